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
# # 04b · Appendix (optional): more measurements, and RETURNN's scope edge case by edge case
#
# **Optional.** [Notebook 04](04_checkpoint_scope.ipynb) builds `ckpt_lab.gradient_checkpoint_scope`
# and is complete without this appendix. Part M holds measurements notebook 04 only cites: the
# release of the hooks during backward, a residual stack, a case on a GPU. Part A runs the edge
# cases a scope must get right (global state, several and nested scopes, enclosing hooks,
# exceptions, in-place writes, replays that cannot reproduce the forward, a scope inside a
# checkpoint) with ours, and each also with the peer: RETURNN's own `gradient_checkpoint_scope`, the
# one its API page describes. The peer solves the hard part of notebook 04 §3 (hooks that outlive
# the `with` block) differently: it **monkey-patches** `saved_tensors_hooks.__enter__`/`__exit__`
# globally and unregisters later from callbacks.
#
# **TL;DR.** A scope tensor dying inside backward releases the hooks after backward returns (M.1).
# On a residual stack the scope retains what a checkpoint per block does and peaks one block
# boundary higher, for the reason notebook 04 §5 gives (M.2). Ours leaves no global state in any
# case, frees every scope tensor, passes every non-scope tensor to enclosing hooks, updates outside
# buffers once and refuses a replay that would give wrong gradients with a `CheckpointError`. The
# peer (returnn 1.20261022) keeps a scope tensor alive in A.2 and A.3, leaves a hook entry behind in
# A.2, A.3, A.5 and A.6, bypasses enclosing hooks (A.4) and replays in-place writes in backward
# (A.6). Table at the end.
#
# | question | section |
# |---|---|
# | The last scope tensor dies inside backward: when are the hooks released? | M.1 |
# | Does the scope peak higher than a checkpoint on a residual stack too? | M.2 |
# | Do the scope's bytes and RNG hold on a GPU? | M.3 |
# | Does a scope leave hooks or patched methods behind? | A.1 |
# | Are the tensors of two scopes alive at once freed (`get_var1() * get_var2()`, the RETURNN issue "Torch multiple simultaneous gradient_checkpoint_scope")? | A.2 |
# | Do nested scopes free all their tensors? | A.3 |
# | Do an enclosing `saved_tensors_hooks` and `save_on_cpu` still see the tensors the scope does not recompute? | A.4 |
# | Does an exception inside the scope leave state behind? | A.5 |
# | Are in-place updates of outside tensors (a buffer, BatchNorm's statistics) applied once? | A.6 |
# | What happens when a replay cannot reproduce the forward? | A.7 |
# | What does a scope do inside a checkpointed function? | A.8 |
# | Where does RETURNN's scope fall short? | every A section's peer cell; table at the end |
#
# Our cells are checked by nbval. Each peer cell is tagged `nbval-ignore-output` and **shows the
# peer only where `returnn` is installed** (CI does not install it; there it prints "peer
# skipped"). After every peer run, `run_peer` puts the global state back, so that the peer's
# leftovers cannot affect later cells.
#
# Terms: a **graph task** is the autograd engine's state for one `backward()` call
# (`torch._C._current_graph_task_id()` is -1 outside one); a **safe point** (notebook 04) is a moment
# when the scope may change the saved-tensors-hooks stack: on its own thread, outside its hooks,
# outside a graph task.

# %%
import contextlib
import gc
import sys
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch._C._autograd import (
    _pop_saved_tensors_default_hooks,
    _push_saved_tensors_default_hooks,
    _top_saved_tensors_default_hooks,
)
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks

from ckpt_lab import CheckpointError, LiveMemory, gradient_checkpoint_scope
from ckpt_lab import checkpoint as ckpt_lab_checkpoint
from ckpt_lab.helpers.tensors import all_equal, grads, leaves
from ckpt_lab.instruments.state import assert_no_global_state as assert_clean
from ckpt_lab.scope import inside_scope_hook, recomputes_region

_ = torch.manual_seed(0)


# %% [markdown]
# Small helpers (the same as in notebook 04): torch's checkpoint with `use_reentrant` spelled out,
# the top of the saved-tensors-hooks stack, a weak reference to a tensor's storage (fresh leaves and
# their gradients come from `ckpt_lab.helpers.tensors`).

# %%
def torch_checkpoint(function, *args):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def top_hooks():  # the top of this thread's saved-tensors-hooks stack, or None
    return _top_saved_tensors_default_hooks(False)


def storage_ref(t):  # dead exactly when t's memory is freed
    return weakref.ref(t.untyped_storage())


# %% [markdown]
# ## M.1 Releasing the hooks during backward
#
# The last scope tensor may die inside a graph task, but the engine restores the hooks stack after
# every node, undoing any change made there. A check: a tensor hook pops the top entry mid-backward.

# %%
def log_pack(t):
    return t


_push_saved_tensors_default_hooks(log_pack, lambda t: t)
a = torch.randn(3, requires_grad=True)
seen_inside = []
a.register_hook(lambda g: seen_inside.append((_pop_saved_tensors_default_hooks(), top_hooks())[1]))
(a * a).sum().backward()
print("stack top inside backward after the pop:", seen_inside[0])
print("after backward, the popped entry is back:", top_hooks()[0].__name__)
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
ref = storage_ref(x)
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
# ## M.2 A residual stack
#
# Notebook 04 §5 measured four MLP blocks whose loss saves the last output. Here a residual stack
# (`h = h + block(h)`, four blocks of Linear, GELU, Linear) whose loss, `h.sum()`, saves nothing.
# An instrument names each storage by its op, `h1`…`h4` for block outputs, and adds `'` to one made
# by a scope's replay. Unit: one block boundary.

# %%
class OpNames(LiveMemory):
    def __init__(self):
        super().__init__()
        self.names = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = len(self.events)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        replay = inside_scope_hook()  # one of the scope's hooks (and its replay) is running
        for serial, sign, _ in self.events[first:]:
            if sign > 0:
                self.names[serial] = func.overloadpacket.__name__ + ("'" if replay else "")
        return out


# %%
def scoped_block(block, h):
    with gradient_checkpoint_scope():
        return block(h)


def residual_stack(wrap, dim=32):
    """Retained and peak bytes (gradients excluded), in boundaries; what is alive at the peak."""
    _ = torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(4)]
    h, unit = torch.randn(4, 16, dim, requires_grad=True), 4 * 16 * dim * 4
    with OpNames() as mem:
        for k, block in enumerate(blocks, 1):
            h = wrap(lambda u, block=block: u + block(u), h)
            mem.names[mem.serial_of(h)] = f"h{k}"
        loss = h.sum()
        del h
        retained, mem.phase = mem.snapshot("forward"), "backward"
        loss.backward()
        del loss
    excluded, alive, curve = mem.born_in("backward"), set(), mem.curve(mem.born_in("backward"))
    for serial, sign, _ in mem.events[: curve.index(max(curve)) + 1]:
        (alive.add if sign > 0 else alive.discard)(serial)
    at_peak = sorted(mem.names[s] for s in alive - excluded if mem.nbytes(s) >= unit // 2)
    return retained / unit, max(curve) / unit, at_peak


# %%
variants = {"no checkpoint": lambda block, h: block(h), "checkpoint per block": ckpt_lab_checkpoint,
            "scope per block": scoped_block}
for name, wrap in variants.items():
    retained, peak, at_peak = residual_stack(wrap)
    print(f"{name:<20} retained {retained:5.2f}  peak {peak:5.2f} block boundaries")
print("scope per block, alive at its peak (a boundary or more):", *at_peak)
print("clean:", assert_clean())

# %% [markdown]
# The scope retains what the checkpoint does (the loss saves nothing, so there is no last output
# to spare) and peaks one boundary higher: scope 3 replays (the `'` storages; `add'` is block 3's
# output again) while block 4's backward temporaries, among them its hidden gradient
# (`gelu_backward`), are alive: the cause of notebook 04 §5, with the next block as the consumer.
#
# ## M.3 On a GPU
#
# The cell runs on CUDA when a device is there, else on the CPU, printing the same lines. Bytes come
# from `LiveMemory`; on CUDA they are checked against `torch.cuda.memory_allocated`. The stored
# outputs come from a CPU.

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
        del x
        freed = before - mem.live_bytes
        assert device == "cpu" or allocated - torch.cuda.memory_allocated() == freed
        y.sum().backward()
    return freed, [*grads(a, c), torch.rand(3, device=device)]


plain_freed, plain_run = gpu_case(contextlib.nullcontext)
scope_freed, scope_run = gpu_case(gradient_checkpoint_scope)
print("bytes freed by `del x` | no scope:", plain_freed, "| scope:", scope_freed)
print("gradients and the next random numbers equal:", all_equal(plain_run, scope_run))
print("clean:", assert_clean())

# %% [markdown]
# # Part A: our scope against RETURNN's
#
# Kept before anything could patch them, the two methods the peer replaces; then the peer, where
# installed.

# %% tags=["nbval-ignore-output"]
# Kept before anything could patch them: the peer replaces these two methods.
ORIGINAL_HOOKS_METHODS = (saved_tensors_hooks.__enter__, saved_tensors_hooks.__exit__)
try:
    import returnn
    from returnn.torch.util.gradient_checkpoint import gradient_checkpoint_scope as peer_scope

    print("peer: returnn", returnn.__version__, "is installed")
except ImportError:
    peer_scope = None
    print("peer: returnn is not installed; each peer cell below prints 'peer skipped'")

# %%
def run_peer(name, case):
    """Run ``case(peer_scope)``; report its result or error and what it left behind; then clean up."""
    if peer_scope is None:
        print(f"{name}: returnn not installed, peer skipped")
        return
    report, unraisable = {}, []
    old_hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            report["result"] = case(peer_scope)
    except Exception as error:  # the peer's failures are part of the comparison
        report["raised"] = f"{type(error).__name__}: {str(error)[:150]}"
    report["hooks left behind"] = top_hooks() is not None
    methods = (saved_tensors_hooks.__enter__, saved_tensors_hooks.__exit__)
    report["methods patched"] = methods != ORIGINAL_HOOKS_METHODS
    gc.collect()  # the peer's finalizers may still run
    while top_hooks() is not None:
        _pop_saved_tensors_default_hooks()
    saved_tensors_hooks.__enter__, saved_tensors_hooks.__exit__ = ORIGINAL_HOOKS_METHODS
    sys.unraisablehook = old_hook
    report["ignored exceptions"] = [type(u.exc_value).__name__ for u in unraisable]
    print(f"{name} (peer):", report)


# %% [markdown]
# ## A.1 No global state left behind
#
# After a scope and its backward: no hook entry, no patched method, and the next user's
# `saved_tensors_hooks`, torch's checkpoint and `save_on_cpu` all work.

# %%
def no_global_state(scope):
    _ = torch.manual_seed(0)
    a, c = leaves((100,), (100,))
    with scope():
        x = a.sin()
    (x * c).sum().backward()
    del x
    hooks_left, packed = top_hooks() is not None, []
    with saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        (a * c).sum().backward()
    torch_checkpoint(lambda u: u.sin().exp(), a).sum().backward()
    with save_on_cpu():
        (a.sin() * c).sum().backward()
    return {"hooks left": hooks_left, "next user hooks packed": len(packed),
            "checkpoint and save_on_cpu ran": True}


print(no_global_state(gradient_checkpoint_scope), "| nothing patched, nothing left:", assert_clean())

# %% tags=["nbval-ignore-output"]
run_peer("no global state", no_global_state)

# %% [markdown]
# ## A.2 Several scopes alive at once (the RETURNN issue "Torch multiple simultaneous gradient_checkpoint_scope")
#
# `get_var1() * get_var2()`: two scopes, each returning a tensor, multiplied. Both scope tensors
# must be freed right after the product.

# %%
def several_scopes(scope):
    _ = torch.manual_seed(0)
    p1, p2 = leaves((200,), (200,))
    refs = []

    def get_var(p):
        with scope():
            v = p * torch.randn_like(p)
        refs.append(storage_ref(v))
        return v

    y = get_var(p1) * get_var(p2)
    alive = [ref() is not None for ref in refs]
    y.sum().backward()
    return alive, grads(p1, p2)


alive, scope_grads = several_scopes(gradient_checkpoint_scope)
print("scope tensors alive after the product (no scope: [True, True]):", alive)
print("gradients equal to no scope:", all_equal(several_scopes(contextlib.nullcontext)[1], scope_grads))
print("clean:", assert_clean())

# %% tags=["nbval-ignore-output"]
run_peer("get_var1() * get_var2(), alive", lambda scope: several_scopes(scope)[0])

# %% [markdown]
# ## A.3 Nested scopes
#
# Scopes nested on one thread act as one (the outer one records everything already); all their
# tensors are freed.

# %%
def nested(scope):
    _ = torch.manual_seed(0)
    a, c = leaves((300,), (300,))
    refs = []
    with scope():
        x = a.sin()
        with scope():
            y = x.exp()
            refs.append(storage_ref(y))
        refs.append(storage_ref(x))
        z = y * x
    w = z.cos() * c
    del x, y
    alive = [ref() is not None for ref in refs]
    w.sum().backward()
    return alive, grads(a, c)


alive, scope_grads = nested(gradient_checkpoint_scope)
print("inner and outer scope tensors alive after forward:", alive)
print("gradients equal to no scope:", all_equal(nested(contextlib.nullcontext)[1], scope_grads))
print("clean:", assert_clean())

# %% tags=["nbval-ignore-output"]
run_peer("nested, alive", lambda scope: nested(scope)[0])

# %% [markdown]
# ## A.4 Enclosing hooks still apply to tensors not made in the scope
#
# An enclosing `saved_tensors_hooks` must see every saved tensor except the ones the scope
# recomputes; an enclosing `save_on_cpu` must still offload them.

# %%
def enclosing_hooks(scope):
    _ = torch.manual_seed(0)
    a, c = leaves((100,), (100,))
    seen = []
    with saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        with scope():
            x = a.sin()  # saves a: not made in the scope
        y = x.cos()  # saves x: made in the scope
        z = y * c  # saves y and c
    z.sum().backward()
    names = {id(a): "a", id(c): "c", id(x): "x", id(y): "y"}
    return sorted(names.get(id(t), "?") for t in seen)


# %%
def enclosing_save_on_cpu(scope):
    _ = torch.manual_seed(0)
    a, c = leaves((100,), (100,))
    offload = save_on_cpu()
    offloaded = []
    pack = offload.pack_hook
    offload.pack_hook = lambda t: offloaded.append(t.shape) or pack(t)
    with offload:
        with scope():
            x = a.sin().exp()  # saves a and exp's output
        y = (x * c).sum()  # saves x and c
    y.backward()
    return len(offloaded)


print("packed by the enclosing hook | no scope:", enclosing_hooks(contextlib.nullcontext),
      "| scope:", enclosing_hooks(gradient_checkpoint_scope))
print("offloaded by save_on_cpu     | no scope:", enclosing_save_on_cpu(contextlib.nullcontext),
      "| scope:", enclosing_save_on_cpu(gradient_checkpoint_scope))
print("clean:", assert_clean())

# %% tags=["nbval-ignore-output"]
run_peer("enclosing hook packed", enclosing_hooks)
run_peer("save_on_cpu offloaded", enclosing_save_on_cpu)

# %% [markdown]
# ## A.5 An exception inside the scope leaves no state

# %%
def raising(scope):
    a = leaves((10,))[0]
    try:
        with scope():
            _ = a.sin()
            raise ValueError("boom")
    except ValueError as error:
        print("caught:", repr(error))
    modes_left = torch._C._len_torch_dispatch_stack()
    return {"hooks left": top_hooks() is not None, "dispatch modes left": modes_left}


print(raising(gradient_checkpoint_scope), "| clean:", assert_clean())

# %% tags=["nbval-ignore-output"]
run_peer("exception", raising)

# %% [markdown]
# ## A.6 In-place updates of outside tensors are applied once
#
# A replay re-runs the recorded ops, writes included. `buf.add_(1)` inside the scope, or BatchNorm's
# running statistics, must not be updated a second time in backward. The scope copies such a tensor
# once, before its first write, and replays into the copy. `torch.utils.checkpoint` re-runs the
# function, so it updates BatchNorm twice.

# %%
def outside_buffer(scope):
    _ = torch.manual_seed(0)
    a = leaves((20,))[0]
    buf = torch.zeros(20)
    with scope():
        buf.add_(1)
        y = (a + buf).sin()
        buf.mul_(3)
        z = (y + buf).exp()
    z.sum().backward()
    return buf.unique().tolist()


def batchnorm_steps(scope, use_checkpoint=False):
    _ = torch.manual_seed(2)
    bn = nn.BatchNorm1d(8)
    x = torch.randn(16, 8, requires_grad=True)
    with scope():
        y = torch_checkpoint(bn, x) if use_checkpoint else bn(x)
    (y.relu() ** 2).sum().backward()
    return int(bn.num_batches_tracked)


print("buf after forward + backward (no scope: [3.0]):", outside_buffer(gradient_checkpoint_scope))
print("num_batches_tracked after one step | scope:", batchnorm_steps(gradient_checkpoint_scope),
      "| torch.utils.checkpoint:", batchnorm_steps(contextlib.nullcontext, use_checkpoint=True))
print("clean:", assert_clean())

# %% tags=["nbval-ignore-output"]
run_peer("buf", outside_buffer)
run_peer("num_batches_tracked", batchnorm_steps)

# %% [markdown]
# ## A.7 A replay that cannot reproduce the forward is refused
#
# Two ways to get silently wrong gradients, both refused with a `CheckpointError`: an outside tensor
# read in the scope and modified in place before backward (`add` saves nothing, so autograd alone
# would not notice), and a replay whose outputs differ in shape (a change through `.data` bypasses
# version counters).

# %%
a, w = leaves((20,), (20,))
with gradient_checkpoint_scope():
    h = (a + w).sin()
loss = h.sum()
del h
with torch.no_grad():
    w.add_(1)
try:
    loss.backward()
except CheckpointError as error:
    print("CheckpointError:", error)
del loss

x = leaves((10,))[0]
m = torch.arange(10.0) - 6.5  # 3 positive entries
with gradient_checkpoint_scope():
    y = x[m > 0].sin()  # data-dependent shape
loss = y.sum()
del y
m.data.neg_()  # 7 positive entries now, no version bump
try:
    loss.backward()
except CheckpointError as error:
    print("CheckpointError:", error)
del loss
print("clean:", assert_clean())

# %% [markdown]
# ## A.8 A scope inside a checkpointed function does nothing
#
# A checkpoint matches the tensors its re-run saves to the forward's *by position*; in backward a
# scope does nothing, so a scope that acted in the forward would shift the positions. The scope
# recognises a checkpoint by its pack hook: torch's by the hook's code object, any other by an
# attribute `recomputes_region = True` that its pack hook carries (`ckpt_lab.checkpoint` sets it).

# %%
def pack_hook_inside(run_checkpoint):
    """The innermost pack hook, as a function run by ``run_checkpoint`` sees it."""
    seen = []

    def function(x):
        seen.append(top_hooks()[0])
        return x.sin()

    run_checkpoint(function, torch.randn(3, requires_grad=True))
    return seen[0]


checkpoints = {"torch.utils.checkpoint": torch_checkpoint, "ckpt_lab.checkpoint": ckpt_lab_checkpoint}
for name, run_checkpoint in checkpoints.items():
    print(f"{name:<32} recognised:", recomputes_region(pack_hook_inside(run_checkpoint)))
with saved_tensors_hooks(lambda t: t, lambda t: t):
    print(f"{'a user saved_tensors_hooks':<32} recognised:", recomputes_region(top_hooks()[0]))

# %% [markdown]
# ## Summary
#
# What the peer cells showed when this notebook was generated, with returnn 1.20261022 (their
# stored outputs above; nbval does not re-check them):
#
# | point | ours | peer |
# |---|---|---|
# | A.1 one scope, then the next hooks | clean | clean in this simple case |
# | A.2 `get_var1() * get_var2()`, alive after the product | `[False, False]` | `[True, False]`, hook entry and patched methods left behind |
# | A.3 nested, alive after forward | `[False, False]` | `[False, True]`, hook entry left |
# | A.4 enclosing hook / `save_on_cpu` | `[a, c, y]` / 2 | `[]` (an ignored `RuntimeError`) / 0 |
# | A.5 exception inside | clean | hook entry left |
# | A.6 `buf` / `num_batches_tracked` | `[3.0]` / 1 | `[12.0]` / 2: writes replayed in backward |
# | A.7 outside tensor modified before backward / replay of another shape | `CheckpointError` | (not run: ours only) |
# | A.8 inside a checkpointed function | does nothing (torch's and `ckpt_lab`'s checkpoints recognised) | (not run: ours only) |
#
# Part M, measured above: a scope tensor dying inside backward releases the hooks after backward
# returns (M.1); on a residual stack the scope retains what a checkpoint per block does and peaks
# one boundary higher (M.2).
#
# Back to [notebook 04](04_checkpoint_scope.ipynb), the scope's main path.
