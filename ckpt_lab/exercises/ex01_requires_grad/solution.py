"""Exercise 01, reference solution: will the output require grad? (notebook 01 §2, §3, §5).

The four custom Functions below are the ones the grader runs. For each case, write True or False
in PREDICTIONS: will the tensor the case names have requires_grad=True? Then, in WHY, give the
letter of the reason for case "h". Predict first; then check, and run the cases you got wrong.

    a  Double.apply(torch.ones(3, requires_grad=True))
    b  Double.apply(torch.ones(3))
    c  with torch.no_grad(): Double.apply(torch.ones(3, requires_grad=True))
    d  TwoOutputs.apply(torch.ones(3, requires_grad=True))[1]
    e  Count.apply(torch.ones(3, requires_grad=True))
    f  Select.apply(torch.ones(3, requires_grad=True), torch.ones(3))
    g  inside Double.forward, y = x * 2 (x requires grad): y.requires_grad
    h  torch.utils.checkpoint.checkpoint(layer, torch.ones(2, 3), use_reentrant=True)
    i  torch.utils.checkpoint.checkpoint(layer, torch.ones(2, 3), use_reentrant=False)

    (layer = torch.nn.Linear(3, 3): its weight and bias require grad; the data does not.)

The reasons:

    A  grad mode was off when apply was called: no node is recorded
    B  no tensor argument of apply requires grad: the call is not executable, no node is recorded
       (parameters used inside are not arguments)
    C  the output was marked with ctx.mark_non_differentiable
    D  the output has an integer dtype: only floating and complex tensors can require grad
    E  the call is executable: apply gives each differentiable output the Function's node as its
       grad_fn, even an input returned as it is (it comes back as a new view)
    F  forward runs with grad mode off: results inside it record no graph
    G  no custom Function decides here: the block runs with grad mode on and records its graph,
       so the output requires grad because a parameter does

Check it from the notebook, or from a shell in the notebooks folder:

    python -m ckpt_lab.exercises check 01-requires-grad exercises/01_requires_grad.py
"""

import torch


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x * 2  # case g asks about this y
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class TwoOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        a, b = x * 2, x * 3
        ctx.mark_non_differentiable(b)
        return a, b

    @staticmethod
    def backward(ctx, grad_a, grad_b):
        return grad_a * 2


class Count(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.tensor(x.numel())  # an integer tensor

    @staticmethod
    def backward(ctx, grad):
        return None


class Select(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        return y  # the second input, as it is

    @staticmethod
    def backward(ctx, grad):
        return None, grad


PREDICTIONS = {
    "a": True,  # E: executable, a differentiable output
    "b": False,  # B: no argument requires grad
    "c": False,  # A: apply under no_grad
    "d": False,  # C: marked non-differentiable
    "e": False,  # D: an integer tensor
    "f": True,  # E: an input returned as it is comes back as a new view carrying the node
    "g": False,  # F: forward runs with grad off
    "h": False,  # B: the layer's parameters are not arguments of apply
    "i": True,  # G: no Function; the block records its graph, and the weight requires grad
}

WHY = {"h": "B"}
