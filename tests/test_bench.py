"""The benchmark runs end to end in --quick mode; its report has the promised structure and checks.

Timings are not asserted (the machines are shared and noisy): only structure, gradients and state.
"""

import json

import pytest
import torch

from ckpt_lab import bench


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # returnn is optional: leave the peer out so the test measures the same thing everywhere.
    code = bench.main(["--quick", "--rounds", "1", "--json", str(out / "r.json"), "--images", str(out),
                       "--no-returnn"])
    return code, json.loads((out / "r.json").read_text()), out


def test_quick_run_succeeds_and_writes_plots(quick_run):
    code, _, out = quick_run
    assert code == 0
    assert (out / "bench_memory_vs_depth.png").stat().st_size > 0
    assert (out / "bench_tradeoff.png").stat().st_size > 0


def test_report_structure(quick_run):
    _, report, _ = quick_run
    assert report["meta"]["quick"] is True
    assert report["meta"]["returnn"] is False
    names = set(report["meta"]["strategies"])
    assert {"none", "torch-reentrant", "torch-nonreentrant", "torch-sequential-sqrt", "torch-sac-matmul",
            "ckpt-reentrant", "ckpt-nonreentrant", "ckpt-sequential-sqrt", "ckpt-scope"} <= names
    workloads = {r["workload"] for r in report["results"]}
    assert {"mlp-4", "mlp-8", "transformer-2", "pointwise-8"} == workloads
    assert len(report["results"]) == len(workloads) * len(names)
    for r in report["results"]:
        assert 0 < r["retained_bytes"] <= r["peak_bytes"], r
        assert r["seconds"] > 0 and r["aten_ops"] > 0


def test_every_strategy_gives_the_gradients_of_none_and_leaves_no_state(quick_run):
    _, report, _ = quick_run
    for r in report["results"]:
        assert r["grad_ok"], (r["workload"], r["strategy"], r["state_error"])
        assert r["state_ok"], (r["workload"], r["strategy"], r["state_error"])


def test_memory_targets_of_the_reimplementations(quick_run):
    # Memory is deterministic, so these targets are asserted; time targets are only reported.
    _, report, _ = quick_run
    memory_checks = [c for c in report["targets"] if "bytes = torch" in c["target"]]
    assert memory_checks and all(c["ok"] for c in memory_checks), memory_checks


def test_checkpointing_retains_less_than_none(quick_run):
    _, report, _ = quick_run
    by = {(r["workload"], r["strategy"]): r for r in report["results"]}
    for workload in ("mlp-8", "transformer-2", "pointwise-8"):
        none = by[workload, "none"]["retained_bytes"]
        for strategy in ("torch-nonreentrant", "ckpt-nonreentrant", "ckpt-reentrant", "ckpt-scope"):
            assert by[workload, strategy]["retained_bytes"] < none, (workload, strategy)


def test_global_state_detects_a_leftover_hook():
    before = bench.global_state()
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    hooks.__enter__()
    try:
        assert bench.global_state() != before
    finally:
        hooks.__exit__()
    assert bench.global_state() == before
