"""Notebook 04's drafts, assembled into exercise 04-scope's reference solution.

Notebook 04 builds the scope in four drafts, (a) to (d), in code cells tagged ``04-scope-draft``
(``# %% tags=["04-scope-draft"]`` in the paired script); a later draft redefines what it changes
(``Replayer``, ``gradient_checkpoint_scope``, ``scope_tensor_died``). Assembled in the notebook's order, each
name kept at its last definition only, they are the reference solution
(``ckpt_lab/exercises/ex04_scope/solution.py``): tests/test_notebook_drafts.py grades the assembly and
checks that the solution is it. After editing a draft in ``notebooks/src/04_checkpoint_scope.py``:

    python3 tools/notebook_drafts.py          # rewrite the solution from the notebook's drafts
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "src" / "04_checkpoint_scope.py"
SOLUTION = ROOT / "ckpt_lab" / "exercises" / "ex04_scope" / "solution.py"
TAG = "04-scope-draft"
HEADER = '''"""Exercise 04-scope, reference solution: notebook 04's drafts (a) to (d), each name at its last
definition, assembled by tools/notebook_drafts.py (edit notebooks/src/04_checkpoint_scope.py, then run it)."""

'''


def draft_cells(source: str) -> list[str]:
    """The code cells of a jupytext percent script tagged as drafts, in order."""
    cells = []
    for chunk in source.split("\n# %%")[1:]:
        header, _, body = chunk.partition("\n")
        if "[markdown]" not in header and f'"{TAG}"' in header:
            cells.append(body)
    return cells


def _blocks(cell: str) -> list[tuple[str | None, str]]:
    """(name defined or None, its source with the comments above it) per top-level statement; the
    imports at the top of a cell stay one block."""
    lines, blocks, start = cell.splitlines(), [], 0
    for node in ast.parse(cell).body:
        text = "\n".join(lines[start : node.end_lineno]).strip("\n")
        gap = "\n" * (start > 0 and not lines[start].strip())  # a blank line between import groups
        start = node.end_lineno
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            name = node.name
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        else:
            name = None
        imports = isinstance(node, ast.Import | ast.ImportFrom)
        if imports and blocks and blocks[-1][0] == "<imports>":
            blocks[-1] = ("<imports>", blocks[-1][1] + "\n" + gap + text)
        else:
            blocks.append(("<imports>" if imports else name, text))
    return blocks


def assemble(source: str) -> str:
    """The drafts as one module: every block in order, a name only at its last definition."""
    blocks = [block for cell in draft_cells(source) for block in _blocks(cell)]
    last = {name: i for i, (name, _) in enumerate(blocks) if name not in (None, "<imports>")}
    kept = [text for i, (name, text) in enumerate(blocks) if name in (None, "<imports>") or last[name] == i]
    return HEADER + "\n\n\n".join(kept) + "\n"


if __name__ == "__main__":
    text = assemble(NOTEBOOK.read_text())
    if "--check" in sys.argv:
        sys.exit(0 if SOLUTION.read_text() == text else f"{SOLUTION} differs from the notebook's drafts")
    SOLUTION.write_text(text)
    print(f"wrote {SOLUTION.relative_to(ROOT)}: {len(text.splitlines())} lines")
