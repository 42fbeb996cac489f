"""Exercise 03b: a non-reentrant checkpoint on saved-tensor hooks (notebook 03b §1 and §2).

The learner's file defines ``checkpoint(function, *args)``: ``function(*args)`` with grad on, its
saved tensors replaced by tickets (a pack hook), recomputed by one re-run at backward's first
unpack. The checks, on a block (Linear, GELU, Linear, GELU) and notebook 03's six-``sin`` chain:

* what it keeps from forward to backward, and after a backward (``Tracker``, storage by storage);
* how often the block runs, and in which grad mode (``CallCounter`` and a pre-hook);
* gradients bit for bit: ``.backward()``, a second ``backward(retain_graph=True)``,
  ``torch.autograd.grad``, an input that needs no gradient, dropout;
* what it leaves behind when the function raises (``global_state``).
"""

from __future__ import annotations

from typing import Any

import torch

from ckpt_lab.exercises._delegation import CHECKPOINTS
from ckpt_lab.exercises._feedback import (
    Tracker,
    compare_gradients,
    listing,
    logged_rng,
    logged_runs,
    restore_state,
    rng_hint,
    size,
    state_left_behind,
)
from ckpt_lab.exercises._grading import Check, Exercise, Submission, error_text
from ckpt_lab.exercises.ex02_checkpoint_function.grader import _block, _dropout_step, _grads, _input
from ckpt_lab.instruments import CallCounter, global_state


def _sin_chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(6):
        x = x.sin()
    return x


def _chain_input() -> torch.Tensor:
    return torch.randn(1000, generator=torch.Generator().manual_seed(3)).requires_grad_()


def _compare(got: list[tuple[str, Any]], expected: list[tuple[str, Any]], what: str) -> None:
    said = compare_gradients([(n, g, e) for (n, g), (_, e) in zip(got, expected, strict=True)])
    assert not said, f"{what}, gradients differ from a plain run's:\n" + "\n".join(f"- {s}" for s in said[:3])


def _wrapped(error: BaseException, sub: Submission, what: str, hint: str) -> AssertionError:
    where = sub.line_of(error)
    return AssertionError(
        f"{what} raised {type(error).__name__}{f' at {where}' if where else ''}: {error_text(error)}\n{hint}"
    )


# ---------------------------------------------------------------------------------------------- checks
def check_forward(sub: Submission) -> None:
    block, x = _block(), _input()
    out = sub.checkpoint(block, x)
    with torch.no_grad():
        expected = block(x)
    assert (
        isinstance(out, torch.Tensor) and out.shape == expected.shape and torch.equal(out.detach(), expected)
    ), "checkpoint(block, x) must return block(x)."
    assert out.requires_grad, (
        "checkpoint(block, x)'s output does not require grad: run the function with grad mode on. A "
        "non-reentrant checkpoint records the block's usual graph and changes only what it stores "
        "(notebook 03b §1)."
    )


def check_keeps_only_inputs(sub: Submission) -> None:
    block, x = _block(), _input()
    with Tracker(sub) as tracker:
        tracker.watch(block, "block")
        out = sub.checkpoint(block, x)
        loss = out.sum()  # sum keeps nothing of its input
        del out
        kept = tracker.alive("forward", exclude=[loss])
    assert not kept, (
        f"Your checkpoint keeps {len(kept)} tensor{'s' * (len(kept) != 1)} made by the block "
        f"({size(sum(b.nbytes for b in kept))}) from forward to backward. The first:\n{listing(kept)}\n"
        "Its pack hook should store a ticket (a position, an empty handle), not the tensor: what "
        "autograd stores is whatever pack returns (notebook 03 §3, notebook 03b §1)."
    )


def check_reruns_once_with_grad(sub: Submission) -> None:
    block, x = _block(), _input()
    runs = CallCounter(block)
    error = None
    try:
        with logged_runs(block) as modes:
            out = sub.checkpoint(block, x)
            try:
                out.sum().backward()
            except Exception as raised:
                error = raised
    finally:
        runs.remove()
    said = []
    if len(modes) >= 2 and not all(modes[1:]):
        said.append(
            "Your re-run ran the block with grad mode off. Backward runs with grad off, and ops save "
            "tensors for backward only when grad mode is on: the re-run saved nothing, so there was nothing "
            "to hand to backward. Re-run it under `with torch.enable_grad():` (notebook 03b §1)."
        )
    if runs.count > 2:
        said.append(
            f"The block ran {runs.count} times for one forward and one backward ({runs.count - 1} re-runs). "
            "Each unpack re-ran it: re-run once, at the first unpack of a backward, keep what it "
            "recomputes, and hand the rest out from there (notebook 03b §1, draft 1 -> draft 2)."
        )
    elif runs.count == 1 and error is None:
        said.append("Backward never re-ran the block: did the pack hook keep the tensors themselves?")
    assert not said, "\n".join(said)
    if error is not None:
        raise error


def check_gradients(sub: Submission) -> None:
    block, x = _block(), _input()
    x_plain = x.detach().clone().requires_grad_()
    block(x_plain).square().sum().backward()
    expected = _grads(block, x_plain)
    sub.checkpoint(block, x).square().sum().backward()
    _compare(_grads(block, x), expected, "After .backward()")


def check_frees_after_use(sub: Submission) -> None:
    x = _chain_input()
    with Tracker(sub) as tracker:
        out = sub.checkpoint(_sin_chain, x)
        tracker.phase = "backward"
        out.sum().backward(retain_graph=True)
        held = tracker.alive("backward", exclude=[x.grad])
    assert not held, (
        f"After backward(retain_graph=True) on notebook 03's six-sin chain, your checkpoint still holds "
        f"{len(held)} tensor{'s' * (len(held) != 1)} its re-run made ({size(sum(b.nbytes for b in held))}), "
        f"as long as the graph lives. The first:\n{listing(held)}\nHand each recomputed tensor to backward "
        "once and drop your reference to it (pop it), so backward frees it after use; kept, they bring "
        "the memory back to what no checkpoint costs (notebook 03b §1, draft 2)."
    )


def check_second_backward(sub: Submission) -> None:
    x = _chain_input()
    x_plain = x.detach().clone().requires_grad_()
    loss = _sin_chain(x_plain).sum()
    loss.backward(retain_graph=True)
    first = x_plain.grad.clone()
    loss.backward()
    out = sub.checkpoint(_sin_chain, x)
    got = []
    for k in (1, 2):
        try:
            out.sum().backward(retain_graph=True)
        except Exception as error:
            raise _wrapped(
                error,
                sub,
                f"Backward number {k} through the same graph (retain_graph=True)",
                "Every backward unpacks every saved tensor again: when the tensor a ticket stands for was "
                "already handed out, re-run again (notebook 03b §2: handles are emptied, so each backward "
                "re-runs).",
            ) from None
        got.append(x.grad.clone())
    _compare(
        [("x", got[0]), ("x", got[1])],
        [("x", first), ("x", x_plain.grad)],
        "Two backward passes through one graph (retain_graph=True; .grad accumulates)",
    )


def check_autograd_grad(sub: Submission) -> None:
    block, x = _block(), _input()
    leaves = [x, *block.parameters()]
    expected = torch.autograd.grad(block(x).square().sum(), leaves)
    got = torch.autograd.grad(sub.checkpoint(block, x).square().sum(), leaves)
    names = [n for n, _ in _grads(block, x)]
    _compare(
        list(zip(names, got, strict=True)),
        list(zip(names, expected, strict=True)),
        "With torch.autograd.grad",
    )
    touched = [n for n, t in zip(names, leaves, strict=True) if t.grad is not None]
    assert not touched, (
        f"torch.autograd.grad wrote .grad of {', '.join(touched)}: it must return the gradients and leave "
        ".grad alone. Was there a nested .backward() in your checkpoint (notebook 02 §6)?"
    )


def check_frozen_input(sub: Submission) -> None:
    block, x = _block(), _input().detach()
    block(x).square().sum().backward()
    expected = _grads(block)
    sub.checkpoint(block, x).square().sum().backward()
    _compare(
        _grads(block),
        expected,
        "With an input that needs no gradient (data, or a frozen layer's output: notebook 03b §3.1)",
    )


def check_dropout_masks(sub: Submission) -> None:
    block, x = _block(dropout=0.5), _input()
    x_plain = x.detach().clone().requires_grad_()
    _dropout_step(block, x_plain)
    expected = _grads(block, x_plain)
    with logged_rng(block) as calls:
        _dropout_step(lambda t: sub.checkpoint(block, t), x)
    said = compare_gradients([(n, g, e) for (n, g), (_, e) in zip(_grads(block, x), expected, strict=True)])
    assert not said, (
        "With dropout in the block, gradients differ from a plain run with the same seed:\n"
        + "\n".join(f"- {s}" for s in said[:3])
        + "\n"
        + rng_hint(calls, "notebook 02 §8")
    )


def check_random_stream(sub: Submission) -> None:
    block, x = _block(dropout=0.5), _input()
    _, _, plain_after = _dropout_step(block, x.detach().clone().requires_grad_())
    _, between, after = _dropout_step(lambda t: sub.checkpoint(block, t), x)
    assert torch.equal(after, plain_after), (
        "The caller's random numbers after backward differ from a plain run's"
        + (
            " (they repeat the draw made between forward and backward: the stream was rewound)"
            if torch.equal(after, between)
            else ""
        )
        + ". Restore the forward's generator state for the re-run inside "
        "`torch.random.fork_rng(devices=[])`, which puts the caller's state back afterwards (notebook 02 §8)."
    )


class _Boom(Exception):
    """What the grader's function raises inside the checkpoint."""


def check_error_leaves_nothing(sub: Submission) -> None:
    def fails(t: torch.Tensor) -> torch.Tensor:
        t.sin()
        raise _Boom("the function raised")

    before = global_state()
    try:
        sub.checkpoint(fails, _input())
    except _Boom:
        pass
    else:
        raise AssertionError(
            "The function raised inside your checkpoint, and the checkpoint returned "
            "normally: let the exception reach the caller."
        )
    left = state_left_behind(before)
    if left:
        left = " ".join(filter(None, [left, restore_state(before)]))
        raise AssertionError(
            "When the function raised inside your checkpoint, it left this behind.\n"
            + left.removeprefix("Left behind: ")
            + "\nPush the hooks with `with saved_tensors_hooks(pack, unpack):` (or pop them in a "
            "`finally:`), so that they come off the stack even when the function raises (notebook 03b §2)."
        )


def checks() -> list[Check]:
    return [
        Check("forward", "checkpoint(block, x) returns block(x), which requires grad", check_forward,
              basic=True),
        Check("keeps-only-inputs", "keeps nothing the block made from forward to backward",
              check_keeps_only_inputs),
        Check("re-run", "backward re-runs the block once, with grad mode on", check_reruns_once_with_grad),
        Check("gradients", "gradients of x and the block's parameters equal a plain run's, bit for bit",
              check_gradients, needs=("re-run",)),
        Check("frees-after-use", "after backward, no recomputed tensor is held", check_frees_after_use,
              needs=("re-run",)),
        Check("second-backward", "a second backward through the same graph (retain_graph=True)",
              check_second_backward, needs=("gradients",)),
        Check("autograd-grad", "torch.autograd.grad gives the plain gradients and leaves .grad alone",
              check_autograd_grad, needs=("gradients",)),
        Check("frozen-input", "an input that needs no gradient: the parameters still get theirs",
              check_frozen_input, needs=("gradients",)),
        Check("dropout", "dropout: the re-run draws the forward's masks", check_dropout_masks,
              needs=("gradients",)),
        Check("random-stream", "dropout: the caller's random stream continues as without checkpoint",
              check_random_stream, needs=("re-run",)),
        Check("error-leaves-nothing", "a function that raises inside it leaves no hook behind",
              check_error_leaves_nothing),
    ]  # fmt: skip


EXERCISE = Exercise(
    name="03b-checkpoint",
    notebook="03b",
    section="§1 and §2",
    defines="checkpoint(function, *args)",
    grades="what it keeps (nothing the block made), one re-run with grad on, nothing held after "
    "backward, gradients bit for bit (twice, autograd.grad, frozen input, dropout), no hook left on error",
    required=("checkpoint",),
    checks=checks,
    refuses=CHECKPOINTS,
)
