"""An eager memory-budget planner: profile every op once, then choose which outputs to keep.

Introduced in notebook 05. torch has a memory-budget solver only under ``torch.compile``
(``torch._functorch.config.activation_memory_budget``); this one works in eager mode on top of
``ckpt_lab.selective`` and is small enough to read in one sitting:

1. **profile** (``profile``): run the function once under a ``TorchDispatchMode`` and note, for every
   op the selective policy will be asked about, the bytes of new memory its output owns and what it
   costs to compute again (FLOPs by default, measured seconds with ``cost="time"``), and how far a
   recomputation runs (the non-reentrant checkpoint stops after the op whose output is the last
   tensor autograd saved: ops after it are never recomputed, so keeping them buys nothing).
   Profiling leaves the model, the random generators and autocast's cache as it found them
   (NOTE [ Profiling leaves no trace ]).
2. **solve**: keeping op *i* costs ``nbytes[i]`` of retained memory and saves ``cost[i]`` of
   recomputation. Under a budget that is a 0/1 knapsack: ``solve_greedy`` takes the best cost per
   byte first, ``solve_dp`` is the exact dynamic program over bytes (in units of their greatest
   common divisor), ``solve_brute_force`` tries every subset (for tests, up to 20 candidates).
3. **run** (``Plan``): one ``selective_checkpoint`` per region, with a policy that saves exactly the
   chosen ops (by position) and checks that the function still runs the ops it was profiled with.

What the model leaves out, and how this relates to the literature (notebook 05 says more):

* it counts memory *retained between forward and backward*, not the peak during backward. Checkmate
  (Jain et al. 2020) schedules the whole training step with an integer program and bounds the peak;
* the plan is made once, ahead of time, for fixed shapes. DTR (Kirisame et al. 2021) decides at run
  time, evicting the tensor with the smallest cost / (bytes x staleness); ``solve_greedy`` is that
  heuristic without staleness, applied once instead of online.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy

from ckpt_lab._aten import new_storages, op_info, storage_key, storage_keys, storage_of, storages, tensors_in
from ckpt_lab.errors import CheckpointError, optional

# The cost model lives with the instruments (the benchmark counts with it too); importable from here.
from ckpt_lab.instruments.flops import CostCounter, matmul_flops, op_cost
from ckpt_lab.rng import fork_rng, tensor_devices
from ckpt_lab.selective import (
    RECOMPUTE,
    SAVE,
    Decision,
    is_autocast_weight_cast,
    must_rerun,
    selective_checkpoint,
)

__all__ = [
    "CostCounter",
    "OpRecord",
    "Plan",
    "PlanPolicy",
    "Profile",
    "TracedPlanPolicy",
    "budget_range",
    "frontier",
    "matmul_flops",
    "op_cost",
    "plan",
    "plan_sequential",
    "profile",
    "profile_sequential",
    "solve",
    "solve_brute_force",
    "solve_dp",
    "solve_greedy",
]


# ------------------------------------------------- entry points: plan a function, or a chain of blocks
def plan(
    function: Callable[..., Any],
    *args: Any,
    budget: int,
    method: str = "dp",
    cost: str = "flops",
    **kwargs: Any,
) -> Plan:
    """Profile ``function(*args, **kwargs)`` and choose what to keep within ``budget`` bytes.

    The budget covers the tensors the checkpoint keeps between forward and backward: its inputs and
    the outputs the plan keeps. ``plan(...)(*args, **kwargs)`` runs it.
    """
    return solve([profile(function, *args, cost=cost, **kwargs)], budget, method)


def plan_sequential(
    functions: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    input: torch.Tensor,
    budget: int,
    method: str = "dp",
    cost: str = "flops",
) -> Plan:
    """One region per function (e.g. per block of a stack), one budget for all of them.

    Checkpointing per block keeps each block's input (the block boundaries) and lets backward
    recompute one block at a time; the plan then spends what is left of the budget where it saves
    the most recomputation, across all blocks at once.
    """
    return solve(profile_sequential(functions, input, cost=cost), budget, method)


# ---------------------------------------------------------------------------------------- profile
@dataclass(frozen=True)
class OpRecord:
    """One op of the profiled forward, at the position the selective policy will see it."""

    index: int
    op: Any
    # Bytes of new storage its outputs own; 0 for views, in-place ops and the region's own output
    # (the caller, or the next region's checkpoint, keeps that alive anyway).
    nbytes: int
    # What computing it again costs (FLOPs, or seconds with cost="time").
    cost: float
    # In-place, view or random: runs again in every recomputation, whatever the plan says.
    rerun: bool
    # A later in-place op modifies its output (``empty_like`` before ``bernoulli_``): a kept copy
    # would not be the op's output any more, so it is recomputed.
    mutated: bool
    # A recomputation reaches it (it is at or before the op that produced the last saved tensor).
    reached: bool

    @property
    def candidate(self) -> bool:
        """Could keeping it change anything? Only if it is recomputed otherwise, and costs something."""
        return self.reached and not self.rerun and not self.mutated and self.cost > 0


@dataclass(frozen=True)
class Profile:
    """A function's ops as profiled once, plus the bytes of its tensor inputs (which it must keep)."""

    function: Callable[..., Any]
    ops: tuple[OpRecord, ...]
    input_bytes: int
    cost_unit: str

    @property
    def candidates(self) -> list[OpRecord]:
        return [r for r in self.ops if r.candidate]

    def recompute_cost(self, saved: frozenset[int]) -> float:
        """Cost of one recomputation that serves the ops in ``saved`` from memory."""
        return sum(r.cost for r in self.ops if r.reached and (not r.candidate or r.index not in saved))

    def saved_bytes(self, saved: frozenset[int]) -> int:
        return sum(self.ops[i].nbytes for i in saved)


class _ProfileMode(TorchDispatchMode):
    """Record what ``OpRecord`` needs for every op the policy would be asked about."""

    def __init__(self, cost: str, repeats: int) -> None:
        super().__init__()
        self.cost, self.repeats = cost, repeats
        self.rows: list[tuple[Any, dict[int, int], float, bool]] = []
        # Which op made each storage (the latest one with that key), and the ops whose output a
        # later in-place op modified.
        self.maker: dict[int, int] = {}
        self.mutated: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # The same ops the selective policy skips, so positions line up with it; and autocast's weight
        # casts, which the real run may take from autocast's cache instead (NOTE [ Autocast's weight
        # casts ] in selective.py): ``PlanPolicy`` counts without them.
        if func in SAC_IGNORED_OPS or is_autocast_weight_cast(func, args, kwargs):
            return out
        rerun = must_rerun(func, args, kwargs, out)
        # Bytes per new storage (a multi-output op like native_layer_norm owns several).
        nbytes = {key: storage.nbytes() for key, storage in new_storages(args, kwargs, out).items()}
        cost: float = op_cost(func, args, kwargs, out)
        if self.cost == "time":
            # In-place and random ops can't be run again just to time them (that would change their
            # input or the generator); they run in every recomputation whatever the plan, so leaving
            # them out shifts every plan's cost alike and changes no choice. Views cost nothing.
            cost = 0.0 if rerun else _seconds(func, args, kwargs, self.repeats)
        for tensor, _ in op_info(func).written(args, kwargs):
            if storage_key(tensor) in self.maker:
                self.mutated.add(self.maker[storage_key(tensor)])
        for key in nbytes:
            self.maker[key] = len(self.rows)
        self.rows.append((func, nbytes, cost, rerun))
        return out


def _seconds(func: Any, args: Any, kwargs: Any, repeats: int) -> float:
    """Median wall time of running a functional op again (on CUDA, synchronised)."""
    cuda = any(t.is_cuda for t in tensors_in((args, kwargs)))
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        func(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile(
    function: Callable[..., Any], *args: Any, cost: str = "flops", repeats: int = 5, **kwargs: Any
) -> Profile:
    """Run ``function(*args, **kwargs)`` once (with grad) and record each op's bytes and cost.

    ``cost="flops"`` is exact and the same on every machine; ``cost="time"`` times each op
    ``repeats`` more times (noisy, machine-dependent, but it sees memory-bound ops as they are;
    in-place and random ops count 0 there, see ``_ProfileMode``). The model is left as it was:
    see NOTE [ Profiling leaves no trace ].
    """
    if cost not in ("flops", "time"):
        raise ValueError(f"profile: cost must be 'flops' or 'time', not {cost!r}.")
    mode = _ProfileMode(cost, repeats)
    # The index of the op that produced the last tensor autograd saved: a recomputation stops there.
    last_pack = [-1]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        last_pack[0] = len(mode.rows) - 1
        return tensor

    # The profiling mode inside the one that undoes writes: the ops it runs again to time them (a
    # batch norm, which writes its running statistics) are undone too.
    with _leaving_no_trace(args, kwargs), torch.enable_grad():
        with saved_tensors_hooks(pack, lambda t: t), mode:
            out = function(*args, **kwargs)
    # The returned storages, each with the op that made it (by the latest maker of its key: a key is
    # an address, and an address freed earlier in the forward may have been reused since).
    returned = {(mode.maker[key], key) for key in storage_keys(tensors_in(out)) if key in mode.maker}
    ops = tuple(
        OpRecord(
            index=i,
            op=func,
            nbytes=sum(n for key, n in nbytes.items() if (i, key) not in returned),
            cost=cost_i,
            rerun=rerun,
            mutated=i in mode.mutated,
            reached=i <= last_pack[0],
        )
        for i, (func, nbytes, cost_i, rerun) in enumerate(mode.rows)
    )
    input_bytes = sum(s.nbytes() for s in storages(tensors_in((args, kwargs))).values())
    return Profile(function, ops, input_bytes, "FLOPs" if cost == "flops" else "seconds")


# NOTE [ Profiling leaves no trace ]
# Profiling runs the function once more (``profile_sequential`` twice per block), in training mode
# if the model is in it, and whatever that run changes outside the function would stay changed:
# BatchNorm's running statistics and ``num_batches_tracked`` (one batch too many), a step counter
# kept in a tensor, the random generators dropout draws from, autocast's cache of weight casts.
# ``plan()`` is a dry run, so ``_leaving_no_trace`` undoes each of them:
#
# * the CPU generator and those of the inputs' devices are forked (``fork_rng``);
# * tensors from outside written in place: ``_UndoWrites``, a dispatch mode, copies the storage of
#   each before the first op writes it (the schema says which arguments an op writes, and
#   ``_aten.op_info`` adds batch norm's unmarked writes to its running statistics) and copies the
#   bytes back at the end, with the tensors' version counters: the module keeps its own buffer
#   tensors, an EMA copy or DDP holding them sees nothing, and a graph built before ``plan()``
#   that saved one of them still passes autograd's version check;
# * autocast's cache is off, so no cast made here is served to the real run later (with it on, the
#   real run would find its weights' casts cached and run none of the ops the plan counted);
# * gradients: no backward runs; train/eval flags: nothing sets them.
#
# Blind spots: state that is not a tensor (a Python int counted up in ``forward``), explicit
# ``torch.Generator`` objects, writes made by something other than an aten op. Copying a written
# storage costs its bytes for the length of the profile (BatchNorm's: two vectors and a count).
@contextlib.contextmanager
def _leaving_no_trace(*inputs: Any) -> Iterator[None]:
    """Undo what a dry run of a function changes. See NOTE [ Profiling leaves no trace ]."""
    cache_enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        with fork_rng(tensor_devices(*inputs)), _UndoWrites():
            yield
    finally:
        torch.set_autocast_cache_enabled(cache_enabled)


class _UndoWrites(TorchDispatchMode):
    """Keep a copy of every outside storage an op writes, and its tensors' versions; put them back on
    exit. "Outside": not made by an op inside the mode. See NOTE [ Profiling leaves no trace ]."""

    def __init__(self) -> None:
        super().__init__()
        # Storages made inside, by key, each with a weak reference: a key can be reused once its
        # storage is freed, and a storage from outside must not be mistaken for a freed inside one.
        self.made: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        # key -> (the outside storage, a copy of its bytes before the first write).
        self.saved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        # id(tensor) -> (tensor, its version counter before the first write), in order.
        self.versions: dict[int, tuple[torch.Tensor, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for tensor, _ in op_info(func).written(args, kwargs):
            storage = storage_of(tensor)
            if storage is None or self._made_inside(storage):
                continue
            if id(storage) not in self.saved:
                self.saved[id(storage)] = (storage, storage.clone())
            self.versions.setdefault(id(tensor), (tensor, tensor._version))
        out = func(*args, **kwargs)
        for key, storage in new_storages(args, kwargs, out).items():
            self.made[key] = weakref.ref(storage)
        return out

    def _made_inside(self, storage: torch.UntypedStorage) -> bool:
        ref = self.made.get(id(storage))
        return ref is not None and ref() is storage

    def __exit__(self, *exc: Any) -> Any:
        result = super().__exit__(*exc)
        for storage, copy in self.saved.values():
            # Storage to storage: no tensor's version counter moves.
            storage.copy_(copy)
        # Views share one counter: put the earliest version noted back last. On a torch without
        # _unsafe_set_version_counter the counters stay moved: a graph that saved such a tensor before
        # profiling then raises autograd's in-place error in backward (loud, never wrong).
        set_version = optional("torch._C._autograd._unsafe_set_version_counter")
        if set_version is not None:
            for tensor, version in reversed(self.versions.values()):
                set_version((tensor,), (version,))
        return result


def profile_sequential(
    functions: Sequence[Callable[[torch.Tensor], torch.Tensor]], input: torch.Tensor, cost: str = "flops"
) -> tuple[Profile, ...]:
    """One profile per function of a chain (e.g. per block of a stack), each on its real input."""
    profiles = []
    x = input
    for function in functions:
        profiles.append(profile(function, x, cost=cost))
        # The next block's profile needs this block's output; no graph is kept, and no trace is left.
        with torch.no_grad(), _leaving_no_trace(x):
            x = function(x)
        # In the real run a block boundary requires grad (it depends on parameters): profile it so.
        x = x.detach().requires_grad_(x.is_floating_point())
    return tuple(profiles)


# ----------------------------------------------------------------------------------------- solvers
# A knapsack item: (key, bytes it costs to keep, recompute cost it saves).
Item = tuple[Any, int, float]


def _free_and_rest(items: Sequence[Item]) -> tuple[list[Item], list[Item]]:
    # Items that cost no memory are always worth keeping; items that save nothing never are.
    free = [it for it in items if it[1] == 0 and it[2] > 0]
    rest = [it for it in items if it[1] > 0 and it[2] > 0]
    return free, rest


def solve_greedy(items: Sequence[Item], capacity: int) -> set[Any]:
    """Keep items in order of cost saved per byte while they fit (DTR's heuristic, offline)."""
    free, rest = _free_and_rest(items)
    chosen = {key for key, _, _ in free}
    left = capacity
    # Best cost per byte first; ties: the smaller item, then the earlier one (deterministic).
    for key, nbytes, _cost in sorted(rest, key=lambda it: (-it[2] / it[1], it[1])):
        if nbytes <= left:
            chosen.add(key)
            left -= nbytes
    return chosen


def solve_dp(items: Sequence[Item], capacity: int, max_cells: int = 200_000_000) -> set[Any]:
    """The exact 0/1 knapsack: the most recompute cost saved within ``capacity`` bytes.

    A dynamic program over bytes, counted in units of the greatest common divisor of the items'
    sizes (tensor sizes share large factors, so the table stays small). ``O(items x capacity/gcd)``.
    """
    free, rest = _free_and_rest(items)
    chosen = {key for key, _, _ in free}
    if not rest:
        return chosen
    unit = math.gcd(*(nbytes for _, nbytes, _ in rest))
    weights = [nbytes // unit for _, nbytes, _ in rest]
    # Nothing can use more than all items together.
    cap = min(capacity // unit, sum(weights))
    if len(rest) * (cap + 1) > max_cells:
        raise ValueError(
            f"solve_dp: {len(rest)} items x {cap + 1} capacity steps is too large a table for the exact "
            "program; use method='greedy' (or plan fewer, larger regions)."
        )
    # best[c]: the most cost saved using at most c units; take[i, c]: item i is in that choice.
    best = np.zeros(cap + 1)
    take = np.zeros((len(rest), cap + 1), dtype=bool)
    for i, ((_, _, cost), w) in enumerate(zip(rest, weights, strict=False)):
        if w > cap:
            continue
        candidate = best[: cap + 1 - w] + cost
        better = candidate > best[w:]
        take[i, w:] = better
        best[w:] = np.where(better, candidate, best[w:])
    # Walk back from the full capacity to read off the choice.
    c = cap
    for i in range(len(rest) - 1, -1, -1):
        if take[i, c]:
            chosen.add(rest[i][0])
            c -= weights[i]
    return chosen


def solve_brute_force(items: Sequence[Item], capacity: int, limit: int = 20) -> set[Any]:
    """Try every subset (ties: the fewest bytes, then the first found). For checking the others."""
    free, rest = _free_and_rest(items)
    if len(rest) > limit:
        raise ValueError(
            f"solve_brute_force: {len(rest)} items means 2**{len(rest)} subsets; at most {limit}."
        )
    best: tuple[float, int, tuple[Item, ...]] = (0.0, 0, ())
    for size in range(len(rest) + 1):
        for subset in itertools.combinations(rest, size):
            nbytes = sum(it[1] for it in subset)
            cost = sum(it[2] for it in subset)
            if nbytes <= capacity and (cost > best[0] or (cost == best[0] and nbytes < best[1])):
                best = (cost, nbytes, subset)
    return {key for key, _, _ in free} | {key for key, _, _ in best[2]}


_SOLVERS: dict[str, Callable[[Sequence[Item], int], set[Any]]] = {
    "greedy": solve_greedy,
    "dp": solve_dp,
    "brute-force": solve_brute_force,
}


# ------------------------------------------------------- plans: solve profiles for a budget, and run
class PlanPolicy:
    """A selective policy that saves the ops at the planned positions, for one checkpointed call.

    It counts the ops it is asked about, so make a fresh one per call (``Plan.policy``). Works with
    ``ckpt_lab.selective_checkpoint`` and with torch's ``create_selective_checkpoint_contexts``.
    """

    def __init__(self, profile: Profile, saved: frozenset[int]) -> None:
        self.profile, self.saved = profile, saved
        self.position = itertools.count()
        # torch 2.11's SAC asks again during the recomputation (ctx.is_recompute=True), op by op in
        # the forward's order: those calls count on their own and get the forward's decisions.
        self.recompute_position = itertools.count()

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        # Not in the profile: whether the real run casts a weight depends on autocast's cache (NOTE
        # [ Autocast's weight casts ] in selective.py); selective_checkpoint never saves one.
        if is_autocast_weight_cast(op, args, kwargs):
            return RECOMPUTE
        index = next(self.recompute_position if getattr(ctx, "is_recompute", False) else self.position)
        ops = self.profile.ops
        expected = ops[index].op if index < len(ops) else None
        if op is not expected:
            what = f"{expected}" if expected is not None else f"nothing (the profile has {len(ops)} ops)"
            raise CheckpointError(
                f"plan: op {index} is {op}, but when the plan was made it was {what}. The plan was made "
                "for another computation (other shapes, branches, or train/eval mode), or this policy "
                "object was used for a second call: make a fresh policy per call with plan.policy(), and "
                "a new plan when the computation changes."
            )
        return SAVE if index in self.saved else RECOMPUTE

    def torch_policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        """The same decisions as torch's ``CheckpointPolicy`` (MUST_SAVE / PREFER_RECOMPUTE)."""
        decision = self(ctx, op, *args, **kwargs)
        return CheckpointPolicy.MUST_SAVE if decision is SAVE else CheckpointPolicy.PREFER_RECOMPUTE


class TracedPlanPolicy(PlanPolicy):
    """The plan's decisions keyed by (op, how many of that op came before), for ``torch.compile``.

    NOTE [ A plan under torch.compile ]
    Traced by Dynamo and AOTAutograd, a checkpointed region shows the policy another op sequence
    than the eager run the profile recorded: training-mode dropout is one ``native_dropout`` instead
    of ``empty_like bernoulli_ div_ mul``, eval-mode dropout an extra ``clone``. Positions no longer
    line up, but the ops the plan chooses between (matmuls, GELU: never random, in-place or views)
    are the same ops in the same order. So this policy saves the k-th call of an op when the
    profile's k-th call of that op is planned saved; ops the profile never saw are recomputed (they
    are the rerun kind: dropout's draw, copies). A traced run with more calls of a profiled op than
    the profile (another computation) raises ``CheckpointError``. ``Plan.torch_context_fn`` picks
    this policy when ``torch.compiler.is_compiling()``; eager keeps the strict positional one.
    """

    def __init__(self, profile: Profile, saved: frozenset[int]) -> None:
        super().__init__(profile, saved)
        self.seen: dict[Any, int] = {}
        self.recompute_seen: dict[Any, int] = {}  # torch 2.11's calls with ctx.is_recompute (above)
        self.where: dict[Any, list[int]] = {}  # op -> its positions in the profile
        for r in profile.ops:
            self.where.setdefault(r.op, []).append(r.index)

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        if is_autocast_weight_cast(op, args, kwargs) or op not in self.where:
            return RECOMPUTE
        seen = self.recompute_seen if getattr(ctx, "is_recompute", False) else self.seen
        k = seen[op] = seen.get(op, -1) + 1
        if k >= len(self.where[op]):
            raise CheckpointError(
                f"plan: under torch.compile, call {k + 1} of {op} in this region, but the profile the "
                f"plan was made from calls it {len(self.where[op])} times. The plan was made for another "
                "computation (other shapes, branches, or train/eval mode): make a new plan for it."
            )
        return SAVE if self.where[op][k] in self.saved else RECOMPUTE


@dataclass(frozen=True)
class Plan:
    """Which ops to keep, per region (one region per checkpointed call), and what that predicts."""

    profiles: tuple[Profile, ...]
    saved: tuple[frozenset[int], ...]
    budget: int
    method: str

    @property
    def retained_bytes(self) -> int:
        """Predicted: every region's inputs plus the outputs it keeps."""
        return sum(p.input_bytes + p.saved_bytes(s) for p, s in zip(self.profiles, self.saved, strict=False))

    @property
    def recompute_cost(self) -> float:
        """Predicted cost of the recomputations in one backward (FLOPs, or seconds)."""
        return sum(p.recompute_cost(s) for p, s in zip(self.profiles, self.saved, strict=False))

    @property
    def saved_ops(self) -> list[str]:
        """The kept ops by name, in order, e.g. ``['mm', 'mm', 'relu']`` (for printing)."""
        names = []
        for p, s in zip(self.profiles, self.saved, strict=False):
            names += [p.ops[i].op.overloadpacket.__name__ for i in sorted(s)]
        return names

    def policy(self, region: int = 0) -> PlanPolicy:
        """A fresh policy for one call of region ``region``."""
        return PlanPolicy(self.profiles[region], self.saved[region])

    def __call__(
        self, *args: Any, preserve_rng_state: bool = True, use_reentrant: bool = False, **kwargs: Any
    ) -> Any:
        """Run the planned function(s): one region takes the profiled arguments; a chain of regions
        (``plan_sequential``) takes one input and feeds each region's output to the next.
        ``use_reentrant`` as ``selective_checkpoint`` takes it (False, or left out)."""
        options = {"preserve_rng_state": preserve_rng_state, "use_reentrant": use_reentrant}
        if len(self.profiles) == 1:
            function = self.profiles[0].function
            return selective_checkpoint(function, *args, policy=self.policy(0), **options, **kwargs)
        if len(args) != 1 or kwargs:
            # Refused rather than dropped: the blocks of a chain take one tensor each.
            raise TypeError(
                f"plan: a plan of {len(self.profiles)} regions (plan_sequential) takes one input, the "
                f"first block's, and no keyword arguments; got {len(args)} positional and "
                f"{sorted(kwargs)} keyword arguments."
            )
        (x,) = args
        for region, p in enumerate(self.profiles):
            x = selective_checkpoint(p.function, x, policy=self.policy(region), **options)
        return x

    def torch_context_fn(self, region: int = 0) -> Callable[[], Any]:
        """The same plan for ``torch.utils.checkpoint.checkpoint(..., context_fn=...)``; under
        ``torch.compile`` keyed by op rather than position (NOTE [ A plan under torch.compile ])."""

        def context_fn() -> Any:
            traced = torch.compiler.is_compiling()
            policy = (TracedPlanPolicy if traced else PlanPolicy)(self.profiles[region], self.saved[region])
            return torch.utils.checkpoint.create_selective_checkpoint_contexts(policy.torch_policy)

        return context_fn


def _check_budget(budget: int, minimum: int) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise TypeError(f"plan: budget must be a number of bytes (int), not {budget!r}.")
    if budget < minimum:
        raise ValueError(
            f"plan: a budget of {budget} bytes is below the {minimum} bytes of the checkpointed inputs, "
            f"which any checkpoint must keep until backward. The smallest possible budget is {minimum} "
            "bytes (keep nothing else: plain checkpointing); for less, checkpoint larger regions or "
            "offload to CPU."
        )


def solve(profiles: Sequence[Profile], budget: int, method: str = "dp") -> Plan:
    """The plan for ``budget`` from profiles made once: one knapsack over every region's candidates.

    Profiling a stack takes seconds and solving it milliseconds: plan many budgets from one profile.
    """
    if method not in _SOLVERS:
        raise ValueError(f"plan: method must be one of {sorted(_SOLVERS)}, not {method!r}.")
    minimum = sum(p.input_bytes for p in profiles)
    _check_budget(budget, minimum)
    items = [((region, r.index), r.nbytes, r.cost) for region, p in enumerate(profiles) for r in p.candidates]
    chosen = _SOLVERS[method](items, budget - minimum)
    saved = tuple(frozenset(index for r, index in chosen if r == region) for region in range(len(profiles)))
    return Plan(tuple(profiles), saved, budget, method)


def budget_range(profiles: Sequence[Profile]) -> tuple[int, int]:
    """The smallest budget (the regions' inputs: plain checkpointing) and the largest useful one
    (every candidate kept as well); budgets beyond it buy nothing more."""
    minimum = sum(p.input_bytes for p in profiles)
    return minimum, minimum + sum(r.nbytes for p in profiles for r in p.candidates)


def frontier(
    profiles: Sequence[Profile], budgets: Sequence[int], method: str = "dp"
) -> list[tuple[int, float]]:
    """(predicted retained bytes, predicted recompute cost) of the plans at ``budgets``."""
    points = []
    for budget in budgets:
        p = solve(profiles, budget, method)
        points.append((p.retained_bytes, p.recompute_cost))
    return points
