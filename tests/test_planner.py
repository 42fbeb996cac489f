"""The memory-budget planner: solvers checked by brute force, predictions checked by measurement.

Every planned run is checked three ways: gradients equal no checkpointing (bitwise, dropout
included), the retained memory measured equals the prediction and stays within the budget, and the
recomputation cost counted equals the prediction.
"""

import functools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ckpt_lab import CheckpointError, measure_memory
from ckpt_lab.planner import (
    CostCounter,
    budget_range,
    op_cost,
    plan,
    plan_sequential,
    profile,
    profile_sequential,
    solve_brute_force,
    solve_dp,
    solve_greedy,
)
from oracle import assert_all_equal, grads


# ------------------------------------------------------------------------------------------ solvers
def _value(items, chosen):
    return sum(cost for key, _, cost in items if key in chosen)


def _weight(items, chosen):
    return sum(nbytes for key, nbytes, _ in items if key in chosen)


items_strategy = st.lists(
    st.tuples(st.integers(0, 12).map(lambda k: 4 * 2**k), st.integers(0, 10**6)), min_size=0, max_size=12
)


@settings(max_examples=200, deadline=None)
@given(items=items_strategy, capacity=st.integers(0, 40_000))
def test_dp_is_optimal_checked_by_brute_force(items, capacity):
    items = [(i, nbytes, float(cost)) for i, (nbytes, cost) in enumerate(items)]
    dp, brute = solve_dp(items, capacity), solve_brute_force(items, capacity)
    assert _weight(items, dp) <= capacity
    assert _value(items, dp) == _value(items, brute)


@settings(max_examples=200, deadline=None)
@given(items=items_strategy, capacity=st.integers(0, 40_000))
def test_greedy_fits_and_is_never_better_than_dp(items, capacity):
    items = [(i, nbytes, float(cost)) for i, (nbytes, cost) in enumerate(items)]
    greedy = solve_greedy(items, capacity)
    assert _weight(items, greedy) <= capacity
    assert _value(items, greedy) <= _value(items, solve_dp(items, capacity))


def test_greedy_is_not_optimal_on_the_textbook_counterexample():
    # The densest item (60/21 per byte) leaves no room for the two that fill the capacity exactly.
    items = [("a", 21, 60.0), ("b", 20, 50.0), ("c", 20, 50.0)]
    assert _value(items, solve_greedy(items, 40)) == 60.0
    assert _value(items, solve_dp(items, 40)) == 100.0


def test_free_items_are_always_kept_and_worthless_ones_never():
    items = [("free", 0, 5.0), ("worthless", 8, 0.0), ("big", 100, 1.0)]
    for solver in (solve_greedy, solve_dp, solve_brute_force):
        assert solver(items, 50) == {"free"}


def test_dp_refuses_a_table_too_large():
    items = [(i, 4 * i + 1, 1.0) for i in range(1, 100)]
    with pytest.raises(ValueError, match="method='greedy'"):
        solve_dp(items, 10**9, max_cells=10**6)


# ---------------------------------------------------------------------------------------- workloads
def _mlp(depth=3, width=64, batch=8, p=0.1):
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(p), nn.Linear(2 * width, width))
        for _ in range(depth)
    ]
    x = torch.randn(batch, width, requires_grad=True)
    return blocks, x


def _stack(blocks):
    def run(x):
        for block in blocks:
            x = block(x)
        return x

    return run


def _leaves(blocks, x):
    return [x, *(p for b in blocks for p in b.parameters())]


def _grads(blocks, x, forward, seed=1):
    grads(*_leaves(blocks, x))  # drop what an earlier backward left
    torch.manual_seed(seed)
    forward(x).square().mean().backward()
    return grads(*_leaves(blocks, x))


def _limits(blocks, x):
    return budget_range(profile_sequential(blocks, x))


def test_budget_range_is_plain_checkpointing_to_keeping_every_candidate():
    blocks, x = _mlp()
    minimum, maximum = _limits(blocks, x)
    # Three blocks, three inputs of x's size; the largest budget is what an unlimited plan keeps.
    assert minimum == 3 * x.nbytes
    assert maximum == plan_sequential(blocks, x, budget=10**12).retained_bytes
    assert plan_sequential(blocks, x, budget=maximum).saved == plan_sequential(blocks, x, budget=10**12).saved


@pytest.mark.parametrize("method", ["dp", "greedy"])
@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.5, 1.0])
def test_planned_stack_meets_budget_prediction_and_gradients(method, fraction):
    blocks, x = _mlp()
    minimum, maximum = _limits(blocks, x)
    budget = int(minimum + fraction * (maximum - minimum))
    p = plan_sequential(blocks, x, budget=budget, method=method)
    assert p.retained_bytes <= budget

    expected = _grads(blocks, x, _stack(blocks))
    assert_all_equal(_grads(blocks, x, p), expected)

    # Memory: measured retained = prediction - x (made before the call) + output (kept by square) + loss.
    def loss():
        torch.manual_seed(1)
        return p(x).square().mean()

    out_bytes = x.nbytes  # the stack maps width -> width
    measured = measure_memory(loss).retained_bytes
    assert measured - out_bytes - 4 + x.nbytes == p.retained_bytes

    # Recompute cost: counted over the whole step, minus the same step without checkpointing.
    with CostCounter() as with_plan:
        loss().backward()
    with CostCounter() as plain:
        torch.manual_seed(1)
        _stack(blocks)(x).square().mean().backward()
    assert with_plan.total - plain.total == p.recompute_cost


def test_more_budget_never_costs_more_recomputation():
    blocks, x = _mlp()
    minimum, maximum = _limits(blocks, x)
    costs = [
        plan_sequential(blocks, x, budget=b).recompute_cost
        for b in range(minimum, maximum + 1, (maximum - minimum) // 8)
    ]
    assert costs == sorted(costs, reverse=True)
    assert costs[0] > costs[-1]


def test_minimum_budget_is_plain_checkpointing():
    blocks, x = _mlp(p=0.0)
    p = plan_sequential(blocks, x, budget=_limits(blocks, x)[0])
    # Nothing kept but what costs no memory (each block's own output, kept by the next block anyway).
    assert all(
        r.nbytes == 0 for prof, s in zip(p.profiles, p.saved, strict=False) for r in prof.ops if r.index in s
    )
    # So the recomputation is one full forward, as with ckpt_lab.checkpoint per block.
    with CostCounter() as forward:
        _stack(blocks)(x)
    last_ops = sum(prof.ops[-1].cost for prof in p.profiles)  # each block's output: kept, not redone
    assert p.recompute_cost == forward.total - last_ops


def test_one_region_plan_and_torch_run_the_same_plan():
    blocks, x = _mlp()
    run = _stack(blocks)
    p = plan(run, x, budget=x.nbytes + 20_000)
    expected = _grads(blocks, x, run)
    assert_all_equal(_grads(blocks, x, p), expected)
    via_torch = functools.partial(torch_checkpoint, run, use_reentrant=False, context_fn=p.torch_context_fn())
    assert_all_equal(_grads(blocks, x, via_torch), expected)


def test_profile_marks_views_inplace_random_and_filled_buffers():
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)

    def f(x):
        h = (x @ w).t()  # mm (candidate), t (view)
        h = torch.relu_(h * 2)  # mul (candidate), relu_ (in place)
        return torch.nn.functional.dropout(h, 0.5, training=True)  # empty_like filled by bernoulli_

    prof = profile(f, torch.randn(4, 16))
    names = [r.op.overloadpacket.__name__ for r in prof.ops]
    assert names == ["mm", "t", "mul", "relu_", "empty_like", "bernoulli_", "div_", "mul"]
    by = {name: prof.ops[names.index(name)] for name in names}  # the first op of each name
    assert by["mm"].candidate and by["mm"].nbytes == 4 * 16 * 4 and by["mm"].cost == 2 * 4 * 16 * 16
    assert by["t"].rerun and by["t"].cost == 0 and by["t"].nbytes == 0
    assert by["relu_"].rerun and by["bernoulli_"].rerun
    assert by["empty_like"].mutated and not by["empty_like"].candidate
    # The last op's output is the function's output: keeping it costs no extra memory.
    assert prof.ops[-1].nbytes == 0
    # The first mul's output is modified by relu_: not a candidate either.
    assert by["mul"].mutated and not by["mul"].candidate
    # Ops after the last tensor autograd saves are never recomputed.
    assert [r.reached for r in prof.ops] == [True] * 7 + [False]


def test_op_cost_counts_matmul_flops_and_elements():
    a, b = torch.randn(3, 5), torch.randn(5, 7)
    mm = torch.ops.aten.mm.default
    assert op_cost(mm, (a, b), {}, mm(a, b)) == 2 * 3 * 5 * 7
    sin = torch.ops.aten.sin.default
    assert op_cost(sin, (a,), {}, sin(a)) == 15
    t = torch.ops.aten.t.default
    assert op_cost(t, (a,), {}, t(a)) == 0


# ------------------------------------------------------------------------------------------- errors
def test_budget_below_the_inputs_is_refused_with_the_minimum():
    blocks, x = _mlp()
    minimum = 3 * x.nbytes  # three blocks, three inputs of the same size
    with pytest.raises(ValueError, match=f"smallest possible budget is {minimum} bytes"):
        plan_sequential(blocks, x, budget=minimum - 1)
    with pytest.raises(TypeError, match="number of bytes"):
        plan_sequential(blocks, x, budget=1.5e6)
    with pytest.raises(ValueError, match="method must be one of"):
        plan_sequential(blocks, x, budget=10**9, method="ilp")


def test_plan_for_another_computation_is_refused():
    blocks, x = _mlp()
    p = plan(_stack(blocks), x, budget=10**9)
    blocks[1].eval()  # dropout off: the op sequence changes
    try:
        with pytest.raises(CheckpointError, match=r"op 1[0-9]* is .* but when the plan was made"):
            p(x)
    finally:
        blocks[1].train()


def test_a_policy_object_is_for_one_call():
    blocks, x = _mlp()
    p = plan(_stack(blocks), x, budget=10**9)
    from ckpt_lab.selective import selective_checkpoint

    policy = p.policy()
    selective_checkpoint(_stack(blocks), x, policy=policy)
    with pytest.raises(CheckpointError, match="fresh policy per call"):
        selective_checkpoint(_stack(blocks), x, policy=policy)


def test_random_budgets_on_random_stacks():
    rng = random.Random(0)
    for _ in range(5):
        blocks, x = _mlp(depth=rng.randint(1, 4), width=rng.choice([16, 32]), p=rng.choice([0.0, 0.3]))
        minimum, maximum = _limits(blocks, x)
        budget = rng.randint(minimum, maximum)
        dp = plan_sequential(blocks, x, budget=budget)
        greedy = plan_sequential(blocks, x, budget=budget, method="greedy")
        assert dp.retained_bytes <= budget and greedy.retained_bytes <= budget
        assert dp.recompute_cost <= greedy.recompute_cost


def test_time_cost_profile_plans_within_budget():
    # Measured seconds instead of FLOPs: noisy, so only structure is asserted, never a time.
    blocks, x = _mlp(p=0.0)
    prof = profile(_stack(blocks), x, cost="time", repeats=2)
    assert prof.cost_unit == "seconds"
    assert all(r.cost > 0 for r in prof.candidates)
    assert all(r.cost == 0 for r in prof.ops if r.rerun)
    p = plan(_stack(blocks), x, budget=x.nbytes + 10_000, cost="time")
    assert p.retained_bytes <= x.nbytes + 10_000
    expected = _grads(blocks, x, _stack(blocks))
    assert_all_equal(_grads(blocks, x, p), expected)
    with pytest.raises(ValueError, match="'flops' or 'time'"):
        profile(_stack(blocks), x, cost="bytes")
