"""Tests for ``ckpt_lab.nonreentrant``; torch's ``checkpoint(use_reentrant=False)`` is the oracle."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import CheckpointError as TorchCheckpointError

from ckpt_lab.instruments.counting import CallCounter
from ckpt_lab.instruments.memory import LiveMemory, measure_memory
from ckpt_lab.nonreentrant import CheckpointError, checkpoint
from oracle import (
    NON_REENTRANT,
    TORCH,
    assert_all_equal,
    cuda,
    plain,
    run_chain,
    sin_chain,
    torch_nonreentrant,
)

ALL = {"plain": plain, **NON_REENTRANT}


def assert_matches_plain_and_torch(
    case: Callable[[Callable[..., Any]], list[torch.Tensor | None]], *, allow_none: bool = False
) -> None:
    """Run ``case`` once per checkpoint (each seeded alike) and compare the tensors it returns
    (``allow_none``: a missing gradient must be missing in all three)."""
    got = {}
    for name, ck in ALL.items():
        torch.manual_seed(0)
        got[name] = case(ck)
    assert_all_equal(got["ours"], got["torch"], allow_none=allow_none)
    assert_all_equal(got["ours"], got["plain"], allow_none=allow_none)


# ------------------------------------------------------------------------------------- gradients


def test_sin_chain() -> None:
    def case(ck: Callable[..., Any]) -> list[torch.Tensor | None]:
        x = torch.linspace(-2, 2, 64, dtype=torch.float64, requires_grad=True)
        ck(sin_chain, x).sum().backward()
        return [x.grad]

    assert_matches_plain_and_torch(case)


def test_dropout_is_replayed_bitwise() -> None:
    def case(ck: Callable[..., Any]) -> list[torch.Tensor | None]:
        net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 8), nn.Dropout(0.3))
        x = torch.randn(4, 16, requires_grad=True)
        (ck(net, x) ** 2).sum().backward()
        return [x.grad, *(p.grad for p in net.parameters())]

    assert_matches_plain_and_torch(case)


def test_without_rng_restore_dropout_grads_are_wrong_like_torchs() -> None:
    def grads(ck: Callable[..., Any], preserve: bool) -> list[torch.Tensor | None]:
        torch.manual_seed(0)
        x = torch.ones(64, requires_grad=True)
        ck(lambda t: F.dropout(t.sin(), 0.5), x, preserve_rng_state=preserve).sum().backward()
        return [x.grad]

    reference = grads(plain, True)
    ours, theirs = grads(checkpoint, False), grads(torch_nonreentrant, False)
    assert not torch.equal(ours[0], reference[0])
    # The recomputation draws the next mask from the caller's stream: the same wrong mask as torch's.
    assert_all_equal(ours, theirs)


def test_kwargs_and_non_tensor_args_and_outputs() -> None:
    def fn(x: torch.Tensor, n: int, mode: str, *, scale: float, bias: torch.Tensor, pair: list) -> Any:
        assert (n, mode) == (3, "tanh")
        return torch.tanh(x * scale) * pair[0] + bias**n, "tag", n, None

    def case(ck: Callable[..., Any]) -> list[torch.Tensor | None]:
        x = torch.linspace(-1, 1, 10, requires_grad=True)
        bias = torch.linspace(0.5, 2, 10, requires_grad=True)
        # A tensor inside a container, passed by keyword: saved and restored like the others.
        weight = torch.linspace(1, 3, 10, requires_grad=True)
        out, tag, n, nothing = ck(fn, x, 3, "tanh", scale=1.5, bias=bias, pair=[weight, "x"])
        assert (tag, n, nothing) == ("tag", 3, None)
        out.sum().backward()
        return [x.grad, bias.grad, weight.grad]

    assert_matches_plain_and_torch(case)


def test_several_outputs_some_unused() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.sin(), x.cos().exp(), x.exp(), x.tanh()

    def case(ck: Callable[..., Any]) -> list[torch.Tensor | None]:
        x = torch.linspace(-1, 1, 7, dtype=torch.float64, requires_grad=True)
        a, _unused, c, kept_unused = ck(fn, x)
        del _unused
        (a * c).sum().backward()
        assert kept_unused.requires_grad
        return [x.grad]

    assert_matches_plain_and_torch(case)


def test_nested_checkpoints() -> None:
    def case(ck: Callable[..., Any]) -> list[torch.Tensor | None]:
        w = torch.linspace(-1, 1, 16).reshape(4, 4).requires_grad_()

        def inner(y: torch.Tensor) -> torch.Tensor:
            return F.dropout((y @ w).tanh(), 0.3)

        def outer(x: torch.Tensor) -> torch.Tensor:
            return ck(inner, x.sin() * 2).exp() + ck(sin_chain, x, n=2)

        x = torch.randn(3, 4, requires_grad=True)
        ck(outer, x).sum().backward()
        return [x.grad, w.grad]

    assert_matches_plain_and_torch(case)


def test_in_place_ops_and_views_inside() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y.add_(1.0)
        # In-place on a view: autograd rewrites y's history (CopySlices).
        y[1:3].mul_(2.0)
        y[0].add_(x[1].sin())
        z = y.t().reshape(-1).sin()
        z.sub_(z[::2].mean())
        return z.view(4, 3).tanh()

    def case(ck: Callable[..., Any]) -> list[torch.Tensor | None]:
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        ck(fn, x).sum().backward()
        return [x.grad]

    assert_matches_plain_and_torch(case)


def test_autograd_grad_leaves_dot_grad_alone() -> None:
    def case(ck: Callable[..., Any]) -> list[torch.Tensor | None]:
        net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
        x = torch.randn(3, 5, requires_grad=True)
        gx, gw = torch.autograd.grad(ck(net, x).pow(2).sum(), [x, net[0].weight])
        assert x.grad is None and all(p.grad is None for p in net.parameters())
        return [gx, gw]

    assert_matches_plain_and_torch(case)


def test_backward_with_inputs() -> None:
    def case(ck: Callable[..., Any]) -> list[torch.Tensor | None]:
        net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
        x = torch.randn(3, 5, requires_grad=True)
        ck(net, x).pow(2).sum().backward(inputs=[net[0].weight])
        assert x.grad is None and net[2].weight.grad is None
        return [net[0].weight.grad]

    assert_matches_plain_and_torch(case)


def test_retain_graph_second_backward_recomputes_again() -> None:
    counts = {}

    def case(ck: Callable[..., Any]) -> list[torch.Tensor | None]:
        counter = CallCounter(lambda t: F.dropout(sin_chain(t), 0.5))
        x = torch.randn(8, dtype=torch.float64, requires_grad=True)
        loss = ck(counter, x).sum()
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        loss.backward()
        counts[ck] = counter.count
        return [first, x.grad]

    assert_matches_plain_and_torch(case)
    # One forward, then exactly one recomputation per backward.
    assert counts[checkpoint] == counts[torch_nonreentrant] == 3


@pytest.mark.parametrize("name", list(NON_REENTRANT))
def test_seed_001_whole_subnet_trains_without_touching_its_inputs(name: str) -> None:
    """No input requires grad: the reentrant variant gives the parameters no gradient; this one does."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    torch.manual_seed(2)
    net(x).square().sum().backward()
    reference = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    out = NON_REENTRANT[name](net, x)
    assert out.requires_grad and x.grad is None
    out.square().sum().backward()
    assert_all_equal([p.grad for p in net.parameters()], reference)


def test_double_backward_through_the_checkpoint() -> None:
    def case(ck: Callable[..., Any]) -> list[torch.Tensor | None]:
        x = torch.linspace(-1, 1, 5, dtype=torch.float64, requires_grad=True)
        (g,) = torch.autograd.grad(ck(lambda t: t.sin().exp(), x).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        return [g.detach(), gg]

    assert_matches_plain_and_torch(case)


# ---------------------------------------------------------------------------------- recomputation


@pytest.mark.parametrize("name", list(NON_REENTRANT))
def test_one_recomputation_per_backward(name: str) -> None:
    counter = CallCounter(sin_chain)
    x = torch.randn(8, requires_grad=True)
    out = NON_REENTRANT[name](counter, x)
    assert counter.count == 1
    # autograd.grad, then a full backward: each is its own graph task, each recomputes once.
    torch.autograd.grad(out.sum(), x, retain_graph=True)
    assert counter.count == 2
    out.sum().backward()
    assert counter.count == 3


@pytest.mark.parametrize("name", list(NON_REENTRANT))
def test_unpack_outside_backward_recomputes_each_time(name: str) -> None:
    counter = CallCounter(lambda t: t.sin().exp())
    x = torch.randn(4, requires_grad=True)
    out = NON_REENTRANT[name](counter, x)
    assert torch.equal(out.grad_fn._saved_result, out)
    assert torch.equal(out.grad_fn._saved_result, out)
    assert counter.count == 3
    out.sum().backward()
    assert counter.count == 4
    assert torch.equal(x.grad, (x.sin().exp() * x.cos()).detach())


def test_early_stop_skips_the_tail() -> None:
    """The re-run stops at the last saved tensor backward still needs; the rest is never re-run."""
    logs: dict[str, list[str]] = {}
    for name, ck in NON_REENTRANT.items():
        log: list[str] = []

        def fn(x: torch.Tensor, log: list[str] = log) -> torch.Tensor:
            log.append("head")
            y = x.sin()  # saves x: needed
            log.append("dead branch")
            unused = y.exp()  # saves its result, but ``unused`` dies with the forward
            log.append("tail")
            z = y * 2 + unused.detach()  # saves nothing
            log.append("end")
            return z

        x = torch.randn(3, requires_grad=True)
        out = ck(fn, x)
        log.clear()
        out.sum().backward()
        logs[name] = log
        assert torch.equal(x.grad, 2 * x.detach().cos())
    # Ours stops once every *live* handle is filled; torch counts dead ones too and re-runs exp.
    assert logs == {"ours": ["head"], "torch": ["head", "dead branch"]}


@pytest.mark.parametrize("name", list(NON_REENTRANT))
def test_early_stop_with_every_saved_tensor_needed(name: str) -> None:
    log: list[str] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        log.append("after sin")
        y = y.exp()  # saves its result: the last saved tensor
        log.append("after exp")
        return y * 3

    x = torch.randn(3, requires_grad=True)
    out = NON_REENTRANT[name](fn, x)
    log.clear()
    out.sum().backward()
    assert log == ["after sin"]


@pytest.mark.parametrize("name", list(NON_REENTRANT))
def test_caller_rng_stream_unchanged_by_forward_and_backward(name: str) -> None:
    def draws(ck: Callable[..., Any]) -> torch.Tensor:
        torch.manual_seed(3)
        x = torch.randn(32, requires_grad=True)
        ck(lambda t: F.dropout(t, 0.5).sin(), x).sum().backward()
        return torch.rand(4)

    assert torch.equal(draws(NON_REENTRANT[name]), draws(plain))


def test_under_no_grad_the_function_is_simply_called() -> None:
    sentinel = object()
    counter = CallCounter(lambda t, *, k: (t.sin(), k, torch.is_grad_enabled()))
    x = torch.randn(3, requires_grad=True)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            out, k, grad_enabled = checkpoint(counter, x, k=sentinel)
        assert k is sentinel and not grad_enabled and out.grad_fn is None
    assert counter.count == 2


# ----------------------------------------------------------------------------------------- memory


@pytest.mark.parametrize("name", list(NON_REENTRANT))
def test_live_memory_after_forward_is_the_output_only(name: str) -> None:
    x = torch.randn(1000, requires_grad=True)
    with LiveMemory() as mem:
        out = NON_REENTRANT[name](sin_chain, x)
        assert mem.snapshot("after forward") == out.nbytes == 4000
        out.sum().backward(retain_graph=True)
        # Recomputed tensors are dropped as backward uses them, even with retain_graph=True.
        assert mem.snapshot("after backward") == out.nbytes + x.grad.nbytes
    assert mem.peak_bytes > 6 * 4000


def exp_sin_chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(4):
        # exp saves its *output*: a recomputed tensor that kept its grad_fn would form a reference
        # cycle through the recomputed graph, which Python's garbage collector cannot break.
        x = x.exp().sin()
    return x


def test_memory_over_two_backwards_matches_torch_and_nothing_leaks() -> None:
    marks = {}
    for name, ck in NON_REENTRANT.items():
        x = torch.randn(1000, requires_grad=True)
        with LiveMemory() as mem:
            out = ck(exp_sin_chain, x)
            mem.snapshot("forward")
            out.sum().backward(retain_graph=True)
            mem.snapshot("backward 1")
            out.sum().backward()
            mem.snapshot("backward 2")
            del out
            mem.snapshot("output deleted")
        marks[name] = (mem.marks, mem.peak_bytes)
    expected = {"forward": 4000, "backward 1": 8000, "backward 2": 8000, "output deleted": 4000}
    assert marks["ours"] == marks["torch"] == (expected, 32008)


def test_plain_forward_keeps_the_activations() -> None:
    x = torch.randn(1000, requires_grad=True)
    with LiveMemory() as mem:
        out = sin_chain(x)
        # Five saved intermediates and the output (x itself was made outside).
        assert mem.snapshot("after forward") == 6 * out.nbytes


def test_nested_inner_inputs_are_dropped_by_the_outer_checkpoint() -> None:
    """An inner checkpoint's inputs are the outer one's activations: the outer one drops them too."""
    retained = {}
    for name, ck in ALL.items():

        def outer(x: torch.Tensor, ck: Callable[..., Any] = ck) -> torch.Tensor:
            return ck(lambda y: y.sin().exp(), x.sin().cos()).cos()

        x = torch.randn(1000, requires_grad=True)
        with LiveMemory() as mem:
            out = ck(outer, x)
            retained[name] = mem.snapshot("after forward")
        out.sum().backward()
    assert retained == {"plain": 4 * 4000, "ours": 4000, "torch": 4000}


def test_nested_inner_inputs_passed_by_keyword_are_dropped_too() -> None:
    """Ours saves keyword (and nested) tensor inputs through autograd as well; torch 2.13 keeps keyword
    arguments in a closure, so the outer checkpoint cannot drop them."""
    retained = {}
    for name, ck in NON_REENTRANT.items():

        def outer(x: torch.Tensor, ck: Callable[..., Any] = ck) -> torch.Tensor:
            return ck(lambda *, y: y.sin().exp(), y=x.sin().cos()).cos()

        x = torch.randn(1000, requires_grad=True)
        with LiveMemory() as mem:
            out = ck(outer, x)
            retained[name] = mem.snapshot("after forward")
        out.sum().backward()
    assert retained == {"ours": 4000, "torch": 8000}


def test_memory_report_matches_torch() -> None:
    reports = {}
    for name, ck in ALL.items():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 64))
        x = torch.randn(32, 64)
        reports[name] = measure_memory(lambda ck=ck, net=net, x=x: ck(net, x).sum())
    assert reports["ours"] == reports["torch"]
    assert reports["ours"].retained_bytes == 4  # the scalar loss: the output died inside ``sum``
    assert reports["plain"].retained_bytes > 32 * 256 * 4 * 3


def test_intermediates_die_after_forward_and_the_frame_dies_with_the_graph() -> None:
    refs: list[weakref.ref[torch.Tensor]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        refs.append(weakref.ref(y))
        return y.cos()

    x = torch.randn(5, requires_grad=True)
    out = checkpoint(fn, x)
    assert refs[0]() is None
    # The unpack hook's closure holds the frame; nothing else should.
    frame = weakref.ref(out.grad_fn._raw_saved_self.unpack_hook.__closure__[0].cell_contents)
    out.sum().backward()
    # Recomputation's intermediates are gone too; once the graph is freed, so is the frame.
    assert refs[1]() is None and frame() is None


# --------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("name", list(NON_REENTRANT))
def test_shape_change_between_forward_and_recomputation_raises(name: str) -> None:
    calls = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return (x if len(calls) == 1 else x[:2]).sin().sum()

    x = torch.randn(3, requires_grad=True)
    loss = NON_REENTRANT[name](fn, x)
    error = CheckpointError if name == "ours" else TorchCheckpointError
    with pytest.raises(error) as info:
        loss.backward()
    if name == "ours":
        message = str(info.value)
        assert "position 0" in message
        assert "shape=(3,), dtype=torch.float32, device=cpu" in message
        assert "shape=(2,), dtype=torch.float32, device=cpu" in message
        assert "don't branch on Python state" in message
    assert x.grad is None


def test_dtype_change_raises() -> None:
    calls = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        y = x.sin()
        return (y if len(calls) == 1 else y.double()).exp().sum()

    with pytest.raises(CheckpointError, match=r"position 1.*torch\.float32.*torch\.float64"):
        checkpoint(fn, torch.randn(3, requires_grad=True)).backward()


@pytest.mark.parametrize("name", list(NON_REENTRANT))
def test_fewer_saved_tensors_raises(name: str) -> None:
    calls = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        y = x.sin()
        return y.sin() if len(calls) == 1 else y

    loss = NON_REENTRANT[name](fn, torch.randn(3, requires_grad=True)).sum()
    error = CheckpointError if name == "ours" else TorchCheckpointError
    match = "different number of tensors"
    if name == "ours":  # torch's sentence first, then the counts, then what to do
        match += r"(.|\n)*forward: 2\nNumber of tensors saved during recomputation: 1\.\n(.|\n)*don't branch"
    with pytest.raises(error, match=match):
        loss.backward()


class _ReadsSavedTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        (x,) = ctx.saved_tensors
        return 2 * x * grad


@pytest.mark.parametrize("name", list(NON_REENTRANT))
def test_second_unpack_in_one_backward_raises(name: str) -> None:
    loss = NON_REENTRANT[name](lambda t: _ReadsSavedTwice.apply(t.sin()), torch.randn(3, requires_grad=True))
    error = CheckpointError if name == "ours" else TorchCheckpointError
    with pytest.raises(error, match="unpacked"):
        loss.sum().backward()


@pytest.mark.parametrize("name", list(NON_REENTRANT))
def test_input_modified_in_place_after_forward_raises(name: str) -> None:
    x = torch.randn(4, requires_grad=True)
    y = x * 1
    loss = NON_REENTRANT[name](sin_chain, y).sum()
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# ------------------------------------------------------------------------------------ property test


# Of oracle.CHAIN_OPS, on 4x4 tensors: in-place ops (also on a view), views and reshapes among them.
OPS = ["sin", "tanh", "exp", "square", "matmul", "dropout", "add_", "view_mul_", "transpose", "reshape"]


@settings(deadline=None, max_examples=25)
@given(
    names=st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=8),
    x_requires_grad=st.booleans(),
    nested=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_chains_match_plain_and_torch(
    names: list[str], x_requires_grad: bool, nested: bool, seed: int
) -> None:
    if not x_requires_grad:
        names = [*names, "matmul"]

    def case(ck: Callable[..., Any]) -> list[torch.Tensor | None]:
        torch.manual_seed(seed)
        weight = torch.randn(4, 4, requires_grad=True)
        x = torch.randn(4, 4, requires_grad=x_requires_grad)
        half = len(names) // 2

        def run(h: torch.Tensor, names: list[str]) -> torch.Tensor:
            return run_chain(names, h, h, weight)  # (h as x: no residual among OPS)

        def chain(x: torch.Tensor) -> torch.Tensor:
            if nested:
                return run(ck(run, x, names[:half]), names[half:])
            return run(x, names)

        (ck(chain, x) ** 2).sum().backward()
        return [x.grad, weight.grad, torch.rand(2)]

    # x.grad is None in all three where x needs no grad.
    assert_matches_plain_and_torch(case, allow_none=True)


# ------------------------------------------------------------------------------------------- CUDA


@cuda
def test_cuda_dropout_replay_and_rng_stream() -> None:
    def case(ck: Callable[..., Any]) -> list[torch.Tensor | None]:
        torch.cuda.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 8)).cuda()
        x = torch.randn(4, 16, device="cuda", requires_grad=True)
        ck(net, x).square().sum().backward()
        return [x.grad, *(p.grad for p in net.parameters()), torch.rand(3, device="cuda")]

    assert_matches_plain_and_torch(case)


@cuda
def test_cuda_autocast_is_replayed() -> None:
    def case(ck: Callable[..., Any]) -> list[torch.Tensor | None]:
        w = torch.randn(16, 16, device="cuda", requires_grad=True)
        x = torch.randn(8, 16, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = ck(lambda t: (t @ w).relu() @ w, x)
        assert out.dtype == torch.bfloat16
        out.float().sum().backward()
        return [x.grad, w.grad]

    assert_matches_plain_and_torch(case)


@cuda
def test_cuda_device_change_raises() -> None:
    calls = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return (x if len(calls) == 1 else x.cpu()).sin().sum()

    loss = checkpoint(fn, torch.randn(3, device="cuda", requires_grad=True))
    with pytest.raises(CheckpointError, match=r"device=cuda:0.*device=cpu"):
        loss.backward()


def test_containers_are_rebuilt_for_the_recomputation() -> None:
    # Documented difference from torch: the re-run gets the argument list as it was at call time.
    def appends_to(x: torch.Tensor, seen: list) -> torch.Tensor:
        seen.append(len(seen))
        return x.sin() * len(seen)

    ours_seen: list = []
    x = torch.randn(3, requires_grad=True)
    checkpoint(appends_to, x, ours_seen).sum().backward()
    ours = x.grad
    assert ours_seen == [0]  # the recomputation appended to a rebuilt copy
    x.grad = None
    torch_seen: list = []
    torch.utils.checkpoint.checkpoint(appends_to, x, torch_seen, use_reentrant=False).sum().backward()
    assert torch_seen == [0, 1]  # torch passed the caller's list again, which had changed
    plain = torch.autograd.grad(x.sin().sum() * 1, x)[0]
    assert torch.equal(ours, plain)  # ours recomputes what the forward computed


def _default_device_after(ck: Callable[..., Any]) -> Any:
    """torch.set_default_device("cpu"), a checkpointed forward and backward, set_default_device(None):
    what ``torch.utils._device.CURRENT_DEVICE`` is left at (None: put back)."""
    x = torch.randn(3, requires_grad=True)
    torch.set_default_device("cpu")
    try:
        ck(lambda t: (t.sin() * torch.ones(3)).cos(), x).sum().backward()
    finally:
        torch.set_default_device(None)
    return torch.utils._device.CURRENT_DEVICE


def test_the_default_device_is_put_back_after_the_recomputation(monkeypatch) -> None:
    # The re-run re-enters the caller's torch.device block as a fresh context on that device: entering
    # the forward's own DeviceContext again overwrote what its exit puts back, and the default device
    # outlived set_default_device(None). torch's checkpoint did the same until 2.14, which fixed it.
    monkeypatch.setattr(torch.utils._device, "CURRENT_DEVICE", None)  # put back after the test
    assert _default_device_after(checkpoint) is None
    torch.utils._device.CURRENT_DEVICE = None
    leaked = _default_device_after(torch_nonreentrant)
    assert leaked == (None if TORCH >= (2, 14) else torch.device("cpu"))  # torch's, as it is
    assert torch._C._len_torch_function_stack() == 0
