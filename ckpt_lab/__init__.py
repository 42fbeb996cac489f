"""ckpt_lab: activation checkpointing in PyTorch, built from first principles.

The public API (names and signatures are stable):

* ``reentrant_checkpoint(function, *args, preserve_rng_state=True)`` -- notebook 02
* ``checkpoint(function, *args, preserve_rng_state=True, **kwargs)`` -- notebook 03
* ``checkpoint_sequential(functions, segments, input, use_reentrant=False, preserve_rng_state=True)``
* ``gradient_checkpoint_scope()`` -- notebook 04

Stage 5 (notebook 05): ``selective_checkpoint(function, *args, policy, ...)`` (exported here), and
the modules ``ckpt_lab.planner`` (an eager memory-budget planner), ``ckpt_lab.offload`` (saved tensors
to CPU) and ``ckpt_lab.batchnorm`` (running statistics updated once under checkpointing).

Beside them: ``ckpt_lab.distributed`` (DDP and FSDP on CPU, notebook 06; not imported here because
it pulls in ``torch.distributed.fsdp``) and ``python -m ckpt_lab.bench`` (the benchmark).

and the instruments every notebook measures with (notebook 01): ``LiveMemory``, ``measure_memory``,
``SavedTensorLog``, ``CallCounter``, ``OpCounter``, ``count_flops``.
"""

from ckpt_lab.counting import CallCounter, OpCounter, count_flops
from ckpt_lab.memory import LiveMemory, MemoryReport, measure_memory
from ckpt_lab.nonreentrant import CheckpointError, checkpoint
from ckpt_lab.reentrant import reentrant_checkpoint
from ckpt_lab.saved import SavedTensorLog
from ckpt_lab.scope import gradient_checkpoint_scope
from ckpt_lab.selective import selective_checkpoint
from ckpt_lab.sequential import checkpoint_sequential

__all__ = [
    "CallCounter",
    "CheckpointError",
    "LiveMemory",
    "MemoryReport",
    "OpCounter",
    "SavedTensorLog",
    "checkpoint",
    "checkpoint_sequential",
    "count_flops",
    "gradient_checkpoint_scope",
    "measure_memory",
    "reentrant_checkpoint",
    "selective_checkpoint",
]
