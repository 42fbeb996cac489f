"""Selective checkpointing: a policy decides, op by op, what the forward keeps and what backward redoes.

Introduced in notebook 05. Same idea as ``torch.utils.checkpoint.checkpoint(fn, *args,
use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, policy))``, built on
this project's non-reentrant checkpoint (notebook 03b) and two ``TorchDispatchMode``s:

* **forward** (``SaveMode``): every aten op runs as usual; then the policy is asked about it, and if
  it says *save*, a detached alias of the op's output goes into the frame's cache. The cache is the
  only extra memory: autograd's own saved tensors are still handles (notebook 03b).
* **recomputation** (``ServeMode``): the function runs again, op by op, each checked against the
  forward's op at the same position. An op whose output is in the cache is *not run*: the cached
  tensor comes back instead. Every other op runs.

The policy has torch's signature, ``policy(ctx, op, *args, **kwargs)``, and may answer with torch's
``CheckpointPolicy``, a ``bool`` (``True`` = save) or a list of ops to save, so one policy drives
both implementations. Three kinds of op always run again whatever the policy says, because skipping
them would change what the re-run computes:

* ops that **modify an input in place** (``relu_``, ``bernoulli_``): the re-run's own input must be
  modified, not replaced by a cached copy;
* **views** (``t``, ``view``, ``expand``): they cost nothing and must alias the re-run's tensors;
* **random ops** (``rand_like``, ``native_dropout``): skipping one leaves the generator behind, and
  every random op after it would draw different numbers. torch 2.13's eager SAC does skip them,
  and gives silently wrong gradients for a function that saves one random op and recomputes a later
  one (shown in notebook 05, tested in ``tests/test_selective.py``).

Behind the banner: what a policy may answer and the errors for what it may not; autocast's weight
casts, which run again *and* are left out of the op-by-op check (NOTE [ Autocast's weight casts ]);
``strict=True``; enclosing ``saved_tensors_hooks`` (``respect_saved_tensors_hooks``, torch 2.14's
keyword); the ``torch.compile`` fallback.

Two cases where torch's SAC raises, ours by default recomputes (correct gradients, at the cost of
the op's FLOPs once more): a cached output modified in place after it was cached ("has been
mutated"), and a second backward through the same checkpoint (``retain_graph=True``, "Trying to
backward an extra time"). ``strict=True`` gives torch's errors instead (notebook 05 compares them).
``selective_checkpoint_contexts(policy)`` is the pair of contexts on its own, a ``context_fn`` for
``ckpt_lab.checkpoint`` -- the counterpart of torch's ``create_selective_checkpoint_contexts``.
"""

from __future__ import annotations

import enum
import itertools
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy

from ckpt_lab._aten import is_view, tensors_in
from ckpt_lab._eager import run_eagerly
from ckpt_lab.errors import CheckpointError, missing_error, optional
from ckpt_lab.nonreentrant import _user_line, check_use_reentrant, checkpoint, user_saved_tensors_hooks

__all__ = [
    "RECOMPUTE",
    "SAVE",
    "Decision",
    "OpContext",
    "OpListError",
    "Policy",
    "PolicyError",
    "SaveMode",
    "ServeMode",
    "is_autocast_weight_cast",
    "is_view",
    "must_rerun",
    "save_ops",
    "selective_checkpoint",
    "selective_checkpoint_contexts",
]


class Decision(enum.Enum):
    """What to do with one op's output: keep it from the forward, or compute it again in backward."""

    SAVE = "save"
    RECOMPUTE = "recompute"


SAVE = Decision.SAVE
RECOMPUTE = Decision.RECOMPUTE


@dataclass(frozen=True)
class OpContext:
    """What the policy gets as ``ctx``: torch's ``SelectiveCheckpointContext`` fields, plus ``index``."""

    # Position of the op among those the policy is asked about (0, 1, 2, ... in forward order).
    index: int
    op_output: Any
    # torch's field; the policy is only ever asked during the forward, so always False.
    is_recompute: bool = False


Policy = Callable[..., Decision | CheckpointPolicy | bool]


def selective_checkpoint(
    function: Callable[..., Any],
    *args: Any,
    policy: Policy | Sequence[torch._ops.OpOverload],
    preserve_rng_state: bool = True,
    use_reentrant: bool = False,
    strict: bool = False,
    respect_saved_tensors_hooks: bool | None = None,
    **kwargs: Any,
) -> Any:
    """``ckpt_lab.checkpoint(function, *args, **kwargs)`` that keeps the outputs ``policy`` saves.

    ``policy(ctx, op, *args, **kwargs)`` is asked once per aten op in the forward and answers SAVE or
    RECOMPUTE (or a torch ``CheckpointPolicy``, or a bool); a list of ops means "save these".
    Backward re-runs the function, serving saved outputs instead of running their ops, each once:
    like torch's SAC, a served output is freed as soon as backward has used it. Unlike torch's SAC,
    backward may run more than once (``retain_graph=True``): later backwards recompute those ops.
    A cached output that an in-place op modified after it was cached is dropped, and its op runs
    again. ``strict=True`` is torch's behaviour instead: both cases raise (see the module docstring).

    Enclosing ``saved_tensors_hooks`` (``torch.autograd.graph.save_on_cpu``,
    ``ckpt_lab.offload.offload_to_cpu``): the tensors autograd saves are the checkpoint's handles,
    and the block's inputs go through the enclosing hooks as always. The outputs the policy saves
    live in the checkpoint's cache, outside autograd: with ``respect_saved_tensors_hooks=None`` (the
    default) or ``False`` they bypass the hooks (they stay where they are, as torch's SAC keeps
    them through 2.14); with ``True`` each goes through the hooks' pack when cached and their unpack
    when served, as torch 2.14 does with ``True``. Unlike torch 2.14, ``None`` does not warn: ours
    keeps this default.

    ``use_reentrant`` is accepted as in torch's call (where SAC needs ``use_reentrant=False``), so
    this drops in for it; any other value is refused, and is never passed on to ``function``; nor
    are ``policy``, ``strict`` and ``respect_saved_tensors_hooks``.
    """
    if torch.compiler.is_compiling():
        # NOTE [ Checkpoints under torch.compile ] (ckpt_lab.compiled): a graph break, then eager.
        return run_eagerly(
            selective_checkpoint, function, *args, policy=policy, preserve_rng_state=preserve_rng_state,
            use_reentrant=use_reentrant, strict=strict,
            respect_saved_tensors_hooks=respect_saved_tensors_hooks, **kwargs,
        )  # fmt: skip
    check_use_reentrant(use_reentrant, "selective_checkpoint")
    contexts = selective_checkpoint_contexts(
        policy, strict=strict, respect_saved_tensors_hooks=respect_saved_tensors_hooks
    )
    return checkpoint(
        function, *args, preserve_rng_state=preserve_rng_state, context_fn=lambda: contexts, **kwargs
    )


def selective_checkpoint_contexts(
    policy: Policy | Sequence[torch._ops.OpOverload],
    *,
    strict: bool = False,
    respect_saved_tensors_hooks: bool | None = None,
) -> tuple[SaveMode, ServeMode]:
    """The two contexts of a selective checkpoint: ``(forward, recomputation)``, one call's worth.

    ``functools.partial(selective_checkpoint_contexts, policy)`` is a ``context_fn`` for
    ``ckpt_lab.checkpoint`` (or torch's non-reentrant checkpoint): ``checkpoint(f, x,
    context_fn=partial(selective_checkpoint_contexts, policy))`` is ``selective_checkpoint(f, x,
    policy=policy)``. Our counterpart of torch's ``create_selective_checkpoint_contexts``: the
    policy is the same; ``strict=True`` is torch's default behaviour (``allow_cache_entry_mutation=False``),
    ``strict=False`` ours (see the module docstring). ``respect_saved_tensors_hooks``: see
    ``selective_checkpoint``; a checkpoint's own keyword of that name, when not ``None``, overrides it
    (torch 2.14 sets it on the forward context the same way).
    """
    _check_torch()  # the private names _alias needs, behind the banner
    chosen = save_ops(policy) if isinstance(policy, (list, tuple)) else policy
    if not callable(chosen):
        raise TypeError(
            "selective_checkpoint: policy_fn_or_list must be either a function or a list of ops. "
            f"Got {policy!r}."
        )
    # A function the user wrote is watched: NOTE [ A policy that saves nothing ].
    cache = _Cache(_Watched(chosen) if isinstance(policy, types.FunctionType) else chosen, strict=strict)
    save = SaveMode(cache)
    save.respect_saved_tensors_hooks = respect_saved_tensors_hooks
    return save, ServeMode(cache)


def save_ops(ops: Sequence[torch._ops.OpOverload]) -> Policy:
    """The policy "save the outputs of these ops, recompute the rest" (torch accepts the bare list)."""
    wanted = set(_checked_ops(ops))

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return SAVE if op in wanted else RECOMPUTE

    return policy


def must_rerun(op: torch._ops.OpOverload, args: Any, kwargs: Any, out: Any) -> bool:
    """True for ops a recomputation must run again whatever the policy says: in-place, view, random.

    (And ops that return no tensor: there is nothing to keep; and autocast's weight casts, see
    NOTE [ Autocast's weight casts ].)
    """
    if op._schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags:
        return True
    return not tensors_in(out) or is_view(op, args, kwargs, out) or is_autocast_weight_cast(op, args, kwargs)


class SaveMode(TorchDispatchMode):
    """Forward: run each op, ask the policy, keep the outputs it wants saved."""

    def __init__(self, cache: _Cache) -> None:
        super().__init__()
        self.cache = cache
        # Whether a saved output goes through the enclosing saved_tensors_hooks (torch 2.14's keyword).
        self.respect_saved_tensors_hooks: bool | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # The same ops torch leaves out (detach, metadata queries): they differ between runs.
        if func in SAC_IGNORED_OPS:
            return out
        index = len(self.cache.ops)
        self.cache.ops.append(func)
        if not is_autocast_weight_cast(func, args, kwargs):
            self.cache.replayed.append(index)
        decision = _ask(self.cache.policy, index, out, func, args, kwargs)
        if decision is SAVE and not must_rerun(func, args, kwargs, out):
            hooks = user_saved_tensors_hooks() if self.respect_saved_tensors_hooks else None
            # Detached aliases sharing the output's version counter: an in-place op on a cached
            # tensor would change what backward gets back, so serving it later must notice.
            self.cache.entries[index] = _Entry.of(out, hooks)
        return out

    def __exit__(self, *args: Any) -> Any:
        # An output that a later op modified in place (``empty_like`` filled by ``bernoulli_``) can't
        # be served; drop it now rather than keep its memory until backward. (Strict mode keeps it,
        # to raise when backward wants it, as torch does.)
        if not self.cache.strict:
            self.cache.entries = {i: e for i, e in self.cache.entries.items() if not e.modified}
        policy = self.cache.policy
        if isinstance(policy, _Watched) and not policy.saved_any and self.cache.ops:
            warnings.warn(_nothing_saved(self.cache.ops), stacklevel=2)
        return super().__exit__(*args)


@dataclass
class _Entry:
    """One cached op output: its leaves (tensors detached, or packed by the user's hooks) and the
    versions of the tensors among them when cached."""

    leaves: list[Any]
    spec: Any
    versions: list[int]
    # The enclosing hooks' unpack, for the leaves at ``packed`` (``respect_saved_tensors_hooks``).
    unpack: Callable[[Any], torch.Tensor] | None = None
    packed: frozenset[int] = frozenset()

    @classmethod
    def of(cls, out: Any, hooks: tuple[Callable[..., Any], Callable[..., Any]] | None) -> _Entry:
        leaves, spec = tree_flatten(out)
        leaves = [_alias(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        packed: frozenset[int] = frozenset()
        if hooks is not None:
            packed = frozenset(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
            leaves = [hooks[0](leaf) if i in packed else leaf for i, leaf in enumerate(leaves)]
        entry = cls(leaves, spec, versions=[], unpack=hooks[1] if hooks else None, packed=packed)
        # What the hooks packed is checked only where it is still a tensor (torch does the same).
        entry.versions = [t._version for t in entry.tensors]
        return entry

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [leaf for leaf in self.leaves if isinstance(leaf, torch.Tensor)]

    @property
    def modified(self) -> bool:
        """Has an in-place op changed a cached tensor since it was cached?"""
        return any(t._version != v for t, v in zip(self.tensors, self.versions, strict=False))

    def output(self) -> Any:
        """The op's output again, as fresh aliases: autograd attaches the re-run's history to them."""
        leaves = [self.unpack(leaf) if i in self.packed else leaf for i, leaf in enumerate(self.leaves)]
        return tree_unflatten([t.detach() if isinstance(t, torch.Tensor) else t for t in leaves], self.spec)


@dataclass
class _Cache:
    """What the forward left for the recomputations of one checkpointed call."""

    policy: Policy
    # The op at each position (the policy's ``ctx.index``).
    ops: list[Any] = field(default_factory=list)
    # The positions a recomputation must meet again, in order: all but autocast's weight casts (NOTE
    # [ Autocast's weight casts ]). The re-run is checked against them and served by them.
    replayed: list[int] = field(default_factory=list)
    entries: dict[int, _Entry] = field(default_factory=dict)
    # torch's behaviour (``strict=True``): a modified entry or a second recomputation raises.
    strict: bool = False
    # Positions served already (strict mode only needs them: a second recomputation meets one again).
    served: set[int] = field(default_factory=set)


# NOTE [ A policy that saves nothing ]
# A policy written as a function, ``op == aten.mm``, compares the overload it is shown
# (``aten.mm.default``) with a packet: never equal, so it saves nothing, and the selective checkpoint
# is a plain one, silently (a PyTorch issue on such policies; torch refuses packets only in the list
# form). So when a function policy answered "save" for none of the ops it was shown, the forward
# ends with a warning that says so and names the ops.
class _Watched:
    """A function policy, and whether it ever answered "save" (True, MUST_SAVE or PREFER_SAVE)."""

    def __init__(self, policy: Policy) -> None:
        self.policy, self.saved_any = policy, False

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        answer = self.policy(ctx, op, *args, **kwargs)
        saves = answer is True or answer in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
        self.saved_any = self.saved_any or saves
        return answer


def _nothing_saved(ops: list[Any]) -> str:
    shown = ", ".join(dict.fromkeys(str(op) for op in ops))
    return (
        f"selective_checkpoint: the policy saved none of the {len(ops)} ops it was shown ({shown}): "
        "every op is recomputed, as under a plain checkpoint. A policy that compares op with an op "
        "packet (op == torch.ops.aten.mm) matches nothing: it is shown overloads "
        "(torch.ops.aten.mm.default). Compare with the overload, or op.overloadpacket with the packet; "
        "for a policy meant to save nothing, use ckpt_lab.checkpoint."
    )


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A detached alias that shares ``tensor``'s version counter, made below autograd.

    Inside ``__torch_dispatch__`` the ADInplaceOrView key is excluded, and a plain ``detach()``
    there gives the alias a version counter of its own: it would never see a later in-place op on
    the output. Re-enabling the key makes ``detach`` share the counter (torch's ``_detach_helper``
    does the same).
    """
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return tensor.detach()


class ServeMode(TorchDispatchMode):
    """Recomputation: run each op again, except those whose output the forward cached."""

    def __init__(self, cache: _Cache) -> None:
        super().__init__()
        self.cache = cache
        self.position = itertools.count()

    def __enter__(self) -> ServeMode:
        # Every recomputation (one per backward) starts again at op 0.
        self.position = itertools.count()
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # Whether autocast runs one of its weight casts depends on its cache, not on the function:
        # see NOTE [ Autocast's weight casts ].
        if func in SAC_IGNORED_OPS or is_autocast_weight_cast(func, args, kwargs):
            return func(*args, **kwargs)
        step = next(self.position)
        # The op's position as the policy saw it in the forward; None once the re-run outruns it.
        index = self.cache.replayed[step] if step < len(self.cache.replayed) else None
        if index is None or func is not self.cache.ops[index]:
            raise _not_the_forward(self.cache, index, func)
        # Served once: from here on backward holds the only reference and frees it after use, as it
        # frees any recomputed tensor. A second backward (retain_graph=True) finds no entry and runs
        # the op again, which is always correct -- it just costs that op's FLOPs once more.
        entry = self.cache.entries.pop(index, None)
        if self.cache.strict:
            _check_strict(self.cache, index, entry)
        # Not saved (or served already), or modified in place since (no longer the op's output).
        if entry is None or entry.modified:
            return func(*args, **kwargs)
        return entry.output()


# ============================================================================================
# Behind the mechanism: policy answers, autocast's casts, strict=True, torch's messages
# ============================================================================================
def _check_torch() -> None:
    """``_alias`` re-enables ADInplaceOrView through torch's private guard: without it an in-place
    change of a cached output would go unseen, so on a torch that lacks either name, selective
    checkpointing refuses to start, naming it."""
    for path in ("torch._C._SetExcludeDispatchKeyGuard", "torch._C.DispatchKey.ADInplaceOrView"):
        if optional(path) is None:
            raise missing_error(path, "selective_checkpoint")


class OpListError(TypeError, ValueError):
    """A policy given as a list holds something that is not one aten op overload.

    Both a ``TypeError`` (what it is) and a ``ValueError`` (what torch's
    ``create_selective_checkpoint_contexts`` raises for it), so code written for either catches it.
    """


class PolicyError(RuntimeError):
    """The policy's answer is not a decision, or the policy raised a ``TypeError``.

    Not a ``TypeError`` itself: see NOTE [ Errors raised inside an operator ].
    """


# NOTE [ Errors raised inside an operator ]
# The policy is called from inside an aten op (``SaveMode.__torch_dispatch__``). When the function
# wrote that op as a Python operator -- ``t * 2.0``, ``2.0 * t``, ``t + t`` -- torch's operator
# wrapper (``_handle_torch_function_and_wrap_type_error_to_not_implemented`` in torch/_tensor.py)
# catches any ``TypeError`` and returns ``NotImplemented``; Python then tries the reflected operator
# and reports "unsupported operand type(s) for *: 'Tensor' and 'float'", which says nothing about
# the policy. So an error about the policy must not be a ``TypeError``: ``PolicyError`` is a
# ``RuntimeError``, and a ``TypeError`` the policy itself raises is re-raised as one (its cause).


def _checked_ops(ops: Sequence[Any]) -> list[torch._ops.OpOverload]:
    for op in ops:
        expected = (
            "selective_checkpoint: Expected op in `op_list` to be an OpOverload but got: "
            f"{op} of type {type(op)}."
        )
        # (On a torch without OpOverloadPacket a packet gets the general message below.)
        if isinstance(op, optional("torch._ops.OpOverloadPacket") or ()):
            raise OpListError(
                f"{expected} Please update the OpOverloadPacket to a specific OpOverload. {op} names a "
                "family of overloads; name one overload, e.g. "
                f"torch.ops.{op}.default."  # str(packet): "aten.mm", public (no _qualified_op_name)
            )
        if not isinstance(op, torch._ops.OpOverload):
            raise OpListError(f"{expected} The list must hold aten ops, e.g. torch.ops.aten.mm.default.")
    return list(ops)


def _ask(policy: Policy, index: int, out: Any, func: Any, args: Any, kwargs: Any) -> Decision:
    """The policy's decision for op ``index``, or a ``PolicyError`` saying why there is none."""
    try:
        answer = policy(OpContext(index=index, op_output=out), func, *args, **kwargs)
    except TypeError as error:
        # See NOTE [ Errors raised inside an operator ].
        raise PolicyError(
            f"selective_checkpoint: the policy raised TypeError for {func} (op {index}): {error}"
        ) from error
    return _decision(answer, func, index)


def _decision(answer: Any, op: Any, index: int) -> Decision:
    """Turn a policy's answer into a Decision, or explain why it is not one."""
    if isinstance(answer, Decision):
        return answer
    # bool before anything else: True/False are torch's shorthand for MUST_SAVE/PREFER_RECOMPUTE.
    if isinstance(answer, bool):
        return SAVE if answer else RECOMPUTE
    if answer in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
        return SAVE
    if answer in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE):
        return RECOMPUTE
    if isinstance(answer, CheckpointPolicy):
        raise PolicyError(
            f"selective_checkpoint: the policy answered {answer} for {op} (op {index}); CPU offload is "
            "not a per-op decision here. Return SAVE or RECOMPUTE for this op, and to offload, wrap the "
            "call in ckpt_lab.offload.offload_to_cpu() instead."
        )
    # The commonest mistake gets its own first sentence.
    what = "returned None" if answer is None else f"answered {answer!r}"
    raise PolicyError(
        f"selective_checkpoint: the policy {what} for {op} (op {index}), which is not a decision. "
        "Return ckpt_lab.selective.SAVE or RECOMPUTE, a torch CheckpointPolicy, or a bool (True = save). "
        "A policy that falls off its end returns None: add a final `return RECOMPUTE`."
    )


def _not_the_forward(cache: _Cache, index: int | None, func: Any) -> CheckpointError:
    """The re-run reached an op that is not the forward's at the same position."""
    if index is None:
        differs = f"The forward ran {len(cache.ops)} ops; the recomputation runs more, {func} next"
    else:
        differs = f"Op {index} was {cache.ops[index]} in the forward and is {func} in the recomputation"
    return CheckpointError(
        f"selective_checkpoint: the recomputation is not the forward. {differs}, at {_user_line()}. "
        "Make the function deterministic (no branches on Python state that changes between calls), "
        "or don't checkpoint it."
    )


# NOTE [ Autocast's weight casts ]
# Under ``torch.autocast``, an op that wants a lower-precision copy of an fp32 *leaf that requires
# grad* (a parameter, or a leaf input) casts it with ``aten._to_copy`` and keeps the copy in a cache
# until the outermost autocast exits; the next op that wants the same cast takes it from the cache
# and dispatches no op at all (``cached_cast`` in aten/src/ATen/autocast_mode.cpp). Whether a cast
# shows up as an op therefore depends on what ran earlier in the same autocast region, not on the
# function:
#
# * backward inside the forward's ``with torch.autocast(...)``: the recomputation finds every cast
#   of the forward cached and runs none of them;
# * a weight used before the checkpointed call, in the same region: the forward finds its cast
#   cached and runs none, the recomputation after the region has exited runs it.
#
# Matched op by op, both look like a recomputation that is not the forward (or, had the ops
# lined up by chance, would serve one op's output for another). So these casts (1) are left out
# of the sequence a recomputation is checked against and served from: wherever they occur, they
# simply run (or hit the cache), and (2) are never saved, like the ops of ``must_rerun``. The
# recomputed values don't change: a cached cast and a fresh one are casts of the same tensor. The
# policy is still asked about them in the forward, as torch's SAC asks.
#
# Recognised by what ``cached_cast`` caches: ``_to_copy`` of an fp32 leaf that requires grad and is
# not a view, to another floating dtype. Whether autocast is on can't be asked here (inside the op
# autocast's dispatch key is excluded, so ``torch.is_autocast_enabled()`` reads False); a user's own
# ``w.to(torch.bfloat16)`` of such a leaf is treated the same, which only means it is never saved.
def is_autocast_weight_cast(op: Any, args: Any, kwargs: Any) -> bool:
    """Is this a cast that autocast may take from its cache instead of running? See the NOTE above."""
    if op is not torch.ops.aten._to_copy.default:
        return False
    source, dtype = args[0], kwargs.get("dtype")
    return (
        source.dtype == torch.float32
        and dtype is not None
        and dtype.is_floating_point
        and dtype != torch.float32
        and source.requires_grad
        and source.is_leaf
        and not _is_a_view(source)
    )


def _is_a_view(tensor: torch.Tensor) -> bool:
    try:
        return tensor._is_view()
    except AttributeError:  # a torch without Tensor._is_view: a view is a tensor with a base
        return tensor._base is not None


def _check_strict(cache: _Cache, index: int, entry: _Entry | None) -> None:
    """``strict=True``: torch's errors where ours would run the op again."""
    if entry is None and index in cache.served:
        raise RuntimeError(
            "Trying to backward an extra time. You are only allowed to backward once on any region "
            f"computed under selective activation checkpoint. This backward wants op {index} "
            f"({cache.ops[index]}) again, whose cached output the first backward used and freed. "
            "Without strict=True selective_checkpoint runs the op again."
        )
    if entry is not None:
        cache.served.add(index)
        if entry.modified:
            raise RuntimeError(
                "Tensor cached during selective activation checkpoint has been mutated. The output of "
                f"op {index} ({cache.ops[index]}) was saved, then modified in place by a later op of "
                "the forward, so it is no longer that op's output. Without strict=True the forward "
                "drops it and backward runs the op again."
            )


# The names these had before they were public (notebook 05 and ``ckpt_lab.explain`` used them).
_SaveMode, _ServeMode = SaveMode, ServeMode
