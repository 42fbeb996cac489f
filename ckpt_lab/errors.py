"""``CheckpointError``: what every checkpoint and scope here raises when a re-run does not reproduce
the forward (its tensors would give wrong gradients).

A module of its own so that copying one stage (the scope, the non-reentrant checkpoint) takes this
file and not another stage's. It subclasses torch's ``torch.utils.checkpoint.CheckpointError``, so
code written for torch (``except torch.utils.checkpoint.CheckpointError``) still catches ours after
the drop-in swap; both are ``RuntimeError``s.
"""

from __future__ import annotations

import torch.utils.checkpoint as _torch_checkpoint

__all__ = ["CheckpointError"]


class CheckpointError(_torch_checkpoint.CheckpointError):
    """The recomputation did not reproduce the forward: its tensors would give wrong gradients."""
