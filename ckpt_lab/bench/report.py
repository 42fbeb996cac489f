"""The benchmark's report: a plain-text table, the results page's Markdown table, and two plots (retained
memory against depth, and the memory-time trade-off)."""

from __future__ import annotations

import math
from pathlib import Path

from ckpt_lab.bench.measure import Result

__all__ = ["FAMILIES", "markdown", "plot", "table"]


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


# The results page's table shows the deepest stack of each family, in this order.
FAMILIES = ("mlp", "transformer", "pointwise", "chain")


def markdown(results: list[Result]) -> str:
    """The benchmark page's table (docs/results/benchmark.md includes it): the deepest workload of each
    family, every strategy in the order it ran; a row whose gradients differ from no checkpointing says so
    (only torch.compile's budgets below 1 have one: dropout redrawn)."""
    deepest = {}
    for r in results:
        deepest[r.family] = max(deepest.get(r.family, 0), r.depth)
    lines = [
        "| workload | strategy | retained MiB | peak MiB | GFLOP | time / none |",
        "|---|---|---|---|---|---|",
    ]
    families = [f for f in FAMILIES if f in deepest] + sorted(set(deepest) - set(FAMILIES))
    for family in families:
        for r in results:
            if r.family != family or r.depth != deepest[family]:
                continue
            strategy = r.strategy if r.grad_ok else f"{r.strategy} (wrong gradients: dropout redrawn)"
            lines.append(
                f"| {r.workload} | {strategy} | {r.retained_bytes / 2**20:.2f} | {r.peak_bytes / 2**20:.2f} "
                f"| {r.flops / 1e9:.1f} | {r.time_vs_none:.2f}× |"
            )
    return "\n".join(lines)


def plot(results: list[Result], images: Path) -> list[Path]:
    """Retained memory against depth (with a sqrt(N) guide), and the memory-time trade-off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images.mkdir(parents=True, exist_ok=True)
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
    markers = {"none": "*", "torch": "s", "ckpt": "o", "returnn": "^", "remat": "D", "floor": "x"}
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
