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
import contextvars
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import DefaultDeviceType

__all__ = [
    "AutocastState",
    "GeneratorState",
    "RNGState",
    "ReplayState",
    "capture_every_device",
    "device_initialised",
    "fork_rng",
    "forked",
    "is_recomputing",
    "recomputing",
    "seeded_states",
    "tensor_devices",
    "with_initialised_inside",
]


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


# =============================================================== the scope's RNG: per random op, per device
# ``gradient_checkpoint_scope`` (notebook 04 §3.3) replays a recording long after the forward, and code
# in the scope may reseed between two random ops, so a snapshot at entry is not enough: each random op
# records the state of the generator it draws from (``GeneratorState``), and a replay sets it back
# before re-running the op, inside ``forked``. The entry snapshot covers the CPU and every device of an
# initialised accelerator (``capture_every_device``), since which devices the scope will draw from
# can't be known when it opens.
_CPU = torch.device("cpu")


class GeneratorState:
    """A generator (an explicit ``torch.Generator``, or a device's default one) and its state at one
    moment: taken just before a random op draws (``before``), set back before its replay (``restore``).

    Cost: a ``get_state`` per random op recorded (about 1 µs; the CPU's Mersenne Twister state is
    5 KB, a CUDA generator's 16 bytes), a ``set_state`` per random op replayed.
    """

    __slots__ = ("device", "generator", "state")

    def __init__(
        self, generator: torch.Generator | None, device: torch.device | None, state: torch.Tensor
    ) -> None:
        self.generator = generator  # None: the default generator of ``device`` (not the CPU's)
        self.device = device
        self.state = state

    @staticmethod
    def before(args: tuple, kwargs: dict) -> GeneratorState | None:
        """The state of the generator an op called with ``args`` and ``kwargs`` is about to draw from:
        its ``generator`` argument if one is passed, else the default generator of its device (a
        factory's ``device`` argument, else its first tensor's). None for the meta device."""
        generator = kwargs.get("generator")
        device = kwargs.get("device")
        # One pass: the first tensor names the device; a few schemas take the generator positionally
        # (rrelu_with_noise, _fused_dropout).
        for arg in args:
            if isinstance(arg, torch.Tensor):
                if device is None:
                    device = arg.device
            elif isinstance(arg, torch.Generator):
                generator = arg
        if generator is not None:
            return GeneratorState(generator, None, generator.get_state())
        if device is None:
            # out= factories (randn.out): the out tensor's device.
            device = next((v.device for v in kwargs.values() if isinstance(v, torch.Tensor)), _CPU)
        elif type(device) is not torch.device:
            device = torch.device(device)
        if device.type == "cpu":
            return GeneratorState(torch.default_generator, None, torch.default_generator.get_state())
        if device.type == "meta":
            return None  # draws nothing
        module = torch.get_device_module(device.type)
        if device.index is None:
            # The current device now, which backward's may not be.
            device = torch.device(device.type, module.current_device())
        return GeneratorState(None, device, module.get_rng_state(device))

    def key(self) -> Any:
        """Which generator: the same key for two states of one generator."""
        return self.device if self.generator is None else self.generator

    def now(self) -> GeneratorState:
        """The same generator's state now."""
        if self.generator is not None:
            return GeneratorState(self.generator, None, self.generator.get_state())
        module = torch.get_device_module(self.device.type)
        return GeneratorState(None, self.device, module.get_rng_state(self.device))

    def restore(self) -> None:
        if self.generator is not None:
            self.generator.set_state(self.state)
        else:
            torch.get_device_module(self.device.type).set_rng_state(self.state, self.device)


@contextlib.contextmanager
def forked(states: Iterable[GeneratorState]) -> Iterator[None]:
    """Run the body, then put every generator of ``states`` back as it is now."""
    now = [state.now() for state in states]
    try:
        yield
    finally:
        for state in now:
            state.restore()


def capture_every_device(preserve_rng_state: bool) -> tuple[ReplayState, str | None]:
    """What a scope captures when it opens: the RNG of the CPU and of every device of an initialised
    accelerator (None with ``preserve_rng_state=False``), and autocast *off* (the recorded ops are
    already cast: replayed under autocast, they would be cast again).

    Also returns the accelerator's type if it is not initialised yet (see ``with_initialised_inside``).
    Never initialises it: for CUDA that means creating a context, seconds and hundreds of MiB.
    """
    accelerator = torch.accelerator.current_accelerator()
    device_types = [] if accelerator is None else [accelerator.type]
    devices: list[torch.device] = []
    uninitialised = None
    if accelerator is not None:
        if device_initialised(accelerator.type):
            # Every device: which ones the scope will draw from can't be known now.
            devices = [torch.device(accelerator.type, i) for i in range(torch.accelerator.device_count())]
        else:
            uninitialised = accelerator.type
    rng = RNGState.capture(devices) if preserve_rng_state else None
    autocast_off = _AUTOCAST_OFF.get(accelerator)
    if autocast_off is None:
        # Made once per accelerator: which device types have autocast, each turned off (the dtype
        # of an autocast that is off is never used).
        settings = AutocastState.capture(device_types).settings
        autocast_off = AutocastState(
            tuple((t, False, dtype) for t, _, dtype in settings), cache_enabled=False
        )
        _AUTOCAST_OFF[accelerator] = autocast_off
    return ReplayState(rng=rng, autocast=autocast_off, devices=tuple(devices)), uninitialised


_AUTOCAST_OFF: dict[Any, AutocastState] = {}


def with_initialised_inside(state: ReplayState, device_type: str | None) -> ReplayState:
    """``state``, plus the freshly seeded generators of ``device_type`` if it was first initialised
    after ``capture_every_device`` (inside the scope): its generators started from their seeds."""
    if device_type is None or state.rng is None or not device_initialised(device_type):
        return state
    fresh = seeded_states(device_type)
    rng = RNGState(cpu=state.rng.cpu, devices=state.rng.devices + fresh)
    return replace(state, rng=rng, devices=state.devices + tuple(d for d, _ in fresh))


def seeded_states(device_type: str) -> tuple[tuple[torch.device, torch.Tensor], ...]:
    """The state each default generator of ``device_type`` had when it was created: its seed, offset 0.

    Blind spot: a ``set_rng_state`` queued before the device was initialised is not known here.
    """
    module = torch.get_device_module(device_type)
    states = []
    for i, generator in enumerate(getattr(module, "default_generators", ())):
        device = torch.device(device_type, i)
        seeded = torch.Generator(device=device)
        seeded.manual_seed(generator.initial_seed())
        states.append((device, seeded.get_state()))
    return tuple(states)


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


# ================================================================== which run this is
# Code that must not run twice per step (a metric, a counter, a cache write) asks is_recomputing():
# every re-run of this package (reentrant, non-reentrant, selective, sequential, the scope's replay)
# enters recomputing(). A context variable, as torch_remat's is_recomputing() is.
_recomputing = contextvars.ContextVar("ckpt_lab_recomputing", default=False)


def is_recomputing() -> bool:
    """Whether the code calling it runs inside one of our checkpoints' re-runs.

    ``False`` in the forward and outside any checkpoint: ``if not ckpt_lab.is_recomputing():
    self.counts += load`` counts once per step.
    """
    return _recomputing.get()


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Entered by every checkpoint of this package around its re-run: ``is_recomputing()`` is ``True``."""
    token = _recomputing.set(True)
    try:
        yield
    finally:
        _recomputing.reset(token)
