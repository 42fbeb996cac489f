"""Exercise 03b: write a non-reentrant checkpoint on saved-tensor hooks (notebook 03b §1 and §2).

checkpoint(function, *args) returns function(*args), run with grad on as usual, but under a pack
hook that stores a ticket instead of each tensor autograd saves; backward's first unpack re-runs
function once (grad on, the forward's random state) and hands each recomputed tensor out once.

It is graded on a small block (Linear, GELU, Linear, GELU) and notebook 03's six-sin chain: what it
keeps after forward and after backward, how often the block runs and in which grad mode, gradients
bit for bit (.backward(), a second backward with retain_graph=True, torch.autograd.grad, an input
that needs no gradient, dropout), and what it leaves behind when the function raises. Check it
from the notebook, or from a shell in the notebooks folder:

    python -m ckpt_lab.exercises check 03b-checkpoint exercises/03b_checkpoint.py
"""

import torch
from torch.autograd.graph import saved_tensors_hooks


def checkpoint(function, *args):
    raise NotImplementedError
