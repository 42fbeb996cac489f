"""The non-reentrant checkpoint: let autograd build its graph as usual, but store handles, not tensors.

Introduced in notebook 03b. Same semantics as ``torch.utils.checkpoint.checkpoint(fn, *args,
use_reentrant=False, **kwargs)``, written from scratch on ``torch.autograd.graph.saved_tensors_hooks``
(torch only serves as the oracle in the tests).

The reentrant checkpoint of notebook 02 hid the block inside one autograd node and ran a nested
backward. This one leaves the graph exactly as a plain forward builds it and changes only *what the
graph stores*:

* **forward**: a pack hook swaps every tensor autograd wants to save for an empty ``Handle``. The
  ``Frame`` keeps the block's inputs and, per saved tensor, a weak reference to its handle, its
  shape, dtype and device, and the op that made it (its ``grad_fn``'s name) -- nothing else.
* **backward**: the first unpack in a backward re-runs the block once, with the forward's RNG and
  autocast state, under a second pack hook that drops each recomputed tensor into its handle *by
  position*, checks that the same op made it, and stops the re-run as soon as the last handle
  backward still needs is filled. Each handle gives its tensor out once, so backward frees it as
  soon as it has used it. When the re-run ends, it redoes autograd's version check, which autograd
  skips for tensors saved through hooks: a tensor the re-run modified in place after saving it is
  an error, not a wrong gradient.

Nothing is reentrant, so ``torch.autograd.grad``, ``backward(inputs=...)``, keyword arguments and
blocks whose inputs don't require grad all just work.

Below the banner: torch's keywords (``determinism_check``, ``debug`` with
``set_checkpoint_debug_enabled``, ``early_stop`` with ``set_checkpoint_early_stop``, ``context_fn``,
torch 2.14's configured form ``checkpoint(use_reentrant=False)(fn)`` and
``respect_saved_tensors_hooks``), the errors (torch's sentence first, then what ours adds),
``debug=True``'s op recorder and the ``torch.compile`` fallback. ``tests/test_torch_parity.py`` runs
torch's own tests on them.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ckpt_lab._eager import run_eagerly
from ckpt_lab.errors import CheckpointError, missing_error, optional
from ckpt_lab.rng import ReplayState
from ckpt_lab.state_guard import STATE_CHECKS, StateGuard, recomputing

__all__ = [
    "CheckpointError",
    "Frame",
    "Handle",
    "History",
    "check_use_reentrant",
    "checkpoint",
    "frame_of",
    "noop_context_fn",
    "pack_to_handle",
    "recompute",
    "set_checkpoint_debug_enabled",
    "set_checkpoint_early_stop",
    "unpack_from_handle",
    "user_saved_tensors_hooks",
]


def noop_context_fn() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The default ``context_fn``: nothing around the forward, nothing around the recomputation."""
    return contextlib.nullcontext(), contextlib.nullcontext()


def checkpoint(
    function: Callable[..., Any] | None = None,
    *args: Any,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, Any]] | None = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    use_reentrant: bool = False,
    respect_saved_tensors_hooks: bool | None = None,
    state_check: str = "none",
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)``, keeping only its inputs; backward recomputes the activations.

    Like ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)``, with
    torch's keywords, which are never passed on to ``function``:

    * ``preserve_rng_state=False`` skips the RNG snapshot: only safe if ``function`` draws no random
      numbers (no dropout), or if different ones in the recomputation are acceptable.
    * ``context_fn``: returns a pair of context managers, the first entered around the forward, the
      second around each recomputation. ``functools.partial(ckpt_lab.selective.
      selective_checkpoint_contexts, policy)`` makes the checkpoint selective (notebook 05), and so
      does torch's ``create_selective_checkpoint_contexts``. ``None`` means none.
    * ``determinism_check="default"`` compares each recomputed tensor with the forward's: its shape,
      dtype and device (torch's check), the op that made it (ours: the name of its ``grad_fn``,
      which catches a re-run that would save *more* tensors even when early stop ends it before
      torch could notice), and the names of the autograd nodes the region created on the way to it
      (ours: NOTE [ Every op is compared ], which catches a re-run that ran another op whose output
      is not saved, ``t.sin().exp()`` against ``t.cos().exp()``). It raises ``CheckpointError`` on
      the first difference, naming both ops and the line. What it cannot see: the same op fed other
      values (``t + 1`` against ``t + 2``). ``"makers"`` (ours) skips the nodes on the way: the walk
      cost 1.12-1.19x a step on regions of many tiny ops (pointwise-32, chain-64; within the noise,
      0.98-1.04x, on mlp-8 and transformer-4: paired rounds, one thread, process time).
      ``"none"`` compares nothing (a
      recomputation that saves a different *number* of tensors still raises: backward would miss
      tensors).
    * ``debug=True``: on such an error, the message adds the aten ops of the forward and of the
      recomputation side by side, each with the line of your code that ran it, and marks the first
      difference. Costs a dispatch mode around both runs; not combinable with ``context_fn``.
      ``set_checkpoint_debug_enabled`` overrides it for every checkpoint in its block.
    * ``early_stop=True`` stops the recomputation once the last tensor backward still needs is
      recomputed; ``False`` runs the whole function again. ``set_checkpoint_early_stop`` overrides
      it for every checkpoint whose forward runs in its block.
    * ``respect_saved_tensors_hooks`` (torch 2.14): whether the outputs a *selective* checkpoint's
      policy saves go through an enclosing ``saved_tensors_hooks`` (``save_on_cpu``); ``None`` (the
      default) and ``False``: they don't, ``True``: they do. Passed on to the ``context_fn``'s
      forward context (``ckpt_lab.selective``'s, or torch 2.14's); without one it does nothing.
    * ``state_check`` (ours): the state of the region's modules (buffers, attributes holding
      numbers, tensors, lists, dicts) before the forward, against before the re-run. ``"none"``
      (the default, as torch): not compared; ``"warn"``/``"raise"``: each change named, module path
      and attribute, in a warning or a ``CheckpointError``; ``"restore"``: the forward's state put
      back for the re-run, and the state the forward left after it. ``ckpt_lab.is_recomputing()`` is
      ``True`` inside the re-run. What it cannot see (globals, closures, C++ state):
      ``ckpt_lab.state_guard``.
    * ``function`` left out (torch 2.14): ``checkpoint(use_reentrant=False, ...)`` returns a
      decorator; ``checkpoint(use_reentrant=False)(fn)(*args)`` is ``checkpoint(fn, *args)``.

    Containers among the arguments (lists, tuples, dicts) are rebuilt for the recomputation from
    their contents at call time, so the re-run sees them as the forward did even if the caller
    mutated them since; torch passes the caller's objects again.
    ``use_reentrant=False`` is accepted, and not passed on to ``function``, so that this drops in
    where ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)`` was; any other
    value is refused (see ``check_use_reentrant``).
    """
    options = {
        "preserve_rng_state": preserve_rng_state, "context_fn": context_fn,
        "determinism_check": determinism_check, "debug": debug, "early_stop": early_stop,
        "use_reentrant": use_reentrant, "respect_saved_tensors_hooks": respect_saved_tensors_hooks,
        "state_check": state_check,
    }  # fmt: skip
    if function is None and not args:
        # torch 2.14's configured form, checked now rather than at the first call.
        return _Configured.decorator(checkpoint, options, kwargs)
    if torch.compiler.is_compiling():
        # NOTE [ Checkpoints under torch.compile ] (ckpt_lab.compiled): a graph break, then eager.
        return run_eagerly(checkpoint, function, *args, **options, **kwargs)
    keywords = _Keywords.resolve("checkpoint", function, **options)
    if not torch.is_grad_enabled():
        # No graph will be built, so there is nothing to save and nothing to recompute.
        return function(*args, **kwargs)
    forward_context, recompute_context = keywords.contexts()
    # Snapshot RNG and autocast before the block draws its first random number.
    replay = ReplayState.capture(args, kwargs, preserve_rng_state=preserve_rng_state)
    # Built (and its inputs saved) before our hooks are installed, so they don't swallow the inputs.
    frame = Frame(function, args, kwargs, replay, recompute_context, keywords)
    _watch_state(frame, keywords, function, args, kwargs)  # state_check (ckpt_lab.state_guard)
    try:
        with _checkpoint_hooks(pack_to_handle(frame), unpack_from_handle(frame)), forward_context:
            out = function(*args, **kwargs)
    finally:
        _forward_ended(frame)  # NOTE [ Every op is compared ]
    frame.forward_completed = True
    return out


class Handle:
    """What the graph stores instead of a saved tensor: a box that a recomputation fills, with one
    tensor per backward (graph task id) that needs it, in ``recomputed``."""

    def __init__(self) -> None:
        self.recomputed: dict[int, torch.Tensor] = {}


class _SaveInputs(torch.autograd.Function):
    """A node that does nothing but keep the block's input tensors as autograd *saved tensors*."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return torch.empty(0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        # Never called: nothing ever uses this node's output.
        return (None,) * len(ctx.needs_input_grad)


# Stands in the frame's argument list for each tensor, which lives in the ``_SaveInputs`` node.
_TENSOR = object()


class Frame:
    """Everything one checkpointed call keeps between its forward and its backward(s).

    Read by notebook 03b (through ``frame_of``): ``handles`` (a weak reference per saved tensor, in
    the order the forward saved them; dead once backward freed the node that saved it), ``metas``
    (shape, dtype and device of each) and ``makers`` (the op that made each: ``made_by``).
    """

    def __init__(
        self,
        function: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        replay: ReplayState,
        recompute_context: contextlib.AbstractContextManager | None = None,
        keywords: _Keywords | None = None,
    ) -> None:
        keywords = keywords or _Keywords()
        self.function = function
        self.replay = replay
        # Entered around every re-run; selective checkpointing (notebook 05) serves saved ops from it.
        self.recompute_context = recompute_context or contextlib.nullcontext()
        # Flatten args and kwargs together, so tensors inside lists or dicts are saved like the rest.
        leaves, self.spec = tree_flatten((args, kwargs))
        self.leaves = [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        # Saving the inputs through autograd rather than in a list does two things: an enclosing
        # checkpoint's pack hook sees them (so a nested checkpoint's inputs, which are the outer one's
        # activations, are dropped and recomputed by the outer one), and autograd's version counter
        # catches an input modified in place before backward. The anchor requires grad so that the
        # node is recorded even when no input does.
        self.saver = _SaveInputs.apply(torch.empty(0, requires_grad=True), *tensors)
        self.handles: list[weakref.ref[Handle]] = []
        self.metas: list[_Meta] = []
        self.makers: list[str] = []
        # Per saved tensor, the autograd nodes the region created for it that no earlier saved tensor
        # came from (``History``): the re-run must create the same ones (NOTE [ Every op is compared ]).
        self.histories: list[tuple[str, ...]] = []
        self.walk = keywords.walk and keywords.check and _WALKS
        self.history = History(tensors) if self.walk else None
        self.forward_nodes = range(0)
        # Graph tasks (backward calls) that have already had their recomputation.
        self.recomputed_for: set[int] = set()
        # torch's keywords: compare each recomputed tensor (determinism_check); stop early.
        self.check = keywords.check
        self.early_stop = keywords.early_stop
        self.debug_log: _DebugLog | None = keywords.debug_log
        # The caller's ``with torch.device(...)``, re-entered for the re-run (see ``_device_context``).
        self.device_context = _device_context()
        # False while the forward runs: a backward inside it may re-run more than was saved so far.
        self.forward_completed = False
        # state_check's guard (ckpt_lab.state_guard), set by checkpoint when asked for.
        self.state: StateGuard | None = None

    def inputs(self) -> tuple[tuple, dict]:
        """The block's ``(args, kwargs)`` again; unpacking may trigger an enclosing checkpoint's re-run."""
        tensors = iter(self.saver.grad_fn.saved_tensors)
        leaves = [next(tensors) if leaf is _TENSOR else leaf for leaf in self.leaves]
        return tree_unflatten(leaves, self.spec)


def frame_of(saved: Any) -> Frame | None:
    """The ``Frame`` of the ``ckpt_lab.checkpoint`` that packed this saved tensor, or ``None``.

    ``saved`` is what autograd keeps for one saved tensor, e.g. ``out.grad_fn._raw_saved_self``
    (notebook 03b inspects a checkpoint this way), or its unpack hook.
    """
    try:
        unpack = saved.unpack_hook if hasattr(saved, "unpack_hook") else saved
    except RuntimeError:
        # A saved tensor without hooks (not inside any checkpoint) has no unpack hook to read.
        return None
    return getattr(unpack, "frame", None)


def pack_to_handle(frame: Frame) -> Callable[[torch.Tensor], Handle]:
    """The forward's pack hook: note the tensor's metadata and maker, give autograd an empty handle."""

    def pack(tensor: torch.Tensor) -> Handle:
        handle = Handle()
        # Weak: the graph owns the handle. Once backward frees the node that saved it, the handle
        # dies, and the recomputation knows that this tensor is no longer needed.
        frame.handles.append(weakref.ref(handle))
        frame.metas.append(_Meta.of(tensor))
        if frame.check:
            frame.makers.append(made_by(tensor))
            frame.histories.append(frame.history.of(tensor) if frame.history else ())
        return handle

    # The protocol of checkpoints whose backward re-runs the region and matches saved tensors by
    # position: a gradient_checkpoint_scope opened inside the region sees this flag and does nothing
    # (see NOTE [ A scope inside a checkpoint ] in ckpt_lab/scope.py). A copy of this file keeps it.
    pack.recomputes_region = True  # type: ignore[attr-defined]
    return pack


# Ids for unpacks outside any backward (say, reading ``grad_fn._saved_self``); real ones are >= 0.
_outside_backward = itertools.count(-2, -1)


def _graph_task_id() -> int:
    task = torch._C._current_graph_task_id()
    # -1 means "not in a backward": such an unpack gets a recomputation of its own.
    return task if task != -1 else next(_outside_backward)


def unpack_from_handle(frame: Frame) -> Callable[[Handle], torch.Tensor]:
    """The forward's unpack hook, called by backward: recompute once per backward, hand out once."""

    def unpack(handle: Handle) -> torch.Tensor:
        task = _graph_task_id()
        # The first unpack of this backward fills every live handle at once: one re-run per backward.
        if task not in frame.recomputed_for:
            recompute(frame, task)
            frame.recomputed_for.add(task)
        if task not in handle.recomputed:
            raise _unpacked_twice()
        # Pop: from now on backward holds the only reference, and frees it once the node is done.
        return handle.recomputed.pop(task)

    unpack.frame = frame  # type: ignore[attr-defined]  # for frame_of
    return unpack


class _StopRecomputation(Exception):
    """Raised inside the re-run once every tensor backward still needs has been recomputed."""


class _Meta(NamedTuple):
    """A saved tensor's shape, dtype and device: what torch's determinism check compares. (A tuple:
    made once per saved tensor, twice per step, it must be cheap.)"""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Meta:
        return cls(tensor.shape, tensor.dtype, tensor.device)

    def __str__(self) -> str:
        return f"shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}"


def made_by(tensor: torch.Tensor) -> str:
    """The op that made ``tensor``, as autograd knows it: its ``grad_fn``'s class name (``SinBackward0``
    for ``x.sin()``), ``"leaf"`` for a tensor that requires grad and has none, ``"no grad"`` else.

    Free: the pack hook is handed the tensor anyway, and autograd has already set its ``grad_fn``
    (for a tensor an op saves as its output, that op's own node). The name, not the class, so that
    an ``autograd.Function`` defined inside the checkpointed function compares equal with itself.
    """
    grad_fn = tensor.grad_fn
    if grad_fn is not None:
        return type(grad_fn).__name__
    return "leaf" if tensor.requires_grad else "no grad"


# On a torch without the thread's node counter, only the makers are compared (torch_private.py).
_WALKS = hasattr(torch._C._autograd, "_get_sequence_nr")


# NOTE [ Every op is compared ]
# Comparing the op that *made* each saved tensor misses a re-run that differs in an op whose output is
# not saved: in ``t.sin().exp()`` against ``t.cos().exp()``, sin and cos both save ``t``, exp saves
# its own output, and every saved tensor has the same maker, yet exp's output differs. So each saved
# tensor also carries the names of the autograd nodes it was computed through that the region itself
# created and that no earlier saved tensor came from: a walk from its ``grad_fn`` along
# ``next_functions``, stopping at nodes already walked, at the region's inputs' nodes and at nodes
# older than the region (autograd numbers the nodes of a thread in creation order,
# ``_sequence_nr``; the parameters' ``AccumulateGrad`` nodes carry the largest number). Each node is
# walked once per run, so it costs one visit per node the region created, in the forward and in the
# re-run. The re-run must walk the same names at the same saved tensor, wherever it stops early.
# What it cannot see: a different *value* fed to the same op (``t + 1`` against ``t + 2``), and ops
# that no saved tensor was computed from (backward never reads those).
class History:
    """The walk of the NOTE above for one run of the region: ``of(tensor)`` gives the names of the
    nodes behind ``tensor`` that this run created and that no earlier call walked."""

    def __init__(self, inputs: list, forward: range = range(0)) -> None:
        # The number the region's first node will get: everything the region creates is younger.
        self.start = torch._C._autograd._get_sequence_nr()
        # The numbers of the forward's own nodes, walked in the re-run too: autocast's cache hands
        # the re-run the forward's cast of a weight (its node) instead of casting again.
        self.forward = forward
        # The youngest node walked: with ``start``, the range of this run's nodes.
        self.last = self.start - 1
        # The inputs' nodes are where the region starts, even when another thread created them (a
        # CUDA backward re-runs on autograd's device thread, whose numbers are its own).
        self.seen = {t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}

    def numbers(self) -> range:
        """The numbers of the nodes this run created, as far as the walk went."""
        return range(self.start, self.last + 1)

    def of(self, tensor: torch.Tensor) -> tuple[str, ...]:
        names: list[str] = []
        stack = [tensor.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in self.seen:
                continue
            number = node._sequence_nr()
            # Older than the region (but the forward's own), or a leaf's AccumulateGrad (2**64 - 1).
            if number >= 2**63 or (number < self.start and number not in self.forward):
                continue
            self.last = max(self.last, number)
            self.seen.add(node)
            name = node.name()
            # Casts are walked through, not compared: autocast casts a weight once per autocast block
            # and caches it, so a re-run casts where the forward found the cast made (or the other
            # way round). A cast to another dtype shows in the saved tensors' dtypes.
            if name != "ToCopyBackward0":
                names.append(name)
            stack.extend(next_node for next_node, _ in node.next_functions)
        return tuple(names)


def recompute(frame: Frame, task: int) -> None:
    """Re-run the block, filling the still-alive handles for backward ``task``, by position."""
    # Strong references for the length of the re-run; None where backward already freed the node.
    handles = [ref() for ref in frame.handles]
    # Everything after the last live handle is not needed by anyone: that is where we stop (early
    # stop), unless the caller asked for the whole re-run.
    last_needed = max(i for i, handle in enumerate(handles) if handle is not None)
    stop_at = last_needed if frame.early_stop else None
    position = itertools.count()
    # torch's determinism check: note every live tensor whose metadata differs, raise at the end.
    mismatches: list[tuple[int, _Meta, _Meta]] = []
    # A backward inside the forward (and no early stop) re-runs more than the forward has saved yet.
    beyond_forward = [False]
    # Each tensor handed to a handle, with its version counter then: autograd skips its in-place check
    # for tensors saved through hooks, so we redo it when the re-run ends.
    stored: list[tuple[int, torch.Tensor, int]] = []
    # Unpack the inputs first: for a nested checkpoint this runs the enclosing one's re-run.
    args, kwargs = frame.inputs()
    # The nodes the re-run creates, walked as the forward's were (NOTE [ Every op is compared ]).
    history = History(tree_flatten((args, kwargs))[0], frame.forward_nodes) if frame.walk else None

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        try:
            return compare_and_store(tensor)
        except Exception as error:
            raised.append(error)  # see the except clause below
            raise

    def compare_and_store(tensor: torch.Tensor) -> torch.Tensor:
        index = next(position)
        # Detached: the handle must keep the value alive, not the recomputed graph around it. A
        # tensor that doesn't require grad has no graph: it is kept as it is, the same object.
        value = tensor.detach() if tensor.requires_grad else tensor
        if index >= len(frame.metas):
            if not frame.forward_completed:
                beyond_forward[0] = True
                return value
            raise _explained(frame, _more_saved(len(frame.metas)))
        if handles[index] is not None:
            recomputed = _Meta.of(tensor)
            if frame.check and recomputed != frame.metas[index]:
                mismatches.append((index, frame.metas[index], recomputed))
            handles[index].recomputed[task] = value
            stored.append((index, value, value._version))  # compared when the re-run ends
        # Made by another op, or through other ops: the re-run took another path; stop here, at once.
        if frame.check:
            _check_same_path(frame, index, tensor, history, mismatches)
        if index == stop_at:
            raise _StopRecomputation
        # The recomputed graph keeps its own saved tensors; it dies when the re-run returns.
        return value

    # The re-run is the region too: a scope opened in it must do nothing here either (a re-run
    # outside backward, for ``grad_fn._saved_result``, is not inside backward).
    pack.recomputes_region = True  # type: ignore[attr-defined]
    raised: list[Exception] = []

    try:
        # Grad mode on (backward runs with it off), or the ops would save nothing for us to capture.
        with (
            frame.replay.replay(),
            torch.enable_grad(),
            _checkpoint_hooks(pack, lambda value: value),
            frame.device_context,
            frame.recompute_context,
            recomputing(),
            frame.state.rerun() if frame.state else contextlib.nullcontext(),
        ):
            frame.function(*args, **kwargs)
    except Exception as error:
        # A TorchScript function re-raises a hook's exception as a bare RuntimeError of its own
        # (empty message): what our hook raised is the real one, the stop included. (Popped, not
        # kept: a kept exception would hold the re-run's frames, and its tensors, in a cycle.)
        hooks = raised.pop() if raised else None
        if hooks is error:
            hooks = None
        if hooks is None and not isinstance(error, _StopRecomputation):
            raise
        if hooks is not None and not isinstance(hooks, _StopRecomputation):
            raise hooks from None
        hooks = None
    else:
        saved = next(position)
        if saved < len(frame.metas) and not beyond_forward[0]:
            raise _explained(frame, _count_mismatch(len(frame.metas), saved))
    finally:
        # The re-run's graph holds this pack hook, which holds ``history``: its nodes must go, or
        # they and the graph would keep each other alive through C++, out of the collector's sight.
        if history is not None:
            history.seen.clear()
    if mismatches:
        raise _explained(frame, _metadata_mismatch(mismatches))
    for index, value, version in stored:
        if value._version != version:  # an op after the one that saved it modified it in place
            raise _explained(frame, _modified_in_place(frame, index, value, version), in_place=True)


# ============================================================================================
# Behind the mechanism: torch's keywords, the errors, debug=True, torch 2.14's additions
# ============================================================================================
def _watch_state(frame: Frame, keywords: _Keywords, function: Any, args: tuple, kwargs: dict) -> None:
    """Before the forward: the module state it starts from, when ``state_check`` asks for it."""
    if keywords.state_check != "none":
        frame.state = StateGuard(keywords.state_check, function, args, kwargs, _user_line())


def _forward_ended(frame: Frame) -> None:
    """The forward's nodes are known by their names in ``histories`` now: let go of them (the graph
    holds our hooks, which hold the frame: nodes kept here would be a cycle through C++ that Python's
    collector cannot see)."""
    if frame.history is not None:
        frame.forward_nodes = frame.history.numbers()
    frame.history = None


def _check_same_path(frame: Frame, index: int, tensor: torch.Tensor, history: Any, mismatches: list) -> None:
    """The re-run's saved tensor ``index`` must come from the op that made the forward's, through the
    same autograd nodes (NOTE [ Every op is compared ]): raise where it did not, at once."""
    if made_by(tensor) != frame.makers[index]:
        raise _explained(frame, _other_op(index, frame.makers[index], made_by(tensor), mismatches))
    ran = history.of(tensor) if history else ()
    if ran != frame.histories[index]:
        raise _explained(frame, _other_history(index, frame, ran, mismatches))


# torch's private API this checkpoint can't do without (ckpt_lab/torch_private.py lists each use):
# on a torch without it, a clear error now, at import, rather than an AttributeError inside backward.
for _path in ("torch._C._current_graph_task_id", "torch._C._autograd._top_saved_tensors_default_hooks"):
    if optional(_path) is None:
        raise missing_error(_path, "ckpt_lab.checkpoint (non-reentrant)")

# None: each call's keyword decides; True/False: the context managers below override it.
_early_stop_override: bool | None = None
_debug_override: bool | None = None
# torch's values for ``determinism_check``: compare (torch: shape, dtype, device; ours: and the op
# that made each tensor, and the nodes on the way to it); or compare nothing.
_DETERMINISM_CHECKS = ("default", "none")
# Ours besides: compare shape, dtype, device and the maker, not the nodes on the way (NOTE [ Every
# op is compared ]: the walk costs 12-19% of a step on regions of many tiny ops).
_MAKERS_ONLY = "makers"


@contextlib.contextmanager
def set_checkpoint_early_stop(enable: bool) -> Iterator[None]:
    """Within this block, every checkpoint's forward takes ``early_stop=enable``, whatever it was passed.

    torch's context manager of the same name: only the forward needs to run inside it (the setting is
    stored with the checkpoint); the innermost block wins.
    """
    global _early_stop_override
    previous, _early_stop_override = _early_stop_override, enable
    try:
        yield
    finally:
        _early_stop_override = previous


@contextlib.contextmanager
def set_checkpoint_debug_enabled(enabled: bool | None) -> Iterator[None]:
    """Within this block, every checkpoint takes ``debug=enabled``; ``None`` defers to each call's keyword.

    torch's context manager of the same name.
    """
    global _debug_override
    previous, _debug_override = _debug_override, enabled
    try:
        yield
    finally:
        _debug_override = previous


def check_use_reentrant(use_reentrant: Any, caller: str) -> None:
    """Accept torch's ``use_reentrant=False``; refuse anything else, saying where the reentrant one is.

    Without this parameter, a call written for torch (``checkpoint(f, x, use_reentrant=False)``)
    would pass the keyword on to ``f``, and the ``TypeError`` would blame the user's function.
    """
    if use_reentrant is False:
        return
    if use_reentrant is None:
        # torch's own default; in torch 2.13 it warns and then runs the reentrant variant.
        asked = "use_reentrant=None (torch's default, which means the reentrant variant)"
    else:
        asked = f"use_reentrant={use_reentrant!r}"
    raise ValueError(
        f"{caller}: got {asked}, but ckpt_lab.{caller} is the non-reentrant checkpoint. Pass "
        "use_reentrant=False or leave it out; for the reentrant variant call "
        "ckpt_lab.reentrant_checkpoint(function, *args) instead."
    )


@dataclass
class _Keywords:
    """torch's keywords of one call, checked, with the global overrides applied."""

    check: bool = True
    # The nodes on the way to each saved tensor compared too (NOTE [ Every op is compared ]).
    walk: bool = True
    early_stop: bool = True
    debug_log: _DebugLog | None = None
    context_fn: Callable[[], tuple[Any, Any]] | None = None
    respect_saved_tensors_hooks: bool | None = None
    state_check: str = "none"

    @classmethod
    def resolve(
        cls,
        caller: str,
        function: Any,
        *,
        preserve_rng_state: bool,
        context_fn: Callable[[], tuple[Any, Any]] | None,
        determinism_check: str,
        debug: bool,
        early_stop: bool,
        use_reentrant: Any,
        respect_saved_tensors_hooks: bool | None,
        state_check: str = "none",
    ) -> _Keywords:
        check_use_reentrant(use_reentrant, caller)
        if state_check not in STATE_CHECKS:
            raise ValueError(
                f"{caller}: state_check should be one of {list(STATE_CHECKS)}, but got {state_check!r}. "
                '"warn" and "raise" name the module state that changed between the forward and the '
                're-run; "restore" puts the forward\'s state back for the re-run.'
            )
        if not callable(function):
            raise TypeError(
                f"{caller}: the first argument must be the function to checkpoint, got "
                f"{type(function).__name__}: call {caller}(function, *args), or "
                f"{caller}(**keywords)(function)."
            )
        if determinism_check not in (*_DETERMINISM_CHECKS, _MAKERS_ONLY):
            raise ValueError(
                f"{caller}: determinism_check should be one of {list(_DETERMINISM_CHECKS)}, but got "
                f'{determinism_check}. "default" compares shape, dtype and device of every recomputed '
                "tensor with the forward's, the op that made it and the ops on the way to it; "
                f'"none" compares nothing; ckpt_lab also takes "{_MAKERS_ONLY}": all but the ops on '
                "the way."
            )
        debug = _debug_override if _debug_override is not None else debug
        if (
            determinism_check == "default" and not debug and context_fn in _NOOP_CONTEXT_FNS
            and respect_saved_tensors_hooks is None and _early_stop_override is None and early_stop
            and state_check == "none"
        ):  # fmt: skip
            return _DEFAULT_KEYWORDS  # the common call: nothing to build
        keywords = cls(
            check=determinism_check != "none",
            walk=determinism_check == "default",
            early_stop=_early_stop_override if _early_stop_override is not None else early_stop,
            context_fn=context_fn,
            respect_saved_tensors_hooks=respect_saved_tensors_hooks,
            state_check=state_check,
        )
        if debug:
            if context_fn not in (None, noop_context_fn, _torch_checkpoint.noop_context_fn):
                raise ValueError(
                    f"{caller}: debug=True is incompatible with non-default context_fn. debug records "
                    "the ops through a context of its own; drop one of the two."
                )
            keywords.debug_log = _DebugLog()
            keywords.context_fn = keywords.debug_log.contexts
        return keywords

    def contexts(self) -> tuple[Any, Any]:
        """``context_fn()``'s pair; its forward context learns ``respect_saved_tensors_hooks``."""
        forward, recompute = self.context_fn() if self.context_fn else noop_context_fn()
        # As torch 2.14 does for its selective mode: set after construction, where the mode has it
        # (unless left at None: a value given to ``selective_checkpoint_contexts`` stands).
        if self.respect_saved_tensors_hooks is not None and hasattr(forward, "respect_saved_tensors_hooks"):
            forward.respect_saved_tensors_hooks = self.respect_saved_tensors_hooks
        return forward, recompute


# Ours, and torch's default passed explicitly (as torch's own tests do): both mean no contexts.
_NOOP_CONTEXT_FNS = (noop_context_fn, _torch_checkpoint.noop_context_fn)
# Shared by every call that passes no keyword of its own (never modified).
_DEFAULT_KEYWORDS = _Keywords(context_fn=noop_context_fn)


class _Configured:
    """torch 2.14's configured form: ``checkpoint(**keywords)`` is a decorator, ``checkpoint(**keywords)(fn)``
    a function that checkpoints ``fn`` on every call, and a method when it decorates one."""

    def __init__(self, entry: Callable[..., Any], function: Callable[..., Any], keywords: dict) -> None:
        self.entry, self.function, self.keywords = entry, function, keywords
        functools.update_wrapper(self, function, updated=())

    @classmethod
    def decorator(cls, entry: Callable[..., Any], keywords: dict, extra: dict) -> Callable[..., Any]:
        if extra:
            # torch's sentence for keywords it does not know; checked now, not at the first call.
            raise ValueError(
                "Unexpected keyword arguments: " + ",".join(extra) + f". {entry.__name__}(**keywords) "
                "configures a checkpoint, and takes only its keywords: pass the function's keyword "
                "arguments in each call instead."
            )
        _Keywords.resolve(entry.__name__, len, **keywords)  # refuse bad keywords at once

        def configured(function: Callable[..., Any], *args: Any) -> _Configured:
            if args:
                # ``checkpoint(use_reentrant=False)(fn, x)``: the arguments went to the decorator.
                raise TypeError(
                    f"{entry.__name__}(**keywords) returns a decorator, which takes the function alone; "
                    f"it got {1 + len(args)} arguments. Call {entry.__name__}(**keywords)(function)(*args), "
                    f"or {entry.__name__}(function, *args, **keywords)."
                )
            return cls(entry, function, keywords)

        return configured

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.entry(self.function, *args, **self.keywords, **kwargs)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        # As a method decorator: bind the function to the instance, keep the keywords.
        get = getattr(self.function, "__get__", None)
        if instance is None or get is None:
            return self
        return type(self)(self.entry, get(instance, owner), self.keywords)


def _device_context() -> contextlib.AbstractContextManager:
    """The innermost ``with torch.device(...)`` around the forward, to re-enter for the recomputation.

    A CUDA backward runs on autograd's device thread, where the caller's ``torch.device`` block is not
    active: without this, ``torch.empty(4)`` in the re-run would land on the CPU.
    """
    _get_current_function_mode_stack = optional("torch.overrides._get_current_function_mode_stack")
    DeviceContext = optional("torch.utils._device.DeviceContext")
    if _get_current_function_mode_stack is None or DeviceContext is None:
        # A torch without them: no device block is re-entered. A factory call without a device then
        # makes the re-run differ, which the determinism check reports (torch's checkpoint does the same).
        return contextlib.nullcontext()

    modes = [m for m in _get_current_function_mode_stack() if isinstance(m, DeviceContext)]
    # A fresh context on the same device, not the forward's instance: entering that one again in the
    # re-run overwrites what its own exit puts back (torch.utils._device.CURRENT_DEVICE), and the
    # default device set by torch.set_default_device outlived the caller's set_default_device(None)
    # (torch fixed the same in its checkpoint in 2.14).
    return DeviceContext(modes[-1].device) if modes else contextlib.nullcontext()


# NOTE [ Our hooks and the user's ]
# torch 2.14 marks a checkpoint's own pack hooks ``_checkpoint_internal`` and, while they are on the
# hooks stack, hangs on them the pair that was on top before (``_user_hooks``): so a selective
# checkpoint's mode can find the *user's* hooks (``save_on_cpu``) under any number of checkpoints.
# Ours follow the same protocol, so that torch 2.14's selective mode inside our checkpoint and ours
# inside torch's find the same hooks. The attribute is cleared on exit: the graph keeps the pack
# hook, and a lasting reference from it to the user's hooks could make a cycle the collector cannot
# see (torch's reason too).
def _checkpoint_hooks(pack: Callable[..., Any], unpack: Callable[..., Any]) -> saved_tensors_hooks:
    """``saved_tensors_hooks(pack, unpack)``, marked as a checkpoint's own (the NOTE above)."""
    pack._checkpoint_internal = True  # type: ignore[attr-defined]
    user = user_saved_tensors_hooks()
    if user is None:
        # The common case costs two attributes: nothing to hang, nothing to take down.
        pack._user_hooks = None  # type: ignore[attr-defined]
        return saved_tensors_hooks(pack, unpack)
    return _WithUserHooks(pack, unpack, user)


class _WithUserHooks(saved_tensors_hooks):
    """Our hooks over the user's: ``_user_hooks`` names them while ours are on the stack."""

    def __init__(self, pack: Callable[..., Any], unpack: Callable[..., Any], user: tuple) -> None:
        super().__init__(pack, unpack)
        self.user = user

    def __enter__(self) -> None:
        self.pack_hook._user_hooks = self.user  # type: ignore[attr-defined]
        super().__enter__()

    def __exit__(self, *args: object) -> None:
        self.pack_hook._user_hooks = None  # type: ignore[attr-defined]
        super().__exit__(*args)


def user_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The ``(pack, unpack)`` pair of the innermost user ``saved_tensors_hooks`` (``save_on_cpu``,
    ``offload_to_cpu``), skipping checkpoints' own hooks; ``None`` if there is none.

    torch 2.13's own checkpoint hooks don't say whose hooks they cover: below one, ``None``.
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    while hooks is not None and getattr(hooks[0], "_checkpoint_internal", False):
        hooks = getattr(hooks[0], "_user_hooks", None)
    if hooks is not None and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint":
        return None
    return hooks


_ADVICE = (
    "The checkpointed function must save the same tensors when backward re-runs it: don't branch on "
    "Python state that changes between calls (counters, flags, the step number, Python's random), "
    "keep preserve_rng_state=True if it draws random numbers, and don't modify its inputs in place. "
    "If it cannot be made deterministic, don't checkpoint it."
)
_DEBUG_TIP = (
    "To see the ops of the forward and of the recomputation side by side, pass debug=True to "
    "ckpt_lab.checkpoint or wrap the call in `with ckpt_lab.set_checkpoint_debug_enabled(True):`."
)


def _unpacked_twice() -> CheckpointError:
    return CheckpointError(
        "checkpoint: Unpack is being triggered for a tensor that was already unpacked once. If you are "
        "calling ctx.saved_tensors in backward, make sure to do so only once. A recomputed tensor is "
        "handed out once per backward and then forgotten, so that backward can free it: read "
        "ctx.saved_tensors once, into a variable."
    )


def _more_saved(forward: int) -> CheckpointError:
    return CheckpointError(
        "checkpoint: trying to save more tensors during recomputation than during the original "
        f"forward pass. The forward saved {forward} tensors for backward; the recomputation went on to "
        f"save one more. {_ADVICE}\n{_DEBUG_TIP}"
    )


def _count_mismatch(forward: int, recomputed: int) -> CheckpointError:
    return CheckpointError(
        "checkpoint: A different number of tensors was saved during the original forward and "
        f"recomputation.\nNumber of tensors saved during forward: {forward}\nNumber of tensors saved "
        f"during recomputation: {recomputed}.\nThe recomputation returned before saving every tensor "
        f"backward needs. {_ADVICE}\n{_DEBUG_TIP}"
    )


def _metadata_mismatch(mismatches: list[tuple[int, _Meta, _Meta]], then: str = "") -> CheckpointError:
    tensors = "".join(
        f"tensor at position {index}: saved metadata: {saved}; recomputed metadata: {recomputed}\n"
        for index, saved, recomputed in mismatches
    )
    return CheckpointError(
        "checkpoint: Recomputed values for the following tensors have different metadata than during "
        f"the forward pass.\n{tensors}{then}Backward would compute wrong gradients with these tensors. "
        f"{_ADVICE}\n{_DEBUG_TIP}"
    )


def _other_op(
    index: int, forward: str, rerun: str, mismatches: list[tuple[int, _Meta, _Meta]]
) -> CheckpointError:
    """Ours (torch has no such check): the same position was saved by another op in the re-run."""
    where = _user_line()
    differs = (
        f"saved tensor {index} was made by {_op_name(forward)} in the forward and by "
        f"{_op_name(rerun)} in the re-run, at {where}."
    )
    if mismatches:
        # torch's error for the metadata comes first; the op says where the paths parted.
        return _metadata_mismatch(mismatches, then=f"The re-run took another path: {differs}\n")
    return CheckpointError(
        f"checkpoint: the recomputation took another path than the forward: {differs} Shapes, dtypes "
        f"and devices agree, so torch's determinism check would let it through, with wrong "
        f"gradients. {_ADVICE}\n{_DEBUG_TIP}"
    )


def _other_history(
    index: int, frame: Frame, ran: tuple[str, ...], mismatches: list[tuple[int, _Meta, _Meta]]
) -> CheckpointError:
    """Ours (torch has no such check): the same op saved the tensor at this position, but the re-run
    computed it through other ops (NOTE [ Every op is compared ])."""
    forward = frame.histories[index]
    # The first node the two walks disagree on (a walk that ended early has "nothing" there).
    at = next(i for i in range(max(len(forward), len(ran))) if forward[i : i + 1] != ran[i : i + 1])

    def op(names: tuple[str, ...]) -> str:
        return _op_name(names[at]) if at < len(names) else "no op"

    differs = (
        f"saved tensor {index} (made by {_op_name(frame.makers[index])} in both) was computed through "
        f"{op(forward)} in the forward and through {op(ran)} in the re-run; the re-run saved it at "
        f"{_user_line()}."
    )
    if mismatches:
        return _metadata_mismatch(mismatches, then=f"The re-run took another path: {differs}\n")
    return CheckpointError(
        f"checkpoint: the recomputation took another path than the forward: {differs} Shapes, dtypes "
        f"and devices agree, so torch's determinism check would let it through, with wrong "
        f"gradients. {_ADVICE}\n{_DEBUG_TIP}"
    )


def _modified_in_place(frame: Frame, index: int, tensor: torch.Tensor, saved_version: int) -> CheckpointError:
    """Autograd's error for a saved tensor modified in place (its sentence from ``SavedVariable::unpack``,
    without the clause on the tensor's grad_fn, which a recomputed tensor has not, and without its
    hint: anomaly mode would point at whichever node's unpack ran the re-run), then ours."""
    made = f" (made by {_op_name(frame.makers[index])})" if frame.check else ""
    return CheckpointError(
        "checkpoint: one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; "
        f"expected version {saved_version} instead. The recomputation modified saved tensor {index}"
        f"{made} in place after an op had saved it for backward. Without a checkpoint autograd raises "
        "this error; a checkpoint's saved tensors go through saved-tensor hooks, which autograd does not "
        "check, and backward would use the modified values: wrong gradients. Write the in-place op out "
        "of place (y = y + 1, not y.add_(1)), or modify a clone. (early_stop=True hands back the right "
        f"tensor only while the re-run stops before the in-place op.)\n{_DEBUG_TIP}"
    )


def _op_name(maker: str) -> str:
    """``SinBackward0`` -> ``aten.sin``, where an aten op of that name exists; else the node's name."""
    if maker in ("leaf", "no grad"):
        return f"no op (a {'leaf that requires grad' if maker == 'leaf' else 'tensor without grad'})"
    stem = maker.removesuffix("Backward").rstrip("0123456789").removesuffix("Backward")
    snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in stem).lstrip("_")
    # Private aten ops lose their leading underscore in the node's name (_to_copy: ToCopyBackward0).
    found = [name for name in (snake, f"_{snake}") if hasattr(torch.ops.aten, name)]
    return f"aten.{found[0]}" if found else f"the op behind {maker}"


# The files whose frames are checkpointing machinery: the user's line is the innermost frame elsewhere.
_TORCH_DIR = os.path.dirname(torch.__file__)
_MACHINERY = {
    os.path.join(os.path.dirname(__file__), name)
    for name in ("nonreentrant.py", "selective.py", "reentrant.py", "rng.py", "_eager.py", "sequential.py")
}


def _user_line() -> str:
    """``file:line in function`` of the innermost frame of the user's code (not torch, not ours); in a
    notebook, ``line N of a notebook cell, in function``."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_TORCH_DIR) and filename not in _MACHINERY:
            # A Jupyter cell's file is a temporary name (ipykernel_<pid>/<hash>.py): say what it is.
            if "ipykernel_" in filename:
                return f"line {frame.f_lineno} of a notebook cell, in {frame.f_code.co_name}"
            return f"{os.path.basename(filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


# -------------------------------------------------------------------------------------- debug=True
class _OpRecorder(TorchDispatchMode):
    """Records each aten op that runs (but ``detach``, which checkpointing adds itself) and the line of
    user code that ran it: the innermost frame outside torch and this file."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is not torch.ops.aten.detach.default:
            self.ops.append((str(func), _user_line()))
        return func(*args, **(kwargs or {}))


# torch's sentence for an error under debug=True (the error template in torch/utils/checkpoint.py).
_DEBUG_SENTENCE = (
    "You are seeing this error because you passed `debug=True` to checkpoint and tensors to be saved "
    "during the original forward and differ between those saved during recomputation."
)


class _DebugLog:
    """``debug=True``: one recorder around the forward, a fresh one around each recomputation."""

    def __init__(self) -> None:
        self.forward = _OpRecorder()
        self.recompute = _OpRecorder()

    def contexts(self) -> tuple[_OpRecorder, contextlib.AbstractContextManager]:
        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            self.recompute = _OpRecorder()
            with self.recompute:
                yield

        return self.forward, _Reusable(recompute)

    def explain(self, error: CheckpointError, in_place: bool = False) -> CheckpointError:
        rows = itertools.zip_longest(self.forward.ops, self.recompute.ops, fillvalue=("", ""))
        width = max([len(f"{op}  ({line})") for op, line in self.forward.ops] + [len("forward")])
        lines, marked = [], False
        for i, (fwd, rec) in enumerate(rows):
            left = f"{fwd[0]}  ({fwd[1]})" if fwd[0] else ""
            right = f"{rec[0]}  ({rec[1]})" if rec[0] else ""
            mark = ""
            if not marked and fwd[0] != rec[0] and rec[0]:
                mark, marked = "   <-- first difference", True
            elif in_place and _writes_in_place(rec[0]):
                mark = "   <-- in place"
            lines.append(f"{i:>4}  {left:<{width}}  {right}{mark}")
        header = f"{'#':>4}  {'forward':<{width}}  recomputation"
        return CheckpointError(
            f"{_DEBUG_SENTENCE} (set_checkpoint_debug_enabled(True) counts as passing it.)\n"
            f"{str(error).replace(_DEBUG_TIP, '').rstrip()}\n\n"
            "The aten ops that ran in the original forward and in the recomputation, side by side "
            "(detach left out: checkpointing adds those itself; the recomputation may end early, "
            "where it had recomputed everything backward needs):\n" + "\n".join([header, *lines])
        )


def _writes_in_place(op: str) -> bool:
    """Whether the op named ``op`` (``aten.add_.Tensor``, ``aten.sin.out``) writes into a tensor."""
    parts = op.split(".")
    return len(parts) == 3 and (parts[1].endswith("_") or parts[2].startswith("out"))


class _Reusable:
    """A context manager that can be entered again each time (one recomputation per backward)."""

    def __init__(self, factory: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.factory = factory
        self.active: list[contextlib.AbstractContextManager] = []

    def __enter__(self) -> None:
        context = self.factory()
        self.active.append(context)
        context.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.active.pop().__exit__(*exc)


def _explained(frame: Frame, error: CheckpointError, in_place: bool = False) -> CheckpointError:
    """The error, with the op logs of forward and recomputation side by side if ``debug=True``
    (``in_place``: the recomputation's in-place ops marked, one of them is the culprit)."""
    return error if frame.debug_log is None else frame.debug_log.explain(error, in_place)


# The names these had before they were public (a copy of older code may still use them).
_Frame, _Handle = Frame, Handle
_pack_to_handle, _unpack_from_handle, _recompute = pack_to_handle, unpack_from_handle, recompute
