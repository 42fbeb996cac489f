"""Exercise 02b's catalogued mistakes: what learners get wrong, each a one-line change (or a few
lines) of the reference solution (``solution.py``) and the check that must catch it, with a phrase of
its message that tells this mistake apart (``tests/test_exercises.py`` grades every one)."""

from ckpt_lab.exercises._grading import Mistake

MISTAKES = [
    Mistake(
        "√n whatever the limit",
        "    for s in range(1, n_layers + 1):\n"
        "        if n_layers % s == 0 and (s - 1 + n_layers // s) * activation_bytes <= limit_bytes:\n"
        "            return s\n    return None\n",
        "    return min((s for s in range(1, n_layers + 1) if n_layers % s == 0), "
        "key=lambda s: abs(s * s - n_layers))\n",
        "fewest-runs",
        "√n minimises memory, not re-runs",
    ),
    Mistake(
        "the largest s that fits",
        "    for s in range(1, n_layers + 1):",
        "    for s in range(n_layers, 0, -1):",
        "fewest-runs",
        "the largest s that fits",
    ),
    Mistake(
        "s + n/s: the last segment counted as checkpointed",
        "(s - 1 + n_layers // s)",
        "(s + n_layers // s)",
        "none",
        "you answered None, but s=4 keeps 7 activations",
    ),
    Mistake(
        "forgets s = 1 (no checkpoint)",
        "    for s in range(1, n_layers + 1):",
        "    for s in range(2, n_layers + 1):",
        "fewest-runs",
        "s=1 fits too (16 activations)",
    ),
    Mistake(
        "the limit taken for activations, not bytes",
        "* activation_bytes <= limit_bytes",
        "<= limit_bytes",
        "fits",
        "s=1 keeps 8,192 B = 16 activations",
    ),
]
