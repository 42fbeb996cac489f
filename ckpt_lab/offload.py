"""CPU offload: keep the saved activations in host memory instead of recomputing them.

Introduced in notebook 05. Checkpointing trades accelerator memory for compute (the block runs
twice); offloading trades it for transfers: every tensor autograd saves is copied to the CPU in the
forward and copied back in backward. Same idea as ``torch.autograd.graph.save_on_cpu``, written out
on ``saved_tensors_hooks`` with byte counters, so that it can be measured as one more point on the
memory/compute frontier:

    with offload_to_cpu() as offload:
        loss = model(x).sum()
    loss.backward()
    offload.bytes_moved, offload.bytes_returned

Differences from ``save_on_cpu``: tensors below ``min_bytes`` stay where they are (a transfer has a
fixed cost), leaves that require grad stay where they are (see ``_keeps_its_own_storage``), and
``include_cpu_tensors=True`` pushes CPU tensors through the same copies, a dry run that shows the
mechanism, its byte counts and its gradients on a machine without an accelerator.

Blind spots: only the innermost ``saved_tensors_hooks`` run, so what a checkpoint inside the region
saves under its own hooks is not offloaded (its inputs, saved before its hooks go on, are). With
``pin_memory`` the copy to the host is asynchronous: a CPU copy read directly (not through backward)
may not have arrived yet.
"""

from __future__ import annotations

import numbers

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["offload_to_cpu"]

# What the pack hook hands autograd: (where the tensor lived, its CPU copy) or the tensor itself.
_Packed = tuple[torch.device, torch.Tensor] | torch.Tensor


# Lower case: a context manager, named like torch's ``save_on_cpu``.
class offload_to_cpu(saved_tensors_hooks):
    """Save the tensors autograd keeps for backward on the CPU; bring them back when backward needs them.

    * ``pin_memory`` (default: whether CUDA is available): copy into page-locked host memory, so that
      both copies can run asynchronously;
    * ``min_bytes``: tensors smaller than this stay on their device;
    * ``include_cpu_tensors``: also copy tensors already on the CPU (to a separate CPU buffer and
      back), a dry run for machines without an accelerator. Otherwise CPU tensors are kept as they are.

    Statistics, accumulated over the instance's life: ``tensors_moved`` and ``bytes_moved`` (copied
    out in forward), ``bytes_returned`` (copied back in backward, once per unpack: a second backward
    with ``retain_graph=True`` counts again), ``tensors_kept`` and ``bytes_kept`` (left where they were).
    Bytes are ``tensor.nbytes`` of what is copied: two saved views of one buffer are copied twice.
    """

    def __init__(
        self, pin_memory: bool | None = None, min_bytes: int = 0, include_cpu_tensors: bool = False
    ) -> None:
        # Checked here: a wrong type would otherwise surface in the first pack hook, mid-forward,
        # as a comparison or truth-value error that names neither the argument nor this class.
        _check_flag("pin_memory", pin_memory, none_ok=True)
        _check_flag("include_cpu_tensors", include_cpu_tensors)
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, numbers.Integral):
            raise TypeError(
                f"offload_to_cpu: min_bytes must be an int, a number of bytes (tensors smaller than it stay "
                f"on their device; 0 moves every tensor), not {min_bytes!r} ({type(min_bytes).__name__})."
            )
        if min_bytes < 0:
            raise ValueError(
                f"offload_to_cpu: min_bytes must be 0 or more (a number of bytes), not {min_bytes}."
            )
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.min_bytes = int(min_bytes)
        self.include_cpu_tensors = include_cpu_tensors
        self.tensors_moved = 0
        self.bytes_moved = 0
        self.bytes_returned = 0
        self.tensors_kept = 0
        self.bytes_kept = 0
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> offload_to_cpu:
        super().__enter__()
        return self

    def _should_move(self, tensor: torch.Tensor) -> bool:
        on_cpu = tensor.device.type == "cpu"
        return (
            (self.include_cpu_tensors or not on_cpu)
            # Sparse and other layouts can't be pinned or copied into a plain buffer: keep them.
            and tensor.layout == torch.strided
            and tensor.nbytes >= self.min_bytes
            and not _keeps_its_own_storage(tensor)
        )

    # Eager even under torch.compile: NOTE [ Checkpoints under torch.compile ] (ckpt_lab.compiled).
    @torch.compiler.disable
    def _pack(self, tensor: torch.Tensor) -> _Packed:
        if not self._should_move(tensor):
            self.tensors_kept += 1
            self.bytes_kept += tensor.nbytes
            return tensor
        # Pinning only speeds up copies from an accelerator (and needs one to be present).
        pin = self.pin_memory and tensor.device.type != "cpu"
        # empty_like keeps the strides of a dense tensor (channels_last stays channels_last), so
        # backward gets back the layout it saw in the forward.
        cpu = torch.empty_like(tensor, device="cpu", pin_memory=pin)
        # Asynchronous from pinned memory; later kernels on the stream are ordered after the copy, so
        # the caching allocator may hand out the device memory as soon as autograd drops the tensor.
        cpu.copy_(tensor, non_blocking=pin)
        self.tensors_moved += 1
        self.bytes_moved += tensor.nbytes
        return (tensor.device, cpu)

    @torch.compiler.disable
    def _unpack(self, packed: _Packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, cpu = packed
        self.bytes_returned += cpu.nbytes
        # copy=True: the CPU dry run copies too, so that it takes the same path as an accelerator.
        return cpu.to(device, non_blocking=self.pin_memory, copy=True)


def _check_flag(name: str, value: object, none_ok: bool = False) -> None:
    if isinstance(value, bool) or (none_ok and value is None):
        return
    expected = "True, False or None (None: whether CUDA is available)" if none_ok else "True or False"
    raise TypeError(f"offload_to_cpu: {name} must be {expected}, not {value!r} ({type(value).__name__}).")


def _keeps_its_own_storage(tensor: torch.Tensor) -> bool:
    """Whether offloading ``tensor`` could free nothing: it is (a view of) a leaf that requires grad.

    Such a leaf -- a parameter, or an input created with ``requires_grad=True`` -- is held by its
    ``AccumulateGrad`` node for as long as the graph lives, whether or not it is also saved. A CPU
    copy would add two transfers and, in backward, a second accelerator copy beside the one still
    alive. Views count too: ``Linear`` saves ``weight.t()``, which shares the parameter's storage.
    (``save_on_cpu`` moves them anyway.)
    """
    base = tensor._base if tensor._base is not None else tensor
    return base.is_leaf and base.requires_grad


