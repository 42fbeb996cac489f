"""State that changes between the forward and the re-run (ckpt_lab.state_guard): named, put back, and
``is_recomputing()`` inside every checkpoint's re-run of ours."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckpt_lab
from ckpt_lab.cases.field import TOKENS, WIDTH, Attention, LoadCountingMoE
from ckpt_lab.errors import CheckpointError
from ckpt_lab.selective import selective_checkpoint

aten = torch.ops.aten


def counted(run) -> int:
    model = LoadCountingMoE()
    run(model, torch.randn(TOKENS, WIDTH)).sum().backward()
    return int(model.tokens_per_expert.sum())


def test_the_load_counter_counts_twice_under_torch_and_ours_by_default() -> None:
    assert counted(lambda m, x: torch_checkpoint(m, x, use_reentrant=False)) == 2 * TOKENS
    assert counted(lambda m, x: ckpt_lab.checkpoint(m, x)) == 2 * TOKENS
    assert counted(lambda m, x: m(x)) == TOKENS


def test_warn_and_raise_name_the_module_path_the_attribute_and_the_change() -> None:
    with pytest.warns(UserWarning) as record:
        assert counted(lambda m, x: ckpt_lab.checkpoint(m, x, state_check="warn")) == 2 * TOKENS
    message = str(record[0].message)
    assert "LoadCountingMoE.tokens_per_expert: a tensor of shape (2,) at version 0 -> " in message
    assert "at version 1" in message and "test_state_guard.py:" in message
    with pytest.raises(CheckpointError, match=r"Attention\.cache: a list of length 0 -> a list of length 1"):
        model = Attention()
        ckpt_lab.checkpoint(model, torch.randn(TOKENS, WIDTH), state_check="raise").sum().backward()


def test_restore_runs_the_rerun_on_the_forwards_state_and_leaves_no_trace() -> None:
    assert counted(lambda m, x: ckpt_lab.checkpoint(m, x, state_check="restore")) == TOKENS
    x = torch.randn(TOKENS, WIDTH)
    plain = Attention()
    right = torch.autograd.grad(plain(x).sum(), list(plain.parameters()))
    model = Attention()
    out = ckpt_lab.checkpoint(model, x, state_check="restore")
    got = torch.autograd.grad(out.sum(), list(model.parameters()))
    assert all(torch.equal(g, r) for g, r in zip(got, right, strict=True))
    assert len(model.cache) == 1  # the forward's append stays; the re-run's is gone


def test_restore_rebinds_an_activation_attribute_without_writing_into_it() -> None:
    class Caching(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.last: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.last = self.lin(x).relu()
            return self.last.sin()

    model, x = Caching(), torch.randn(3, 4, requires_grad=True)
    out = ckpt_lab.checkpoint(model, x, state_check="restore")
    forward_last = model.last
    out.sum().backward()  # no in-place error: the activation was rebound, not copied into
    assert model.last is forward_last and forward_last._version == 0


@pytest.mark.parametrize("variant", ["non-reentrant", "reentrant", "selective", "sequential"])
def test_is_recomputing_is_true_in_our_reruns_only(variant: str) -> None:
    seen: list[bool] = []

    def region(t: torch.Tensor) -> torch.Tensor:
        seen.append(ckpt_lab.is_recomputing())
        return t.sin().exp()

    x = torch.randn(4, requires_grad=True)
    run = {
        "non-reentrant": lambda: ckpt_lab.checkpoint(region, x),
        "reentrant": lambda: ckpt_lab.reentrant_checkpoint(region, x),
        "selective": lambda: selective_checkpoint(region, x, policy=[aten.exp.default]),
        "sequential": lambda: ckpt_lab.checkpoint_sequential([region, region], 2, x, use_reentrant=False),
    }[variant]
    out = run()
    assert not any(seen) and not ckpt_lab.is_recomputing()
    out.sum().backward()
    assert any(seen) and not all(seen) and not ckpt_lab.is_recomputing()


def test_is_recomputing_counts_once_with_the_counter() -> None:
    counts = counted(lambda m, x: ckpt_lab.checkpoint(m, x))
    model = LoadCountingMoE(guard_with_is_recomputing=True)
    ckpt_lab.checkpoint(model, torch.randn(TOKENS, WIDTH)).sum().backward()
    assert counts == 2 * TOKENS and int(model.tokens_per_expert.sum()) == TOKENS


def test_what_it_cannot_see_a_global_and_a_closures_number() -> None:
    # Documented: globals and values a closure holds (not modules) are out of its sight.
    state = {"calls": 0}

    def region(t: torch.Tensor) -> torch.Tensor:
        state["calls"] += 1
        return t.sin()

    x = torch.randn(3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt_lab.checkpoint(region, x, state_check="raise").sum().backward()
    assert state["calls"] == 2


def test_the_modules_it_finds_a_bound_method_a_partial_and_a_closure() -> None:
    model = LoadCountingMoE()
    x = torch.randn(TOKENS, WIDTH)
    for function in (model.forward, functools.partial(model), lambda t: model(t)):
        with pytest.raises(CheckpointError, match=r"LoadCountingMoE\.tokens_per_expert"):
            ckpt_lab.checkpoint(function, x, state_check="raise").sum().backward()


def test_state_check_must_be_one_of_its_values() -> None:
    with pytest.raises(
        ValueError, match=r"state_check should be one of \['none', 'warn', 'raise', 'restore'\]"
    ):
        ckpt_lab.checkpoint(torch.sin, torch.randn(2, requires_grad=True), state_check="yes")
