"""The report ``explain`` returns: what the forward kept (``saved``, one row per storage), each
region's verdict, the timeline of live bytes, and the peak's ledger (``peak.py``); read as
``summary()``, ``table()`` and ``plot()``. Plain data: built by ``build.py``, never by hand."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ckpt_lab.explain.peak import PeakLedger


@dataclass(frozen=True)
class SavedRow:
    """One storage the forward kept for backward (views and aliases of it are the same row)."""

    serial: int  # LiveMemory's serial: the order storages were made in
    shape: tuple[int, ...]  # of the tensor the op returned (a later view may have another)
    dtype: torch.dtype
    device: torch.device
    bytes: int
    op: str  # the aten op that made it ("addmm"); its output index if not the first ("native_dropout.1")
    written_by: str  # the first in-place op that filled it ("bernoulli_" into an "empty_like"), or ""
    module: str  # module path, "layers.3.linear1"; "" outside any module
    line: str  # the caller's line (not torch's, ckpt_lab's, the stdlib's): "model.py:42", "<cell>:3"
    region: str  # "checkpoint #3 (torch.utils.checkpoint)", nested ones joined by " > "; "" for none
    role: str  # how its innermost region holds it: "", "output", "kept", "copy" (by a pack hook), "loss"
    where: str  # the same in words, as the summary groups rows: "the output of a checkpoint (...)"

    def describe(self) -> str:
        op = self.op + (f"→{self.written_by}" if self.written_by else "")
        return (
            f"{_size(self.bytes):>10}  {_typed(self.dtype, self.shape)}".ljust(36)
            + f" {op:<22} {self.module or '-':<24} {self.line:<22} {self.where}"
        )


@dataclass(frozen=True)
class Held:
    """A tensor that existed before the call (a parameter, an input): alive anyway, never counted."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int


@dataclass(frozen=True)
class RegionReport:
    """One checkpoint, scope, hooks context or custom Function, and what it kept."""

    name: str  # "checkpoint #3 (torch.utils.checkpoint)"
    noun: str  # the same without which one: "checkpoint (torch.utils.checkpoint)"
    kind: str  # "checkpoint", "reentrant", "scope", "hooks", "function"
    module: str  # the module path its storages were made in (their common prefix)
    kept_bytes: int  # made inside it, alive after the forward, never read after it
    output_bytes: int  # made inside it, alive after the forward, read after it
    recomputed_bytes: int  # allocated by backward re-running it (0 where that can't be attributed)
    wraps_output: bool  # it made the function's output: the last stage
    verdict: str


@dataclass(frozen=True)
class Span:
    """Timeline events ``start`` to ``stop`` (exclusive), when backward recomputed or reloaded."""

    start: int
    stop: int
    kind: str  # "recompute", or "reload" (an unpack hook that does not recompute: offloading)
    label: str  # the region's name, or "unknown region"


@dataclass(frozen=True)
class Timeline:
    """Live bytes after each ``LiveMemory`` event (a storage born or freed), gradients of leaves
    excluded, as ``measure_memory``'s ``peak_bytes``."""

    live_bytes: list[int]
    phase: list[str]  # "forward" (including the loss) or "backward", per event
    backward_start: int  # index of the first backward event
    spans: list[Span]
    peak_index: int
    peak_bytes: int
    at_peak: list[tuple[str, int]]  # what was alive at the peak, grouped, largest first


@dataclass(frozen=True)
class Report:
    """What ``explain`` found. All bytes are exact storage sizes (``LiveMemory``'s)."""

    saved: list[SavedRow]
    parameters: list[Held]
    inputs: list[Held]
    loss_bytes: int
    output_bytes: int  # 0 unless the loss keeps the output
    retained_bytes: int  # == saved_bytes + loss_bytes + output_bytes
    peak_bytes: int  # over forward and backward, gradients of leaves excluded (as measure_memory's)
    peak_bytes_with_grads: int
    grad_bytes: int
    cuda_peak_bytes: int | None  # torch.cuda.max_memory_allocated above the start, on CUDA only
    regions: list[RegionReport]
    timeline: Timeline
    peak_ledger: PeakLedger  # every storage alive at the peak, by role; its rows add up to peak_bytes

    @property
    def saved_bytes(self) -> int:
        return sum(row.bytes for row in self.saved)

    def summary(self, top: int = 5) -> str:
        """A few lines: the totals, the peak by role and what would lower it, the largest holders
        grouped across layers, a verdict per region."""
        count = len(self.saved)
        output = f" + {_size(self.output_bytes)} output (kept for backward)" if self.output_bytes else ""
        cuda = self.cuda_peak_bytes
        lines = [
            f"kept after forward: {_size(self.retained_bytes)} = {_size(self.saved_bytes)} in {count} "
            f"storage{'s' * (count != 1)} + {_size(self.loss_bytes)} loss{output}",
            f"peak over forward and backward: {_size(self.peak_bytes)}"
            + (f" (torch.cuda.max_memory_allocated: {_size(cuda)})" if cuda is not None else "")
            + f"; not counted: parameters {_size(sum(h.bytes for h in self.parameters))}, "
            f"inputs {_size(sum(h.bytes for h in self.inputs))}",
            *self.peak_ledger.lines(),
        ]
        groups = _group(self.saved)
        if groups:
            lines.append("largest holders:")
        for (op, pattern, where), (size, modules) in groups[:top]:
            lines.append(f"  {_size(size)}: {_holder(op, pattern, modules)}, {where}")
        if len(groups) > top:
            rest = sum(size for _, (size, _) in groups[top:])
            lines.append(f"  ... and {_size(rest)} in {len(groups) - top} more groups")
        verdicts = _grouped_verdicts(self.regions)
        if verdicts:
            lines += ["regions:", *(f"  {line}" for line in verdicts)]
        return "\n".join(lines)

    def table(self, peak: bool = True) -> str:
        """Every kept storage, one line each, in the order they were made; then (``peak``) the peak's
        ledger: every storage alive at the peak, by role."""
        kept = "\n".join(row.describe() for row in self.saved)
        return kept + ("\n\n" + self.peak_ledger.table() if peak else "")

    def plot(self, ax: Any = None) -> Any:
        """Live MiB over forward and backward, recompute spans shaded, the peak marked and its ledger
        written beside it (the roles, then the largest groups alive)."""
        if ax is None:
            import matplotlib.pyplot as plt

            _, ax = plt.subplots(figsize=(10, 4.5))
        t = self.timeline
        label = "live (leaves' gradients excluded)"
        ax.plot([b / 2**20 for b in t.live_bytes], lw=1.2, color="C0", label=label)
        ax.axvline(t.backward_start, color="grey", ls="--", lw=0.8)
        ax.text(t.backward_start, 0, " backward", color="grey", va="bottom")
        for kind, colour in (("recompute", "C1"), ("reload", "C2")):
            for i, span in enumerate(s for s in t.spans if s.kind == kind):
                # Each span stretched over its last event, so that one-event spans show too.
                label = kind if i == 0 else None
                ax.axvspan(span.start, span.stop, color=colour, alpha=0.2, lw=0, label=label)
        ax.plot([t.peak_index], [t.peak_bytes / 2**20], "v", color="C3", label=f"peak {_size(t.peak_bytes)}")
        # Head-room above the curve for the box below (kept if shared axes already have more).
        ax.set_ylim(0, max(ax.get_ylim()[1], 1.8 * t.peak_bytes / 2**20))
        # Regions by name and number only ("re-run of checkpoint #4"): the box stays narrow.
        roles = "\n".join(f"{_size(size):>10}  {label.split(' (')[0]}"
                          for label, size in self.peak_ledger.roles.items())
        alive = "\n".join(f"{_size(size):>10}  {what}" for what, size in t.at_peak[:3])
        ax.text(0.01, 0.98, f"the peak by role:\n{roles}\nlargest alive at the peak:\n{alive}",
                transform=ax.transAxes, va="top", fontsize=7, family="monospace",
                bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
        ax.set_xlabel("LiveMemory event (a storage born or freed)")
        ax.set_ylabel("MiB")
        ax.legend(loc="upper right", fontsize=7)
        return ax


# -------------------------------------------------------------------------------------- grouping
def _pattern(path: str) -> str:
    """A module path with layer indices collapsed: "layers.3.linear1" -> "layers.*.linear1"."""
    return ".".join("*" if part.isdigit() else part for part in path.split(".")) if path else ""


def _common_prefix(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths if p]
    if not parts:
        return ""
    prefix = parts[0]
    for p in parts[1:]:
        n = 0
        while n < min(len(prefix), len(p)) and prefix[n] == p[n]:
            n += 1
        prefix = prefix[:n]
    return ".".join(prefix)


def _group(rows: list[SavedRow]) -> list[tuple[tuple[str, str, str], tuple[int, set[str]]]]:
    """Rows grouped by (op, module pattern, where), largest first, with the modules in each group."""
    groups: dict[tuple[str, str, str], tuple[int, set[str]]] = {}
    for row in rows:
        key = (row.op + (f"→{row.written_by}" if row.written_by else ""), _pattern(row.module), row.where)
        size, modules = groups.get(key, (0, set()))
        groups[key] = (size + row.bytes, modules | {row.module})
    return sorted(groups.items(), key=lambda kv: (-kv[1][0], kv[0]))


def _holder(op: str, pattern: str, modules: set[str]) -> str:
    """ "outputs of `softmax` in 8 modules (layers.*.attn)"."""
    op, _, written = op.partition("→")
    name, _, index = op.partition(".")
    what = f"outputs of `{name}`" + (f" (output {index})" if index else "")
    what += f" filled by `{written}`" if written else ""
    if not pattern:
        return what + " outside any module"
    if len(modules) == 1:
        return f"{what} in {next(iter(modules))}"
    return f"{what} in {len(modules)} modules ({pattern})"


def _grouped_verdicts(regions: list[RegionReport]) -> list[str]:
    """One line per distinct verdict: regions over layers that differ only in the layer say it once."""
    groups: dict[tuple[str, str, str], list[RegionReport]] = defaultdict(list)
    for region in regions:
        groups[(region.noun, _pattern(region.module), region.verdict)].append(region)
    lines = []
    for (noun, pattern, verdict), members in groups.items():
        if len(members) == 1:
            where = f" on {members[0].module}" if members[0].module else ""
            lines.append(f"{members[0].name}{where}: {verdict}")
        else:
            where = f" on {pattern}" if pattern else ""
            lines.append(f"{len(members)}× {noun}{where}: each {verdict}")
    return lines


def _typed(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    """ "float32[4x16]"."""
    return f"{str(dtype).removeprefix('torch.')}[{'x'.join(map(str, shape)) or 'scalar'}]"


def _size(n: int | None) -> str:
    if n is None:
        return "n/a"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    if n >= 2**10:
        return f"{n / 2**10:.1f} KiB"
    return f"{n} B"
