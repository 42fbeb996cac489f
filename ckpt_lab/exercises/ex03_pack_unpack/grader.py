"""Exercise 03: a pack/unpack pair that compresses or offloads saved tensors (notebook 03 §3).

The learner's file defines ``pack(tensor)`` and ``unpack(packed)``. The grader runs notebook 03's
six-``sin`` chain on 1,000 floats under ``saved_tensors_hooks(pack, unpack)``:

* every unpack must give back a tensor of the shape, dtype and device that was saved;
* what stays alive from forward to backward (``Tracker``: each storage, who made it) must be at
  most ``TARGET_BYTES`` (the chain keeps 20,004 bytes without hooks: five 4,000-byte
  intermediates and the 4-byte loss);
* the input's gradient within ``RTOL`` of the gradient without hooks (relative, in norm).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from ckpt_lab.exercises._feedback import Tracker, gradient_difference, listing, size, tensor_text
from ckpt_lab.exercises._grading import Check, Exercise, Submission

TARGET_BYTES = 12_004  # 60% of the 20,004 bytes the chain keeps without hooks
RTOL = 1e-2


def _sin_chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(6):
        x = x.sin()
    return x


def _input() -> torch.Tensor:
    return torch.randn(1000, generator=torch.Generator().manual_seed(0)).requires_grad_()


def _made_by(tensor: torch.Tensor) -> str:
    if tensor.grad_fn is None:
        return "x, the chain's input" if tensor.requires_grad else "a tensor without history"
    return "the output of " + re.sub(r"Backward\d*$", "", tensor.grad_fn.name()).lower()


def _step(sub: Submission) -> tuple[torch.Tensor, list[str]]:
    """One forward and backward under the learner's hooks: x's gradient, and what each unpack got wrong."""
    x, wrong = _input(), []

    def pack(tensor: torch.Tensor) -> Any:
        return (tensor.shape, tensor.dtype, tensor.device, _made_by(tensor)), sub.pack(tensor)

    def unpack(packed: Any) -> torch.Tensor:
        (shape, dtype, device, made_by), inner = packed
        out = sub.unpack(inner)
        if not isinstance(out, torch.Tensor):
            raise AssertionError(
                f"unpack returned {type(out).__name__} for {made_by}: it must return a tensor."
            )
        if (out.shape, out.dtype, out.device) != (shape, dtype, device):
            wrong.append(
                f"unpack returned {tensor_text(out.shape, out.dtype)} on {out.device} for "
                f"{tensor_text(shape, dtype)} on {device} that was saved ({made_by})"
            )
            out = out.to(dtype=dtype, device=device)  # so that the other checks still learn something
        return out

    with saved_tensors_hooks(pack, unpack):
        loss = _sin_chain(x).sum()
    loss.backward()
    return x.grad, wrong


# ---------------------------------------------------------------------------------------------- checks
def check_runs(sub: Submission) -> None:
    _step(sub)


def check_unpack_returns(sub: Submission) -> None:
    _, wrong = _step(sub)
    assert not wrong, (
        "\n".join(wrong[:3])
        + (f"\n... and {len(wrong) - 3} more" if len(wrong) > 3 else "")
        + "\nunpack must give back what was saved: same shape, dtype and device (cast a compressed copy "
        "back to the dtype you packed it from; notebook 03 §3)."
    )


def check_bytes(sub: Submission) -> None:
    x = _input()
    with Tracker(sub) as tracker:
        with saved_tensors_hooks(sub.pack, sub.unpack):
            loss = _sin_chain(x).sum()
        kept = tracker.alive("forward", exclude=[loss])
        total = sum(b.nbytes for b in kept) + loss.nbytes
    assert total <= TARGET_BYTES, (
        f"After the forward, {size(total)} stay alive until backward (the chain without hooks: 20,004 B); "
        f"the target is at most {size(TARGET_BYTES)}. Alive, in the order they were made:\n{listing(kept)}\n"
        "A tensor stays alive while anything refers to it: what pack returns, and anything else your code "
        "keeps (a list, a global). Compress to a smaller dtype, or move it out of memory (on a CPU, "
        "tensor.to('cpu') is the tensor itself: nothing moves); notebook 03 §3."
    )


def check_gradient(sub: Submission) -> None:
    x = _input()
    _sin_chain(x).sum().backward()
    got, _ = _step(sub)
    said = gradient_difference("x", got, x.grad, rtol=RTOL)
    assert said is None, (
        f"The input's gradient is too far from the one computed without hooks:\n{said}\n"
        "bfloat16 keeps 8 significant bits and gets within 1% here; float16 keeps 11 (notebook 03 §3)."
    )


def checks() -> list[Check]:
    return [
        Check("runs", "forward and backward run under your hooks", check_runs, basic=True),
        Check("unpack-returns", "unpack gives back the shape, dtype and device that were saved",
              check_unpack_returns),
        Check("bytes", f"at most {TARGET_BYTES:,} B stay alive from forward to backward", check_bytes),
        Check("gradient", f"the gradient within {RTOL:g} (relative) of the one without hooks",
              check_gradient),
    ]  # fmt: skip


EXERCISE = Exercise(
    name="03-pack-unpack",
    notebook="03",
    section="§3",
    defines="pack(tensor), unpack(packed)",
    grades=f"saved tensors compressed or offloaded: at most {TARGET_BYTES:,} B kept on the six-sin chain "
    f"(20,004 without), the gradient within {RTOL:g}, unpack's shape, dtype and device",
    required=("pack", "unpack"),
    checks=checks,
    # ready-made offloading pairs
    refuses=("torch.autograd.graph.save_on_cpu", "ckpt_lab.offload"),
)
