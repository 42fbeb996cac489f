"""Delegation refused: a learner's file that hands the exercise to a ready-made implementation fails.

Each exercise names what it ``refuses``: torch's version of what it asks for, and ``ckpt_lab``'s
(the package answers several exercises: it is the course's reference). The reference solutions in
``ckpt_lab.exercises`` are refused everywhere. The building blocks the notebooks teach
(``saved_tensors_hooks``, ``TorchDispatchMode``, ``fork_rng``, ``torch.autograd.Function``) are not
refused: they are how the exercise is done.

Two looks, both before any check runs:

* the file's text (``ast``): every import of a refused name, and every use of one through an
  imported name (``torch.utils.checkpoint.checkpoint(...)``, ``cp.checkpoint``), with its line;
* the loaded file's names: one that *is* a refused object, a subclass of one, a ``partial`` of one,
  or defined in a refused module (what ``importlib`` or ``getattr`` fetched past the first look).

A determined student can still hide a call inside a function behind ``getattr`` and a built string;
these looks stop the honest shortcut and the obvious disguises, which is what a grader a class can
trust needs: nobody passes by accident with torch's code.
"""

from __future__ import annotations

import ast
import functools
import importlib
import types
from pathlib import Path
from typing import Any

__all__ = ["CHECKPOINTS", "CKPT_LAB_CHECKPOINTS", "REFERENCE_SOLUTIONS", "TORCH_CHECKPOINTS", "delegations"]

# torch's checkpoints, its CheckpointFunction and its selective-checkpointing helpers.
TORCH_CHECKPOINTS = (
    "torch.utils.checkpoint.checkpoint",
    "torch.utils.checkpoint.checkpoint_sequential",
    "torch.utils.checkpoint.CheckpointFunction",
    "torch.utils.checkpoint.create_selective_checkpoint_contexts",
    "torch.utils.checkpoint._checkpoint_without_reentrant_generator",
    "torch.utils.checkpoint._CachingTorchDispatchMode",
    "torch.utils.checkpoint._CachedTorchDispatchMode",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
    "torch.ops.higher_order.tag_activation_checkpoint",
)
# ckpt_lab's own checkpoints: the modules, and the names the package exports for them.
CKPT_LAB_CHECKPOINTS = (
    "ckpt_lab.reentrant",
    "ckpt_lab.nonreentrant",
    "ckpt_lab.sequential",
    "ckpt_lab.scope",
    "ckpt_lab.scope_core",
    "ckpt_lab.selective",
    "ckpt_lab.reentrant_checkpoint",
    "ckpt_lab.checkpoint",
    "ckpt_lab.checkpoint_sequential",
    "ckpt_lab.gradient_checkpoint_scope",
    "ckpt_lab.selective_checkpoint",
)
CHECKPOINTS = TORCH_CHECKPOINTS + CKPT_LAB_CHECKPOINTS
# Every exercise's graders and reference solutions.
REFERENCE_SOLUTIONS = ("ckpt_lab.exercises",)


def _within(name: str, refused: str) -> bool:
    return name == refused or name.startswith(refused + ".")


def _refused_in(name: str, refuses: tuple[str, ...]) -> str | None:
    return next((r for r in refuses if _within(name, r)), None)


# ------------------------------------------------------------------------------- the file's text
def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``cp.checkpoint`` -> ``torch.utils.checkpoint.checkpoint`` when ``cp`` was imported as that module."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def _in_the_text(tree: ast.Module, refuses: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """(line, verb, refused name) for each import or use of a refused name in the file."""
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                # `import torch.utils.checkpoint` binds `torch`; `import x.y as z` binds z to x.y.
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                found.append((node.lineno, "imports", a.name))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if a.name == "*":
                    found += [(node.lineno, "imports", r) for r in refuses if _within(r, node.module)]
                    continue
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                found.append((node.lineno, "imports", f"{node.module}.{a.name}"))
    for node in ast.walk(tree):
        target = node.func if isinstance(node, ast.Call) else node
        if isinstance(target, ast.Attribute | ast.Name) and (name := _dotted(target, aliases)):
            found.append((node.lineno, "calls" if isinstance(node, ast.Call) else "uses", name))
    said: dict[int, tuple[int, str, str]] = {}
    for line, verb, name in sorted(found, key=lambda f: (f[0], f[1] != "calls")):
        refused = _refused_in(name, refuses)
        # One finding per line: the call if there is one, else the first use.
        if refused is not None and line not in said:
            said[line] = (line, verb, name if _within(name, refused) else refused)
    return list(said.values())


# ------------------------------------------------------------------------------- the loaded names
def _resolve(dotted: str) -> Any:
    """The object called ``dotted`` (its longest importable module, then attributes), or None."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _is_refused(value: Any, refuses: tuple[str, ...], objects: dict[int, str]) -> str | None:
    """The refused name ``value`` is, wraps, inherits from or was defined in; None if none."""
    if isinstance(value, functools.partial):
        value = value.func
    if isinstance(value, types.ModuleType):
        return _refused_in(value.__name__, refuses)
    if id(value) in objects:
        return objects[id(value)]
    if isinstance(value, type):
        for base in value.__mro__[1:]:
            if id(base) in objects:
                return f"a subclass of {objects[id(base)]}"
    module = getattr(value, "__module__", None)
    if isinstance(module, str) and (refused := _refused_in(module, refuses)):
        qualname = getattr(value, "__qualname__", None)
        return f"{module}.{qualname}" if isinstance(qualname, str) else refused
    return None


def _in_the_names(module: types.ModuleType, refuses: tuple[str, ...]) -> list[tuple[str, str]]:
    objects = {}
    for name in refuses:
        obj = _resolve(name)
        # Modules are recognised by name; everything else by identity.
        if obj is not None and not isinstance(obj, types.ModuleType):
            objects[id(obj)] = name
    found = []
    for name, value in vars(module).items():
        if name.startswith("__"):
            continue
        refused = _is_refused(value, refuses, objects)
        if refused is not None:
            found.append((name, refused))
    return found


def delegations(
    path: Path, shown: str, module: types.ModuleType, refuses: tuple[str, ...], taught: str
) -> list[str]:
    """What the learner's file hands to a ready-made implementation, one sentence each ([] if nothing)."""
    refuses = refuses + REFERENCE_SOLUTIONS
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (SyntaxError, ValueError, OSError):  # it loaded, so the file changed since: look at its names only
        tree = ast.Module(body=[], type_ignores=[])
    in_the_text = _in_the_text(tree, refuses)
    found = [(f"your file {verb} {name} at {shown}:{line}", name) for line, verb, name in in_the_text]
    in_text = {name for _, name in found}
    found += [
        (f"your file's `{name}` is {refused}", refused.removeprefix("a subclass of "))
        for name, refused in _in_the_names(module, refuses)
        if refused.removeprefix("a subclass of ") not in in_text
    ]
    said = [f"{text}: write it yourself ({taught})." for text, _ in found]
    if any(_within(name, "ckpt_lab.exercises") for _, name in found):
        said.append("(ckpt_lab.exercises holds the graders and the reference solutions.)")
    return said
