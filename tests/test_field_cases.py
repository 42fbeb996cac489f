"""Notebook 07c's cases (ckpt_lab.cases.field): each record's three runs give what its words say."""

from __future__ import annotations

import pytest

from ckpt_lab.cases import field

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

# The start of each outcome, by case name and how it was run.
EXPECTED = {
    "an MoE router whose top-1 flips on a near-tie, other counts": (
        "CheckpointError", "CheckpointError", "gradients equal the plain run's: True"),
    "an MoE router whose top-1 flips on a near-tie, the same counts": (
        "gradients equal the plain run's: False", "gradients equal the plain run's: False",
        "gradients equal the plain run's: True"),
    "an expert-load counter counted twice": (
        "counted 10 tokens for 5",
        "counted 10 tokens for 5; the guard warned: LoadCountingMoE.tokens_per_expert",
        "counted 5 tokens for 5"),
    "a KV cache appended in forward": (
        "CheckpointError: torch.utils.checkpoint: Recomputed values",
        "CheckpointError: checkpoint: the state of the checkpointed modules changed",
        "gradients equal the plain run's: True; cache holds 1 entry"),
    "a module that caches its last activation": (
        "after the step, model.last holds 640 B and the forward's graph: True",
        "after the step, model.last holds 640 B and the forward's graph: True",
        "after the step, model.last holds 640 B and the forward's graph: False"),
    "a wrapper that checkpoints each child instead of the layer": (
        "keeps 98308 B", "keeps 98308 B", "keeps 4 B"),
    "a SAC policy written as a callable that compares with aten.mm, not aten.mm.default": (
        "the policy saved 0 of the 3 ops it was shown",
        "the policy saved 0 of the 3 ops it was shown; ours warned: selective_checkpoint: the policy",
        "the policy saved 2 of the 3 ops it was shown"),
    "a custom Function that reads ctx.saved_tensors twice": (
        "CheckpointError: torch.utils.checkpoint: Unpack is being triggered",
        "CheckpointError: checkpoint: Unpack is being triggered", "gradient equals the plain run's: True"),
    'determinism_check="none" used to silence the error': (
        "gradient equals the plain run's: False",
        "CheckpointError: checkpoint: the recomputation took another path",
        "gradient equals the plain run's: True"),
}  # fmt: skip


def test_every_case_has_its_expectation() -> None:
    assert [case.name for case in field.CASES] == list(EXPECTED)


@pytest.mark.parametrize("case", field.CASES, ids=lambda c: c.name[:40])
def test_each_case_runs_as_its_record_says(case: field.Case) -> None:
    for how, expected in zip(("torch", "ours", "fix"), EXPECTED[case.name], strict=True):
        assert field.run(case, how).startswith(expected), (case.name, how)
