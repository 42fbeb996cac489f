"""The harness: workloads, the registry of strategies, the benchmark and the Pareto sweep.

    python -m ckpt_lab.bench [--quick]       # every strategy side by side (__main__.py)
    python -m ckpt_lab.bench.pareto          # the memory/recompute frontier of notebook 05

* ``workloads``: the MLP, transformer and pointwise stacks everything is measured on;
* ``strategies``: the registry, one entry per way of running a stack (``none``, torch's, ours);
* ``measure``: every strategy on a workload, side by side (memory, FLOPs, gradients, state, time);
* ``report``: the table and plots; ``pareto``: retained memory against recomputation.

The names most used are importable from here (``from ckpt_lab import bench; bench.mlp(8)``).
"""

from ckpt_lab.bench.measure import Result, check_targets, measure, run
from ckpt_lab.bench.strategies import REGISTRY, PlannerRange, Strategy, planner_range, strategies
from ckpt_lab.bench.workloads import PointwiseBlock, Workload, mlp, pointwise, suite, transformer
from ckpt_lab.instruments.state import global_state

__all__ = [
    "REGISTRY",
    "PlannerRange",
    "PointwiseBlock",
    "Result",
    "Strategy",
    "Workload",
    "check_targets",
    "global_state",
    "measure",
    "mlp",
    "planner_range",
    "pointwise",
    "run",
    "strategies",
    "suite",
    "transformer",
]
