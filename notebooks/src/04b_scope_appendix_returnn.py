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
# # 04b · Appendix (optional): what `scope.py` adds to the core, and why
#
# **Optional.** [Notebook 04](04_checkpoint_scope.ipynb) builds the scope's core,
# `ckpt_lab/scope_core.py`; `ckpt_lab/scope.py` is it hardened. Each section: what the core does,
# what `scope.py` adds, a case measured with both, and often the peer, RETURNN's scope, which keeps
# its hooks by **monkey-patching** `saved_tensors_hooks.__enter__`/`__exit__`.
#
# **TL;DR.** The core refuses what `scope.py` handles (`inference_mode`, a Parameter built in the
# scope, writes to outside tensors), replays every op and keeps every input. On a chain of scoped
# blocks `scope.py` splits the first replay of a backward: peak 8 boundaries, the core's 10; on a
# residual stack a scope still replays a block at once, one boundary above a checkpoint (§8). Ours
# releases its hooks by itself (§11); the peer leaves scope tensors alive and hooks behind.
#
# **After this appendix you can**
# 1. name what `scope.py` adds to the core, part by part (checked: each section's measured lines);
# 2. explain why the scope's peak matches a checkpoint's on a chain and not on a residual stack
#    (checked: §8's prediction and ledgers);
# 3. say why ours needs no `exit_saved_tensors_hooks_scope()` (checked: §11's printed moments).
#
# The peer (`returnn==1.20261022.211313`, pinned in requirements.txt) runs in every peer cell, and
# nbval re-checks the outputs; `run_peer` reports what it returned, raised and left behind, then
# cleans up. Terms: [glossary](glossary.md) ([graph task](glossary.md#graph-task),
# [safe point](glossary.md#safe-point), [peak](glossary.md#peak)).

# %%
import contextlib
import gc
import sys
import warnings
import weakref

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch._C._autograd import _pop_saved_tensors_default_hooks, _top_saved_tensors_default_hooks
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks

from ckpt_lab import CheckpointError, LiveMemory, explain, gradient_checkpoint_scope, scope_core
from ckpt_lab import checkpoint as ckpt_lab_checkpoint
from ckpt_lab.bench.workloads import mlp
from ckpt_lab.helpers.predict import reveal
from ckpt_lab.helpers.tensors import all_equal, grads, leaves
from ckpt_lab.helpers.viz import save_figure
from ckpt_lab.instruments.counting import OpCounter
from ckpt_lab.instruments.state import assert_no_global_state as assert_clean
from ckpt_lab.instruments.state import global_state
from ckpt_lab.scope import recomputes_region

_ = torch.manual_seed(0)
core_scope = scope_core.gradient_checkpoint_scope

# %% [markdown]
# Small helpers: torch's checkpoint with `use_reentrant` spelled out; the top of the
# saved-tensors-hooks stack (private torch API, `_top_saved_tensors_default_hooks`, and `_pop_...` to
# clean up after the peer: the stack has no public reader); a weak reference to a tensor's storage;
# `versus`, which runs a case without a scope, with the core and with `scope.py`, and prints each
# result (or the core's refusal).

# %%
def torch_checkpoint(function, *args):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
def top_hooks():  # the top of this thread's saved-tensors-hooks stack, or None
    return _top_saved_tensors_default_hooks(False)
def storage_ref(t):  # dead exactly when t's memory is freed
    return weakref.ref(t.untyped_storage())
def versus(case):
    for name, scope in (("no scope", contextlib.nullcontext), ("core", core_scope),
                        ("scope.py", gradient_checkpoint_scope)):
        try:
            print(f"{name:<9}", case(scope))
        except CheckpointError as error:
            print(f"{name:<9} CheckpointError: {str(error).split(': ', 1)[1].split('. ')[0]}")
    print("clean:", assert_clean())

# %%
# Kept before anything could patch them: the peer replaces these two methods.
ORIGINAL_HOOKS_METHODS = (saved_tensors_hooks.__enter__, saved_tensors_hooks.__exit__)
import returnn
from returnn.torch.util.gradient_checkpoint import gradient_checkpoint_scope as peer_scope

print("peer: returnn", returnn.__version__)

# %%
def run_peer(name, case):
    """Run ``case(peer_scope)``; report its result or error and what it left behind; then clean up."""
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
    peer_module = sys.modules[peer_scope.__module__]  # its registry of patched threads, as in a fresh process
    peer_module._custom_saved_tensors_hooks_registered_threads.clear()
    peer_module._custom_saved_tensors_hooks_tls_ctx.__dict__.clear()
    sys.unraisablehook = old_hook
    report["ignored exceptions"] = [type(u.exc_value).__name__ for u in unraisable]
    print(f"{name} (peer):", report)

# %% [markdown]
# ## 1. Per-thread state; nested scopes (A.3)
#
# NOTE [ Per-thread state ]: a count, `in_hook`, is above zero while one of our hooks (and so any
# replay) runs on this thread. Ops run then (a replay's, `save_on_cpu`'s copy in a hook we hand a
# tensor to) are not recorded, a scope opened then does nothing, and the hooks stack is not touched
# (pytorch/pytorch#130734). A count: our hooks nest. The core has it too, and one open scope per
# thread, so nested scopes act as one in both; `scope.py` adds only the backward in which this
# thread last replayed (§8).

# %%
def nested(scope):
    _ = torch.manual_seed(0)
    a, c = leaves((300,), (300,))
    with scope():
        x = a.sin()
        with scope():
            y = x.exp()
        z = y * x
    refs = [storage_ref(y), storage_ref(x)]
    w = z.cos() * c
    del x, y
    alive = [ref() is not None for ref in refs]
    w.sum().backward()
    return alive, grads(a, c)
alive, scope_grads = nested(gradient_checkpoint_scope)
print("inner and outer scope tensors alive after forward:", alive)
print("gradients equal to no scope:", all_equal(nested(contextlib.nullcontext)[1], scope_grads))
print("clean:", assert_clean())

# %%
run_peer("nested, alive", lambda scope: nested(scope)[0])

# %% [markdown]
# ## 2. A scope inside a checkpoint (A.8)
#
# A checkpoint matches what its re-run saves to what the forward saved *by position*; a scope acting
# in the forward (in backward it does nothing) would shift the positions: wrong gradients. So inside
# such a region a scope does nothing. The core recognises torch's checkpoint by its pack hook's
# *name*; `scope.py` by the hook's **code object** (a renamed or re-wrapped hook is still found), and
# any other by `recomputes_region = True` on its pack hook (`ckpt_lab.checkpoint` sets it).

# %%
def pack_hook_inside(run_checkpoint):
    """The innermost pack hook, as a function run by ``run_checkpoint`` sees it."""
    seen = []
    run_checkpoint(lambda x: seen.append(top_hooks()[0]) or x.sin(), torch.randn(3, requires_grad=True))
    return seen[0]
for name, run in (("torch.utils.checkpoint", torch_checkpoint), ("ckpt_lab.checkpoint", ckpt_lab_checkpoint)):
    print(f"{name:<32} recognised:", recomputes_region(pack_hook_inside(run)))
with saved_tensors_hooks(lambda t: t, lambda t: t):
    print(f"{'a user saved_tensors_hooks':<32} recognised:", recomputes_region(top_hooks()[0]))

# %% [markdown]
# ## 3. What the tape leaves out
#
# The tape is the forward's ops only. Both leave out a backward run inside the scope (recorded, the
# gradients became scope tensors and the tape kept every parameter: a cycle nothing freed). Ops under
# `inference_mode` make tensors autograd can't save: the core refuses them; `scope.py` reads what
# they made as inputs rather than recompute, say, a teacher's forward:

# %%
def teacher(scope):
    _ = torch.manual_seed(0)
    a, c = leaves((100,), (100,))
    with scope():
        with torch.inference_mode():
            target = a.detach().exp()  # a teacher's forward
        x = a.sin() + target
    (x * c).sum().backward()
    return f"a.grad sums to {a.grad.sum().item():.4f}"
versus(teacher)

# %% [markdown]
# ## 4. What "born in the scope" means
#
# A *scope tensor* is a tensor object a recorded op returned as new memory with grad on (or a view
# of one), known by identity. Another object on that memory is not: a `detach()`, a leaf that
# requires grad, a tensor made with grad off (optimizer state). The core refuses one that shares the
# scope's memory (`.data`, a Parameter built in the scope); `scope.py` records it as an alias
# (`_Alias`), a view of the replayed memory, so that writes through it are replayed. `nn.Linear`
# built inside the scope:

# %%
def linear_inside(scope):
    _ = torch.manual_seed(0)
    a, c = leaves((4, 8), (8,))
    with scope():
        lin = nn.Linear(8, 8)  # its parameters wrap memory the scope made
        y = lin(a).relu()
    (y * c).sum().backward()
    return f"a.grad sums to {a.grad.sum().item():.4f}"
versus(linear_inside)

# %% [markdown]
# ## 5. Inputs are kept, not recomputed
#
# An outside tensor the tape reads is kept by reference, as a checkpoint keeps its input. That
# includes a tensor made by an *earlier* scope: recomputed from the start, it would make each scope
# of a chain hold the earlier one's whole replay. The core keeps it for the tape's life; `scope.py`
# lets it go once the later scope has replayed (a second backward asks the earlier scope, whose
# replay offers the copy back). Scope 2 reads `x` of scope 1:

# %%
def earlier_input(scope):
    _ = torch.manual_seed(0)
    a, c = leaves((300,), (300,))
    with scope():
        x = a.sin()
    ref = storage_ref(x)
    with scope():
        y = x + 1  # reads x; add saves nothing
    del x
    loss = (y * c).sum()
    loss.backward(retain_graph=True)
    alive, first = ref() is not None, a.grad.clone()
    loss.backward()  # a second backward: a.grad doubles
    return f"x alive after the first backward: {alive}, the second right: {torch.equal(a.grad, 2 * first)}"
versus(earlier_input)

# %% [markdown]
# ## 6. Outside tensors written in place (A.6)
#
# A replay re-runs the recorded ops, writes included: `buf.add_(1)` in the scope must not happen
# again in backward. The core refuses a write to an input; `scope.py` copies the tensor once, before
# the first write (`_Snapshot`), and each replay writes into a copy of that copy. BatchNorm's running
# statistics are such tensors: [notebook 05, section 7](05_selective_and_planner.ipynb) treats them.

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
    return f"buf after forward and backward: {buf.unique().tolist()}"
versus(outside_buffer)

# %%
run_peer("buf", outside_buffer)

# %% [markdown]
# A tensor our entry *stores*, then written in place: autograd checks versions only without hooks
# (`SavedVariable::unpack`: "If user provides hooks, we can't track versions through the hooks"), so
# the stored tensor keeps its version and its unpack raises autograd's own error, in its words:

# %%
def written_after_saved(scope):
    a, b = leaves((10,), (10,))
    with scope():
        x = a.sin()
    y = x * (b := b * 1)  # saves b: not a scope tensor
    with torch.no_grad():
        b.add_(1)
    try:
        return y.sum().backward() or "no error: the gradients use b's new values"
    except RuntimeError as error:
        return f"RuntimeError: {str(error).split(':')[0]}"
versus(written_after_saved)

# %% [markdown]
# ## 7. One replay per backward
#
# The first unpack replays once and keeps what every live reference wants; a second backward starts
# a new round. The core runs every op and keeps every tensor until the replay ends; `scope.py` runs
# only the ops a wanted tensor depends on and frees each intermediate after its last reader
# (`_plan_replay`; a skipped random op shifts no other's numbers, §10). `z`'s graph is dropped, so
# nothing of its branch is wanted; the ops each backward runs:

# %%
def ops_in_backward(scope):
    _ = torch.manual_seed(0)
    a, c = leaves((1000,), (1000,))
    with scope():
        h = a.sin()
        y = h.exp()
        z = (h * 3).tanh()  # dropped below: nothing of it is wanted
    del z
    loss = (y * c).sum()
    with OpCounter() as ops:
        loss.backward()
    return {op: ops.counts[op] for op in ("sin", "exp", "tanh")}
versus(ops_in_backward)

# %% [markdown]
# ## 8. The first replay of a backward; a residual stack (M.2)
#
# Notebook 04 §5's chain: four MLP blocks, a scope per block, loss `h.square().mean()`, measured by
# `explain` (unit: one block boundary): one step under the package's memory instruments, its
# retained bytes, peak and peak ledger (every storage alive at the peak, by role); notebook
# [07](07_why_memory_did_not_drop.ipynb) introduces it.

# %%
unit = 16 * 256 * 4  # one block boundary of the MLP chain
def scoped(scope):
    def wrap(block, h):
        with scope():
            return block(h)
    return wrap
def explain_chain(wrap):
    stack = mlp(4, width=256, batch=16)
    def forward(h):
        torch.manual_seed(1)
        for block in stack.blocks:
            h = wrap(block, h)
        return h
    return explain(forward, stack.input, loss_fn=lambda h: h.square().mean())
reports = {"checkpoint per block": explain_chain(ckpt_lab_checkpoint),
           "core per block": explain_chain(scoped(core_scope)),
           "scope.py per block": explain_chain(scoped(gradient_checkpoint_scope))}

# %% [markdown]
# **Predict.** In one backward, how many times does `scope.py` replay (part of) scope #4, the last block?

# %%
guess = None  # a number

# %%
spans = reports["scope.py per block"].timeline.spans
reveal(guess, sum(span.label.endswith("#4") for span in spans), "replays of scope #4 in one backward")
for name, report in reports.items():
    ledger = report.peak_ledger
    print(f"{name}: peak {report.peak_bytes / unit:.2f}, during {ledger.during}")
    for role, size in ledger.roles.items():
        ops = [row.op for row in ledger.rows if row.label == role and row.bytes >= unit // 2]
        if ops:
            print(f"    {size / unit:4.2f}  {role.split(' (')[0]:<40}", *ops)

# %%
fig, ax = plt.subplots(figsize=(11, 3.6))
styles = ({"lw": 2.5, "alpha": 0.5, "color": "C0"}, {"lw": 1, "ls": ":", "color": "C3"}, {"color": "C2"})
for name, style in zip(reports, styles, strict=True):
    t = reports[name].timeline  # events counted from the start of backward
    ax.step([i - t.backward_start for i in range(len(t.live_bytes))], [b / unit for b in t.live_bytes],
            where="post", label=f"{name} (peak {t.peak_bytes / unit:.2f})", **style)
t = reports["scope.py per block"].timeline
first, second = (s for s in t.spans if s.label.endswith("#4"))
for span, colour, text, x, ha in (
    (first, "#e6a23c", "scope.py, first replay of block 4:\nfor the loss only", first.start - 1, "right"),
    (second, "#9ecae1", "second replay: block 4's own\n(GELU and the mask)", second.stop + 2, "left"),
):
    ax.axvspan(span.start - t.backward_start, span.stop + 0.6 - t.backward_start, color=colour, alpha=0.5)
    ax.text(x - t.backward_start, 9.2, text, fontsize=7.5, ha=ha)
ax.axvline(0, color="grey", ls="--", lw=0.8)
ax.set(xlabel="event (a storage born or freed), from the start of backward", ylabel="live (block boundaries)",
       title="the first replay of a backward, split: a chain of 4 scoped MLP blocks")
ax.legend(loc="upper right", fontsize=8)
save_figure(fig, "04b_first_replay")
plt.show()

# %% [markdown]
# (`explain` names `scope.py`'s replays; the core's count as backward temporaries.) The core holds
# block 4's `addmm`, mask and output beside `h1`–`h3` and the loss's four temporaries: 10. NOTE
# [ The first replay of a backward ]: in a chain, the first replay serves only what the consumer
# saved; within the bytes of the earlier tensor it lets go (`h3`), it keeps the Linear's `addmm`, so
# that block 4's own backward replays only GELU and the mask. Peak 8, the checkpoint's; cost: at
# most the last block once more per backward. Rejected: splitting every block (twice the
# recomputation; later replays stand on memory backward has freed).
#
# **M.2, a residual stack** (`h = h + block(h)`: Linear, GELU, Linear; loss `h.sum()`, which saves
# nothing; unit: a block boundary, a quarter of a hidden activation):

# %%
def residual(wrap, dim=32):
    _ = torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(4)]
    def forward(h):
        for block in blocks:
            h = wrap(lambda u, block=block: u + block(u), h)
        return h
    return explain(forward, torch.randn(4, 16, dim, requires_grad=True)), 4 * 16 * dim * 4
for name, wrap in (("checkpoint per block", ckpt_lab_checkpoint),
                   ("scope.py per block", scoped(gradient_checkpoint_scope))):
    report, boundary = residual(wrap)
    print(f"{name}: retained {report.retained_bytes / boundary:.2f}, peak {report.peak_bytes / boundary:.2f}",
          f"during {report.peak_ledger.during}")
    for role, size in report.peak_ledger.roles.items():
        ops = [row.op for row in report.peak_ledger.rows if row.label == role and row.bytes >= boundary // 2]
        if ops:
            print(f"    {size / boundary:5.2f}  {role.split(' (')[0]:<40}", *ops)

# %% [markdown]
# **A scope replays all its saved tensors at once**, at its first unpack. For every block but the
# last, that comes from the next block's backward: block 4's Linear unpacks `h3`, and scope 3 makes
# all that block 3's backward will need (hidden `addmm` and `gelu`, 8; `addmm`; `h3` again) beside
# block 4's GELU gradient (`gelu_backward`, 4): 2 + 10 + 4 = 16. The checkpoint re-runs a block
# inside its own backward: block 4's hidden activations (8) beside 3 kept and one gradient (4): 15.

# %% [markdown]
# ## 9. What a replay refuses (A.7)
#
# Both refuse with a `CheckpointError` what would give silently wrong gradients: an outside tensor
# modified in place since the scope read it (`add` saves nothing: autograd would not notice); a
# scope tensor modified after autograd saved it; a replayed tensor of another shape, strides,
# offset, dtype or device (`.data` bypasses version counters). `scope.py` keeps versions per
# version counter (a view shares its base's), and stores a scope tensor a replay can't reproduce.

# %%
a, w = leaves((20,), (20,))
with gradient_checkpoint_scope():
    h = (a + w).sin()
loss_1 = h.sum()
with torch.no_grad():
    w.add_(1)
x, m = leaves((10,))[0], torch.arange(10.0) - 6.5  # 3 positive entries
with gradient_checkpoint_scope():
    y = x[m > 0].sin()  # data-dependent shape
loss_2 = y.sum()
m.data.neg_()  # 7 positive entries now, no version bump
del h, y
for loss in loss_1, loss_2:
    try:
        loss.backward()
    except CheckpointError as error:
        print("CheckpointError:", error)
del loss, loss_1, loss_2
print("clean:", assert_clean())

# %% [markdown]
# ## 10. Random ops; RNG and autocast in a replay; a GPU (M.3)
#
# Both record, before each random op, its generator's state and replay in a fork (notebook 04 §3.3),
# autocast off (the recorded ops are cast already). `scope.py` also captures, at entry, the CPU and
# *every* initialised accelerator, replays one first initialised inside the scope from its fresh
# seed, and never initialises CUDA. The cell runs on CUDA where there is one (checked against
# `torch.cuda.memory_allocated`), else on the CPU, which made the stored outputs.

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
# ## 11. Hooks that outlive the with block; safe points (M.1, A.1, A.2, A.4, A.5)
#
# Both keep a resident entry at the bottom of the stack, wrap every entry above it (notebook 04 §3.4),
# and release it at a *safe point*: the owning thread, outside our hooks, outside a backward.
# `scope.py` adds fast paths that touch only the top of the stack, and copes with hooks disabled.
#
# **M.1. Why a safe point.** The engine restores the hooks stack after every node. A tensor hook pops
# the top entry mid-backward (private torch API, `_pop_saved_tensors_default_hooks`, what
# `saved_tensors_hooks.__exit__` calls):

# %%
a = torch.randn(3, requires_grad=True)
with saved_tensors_hooks(lambda t: t, lambda t: t):
    seen_inside = []
    a.register_hook(lambda g: seen_inside.append((_pop_saved_tensors_default_hooks(), top_hooks())[1]))
    (a * a).sum().backward()
    print("stack top inside backward after the pop:", seen_inside[0], "| after it:", top_hooks() is not None)

# %% [markdown]
# So a scope tensor dying inside backward leaves the entry there; a final callback queued on the
# engine does nothing when called: its use is its *death*, when the engine drops it after backward
# returns, on the calling thread; then the entry goes. Here scope 2 reads `x`:

# %%
a, c = leaves((300,), (300,))
with gradient_checkpoint_scope():
    x = a.sin()
print("x alive after its with block: resident entry:", top_hooks() is not None)
ref = storage_ref(x)
with gradient_checkpoint_scope():
    y = (x * x).exp()  # x is an input of this scope
z = y * c
del x, y
inside = []
a.register_hook(lambda g: inside.append((ref() is not None, top_hooks() is not None)))
z.sum().backward()
print("inside backward, at a's gradient: x alive, resident entry:", inside[0])
print("right after backward: hooks stack empty:", top_hooks() is None)
del z

# %% [markdown]
# **RETURNN's `exit_saved_tensors_hooks_scope()`** ("exit saved_tensors_hooks_scope if not yet
# done") pops the peer's `saved_tensors_hooks` entry, kept past `__exit__` while a recorded tensor
# lives, asserting it runs on the entering thread. The peer calls it itself once no recorded tensor
# is alive: at `__exit__`, or from a tensor's deletion hook, an unpack, its patched
# `__enter__`/`__exit__`, its `__del__`
# ([source](https://github.com/rwth-i6/returnn/blob/5637148746a4271277229c1667f5a4a989e54a11/returnn/torch/util/gradient_checkpoint.py)).
# Called early by a user, it ends the recomputation: scope tensors saved later are stored. Ours
# needs no such call: the entry goes at the first safe point after the last scope tensor dies (at
# `del x` in notebook 04 §3.4, after backward above, on another thread at its next safe point).
#
# **A.1. No global state left behind**: after a scope and its backward, the next user's
# `saved_tensors_hooks`, torch's checkpoint and `save_on_cpu` all work:

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
    return {"hooks left": hooks_left, "next user hooks packed": len(packed)}
print(no_global_state(gradient_checkpoint_scope), "| nothing patched, nothing left:", assert_clean())

# %%
run_peer("no global state", no_global_state)

# %% [markdown]
# **A.2. Several scopes alive at once** (`get_var1() * get_var2()`, the RETURNN issue "Torch multiple
# simultaneous gradient_checkpoint_scope"): both scope tensors must be freed right after the product.

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

# %%
run_peer("get_var1() * get_var2(), alive", lambda scope: several_scopes(scope)[0])

# %% [markdown]
# **A.4. Enclosing hooks** must still see every saved tensor the scope does not recompute; an
# enclosing `save_on_cpu` must still offload them.

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
def enclosing_save_on_cpu(scope):
    _ = torch.manual_seed(0)
    a, c = leaves((100,), (100,))
    offload, offloaded = save_on_cpu(), []
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

# %%
run_peer("enclosing hook packed", enclosing_hooks)
run_peer("save_on_cpu offloaded", enclosing_save_on_cpu)

# %% [markdown]
# **A.5. An exception inside the scope** leaves no hook and no dispatch mode (`global_state()` reads
# the dispatch-mode stack's depth):

# %%
def raising(scope):
    a = leaves((10,))[0]
    try:
        with scope():
            _ = a.sin()
            raise ValueError("boom")
    except ValueError as error:
        print("caught:", repr(error))
    return {"hooks left": top_hooks() is not None, "dispatch modes left": global_state()["dispatch_modes"]}
print(raising(gradient_checkpoint_scope), "| clean:", assert_clean())

# %%
run_peer("exception", raising)

# %% [markdown]
# **Your turn.** Exercise `04b-scope`: your `04-scope` solution in `exercises/04b_scope.py`, made to
# pass what this appendix teaches; grade it with `check("04b-scope", "exercises/04b_scope.py")`
# (`from ckpt_lab.exercises import check`) in a cell of your own.

# %% [markdown]
# ## 12. Speed
#
# NOTE [ Speed ], at the end of `scope.py`, lists the shortcuts that spare Python calls per op
# (cached schema facts, `__slots__`, an op's C++ entry point called directly), each cited where the
# code takes it; none changes what is recorded or replayed (the benchmark page's scope rows measure them).
#
# ## Summary
#
# | part | the core | `scope.py` adds | shown by |
# |---|---|---|---|
# | per-thread state | hook count, open scope | the backward last replayed in | §1 |
# | inside a checkpoint | torch's hook by name | by code object; `recomputes_region` | §2 |
# | what the tape leaves out | refuses `inference_mode` | its results read as inputs | §3 |
# | born in the scope | refuses `.data`, Parameters built inside | `_Alias` | §4 |
# | inputs | kept for the tape's life | an earlier scope's let go | §5: `True` / `False` |
# | outside tensors written | refused | `_Snapshot` | §6: `[3.0]` |
# | one replay per backward | every op | the ops needed; intermediates freed | §7: `tanh` 1 / 0 |
# | the first replay | everything at once | split on a chain | §8: peak 10 / 8; residual 16 (checkpoint 15) |
# | what a replay refuses | three checks | versions per counter | §9 |
# | RNG, autocast | per random op | every device at entry | §10 |
# | hooks, safe points | resident entry, release | fast paths, hooks disabled | §11 |
#
# The peer, as its outputs above show (returnn 1.20261022.211313):
#
# | case | ours | peer |
# |---|---|---|
# | A.1 one scope, then the next hooks | clean | clean |
# | A.2 `get_var1() * get_var2()`, alive after the product | `[False, False]` | `[True, False]`, hook entry and patched methods left |
# | A.3 nested, alive after forward | `[False, False]` | `[False, True]`, hook entry and patched methods left, an ignored `AssertionError` |
# | A.4 enclosing hook / `save_on_cpu` | `[a, c, y]` / 2 | `[]` (an ignored `RuntimeError`) / 0 |
# | A.5 exception inside | clean | hook entry left |
# | A.6 `buf` | `[3.0]` | `[12.0]`: writes replayed in backward, hook entry left |
#
# Back to [notebook 04](04_checkpoint_scope.ipynb), the scope's main path.
