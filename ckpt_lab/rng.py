"""RNG and autocast snapshots: what a checkpoint must restore so that a recomputation replays the forward.

Introduced in notebook 02 (the reentrant checkpoint); shared by every checkpoint in ``ckpt_lab``.

A recomputation runs the same Python code a second time, later. Two pieces of hidden global state
decide what that code computes besides its tensor inputs:

* the random number generators (dropout draws a fresh mask each call), and
* the autocast state (``torch.autocast`` changes which dtype matmuls run in).

``ReplayState.capture`` snapshots both at forward time; ``ReplayState.replay()`` re-installs them
for the recomputation inside a *fork*, so the caller's RNG stream continues as if nothing happened.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import DefaultDeviceType

__all__ = ["AutocastState", "RNGState", "ReplayState", "device_initialised", "fork_rng", "tensor_devices"]


def tensor_devices(*args: Any) -> list[torch.device]:
    """The distinct non-CPU devices of the tensors in ``args`` (nested containers included), in order."""
    devices: list[torch.device] = []
    for leaf in tree_leaves((args,)):
        # CPU state is always captured; "meta" tensors have no RNG at all.
        if isinstance(leaf, torch.Tensor) and leaf.device.type not in ("cpu", "meta"):
            if leaf.device not in devices:
                devices.append(leaf.device)
    return devices


def device_initialised(device_type: str) -> bool:
    """Whether the device module is already initialised (asking for its RNG state would otherwise
    initialise it, which for CUDA means creating a context: seconds and hundreds of MiB)."""
    module = torch.get_device_module(device_type)
    is_initialized = getattr(module, "is_initialized", None)
    return bool(is_initialized()) if callable(is_initialized) else True


@dataclass(frozen=True)
class RNGState:
    """The CPU generator's state and the states of some accelerator devices' default generators.

    Blind spot: only the *default* generators. A ``torch.Generator`` object passed explicitly to an
    op is the caller's to fork.
    """

    cpu: torch.Tensor
    devices: tuple[tuple[torch.device, torch.Tensor], ...] = ()

    @classmethod
    def capture(cls, devices: Iterable[torch.device] = ()) -> RNGState:
        states = []
        for device in devices:
            # Never initialise CUDA by accident: an uninitialised device has drawn no numbers yet,
            # and if the function initialises it, its seed-derived state is what it would get anyway.
            if device_initialised(device.type):
                module = torch.get_device_module(device.type)
                states.append((device, module.get_rng_state(device)))
        return cls(cpu=torch.get_rng_state(), devices=tuple(states))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in self.devices:
            torch.get_device_module(device.type).set_rng_state(state, device)


@contextlib.contextmanager
def fork_rng(devices: Iterable[torch.device] = ()) -> Iterator[None]:
    """Run the body, then put the CPU generator and those of ``devices`` back as they were.

    ``torch.random.fork_rng`` does the same; this one is written out to show there is no magic.
    """
    saved = RNGState.capture(devices)
    try:
        yield
    finally:
        saved.restore()


@dataclass(frozen=True)
class AutocastState:
    """Whether autocast was on, and with which dtype, for the CPU and an accelerator device type."""

    settings: tuple[tuple[str, bool, torch.dtype], ...]
    cache_enabled: bool

    @classmethod
    def capture(cls, device_types: Iterable[str] = ()) -> AutocastState:
        types = ["cpu", *(t for t in dict.fromkeys(device_types) if t != "cpu")]
        settings = tuple(
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
            for t in types
            if torch.amp.is_autocast_available(t)
        )
        return cls(settings=settings, cache_enabled=torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for device_type, enabled, dtype in self.settings:
                autocast = torch.autocast(device_type, dtype, enabled, self.cache_enabled)
                stack.enter_context(autocast)
            yield


@dataclass(frozen=True)
class ReplayState:
    """Everything besides the tensor inputs that a recomputation needs to equal the forward."""

    rng: RNGState | None
    autocast: AutocastState
    devices: tuple[torch.device, ...]

    @classmethod
    def capture(cls, *args: Any, preserve_rng_state: bool = True) -> ReplayState:
        """Snapshot at forward time; ``args`` name the accelerator devices whose RNG matters."""
        devices = tuple(tensor_devices(*args))
        rng = RNGState.capture(devices) if preserve_rng_state else None
        autocast = AutocastState.capture(autocast_device_types(devices))
        return cls(rng=rng, autocast=autocast, devices=devices)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Re-install the forward's RNG and autocast state; the caller's RNG is restored afterwards."""
        if self.rng is None:
            # preserve_rng_state=False: the caller promised the function draws no random numbers
            # (or accepts different ones); skip the snapshot and the fork entirely.
            with self.autocast.restored():
                yield
            return
        with fork_rng(d for d, _ in self.rng.devices):
            self.rng.restore()
            with self.autocast.restored():
                yield


# ------------------------------------------------------------- whose autocast state a checkpoint records
def autocast_device_types(devices: Iterable[torch.device]) -> list[str]:
    """The device types whose autocast state ``ReplayState`` records (the CPU's always, besides).

    torch's rule (``_infer_device_type`` in torch/utils/checkpoint.py): the types of the tensor
    arguments' devices; when every tensor argument is on the CPU, the *default* device type,
    ``torch.utils.checkpoint.DefaultDeviceType.get_device_type()`` -- the current accelerator's type
    ("cuda" on a CUDA machine, "cpu" on a machine without one), or what
    ``DefaultDeviceType.set_device_type`` set. So a GPU block called with CPU tensors inside
    ``torch.autocast("cuda")`` recomputes under it too. Where ours differs: with arguments on several
    device types torch records one (cuda first, else the first it meets, with a warning), ours
    records all. As in torch, the default device's *RNG* state is not recorded for CPU arguments.
    """
    types = [device.type for device in devices]
    return types or [DefaultDeviceType.get_device_type()]
