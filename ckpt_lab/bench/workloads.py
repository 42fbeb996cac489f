"""The models every strategy is measured on: stacks of blocks, each with its input.

Shared by the benchmark, the Pareto sweep, notebook 05 and the tests, so that "mlp-8" means one
thing everywhere. Every factory seeds torch before building, so two calls give the same weights and
input; every block is in training mode (dropout active).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "FACTORIES",
    "DropoutChainBlock",
    "PointwiseBlock",
    "Workload",
    "chain",
    "mlp",
    "pointwise",
    "suite",
    "transformer",
]


@dataclass
class Workload:
    """A stack of blocks and an input; ``family`` groups workloads that differ only in depth."""

    family: str
    depth: int
    blocks: list[nn.Module]
    input: torch.Tensor
    # How to build it again in another process: its factory's name in ``FACTORIES`` and its arguments.
    spec: tuple[str, dict[str, Any]] = ("", {})

    @property
    def name(self) -> str:
        return f"{self.family}-{self.depth}"

    def parameters(self) -> list[torch.Tensor]:
        return [p for block in self.blocks for p in block.parameters()]


def mlp(depth: int, width: int = 1024, batch: int = 64, device: str = "cpu") -> Workload:
    """``depth`` blocks of Linear + GELU + Dropout."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1)) for _ in range(depth)]
    x = torch.randn(batch, width)
    spec = ("mlp", {"depth": depth, "width": width, "batch": batch, "device": device})
    return Workload("mlp", depth, [b.to(device).train() for b in blocks], x.to(device).requires_grad_(), spec)


def transformer(
    depth: int, d_model: int = 256, nhead: int = 4, seq: int = 128, batch: int = 8, device: str = "cpu"
) -> Workload:
    """``depth`` ``nn.TransformerEncoderLayer`` blocks (dropout 0.1, batch first)."""
    torch.manual_seed(0)
    blocks = [
        nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=4 * d_model, dropout=0.1, batch_first=True)
        for _ in range(depth)
    ]
    x = torch.randn(batch, seq, d_model)
    spec = (
        "transformer",
        {"depth": depth, "d_model": d_model, "nhead": nhead, "seq": seq, "batch": batch, "device": device},
    )
    return Workload(
        "transformer", depth, [b.to(device).train() for b in blocks], x.to(device).requires_grad_(), spec
    )


class PointwiseBlock(nn.Module):
    """Ten cheap pointwise ops: the per-op overhead of hooks and dispatch modes dominates."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(5):
            x = torch.sin(x) * self.scale
        return x


def pointwise(depth: int, size: int = 64, device: str = "cpu") -> Workload:
    """``depth`` ``PointwiseBlock``s on a ``size`` x ``size`` input."""
    torch.manual_seed(0)
    x = torch.randn(size, size)
    spec = ("pointwise", {"depth": depth, "size": size, "device": device})
    return Workload(
        "pointwise",
        depth,
        [PointwiseBlock().to(device) for _ in range(depth)],
        x.to(device).requires_grad_(),
        spec,
    )


class DropoutChainBlock(nn.Module):
    """Eight cheap pointwise ops and a dropout (on CPU three aten ops more: its mask is drawn, scaled
    and applied): where the cost per op of a dispatch mode or a hook shows, with random ops to replay."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.p = p
        self.scale = nn.Parameter(torch.ones(()))
        self.shift = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.sin(x) * self.scale
        x = torch.cos(x) + self.shift
        x = torch.tanh(x) * 2
        x = torch.sigmoid(x) - 0.5
        return F.dropout(x, self.p, self.training)


def chain(depth: int, rows: int = 32, cols: int = 256, device: str = "cpu") -> Workload:
    """``depth`` ``DropoutChainBlock``s on a ``rows`` x ``cols`` input (the chain of 64 such blocks
    on 32 x 256 on which the scope was measured at 1.33x torch's non-reentrant checkpoint)."""
    torch.manual_seed(0)
    x = torch.randn(rows, cols)
    spec = ("chain", {"depth": depth, "rows": rows, "cols": cols, "device": device})
    blocks = [DropoutChainBlock().to(device).train() for _ in range(depth)]
    return Workload("chain", depth, blocks, x.to(device).requires_grad_(), spec)


FACTORIES = {"mlp": mlp, "transformer": transformer, "pointwise": pointwise, "chain": chain}


def suite(quick: bool, device: str = "cpu") -> Iterator[Workload]:
    """The benchmark's workloads: the benchmark page's seven, or five small ones (``quick``, a minute)."""
    if quick:
        yield from (mlp(d, width=256, batch=16, device=device) for d in (4, 8))
        yield transformer(2, d_model=64, nhead=4, seq=32, batch=4, device=device)
        yield pointwise(8, device=device)
        yield chain(16, device=device)
    else:
        yield from (mlp(d, device=device) for d in (8, 16, 32))
        yield from (transformer(d, device=device) for d in (4, 8))
        yield pointwise(32, device=device)
        yield chain(64, device=device)
