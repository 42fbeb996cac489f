"""Measure every strategy on a workload, side by side, in one process.

For each workload and strategy, in separate passes, so that no instrument disturbs another:

1. **correctness**: every gradient against the un-checkpointed run, and a check that the strategy
   left no global state behind (``ckpt_lab.instruments.state``);
2. **memory**: retained-after-forward and peak live bytes over forward + backward (gradients
   excluded), from ``ckpt_lab.instruments.memory``; plus ``torch.cuda.max_memory_allocated`` on CUDA;
3. **FLOPs and aten ops** of forward + backward (``OpCounter``, and torch's FLOP formulas: the
   numbers of ``count_flops``, without its module hooks; see ``instruments.flops.CostCounter``);
4. **time**: rounds in which the strategies run in a shuffled order; each strategy's time is divided
   by the time of "none" (and of its torch equivalent) *in the same round*, and the median of those
   ratios is reported, so that the machine's drifting load cancels out.

``check_targets`` turns the results into PASS/MISS lines for the benchmark page's targets.
"""

from __future__ import annotations

import multiprocessing
import random
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import torch

from ckpt_lab.bench.workloads import FACTORIES, Workload, suite
from ckpt_lab.instruments.counting import OpCounter
from ckpt_lab.instruments.flops import CostCounter, matmul_flops
from ckpt_lab.instruments.memory import measure_memory
from ckpt_lab.instruments.state import changes, global_state
from ckpt_lab.rng import fork_rng
from ckpt_lab.strategies import REGISTRY, Strategy, planner_range, strategies

__all__ = ["Result", "check_targets", "floor_lines", "measure", "run"]


def _loss(strategy: Strategy, wl: Workload, seed: int = 1) -> torch.Tensor:
    # The same seed for every strategy: the same dropout masks, so gradients can be compared exactly.
    torch.manual_seed(seed)
    return strategy.run(wl.blocks, wl.input).square().mean()


def _zero_grads(wl: Workload) -> None:
    for t in [wl.input, *wl.parameters()]:
        t.grad = None


def _grads(wl: Workload) -> list[torch.Tensor]:
    return [t.grad.detach().clone() for t in [wl.input, *wl.parameters()]]


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
    # Median of the per-round ratios to torch's non-reentrant checkpoint, timed in the same rounds.
    time_vs_torch_nonreentrant: float | None = None
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
        results.extend(measure(FACTORIES[factory](**kwargs), strats, rounds, device, lambda m: None))
    return results


def _output_bytes(wl: Workload) -> int:
    """Bytes of the stack's final output (the same for every strategy)."""
    with torch.no_grad(), fork_rng():
        out = REGISTRY["none"].run(wl.blocks, wl.input)
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
        left = changes(before, global_state())
        if left:
            # Reported, not repaired: popping another library's hooks could break its later __exit__.
            results[s.name].state_ok = False
            results[s.name].state_error = "; ".join(left)
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
        if "torch-nonreentrant" in per_round[0]:
            res.time_vs_torch_nonreentrant = statistics.median(
                t[s.name] / t["torch-nonreentrant"] for t in per_round
            )

    return list(results.values())


def _merge_isolated(results: list[Result], child: list[Result]) -> list[Result]:
    """Add the isolated strategies' results; relate times through each process's own "none".

    Paired per round there, so robust to the load of a shared machine; but RETURNN's scope leaves
    its pack hook on the stack after a step, which slows every later step of "none" in its process
    (pointwise-32: 12.2 vs 4.0 ms), so its ratio comes out low where per-op overhead dominates.
    Its ``seconds`` stay comparable with ours in absolute terms (not paired: one process after
    the other).
    """
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
    """The benchmark page's targets, each with the measured figure: PASS or MISS (never hidden)."""
    by = {(r.workload, r.strategy): r for r in results}
    checks = []

    def add(workload: str, what: str, ok: bool, figure: str) -> None:
        checks.append({"workload": workload, "target": what, "ok": ok, "figure": figure})

    for (workload, name), r in sorted(by.items()):
        ref = by.get((workload, r.reference)) if r.reference else None
        # A reimplementation of one of torch's strategies must match its bytes (and roughly its time);
        # a peer's (torch_remat's) reference is only the column its time is divided by.
        if ref and ref.strategy.startswith("torch-") and name.startswith("ckpt-"):
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
            _scope_targets(r, by, add)
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


# The scope against its peers: never the fat option nor the slow one (at torch's peak and speed).
SCOPE_TIME_VS_TORCH = 1.05


def _scope_targets(r: Result, by: dict[tuple[str, str], Result], add: Callable[..., None]) -> None:
    """Peak at most the lower of torch's non-reentrant checkpoint and RETURNN's scope; time at most
    1.05x torch's non-reentrant checkpoint (median of per-round ratios) and at most RETURNN's."""
    peers = [p for p in (by.get((r.workload, n)) for n in ("torch-nonreentrant", "returnn-scope")) if p]
    torch_nr = by.get((r.workload, "torch-nonreentrant"))
    if torch_nr:
        ours, theirs = r.retained_bytes, torch_nr.retained_bytes
        what = "ckpt-scope retained_bytes <= torch-nonreentrant"
        add(r.workload, what, ours <= theirs, f"{ours:,} vs {theirs:,}")
    if peers:
        lowest = min(p.peak_bytes for p in peers)
        figure = f"{r.peak_bytes:,} vs " + ", ".join(f"{p.strategy} {p.peak_bytes:,}" for p in peers)
        names = " and ".join(p.strategy for p in peers)
        add(r.workload, f"ckpt-scope peak_bytes <= {names}", r.peak_bytes <= lowest, figure)
    if r.time_vs_torch_nonreentrant is not None:
        add(
            r.workload,
            f"ckpt-scope time <= {SCOPE_TIME_VS_TORCH:.2f}x torch-nonreentrant (per-round ratio)",
            r.time_vs_torch_nonreentrant <= SCOPE_TIME_VS_TORCH,
            f"{r.time_vs_torch_nonreentrant:.2f}x",
        )
    if r.time_vs_reference is not None:
        ratio = r.time_vs_reference
        add(r.workload, "ckpt-scope time <= returnn-scope", ratio <= 1.0, f"{ratio:.2f}x")


def floor_lines(results: list[Result]) -> list[dict[str, Any]]:
    """Per workload, the scope's time against its floor, both per-round ratios to torch's
    non-reentrant checkpoint: the floor is that checkpoint with an empty dispatch mode around each
    block's forward (``strategies.FLOOR``), the least a scope that records in such a mode can cost;
    ``x`` is what the scope costs above it."""
    by = {(r.workload, r.strategy): r for r in results}
    lines = []
    for workload in dict.fromkeys(r.workload for r in results):
        floor, scope = by.get((workload, "floor-empty-mode")), by.get((workload, "ckpt-scope"))
        if floor is None or scope is None or None in (
            floor.time_vs_torch_nonreentrant, scope.time_vs_torch_nonreentrant
        ):
            continue
        f, s = floor.time_vs_torch_nonreentrant, scope.time_vs_torch_nonreentrant
        lines.append({"workload": workload, "floor": f, "scope": s, "x": s - f})
    return lines


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
    for wl in suite(quick, device):
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
        "floor": floor_lines(results),
    }
