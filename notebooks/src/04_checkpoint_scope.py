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
# * A `TorchDispatchMode` records the scope's [aten ops](glossary.md#aten-op); a pack hook stores a
#   reference instead of a tensor the scope made; the first unpack replays the recording. A
#   checkpoint keeps the same 4,000 bytes only if it wraps the consumer `* c` too (§2).
# * `x * c` runs *after* the `with` block, so the pack hook must outlive it, on a stack where every
#   `__exit__` pops whatever is on top: the scope rebuilds the stack, without patching torch, and
#   restores it when its last tensor dies (§3). The mechanism is `ckpt_lab/scope_core.py` (§3;
#   exercise `04-scope` rebuilds it).
# * On four MLP blocks, a scope per block keeps one block boundary *less* than a checkpoint per
#   block and peaks at the *same* 8; the core, which replays everything at once, at 10 (§5).
#
# **After this notebook you can**
# 1. say where a `TorchDispatchMode` sees ops, and why `nn.Linear` arrives as `t`, `addmm` (checked: §1's prediction);
# 2. compare what a scope and a checkpoint keep, for both placements of the checkpoint (checked: §2's prediction);
# 3. say why the scope's hook outlives the `with` block, and when it goes (checked: §3's printed stacks);
# 4. build the scope's core: tape, reference, replay in an RNG fork, resident hooks (checked: exercise `04-scope`);
# 5. read what is alive at the peak, by role (checked: §5's prediction and ledgers).
#
# | question | section |
# |---|---|
# | Where does a `TorchDispatchMode` see ops, and which ones? | §1 |
# | How does a scope that names *what to recompute* differ from a checkpoint? | §2 |
# | How can the scope's hooks outlive the `with` block, and be released? The core, part by part | §3 |
# | How does dropout inside the scope recompute identically (RNG fork and reset)? | §4 |
# | What does a chain of scoped blocks keep, and what is alive at its peak? | §5 |
# | What changes on a GPU? | §6 |
# | Where do the scope's assumptions end? | §7 |
# | What `scope.py` adds to the core, and why; RETURNN's scope edge case by edge case | [04b](04b_scope_appendix_returnn.ipynb) (optional) |
#
# Terms: the [glossary](glossary.md) ([scope](glossary.md#scope), [pack and unpack
# hooks](glossary.md#pack-unpack), [retained](glossary.md#retained), [peak](glossary.md#peak)). The
# **saved-tensors-hooks stack**: the thread-local stack of `(pack, unpack)` pairs that
# `saved_tensors_hooks` pushes; autograd calls the top pair.

# %%
import contextlib

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch._C._autograd import _pop_saved_tensors_default_hooks as pop_hooks
from torch._C._autograd import _push_saved_tensors_default_hooks as push_hooks
from torch._C._autograd import _top_saved_tensors_default_hooks
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ckpt_lab import LiveMemory, explain, gradient_checkpoint_scope, scope_core
from ckpt_lab import checkpoint as ckpt_lab_checkpoint
from ckpt_lab.bench.workloads import mlp
from ckpt_lab.helpers.predict import reveal
from ckpt_lab.helpers.show import show_source
from ckpt_lab.helpers.tensors import all_equal, grads, leaves
from ckpt_lab.helpers.viz import save_figure, show_dot
from ckpt_lab.instruments.memory import measure_memory
from ckpt_lab.scope import inside_scope_hook, is_scope_pack_hook, pack_hook_below

print("torch", torch.__version__)

# %% [markdown]
# Helpers, not the lesson. The saved-tensors-hooks stack has no public reader, so these use private
# torch API (`torch._C._autograd._push/_pop/_top_saved_tensors_default_hooks`, what
# `saved_tensors_hooks` itself calls): `hooks_stack` pops the stack and pushes it back.

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
# The [dispatcher](glossary.md#dispatcher) passes every aten op call through an ordered list of
# dispatch keys ([`c10/core/DispatchKey.h`](https://github.com/pytorch/pytorch/blob/v2.13.0/c10/core/DispatchKey.h)):
# autocast's and autograd's keys first, then `Python`, where a `TorchDispatchMode` runs, then the
# kernel's (`CPU`, `CUDA`). So a mode sees ops **below autograd and above the kernels**, and only ops that
# reach that far: a *composite* op (registered as `CompositeImplicitAutograd`, like `aten::linear`)
# has already decomposed into others at the autograd key. (The class lives in
# `torch.utils._python_dispatch`, a private-looking module; the class itself is documented.)

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
# the mode, `relu`'s output *after*; each `UNPACK` comes before the backward ops that use it:

# %%
order = f"measured, forward:\\l{' → '.join(forward_log)}\\lbackward: {' → '.join(log[:8])} …\\l"
show_dot(f"""digraph {{ node [shape=box, style="rounded,filled", fillcolor=white, fontname=Helvetica];
 edge [fontname=Helvetica, fontsize=10]; py [label="Python: F.relu(lin(x)).sin().sum()"];
 ag [label="Autograd key: composite ops decompose\\n(linear → t, addmm); builds grad_fn, saves tensors"];
 hooks [label="saved_tensors_hooks, top entry\\npack (forward), unpack (backward)\\nscope: _PackHook",
        fillcolor="#9ecae1"];
 mode [label="Python key: TorchDispatchMode.__torch_dispatch__\\nLoggingMode here; scope: records (op, args)",
       fillcolor="#e6a23c"];
 aten [label="kernel (CPU, CUDA keys)"]; order [shape=note, fillcolor="#f7f7f7", label="{order}"];
 py -> ag -> mode -> aten; ag -> hooks [label=" inputs: before\\l outputs: after\\l"];
 {{rank=same; ag; hooks}} {{rank=same; aten; order}} }}""", "04_dispatch_layers")

# %% [markdown]
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
    "scope around a + b": in_scope(gradient_checkpoint_scope),
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
# ## 3. Building the scope
#
# ### Draft 1: record, store positions, replay, and pop the hooks at `__exit__`
#
# The mode records the ops on a tape; the pack hook stores, for a tensor the scope made (known by
# its storage), the position of the op that made it; the unpack hook replays the tape.

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
print("x * c after the scope | draft 1:", api_page_example(in_scope(DraftScopeV1))[0], "B | ckpt_lab:",
      measured["scope around a + b"][0], "B | hooks left after draft 1:", top_hooks() is not None)

# %% [markdown]
# `y = x * c` runs after `__exit__` popped the hooks, so `mul` stores `x`.
#
# ### Draft 2: leave the hooks pushed at `__exit__`
#
# Then `x * c` goes through our pack hook. But `saved_tensors_hooks.__exit__` is one line,
# `_pop_saved_tensors_default_hooks()`: it pops whatever is on top. Inside an enclosing
# `saved_tensors_hooks` (a logging hook, `save_on_cpu`, a checkpoint), its `__exit__` pops *draft
# 2's* entry, and its own stays:

# %%
class DraftScopeV2(DraftScopeV1):
    """Draft 2: as draft 1, but the hooks stay on the stack after ``__exit__`` (popped by nobody)."""
    def __exit__(self, *exc):
        TorchDispatchMode.__exit__(self, *exc)  # stop recording only

def log_pack(t):
    logged.append(t.shape)
    return t

print("x * c after the scope | draft 2:", api_page_example(in_scope(DraftScopeV2))[0], "B")
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
# ### The hard part: hooks that outlive the `with` block
#
# Our entry must stay after the scope closes, yet every enclosing context must pop *its own*. So a
# scope that closes with its tensors alive rebuilds the stack: a **resident entry** of ours at the
# *bottom*, every entry above it **wrapped** (a pack hook of ours whose `below` is the original
# pair: scope tensors to us, the rest to it). Each `__exit__` pops its wrapper:

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
y.sum().backward()  # the replay needs no hook on the stack: y's graph holds the reference
print("y's backward after the release, a.grad equals c * cos(a):", torch.equal(a.grad, c * a.detach().cos()))
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
plt.show()

# %% [markdown]
# The release needs no call: when `x`, the last scope tensor, died (a `weakref` callback), the
# resident entry went, at a [safe point](glossary.md#safe-point) (this thread, outside our hooks,
# outside a backward), and the stack is as if we had never been there, *before* backward: `y`'s
# graph holds a reference to the tape, not a hook. (RETURNN's scope has an
# `exit_saved_tensors_hooks_scope()` for this; 04b's "Hooks that outlive the block" says why ours
# needs none, and what happens when the last scope tensor dies inside a backward.)
#
# ### The core: `ckpt_lab/scope_core.py`
#
# The drafts made right are the package's scope core, read in one sitting
# (`ckpt_lab/scope_core.py`, 448 lines; `ckpt_lab.scope` is it hardened: 04b). Its four parts:
#
# 1. **The tape** (`_Tape`, a dispatch mode): draft 1's tape, a *slot* per tensor instead of a
#    storage id; a tensor from outside (an *input*) kept by reference with its version; a random op's
#    generator state (§4). New memory an op returns with grad on is a *scope tensor*, registered
#    weakly by identity.
# 2. **The pack hook's reference** (`_PackHook`, `_scope_ref`, `_ScopeTensorRef`): a scope tensor (or a view
#    of one) becomes a `_ScopeTensorRef` (replayer, slot); anything else goes to the pair below, or is stored:

# %%
show_source(scope_core, start="ref = _scope_ref(tensor)", stop="finally")

# %% [markdown]
# 3. **The replay** (`_Replayer.serve`, `_Replayer._replay`): the first unpack of a backward re-runs the **whole** tape
#    in an RNG fork, grad and autocast off, checks each tensor's metadata, and keeps what live
#    references want until each is handed out:

# %%
show_source(scope_core, start="with torch.no_grad(), autocast_off", stop="self.pending = ")

# %% [markdown]
# 4. **The resident hooks** (`_ResidentHooks.restack`, `release_if_idle`, an after-backward callback): the
#    stack rebuilt as pictured above, put back when the last scope tensor dies at a safe point.
#
# Where the core takes the simple way (replay everything, keep every input, refuse writes to
# inputs), a "Simple way:" comment says what the other way costs and where `scope.py` takes it.

# %% [markdown]
# ## 4. RNG: dropout inside the scope
#
# The scope records, before each random op, the state of the generator it draws from; the replay
# sets that state back before re-running the op, in a `fork_rng`-style fork: the forward's masks
# (even if the code reseeds between them: last cell of this section), and the caller's stream
# untouched. A mode logs each dropout mask (`bernoulli_`) and the state before it; `inside_scope_hook()`
# tells a replay's ops from the forward's:

# %%
class DropoutLog(TorchDispatchMode):  # (forward or replay, the CPU generator's state before, the mask)
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        state = torch.get_rng_state()
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ == "bernoulli_":
            draws.append(("replay" if inside_scope_hook() else "forward", state, out.clone()))
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
# **Your turn.** Build the scope's core in `exercises/04_scope.py` (open it from the file browser):
# `gradient_checkpoint_scope`, a context manager. The cell below grades it with the same mechanism
# checks the package's two scopes pass.

# %%
from ckpt_lab.exercises import check

check("04-scope", "exercises/04_scope.py")

# %% [markdown]
# ## 5. Memory on a chain of scoped blocks: what is alive at the peak
#
# The benchmark (README) runs a scope per block against a checkpoint per block. Here on four of its
# MLP blocks (Linear, GELU, Dropout; width 256, batch 16) and the loss `h.square().mean()`, which
# saves the last output. `explain` measures each variant; its peak ledger (`report.peak_ledger`)
# lists every storage alive at the peak by role. Unit: one *block boundary* (a block's output).

# %%
def scoped(scope):
    def wrap(block, h):
        with scope():
            return block(h)
    return wrap
variants = {"no checkpoint": lambda block, h: block(h), "checkpoint per block": ckpt_lab_checkpoint,
            "scope per block": scoped(gradient_checkpoint_scope),
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
    print(f"{name:<21} retained {report.retained_bytes / unit:5.2f}  peak {report.peak_bytes / unit:5.2f}")

# %% [markdown]
# **Predict.** The scope per block keeps one boundary less than the checkpoint per block. Is its
# peak above, equal to, or below the checkpoint's?

# %%
guess = None  # "above", "equal" or "below"

# %%
peaks = [round(reports[name].peak_bytes / unit, 2) for name in ("scope per block", "checkpoint per block")]
reveal(guess, "above" if peaks[0] > peaks[1] else "equal" if peaks[0] == peaks[1] else "below",
       "the scope's peak against the checkpoint's")
for name in ("checkpoint per block", "scope per block"):
    ledger = reports[name].peak_ledger
    print(f"{name}, the peak during {ledger.during}; alive, by role (boundaries):")
    for role, size in ledger.roles.items():
        ops = [row.op for row in ledger.rows if row.label == role]
        print(f"    {size / unit:4.2f}  {role.split(' (')[0]:<40}", *ops)

# %%
fig, ax = plt.subplots(figsize=(11, 3.4))
for name, style in (("checkpoint per block", {"lw": 2.5, "alpha": 0.6}), ("scope per block", {"lw": 1.2})):
    t = reports[name].timeline  # events counted from the start of backward, so that the phases line up
    ax.step([i - t.backward_start for i in range(len(t.live_bytes))], [b / unit for b in t.live_bytes],
            where="post", label=f"{name} (peak {t.peak_bytes / unit:.2f})", **style)
t = reports["scope per block"].timeline
for k, span in enumerate(t.spans):
    ax.axvspan(span.start - t.backward_start, span.stop + 0.6 - t.backward_start, color="#e6a23c",
               alpha=0.35, lw=0, label="scope's replays" if k == 0 else None)
    if k < 2:
        ax.text(span.start - t.backward_start, 0.3, ("block 4\nfor the loss", "block 4\nits own")[k],
                fontsize=7)
ax.axvline(0, color="grey", ls="--", lw=0.8)
ax.annotate("the scope's peak: block 4 replayed\nfor the loss, beside h1-h3 and div",
            (t.peak_index - t.backward_start, t.peak_bytes / unit), xytext=(60, -4),
            textcoords="offset points", fontsize=8, arrowprops={"arrowstyle": "->"})
ax.set(xlabel="event (a storage born or freed), from the start of backward",
       ylabel="live (block boundaries)")
ax.legend(loc="upper left", fontsize=8)
save_figure(fig, "04_chain_timeline")
plt.show()

# %% [markdown]
# **What runs when**, for the scope per block (the shaded spans):
#
# 1. **Forward.** Scope k+1 reads `h_k` as an input and keeps it: `h1`–`h3` are retained (the three
#    `mul` above: dropout's outputs). `h4` is freed: the loss saved a reference into scope 4.
# 2. **The loss's backward** unpacks `h4`: scope 4's *first* replay runs block 4 again from `h3`
#    (`addmm`, `gelu`, the mask `empty_like`, `mul`: `h4` again) beside the loss's first temporary,
#    `div`: **the peak**, 3 + 4 + 1 = 8. It hands `h4` to the loss, keeps `addmm`, and lets `gelu`,
#    the mask and `h3` go (scope 3 recomputes `h3` when asked).
# 3. **Block 4's backward** unpacks its own tensors: a second, short replay makes GELU's output and
#    the mask again from `addmm`. Block 4's Linear unpacks `h3`: scope 3 replays; and so on.
#
# The checkpoint keeps `h1`–`h4` and re-runs block k in block k's own backward: its peak, also 8,
# is those 4 beside the loss's 4 temporaries, before any re-run.
#
# **Why no higher:** the first replay of a backward comes from the last block's *consumer* (the
# loss) and serves the consumer only; the block's own tensors wait for the block's backward
# (`scope.py`'s NOTE [ The first replay of a backward ]). The core replays everything at once:
# `addmm`, the mask and `h4` beside `h1`–`h3` and the loss's 4 temporaries, 10. 04b compares them,
# and shows a residual stack where the scope still peaks one boundary higher (M.2).

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
    plain, scoped_grads = (write_case(s, write) for s in (contextlib.nullcontext, gradient_checkpoint_scope))
    ratio = round((scoped_grads[1] / plain[1]).mean().item(), 3)
    print(f"{write.__name__:<13} a.grad equal:", torch.equal(plain[0], scoped_grads[0]), "| c.grad equal:",
          torch.equal(plain[1], scoped_grads[1]), "| c.grad, scope / plain:", ratio)

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
# | What does a `TorchDispatchMode` see? | aten ops at the `Python` key: below autograd, above the kernels, composites decomposed (`t`, `addmm`) | §1 |
# | Scope or checkpoint? | the scope names what to recompute, a checkpoint what to store, and must include the consumer | §2: 4,000 vs 8,000 bytes |
# | Why not pop the hooks at `__exit__`, or leave them? | `x * c` would store `x`; an enclosing `__exit__` pops ours | §3 drafts: 8,000 bytes; 0 packs |
# | How does the hook outlive the block? | a resident entry at the bottom, enclosing entries wrapped; gone when the last scope tensor dies | §3, the stack picture |
# | What is the core? | tape, reference, one replay of the whole tape in an RNG fork, resident hooks | §3; exercise `04-scope` |
# | Dropout? | each random op replayed from the generator state recorded before it, in a fork | §4, the RNG picture |
# | A chain of scoped blocks? | one boundary less kept than a checkpoint per block, the same peak (core: 10) | §5: 3 vs 4; 8 vs 8 |
# | Where does it end? | `.data` writes after the scope unseen; aliases made after it stored; a live scope tensor keeps the hook | §7 |
# | GPU? | RNG per initialised device; release deferred off the device thread | §6; 04b M.3 |
#
# **Next (optional):** [04b](04b_scope_appendix_returnn.ipynb): what `scope.py` adds to the core and
# why, one part per note, with RETURNN's scope run on the same edge cases.
