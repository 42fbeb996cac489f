"""Tests for ``ckpt_lab.sequential``; ``torch.utils.checkpoint.checkpoint_sequential`` is the oracle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential as torch_checkpoint_sequential

from ckpt_lab.instruments.counting import CallCounter
from ckpt_lab.sequential import checkpoint_sequential
from oracle import assert_all_equal, output_and_grads, saved_by

USE_REENTRANT = [True, False]


def make_layers(seed: int = 0) -> list[nn.Module]:
    """Seven layers (not a multiple of most segment counts, so the last chunk absorbs a remainder)."""
    torch.manual_seed(seed)
    return [
        nn.Linear(8, 16),
        nn.Tanh(),
        nn.Dropout(0.3),
        nn.Linear(16, 16),
        nn.GELU(),
        nn.Dropout(0.2),
        nn.Linear(16, 4),
    ]


def step(
    run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: list[nn.Parameter]
) -> list[Any]:
    """Output and grads of ``(run(x) ** 2).sum()`` w.r.t. a fresh copy of ``x`` and ``params`` (seeded)."""
    return output_and_grads(run, x, params, seed=123)


@pytest.mark.parametrize("use_reentrant", USE_REENTRANT)
@pytest.mark.parametrize("segments", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("container", ["list", "sequential"])
def test_matches_torch_and_plain(container: str, segments: int, use_reentrant: bool) -> None:
    layers = make_layers()
    functions: Any = layers if container == "list" else nn.Sequential(*layers)
    params = [p for layer in layers for p in layer.parameters()]
    x = torch.randn(5, 8)

    ours = step(
        lambda t: checkpoint_sequential(functions, segments, t, use_reentrant=use_reentrant), x, params
    )
    theirs = step(
        lambda t: torch_checkpoint_sequential(functions, segments, t, use_reentrant=use_reentrant), x, params
    )
    reference = step(nn.Sequential(*layers), x, params)
    assert_all_equal(ours, theirs)
    assert_all_equal(ours, reference)


@pytest.mark.parametrize("use_reentrant", USE_REENTRANT)
def test_plain_callables(use_reentrant: bool) -> None:
    functions = [torch.sin, lambda t: t * 3, torch.tanh, torch.exp, torch.cos]
    x = torch.randn(10, dtype=torch.float64)
    ours = step(lambda t: checkpoint_sequential(functions, 2, t, use_reentrant=use_reentrant), x, [])
    theirs = step(lambda t: torch_checkpoint_sequential(functions, 2, t, use_reentrant=use_reentrant), x, [])
    assert_all_equal(ours, theirs)


@pytest.mark.parametrize(
    ("segments", "expected"),
    [
        # 7 layers: chunk size 7 // segments; the first segments - 1 chunks run twice, the rest once.
        (1, [1, 1, 1, 1, 1, 1, 1]),
        (2, [2, 2, 2, 1, 1, 1, 1]),
        (3, [2, 2, 2, 2, 1, 1, 1]),
        (4, [2, 2, 2, 1, 1, 1, 1]),
        (7, [2, 2, 2, 2, 2, 2, 1]),
    ],
)
def test_recompute_counts_per_layer(segments: int, expected: list[int]) -> None:
    layers = make_layers()
    counters = [CallCounter(layer) for layer in layers]
    x = torch.randn(5, 8, requires_grad=True)
    checkpoint_sequential(nn.Sequential(*layers), segments, x, use_reentrant=True).sum().backward()
    assert [c.count for c in counters] == expected
    for c in counters:
        c.remove()


def test_only_segment_inputs_and_last_chunk_activations_are_saved() -> None:
    functions = [torch.sin] * 6
    x = torch.randn(100, requires_grad=True)
    counts = {}
    for name, fn in {"ours": checkpoint_sequential, "torch": torch_checkpoint_sequential}.items():
        counts[name] = len(saved_by(fn, functions, 3, x, use_reentrant=True))
    # Two checkpointed chunks save their inputs (x and h2); the last chunk's two sins save theirs.
    assert counts == {"ours": 4, "torch": 4}


def test_module_used_twice_in_a_sequential() -> None:
    """torch lists ``nn.Sequential`` children with ``.children()``, which yields a repeated module once,
    so its result differs from ``seq(x)``; iterating the Sequential keeps every position."""
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    seq = nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh())
    x = torch.randn(3, 4, requires_grad=True)
    assert torch.equal(checkpoint_sequential(seq, 2, x, use_reentrant=True), seq(x))
    assert not torch.allclose(torch_checkpoint_sequential(seq, 2, x, use_reentrant=True), seq(x))


@pytest.mark.parametrize("segments", [0, -1, 8, 2.0, None])
def test_invalid_segments(segments: Any) -> None:
    with pytest.raises(ValueError, match=r"1 <= segments <= len\(functions\) = 7"):
        checkpoint_sequential(make_layers(), segments, torch.randn(2, 8), use_reentrant=True)


def test_preserve_rng_state_false_changes_dropout_grads() -> None:
    layers = make_layers()
    params = [p for layer in layers for p in layer.parameters()]
    x = torch.randn(5, 8)
    reference = step(nn.Sequential(*layers), x, params)
    no_rng = step(
        lambda t: checkpoint_sequential(layers, 3, t, use_reentrant=True, preserve_rng_state=False), x, params
    )
    assert torch.equal(no_rng[0], reference[0])  # the forward itself is unaffected
    assert not torch.allclose(no_rng[1], reference[1])
