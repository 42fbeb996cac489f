"""Global state a checkpoint must leave as it found it.

A checkpoint pushes saved-tensor hooks, enters dispatch modes, turns grad mode off and on; RETURNN's
scope even patches ``saved_tensors_hooks``' methods; ``gradient_checkpoint_scope`` registers the
tensors it made and may keep a hooks entry until the last of them dies. Anything of that left behind
breaks the *next* user's hooks, silently, or keeps memory. ``global_state()`` reads all of it; the
benchmark compares it before and after every strategy, and the tests and notebook 04 assert
``assert_no_global_state()`` after every scope.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from ckpt_lab.errors import optional

__all__ = ["CLEAN", "UNKNOWN", "assert_no_global_state", "changes", "global_state"]

# What a reading says where this torch lacks the private name that would tell (ckpt_lab/torch_private.py):
# never a guess. Against CLEAN it shows as a change, so assert_no_global_state can't pass unseen.
UNKNOWN = "unknown"


def _method_names() -> tuple[str, str]:
    # By qualified name: a patched method (RETURNN's scope patches both) has another one.
    return (saved_tensors_hooks.__enter__.__qualname__, saved_tensors_hooks.__exit__.__qualname__)


def global_state() -> dict[str, Any]:
    """This thread's saved-tensor hooks, dispatch modes and grad mode, the hooks' methods, and what
    ``gradient_checkpoint_scope`` still holds."""
    top = optional("torch._C._autograd._top_saved_tensors_default_hooks")
    modes = optional("torch._C._len_torch_dispatch_stack")
    state = {
        # False: the real stack, as a user's next ``saved_tensors_hooks`` will find it.
        "saved_tensors_hooks_on_stack": UNKNOWN if top is None else top(False) is not None,
        "dispatch_modes": UNKNOWN if modes is None else modes(),
        "grad_enabled": torch.is_grad_enabled(),
        "saved_tensors_hooks_methods": _method_names(),
    }
    # Only if the scope was ever imported: otherwise it holds nothing (and this instrument needs it not).
    scope = sys.modules.get("ckpt_lab.scope")
    state.update(scope.leftovers() if scope is not None else _NO_SCOPE)
    return state


_NO_SCOPE = {"scope_storages_registered": 0, "scope_hooks_held": False}


# What a fresh interpreter has: no hooks, no modes, grad on, torch's own methods.
CLEAN: dict[str, Any] = {
    "saved_tensors_hooks_on_stack": False,
    "dispatch_modes": 0,
    "grad_enabled": True,
    "saved_tensors_hooks_methods": ("saved_tensors_hooks.__enter__", "saved_tensors_hooks.__exit__"),
    **_NO_SCOPE,
}


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs between two ``global_state()`` readings, one ``key: before -> after`` each."""
    return [f"{key}: {before[key]} -> {after[key]}" for key in before if before[key] != after[key]]


def assert_no_global_state(before: dict[str, Any] = CLEAN) -> bool:
    """Raise ``AssertionError`` naming what differs from ``before`` (a fresh interpreter's state by
    default); return True, so that a notebook cell can print the verdict."""
    left = changes(before, global_state())
    assert not left, "global state left behind: " + "; ".join(left)
    return True
