"""``explain``: what a forward keeps for backward, who made it, and what each checkpoint changed.

One call runs one forward and one backward and says, storage by storage, what stayed alive between
them::

    report = ckpt_lab.explain(model, x)          # or explain(fn, x, loss_fn=...)
    print(report.summary())                      # the largest holders, a verdict per checkpoint
    report.saved                                 # one row per storage kept: op, module, line, region
    report.plot()                                # live bytes over forward and backward, the peak

or, from a shell, ``python -m ckpt_lab.explain MODULE:FACTORY [--plot out.png]``.

NOTE [ Storages, not saved tensors ]
A ``saved_tensors_hooks`` pack hook is blind to everything a checkpoint saves inside its *own*
hooks (only the innermost hooks run). So the report is built from storages: ``LiveMemory`` (the
instrument every notebook measures with) records every storage an aten op creates and frees, and
a dispatch mode of ours, above it, writes down at each storage's birth what made it: the aten op,
the module running (global forward hooks keep a stack of module paths), the caller's source line,
and the *regions* it was made in (NOTE [ Regions ]). What is alive when the forward ends is what
the forward kept: ``retained_bytes == sum of report.saved + the loss (+ the output, if the loss
keeps it)``, to the byte, and the same numbers as ``measure_memory``.

How a region is recognised (``_Recorder._context``):

* a hook-based checkpoint (torch's ``use_reentrant=False``, ``ckpt_lab.checkpoint``, and what is
  built on them: selective, sequential, the planner) by its pack hook on the saved-tensor hooks
  stack, the way ``gradient_checkpoint_scope`` recognises one (``ckpt_lab.scope._recomputes_region``);
* selective checkpointing by the frame of its caching dispatch mode (torch's or ours);
* a reentrant checkpoint by the frame of its ``autograd.Function``'s ``forward``; other Functions
  are named as what they are;
* ``gradient_checkpoint_scope`` by the frame of its recording mode; other saved-tensor hooks by
  their pack hook: offloading ones (``save_on_cpu``, ``offload_to_cpu``) are named so, the rest are
  an *unknown region* (RETURNN's scope, a logger): what their pack hook keeps is theirs to know.

Blind spots:

* alive is not always needed: a tensor the user keeps (stored on a module, in a list) is listed like
  one autograd saved, under the op that made it;
* memory no aten op makes (``torch.get_rng_state`` snapshots, allocator slack), and tensors made
  before the call (parameters and inputs: listed apart, never counted): ``LiveMemory``'s blind spots;
* a hook-based region opened *inside* a custom Function's forward is listed outside it; which scope
  a replay belongs to is known only through ``ckpt_lab.scope``'s internals (else "unknown region");
* recomputation in backward is found by grad mode (backward runs its nodes with grad off) and by the
  unpack hooks seen in forward: a re-run with grad off outside them counts as ordinary backward work;
* modules outside the function's own module tree (a plain function calling modules) are named by
  class and order of first call (``Sequential.0``); pass a module, or a bound method of one, for
  real paths (``layers.3.linear1``).

NOTE [ The function and the package ]
``ckpt_lab`` exports the function ``explain`` under this package's name, so ``ckpt_lab.explain(...)``
calls it, and ``python -m ckpt_lab.explain`` runs ``__main__.py`` here (a plain module of that name,
imported by ``ckpt_lab`` itself, would run twice under ``-m``). Import the rest from the package:
``from ckpt_lab.explain import Report``; ``from ckpt_lab.explain.examples import stack``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import sysconfig
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch._C._autograd import (
    _pop_saved_tensors_default_hooks,
    _push_saved_tensors_default_hooks,
    _saved_tensors_hooks_is_enabled,
    _top_saved_tensors_default_hooks,
)
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from ckpt_lab import reentrant, selective
from ckpt_lab import scope as scope_module
from ckpt_lab._aten import new_storages, op_info, storage_of, tensors_in
from ckpt_lab.instruments.memory import LiveMemory
from ckpt_lab.scope import _recomputes_region

__all__ = ["Held", "RegionReport", "Report", "SavedRow", "Span", "Timeline", "explain"]


# =================================================================================== entry point
def explain(
    function: Callable[..., Any], *args: Any, loss_fn: Callable[[Any], Any] | None = None, **kwargs: Any
) -> Report:
    """Run ``function(*args, **kwargs)`` and its backward once; report what the forward kept.

    The loss is ``loss_fn(output)`` (summed if not a scalar), else the sum of the output's tensors.
    Gradients land in ``.grad`` as after any training step; nothing else is left behind.
    """
    root = _root(function)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_start = torch.cuda.memory_allocated()
    memory = LiveMemory()
    recorder = _Recorder(memory, _module_names(root))
    # All of the root's parameters (MultiheadAttention reads its out_proj's without calling it), and
    # those of any other module that runs.
    for name, p in [] if root is None else root.named_parameters():
        recorder.parameters[id(p)] = _held(name, p)
    # NOTE [ Two modes ]
    # LiveMemory is entered first, so it sits below our mode: each op reaches us first, we let it
    # run (through LiveMemory, which gives each new storage its serial), then read the serials back
    # (``serial_of``) and write down who made each storage. Modes entered later (a selective
    # checkpoint's, a scope's) sit above both: we see the ops they run, and their frames.
    with memory, recorder, _module_hooks(recorder):
        output = function(*args, **kwargs)
        recorder.stage = "loss"
        output_serials = recorder.serials_of(output)
        loss = _loss(output, loss_fn)
        # Only the graph may keep the output now: alive at the snapshot means the loss keeps it.
        del output
        retained = memory.snapshot("after forward")
        alive = memory.born_in("forward")
        loss_serials = recorder.serials_of(loss)
        forward_events = len(memory.events)
        memory.phase = recorder.stage = "backward"
        loss.backward()
        del loss
        memory.snapshot("after backward")
    cuda_peak = torch.cuda.max_memory_allocated() - cuda_start if cuda else None
    return _build_report(
        recorder, retained, alive, output_serials, loss_serials, forward_events, cuda_peak, args, kwargs
    )


def _loss(output: Any, loss_fn: Callable[[Any], Any] | None) -> torch.Tensor:
    if loss_fn is not None:
        loss = loss_fn(output)
    else:
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if not tensors:
            raise ValueError("explain: the output has no tensor that requires grad: no backward to run.")
        # Not sum(...): its start value 0 would add one more op (and a storage) to the report.
        loss = tensors[0].sum()
        for t in tensors[1:]:
            loss = loss + t.sum()
    return loss if loss.dim() == 0 else loss.sum()


# ======================================================================================= the report
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
        dtype = str(self.dtype).removeprefix("torch.")
        shape = "x".join(map(str, self.shape)) or "scalar"
        op = self.op + (f"→{self.written_by}" if self.written_by else "")
        return (
            f"{_size(self.bytes):>10}  {dtype}[{shape}]".ljust(36)
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

    @property
    def saved_bytes(self) -> int:
        return sum(row.bytes for row in self.saved)

    def summary(self, top: int = 5) -> str:
        """A few lines: the totals, the largest holders grouped across layers, a verdict per region."""
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

    def table(self) -> str:
        """Every kept storage, one line each, in the order they were made."""
        return "\n".join(row.describe() for row in self.saved)

    def plot(self, ax: Any = None) -> Any:
        """Live MiB over forward and backward, recompute spans shaded, the peak marked and explained."""
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
        alive = "\n".join(f"{_size(size):>10}  {what}" for what, size in t.at_peak[:6])
        ax.text(0.01, 0.98, "alive at the peak:\n" + alive, transform=ax.transAxes, va="top", fontsize=7,
                family="monospace", bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
        ax.set_xlabel("LiveMemory event (a storage born or freed)")
        ax.set_ylabel("MiB")
        ax.legend(loc="upper right", fontsize=7)
        return ax


# ===================================================================================== recording
# NOTE [ Regions ]
# A region is one checkpoint call, one scope, one saved-tensor hooks context or one custom Function
# forward: whatever decides what becomes of the tensors made inside it. Each storage is stamped with
# the chain of regions it was born in (outermost first). A storage made inside a region and read by
# a forward op *outside* it is one of the region's outputs (the next layer's input, the loss's); one
# never read outside is something the region keeps of its own (a selective checkpoint's cached
# matmul, a tensor a hook inside it stored). Nothing is inferred from names: what a region keeps is
# what is alive, and what it hands on is what was read.
@dataclass(eq=False)
class _Region:
    kind: str  # "checkpoint", "reentrant", "scope", "hooks", "function"
    what: str  # "checkpoint", "offload hooks", "saved_tensors_hooks", ...
    by: str  # whose: "torch.utils.checkpoint", "offload_to_cpu", ... ("" where it goes without saying)
    number: int  # 1, 2, ... per kind, in the order first seen
    selective: bool = False  # a checkpoint whose forward ran a selective-checkpointing caching mode

    @property
    def noun(self) -> str:
        """What it is, not which one: "selective checkpoint (torch.utils.checkpoint)"."""
        return ("selective " if self.selective else "") + self.what + (f" ({self.by})" if self.by else "")

    @property
    def name(self) -> str:
        """Which one: "checkpoint #3 (torch.utils.checkpoint)"."""
        what = ("selective " if self.selective else "") + self.what
        return f"{what} #{self.number}" + (f" ({self.by})" if self.by else "")


@dataclass(frozen=True)
class _Context:
    """Where an op stands when it runs."""

    chain: tuple[_Region, ...] = ()  # forward only: its regions, outermost first
    module: str = ""
    line: str = ""
    via: _Region | None = None  # forward only: run by this region's pack hook (an offloaded copy)
    span_kind: str | None = None  # backward only: "recompute" or "reload"
    recompute: _Region | None = None  # backward only: the region being recomputed or reloaded, if known


class _Birth:
    """What was known about a storage when an op made it."""

    __slots__ = ("bytes", "chain", "device", "dtype", "escaped", "line", "module", "op", "phase",
                 "recomputed_by", "shape", "stage", "via", "written_by")

    def __init__(self, op: str, tensor: torch.Tensor, nbytes: int, context: _Context, stage: str) -> None:
        self.op, self.bytes, self.stage = op, nbytes, stage
        self.shape, self.dtype, self.device = tuple(tensor.shape), tensor.dtype, tensor.device
        self.chain, self.module, self.line = context.chain, context.module, context.line
        self.via = context.via
        self.recomputed_by = context.recompute
        # "forward", "loss", "backward", or "recompute" for a storage a re-run made.
        self.phase = "recompute" if context.span_kind == "recompute" else stage
        # ids of the regions of ``chain`` that a forward op outside them read it from: NOTE [ Regions ].
        self.escaped: set[int] = set()
        self.written_by = ""


# Frames in these files are machinery; the caller's line is the first frame outside them. The
# benchmark's workloads and explain's examples are model code, so they count as the caller's.
_TORCH_DIR = str(Path(torch.__file__).parent)
_CKPT_LAB_DIR = str(Path(__file__).resolve().parents[1])
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_SITE_DIRS = (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])
_MODEL_FILES = (
    str(Path(_CKPT_LAB_DIR) / "bench" / "workloads.py"),
    str(Path(_CKPT_LAB_DIR) / "explain" / "examples.py"),
)

# Frames whose presence tells something about the op running below them. (unwrap: torch wraps
# every mode's __torch_dispatch__ in a decorator that disables dynamo.)
_SELECTIVE_FORWARD = {
    inspect.unwrap(torch_checkpoint._CachingTorchDispatchMode.__torch_dispatch__).__code__,
    inspect.unwrap(selective._SaveMode.__torch_dispatch__).__code__,
}
_REENTRANT_FORWARD = {
    torch_checkpoint.CheckpointFunction.forward.__code__: "torch.utils.checkpoint",
    reentrant.CheckpointFunction.forward.__code__: "ckpt_lab.reentrant_checkpoint",
}
# The scope's recording mode, its unpack hook and the class of its hooks-stack entries, looked up
# defensively: were they renamed, scope tensors would show as "not inside any checkpoint" or as an
# unknown region, never as something they are not.
_SCOPE_RECORDING = getattr(
    inspect.unwrap(getattr(getattr(scope_module, "_RecordingMode", None), "__torch_dispatch__", None)),
    "__code__",
    None,
)
_SCOPE_UNPACK = getattr(getattr(scope_module, "_unpack", None), "__code__", None)
_SCOPE_ENTRY = getattr(scope_module, "_PackHook", ())
# Saved-tensor hooks known to move tensors elsewhere (torch's and ours), by ``_hook_name``.
_OFFLOAD_NAMES = {"save_on_cpu", "offload_to_cpu"}
# The public names of the modules whose pack hooks say "checkpoint".
_CHECKPOINT_NAMES = {
    "torch.utils.checkpoint": "torch.utils.checkpoint",
    "ckpt_lab.nonreentrant": "ckpt_lab.checkpoint",
}


class _Recorder(TorchDispatchMode):
    """Stamps every storage an op makes with its op, module, line and regions; notes which storages
    leave their region, and when backward recomputes."""

    def __init__(self, memory: LiveMemory, names: dict[torch.nn.Module, str]) -> None:
        super().__init__()
        self.memory = memory
        self.names = names  # module -> path; modules outside the root are added as they first run
        self.stage = "forward"  # then "loss", then "backward"
        self.births: dict[int, _Birth] = {}  # by serial
        # id(storage) -> (weak reference, serial): which storage an op reads, without keeping it alive.
        self.by_storage: dict[int, tuple[weakref.ref, int]] = {}
        # id(object) -> (weak reference or None, region), for the objects a region is known by: its
        # pack hook, its unpack hook's closure, its Function's ctx, its scope's recording.
        self.regions: dict[int, tuple[weakref.ref | None, _Region]] = {}
        self.counts: dict[str, int] = defaultdict(int)
        # Code of the hooks seen in forward: a frame running one is inside that hook.
        self.pack_codes: set[Any] = set()
        self.unpack_codes: set[Any] = {_SCOPE_UNPACK}
        self.spans: list[list[Any]] = []  # [start, stop, kind, region]
        self.span_open = False
        self.threads = threading.local()
        self.parameters: dict[int, Held] = {}

    # ------------------------------------------------------------------------------ every op
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        backward = self.stage == "backward"
        context = self._context(backward)
        if not backward:
            self._note_reads(args, kwargs, context.chain)
        start = len(self.memory.events)
        out = func(*args, **kwargs)
        fresh = new_storages(args, kwargs, out)
        for index, tensor in enumerate(tensors_in(out)):
            storage = fresh.pop(id(storage_of(tensor)), None)
            if storage is not None:
                self._note_birth(func, index, tensor, storage, context)
        if backward:
            self._note_span(start, len(self.memory.events), context)
        elif func._schema.is_mutable:
            self._note_writes(func, args, kwargs)
        return out

    def _note_birth(self, func: Any, index: int, tensor: torch.Tensor, storage: Any, context: _Context
                    ) -> None:
        serial = self.memory.serial_of(tensor)
        op = func.overloadpacket.__name__ + (f".{index}" if index else "")
        self.births[serial] = _Birth(op, tensor, self.memory.nbytes(serial), context, self.stage)
        self.by_storage[id(storage)] = (weakref.ref(storage), serial)

    def _note_reads(self, args: tuple, kwargs: dict, chain: tuple[_Region, ...]) -> None:
        """A forward op reading a storage made in regions it is not inside: it left those regions."""
        for tensor in tensors_in((args, kwargs)):
            birth = self._birth_of(tensor)
            if birth is not None and birth.chain:
                birth.escaped.update(id(r) for r in birth.chain if r not in chain)

    def _note_writes(self, func: Any, args: tuple, kwargs: dict) -> None:
        """The first in-place op into a new storage says what it holds: dropout's mask is an
        ``empty_like`` filled by ``bernoulli_``."""
        for tensor, _ in op_info(func).written(args, kwargs):
            birth = self._birth_of(tensor)
            if birth is not None and not birth.written_by:
                birth.written_by = func.overloadpacket.__name__

    def _note_span(self, start: int, stop: int, context: _Context) -> None:
        """Extend the open recompute (or reload) span, or open one, or close it."""
        if context.span_kind is None:
            self.span_open = False
            return
        last = self.spans[-1] if self.spans else None
        if self.span_open and last[2] == context.span_kind and last[3] is context.recompute:
            last[1] = stop
        else:
            self.spans.append([start, stop, context.span_kind, context.recompute])
        self.span_open = True

    def _birth_of(self, tensor: torch.Tensor) -> _Birth | None:
        storage = storage_of(tensor)
        entry = self.by_storage.get(id(storage))
        # The weak reference tells the storage from a newer one that got the id of a dead one.
        return self.births[entry[1]] if entry is not None and entry[0]() is storage else None

    def serials_of(self, tree: Any) -> set[int]:
        """Serials of the storages behind the tensors in ``tree`` that were made in the run."""
        births = {id(b): s for s, b in self.births.items()}
        found = (self._birth_of(t) for t in tensors_in(tree))
        return {births[id(b)] for b in found if b is not None}

    # ------------------------------------------------------------------------------ modules
    def enter_module(self, module: torch.nn.Module, args: Any) -> None:
        stack = self._module_stack()
        path = self.names.get(module)
        if path is None:
            path = self.names[module] = self._unnamed_path(module, stack[-1] if stack else None)
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in self.parameters:
                self.parameters[id(p)] = _held(f"{path}.{name}".lstrip("."), p)
        stack.append((module, path))

    def exit_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        # Called even when the forward raised (a checkpoint stops its recomputation with an exception
        # inside a module): pop down to this module's entry, whatever was left above it.
        stack = self._module_stack()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] is module:
                del stack[i:]
                return

    def _unnamed_path(self, module: torch.nn.Module, parent: tuple[torch.nn.Module, str] | None) -> str:
        """A module outside the function's module tree: its attribute name in the module running it;
        else its class and the order of its first call among modules of that class ("Sequential.0"),
        which collapses to "Sequential.*" as layer indices do."""
        if parent is not None:
            for name, child in parent[0]._modules.items():
                if child is module:
                    return f"{parent[1]}.{name}".lstrip(".")
        kind = type(module).__name__
        self.counts["module " + kind] += 1
        return f"{kind}.{self.counts['module ' + kind] - 1}"

    def _module_stack(self) -> list[tuple[torch.nn.Module, str]]:
        # Per thread: on CUDA, backward (and so recomputation) runs on the device's own thread.
        if not hasattr(self.threads, "modules"):
            self.threads.modules = []
        return self.threads.modules

    # ------------------------------------------------------------------------------ regions
    def _context(self, backward: bool) -> _Context:
        """Where the op about to run stands: module, caller's line, and its regions (forward) or
        whether it recomputes (backward). One walk over the Python frames gathers the evidence."""
        stack = self._module_stack()
        module = stack[-1][1] if stack else ""
        line, functions, selective_mode, scope, via, unpacked = "", [], False, None, False, None
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            if not line and _is_callers(code.co_filename):
                line = f"{_file_name(code.co_filename)}:{frame.f_lineno}"
            if backward:
                if unpacked is None and (code in self.unpack_codes or _is_function_method(code, "backward")):
                    unpacked = self._unpacking(frame)
            elif code in _SELECTIVE_FORWARD:
                selective_mode = True
            elif code is _SCOPE_RECORDING and scope is None:
                recording = getattr(frame.f_locals.get("self"), "recording", None)
                # Its replayer is what backward's frames show when this scope's tensors are recomputed.
                replayer = getattr(recording, "replayer", None)
                scope = self._region(recording, "scope", "gradient_checkpoint_scope", "", anchor=replayer)
            elif code in self.pack_codes:
                via = True
            elif _is_function_method(code, "forward"):
                functions.append((code, frame.f_locals.get("ctx")))
            frame = frame.f_back
        if backward:
            return self._backward_context(module, line, unpacked)
        chain = self._hook_chain(scope)
        # Function forwards are taken to be inside the hooks (see the blind spots).
        chain += [self._function_region(code, ctx) for code, ctx in reversed(functions)]
        if selective_mode:
            # The innermost checkpoint is the one whose context_fn entered the caching mode.
            for region in reversed(chain):
                if region.kind == "checkpoint":
                    region.selective = True
                    break
        # An op inside a pack hook runs for the innermost hooks: those of the innermost region.
        return _Context(tuple(chain), module, line, chain[-1] if via and chain else None)

    def _backward_context(self, module: str, line: str, unpacked: tuple[str | None, _Region | None] | None
                          ) -> _Context:
        if unpacked is None and torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:
            # The engine runs its nodes with grad off (no create_graph): an op with grad on is a re-run.
            unpacked = ("recompute", None)
        kind, region = unpacked or (None, None)
        return _Context((), module, line, None, kind, region)

    def _unpacking(self, frame: Any) -> tuple[str | None, _Region | None] | None:
        """A frame of an unpack hook or of a Function's backward: whose is it, does it recompute?
        None if it belongs to no region we know (the walk goes on outwards)."""
        values = frame.f_locals
        if frame.f_code is _SCOPE_UNPACK:
            # What autograd stored for a scope tensor (a _ScopeTensorRef) knows its scope's replayer;
            # other stored values are handed back as they are, or to the hook the scope wrapped.
            replayer = getattr(values.get("packed"), "replayer", None)
            return None if replayer is None else ("recompute", self._known(replayer))
        for value in values.values():
            region = self._known(value)
            if region is None or region.kind == "function":
                continue
            if region.kind == "reentrant":
                # Its backward re-runs the block with grad on, then runs a nested backward with grad off.
                return ("recompute" if torch.is_grad_enabled() else None), region
            return ("reload" if region.kind == "hooks" else "recompute"), region
        return None

    def _hook_chain(self, scope: _Region | None) -> list[_Region]:
        """The regions of the saved-tensor hooks stack, outermost first."""
        entries = _hooks_stack()
        # The scope's hooks-stack entries are its open scope's, its resident one, and wrappers that
        # stand in for other hooks (ckpt_lab/scope.py, section 5). The open scope's is the topmost:
        # entries above it were pushed after it opened, and nothing is wrapped while a scope is open.
        ours = [i for i, (pack, _) in enumerate(entries) if isinstance(pack, _SCOPE_ENTRY)]
        chain: list[_Region] = []
        for i, (pack, unpack) in enumerate(entries):
            if isinstance(pack, _SCOPE_ENTRY):
                if scope is not None and i == ours[-1]:
                    chain.append(scope)
                    continue
                if pack.below is None:
                    continue  # the resident entry: not a region
                pack, unpack = pack.below
            region = self._hook_region(pack, unpack)
            # A wrapper and the hook it wraps are one region.
            if not chain or chain[-1] is not region:
                chain.append(region)
        if scope is not None and scope not in chain:
            chain.append(scope)
        return chain

    def _hook_region(self, pack: Any, unpack: Any) -> _Region:
        region = self._known(pack)
        if region is not None:
            return region
        if _recomputes_region(pack):
            module = getattr(_unwrapped(pack), "__module__", "")
            kind, what, by = "checkpoint", "checkpoint", _CHECKPOINT_NAMES.get(module, module)
        else:
            # Not known to recompute: offloading hooks (named so), a logger, RETURNN's scope, ...
            by = _hook_name(pack)
            kind, what = "hooks", "offload hooks" if by in _OFFLOAD_NAMES else "saved_tensors_hooks"
        # What backward's frames will show of this region: the unpack hook's bound object, or the
        # first object its closure holds (torch's and ours: the checkpoint's frame).
        cells = getattr(unpack, "__closure__", None) or ()
        anchor = getattr(unpack, "__self__", None) or next(
            (c.cell_contents for c in cells if _weakrefable(_cell_contents(c))), None
        )
        region = self._region(pack, kind, what, by, anchor=anchor)
        for hook, codes in ((pack, self.pack_codes), (unpack, self.unpack_codes)):
            code = getattr(_unwrapped(hook), "__code__", None)
            if code is not None:
                codes.add(code)
        return region

    def _function_region(self, code: Any, ctx: Any) -> _Region:
        region = self._known(ctx)
        if region is not None:
            return region
        if code in _REENTRANT_FORWARD:
            by = _REENTRANT_FORWARD[code]
            return self._region(ctx, "reentrant", "reentrant checkpoint", by, anchor=ctx)
        # Any other custom Function (grad is off in its forward too): named, not judged.
        return self._region(ctx, "function", "autograd.Function", type(ctx).__name__.removesuffix("Backward"))

    def _region(self, key: Any, kind: str, what: str, by: str, anchor: Any = None) -> _Region:
        region = self._known(key)
        if region is None:
            self.counts[kind] += 1
            region = _Region(kind, what, by, self.counts[kind])
            for obj in (key, anchor):
                if obj is not None:
                    # Weakly: holding a checkpoint's frame would keep what it keeps alive.
                    self.regions[id(obj)] = (weakref.ref(obj) if _weakrefable(obj) else None, region)
        return region

    def _known(self, obj: Any) -> _Region | None:
        entry = self.regions.get(id(obj)) if obj is not None else None
        if entry is None or (entry[0] is not None and entry[0]() is not obj):
            return None
        return entry[1]


# NOTE [ Reading the hooks stack ]
# torch shows only the top of the thread's saved-tensor hooks stack, so we pop every entry and push
# them back, the same objects in the same order, as ckpt_lab.scope does. Only in forward: in
# backward the engine restores the stack after every node anyway, and there we need no regions.
def _hooks_stack() -> list[tuple[Any, Any]]:
    """This thread's saved-tensor hooks, outermost first."""
    if not _saved_tensors_hooks_is_enabled():
        # Pushing would fail: the top is all we can see.
        top = _top_saved_tensors_default_hooks(True)
        return [] if top is None else [top]
    popped = []
    try:
        while (top := _top_saved_tensors_default_hooks(True)) is not None:
            _pop_saved_tensors_default_hooks()
            popped.append(top)
    finally:
        for pack, unpack in reversed(popped):
            _push_saved_tensors_default_hooks(pack, unpack)
    return popped[::-1]


def _is_callers(filename: str) -> bool:
    if filename in _MODEL_FILES:
        return True
    if filename.startswith((_TORCH_DIR, _CKPT_LAB_DIR)):
        return False
    # The standard library is machinery too (runpy, contextlib), but not the packages installed in it.
    return not filename.startswith(_STDLIB_DIR) or filename.startswith(_SITE_DIRS)


def _file_name(filename: str) -> str:
    # A Jupyter cell's file is a new temporary one in every kernel: "<cell>" keeps outputs stable.
    return "<cell>" if "ipykernel_" in filename else Path(filename).name


def _is_function_method(code: Any, name: str) -> bool:
    """Is this the code of an ``autograd.Function``'s ``forward``/``backward`` (first argument ``ctx``)?"""
    return code.co_name == name and code.co_argcount > 0 and code.co_varnames[0] == "ctx"


def _unwrapped(hook: Any) -> Any:
    # Some hooks are wrapped in decorators (torch._dynamo.disable): the function is underneath.
    return inspect.unwrap(hook) if callable(hook) else hook


def _hook_name(pack: Any) -> str:
    owner = getattr(pack, "__self__", None)
    if owner is not None:
        return type(owner).__name__  # offload_to_cpu, SavedTensorLog: the hooks object's class
    qualname = getattr(_unwrapped(pack), "__qualname__", type(pack).__name__)
    # "save_on_cpu.__init__.<locals>.pack_to_cpu" -> "save_on_cpu"
    return qualname.split(".")[0]


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _weakrefable(obj: Any) -> bool:
    if obj is None:
        return False
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


# ----------------------------------------------------------------------------------- module paths
def _root(function: Any) -> torch.nn.Module | None:
    """The module ``function`` is (or is a bound method of), if any."""
    root = function if isinstance(function, torch.nn.Module) else getattr(function, "__self__", None)
    return root if isinstance(root, torch.nn.Module) else None


def _module_names(root: torch.nn.Module | None) -> dict[torch.nn.Module, str]:
    """Paths of ``root``'s modules, by module."""
    return {} if root is None else {m: path for path, m in root.named_modules(remove_duplicate=False)}


@contextlib.contextmanager
def _module_hooks(recorder: _Recorder) -> Iterator[None]:
    # Global hooks: they see every module, including those a checkpoint re-runs in backward.
    pre = register_module_forward_pre_hook(recorder.enter_module)
    post = register_module_forward_hook(recorder.exit_module, always_call=True)
    try:
        yield
    finally:
        pre.remove()
        post.remove()


def _held(name: str, tensor: torch.Tensor) -> Held:
    storage = storage_of(tensor)
    return Held(name, tuple(tensor.shape), tensor.dtype, 0 if storage is None else storage.nbytes())


# ============================================================================= building the report
def _build_report(
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
    return Report(
        saved=rows,
        parameters=list(recorder.parameters.values()),
        inputs=[_held(f"input {i}", t) for i, t in enumerate(tensors_in((args, kwargs)))],
        loss_bytes=sum(memory.nbytes(s) for s in loss_serials & alive),
        output_bytes=sum(memory.nbytes(s) for s in output_kept),
        retained_bytes=retained,
        peak_bytes=memory.peak(exclude=grads),
        peak_bytes_with_grads=memory.peak(),
        grad_bytes=sum(memory.nbytes(s) for s in grads),
        cuda_peak_bytes=cuda_peak,
        regions=_region_reports(births, alive, output_serials, output_kept),
        timeline=timeline,
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
    (op, pattern), _ = max(_group_births(births).items(), key=lambda kv: kv[1])
    return f" (mostly `{op}` in {pattern or 'no module'})"


def _alive_at(memory: LiveMemory, births: dict[int, _Birth], index: int, grads: set[int]
              ) -> list[tuple[str, int]]:
    """What was alive after event ``index``, grouped by op, module pattern and phase, largest first."""
    alive: set[int] = set()
    for serial, sign, _ in memory.events[: index + 1]:
        if serial not in grads:
            (alive.add if sign > 0 else alive.discard)(serial)
    groups: dict[str, int] = defaultdict(int)
    for serial in alive:
        birth = births.get(serial)
        what = "unattributed"
        if birth is not None:
            op = birth.op + (f"→{birth.written_by}" if birth.written_by else "")
            what = f"`{op}` {_pattern(birth.module) or '-'} ({birth.phase})"
        groups[what] += memory.nbytes(serial)
    return sorted(groups.items(), key=lambda kv: -kv[1])


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


def _group_births(births: list[_Birth]) -> dict[tuple[str, str], int]:
    groups: dict[tuple[str, str], int] = defaultdict(int)
    for birth in births:
        groups[(birth.op, _pattern(birth.module))] += birth.bytes
    return groups


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


def _size(n: int | None) -> str:
    if n is None:
        return "n/a"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    if n >= 2**10:
        return f"{n / 2**10:.1f} KiB"
    return f"{n} B"
