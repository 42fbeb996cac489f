"""Exercise 02, reference solution: the reentrant CheckpointFunction (notebook 02 §3 and §8)."""

import torch


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, preserve_rng_state, *args):
        ctx.run_function = run_function
        ctx.preserve_rng_state = preserve_rng_state
        if preserve_rng_state:
            ctx.rng_state = torch.get_rng_state()  # dropout must draw the same masks in the re-run
        ctx.save_for_backward(*args)  # only the inputs; apply runs this with grad off: no graph
        return run_function(*args)

    @staticmethod
    def backward(ctx, *grads):
        # Fresh leaves: the nested backward stops at them and leaves their gradient in .grad.
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.random.fork_rng(devices=[]):  # the caller's random stream is put back afterwards
            if ctx.preserve_rng_state:
                torch.set_rng_state(ctx.rng_state)
            with torch.enable_grad():  # backward runs with grad off; the re-run must record a graph
                outputs = ctx.run_function(*inputs)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        # A backward inside the backward: it reaches the block's parameters too.
        torch.autograd.backward(outputs, grads)
        return (None, None, *(t.grad for t in inputs))
