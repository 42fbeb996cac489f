"""Exercise 07: the memory did not drop. Find why with explain, then fix it (notebook 07 §1 and §2).

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

WIDTH, BATCH, DEPTH = 64, 32, 4

CAUSES = None  # a set of numbers from notebook 07's table, e.g. {3, 5}


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
        self.logged.append(output)

    def run_blocks(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, x):
        return checkpoint(self.run_blocks, x)  # checkpointed, to save memory


def make_model():
    """The model, one batch and the loss: what the grader (and explain) runs."""
    model = Model()
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    return model, x, lambda out: F.mse_loss(out, torch.zeros_like(out))
