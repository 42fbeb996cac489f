"""The instruments every notebook measures with: exact, deterministic, the same on every device.

* ``memory``: ``LiveMemory`` and ``measure_memory``, bytes of storages born and freed in a region;
* ``saved``: ``SavedTensorLog``, what autograd saves for backward;
* ``counting``: ``CallCounter`` (the recompute counter), ``OpCounter`` (aten ops), ``count_flops``;
* ``flops``: ``op_cost``, ``matmul_flops`` and ``CostCounter``: the planner's cost model, summed
  over a run;
* ``state``: ``global_state`` and ``assert_no_global_state``, what a checkpoint must leave behind.

Each is tested to the byte on toys whose answer is computed by hand (``tests/test_instruments.py``,
``tests/test_state_and_aten.py``).
"""

from ckpt_lab.instruments.counting import CallCounter, OpCounter, count_flops
from ckpt_lab.instruments.flops import CostCounter, matmul_flops, op_cost
from ckpt_lab.instruments.memory import LiveMemory, MemoryReport, measure_memory
from ckpt_lab.instruments.saved import SavedEntry, SavedTensorLog
from ckpt_lab.instruments.state import assert_no_global_state, global_state

__all__ = [
    "CallCounter",
    "CostCounter",
    "LiveMemory",
    "MemoryReport",
    "OpCounter",
    "SavedEntry",
    "SavedTensorLog",
    "assert_no_global_state",
    "count_flops",
    "global_state",
    "matmul_flops",
    "measure_memory",
    "op_cost",
]
