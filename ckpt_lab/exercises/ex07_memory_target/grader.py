"""Exercise 07: a model whose memory does not drop: find why with ``explain``, fix it (notebook 07).

The learner's file holds a model of four feed-forward blocks "checkpointed to save memory", whose
memory barely drops, and ``make_model()`` returning ``(model, x, loss_fn)``. The learner names the
causes (``CAUSES``: numbers from notebook 07's table) and edits the model until one training step
keeps at most ``KEPT_TARGET`` bytes after the forward and peaks at most at ``PEAK_TARGET``
(``measure_memory``'s numbers; the targets are what notebook 07's fix reaches on this model), with
the gradients of the model without checkpoint, bit for bit, and the log still working (one number
per GELU per step, its output's mean magnitude). When a target is missed, the feedback quotes
``explain``'s summary of the learner's model: the largest holders and a verdict per checkpoint.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ckpt_lab import explain
from ckpt_lab.exercises._feedback import Tracker, compare_gradients, listing, size
from ckpt_lab.exercises._grading import Check, Exercise, Submission
from ckpt_lab.instruments import measure_memory

WIDTH, BATCH, DEPTH = 64, 32, 4
KEPT_TARGET = 114_688  # bytes alive after the forward: each block but the last checkpointed, numbers logged
PEAK_TARGET = 139_268  # bytes at the peak of forward and backward (parameters' gradients not counted)
RIGHT_CAUSES = {1, 2}  # the whole function checkpointed; the log keeps activations alive


def _plain() -> tuple[nn.Module, torch.Tensor]:
    """The stub's model without checkpoint or hook: the reference gradients and logged numbers."""
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        for _ in range(DEPTH)
    )
    return model, torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))


def _reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    model, x = _plain()
    logged = []
    for block in model.blocks:
        h = block[1](block[0](x))
        logged.append(h.detach().abs().mean().item())
        x = block[2](h)
    F.mse_loss(x, torch.zeros_like(x)).backward()
    return {n: p.grad for n, p in model.named_parameters()}, logged


def _step(sub: Submission) -> tuple[Any, ...]:
    """One training step of the learner's model: (model, kept bytes, peak bytes)."""
    model, x, loss_fn = sub.make_model()
    report = measure_memory(lambda: loss_fn(model(x)))
    return model, report.retained_bytes, report.peak_bytes


def _explained(sub: Submission, verdicts_only: bool = False) -> str:
    """``explain``'s summary of the learner's model (only its verdicts per checkpoint, if asked)."""
    model, x, loss_fn = sub.make_model()
    lines = explain(model, x, loss_fn=loss_fn).summary().splitlines()
    if verdicts_only and "regions:" in lines:
        lines = lines[lines.index("regions:") :]
    # A model without a checkpoint has no verdicts: its whole summary says what is kept.
    what = "verdicts on your model's checkpoints" if verdicts_only and "regions:" in lines else (
        "summary of your model" + ("" if "regions:" in lines else " (it has no checkpoint)")
    )
    return f"explain's {what}:\n" + "\n".join(f"  {line}" for line in lines)


# ---------------------------------------------------------------------------------------------- checks
def check_answered(sub: Submission) -> None:
    causes = sub.CAUSES
    if causes is None:
        raise NotImplementedError("CAUSES is not filled in: run explain on the model first")
    assert isinstance(causes, set | frozenset | list | tuple) and all(
        isinstance(c, int) and 1 <= c <= 8 for c in causes
    ), f"CAUSES must be a set of numbers from 1 to 8 (the rows of notebook 07's table), not {causes!r}."


def check_causes(sub: Submission) -> None:
    causes = set(sub.CAUSES)
    said = []
    if wrong := sorted(causes - RIGHT_CAUSES):
        said.append(f"Not a cause here: {', '.join(map(str, wrong))}.")
    if missing := sorted(RIGHT_CAUSES - causes):
        said.append(
            f"{len(missing)} cause{'s' * (len(missing) != 1)} missing. Run explain on the model as "
            "the stub has it: what does its summary say each checkpoint keeps, and what it does to the "
            "peak? (Two causes: notebook 07 §1 and §2.)"
        )
    assert not said, " ".join(said)


def check_gradients(sub: Submission) -> None:
    expected, _ = _reference()
    model, x, loss_fn = sub.make_model()
    loss_fn(model(x)).backward()
    got = {n: p.grad for n, p in model.named_parameters()}
    assert set(got) == set(expected), (
        "The model's parameters are not the stub's (blocks.0.0.weight ... blocks.3.2.bias): change where "
        "the checkpoints go and what the hook logs, not the model."
    )
    said = compare_gradients([(n, got[n], expected[n]) for n in expected])
    assert not said, "Gradients differ from the model's without checkpoint:\n" + "\n".join(
        f"- {s}" for s in said[:3]
    )


def check_logging(sub: Submission) -> None:
    _, expected = _reference()
    model, x, loss_fn = sub.make_model()
    loss_fn(model(x)).backward()
    logged = list(getattr(model, "logged", []))
    assert len(logged) == DEPTH, (
        f"After one training step, model.logged holds {len(logged)} entries; it should hold {DEPTH}, one per "
        "GELU."
        + (
            " The checkpoints' re-runs in backward call the hook again: log only in the forward "
            "(ckpt_lab.batchnorm.in_backward() tells a re-run; notebook 07 §2)."
            if len(logged) > DEPTH
            else ""
        )
        + (" Keep the log: it feeds a plot." if not logged else "")
    )
    said = []
    for i, (entry, value) in enumerate(zip(logged, expected, strict=True)):
        if isinstance(entry, torch.Tensor) and entry.numel() != 1:
            said.append(f"entry {i} is a whole tensor, {list(entry.shape)}: log its mean magnitude, a number")
        elif not math.isclose(float(entry), value, rel_tol=1e-6):
            said.append(f"entry {i} is {float(entry):.6g}; the GELU output's mean magnitude is {value:.6g}")
    assert not said, "model.logged: " + "; ".join(said) + "."


def check_kept(sub: Submission) -> None:
    _, kept, _ = _step(sub)
    if kept <= KEPT_TARGET:
        return
    model, x, loss_fn = sub.make_model()
    with Tracker(sub) as tracker:
        tracker.watch(model, "model")
        loss = loss_fn(model(x))
        alive = tracker.alive("forward", exclude=[loss])
    raise AssertionError(
        f"After the forward, {size(kept)} stay alive until backward; the target is at most "
        f"{size(KEPT_TARGET)}. The largest alive:\n{listing(sorted(alive, key=lambda b: -b.nbytes))}\n"
        + _explained(sub)
        + (
            "\nThe log's entries are tensors: a tensor in a list stays alive, detached or not."
            if any(isinstance(e, torch.Tensor) for e in getattr(model, "logged", []))
            else ""
        )
    )


def check_peak(sub: Submission) -> None:
    _, _, peak = _step(sub)
    assert peak <= PEAK_TARGET, (
        f"The step peaks at {size(peak)}; the target is at most {size(PEAK_TARGET)} (without checkpoint: "
        f"335,876 B).\n{_explained(sub, verdicts_only=True)}\nWhere do the checkpoints go, and what does "
        "backward re-run while the rest of the forward is still alive (notebook 07 §1)?"
    )


def checks() -> list[Check]:
    return [
        Check("answered", "CAUSES is filled in", check_answered, basic=True),
        Check("causes", "the causes named are the ones explain shows", check_causes),
        Check("gradients", "gradients equal the model's without checkpoint, bit for bit", check_gradients),
        Check("logging", "the log still holds each GELU output's mean magnitude, one per GELU",
              check_logging),
        Check("kept", f"at most {KEPT_TARGET:,} B alive after the forward", check_kept),
        Check("peak", f"a peak of at most {PEAK_TARGET:,} B", check_peak),
    ]  # fmt: skip


EXERCISE = Exercise(
    name="07-memory-target",
    notebook="07",
    section="§1 and §2",
    defines="CAUSES, make_model() -> (model, x, loss_fn): the model fixed",
    grades=f"the causes named (notebook 07's table); the fixed model: at most {KEPT_TARGET:,} B kept and "
    f"{PEAK_TARGET:,} B at the peak (measured), gradients bit for bit, the log kept",
    required=("CAUSES", "make_model"),
    checks=checks,
    # only the reference solution (always refused): placing torch's checkpoints is the exercise
    refuses=(),
)
