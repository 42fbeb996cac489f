"""Exercise 04-scope, reference solution: notebook 04's drafts (a) to (d), each name at its last
definition, assembled by tools/notebook_drafts.py (edit notebooks/src/04_checkpoint_scope.py, then run it)."""

import contextlib
import weakref
from collections import namedtuple

import torch
from torch._C import _current_graph_task_id
from torch._C._autograd import _pop_saved_tensors_default_hooks as pop_hooks
from torch._C._autograd import _push_saved_tensors_default_hooks as push_hooks
from torch._C._autograd import _top_saved_tensors_default_hooks as top_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary


class Slot(int):  # a tensor in a recorded op's arguments: its slot (a type of its own: not an int argument)
    pass


Op = namedtuple("Op", "func args kwargs outputs draw")  # draw: a random op's (generator, its state)


class ScopeTensor(weakref.ref):  # a tensor the scope made with grad on: its tape, slot, version at close
    __slots__ = ("key", "slot", "tape", "version")


SCOPE_TENSORS = {}  # id(tensor) -> its ScopeTensor, for every scope, until the tensor dies


class Tape(TorchDispatchMode):  # one scope's recording: its aten ops, its inputs
    def __init__(self):
        super().__init__()
        self.ops, self.inputs, self.count = [], {}, 0  # Ops; slot -> a tensor from outside (kept); slots
        self.slots, self.alive = WeakIdKeyDictionary(), set()  # tensor -> slot; keys of live scope tensors
        self.last_write, self.replayer = {}, None  # slot -> the last op writing into it in place; (c)
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _current_graph_task_id() != -1:  # a backward's op (a replay's too): not the forward's
            return func(*args, **kwargs)
        generator = kwargs.get("generator") or torch.default_generator  # (CPU; devices: 04b §10)
        random = torch.Tag.nondeterministic_seeded in func.tags  # random: record the generator's state
        draw = (generator, generator.get_state()) if random else None
        out = func(*args, **kwargs)
        for i, arg in enumerate(func._schema.arguments):  # in-place and out= ops write into an argument
            if arg.alias_info is not None and arg.alias_info.is_write:
                written = args[i] if i < len(args) else kwargs[arg.name]
                self.last_write[slot_of(self, written)] = len(self.ops)
        args, kwargs = tree_map_only(torch.Tensor, lambda t: slot_of(self, t), (args, kwargs))
        outputs = [slot_of(self, t, made=True) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.ops.append(Op(func, args, kwargs, outputs, draw))
        return out


def slot_of(tape, tensor, made=False):  # a new slot: for an argument an input, for an output a scope tensor
    if tensor in tape.slots:
        return tape.slots[tensor]  # an in-place op returns its argument: it keeps its slot
    slot = tape.slots[tensor] = Slot(tape.count)
    tape.count += 1
    if not made:
        tape.inputs[slot] = tensor
    elif torch.is_grad_enabled():  # autograd may save it
        entry = SCOPE_TENSORS[id(tensor)] = ScopeTensor(tensor, scope_tensor_died)
        entry.key, entry.tape, entry.slot, entry.version = id(tensor), tape, slot, None
        tape.alive.add(entry.key)
    return slot


class ScopeTensorRef:  # instead of a scope tensor: its tape and slot, how many ops were recorded then
    def __init__(self, tape, slot):
        self.tape, self.slot, self.saved_at, self.round = tape, slot, len(tape.ops), 0
        tape.replayer = tape.replayer or Replayer()
    def unpack(self):
        return self.tape.replayer.serve(self)


class Stored:  # not a scope tensor, and no pair below ours
    def __init__(self, tensor):
        self.tensor = tensor.detach()  # a saved output kept as it is would hold its grad_fn: a cycle
    def unpack(self):
        return self.tensor


class Delegated:  # not a scope tensor: handed to the (pack, unpack) pair below our entry
    def __init__(self, pair, tensor):
        self.unpack_hook, self.packed = pair[1], pair[0](tensor)
    def unpack(self):
        return self.unpack_hook(self.packed)


class PackHook:  # ours: a scope tensor becomes a reference; another goes to the pair below, or is stored
    def __init__(self, below):
        self.below = below  # the (pack, unpack) pair below our entry, or None
    def __call__(self, tensor):
        entry = SCOPE_TENSORS.get(id(tensor))  # the tensor is alive: the entry is its own (see the callback)
        # a scope tensor not written since its scope closed (draft (d) notes the version; None while open)
        if entry is not None and entry.version in (None, tensor._version):
            return ScopeTensorRef(entry.tape, entry.slot)
        return Stored(tensor) if self.below is None else Delegated(self.below, tensor)


def unpack(packed):  # the unpack hook of every entry of ours
    return packed.unpack()


class Replayer:  # the first unpack of a backward replays the tape; the others take from that replay
    def __init__(self):
        self.values, self.round = {}, 0  # the last replay's tensors; replays so far
    def replay(self, tape):
        # a fork: every generator the tape drew from is put back afterwards, the caller's streams go on
        forked = [(op.draw[0], op.draw[0].get_state()) for op in tape.ops if op.draw]
        values = dict(tape.inputs)
        with torch.no_grad():  # a replay builds no graph: autograd wires what we hand out
            for func, args, kwargs, outputs, draw in tape.ops:
                if draw:
                    draw[0].set_state(draw[1])  # the state this op drew from in the forward
                args, kwargs = tree_map_only(Slot, values.__getitem__, (args, kwargs))
                values.update(zip(outputs, tree_leaves(func(*args, **kwargs)), strict=True))
        for generator, state in forked:
            generator.set_state(state)
        self.values, self.round = values, self.round + 1
    def serve(self, ref):
        if ref.tape.last_write.get(ref.slot, -1) >= ref.saved_at:  # autograd refuses it too (03 §1)
            raise RuntimeError("a tensor made in the scope was modified in place after autograd saved it")
        if ref.round == self.round:  # served already (or never replayed): a new backward
            self.replay(ref.tape)
        ref.round = self.round
        return self.values[ref.slot]


class ResidentHooks:  # the open scope's tape, the tapes with scope tensors alive
    open, live = None, set()  # one set for the process (04b §1: one per thread)
    @classmethod
    def restack(cls, drop=None):
        """The stack without drop: while tapes live, our resident entry at the bottom, the rest wrapped."""
        pairs = []  # the stack's entries, top first, as pushed; without our resident entry and drop
        while (top := top_hooks(False)) is not None:
            pop_hooks()
            if not isinstance(top[0], PackHook):
                pairs.append(top)
            elif top[0].below is not None and top[0] is not drop:
                pairs.append(top[0].below)  # a wrapper: the pair it stands for
        if cls.live:
            push_hooks(PackHook(None), unpack)  # the resident entry
        for pair in reversed(pairs):  # while tapes live, each wrapped: scope tensors still come to us
            push_hooks(*((PackHook(pair), unpack) if cls.live else pair))


def scope_tensor_died(entry):
    del SCOPE_TENSORS[entry.key]
    entry.tape.alive.discard(entry.key)
    if not entry.tape.alive and entry.tape is not ResidentHooks.open:
        ResidentHooks.live.discard(entry.tape)
        if not ResidentHooks.live and _current_graph_task_id() == -1:  # in backward: 04b §11
            ResidentHooks.restack()


@contextlib.contextmanager
def gradient_checkpoint_scope():
    if ResidentHooks.open is not None:
        yield  # nested: the outer scope records it all
        return
    entry = PackHook(top_hooks(False))  # what is not a scope tensor goes to the pair below
    push_hooks(entry, unpack)
    tape = ResidentHooks.open = Tape()
    ResidentHooks.live.add(tape)
    try:
        with tape:
            yield
    except BaseException:  # what escaped the failed scope is stored as an ordinary tensor (no version is -1)
        for key in tape.alive:
            SCOPE_TENSORS[key].version = -1
        tape.alive.clear()
        raise
    finally:
        ResidentHooks.open = None
        for key in tape.alive:  # a write after the scope is not on the tape: note the version (see below)
            SCOPE_TENSORS[key].version = SCOPE_TENSORS[key]()._version
        if not tape.alive:
            ResidentHooks.live.discard(tape)
        ResidentHooks.restack(drop=entry)
