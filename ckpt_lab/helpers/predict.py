"""Predict, then run: the learner writes a guess before the notebook computes the answer.

A prompt is three cells. The question (Markdown), a cell where the learner writes a guess, and the
cell that measures the answer and shows it beside the guess::

    # **Predict.** How many tensors does `x.exp().sin()` save for backward?
    guess = None  # write your guess here, then run the next cell
    reveal(guess, log.count, "tensors saved")

The answer is always computed by the notebook, never typed in. With no guess written (``None``), the
output names only the measured answer, so the stored notebook is the same on every run and nbval
can re-check it; a learner's guess changes only their own copy's output.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["reveal"]


def reveal(guess: Any, answer: Any, what: str = "answer", *, rel_tol: float = 0.0) -> None:
    """Print the measured ``answer`` and, if the learner wrote one, their ``guess`` beside it.

    ``what`` names the quantity ("bytes kept", "re-runs"). Numbers are compared exactly unless
    ``rel_tol`` allows a relative difference (for a guess of a ratio); strings without regard to
    case or surrounding spaces; anything else with ``==``.
    """
    shown = f"{answer:,}" if isinstance(answer, int) and not isinstance(answer, bool) else repr(answer)
    if guess is None:
        print(f"measured {what}: {shown}  (write a guess in the cell above before running this one)")
        return
    right = _matches(guess, answer, rel_tol)
    verdict = "right" if right else "not what was measured"
    print(f"measured {what}: {shown}  |  your guess: {guess!r}, {verdict}")


def _matches(guess: Any, answer: Any, rel_tol: float) -> bool:
    if isinstance(answer, bool) or isinstance(guess, bool):
        return guess is answer
    if isinstance(answer, (int, float)) and isinstance(guess, (int, float)):
        return math.isclose(guess, answer, rel_tol=rel_tol, abs_tol=0.0)
    if isinstance(answer, str) and isinstance(guess, str):
        return guess.strip().lower() == answer.strip().lower()
    return guess == answer
