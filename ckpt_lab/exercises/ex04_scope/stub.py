"""Exercise 04: write the scope core, gradient_checkpoint_scope (notebook 04 §3 and §4).

gradient_checkpoint_scope() is a context manager: every tensor created inside the `with` block is
recomputed in backward instead of stored, even when it is used after the block (RETURNN's API):

    with gradient_checkpoint_scope():
        x = a + b
    y = x * c          # x is not stored: backward re-runs a + b

Record the block's aten ops with a TorchDispatchMode, store a small reference instead of each
tensor the scope made (a pack hook that outlives the block), replay the recording once per
backward at the first unpack (in an RNG fork, with the forward's random state), and leave the
saved-tensors-hooks stack as you found it once the scope's tensors are gone.

It is graded by the same mechanism checks the package's scopes pass (ckpt_lab.scope_checks):
recompute instead of store, tensors used after the scope, dropout, enclosing hooks, nested and
several scopes, exceptions, a second backward, checkpoints, the hooks released, threads. Check it
from the notebook, or from a shell in the notebooks folder:

    python -m ckpt_lab.exercises check 04-scope exercises/04_scope.py
"""

import contextlib

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode


@contextlib.contextmanager
def gradient_checkpoint_scope():
    raise NotImplementedError
    yield
