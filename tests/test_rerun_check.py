"""A re-run that takes another path is caught; torch 2.14's checkpoint additions; autocast's device.

Marked by task:

* the re-run check: the non-reentrant checkpoint compares the op that made each saved tensor, the
  reentrant one its outputs, the selective one op by op; each case against torch, which misses some
  (its behaviour asserted as it is);
* ``debug=True``'s error starts with torch's sentence;
* torch 2.14's configured form (``function=None``) and ``respect_saved_tensors_hooks``;
* which device's autocast state a checkpoint records for CPU arguments (torch's default device type);
* the public names notebooks 03b and 05 read (``frame_of``, ``Frame``, ``SaveMode``, ...).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import DefaultDeviceType, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckpt_lab
from ckpt_lab import nonreentrant, selective
from ckpt_lab.errors import CheckpointError
from ckpt_lab.nonreentrant import checkpoint, frame_of, made_by, set_checkpoint_early_stop
from ckpt_lab.reentrant import reentrant_checkpoint
from ckpt_lab.rng import ReplayState
from ckpt_lab.selective import selective_checkpoint
from oracle import SAC_ASKS_IN_RECOMPUTE, leaves

aten = torch.ops.aten
TORCH_2_14 = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)
needs_torch_2_14 = pytest.mark.skipif(not TORCH_2_14, reason="compares with torch 2.14's behaviour")


def second_call_differs(first: Callable, later: Callable) -> Callable:
    """A function that runs ``first`` on its first call and ``later`` on every call after."""
    calls = [0]

    def function(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return first(x) if calls[0] == 1 else later(x)

    return function


def sin_exp(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp()


def sin_cos_exp(x: torch.Tensor) -> torch.Tensor:
    # The re-run of the case: ``y = x.sin(); if second_call: y = y.cos(); return y.exp()``.
    y = x.sin()
    y = y.cos()
    return y.exp()


def tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * 2)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x * 2)


def gradient(run: Callable, function: Callable, x: torch.Tensor) -> torch.Tensor:
    """``x``'s gradient through ``run(function, x)``, by ``backward()`` (the reentrant variants refuse
    ``autograd.grad``)."""
    x.grad = None
    run(function, x).sum().backward()
    return x.grad


def plain(function: Callable, x: torch.Tensor) -> torch.Tensor:
    return function(x)


TORCH = {
    "torch, use_reentrant=False": lambda f, x: torch_checkpoint(f, x, use_reentrant=False),
    "torch, use_reentrant=True": lambda f, x: torch_checkpoint(f, x, use_reentrant=True),
    "torch SAC (saves mm)": lambda f, x: torch_checkpoint(
        f, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts([aten.mm.default])
    ),
}


# ============================================================== a re-run that saves more tensors
@pytest.mark.parametrize("early_stop", [True, False])
def test_torch_misses_a_rerun_that_saves_more_with_early_stop(early_stop: bool) -> None:
    x = torch.randn(5, requires_grad=True)
    right = gradient(plain, sin_exp, x)
    function = second_call_differs(sin_exp, sin_cos_exp)
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        if early_stop:
            # torch stops once the re-run has saved as many tensors as the forward: wrong, silently.
            got = gradient(TORCH["torch, use_reentrant=False"], function, x)
            assert not torch.allclose(got, right)
        else:
            with pytest.raises(torch.utils.checkpoint.CheckpointError, match="trying to save more tensors"):
                gradient(TORCH["torch, use_reentrant=False"], function, x)


@pytest.mark.parametrize("early_stop", [True, False])
def test_ours_catches_a_rerun_that_saves_more_early_stop_on_or_off(early_stop: bool) -> None:
    x = torch.randn(5, requires_grad=True)
    function = second_call_differs(sin_exp, sin_cos_exp)
    # Saved tensor 1 is exp's result in the forward; in the re-run it is sin's, which cos saves.
    expected = (
        r"saved tensor 1 was made by aten\.exp in the forward and by aten\.sin in the re-run, at "
        r"test_rerun_check\.py:\d+ in sin_cos_exp"
    )
    with set_checkpoint_early_stop(early_stop), pytest.raises(CheckpointError, match=expected) as info:
        gradient(checkpoint, function, x)
    # Ours is torch's exception type too: code written for torch catches it.
    assert isinstance(info.value, torch.utils.checkpoint.CheckpointError)
    assert str(info.value).startswith("checkpoint: the recomputation took another path than the forward")


def test_the_reentrant_checkpoints_on_a_rerun_that_does_more() -> None:
    x = torch.randn(5, requires_grad=True)
    right = gradient(plain, sin_exp, x)
    got = gradient(TORCH["torch, use_reentrant=True"], second_call_differs(sin_exp, sin_cos_exp), x)
    assert not torch.allclose(got, right)  # torch: no check at all
    with pytest.raises(
        CheckpointError, match=r"reentrant_checkpoint: the recomputation is not the forward: output 0"
    ):
        gradient(reentrant_checkpoint, second_call_differs(sin_exp, sin_cos_exp), x)


def test_selective_catches_it_op_by_op_where_torchs_sac_does_not() -> None:
    x = torch.randn(5, requires_grad=True)
    right = gradient(plain, sin_exp, x)
    got = gradient(TORCH["torch SAC (saves mm)"], second_call_differs(sin_exp, sin_cos_exp), x)
    assert not torch.allclose(got, right)
    sac = lambda f, v: selective_checkpoint(f, v, policy=[aten.mm.default])
    # cos saves its input before it runs: the checkpoint's check (the op that made saved tensor 1)
    # sees it before the selective one (op 1 is cos, not exp). Either names the re-run's line.
    with pytest.raises(
        CheckpointError,
        match=r"aten\.exp in the forward and by aten\.sin in the re-run, at "
        r"test_rerun_check\.py:\d+ in sin_cos_exp",
    ):
        gradient(sac, second_call_differs(sin_exp, sin_cos_exp), x)
    # An op that saves nothing before it runs (exp in place of sin) meets the selective check first.
    with pytest.raises(
        CheckpointError,
        match=r"Op 0 was aten\.sin\.default in the forward and is "
        r"aten\.exp\.default in the recomputation, at test_rerun_check\.py:\d+ in ",
    ):
        gradient(sac, second_call_differs(sin_exp, lambda v: v.exp().exp()), x)


# ================================================= a branch of the same shape (tanh or sigmoid)
def test_a_branch_of_the_same_shape_passes_torchs_checkpoints() -> None:
    x = torch.randn(5, requires_grad=True)
    right = gradient(plain, tanh, x)
    for name in ["torch, use_reentrant=False", "torch, use_reentrant=True"]:
        got = gradient(TORCH[name], second_call_differs(tanh, sigmoid), x)
        assert not torch.allclose(got, right), name
    if SAC_ASKS_IN_RECOMPUTE:
        # torch's SAC before 2.13 (2.11 checked) asks the policy again in the recomputation, which
        # says recompute for sigmoid: it runs, and the gradients are silently wrong too.
        got = gradient(TORCH["torch SAC (saves mm)"], second_call_differs(tanh, sigmoid), x)
        assert not torch.allclose(got, right)
        return
    # torch's SAC keys its cache by op: an op the forward never ran is not found there.
    with pytest.raises(RuntimeError, match=r"aten\.sigmoid\.default encountered during backward"):
        gradient(TORCH["torch SAC (saves mm)"], second_call_differs(tanh, sigmoid), x)


@pytest.mark.parametrize("early_stop", [True, False])
def test_ours_catch_a_branch_of_the_same_shape(early_stop: bool) -> None:
    x = torch.randn(5, requires_grad=True)
    with set_checkpoint_early_stop(early_stop):
        with pytest.raises(CheckpointError, match=r"made by aten\.tanh in the forward and by aten\.sigmoid"):
            gradient(checkpoint, second_call_differs(tanh, sigmoid), x)
        with pytest.raises(CheckpointError, match=r"Op 1 was aten\.tanh\.default in the forward"):
            gradient(
                lambda f, v: selective_checkpoint(f, v, policy=[]), second_call_differs(tanh, sigmoid), x
            )
    with pytest.raises(
        CheckpointError, match=r"output 0 has norm [\d.]+ in the re-run and [\d.]+ in the forward"
    ):
        gradient(reentrant_checkpoint, second_call_differs(tanh, sigmoid), x)


def test_the_metadata_error_comes_first_and_says_where_the_paths_parted() -> None:
    # torch's test case: the re-run saves a constant of another shape where the forward saved exp's
    # result. torch's sentence for the metadata first, then the op.
    a = torch.randn(1, requires_grad=True)
    alt = lambda x: x.sin() * torch.tensor([1.0, 2.0])
    with pytest.raises(CheckpointError) as info:
        checkpoint(second_call_differs(sin_exp, alt), a).backward()
    message = str(info.value)
    assert message.startswith(
        "checkpoint: Recomputed values for the following tensors have different metadata"
    )
    assert re.search(
        r"The re-run took another path: saved tensor 1 was made by aten\.exp in the forward and "
        r"by no op \(a tensor without grad\) in the re-run",
        message,
    ), message


def test_determinism_check_none_compares_nothing_as_torchs() -> None:
    x = torch.randn(5, requires_grad=True)
    right = gradient(plain, tanh, x)
    ours = lambda f, v: checkpoint(f, v, determinism_check="none")
    reentrant = lambda f, v: reentrant_checkpoint(f, v, determinism_check="none")
    for run in (ours, reentrant):
        assert not torch.allclose(gradient(run, second_call_differs(tanh, sigmoid), x), right)
    with pytest.raises(ValueError, match=r"determinism_check should be one of \['default', 'none'\]"):
        reentrant_checkpoint(tanh, x, determinism_check="full")


def test_debug_error_starts_with_torchs_sentence_then_ours() -> None:
    x = torch.randn(5, requires_grad=True)
    with pytest.raises(CheckpointError) as info:
        checkpoint(second_call_differs(tanh, sigmoid), x, debug=True).sum().backward()
    first, second = str(info.value).splitlines()[:2]
    assert first.startswith(
        "You are seeing this error because you passed `debug=True` to checkpoint and tensors to be saved "
        "during the original forward and differ between those saved during recomputation."
    )
    assert second.startswith("checkpoint: the recomputation took another path than the forward")
    assert "first difference" in str(info.value)


# ================================================================== no error where nothing differs
class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def function_defining_its_own_autograd_function(x: torch.Tensor) -> torch.Tensor:
    class Square(_Square):  # a new class, with a new backward class, at every call
        pass

    return Square.apply(x.sin()).exp()


CASES: dict[str, Callable[[], tuple[Callable, tuple]]] = {
    "nested checkpoints": lambda: (lambda x: checkpoint(sin_exp, x.cos()).tanh(), leaves((4,))),
    "an autograd.Function defined inside": lambda: (
        function_defining_its_own_autograd_function,
        leaves((4,)),
    ),
    "dropout (RNG replayed)": lambda: (nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)), leaves((3, 4))),
    "input that needs no grad": lambda: (nn.Linear(4, 4), (torch.randn(3, 4),)),
    "eval-mode transformer (a no-grad fast path)": lambda: (
        nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).eval(),
        leaves((2, 5, 8)),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("variant", ["checkpoint", "reentrant_checkpoint"])
def test_no_error_and_torchs_gradients_where_nothing_differs(case: str, variant: str) -> None:
    torch.manual_seed(0)
    function, args = CASES[case]()
    ours = checkpoint if variant == "checkpoint" else reentrant_checkpoint
    theirs = TORCH["torch, use_reentrant=False" if variant == "checkpoint" else "torch, use_reentrant=True"]
    params = list(function.parameters()) if isinstance(function, nn.Module) else []
    if variant == "reentrant_checkpoint" and not any(a.requires_grad for a in args):
        pytest.skip(
            "the reentrant variants train nothing when no input requires grad (tests/test_reentrant.py)"
        )
    wrt = [t for t in (*args, *params) if t.requires_grad]
    results = []
    for run in (ours, theirs):
        for t in wrt:
            t.grad = None
        torch.manual_seed(1)
        run(function, *args).sum().backward()  # backward(): the reentrant variants refuse autograd.grad
        results.append([t.grad.clone() for t in wrt])
    for got, expected in zip(*results, strict=True):
        assert torch.allclose(got, expected, atol=1e-6), case


def test_made_by_is_the_grad_fn_name_or_what_the_tensor_is() -> None:
    x = torch.randn(3, requires_grad=True)
    assert made_by(x.sin()) == "SinBackward0"
    assert made_by(x) == "leaf"
    assert made_by(torch.randn(3)) == "no grad"


# ======================================================= torch 2.14: checkpoint(**keywords)(function)
def test_configured_form_checkpoints_the_function_it_decorates() -> None:
    x = torch.randn(4, requires_grad=True)
    runs = []

    @checkpoint(use_reentrant=False, preserve_rng_state=False)
    def block(v: torch.Tensor, *, scale: float) -> torch.Tensor:
        runs.append(1)
        return (v * scale).sin().exp()

    assert block.__name__ == "block"  # functools.update_wrapper, as torch's
    out = block(x, scale=2.0)
    assert out.grad_fn is not None and len(frame_of(out.grad_fn._raw_saved_result).handles) == 2
    out.sum().backward()
    assert len(runs) == 2  # the forward and one re-run: it is checkpointed
    assert torch.allclose(x.grad, ((2 * x).sin().exp() * (2 * x).cos() * 2).detach())


def test_configured_form_as_a_method_decorator() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)

        @checkpoint(use_reentrant=False)
        def forward(self, v: torch.Tensor) -> torch.Tensor:
            return self.linear(v).tanh()

    block, x = Block(), torch.randn(2, 3)
    out = block(x)
    assert frame_of(out.grad_fn._raw_saved_result) is not None
    out.sum().backward()
    assert block.linear.weight.grad is not None


def test_configured_form_refuses_bad_keywords_at_once() -> None:
    with pytest.raises(ValueError, match=r"ckpt_lab\.reentrant_checkpoint"):
        checkpoint(use_reentrant=True)
    with pytest.raises(ValueError, match="determinism_check should be one of"):
        checkpoint(determinism_check="full")
    with pytest.raises(ValueError, match="Unexpected keyword arguments: scale"):
        checkpoint(use_reentrant=False, scale=2.0)


@needs_torch_2_14
def test_configured_form_gives_torchs_gradients() -> None:
    x = torch.randn(4, requires_grad=True)
    ours = checkpoint(use_reentrant=False)(sin_exp)(x)
    theirs = torch_checkpoint(use_reentrant=False)(sin_exp)(x)
    assert torch.equal(torch.autograd.grad(ours.sum(), x)[0], torch.autograd.grad(theirs.sum(), x)[0])


# ========================================================== torch 2.14: respect_saved_tensors_hooks
def counting_hooks(shape: tuple[int, ...]) -> tuple[saved_tensors_hooks, list[str]]:
    """Identity hooks that log "pack"/"unpack" for tensors of ``shape`` (mm's output below)."""
    log: list[str] = []

    def pack(t: torch.Tensor) -> Any:
        if tuple(t.shape) == shape:
            log.append("pack")
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        if tuple(t.shape) == shape:
            log.append("unpack")
        return t

    return saved_tensors_hooks(pack, unpack), log


def mm_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).relu().sum(0)


@pytest.mark.parametrize("respect", [None, False, True])
def test_selective_cache_goes_through_enclosing_hooks_only_when_asked(respect: bool | None) -> None:
    x, w = leaves((3, 5), (5, 7))
    expected = torch.autograd.grad(mm_block(x, w).sum(), [x, w])
    hooks, log = counting_hooks((3, 7))
    with hooks:
        out = selective_checkpoint(
            mm_block, x, w, policy=[aten.mm.default], respect_saved_tensors_hooks=respect
        )
    got = torch.autograd.grad(out.sum(), [x, w])
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    # mm's output is cached, outside autograd: the enclosing hooks see it only with True.
    assert log == (["pack", "unpack"] if respect else [])


def test_respect_reaches_the_cache_through_checkpoints_keyword_and_the_contexts() -> None:
    from functools import partial

    x, w = leaves((3, 5), (5, 7))
    for context_fn, keyword in [
        (partial(selective.selective_checkpoint_contexts, [aten.mm.default]), True),
        (
            partial(
                selective.selective_checkpoint_contexts, [aten.mm.default], respect_saved_tensors_hooks=True
            ),
            None,
        ),
    ]:
        hooks, log = counting_hooks((3, 7))
        with hooks:
            out = checkpoint(mm_block, x, w, context_fn=context_fn, respect_saved_tensors_hooks=keyword)
        out.sum().backward()
        assert log == ["pack", "unpack"]


def test_respect_saved_tensors_hooks_is_refused_by_the_reentrant_variant_as_torch_does() -> None:
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="only supported when use_reentrant=False"):
        reentrant_checkpoint(torch.sin, x, respect_saved_tensors_hooks=True)
    checkpoint(torch.sin, x, respect_saved_tensors_hooks=True).sum().backward()  # plain: no effect


def test_our_hooks_say_whose_hooks_they_cover() -> None:
    # torch 2.14's protocol: a checkpoint's own pack hook is marked, and names the user's hooks.
    seen = []
    hooks, _ = counting_hooks((0,))
    with hooks:
        checkpoint(lambda v: seen.append(nonreentrant.user_saved_tensors_hooks()) or v.sin(), torch.randn(2))
    top = torch.randn(1)
    with hooks:
        assert nonreentrant.user_saved_tensors_hooks()[0] is hooks.pack_hook
    assert seen == [(hooks.pack_hook, hooks.unpack_hook)] and top is not None
    assert nonreentrant.user_saved_tensors_hooks() is None


@needs_torch_2_14
@pytest.mark.parametrize("respect", [False, True])
def test_respect_saved_tensors_hooks_as_torch_2_14(respect: bool) -> None:
    x, w = leaves((3, 5), (5, 7))
    logs = []
    for ours in (True, False):
        hooks, log = counting_hooks((3, 7))
        with hooks:
            if ours:
                out = selective_checkpoint(
                    mm_block, x, w, policy=[aten.mm.default], respect_saved_tensors_hooks=respect
                )
            else:
                context = lambda: create_selective_checkpoint_contexts([aten.mm.default])
                out = torch_checkpoint(
                    mm_block,
                    x,
                    w,
                    use_reentrant=False,
                    context_fn=context,
                    respect_saved_tensors_hooks=respect,
                )
        out.sum().backward()
        logs.append(log)
    assert logs[0] == logs[1]


# ===================================================== autocast: torch's default device type
def test_cpu_arguments_record_the_default_device_types_autocast_as_torch() -> None:
    # torch's rule (_infer_device_type): all tensor arguments on the CPU -> the default device type.
    # "xpu" stands for an accelerator: its autocast state can be set on a CPU-only build.
    seen: dict[str, list[bool]] = {}

    def block(v: torch.Tensor) -> torch.Tensor:
        seen[name].append(torch.is_autocast_enabled("xpu"))
        return v.sin()

    variants = {"ours": checkpoint, "ours, reentrant": reentrant_checkpoint, **TORCH}
    del variants["torch SAC (saves mm)"]
    previous = DefaultDeviceType._default_device_type
    DefaultDeviceType.set_device_type("xpu")
    try:
        assert [d for d, _, _ in ReplayState.capture(torch.randn(2)).autocast.settings] == ["cpu", "xpu"]
        for name, run in variants.items():
            seen[name] = []
            x = torch.randn(3, requires_grad=True)
            with torch.autocast("xpu", dtype=torch.float16):
                out = run(block, x)
            out.sum().backward()  # outside autocast: the re-run must restore the forward's state
    finally:
        DefaultDeviceType._default_device_type = previous
    assert all(flags == [True, True] for flags in seen.values()), seen


def test_on_a_machine_without_accelerator_cpu_arguments_record_the_cpu_only() -> None:
    if torch.accelerator.current_accelerator(True) is not None:
        pytest.skip("this machine has an accelerator")
    assert [d for d, _, _ in ReplayState.capture(torch.randn(2)).autocast.settings] == ["cpu"]


# ================================================================ the names the notebooks read
def test_frame_of_a_saved_tensor() -> None:
    x = torch.randn(6, requires_grad=True)
    out = checkpoint(sin_exp, x)
    frame = frame_of(out.grad_fn._raw_saved_result)
    assert isinstance(frame, nonreentrant.Frame)
    assert [str(m) for m in frame.metas] == ["shape=(6,), dtype=torch.float32, device=cpu"] * 2
    assert frame.makers == ["leaf", "ExpBackward0"]
    assert isinstance(out.grad_fn._raw_saved_result.data, nonreentrant.Handle)
    assert frame_of(out.grad_fn._raw_saved_result.unpack_hook) is frame
    assert frame_of(x.sin().grad_fn._raw_saved_self) is None  # not inside any checkpoint


def test_old_private_names_still_work() -> None:
    assert nonreentrant._recompute is nonreentrant.recompute
    assert nonreentrant._unpack_from_handle is nonreentrant.unpack_from_handle
    assert nonreentrant._Frame is nonreentrant.Frame and nonreentrant._Handle is nonreentrant.Handle
    assert selective._SaveMode is selective.SaveMode and selective._ServeMode is selective.ServeMode
    assert ckpt_lab.nonreentrant.CheckpointError is CheckpointError
