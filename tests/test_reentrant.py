"""Tests for ``ckpt_lab.reentrant``; torch's ``checkpoint(..., use_reentrant=True)`` is the oracle."""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ckpt_lab.instruments.counting import CallCounter
from ckpt_lab.instruments.memory import LiveMemory, measure_memory
from ckpt_lab.reentrant import CheckpointFunction, reentrant_checkpoint
from oracle import (
    REENTRANT,
    assert_all_equal,
    cuda,
    output_and_grads,
    plain,
    run_chain,
    saved_by,
    sin_chain,
    torch_reentrant,
)

ALL = {"plain": plain, **REENTRANT}


def grads_after(
    ckpt: Callable[..., Any],
    fn: Callable[..., Any],
    x: torch.Tensor,
    params: list[torch.Tensor],
    seed: int = 0,
) -> list[torch.Tensor | None]:
    """Grads of ``(ckpt(fn, x) ** 2).sum()`` w.r.t. a fresh copy of ``x`` and ``params`` (seeded)."""
    return output_and_grads(functools.partial(ckpt, fn), x, params, seed=seed)[1:]


def plain_grad(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The gradient of ``fn(x).sum()`` without any checkpoint."""
    x = x.detach().clone().requires_grad_()
    fn(x).sum().backward()
    return x.grad


# ------------------------------------------------------------------------------------- gradients


def test_sin_chain_grads_bitwise_equal_to_plain_and_torch() -> None:
    x = torch.randn(64, dtype=torch.float64)
    got = {name: grads_after(ck, sin_chain, x, []) for name, ck in ALL.items()}
    assert_all_equal(got["ours"], got["torch"])
    assert_all_equal(got["ours"], got["plain"])


def test_module_with_parameters() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8), nn.GELU())
    x = torch.randn(4, 16)
    got = {name: grads_after(ck, net, x, list(net.parameters())) for name, ck in ALL.items()}
    assert_all_equal(got["ours"], got["torch"])
    assert_all_equal(got["ours"], got["plain"])


def test_dropout_is_replayed_bitwise() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 8), nn.Dropout(0.3))
    x = torch.randn(4, 16)
    got = {name: grads_after(ck, net, x, list(net.parameters()), seed=1) for name, ck in ALL.items()}
    assert_all_equal(got["ours"], got["torch"])
    assert_all_equal(got["ours"], got["plain"])


def test_without_rng_restore_dropout_grads_differ() -> None:
    """preserve_rng_state=False: the recomputation draws a new mask, so grads are wrong (as torch's)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    params = list(net.parameters())
    reference = grads_after(plain, net, x, params, seed=1)
    ours = grads_after(
        lambda f, a: reentrant_checkpoint(f, a, preserve_rng_state=False), net, x, params, seed=1
    )
    theirs = grads_after(lambda f, a: torch_reentrant(f, a, preserve_rng_state=False), net, x, params, seed=1)
    assert not torch.equal(ours[0], reference[0])
    assert not torch.allclose(ours[0], reference[0])
    # Same RNG stream position at backward time, so the same (wrong) mask as torch's.
    assert_all_equal(ours, theirs)


def test_preserve_rng_state_false_without_randomness_is_exact() -> None:
    x = torch.randn(32, dtype=torch.float64)
    no_rng = lambda f, a: reentrant_checkpoint(f, a, preserve_rng_state=False)
    assert_all_equal(grads_after(no_rng, sin_chain, x, []), grads_after(plain, sin_chain, x, []))


def test_non_tensor_args_pass_through() -> None:
    def fn(x: torch.Tensor, scale: float, mode: str, nothing: None, y: torch.Tensor, n: int) -> torch.Tensor:
        assert mode == "tanh" and nothing is None and n == 3
        return torch.tanh(x * scale) * y**n

    results = {}
    for name, ck in ALL.items():
        x = torch.linspace(-1, 1, 10, requires_grad=True)
        y = torch.linspace(0.5, 2, 10, requires_grad=True)
        ck(fn, x, 1.5, "tanh", None, y, 3).sum().backward()
        results[name] = [x.grad, y.grad]
    assert_all_equal(results["ours"], results["torch"])
    assert_all_equal(results["ours"], results["plain"])


def test_tensor_input_without_grad_among_others() -> None:
    """Only inputs that require grad get one; a constant tensor input stays a constant."""
    x = torch.randn(5, requires_grad=True)
    mask = torch.rand(5) > 0.5
    reentrant_checkpoint(lambda a, m: (a.sin() * m).sum(), x, mask).backward()
    assert torch.equal(x.grad, x.detach().cos() * mask)
    assert mask.grad is None


def test_several_outputs_some_unused_and_non_tensor_outputs() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, int, str, torch.Tensor, torch.Tensor]:
        return x.sin(), 3, "tag", x.cos(), x.exp()

    results = {}
    for name, ck in ALL.items():
        x = torch.linspace(-1, 1, 7, dtype=torch.float64, requires_grad=True)
        a, n, tag, _unused, c = ck(fn, x)
        assert (n, tag) == (3, "tag")
        (a * c).sum().backward()
        results[name] = [x.grad]
    assert_all_equal(results["ours"], results["torch"])
    assert_all_equal(results["ours"], results["plain"])


def test_output_that_is_not_differentiable_is_skipped() -> None:
    """An integer output has no gradient; the other output still backpropagates."""
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    y, idx = reentrant_checkpoint(lambda t: (t.sin(), t.argmax()), x)
    assert not idx.requires_grad
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().cos())


def test_grad_mode_off_in_forward_on_in_recomputation() -> None:
    """Function.apply already disables grad in forward: torch's extra no_grad is redundant."""
    modes: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        modes.append(torch.is_grad_enabled())
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    y = CheckpointFunction.apply(fn, True, x)
    assert modes == [False]
    y.sum().backward()
    assert modes == [False, True]


def test_double_backward_with_retain_graph_recomputes_again() -> None:
    counter = CallCounter(sin_chain)
    x = torch.randn(8, dtype=torch.float64, requires_grad=True)
    loss = reentrant_checkpoint(counter, x).sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    assert counter.count == 3
    assert torch.equal(x.grad, 2 * first)


# ---------------------------------------------------------------------------------------- limits


def test_warning_when_no_input_requires_grad() -> None:
    net = nn.Linear(4, 4)
    with pytest.warns(UserWarning) as record:
        y = reentrant_checkpoint(net, torch.randn(2, 4))
    message = str(record[0].message)
    assert record[0].filename == __file__  # stacklevel points at the caller
    assert message.startswith("None of the inputs have requires_grad=True. Gradients will be None.")
    assert "output will not require grad" in message
    assert "parameters used inside the function will get no gradient" in message
    assert "requires_grad_()" in message and "ckpt_lab.checkpoint" in message
    assert not y.requires_grad


@pytest.mark.parametrize("name", list(REENTRANT))
def test_seed_001_whole_subnet_input_without_grad(name: str) -> None:
    """Seed 001's failure: checkpoint a whole subnet whose input needs no grad -> warning, then the
    loss is a constant and backward fails; the parameters inside get no gradient either way."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="requires_grad"):
        loss = REENTRANT[name](net, x).sum()
    with pytest.raises(RuntimeError, match="element 0 of tensors does not require grad"):
        loss.backward()
    assert all(p.grad is None for p in net.parameters())


def test_under_no_grad_the_function_is_simply_called() -> None:
    counter = CallCounter(sin_chain)
    x = torch.randn(4, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            y = reentrant_checkpoint(counter, x)
    assert counter.count == 1 and not y.requires_grad and y.grad_fn is None
    assert torch.equal(y, sin_chain(x.detach()))


AUTOGRAD_GRAD_MESSAGES = {
    "ours": [
        "torch.autograd.grad()",
        "backward(inputs=...)",
        "accumulates into .grad",
        "ckpt_lab.checkpoint",
    ],
    "torch": ["incompatible with .grad()", "use_reentrant=False"],
}


@pytest.mark.parametrize("name", list(REENTRANT))
def test_autograd_grad_raises_and_a_later_backward_still_works(name: str) -> None:
    """The check runs before anything is recomputed or accumulated, and the node's saved input is
    only released after a *successful* backward, so the graph survives: a plain backward works."""
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    loss = REENTRANT[name](sin_chain, x).sum()
    with pytest.raises(RuntimeError) as error:
        torch.autograd.grad(loss, x)
    for fragment in AUTOGRAD_GRAD_MESSAGES[name]:
        assert fragment in str(error.value)
    assert x.grad is None
    loss.backward()
    assert torch.equal(x.grad, plain_grad(sin_chain, x))


@pytest.mark.parametrize("name", list(REENTRANT))
def test_after_autograd_grad_error_nodes_before_the_checkpoint_are_freed(name: str) -> None:
    """...but only if no node between the loss and the checkpoint had saved tensors: those already ran
    in the failed pass and released them (unless retain_graph=True)."""
    x = torch.randn(5, requires_grad=True)
    loss = (REENTRANT[name](sin_chain, x) ** 2).sum()  # PowBackward saves its input
    with pytest.raises(RuntimeError, match=r"\.grad\(\)"):
        torch.autograd.grad(loss, x)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()

    loss = (REENTRANT[name](sin_chain, x) ** 2).sum()
    with pytest.raises(RuntimeError, match=r"\.grad\(\)"):
        torch.autograd.grad(loss, x, retain_graph=True)
    loss.backward()
    assert x.grad is not None


@pytest.mark.parametrize("name", list(REENTRANT))
def test_backward_with_inputs_raises_and_a_later_backward_still_works(name: str) -> None:
    x = torch.randn(5, requires_grad=True)
    w = torch.randn(5, requires_grad=True)
    loss = REENTRANT[name](lambda a, b: (a * b).sin(), x, w).sum()
    with pytest.raises(RuntimeError, match=r"inputs"):
        loss.backward(inputs=[x])
    assert x.grad is None and w.grad is None
    loss.backward()
    assert torch.equal(x.grad, (x * w).detach().cos() * w.detach())


def test_no_recomputed_output_requires_grad_raises() -> None:
    x = torch.randn(3, requires_grad=True)
    # The forward output requires grad (an input does), but the recomputed one is a constant.
    y = reentrant_checkpoint(lambda t: torch.ones(3), x)
    assert y.requires_grad
    with pytest.raises(RuntimeError, match="none of the recomputed outputs requires grad"):
        y.sum().backward()
    y = reentrant_checkpoint(lambda t: t.detach() * 2, x)
    with pytest.raises(RuntimeError, match=r"this checkpoint\(\) is not necessary(.|\n)*detach its result"):
        y.sum().backward()


# ------------------------------------------------------------------------------------------- RNG


def dropout_chain(x: torch.Tensor) -> torch.Tensor:
    return F.dropout(F.dropout(x.sin(), 0.5).tanh(), 0.2)


def test_caller_rng_stream_unchanged_by_forward_and_backward() -> None:
    x = torch.randn(100, requires_grad=True)
    torch.manual_seed(3)
    dropout_chain(x)
    expected_after_forward = torch.rand(10)

    torch.manual_seed(3)
    y = reentrant_checkpoint(dropout_chain, x)
    state = torch.get_rng_state()
    assert torch.equal(torch.rand(10), expected_after_forward)  # the snapshot drew nothing
    torch.set_rng_state(state)
    y.sum().backward()  # the recomputation replays the forward's draws inside a fork
    assert torch.equal(torch.get_rng_state(), state)


# -------------------------------------------------------------------------------- recompute count


@pytest.mark.parametrize("name", list(REENTRANT))
def test_function_runs_once_in_forward_once_in_backward(name: str) -> None:
    counter = CallCounter(sin_chain)
    x = torch.randn(8, requires_grad=True)
    y = REENTRANT[name](counter, x)
    assert counter.count == 1
    y.sum().backward()
    assert counter.count == 2


def test_module_forward_count() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    counter = CallCounter(net)
    reentrant_checkpoint(net, torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert counter.count == 2
    counter.remove()


# ---------------------------------------------------------------------------------------- memory


def test_only_the_tensor_inputs_are_saved() -> None:
    x = torch.randn(1000, requires_grad=True)
    assert len(saved_by(plain, sin_chain, x)) == 6  # every sin saves its input
    for ck in REENTRANT.values():
        saved = saved_by(ck, sin_chain, x)
        assert len(saved) == 1 and saved[0] is x

    w = torch.randn(1000)
    saved = saved_by(reentrant_checkpoint, lambda a, k, b: (a * b).sin() * k, x, 2.0, w)
    assert [t is s for t, s in zip(saved, [x, w], strict=True)] == [True, True]


def test_live_memory_after_forward_is_the_output_only() -> None:
    x = torch.randn(1000, requires_grad=True)
    live = {}
    for name, ck in ALL.items():
        with LiveMemory() as mem:
            y = ck(sin_chain, x)
            live[name] = mem.snapshot("after forward")
            del y
    assert live == {"plain": 6 * 4000, "ours": 4000, "torch": 4000}


def test_memory_report_matches_torch() -> None:
    reports = {}
    for name, ck in ALL.items():
        x = torch.randn(1000, requires_grad=True)
        reports[name] = measure_memory(lambda ck=ck, x=x: ck(sin_chain, x).sum())
    # Only the 4-byte loss outlives the checkpointed forward; plain keeps 5 intermediates (4000 B each).
    assert reports["ours"].retained_bytes == reports["torch"].retained_bytes == 4
    assert reports["plain"].retained_bytes == 5 * 4000 + 4
    assert reports["ours"] == reports["torch"]


def test_intermediates_die_after_forward() -> None:
    refs: list[weakref.ref[torch.Tensor]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        for _ in range(5):
            x = x.sin()
            refs.append(weakref.ref(x))
        return x.sin()

    x = torch.randn(100, requires_grad=True)
    y = reentrant_checkpoint(fn, x)
    assert [r() for r in refs] == [None] * 5
    y.sum().backward()
    assert torch.equal(x.grad, plain_grad(fn, x))


# ------------------------------------------------------------------------------------------ CUDA


@cuda
def test_cuda_dropout_replay_matches_torch_and_plain() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 8)).cuda()
    x = torch.randn(16, 64, device="cuda")
    got = {name: grads_after(ck, net, x, list(net.parameters()), seed=7) for name, ck in ALL.items()}
    assert_all_equal(got["ours"], got["torch"])
    assert_all_equal(got["ours"], got["plain"])  # bitwise on an H100 too (torch 2.11 + cu130)
    # Without the RNG snapshot the CUDA generator draws a fresh mask in the recomputation.
    no_rng = lambda f, a: reentrant_checkpoint(f, a, preserve_rng_state=False)
    assert not torch.allclose(grads_after(no_rng, net, x, list(net.parameters()), seed=7)[0], got["plain"][0])


@cuda
def test_cuda_caller_rng_stream_unchanged_by_backward() -> None:
    x = torch.randn(1000, device="cuda", requires_grad=True)
    y = reentrant_checkpoint(dropout_chain, x)
    cpu, gpu = torch.get_rng_state(), torch.cuda.get_rng_state()
    y.sum().backward()
    assert torch.equal(torch.get_rng_state(), cpu)
    assert torch.equal(torch.cuda.get_rng_state(), gpu)


@cuda
def test_cuda_autocast_is_replayed() -> None:
    """The recomputation runs under the forward's autocast even when backward runs outside it."""
    dtypes: list[torch.dtype] = []
    w = torch.randn(32, 32, device="cuda", requires_grad=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x @ w
        dtypes.append(y.dtype)
        return y

    x = torch.randn(8, 32, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = reentrant_checkpoint(fn, x)
    y.float().sum().backward()
    assert dtypes == [torch.bfloat16, torch.bfloat16]


# ---------------------------------------------------------------------------------------- property

# Names of oracle.CHAIN_OPS.
OPS = st.sampled_from(["sin", "tanh", "scale", "matmul", "dropout"])


@settings(deadline=None, max_examples=25)
@given(ops=st.lists(OPS, min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_random_chains_match_plain_and_torch(ops: list[str], seed: int) -> None:
    torch.manual_seed(seed)
    # Closed over, not an input: the weight gets its gradient from the recomputation's own backward.
    w = (torch.randn(8, 8, dtype=torch.float64) / 8**0.5).requires_grad_()
    x = torch.randn(4, 8, dtype=torch.float64)
    chain = lambda t: run_chain(ops, t, t, w)
    params = [w] if "matmul" in ops else []
    got = {name: grads_after(ck, chain, x, params, seed=seed) for name, ck in ALL.items()}
    assert_all_equal(got["ours"], got["torch"])
    assert_all_equal(got["ours"], got["plain"])
