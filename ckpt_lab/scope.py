"""``gradient_checkpoint_scope``: every tensor created inside it is recomputed in backward.

Same semantics as RETURNN's ``returnn.torch.util.gradient_checkpoint.gradient_checkpoint_scope``,
written from scratch. Introduced in notebook 04, and read top to bottom in the order it tells::

    with gradient_checkpoint_scope():
        x = a + b
    y = x * c        # autograd saves a small reference instead of x; backward re-runs a + b

1. The entry point, and where a scope does nothing.
2. Recording: ``_RecordingMode`` writes every aten op into a ``_Recording``, the scope's tape.
3. Packing: ``_PackHook`` finds a scope tensor's recording by its storage, in ``_OWNERS``.
4. Replay: ``_Replayer`` re-runs the tape once per backward, and checks what it recomputed.
5. The resident hooks: how our pack hook outlives the ``with`` block, and how it is released.

The design notes sit next to the code they explain, as ``NOTE [ ... ]`` comments that the code cites.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, NamedTuple

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch._C._autograd import (
    _pop_saved_tensors_default_hooks,
    _push_saved_tensors_default_hooks,
    _saved_tensors_hooks_is_enabled,
    _top_saved_tensors_default_hooks,
)
from torch.utils._python_dispatch import TorchDispatchMode

from ckpt_lab._aten import _OP_INFO, OpInfo, op_info, storage_of
from ckpt_lab.nonreentrant import CheckpointError
from ckpt_lab.rng import AutocastState, ReplayState, RNGState, device_initialised

__all__ = ["gradient_checkpoint_scope"]


# =================================================================================== 1. entry point
@contextlib.contextmanager
def gradient_checkpoint_scope(*, preserve_rng_state: bool = True) -> Iterator[None]:
    """Every tensor created inside is recomputed in backward instead of being stored for it.

    ``torch.utils.checkpoint`` takes a function and stores what goes in and what comes out: with
    ``x = checkpoint(lambda a, b: a + b, a, b)``, ``x * c`` saves ``x``, alive until backward. Here
    ``x`` itself is recomputed, so it is freed as soon as the user drops it.

    ``preserve_rng_state=False`` skips the RNG snapshot: only safe if the scope draws no random
    numbers, or if different ones in the recomputation are acceptable.
    """
    hooks = _ResidentHooks.of_this_thread()
    # Where a scope does nothing (the with block simply runs):
    if (
        # nested in a scope on this thread: the outer one records everything already, they act as one;
        hooks.open is not None
        # inside one of our hooks or a replay: see NOTE [ Per-thread state ];
        or _thread.in_hook
        # with grad disabled: nothing will be saved, so there is nothing to recompute;
        or not torch.is_grad_enabled()
        # inside backward: the engine undoes any change to the hooks stack, see NOTE [ Safe points ];
        or torch._C._current_graph_task_id() != -1
        # inside a checkpointed region: see NOTE [ A scope inside a checkpoint ].
        or _inside_a_checkpoint()
    ):
        yield
        return
    recording = _Recording(hooks, preserve_rng_state)
    entry = hooks.open_scope(recording)
    failed = True
    try:
        with _RecordingMode(recording):
            yield
        failed = False
    finally:
        hooks.close_scope(recording, entry, failed)


class _ThreadState(threading.local):
    # NOTE [ Per-thread state ]
    # ``in_hook`` > 0 while one of our hooks runs on this thread, and with it any replay (a replay
    # runs inside an unpack). Ops run then are not the forward's (save_on_cpu's copy in a hook we
    # hand tensors to, the replay's own ops): they are not recorded, a scope opened then does
    # nothing, and the hooks stack is not touched (exiting hooks from inside a hook can crash,
    # pytorch/pytorch#130734). A count, not a flag: our hooks nest (an unpack we hand on to another
    # hook may unpack through us again).
    in_hook = 0
    # This thread's resident hooks, made on first use (see section 5).
    hooks: _ResidentHooks | None = None


_thread = _ThreadState()


# NOTE [ A scope inside a checkpoint ]
# Some checkpoints re-run their region in backward and match what the re-run saves to what the
# forward saved, *by position*: torch.utils.checkpoint's non-reentrant checkpoint, ckpt_lab's
# checkpoint, and any built like them. A scope inside such a region would make the forward save
# other tensors than the re-run (inside backward a scope does nothing), and the checkpoint would
# hand out the wrong tensors: silently wrong gradients. So inside their region a scope does
# nothing; the checkpoint recomputes everything there anyway.
#
# Such a checkpoint is recognised by its pack hook, not by the name of the module that defines it
# (a copied or renamed checkpoint would be missed):
# * torch's, by the code objects of its two pack hooks (the forward's, defined in
#   ``_checkpoint_hook.__init__``, and the re-run's, in ``_recomputation_hook.__init__``), read
#   from torch once, here; the tests check that both are found;
# * any other, by a protocol: a checkpoint whose backward re-runs its region and matches saved
#   tensors by position sets ``recomputes_region = True`` on its pack hooks, the forward's and the
#   re-run's (ckpt_lab's checkpoint does, and a copy of its file keeps it).
def _pack_hook_codes(*hook_classes: str) -> frozenset[types.CodeType]:
    """The code objects of the ``pack_hook`` functions defined in these classes' ``__init__``."""
    codes = set()
    for name in hook_classes:
        init = getattr(getattr(torch_checkpoint, name, None), "__init__", None)
        for const in getattr(getattr(init, "__code__", None), "co_consts", ()):
            if isinstance(const, types.CodeType) and const.co_name == "pack_hook":
                codes.add(const)
    return frozenset(codes)


_TORCH_CHECKPOINT_PACK_HOOKS = _pack_hook_codes("_checkpoint_hook", "_recomputation_hook")


def _recomputes_region(pack: Any) -> bool:
    """Whether ``pack`` is the pack hook of a checkpoint that re-runs its region in backward."""
    # Through decorators (torch wraps its re-run's pack hook in torch._dynamo.disable), a few deep:
    # a __wrapped__ chain may loop.
    for _ in range(8):
        if getattr(pack, "recomputes_region", False) is True:
            return True
        if getattr(pack, "__code__", None) in _TORCH_CHECKPOINT_PACK_HOOKS:
            return True
        pack = getattr(pack, "__wrapped__", None)
        if pack is None:
            return False
    return False


def _inside_a_checkpoint() -> bool:
    """Whether such a checkpoint's pack hook is on this thread's stack, above our entries (it can't
    be below them: a scope that closed above it, and so could have wrapped it, was inside its
    region, where a scope does nothing)."""
    if not _saved_tensors_hooks_is_enabled():
        # We could not push back what we pop; and the scope's own push will fail anyway.
        return False
    popped = []
    try:
        while (top := _top()) is not None and not isinstance(top[0], _PackHook):
            if _recomputes_region(top[0]):
                return True
            # Look below it (typically a save_on_cpu inside a checkpointed function).
            _pop_saved_tensors_default_hooks()
            popped.append(top)
        return False
    finally:
        for pack, unpack in reversed(popped):
            _push_saved_tensors_default_hooks(pack, unpack)


# ========================================================================= 2. recording: the tape
# NOTE [ Speed ]
# The recording runs once per aten op of the forward, and the replay once per op it re-runs, so
# both spare Python calls where they can. Each shortcut cites its letter:
# (a) An op's schema facts are looked up in _aten's cache by id(func), without a call on a hit
#     (an OpOverload's __hash__ is a Python method, and op_info() a Python call).
# (b) tuple.__new__(_Op, ...) rather than _Op(...): a NamedTuple's __new__ is a Python function.
# (c) One tensor returned, the common case, is handled without calling _outputs; and _outputs
#     flattens by hand, without pytree's generic (and slower) traversal.
# (d) type(x) is _Slot rather than isinstance(), and _resolve inlined where it runs once per
#     argument of every replayed op.
# (e) One shared empty dict (_NO_KWARGS) for ops called without keyword arguments.
# (f) The per-tensor objects (_SlotRecord, _ScopeTensorRef, _Owner, ...) have __slots__; and _Owner
#     is a weakref subclass: one object per storage, where weakref.finalize keeps a registry too.
_NO_KWARGS: dict = {}


class _RecordingMode(TorchDispatchMode):
    """Records every aten op run inside the scope (below autograd: what the backend really ran)."""

    def __init__(self, recording: _Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or _NO_KWARGS  # See NOTE [ Speed ] (e).
        if _thread.in_hook:
            # Run by one of our hooks or a replay: not the forward's. See NOTE [ Per-thread state ].
            return func(*args, **kwargs)
        info = _OP_INFO.get(id(func)) or op_info(func)  # See NOTE [ Speed ] (a).
        written = self._before_writes(info, args, kwargs) if info.writes else []
        if kwargs:
            self._note_generators(kwargs)
        out = func(*args, **kwargs)
        self.recording.record(func, info, args, kwargs, out, written)
        return out

    def _note_generators(self, kwargs: dict) -> None:
        """Before an op runs: remember the state of an explicit generator it draws from."""
        generators = self.recording.generators
        for value in kwargs.values():
            if isinstance(value, torch.Generator) and id(value) not in generators:
                generators[id(value)] = (value, value.get_state())

    def _before_writes(self, info: OpInfo, args: tuple, kwargs: dict) -> list[tuple[_Slot, int]]:
        """Before an op that writes in place runs: copy the outside tensors it is about to write to.

        Returns (slot, version it will have after the op) for each tensor written.
        """
        # A marked write bumps the version above us (ADInplaceOrView), after the op returns to autograd.
        return [(self._before_write(t), t._version + marked) for t, marked in info.written(args, kwargs)]

    def _before_write(self, tensor: torch.Tensor) -> _Slot:
        # See NOTE [ Outside tensors written in place ].
        recording = self.recording
        slot = recording.encode(tensor)
        root = recording.slots[recording.slots[slot].root]
        source = root.source
        if isinstance(source, _Borrowed):
            owner = _OWNERS.get(id(storage_of(source.tensor)))
            if owner is not None and owner.recording is recording:
                # Limitation: a replay would write into a copy, not into the scope tensor this aliases.
                raise CheckpointError(
                    "gradient_checkpoint_scope: an in-place write through an alias the scope did not "
                    "create (.data?) into a tensor the scope did create cannot be replayed."
                )
            if source.tensor._version != source.version:
                # Limitation: the copy would hold values the scope's earlier reads did not see.
                raise CheckpointError(
                    "gradient_checkpoint_scope: a tensor from outside the scope changed between the "
                    "scope reading it and writing to it, by an op the scope did not see."
                )
            root.source = _Snapshot(source.tensor)
        return slot


class _Recording:
    """One scope's tape (its ops, one ``_SlotRecord`` per tensor they touched, the generators they
    drew from), and its lifetime: open or not, and which storages it created are still alive."""

    def __init__(self, hooks: _ResidentHooks, preserve_rng_state: bool) -> None:
        self.hooks = hooks
        self.ops: list[_Op] = []
        self.slots: list[_SlotRecord] = []
        # While recording: id(tensor) -> (weakref, slot). Weak, or the scope would keep its tensors.
        self.by_id: dict[int, tuple[weakref.ref, _Slot]] = {}
        # id -> (generator, its state before the scope first drew from it).
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        # Keys of our entries in _OWNERS whose storages are alive. A set: add and discard are atomic,
        # and storages die on any thread.
        self.alive_storages: set[int] = set()
        self.open = True
        # Captured once, before the scope's first op. See NOTE [ RNG and autocast in a replay ].
        state, self.uninitialised = _capture_replay_state(preserve_rng_state)
        # The replayer shares our lists but holds no reference back to us: we reference it, and a
        # cycle would free the tape (and the inputs it keeps) only when the garbage collector runs.
        self.replayer = _Replayer(self.ops, self.slots, self.generators, state)

    def encode(self, value: Any) -> Any:
        """An argument as the tape keeps it: each tensor becomes its slot."""
        if isinstance(value, torch.Tensor):
            entry = self.by_id.get(id(value))
            # The weakref tells the tensor apart from a new one that got the id of a dead one.
            return entry[1] if entry is not None and entry[0]() is value else self._add_input(value)
        if type(value) in (list, tuple) and any(isinstance(v, torch.Tensor) for v in value):
            return _Nested([self.encode(v) for v in value])
        return value

    def _add_input(self, tensor: torch.Tensor) -> _Slot:
        """A slot for a tensor from outside the scope. See NOTE [ Inputs are kept, not recomputed ]."""
        return self._add_slot(tensor, _Borrowed(tensor), None)

    def _add_slot(self, tensor: torch.Tensor, source: Any, root: _Slot | None) -> _Slot:
        slot = _Slot(len(self.slots))
        self.slots.append(_SlotRecord(source, slot if root is None else root, None, None))
        self.by_id[id(tensor)] = (weakref.ref(tensor), slot)
        return slot

    def record(
        self, func: Any, info: OpInfo, args: tuple, kwargs: dict, out: Any, written: list[tuple[_Slot, int]]
    ) -> None:
        """After an op ran: append it, and give every new tensor it returned a slot."""
        # See NOTE [ Speed ] (c).
        outputs = ((out, info.fresh[0]),) if type(out) is torch.Tensor else _outputs(out, info.fresh)
        if not outputs and not written:
            # .item(), .equal() and the like: nothing a later op could read, nothing to replay.
            return
        args = tuple([self.encode(a) for a in args])
        kwargs = {k: self.encode(v) for k, v in kwargs.items()} if kwargs else _NO_KWARGS
        slots, metas = [], []
        for tensor, fresh in outputs:
            meta = _meta(tensor)
            entry = self.by_id.get(id(tensor))
            # In-place and out= ops return an argument: it keeps its slot.
            known = entry is not None and entry[0]() is tensor
            slots.append(entry[1] if known else self._add_output(tensor, fresh, args, meta))
            metas.append(meta)
        writes = ()
        if written:
            writes = tuple(slot for slot, _ in written)
            for slot, version in written:
                root = self.slots[self.slots[slot].root]
                if root.version is not None:
                    # Views share their base's version counter: this is the root's version after the op.
                    root.version = version
        # See NOTE [ Speed ] (b).
        self.ops.append(tuple.__new__(_Op, (func, args, kwargs, tuple(slots), tuple(metas), writes)))

    def _add_output(self, tensor: torch.Tensor, fresh: bool, args: tuple, meta: tuple) -> _Slot:
        storage = storage_of(tensor) if fresh else None
        owner = _OWNERS.get(id(storage))
        if storage is not None and owner is None:
            # New memory, what the scope exists for: register it so that the pack hook knows it.
            # See NOTE [ Scope tensors are recognised by their storage ].
            slot = _Slot(len(self.slots))
            self.slots.append(_SlotRecord(None, slot, tensor._version, meta))
            self.by_id[id(tensor)] = (weakref.ref(tensor), slot)
            owner = _Owner(storage, _storage_died)
            owner.key, owner.recording, owner.root = id(storage), self, slot
            _OWNERS[owner.key] = owner
            self.alive_storages.add(owner.key)
            return slot
        # A view (or an alias the schema does not declare, like _unsafe_view): it lives in the storage
        # of the slot that owns it, or else in that of the op's first tensor argument.
        if owner is not None and owner.recording is self:
            root = owner.root
        else:
            base = next((a for a in args if type(a) is _Slot), None)
            root = None if base is None else self.slots[base].root
        return self._add_slot(tensor, None, root)

    def close(self, failed: bool) -> None:
        """The scope's ``with`` block ended (``failed``: by an exception)."""
        self.open = False
        # Identities are only needed while ops are still being recorded.
        self.by_id = {}
        replayer = self.replayer
        replayer.state = _with_accelerator_initialised_inside(replayer.state, self.uninitialised)
        # Safety net for schemas that lie: an output we took for new memory but that shares an
        # outside tensor's storage would keep this recording alive as long as that tensor lives.
        borrowed = {id(storage_of(s.source.tensor)) for s in self.slots if isinstance(s.source, _Borrowed)}
        for key in list(self.alive_storages) if failed else self.alive_storages & borrowed:
            # After an exception no new references: scope tensors still alive are stored normally.
            owner = _OWNERS.get(key)
            if owner is not None and owner.recording is self:
                del _OWNERS[key]
            self.alive_storages.discard(key)
        if not self.alive_storages:
            self.hooks.live_recordings.discard(self)

    def storage_released(self, key: int) -> None:
        """A storage this scope created was freed (on any thread)."""
        self.alive_storages.discard(key)
        if not self.alive_storages and not self.open:
            self.hooks.forget(self)


# What the tape holds.
class _Slot(int):
    """A slot number of a recording. In a recorded op's arguments it stands for the slot's tensor (an
    int of its own type, so that it can't be mistaken for an int argument; tested with
    ``type(x) is _Slot``, see NOTE [ Speed ] (d))."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"_Slot({int(self)})"


class _SlotRecord:
    """What the tape knows of the tensor in one slot."""

    __slots__ = ("meta", "root", "source", "version")

    def __init__(self, source: Any, root: _Slot, version: int | None, meta: tuple | None) -> None:
        # None for a tensor an op made, else how a replay gets it: _Borrowed, or _Snapshot once the
        # scope wrote to it.
        self.source = source
        # The slot whose storage it lives in: itself for new memory and for inputs.
        self.root = root
        # For a slot owning new memory (else None): its version after the last recorded op, and
        # its metadata (which tells a view of it that autograd saves from the tensor itself).
        self.version = version
        self.meta = meta


class _Op(NamedTuple):
    func: Any
    args: tuple  # tensors replaced by their slots
    kwargs: dict
    outputs: tuple[_Slot, ...]  # the slot of each tensor it returned
    metas: tuple[tuple, ...]  # and that tensor's metadata, for the replay's check
    writes: tuple[_Slot, ...]  # slots it writes in place


class _Nested(tuple):
    """A list argument with tensors in it (``torch.cat([a, b])``), as the tape keeps it."""

    __slots__ = ()

    def resolve(self, values: list[Any]) -> list[Any]:
        return [values[a] if type(a) is _Slot else a for a in self]


# NOTE [ Inputs are kept, not recomputed ]
# Tensors from outside the scope that a replay reads (inputs, parameters) are kept by strong
# reference until every reference autograd holds and every scope tensor is gone: an input nothing
# else keeps (``a`` in ``a + b``, which add does not save) lives until backward. That includes
# tensors made by an earlier scope and read by a later one. A _ScopeTensorRef instead would make the
# later replay start with the earlier scope's, which would hold all of *its* recomputed tensors
# while backward goes through the later one, and so on down a chain of scoped layers: peak memory as
# without any checkpointing. Kept, they are the layer boundaries a checkpoint stores too.
class _Borrowed:
    """A tensor from outside the scope that the replay reads: kept by reference, checked by version."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version

    def materialize(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            # Limitation (1) of NOTE [ What a replay refuses ].
            raise CheckpointError(
                "gradient_checkpoint_scope: a tensor from outside the scope, read inside it, was modified "
                f"in place before backward recomputed the scope (version {self.tensor._version}, read at "
                f"version {self.version}; shape {list(self.tensor.shape)}). The recomputation would read "
                "the new values and give wrong gradients. Modify it out of place, or after backward."
            )
        return self.tensor


# NOTE [ Outside tensors written in place ]
# An outside tensor written in place inside the scope (BatchNorm's running statistics, buf.add_(1))
# must be updated exactly once, by the forward. So it is copied once, just before the first write
# (_Snapshot), and each replay writes into a fresh copy of that copy; a large buffer costs its size.
# Views of it made earlier are replayed as views of the copy, so they see the write too. Refused
# with CheckpointError: a write through an alias the scope did not create (.data) into a tensor the
# scope did create, and an outside tensor that changed, by an op the scope did not see, between the
# scope reading it and writing to it.
class _Snapshot:
    """An input the scope writes to in place, copied just before the first write: each replay writes
    into a copy of this copy, and the input itself is updated exactly once, by the forward."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.clone()

    def materialize(self) -> torch.Tensor:
        return self.tensor.clone()


def _outputs(out: Any, fresh: tuple[bool, ...]) -> list[tuple[torch.Tensor, bool]]:
    """The tensors an op returned, flat and in order, each with its ``fresh`` flag (new memory).

    Flattened by hand: see NOTE [ Speed ] (c).
    """
    if isinstance(out, torch.Tensor):
        return [(out, bool(fresh) and fresh[0])]
    if not isinstance(out, (tuple, list)):
        return []
    # A tuple has one schema return per element; a list is one ``Tensor[]`` return.
    if not (isinstance(out, tuple) and len(fresh) == len(out)):
        fresh = (bool(fresh) and fresh[0],) * len(out)
    pairs = []
    for item, flag in zip(out, fresh, strict=True):
        if isinstance(item, torch.Tensor):
            pairs.append((item, flag))
        elif isinstance(item, (tuple, list)):
            pairs.extend((t, flag) for t in item if isinstance(t, torch.Tensor))
    return pairs


def _meta(tensor: torch.Tensor) -> tuple:
    """What a replay must reproduce exactly: shape, strides, storage offset, dtype, device."""
    try:
        return (tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype, tensor.device)
    except (RuntimeError, NotImplementedError):
        # Sparse tensors and wrapper subclasses have no strides of their own.
        return (tensor.shape, None, None, tensor.dtype, tensor.device)


# ============================================================================ 3. packing: owners
# NOTE [ Scope tensors are recognised by their storage ]
# A pack hook is handed a tensor, not told where it came from. A tensor the scope made is
# recognised by its *storage*, so views of it count too, wherever they were made (a 3-d Linear
# after the scope saves a view of its input). _OWNERS maps id(storage) to its _Owner. Process-wide,
# so a scope tensor saved by any thread is recognised. A storage's Python object lives exactly as
# long as the storage, so its id is a valid key while it lives, and the weakref callback removes
# the entry before the id can be reused.
class _Owner(weakref.ref):
    """A weak reference to a storage a scope created, naming the recording and the slot that own it."""

    __slots__ = ("key", "recording", "root")  # See NOTE [ Speed ] (f).


_OWNERS: dict[int, _Owner] = {}


def _storage_died(owner: _Owner) -> None:
    # Identity check: the entry may have been forgotten already (after an exception in the scope).
    if _OWNERS.get(owner.key) is owner:
        del _OWNERS[owner.key]
        owner.recording.storage_released(owner.key)


class _PackHook:
    """Our pack hook, one object per entry of ours on the stack: a scope's own entry while it is
    open, the resident entry (``below`` is None), or a wrapper standing in for another hook
    (see NOTE [ Hooks that outlive the with block ])."""

    __slots__ = ("below",)

    def __init__(self, below: tuple[Any, Any] | None) -> None:
        # The (pack, unpack) pair that gets tensors not made in a scope; None: store them ourselves.
        self.below = below

    def __call__(self, tensor: torch.Tensor) -> Any:
        _thread.in_hook += 1
        try:
            # See NOTE [ Scope tensors are recognised by their storage ]; id(None) is never a key.
            owner = _OWNERS.get(id(storage_of(tensor)))
            ref = owner.recording.replayer.ref_for(tensor, owner.root) if owner is not None else None
            if ref is not None:
                return ref
            if self.below is None:
                return _Stored(tensor)
            pack, unpack = self.below
            return _Delegated(unpack, pack(tensor))
        finally:
            _thread.in_hook -= 1


def _unpack(packed: _ScopeTensorRef | _Stored | _Delegated) -> torch.Tensor:
    """The unpack hook of every entry of ours: each packed value knows how to give its tensor back."""
    _thread.in_hook += 1
    try:
        return packed.unpack()
    finally:
        _thread.in_hook -= 1


# What autograd stores, through our pack hook.
class _ScopeTensorRef:
    """What autograd stores for a scope tensor: its recording's replayer, the slot whose storage it
    lives in, its version when saved, and its geometry if it is a view (None: the slot's tensor)."""

    __slots__ = ("__weakref__", "geometry", "replayer", "root", "round", "version")

    def __init__(self, replayer: _Replayer, root: int, version: int, geometry: tuple | None) -> None:
        self.replayer = replayer
        self.root = root
        self.version = version
        self.geometry = geometry
        self.round = -1  # the last replay that served this reference

    def unpack(self) -> torch.Tensor:
        return self.replayer.serve(self)


class _Stored:
    """A tensor not created in any scope, stored as autograd itself would store it."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        # Detached: a saved *output* returned as is references its own grad_fn, a cycle through
        # C++ that not even the garbage collector frees (the output's memory would leak).
        self.tensor = tensor.detach()
        # Autograd skips its version check for tensors that went through hooks; we redo it.
        self.version = tensor._version

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            # Limitation: autograd's own check for a saved tensor modified in place, redone.
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{self.tensor.type()} {list(self.tensor.shape)}] is at version "
                f"{self.tensor._version}; expected version {self.version} instead."
            )
        return self.tensor


class _Delegated:
    """A tensor packed by the hook we stand in for; that hook's unpack gets it back."""

    __slots__ = ("packed", "unpack_hook")

    def __init__(self, unpack_hook: Any, packed: Any) -> None:
        self.unpack_hook = unpack_hook
        self.packed = packed

    def unpack(self) -> torch.Tensor:
        return self.unpack_hook(self.packed)


# ===================================================================================== 4. replay
# NOTE [ One replay per backward ]
# The first unpack replays the tape once, with the forward's RNG state inside a fork, and keeps the
# recomputed tensor of every slot that a live _ScopeTensorRef wants. Each is handed out, and
# dropped as soon as every reference that wanted it has it: backward then holds the only
# references. A second unpack of the same reference (retain_graph, a second backward) starts a new
# round: it replays again. A replay runs the ops up to the last one that writes a wanted tensor, all
# of them, even those whose outputs nobody wants, so that the RNG is drawn from in the forward's
# order; and it frees each intermediate as soon as no later op reads it.
#
# NOTE [ What a replay refuses ]
# A replay refuses with CheckpointError what would otherwise give silently wrong gradients:
# (1) an outside tensor modified in place since the scope read it;
# (2) a scope tensor modified in place after autograd saved it;
# (3) recomputed outputs whose number, shape, strides, storage offset, dtype or device differ.
# Modifications through .data bypass version counters, here as in autograd: (1) and (2) can't see
# them, (3) catches those that change what a recomputed tensor looks like. A scope tensor a replay
# could not reproduce is stored instead of recomputed (see _Replayer.ref_for).
class _Schedule(NamedTuple):
    """What a replay of the first ``ops`` ops needs to know, computed once per length of the tape."""

    ops: int
    last_use: dict[int, int]  # per slot: the last op reading or returning it
    last_write: dict[int, int]  # per root: the last op writing it
    first_use: dict[int, int]  # per input: the first op reading it


class _Replayer:
    """Re-runs one recording's tape for the scope tensors backward unpacks.

    See NOTE [ One replay per backward ]; a lock makes unpacks on several threads take turns.
    """

    def __init__(
        self, ops: list[_Op], slots: list[_SlotRecord], generators: dict, state: ReplayState
    ) -> None:
        # The recording's own lists: ops recorded later (an unpack inside the scope) are seen too.
        self.ops = ops
        self.slots = slots
        self.generators = generators
        self.state = state
        self.lock = threading.RLock()
        # Weak: the graph owns the references. A dead one tells the replay its tensor is not needed.
        self.refs: list[weakref.ref[_ScopeTensorRef]] = []
        self.values: dict[int, torch.Tensor] = {}
        self.pending: Counter[int] = Counter()
        self.round = 0
        self.cached_schedule: _Schedule | None = None

    def ref_for(self, tensor: torch.Tensor, root: int) -> _ScopeTensorRef | None:
        """What autograd stores for a tensor living in ``root``'s storage; None: store it normally."""
        version = tensor._version
        root_record = self.slots[root]
        # Limitation: a replay could not reproduce it. Modified in place by an op we did not record
        # (after the scope), or a conjugate or negative view (a lazy bit that _restrided would drop).
        if version != root_record.version or tensor.is_conj() or tensor.is_neg():
            return None
        geometry = (tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype)
        ref = _ScopeTensorRef(self, root, version, None if geometry == root_record.meta[:4] else geometry)
        self.refs.append(weakref.ref(ref))
        return ref

    def serve(self, ref: _ScopeTensorRef) -> torch.Tensor:
        """Unpack: the recomputed tensor for ``ref``, replaying first if this round has none."""
        with self.lock:
            version = self.slots[ref.root].version
            if version != ref.version:
                # Limitation (2) of NOTE [ What a replay refuses ].
                raise CheckpointError(
                    "gradient_checkpoint_scope: a tensor created in the scope was modified in place after "
                    f"autograd saved it (saved at version {ref.version}, the scope left it at version "
                    f"{version}). Without the scope autograd would raise too: one of the "
                    "variables needed for gradient computation has been modified by an inplace operation."
                )
            value = self.values.get(ref.root) if ref.round != self.round else None
            if value is None:
                self._replay()
                value = self.values[ref.root]
            ref.round = self.round
            self.pending[ref.root] -= 1
            if self.pending[ref.root] <= 0:
                # Every live reference to this slot has it now: backward holds the only references.
                self.values.pop(ref.root, None)
                del self.pending[ref.root]
        return value if ref.geometry is None else _restrided(value, ref.geometry)

    def _schedule(self) -> _Schedule:
        """The tape's schedule, computed again only if ops were recorded since (the scope is open)."""
        if self.cached_schedule is None or self.cached_schedule.ops != len(self.ops):
            last_use: dict[int, int] = {}
            last_write: dict[int, int] = {}
            first_use: dict[int, int] = {}
            for i, op in enumerate(self.ops):
                for arg in (*op.args, *op.kwargs.values()):
                    for slot in (arg,) if type(arg) is _Slot else arg if type(arg) is _Nested else ():
                        if type(slot) is _Slot:
                            last_use[slot] = i
                            if self.slots[slot].source is not None:
                                first_use.setdefault(slot, i)
                for slot in op.outputs:
                    last_use[slot] = i
                for slot in op.outputs + op.writes:
                    last_write[self.slots[slot].root] = i
            self.cached_schedule = _Schedule(len(self.ops), last_use, last_write, first_use)
        return self.cached_schedule

    def _replay(self) -> None:
        refs = [r for r in (ref() for ref in self.refs) if r is not None]
        self.refs = [weakref.ref(r) for r in refs]
        wanted = Counter(r.root for r in refs)
        schedule = self._schedule()
        # See NOTE [ One replay per backward ]: no op after the last write to a wanted tensor.
        stop = max(schedule.last_write[root] for root in wanted)
        frees: list[list[int]] = [[] for _ in range(stop + 1)]
        for slot, i in schedule.last_use.items():
            if i <= stop and slot not in wanted:
                frees[i].append(slot)
        values: list[Any] = [None] * len(self.slots)
        # no_grad: a replay builds no graph (backward wires the unpacked tensors to the original one).
        # The forward's RNG in a fork, autocast off: see NOTE [ RNG and autocast in a replay ].
        with torch.no_grad(), self.state.replay(), _generators_at(self.generators.values()):
            # Inputs first: if one was modified in place since, fail before running anything.
            for slot, i in schedule.first_use.items():
                if i <= stop:
                    values[slot] = self.slots[slot].source.materialize()
            for i in range(stop + 1):
                self._run(self.ops[i], values)
                for slot in frees[i]:
                    # Not needed by a later op nor by a reference: let it go now.
                    values[slot] = None
        self.values = {root: values[root] for root in wanted}
        self.pending = wanted
        self.round += 1

    def _run(self, op: _Op, values: list[Any]) -> None:
        # See NOTE [ Speed ] (d): _resolve, inlined for the positional arguments.
        args = [
            values[a] if type(a) is _Slot else a.resolve(values) if type(a) is _Nested else a for a in op.args
        ]
        kwargs = {k: _resolve(v, values) for k, v in op.kwargs.items()} if op.kwargs else op.kwargs
        out = op.func(*args, **kwargs)
        recomputed = (out,) if isinstance(out, torch.Tensor) else [t for t, _ in _outputs(out, ())]
        # Limitation (3) of NOTE [ What a replay refuses ], for both checks.
        if len(recomputed) != len(op.outputs):
            raise _replay_mismatch(op, f"{len(recomputed)} tensors", f"{len(op.outputs)}")
        for slot, tensor, meta in zip(op.outputs, recomputed, op.metas, strict=True):
            if _meta(tensor) != meta:
                raise _replay_mismatch(op, _describe(_meta(tensor)), _describe(meta))
            values[slot] = tensor


def _resolve(arg: Any, values: list[Any]) -> Any:
    """A recorded argument with the replayed tensors in place of their slots."""
    kind = type(arg)
    return values[arg] if kind is _Slot else arg.resolve(values) if kind is _Nested else arg


def _restrided(value: torch.Tensor, geometry: tuple) -> torch.Tensor:
    """The view ``geometry`` describes, on the storage of the recomputed ``value``."""
    size, stride, offset, dtype = geometry
    view = torch.empty(0, dtype=dtype, device=value.device)
    return view.set_(value.untyped_storage(), offset, size, stride)


def _describe(meta: tuple) -> str:
    shape, stride, offset, dtype, device = meta
    return f"shape={list(shape)}, stride={stride}, storage_offset={offset}, dtype={dtype}, device={device}"


def _replay_mismatch(op: _Op, got: str, recorded: str) -> CheckpointError:
    return CheckpointError(
        f"gradient_checkpoint_scope: the recomputation of {op.func} returned {got}; the forward returned "
        f"{recorded}. The replay does not reproduce the forward (an input changed without a version "
        "bump, e.g. through .data, or the op's result depends on something the scope cannot restore), "
        "and would give wrong gradients."
    )


# NOTE [ RNG and autocast in a replay ]
# Autocast is *off* during a replay: the dispatch level sits below autocast, so the recorded ops are
# already cast, and replaying them under autocast would cast again. RNG: the default CPU generator
# and every device of an already initialised accelerator are captured when the scope opens (it can't
# be known which devices the scope will draw from; each costs a few µs), and the replay draws inside
# a fork, so the caller's stream goes on untouched. An accelerator first initialised inside the scope
# is replayed from its freshly seeded state. Explicit torch.Generator arguments are set to their
# state before the scope's first draw from them, and put back after the replay.
def _capture_replay_state(preserve_rng_state: bool) -> tuple[ReplayState, str | None]:
    """RNG of the CPU and of every device of an initialised accelerator; autocast *off*.

    Also returns the accelerator's type if it is not initialised yet (see ``_seeded_states``).
    """
    accelerator = torch.accelerator.current_accelerator()
    device_types = [] if accelerator is None else [accelerator.type]
    devices: list[torch.device] = []
    uninitialised = None
    if accelerator is not None:
        if device_initialised(accelerator.type):
            # Every device: which ones the scope will draw from can't be known now.
            devices = [torch.device(accelerator.type, i) for i in range(torch.accelerator.device_count())]
        else:
            uninitialised = accelerator.type
    rng = RNGState.capture(devices) if preserve_rng_state else None
    # Off, whatever backward runs under: the recorded ops are already cast.
    settings = AutocastState.capture(device_types).settings
    autocast_off = AutocastState(tuple((t, False, dtype) for t, _, dtype in settings), cache_enabled=False)
    return ReplayState(rng=rng, autocast=autocast_off, devices=tuple(devices)), uninitialised


def _with_accelerator_initialised_inside(state: ReplayState, device_type: str | None) -> ReplayState:
    """``state``, plus the seeded generators of ``device_type`` if the scope initialised it."""
    if device_type is None or state.rng is None or not device_initialised(device_type):
        return state
    # Initialised inside the scope, so its generators started from their seeds.
    fresh = _seeded_states(device_type)
    rng = RNGState(cpu=state.rng.cpu, devices=state.rng.devices + fresh)
    return replace(state, rng=rng, devices=state.devices + tuple(d for d, _ in fresh))


def _seeded_states(device_type: str) -> tuple[tuple[torch.device, torch.Tensor], ...]:
    """The state each default generator of ``device_type`` had when it was created: its seed, offset 0.

    Blind spot: a ``set_rng_state`` queued before the device was initialised is not known here.
    """
    module = torch.get_device_module(device_type)
    states = []
    for i, generator in enumerate(getattr(module, "default_generators", ())):
        device = torch.device(device_type, i)
        seeded = torch.Generator(device=device)
        seeded.manual_seed(generator.initial_seed())
        states.append((device, seeded.get_state()))
    return tuple(states)


@contextlib.contextmanager
def _generators_at(generators: Any) -> Iterator[None]:
    """Explicit ``torch.Generator`` arguments at their recorded states; put back afterwards."""
    generators = list(generators)
    now = [(g, g.get_state()) for g, _ in generators]
    try:
        for g, state in generators:
            g.set_state(state)
        yield
    finally:
        for g, state in now:
            g.set_state(state)


# ============================================================================ 5. resident hooks
# NOTE [ Hooks that outlive the with block ]
# Our pack hook must outlive the with block: in ``with scope(): x = a + b`` then ``y = x * c``, mul
# saves x after the block has closed. But the saved-tensors-hooks stack is thread-local and strictly
# LIFO, and every ``saved_tensors_hooks.__exit__`` simply pops the top entry, whoever pushed it. So a
# scope that closes while its tensors are alive takes the stack apart and rebuilds it (_restack):
# one *resident* entry of ours at the bottom, every entry above it wrapped (a _PackHook whose
# ``below`` is the original pair: scope tensors to us, the rest to the original hook). Each
# enclosing context still pops exactly one entry, its own (its wrapper, as far as anyone can
# tell). When the last scope tensor dies, the resident entry is taken out again and the wrappers
# unwrapped, so that the stack is exactly as if we had never been there: see NOTE [ Safe points ].
# Nothing is monkey-patched.
#
# A saved_tensors_hooks entered *after* the scope closed is the innermost hook while it is active,
# so scope tensors saved then go to it, not to us: the innermost hook wins, as always.
#
# NOTE [ Safe points ]
# The resident entry is taken out only at a safe point (a scope opens and closes at one: the entry
# point sees to that):
# * on the thread that owns it (it is thread-local);
# * outside any of our hooks (see NOTE [ Per-thread state ]);
# * outside backward: the autograd engine restores the thread-local hooks stack after every node,
#   silently undoing any change made there.
# So the resident entry normally goes as soon as the last scope tensor is freed; a death inside
# backward retries right after that backward (_AfterBackward). One on another thread (or the engine
# dropping its graph task on a device thread, as it may on CUDA) waits for the owning thread's next
# safe point: a scope tensor freed there, a scope opened or closed there. Until then the resident
# entry merely stores what it is given (and torch.compile would see a hook).
def _top() -> tuple[Any, Any] | None:
    # True: the real top, even while a compiler traces (with False it would read as empty then).
    return _top_saved_tensors_default_hooks(True)


class _ResidentHooks:
    """One per thread: the scope open on it, its recordings whose tensors may still be saved, and
    our resident entry on its hooks stack."""

    def __init__(self) -> None:
        self.owner = threading.get_ident()
        self.open: _Recording | None = None
        # Recordings open, or with a storage still alive: while any, the resident entry must stay.
        self.live_recordings: set[_Recording] = set()
        self.resident: _PackHook | None = None
        self.busy = False  # rebuilding the stack right now (a finalizer must not start another rebuild)
        self.retry_after = -1  # the backward (graph task) after which we try again

    @staticmethod
    def of_this_thread() -> _ResidentHooks:
        hooks = _thread.hooks
        if hooks is None:
            hooks = _thread.hooks = _ResidentHooks()
        return hooks

    def open_scope(self, recording: _Recording) -> _PackHook:
        # A safe point: a removal deferred earlier can happen now.
        self.release_if_idle()
        top = _top()
        # On top of an entry of ours, skip it: it would only ask the same question again.
        below = top[0].below if top is not None and isinstance(top[0], _PackHook) else top
        entry = _PackHook(below)
        _push_saved_tensors_default_hooks(entry, _unpack)
        self.open = recording
        self.live_recordings.add(recording)
        return entry

    def close_scope(self, recording: _Recording, entry: _PackHook, failed: bool) -> None:
        self.open = None
        recording.close(failed)
        self.busy = True
        try:
            self.resident = _restack(self.resident, keep=bool(self.live_recordings), drop=entry)
        finally:
            self.busy = False
        # A storage freed while we were rebuilding could not release anything then.
        self.release_if_idle()

    def forget(self, recording: _Recording) -> None:
        """``recording``'s last storage died: maybe remove the resident entry."""
        self.live_recordings.discard(recording)
        self.release_if_idle()

    def release_if_idle(self) -> None:
        """Remove the resident entry if no recording needs it, at a safe point (see NOTE [ Safe points ])."""
        if self.live_recordings or self.resident is None or self.busy:
            return
        task = torch._C._current_graph_task_id()
        if task != -1:
            # Not a safe point: inside backward (typically: the last reference to a later scope
            # died, and with it the earlier scope tensor it kept). Try again once it is over.
            if task != self.retry_after:
                self.retry_after = task
                try:
                    torch.autograd.Variable._execution_engine.queue_callback(_AfterBackward(self))
                except RuntimeError:
                    pass  # no callbacks here (an unusual engine): the next safe point will do it
            return
        # Not a safe point: another thread, inside a hook, or hooks disabled (we could not pop).
        if threading.get_ident() != self.owner or _thread.in_hook or not _saved_tensors_hooks_is_enabled():
            return
        self.busy = True
        try:
            self.resident = _restack(self.resident, keep=False)
        finally:
            self.busy = False


def _restack(resident: _PackHook | None, keep: bool, drop: _PackHook | None = None) -> _PackHook | None:
    """Make this thread's stack right, without ``drop`` (a closing scope's entry); return the
    resident entry. See NOTE [ Hooks that outlive the with block ].

    ``keep`` (live recordings): our resident entry at the bottom, every other entry ours or wrapped.
    Otherwise no resident entry, and every wrapper replaced by the original it stands in for.
    """
    top = _top()
    # The common cases touch only the top of the stack.
    if drop is not None and top is not None and top[0] is drop:
        _pop_saved_tensors_default_hooks()
        top, drop = _top(), None
    if not _saved_tensors_hooks_is_enabled():
        # Limitation: someone disabled saved-tensor hooks (functorch, a compiler): pushing would fail,
        # so there is no resident entry; scope tensors saved from now on are simply stored.
        return resident
    if drop is None:
        if keep and resident is not None and top is not None and isinstance(top[0], _PackHook):
            return resident  # entries of ours all the way down to the resident one
        if not keep and resident is None:
            return None
        if not keep and top is not None and top[0] is resident:
            _pop_saved_tensors_default_hooks()
            return None
    # Otherwise take the whole stack apart (these are all enclosing contexts) and rebuild it.
    entries = []
    while (top := _top()) is not None:
        _pop_saved_tensors_default_hooks()
        entries.append(top)
    resident = (resident or _PackHook(None)) if keep else None
    if resident is not None:
        _push_saved_tensors_default_hooks(resident, _unpack)
    for pack, unpack in reversed(entries):
        if isinstance(pack, _PackHook):
            if pack.below is None or pack is drop:
                continue  # an old resident entry, or the closing scope's own
            if not keep:
                pack, unpack = pack.below
        elif keep:
            # Its owner will pop this wrapper on exit, as it would have popped its own entry.
            pack, unpack = _PackHook((pack, unpack)), _unpack
        _push_saved_tensors_default_hooks(pack, unpack)
    return resident


class _AfterBackward:
    """A final callback for the autograd engine that does nothing when called: its use is its death.

    It is called at the end of backward, but still under the engine's thread-local state guard, so
    a change to the hooks stack would be undone. The engine drops it with the graph task, after
    backward has returned, normally on the thread that called backward: a safe point there.
    """

    __slots__ = ("hooks",)

    def __init__(self, hooks: _ResidentHooks) -> None:
        self.hooks = hooks

    def __call__(self) -> None:
        pass

    def __del__(self) -> None:
        # At interpreter exit there is nothing left to restore.
        if not sys.is_finalizing():
            self.hooks.release_if_idle()


def leftovers() -> dict[str, Any]:
    """What scopes still hold: storages registered for the pack hook to recognise (any thread), and
    this thread's resident hooks (an entry on the stack, a live recording, an open scope). Once every
    scope tensor is freed, both must be gone; ``ckpt_lab.instruments.state`` checks it."""
    hooks = _thread.hooks
    held = hooks is not None and bool(hooks.live_recordings or hooks.resident is not None or hooks.open)
    return {"scope_storages_registered": len(_OWNERS), "scope_hooks_held": held}
