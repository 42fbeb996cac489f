"""``CheckpointError``: what every checkpoint and scope here raises when a re-run does not reproduce
the forward (its tensors would give wrong gradients).

A module of its own so that copying one stage (the scope, the non-reentrant checkpoint) takes this
file and not another stage's. It subclasses torch's ``torch.utils.checkpoint.CheckpointError``, so
code written for torch (``except torch.utils.checkpoint.CheckpointError``) still catches ours after
the drop-in swap; both are ``RuntimeError``s.

``missing_error`` is the other error every stage may raise: a feature that needs one of torch's private
names (``ckpt_lab/torch_private.py`` lists each use) on a torch that lacks it. Here too, so that a copied
stage carries it, with ``optional``: the one way the package looks a private torch name up.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.utils.checkpoint as _torch_checkpoint

__all__ = ["CHECKED_ON", "CheckpointError", "lookup", "missing_error", "optional"]

# The torch releases the package was checked on (ckpt_lab/torch_private.py: NOTE [ Private torch API ]).
CHECKED_ON = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")


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


def lookup(path: str) -> Any:
    """The object the dotted ``path`` from ``torch`` names on the running torch
    (``"torch._C._current_graph_task_id"``), importing submodules on the way; ImportError or
    AttributeError where this torch lacks it."""
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            # A submodule not imported yet (or, if this fails too, a name this torch lacks).
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def optional(path: str) -> Any:
    """``lookup(path)``, or None where this torch lacks it: how every module of the package looks up a
    private torch name (NOTE [ Private torch API ] in ckpt_lab/torch_private.py). The caller decides
    what None means: its fallback, or ``missing_error`` when the feature is used."""
    try:
        return lookup(path)
    except (ImportError, AttributeError):
        return None
