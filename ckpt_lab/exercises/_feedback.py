"""Feedback in the learner's terms, read off the package's instruments.

* ``Tracker``: ``LiveMemory`` (bytes of every storage an aten op makes, until it is freed) with a
  dispatch mode above it that writes down, at each storage's birth, the op that made it, its shape
  and dtype, the module of the grader's model that was running, and the line of the learner's file
  on the stack. So "your checkpoint keeps 2,048 bytes" becomes "it keeps f32[16, 32], the output of
  addmm in block.0 (Linear), made at exercises/02_checkpoint_function.py:23".
* ``gradient_difference``: which gradient differs from the reference run, where, and by how much.
* ``state_left_behind`` / ``restore_state``: what ``ckpt_lab.instruments.global_state()`` says a
  check left behind (a hook on the stack, a dispatch mode, grad mode off), said plainly, and undone.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch._C._autograd import _top_saved_tensors_default_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ckpt_lab.errors import optional
from ckpt_lab.instruments import LiveMemory, global_state
from ckpt_lab.instruments.state import UNKNOWN, changes

if TYPE_CHECKING:
    from ckpt_lab.exercises._grading import Submission

__all__ = [
    "Birth",
    "Tracker",
    "gradient_difference",
    "restore_state",
    "size",
    "state_left_behind",
]


def size(nbytes: int) -> str:
    return f"{nbytes:,} B"


def tensor_text(shape: Sequence[int], dtype: torch.dtype) -> str:
    """``f32[16, 32]``, as ``SavedTensorLog`` writes tensors."""
    short = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
             torch.int64: "i64", torch.uint8: "u8", torch.bool: "bool"}  # fmt: skip
    return f"{short.get(dtype, str(dtype).removeprefix('torch.'))}[{', '.join(map(str, shape))}]"


# ------------------------------------------------------------------------------------- who made what
@dataclass(frozen=True)
class Birth:
    """A storage born while tracking: what made it, and where."""

    serial: int  # LiveMemory's: the order storages were made in
    op: str  # the aten op ("addmm")
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    phase: str  # LiveMemory's phase when it was made ("forward", "backward", ...)
    module: str  # the grader's module that was running ("block.0 (Linear)"), or ""
    line: str | None  # the learner's line on the stack, or None

    def describe(self) -> str:
        """``f32[16, 32] (2,048 B), the output of addmm in block.0 (Linear), made at FILE:LINE``."""
        where = f" in {self.module}" if self.module else ""
        made = f", made at {self.line}" if self.line else ""
        tensor = f"{tensor_text(self.shape, self.dtype)} ({size(self.nbytes)})"
        return f"{tensor}, the output of {self.op}{where}{made}"


class _Births(TorchDispatchMode):
    """Above a ``LiveMemory``: each op runs through it (which numbers the new storages), then the
    storages it has not seen yet are written down (the way ``ckpt_lab.explain`` does it)."""

    def __init__(self, tracker: Tracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        t, memory = self.tracker, self.tracker.memory
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            try:
                serial = memory.serial_of(tensor)
            except (KeyError, RuntimeError):  # not new memory (a view, an input), or no storage
                continue
            if serial not in t.births:
                t.births[serial] = Birth(
                    serial, func.overloadpacket.__name__, tuple(tensor.shape), tensor.dtype,
                    memory.nbytes(serial), memory.phase, t.modules[-1] if t.modules else "",
                    t.submission.line() if t.submission is not None else None,
                )  # fmt: skip
        return out


class Tracker:
    """``with Tracker(submission) as t:`` tracks memory like ``LiveMemory`` and remembers who made
    each storage. ``t.kept(...)``: the storages made in a phase that are still alive, oldest first."""

    def __init__(self, submission: Submission | None = None) -> None:
        self.submission = submission
        self.memory = LiveMemory()
        self.births: dict[int, Birth] = {}
        self.modules: list[str] = []
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Tracker:
        # LiveMemory first, so that it sits below and numbers each storage before we read it.
        self._stack.enter_context(self.memory)
        self._stack.enter_context(_Births(self))
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._stack.__exit__(*exc)

    @property
    def phase(self) -> str:
        return self.memory.phase

    @phase.setter
    def phase(self, value: str) -> None:
        self.memory.phase = value

    def watch(self, module: torch.nn.Module, name: str) -> None:
        """Name the storages made while ``module`` or one of its children runs (hooks removed on exit)."""

        def enter(label: str) -> None:
            self.modules.append(label)

        def leave(*_: Any) -> None:  # returns None: a forward hook's result would replace the output
            self.modules.pop()

        for path, child in module.named_modules(prefix=name):
            label = f"{path} ({type(child).__name__})"
            pre = child.register_forward_pre_hook(lambda m, a, label=label: enter(label))
            post = child.register_forward_hook(leave, always_call=True)
            self._stack.callback(pre.remove)
            self._stack.callback(post.remove)

    def snapshot(self) -> int:
        """Collect garbage, then the live bytes (``LiveMemory.snapshot``)."""
        return self.memory.snapshot(f"snapshot {len(self.memory.marks)}")

    def alive(self, phase: str | None = None, exclude: Sequence[torch.Tensor] = ()) -> list[Birth]:
        """Storages made (in ``phase``, if given) and alive now, oldest first; not those of ``exclude``,
        nor empty ones (a checkpoint's zero-size placeholders hold no memory)."""
        self.snapshot()
        skip = set()
        for tensor in exclude:
            with contextlib.suppress(KeyError, RuntimeError):
                skip.add(self.memory.serial_of(tensor))
        live: set[int] = set()
        for made_in in {b.phase for b in self.births.values()}:
            live |= self.memory.born_in(made_in)
        return [
            b for serial, b in sorted(self.births.items())
            if serial in live and serial not in skip and b.nbytes and (phase is None or b.phase == phase)
        ]  # fmt: skip


def listing(births: Sequence[Birth], limit: int = 3) -> str:
    """The first few, one a line, and how many more."""
    if not births:
        return "  (nothing)"
    lines = [f"  {b.describe()}" for b in births[:limit]]
    if len(births) > limit:
        lines.append(f"  ... and {len(births) - limit} more ({size(sum(b.nbytes for b in births[limit:]))})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- gradients
def _index(flat: int, shape: Sequence[int]) -> str:
    index = []
    for dim in reversed(shape):
        index.append(flat % dim)
        flat //= dim
    return "[" + ", ".join(map(str, reversed(index))) + "]"


def gradient_difference(
    name: str, got: torch.Tensor | None, expected: torch.Tensor | None, rtol: float = 0.0
) -> str | None:
    """None if ``got`` equals ``expected`` (bitwise, or within ``rtol`` of its norm); else one
    sentence: which entries differ, the first one, and the largest difference."""
    if expected is None:
        return None if got is None else f"{name} got a gradient, but the reference run gives it none."
    if got is None:
        return f"{name} got no gradient (its .grad is None); the reference run gives it one."
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return (
            f"{name}'s gradient is {tensor_text(got.shape, got.dtype)}, the reference run's "
            f"{tensor_text(expected.shape, expected.dtype)}."
        )
    g, e = got.detach().double().flatten(), expected.detach().double().flatten()
    if rtol:
        error = ((g - e).norm() / e.norm().clamp_min(1e-30)).item()
        if error <= rtol:
            return None
    elif torch.equal(got, expected):
        return None
    differ = (g != e).nonzero().flatten()
    first = int(differ[0])
    worst = int((g - e).abs().argmax())
    said = (
        f"{name}: {len(differ):,} of {e.numel():,} gradient entries differ from the reference run's; "
        f"the first at {name}{_index(first, got.shape)}: {g[first]:.6g} instead of {e[first]:.6g}; "
        f"the largest difference {abs(g[worst] - e[worst]):.3g} at {name}{_index(worst, got.shape)}"
    )
    if rtol:
        said += f"; relative error {error:.3g} (norm of the difference / the reference's), tolerance {rtol:g}"
    ratio = g[e != 0] / e[e != 0]
    if len(ratio) and torch.allclose(ratio, torch.full_like(ratio, 2.0)):
        said += "; every entry is exactly twice the reference: it was accumulated twice"
    return said + "."


def compare_gradients(
    named: Sequence[tuple[str, torch.Tensor | None, torch.Tensor | None]], rtol: float = 0.0
) -> list[str]:
    """``gradient_difference`` for each (name, got, expected); the sentences of those that differ."""
    return [d for d in (gradient_difference(n, g, e, rtol) for n, g, e in named) if d]


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    e = expected.double()
    return ((got.double() - e).norm() / e.norm().clamp_min(1e-30)).item() if e.numel() else math.nan


# ---------------------------------------------------------------------------------- state left behind
_PLAIN = {
    "saved_tensors_hooks_on_stack": "a saved-tensor hook is still on the stack (pushed, never popped): every "
    "later op's saved tensors go through it",
    "dispatch_modes": "a TorchDispatchMode is still active (entered, never exited): it sees every later op",
    "grad_enabled": "grad mode was left switched",
    "saved_tensors_hooks_methods": "torch.autograd.graph.saved_tensors_hooks' methods were replaced",
}


def state_left_behind(before: dict[str, Any]) -> str | None:
    """What differs from ``before`` (a ``global_state()`` reading), in plain words, or None."""
    left = changes(before, global_state())
    if not left:
        return None
    after = global_state()
    said = []
    for key in (k for k in before if before[k] != after[k]):
        plain = _PLAIN.get(key, key)
        if key == "grad_enabled":
            plain += " off" if not after[key] else " on"
        said.append(f"{plain} ({key}: {before[key]} -> {after[key]})")
    return "Left behind: " + "; ".join(said) + ". (The grader put it back before the next check.)"


def restore_state(before: dict[str, Any]) -> str | None:
    """Undo what a check left behind: pop hooks and dispatch modes it pushed, set grad mode back.
    Returns what it could not undo, in plain words (None when everything was put back): it pops with
    torch's private API (ckpt_lab/torch_private.py), and on a torch without a name it needs, what is
    left is said, not popped."""
    torch.set_grad_enabled(before["grad_enabled"])
    now, not_undone = global_state(), []
    if before["saved_tensors_hooks_on_stack"] is False and now["saved_tensors_hooks_on_stack"] is True:
        pop = optional("torch._C._autograd._pop_saved_tensors_default_hooks")
        if pop is None:
            not_undone.append("saved-tensor hooks")
        while pop is not None and _top_saved_tensors_default_hooks(False) is not None:
            pop()
    modes, left = before["dispatch_modes"], now["dispatch_modes"]
    if UNKNOWN not in (modes, left) and left > modes:
        _pop_mode = optional("torch.utils._python_dispatch._pop_mode")
        if _pop_mode is None:
            not_undone.append(f"{left - modes} dispatch mode(s)")
        for _ in range(left - modes if _pop_mode is not None else 0):
            _pop_mode()
    if not not_undone:
        return None
    return (
        f"Except {' and '.join(not_undone)}, still active: the grader can't take them off on torch "
        f"{torch.__version__} (it lacks the private name that would, see ckpt_lab/torch_private.py), "
        "and every later check runs under them. Restart the kernel before checking again."
    )


@contextlib.contextmanager
def logged_runs(module: torch.nn.Module) -> Iterator[list[bool]]:
    """The grad mode of each call of ``module``, in order (a recomputation shows as ``True`` in backward)."""
    modes: list[bool] = []
    handle = module.register_forward_pre_hook(lambda m, a: modes.append(torch.is_grad_enabled()))
    try:
        yield modes
    finally:
        handle.remove()


@contextlib.contextmanager
def logged_rng(module: torch.nn.Module) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The CPU generator's state when each call of ``module`` starts and when it returns, in order."""
    calls: list[list[torch.Tensor]] = []
    starts = module.register_forward_pre_hook(lambda m, a: calls.append([torch.get_rng_state()]))
    ends = module.register_forward_hook(lambda m, a, o: calls[-1].append(torch.get_rng_state()))
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        yield pairs
    finally:
        starts.remove()
        ends.remove()
        pairs += [(c[0], c[-1]) for c in calls]


def rng_hint(calls: list[tuple[torch.Tensor, torch.Tensor]], taught: str) -> str:
    """Why a re-run drew other dropout masks, from the generator's state at the forward's and the
    re-run's start (``logged_rng``): no snapshot restored, or one taken after the block ran."""
    if len(calls) >= 2 and torch.equal(calls[1][0], calls[0][1]):
        return (
            "The re-run started from the generator's state at the *end* of the forward: your snapshot "
            "(torch.get_rng_state()) was taken after the block ran, so the re-run drew the numbers that come "
            f"after the forward's masks. Take it before running the block ({taught})."
        )
    return (
        "The re-run drew new dropout masks: take a snapshot of the random generator before the block "
        "runs in forward (torch.get_rng_state()) and restore it, inside torch.random.fork_rng(devices=[]), "
        f"for the re-run ({taught})."
    )
