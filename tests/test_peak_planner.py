"""The peak planner (``ckpt_lab.peak_planner``): its predicted peak against ``measure_memory``, its
dynamic program against every choice of ways, its plans against no checkpointing's gradients.

Small stacks only (each way of each region runs once, forward and backward, when profiled); the
peak sweep (``python -m ckpt_lab.bench.peak``) checks the same on mlp-8, transformer-4 and GPT-2.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from ckpt_lab.bench.workloads import mlp, transformer
from ckpt_lab.instruments.memory import measure_memory
from ckpt_lab.peak_planner import (
    mean_square,
    peak_frontier,
    plan_peak,
    profile_peak,
    simulate,
    solve_peak,
)
from ckpt_lab.planner import budget_range, solve

TOLERANCE = 0.02  # the sweep's target: measured peak within 2% of the prediction


def _measure(functions, x, loss, run, params):
    for t in [x, *params]:
        t.grad = None

    def forward():
        torch.manual_seed(1)
        return loss(run(x))

    report = measure_memory(forward)
    grads = [None if t.grad is None else t.grad.clone() for t in [x, *params]]
    return report, grads


def _plain(functions):
    def run(x):
        for f in functions:
            x = f(x)
        return x

    return run


def _choices(pp):
    return list(itertools.product(*(range(len(ways)) for ways in pp.ways)))


class _TanhBlock(nn.Module):
    """Ends with tanh, which saves its output: the block's own graph keeps its output into backward."""

    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class _Tied(nn.Module):
    """An embedding whose weight the loss uses again as its output layer (GPT-2's tied weights)."""

    def __init__(self, vocab=16, width=8):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.block = nn.Sequential(nn.Linear(width, width), nn.GELU())

    def loss(self, h):
        logits = nn.functional.linear(h, self.embedding.weight)
        return nn.functional.cross_entropy(logits.flatten(0, 1), self.tokens.flatten())


def _cases():
    torch.manual_seed(0)
    small_mlp = mlp(3, width=64, batch=8)
    tiny_transformer = transformer(2, d_model=16, nhead=2, seq=8, batch=2)
    tanh = [_TanhBlock(32) for _ in range(3)]
    tied = _Tied()
    tied.tokens = torch.randint(0, 16, (2, 6))
    return {
        "mlp": (small_mlp.blocks, small_mlp.input, mean_square, small_mlp.parameters()),
        "transformer": (
            tiny_transformer.blocks,
            tiny_transformer.input,
            mean_square,
            tiny_transformer.parameters(),
        ),
        "output kept by its block": (
            tanh,
            torch.randn(4, 32, requires_grad=True),
            mean_square,
            [p for b in tanh for p in b.parameters()],
        ),
        "shared parameter": ([tied.embedding, tied.block], tied.tokens, tied.loss, list(tied.parameters())),
    }


CASES = _cases()
_PROFILES = {}


def _profile(name, max_ways=2):
    """Each case profiled once per menu size, shared by the tests (profiling runs every way)."""
    if (name, max_ways) not in _PROFILES:
        functions, x, loss, _ = CASES[name]
        _PROFILES[name, max_ways] = profile_peak(functions, x, loss, max_ways=max_ways)
    return _PROFILES[name, max_ways]


# ------------------------------------------------------------------------------ prediction = measurement
@pytest.mark.parametrize("name", list(CASES))
def test_predicted_peak_equals_the_measured_peak_for_every_choice_of_ways(name):
    functions, x, loss, params = CASES[name]
    pp = _profile(name)
    choices = _choices(pp)
    for choice in choices[:: max(1, len(choices) // 6)]:
        plan = pp.plan(choice)
        report, _ = _measure(functions, x, loss, plan, params)
        # Within the sweep's tolerance, and in fact to the byte (no storage here waits for a collection).
        assert abs(report.peak_bytes - plan.predicted_peak) <= TOLERANCE * plan.predicted_peak
        assert report.peak_bytes == plan.predicted_peak, (choice, plan.ways)
        assert report.retained_bytes == plan.predicted_retained, (choice, plan.ways)
        with_grads = pp.plan(choice, with_grads=True)
        assert report.peak_bytes_with_grads == with_grads.predicted_peak, (choice, plan.ways)


def test_the_retained_bytes_planners_plans_are_predicted_too():
    functions, x, loss, params = CASES["transformer"]
    pp = _profile("transformer")
    low, high = budget_range(pp.profiles)
    for fraction in (0.0, 0.3, 1.0):
        plan = solve(pp.profiles, low + round(fraction * (high - low)))
        report, _ = _measure(functions, x, loss, plan, params)
        assert report.peak_bytes == pp.predict(plan.saved).peak_bytes


# --------------------------------------------------------------------------------------------- solver
def test_solve_peak_is_the_cheapest_choice_within_budget_checked_against_every_choice():
    pp = _profile("mlp", 3)
    every = [pp.plan(c) for c in _choices(pp)]
    # The dynamic program's numbers are the simulation's.
    for plan in peak_frontier(pp):
        assert simulate(plan.chosen()).peak_bytes == plan.predicted_peak
    peaks = sorted({p.predicted_peak for p in every})
    for budget in [*peaks[:: max(1, len(peaks) // 10)], peaks[-1]]:
        fits = [p for p in every if p.predicted_peak <= budget]
        plan = solve_peak(pp, budget)
        assert plan.predicted_peak <= budget
        assert plan.recompute_cost == min(p.recompute_cost for p in fits)


def test_frontier_is_every_choice_no_other_beats():
    pp = _profile("output kept by its block")
    every = [(p.predicted_peak, p.recompute_cost) for p in (pp.plan(c) for c in _choices(pp))]
    best = {pk: min(c for p, c in every if p <= pk) for pk, _ in every}
    front = peak_frontier(pp)
    assert [p.predicted_peak for p in front] == sorted(p.predicted_peak for p in front)
    for plan in front:
        assert plan.recompute_cost == best[plan.predicted_peak]
    # Each point of the frontier recomputes strictly less than the one below it.
    assert all(a.recompute_cost > b.recompute_cost for a, b in itertools.pairwise(front))


def test_blocks_are_left_unchecked_where_that_is_cheaper():
    pp = _profile("mlp", 3)
    front = peak_frontier(pp)
    # At no checkpointing's peak, nothing is checkpointed and nothing recomputed; lower, some are.
    top = solve_peak(pp, front[-1].predicted_peak)
    assert top.ways == ["plain"] * 3 and top.recompute_cost == 0
    assert any("plain" in p.ways and p.ways != ["plain"] * 3 for p in front)


# ------------------------------------------------------------------------------------- running a plan
def test_a_peak_plan_gives_no_checkpointings_gradients_bit_for_bit():
    functions, x, loss, params = CASES["mlp"]
    _, expected = _measure(functions, x, loss, _plain(functions), params)
    pp = _profile("mlp", 3)
    front = peak_frontier(pp)
    for plan in front[:: max(1, len(front) // 4)]:
        report, grads = _measure(functions, x, loss, plan, params)
        assert report.peak_bytes <= plan.predicted_peak
        assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True)), plan.ways


def test_plan_peak_meets_its_budget_measured():
    functions, x, loss, params = CASES["shared parameter"]
    plain_peak = _measure(functions, x, loss, _plain(functions), params)[0].peak_bytes
    budget = round(0.9 * plain_peak)
    plan = plan_peak(functions, x, budget=budget, loss=loss)
    report, _ = _measure(functions, x, loss, plan, params)
    assert report.peak_bytes <= budget and plan.predicted_peak <= budget


def test_profiling_leaves_no_trace():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.2)) for _ in range(2)]
    x = torch.randn(4, 8, requires_grad=True)
    params = [p for b in blocks for p in b.parameters()]
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    before = [(b[1].running_mean.clone(), b[1].num_batches_tracked.clone()) for b in blocks]
    rng = torch.get_rng_state()
    profile_peak(blocks, x, max_ways=2)
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in params)
    assert x.grad is None
    for b, (mean, count) in zip(blocks, before, strict=True):
        assert torch.equal(b[1].running_mean, mean) and torch.equal(b[1].num_batches_tracked, count)
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_budget_below_every_plan_is_refused_with_the_lowest_peak():
    pp = _profile("mlp")
    lowest = peak_frontier(pp)[0].predicted_peak
    with pytest.raises(ValueError, match=f"lowest predicted peak is {lowest} bytes"):
        solve_peak(pp, lowest - 1)
    with pytest.raises(TypeError, match="budget must be a number of bytes"):
        solve_peak(pp, 1.5e6)


def test_the_simulated_timeline_is_the_measured_one_event_for_event():
    from ckpt_lab.instruments.memory import LiveMemory

    _, x, loss, params = CASES["transformer"]
    pp = _profile("transformer")
    plan = pp.plan([1, 0])  # the first block checkpointed, the second plain
    for t in [x, *params]:
        t.grad = None
    with LiveMemory() as memory:
        torch.manual_seed(1)
        out = loss(plan(x))
        memory.snapshot("after forward")
        memory.phase = "backward"
        out.backward()
        del out
        memory.snapshot("after backward")
    measured = memory.curve(exclude=memory.born_in("backward"))
    # The measured curve repeats its level where a left-out gradient is born; the simulation skips it.
    steps = [b for a, b in itertools.pairwise([0, *measured]) if a != b]
    assert steps == [b for a, b in itertools.pairwise([0, *plan.simulation().curve]) if a != b]
