"""Tests for ``ckpt_lab.batchnorm``; an un-checkpointed training step is the oracle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError as TorchCheckpointError

from ckpt_lab.batchnorm import StatsHooks, in_backward, skip_stats_update_in_recompute
from ckpt_lab.instruments.counting import OpCounter
from ckpt_lab.instruments.saved import SavedTensorLog
from ckpt_lab.nonreentrant import CheckpointError, checkpoint
from ckpt_lab.scope import gradient_checkpoint_scope
from oracle import CHECKPOINTS, NON_REENTRANT, assert_all_equal, plain


def make_model() -> nn.Sequential:
    """Conv + BatchNorm2d + ReLU, then Linear + BatchNorm1d + ReLU, then a head; seeded."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 6),
        nn.BatchNorm1d(6),
        nn.ReLU(),
        nn.Linear(6, 2),
    )


def batchnorms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def step(ck: Callable[..., Any], fix: bool = False, train: bool = True) -> dict[str, Any]:
    """One forward + backward of ``make_model()`` through ``ck``; what it leaves behind."""
    model = make_model().train(train)
    hooks = skip_stats_update_in_recompute(model) if fix else None
    torch.manual_seed(1)
    x = torch.randn(8, 3, 5, 5, requires_grad=True)
    out = ck(model, x)
    out.square().sum().backward()
    bns = batchnorms(model)
    return {
        "out": out.detach(),
        "tracked": [bn.num_batches_tracked.item() for bn in bns],
        "mean": [bn.running_mean.clone() for bn in bns],
        "var": [bn.running_var.clone() for bn in bns],
        "grads": [x.grad, *(p.grad for p in model.parameters())],
        "hooks": hooks,
    }


# ------------------------------------------------------------------------------------ the pitfall


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_pitfall_statistics_are_updated_twice(name: str) -> None:
    ref = step(plain)
    got = step(CHECKPOINTS[name])
    assert ref["tracked"] == [1, 1]
    assert got["tracked"] == [2, 2]
    # Momentum 0.1 applied twice with the same batch statistics m (running mean starts at 0):
    # 0.9 * 0.1 m + 0.1 m = 0.19 m instead of 0.1 m; running var: 0.81 + 0.19 v instead of 0.9 + 0.1 v.
    for mean, ref_mean in zip(got["mean"], ref["mean"], strict=True):
        assert not torch.allclose(mean, ref_mean)
        torch.testing.assert_close(mean, 1.9 * ref_mean)
    for var, ref_var in zip(got["var"], ref["var"], strict=True):
        torch.testing.assert_close(var, 0.81 + 1.9 * (ref_var - 0.9))
    # Gradients are not affected: training mode normalises with the batch's own statistics.
    assert_all_equal(got["grads"], ref["grads"])


# ---------------------------------------------------------------------------------------- the fix


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_fix_updates_statistics_once_and_keeps_gradients(name: str) -> None:
    ref = step(plain)
    got = step(CHECKPOINTS[name], fix=True)
    assert got["tracked"] == [1, 1]
    assert_all_equal(got["mean"], ref["mean"])
    assert_all_equal(got["var"], ref["var"])
    assert_all_equal([got["out"], *got["grads"]], [ref["out"], *ref["grads"]])
    # Nothing left stashed: every recomputation put the real buffers back.
    assert got["hooks"].stashed == {}


def test_fix_leaves_plain_training_unchanged() -> None:
    ref = step(plain)
    got = step(plain, fix=True)
    assert got["tracked"] == [1, 1]
    assert_all_equal(got["mean"] + got["var"], ref["mean"] + ref["var"])
    assert_all_equal(got["grads"], ref["grads"])


@pytest.mark.parametrize("name", ["plain", *CHECKPOINTS])
def test_fix_leaves_eval_mode_unchanged(name: str) -> None:
    ck = plain if name == "plain" else CHECKPOINTS[name]
    ref = step(ck, train=False)
    got = step(ck, fix=True, train=False)
    # Eval mode reads the running statistics and never writes them.
    assert ref["tracked"] == got["tracked"] == [0, 0]
    assert_all_equal(got["mean"] + got["var"], ref["mean"] + ref["var"])
    assert_all_equal([got["out"], *got["grads"]], [ref["out"], *ref["grads"]])


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_remove_restores_the_pitfall(name: str) -> None:
    model = make_model()
    hooks = skip_stats_update_in_recompute(model)
    assert len(hooks.handles) == 4  # two BatchNorms, a pre-hook and a hook each
    hooks.remove()
    for bn in batchnorms(model):
        assert len(bn._forward_pre_hooks) == len(bn._forward_hooks) == 0
    x = torch.randn(8, 3, 5, 5, requires_grad=True)
    CHECKPOINTS[name](model, x).sum().backward()
    assert [bn.num_batches_tracked.item() for bn in batchnorms(model)] == [2, 2]


def test_module_itself_is_hooked_and_context_manager_removes() -> None:
    bn = nn.BatchNorm1d(3)
    with skip_stats_update_in_recompute(bn) as hooks:
        assert isinstance(hooks, StatsHooks) and len(hooks.handles) == 2
        checkpoint(bn, torch.randn(4, 3, requires_grad=True)).sum().backward()
        assert bn.num_batches_tracked.item() == 1
    assert hooks.handles == [] and len(bn._forward_hooks) == 0


def test_momentum_none_cumulative_average_is_updated_once() -> None:
    def run(ck: Callable[..., Any], fix: bool) -> nn.BatchNorm1d:
        torch.manual_seed(0)
        bn = nn.BatchNorm1d(3, momentum=None)
        if fix:
            skip_stats_update_in_recompute(bn)
        for _ in range(3):
            ck(bn, torch.randn(5, 3, requires_grad=True)).square().sum().backward()
        return bn

    ref, fixed = run(plain, False), run(checkpoint, True)
    assert ref.num_batches_tracked.item() == fixed.num_batches_tracked.item() == 3
    torch.testing.assert_close(fixed.running_mean, ref.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(fixed.running_var, ref.running_var, rtol=0, atol=0)
    assert run(checkpoint, False).num_batches_tracked.item() == 6


# ------------------------------------------------------------------------------------ exceptions


class FailsInBackward(nn.BatchNorm1d):
    """A BatchNorm whose recomputation raises after it has written its statistics."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = super().forward(input)
        if in_backward():
            raise RuntimeError("boom in the recomputation")
        return out


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_real_buffers_are_restored_after_an_exception_in_the_recomputation(name: str) -> None:
    torch.manual_seed(0)
    bn = FailsInBackward(4)
    model = nn.Sequential(nn.Linear(3, 4), bn, nn.ReLU())
    hooks = skip_stats_update_in_recompute(model)
    real = {name: getattr(bn, name) for name in ("running_mean", "running_var", "num_batches_tracked")}
    x = torch.randn(6, 3, requires_grad=True)
    out = CHECKPOINTS[name](model, x)
    after_forward = {k: v.clone() for k, v in real.items()}
    with pytest.raises(RuntimeError, match="boom in the recomputation"):
        out.sum().backward()
    # The hook ran although the forward raised: the real buffers are back, untouched by the re-run.
    assert hooks.stashed == {}
    assert bn.track_running_stats is True
    for key, buffer in real.items():
        assert getattr(bn, key) is buffer
        assert torch.equal(buffer, after_forward[key])
    assert bn.num_batches_tracked.item() == 1
    # And a later plain step updates the real buffers again.
    model(x)
    assert real["num_batches_tracked"].item() == 2


def test_early_stop_inside_a_batchnorm_restores_the_buffers() -> None:
    """ckpt_lab.checkpoint stops its re-run by raising inside the op that saves the last needed tensor:
    here BatchNorm's own save_invstd, so the exception goes through the BatchNorm's forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    bn = model[1]
    hooks = skip_stats_update_in_recompute(model)
    real_mean = bn.running_mean
    x = torch.randn(6, 3, requires_grad=True)
    reached_end: list[bool] = []
    bn.register_forward_hook(lambda *args: reached_end.append(in_backward()))
    checkpoint(model, x).square().sum().backward()
    # The forward ran to the end (a plain hook saw it); the recomputation did not.
    assert reached_end == [False]
    assert bn.running_mean is real_mean and hooks.stashed == {}
    assert bn.num_batches_tracked.item() == 1


# --------------------------------------------------------------- why not track_running_stats=False


def disable_tracking_in_recompute(module: nn.Module) -> list[Any]:
    """The obvious fix, which the module docstring explains is wrong for non-reentrant checkpoints."""
    handles = []
    for bn in batchnorms(module):

        def pre(bn: nn.Module, args: Any) -> None:
            bn.previous = bn.track_running_stats
            if in_backward():
                bn.track_running_stats = False

        def post(bn: nn.Module, args: Any, out: Any) -> None:
            bn.track_running_stats = bn.previous

        handles += [bn.register_forward_pre_hook(pre), bn.register_forward_hook(post, always_call=True)]
    return handles


def test_without_running_stats_batchnorm_saves_two_tensors_fewer() -> None:
    bn = nn.BatchNorm1d(4)
    x = torch.randn(8, 4, requires_grad=True)
    counts = []
    for tracking in (True, False):
        bn.track_running_stats = tracking
        with SavedTensorLog() as log:
            bn(x)
        counts.append(len(log.entries))
    # input, running_mean, running_var, weight, save_mean, save_invstd -- or without the two stats.
    assert counts == [6, 4]


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_disabling_tracking_breaks_non_reentrant_checkpoints(name: str) -> None:
    model = make_model()
    disable_tracking_in_recompute(model)
    loss = CHECKPOINTS[name](model, torch.randn(8, 3, 5, 5, requires_grad=True)).sum()
    if CHECKPOINTS[name] in NON_REENTRANT.values():
        with pytest.raises((CheckpointError, TorchCheckpointError)):
            loss.backward()
    else:
        loss.backward()
        assert [bn.num_batches_tracked.item() for bn in batchnorms(model)] == [1, 1]


# ----------------------------------------------------------------------------------- blind spots


def test_blind_spot_recomputation_outside_backward_is_not_detected() -> None:
    model = make_model()
    skip_stats_update_in_recompute(model)
    out = checkpoint(model, torch.randn(8, 3, 5, 5, requires_grad=True))
    # Reading a saved tensor outside backward makes ckpt_lab.checkpoint recompute right now.
    assert out.grad_fn._saved_mat1.shape == (8, 6)
    out.sum().backward()
    # Forward (1) + the undetected re-run (1); backward's re-run was caught.
    assert [bn.num_batches_tracked.item() for bn in batchnorms(model)] == [2, 2]


def test_blind_spot_a_module_run_in_a_backward_hook_is_taken_for_a_recomputation() -> None:
    bn = nn.BatchNorm1d(3)
    skip_stats_update_in_recompute(bn)
    x = torch.randn(4, 3, requires_grad=True)
    seen = []
    y = x.sin()
    y.register_hook(lambda grad: seen.append(bn(grad)) or None)
    y.sum().backward()
    assert len(seen) == 1 and bn.num_batches_tracked.item() == 0
    assert torch.equal(bn.running_mean, torch.zeros(3))


def test_in_backward() -> None:
    seen = []
    x = torch.randn(3, requires_grad=True)
    y = x.exp()
    y.register_hook(lambda grad: seen.append(in_backward()) or None)
    assert in_backward() is False
    y.sum().backward()
    assert seen == [True]


# ---------------------------------------------------------------------- gradient_checkpoint_scope


@pytest.mark.parametrize("fix", [False, True])
def test_scope_updates_statistics_once_without_any_fix(fix: bool) -> None:
    """The scope replays aten ops (no module hooks run) and redirects the in-place writes to the
    running statistics into copies: one update per step, with or without the fix."""

    def scoped(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with gradient_checkpoint_scope():
            return model(x)

    ref = step(plain)
    model = make_model()
    if fix:
        skip_stats_update_in_recompute(model)
    torch.manual_seed(1)
    x = torch.randn(8, 3, 5, 5, requires_grad=True)
    out = scoped(model, x)
    with OpCounter() as ops:
        out.square().sum().backward()
    # Backward did replay both batch norms...
    assert ops.counts["native_batch_norm"] == 2
    # ... and the statistics were updated once, exactly as without checkpointing.
    bns = batchnorms(model)
    assert [bn.num_batches_tracked.item() for bn in bns] == [1, 1]
    assert_all_equal([bn.running_mean for bn in bns], ref["mean"])
    assert_all_equal([bn.running_var for bn in bns], ref["var"])
    assert_all_equal([x.grad, *(p.grad for p in model.parameters())], ref["grads"])
