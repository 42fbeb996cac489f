"""A training step's memory timeline, put together from its regions' timelines, each recorded alone.

The peak planner's instrument (``ckpt_lab.peak_planner``, which says why): a region (a block of a
stack, an embedding, a loss) run one way (plainly, or checkpointed) is recorded *alone*, forward and
backward, under ``LiveMemory``; the step's timeline for any choice of ways is then laid out from
those recordings without running the step:

    t = record(block, x, profile, saved)            # one region, one way: a Timeline
    simulate([run_0, run_1, ..., loss_run])         # the step: Simulation(curve, peak_bytes, ...)

``record`` stands in for the region's neighbours (NOTE [ One region alone ]), also where a parameter
is shared between regions (NOTE [ Parameters shared by regions ]); ``simulate`` joins the regions'
timelines at their boundaries (NOTE [ Composing a step from its regions ]). Bytes are storages, as
``measure_memory`` counts them, and so is the peak: with or without the gradients the step leaves.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ckpt_lab.instruments.memory import LiveMemory
from ckpt_lab.planner import PlanPolicy, Profile, _leaving_no_trace
from ckpt_lab.selective import selective_checkpoint

__all__ = [
    "PARTS",
    "Run",
    "Simulation",
    "Timeline",
    "gradients",
    "holds_output",
    "joined",
    "leaves_of",
    "record",
    "simulate",
]


# ------------------------------------------------------------------------------------ one region
@dataclass(frozen=True)
class Timeline:
    """What one way of one region made and freed, run alone (NOTE [ One region alone ]).

    ``events`` are ``(serial, +1 born / -1 freed, part)`` with ``part`` one of ``"forward"``,
    ``"collected"`` (freed by the collection after the forward), ``"backward"``, ``"end"`` (freed when
    the step's graph goes); ``nbytes`` gives each serial's bytes. The four boundary serials (``None``
    where there is none) are what the composition joins to the neighbours.
    """

    events: tuple[tuple[int, int, str], ...]
    nbytes: dict[int, int]
    input: int | None  # the stand-in for the region's input (made by the harness)
    output: int | None  # the region's output
    grad_output: int | None  # the gradient handed to its backward (made by the harness)
    grad_input: int | None  # the gradient its backward hands on
    # Per leaf of the region (``PeakProfile.leaves``, in that order): the harness's stand-in for the
    # gradient another region sent it first (NOTE [ Parameters shared by regions ]), and the serial of
    # the leaf's ``.grad`` when the backward is done (if made in the run), or None.
    stand_ins: tuple[int | None, ...] = ()
    grads: tuple[int | None, ...] = ()


class Run(Protocol):
    """A region's recorded way, as ``simulate`` reads it (``peak_planner.Way`` is one)."""

    timeline: Timeline
    # Gradients the run leaves that the step frees later (NOTE [ Parameters shared by regions ]).
    not_grads: frozenset[int]


# NOTE [ One region alone ]
# A way's timeline is the region's forward and backward run by themselves, with a harness that stands
# in for the neighbours the step will give it, so that every byte it makes, and when it goes, is what
# it will be in the step:
#
# * its input: the first region's is the step's own input (made before the step, never counted). A
#   later region's is the previous region's output, a tensor that requires grad and that the caller
#   drops once the region returns (``x = block(x)``); the harness makes a fresh copy of it
#   (``_Boundary``: made inside, so its death is seen) and drops its reference after the forward.
#   Whether the region's graph keeps it, and until when, is then measured, not assumed.
# * its output's gradient: made by the harness (``_Source``) when backward starts, and freed when the
#   region's backward is done with it; the gradient of its input is taken by ``_Boundary``'s backward,
#   which drops it (in the step, the previous region's backward consumes it: that region's timeline
#   says when).
# * the loss (the last region) runs as in the step: the scalar, then ``backward()`` from it.
#
# Each run leaves no trace: the generators are forked, writes to outside tensors (BatchNorm's running
# statistics) undone, and the leaves' ``.grad`` put back (NOTE [ Profiling leaves no trace ] in
# planner.py). What the harness itself makes (the scalar ``_Source`` returns, the gradient ``backward``
# starts from) is recorded in a phase of its own and left out.
#
# NOTE [ Parameters shared by regions ]
# A parameter two regions use (GPT-2's token embedding is also its output layer) gets one gradient,
# summed by the autograd engine: the region later in the chain runs its backward first and sends its
# part, which waits in the engine's input buffer of that parameter until the earlier region's part
# arrives; then the two are added (a new storage, here) and the sum becomes ``.grad``. Alone, the later
# region's part would become ``.grad`` at once and look like a gradient kept to the end; and the
# earlier region's part would be stolen as ``.grad`` without the addition. So the harness recreates
# the wait: ``_Source`` also sends each shared parameter a gradient of its own (a "stand-in", made in
# a phase of its own), which waits in the buffer as the other region's part would, and the engine
# does the same addition. A stand-in's birth is the harness's; its death is the other region's part
# dying, in the step; and the later region's part is then no gradient (``PeakProfile._replaced``):
# it lives from its birth to that death. Found on GPT-2, where leaving it out cost 4.7% of the peak.
class _Boundary(torch.autograd.Function):
    """The stand-in for a region's input: a copy made inside the recording; its backward takes the
    gradient of the input, notes which storage it is, and drops it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, note: dict[str, Any]) -> torch.Tensor:
        ctx.note = note
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        ctx.note["grad_input"] = ctx.note["memory"].serial_or_none(grad)
        return None, None


class _Source(torch.autograd.Function):
    """Ends a region's recording: a scalar to call ``backward()`` on, whose backward makes the region
    output's gradient (as the next region's backward would) and then hands over to the region's.
    ``shared`` are parameters that regions later in the chain use too: their backward (earlier)
    has sent those a gradient already, which waits for this region's (NOTE [ Parameters shared ...])."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, note: dict[str, Any], *shared: torch.Tensor) -> torch.Tensor:
        ctx.note, ctx.like = note, (y.shape, y.dtype, y.device)
        ctx.shared = [(t.shape, t.dtype, t.device) for t in shared]
        return torch.zeros((), dtype=y.dtype, device=y.device)

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shape, dtype, device = ctx.like
        memory = ctx.note["memory"]
        memory.phase = "stand-in"
        waiting = [torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shared]
        ctx.note["stand_ins"] = [memory.serial_or_none(t) for t in waiting]
        memory.phase = "harness"
        grad = torch.ones(shape, dtype=dtype, device=device)
        ctx.note["grad_output"] = memory.serial_or_none(grad)
        memory.phase = "backward"
        return (grad, None, *waiting)


class _Recorder(LiveMemory):
    def serial_or_none(self, tensor: torch.Tensor) -> int | None:
        return self._live.get(id(tensor.untyped_storage()))


def leaves_of(root: Any) -> list[torch.Tensor]:
    """The leaf tensors (parameters, a leaf input) the graph below ``root`` accumulates gradients into."""
    found, seen, todo = [], set(), [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            found.append(node.variable)
        todo.extend(n for n, _ in node.next_functions)
    return found


def _run(
    function: Callable[..., Any], x: torch.Tensor, prof: Profile | None, saved: frozenset[int] | None
) -> Any:
    if saved is None:
        return function(x)
    return selective_checkpoint(function, x, policy=PlanPolicy(prof, saved), use_reentrant=False)


def record(
    function: Callable[..., Any],
    x: torch.Tensor,
    prof: Profile | None,
    saved: frozenset[int] | None,
    first: bool,
    last: bool = False,
    leaves: Sequence[torch.Tensor] = (),
    existing: Sequence[int] = (),
) -> Timeline:
    """One way of one region, forward and backward, alone: see NOTE [ One region alone ]."""
    stand_in = x if first else x.detach().requires_grad_(x.requires_grad)
    note: dict[str, Any] = {"grad_input": None, "grad_output": None}
    marks: dict[str, int] = {}
    leaves = list(leaves)
    grads = [leaf.grad for leaf in leaves]
    stand_ins: list[int | None] = [None] * len(leaves)
    # The collections below only need to look at what the run made: everything older is frozen out
    # of them (a full collection of a process with torch loaded takes a third of a second here).
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        with _leaving_no_trace(x), _Recorder() as memory:
            note["memory"] = memory
            # The stand-in is made in a phase of its own: its birth is the harness's, its death is not.
            memory.phase = "input"
            xin = stand_in if first else _Boundary.apply(stand_in, note)
            input_serial = None if first else memory.serial_or_none(xin)
            memory.phase = "forward"
            y = _run(function, xin, prof, saved)
            output_serial = memory.serial_or_none(y)
            memory.phase = "harness"
            end = y if last else _Source.apply(y, note, *(leaves[i] for i in existing))
            for leaf in leaves:
                leaf.grad = None
            del xin, y
            marks["forward"] = len(memory.events)
            gc.collect()
            marks["collected"] = len(memory.events)
            memory.phase = "backward" if last else "harness"
            # The gradient backward starts from, made as ``backward()`` makes it; held here as the
            # step's ``backward()`` call holds it, until every region's backward is done.
            start = torch.ones_like(end, memory_format=torch.preserve_format)
            end.backward(start)
            marks["backward"] = len(memory.events)
            final = tuple(None if t.grad is None else memory.serial_or_none(t.grad) for t in leaves)
            for i, serial in zip(existing, note.get("stand_ins", ()), strict=True):
                stand_ins[i] = serial
            del end, start
            gc.collect()
    finally:
        # After the recording: the gradients it made die unseen, as they outlive the step they are in.
        for leaf, grad in zip(leaves, grads, strict=True):
            leaf.grad = grad
        if freeze:
            gc.unfreeze()
    harness = {s for s, sign, phase in memory.events if sign > 0 and phase == "harness"}
    harness -= {note["grad_output"]}
    events = []
    for i, (serial, sign, _) in enumerate(memory.events):
        if serial in harness:
            continue
        part = (
            "forward"
            if i < marks["forward"]
            else "collected"
            if i < marks["collected"]
            else "backward"
            if i < marks["backward"]
            else "end"
        )
        events.append((serial, sign, part))
    return Timeline(
        tuple(events),
        {s: memory.nbytes(s) for s, _, _ in events},
        input_serial,
        None if last else output_serial,
        note["grad_output"],
        note["grad_input"],
        tuple(stand_ins),
        final,
    )


# -------------------------------------------------------------------------------------- the step
# NOTE [ Composing a step from its regions ]
# The step is: each region's forward in order, the loss's forward, the collection ``measure_memory``
# runs before backward, the loss's backward, each region's backward in reverse order, and the graph
# freed. So its timeline is the regions' timelines, cut into their parts and laid end to end in that
# order, with the joints between neighbours made once:
#
# * region r's output *is* region r+1's input. Its birth is r's (r+1's stand-in copy is the harness's);
#   the reference the harness drops after r's forward is no death (in the step, r+1 has it). It dies
#   where r+1's timeline says, unless r's own graph keeps it into backward (an op saved its output:
#   ``holds_output``): then r's backward, later, frees it, and r+1's deaths of it are dropped.
# * the gradient of r's output *is* r+1's gradient of its input: born in r+1's backward (the harness's
#   copy in r is no birth), freed in r's backward (r+1's harness dropping it is no death).
# * gradients, for NOTE [ Which peak ]: storages born in a backward that nothing in the step frees.
#
# The autograd engine runs a region's backward nodes only once the gradient of its output is complete,
# and each region's nodes in the order of its own run alone; the non-reentrant checkpoint re-runs a
# region when its backward first unpacks, inside that region's backward. So nothing interleaves across
# regions and the laid-out timeline is the step's, event for event. Checked against ``measure_memory``
# on every workload of the peak sweep (within 2%: exact where storages die by reference counting).
def joined(t: Timeline, held_in: bool) -> list[tuple[int, int, str]]:
    """One region's events with its joints made (see the NOTE); ``held_in``: the previous region's
    graph keeps this region's input into backward. Serials stay the region's own."""
    kept = []
    for serial, sign, part in t.events:
        if serial == t.input and (sign > 0 or held_in):
            continue
        if serial == t.output and sign < 0 and part in ("forward", "collected"):
            continue
        if serial == t.grad_output and sign > 0:
            continue
        if serial == t.grad_input and sign < 0:
            continue
        if serial in t.stand_ins and sign > 0:
            continue
        kept.append((serial, sign, part))
    return kept


def holds_output(t: Timeline) -> bool:
    """Does the region's own graph keep its output alive into backward (an op saved it)?"""
    return t.output is not None and not any(
        s == t.output and sign < 0 and part in ("forward", "collected") for s, sign, part in t.events
    )


def gradients(run: Run) -> set[int]:
    """Serials born in this region's backward that nothing in the step frees: the gradients it leaves
    (not the gradient it hands on, not one a region earlier in the chain replaces)."""
    t = run.timeline
    freed = {s for s, sign, _ in t.events if sign < 0}
    born = {s for s, sign, part in t.events if sign > 0 and part == "backward" and s not in freed}
    return born - {t.grad_input, *t.stand_ins} - run.not_grads


# The parts of a region's timeline, in the order they happen.
PARTS = ("forward", "collected", "backward", "end")


@dataclass(frozen=True)
class Simulation:
    """The predicted step: its live-bytes curve, its peak and what is alive when backward starts."""

    curve: list[int]
    labels: list[tuple[int, str]]  # (region, part) of each point of the curve
    peak_bytes: int
    retained_bytes: int


def simulate(regions: Sequence[Run], with_grads: bool = False) -> Simulation:
    """The step's timeline for one way per region (the loss's way last): NOTE [ Composing a step ... ]."""
    n = len(regions)
    events = [
        joined(w.timeline, r > 0 and holds_output(regions[r - 1].timeline)) for r, w in enumerate(regions)
    ]
    order = (
        [(r, "forward") for r in range(n)]
        + [(r, "collected") for r in range(n)]
        + [(r, "backward") for r in reversed(range(n))]
        + [(r, "end") for r in range(n)]
    )
    skip = [set() if with_grads else gradients(w) for w in regions]
    live, curve, labels, retained = 0, [], [], 0
    for r, part in order:
        nbytes = regions[r].timeline.nbytes
        for serial, sign, p in events[r]:
            if p == part and serial not in skip[r]:
                live += sign * nbytes[serial]
                curve.append(live)
                labels.append((r, part))
        if (r, part) == (n - 1, "collected"):
            retained = live
    return Simulation(curve, labels, max([0, *curve]), retained)
