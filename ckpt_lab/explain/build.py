"""From the recording to the report: one row per storage the forward kept, one verdict per region,
the timeline, the peak's ledger (``peak.py``)."""

from __future__ import annotations

from collections import defaultdict

import torch

from ckpt_lab._aten import tensors_in
from ckpt_lab.explain.peak import alive_after, build_ledger
from ckpt_lab.explain.recorder import _Birth, _Recorder, held
from ckpt_lab.explain.regions import _Region
from ckpt_lab.explain.report import (
    RegionReport,
    Report,
    SavedRow,
    Span,
    Timeline,
    _common_prefix,
    _pattern,
    _size,
)
from ckpt_lab.instruments.memory import LiveMemory


def build_report(
    recorder: _Recorder,
    retained: int,
    alive: set[int],
    output_serials: set[int],
    loss_serials: set[int],
    forward_events: int,
    cuda_peak: int | None,
    args: tuple,
    kwargs: dict,
) -> Report:
    memory, births = recorder.memory, recorder.births
    # A model that returns its own loss (Hugging Face's ``labels=``) has the loss in its output:
    # counted once, as the loss.
    output_kept = (output_serials - loss_serials) & alive
    # Empty storages (torch's and ours' placeholders) cost nothing and explain nothing.
    rows = [_row(s, births.get(s), memory.nbytes(s)) for s in sorted(alive - loss_serials - output_kept)
            if memory.nbytes(s)]
    grads = memory.born_in("backward")
    live = memory.curve(exclude=grads)
    peak_index = max(range(len(live)), key=live.__getitem__, default=0)
    spans = [Span(start, stop, kind, region.name if region else "unknown region")
             for start, stop, kind, region in recorder.spans if stop > start]
    timeline = Timeline(
        live_bytes=live,
        phase=[phase for _, _, phase in memory.events],
        backward_start=forward_events,
        spans=spans,
        peak_index=peak_index,
        peak_bytes=live[peak_index] if live else 0,
        at_peak=_alive_at(memory, births, peak_index, grads),
    )
    # How each storage alive after the forward is kept, in the rows' words (for the peak's ledger).
    kept = dict.fromkeys(alive, "") | dict.fromkeys(output_kept, "the output, which the loss keeps")
    kept |= {r.serial: r.where for r in rows} | dict.fromkeys(alive & loss_serials, "the loss")
    parameters = list(recorder.parameters.values())
    inputs = [held(f"input {i}", t) for i, t in enumerate(tensors_in((args, kwargs)))]
    return Report(
        saved=rows,
        parameters=parameters,
        inputs=inputs,
        loss_bytes=sum(memory.nbytes(s) for s in loss_serials & alive),
        output_bytes=sum(memory.nbytes(s) for s in output_kept),
        retained_bytes=retained,
        peak_bytes=memory.peak(exclude=grads),
        peak_bytes_with_grads=memory.peak(),
        grad_bytes=sum(memory.nbytes(s) for s in grads),
        cuda_peak_bytes=cuda_peak,
        regions=_region_reports(births, alive, output_serials, output_kept),
        timeline=timeline,
        peak_ledger=build_ledger(memory, births, kept, grads, peak_index, forward_events, parameters, inputs),
    )


def _row(serial: int, birth: _Birth | None, nbytes: int) -> SavedRow:
    if birth is None:
        # Every op passes through our mode, so this would be a storage LiveMemory saw and we did not.
        cpu = torch.device("cpu")
        return SavedRow(serial, (), torch.uint8, cpu, nbytes, "?", "", "", "", "", "", "unattributed")
    role, where = _role(birth)
    region = " > ".join(r.name for r in birth.chain)
    return SavedRow(serial, birth.shape, birth.dtype, birth.device, nbytes, birth.op, birth.written_by,
                    birth.module, birth.line, region, role, where)


def _role(birth: _Birth) -> tuple[str, str]:
    """How the innermost region holds a storage, and the words the summary groups rows by."""
    if birth.stage == "loss":
        return "loss", "made by the loss, after the function returned"
    if not birth.chain:
        return "", "not inside any checkpoint"
    region = birth.chain[-1]
    if birth.via is region:
        return "copy", f"a copy made by the pack hook of {region.noun}"
    role = "output" if id(region) in birth.escaped else "kept"
    if region.kind == "hooks" and region.what == "saved_tensors_hooks":
        # Hooks we know nothing about: whether they keep, move or recompute is theirs to say.
        return role, f"unknown region: made inside {region.noun}"
    if region.kind in ("hooks", "function"):
        return role, f"made inside {region.noun}" + (", read after it" if role == "output" else "")
    if role == "output":
        return role, f"the output of a {region.noun}"
    if region.selective:
        return role, f"kept by a {region.noun}'s policy"
    return role, f"kept inside a {region.noun}"


def _region_reports(births: dict[int, _Birth], alive: set[int], output_serials: set[int],
                    output_kept: set[int]) -> list[RegionReport]:
    regions: dict[int, _Region] = {}
    kept: dict[int, list[_Birth]] = defaultdict(list)
    outputs: dict[int, int] = defaultdict(int)
    modules: dict[int, list[str]] = defaultdict(list)
    wraps: set[int] = set()
    recomputed: dict[int, int] = defaultdict(int)
    for serial, birth in births.items():
        for region in birth.chain:
            key = id(region)
            regions.setdefault(key, region)
            modules[key].append(birth.module)
            if serial in output_serials:
                wraps.add(key)
            if serial in alive and serial not in output_kept and birth.bytes:
                if key in birth.escaped:
                    outputs[key] += birth.bytes
                else:
                    kept[key].append(birth)
        if birth.recomputed_by is not None and birth.phase == "recompute":
            recomputed[id(birth.recomputed_by)] += birth.bytes
    reports = []
    for key, region in regions.items():
        if region.kind == "function" and not kept[key] and not outputs[key]:
            continue  # a Function that holds nothing (the checkpoints' input savers): not worth a line
        verdict = _verdict(region, kept[key], outputs[key], recomputed[key], key in wraps, bool(output_kept))
        kept_bytes = sum(b.bytes for b in kept[key])
        reports.append(RegionReport(region.name, region.noun, region.kind, _common_prefix(modules[key]),
                                    kept_bytes, outputs[key], recomputed[key], key in wraps, verdict))
    return reports


# NOTE [ Verdicts ]
# One sentence per region from what was measured: what it made and still holds of its own (kept),
# what it hands on (outputs: read after it), what backward allocated to re-run it, and whether it
# made the function's output (the last stage). "Does not lower the peak" is said only where the numbers
# show it: the region keeps nothing of its own, its output is kept by the loss anyway, and being last it
# is re-run first in backward, while everything else the forward kept is still alive. "Allocates" is a
# running total over the re-run (bytes born), not bytes alive at once.
def _verdict(region: _Region, kept: list[_Birth], output_bytes: int, recomputed: int, last: bool,
             output_kept: bool) -> str:
    kept_bytes = sum(b.bytes for b in kept)
    redo = f"re-running it allocates {_size(recomputed)} in total in backward" if recomputed else ""
    if region.kind in ("hooks", "function"):
        copies = sum(b.bytes for b in kept if b.via is region)
        made_copies = f", {_size(copies)} of it copies its pack hook made" if copies else ""
        return f"holds {_size(kept_bytes + output_bytes)} made inside it{made_copies}"
    if last and kept_bytes == 0 and output_kept:
        parts = ["does not lower the peak: it wraps the last stage, whose outputs the loss keeps; backward "
                 "re-runs it first, while the rest of the forward is alive", redo]
    elif region.selective:
        parts = [f"keeps {_size(kept_bytes)} its policy chose{_mostly(kept)} and recomputes the rest", redo]
    elif kept_bytes == 0:
        handed_on = f"its outputs ({_size(output_bytes)}) are kept by what reads them" if output_bytes else ""
        first = "it is the last stage: backward re-runs it first, while the rest of the forward is alive"
        parts = ["keeps only its inputs", handed_on, redo, first if last else ""]
    else:
        parts = [f"keeps {_size(kept_bytes)} of its own besides its outputs{_mostly(kept)}: tensors "
                 "referenced from outside it, or saved by hooks inside it", redo]
    return "; ".join(p for p in parts if p)


def _mostly(births: list[_Birth]) -> str:
    if not births:
        return ""
    groups: dict[tuple[str, str], int] = defaultdict(int)
    for birth in births:
        groups[(birth.op, _pattern(birth.module))] += birth.bytes
    (op, pattern), _ = max(groups.items(), key=lambda kv: kv[1])
    return f" (mostly `{op}` in {pattern or 'no module'})"


def _alive_at(memory: LiveMemory, births: dict[int, _Birth], index: int, grads: set[int]
              ) -> list[tuple[str, int]]:
    """What was alive after event ``index``, grouped by op, module pattern and phase, largest first."""
    groups: dict[str, int] = defaultdict(int)
    for serial in alive_after(memory, index, exclude=grads):
        birth = births.get(serial)
        what = "unattributed"
        if birth is not None:
            op = birth.op + (f"→{birth.written_by}" if birth.written_by else "")
            what = f"`{op}` {_pattern(birth.module) or '-'} ({birth.phase})"
        groups[what] += memory.nbytes(serial)
    return sorted(groups.items(), key=lambda kv: -kv[1])
