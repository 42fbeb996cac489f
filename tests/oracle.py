"""What the test modules share: the checkpoints they compare, bitwise equality, gradients, op chains.

Imported as ``from oracle import ...``: pyproject's ``pythonpath = ["tests"]`` puts this folder on the
path under any import mode. (Not a ``tests/conftest.py``: pytest imports every conftest as the module
``conftest``, the last one loaded wins, and ``pytest tests notebooks/*.ipynb`` (``make test``) loads
nbval's ``notebooks/conftest.py`` last, so ``from conftest import`` in a test would find that one.)

* the checkpoints: ``plain`` (no checkpoint), ``torch_reentrant``, ``torch_nonreentrant`` (torch's,
  the oracles, with ``use_reentrant`` always explicit), and the tables ``REENTRANT``, ``NON_REENTRANT``
  (``{"ours": ..., "torch": ...}``) and ``CHECKPOINTS`` (all four);
* equality: ``assert_all_equal`` (bitwise, position by position, says where and by how much);
* gradients: ``leaves``, ``grads``, ``output_and_grads``, ``saved_by``;
* ``sin_chain``; random op chains for the property tests: ``CHAIN_OPS``, ``run_chain``, ``chain``;
* ``cuda``: the mark that skips a test without a CUDA device; ``TORCH``: the running torch's
  (major, minor), and ``SAC_ASKS_IN_RECOMPUTE``, for tests that compare with a behaviour of torch's
  that changed between releases (ours is checked alike on each; torch's as it is on each).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint

# Re-exported: the tests take them from here with the rest.
from ckpt_lab.helpers.tensors import grads as grads
from ckpt_lab.helpers.tensors import leaves as leaves
from ckpt_lab.nonreentrant import checkpoint
from ckpt_lab.reentrant import reentrant_checkpoint

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
# torch's selective checkpointing before 2.13 (checked on 2.11; 2.12 was not): the policy is asked
# again in the recomputation (``ctx.is_recompute=True``), each op's cache is served first in, first
# out, and ``ctx`` has no ``op_output``. 2.13 and 2.14 ask in the forward only and serve by position.
SAC_ASKS_IN_RECOMPUTE = TORCH < (2, 13)


# ----------------------------------------------------------------------------------- the checkpoints
def plain(
    function: Callable[..., Any],
    *args: Any,
    preserve_rng_state: bool = True,
    policy: Any = None,
    **kwargs: Any,
) -> Any:
    """No checkpoint: ``function(*args, **kwargs)``; takes (and ignores) the checkpoints' own options."""
    return function(*args, **kwargs)


def torch_reentrant(function: Callable[..., Any], *args: Any, preserve_rng_state: bool = True) -> Any:
    return torch_checkpoint(function, *args, use_reentrant=True, preserve_rng_state=preserve_rng_state)


def torch_nonreentrant(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return torch_checkpoint(function, *args, use_reentrant=False, **kwargs)


# Ours and torch's, under the names the parametrized tests show.
REENTRANT: dict[str, Callable[..., Any]] = {"ours": reentrant_checkpoint, "torch": torch_reentrant}
NON_REENTRANT: dict[str, Callable[..., Any]] = {"ours": checkpoint, "torch": torch_nonreentrant}
# Every checkpoint, both variants: for what all four must do alike.
CHECKPOINTS: dict[str, Callable[..., Any]] = {
    "torch reentrant": torch_reentrant,
    "torch non-reentrant": torch_nonreentrant,
    "ckpt_lab.reentrant_checkpoint": reentrant_checkpoint,
    "ckpt_lab.checkpoint": checkpoint,
}


# -------------------------------------------------------------------------------------------- equality
def _describe(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"{tuple(t.shape)} {t.dtype} on {t.device}"


def _difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device):
        return f"{_describe(a)} against {_describe(b)}"
    both_nan = a.isnan() & b.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
    differ = (a != b) & ~both_nan
    said = []
    if differ.any():
        worst = (a.double() - b.double()).abs()[differ].max().item()
        said.append(f"{int(differ.sum())} of {a.numel()} elements differ, by up to {worst:.3g}")
    if both_nan.any():
        said.append(f"{int(both_nan.sum())} NaN in both (torch.equal counts NaN unequal to NaN)")
    return "; ".join(said)


def assert_all_equal(
    a: Sequence[torch.Tensor | None], b: Sequence[torch.Tensor | None], *, allow_none: bool = False
) -> None:
    """Bitwise equal (``torch.equal``), position by position. A missing tensor (``None``, a gradient
    that was never computed) fails, unless ``allow_none``: then ``None`` matches only ``None``."""
    assert len(a) == len(b), f"{len(a)} tensors against {len(b)}"
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        if u is None or v is None:
            missing = f"position {i}: {_describe(u)} against {_describe(v)}"
            assert allow_none and u is None and v is None, missing
            continue
        assert torch.equal(u, v), f"position {i}: {_difference(u, v)}"


# ------------------------------------------------------------------------------------------- gradients
def output_and_grads(
    run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor], *, seed: int
) -> list[torch.Tensor | None]:
    """``run`` on a fresh leaf copy of ``x`` after ``torch.manual_seed(seed)``, then backward of
    ``(out ** 2).sum()``: ``[out, x.grad, *(p.grad for p in params)]`` (the ``params``' ``.grad`` are
    reset before and after)."""
    grads(*params)
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    out = run(x)
    (out**2).sum().backward()
    return [out.detach(), *grads(x, *params)]


def saved_by(function: Callable[..., Any], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """The tensors autograd saves while ``function(*args, **kwargs)`` runs (what the outermost
    saved-tensor hooks see), in order."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        function(*args, **kwargs)
    return saved


def sin_chain(x: torch.Tensor, n: int = 6) -> torch.Tensor:
    """``x.sin()`` ``n`` times: every sin saves its input."""
    for _ in range(n):
        x = x.sin()
    return x


# -------------------------------------------------------------------------------------- random chains
def _add_(h: torch.Tensor) -> torch.Tensor:
    return (h * 1.5).add_(0.5)


def _view_mul_(h: torch.Tensor) -> torch.Tensor:
    h = h * 1.0
    h[1:3].mul_(0.5)  # in place on a view: autograd rewrites h's history (CopySlices)
    return h


# The ops a property test strings together, each as ``op(h, x, w)``: ``h`` the chain so far, ``x`` its
# input, ``w`` a weight. A test samples the names its shapes allow: ``matmul`` needs ``h @ w`` to fit,
# ``residual`` h shaped as x, ``transpose`` a square h (the chain goes on with the same shape).
CHAIN_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sin": lambda h, x, w: h.sin(),
    "tanh": lambda h, x, w: h.tanh(),
    "relu": lambda h, x, w: h.relu(),
    "exp": lambda h, x, w: h.tanh().exp(),  # tanh first: no overflow however long the chain
    "square": lambda h, x, w: h * h,
    "scale": lambda h, x, w: h * 1.5,
    "softmax": lambda h, x, w: h.softmax(-1),
    "matmul": lambda h, x, w: h @ w,
    "residual": lambda h, x, w: h + x,
    "dropout": lambda h, x, w: F.dropout(h, 0.25),
    "add_": lambda h, x, w: _add_(h),
    "view_mul_": lambda h, x, w: _view_mul_(h),
    "transpose": lambda h, x, w: h.t(),
    "reshape": lambda h, x, w: h.reshape(2, -1).reshape(h.shape),
}


def run_chain(names: Sequence[str], h: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The ops ``names`` (keys of ``CHAIN_OPS``) applied to ``h`` in turn."""
    for name in names:
        h = CHAIN_OPS[name](h, x, w)
    return h


def chain(names: Sequence[str]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``fn(x, w)``: the ops ``names`` applied to ``x`` in turn."""
    return lambda x, w: run_chain(names, x, x, w)
