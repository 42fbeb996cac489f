"""Checkpoint a sequential model segment by segment.

Same segment rule as ``torch.utils.checkpoint.checkpoint_sequential``: split the ``n`` functions into
chunks of ``n // segments``; checkpoint the first ``segments - 1`` chunks and run the rest (the last
chunk, which absorbs the remainder) normally, since its activations are needed right away by the
backward pass anyway. Only the input of each checkpointed chunk stays alive between forward and backward.

Introduced in notebook 02 (with the reentrant checkpoint); the default, non-reentrant variant is
the subject of notebook 03b.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ckpt_lab.nonreentrant import checkpoint as nonreentrant_checkpoint
from ckpt_lab.reentrant import reentrant_checkpoint

__all__ = ["checkpoint_sequential"]


def checkpoint_sequential(
    functions: torch.nn.Sequential | Sequence[Callable[[Any], Any]],
    segments: int,
    input: torch.Tensor,
    use_reentrant: bool = False,
    preserve_rng_state: bool = True,
) -> Any:
    """Run ``functions`` in order on ``input``, checkpointing all segments but the last.

    ``use_reentrant=True`` uses :func:`ckpt_lab.reentrant.reentrant_checkpoint`, ``False`` (the
    default) uses :func:`ckpt_lab.nonreentrant.checkpoint`.
    """
    # Iterating an nn.Sequential yields its modules in order, a module used twice included
    # (torch uses ``.children()``, which lists such a module once).
    if not isinstance(use_reentrant, bool):
        # checkpoint_sequential(model, segments, a, b): the second input lands here, as in torch.
        raise TypeError(
            "checkpoint_sequential: use_reentrant must be True or False, got "
            f"{type(use_reentrant).__name__}. "
            "checkpoint_sequential takes one input, like nn.Sequential: (functions, segments, input, "
            "use_reentrant=False, preserve_rng_state=True). A second positional input lands in "
            "use_reentrant; pass the blocks one input (a tuple, if they take several) instead."
        )
    functions = list(functions)
    if not isinstance(segments, int) or not 1 <= segments <= len(functions):
        raise ValueError(
            f"checkpoint_sequential: segments must be an int with 1 <= segments <= len(functions) "
            f"= {len(functions)}, got {segments!r}"
        )
    checkpoint = reentrant_checkpoint if use_reentrant else nonreentrant_checkpoint

    segment_size = len(functions) // segments
    # Checkpointed chunks: [0, s), [s, 2s), ..., up to (segments - 1) * s.
    end = 0
    for start in range(0, segment_size * (segments - 1), segment_size):
        end = start + segment_size
        input = checkpoint(_run_segment(functions, start, end), input, preserve_rng_state=preserve_rng_state)
    # The last chunk runs normally: its activations would be recomputed right away anyway.
    return _run_segment(functions, end, len(functions))(input)


def _run_segment(functions: Sequence[Callable[[Any], Any]], start: int, end: int) -> Callable[[Any], Any]:
    """A function running ``functions[start:end]`` one after another."""

    def forward(x: Any) -> Any:
        for fn in functions[start:end]:
            x = fn(x)
        return x

    return forward
