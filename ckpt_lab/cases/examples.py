"""Models to explain: ``python -m ckpt_lab.explain ckpt_lab.cases.examples:FACTORY``.

Every factory returns ``(model, inputs)`` or ``(model, inputs, loss_fn)``, the form the command
takes. ``Stack`` runs the benchmark's workloads (``ckpt_lab.bench.workloads``) with any strategy of
``ckpt_lab.strategies.REGISTRY``, as one module, so that the report names modules ``layers.3.linear1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ckpt_lab.bench import workloads
from ckpt_lab.strategies import REGISTRY, planner_range

__all__ = ["Stack", "last_stage_checkpointed", "stack", "transformer_per_layer", "transformer_selective"]


class Stack(nn.Module):
    """A workload's blocks, run by the registered strategy ``strategy`` (``"torch-nonreentrant"``)."""

    def __init__(self, blocks: Sequence[nn.Module], strategy: str = "none") -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.strategy = REGISTRY[strategy]
        # The planner caches its plan per list of blocks: always hand it the same list.
        self._blocks = list(blocks)

    def prepare(self, x: torch.Tensor) -> Stack:
        """Make the plan of a planner strategy now, so that explaining the model measures a step, not
        the planner's profiling (as the benchmark does)."""
        if self.strategy.budget_fraction is not None:
            planner_range(self._blocks, x).plan(self.strategy.budget_fraction)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.strategy.run(self._blocks, x)


def stack(family: str, strategy: str, **sizes: Any) -> tuple[Stack, torch.Tensor]:
    """A workload of ``family`` ("mlp", "transformer", "pointwise"), its blocks run by ``strategy``."""
    workload = workloads.FACTORIES[family](**sizes)
    return Stack(workload.blocks, strategy).prepare(workload.input), workload.input


def transformer_per_layer() -> tuple[Stack, torch.Tensor]:
    """Four encoder layers, each in torch's non-reentrant checkpoint (the benchmark's, half depth)."""
    return stack("transformer", "torch-nonreentrant", depth=4)


def transformer_selective() -> tuple[Stack, torch.Tensor]:
    """The same layers under torch's selective checkpointing: matmul outputs kept, the rest recomputed."""
    return stack("transformer", "torch-sac-matmul", depth=4)


class _LastStageCheckpointed(nn.Module):
    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = layer(x)
        return checkpoint(self.layers[-1], x, use_reentrant=False)


def last_stage_checkpointed() -> tuple[nn.Module, torch.Tensor, Any]:
    """Eight MLP blocks, only the last one checkpointed, and a loss that keeps the output (MSE):
    the checkpoint saves nothing (notebook 02 §9)."""
    workload = workloads.mlp(8, width=1024, batch=64)
    target = torch.zeros(64, 1024)
    return _LastStageCheckpointed(workload.blocks), workload.input, lambda out: F.mse_loss(out, target)
