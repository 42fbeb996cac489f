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
# # 03 · Saved-tensor hooks: what autograd keeps for backward, and how to change it
#
# **TL;DR.** Every op whose backward formula needs a value stores it in its graph node as a
# [saved tensor](glossary.md#saved-tensor). An op's inputs are stored as they are; an op's own output is stored as bare data, without
# its `grad_fn`, and re-attached to the node each time it is read. `saved_tensors_hooks(pack, unpack)`
# lets you intercept both ends: autograd stores **whatever `pack` returns** and calls `unpack` when
# backward needs the tensor, even after the `with` block has closed. With a few lines per pair, the
# saved values can be logged tensor by tensor, moved to CPU or to disk, or compressed (bfloat16: the
# saved bytes of a six-`sin` chain fall from 20,004 to 12,004, gradient error < 1 %).
#
# Notebook [03b](03b_nonreentrant_checkpoint.ipynb) uses the same hooks to build the non-reentrant
# checkpoint: a pack hook that stores *nothing* and an unpack hook that recomputes.
#
# **After this notebook you can**
#
# 1. say what an op saves (its inputs as they are, its output as bare data) and read it back
#    (checked: §1's assert);
# 2. say when autograd's in-place check guards a saved tensor, and whether it still does under
#    hooks (checked: §3's second prediction);
# 3. write a pack/unpack pair that meets a byte target with gradients within a tolerance (checked:
#    exercise 03-pack-unpack, §3);
# 4. say what offloading and compression cost on a CPU (checked: §3's prediction);
# 5. say why drawing a checkpointed graph with `show_saved=True` re-runs the block (checked: §4's
#    prediction).
#
# | question | answered in |
# |---|---|
# | What does autograd save for backward, and is a saved tensor the same object as the original? | §1 |
# | How does a node keep its own output without owning itself? | §1 |
# | When can a saved tensor no longer be read, and when does an in-place change go unnoticed? | §1 |
# | What are pack and unpack hooks, and when does each run? | §2 |
# | How do I see what a block saves, tensor by tensor? | §2 |
# | How can hooks offload saved tensors (CPU, disk) or compress them, and at what cost? | §3 |
# | Why does drawing the graph with `show_saved=True` re-run a checkpointed block? | §4 |
# | How is a checkpoint built from these hooks? | notebook [03b](03b_nonreentrant_checkpoint.ipynb) |

# %%
import itertools
import tempfile
import warnings
from contextlib import nullcontext
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks

from ckpt_lab import CallCounter, SavedTensorLog, checkpoint, measure_memory
from ckpt_lab.helpers.predict import reveal
from ckpt_lab.helpers.show import show_source
from ckpt_lab.helpers.viz import draw_graph, plot_memory_bars, save_figure, show_dot

_ = torch.manual_seed(0)
print("torch", torch.__version__)

# %% [markdown]
# The running example is notebook 02's chain of six `sin`s: each `sin` saves its input for backward,
# since d sin(x)/dx = cos(x).

# %%
def sin_chain(x, n=6):
    for _ in range(n):
        x = x.sin()
    return x

# %% [markdown]
# ## 1. What autograd saves
#
# Every op that needs a value in its backward formula stores it in its node (`grad_fn`) as a
# *saved tensor*, readable as `grad_fn._saved_<name>` (underscore names: torch's saved-tensor-hooks
# tutorial reads them, but they are not stable API). `pow` needs its input, and stores it as it is:

# %%
x = torch.randn(5, requires_grad=True)
y = x.pow(2)
print("y.grad_fn._saved_self is x:", y.grad_fn._saved_self is x)
print("y.grad_fn._saved_exponent: ", y.grad_fn._saved_exponent, "(a non-tensor is saved too)")

# %% [markdown]
# `exp` needs its *output* (d eˣ/dx = eˣ). What comes back holds the same numbers in the same
# [storage](glossary.md#storage), with the same `grad_fn`, and yet it is **not** the same Python
# object, and reading it twice gives two different objects:

# %%
y = x.exp()
saved = y.grad_fn._saved_result
print("torch.equal(saved, y):               ", torch.equal(saved, y))
print("saved is y:                          ", saved is y)
print("saved.data_ptr() == y.data_ptr():    ", saved.data_ptr() == y.data_ptr())
print("saved.grad_fn is y.grad_fn:          ", saved.grad_fn is y.grad_fn)
print("_saved_result is _saved_result again:", y.grad_fn._saved_result is y.grad_fn._saved_result)
assert saved is not y and saved.data_ptr() == y.data_ptr() and saved.grad_fn is y.grad_fn

# %% [markdown]
# Why? A node that kept its own output *with* its `grad_fn` would own itself: node → output →
# `grad_fn` → node, a cycle of C++ shared pointers that nothing would ever free. So autograd's
# `SavedVariable` (in
# [`torch/csrc/autograd/saved_variable.cpp`](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/csrc/autograd/saved_variable.cpp))
# stores an output as **bare data, without `grad_fn`**, and keeps no reference to the node at all.
# Reading it calls `unpack(saved_for)`, where the *caller* passes the node that owns the saved
# tensor; `unpack` builds a fresh tensor around the data and attaches that node as its `grad_fn`.
# (`SavedVariable` has a `weak_grad_fn_` field, but it serves only one corner: an output that was
# modified in place through a view.) Three observations show it. `_raw_saved_result.data` is the
# stored value, read without unpacking (`_raw_saved_*`, private torch API, is the only way to see
# it); the node keeps working after `y` is gone; and the raw `SavedTensor.unpack()`, called without
# a node, cannot rebuild the output:

# %%
y = x.exp()
node = y.grad_fn
stored = node._raw_saved_result.data
print("stored data: grad_fn", stored.grad_fn, "| requires_grad", stored.requires_grad,
      "| same memory as y:", stored.data_ptr() == y.data_ptr())
del y  # the node is now the only owner of exp's result
print("after del y: node._saved_result.grad_fn is node:", node._saved_result.grad_fn is node)
try:
    node._raw_saved_result.unpack()  # no node passed: nothing to attach
except RuntimeError as error:
    print("SavedTensor.unpack() without a node: RuntimeError:", str(error).split(",")[0])

# %% [markdown]
# (The message speaks of `.detach_()` because, without a node, the data looks like a tensor whose
# history was cut off.) Inputs have no cycle problem: an input's node is another node, upstream. They
# are stored as they are, leaves or not, `grad_fn` included:

# %%
h = x.sin()
e = x.exp()
cases = {
    "x.pow(2) saves x (a leaf input)": (x.pow(2).grad_fn._saved_self, x),
    "h.pow(2) saves h (a non-leaf input)": (h.pow(2).grad_fn._saved_self, h),
    "x * h saves both inputs": (torch.mul(x, h).grad_fn._saved_other, h),
    "e = x.exp() saves its output e": (e.grad_fn._saved_result, e),
}
for label, (saved, original) in cases.items():
    print(f"{label:38} same object: {saved is original!s:5}  same storage: "
          f"{saved.data_ptr() == original.data_ptr()}")

# %% [markdown]
# The picture: who holds what, for `h = x.sin()` and `e = h.exp()`. Solid arrows own (a reference
# count); the dashed one is what `unpack` does when someone (backward, or `_saved_result`) reads the
# saved output.

# %%
show_dot("""digraph { rankdir=LR; node [shape=box, fontname=Helvetica, fontsize=11];
 edge [fontname=Helvetica, fontsize=10];
 e [label="tensor e\\ngrad_fn = ExpBackward0"]; h [label="tensor h\\ngrad_fn = SinBackward0"];
 exp [label="ExpBackward0 (node)", style=filled, fillcolor="#dde8f5"];
 sin [label="SinBackward0 (node)", style=filled, fillcolor="#dde8f5"];
 sr [label="SavedVariable result\\ne's data, no grad_fn"]; ss [label="SavedVariable self\\nx itself"];
 e -> exp; h -> sin; exp -> sin [label="next_functions"]; exp -> sr; sin -> ss;
 sr -> exp [style=dashed, label="unpack(saved_for = this node)\\nattaches the caller's node"]; }""",
         "03_saved_variable")

# %% [markdown]
# Two more facts about saved tensors that a checkpoint will rely on. Without hooks, autograd
# remembers each saved tensor's *version counter* and refuses to hand out one that was modified in
# place since; and backward frees the saved tensors of every node it has run (unless
# `retain_graph=True`), after which reading them raises:

# %%
a = x * 1
y = a.pow(2)
a.add_(1)
try:
    y.grad_fn._saved_self
except RuntimeError as error:
    print("after a.add_(1):", str(error).split(" Hint:")[0])

y = x.pow(2)
y.sum().backward()
try:
    y.grad_fn._saved_self
except RuntimeError as error:
    print("after backward: ", error)

# %% [markdown]
# What becomes of that check once saved-tensor hooks (§2) stand between autograd and the saved
# tensor is a prediction at the end of §3.
#
# ## 2. Pack and unpack hooks
#
# `torch.autograd.graph.saved_tensors_hooks(pack_hook, unpack_hook)` is a context manager. While it is
# active, every time an op saves a tensor, autograd calls `pack_hook(tensor)` and stores **whatever it
# returns**, tensor or not. When backward (or anyone) reads the saved tensor, autograd calls
# `unpack_hook(stored)` and uses the tensor it returns, which must hold the same values as the
# original. A logging pair shows when each runs:

# %%
events = []

def pack_logging(tensor):
    events.append(("pack", "x" if tensor is x else type(tensor.grad_fn).__name__.removesuffix("Backward0")))
    return tensor

def unpack_logging(tensor):
    events.append(("unpack", "x" if tensor is x else type(tensor.grad_fn).__name__.removesuffix("Backward0")))
    return tensor

x = torch.randn(3, requires_grad=True)
with saved_tensors_hooks(pack_logging, unpack_logging):
    y = x.pow(2).exp()
events.append(("exit", "with block closed"))
y.sum().backward()
print(" → ".join(f"{kind} {what}" for kind, what in events))

# %% [markdown]
# Packing happens during the forward, in op order; unpacking during the backward, in reverse. `sum`
# packed nothing (its backward only needs a shape). And the unpacks ran *after* the `with` block had
# closed: each saved tensor keeps the hooks that were active when it was packed. The same events on
# a timeline:

# %%
fig, ax = plt.subplots(figsize=(8, 1.6))
colors = {"pack": "#4c72b0", "exit": "#999999", "unpack": "#dd8452"}
for step, (kind, what) in enumerate(events):
    ax.barh(0, 0.9, left=step, color=colors[kind])
    ax.text(step + 0.45, 0, f"{kind}\n{what}", ha="center", va="center", fontsize=8, color="white")
ax.set_yticks([])
ax.set_xticks([0.95, 2.45, 3.95], ["forward (hooks active)", "with closes", "backward"])
_ = ax.set_title("y = x.pow(2).exp() under logging hooks: when pack and unpack run")
save_figure(fig, "03_pack_unpack_timeline")
plt.show()

# %% [markdown]
# `ckpt_lab`'s `SavedTensorLog` (notebook 01's instrument) is such a hook: its pack writes the tensor
# down and returns it unchanged. `listing()` prints one line per saved tensor, like JAX's
# `print_saved_residuals`: its shape, bytes, which op made it, and the line of code where it was
# saved. A small MLP, with parameters listed too:

# %%
_ = torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
with SavedTensorLog() as log:
    out = mlp(torch.randn(8, 16))
print(log.listing(parameters=True))

# %% [markdown]
# The first `Linear` saves its input, the batch ("no grad_fn": it was made outside autograd), for its
# weight's gradient, and not its weight, since the batch needs no gradient. `ReLU` saves its output;
# the second `Linear` saves its input (ReLU's output again: one storage, counted once) and its
# weight. Three saves, 8·16·4 + 8·32·4 = 1,536 bytes of activations, and one parameter.
#
# ## 3. Offloading and compressing: a pack hook may store anything
#
# Since autograd stores whatever `pack_hook` returns, the hook decides *where* and *how* the saved
# values live. Four pairs, each a few lines:
#
# * **offload by hand**: store `(device, tensor.to("cpu"))`, move back in unpack. On a GPU this
#   copies every saved activation to host memory in forward, so the device copy can be freed, and
#   back in backward. On a CPU tensor `.to("cpu")` returns the tensor itself: nothing moves;
# * **`torch.autograd.graph.save_on_cpu`**, torch's version of the same (its pack hook is below);
# * **to disk**: `torch.save` to a file, store the path, `torch.load` in unpack, as in PyTorch's
#   saved-tensor-hooks tutorial. On this CPU-only machine it is the one that visibly moves bytes out;
# * **compress**: store a `bfloat16` or `float16` copy, cast back to the original dtype in unpack.

# %%
copies = []

def offload_pack(tensor):
    packed = tensor.to("cpu")
    copies.append(packed.data_ptr() != tensor.data_ptr())
    return tensor.device, packed

def offload_unpack(packed):
    device, tensor = packed
    return tensor.to(device)

# %%
def to_disk(folder):
    paths = (Path(folder) / f"{i}.pt" for i in itertools.count())

    def pack(tensor):
        path = next(paths)
        torch.save(tensor, path)
        return path

    return saved_tensors_hooks(pack, lambda path: torch.load(path, weights_only=True))

def compressed(dtype, keep_leaves=False):
    def pack(tensor):
        if keep_leaves and tensor.is_leaf:
            return tensor.dtype, tensor  # alive anyway (an input, a parameter): a copy would only add
        return tensor.dtype, tensor.to(dtype)

    def unpack(packed):
        original_dtype, tensor = packed
        return tensor.to(original_dtype)

    return saved_tensors_hooks(pack, unpack)

# %%
show_source(save_on_cpu, start="def pack_to_cpu", stop="def unpack_from_cpu")

# %% [markdown]
# (Its unpack is `tensor.to(device, non_blocking=pin_memory)`.) Each pair runs the six-`sin` chain on
# 1,000 floats; `measure_memory` counts the bytes that stay alive between forward and backward (the
# input `x` was made before, so it is not counted), and we compare the gradient with the one computed
# without hooks:

# %%
x_values = torch.randn(1000)

def run_with(hooks):
    """Retained bytes after forward, and x's gradient, for the six-sin chain under ``hooks()``."""
    x = x_values.clone().requires_grad_()

    def forward():
        with hooks():
            return sin_chain(x).sum()

    return measure_memory(forward).retained_bytes, x.grad

# %% [markdown]
# **Predict.** Without hooks the chain keeps 20,004 bytes. On this CPU-only machine, how many does
# it keep under `save_on_cpu(pin_memory=True)`?

# %%
guess = None  # your guess, in bytes

# %%
_, grad_plain = run_with(nullcontext)
retained, errors = {}, {}
with tempfile.TemporaryDirectory() as folder:
    variants = {
        "no hooks": nullcontext,
        "offload by hand": lambda: saved_tensors_hooks(offload_pack, offload_unpack),
        "save_on_cpu()": save_on_cpu,
        "save_on_cpu(pin_memory=True)": lambda: save_on_cpu(pin_memory=True),
        "to disk": lambda: to_disk(folder),
        "bfloat16": lambda: compressed(torch.bfloat16),
        "float16": lambda: compressed(torch.float16),
        "bfloat16, leaves kept": lambda: compressed(torch.bfloat16, keep_leaves=True),
    }
    for name, hooks in variants.items():
        retained[name], grad = run_with(hooks)
        errors[name] = ((grad - grad_plain).norm() / grad_plain.norm()).item()
        print(f"{name:29} retained {retained[name]:>6,} bytes   gradient bitwise equal: "
              f"{torch.equal(grad, grad_plain)}")
print("hand offload: real copies made on this machine:", sum(copies), "of", len(copies))
reveal(guess, retained["save_on_cpu(pin_memory=True)"], "bytes kept, save_on_cpu(pin_memory=True)")

# %%
fig, ax = plt.subplots(figsize=(8, 2.6))
plot_memory_bars(ax, retained, "six-sin chain, 1,000 floats: bytes kept from forward to backward")
save_figure(fig, "03_hooks_memory")
plt.show()

# %% [markdown]
# Reading the table and the bars:
#
# * Without hooks, the five intermediates stay alive, 5 × 4,000 bytes, plus the 4-byte loss. The
#   sixth saved tensor is `x` itself, created before.
# * The offloading hooks change nothing on a CPU: the hand hook made no copy. `save_on_cpu` even
#   *adds* 4,000 bytes with `pin_memory=True`: its pack allocates a fresh (here unpinned) buffer and
#   copies every saved tensor into it, including `x`, which stays alive anyway. On a GPU, the same
#   hooks take the five intermediates off the device. (Measured once on an H100 with torch 2.11, not
#   re-checked here: for the chain on 1,000,000 floats, device memory after the forward fell from
#   24,971,776 bytes to the 4,000,256 of the output, with all three hooks, gradients bitwise equal.)
# * Writing to disk leaves only the loss in memory: the hook really did take the saved values out.
# * Compression halves the saved bytes, and `x`'s half-size copy costs 2,000 bytes on top of `x`
#   itself. Keeping leaves as they are avoids that cost: 5 × 2,000 + 4.
#
# All offloads give bitwise-equal gradients; compression gives *close* ones. How close depends on
# the format (bfloat16 keeps 8 significant bits, float16 keeps 11):

# %%
print("bfloat16: relative gradient error < 1e-2:", errors["bfloat16"] < 1e-2)
print("float16:  relative gradient error < 1e-3:", errors["float16"] < 1e-3)
print("bfloat16's error larger than float16's:  ", errors["bfloat16"] > errors["float16"])

# %% [markdown]
# What the graph holds is exactly what the pack hook returned. `_raw_saved_<name>.data` gives the
# packed value *without* calling unpack:

# %%
x = torch.randn(4, requires_grad=True)
with saved_tensors_hooks(offload_pack, offload_unpack):
    y = x.sin()
print("stored in the graph:", type(y.grad_fn._raw_saved_self.data).__name__,
      "of", [type(item).__name__ for item in y.grad_fn._raw_saved_self.data])

# %% [markdown]
# So a pack hook may return *anything*, even an object that holds no tensor at all, as long as its
# unpack hook can produce the values again when backward asks. Returning an empty ticket and
# **recomputing** in unpack is the non-reentrant checkpoint, the subject of notebook
# [03b](03b_nonreentrant_checkpoint.ipynb).

# %% [markdown]
# ### Hooks and autograd's in-place check
#
# §1 showed autograd refusing a saved tensor that was modified in place after it was saved. With
# hooks, autograd stores what pack returns and backward gets what unpack returns.
#
# **Predict.** Under hooks whose pack and unpack return the tensor unchanged, does
# `y = x * 1; z = y.sin(); y.add_(1); z.sum().backward()` still raise?

# %%
guess = None  # your guess: True (it raises) or False

# %%
def in_place_after_save(hooks, sin=torch.sin):  # (raises?, is x's gradient cos of the *modified* y?)
    x = torch.randn(5, requires_grad=True)
    with hooks:
        y = x * 1
        z = sin(y)  # sin saves y
    y.add_(1)
    try:
        z.sum().backward()
    except RuntimeError:
        return True, "-"
    return False, torch.equal(x.grad, y.detach().cos())

in_checkpoint = lambda y: checkpoint(torch.sin, y)  # notebook 03b's checkpoint
cases = {"no hooks": (nullcontext(), torch.sin),
         "identity hooks": (saved_tensors_hooks(lambda t: t, lambda t: t), torch.sin),
         "pack stores a copy": (saved_tensors_hooks(lambda t: t.clone(), lambda t: t), torch.sin),
         "checkpoint(sin)": (nullcontext(), in_checkpoint),
         "checkpoint(sin) in save_on_cpu": (save_on_cpu(), in_checkpoint)}
outcomes = {name: in_place_after_save(*case) for name, case in cases.items()}
for name, (raised, modified_used) in outcomes.items():
    print(f"{name:31} raises: {raised!s:5} | gradient is cos(modified y): {modified_used}")
reveal(guess, outcomes["identity hooks"][0], "error under identity hooks")

# %% [markdown]
# Without hooks, the error; with identity hooks, no error and a gradient computed from the modified
# `y`, silently. The version check holds only without [saved-tensor hooks](glossary.md#pack-unpack):
# `SavedVariable::unpack` skips it when hooks are set ("If user provides hooks, we can't track
# versions through the hooks"): what an unpack hook returns has no saved version to compare. The
# last two rows use `ckpt_lab.checkpoint`, whose hooks notebook 03b builds. What it means:
#
# * **Offload and compression**: a pack hook that stores a *copy* (a GPU tensor moved to the host, a
#   smaller dtype, a file) hands backward the value the forward saved: no error, and the gradient of
#   what the forward computed. One that stores the tensor itself (an identity or logging hook;
#   `save_on_cpu` on a CPU tensor, where `.cpu()` is the tensor, as above) hands backward the modified
#   value.
# * **Every hook-based checkpoint** stores handles, which carry no version either. Ours and torch's
#   (`_CheckpointFrame.save_inputs` in `torch/utils/checkpoint.py`) keep the check for the block's
#   *inputs* by saving them as saved tensors outside their own hooks (the `checkpoint(sin)` row
#   raises); inside an enclosing pair of hooks, an offload or an outer checkpoint, those inputs pass
#   through that pair and the check is gone (the last row).

# %% [markdown]
# The exercise's targets, on the same chain: at most 12,004 bytes kept from forward to backward,
# x's gradient within 1% (relative, in norm) of the one without hooks, and each unpack giving back
# the shape, dtype and device that were saved.

# %% [markdown]
# **Your turn.** Write a pack/unpack pair in `exercises/03_pack_unpack.py` (open it from the file browser) that meets the byte target with gradients within the tolerance; then run the cell below: it grades your file with this notebook's instruments.

# %%
from ckpt_lab.exercises import check

check("03-pack-unpack", "exercises/03_pack_unpack.py")

# %% [markdown]
# ## 4. Reading a saved tensor runs the unpack hook: the torchviz trap
#
# `grad_fn._saved_<name>` is an unpack like backward's, so it runs the unpack hook. With a checkpoint
# whose unpack hook recomputes (`ckpt_lab.checkpoint`, built in 03b), reading a saved tensor by hand
# re-runs the block. torchviz's `make_dot(..., show_saved=True)` reads every saved tensor to draw it,
# so drawing the graph re-runs the block once per saved tensor. `draw_graph` (torchviz, counting the
# aten ops that ran while drawing) warns.
#
# **Predict.** How many times does drawing `checkpoint(sin, sin, exp)` with `show_saved=True` re-run
# the block?

# %%
guess = None  # your guess: a number of re-runs

# %%
x = torch.randn(4, requires_grad=True)
block = CallCounter(lambda t: t.sin().sin().exp())
out = checkpoint(block, x)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    picture = draw_graph(out, {"x": x}, show_saved=True, name="03_torchviz_trap")
print("warning:", *(w.message for w in caught if issubclass(w.category, UserWarning)))
print("runs: forward 1, while drawing", block.count - 1, "| aten ops while drawing:",
      picture.ops_while_drawing)
reveal(guess, block.count - 1, "re-runs while drawing")
block.reset()
print("without show_saved: runs", block.count, "| ops while drawing:",
      draw_graph(out, {"x": x}).ops_while_drawing)
picture

# %% [markdown]
# Three saved tensors (`x`, `sin(x)`, and `exp`'s result), three extra runs of the block, 21 aten ops
# that had nothing to do with drawing; drawn without `show_saved`, nothing is unpacked.
#
# ## Summary
#
# | question | answer | shown by |
# |---|---|---|
# | What does autograd save, and is it the same tensor? | inputs are stored as the same object; an op's output is stored as data without `grad_fn`, and each read builds a new tensor on the same storage | §1 |
# | How does a node keep its own output without a reference cycle? | `SavedVariable` keeps no reference to the node; `unpack(saved_for)` attaches the node the caller passes (`weak_grad_fn_` only serves in-place ops on views) | §1: stored data has no `grad_fn`; the node still works after `del y`; `unpack()` without a node fails |
# | When can a saved tensor not be read? | after backward freed it; after an in-place change (version counter), but only without hooks: under hooks the change goes unnoticed | §1: without hooks the error; identity hooks: no error, gradient from the modified value |
# | What can a pack hook return, and when do the hooks run? | anything; pack in forward in op order, unpack in backward in reverse, even after the `with` block closed | §2: the timeline |
# | What does a block save, tensor by tensor? | `SavedTensorLog().listing()`: shape, bytes, the op that made it, where it was saved | §2: an MLP saves 3 activations, 1,536 bytes, and 1 weight |
# | What do offload and compression buy? | disk: 20,004 → 4 bytes kept, bitwise-equal gradients; bfloat16: 20,004 → 12,004 (10,004 keeping leaves), error < 1e-2; CPU offload moves nothing on a CPU (24,004 with `pin_memory=True`) | §3; exercise 03-pack-unpack |
# | Why does drawing the graph with `show_saved=True` re-run my checkpointed block? | reading a saved tensor is an unpack; under a checkpoint, unpack recomputes | §4: 3 extra runs, 21 aten ops |
# | How is a checkpoint built on hooks? | pack returns an empty handle, unpack recomputes | notebook [03b](03b_nonreentrant_checkpoint.ipynb) |
