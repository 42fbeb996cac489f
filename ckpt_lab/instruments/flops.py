"""FLOPs, op by op: the cost model the planner plans with and the benchmark counts with.

``torch.utils.flop_counter`` counts matmul-like ops only (mm, bmm, convolution, attention), and
``count_flops`` (``ckpt_lab.instruments.counting``) reports exactly that. A planner that took every
other op as free would never keep one, however large; so ``op_cost`` adds one FLOP per output
element for every other op (0 for views). ``CostCounter`` sums either cost over everything that runs
while it is active, without ``FlopCounterMode``'s module hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS
from torch.utils.flop_counter import flop_registry

from ckpt_lab._aten import is_view, tensors_in

__all__ = ["CostCounter", "matmul_flops", "op_cost"]


def op_cost(op: Any, args: Any, kwargs: Any, out: Any) -> int:
    """FLOPs of one op: torch's count for matmul-like ops, one per output element for the rest.

    torch.utils.flop_counter counts only matmuls, convolutions and attention; a planner that took
    pointwise ops as free would never keep one, however large. Views and ignored ops cost 0.
    """
    if op in SAC_IGNORED_OPS:
        return 0
    packet = op.overloadpacket
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    # A view does no arithmetic.
    if is_view(op, args, kwargs, out):
        return 0
    return sum(t.numel() for t in tensors_in(out))


def matmul_flops(op: Any, args: Any, kwargs: Any, out: Any) -> int:
    """torch.utils.flop_counter's count alone (matmul-like ops; 0 for everything else)."""
    packet = op.overloadpacket
    return int(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0


class CostCounter(TorchDispatchMode):
    """Sum a per-op cost (``op_cost`` by default) over every op run while active (forward, backward
    and recomputation alike).

    With ``cost=matmul_flops`` it counts what ``count_flops`` counts, without ``FlopCounterMode``'s
    module hooks: those run ``view_as`` inside each block, ops a plan was not profiled with.
    """

    def __init__(self, cost: Callable[[Any, Any, Any, Any], int] = op_cost) -> None:
        super().__init__()
        self.cost = cost
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.total += self.cost(func, args, kwargs, out)
        return out
