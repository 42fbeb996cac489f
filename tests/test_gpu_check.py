"""``make gpu-check`` (``python -m ckpt_lab.gpu_check``): its dry run on the CPU works, so that the
command is ready the day a GPU is; and what it reports from a GPU is read right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_lab import gpu_check

CHECKOUT = Path(gpu_check.__file__).resolve().parents[1]


def _git_state() -> str | None:
    if not (CHECKOUT / ".git").exists():
        return None
    done = subprocess.run(
        ["git", "status", "--porcelain", "--ignored"], cwd=CHECKOUT, capture_output=True, text=True
    )
    return done.stdout if done.returncode == 0 else None


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    env = dict(os.environ, PYTHONPATH=str(CHECKOUT), PYTHONDONTWRITEBYTECODE="1")
    before = _git_state()
    # --device cpu: the dry run even on a machine with a GPU.
    done = subprocess.run(
        [sys.executable, "-m", "ckpt_lab.gpu_check", "--out", str(out), "--device", "cpu"],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert _git_state() == before, "gpu_check wrote into the checkout"
    return done, out


def test_the_dry_run_says_there_is_no_cuda_and_exits_0(dry_run) -> None:
    done, out = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "gpu-check: no CUDA (--device cpu" in done.stdout or "no CUDA (torch.cuda" in done.stdout
    assert "nothing ran on a GPU" in done.stdout
    assert {p.name for p in out.iterdir()} >= {"gpu_check.json", "summary.txt", "pytest.xml", "pytest.log"}


def test_the_dry_run_selects_every_cuda_test_and_nothing_else(dry_run) -> None:
    report = json.loads((dry_run[1] / "gpu_check.json").read_text())
    assert report["cuda"] is False and report["machine"]["torch"] == torch.__version__
    names = {case["test"] for case in report["tests"]["tests"]}
    assert {case["outcome"] for case in report["tests"]["tests"]} == {"skipped"}
    # One of each kind the issue lists: checkpoints, scope, offload, parity, explain, test_cuda.py.
    for expected in (
        "test_nonreentrant::test_cuda_dropout_replay_and_rng_stream",
        "test_reentrant::test_cuda_autocast_is_replayed",
        "test_scope::test_cuda_dropout_rng_and_memory",
        "test_offload::test_cuda_offload_frees_device_memory_and_brings_tensors_back",
        "test_explain::test_cuda_reports_the_allocator_peak_too",
        "test_cuda::test_a_checkpoint_whose_forward_runs_on_a_side_stream[gradient_checkpoint_scope]",
        "test_cuda::test_offload_pinned_copies_and_device_memory_drops[cuda]",
    ):
        assert expected in names, expected
    assert any(n.startswith("test_torch_parity::test_checkpoint_rng_gpu") for n in names)
    # The CPU halves of tests/test_cuda.py run in the ordinary suite, not here.
    assert not any("[cpu" in n for n in names)


def test_the_dry_run_measures_every_strategy_on_the_cpu(dry_run) -> None:
    report = json.loads((dry_run[1] / "gpu_check.json").read_text())
    (name, entry), *_ = report["bench"]["workloads"].items()
    strategies = [r["strategy"] for r in entry["results"]]
    assert strategies[0] == "none" and "ckpt-scope" in strategies and len(strategies) >= 10
    assert all(r["grad_ok"] and r["state_ok"] and r["allocator"] is None for r in entry["results"])
    text = (dry_run[1] / "summary.txt").read_text()
    assert "NO CUDA" in text and f"{name:14} ckpt-scope" in text and "verdict: dry run worked" in text


# ---------------------------------------------------------------- what a GPU run reports, read right
def _gpu_report(grad_ok: bool = True, failed: int = 0) -> dict:
    result = {
        "strategy": "ckpt-scope",
        "peak_bytes": 3 << 20,
        "retained_bytes": 1 << 20,
        "time_vs_none": 1.31,
        "time_vs_torch_nonreentrant": 0.97,
        "grad_ok": grad_ok,
        "state_ok": True,
        "state_error": "",
        "allocator": {"max_memory_allocated": 5 << 20, "memory_stats_allocated_peak": 5 << 20},
    }
    cases = [{"test": "test_cuda::t[cuda]", "outcome": "passed", "properties": {"released": "True"}}]
    cases += [{"test": f"test_cuda::f{i}", "outcome": "failed", "message": "boom"} for i in range(failed)]
    return {
        "cuda": True,
        "machine": {
            "torch": "2.11.0",
            "cuda": "13.0",
            "python": "3.12.3",
            "device": "NVIDIA H100",
            "commit": None,
            "private_api_missing": [],
        },
        "tests": {
            "files": ["test_cuda.py"],
            "seconds": 40.0,
            "exit_code": 1 if failed else 0,
            "tests": cases,
            "counts": {"passed": 1, "failed": failed, "error": 0, "skipped": 0},
        },
        "bench": {
            "device": "cuda",
            "rounds": 3,
            "seconds": 80.0,
            "workloads": {
                "mlp-8": {"results": [result]},
                "pointwise-32": {"skipped": "the 240 s budget was spent"},
            },
            "targets": [{"workload": "mlp-8", "target": "t", "ok": False, "figure": "1.2x"}],
        },
        "verdict": "",
    }


def test_a_gpu_run_is_summarised_with_the_allocator_beside_live_memory() -> None:
    report = _gpu_report()
    ok, report["verdict"] = gpu_check._verdict(report)
    assert ok and report["verdict"] == "all 1 CUDA tests passed, every strategy's gradients right"
    text = gpu_check.summary(report)
    row = next(line for line in text.splitlines() if line.startswith("mlp-8"))
    assert row.split() == ["mlp-8", "ckpt-scope", "5.00", "5.00", "3.00", "1.00", "1.31", "0.97", "ok"]
    assert "pointwise-32   skipped: the 240 s budget was spent" in text
    assert "test_cuda::t[cuda]: released = True" in text and "1 MISS" in text


def test_a_gpu_run_with_a_failure_fails() -> None:
    assert gpu_check._verdict(_gpu_report(failed=2)) == (False, "2 tests failed, 0 errors")
    ok, verdict = gpu_check._verdict(_gpu_report(grad_ok=False))
    assert not ok and verdict == "mlp-8/ckpt-scope: gradients or state wrong"
