"""The reentrant checkpoint: keep a block's inputs, drop its activations, recompute them in backward.

Introduced in notebook 02. Same semantics as ``torch.utils.checkpoint.checkpoint(fn, *args,
use_reentrant=True)``, written out from scratch (torch only serves as the oracle in the tests).

The trick is a custom ``torch.autograd.Function`` that wraps the whole block:

* **forward** runs the block with grad mode off, so autograd records nothing inside it and every
  intermediate activation is freed as soon as the next op has used it. Only the inputs are saved.
* **backward** runs the block *again*, this time with grad mode on, which builds a small private
  graph, and then runs a *nested* ``backward`` through that graph. This backward-inside-a-backward
  is what "reentrant" means: the autograd engine is re-entered from within one of its own nodes.

Limits that follow from the design (each one tested in ``tests/test_reentrant.py``):

* the nested backward accumulates into ``.grad`` of every leaf it reaches, so it cannot serve
  ``torch.autograd.grad`` or ``backward(inputs=...)``, which promise to leave ``.grad`` alone;
* if no tensor *input* requires grad, the node is cut out of the graph: parameters used inside the
  block silently get no gradient.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from ckpt_lab._eager import run_eagerly
from ckpt_lab.rng import ReplayState

__all__ = ["CheckpointFunction", "reentrant_checkpoint"]


def reentrant_checkpoint(
    function: Callable[..., Any], *args: Any, preserve_rng_state: bool = True, **options: Any
) -> Any:
    """``function(*args)``, storing only the inputs; the activations are recomputed in backward.

    Like ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)``.
    ``preserve_rng_state=False`` skips the RNG snapshot: only safe if ``function`` draws no random
    numbers (no dropout), or if different ones in the recomputation are acceptable.
    ``options`` takes torch's keywords as torch's reentrant variant does, so that a call written for
    torch drops in: ``use_reentrant=True``, ``determinism_check`` and ``early_stop`` are accepted and
    ignored (this variant has neither); ``context_fn`` or ``debug=True`` raise ``ValueError``, and so
    does any other keyword: none is passed on to ``function`` (use ``ckpt_lab.checkpoint`` for that).
    """
    if torch.compiler.is_compiling():
        # NOTE [ Checkpoints under torch.compile ] (ckpt_lab.compiled): a graph break, then eager.
        return run_eagerly(
            reentrant_checkpoint, function, *args, preserve_rng_state=preserve_rng_state, **options
        )
    _check_options(options)
    if not torch.is_grad_enabled():
        # No graph will be built, so there is nothing to save and nothing to recompute.
        return function(*args)
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        # The autograd node only joins the graph through inputs that require grad; without one the
        # outputs are plain constants and parameters inside ``function`` never see a gradient.
        warnings.warn(
            "None of the inputs have requires_grad=True. Gradients will be None "
            "(reentrant_checkpoint: none of the tensor inputs requires grad, so the output will not "
            "require grad and parameters used inside the function will get no gradient. Make an "
            "input require grad (e.g. x.requires_grad_()), or use ckpt_lab.checkpoint (the "
            "non-reentrant variant), which tracks parameters too.)",
            UserWarning,
            stacklevel=2,
        )
    return CheckpointFunction.apply(function, preserve_rng_state, *args)


def _check_options(options: dict[str, Any]) -> None:
    """torch's checks on the keywords of its reentrant variant, with torch's messages first."""
    if options.pop("use_reentrant", True) is not True:
        raise ValueError(
            "reentrant_checkpoint: use_reentrant must be True here (this is the reentrant variant); "
            "for use_reentrant=False call ckpt_lab.checkpoint."
        )
    context_fn = options.pop("context_fn", None)
    debug = options.pop("debug", False)
    # Accepted by torch's reentrant variant and ignored there: it has no determinism check and no early stop.
    options.pop("determinism_check", None)
    options.pop("early_stop", None)
    if (context_fn is not None and getattr(context_fn, "__name__", "") != "noop_context_fn") or debug:
        raise ValueError(
            "Passing `context_fn` or `debug` is only supported when use_reentrant=False. "
            "(reentrant_checkpoint recomputes inside its own backward, with no hook for a context or an "
            "op log; call ckpt_lab.checkpoint, the non-reentrant variant, which takes both.)"
        )
    if options:
        raise ValueError(
            "Unexpected keyword arguments: " + ",".join(options) + " (reentrant_checkpoint passes no "
            "keyword arguments to the function: bind them first, e.g. with functools.partial, or call "
            "ckpt_lab.checkpoint, which passes them on.)"
        )


class CheckpointFunction(torch.autograd.Function):
    """``CheckpointFunction.apply(function, preserve_rng_state, *args)``: run ``function(*args)``
    keeping only the tensor inputs; recompute it during backward."""

    @staticmethod
    def forward(ctx: Any, function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        ctx.function = function
        # Non-tensor arguments (ints, flags, None, ...) are kept aside as they are; a ``None`` marks
        # each slot a saved tensor will fill again in backward.
        ctx.tensor_indices = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.inputs = [None if isinstance(a, torch.Tensor) else a for a in args]
        # save_for_backward (not ``ctx.x = x``) so autograd can check the inputs were not modified
        # in place before backward, and so saved-tensor hooks see them.
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_indices))
        # Snapshot the RNG (dropout masks!) and autocast state: the recomputation must see the same.
        ctx.replay_state = ReplayState.capture(*args, preserve_rng_state=preserve_rng_state)
        # ``Function.apply`` already runs forward with grad mode off, so no graph is recorded here and
        # the block's activations die young. torch wraps this call in an extra ``torch.no_grad()``,
        # which is redundant.
        return function(*args)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> tuple[torch.Tensor | None, ...]:
        # False inside ``torch.autograd.grad`` and ``backward(inputs=...)``: the engine only computes
        # the gradients asked for and must not write to ``.grad`` -- but our nested backward would.
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad() or passing "
                "an `inputs` parameter to .backward(). (reentrant_checkpoint is that variant: it "
                "recomputes the block and runs a nested .backward() that accumulates into .grad of the "
                "leaves it reaches, which torch.autograd.grad() and backward(inputs=...) must not touch. "
                "Use ckpt_lab.checkpoint (the non-reentrant variant) instead, or call .backward() "
                "without `inputs`.)"
            )
        # Fresh leaves cut from the saved inputs: the nested backward stops at them and leaves their
        # gradients in ``.grad``, where we pick them up. requires_grad is copied so inputs that did
        # not require grad stay constants.
        inputs = list(ctx.inputs)
        for i, saved in zip(ctx.tensor_indices, ctx.saved_tensors, strict=True):
            inputs[i] = saved.detach().requires_grad_(saved.requires_grad)

        # Recompute with the forward's RNG and autocast state, this time recording a graph.
        with ctx.replay_state.replay(), torch.enable_grad():
            outputs = ctx.function(*inputs)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)

        # Pair each recomputed output with the gradient flowing into its forward twin; outputs that
        # do not require grad (ints, detached tensors) have nothing to propagate.
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, grad_outputs, strict=True)
            if isinstance(out, torch.Tensor) and out.requires_grad
        ]
        if not pairs:
            raise RuntimeError(
                "none of output has requires_grad=True, this checkpoint() is not necessary "
                "(reentrant_checkpoint: none of the recomputed outputs requires grad, so there is "
                "nothing to backpropagate through; this checkpoint is not needed: did the function "
                "detach its result, run under torch.no_grad(), or not use its inputs?)"
            )
        # The reentrant step: a whole backward pass run from inside this node's backward. It fills
        # ``.grad`` of our detached inputs and, as a side effect, of the parameters used inside.
        recomputed, grads = zip(*pairs, strict=True)
        torch.autograd.backward(recomputed, grads)

        # One gradient per forward argument: none for ``function`` and ``preserve_rng_state``.
        input_grads = tuple(inp.grad if isinstance(inp, torch.Tensor) else None for inp in inputs)
        return (None, None, *input_grads)
