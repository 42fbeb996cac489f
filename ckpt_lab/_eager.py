"""``run_eagerly``: how ckpt_lab's checkpoints step out of a ``torch.compile`` trace.

A module of its own so that the checkpoints (the teaching core) need nothing from ``ckpt_lab.compiled``
(the measurements of notebook 08), where NOTE [ Checkpoints under torch.compile ] says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["run_eagerly"]


@torch.compiler.disable(reason="ckpt_lab's checkpoints run eagerly under torch.compile (ckpt_lab.compiled)")
def run_eagerly(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, never traced by Dynamo: a graph break, then eager execution.

    See NOTE [ Checkpoints under torch.compile ] (``ckpt_lab.compiled``). Inside,
    ``torch.compiler.is_compiling()`` is False, so the entry point that called this runs its eager path.
    """
    return function(*args, **kwargs)
