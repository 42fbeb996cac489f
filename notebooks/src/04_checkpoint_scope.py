# ---
# jupyter:
#   jupytext:
#     formats: ipynb,src//py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · A scope that names what to recompute: `gradient_checkpoint_scope`
#
# **TL;DR.** `torch.utils.checkpoint` takes a *function* and stores what goes in and comes out.
# RETURNN's `gradient_checkpoint_scope` API page asks for the opposite: *"All tensors created within
# this scope will not be stored for backpropagation, but will be recomputed on the fly."*
#
# ```python
# with gradient_checkpoint_scope():
#     x = a + b
# y = x * c          # x is not stored: backward re-runs a + b
# ```
#
# * A `TorchDispatchMode` records the scope's aten ops on a tape; a pack hook
#   stores a reference instead of a tensor the scope made; the first unpack of a backward replays the
#   tape. `x * c` runs *after* the `with` block, so the hook must outlive it, on a stack where every
#   `__exit__` pops whatever is on top: the scope rebuilds the stack, and restores it when its last
#   tensor dies.
# * §3 builds it in four drafts you can type, each run and its failure measured; together they pass
#   exercise `04-scope` (§4). The package's core, `ckpt_lab/scope_core.py`, is the last draft grown.
#
# **After this notebook you can**
# 1. say where a `TorchDispatchMode` sees ops, and which ops `nn.Linear` arrives as (checked: §1's prediction);
# 2. compare what a scope and a checkpoint keep (checked: §2's prediction);
# 3. build the scope in four drafts, and say when its hooks go (checked: exercise `04-scope`, §3.4's stacks);
# 4. read what is alive at the peak, by role (checked: §5's prediction and ledgers).
#
# [04b](04b_scope_appendix_returnn.ipynb) (optional): what `scope.py` adds, RETURNN's scope case by case.
#
# Terms: the [glossary](glossary.md) ([scope](glossary.md#scope), [pack and unpack
# hooks](glossary.md#pack-unpack), [peak](glossary.md#peak)). The
# **saved-tensors-hooks stack**: the thread-local stack of `(pack, unpack)` pairs that
# `saved_tensors_hooks` pushes; autograd calls the top pair.

# %%
import contextlib
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch._C._autograd import _pop_saved_tensors_default_hooks as pop_hooks
from torch._C._autograd import _push_saved_tensors_default_hooks as push_hooks
from torch._C._autograd import _top_saved_tensors_default_hooks as top_hooks
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckpt_lab
from ckpt_lab import LiveMemory, explain, scope_core
from ckpt_lab import checkpoint as ckpt_lab_checkpoint
from ckpt_lab.bench.workloads import mlp
from ckpt_lab.helpers.predict import reveal
from ckpt_lab.helpers.tensors import all_equal, grads, leaves
from ckpt_lab.instruments.counting import OpCounter

print("torch", torch.__version__)

# %% [markdown]
# Helpers, not the lesson. The saved-tensors-hooks stack has no public reader: `hooks_stack` pops it
# and pushes it back with torch's private `_pop/_push/_top_saved_tensors_default_hooks` (what
# `saved_tensors_hooks` calls). `ckpt_lab.gradient_checkpoint_scope` is the package's scope.

# %%
def hooks_stack():  # bottom first, each entry described
    entries = []
    while (top := top_hooks(False)) is not None:
        pop_hooks()
        entries.append(top)
    for pack, unpack_hook in reversed(entries):
        push_hooks(pack, unpack_hook)
    return [describe(pack) for pack, _ in reversed(entries)]
def describe(pack):
    if type(pack).__name__ == "PackHook":  # the drafts' pack hook (§3)
        return "resident entry (ours)" if pack.below is None else f"ours, others to {describe(pack.below[0])}"
    return getattr(pack, "__name__", type(pack).__name__)
def log_pack(t):  # a user's pack hook
    return t

# %% [markdown]
# ## 1. Below autograd: `TorchDispatchMode`
#
# The [dispatcher](glossary.md#dispatcher) passes every aten op call through an ordered list of
# dispatch keys ([`c10/core/DispatchKey.h`](https://github.com/pytorch/pytorch/blob/v2.13.0/c10/core/DispatchKey.h)):
# autocast's and autograd's keys first, then `Python`, where a `TorchDispatchMode` runs, then the
# kernel's (`CPU`, `CUDA`). So a mode sees ops **below autograd and above the kernels**, and only ops that
# reach that far: a *composite* op (registered as `CompositeImplicitAutograd`, like `aten::linear`)
# has already decomposed into others at the autograd key.

# %%
class LoggingMode(TorchDispatchMode):
    def __init__(self, log):
        super().__init__()
        self.log, self.grad_fn_seen = log, False
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.log.append(func.overloadpacket.__name__)  # logged as the op arrives
        out = func(*args, **(kwargs or {}))
        self.grad_fn_seen |= isinstance(out, torch.Tensor) and out.grad_fn is not None
        return out
_ = torch.manual_seed(0)
lin, x = nn.Linear(4, 3), torch.randn(2, 4, requires_grad=True)

# %% [markdown]
# **Predict.** `lin(x)` calls `F.linear`. Which aten ops does the mode see for it (a list of names)?

# %%
guess = None  # your guess, e.g. ["linear"]

# %%
with LoggingMode(linear_log := []):
    out = lin(x)
reveal(guess, linear_log, "aten ops the mode sees for lin(x)")
print("the node autograd recorded:", type(out.grad_fn).__name__)

# %% [markdown]
# `aten::linear` never reaches the mode: it decomposed into `t` and `addmm` above autograd, which
# recorded an `AddmmBackward0`. Now a whole step, with a `saved_tensors_hooks` logging to the same list:

# %%
log = []
with saved_tensors_hooks(lambda t: log.append("PACK") or t, lambda t: log.append("UNPACK") or t):
    with LoggingMode(log) as mode:
        loss = F.relu(lin(x)).sin().sum()  # relu saves its output, sin its input
        forward_log, log[:] = list(log), []
        loss.backward()
print("forward: ", forward_log)
print("backward:", log)
print("an op's output had a grad_fn down there:", mode.grad_fn_seen)

# %% [markdown]
# Backward's ops pass here too; no output has a `grad_fn`, so an op re-run from here builds no
# graph. The hooks fire one layer up, in autograd: `addmm`'s inputs are packed *before* it reaches
# the mode, `relu`'s output *after*; each `UNPACK` comes before the backward ops that use it.
#
# So the scope records here: a flat list of `(op, arguments)` that replays **without the user's
# Python code** and **without autograd**; when autograd packs a tensor, the mode has already
# recorded the op that made it.
#
# ## 2. Scope versus checkpoint on the API page's example
#
# `x = a + b`, then `y = x * c`; `mul` saves both its inputs. Three placements, each measured by
# the bytes alive after the forward (`x` dropped): a checkpoint around `a + b` only, the API page's
# own `checkpoint(lambda: (a + b) * c)`, and the scope around `a + b`.

# %%
def api_page_example(placement):
    """Live bytes after the forward (the user's x gone), and the gradients."""
    _ = torch.manual_seed(0)
    a, b, c = leaves((1000,), (1000,), (1000,))
    with LiveMemory() as mem:
        y = placement(a, b, c)
        kept = mem.live_bytes
        y.sum().backward()
    return kept, grads(a, b, c)
def in_scope(scope):
    def placement(a, b, c):
        with scope():
            x = a + b
        return x * c
    return placement
placements = {
    "checkpoint around a + b": lambda a, b, c: torch_checkpoint(torch.add, a, b, use_reentrant=False) * c,
    "the page's checkpoint, (a + b) * c": lambda a, b, c: torch_checkpoint(lambda: (a + b) * c,
                                                                           use_reentrant=False),
    "scope around a + b": in_scope(ckpt_lab.gradient_checkpoint_scope),
}
measured = {name: api_page_example(placement) for name, placement in placements.items()}
for name in ("checkpoint around a + b", "scope around a + b"):
    print(f"live bytes after forward, {name}:", measured[name][0])

# %% [markdown]
# **Predict.** The page's own placement, `checkpoint(lambda: (a + b) * c)`: how many bytes are alive
# after its forward?

# %%
guess = None  # your guess, in bytes

# %%
reveal(guess, measured["the page's checkpoint, (a + b) * c"][0], "bytes after the page's checkpoint")
scope_grads = measured["scope around a + b"][1]
print("gradients of the three equal:", all(all_equal(scope_grads, g) for _, g in measured.values()))

# %% [markdown]
# Placed as the page places it, the checkpoint keeps what the scope keeps: `y` (`mul`'s `x` is
# recomputed, `c` is a leaf). Around `a + b` alone it returns `x`, which `mul` then stores. The
# difference is the **shape of the API**: a checkpoint says *what to store* (its inputs and outputs)
# and must be a function that *includes the consumer* `* c`; the scope says *what to recompute*
# and leaves the consumer after the block.

# %% [markdown]
# ## 3. Building the scope, in four drafts
#
# Four drafts to type, cell by cell, into `exercises/04_scope.py`. Each adds to the one before (and
# redefines what it changes), runs here, and has what it still gets wrong measured. Together they
# are exercise `04-scope`'s reference solution, in the names of `ckpt_lab/scope_core.py`.
#
# ### 3.1 Draft (a): the tape
#
# A dispatch mode records each op the scope runs (an `Op`): its arguments with a `Slot` for each
# tensor, the slots of what it returns; it knows a tensor by identity (torch's `WeakIdKeyDictionary`:
# an id alone is reused once its tensor dies). A tensor from outside, an *input*, is kept. What an op
# returns with grad on is a **scope tensor**, registered weakly in `SCOPE_TENSORS` until it dies.
# For §3.3 it also records a random op's generator state and the last in-place write to each slot.
# Ops run inside backward (a replay's too) are not the forward's.

# %% tags=["04-scope-draft"]
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
def scope_tensor_died(entry):  # the weakref's callback (draft (d) adds the release of our hooks)
    del SCOPE_TENSORS[entry.key]
    entry.tape.alive.discard(entry.key)

# %% tags=["04-scope-draft"]
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

# %% tags=["04-scope-draft"]
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

# %%
a, b, c = leaves((1000,), (1000,), (1000,))
with Tape() as tape:
    x = a + b
print("recorded:", [(op.func.overloadpacket.__name__, op.args, op.outputs) for op in tape.ops],
      "| inputs:", list(tape.inputs), "| scope tensors alive:", len(tape.alive))
print("x * c after the tape alone | bytes kept:", api_page_example(in_scope(Tape))[0],
      "| no scope:", measured["checkpoint around a + b"][0])

# %% [markdown]
# The tape alone stores as much as no scope: nothing yet tells autograd not to keep `x`.
#
# ### 3.2 Draft (b): the pack hook returns a reference
#
# For a scope tensor the pack hook (notebook 03 §2) returns a `ScopeTensorRef` (tape, slot) instead;
# anything else goes to the pair that was on top of the stack (`Delegated`), or is `Stored`. Here
# each unpack replays the tape, and the entry is popped as the scope closes. A case all inside the
# `with` block:

# %% tags=["04-scope-draft"]
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

# %% tags=["04-scope-draft"]
class Replayer:  # draft (b): every unpack re-runs the whole tape
    def serve(self, ref):
        values = dict(ref.tape.inputs)
        with torch.no_grad():  # a replay builds no graph: autograd wires what we hand out
            for func, args, kwargs, outputs, _ in ref.tape.ops:
                args, kwargs = tree_map_only(Slot, values.__getitem__, (args, kwargs))
                values.update(zip(outputs, tree_leaves(func(*args, **kwargs)), strict=True))
        return values[ref.slot]
@contextlib.contextmanager
def gradient_checkpoint_scope():  # draft (b): our entry pushed as the scope opens, popped as it closes
    push_hooks(PackHook(top_hooks(False)), unpack)
    try:
        with Tape():
            yield
    finally:
        pop_hooks()

# %%
def inside_case(scope):  # bytes kept, sin's runs in backward, gradients, the next random numbers
    _ = torch.manual_seed(0)
    a, c, g = *leaves((1000,), (1000,)), torch.Generator().manual_seed(5)
    with LiveMemory() as mem:
        with scope():
            x = F.dropout(a.sin(), 0.5) * torch.randn(1000, generator=g)
            loss = (x * x.exp() * c).sum()
        kept = mem.live_bytes
        with OpCounter() as ops:
            loss.backward()
    return kept, ops.counts["sin"], [*grads(a, c), torch.rand(3), torch.randn(3, generator=g)]
def compare(scope):
    (plain_kept, _, plain), (kept, sins, got) = inside_case(contextlib.nullcontext), inside_case(scope)
    print(f"bytes kept {kept:,} (no scope {plain_kept:,}) | sin runs in backward: {sins} | gradients equal:",
          all_equal(plain[:2], got[:2]), "| next numbers equal, the caller's:", torch.equal(plain[2], got[2]),
          "g's:", torch.equal(plain[3], got[3]))
compare(gradient_checkpoint_scope)

# %% [markdown]
# Fewer bytes kept: the scope's tensors are replayed instead. But every unpack replays the whole
# tape (one `sin` per unpack), and each replay draws **new** random numbers, from the caller's
# generator and from `g`: wrong gradients, and both streams moved.
#
# ### 3.3 Draft (c): one replay per backward, with the forward's random numbers
#
# A `Replayer` replays the tape at the first unpack of a backward and serves the others from that
# replay (a reference served already means a new backward). Before each random op it sets the op's
# generator (the default, or the `torch.Generator` passed to it) to the state recorded in the forward,
# and afterwards puts every generator back (a fork, like `fork_rng` in torch's checkpoint).
#
# It also refuses a tensor written in place *after* autograd saved it, as autograd does (notebook 03
# §1; hooks bypass that check, §3): the tensor may be gone by backward, but the tape knows the slot's
# last write (`saved_at`).

# %% tags=["04-scope-draft"]
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

# %%
compare(gradient_checkpoint_scope)
a = leaves((10,))[0]
with gradient_checkpoint_scope():
    x2 = a * 2
    y = x2.sin()  # saves x2 ...
    x2.add_(1)  # ... then writes it
loss = (y + x2).sum()
del x2, y
try:
    loss.backward()
except RuntimeError as error:
    print("x2 written after sin saved it, gone by backward: refused:", error)
print("x * c after the scope, bytes kept:", api_page_example(in_scope(gradient_checkpoint_scope))[0])

# %% [markdown]
# One replay per backward, the plain run's gradients, both streams as they were. But `y = x * c`,
# after the `with` block, still stores `x`: the scope popped its entry when it closed.
#
# ### 3.4 Draft (d): hooks that outlive the `with` block, and when they go
#
# The entry must stay after the scope closes, but not as it is: `saved_tensors_hooks.__exit__` is
# one line, `torch._C._autograd._pop_saved_tensors_default_hooks()`: it pops whatever is on top, so
# an enclosing `saved_tensors_hooks` (`save_on_cpu`, a checkpoint) would pop *ours* and leave its own
# forever. A scope closing with scope tensors alive **rebuilds the stack** (`restack`): a **resident
# entry** of ours at the *bottom*, every entry above it **wrapped** in a `PackHook` whose `below` is
# the original pair. When the last scope tensor dies, the stack is put back. A scope opened inside
# an open one does nothing; after an exception, what escaped the block is an ordinary tensor.

# %% tags=["04-scope-draft"]
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

# %% tags=["04-scope-draft"]
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

# %%
print("x * c after the scope, bytes kept:", api_page_example(in_scope(gradient_checkpoint_scope))[0])
a, c = leaves((100,), (100,))
stacks = {"before": hooks_stack()}
with saved_tensors_hooks(log_pack, lambda t: t):
    stacks["in the user's with"] = hooks_stack()
    with gradient_checkpoint_scope():
        stacks["in the scope"] = hooks_stack()
        x = a.sin()
    stacks["scope closed, x alive"] = hooks_stack()
    y = x * c
stacks["user's with closed"] = hooks_stack()
del x
stacks["x deleted (y's ref is not x)"] = hooks_stack()
y.sum().backward()  # the replay needs no hook on the stack: y's graph holds the reference
print("y's backward after the release, a.grad equals c * cos(a):", torch.equal(a.grad, c * a.detach().cos()))
for moment, stack in stacks.items():
    print(f"{moment:<30}", stack)

# %% [markdown]
# Bottom first: as the scope closes with `x` alive, the resident entry goes to the bottom and
# `log_pack` is wrapped, so the user's `__exit__` pops its own. When `x` died, `scope_tensor_died`
# restacked, *before* backward (`y`'s graph holds a reference, not a hook). Inside a backward the
# engine puts the stack back after each node: draft (d) does not release there (04b §11 does, after).
#
# **A trap: which version.** Draft (d) notes each scope tensor's version as the scope closes, read
# from the tensor itself (`SCOPE_TENSORS[key]()`), so that one written *after* the scope is stored,
# not replayed (the tape lacks that write). Not from a `detach()` kept inside `__torch_dispatch__`:
# autograd's `detach` shares its input's version counter (its ADInplaceOrView kernel makes the result
# a view, `as_view` in torch/csrc/autograd/VariableTypeManual.cpp); below autograd, it gets a fresh one:

# %%
class DetachInside(TorchDispatchMode):  # keeps a detach() of each output, made below autograd
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.alias = (out := func(*args, **(kwargs or {}))).detach()
        return out
with DetachInside() as mode:
    x = torch.ones(3, requires_grad=True).sin()
with torch.no_grad():
    x.mul_(3)
print("versions after x.mul_(3): x", x._version, "| x.detach() made above autograd", x.detach()._version,
      "| the detach() made in __torch_dispatch__", mode.alias._version)

# %% [markdown]
# ### 3.5 From draft (d) to the package's core (a read-along)
#
# `ckpt_lab/scope_core.py` is draft (d) grown, in the same names and parts; 04b teaches what it adds
# (exercise `04b-scope`): per-thread `ResidentHooks`, a release after backward, `storage_slot` for
# views, inputs' versions and each replayed tensor's shape checked, tensors let go once handed out,
# nothing done inside a checkpoint. `ckpt_lab/scope.py`, the core hardened, is measured from §5 on.

# %%
print("ckpt_lab/scope_core.py:", len(inspect.getsource(scope_core).splitlines()), "lines")

# %% [markdown]
# ## 4. Your turn: exercise `04-scope`
#
# Type the drafts into `exercises/04_scope.py` (open it from the file browser), or write your own.
# The cell below grades it with the package's own mechanism checks; each failure names the section
# that teaches the fix.

# %%
from ckpt_lab.exercises import check

check("04-scope", "exercises/04_scope.py")

# %% [markdown]
# ## 5. Memory on a chain of scoped blocks: what is alive at the peak
#
# A scope per block against a checkpoint per block, on four of the benchmark's MLP blocks (Linear,
# GELU, Dropout; width 256, batch 16), loss `h.square().mean()`. Unit: one *block boundary* (a
# block's output). **`explain`**, the package's memory report (notebook
# [07](07_why_memory_did_not_drop.ipynb) introduces it), runs one step under the package's memory
# instruments and reports the bytes *retained* after the forward, the *peak*, and the **peak
# ledger** (`report.peak_ledger`): every storage alive at the peak, its op and its role.

# %%
def scoped(scope):
    def wrap(block, h):
        with scope():
            return block(h)
    return wrap
variants = {"no checkpoint": lambda block, h: block(h), "checkpoint per block": ckpt_lab_checkpoint,
            "scope per block": scoped(ckpt_lab.gradient_checkpoint_scope),
            "scope core per block": scoped(scope_core.gradient_checkpoint_scope)}
unit = 16 * 256 * 4  # one block boundary: batch × width × 4 bytes
def explain_chain(wrap):
    """explain's report on a fresh 4-block MLP, each block wrapped by ``wrap``."""
    stack = mlp(4, width=256, batch=16)
    def forward(h):
        torch.manual_seed(1)  # the same dropout masks for every variant
        for block in stack.blocks:
            h = wrap(block, h)
        return h
    return explain(forward, stack.input, loss_fn=lambda h: h.square().mean())
reports = {name: explain_chain(wrap) for name, wrap in variants.items()}
for name, report in reports.items():
    print(f"{name:<21} retained {report.retained_bytes / unit:5.2f}")

# %% [markdown]
# **Predict.** The scope per block keeps one boundary less than the checkpoint per block. Is its
# peak above, equal to, or below the checkpoint's?

# %%
guess = None  # "above", "equal" or "below"

# %%
peaks = [round(reports[name].peak_bytes / unit, 2) for name in ("scope per block", "checkpoint per block")]
reveal(guess, "above" if peaks[0] > peaks[1] else "equal" if peaks[0] == peaks[1] else "below",
       "the scope's peak against the checkpoint's")
for name, report in reports.items():
    print(f"{name:<21} peak {report.peak_bytes / unit:5.2f}")
for name in ("checkpoint per block", "scope per block"):
    ledger = reports[name].peak_ledger
    print(f"{name}, the peak during {ledger.during}; alive, by role (boundaries):")
    for role, size in ledger.roles.items():
        ops = [row.op for row in ledger.rows if row.label == role]
        print(f"    {size / unit:4.2f}  {role.split(' (')[0]:<40}", *ops)

# %% [markdown]
# **What runs when**, for the scope per block:
#
# 1. **Forward.** Scope k+1 keeps `h_k`, its input: `h1`–`h3` are retained (the three `mul` above,
#    dropout's outputs); `h4` is freed (the loss saved a reference into scope 4).
# 2. **The loss's backward** unpacks `h4`: scope 4's *first* replay runs block 4 again from `h3`
#    (`addmm`, `gelu`, the mask, `mul`) beside the loss's first temporary, `div`: **the peak**,
#    3 + 4 + 1 = 8. It hands `h4` over and keeps only `addmm` for block 4's own backward.
# 3. **Block 4's backward** replays GELU's output and the mask from `addmm`; its Linear unpacks `h3`:
#    scope 3 replays; and so on.
#
# The checkpoint's peak: `h1`–`h4` beside the loss's 4 temporaries. The core replays all at once
# (04b §8).

# %% [markdown]
# ## 6. On a GPU
#
# What changes there (every device's generator, the caching allocator, backward in a device thread)
# is in 04b §10 and §11, with a case run on CUDA when there is one.

# %% [markdown]
# ## 7. Where the scope's assumptions end
#
# A scope tensor, wherever it is saved, is recomputed from the record. So a write the scope cannot
# see gives different gradients **silently**: write through `.data` after the scope (no version
# counter sees a `.data` write), and the replay rebuilds the value from before the write. Under
# `torch.no_grad()` instead, the version moves and draft (d)'s check stores the tensor:

# %%
ckpt_lab_scope = ckpt_lab.gradient_checkpoint_scope
def write_case(scope, via_data):
    _ = torch.manual_seed(0)
    a, c = leaves((1000,), (1000,))
    with scope():
        w = a.sin()
    with torch.no_grad():  # a write that moves w's version; through .data, one that does not
        (w.data if via_data else w).mul_(3)
    (w * c).sum().backward()
    return grads(a, c)
for name, via_data in {"through .data": True, "under no_grad": False}.items():
    plain, got = (write_case(scope, via_data) for scope in (contextlib.nullcontext, ckpt_lab_scope))
    print(f"{name:<13} a.grad equal: {torch.equal(plain[0], got[0])} |",
          f"c.grad equal: {torch.equal(plain[1], got[1])} | c.grad, scope / plain:",
          round((got[1] / plain[1]).mean().item(), 3))

# %% [markdown]
# 04b §3 and §4 measure the other limits: ops the tape leaves out, and aliases.

# %% [markdown]
# ## Summary
#
# | question | answer | shown by |
# |---|---|---|
# | What does a `TorchDispatchMode` see? | aten ops below autograd, composites decomposed (`t`, `addmm`) | §1 |
# | Scope or checkpoint? | the scope names what to recompute; a checkpoint what to store, consumer included | §2: 4,000 vs 8,000 bytes |
# | How is it built? | a tape; a reference; one replay per backward, random ops from recorded states; a resident entry | §3 |
# | A chain of scoped blocks? | one boundary less kept than a checkpoint per block, the same peak | §5: 3 vs 4; 8 vs 8 |
# | Where does it end? | a `.data` write after the scope: silently wrong gradients | §7 |
#
# **Next (optional):** [04b](04b_scope_appendix_returnn.ipynb): what `scope.py` adds to the core,
# with RETURNN's scope on the same cases; exercise `04b-scope` grades it.
