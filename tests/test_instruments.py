"""The measuring instruments against answers computed by hand, to the byte."""

import warnings

import pytest
import torch

from ckpt_lab.instruments.counting import CallCounter, OpCounter, count_flops
from ckpt_lab.instruments.memory import LiveMemory, measure_memory
from ckpt_lab.instruments.saved import SavedTensorLog
from ckpt_lab.instruments.state import assert_no_global_state
from oracle import TORCH

N = 1000
S = 4 * N  # bytes of one float32 tensor of N elements


def six_sins(x: torch.Tensor) -> torch.Tensor:
    for _ in range(6):
        x = x.sin()
    return x.sum()


def test_six_sins_retain_five_tensors_and_the_loss():
    x = torch.randn(N, requires_grad=True)
    report = measure_memory(lambda: six_sins(x))
    # sin saves its input: x (not counted: created outside) and the first five results; the sixth
    # result is saved by nobody (sum's backward needs only the shape), so it is freed. +4: the loss.
    assert report.retained_bytes == 5 * S + 4
    # Forward peak 6S+4 (all six sins and the loss). Backward of the last sin adds cos(a5) and the
    # product (2S) on top of the 5S+4 still retained, plus the 4-byte seed gradient of sum: 7S+8.
    assert report.peak_bytes == 7 * S + 8
    # x.grad was None: the gradient is the one S-byte tensor born in backward that outlives it.
    assert report.grad_bytes == S


def test_retained_with_torch_checkpoint_is_the_loss_only():
    x = torch.randn(N, requires_grad=True)
    for reentrant in (True, False):
        report = measure_memory(
            lambda: torch.utils.checkpoint.checkpoint(six_sins, x, use_reentrant=reentrant)  # noqa: B023
        )
        # The checkpoint keeps only its input x (created outside): nothing born in the region but the loss.
        assert report.retained_bytes == 4


def test_live_memory_counts_views_and_in_place_results_once():
    x = torch.randn(N)
    with LiveMemory() as mem:
        y = x * 2  # new: S bytes
        v = y.view(10, 100)  # a view of y: no new storage
        y.add_(1)  # in place: no new storage
        z = x[:10]  # a view of a tensor created outside the region: not counted
        assert mem.live_bytes == S
        del y
        assert mem.live_bytes == S  # v still holds y's storage
        del v
        assert mem.live_bytes == 0
    assert mem.peak_bytes == S
    assert z.shape == (10,)


def test_live_memory_sees_frees_and_peak():
    x = torch.randn(N)
    with LiveMemory() as mem:
        a = x + 1
        b = a + 1
        del a
        c = b + 1
        del b, c
    assert mem.live_bytes == 0
    assert mem.peak_bytes == 2 * S


def test_live_memory_sees_what_a_checkpoint_keeps_inside_its_hooks():
    x = torch.randn(N, requires_grad=True)

    def block(x):
        return x.exp().exp()

    with LiveMemory() as mem:
        y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        assert mem.snapshot("forward") == S  # only the output
        y.sum().backward()


def test_measure_memory_requires_a_scalar():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="scalar"):
        measure_memory(lambda: x * 2)


def test_saved_tensor_log_counts_saves_and_dedups_storages():
    x = torch.randn(N, requires_grad=True)
    with SavedTensorLog() as log:
        six_sins(x)
    assert log.count == 6
    assert log.activation_bytes == 6 * S
    assert log.parameter_count == 0

    y = torch.randn(N, requires_grad=True)
    with SavedTensorLog() as log:
        (y * y).sum()  # mul saves both factors: the same storage twice
    assert log.count == 2
    assert log.activation_bytes == S


def test_saved_tensor_log_reports_parameters_apart():
    lin = torch.nn.Linear(10, 20)
    x = torch.randn(4, 10)
    with SavedTensorLog() as log:
        lin(x).relu().sum()
    # x needs no grad, so addmm saves only x (for the weight's grad); relu saves its result (4x20).
    assert (log.parameter_count, log.count) == (0, 2)

    x.requires_grad_()
    with SavedTensorLog() as log:
        lin(x).relu().sum()
    # Now addmm also saves weight.t() (a view of the Parameter) to compute x's grad.
    assert (log.parameter_count, log.parameter_bytes) == (1, 20 * 10 * 4)
    assert (log.count, log.activation_bytes) == (2, 4 * 10 * 4 + 4 * 20 * 4)
    assert "parameters: 1 tensors, 800 bytes" in log.summary()


def test_saved_tensor_log_is_blind_inside_a_non_reentrant_checkpoint():
    x = torch.randn(N, requires_grad=True)
    with SavedTensorLog() as log:
        torch.utils.checkpoint.checkpoint(six_sins, x, use_reentrant=False)
    # Only the innermost hooks run: the checkpoint's own hooks see the six saves inside, ours none of
    # them. We see one save: the checkpoint itself stores its input x with save_for_backward. (torch
    # before 2.13 stores it through an autograd Function that saves an empty placeholder too: two
    # saves, the same bytes.)
    assert log.count == (2 if TORCH < (2, 13) else 1)
    assert log.activation_bytes == S


def test_call_counter_function_and_module():
    counter = CallCounter(torch.sin)
    counter(torch.zeros(2))
    counter(torch.zeros(2))
    assert counter.count == 2

    lin = torch.nn.Linear(2, 2)
    counter = CallCounter(lin)
    lin(torch.zeros(1, 2))
    counter(torch.zeros(1, 2))
    assert counter.count == 2
    counter.remove()
    lin(torch.zeros(1, 2))
    assert counter.count == 2


def test_call_counter_counts_recomputation():
    x = torch.randn(3, requires_grad=True)
    block = CallCounter(lambda t: t.sin().sin())
    y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    assert block.count == 1
    y.sum().backward()
    assert block.count == 2


def test_op_counter_and_flops():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with OpCounter() as ops:
        (a @ b).relu()
    assert ops.counts["mm"] == 1 and ops.counts["relu"] == 1
    assert ops.total == 2
    assert count_flops(torch.mm, a, b) == 2 * 8 * 16 * 4


def test_instruments_leave_nothing_behind():
    with LiveMemory(), OpCounter(), SavedTensorLog():
        pass
    # No saved-tensor hooks, no dispatch mode, grad mode on, saved_tensors_hooks unpatched.
    assert_no_global_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.randn(2, requires_grad=True).sin().sum().backward()


def test_saved_tensor_log_lists_each_saved_tensor_with_its_origin_and_place() -> None:
    x = torch.randn(N, requires_grad=True)

    def block(t: torch.Tensor) -> torch.Tensor:
        return t.sin().exp()  # sin saves its input (the leaf); exp saves its result

    with SavedTensorLog() as log:
        y = block(x)
    line = block.__code__.co_firstlineno + 1
    where = f"block:{line}"
    assert [(e.made_by, e.where) for e in log.entries] == [("leaf", where), ("exp", where)]
    assert log.listing().splitlines() == [
        f"f32[{N}]".ljust(22) + f"{S:,} B".rjust(14) + "  leaf".ljust(31) + f"block:{line}",
        f"f32[{N}]".ljust(22) + f"{S:,} B".rjust(14) + "  output of exp".ljust(31) + f"block:{line}",
        f"saved activations: 2 tensors, {2 * S} bytes; parameters: 0 tensors, 0 bytes",
    ]
    del y


def test_live_memory_serials_sizes_and_curve() -> None:
    x = torch.randn(1000)
    with LiveMemory() as mem:
        y = x.sin()  # 4000 bytes
        z = y.cos()  # 4000 more
        s_y, s_z = mem.serial_of(y), mem.serial_of(z)
        del y
    assert (mem.nbytes(s_y), mem.nbytes(s_z)) == (4000, 4000)
    assert mem.curve() == [4000, 8000, 4000]
    assert mem.curve(exclude={s_y}) == [0, 4000, 4000]
    assert max(mem.curve()) == mem.peak_bytes == 8000
    with pytest.raises(KeyError, match="not created while tracking"):
        mem.serial_of(x)
    del z
