"""The grading machinery: load a learner's file, run an exercise's checks on it, say what happened.

A **check** is a function of the loaded file that returns when the file passes it and raises
``AssertionError`` with a message for the learner when it does not (the same contract as a pytest
test, so that a module of mechanism checks, such as the scope's, plugs in as it is). Everything
else a check raises is the learner's code failing: reported as "your code raised ..." with the line
of the learner's file it came from; ``NotImplementedError`` means the stub is not filled in yet.

Around every check the grader reads ``ckpt_lab.instruments.global_state()`` and, if the check left
hooks, dispatch modes or grad mode behind, says so and puts them back: one check's leftovers never
spoil the next one's measurements (or the notebook the grader runs in).

Unattended, over a class's files (NOTE [ A grader a class can trust ]): whatever the learner's code
raises, ``SystemExit`` and ``KeyboardInterrupt`` included, fails that check with a message (a real
Ctrl-C still stops the grader); each check, and the loading of the file, has a time limit, past
which a runaway loop is stopped and reported; what the code prints is captured and capped, and
shown under the check that printed it; a file that does not load is one line.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import io
import itertools
import os
import signal
import sys
import threading
import traceback
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckpt_lab.exercises._delegation import delegations
from ckpt_lab.exercises._feedback import restore_state, state_left_behind
from ckpt_lab.instruments import global_state

__all__ = [
    "DEFAULT_TIME_LIMIT",
    "Check",
    "Exercise",
    "LoadError",
    "Mistake",
    "Outcome",
    "Report",
    "Submission",
    "error_text",
    "grade_file",
    "load",
    "load_any",
]


@dataclass(frozen=True)
class Check:
    """One thing an exercise grades: ``run(submission)`` returns, or raises ``AssertionError(feedback)``."""

    id: str  # short and stable, what tests and teachers refer to: "keeps-only-inputs"
    title: str  # what it checks, in the learner's words
    run: Callable[[Submission], None]
    # A basic check failing makes the rest meaningless (the function does not even return): skip them.
    basic: bool = False
    # Checks that must pass first, else this one is skipped (its failure would repeat theirs).
    needs: tuple[str, ...] = ()
    # Where the exercise's notebook teaches what this check asks for ("§3.3, the replay"): a failure
    # of the check ends with it.
    teaches: str = ""


@dataclass(frozen=True)
class Exercise:
    """An exercise: what the learner's file must define, where it is taught, and its checks."""

    name: str  # "02-checkpoint-function": what `check` and the command line take
    notebook: str  # "02"
    section: str  # "§3 and §8": where the notebook builds what the exercise asks for
    defines: str  # what the file must define, as the list line shows it
    grades: str  # what is graded, one line (the exercises' tables on the site)
    required: tuple[str, ...]  # the names the file must define
    checks: Callable[[], list[Check]]  # built on demand: exercise 04's come from another module
    # What the learner's file must not hand the work to: torch's or ckpt_lab's own version of what the
    # exercise asks for (``_delegation``: the usual sets; the reference solutions are always refused).
    refuses: tuple[str, ...] = ()
    # A module of the package that is the reference solution, graded as a learner's file (exercise 04:
    # the scope core), instead of the folder's solution.py.
    reference: str | None = None

    @property
    def file_name(self) -> str:
        """``02_checkpoint_function.py``: the stub's and the reference solution's file name."""
        number, _, rest = self.name.partition("-")
        return f"{number}_{rest.replace('-', '_')}.py"

    @property
    def where_taught(self) -> str:
        return f"notebook {self.notebook} {self.section}"

    @property
    def folder(self) -> Path:
        """``ckpt_lab/exercises/ex02_checkpoint_function/``: the exercise's one folder, which holds
        ``grader.py`` (this object), ``stub.py``, ``solution.py`` and ``mistakes.py``."""
        return Path(__file__).parent / f"ex{self.file_name.removesuffix('.py')}"

    @property
    def stub_path(self) -> Path:
        return self.folder / "stub.py"

    @property
    def solution_path(self) -> Path:
        if self.reference is not None:
            spec = importlib.util.find_spec(self.reference)
            assert spec is not None and spec.origin is not None, f"no module {self.reference}"
            return Path(spec.origin)
        return self.folder / "solution.py"

    @property
    def mistakes(self) -> list[Mistake]:
        """The catalogued mistakes (``mistakes.py``), each graded in the tests."""
        package = __name__.rpartition(".")[0]
        return importlib.import_module(f"{package}.{self.folder.name}.mistakes").MISTAKES


@dataclass(frozen=True)
class Mistake:
    """A mistake learners make, and the check that must catch it: ``old`` replaced by ``new`` in the
    reference solution (with ``old`` empty, ``new`` is the whole file), graded, must fail ``check``
    with a message that contains ``says`` (a phrase that tells this mistake apart from the others)."""

    label: str
    old: str
    new: str
    check: str
    says: str


@dataclass
class Submission:
    """A learner's file, loaded: its names (``submission.CheckpointFunction``), where it lives, and
    how to name a line of it in feedback (by the path the learner gave, never an absolute one)."""

    module: types.ModuleType
    path: Path  # resolved
    shown: str  # as given: "exercises/02_checkpoint_function.py"
    # Measurements several checks read (two training steps, say), made once per grading.
    cache: dict[str, Any] = field(default_factory=dict)

    def once(self, key: str, compute: Callable[[], Any]) -> Any:
        """``compute()`` the first time, its result after (an exception is not kept: it raises again)."""
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    def line(self, frame: types.FrameType | None = None) -> str | None:
        """``exercises/02_checkpoint_function.py:23 (in CheckpointFunction.forward)`` for the
        innermost frame of this file on the stack above ``frame`` (the caller's by default)."""
        frame = frame or sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename == str(self.path):
                return f"{self.shown}:{frame.f_lineno} (in {frame.f_code.co_qualname})"
            frame = frame.f_back
        return None

    def line_of(self, error: BaseException) -> str | None:
        """The innermost line of this file in ``error``'s traceback."""
        found = None
        for frame, lineno in traceback.walk_tb(error.__traceback__):
            if frame.f_code.co_filename == str(self.path):
                found = f"{self.shown}:{lineno} (in {frame.f_code.co_qualname})"
        return found


class LoadError(Exception):
    """The file does not load: missing, a syntax error, an import that fails, a name it lacks."""


_loaded = itertools.count()


def load_any(path: str | os.PathLike) -> types.ModuleType:
    """Run a file as a fresh module (each call reads it again: the learner edits it and checks again)."""
    return load_submission(path).module


def load(exercise: Exercise, path: str | os.PathLike) -> Submission:
    """Load the learner's file and check that it defines what the exercise asks for."""
    submission = load_submission(path)
    missing = [n for n in exercise.required if not hasattr(submission.module, n)]
    if missing:
        raise LoadError(
            f"{submission.shown} defines no {', '.join(f'`{n}`' for n in missing)}: exercise {exercise.name} "
            f"needs {exercise.defines} (the stub from `python -m ckpt_lab.exercises stubs DIR` has them)."
        )
    return submission


def load_submission(path: str | os.PathLike) -> Submission:
    shown = str(path)
    resolved = Path(path).resolve()
    if resolved.is_dir():
        raise LoadError(f"{shown} is a folder: give the learner's .py file")
    if not resolved.is_file():
        raise LoadError(f"no such file: {shown}")
    if resolved.suffix != ".py":
        raise LoadError(f"{shown} is not a Python file: its name must end in .py")
    name = f"_ckpt_lab_exercise_{next(_loaded)}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # In sys.modules while it runs (dataclasses and typing look their module up), not after.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        raise LoadError(f"SyntaxError at {shown}:{error.lineno}: {error.msg}") from None
    except (TimeLimit, _Interrupted):
        raise
    except BaseException as error:  # anything it runs at import, sys.exit included: never crash the grader
        where = Submission(module, resolved, shown).line_of(error)
        said = f"{type(error).__name__} at {where or shown}: {error_text(error)}"
        if isinstance(error, SystemExit):
            said = f"the file {_exit_call(error)} while it loads, at {where or shown}: remove the call"
        raise LoadError(said) from None
    finally:
        sys.modules.pop(name, None)
    return Submission(module, resolved, shown)


# ------------------------------------------------------------------------------------------ reports
@dataclass(frozen=True)
class Outcome:
    check: Check
    status: str  # "passed", "failed", "todo" (the learner's code raised NotImplementedError), "skipped"
    message: str = ""
    printed: str = ""  # what the learner's code printed during the check, capped


@dataclass
class Report:
    """What grading one file found. ``str(report)`` is what the learner reads."""

    exercise: Exercise
    shown: str
    status: str  # "passed", "failed", "not implemented", "did not load"
    outcomes: list[Outcome] = field(default_factory=list)
    reason: str = ""  # for "not implemented" and "did not load"
    printed: str = ""  # what the file printed while it loaded, capped

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def exit_code(self) -> int:
        """0 passed, 1 not passed (a check failed, or not implemented yet), 2 the file does not load."""
        return {"passed": 0, "did not load": 2}.get(self.status, 1)

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "failed"]

    def message(self, check_id: str) -> str:
        """The feedback of the check ``check_id`` ("" if it passed or did not run)."""
        return next((o.message for o in self.outcomes if o.check.id == check_id), "")

    def __str__(self) -> str:
        lines = [f"{self.exercise.name}: {self.shown}"]
        taught = self.exercise.where_taught
        if self.status == "did not load":
            # One line, whatever the reason said: a class's log reads one file per line.
            return f"{lines[0]}: DID NOT LOAD: {' '.join(self.reason.split())}"
        if self.printed:
            lines += [f"  (printed while loading) {line}" for line in self.printed.splitlines()]
        if self.status == "not implemented":
            return "\n".join(
                [*lines, f"NOT IMPLEMENTED YET: {self.reason}",
                 f"Read {taught}, fill in the file, then check it again."]
            )  # fmt: skip
        for o in self.outcomes:
            mark = {"passed": "ok     ", "failed": "FAILED ", "todo": "TODO   ", "skipped": "skipped"}[
                o.status
            ]
            lines.append(f"  {mark} {o.check.title}")
            if o.message:
                lines += [f"            {line}" if line else "" for line in o.message.splitlines()]
            if o.printed:
                lines += [f"            (printed) {line}" for line in o.printed.splitlines()]
        passed = sum(o.status == "passed" for o in self.outcomes)
        if self.passed:
            lines.append(f"PASSED: all {passed} checks.")
        else:
            lines.append(f"FAILED: {passed} of {len(self.outcomes)} checks passed. See {taught}.")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------ grading
@contextlib.contextmanager
def _grading() -> Iterator[None]:
    """What grading changes in the process, put back afterwards.

    * ``gc.freeze()``: the instruments collect garbage before each reading; with everything that
      existed before grading frozen, that costs microseconds instead of a full collection (a
      notebook kernel holds many objects). Garbage frozen with it is collected after ``unfreeze``;
      what grading measures is made during grading, never frozen;
    * one intra-op thread: the graders' tensors are tiny, and on a busy machine several threads per
      op cost a hundred times more than they save;
    * warnings (torch's reentrant checkpoint warns, for one) are the checks' business, not the page's.
    """
    threads = torch.get_num_threads()
    gc.freeze()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.set_num_threads(threads)
        gc.unfreeze()


def error_text(error: BaseException, limit: int = 400) -> str:
    """The exception's message, cut to ``limit`` characters (a KeyError's message can be a whole tensor)."""
    if isinstance(error, KeyError) and len(error.args) == 1 and isinstance(error.args[0], torch.Tensor):
        # Its message would be the tensor's values: say what it is instead.
        key = error.args[0]
        return f"the key looked up is a tensor, {str(key.dtype).removeprefix('torch.')}{list(key.shape)}"
    said = str(error).strip() or "(no message)"
    return said if len(said) <= limit else said[:limit].rstrip() + " ..."


def _raised(error: BaseException, submission: Submission) -> str:
    where = submission.line_of(error)
    return f"Your code raised {type(error).__name__}{f' at {where}' if where else ''}:\n{error_text(error)}"


def _not_implemented(error: NotImplementedError, submission: Submission) -> str:
    """What is not implemented: the function of the learner's file that raised, or the grader's words."""
    frames = [
        f for f, _ in traceback.walk_tb(error.__traceback__) if f.f_code.co_filename == str(submission.path)
    ]
    if frames:
        return f"{frames[-1].f_code.co_qualname} raises NotImplementedError"
    return str(error).strip() or "the file's functions raise NotImplementedError"


# NOTE [ A grader a class can trust ]
# A script grades a class by exit status, so nothing the learner's code does may turn a failure into
# a pass or stop the grader:
# * ``SystemExit`` (``sys.exit(0)``, ``exit()``), ``KeyboardInterrupt`` raised by the code, any
#   ``BaseException``: caught, and the check fails saying so; ``os._exit`` is replaced while the code
#   runs (it would end the process with the code's status, past every ``except``). A real Ctrl-C
#   arrives as ``_Interrupted`` (our SIGINT handler's) and stops the grading, as it should;
# * a loop that never ends: ``SIGALRM`` raises ``TimeLimit`` in it after the limit, and again every
#   second if the code catches it; it is a ``BaseException``, so ``except Exception`` does not stop
#   it. Signals reach the main thread only: elsewhere (a grader run on a worker thread), and where
#   there is no ``SIGALRM`` (Windows), there is no limit: run ``timeout 120 python -m ...`` there;
# * prints go into a capped buffer and come back under the check that printed them.
DEFAULT_TIME_LIMIT = 60.0  # seconds per check (and for loading the file): the slowest check takes a few
PRINTED_LIMIT = 1_000  # characters of a check's prints kept in the report
PRINTED_LINES = 10


class TimeLimit(BaseException):
    """Raised in the learner's code when it runs past the time limit."""


class _Interrupted(KeyboardInterrupt):
    """A real Ctrl-C (SIGINT) during grading, as opposed to a KeyboardInterrupt the learner's code raised."""


class _Exited(SystemExit):
    """``os._exit(status)`` called by the learner's code (replaced while it runs)."""


def _exit(status: int) -> None:
    raise _Exited(status)


class _Capped(io.TextIOBase):
    """A text stream that keeps the first ``PRINTED_LIMIT`` characters written to it, and counts the rest."""

    def __init__(self) -> None:
        self.kept: list[str] = []
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        room = PRINTED_LIMIT - sum(map(len, self.kept))
        if room > 0:
            self.kept.append(text[:room])
        self.size += len(text)
        return len(text)

    def text(self) -> str:
        lines = [line[:200] + " ..." * (len(line) > 200) for line in "".join(self.kept).splitlines()]
        more = self.size - sum(map(len, self.kept))
        said = lines[:PRINTED_LINES]
        if more > 0 or len(lines) > PRINTED_LINES:
            said.append(f"... ({self.size:,} characters printed in all; the first shown)")
        return "\n".join(said)


@contextlib.contextmanager
def _guarded(seconds: float | None) -> Iterator[_Capped]:
    """Around the learner's code: prints captured, ``os._exit`` replaced, and the time limit armed."""
    printed = _Capped()
    on_main = threading.current_thread() is threading.main_thread()
    alarm = bool(seconds) and hasattr(signal, "setitimer") and on_main
    armed = [False]

    def expired(signum: int, frame: types.FrameType | None) -> None:
        if armed[0]:  # not once the code is done: the grader's own lines after it must run
            raise TimeLimit(seconds)

    def interrupted(signum: int, frame: types.FrameType | None) -> None:
        raise _Interrupted

    exit_before = os._exit
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        if alarm:
            previous = signal.signal(signal.SIGALRM, expired), signal.signal(signal.SIGINT, interrupted)
            armed[0] = True
            signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
        os._exit = _exit
        try:
            yield printed
        finally:
            armed[0] = False
            os._exit = exit_before
            if alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous[0])
                signal.signal(signal.SIGINT, previous[1])


def _ran_too_long(error: TimeLimit, submission: Submission | None, seconds: float | None) -> str:
    where = submission.line_of(error) if submission is not None else None
    return (
        f"Stopped after {seconds:g} s, the time limit{' of a check' if submission else ''}: your code was "
        f"still running{f' at {where}' if where else ''}. An endless loop? (A teacher can raise the limit: "
        "`--time-limit SECONDS`, or `time_limit=`.)"
    )


def _exited(error: BaseException, submission: Submission) -> str:
    """What a SystemExit, a KeyboardInterrupt or another BaseException from the learner's code means."""
    if not isinstance(error, SystemExit):
        return _raised(error, submission)
    where = submission.line_of(error)
    return (
        f"Your code {_exit_call(error)}{f' at {where}' if where else ''}. A check cannot pass when the code "
        "exits the program: remove the call (the grader counts it as a failure)."
    )


def _exit_call(error: SystemExit) -> str:
    if isinstance(error, _Exited):
        return f"called os._exit({error.code!r})"
    return f"exited (SystemExit({error.code!r}))"


def grade_file(
    exercise: Exercise, path: str | os.PathLike, time_limit: float | None = DEFAULT_TIME_LIMIT
) -> Report:
    """Grade one file: every check in order, each one's leftovers cleared before the next. Each check
    (and loading the file) is stopped after ``time_limit`` seconds (None: no limit)."""
    shown = str(path)
    with _grading():
        try:
            with _guarded(time_limit) as loading:
                submission = load(exercise, path)
        except LoadError as error:
            return Report(exercise, shown, "did not load", reason=str(error))
        except TimeLimit as error:
            frames = traceback.extract_tb(error.__traceback__)
            mine = [f"{shown}:{f.lineno}" for f in frames if f.filename == str(Path(path).resolve())]
            at = f" (at {mine[-1]}, while loading)" if mine else " (while loading)"
            return Report(exercise, shown, "did not load", reason=_ran_too_long(error, None, time_limit) + at)
        outcomes: list[Outcome] = []
        stop = None
        checks = exercise.checks()
        said = delegations(submission.path, shown, submission.module, exercise.refuses, exercise.where_taught)
        if said:
            # The checks would grade someone else's code: none runs.
            own = Check("own-work", "your own code, not a ready-made one", lambda sub: None, basic=True)
            outcomes.append(Outcome(own, "failed", "\n".join(said)))
            stop = own.id
        for check in checks:
            if stop is not None:
                outcomes.append(Outcome(check, "skipped", f"not run: `{stop}` failed first"))
                continue
            unmet = [o.check.id for o in outcomes if o.check.id in check.needs and o.status != "passed"]
            if unmet:
                outcomes.append(Outcome(check, "skipped", f"not run until `{unmet[0]}` passes"))
                continue
            before = global_state()
            message = None
            todo = None
            try:
                with _guarded(time_limit) as printed:
                    check.run(submission)
            except NotImplementedError as error:
                todo = _not_implemented(error, submission)
                message = f"not implemented yet: {todo}"
            except AssertionError as error:
                message = str(error) or "failed (no message)"
            except Exception as error:  # the learner's code failed: say where, in their file
                message = _raised(error, submission)
            except TimeLimit as error:
                message = _ran_too_long(error, submission, time_limit)
            except _Interrupted:
                raise
            except BaseException as error:  # SystemExit, KeyboardInterrupt, ...: a failure, never a pass
                message = _exited(error, submission)
            # What makes a basic check stop the rest: its own failure, not leftovers (said, and undone).
            own_failure = message is not None
            if own_failure and todo is None and check.teaches:
                message += f"\nTaught in notebook {exercise.notebook} {check.teaches}."
            left = state_left_behind(before)
            if left:
                # What the grader could not undo (a torch without _pop_mode) is said, not hidden.
                left = " ".join(filter(None, [left, restore_state(before)]))
                # Said once: a check may have said it already (the scope's checks end by asking for it).
                if "left behind" not in (message or "").lower():
                    message = "\n".join(filter(None, [message, left]))
            status = "passed" if message is None else "todo" if todo is not None else "failed"
            outcomes.append(Outcome(check, status, message or "", printed.text()))
            if own_failure and check.basic:
                stop = check.id
        todos = list(
            dict.fromkeys(
                o.message.removeprefix("not implemented yet: ") for o in outcomes if o.status == "todo"
            )
        )
        if todos and all(o.status in ("todo", "skipped") for o in outcomes):
            # Nothing filled in yet: the short report, the same every time for an untouched stub.
            return Report(exercise, shown, "not implemented", outcomes, reason="; ".join(todos) + ".",
                          printed=loading.text())
        status = "passed" if all(o.status == "passed" for o in outcomes) else "failed"
        return Report(exercise, shown, status, outcomes, printed=loading.text())
