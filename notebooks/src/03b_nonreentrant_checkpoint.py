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
# **TL;DR.** Record the block's usual graph (grad on) and change only *what it stores*: the pack
# hook ([notebook 03](03_saved_tensor_hooks.ipynb)) stores an empty handle; backward's first unpack
# re-runs the block once, fills the handles still needed, and hands each tensor out once. The graph
# *is* the plain graph, so frozen inputs, `autograd.grad`, `backward(inputs=...)`, keywords and
# nesting work; the re-run stops early, checked against the forward. An MLP block keeps 65,540
# bytes instead of 851,972, as torch's `use_reentrant=False` does.
#
# **After this notebook you can**
#
# 1. build a checkpoint from pack and unpack hooks (checked: exercise 03b-checkpoint, §2);
# 2. say what a draft that caches its re-run still holds after backward (checked: §1's prediction);
# 3. say why frozen inputs, `autograd.grad` and nesting work here, not in the reentrant checkpoint
#    (checked: the exercise's autograd-grad and frozen-input checks; §3.4's assert);
# 4. say how far each checkpoint's re-run goes, and which ones catch a re-run on another path
#    (checked: §4's prediction and its `CheckpointError`);
# 5. compare ours with torch's `use_reentrant=False` in bytes, runs and gradients (checked: §6's
#    asserts).
#
# | question | answered in |
# |---|---|
# | How can hooks make a checkpoint; why do simple drafts fail? | §1 |
# | What does `ckpt_lab.checkpoint` keep, who owns it, what runs when? | §2 |
# | How do I checkpoint and train a sub-network whose inputs don't require grad; is passing the parameters in idiomatic? (forum thread "Checkpoint for a whole subnet") | §3.1 |
# | Why does the reentrant checkpoint refuse `autograd.grad`? (same thread) `backward(inputs=...)`, keywords, nesting? | §3.2–§3.4, §5 |
# | Does the re-run run the whole block? What if it takes another path? | §4 |
# | How do `autograd.Function` and checkpointing relate; why is PyTorch moving checkpoint away from it? (forum thread "Tensor.requires_grad in torch.autograd.Function") | §5 |
# | Is `ckpt_lab.checkpoint` torch's `use_reentrant=False`? | §6 |
#
# Terms: [graph task](glossary.md#graph-task), [saved tensor](glossary.md#saved-tensor),
# [pack and unpack hooks](glossary.md#pack-unpack), [recompute](glossary.md#recompute),
# [reentrant and non-reentrant](glossary.md#checkpoint). `phase()` below reads the graph task's id
# with `torch._C._current_graph_task_id()`, private torch API (−1 outside a backward): no public
# call tells whether code runs inside a backward.

# %%
import functools
import inspect
import itertools
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch._higher_order_ops.wrap import tag_activation_checkpoint_impl
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from ckpt_lab import CallCounter, CheckpointError, LiveMemory, OpCounter, SavedTensorLog, checkpoint
from ckpt_lab.helpers.predict import reveal
from ckpt_lab.helpers.show import show_source
from ckpt_lab.helpers.tensors import all_equal, grads, leaves
from ckpt_lab.helpers.viz import plot_timeline, save_figure, show_dot
from ckpt_lab.instruments import measure_memory
from ckpt_lab.nonreentrant import frame_of, recompute, unpack_from_handle
from ckpt_lab.reentrant import reentrant_checkpoint

_ = torch.manual_seed(0)
print("torch", torch.__version__)

# %% [markdown]
# Helpers: notebook 02's six-`sin` chain; checkpoints alike in signature; `phase()` (forward or
# re-run); a table printer; a "what runs when" drawer.

# %%
def sin_chain(x, n=6):
    for _ in range(n):
        x = x.sin()
    return x

torch_nonreentrant = lambda f, *args, **kwargs: torch_checkpoint(f, *args, use_reentrant=False, **kwargs)
torch_reentrant = lambda f, *args: torch_checkpoint(f, *args, use_reentrant=True)
no_checkpoint = lambda f, *args, **kwargs: f(*args, **kwargs)
hook_based = {"ckpt_lab.checkpoint": checkpoint, "torch, use_reentrant=False": torch_nonreentrant}
phase = lambda: "forward" if torch._C._current_graph_task_id() == -1 else "recompute"
def print_table(rows, columns):  # one line per variant; integers with thousands separators
    line = lambda cells: "".join(f"{c:>{max(len(k), 9) + 2}}" for c, k in zip(cells, columns, strict=True))
    print(f"{'':27}" + line(columns))
    for name, r in rows.items():
        print(f"{name:27}" + line(f"{r[c]:,}" if type(r[c]) is int else str(r[c]) for c in columns))
COLORS = {"forward": "#4c72b0", "recompute": "#55a868", "backward": "#dd8452", "skipped": "#bbbbbb"}
def draw_steps(rows, name):  # rows: {label: [(kind, text), ...]}, kind a key of COLORS
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 0.9 + 0.75 * len(rows)), squeeze=False)
    for ax, (label, steps) in zip(axes[:, 0], rows.items(), strict=True):
        for i, (kind, what) in enumerate(steps):
            ax.barh(0, 0.92, left=i, color=COLORS[kind])
            ax.text(i + 0.46, 0, f"{i + 1}. {what}", ha="center", va="center", fontsize=7, color="white")
        ax.set(yticks=[0], yticklabels=[label], xticks=[], xlim=(0, max(map(len, rows.values()))))
    kinds = [k for k in COLORS if any(k == kind for steps in rows.values() for kind, _ in steps)]
    fig.legend([plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in kinds], kinds, ncol=4, fontsize=8,
               loc="upper center", bbox_to_anchor=(0.5, 1.06))
    save_figure(fig, name)
    plt.show()

# %% [markdown]
# ## 1. A checkpoint made of hooks, in two drafts
#
# A pack hook may return *anything* (notebook 03): let it return a **ticket**. The forward runs with
# grad on, so autograd records every node, minus the saved values. When backward unpacks a ticket,
# re-run the block (grad on) and return the tensor the ticket stands for.

# %%
def draft_recompute_all(function, args):  # re-run function(*args); every tensor it saves, in order
    saved = []
    with torch.enable_grad(), saved_tensors_hooks(lambda t: saved.append(t.detach()) or t, lambda t: t):
        function(*args)
    return saved

def draft_checkpoint_v1(function, *args):  # DRAFT 1: ticket = position; every unpack re-runs it all
    tickets = itertools.count()
    with saved_tensors_hooks(lambda t: next(tickets), lambda i: draft_recompute_all(function, args)[i]):
        return function(*args)

def draft_checkpoint_v2(function, *args):  # DRAFT 2: the first unpack re-runs once and caches it all
    tickets, cache = itertools.count(), []
    def unpack(ticket):
        if not cache:
            cache.extend(draft_recompute_all(function, args))
        return cache[ticket]
    with saved_tensors_hooks(lambda tensor: next(tickets), unpack):
        return function(*args)

# %% [markdown]
# On the 1,000-float chain: runs, `sin`s in backward, live bytes after forward, at the peak, and after
# `backward(retain_graph=True)`.
#
# **Predict.** After the forward, draft 2 holds 4,000 bytes (the output). How many does it hold
# after `backward(retain_graph=True)`, `x.grad` included?

# %%
guess = None  # your guess, in bytes

# %%
def run_draft(variant):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0), requires_grad=True)
    counter = CallCounter(sin_chain)
    with LiveMemory() as mem:
        out = variant(counter, x)
        after_forward = mem.snapshot("after forward")
        with OpCounter() as ops:
            out.sum().backward(retain_graph=True)
        r = {"runs": counter.count, "sin ops in backward": ops.counts["sin"], "after forward": after_forward,
             "peak": mem.peak_bytes, "after backward(retain_graph=True)": mem.snapshot("after backward")}
    return r, x.grad, mem
drafts = {name: run_draft(variant) for name, variant in {
    "no checkpoint": no_checkpoint, "draft 1": draft_checkpoint_v1, "draft 2": draft_checkpoint_v2,
    "ckpt_lab.checkpoint": checkpoint}.items()}
assert all(torch.equal(grad, drafts["no checkpoint"][1]) for _, grad, _ in drafts.values())
print_table({name: r for name, (r, _, _) in drafts.items()}, list(drafts["draft 1"][0]))
reveal(guess, drafts["draft 2"][0]["after backward(retain_graph=True)"], "bytes draft 2 holds after backward")

# %% [markdown]
# Gradients are bitwise equal (asserted); each checkpoint keeps 4,000 bytes instead of 24,000.
# **Draft 1** re-runs at each of the 6 unpacks: **36 `sin`s**. **Draft 2** re-runs once but keeps
# its cache while the graph lives: 28,000 bytes after backward, as without checkpoint: 20,000 of
# cache (five recomputed intermediates), 8,000 of output and `x.grad`, all the package holds; and a
# peak 4,000 bytes higher. **The package** hands each tensor out once, so backward frees it after
# use (and runs one `sin` fewer: §4).

# %%
fig, ax = plt.subplots(figsize=(7, 2.6))
for name, label in {"draft 2": "caches all", "ckpt_lab.checkpoint": "hands out once"}.items():
    plot_timeline(ax, drafts[name][2], f"{name} ({label})")
_ = ax.legend(loc="upper left", bbox_to_anchor=(1, 1))
_ = ax.set_title("six-sin chain, 1,000 floats: forward, then backward with its recomputation")
save_figure(fig, "03b_drafts_timeline")
plt.show()

# %% [markdown]
# Two more defects: the re-run draws a **new dropout mask**, and inputs **held in a closure** escape
# autograd's version check, so modifying one in place goes unnoticed:

# %%
def gradient(run, function, modify_input=False):  # seeded: same input, same dropout mask
    _ = torch.manual_seed(0)
    x = torch.randn(1000, requires_grad=True)
    out = run(function, a := x * 1)
    if modify_input:
        a.add_(1)  # modify the block's input after the forward
    try:
        return torch.autograd.grad(out.sum(), x)[0]
    except RuntimeError as error:
        return "RuntimeError: " + str(error).split(" by an inplace")[0] + " by an inplace operation"

with_dropout = lambda x: F.dropout(x.sin(), 0.5).sin()  # sin, dropout, sin
for name, variant in {"draft 2": draft_checkpoint_v2, "ckpt_lab.checkpoint": checkpoint}.items():
    modified = gradient(variant, sin_chain, modify_input=True)
    print(f"{name:20} dropout: gradient equal to no checkpoint:",
          torch.equal(gradient(variant, with_dropout), gradient(no_checkpoint, with_dropout)),
          "| input modified in place:", modified if isinstance(modified, str) else
          f"no error, gradient correct: {torch.equal(modified, gradient(no_checkpoint, sin_chain))}")

# %% [markdown]
# ## 2. `ckpt_lab.checkpoint`: who owns what, and what runs when
#
# The package keeps draft 2's single re-run and fixes the rest. It snapshots RNG and autocast state
# (notebook 02), builds a *frame* holding what the call needs later, and runs the function under the
# frame's two hooks (`context_fn`: notebook 05).

# %%
show_source(checkpoint, start="replay = ReplayState", stop="    finally:")

# %% [markdown]
# The frame saves the inputs **through autograd**, in `_SaveInputs`, a do-nothing
# `autograd.Function`: they get the version check (the error above), and an enclosing checkpoint's
# pack hook sees them (§3.4). The pack hook returns an empty `Handle` (a dict: graph-task id →
# tensor), and keeps a **weak** reference to it, the tensor's shape, dtype and device, and the op
# that made it (its `grad_fn`'s name, `frame.makers`). When backward frees a node, its handles die,
# telling the frame that tensor is no longer needed. A forward, inspected (`frame_of` finds the
# `Frame` behind a saved tensor's hooks; `_raw_saved_self` is private torch API, notebook 03 §1):

# %%
x = torch.randn(1000, requires_grad=True)
counter = CallCounter(sin_chain)
out = checkpoint(counter, x)
raw = out.grad_fn._raw_saved_self
frame = frame_of(raw)  # the Frame behind the unpack hook of this saved tensor
alive = sum(ref() is not None for ref in frame.handles)
print(f"the graph stores: {type(raw.data).__name__} {raw.data.recomputed} | frame: {len(frame.handles)} weak "
      f"refs, {alive} alive; first saved tensor: {frame.metas[0]} | runs so far: {counter.count}")

# %% [markdown]
# Who owns what after the forward, with the counts just measured (dashed: weak references):

# %%
dot = f"""digraph {{ rankdir=LR; node [shape=box, fontname=Helvetica, fontsize=11];
edge [fontname=Helvetica, fontsize=10]; out [label="output tensor"]; out -> nodes [label="grad_fn"];
nodes [label="graph nodes\\nSinBackward0 × 6", style=filled, fillcolor="#dde8f5"]; nodes -> sv;
sv [label="saved tensors × {len(frame.handles)}\\ndata: a Handle\\nunpack hook: a closure"];
h [label="Handle × {alive}\\nempty until backward"]; x [label="input x\\n{x.nbytes:,} B"];
fr [label="Frame\\nfunction, RNG state,\\n{len(frame.metas)} × (shape, dtype, device, op)", style=filled];
si [label="_SaveInputs node\\n(saved tensors)"]; sv -> h [label="owns"]; sv -> fr [label="closure"];
fr -> h [style=dashed, label="weak refs"]; fr -> si [label="saver"]; si -> x; }}"""
show_dot(dot, "03b_ownership")

# %% [markdown]
# A graph task's first unpack runs one re-run that fills *every* live handle; each unpack then pops
# its tensor, so backward holds the only reference:

# %%
show_source(unpack_from_handle, start="def unpack(handle", stop="unpack.frame = frame")

# %% [markdown]
# `recompute` re-runs the function (RNG and autocast replayed, grad on) under a second pack hook
# that fills each live handle, notes a tensor whose shape, dtype or device is not the forward's (it
# raises when the re-run ends, as torch does), raises at once where another op made the tensor (a
# check torch does not have, §4), and stops at the last live one (`early_stop=False` runs the whole
# function instead):

# %%
show_source(recompute, start="if handles[index] is not None:", stop="# The recomputed graph keeps")

# %% [markdown]
# **What runs when**: a four-`sin` chain logs each `sin`, and a tensor hook on each output logs when
# the gradient reaches it:

# %%
def schedule(variant, n=4):  # steps (kind, what) of forward and backward, and the bytes kept between
    steps = []
    def logged_chain(x):
        for k in range(1, n + 1):
            x = x.sin()
            steps.append((phase(), f"sin {k}"))
            if phase() == "forward":
                x.register_hook(lambda grad, k=k: steps.append(("backward", f"grad at\nsin {k}")))
        return x
    x = torch.randn(1000, requires_grad=True)  # made before measuring: not counted as kept
    return steps, measure_memory(lambda: variant(logged_chain, x).sum()).retained_bytes
runs = {name: schedule(v) for name, v in {"no checkpoint": no_checkpoint, "checkpoint": checkpoint}.items()}
for name, (steps, kept) in runs.items():
    print(f"{name:14} kept {kept:>6,} B:", " → ".join(f"{p} {w}".replace("\n", " ") for p, w in steps))
draw_steps({f"{name}\nkept: {kept:,} B": steps for name, (steps, kept) in runs.items()}, "03b_what_runs_when")

# %% [markdown]
# Without checkpoint, three intermediates stay alive until backward (12,004 bytes with the loss);
# with it, the 4-byte loss. The gradient at `sin 4` (5) unpacks its input: the re-run (6–8) stops
# inside `sin 4`, the last handle needed filled. Handles are emptied even with
# `retain_graph=True`, so each backward re-runs:

# %%
for k in (1, 2):
    out.sum().backward(retain_graph=True)
    print(f"after backward {k}: runs {counter.count} | handles holding a tensor:",
          sum(bool(ref().recomputed) for ref in frame.handles if ref() is not None))

# %% [markdown]
# The exercise's grader runs a small MLP block and the six-`sin` chain: nothing the block made kept
# after the forward, one re-run with grad on, nothing held after backward, gradients bit for bit (a
# second backward, `autograd.grad`, a frozen input, dropout), the caller's random stream as without
# checkpoint, no hook left behind on an error.

# %% [markdown]
# **Your turn.** Write `checkpoint(function, *args)` on saved-tensor hooks in `exercises/03b_checkpoint.py` (open it from the file browser); then run the cell below: it grades your file with this notebook's instruments.

# %%
from ckpt_lab.exercises import check

check("03b-checkpoint", "exercises/03b_checkpoint.py")

# %% [markdown]
# ## 3. The limits of notebook 02, gone
#
# The graph a non-reentrant checkpoint leaves **is** the plain graph (§5 draws both).
#
# ### 3.1 A whole sub-network whose inputs don't require grad
#
# The forum thread "Checkpoint for a whole subnet" checkpoints a sub-network fed by a frozen part of
# the model. The reentrant checkpoint returns a constant; the non-reentrant one needs no wrapper: the
# parameters are leaves of the recorded graph.

# %%
_ = torch.manual_seed(1)
subnet = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 4))
x = torch.randn(5, 8)  # from a frozen part of the model: no grad

def subnet_grads(variant):  # the parameters' gradients after one step
    _ = torch.manual_seed(2)
    variant(subnet, x).square().sum().backward()
    return grads(*subnet.parameters())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = reentrant_checkpoint(subnet, x)
print("reentrant_checkpoint: output requires grad:", out.requires_grad, "| warning:", caught[0].message)
print("ckpt_lab.checkpoint: parameter gradients equal to no checkpoint:",
      all_equal(subnet_grads(checkpoint), subnet_grads(no_checkpoint)), "| x.grad:", x.grad)

# %% [markdown]
# **Is a wrapper passing the parameters in idiomatic?** It is the thread's workaround for the
# reentrant variant (notebook 02); with `use_reentrant=False` it is unnecessary.
#
# ### 3.2 `torch.autograd.grad` and `backward(inputs=...)`
#
# The same thread asks why `autograd.grad` is unsupported. It writes no `.grad`, and
# `backward(inputs=...)` writes only the listed tensors'; the reentrant backward's nested
# `.backward()` writes every leaf's. So it refuses `autograd.grad`; and `backward(inputs=[weight])`
# never runs its node, which hides the parameter: the gradient is silently missing.

# %%
x, weight = torch.randn(5, 8, requires_grad=True), subnet[0].weight
calls = {"autograd.grad([x, weight])": lambda loss: torch.autograd.grad(loss, [x, weight])[1],
         "backward(inputs=[weight])": lambda loss: loss.backward(inputs=[weight]) or grads(weight)[0]}
_ = torch.manual_seed(3)
expected = calls["autograd.grad([x, weight])"](subnet(x).square().sum())
for name, variant in {"reentrant_checkpoint": reentrant_checkpoint, "ckpt_lab.checkpoint": checkpoint,
                      "torch, use_reentrant=True": torch_reentrant}.items():
    for call_name, call in calls.items():
        _ = torch.manual_seed(3)
        try:
            got = call(variant(subnet, x).square().sum())
            verdict = "missing" if got is None else torch.equal(got, expected)
        except RuntimeError as error:
            verdict = f"RuntimeError: {str(error)[:60]}..."
        print(f"{name:26} {call_name:26} weight gradient equal: {verdict} | x.grad: {x.grad}")

# %% [markdown]
# ### 3.3 Keyword arguments, and tensors inside containers
#
# Notebook 02's `reentrant_checkpoint` takes positional tensors only. The frame flattens everything
# and rebuilds containers for the re-run as they were at call time; torch passes the caller's objects
# again, so a side effect on a list happens twice:

# %%
scaled = lambda x, *, scale, bias: torch.tanh(x * scale) + bias[0]
x, b = leaves((6,), (6,))
grad_of = lambda run: torch.autograd.grad(run(scaled, x, scale=1.5, bias=[b]).sum(), [x, b])
print("ckpt_lab.checkpoint: gradients of x and of the tensor in a keyword list equal:",
      all_equal(grad_of(checkpoint), grad_of(no_checkpoint)))
appends = lambda t, seen: seen.append(len(seen)) or t.sin()  # a side effect on a list argument
for name, variant in hook_based.items():
    variant(appends, torch.randn(3, requires_grad=True), seen := []).sum().backward()
    print(f"{name:27} the caller's list after forward and backward: {seen}")

# %% [markdown]
# ### 3.4 Nested checkpoints
#
# The inner checkpoint's inputs are saved through autograd, so the **outer** pack hook swaps them for
# handles too, and the outer re-run rebuilds them when the inner one asks. Each level logs its runs,
# and when its output's gradient arrives:

# %%
def nested_case(variant, by_keyword=False):  # steps (kind, what), bytes kept, gradient of x
    steps = []
    def logged(level, function):
        def run(y):
            steps.append((phase(), f"{level}\nrun {1 + sum(w.startswith(level) for _, w in steps)}"))
            out = function(y)
            if phase() == "forward" and out.requires_grad:
                out.register_hook(lambda grad: steps.append(("backward", f"grad at\n{level} out")))
            return out
        return run
    inner = logged("inner", lambda y: y.sin().exp())
    outer = logged("outer", lambda x: (variant(lambda *, y: inner(y), y=x.sin().cos()) if by_keyword
                                       else variant(inner, x.sin().cos())).cos())
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0), requires_grad=True)
    x.register_hook(lambda grad: steps.append(("backward", "grad at x")))
    with LiveMemory() as mem:
        out = variant(outer, x)
        kept = mem.snapshot("after forward")
    try:
        return steps, kept, torch.autograd.grad(out.sum(), x)[0]
    except RuntimeError:
        return steps, kept, "raises RuntimeError"
nested = {name: nested_case(variant) for name, variant in {
    "no checkpoint": no_checkpoint, "reentrant_checkpoint": reentrant_checkpoint, **hook_based}.items()}
for name, (steps, kept, grad) in nested.items():
    verdict = torch.equal(grad, nested["no checkpoint"][2]) if isinstance(grad, torch.Tensor) else grad
    inner_runs = sum(w.startswith("inner") for _, w in steps)
    print(f"{name:27} kept {kept:>6,} B | inner runs: {inner_runs} | autograd.grad equal: {verdict}")

# %%
assert nested["ckpt_lab.checkpoint"][0] == nested["torch, use_reentrant=False"][0]  # same steps
draw_steps({f"{name}\nkept: {nested[name][1]:,} B": nested[name][0]
            for name in ("no checkpoint", "ckpt_lab.checkpoint")}, "03b_nested")

# %% [markdown]
# Nested, only the output stays alive (4,000 bytes instead of 16,000). The inner function runs three
# times: in the forward (2), in the outer re-run (5) set off by the outer output's gradient (3), and
# in its own re-run (7). With the inner input passed **by keyword**, torch keeps it in a closure, out
# of the outer checkpoint's reach:

# %%
print(*(f"{name:27} inner input by keyword: kept {nested_case(variant, True)[1]:>6,} B"
        for name, variant in hook_based.items()), sep="\n")

# %% [markdown]
# ## 4. Early stop, and the determinism check
#
# A re-run can stop once it has recomputed what backward needs. A block with a dead branch
# (`_unused`, dropped when the forward returns) and a tail that saves nothing:

# %%
def block_with_tail(x):
    y = x.sin().exp()  # sin saves x and exp its result: backward needs both
    _unused = y.tanh()  # saves its result, but `_unused` dies with the forward
    return y * 2 + 1  # saves nothing
with SavedTensorLog() as log:
    block_with_tail(torch.randn(1000, requires_grad=True))
print("tensors the forward saves:", log.count)

# %% [markdown]
# **Predict.** Backward needs two of the three. Of the block's four steps (`sin`, `exp`, `tanh`, the
# tail), how many does torch's re-run run? An `OpCounter` counts the ops each re-run ran.

# %%
guess = None  # your guess: a number of steps, 1 to 4

# %%
stages = {"sin": "sin", "exp": "exp", "tanh": "tanh\n(dead branch)", "add": "* 2 + 1\n(tail)"}
rows, steps_ran = {"forward": [("forward", text) for text in stages.values()]}, {}
for name, variant in {"reentrant_checkpoint": reentrant_checkpoint, **hook_based}.items():
    out = variant(block_with_tail, torch.randn(1000, requires_grad=True))
    with OpCounter() as ops:
        out.sum().backward()  # sin, exp, tanh and add occur in backward only in a re-run
    ran = {op: ops.counts[op] for op in stages}
    steps_ran[name] = sum(map(bool, ran.values()))
    print(f"{name:27} ops the re-run ran: {ran}")
    rows[f"{name} re-run:\n{steps_ran[name]} of {len(stages)} steps"] = [
        ("recompute" if ran[op] else "skipped", text) for op, text in stages.items()]
reveal(guess, steps_ran["torch, use_reentrant=False"], "steps torch's re-run ran")
draw_steps(rows, "03b_early_stop")

# %% [markdown]
# Where each stops, and why:
#
# * The **reentrant** re-run runs all four: its nested backward starts from the rebuilt output.
# * **torch's** stops once it has saved as many tensors as the forward did (`_recomputation_hook`'s
#   pack hook in
#   [torch/utils/checkpoint.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/utils/checkpoint.py):
#   `recomp_counter[gid] == len(weak_holders)`). The count includes `tanh`'s result, whose holder
#   backward already freed: three steps, the third for nothing.
# * **Ours** stops at the last handle still alive, `exp`'s result (`stop_at` in §2's listing): two.
#
# Stopping by position needs the re-run to save the same tensors in the same order. torch compares
# each one's shape, dtype and device with the forward's; ours also the op that made it. A re-run
# that takes another path with the same shapes (a `cos` between `sin` and `exp` from the second call
# on) gets past torch: it would save three tensors where the forward saved two, and early stop ends
# it after two. The reentrant variants keep none of the block's tensors to compare; ours compares
# the outputs:

# %%
def cos_on_rerun(x, calls):  # sin, then exp; from the second call on, a cos between them
    y = x.sin()
    if next(calls) > 1:
        y = y.cos()
    return y.exp()
x = torch.randn(3, requires_grad=True)
expected = torch.autograd.grad(cos_on_rerun(x, itertools.count(1)).sum(), x)[0]
for name, variant in {**hook_based, "reentrant_checkpoint": reentrant_checkpoint,
                      "torch, use_reentrant=True": torch_reentrant}.items():
    x.grad = None
    try:
        variant(functools.partial(cos_on_rerun, calls=itertools.count(1)), x).sum().backward()
        print(f"{name:27} no error; gradient correct: {torch.equal(x.grad, expected)}")
    except CheckpointError as error:
        said = str(error).split(" The checkpointed")[0].split(". The function")[0]  # up to the advice
        print(f"{name:27} CheckpointError:", said)

# %% [markdown]
# torch's two variants return wrong gradients without a word; ours raise, saying where the paths
# parted (`debug=True` adds the aten ops of both runs side by side, each with its line). The cost, in
# the benchmark's paired time ratios: the non-reentrant check (a name per saved tensor, compared in
# the re-run) stays within about 2% on its workloads; the reentrant one (a norm per output in the
# forward and in backward) costs up to 12% on small blocks. `determinism_check="none"` turns either
# off.
#
# ## 5. Why PyTorch moved checkpointing away from `autograd.Function`
#
# The forum thread "Tensor.requires_grad in torch.autograd.Function" asks how `autograd.Function` and
# `torch.utils.checkpoint` relate; albanD answers *"we are transitioning to not use
# autograd.Function to implement AC"* (activation checkpointing). A Function's `backward` *can*
# recompute with `autograd.grad`, so that `autograd.grad` through it works, **if every tensor needing
# a gradient is an input**, parameters included:

# %%
block_fn = lambda x, weight, bias: F.linear(x, weight, bias).tanh()
class RecomputeWithGrad(torch.autograd.Function):  # backward recomputes, then calls autograd.grad
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
grad_of = lambda run: torch.autograd.grad(run(x, *params).square().sum(), [x, *params])
print("autograd.grad through it equal to no checkpoint:", all_equal(grad_of(RecomputeWithGrad.apply),
      grad_of(block_fn)), "| .grad left alone:", all(p.grad is None for p in params))

# %% [markdown]
# But `torch.utils.checkpoint(function, *args)` takes any function, parameters not among `args`;
# to reach them, the reentrant `backward` runs a nested `.backward()`. The two graphs of
# `layer(x).tanh()`, each node labelled with what it saves:

# %%
names = {id(x): "x", id(layer.weight): "weight", id(layer.bias): "bias"}
def graph_cluster(out, title):  # the autograd graph behind `out` (a tree here), as a DOT cluster
    labels, edges, todo = {}, [], [out.grad_fn]
    while todo:
        node = todo.pop()
        saved = [getattr(node, a) for a in dir(node) if a.startswith("_raw_saved_")]
        saved = [s for r in saved for s in (r if isinstance(r, tuple) else [r])]  # a Function's: a tuple
        labels[node] = names.get(id(getattr(node, "variable", None))) or "\\n".join(
            [type(node).__name__, *(f"saves a {type(s.data).__name__}" for s in saved)])
        children = [child for child, _ in node.next_functions if child is not None]
        edges += [(node, child) for child in children]
        todo += children
    print(f"{title}: {len(labels)} nodes; leaves:", sorted(set(names.values()) & set(labels.values())))
    return f'subgraph "cluster {title}" {{ label="{title}"; ' + " ".join(
        [f'"{title}{id(n)}" [label="{label}"];' for n, label in labels.items()]
        + [f'"{title}{id(a)}" -> "{title}{id(b)}";' for a, b in edges]) + " }"

clusters = [graph_cluster(run(lambda x: layer(x).tanh(), x), title) for title, run in
            {"reentrant_checkpoint": reentrant_checkpoint, "ckpt_lab.checkpoint": checkpoint}.items()]
show_dot("digraph { node [shape=box, fontname=Helvetica, fontsize=11]; " + " ".join(clusters) + " }",
         "03b_graph_shapes")

# %% [markdown]
# The reentrant graph is one opaque node saving the input itself; `weight` and `bias` are out of the
# engine's sight, so only a nested backward reaches them. The hook-based graph is the plain one,
# storing handles. Why hooks, as measured: **no reentrancy** (§3.2, §3.4); **no input-requires-grad
# rule** (§3.1); **early stop** (§4, §6); **a check** of the re-run (§4); and **hooks compose**:
# nesting (§3.4), selective checkpointing (a `context_fn`, notebook 05, refused for the reentrant
# variant, §6), and `torch.compile`, whose higher-order op checkpoints with `use_reentrant=False`
# whatever the user passed, and with `preserve_rng_state=False`, leaving the re-run's random numbers
# to the partitioner, which replays them for the random ops inside a checkpoint region: it saves a
# generator state per random op and restores it in backward (measured in notebook 08 §5; §2.1 there
# is a different case, the ops its memory budget recomputes outside any region). `tag_activation_checkpoint_impl`
# in
# [torch/_higher_order_ops/wrap.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/_higher_order_ops/wrap.py)
# (a private module: no public name shows the rule) sets both:

# %%
print(*(line.strip() for line in inspect.getsource(tag_activation_checkpoint_impl).splitlines()
        if line.strip().startswith(('kwargs["use_reentrant"]', 'kwargs["preserve_rng_state"]'))), sep="\n")

# %% [markdown]
# ## 6. Side by side with `torch.utils.checkpoint(..., use_reentrant=False)`
#
# A transformer's MLP block with dropout, batch 64: no checkpoint, notebook 02's reentrant
# checkpoint, the two non-reentrant ones, and torch's with selective checkpointing (SAC) keeping the
# `addmm` outputs, refused with `use_reentrant=True`. Seeded alike; gradients compared bitwise:

# %%
_ = torch.manual_seed(0)
mlp_block = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 256))
keep_addmm = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.addmm.default])
try:
    torch_checkpoint(mlp_block, torch.randn(4, 256), use_reentrant=True, context_fn=keep_addmm)
except ValueError as error:
    print("use_reentrant=True with context_fn: ValueError:", error)

# %%
def mlp_case(variant):
    _ = torch.manual_seed(1)
    x = torch.randn(64, 256, requires_grad=True)
    runs = CallCounter(mlp_block)
    with LiveMemory() as mem:
        loss = variant(mlp_block, x).square().sum()
        retained = mem.snapshot("after forward")
        mem.phase = "backward"
        with OpCounter() as ops:
            loss.backward()
    runs.remove()
    r = {"block runs": runs.count, "addmm in backward": ops.counts["addmm"], "retained": retained,
         "peak": mem.peak(exclude=mem.born_in("backward")), "peak with grads": mem.peak()}
    return grads(x, *mlp_block.parameters()), r  # after the peaks: grads() frees the gradients
variants = {"no checkpoint": no_checkpoint, "reentrant_checkpoint": reentrant_checkpoint, **hook_based,
            "torch, keep addmm (SAC)": lambda f, x: torch_nonreentrant(f, x, context_fn=keep_addmm)}
mlp = {name: mlp_case(variant) for name, variant in variants.items()}
rows = {name: {"grads equal": all_equal(g, mlp["no checkpoint"][0]), **r} for name, (g, r) in mlp.items()}
print_table(rows, list(rows["no checkpoint"]))
for column in ("retained", "peak", "peak with grads"):
    assert rows["ckpt_lab.checkpoint"][column] == rows["torch, use_reentrant=False"][column]

# %% [markdown]
# * **Gradients**: bitwise equal, dropout included: every checkpoint replays the RNG.
# * **Kept**: 65,540 bytes (the output, which `square` saves, and the loss) instead of 851,972.
# * **Recomputed**: the reentrant one redoes both `addmm`s, the non-reentrant ones only the first
#   (early stop skips the output projection); SAC redoes none, keeping more bytes.
# * **Peak**: one recomputed block brings all its activations back at once: the non-reentrant peak
#   equals the un-checkpointed one; the reentrant one is 65,536 bytes higher (131,072 with gradients),
#   as it rebuilds the output while the forward's lives. Peaks fall only over many blocks (notebook 02).
#
# ## Summary
#
# | question | answer (section) |
# |---|---|
# | How does a checkpoint use hooks? | pack stores an empty handle; the first unpack re-runs the block once, filling the live handles, each handed out once (§1, §2) |
# | Who owns what? | graph nodes own the handles; the frame, weak references, metadata, RNG state and the inputs (§2) |
# | Frozen inputs, `autograd.grad`, `backward(inputs=...)`, keywords, nesting? | all work; the reentrant variant fails on each (§3) |
# | The whole block re-run? Another path? | reentrant: all; torch's: until it has saved as many tensors as the forward; ours: until the last handle needed. Another path: ours raise `CheckpointError`, torch's give wrong gradients (§4) |
# | Why leave `autograd.Function`? | it hides the parameters from the engine, so it needs a nested `.backward()` (§5) |
# | Same as torch's `use_reentrant=False`? | same gradients, runs, `addmm`s and bytes (§6) |
