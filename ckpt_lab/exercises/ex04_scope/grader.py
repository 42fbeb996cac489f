"""Exercise 04: the scope core, ``gradient_checkpoint_scope`` (notebook 04 §3 and §4).

The learner's file defines ``gradient_checkpoint_scope``, a context manager: every tensor created
inside the ``with`` block is recomputed in backward instead of stored, even when it is used after
the block. It is graded by the very checks the package's two scopes pass in the tests
(``ckpt_lab.scope_checks``: ``tests/test_scope_mechanism.py`` runs them on ``ckpt_lab.scope`` and
``ckpt_lab.scope_core``): each a plain function ``check_xxx(gradient_checkpoint_scope)`` that raises
``AssertionError`` with a message for the learner, which is this framework's contract for a check.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from ckpt_lab.exercises._delegation import CHECKPOINTS
from ckpt_lab.exercises._grading import Check, Exercise, Submission


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


def checks() -> list[Check]:
    # Imported here: the mechanism checks are their own module, shared with the scope's tests.
    from ckpt_lab import scope_checks

    def runs(check: Callable[[Any], None]) -> Callable[[Submission], None]:
        return lambda sub: check(sub.gradient_checkpoint_scope)

    mechanism = [
        Check(c.__name__.removeprefix("check_").replace("_", "-"), _title(c), runs(c))
        for c in scope_checks.CHECKS
    ]
    return [
        Check("enters", "a with block around x.sin(), then backward", check_enters, basic=True),
        *mechanism,
    ]


# Graded by the scope's mechanism checks (ckpt_lab.scope_checks), where they exist.
EXERCISE: Exercise | None = Exercise(
    name="04-scope",
    notebook="04",
    section="§3 and §4",
    defines="gradient_checkpoint_scope: a context manager",
    grades="the scope's mechanism checks, the same the package's scopes pass: recompute instead of "
    "store, tensors used after the scope, dropout, enclosing hooks, nesting, exceptions, hooks released",
    required=("gradient_checkpoint_scope",),
    checks=checks,
    refuses=CHECKPOINTS,
    reference="ckpt_lab.scope_core",
)
if importlib.util.find_spec("ckpt_lab.scope_checks") is None:
    EXERCISE = None
