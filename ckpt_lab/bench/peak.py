"""The peak sweep: three ways to fit a memory budget, judged by the peak each one measures.

    python -m ckpt_lab.bench.peak                    # results/: peak.json, peak.md, peak_sweep.png
    python -m ckpt_lab.bench.peak --refresh-site     # the picture and the site's table (make peak)
    python -m ckpt_lab.bench.peak --quick            # small models, for a smoke test

On mlp-8, transformer-4 (the benchmark's stacks, loss the mean of the output squared) and notebook
07b's GPT-2 (``gpt2_chain``: the same model cut into its embedding, its four blocks and its head with
the loss), a budget sweep of

(a) ``peak_planner``: the plan whose predicted peak fits the budget at the least recomputation, at
    budgets from its lowest predicted peak to no checkpointing's (``FRACTIONS`` of that range);
(b) ``planner``: the retained-bytes plan at ``FRACTIONS`` of its budget range, with the peak the same
    simulation predicts for it;
(c) torch.compile's ``activation_memory_budget`` (``COMPILE_BUDGETS``), backend
    ``aot_eager_decomp_partition`` as in notebook 08 (``ckpt_lab.compiled.compile_step``, the loss
    inside the compiled function, memory measured inside its graphs).

Per point: the predicted and the measured peak (``measure_memory``'s ``peak_bytes``: gradients left
out, NOTE [ Which peak ] in ``ckpt_lab.peak_planner``), the bytes alive when backward starts (made in
the step), and the FLOPs recomputed (``CostCounter``, the planners' cost model, minus no
checkpointing's; for the compiler, its backward graph's recomputed ops on their decomposed ops).
Every eager run is seeded alike and its gradients compared with no checkpointing's, bit for bit; a
compiled budget's with the compiled step at budget 1.

Targets, each printed PASS or MISS with its figure (``check_targets``):

* the measured peak within 2% of the prediction at every point of both planners;
* the measured peak never rising as the budget falls, for each of the three;
* at equal recomputation the peak planner at or below the others: for every point of (b) and (c),
  the peak planner's plan with the lowest predicted peak among those recomputing no more
  (``peak_frontier``), measured, peaks no higher; a MISS says why;
* pytorch/pytorch#197838 (the compiler's measured peak not monotonic in its budget): shown or not,
  measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckpt_lab.bench.workloads import Workload, mlp, transformer
from ckpt_lab.helpers import in_checkout
from ckpt_lab.instruments.flops import CostCounter
from ckpt_lab.instruments.memory import MemoryReport, measure_memory
from ckpt_lab.peak_planner import PeakPlan, PeakProfile, mean_square, peak_frontier, profile_peak, solve_peak
from ckpt_lab.planner import budget_range, solve

__all__ = [
    "COMPILE_BUDGETS",
    "FRACTIONS",
    "Chain",
    "PeakPoint",
    "Sweep",
    "chain_of",
    "check_targets",
    "gpt2_chain",
    "main",
    "markdown",
    "models",
    "plot",
    "sweep",
    "table",
]

FRACTIONS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)
COMPILE_BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.15, 0.1, 0.05, 0.0)
# The measured peak may differ from the prediction by this fraction of it.
TOLERANCE = 0.02
SEED = 1


# ------------------------------------------------------------------------------------------ models
@dataclass
class Chain:
    """A model as a chain of regions, each taking and returning one tensor, then its loss."""

    name: str
    regions: list[Callable[[torch.Tensor], torch.Tensor]]
    input: torch.Tensor
    loss: Callable[[torch.Tensor], torch.Tensor]
    params: list[torch.Tensor] = field(repr=False)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        for region in self.regions:
            x = region(x)
        return x

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """The loss of one plain forward (what torch.compile compiles)."""
        return self.loss(self.run(x))


def chain_of(wl: Workload) -> Chain:
    """A benchmark stack, with the benchmark's loss."""
    return Chain(wl.name, list(wl.blocks), wl.input, mean_square, wl.parameters())


class _GPT2Block(nn.Module):
    """One GPT-2 block as ``GPT2Model.forward`` calls it, with the arguments it passes besides the
    hidden states (the causal mask, the position ids) fixed."""

    def __init__(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.block, self.args, self.kwargs = block, args, kwargs

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block(h, *self.args, **self.kwargs)


def gpt2_chain(**sizes: Any) -> Chain:
    """Notebook 07b's GPT-2 (``ckpt_lab.cases.real.gpt2``) as a chain: its embedding (token and
    position embeddings, dropout), each block, and last its head with the loss (final layer norm,
    ``lm_head``, the model's own causal-LM loss on the tokens as labels).

    The same ops as ``model(tokens, labels=tokens)`` (tested: the same loss and gradients), with one
    difference: the causal mask the model makes every step (a float tensor, batch x 1 x seq x seq)
    is made once here, before the step, so no step counts it.
    """
    from ckpt_lab.cases.real import gpt2  # transformers: imported only when GPT-2 is wanted

    model, tokens = gpt2(**sizes)
    t = model.transformer
    seen: dict[str, Any] = {}

    def grab(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen["args"], seen["kwargs"] = args[1:], kwargs

    # What the model passes to its blocks besides the hidden states, from one forward of its own.
    handle = t.h[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        handle.remove()
    positions = seen["kwargs"]["position_ids"]

    def embed(ids: torch.Tensor) -> torch.Tensor:
        return t.drop(t.wte(ids) + t.wpe(positions))

    def head_and_loss(h: torch.Tensor) -> torch.Tensor:
        logits = model.lm_head(t.ln_f(h))
        return model.loss_function(logits, tokens, vocab_size=model.config.vocab_size)

    blocks = [_GPT2Block(b, seen["args"], seen["kwargs"]) for b in t.h]
    params = [p for p in model.parameters() if p.requires_grad]
    chain = Chain("gpt2", [embed, *blocks], tokens, head_and_loss, params)
    chain.model = model  # type: ignore[attr-defined]  # for the test that compares with model(...)
    return chain


def models(quick: bool = False) -> list[Callable[[], Chain]]:
    """The sweep's models: mlp-8, transformer-4, GPT-2 (``quick``: small ones of each kind)."""
    if quick:
        return [
            lambda: chain_of(mlp(4, width=128, batch=8)),
            lambda: chain_of(transformer(2, d_model=32, nhead=2, seq=16, batch=2)),
            lambda: gpt2_chain(n_layer=2, n_embd=32, n_head=2, seq=16, batch=2, vocab=64),
        ]
    return [lambda: chain_of(mlp(8)), lambda: chain_of(transformer(4)), gpt2_chain]


# ----------------------------------------------------------------------------------------- measure
@dataclass
class PeakPoint:
    """One plan (or compiled budget) on one model: predicted and measured (see the module docstring)."""

    model: str
    method: str  # "none", "peak planner", "planner", "torch.compile"
    budget: float | None  # bytes for the planners; activation_memory_budget for torch.compile
    peak_bytes: int
    retained_bytes: int
    recompute_flops: int
    predicted_peak: int | None = None
    predicted_retained: int | None = None
    predicted_recompute_flops: int | None = None
    grads_ok: bool = True
    ways: str = ""
    note: str = ""

    @property
    def label(self) -> str:
        if self.method == "torch.compile":
            return f"compile {self.budget:g}"
        return self.method if self.method == "none" else f"{self.method} {self.budget / 2**20:.2f} MiB"


@dataclass
class _Measured:
    report: MemoryReport
    cost: int
    grads: list[torch.Tensor | None]


def _leaves(chain: Chain) -> list[torch.Tensor]:
    return [t for t in [chain.input, *chain.params] if t.requires_grad]


def _measure(chain: Chain, run: Callable[[torch.Tensor], torch.Tensor]) -> _Measured:
    """One seeded step of ``chain.loss(run(input))`` under ``measure_memory`` and ``CostCounter``."""
    for t in _leaves(chain):
        t.grad = None

    def forward() -> torch.Tensor:
        torch.manual_seed(SEED)
        return chain.loss(run(chain.input))

    with CostCounter() as cost:
        report = measure_memory(forward)
    grads = [None if t.grad is None else t.grad.detach().clone() for t in _leaves(chain)]
    return _Measured(report, cost.total, grads)


def _same(a: Sequence[torch.Tensor | None], b: Sequence[torch.Tensor | None]) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def _ways(plan: PeakPlan) -> str:
    """``P`` a region run plainly, ``k/n`` checkpointed keeping k of its n candidates."""
    return " ".join("P" if w == "plain" else w.removeprefix("keep ").replace(" of ", "/") for w in plan.ways)


@dataclass
class Sweep:
    """One model's sweep: its points, the equal-recomputation comparisons, the peak planner's
    predicted frontier as (peak, recomputation) pairs, and the profile it was planned from."""

    points: list[PeakPoint]
    comparisons: list[dict[str, Any]]
    frontier: list[tuple[int, float]]
    profile: PeakProfile = field(repr=False)


class _Sweeper:
    """Everything measured on one model, each distinct plan once."""

    def __init__(self, chain: Chain, log: Callable[[str], None]) -> None:
        self.chain, self.log = chain, log
        self.none = _measure(chain, chain.run)
        self.measured: dict[Any, _Measured] = {}
        started = time.perf_counter()
        self.pp: PeakProfile = profile_peak(chain.regions, chain.input, chain.loss)
        self.front = peak_frontier(self.pp)
        ways = sum(map(len, self.pp.ways))
        log(f"  {chain.name}: profiled {ways} ways in {time.perf_counter() - started:.0f} s")

    def _run(self, key: Any, run: Callable[[torch.Tensor], torch.Tensor]) -> _Measured:
        if key not in self.measured:
            self.measured[key] = _measure(self.chain, run)
        return self.measured[key]

    def point(self, method: str, budget: float, plan: PeakPlan, note: str = "") -> PeakPoint:
        # Keyed by what each region keeps: a plan of either planner that keeps the same runs once.
        m = self._run(plan.saved, plan)
        return PeakPoint(
            self.chain.name,
            method,
            budget,
            m.report.peak_bytes,
            m.report.retained_bytes,
            m.cost - self.none.cost,
            plan.predicted_peak,
            plan.predicted_retained,
            round(plan.recompute_cost),
            _same(m.grads, self.none.grads),
            _ways(plan),
            note,
        )


def sweep(
    chain: Chain,
    fractions: Sequence[float] = FRACTIONS,
    compile_budgets: Sequence[float] = COMPILE_BUDGETS,
    log: Callable[[str], None] = lambda message: None,
) -> Sweep:
    """Every point of the sweep on ``chain``, and the equal-recomputation comparisons: for each point
    of the other two, the peak planner's least-peak plan that recomputes no more, measured."""
    s = _Sweeper(chain, log)
    r = s.none.report
    points = [PeakPoint(chain.name, "none", None, r.peak_bytes, r.retained_bytes, 0, grads_ok=True)]
    # (a) the peak planner, from its lowest predicted peak to no checkpointing's.
    n = len(chain.regions)
    low, high = s.front[0].predicted_peak, s.pp.predict([None] * n).peak_bytes
    for fraction in fractions:
        budget = low + round(fraction * (high - low))
        points.append(s.point("peak planner", budget, solve_peak(s.pp, budget), f"{fraction:g} of its range"))
    # (b) the retained-bytes planner, its predicted peak from the same simulation.
    lo_r, hi_r = budget_range(s.pp.profiles)
    for fraction in fractions:
        budget = lo_r + round(fraction * (hi_r - lo_r))
        plan = solve(s.pp.profiles, budget)
        sim = s.pp.predict(plan.saved)
        m = s._run(plan.saved, plan)
        points.append(
            PeakPoint(
                chain.name,
                "planner",
                budget,
                m.report.peak_bytes,
                m.report.retained_bytes,
                m.cost - s.none.cost,
                sim.peak_bytes,
                sim.retained_bytes,
                round(plan.recompute_cost),
                _same(m.grads, s.none.grads),
                " ".join(
                    f"{len(k)}/{len(p.candidates)}" for k, p in zip(plan.saved, plan.profiles, strict=True)
                ),
                f"{fraction:g} of its range; keeps {plan.retained_bytes / 2**20:.2f} MiB (its own terms)",
            )
        )
    log(f"  {chain.name}: both planners measured")
    # (c) torch.compile's budgets.
    if compile_budgets:
        points += _compiled(chain, compile_budgets, log)
    # At equal recomputation: the peak planner's best plan recomputing no more than each other point.
    comparisons = []
    for p in points:
        if p.method not in ("planner", "torch.compile"):
            continue
        affordable = [q for q in s.front if q.recompute_cost <= p.recompute_flops]
        if not affordable:
            comparisons.append({"other": p.label, "model": chain.name, "ours": None})
            continue
        best = min(affordable, key=lambda q: (q.predicted_peak, q.recompute_cost))
        ours = s.point("peak planner", best.predicted_peak, best, "at equal recomputation")
        comparisons.append({"other": p.label, "model": chain.name, "ours": asdict(ours), "theirs": asdict(p)})
    frontier = [(q.predicted_peak, q.recompute_cost) for q in s.front]
    return Sweep(points, comparisons, frontier, s.pp)


def _compiled(chain: Chain, budgets: Sequence[float], log: Callable[[str], None]) -> list[PeakPoint]:
    from ckpt_lab.compiled import compile_step

    steps = {}
    for budget in sorted(budgets, reverse=True):
        started = time.perf_counter()
        steps[budget] = compile_step(
            chain.step, chain.input, budget=budget, params=chain.params, check=False, loss=None
        )
        log(f"  {chain.name}: torch.compile budget {budget:g} in {time.perf_counter() - started:.0f} s")
    reference = steps.get(1.0) or compile_step(
        chain.step, chain.input, budget=1.0, params=chain.params, check=False, loss=None
    )
    points = []
    for budget in budgets:
        step = steps[budget]
        ok = all(
            (a is None and b is None) or torch.allclose(a, b, rtol=1e-4, atol=1e-6)
            for a, b in zip(step.grads, reference.grads, strict=True)
        )
        note = f"{len(step.saved)} saved, {len(step.recomputed)} ops recomputed"
        if not step.measured:
            note += "; NOT MEASURED (higher-order ops in the graph)"
        points.append(
            PeakPoint(
                chain.name,
                "torch.compile",
                budget,
                step.peak_bytes,
                step.retained_bytes,
                step.recompute_flops,
                grads_ok=ok,
                note=note if ok else note + "; gradients differ from budget 1 (dropout redrawn)",
            )
        )
    return points


# ----------------------------------------------------------------------------------------- targets
def check_targets(points: Sequence[PeakPoint], comparisons: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets of the module docstring, each with its figure: PASS or MISS, never hidden."""
    checks = []

    def add(model: str, target: str, ok: bool, figure: str) -> None:
        checks.append({"model": model, "target": target, "ok": ok, "figure": figure})

    names = list(dict.fromkeys(p.model for p in points))
    for model in names:
        mine = [p for p in points if p.model == model]
        for method in ("peak planner", "planner"):
            rows = [p for p in mine if p.method == method and p.predicted_peak]
            worst = max(
                rows, key=lambda p: abs(p.peak_bytes - p.predicted_peak) / p.predicted_peak, default=None
            )
            if worst is not None:
                err = abs(worst.peak_bytes - worst.predicted_peak) / worst.predicted_peak
                add(
                    model,
                    f"{method}: measured peak within {TOLERANCE:.0%} of the prediction at every point",
                    err <= TOLERANCE,
                    f"worst {err:.3%} ({worst.peak_bytes:,} vs {worst.predicted_peak:,} B predicted)",
                )
        for method in ("peak planner", "planner", "torch.compile"):
            rows = sorted((p for p in mine if p.method == method), key=lambda p: -p.budget)
            if len(rows) < 2:
                continue
            rises = [(a, b) for a, b in itertools.pairwise(rows) if b.peak_bytes > a.peak_bytes]
            peaks = ", ".join(f"{_budget(p)}: {p.peak_bytes / 2**20:.2f}" for p in rows)
            target = f"{method}: measured peak never rises as the budget falls"
            if method == "torch.compile":
                target += " (pytorch/pytorch#197838 " + ("shown" if rises else "not shown") + ")"
            add(model, target, not rises, f"MiB by budget: {peaks}")
        for c in (c for c in comparisons if c["model"] == model):
            theirs = c.get("theirs")
            if c["ours"] is None:
                add(
                    model,
                    f"at equal recomputation: peak planner <= {c['other']}",
                    False,
                    "no plan recomputes that little",
                )
                continue
            ours = c["ours"]
            ok = ours["peak_bytes"] <= theirs["peak_bytes"]
            figure = (
                f"{ours['peak_bytes'] / 2**20:.2f} vs {theirs['peak_bytes'] / 2**20:.2f} MiB at "
                f"{ours['recompute_flops'] / 1e9:.4f} vs {theirs['recompute_flops'] / 1e9:.4f} GFLOP"
            )
            if not ok:
                figure += "; " + _why(theirs)
            add(model, f"at equal recomputation: peak planner <= {c['other']}", ok, figure)
    return checks


def _budget(p: PeakPoint) -> str:
    return f"{p.budget:g}" if p.method == "torch.compile" else f"{p.budget / 2**20:.1f}M"


def _why(theirs: dict[str, Any]) -> str:
    if theirs["method"] == "torch.compile":
        why = (
            "the compiler is not tied to regions: it recomputes pointwise ops across block boundaries and "
            "keeps dropout's 1-byte mask where an eager region keeps a 4-byte one"
        )
        return why + ("" if theirs["grads_ok"] else "; and its gradients are wrong here (dropout redrawn)")
    return "the peak planner's menu offers per region only sets on its retained-bytes frontier"


# ------------------------------------------------------------------------------------- table, plot
def table(points: Sequence[PeakPoint]) -> str:
    lines = [
        f"{'point':26} {'peak MiB':>9} {'predicted':>9} {'retained MiB':>12} {'recompute GFLOP':>15} "
        f"{'grads':>5}  ways / note"
    ]
    for p in points:
        pred = f"{p.predicted_peak / 2**20:9.3f}" if p.predicted_peak is not None else f"{'-':>9}"
        lines.append(
            f"{p.label:26} {p.peak_bytes / 2**20:9.3f} {pred} {p.retained_bytes / 2**20:12.3f} "
            f"{p.recompute_flops / 1e9:15.4f} {'ok' if p.grads_ok else 'WRONG':>5}  {p.ways or p.note}"
        )
    return "\n".join(lines)


def markdown(points: Sequence[PeakPoint]) -> str:
    """The peak sweep's table on the site (docs/results/generated/peak_table.md): per model and method,
    the measured peak (MiB) and the recomputed GFLOP at each budget, largest budget first; a compiled
    budget with wrong gradients in italics."""
    lines = [
        "| model | method (budgets, largest first) | measured peak MiB (recomputed GFLOP) |",
        "|---|---|---|",
    ]
    for model in dict.fromkeys(p.model for p in points):
        none = next(p for p in points if p.model == model and p.method == "none")
        lines.append(f"| {model} | no checkpointing | {none.peak_bytes / 2**20:.2f} (0) |")
        for method in ("peak planner", "planner", "torch.compile"):
            rows = sorted(
                (p for p in points if p.model == model and p.method == method), key=lambda p: -p.budget
            )
            if not rows:
                continue
            cells = []
            for p in rows:
                cell = f"{p.peak_bytes / 2**20:.2f} ({_gflop(p.recompute_flops)})"
                cells.append(cell if p.grads_ok else f"*{cell}*")
            if method == "torch.compile":
                what = "torch.compile " + ", ".join(f"{p.budget:g}" for p in rows)
            else:
                what = f"{method}, {len(rows)} budgets"
            lines.append(f"| {model} | {what} | {' · '.join(cells)} |")
    return "\n".join(lines)


def _gflop(flops: int) -> str:
    return "0" if flops == 0 else f"{flops / 1e9:.3g}"


_STYLE = {
    "peak planner": dict(marker="o", color="tab:blue", s=45, zorder=4),
    "planner": dict(marker="x", color="tab:orange", s=55, zorder=4),
    "torch.compile": dict(marker="^", color="tab:gray", s=55, zorder=5),
    "none": dict(marker="*", color="black", s=150, zorder=6),
}
_SHORT = {
    "peak planner": "peak planner",
    "planner": "retained-bytes planner",
    "torch.compile": "torch.compile",
}
_LABEL = {
    "peak planner": "peak planner (budget: the peak), measured",
    "planner": "retained-bytes planner, measured",
    "torch.compile": "torch.compile activation_memory_budget, measured (number = budget)",
    "none": "no checkpointing",
}


def plot(
    points: Sequence[PeakPoint], frontiers: dict[str, list[tuple[int, float]]], path: Path | str | None = None
) -> Any:
    """Top: measured peak against recomputation per model, the peak planner's predicted frontier as
    a line. Bottom: each method's measured peak as its budget falls (left to right)."""
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(p.model for p in points))
    fig, axes = plt.subplots(2, len(names), figsize=(5.4 * len(names), 8.2), squeeze=False)
    for col, name in enumerate(names):
        ax, low = axes[0][col], axes[1][col]
        curve = frontiers.get(name, [])
        if curve:
            xs, ys = zip(*sorted(curve), strict=True)
            ax.plot([x / 2**20 for x in xs], [y / 1e9 for y in ys], drawstyle="steps-post", color="tab:blue",
                    alpha=0.4, lw=1.5, label="peak planner, predicted frontier")  # fmt: skip
        mine = [p for p in points if p.model == name]
        labelled: set[str] = set()
        for p in mine:
            style = dict(_STYLE[p.method])
            if p.method == "torch.compile" and not p.grads_ok:
                style.update(facecolors="none", edgecolors="tab:gray")
                style.pop("color")
            label = _LABEL[p.method] if p.method not in labelled else None
            labelled.add(p.method)
            ax.scatter([p.peak_bytes / 2**20], [p.recompute_flops / 1e9], label=label, **style)
            if p.method == "torch.compile":
                ax.annotate(f"{p.budget:g}", (p.peak_bytes / 2**20, p.recompute_flops / 1e9), xytext=(4, -9),
                            textcoords="offset points", fontsize=7, color="dimgray")  # fmt: skip
        ys = [p.recompute_flops / 1e9 for p in mine] + [y / 1e9 for _, y in curve]
        lo = math.floor(math.log10(min((y for y in ys if y > 0), default=1.0)))
        ax.set_yscale("symlog", linthresh=10.0**lo, linscale=0.5)
        ax.set_xlabel("measured peak (MiB), gradients left out")
        ax.set_ylabel("recomputed per step (GFLOP)")
        ax.set_title(name)
        ax.grid(alpha=0.3, which="both")
        for method in ("peak planner", "planner", "torch.compile"):
            rows = sorted((p for p in mine if p.method == method), key=lambda p: -p.budget)
            if rows:
                xs = [i / max(1, len(rows) - 1) for i in range(len(rows))]
                low.plot(xs, [p.peak_bytes / 2**20 for p in rows], marker=_STYLE[method]["marker"],
                         color=_STYLE[method]["color"], label=_SHORT[method])  # fmt: skip
        none = next((p for p in mine if p.method == "none"), None)
        if none is not None:
            low.axhline(none.peak_bytes / 2**20, color="black", lw=0.8, ls=":", label="no checkpointing")
        low.set_title("measured peak as the budget falls", fontsize=9)
        low.set_xlabel("budget, from the largest (left) to the smallest (right) of each sweep")
        low.set_ylabel("measured peak (MiB)")
        low.grid(alpha=0.3)
    # Hollow triangles: the compiled budgets whose gradients are wrong (dropout redrawn in backward).
    axes[0][-1].scatter([], [], marker="^", s=55, facecolors="none", edgecolors="tab:gray",
                        label="torch.compile, wrong gradients (dropout redrawn)")  # fmt: skip
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="upper center", ncol=3, fontsize=8, frameon=False, bbox_to_anchor=(0.5, 1.02)
    )
    axes[1][-1].legend(fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100, bbox_inches="tight")
    return fig


# -------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None, chains: Callable[[bool], list[Callable[[], Chain]]] = models) -> int:
    """The CLI; ``chains`` lets tests run it on tiny models."""
    parser = argparse.ArgumentParser(
        prog="python -m ckpt_lab.bench.peak", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--out", type=Path, default=Path("results"), help="folder for peak.json and the picture"
    )
    parser.add_argument(
        "--refresh-site",
        "--refresh-readme",  # its name before the results moved to the site
        dest="refresh_site",
        action="store_true",
        help="write the picture into images/ and the table into docs/results/generated/peak_table.md "
        "(the site's frontier page)",
    )
    parser.add_argument("--quick", action="store_true", help="small models of each kind (a smoke test)")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile's budgets out")
    args = parser.parse_args(argv)
    if args.refresh_site and args.quick:
        parser.error("--refresh-site writes the site's picture and table: run it without --quick")
    started = time.perf_counter()
    points: list[PeakPoint] = []
    comparisons: list[dict[str, Any]] = []
    frontiers: dict[str, list[tuple[int, float]]] = {}

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    for make in chains(args.quick):
        chain = make()
        log(f"{chain.name}: {len(chain.regions)} regions and the loss")
        result = sweep(chain, compile_budgets=() if args.no_compile else COMPILE_BUDGETS, log=log)
        points += result.points
        comparisons += result.comparisons
        frontiers[chain.name] = result.frontier
        print(f"{chain.name}\n{table(result.points)}\n")
    seconds = time.perf_counter() - started
    targets = check_targets(points, comparisons)
    for check in targets:
        print(
            f"{'PASS' if check['ok'] else 'MISS'}  {check['model']:14} {check['target']}: {check['figure']}"
        )
    images = in_checkout("images") if args.refresh_site else args.out
    picture = images / "peak_sweep.png"
    plot(points, frontiers, picture)
    report = {
        "meta": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "seconds": round(seconds),
            "quick": args.quick,
        },
        "points": [asdict(p) for p in points],
        "comparisons": comparisons,
        "frontiers": frontiers,
        "targets": targets,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peak.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (args.out / "peak.md").write_text(markdown(points) + "\n")
    if args.refresh_site:
        in_checkout("docs", "results", "generated", "peak_table.md").write_text(markdown(points) + "\n")
    print(f"\nsweep: {seconds:.0f} s; plot: {picture}; results and table: {args.out}/peak.json, peak.md")
    wrong = [f"{p.model}/{p.label}" for p in points if not p.grads_ok and p.method != "torch.compile"]
    if wrong:
        print("FAILED (gradients differ from no checkpointing): " + ", ".join(wrong), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
