"""Saved-tensor accounting: which tensors autograd keeps for backward while a region runs.

Introduced in notebook 01; the hooks it is built on are the subject of notebook 03.

Every time an op records a tensor for its backward (``mul`` keeps both factors, ``exp`` keeps its
result, ``save_for_backward`` keeps what a custom Function asks for), autograd calls the innermost
``saved_tensors_hooks`` pack hook. ``SavedTensorLog`` is such a hook that writes the tensor down and
returns it unchanged.

Bytes are counted per *storage*: two saved views of one buffer cost its bytes once.
``nn.Parameter`` objects (and views of them, such as the ``weight.t()`` that ``Linear`` saves) are
reported apart from activations: every strategy keeps them anyway.

Blind spots: only the innermost hooks run, so tensors saved while another ``saved_tensors_hooks``
is active inside the region (e.g. by ``ckpt_lab.checkpoint`` or ``torch.utils.checkpoint`` with
``use_reentrant=False``) are not seen here; use ``ckpt_lab.LiveMemory`` for those. Tensors a custom
Function stores on ``ctx`` directly (``ctx.x = x``) bypass the hooks too.
"""

from __future__ import annotations

import re
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from ckpt_lab._aten import storage_key

__all__ = ["SavedEntry", "SavedTensorLog"]


@dataclass(frozen=True)
class SavedEntry:
    """One tensor saved for backward."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    storage_bytes: int
    is_parameter: bool
    first_of_storage: bool  # False if an earlier entry already saved the same storage
    # What made the saved tensor: the op whose output it is ("sin", from its grad_fn SinBackward0),
    # or "parameter", "leaf" (an input that requires grad), "no grad_fn" (a mask, a no_grad result).
    made_by: str = ""
    # Where it was saved: the innermost frame of the caller's code (not torch's, not ckpt_lab's),
    # as "function:line" (a notebook cell's top level is "<module>").
    where: str = ""

    def describe(self) -> str:
        """One line, like JAX's ``print_saved_residuals``: ``f32[64, 256]  65,536 B  output of addmm``."""
        dtype = str(self.dtype).removeprefix("torch.")
        short = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int64": "i64"}
        shape = ", ".join(map(str, self.shape))
        plain = ("parameter", "leaf", "no grad_fn")
        origin = self.made_by if self.made_by in plain else f"output of {self.made_by}"
        size = f"{self.storage_bytes:,} B" if self.first_of_storage else "(same storage)"
        return f"{short.get(dtype, dtype)}[{shape}]".ljust(22) + f"{size:>14}  {origin:<28} {self.where}"


# Frames of these folders are the machinery, not the caller's code.
_INTERNAL = (str(Path(torch.__file__).parent), str(Path(__file__).resolve().parents[1]))


def _where() -> str:
    """``function:line`` of the innermost frame outside torch and ckpt_lab (stable across runs:
    no file names, which in Jupyter are temporary)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back
    return "" if frame is None else f"{frame.f_code.co_name}:{frame.f_lineno}"


def _made_by(tensor: torch.Tensor, is_parameter: bool) -> str:
    if is_parameter:
        return "parameter"
    node = tensor.grad_fn
    if node is None:
        # A leaf that requires grad (the block's input), or a tensor made without autograd history
        # (dropout's mask, anything computed under no_grad).
        return "leaf" if tensor.requires_grad else "no grad_fn"
    # NativeLayerNormBackward0 -> native_layer_norm; a custom Function's node is named after it.
    name = re.sub(r"Backward\d*$", "", node.name())
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _is_parameter(tensor: torch.Tensor) -> bool:
    # Linear saves weight.t(), a view whose _base is the Parameter.
    return isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)


class SavedTensorLog(saved_tensors_hooks):
    """A ``saved_tensors_hooks`` that logs what is saved and changes nothing.

    >>> x = torch.randn(100, requires_grad=True)
    >>> with SavedTensorLog() as log:
    ...     y = x.sin().sin()           # each sin saves its input: x and x.sin()
    >>> log.count, log.activation_bytes
    (2, 800)
    """

    def __init__(self) -> None:
        self.entries: list[SavedEntry] = []
        # Weak references to the storages seen, by ``storage_key``.
        self._storages: dict[int, weakref.ref] = {}
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> SavedTensorLog:
        super().__enter__()
        return self

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage_key(tensor)
        # A key is reused once its storage is gone: the weakref tells an old storage from a new one.
        seen = self._storages.get(key)
        first = seen is None or seen() is not storage
        if first:
            self._storages[key] = weakref.ref(storage)
        is_parameter = _is_parameter(tensor)
        self.entries.append(
            SavedEntry(
                shape=tuple(tensor.shape),
                dtype=tensor.dtype,
                storage_bytes=storage.nbytes(),
                is_parameter=is_parameter,
                first_of_storage=first,
                made_by=_made_by(tensor, is_parameter),
                where=_where(),
            )
        )
        # Returning the tensor itself keeps autograd's behaviour; see notebook 03 for what else a
        # pack hook can return.
        return tensor

    @staticmethod
    def _unpack(tensor: Any) -> torch.Tensor:
        return tensor

    # ---------------------------------------------------------------- summaries
    @property
    def count(self) -> int:
        """Number of saved activations (saves, not storages; parameters excluded)."""
        return sum(not e.is_parameter for e in self.entries)

    @property
    def activation_bytes(self) -> int:
        """Bytes of the distinct storages of saved activations."""
        return sum(e.storage_bytes for e in self.entries if e.first_of_storage and not e.is_parameter)

    @property
    def parameter_count(self) -> int:
        return sum(e.is_parameter for e in self.entries)

    @property
    def parameter_bytes(self) -> int:
        return sum(e.storage_bytes for e in self.entries if e.first_of_storage and e.is_parameter)

    def listing(self, parameters: bool = False) -> str:
        """Every saved tensor, one line each (``SavedEntry.describe``), then the totals: what a region
        keeps for backward, tensor by tensor. Parameters are left out unless ``parameters``."""
        lines = [e.describe() for e in self.entries if parameters or not e.is_parameter]
        return "\n".join([*lines, self.summary()])

    def summary(self) -> str:
        """One line, stable on any machine: counts and bytes."""
        return (
            f"saved activations: {self.count} tensors, {self.activation_bytes} bytes; "
            f"parameters: {self.parameter_count} tensors, {self.parameter_bytes} bytes"
        )
