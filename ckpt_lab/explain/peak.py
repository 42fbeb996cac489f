"""The peak ledger: every storage alive at the peak instant, what it is there for, and what would
lower the peak. ``report.peak_ledger`` (``.rows``, ``.roles``, ``.verdict``, ``.table()``).

NOTE [ Which peak ]
One definition, the project's: ``measure_memory``'s ``peak_bytes``, the most bytes alive at once over
forward and backward among the storages the step's aten ops made, the leaves' gradients excluded
(storages made in backward that outlive it: the ``.grad`` of parameters and inputs). It is
``report.peak_bytes`` and the top of ``report.timeline``. The ledger lists every storage counted in
it (``rows``: they add up to ``peak_bytes`` to the byte) and, apart, what stands beside it uncounted
(``held``): the leaves' gradients made by then, the parameters, the inputs. The peak *with* the
gradients (``peak_bytes_with_grads``) may come at another instant, usually the end of backward.

NOTE [ Roles ]
Each counted storage has one role, from when it was made and whether it lived through the end of
the forward (the order a step makes them):
* ``kept``: made by the forward, alive when it ended: kept for backward (``report.saved``'s rows, the
  output if the loss keeps it);
* ``forward``: made by the forward and freed before it ended (a peak inside the forward);
* ``loss``: made by ``loss_fn`` (or the sum ``explain`` takes), after the function returned; or the
  loss itself, where the function returns it (Hugging Face's ``labels=``);
* ``recomputed``: made by backward re-running a region (by which one: the region's name; "an
  unknown region" where only grad mode gave the re-run away);
* ``reloaded``: made by an offloading hook's unpack, bringing a tensor back;
* ``backward``: any other storage backward made: the gradients flowing back between nodes and the
  backward formulas' intermediates (by the autograd node that made it).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ckpt_lab.explain.report import Held, _common_prefix, _pattern, _size, _typed
from ckpt_lab.instruments.memory import LiveMemory

if TYPE_CHECKING:
    from ckpt_lab.explain.recorder import _Birth

__all__ = ["ROLES", "PeakLedger", "PeakRow"]

# Role -> its words, in the order a step makes them; the last three are not counted in the peak.
ROLES = {
    "kept": "kept for backward",
    "forward": "forward temporaries",
    "loss": "made by the loss",
    "recomputed": "re-run of",
    "reloaded": "reloaded by",
    "backward": "backward temporaries",
    "unattributed": "unattributed",
    "gradient": "leaves' gradients",
    "parameter": "parameters",
    "input": "inputs",
}
_ORDER = {role: i for i, role in enumerate(ROLES)}


@dataclass(frozen=True)
class PeakRow:
    """One storage alive at the peak instant (or, not counted, a tensor standing beside it)."""

    role: str  # a key of ROLES: NOTE [ Roles ]
    label: str  # the role in words, with the region for re-runs: "re-run of checkpoint #4 (torch.utils...)"
    serial: int | None  # LiveMemory's serial; None for parameters and inputs (made before the call)
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int
    op: str  # the aten op that made it, "→" the first in-place op that filled it; "" if made before
    module: str  # module path (forward and re-runs), a parameter's or input's name; "" in backward
    node: str  # the autograd node backward was running when it was made ("MmBackward0"), else ""
    line: str  # the caller's line, as in SavedRow; "" for backward's own work
    region: str  # forward: the regions it was made in (" > "); backward: the region re-run or reloaded
    where: str  # kept rows: how it is kept, in report.saved's words ("the output of a checkpoint (...)")
    counted: bool  # in ``peak_bytes`` (False: leaves' gradients, parameters, inputs)

    def describe(self) -> str:
        where = self.module or (f"({self.node})" if self.node else "-")
        return (
            f"{_size(self.bytes):>10}  {_typed(self.dtype, self.shape)}".ljust(36)
            + f" {self.op or '-':<22} {where:<24} {self.line or '-':<22} {self.region or '-'}"
        )


@dataclass(frozen=True)
class PeakLedger:
    """Every storage alive at the peak instant, by role; the counted rows add up to ``bytes``."""

    bytes: int  # == Report.peak_bytes == sum(row.bytes for row in rows): NOTE [ Which peak ]
    index: int  # the timeline's event at the peak (Timeline.peak_index)
    phase: str  # "forward", "loss" or "backward": when the peak came
    during: str  # the op that reached it: "re-running checkpoint #4 (torch.utils.checkpoint), `gelu` in ..."
    rows: list[PeakRow]  # counted, by role (ROLES' order), then in the order they were made
    held: list[PeakRow]  # not counted: the leaves' gradients made by then, parameters, inputs
    verdict: str  # what would lower the peak, from the numbers

    @property
    def roles(self) -> dict[str, int]:
        """Bytes per role (per region for re-runs), in the order a step makes them; they add up to
        ``bytes``. Roles with nothing alive at the peak are left out."""
        return _totals(self.rows)

    @property
    def not_counted(self) -> dict[str, int]:
        """Bytes beside the peak, not in it: leaves' gradients made by then, parameters, inputs."""
        return _totals(self.held)

    def lines(self) -> list[str]:
        """The summary's lines: the peak by role, then the verdict."""
        if not self.rows:
            return []
        parts = " + ".join(f"{_size(size)} {label}" for label, size in self.roles.items())
        grads = self.not_counted.get(ROLES["gradient"], 0)
        beside = f"; leaves' gradients made by then (not counted): {_size(grads)}" if grads else ""
        at = f"at the peak ({self.phase}: {self.during}): {parts}{beside}"
        return [at, f"to lower the peak: {self.verdict}"]

    def table(self) -> str:
        """Every row, grouped by role, then what is not counted, then the verdict."""
        out = [f"the peak, {_size(self.bytes)} at event {self.index} ({self.phase}: {self.during}); "
               "every storage alive then, by role:"]
        for title, rows in (("", self.rows), ("not counted: ", self.held)):
            groups: dict[str, list[PeakRow]] = defaultdict(list)
            for row in rows:
                groups[row.label].append(row)
            for label, members in groups.items():
                things = "tensor" if members[0].serial is None else "storage"
                out.append(f"{title}{label}: {_size(sum(r.bytes for r in members))} in {len(members)} "
                           f"{things}{'s' * (len(members) != 1)}")
                # Parameters and inputs are the model's own: their sizes are on the line above.
                if members[0].role not in ("parameter", "input"):
                    out += [f"  {row.describe()}" for row in members]
        return "\n".join([*out, f"to lower the peak: {self.verdict}"])


# ================================================================================ building it
def build_ledger(memory: LiveMemory, births: dict[int, _Birth], kept: dict[int, str], grads: set[int],
                 index: int, forward_events: int, parameters: list[Held], inputs: list[Held]) -> PeakLedger:
    """The ledger at event ``index`` (the peak): ``kept`` are the storages alive when the forward
    ended, with how each is kept; ``grads`` the leaves' gradients (NOTE [ Which peak ])."""
    if not memory.events:
        return PeakLedger(0, 0, "forward", "no op made a storage", [], [], "nothing to lower")
    rows = [_row(s, births.get(s), memory.nbytes(s), kept.get(s)) for s in alive_after(memory, index, grads)]
    rows = sorted((r for r in rows if r.bytes), key=lambda r: (_ORDER[r.role], r.serial))
    made_by_then = sorted(alive_after(memory, index) & grads)
    held = [_row(s, births.get(s), memory.nbytes(s), None, gradient=True) for s in made_by_then]
    held += [_held("parameter", h) for h in parameters] + [_held("input", h) for h in inputs]
    at = births.get(memory.events[index][0])
    phase = at.stage if at is not None else ("forward" if index < forward_events else "backward")
    total = sum(r.bytes for r in rows)
    return PeakLedger(total, index, phase, _during(at), rows, held, _verdict(rows, phase))


def alive_after(memory: LiveMemory, index: int, exclude: set[int] | None = None) -> set[int]:
    """Serials of the storages alive after event ``index`` of the timeline, but those in ``exclude``."""
    alive: set[int] = set()
    for serial, sign, _ in memory.events[: index + 1]:
        if not (exclude and serial in exclude):
            (alive.add if sign > 0 else alive.discard)(serial)
    return alive


def _held(role: str, tensor: Held) -> PeakRow:
    return PeakRow(role, ROLES[role], None, tensor.shape, tensor.dtype, tensor.bytes, "", tensor.name, "", "",
                   "", "", False)


def _row(serial: int, birth: _Birth | None, nbytes: int, kept: str | None, gradient: bool = False) -> PeakRow:
    if birth is None:
        # Every op passes through the recorder: a storage LiveMemory saw and it did not.
        return PeakRow("unattributed", ROLES["unattributed"], serial, (), torch.uint8, nbytes, "?", "", "",
                       "", "", "", True)
    region = " > ".join(r.name for r in birth.chain)
    if gradient:
        role = "gradient"
    elif birth.stage == "loss" or kept == "the loss":  # a model may return its own loss
        role = "loss"
    elif birth.stage != "backward":
        role = "forward" if kept is None else "kept"
    else:
        role = {"recompute": "recomputed", "reload": "reloaded"}.get(birth.span_kind or "", "backward")
        region = birth.recomputed_by.name if birth.recomputed_by is not None else ""
    label = ROLES[role]
    if role in ("recomputed", "reloaded"):
        label += " " + (region or "an unknown region")
    op = birth.op + (f"→{birth.written_by}" if birth.written_by else "")
    return PeakRow(role, label, serial, birth.shape, birth.dtype, nbytes, op, birth.module, birth.node,
                   birth.line, region, kept or "", not gradient)


def _during(birth: _Birth | None) -> str:
    """The op that reached the peak, and what it was part of: "re-running checkpoint #4 (...), `gelu`
    in layers.3.1"; "`mm` in MmBackward0"; "`mul` in layers.7.2"."""
    if birth is None:
        return "an unattributed op"
    op = f"`{birth.op}`" + (f" in {birth.module}" if birth.module else "")
    region = birth.recomputed_by.name if birth.recomputed_by is not None else "an unknown region"
    if birth.phase == "recompute":
        return f"re-running {region}, {op}"
    if birth.stage != "backward":
        return op
    if birth.span_kind == "reload":
        return f"reloading for {region}, {op}"
    op = f"`{birth.op}`" + (f" in {birth.node}" if birth.node else "")
    return op + (f", through {region}" if birth.recomputed_by is not None else "")


def _totals(rows: list[PeakRow]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for row in rows:
        totals[row.label] = totals.get(row.label, 0) + row.bytes
    return totals


# NOTE [ What would lower the peak ]
# One sentence from the ledger's numbers: the largest part of the peak, the next largest beside it,
# and the change that shrinks that part. A re-run's part shrinks when the region is checkpointed in
# smaller pieces (each re-run rebuilds only its piece). What the forward kept shrinks by checkpointing
# the blocks that made it; kept as checkpoints' outputs (each the next one's input), by fewer, longer
# checkpoints; kept by a checkpoint's policy, by a smaller budget. The loss's part, by a loss computed
# in chunks. Backward's own temporaries and the forward's no checkpoint removes: said so.
_KEPT_FIXES = {
    "the output of a": "they are checkpoints' outputs, each kept as the next one's input: fewer, longer "
    "checkpoints keep fewer of them (and re-run more each)",
    "kept by a": "a checkpoint's policy chose to keep them, and a smaller budget keeps less; to budget "
    "the peak itself, plan with ckpt_lab.peak_planner.plan_peak",
    "not inside any checkpoint": "checkpointing the blocks that make them keeps only the blocks' inputs",
    "the output, which the loss keeps": "the loss keeps the output for its backward: no checkpoint frees it",
}


def _verdict(rows: list[PeakRow], phase: str) -> str:
    totals = _totals(rows)
    if not totals:
        return "nothing the step made was alive at the peak"
    label, size = max(totals.items(), key=lambda kv: kv[1])
    members = [r for r in rows if r.label == label]
    role, mostly = members[0].role, _mostly(members)
    # The next largest parts, those that matter (1% of the peak or more).
    others = sorted(((s, other) for other, s in totals.items() if other != label), reverse=True)
    beside = [f"{_size(s)} {other}" for s, other in others[:2] if s * 100 >= sum(totals.values())]
    beside_them = " beside " + " and ".join(beside) if beside else ""
    if role == "recomputed":
        module = _common_prefix([r.module for r in members])
        name = label.removeprefix(ROLES["recomputed"] + " ") + (f" on {module}" if module else "")
        return (f"the re-run of {name} materialises {_size(size)}{beside_them}: checkpoint it in two parts, "
                "so that each re-run rebuilds half of it")
    part = f"{_size(size)}, mostly {mostly}"
    if role == "kept":
        by_where: dict[str, int] = defaultdict(int)
        for row in members:
            by_where[row.where] += row.bytes
        where = max(by_where.items(), key=lambda kv: kv[1])[0]
        fixes = (fix for start, fix in _KEPT_FIXES.items() if where.startswith(start))
        fix = next(fixes, f"most of it is {where}")
        if where == "not inside any checkpoint" and phase == "backward":
            fix = _unchecked_fix([r for r in members if r.where == where]) or fix
        return f"what the forward kept for backward is the largest part ({part}){beside_them}: {fix}"
    if role == "loss":
        return (f"the loss's tensors are the largest part ({part}){beside_them}: a loss computed in chunks "
                "keeps less")
    if role == "backward":
        return (f"backward's own temporaries are the largest part ({part}){beside_them}: gradients flowing "
                "back and the backward formulas' intermediates, which no checkpoint removes")
    if role == "forward":
        return (f"the peak comes in the forward, and its temporaries are the largest part ({part})"
                f"{beside_them}: no checkpoint removes what an op makes while it runs; smaller or chunked "
                "inputs do")
    return f"{label} is the largest part ({part}){beside_them}"


def _unchecked_fix(rows: list[PeakRow]) -> str:
    """Unchecked activations at a peak in backward. Backward frees the activations of later blocks
    first, so the block of the last one made that is still alive is the one backward is going
    through (or about to): a checkpoint around it would re-run it at this same instant. Only the
    other blocks' activations wait for later, and only those a checkpoint moves off the peak."""
    blocks: dict[str, int] = defaultdict(int)
    for row in rows:
        blocks[_block(row.module)] += row.bytes
    current = _block(max(rows, key=lambda r: r.serial or 0).module)
    if not current or 2 * blocks[current] <= sum(blocks.values()):
        return ""
    return (f"most of them were made in {current}, the last block still alive, which backward is going "
            "through at the peak: a checkpoint around it would re-run it at this same instant; a smaller "
            f"{current} (or one that keeps less) lowers it")


def _block(path: str) -> str:
    """The block a module path belongs to: up to its first layer index ("transformer.h.3.mlp.act" ->
    "transformer.h.3"), or the whole path if it has none."""
    parts = path.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 1)
    return ".".join(parts[: index + 1]) if path else ""


def _mostly(rows: list[PeakRow]) -> str:
    """The largest group among ``rows`` by op and where: "`mul` in h.*.mlp.act", "`mm` in MmBackward0"."""
    groups: dict[tuple[str, str], int] = defaultdict(int)
    for row in rows:
        groups[(row.op, _pattern(row.module) or row.node)] += row.bytes
    (op, where), _ = max(groups.items(), key=lambda kv: kv[1])
    return f"`{op}` " + (f"in {where}" if where else "outside any module")
