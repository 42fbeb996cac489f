"""A scope that names what to recompute: ``gradient_checkpoint_scope``.

Introduced in notebook 04. Same semantics as RETURNN's
``returnn.torch.util.gradient_checkpoint.gradient_checkpoint_scope``, written from scratch.

``torch.utils.checkpoint`` (and ``ckpt_lab.checkpoint``) take a *function*: they store what goes in
and what comes out, and recompute what lies between. This scope turns the question around and names
what to *recompute*: every tensor created inside it::

    with gradient_checkpoint_scope():
        x = a + b
    y = x * c        # autograd saves a small handle instead of x; backward re-runs a + b

With ``checkpoint(lambda a, b: a + b, a, b)``, ``x`` is the checkpoint's *output*, and ``x * c``
saves it: it stays alive until backward. Here ``x`` itself is recomputed, so it is freed as soon as
the user drops it.

Three pieces:

* ``_RecordingMode``, a ``TorchDispatchMode``, writes every aten op run inside the scope into a
  ``_Recording``: the op, its arguments (tensors made in the scope by slot number, others by
  reference) and its outputs' metadata. RNG state is captured once, when the scope opens.
* ``_Pack``, a pack hook, recognises a tensor made in the scope by its *storage* (so views of it
  count too, wherever they were made) and gives autograd a ``_Handle`` instead. The first unpack
  replays the whole recording once, with the forward's RNG state inside a fork, and hands the
  recomputed tensors out; each is dropped as soon as every handle that wanted it has it.
* ``_ResidentHooks`` does the hard part: the hook must outlive the ``with`` block (``x * c`` above
  runs after it), but the saved-tensors-hooks stack is thread-local and strictly LIFO, and every
  ``saved_tensors_hooks.__exit__`` simply pops the top entry. So a scope that closes while its
  tensors are alive takes the stack apart and rebuilds it: one *resident* entry of ours at the
  bottom, every entry above it wrapped (scope tensors to us, the rest to the original hook). Each
  enclosing context still pops exactly one entry, its own. When the last scope tensor dies, the
  resident entry is taken out again and the wrappers unwrapped (the stack is exactly as if we had
  never been there), but only at a *safe point*: on the owning thread, outside any hook, and outside
  backward (the autograd engine restores the thread-local hooks stack after every node, silently
  undoing any change made there). A death inside backward retries once backward has returned
  (``_AfterBackward``); one on another thread waits for the owning thread's next safe point (a
  scope tensor freed there, a scope opened or closed there). Nothing is monkey-patched.

Costs and limitations:

* Tensors from outside the scope that a replay reads (inputs, parameters) are kept by strong
  reference until every handle and scope tensor is gone: an input nothing else keeps (``a`` in
  ``a + b``, which ``add`` does not save) lives until backward. That includes tensors made by an
  earlier scope and read by a later one (in a chain of scoped layers: the layer boundaries, which a
  checkpoint stores too); see ``_Recording._add_input`` for why. Outside tensors written in place
  inside the scope (BatchNorm running statistics, ``buf.add_(1)``) are copied once, before the first
  write, so a replay writes into the copy; a large buffer costs its size.
* A replay checks, and refuses with ``CheckpointError``, what would otherwise give silently wrong
  gradients: an outside tensor modified in place since the scope read it, a scope tensor modified
  in place after autograd saved it, recomputed outputs whose shape, strides, dtype or device differ.
  Modifications through ``.data`` bypass version counters, here as in autograd.
* Autocast is *off* during a replay: the dispatch level sits below autocast, so the recorded ops are
  already cast. RNG: the default CPU generator and every device of an already initialised
  accelerator are captured when the scope opens; an accelerator first initialised inside the scope
  is replayed from its freshly seeded state. Explicit ``torch.Generator`` arguments are restored too.
* Scopes nested on one thread act as one (the outer one already records everything). Inside a
  checkpointed function (``torch.utils.checkpoint``, ``ckpt_lab.checkpoint``), inside backward,
  inside a saved-tensor hook, or with grad disabled, the scope does nothing.
* A ``saved_tensors_hooks`` entered *after* the scope closed is the innermost hook while it is
  active, so scope tensors saved then go to it, not to us: the innermost hook wins, as always.
* The resident entry normally goes as soon as the last scope tensor is freed, or right after the
  backward in which that happened. If it is freed on another thread (or the engine drops its graph
  task on a device thread, as it may on CUDA), the entry stays until the owning thread's next safe
  point; until then it merely stores what it is given (and ``torch.compile`` would see a hook).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, NamedTuple

import torch
from torch._C._autograd import (
    _pop_saved_tensors_default_hooks,
    _push_saved_tensors_default_hooks,
    _saved_tensors_hooks_is_enabled,
    _top_saved_tensors_default_hooks,
)
from torch.utils._python_dispatch import TorchDispatchMode

from ckpt_lab.nonreentrant import CheckpointError
from ckpt_lab.rng import AutocastState, ReplayState, RNGState, device_initialised

__all__ = ["gradient_checkpoint_scope"]


# ---------------------------------------------------------------------------------------- op facts
class _OpInfo(NamedTuple):
    """What an aten op's schema says, looked up once per op."""

    func: Any  # kept so that its id, our key, stays valid
    # (position, name, marked) of each argument the op writes in place; marked: the schema says so
    # (``Tensor(a!)``), and then autograd bumps the argument's version counter once the op returns.
    writes: tuple[tuple[int, str, bool], ...]
    fresh: tuple[bool, ...]  # per return: True if it is new memory, False if it aliases an argument


# Ops that write into arguments their schema does not mark as written (``Tensor?`` not ``Tensor(a!)``):
# in training mode they update the running statistics in place, without a version bump.
_RUNNING_STATS = ((3, "running_mean", False), (4, "running_var", False))
_UNMARKED_WRITES = {
    torch.ops.aten.native_batch_norm: _RUNNING_STATS,
    torch.ops.aten.cudnn_batch_norm: _RUNNING_STATS,
    torch.ops.aten.miopen_batch_norm: _RUNNING_STATS,
}
# Keyed by id: an OpOverload's __hash__ is a Python method, too slow to call once per op.
_OP_INFO: dict[int, _OpInfo] = {}


def _op_info(func: Any) -> _OpInfo:
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
        info = _OP_INFO[id(func)] = _OpInfo(func, writes, fresh)
    return info


def _outputs(out: Any, fresh: tuple[bool, ...]) -> list[tuple[torch.Tensor, bool]]:
    """The tensors an op returned, flat and in order, each with its ``fresh`` flag (no pytree: too slow)."""
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


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        # Sparse tensors and wrapper subclasses have no storage of their own: never scope tensors.
        return None


def _meta(tensor: torch.Tensor) -> tuple:
    """What a replay must reproduce exactly: shape, strides, storage offset, dtype, device."""
    try:
        return (tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype, tensor.device)
    except (RuntimeError, NotImplementedError):
        return (tensor.shape, None, None, tensor.dtype, tensor.device)


# ------------------------------------------------------------------------------------ thread state
class _ThreadState(threading.local):
    # > 0 while one of our hooks or a replay runs on this thread: ops run then are not recorded, and
    # the hooks stack is not touched (exiting hooks from inside a hook can crash, pytorch#130734).
    depth = 0
    hooks: _ResidentHooks | None = None


_thread = _ThreadState()


# ----------------------------------------------------------------------------- what autograd stores
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


class _Handle:
    """What autograd stores for a scope tensor: its recording, the slot whose storage it lives in,
    its version when saved, and its geometry if it is a view (``None``: the slot's tensor itself)."""

    __slots__ = ("__weakref__", "geometry", "recording", "root", "round", "version")

    def __init__(self, recording: _Recording, root: int, version: int, geometry: tuple | None) -> None:
        self.recording = recording
        self.root = root
        self.version = version
        self.geometry = geometry
        self.round = -1  # the last replay that served this handle

    def unpack(self) -> torch.Tensor:
        return self.recording.serve(self)


def _restrided(value: torch.Tensor, geometry: tuple) -> torch.Tensor:
    """The view ``geometry`` describes, on the storage of the recomputed ``value``."""
    size, stride, offset, dtype = geometry
    view = torch.empty(0, dtype=dtype, device=value.device)
    return view.set_(value.untyped_storage(), offset, size, stride)


# ---------------------------------------------------------------------------- inputs of a recording
class _Borrowed:
    """A tensor from outside the scope that the replay reads: kept by reference, checked by version."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version

    def materialize(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise CheckpointError(
                "gradient_checkpoint_scope: a tensor from outside the scope, read inside it, was modified "
                f"in place before backward recomputed the scope (version {self.tensor._version}, read at "
                f"version {self.version}; shape {list(self.tensor.shape)}). The recomputation would read "
                "the new values and give wrong gradients. Modify it out of place, or after backward."
            )
        return self.tensor


class _Snapshot:
    """An input the scope writes to in place, copied just before the first write: each replay writes
    into a copy of this copy, and the input itself is updated exactly once, by the forward."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.clone()

    def materialize(self) -> torch.Tensor:
        return self.tensor.clone()


class _Slot(int):
    """A slot number of a recording. In a recorded op's arguments it stands for the slot's tensor (an
    int of its own type, so that it can't be mistaken for an int argument)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"_Slot({int(self)})"


class _Nested(tuple):
    """A list argument with tensors in it (``torch.cat([a, b])``), as a recording keeps it."""

    __slots__ = ()

    def resolve(self, values: list[Any]) -> list[Any]:
        return [values[a] if type(a) is _Slot else a for a in self]


def _resolve(arg: Any, values: list[Any]) -> Any:
    """A recorded argument with the replayed tensors in place of their slots."""
    kind = type(arg)
    return values[arg] if kind is _Slot else arg.resolve(values) if kind is _Nested else arg


class _Op(NamedTuple):
    func: Any
    args: tuple  # tensors replaced by their slots
    kwargs: dict
    outputs: tuple[_Slot, ...]  # the slot of each tensor it returned
    metas: tuple[tuple, ...]  # and that tensor's metadata, for the replay's check
    writes: tuple[_Slot, ...]  # slots it writes in place


class _Owner(weakref.ref):
    """A weak reference to a storage a scope created, naming the recording and the slot that own it."""

    __slots__ = ("key", "recording", "root")


# id(storage) -> its owner. Process-wide, so a scope tensor saved by any thread is recognised. A
# storage's Python object lives exactly as long as the storage, so its id is a valid key while it
# lives, and the weakref callback removes the entry before the id can be reused.
_OWNERS: dict[int, _Owner] = {}


def _storage_died(owner: _Owner) -> None:
    # Identity check: the entry may have been forgotten already (after an exception in the scope).
    if _OWNERS.get(owner.key) is owner:
        del _OWNERS[owner.key]
        owner.recording.storage_released(owner.key)


_NO_KWARGS: dict = {}


# -------------------------------------------------------------------------------------- recording
class _Recording:
    """The ops of one scope, in order, and everything needed to replay them once per backward."""

    def __init__(self, hooks: _ResidentHooks, preserve_rng_state: bool) -> None:
        self.hooks = hooks
        self.ops: list[_Op] = []
        # Per slot: None for a tensor an op made, else how a replay gets it (_Borrowed or _Snapshot).
        self.sources: list[Any] = []
        # Per slot: the slot whose storage it lives in (itself for new memory and for inputs).
        self.roots: list[_Slot] = []
        # Per slot owning new memory: its version after the last recorded op, and its metadata.
        self.versions: dict[int, int] = {}
        self.root_metas: dict[int, tuple] = {}
        # While recording: id(tensor) -> (weakref, slot). Weak, or the scope would keep its tensors.
        self.by_id: dict[int, tuple[weakref.ref, _Slot]] = {}
        # Keys of our entries in _OWNERS whose storages are alive. A set: add and discard are atomic,
        # and storages die on any thread.
        self.alive: set[int] = set()
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self.open = True
        # Replay state: one replay serves every live handle; a second unpack of a handle replays again.
        self.lock = threading.RLock()
        self.handles: list[weakref.ref[_Handle]] = []
        self.values: dict[int, torch.Tensor] = {}
        self.pending: Counter[int] = Counter()
        self.round = 0
        self.plan: tuple[int, dict[int, int], dict[int, int], dict[int, int]] | None = None
        self.state, self.uninitialised = _capture_replay_state(preserve_rng_state)

    # ------------------------------------------------------------------ forward: recording
    def encode(self, value: Any) -> Any:
        """An argument as the recording keeps it: each tensor becomes its slot."""
        if isinstance(value, torch.Tensor):
            entry = self.by_id.get(id(value))
            # The weakref tells the tensor apart from a new one that got the id of a dead one.
            return entry[1] if entry is not None and entry[0]() is value else self._add_input(value)
        if type(value) in (list, tuple) and any(isinstance(v, torch.Tensor) for v in value):
            return _Nested([self.encode(v) for v in value])
        return value

    def _add_input(self, tensor: torch.Tensor) -> _Slot:
        """A slot for a tensor from outside the scope.

        That includes tensors made by an earlier scope: we keep those too. A handle instead would
        make our replay start with that scope's, which would hold all of *its* recomputed tensors
        while backward goes through ours, and so on down a chain of scoped layers: peak memory as
        without any checkpointing. Kept, they are the layer boundaries a checkpoint stores anyway.
        """
        return self._add_slot(tensor, _Borrowed(tensor), None)

    def _add_slot(self, tensor: torch.Tensor, source: Any, root: _Slot | None) -> _Slot:
        slot = _Slot(len(self.sources))
        self.sources.append(source)
        self.roots.append(slot if root is None else root)
        self.by_id[id(tensor)] = (weakref.ref(tensor), slot)
        return slot

    def before(self, info: _OpInfo, args: tuple, kwargs: dict) -> list[tuple[_Slot, int]]:
        """Called before the op runs: copy outside tensors it is about to write to.

        Returns (slot, version it will have after the op) for each tensor written.
        """
        written = []
        for position, name, marked in info.writes:
            value = args[position] if position < len(args) else kwargs.get(name)
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, torch.Tensor):
                    # The bump happens above us (ADInplaceOrView), after the op returns to autograd.
                    written.append((self._before_write(tensor), tensor._version + marked))
        return written

    def _before_write(self, tensor: torch.Tensor) -> _Slot:
        slot = self.encode(tensor)
        root = self.roots[slot]
        source = self.sources[root]
        if isinstance(source, _Borrowed):
            owner = _OWNERS.get(id(_storage(source.tensor)))
            if owner is not None and owner.recording is self:
                raise CheckpointError(
                    "gradient_checkpoint_scope: an in-place write through an alias the scope did not "
                    "create (.data?) into a tensor the scope did create cannot be replayed."
                )
            if source.tensor._version != source.version:
                raise CheckpointError(
                    "gradient_checkpoint_scope: a tensor from outside the scope changed between the "
                    "scope reading it and writing to it, by an op the scope did not see."
                )
            # Copy it now, before its first write (views of it made earlier are replayed as views of
            # the copy, so they see the write too).
            self.sources[root] = _Snapshot(source.tensor)
        return slot

    def note_generators(self, kwargs: dict) -> None:
        """Called before the op runs: remember the state of an explicit generator it draws from."""
        for value in kwargs.values():
            if isinstance(value, torch.Generator) and id(value) not in self.generators:
                self.generators[id(value)] = (value, value.get_state())

    def record(
        self, func: Any, info: _OpInfo, args: tuple, kwargs: dict, out: Any, written: list[tuple[_Slot, int]]
    ) -> None:
        """Called after the op ran: append it, and give every new tensor it returned a slot."""
        # (The common case, one tensor returned, without a call: this runs once per op.)
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
                root = self.roots[slot]
                if root in self.versions:
                    # Views share their base's version counter: this is the root's version after the op.
                    self.versions[root] = version
        # tuple.__new__ rather than _Op(...): a NamedTuple's __new__ is a Python function.
        self.ops.append(tuple.__new__(_Op, (func, args, kwargs, tuple(slots), tuple(metas), writes)))

    def _add_output(self, tensor: torch.Tensor, fresh: bool, args: tuple, meta: tuple) -> _Slot:
        storage = _storage(tensor) if fresh else None
        owner = _OWNERS.get(id(storage))
        if storage is not None and owner is None:
            # New memory: this is what the scope exists for. Register it so the pack hook knows it.
            slot = _Slot(len(self.sources))
            self.sources.append(None)
            self.roots.append(slot)
            self.by_id[id(tensor)] = (weakref.ref(tensor), slot)
            owner = _Owner(storage, _storage_died)
            owner.key, owner.recording, owner.root = id(storage), self, slot
            _OWNERS[owner.key] = owner
            self.alive.add(owner.key)
            self.versions[slot] = tensor._version
            self.root_metas[slot] = meta
            return slot
        # A view (or an alias the schema does not declare, like _unsafe_view): it lives in the storage
        # of the slot that owns it, or else in that of the op's first tensor argument.
        if owner is not None and owner.recording is self:
            root = owner.root
        else:
            base = next((a for a in args if type(a) is _Slot), None)
            root = None if base is None else self.roots[base]
        return self._add_slot(tensor, None, root)

    def close(self, failed: bool) -> None:
        """The scope's ``with`` block ended (``failed``: by an exception)."""
        self.open = False
        # Identities are only needed while ops are still being recorded.
        self.by_id = {}
        self._add_accelerators_initialised_inside()
        # Safety net for schemas that lie: an output we took for new memory but that shares an
        # outside tensor's storage would keep this recording alive as long as that tensor lives.
        borrowed = {id(_storage(s.tensor)) for s in self.sources if isinstance(s, _Borrowed)}
        for key in list(self.alive) if failed else self.alive & borrowed:
            # After an exception no new handles: scope tensors still alive are stored normally.
            owner = _OWNERS.get(key)
            if owner is not None and owner.recording is self:
                del _OWNERS[key]
            self.alive.discard(key)
        if not self.alive:
            self.hooks.live.discard(self)

    def storage_released(self, key: int) -> None:
        """A storage this scope created was freed (on any thread)."""
        self.alive.discard(key)
        if not self.alive and not self.open:
            self.hooks.forget(self)

    def _add_accelerators_initialised_inside(self) -> None:
        if self.uninitialised is None or self.state.rng is None or not device_initialised(self.uninitialised):
            return
        # The device was initialised inside the scope, so its generators started from their seeds.
        fresh = _seeded_states(self.uninitialised)
        rng = RNGState(cpu=self.state.rng.cpu, devices=self.state.rng.devices + fresh)
        self.state = replace(self.state, rng=rng, devices=self.state.devices + tuple(d for d, _ in fresh))

    # ------------------------------------------------------------------ backward: replaying
    def handle_for(self, tensor: torch.Tensor, root: int) -> _Handle | None:
        """A handle for a tensor living in ``root``'s storage, or None if a replay can't reproduce it."""
        version = tensor._version
        # Modified in place by an op we did not record (after the scope): store it normally.
        if version != self.versions[root] or tensor.is_conj() or tensor.is_neg():
            return None
        geometry = (tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype)
        handle = _Handle(self, root, version, None if geometry == self.root_metas[root][:4] else geometry)
        # Weak: the graph owns the handle. A dead handle tells the replay its tensor is not needed.
        self.handles.append(weakref.ref(handle))
        return handle

    def serve(self, handle: _Handle) -> torch.Tensor:
        """Unpack: the recomputed tensor for ``handle``, replaying first if this round has none."""
        with self.lock:
            if self.versions[handle.root] != handle.version:
                raise CheckpointError(
                    "gradient_checkpoint_scope: a tensor created in the scope was modified in place after "
                    f"autograd saved it (saved at version {handle.version}, the scope left it at version "
                    f"{self.versions[handle.root]}). Without the scope autograd would raise too: one of the "
                    "variables needed for gradient computation has been modified by an inplace operation."
                )
            value = self.values.get(handle.root) if handle.round != self.round else None
            if value is None:
                self._replay()
                value = self.values[handle.root]
            handle.round = self.round
            self.pending[handle.root] -= 1
            if self.pending[handle.root] <= 0:
                # Every live handle of this slot has it now: backward holds the only references.
                self.values.pop(handle.root, None)
                del self.pending[handle.root]
        return value if handle.geometry is None else _restrided(value, handle.geometry)

    def _plan(self) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
        """Per slot the last op reading it; per root the last op writing it; per input the first reader."""
        if self.plan is None or self.plan[0] != len(self.ops):
            last_use: dict[int, int] = {}
            last_write: dict[int, int] = {}
            first_use: dict[int, int] = {}
            for i, op in enumerate(self.ops):
                for arg in (*op.args, *op.kwargs.values()):
                    for slot in (arg,) if type(arg) is _Slot else arg if type(arg) is _Nested else ():
                        if type(slot) is _Slot:
                            last_use[slot] = i
                            if self.sources[slot] is not None:
                                first_use.setdefault(slot, i)
                for slot in op.outputs:
                    last_use[slot] = i
                for slot in op.outputs + op.writes:
                    last_write[self.roots[slot]] = i
            self.plan = (len(self.ops), last_use, last_write, first_use)
        return self.plan[1:]

    def _replay(self) -> None:
        handles = [h for h in (ref() for ref in self.handles) if h is not None]
        self.handles = [weakref.ref(h) for h in handles]
        wanted = Counter(h.root for h in handles)
        last_use, last_write, first_use = self._plan()
        # Ops after the last write to a wanted tensor are needed by no one; earlier ones all run, even
        # those whose outputs are unused, so that the RNG is drawn from in the forward's order.
        stop = max(last_write[root] for root in wanted)
        frees: list[list[int]] = [[] for _ in range(stop + 1)]
        for slot, i in last_use.items():
            if i <= stop and slot not in wanted:
                frees[i].append(slot)
        values: list[Any] = [None] * len(self.sources)
        # no_grad: a replay builds no graph (backward wires the unpacked tensors to the original one).
        with torch.no_grad(), self.state.replay(), _generators_at(self.generators.values()):
            # Inputs first: if one was modified in place since, fail before running anything.
            for slot, i in first_use.items():
                if i <= stop:
                    values[slot] = self.sources[slot].materialize()
            for i in range(stop + 1):
                self._run(self.ops[i], values)
                for slot in frees[i]:
                    # Not needed by a later op nor by a handle: let it go now.
                    values[slot] = None
        self.values = {root: values[root] for root in wanted}
        self.pending = wanted
        self.round += 1

    def _run(self, op: _Op, values: list[Any]) -> None:
        # _resolve, inlined: this runs once per argument of every replayed op.
        args = [
            values[a] if type(a) is _Slot else a.resolve(values) if type(a) is _Nested else a for a in op.args
        ]
        kwargs = {k: _resolve(v, values) for k, v in op.kwargs.items()} if op.kwargs else op.kwargs
        out = op.func(*args, **kwargs)
        recomputed = (out,) if isinstance(out, torch.Tensor) else [t for t, _ in _outputs(out, ())]
        if len(recomputed) != len(op.outputs):
            raise _mismatch(op, f"{len(recomputed)} tensors", f"{len(op.outputs)}")
        for slot, tensor, meta in zip(op.outputs, recomputed, op.metas, strict=True):
            if _meta(tensor) != meta:
                raise _mismatch(op, _describe(_meta(tensor)), _describe(meta))
            values[slot] = tensor


def _describe(meta: tuple) -> str:
    shape, stride, offset, dtype, device = meta
    return f"shape={list(shape)}, stride={stride}, storage_offset={offset}, dtype={dtype}, device={device}"


def _mismatch(op: _Op, got: str, recorded: str) -> CheckpointError:
    return CheckpointError(
        f"gradient_checkpoint_scope: the recomputation of {op.func} returned {got}; the forward returned "
        f"{recorded}. The replay does not reproduce the forward (an input changed without a version "
        "bump, e.g. through .data, or the op's result depends on something the scope cannot restore), "
        "and would give wrong gradients."
    )


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
            # We can't know which devices the scope will draw from: capturing all costs a few µs each.
            devices = [torch.device(accelerator.type, i) for i in range(torch.accelerator.device_count())]
        else:
            uninitialised = accelerator.type
    rng = RNGState.capture(devices) if preserve_rng_state else None
    # The recorded ops ran below autocast, i.e. already cast: replaying them under autocast would
    # cast again. So the replay runs with autocast off, whatever backward runs under.
    settings = AutocastState.capture(device_types).settings
    autocast_off = AutocastState(tuple((t, False, dtype) for t, _, dtype in settings), cache_enabled=False)
    return ReplayState(rng=rng, autocast=autocast_off, devices=tuple(devices)), uninitialised


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


# ------------------------------------------------------------------------------------ dispatch mode
class _RecordingMode(TorchDispatchMode):
    """Records every aten op run inside the scope (below autograd: what the backend really ran)."""

    def __init__(self, recording: _Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or _NO_KWARGS
        if _thread.depth:
            # An op run by a hook (save_on_cpu's copy) or by a replay: not part of the forward.
            return func(*args, **kwargs)
        recording = self.recording
        info = _OP_INFO.get(id(func)) or _op_info(func)
        written = recording.before(info, args, kwargs) if info.writes else []
        if kwargs:
            recording.note_generators(kwargs)
        out = func(*args, **kwargs)
        recording.record(func, info, args, kwargs, out, written)
        return out


# ------------------------------------------------------------------------------- the hooks stack
def _top() -> tuple[Any, Any] | None:
    # True: the real top, even while a compiler traces (with False it would read as empty then).
    return _top_saved_tensors_default_hooks(True)


class _Pack:
    """Our pack hook, one object per entry of ours on the stack: a scope's own entry while it is
    open, the resident entry (``below`` is None), or a wrapper standing in for another hook."""

    __slots__ = ("below",)

    def __init__(self, below: tuple[Any, Any] | None) -> None:
        # The (pack, unpack) pair that gets tensors not made in a scope; None: store them ourselves.
        self.below = below

    def __call__(self, tensor: torch.Tensor) -> Any:
        _thread.depth += 1
        try:
            # By storage: views of a scope tensor count too, wherever they were made (Linear on a 3-d
            # input saves a view of it). id(None) is never a key.
            owner = _OWNERS.get(id(_storage(tensor)))
            handle = owner.recording.handle_for(tensor, owner.root) if owner is not None else None
            if handle is not None:
                return handle
            if self.below is None:
                return _Stored(tensor)
            pack, unpack = self.below
            return _Delegated(unpack, pack(tensor))
        finally:
            _thread.depth -= 1


# Checkpoints whose backward re-runs their function and matches what it saves to what the forward
# saved, by position. A scope inside their region would save differently in the forward than in that
# re-run (inside backward a scope does nothing): silently wrong gradients. So inside their region a
# scope does nothing: the checkpoint recomputes everything there anyway.
_RECOMPUTING_CHECKPOINTS = ("torch.utils.checkpoint", "ckpt_lab.nonreentrant")


def _inside_a_checkpoint() -> bool:
    """Whether the hook of such a checkpoint is on the stack (above our entries: it can't be below)."""
    if not _saved_tensors_hooks_is_enabled():
        return False  # we could not push back what we pop; and the scope's own push will fail anyway
    popped = []
    try:
        while (top := _top()) is not None and not isinstance(top[0], _Pack):
            if getattr(top[0], "__module__", None) in _RECOMPUTING_CHECKPOINTS:
                return True
            # Look below it (typically a save_on_cpu inside a checkpointed function).
            _pop_saved_tensors_default_hooks()
            popped.append(top)
        return False
    finally:
        for pack, unpack in reversed(popped):
            _push_saved_tensors_default_hooks(pack, unpack)


def _unpack(packed: _Handle | _Stored | _Delegated) -> torch.Tensor:
    """The unpack hook of every entry of ours: each packed value knows how to give its tensor back."""
    _thread.depth += 1
    try:
        return packed.unpack()
    finally:
        _thread.depth -= 1


class _ResidentHooks:
    """One per thread: the scope open on it, its recordings whose tensors may still be saved, and
    our resident entry on its hooks stack."""

    def __init__(self) -> None:
        self.owner = threading.get_ident()
        self.open: _Recording | None = None
        # Recordings open, or with a storage still alive: while any, the resident entry must stay.
        self.live: set[_Recording] = set()
        self.resident: _Pack | None = None
        self.busy = False  # rebuilding the stack right now (a finalizer must not start another rebuild)
        self.retry_after = -1  # the backward (graph task) after which we try again

    @staticmethod
    def of_this_thread() -> _ResidentHooks:
        hooks = _thread.hooks
        if hooks is None:
            hooks = _thread.hooks = _ResidentHooks()
        return hooks

    def open_scope(self, recording: _Recording) -> _Pack:
        # A safe point: a removal deferred earlier can happen now.
        self.release_if_idle()
        top = _top()
        # On top of an entry of ours, skip it: it would only ask the same question again.
        below = top[0].below if top is not None and isinstance(top[0], _Pack) else top
        entry = _Pack(below)
        _push_saved_tensors_default_hooks(entry, _unpack)
        self.open = recording
        self.live.add(recording)
        return entry

    def close_scope(self, recording: _Recording, entry: _Pack, failed: bool) -> None:
        self.open = None
        recording.close(failed)
        self.busy = True
        try:
            self._restack(drop=entry)
        finally:
            self.busy = False
        # A storage freed while we were rebuilding could not release anything then.
        self.release_if_idle()

    def forget(self, recording: _Recording) -> None:
        """``recording``'s last storage died: maybe remove the resident entry."""
        self.live.discard(recording)
        self.release_if_idle()

    def release_if_idle(self) -> None:
        if self.live or self.resident is None or self.busy:
            return
        task = torch._C._current_graph_task_id()
        if task != -1:
            # Inside backward (typically: the last handle of a later scope died, and with it the
            # earlier scope tensor it kept): try again once this backward is over.
            if task != self.retry_after:
                self.retry_after = task
                try:
                    torch.autograd.Variable._execution_engine.queue_callback(_AfterBackward(self))
                except RuntimeError:
                    pass  # no callbacks here (an unusual engine): the next safe point will do it
            return
        # Only at a safe point; otherwise the next one will do it.
        if threading.get_ident() != self.owner or _thread.depth or not _saved_tensors_hooks_is_enabled():
            return
        self.busy = True
        try:
            self._restack()
        finally:
            self.busy = False

    def _restack(self, drop: _Pack | None = None) -> None:
        """Make the stack right for ``self.live``, without ``drop`` (a closing scope's entry).

        Live recordings: our resident entry at the bottom, every other entry ours or wrapped. None: no
        resident entry, and every wrapper replaced by the original it stands in for.
        """
        keep = bool(self.live)
        top = _top()
        # The common cases touch only the top of the stack.
        if drop is not None and top is not None and top[0] is drop:
            _pop_saved_tensors_default_hooks()
            top, drop = _top(), None
        if not _saved_tensors_hooks_is_enabled():
            # Someone disabled saved-tensor hooks (functorch, a compiler): pushing would fail, so
            # there is no resident entry; scope tensors saved from now on are simply stored.
            return
        if drop is None:
            if keep and self.resident is not None and top is not None and isinstance(top[0], _Pack):
                return  # entries of ours all the way down to the resident one
            if not keep and self.resident is None:
                return
            if not keep and top is not None and top[0] is self.resident:
                _pop_saved_tensors_default_hooks()
                self.resident = None
                return
        # Otherwise take the whole stack apart (these are all enclosing contexts) and rebuild it.
        entries = []
        while (top := _top()) is not None:
            _pop_saved_tensors_default_hooks()
            entries.append(top)
        self.resident = (self.resident or _Pack(None)) if keep else None
        if self.resident is not None:
            _push_saved_tensors_default_hooks(self.resident, _unpack)
        for pack, unpack in reversed(entries):
            if isinstance(pack, _Pack):
                if pack.below is None or pack is drop:
                    continue  # an old resident entry, or the closing scope's own
                if not keep:
                    pack, unpack = pack.below
            elif keep:
                # Its owner will pop this wrapper on exit, as it would have popped its own entry.
                pack, unpack = _Pack((pack, unpack)), _unpack
            _push_saved_tensors_default_hooks(pack, unpack)


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
        if not sys.is_finalizing():
            self.hooks.release_if_idle()


# --------------------------------------------------------------------------------------- the scope
@contextlib.contextmanager
def gradient_checkpoint_scope(*, preserve_rng_state: bool = True) -> Iterator[None]:
    """Every tensor created inside is recomputed in backward instead of being stored for it.

    ``preserve_rng_state=False`` skips the RNG snapshot: only safe if the scope draws no random
    numbers, or if different ones in the recomputation are acceptable.
    """
    hooks = _ResidentHooks.of_this_thread()
    if (
        hooks.open is not None
        or _thread.depth
        or not torch.is_grad_enabled()
        or torch._C._current_graph_task_id() != -1
        or _inside_a_checkpoint()
    ):
        # Nested in a scope (which records everything already), inside a hook, with nothing to save,
        # inside backward (where any change to the hooks stack is undone after each node), or inside
        # a checkpointed function (which is recomputed as a whole).
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
