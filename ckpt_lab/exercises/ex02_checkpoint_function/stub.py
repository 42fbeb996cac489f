"""Exercise 02: write the reentrant checkpoint, CheckpointFunction (notebook 02 §3 and §8).

CheckpointFunction.apply(run_function, preserve_rng_state, *args) must return run_function(*args),
keeping only the inputs (tensors) for backward; backward re-runs run_function and returns one
gradient per argument of forward (None for run_function and preserve_rng_state).

It is graded on a small block (Linear, GELU, Linear, GELU) against the same block without
checkpoint: what it keeps between forward and backward, how often and in which grad mode the block
runs, the gradients of the input and the parameters (bit for bit), an input that comes from a
trained layer and is used again afterwards, and dropout (the same masks, and the caller's random
stream left alone). Check it from the notebook, or from a shell in the notebooks folder:

    python -m ckpt_lab.exercises check 02-checkpoint-function exercises/02_checkpoint_function.py
"""

import torch


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, preserve_rng_state, *args):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError
