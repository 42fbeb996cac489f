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
# * A `TorchDispatchMode` records the scope's aten ops; a pack hook stores a reference instead of a
#   tensor the scope made; the first unpack replays the recording: 4,000 bytes kept, not 8,000 (§2).
# * `x * c` runs *after* the `with` block, so the pack hook must outlive it, on a stack where every
#   `__exit__` pops whatever is on top: `ckpt_lab` rebuilds the stack, without patching torch (§3).
# * On four MLP blocks, a scope per block keeps one block boundary *less* than a checkpoint per
#   block but peaks one *higher*: a scope replays all its saved tensors at the first unpack, which comes
#   from the block's consumer, before the block's own backward: they overlap the consumer's backward
#   temporaries (§5).
#
# | question | section |
# |---|---|
# | What are post-autograd aten ops; why record them with a `TorchDispatchMode`? | §1 |
# | How does a scope that names *what to recompute* differ from a checkpoint? | §2 |
# | How can the scope's `saved_tensors_hooks` outlive the `with` block, and be released? | §3 |
# | How does dropout inside the scope recompute identically (RNG fork and reset)? | §4 |
# | What does a chain of scoped blocks keep, what runs when, and why is its peak higher? | §5 |
# | What changes on a GPU? | §6 |
# | Where do the scope's assumptions end? | §7 |
# | More measurements; where RETURNN's own scope falls short | [04b](04b_scope_appendix_returnn.ipynb) (optional) |
#
# Terms: the **saved-tensors-hooks stack** is the thread-local stack of `(pack, unpack)` pairs that
# `saved_tensors_hooks` pushes (autograd calls the top pair); a **safe point** is a moment when the
# scope may change that stack: on its own thread, outside its hooks, outside a backward. The code is
# in `ckpt_lab/scope.py`; `DraftScopeV1` and `DraftScopeV2` are drafts.

# %%
import contextlib
from itertools import pairwise

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch._C._autograd import _pop_saved_tensors_default_hooks as pop_hooks
from torch._C._autograd import _push_saved_tensors_default_hooks as push_hooks
from torch._C._autograd import _top_saved_tensors_default_hooks
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_lab.scope
from ckpt_lab import LiveMemory, gradient_checkpoint_scope
from ckpt_lab import checkpoint as ckpt_lab_checkpoint
from ckpt_lab.bench.workloads import mlp
from ckpt_lab.helpers.show import show_source
from ckpt_lab.helpers.tensors import all_equal, grads, leaves
from ckpt_lab.helpers.viz import save_figure, show_dot
from ckpt_lab.instruments.memory import measure_memory
from ckpt_lab.scope import inside_scope_hook, is_scope_pack_hook, pack_hook_below

print("torch", torch.__version__)

# %% [markdown]
# Helpers, not the lesson (the stack has no public reader: `hooks_stack` pops it and pushes it back).

# %%
def top_hooks():
    return _top_saved_tensors_default_hooks(False)
def clear_hooks():  # pop whatever a draft left on the stack
    while top_hooks() is not None:
        pop_hooks()
def hooks_stack():  # bottom first, each entry described
    entries = []
    while (top := top_hooks()) is not None:
        pop_hooks()
        entries.append(top)
    for pack, unpack in reversed(entries):
        push_hooks(pack, unpack)
    return [describe(pack) for pack, _ in reversed(entries)]
def describe(pack):
    if is_scope_pack_hook(pack):
        below = pack_hook_below(pack)
        return "resident entry (ours)" if below is None else f"ours, others to {describe(below)}"
    return getattr(pack, "__name__", type(pack).__name__)

# %% [markdown]
# ## 1. Below autograd: `TorchDispatchMode`
#
# A `TorchDispatchMode` sees every op at the bottom of PyTorch's dispatcher, *after* autograd has
# done its part. A tiny logging mode, and a `saved_tensors_hooks` logging to the same list:

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
lin, x, log = nn.Linear(4, 3), torch.randn(2, 4, requires_grad=True), []
with saved_tensors_hooks(lambda t: log.append("PACK") or t, lambda t: log.append("UNPACK") or t):
    with LoggingMode(log) as mode:
        loss = F.relu(lin(x)).sin().sum()  # relu saves its output, sin its input
        forward_log, log[:] = list(log), []
        loss.backward()
print("forward: ", forward_log)
print("backward:", log)
print("an op's output had a grad_fn down there:", mode.grad_fn_seen)

# %% [markdown]
# These are *post-autograd aten ops*: `nn.Linear` arrives as `t`, `addmm`; backward's ops pass
# here too; no output has a `grad_fn`, so an op re-run from here builds no graph. The hooks fire one
# layer up, in autograd: `addmm`'s inputs are packed *before* it reaches the mode, `relu`'s output
# *after*; each `UNPACK` comes before the backward ops that use the tensor:

# %%
order = f"measured, forward:\\l{' → '.join(forward_log)}\\lbackward: {' → '.join(log[:8])} …\\l"
show_dot(f"""digraph {{ node [shape=box, style="rounded,filled", fillcolor=white, fontname=Helvetica];
 edge [fontname=Helvetica, fontsize=10]; py [label="Python: F.relu(lin(x)).sin().sum()"];
 ag [label="autograd kernel\\nbuilds grad_fn, saves tensors"];
 hooks [label="saved_tensors_hooks, top entry\\npack (forward), unpack (backward)\\nscope: _PackHook",
        fillcolor="#9ecae1"];
 mode [label="TorchDispatchMode.__torch_dispatch__\\nLoggingMode here; scope: records (op, args)",
       fillcolor="#e6a23c"];
 aten [label="aten kernel (CPU, CUDA)"]; order [shape=note, fillcolor="#f7f7f7", label="{order}"];
 py -> ag -> mode -> aten; ag -> hooks [label=" inputs: before\\l outputs: after\\l"];
 {{rank=same; ag; hooks}} {{rank=same; aten; order}} }}""", "04_dispatch_layers")

# %% [markdown]
# So the scope records here: a flat list of `(op, arguments)` that replays **without the user's
# Python code** (`x = a + b` has long returned when backward needs `x`) and **without autograd**;
# when autograd packs a tensor, the mode has already recorded the op that made it.
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
# The mode records the ops on a tape; the pack hook stores, for a tensor the scope made (known by
# its storage), the position of the op that made it; the unpack hook replays the tape. Draft 1
# pushes its hooks in `__enter__` and pops them in `__exit__`:

# %%
class Made(int):
    """A tensor argument made by the scope, recorded as the position of the op that made it."""

class DraftScopeV1(TorchDispatchMode):
    """Draft 1: a tape of ops; hooks pushed in __enter__, popped in __exit__; unpack replays the tape."""
    def __enter__(self):
        self.tape, self.made = [], {}  # made: id(storage) -> Made (draft: ids of dead storages are reused)
        self.hooks = saved_tensors_hooks(self.pack, self.unpack)
        self.hooks.__enter__()
        return super().__enter__()  # the dispatch mode: start recording
    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.hooks.__exit__(*exc)
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tape.append((func, [self.pack(v) if isinstance(v, torch.Tensor) else v for v in args], kwargs))
        self.made[id(out.untyped_storage())] = Made(len(self.tape) - 1)
        return out
    def pack(self, tensor):  # a tensor the scope made becomes its Made; any other is kept as it is
        return self.made.get(id(tensor.untyped_storage()), tensor)
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
# `y = x * c` runs after `__exit__` popped the hooks, so `mul` stores `x`: 8,000 bytes.
#
# ### Draft 2: leave the hooks pushed at `__exit__`
#
# Then `x * c` goes through our pack hook. But torch's `saved_tensors_hooks.__exit__` is one line,
# `_pop_saved_tensors_default_hooks()`: it pops whatever is on top. So inside an enclosing
# `saved_tensors_hooks` (a logging hook, `save_on_cpu`, a checkpoint), the enclosing `__exit__` pops
# *draft 2's* entry, and its own stays:

# %%
class DraftScopeV2(DraftScopeV1):
    """Draft 2: as draft 1, but the hooks stay on the stack after ``__exit__`` (popped by nobody)."""
    def __exit__(self, *exc):
        TorchDispatchMode.__exit__(self, *exc)  # stop recording only

def log_pack(t):
    logged.append(t.shape)
    return t

print("x * c after the scope | draft 2:", api_page_example(DraftScopeV2)[0], "B")
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
# Two silent failures: the enclosing hook was bypassed (0 packs, not 1: under `save_on_cpu`, a
# tensor left on the GPU), and the *user's* hook stays active forever.
#
# ### The package: record, pack, replay
#
# * **Recording** (`_RecordingMode`): draft 1's tape, plus version checks of the outside tensors it
#   reads and in-place writes to outside tensors replayed into a copy.
# * **Packing** (`_PackHook`, below): a scope tensor becomes a `_ScopeTensorRef`; any other goes to
#   the hook this entry stands in for (`below`), or is stored as autograd would store it.
# * **Replaying** (`_Replayer`): the *first* unpack of a backward replays the recording **once**, in
#   an RNG fork, and keeps the recomputed tensor of *every* slot a live reference wants: "all at
#   once" decides the peak in §5.
#
# The end of the pack hook, after it has looked the tensor up (`ref` is None unless a scope made it):

# %%
show_source(ckpt_lab.scope, start="if ref is not None", stop="finally")

# %% [markdown]
# ### The hard part: hooks that outlive the `with` block
#
# Our entry must stay after the scope closes, yet every enclosing context must pop *its own*. So a
# scope that closes with its tensors alive rebuilds the stack: a **resident entry** of ours at the
# *bottom*, every entry above it **wrapped** (a `_PackHook` whose `below` is the original pair: scope
# tensors to us, the rest to it). Each `__exit__` pops its wrapper:

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
# When `x`'s storage died (a `weakref` callback), the resident entry was taken out, at a safe point:
# the stack is as if we had never been there (`_restack` rebuilds it). If the last scope tensor dies
# *inside* a backward, the release waits until backward returns (04b, M.1).

# %% [markdown]
# ## 4. RNG: dropout inside the scope
#
# The scope records, before each random op, the state of the generator it draws from (CPU, and
# every *initialised* accelerator); the replay sets that state back before re-running the op, in a
# `fork_rng`-style fork: the forward's masks (even if the code reseeds between them: last cell of
# this section), and the caller's stream untouched. A mode logs each dropout mask (`bernoulli_`) and
# the state before it:

# %%
class DropoutLog(TorchDispatchMode):  # (forward or replay, the CPU generator's state before, the mask)
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        state = torch.get_rng_state()
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ == "bernoulli_":  # a replay runs inside backward's graph task
            in_backward = torch._C._current_graph_task_id() != -1
            draws.append(("replay" if in_backward else "forward", state, out.clone()))
        return out
def dropout_case(scope):
    _ = torch.manual_seed(0)
    a, c = leaves((4, 256), (256,))
    with DropoutLog():
        entry = torch.get_rng_state()  # the generator's state as the scope opens
        with scope():
            x = F.dropout(F.dropout(a.sin(), p=0.5) * 2, p=0.3)
        (x * c).sum().backward()
    return [*grads(a, c), torch.rand(5)], entry  # the last: the caller's next random numbers
draws = []
plain_run, _ = dropout_case(contextlib.nullcontext)
scope_run, entry = dropout_case(gradient_checkpoint_scope)
forward, replay = ([(s, m) for kind, s, m in draws[2:] if kind == k] for k in ("forward", "replay"))
same = [(torch.equal(f[0], r[0]), torch.equal(f[1], r[1])) for f, r in zip(forward, replay, strict=True)]
print("gradients bitwise equal:", all_equal(plain_run[:2], scope_run[:2]), "| next torch.rand(5) equal:",
      torch.equal(plain_run[2], scope_run[2]), "| masks, forward:", len(forward), "replay:", len(replay))
print("replay starts from the state captured at entry:", torch.equal(entry, replay[0][0]),
      "| per mask, (state before, mask) equal to the forward's:", same)

# %%
masks = ""  # per mask, a forward node and a replay node in one column, with the comparisons measured above
for k, ((_, mask), (state_eq, mask_eq)) in enumerate(zip(forward, same, strict=True)):
    masks += (f'f{k} [label="mask {k + 1}: {int(mask.sum())} of {mask.numel()} kept"]; '
              f'r{k} [label="mask {k + 1} again: state before\\nand mask equal: {state_eq}, {mask_eq}"]; '
              f'f{k} -> r{k} [style=dashed]; {{rank=same; f{k}; r{k}}} ')
path = lambda row, first, last: " -> ".join([first, *(f"{row}{k}" for k in range(len(forward))), last])
show_dot(f"""digraph {{ rankdir=LR; node [shape=box, fontname=Helvetica, fontsize=10];
 fs [label="forward: the scope opens,\\ncaptures the CPU state S"]; fe [label="the scope closes"];
 rs [label="backward, first unpack:\\nfork, set S (equal: {torch.equal(entry, replay[0][0])})",
     style=filled, fillcolor="#e6a23c"];
 re [label="the fork ends: the caller's\\nnext torch.rand equal: {torch.equal(plain_run[2], scope_run[2])}"];
 {{rank=same; fs; rs}} {{rank=same; fe; re}} {masks} {path("f", "fs", "fe")}; {path("r", "rs", "re")}; }}""",
         "04_rng_replay")

# %%
def reseeded(scope):  # the code reseeds between two random ops inside the scope
    _ = torch.manual_seed(0)
    a, c = leaves((4, 256), (256,))
    with scope():
        x = F.dropout(a.sin(), p=0.5)
        _ = torch.manual_seed(7)
        x = F.dropout(x, p=0.3)
    (x * c).sum().backward()
    return grads(a, c)
print("reseeded inside the scope, gradients bitwise equal:",
      all_equal(reseeded(contextlib.nullcontext), reseeded(gradient_checkpoint_scope)))

# %% [markdown]
# ## 5. Memory on a chain of scoped blocks: what is kept, what runs when
#
# The benchmark (README) found that a scope per block retains *less* than a checkpoint per block but
# peaks *higher*. Here on four of its MLP blocks (Linear, GELU, Dropout; width 256, batch 16) and
# the loss `h.square().mean()`, which saves the last output. Peak: gradients excluded; unit: one
# *block boundary* (a block's output).

# %%
def scoped_block(block, h):
    with gradient_checkpoint_scope():
        return block(h)
variants = {"no checkpoint": lambda block, h: block(h), "checkpoint per block": ckpt_lab_checkpoint,
            "scope per block": scoped_block}
unit = 16 * 256 * 4  # one block boundary: batch × width × 4 bytes
def chain_forward(wrap, mem):
    """A fresh 4-block MLP (built here, before the measurement) and its forward, which returns the loss."""
    stack = mlp(4, width=256, batch=16)
    def forward():
        torch.manual_seed(1)  # the same dropout masks for every variant
        h = stack.input
        for k, block in enumerate(stack.blocks, 1):
            h = wrap(block, h)
            mem.name_output(h, f"h{k}")
        return h.square().mean()
    return forward

# %% [markdown]
# An instrument: a `LiveMemory` that names every storage (its op; `h1`…`h4` for block outputs; `h1'`…
# for equal tensors a recomputation makes) and records what runs at every event:

# %%
class NamedMemory(LiveMemory):
    def __init__(self):
        super().__init__()
        self.names, self.outputs, self.kinds = {}, {}, []  # kinds: (first event, what runs), per op
    def name_output(self, h, name):
        self.names[self.serial_of(h)] = name
        with torch.utils._python_dispatch._disable_current_modes():
            self.outputs[name] = h.detach().clone()  # a copy this instrument does not count
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = len(self.events)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        # in_hook: one of the scope's hooks (and so its replay) is running
        recompute = self.phase == "backward" and (inside_scope_hook() or torch.is_grad_enabled())
        self.kinds.append((first, "recompute" if recompute else self.phase))
        copy = next((n + "'" for n, t in self.outputs.items() if recompute and isinstance(out, torch.Tensor)
                     and out.shape == t.shape and torch.equal(out, t)), None)
        for serial, sign, _ in self.events[first:]:
            if sign > 0:
                self.names[serial] = copy or func.overloadpacket.__name__
        return out

# %%
def named_timeline(wrap):
    """Retained bytes; live bytes per event (gradients excluded); names of a boundary or more alive."""
    mem = NamedMemory()
    forward = chain_forward(wrap, mem)
    with mem:
        loss = forward()
        retained, mem.phase = mem.snapshot("forward"), "backward"
        loss.backward()
        del loss
    excluded, alive, named = mem.born_in("backward"), set(), []  # excluded: the .grad of leaves
    for serial, sign, _ in mem.events:
        (alive.add if sign > 0 else alive.discard)(serial)
        named.append(sorted(mem.names[s] for s in alive - excluded if mem.nbytes(s) >= unit // 2))
    return mem, retained, mem.curve(excluded), named
timelines = {name: named_timeline(wrap) for name, wrap in variants.items()}
for name, (mem, retained, curve, named) in timelines.items():
    at = curve.index(max(curve))
    print(f"{name:<20} retained {retained / unit:5.2f}  peak {max(curve) / unit:5.2f}",
          f"(in {mem.events[at][2]})")
    if name != "no checkpoint":
        print("    alive at the peak (a boundary or more):", *named[at])
scope_mem, _, scope_curve, scope_named = timelines["scope per block"]
print("events at which a block output and its recomputed copy are both alive:",
      sum(any(n + "'" in names for n in names) for names in scope_named))

# %%
fig, (ax, strip) = plt.subplots(2, 1, figsize=(11, 4.2), sharex=True, height_ratios=[4, 1])
for name, (_, _, curve, _) in list(timelines.items())[1:]:
    ax.step(range(len(curve)), [v / unit for v in curve], where="post", label=name)
ax.annotate("scope's peak: the loss's backward\nunpacks h4, scope 4 replays it all",
            (scope_curve.index(max(scope_curve)), max(scope_curve) / unit),
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
# **What runs when**, for the scope per block (the strip under the plot):
#
# 1. **Forward**, each block in its scope. Scope k+1 keeps `h_k` as an outside input; what block
#    k+1 and `square` save of `h_k` is a reference into scope k, so `h4` is freed in the forward.
# 2. **The loss's backward** unpacks `h4`. Scope 4 replays **at once all that backward still wants
#    of it**: `h4'`, GELU's input (`addmm`), the dropout mask (`empty_like`). The replay read `h3`
#    and then lets it go: from now on scope 3 recomputes it. The loss's backward temporaries
#    (`div`, `pow`, `mul`, `mul`) come on top: **the peak**, 9 boundaries (`h3` not among them).
# 3. **Block 4's backward** uses them. Block 4's first Linear unpacks `h3`: scope 3 replays. And so
#    on down to block 1.
#
# The checkpoint keeps `h4` and re-runs block k when block k's own backward unpacks, after the
# consumer's temporaries are gone: its peak, 8, is `h1`–`h4` and the loss's 4 temporaries.
#
# **Why the scope peaks higher:** *a scope replays all its saved tensors at the first unpack, which
# comes from the block's consumer (the loss here, the next block in a stack), before the block's own
# backward: they overlap the consumer's backward temporaries.* Here +3 boundaries (`h4'`, GELU's
# input, the mask) against the two (`h4`, and `h3` once replayed) the scope does not hold: +1. It
# is **not** two copies of one tensor: every block output is freed before its copy is born (0 such
# events). A residual stack (the same cause) is in 04b (M.2).

# %% [markdown]
# ## 6. On a GPU
#
# * **RNG per device.** The scope captures the generator of the CPU and of *every* initialised
#   accelerator (one first initialised inside the scope replays from its fresh seed); it never
#   initialises CUDA.
# * **The caching allocator.** `memory_allocated` drops when a scope tensor dies, `memory_reserved`
#   does not. 04b (M.3) runs a case on CUDA when there is one, against `memory_allocated`.
# * **Backward runs in a device thread.** A scope tensor dying there cannot touch the caller's
#   stack: the resident entry stays, merely storing what it is given, until that thread's next safe
#   point (NOTE [ Safe points ] in `scope.py`).

# %% [markdown]
# ## 7. Where the scope's assumptions end
#
# A tensor is a scope tensor if a recorded op returned it (or it is a view of one); wherever it is
# saved, it is recomputed from the record. Three limits follow, each measured against the plain run.
# The first gives different gradients **silently**: write through `.data` after the scope, and the
# replay rebuilds the value from before the write (no version counter sees a `.data` write).

# %%
def write_case(scope, write):
    _ = torch.manual_seed(0)
    a, c = leaves((1000,), (1000,))
    with scope():
        w = a.sin()
    write(w)
    (w * c).sum().backward()
    return grads(a, c)
def through_data(w):
    w.data.mul_(3)  # a write that bumps no version counter
def under_no_grad(w):
    with torch.no_grad():
        w.mul_(3)  # a write that bumps the version
for write in through_data, under_no_grad:
    plain, scoped = write_case(contextlib.nullcontext, write), write_case(gradient_checkpoint_scope, write)
    ratio = round((scoped[1] / plain[1]).mean().item(), 3)
    print(f"{write.__name__:<13} a.grad equal:", torch.equal(plain[0], scoped[0]), "| c.grad equal:",
          torch.equal(plain[1], scoped[1]), "| c.grad, scope / plain:", ratio)

# %% [markdown]
# Written under `torch.no_grad()` instead (second line), the version moves, the scope sees it, and
# both gradients equal the plain run's. Second, an alias made *after* the scope
# (`x.detach()`, `x.data`) is a plain tensor: autograd stores it, and with it the storage (memory,
# never gradients). Third, the hook stays on the stack while any scope tensor lives, and `torch.func`
# refuses to run under it:

# %%
def retained(use):
    _ = torch.manual_seed(0)
    a, c = leaves((1000,), (1000,))
    def forward():
        with gradient_checkpoint_scope():
            x = a.sin()
        return (use(x) * c).sum()
    return measure_memory(forward).retained_bytes
for name, use in {"x": lambda x: x, "x.detach()": lambda x: x.detach(), "x.data": lambda x: x.data}.items():
    print(f"saving {name:<11} retains {retained(use):,} bytes")
def func_grad_runs():
    try:
        return torch.func.grad(torch.sin)(torch.tensor(1.0)) is not None
    except RuntimeError:
        return False
a = torch.randn(3, requires_grad=True)
with gradient_checkpoint_scope():
    y = a.sin()
print("while y lives: hook on the stack:", top_hooks() is not None,
      "| torch.func.grad runs:", func_grad_runs())
del y
print("after del y:   hook on the stack:", top_hooks() is not None,
      "| torch.func.grad runs:", func_grad_runs())

# %% [markdown]
# ## Summary
#
# | question | answer | shown by |
# |---|---|---|
# | What does a `TorchDispatchMode` see? | post-autograd aten ops, below the saved-tensor hooks, without `grad_fn` | §1, `images/04_dispatch_layers.png` |
# | Scope or checkpoint? | the scope names what to recompute, a checkpoint what to store | §2: 4,000 vs 8,000 bytes |
# | Why not pop the hooks at `__exit__`? | `x * c` after the block would store `x` | §3 draft 1: 8,000 bytes |
# | Why not leave them pushed? | the enclosing context pops ours; its own stays forever, bypassed | §3 draft 2: 0 packs |
# | How does the package keep its hook? | a resident entry at the bottom, enclosing entries wrapped | §3, `images/04_hooks_stack.png` |
# | When is it released? | when the last scope tensor dies, at a safe point (inside backward: after it) | §3; 04b M.1 |
# | Dropout? | a replay in a fork, each random op from the generator state recorded before it: same masks | §4, `images/04_rng_replay.png` |
# | Where does it end? | a write through `.data` after the scope is not seen; aliases made after it are stored; a live scope tensor keeps the hook | §7: `c.grad` ×0.333; 4 vs 4,004 bytes |
# | What does a chain of scoped blocks keep? | one block boundary less than a checkpoint per block | §5: 3 vs 4 boundaries |
# | Why is its peak higher? | a scope replays all its saved tensors at the first unpack, which comes from the block's consumer, before the block's own backward: they overlap the consumer's backward temporaries (not two copies of one tensor) | §5: 9 vs 8 boundaries, `images/04_chain_timeline.png`; 04b M.2 |
# | GPU? | RNG per initialised device; release deferred off the device thread | §6; 04b M.3 |
#
# **Next (optional):** [04b](04b_scope_appendix_returnn.ipynb): more measurements, and the edge cases
# run with ours and RETURNN's scope.
