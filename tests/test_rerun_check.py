"""A re-run that takes another path is caught; torch 2.14's checkpoint additions; autocast's device.

Marked by task:

* the re-run check: the non-reentrant checkpoint compares the op that made each saved tensor, the
  reentrant one its outputs, the selective one op by op; each case against torch, which misses some
  (its behaviour asserted as it is);
* a saved tensor the re-run modifies in place after saving it: autograd's error from ours, where
  torch's non-reentrant checkpoint gives a wrong gradient (asserted as it is); the reentrant
  variants, the selective checkpoint and the scope raise too;
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


def test_the_reentrant_message_names_a_captured_tensor_changed_in_place() -> None:
    # notebook 02's wrapper case: the block reads a tensor it captures, not one of its inputs; it
    # changes in place between forward and backward. Same symptom as a branch: other outputs.
    x = torch.randn(5, requires_grad=True)
    captured = torch.randn(5)
    right = gradient(plain, lambda v: v.sin() * captured, x)
    for run in (TORCH["torch, use_reentrant=True"], reentrant_checkpoint):
        x.grad = None
        out = run(lambda v: v.sin() * captured, x)
        captured.mul_(2)  # between forward and backward
        if run is reentrant_checkpoint:
            with pytest.raises(CheckpointError) as info:
                out.sum().backward()
            said = "or a tensor the function captures (not one of its inputs) changed in place"
            assert said in str(info.value)
        else:
            out.sum().backward()
            assert not torch.allclose(x.grad, right)  # torch: no check, a wrong gradient
        captured.div_(2)
    # Passed as an argument, the tensor is saved for backward: autograd's own check catches it.
    out = reentrant_checkpoint(lambda v, c: v.sin() * c, x, captured)
    captured.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


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


def test_the_reentrant_message_shows_norms_to_3_digits_that_stay_put_on_another_processor() -> None:
    # notebooks store the message (nbval compares it exactly); a norm's last digits depend on the
    # summation order. 3 significant digits, more only where 3 would show the two equal.
    x = torch.full((5,), 2.0, requires_grad=True)
    with pytest.raises(
        CheckpointError, match=r"output 0 has norm 6\.71 in the re-run and 4\.47 in the forward"
    ):
        gradient(reentrant_checkpoint, second_call_differs(lambda v: v * 1, lambda v: v * 1.5), x)
    with pytest.raises(CheckpointError, match=r"norm 4\.47348 in the re-run and 4\.47214 in the forward"):
        gradient(reentrant_checkpoint, second_call_differs(lambda v: v * 1, lambda v: v * 1.0003), x)


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


# ============================================== a saved tensor the re-run modifies in place after saving
# cos saves y; add_ then modifies y. Without a checkpoint autograd raises; with one, the saved tensors
# go through hooks, which autograd's version check skips.
def modified_after_cos_saved_it(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    z = y.cos()
    y.add_(1)
    return z


def and_saved_again_after(x: torch.Tensor) -> torch.Tensor:
    # The same, with exp's result saved after the add_: early stop cannot end the re-run before it.
    y = x.sin()
    z = y.cos()
    y.add_(1)
    return z * y.exp()


# What the two compute, written without the in-place op: the right gradients.
RIGHT: dict[Callable, Callable] = {
    modified_after_cos_saved_it: lambda x: x.sin().cos(),
    and_saved_again_after: lambda x: x.sin().cos() * (x.sin() + 1).exp(),
}


def autograds_error(function: Callable) -> str:
    """The sentence autograd raises for ``function`` without a checkpoint (SavedVariable::unpack)."""
    x = torch.tensor([0.3, 0.7, 1.1], dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
        function(x).sum().backward()
    return str(info.value)


def inplace_input() -> torch.Tensor:
    return torch.tensor([0.3, 0.7, 1.1], dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("early_stop", [True, False])
def test_torch_gives_a_wrong_gradient_for_a_saved_tensor_the_rerun_modifies(early_stop: bool) -> None:
    # torch's behaviour as it is (the reason for ours): no error, a gradient that is not the plain one.
    x = inplace_input()
    for function, right in RIGHT.items():
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            got = gradient(TORCH["torch, use_reentrant=False"], function, x)
        # Early stop ends the first one's re-run inside cos, before the add_: right by luck.
        lucky = early_stop and function is modified_after_cos_saved_it
        assert torch.allclose(got, gradient(plain, right, x)) == lucky


@pytest.mark.parametrize("function", [modified_after_cos_saved_it, and_saved_again_after])
@pytest.mark.parametrize("early_stop", [True, False])
def test_ours_raises_autograds_error_where_the_rerun_modifies_a_saved_tensor(
    function: Callable, early_stop: bool
) -> None:
    x = inplace_input()
    if early_stop and function is modified_after_cos_saved_it:
        # The re-run stops inside cos, before the add_: the tensor handed back is the right one.
        right = gradient(plain, RIGHT[function], x)
        assert torch.equal(gradient(lambda f, v: checkpoint(f, v, early_stop=True), function, x), right)
        return
    with pytest.raises(CheckpointError) as info:
        gradient(lambda f, v: checkpoint(f, v, early_stop=early_stop), function, x)
    message = str(info.value)
    # torch's sentence (SavedVariable::unpack's, without its clause on the grad_fn a recomputed
    # tensor has not), then ours: which saved tensor, made by what, what to do.
    pattern = (
        r"(.*\]\])(, which is output 0 of \w+,)( is at version 1; expected version 0 instead\.) Hint: .*"
    )
    torchs = re.fullmatch(pattern, autograds_error(function))
    assert torchs is not None
    assert torchs[1] == (
        "one of the variables needed for gradient computation has been modified by an inplace "
        "operation: [torch.DoubleTensor [3]]"
    )
    assert message.startswith(
        f"checkpoint: {torchs[1]}{torchs[3]} The recomputation modified saved tensor 1 (made by aten.sin) "
        "in place after an op had saved it for backward."
    ), message
    assert "y = y + 1, not y.add_(1)" in message and "debug=True" in message
    # torch's exception type, as autograd's error is: code that catches RuntimeError still does.
    assert isinstance(info.value, RuntimeError)


def test_determinism_check_none_still_checks_versions_and_debug_marks_the_in_place_op() -> None:
    x = inplace_input()
    with pytest.raises(CheckpointError, match=r"modified saved tensor 1 in place"):
        checkpoint(and_saved_again_after, x, determinism_check="none").sum().backward()
    with pytest.raises(CheckpointError) as info:
        checkpoint(and_saved_again_after, x, debug=True).sum().backward()
    marked = [line for line in str(info.value).splitlines() if line.endswith("<-- in place")]
    assert len(marked) == 1 and "aten.add_.Tensor" in marked[0] and "in and_saved_again_after" in marked[0]


def test_in_place_before_the_save_or_on_a_tensor_nobody_saved_is_fine() -> None:
    def before(v: torch.Tensor) -> torch.Tensor:
        y = v.sin()
        y.add_(1)  # before cos saves it: cos saves version 1, in the forward and the re-run
        return y.cos()

    def unsaved(v: torch.Tensor) -> torch.Tensor:
        y = v * 2  # a product by a number saves nothing
        y.add_(1)
        return y.sin()

    bn = nn.BatchNorm1d(3).double()  # running stats: saved, and updated inside the op (no version bump)
    twice = lambda v: bn(bn(torch.outer(torch.arange(1.0, 5.0, dtype=v.dtype), v)))  # a batch of 4
    for function in (before, unsaved, twice):
        x = inplace_input()
        right = gradient(plain, function, x)
        with set_checkpoint_early_stop(False):
            got = gradient(checkpoint, function, x)
            assert torch.equal(got, gradient(TORCH["torch, use_reentrant=False"], function, x))
        assert torch.allclose(got, right)


def test_the_reentrant_checkpoints_nested_backward_raises_autograds_error() -> None:
    # Its re-run builds a graph of its own, saved without hooks: autograd's check applies as usual.
    for run in (reentrant_checkpoint, TORCH["torch, use_reentrant=True"]):
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
            gradient(run, modified_after_cos_saved_it, inplace_input())
        assert not isinstance(info.value, CheckpointError)


@pytest.mark.parametrize("saved", [[], [aten.sin.default], [aten.cos.default]])
def test_selective_raises_where_the_rerun_modifies_a_saved_tensor(saved: list) -> None:
    # Built on ours: the re-run's check covers it (a served output is the forward's, also checked).
    sac = lambda f, v: selective_checkpoint(f, v, policy=saved)
    with set_checkpoint_early_stop(False), pytest.raises(CheckpointError, match="modified by an inplace"):
        gradient(sac, modified_after_cos_saved_it, inplace_input())
    with pytest.raises(CheckpointError, match="modified by an inplace"):
        gradient(sac, and_saved_again_after, inplace_input())


def test_the_scope_raises_where_a_scope_tensor_is_modified_after_autograd_saved_it() -> None:
    # The scope records the add_ on its tape and knows the version each saved tensor had: it refuses.
    for function in (modified_after_cos_saved_it, and_saved_again_after):
        x = inplace_input()
        with ckpt_lab.gradient_checkpoint_scope():
            out = function(x)
        with pytest.raises(CheckpointError, match="modified in place after autograd saved it"):
            out.sum().backward()


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
