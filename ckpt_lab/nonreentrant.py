"""The non-reentrant checkpoint: let autograd build its graph as usual, but store handles, not tensors.

Introduced in notebook 03b. Same semantics as ``torch.utils.checkpoint.checkpoint(fn, *args,
use_reentrant=False, **kwargs)``, written from scratch on ``torch.autograd.graph.saved_tensors_hooks``
(torch only serves as the oracle in the tests).

The reentrant checkpoint of notebook 02 hid the block inside one autograd node and ran a nested
backward. This one leaves the graph exactly as a plain forward builds it and changes only *what the
graph stores*:

* **forward**: a pack hook swaps every tensor autograd wants to save for an empty ``_Handle``. The
  frame keeps the block's inputs and, per saved tensor, a weak reference to its handle and its
  shape, dtype and device -- nothing else.
* **backward**: the first unpack in a backward re-runs the block once, with the forward's RNG and
  autocast state, under a second pack hook that drops each recomputed tensor into its handle *by
  position*, and stops the re-run as soon as the last handle backward still needs is filled.
  Each handle gives its tensor out once, so backward frees it as soon as it has used it.

Nothing is reentrant, so ``torch.autograd.grad``, ``backward(inputs=...)``, keyword arguments and
blocks whose inputs don't require grad all just work.

torch's keywords work as torch's do (``tests/test_torch_parity.py`` runs torch's own tests on them):
``determinism_check``, ``debug`` (with ``set_checkpoint_debug_enabled``), ``early_stop`` (with
``set_checkpoint_early_stop``) and ``context_fn``. Where torch raises, the error starts with torch's
sentence, so that a search for it finds ours too, and goes on with what happened and what to do.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ckpt_lab._eager import run_eagerly
from ckpt_lab.errors import CheckpointError
from ckpt_lab.rng import ReplayState

__all__ = [
    "CheckpointError",
    "check_use_reentrant",
    "checkpoint",
    "noop_context_fn",
    "set_checkpoint_debug_enabled",
    "set_checkpoint_early_stop",
]

_ADVICE = (
    "The checkpointed function must save the same tensors when backward re-runs it: don't branch on "
    "Python state that changes between calls (counters, flags, the step number), keep "
    "preserve_rng_state=True if it draws random numbers, and don't modify its inputs in place. "
    "If it cannot be made deterministic, don't checkpoint it."
)
_DEBUG_TIP = (
    "To see the ops of the forward and of the recomputation side by side, pass debug=True to "
    "ckpt_lab.checkpoint or wrap the call in `with ckpt_lab.set_checkpoint_debug_enabled(True):`."
)
# torch's values for ``determinism_check``: compare shape, dtype and device; or compare nothing.
_DETERMINISM_CHECKS = ("default", "none")
# None: each call's keyword decides; True/False: the context managers below override it.
_early_stop_override: bool | None = None
_debug_override: bool | None = None


def noop_context_fn() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The default ``context_fn``: nothing around the forward, nothing around the recomputation."""
    return contextlib.nullcontext(), contextlib.nullcontext()


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, Any]] | None = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    use_reentrant: bool = False,
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)``, keeping only its inputs; backward recomputes the activations.

    Like ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)``, with
    torch's keywords, which are never passed on to ``function``:

    * ``preserve_rng_state=False`` skips the RNG snapshot: only safe if ``function`` draws no random
      numbers (no dropout), or if different ones in the recomputation are acceptable.
    * ``context_fn``: returns a pair of context managers, the first entered around the forward, the
      second around each recomputation. ``functools.partial(ckpt_lab.selective.
      selective_checkpoint_contexts, policy)`` makes the checkpoint selective (notebook 05), and so
      does torch's ``create_selective_checkpoint_contexts``. ``None`` means none.
    * ``determinism_check="default"`` compares shape, dtype and device of each recomputed tensor with
      the forward's and raises ``CheckpointError`` on a difference; ``"none"`` skips that comparison
      (a recomputation that saves a different *number* of tensors still raises: backward would
      miss tensors).
    * ``debug=True``: on such an error, the message adds the aten ops of the forward and of the
      recomputation side by side, each with the line of your code that ran it, and marks the first
      difference. Costs a dispatch mode around both runs; not combinable with ``context_fn``.
      ``set_checkpoint_debug_enabled`` overrides it for every checkpoint in its block.
    * ``early_stop=True`` stops the recomputation once the last tensor backward still needs is
      recomputed; ``False`` runs the whole function again (and so can notice a re-run that saves
      *more* tensors). ``set_checkpoint_early_stop`` overrides it for every checkpoint whose forward
      runs in its block.

    Containers among the arguments (lists, tuples, dicts) are rebuilt for the recomputation from
    their contents at call time, so the re-run sees them as the forward did even if the caller
    mutated them since; torch passes the caller's objects again.
    ``use_reentrant=False`` is accepted, and not passed on to ``function``, so that this drops in
    where ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)`` was; any other
    value is refused (see ``check_use_reentrant``).
    """
    if torch.compiler.is_compiling():
        # NOTE [ Checkpoints under torch.compile ] (ckpt_lab.compiled): a graph break, then eager.
        return run_eagerly(
            checkpoint, function, *args, preserve_rng_state=preserve_rng_state, context_fn=context_fn,
            determinism_check=determinism_check, debug=debug, early_stop=early_stop,
            use_reentrant=use_reentrant, **kwargs,
        )  # fmt: skip
    check_use_reentrant(use_reentrant, "checkpoint")
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"checkpoint: determinism_check should be one of {list(_DETERMINISM_CHECKS)}, but got "
            f'{determinism_check}. "default" compares shape, dtype and device of every recomputed '
            'tensor with the forward\'s; "none" compares nothing.'
        )
    debug = _debug_override if _debug_override is not None else debug
    early_stop = _early_stop_override if _early_stop_override is not None else early_stop
    if not torch.is_grad_enabled():
        # No graph will be built, so there is nothing to save and nothing to recompute.
        return function(*args, **kwargs)
    debug_log = None
    if debug:
        if context_fn not in (None, noop_context_fn):
            raise ValueError(
                "checkpoint: debug=True is incompatible with non-default context_fn. debug records "
                "the ops through a context of its own; drop one of the two."
            )
        debug_log = _DebugLog()
        context_fn = debug_log.contexts
    forward_context, recompute_context = context_fn() if context_fn else noop_context_fn()
    # Snapshot RNG and autocast before the block draws its first random number.
    replay = ReplayState.capture(args, kwargs, preserve_rng_state=preserve_rng_state)
    # Built (and its inputs saved) before our hooks are installed, so they don't swallow the inputs.
    frame = _Frame(function, args, kwargs, replay, recompute_context)
    frame.check_metadata = determinism_check == "default"
    frame.early_stop = early_stop
    frame.debug_log = debug_log
    frame.device_context = _device_context()
    with saved_tensors_hooks(_pack_to_handle(frame), _unpack_from_handle(frame)), forward_context:
        out = function(*args, **kwargs)
    frame.forward_completed = True
    return out


@contextlib.contextmanager
def set_checkpoint_early_stop(enable: bool) -> Iterator[None]:
    """Within this block, every checkpoint's forward takes ``early_stop=enable``, whatever it was passed.

    torch's context manager of the same name: only the forward needs to run inside it (the setting is
    stored with the checkpoint); the innermost block wins.
    """
    global _early_stop_override
    previous, _early_stop_override = _early_stop_override, enable
    try:
        yield
    finally:
        _early_stop_override = previous


@contextlib.contextmanager
def set_checkpoint_debug_enabled(enabled: bool | None) -> Iterator[None]:
    """Within this block, every checkpoint takes ``debug=enabled``; ``None`` defers to each call's keyword.

    torch's context manager of the same name.
    """
    global _debug_override
    previous, _debug_override = _debug_override, enabled
    try:
        yield
    finally:
        _debug_override = previous


def _device_context() -> contextlib.AbstractContextManager:
    """The innermost ``with torch.device(...)`` around the forward, to re-enter for the recomputation.

    A CUDA backward runs on autograd's device thread, where the caller's ``torch.device`` block is not
    active: without this, ``torch.empty(4)`` in the re-run would land on the CPU.
    """
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    modes = [m for m in _get_current_function_mode_stack() if isinstance(m, DeviceContext)]
    return modes[-1] if modes else contextlib.nullcontext()


class _OpRecorder(TorchDispatchMode):
    """Records each aten op that runs (but ``detach``, which checkpointing adds itself) and the line of
    user code that ran it: the innermost frame outside torch and this file."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is not torch.ops.aten.detach.default:
            self.ops.append((str(func), _user_line()))
        return func(*args, **(kwargs or {}))


_TORCH_DIR = os.path.dirname(torch.__file__)


def _user_line() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(_TORCH_DIR) and frame.filename != __file__:
            return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
    return "?"


class _DebugLog:
    """``debug=True``: one recorder around the forward, a fresh one around each recomputation."""

    def __init__(self) -> None:
        self.forward = _OpRecorder()
        self.recompute = _OpRecorder()

    def contexts(self) -> tuple[_OpRecorder, contextlib.AbstractContextManager]:
        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            self.recompute = _OpRecorder()
            with self.recompute:
                yield

        return self.forward, _Reusable(recompute)

    def explain(self, error: CheckpointError) -> CheckpointError:
        rows = itertools.zip_longest(self.forward.ops, self.recompute.ops, fillvalue=("", ""))
        width = max([len(f"{op}  ({line})") for op, line in self.forward.ops] + [len("forward")])
        lines, marked = [], False
        for i, (fwd, rec) in enumerate(rows):
            left = f"{fwd[0]}  ({fwd[1]})" if fwd[0] else ""
            right = f"{rec[0]}  ({rec[1]})" if rec[0] else ""
            mark = ""
            if not marked and fwd[0] != rec[0] and rec[0]:
                mark, marked = "   <-- first difference", True
            lines.append(f"{i:>4}  {left:<{width}}  {right}{mark}")
        header = f"{'#':>4}  {'forward':<{width}}  recomputation"
        return CheckpointError(
            f"{str(error).replace(_DEBUG_TIP, '').rstrip()}\n\n"
            "You are seeing this error because you passed `debug=True` to checkpoint (or "
            "enabled set_checkpoint_debug_enabled). The aten ops that ran in the original forward and in "
            "the recomputation, side by side (detach left out: checkpointing adds those itself; the "
            "recomputation may end early, where it had recomputed everything backward needs):\n"
            + "\n".join([header, *lines])
        )


class _Reusable:
    """A context manager that can be entered again each time (one recomputation per backward)."""

    def __init__(self, factory: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.factory = factory
        self.active: list[contextlib.AbstractContextManager] = []

    def __enter__(self) -> None:
        context = self.factory()
        self.active.append(context)
        context.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.active.pop().__exit__(*exc)


def check_use_reentrant(use_reentrant: Any, caller: str) -> None:
    """Accept torch's ``use_reentrant=False``; refuse anything else, saying where the reentrant one is.

    Without this parameter, a call written for torch (``checkpoint(f, x, use_reentrant=False)``)
    would pass the keyword on to ``f``, and the ``TypeError`` would blame the user's function.
    """
    if use_reentrant is False:
        return
    if use_reentrant is None:
        # torch's own default; in torch 2.13 it warns and then runs the reentrant variant.
        asked = "use_reentrant=None (torch's default, which means the reentrant variant)"
    else:
        asked = f"use_reentrant={use_reentrant!r}"
    raise ValueError(
        f"{caller}: got {asked}, but ckpt_lab.{caller} is the non-reentrant checkpoint. Pass "
        "use_reentrant=False or leave it out; for the reentrant variant call "
        "ckpt_lab.reentrant_checkpoint(function, *args) instead."
    )


class _StopRecomputation(Exception):
    """Raised inside the re-run once every tensor backward still needs has been recomputed."""


@dataclass(frozen=True)
class _Meta:
    """What the frame remembers of a saved tensor: enough to notice a re-run that went another way."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Meta:
        return cls(tensor.shape, tensor.dtype, tensor.device)

    def __str__(self) -> str:
        return f"shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}"


class _Handle:
    """What the graph stores instead of a saved tensor: a box that a recomputation fills, with one
    tensor per backward (graph task id) that needs it."""

    def __init__(self) -> None:
        self.recomputed: dict[int, torch.Tensor] = {}


class _SaveInputs(torch.autograd.Function):
    """A node that does nothing but keep the block's input tensors as autograd *saved tensors*."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return torch.empty(0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        # Never called: nothing ever uses this node's output.
        return (None,) * len(ctx.needs_input_grad)


# Stands in the frame's argument list for each tensor, which lives in the ``_SaveInputs`` node.
_TENSOR = object()


class _Frame:
    """Everything one checkpointed call keeps between its forward and its backward(s)."""

    def __init__(
        self,
        function: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        replay: ReplayState,
        recompute_context: contextlib.AbstractContextManager | None = None,
    ) -> None:
        self.function = function
        self.replay = replay
        # Entered around every re-run; selective checkpointing (notebook 05) serves saved ops from it.
        self.recompute_context = recompute_context or contextlib.nullcontext()
        # Flatten args and kwargs together, so tensors inside lists or dicts are saved like the rest.
        leaves, self.spec = tree_flatten((args, kwargs))
        self.leaves = [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        # Saving the inputs through autograd rather than in a list does two things: an enclosing
        # checkpoint's pack hook sees them (so a nested checkpoint's inputs, which are the outer one's
        # activations, are dropped and recomputed by the outer one), and autograd's version counter
        # catches an input modified in place before backward. The anchor requires grad so that the
        # node is recorded even when no input does.
        self.saver = _SaveInputs.apply(torch.empty(0, requires_grad=True), *tensors)
        self.handles: list[weakref.ref[_Handle]] = []
        self.metas: list[_Meta] = []
        # Graph tasks (backward calls) that have already had their recomputation.
        self.recomputed_for: set[int] = set()
        # The keywords of ``checkpoint`` (set there after construction).
        self.check_metadata = True
        self.early_stop = True
        self.debug_log: _DebugLog | None = None
        self.device_context: contextlib.AbstractContextManager = contextlib.nullcontext()
        # False while the forward runs: a backward inside it may re-run more than was saved so far.
        self.forward_completed = False

    def inputs(self) -> tuple[tuple, dict]:
        """The block's ``(args, kwargs)`` again; unpacking may trigger an enclosing checkpoint's re-run."""
        tensors = iter(self.saver.grad_fn.saved_tensors)
        leaves = [next(tensors) if leaf is _TENSOR else leaf for leaf in self.leaves]
        return tree_unflatten(leaves, self.spec)


def _pack_to_handle(frame: _Frame) -> Callable[[torch.Tensor], _Handle]:
    """The forward's pack hook: note the tensor's metadata, give autograd an empty handle instead."""

    def pack(tensor: torch.Tensor) -> _Handle:
        handle = _Handle()
        # Weak: the graph owns the handle. Once backward frees the node that saved it, the handle
        # dies, and the recomputation knows that this tensor is no longer needed.
        frame.handles.append(weakref.ref(handle))
        frame.metas.append(_Meta.of(tensor))
        return handle

    # The protocol of checkpoints whose backward re-runs the region and matches saved tensors by
    # position: a gradient_checkpoint_scope opened inside the region sees this flag and does nothing
    # (see NOTE [ A scope inside a checkpoint ] in ckpt_lab/scope.py). A copy of this file keeps it.
    pack.recomputes_region = True  # type: ignore[attr-defined]
    return pack


# Ids for unpacks outside any backward (say, reading ``grad_fn._saved_self``); real ones are >= 0.
_outside_backward = itertools.count(-2, -1)


def _graph_task_id() -> int:
    task = torch._C._current_graph_task_id()
    # -1 means "not in a backward": such an unpack gets a recomputation of its own.
    return task if task != -1 else next(_outside_backward)


def _unpack_from_handle(frame: _Frame) -> Callable[[_Handle], torch.Tensor]:
    """The forward's unpack hook, called by backward: recompute once per backward, hand out once."""

    def unpack(handle: _Handle) -> torch.Tensor:
        task = _graph_task_id()
        # The first unpack of this backward fills every live handle at once: one re-run per backward.
        if task not in frame.recomputed_for:
            _recompute(frame, task)
            frame.recomputed_for.add(task)
        if task not in handle.recomputed:
            raise CheckpointError(
                "checkpoint: Unpack is being triggered for a tensor that was already unpacked once. If "
                "you are calling ctx.saved_tensors in backward, make sure to do so only once. (Backward "
                "unpacked the same saved tensor twice: a recomputed tensor is handed out once per "
                "backward and then forgotten, so that it can be freed; if a custom autograd.Function "
                "reads ctx.saved_tensors more than once, read it once into a variable.)"
            )
        # Pop: from now on backward holds the only reference, and frees it once the node is done.
        return handle.recomputed.pop(task)

    return unpack


def _explained(frame: _Frame, error: CheckpointError) -> CheckpointError:
    """The error, with the op logs of forward and recomputation side by side if ``debug=True``."""
    return error if frame.debug_log is None else frame.debug_log.explain(error)


def _metadata_mismatch(mismatches: list[tuple[int, _Meta, _Meta]]) -> CheckpointError:
    """torch's error for recomputed tensors whose shape, dtype or device is not the forward's."""
    tensors = "".join(
        f"tensor at position {index}: saved metadata: {saved}; recomputed metadata: {recomputed}\n"
        for index, saved, recomputed in mismatches
    )
    return CheckpointError(
        "checkpoint: Recomputed values for the following tensors have different metadata than during "
        f"the forward pass.\n{tensors}The recomputation is not the forward: backward would compute "
        f"wrong gradients with these tensors. {_ADVICE}\n{_DEBUG_TIP}"
    )


def _count_mismatch(forward: int, recomputed: int) -> CheckpointError:
    """torch's error for a recomputation that saved fewer tensors than the forward."""
    return CheckpointError(
        "checkpoint: A different number of tensors was saved during the original forward and "
        f"recomputation.\nNumber of tensors saved during forward: {forward}\nNumber of tensors saved "
        f"during recomputation: {recomputed}.\nThe recomputation is not the forward: it returned before "
        f"saving every tensor backward needs. {_ADVICE}\n{_DEBUG_TIP}"
    )


def _recompute(frame: _Frame, task: int) -> None:
    """Re-run the block, filling the still-alive handles for backward ``task``, by position."""
    # Strong references for the length of the re-run; None where backward already freed the node.
    handles = [ref() for ref in frame.handles]
    # Everything after the last live handle is not needed by anyone: that is where we stop (early
    # stop), unless the caller asked for the whole re-run.
    last_needed = max(i for i, handle in enumerate(handles) if handle is not None)
    stop_at = last_needed if frame.early_stop else None
    position = itertools.count()
    # The determinism check, as torch's: note every live tensor whose metadata differs, raise at the end.
    mismatches: list[tuple[int, _Meta, _Meta]] = []
    # A backward inside the forward (and no early stop) re-runs more than the forward has saved yet.
    beyond_forward = [False]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        index = next(position)
        # Detached: the handle must keep the value alive, not the recomputed graph around it. A
        # tensor that doesn't require grad has no graph: it is kept as it is, the same object.
        value = tensor.detach() if tensor.requires_grad else tensor
        if index >= len(frame.metas):
            if not frame.forward_completed:
                beyond_forward[0] = True
                return value
            raise _explained(
                frame,
                CheckpointError(
                    "checkpoint: trying to save more tensors during recomputation than during the original "
                    f"forward pass. The forward saved {len(frame.metas)} tensors for backward; the "
                    f"recomputation went on to save one more. {_ADVICE}\n{_DEBUG_TIP}"
                ),
            )
        if handles[index] is not None:
            recomputed = _Meta.of(tensor)
            if frame.check_metadata and recomputed != frame.metas[index]:
                mismatches.append((index, frame.metas[index], recomputed))
            handles[index].recomputed[task] = value
        if index == stop_at:
            raise _StopRecomputation
        # The recomputed graph keeps its own saved tensors; it dies when the re-run returns.
        return value

    # The re-run is the region too: a scope opened in it must do nothing here either (a re-run
    # outside backward, for ``grad_fn._saved_result``, is not inside backward).
    pack.recomputes_region = True  # type: ignore[attr-defined]

    # Unpack the inputs first: for a nested checkpoint this runs the enclosing one's re-run.
    args, kwargs = frame.inputs()
    try:
        # Grad mode on (backward runs with it off), or the ops would save nothing for us to capture.
        with (
            frame.replay.replay(),
            torch.enable_grad(),
            saved_tensors_hooks(pack, lambda value: value),
            frame.device_context,
            frame.recompute_context,
        ):
            frame.function(*args, **kwargs)
    except _StopRecomputation:
        pass
    else:
        saved = next(position)
        if saved < len(frame.metas) and not beyond_forward[0]:
            raise _explained(frame, _count_mismatch(len(frame.metas), saved))
    if mismatches:
        raise _explained(frame, _metadata_mismatch(mismatches))
