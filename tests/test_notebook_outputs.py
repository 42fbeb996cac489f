"""The notebooks' stored outputs show no absolute path of the machine that ran them.

A traceback, a warning or a printed ``__file__`` stores the author's home, temporary or checkout
folder in the ``.ipynb``: it tells a reader nothing, and differs on every machine. Print a
message, or a path relative to the repository, instead.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))

# Home folders (Linux, macOS, Windows), temporary folders, this checkout's own folder, and any
# absolute path that leads into a checkout (the package, the notebooks, a virtual environment).
MACHINE_PATHS = re.compile(
    r"(?:/home/|/root/|/Users/|/tmp/|/var/folders/|/private/var/|[A-Za-z]:\\+Users\\+|\\AppData\\Local\\Temp"
    + "".join(f"|{re.escape(str(folder).rstrip('/'))}/" for folder in {ROOT, Path(tempfile.gettempdir())})
    + r"|(?<![\w.:/])/(?:[\w.+-]+/)+?(?:ckpt_lab|notebooks|tests|\.venv|site-packages)/)"
)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _texts(value: object) -> list[str]:
    """Every string in an output (its text, its traceback's lines, its data), colour codes removed."""
    if isinstance(value, str):
        return [ANSI.sub("", value)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _texts(v)]
    if isinstance(value, list):
        return [t for v in value for t in _texts(v)]
    return []


def _outputs(notebook: Path) -> list[tuple[int, str]]:
    cells = json.loads(notebook.read_text())["cells"]
    return [(i, text) for i, cell in enumerate(cells) for output in cell.get("outputs", [])
            for text in _texts({k: v for k, v in output.items() if k != "data" or "image/png" not in v})]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[n.name for n in NOTEBOOKS])
def test_no_machine_paths_in_stored_outputs(notebook: Path) -> None:
    found = [(i, m.group(0)) for i, text in _outputs(notebook) for m in MACHINE_PATHS.finditer(text)]
    assert not found, f"{notebook.name}: absolute machine paths in cell outputs (cell, path): {found[:5]}"


def test_the_scan_finds_what_it_looks_for() -> None:
    said = [
        "/home/ana/ckpt_lab/x.py",
        "/tmp/pytest-1/a.py",
        "C:\\Users\\ana\\x.py",
        "/work/main/.venv/lib/python3.11/site-packages/torch/_tensor.py:623",
        "File /srv/checkout/ckpt_lab/explain/zoo.py:100",
        "/Users/ana/x.py",
        f"{ROOT}/ckpt_lab/scope.py",
    ]
    assert all(MACHINE_PATHS.search(text) for text in said)
    assert not MACHINE_PATHS.search("ckpt_lab/scope.py:12 and torch/utils/checkpoint.py")
    assert not MACHINE_PATHS.search("https://github.com/pytorch/pytorch/blob/v2.13.0/torch/utils/checkpoint.py")
