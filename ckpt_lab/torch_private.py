"""Every private torch API ckpt_lab uses, in one place: NOTE [ Private torch API ].

    python -m ckpt_lab.torch_private      # which of them this torch has

A learner's torch is the torch of the day, and an engineer's is whatever their cluster runs; the
package reaches below torch's public API where the mechanism it teaches lives there (the saved-tensor
hooks stack, dispatch below autograd, the graph task). This module is the list: each use, where it
is, what it is for, and what happens on a torch without it. tests/test_torch_private.py checks that
every name listed exists on the running torch (or that its entry says what replaces it), and that
every private name the package's source uses is listed here, so that the list cannot drift.

NOTE [ Private torch API ]
A use is private when its path from ``torch`` has a component that starts with one underscore
(``torch._C._current_graph_task_id``, ``torch.utils._pytree.tree_flatten``), when it reads one
of torch's underscore attributes off an object (``tensor._base``), or when a class of ours
overrides or sets one that torch reads (``_should_skip_dynamo``, ``_boxed_call``). ATen ops whose
name starts with an underscore (``torch.ops.aten._to_copy``) are listed too: they are part of the
operator set, stable, but not promised.

Checked on: torch 2.11.0 (Python 3.12), 2.13.0 (the pinned one), 2.14.1 and 2.15.0 (Python 3.11), by
this list's test in ``make compat`` runs: every name below exists on each (``CHECKED_ON``), and the
signatures the package calls (``_unsafe_set_version_counter`` takes sequences, the pack hooks are
code constants of ``__init__``) are the same. ``absent_on`` names the checked releases an entry is
missing from.

How a module looks a name up: one way, ``ckpt_lab.errors.optional("torch._C._name")`` (the object, or
None where this torch lacks it), at import or at the call as the use needs, then its fallback or
``missing_error``. It lives in errors.py, which every stage module imports already, so a copied stage
carries it. (Not in ``scope_core.py``, whose ``from ... import`` fails at import by design: no
fallbacks in the core.)

``if_missing`` says what the package does on a torch without it: ``fallback`` (it works on,
gradients exact, perhaps slower or with less to report), or ``error`` (the feature that needs it
fails with ``ckpt_lab.errors.missing_error``: which feature, which private name, which torch).
tests/test_torch_private_fallbacks.py takes each name away and checks that it is so. The uses
without which the package can't be imported at all are checked when it is imported
(ckpt_lab/_torch_needed.py): such a torch gets that clear error, naming the first one it lacks,
before anything else (``python -m ckpt_lab.torch_private`` too). Where a use's ``today``
differs from ``if_missing``, the entry says so: that is work to do, not a promise kept (none does).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from ckpt_lab.errors import CHECKED_ON, lookup, missing_error

__all__ = ["CHECKED_ON", "PRIVATE_API", "PrivateUse", "missing", "missing_error", "optional", "resolve"]

# The releases this list was checked on (tests/test_torch_private.py passed under each; the site's
# "Torch versions" page says how the rest of the suite fared): CHECKED_ON, and missing_error, live in
# ckpt_lab/errors.py, which every stage module imports already (a copied stage carries them).


@dataclass(frozen=True)
class PrivateUse:
    """One private name: ``path`` from ``torch``; ``torch.Tensor()._base`` means an attribute of an
    instance (see ``_SAMPLES``)."""

    path: str
    where: str  # module: function, as of this writing (the test matches names, not places)
    why: str
    if_missing: str  # "fallback: ..." or "error: ..."
    today: str = ""  # where the code does not do ``if_missing`` (yet): what it does instead
    absent_on: tuple[str, ...] = ()


# What a use whose absence the package cannot get past says: checked when ckpt_lab is imported
# (ckpt_lab/_torch_needed.py, which lists these uses again), so that such a torch gets missing_error
# naming the name and the version, not an ImportError from somewhere inside.
_AT_IMPORT = "error: ckpt_lab cannot be imported (importing it names this and torch's version)"

PRIVATE_API: tuple[PrivateUse, ...] = (
    # ------------------------------------------------------------------ dispatch modes
    PrivateUse(
        "torch.utils._python_dispatch.TorchDispatchMode",
        "scope, nonreentrant (debug log), selective, planner, explain, instruments (memory, counting, flops)",
        "the base class of every dispatch mode: how the scope records and replays aten ops, and how "
        "the instruments see every storage born",
        _AT_IMPORT + "; there is no public alias (torch's own docs import it from here)",
    ),
    PrivateUse(
        "torch.utils._python_dispatch.TorchDispatchMode._should_skip_dynamo",
        "scope: _RecordingMode (overrides it)",
        "opts the recording mode out of the torch._dynamo.disable wrapper torch puts around a mode's "
        "__torch_dispatch__ (a tenth of the scope's time); scope.NOTE [ Speed ] (j)",
        "fallback: the override is never called and torch keeps its wrapper: same results, slower",
    ),
    PrivateUse(
        "torch.utils._python_dispatch._disable_current_modes",
        "batchnorm: skip_stats_update_in_recompute",
        "makes the scratch copies of the running statistics out of sight of a checkpoint's mode",
        "error: skip_stats_update_in_recompute raises when called, naming it and torch's version",
    ),
    PrivateUse(
        "torch.utils._python_dispatch._pop_mode",
        "exercises._feedback: restore_state",
        "pops the dispatch modes a learner's code left on the stack, so that grading goes on",
        "fallback: the grader reports the leftover modes (how many, torch's version) without popping them",
    ),
    # ------------------------------------------------------------------ autograd engine
    PrivateUse(
        "torch._C._current_graph_task_id",
        "scope (entry point, safe points, replay), scope_core, nonreentrant (_graph_task_id), batchnorm "
        "(in_backward), explain (unpack), distributed (hook tracing)",
        "whether this code runs inside backward (-1 outside): a scope does nothing there, and a "
        "recomputation is told apart from a forward",
        _AT_IMPORT + "; no public equivalent (a copied nonreentrant.py raises at import, a copied "
        "scope.py when a scope opens, a copied scope_core.py at import)",
    ),
    PrivateUse(
        "torch.autograd.Variable._execution_engine.queue_callback",
        "scope, scope_core: _ResidentHooks.release_if_idle",
        "removes the scope's resident hooks once the backward that freed its last tensor is over",
        "fallback: the hooks go at the next safe point instead (memory of one stack entry; gradients "
        "unaffected); scope_core, which has no fallbacks, lets torch's AttributeError be printed (Python "
        "ignores it in the weakref callback that meets it) and the hooks go at the next scope",
    ),
    PrivateUse(
        "torch._C._autograd._get_sequence_nr",
        "nonreentrant: History (NOTE [ Every op is compared ])",
        "the number autograd gives the next node this thread creates: the nodes a checkpointed region "
        "(and its re-run) created are the ones numbered from there",
        "fallback: the re-run check compares the op that made each saved tensor only (a differing op "
        "whose output is not saved goes unseen, as in torch's check)",
    ),
    PrivateUse(
        "torch._C._current_autograd_node",
        "explain.regions: _backward_context",
        "names the autograd node that runs a backward op",
        "fallback: leave the node's name empty",
    ),
    PrivateUse(
        "torch.autograd._is_checkpoint_valid",
        "reentrant: _is_checkpoint_valid (CheckpointFunction.backward)",
        "refuses torch.autograd.grad() and backward(inputs=...), where the nested backward would "
        "write .grad (torch's reentrant checkpoint asks the same)",
        "error: reentrant_checkpoint's backward raises, naming it and torch's version (skipping the "
        "check could write .grad where autograd.grad must not)",
    ),
    # ------------------------------------------------------------------ saved-tensor hooks stack
    PrivateUse(
        "torch._C._autograd._push_saved_tensors_default_hooks",
        "scope (_ResidentHooks.restack, _inside_a_checkpoint), scope_core, explain (_hooks_stack)",
        "puts the scope's resident pack hook below others, and puts back what was popped to look",
        "error: gradient_checkpoint_scope refuses to open, naming it and torch's version (scope_core: "
        "at import); fallback for explain: the hooks stack reads as empty (hooks-based regions unseen)",
    ),
    PrivateUse(
        "torch._C._autograd._pop_saved_tensors_default_hooks",
        "scope (_ResidentHooks.restack, _inside_a_checkpoint), scope_core, explain (_hooks_stack), "
        "exercises._feedback (restore_state)",
        "reads the hooks stack below its top (torch shows only the top)",
        "error: as for _push_saved_tensors_default_hooks; fallback for explain: as there; for the "
        "grader: leftover hooks are reported, not popped",
    ),
    PrivateUse(
        "torch._C._autograd._top_saved_tensors_default_hooks",
        "nonreentrant (user_saved_tensors_hooks), scope (_top), scope_core, explain (_hooks_stack), "
        "instruments.state (global_state), exercises._feedback",
        "the innermost saved-tensor hooks on this thread",
        _AT_IMPORT + " (the non-reentrant checkpoint finds the user's hooks with it); for a copied "
        "scope.py: it refuses to open; fallback for explain and instruments.state: the stack as empty, "
        "its state as unknown",
    ),
    PrivateUse(
        "torch._C._autograd._saved_tensors_hooks_is_enabled",
        "scope (safe points, _inside_a_checkpoint), explain (_hooks_stack)",
        "whether pushing hooks is allowed here (torch.autograd.graph.disable_saved_tensors_hooks)",
        "error: as for _push_saved_tensors_default_hooks; fallback for explain: as there",
    ),
    # ------------------------------------------------------------------ the scope's replay
    PrivateUse(
        "torch._C._AutoDispatchBelowAutograd",
        "scope: _Replayer._replay",
        "replays the tape below autograd, as it was recorded: the replay builds no graph",
        "error: gradient_checkpoint_scope refuses to open, naming it and torch's version (a replay "
        "above autograd would build a graph backward never uses)",
    ),
    PrivateUse(
        "torch._C._set_grad_enabled",
        "scope: _Replayer._replay",
        "switches grad mode between replayed ops without a context manager (speed)",
        "fallback: torch.set_grad_enabled(mode) called as a function does the same",
    ),
    PrivateUse(
        "torch.utils.checkpoint._checkpoint_hook",
        "scope: _pack_hook_codes, _marks_its_pack_hooks",
        "recognises torch's non-reentrant checkpoint around a scope: NOTE [ A scope inside a checkpoint ]",
        "fallback: torch 2.14's mark on its pack hooks (_checkpoint_internal) recognises them; error "
        "where neither works: the scope refuses to open under a pack hook it does not know, naming this "
        "and torch's version (else a scope inside torch's checkpoint would give wrong gradients)",
    ),
    PrivateUse(
        "torch.utils.checkpoint._recomputation_hook",
        "scope: _pack_hook_codes, _marks_its_pack_hooks",
        "the same, for the pack hook of torch's recomputation",
        "fallback: as for _checkpoint_hook (and its error where the fallback fails too)",
    ),
    # ------------------------------------------------------------------ checkpoints
    PrivateUse(
        "torch.overrides._get_current_function_mode_stack",
        "nonreentrant: _device_context",
        "finds the torch.device block around the forward, to re-enter it in the recomputation",
        "fallback: no device block is re-entered; a factory call without a device then makes the "
        "re-run differ, which the determinism check reports (torch's checkpoint does the same)",
    ),
    PrivateUse(
        "torch.utils._device.DeviceContext",
        "nonreentrant: _device_context",
        "the mode a torch.device block pushes (a fresh one, on the forward's device, for the re-run)",
        "fallback: as for _get_current_function_mode_stack",
    ),
    PrivateUse(
        "torch.utils._pytree.tree_flatten",
        "_aten (tensors_in), nonreentrant, selective",
        "walks nested arguments and outputs",
        _AT_IMPORT + "; no public module has it (there is no torch.utils.pytree in 2.13)",
    ),
    PrivateUse(
        "torch.utils._pytree.tree_unflatten",
        "nonreentrant, selective",
        "rebuilds nested outputs",
        _AT_IMPORT,
    ),
    PrivateUse(
        "torch.utils._pytree.tree_leaves",
        "rng: tensor_devices; scope_core: the replay",
        "the devices of nested arguments; the tensors an op returned",
        _AT_IMPORT,
    ),
    PrivateUse(
        "torch.utils._pytree.tree_map_only",
        "scope_core: the tape's arguments",
        "replaces the tensors of nested op arguments by their slots, and back",
        _AT_IMPORT,
    ),
    PrivateUse(
        "torch._C._SetExcludeDispatchKeyGuard",
        "selective: _alias (checked by _check_torch)",
        "a detached alias that shares the output's version counter (as torch's _detach_helper)",
        "error: selective_checkpoint refuses to start, naming it and torch's version (without it an "
        "in-place change of a cached output would go unseen)",
    ),
    PrivateUse(
        "torch._C.DispatchKey.ADInplaceOrView",
        "selective: _alias (checked by _check_torch)",
        "the dispatch key _SetExcludeDispatchKeyGuard re-enables",
        "error: as for _SetExcludeDispatchKeyGuard",
    ),
    PrivateUse(
        "torch._ops.OpOverload",
        "_aten (is_view), selective (policies), compiled (graph costs)",
        "the type of one aten overload: policies and op tables are keyed by it",
        _AT_IMPORT + "; no public alias",
    ),
    PrivateUse(
        "torch._ops.OpOverloadPacket",
        "selective: _checked_ops",
        "tells an overload packet (torch.ops.aten.mm) from an overload in a policy's op list",
        "fallback: a packet in an op list is refused with the general message (the list must hold "
        "aten op overloads)",
    ),
    PrivateUse(
        "torch._ops.HigherOrderOperator",
        "compiled: _has_higher_order_ops",
        "finds graphs the instruments cannot measure",
        "error: ckpt_lab.compiled's measurements raise, naming it and torch's version",
    ),
    PrivateUse(
        "torch.ops.aten._to_copy.default",
        "selective (is_autocast_weight_cast), cases.zoo",
        "the aten op behind .to(dtype): autocast's weight casts",
        _AT_IMPORT + "; an ATen op, which torch's own SAC policies name too",
    ),
    PrivateUse(
        "torch.utils.checkpoint._CachingTorchDispatchMode",
        "explain: _SELECTIVE_FORWARD; exercises._delegation (TORCH_CHECKPOINTS)",
        "recognises torch's selective checkpoint's forward frames",
        "fallback: torch's selective regions are shown as plain non-reentrant checkpoints",
    ),
    # ------------------------------------------------------------------ the exercises' graders
    PrivateUse(
        "torch.utils.checkpoint._checkpoint_without_reentrant_generator",
        "exercises._delegation (TORCH_CHECKPOINTS)",
        "refused in a learner's file: torch's non-reentrant checkpoint, called from below its public name",
        "fallback: not looked up by identity (the file's text is still read for it)",
    ),
    PrivateUse(
        "torch.utils.checkpoint._CachedTorchDispatchMode",
        "exercises._delegation (TORCH_CHECKPOINTS)",
        "refused in a learner's file: torch's selective checkpoint's recomputation mode",
        "fallback: not looked up by identity (the file's text is still read for it)",
    ),
    PrivateUse(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "exercises._delegation (TORCH_CHECKPOINTS)",
        "refused in a learner's file: torch's checkpoint wrapper module (FSDP's recipe)",
        "fallback: not looked up by identity (the file's text is still read for it)",
    ),
    # ------------------------------------------------------------------ planner, batchnorm, state
    PrivateUse(
        "torch._C._autograd._unsafe_set_version_counter",
        "planner: _UndoWrites.__exit__ (profiling)",
        "puts back the version counters the profiling run's in-place writes moved",
        "fallback: counters stay moved: a graph built before profiling that saved such a tensor "
        "raises torch's in-place error in backward (loud, never wrong)",
    ),
    PrivateUse(
        "torch.nn.modules.batchnorm._BatchNorm",
        "batchnorm: skip_stats_update_in_recompute",
        "finds every BatchNorm (1d/2d/3d, lazy, sync) in a model",
        "fallback: the public classes (BatchNorm1d/2d/3d, LazyBatchNorm1d/2d/3d, SyncBatchNorm)",
    ),
    PrivateUse(
        "torch._C._len_torch_dispatch_stack",
        "instruments.state: global_state",
        "how many dispatch modes are on (the test that nothing was left behind)",
        "fallback: report the count as unknown",
    ),
    # ------------------------------------------------------------------ Dynamo and the compiler
    PrivateUse(
        "torch._C._dynamo.eval_frame.set_code_exec_strategy",
        "scope: _RecordingMode._should_skip_dynamo, _skip_dynamo",
        "marks the recording mode's code for Dynamo to skip, once, in C: NOTE [ Speed ] (j)",
        "fallback: torch keeps its torch._dynamo.disable wrapper (_should_skip_dynamo returns True)",
    ),
    PrivateUse(
        "torch._C._dynamo.eval_frame._FrameAction",
        "scope: _RecordingMode._should_skip_dynamo, _skip_dynamo",
        "argument of set_code_exec_strategy",
        "fallback: as for set_code_exec_strategy",
    ),
    PrivateUse(
        "torch._C._dynamo.eval_frame._FrameAction.SKIP",
        "scope: _RecordingMode._should_skip_dynamo, _skip_dynamo",
        "skip this frame and the frames it calls",
        "fallback: as for set_code_exec_strategy",
    ),
    PrivateUse(
        "torch._C._dynamo.eval_frame._FrameExecStrategy",
        "scope: _RecordingMode._should_skip_dynamo, _skip_dynamo",
        "argument of set_code_exec_strategy",
        "fallback: as for set_code_exec_strategy",
    ),
    PrivateUse(
        "torch._dynamo",
        "helpers.processes: _context (forkserver preload, by name); scope: _skip_dynamo",
        "imported once in the forkserver, not in every worker; imported on the scope's first use, as "
        "torch's wrapper would",
        "fallback: the forkserver ignores a preload module it cannot import; a torch without Dynamo "
        "has nothing to mark",
    ),
    PrivateUse(
        "torch._dynamo.explain",
        "compiled: graph_breaks",
        "counts Dynamo's graph breaks",
        "error: ckpt_lab.compiled's graph-break report raises, naming it and torch's version",
    ),
    PrivateUse(
        "torch._dynamo.backends.common.aot_autograd",
        "compiled: _recording_backend",
        "builds a backend that keeps the forward and backward graphs",
        "error: ckpt_lab.compiled's measurements raise, naming it and torch's version",
    ),
    PrivateUse(
        "torch._dynamo.backends.debugging.boxed_nop",
        "compiled: _recording_backend",
        "runs the graphs eagerly (aot_eager)",
        "error: as for aot_autograd",
    ),
    PrivateUse(
        "torch._functorch.config.patch",
        "compiled: _memory_budget (compile_step, compiled_points)",
        "sets the partitioner's activation memory budget for one compilation",
        "error: as for activation_memory_budget",
    ),
    PrivateUse(
        "torch._functorch.config.activation_memory_budget",
        "compiled: _memory_budget (compile_step, compiled_points)",
        "the budget itself (notebook 08)",
        "error: ckpt_lab.compiled's budgets raise, naming it and torch's version",
    ),
    PrivateUse(
        "torch._inductor.compile_fx.select_decomp_table",
        "compiled: _recording_backend",
        "the decompositions torch.compile's inductor backend uses",
        "error: as for aot_autograd (when the first graph compiles)",
    ),
    PrivateUse(
        "_boxed_call",
        "compiled: _run_inside (set on our compiled function)",
        "tells aot_autograd that the function takes its arguments as one list",
        "fallback: were torch to stop reading it, the graph's inputs come one by one, and run() "
        "gathers them into the list the compiled graph takes",
    ),
    # ------------------------------------------------------------------ distributed
    PrivateUse(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",
        "distributed",
        "torch's FSDP recipe for checkpointing a submodule (notebook 06 compares with it)",
        "error: importing ckpt_lab.distributed raises, naming it and torch's version (it is not "
        "imported by ckpt_lab/__init__)",
    ),
    PrivateUse(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing",
        "distributed",
        "the same recipe over a whole model",
        "error: as for checkpoint_wrapper",
    ),
    # ------------------------------------------------------------------ attributes of objects
    PrivateUse(
        "torch.Tensor()._base",
        "scope (_scope_ref), scope_core, offload (_keeps_its_own_storage), instruments.saved, selective "
        "(_is_a_view's fallback)",
        "the tensor a view was made from",
        _AT_IMPORT + "; no public equivalent",
    ),
    PrivateUse(
        "torch.autograd.graph.Node()._sequence_nr",
        "nonreentrant: History (NOTE [ Every op is compared ])",
        "the creation number of an autograd node (every node has it, C++ ones and custom Functions' "
        "alike): which nodes a checkpointed region created",
        "fallback: with torch._C._autograd._get_sequence_nr (both came together), the re-run check "
        "compares the op that made each saved tensor only",
    ),
    PrivateUse(
        "torch.Tensor()._version",
        "scope (in-place checks), scope_core, selective (_Entry.modified), planner (profiling)",
        "the version counter autograd's own in-place check reads",
        _AT_IMPORT + "; no public equivalent",
    ),
    PrivateUse(
        "torch.Tensor()._is_view",
        "selective: _is_a_view (is_autocast_weight_cast)",
        "whether a tensor is a view",
        "fallback: tensor._base is not None",
    ),
    PrivateUse(
        "torch._ops.OpOverload()._schema",
        "_aten (op_info, is_view), selective (must_rerun), explain",
        "an op's schema: which arguments it writes, which outputs alias",
        _AT_IMPORT + "; no public equivalent (torch's own SAC reads it)",
    ),
)


# Instances whose attributes the ``Class()._attr`` entries name.
def _sample(cls_path: str) -> Any:
    import torch

    return {
        "torch.Tensor": lambda: torch.zeros(2),
        "torch.nn.Module": lambda: torch.nn.Linear(1, 1),
        "torch._ops.OpOverload": lambda: torch.ops.aten.add.Tensor,
        "torch._ops.OpOverloadPacket": lambda: torch.ops.aten.add,
        # An autograd node (the class of C++ nodes has no importable name).
        "torch.autograd.graph.Node": lambda: torch.zeros(2, requires_grad=True).sin().grad_fn,
    }[cls_path]()


def resolve(path: str) -> Any:
    """The object ``path`` names on the running torch (ImportError or AttributeError if absent).

    ``torch.a.b.C()._x`` is attribute ``_x`` of a sample instance of ``torch.a.b.C``; a bare ``_x``
    (a protocol attribute torch reads off our objects) is looked up in torch's source."""
    if "()." in path:
        owner, attr = path.split("().")
        return getattr(_sample(owner), attr)
    if "." not in path:
        return _torch_reads(path)
    return lookup(path)


def _torch_reads(attr: str) -> str:
    """The first file of torch that mentions ``attr`` (a protocol attribute it reads off objects)."""
    from pathlib import Path

    import torch

    root = Path(torch.__file__).parent
    for folder in ("_dynamo", "_functorch", "fx", "_inductor"):
        for file in sorted((root / folder).rglob("*.py")):
            if attr in file.read_text(errors="ignore"):
                return str(file.relative_to(root.parent))
    raise AttributeError(f"torch {torch.__version__} no longer mentions {attr!r}")


def optional(path: str) -> Any:
    """The object ``path`` names on the running torch, or None where it lacks it: for a use whose entry
    says ``fallback``, so that the module can take its fallback. For a dotted path from ``torch`` this is
    ``ckpt_lab.errors.optional``, the lookup every module uses; here also the ``Class()._attr`` forms."""
    try:
        return resolve(path)
    except (ImportError, AttributeError):
        return None


def missing() -> list[PrivateUse]:
    """The entries the running torch lacks."""
    absent = []
    for use in PRIVATE_API:
        try:
            resolve(use.path)
        except (ImportError, AttributeError):
            absent.append(use)
    return absent


def main() -> int:
    import torch

    absent = {use.path for use in missing()}
    width = max(len(use.path) for use in PRIVATE_API)
    for use in PRIVATE_API:
        print(f"{'MISSING' if use.path in absent else 'ok':>7}  {use.path:<{width}}  {use.if_missing}")
    print(f"\ntorch {torch.__version__}: {len(PRIVATE_API) - len(absent)} of {len(PRIVATE_API)} present")
    return 1 if absent else 0


if __name__ == "__main__":
    sys.exit(main())
