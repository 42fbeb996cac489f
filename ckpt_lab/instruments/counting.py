"""Counting instruments: how often a function ran, which aten ops ran, and how many FLOPs they cost.

Introduced in notebook 01; used by every later notebook, test and benchmark. All counts are exact
and device-independent, so notebooks can print them and nbval can re-check them.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["CallCounter", "OpCounter", "count_flops"]


class CallCounter:
    """Count calls of a function, or forward calls of an ``nn.Module`` (a recompute counter).

    >>> block = CallCounter(torch.sin)
    >>> _ = block(torch.zeros(2)); _ = block(torch.zeros(2))
    >>> block.count
    2

    For a module, a forward pre-hook counts every call of the module (``counter(x)`` calls it too);
    ``remove()`` takes the hook off again.
    """

    def __init__(self, target: Callable[..., Any] | torch.nn.Module) -> None:
        self.target = target
        self.count = 0
        self._handle = None
        if isinstance(target, torch.nn.Module):
            # A hook also sees calls that don't go through this wrapper (e.g. from a parent module).
            self._handle = target.register_forward_pre_hook(self._count_module)
        else:
            functools.update_wrapper(self, target)

    def _count_module(self, module: torch.nn.Module, args: Any) -> None:
        self.count += 1

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._handle is None:
            self.count += 1
        return self.target(*args, **kwargs)

    def reset(self) -> None:
        self.count = 0

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class OpCounter(TorchDispatchMode):
    """Count the aten ops run while active, by name (``aten.mm.default`` is counted as ``mm``).

    Sees forward, backward and recomputation ops alike (it runs below autograd). Blind spot: ops
    that never reach the dispatcher (Python-side bookkeeping, RNG state reads).
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Total FLOPs of ``fn(*args, **kwargs)`` as counted by ``torch.utils.flop_counter``.

    Only matmul-like ops (mm, bmm, convolution, attention) are counted; pointwise ops count 0.
    Run it in its own pass, never while measuring memory: its module hooks keep tensors alive.
    Blind spot: torch's counter fails under ``torch.autograd.grad`` with respect to leaves
    ("A leaf node was passed to _will_engine_execute_node"); count ``.backward()`` there, or use
    ``OpCounter``.
    """
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()
