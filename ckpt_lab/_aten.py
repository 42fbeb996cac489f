"""Facts about tensors and aten ops that several modules need, each computed one way.

* **Storage identity.** Two tensors share memory exactly when they share a storage (a view, an
  in-place result, an ``out=`` argument). The key is ``id()`` of the storage's Python object: PyTorch
  keeps that object alive exactly as long as the storage itself (and hands out the same one every
  time), so the id is unique among live storages, and ``weakref.finalize`` on it fires when the memory
  is freed. A key may be reused once its storage is gone.
* **What an op writes.** The schema marks written arguments (``Tensor(a!) self`` of ``add_``, ``out=``
  arguments); autograd bumps their version counters after the op returns. A few ops write into
  arguments their schema does not mark: batch norm in training mode updates its running statistics
  in place, with no version bump.
* **Whether an op draws random numbers.** aten's ops that do carry the ``nondeterministic_seeded``
  tag (``bernoulli_``, ``randn``, ``native_dropout``, ...); a custom op (``torch.library``) may draw
  without saying so.

Used by the instruments (``LiveMemory``, ``SavedTensorLog``), the scope, selective checkpointing and
the planner.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten

__all__ = [
    "OpInfo",
    "is_view",
    "new_storages",
    "op_info",
    "storage_key",
    "storage_keys",
    "storage_of",
    "storages",
    "tensors_in",
]


# --------------------------------------------------------------------------------- storage identity
def storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage ``tensor`` lives in, or None if it has none of its own (sparse tensors, wrapper
    subclasses, some fake tensors): such tensors are never counted as memory."""
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def storage_key(tensor: torch.Tensor) -> int | None:
    """The identity of ``tensor``'s storage (see the module docstring), or None if it has none."""
    storage = storage_of(tensor)
    return None if storage is None else id(storage)


def storage_keys(tensors: Any) -> set[int]:
    """The identities of the storages behind ``tensors`` (an iterable of tensors)."""
    keys = {storage_key(t) for t in tensors}
    keys.discard(None)
    return keys  # type: ignore[return-value]


def storages(tensors: Any) -> dict[int, torch.UntypedStorage]:
    """The distinct storages behind ``tensors`` (an iterable of tensors), by key, in order."""
    found: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = storage_of(t)
        if storage is not None:
            found.setdefault(id(storage), storage)
    return found


def new_storages(args: Any, kwargs: Any, out: Any) -> dict[int, torch.UntypedStorage]:
    """The storages among an op's outputs that none of its arguments has, by key: the new memory the
    op made. (Views, in-place and ``out=`` results live in an argument's storage.)"""
    inputs = storages(tensors_in((args, kwargs)))
    return {key: s for key, s in storages(tensors_in(out)).items() if key not in inputs}


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors among the leaves of a (nested) structure of arguments or outputs."""
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def is_view(op: torch._ops.OpOverload, args: Any, kwargs: Any, out: Any) -> bool:
    """Does a non-mutating op return an alias of one of its inputs (``t``, ``view``, ``expand``)?"""
    outputs = storage_keys(tensors_in(out))
    return not op._schema.is_mutable and bool(outputs & storage_keys(tensors_in((args, kwargs))))


# ---------------------------------------------------------------------------------- what an op writes
class OpInfo(NamedTuple):
    """What an aten op's schema says, looked up once per op (``op_info``)."""

    func: Any  # kept so that its id, the cache's key, stays valid
    # (position, name, marked) of each argument the op writes in place; marked: the schema says so
    # (``Tensor(a!)``), and then autograd bumps the argument's version counter once the op returns.
    writes: tuple[tuple[int, str, bool], ...]
    fresh: tuple[bool, ...]  # per return: True if it is new memory, False if it aliases an argument
    # Draws random numbers, from its ``generator`` argument if one is passed, else from the default
    # generator of its device: an op with the ``nondeterministic_seeded`` tag, and any op from outside
    # aten and prims (a custom op can't be known not to).
    random: bool = False
    # The C++ entry point the OpOverload's ``__call__`` forwards to (``func._op``): calling it skips
    # that Python frame, once per op for a dispatch mode that runs every op (the scope).
    call: Any = None

    def written(self, args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, bool]]:
        """The tensors a call with ``args`` and ``kwargs`` writes to, each with its ``marked`` flag."""
        tensors = []
        for position, name, marked in self.writes:
            value = args[position] if position < len(args) else kwargs.get(name)
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    tensors.append((t, marked))
        return tensors


# Ops that write into arguments their schema does not mark as written (``Tensor?`` not ``Tensor(a!)``):
# in training mode they update the running statistics in place, without a version bump.
_RUNNING_STATS = ((3, "running_mean", False), (4, "running_var", False))
_UNMARKED_WRITES = {
    torch.ops.aten.native_batch_norm: _RUNNING_STATS,
    torch.ops.aten.cudnn_batch_norm: _RUNNING_STATS,
    torch.ops.aten.miopen_batch_norm: _RUNNING_STATS,
}
# Namespaces whose ops say whether they draw random numbers (their tags).
_KNOWN_NAMESPACES = frozenset({"aten", "prims"})
# Keyed by id: an OpOverload's __hash__ is a Python method, too slow to call once per op.
_OP_INFO: dict[int, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    """What ``func``'s schema says about writes, fresh memory and random numbers (cached per op)."""
    info = _OP_INFO.get(id(func))
    if info is None:
        schema = func._schema
        writes = tuple(
            (i, arg.name, True)
            for i, arg in enumerate(schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        writes += _UNMARKED_WRITES.get(func.overloadpacket, ())
        fresh = tuple(ret.alias_info is None for ret in schema.returns)
        tags, namespace = getattr(func, "tags", ()), getattr(func, "namespace", "aten")
        random = torch.Tag.nondeterministic_seeded in tags or namespace not in _KNOWN_NAMESPACES
        info = _OP_INFO[id(func)] = OpInfo(func, writes, fresh, random, getattr(func, "_op", func))
    return info
