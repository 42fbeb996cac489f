"""The non-reentrant checkpoint's re-run check sees every op, not only the makers of saved tensors.

NOTE [ Every op is compared ] in ckpt_lab/nonreentrant.py. The families below differ in an op whose
output is never saved (sin and cos both save their input; exp, relu and tanh save their output), so
every saved tensor has the same maker in the forward and the re-run: torch's checkpoint gives wrong
gradients there (asserted as it is), ours raises ``CheckpointError`` naming both ops and the line.
Then the legitimate cases that must not raise, each against the plain run, bitwise.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckpt_lab
from ckpt_lab.errors import CheckpointError
from ckpt_lab.nonreentrant import set_checkpoint_debug_enabled, set_checkpoint_early_stop


def flips(first: Callable, later: Callable) -> Callable:
    """``first`` on the first call, ``later`` on every call after (the forward, then the re-run)."""
    calls = itertools.count()
    return lambda t: first(t) if next(calls) == 0 else later(t)


# (forward, re-run, the aten op of each that the error must name)
FAMILIES = {
    "sin/cos then exp": (lambda t: t.sin().exp(), lambda t: t.cos().exp(), "aten.sin", "aten.cos"),
    "add/sub then relu": (lambda t: (t + 1).relu(), lambda t: (t - 1).relu(), "aten.add", "aten.sub"),
    "sin/cos then tanh": (lambda t: t.sin().tanh(), lambda t: t.cos().tanh(), "aten.sin", "aten.cos"),
    # Deeper: a scalar multiplication (saves no tensor) between the differing op and the saving one.
    "sin/cos, mul, then exp": (
        lambda t: (t.sin() * 3).exp(),
        lambda t: (t.cos() * 3).exp(),
        "aten.sin",
        "aten.cos",
    ),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_gives_wrong_gradients_on_these_families(family: str) -> None:
    first, later, _, _ = FAMILIES[family]
    x = torch.randn(6, requires_grad=True, generator=torch.Generator().manual_seed(0))
    right = torch.autograd.grad(first(x).sum(), x)[0]
    out = torch_checkpoint(flips(first, later), x, use_reentrant=False)
    got = torch.autograd.grad(out.sum(), x)[0]
    assert not torch.equal(got, right)  # torch's behaviour, as it is: silently wrong


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_ours_raises_naming_both_ops_and_the_line(family: str, early_stop: bool, debug: bool) -> None:
    first, later, forward_op, rerun_op = FAMILIES[family]
    x = torch.randn(6, requires_grad=True, generator=torch.Generator().manual_seed(0))
    with set_checkpoint_early_stop(early_stop), set_checkpoint_debug_enabled(debug):
        out = ckpt_lab.checkpoint(flips(first, later), x)
        with pytest.raises(CheckpointError) as info:
            out.sum().backward()
    message = str(info.value)
    assert f"through {forward_op} in the forward and through {rerun_op} in the re-run" in message
    # The user's line: the lambda in FAMILIES, in this file.
    assert "test_rerun_history.py:" in message and "in <lambda>" in message
    if debug:
        assert message.startswith("You are seeing this error because you passed `debug=True`")
        assert "first difference" in message
    else:
        assert message.startswith("checkpoint: the recomputation took another path than the forward")
    # determinism_check="none" compares nothing: torch's keyword keeps its meaning.
    x.grad = None
    ckpt_lab.checkpoint(flips(first, later), x, determinism_check="none").sum().backward()


# ================================================================== no false positives
def grads(run: Callable, model: Callable, inputs: list[torch.Tensor], params: list[torch.Tensor]) -> list:
    """The gradients of ``run(model, *inputs)``'s sum with respect to inputs and parameters."""
    torch.manual_seed(0)
    out = run(model, *inputs)
    out = out[0] if isinstance(out, tuple) else out
    leaves = [t for t in [*inputs, *params] if t.requires_grad]
    return list(torch.autograd.grad(out.real.sum() if out.is_complex() else out.sum(), leaves))


def checkpointed(model: Callable, *inputs: torch.Tensor) -> torch.Tensor:
    return ckpt_lab.checkpoint(model, *inputs)


def plain(model: Callable, *inputs: torch.Tensor) -> torch.Tensor:
    return model(*inputs)


def case(name: str) -> tuple[Callable, list[torch.Tensor], list[torch.Tensor]]:
    """A legitimate region, its inputs and its parameters (fresh for each call, seeded)."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, requires_grad=True)
    if name == "autocast":
        lin = nn.Linear(8, 8)

        def model(t: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return lin(t).relu().float()

        return model, [x], list(lin.parameters())
    if name == "in-place on intermediates":

        def model(t: torch.Tensor) -> torch.Tensor:
            y = t * 2
            y.add_(1)
            y[:, 0].mul_(3)
            z = y.sin()
            z.relu_()
            return z * t

        return model, [x], []
    if name == "views":
        return (lambda t: t.view(10, 8).t().sin()[1:].exp().unsqueeze(0).expand(2, -1, -1)), [x], []
    if name == "SDPA":
        sdpa = nn.functional.scaled_dot_product_attention
        return (lambda t: sdpa(t, t.cos(), t.sin(), is_causal=True)), [x], []
    if name == "MultiheadAttention":
        mha = nn.MultiheadAttention(8, 2, batch_first=True, dropout=0.1)
        return (lambda t: mha(t, t, t)[0]), [x], list(mha.parameters())
    if name == "LSTM":
        lstm = nn.LSTM(8, 8, num_layers=2, batch_first=True, dropout=0.1)
        return (lambda t: lstm(t)[0]), [x], list(lstm.parameters())
    if name == "GRU":
        gru = nn.GRU(8, 8, batch_first=True)
        return (lambda t: gru(t)[0]), [x], list(gru.parameters())
    if name == "Embedding max_norm":
        emb = nn.Embedding(10, 8, max_norm=1.0)
        ids = torch.tensor([[1, 2, 2], [3, 1, 0]])
        return (lambda t: emb(ids) * t[:, :3]), [x], list(emb.parameters())
    if name == "sparse":
        sparse = torch.eye(8).to_sparse()
        return (lambda t: torch.sparse.mm(sparse, t[0].t()).relu()), [x], []
    if name == "complex":
        return (lambda t: torch.view_as_complex(t.reshape(2, 5, 4, 2)).exp().abs()), [x], []
    if name == "nested checkpoints":
        lin = nn.Linear(8, 8)

        def inner(t: torch.Tensor) -> torch.Tensor:
            return lin(t).sin()

        def model(t: torch.Tensor) -> torch.Tensor:
            y = ckpt_lab.checkpoint(inner, t.cos())
            y = torch_checkpoint(inner, y, use_reentrant=False)
            return ckpt_lab.checkpoint(inner, y).exp()

        return model, [x], list(lin.parameters())
    if name == "dropout":
        return (lambda t: nn.functional.dropout(t.sin(), 0.5).exp()), [x], []
    raise KeyError(name)


LEGITIMATE = [
    "autocast", "in-place on intermediates", "views", "SDPA", "MultiheadAttention", "LSTM", "GRU",
    "Embedding max_norm", "sparse", "complex", "nested checkpoints", "dropout",
]  # fmt: skip


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("name", LEGITIMATE)
def test_legitimate_regions_pass_with_the_plain_gradients(name: str, early_stop: bool) -> None:
    right = grads(plain, *case(name))
    with set_checkpoint_early_stop(early_stop):
        got = grads(checkpointed, *case(name))
    for g, r in zip(got, right, strict=True):
        assert torch.equal(g, r), name


@pytest.mark.parametrize("name", ["MultiheadAttention", "nested checkpoints", "in-place on intermediates"])
def test_retain_graph_create_graph_and_autograd_grad(name: str) -> None:
    model, inputs, _ = case(name)
    torch.manual_seed(0)
    out = ckpt_lab.checkpoint(model, *inputs).sum()
    # Two backwards of one graph (two re-runs), then a double backward through create_graph.
    first = torch.autograd.grad(out, inputs, retain_graph=True)[0]
    (again,) = torch.autograd.grad(out, inputs, retain_graph=True, create_graph=True)
    assert torch.equal(first, again)
    again.sum().backward()
    model, inputs, _ = case(name)
    torch.manual_seed(0)
    (plain_first,) = torch.autograd.grad(model(*inputs).sum(), inputs)
    assert torch.equal(first, plain_first)


def test_the_check_does_not_keep_the_forwards_nodes() -> None:
    # The walk holds the nodes it has seen only while the forward runs; afterwards only names remain.
    x = torch.randn(4, requires_grad=True)
    out = ckpt_lab.checkpoint(lambda t: t.sin().exp(), x)
    frame = ckpt_lab.nonreentrant.frame_of(out.grad_fn._raw_saved_result)
    assert frame.history is None
    assert frame.histories == [(), ("ExpBackward0", "SinBackward0")]


def test_makers_only_is_the_cheaper_check_that_misses_these() -> None:
    # determinism_check="makers" (ours): shapes and makers only, as before the walk; for regions of
    # many tiny ops where the walk's cost shows. It still catches a different maker.
    first, later, _, _ = FAMILIES["sin/cos then exp"]
    x = torch.randn(6, requires_grad=True)
    ckpt_lab.checkpoint(flips(first, later), x, determinism_check="makers").sum().backward()
    with pytest.raises(CheckpointError, match=r"made by aten\.exp in the forward and by aten\.sin"):
        function = flips(lambda t: t.sin().exp(), lambda t: t.sin().cos().exp())
        ckpt_lab.checkpoint(function, x, determinism_check="makers").sum().backward()
    expected = r"should be one of \['default', 'none'\], but got full\. .*\"makers\""
    with pytest.raises(ValueError, match=expected):
        ckpt_lab.checkpoint(first, x, determinism_check="full")
