"""The remaining hard inputs, each with a clear error (or, where torch accepts it, accepted).

* a freshly scripted TorchScript function under ``ckpt_lab.checkpoint``: its executor profiles the
  first run and runs an optimized graph (one ``CppFunction`` node) from the second, so the forward and
  the re-run take different autograd paths; TorchScript turns any exception a saved-tensor hook raises
  into a bare ``RuntimeError`` with an empty message (torch 2.13's checkpoint fails so, asserted as it
  is); ours raises its ``CheckpointError`` saying what differed, runs a warmed-up scripted function
  with the plain gradients, and names a re-run that differs inside the scripted code;
* ``plan_peak`` with a loss that is not a scalar, a region that is not callable, ``loss=None``;
* ``compile_step``'s budget outside [0, 1] or NaN;
* ``checkpoint(use_reentrant=False)(fn, x)``: the error names the right form;
* ``reentrant_checkpoint(..., respect_saved_tensors_hooks=True)``: the error names the keyword passed;
* ``debug=True`` with ``context_fn=torch.utils.checkpoint.noop_context_fn``: accepted, as torch does.
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckpt_lab
from ckpt_lab.compiled import compile_step
from ckpt_lab.errors import CheckpointError
from ckpt_lab.peak_planner import plan_peak

# torch.jit.script is deprecated in favour of torch.compile; scripted functions still run, so they are tested.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


def scripted_chain(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * 2).exp().cos()


def scripted_sin_exp(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp()


def scripted_cos_exp(x: torch.Tensor) -> torch.Tensor:
    return x.cos().exp()


def fresh_scripted_chain() -> torch.jit.ScriptFunction:
    """A scripted function never run before: torch.jit.script caches by function object, so each call
    compiles a new one, whatever ran earlier in the process."""

    def chain(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 2).exp().cos()  # scripted_chain, as a new function object

    return torch.jit.script(chain)


def test_torch_213_fails_on_a_fresh_scripted_function_with_an_empty_message() -> None:
    x = torch.randn(4, requires_grad=True)
    out = torch_checkpoint(fresh_scripted_chain(), x, use_reentrant=False)
    if torch.__version__.startswith("2.13"):
        with pytest.raises(RuntimeError, match=r"(?s)TorchScript interpreter.*\nRuntimeError: \n$"):
            out.sum().backward()


def test_ours_names_what_differs_on_a_fresh_scripted_function() -> None:
    x = torch.randn(4, requires_grad=True)
    for early_stop in (True, False):
        out = ckpt_lab.checkpoint(fresh_scripted_chain(), x, early_stop=early_stop)
        with pytest.raises(CheckpointError, match=r"took another path than the forward.*CppFunction"):
            out.sum().backward()


def test_ours_runs_a_warmed_up_scripted_function_with_the_plain_gradients() -> None:
    x = torch.randn(4, requires_grad=True)
    (right,) = torch.autograd.grad(scripted_chain(x).sum(), x)
    for early_stop in (True, False):
        scripted = fresh_scripted_chain()
        for _ in range(2):  # the profiling run, then the optimized graph's first
            scripted(x.detach())
        out = ckpt_lab.checkpoint(scripted, x, early_stop=early_stop)
        (got,) = torch.autograd.grad(out.sum(), x)
        assert torch.allclose(got, right)


def test_a_scripted_rerun_that_differs_raises_our_error_not_an_empty_one() -> None:
    x = torch.randn(4, requires_grad=True)
    calls = itertools.count()
    first, later = torch.jit.script(scripted_sin_exp), torch.jit.script(scripted_cos_exp)
    out = ckpt_lab.checkpoint(lambda t: first(t) if next(calls) == 0 else later(t), x)
    with pytest.raises(CheckpointError, match=r"through aten\.sin in the forward and through aten\.cos"):
        out.sum().backward()


# --------------------------------------------------------------------------------------- plan_peak
BLOCKS = [nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2)]


def test_plan_peak_refuses_a_loss_that_is_not_a_scalar() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"loss must return a scalar tensor .* a tensor of shape \(4, 8\)"):
        plan_peak(BLOCKS, x, budget=2**30, loss=lambda y: y.square())


def test_plan_peak_names_a_region_that_is_not_callable_and_a_missing_loss() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match=r"region 1 of functions is int 3, not a callable"):
        plan_peak([BLOCKS[0], 3], x, budget=2**30)
    with pytest.raises(TypeError, match=r"loss must be a callable .* got None"):
        plan_peak(BLOCKS, x, budget=2**30, loss=None)


# ------------------------------------------------------------------------------------ compile_step
@pytest.mark.parametrize("budget", [-0.1, 1.5, math.nan, "0.5", True])
def test_compile_step_checks_its_budget_before_compiling(budget: object) -> None:
    with pytest.raises(ValueError, match=rf"budget must be a number from 0 to 1 .* got {budget!r}"):
        compile_step(torch.sin, torch.randn(3, requires_grad=True), budget=budget)


# ---------------------------------------------------------------- torch's keywords, misplaced
def test_the_configured_form_called_with_the_arguments_names_the_right_form() -> None:
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError) as info:
        ckpt_lab.checkpoint(use_reentrant=False)(torch.sin, x)
    message = str(info.value)
    assert "lambda" not in message
    assert "checkpoint(**keywords)(function)(*args)" in message and "checkpoint(function, *args" in message
    # The right form works.
    assert torch.equal(ckpt_lab.checkpoint(use_reentrant=False)(torch.sin)(x), x.sin())


@pytest.mark.parametrize(
    "keyword", [{"respect_saved_tensors_hooks": True}, {"debug": True}, {"context_fn": lambda: (None, None)}]
)
def test_reentrant_names_the_keyword_it_was_passed(keyword: dict) -> None:
    x = torch.randn(3, requires_grad=True)
    (name,) = keyword
    with pytest.raises(ValueError) as info:
        ckpt_lab.reentrant_checkpoint(torch.sin, x, **keyword)
    # torch's sentence first, then the keyword this call passed.
    torch_sentence = "Passing `context_fn` or `debug` is only supported when use_reentrant=False."
    assert str(info.value).startswith(torch_sentence)
    assert f"reentrant_checkpoint got {name}=" in str(info.value)


def test_debug_with_torchs_own_noop_context_fn_is_accepted_as_torch_does() -> None:
    x = torch.randn(3, requires_grad=True)
    noop = torch.utils.checkpoint.noop_context_fn
    torch_checkpoint(torch.sin, x, use_reentrant=False, debug=True, context_fn=noop).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    ckpt_lab.checkpoint(torch.sin, x, debug=True, context_fn=noop).sum().backward()
    assert torch.equal(x.grad, expected)
    # A re-run that differs is still explained side by side.
    calls = itertools.count()
    out = ckpt_lab.checkpoint(
        lambda t: t.sin().exp() if next(calls) == 0 else t.cos().exp(), x, debug=True, context_fn=noop
    )
    with pytest.raises(CheckpointError, match="first difference"):
        out.sum().backward()


# --------------------------------------------------------------- a SAC policy that saves nothing
def test_a_function_policy_that_saves_nothing_is_told_so() -> None:
    aten = torch.ops.aten
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    block = lambda t: (t @ w).relu() @ w

    def packet_policy(ctx, op, *args, **kwargs):
        return op == aten.mm  # an overload is never equal to its packet

    with pytest.warns(UserWarning, match=r"saved none of the 3 ops it was shown \(aten\.mm\.default, "):
        ckpt_lab.selective_checkpoint(block, x, policy=packet_policy).sum().backward()
    # A policy that saves, and a list (refused by torch when it holds packets): no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt_lab.selective_checkpoint(block, x, policy=lambda ctx, op, *a, **k: op == aten.mm.default)
        ckpt_lab.selective_checkpoint(block, x, policy=[aten.mm.default])
