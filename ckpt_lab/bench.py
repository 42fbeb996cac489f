"""Benchmark: every checkpointing strategy side by side, in one process.

    python -m ckpt_lab.bench           # full run (minutes): bench/results.json, images/bench_*.png
    python -m ckpt_lab.bench --quick   # small workloads, about a minute on 2 cores

Introduced in the README's "Benchmark" section. For each workload (an MLP stack, a transformer
encoder stack, a chain of cheap pointwise ops; training mode, dropout active, the same seed for
every strategy) and each strategy, it measures in separate passes, so no instrument disturbs another:

1. **memory**: retained-after-forward and peak live bytes over forward + backward (gradients
   excluded), from ``ckpt_lab.memory``; plus ``torch.cuda.max_memory_allocated`` on CUDA;
2. **FLOPs and aten ops** of forward + backward (``OpCounter``, and torch's FLOP formulas: the
   numbers of ``count_flops``, without its module hooks; see ``planner.CostCounter``);
3. **correctness**: every gradient against the un-checkpointed run, and a check that the strategy
   left no global state behind (saved-tensor hooks, dispatch modes, patched methods, grad mode);
4. **time**: rounds in which the strategies run in a shuffled order; each strategy's time is divided
   by the time of "none" (and of its torch equivalent) *in the same round*, and the median of those
   ratios is reported, so that the machine's drifting load cancels out.

The planner strategies (``ckpt-plan-25``, ``ckpt-plan-50``; notebook 05) are planned once per workload,
before anything is measured or timed, at a quarter and half of the way from the smallest useful
budget to the largest (``PlannerRange``); each is checked against its budget.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as torch_ckpt

from ckpt_lab.counting import OpCounter
from ckpt_lab.memory import measure_memory
from ckpt_lab.nonreentrant import checkpoint
from ckpt_lab.planner import CostCounter, Plan, Profile, budget_range, matmul_flops, profile_sequential, solve
from ckpt_lab.reentrant import reentrant_checkpoint
from ckpt_lab.selective import selective_checkpoint
from ckpt_lab.sequential import checkpoint_sequential

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    """A stack of blocks and an input; ``family`` groups workloads that differ only in depth."""

    family: str
    depth: int
    blocks: list[nn.Module]
    input: torch.Tensor
    # How to build it again in another process: the factory's name in this module and its arguments.
    spec: tuple[str, dict[str, Any]] = ("", {})

    @property
    def name(self) -> str:
        return f"{self.family}-{self.depth}"

    def parameters(self) -> list[torch.Tensor]:
        return [p for block in self.blocks for p in block.parameters()]


def mlp(depth: int, width: int = 1024, batch: int = 64, device: str = "cpu") -> Workload:
    """``depth`` blocks of Linear + GELU + Dropout."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1)) for _ in range(depth)]
    x = torch.randn(batch, width)
    spec = ("mlp", {"depth": depth, "width": width, "batch": batch, "device": device})
    return Workload("mlp", depth, [b.to(device).train() for b in blocks], x.to(device).requires_grad_(), spec)


def transformer(
    depth: int, d_model: int = 256, nhead: int = 4, seq: int = 128, batch: int = 8, device: str = "cpu"
) -> Workload:
    """``depth`` ``nn.TransformerEncoderLayer`` blocks (dropout 0.1, batch first)."""
    torch.manual_seed(0)
    blocks = [
        nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=4 * d_model, dropout=0.1, batch_first=True)
        for _ in range(depth)
    ]
    x = torch.randn(batch, seq, d_model)
    spec = (
        "transformer",
        {"depth": depth, "d_model": d_model, "nhead": nhead, "seq": seq, "batch": batch, "device": device},
    )
    return Workload(
        "transformer", depth, [b.to(device).train() for b in blocks], x.to(device).requires_grad_(), spec
    )


class PointwiseBlock(nn.Module):
    """Ten cheap pointwise ops: the per-op overhead of hooks and dispatch modes dominates."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(5):
            x = torch.sin(x) * self.scale
        return x


def pointwise(depth: int, size: int = 64, device: str = "cpu") -> Workload:
    torch.manual_seed(0)
    x = torch.randn(size, size)
    spec = ("pointwise", {"depth": depth, "size": size, "device": device})
    return Workload(
        "pointwise",
        depth,
        [PointwiseBlock().to(device) for _ in range(depth)],
        x.to(device).requires_grad_(),
        spec,
    )


# ---------------------------------------------------------------------------------------- strategies
Run = Callable[[list[nn.Module], torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Strategy:
    """How to run a stack of blocks; ``reference`` names the torch strategy it reimplements."""

    name: str
    run: Run
    reference: str | None = None
    # Measured in a process of its own (with "none" beside it), because it leaves global state behind
    # that would break the strategies measured after it.
    isolated: bool = False
    # Planner strategies: where their budget lies between the workload's smallest and largest
    # (``PlannerRange.budget``); ``measure`` makes the plan before anything is measured or timed.
    budget_fraction: float | None = None


def _per_block(wrap: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> Run:
    def run(blocks: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            x = wrap(block, x)
        return x

    return run


def _in_scope(scope_factory: Callable[[], Any]) -> Run:
    def wrap(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with scope_factory():
            return block(x)

    return _per_block(wrap)


def _sqrt_segments(n: int) -> int:
    return max(1, round(math.sqrt(n)))


_MATMULS = [
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
]


def _sac_context() -> Any:
    # Save the outputs of matmuls (expensive to recompute), recompute everything else.
    return torch_ckpt.create_selective_checkpoint_contexts(_MATMULS)


def _ckpt_sac(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return selective_checkpoint(block, x, policy=_MATMULS)


# ------------------------------------------------------------------------------------------ planner
@dataclass
class PlannerRange:
    """One stack's profiles (one per block) and the budgets worth planning for.

    ``minimum`` is the blocks' inputs alone (plain per-block checkpointing keeps nothing else);
    ``maximum`` is what the plan keeps with no limit. Budgets between them are given as a fraction.
    """

    # Held so that the id the cache is keyed on can't be reused by another list while cached.
    blocks: list[nn.Module]
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


def planner_range(blocks: list[nn.Module], x: torch.Tensor) -> PlannerRange:
    """Profile ``blocks`` on ``x`` once per stack and input shape (cached: ``id(blocks)``, shape, dtype)."""
    key = (id(blocks), tuple(x.shape), x.dtype, x.device)
    cached = _RANGES.get(key)
    # The same id may belong to a new list once the old one is gone: only a hit on the same list counts.
    if cached is None or cached.blocks is not blocks:
        # Profiling every block is the slow part; solving for a budget takes milliseconds.
        profiles = profile_sequential(blocks, x)
        cached = _RANGES[key] = PlannerRange(blocks, profiles, *budget_range(profiles))
    return cached


def _planned(fraction: float) -> Run:
    def run(blocks: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
        return planner_range(blocks, x).plan(fraction)(x)

    return run


def strategies(include_returnn: bool = True, only: list[str] | None = None) -> list[Strategy]:
    """Every strategy available in this environment ("none" first), or those named in ``only``."""
    found = [
        Strategy("none", _per_block(lambda b, x: b(x))),
        Strategy("torch-reentrant", _per_block(lambda b, x: torch_ckpt.checkpoint(b, x, use_reentrant=True))),
        Strategy(
            "torch-nonreentrant", _per_block(lambda b, x: torch_ckpt.checkpoint(b, x, use_reentrant=False))
        ),
        Strategy(
            "torch-sequential-sqrt",
            lambda bs, x: torch_ckpt.checkpoint_sequential(
                nn.Sequential(*bs), _sqrt_segments(len(bs)), x, use_reentrant=False
            ),
        ),
        Strategy(
            "torch-sac-matmul",
            _per_block(
                lambda b, x: torch_ckpt.checkpoint(b, x, use_reentrant=False, context_fn=_sac_context)
            ),
        ),
        Strategy("ckpt-reentrant", _per_block(reentrant_checkpoint), reference="torch-reentrant"),
        Strategy("ckpt-nonreentrant", _per_block(checkpoint), reference="torch-nonreentrant"),
        Strategy(
            "ckpt-sequential-sqrt",
            lambda bs, x: checkpoint_sequential(bs, _sqrt_segments(len(bs)), x, use_reentrant=False),
            reference="torch-sequential-sqrt",
        ),
        Strategy("ckpt-sac-matmul", _per_block(_ckpt_sac), reference="torch-sac-matmul"),
        # No torch reference: torch's memory-budget solver exists only under torch.compile.
        Strategy("ckpt-plan-25", _planned(0.25), budget_fraction=0.25),
        Strategy("ckpt-plan-50", _planned(0.5), budget_fraction=0.5),
    ]
    try:
        from ckpt_lab.scope import gradient_checkpoint_scope
    except ImportError:
        pass
    else:
        found.append(Strategy("ckpt-scope", _in_scope(gradient_checkpoint_scope), reference="returnn-scope"))
    if include_returnn:
        try:
            from returnn.torch.util.gradient_checkpoint import gradient_checkpoint_scope as returnn_scope
        except ImportError:
            pass
        else:
            found.append(Strategy("returnn-scope", _in_scope(returnn_scope), isolated=True))
    if only:
        unknown = set(only) - {s.name for s in found}
        if unknown:
            raise ValueError(f"unknown or unavailable strategies: {sorted(unknown)}")
        found = [s for s in found if s.name == "none" or s.name in only]
    return found


# ------------------------------------------------------------------------------------------ measuring
def _loss(strategy: Strategy, wl: Workload, seed: int = 1) -> torch.Tensor:
    # The same seed for every strategy: the same dropout masks, so gradients can be compared exactly.
    torch.manual_seed(seed)
    return strategy.run(wl.blocks, wl.input).square().mean()


def _zero_grads(wl: Workload) -> None:
    for t in [wl.input, *wl.parameters()]:
        t.grad = None


def _grads(wl: Workload) -> list[torch.Tensor]:
    return [t.grad.detach().clone() for t in [wl.input, *wl.parameters()]]


def global_state() -> dict[str, Any]:
    """What a strategy must leave as it found it."""
    hooks = torch.autograd.graph.saved_tensors_hooks
    return {
        "saved_tensors_hooks_on_stack": torch._C._autograd._top_saved_tensors_default_hooks(False)
        is not None,
        "dispatch_modes": torch._C._len_torch_dispatch_stack(),
        "grad_enabled": torch.is_grad_enabled(),
        "saved_tensors_hooks_methods": (hooks.__enter__.__qualname__, hooks.__exit__.__qualname__),
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed_step(strategy: Strategy, wl: Workload, device: str) -> float:
    _zero_grads(wl)
    _sync(device)
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _loss(strategy, wl).backward()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000
    t0 = time.perf_counter()
    _loss(strategy, wl).backward()
    return time.perf_counter() - t0


@dataclass
class Result:
    workload: str
    family: str
    depth: int
    strategy: str
    reference: str | None
    retained_bytes: int = 0
    peak_bytes: int = 0
    cuda_peak_bytes: int | None = None
    flops: int = 0
    aten_ops: int = 0
    grad_max_abs_diff: float = 0.0
    grad_ok: bool = True
    state_ok: bool = True
    state_error: str = ""
    seconds: float = 0.0
    time_vs_none: float = 1.0
    time_vs_reference: float | None = None
    # Planner strategies: the budget, in bytes, that the plan was made for.
    budget_bytes: int | None = None
    # ``retained_bytes`` on the planner's terms, comparable with ``budget_bytes``: the activations kept
    # between forward and backward, counting the first block's input but not the final output nor the
    # loss (``retained_bytes`` counts those two and not the input, which exists before the forward).
    activation_bytes: int | None = None
    samples: list[float] = field(default_factory=list, repr=False)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _measure_isolated(
    specs: list[tuple[str, dict[str, Any]]], names: list[str], rounds: int, device: str
) -> list[Result]:
    """In a fresh process: rebuild each workload and measure "none" and the strategies ``names`` there."""
    strats = [replace(s, isolated=False) for s in strategies(True) if s.name in ("none", *names)]
    results = []
    for factory, kwargs in specs:
        results.extend(measure(globals()[factory](**kwargs), strats, rounds, device, lambda m: None))
    return results


def _output_bytes(wl: Workload) -> int:
    """Bytes of the stack's final output (the same for every strategy)."""
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        out = _per_block(lambda b, x: b(x))(wl.blocks, wl.input)
    return out.untyped_storage().nbytes()


def measure(
    wl: Workload, strats: list[Strategy], rounds: int, device: str, log: Callable[[str], None]
) -> list[Result]:
    """All metrics of every strategy on one workload."""
    results = {s.name: Result(wl.name, wl.family, wl.depth, s.name, s.reference) for s in strats}
    # Plans are made (profiled and solved) now, so that planning is in none of the measurements.
    for s in strats:
        if s.budget_fraction is not None:
            results[s.name].budget_bytes = planner_range(wl.blocks, wl.input).plan(s.budget_fraction).budget
    # Correctness and global state first: a broken strategy should be flagged before being timed.
    _zero_grads(wl)
    _loss(strats[0], wl).backward()
    expected = _grads(wl)
    for s in strats:
        before = global_state()
        _zero_grads(wl)
        try:
            _loss(s, wl).backward()
        except Exception as error:  # a strategy that breaks is reported, not fatal for the others
            results[s.name].grad_ok = False
            results[s.name].state_error = f"raised {type(error).__name__}: {error}"
            continue
        got = _grads(wl)
        diffs = [(a - b).abs().max().item() for a, b in zip(got, expected, strict=True)]
        results[s.name].grad_max_abs_diff = max(diffs)
        results[s.name].grad_ok = all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(got, expected, strict=True)
        )
        after = global_state()
        if after != before:
            # Reported, not repaired: popping another library's hooks could break its later __exit__.
            results[s.name].state_ok = False
            results[s.name].state_error = "; ".join(
                f"{key}: {before[key]} -> {after[key]}" for key in before if before[key] != after[key]
            )
    runnable = [s for s in strats if not results[s.name].state_error.startswith("raised")]
    log(f"  {wl.name}: gradients and state checked")

    # On the planner's terms (``activation_bytes``): the final output stays alive (square saved it) and
    # so does the loss (a scalar of the input's dtype); the input was made before, yet is kept.
    not_activations = _output_bytes(wl) + wl.input.element_size() - wl.input.untyped_storage().nbytes()
    for s in runnable:
        _zero_grads(wl)
        report = measure_memory(partial(_loss, s, wl))
        results[s.name].retained_bytes = report.retained_bytes
        results[s.name].activation_bytes = report.retained_bytes - not_activations
        results[s.name].peak_bytes = report.peak_bytes
        results[s.name].cuda_peak_bytes = report.cuda_peak_bytes
    log(f"  {wl.name}: memory measured")

    for s in runnable:
        _zero_grads(wl)
        with OpCounter() as ops, CostCounter(cost=matmul_flops) as flops:
            _loss(s, wl).backward()
        results[s.name].flops = flops.total
        results[s.name].aten_ops = ops.total
    log(f"  {wl.name}: FLOPs counted")

    # Warm-up round (allocator, lazy inits), not recorded.
    for s in runnable:
        _timed_step(s, wl, device)
    order = list(runnable)
    rng = random.Random(0)
    per_round: list[dict[str, float]] = []
    for r in range(rounds):
        rng.shuffle(order)
        per_round.append({s.name: _timed_step(s, wl, device) for s in order})
        log(f"  {wl.name}: timing round {r + 1}/{rounds}")
    for s in runnable:
        res = results[s.name]
        res.samples = [t[s.name] for t in per_round]
        res.seconds = statistics.median(res.samples)
        res.time_vs_none = statistics.median(t[s.name] / t["none"] for t in per_round)
        if s.reference in per_round[0]:
            res.time_vs_reference = statistics.median(t[s.name] / t[s.reference] for t in per_round)

    return list(results.values())


def _merge_isolated(results: list[Result], child: list[Result]) -> list[Result]:
    """Add the isolated strategies' results; relate times through each process's own "none"."""
    merged = list(results)
    for res in child:
        if res.strategy == "none":
            continue
        merged.append(res)
        for other in merged:
            if other.workload == res.workload and other.reference == res.strategy:
                other.time_vs_reference = other.time_vs_none / res.time_vs_none
    return merged


# ------------------------------------------------------------------------------------------- targets
def check_targets(results: list[Result]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured figure: PASS or MISS (never hidden)."""
    by = {(r.workload, r.strategy): r for r in results}
    checks = []

    def add(workload: str, what: str, ok: bool, figure: str) -> None:
        checks.append({"workload": workload, "target": what, "ok": ok, "figure": figure})

    for (workload, name), r in sorted(by.items()):
        ref = by.get((workload, r.reference)) if r.reference else None
        if name in ("ckpt-reentrant", "ckpt-nonreentrant", "ckpt-sequential-sqrt", "ckpt-sac-matmul") and ref:
            for metric in ("retained_bytes", "peak_bytes"):
                ours, theirs = getattr(r, metric), getattr(ref, metric)
                ok = abs(ours - theirs) <= 0.01 * max(theirs, 1)
                add(workload, f"{name} {metric} = {ref.strategy} ±1%", ok, f"{ours:,} vs {theirs:,}")
            if r.family in ("mlp", "transformer") and r.time_vs_reference is not None:
                add(
                    workload,
                    f"{name} time <= 1.05x {ref.strategy}",
                    r.time_vs_reference <= 1.05,
                    f"{r.time_vs_reference:.2f}x",
                )
        if name == "ckpt-scope":
            torch_nr = by.get((workload, "torch-nonreentrant"))
            if torch_nr:
                for metric in ("retained_bytes", "peak_bytes"):
                    ours, theirs = getattr(r, metric), getattr(torch_nr, metric)
                    add(
                        workload,
                        f"ckpt-scope {metric} <= torch-nonreentrant",
                        ours <= theirs,
                        f"{ours:,} vs {theirs:,}",
                    )
            if ref and r.time_vs_reference is not None:
                add(
                    workload,
                    "ckpt-scope time <= returnn-scope",
                    r.time_vs_reference <= 1.0,
                    f"{r.time_vs_reference:.2f}x",
                )
            if r.family == "pointwise":
                add(
                    workload,
                    "ckpt-scope time <= 3x none (pointwise chain)",
                    r.time_vs_none <= 3.0,
                    f"{r.time_vs_none:.2f}x",
                )
        if r.budget_bytes is not None and r.activation_bytes is not None:
            add(
                workload,
                f"{name}: planner within its budget",
                r.activation_bytes <= r.budget_bytes,
                f"{r.activation_bytes:,} vs budget {r.budget_bytes:,}",
            )
        if not r.grad_ok:
            add(
                workload,
                f"{name} gradients equal none's",
                False,
                r.state_error or f"{r.grad_max_abs_diff:.2e}",
            )
        if not r.state_ok:
            add(workload, f"{name} leaves no global state", False, r.state_error)
    return checks


# -------------------------------------------------------------------------------------------- report
def _mib(n: int) -> str:
    return f"{n / 2**20:8.2f}"


def table(results: list[Result]) -> str:
    lines = [
        f"{'workload':15} {'strategy':22} {'retained MiB':>12} {'peak MiB':>9} {'GFLOP':>7} "
        f"{'ops':>6} {'time/none':>9} {'time/ref':>8} {'grad':>5} {'state':>5}"
    ]
    for r in results:
        ref = f"{r.time_vs_reference:.2f}x" if r.time_vs_reference is not None else "-"
        lines.append(
            f"{r.workload:15} {r.strategy:22} {_mib(r.retained_bytes):>12} {_mib(r.peak_bytes):>9} "
            f"{r.flops / 1e9:7.2f} {r.aten_ops:6d} {r.time_vs_none:8.2f}x {ref:>8} "
            f"{'ok' if r.grad_ok else 'FAIL':>5} {'ok' if r.state_ok else 'FAIL':>5}"
        )
    return "\n".join(lines)


def plot(results: list[Result], images: Path) -> list[Path]:
    """Retained memory against depth (with a sqrt(N) guide), and the memory-time trade-off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images.mkdir(exist_ok=True)
    written = []
    mlp_results = [r for r in results if r.family == "mlp" and r.retained_bytes]
    depths = sorted({r.depth for r in mlp_results})
    if len(depths) > 1:
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for name in dict.fromkeys(r.strategy for r in mlp_results):
            pts = sorted((r.depth, r.retained_bytes / 2**20) for r in mlp_results if r.strategy == name)
            style = "--" if name.startswith("torch") else "-"
            ax.plot(*zip(*pts, strict=True), style, marker="o", label=name)
        seq = {r.depth: r.retained_bytes for r in mlp_results if r.strategy == "torch-sequential-sqrt"}
        if seq:
            d0 = depths[0]
            ax.plot(
                depths,
                [seq[d0] / 2**20 * math.sqrt(d / d0) for d in depths],
                ":",
                color="gray",
                label="∝ √N guide",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("MLP depth N (blocks)")
        ax.set_ylabel("retained after forward (MiB)")
        ax.set_title("Activation memory kept for backward")
        ax.legend(fontsize=7, ncol=2)
        path = images / "bench_memory_vs_depth.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)

    deepest: dict[str, int] = {}
    for r in results:
        if r.retained_bytes and (r.family not in deepest or r.depth > deepest[r.family]):
            deepest[r.family] = r.depth
    names = list(dict.fromkeys(r.strategy for r in results))
    colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(names)}
    markers = {"none": "*", "torch": "s", "ckpt": "o", "returnn": "^"}
    fig, axes = plt.subplots(1, len(deepest), figsize=(4.5 * len(deepest), 4), squeeze=False)
    for ax, (family, depth) in zip(axes[0], sorted(deepest.items()), strict=True):
        rows = [r for r in results if r.family == family and r.depth == depth and r.retained_bytes]
        none = next(r for r in rows if r.strategy == "none")
        for r in rows:
            marker = markers[r.strategy.split("-")[0]]
            ax.scatter(r.time_vs_none, r.peak_bytes / none.peak_bytes, s=45, marker=marker,
                       color=colors[r.strategy], label=r.strategy, alpha=0.85)
        ax.set_xlabel("time / none (median of per-round ratios)")
        ax.set_ylabel("peak live bytes / none")
        ax.set_title(f"{family}, {depth} blocks")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(5, len(labels)), fontsize=8,
               bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    path = images / "bench_tradeoff.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    written.append(path)
    return written


# ---------------------------------------------------------------------------------------------- main
def workloads(quick: bool, device: str) -> Iterator[Workload]:
    if quick:
        yield from (mlp(d, width=256, batch=16, device=device) for d in (4, 8))
        yield transformer(2, d_model=64, nhead=4, seq=32, batch=4, device=device)
        yield pointwise(8, device=device)
    else:
        yield from (mlp(d, device=device) for d in (8, 16, 32))
        yield from (transformer(d, device=device) for d in (4, 8))
        yield pointwise(32, device=device)


def run(
    quick: bool = False,
    rounds: int | None = None,
    device: str = "cpu",
    include_returnn: bool = True,
    only: list[str] | None = None,
    log: Callable[[str], None] = _progress,
) -> dict[str, Any]:
    """Measure every strategy on every workload; returns what ``--json`` writes."""
    rounds = rounds or (3 if quick else 7)
    strats = strategies(include_returnn, only)
    in_process = [s for s in strats if not s.isolated]
    isolated = [s.name for s in strats if s.isolated]
    results: list[Result] = []
    specs = []
    for wl in workloads(quick, device):
        log(f"{wl.name}: {len(in_process)} strategies")
        results.extend(measure(wl, in_process, rounds, device, log))
        specs.append(wl.spec)
    if isolated:
        # Strategies that leave global state behind run last, in a fresh process, beside "none".
        log(f"{', '.join(isolated)}: every workload, in a process of its own")
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            child = pool.submit(_measure_isolated, specs, isolated, rounds, device).result()
        results = _merge_isolated(results, child)
    results.sort(key=lambda r: (r.family, r.depth))
    return {
        "meta": {
            "torch": torch.__version__,
            "device": device if device == "cpu" else torch.cuda.get_device_name(),
            "threads": torch.get_num_threads(),
            "quick": quick,
            "rounds": rounds,
            "strategies": [s.name for s in strats],
            "returnn": "returnn-scope" in [s.name for s in strats],
        },
        "results": [{k: v for k, v in asdict(r).items() if k != "samples"} for r in results],
        "targets": check_targets(results),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckpt_lab.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small workloads, under a minute on 2 cores")
    parser.add_argument("--rounds", type=int, help="timing rounds (default 7, quick 3)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="where to write the results (default bench/results.json)")
    parser.add_argument("--images", type=Path, default=ROOT / "images", help="where to write the plots")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--strategies", help="comma-separated names to run (none is always included)")
    parser.add_argument(
        "--no-returnn", action="store_true", help="leave RETURNN's scope out even if installed"
    )
    args = parser.parse_args(argv)

    only = args.strategies.split(",") if args.strategies else None
    report = run(args.quick, args.rounds, args.device, include_returnn=not args.no_returnn, only=only)
    results = [Result(**r) for r in report["results"]]
    print(table(results))
    print()
    for check in report["targets"]:
        verdict = "PASS" if check["ok"] else "MISS"
        print(f"{verdict}  {check['workload']:15} {check['target']}: {check['figure']}")
    if not report["meta"]["returnn"]:
        print(
            "returnn-scope: absent (pip install returnn to compare with RETURNN's gradient_checkpoint_scope)"
        )
    out = args.json or (ROOT / "bench" / ("results-quick.json" if args.quick else "results.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nresults: {out}")
    if not args.no_plots:
        for path in plot(results, args.images):
            print(f"plot: {path}")
    # Wrong gradients anywhere, or global state left behind by a strategy of ours or torch's, fail the run;
    # the peer's known state leak is reported above as a MISS.
    broken = [r for r in results if not r.grad_ok or (not r.state_ok and r.strategy != "returnn-scope")]
    if broken:
        print("\nFAILED: " + ", ".join(f"{r.workload}/{r.strategy}" for r in broken), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
