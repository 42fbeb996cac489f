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
# * A `TorchDispatchMode` records the scope's ops below autograd; a pack hook stores a small
#   reference instead of any tensor the scope made; the first unpack in backward replays the
#   recording. Here the scope keeps 4,000 bytes where a checkpoint keeps 8,000 (§2).
# * The hard part: `x * c` runs *after* the `with` block, so the pack hook must outlive it, on a
#   stack where every `__exit__` pops whatever is on top. `ckpt_lab` rebuilds the stack (a
#   *resident entry* at the bottom, wrappers above), without patching torch, and leaves when the
#   last scope tensor dies (§3).
# * On four MLP blocks, a scope per block retains one block boundary *less* than a checkpoint per
#   block (the last output is recomputed) but peaks two *higher*: a scope recomputes all its saved
#   tensors at the first unpack, which comes from the block's consumer, before the block's own
#   backward (§5, with a measured "what runs when").
#
# You will be able to record and replay aten ops, say what a scope keeps and when it recomputes,
# change the saved-tensors-hooks stack safely, and explain the scope's peak.
#
# | question (RETURNN's API page, and this project's) | section |
# |---|---|
# | What are post-autograd aten ops; why record them with a `TorchDispatchMode`? | §1 |
# | How does a scope that names *what to recompute* differ from a checkpoint? | §2 |
# | How can the scope's `saved_tensors_hooks` outlive the `with` block, and be released? | §3 |
# | How does dropout inside the scope recompute identically (RNG fork and reset)? | §4 |
# | What does a chain of scoped blocks keep, what runs when, and why is its peak higher? | §5 |
# | What changes on a GPU? | §6 |
# | Where does RETURNN's own scope fall short (edge cases), and how is each point fixed? | [04b](04b_scope_appendix_returnn.ipynb) (optional) |
#
# Terms: the **saved-tensors-hooks stack** is the thread-local stack of `(pack, unpack)` pairs that
# `saved_tensors_hooks` pushes (autograd calls the top pair); the **resident entry** is our pair,
# left at the *bottom* of that stack after a scope closes, for as long as a scope tensor lives; a
# **graph task** is the autograd engine's state for one `backward()` call
# (`torch._C._current_graph_task_id()` is -1 outside one); a **safe point** is a moment when the
# scope may change the stack: on the thread that owns it, outside its hooks, outside a graph task.
# The code is in `ckpt_lab/scope.py`; `DraftScopeV1` and `DraftScopeV2` are drafts.

# %%
import contextlib
import weakref
from functools import partial
from itertools import pairwise
from types import SimpleNamespace

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch._C._autograd import (
    _pop_saved_tensors_default_hooks,
    _push_saved_tensors_default_hooks,
    _top_saved_tensors_default_hooks,
)
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode

from ckpt_lab import LiveMemory, OpCounter, gradient_checkpoint_scope, measure_memory
from ckpt_lab import checkpoint as ckpt_lab_checkpoint
from ckpt_lab.bench.workloads import mlp
from ckpt_lab.helpers.show import show_source
from ckpt_lab.helpers.tensors import all_equal, grads, leaves
from ckpt_lab.helpers.viz import save_figure
from ckpt_lab.instruments.state import assert_no_global_state as assert_clean  # no hooks, modes, patches left
from ckpt_lab.scope import _PackHook, _restack, _thread

print("torch", torch.__version__)

# %% [markdown]
# Helpers, not the lesson (the stack has no public reader: `hooks_stack` pops it and pushes it back).

# %%
def top_hooks():
    return _top_saved_tensors_default_hooks(False)

def clear_hooks():  # pop whatever a draft left on the stack
    while top_hooks() is not None:
        _pop_saved_tensors_default_hooks()

def hooks_stack():  # bottom first, each entry described
    entries = []
    while (top := top_hooks()) is not None:
        _pop_saved_tensors_default_hooks()
        entries.append(top)
    for pack, unpack in reversed(entries):
        _push_saved_tensors_default_hooks(pack, unpack)
    return [describe(pack) for pack, _ in reversed(entries)]

def describe(pack):
    if isinstance(pack, _PackHook):
        return "resident entry (ours)" if pack.below is None else f"ours, others to {describe(pack.below[0])}"
    return getattr(pack, "__name__", type(pack).__name__)

# %% [markdown]
# ## 1. Below autograd: `TorchDispatchMode`
#
# A `TorchDispatchMode` sees every op at the bottom of PyTorch's dispatcher, *after* autograd has
# done its part. A tiny logging mode of our own:

# %%
class LoggingMode(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.grad_fn_seen = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(func.overloadpacket.__name__)
        self.grad_fn_seen |= isinstance(out, torch.Tensor) and out.grad_fn is not None
        return out

lin, x = nn.Linear(4, 3), torch.randn(2, 4, requires_grad=True)
with LoggingMode() as forward_log:
    loss = F.relu(lin(x)).sin().sum()  # relu saves its output, sin its input
with LoggingMode() as backward_log:
    loss.backward()
print("forward: ", forward_log.ops)
print("backward:", backward_log.ops)
print("an op's output had a grad_fn down there:", forward_log.grad_fn_seen)

# %% [markdown]
# These are *post-autograd aten ops*: `nn.Linear` arrives as what the backend ran (`t`, `addmm`);
# backward's ops pass through here too; `detach` follows an op that saves its *output* (`relu`), not
# its input (`sin`); and no output has a `grad_fn`, so an op re-run from here builds no graph. So
# the scope records here: a flat list of `(op, arguments)` that replays **without the user's Python
# code** (`x = a + b` has long returned when backward needs `x`) and **without autograd**.
#
# ## 2. Scope versus checkpoint on the API page's example
#
# `x = a + b` inside, `y = x * c` after; `mul` saves both inputs. `torch.utils.checkpoint` can only
# wrap `a + b` as a function, whose output `x` `mul` then stores; the scope recomputes `x` itself.
# Live bytes after the forward, with `x` dropped by the user:

# %%
def api_page_example(scope):
    """Live bytes after the forward (the user's x dropped), and the gradients."""
    _ = torch.manual_seed(0)
    a, b, c = leaves((1000,), (1000,), (1000,))
    with LiveMemory() as mem:
        if scope == "checkpoint":
            x = torch.utils.checkpoint.checkpoint(torch.add, a, b, use_reentrant=False)
        else:
            with scope():
                x = a + b
        y = x * c
        del x
        kept = mem.live_bytes
        y.sum().backward()
    return kept, grads(a, b, c)

ckpt_bytes, ckpt_grads = api_page_example("checkpoint")
scope_bytes, scope_grads = api_page_example(gradient_checkpoint_scope)
print("live bytes after forward, torch.utils.checkpoint:", ckpt_bytes, "(x and y)")
print("live bytes after forward, scope:", scope_bytes, "(y only)")
print("gradients equal:", all_equal(ckpt_grads, scope_grads))

# %% [markdown]
# A checkpoint says *what to store* (its inputs and outputs) and recomputes everything between; the
# scope says *what to recompute* (everything made inside it) and leaves the rest to autograd.
#
# ## 3. Building the scope
#
# ### Draft 1: record, hand out handles, replay, and pop the hooks at `__exit__`
#
# A dispatch mode records the ops on a tape; a pack hook recognises a tensor the scope made (by its
# storage) and stores the position of the op that made it; the unpack hook replays the tape under
# `no_grad`. Draft 1 pushes its hooks in `__enter__` and pops them in `__exit__`:

# %%
class Made(int):
    """A tensor argument made by the scope, recorded as the position of the op that made it."""

class DraftTape(TorchDispatchMode):
    """A tape of ops; a tensor the scope made is recorded (and packed, below) as a Made."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tape.append((func, [self.pack(v) if isinstance(v, torch.Tensor) else v for v in args], kwargs))
        self.made[id(out.untyped_storage())] = Made(len(self.tape) - 1)
        return out

    def pack(self, tensor):  # outside tensors are kept as they are
        return self.made.get(id(tensor.untyped_storage()), tensor)

# %%
class DraftScopeV1(DraftTape):
    """Draft 1: the tape's pack hook, pushed in __enter__ and popped in __exit__; unpack replays."""

    def __enter__(self):
        self.tape, self.made = [], {}  # made: id(storage) -> Made (draft: ids of dead storages are reused)
        self.hooks = saved_tensors_hooks(self.pack, self.unpack)
        self.hooks.__enter__()
        return super().__enter__()  # the dispatch mode: start recording

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.hooks.__exit__(*exc)

    def unpack(self, packed):
        if type(packed) is not Made:
            return packed
        values = []
        with torch.no_grad():  # a replay builds no graph
            for func, args, kwargs in self.tape:
                values.append(func(*[values[v] if type(v) is Made else v for v in args], **(kwargs or {})))
        return values[packed]

# %%
print("x * c after the scope | draft 1:", api_page_example(DraftScopeV1)[0], "B | ckpt_lab:",
      scope_bytes, "B | hooks left after draft 1:", top_hooks() is not None)

# %% [markdown]
# `y = x * c` runs after `__exit__` popped the hooks, so `mul` stores `x`: 8,000 bytes, as the
# checkpoint.
#
# ### Draft 2: leave the hooks pushed at `__exit__`
#
# The obvious fix: don't pop. Then `x * c` goes through our pack hook, and `x` is recomputed. But the
# saved-tensors-hooks stack is strictly last-in, first-out, and torch's `saved_tensors_hooks.__exit__`
# is one line, `torch._C._autograd._pop_saved_tensors_default_hooks()`: it checks nothing and pops
# whatever is on top. So inside an enclosing `saved_tensors_hooks` (a user's logging hook,
# `save_on_cpu`, a checkpoint), the enclosing `__exit__` pops *draft 2's* entry, and its own stays:

# %%
class DraftScopeV2(DraftScopeV1):
    """Draft 2: as draft 1, but the hooks stay on the stack after ``__exit__`` (popped by nobody)."""

    def __exit__(self, *exc):
        TorchDispatchMode.__exit__(self, *exc)  # stop recording only

def log_pack(t):
    logged.append(t.shape)
    return t

draft2_bytes, draft2_grads = api_page_example(DraftScopeV2)
print("x * c after the scope | draft 2:", draft2_bytes, "B | gradients equal to the scope's:",
      all_equal(scope_grads, draft2_grads))
clear_hooks()
logged = []
a, b, c = leaves((1000,), (1000,), (1000,))
with saved_tensors_hooks(log_pack, lambda t: t):
    with DraftScopeV2():
        x = a + b
    y = x * c  # c is not a scope tensor: the enclosing hook should see it
    print("packs the enclosing hook saw for x * c (c should be one):", len(logged))
print("stack after both with blocks closed:", hooks_stack())
logged.clear()
z = (a * b).sum()  # long after the user's with block
print("packs by the user's hook *after* its with block:", len(logged))
clear_hooks()
del x, y, z

# %% [markdown]
# Two silent failures: the enclosing hook was bypassed (0 packs, not 1: with `save_on_cpu`, a tensor
# left on the GPU), and the *user's* hook stays active forever.
#
# ### The package: three pieces and one listing
#
#
# * **Recording** (`_RecordingMode`, `_Recording`): draft 1's tape, plus version checks of the
#   outside tensors it reads, views of scope tensors recognised by storage, and in-place writes to
#   outside tensors replayed into a copy (04b, A.6).
# * **Packing** (`_PackHook`, below): a scope tensor becomes a `_ScopeTensorRef`; any other goes to
#   the hook this entry stands in for (`below`), or is stored as autograd would store it.
# * **Replaying** (`_Replayer`): the *first* unpack of a backward replays the recording **once**
#   (no grad, the forward's RNG in a fork, intermediates freed early) and keeps the recomputed
#   tensor of *every* slot a live reference wants: "all at once" decides the peak in §5.
#
# The scope does nothing with grad off, nested, inside backward or inside a checkpoint (04b, A.8).
# The pack hook, less the lines that count the thread's hook depth:

# %%
show_source(_PackHook.__call__, start="owner = ", stop="finally")

# %% [markdown]
# ### The hard part: hooks that outlive the `with` block
#
# An entry of ours must stay after the scope closes, yet every enclosing context must still pop
# *its own* entry. So a scope that closes with its tensors alive rebuilds the stack: a **resident
# entry** of ours at the *bottom*, every entry above it **wrapped** (a `_PackHook` whose `below` is
# the original pair: scope tensors to us, the rest to it). Each `__exit__` pops its wrapper:

# %%
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
y.sum().backward()
del y
stacks["after backward"] = hooks_stack()
for moment, stack in stacks.items():
    print(f"{moment:<30}", stack)

# %%
fig, ax = plt.subplots(figsize=(11, 2.6))
for column, (moment, stack) in enumerate(stacks.items()):
    ax.text(column * 1.6 + 0.72, -0.35, moment, ha="center", va="top", fontsize=7.5, wrap=True)
    for level, name in enumerate(stack or ["(empty)"]):
        role = "scope's entry" if moment == "in the scope" else "wrapper (ours)"
        label = f"{role}\nothers → log_pack" if name[0] == "o" else name.replace(" (ours)", "\n(ours)")
        colour = {"r": "#e6a23c", "o": "#9ecae1", "l": "#c7e9c0"}.get(name[0], "white")
        edge = "black" if stack else "none"
        ax.add_patch(plt.Rectangle((column * 1.6, level), 1.45, 0.9, color=colour, ec=edge))
        ax.text(column * 1.6 + 0.72, level + 0.45, label, ha="center", va="center", fontsize=7.5)
ax.set(xlim=(-0.1, 1.6 * len(stacks)), ylim=(-1.1, 2.1), title="the saved-tensors-hooks stack at each moment")
ax.axis("off")
save_figure(fig, "04_hooks_stack")
plt.close(fig)

# %% [markdown]
# ![the saved-tensors-hooks stack at each moment](../images/04_hooks_stack.png)
#
# When `x`'s storage died (a `weakref` callback; `y`'s saved reference is not `x`), the resident
# entry was taken out: the stack is as if we had never been there. `_restack`'s general case (the
# lines before it handle cases that touch only the top, then pop every entry, as `hooks_stack`
# does):

# %%
show_source(_restack, start="resident = (resident", stop="return resident")

# %% [markdown]
# **Releasing during backward.** The last scope tensor may die inside a graph task, but the engine
# restores the hooks stack after every node, undoing any change made there. A check:

# %%
_push_saved_tensors_default_hooks(log_pack, lambda t: t)
a = torch.randn(3, requires_grad=True)
seen_inside = []
a.register_hook(lambda g: seen_inside.append((_pop_saved_tensors_default_hooks(), top_hooks())[1]))
(a * a).sum().backward()
print("stack top inside backward after the pop:", seen_inside[0])
print("after backward, the popped entry is back:", describe(top_hooks()[0]))
_pop_saved_tensors_default_hooks()
print("clean:", top_hooks() is None)

# %% [markdown]
# So the resident entry is removed only at a **safe point**. Inside backward, `release_if_idle`
# queues a final callback, `_AfterBackward`, that does nothing (it still runs under the engine's
# guard); its use is its *death*: the engine drops it with the graph task after backward returns,
# on the calling thread, and its `__del__` calls `release_if_idle()` there. A case: a second scope
# reads `x`, so its recording keeps `x` until backward releases it.

# %%
a, c = leaves((300,), (300,))
with gradient_checkpoint_scope():
    x = a.sin()
ref = weakref.ref(x.untyped_storage())  # dead exactly when x's memory is freed
with gradient_checkpoint_scope():
    y = (x * x).exp()  # x is an input of this scope: its recording keeps x
z = y * c
del x, y
inside = []
c.register_hook(lambda g: inside.append((torch._C._current_graph_task_id() != -1, top_hooks() is not None)))
print("before backward: x's storage alive:", ref() is not None, "| resident entry:", top_hooks() is not None)
z.sum().backward()
del z
print("inside backward: in a graph task, resident entry still there:", inside[0])
print("after backward: x's storage alive:", ref() is not None, "| hooks stack empty:", top_hooks() is None)

# %% [markdown]
# ## 4. RNG: dropout inside the scope
#
# The scope captures the RNG state when it opens (CPU, and every *initialised* accelerator); the
# replay draws in a `fork_rng`-style fork: the forward's masks, and the caller's stream untouched.

# %%
def dropout_case(scope):
    _ = torch.manual_seed(0)
    a, c = leaves((4, 256), (256,))
    with scope():
        x = F.dropout(F.dropout(a.sin(), p=0.5) * 2, p=0.3)
    (x * c).sum().backward()
    return [*grads(a, c), torch.rand(5)]  # the last: the caller's next random numbers

plain_run, scope_run = dropout_case(contextlib.nullcontext), dropout_case(gradient_checkpoint_scope)
with OpCounter() as ops:
    dropout_case(gradient_checkpoint_scope)
print("gradients bitwise equal (torch.equal):", all_equal(plain_run[:2], scope_run[:2]))
print("next torch.rand(5) equal, RNG stream untouched:", torch.equal(plain_run[2], scope_run[2]))
print("bernoulli_ calls, forward + replay:", ops.counts["bernoulli_"])

# %% [markdown]
# ## 5. Memory on a chain of scoped blocks: what is kept, what runs when
#
# The benchmark (README) found that a scope per block retains *less* than a checkpoint per block
# but peaks *higher*. The same on four of its MLP blocks (Linear, GELU, Dropout; width 256, batch
# 16) and its loss, `h.square().mean()`, which saves the last output. Retained: kept from forward
# to backward; peak: the most alive at once, gradients excluded; unit: one *block boundary*.

# %%
def scoped_block(block, h):
    with gradient_checkpoint_scope():
        return block(h)

def run_chain(stack, wrap, loss=lambda h: h.square().mean(), mem=None):
    torch.manual_seed(1)  # the same dropout masks for every variant
    h = stack.input
    for k, block in enumerate(stack.blocks, 1):
        h = wrap(block, h)
        if mem is not None:
            mem.name_output(h, f"h{k}")
    return loss(h)

chain_variants = {"no checkpoint": lambda block, h: block(h),
                  "ckpt_lab.checkpoint per block": ckpt_lab_checkpoint, "scope per block": scoped_block}

def compare_chain(make_stack, unit, **kwargs):
    """measure_memory for each variant, each on a fresh stack built outside the measurement."""
    chain = {name: measure_memory(partial(run_chain, make_stack(), wrap, **kwargs))
             for name, wrap in chain_variants.items()}
    print(f"unit: one block boundary, {unit:,} bytes")
    for name, r in chain.items():
        print(f"{name:<30} retained {r.retained_bytes / unit:5.2f}   peak {r.peak_bytes / unit:5.2f}")
    per_block, scope = chain["ckpt_lab.checkpoint per block"], chain["scope per block"]
    less = (per_block.retained_bytes - scope.retained_bytes) / unit
    print(f"scope vs checkpoint per block: retained {less:g} boundaries less,",
          f"peak {(scope.peak_bytes - per_block.peak_bytes) / unit:g} higher")

small_mlp, unit = partial(mlp, 4, width=256, batch=16), 16 * 256 * 4  # unit: one block boundary
compare_chain(small_mlp, unit)

# %% [markdown]
# The checkpoint keeps its four outputs (`h4` is saved by `square`); the scope keeps `h1`–`h3`
# (each held by the next scope, which reads it) and recomputes `h4`. For the peak, an instrument
# (next two cells) names every storage: its op, `h1`…`h4` for block outputs, `h1'`…`h4'` for equal
# tensors a recomputation makes (a checkpoint's re-run with grad on, or a replay in a scope hook).

# %%
class NamedMemory(LiveMemory):
    def __init__(self):
        super().__init__()
        self.names, self.outputs, self.kinds = {}, {}, []

    def name_output(self, h, name):
        self.names[self._live[id(h.untyped_storage())]] = name
        with torch.utils._python_dispatch._disable_current_modes():
            self.outputs[name] = h.detach().clone()  # a copy this instrument does not count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = len(self.events)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        # in_hook: one of the scope's hooks (and so its replay) is running
        recompute = self.phase == "backward" and (_thread.in_hook > 0 or torch.is_grad_enabled())
        self.kinds.append((first, "recompute" if recompute else self.phase))
        for serial, sign, _ in self.events[first:]:
            if sign > 0:
                copies = [n for n, t in self.outputs.items() if recompute and isinstance(out, torch.Tensor)
                          and out.shape == t.shape and torch.equal(out, t)]
                self.names[serial] = copies[0] + "'" if copies else func.overloadpacket.__name__
        return out

# %%
def named_timeline(wrap, make_stack=small_mlp, **kwargs):
    """Live bytes after every event (gradients excluded), and the storages of a boundary or more alive."""
    stack = make_stack()
    with NamedMemory() as mem:
        loss = run_chain(stack, wrap, mem=mem, **kwargs)
        mem.phase = "backward"
        loss.backward()
        del loss
    excluded = mem.born_in("backward")  # the .grad of leaves, as measure_memory excludes them
    live, alive, curve, named = 0, set(), [], []
    for serial, sign, _ in mem.events:
        if serial not in excluded:
            live += sign * mem._nbytes[serial]
            (alive.add if sign > 0 else alive.discard)(serial)
        curve.append(live)
        named.append(sorted(mem.names[s] for s in alive if mem._nbytes[s] >= unit // 2))
    return mem, curve, named

# %%
timelines = {name: named_timeline(chain_variants[name]) for name in list(chain_variants)[1:]}
for name, (mem, curve, named) in timelines.items():
    peak_at = curve.index(max(curve))
    print(f"{name}: peak {max(curve) / unit:.2f} boundaries, in {mem.events[peak_at][2]}")
    print("   alive then (a boundary or more):", *named[peak_at])
scope_mem, scope_curve, scope_named = timelines["scope per block"]
print("events at which a block output and its recomputed copy are both alive:",
      sum(any(n + "'" in names for n in names) for names in scope_named))
moments = {}  # the event at which each block output h_k is freed, and at which its copy h_k' is born
for i, (serial, sign, _) in enumerate(scope_mem.events):
    name = scope_mem.names[serial]
    if name[:1] == "h" and name[1:].rstrip("'").isdigit() and (sign < 0) != name.endswith("'"):
        moments.setdefault(name, i)
order = sorted(moments, key=moments.get)
print("scope, in order:", ", ".join(n + (" born" if n.endswith("'") else " freed") for n in order))

# %%
fig, (ax, strip) = plt.subplots(2, 1, figsize=(11, 4.2), sharex=True, height_ratios=[4, 1])
for name, (_, curve, _) in timelines.items():
    ax.step(range(len(curve)), [v / unit for v in curve], where="post", label=name)
for name, i in moments.items():
    ax.annotate(name, (i, scope_curve[i] / unit), xytext=(0, 14 if name.endswith("'") else -16),
                textcoords="offset points", ha="center", fontsize=8, arrowprops={"arrowstyle": "-"})
peak = (scope_curve.index(max(scope_curve)), max(scope_curve) / unit)
ax.annotate("scope's peak: the loss's backward\nunpacks h4, scope 4 replays it all", peak,
            xytext=(40, -6), textcoords="offset points", fontsize=8, arrowprops={"arrowstyle": "->"})
ax.set_ylabel("live (block boundaries)")
ax.legend(loc="upper left", fontsize=8)
colours = {"forward": "#bdbdbd", "recompute": "#e6a23c", "backward": "#6baed6"}
for (start, kind), (stop, _) in pairwise([*scope_mem.kinds, (len(scope_mem.events), "end")]):
    strip.axvspan(start, max(stop, start + 0.6), color=colours[kind], lw=0)
strip.set(yticks=[], ylabel="scope:\nwhat runs", xlabel="event (a storage born or freed)")
handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
strip.legend(handles, ["forward", "replay (recompute)", "backward"], loc="upper right", fontsize=7, ncol=3)
fig.tight_layout()
save_figure(fig, "04_chain_timeline")
plt.close(fig)

# %% [markdown]
# ![live memory over a 4-block chain, checkpoint per block vs scope per block](../images/04_chain_timeline.png)
#
# **What runs when**, for the scope per block (the strip under the plot, the order as printed):
#
# 1. **Forward**, block by block, each in its scope: ops run and are recorded. Scope k+1 keeps
#    `h_k` as an outside input (NOTE [ Inputs are kept, not recomputed ]); what block k+1 and
#    `square` save of `h_k` is a reference into scope k, so `h4` is freed in the forward. Kept for
#    backward: `h1`–`h3` and the loss.
# 2. **The loss's backward** unpacks the first scope tensor (`h4`). Scope 4 replays **at once all
#    that backward still wants of it**: `h4'`, GELU's input (`addmm`), the dropout mask
#    (`empty_like`), while the loss's backward temporaries (`div`, `pow`, `mul`, `mul`) are alive:
#    **the peak**, 10 boundaries.
# 3. **Block 4's backward** uses the replayed tensors; when it has released them, scope 4's
#    recording dies and frees `h3`.
# 4. **Block 4's first Linear** unpacks its input `h3` for the weight gradient, and scope 3
#    replays: `h3'` is born, after `h3` died. Steps 3–4 repeat down to block 1.
#
# The checkpoint keeps `h4` and re-runs block k when block k's own backward unpacks, after the
# consumer's temporaries are gone: its peak, 8, is `h1`–`h4` plus the loss's 4 temporaries.
#
# **Why the scope peaks higher:** *a scope recomputes all of its saved tensors at the first unpack
# of any of them, and that first unpack comes from the block's consumer (the loss here, the next
# block in a stack), whose backward runs before the block's own; so the block's recomputed tensors
# are alive together with the consumer's backward temporaries, where a checkpoint keeps the output
# and recomputes later.* Here: +3 boundaries (`h4'`, GELU's input, the mask) against the one (`h4`)
# the scope did not keep, +2. It is **not** two copies of one tensor alive at once: every block
# output is freed before its recomputed copy is born (printed above: 0 such events).
#
# On a residual stack (`h = h + block(h)`) whose loss, `h.sum()`, saves nothing, the scope retains
# what the checkpoint does and peaks one boundary higher: scope 3 replays while block 4's hidden
# gradient (`gelu_backward`) lives:

# %%
def residual_stack(dim=32):
    _ = torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(4)]
    return SimpleNamespace(blocks=[lambda u, block=block: u + block(u) for block in blocks],
                           input=torch.randn(4, 16, dim, requires_grad=True))

compare_chain(residual_stack, 4 * 16 * 32 * 4, loss=lambda h: h.sum())
_, curve, named = named_timeline(scoped_block, residual_stack, loss=lambda h: h.sum())
print("scope, alive at its peak (a boundary or more):", *named[curve.index(max(curve))])

# %% [markdown]
# ## 6. On a GPU
#
# The cell runs on CUDA when a device is there, else on the CPU, printing the same lines. Bytes come
# from `LiveMemory`; on CUDA they are checked against `torch.cuda.memory_allocated`.

# %%
device = "cuda" if torch.cuda.is_available() else "cpu"
def gpu_case(scope):
    _ = torch.manual_seed(0)
    a, c = (torch.randn(1024, 1024, device=device, requires_grad=True) for _ in range(2))
    with LiveMemory() as mem:
        with scope():
            x = F.dropout(a.sin(), 0.5)
        y = x * c
        before, allocated = mem.live_bytes, torch.cuda.memory_allocated() if device == "cuda" else 0
        del x; freed = before - mem.live_bytes  # noqa: E702
        assert device == "cpu" or allocated - torch.cuda.memory_allocated() == freed
        y.sum().backward()
    return freed, [*grads(a, c), torch.rand(3, device=device)]
plain_freed, plain_run = gpu_case(contextlib.nullcontext)
scope_freed, scope_run = gpu_case(gradient_checkpoint_scope)
print("bytes freed by `del x` | no scope:", plain_freed, "| scope:", scope_freed)
print("gradients and the next random numbers equal:", all_equal(plain_run, scope_run))
print("clean:", assert_clean())

# %% [markdown]
# What changes on a GPU:
#
# * **RNG per device.** The scope captures the generator of the CPU and of *every* initialised
#   accelerator device; one first initialised inside the scope replays from its fresh seed. Like
#   torch's checkpoint, it never initialises CUDA.
# * **The caching allocator.** `memory_allocated` drops when `x` dies (4 MiB here),
#   `memory_reserved` does not; the allocator's peaks include its rounding to block sizes.
# * **Backward runs in a device thread.** A scope tensor (or `_AfterBackward`) dying on the engine's
#   CUDA thread cannot touch the caller's stack: the resident entry stays, merely storing what it is
#   given, until that thread's next safe point (NOTE [ Safe points ]).
#
# Status: the stored outputs come from a CPU; the CUDA path has not run on a GPU yet.

# %% [markdown]
# ## Summary
#
# | question | answer | shown by |
# |---|---|---|
# | What does a `TorchDispatchMode` see; why record there? | post-autograd aten ops, forward and backward (`linear` as `t` + `addmm`), no `grad_fn`: a recording replays without the user's code and without autograd | §1 |
# | Scope or checkpoint? | the scope names what to recompute; a checkpoint names what to store | §2: 4,000 vs 8,000 bytes, equal gradients |
# | Why not pop the hooks at `__exit__`? | `x * c` after the block would store `x` | §3 draft 1: 8,000 bytes |
# | Why not leave them pushed? | the enclosing context pops ours; its own stays forever, and was bypassed | §3 draft 2: 0 packs, user hook left active |
# | How does the package keep its hook? | a resident entry at the bottom, enclosing entries wrapped; each `__exit__` pops its own | §3, `images/04_hooks_stack.png` |
# | When is it released? | when the last scope tensor dies, at a safe point; inside backward, after it returns (`_AfterBackward`'s death) | §3: the engine restores a popped entry; stack empty after backward |
# | Dropout? | same masks in the replay, the caller's RNG stream untouched | §4: `torch.equal` |
# | What does a chain of scoped blocks keep? | one block boundary less than a checkpoint per block: the last output is recomputed | §5: 3 vs 4 boundaries |
# | Why is its peak higher? | a scope replays all its saved tensors at the first unpack, which comes from the block's consumer, before the block's own backward: they overlap the consumer's backward temporaries. Not two copies of one tensor: each output dies before its copy is born | §5: 10 vs 8 boundaries, `images/04_chain_timeline.png`; residual stack +1 boundary |
# | GPU? | RNG per initialised device, allocator, streams, release deferred off the device thread | §6 (run on CPU here) |
#
# **Next (optional):** [04b · our scope against RETURNN's](04b_scope_appendix_returnn.ipynb) runs the
# edge cases (several and nested scopes, enclosing hooks, exceptions, in-place writes, bad replays, a
# scope inside a checkpoint) with both.
