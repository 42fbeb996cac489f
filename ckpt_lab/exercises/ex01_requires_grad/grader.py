"""Exercise 01: predict ``requires_grad`` of a custom Function's outputs, then explain one (notebook 01).

The learner's file holds ``PREDICTIONS`` (case -> True or False) for nine cases, and ``WHY``
(case -> the letter of a reason) for case "h" at least. The grader runs every case with torch and
compares; the right reason comes from ``ckpt_lab.grad_rule.predict_requires_grad``, the package's
model of ``_wrap_outputs`` (checked against torch in its own tests), for the cases it models.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ckpt_lab.exercises._grading import Check, Exercise, Submission
from ckpt_lab.grad_rule import InputSpec, OutputSpec, predict_requires_grad


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        y = x * 2
        Double.inside = y.requires_grad
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad * 2


class TwoOutputs(torch.autograd.Function):  # the second output is marked non-differentiable
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        a, b = x * 2, x * 3
        ctx.mark_non_differentiable(b)
        return a, b

    @staticmethod
    def backward(ctx, grad_a, grad_b):  # type: ignore[override]
        return grad_a * 2


class Count(torch.autograd.Function):  # returns an integer tensor
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return torch.tensor(x.numel())

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return None


class Select(torch.autograd.Function):  # returns its second input as it is
    @staticmethod
    def forward(ctx, x, y):  # type: ignore[override]
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return None, grad


def _wants() -> torch.Tensor:
    return torch.ones(3, requires_grad=True)


def _layer() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 3)  # its weight and bias require grad


def _case_c() -> torch.Tensor:
    with torch.no_grad():
        return Double.apply(_wants())


def _case_g() -> bool:
    Double.apply(_wants())
    return Double.inside


_REENTRANT = lambda: torch_checkpoint(_layer(), torch.ones(2, 3), use_reentrant=True)
_NON_REENTRANT = lambda: torch_checkpoint(_layer(), torch.ones(2, 3), use_reentrant=False)

# case -> (the code, as the stub shows it; what torch answers; the rule's (inputs, outputs, grad mode),
# or the reason's letter where the rule does not model the case)
_T, _P, _N = InputSpec(requires_grad=True), InputSpec(), InputSpec(is_tensor=False)
CASES: dict[str, tuple[str, Callable[[], bool], tuple | str]] = {
    "a": ("Double.apply(torch.ones(3, requires_grad=True))",
          lambda: Double.apply(_wants()).requires_grad, ([_T], [OutputSpec()], True)),
    "b": ("Double.apply(torch.ones(3))", lambda: Double.apply(torch.ones(3)).requires_grad,
          ([_P], [OutputSpec()], True)),
    "c": ("with torch.no_grad(): Double.apply(torch.ones(3, requires_grad=True))",
          lambda: _case_c().requires_grad, ([_T], [OutputSpec()], False)),
    "d": ("TwoOutputs.apply(torch.ones(3, requires_grad=True))[1]  (marked non-differentiable)",
          lambda: TwoOutputs.apply(_wants())[1].requires_grad,
          ([_T], [OutputSpec(), OutputSpec(non_differentiable=True)], True)),
    "e": ("Count.apply(torch.ones(3, requires_grad=True))  (returns torch.tensor(x.numel()))",
          lambda: Count.apply(_wants()).requires_grad, ([_T], [OutputSpec(floating=False)], True)),
    "f": ("Select.apply(torch.ones(3, requires_grad=True), torch.ones(3))  (returns its 2nd input as it is)",
          lambda: Select.apply(_wants(), torch.ones(3)).requires_grad,
          ([_T, _P], [OutputSpec(returns_input=1)], True)),
    "g": ("inside Double.forward, y = x * 2 with x = torch.ones(3, requires_grad=True): y.requires_grad",
          _case_g, "F"),
    "h": ("torch.utils.checkpoint.checkpoint(layer, torch.ones(2, 3), use_reentrant=True)  (nn.Linear)",
          lambda: _REENTRANT().requires_grad, ([_N, _N, _P], [OutputSpec()], True)),
    "i": ("torch.utils.checkpoint.checkpoint(layer, torch.ones(2, 3), use_reentrant=False)",
          lambda: _NON_REENTRANT().requires_grad, "G"),
}  # fmt: skip

REASONS = {
    "A": "grad mode was off when apply was called: no node is recorded",
    "B": "no tensor argument of apply requires grad: the call is not executable, no node is recorded "
    "(parameters used inside are not arguments)",
    "C": "the output was marked with ctx.mark_non_differentiable",
    "D": "the output has an integer dtype: only floating and complex tensors can require grad",
    "E": "the call is executable: apply gives each differentiable output the Function's node as its "
    "grad_fn, even an input returned as it is (it comes back as a new view)",
    "F": "forward runs with grad mode off: results inside it record no graph",
    "G": "no custom Function decides here: the block runs with grad mode on and records its graph, "
    "so the output requires grad because a parameter does",
}
# The rule's reasons (ckpt_lab.grad_rule), by the words that tell them apart.
_RULE = {"grad mode was off": "A", "no tensor input requires grad": "B", "non-differentiable": "C",
         "integer dtype": "D", "returned as-is": "E", "executable node": "E"}  # fmt: skip


def right_reason(case: str) -> str:
    """The letter of the reason for ``case``'s answer: from the package's rule where it models the case."""
    spec = CASES[case][2]
    if isinstance(spec, str):
        return spec
    inputs, outputs, grad_enabled = spec
    # The case reads the last output (TwoOutputs' second).
    verdict = predict_requires_grad(inputs, outputs, grad_enabled)[-1]
    (letter,) = {v for k, v in _RULE.items() if k in verdict.reason}
    return letter


def torch_says(case: str) -> bool:
    return bool(CASES[case][1]())


# ---------------------------------------------------------------------------------------------- checks
def check_answered(sub: Submission) -> None:
    predictions, why = getattr(sub, "PREDICTIONS", None), getattr(sub, "WHY", None)
    assert isinstance(predictions, dict) and isinstance(why, dict), (
        "PREDICTIONS and WHY must be dicts (case -> True/False, case -> letter), as in the stub."
    )
    if all(predictions.get(c) is None for c in CASES) and all(v is None for v in why.values()):
        raise NotImplementedError("PREDICTIONS and WHY are not filled in")
    said = [f"case {c}: not answered yet (None)" for c in CASES if predictions.get(c) is None]
    said += [
        f"case {c}: {predictions[c]!r} is a {type(predictions[c]).__name__}; write True or False"
        for c in CASES
        if predictions.get(c) is not None and not isinstance(predictions[c], bool)
    ]
    unknown = sorted(set(predictions) - set(CASES))
    said += [f"there is no case {', '.join(unknown)}; the cases are {', '.join(CASES)}"] if unknown else []
    if why.get("h") is None:
        said.append('WHY["h"]: not answered yet (None); write the letter of a reason, "A" to "G"')
    said += [
        f'WHY["{c}"]: {v!r} is not one of the letters {", ".join(REASONS)}'
        for c, v in why.items()
        if v is not None and v not in REASONS
    ]
    assert not said, "\n".join(said)


def check_predictions(sub: Submission) -> None:
    wrong = []
    for case, (code, _, _) in CASES.items():
        actual = torch_says(case)
        if sub.PREDICTIONS[case] != actual:
            wrong.append(f"case {case}: {code}\n  you predicted {sub.PREDICTIONS[case]}; torch says {actual}")
    assert not wrong, (
        f"{len(wrong)} of {len(CASES)} predictions differ from what torch does:\n"
        + "\n".join(wrong)
        + "\nRun the case yourself, then find the step of Function.apply that decides it (notebook 01 §2 "
        "and §3; cases h and i: §5)."
    )


def check_explanation(sub: Submission) -> None:
    wrong = []
    for case, letter in sub.WHY.items():
        if letter is None or case not in CASES:
            continue
        right = right_reason(case)
        if letter != right:
            wrong.append(
                f'WHY["{case}"] = "{letter}": {REASONS[letter]}.\n  That is not why torch answers '
                f"{torch_says(case)} for case {case} ({CASES[case][0]})."
            )
    assert not wrong, (
        "\n".join(wrong) + "\nWhich arguments does apply see, and in which grad mode (notebook 01 §2, §5)?"
    )


def checks() -> list[Check]:
    return [
        Check("answered", "every case has a prediction, case h a reason", check_answered, basic=True),
        Check("predictions", "the predictions agree with torch", check_predictions),
        Check("explanation", "the reason given is the rule's", check_explanation),
    ]


EXERCISE = Exercise(
    name="01-requires-grad",
    notebook="01",
    section="§2, §3 and §5",
    defines="PREDICTIONS (nine cases: True or False), WHY (case h: a letter)",
    grades="nine predictions of requires_grad against torch, and the reason for one against the "
    "package's model of the rule",
    required=("PREDICTIONS", "WHY"),
    checks=checks,
    # the package's model of the rule answers the predictions
    refuses=("ckpt_lab.grad_rule",),
)
