"""Exercise 01's catalogued mistakes: what learners get wrong, each a one-line change (or a few
lines) of the reference solution (``solution.py``) and the check that must catch it, with a phrase of
its message that tells this mistake apart (``tests/test_exercises.py`` grades every one)."""

from ckpt_lab.exercises._grading import Mistake

MISTAKES = [
    Mistake(
        "apply under no_grad still records",
        '    "c": False,',
        '    "c": True,',
        "predictions",
        "case c: with torch.no_grad()",
    ),
    Mistake(
        "an input returned as it is keeps its flag",
        '    "f": True,',
        '    "f": False,',
        "predictions",
        "case f: Select.apply",
    ),
    Mistake(
        "parameters count as arguments",
        '    "h": False,',
        '    "h": True,',
        "predictions",
        "case h: torch.utils.checkpoint",
    ),
    Mistake("the wrong reason", 'WHY = {"h": "B"}', 'WHY = {"h": "A"}', "explanation", 'WHY["h"] = "A"'),
    Mistake("a string for a bool", '    "a": True,', '    "a": "True",', "answered", "'True' is a str"),
]
