"""Exercise 04b-scope: the rest of the scope's mechanism, as notebook 04b teaches it.

The second step after exercise 04-scope: the learner's file defines ``gradient_checkpoint_scope``
(start from the 04-scope solution) and is graded by the mechanism checks that 04-scope leaves out
(``ckpt_lab.scope_checks``, the suite the package's two scopes pass): enclosing hooks, several scopes
alive, a chain of scopes, a scope inside a checkpoint and a checkpoint inside one, the release after
backward, refused replays, writes outside the recording, autocast, op chains,
threads. Each failure names the section of 04b that teaches the fix. The reference solution is the
package's scope core, ``ckpt_lab/scope_core.py``, graded as a learner's file.
"""

from __future__ import annotations

import importlib.util

from ckpt_lab.exercises._delegation import CHECKPOINTS
from ckpt_lab.exercises._grading import Check, Exercise

# The mechanism checks 04-scope leaves out, and where notebook 04b teaches each.
TEACHES = {
    "enclosing_hooks": "§11, A.4 (every entry above ours wrapped: the rest goes to the pair below)",
    "several_scopes": "§11, A.2 (several tapes alive: one resident entry until the last one's tensors die)",
    "chain_of_scopes": "§5 (inputs are kept, not recomputed) and §11 (the release after backward)",
    "scope_inside_a_checkpoint": "§2 (a scope inside a checkpoint does nothing)",
    "checkpoint_inside_the_scope": "§2 and §3 (what the tape leaves out: the backward's ops)",
    "release_after_backward": "§11 (a scope tensor dying inside backward: release at the next safe point)",
    "refused_replays": "§9 (what a replay refuses: inputs' versions, each recomputed tensor's metadata)",
    "writes_outside_the_recording": "§6 (tensors written in place; Stored raises autograd's own error)",
    "autocast": "§10 (autocast off in a replay: the recorded ops are cast already)",
    "op_chains": "§4 (what born in the scope means: views, in-place ops)",
    "another_thread": "§1 (per-thread state: the hooks stack is thread-local)",
}


def checks() -> list[Check]:
    from ckpt_lab.exercises.ex04_scope.grader import check_enters, mechanism_checks

    enters = Check("enters", "a with block around x.sin(), then backward", check_enters, basic=True,
                   teaches="§1 (start from your exercise 04-scope solution)")  # fmt: skip
    return [enters, *mechanism_checks(TEACHES)]


EXERCISE: Exercise | None = Exercise(
    name="04b-scope",
    notebook="04b",
    section="§1 to §11",
    defines="gradient_checkpoint_scope: a context manager",
    grades="the rest of the scope's mechanism checks: enclosing hooks, several scopes, checkpoints, "
    "the release after backward, refused replays, writes outside the recording, autocast, threads",
    required=("gradient_checkpoint_scope",),
    checks=checks,
    refuses=CHECKPOINTS,
    reference="ckpt_lab.scope_core",
)
if importlib.util.find_spec("ckpt_lab.scope_checks") is None:
    EXERCISE = None
