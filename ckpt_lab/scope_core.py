"""``gradient_checkpoint_scope``, the core: notebook 04's scope, read in one sitting.

    with gradient_checkpoint_scope():
        x = a + b
    y = x * c        # autograd stores a reference instead of x; backward re-runs a + b

1. **The tape.** A ``TorchDispatchMode`` records each aten op of the scope, below autograd: the op, its
   arguments (a tensor the tape knows becomes its slot; one from outside, an *input*, is kept by
   reference), for a random op its generator's state. What an op returns as new memory with grad on
   is a *scope tensor*, known by its identity.
2. **The pack hook's reference.** Autograd saves a scope tensor (or a view of one) through our pack
   hook, which returns a ``_Ref`` (tape, slot) instead: the tensor is freed when the user drops it.
3. **The replay.** The first unpack of a backward re-runs the whole tape, without grad or autocast,
   each random op from its generator's recorded state, in a fork (the caller's streams go on
   untouched); it checks every recomputed tensor's shape, strides, offset, dtype and device, and
   keeps what live references want until each has been handed out.
4. **The resident hooks.** ``x * c`` saves ``x`` after the ``with`` block, on a thread-local stack where
   each ``__exit__`` pops the top entry, whoever pushed it. So a scope that closes with scope tensors
   alive rebuilds the stack: a resident entry of ours at the bottom, every entry above it wrapped (scope
   tensors to us, the rest to it); when the last scope tensor dies, at a safe point (its thread, outside
   our hooks, outside backward), the stack is put back as it was. Nothing of torch is patched.

Imports: torch, ``ckpt_lab.errors``, ``.rng`` and ``._aten`` (copying it takes those four files).
``ckpt_lab.scope`` is the shipped scope, this mechanism hardened; both pass ``ckpt_lab.scope_checks``.
Refused with a ``CheckpointError`` naming the shipped scope: an in-place write to a tensor from outside
(a buffer, BatchNorm's statistics), a tensor the scope did not make on memory it made (``.data``, a
Parameter built in it), ops under ``inference_mode``. A "Simple way:" comment says what the other
way costs and where ``scope.py`` takes it; its NOTE [ Speed ] lists the shortcuts of its per-op path.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Any

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
_top = lambda: _top_saved_tensors_default_hooks(True)  # the real top of the stack, even while compiling


@contextlib.contextmanager
def gradient_checkpoint_scope(*, preserve_rng_state: bool = True) -> Iterator[None]:
    """Every tensor created inside is recomputed in backward instead of being stored for it.
    ``preserve_rng_state=False`` records no generator states: a replay draws new random numbers."""
    hooks = _thread.hooks = _thread.hooks or _Hooks()
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
    hooks: _Hooks | None = None  # this thread's resident hooks, made on first use


_thread = _ThreadState()

# A checkpoint that re-runs its region in backward and hands out what the re-run saved by position
# (torch's non-reentrant one, ckpt_lab's) would hand out wrong tensors if a scope in its region made
# the forward save others than the re-run (in backward a scope does nothing): there a scope does
# nothing. Its pack hook says so: torch's by its name, any other by ``recomputes_region = True``.
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
class _Slot(int):
    """A tensor in a recorded op's arguments: its slot number (a type of its own: no int argument)."""


class _Tape(TorchDispatchMode):
    """One scope's recording, a dispatch mode: its aten ops; per slot, the slot whose memory it lives in."""

    def __init__(self, hooks: _Hooks, rng: bool) -> None:
        super().__init__()
        self.hooks, self.rng, self.open = hooks, rng, True
        self.ops: list[tuple] = []  # (func, args, kwargs, output slots, their metadata, GeneratorState)
        self.roots: list[int] = []
        self.inputs: dict[int, tuple[torch.Tensor, int]] = {}  # slot -> (input, its version when read)
        self.last_write: dict[int, int] = {}  # root -> the last op that wrote into it in place
        # While recording, weakly (ids get reused): id(tensor) -> (ref, slot), id(storage) -> (ref, root).
        self.by_id, self.storages = {}, {}
        self.scope_tensors: set[int] = set()  # keys of ours in _SCOPE_TENSORS
        self.refs: list[weakref.ref] = []  # the _Refs autograd holds, weakly: which slots a replay keeps
        # The last replay's tensors not yet handed out, how many live references want each; replays so far.
        self.values, self.pending, self.round = {}, Counter(), 0
        self.lock = threading.Lock()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # Not the forward's ops: a replay's (an unpack inside the scope), a backward's.
        if _thread.in_hook or _graph_task() != -1:
            return func(*args, **kwargs)
        if torch.is_inference_mode_enabled():
            raise CheckpointError(f"gradient_checkpoint_scope: {func} under inference_mode. {_USE_SCOPE}")
        info = op_info(func)
        written = [self.slot_of(tensor) for tensor, _ in info.written(args, kwargs)]
        if any(self.roots[slot] in self.inputs for slot in written):
            # Simple way: refused. scope.py copies such a tensor once, before the first write, and
            # each replay writes into a copy of that copy (NOTE [ Outside tensors written in place ]).
            raise CheckpointError(f"gradient_checkpoint_scope: {func} writes to an input. {_USE_SCOPE}")
        draw = GeneratorState.before(args, kwargs) if info.random and self.rng else None
        out = func(*args, **kwargs)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if outputs or written:  # not .item() and the like: nothing a later op could read
            for slot in written:
                self.last_write[self.roots[slot]] = len(self.ops)
            args, kwargs = tree_map_only(torch.Tensor, self.slot_of, (args, kwargs))  # lists of tensors too
            # New memory, says the schema (or an alias it does not declare, like _unsafe_view's), or a view.
            fresh = bool(info.fresh) and all(info.fresh)
            slots = tuple(self._output(t, fresh) for t in outputs)
            self.ops.append((func, args, kwargs, slots, [_meta(t) for t in outputs], draw))
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
            raise CheckpointError(
                "gradient_checkpoint_scope: a tensor the scope did not make shares memory it made (.data, "
                f"a Parameter built in the scope). {_USE_SCOPE}"
            )
        slot = self._new_slot(tensor, storage, None)
        self.inputs[slot] = (tensor, tensor._version)
        return slot

    def _new_slot(self, tensor: torch.Tensor, storage: Any, root: int | None) -> _Slot:
        slot = _Slot(len(self.roots))
        self.roots.append(slot if root is None else root)
        if root is None and storage is not None:
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
        # A scope tensor: the schema's new memory, not an input's, made with grad on. Not a view (the
        # pack hook finds a view by its _base; a detach() has none: a plain tensor), nor a tensor made
        # with grad off (an optimizer's state, a target): autograd won't save it, and registered it
        # would keep our hook for its whole life. Both are recorded all the same.
        if fresh and torch.is_grad_enabled() and self.roots[slot] not in self.inputs:
            entry = _ScopeTensor(tensor, _died)
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


# ============================================================================ 2. the pack hook
class _ScopeTensor(weakref.ref):
    """A registered scope tensor: a weak reference, its tape and slot, its version when the scope closed."""

    __slots__ = ("key", "slot", "tape", "version")


# id(tensor) -> its _ScopeTensor, for every thread. PyTorch keeps a tensor's Python object exactly as
# long as the tensor, and the weakref callback removes the entry before the id can be reused.
_SCOPE_TENSORS: dict[int, _ScopeTensor] = {}


def _died(entry: _ScopeTensor) -> None:
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

    def __call__(self, tensor: torch.Tensor) -> tuple[Any, Any]:
        """What autograd stores: (how to get the tensor back, from what)."""
        _thread.in_hook += 1
        try:
            ref = _scope_ref(tensor)
            if ref is not None:
                return _serve, ref
            if self.below is None:
                # Detached: a saved output kept as is would reference its own grad_fn, a cycle in C++.
                return _stored, (tensor.detach(), tensor._version)
            pack, unpack = self.below
            return unpack, pack(tensor)
        finally:
            _thread.in_hook -= 1


def _unpack(packed: tuple[Any, Any]) -> torch.Tensor:
    """The unpack hook of every entry of ours: ``packed`` is (how to get the tensor back, from what)."""
    _thread.in_hook += 1
    try:
        return packed[0](packed[1])
    finally:
        _thread.in_hook -= 1


def _scope_ref(tensor: torch.Tensor) -> _Ref | None:
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
    ref = _Ref(entry.tape, entry.slot, view)
    entry.tape.refs.append(weakref.ref(ref))  # weakly: a dead one tells a replay its tensor is unwanted
    return ref


class _Ref:
    """What autograd stores for a scope tensor: tape, slot, geometry if a view, and how many ops the tape
    held when it was saved (a later op writing into its memory would change what a replay returns)."""

    __slots__ = ("__weakref__", "geometry", "round", "saved_at", "slot", "tape")

    def __init__(self, tape: _Tape, slot: int, geometry: tuple | None) -> None:
        self.tape, self.slot, self.geometry = tape, slot, geometry
        self.saved_at, self.round = len(tape.ops), -1  # round: the last replay that served it


def _stored(saved: tuple[torch.Tensor, int]) -> torch.Tensor:
    """A tensor not made in a scope, as autograd stores it (with the version check it skips for hooks)."""
    tensor, version = saved
    if tensor._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"a tensor of shape {list(tensor.shape)} is at version {tensor._version}, saved at {version}."
        )
    return tensor


# =============================================================================== 3. the replay
def _serve(ref: _Ref) -> torch.Tensor:
    """Unpack: the replayed tensor for ``ref``, replaying first if this round has none for it."""
    tape = ref.tape  # a lock: unpacks on several threads take turns
    with tape.lock:
        if tape.last_write.get(tape.roots[ref.slot], -1) >= ref.saved_at:
            message = "a tensor created in the scope was modified in place after autograd saved it"
            raise CheckpointError(f"gradient_checkpoint_scope: {message}; autograd would raise too.")
        if ref.round == tape.round or ref.slot not in tape.values:
            _replay(tape)  # the first unpack of a backward; or a second of ``ref``: a new round
        ref.round = tape.round
        value = tape.values[ref.slot]
        tape.pending[ref.slot] -= 1
        if tape.pending[ref.slot] <= 0:  # every live reference has it: backward holds the only ones
            del tape.values[ref.slot], tape.pending[ref.slot]
    if ref.geometry is None:
        return value
    size, stride, offset, dtype = ref.geometry  # a view, on the replayed memory
    return torch.empty(0, dtype=dtype, device=value.device).set_(
        value.untyped_storage(), offset, size, stride
    )


def _replay(tape: _Tape) -> None:
    """Re-run the whole tape; keep what the live references want."""
    live = [r for r in (w() for w in tape.refs) if r is not None]
    tape.refs = [weakref.ref(r) for r in live]
    values: dict[int, torch.Tensor] = {}
    for slot, (tensor, version) in tape.inputs.items():
        if tensor._version != version:
            raise CheckpointError(
                f"gradient_checkpoint_scope: a tensor from outside the scope, read inside it, was modified "
                f"in place before backward (shape {list(tensor.shape)}). Modify it out of place, or after."
            )
        values[slot] = tensor
    # Simple way: every op runs, and every tensor stays until the replay ends (the scope's whole
    # forward at once). scope.py runs only the ops the wanted tensors depend on and frees each tensor
    # after its last reader (_plan_replay), a plan computed once per set of wanted tensors.
    # No grad (a replay builds no graph: backward wires what it unpacks), autocast off (the recorded
    # ops are already cast), each random op from its recorded generator state, all in a fork.
    draws = [op[5] for op in tape.ops if op[5] is not None]
    accelerator = torch.accelerator.current_accelerator()
    settings = AutocastState.capture([] if accelerator is None else [accelerator.type]).settings
    autocast_off = AutocastState(tuple((t, False, dtype) for t, _, dtype in settings), cache_enabled=False)
    with torch.no_grad(), autocast_off.restored(), forked(draws):
        for func, args, kwargs, outputs, metas, draw in tape.ops:
            if draw is not None:
                draw.restore()
            args, kwargs = tree_map_only(_Slot, values.__getitem__, (args, kwargs))
            recomputed = [t for t in tree_leaves(func(*args, **kwargs)) if isinstance(t, torch.Tensor)]
            if (got := [_meta(t) for t in recomputed]) != metas:
                raise CheckpointError(
                    f"gradient_checkpoint_scope: the recomputation of {func} returned {got}, the forward "
                    f"{metas}: an input changed without a version bump (.data?); wrong gradients."
                )
            values.update(zip(outputs, recomputed, strict=True))
    tape.pending = Counter(r.slot for r in live)
    tape.values = {slot: values[slot] for slot in tape.pending}
    tape.round += 1


# ======================================================================== 4. the resident hooks
class _Hooks:
    """One per thread: its open scope, its live tapes (open, or a scope tensor alive), our resident entry."""

    def __init__(self) -> None:
        self.owner = threading.get_ident()
        self.open: _Tape | None = None
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
        """Rebuild this thread's stack without ``drop``. With live tapes: our resident entry at the
        bottom and every other entry ours or wrapped, so that each enclosing ``__exit__`` pops its own
        (its wrapper); without: no entry of ours, every wrapper replaced by the pair it stands in for.
        Simple way: the whole stack every time (usually an entry or two); scope.py touches only its
        top in the common cases."""
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
    storages = {(id(e.tape), e.tape.roots[e.slot]) for e in list(_SCOPE_TENSORS.values())}
    return {"scope_storages_registered": len(storages), "scope_hooks_held": held}
