"""The harness: workloads, the benchmark and the Pareto sweep.

    python -m ckpt_lab.bench [--quick]       # every strategy side by side (__main__.py)
    python -m ckpt_lab.bench.pareto          # the memory/recompute frontier of notebook 05
    python -m ckpt_lab.bench.peak            # the peak sweep (notebook 07b)
    python -m ckpt_lab.bench.floor           # the floor under the scope's time on the dropout chain

* ``workloads``: the MLP, transformer and pointwise stacks everything is measured on;
* ``measure``: every strategy on a workload, side by side (memory, FLOPs, gradients, state, time),
  and the benchmark page's targets (docs/results/benchmark.md) as PASS/MISS;
* ``report``: the table and plots; ``pareto``: retained memory against recomputation.

The strategies themselves are the project's registry, ``ckpt_lab.strategies``. The names most used
are importable from here (``from ckpt_lab import bench; bench.mlp(8)``).
"""

from ckpt_lab.bench.measure import Result
from ckpt_lab.bench.workloads import PointwiseBlock, Workload, mlp, pointwise, suite, transformer
from ckpt_lab.strategies import REGISTRY, PlannerRange, Strategy, planner_range, strategies

__all__ = [
    "REGISTRY",
    "PlannerRange",
    "PointwiseBlock",
    "Result",
    "Strategy",
    "Workload",
    "mlp",
    "planner_range",
    "pointwise",
    "strategies",
    "suite",
    "transformer",
]
