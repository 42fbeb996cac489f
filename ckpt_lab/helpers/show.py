"""Show the package's own code inside a notebook, so that a notebook never holds a second copy.

Introduced in notebook 01. ``show_source(reentrant_checkpoint)`` renders the function's source as a
Python code block. Its plain-text form *is* the source, so nbval compares it with the stored output
and fails if the module changed but the notebook was not re-run: what the reader sees cannot drift.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any

__all__ = ["Source", "show_source"]


class Source:
    """Source code that Jupyter renders as a highlighted block (Markdown) and nbval compares as text."""

    def __init__(self, code: str, title: str) -> None:
        self.code = code
        self.title = title

    def _repr_markdown_(self) -> str:
        return f"**`{self.title}`**\n\n```python\n{self.code}\n```"

    def __repr__(self) -> str:
        return f"# {self.title}\n{self.code}"


def show_source(obj: Any, start: str | None = None, stop: str | None = None) -> Source:
    """The source of a function, class or module, optionally only the lines from the first line
    containing ``start`` up to (excluding) the first later line containing ``stop``."""
    lines = inspect.getsource(obj).rstrip("\n").splitlines()
    if start is not None:
        lines = lines[next(i for i, line in enumerate(lines) if start in line) :]
    if stop is not None:
        lines = lines[: next(i for i, line in enumerate(lines) if i > 0 and stop in line)]
    module = inspect.getmodule(obj)
    where = module.__name__ if module is not None else "?"
    name = getattr(obj, "__qualname__", None)
    title = where if name is None or inspect.ismodule(obj) else f"{where}.{name}"
    # A slice of a method keeps its class-body indentation; show it flush left.
    return Source(textwrap.dedent("\n".join(lines)).rstrip(), title)
