"""Exercise 02b: choose the number of segments for a chain under a memory limit (notebook 02b A).

The learner's file defines ``choose_segments(n_layers, activation_bytes, limit_bytes)``: the number
of segments ``s`` (a divisor of ``n_layers``) for ``checkpoint_sequential`` such that the bytes
kept from forward to backward stay within ``limit_bytes``, with the fewest layer runs, or ``None``
if no ``s`` fits. Graded by measurement, never by formula: for each case the grader runs
``ckpt_lab.checkpoint_sequential`` on a chain of ``n_layers`` (Linear + Tanh) layers with every
divisor, reads the kept bytes with ``measure_memory`` and counts layer runs with ``CallCounter``.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from ckpt_lab import checkpoint_sequential
from ckpt_lab.exercises._feedback import size
from ckpt_lab.exercises._grading import Check, Exercise, Submission
from ckpt_lab.instruments import CallCounter, measure_memory

WIDTH, BATCH = 16, 8
A = WIDTH * BATCH * 4  # one layer's activation: 512 bytes
LOSS_BYTES = 4  # the loss, a float32 scalar, is alive after the forward too: not counted as kept

# (n_layers, limit in activations): what the grader asks, in this order.
CASES = [(16, 9), (16, 7), (16, 6), (16, 16), (12, 6), (12, 7)]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@cache
def measure(n_layers: int, segments: int) -> tuple[int, int]:
    """(bytes kept from forward to backward, layer runs over forward and backward), measured."""
    torch.manual_seed(0)
    chain = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n_layers)])
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    counters = [CallCounter(layer) for layer in chain]
    report = measure_memory(lambda: checkpoint_sequential(chain, segments, x, use_reentrant=False).sum())
    for c in counters:
        c.remove()
    return report.retained_bytes - LOSS_BYTES, sum(c.count for c in counters)


def best(n_layers: int, limit: int) -> int | None:
    """The divisor that fits with the fewest layer runs (then the fewest bytes), or None."""
    fits = [s for s in divisors(n_layers) if measure(n_layers, s)[0] <= limit]
    return min(fits, key=lambda s: measure(n_layers, s)[::-1]) if fits else None


def _case(n: int, k: int) -> str:
    return f"n_layers={n}, limit {k} activations ({size(k * A)})"


def _answers(sub: Submission) -> list[tuple[int, int, int | None]]:
    return [(n, k, sub.choose_segments(n, A, k * A)) for n, k in CASES]


# ---------------------------------------------------------------------------------------------- checks
def check_answers(sub: Submission) -> None:
    said = []
    for n, k, s in _answers(sub):
        if s is not None and not (isinstance(s, int) and not isinstance(s, bool) and s >= 1 and n % s == 0):
            said.append(f"{_case(n, k)}: {s!r} is not a divisor of {n} (one of {divisors(n)}) or None")
    assert not said, "choose_segments must return a divisor of n_layers, or None:\n" + "\n".join(said)


def check_fits(sub: Submission) -> None:
    said = []
    for n, k, s in _answers(sub):
        if s is None:
            continue
        kept, _ = measure(n, s)
        if kept > k * A:
            said.append(
                f"{_case(n, k)}: s={s} keeps {size(kept)} = {kept / A:g} activations from forward to "
                f"backward (measured), over the limit"
            )
    assert not said, "\n".join(said) + (
        "\nEach checkpointed segment keeps its input, and the last segment, not checkpointed, keeps all of "
        "its activations: (s - 1) + n/s activations (notebook 02b A)."
    )


def check_none(sub: Submission) -> None:
    said = []
    for n, k, s in _answers(sub):
        right = best(n, k * A)
        if s is None and right is not None:
            kept, _ = measure(n, right)
            said.append(f"{_case(n, k)}: you answered None, but s={right} keeps {kept / A:g} activations")
        if s is not None and right is None:
            fewest = min(measure(n, d)[0] for d in divisors(n))
            said.append(
                f"{_case(n, k)}: you answered s={s}, but no s fits (the fewest any s keeps is "
                f"{fewest / A:g} activations): the answer is None"
            )
    assert not said, "\n".join(said)


def check_fewest_runs(sub: Submission) -> None:
    said = []
    for n, k, s in _answers(sub):
        right = best(n, k * A)
        if s is None or right is None or measure(n, s)[0] > k * A:
            continue
        (kept, runs), (best_kept, best_runs) = measure(n, s), measure(n, right)
        if runs > best_runs:
            fitting = [d for d in divisors(n) if measure(n, d)[0] <= k * A]
            hint = ""
            if s == max(fitting):
                hint = " (the largest s that fits: more segments re-run more layers)"
            elif s == min(divisors(n), key=lambda d: measure(n, d)[0]):
                hint = " (the s that keeps the least: √n minimises memory, not re-runs)"
            said.append(
                f"{_case(n, k)}: s={s} fits ({kept / A:g} activations) but runs the layers {runs} times"
                f"{hint}; s={right} fits too ({best_kept / A:g} activations) with {best_runs} runs"
            )
    assert not said, "\n".join(said) + (
        "\nA step runs n layers in forward, then re-runs every checkpointed segment in backward: "
        "n + (s - 1)·n/s layer runs, more as s grows. Within the limit, choose the fewest segments."
    )


def checks() -> list[Check]:
    return [
        Check("answers", "returns a divisor of n_layers, or None", check_answers, basic=True),
        Check("fits", "the segments chosen keep no more than the limit (measured)", check_fits),
        Check("none", "None exactly when no number of segments fits", check_none),
        Check("fewest-runs", "within the limit, the fewest layer runs (measured)", check_fewest_runs),
    ]


EXERCISE = Exercise(
    name="02b-segments",
    notebook="02b",
    section="A",
    defines="choose_segments(n_layers, activation_bytes, limit_bytes) -> int | None",
    grades="segments for checkpoint_sequential: measured kept bytes within the limit, the fewest layer "
    "runs, None when nothing fits",
    required=("choose_segments",),
    checks=checks,
    # the planners choose what to checkpoint
    refuses=("ckpt_lab.planner", "ckpt_lab.peak_planner"),
)
