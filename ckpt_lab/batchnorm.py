"""BatchNorm under checkpointing: the running statistics are updated twice per step. A fix.

Introduced in notebook 05. In training mode ``_BatchNorm.forward`` does two things besides
normalising: ``num_batches_tracked.add_(1)``, and ``F.batch_norm`` blends the batch mean and variance
into ``running_mean`` / ``running_var`` *in place* (momentum 0.1 by default). A checkpoint runs the
block twice -- once in the forward, once in backward to recompute it -- so both happen twice: after
one step ``num_batches_tracked == 2`` and the running statistics have had momentum applied twice.
The same goes for ``torch.utils.checkpoint`` (both variants), ``ckpt_lab.reentrant_checkpoint`` and
``ckpt_lab.checkpoint``. The gradients are unaffected (training mode normalises with the batch's own
statistics), so nothing fails: the model just evaluates worse, later.

``skip_stats_update_in_recompute(model)`` hooks every BatchNorm module so that a forward that runs
*inside backward* (a recomputation) writes its statistics into scratch copies that are then thrown
away. ``gradient_checkpoint_scope`` needs no fix: it replays aten ops, not modules, and already
redirects in-place writes to outside tensors (the running statistics) into copies.

Why not simply ``track_running_stats = False`` during the recomputation? Read ``_BatchNorm.forward``
(torch/nn/modules/batchnorm.py): in training mode that flag alone makes it skip ``add_(1)`` and pass
``None`` for both running statistics, while it still normalises with batch statistics -- the same
output. But ``native_batch_norm`` *saves* ``running_mean`` and ``running_var`` for its backward when
they are given, so the recomputation would save two tensors fewer per BatchNorm than the forward did.
The reentrant checkpoints don't care; the non-reentrant ones match recomputed tensors to saved ones
by position and raise ``CheckpointError`` (or, where shapes happen to line up, could hand backward
the wrong tensor). Swapping the buffers for copies keeps what is saved identical.

The swap must stay invisible to everyone else: the copies are made where no dispatch mode sees
them (NOTE [ Scratch copies are made out of sight ]), and the module's own buffer tensors are always
put back, however often the fix is applied (NOTE [ Applied twice ]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ckpt_lab.errors import missing_error, optional

# torch's private API (ckpt_lab/torch_private.py lists each use). The base class of every BatchNorm;
# on a torch without it, the public ones (a subclass of _BatchNorm of one's own is then missed).
_BatchNorm = optional("torch.nn.modules.batchnorm._BatchNorm")
_BATCH_NORMS: tuple[type, ...] = (_BatchNorm,) if _BatchNorm is not None else (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d,
)
# Needed: on a torch without it, skip_stats_update_in_recompute raises, naming it.
_disable_current_modes = optional("torch.utils._python_dispatch._disable_current_modes")

__all__ = ["StatsHooks", "in_backward", "skip_stats_update_in_recompute"]

# The buffers a training-mode forward writes to, in place.
_STATS = ("running_mean", "running_var", "num_batches_tracked")

# id() of every BatchNorm whose buffers are swapped for scratch copies right now, whichever hooks
# swapped them. See NOTE [ Applied twice ].
_SWAPPED: set[int] = set()


def skip_stats_update_in_recompute(module: nn.Module) -> StatsHooks:
    """Hook every BatchNorm in ``module`` (itself included) so that its running statistics and
    ``num_batches_tracked`` are updated once per step under checkpointing, as without it.

    A forward running inside backward (see ``in_backward``) gets scratch copies of the three buffers
    to write into; the real ones are put back when it returns *or raises* (a non-reentrant checkpoint
    stops its recomputation early by raising an exception, possibly inside a BatchNorm). Eval mode
    and forwards outside backward are left alone. Returns an object whose ``remove()`` unhooks all.
    Applying it again (once per epoch, say) is harmless: see NOTE [ Applied twice ].
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"skip_stats_update_in_recompute: expected an nn.Module (a model, or one BatchNorm), got "
            f"{type(module).__name__}. Pass the model that contains the BatchNorms; for several "
            "separate modules call it once per module, or pass nn.ModuleList([...])."
        )
    if _disable_current_modes is None:
        raise missing_error(
            "torch.utils._python_dispatch._disable_current_modes", "skip_stats_update_in_recompute"
        )
    hooks = StatsHooks()

    def pre_hook(bn: nn.Module, args: tuple[Any, ...]) -> None:
        # Eval mode and track_running_stats=False never write the buffers: nothing to protect.
        if not (in_backward() and bn.training and bn.track_running_stats):
            return
        # Already on scratch copies (the fix applied twice): see NOTE [ Applied twice ].
        if id(bn) in _SWAPPED:
            return
        real = {name: getattr(bn, name) for name in _STATS if getattr(bn, name) is not None}
        hooks.stashed[id(bn)] = real
        _SWAPPED.add(id(bn))
        # See NOTE [ Scratch copies are made out of sight ].
        with _disable_current_modes():
            # Copies, not empty tensors: with momentum=None the factor is 1 / num_batches_tracked,
            # and the same shape, dtype and device mean the recomputation saves what the forward saved.
            copies = {name: buffer.clone() for name, buffer in real.items()}
        for name, copy in copies.items():
            setattr(bn, name, copy)

    def post_hook(bn: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        # Registered with always_call=True: runs even when the forward raised. Only the hooks that
        # swapped the buffers put them back.
        if id(bn) not in hooks.stashed:
            return
        for name, buffer in hooks.stashed.pop(id(bn)).items():
            setattr(bn, name, buffer)
        _SWAPPED.discard(id(bn))

    for submodule in module.modules():
        if isinstance(submodule, _BATCH_NORMS):
            hooks.handles.append(submodule.register_forward_pre_hook(pre_hook))
            hooks.handles.append(submodule.register_forward_hook(post_hook, always_call=True))
    return hooks


# NOTE [ Scratch copies are made out of sight ]
# The copies are made inside the recomputation, where a checkpoint may be watching every aten op:
# ``selective_checkpoint``'s ``_ServeMode`` checks that the re-run runs the forward's ops one by one,
# and the forward ran no ``clone`` there. The copies are the fix's bookkeeping, not part of the
# recomputed function, so they are made with every dispatch mode set aside (torch's
# ``_disable_current_modes``; the instruments don't see those three small allocations either).
# The updates *into* the copies (``add_``, ``native_batch_norm``'s writes) are the function's own
# ops, the same as in the forward, and stay in sight.


# NOTE [ Applied twice ]
# Calling ``skip_stats_update_in_recompute`` again on the same model (once per epoch, say) registers
# a second pair of hooks on each BatchNorm. Forward hooks run in the order they were registered, so
# with each pair on its own the second pre-hook would stash the *first pair's scratch copies* as the
# real buffers, the first post-hook would put the real ones back, and the second would then replace
# them by those copies for good: the module keeps a copy, while an EMA model or DDP, holding the
# original tensors, sees statistics that never change again. So the pairs share ``_SWAPPED``: a
# pre-hook that finds the module already swapped does nothing, and only the post-hook of the pair
# that swapped puts the buffers back. Removing either pair leaves the other working.


def in_backward() -> bool:
    """Whether this code runs inside a backward pass, i.e. in the autograd engine's graph task.

    Every checkpoint (both ``torch.utils.checkpoint`` variants, ``ckpt_lab.reentrant_checkpoint``,
    ``ckpt_lab.checkpoint``) recomputes from inside backward, so a module forward that runs while
    this is True is taken to be a recomputation.

    Blind spots: a recomputation triggered *outside* backward -- e.g. by reading a saved tensor
    (``out.grad_fn._saved_mat1``) of a non-reentrant checkpoint -- is not detected; and a module that
    genuinely runs inside backward (called from a tensor hook or a custom ``Function.backward``) is
    taken for a recomputation.
    """
    # -1 is the engine's "no graph task on this thread"; device threads carry the task id too.
    return torch._C._current_graph_task_id() != -1


class StatsHooks:
    """The hooks ``skip_stats_update_in_recompute`` registered; ``remove()`` takes them all off."""

    def __init__(self) -> None:
        self.handles: list[RemovableHandle] = []
        # id(module) -> the real buffers, while a recomputation runs on scratch copies of them.
        self.stashed: dict[int, dict[str, torch.Tensor]] = {}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def __enter__(self) -> StatsHooks:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()
