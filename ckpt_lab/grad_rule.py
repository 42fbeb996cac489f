"""Why a custom ``autograd.Function``'s outputs require grad although ``forward`` ran without grad.

Introduced in notebook 01.

``Function.apply`` (C++, ``torch/csrc/autograd/python_function.cpp``) does three things in order:

1. it decides whether the call is *executable* for autograd: grad mode is on and at least one
   tensor input requires grad; it records ``ctx.needs_input_grad`` from the same facts;
2. it runs your ``forward`` with grad mode **off**, so the ops inside build no graph and save
   nothing (you supply ``backward``, so autograd needs no record of how the outputs were made);
3. it wraps the outputs (``_wrap_outputs`` in ``torch/csrc/autograd/custom_function.cpp``): each
   differentiable output gets the Function's backward node as its ``grad_fn``, and so
   ``requires_grad=True``.

This module holds ``LinearFunction``, the custom-Function tutorial's example as the PyTorch forum
thread "Tensor.requires_grad in torch.autograd.Function" quotes it, made to record what it sees
inside ``forward``; and ``predict_requires_grad``, a pure-Python model of rule 3 that the tests
check against torch over random cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ForwardObservation",
    "InputSpec",
    "LinearFunction",
    "OutputSpec",
    "Verdict",
    "predict_needs_input_grad",
    "predict_requires_grad",
]


@dataclass(frozen=True)
class ForwardObservation:
    """What ``LinearFunction.forward`` saw while it ran."""

    grad_enabled: bool
    input_requires_grad: bool
    weight_requires_grad: bool
    output_requires_grad: bool


class LinearFunction(torch.autograd.Function):
    """``y = x @ W.T + b`` with a hand-written backward (from the PyTorch custom-Function tutorial).

    ``forward`` appends a ``ForwardObservation`` to ``LinearFunction.observations`` instead of
    printing, so that a notebook can show and assert what happened inside.
    """

    observations: list[ForwardObservation] = []  # noqa: RUF012 (a deliberate class-level log)

    @staticmethod
    def forward(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # input: (N, in), weight: (out, in), bias: (out,) -> output: (N, out)
        output = input.mm(weight.t())
        if bias is not None:
            output += bias.unsqueeze(0).expand_as(output)
        LinearFunction.observations.append(
            ForwardObservation(
                grad_enabled=torch.is_grad_enabled(),
                input_requires_grad=input.requires_grad,
                weight_requires_grad=weight.requires_grad,
                output_requires_grad=output.requires_grad,
            )
        )
        return output

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        input, weight, bias = inputs
        ctx.save_for_backward(input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        # needs_input_grad skips work for inputs that don't require grad (returning it anyway is fine).
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.mm(weight)
        if ctx.needs_input_grad[1]:
            grad_weight = grad_output.t().mm(input)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum(0)
        return grad_input, grad_weight, grad_bias


# ------------------------------------------------------------------------- the rule, modelled
@dataclass(frozen=True)
class InputSpec:
    """One argument of ``apply``: a tensor (floating or integer) or any other Python object."""

    is_tensor: bool = True
    requires_grad: bool = False
    floating: bool = True


@dataclass(frozen=True)
class OutputSpec:
    """One output of ``forward``: a newly computed tensor, or input ``returns_input`` returned as-is."""

    floating: bool = True
    non_differentiable: bool = False  # passed to ctx.mark_non_differentiable
    returns_input: int | None = None


@dataclass(frozen=True)
class Verdict:
    requires_grad: bool
    reason: str


def _is_executable(inputs: Sequence[InputSpec], grad_enabled: bool) -> bool:
    # python_function.cpp: is_executable = GradMode::is_enabled() && any_variable_requires_grad(inputs)
    return grad_enabled and any(i.is_tensor and i.requires_grad for i in inputs)


def predict_needs_input_grad(inputs: Sequence[InputSpec], grad_enabled: bool = True) -> tuple[bool, ...]:
    """``ctx.needs_input_grad`` as ``apply`` will set it: one bool per argument.

    It mirrors each input's ``requires_grad`` and ignores grad mode: under ``torch.no_grad()`` it
    can say True for a call whose backward will never run (``grad_enabled`` is accepted to say so).
    """
    return tuple(i.is_tensor and i.requires_grad for i in inputs)


def predict_requires_grad(
    inputs: Sequence[InputSpec], outputs: Sequence[OutputSpec], grad_enabled: bool = True
) -> list[Verdict]:
    """Will each output of ``apply`` require grad, and why? (A model of ``_wrap_outputs``.)"""
    executable = _is_executable(inputs, grad_enabled)
    # mark_non_differentiable marks tensor *objects*: one input returned twice is marked for both.
    marked_inputs = {o.returns_input for o in outputs if o.non_differentiable and o.returns_input is not None}
    verdicts = []
    for out in outputs:
        # An input returned as-is has that input's dtype.
        floating = inputs[out.returns_input].floating if out.returns_input is not None else out.floating
        if not grad_enabled:
            verdicts.append(Verdict(False, "grad mode was off when apply was called: no node is recorded"))
        elif not executable:
            verdicts.append(Verdict(False, "no tensor input requires grad: no node is recorded"))
        elif out.non_differentiable or (out.returns_input is not None and out.returns_input in marked_inputs):
            verdicts.append(Verdict(False, "marked non-differentiable with ctx.mark_non_differentiable"))
        elif not floating:
            verdicts.append(Verdict(False, "integer dtype: only floating/complex tensors can require grad"))
        elif out.returns_input is not None:
            verdicts.append(
                Verdict(True, "an input returned as-is comes back as a new view whose grad_fn is this node")
            )
        else:
            verdicts.append(Verdict(True, "a differentiable output of an executable node: grad_fn is this"))
    return verdicts
