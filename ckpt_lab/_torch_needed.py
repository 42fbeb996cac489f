"""The private torch names ckpt_lab can't be imported without, checked first when it is imported.

ckpt_lab/torch_private.py lists every private name the package uses; those whose entry says
"ckpt_lab cannot be imported" are these (tests/test_torch_private.py keeps the two in step). On a torch
without one of them, ``import ckpt_lab`` raises ``missing_error`` naming it and torch's version, before
an ImportError from somewhere inside could. (A module of its own, not torch_private: the package must
not import that one, which ``python -m ckpt_lab.torch_private`` runs as a script.)
"""

from __future__ import annotations

import torch

from ckpt_lab.errors import missing_error, optional

NEEDED_AT_IMPORT = (
    "torch.utils._python_dispatch.TorchDispatchMode",
    "torch._C._current_graph_task_id",
    "torch._C._autograd._top_saved_tensors_default_hooks",
    "torch.utils._pytree.tree_flatten",
    "torch.utils._pytree.tree_unflatten",
    "torch.utils._pytree.tree_leaves",
    "torch.utils._pytree.tree_map_only",
    "torch._ops.OpOverload",
    "torch.ops.aten._to_copy.default",
    "torch.Tensor()._base",
    "torch.Tensor()._version",
    "torch._ops.OpOverload()._schema",
)


def _present(path: str) -> bool:
    if "()." in path:  # an attribute of an instance: a tensor's, an aten op overload's
        owner, attr = path.split("().")
        sample = torch.zeros(1) if owner == "torch.Tensor" else torch.ops.aten.add.Tensor
        return hasattr(sample, attr)
    return optional(path) is not None


def check() -> None:
    """Raise ``missing_error`` for the first of ``NEEDED_AT_IMPORT`` this torch lacks."""
    for path in NEEDED_AT_IMPORT:
        if not _present(path):
            raise missing_error(path, "ckpt_lab")


check()
