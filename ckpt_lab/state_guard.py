"""State that changes between the forward and the re-run: named, or put back; and ``is_recomputing()``.

A checkpoint runs the region's Python code twice: in the forward, and again in backward. Whatever
the first run changes on the modules it reads (a counter, a cache, a buffer modified in place) the
second run sees changed. ``ckpt_lab.checkpoint(..., state_check=...)`` compares that state:

* ``"none"`` (the default, as torch): nothing is compared.
* ``"warn"`` / ``"raise"``: before the re-run, the state of the region's modules is compared with
  the state they had before the forward; each difference is named (module path, attribute, before
  and after) in a ``UserWarning``, or in a ``CheckpointError``.
* ``"restore"``: the state is copied before the forward and put back for the re-run (then the state
  the forward left is put back again): the re-run sees what the forward saw, and leaves no trace.
  The automatic counterpart of torch_remat's ``RecomputeStateHook``, for module state.

``is_recomputing()`` is ``True`` inside our checkpoints' re-runs (reentrant, non-reentrant,
selective): code that must run once per step (metrics, counters, cache writes) asks it.

The state of a module, here: its buffers and its public attributes holding numbers, tensors (not
parameters), lists, tuples and dicts (their lengths); tensors compared by identity, shape and version
counter (an in-place change bumps it), not by value. The modules: ``function`` itself when it is one,
the module of a bound method, the modules among ``functools.partial``'s and the call's arguments and
those a closure captures directly, with all their submodules.

What it cannot see: global variables, closures' other values, attributes whose names start with an
underscore, objects that are not modules, the contents of lists and dicts (only their lengths), C++
state (cuDNN's choices, a library's own caches), and Python's or NumPy's random generators.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ckpt_lab.errors import CheckpointError
from ckpt_lab.rng import is_recomputing, recomputing

__all__ = ["STATE_CHECKS", "StateGuard", "is_recomputing", "recomputing"]

# is_recomputing and recomputing live in rng.py, beside the replay state every re-run installs, so a
# copied stage carries them; re-exported here with the guard they serve.

STATE_CHECKS = ("none", "warn", "raise", "restore")


def _modules(function: Any, args: tuple, kwargs: dict) -> list[tuple[str, nn.Module]]:
    """The modules the region can reach that we can see (the module docstring), with their names."""
    roots: list[Any] = [function, getattr(function, "__self__", None)]
    if isinstance(function, functools.partial):
        roots += [function.func, getattr(function.func, "__self__", None), *function.args]
    roots += [cell.cell_contents for cell in getattr(function, "__closure__", None) or () if _filled(cell)]
    roots += [*args, *kwargs.values()]
    found: dict[int, tuple[str, nn.Module]] = {}
    for root in roots:
        if isinstance(root, nn.Module):
            for path, module in root.named_modules(prefix=type(root).__name__):
                found.setdefault(id(module), (path, module))
    return list(found.values())


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018  (an empty cell raises)
    except ValueError:
        return False
    return True


def _state(module: nn.Module) -> dict[str, Any]:
    """The attributes this guard compares, by name: buffers and public non-parameter attributes."""
    state = dict(module.named_buffers(recurse=False))
    for name, value in vars(module).items():
        if not name.startswith("_") and not isinstance(value, nn.Parameter):
            if isinstance(value, (numbers.Number, torch.Tensor, list, tuple, dict)):
                state[name] = value
    return state


def _fingerprint(value: Any) -> Any:
    """What is compared: a tensor's identity, shape and version; a container's length; a number."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), tuple(value.shape), value._version)
    if isinstance(value, (list, tuple, dict)):
        return (type(value).__name__, len(value))
    return value


def _describe(fingerprint: Any) -> str:
    if isinstance(fingerprint, tuple) and fingerprint and fingerprint[0] == "tensor":
        return f"a tensor of shape {fingerprint[2]} at version {fingerprint[3]}"
    if isinstance(fingerprint, tuple) and fingerprint and fingerprint[0] in ("list", "tuple", "dict"):
        return f"a {fingerprint[0]} of length {fingerprint[1]}"
    return "absent" if fingerprint is _ABSENT else repr(fingerprint)


_ABSENT = object()


def _copy(value: Any) -> Any:
    """A copy to put back: the values of a tensor that is state (a buffer, a counter; not one that
    requires grad, an activation, which is only rebound), a container's items (shallow), a number."""
    if isinstance(value, torch.Tensor):
        return None if value.requires_grad else value.detach().clone()
    if isinstance(value, (list, dict)):
        return type(value)(value)
    return value


class StateGuard:
    """One checkpointed call's guard: the state before its forward, compared or put back for each
    re-run (``rerun()``, a context manager around it)."""

    def __init__(
        self, mode: str, function: Callable[..., Any], args: tuple, kwargs: dict, where: str
    ) -> None:
        self.mode, self.where = mode, where
        self.modules = _modules(function, args, kwargs)
        self.before = self._fingerprints()
        # "restore": the objects and copies of their contents, as the forward found them.
        self.saved = self._snapshot() if mode == "restore" else None

    def _fingerprints(self) -> dict[tuple[str, str], Any]:
        return {
            (path, name): _fingerprint(value)
            for path, module in self.modules
            for name, value in _state(module).items()
        }

    def _snapshot(self) -> list[tuple[nn.Module, str, Any, Any]]:
        return [
            (module, name, value, _copy(value))
            for _, module in self.modules
            for name, value in _state(module).items()
        ]

    def changes(self) -> list[str]:
        """Each attribute whose state differs from the forward's: ``path.attribute: before -> now``."""
        now = self._fingerprints()
        return [
            f"{path}.{name}: {_describe(self.before.get((path, name), _ABSENT))} -> "
            f"{_describe(now.get((path, name), _ABSENT))}"
            for path, name in sorted({*self.before, *now})
            if self.before.get((path, name), _ABSENT) != now.get((path, name), _ABSENT)
        ]

    @contextlib.contextmanager
    def rerun(self) -> Iterator[None]:
        if self.saved is not None:
            after_forward = self._snapshot()
            _put_back(self.saved)
            try:
                yield
            finally:
                _put_back(after_forward)
            return
        changed = self.changes()
        if changed:
            message = (
                "checkpoint: the state of the checkpointed modules changed between the forward and the "
                f"re-run (state_check={self.mode!r}; checkpointed at {self.where}):\n  "
                + "\n  ".join(changed)
                + "\nThe re-run sees the changed state: it may take another path, or count, append or "
                "update twice. Pass state_check='restore' to re-run on the state the forward saw, or "
                "guard code that must run once per step with `if not ckpt_lab.is_recomputing():`."
            )
            if self.mode == "raise":
                raise CheckpointError(message)
            # stacklevel: past contextlib, at the re-run in the checkpoint.
            warnings.warn(message, stacklevel=3)
        yield


def _put_back(snapshot: list[tuple[nn.Module, str, Any, Any]]) -> None:
    """Rebind each attribute to the object it held, and give that object the contents it had."""
    with torch.no_grad():
        for module, name, value, copy in snapshot:
            if isinstance(value, torch.Tensor) and copy is not None:
                if value.shape != copy.shape:
                    value.resize_(copy.shape)
                value.copy_(copy)
            elif isinstance(value, list):
                value[:] = copy
            elif isinstance(value, dict):
                value.clear()
                value.update(copy)
            setattr(module, name, value)
