"""Exercise 07, reference solution: the memory did not drop; why, and the fix (notebook 07 §1 and §2).

Model below checkpoints its four blocks to save memory, and a hook logs each GELU's output for a
plot. Yet one training step keeps 155,648 bytes after the forward and peaks at 204,804. See for
yourself, in a notebook cell (from the notebooks folder):

    from ckpt_lab import explain
    from ckpt_lab.exercises import load_file
    model, x, loss_fn = load_file("exercises/07_memory_target.py").make_model()
    print(explain(model, x, loss_fn=loss_fn).summary())

1. Write in CAUSES the numbers of the causes (rows of notebook 07's table, 1 to 8) that explain shows.
2. Fix the model: one training step must keep at most 114,688 bytes after the forward and peak at
   most at 139,268 bytes (measure_memory's numbers), with the gradients of the model without
   checkpoint, bit for bit. Keep the model (its blocks and parameters) and keep the log: after a
   step, model.logged must hold, for each GELU, its output's mean magnitude, output.abs().mean(),
   one per GELU, in order.

Check it from the notebook, or from a shell in the notebooks folder:

    python -m ckpt_lab.exercises check 07-memory-target exercises/07_memory_target.py
"""

import torch
import torch.nn.functional as F
from torch import nn

from ckpt_lab import checkpoint
from ckpt_lab.batchnorm import in_backward

WIDTH, BATCH, DEPTH = 64, 32, 4

CAUSES = {1, 2}  # the whole function checkpointed; the log keeps the GELU outputs alive


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(DEPTH)
        )
        self.logged = []  # for a plot of each GELU's mean magnitude
        for block in self.blocks:
            block[1].register_forward_hook(self.log_activation)

    def log_activation(self, module, args, output):
        if not in_backward():  # a re-run in backward calls the hook again: log the forward only
            self.logged.append(output.detach().abs().mean().item())  # a number keeps no tensor alive

    def run_blocks(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, x):
        # One checkpoint per block, the last plain: backward re-runs one block at a time.
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            x = block(x) if i == last else checkpoint(block, x)
        return x


def make_model():
    """The model, one batch and the loss: what the grader (and explain) runs."""
    model = Model()
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    return model, x, lambda out: F.mse_loss(out, torch.zeros_like(out))
