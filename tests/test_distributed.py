"""Tests for ``ckpt_lab.distributed`` (DDP and FSDP with checkpointing, 2 processes, CPU and gloo)
and for the launcher it uses, ``ckpt_lab.helpers.processes``.

Every distributed test starts 2 worker processes through ``run_workers``; the first one also starts
the fork server (a few seconds of ``import torch``), the others take well under a second each.
"""

from __future__ import annotations

import gc
import operator
import os
import queue
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ckpt_lab import distributed
from ckpt_lab.distributed import (
    REENTRANT,
    STRATEGIES,
    TinyNet,
    ddp_train_steps,
    fail_on_rank,
    fsdp_train_steps,
    sum_of_ranks,
    trace_parameter_hooks,
)
from ckpt_lab.helpers import processes
from ckpt_lab.helpers.processes import WorkerError, _worker_main, free_port, run_workers
from ckpt_lab.strategies import by_label

NON_REENTRANT = [s for s in STRATEGIES if s not in (*REENTRANT, "none")]
READY_TWICE = "Expected to mark a variable ready only once"


# ------------------------------------------------------------------------------------ the model
def test_strategies_are_the_registry_labels_in_notebook_order() -> None:
    assert STRATEGIES == (
        "none",
        "torch reentrant",
        "ckpt_lab.reentrant_checkpoint",
        "torch non-reentrant",
        "ckpt_lab.checkpoint",
        "ckpt_lab.gradient_checkpoint_scope",
    )
    assert REENTRANT == ("torch reentrant", "ckpt_lab.reentrant_checkpoint")
    assert all(by_label(label).block is not None for label in STRATEGIES)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_tinynet_runs_each_block_through_the_registry_wrapper(strategy: str) -> None:
    torch.manual_seed(0)
    model = TinyNet(strategy=strategy, repeat=2).double()
    x = torch.randn(2, 4, dtype=torch.float64)
    # By hand: the stem, the registry's per-block wrapper twice over the blocks, the head.
    h = model.stem(x)
    for _ in range(2):
        for block in model.blocks:
            h = by_label(strategy).block(block, h)
    assert torch.equal(model(x), model.head(h))


def test_tinynet_refuses_unknown_and_whole_stack_strategies() -> None:
    with pytest.raises(ValueError, match="no strategy is called 'nope'"):
        TinyNet(strategy="nope")
    with pytest.raises(ValueError, match="whole stack"):
        TinyNet(strategy="ckpt_lab.checkpoint_sequential, √N segments")


# ------------------------------------------------------------------------------------------- DDP
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_ddp_matches_single_process_reference(strategy: str) -> None:
    # Default DDP options: every checkpoint works, reentrant ones included (each parameter used once).
    results = run_workers(ddp_train_steps, strategy=strategy)
    assert results[0] == results[1]  # both ranks end with the same verdicts
    result = results[0]
    assert result.error is None
    assert result.params_match_reference and result.grads_match_reference
    assert result.bitwise_equal_to_no_checkpoint
    assert result.ranks_agree
    # 3 steps; a checkpoint calls the block again in backward, the scope replays ops instead.
    recomputes = strategy not in ("none", "ckpt_lab.gradient_checkpoint_scope")
    assert result.block_forwards == (6 if recomputes else 3)


@pytest.mark.parametrize("strategy", REENTRANT)
@pytest.mark.parametrize(
    "options", [{"find_unused_parameters": True}, {"repeat": 2}], ids=["find_unused", "tied_weights"]
)
def test_ddp_reentrant_marks_ready_twice_and_static_graph_fixes_it(strategy: str, options: dict) -> None:
    failed = run_workers(ddp_train_steps, strategy=strategy, **options)
    assert all(r.error is not None and READY_TWICE in r.error for r in failed)
    assert "has been marked as ready twice" in failed[0].error
    fixed = run_workers(ddp_train_steps, strategy=strategy, static_graph=True, **options)
    assert all(r.error is None and r.params_match_reference and r.grads_match_reference for r in fixed)


@pytest.mark.parametrize("strategy", NON_REENTRANT)
def test_ddp_non_reentrant_needs_no_static_graph(strategy: str) -> None:
    for options in ({"find_unused_parameters": True}, {"repeat": 2}):
        results = run_workers(ddp_train_steps, strategy=strategy, **options)
        assert all(r.error is None for r in results)
        assert all(r.params_match_reference and r.bitwise_equal_to_no_checkpoint for r in results)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("repeat", [1, 2])
def test_trace_parameter_hooks_predicts_ddp(strategy: str, repeat: int) -> None:
    # One process, no DDP: the reducer's counts, replayed. They must say "fails" exactly where DDP does.
    torch.manual_seed(0)
    model = TinyNet(strategy=strategy, repeat=repeat).double()
    hooks = trace_parameter_hooks(model, torch.randn(2, 4, dtype=torch.float64))
    inside = [h for h in hooks if h.name.startswith("blocks.")]
    outside = [h for h in hooks if not h.name.startswith("blocks.")]
    assert len(inside) == 6 and len(outside) == 4
    assert all(h.reachable and (h.fired_outer, h.fired_nested) == (1, 0) for h in outside)
    if strategy in REENTRANT:
        # Hidden from the walk, reached only by the nested backwards: one per checkpointed call.
        assert all(not h.reachable and (h.fired_outer, h.fired_nested) == (0, repeat) for h in inside)
    else:
        assert all(h.reachable and (h.fired_outer, h.fired_nested) == (1, 0) for h in inside)
    for find_unused in (False, True):
        ddp_would_fail = any(h.ready_marks(find_unused) != 1 for h in hooks)
        assert ddp_would_fail == (strategy in REENTRANT and (find_unused or repeat > 1))


# ------------------------------------------------------------------------------------------- FSDP
def test_fsdp_with_ckpt_lab_checkpoint_matches_reference_and_keeps_less() -> None:
    plain = run_workers(fsdp_train_steps, checkpointed=False)
    checkpointed = run_workers(fsdp_train_steps, checkpointed=True)
    for result in plain + checkpointed:
        assert result.params_match_reference and result.grads_match_reference
        # Sharded: each rank holds about half the parameters (the shards of dim 0 may differ by a row).
        assert result.local_param_bytes < 0.6 * result.full_param_bytes
    for rank in range(2):
        # Data parallel: a rank's activations are half of the single-process run's on the global batch.
        assert 2 * plain[rank].retained_bytes == plain[rank].single_process_retained_bytes
        # Checkpointed: block inputs only (4 of the 7 block-sized tensors), the block ran twice.
        assert checkpointed[rank].retained_bytes < 0.6 * plain[rank].retained_bytes
        assert (plain[rank].block_forwards, checkpointed[rank].block_forwards) == (1, 2)
    assert plain[0].retained_bytes == plain[1].retained_bytes


# ------------------------------------------------------------------- launcher (helpers.processes)
def test_launcher_is_importable_from_distributed() -> None:
    assert distributed.run_workers is processes.run_workers
    assert distributed.WorkerError is processes.WorkerError
    assert distributed.free_port is processes.free_port


def test_results_come_back_in_rank_order() -> None:
    assert run_workers(fail_on_rank, world_size=2, bad_rank=-1) == [0, 1]
    assert run_workers(sum_of_ranks, world_size=3) == [3, 3, 3]


def test_worker_exception_is_reported_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        run_workers(fail_on_rank, how="raise", timeout=60)
    # Rank 0 waits in a barrier for rank 1 forever: the launcher stops it instead of waiting.
    assert time.monotonic() - start < 10
    error = caught.value
    # Rank 1 is the cause; rank 0's barrier may fail next (its connection to rank 1 broke).
    assert error.rank == 1 and next(iter(error.failures)) == 1
    assert "ValueError: rank 1 failed on purpose" in str(error).splitlines()[0]
    assert "in fail_on_rank" in error.worker_traceback


def test_worker_that_dies_silently_is_reported() -> None:
    with pytest.raises(WorkerError, match="on rank 1: the worker process exited with code 3") as caught:
        run_workers(fail_on_rank, how="exit", timeout=60)
    assert caught.value.rank == 1


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # Still in the process table: gone if it is a zombie waiting for its parent (the fork server).
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" in status.read_text()


def test_timeout_kills_every_worker(tmp_path: Path) -> None:
    run_workers(fail_on_rank, bad_rank=-1)  # the fork server is up: the timeout is all the hang's
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not finish within 2 s: rank\(s\) \[0, 1\] had not reported"):
        run_workers(fail_on_rank, how="hang", timeout=2, pid_dir=str(tmp_path))
    assert time.monotonic() - start < 8
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
    assert len(pids) == 2
    assert all(_gone(pid) for pid in pids)


def test_runs_any_importable_function() -> None:
    # The launcher knows nothing of ckpt_lab.distributed's workers: operator.add(rank, world_size).
    assert run_workers(operator.add, world_size=2) == [2, 3]


def test_refuses_functions_a_worker_cannot_import() -> None:
    with pytest.raises(ValueError, match="must be importable"):
        run_workers(lambda rank, world_size: rank)


@pytest.mark.parametrize("fails", [False, True])
def test_worker_main_always_destroys_its_process_group(fails: bool) -> None:
    # In this process, world size 1: the worker's own code path, success and failure alike.
    messages: queue.Queue = queue.Queue()
    # _worker_main closes the queue when done, as a multiprocessing queue must be; a plain one can't.
    messages.close = messages.join_thread = lambda: None  # type: ignore[attr-defined]
    environ = dict(os.environ)
    try:
        _worker_main(fail_on_rank, 0, 1, free_port(), 30.0, messages, {"bad_rank": 0 if fails else -1})
    finally:
        # Undo what a worker process may do to itself: freeze the collector, set the group's address.
        gc.unfreeze()
        os.environ.clear()
        os.environ.update(environ)
    rank, ok, _payload = messages.get_nowait()
    assert (rank, ok) == (0, not fails)
    assert not dist.is_initialized()
