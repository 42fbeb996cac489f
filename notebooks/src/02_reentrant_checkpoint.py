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
# # 02 · The reentrant checkpoint: one autograd node, and a backward inside a backward
#
# Notebook 01 showed that a custom `autograd.Function` runs its `forward` with grad mode off and
# hands its outputs one node, its own backward. That is all a checkpoint needs: run a block inside
# such a `forward` (no graph, so its activations die young), keep only its inputs, and in `backward`
# run the block **again**, this time with grad mode on, and backpropagate through that fresh graph.
# Running a whole backward pass from inside one node of another is what *reentrant* means. It is
# what `torch.utils.checkpoint.checkpoint(..., use_reentrant=True)` does, and it has consequences
# that people meet on the forum:
#
# * *"The block runs under `no_grad`, so why does the checkpoint's output require grad, and why not
#   when the input doesn't?"* (seed 000)
# * *"I checkpoint a whole sub-network: `None of the inputs have requires_grad=True`, then
#   `element 0 of tensors does not require grad`. Must I pass the parameters in? Isn't
#   `autograd.grad` forward mode? Why can't checkpoint support it?"* (seed 001)
# * *"How does `CheckpointFunction` save memory? Is the `no_grad` inside its `forward`
#   redundant?"* (seed 002)
#
# We measure what a block saves (§1), build the checkpoint in drafts up to `ckpt_lab`'s
# `CheckpointFunction` (§2), answer the seeds (§3–§6), replay dropout (§7), cut a deep stack into
# √N segments (§8) and check everything against torch's own (§9). Every claim stands on a printed
# or asserted number that nbval re-checks.

# %%
import copy
import math
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import checkpoint_sequential as torch_checkpoint_sequential

import ckpt_lab
from ckpt_lab.grad_rule import InputSpec, OutputSpec, predict_requires_grad
from ckpt_lab.helpers.show import show_source
from ckpt_lab.helpers.viz import draw_graph, plot_memory_bars, plot_timeline, save_figure
from ckpt_lab.instruments.counting import CallCounter, OpCounter, count_flops
from ckpt_lab.instruments.memory import LiveMemory, measure_memory
from ckpt_lab.instruments.saved import SavedTensorLog
from ckpt_lab.reentrant import CheckpointFunction, reentrant_checkpoint
from ckpt_lab.rng import ReplayState, fork_rng
from ckpt_lab.sequential import checkpoint_sequential

_ = torch.manual_seed(0)
print("torch", torch.__version__)


# %% [markdown]
# A few helpers of this notebook (none of them is in the package): a block of `Linear` + `GELU`
# layers (optionally with dropout), torch's reentrant checkpoint with `use_reentrant` spelled out,
# and the gradients of one seeded training step.

# %%
def make_block(layers: int = 4, width: int = 128, dropout: float = 0.0) -> nn.Sequential:
    """`layers` times Linear(width, width) + GELU (+ Dropout)."""
    modules = []
    for _ in range(layers):
        modules += [nn.Linear(width, width), nn.GELU()] + ([nn.Dropout(dropout)] if dropout else [])
    return nn.Sequential(*modules)


def torch_reentrant(function, *args, **kwargs):
    """torch's checkpoint, reentrant variant (always pass use_reentrant explicitly)."""
    return torch_checkpoint(function, *args, use_reentrant=True, **kwargs)


def clear_grads(*tensors):
    for t in tensors:
        t.grad = None


def step_grads(run, x, model, seed=1):
    """Gradients of run(x).sum() w.r.t. x and the model's parameters, after a seeded forward."""
    clear_grads(x, *model.parameters())
    _ = torch.manual_seed(seed)
    run(x).sum().backward()
    return [x.grad, *(p.grad for p in model.parameters())]


def all_equal(grads_a, grads_b):
    """Bit-for-bit equality of two lists of gradients (None counts as different)."""
    pairs = zip(grads_a, grads_b, strict=True)
    return all(a is not None and b is not None and torch.equal(a, b) for a, b in pairs)


def graph_nodes(tensor):
    """Names of the autograd nodes reachable from tensor.grad_fn."""
    seen, todo = {}, [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and id(node) not in seen:
            seen[id(node)] = type(node).__name__
            todo.extend(next_node for next_node, _ in node.next_functions)
    return sorted(seen.values())


# %% [markdown]
# ## 1. What a block keeps for backward, without and with the checkpoint
#
# The block: four `Linear(128, 128)` + `GELU` layers on an input of 512 × 128 (think 512 tokens).
# Without a checkpoint, each `Linear` saves its input (and its weight, a parameter that lives
# anyway) and each `GELU` saves its input, the `Linear`'s output: eight activations of
# 512 × 128 × 4 = 262,144 bytes. `SavedTensorLog` lists what autograd saves while a region runs:

# %%
_ = torch.manual_seed(0)
block = make_block()
x = torch.randn(512, 128, requires_grad=True)

with SavedTensorLog() as saved_plain:
    _ = block(x)
with SavedTensorLog() as saved_ckpt:
    _ = reentrant_checkpoint(block, x)
print("plain:     ", saved_plain.summary())
print("checkpoint:", saved_ckpt.summary())

# %% [markdown]
# With the checkpoint, one tensor is saved: the block's input `x`. What that means for memory is
# measured by `measure_memory`, which watches every storage created in the forward and the backward:
# *retained* is what is still alive when the forward ends (kept for backward), *peak* the most alive
# at once (gradients of leaves left out).

# %%
memory = {}
for name, run in {"plain": block, "checkpoint": lambda t: reentrant_checkpoint(block, t)}.items():
    clear_grads(x, *block.parameters())
    memory[name] = measure_memory(lambda run=run: run(x).sum())
    print(f"{name:10} retained after forward: {memory[name].retained_bytes:>7,} bytes, "
          f"peak: {memory[name].peak_bytes:>7,} bytes")
extra_peak = memory["checkpoint"].peak_bytes - memory["plain"].peak_bytes
print("peak, checkpoint minus plain:", f"{extra_peak:,}", "bytes =", extra_peak // x.nbytes, "activation")

fig, ax = plt.subplots(figsize=(7, 2.2))
plot_memory_bars(ax, {
    "plain: retained after forward": memory["plain"].retained_bytes,
    "checkpoint: retained after forward": memory["checkpoint"].retained_bytes,
    "plain: peak": memory["plain"].peak_bytes,
    "checkpoint: peak": memory["checkpoint"].peak_bytes,
}, "one block of 4 × (Linear(128, 128) + GELU), input 512 × 128")
save_figure(fig, "02_block_memory")
plt.show()

# %% [markdown]
# Between forward and backward the plain block keeps seven activations (1,835,008 bytes; the eighth
# saved tensor is `x`, created before we started counting) plus the 4-byte loss; the checkpointed
# block keeps **only the loss**. The peak, though, is one activation *higher*: backward recomputes
# the whole block and holds all its activations at once, plus the recomputed output, the root of
# the nested backward. One checkpoint around one block moves memory from "between forward and
# backward" to "during backward"; the peak falls when *many* blocks are checkpointed, because then
# only one block's activations are alive at a time (§8).
#
# The graph shows where everything went. Without the checkpoint, every op left a node:

# %%
loss_plain = block(x).sum()
print("nodes:", len(graph_nodes(loss_plain)))
draw_graph(loss_plain, {"x": x, **dict(block.named_parameters())}, name="02_plain_graph")

# %% [markdown]
# With it, the whole block is one node, `CheckpointFunctionBackward`, and it has a single edge: to
# `x`. (torchviz draws a custom Function's saved tensors in orange: the node's one saved tensor is
# `x` itself.) The eight parameters are **not in the graph at all**; only the nested backward of §2
# will reach them. Keep that in mind for seed 001 (§4) and for `autograd.grad` (§5).

# %%
loss_ckpt = reentrant_checkpoint(block, x).sum()
print("nodes:", graph_nodes(loss_ckpt))
checkpoint_node = loss_ckpt.grad_fn.next_functions[0][0]  # SumBackward's only input
print("edges out of the checkpoint node:", [type(n).__name__ for n, _ in checkpoint_node.next_functions])
draw_graph(loss_ckpt, {"x": x, **dict(block.named_parameters())}, name="02_checkpoint_graph")


# %% [markdown]
# ## 2. Building it, draft by draft
#
# **Draft 1** keeps `x`, runs the block in `forward` (grad mode is already off there), and in
# `backward` recomputes the block with grad on and asks `torch.autograd.grad` for the gradient of
# `x`, the only thing a Function's `backward` may return:

# %%
class DraftCheckpointGradOnly(torch.autograd.Function):
    """DRAFT 1: recompute in backward, then torch.autograd.grad for the input only."""

    @staticmethod
    def forward(ctx, function, x):
        ctx.function = function
        ctx.save_for_backward(x)
        return function(x)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()  # a fresh leaf: the recomputed graph starts here
        with torch.enable_grad():  # backward runs with grad mode off; we need a graph
            output = ctx.function(x)
        (grad_x,) = torch.autograd.grad(output, x, grad_output)
        return None, grad_x  # no gradient for `function`


reference = step_grads(block, x, block)
draft1 = step_grads(lambda t: DraftCheckpointGradOnly.apply(block, t), x, block)
print("x.grad equals the plain run's:", torch.equal(draft1[0], reference[0]))
print("parameters left without a gradient:", sum(g is None for g in draft1[1:]), "of", len(draft1) - 1)

# %% [markdown]
# Draft 1 falls short: **the parameters get no gradient**. A `backward` returns gradients for the
# Function's inputs only, and the parameters are not inputs (the graph above has no edge to them).
# The way out is what makes this checkpoint *reentrant*: instead of `autograd.grad`, run
# `torch.autograd.backward` on the recomputed graph. It accumulates into `.grad` of every leaf it
# reaches, the parameters included, as a side effect; our fresh leaf `x` gets its `.grad` too, and
# that we return.
#
# **Draft 2** does that:

# %%
class DraftCheckpointNoRNG(torch.autograd.Function):
    """DRAFT 2: a nested backward fills .grad of the parameters; no RNG restore, no guards."""

    @staticmethod
    def forward(ctx, function, x):
        ctx.function = function
        ctx.save_for_backward(x)
        return function(x)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            output = ctx.function(x)
        torch.autograd.backward(output, grad_output)  # the reentrant step: a backward inside a backward
        return None, x.grad


draft2 = step_grads(lambda t: DraftCheckpointNoRNG.apply(block, t), x, block)
print("all 9 gradients equal the plain run's, bit for bit:", all_equal(draft2, reference))

# %% [markdown]
# Draft 2 is right for this block. It falls short as soon as the block draws random numbers: with
# dropout, the recomputation draws *new* masks, so backward differentiates a different function
# from the one the forward ran (§7 takes this apart; §5 shows a second gap, under `autograd.grad`):

# %%
_ = torch.manual_seed(0)
dropout_block = make_block(dropout=0.1)
reference_dropout = step_grads(dropout_block, x, dropout_block)
draft2_dropout = step_grads(lambda t: DraftCheckpointNoRNG.apply(dropout_block, t), x, dropout_block)
wrong = sum(int((a != b).sum()) for a, b in zip(draft2_dropout, reference_dropout, strict=True))
print(f"dropout block: {wrong:,} of {sum(g.numel() for g in reference_dropout):,} gradient entries differ")

# %% [markdown]
# `ckpt_lab`'s `CheckpointFunction` is draft 2 grown up: it snapshots the RNG (and autocast) state in
# `forward` and replays it around the recomputation (§7), accepts any mix of tensor and non-tensor
# arguments and several outputs, and refuses to run under `torch.autograd.grad` (§5):

# %%
show_source(CheckpointFunction)

# %% [markdown]
# `reentrant_checkpoint` is the function you call. Under `no_grad` there is nothing to recompute
# for, so it just calls the block; when no input requires grad it warns (§4):

# %%
show_source(reentrant_checkpoint)

# %% [markdown]
# Exercised: gradients equal the plain run's bit for bit, with and without dropout, and the block
# runs exactly twice, once in the forward and once in the backward:

# %%
print("block:         gradients equal plain:",
      all_equal(step_grads(lambda t: reentrant_checkpoint(block, t), x, block), reference))
print("dropout block: gradients equal plain:",
      all_equal(step_grads(lambda t: reentrant_checkpoint(dropout_block, t), x, dropout_block),
                reference_dropout))

calls = CallCounter(block)
loss = reentrant_checkpoint(block, x).sum()
print("block calls after forward:", calls.count)
loss.backward()
print("block calls after backward:", calls.count)
calls.remove()

# %% [markdown]
# Non-tensor arguments pass through as they are, and tensors that don't require grad stay constants
# (here a mask, which gets no `.grad`):

# %%
mask = torch.rand(512, 128) > 0.5
clear_grads(x)
out = reentrant_checkpoint(lambda t, scale, m: (t * scale).sin() * m, x, 0.5, mask)
out.sum().backward()
print("x.grad equals cos(0.5 x) · 0.5 · mask:", torch.equal(x.grad, (0.5 * x.detach()).cos() * 0.5 * mask))
print("mask.grad:", mask.grad)


# %% [markdown]
# ## 3. Seed 000: why the checkpoint's output requires grad, and when it doesn't
#
# The block inside the checkpoint runs with grad mode off: a tensor it computes does not require
# grad. A probe that writes down what it sees inside shows it, and shows what the caller gets:

# %%
def probe(t):
    """sin, recording grad mode and whether the result requires grad, as seen inside the block."""
    result = t.sin()
    probe.seen.append((torch.is_grad_enabled(), result.requires_grad))
    return result


probe.seen = []
out = reentrant_checkpoint(probe, x)
print("inside the block: grad mode on =", probe.seen[0][0], "| result requires grad =", probe.seen[0][1])
print("outside:          out.requires_grad =", out.requires_grad, "| grad_fn:", type(out.grad_fn).__name__)

# %% [markdown]
# That is notebook 01's rule, nothing checkpoint-specific: `CheckpointFunction` is an
# `autograd.Function`, so `apply` runs its `forward` with grad off and then gives every
# differentiable output the `CheckpointFunctionBackward` node, **if** the call was executable: grad
# mode on and at least one tensor argument requiring grad. `CheckpointFunction.apply(function,
# preserve_rng_state, *args)` has two non-tensor arguments and then the block's inputs; the model of
# the rule from notebook 01 predicts each case, and both checkpoints agree:

# %%
def predicted(x_requires_grad, grad_enabled=True):
    args = [InputSpec(is_tensor=False), InputSpec(is_tensor=False), InputSpec(requires_grad=x_requires_grad)]
    return predict_requires_grad(args, [OutputSpec()], grad_enabled)[0]


cases = {
    "x requires grad": (True, True),
    "x doesn't": (False, True),
    "x does, under no_grad": (True, False),
}
for label, (requires_grad, grad_enabled) in cases.items():
    verdict = predicted(requires_grad, grad_enabled)
    actual = {}
    for name, ckpt in {"ours": reentrant_checkpoint, "torch": torch_reentrant}.items():
        with warnings.catch_warnings(record=True), torch.set_grad_enabled(grad_enabled):
            warnings.simplefilter("always")
            actual[name] = ckpt(torch.sin, torch.randn(3, requires_grad=requires_grad)).requires_grad
    assert actual["ours"] == actual["torch"] == verdict.requires_grad
    print(f"{label:22} rule={verdict.requires_grad!s:5} ours={actual['ours']!s:5} "
          f"torch={actual['torch']!s:5} ({verdict.reason})")

# %% [markdown]
# Under `no_grad`, `reentrant_checkpoint` does not even create the node: it calls the block once and
# returns (nothing will ever be recomputed). torch's goes through `apply` and gets the same result.
# The middle case is the dangerous one: the output is a constant, so nothing upstream of it, and no
# parameter inside the block, will get a gradient. Seed 001 walked straight into it.

# %% [markdown]
# ## 4. Seed 001: checkpointing a whole sub-network
#
# Seed 001 had a sub-network `net(x, y)` (returning a tuple) whose inputs come from earlier layers
# that need no gradient, and wanted to train `net`'s own parameters with
# `checkpoint(net, x, y)[0]`. A stand-in with the same shape:

# %%
class SubNet(nn.Module):
    """Two inputs, a tuple out: (prediction, hidden features)."""

    def __init__(self, width: int = 128):
        super().__init__()
        self.embed_x = nn.Linear(32, width)
        self.embed_y = nn.Linear(32, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x, y):
        h = F.gelu(self.embed_x(x) + self.embed_y(y))
        h = F.gelu(self.hidden(h))
        return self.head(h), h


_ = torch.manual_seed(0)
net = SubNet()
data_x, data_y = torch.randn(64, 32), torch.randn(64, 32)  # no requires_grad: data, or a frozen encoder

for name, ckpt in {"torch": torch_reentrant, "ours": reentrant_checkpoint}.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = ckpt(net, data_x, data_y)[0]
    print(f"{name}: warning: {caught[0].message}")
    loss = result.sum()
    print(f"{name}: loss.requires_grad = {loss.requires_grad}, loss.grad_fn = {loss.grad_fn}")
    try:
        loss.backward()
    except RuntimeError as error:
        print(f"{name}: RuntimeError: {error}")
    print(f"{name}: parameters with a gradient: {sum(p.grad is not None for p in net.parameters())}")

# %% [markdown]
# Both checkpoints warn, and the loss has no `grad_fn`, so `backward` has nothing to start from:
# *element 0 of tensors does not require grad and does not have a grad_fn*. Stage 1's rule explains
# it: `apply` looks only at its **arguments** (`net`, `x`, `y`), none of which requires grad, so the
# call is not executable, no node is recorded and the output is a constant. The parameters inside
# `net` require grad, but `apply` never sees them (§1: they are not even in the graph). albanD's
# first answer ("you don't need to pass the parameters") assumed an input that requires grad, which
# is the usual case when the checkpoint sits behind a trained layer.
#
# Three ways out that keep the reentrant checkpoint, weighed on the same step (a fourth drops it, at
# the end of this section). For each: are the parameter gradients those of the plain, uncheckpointed
# run; FLOPs of forward + backward (`count_flops` counts the matmuls), extra over the plain run and
# extra beyond the recomputation; bytes of gradients created; bytes kept between forward and
# backward.

# %%
y_needs_grad = data_y.detach().requires_grad_()  # seed 001's fix, on a new leaf (data_y stays as it is)
dummy = torch.empty(0, requires_grad=True)  # a zero-size input whose only job is to require grad


class _NetCheckpointWrapper:
    """Seed 001's wrapper, made runnable: the parameters go in as arguments, the function ignores them."""

    def __init__(self, net, x, y):
        self.net = net
        self.x = x
        self.y = y

    def __call__(self, *args, **kwargs):
        return self.net(self.x, self.y)


ways_out = {
    "no checkpoint (reference)": lambda: net(data_x, data_y)[0].sum(),
    "make y require grad": lambda: reentrant_checkpoint(net, data_x, y_needs_grad)[0].sum(),
    "a dummy input that requires grad": lambda: reentrant_checkpoint(
        lambda a, b, _dummy: net(a, b), data_x, data_y, dummy
    )[0].sum(),
    "pass the parameters (_NetCheckpointWrapper)": lambda: reentrant_checkpoint(
        _NetCheckpointWrapper(net, data_x, data_y), *net.parameters()
    )[0].sum(),
}


def clear_subnet_grads():
    clear_grads(*net.parameters(), y_needs_grad, dummy)


weighed = {}
for name, run in ways_out.items():
    clear_subnet_grads()
    run().backward()
    grads = [p.grad for p in net.parameters()]
    clear_subnet_grads()
    flops = count_flops(lambda run=run: run().backward())
    clear_subnet_grads()
    weighed[name] = (grads, flops, measure_memory(run))

plain_grads, plain_flops, _ = weighed["no checkpoint (reference)"]
recompute_flops = count_flops(lambda: net(data_x, data_y))  # one more forward of net
print(f"one forward of net: {recompute_flops:,} FLOPs\n")
print(f"{'':44} {'grads = plain':>13} {'FLOPs':>11} {'extra':>10} {'beyond recompute':>16} "
      f"{'grad bytes':>10} {'retained':>9}")
for name, (grads, flops, report) in weighed.items():
    recomputed = recompute_flops if name != "no checkpoint (reference)" else 0
    print(f"{name:44} {all_equal(grads, plain_grads)!s:>13} {flops:>11,} {flops - plain_flops:>+10,} "
          f"{flops - plain_flops - recomputed:>+16,} {report.grad_bytes:>10,} {report.retained_bytes:>9,}")

# %% [markdown]
# All three give the plain run's gradients bit for bit and keep only the 4-byte loss. What they
# cost, beyond the recomputation every checkpoint pays (one more forward of `net`: +3,162,112 FLOPs):
#
# * **make `y` require grad** (seed 001's final fix): the nested backward computes `∂loss/∂y`, a
#   gradient nobody wants: one more 64 × 128 × 32 matmul, **+524,288 FLOPs** (2 · 64 · 128 · 32), and
#   `y.grad`, **+8,192 bytes**. Cheap here, more when the input is wide;
# * **a dummy input**: zero extra FLOPs and bytes. The dummy is not used by `net`, so the nested
#   backward never reaches it; it only makes `apply` executable. The price is a function signature
#   with an argument it ignores;
# * **passing the parameters** as seed 001's wrapper does: zero extra FLOPs and bytes too. Verbose
#   (a class, and `*net.parameters()` at the call), but correct; the numbers below answer the
#   worries in the seed.

# %%
wrapper_call = _NetCheckpointWrapper(net, data_x, data_y)
net_params = tuple(net.parameters())
print("net_params are the very tensors of net.parameters():",
      all(a is b for a, b in zip(net_params, net.parameters(), strict=True)))

clear_subnet_grads()
with SavedTensorLog() as saved_wrapper:
    result = reentrant_checkpoint(wrapper_call, *net_params)[0]
print("saved by the wrapper's checkpoint:", saved_wrapper.summary())
node = result.grad_fn  # [0] picked from the Function's tuple of outputs: no indexing node
print("node:", type(node).__name__)
edge_kinds = ", ".join(sorted({type(edge).__name__ for edge, _ in node.next_functions}))
print("edges out of the checkpoint node:", len(node.next_functions), "x", edge_kinds)
returned = []
_ = node.register_hook(lambda grad_inputs, grad_outputs: returned.append([g is None for g in grad_inputs]))
result.sum().backward()
print("gradients the node returned for the 8 parameters: None x", sum(returned[0]))
print("gradients equal the plain run's:", all_equal([p.grad for p in net.parameters()], plain_grads))

clear_subnet_grads()
torch_reentrant(wrapper_call, *net_params)[0].sum().backward()
print("with torch's checkpoint too:", all_equal([p.grad for p in net.parameters()], plain_grads))

# %% [markdown]
# The parameters are saved with `save_for_backward` (8 tensors, 100,356 bytes in the log), but saving
# keeps a reference, not a copy: the retained bytes in the table above are 4, as for the other
# variants. They give the node eight edges, which makes it executable, and yet the node returns
# `None` for all eight: `net` uses its own parameters, not the detached copies `backward` passes in,
# so the nested backward writes their `.grad` directly. Either way the gradients are right.
#
# The fourth way out needs no trick at all: the **non-reentrant** checkpoint (`ckpt_lab.checkpoint`,
# stage 3, notebook 03) does not hide the block in one node, so the parameters stay in the graph:

# %%
clear_subnet_grads()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ckpt_lab.checkpoint(net, data_x, data_y)[0].sum().backward()
print("warnings:", len(caught), "| gradients equal the plain run's:",
      all_equal([p.grad for p in net.parameters()], plain_grads))

# %% [markdown]
# ## 5. Seed 001: `autograd.grad` is reverse mode too, and why this checkpoint can't serve it
#
# *"autograd.grad does forward differentiation, doesn't it?"* No: it runs the same backward pass as
# `.backward()`, but returns the gradients of the tensors you name instead of accumulating into
# `.grad`. Same numbers, the same aten ops (`OpCounter` counts them), `.grad` untouched:

# %%
params = list(block.parameters())
clear_grads(x, *params)
loss_a, loss_b = block(x).sum(), block(x).sum()
with OpCounter() as ops_grad:
    grads_by_grad = torch.autograd.grad(loss_a, [x, *params])
print("after autograd.grad: tensors with a .grad:", sum(t.grad is not None for t in [x, *params]))
with OpCounter() as ops_backward:
    loss_b.backward()
grads_by_backward = [x.grad, *(p.grad for p in params)]
print("same numbers as .backward(), bit for bit:", all_equal(grads_by_grad, grads_by_backward))
print("aten ops run by autograd.grad:", dict(ops_grad.counts))
extra = ops_backward.counts - ops_grad.counts
print(".backward() runs the same ops plus:", dict(extra), "(one per leaf whose .grad it sets)")

# %% [markdown]
# Forward mode is a different thing: one pass gives the derivative along **one** direction `v`
# (a Jacobian-vector product), here ⟨∇ₓloss, v⟩ (checked in float64, so that the comparison does not
# depend on rounding). Getting all 65,536 entries of ∇ₓloss that way would take 65,536 passes;
# reverse mode gets them all in one.

# %%
block64, x64 = copy.deepcopy(block).double(), x.detach().double().requires_grad_()
(grad_x64,) = torch.autograd.grad(block64(x64).sum(), x64)
v = torch.randn_like(x64)
with torch.autograd.forward_ad.dual_level():
    dual_x = torch.autograd.forward_ad.make_dual(x64.detach(), v)
    tangent = torch.autograd.forward_ad.unpack_dual(block64(dual_x).sum()).tangent
print("forward mode's one number equals <grad_x, v>:", torch.allclose(tangent, (grad_x64 * v).sum()))
print("passes forward mode would need for the whole gradient of x:", x.numel())

# %% [markdown]
# Now with the reentrant checkpoint. Both refuse, with an error raised from the node's `backward`,
# **before** it recomputes or accumulates anything, so no `.grad` has been touched:

# %%
refusals = {}
for name, ckpt in {"ours": reentrant_checkpoint, "torch": torch_reentrant}.items():
    clear_grads(x, *params)
    try:
        torch.autograd.grad(ckpt(block, x).sum(), x)
    except RuntimeError as error:
        refusals[name] = str(error)
        print(f"{name}: RuntimeError: {error}")
    print(f"{name}: tensors with a .grad afterwards: {sum(t.grad is not None for t in [x, *params])}\n")

# %% [markdown]
# Why refuse? Take the guard away and see what `autograd.grad` would do. Draft 2 has no guard:

# %%
clear_grads(x, *params)
(grad_x,) = torch.autograd.grad(DraftCheckpointNoRNG.apply(block, x).sum(), x)
print("draft 2, autograd.grad(loss, x): right value:", torch.equal(grad_x, reference[0]))
print("   ... and parameters whose .grad it wrote, which autograd.grad promises never to do:",
      sum(p.grad is not None for p in params))
try:
    torch.autograd.grad(DraftCheckpointNoRNG.apply(block, x).sum(), params)
except RuntimeError as error:
    print("draft 2, autograd.grad(loss, parameters): RuntimeError:", error)

# %% [markdown]
# Both halves of the problem in two numbers: the nested backward is a full `.backward()`, so it
# writes `.grad` of every leaf it reaches (all 8 parameters, although we asked only for `x`); and
# the parameters are not in the outer graph, so the outer `autograd.grad` cannot even find them.
# `torch.autograd.backward(..., inputs=...)` makes the same promise as `autograd.grad` and is
# refused the same way. The engine tells a checkpoint which case it is in through
# `torch.autograd._is_checkpoint_valid()`, false inside those calls; `CheckpointFunction` checks it
# first thing:

# %%
show_source(CheckpointFunction, start="# False inside", stop="# Fresh leaves")

# %%
for name, ckpt in {"ours": reentrant_checkpoint, "torch": torch_reentrant}.items():
    clear_grads(x, *params)
    try:
        ckpt(block, x).sum().backward(inputs=[x])
    except RuntimeError as error:
        same = str(error) == refusals[name]
        print(f"{name}: backward(inputs=[x]) raises the same error as autograd.grad: {same}")

# %% [markdown]
# Can you carry on after the error? The node raised before using its saved input, so it still has
# it, and a plain `.backward()` works, **unless** a node between the loss and the checkpoint had
# saved tensors: the failed pass ran it and freed them (`retain_graph=True` on the failed call
# prevents that).

# %%
for label, make_loss in {
    "ckpt(block, x).sum()": lambda ckpt: ckpt(block, x).sum(),
    "(ckpt(block, x) ** 2).sum()": lambda ckpt: (ckpt(block, x) ** 2).sum(),  # PowBackward saves its input
}.items():
    for name, ckpt in {"ours": reentrant_checkpoint, "torch": torch_reentrant}.items():
        clear_grads(x, *params)
        loss = make_loss(ckpt)
        try:
            torch.autograd.grad(loss, x)
        except RuntimeError:
            pass
        try:
            loss.backward()
            outcome = f"works, x.grad equals plain: {torch.equal(x.grad, reference[0])}"
        except RuntimeError as error:
            outcome = f"RuntimeError: {str(error)[:58]}..."
        print(f"{label:28} {name:5} then .backward(): {outcome}")

# %% [markdown]
# The way out is again the non-reentrant checkpoint: it runs no nested backward, so `autograd.grad`
# just works.

# %%
clear_grads(x, *params)
grads_nonreentrant = torch.autograd.grad(ckpt_lab.checkpoint(block, x).sum(), [x, *params])
print("ckpt_lab.checkpoint + autograd.grad equals the plain run:",
      all_equal(grads_nonreentrant, grads_by_grad))
print("tensors with a .grad:", sum(t.grad is not None for t in [x, *params]))

# %% [markdown]
# ## 6. Seed 002: how `CheckpointFunction` saves memory, and the redundant `no_grad`
#
# *"What techniques does `CheckpointFunction` employ to conserve GPU memory?"* albanD: *"It is by only
# saving for backward the input."* In numbers: the one tensor saved in §1 is `x` itself, the
# activations inside the block die as soon as the next op has used them, and the gradients are the
# same size as without the checkpoint (a checkpoint drops activations, never gradients):

# %%
out = reentrant_checkpoint(block, x)
saved_by_node = out.grad_fn.saved_tensors
print("tensors the node saved:", len(saved_by_node), "| it is x itself:", saved_by_node[0] is x)
print(f"bytes saved: plain {saved_plain.activation_bytes:,} | checkpoint {saved_ckpt.activation_bytes:,}")
print("bytes of gradients created: plain", f"{memory['plain'].grad_bytes:,}",
      "| checkpoint", f"{memory['checkpoint'].grad_bytes:,}")

# %% [markdown]
# The timeline of live bytes over one step (gradients included) tells the story at a glance: the
# plain block climbs through the forward and stays up until backward frees its activations one by
# one; the checkpointed block never holds more than two activations in the forward (each dies as
# soon as the next op has used it), then climbs in the backward, where the recomputation happens.
# Both end holding the same gradients.

# %%
timelines, kept_grads = {}, {}
for name, run in {"plain": block, "reentrant checkpoint": lambda t: reentrant_checkpoint(block, t)}.items():
    clear_grads(x, *params)
    with LiveMemory() as mem:
        loss = run(x).sum()
        mem.snapshot("end of forward")
        mem.phase = "backward"
        loss.backward()
        del loss
    timelines[name] = mem
    # LiveMemory records a storage's death whenever it happens, even after the region: keep this run's
    # gradients alive, or clearing them for the next run would add their frees to this timeline.
    kept_grads[name] = [x.grad, *(p.grad for p in params)]

fig, axes = plt.subplots(1, 2, figsize=(10, 3), sharey=True)
for ax, (name, mem) in zip(axes, timelines.items(), strict=True):
    plot_timeline(ax, mem, name)
    backward_starts = next(i for i, (_, _, phase) in enumerate(mem.events) if phase == "backward")
    ax.axvline(backward_starts, color="gray", linestyle="--", label="backward starts")
    ax.set_title(name)
axes[0].legend(loc="upper right")
save_figure(fig, "02_timeline")
plt.show()
for name, mem in timelines.items():
    forward_peak = mem.peak(exclude=mem.born_in("backward", alive=False))  # the forward's own tensors
    print(f"{name:22} most alive in the forward: {forward_peak:>9,} bytes "
          f"({forward_peak // x.nbytes} activations) | at its end: {mem.marks['end of forward']:>9,} "
          f"| peak, gradients included: {mem.peak_bytes:>9,}")

# %% [markdown]
# *"Is it redundant to define a new `no_grad()` environment?"* Yes. torch's `forward` ends like this:

# %%
show_source(torch.utils.checkpoint.CheckpointFunction.forward, start="ctx.save_for_backward(*tensor_inputs)")

# %% [markdown]
# `ckpt_lab`'s `CheckpointFunction.forward` has no `no_grad` (§2), and the probe of §3 saw grad mode
# off inside it anyway: `Function.apply` switched it off in C++. During the recomputation it is on,
# as it must be. And the memory is the same as torch's:

# %%
probe.seen = []
reentrant_checkpoint(probe, x).sum().backward()
print("grad mode inside the block: forward =", probe.seen[0][0], "| recomputation =", probe.seen[1][0])
clear_grads(x, *params)
print("retained after forward, ours vs torch's:", memory["checkpoint"].retained_bytes,
      measure_memory(lambda: torch_reentrant(block, x).sum()).retained_bytes)

# %% [markdown]
# ## 7. RNG: replaying dropout, and leaving the caller's random stream alone
#
# A recomputation runs the block's Python code again, later. Dropout draws its mask from the global
# generator, which by then has moved on: draft 2 got every gradient entry wrong (§2). The fix is to
# snapshot the generator in `forward` and restore it before recomputing. Restoring it **naively**
# breaks something else, though: **draft 3** restores and recomputes, and leaves the generator where
# the recomputation left it, i.e. where the *forward* left it.

# %%
class DraftCheckpointNoFork(torch.autograd.Function):
    """DRAFT 3: restores the forward's RNG state before recomputing, but does not fork."""

    @staticmethod
    def forward(ctx, function, x):
        ctx.function = function
        ctx.rng_state = torch.get_rng_state()
        ctx.save_for_backward(x)
        return function(x)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        torch.set_rng_state(ctx.rng_state)  # the forward's masks again, but the caller's stream is rewound
        with torch.enable_grad():
            output = ctx.function(x)
        torch.autograd.backward(output, grad_output)
        return None, x.grad


# %% [markdown]
# One training step with dropout, as a caller would write it: seed, forward, **draw random numbers
# between forward and backward** (the next layer's dropout, a data shuffle), backward, draw again.
# We compare the gradients and both draws with the plain run:

# %%
def dropout_step(ckpt):
    """Gradients, the caller's draw between forward and backward, and the draw after backward."""
    clear_grads(x, *dropout_block.parameters())
    _ = torch.manual_seed(1)
    out = ckpt(dropout_block, x)
    between = torch.rand(4)
    out.sum().backward()
    after = torch.rand(4)
    return [x.grad, *(p.grad for p in dropout_block.parameters())], between, after


plain_step = dropout_step(lambda f, t: f(t))
variants = {
    "draft 2 (no RNG restore)": DraftCheckpointNoRNG.apply,
    "ours, preserve_rng_state=False": lambda f, t: reentrant_checkpoint(f, t, preserve_rng_state=False),
    "draft 3 (restore, no fork)": DraftCheckpointNoFork.apply,
    "ours (restore inside a fork)": reentrant_checkpoint,
    "torch's": torch_reentrant,
}
print(f"{'':32} {'wrong grad entries':>18} {'draw after backward = plain':>28} "
      f"{'= draw before backward':>23}")
for name, ckpt in variants.items():
    grads, between, after = dropout_step(ckpt)
    wrong = sum(int((a != b).sum()) for a, b in zip(grads, plain_step[0], strict=True))
    print(f"{name:32} {wrong:>18,} {torch.equal(after, plain_step[2])!s:>28} "
          f"{torch.equal(after, between)!s:>23}")

# %% [markdown]
# * Without a restore (draft 2, or `preserve_rng_state=False`), all 131,584 gradient entries are
#   wrong, and the recomputation's draws also shift the caller's stream.
# * Draft 3 gets the gradients right but **rewinds** the caller's stream: the numbers drawn after
#   backward repeat the ones drawn between forward and backward. A training loop would reuse masks
#   or shuffles without any error.
# * `ckpt_lab` (and torch) restore the forward's state inside a **fork**: the generator is saved
#   before the recomputation and put back after, so the caller's stream continues as if nothing had
#   been recomputed. The package's `ReplayState` does it, for the CPU generator and the generators
#   of the accelerator devices the inputs live on, plus autocast:

# %%
show_source(ReplayState.replay)

# %%
show_source(fork_rng)

# %% [markdown]
# The snapshot is not free: each checkpointed call keeps a copy of the CPU generator's state (and of
# each accelerator's), made outside any aten op, so `LiveMemory` does not count it (one of its
# documented blind spots):

# %%
print("CPU RNG snapshot:", torch.get_rng_state().numel(), "bytes (uint8) per checkpointed call")

# %% [markdown]
# ## 8. `checkpoint_sequential` and the √N rule
#
# A checkpoint around each piece of a deep stack is where the peak falls. `checkpoint_sequential`
# cuts `N` layers into `segments` chunks of `N // segments`, checkpoints all but the last chunk (the
# last one's activations would be recomputed right away anyway) and keeps only each chunk's input:

# %%
show_source(checkpoint_sequential, start="segment_size =")

# %% [markdown]
# Chen et al. 2016 (*Training Deep Nets with Sublinear Memory Cost*, arXiv:1604.06174) count what
# that keeps. With `N` layers that each keep one activation of size `a`, and `s` segments:
#
# * between forward and backward: the inputs of the `s − 1` later chunks, plus the activations of
#   the last chunk, which runs normally: **(s − 1 + N/s) · a**;
# * the peak adds what backward holds while it works through one segment: about **s · a + (N/s) · a**;
# * the recomputation runs every checkpointed layer once more: **(s − 1) · N/s** extra layer
#   forwards, i.e. FLOPs × (1 + (1 − 1/s)/3) if a backward costs two forwards.
#
# Both memory terms balance at **s = √N**, which gives O(√N) memory for less than one extra forward.
# The stack: N = 36 layers of `Linear(128, 128)` + `Tanh`, batch 32. `Tanh` saves its output, which
# is the next `Linear`'s input, so each layer keeps exactly one activation of a = 32 × 128 × 4 bytes,
# as the analysis assumes. The input requires grad: the first chunk is a reentrant checkpoint, and
# §4 showed what happens otherwise.

# %%
N, batch, width = 36, 32, 128
a = batch * width * 4
_ = torch.manual_seed(0)
stack = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(N)])
stack_x = torch.randn(batch, width, requires_grad=True)
layer_calls = [CallCounter(layer) for layer in stack]
layer_flops = 2 * batch * width * width  # one Linear forward (addmm)


def reset_stack():
    clear_grads(stack_x, *stack.parameters())
    for counter in layer_calls:
        counter.reset()


reset_stack()
plain_stack_flops = count_flops(lambda: stack(stack_x).sum().backward())
rows = []
for s in [d for d in range(1, N + 1) if N % d == 0]:
    reset_stack()
    report = measure_memory(lambda s=s: checkpoint_sequential(stack, s, stack_x, use_reentrant=True).sum())
    runs = sum(counter.count for counter in layer_calls)
    # Exact accounting: (s - 1 + N/s) activations plus the 4-byte loss; (s - 1) * N/s layers run twice.
    assert report.retained_bytes == (s - 1 + N // s) * a + 4
    assert runs == N + (s - 1) * (N // s)
    flops = plain_stack_flops + (runs - N) * layer_flops
    rows.append((s, report.retained_bytes, report.peak_bytes, runs, flops))

# The FLOPs column is the plain step plus one Linear forward per extra layer run; count_flops agrees:
for s in (6, N):
    reset_stack()
    step = lambda s=s: checkpoint_sequential(stack, s, stack_x, use_reentrant=True).sum().backward()
    measured = count_flops(step)
    assert measured == next(row[4] for row in rows if row[0] == s)

print(f"a = {a:,} bytes; plain forward + backward: {plain_stack_flops:,} FLOPs")
print(f"{'segments':>8} {'retained':>10} {'/ a':>6} {'peak':>10} {'/ a':>6} {'s + N/s':>7} "
      f"{'layer runs':>10} {'FLOPs':>13} {'× plain':>7} {'theory':>7}")
for s, retained, peak, runs, flops in rows:
    print(f"{s:>8} {retained:>10,} {retained / a:>6.1f} {peak:>10,} {peak / a:>6.1f} {s + N // s:>7} "
          f"{runs:>10} {flops:>13,} {flops / plain_stack_flops:>7.3f} {1 + (1 - 1 / s) / 3:>7.3f}")
best = min(rows, key=lambda row: row[1])
print("fewest bytes retained at segments =", best[0], "= √N:", best[0] == math.isqrt(N))
print(f"peak, plain ÷ √N segments: {rows[0][2] / best[2]:.2f}")

# %%
segments = [row[0] for row in rows]
fine = [1 + i * (N - 1) / 200 for i in range(201)]
fig, (ax_mem, ax_flops) = plt.subplots(1, 2, figsize=(11, 3.6))
ax_mem.plot(segments, [row[1] / a for row in rows], "o", label="retained after forward (measured)")
ax_mem.plot(fine, [s - 1 + N / s for s in fine], "-", color="tab:blue", alpha=0.5, label="(s − 1 + N/s)·a")
ax_mem.plot(segments, [row[2] / a for row in rows], "s", color="tab:red", label="peak (measured)")
ax_mem.plot(fine, [s + N / s for s in fine], "--", color="tab:red", alpha=0.5, label="s·a + (N/s)·a")
ax_mem.set_ylabel("memory, in activations a")
ax_flops.plot(segments, [row[4] / plain_stack_flops for row in rows], "o", label="measured")
ax_flops.plot(fine, [1 + (1 - 1 / s) / 3 for s in fine], "-", alpha=0.5, label="1 + (1 − 1/s)/3")
ax_flops.set_ylabel("FLOPs of a step ÷ plain")
for ax in (ax_mem, ax_flops):
    ax.set_xscale("log")
    ax.set_xticks(segments, [str(s) for s in segments])
    ax.axvline(math.sqrt(N), color="gray", linestyle=":", label="√N = 6")
    ax.set_xlabel(f"segments (N = {N} layers)")
    ax.legend(fontsize=8)
ax_mem.set_title("memory")
ax_flops.set_title("compute")
save_figure(fig, "02_sqrt_n")
plt.show()

# %% [markdown]
# The retained bytes follow (s − 1 + N/s) · a to the byte, and are fewest at s = 6 = √36: 11
# activations instead of 36. The peak stays within one activation of s · a + (N/s) · a and is lowest
# at √N too: 13 a against 37 a for the plain stack, 2.85 × lower. The price is 30 extra layer
# forwards on top of 36, 1.278 × the FLOPs of a plain step, under the 4/3 of one full extra forward.
# Chen et al. report the same trade at scale: a 1,000-layer ResNet from 48 GB to 7 GB for about 30%
# more time. Fewer segments keep fewer boundaries but a longer last chunk, more segments the reverse;
# s = N pays almost the full extra forward and keeps as much as no checkpoint at all.
#
# Two details of the segment rule show in the table: with s = 1 nothing is checkpointed, and with
# s = N every layer but the last is, so 35 layers run twice, not 36.

# %% [markdown]
# ## 9. Side by side with `torch.utils.checkpoint(..., use_reentrant=True)`
#
# torch's reentrant checkpoint is the oracle the tests hold `ckpt_lab` to. On the block of §1, with
# and without dropout: the gradients are identical bit for bit, the memory reports are identical to
# the byte, and the block runs the same number of times.

# %%
for label, model in {"block": block, "dropout block": dropout_block}.items():
    grads, reports, runs = {}, {}, {}
    for name, ckpt in {"ours": reentrant_checkpoint, "torch": torch_reentrant}.items():
        grads[name] = step_grads(lambda t, ckpt=ckpt, model=model: ckpt(model, t), x, model)
        clear_grads(x, *model.parameters())
        _ = torch.manual_seed(1)
        reports[name] = measure_memory(lambda ckpt=ckpt, model=model: ckpt(model, x).sum())
        counter = CallCounter(model)
        _ = torch.manual_seed(1)
        ckpt(model, x).sum().backward()
        runs[name] = counter.count
        counter.remove()
    print(f"{label:13} gradients equal: {all_equal(grads['ours'], grads['torch'])} | memory reports equal: "
          f"{reports['ours'] == reports['torch']} (retained {reports['ours'].retained_bytes}, "
          f"peak {reports['ours'].peak_bytes:,}) | runs of the block: {runs['ours']} vs {runs['torch']}")

# %% [markdown]
# And `checkpoint_sequential` on the 36-layer stack with √N segments: the same gradients, the same
# memory, the same 66 layer runs.

# %%
grads, reports, runs = {}, {}, {}
for name, seq in {"ours": checkpoint_sequential, "torch": torch_checkpoint_sequential}.items():
    reset_stack()
    seq(stack, 6, stack_x, use_reentrant=True).sum().backward()
    grads[name] = [stack_x.grad, *(p.grad for p in stack.parameters())]
    runs[name] = sum(counter.count for counter in layer_calls)
    reset_stack()
    reports[name] = measure_memory(lambda seq=seq: seq(stack, 6, stack_x, use_reentrant=True).sum())
print("gradients equal:", all_equal(grads["ours"], grads["torch"]), "| memory reports equal:",
      reports["ours"] == reports["torch"], "| layer runs:", runs["ours"], "vs", runs["torch"])

# %% [markdown]
# One difference, found by the tests: torch lists an `nn.Sequential`'s layers with `.children()`,
# which yields a module used twice only once, so torch's `checkpoint_sequential` runs a different
# network. `ckpt_lab` iterates the `Sequential` itself, as `Sequential.forward` does:

# %%
_ = torch.manual_seed(0)
shared = nn.Linear(4, 4)
twice = nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh())
small_x = torch.randn(3, 4, requires_grad=True)
print("layers: in the Sequential", len(twice), "| from .children()", len(list(twice.children())))
for name, seq in {"ours": checkpoint_sequential, "torch": torch_checkpoint_sequential}.items():
    result = seq(twice, 2, small_x, use_reentrant=True)
    print(f"{name:5} equals twice(x):", torch.equal(result, twice(small_x)))

# %% [markdown]
# ## Summary
#
# | question | answer | shown by |
# |---|---|---|
# | What does a checkpointed block keep for backward? How does `CheckpointFunction` save memory? (seed 002) | only its inputs: 1 tensor (262,144 bytes) instead of 8 (2,097,152); retained after forward 4 bytes instead of 1,835,012 | §1, §6 |
# | Does one checkpoint lower the peak? | no, +1 activation: backward recomputes the whole block; the peak falls when many blocks are checkpointed | §1, §8 |
# | How does the reentrant checkpoint work? | a Function runs the block with grad off; its backward recomputes with grad on and runs a nested `.backward()` | §2, drafts 1–2 |
# | Why a nested `.backward()`, not `autograd.grad`? | the parameters are not inputs of the node; only a full backward reaches them (draft 1: 8 of 8 without gradient) | §2 |
# | Why does the output require grad although the block ran without grad? (seed 000) | it is a Function's output: notebook 01's rule | §3 |
# | …and why not when no input requires grad? | the call is not executable: no node, a constant output | §3 |
# | Why "element 0 of tensors does not require grad"? (seed 001) | the parameters are not arguments of `apply`, so with inputs that need no grad the loss is a constant | §4 |
# | Ways out? | an input requiring grad (+524,288 FLOPs, +8,192 bytes), a dummy input or the parameters as arguments (free, same gradients), or the non-reentrant checkpoint (just works) | §4 |
# | Is seed 001's `_NetCheckpointWrapper` sound? | yes: the very same parameter tensors, the plain run's gradients, no extra FLOPs or bytes; the node returns `None` for them and the nested backward writes their `.grad` | §4 |
# | Is `autograd.grad` forward mode? | no: the same backward pass (same aten ops, same numbers), `.grad` untouched; forward mode needs one pass per direction | §5 |
# | Why can't the reentrant checkpoint serve `autograd.grad`? | its nested backward writes `.grad` of all 8 parameters, which the outer graph cannot even reach | §5 |
# | Is torch's inner `no_grad` redundant? (seed 002) | yes: grad mode is already off in `forward`; same memory without it | §6 |
# | Why restore the RNG, and why inside a fork? | without: 131,584 of 131,584 gradient entries wrong; without the fork the caller's random stream is rewound | §7 |
# | How many segments? | √N: retained (s − 1 + N/s)·a, fewest at s = 6 for N = 36 (11 a vs 36 a; peak 13 a vs 37 a), for 1.278 × the FLOPs | §8 |
# | Same as torch's? | gradients bit for bit, memory to the byte, same recompute counts; `checkpoint_sequential` also handles a module used twice | §9 |
#
# Notebook 03 drops the `autograd.Function` altogether: the non-reentrant checkpoint keeps the graph
# as it is and changes only what it stores, which is why it needed no tricks in §4 and §5.
