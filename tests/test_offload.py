"""Tests for ``ckpt_lab.offload``; no offloading and ``torch.autograd.graph.save_on_cpu`` are the oracles.

Without a GPU the dry run (``include_cpu_tensors=True``) exercises the same copies on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.graph import save_on_cpu

from ckpt_lab.instruments.saved import SavedTensorLog
from ckpt_lab.nonreentrant import checkpoint
from ckpt_lab.offload import offload_to_cpu
from oracle import assert_all_equal, cuda

CONTEXTS: dict[str, Callable[[], Any]] = {
    "none": contextlib.nullcontext,
    "torch save_on_cpu": save_on_cpu,
    "offload dry run": lambda: offload_to_cpu(include_cpu_tensors=True),
}


def make_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 8))


# ------------------------------------------------------------------------------------- gradients


def test_mlp_with_dropout_gradients_equal_no_offload_and_save_on_cpu() -> None:
    grads = {}
    for name, context in CONTEXTS.items():
        net = make_mlp()
        torch.manual_seed(1)
        x = torch.randn(4, 16, requires_grad=True)
        with context():
            loss = net(x).square().sum()
        loss.backward()
        grads[name] = [x.grad, *(p.grad for p in net.parameters())]
    assert_all_equal(grads["offload dry run"], grads["none"])
    assert_all_equal(grads["offload dry run"], grads["torch save_on_cpu"])


def test_autograd_grad_through_offloaded_tensors() -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((a.sin() * b).exp() @ b.t()).sum()

    torch.manual_seed(0)
    a = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(f(a, b), (a, b))
    with offload_to_cpu(include_cpu_tensors=True) as offload:
        loss = f(a, b)
    got = torch.autograd.grad(loss, (a, b))
    assert_all_equal(list(got), list(expected))
    # sin saves a (a leaf: kept); mul saves sin(a) and b (leaf: kept); exp saves its result; mm saves
    # exp's result and b.t() (a view of a leaf: kept). Moved: sin(a), exp result, and exp result again.
    assert (offload.tensors_moved, offload.tensors_kept) == (3, 3)
    assert offload.bytes_moved == offload.bytes_returned == 3 * 5 * 3 * 8
    assert a.grad is None and b.grad is None


# ---------------------------------------------------------------------------------------- bytes


def test_byte_counts_match_the_saved_tensor_log() -> None:
    net = make_mlp()
    x = torch.randn(4, 16)
    with SavedTensorLog() as log:
        net(x)
    # No views among the activations: one storage each, exactly the tensor's bytes.
    activations = [e for e in log.entries if not e.is_parameter]
    assert all(e.first_of_storage for e in activations)
    with offload_to_cpu(include_cpu_tensors=True) as offload:
        loss = net(x).sum()
    assert offload.tensors_moved == len(activations) == 4
    assert offload.bytes_moved == sum(e.storage_bytes for e in activations)
    # By hand: x (4x16 floats, saved by the first Linear), ReLU's result, dropout's float mask and
    # its output (saved by the second Linear), 4x32 floats each. Kept: the second weight.t().
    assert offload.bytes_moved == 4 * 16 * 4 + 3 * 4 * 32 * 4 == 1792
    assert (offload.tensors_kept, offload.bytes_kept) == (1, 32 * 8 * 4)
    assert offload.bytes_kept == log.parameter_bytes
    assert offload.bytes_returned == 0
    loss.backward()
    assert offload.bytes_returned == 1792


def test_cpu_tensors_are_kept_unless_dry_run() -> None:
    net = make_mlp()
    x = torch.randn(4, 16)
    with offload_to_cpu() as offload:
        net(x).sum().backward()
    assert (offload.tensors_moved, offload.bytes_moved, offload.bytes_returned) == (0, 0, 0)
    assert (offload.tensors_kept, offload.bytes_kept) == (5, 1792 + 1024)


def test_min_bytes_filters_small_tensors() -> None:
    net = make_mlp()
    x = torch.randn(4, 16)
    with offload_to_cpu(min_bytes=512, include_cpu_tensors=True) as offload:
        net(x).sum().backward()
    # x (256 bytes) now stays, next to the weight; the three 512-byte activations go.
    assert (offload.tensors_moved, offload.bytes_moved) == (3, 3 * 512)
    assert (offload.tensors_kept, offload.bytes_kept) == (2, 256 + 1024)
    assert offload.bytes_returned == offload.bytes_moved


def test_leaves_requiring_grad_and_their_views_stay() -> None:
    """A leaf that requires grad is held by its AccumulateGrad node anyway: a copy would free nothing.
    ``save_on_cpu`` moves it; we keep it, and the graph then holds the very same storage."""
    weight = torch.randn(16, 8, requires_grad=True)
    # mm saves x (for weight's gradient) and, only if x requires grad, weight (for x's gradient).
    x = torch.randn(4, 16)
    with offload_to_cpu(include_cpu_tensors=True) as offload:
        out = x @ weight
    assert (offload.tensors_moved, offload.tensors_kept) == (1, 0)
    assert out.grad_fn._saved_self.data_ptr() != x.data_ptr()
    assert torch.equal(out.grad_fn._saved_self, x)

    x.requires_grad_()
    with offload_to_cpu(include_cpu_tensors=True) as offload:
        out = x @ weight
    assert (offload.tensors_moved, offload.tensors_kept) == (0, 2)
    assert offload.bytes_kept == x.nbytes + weight.nbytes
    assert out.grad_fn._saved_self.data_ptr() == x.data_ptr()
    assert out.grad_fn._saved_mat2.data_ptr() == weight.data_ptr()


def test_parameter_views_saved_by_linear_stay() -> None:
    linear = nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    h = x * 2  # not a leaf: moved
    with offload_to_cpu(include_cpu_tensors=True) as offload:
        out = linear(h)
    # Linear saves weight.t(), a view of a leaf that requires grad: it is kept, on the same storage.
    assert out.grad_fn._saved_mat2.data_ptr() == linear.weight.data_ptr()
    assert out.grad_fn._saved_mat1.data_ptr() != h.data_ptr()
    assert (offload.tensors_moved, offload.bytes_moved) == (1, h.nbytes)
    assert (offload.tensors_kept, offload.bytes_kept) == (1, linear.weight.nbytes)


# ----------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_round_trip_same_values_dtype_device_and_strides(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    leaf = torch.randn(2, 3, 4, 5, dtype=dtype, requires_grad=True)
    # Not a leaf, and not contiguous: channels_last strides.
    x = leaf.to(memory_format=torch.channels_last)
    index = torch.randint(0, 5, (2, 3, 4, 2))
    with offload_to_cpu(include_cpu_tensors=True) as offload:
        y = x.exp()  # saves its result
        g = torch.gather(x, 3, index)  # saves x and the int64 index
    result = y.grad_fn._saved_result
    assert result.data_ptr() != y.data_ptr()  # a copy ...
    assert torch.equal(result, y)  # ... with the same values,
    assert (result.dtype, result.device, result.stride()) == (dtype, y.device, y.stride())
    saved_index = g.grad_fn._saved_index
    assert torch.equal(saved_index, index) and saved_index.dtype == torch.int64
    assert (offload.tensors_moved, offload.bytes_moved) == (3, y.nbytes + x.nbytes + index.nbytes)
    # Each read of a saved tensor is one copy back: two read so far.
    assert offload.bytes_returned == y.nbytes + index.nbytes


# -------------------------------------------------------------------------------------- nesting


def test_nested_checkpoint_only_its_inputs_are_offloaded() -> None:
    """Offload outside, checkpoint inside: the checkpoint saves its inputs before its own hooks go on,
    so they go through ours; what it saves inside goes to its innermost hooks, never to us."""
    torch.manual_seed(0)
    first = nn.Linear(16, 16)
    block = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    x = torch.randn(4, 16)
    stats, grads = {}, {}
    for name in ("plain", "checkpoint"):
        with offload_to_cpu(include_cpu_tensors=True) as offload:
            h = first(x)
            out = (checkpoint(block, h) if name == "checkpoint" else block(h)).relu()
        out.sum().backward()
        stats[name] = (offload.tensors_moved, offload.bytes_moved, offload.tensors_kept, offload.bytes_kept)
        grads[name] = [p.grad.clone() for p in (*first.parameters(), *block.parameters())]
        for p in (*first.parameters(), *block.parameters()):
            p.grad = None
        assert offload.bytes_returned == offload.bytes_moved
    assert_all_equal(grads["checkpoint"], grads["plain"])
    row = 4 * 16 * 4  # bytes of x, of h and of the output: 4x16 floats
    # Checkpointed: x (saved by ``first``), h (the checkpoint's input), the final ReLU's result.
    assert stats["checkpoint"] == (3, 3 * row, 0, 0)
    # Plain: x, h, the hidden ReLU's result twice (ReLU and the next Linear both save it), the final
    # ReLU's result; the block's two weight.t() stay.
    assert stats["plain"] == (5, 3 * row + 2 * 4 * 32 * 4, 2, 2 * 16 * 32 * 4)


# ------------------------------------------------------------------------------------------- CUDA


@cuda
def test_cuda_offload_frees_device_memory_and_brings_tensors_back() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).cuda()
    x = torch.randn(512, 256, device="cuda")
    grown, grads = {}, {}
    for name in ("none", "offload"):
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        offload = offload_to_cpu()
        with offload if name == "offload" else contextlib.nullcontext():
            out = net(x)
        torch.cuda.synchronize()
        grown[name] = torch.cuda.memory_allocated() - start
        if name == "offload":
            assert offload.pin_memory is True
            # The hidden ReLU result, saved twice, and x; the weights stay.
            assert offload.bytes_moved == 2 * 512 * 1024 * 4 + 512 * 256 * 4
            assert offload.tensors_kept == 1
            # A saved tensor read back comes back to the GPU.
            saved = out.grad_fn._saved_mat1
            assert saved.device.type == "cuda"
            torch.testing.assert_close(saved, net[1](net[0](x)))
            del saved
        out.square().sum().backward()
        grads[name] = [p.grad.clone() for p in net.parameters()]
        net.zero_grad(set_to_none=True)
        del out
    # Without offload the 2 MiB hidden activation stays on the GPU until backward.
    assert grown["offload"] < grown["none"]
    assert grown["none"] - grown["offload"] >= 512 * 1024 * 4
    for got, expected in zip(grads["offload"], grads["none"], strict=True):
        assert got.device.type == "cuda"
        torch.testing.assert_close(got, expected)


# ---------------------------------------------------------------------------- arguments checked early
@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"min_bytes": "1"}, TypeError, ["min_bytes", "'1'", "str", "an int"]),
        ({"min_bytes": None}, TypeError, ["min_bytes", "None", "an int"]),
        ({"min_bytes": 1.5}, TypeError, ["min_bytes", "1.5", "float"]),
        ({"min_bytes": True}, TypeError, ["min_bytes", "True", "bool"]),
        ({"min_bytes": -1}, ValueError, ["min_bytes", "-1", "0 or more"]),
        ({"pin_memory": "yes"}, TypeError, ["pin_memory", "'yes'", "True, False or None"]),
        ({"pin_memory": 1}, TypeError, ["pin_memory", "1", "int"]),
        ({"include_cpu_tensors": "no"}, TypeError, ["include_cpu_tensors", "'no'", "True or False"]),
    ],
)
def test_bad_arguments_are_refused_at_construction_naming_them(kwargs, error, words) -> None:
    with pytest.raises(error) as caught:
        offload_to_cpu(**kwargs)
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


def test_good_arguments_of_every_accepted_kind_still_offload() -> None:
    import numpy as np

    accepted = ({"min_bytes": np.int64(64)}, {"pin_memory": None}, {"pin_memory": False}, {"min_bytes": 0})
    for kwargs in accepted:
        x = torch.randn(8, 8, requires_grad=True)
        with offload_to_cpu(include_cpu_tensors=True, **kwargs) as hooks:
            y = (x * 2).sin().sum()
        y.backward()
        assert hooks.tensors_moved == 1 and hooks.bytes_moved == 256
        assert torch.equal(x.grad, 2 * (x * 2).cos())
