"""Which region an op runs in: the checkpoint, scope, saved-tensor hooks or custom Function whose
tensors it makes (forward), or which one backward is re-running or reloading (backward).

The recorder (``recorder.py``) asks ``_Regions.context`` once per aten op; one walk over the Python
frames gathers the evidence. How each region is recognised:

* a hook-based checkpoint (torch's ``use_reentrant=False``, ``ckpt_lab.checkpoint``, and what is
  built on them: selective, sequential, the planner) by its pack hook on the saved-tensor hooks
  stack, the way ``gradient_checkpoint_scope`` recognises one (``ckpt_lab.scope._recomputes_region``);
* selective checkpointing by the frame of its caching dispatch mode (torch's or ours);
* a reentrant checkpoint by the frame of its ``autograd.Function``'s ``forward``; other Functions
  are named as what they are;
* ``gradient_checkpoint_scope`` by the frame of its recording mode; other saved-tensor hooks by
  their pack hook: offloading ones (``save_on_cpu``, ``offload_to_cpu``) are named so, the rest are
  an *unknown region* (RETURNN's scope, a logger): what their pack hook keeps is theirs to know.
"""

from __future__ import annotations

import inspect
import sys
import sysconfig
import weakref
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from ckpt_lab import reentrant, selective
from ckpt_lab import scope as scope_module
from ckpt_lab.errors import optional
from ckpt_lab.scope import _recomputes_region


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
    node: str = ""  # backward only: the autograd node running ("AddmmBackward0"), if any


# Frames in these files are machinery; the caller's line is the first frame outside them. The
# benchmark's workloads and the examples explain is shown on (ckpt_lab.cases.examples) are model code,
# so they count as the caller's. (Paths only: explain imports neither.)
_TORCH_DIR = str(Path(torch.__file__).parent)
_CKPT_LAB_DIR = str(Path(__file__).resolve().parents[1])
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_SITE_DIRS = (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])
_MODEL_FILES = (
    str(Path(_CKPT_LAB_DIR) / "bench" / "workloads.py"),
    str(Path(_CKPT_LAB_DIR) / "cases" / "examples.py"),
)
# The code of ``explain`` itself (added by the entry point): in backward, a caller's line found
# only beyond it is the line that called ``explain``, not one that made the storage.
ENTRY_CODES: set[Any] = set()

# Frames whose presence tells something about the op running below them. (unwrap: torch wraps
# every mode's __torch_dispatch__ in a decorator that disables dynamo.)
_SELECTIVE_FORWARD = {
    inspect.unwrap(mode.__torch_dispatch__).__code__
    # torch's (private: on a torch without it, torch's selective regions show as plain checkpoints)
    for mode in (optional("torch.utils.checkpoint._CachingTorchDispatchMode"), selective._SaveMode)
    if mode is not None
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


class _Regions:
    """The regions seen so far, by the objects they are known by, and the walk that finds them."""

    def __init__(self) -> None:
        # id(object) -> (weak ref or None, region): its pack hook, unpack closure, Function ctx, recording.
        self.known: dict[int, tuple[weakref.ref | None, _Region]] = {}
        self.counts: dict[str, int] = defaultdict(int)
        # Code of the hooks seen in forward: a frame running one is inside that hook.
        self.pack_codes: set[Any] = set()
        self.unpack_codes: set[Any] = {_SCOPE_UNPACK}

    def context(self, backward: bool, module: str) -> _Context:
        """Where the op about to run stands: caller's line, its regions (forward) or whether it recomputes
        (backward). Called from the recorder's ``__torch_dispatch__``: two frames up ran the op."""
        line, functions, selective_mode, scope, via, unpacked = "", [], False, None, False, None
        past_entry = line_outside = False  # the walk went past explain's own frame; found the line there
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            if not line and _is_callers(code.co_filename):
                line = f"{_file_name(code.co_filename)}:{frame.f_lineno}"
                line_outside = past_entry
            past_entry = past_entry or code in ENTRY_CODES
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
            return self._backward_context(module, "" if line_outside else line, unpacked)
        chain = _hook_chain(self, scope)
        # Function forwards are taken to be inside the hooks (the blind spots in ``__init__.py``).
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
        node = _current_autograd_node() if _current_autograd_node is not None else None
        return _Context((), module, line, None, kind, region, "" if node is None else node.name())

    def _unpacking(self, frame: Any) -> tuple[str | None, _Region | None] | None:
        """A frame of an unpack hook or of a Function's backward: whose is it, does it recompute?
        None if it belongs to no region we know (the walk goes on outwards)."""
        values = frame.f_locals
        if frame.f_code is _SCOPE_UNPACK:
            # What autograd stored for a scope tensor (a _ScopeTensorRef) knows its scope's replayer;
            # other stored values are handed back as they are, or to the hook the scope wrapped.
            replayer = getattr(values.get("packed"), "replayer", None)
            return None if replayer is None else ("recompute", self._lookup(replayer))
        for value in values.values():
            region = self._lookup(value)
            if region is None or region.kind == "function":
                continue
            if region.kind == "reentrant":
                # Its backward re-runs the block with grad on, then runs a nested backward with grad off.
                return ("recompute" if torch.is_grad_enabled() else None), region
            return ("reload" if region.kind == "hooks" else "recompute"), region
        return None

    def hook_region(self, pack: Any, unpack: Any) -> _Region:
        region = self._lookup(pack)
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
        region = self._lookup(ctx)
        if region is not None:
            return region
        if code in _REENTRANT_FORWARD:
            by = _REENTRANT_FORWARD[code]
            return self._region(ctx, "reentrant", "reentrant checkpoint", by, anchor=ctx)
        # Any other custom Function (grad is off in its forward too): named, not judged.
        return self._region(ctx, "function", "autograd.Function", type(ctx).__name__.removesuffix("Backward"))

    def _region(self, key: Any, kind: str, what: str, by: str, anchor: Any = None) -> _Region:
        region = self._lookup(key)
        if region is None:
            self.counts[kind] += 1
            region = _Region(kind, what, by, self.counts[kind])
            for obj in (key, anchor):
                if obj is not None:
                    # Weakly: holding a checkpoint's frame would keep what it keeps alive.
                    self.known[id(obj)] = (weakref.ref(obj) if _weakrefable(obj) else None, region)
        return region

    def _lookup(self, obj: Any) -> _Region | None:
        entry = self.known.get(id(obj)) if obj is not None else None
        if entry is None or (entry[0] is not None and entry[0]() is not obj):
            return None
        return entry[1]


# NOTE [ Reading the hooks stack ]
# torch shows only the top of the thread's saved-tensor hooks stack, so we pop every entry and push
# them back, the same objects in the same order, as ckpt_lab.scope does. Only in forward: in
# backward the engine restores the stack after every node anyway, and there we need no regions.
# torch's private API (ckpt_lab/torch_private.py): on a torch without one of these names, the stack
# reads as empty, and what hooks-based regions made shows as made outside any (never as another's).
_pop_saved_tensors_default_hooks = optional("torch._C._autograd._pop_saved_tensors_default_hooks")
_push_saved_tensors_default_hooks = optional("torch._C._autograd._push_saved_tensors_default_hooks")
_saved_tensors_hooks_is_enabled = optional("torch._C._autograd._saved_tensors_hooks_is_enabled")
_top_saved_tensors_default_hooks = optional("torch._C._autograd._top_saved_tensors_default_hooks")
# The autograd node a backward op runs for (its name is shown; empty on a torch without it).
_current_autograd_node = optional("torch._C._current_autograd_node")


def _hooks_stack() -> list[tuple[Any, Any]]:
    """This thread's saved-tensor hooks, outermost first."""
    if None in (
        _pop_saved_tensors_default_hooks,
        _push_saved_tensors_default_hooks,
        _saved_tensors_hooks_is_enabled,
        _top_saved_tensors_default_hooks,
    ):
        return []  # a torch without one of them (above)
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


def _hook_chain(regions: _Regions, scope: _Region | None) -> list[_Region]:
    """The regions of the saved-tensor hooks stack, outermost first."""
    entries = _hooks_stack()
    # The scope's hooks-stack entries are its open scope's, its resident one, and wrappers that
    # stand in for other hooks (ckpt_lab/scope.py). The open scope's is the topmost: entries
    # above it were pushed after it opened, and nothing is wrapped while a scope is open.
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
        region = regions.hook_region(pack, unpack)
        # A wrapper and the hook it wraps are one region.
        if not chain or chain[-1] is not region:
            chain.append(region)
    if scope is not None and scope not in chain:
        chain.append(scope)
    return chain


# ---------------------------------------------------------------------------------- frames, hooks
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
