"""Exercise 02: the reentrant ``CheckpointFunction`` (notebook 02 §3 and §8).

The learner's file defines ``CheckpointFunction``, a ``torch.autograd.Function`` with torch's
signature: ``forward(ctx, run_function, preserve_rng_state, *args)``, ``backward(ctx, *grads)``,
called as ``CheckpointFunction.apply(block, True, x)``. The checks run it on a small block
(Linear, GELU, Linear, GELU on 16 x 32 floats) and compare it with the plain block:

* what it keeps from forward to backward (``Tracker``: each storage, who made it, where);
* how many times the block ran, and with grad mode on or off (``CallCounter`` and a pre-hook);
* the gradients of the input and of the four parameters, bit for bit;
* an input that is not a leaf, used again after the checkpoint (a residual): the re-run must start
  from detached inputs, or its nested backward runs on into the graph before the checkpoint;
* dropout: the same masks in the re-run, and the caller's random stream left where it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ckpt_lab.exercises._delegation import CHECKPOINTS
from ckpt_lab.exercises._feedback import (
    Tracker,
    compare_gradients,
    listing,
    logged_rng,
    logged_runs,
    rng_hint,
    size,
)
from ckpt_lab.exercises._grading import Check, Exercise, Submission
from ckpt_lab.instruments import CallCounter

WIDTH, BATCH = 32, 16


def _block(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU()]
    if dropout:
        layers.insert(2, nn.Dropout(dropout))
    return nn.Sequential(*layers)


def _input() -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1)).requires_grad_()


def _apply(sub: Submission, block: Callable[..., Any], *args: Any) -> Any:
    return sub.CheckpointFunction.apply(block, True, *args)


def _grads(block: nn.Module, *tensors: torch.Tensor) -> list[tuple[str, torch.Tensor | None]]:
    """(name, gradient) of ``tensors`` and of the block's parameters; the ``.grad`` reset to None."""
    named = [*tensors, *block.parameters()]
    names = [f"x{'' if i == 0 else i}" for i in range(len(tensors))]
    names += [f"block.{n}" for n, _ in block.named_parameters()]
    out = [(name, None if t.grad is None else t.grad.clone()) for name, t in zip(names, named, strict=True)]
    for t in named:
        t.grad = None
    return out


def _differences(got: list[tuple[str, Any]], expected: list[tuple[str, Any]]) -> list[str]:
    return compare_gradients([(n, g, e) for (n, g), (_, e) in zip(got, expected, strict=True)])


# ---------------------------------------------------------------------------------------------- checks
def check_forward(sub: Submission) -> None:
    block, x = _block(), _input()
    out = _apply(sub, block, x)
    with torch.no_grad():
        expected = block(x)
    assert isinstance(out, torch.Tensor), (
        f"CheckpointFunction.apply(block, True, x) returned {type(out).__name__}; it must return the "
        "block's output, block(x)."
    )
    assert out.shape == expected.shape and torch.equal(out.detach(), expected), (
        f"CheckpointFunction.apply(block, True, x) returned a tensor of shape {list(out.shape)} that is not "
        f"block(x) (shape {list(expected.shape)}): forward must return run_function(*args)."
    )


def check_keeps_only_inputs(sub: Submission) -> None:
    block, x = _block(), _input()
    with Tracker(sub) as tracker:
        tracker.watch(block, "block")
        out = _apply(sub, block, x)
        loss = out.sum()  # sum keeps nothing of its input: only the checkpoint can keep the output now
        del out
        kept = tracker.alive("forward", exclude=[loss])
    assert not kept, (
        f"Your CheckpointFunction keeps {len(kept)} tensor{'s' * (len(kept) != 1)} made by the block "
        f"({size(sum(b.nbytes for b in kept))}) alive from forward to backward. The first:\n"
        f"{listing(kept)}\nA reentrant checkpoint keeps only the block's inputs (save_for_backward(*args)) "
        "and lets every intermediate die in the forward: apply already runs forward with grad mode off, "
        "so the block records no graph (notebook 02 §1; notebook 01 §4)."
    )


def check_reruns_once_with_grad(sub: Submission) -> None:
    block, x = _block(), _input()
    runs = CallCounter(block)
    error = None
    try:
        with logged_runs(block) as modes:
            out = _apply(sub, block, x)
            try:
                out.sum().backward()
            except Exception as raised:  # diagnosed below from what the block saw, if it can be
                error = raised
    finally:
        runs.remove()
    said = []
    if modes and modes[0]:
        said.append(
            "Your forward ran the block with grad mode on (torch.enable_grad()): the block recorded a graph "
            "of its own, which holds the tensors its ops save at least until the block returns: the "
            "forward's peak that a checkpoint is meant to lower, and the time to record it. (Unless your "
            "forward keeps that graph, apply then drops it: your Function's node replaces the output's "
            "history, notebook 01 §4.) apply runs forward with grad off for a reason: leave it off."
        )
    if len(modes) >= 2 and not modes[1]:
        said.append(
            "Your backward re-ran the block with grad mode off. Autograd runs backward with grad mode off, "
            "so the re-run recorded no graph and there is nothing to run a backward through ('element 0 of "
            "tensors does not require grad'). Re-run it under `with torch.enable_grad():` (notebook 02 §3)."
        )
    if runs.count == 1:
        said.append(
            "The block ran once, in the forward; your backward did not run it again. A reentrant checkpoint "
            "keeps only the inputs, so backward must re-run the block to rebuild what its gradients need "
            "(notebook 02 §2)."
        )
    elif runs.count > 2:
        said.append(
            f"The block ran {runs.count} times for one forward and one backward; it should run twice: once "
            "in forward (grad off), once more in backward (grad on)."
        )
    assert not said, "\n".join(said)
    if error is not None:
        raise error


def check_gradients(sub: Submission) -> None:
    block, x = _block(), _input()
    x_plain = x.detach().clone().requires_grad_()
    block(x_plain).square().sum().backward()
    expected = _grads(block, x_plain)
    _apply(sub, block, x).square().sum().backward()
    got = _grads(block, x)
    said = _differences(got, expected)
    if not said:
        return
    hint = []
    if all(g is None for _, g in got[1:]):
        hint.append(
            "None of the block's parameters got a gradient: backward returns gradients for apply's "
            "arguments only, and the parameters are not arguments. Run a nested backward through the "
            "re-run, torch.autograd.backward(outputs, grads), which accumulates into every leaf it "
            "reaches, parameters included (notebook 02 §3, draft 1 -> draft 2)."
        )
    if any("twice" in s for s in said[:1]) and said[0].startswith("x:"):
        hint.append(
            "x's gradient was added twice: the nested backward already accumulated into x.grad (your re-run "
            "started from x itself), then the gradient your backward returned was added again. Re-run on "
            "detached copies, t.detach().requires_grad_(t.requires_grad), and return their .grad "
            "(notebook 02 §3)."
        )
    raise AssertionError(
        "Gradients differ from a plain run's (the block without checkpoint, same input, loss "
        "out.square().sum()):\n"
        + "\n".join(f"- {s}" for s in said[:3])
        + ("\n" + "\n".join(hint) if hint else "")
    )


def check_detached_inputs(sub: Submission) -> None:
    torch.manual_seed(2)
    pre = nn.Linear(WIDTH, WIDTH)
    block, x = _block(), _input()

    def step(run: Callable[[torch.Tensor], torch.Tensor]) -> list[tuple[str, Any]]:
        h = pre(x)  # not a leaf: the checkpoint's input comes from a trained layer
        (run(h) + h).square().sum().backward()  # and is used again after it: a residual
        grads = [("pre.weight", pre.weight.grad), ("pre.bias", pre.bias.grad)]
        pre.zero_grad(set_to_none=True)
        return grads + _grads(block, x)

    expected = step(block)
    try:
        got = step(lambda h: _apply(sub, block, h))
    except RuntimeError as error:
        if "second time" not in str(error):
            raise
        raise AssertionError(
            "With an input that comes from a trained layer and is used again after the checkpoint (a "
            "residual), backward failed: 'Trying to backward through the graph a second time'. Your re-run "
            "started from the saved inputs themselves, so its nested backward ran on through them into the "
            "graph before the checkpoint and freed it. Re-run on detached copies, "
            "t.detach().requires_grad_(t.requires_grad) (notebook 02 §3 and §5)."
        ) from None
    said = _differences(got, expected)
    assert not said, (
        "With an input from a trained layer, used again after the checkpoint (a residual), gradients "
        "differ from a plain run's:\n" + "\n".join(f"- {s}" for s in said[:3])
    )


def _dropout_step(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> tuple[Any, ...]:
    """A seeded step with a draw between forward and backward: (output, the draw between, the draw after)."""
    torch.manual_seed(4)
    out = run(x)
    between = torch.rand(4)
    out.square().sum().backward()
    return out.detach(), between, torch.rand(4)


def check_dropout_masks(sub: Submission) -> None:
    block, x = _block(dropout=0.5), _input()
    x_plain = x.detach().clone().requires_grad_()
    _dropout_step(block, x_plain)
    expected = _grads(block, x_plain)
    with logged_rng(block) as calls:
        _dropout_step(lambda t: _apply(sub, block, t), x)
    said = _differences(_grads(block, x), expected)
    assert not said, (
        "With dropout in the block, gradients differ from a plain run with the same seed:\n"
        + "\n".join(f"- {s}" for s in said[:3])
        + "\n"
        + rng_hint(calls, "notebook 02 §8")
    )


def check_random_stream(sub: Submission) -> None:
    block, x = _block(dropout=0.5), _input()
    _, _, plain_after = _dropout_step(block, x.detach().clone().requires_grad_())
    _, between, after = _dropout_step(lambda t: _apply(sub, block, t), x)
    assert not torch.equal(after, between), (
        "The caller's random stream was rewound: the first draw after backward repeated the draw made "
        "between forward and backward (a training loop would reuse its shuffles). Your backward set the "
        "generator to the forward's state and left it there. Restore it inside a fork, "
        "`with torch.random.fork_rng(devices=[]):`, which puts the caller's state back after the re-run "
        "(notebook 02 §8, draft 3)."
    )
    assert torch.equal(after, plain_after), (
        "The caller's random numbers after backward differ from a plain run's: your backward moved the "
        "global generator on (the re-run drew dropout masks from it). Run the re-run inside "
        "`torch.random.fork_rng(devices=[])`, with the forward's state restored in it (notebook 02 §8)."
    )


def checks() -> list[Check]:
    return [
        Check("forward", "apply(block, True, x) returns block(x)", check_forward, basic=True),
        Check("keeps-only-inputs", "keeps only the block's inputs from forward to backward",
              check_keeps_only_inputs),
        Check("re-run", "backward re-runs the block once, with grad mode on", check_reruns_once_with_grad),
        Check("gradients", "gradients of x and the block's parameters equal a plain run's, bit for bit",
              check_gradients, needs=("re-run",)),
        Check("detached-inputs", "an input from a trained layer, used again after the checkpoint",
              check_detached_inputs, needs=("gradients",)),
        Check("dropout", "dropout: the re-run draws the forward's masks", check_dropout_masks,
              needs=("gradients",)),
        Check("random-stream", "dropout: the caller's random stream continues as without checkpoint",
              check_random_stream, needs=("re-run",)),
    ]  # fmt: skip


EXERCISE = Exercise(
    name="02-checkpoint-function",
    notebook="02",
    section="§3 and §8",
    defines="CheckpointFunction: forward(ctx, run_function, preserve_rng_state, *args), "
    "backward(ctx, *grads)",
    grades="what it keeps (only the inputs), the re-run (once, grad on), gradients bit for bit, "
    "detached inputs, dropout masks and the caller's random stream",
    required=("CheckpointFunction",),
    checks=checks,
    refuses=CHECKPOINTS,
)
