"""The course site (``make site``): it builds with no warning outside the allow-list, and every link and
anchor in its HTML lands somewhere on the site.

The build runs Sphinx from the site's own environment (``.venv-site``, made by ``make site-setup``, which
``make test`` runs first) into a temporary folder, so the checkout stays clean. Without that
environment the test fails and says how to make it: CI must build the site, never skip it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE_PYTHON = ROOT / ".venv-site" / "bin" / "python"
# What a page may link to outside the site: the web. Anything else (file:, a path out of the build,
# javascript:) is a link that works on the author's machine only.
EXTERNAL = ("http", "https", "mailto")
# Links the theme writes that are not pages (its own search and index pages are checked like the rest).
LINK_ATTRS = {"a": "href", "link": "href", "img": "src", "script": "src", "iframe": "src", "source": "src"}


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        for key in ("id", "name"):
            if values.get(key):
                self.ids.add(values[key])
        attr = LINK_ATTRS.get(tag)
        if attr and values.get(attr) is not None:
            self.links.append((tag, values[attr]))


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def dead_links(site: Path) -> list[str]:
    """Every link in the site's HTML that leads nowhere: ``page: link (why)``."""
    # _static/ holds the theme's assets, its Jinja macro files among them: not pages.
    pages = {p: _parse(p) for p in sorted(site.rglob("*.html")) if "_static" not in p.relative_to(site).parts}
    dead = []
    for page, parsed in pages.items():
        where = page.relative_to(site)
        for tag, link in parsed.links:
            parts = urlsplit(link)
            if parts.scheme in EXTERNAL:
                continue
            if parts.scheme or parts.netloc:
                dead.append(f"{where}: {link} (leaves the site)")
                continue
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_relative_to(site.resolve()) and not target.is_relative_to(site):
                dead.append(f"{where}: {link} (leaves the site)")
                continue
            if not target.exists():
                dead.append(f"{where}: {link} (no such file)")
                continue
            if parts.fragment and tag == "a" and target.suffix == ".html":
                anchor = unquote(parts.fragment)
                ids = pages[target].ids if target in pages else _parse(target).ids
                if anchor not in ids:
                    dead.append(f"{where}: {link} (no anchor #{anchor} there)")
    return dead


def _build(out: Path, *tags: str) -> subprocess.CompletedProcess:
    if not SITE_PYTHON.exists():
        pytest.fail(
            f"the site's environment {SITE_PYTHON.parent.parent} is missing: run `make site-setup` "
            "(make test does it first)"
        )
    command = [str(SITE_PYTHON), "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q"]
    for tag in tags:
        command += ["-t", tag]
    command += ["-d", str(out / "doctrees"), str(ROOT / "docs"), str(out / "html")]
    env = dict(os.environ, CKPT_LAB_VENV=str(Path(sys.prefix)))
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    started = time.perf_counter()
    build = _build(out)
    seconds = time.perf_counter() - started
    # -W: any warning outside docs/_ext/ckpt_site.py's ALLOWED_WARNINGS fails the build, and says which.
    assert build.returncode == 0, f"the site's build failed:\n{build.stderr[-6000:]}"
    print(f"site built in {seconds:.0f} s")
    return out / "html"


def test_every_link_and_anchor_lands_on_the_site(site: Path) -> None:
    dead = dead_links(site)
    assert not dead, f"{len(dead)} dead links:\n" + "\n".join(dead[:50])


def test_every_page_is_there(site: Path) -> None:
    """The landing page, one page per notebook, the glossary, the exercises, the API reference, the
    results pages, and a source page for every module the notebooks link to."""
    expected = ["index", "exercises", "api", "teachers", "engineers", "maintainers", "results/index"]
    expected += [f"notebooks/{p.stem}" for p in (ROOT / "notebooks").glob("[0-9]*.ipynb")]
    expected += ["notebooks/glossary"]
    expected += [f"results/{p.stem}" for p in (ROOT / "docs" / "results").glob("*.md")]
    missing = [name for name in expected if not (site / f"{name}.html").is_file()]
    assert not missing, missing
    for module in (ROOT / "ckpt_lab").rglob("*.py"):
        rel = module.relative_to(ROOT).with_suffix("")
        page = site / "_modules" / (rel.parent if rel.name == "__init__" else rel)
        assert page.with_suffix(".html").is_file(), f"no source page for {module.relative_to(ROOT)}"


def test_the_notebooks_links_land_where_jupyterlab_s_do(site: Path) -> None:
    """JupyterLab's heading anchors, `<a id>` anchors and ../ckpt_lab/*.py links, mapped: each one
    points at the element (or the source page) it names in JupyterLab."""
    nb05 = (site / "notebooks" / "05_selective_and_planner.html").read_text()
    nb02 = _parse(site / "notebooks" / "02_reentrant_checkpoint.html")
    # 05 links to 02's "9. Where checkpointing saves nothing" by JupyterLab's anchor for that heading
    assert "#9.-Where-checkpointing-saves-nothing" not in nb05
    assert "saves-nothing" in nb02.ids
    glossary = _parse(site / "notebooks" / "glossary.html")
    assert {"peak", "leaf", "pack-unpack", "graph-task"} <= glossary.ids
    nb07 = (site / "notebooks" / "07_why_memory_did_not_drop.html").read_text()
    assert "../_modules/ckpt_lab/cases/zoo.html" in nb07
    assert "/work/" not in nb07  # stored tracebacks name the checkout's files relative to it


def test_the_exercises_page_lists_every_exercise_with_its_stub_and_folded_solution(site: Path) -> None:
    from ckpt_lab.exercises import EXERCISES

    page = (site / "exercises.html").read_text()
    for ex in EXERCISES.values():
        assert ex.name in page
        assert f"python -m ckpt_lab.exercises check {ex.name}" in page
        first_stub_line = next(line for line in ex.stub_path.read_text().splitlines() if line.strip())
        assert first_stub_line.split()[0] in page
    assert page.count('class="solution') >= len(EXERCISES)
    assert "dropdown" in page


def test_the_students_site_has_no_solutions() -> None:
    """``make site STUDENT=1`` (``sphinx-build -t students``) writes the exercises page without a single
    reference solution: checked on the page's source as the site's extension generates it (a second
    build would double this test's time)."""
    from ckpt_lab.exercises import EXERCISES

    script = (
        "import sys, site; sys.path[:0] = [sys.argv[1], sys.argv[2]]; site.addsitedir(sys.argv[3]);"
        "import ckpt_site; print(ckpt_site.exercises_markdown(students=True)); print('=====');"
        "print(ckpt_site.exercises_markdown(students=False)); print('=====');"
        "print(*ckpt_site.source_modules(students=True)); print('=====');"
        "print(*ckpt_site.source_modules(students=False))"
    )
    packages = next((Path(sys.prefix) / "lib").glob("python*/site-packages"))
    if not SITE_PYTHON.exists():
        pytest.fail("the site's environment is missing: run `make site-setup`")
    run = subprocess.run(
        [str(SITE_PYTHON), "-c", script, str(ROOT / "docs" / "_ext"), str(ROOT), str(packages)],
        capture_output=True,
        text=True,
        check=True,
    )
    students, default, student_sources, sources = run.stdout.split("=====")
    assert "{solution}" not in students and "solutions" not in students
    assert default.count("{solution}") == len(EXERCISES)
    for ex in EXERCISES.values():
        assert "{exercise}" in students and ex.stub_path.name in students
    # nor a source page of a solution
    answers = {f"ckpt_lab.exercises.ex{ex.file_name.removesuffix('.py')}.{part}" for ex in EXERCISES.values()
               for part in ("solution", "mistakes")}
    assert answers & set(sources.split()) and not answers & set(student_sources.split())
    assert "ckpt_lab.exercises" in student_sources.split()
    conf = (ROOT / "docs" / "conf.py").read_text()
    assert 'hide_solutions = tags.has("students")' in conf
