"""The recorder: a dispatch mode that writes down, at each storage's birth, what made it.

For every aten op of the step it asks where the op stands (``regions.py``: its regions in forward,
whether backward is re-running one), lets the op run (through ``LiveMemory``, below it, which gives
each new storage its serial: NOTE [ Two modes ] in ``__init__.py``), and stamps each new storage with
a ``_Birth``: the op, the module running, the caller's line, the regions. In forward it also notes
which storages a later op reads from outside the region that made them (NOTE [ Regions ] in
``regions.py``); in backward, the spans of events that re-run or reload a region.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from ckpt_lab._aten import new_storages, op_info, storage_of, tensors_in
from ckpt_lab.explain.regions import _Context, _Region, _Regions
from ckpt_lab.explain.report import Held
from ckpt_lab.instruments.memory import LiveMemory


class _Birth:
    """What was known about a storage when an op made it."""

    __slots__ = ("bytes", "chain", "device", "dtype", "escaped", "line", "module", "node", "op", "phase",
                 "recomputed_by", "shape", "span_kind", "stage", "via", "written_by")

    def __init__(self, op: str, tensor: torch.Tensor, nbytes: int, context: _Context, stage: str) -> None:
        self.op, self.bytes, self.stage = op, nbytes, stage
        self.shape, self.dtype, self.device = tuple(tensor.shape), tensor.dtype, tensor.device
        self.chain, self.module, self.line = context.chain, context.module, context.line
        self.via, self.node = context.via, context.node
        self.recomputed_by = context.recompute
        self.span_kind = context.span_kind  # "recompute", "reload" or None
        # "forward", "loss", "backward", or "recompute" for a storage a re-run made.
        self.phase = "recompute" if context.span_kind == "recompute" else stage
        # ids of the regions of ``chain`` that a forward op outside them read it from: NOTE [ Regions ].
        self.escaped: set[int] = set()
        self.written_by = ""


class _Recorder(TorchDispatchMode):
    """Stamps every storage an op makes with its op, module, line and regions; notes which storages
    leave their region, and when backward recomputes."""

    def __init__(self, memory: LiveMemory, names: dict[torch.nn.Module, str]) -> None:
        super().__init__()
        self.memory = memory
        self.stage = "forward"  # then "loss", then "backward"
        self.births: dict[int, _Birth] = {}  # by serial
        # id(storage) -> (weak reference, serial): which storage an op reads, without keeping it alive.
        self.by_storage: dict[int, tuple[weakref.ref, int]] = {}
        self.regions = _Regions()
        self.parameters: dict[int, Held] = {}
        self.modules = _ModuleStack(names, self.parameters)
        self.spans: list[list[Any]] = []  # [start, stop, kind, region]
        self.span_open = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        backward = self.stage == "backward"
        context = self.regions.context(backward, self.modules.current())
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


# ----------------------------------------------------------------------------------- module paths
class _ModuleStack:
    """The module running now, by path, from global forward hooks (which also see the modules a
    checkpoint re-runs in backward); the parameters of every module that runs."""

    def __init__(self, names: dict[torch.nn.Module, str], parameters: dict[int, Held]) -> None:
        self.names = names  # module -> path; modules outside the root are added as they first run
        self.parameters = parameters
        self.counts: dict[str, int] = defaultdict(int)
        self.threads = threading.local()

    def current(self) -> str:
        stack = self._stack()
        return stack[-1][1] if stack else ""

    def enter(self, module: torch.nn.Module, args: Any) -> None:
        stack = self._stack()
        path = self.names.get(module)
        if path is None:
            path = self.names[module] = self._unnamed_path(module, stack[-1] if stack else None)
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in self.parameters:
                self.parameters[id(p)] = held(f"{path}.{name}".lstrip("."), p)
        stack.append((module, path))

    def exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        # Called even when the forward raised (a checkpoint stops its recomputation with an exception
        # inside a module): pop down to this module's entry, whatever was left above it.
        stack = self._stack()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] is module:
                del stack[i:]
                return

    def _unnamed_path(self, module: torch.nn.Module, parent: tuple[torch.nn.Module, str] | None) -> str:
        """A module outside the function's module tree: its attribute name in the module running it;
        else its class and the order of its first call among modules of that class ("Sequential.0"),
        which collapses to "Sequential.*" as layer indices do."""
        if parent is not None:
            for name, child in parent[0].named_children():
                if child is module:
                    return f"{parent[1]}.{name}".lstrip(".")
        kind = type(module).__name__
        self.counts[kind] += 1
        return f"{kind}.{self.counts[kind] - 1}"

    def _stack(self) -> list[tuple[torch.nn.Module, str]]:
        # Per thread: on CUDA, backward (and so recomputation) runs on the device's own thread.
        if not hasattr(self.threads, "modules"):
            self.threads.modules = []
        return self.threads.modules


@contextlib.contextmanager
def module_hooks(modules: _ModuleStack) -> Iterator[None]:
    # Global hooks: they see every module, including those a checkpoint re-runs in backward.
    pre = register_module_forward_pre_hook(modules.enter)
    post = register_module_forward_hook(modules.exit, always_call=True)
    try:
        yield
    finally:
        pre.remove()
        post.remove()


def root_module(function: Any) -> torch.nn.Module | None:
    """The module ``function`` is (or is a bound method of), if any."""
    root = function if isinstance(function, torch.nn.Module) else getattr(function, "__self__", None)
    return root if isinstance(root, torch.nn.Module) else None


def module_names(root: torch.nn.Module | None) -> dict[torch.nn.Module, str]:
    """Paths of ``root``'s modules, by module."""
    return {} if root is None else {m: path for path, m in root.named_modules(remove_duplicate=False)}


def held(name: str, tensor: torch.Tensor) -> Held:
    """A tensor that existed before the call, by name."""
    storage = storage_of(tensor)
    return Held(name, tuple(tensor.shape), tensor.dtype, 0 if storage is None else storage.nbytes())
