"""ckpt_lab: activation checkpointing in PyTorch, built from first principles.

The public API (names and signatures are stable), in the order the notebooks build it:

* ``reentrant_checkpoint(function, *args, preserve_rng_state=True)`` -- notebook 02 (``reentrant``)
* ``checkpoint_sequential(functions, segments, input, use_reentrant=False, preserve_rng_state=True)``
  -- notebook 02b (``sequential``)
* ``checkpoint(function, *args, preserve_rng_state=True, context_fn=noop_context_fn,
  determinism_check="default", debug=False, early_stop=True, use_reentrant=False, **kwargs)``
  -- notebook 03b (``nonreentrant``), with torch's ``set_checkpoint_early_stop`` and
  ``set_checkpoint_debug_enabled``
* ``gradient_checkpoint_scope()`` -- notebook 04 (``scope``)
* ``is_recomputing()``: ``True`` inside our checkpoints' re-runs, for code that must run once per step
  (``state_guard``, notebook 07c, with ``checkpoint``'s ``state_check``)
* ``selective_checkpoint(function, *args, policy, ...)`` -- notebook 05 (``selective``), with the
  modules ``planner`` (an eager memory-budget planner), ``offload`` (saved tensors to CPU) and
  ``batchnorm`` (running statistics updated once under checkpointing)
* ``ckpt_lab.distributed`` -- notebook 06 (DDP and FSDP on CPU; not imported here because it pulls
  in ``torch.distributed.fsdp``)

The instruments every notebook measures with (``ckpt_lab.instruments``, notebook 01):
``LiveMemory``, ``measure_memory``, ``SavedTensorLog``, ``CallCounter``, ``OpCounter``,
``count_flops``; and ``explain(function, *args)``, which lists what one training step keeps between
forward and backward, storage by storage, and why (``ckpt_lab.explain``). The harness lives apart:
``ckpt_lab.helpers`` (notebook helpers) and ``ckpt_lab.bench`` (workloads, the registry of
strategies, ``python -m ckpt_lab.bench``).
"""

import sys
import types
from typing import Any

# First: on a torch without a private name the package can't be imported without, a clear error
# naming it and torch's version (ckpt_lab/_torch_needed.py), not an ImportError from inside.
from ckpt_lab import _torch_needed  # noqa: F401
from ckpt_lab.errors import CheckpointError
from ckpt_lab.instruments.counting import CallCounter, OpCounter, count_flops
from ckpt_lab.instruments.memory import LiveMemory, MemoryReport, measure_memory
from ckpt_lab.instruments.saved import SavedTensorLog
from ckpt_lab.nonreentrant import (
    checkpoint,
    set_checkpoint_debug_enabled,
    set_checkpoint_early_stop,
)
from ckpt_lab.reentrant import reentrant_checkpoint
from ckpt_lab.scope import gradient_checkpoint_scope
from ckpt_lab.selective import selective_checkpoint
from ckpt_lab.sequential import checkpoint_sequential
from ckpt_lab.state_guard import is_recomputing

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
    "explain",
    "gradient_checkpoint_scope",
    "is_recomputing",
    "measure_memory",
    "reentrant_checkpoint",
    "selective_checkpoint",
    "set_checkpoint_debug_enabled",
    "set_checkpoint_early_stop",
]


# NOTE [ explain on first use ]
# ``ckpt_lab.explain`` is the function ``explain`` (``ckpt_lab.explain(model, x)``, ``from ckpt_lab
# import explain``), imported when first used, so that ``import ckpt_lab`` does not pay for it. Not a
# module ``__getattr__``: importing the subpackage of the same name (``from ckpt_lab.explain import
# zoo``) makes importlib set this module's attribute ``explain`` to the subpackage, which would hide
# the function from then on. A property of this module's class keeps the function there.
class _Package(types.ModuleType):
    @property
    def explain(self) -> Any:
        if "_explain" not in self.__dict__:
            from ckpt_lab.explain import explain

            self.__dict__["_explain"] = explain
        return self.__dict__["_explain"]

    @explain.setter
    def explain(self, value: Any) -> None:
        # importlib binding the subpackage: ignored. Anything else (a test's monkeypatch) is kept.
        if value is not sys.modules.get(f"{__name__}.explain"):
            self.__dict__["_explain"] = value

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), "explain"} - {"_explain"})


sys.modules[__name__].__class__ = _Package
