"""Exercise 05: the knapsack solver, and a selective policy that meets a memory budget (notebook 05).

1. knapsack(items, capacity): items are (key, nbytes, cost) triples; return the set of keys to keep
   so that their nbytes add up to at most capacity and their costs (the recomputation they save)
   to the most possible: the 0/1 knapsack of notebook 05 §4, exactly (not greedily).

2. make_policy(block): a fresh policy for one call of block number `block` (0, 1 or 2) of this stack,
   each block run as ckpt_lab.selective_checkpoint(blocks[i], h, policy=make_policy(i)):

       block = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                             nn.Linear(256, 64))        # three of them; input 32 x 64 floats
       loss = h.sum()                                     # h: the last block's output

   The policy has torch's signature, policy(ctx, op, *args, **kwargs), and answers True (keep op's
   output) or False (recompute it in backward); it is asked about every op of the block's forward,
   in order (op is an aten op such as torch.ops.aten.addmm.default). After the forward at most
   BUDGET bytes may be alive: the block boundaries (blocks 0 and 1's outputs, 2 x 8,192 B), the
   4-byte loss and what your policies keep; and backward may recompute at most TARGET_RECOMPUTE
   FLOPs (ckpt_lab.instruments.op_cost: 2·m·k·n for a matmul, one per output element otherwise).
   ckpt_lab.planner.profile(block, x) lists each op's bytes and cost, if you want to look.

It is graded against brute force (the knapsack) and by measurement over two training steps (the
policy): bytes alive, FLOPs recomputed, both steps alike, gradients bit for bit. Check it from the
notebook, or from a shell in the notebooks folder:

    python -m ckpt_lab.exercises check 05-selective-budget exercises/05_selective_budget.py
"""

import torch

BUDGET = 147_460  # bytes alive after the forward
TARGET_RECOMPUTE = 2_146_304  # FLOPs recomputed in backward


def knapsack(items, capacity):
    raise NotImplementedError


def make_policy(block):
    raise NotImplementedError
