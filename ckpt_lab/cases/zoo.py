"""The failure zoo of notebook 07, "Why didn't my memory drop?": each case broken, then fixed.

Every case is a minimal CPU model. Factories return ``(model, inputs)`` or ``(model, inputs, loss_fn)``,
so ``python -m ckpt_lab.explain ckpt_lab.cases.zoo:FACTORY`` explains any of them; the other
functions run one training step and return the number the notebook and ``tests/test_zoo.py`` assert.

1. **Whole function, or only its last stage**, checkpointed: ``whole_function``, ``last_stage``;
   fixed: ``each_block_but_last``.
2. **The caller keeps what the checkpoint should free**: a checkpoint around one op keeps that op's
   input, which is all it saved (``around_one_op``); a logging hook keeps activations
   (``logged_tensors``); fixed: ``logged_numbers``.
3. **No grad**: under ``torch.no_grad()`` (``called_under_no_grad``), and around a block whose inputs need
   no grad (``first_block_checkpointed``, ``params_without_grad``).
4. **BatchNorm's running statistics updated twice**: ``batchnorm_step``; fixed with
   ``ckpt_lab.batchnorm.skip_stats_update_in_recompute``.
5. **Autocast during the recomputation**: ``autocast_step`` (a weight cast cached before the checkpoint).
6. **A selective policy with a counter**: ``every_other_matmul`` shared by every call
   (``counter_shared``) or fresh per call (``counter_fresh``).
7. (The reentrant checkpoint under DDP: notebook 06.)
8. **A recomputation that differs from the forward**: ``LayerDrop`` (and ``RandomActivation``) draw
   a choice with Python's ``random`` inside the checkpoint; fixed: ``LayerDropFixed`` draws outside
   and passes it in.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ckpt_lab.batchnorm import in_backward, skip_stats_update_in_recompute
from ckpt_lab.nonreentrant import checkpoint
from ckpt_lab.reentrant import reentrant_checkpoint
from ckpt_lab.selective import selective_checkpoint

__all__ = [
    "CHECKPOINTS",
    "Chain",
    "LayerDrop",
    "LayerDropFixed",
    "RandomActivation",
    "around_one_op",
    "autocast_step",
    "batchnorm_step",
    "called_under_no_grad",
    "counter_fresh",
    "counter_shared",
    "each_block_but_last",
    "every_other_matmul",
    "first_block_checkpointed",
    "gradients",
    "last_stage",
    "layer_drop_step",
    "logged_numbers",
    "logged_tensors",
    "no_checkpoint",
    "params_without_grad",
    "whole_function",
]

WIDTH, BATCH, DEPTH = 64, 32, 4

# The four checkpoints the zoo compares, called alike: ``run(function, *args)``.
CHECKPOINTS: dict[str, Callable[..., Any]] = {
    "torch, use_reentrant=False": lambda f, *a: torch_checkpoint(f, *a, use_reentrant=False),
    "torch, use_reentrant=True": lambda f, *a: torch_checkpoint(f, *a, use_reentrant=True),
    "ckpt_lab.checkpoint": checkpoint,
    "ckpt_lab.reentrant_checkpoint": reentrant_checkpoint,
}


def block(width: int = WIDTH) -> nn.Sequential:
    """Linear, GELU, Linear: what a transformer's feed-forward does."""
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def _input() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(BATCH, WIDTH)


def _mse(out: torch.Tensor) -> torch.Tensor:
    # MSE keeps its input, the function's output, for backward (as most losses do).
    return F.mse_loss(out, torch.zeros_like(out))


def gradients(model: nn.Module, *inputs: Any, loss_fn: Callable[[Any], torch.Tensor] = _mse
              ) -> list[torch.Tensor]:
    """One step's gradients of the parameters (zeros where a parameter got none)."""
    params = list(model.parameters())
    for p in params:
        p.grad = None
    loss_fn(model(*inputs)).backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]


# ============================================================ 1, 2: where the checkpoint goes
class Chain(nn.Module):
    """``DEPTH`` blocks in a row; ``placement`` says where the checkpoints go (``ckpt_lab.checkpoint``).

    ``log``: "" (no logging), "tensors" (a forward hook keeps each GELU's output), "numbers" (it
    keeps a float per call, and only in the forward).
    """

    def __init__(self, placement: str = "none", log: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(block() for _ in range(DEPTH))
        self.placement = placement
        self.logged: list[Any] = []
        if log:
            for layer in self.layers:
                layer[1].register_forward_hook(self._log_tensor if log == "tensors" else self._log_number)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.placement == "whole":
            return checkpoint(self._all, x)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if (self.placement, i == last) in {("last", True), ("each_but_last", False)}:
                x = checkpoint(layer, x)
            elif self.placement == "one_op":
                # Only the GELU checkpointed: it saves its input, which the checkpoint keeps anyway.
                x = layer[2](checkpoint(layer[1], layer[0](x)))
            else:
                x = layer(x)
        return x

    def _all(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def _log_tensor(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        # The tensor itself: alive until the list is cleared, whatever the checkpoint does. (It is
        # logged twice, too: the recomputation runs the hook again.)
        self.logged.append(output)

    def _log_number(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        # A Python float keeps no tensor alive; a recomputation (in backward) is not logged again.
        if not in_backward():
            self.logged.append(output.detach().abs().mean().item())


def no_checkpoint() -> tuple[Chain, torch.Tensor, Any]:
    return Chain("none"), _input(), _mse


def whole_function() -> tuple[Chain, torch.Tensor, Any]:
    """Case 1: one checkpoint around all four blocks."""
    return Chain("whole"), _input(), _mse


def last_stage() -> tuple[Chain, torch.Tensor, Any]:
    """Case 1: only the last block checkpointed."""
    return Chain("last"), _input(), _mse


def each_block_but_last() -> tuple[Chain, torch.Tensor, Any]:
    """Case 1, fixed: every block checkpointed but the last (which backward needs first)."""
    return Chain("each_but_last"), _input(), _mse


def around_one_op() -> tuple[Chain, torch.Tensor, Any]:
    """Case 2: a checkpoint around the GELU only, which saves nothing but its input."""
    return Chain("one_op"), _input(), _mse


def logged_tensors() -> tuple[Chain, torch.Tensor, Any]:
    """Case 2: blocks checkpointed, but a forward hook keeps every GELU output for logging."""
    return Chain("each_but_last", log="tensors"), _input(), _mse


def logged_numbers() -> tuple[Chain, torch.Tensor, Any]:
    """Case 2, fixed: the hook keeps one float per GELU, and only in the forward."""
    return Chain("each_but_last", log="numbers"), _input(), _mse


# ======================================================================= 3: no grad to track
def called_under_no_grad(name: str) -> dict[str, Any]:
    """Case 3: checkpoint ``CHECKPOINTS[name]`` called under ``torch.no_grad()``."""
    torch.manual_seed(0)
    layer, runs = block(), []
    layer.register_forward_pre_hook(lambda module, args: runs.append(1))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = CHECKPOINTS[name](layer, _input())
    return {"forward runs": len(runs), "output requires grad": out.requires_grad, "warnings": len(caught)}


class _FirstBlockCheckpointed(nn.Module):
    def __init__(self, run: Callable[..., Any]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(block() for _ in range(2))
        self.run = run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The first block's input is the data: it needs no grad, only the block's parameters do.
        return self.layers[1](self.run(self.layers[0], x))


def first_block_checkpointed(name: str = "torch, use_reentrant=True") -> tuple[nn.Module, torch.Tensor, Any]:
    """Case 3: two blocks, the first in ``CHECKPOINTS[name]``, its input the data (no grad)."""
    return _FirstBlockCheckpointed(CHECKPOINTS[name]), _input(), _mse


def params_without_grad(name: str) -> dict[str, Any]:
    """Case 3: the first block checkpointed, its input the data (no grad): what its weights get."""
    model = _FirstBlockCheckpointed(CHECKPOINTS[name])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = gradients(model, _input())
    first = len(list(model.layers[0].parameters()))
    return {
        "first block's parameters without gradient": sum(not g.any() for g in grads[:first]),
        "warnings": len([w for w in caught if "requires" in str(w.message)]),
    }


# ================================================================ 4: BatchNorm, run twice
def batchnorm_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))


def batchnorm_step(name: str | None, fixed: bool = False) -> tuple[nn.Sequential, list[torch.Tensor]]:
    """Case 4: one training step of a BatchNorm block, checkpointed by ``CHECKPOINTS[name]`` (None:
    plain); ``fixed`` applies ``skip_stats_update_in_recompute``. Returns the model and gradients."""
    model = batchnorm_model()
    # The input requires grad so that the reentrant variants train the parameters (case 3).
    x = _input().requires_grad_()
    forward = model if name is None else (lambda h: CHECKPOINTS[name](model, h))
    hooks = skip_stats_update_in_recompute(model) if fixed else None
    params = list(model.parameters())
    loss = _mse(forward(x))
    loss.backward()
    if hooks is not None:
        hooks.remove()
    return model, [p.grad.clone() for p in params]


def batchnorm_checkpointed() -> tuple[nn.Module, torch.Tensor, Any]:
    """Case 4, for explain: the BatchNorm block in ``ckpt_lab.checkpoint``, a plain Linear after it."""
    model = nn.Sequential(_Wrapped(batchnorm_model(), checkpoint), nn.Linear(WIDTH, WIDTH))
    return model, _input().requires_grad_(), _mse


class _Wrapped(nn.Module):
    def __init__(self, inner: nn.Module, run: Callable[..., Any]) -> None:
        super().__init__()
        self.inner, self.run = inner, run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self.inner, x)


# ====================================================================== 5: autocast
# A selective policy that keeps the matmuls' outputs and the casts autocast makes for them.
_SAVE_CASTS = [torch.ops.aten.addmm.default, torch.ops.aten._to_copy.default]
AUTOCAST_RUNS: dict[str, Callable[..., Any]] = {
    **CHECKPOINTS,
    "torch SAC (saves matmuls and casts)": lambda f, x: torch_checkpoint(
        f, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(_SAVE_CASTS)),
    "ckpt_lab.selective_checkpoint (same policy)": lambda f, x: selective_checkpoint(
        f, x, policy=_SAVE_CASTS),
}


def autocast_step(name: str | None) -> list[torch.Tensor] | str:
    """Case 5: the first Linear is used before the checkpoint too, in the same bfloat16 autocast
    region, so its weight's cast is cached there; backward runs after the region. Gradients, or
    the error's first line."""
    torch.manual_seed(0)
    first, second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
    params, x = [*first.parameters(), *second.parameters()], _input().requires_grad_()

    def body(h: torch.Tensor) -> torch.Tensor:
        return second(torch.relu(first(h)))

    run = body if name is None else (lambda h: AUTOCAST_RUNS[name](body, h))
    try:
        with torch.autocast("cpu", torch.bfloat16):
            # Autocast casts ``first.weight`` here and keeps the cast until the region ends: the
            # checkpoint's forward takes it from that cache, its recomputation (after) casts again.
            out = first(x).sum() + run(x).float().sum()
        out.backward()
    except RuntimeError as error:
        # The first sentence only: the message goes on for lines.
        first_sentence = str(error).splitlines()[0].split(". ")[0].rstrip(".")
        return f"{type(error).__name__}: {first_sentence}."
    return [p.grad.clone() for p in params]


# =========================================================== 6: a policy with a counter
_MATMULS = (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)


def every_other_matmul() -> Callable[..., CheckpointPolicy]:
    """A selective policy "save every other matmul", with a counter in its closure."""
    seen = [0]

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op not in _MATMULS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        seen[0] += 1
        return CheckpointPolicy.MUST_SAVE if seen[0] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE

    policy.seen = seen  # type: ignore[attr-defined]
    return policy


class _SelectiveChain(nn.Module):
    """Three blocks of three matmuls each, every block in a selective checkpoint ("ours", "torch"),
    or none ("none")."""

    def __init__(self, policy_for_call: Callable[[], Any], implementation: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(block(), nn.Linear(WIDTH, WIDTH)) for _ in range(3))
        self.policy_for_call, self.implementation = policy_for_call, implementation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            policy = self.policy_for_call()
            if self.implementation == "none":
                x = layer(x)
            elif self.implementation == "ours":
                x = selective_checkpoint(layer, x, policy=policy)
            else:
                context = lambda policy=policy: create_selective_checkpoint_contexts(policy)
                x = torch_checkpoint(layer, x, use_reentrant=False, context_fn=context)
        return x


def counter_shared(implementation: str = "ours") -> tuple[nn.Module, torch.Tensor, Any]:
    """Case 6: one counting policy for every call: odd blocks start counting on an even matmul."""
    shared = every_other_matmul()
    return _SelectiveChain(lambda: shared, implementation), _input().requires_grad_(), _mse


def counter_fresh(implementation: str = "ours") -> tuple[nn.Module, torch.Tensor, Any]:
    """Case 6, fixed: a fresh counter for each checkpointed call."""
    return _SelectiveChain(every_other_matmul, implementation), _input().requires_grad_(), _mse


# ============================================================ 8: a different recomputation
class LayerDrop(nn.Module):
    """Skips its block with probability ``p``, drawn with Python's ``random`` *inside* the checkpoint."""

    def __init__(self, run: Callable[..., Any], p: float = 0.5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block, self.run, self.p = block(), run, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self._maybe, x)

    def _maybe(self, x: torch.Tensor) -> torch.Tensor:
        # Drawn again when backward re-runs this: a checkpoint replays torch's RNG, not Python's.
        if random.random() < self.p:
            return x
        return x + self.block(x)


class RandomActivation(LayerDrop):
    """Tanh or sigmoid at random, inside the checkpoint: both save one tensor of the same shape, so
    a recomputation that picks the other one passes torch's determinism check (shapes, dtypes and
    devices); ours compares the op that made each saved tensor and raises."""

    def _maybe(self, x: torch.Tensor) -> torch.Tensor:
        activation = torch.tanh if random.random() < self.p else torch.sigmoid
        return activation(self.block(x))


class LayerDropFixed(LayerDrop):
    """The choice drawn once, outside the checkpoint, and passed in: the recomputation gets the same."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = random.random() >= self.p
        return self.run(self._chosen, x, keep)

    def _chosen(self, x: torch.Tensor, keep: bool) -> torch.Tensor:
        return x + self.block(x) if keep else x


def layer_drop_step(name: str | None, seed: int, fixed: bool = False,
                    model: type[LayerDrop] = LayerDrop) -> list[torch.Tensor] | str:
    """Case 8: one step of ``model`` (``LayerDropFixed`` if ``fixed``) under ``CHECKPOINTS[name]``
    (None: plain), with Python's ``random`` seeded: gradients, or the error's first line."""
    identity = lambda f, *a: f(*a)
    model = LayerDropFixed if fixed else model
    model = model(identity if name is None else CHECKPOINTS[name])
    x = _input().requires_grad_()
    random.seed(seed)
    try:
        return gradients(model, x)
    except RuntimeError as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0][:150]}"
