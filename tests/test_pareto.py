"""The memory/recompute frontier: every planner point is measured as predicted and within its budget.

One run of the CLI on two small stacks (a few seconds) feeds every test; all numbers are exact byte
and FLOP counts, so they are asserted exactly.
"""

import gc
import itertools
import json

import pytest
import torch

from ckpt_lab import bench
from ckpt_lab.bench import pareto
from ckpt_lab.planner import frontier

FIXED = ("none", "per-block", "sqrt(N)", "torch SAC (matmuls)", "ckpt SAC (matmuls)")


def _small() -> list[bench.Workload]:
    return [bench.transformer(2, d_model=64, seq=16, batch=2), bench.mlp(4, width=128)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pareto")
    workloads = _small()
    threads = torch.get_num_threads()
    # One thread: nothing here is timed, and on a loaded 2-core machine two threads contend badly.
    torch.set_num_threads(1)
    # measure_memory collects garbage twice per run; frozen, the objects that exist already (torch's
    # own, pytest's) are not walked each time. What the runs create is still collected.
    gc.freeze()
    try:
        code = pareto.main(["--out", str(out), "--json", str(out / "p.json")], workloads=lambda: workloads)
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)
    report = json.loads((out / "p.json").read_text())["workloads"]
    points = {name: [pareto.Point(**p) for p in w["points"]] for name, w in report.items()}
    frontiers = {name: [tuple(f) for f in w["frontier"]] for name, w in report.items()}
    return code, points, frontiers, {wl.name: wl for wl in workloads}, out


def _by_name(points):
    return {p.strategy: p for p in points}


def test_cli_succeeds_and_writes_the_plot(run):
    code, points, frontiers, _, out = run
    assert code == 0
    assert set(points) == set(frontiers) == {"transformer-2", "mlp-4"}
    assert (out / "05_pareto.png").stat().st_size > 0


def test_every_strategy_is_measured(run):
    _, points, _, _, _ = run
    for pts in points.values():
        names = [p.strategy for p in pts]
        assert tuple(names[:5]) == FIXED
        for method in ("dp", "greedy"):
            assert [f"planner {method} {f:g}" for f in pareto.FRACTIONS] == [
                n for n in names if n.startswith(f"planner {method} ")
            ]
        assert names[-1] == "CPU offload"


def test_every_planner_point_is_within_its_budget_and_measured_as_predicted(run):
    _, points, _, _, _ = run
    for name, pts in points.items():
        for p in pts:
            if not p.strategy.startswith("planner"):
                assert p.budget is None and p.as_planned is None
                continue
            assert p.retained_bytes <= p.budget, (name, p)
            assert p.retained_bytes == p.predicted_retained_bytes, (name, p)
            assert p.recompute_flops == p.predicted_recompute_flops, (name, p)


def test_budgets_span_per_block_checkpointing_to_keeping_everything(run):
    _, points, _, workloads, _ = run
    for name, pts in points.items():
        by = _by_name(pts)
        planner = bench.planner_range(workloads[name].blocks, workloads[name].input)
        # At the smallest budget the plan keeps nothing: plain per-block checkpointing.
        assert by["planner dp 0"].budget == planner.minimum
        assert (by["planner dp 0"].retained_bytes, by["planner dp 0"].recompute_flops) == (
            by["per-block"].retained_bytes,
            by["per-block"].recompute_flops,
        )
        assert by["planner dp 1"].budget == by["planner dp 1"].retained_bytes == planner.maximum


def test_dp_never_recomputes_more_than_greedy(run):
    _, points, _, _, _ = run
    for pts in points.values():
        by = _by_name(pts)
        for f in pareto.FRACTIONS:
            dp, greedy = by[f"planner dp {f:g}"], by[f"planner greedy {f:g}"]
            assert dp.budget == greedy.budget
            assert dp.recompute_flops <= greedy.recompute_flops, f


def _checkpoints(p: pareto.Point) -> bool:
    """Does the strategy recompute anything? "none" and offload don't, and neither does sqrt(N) on two
    blocks (one segment: the last, which checkpoint_sequential runs without checkpointing)."""
    return p.recompute_flops > 0


def test_dp_with_the_largest_budget_recomputes_least_of_all_checkpointing_strategies(run):
    _, points, _, _, _ = run
    for name, pts in points.items():
        by = _by_name(pts)
        best = by["planner dp 1"]
        for p in pts:
            if _checkpoints(p) and p.retained_bytes <= best.retained_bytes:
                assert best.recompute_flops <= p.recompute_flops, (name, p)


def test_no_plan_matches_not_checkpointing(run):
    # A limit of the planner's model, pinned down: every block stays a checkpoint, so even with an
    # unlimited budget the ops that must run again (dropout, views) are recomputed; and it keeps the
    # output of every op a recomputation would run, which can be more than autograd saves (transformer).
    _, points, _, _, _ = run
    for pts in points.values():
        by = _by_name(pts)
        assert by["none"].recompute_flops == 0 < by["planner dp 1"].recompute_flops
        assert by["none"].retained_bytes <= by["planner dp 1"].retained_bytes
    transformer = _by_name(points["transformer-2"])
    assert transformer["none"].retained_bytes < transformer["planner dp 1"].retained_bytes


def test_the_planner_frontier_dominates_the_fixed_strategies(run):
    # At the memory a fixed checkpointing strategy retains, the best plan recomputes no more than it.
    _, points, _, workloads, _ = run
    for name, pts in points.items():
        planner = bench.planner_range(workloads[name].blocks, workloads[name].input)
        fixed = [p for p in pts if p.strategy in FIXED and _checkpoints(p)]
        assert {"per-block", "torch SAC (matmuls)", "ckpt SAC (matmuls)"} <= {p.strategy for p in fixed}
        for p in fixed:
            [(_, cost)] = frontier(planner.profiles, [p.retained_bytes])
            assert cost <= p.recompute_flops, (name, p, cost)


def test_dp_points_lie_on_the_exact_frontier(run):
    _, points, frontiers, workloads, _ = run
    for name, pts in points.items():
        by = _by_name(pts)
        # Five budgets at fractions 0, 0.25, ..., 1: the DP points at those fractions.
        corners = pareto.exact_frontier(workloads[name], n=5)
        expected = [by[f"planner dp {f:g}"] for f in (0, 0.25, 0.5, 0.75, 1.0)]
        assert corners == [(p.predicted_retained_bytes, p.predicted_recompute_flops) for p in expected]
        # The 40-point curve of the CLI: retained never above its budget, cost never rising with it.
        curve = frontiers[name]
        assert len(curve) == 40
        assert all(b[1] <= a[1] and b[0] >= a[0] for a, b in itertools.pairwise(curve))


def test_torch_and_ckpt_sac_measure_the_same(run):
    _, points, _, _, _ = run
    for pts in points.values():
        by = _by_name(pts)
        torch_sac, ckpt_sac = by["torch SAC (matmuls)"], by["ckpt SAC (matmuls)"]
        assert (torch_sac.retained_bytes, torch_sac.recompute_flops) == (
            ckpt_sac.retained_bytes,
            ckpt_sac.recompute_flops,
        )


def test_every_strategy_gives_the_gradients_of_none_bit_for_bit(run):
    _, points, _, _, _ = run
    for name, pts in points.items():
        assert all(p.grads_ok for p in pts), (name, [p.strategy for p in pts if not p.grads_ok])


def test_offload_keeps_only_the_input_on_the_device(run):
    _, points, _, workloads, _ = run
    for name, pts in points.items():
        p = _by_name(pts)["CPU offload"]
        assert p.retained_bytes == workloads[name].input.untyped_storage().nbytes()
        assert p.recompute_flops == 0
        assert "MiB to host" in p.note


def test_fixed_strategies_retain_what_checkpointing_promises(run):
    _, points, _, workloads, _ = run
    for name, pts in points.items():
        by = _by_name(pts)
        wl = workloads[name]
        # Per-block checkpointing keeps exactly each block's input.
        assert by["per-block"].retained_bytes == wl.depth * wl.input.untyped_storage().nbytes()
        assert by["none"].recompute_flops == 0
        assert by["per-block"].retained_bytes < by["none"].retained_bytes
