"""The package's layering: ``explain`` is the instrument, ``bench`` the harness, ``cases`` the models
the notebooks study; explain and bench import neither each other nor the cases."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ckpt_lab"


def imported(folder: str) -> set[str]:
    """Every ``ckpt_lab...`` module that a file of ``ckpt_lab/<folder>`` imports (at any depth)."""
    found = set()
    for file in (PACKAGE / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("ckpt_lab")}


PAIRS = [("explain", "bench"), ("bench", "explain"), ("explain", "cases")]


@pytest.mark.parametrize(("folder", "other"), PAIRS)
def test_no_imports_across(folder: str, other: str) -> None:
    across = sorted(name for name in imported(folder) if name.startswith(f"ckpt_lab.{other}"))
    assert not across, f"ckpt_lab/{folder} imports {across}"


def test_the_cases_left_explain() -> None:
    assert not {"zoo.py", "real.py", "examples.py"} & {f.name for f in (PACKAGE / "explain").iterdir()}
    assert {"zoo.py", "real.py", "examples.py", "field.py"} <= {f.name for f in (PACKAGE / "cases").iterdir()}
