"""``CheckpointError``: what every checkpoint and scope here raises when a re-run does not reproduce
the forward (its tensors would give wrong gradients).

A module of its own so that copying one stage (the scope, the non-reentrant checkpoint) takes this
file and not another stage's. It subclasses torch's ``torch.utils.checkpoint.CheckpointError``, so
code written for torch (``except torch.utils.checkpoint.CheckpointError``) still catches ours after
the drop-in swap; both are ``RuntimeError``s.

``missing_error`` is the other error every stage may raise: a feature that needs one of torch's private
names (``ckpt_lab/torch_private.py`` lists each use) on a torch that lacks it. Here too, so that a copied
stage carries it.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint as _torch_checkpoint

__all__ = ["CHECKED_ON", "CheckpointError", "missing_error"]

# The torch releases the package was checked on (ckpt_lab/torch_private.py: NOTE [ Private torch API ]).
CHECKED_ON = ("2.11.0", "2.13.0", "2.14.1")


class CheckpointError(_torch_checkpoint.CheckpointError):
    """The recomputation did not reproduce the forward: its tensors would give wrong gradients."""


def missing_error(path: str, feature: str) -> RuntimeError:
    """The error for a feature that needs torch's private ``path`` on a torch without it: which feature,
    which name, which torch (``raise missing_error("torch._C._AutoDispatchBelowAutograd",
    "gradient_checkpoint_scope")``). Never a silent difference instead."""
    return RuntimeError(
        f"{feature} needs torch's private {path}, which torch {torch.__version__} lacks. ckpt_lab was "
        f"checked on torch {', '.join(CHECKED_ON)}: use one of those, or see NOTE [ Private torch API ] "
        "in ckpt_lab/torch_private.py for what each private name is for."
    )
