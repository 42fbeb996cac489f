"""A planner for the peak: how to run each region so that a training step's highest memory fits a budget.

``ckpt_lab.planner`` budgets the bytes a checkpoint keeps between forward and backward. A step runs
out of memory at its *peak*, and the peak is not what is kept: a checkpoint's re-run, the gradients
and the loss's temporaries stand on top of it. This planner predicts the peak of a whole step (a
chain of regions, the loss, backward) and chooses, region by region, how to run it:

    p = plan_peak(blocks, x, budget=24 * 2**20, loss=lambda y: y.square().mean())
    p.predicted_peak, p.recompute_cost, p.ways     # per region: "plain", or "keep 3 of 11 ops"
    p.loss(p(x)).backward()                        # the step the prediction is for

1. **profile** (``profile_peak``): for each region a menu of *ways* to run it: plainly (not
   checkpointed), or checkpointed keeping one of the sets on the region's own retained-bytes frontier
   (``planner``'s knapsack at each of its breakpoints). Each way runs once, forward and backward,
   alone, under ``LiveMemory``: a byte-exact timeline of what it makes and frees (NOTE [ One region
   alone ]). Regions of the same ops on the same shapes share their timelines.
2. **simulate**: the step's timeline for one way per region, put together from those timelines: the
   forwards in order, the collection after the forward, the backwards in reverse order, what the graph
   frees at the end (NOTE [ Composing a step from its regions ]). Its highest point is the predicted peak.
3. **solve** (``solve_peak``): the ways whose simulated peak fits the budget at the least recomputation,
   by dynamic programming over the regions (NOTE [ The peak as a dynamic program ]); ``peak_frontier``
   lists every (peak, recomputation) that no other choice of ways beats.

NOTE [ Which peak ]
The prediction is ``measure_memory``'s ``peak_bytes``: the most bytes alive at once, over forward and
backward, among the storages the step creates, *gradients left out* (storages created in backward
that outlive it: the parameters' ``.grad`` and the input's). It is the peak the benchmark's table,
``compiled.compile_step`` and ``explain`` report, so the three planners of the peak sweep are
compared on one definition; and it is the part of the peak a plan moves: the gradients a step leaves
behind are the optimizer's, the same bytes under every plan. ``with_grads=True`` predicts
``peak_bytes_with_grads`` instead (the same timelines, the gradients counted). Tensors made before
the step (the input, the parameters) count in neither.

NOTE [ A function of its own ]
``plan(..., objective="peak")`` was the other design: one entry point, a flag. Rejected, because the
two objectives take different things and a flag would hide it: the peak needs the loss (its
temporaries and its backward stand at the peak), a backward run per way (``profile`` runs one
forward), and a way the retained-bytes plan cannot express (a region left unchecked); and its budget
is another quantity (peak bytes, not retained bytes), so ``plan(f, x, budget=b)`` and the same call
with the flag would read the same number two ways. So: ``plan_peak`` / ``solve_peak``, with a budget
that says what it bounds, sharing ``planner``'s profile (a way's recomputation is
``Profile.recompute_cost``) and its policies (``PlanPolicy``), so a plan runs as the other planner's do.

What it leaves out: ways that keep a set *off* the region's retained-bytes frontier (such a set could
lower a re-run's working set at more recomputation; the menu does not offer it), splitting a region,
offloading, and the allocator (its rounding and caching: the instruments count storages, not what
``torch.cuda.max_memory_allocated`` adds). Checkmate (Jain et al. 2020) solves the peak over every op
with an integer program; here the unit is the region and the solver exact over the menu.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckpt_lab.planner import PlanPolicy, Profile, _leaving_no_trace, budget_range, profile_sequential, solve
from ckpt_lab.selective import selective_checkpoint
from ckpt_lab.step_timeline import (
    PARTS,
    Simulation,
    Timeline,
    gradients,
    holds_output,
    joined,
    leaves_of,
    record,
    simulate,
)

__all__ = [
    "PeakPlan",
    "PeakProfile",
    "Simulation",
    "Timeline",
    "Way",
    "mean_square",
    "peak_frontier",
    "plan_peak",
    "profile_peak",
    "simulate",
    "solve_peak",
]


def mean_square(y: torch.Tensor) -> torch.Tensor:
    """The benchmark's loss: the mean of the output squared."""
    return y.square().mean()


# ------------------------------------------------------------------------------------- entry point
def plan_peak(
    functions: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    input: torch.Tensor,
    budget: int,
    loss: Callable[[torch.Tensor], torch.Tensor] = mean_square,
    with_grads: bool = False,
    max_ways: int = 12,
) -> PeakPlan:
    """Profile the chain ``functions`` on ``input`` followed by ``loss``, and choose how to run each
    region so that the predicted peak of the step is at most ``budget`` bytes, recomputing least.

    The peak is ``measure_memory``'s ``peak_bytes`` (``peak_bytes_with_grads`` with ``with_grads``):
    NOTE [ Which peak ]. ``plan_peak(...)(input)`` runs the chain; ``.loss`` is the loss it was planned with.
    """
    return solve_peak(profile_peak(functions, input, loss, max_ways=max_ways), budget, with_grads)


# ------------------------------------------------------------------------------------------ ways
@dataclass(frozen=True)
class Way:
    """One way to run one region: plainly (``saved is None``) or checkpointed keeping ``saved``."""

    saved: frozenset[int] | None
    recompute_cost: float
    timeline: Timeline = field(repr=False)
    # Gradients this run leaves that a region earlier in the chain replaces, later in the step.
    not_grads: frozenset[int] = frozenset()

    @property
    def checkpointed(self) -> bool:
        return self.saved is not None

    @property
    def holds_output(self) -> bool:
        """Does the region's own graph keep its output alive into backward (an op saved it)?"""
        return holds_output(self.timeline)

    def describe(self, profile: Profile | None) -> str:
        if self.saved is None:
            return "plain"
        total = len(profile.candidates) if profile is not None else "?"
        return f"keep {len(self.saved)} of {total}"


@dataclass
class PeakProfile:
    """Every region's menu of ways, the loss's way, and what recording another way needs.

    ``profiles`` are the regions' retained-bytes profiles (``planner.profile_sequential``); ``inputs``
    the tensors each region (and, last, the loss) is recorded on; ``leaves`` the leaf tensors each one
    accumulates gradients into (parameters; the first region's input if it requires grad).
    """

    functions: tuple[Callable[[torch.Tensor], torch.Tensor], ...]
    inputs: tuple[torch.Tensor, ...] = field(repr=False)
    profiles: tuple[Profile, ...] = field(repr=False)
    loss: Callable[[torch.Tensor], torch.Tensor]
    leaves: list[list[torch.Tensor]] = field(repr=False)
    ways: list[list[Way]] = field(default_factory=list)
    loss_way: Way | None = None
    # Timelines by (region signature, first region?, input shape, dtype, kept set): see ``way``.
    recorded: dict[Any, Timeline] = field(default_factory=dict, repr=False)

    def regions(self) -> list[list[Way]]:
        """The menus, the loss last as a region with one way."""
        assert self.loss_way is not None
        return [*self.ways, [self.loss_way]]

    def way(self, region: int, saved: frozenset[int] | None) -> Way:
        """Region ``region`` run plainly (``None``) or checkpointed keeping ``saved``: from its menu,
        or recorded now (a plan made otherwise, e.g. by ``planner.solve``, can be predicted too).
        Region ``len(functions)`` is the loss (plain only)."""
        for way in self.ways[region] if region < len(self.ways) else ():
            if way.saved == saved:
                return way
        n = len(self.functions)
        prof, x = (self.profiles[region], self.inputs[region]) if region < n else (None, self.inputs[n])
        # Gradients other regions make first: in backward order, every region after this one.
        later = {id(t) for leaves in self.leaves[region + 1 :] for t in leaves}
        existing = tuple(i for i, t in enumerate(self.leaves[region]) if id(t) in later)
        # Same ops on the same shapes, same timeline: the blocks of one stack are recorded once. Not
        # where a parameter is shared with another region: positions of leaves would not say which.
        key = (_signature(prof) if prof else "loss", region == 0, tuple(x.shape), x.dtype, saved)
        key = (*key, region) if existing or region == n else key
        if key not in self.recorded:
            self.recorded[key] = record(
                self.functions[region] if region < n else self.loss,
                x,
                prof,
                saved,
                first=region == 0,
                last=region == n,
                leaves=self.leaves[region],
                existing=existing,
            )
        timeline = self.recorded[key]
        cost = 0.0 if saved is None or prof is None else prof.recompute_cost(saved)
        return Way(saved, cost, timeline, self._replaced(region, timeline))

    def _replaced(self, region: int, timeline: Timeline) -> frozenset[int]:
        """The gradients ``timeline`` leaves that, in the step, an earlier region's part is added to
        (a new storage: this one dies there): NOTE [ Parameters shared by regions ]."""
        found = set()
        for i, serial in enumerate(timeline.grads):
            leaf = self.leaves[region][i]
            for r in range(region - 1, -1, -1):
                ids = [id(t) for t in self.leaves[r]]
                if id(leaf) not in ids:
                    continue
                earlier = self.way(r, None).timeline
                stand_in = earlier.stand_ins[ids.index(id(leaf))]
                if any(s == stand_in and sign < 0 for s, sign, _ in earlier.events):
                    found.add(serial)
                    break
        return frozenset(s for s in found if s is not None)

    def plan(self, choice: Sequence[int], with_grads: bool = False) -> PeakPlan:
        """The plan that runs region r its way ``choice[r]`` (an index into ``ways[r]``)."""
        return _plan(self, tuple(choice), None, with_grads)

    def predict(self, saved: Sequence[frozenset[int] | None], with_grads: bool = False) -> Simulation:
        """The step's simulated timeline when region r runs plainly (``saved[r] is None``) or keeping
        ``saved[r]``; e.g. ``predict(plan.saved)`` for a ``planner.Plan`` over the same regions."""
        if len(saved) != len(self.functions):
            raise ValueError(
                f"PeakProfile.predict: {len(saved)} regions given, the profile has {len(self.functions)}."
            )
        return simulate([*(self.way(r, s) for r, s in enumerate(saved)), *self.regions()[-1]], with_grads)


# --------------------------------------------------------------------------------------- profile
def profile_peak(
    functions: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    input: torch.Tensor,
    loss: Callable[[torch.Tensor], torch.Tensor] = mean_square,
    max_ways: int = 12,
    profiles: Sequence[Profile] | None = None,
    retained_steps: int = 20,
) -> PeakProfile:
    """Run every way of every region once, alone, and record its timeline.

    A region's menu: plain; ``max_ways`` sets spread over its own retained-bytes frontier; and the
    sets the retained-bytes planner (``planner.solve``, all regions at once) keeps in it at
    ``retained_steps + 1`` budgets spread over its range (every 5% by default), so that the peak
    planner can always choose what the other would. ``profiles``: the regions' retained-bytes
    profiles if made already (``profile_sequential``).
    """
    _check_chain(functions, loss)
    if profiles is None:
        profiles = profile_sequential(functions, input)
    if len(profiles) != len(functions):
        raise ValueError(f"profile_peak: {len(profiles)} profiles for {len(functions)} functions.")
    inputs, leaves = [input], []
    for index, function in enumerate([*functions, loss]):
        # Each region's input as the step will give it (the previous output, requiring grad), and
        # the leaves its graph reaches.
        x = inputs[-1]
        stand_in = x if index == 0 else x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad(), _leaving_no_trace(x):
            y = function(stand_in)
        if index == len(functions) and not (isinstance(y, torch.Tensor) and y.numel() == 1):
            # backward() of the planned step needs a scalar; without this the plan would fail later.
            got = f"a tensor of shape {tuple(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(
                f"plan_peak: loss must return a scalar tensor (the step calls loss(output).backward()), "
                f"but it returned {got}. Reduce it, e.g. loss=lambda y: y.square().mean()."
            )
        leaves.append([t for t in leaves_of(y.grad_fn) if index == 0 or t is not stand_in])
        if index < len(functions):
            inputs.append(y.detach().requires_grad_(y.is_floating_point()))
        del y
    pp = PeakProfile(tuple(functions), tuple(inputs), tuple(profiles), loss, leaves)
    menus: list[list[frozenset[int] | None]] = [[None, *_frontier_sets(p, max_ways)] for p in profiles]
    if profiles and retained_steps > 0:
        low, high = budget_range(profiles)
        for step in range(retained_steps + 1):
            plan = solve(profiles, low + round(step / retained_steps * (high - low)))
            for menu, saved in zip(menus, plan.saved, strict=True):
                if saved not in menu:
                    menu.append(saved)
    for region, menu in enumerate(menus):
        pp.ways.append([pp.way(region, saved) for saved in menu])
    pp.loss_way = pp.way(len(functions), None)
    return pp


def _check_chain(functions: Sequence[Any], loss: Any) -> None:
    """Callables where callables are expected, each named by its place in the chain."""
    for index, function in enumerate(functions):
        if not callable(function):
            raise TypeError(
                f"plan_peak: region {index} of functions is {type(function).__name__} {function!r:.60}, "
                "not a callable: functions is a sequence of modules or functions, run one after the other."
            )
    if not callable(loss):
        raise TypeError(
            f"plan_peak: loss must be a callable that makes a scalar loss from the chain's output, "
            f"got {loss!r:.60}; leave it out for the mean of the output squared."
        )


def _signature(prof: Profile) -> tuple[Any, ...]:
    ops = tuple((r.op, r.nbytes, r.cost, r.rerun, r.mutated, r.reached) for r in prof.ops)
    return ops, prof.input_bytes


def _frontier_sets(prof: Profile, max_ways: int) -> list[frozenset[int]]:
    """The region's retained-bytes frontier: the knapsack's best set at each capacity where it changes,
    from keeping nothing to keeping every candidate; at most ``max_ways``, spread by bytes."""
    items = [(r.index, r.nbytes, r.cost) for r in prof.candidates]
    free = frozenset(k for k, n, c in items if n == 0 and c > 0)
    rest = [it for it in items if it[1] > 0 and it[2] > 0]
    sets = [free]
    if rest:
        unit = math.gcd(*(n for _, n, _ in rest))
        weights = [n // unit for _, n, _ in rest]
        cap = sum(weights)
        best = np.zeros(cap + 1)
        take = np.zeros((len(rest), cap + 1), dtype=bool)
        for i, ((_, _, cost), w) in enumerate(zip(rest, weights, strict=True)):
            candidate = best[: cap + 1 - w] + cost
            better = candidate > best[w:]
            take[i, w:] = better
            best[w:] = np.where(better, candidate, best[w:])
        # Capacities where the best cost saved rises: each is a new point of the frontier.
        for c in [int(c) for c in np.flatnonzero(np.diff(best) > 0) + 1]:
            chosen, left = set(free), c
            for i in range(len(rest) - 1, -1, -1):
                if take[i, left]:
                    chosen.add(rest[i][0])
                    left -= weights[i]
            if frozenset(chosen) not in sets:
                sets.append(frozenset(chosen))
    if len(sets) > max_ways:
        # Spread by bytes kept: the ends always, the rest evenly between them.
        picks = {round(i * (len(sets) - 1) / (max_ways - 1)) for i in range(max_ways)}
        sets = [s for i, s in enumerate(sets) if i in picks]
    return sets


# ------------------------------------------------------------------------------------------ solve
# NOTE [ The peak as a dynamic program ]
# Cut into its parts, the step's curve is the sum of the regions' contributions, so each way reduces
# to a few numbers (``_Summary``): f, the bytes its forward leaves alive (net) and q, the highest its
# forward rises above where it started; a, f plus what the collection then frees; p, the highest its
# backward rises; c, what its forward and backward leave alive together. With regions 0..n-1 (the
# loss last), the peak is the larger of
#
#     forward:   max over r of  f_0 + ... + f_{r-1} + q_r
#     backward:  max over r of  a_0 + ... + a_r + p_r + c_{r+1} + ... + c_{n-1}
#
# (in region r's backward, every forward has left its a, and every region after r has already run its
# backward, leaving its c). Left to right, the backward term is L_r = max(L_{r-1} + c_r, A_r + p_r)
# with A_r = a_0 + ... + a_r. So a partial choice is summed up by (F, A, L, highest forward so far) and
# whether its last region keeps its output (the joint changes the next region's numbers); of two
# partial choices with the same last flag, one no larger in all four and no dearer is as good for any
# continuation: the other is dropped. With a budget, a partial choice is dropped as soon as its forward
# exceeds it, or L plus the least the remaining regions' c can add does. The result is exact over the
# menu; ``simulate`` on the chosen ways gives the same peak (tested).
@dataclass(frozen=True)
class _Summary:
    f: int
    q: int
    a: int
    p: int
    c: int


def _summary(way: Way, held_in: bool, with_grads: bool) -> _Summary:
    skip = set() if with_grads else gradients(way)
    nbytes = way.timeline.nbytes
    totals = dict.fromkeys(PARTS, 0)
    rises = dict.fromkeys(PARTS, 0)
    for serial, sign, part in joined(way.timeline, held_in):
        if serial in skip:
            continue
        totals[part] += sign * nbytes[serial]
        rises[part] = max(rises[part], totals[part])
    f = totals["forward"]
    a = f + totals["collected"]
    return _Summary(f, rises["forward"], a, rises["backward"], a + totals["backward"])


def _solve(pp: PeakProfile, budget: float, with_grads: bool) -> list[tuple[int, float, tuple[int, ...]]]:
    """Every non-dominated complete choice as (peak, cost, way indices), the peak at most ``budget``."""
    regions = pp.regions()
    sums = [
        {(i, h): _summary(w, h, with_grads) for i, w in enumerate(ways) for h in (False, True)}
        for ways in regions
    ]
    # The least every later region's c can add: a lower bound on how L grows from here.
    least_c = [0] * (len(regions) + 1)
    for r in range(len(regions) - 1, -1, -1):
        least_c[r] = least_c[r + 1] + min(s.c for s in sums[r].values())
    # state: (holds, F, A, L, M) -> (cost, choice)
    states: dict[tuple[bool, int, int, int, int], tuple[float, tuple[int, ...]]] = {
        (False, 0, 0, -(2**62), 0): (0.0, ())
    }
    for r, ways in enumerate(regions):
        nxt: dict[tuple[bool, int, int, int, int], tuple[float, tuple[int, ...]]] = {}
        for (held, F, A, L, M), (cost, choice) in states.items():
            for i, way in enumerate(ways):
                s = sums[r][(i, held)]
                m = max(M, F + s.q)
                a = A + s.a
                lo = max(L + s.c, a + s.p)
                if m > budget or lo + least_c[r + 1] > budget:
                    continue
                key = (way.holds_output, F + s.f, a, lo, m)
                new = (cost + way.recompute_cost, (*choice, i))
                if key not in nxt or new[0] < nxt[key][0]:
                    nxt[key] = new
        states = _pareto(nxt)
    return [(max(M, L), cost, choice) for (_, _, _, L, M), (cost, choice) in states.items()]


def _pareto(states: dict[Any, tuple[float, Any]]) -> dict[Any, tuple[float, Any]]:
    """Drop every state another with the same flag beats in all of F, A, L, M and the cost."""
    kept: dict[Any, tuple[float, Any]] = {}
    by_flag: dict[bool, list[tuple[tuple[float, ...], Any]]] = {}
    for key, value in states.items():
        by_flag.setdefault(key[0], []).append(((*key[1:], value[0]), key))
    for rows in by_flag.values():
        rows.sort()
        # The states kept so far, one row each: numpy compares a new one with all of them at once.
        front = np.empty((len(rows), 5))
        size = 0
        for vec, key in rows:
            # Sorted, so any state that dominates this one came before it.
            if size and (front[:size] <= vec).all(axis=1).any():
                continue
            front[size] = vec
            size += 1
            kept[key] = states[key]
    return kept


@dataclass(frozen=True)
class PeakPlan:
    """How to run each region (``saved[r] is None``: plainly), and what that predicts for the step."""

    profile: PeakProfile = field(repr=False)
    choice: tuple[int, ...]  # the way of each region, by its index in the region's menu
    budget: int | None
    with_grads: bool
    predicted_peak: int
    predicted_retained: int  # alive when backward starts, made in the step (``measure_memory``'s)
    recompute_cost: float

    @property
    def saved(self) -> tuple[frozenset[int] | None, ...]:
        return tuple(self.profile.ways[r][i].saved for r, i in enumerate(self.choice))

    @property
    def ways(self) -> list[str]:
        """Per region: ``"plain"`` or ``"keep k of n"`` (the candidates it keeps)."""
        return [self.profile.ways[r][i].describe(self.profile.profiles[r]) for r, i in enumerate(self.choice)]

    @property
    def loss(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.profile.loss

    def simulation(self) -> Simulation:
        """The predicted step, event by event (``Simulation.curve``), e.g. to plot beside a measured one."""
        return simulate(self.chosen(), self.with_grads)

    def chosen(self) -> list[Way]:
        """The way of each region, the loss's last."""
        return [*(self.profile.ways[r][i] for r, i in enumerate(self.choice)), self.profile.loss_way]

    def policy(self, region: int) -> PlanPolicy:
        saved = self.saved[region]
        if saved is None:
            raise ValueError(f"PeakPlan: region {region} runs plainly; it has no checkpoint policy.")
        return PlanPolicy(self.profile.profiles[region], saved)

    def __call__(self, x: torch.Tensor, preserve_rng_state: bool = True) -> torch.Tensor:
        """Run the chain as planned (not the loss: ``plan.loss(plan(x))``)."""
        for region, (prof, saved) in enumerate(zip(self.profile.profiles, self.saved, strict=True)):
            if saved is None:
                x = prof.function(x)
            else:
                x = selective_checkpoint(
                    prof.function, x, policy=self.policy(region), preserve_rng_state=preserve_rng_state
                )
        return x


def _plan(pp: PeakProfile, choice: tuple[int, ...], budget: int | None, with_grads: bool) -> PeakPlan:
    ways = [*(pp.ways[r][i] for r, i in enumerate(choice)), pp.loss_way]
    sim = simulate(ways, with_grads)
    cost = sum(w.recompute_cost for w in ways)
    return PeakPlan(pp, choice[: len(pp.ways)], budget, with_grads, sim.peak_bytes, sim.retained_bytes, cost)


def solve_peak(pp: PeakProfile, budget: int, with_grads: bool = False) -> PeakPlan:
    """The ways whose predicted peak is at most ``budget`` bytes, recomputing least (then: peaking lowest)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise TypeError(f"solve_peak: budget must be a number of bytes (int), not {budget!r}.")
    found = _solve(pp, budget, with_grads)
    if not found:
        lowest = min(p for p, _, _ in _solve(pp, math.inf, with_grads))
        raise ValueError(
            f"solve_peak: no way of running these regions peaks at {budget} bytes or less; the lowest "
            f"predicted peak is {lowest} bytes (every region checkpointed as its menu allows). For less, "
            "cut the model into more, smaller regions, or offload to CPU."
        )
    *_, choice = min(found, key=lambda t: (t[1], t[0]))
    return _plan(pp, choice[:-1], budget, with_grads)


def peak_frontier(pp: PeakProfile, with_grads: bool = False) -> list[PeakPlan]:
    """Every plan no other beats in both predicted peak and recomputation, lowest peak first."""
    found = sorted(_solve(pp, math.inf, with_grads), key=lambda t: (t[0], t[1]))
    front, best = [], math.inf
    for _peak, cost, choice in found:
        if cost < best:
            best = cost
            front.append(_plan(pp, choice[:-1], None, with_grads))
    return front
