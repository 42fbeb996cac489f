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
# # 03 · Saved-tensor hooks: a checkpoint that autograd does not notice
#
# Notebook 02 built activation checkpointing as a custom `autograd.Function`, like
# `torch.utils.checkpoint(..., use_reentrant=True)`, and met its limits. A sub-network whose inputs
# don't require grad trains no parameters (seed 001's *"None of the inputs have requires_grad=True"*,
# then *"element 0 of tensors does not require grad"*), and `torch.autograd.grad` raises. Below we
# meet more: `backward(inputs=...)` raises too, keyword arguments are refused, and nothing checks that
# the recomputation matches the forward. In seed 002, albanD says: *"we are transitioning to not use
# autograd.Function to implement AC (Activation Checkpointing) anymore."*
#
# This notebook builds the replacement, `use_reentrant=False`. The idea fits in one sentence: let
# autograd record the block's graph exactly as it would without checkpointing, and change only **what
# the graph stores** for backward. The tool is `torch.autograd.graph.saved_tensors_hooks`.
#
# 1. What autograd saves, and in what form
# 2. Pack and unpack hooks: log, offload, compress
# 3. A checkpoint from hooks, in two drafts, then `ckpt_lab.checkpoint` piece by piece
# 4. The limits of notebook 02, one by one, gone
# 5. Early stop and the determinism check
# 6. The torchviz trap: drawing the graph recomputes the block
# 7. Why PyTorch moved away from `autograd.Function`
# 8. Side by side with `torch.utils.checkpoint(..., use_reentrant=False)`
#
# As before, every claim stands on a printed or asserted number, which nbval re-checks on every run.
# The code we end with lives in `ckpt_lab/nonreentrant.py`; the notebook shows it rather than copying
# it. The notebook's own attempts at a checkpoint are named `draft_...`: each falls short in a way a
# number shows, and none is the package's code.

# %%
import functools
import inspect
import itertools
import tempfile
import warnings
from contextlib import nullcontext
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from ckpt_lab import (
    CallCounter,
    CheckpointError,
    LiveMemory,
    OpCounter,
    SavedTensorLog,
    checkpoint,
    measure_memory,
    reentrant_checkpoint,
)
from ckpt_lab.helpers.show import show_source
from ckpt_lab.helpers.viz import draw_graph, plot_memory_bars, plot_timeline, save_figure
from ckpt_lab.nonreentrant import (
    _Frame,
    _graph_task_id,
    _Handle,
    _pack_to_handle,
    _recompute,
    _SaveInputs,
    _unpack_from_handle,
)

_ = torch.manual_seed(0)
print("torch", torch.__version__)


# %% [markdown]
# Helpers used throughout: the six-`sin` chain of notebook 02 (each `sin` saves its input for
# backward, since d sin(x)/dx = cos(x)), torch's checkpoint with `use_reentrant` spelled out,
# "call the function, no checkpoint", so that every variant has the same signature, and the two
# hook-based checkpoints, ours and torch's, which we will often compare.

# %%
def sin_chain(x, n=6):
    for _ in range(n):
        x = x.sin()
    return x


def torch_nonreentrant(function, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def torch_reentrant(function, *args):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)


def no_checkpoint(function, *args, **kwargs):
    return function(*args, **kwargs)


hook_based = {"ckpt_lab.checkpoint": checkpoint, "torch, use_reentrant=False": torch_nonreentrant}


# %% [markdown]
# ## 1. What autograd saves
#
# Every op that needs a value in its backward formula stores it in its node (`grad_fn`) as a
# *saved tensor*, readable as `grad_fn._saved_<name>`. `pow` needs its input, and stores it as it is:

# %%
x = torch.randn(5, requires_grad=True)
y = x.pow(2)
print("y.grad_fn._saved_self is x:", y.grad_fn._saved_self is x)
print("y.grad_fn._saved_exponent: ", y.grad_fn._saved_exponent, "(a non-tensor is saved too)")

# %% [markdown]
# `exp` needs its *output* (d eˣ/dx = eˣ). What comes back holds the same numbers in the same memory,
# with the same `grad_fn`, and yet it is **not** the same Python object, and reading it twice gives
# two different objects:

# %%
y = x.exp()
saved = y.grad_fn._saved_result
print("torch.equal(saved, y):               ", torch.equal(saved, y))
print("saved is y:                          ", saved is y)
print("saved.data_ptr() == y.data_ptr():    ", saved.data_ptr() == y.data_ptr())
print("saved.grad_fn is y.grad_fn:          ", saved.grad_fn is y.grad_fn)
print("_saved_result is _saved_result again:", y.grad_fn._saved_result is y.grad_fn._saved_result)

# %% [markdown]
# Why the difference? A node that kept its own output, `grad_fn` included, would own itself: node →
# output → `grad_fn` → node, a cycle of C++ shared pointers that nothing would ever free. So
# autograd's `SavedVariable` stores an output's data with only a *weak* reference to its node, and
# builds a fresh tensor around the same storage, `grad_fn` restored, on every read. Inputs have no such
# problem and are stored as they are, whether they are leaves or not:

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
# Two more facts about saved tensors that a checkpoint will rely on. Autograd remembers each saved
# tensor's *version counter* and refuses to hand out one that was modified in place since; and
# backward frees the saved tensors of every node it has run (unless `retain_graph=True`), after which
# reading them raises:

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
# ## 2. Pack and unpack hooks
#
# `torch.autograd.graph.saved_tensors_hooks(pack_hook, unpack_hook)` is a context manager. While it is
# active, every time an op saves a tensor, autograd calls `pack_hook(tensor)` and stores **whatever it
# returns**, tensor or not. When backward (or anyone) reads the saved tensor, autograd calls
# `unpack_hook(stored)` and uses the tensor it returns, which must hold the same values as the
# original. A tiny logging pair shows when each runs:

# %%
events = []


def describe(tensor):
    return "x" if tensor is x else f"a tensor made by {type(tensor.grad_fn).__name__}"


def pack_logging(tensor):
    events.append(f"pack   {describe(tensor)}")
    return tensor


def unpack_logging(tensor):
    events.append(f"unpack {describe(tensor)}")
    return tensor


x = torch.randn(3, requires_grad=True)
with saved_tensors_hooks(pack_logging, unpack_logging):
    y = x.pow(2).exp()
events.append("-- forward done, hooks context exited")
y.sum().backward()
print("\n".join(events))

# %% [markdown]
# Three things to notice. Packing happens during the forward, in op order; unpacking during the
# backward, in reverse. `sum` packed nothing (its backward only needs a shape). And the unpack hook
# ran *after* the `with` block ended: each saved tensor keeps the hooks that were active when it was
# packed. That last property is what makes a checkpoint possible.
#
# `ckpt_lab`'s `SavedTensorLog` (notebook 01's instrument) is exactly such a hook: its pack writes down
# the tensor's shape, dtype and storage size, and returns the tensor unchanged:

# %%
show_source(SavedTensorLog, start="def _pack", stop="# ---")

# %%
_ = torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
with SavedTensorLog() as log:
    out = mlp(torch.randn(8, 16))
print(log.summary())

# %% [markdown]
# The first `Linear` saves its input, the batch, for its weight's gradient (and not its weight: the
# batch needs no gradient); `ReLU` saves its output; the second `Linear` saves its input (ReLU's output
# again, one storage counted once) and its weight. Three saves, 8·16·4 + 8·32·4 = 1,536 bytes of
# activations, and one parameter.
#
# ### Offloading, compressing: a pack hook may store anything
#
# Since autograd stores whatever `pack_hook` returns, the hook decides *where* and *how* the saved
# values live. Four pairs, each a few lines:
#
# * **offload by hand**: store `(device, tensor.to("cpu"))`, move back in unpack. On a GPU this
#   copies every saved activation to host memory in forward, so the device copy can be freed, and
#   back in backward. On a CPU tensor `.to("cpu")` returns the tensor itself: nothing moves;
# * **`torch.autograd.graph.save_on_cpu`**, torch's version of the same (its code is below);
# * **to disk**: `torch.save` to a file, store the path, `torch.load` in unpack, as in PyTorch's
#   saved-tensor-hooks tutorial. On this CPU-only machine it is the one that visibly moves bytes out;
# * **compress**: store a `bfloat16` or `float16` copy, cast back to the original dtype in unpack.

# %%
copies = []


def draft_offload_pack(tensor):
    packed = tensor.to("cpu")
    copies.append(packed.data_ptr() != tensor.data_ptr())
    return tensor.device, packed


def draft_offload_unpack(packed):
    device, tensor = packed
    return tensor.to(device)


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


show_source(save_on_cpu, start="def __init__")

# %% [markdown]
# Each pair runs the six-`sin` chain on 1,000 floats; `measure_memory` counts the bytes that stay
# alive between forward and backward (the input `x` was made before, so it is not counted), and we
# compare the gradient with the one computed without hooks:

# %%
x_values = torch.randn(1000)


def run_with(hooks):
    """Retained bytes after forward, and x's gradient, for the six-sin chain under ``hooks()``."""
    x = x_values.clone().requires_grad_()

    def forward():
        with hooks():
            return sin_chain(x).sum()

    return measure_memory(forward).retained_bytes, x.grad


_, grad_plain = run_with(nullcontext)
results = {}
with tempfile.TemporaryDirectory() as folder:
    variants = {
        "no hooks": nullcontext,
        "offload by hand": lambda: saved_tensors_hooks(draft_offload_pack, draft_offload_unpack),
        "save_on_cpu()": save_on_cpu,
        "save_on_cpu(pin_memory=True)": lambda: save_on_cpu(pin_memory=True),
        "to disk": lambda: to_disk(folder),
        "bfloat16": lambda: compressed(torch.bfloat16),
        "float16": lambda: compressed(torch.float16),
        "bfloat16, leaves kept": lambda: compressed(torch.bfloat16, keep_leaves=True),
    }
    for name, hooks in variants.items():
        retained, grad = run_with(hooks)
        relative_error = ((grad - grad_plain).norm() / grad_plain.norm()).item()
        results[name] = relative_error
        equal = torch.equal(grad, grad_plain)
        print(f"{name:29} retained {retained:>6,} bytes   gradient bitwise equal: {equal}")
print("hand offload: real copies made on this machine:", sum(copies), "of", len(copies))

# %% [markdown]
# Reading the table:
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
print("bfloat16: relative gradient error < 1e-2:", results["bfloat16"] < 1e-2)
print("float16:  relative gradient error < 1e-3:", results["float16"] < 1e-3)
print("bfloat16's error larger than float16's:  ", results["bfloat16"] > results["float16"])

# %% [markdown]
# What the graph holds is exactly what the pack hook returned. `_raw_saved_<name>` exposes the
# `SavedTensor` object itself, and its `.data` gives the packed value *without* calling unpack:

# %%
x = torch.randn(4, requires_grad=True)
with saved_tensors_hooks(draft_offload_pack, draft_offload_unpack):
    y = x.sin()
print("stored in the graph:", type(y.grad_fn._raw_saved_self.data).__name__,
      "of", [type(item).__name__ for item in y.grad_fn._raw_saved_self.data])

# %% [markdown]
# ## 3. A checkpoint made of hooks
#
# Now the trick. A pack hook may return *anything*, so let it return **nothing of the tensor**: a
# small ticket. The forward runs normally, with grad on, so autograd records every node of the block,
# as without checkpointing; only the saved values are missing. When backward unpacks a ticket, run
# the block again and hand back the tensor that took that ticket's place.
#
# Both drafts below share one helper: re-run the function (grad on, since backward runs with grad
# off and ops would save nothing) under a pack hook that collects, in order, everything it saves.

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

    def pack(tensor):
        return next(tickets)

    def unpack(ticket):
        return draft_recompute_all(function, args)[ticket]

    with saved_tensors_hooks(pack, unpack):
        return function(*args)


# %%
def run_draft(variant):
    """Run the six-sin chain of 1,000 floats under ``variant``; count runs and sin ops, track memory."""
    _ = torch.manual_seed(0)
    x = torch.randn(1000, requires_grad=True)
    counter = CallCounter(sin_chain)
    with LiveMemory() as mem:
        out = variant(counter, x)
        after_forward = mem.snapshot("after forward")
        mem.phase = "backward"
        with OpCounter() as ops:
            out.sum().backward(retain_graph=True)
        after_backward = mem.snapshot("after backward")
    return {
        "runs": counter.count,
        "sin ops in backward": ops.counts["sin"],
        "after forward": after_forward,
        "peak": mem.peak_bytes,
        "after backward(retain_graph=True)": after_backward,
        "grad": x.grad,
        "mem": mem,
    }


reference = run_draft(no_checkpoint)
draft1 = run_draft(draft_checkpoint_v1)
print("gradient equal to no checkpoint:", torch.equal(draft1["grad"], reference["grad"]))
print("function runs: forward 1 + backward", draft1["runs"] - 1,
      "| sin ops in backward:", draft1["sin ops in backward"])
print("bytes alive after forward:", f"{draft1['after forward']:,}", "(the output only) vs",
      f"{reference['after forward']:,}", "without checkpoint")

# %% [markdown]
# Draft 1 is correct and keeps only the output between forward and backward. But backward unpacked 6
# saved tensors and each unpack re-ran the whole chain: **6 re-runs, 36 `sin`s** to rebuild what one
# forward of 6 `sin`s computed. A block that saves N tensors costs N extra forwards, quadratic work.
#
# Draft 2 re-runs once and keeps the results:

# %%
def draft_checkpoint_v2(function, *args):
    """DRAFT 2: the first unpack re-runs the function once and caches everything it saved."""
    tickets = itertools.count()
    cache = []

    def pack(tensor):
        return next(tickets)

    def unpack(ticket):
        if not cache:
            cache.extend(draft_recompute_all(function, args))
        return cache[ticket]

    with saved_tensors_hooks(pack, unpack):
        return function(*args)


draft2 = run_draft(draft_checkpoint_v2)
package = run_draft(checkpoint)
print(f"{'':24}{'runs':>5}{'sin ops in backward':>21}{'after forward':>15}{'peak':>8}"
      f"{'after backward(retain_graph=True)':>35}")
drafts = {"no checkpoint": reference, "draft 1": draft1, "draft 2": draft2, "ckpt_lab.checkpoint": package}
for name, r in drafts.items():
    assert torch.equal(r["grad"], reference["grad"])
    print(f"{name:24}{r['runs']:>5}{r['sin ops in backward']:>21}{r['after forward']:>15,}{r['peak']:>8,}"
          f"{r['after backward(retain_graph=True)']:>35,}")

# %% [markdown]
# All four give bitwise-equal gradients (asserted). Draft 2 re-runs once, 6 `sin`s. But its cache
# holds every recomputed tensor as long as the graph lives: after a backward with `retain_graph=True`
# it keeps 20,000 bytes (the five recomputed intermediates; the sixth saved tensor is `x` itself) next
# to the 4,000-byte output and the 4,000-byte gradient, exactly as much as no checkpoint at all. Its
# peak is the un-checkpointed one too, 4,000 bytes above the package's, because tensors backward has
# finished with are still cached. The package hands each recomputed tensor out once and forgets it,
# so backward frees it as soon as the node that needed it is done. (It also ran one `sin` fewer: the
# early stop of §5.) The live-memory timeline of the backward shows the difference:

# %%
fig, ax = plt.subplots(figsize=(7, 2.6))
for name, r in {"draft 2 (caches all)": draft2, "ckpt_lab.checkpoint (hands out once)": package}.items():
    plot_timeline(ax, r["mem"], name)
_ = ax.legend(loc="upper left", bbox_to_anchor=(1, 1))
_ = ax.set_title("six-sin chain, 1,000 floats: forward, then backward with its recomputation")
save_figure(fig, "03_drafts_timeline")
plt.show()

# %% [markdown]
# Both drafts have three more defects that the numbers above cannot show, because the sin chain
# draws no random numbers, and nobody touched its input:
#
# * **randomness**: the re-run draws a new dropout mask, so the recomputed activations are not the
#   forward's;
# * **inputs held in a closure**: autograd never learns about them, so modifying one in place after
#   the forward goes unnoticed, and the re-run computes from the modified value;
# * **no check** that the re-run saved the same tensors as the forward (§5 shows one failing).

# %%
def with_dropout(x):
    return F.dropout(x.sin(), 0.5).sin()


for name, variant in {"draft 2": draft_checkpoint_v2, "ckpt_lab.checkpoint": checkpoint}.items():
    grads = []
    for run in (no_checkpoint, variant):
        _ = torch.manual_seed(0)
        x = torch.randn(1000, requires_grad=True)
        run(with_dropout, x).sum().backward()
        grads.append(x.grad)
    print(f"{name:20} dropout: gradient equal to no checkpoint: {torch.equal(*grads)}")

x = torch.randn(1000, requires_grad=True)
a = x * 1
out = draft_checkpoint_v2(sin_chain, a)
a.add_(1)  # modify the block's input after the forward
out.sum().backward()
expected = torch.autograd.grad(sin_chain(x * 1).sum(), x)[0]
print("draft 2, input modified in place: no error, gradient correct:", torch.allclose(x.grad, expected))

a = x * 1
out = checkpoint(sin_chain, a)
a.add_(1)
try:
    out.sum().backward()
except RuntimeError as error:
    print("ckpt_lab.checkpoint:", str(error).split(" Hint:")[0])

# %% [markdown]
# ### The package, piece by piece
#
# `ckpt_lab.checkpoint` keeps draft 2's single re-run and fixes the rest. Top down, the entry point:
# snapshot RNG and autocast state (notebook 02's `ReplayState`), build a frame that holds the inputs,
# and run the function under the frame's two hooks.
#
# Its one extra keyword is torch's `context_fn`: a pair of context managers entered around the forward
# and around each re-run. Plain checkpointing leaves it empty; notebook 05's selective checkpointing
# plugs its two dispatch modes in there.

# %%
show_source(checkpoint)

# %% [markdown]
# The frame saves the inputs **through autograd**, as saved tensors of a do-nothing node, instead of
# in a Python list. That buys two things: autograd's version check (the in-place error above), and,
# for a nested checkpoint, an enclosing checkpoint's pack hook sees them (§4.5). Arguments are
# flattened with `tree_flatten`, so tensors passed by keyword or inside lists are saved the same way.

# %%
show_source(_SaveInputs)

# %%
show_source(_Frame)

# %% [markdown]
# The forward's pack hook gives autograd an empty `_Handle` and keeps, per saved tensor, a **weak**
# reference to it and the tensor's shape, dtype and device. The graph owns the handles: when backward
# frees a node, its handles die, and the frame can tell that nobody needs that tensor anymore.

# %%
show_source(_Handle)

# %%
show_source(_pack_to_handle)

# %% [markdown]
# Let us look at a forward. What the graph stores is a `_Handle` with nothing in it, and the frame
# (reachable through the unpack hook's closure) holds one weak reference and one metadata record per
# saved tensor. Nothing of the six-`sin` chain's activations is alive: only the output.

# %%
x = torch.randn(1000, requires_grad=True)
counter = CallCounter(sin_chain)
with LiveMemory() as mem:
    out = checkpoint(counter, x)
    print(f"bytes alive after forward: {mem.snapshot('forward'):,} = out.nbytes: {out.nbytes:,}")
raw = out.grad_fn._raw_saved_self
frame = inspect.getclosurevars(raw.unpack_hook).nonlocals["frame"]
print("the graph stores:", type(raw.data).__name__, "with", raw.data.recomputed)
print("frame:", len(frame.handles), "handles,", sum(ref() is not None for ref in frame.handles), "alive;",
      "first saved tensor:", frame.metas[0])
print("function runs so far:", counter.count)

# %% [markdown]
# The unpack hook: the first unpack of a backward triggers one recomputation, which fills *every*
# live handle; each unpack then pops its tensor, so backward holds the only reference. Backward
# passes are told apart by the engine's graph-task id; an unpack outside any backward (reading
# `grad_fn._saved_self` by hand) gets an id of its own, and so a recomputation of its own.

# %%
show_source(_unpack_from_handle)

# %%
show_source(_graph_task_id)

# %% [markdown]
# The recomputation replays the forward's RNG and autocast state and runs the function under a second
# pack hook that drops each tensor into the handle at the same position, after checking its metadata
# against the forward's, and stops the re-run once the last handle still alive is filled:

# %%
show_source(_recompute)

# %% [markdown]
# Exercising it on the forward above: one backward, one re-run, and the handles are empty afterwards
# even with `retain_graph=True` (they gave their tensors away). A second backward recomputes again;
# reading a saved tensor by hand recomputes each time:

# %%
with OpCounter() as ops:
    out.sum().backward(retain_graph=True)
print("after backward 1: runs", counter.count, "| sin ops in backward:", ops.counts["sin"],
      "| handles alive:", sum(ref() is not None for ref in frame.handles),
      "| still holding a tensor:", sum(bool(ref().recomputed) for ref in frame.handles if ref() is not None))
out.sum().backward()
print("after backward 2: runs", counter.count,
      "| handles alive:", sum(ref() is not None for ref in frame.handles))

out = checkpoint(counter, x)
counter.reset()
_ = out.grad_fn._saved_self
_ = out.grad_fn._saved_self
print("two reads of out.grad_fn._saved_self outside backward: runs", counter.count)

# %% [markdown]
# Handing out once has one consequence: a custom `Function` whose `backward` reads
# `ctx.saved_tensors` twice gets an error the second time (torch's checkpoint behaves the same):

# %%
class ReadsSavedTwice(torch.autograd.Function):
    """A Function whose backward reads ctx.saved_tensors twice (read it once into a variable instead)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        (x,) = ctx.saved_tensors
        return 2 * x * grad


out = checkpoint(lambda t: ReadsSavedTwice.apply(t.sin()), torch.randn(3, requires_grad=True))
try:
    out.sum().backward()
except CheckpointError as error:
    print("CheckpointError:", error)

# %% [markdown]
# Finally, a consequence for measuring: only the **innermost** saved-tensor hooks run. A
# `SavedTensorLog` around a checkpoint sees only what the checkpoint saves before installing its own
# hooks, the block's input:

# %%
x = torch.randn(1000, requires_grad=True)
for name, variant in {"no checkpoint": no_checkpoint, "ckpt_lab.checkpoint": checkpoint}.items():
    with SavedTensorLog() as log:
        out = variant(sin_chain, x)
    print(f"{name:20} SavedTensorLog: {log.summary()}")

# %% [markdown]
# That is why `ckpt_lab` measures checkpoints with `LiveMemory`, which watches storages being born
# and freed below autograd, and sees whatever the hooks keep.
#
# ## 4. The limits of notebook 02, gone
#
# The graph a non-reentrant checkpoint leaves behind **is** the plain graph, node for node; the
# reentrant one is a single opaque node. Listing the nodes reachable from the output:

# %%
def graph_nodes(tensor):
    """Names of the autograd nodes reachable from ``tensor.grad_fn``, depth first."""
    names, stack = [], [tensor.grad_fn]
    while stack:
        node = stack.pop()
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return names


x = torch.randn(4, requires_grad=True)
for name, variant in {"no checkpoint": no_checkpoint, "reentrant_checkpoint": reentrant_checkpoint,
                      "ckpt_lab.checkpoint": checkpoint}.items():
    print(f"{name:21}", graph_nodes(variant(sin_chain, x)))

# %% [markdown]
# Everything autograd can do with a plain graph, it can now do with a checkpointed one. Limit by
# limit, each time `ckpt_lab.reentrant_checkpoint` (notebook 02) first, then `ckpt_lab.checkpoint`.
#
# ### 4.1 Seed 001: a whole sub-network, inputs that don't require grad
#
# Seed 001 checkpoints a sub-network whose inputs come from a frozen part of the model. The
# reentrant checkpoint warns and returns a constant; backward then fails:

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
print("warning:", caught[0].message)
print("output requires grad:", out.requires_grad)
try:
    out.square().sum().backward()
except RuntimeError as error:
    print("backward:", error)

# %% [markdown]
# The non-reentrant checkpoint needs no wrapper, no `requires_grad_()` on the input, no parameters
# passed in (seed 001's `_NetCheckpointWrapper` becomes unnecessary): the parameters are leaves of the
# recorded graph like in any forward. Same seed, same dropout mask, bitwise-equal gradients:

# %%
_ = torch.manual_seed(2)
out = checkpoint(subnet, x)
out.square().sum().backward()
print("output requires grad:", out.requires_grad, "| x.grad:", x.grad)
print("parameter gradients equal to no checkpoint:",
      all(torch.equal(p.grad, r) for p, r in zip(subnet.parameters(), reference, strict=True)))

# %% [markdown]
# ### 4.2 `torch.autograd.grad`
#
# Seed 001 also asks why `autograd.grad` is unsupported. It is reverse mode, like `backward`, and
# returns the gradients instead of writing `.grad` (notebook 02, §5). The reentrant backward runs a
# nested `.backward()`, which *would* write `.grad`, so it refuses. With hooks there is no nested
# backward:

# %%
x = torch.randn(5, 8, requires_grad=True)
wanted = [x, subnet[0].weight]
subnet.zero_grad(set_to_none=True)
try:
    torch.autograd.grad(reentrant_checkpoint(subnet, x).square().sum(), wanted)
except RuntimeError as error:
    print("reentrant:", error)

_ = torch.manual_seed(3)
expected = torch.autograd.grad(subnet(x).square().sum(), wanted)
_ = torch.manual_seed(3)
grads = torch.autograd.grad(checkpoint(subnet, x).square().sum(), wanted)
print("ckpt_lab.checkpoint: equal to no checkpoint:",
      all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True)),
      "| .grad left alone:", x.grad is None and all(p.grad is None for p in subnet.parameters()))

# %% [markdown]
# ### 4.3 Keyword arguments (and tensors inside containers)

# %%
def scaled(x, *, scale, bias):
    return torch.tanh(x * scale) + bias[0]


x = torch.randn(6, requires_grad=True)
bias = [torch.randn(6, requires_grad=True)]
try:
    reentrant_checkpoint(scaled, x, scale=1.5, bias=bias)
except TypeError as error:
    print("reentrant:", error)

expected = torch.autograd.grad(scaled(x, scale=1.5, bias=bias).sum(), [x, bias[0]])
grads = torch.autograd.grad(checkpoint(scaled, x, scale=1.5, bias=bias).sum(), [x, bias[0]])
print("ckpt_lab.checkpoint: gradients of x and of the tensor inside a keyword list equal:",
      all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True)))

# %% [markdown]
# To find the tensors inside lists, tuples and dicts, `_Frame` flattens the arguments with
# `tree_flatten` when the checkpoint is called and rebuilds them with `tree_unflatten` for the
# recomputation. So the recomputation receives a **new** list with the elements the original had at
# call time, where torch passes the original object. A function that appends to a list argument
# shows the difference:

# %%
def appends_to(x, seen):
    seen.append(len(seen))
    return x.sin()


for name, variant in hook_based.items():
    seen = []
    variant(appends_to, torch.randn(3, requires_grad=True), seen).sum().backward()
    print(f"{name:28} the caller's list after forward and backward: {seen}")

# %% [markdown]
# Appending to a list argument is a side effect that a recomputation should not repeat anyway, but it
# is a difference: with `ckpt_lab`, a mutable container argument is a snapshot, not a shared object.

# %% [markdown]
# ### 4.4 `backward(inputs=...)`

# %%
x = torch.randn(5, 8, requires_grad=True)
subnet.zero_grad(set_to_none=True)
try:
    reentrant_checkpoint(subnet, x).square().sum().backward(inputs=[subnet[0].weight])
except RuntimeError as error:
    print("reentrant: raises RuntimeError:", str(error).startswith("reentrant_checkpoint cannot be used"))

_ = torch.manual_seed(4)
(expected,) = torch.autograd.grad(subnet(x).square().sum(), [subnet[0].weight])
subnet.zero_grad(set_to_none=True)
_ = torch.manual_seed(4)
checkpoint(subnet, x).square().sum().backward(inputs=[subnet[0].weight])
print("ckpt_lab.checkpoint: weight gradient equal:", torch.equal(subnet[0].weight.grad, expected),
      "| other .grad untouched:", x.grad is None and subnet[3].weight.grad is None)

# %% [markdown]
# ### 4.5 Nested checkpoints
#
# A checkpoint inside a checkpoint. The reentrant variant nests too, by re-entering the engine twice,
# but a nested reentrant checkpoint is still reentrant, so `autograd.grad` fails through it. With
# hooks, nesting is just a stack of hooks: the inner checkpoint's inputs are saved through autograd
# (`_SaveInputs`), so the **outer** pack hook swaps them for handles as well, and the outer
# recomputation rebuilds them when the inner one asks.

# %%
def nested_case(variant, inner_by_keyword=False):
    """An outer checkpoint around a function that checkpoints an inner part; returns counts and grads."""
    _ = torch.manual_seed(0)
    inner = CallCounter(lambda y: y.sin().exp())

    def outer(x):
        y = x.sin().cos()
        inner_out = variant(lambda *, y: inner(y), y=y) if inner_by_keyword else variant(inner, y)
        return inner_out.cos()

    x = torch.randn(1000, requires_grad=True)
    with LiveMemory() as mem:
        out = variant(outer, x)
        retained = mem.snapshot("after forward")
    runs_in_forward = inner.count
    try:
        (grad,) = torch.autograd.grad(out.sum(), x)
    except RuntimeError as error:
        grad = error
    return retained, runs_in_forward, inner.count, grad


plain_grad = nested_case(no_checkpoint)[3]
nested_variants = {"no checkpoint": no_checkpoint, "reentrant_checkpoint": reentrant_checkpoint, **hook_based}
for name, variant in nested_variants.items():
    retained, runs_forward, runs_total, grad = nested_case(variant)
    verdict = torch.equal(grad, plain_grad) if isinstance(grad, torch.Tensor) else "raises RuntimeError"
    print(f"{name:28} retained {retained:>6,} bytes | inner runs: forward {runs_forward}, total {runs_total}"
          f" | autograd.grad equal: {verdict}")

# %% [markdown]
# Without checkpoints, three saved 1,000-float activations and the output stay alive (16,000 bytes);
# with nested checkpoints only the output does (4,000). The inner function runs three times: once
# in the forward, once when the outer recomputation replays the outer function (which calls the inner
# checkpoint again), once for the inner recomputation.
#
# Passing the inner input **by keyword** shows a difference between `ckpt_lab` and torch 2.13: torch
# keeps keyword arguments in a closure instead of saving them through autograd, so the outer
# checkpoint cannot drop them:

# %%
for name, variant in hook_based.items():
    retained, *_ = nested_case(variant, inner_by_keyword=True)
    print(f"{name:28} inner input by keyword: retained {retained:>6,} bytes")

# %% [markdown]
# ## 5. Early stop, and the determinism check
#
# The recomputation only has to fill the handles backward still needs; once the last one is filled,
# `_recompute` raises `_StopRecomputation` and the rest of the function never runs. Here is a block
# whose tail (a multiplication and an addition by numbers) saves nothing, and which also
# computes a branch (`_unused`) that the output does not depend on. The function writes down how far
# each run got (in a list bound with `functools.partial`, so that every run appends to the same list,
# see §4.3), and an `OpCounter` counts the ops of the backward:

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


for name, variant in {"reentrant_checkpoint": reentrant_checkpoint, "ckpt_lab.checkpoint": checkpoint,
                      "torch, use_reentrant=False": torch_nonreentrant}.items():
    log = []
    x = torch.randn(1000, requires_grad=True)
    out = variant(functools.partial(block_with_tail, log=log), x)
    log.clear()
    with OpCounter() as ops:
        out.sum().backward()
    recomputed = {op: ops.counts[op] for op in ("sin", "exp", "tanh", "add")}
    print(f"{name:28} re-run reached {log} | recomputed ops {recomputed}")

# %% [markdown]
# The reentrant checkpoint re-runs the whole function, tail included: it has to, because its nested
# backward starts from the recomputed *output*. The hook-based ones stop as soon as `exp` has
# produced its result. `ckpt_lab` stops even earlier than torch: it stops at the last handle that is
# still **alive**, and the handle `tanh` saved died with `_unused` at the end of the forward; torch
# counts dead handles too and re-runs the `tanh`.
#
# Stopping by position has a price: the re-run must save the same tensors, in the same order, as the
# forward did. Every recomputed tensor is checked against the forward's shape, dtype and device. A
# function that branches on a Python counter trips the check:

# %%
calls = itertools.count(1)


def counts_its_calls(x):
    """First call: uses all of x. Later calls: only the first two elements."""
    return (x if next(calls) == 1 else x[:2]).sin().sum()


x = torch.randn(3, requires_grad=True)
loss = checkpoint(counts_its_calls, x)
try:
    loss.backward()
except CheckpointError as error:
    print("CheckpointError:", error)

# %% [markdown]
# The reentrant variant has no such check. It runs its nested backward through whatever the
# re-run computed, and returns a wrong gradient without a word: the third element, which the re-run
# did not use, gets a gradient of 0 instead of cos(x₂).

# %%
calls = itertools.count(1)
x = torch.randn(3, requires_grad=True)
reentrant_checkpoint(counts_its_calls, x).backward()
print("reentrant: no error; gradient equal to cos(x):", torch.allclose(x.grad, x.detach().cos()),
      "| zeros in the gradient:", int((x.grad == 0).sum()))

# %% [markdown]
# ## 6. The torchviz trap
#
# torchviz's `make_dot(..., show_saved=True)` draws each node's saved tensors, and it reads them as
# `grad_fn._saved_<name>`, which *unpacks* them. Under a non-reentrant checkpoint every unpack
# outside backward is a recomputation (§3), so drawing the graph runs the block again, once
# per saved tensor. `draw_graph` counts the aten ops that ran while drawing and warns:

# %%
x = torch.randn(4, requires_grad=True)
block = CallCounter(lambda t: t.sin().sin().exp())
out = checkpoint(block, x)
print("runs after forward:", block.count)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    picture = draw_graph(out, {"x": x}, show_saved=True, name="03_torchviz_trap")
for warning in caught:
    if issubclass(warning.category, UserWarning):
        print("warning:", warning.message)
print("runs after drawing:", block.count, "| picture.ops_while_drawing:", picture.ops_while_drawing)
picture

# %% [markdown]
# Three saved tensors (`x`, `sin(x)`, and `exp`'s result), three extra runs of the block, 21 aten ops
# that had nothing to do with drawing. It is harmless here, but on a real model, drawing a large
# graph with `show_saved=True` costs one forward of the block per saved tensor. Drawn without
# `show_saved`, nothing is unpacked:

# %%
block.reset()
picture = draw_graph(out, {"x": x})
print("runs while drawing without show_saved:", block.count,
      "| ops_while_drawing:", picture.ops_while_drawing)

# %% [markdown]
# ## 7. Why PyTorch moved checkpointing away from `autograd.Function`
#
# Seed 002 asks how `autograd.Function` and `torch.utils.checkpoint` relate, and albanD answers
# that *"we are transitioning to not use autograd.Function to implement AC"*. The cells above give the
# reasons, each measured:
#
# 1. **Reentrancy.** A Function's `backward` can only recompute the block by running a second,
#    nested backward through a private graph. That nested backward accumulates into `.grad` of every
#    leaf it reaches, so the API calls that promise *not* to touch `.grad`, `torch.autograd.grad` and
#    `backward(inputs=...)`, cannot be served (§4.2, §4.4, and §4.5 for nesting). With hooks, backward
#    is one ordinary pass over one ordinary graph (§4: the node lists are identical).
# 2. **The input-requires-grad requirement.** A Function's node joins the graph only through tensor
#    *inputs* that require grad; parameters used inside are invisible to autograd. Seed 001's
#    sub-network got no gradients and a confusing error (§4.1). With hooks, parameters are leaves
#    of the recorded graph, as in any forward.
# 3. **Hooks compose.** Saved-tensor hooks stack: a checkpoint inside a checkpoint is handled by the
#    outer hook dropping the inner one's inputs (§4.5). The same hooks let other tools join in:
#    selective activation checkpointing decides op by op what to keep, and exists only for the
#    non-reentrant variant (below); and `torch.compile` traces every checkpoint as the non-reentrant
#    one (below).
# 4. **Early stop.** The reentrant variant must recompute the block's output, because its nested
#    backward starts there. Handles let the re-run stop at the last tensor backward needs (§5), which
#    in an MLP block skips its last matrix multiplication (§8).
# 5. **A check for free.** Because handles are filled by position, the re-run's tensors are compared
#    with the forward's. The reentrant variant silently returned a wrong gradient where the hooks
#    raised (§5).
#
# The two claims of point 3 not shown yet. Selective checkpointing in torch is a `context_fn`:
# a pair of `TorchDispatchMode`s that cache the outputs of chosen ops in the forward and serve them
# in the recomputation. Torch refuses it for the reentrant variant; for the non-reentrant one, caching
# `addmm` removes the matrix multiplication from the recomputation:

# %%
_ = torch.manual_seed(0)
mlp_block = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 256))
x = torch.randn(64, 256, requires_grad=True)
keep_matmuls = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.addmm.default])
try:
    torch.utils.checkpoint.checkpoint(mlp_block, x, use_reentrant=True, context_fn=keep_matmuls)
except ValueError as error:
    print("use_reentrant=True: ValueError:", error)

for name, kwargs in {"full recomputation": {}, "keep addmm outputs": {"context_fn": keep_matmuls}}.items():
    out = torch_nonreentrant(mlp_block, x, **kwargs)
    with OpCounter() as ops:
        out.square().sum().backward()
    print(f"use_reentrant=False, {name:18}: addmm recomputed in backward: {ops.counts['addmm']}")

# %% [markdown]
# And `torch.compile`: Dynamo does not step into `torch.utils.checkpoint`; it wraps the call in a
# higher-order op, and when AOT Autograd traces that op it calls the checkpoint with
# `use_reentrant=False` whatever the user passed. From torch's source:

# %%
from torch._higher_order_ops.wrap import tag_activation_checkpoint_impl

show_source(tag_activation_checkpoint_impl, start="# use_reentrant is set", stop="# preserve_rng_state")

# %% [markdown]
# ## 8. Side by side with `torch.utils.checkpoint(..., use_reentrant=False)`
#
# The MLP block of a transformer, with dropout, on a batch of 64: no checkpoint, the two reentrant
# checkpoints (ours and torch's), and the two non-reentrant ones. Each run is seeded alike, so every
# variant must reproduce the same dropout mask; we compare all gradients bitwise with the plain run,
# count how often the block runs and how many `addmm`s the backward computes, and measure memory.

# %%
def mlp_case(variant):
    _ = torch.manual_seed(1)
    x = torch.randn(64, 256, requires_grad=True)
    mlp_block.zero_grad(set_to_none=True)
    runs = CallCounter(mlp_block)
    out = variant(mlp_block, x)
    with OpCounter() as ops:
        out.square().sum().backward()
    runs.remove()
    grads = [x.grad, *(p.grad for p in mlp_block.parameters())]
    for tensor in (x, *mlp_block.parameters()):
        tensor.grad = None
    report = measure_memory(lambda: variant(mlp_block, x).square().sum())
    for tensor in (x, *mlp_block.parameters()):
        tensor.grad = None
    with LiveMemory() as mem:  # once more, for the timeline picture: gradients included
        loss = variant(mlp_block, x).square().sum()
        mem.phase = "backward"
        loss.backward()
        del loss
    assert mem.peak_bytes == report.peak_bytes_with_grads
    return {"grads": grads, "runs": runs.count, "addmm": ops.counts["addmm"], "mem": mem,
            "retained": report.retained_bytes, "peak": report.peak_bytes,
            "peak with grads": report.peak_bytes_with_grads}


variants = {
    "no checkpoint": no_checkpoint,
    "reentrant_checkpoint": reentrant_checkpoint,
    "torch, use_reentrant=True": torch_reentrant,
    "ckpt_lab.checkpoint": checkpoint,
    "torch, use_reentrant=False": torch_nonreentrant,
}
mlp = {name: mlp_case(variant) for name, variant in variants.items()}
print(f"{'':27}{'grads equal':>12}{'block runs':>11}{'addmm in backward':>18}"
      f"{'retained':>10}{'peak':>11}{'peak with grads':>16}")
for name, r in mlp.items():
    equal = all(torch.equal(a, b) for a, b in zip(r["grads"], mlp["no checkpoint"]["grads"], strict=True))
    print(f"{name:27}{equal!s:>12}{r['runs']:>11}{r['addmm']:>18}"
          f"{r['retained']:>10,}{r['peak']:>11,}{r['peak with grads']:>16,}")
for column in ("retained", "peak", "peak with grads"):
    assert mlp["ckpt_lab.checkpoint"][column] == mlp["torch, use_reentrant=False"][column]

# %% [markdown]
# * **Gradients**: bitwise equal everywhere, dropout included: all four checkpoints replay the RNG.
# * **Between forward and backward** every checkpoint keeps 65,540 bytes, the block's output (which
#   `square` saves) and the loss, instead of 851,972: 13 times less.
# * **Recomputation**: everyone runs the block twice, but the reentrant variants compute both
#   `addmm`s again, the non-reentrant ones only the first. The second `Linear` saves its input and
#   its weight *before* multiplying, so once they are packed, nothing else is needed: early stop
#   skips the largest tail there is, the output projection.
# * **Peak**: one block recomputed in backward needs all its activations back at once, so the
#   non-reentrant peak equals the un-checkpointed one. The reentrant variants go 65,536 bytes
#   *above* it (131,072 counting gradients): they rebuild the block's output while the forward's is
#   still alive, and they hold the gradient flowing into the block until their nested backward is
#   over (each 64 × 256 floats, 65,536 bytes). The peak falls only when many blocks are checkpointed
#   and recomputed one at a time (notebook 02's `checkpoint_sequential`).
#
# `ckpt_lab.checkpoint` and torch's non-reentrant checkpoint agree to the byte (asserted).

# %%
fig, (ax_retained, ax_peak) = plt.subplots(1, 2, figsize=(11, 2.4))
shown = ["no checkpoint", "reentrant_checkpoint", "ckpt_lab.checkpoint"]
plot_memory_bars(ax_retained, {n: mlp[n]["retained"] for n in shown}, "kept from forward to backward")
plot_memory_bars(ax_peak, {n: mlp[n]["peak"] for n in shown}, "peak over forward + backward")
ax_peak.set_yticklabels([])
fig.tight_layout()
save_figure(fig, "03_memory_bars")
plt.show()

fig, ax = plt.subplots(figsize=(9, 3))
for name in shown:
    plot_timeline(ax, mlp[name]["mem"], name)
_ = ax.legend()
_ = ax.set_title("MLP block with dropout: live memory over forward and backward, gradients included")
save_figure(fig, "03_memory_timeline")
plt.show()

# %% [markdown]
# In the timeline (gradients included, so the two 1 MiB weight gradients show up in every backward),
# the plain run climbs through the forward and stays up until backward consumes the activations; the
# checkpoints fall back to the output after the forward and climb again only when backward
# recomputes the block, the reentrant one a step higher than the rest.
#
# ## Summary
#
# | question | answer | shown by |
# |---|---|---|
# | What does autograd save, and is it the same tensor? | inputs are stored as the same object; outputs are re-wrapped (same storage and `grad_fn`, new object on every read) to avoid a reference cycle | §1 |
# | When can a saved tensor not be read? | after backward freed it, or after an in-place change (version counter) | §1 |
# | What can a pack hook return? | anything; the unpack hook turns it back into a tensor, and hooks stay attached after the `with` block | §2: logging, offload, disk (20,004 → 4 bytes), bfloat16 (20,004 → 12,004 bytes, error < 1e-2) |
# | How does a checkpoint use hooks? | pack returns an empty handle; the first unpack of a backward re-runs the block once and fills all handles; each handle gives its tensor out once | §3: draft 1 re-runs 6 times, draft 2 keeps 20,000 recomputed bytes as long as the graph lives, the package neither |
# | Why do inputs go through `_SaveInputs`? | version check against in-place changes (a draft silently got it wrong), and an enclosing checkpoint can drop them (4,000 bytes where torch keeps 8,000 for a keyword input) | §3, §4.5 |
# | Are arguments passed as they are? | tensors anywhere in args and kwargs are saved; containers are rebuilt for the recomputation (a list argument is a snapshot, torch passes the object) | §4.3 |
# | Do seed 001's sub-network, `autograd.grad`, keyword arguments, `backward(inputs=...)`, nesting work? | yes, with gradients bitwise equal to no checkpoint | §4 |
# | Does the recomputation run the whole block? | no: it stops at the last saved tensor still needed, earlier than torch's | §5, §8 (one `addmm` instead of two) |
# | What if the re-run differs from the forward? | `CheckpointError` naming the position and both metadata; the reentrant variant returns a wrong gradient silently | §5 |
# | Why does drawing the graph with `show_saved` re-run my block? | reading a saved tensor outside backward is an unpack, hence a recomputation | §6: 3 runs, 21 ops |
# | Why did PyTorch leave `autograd.Function`? | reentrancy, the input-requires-grad rule, composition (nesting, selective checkpointing, `torch.compile`), early stop, the determinism check | §7 |
# | Is `ckpt_lab.checkpoint` torch's `use_reentrant=False`? | same gradients, runs, `addmm` count, retained and peak bytes on an MLP block with dropout; 13 times less kept than no checkpoint | §8 |
