"""Benchmark: every checkpointing strategy side by side, in one process.

    python -m ckpt_lab.bench --quick          # small workloads, about a minute on 2 cores
    python -m ckpt_lab.bench                  # the benchmark page's workloads (about 9 minutes)
    python -m ckpt_lab.bench --refresh-site   # the same, and rewrite the benchmark page's table and figures
    python -m ckpt_lab.bench --compile        # also torch.compile's memory budgets (notebook 08)

Results and plots go to ``results/`` (ignored by git), or to ``--out DIR``; only ``--refresh-site`` (make
bench) writes into the checkout: ``bench/results.json``, ``images/bench_*.png`` and the site's table,
``docs/results/generated/benchmark_table.md`` (the benchmark page, docs/results/benchmark.md, includes
it). The run fails (exit 1) if any strategy's gradients differ from no checkpointing, or if a strategy
of ours or torch's leaves global state behind.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ckpt_lab.bench.measure import Result, run
from ckpt_lab.bench.report import markdown, plot, table
from ckpt_lab.helpers import in_checkout


def _compiled(quick: bool, device: str) -> dict[str, list[dict]]:
    """torch.compile's budget sweep on the suite's MLP and transformer stacks, as Pareto points
    (``ckpt_lab.compiled.compiled_points``, converted by ``bench.pareto``: backend
    aot_eager_decomp_partition; bytes and FLOPs)."""
    from dataclasses import asdict

    from ckpt_lab.bench.pareto import compiled_pareto_points
    from ckpt_lab.bench.pareto import table as points_table
    from ckpt_lab.bench.workloads import suite

    found = {}
    for wl in suite(quick, device):
        if wl.family in ("mlp", "transformer"):
            points = compiled_pareto_points(wl)
            print(f"\ntorch.compile, {wl.name} (aot_eager_decomp_partition):\n{points_table(points)}")
            found[wl.name] = [asdict(p) for p in points]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckpt_lab.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small workloads, under a minute on 2 cores")
    parser.add_argument("--rounds", type=int, help="timing rounds (default 7, quick 3)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for results and plots")
    parser.add_argument(
        "--refresh-site",
        "--refresh-readme",  # its name before the results moved to the site
        dest="refresh_site",
        action="store_true",
        help="write bench/results.json, images/bench_*.png and docs/results/generated/benchmark_table.md in "
        "the checkout (the site's benchmark page)",
    )
    parser.add_argument("--json", type=Path, help="write the results to this file instead")
    parser.add_argument("--images", type=Path, help="write the plots to this folder instead")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--strategies", help="comma-separated names to run (none is always included)")
    parser.add_argument(
        "--no-returnn", action="store_true", help="leave RETURNN's scope out even if installed"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="add torch.compile's activation_memory_budget: table rows at 1, 0.5, 0 for every workload, and "
        "Pareto points at 0 ... 1 for the MLP and transformer stacks (ckpt_lab.compiled; slower)",
    )
    args = parser.parse_args(argv)
    if args.refresh_site and args.quick:
        parser.error("--refresh-site writes the benchmark page's table and figures: run it without --quick")

    name = "results-quick.json" if args.quick else "results.json"
    if args.refresh_site:
        default_json, default_images = in_checkout("bench", name), in_checkout("images")
    else:
        default_json, default_images = args.out / name, args.out
    only = args.strategies.split(",") if args.strategies else None
    report = run(args.quick, args.rounds, args.device, include_returnn=not args.no_returnn, only=only)
    if args.compile:
        from dataclasses import asdict

        from ckpt_lab.bench.workloads import suite
        from ckpt_lab.compiled import BACKEND, compiled_results

        rows = []
        for wl in suite(args.quick, args.device):
            print(f"{wl.name}: torch.compile budgets ({BACKEND})", file=sys.stderr, flush=True)
            # ckpt_lab.compiled returns records of its own; the benchmark's rows are built here.
            rows += [
                Result(
                    wl.name,
                    wl.family,
                    wl.depth,
                    f"compiled-budget-{r.budget:g}",
                    None,
                    retained_bytes=r.retained_bytes,
                    peak_bytes=r.peak_bytes,
                    flops=r.flops,
                    aten_ops=r.aten_ops,
                    grad_ok=r.grads_ok,
                    seconds=r.seconds,
                    time_vs_none=r.time_vs_none,
                    activation_bytes=r.activation_bytes,
                )
                for r in compiled_results(wl, rounds=report["meta"]["rounds"])
            ]
        report["meta"]["compile_backend"] = BACKEND
        report["results"] += [asdict(r) | {"samples": None} for r in rows]
        report["results"] = [{k: v for k, v in r.items() if k != "samples"} for r in report["results"]]
        report["results"].sort(key=lambda r: (r["family"], r["depth"]))
    results = [Result(**r) for r in report["results"]]
    print(table(results))
    if args.compile:
        report["compiled"] = _compiled(args.quick, args.device)
    if report.get("floor"):
        # The scope's cost as floor + x (per-round ratios to torch's non-reentrant checkpoint).
        print("\nthe scope against its floor (torch non-reentrant + an empty dispatch mode), in time")
        print("per round of torch's non-reentrant checkpoint (medians):")
        for line in report["floor"]:
            print(
                f"  {line['workload']:15} floor {line['floor']:.2f}x, scope {line['scope']:.2f}x "
                f"= floor + {line['x']:+.2f}"
            )
    print()
    for check in report["targets"]:
        verdict = "PASS" if check["ok"] else "MISS"
        print(f"{verdict}  {check['workload']:15} {check['target']}: {check['figure']}")
    if not report["meta"]["returnn"]:
        print(
            "returnn-scope: absent (pip install returnn to compare with RETURNN's gradient_checkpoint_scope)"
        )
    out = args.json or default_json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nresults: {out}")
    if args.refresh_site:
        page = in_checkout("docs", "results", "generated", "benchmark_table.md")
        page.write_text(markdown(results) + "\n")
        print(f"the benchmark page's table: {page}")
    if not args.no_plots:
        # torch.compile's rows go on the memory/recompute figure (python -m ckpt_lab.bench.pareto --compile).
        plotted = [r for r in results if not r.strategy.startswith("compiled-")]
        for path in plot(plotted, args.images or default_images):
            print(f"plot: {path}")
    # Wrong gradients anywhere, or global state left behind by a strategy of ours or torch's, fail the run;
    # RETURNN's scope's known state leak is reported above as a MISS.
    # torch.compile's budgets below 1 redraw dropout masks (ckpt_lab.compiled's NOTE): torch's bug, shown
    # in the grad column, not failed on.
    broken = [
        r
        for r in results
        if (not r.grad_ok and not r.strategy.startswith("compiled-"))
        or (not r.state_ok and r.strategy != "returnn-scope")
    ]
    if broken:
        print("\nFAILED: " + ", ".join(f"{r.workload}/{r.strategy}" for r in broken), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
