"""Every way this project runs a stack of blocks, in one registry.

The benchmark measures them side by side, the Pareto sweep places some of them on its picture, and
notebook 06's model (``ckpt_lab.distributed.TinyNet``) runs its blocks through the per-block ones
by name, so a strategy is written once. Each ``Strategy`` has:

* ``name``, the benchmark's identifier (``ckpt-nonreentrant``), and ``label``, what a reader calls it
  (``ckpt_lab.checkpoint``);
* ``run(blocks, x)``, the whole stack; and ``block(block, x)``, one block, for strategies that work
  block by block (``None`` for those that see the whole stack, like ``checkpoint_sequential``);
* ``reference``: the torch strategy it reimplements, whose bytes it must match.

The planner strategies (``ckpt-plan-25``, ``ckpt-plan-50``, notebook 05) plan once per stack and
input shape (``planner_range``), at a quarter and half of the way from the smallest useful budget to
the largest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as torch_ckpt

from ckpt_lab.nonreentrant import checkpoint
from ckpt_lab.planner import Plan, Profile, budget_range, profile_sequential, solve
from ckpt_lab.reentrant import reentrant_checkpoint
from ckpt_lab.scope import gradient_checkpoint_scope
from ckpt_lab.selective import selective_checkpoint
from ckpt_lab.sequential import checkpoint_sequential

__all__ = [
    "FLOOR",
    "REGISTRY",
    "PlannerRange",
    "Strategy",
    "by_label",
    "planner_range",
    "sqrt_segments",
    "strategies",
]

BlockRun = Callable[[nn.Module, torch.Tensor], torch.Tensor]
StackRun = Callable[[Sequence[nn.Module], torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Strategy:
    """How to run a stack of blocks (see the module docstring)."""

    name: str
    label: str
    run: StackRun
    block: BlockRun | None = None
    reference: str | None = None
    # Measured in a process of its own (with "none" beside it), because it leaves global state behind
    # that would break the strategies measured after it.
    isolated: bool = False
    # Planner strategies: where their budget lies between the stack's smallest and largest
    # (``PlannerRange.budget``); the benchmark makes the plan before anything is measured or timed.
    budget_fraction: float | None = None


def _per_block(name: str, label: str, block: BlockRun, **fields: Any) -> Strategy:
    def run(blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            x = block(b, x)
        return x

    return Strategy(name, label, run, block, **fields)


# ------------------------------------------------------------------------------------- one block each
def _plain(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x)


def _torch_reentrant(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch_ckpt.checkpoint(block, x, use_reentrant=True)


def _torch_nonreentrant(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch_ckpt.checkpoint(block, x, use_reentrant=False)


# Save the outputs of matmuls (expensive to recompute), recompute everything else.
_MATMULS = [
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
]


# A function of the module, not a lambda made per call: under torch.compile, Dynamo accepts only a
# context_fn it did not see being made (notebook 08 compiles these block runs).
def _torch_sac_context() -> tuple[Any, Any]:
    return torch_ckpt.create_selective_checkpoint_contexts(_MATMULS)


def _torch_sac(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch_ckpt.checkpoint(block, x, use_reentrant=False, context_fn=_torch_sac_context)


def _ckpt_sac(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return selective_checkpoint(block, x, policy=_MATMULS)


def _scoped(scope: Callable[[], Any]) -> BlockRun:
    def block_in_scope(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with scope():
            return block(x)

    return block_in_scope


# -------------------------------------------------------------------------------- the whole stack
def sqrt_segments(n: int) -> int:
    """The number of segments for ``n`` blocks that keeps the least memory: round(sqrt(n)) (notebook 02)."""
    return max(1, round(math.sqrt(n)))


def _torch_sequential(blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    segments = sqrt_segments(len(blocks))
    return torch_ckpt.checkpoint_sequential(nn.Sequential(*blocks), segments, x, use_reentrant=False)


def _ckpt_sequential(blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    return checkpoint_sequential(list(blocks), sqrt_segments(len(blocks)), x, use_reentrant=False)


@dataclass
class PlannerRange:
    """One stack's profiles (one per block) and the budgets worth planning for.

    ``minimum`` is the blocks' inputs alone (plain per-block checkpointing keeps nothing else);
    ``maximum`` is what the plan keeps with no limit. Budgets between them are given as a fraction.
    """

    # Held so that the id the cache is keyed on can't be reused by another list while cached.
    blocks: Sequence[nn.Module]
    profiles: tuple[Profile, ...]
    minimum: int
    maximum: int
    plans: dict[tuple[float, str], Plan] = field(default_factory=dict, repr=False)

    def budget(self, fraction: float) -> int:
        return self.minimum + round(fraction * (self.maximum - self.minimum))

    def plan(self, fraction: float, method: str = "dp") -> Plan:
        """The plan at ``budget(fraction)``, solved once and then reused."""
        key = (fraction, method)
        if key not in self.plans:
            self.plans[key] = solve(self.profiles, self.budget(fraction), method)
        return self.plans[key]


# Kept for the life of the process (a benchmark plans a handful of stacks).
_RANGES: dict[tuple[Any, ...], PlannerRange] = {}


def planner_range(blocks: Sequence[nn.Module], x: torch.Tensor) -> PlannerRange:
    """Profile ``blocks`` on ``x`` once per stack and input shape (cached: ``id(blocks)``, shape, dtype)."""
    key = (id(blocks), tuple(x.shape), x.dtype, x.device)
    cached = _RANGES.get(key)
    # The same id may belong to a new list once the old one is gone: only a hit on the same list counts.
    if cached is None or cached.blocks is not blocks:
        # Profiling every block is the slow part; solving for a budget takes milliseconds.
        profiles = profile_sequential(blocks, x)
        cached = _RANGES[key] = PlannerRange(blocks, profiles, *budget_range(profiles))
    return cached


def _planned(fraction: float) -> StackRun:
    def run(blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
        return planner_range(blocks, x).plan(fraction)(x)

    return run


# ------------------------------------------------------------------------------------------ registry
_ALWAYS = [
    _per_block("none", "none", _plain),
    _per_block("torch-reentrant", "torch reentrant", _torch_reentrant),
    _per_block("torch-nonreentrant", "torch non-reentrant", _torch_nonreentrant),
    Strategy("torch-sequential-sqrt", "torch checkpoint_sequential, √N segments", _torch_sequential),
    _per_block("torch-sac-matmul", "torch selective, matmuls saved", _torch_sac),
    _per_block(
        "ckpt-reentrant", "ckpt_lab.reentrant_checkpoint", reentrant_checkpoint, reference="torch-reentrant"
    ),
    _per_block("ckpt-nonreentrant", "ckpt_lab.checkpoint", checkpoint, reference="torch-nonreentrant"),
    Strategy(
        "ckpt-sequential-sqrt",
        "ckpt_lab.checkpoint_sequential, √N segments",
        _ckpt_sequential,
        reference="torch-sequential-sqrt",
    ),
    _per_block(
        "ckpt-sac-matmul",
        "ckpt_lab.selective_checkpoint, matmuls saved",
        _ckpt_sac,
        reference="torch-sac-matmul",
    ),
    # No torch reference: torch's memory-budget solver exists only under torch.compile.
    Strategy("ckpt-plan-25", "ckpt_lab.planner, 25% of its range", _planned(0.25), budget_fraction=0.25),
    Strategy("ckpt-plan-50", "ckpt_lab.planner, 50% of its range", _planned(0.5), budget_fraction=0.5),
    _per_block(
        "ckpt-scope",
        "ckpt_lab.gradient_checkpoint_scope",
        _scoped(gradient_checkpoint_scope),
        reference="returnn-scope",
    ),
]
# The strategies that need nothing beyond this package, by name ("none" first).
REGISTRY: dict[str, Strategy] = {s.name: s for s in _ALWAYS}


def _returnn() -> Strategy | None:
    """RETURNN's ``gradient_checkpoint_scope``, if ``returnn`` is installed (``pip install returnn``)."""
    try:
        from returnn.torch.util.gradient_checkpoint import gradient_checkpoint_scope as returnn_scope
    except ImportError:
        return None
    label = "RETURNN's gradient_checkpoint_scope"
    return _per_block("returnn-scope", label, _scoped(returnn_scope), isolated=True)


# ------------------------------------------------------------------------- torch_remat (a peer)
# Meta's torch_remat (notebook 05b): torch's non-reentrant checkpoint with a context_fn whose contexts
# only set a context variable, and regions of code (``remat.region(fn, name, recompute=False)``)
# whose saved tensors it keeps. Benchmark-only strategies, like RETURNN's: not in REGISTRY (whose
# strategies the notebooks' figures and the Pareto sweep run).


class _RNGStates:
    """A torch_remat ``RecomputeStateHook`` for the CPU generator and every initialised CUDA device's:
    torch_remat refuses ``preserve_rng_state=True`` and realigns through such hooks instead, at the
    checkpoint's entry and after each kept region (whose draws the re-run skips)."""

    def snapshot(self) -> Any:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return torch.get_rng_state(), cuda

    def restore(self, state: Any) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


_RNG_HOOKS = (_RNGStates(),)
# The submodules a region policy keeps: those that run matmuls (the region counterpart of "save the
# matmuls"). MultiheadAttention calls its out_proj's weights functionally, so it is kept whole.
_KEPT_MODULES = (nn.Linear, nn.MultiheadAttention)


def _remat_plain(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    import torch_remat as remat

    return remat.checkpoint(region_name="block", recompute_state_hooks=_RNG_HOOKS)(block)(x)


def _kept_call(module: nn.Module, name: str) -> Callable[..., Any]:
    """``module.forward`` as a kept region whose tensor outputs are persisted for the re-run (a bare
    op, the next activation or residual add, reads them there)."""
    import torch_remat as remat

    call = remat.region(module.forward, name, recompute=False)

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = call(*args, **kwargs)
        outputs = out if isinstance(out, tuple) else (out,)
        remat.recompute_needs_tensor(*[t for t in outputs if t is not None])
        return out

    return forward


def _remat_regions(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    import torch_remat as remat

    kept = [(m, _kept_call(m, name)) for name, m in block.named_modules() if isinstance(m, _KEPT_MODULES)]
    # Kept only inside an inner MultiheadAttention (whose Linear is never called as a module) or not.
    kept = [(m, f) for m, f in kept if not any(o is not m and m in o.modules() for o, _ in kept)]

    def body(h: torch.Tensor) -> torch.Tensor:
        # The instances' forward is swapped for the body's two runs (forward and re-run) only.
        for module, forward in kept:
            module.forward = forward
        try:
            return block(h)
        finally:
            for module, _ in kept:
                del module.forward

    return remat.checkpoint(region_name="block", recompute_state_hooks=_RNG_HOOKS)(body)(x)


def _remat() -> list[Strategy]:
    """torch_remat's plain checkpoint and one region policy, if ``torch_remat`` is installed."""
    import importlib.util

    if importlib.util.find_spec("torch_remat") is None:
        return []
    return [
        _per_block(
            "remat-checkpoint", "torch_remat.checkpoint", _remat_plain, reference="torch-nonreentrant"
        ),
        _per_block(
            "remat-region-matmul",
            "torch_remat, Linear and attention calls kept",
            _remat_regions,
            reference="torch-sac-matmul",
        ),
    ]


# ------------------------------------------------------------------------------------------ the floor
def _empty_mode_around(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from ckpt_lab.bench.floor import EmptyMode

    with EmptyMode():
        return torch_ckpt.checkpoint(block, x, use_reentrant=False)


# torch's non-reentrant checkpoint with an empty dispatch mode around each block's forward: what any
# scope that records in a Python dispatch mode pays before it does anything (ckpt_lab.bench.floor).
FLOOR = _per_block("floor-empty-mode", "torch non-reentrant + empty dispatch mode", _empty_mode_around)


def strategies(include_returnn: bool = True, only: list[str] | None = None) -> list[Strategy]:
    """Every strategy available in this environment ("none" first), or "none" and those in ``only``:
    the registry's, the floor, torch_remat's (if installed) and RETURNN's (if installed and asked)."""
    found = [*REGISTRY.values(), FLOOR, *_remat()]
    returnn = _returnn() if include_returnn else None
    if returnn is not None:
        found.append(returnn)
    if only:
        unknown = set(only) - {s.name for s in found}
        if unknown:
            raise ValueError(f"unknown or unavailable strategies: {sorted(unknown)}")
        found = [s for s in found if s.name == "none" or s.name in only]
    return found


def by_label(label: str) -> Strategy:
    """The registered strategy a reader calls ``label`` (``"ckpt_lab.checkpoint"``)."""
    for s in REGISTRY.values():
        if s.label == label:
            return s
    labels = sorted(s.label for s in REGISTRY.values())
    raise ValueError(f"no strategy is called {label!r}; the registered ones are {labels}")
