"""The unit tests under another torch: ``make compat TORCH=2.14.1`` (this script).

    python3 tools/compat.py --torch 2.14.1             # build or reuse the environment, run tests/
    python3 tools/compat.py --torch 2.11.0 --python python3.12
    python3 tools/compat.py --torch 2.14.1 --dry-run   # print the commands, run nothing
    python3 tools/compat.py --interpreter .venv/bin/python --tests tests/test_grad_rule.py
                                                        # no environment: that interpreter's torch

A virtual environment with ``torch==VERSION`` and the rest of requirements.txt as pinned lives
outside the checkout, in ``${XDG_CACHE_HOME:-~/.cache}/ckpt_lab/venv-torch-VERSION-pyX.Y`` (or
``--venv``), and is reused by later runs (rebuilt when requirements.txt's pins change). The unit
tests run there with the checkout on ``PYTHONPATH`` (no install of ckpt_lab: no egg-info, no build
folder) from a temporary working directory (hypothesis's database and pytest's files land there,
bytecode under it too), so the checkout is left as it was; the script checks that with git and
fails if anything appeared. nbval is not run: the notebooks' stored outputs belong to the pinned
torch. The summary: torch and Python versions, what pip says about the pins, passed / failed /
skipped per test file, and how long the install and the tests took.

torch goes in first, then the pinned rest with ``torch==VERSION`` again (so that pip's resolver can
never swap torch for a release that suits the pins). Where a pin contradicts torch's own
requirements (torch 2.11 wants setuptools < 82; requirements.txt pins 84.2.1 for the notebooks'
torchviz), torch's requirement wins, and the summary says so. A run whose environment ends up with
another torch than asked for fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ckpt_lab"


def pinned_rest(requirements: Path) -> list[str]:
    """requirements.txt's lines but torch's (and comments)."""
    rest = []
    for line in requirements.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        name = line.split("==")[0].split(">")[0].split("<")[0].split("[")[0].strip().lower()
        if line and name != "torch":
            rest.append(line)
    return rest


def python_version(python: str) -> str:
    out = subprocess.run(
        [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def git_state(folder: Path) -> set[str] | None:
    """Every path git sees as changed, untracked or ignored (None outside a git checkout)."""
    if shutil.which("git") is None or not (folder / ".git").exists():
        return None
    out = subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "--untracked-files=normal"],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    return set(out.stdout.splitlines()) if out.returncode == 0 else None


def run(
    cmd: list[str], dry: bool, show: list[str] | None = None, **kwargs
) -> subprocess.CompletedProcess | None:
    env = kwargs.get("env")
    shown = shlex.join(show or cmd)
    if env is not None:
        extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(extra.items())) + " " + shown
    if "cwd" in kwargs:
        shown = f"(cd {shlex.quote(str(kwargs['cwd']))} && {shown})"
    print(f"+ {shown}", flush=True)
    if dry:
        return None
    return subprocess.run(cmd, **kwargs)


def per_file(junit: Path) -> dict[str, Counter]:
    """Outcomes per test file, from pytest's JUnit XML."""
    counts: dict[str, Counter] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        where = "?"
        # classname is the module's dotted path, then any class: the longest prefix that is a file.
        for i in range(len(parts), 0, -1):
            candidate = "/".join(parts[:i]) + ".py"
            if (CHECKOUT / candidate).is_file():
                where = candidate
                break
        tags = {child.tag: child for child in case}
        if "failure" in tags:
            outcome = "failed"
        elif "error" in tags:
            outcome = "error"
        elif "skipped" in tags:
            outcome = "xfailed" if tags["skipped"].get("type") == "pytest.xfail" else "skipped"
        else:
            outcome = "passed"
        counts.setdefault(where, Counter())[outcome] += 1
    return counts


def table(counts: dict[str, Counter]) -> str:
    width = max([len(f) for f in counts] + [len("total")])
    lines = [f"{'file':<{width}}  " + "  ".join(f"{o:>7}" for o in OUTCOMES)]
    total: Counter = Counter()
    for name in sorted(counts):
        total.update(counts[name])
        lines.append(f"{name:<{width}}  " + "  ".join(f"{counts[name][o]:>7}" for o in OUTCOMES))
    lines.append(f"{'total':<{width}}  " + "  ".join(f"{total[o]:>7}" for o in OUTCOMES))
    return "\n".join(lines)


# Run inside the environment (pip's own copy of packaging is there): which pins of the rest contradict
# what the installed torch itself requires, and torch's requirement for each.
_CONFLICTS = """
import json, sys, importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name as canon
own = [Requirement(r) for r in md.requires("torch") or []]
own = [r for r in own if r.marker is None or r.marker.evaluate({"extra": ""})]
found = {}
for pin in json.loads(sys.argv[1]):
    p = Requirement(pin)
    version = next(iter(p.specifier)).version if len(p.specifier) == 1 else None
    for r in own:
        if canon(r.name) == canon(p.name) and version and not r.specifier.contains(version, prereleases=True):
            found[pin] = str(r).split(";")[0].strip()
print(json.dumps(found))
"""


def ensure_venv(args: argparse.Namespace, venv: Path) -> tuple[str, float, str, dict[str, str]]:
    """Build (or reuse) the environment; returns its python, the install's seconds, what pip check
    says, and the pins that gave way to torch's own requirements."""
    python = str(venv / "bin" / "python")
    rest = pinned_rest(CHECKOUT / "requirements.txt")
    stamp_text = json.dumps({"torch": args.torch, "rest": rest, "recipe": 2}, sort_keys=True)
    digest = hashlib.sha256(stamp_text.encode()).hexdigest()[:16]
    stamp = venv / ".ckpt_lab-compat"
    replaced_file = venv / "replaced-pins.json"
    if not args.dry_run and stamp.is_file() and stamp.read_text().strip() == digest:
        print(f"reusing {venv} (torch {args.torch}, requirements.txt's pins unchanged)", flush=True)
        replaced = json.loads(replaced_file.read_text()) if replaced_file.is_file() else {}
        return python, 0.0, "", replaced
    start = time.perf_counter()
    if args.dry_run or not Path(python).is_file():
        run([args.python, "-m", "venv", str(venv)], args.dry_run, check=True)
    pip = [python, "-m", "pip", "install", "--quiet"]
    # torch first, with its own requirements.
    run([*pip, f"torch=={args.torch}"], args.dry_run, check=True)
    # Then the rest as pinned, except where a pin contradicts torch's own requirement (torch 2.11 wants
    # setuptools < 82): there torch's wins, since torch is what is under test. torch==VERSION goes in
    # again so that the resolver can never swap torch for a release that suits the pins.
    found = run(
        [python, "-c", _CONFLICTS, json.dumps(rest)],
        args.dry_run,
        show=[python, "-c", "<tools/compat.py: _CONFLICTS>", json.dumps(rest)],
        capture_output=True,
        text=True,
    )
    replaced: dict[str, str] = {}
    if found is not None:
        if found.returncode != 0:
            raise SystemExit(f"could not read torch {args.torch}'s requirements:\n{found.stderr}")
        replaced = json.loads(found.stdout)
    effective = [replaced.get(pin, pin) for pin in rest] + [f"torch=={args.torch}"]
    rest_file = venv / "requirements-rest.txt"
    if args.dry_run:
        print(
            f"# {rest_file}: {' '.join(effective)} (pins that contradict torch's own requirements replaced)"
        )
    else:
        rest_file.write_text("\n".join(effective) + "\n")
    run([*pip, "-r", str(rest_file)], args.dry_run, check=True)
    checked = run([python, "-m", "pip", "check"], args.dry_run, capture_output=True, text=True)
    said = "" if checked is None else (checked.stdout + checked.stderr).strip()
    if not args.dry_run:
        got = run(
            [python, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
            False,
            capture_output=True,
            text=True,
        )
        if got.stdout.strip().split("+")[0] != args.torch:
            raise SystemExit(f"{venv} ended up with torch {got.stdout.strip()}, not {args.torch}")
        replaced_file.write_text(json.dumps(replaced) + "\n")
        stamp.write_text(digest + "\n")
    return python, time.perf_counter() - start, said, replaced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", help="the torch version to install (e.g. 2.14.1)")
    parser.add_argument("--python", default=sys.executable, help="the Python the environment is made from")
    parser.add_argument("--venv", type=Path, help="where the environment lives (default: under the cache)")
    parser.add_argument(
        "--interpreter", help="run the tests with this Python as it is: no environment, nothing installed"
    )
    parser.add_argument("--tests", nargs="+", default=["tests"], help="what pytest runs (default tests/)")
    parser.add_argument("--pytest-args", default="", help="more arguments for pytest, one string")
    parser.add_argument("--json", type=Path, help="also write the summary as JSON here")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    if not args.torch and not args.interpreter:
        parser.error("give --torch VERSION (make compat TORCH=2.14.1), or --interpreter PYTHON")

    start = time.perf_counter()
    install_s, pip_said, replaced = 0.0, "", {}
    if args.interpreter:
        python = args.interpreter
        where = f"the interpreter {python}, as it is"
    else:
        pyver = python_version(args.python)
        venv = args.venv or cache_root() / f"venv-torch-{args.torch}-py{pyver}"
        if inside(venv, CHECKOUT):
            parser.error(f"{venv} is inside the checkout: the environment must live outside it")
        where = str(venv)
        print(f"environment: {venv} (torch=={args.torch}, Python {pyver})", flush=True)
        python, install_s, pip_said, replaced = ensure_venv(args, venv)

    before = git_state(CHECKOUT)
    scratch = Path(tempfile.mkdtemp(prefix="ckpt_lab-compat-"))
    try:
        junit = scratch / "junit.xml"
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(CHECKOUT), *filter(None, [os.environ.get("PYTHONPATH")])]),
            # Bytecode of the checkout's modules goes to the scratch folder, not into __pycache__/.
            PYTHONPYCACHEPREFIX=str(scratch / "pycache"),
            MPLBACKEND="Agg",
        )
        cmd = [
            python,
            "-m",
            "pytest",
            # pyproject's options (no cache provider, tests/ on the path), from a scratch folder: the
            # files hypothesis and pytest write to the working directory land there.
            "-c",
            str(CHECKOUT / "pyproject.toml"),
            "--rootdir",
            str(CHECKOUT),
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *shlex.split(args.pytest_args),
            *[str(CHECKOUT / t) for t in args.tests],
        ]
        versions = run(
            [python, "-c", "import sys, torch; print(torch.__version__, '%d.%d.%d' % sys.version_info[:3])"],
            args.dry_run,
            capture_output=True,
            text=True,
            env=env,
            cwd=scratch,
        )
        test_start = time.perf_counter()
        tests = run(cmd, args.dry_run, env=env, cwd=scratch)
        test_s = time.perf_counter() - test_start
        if args.dry_run:
            print("dry run: nothing was installed or run")
            return 0
        counts = per_file(junit) if junit.is_file() else {}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    after = git_state(CHECKOUT)
    appeared = sorted(after - before) if before is not None and after is not None else []

    torch_version, py = [*versions.stdout.split(), "?", "?"][:2] if versions.returncode == 0 else ("?", "?")
    if args.torch and torch_version.split("+")[0] != args.torch:
        print(f"the environment has torch {torch_version}, not {args.torch}: its results would mislead")
        return 1
    total = sum(counts.values(), Counter())
    summary = {
        "torch": torch_version,
        "python": py,
        "environment": where,
        "pip_check": pip_said,
        "pins_replaced_by_torch_requirements": replaced,
        "per_file": {k: dict(v) for k, v in sorted(counts.items())},
        "total": dict(total),
        "install_seconds": round(install_s, 1),
        "test_seconds": round(test_s, 1),
        "total_seconds": round(time.perf_counter() - start, 1),
        "pytest_exit_code": tests.returncode,
        "checkout_changes": appeared,
    }
    print(f"\n===== compat summary: torch {torch_version}, Python {py} =====")
    print(f"environment: {where}")
    for pin, own in replaced.items():
        print(f"pinned {pin} gave way to torch {torch_version}'s own requirement {own}")
    if pip_said and "No broken requirements" not in pip_said:
        print(f"pip check:\n  {pip_said}")
    print(table(counts) if counts else "no test results (pytest wrote no report)")
    print(
        f"install {install_s:.0f} s, tests {test_s:.0f} s, total {summary['total_seconds']:.0f} s; "
        f"pytest exit code {tests.returncode}"
    )
    if appeared:
        print("the checkout changed (it must not):\n  " + "\n  ".join(appeared))
    else:
        print("checkout unchanged" if before is not None else "checkout not checked (not a git checkout)")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if appeared else tests.returncode


if __name__ == "__main__":
    sys.exit(main())
