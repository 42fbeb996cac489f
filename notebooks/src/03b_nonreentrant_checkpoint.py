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
# # 03b · The non-reentrant checkpoint: a checkpoint built on saved-tensor hooks
#
# **TL;DR.** Run the block with grad on, so autograd records its usual graph, and change only *what
# the graph stores*: the pack hook ([notebook 03](03_saved_tensor_hooks.ipynb)) stores an empty
# handle instead of each tensor; backward's first unpack re-runs the block once, fills every handle
# still needed, and hands each tensor out once (`use_reentrant=False`, `ckpt_lab.checkpoint`). The
# graph *is* the plain graph, so frozen inputs, `autograd.grad`, `backward(inputs=...)`, keywords and
# nesting work, gradients bitwise equal. The re-run stops early and is checked against the forward. An MLP block with dropout keeps
# 65,540 bytes instead of 851,972, to the byte what torch's keeps.
#
# | question | answered in |
# |---|---|
# | How can hooks make a checkpoint, and why do simple drafts fall short? | §1 |
# | What does `ckpt_lab.checkpoint` keep, who owns it, and what runs when? | §2 (two pictures) |
# | How do I checkpoint a sub-network whose inputs don't require grad, and train it? Is a wrapper passing the parameters in idiomatic? (forum thread "Checkpoint for a whole subnet") | §3.1 |
# | Why is `autograd.grad` unsupported by the reentrant checkpoint, and does it work here? (same thread) | §3.2, §5 |
# | `backward(inputs=...)`, keyword arguments, a checkpoint inside a checkpoint? | §3.2–§3.4 |
# | Does the recomputation run the whole block? What if it differs from the forward? | §4 |
# | How do `autograd.Function` and checkpointing relate; why is PyTorch moving checkpoint away from `autograd.Function`? (forum thread "Tensor.requires_grad in torch.autograd.Function") | §5 |
# | Is `ckpt_lab.checkpoint` the same as torch's `use_reentrant=False`? | §6 |
# | Why does drawing the graph with `show_saved=True` re-run my block? | [notebook 03](03_saved_tensor_hooks.ipynb), §4 |
#
# Terms. A **graph task** is one call of `backward()` or `autograd.grad()`, with an id that
# `torch._C._current_graph_task_id()` returns while it runs (−1 outside). A **reentrant** checkpoint
# (notebook 02) starts a nested backward inside its `backward`.

# %%
import functools
import inspect
import itertools
import warnings

import graphviz
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from IPython.display import Image
from torch import nn
from torch._higher_order_ops.wrap import tag_activation_checkpoint_impl
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from ckpt_lab import CallCounter, CheckpointError, LiveMemory, OpCounter, SavedTensorLog, checkpoint
from ckpt_lab.helpers.show import show_source
from ckpt_lab.helpers.viz import plot_timeline, save_figure, save_png
from ckpt_lab.instruments import measure_memory
from ckpt_lab.nonreentrant import _pack_to_handle, _recompute, _unpack_from_handle
from ckpt_lab.reentrant import reentrant_checkpoint

_ = torch.manual_seed(0)
print("torch", torch.__version__)

# %% [markdown]
# Helpers: notebook 02's six-`sin` chain, torch's two checkpoints, and "no checkpoint", alike in signature.

# %%
def sin_chain(x, n=6):
    for _ in range(n):
        x = x.sin()
    return x

torch_nonreentrant = lambda f, *args, **kwargs: torch_checkpoint(f, *args, use_reentrant=False, **kwargs)
torch_reentrant = lambda f, *args: torch_checkpoint(f, *args, use_reentrant=True)
no_checkpoint = lambda f, *args, **kwargs: f(*args, **kwargs)

hook_based = {"ckpt_lab.checkpoint": checkpoint, "torch, use_reentrant=False": torch_nonreentrant}

# %% [markdown]
# ## 1. A checkpoint made of hooks, in two drafts
#
# A pack hook may return *anything* (notebook 03), so let it return a **ticket**. The forward runs
# with grad on, so autograd records every node; only the saved values are missing. When backward
# unpacks a ticket, re-run the block and hand back the tensor that took its place. A helper re-runs
# the function (grad on: backward runs with grad off) and collects what it saves, in order.

# %%
def draft_recompute_all(function, args):
    """DRAFT helper: re-run ``function(*args)`` and return every tensor it saves, in order."""
    saved = []

    def keep(tensor):
        saved.append(tensor.detach())
        return tensor

    with torch.enable_grad(), saved_tensors_hooks(keep, lambda tensor: tensor):
        function(*args)
    return saved

def draft_checkpoint_v1(function, *args):
    """DRAFT 1: the ticket is the save's position; every unpack re-runs the whole function."""
    tickets = itertools.count()
    with saved_tensors_hooks(lambda tensor: next(tickets),
                             lambda ticket: draft_recompute_all(function, args)[ticket]):
        return function(*args)

def draft_checkpoint_v2(function, *args):
    """DRAFT 2: the first unpack re-runs the function once and caches everything it saved."""
    tickets, cache = itertools.count(), []

    def unpack(ticket):
        if not cache:
            cache.extend(draft_recompute_all(function, args))
        return cache[ticket]

    with saved_tensors_hooks(lambda tensor: next(tickets), unpack):
        return function(*args)

# %% [markdown]
# The drafts, the package and no checkpoint on the chain of 1,000 floats: runs, `sin`s in backward,
# live bytes after forward, at the peak, and after `backward(retain_graph=True)`:

# %%
def run_draft(variant):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0), requires_grad=True)
    counter = CallCounter(sin_chain)
    with LiveMemory() as mem:
        out = variant(counter, x)
        r = {"after forward": mem.snapshot("after forward")}
        mem.phase = "backward"
        with OpCounter() as ops:
            out.sum().backward(retain_graph=True)
        r["after backward(retain_graph=True)"] = mem.snapshot("after backward")
    return {**r, "runs": counter.count, "sin ops in backward": ops.counts["sin"], "peak": mem.peak_bytes,
            "grad": x.grad, "mem": mem}

drafts = {name: run_draft(variant) for name, variant in {
    "no checkpoint": no_checkpoint, "draft 1": draft_checkpoint_v1, "draft 2": draft_checkpoint_v2,
    "ckpt_lab.checkpoint": checkpoint}.items()}
columns = ["runs", "sin ops in backward", "after forward", "peak", "after backward(retain_graph=True)"]
print(f"{'':20}" + "".join(f"{c:>{max(len(c), 7) + 2}}" for c in columns))
for name, r in drafts.items():
    assert torch.equal(r["grad"], drafts["no checkpoint"]["grad"])
    print(f"{name:20}" + "".join(f"{r[c]:>{max(len(c), 7) + 2},}" for c in columns))

# %% [markdown]
# Gradients are bitwise equal (asserted); every checkpoint keeps only the 4,000-byte output after the
# forward, instead of 24,000 bytes.
#
# * **Draft 1** re-runs the chain at each of the 6 unpacks: **36 `sin`s** to rebuild what 6 computed.
# * **Draft 2** re-runs once, but caches every recomputed tensor as long as the graph lives: 20,000
#   bytes after the backward (five intermediates; the sixth saved tensor is `x`), as much as no
#   checkpoint, and its peak is 4,000 bytes above the package's.
# * **The package** hands each recomputed tensor out once and forgets it, so backward frees it when
#   the node that needed it is done. (It also ran one `sin` fewer: the early stop of §4.)

# %%
fig, ax = plt.subplots(figsize=(7, 2.6))
for name, label in {"draft 2": "caches all", "ckpt_lab.checkpoint": "hands out once"}.items():
    plot_timeline(ax, drafts[name]["mem"], f"{name} ({label})")
_ = ax.legend(loc="upper left", bbox_to_anchor=(1, 1))
_ = ax.set_title("six-sin chain, 1,000 floats: forward, then backward with its recomputation")
save_figure(fig, "03b_drafts_timeline")
plt.show()

# %% [markdown]
# Two more defects: the re-run draws a **new dropout mask**; and inputs **held in a closure** escape
# autograd's version check, so an input modified in place after the forward goes unnoticed.

# %%
def gradient(run, function, modify_input=False):
    _ = torch.manual_seed(0)
    x = torch.randn(1000, requires_grad=True)
    out = run(function, a := x * 1)
    if modify_input:
        a.add_(1)  # modify the block's input after the forward
    out.sum().backward()
    return x.grad

with_dropout = lambda x: F.dropout(x.sin(), 0.5).sin()  # sin, dropout, sin
for name, variant in {"draft 2": draft_checkpoint_v2, "ckpt_lab.checkpoint": checkpoint}.items():
    print(f"{name:20} dropout: gradient equal to no checkpoint:",
          torch.equal(gradient(variant, with_dropout), gradient(no_checkpoint, with_dropout)), end=" | ")
    try:
        modified = gradient(variant, sin_chain, modify_input=True)
        print("input modified in place: no error, gradient correct:",
              torch.equal(modified, gradient(no_checkpoint, sin_chain)))
    except RuntimeError as error:
        print("input modified in place:", str(error).split(" by an inplace")[0] + " by an inplace operation")

# %% [markdown]
# ## 2. `ckpt_lab.checkpoint`: who owns what, and what runs when
#
# The package keeps draft 2's single re-run and fixes the rest. The entry point (with grad off it just
# calls the function) snapshots RNG and autocast state (notebook 02's `ReplayState`), builds a
# *frame* holding what the call needs later, and runs the function under the frame's two hooks.
# (`context_fn`, as torch's: context managers around forward and re-run; used in notebook 05.)

# %%
show_source(checkpoint, start="replay = ReplayState")

# %% [markdown]
# The frame saves the inputs **through autograd**: `_SaveInputs` is a do-nothing `autograd.Function`
# whose `forward` calls `ctx.save_for_backward(*inputs)`. So they get the version check (the in-place
# error above), and an enclosing checkpoint's pack hook sees them (§3.4). Tensors passed by keyword
# or inside lists are saved too (§3.3).
#
# The pack hook stores an empty `_Handle` (one dict, `recomputed`: graph-task id → tensor) and keeps a
# **weak** reference to it plus the tensor's shape, dtype and device. The graph owns the handles:
# when backward frees a node, its handles die, and the frame knows that tensor is no longer needed.

# %%
show_source(_pack_to_handle, start="frame.handles.append", stop="# The protocol")

# %% [markdown]
# A forward, inspected: the frame is reachable through the unpack hook's closure. Only the innermost
# hooks run, so `SavedTensorLog().listing()` around the call sees only what was saved *outside* the
# checkpoint's hooks: the input, saved by `_SaveInputs`.

# %%
x = torch.randn(1000, requires_grad=True)
counter = CallCounter(sin_chain)
with LiveMemory() as mem, SavedTensorLog() as log:
    out = checkpoint(counter, x)
    print(f"bytes alive after forward: {mem.snapshot('forward'):,} = out.nbytes: {out.nbytes:,}")
raw = out.grad_fn._raw_saved_self
frame = inspect.getclosurevars(raw.unpack_hook).nonlocals["frame"]
alive = sum(ref() is not None for ref in frame.handles)
print("the graph stores:", type(raw.data).__name__, "with", raw.data.recomputed, "| frame:",
      len(frame.handles), "weak refs,", alive, "alive; first saved tensor:", frame.metas[0],
      "| runs so far:", counter.count)
print(log.listing())

# %% [markdown]
# Who owns what between forward and backward, with the counts just measured (solid: strong
# references; dashed: weak). Handles live as long as the graph nodes that saved them; the frame as
# long as any unpack hook (a closure over it); the input in the `_SaveInputs` node the frame holds.

# %%
dot = f"""digraph {{ rankdir=LR; node [shape=box, fontname=Helvetica, fontsize=11];
edge [fontname=Helvetica, fontsize=10]; out [label="output tensor"];
nodes [label="graph nodes\\nSinBackward0 × 6", style=filled, fillcolor="#dde8f5"];
sv [label="saved tensors × {len(frame.handles)}\\ndata: a _Handle\\nunpack hook: a closure"];
h [label="_Handle × {alive}\\nempty until backward"]; x [label="input x\\n{x.nbytes:,} B"];
fr [label="_Frame\\nfunction, RNG state,\\n{len(frame.metas)} × (shape, dtype, device)",
    style=filled, fillcolor="#f5e6d3"];
si [label="_SaveInputs node\\n(saved tensors)"]; out -> nodes [label="grad_fn"]; nodes -> sv;
sv -> h [label="owns"]; sv -> fr [label="closure"]; fr -> h [style=dashed, label="weak refs"];
fr -> si [label="saver"]; si -> x; }}"""
png = graphviz.Source(dot).pipe(format="png")
save_png(png, "03b_ownership")  # when regenerating the notebook: images/03b_ownership.png
Image(png)

# %% [markdown]
# The unpack hook: a graph task's first unpack triggers one re-run, which fills *every* live handle;
# each unpack then pops its tensor, so backward holds the only reference. An unpack outside backward
# gets an id, and a re-run, of its own. A second unpack of one handle in one graph task raises
# `CheckpointError` (as for a custom `Function` that reads `ctx.saved_tensors` twice).

# %%
show_source(_unpack_from_handle, start="def unpack", stop="if task not in handle.recomputed")

# %% [markdown]
# `_recompute` notes the position `last_needed` of the last live handle, unpacks the inputs, and
# re-runs the function (RNG and autocast replayed, grad on) under a second pack hook. For the tensor
# at position `index` it compares the metadata `recomputed` with the forward's `saved`, drops the
# tensor into the handle at that position, and raises `_StopRecomputation` at `last_needed`. A
# re-run that returns first saved fewer tensors than the forward: `CheckpointError`.

# %%
show_source(_recompute, start="if recomputed != saved:", stop="# The recomputed graph keeps")

# %% [markdown]
# **What runs when**, measured: a four-`sin` chain logs each `sin` it finishes (forward or re-run: the
# graph-task id tells), and a tensor hook on each output logs when backward's gradient reaches it:

# %%
def schedule(variant, n=4):  # events (phase, what) of one step, and the bytes kept for backward
    events = []

    def logged_chain(x):
        phase = "forward" if torch._C._current_graph_task_id() == -1 else "recompute"
        for k in range(1, n + 1):
            x = x.sin()
            events.append((phase, f"sin {k}"))
            if phase == "forward":
                x.register_hook(lambda grad, k=k: events.append(("backward", f"grad at\nsin {k}")))
        return x

    x = torch.randn(1000, requires_grad=True)  # made before measuring: not counted as kept
    return events, measure_memory(lambda: variant(logged_chain, x).sum()).retained_bytes

fig, axes = plt.subplots(2, 1, figsize=(10, 2.6))
colors = {"forward": "#4c72b0", "recompute": "#55a868", "backward": "#dd8452"}
for ax, (name, variant) in zip(axes, {"no checkpoint": no_checkpoint, "checkpoint": checkpoint}.items(),
                               strict=True):
    events, kept = schedule(variant)
    for step, (phase, what) in enumerate(events):
        ax.barh(0, 0.92, left=step, color=colors[phase])
        ax.text(step + 0.46, 0, f"{step + 1}. {what}", ha="center", va="center", fontsize=7, color="white")
    ax.set(yticks=[0], yticklabels=[f"{name}\nkept: {kept:,} B"], xticks=[], xlim=(0, 11))
    print(f"{name:14} kept {kept:>6,} B:", " → ".join(f"{p} {w}".replace("\n", " ") for p, w in events))
fig.legend([plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()], colors, ncol=3, fontsize=8,
           loc="upper center", bbox_to_anchor=(0.5, 1.06))
save_figure(fig, "03b_what_runs_when")
plt.show()

# %% [markdown]
# Step by step. Without checkpoint three intermediates stay alive until backward (12,004 bytes with
# the loss). With it, the forward (1–4) keeps the 4-byte loss (`x` lives in `_SaveInputs`). The
# gradient reaches the last `sin` (5), whose node unpacks its input; that first unpack runs the
# re-run (6–8), which stops inside `sin 4` once the last handle needed is filled.
#
# Back to the frame above: after a backward the handles are empty even with `retain_graph=True`, and
# a second backward re-runs again (so does each read of a saved tensor by hand: notebook 03, §4):

# %%
out.sum().backward(retain_graph=True)
alive = [ref() for ref in frame.handles if ref() is not None]
print("after backward 1: runs", counter.count, "| handles alive:", len(alive),
      "| holding a tensor:", sum(bool(handle.recomputed) for handle in alive))
del alive
out.sum().backward()
alive = sum(ref() is not None for ref in frame.handles)
print("after backward 2: runs", counter.count, "| handles alive:", alive)

# %% [markdown]
# ## 3. The limits of notebook 02, gone
#
# The graph a non-reentrant checkpoint leaves **is** the plain graph, node for node; the reentrant
# one is a single opaque node. Limit by limit, notebook 02's `reentrant_checkpoint` first:

# %%
def graph_nodes(node):
    """Names of the autograd nodes reachable from ``node``, depth first."""
    below = (name for child, _ in node.next_functions if child is not None for name in graph_nodes(child))
    return [type(node).__name__.removesuffix("Backward0").removesuffix("Backward"), *below]

x = torch.randn(4, requires_grad=True)
for name, variant in {"no checkpoint": no_checkpoint, "reentrant_checkpoint": reentrant_checkpoint,
                      "ckpt_lab.checkpoint": checkpoint}.items():
    print(f"{name:21}", graph_nodes(variant(sin_chain, x).grad_fn))

# %% [markdown]
# ### 3.1 A whole sub-network whose inputs don't require grad
#
# The forum thread "Checkpoint for a whole subnet" checkpoints a sub-network fed by a frozen part of
# the model. The reentrant checkpoint warns and returns a constant; backward fails:

# %%
_ = torch.manual_seed(1)
subnet = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 4))
x = torch.randn(5, 8)  # from a frozen part of the model: no grad
_ = torch.manual_seed(2)
subnet(x).square().sum().backward()
reference = [p.grad.clone() for p in subnet.parameters()]
subnet.zero_grad(set_to_none=True)

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = reentrant_checkpoint(subnet, x)
print("warning:", caught[0].message, "| output requires grad:", out.requires_grad)
try:
    out.square().sum().backward()
except RuntimeError as error:
    print("backward:", error)

# %% [markdown]
# The non-reentrant checkpoint needs no wrapper: the parameters are leaves of the recorded graph.
# Same seed, same dropout mask, bitwise-equal gradients:

# %%
_ = torch.manual_seed(2)
out = checkpoint(subnet, x)
out.square().sum().backward()
print("output requires grad:", out.requires_grad, "| x.grad:", x.grad, "| parameter gradients equal:",
      all(torch.equal(p.grad, r) for p, r in zip(subnet.parameters(), reference, strict=True)))

# %% [markdown]
# **Is a wrapper passing the parameters in idiomatic?** For the reentrant variant it is the thread's
# workaround (notebook 02 writes it safely); with `use_reentrant=False` it is unnecessary.
#
# ### 3.2 `torch.autograd.grad` and `backward(inputs=...)`
#
# The same thread asks why `autograd.grad` is unsupported. It is reverse mode like `backward`, but
# returns gradients instead of writing `.grad`; `backward(inputs=...)` writes only the `.grad` of the
# tensors listed. The reentrant backward's nested `.backward()` writes the `.grad` of every leaf it
# reaches, so it refuses `autograd.grad`. Asked for a parameter's gradient with `backward(inputs=...)`
# it does worse, for ours and torch's alike: the parameter is hidden inside its node, so the engine
# never runs it, and the gradient is silently missing. Hooks need no nested backward:

# %%
x, weight = torch.randn(5, 8, requires_grad=True), subnet[0].weight
_ = torch.manual_seed(3)
expected = torch.autograd.grad(subnet(x).square().sum(), [x, weight])[1]
calls = {"autograd.grad([x, weight])": lambda loss: torch.autograd.grad(loss, [x, weight])[1],
         "backward(inputs=[weight])": lambda loss: loss.backward(inputs=[weight]) or weight.grad}
for name, variant in {"reentrant_checkpoint": reentrant_checkpoint, "ckpt_lab.checkpoint": checkpoint,
                      "torch, use_reentrant=True": torch_reentrant}.items():
    for call_name, call in calls.items():
        subnet.zero_grad(set_to_none=True)
        _ = torch.manual_seed(3)
        try:
            got = call(variant(subnet, x).square().sum())
        except RuntimeError as error:
            print(f"{name:26} {call_name:26} RuntimeError: {str(error)[:75]}...")
            continue
        print(f"{name:26} {call_name:26} weight gradient:", "missing, no error" if got is None else
              f"equal {torch.equal(got, expected)}", "| x.grad untouched:", x.grad is None)

# %% [markdown]
# ### 3.3 Keyword arguments, and tensors inside containers
#
# Notebook 02's `reentrant_checkpoint` takes positional tensors only (`TypeError` on a keyword). The
# frame flattens everything, and rebuilds containers for the re-run:

# %%
scaled = lambda x, *, scale, bias: torch.tanh(x * scale) + bias[0]
x, bias = torch.randn(6, requires_grad=True), [torch.randn(6, requires_grad=True)]
expected = torch.autograd.grad(scaled(x, scale=1.5, bias=bias).sum(), [x, bias[0]])
grads = torch.autograd.grad(checkpoint(scaled, x, scale=1.5, bias=bias).sum(), [x, bias[0]])
print("ckpt_lab.checkpoint: gradients of x and of the tensor inside a keyword list equal:",
      all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True)))
appends = lambda t, seen: seen.append(len(seen)) or t.sin()  # a side effect on a list argument
for name, variant in hook_based.items():
    variant(appends, torch.randn(3, requires_grad=True), seen := []).sum().backward()
    print(f"{name:27} the caller's list after forward and backward: {seen}")

# %% [markdown]
# Containers are rebuilt for the re-run from their contents at call time, so the re-run of `appends`
# appended to a copy; torch passes the caller's list again, and the side effect happens twice.
#
# ### 3.4 Nested checkpoints
#
# A nested reentrant checkpoint is still reentrant: `autograd.grad` fails through it. With hooks,
# the inner checkpoint's inputs are saved through autograd (`_SaveInputs`), so the **outer** pack hook
# swaps them for handles too, and the outer re-run rebuilds them when the inner one asks.

# %%
def nested_case(variant, inner_by_keyword=False):  # bytes kept, inner runs, gradient
    inner = CallCounter(lambda y: y.sin().exp())
    outer = lambda x: (variant(lambda *, y: inner(y), y=x.sin().cos()) if inner_by_keyword
                       else variant(inner, x.sin().cos())).cos()
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with LiveMemory() as mem:
        out = variant(outer, x)
        retained = mem.snapshot("after forward")
    try:
        grad = torch.autograd.grad(out.sum(), x)[0]
    except RuntimeError:
        grad = "raises RuntimeError"
    return retained, inner.count, grad

plain_grad = nested_case(no_checkpoint)[2]
for name, variant in {"no checkpoint": no_checkpoint, "reentrant_checkpoint": reentrant_checkpoint,
                      **hook_based}.items():
    retained, runs, grad = nested_case(variant)
    verdict = torch.equal(grad, plain_grad) if isinstance(grad, torch.Tensor) else grad
    print(f"{name:27} retained {retained:>6,} B | inner runs: {runs} | autograd.grad equal: {verdict}")

# %% [markdown]
# Without checkpoints three saved activations and the output stay alive (16,000 bytes); nested, only
# the output (4,000). The inner function runs three times: forward, outer re-run, inner re-run. With
# the inner input passed **by keyword**, torch 2.13 keeps it in a closure, out of the outer
# checkpoint's reach:

# %%
for name, variant in hook_based.items():
    print(f"{name:27} inner input by keyword: retained", f"{nested_case(variant, True)[0]:>6,} B")

# %% [markdown]
# ## 4. Early stop, and the determinism check
#
# After the last handle backward still needs, the rest of the function never runs (§2's schedule). A
# block with a tail that saves nothing (`* 2 + 1`) and a branch the output does not use (`_unused`)
# writes down how far each run got; an `OpCounter` counts the backward's ops:

# %%
def block_with_tail(x, *, log):
    log.append("head")
    y = x.sin().exp()  # saves x and exp's result: needed by backward
    log.append("dead branch")
    _unused = y.tanh()  # saves its result, but `_unused` dies with the forward
    log.append("tail")
    z = y * 2 + 1  # saves nothing
    log.append("end")
    return z

for name, variant in {"reentrant_checkpoint": reentrant_checkpoint, **hook_based}.items():
    log = []
    out = variant(functools.partial(block_with_tail, log=log), torch.randn(1000, requires_grad=True))
    log.clear()
    with OpCounter() as ops:
        out.sum().backward()
    recomputed = {op: ops.counts[op] for op in ("sin", "exp", "tanh", "add")}
    print(f"{name:27} re-run reached {log} | recomputed ops {recomputed}")

# %% [markdown]
# The reentrant checkpoint re-runs everything: its nested backward starts from the recomputed
# *output*. The hook-based ones stop once `exp` has produced its result; `ckpt_lab` even before the
# `tanh`, whose handle died with `_unused` at the end of the forward (torch counts dead handles too).
#
# The price of stopping by position: the re-run must save the same tensors, in the same order, as the
# forward; each is checked against the forward's shape, dtype and device. A function that branches
# on a Python counter trips the check; the reentrant variant, with no check, is silently wrong:

# %%
# First call: uses all of x. Later calls: only its first two elements.
counts_its_calls = lambda x, calls: (x if next(calls) == 1 else x[:2]).sin().sum()
x = torch.randn(3, requires_grad=True)
try:
    checkpoint(counts_its_calls, x, itertools.count(1)).backward()
except CheckpointError as error:
    print("ckpt_lab.checkpoint: CheckpointError:", error)
reentrant_checkpoint(functools.partial(counts_its_calls, calls=itertools.count(1)), x).backward()
print("reentrant: no error; gradient equal to cos(x):", torch.allclose(x.grad, x.detach().cos()),
      "| zeros in the gradient:", int((x.grad == 0).sum()))

# %% [markdown]
# The third element, unused by the re-run, got a gradient of 0 instead of cos(x₂).
#
# ## 5. Why PyTorch moved checkpointing away from `autograd.Function`
#
# The forum thread "Tensor.requires_grad in torch.autograd.Function" asks how `autograd.Function` and
# `torch.utils.checkpoint` relate; albanD answers *"we are transitioning to not use
# autograd.Function to implement AC"* (activation checkpointing). What is the limitation, really? A
# Function's `backward` *can* recompute with `torch.autograd.grad` rather than a nested `.backward()`
# (notebook 02's draft 1, for the input only), and then `autograd.grad` through it works, **if every tensor
# that needs a gradient is passed in as an input**, parameters included:

# %%
block_fn = lambda x, weight, bias: F.linear(x, weight, bias).tanh()
class RecomputeWithGrad(torch.autograd.Function):
    """A checkpoint whose backward uses autograd.grad: every tensor that needs a gradient is an input."""

    @staticmethod
    def forward(ctx, *inputs):
        ctx.save_for_backward(*inputs)
        return block_fn(*inputs)

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            return torch.autograd.grad(block_fn(*inputs), inputs, grad)

layer = nn.Linear(8, 4)
x, params = torch.randn(5, 8, requires_grad=True), [layer.weight, layer.bias]
expected = torch.autograd.grad(block_fn(x, *params).square().sum(), [x, *params])
grads = torch.autograd.grad(RecomputeWithGrad.apply(x, *params).square().sum(), [x, *params])
print("autograd.grad through it equal to no checkpoint:", all(map(torch.equal, grads, expected)),
      "| .grad left alone:", all(p.grad is None for p in params))

# %% [markdown]
# So the trade-off is this. `torch.utils.checkpoint(function, *args)` takes any function, whose
# parameters are not among `args`; a Function returns gradients only for its inputs, so to reach the
# parameters the reentrant `backward` runs a nested `.backward()`, which writes the `.grad` of every
# leaf it finds. That design, chosen so that parameters need not be passed in, rules out
# `autograd.grad` and `backward(inputs=...)`. Hooks remove the trade-off. The reasons, as measured:
#
# 1. **No reentrancy**: one ordinary backward over one ordinary graph, so `autograd.grad`,
#    `backward(inputs=...)` and nesting work (§3.2, §3.4).
# 2. **No input-requires-grad rule**: parameters are leaves of the recorded graph (§3.1).
# 3. **Hooks compose**: nesting (§3.4); selective checkpointing and `torch.compile` (below).
# 4. **Early stop** at the last tensor needed (§4), skipping an MLP block's last matmul (§6).
# 5. **A check for free**: the re-run is compared with the forward (§4).
#
# Point 3: torch's selective checkpointing (notebook 05) is a `context_fn`, two `TorchDispatchMode`s
# that cache chosen ops' outputs in the forward and serve them in the re-run; torch refuses it for the
# reentrant variant (§6 shows it at work). And `torch.compile` wraps the call in a higher-order op
# which, when traced, calls the checkpoint with `use_reentrant=False` whatever the user passed
# (`tag_activation_checkpoint_impl` in torch's `torch/_higher_order_ops/wrap.py`):

# %%
print(*(line.strip() for line in inspect.getsource(tag_activation_checkpoint_impl).splitlines()
        if 'kwargs["use_reentrant"]' in line))

# %% [markdown]
# ## 6. Side by side with `torch.utils.checkpoint(..., use_reentrant=False)`
#
# A transformer's MLP block with dropout, batch 64: no checkpoint, notebook 02's reentrant checkpoint,
# the two non-reentrant ones, and torch's with selective checkpointing that keeps the `addmm` outputs
# (which the reentrant variant refuses). All are seeded alike (each must reproduce the dropout mask).
# We compare gradients bitwise, count block runs and the backward's `addmm`s, and measure memory.

# %%
_ = torch.manual_seed(0)
mlp_block = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 256))
keep_addmm = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.addmm.default])
x = torch.randn(4, 256)
try:
    torch_checkpoint(mlp_block, x, use_reentrant=True, context_fn=keep_addmm)
except ValueError as error:
    print("use_reentrant=True with context_fn: ValueError:", error)

# %%
def mlp_case(variant):
    _ = torch.manual_seed(1)
    x = torch.randn(64, 256, requires_grad=True)
    mlp_block.zero_grad(set_to_none=True)
    runs = CallCounter(mlp_block)
    with LiveMemory() as mem:
        loss = variant(mlp_block, x).square().sum()
        retained = mem.snapshot("after forward")
        mem.phase = "backward"
        with OpCounter() as ops:
            loss.backward()
        del loss
    runs.remove()
    return {"grads": [x.grad, *(p.grad for p in mlp_block.parameters())],
            "block runs": runs.count, "addmm in backward": ops.counts["addmm"], "retained": retained,
            "peak": mem.peak(exclude=mem.born_in("backward")), "peak with grads": mem.peak()}

variants = {"no checkpoint": no_checkpoint, "reentrant_checkpoint": reentrant_checkpoint, **hook_based,
            "torch, keep addmm (SAC)": lambda f, x: torch_nonreentrant(f, x, context_fn=keep_addmm)}
mlp = {name: mlp_case(variant) for name, variant in variants.items()}
columns = ["block runs", "addmm in backward", "retained", "peak", "peak with grads"]
print(f"{'':27}{'grads equal':>12}" + "".join(f"{c:>{max(len(c), 9) + 2}}" for c in columns))
for name, r in mlp.items():
    equal = all(torch.equal(a, b) for a, b in zip(r["grads"], mlp["no checkpoint"]["grads"], strict=True))
    print(f"{name:27}{equal!s:>12}" + "".join(f"{r[c]:>{max(len(c), 9) + 2},}" for c in columns))
for column in ("retained", "peak", "peak with grads"):
    assert mlp["ckpt_lab.checkpoint"][column] == mlp["torch, use_reentrant=False"][column]

# %% [markdown]
# * **Gradients** are bitwise equal, dropout included: every checkpoint replays the RNG.
# * **Kept from forward to backward**: 65,540 bytes (the output, which `square` saves, and the loss)
#   instead of 851,972: 13 times less.
# * **Recomputation**: the reentrant one computes both `addmm`s again, the non-reentrant ones only the
#   first: early stop skips the output projection, whose `Linear` saved its input before multiplying. Selective checkpointing (SAC) recomputes
#   no `addmm`, for more bytes kept.
# * **Peak**: one block recomputed in backward needs all its activations back at once, so the
#   non-reentrant peak equals the un-checkpointed one. The reentrant one goes 65,536 bytes *above*
#   (131,072 counting gradients): it rebuilds the block's output while the forward's is still alive,
#   and holds the gradient flowing into the block until its nested backward is over. The peak falls
#   only when many blocks are recomputed one at a time (notebook 02).
#
# ## Summary
#
# | question | answer | shown by |
# |---|---|---|
# | How does a checkpoint use hooks? | pack stores an empty handle; backward's first unpack re-runs the block once and fills the live handles, each handed out once | §1: draft 1 re-runs 6 times; draft 2 keeps 20,000 recomputed bytes |
# | Who owns what? | graph nodes own the handles; the frame (in the unpack hooks' closure) holds weak references, metadata, function, RNG state and the inputs, saved through autograd | §2: picture; nesting (4,000 bytes where torch keeps 8,000) |
# | What runs when? | forward with handles; the first unpack runs one re-run, which stops at the last handle needed | §2: schedule; 4 bytes kept instead of 12,004 |
# | Frozen inputs, `autograd.grad`, `backward(inputs=...)`, keywords, nesting? | all work, gradients bitwise equal; no wrapper needed (the reentrant variant refuses `autograd.grad` and returns no gradient for `backward(inputs=[weight])`) | §3 |
# | Does the re-run run the whole block? What if it differs? | no, it stops early (earlier than torch's); a difference raises `CheckpointError` (the reentrant variant returns a wrong gradient) | §4, §6 |
# | Why did PyTorch leave `autograd.Function`? | a Function *can* use `autograd.grad` if given the parameters; taking any function without them forces a nested `.backward()`. Hooks also drop the input-requires-grad rule, compose, stop early, check the re-run | §5, §6 |
# | Is `ckpt_lab.checkpoint` torch's `use_reentrant=False`? | same gradients, runs, `addmm`s and bytes on an MLP block; 13 times less kept than no checkpoint | §6 |

