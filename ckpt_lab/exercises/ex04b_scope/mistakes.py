"""Exercise 04b-scope's catalogued mistakes: notebook 04's drafts as they stand (exercise 04-scope's
reference solution, a whole file), each with one of the checks that 04b teaches it to pass and a
phrase of that check's message (``tests/test_exercises.py`` grades every one)."""

from pathlib import Path

from ckpt_lab.exercises._grading import Mistake

_DRAFTS = (Path(__file__).parent.parent / "ex04_scope" / "solution.py").read_text()

MISTAKES = [
    Mistake(
        "records inside a checkpoint (notebook 04's drafts)",
        "",
        _DRAFTS,
        "scope-inside-a-checkpoint",
        "a scope inside torch.utils.checkpoint",
    ),
    Mistake(
        "no release after a backward (notebook 04's drafts)",
        "",
        _DRAFTS,
        "release-after-backward",
        "hook is still on the stack",
    ),
    Mistake(
        "inputs read without their versions (notebook 04's drafts)",
        "",
        _DRAFTS,
        "refused-replays",
        "w, read in the scope, then modified in place before backward",
    ),
]
