"""Exercise 04-scope: write gradient_checkpoint_scope (notebook 04 §3 and §4).

gradient_checkpoint_scope() is a context manager: every tensor created inside the `with` block is
recomputed in backward instead of stored, even when it is used after the block (RETURNN's API):

    with gradient_checkpoint_scope():
        x = a + b
    y = x * c          # x is not stored: backward re-runs a + b

Notebook 04 §3 builds it in four drafts you can type here, cell by cell: (a) a TorchDispatchMode
that records the block's aten ops on a tape; (b) a pack hook that stores a reference instead of a
tensor the scope made; (c) one replay of the tape per backward, each random op from the generator
state it drew from, in a fork; (d) hooks that outlive the `with` block, on a stack every `__exit__`
pops from the top, gone when the last scope tensor dies.

It is graded by the mechanism checks the package's scopes pass (ckpt_lab.scope_checks) that notebook
04 teaches; each failure names the section that teaches the fix. Exercise 04b-scope grades the rest.
Check it from the notebook, or from a shell in the notebooks folder:

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
