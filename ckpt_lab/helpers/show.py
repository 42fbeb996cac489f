"""Show the package's own code inside a notebook, so that a notebook never holds a second copy.

Introduced in notebook 01. ``show_source(reentrant_checkpoint)`` renders the function's source as a
Python code block, under a link to the file and the lines it comes from; ``start`` and ``stop`` cut
it to the lines that teach. Its plain-text form *is* the source, so nbval compares it with the
stored output and fails if the module changed but the notebook was not re-run: what the reader sees
cannot drift.
"""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path
from typing import Any

__all__ = ["Source", "show_source"]

# The checkout's root: a module's path relative to it is what the notebooks (in notebooks/) link to.
_ROOT = Path(__file__).resolve().parents[2]


class Source:
    """Source code that Jupyter renders as a highlighted block (Markdown) and nbval compares as text."""

    def __init__(self, code: str, title: str, where: str = "") -> None:
        self.code = code
        self.title = title
        # "ckpt_lab/scope.py, lines 40-61": where the excerpt comes from ("" if unknown).
        self.where = where

    def _repr_markdown_(self) -> str:
        path = self.where.split(",")[0]
        link = f" — [{self.where}](../{path})" if self.where else ""
        return f"**`{self.title}`**{link}\n\n```python\n{self.code}\n```"

    def __repr__(self) -> str:
        return f"# {self.title}" + (f" ({self.where})" if self.where else "") + f"\n{self.code}"


def show_source(obj: Any, start: str | None = None, stop: str | None = None) -> Source:
    """The source of a function, class or module, optionally only the lines from the first line
    containing ``start`` up to (excluding) the first later line containing ``stop``."""
    lines, first = inspect.getsourcelines(obj)
    lines = "".join(lines).rstrip("\n").splitlines()
    # A module's source starts at line 0 for inspect; count from 1.
    first = max(first, 1)
    if start is not None:
        skip = next(i for i, line in enumerate(lines) if start in line)
        lines, first = lines[skip:], first + skip
    if stop is not None:
        lines = lines[: next(i for i, line in enumerate(lines) if i > 0 and stop in line)]
    module = inspect.getmodule(obj)
    where_module = module.__name__ if module is not None else "?"
    name = getattr(obj, "__qualname__", None)
    title = where_module if name is None or inspect.ismodule(obj) else f"{where_module}.{name}"
    where = ""
    path = Path(inspect.getsourcefile(obj) or "").resolve()
    # Only the package's own files get a link (torch's are elsewhere on every machine).
    if path.is_relative_to(_ROOT / "ckpt_lab"):
        where = f"{path.relative_to(_ROOT).as_posix()}, lines {first}–{first + len(lines) - 1}"
    # A slice of a method keeps its class-body indentation; show it flush left.
    return Source(textwrap.dedent("\n".join(lines)).rstrip(), title, where)
