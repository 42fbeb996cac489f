"""Live-memory tracking: bytes of tensors created in a region, as they are born and as they die.

Introduced in notebook 01; used by every later notebook, test and benchmark.

Why not count saved tensors with a ``saved_tensors_hooks``? Only the *innermost* hooks run, so an
outer logging hook is blind to everything a checkpoint keeps inside its own hooks. And why not
``torch.cuda.memory_allocated``? It exists only on a GPU, and its numbers include the caching
allocator's rounding. Instead we watch *storages*:

* a ``TorchDispatchMode`` sees every aten op run below autograd, in forward, in backward and in any
  recomputation, and with it every tensor those ops return;
* a tensor whose storage is not the storage of one of the op's inputs is new memory: we record its
  ``nbytes`` and attach a ``weakref.finalize`` to the storage object, which fires exactly when the
  storage is freed (PyTorch keeps a storage's Python object alive as long as the storage itself).

The numbers are exact byte counts of storages, so they are identical on every run and every device.

Blind spots (say so wherever a number could mislead):

* memory not produced by an aten op: ``torch.get_rng_state()`` snapshots, tensors made in C++
  kernels' scratch space, the caching allocator's slack, and tensors created before the region;
* storages of tensor subclasses without real storage (e.g. wrapper subclasses) are skipped;
* a storage kept alive only by a reference cycle is freed at the next ``gc.collect()``, which
  ``snapshot`` and ``measure_memory`` run, but not mid-backward.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ckpt_lab._aten import new_storages

__all__ = ["LiveMemory", "MemoryReport", "measure_memory"]


class LiveMemory(TorchDispatchMode):
    """Track every storage created by an aten op while the mode is active, and when it is freed.

    >>> x = torch.randn(1000)          # created outside: not counted
    >>> with LiveMemory() as mem:
    ...     y = x.sin()                # 4000 bytes born
    ...     del y                      # ... and freed
    >>> mem.peak_bytes, mem.live_bytes
    (4000, 0)
    """

    def __init__(self) -> None:
        super().__init__()
        self._serials = itertools.count()
        # id(storage object) -> serial, for storages alive now (ids are unique among live objects).
        self._live: dict[int, int] = {}
        # serial -> bytes, for every storage ever seen.
        self._nbytes: dict[int, int] = {}
        # The timeline: (serial, +1 born / -1 freed, phase label).
        self.events: list[tuple[int, int, str]] = []
        self.phase = "forward"
        self.marks: dict[str, int] = {}
        self.closed = False

    # ---------------------------------------------------------------- recording
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # An output sharing a storage the op received is a view or an in-place result, not new memory.
        # (Tensors without a real storage, such as wrapper subclasses, are a blind spot.)
        for key, storage in new_storages(args, kwargs, out).items():
            if key not in self._live:
                self._born(storage)
        return out

    def _born(self, storage: torch.UntypedStorage) -> None:
        serial = next(self._serials)
        key = id(storage)
        self._live[key] = serial
        self._nbytes[serial] = storage.nbytes()
        self.events.append((serial, +1, self.phase))
        # The finalizer holds no reference to the storage; it fires when the storage is freed.
        weakref.finalize(storage, self._freed, key, serial)

    def __exit__(self, *args: Any) -> Any:
        # Frees after the region still update ``live_bytes`` but no longer extend the timeline.
        self.closed = True
        return super().__exit__(*args)

    def _freed(self, key: int, serial: int) -> None:
        if self._live.get(key) == serial:
            del self._live[key]
        if not self.closed:
            self.events.append((serial, -1, self.phase))

    # ---------------------------------------------------------------- reading
    @property
    def live_bytes(self) -> int:
        """Bytes of storages created while tracking that are alive now."""
        return sum(self._nbytes[s] for s in self._live.values())

    @property
    def peak_bytes(self) -> int:
        """The highest ``live_bytes`` reached so far."""
        return self.peak()

    def peak(self, exclude: set[int] | None = None) -> int:
        """Peak live bytes over the timeline, ignoring the storages whose serials are in ``exclude``."""
        return max(self.curve(exclude), default=0)

    def curve(self, exclude: set[int] | None = None) -> list[int]:
        """Live bytes after each event of the timeline, ignoring the serials in ``exclude``."""
        live, out = 0, []
        for serial, sign, _ in self.events:
            if not (exclude and serial in exclude):
                live += sign * self._nbytes[serial]
            out.append(live)
        return out

    def serial_of(self, tensor: torch.Tensor) -> int:
        """The serial of ``tensor``'s storage, which must have been born while tracking and be alive."""
        try:
            return self._live[id(tensor.untyped_storage())]
        except KeyError:
            raise KeyError(
                "LiveMemory.serial_of: this tensor's storage was not created while tracking (or is already "
                "freed); only storages born inside the `with` block have serials."
            ) from None

    def nbytes(self, serial: int) -> int:
        """Bytes of the storage with this serial (alive or freed)."""
        return self._nbytes[serial]

    def snapshot(self, label: str) -> int:
        """Collect garbage, then record and return ``live_bytes`` under ``label``."""
        gc.collect()
        self.marks[label] = self.live_bytes
        return self.marks[label]

    def born_in(self, phase: str, alive: bool = True) -> set[int]:
        """Serials of storages created during ``phase`` (and, if ``alive``, still alive)."""
        live = set(self._live.values())
        return {s for s, sign, p in self.events if sign > 0 and p == phase and (not alive or s in live)}


@dataclass(frozen=True)
class MemoryReport:
    """What ``measure_memory`` measured; all numbers are bytes of storages created in the run.

    * ``retained_bytes``: created in the forward and still alive when it ends (the activations the
      graph keeps for backward, plus the output itself);
    * ``peak_bytes``: the most alive at once over forward and backward, not counting gradients
      (storages created in backward that outlive it, i.e. the ``.grad`` of leaves);
    * ``peak_bytes_with_grads``: the same, counting them;
    * ``grad_bytes``: bytes of those gradients;
    * ``cuda_peak_bytes``: ``torch.cuda.max_memory_allocated`` above the starting point, on CUDA only.
    """

    retained_bytes: int
    peak_bytes: int
    peak_bytes_with_grads: int
    grad_bytes: int
    cuda_peak_bytes: int | None = None
    extra: dict[str, int] = field(default_factory=dict)


def measure_memory(forward: Callable[[], torch.Tensor], backward: bool = True) -> MemoryReport:
    """Run ``forward()`` (which must return a scalar loss) and then its backward, tracking memory.

    Tensors created before the call (inputs, parameters, existing ``.grad``) are not counted.
    """
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_start = torch.cuda.memory_allocated()
    with LiveMemory() as mem:
        loss = forward()
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise ValueError("measure_memory: forward() must return a scalar tensor (e.g. out.sum()).")
        retained = mem.snapshot("after forward")
        if backward:
            mem.phase = "backward"
            loss.backward()
            del loss
            mem.snapshot("after backward")
    grads = mem.born_in("backward") if backward else set()
    return MemoryReport(
        retained_bytes=retained,
        peak_bytes=mem.peak(exclude=grads),
        peak_bytes_with_grads=mem.peak(),
        grad_bytes=sum(mem.nbytes(s) for s in grads),
        cuda_peak_bytes=(torch.cuda.max_memory_allocated() - cuda_start) if cuda else None,
    )
