"""Inputs that used to break selective checkpointing, the BatchNorm fix, the planner and the
drop-in ``use_reentrant`` keyword: autocast over backward, BatchNorm under a selective checkpoint,
the fix applied twice, planning a model with state, policies that return None, wrong argument types.

Every case compares with the plain, un-checkpointed run (and with ``torch.utils.checkpoint`` where
one applies, ``use_reentrant`` always explicit), or asserts the refusal by its message; every case
ends with no global state left behind.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import ckpt_lab
from ckpt_lab import planner
from ckpt_lab.batchnorm import skip_stats_update_in_recompute
from ckpt_lab.instruments.state import assert_no_global_state
from ckpt_lab.selective import RECOMPUTE, PolicyError, selective_checkpoint
from oracle import SAC_ASKS_IN_RECOMPUTE, assert_all_equal, plain, torch_nonreentrant

aten = torch.ops.aten
MATMULS = [aten.mm.default, aten.addmm.default]


@pytest.fixture(autouse=True)
def no_global_state() -> Iterator[None]:
    """Every test: nothing left behind (hooks, dispatch modes, grad mode)."""
    yield
    assert_no_global_state()


def torch_sac(function: Callable[..., Any], *args: Any, policy: Any, **kwargs: Any) -> Any:
    """torch's selective checkpoint, the oracle for ours."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    return torch_nonreentrant(function, *args, context_fn=context_fn, **kwargs)


def save_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    return True


def save_nothing(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    return False


POLICIES: dict[str, Any] = {
    "save matmuls": MATMULS,
    "save everything": save_everything,
    "save nothing": save_nothing,
}


# ------------------------------------------------------------------- 8: autocast covering backward
def twice_used_mlp() -> tuple[nn.Module, nn.Module]:
    """Two Linears, the first used twice (so its cast weight is reused inside the region)."""
    torch.manual_seed(0)
    return nn.Linear(8, 8), nn.Linear(8, 8)


def mlp_block(first: nn.Module, second: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = F.gelu(first(x))
    h = F.dropout(h, 0.2)
    return second(first(h)).relu()


def autocast_step(
    run: Callable[..., Any], policy: Any, *, backward_in_autocast: bool, cast_before: bool
) -> list[torch.Tensor | None]:
    """One step under CPU bf16 autocast; ``cast_before`` uses ``first`` outside the region first (its
    weight's cast is then in autocast's cache before the checkpoint runs)."""
    first, second = twice_used_mlp()
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = first(x) if cast_before else x
        out = run(functools.partial(mlp_block, first, second), h, policy=policy)
        loss = out.float().square().sum()
        if backward_in_autocast:
            loss.backward()
    if not backward_in_autocast:
        loss.backward()
    return [out.detach(), x.grad, *(p.grad for p in (*first.parameters(), *second.parameters()))]


# torch's SAC is the oracle for these two: with "save everything" it refuses dropout's mask, which
# ``bernoulli_`` fills in place after ``empty_like`` ("cached ... has been mutated", tests/test_selective.py).
TORCH_SAC_WORKS = ("save matmuls", "save nothing")
AUTOCAST_CASES = {
    "backward in autocast": (True, False),
    "backward in autocast, weight cast before": (True, True),
    "weight cast before": (False, True),
    "backward outside autocast": (False, False),
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", AUTOCAST_CASES)
def test_selective_under_autocast_equals_plain(policy: str, case: str) -> None:
    backward_in_autocast, cast_before = AUTOCAST_CASES[case]
    step = functools.partial(
        autocast_step, backward_in_autocast=backward_in_autocast, cast_before=cast_before
    )
    ref = step(plain, POLICIES[policy])
    assert_all_equal(step(selective_checkpoint, POLICIES[policy]), ref)
    if policy not in TORCH_SAC_WORKS:
        return
    if case == "weight cast before" and not SAC_ASKS_IN_RECOMPUTE:
        # torch 2.13's SAC counts every op's calls and finds one more weight cast in the
        # recomputation (outside autocast, a cache miss) than in the forward (a cache hit). (Before
        # 2.13 its cache is per op, first in, first out, and the extra cast is simply run.)
        with pytest.raises(
            RuntimeError, match=r"_to_copy\.default invocation index \d+ .* not found in storage"
        ):
            step(torch_sac, POLICIES[policy])
        return
    assert_all_equal(step(torch_sac, POLICIES[policy]), ref)


def test_selective_under_autocast_asks_the_policy_about_the_casts() -> None:
    """The weight casts are still shown to the policy (as torch's SAC does), even when saved they are
    recomputed: whether autocast runs one at all depends on its cache (NOTE [ Autocast's weight casts ])."""
    asked: list[Any] = []

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        asked.append(op)
        return True

    ref = autocast_step(plain, None, backward_in_autocast=True, cast_before=False)
    got = autocast_step(
        lambda fn, h, policy: selective_checkpoint(fn, h, policy=policy),
        policy,
        backward_in_autocast=True,
        cast_before=False,
    )
    assert_all_equal(got, ref)
    assert aten._to_copy.default in asked


# ------------------------------------------------------------------ 9: BatchNorm under selective
def two_batchnorms() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 6),
        nn.BatchNorm1d(6),
        nn.ReLU(),
        nn.Linear(6, 6),
        nn.BatchNorm1d(6),
        nn.Tanh(),
        nn.Linear(6, 2),
    )


def batchnorm_steps(
    model: nn.Module, run: Callable[..., Any], policy: Any, steps: int = 3, fix: bool = True
) -> dict[str, list[Any]]:
    """``steps`` training steps of ``model`` through ``run``; the statistics and gradients after each."""
    if fix:
        skip_stats_update_in_recompute(model)
    torch.manual_seed(1)
    seen: dict[str, list[Any]] = {"grads": [], "stats": []}
    for _ in range(steps):
        x = torch.randn(8, 5, requires_grad=True)
        run(model, x, policy=policy).square().sum().backward()
        seen["grads"] += [x.grad, *(p.grad for p in model.parameters())]
        seen["stats"] += [b.clone() for b in model.buffers()]
        model.zero_grad()
    return seen


@pytest.mark.parametrize("policy", POLICIES)
def test_selective_with_batchnorm_fix_updates_statistics_once(policy: str) -> None:
    ref = batchnorm_steps(two_batchnorms(), plain, None, fix=False)
    got = batchnorm_steps(two_batchnorms(), selective_checkpoint, POLICIES[policy])
    # Buffers: running_mean, running_var, num_batches_tracked of each BatchNorm, after each step.
    assert_all_equal(got["stats"], ref["stats"])
    assert_all_equal(got["grads"], ref["grads"])
    if policy in TORCH_SAC_WORKS:
        oracle = batchnorm_steps(two_batchnorms(), torch_sac, POLICIES[policy])
        assert_all_equal(oracle["stats"], ref["stats"])


class SameBatchNormTwice(nn.Module):
    """One BatchNorm with cumulative momentum (``momentum=None``) used twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(5, 5)
        self.bn = nn.BatchNorm1d(5, momentum=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.linear(self.bn(x)).tanh())


@pytest.mark.parametrize("policy", POLICIES)
def test_selective_with_one_batchnorm_used_twice_cumulative_momentum(policy: str) -> None:
    ref = batchnorm_steps(SameBatchNormTwice(), plain, None, fix=False)
    got = batchnorm_steps(SameBatchNormTwice(), selective_checkpoint, POLICIES[policy])
    assert ref["stats"][2].item() == 2  # num_batches_tracked after one step: two batches
    assert_all_equal(got["stats"], ref["stats"])
    assert_all_equal(got["grads"], ref["grads"])


# -------------------------------------------------------------- 10: the BatchNorm fix applied twice
CHECKPOINTS: dict[str, Callable[..., Any]] = {
    "ckpt_lab.checkpoint": lambda fn, x, policy: ckpt_lab.checkpoint(fn, x),
    "torch non-reentrant": lambda fn, x, policy: torch_nonreentrant(fn, x),
    "torch reentrant": lambda fn, x, policy: torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=True),
    "ckpt_lab.reentrant_checkpoint": lambda fn, x, policy: ckpt_lab.reentrant_checkpoint(fn, x),
    "selective_checkpoint": lambda fn, x, policy: selective_checkpoint(fn, x, policy=MATMULS),
}


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_fix_applied_twice_keeps_the_modules_buffers(name: str) -> None:
    ref = batchnorm_steps(two_batchnorms(), plain, None, fix=False)
    model = two_batchnorms()
    # Someone else's references to the buffers: an EMA copy, DDP's buffer list.
    buffers = list(model.buffers())
    # Once per epoch, say; batchnorm_steps applies it a second time.
    skip_stats_update_in_recompute(model)
    got = batchnorm_steps(model, CHECKPOINTS[name], None)
    assert all(now is then for now, then in zip(model.buffers(), buffers, strict=True))
    assert_all_equal(got["stats"], ref["stats"])
    # The references outside see the updates too.
    assert_all_equal(buffers, ref["stats"][-len(buffers) :])
    assert_all_equal(got["grads"], ref["grads"])


def test_fix_applied_twice_either_removal_keeps_the_other() -> None:
    ref = batchnorm_steps(two_batchnorms(), plain, None, fix=False, steps=1)
    for remove_first in (True, False):
        model = two_batchnorms()
        first, second = skip_stats_update_in_recompute(model), skip_stats_update_in_recompute(model)
        (first if remove_first else second).remove()
        got = batchnorm_steps(model, CHECKPOINTS["ckpt_lab.checkpoint"], None, fix=False, steps=1)
        assert_all_equal(got["stats"], ref["stats"])
        assert first.stashed == second.stashed == {}


# --------------------------------------------------------------------- 11: planning leaves no state
class Stateful(nn.Module):
    """BatchNorm (buffers written in place), dropout (the RNG), and a step counter in a closure."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(
            nn.Linear(6, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 6)
        )
        self.frozen = nn.Linear(6, 6).eval().requires_grad_(False)
        self.calls = torch.zeros((), dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.frozen(self.body(x))


def snapshot(model: nn.Module, *tensors: torch.Tensor) -> dict[str, Any]:
    return {
        "state": {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()},
        "objects": list(model.state_dict(keep_vars=True).values()),
        "grads": [p.grad for p in model.parameters()] + [t.grad for t in tensors],
        "training": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
        "calls": model.calls.item() if hasattr(model, "calls") else None,
    }


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert list(before["state"]) == list(after["state"])
    assert_all_equal(list(after["state"].values()), list(before["state"].values()))
    assert all(a is b for a, b in zip(after["objects"], before["objects"], strict=True))
    assert all(g is None for g in after["grads"]), "profiling left gradients behind"
    assert after["training"] == before["training"]
    assert torch.equal(after["rng"], before["rng"])
    assert after["calls"] == before["calls"]


@pytest.mark.parametrize("cost", ["flops", "time"])
def test_plan_leaves_the_model_as_it_was(cost: str) -> None:
    model = Stateful().train()
    x = torch.randn(8, 6, requires_grad=True)
    before = snapshot(model, x)
    made = planner.plan(model, x, budget=10**9, cost=cost)
    assert_unchanged(before, snapshot(model, x))
    # And running the plan is one step, as without checkpointing (the fix keeps the recomputation's
    # statistics out).
    skip_stats_update_in_recompute(model)
    ref_model = Stateful().train()
    torch.manual_seed(2)
    made(x).square().sum().backward()
    torch.manual_seed(2)
    x_ref = x.detach().requires_grad_()
    ref_model(x_ref).square().sum().backward()
    assert_all_equal(list(model.state_dict().values()), list(ref_model.state_dict().values()))
    # The frozen Linear's parameters have no gradient in either run.
    assert_all_equal(
        [x.grad, *(p.grad for p in model.parameters())],
        [x_ref.grad, *(p.grad for p in ref_model.parameters())],
        allow_none=True,
    )


def test_plan_sequential_leaves_the_blocks_as_they_were() -> None:
    model = Stateful().train()
    blocks = [model.body[:3], model.body[3:], model.frozen]
    x = torch.randn(8, 6, requires_grad=True)
    before = snapshot(model, x)
    planner.plan_sequential(blocks, x, budget=10**9)
    assert_unchanged(before, snapshot(model, x))


def test_plan_of_a_closure_leaves_outside_tensors_as_they_were() -> None:
    """Not a module: the planner can't list what the function touches, so it notices writes."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    counter = torch.zeros(3)

    def function(x: torch.Tensor) -> torch.Tensor:
        counter[1:].add_(1)  # a write through a view of an outside tensor
        return bn(x).sin()

    x = torch.randn(5, 4, requires_grad=True)
    before = [counter.clone(), *(b.clone() for b in bn.buffers())]
    planner.plan(function, x, budget=10**9)
    assert_all_equal([counter, *bn.buffers()], before)


def test_plan_restores_version_counters_for_a_graph_built_before() -> None:
    """A graph that saved an outside tensor before ``plan()`` still backpropagates: the tensor's bytes
    and its version counter are both put back."""
    counter = torch.ones(3)
    w = torch.randn(3, requires_grad=True)
    # mul saves ``counter`` for w's gradient.
    earlier = (w * counter).sum()

    def function(x: torch.Tensor) -> torch.Tensor:
        counter.add_(1)
        return x.sin() * counter

    planner.plan(function, torch.randn(3, requires_grad=True), budget=10**9)
    earlier.backward()
    assert_all_equal([w.grad, counter], [torch.ones(3), torch.ones(3)])
    assert counter._version == 0


def test_plan_inside_autocast_then_run_in_the_same_region() -> None:
    """Profiling fills no autocast cache, so the real run in the same region casts its weights itself,
    and the plan's positions don't count the casts at all."""

    def step(planned: bool) -> list[torch.Tensor | None]:
        first, second = twice_used_mlp()
        x = torch.randn(4, 8, requires_grad=True)
        block = functools.partial(mlp_block, first, second)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            run = planner.plan(block, x, budget=10**9) if planned else block
            torch.manual_seed(1)
            out = run(x)
            out.float().square().sum().backward()
        return [out.detach(), x.grad, *(p.grad for p in (*first.parameters(), *second.parameters()))]

    assert_all_equal(step(planned=True), step(planned=False))


# --------------------------------------------------------------------- 12: a policy returning None
def falls_off_its_end(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    if op in MATMULS:
        return True


@pytest.mark.parametrize(
    "function",
    [lambda t: (t * 2.0).sin(), lambda t: (2.0 * t).sin(), lambda t: (t + t).sin(), lambda t: t.sin()],
    ids=["t * 2.0", "2.0 * t", "t + t", "t.sin()"],
)
def test_policy_returning_none_says_so(function: Callable[[torch.Tensor], torch.Tensor]) -> None:
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(PolicyError, match=r"the policy returned None for aten\.\w+\.\w+ \(op 0\)") as info:
        selective_checkpoint(function, x, policy=falls_off_its_end)
    assert "return RECOMPUTE" in str(info.value)


def test_policy_raising_type_error_under_an_operator_is_reported_as_the_policys() -> None:
    def broken(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return len(op)  # TypeError: an OpOverload has no len()

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(PolicyError, match=r"the policy raised TypeError.*aten\.mul\.Tensor \(op 0\)") as info:
        selective_checkpoint(lambda t: t * 2.0, x, policy=broken)
    assert isinstance(info.value.__cause__, TypeError)


def test_bad_answer_under_an_operator_names_the_answer() -> None:
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(PolicyError, match=r"answered 'save' for aten\.mul\.Tensor \(op 0\)"):
        selective_checkpoint(lambda t: t * 2.0, x, policy=lambda ctx, op, *a, **k: "save")


def test_policy_returning_none_then_recompute_fixes_it() -> None:
    def fixed(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return True if op in MATMULS else RECOMPUTE

    x = torch.randn(3, requires_grad=True)
    y = x.detach().requires_grad_()
    selective_checkpoint(lambda t: (t * 2.0).sin(), x, policy=fixed).sum().backward()
    (y * 2.0).sin().sum().backward()
    assert_all_equal([x.grad], [y.grad])


# ------------------------------------------------------------------------ 13: a list, not a module
@pytest.mark.parametrize("wrong", [[nn.BatchNorm1d(3)], (nn.BatchNorm1d(3),), None])
def test_skip_stats_wants_a_module(wrong: Any) -> None:
    with pytest.raises(
        TypeError, match=r"skip_stats_update_in_recompute: expected an nn\.Module.*nn\.ModuleList"
    ):
        skip_stats_update_in_recompute(wrong)


def test_skip_stats_takes_a_module_list() -> None:
    bns = nn.ModuleList([nn.BatchNorm1d(3), nn.BatchNorm1d(3)])
    with skip_stats_update_in_recompute(bns) as hooks:
        assert len(hooks.handles) == 4


# ------------------------------------------------------------------ 14: torch's use_reentrant=False
def keyword_block(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Fails loudly if a checkpoint's own keyword reaches it."""
    assert "use_reentrant" not in kwargs, "use_reentrant was passed on to the function"
    return F.dropout(x.sin() * kwargs.get("scale", 1.0), 0.3).exp()


DROP_INS: dict[str, Callable[..., Any]] = {
    "ckpt_lab.checkpoint": ckpt_lab.checkpoint,
    "selective_checkpoint": functools.partial(selective_checkpoint, policy=MATMULS),
}


@pytest.mark.parametrize("name", DROP_INS)
def test_use_reentrant_false_is_accepted_like_torchs(name: str) -> None:
    def step(run: Callable[..., Any]) -> list[torch.Tensor | None]:
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0)).requires_grad_()
        torch.manual_seed(1)
        out = run(keyword_block, x, use_reentrant=False, scale=2.0)
        out.sum().backward()
        return [out.detach(), x.grad]

    ref = step(lambda f, x, use_reentrant, **kwargs: f(x, **kwargs))
    assert_all_equal(step(DROP_INS[name]), ref)
    assert_all_equal(step(torch.utils.checkpoint.checkpoint), ref)


@pytest.mark.parametrize("name", DROP_INS)
@pytest.mark.parametrize("value", [True, None])
def test_use_reentrant_other_than_false_is_refused(name: str, value: Any) -> None:
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"use_reentrant=False.*ckpt_lab\.reentrant_checkpoint"):
        DROP_INS[name](keyword_block, x, use_reentrant=value)


def test_plan_call_accepts_use_reentrant_false() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    made = planner.plan(keyword_block, x, budget=10**9)
    torch.manual_seed(0)
    made(x, use_reentrant=False).sum().backward()
    y = x.detach().requires_grad_()
    torch.manual_seed(0)
    keyword_block(y).sum().backward()
    assert_all_equal([x.grad], [y.grad])


def test_sequential_plan_takes_use_reentrant_false_and_refuses_other_keywords() -> None:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)]
    x = torch.randn(2, 4, requires_grad=True)
    made = planner.plan_sequential(blocks, x, budget=10**9)
    made(x, use_reentrant=False).sum().backward()
    y = x.detach().requires_grad_()
    nn.Sequential(*blocks)(y).sum().backward()
    assert_all_equal([x.grad], [y.grad])
    with pytest.raises(TypeError, match=r"takes one input, the first block's, and no keyword arguments"):
        made(x, scale=2.0)
    with pytest.raises(ValueError, match=r"use_reentrant=False.*ckpt_lab\.reentrant_checkpoint"):
        made(x, use_reentrant=True)
