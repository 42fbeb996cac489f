"""Exercise 05's catalogued mistakes: what learners get wrong, each a one-line change (or a few
lines) of the reference solution (``solution.py``) and the check that must catch it, with a phrase of
its message that tells this mistake apart (``tests/test_exercises.py`` grades every one)."""

from ckpt_lab.exercises._grading import Mistake

MISTAKES = [
    Mistake(
        "a greedy knapsack",
        "    best = {0: (0, frozenset())}\n",
        "    chosen, left = set(), capacity\n"
        "    for key, nbytes, cost in sorted(items, key=lambda i: -i[2] / max(i[1], 1e-9)):\n"
        "        if nbytes <= left:\n            chosen.add(key)\n            left -= nbytes\n"
        "    return chosen\n    best = {0: (0, frozenset())}\n",
        "knapsack-optimal",
        "greedy, not exact",
    ),
    Mistake(
        "a strict < in the knapsack",
        "if total <= capacity and",
        "if total < capacity and",
        "knapsack-optimal",
        "`<` for `<=`?",
    ),
    Mistake(
        "the knapsack returns positions",
        "    return set(max(best.values(), key=lambda v: v[0])[1])",
        "    chosen = max(best.values(), key=lambda v: v[0])[1]\n"
        "    return {i for i, item in enumerate(items) if item[0] in chosen}",
        "knapsack-keys",
        "not their positions",
    ),
    Mistake(
        "keeps every matmul",
        '        return (block, f"{name} {seen[name]}") in KEEP',
        '        return name == "addmm"',
        "policy-budget",
        "The first one over the budget",
    ),
    Mistake(
        "a counter shared by every call",
        'def make_policy(block):\n    seen = {"addmm": 0, "gelu": 0}',
        'SEEN = {"addmm": 0, "gelu": 0}\n\n\ndef make_policy(block):\n    seen = SEEN',
        "policy-steady",
        "in the first training step and 0 B in the second",
    ),
    Mistake(
        "keeps only the costliest matmul",
        '        return (block, f"{name} {seen[name]}") in KEEP',
        '        return name == "addmm" and seen[name] == 2',
        "policy-recompute",
        "Backward recomputes 3,194,880 FLOPs",
    ),
]
