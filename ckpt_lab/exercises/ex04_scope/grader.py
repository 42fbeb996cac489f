"""Exercise 04-scope: the scope notebook 04 builds, ``gradient_checkpoint_scope`` (notebook 04 §3).

The learner's file defines ``gradient_checkpoint_scope``, a context manager: every tensor created
inside the ``with`` block is recomputed in backward instead of stored, even when it is used after
the block. It is graded by the checks of the scope's mechanism test suite (``ckpt_lab.scope_checks``,
which ``tests/test_scope_mechanism.py`` runs on the package's two scopes) that notebook 04 teaches:
each a plain function ``check_xxx(gradient_checkpoint_scope)`` raising ``AssertionError`` with a
message for the learner, and each failure names the section of 04 that teaches the fix. The rest of
the suite is exercise 04b-scope (notebook 04b). The reference solution is notebook 04's four drafts,
assembled (``solution.py``, written by ``tools/notebook_drafts.py``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from ckpt_lab.exercises._delegation import CHECKPOINTS
from ckpt_lab.exercises._grading import Check, Exercise, Submission

# The mechanism checks notebook 04 teaches, and where (a check's name without its check_ prefix).
TEACHES = {
    "api_page_example": "§3.2 (the pack hook returns a reference) and §3.4 (hooks that outlive the block)",
    "recomputes_each_op_once": "§3.3 (one replay per backward: the Replayer)",
    "tensor_used_long_after_the_scope": "§3.4 (the resident entry: hooks that outlive the block)",
    "dropout": "§3.3 (each random op's generator state, an explicit torch.Generator's too, in a fork)",
    "nested_scopes": "§3.4 (a scope opened inside an open one does nothing)",
    "exception_inside": "§3.4 (after an exception, what escaped the block is an ordinary tensor)",
    "second_backward": "§3.3 (a reference served already means a new backward: replay again)",
    "modified_after_saved": "§3.3 (refused when the slot's last write came after the reference)",
    "hooks_released": "§3.4 (restack; the stack put back when the last scope tensor dies)",
    "no_reference_cycles": "§3.2 (Stored detaches: a saved output kept as it is holds its own grad_fn)",
}


def _title(check: Callable[..., Any]) -> str:
    """``check_tensor_used_long_after_the_scope`` -> "tensor used long after the scope"."""
    return check.__name__.removeprefix("check_").replace("_", " ")


def check_enters(sub: Submission) -> None:
    """The smallest use: ``with gradient_checkpoint_scope(): ...``, then a backward. An unfilled stub
    stops here (the mechanism checks run scopes on worker threads too, where its error would be
    reported as a failure, not as "not implemented yet")."""
    x = torch.ones(3, requires_grad=True)
    with sub.gradient_checkpoint_scope():
        y = x.sin()
    (y * 2).sum().backward()
    assert torch.equal(x.grad, 2 * x.detach().cos()), (
        "with the scope, the gradient of (x.sin() * 2).sum() is wrong"
    )


def mechanism_checks(teaches: dict[str, str]) -> list[Check]:
    """The mechanism checks named in ``teaches``, in the suite's order, as this framework's checks."""
    # Imported here: the mechanism checks are their own module, shared with the scope's tests.
    from ckpt_lab import scope_checks

    def runs(check: Callable[[Any], None]) -> Callable[[Submission], None]:
        return lambda sub: check(sub.gradient_checkpoint_scope)

    chosen = [c for c in scope_checks.CHECKS if c.__name__.removeprefix("check_") in teaches]
    assert len(chosen) == len(teaches), f"not in ckpt_lab.scope_checks: {set(teaches)}"
    return [
        Check(c.__name__.removeprefix("check_").replace("_", "-"), _title(c), runs(c),
              teaches=teaches[c.__name__.removeprefix("check_")])
        for c in chosen
    ]  # fmt: skip


def checks() -> list[Check]:
    enters = Check("enters", "a with block around x.sin(), then backward", check_enters, basic=True,
                   teaches="§3 (the four drafts)")  # fmt: skip
    return [enters, *mechanism_checks(TEACHES)]


# Graded by the scope's mechanism checks (ckpt_lab.scope_checks), where they exist.
EXERCISE: Exercise | None = Exercise(
    name="04-scope",
    notebook="04",
    section="§3 and §4",
    defines="gradient_checkpoint_scope: a context manager",
    grades="what notebook 04's drafts build: recompute instead of store, tensors used after the scope, "
    "dropout, nesting, an exception, a second backward, a write after a save, the hooks released",
    required=("gradient_checkpoint_scope",),
    checks=checks,
    refuses=CHECKPOINTS,
)
if importlib.util.find_spec("ckpt_lab.scope_checks") is None:
    EXERCISE = None
