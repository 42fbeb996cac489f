"""Stage 1: the requires_grad rule of custom Functions, modelled in Python and checked against torch."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_lab.grad_rule import (
    InputSpec,
    LinearFunction,
    OutputSpec,
    predict_needs_input_grad,
    predict_requires_grad,
)


def test_linear_function_forward_runs_without_grad_but_output_requires_grad():
    LinearFunction.observations.clear()
    x = torch.rand(2, 128, requires_grad=True)
    weight = torch.rand(256, 128, requires_grad=True)
    bias = torch.rand(256, requires_grad=True)
    out = LinearFunction.apply(x, weight, bias)
    (seen,) = LinearFunction.observations
    assert seen.grad_enabled is False
    assert seen.input_requires_grad and seen.weight_requires_grad
    assert seen.output_requires_grad is False
    assert out.requires_grad is True
    assert type(out.grad_fn).__name__ == "LinearFunctionBackward"


def test_linear_function_gradients_match_torch():
    torch.manual_seed(0)
    x = torch.rand(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.rand(4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.rand(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(LinearFunction.apply, (x, w, b))
    ours = torch.autograd.grad(LinearFunction.apply(x, w, b).sum(), (x, w, b))
    ref = torch.autograd.grad(torch.nn.functional.linear(x, w, b).sum(), (x, w, b))
    for a, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, r)


def _make_function(outputs):
    class Probe(torch.autograd.Function):
        needs_input_grad = None

        @staticmethod
        def forward(ctx, *args):
            Probe.needs_input_grad = ctx.needs_input_grad
            float_inputs = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
            results, non_diff = [], []
            for spec in outputs:
                if spec.returns_input is not None:
                    out = args[spec.returns_input]
                elif spec.floating:
                    out = sum((a * 2 for a in float_inputs), torch.ones(3))
                else:
                    out = torch.arange(3)
                if spec.non_differentiable:
                    non_diff.append(out)
                results.append(out)
            ctx.mark_non_differentiable(*non_diff)
            return tuple(results)

        @staticmethod
        def backward(ctx, *grads):
            return (None,) * len(ctx.needs_input_grad)

    return Probe


def _make_input(spec):
    if not spec.is_tensor:
        return 1.5
    if not spec.floating:
        return torch.arange(3)
    return torch.zeros(3, requires_grad=spec.requires_grad)


input_specs = st.one_of(
    st.just(InputSpec(is_tensor=False, floating=False)),
    st.just(InputSpec(floating=False)),
    st.builds(InputSpec, requires_grad=st.booleans()),
)


@st.composite
def cases(draw):
    inputs = draw(st.lists(input_specs, min_size=1, max_size=4))
    tensor_positions = [i for i, s in enumerate(inputs) if s.is_tensor]
    output = st.builds(
        OutputSpec,
        floating=st.booleans(),
        non_differentiable=st.booleans(),
        returns_input=st.sampled_from([None, *tensor_positions]),
    )
    outputs = draw(st.lists(output, min_size=1, max_size=3))
    return inputs, outputs, draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(cases())
def test_model_of_the_rule_matches_torch(case):
    inputs, outputs, grad_enabled = case
    probe = _make_function(outputs)
    with torch.set_grad_enabled(grad_enabled):
        results = probe.apply(*[_make_input(s) for s in inputs])
    predicted = predict_requires_grad(inputs, outputs, grad_enabled)
    assert [r.requires_grad for r in results] == [v.requires_grad for v in predicted], predicted
    assert tuple(probe.needs_input_grad) == predict_needs_input_grad(inputs, grad_enabled)


def test_an_input_returned_as_is_comes_back_as_a_new_tensor():
    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    x = torch.zeros(3, requires_grad=True)
    y = Identity.apply(x)
    assert y is not x
    assert y.data_ptr() == x.data_ptr()
    assert type(y.grad_fn).__name__ == "IdentityBackward"
