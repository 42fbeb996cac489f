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

Below the banner: torch's keywords and messages, and a determinism check torch's reentrant variant
does not have (NOTE [ The reentrant determinism check ]).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ckpt_lab._eager import run_eagerly
from ckpt_lab.errors import CheckpointError, missing_error, optional
from ckpt_lab.rng import ReplayState, recomputing

__all__ = ["CheckpointFunction", "reentrant_checkpoint"]


def reentrant_checkpoint(
    function: Callable[..., Any], *args: Any, preserve_rng_state: bool = True, **options: Any
) -> Any:
    """``function(*args)``, storing only the inputs; the activations are recomputed in backward.

    Like ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)``.
    ``preserve_rng_state=False`` skips the RNG snapshot: only safe if ``function`` draws no random
    numbers (no dropout), or if different ones in the recomputation are acceptable.
    ``options`` takes torch's keywords as torch's reentrant variant does, so that a call written for
    torch drops in: ``use_reentrant=True`` and ``early_stop`` are accepted and ignored (this variant
    always re-runs the whole block); ``context_fn``, ``debug=True`` or
    ``respect_saved_tensors_hooks`` raise ``ValueError``, and so does any other keyword: none is
    passed on to ``function`` (use ``ckpt_lab.checkpoint`` for that). ``determinism_check`` is
    ours to keep: ``"default"`` checks that the recomputed outputs are the forward's (torch's
    reentrant variant checks nothing; NOTE [ The reentrant determinism check ]), ``"none"`` skips it.
    """
    if torch.compiler.is_compiling():
        # NOTE [ Checkpoints under torch.compile ] (ckpt_lab.compiled): a graph break, then eager.
        return run_eagerly(
            reentrant_checkpoint, function, *args, preserve_rng_state=preserve_rng_state, **options
        )
    if not _check_options(options):
        function = _Unchecked(function)  # determinism_check="none"
    if not torch.is_grad_enabled():
        # No graph will be built, so there is nothing to save and nothing to recompute.
        return function(*args)
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        # The autograd node only joins the graph through inputs that require grad; without one the
        # outputs are plain constants and parameters inside ``function`` never see a gradient.
        warnings.warn(_NO_INPUT_REQUIRES_GRAD, UserWarning, stacklevel=2)
    return CheckpointFunction.apply(function, preserve_rng_state, *args)


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
        outputs = function(*args)
        # What backward's re-run must reproduce: NOTE [ The reentrant determinism check ].
        checked = preserve_rng_state and not isinstance(function, _Unchecked)
        ctx.fingerprints = _Fingerprints(outputs) if checked else None
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> tuple[torch.Tensor | None, ...]:
        # False inside ``torch.autograd.grad`` and ``backward(inputs=...)``: the engine only computes
        # the gradients asked for and must not write to ``.grad`` -- but our nested backward would.
        # (torch.autograd._is_checkpoint_valid(), asked behind the banner.)
        if not _is_checkpoint_valid():
            raise RuntimeError(_INCOMPATIBLE_WITH_GRAD)
        # Fresh leaves cut from the saved inputs: the nested backward stops at them and leaves their
        # gradients in ``.grad``, where we pick them up. requires_grad is copied so inputs that did
        # not require grad stay constants.
        inputs = list(ctx.inputs)
        for i, saved in zip(ctx.tensor_indices, ctx.saved_tensors, strict=True):
            inputs[i] = saved.detach().requires_grad_(saved.requires_grad)

        # Recompute with the forward's RNG and autocast state, this time recording a graph.
        with ctx.replay_state.replay(), torch.enable_grad(), recomputing():
            outputs = ctx.function(*inputs)
        if ctx.fingerprints is not None:
            ctx.fingerprints.check(outputs)
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
            raise RuntimeError(_NO_OUTPUT_REQUIRES_GRAD)
        # The reentrant step: a whole backward pass run from inside this node's backward. It fills
        # ``.grad`` of our detached inputs and, as a side effect, of the parameters used inside.
        recomputed, grads = zip(*pairs, strict=True)
        torch.autograd.backward(recomputed, grads)

        # One gradient per forward argument: none for ``function`` and ``preserve_rng_state``.
        input_grads = tuple(inp.grad if isinstance(inp, torch.Tensor) else None for inp in inputs)
        return (None, None, *input_grads)


# ============================================================================================
# Behind the mechanism: torch's keywords and messages, and our determinism check
# ============================================================================================
class _Unchecked:
    """``determinism_check="none"``: the function, marked so that ``CheckpointFunction`` compares
    nothing, as torch's reentrant variant. (With ``preserve_rng_state=False`` it compares nothing
    either: the caller accepts other random numbers, so other outputs.)"""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __call__(self, *args: Any) -> Any:
        return self.function(*args)


def _check_options(options: dict[str, Any]) -> bool:
    """torch's checks on the keywords of its reentrant variant, with torch's messages first; whether
    our determinism check is on."""
    if options.pop("use_reentrant", True) is not True:
        raise ValueError(
            "reentrant_checkpoint: use_reentrant must be True here (this is the reentrant variant); "
            "for use_reentrant=False call ckpt_lab.checkpoint."
        )
    context_fn = options.pop("context_fn", None)
    debug = options.pop("debug", False)
    respect = options.pop("respect_saved_tensors_hooks", None)
    determinism_check = options.pop("determinism_check", "default")
    # Accepted by torch's reentrant variant and ignored there: it has no early stop.
    options.pop("early_stop", None)
    custom_context = context_fn is not None and getattr(context_fn, "__name__", "") != "noop_context_fn"
    if custom_context or debug or respect is not None:
        # torch 2.13's sentence names context_fn and debug; 2.14's adds respect_saved_tensors_hooks.
        # Ours then says which of the three this call passed.
        passed = [
            f"{name}={value!r:.40}"
            for name, value, given in (
                ("context_fn", context_fn, custom_context),
                ("debug", debug, bool(debug)),
                ("respect_saved_tensors_hooks", respect, respect is not None),
            )
            if given
        ]
        raise ValueError(
            "Passing `context_fn` or `debug` is only supported when use_reentrant=False. "
            f"reentrant_checkpoint got {', '.join(passed)}: it recomputes inside its own backward, where "
            "no context, op log or saved-tensor hook applies; ckpt_lab.checkpoint (the non-reentrant "
            "variant) takes them."
        )
    if options:
        raise ValueError(
            "Unexpected keyword arguments: " + ",".join(options) + ". reentrant_checkpoint passes no "
            "keyword arguments to the function: bind them first, e.g. with functools.partial, or call "
            "ckpt_lab.checkpoint, which passes them on."
        )
    if determinism_check not in ("default", "none"):
        raise ValueError(
            f"reentrant_checkpoint: determinism_check should be one of ['default', 'none'], but got "
            f'{determinism_check}. "default" checks that the recomputed outputs are the forward\'s; '
            '"none" checks nothing, as torch\'s reentrant variant.'
        )
    return determinism_check == "default"


def _is_checkpoint_valid() -> bool:
    """``torch.autograd._is_checkpoint_valid()``, torch's own answer (its reentrant checkpoint asks it
    too); on a torch without it, a clear error: skipping the check could write ``.grad`` where
    ``torch.autograd.grad()`` must not."""
    valid = optional("torch.autograd._is_checkpoint_valid")
    if valid is None:
        raise missing_error(
            "torch.autograd._is_checkpoint_valid", "reentrant_checkpoint's check against autograd.grad()"
        )
    return valid()


_NO_INPUT_REQUIRES_GRAD = (
    "None of the inputs have requires_grad=True. Gradients will be None. "
    "reentrant_checkpoint's output will not require grad, and parameters used inside the function "
    "will get no gradient. Make an input require grad (e.g. x.requires_grad_()), or use "
    "ckpt_lab.checkpoint (the non-reentrant variant), which tracks parameters too."
)
_INCOMPATIBLE_WITH_GRAD = (
    "When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad() or passing an "
    "`inputs` parameter to .backward(). reentrant_checkpoint is that variant: its backward runs a "
    "nested .backward() that accumulates into .grad of every leaf it reaches, which "
    "torch.autograd.grad() and backward(inputs=...) must leave alone. Use ckpt_lab.checkpoint (the "
    "non-reentrant variant) instead, or call .backward() without `inputs`."
)
_NO_OUTPUT_REQUIRES_GRAD = (
    "none of output has requires_grad=True, this checkpoint() is not necessary. In "
    "reentrant_checkpoint's re-run none of the recomputed outputs requires grad: did the function "
    "detach its result, run under torch.no_grad(), or not use its inputs?"
)


# NOTE [ The reentrant determinism check ]
# torch's reentrant variant trusts the re-run; a function that branches on Python state (a counter,
# Python's ``random``), or that captures a tensor changed in place before backward, gets wrong
# gradients silently. The non-reentrant checkpoint compares what each run *saves*, and learns the op
# that made each saved tensor for free from its ``grad_fn``. Here the forward runs under no_grad and
# saves nothing, so there is nothing free to compare op by op.
#
# Rejected: recording the aten ops of forward and re-run with a ``TorchDispatchMode`` and comparing
# the sequences. Measured on the benchmark's quick workloads, it made this checkpoint 1.37x to 1.51x
# slower; and the sequences differ where nothing is wrong, because the forward runs with grad mode
# off and the re-run with it on: ``nn.MultiheadAttention``'s fast path (taken in eval mode only when
# grad is off), attention backends chosen by ``requires_grad``, any Python branch on
# ``torch.is_grad_enabled()``. Also rejected: running the forward with grad mode on, which changes
# what the function sees.
#
# Kept: the forward's outputs are there for free. Their shape, dtype and device, and for each
# floating-point output its norm (one reduction; on the CPU kept as a Python float, so no byte more
# is kept between forward and backward), are compared with the re-run's. A re-run that took
# another path gives other outputs; a re-run that took a faster path to the same values (the cases
# above) gives the same norm up to rounding, hence the tolerance. Not checked: with
# ``preserve_rng_state=False`` (other random numbers are accepted, so other outputs); outputs of
# tensor subclasses (a norm could run collectives) and integer outputs. On a GPU the comparison
# synchronises once per checkpoint in backward. ``determinism_check="none"`` turns it off.
class _Fingerprints:
    """The forward's outputs, as the re-run must reproduce them: metadata, and norms (see the NOTE)."""

    def __init__(self, outputs: Any) -> None:
        flat = outputs if isinstance(outputs, tuple) else (outputs,)
        self.count = len(flat)
        self.values = [(i, _meta(t), _norm(t)) for i, t in enumerate(flat) if isinstance(t, torch.Tensor)]

    def check(self, outputs: Any) -> None:
        flat = outputs if isinstance(outputs, tuple) else (outputs,)
        if len(flat) != self.count:
            raise _not_the_forward(f"the re-run returned {len(flat)} outputs, the forward {self.count}")
        for i, meta, norm in self.values:
            again = flat[i]
            if not isinstance(again, torch.Tensor) or _meta(again) != meta:
                shown = _shown(_meta(again)) if isinstance(again, torch.Tensor) else type(again).__name__
                raise _not_the_forward(f"output {i} is {shown} in the re-run, {_shown(meta)} in the forward")
            with torch.no_grad():  # the re-run runs with grad on: no graph for the norm
                rerun = _norm(again) if norm is not None else None
            if rerun is not None and not _close(norm, rerun, again.dtype):
                shown_rerun, shown_forward = _apart(float(rerun), float(norm))
                raise _not_the_forward(
                    f"output {i} has norm {shown_rerun} in the re-run and {shown_forward} in the "
                    "forward, with the same shape, dtype and device"
                )


def _meta(tensor: torch.Tensor) -> tuple:
    return tensor.shape, tensor.dtype, tensor.device


def _shown(meta: tuple) -> str:
    return f"shape={tuple(meta[0])}, dtype={meta[1]}, device={meta[2]}"


def _norm(tensor: torch.Tensor) -> float | torch.Tensor | None:
    plain = type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided
    if not plain or not tensor.dtype.is_floating_point or tensor.device.type == "meta":
        return None
    # Called with grad mode off (the forward runs so; the check turns it off): no graph, no detach.
    norm = torch.linalg.vector_norm(tensor)
    # On the CPU a Python float: no tensor is kept between forward and backward. On a device, reading
    # it would wait for the device: kept as a 0-d tensor, compared in backward.
    return norm.item() if tensor.device.type == "cpu" else norm


def _close(forward: float | torch.Tensor, rerun: float | torch.Tensor, dtype: torch.dtype) -> bool:
    # Rounding: bitwise equal on a deterministic re-run; a few units of the last place otherwise.
    rtol = 1e-2 if torch.finfo(dtype).bits <= 16 else 1e-4
    forward, rerun = float(forward), float(rerun)
    return math.isclose(forward, rerun, rel_tol=rtol) or (math.isnan(forward) and math.isnan(rerun))


def _apart(*values: float) -> list[str]:
    """The values to 3 significant digits, or to more where 3 would show them equal."""
    # 3, not 6: notebooks store this message and nbval compares it exactly, and a norm is a float sum
    # whose last digits may differ on another processor (another summation order); 3 digits stay put
    # unless the value sits on a rounding boundary.
    for digits in (3, 6, 9, 17):
        shown = [f"{value:.{digits}g}" for value in values]
        if len(set(shown)) == len(shown):
            break
    return shown


def _not_the_forward(what: str) -> CheckpointError:
    return CheckpointError(
        f"reentrant_checkpoint: the recomputation is not the forward: {what}. The function took "
        "another path when backward re-ran it (a branch on Python state that changed between the "
        "calls: a counter, a flag, Python's random), or a tensor the function captures (not one of its "
        "inputs) changed in place between forward and backward; backward would compute wrong "
        "gradients. Make that choice outside the checkpoint and pass it in, and pass tensors as "
        "arguments: autograd then catches an in-place change. To see where the runs part, run the "
        "block under ckpt_lab.checkpoint(..., debug=True); to accept the difference, pass "
        'determinism_check="none".'
    )
