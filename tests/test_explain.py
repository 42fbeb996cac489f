"""``ckpt_lab.explain``: its numbers against the instruments, to the byte, on every registered strategy;
its attribution (op, module, line, region) on toys whose answer is known by hand; the peak's ledger
(every storage alive at the peak, by role, adding up to the peak); gradients and global state left as
they were; the command line and its errors; ``import ckpt_lab`` without explain."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import ckpt_lab
from ckpt_lab import (
    SavedTensorLog,
    checkpoint,
    gradient_checkpoint_scope,
    reentrant_checkpoint,
    selective_checkpoint,
)
from ckpt_lab.cases import zoo
from ckpt_lab.cases.examples import stack
from ckpt_lab.explain import explain
from ckpt_lab.explain.__main__ import load, main
from ckpt_lab.instruments.memory import measure_memory
from ckpt_lab.instruments.state import assert_no_global_state
from ckpt_lab.offload import offload_to_cpu
from ckpt_lab.strategies import REGISTRY, sqrt_segments
from oracle import cuda

matplotlib.use("Agg")

SIZES = {
    "mlp": {"depth": 4, "width": 128, "batch": 8},
    "transformer": {"depth": 2, "d_model": 32, "nhead": 2, "seq": 16, "batch": 2},
    "pointwise": {"depth": 4, "size": 16},
}
MATMULS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]


def _clear_grads(model: nn.Module, *inputs: torch.Tensor) -> None:
    # An existing .grad is accumulated into instead of allocated: both runs must start alike.
    for t in [*model.parameters(), *inputs]:
        t.grad = None


def _kinds(report) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for region in report.regions:
        kinds[region.kind] = kinds.get(region.kind, 0) + 1
    return kinds


# ------------------------------------------------------------------------ against the instruments
# The regions each strategy makes on n blocks (None: the planner decides). checkpoint_sequential
# checkpoints all segments but the last: round(sqrt(n)) - 1 of them.
EXPECTED_REGIONS = {
    "none": lambda n: {},
    "torch-reentrant": lambda n: {"reentrant": n},
    "torch-nonreentrant": lambda n: {"checkpoint": n},
    "torch-sequential-sqrt": lambda n: {"checkpoint": sqrt_segments(n) - 1} if n > 2 else {},
    "torch-sac-matmul": lambda n: {"checkpoint": n},
    "ckpt-reentrant": lambda n: {"reentrant": n},
    "ckpt-nonreentrant": lambda n: {"checkpoint": n},
    "ckpt-sequential-sqrt": lambda n: {"checkpoint": sqrt_segments(n) - 1} if n > 2 else {},
    "ckpt-sac-matmul": lambda n: {"checkpoint": n},
    "ckpt-plan-25": None,
    "ckpt-plan-50": None,
    "ckpt-scope": lambda n: {"scope": n},
}


def test_every_registered_strategy_is_expected() -> None:
    assert set(EXPECTED_REGIONS) == set(REGISTRY)


@pytest.mark.parametrize("family", sorted(SIZES))
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_numbers_match_measure_memory(name: str, family: str) -> None:
    model, x = stack(family, name, **SIZES[family])
    _clear_grads(model, x)
    reference = measure_memory(lambda: model(x).sum())
    _clear_grads(model, x)
    report = explain(model, x)
    assert_no_global_state()

    assert report.retained_bytes == reference.retained_bytes
    assert report.peak_bytes == reference.peak_bytes
    assert report.peak_bytes_with_grads == reference.peak_bytes_with_grads
    assert report.grad_bytes == reference.grad_bytes
    # Kept after forward = the listed storages + the loss (a float32 scalar) + the output if kept
    # (sum() doesn't keep it; a selective policy that caches the last op's output does).
    assert report.loss_bytes == 4
    assert report.retained_bytes == report.saved_bytes + report.loss_bytes + report.output_bytes
    # Storages are listed once each, in the order they were made.
    serials = [row.serial for row in report.saved]
    assert serials == sorted(set(serials))
    # The timeline is the same measurement: the live bytes when forward ends, and the peak.
    timeline = report.timeline
    assert timeline.live_bytes[timeline.backward_start - 1] == report.retained_bytes
    assert timeline.peak_bytes == max(timeline.live_bytes) == report.peak_bytes
    assert sum(size for _, size in timeline.at_peak) == report.peak_bytes
    # Parameters and inputs are reported apart, never counted.
    assert sum(h.bytes for h in report.parameters) == sum(p.nbytes for p in model.parameters())
    assert [h.bytes for h in report.inputs] == [x.nbytes]

    expected = EXPECTED_REGIONS[name]
    if expected is not None:
        assert _kinds(report) == expected(SIZES[family]["depth"])
    if not report.regions:
        assert timeline.spans == [] and {row.where for row in report.saved} == {"not inside any checkpoint"}
    else:
        assert any(span.kind == "recompute" for span in timeline.spans)
    if "sac" in name:
        assert all(r.name.startswith("selective checkpoint") for r in report.regions)
        kept = {row.op for row in report.saved if row.role == "kept"}
        # The pointwise blocks have no matmul for the policy to keep.
        assert kept <= {"mm", "addmm", "bmm", "baddbmm"} and bool(kept) == (family != "pointwise")
    # The peak's ledger is the same measurement: its rows add up to measure_memory's peak_bytes.
    check_ledger(report, reference)


def check_ledger(report, reference) -> None:
    """The peak ledger against the instruments: its counted rows add up to ``peak_bytes`` to the byte,
    each storage once; what it leaves uncounted is what the peak excludes; each role is what it says."""
    ledger = report.peak_ledger
    assert ledger.bytes == sum(r.bytes for r in ledger.rows) == sum(ledger.roles.values())
    assert ledger.bytes == reference.peak_bytes == report.peak_bytes
    assert ledger.index == report.timeline.peak_index
    assert (ledger.phase == "backward") == (ledger.index >= report.timeline.backward_start)
    serials = [r.serial for r in ledger.rows]
    assert len(serials) == len(set(serials)) and all(r.counted and r.bytes for r in ledger.rows)
    assert not any(r.counted for r in ledger.held)
    # Not counted: the parameters and inputs (all of them), and the leaves' gradients made by then,
    # which with the counted rows never exceed the peak with gradients.
    held = ledger.not_counted
    assert held.get("parameters", 0) == sum(h.bytes for h in report.parameters)
    assert held.get("inputs", 0) == sum(h.bytes for h in report.inputs)
    assert ledger.bytes + held.get("leaves' gradients", 0) <= reference.peak_bytes_with_grads
    # Kept for backward: storages the report lists as kept (or the output the loss keeps), alive
    # after the forward, so never more than it kept.
    saved = {row.serial for row in report.saved}
    kept = [r for r in ledger.rows if r.role == "kept"]
    assert all(r.serial in saved or r.where == "the output, which the loss keeps" for r in kept)
    assert sum(r.bytes for r in kept) <= report.retained_bytes
    # Re-runs are named by a region the report lists (or said to be unknown), and lie in its spans.
    names = {r.name for r in report.regions}
    for row in ledger.rows:
        if row.role == "recomputed":
            assert row.region in names or row.label == "re-run of an unknown region"
    if ledger.phase != "backward":
        assert {r.role for r in ledger.rows} <= {"kept", "forward", "loss"}
    assert ledger.verdict and report.summary().splitlines()[3] == f"to lower the peak: {ledger.verdict}"


PLAIN_AND_CHECKPOINTED = [
    "none", "torch-reentrant", "torch-nonreentrant", "torch-sac-matmul", "ckpt-sac-matmul", "ckpt-scope"
]


@pytest.mark.parametrize("name", PLAIN_AND_CHECKPOINTED)
def test_gradients_are_bitwise_those_of_a_plain_step(name: str) -> None:
    # The transformer has dropout: equal gradients also mean explain drew no random numbers.
    model, x = stack("transformer", name, **SIZES["transformer"])
    _clear_grads(model, x)
    torch.manual_seed(1)
    model(x).sum().backward()
    plain = [t.grad.clone() for t in [*model.parameters(), x]]
    _clear_grads(model, x)
    torch.manual_seed(1)
    explain(model, x)
    explained = [t.grad for t in [*model.parameters(), x]]
    assert all(torch.equal(a, b) for a, b in zip(plain, explained, strict=True))


# --------------------------------------------------------------------- attribution, known by hand
class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        y = h.exp()  # the line a row must point at
        return self.head(y)


def _line_of(function, text: str) -> str:
    lines, first = inspect.getsourcelines(function)
    return f"test_explain.py:{first + next(i for i, line in enumerate(lines) if text in line)}"


def test_rows_name_op_module_line_shape_and_bytes() -> None:
    torch.manual_seed(0)
    toy, x = Toy(), torch.randn(3, 8)
    report = explain(toy, x)
    # tanh saves its output h, exp saves its output y, the head's Linear saves y (again) and its
    # weight: two storages of 3 x 16 float32. addmm's output dies (tanh keeps only its result), and so
    # does the head's output (sum keeps nothing).
    assert [(r.op, r.module, r.shape, r.dtype, r.bytes) for r in report.saved] == [
        ("tanh", "encoder.1", (3, 16), torch.float32, 192),
        ("exp", "", (3, 16), torch.float32, 192),
    ]
    assert report.saved[1].line == _line_of(Toy.forward, "h.exp()")
    assert {r.where for r in report.saved} == {"not inside any checkpoint"}
    names = ["encoder.0.weight", "encoder.0.bias", "head.weight", "head.bias"]
    assert [h.name for h in report.parameters] == names
    assert [(h.name, h.bytes) for h in report.inputs] == [("input 0", 96)]
    assert report.retained_bytes == 192 + 192 + 4
    assert "384 B in 2 storages + 4 B loss" in report.summary()


def test_views_of_one_storage_are_one_row() -> None:
    x = torch.randn(2, 100, requires_grad=True)

    def f(x, *, power):
        y = x.exp()
        # mul saves the views y[0] and y[1]; exp saves y: one storage.
        return (y[0] * y[1]) ** power

    # Keywords go to the function; ckpt_lab exports explain itself.
    report = ckpt_lab.explain(f, x, power=1)
    assert ckpt_lab.explain is explain
    # pow saves its input, the mul's output (100 float32).
    assert [(r.op, r.bytes) for r in report.saved] == [("exp", 800), ("mul", 400)]


def test_a_loss_that_keeps_the_output_is_counted_apart() -> None:
    torch.manual_seed(0)
    toy, x, target = Toy(), torch.randn(3, 8), torch.randn(3, 4)
    report = explain(toy, x, loss_fn=lambda out: F.mse_loss(out, target))
    # mse_loss saves its input, the head's output (3 x 4 float32); its own output is the loss.
    assert report.output_bytes == 48
    # A quirk the storage view shows: torch 2.13's CPU mse_loss returns its scalar in a storage the
    # size of its input.
    assert report.loss_bytes == 48
    assert report.retained_bytes == report.saved_bytes + report.output_bytes + report.loss_bytes
    assert "+ 48 B loss + 48 B output (kept for backward)" in report.summary()


def test_a_loss_returned_inside_the_output_is_counted_once() -> None:
    # Hugging Face models return their loss in their output (``labels=``): it is the loss, not also
    # an output kept for backward.
    torch.manual_seed(0)
    toy, x = Toy(), torch.randn(3, 8)
    report = explain(lambda x: {"loss": toy(x).sum()}, x, loss_fn=lambda out: out["loss"])
    assert (report.loss_bytes, report.output_bytes) == (4, 0)
    assert report.retained_bytes == report.saved_bytes + 4


# --------------------------------------------------------------------------------------- regions
def _blocks(n: int = 3) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(n))


class Net(nn.Module):
    """Blocks run through ``run(block, x)``: each in a checkpoint, a scope, ..."""

    def __init__(self, run, n: int = 3) -> None:
        super().__init__()
        self.layers, self.run = _blocks(n), run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = self.run(block, x)
        return x


def _scoped(block, x):
    with gradient_checkpoint_scope():
        return block(x)


def _torch(use_reentrant: bool):
    return lambda block, x: torch_checkpoint(block, x, use_reentrant=use_reentrant)


# How to run a block, the kind of region it makes, and a word of the region's name.
RUNS = {
    "torch non-reentrant": (_torch(False), "checkpoint", "torch.utils"),
    "ckpt_lab.checkpoint": (checkpoint, "checkpoint", "ckpt_lab.checkpoint"),
    "torch reentrant": (_torch(True), "reentrant", "torch.utils"),
    "ckpt_lab.reentrant_checkpoint": (reentrant_checkpoint, "reentrant", "ckpt_lab.reentrant_checkpoint"),
    "scope": (_scoped, "scope", "gradient_checkpoint_scope"),
}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_per_block_regions_keep_their_inputs_and_hand_on_their_outputs(run: str) -> None:
    function, kind, name = RUNS[run]
    net, x = Net(function), torch.randn(4, 16, requires_grad=True)
    report = explain(net, x)
    assert_no_global_state()
    assert _kinds(report) == {kind: 3}
    assert all(name in r.name and r.kept_bytes == 0 for r in report.regions)
    # Blocks 0 and 1 hand their outputs (4 x 16 float32) to the next block; block 2's dies (sum).
    assert [r.output_bytes for r in report.regions] == [256, 256, 0]
    assert [r.wraps_output for r in report.regions] == [False, False, True]
    assert [r.module for r in report.regions] == ["layers.0", "layers.1", "layers.2"]
    assert all(r.role == "output" and r.op == "gelu" for r in report.saved)
    assert report.regions[0].verdict.startswith("keeps only its inputs; its outputs (256 B) are kept")
    assert "it is the last stage" in report.regions[2].verdict
    assert {span.label for span in report.timeline.spans} <= {r.name for r in report.regions}
    assert "2× " in report.summary() and "it is the last stage" in report.summary()


@pytest.mark.parametrize("implementation", ["torch", "ours"])
def test_selective_regions_keep_what_the_policy_saves(implementation: str) -> None:
    def run(block, x):
        if implementation == "ours":
            return selective_checkpoint(block, x, policy=MATMULS)
        context = lambda: create_selective_checkpoint_contexts(MATMULS)
        return torch_checkpoint(block, x, use_reentrant=False, context_fn=context)

    report = explain(Net(run), torch.randn(4, 16, requires_grad=True))
    kept = [r for r in report.saved if r.role == "kept"]
    # One addmm output (4 x 16 float32) per block, cached by the policy.
    assert [(r.op, r.module, r.bytes) for r in kept] == [("addmm", f"layers.{i}.0", 256) for i in range(3)]
    assert all("policy" in r.where and r.region.startswith("selective checkpoint #") for r in kept)
    assert [r.kept_bytes for r in report.regions] == [256] * 3
    assert "keeps 256 B its policy chose (mostly `addmm` in layers.*.*)" in report.regions[0].verdict


def test_nested_regions_are_listed_outermost_first() -> None:
    blocks = _blocks(2)

    def f(x):
        return torch_checkpoint(lambda h: checkpoint(blocks[1], blocks[0](h)), x, use_reentrant=False)

    report = explain(f, torch.randn(4, 16, requires_grad=True))
    # The only thing kept: the inner checkpoint's output, which is also the outer's (and not kept by
    # the loss: it is the function's output).
    assert report.saved == [] and report.retained_bytes == 4
    outer, inner = report.regions
    assert outer.name == "checkpoint #1 (torch.utils.checkpoint)"
    assert inner.name == "checkpoint #2 (ckpt_lab.checkpoint)"
    assert outer.wraps_output and inner.wraps_output


def test_an_outer_checkpoint_output_made_by_an_inner_one_names_both() -> None:
    blocks = _blocks(3)

    def f(x):
        h = torch_checkpoint(lambda h: checkpoint(blocks[1], blocks[0](h)), x, use_reentrant=False)
        return blocks[2](h)

    report = explain(f, torch.randn(4, 16, requires_grad=True))
    (made_inside,) = [r for r in report.saved if r.region]
    outer_then_inner = "checkpoint #1 (torch.utils.checkpoint) > checkpoint #2 (ckpt_lab.checkpoint)"
    assert made_inside.region == outer_then_inner
    assert made_inside.role == "output"
    assert made_inside.where == "the output of a checkpoint (ckpt_lab.checkpoint)"


def test_offload_copies_are_the_pack_hooks_and_reloads_are_spans() -> None:
    blocks = _blocks(3)
    hooks = offload_to_cpu(include_cpu_tensors=True)

    def f(x):
        with hooks:
            for block in blocks:
                x = block(x)
        return x

    report = explain(f, torch.randn(4, 16, requires_grad=True))
    copies = [r for r in report.saved if r.role == "copy"]
    assert copies and len(copies) == len(report.saved)
    # The hooks count what they copied: the same bytes (no two saved views of one buffer here).
    assert sum(r.bytes for r in copies) == hooks.bytes_moved
    assert all(r.op == "empty_like" and r.written_by == "copy_" for r in copies)
    assert report.regions[0].name == "offload hooks #1 (offload_to_cpu)"
    assert {s.kind for s in report.timeline.spans} == {"reload"}


def test_hooks_it_does_not_know_are_an_unknown_region() -> None:
    blocks = _blocks(2)

    def f(x):
        with SavedTensorLog():
            return blocks[1](blocks[0](x))

    report = explain(f, torch.randn(4, 16, requires_grad=True))
    assert report.saved
    assert all(r.where.startswith("unknown region: made inside saved_tensors_hooks") for r in report.saved)


def test_a_checkpoint_around_the_last_stage_does_not_lower_the_peak_when_the_loss_keeps_its_output() -> None:
    blocks, target = _blocks(3), torch.randn(4, 16)

    def f(x):
        x = blocks[1](blocks[0](x))
        return torch_checkpoint(blocks[2], x, use_reentrant=False)

    report = explain(f, torch.randn(4, 16, requires_grad=True), loss_fn=lambda out: F.mse_loss(out, target))
    (region,) = report.regions
    assert region.kept_bytes == 0 and region.wraps_output
    assert region.verdict.startswith(
        "does not lower the peak: it wraps the last stage, whose outputs the loss keeps; backward re-runs it"
    )


def test_a_hook_inside_a_checkpoint_shows_as_what_the_checkpoint_keeps() -> None:
    blocks = _blocks(2)

    def f(x):
        def inner(h):
            # Innermost hooks win: on the CPU save_on_cpu keeps the tensors themselves, so the
            # checkpoint around it saves nothing.
            with torch.autograd.graph.save_on_cpu():
                return blocks[0](h)

        return blocks[1](checkpoint(inner, x))

    report = explain(f, torch.randn(4, 16, requires_grad=True))
    ckpt = next(r for r in report.regions if r.kind == "checkpoint")
    assert ckpt.kept_bytes == 256  # blocks[0]'s addmm output (4 x 16 float32), which its GELU saves
    assert "of its own besides its outputs" in ckpt.verdict


# ------------------------------------------------------------------------------------ the peak ledger
# What is alive at the peak of the three blocks of Net (Linear 16 -> 16, GELU; a batch of 4: every
# activation 4 x 16 float32 = 256 B), known by hand. Backward reaches its peak in the last block, at
# GELU's backward (``gelu_backward``, 256 B), with the loss (4 B) and its gradient seed (``ones_like``,
# 4 B) alive. Kept for backward: the plain step keeps addmm and GELU outputs of blocks 0 and 1 and the
# addmm output of block 2 (its GELU's output is the function's output, which ``sum`` does not keep);
# a checkpoint per block keeps the outputs of blocks 0 and 1 (the inputs of blocks 1 and 2). Re-run:
# the non-reentrant checkpoints stop once the saved addmm output is back (early stop); the reentrant
# ones re-run the whole block (addmm, GELU). The scope replays block 2 up to what its backward reads
# (addmm), and its peak comes one block later: re-running block 1 (addmm, GELU) beside block 0's
# output, block 1's output having been freed after block 2's backward.
def _peak(kept: int, rerun: str = "", rerun_bytes: int = 0) -> dict[str, int]:
    rerun_part = {f"re-run of {rerun}": rerun_bytes} if rerun else {}
    return {"kept for backward": kept, "made by the loss": 4, **rerun_part, "backward temporaries": 260}


PEAKS = {
    "plain": _peak(1280),
    "torch non-reentrant": _peak(512, "checkpoint #3 (torch.utils.checkpoint)", 256),
    "ckpt_lab.checkpoint": _peak(512, "checkpoint #3 (ckpt_lab.checkpoint)", 256),
    "torch reentrant": _peak(512, "reentrant checkpoint #3 (torch.utils.checkpoint)", 512),
    "ckpt_lab.reentrant_checkpoint": _peak(
        512, "reentrant checkpoint #3 (ckpt_lab.reentrant_checkpoint)", 512
    ),
    "scope": _peak(256, "gradient_checkpoint_scope #2", 512),
}


@pytest.mark.parametrize("run", sorted(PEAKS))
def test_the_peak_ledger_lists_what_is_alive_at_the_peak_by_role(run: str) -> None:
    net = Net(RUNS[run][0] if run in RUNS else lambda block, x: block(x))
    x = torch.randn(4, 16, requires_grad=True)
    reference = measure_memory(lambda: net(x).sum())
    _clear_grads(net, x)
    report = explain(net, x)
    ledger = report.peak_ledger
    assert ledger.roles == PEAKS[run]
    check_ledger(report, reference)
    assert ledger.phase == "backward"
    backward = [(r.op, r.node) for r in ledger.rows if r.role == "backward"]
    assert backward == [("ones_like", ""), ("gelu_backward", "GeluBackward0")]
    kept = [r for r in ledger.rows if r.role == "kept"]
    if run == "plain":
        assert [(r.op, r.module) for r in kept] == [
            ("addmm", "layers.0.0"), ("gelu", "layers.0.1"), ("addmm", "layers.1.0"), ("gelu", "layers.1.1"),
            ("addmm", "layers.2.0"),
        ]
        assert ledger.verdict.endswith("checkpointing the blocks that make them keeps only the blocks' "
                                       "inputs")
    else:
        # What a re-run made is alive at the peak: the re-run of the region the timeline's last span
        # before the peak names.
        (rerun,) = [label for label in ledger.roles if label.startswith("re-run of ")]
        span = [s for s in report.timeline.spans if s.start <= ledger.index][-1]
        assert rerun == f"re-run of {span.label}"
        assert all(r.op == "gelu" and r.where.startswith("the output of a") for r in kept)
    # No leaf's gradient is made before the last block's backward is through.
    assert "leaves' gradients" not in ledger.not_counted
    lines = report.summary().splitlines()
    assert lines[2] == f"at the peak (backward: {ledger.during}): " + " + ".join(
        f"{size} B {label}" for label, size in PEAKS[run].items()
    ).replace("1280 B", "1.2 KiB")
    assert lines[3] == f"to lower the peak: {ledger.verdict}"


def test_a_rerun_at_the_peak_is_told_to_split() -> None:
    # The whole function in one checkpoint: backward re-runs all of it at once, beside the loss.
    blocks = _blocks(3)
    report = explain(lambda x: checkpoint(lambda h: blocks[2](blocks[1](blocks[0](h))), x),
                     torch.randn(4, 16, requires_grad=True))
    ledger = report.peak_ledger
    assert max(ledger.roles, key=ledger.roles.get) == "re-run of checkpoint #1 (ckpt_lab.checkpoint)"
    assert ledger.verdict.startswith("the re-run of checkpoint #1 (ckpt_lab.checkpoint) on ")
    assert ledger.verdict.endswith("checkpoint it in two parts, so that each re-run rebuilds half of it")


def test_the_unchecked_block_backward_is_in_is_not_told_to_checkpoint() -> None:
    # Notebook 07's fix: each block checkpointed but the last. At the peak backward is in the last
    # block (layers.3), whose own activations lead: a checkpoint around it would re-run them then.
    model, x, loss_fn = zoo.each_block_but_last()
    ledger = explain(model, x, loss_fn=loss_fn).peak_ledger
    kept = [r for r in ledger.rows if r.role == "kept"]
    last = sum(r.bytes for r in kept if r.module.startswith("layers.3."))
    assert 2 * last > sum(r.bytes for r in kept)
    assert "most of them were made in layers.3, the last block still alive" in ledger.verdict


class _WideBackward(torch.autograd.Function):
    """The identity, whose backward makes a 40,000-byte temporary."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        scratch = torch.zeros(10_000)  # the line a backward row must point at
        return grad + scratch.sum()


def test_backward_temporaries_at_the_peak_name_their_node_and_line() -> None:
    report = explain(_WideBackward.apply, torch.randn(4, 16, requires_grad=True))
    ledger = report.peak_ledger
    (scratch,) = [r for r in ledger.rows if r.op == "zeros"]
    assert (scratch.role, scratch.bytes, scratch.node) == ("backward", 40_000, "_WideBackwardBackward")
    assert scratch.line == _line_of(_WideBackward.backward, "torch.zeros(10_000)")
    assert ledger.verdict.startswith("backward's own temporaries are the largest part (39.1 KiB, mostly "
                                     "`zeros` in _WideBackwardBackward)")
    assert "which no checkpoint removes" in ledger.verdict


def test_the_loss_and_the_forward_temporaries_have_roles_of_their_own() -> None:
    blocks = _blocks(1)
    x = torch.randn(4, 16, requires_grad=True)
    # A loss that makes 100 copies of the output and keeps four tensors of that size for backward
    # (each sin keeps its input); its backward makes two at a time (cos, and the product).
    loss_fn = lambda out: out.repeat(100, 1).sin().sin().sin().sin().sum()
    loss = explain(blocks[0], x, loss_fn=loss_fn).peak_ledger
    assert max(loss.roles, key=loss.roles.get) == "made by the loss"
    assert loss.verdict.startswith("the loss's tensors are the largest part (") and "chunks" in loss.verdict
    # A forward that makes a large temporary and frees it before it returns: the peak is in the forward.
    forward = explain(lambda h: blocks[0](h.repeat(100, 1).sum(0, keepdim=True)), x).peak_ledger
    assert forward.phase == "forward" and max(forward.roles, key=forward.roles.get) == "forward temporaries"
    assert [(r.op, r.bytes) for r in forward.rows if r.role == "forward"] == [("repeat", 100 * 256)]
    assert forward.verdict.startswith("the peak comes in the forward")


# ------------------------------------------------------------------------------- report and state
def test_summary_groups_layers_and_the_plot_draws() -> None:
    model, x = stack("transformer", "none", **SIZES["transformer"])
    report = explain(model, x)
    summary = report.summary(top=3)
    assert summary.splitlines()[0].startswith("kept after forward: ")
    assert "in 2 modules (layers.*." in summary and "not inside any checkpoint" in summary
    assert summary.splitlines()[2].startswith("at the peak (")
    ax = report.plot()
    assert len(ax.lines) >= 2  # the curve and the peak
    # The box beside the peak: its roles (regions by name and number only), then the largest groups.
    (box,) = [text.get_text() for text in ax.texts if text.get_text().startswith("the peak by role:")]
    assert all(label.split(" (")[0] in box for label in report.peak_ledger.roles)
    matplotlib.pyplot.close(ax.figure)
    # The table lists the kept storages, then every storage alive at the peak.
    table = report.table()
    assert table.startswith(report.saved[0].describe())
    assert table.endswith(report.peak_ledger.table()) and report.table(peak=False) == table.split("\n\n")[0]


def test_nothing_is_left_behind_when_the_function_raises() -> None:
    hooks = torch.nn.modules.module
    before = (dict(hooks._global_forward_hooks), dict(hooks._global_forward_pre_hooks))

    def f(x):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        explain(f, torch.randn(2, requires_grad=True))
    assert (hooks._global_forward_hooks, hooks._global_forward_pre_hooks) == before
    assert_no_global_state()


def test_command_prints_the_summary_and_writes_the_plot(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "tiny_model.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), torch.randn(2, 4)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    main(["tiny_model:make"])
    # tanh keeps its result (2 x 4 float32), which the last Linear saves too.
    assert "kept after forward: 36 B = 32 B in 1 storage + 4 B loss" in capsys.readouterr().out
    assert (tmp_path / "results" / "explain-make.png").stat().st_size > 0
    main(["tiny_model:make", "--plot", str(tmp_path / "here.png"), "--table"])
    assert "tanh" in capsys.readouterr().out and (tmp_path / "here.png").exists()
    main(["tiny_model:make", "--peak"])
    out = capsys.readouterr().out
    assert "\nat the peak (" in out and "every storage alive then, by role:\nkept for backward: " in out
    sys.modules.pop("tiny_model", None)


# What a factory may return, and what the command says when it returns something else.
EXPECTED = "(model, inputs[, loss_fn[, kwargs]])"
FACTORIES = {
    "none": ("return None", f"make() returned None; it must return a tuple {EXPECTED}"),
    "bare model": ("return model", f"make() returned a Linear, a model alone; it must return a tuple "
                   f"{EXPECTED}: the model and its inputs at least"),
    "five items": ("return model, x, None, {}, 1",
                   f"make() returned a tuple of 5 items; it must return 2 to 4 of them: {EXPECTED}"),
    "generator": ("yield model",
                  f"make() returned a generator (a function with `yield`); return the tuple {EXPECTED} "
                  "instead"),
    "loss_fn not callable": ("return model, x, 'mse'",
                             "make() returned a str ('mse') as loss_fn; it must be callable or None"),
    "kwargs not a dict": ("return model, x, None, [1]",
                          "make() returned a list of 1 item as kwargs; it must be a dict of keyword "
                          "arguments"),
}


@pytest.mark.parametrize("case", sorted(FACTORIES))
def test_command_says_what_the_factory_returned_and_what_it_expects(case, tmp_path, monkeypatch, capsys
                                                                     ) -> None:
    body, message = FACTORIES[case]
    module = f"factory_{case.replace(' ', '_')}"
    (tmp_path / f"{module}.py").write_text(
        "import torch\nfrom torch import nn\n"
        f"def make():\n    model, x = nn.Linear(4, 4), torch.randn(2, 4)\n    {body}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError) as raised:
        load(f"{module}:make")
    assert str(raised.value) == f"{module}:make: {message}"
    # The command: argparse's usage error (exit status 2) with the same sentence, no traceback.
    with pytest.raises(SystemExit) as exited:
        main([f"{module}:make"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: {module}:make: {message}\n")
    sys.modules.pop(module, None)


def test_command_says_when_the_factory_is_not_a_function(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "not_factories.py").write_text("SIZE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError) as raised:
        load("not_factories:SIZE")
    assert str(raised.value) == (
        "not_factories:SIZE: SIZE is an int (3), not a function; it must be a function that returns "
        f"{EXPECTED}"
    )
    with pytest.raises(ValueError) as raised:
        load("not_factories:make")
    assert str(raised.value) == "not_factories:make: module not_factories has no 'make'"
    with pytest.raises(SystemExit):
        main(["not_factories"])
    assert "give the factory as MODULE:FACTORY, not 'not_factories'" in capsys.readouterr().err
    sys.modules.pop("not_factories", None)


@pytest.mark.parametrize(("returned", "words"), [(None, "None"), ("loss", "a str ('loss')")])
def test_a_loss_fn_that_returns_no_tensor_is_named(returned, words) -> None:
    hooks = torch.nn.modules.module
    before = (dict(hooks._global_forward_hooks), dict(hooks._global_forward_pre_hooks))
    toy, x = Toy(), torch.randn(3, 8)
    message = (f"explain: loss_fn returned {words}; it must return the loss as a tensor (a scalar, or a "
               "tensor explain sums), computed from the output it is given.")
    with pytest.raises(TypeError) as raised:
        explain(toy, x, loss_fn=lambda out: returned)
    assert str(raised.value) == message
    # Nothing left behind: the modes and the module hooks are gone.
    assert (hooks._global_forward_hooks, hooks._global_forward_pre_hooks) == before
    assert_no_global_state()


def test_what_is_not_callable_is_named_before_anything_runs() -> None:
    with pytest.raises(TypeError) as raised:
        explain(Toy(), torch.randn(3, 8), loss_fn="mse")
    assert str(raised.value) == (
        "explain: loss_fn must be callable (output -> loss) or None; got a str ('mse')."
    )
    with pytest.raises(TypeError) as raised:
        explain(torch.randn(3, 8), Toy())
    assert str(raised.value) == (
        "explain: the function to explain must be callable (a model, a function); got a Tensor."
    )


@cuda
def test_cuda_reports_the_allocator_peak_too() -> None:
    model, x = stack("mlp", "torch-nonreentrant", **SIZES["mlp"], device="cuda")
    report = explain(model, x)
    # The allocator rounds every block up, and counts gradients: never below the exact peak.
    assert report.cuda_peak_bytes is not None and report.cuda_peak_bytes >= report.peak_bytes
    # The ledger is LiveMemory's, on any device: the same storages, to the byte.
    assert report.peak_ledger.bytes == sum(r.bytes for r in report.peak_ledger.rows) == report.peak_bytes


# ---------------------------------------------------------------------------------- import ckpt_lab
def test_import_ckpt_lab_does_not_import_explain_until_it_is_used() -> None:
    script = """
import sys
import ckpt_lab
assert "ckpt_lab.explain" not in sys.modules, sorted(m for m in sys.modules if m.startswith("ckpt_lab"))
assert "explain" in dir(ckpt_lab) and "explain" in ckpt_lab.__all__
function = ckpt_lab.explain  # the first use imports it
assert "ckpt_lab.explain" in sys.modules and callable(function) and function.__name__ == "explain"
print("ok")
"""
    # A fresh interpreter (this one has imported explain already), importing this ckpt_lab.
    root = str(Path(ckpt_lab.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.stdout == "ok\n", done.stderr


def test_the_name_stays_the_function_whatever_imports_the_subpackage() -> None:
    import ckpt_lab.explain as imported
    from ckpt_lab.explain import report  # noqa: F401  (a module of the subpackage)

    assert ckpt_lab.explain is explain is imported and explain.__module__ == "ckpt_lab.explain"
    assert sys.modules["ckpt_lab.explain"].report is sys.modules["ckpt_lab.explain.report"]
    # What importlib does when it first imports the subpackage: bind it on the package. Ignored.
    ckpt_lab.explain = sys.modules["ckpt_lab.explain"]
    assert ckpt_lab.explain is explain
