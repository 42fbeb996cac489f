"""``gradient_checkpoint_scope``: every tensor created inside it is recomputed in backward.

Same semantics as RETURNN's ``returnn.torch.util.gradient_checkpoint.gradient_checkpoint_scope``,
written from scratch. Introduced in notebook 04::

    with gradient_checkpoint_scope():
        x = a + b
    y = x * c        # autograd saves a small reference instead of x; backward re-runs a + b

``ckpt_lab.scope_core`` is the same mechanism at its smallest, in the same sections and names (read it
first); this is the shipped scope, hardened for real code; notebook 04b explains each difference. After
the entry point: 1. the tape (``_RecordingMode`` records each aten op as an ``_Op`` on a ``_Tape``);
2. the reference (``_PackHook`` returns a ``_ScopeTensorRef`` for a scope tensor); 3. the replay
(``_Replayer.serve``); 4. the resident hooks (``_ResidentHooks.restack``). Then, behind a banner, the
hardening, each part a ``NOTE [ ... ]`` the code cites, the chain of scoped blocks kept at torch's
peak among them (``_Chain``, reached only through ``_Replayer.chain``); last, NOTE [ Speed ], the
per-op shortcuts (a) to (n). Copying this file takes ``ckpt_lab/errors.py``, ``ckpt_lab/rng.py`` and
``ckpt_lab/_aten.py``, nothing else of ``ckpt_lab``.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import types
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from ckpt_lab._aten import _OP_INFO, OpInfo, op_info, storage_of
from ckpt_lab.errors import CheckpointError, missing_error, optional
from ckpt_lab.rng import (
    GeneratorState,
    ReplayState,
    RNGState,
    capture_every_device,
    recomputing,
    with_initialised_inside,
)

__all__ = [
    "gradient_checkpoint_scope",
    "inside_scope_hook",
    "is_scope_pack_hook",
    "leftovers",
    "pack_hook_below",
    "recomputes_region",
]

# torch's private API (ckpt_lab/torch_private.py lists every use); None where this torch lacks it.
_pop_saved_tensors_default_hooks = optional("torch._C._autograd._pop_saved_tensors_default_hooks")
_push_saved_tensors_default_hooks = optional("torch._C._autograd._push_saved_tensors_default_hooks")
_saved_tensors_hooks_is_enabled = optional("torch._C._autograd._saved_tensors_hooks_is_enabled")
_top_saved_tensors_default_hooks = optional("torch._C._autograd._top_saved_tensors_default_hooks")
_current_graph_task_id = optional("torch._C._current_graph_task_id")
# Only switches grad mode: torch.set_grad_enabled(mode), called as a function, does the same.
_set_grad_enabled = optional("torch._C._set_grad_enabled") or torch.set_grad_enabled


# ============================================================================================ the entry point
@contextlib.contextmanager
def gradient_checkpoint_scope(*, preserve_rng_state: bool = True) -> Iterator[None]:
    """Every tensor created inside is recomputed in backward instead of being stored for it (unlike
    ``torch.utils.checkpoint``, which stores its function's outputs). NOTE [ What "born in the scope"
    means ], NOTE [ What a replay refuses ]. ``preserve_rng_state=False`` skips the RNG snapshots: safe
    only if the scope draws no random numbers, or different ones in the recomputation are acceptable.
    """
    if _LACKING:
        raise missing_error(_LACKING[0], "gradient_checkpoint_scope")  # NOTE [ Private names ]
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
        or _current_graph_task_id() != -1
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
    except RuntimeError as error:
        # torch.func refuses to run under saved-tensor hooks, ours included, without saying whose.
        if "support saved tensor hooks" in str(error):
            raise CheckpointError(
                "gradient_checkpoint_scope: torch.func (grad, vjp, jacrev, hessian) can't run inside the "
                "scope: the scope recomputes its tensors through saved-tensor hooks, which torch.func "
                "does not support. Call it outside the scope, with no scope tensor alive."
            ) from error
        raise
    finally:
        hooks.close_scope(recording, entry, failed)


# What a notebook (or a debugger) may read from inside the scope, without its private names.
def is_scope_pack_hook(hook: Any) -> bool:
    """Whether ``hook`` (from the saved-tensors-hooks stack) is one of the scope's entries: an open
    scope's own, the resident one, or a wrapper (NOTE [ Hooks that outlive the with block ])."""
    return isinstance(hook, _PackHook)


def pack_hook_below(hook: Any) -> Any:
    """For one of the scope's entries: the pack hook it hands the tensors it does not recompute to;
    None if it stores them itself. Raises ``TypeError`` for any other hook."""
    if not isinstance(hook, _PackHook):
        raise TypeError(f"pack_hook_below: {hook!r} is not one of gradient_checkpoint_scope's pack hooks")
    return None if hook.below is None else hook.below[0]


def inside_scope_hook() -> bool:
    """Whether one of the scope's hooks (and so any replay) runs on this thread now."""
    return _thread.in_hook > 0


def recomputes_region(pack_hook: Any) -> bool:
    """Whether ``pack_hook`` belongs to a checkpoint that re-runs its region in backward (torch's
    non-reentrant one, ``ckpt_lab.checkpoint``, any hook marked ``recomputes_region = True``): a scope
    inside its region does nothing. NOTE [ A scope inside a checkpoint ]."""
    return _recomputes_region(pack_hook)


def leftovers() -> dict[str, Any]:
    """What scopes still hold: scope tensors' storages registered (any thread), and this thread's
    resident hooks. Both gone once every scope tensor is freed (``ckpt_lab.instruments.state``)."""
    hooks = _thread.hooks
    held = hooks is not None and bool(hooks.live_recordings or hooks.resident is not None or hooks.open)
    storages = {(id(entry.recording), entry.storage_slot) for entry in list(_SCOPE_TENSORS.values())}
    return {"scope_storages_registered": len(storages), "scope_hooks_held": held}


class _ThreadState(threading.local):
    # NOTE [ Per-thread state ] (notebook 04b §1)
    # ``in_hook`` > 0 while one of our hooks (and so any replay) runs on this thread: its ops are not
    # recorded, a scope opened then does nothing, the hooks stack is not touched (exiting hooks from
    # inside a hook can crash, pytorch/pytorch#130734). A count: our hooks nest.
    in_hook = 0
    # The backward (graph task) in which this thread last replayed: NOTE [ The first replay of a backward ].
    replayed_in = -1
    # This thread's resident hooks, made on first use (section 4).
    hooks: _ResidentHooks | None = None


_thread = _ThreadState()

# ================================================================================================ 1. the tape
_NO_KWARGS: dict = {}
_graph_task_id = _current_graph_task_id
_grad_enabled = torch.is_grad_enabled
_inference_mode_enabled = torch.is_inference_mode_enabled


class _RecordingMode(TorchDispatchMode):
    """Records every aten op run inside the scope (below autograd: what the backend really ran)."""

    def __init__(self, recording: _Recording) -> None:
        super().__init__()
        self.recording = recording
        self.tape = recording.tape
        if not _dynamo_skips:
            _skip_dynamo(_RecordingMode.__torch_dispatch__.__code__)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # No torch._dynamo.disable wrapper where Dynamo can be told once to skip the code instead
        # (_skip_dynamo): see NOTE [ Speed ] (j). On a torch without that C API, torch's wrapper stays.
        return not (
            hasattr(torch._C._dynamo.eval_frame, "set_code_exec_strategy")
            and hasattr(torch._C._dynamo.eval_frame, "_FrameExecStrategy")
            and hasattr(torch._C._dynamo.eval_frame, "_FrameAction")
            and hasattr(torch._C._dynamo.eval_frame._FrameAction, "SKIP")
        )

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or _NO_KWARGS  # See NOTE [ Speed ] (e).
        # Not the forward's: see NOTE [ What the tape leaves out ] and NOTE [ Speed ] (g).
        if _thread.in_hook or _graph_task_id() != -1:
            return func(*args, **kwargs)
        info = _OP_INFO.get(id(func)) or op_info(func)  # See NOTE [ Speed ] (a).
        if not info.writes and _inference_mode_enabled():
            return func(*args, **kwargs)
        written = _before_writes(self.tape, info, args, kwargs) if info.writes else []
        # The state of the generator it is about to draw from. See NOTE [ Random ops ].
        draw = GeneratorState.before(args, kwargs) if info.random and self.recording.rng else None
        out = info.call(*args, **kwargs)  # func(...), without its Python frame: NOTE [ Speed ] (k)
        self.tape.record(func, info, args, kwargs, out, written, draw)
        return out


class _Tape:
    """A scope's tape: its ops, one ``_SlotRecord`` per tensor they touched, and the generators they
    drew from; while recording, which tensor object and which memory is in which slot."""

    def __init__(self, register: Any) -> None:
        self.ops: list[_Op] = []
        self.slots: list[_SlotRecord] = []
        # While recording, weakly (ids get reused): id(tensor) -> (weakref, slot[, id of an input's
        # storage]); id(storage) -> (weakref, storage slot) for memory the scope made, to tell an
        # undeclared alias (or a .data) of it from an input.
        self.by_id: dict[int, tuple] = {}
        self.storages: dict[int, tuple[weakref.ref, _Slot]] = {}
        self.drawn: dict[Any, GeneratorState] = {}  # the first draw from each generator: NOTE [ Random ops ]
        # The recording's ``register``; None once the scope closed (it would keep the recording in a cycle).
        self.register = register

    def encode(self, value: Any) -> Any:
        """An argument as the tape keeps it: each tensor becomes its slot."""
        if isinstance(value, torch.Tensor):
            entry = self.by_id.get(id(value))
            # The weakref tells the tensor apart from a new one that got the id of a dead one.
            return entry[1] if entry is not None and entry[0]() is value else self.add_input(value)
        if type(value) in (list, tuple) and any(isinstance(v, torch.Tensor) for v in value):
            return _Nested([self.encode(v) for v in value])
        return value

    def add_input(self, tensor: torch.Tensor) -> _Slot:
        """A slot for a tensor the scope did not make (kept by reference: _Borrowed)."""
        storage = storage_of(tensor)
        entry = self.storages.get(id(storage))
        slot = _Slot(len(self.slots))
        if entry is not None and entry[0]() is storage:
            # Another object on memory the scope made (.data, a Parameter around it): replayed as a view.
            self.slots.append(_SlotRecord(_Alias(tensor), entry[1], None, None, False, slot))
        else:
            self.slots.append(_SlotRecord(_Borrowed(tensor), slot, None, None, False, slot))
        self.by_id[id(tensor)] = (weakref.ref(tensor), slot, id(storage))
        return slot

    def record(
        self, func: Any, info: OpInfo, args: tuple, kwargs: dict, out: Any, written: list, draw: Any
    ) -> None:
        """After an op ran: append it, a slot for each new tensor it returned. ``written``: (slot,
        version after the op) per tensor written in place."""
        grad = _grad_enabled()
        # See NOTE [ Speed ] (c).
        outputs = ((out, info.fresh[0]),) if type(out) is torch.Tensor else _outputs(out, info.fresh)
        if not outputs and not written:
            # .item(), .equal() and the like: nothing a later op could read, nothing to replay.
            return
        by_id, encoded, reads = self.by_id, [], []
        for a in args:
            # ``encode``, inlined for a tensor and for a plain value: NOTE [ Speed ] (c).
            if isinstance(a, torch.Tensor):
                entry = by_id.get(id(a))
                a = entry[1] if entry is not None and entry[0]() is a else self.add_input(a)
                reads.append(a)
            elif type(a) in (list, tuple):
                a = self.encode(a)
                if type(a) is _Nested:
                    reads.extend(v for v in a if type(v) is _Slot)
            encoded.append(a)
        args = tuple(encoded)
        if kwargs:
            kwargs = {k: self.encode(v) for k, v in kwargs.items()}
            reads.extend(_slot_args(kwargs.values()))
        else:
            kwargs = _NO_KWARGS
        slots, metas = [], []
        for tensor, fresh in outputs:
            try:  # _meta, inlined: NOTE [ Speed ] (c)
                meta = (tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype, tensor.device)
            except (RuntimeError, NotImplementedError):
                meta = _meta(tensor)
            entry = by_id.get(id(tensor))
            metas.append(meta)
            if entry is not None and entry[0]() is tensor:
                slots.append(entry[1])  # in-place and out= ops return an argument: it keeps its slot
                continue
            # New memory, says the schema: is it (an undeclared alias of memory the tape knows)?
            storage = storage_of(tensor) if fresh else None
            known = None if storage is None else self.storages.get(id(storage))
            if storage is None or (known is not None and known[0]() is storage):
                slots.append(_alias_slot(self, tensor, known if storage is not None else None, args))
                continue
            # New memory: a scope tensor, unless made with grad off (NOTE [ What "born in the scope" means ]).
            slot = _Slot(len(self.slots))
            self.slots.append(_SlotRecord(None, slot, tensor._version, meta, grad, slot))
            self.storages[id(storage)] = (weakref.ref(storage), slot)
            by_id[id(tensor)] = (self.register(tensor, slot, slot) if grad else weakref.ref(tensor), slot)
            slots.append(slot)
        writes = ()
        if written:
            writes = tuple(slot for slot, _ in written)
            for slot, version in written:
                # The version after the op of the counter it shares (see _SlotRecord.version_slot).
                counter = self.slots[self.slots[slot].version_slot]
                if counter.version is not None and version is not None:
                    counter.version = version
        if draw is not None:
            self.drawn.setdefault(draw.key(), draw)
        # See NOTE [ Speed ] (b).
        op = (func, args, kwargs, tuple(slots), tuple(metas), writes, draw, grad, info.call, tuple(reads))
        self.ops.append(tuple.__new__(_Op, op))


def _alias_slot(tape: _Tape, tensor: torch.Tensor, known: tuple | None, args: tuple) -> _Slot:
    """A slot for an output on memory the tape knows (``known``: its storage's entry, None for a view)."""
    slots = tape.slots
    slot = _Slot(len(slots))
    if known is not None:
        # An alias the schema does not declare (_unsafe_view, unsafe_split's chunks in RNN cells): no
        # base to be recognised by, so registered itself if its memory is; a version counter of its own.
        storage_slot, version_slot, version = known[1], slot, tensor._version
        made = slots[storage_slot].is_scope_tensor
    else:
        # A view: it lives in the storage of the op's first tensor argument, and shares its version
        # counter. Not registered: the pack hook finds a view of a scope tensor by its _base, and a
        # detach() has none.
        base = next((a for a in args if type(a) is _Slot), None)
        storage_slot = slot if base is None else slots[base].storage_slot
        version_slot = slot if base is None else slots[base].version_slot
        version, made = None, False
    slots.append(_SlotRecord(None, storage_slot, version, None, made, version_slot))
    # A scope tensor is registered, so that the pack hook knows it (NOTE [ Speed ] (f)).
    ref = tape.register(tensor, storage_slot, version_slot) if made else weakref.ref(tensor)
    tape.by_id[id(tensor)] = (ref, slot)
    return slot


class _Recording:
    """One scope's lifetime: its tape and replayer, and which of its scope tensors are alive."""

    def __init__(self, hooks: _ResidentHooks, preserve_rng_state: bool) -> None:
        self.hooks = hooks
        self.tape = _Tape(self.register)
        # Our keys in _SCOPE_TENSORS, of scope tensors alive (a set: atomic add and discard, any thread).
        self.scope_tensors: set[int] = set()
        self.open = True
        self.rng = preserve_rng_state  # NOTE [ Random ops ]
        # Captured once, before the scope's first op. See NOTE [ RNG and autocast in a replay ].
        state, self.uninitialised = capture_every_device(preserve_rng_state)
        # The replayer shares the tape but holds no reference back to us: we reference it, and a
        # cycle would free the tape (and the inputs it keeps) only when the garbage collector runs.
        self.replayer = _Replayer(self.tape.ops, self.tape.slots, self.tape.drawn, state)

    def register(self, tensor: torch.Tensor, storage_slot: _Slot, version_slot: _Slot) -> _ScopeTensor:
        """A scope tensor, registered for the pack hook (NOTE [ Speed ] (f))."""
        entry = _ScopeTensor(tensor, _scope_tensor_died)
        entry.key, entry.recording = id(tensor), self
        entry.storage_slot, entry.version_slot = storage_slot, version_slot
        _SCOPE_TENSORS[entry.key] = entry
        self.scope_tensors.add(entry.key)
        return entry

    def close(self, failed: bool) -> None:
        """The scope's ``with`` block ended (``failed``: by an exception)."""
        self.open = False
        tape = self.tape
        # Identities are only needed while ops are still being recorded.
        tape.by_id, tape.register = {}, None
        storages, tape.storages = tape.storages, {}
        replayer = self.replayer
        replayer.state = with_initialised_inside(replayer.state, self.uninitialised)
        replayer.closed = True
        # Safety net for schemas that lie: an output we took for new memory but that shares an outside
        # tensor's storage is stored, not recomputed (that tensor may change it, unseen).
        inputs = [s.source.tensor for s in tape.slots if type(s.source) is _Borrowed]
        borrowed = {id(storage_of(tensor)) for tensor in inputs}
        replayer.chain.closed(inputs)
        lying = {storages[key][1] for key in borrowed if key in storages and storages[key][0]() is not None}
        for key in list(self.scope_tensors):
            entry = _SCOPE_TENSORS.get(key)
            tensor = None if entry is None else entry()
            if tensor is None:
                continue
            # After an exception no new references: scope tensors still alive are stored normally.
            # A leaf that requires grad (made in the scope) is the user's state: see the NOTE.
            if failed or entry.storage_slot in lying or (tensor.requires_grad and tensor.is_leaf):
                if _SCOPE_TENSORS.get(key) is entry:
                    del _SCOPE_TENSORS[key]
                self.scope_tensors.discard(key)
        if not self.scope_tensors:
            self.hooks.live_recordings.discard(self)


class _Slot(int):
    """A slot number; in a recorded op's arguments it stands for the slot's tensor (its own type: not
    mistaken for an int argument; NOTE [ Speed ] (d))."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"_Slot({int(self)})"


class _SlotRecord:
    """What the tape knows of the tensor in one slot."""

    __slots__ = ("is_scope_tensor", "meta", "source", "storage_slot", "version", "version_slot")

    def __init__(
        self, source: Any, storage_slot: _Slot, version: int | None, meta: tuple | None, made: bool,
        version_slot: _Slot,
    ) -> None:
        # None for a tensor an op made, else how a replay gets it: _Borrowed, _Snapshot once the scope
        # wrote to it, _Alias for another tensor object on memory the scope made.
        self.source = source
        self.storage_slot = storage_slot  # the slot whose storage it lives in (itself: new memory, inputs)
        # The slot whose version counter it shares: its base's for a view, else itself (an undeclared
        # alias counts its own writes, as unsafe_split's chunks do).
        self.version_slot = version_slot
        self.version = version  # a counter of its own made in the scope: its version after the last op
        self.meta = meta  # new memory: its metadata (tells a view of it autograd saves from the tensor)
        self.is_scope_tensor = made  # registered: NOTE [ What "born in the scope" means ]


class _Op(NamedTuple):
    func: Any
    args: tuple  # tensors replaced by their slots
    kwargs: dict
    outputs: tuple[_Slot, ...]  # the slot of each tensor it returned
    metas: tuple[tuple, ...]  # and that tensor's metadata, for the replay's check
    writes: tuple[_Slot, ...]  # slots it writes in place
    draw: GeneratorState | None  # a random op: its generator's state before it drew (NOTE [ Random ops ])
    grad: bool  # grad mode when it ran (some kernels ask: an RNN's returns a workspace only with it)
    call: Any  # func's C++ entry point (OpInfo.call): NOTE [ Speed ] (k)
    reads: tuple[_Slot, ...]  # the slots among its arguments, nested lists included (for _plan_replay)


class _Nested(tuple):
    """A list argument with tensors in it (``torch.cat([a, b])``), as the tape keeps it."""

    __slots__ = ()

    def resolve(self, values: list[Any]) -> list[Any]:
        return [values[a] if type(a) is _Slot else a for a in self]


def _outputs(out: Any, fresh: tuple[bool, ...]) -> list[tuple[torch.Tensor, bool]]:
    """The tensors an op returned, flat, each with its ``fresh`` flag (new memory): NOTE [ Speed ] (c)."""
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


def _version_of(tensor: torch.Tensor) -> int | None:
    """A tensor's version counter; None for an inference tensor, which has none (written in place only
    under inference_mode, unseen before backward, as a write through .data is)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


class _Borrowed:
    """A tensor from outside the scope that the replay reads: kept by reference, checked by version
    (NOTE [ Inputs are kept, not recomputed ])."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = _version_of(tensor)

    def materialize(self) -> torch.Tensor:
        if _version_of(self.tensor) != self.version:
            # Limitation (1) of NOTE [ What a replay refuses ].
            raise CheckpointError(
                "gradient_checkpoint_scope: a tensor from outside the scope, read inside it, was modified "
                f"in place before backward recomputed the scope (version {self.tensor._version}, read at "
                f"version {self.version}; shape {list(self.tensor.shape)}). The recomputation would read "
                "the new values and give wrong gradients. Modify it out of place, or after backward."
            )
        return self.tensor


# =========================================================================================== 2. the reference
# NOTE [ What "born in the scope" means ] (notebook 04b §4)
# A *scope tensor* is a tensor object a recorded op returned as new memory with grad on (or an
# undeclared alias of one), or a view autograd made of one (its ``_base`` is one), known by identity
# in the process-wide _SCOPE_TENSORS (a weakref callback removes the entry before its id is reused).
# Another object on that memory is stored as autograd would, keeping no recording alive: a
# ``detach()`` (truncated BPTT's hidden state, else recomputed from parameters updated since); a
# ``.data`` or a Parameter around it (inside the scope read as a view of it: _Alias); a leaf that
# requires grad (the user's state); new memory made with grad off (optimizer state: registered, it
# held a hook for the optimizer's life). Limits: a write through ``.data`` after the scope goes unseen
# (NOTE [ What a replay refuses ]).
class _ScopeTensor(weakref.ref):
    """A scope tensor in the registry: a weak reference naming its recording, the slot whose storage
    it lives in and the slot whose version counter it shares."""

    __slots__ = ("key", "recording", "storage_slot", "version_slot")  # See NOTE [ Speed ] (f).


_SCOPE_TENSORS: dict[int, _ScopeTensor] = {}


def _scope_tensor_died(entry: _ScopeTensor) -> None:
    # Identity check: the entry may have been forgotten already (after an exception in the scope).
    if _SCOPE_TENSORS.get(entry.key) is entry:
        del _SCOPE_TENSORS[entry.key]
        recording = entry.recording
        # The recording's bookkeeping, here rather than in a method of it: NOTE [ Speed ] (l).
        recording.scope_tensors.discard(entry.key)
        if not recording.scope_tensors and not recording.open:
            recording.hooks.forget(recording)


class _PackHook:
    """Our pack hook, one per entry of ours on the stack: an open scope's, the resident one (``below``
    None), or a wrapper standing in for another hook (NOTE [ Hooks that outlive the with block ])."""

    __slots__ = ("below",)

    def __init__(self, below: tuple[Any, Any] | None) -> None:
        # The (pack, unpack) pair that gets tensors not made in a scope; None: store them ourselves.
        self.below = below

    def __call__(self, tensor: torch.Tensor) -> Any:
        # A scope tensor: no op runs here, so the hook need not be marked running (NOTE [ Speed ] (l)).
        ref = _scope_ref(tensor)
        if ref is not None:
            return ref
        _thread.in_hook += 1
        try:
            if self.below is None:
                return _Stored(tensor)
            pack, unpack = self.below
            return _Delegated(unpack, pack(tensor))
        finally:
            _thread.in_hook -= 1


def _scope_ref(tensor: torch.Tensor, register: bool = True) -> _ScopeTensorRef | None:
    """What autograd stores for ``tensor`` if it is a scope tensor (else None). ``register=False``: not
    wanted by its replays (NOTE [ Inputs are kept, not recomputed ])."""
    owner = _SCOPE_TENSORS.get(id(tensor))  # NOTE [ What "born in the scope" means ]
    if owner is None:
        # A view autograd made of a scope tensor (after the scope, say); id(None) is never a key.
        owner = _SCOPE_TENSORS.get(id(tensor._base))
    made = owner() if owner is not None else None
    # A leaf that requires grad is the user's state (made in a scope still open).
    if made is None or (made.requires_grad and made.is_leaf):
        return None
    replayer, storage_slot, version_slot = owner.recording.replayer, owner.storage_slot, owner.version_slot
    version = tensor._version
    # Limitation: a replay could not reproduce it. Modified in place by an op we did not record
    # (after the scope), or a conjugate or negative view (a lazy bit that _restrided would drop).
    if version != replayer.slots[version_slot].version or tensor.is_conj() or tensor.is_neg():
        return None
    geometry = None
    # The registered tensor itself, on memory of its own, is its slot's tensor (NOTE [ Speed ] (n));
    # a view or an undeclared alias is remade from its geometry, unless it has its base's.
    if made is not tensor or storage_slot != version_slot:
        geometry = (tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype)
        if geometry == replayer.slots[storage_slot].meta[:4]:
            geometry = None
    ref = _ScopeTensorRef(replayer, storage_slot, version_slot, version, geometry)
    if register:
        replayer.refs.append(weakref.ref(ref))
    return ref


def _unpack(packed: _ScopeTensorRef | _Stored | _Delegated) -> torch.Tensor:
    """The unpack hook of every entry of ours."""
    _thread.in_hook += 1
    try:
        if type(packed) is _ScopeTensorRef:  # packed.unpack(), without its frame: NOTE [ Speed ] (l)
            return packed.replayer.serve(packed)
        return packed.unpack()
    finally:
        _thread.in_hook -= 1


class _ScopeTensorRef:
    """What autograd stores for a scope tensor: its replayer, storage slot, version slot and version
    when saved, and its geometry if it is a view (None: the slot's tensor)."""

    __slots__ = (
        "__weakref__", "consumer", "geometry", "replayer", "round", "storage_slot", "version", "version_slot"
    )

    def __init__(
        self, replayer: _Replayer, storage_slot: int, version_slot: int, version: int, geometry: tuple | None
    ) -> None:
        self.replayer = replayer
        self.storage_slot = storage_slot
        self.version_slot = version_slot
        self.version = version
        self.geometry = geometry
        self.round = -1  # the last replay that served this reference
        # Saved after the scope closed, by a consumer: NOTE [ The first replay of a backward ].
        self.consumer = replayer.closed

    def unpack(self) -> torch.Tensor:
        return self.replayer.serve(self)


class _Stored:
    """A tensor not created in any scope, stored as autograd would store it."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        # Detached: a saved *output* returned as is references its own grad_fn, a cycle through
        # C++ that not even the garbage collector frees (the output's memory would leak). A leaf
        # (a parameter) has no grad_fn: stored as is, it costs no detach op (NOTE [ Speed ] (i)).
        self.tensor = tensor if tensor.grad_fn is None else tensor.detach()
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


# ============================================================================================== 3. the replay
# NOTE [ One replay per backward ] (notebook 04b §7)
# The first unpack replays once and keeps the tensor of each slot a live _ScopeTensorRef wants, until
# every reference that wanted it has it; a second unpack of a reference (retain_graph) replays again
# (but see NOTE [ The first replay of a backward ]). A replay runs only the ops a wanted tensor
# depends on (_plan_replay), below autograd in the grad mode each ran in, and frees each
# intermediate after its last reader.
#
# NOTE [ What a replay refuses ] (notebook 04b §9)
# With CheckpointError, what would give silently wrong gradients: (1) an outside tensor modified in
# place since the scope read it; (2) a scope tensor modified in place after autograd saved it;
# (3) recomputed outputs whose number, shape, strides, storage offset, dtype or device differ.
# (3) catches writes through .data (no version bump) that change what a tensor looks like. Not
# detectable: a scope tensor written through ``.data`` after the scope and before autograd saves it
# (the replay recomputes the old values; a checksum would cost a pass over every saved tensor).
class _Plan(NamedTuple):
    """What one replay runs, for one set of wanted storage slots: see NOTE [ One replay per backward ]."""

    key: tuple  # (ops recorded, wanted storage slots) it was computed for
    run: list[int]  # the ops to re-run, in the forward's order
    frees: list[list[int]]  # per op run: the slots that no later op nor any reference needs
    inputs: list[int]  # the input slots it reads (_Borrowed, _Snapshot), made first
    alias_at: dict[int, list[int]]  # per op run: the _Alias slots it is the first to read


def _slot_args(args: Any) -> list[_Slot]:
    """The slots among recorded arguments, nested lists included."""
    found = []
    for arg in args:
        if type(arg) is _Slot:
            found.append(arg)
        elif type(arg) is _Nested:
            found.extend(a for a in arg if type(a) is _Slot)
    return found


def _plan_replay(
    ops: list[_Op], slots: list[_SlotRecord], wanted: dict, key: tuple, held: frozenset = frozenset()
) -> _Plan:
    """What a replay for ``wanted`` (storage slots) runs. ``held``: slots whose tensors the replay has
    already (NOTE [ The first replay of a backward ])."""
    # Backwards from the end: an op runs if a later one (or a reference) needs a tensor it returns,
    # or if it writes into memory that is needed (a storage slot: its own, or a view's).
    needed_slots: set[int] = set()
    needed_storage = set(wanted) - held
    run: list[int] = []
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        for o in op.outputs:
            if o in needed_slots or (o in needed_storage and slots[o].storage_slot == o):
                break
        else:
            for w in op.writes:
                if slots[w].storage_slot in needed_storage:
                    break
            else:
                continue
        run.append(i)
        for slot in op.reads:
            if slot not in held:
                needed_slots.add(slot)
                needed_storage.add(slots[slot].storage_slot)
    run.reverse()
    # Over the ops that run: when each input is first read, and when each slot is last needed.
    last_use: dict[int, int] = {}
    first_use: dict[int, int] = {}
    for n, i in enumerate(run):
        op = ops[i]
        for slot in op.reads:
            last_use[slot] = n
            if slots[slot].source is not None:
                first_use.setdefault(slot, n)
        for slot in op.outputs:
            last_use[slot] = n
    alias_at: dict[int, list[int]] = {}
    for slot, n in list(first_use.items()):
        if type(slots[slot].source) is _Alias:
            del first_use[slot]
            alias_at.setdefault(n, []).append(slot)
            # Made from its storage slot's recomputed memory: that must still be there then.
            memory = slots[slot].storage_slot
            last_use[memory] = max(last_use.get(memory, n), n)
    frees: list[list[int]] = [[] for _ in run]
    for slot, n in last_use.items():
        if slot not in wanted:
            frees[n].append(slot)
    return _Plan(key, run, frees, list(first_use), alias_at)


class _Replayer:
    """Re-runs one recording's tape for the scope tensors backward unpacks (NOTE [ One replay per
    backward ]); a lock makes unpacks on several threads take turns."""

    def __init__(self, ops: list[_Op], slots: list[_SlotRecord], drawn: dict, state: ReplayState) -> None:
        # The recording's own lists: ops recorded later (an unpack inside the scope) are seen too.
        self.ops = ops
        self.slots = slots
        self.drawn = drawn
        self.state = state
        self.lock = threading.RLock()
        # Weak: the graph owns the references. A dead one tells the replay its tensor is not needed.
        self.refs: list[weakref.ref[_ScopeTensorRef]] = []
        self.values: dict[int, torch.Tensor] = {}
        self.pending: dict[int, int] = {}
        self.round = 0
        self.cached_plan: _Plan | None = None
        # The scope's with block has ended: no op will be recorded any more (an input's source may change).
        self.closed = False
        # The seam to the peak-parity machinery behind the banner: NOTE [ A chain of scoped blocks ].
        self.chain = _Chain()

    def serve(self, ref: _ScopeTensorRef) -> torch.Tensor:
        """Unpack: the recomputed tensor for ``ref``, replaying first if this round has none."""
        with self.lock:
            version = self.slots[ref.version_slot].version
            if version != ref.version:
                # Limitation (2) of NOTE [ What a replay refuses ].
                raise CheckpointError(
                    "gradient_checkpoint_scope: a tensor created in the scope was modified in place after "
                    f"autograd saved it (saved at version {ref.version}, the scope left it at version "
                    f"{version}). Without the scope autograd would raise too: one of the "
                    "variables needed for gradient computation has been modified by an inplace operation."
                )
            value = self.values.get(ref.storage_slot) if ref.round != self.round else None
            if value is None:
                self._replay(ref)
                value = self.values[ref.storage_slot]
            ref.round = self.round
            self.pending[ref.storage_slot] -= 1
            if self.pending[ref.storage_slot] <= 0:
                # Every live reference to this slot has it now: backward holds the only references.
                self.values.pop(ref.storage_slot, None)
                self.pending.pop(ref.storage_slot, None)
        return value if ref.geometry is None else _restrided(value, ref.geometry)

    def _plan(self, wanted: dict[int, int], held: frozenset = frozenset()) -> _Plan:
        """``_plan_replay``'s plan, computed again only if ops were recorded since or others are wanted."""
        key = (len(self.ops), frozenset(wanted), held)
        if self.cached_plan is None or self.cached_plan.key != key:
            self.cached_plan = _plan_replay(self.ops, self.slots, wanted, key, held)
        return self.cached_plan

    def _replay(self, trigger: _ScopeTensorRef) -> None:
        refs = [r for r in (ref() for ref in self.refs) if r is not None]
        self.refs = [weakref.ref(r) for r in refs]
        # Which it serves, what it has already, whether it lets go: all, none, yes, but in a chain of blocks.
        refs, held, let_go = self.chain.select(self, refs, trigger)
        wanted: dict[int, int] = {}  # storage slot -> how many references want it (not a Counter: speed)
        for r in refs:
            wanted[r.storage_slot] = wanted.get(r.storage_slot, 0) + 1
        plan = self._plan(wanted, held)
        values: list[Any] = [None] * len(self.slots)
        for slot in held:
            values[slot] = self.values[slot]
        # Below autograd: a replay builds no graph (backward wires the unpacked tensors to the
        # original one); each op in the grad mode it ran in (CPU LSTM's mkldnn_rnn_layer returns its
        # workspace only with grad on). RNG and autocast: NOTE [ RNG and autocast in a replay ].
        grad = caller_grad = torch.is_grad_enabled()
        rng = self.state.rng
        # The caller's generators, put back by hand afterwards (NOTE [ Speed ] (i)).
        callers = [draw.now() for draw in self.drawn.values()]
        if rng is not None:
            callers.append(RNGState.capture(d for d, _ in rng.devices))
        try:
            # is_recomputing() is True for Python that runs inside the replay (another mode's
            # __torch_dispatch__, a hook): the same answer our checkpoints give in their re-runs.
            with torch._C._AutoDispatchBelowAutograd(), _autocast_off(self.state), recomputing():
                if rng is not None:
                    rng.restore()
                _run_plan(self, plan, values, grad, let_go)
        finally:
            for state in callers:
                state.restore()
            _set_grad_enabled(caller_grad)
        self.values = {slot: values[slot] for slot in wanted}
        self.pending = dict(wanted)
        if self.chain.offers:
            self.chain.offer(self.values)
        self.round += 1


def _run_plan(replayer: _Replayer, plan: _Plan, values: list[Any], grad: bool, let_go: bool) -> None:
    """Run ``plan``'s ops on the replayed ``values`` (by slot), checking what each returns. ``let_go``:
    an earlier scope's tensor read as an input is let go (NOTE [ Inputs are kept, not recomputed ])."""
    ops, slots, alias_at = replayer.ops, replayer.slots, plan.alias_at
    # Inputs first: if one was modified in place since, fail before running anything.
    for slot in plan.inputs:
        source = slots[slot].source
        values[slot] = source.materialize()
        if let_go and type(source) is _Borrowed and replayer.closed:
            replayer.chain.let_go(replayer, slot)  # if an earlier scope's tensor: it recomputes it
    for n, i in enumerate(plan.run):
        op = ops[i]
        _, args, kwargs, outputs, metas, _, draw, op_grad, call, _ = op  # at once: NOTE [ Speed ] (m)
        if op_grad is not grad:
            grad = op_grad
            _set_grad_enabled(grad)
        if alias_at and n in alias_at:
            # A tensor sharing the scope's memory: a view of the recomputed memory.
            for slot in alias_at[n]:
                values[slot] = _restrided(values[slots[slot].storage_slot], slots[slot].source.geometry)
        # _resolve, inlined for the positional arguments: NOTE [ Speed ] (d).
        args = [
            values[a] if type(a) is _Slot else a.resolve(values) if type(a) is _Nested else a for a in args
        ]
        if draw is not None:
            draw.restore()  # its generator as the forward's op found it: NOTE [ Random ops ]
        # op.func(...), without its Python frame: NOTE [ Speed ] (k).
        out = call(*args, **{k: _resolve(v, values) for k, v in kwargs.items()}) if kwargs else call(*args)
        if type(out) is torch.Tensor and len(outputs) == 1:
            try:  # _check_replayed, inlined for a strided tensor that passes: NOTE [ Speed ] (d)
                same = (out.shape, out.stride(), out.storage_offset(), out.dtype, out.device) == metas[0]
            except (RuntimeError, NotImplementedError):
                same = False
            if not same:
                _check_replayed(op, out, metas[0])
            values[outputs[0]] = out
        else:
            recomputed = [t for t, _ in _outputs(out, ())]
            if len(recomputed) != len(outputs):
                # Limitation (3) of NOTE [ What a replay refuses ], as _check_replayed.
                raise _replay_mismatch(op, f"{len(recomputed)} tensors", f"{len(outputs)}")
            for slot, tensor, meta in zip(outputs, recomputed, metas, strict=True):
                _check_replayed(op, tensor, meta)
                values[slot] = tensor
        for slot in plan.frees[n]:
            # Not needed by a later op nor by a reference: let it go now.
            values[slot] = None


def _check_replayed(op: _Op, tensor: torch.Tensor, meta: tuple) -> None:
    """Limitation (3) of NOTE [ What a replay refuses ]: the replayed tensor looks like the forward's."""
    if _meta(tensor) != meta:
        raise _replay_mismatch(op, _describe(_meta(tensor)), _describe(meta))


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


# NOTE [ Random ops ] (notebook 04b §10)
# The state at the scope's entry is not enough: code in the scope may reseed between two random ops.
# So each op that draws (OpInfo.random: aten's ``nondeterministic_seeded`` tag, any custom op)
# records its generator's state just before (``GeneratorState``: its ``generator`` argument, else its
# device's default), the replay sets it right before re-running it and puts each generator back
# afterwards. A random op the replay skips shifts no other's numbers. Limit: a custom op drawing from
# another generator draws from wherever the replay left it.
_NOTHING = contextlib.nullcontext()


# NOTE [ RNG and autocast in a replay ] (notebook 04b §10)
# Autocast is off (below autograd the recorded ops are cast already). The default CPU generator and
# every initialised accelerator's are captured at the scope's entry and the replay draws in a fork;
# an accelerator first initialised inside replays from its fresh seed (``with_initialised_inside``).
def _autocast_off(state: ReplayState) -> Any:
    """``state.autocast.restored()``, without autocast contexts when autocast is off (NOTE [ Speed ] (i))."""
    if any(torch.is_autocast_enabled(device_type) for device_type, _, _ in state.autocast.settings):
        return state.autocast.restored()
    return _NOTHING


# ====================================================================================== 4. the resident hooks
# NOTE [ Hooks that outlive the with block ] (notebook 04b §11)
# ``y = x * c`` saves x after the with block, but each ``saved_tensors_hooks.__exit__`` pops the top
# of the thread's stack, whoever pushed it. So a scope that closes with its tensors alive rebuilds
# the stack (restack): a *resident* entry of ours at the bottom, every entry above it wrapped (a
# _PackHook whose ``below`` is the original pair), so each enclosing context pops its own wrapper.
# When the last scope tensor dies, the stack is put back as it was. A hook entered after the scope
# closed is innermost, and gets the scope tensors saved then.
#
# NOTE [ Safe points ] (notebook 04b §11)
# The resident entry is taken out only on its own thread, outside our hooks, outside backward (the
# engine restores the stack after every node). A death inside backward retries right after it
# (_AfterBackward); one on another thread waits for the owner's next scope tensor freed, scope opened
# or closed, the entry meanwhile storing what it is given.
def _top() -> tuple[Any, Any] | None:
    # True: the real top, even while a compiler traces (with False it would read as empty then).
    return _top_saved_tensors_default_hooks(True)


class _ResidentHooks:
    """One per thread: its open scope, its recordings whose tensors may still be saved, our resident entry."""

    def __init__(self) -> None:
        self.owner = threading.get_ident()
        self.open: _Recording | None = None
        # Recordings open, or with a scope tensor still alive: while any, the resident entry must stay.
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
        self.restack(drop=entry)
        # A storage freed while we were rebuilding could not release anything then.
        self.release_if_idle()

    def forget(self, recording: _Recording) -> None:
        """``recording``'s last scope tensor died: maybe remove the resident entry."""
        self.live_recordings.discard(recording)
        self.release_if_idle()

    def release_if_idle(self) -> None:
        """Remove the resident entry if no recording needs it, at a safe point (NOTE [ Safe points ])."""
        if self.live_recordings or self.resident is None or self.busy:
            return
        task = torch._C._current_graph_task_id()
        if task != -1:
            # Inside backward: try again once it is over.
            if task != self.retry_after:
                self.retry_after = task
                try:
                    torch.autograd.Variable._execution_engine.queue_callback(_AfterBackward(self))
                except (RuntimeError, AttributeError):
                    # No callbacks here (an unusual engine, or none in this torch): the next safe
                    # point will do it (one stack entry kept a while; gradients unaffected).
                    pass
            return
        # Not a safe point: another thread, inside a hook, or hooks disabled (we could not pop).
        if threading.get_ident() != self.owner or _thread.in_hook or not _saved_tensors_hooks_is_enabled():
            return
        self.restack()

    def restack(self, drop: _PackHook | None = None) -> None:
        """Make this thread's stack right, without ``drop`` (a closing scope's entry): with live
        recordings, our resident entry at the bottom and every other entry ours or wrapped; without,
        no resident entry and every wrapper unwrapped."""
        self.busy = True  # a scope tensor dying meanwhile must not start another rebuild
        try:
            self.resident = self._restacked(bool(self.live_recordings), drop)
        finally:
            self.busy = False

    def _restacked(self, keep: bool, drop: _PackHook | None) -> _PackHook | None:
        resident, top = self.resident, _top()
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
    """A final callback for the autograd engine that does nothing when called (still under the
    engine's guard, which would undo a change to the stack): its use is its death, with the graph
    task, after backward returned, normally on the thread that called it: a safe point there."""

    __slots__ = ("hooks",)

    def __init__(self, hooks: _ResidentHooks) -> None:
        self.hooks = hooks

    def __call__(self) -> None:
        pass

    def __del__(self) -> None:
        # At interpreter exit there is nothing left to restore.
        if not sys.is_finalizing():
            self.hooks.release_if_idle()


# ======================================================================================================
# Hardening: what real code needs besides the mechanism above. Each part is a NOTE the code cites.
# ======================================================================================================
# NOTE [ Private names ]
# The private names the scope can't do without (ckpt_lab/torch_private.py lists each use), looked up
# at import: on a torch lacking one the scope refuses to open, naming it, rather than fail in backward.
_LACKING = [
    path
    for path, found in (
        ("torch._C._autograd._pop_saved_tensors_default_hooks", _pop_saved_tensors_default_hooks),
        ("torch._C._autograd._push_saved_tensors_default_hooks", _push_saved_tensors_default_hooks),
        ("torch._C._autograd._saved_tensors_hooks_is_enabled", _saved_tensors_hooks_is_enabled),
        ("torch._C._autograd._top_saved_tensors_default_hooks", _top_saved_tensors_default_hooks),
        ("torch._C._current_graph_task_id", _current_graph_task_id),
        ("torch._C._AutoDispatchBelowAutograd", optional("torch._C._AutoDispatchBelowAutograd")),
    )
    if found is None
]


# NOTE [ What the tape leaves out ] (notebook 04b §3)
# Run through the mode but not recorded: ops run by our hooks or a replay; a backward's ops
# (recorded, its gradients became scope tensors and the tape kept the parameters: a cycle nothing
# freed); ops under inference_mode that write nothing in place (their tensors can't be saved: later
# ops read them as inputs). Those that write in place are recorded: a replay must see the write.
#
# NOTE [ A scope inside a checkpoint ] (notebook 04b §2)
# A checkpoint that re-runs its region in backward matches the re-run's saved tensors to the
# forward's by position; a scope there (acting in the forward, not in backward) would shift them:
# silently wrong gradients. So there a scope does nothing. Such a checkpoint is known by its pack
# hook: torch's by the code objects of its two pack hooks (in ``_checkpoint_hook.__init__`` and
# ``_recomputation_hook.__init__``) or, from torch 2.14, their ``_checkpoint_internal = True``; any
# other by ``recomputes_region = True`` (ckpt_lab's checkpoint). Where neither finds torch's hooks,
# a scope refuses to open under a pack hook it does not know.
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


def _marks_its_pack_hooks(*hook_classes: str) -> bool:
    """Whether each of these classes' ``__init__`` sets ``_checkpoint_internal`` (on its pack hook)."""
    inits = [getattr(getattr(torch_checkpoint, name, None), "__init__", None) for name in hook_classes]
    return all("_checkpoint_internal" in getattr(getattr(i, "__code__", None), "co_names", ()) for i in inits)


# False: this torch's checkpoint hooks can't be told from others (the NOTE above).
_KNOWS_TORCH_PACK_HOOKS = len(_TORCH_CHECKPOINT_PACK_HOOKS) >= 2 or _marks_its_pack_hooks(
    "_checkpoint_hook", "_recomputation_hook"
)


def _recomputes_region(pack: Any) -> bool:
    """Whether ``pack`` is the pack hook of a checkpoint that re-runs its region in backward."""
    # Through decorators (torch wraps its re-run's pack hook in torch._dynamo.disable), a few deep:
    # a __wrapped__ chain may loop.
    for _ in range(8):
        if getattr(pack, "recomputes_region", False) is True:
            return True
        if getattr(pack, "__code__", None) in _TORCH_CHECKPOINT_PACK_HOOKS:
            return True
        if getattr(pack, "_checkpoint_internal", False) is True:
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
            if not _KNOWS_TORCH_PACK_HOOKS:
                hook = getattr(top[0], "__qualname__", repr(top[0]))
                feature = f"gradient_checkpoint_scope under a pack hook it does not know ({hook})"
                raise RuntimeError(
                    f"{missing_error('torch.utils.checkpoint._checkpoint_hook', feature)} Without it the "
                    "scope can't tell torch's checkpoint (inside which it must do nothing) from other pack "
                    "hooks: open the scope outside this saved_tensors_hooks context."
                )
            # Look below it (typically a save_on_cpu inside a checkpointed function).
            _pop_saved_tensors_default_hooks()
            popped.append(top)
        return False
    finally:
        for pack, unpack in reversed(popped):
            _push_saved_tensors_default_hooks(pack, unpack)


# NOTE [ A chain of scoped blocks ]
# A chain of scoped blocks (a scope that read an earlier scope's tensor) is kept at torch's peak by
# the two NOTEs below; the replay reaches their machinery through one seam, _Replayer.chain.
#
# NOTE [ The first replay of a backward ] (notebook 04b §8)
# In a chain, the first unpack of a backward comes from the last block's consumer (the loss, a head).
# Replaying the whole block then put its other saved tensors, wanted only by its own backward, beside
# the consumer's backward temporaries: one tensor above torch's checkpoint at the peak (notebook 04
# §5). So that first replay serves only the references saved after the scope closed (``consumer``);
# the rest get a second replay at the block's own backward (_Chain.split). It keeps the earlier
# scope's tensor it read, unless some of the block's own tensors, within its bytes, spare the second
# replay that tensor (_kept_for_the_second_replay). Cost: at most the last block once more per
# backward. Rejected: for every block (twice the recomputation, no lower peak), or a lone scope.
#
# NOTE [ Inputs are kept, not recomputed ] (notebook 04b §5)
# Outside tensors a replay reads are kept by strong reference, as a checkpoint keeps its input, an
# earlier scope's tensor included: recomputed instead, each scope of a chain would hold the earlier
# one's whole replay (the peak of no checkpointing). Once the later scope has replayed, such a tensor
# is let go (_Recomputed, as RETURNN's scope does); for a second backward the earlier scope's next
# replay offers its copy back (_Recomputed.offer), or the later replay asks the earlier scope for it.
class _Chain:
    """A scope's part in a chain of scoped blocks, the replay's one seam to the machinery above. For
    a scope on its own every method leaves the replay as it was."""

    __slots__ = ("chained", "offers", "split")

    def __init__(self) -> None:
        # The scope read a tensor of an earlier scope: a block of a chain. Known when the scope closes.
        self.chained = False
        # Later scopes that read one of our tensors and let it go (_Recomputed), weakly.
        self.offers: list[weakref.ref[_Recomputed]] = []
        # (backward, round) of a first replay that served only the consumers, until the rest is served.
        self.split: tuple[int, int] | None = None

    def closed(self, inputs: list[torch.Tensor]) -> None:
        """The scope closed, having read ``inputs`` from outside: is one an earlier scope's tensor?"""
        self.chained = any(_scope_ref(tensor, register=False) is not None for tensor in inputs)

    def select(
        self, replayer: _Replayer, refs: list[_ScopeTensorRef], trigger: _ScopeTensorRef
    ) -> tuple[list[_ScopeTensorRef], frozenset, bool]:
        """The references a replay serves, the slots it has already, and ``_run_plan``'s ``let_go``."""
        let_go, held, task = True, frozenset(), _graph_task_id()
        if task != -1 and _thread.replayed_in != task:
            # The first replay of this backward: see NOTE [ The first replay of a backward ].
            _thread.replayed_in = task
            if self.chained and trigger.consumer and not all(r.consumer for r in refs):
                keep, let_go = _kept_for_the_second_replay(replayer, refs)
                # The consumers' tensors (for every reference to them) and those kept.
                served = keep | {r.storage_slot for r in refs if r.consumer}
                refs = [r for r in refs if r.storage_slot in served]
                self.split = (task, replayer.round + 1)
        elif self.split is not None:
            if self.split[0] == task:
                # The rest, after a first replay that served the consumers (and kept ``held``).
                refs = [r for r in refs if r.round != self.split[1]]
                held = frozenset(s for s in replayer.values if any(r.storage_slot == s for r in refs))
            self.split = None
        return refs, held, let_go

    def let_go(self, replayer: _Replayer, slot: int) -> None:
        """After a replay read input ``slot``: an earlier scope's tensor is from now on recomputed there."""
        record = replayer.slots[slot]
        ref = _scope_ref(record.source.tensor, register=False)
        if ref is not None:
            record.source = _Recomputed(ref, replayer)

    def offer(self, values: dict[int, torch.Tensor]) -> None:
        """This scope replayed: offer later scopes what they let go of (``_Recomputed.offer``)."""
        self.offers = [o for o in self.offers if (offer := o()) is not None and offer.offer(values)]


def _kept_for_the_second_replay(replayer: _Replayer, refs: list[_ScopeTensorRef]) -> tuple[set[int], bool]:
    """For a first replay that serves the consumers: the block's own tensors it keeps too, and whether
    it lets go of the earlier scopes' tensors it reads. Some, and yes, if then the second replay needs
    none of those tensors and they weigh no more than those do; else none, and no."""
    ops, slots = replayer.ops, replayer.slots
    consumers = Counter(r.storage_slot for r in refs if r.consumer)
    own = Counter(r.storage_slot for r in refs if not r.consumer and r.storage_slot not in consumers)
    first = _plan_replay(ops, slots, consumers, ())
    earlier = {s for s in first.inputs if type(slots[s].source) is _Borrowed}
    earlier = {s for s in earlier if _scope_ref(slots[s].source.tensor, register=False) is not None}
    written = {slots[w].storage_slot for op in ops for w in op.writes}
    made_by = {o: i for i in first.run for o in ops[i].outputs}
    # Kept as the first replay made them: memory no op writes to, made by an op it runs; the latest
    # first (it spares the second replay the most).
    candidates = sorted((s for s in own if s not in written and s in made_by), key=made_by.get, reverse=True)
    kept: list[int] = []
    for slot in candidates[:4]:
        kept.append(slot)
        second = _plan_replay(ops, slots, own, (), frozenset(kept))
        if not earlier & set(second.inputs):
            size = sum(math.prod(slots[s].meta[0]) * slots[s].meta[3].itemsize for s in kept)
            budget = sum(slots[s].source.tensor.untyped_storage().nbytes() for s in earlier)
            return (set(kept), True) if size <= budget else (set(), False)
    return set(), False


class _Recomputed:
    """An earlier scope's tensor a replay read as an input (a _Borrowed until then), let go after it."""

    __slots__ = ("__weakref__", "kept", "reader", "ref", "wanted")

    def __init__(self, ref: _ScopeTensorRef, reader: _Replayer) -> None:
        self.ref = ref  # into the earlier scope; not wanted by its replays until needed here
        self.reader = weakref.ref(reader)  # the replayer of the scope that reads it
        self.kept: torch.Tensor | None = None
        self.wanted = False
        # The earlier scope offers us what its next replay recomputes (``offer``).
        with ref.replayer.lock:
            ref.replayer.chain.offers.append(weakref.ref(self))

    def offer(self, values: dict[int, torch.Tensor]) -> bool:
        """The earlier scope replayed ``values`` (by storage slot): keep ours if the reading scope may
        replay again (a reference of its alive: retain_graph). Returns whether the offer stays open."""
        reader = self.reader()
        if reader is None or self.kept is not None:
            return False
        value = values.get(self.ref.storage_slot)
        if value is None or not any(r() is not None for r in reader.refs):
            return True
        geometry = self.ref.geometry
        self.kept = value if geometry is None else _restrided(value, geometry)
        return False

    def materialize(self) -> torch.Tensor:
        if self.kept is not None:
            return self.kept
        ref = self.ref
        if not self.wanted:
            # Wanted from now on: that scope's replays keep it until served here.
            self.wanted = True
            replayer = ref.replayer
            with replayer.lock:
                replayer.refs.append(weakref.ref(ref))
                if ref.storage_slot in replayer.values:
                    replayer.pending[ref.storage_slot] += 1
        return ref.unpack()


class _Alias:
    """Another tensor object on memory the scope made (a ``.data``, a Parameter wrapped around it):
    a replay makes it as a view of the recomputed memory, with its geometry."""

    __slots__ = ("geometry",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.geometry = (tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype)


# NOTE [ Outside tensors written in place ] (notebook 04b §6)
# An outside tensor written in place in the scope (BatchNorm's running statistics) must be updated
# once, by the forward: it is copied just before the first write (_Snapshot) and each replay writes
# into a copy of that copy. Memory the scope made (.data, a Parameter initialised in place) is no
# outside tensor (_Alias). Refused: an outside tensor changed unseen between the scope's read and write.
def _before_writes(tape: _Tape, info: OpInfo, args: tuple, kwargs: dict) -> list[tuple[_Slot, int | None]]:
    """Before an op that writes in place runs: (slot, version after the op) of each tensor it writes,
    the outside ones copied first."""
    written = []
    for tensor, marked in info.written(args, kwargs):
        version = _version_of(tensor)
        # ``tape.encode``, but an input also names its storage: ``p.data = ...`` swaps it (a LazyLinear's
        # first forward), and p is then another input. Looked for only before writes (NOTE [ Speed ] (h));
        # a new storage that got a dead one's id goes unseen (the write then goes to a copy).
        entry = tape.by_id.get(id(tensor))
        swapped = entry is not None and len(entry) == 3 and entry[0]() is tensor
        swapped = swapped and entry[2] != id(storage_of(tensor))
        slot = tape.add_input(tensor) if swapped else tape.encode(tensor)
        memory = tape.slots[tape.slots[slot].storage_slot]
        source = memory.source
        if type(source) is _Borrowed:
            if _version_of(source.tensor) != source.version:
                # Limitation: the copy would hold values the scope's earlier reads did not see.
                raise CheckpointError(
                    "gradient_checkpoint_scope: a tensor from outside the scope changed between the "
                    "scope reading it and writing to it, by an op the scope did not see."
                )
            memory.source = _Snapshot(source.tensor)
        # A marked write bumps the version above us (ADInplaceOrView), after the op returns to autograd.
        written.append((slot, None if version is None else version + marked))
    return written


class _Snapshot:
    """An input the scope writes to in place, copied before the first write; each replay writes into
    a copy of this copy."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.clone()

    def materialize(self) -> torch.Tensor:
        return self.tensor.clone()


_dynamo_skips: list[Any] = []


def _skip_dynamo(code: types.CodeType) -> None:
    """Tell Dynamo to skip ``code``'s frames and those they call, once (NOTE [ Speed ] (j))."""
    _dynamo_skips.append(code)
    if getattr(_RecordingMode.__torch_dispatch__, "__wrapped__", None) is not None:
        # torch kept its wrapper (_RecordingMode._should_skip_dynamo): ``code`` is then the wrapper's,
        # shared by every function torch._dynamo.disable wraps, and not ours to mark.
        return
    try:
        # Dynamo imported on first use, as the wrapper would (importing it takes a while); the marker
        # is the C API _RecordingMode._should_skip_dynamo found (torch._dynamo re-exports it).
        import torch._dynamo  # noqa: F401
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        return  # a torch without Dynamo: nothing would trace the mode anyway
    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))


# ======================================================================================================
# Appendix: NOTE [ Speed ]
# ======================================================================================================
# NOTE [ Speed ] (notebook 04b §12)
# The recording runs once per forward op, the replay once per op it re-runs: both spare Python calls.
# (a) An op's schema facts come from _aten's cache by id(func).
# (b) tuple.__new__(_Op, ...), not _Op(...): a NamedTuple's __new__ is a Python function.
# (c) _Tape.record writes out the common paths (one tensor returned, a known tensor or a plain value as
#     argument, an output's metadata, new memory); _outputs flattens by hand, without pytree.
# (d) type(x) is _Slot, not isinstance(); _resolve and _check_replayed inlined once per argument or
#     output of every replayed op; no Counter (its update is Python).
# (e) One shared empty dict (_NO_KWARGS) for ops called without keyword arguments.
# (f) __slots__ on the per-tensor objects; _ScopeTensor, a weakref subclass, is the one weak reference
#     a scope tensor costs (by_id and the registry share it).
# (g) What every op is asked are C calls (graph task, inference mode) or attributes of its OpInfo.
# (h) A known tensor costs a dict lookup and a weakref call; a swapped storage is looked for only
#     before an in-place write.
# (i) Per scope: no autocast context when autocast is off; the caller's generators put back by hand; a
#     leaf saved in the scope stored without a detach op; the autocast-off state made once per device.
# (j) torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable, whose wrapper swaps the
#     frame-evaluation callback four times per call (a tenth of the scope's time on a pointwise chain);
#     instead its code object is marked once for Dynamo to skip (_skip_dynamo), in C.
# (k) The recording and the replay call an op's C++ entry point (OpInfo.call, _Op.call).
# (l) The pack hook marks itself as running only where it may run ops; the unpack hook serves a
#     reference without its unpack method; a scope tensor's death callback does the bookkeeping itself.
# (m) A replay unpacks each op's fields at once; its plan reads _Op.reads, gathered when recording.
# (n) The pack hook compares geometries only for a view or an undeclared alias.
# On the benchmark's chain of 64 dropout blocks: (k)-(n) took the scope from 1.26x to 1.16x torch's
# non-reentrant checkpoint; (c) and (d) as they are now, 4% more.
