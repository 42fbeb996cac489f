"""Exercises: rebuild a stage yourself, and have it graded by the package's own instruments.

Each exercise is a stub the learner fills in and a grader that runs it. The grader says more than
pass or fail: which tensor the learner's checkpoint keeps that it should not (shape, bytes, the op
and the line that made it), how many times the block ran, which gradient differs and where, what
was left behind (a hook on the stack, a dispatch mode, grad mode off).

An exercise is one folder, ``ckpt_lab/exercises/exNN_name/`` (found by looking, never listed by hand):

* ``grader.py``: ``EXERCISE``, its checks in order;
* ``stub.py``: what the learner fills in. ``python -m ckpt_lab.exercises stubs DIR`` writes a set to
  hand out; ``notebooks/exercises/NN_name.py``, where JupyterLab (``make lab``, which serves
  ``notebooks/``) opens it, is a copy that the tests keep identical (after editing a stub, run
  ``python -m ckpt_lab.exercises stubs notebooks/exercises --force``);
* ``solution.py``: the reference solution, written as a learner would (torch only); ``stubs`` never
  writes it (exercise 04's is a module of the package, ``Exercise.reference``: the scope core);
* ``mistakes.py``: the catalogued mistakes, each a one-line change of the solution and the check
  that must catch it (``tests/test_exercises.py`` grades the solution and every mistake).

A learner's file that hands the work to torch's or ckpt_lab's own version of what the exercise asks
for (``Exercise.refuses``; ``_delegation``) fails before any check runs, with the line that does it.

Adding an exercise: docs/maintainers.md ("How to add an exercise").

In a notebook::

    from ckpt_lab.exercises import check
    check("02-checkpoint-function", "exercises/02_checkpoint_function.py")

From a shell: ``python -m ckpt_lab.exercises list | check NAME FILE... | stubs DIR``.
"""

from __future__ import annotations

import importlib
import os
import types
from pathlib import Path

from ckpt_lab.exercises._grading import (
    DEFAULT_TIME_LIMIT,
    Check,
    Exercise,
    Outcome,
    Report,
    grade_file,
    load_any,
)

__all__ = [
    "DEFAULT_TIME_LIMIT",
    "EXERCISES",
    "Check",
    "Exercise",
    "Outcome",
    "Report",
    "check",
    "exercise",
    "grade",
    "load_file",
    "write_stubs",
]


def _exercises() -> dict[str, Exercise]:
    """Every folder ``exNN_name/`` here with a ``grader.py``, in the order of their names (01, 02, 02b...)."""
    found = []
    for folder in sorted(Path(__file__).parent.glob("ex*/grader.py")):
        grader = importlib.import_module(f"{__name__}.{folder.parent.name}.grader")
        # A grader whose checks live in a module this checkout lacks sets EXERCISE to None (exercise 04).
        if grader.EXERCISE is not None:
            found.append(grader.EXERCISE)
    return {e.name: e for e in found}


EXERCISES: dict[str, Exercise] = _exercises()


def exercise(name: str) -> Exercise:
    """The exercise called ``name`` ("02-checkpoint-function"), or by its number alone ("02")."""
    if name in EXERCISES:
        return EXERCISES[name]
    by_number = [e for e in EXERCISES.values() if e.name.split("-")[0] == name]
    if len(by_number) == 1:
        return by_number[0]
    raise KeyError(f"no exercise {name!r}; the exercises are: {', '.join(EXERCISES)}")


def grade(name: str, path: str | os.PathLike, time_limit: float | None = DEFAULT_TIME_LIMIT) -> Report:
    """Grade the file ``path`` for exercise ``name``; ``str(report)`` is the feedback. Each check is
    stopped after ``time_limit`` seconds (None: no limit), and reported as a runaway loop."""
    return grade_file(exercise(name), path, time_limit)


def load_file(path: str | os.PathLike) -> types.ModuleType:
    """Run a learner's file and return it as a module, to try things on it in a notebook::

        ex07 = load_file("exercises/07_memory_target.py")
        model, x, loss_fn = ex07.make_model()

    The file is read again at each call (edit it, load it again)."""
    return load_any(path)


def check(name: str, path: str | os.PathLike, time_limit: float | None = DEFAULT_TIME_LIMIT) -> None:
    """Grade the file and print the report (the "Your turn" cells of the notebooks call this)."""
    print(grade(name, path, time_limit))


def write_stubs(folder: str | os.PathLike, names: list[str] | None = None, force: bool = False) -> list[Path]:
    """Write the stubs (never the solutions) of ``names`` (all by default) into ``folder``; an existing
    file is kept unless ``force``. Returns the files written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for e in [exercise(n) for n in names] if names else EXERCISES.values():
        target = folder / e.file_name
        if target.exists() and not force:
            continue
        target.write_text(e.stub_path.read_text())
        written.append(target)
    return written
