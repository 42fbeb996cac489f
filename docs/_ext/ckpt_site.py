"""The course site's own Sphinx extension: what the notebooks write for JupyterLab, made to work on the site.

* ``<a id="peak"></a>`` (the glossary's and notebooks' anchors) become explicit targets, so links to
  ``glossary.md#peak`` or ``#c1`` resolve (and warn when dead) like any heading's.
* JupyterLab's heading anchors (``#9.-Where-checkpointing-saves-nothing``: the heading's text with
  ``-`` for spaces) are mapped to the heading's own id on the site.
* Links to the package's source (``../ckpt_lab/reentrant.py``) land on the site's page of that module's
  source (viewcode's ``_modules/ckpt_lab/reentrant.html``); every module under ckpt_lab/ gets one.
* A section whose title starts with "Appendix" is marked optional.
* The exercises page is generated from ``ckpt_lab.exercises.EXERCISES``: statement, stub, how to check,
  and the reference solution folded (absent with ``-t students``).
* The allow-list of warnings: the build (``-W``) fails on every warning except those listed in
  ``ALLOWED_WARNINGS``, each with its reason.
"""

from __future__ import annotations

import inspect
import logging
import os
import posixpath
import re
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.transforms import SphinxTransform
from sphinx.util.osutil import relative_uri

ROOT = Path(__file__).resolve().parents[2]

# (pattern found in the warning's text, why it is allowed). Everything else fails the build.
ALLOWED_WARNINGS: list[tuple[str, str]] = [
    (
        r"^Lexing literal_block .* as \"ipythontb\" resulted in an error",
        "IPython's traceback lexer stops at a backtick in a stored CheckpointError message (notebook 07 "
        "§8); Sphinx retries in relaxed mode and the page shows the whole traceback, highlighted",
    ),
]


class _AllowList(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        text = record.getMessage()
        return not any(re.search(pattern, text) for pattern, _ in ALLOWED_WARNINGS)


# markdown-it hands `<a id="peak"></a>` over as two inline HTML tokens, `<a id="peak">` and `</a>`.
_ANCHOR = re.compile(r'^\s*<a\s+(?:id|name)="([^"]+)"\s*>\s*(</a>)?\s*$')
_ABSOLUTE = re.compile(r"File /\S*?/(?:site-packages/)?(?=(?:ckpt_lab|torch|transformers|IPython)/)")
_SOURCE = re.compile(r"^(?:\.\./)*(ckpt_lab/[\w/]+)\.py$")


def _jupyter_anchor(title: str) -> str:
    """JupyterLab's (and GitHub's notebook viewer's) anchor for a heading: its text, spaces as '-'."""
    return "-".join(title.split())


def source_page(module_path: str) -> str:
    """``ckpt_lab/explain/zoo`` -> viewcode's page name ``_modules/ckpt_lab/explain/zoo``."""
    if module_path.endswith("/__init__"):
        module_path = module_path[: -len("/__init__")]
    return posixpath.join("_modules", module_path)


class NotebookLinks(SphinxTransform):
    """Runs after parsing, before myst resolves `#id` links (879) and Sphinx collects labels."""

    default_priority = 250

    def apply(self, **kwargs: Any) -> None:
        docname = self.env.docname
        self._html_anchors(docname)
        self._jupyter_heading_anchors(docname)
        self._notebook_docs()
        self._source_links(docname)
        self._tracebacks()
        self._optional_appendices()

    def _html_anchors(self, docname: str) -> None:
        for raw in list(self.document.findall(nodes.raw)):
            if raw.get("format") != "html":
                continue
            match = _ANCHOR.match(raw.astext())
            if not match:
                continue
            name = match.group(1)
            if match.group(2) is None:
                closing = raw.next_node(descend=False, siblings=True)
                if not (isinstance(closing, nodes.raw) and closing.astext().strip() == "</a>"):
                    continue  # an <a> around text: left as it is
                closing.parent.remove(closing)
            target = nodes.target("", "", ids=[name], names=[name])
            raw.replace_self(target)
            self.document.note_explicit_target(target, target)

    def _jupyter_heading_anchors(self, docname: str) -> None:
        slugs = getattr(self.document, "myst_slugs", None)
        if slugs is None:
            slugs = self.document.myst_slugs = {}
        for section in self.document.findall(nodes.section):
            title = section.next_node(nodes.title)
            if title is None or not section["ids"]:
                continue
            text = title.astext()
            anchor = _jupyter_anchor(text)
            if anchor not in slugs:
                slugs[anchor] = (section.line, section["ids"][0], text)
        self.env.metadata[docname]["myst_slugs"] = slugs

    def _notebook_docs(self) -> None:
        """docs/notebooks is a link to ../notebooks; myst resolves a notebook's link to its neighbour through
        it, to the real path, which is no document name: map it back to ``notebooks/NAME``."""
        real = str((ROOT / "notebooks").resolve()) + os.sep
        for node in self.document.findall(addnodes.pending_xref):
            target = node.get("reftarget", "")
            if node.get("refdomain") == "doc" and target.startswith(real):
                node["reftarget"] = "notebooks/" + target[len(real) :]

    def _tracebacks(self) -> None:
        """Stored tracebacks name the files of the machine that ran the notebook; show them relative to
        the checkout (``ckpt_lab/nonreentrant.py``) and to site-packages (``torch/autograd/graph.py``)."""
        for block in list(self.document.findall(nodes.literal_block)):
            text = block.astext()
            if "Traceback" not in text or "File /" not in text:
                continue
            new = _ABSOLUTE.sub("File ", text)
            block.replace_self(nodes.literal_block(new, new, **block.attributes))

    def _source_links(self, docname: str) -> None:
        here = self.app.builder.get_target_uri(docname)
        # A markdown cell's link arrives as a pending reference; a link in a stored Markdown output
        # (``helpers.show``'s "ckpt_lab/grad_rule.py, lines 60-64") as a plain reference.
        candidates = [
            *self.document.findall(addnodes.pending_xref),
            *self.document.findall(addnodes.download_reference),
            *(n for n in self.document.findall(nodes.reference) if "refuri" in n),
        ]
        for node in candidates:
            match = _SOURCE.match(node.get("reftarget") or node.get("refuri") or "")
            if not match:
                continue
            path = match.group(1)
            if not (ROOT / f"{path}.py").is_file():
                continue  # left to myst, which reports it
            uri = relative_uri(here, source_page(path) + ".html")
            ref = nodes.reference("", "", internal=True, refuri=uri, classes=["ckpt-source"])
            ref += node.children
            node.replace_self(ref)

    def _optional_appendices(self) -> None:
        for section in self.document.findall(nodes.section):
            title = section.next_node(nodes.title)
            if title is None or not title.astext().startswith("Appendix"):
                continue
            if section.parent is self.document:
                continue  # the appendix notebooks (02b, 04b) say so in their own first paragraph
            note = nodes.note(
                "",
                nodes.paragraph(
                    "", "Optional: the notebook is complete without this appendix; read it when you need it."
                ),
                classes=["ckpt-optional"],
            )
            section.insert(section.index(title) + 1, note)


# ------------------------------------------------------------------------ every module gets a source page
def source_modules(students: bool) -> list[str]:
    """Every module under ckpt_lab/, by name; for students, without the exercises' reference solutions."""
    names = []
    for path in sorted((ROOT / "ckpt_lab").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        # an exercise's folder: its reference solution, and its mistakes (each a one-line change of it)
        answer = name.startswith("ckpt_lab.exercises.ex") and parts[-1] in ("solution", "mistakes")
        if not (students and answer):
            names.append(name)
    return names


def _add_source_pages(app: Sphinx) -> list:
    """viewcode writes a page for the modules autodoc documented; add the rest (before viewcode runs)."""
    from sphinx.pycode import ModuleAnalyzer

    env = app.env
    modules = env._viewcode_modules if hasattr(env, "_viewcode_modules") else {}
    env._viewcode_modules = modules  # type: ignore[attr-defined]
    for name in source_modules(app.tags.has("students")):
        if modules.get(name):
            continue
        analyzer = ModuleAnalyzer.for_module(name)
        analyzer.find_tags()
        modules[name] = (analyzer.code, analyzer.tags, {}, name)
    return []


_BACKLINK = re.compile(r'(class="viewcode-back" href="[^"#]*#)([\w.]+)"')


def _fix_backlinks(app: Sphinx, pagename: str, templatename: str, context: dict, doctree: Any) -> None:
    """viewcode keeps one documented name per source module, so the "[docs]" links of a module documented
    under two names (``ckpt_lab.selective_checkpoint``, ``ckpt_lab.selective.Decision``) point the
    second kind at anchors that do not exist: point each at the name it is documented under."""
    if not pagename.startswith("_modules/") or "body" not in context:
        return
    modname = pagename[len("_modules/") :].replace("/", ".")
    entry = getattr(app.env, "_viewcode_modules", {}).get(modname)
    if not entry:
        return
    refname = entry[3]
    documented = app.env.get_domain("py").objects

    def fix(match: re.Match) -> str:
        anchor = match.group(2)
        if anchor in documented or not anchor.startswith(refname + "."):
            return match.group(0)
        own = f"{modname}.{anchor[len(refname) + 1 :]}"
        return f'{match.group(1)}{own}"' if own in documented else match.group(0)

    context["body"] = _BACKLINK.sub(fix, context["body"])


# ------------------------------------------------------------------------------------- the exercises page
def exercises_markdown(students: bool) -> str:
    """The exercises, one section each, from the package's registry (names, notebooks, stubs, solutions)."""
    from ckpt_lab.exercises import EXERCISES

    docs = ROOT / "docs"
    out = []
    for ex in EXERCISES.values():
        grader = inspect.getmodule(ex.checks)
        statement = inspect.cleandoc(grader.__doc__ or "") if grader is not None else ""
        title, _, body = statement.partition("\n\n")
        # "Exercise 01: predict ..." -> "predict ...": sphinx-exercise numbers the box itself
        title = re.sub(r"^Exercise \w+:\s*", "", title.replace("\n", " "))
        stub = os.path.relpath(ex.stub_path, docs)
        solution = os.path.relpath(ex.solution_path, docs)
        label = f"ex-{ex.name}"
        nb = next(iter(sorted((ROOT / "notebooks").glob(f"{ex.notebook}_*.ipynb"))), None)
        taught = f"[notebook {ex.notebook}](notebooks/{nb.name}) {ex.section}" if nb else ex.where_taught
        out += [
            f"({ex.name})=",
            f"## `{ex.name}`",
            "",
            # colon fences: a backtick fence's title may not hold backticks, and the statements' do
            f":::::{{exercise}} {title.rstrip('.') or ex.name}",
            f":label: {label}",
            ":nonumber:",
            "",
            f"**Taught in** {taught}. **Your file defines** {ex.defines}.",
            "",
            body,
            "",
            f"**What is graded**: {ex.grades}.",
            "",
            f"**The stub** (`notebooks/exercises/{ex.file_name}`; a fresh copy: "
            f"`python -m ckpt_lab.exercises stubs DIR {ex.name}`):",
            "",
            f"```{{literalinclude}} {stub}",
            ":language: python",
            "```",
            "",
            "**How to check it**, in the notebook's \"Your turn\" cell or from a shell:",
            "",
            "```python",
            "from ckpt_lab.exercises import check",
            f'check("{ex.name}", "exercises/{ex.file_name}")',
            "```",
            "",
            "```text",
            f"python -m ckpt_lab.exercises check {ex.name} notebooks/exercises/{ex.file_name}",
            "```",
            ":::::",
            "",
        ]
        if not students:
            out += [
                f":::::{{solution}} {label}",
                ":class: dropdown",
                "",
                f"The reference solution (`{os.path.relpath(ex.solution_path, ROOT)}`), graded by the same "
                "checks in the tests:",
                "",
                f"```{{literalinclude}} {solution}",
                ":language: python",
                "```",
                ":::::",
                "",
            ]
    return "\n".join(out)


def exercise_table() -> str:
    """One row per exercise: name (linked to its section of the exercises page), notebook, what the
    learner's file defines, what is graded."""
    from ckpt_lab.exercises import EXERCISES

    rows = [
        "| exercise | notebook | the learner's file defines | what is graded |",
        "|---|---|---|---|",
    ]
    for ex in EXERCISES.values():
        rows.append(
            f"| [`{ex.name}`](exercises.md#{ex.name}) | {ex.notebook} {ex.section} "
            f"| {ex.defines} | {ex.grades} |"
        )
    return "\n".join(rows)


_MARKERS = {
    "<!-- the exercises, generated by docs/_ext/ckpt_site.py -->": lambda app: exercises_markdown(
        app.tags.has("students")
    ),
    "<!-- the exercise table, generated by docs/_ext/ckpt_site.py -->": lambda app: exercise_table(),
}


def _source_read(app: Sphinx, docname: str, source: list[str]) -> None:
    for marker, make in _MARKERS.items():
        if marker in source[0]:
            source[0] = source[0].replace(marker, make(app))


def _always_generated(app: Sphinx, env: Any, added: set, changed: set, removed: set) -> list[str]:
    """The pages generated from ckpt_lab.exercises are read again on every build: their source file does
    not change when the registry does."""
    return [name for name in ("exercises", "teachers") if name in env.found_docs]


def setup(app: Sphinx) -> dict[str, Any]:
    allow = _AllowList()
    for handler in logging.getLogger("sphinx").handlers:
        handler.filters.insert(0, allow)
    app.add_transform(NotebookLinks)
    app.connect("source-read", _source_read)
    app.connect("env-get-outdated", _always_generated)
    app.connect("html-collect-pages", _add_source_pages, priority=400)
    app.connect("html-page-context", _fix_backlinks)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
