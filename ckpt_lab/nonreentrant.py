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
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten, tree_unflatten

from ckpt_lab.rng import ReplayState

__all__ = ["CheckpointError", "check_use_reentrant", "checkpoint"]

_ADVICE = (
    "The checkpointed function must save the same tensors when backward re-runs it: don't branch on "
    "Python state that changes between calls (counters, flags, the step number), keep "
    "preserve_rng_state=True if it draws random numbers, and don't modify its inputs in place. "
    "If it cannot be made deterministic, don't checkpoint it."
)


class CheckpointError(RuntimeError):
    """The recomputation did not reproduce the forward: its tensors would give wrong gradients."""


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    use_reentrant: bool = False,
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)``, keeping only its inputs; backward recomputes the activations.

    Like ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)``.
    ``preserve_rng_state=False`` skips the RNG snapshot: only safe if ``function`` draws no random
    numbers (no dropout), or if different ones in the recomputation are acceptable.
    ``context_fn``, as torch's: returns a pair of context managers, the first entered around the
    forward, the second around each recomputation (``selective_checkpoint`` plugs in here, and so
    does torch's ``create_selective_checkpoint_contexts``).
    Containers among the arguments (lists, tuples, dicts) are rebuilt for the recomputation from
    their contents at call time, so the re-run sees them as the forward did even if the caller
    mutated them since; torch passes the caller's objects again.
    ``use_reentrant=False`` is accepted, and not passed on to ``function``, so that this drops in
    where ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)`` was; any other
    value is refused (see ``check_use_reentrant``).
    """
    check_use_reentrant(use_reentrant, "checkpoint")
    if not torch.is_grad_enabled():
        # No graph will be built, so there is nothing to save and nothing to recompute.
        return function(*args, **kwargs)
    forward_context, recompute_context = context_fn() if context_fn else (contextlib.nullcontext(), None)
    # Snapshot RNG and autocast before the block draws its first random number.
    replay = ReplayState.capture(args, kwargs, preserve_rng_state=preserve_rng_state)
    # Built (and its inputs saved) before our hooks are installed, so they don't swallow the inputs.
    frame = _Frame(function, args, kwargs, replay, recompute_context)
    with saved_tensors_hooks(_pack_to_handle(frame), _unpack_from_handle(frame)), forward_context:
        return function(*args, **kwargs)


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
                "checkpoint: backward unpacked the same saved tensor twice. A recomputed tensor is "
                "handed out once per backward and then forgotten, so that it can be freed; if a custom "
                "autograd.Function reads ctx.saved_tensors more than once, read it once into a variable."
            )
        # Pop: from now on backward holds the only reference, and frees it once the node is done.
        return handle.recomputed.pop(task)

    return unpack


def _saved_tensor_mismatch(index: int, saved: _Meta | None, recomputed: _Meta) -> CheckpointError:
    """The error for a recomputed tensor that is not the one the forward saved at ``index``."""
    forward = f"saved {saved}" if saved is not None else "saved nothing there"
    return CheckpointError(
        f"checkpoint: the recomputation is not the forward. Saved tensor at position {index}: the forward "
        f"{forward}; the recomputation saved {recomputed}. {_ADVICE}"
    )


def _recompute(frame: _Frame, task: int) -> None:
    """Re-run the block, filling the still-alive handles for backward ``task``, by position."""
    # Strong references for the length of the re-run; None where backward already freed the node.
    handles = [ref() for ref in frame.handles]
    # Everything after the last live handle is not needed by anyone: that is where we stop.
    last_needed = max(i for i, handle in enumerate(handles) if handle is not None)
    position = itertools.count()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        index = next(position)
        recomputed = _Meta.of(tensor)
        saved = frame.metas[index] if index < len(frame.metas) else None
        # The determinism check: a different tensor at this position would mean wrong gradients.
        if recomputed != saved:
            raise _saved_tensor_mismatch(index, saved, recomputed)
        # Detached: the handle must keep the value alive, not the recomputed graph around it.
        value = tensor.detach()
        if handles[index] is not None:
            handles[index].recomputed[task] = value
        if index == last_needed:
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
            frame.recompute_context,
        ):
            frame.function(*args, **kwargs)
    except _StopRecomputation:
        return
    raise CheckpointError(
        f"checkpoint: the recomputation is not the forward. The forward saved {len(frame.metas)} tensors "
        f"for backward, the recomputation returned after saving only {next(position)}. {_ADVICE}"
    )


