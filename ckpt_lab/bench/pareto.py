"""Retained memory against recomputation: every strategy as one point, the planner as a curve.

Introduced in notebook 05. Each strategy of the earlier notebooks trades memory for compute at one
fixed point; the planner (``ckpt_lab.planner``) can be asked for any budget in between. This module
puts them on one picture, for a transformer stack and an MLP stack:

    python -m ckpt_lab.bench.pareto [--out DIR] [--json PATH]   # about 40 s on 2 cores
    python -m ckpt_lab.bench.pareto --refresh-site            # rewrite images/05_pareto.png (make pareto)
    python -m ckpt_lab.bench.pareto --compile                 # add torch.compile's budget sweep (+1 min)

With ``--compile`` (``measure_points(..., compiled=True)``, off by default: compiling is slow) each
workload also gets torch.compile's points at ``activation_memory_budget`` 0 ... 1
(``ckpt_lab.compiled.compiled_points``, notebook 08): bytes the compiled forward saves plus the
first block's input, and the FLOPs of the forward ops its backward graph runs again.

Both axes are exact counts, identical on every run and machine:

* **retained bytes**: the activation memory kept between forward and backward, *counting the first
  block's input* -- the planner's own definition, so that a measured point can be compared with a
  budget. ``measure_memory`` counts storages created during the forward that are still alive when it
  ends; that includes the final output (square's saved input) and the 4-byte loss, and leaves out
  the input (it existed before). So ``retained = measured - bytes(output) - bytes(loss) + bytes(x)``.
* **recomputed FLOPs**: ``instruments.flops.CostCounter``'s total for forward + backward with the
  strategy, minus the same total without checkpointing. The counter's cost model is the planner's (torch's
  FLOPs for matmuls, one per output element for other ops, 0 for views), so measured and predicted
  costs are in the same unit.

Every run is seeded identically (dropout draws the same masks), and its gradients are compared with
those of the run without checkpointing, bit for bit.

CPU offload is the odd one out: it recomputes nothing and keeps nothing on the accelerator but the
input; it moves every saved activation to host memory instead. On a machine without an accelerator
it runs as a dry run (``include_cpu_tensors=True``): the copies are made and counted, and the point
is placed at what would stay on the device (``measured - bytes moved - bytes(loss) + bytes(x)``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt_lab.bench.workloads import Workload, mlp, transformer
from ckpt_lab.helpers import in_checkout
from ckpt_lab.instruments.flops import CostCounter
from ckpt_lab.instruments.memory import measure_memory
from ckpt_lab.offload import offload_to_cpu
from ckpt_lab.planner import frontier
from ckpt_lab.strategies import REGISTRY, StackRun, planner_range, sqrt_segments

__all__ = [
    "FRACTIONS",
    "Point",
    "compiled_pareto_points",
    "exact_frontier",
    "main",
    "measure_points",
    "plot",
    "table",
]

# Where the planner's budgets lie between the smallest useful one (the blocks' inputs) and the largest.
FRACTIONS = (0, 0.1, 0.25, 0.5, 0.75, 1.0)
# The same seed before every run: the same dropout masks, so gradients can be compared bit for bit.
SEED = 1
# The fixed strategies: how this picture labels them, and their names in the registry.
_FIXED = {
    "none": "none",
    "per-block": "ckpt-nonreentrant",
    "sqrt(N)": "ckpt-sequential-sqrt",
    "torch SAC (matmuls)": "torch-sac-matmul",
    "ckpt SAC (matmuls)": "ckpt-sac-matmul",
}


@dataclass
class Point:
    """One strategy on one workload: what it keeps and what it recomputes (both measured)."""

    strategy: str
    retained_bytes: int
    recompute_flops: int
    budget: int | None = None
    note: str = ""
    grads_ok: bool = True
    # Planner points: the plan's predictions, to compare with the measured numbers above.
    predicted_retained_bytes: int | None = None
    predicted_recompute_flops: int | None = None

    @property
    def within_budget(self) -> bool | None:
        return None if self.budget is None else self.retained_bytes <= self.budget

    @property
    def as_planned(self) -> bool | None:
        """Did the measurement match the plan's prediction exactly (planner points only)?"""
        if self.predicted_retained_bytes is None:
            return None
        return (self.retained_bytes, self.recompute_flops) == (
            self.predicted_retained_bytes,
            self.predicted_recompute_flops,
        )


@dataclass
class _Measured:
    retained: int
    cost: int
    grads: list[torch.Tensor]
    # CPU offload only: bytes copied to the host in the forward.
    moved: int = 0


def _measure(wl: Workload, run: StackRun, offload: bool = False) -> _Measured:
    """One seeded forward + backward: retained bytes (planner terms), CostCounter total, gradients."""
    sizes: dict[str, Any] = {}

    def forward() -> torch.Tensor:
        torch.manual_seed(SEED)
        # A dry run on CPU: CPU tensors are copied too, so the mechanism and its bytes are real.
        hooks = offload_to_cpu(include_cpu_tensors=True) if offload else nullcontext()
        with hooks:
            out = run(wl.blocks, wl.input)
            loss = out.square().mean()
        # Sizes only: holding ``out`` here would keep it alive where nothing else does (offload).
        sizes.update(out=out.untyped_storage().nbytes(), loss=loss.untyped_storage().nbytes(), hooks=hooks)
        return loss

    for t in [wl.input, *wl.parameters()]:
        t.grad = None
    with CostCounter() as cost:
        report = measure_memory(forward)
    grads = [t.grad.detach().clone() for t in [wl.input, *wl.parameters()]]
    moved = sizes["hooks"].bytes_moved if offload else 0
    # Offloaded, the final output's only reference is its CPU copy, which is among the bytes moved.
    not_activations = (moved if offload else sizes["out"]) + sizes["loss"]
    retained = report.retained_bytes - not_activations + wl.input.untyped_storage().nbytes()
    return _Measured(retained, cost.total, grads, moved)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def measure_points(
    workload: Workload, budgets_fractions: Sequence[float] = FRACTIONS, compiled: bool = False
) -> list[Point]:
    """Measure every strategy on ``workload``: the fixed ones, the planner (DP and greedy) at each
    budget fraction, CPU offload, and with ``compiled`` torch.compile's memory budgets. See the
    module docstring for what the numbers mean."""
    wl = workload
    runs = {name: s.run for name, s in REGISTRY.items()}
    baseline = _measure(wl, runs["none"])

    def point(name: str, m: _Measured, **fields: Any) -> Point:
        ok = _same(m.grads, baseline.grads)
        return Point(name, m.retained, m.cost - baseline.cost, grads_ok=ok, **fields)

    points = [
        point(name, baseline if name == "none" else _measure(wl, runs[bench_name]))
        for name, bench_name in _FIXED.items()
    ]
    segments = sqrt_segments(len(wl.blocks))
    # With one segment checkpoint_sequential checkpoints nothing (the last segment runs plainly).
    sqrt_point = next(p for p in points if p.strategy == "sqrt(N)")
    sqrt_point.note = f"{segments} segment{'s' if segments > 1 else ': nothing checkpointed'}"

    planner = planner_range(wl.blocks, wl.input)
    measured: dict[tuple[frozenset[int], ...], _Measured] = {}
    for method in ("dp", "greedy"):
        for fraction in budgets_fractions:
            plan = planner.plan(fraction, method)
            # Plans that keep the same ops run the same computation: measure each once.
            if plan.saved not in measured:
                measured[plan.saved] = _measure(wl, lambda blocks, x, plan=plan: plan(x))
            points.append(
                point(
                    f"planner {method} {fraction:g}",
                    measured[plan.saved],
                    budget=plan.budget,
                    note=f"keeps {len(plan.saved_ops)} op output{'' if len(plan.saved_ops) == 1 else 's'}",
                    predicted_retained_bytes=plan.retained_bytes,
                    # The FLOP cost model counts whole FLOPs; the planner sums them as a float.
                    predicted_recompute_flops=int(plan.recompute_cost),
                )
            )

    m = _measure(wl, runs["none"], offload=True)
    points.append(
        Point(
            "CPU offload",
            m.retained,
            # Nothing is recomputed; the copies to the host and back are transfers, not FLOPs.
            0,
            note=f"moves {m.moved / 2**20:.2f} MiB to host (CPU dry run)",
            grads_ok=_same(m.grads, baseline.grads),
        )
    )
    if compiled:
        points += compiled_pareto_points(wl)
    return points


def compiled_pareto_points(workload: Workload) -> list[Point]:
    """torch.compile's budget sweep (``ckpt_lab.compiled.compiled_points``, notebook 08) as this
    picture's points. The compiler's module returns records of its own; the harness converts them."""
    from ckpt_lab.compiled import compiled_points

    points = []
    for b in compiled_points(workload):
        note = f"{b.saved} saved, {b.recomputed} ops recomputed"
        if not b.grads_ok:
            note += "; gradients differ from budget 1 (random ops recomputed: see ckpt_lab.compiled)"
        points.append(
            Point(
                f"compiled {b.budget:g}", b.retained_bytes, b.recompute_flops, note=note, grads_ok=b.grads_ok
            )
        )
    return points


def exact_frontier(workload: Workload, n: int = 40) -> list[tuple[int, float]]:
    """The planner's predicted (retained bytes, recompute FLOPs) at ``n`` budgets from min to max (DP)."""
    if n < 2:
        raise ValueError(f"exact_frontier: n must be at least 2 (the smallest and largest budgets), not {n}.")
    planner = planner_range(workload.blocks, workload.input)
    budgets = [planner.budget(i / (n - 1)) for i in range(n)]
    return frontier(planner.profiles, budgets, "dp")


# ------------------------------------------------------------------------------------------------ plot
_MARKERS = {
    "none": dict(marker="*", s=160, color="black"),
    # Hollow where a planner point may sit on top (per-block is the plan at the smallest budget).
    "per-block": dict(marker="s", s=150, facecolors="none", edgecolors="tab:red", linewidths=1.5),
    "sqrt(N)": dict(marker="D", s=55, color="tab:purple"),
    # Two SACs measure the same: a large hollow marker around a small filled one shows both.
    "torch SAC (matmuls)": dict(marker="o", s=150, facecolors="none", edgecolors="tab:green", linewidths=1.5),
    "ckpt SAC (matmuls)": dict(marker="o", s=30, color="tab:green"),
    "planner dp": dict(marker="o", s=60, color="tab:blue", zorder=3),
    "planner greedy": dict(marker="x", s=60, color="tab:orange", zorder=4),
    "CPU offload": dict(marker="P", s=110, color="tab:brown"),
    # torch.compile's budgets: hollow where its gradients are wrong (ckpt_lab.compiled's NOTE).
    "compiled": dict(marker="^", s=60, color="tab:gray", zorder=5),
    "compiled, wrong gradients": dict(marker="^", s=60, facecolors="none", edgecolors="tab:gray", zorder=5),
}


def plot(
    points_by_workload: dict[str, list[Point]],
    frontiers: dict[str, list[tuple[int, float]]],
    path: Path | str | None = None,
) -> Any:
    """One panel per workload: x = retained MiB, y = recomputed GFLOP (symlog: "none" recomputes 0).

    Returns the matplotlib figure; saves it to ``path`` when given.
    """
    # Imported here: measuring needs no matplotlib (without a display it picks a file-only backend).
    import matplotlib.pyplot as plt

    names = list(points_by_workload)
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.6), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        curve = frontiers.get(name, [])
        if curve:
            xs, ys = zip(*sorted(curve), strict=True)
            # A budget buys the same plan until the next one fits: the exact frontier is a staircase.
            ax.plot(
                [x / 2**20 for x in xs],
                [y / 1e9 for y in ys],
                drawstyle="steps-post",
                color="tab:blue",
                alpha=0.45,
                lw=1.5,
                label="planner DP, predicted frontier",
            )
        labelled: set[str] = set()
        for p in points_by_workload[name]:
            key = (
                p.strategy.rsplit(" ", 1)[0] if p.strategy.startswith(("planner", "compiled")) else p.strategy
            )
            if key == "compiled" and not p.grads_ok:
                key = "compiled, wrong gradients"
            x, y = p.retained_bytes / 2**20, p.recompute_flops / 1e9
            label = {
                "planner dp": "planner DP, measured",
                "planner greedy": "planner greedy, measured",
                "compiled": "torch.compile budgets (aot_eager_decomp_partition), number = budget",
                "compiled, wrong gradients": "torch.compile budgets, wrong gradients (dropout redrawn)",
            }.get(key, p.strategy)
            ax.scatter([x], [y], label=None if key in labelled else label, **_MARKERS.get(key, {}))
            labelled.add(key)
            if key.startswith("compiled"):  # its budget, to match the point with the table
                ax.annotate(
                    p.strategy.rsplit(" ", 1)[1],
                    (x, y),
                    xytext=(5, -10),
                    textcoords="offset points",
                    fontsize=7,
                    color="dimgray",
                )
            if p.strategy == "CPU offload":
                ax.annotate(
                    p.note.replace(" to host", "\nto host"),
                    (x, y),
                    xytext=(12, 18),
                    textcoords="offset points",
                    fontsize=7,
                    arrowprops=dict(arrowstyle="-", lw=0.6),
                )
        ys = [p.recompute_flops / 1e9 for p in points_by_workload[name]] + [y / 1e9 for _, y in curve]
        low = math.floor(math.log10(min((y for y in ys if y > 0), default=1.0)))
        high = math.ceil(math.log10(max(ys, default=1.0)))
        # Logarithmic from the decade below the smallest nonzero cost, linear down to 0 (where "none"
        # and offload sit); ticks at 0 and each decade, so none of them crowd the linear part.
        ax.set_yscale("symlog", linthresh=10.0**low, linscale=0.5)
        ax.set_yticks([0.0] + [10.0**k for k in range(low, high + 1)])
        # The top decade's tick may lie far above the data: stop just above the highest point.
        ax.set_ylim(top=max(ys, default=1.0) * 2)
        ax.set_xlabel("retained between forward and backward (MiB)")
        ax.set_ylabel("recomputed per step (GFLOP, planner cost model)")
        ax.set_title(name)
        ax.grid(alpha=0.3, which="both")
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100, bbox_inches="tight")
    return fig


# ------------------------------------------------------------------------------------------------ main
def _yes(flag: bool | None) -> str:
    return "-" if flag is None else ("yes" if flag else "NO")


def table(points: list[Point]) -> str:
    """A plain-text table of one workload's points."""
    lines = [
        f"{'strategy':22} {'retained MiB':>12} {'recompute GFLOP':>15} {'budget MiB':>10} "
        f"{'within':>6} {'as planned':>10} {'grads':>5}  note"
    ]
    for p in points:
        budget = f"{p.budget / 2**20:10.3f}" if p.budget is not None else f"{'-':>10}"
        grads = "ok" if p.grads_ok else "FAIL"
        lines.append(
            f"{p.strategy:22} {p.retained_bytes / 2**20:12.3f} {p.recompute_flops / 1e9:15.4f} {budget} "
            f"{_yes(p.within_budget):>6} {_yes(p.as_planned):>10} {grads:>5}  {p.note}"
        )
    return "\n".join(lines)


def _default_workloads() -> list[Workload]:
    return [transformer(4), mlp(8)]


def main(argv: list[str] | None = None, workloads: Callable[[], list[Workload]] = _default_workloads) -> int:
    """The CLI; ``workloads`` lets tests run it on small stacks."""
    parser = argparse.ArgumentParser(
        prog="python -m ckpt_lab.bench.pareto", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=Path("results"), help="where 05_pareto.png goes")
    parser.add_argument(
        "--refresh-site",
        "--refresh-readme",  # its name before the results moved to the site
        dest="refresh_site",
        action="store_true",
        help="rewrite images/05_pareto.png (the site's frontier page shows it)",
    )
    parser.add_argument("--json", type=Path, help="also write the points and frontiers here")
    parser.add_argument(
        "--compile", action="store_true", help="add torch.compile's activation_memory_budget points (slow)"
    )
    args = parser.parse_args(argv)
    images = in_checkout("images") if args.refresh_site else args.out

    points: dict[str, list[Point]] = {}
    frontiers: dict[str, list[tuple[int, float]]] = {}
    for wl in workloads():
        points[wl.name] = measure_points(wl, compiled=args.compile)
        frontiers[wl.name] = exact_frontier(wl)
        x = wl.input.untyped_storage().nbytes()
        print(f"{wl.name} ({wl.depth} blocks, input {x / 2**20:.3f} MiB)")
        print(table(points[wl.name]))
        print()
    path = images / "05_pareto.png"
    plot(points, frontiers, path)
    print(f"plot: {path}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"torch": torch.__version__, "workloads": {}}
        for name, pts in points.items():
            report["workloads"][name] = {"points": [asdict(p) for p in pts], "frontier": frontiers[name]}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"results: {args.json}")
    broken = [
        f"{name}/{p.strategy}"
        for name, pts in points.items()
        for p in pts
        # torch.compile's wrong gradients are torch's (ckpt_lab.compiled's NOTE), shown, not failed on.
        if (not p.grads_ok and not p.strategy.startswith("compiled")) or p.within_budget is False
    ]
    if broken:
        print("FAILED (over budget or gradients differ): " + ", ".join(broken), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
