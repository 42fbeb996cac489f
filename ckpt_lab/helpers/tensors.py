"""Small tensor helpers the notebooks and the tests share: fresh leaves, gradients, bitwise equality."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["all_equal", "grads", "leaves"]


def leaves(*shapes: tuple[int, ...], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """One ``torch.randn`` leaf that requires grad per shape, drawn in order."""
    return [torch.randn(*shape, dtype=dtype, requires_grad=True) for shape in shapes]


def grads(*tensors: torch.Tensor) -> list[torch.Tensor | None]:
    """Copies of the tensors' ``.grad`` (None where there is none); the ``.grad`` are reset to None,
    ready for the next run."""
    out = [None if t.grad is None else t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out


def all_equal(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> bool:
    """Bitwise equal (``torch.equal``), position by position, and as many of each."""
    return all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True))
