"""``gradient_checkpoint_scope``, the core: notebook 04's scope, read in one sitting.

    with gradient_checkpoint_scope():
        x = a + b
    y = x * c        # autograd stores a reference instead of x; backward re-runs a + b

1. **The tape.** A ``TorchDispatchMode`` records each aten op of the scope, below autograd, as an ``_Op``:
   its arguments (a known tensor becomes its slot; one from outside, an *input*, is kept), for a random
   op its generator's state. New memory an op returns with grad on is a *scope tensor*, known by identity.
2. **The reference.** Autograd saves a scope tensor (or a view of one) through our pack hook, which
   returns a ``_ScopeTensorRef`` (replayer, slot) instead: the tensor is freed when the user drops it.
3. **The replay.** The first unpack of a backward makes the ``_Replayer`` re-run the whole tape, without
   grad or autocast, each random op from its generator's recorded state, in a fork; it checks what each
   op returns (shape, strides, offset, dtype, device) and keeps what live references want until served.
4. **The resident hooks.** ``x * c`` saves ``x`` after the ``with`` block, on a thread-local stack where
   each ``__exit__`` pops the top entry, whoever pushed it. So a scope that closes with scope tensors alive
   rebuilds it: a resident entry of ours at the bottom, every entry above wrapped; when the last scope
   tensor dies, at a safe point, the stack is put back as it was. Nothing of torch is patched.

Imports torch, ``ckpt_lab.errors``, ``.rng``, ``._aten``. ``ckpt_lab.scope``, the shipped scope, is this
mechanism hardened, in the same sections and names; both pass ``ckpt_lab.scope_checks``. Refused here:
an in-place write to an outside tensor (BatchNorm's statistics), a tensor the scope did not make on memory
it made (``.data``), ops under ``inference_mode``. "Simple way:" says where ``scope.py`` goes further.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from ckpt_lab._aten import op_info, storage_of
from ckpt_lab.errors import CheckpointError
from ckpt_lab.rng import AutocastState, GeneratorState, forked

try:  # torch's private API (ckpt_lab/torch_private.py lists each use): no fallbacks in the core
    from torch._C import _current_graph_task_id as _graph_task
    from torch._C._autograd import _pop_saved_tensors_default_hooks as _pop
    from torch._C._autograd import _push_saved_tensors_default_hooks as _push
    from torch._C._autograd import _top_saved_tensors_default_hooks
except ImportError as error:
    raise ImportError(f"ckpt_lab.scope_core, on torch {torch.__version__}: {error}") from error

__all__ = ["gradient_checkpoint_scope", "leftovers"]

_USE_SCOPE = "ckpt_lab.gradient_checkpoint_scope handles it; this core refuses it."
_MODIFIED = "one of the variables needed for gradient computation has been modified by an inplace operation"
_top = lambda: _top_saved_tensors_default_hooks(True)  # the real top of the stack, even while compiling


@contextlib.contextmanager
def gradient_checkpoint_scope(*, preserve_rng_state: bool = True) -> Iterator[None]:
    """Every tensor created inside is recomputed in backward instead of being stored for it.
    ``preserve_rng_state=False`` records no generator states: a replay draws new random numbers."""
    hooks = _thread.hooks = _thread.hooks or _ResidentHooks()
    if (
        hooks.open is not None  # nested: the outer scope records everything already
        or _thread.in_hook  # inside our hooks or a replay: those ops are not the forward's
        or not torch.is_grad_enabled()  # nothing will be saved
        or _graph_task() != -1  # backward undoes any change to the hooks stack
        or _inside_a_checkpoint()
    ):
        yield
        return
    hooks.release_if_idle()  # a safe point: a release deferred earlier can happen now
    top = _top()
    # What is not a scope tensor goes to the pair below (not to an entry of ours: it would ask again).
    entry = _PackHook(top[0].below if top is not None and isinstance(top[0], _PackHook) else top)
    _push(entry, _unpack)
    tape = hooks.open = _Tape(hooks, preserve_rng_state)
    hooks.live.add(tape)
    failed = True
    try:
        with tape:  # recording
            yield
        failed = False
    finally:
        hooks.open = None
        tape.close(failed)
        if not tape.scope_tensors:
            hooks.live.discard(tape)
        hooks.restack(drop=entry)  # our entry goes; a resident one stays below if scope tensors live


class _ThreadState(threading.local):
    in_hook = 0  # > 0 while one of our hooks (and so a replay) runs on this thread; a count: they nest
    hooks: _ResidentHooks | None = None  # this thread's resident hooks, made on first use


_thread = _ThreadState()

# A checkpoint that re-runs its region and hands out what the re-run saved by position (torch's
# non-reentrant one, ckpt_lab's) would hand out wrong tensors if a scope in its region made the forward
# save others: there a scope does nothing. Known by its pack hook's name, or ``recomputes_region = True``.
_TORCH_PACK_HOOKS = {f"_{kind}_hook.__init__.<locals>.pack_hook" for kind in ("checkpoint", "recomputation")}


def _inside_a_checkpoint() -> bool:
    """Such a pack hook above our entries? Others above it (a save_on_cpu inside) are popped, pushed back."""
    popped = []
    try:
        while (top := _top()) is not None and not isinstance(top[0], _PackHook):
            for hook in (top[0], getattr(top[0], "__wrapped__", None)):  # torch wraps one (dynamo.disable)
                name, says_so = getattr(hook, "__qualname__", ""), getattr(hook, "recomputes_region", False)
                if name in _TORCH_PACK_HOOKS or says_so is True:
                    return True
            _pop()
            popped.append(top)
        return False
    finally:
        for pair in reversed(popped):
            _push(*pair)


# ======================================================================================= 1. the tape
class _Slot(int):  # a tensor in a recorded op's arguments: its slot number (its own type: no int argument)
    __slots__ = ()


class _Op(NamedTuple):  # one recorded aten op (scope.py's adds what its per-op path and plans need)
    func: Any
    args: tuple  # tensors replaced by their slots
    kwargs: dict
    outputs: tuple[_Slot, ...]  # the slot of each tensor it returned
    metas: list[tuple]  # and that tensor's metadata, for the replay's check
    draw: GeneratorState | None  # a random op: its generator's state before it drew


class _Tape(TorchDispatchMode):
    """One scope's recording, a dispatch mode: its aten ops; per slot, the slot whose memory it lives in."""

    def __init__(self, hooks: _ResidentHooks, rng: bool) -> None:
        super().__init__()
        self.hooks, self.rng, self.open = hooks, rng, True
        self.ops: list[_Op] = []
        self.storage_slot: list[int] = []  # per slot: the slot whose storage it lives in
        self.inputs: dict[int, tuple[torch.Tensor, int]] = {}  # slot -> (input, its version when read)
        self.last_write: dict[int, int] = {}  # storage slot -> the last op that wrote into it in place
        # While recording, weakly (ids get reused): id(tensor) -> (ref, slot), id(storage) -> (ref, slot).
        self.by_id, self.storages = {}, {}
        self.scope_tensors: set[int] = set()  # keys of ours in _SCOPE_TENSORS
        # It shares the tape's lists, holding no reference back (a cycle would wait for the collector).
        self.replayer = _Replayer(self.ops, self.storage_slot, self.inputs, self.last_write)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _thread.in_hook or _graph_task() != -1:  # not the forward's: a replay's, a backward's ops
            return func(*args, **kwargs)
        if torch.is_inference_mode_enabled():
            raise CheckpointError(f"gradient_checkpoint_scope: {func} under inference_mode. {_USE_SCOPE}")
        info = op_info(func)
        written = [self.slot_of(tensor) for tensor, _ in info.written(args, kwargs)]
        if any(self.storage_slot[slot] in self.inputs for slot in written):
            # Simple way: refused. scope.py copies such a tensor once, before the first write, and
            # each replay writes into a copy of that copy (NOTE [ Outside tensors written in place ]).
            raise CheckpointError(f"gradient_checkpoint_scope: {func} writes to an input. {_USE_SCOPE}")
        draw = GeneratorState.before(args, kwargs) if info.random and self.rng else None
        out = func(*args, **kwargs)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if outputs or written:  # not .item() and the like: nothing a later op could read
            for slot in written:
                self.last_write[self.storage_slot[slot]] = len(self.ops)
            args, kwargs = tree_map_only(torch.Tensor, self.slot_of, (args, kwargs))  # lists of tensors too
            # New memory, says the schema (or an alias it does not declare, like _unsafe_view's), or a view.
            fresh = bool(info.fresh) and all(info.fresh)
            slots = tuple(self._output(t, fresh) for t in outputs)
            self.ops.append(_Op(func, args, kwargs, slots, [_meta(t) for t in outputs], draw))
        return out

    def slot_of(self, tensor: torch.Tensor) -> _Slot:
        entry = self.by_id.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            return entry[1]
        # An input: kept by reference, its version checked. Simple way: kept as long as the tape; scope.py
        # lets an earlier scope's tensor go once this one has replayed (NOTE [ Inputs are kept, ... ]).
        storage = storage_of(tensor)
        known = self.storages.get(id(storage))
        if known is not None and known[0]() is storage:
            message = "a tensor the scope did not make shares memory it made (.data, a Parameter built in it)"
            raise CheckpointError(f"gradient_checkpoint_scope: {message}. {_USE_SCOPE}")
        slot = self._new_slot(tensor, storage, None)
        self.inputs[slot] = (tensor, tensor._version)
        return slot

    def _new_slot(self, tensor: torch.Tensor, storage: Any, storage_slot: int | None) -> _Slot:
        slot = _Slot(len(self.storage_slot))
        self.storage_slot.append(slot if storage_slot is None else storage_slot)
        if storage_slot is None and storage is not None:
            self.storages[id(storage)] = (weakref.ref(storage), slot)
        self.by_id[id(tensor)] = (weakref.ref(tensor), slot)
        return slot

    def _output(self, tensor: torch.Tensor, fresh: bool) -> _Slot:
        entry = self.by_id.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            return entry[1]  # an in-place or out= op returns its argument: it keeps its slot
        storage = storage_of(tensor)
        known = self.storages.get(id(storage))
        slot = self._new_slot(tensor, storage, known[1] if known and known[0]() is storage else None)
        # A scope tensor: the schema's new memory, not an input's, made with grad on. Not a view (the pack
        # hook finds one by its _base; a detach() has none), nor made with grad off (an optimizer's state:
        # autograd won't save it; registered, it would keep our hook for its life). All are recorded.
        if fresh and torch.is_grad_enabled() and self.storage_slot[slot] not in self.inputs:
            entry = _ScopeTensor(tensor, _scope_tensor_died)
            entry.key, entry.tape, entry.slot, entry.version = id(tensor), self, slot, None
            _SCOPE_TENSORS[entry.key] = entry
            self.scope_tensors.add(entry.key)
        return slot

    def close(self, failed: bool) -> None:
        self.open, self.by_id, self.storages = False, {}, {}  # identities matter only while recording
        for key in list(self.scope_tensors):
            tensor = entry() if (entry := _SCOPE_TENSORS.get(key)) is not None else None
            if tensor is not None and failed:  # after an exception: what escaped is an ordinary tensor
                del _SCOPE_TENSORS[key]
                self.scope_tensors.discard(key)
            elif tensor is not None:  # a later write is not on the tape (see _scope_ref)
                entry.version = tensor._version


def _meta(tensor: torch.Tensor) -> tuple:
    """What a replay must reproduce. Simple way: a sparse tensor (no strides) fails here; scope.py copes."""
    return tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype, tensor.device


# ================================================================================== 2. the reference
class _ScopeTensor(weakref.ref):  # a registered scope tensor: its tape, slot, version when the scope closed
    __slots__ = ("key", "slot", "tape", "version")


# id(tensor) -> its _ScopeTensor, for every thread. PyTorch keeps a tensor's Python object exactly as
# long as the tensor, and the weakref callback removes the entry before the id can be reused.
_SCOPE_TENSORS: dict[int, _ScopeTensor] = {}


def _scope_tensor_died(entry: _ScopeTensor) -> None:
    """A scope tensor died (on any thread): with its tape's last, our hooks may go."""
    tape = entry.tape
    if _SCOPE_TENSORS.get(entry.key) is entry:  # not forgotten already (after an exception)
        del _SCOPE_TENSORS[entry.key]
        tape.scope_tensors.discard(entry.key)
        if not tape.scope_tensors and not tape.open:
            tape.hooks.live.discard(tape)
            tape.hooks.release_if_idle()


class _PackHook:
    """Our pack hook, one per entry of ours (section 4): an open scope's, the resident one, a wrapper."""

    __slots__ = ("below",)

    def __init__(self, below: tuple[Any, Any] | None) -> None:
        self.below = below  # the pair that gets what is not a scope tensor; None: stored here

    def __call__(self, tensor: torch.Tensor) -> _ScopeTensorRef | _Stored | _Delegated:  # each can unpack
        _thread.in_hook += 1
        try:
            ref = _scope_ref(tensor)
            if ref is not None:
                return ref
            if self.below is None:
                return _Stored(tensor.detach(), tensor._version)
            pack, unpack = self.below
            return _Delegated(unpack, pack(tensor))
        finally:
            _thread.in_hook -= 1


def _scope_ref(tensor: torch.Tensor) -> _ScopeTensorRef | None:
    """A reference to a scope tensor, or a view autograd made of one (a 3-d Linear after the scope
    saves ``h.view(-1, n)``); None: not one, stored."""
    entry = _SCOPE_TENSORS.get(id(tensor))
    if entry is None:
        entry = _SCOPE_TENSORS.get(id(tensor._base))  # id(None) is never a key
    made = None if entry is None else entry()
    # Not recomputed: a leaf that requires grad (the user's state); a tensor modified in place after
    # the scope (not on the tape); a conjugate or negative view (a lazy bit the geometry would drop).
    if made is None or (made.requires_grad and made.is_leaf) or tensor.is_conj() or tensor.is_neg():
        return None
    if entry.version not in (None, tensor._version):
        return None
    view = None if made is tensor else (tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype)
    ref = _ScopeTensorRef(replayer := entry.tape.replayer, entry.slot, view)
    replayer.refs.append(weakref.ref(ref))  # weakly: a dead one tells a replay its tensor is unwanted
    return ref


def _unpack(packed: _ScopeTensorRef | _Stored | _Delegated) -> torch.Tensor:
    """The unpack hook of every entry of ours: a reference is served by its replayer, the rest unpack."""
    _thread.in_hook += 1
    try:
        return packed.replayer.serve(packed) if type(packed) is _ScopeTensorRef else packed.unpack()
    finally:
        _thread.in_hook -= 1


class _ScopeTensorRef:
    """What autograd stores for a scope tensor: its tape's replayer, slot, geometry if a view, and how
    many ops the tape held when saved (a later write into its memory would change what a replay returns)."""

    __slots__ = ("__weakref__", "geometry", "replayer", "round", "saved_at", "slot")

    def __init__(self, replayer: _Replayer, slot: int, geometry: tuple | None) -> None:
        self.replayer, self.slot, self.geometry = replayer, slot, geometry
        self.saved_at, self.round = len(replayer.ops), -1  # round: the last replay that served it


class _Stored(NamedTuple):
    """Not a scope tensor: stored detached (no C++ cycle through its grad_fn), version-checked as autograd."""

    tensor: torch.Tensor
    version: int

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            at = f"a tensor of shape {list(self.tensor.shape)} is at version {self.tensor._version}"
            raise RuntimeError(f"{_MODIFIED}: {at}, saved at {self.version}.")
        return self.tensor


class _Delegated(NamedTuple):  # a tensor packed by the pair we stand in for, unpacked by it
    unpack_hook: Any
    packed: Any

    def unpack(self) -> torch.Tensor:
        return self.unpack_hook(self.packed)


# ===================================================================================== 3. the replay
class _Replayer:
    """One tape's replays: what live references want, each served once (unpacks on threads take turns)."""

    def __init__(self, ops: list[_Op], storage_slot: list[int], inputs: dict, last_write: dict) -> None:
        self.ops, self.storage_slot, self.inputs, self.last_write = ops, storage_slot, inputs, last_write
        self.refs: list[weakref.ref] = []  # the references autograd holds, weakly: what a replay keeps
        # The last replay's tensors not yet handed out, how many live references want each; replays so far.
        self.values, self.pending, self.round, self.lock = {}, Counter(), 0, threading.Lock()

    def serve(self, ref: _ScopeTensorRef) -> torch.Tensor:
        """Unpack: the replayed tensor for ``ref``, replaying first if this round has none for it."""
        with self.lock:
            if self.last_write.get(self.storage_slot[ref.slot], -1) >= ref.saved_at:
                message = "a tensor created in the scope was modified in place after autograd saved it"
                raise CheckpointError(f"gradient_checkpoint_scope: {message}; autograd would raise too.")
            if ref.round == self.round or ref.slot not in self.values:
                self._replay()  # the first unpack of a backward; or a second of ``ref``: a new round
            ref.round = self.round
            value = self.values[ref.slot]
            self.pending[ref.slot] -= 1
            if self.pending[ref.slot] <= 0:  # every live reference has it: backward holds the only ones
                del self.values[ref.slot], self.pending[ref.slot]
        if ref.geometry is None:
            return value
        size, stride, offset, dtype = ref.geometry  # a view, on the replayed memory
        view = torch.empty(0, dtype=dtype, device=value.device)
        return view.set_(value.untyped_storage(), offset, size, stride)

    def _replay(self) -> None:  # re-run the whole tape; keep what the live references want
        live = [r for r in (w() for w in self.refs) if r is not None]
        self.refs = [weakref.ref(r) for r in live]
        values: dict[int, torch.Tensor] = {}
        for slot, (tensor, version) in self.inputs.items():
            if tensor._version != version:
                message = f"a tensor from outside the scope, read inside it (shape {list(tensor.shape)})"
                raise CheckpointError(f"gradient_checkpoint_scope: {message}, was modified in place since.")
            values[slot] = tensor
        # Simple way: every op runs, every tensor stays until the replay ends (the scope's whole forward
        # at once); scope.py runs only what the wanted tensors need and frees each after its last reader.
        # No grad (backward wires what it unpacks), autocast off (the recorded ops are already cast).
        draws = [op.draw for op in self.ops if op.draw is not None]
        accelerator = torch.accelerator.current_accelerator()
        settings = AutocastState.capture([] if accelerator is None else [accelerator.type]).settings
        autocast_off = AutocastState(tuple((t, False, d) for t, _, d in settings), cache_enabled=False)
        with torch.no_grad(), autocast_off.restored(), forked(draws):
            for op in self.ops:
                if op.draw is not None:
                    op.draw.restore()
                args, kwargs = tree_map_only(_Slot, values.__getitem__, (op.args, op.kwargs))
                out = [t for t in tree_leaves(op.func(*args, **kwargs)) if isinstance(t, torch.Tensor)]
                if (got := [_meta(t) for t in out]) != op.metas:
                    message = f"{op.func} returned {got}, the forward {op.metas} (an input changed unseen?)"
                    raise CheckpointError(f"gradient_checkpoint_scope: the recomputation of {message}.")
                values.update(zip(op.outputs, out, strict=True))
        self.pending = Counter(r.slot for r in live)
        self.values = {slot: values[slot] for slot in self.pending}
        self.round += 1


# ============================================================================ 4. the resident hooks
class _ResidentHooks:
    """One per thread: its open scope, its live tapes (open, or a scope tensor alive), our resident entry."""

    def __init__(self) -> None:
        self.owner, self.open = threading.get_ident(), None  # open: the tape of the scope open on it
        self.live: set[_Tape] = set()
        self.resident: _PackHook | None = None
        self.retry_after = -1  # the backward (graph task) after which to try the release again

    def release_if_idle(self) -> None:
        """Take the resident entry out if no tape needs it, at a safe point."""
        if self.live or self.resident is None:
            return
        task = _graph_task()
        if task != -1:
            # Inside backward the engine restores the stack after every node: retry once it is over.
            if task != self.retry_after:
                self.retry_after = task
                # A final callback that does nothing when called: its use is its death. The engine
                # drops it with the graph task after backward has returned, on the calling thread.
                callback = lambda: None
                weakref.finalize(callback, self.release_if_idle).atexit = False
                torch.autograd.Variable._execution_engine.queue_callback(callback)
        elif threading.get_ident() == self.owner and not _thread.in_hook:
            self.restack()

    def restack(self, drop: _PackHook | None = None) -> None:
        """Rebuild this thread's stack without ``drop``. With live tapes: our resident entry at the bottom,
        every other entry ours or wrapped (each ``__exit__`` pops its own wrapper); without: no entry of ours,
        every wrapper unwrapped. Simple way: the whole stack (scope.py mostly touches only its top)."""
        keep, entries = bool(self.live), []
        while (top := _top()) is not None:
            _pop()
            entries.append(top)
        self.resident = (self.resident or _PackHook(None)) if keep else None
        if keep:
            _push(self.resident, _unpack)
        for pack, unpack in reversed(entries):
            if isinstance(pack, _PackHook):
                if pack.below is None or pack is drop:
                    continue  # an old resident entry, or the closing scope's own
                if not keep:
                    pack, unpack = pack.below
            elif keep:
                pack, unpack = _PackHook((pack, unpack)), _unpack
            _push(pack, unpack)


def leftovers() -> dict[str, Any]:
    """Scope tensors registered (any thread), this thread's hooks: gone once every scope tensor is."""
    hooks = _thread.hooks
    held = hooks is not None and bool(hooks.live or hooks.resident is not None or hooks.open)
    storages = {(id(e.tape), e.tape.storage_slot[e.slot]) for e in list(_SCOPE_TENSORS.values())}
    return {"scope_storages_registered": len(storages), "scope_hooks_held": held}
