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
# **TL;DR.** The reentrant checkpoint is an `autograd.Function` around a block: `forward` runs it
# with grad off and saves **only its inputs**; `backward` runs it **again** with grad on, then a
# backward pass through that graph inside the first (*reentrant*). So the output requires grad only
# if an *input* does, `autograd.grad` is refused, and dropout must be replayed. One checkpoint
# around everything saves nothing at the peak; one per block does.
#
# **After this notebook you can**
#
# 1. build `CheckpointFunction`: inputs saved, a re-run, a nested backward (checked: §3; exercise 02);
# 2. say what a checkpointed block keeps and what runs when (checked: §1's prediction, §2);
# 3. say when its output requires grad and why `autograd.grad` is refused (checked: §4, §6);
# 4. replay dropout, leaving the caller's random stream alone (checked: §8; exercise 02);
# 5. place checkpoints so that the peak drops (checked: §9's prediction).
#
# **Questions answered here**, from three PyTorch forum threads:
#
# | question | section |
# |---|---|
# | *About the implementation of activation checkpointing*: the block runs under `no_grad`; why does the output require grad, and not when the input doesn't? | §4 |
# | *Checkpoint for a whole subnet*: how to train a checkpointed sub-network? Why "None of the inputs have requires_grad=True", "element 0 of tensors does not require grad"? Is `_NetCheckpointWrapper` idiomatic? Are the tuple's parameters `net.parameters()` themselves? | §5 |
# | … is `autograd.grad` forward mode? Why is it unsupported, and what does the engine test? | §6 |
# | *Tensor.requires_grad in torch.autograd.Function*: how does `CheckpointFunction` save memory? Is its `no_grad` redundant? | §1, §7 |
# | Why replay the RNG, and why inside a fork? | §8 |
# | Where does checkpointing save nothing? | §9 |
# | How many segments (√N)? What does recursive checkpointing cost? | notebook 02b |

# %%
import itertools
import textwrap
import warnings

import matplotlib.pyplot as plt
import torch
from IPython.display import Image
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckpt_lab
from ckpt_lab import OpCounter, SavedTensorLog, measure_memory
from ckpt_lab.helpers.predict import reveal
from ckpt_lab.helpers.show import show_source
from ckpt_lab.helpers.tensors import all_equal
from ckpt_lab.helpers.viz import draw_graph, plot_memory_bars, save_figure, show_dot
from ckpt_lab.reentrant import CheckpointFunction, reentrant_checkpoint

print("torch", torch.__version__)


# %%
def make_block(layers: int = 4, width: int = 128, dropout: float = 0.0) -> nn.Sequential:
    extra = lambda: [nn.Dropout(dropout)] if dropout else []
    return nn.Sequential(*[m for _ in range(layers) for m in [nn.Linear(width, width), nn.GELU(), *extra()]])
def clear_grads(*tensors):
    for t in tensors:
        t.grad = None
def show_rows(rows, name, arrows=True):  # per row, boxes joined by arrows (steps); else panels of boxes
    layout = "rankdir=LR" if arrows else "ranksep=0.2"  # panels: side by side, boxes stacked
    dot = f"digraph {{ {layout}; node [shape=box, fontname=Helvetica, fontsize=10]; "
    for k, (title, boxes) in enumerate(rows.items()):
        dot += f'subgraph cluster{k} {{ label="{title}"; ' + "".join(f'n{k}{i} [label="{b}"]; '
                                                                  for i, b in enumerate(boxes))
        edges = " -> ".join(f"n{k}{i}" for i in range(len(boxes)))
        dot += edges + ("" if arrows else " [style=invis]") + "; } "
    return show_dot(dot + "}", name)
def step_grads(run, x, model, seed=1):  # the gradients of one seeded training step
    clear_grads(x, *model.parameters())
    _ = torch.manual_seed(seed)
    run(x).sum().backward()
    return [x.grad, *(p.grad for p in model.parameters())]


# %% [markdown]
# ## 1. What a block keeps for backward, tensor by tensor
#
# Four `Linear(128, 128)` + `GELU` on a 512 × 128 input (one activation: 262,144 bytes).
# `SavedTensorLog.listing()` lists each saved tensor: shape, bytes, the op that made it.

# %%
_ = torch.manual_seed(0)
block, x = make_block(), torch.randn(512, 128, requires_grad=True)
with SavedTensorLog() as saved_plain:
    _ = block(x)
with SavedTensorLog() as saved_ckpt:
    _ = reentrant_checkpoint(block, x)
print("PLAIN\n" + saved_plain.listing() + "\nCHECKPOINT\n" + saved_ckpt.listing())

# %% [markdown]
# Plain, each `Linear` and `GELU` saves its input: 8 activations. Checkpointed, **one**: the input
# `x` (a [leaf](glossary.md#leaf)). That is how `CheckpointFunction` saves memory (albanD: *"It is
# by only saving for backward the input."*). What a checkpoint leaves out is these buffers saved
# for backward, the activations: not the gradients. Backward still computes a gradient for `x` and
# for every parameter, from activations it recomputes. (The forum thread "Tensor.requires_grad in
# torch.autograd.Function" asks whether checkpointing works by "omission of gradients during the
# forward"; the answer corrects it: *"checkpoint will omit intermediary buffers (save_for_backward),
# not gradients."*) `measure_memory` reports the bytes
# [retained](glossary.md#retained) after the forward and the [peak](glossary.md#peak) over forward
# and backward (leaf gradients not counted).
#
# **Predict.** Checkpointed, the block retains only the 4-byte loss. Its peak, minus the plain
# run's, in activations (negative if lower)?

# %%
guess = None  # your guess: a whole number of activations

# %%
memory = {}
for name, run in {"plain": block, "checkpoint": lambda t: reentrant_checkpoint(block, t)}.items():
    clear_grads(x, *block.parameters())
    memory[name] = measure_memory(lambda run=run: run(x).sum())
    print(f"{name:10} retained {memory[name].retained_bytes:>9,} B  peak {memory[name].peak_bytes:>9,} B")
extra_peak = memory["checkpoint"].peak_bytes - memory["plain"].peak_bytes
print("peak, checkpoint minus plain:", f"{extra_peak:,}", "B =", extra_peak // x.nbytes, "activation")
reveal(guess, extra_peak // x.nbytes, "activations the checkpoint adds to the peak")

# %% [markdown]
# Plain retains seven new activations (`x` existed before) and the loss; checkpointed, **only the
# loss**, but the peak is one activation *higher*: backward re-runs the whole block at once (§9). In
# the graph the block is one node with one edge, to `x`; the eight parameters are **not in it**.

# %%
loss_ckpt = reentrant_checkpoint(block, x).sum()
checkpoint_node = loss_ckpt.grad_fn.next_functions[0][0]  # SumBackward's only input
print("edges out of the checkpoint node:", [type(n).__name__ for n, _ in checkpoint_node.next_functions])
draw_graph(loss_ckpt, {"x": x, **dict(block.named_parameters())}, name="02_checkpoint_graph")

# %% [markdown]
# ## 2. What runs when
#
# A [graph task](glossary.md#graph-task) is one run of the autograd engine, started by one
# `.backward()` or `autograd.grad` call. We log a step of a small block: module pre-hooks log each
# layer, a pack hook each save (`t._base`, private torch API, tells a weight's view from an
# activation), node pre-hooks each backward node (outer graph and recomputed one).

# %%
events, lane = [], ["forward (grad off)"]
def log(where, what):
    lane[0] = where
    events.append((where, what))
def hook_graph(root, where):  # a pre-hook on every node reachable from root
    seen, todo = set(), [root]
    while todo:
        if (node := todo.pop()) is not None and node not in seen:
            seen.add(node)
            node.register_prehook(lambda g, n=node: log(where, n.name().split("::")[-1]))
            todo += [n for n, _ in node.next_functions]
def pack(t):
    kind = "weight" if isinstance(t._base, nn.Parameter) else "activation" if t.grad_fn else "input"
    log(lane[0], "save " + kind)
    return t
def layer_runs(module, args):
    log("recompute (grad on)" if torch.is_grad_enabled() else "forward (grad off)", type(module).__name__)

# %%
small = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU())
_ = [m.register_forward_pre_hook(layer_runs) for m in small]
_ = small.register_forward_hook(lambda m, i, o: o.grad_fn and hook_graph(o.grad_fn, "nested backward"))
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    loss = reentrant_checkpoint(small, torch.randn(4, 16, requires_grad=True)).sum()
    hook_graph(loss.grad_fn, "backward")
    loss.grad_fn.next_functions[0][0].register_hook(lambda gi, go: log("backward", "returns grad of x"))
    loss.backward()

# %% [markdown]
# The log as a timeline (consecutive events of one lane merged into one box):

# %%
lanes = ["forward (grad off)", "backward", "recompute (grad on)", "nested backward"]
groups = [(w, [e for _, e in g]) for w, g in itertools.groupby(events, lambda e: e[0])]
labels = ["\n".join(f"{g.count(e)}× {e}".removeprefix("1× ") for e in dict.fromkeys(g)) for _, g in groups]
# A box spans its events (0.22 inch each), or its label if wider (7 pt: ~0.06 inch a character):
widths = [max(len(g), 1 + max(map(len, label.splitlines())) * 0.06 / 0.22)
          for (_, g), label in zip(groups, labels, strict=True)]
schedule_fig, ax = plt.subplots(figsize=(0.22 * sum(widths) / 0.775, 3.4))
t = 0
for (where, _), label, width in zip(groups, labels, widths, strict=True):
    y = lanes.index(where)
    ax.broken_barh([(t, width)], (y - 0.4, 0.8), facecolors=f"C{y}", alpha=0.35, edgecolor="k")
    ax.text(t + width / 2, y, label, ha="center", va="center", fontsize=7)
    t += width
ax.set(xlim=(0, t), xticks=[], yticks=range(len(lanes)), yticklabels=lanes,
       xlabel="events, in the order they happened (each box as wide as its events, or its label)")
ax.invert_yaxis()
save_figure(schedule_fig, "02_schedule")
plt.show()

# %% [markdown]
# 1. **Forward**, grad off: the layers save nothing; the node saves the input.
# 2. **Graph task 1** runs `SumBackward0`, then `CheckpointFunctionBackward`, which
# 3. **recomputes** the block with grad on, each layer saving its weight and input, and
# 4. **runs graph task 2** through that graph (the last two lanes), down to `AccumulateGrad` for the four
#    parameters **and** a fresh copy of `x`, whose `.grad` it
# 5. **returns**; graph task 1 accumulates it into `x.grad`.

# %% [markdown]
# ## 3. Building it, draft by draft
#
# **Draft 1** keeps `x`, runs the block in `forward` (grad is off there), and in `backward`
# recomputes with grad on and asks `torch.autograd.grad` for the gradient of `x`:

# %%
class DraftCheckpointGradOnly(torch.autograd.Function):  # DRAFT 1: autograd.grad for the input only
    @staticmethod
    def forward(ctx, function, x):
        ctx.function = function
        ctx.save_for_backward(x)
        return function(x)
    @staticmethod
    def backward(ctx, grad_output):
        x = ctx.saved_tensors[0].detach().requires_grad_()  # a fresh leaf: the recomputed graph starts here
        with torch.enable_grad():  # backward runs with grad off; we need a graph
            output = ctx.function(x)
        return None, torch.autograd.grad(output, x, grad_output)[0]  # no gradient for `function`
reference = step_grads(block, x, block)
draft1 = step_grads(lambda t: DraftCheckpointGradOnly.apply(block, t), x, block)
print("x.grad equals the plain run's:", torch.equal(draft1[0], reference[0]),
      "| parameters without a gradient:", sum(g is None for g in draft1[1:]), "of", len(draft1) - 1)

# %% [markdown]
# **The parameters get no gradient**: `backward` returns gradients for the Function's inputs only
# (passed as inputs, they would get one; not having to pass them is the point). **Draft 2** runs
# `torch.autograd.backward` on the recomputed graph, which fills `.grad` of every leaf it reaches.

# %%
class DraftCheckpointNoRNG(DraftCheckpointGradOnly):  # DRAFT 2: a nested backward; no RNG restore, no guard
    @staticmethod
    def backward(ctx, grad_output):
        x = ctx.saved_tensors[0].detach().requires_grad_()
        with torch.enable_grad():
            output = ctx.function(x)
        torch.autograd.backward(output, grad_output)  # the reentrant step: a backward inside a backward
        return None, x.grad
draft2 = step_grads(lambda t: DraftCheckpointNoRNG.apply(block, t), x, block)
print("all 9 gradients equal the plain run's, bit for bit:", all_equal(draft2, reference))
_ = torch.manual_seed(0)
dropout_block = make_block(dropout=0.1)
reference_dropout = step_grads(dropout_block, x, dropout_block)
draft2_dropout = step_grads(lambda t: DraftCheckpointNoRNG.apply(dropout_block, t), x, dropout_block)
wrong = sum(int((a != b).sum()) for a, b in zip(draft2_dropout, reference_dropout, strict=True))
print(f"with dropout: {wrong:,} of {sum(g.numel() for g in reference_dropout):,} gradient entries differ")

# %% [markdown]
# With dropout, the recomputation draws *new* masks (§8). `ckpt_lab`'s `CheckpointFunction` is draft
# 2 grown up (it also keeps non-tensor arguments aside); its `forward` saves the tensors, snapshots
# the RNG and autocast state, and runs the block (a check of ours follows, not shown):

# %%
show_source(CheckpointFunction.forward, start="# save_for_backward (not", stop="# What backward's re-run")

# %% [markdown]
# Its `backward` first refuses `autograd.grad` (§6), then does draft 2's steps (fresh leaves, whose
# `.grad` the nested backward fills) with the RNG replayed; the tail, not shown, runs the nested
# backward on the outputs that require grad and returns one gradient per argument:

# %%
show_source(CheckpointFunction.backward, start="inputs = list(ctx.inputs)", stop="if ctx.fingerprints")

# %% [markdown]
# You call `reentrant_checkpoint(function, *args)` (under `no_grad` it just runs the function).
# Gradients equal the plain run's bit for bit, with and without dropout:

# %%
for label, model, ref in [("block", block, reference), ("dropout block", dropout_block, reference_dropout)]:
    grads = step_grads(lambda t, m=model: reentrant_checkpoint(m, t), x, model)
    print(label, "gradients equal plain:", all_equal(grads, ref))


# %% [markdown]
# ## 4. Why the output requires grad, and when it doesn't
#
# The thread *"About the implementation of activation checkpointing"* asks why the output requires
# grad although the block runs under `no_grad`, and not once the input doesn't. That depends on
# **which** checkpoint runs. A probe inside the thread's `Linear` block, under both variants and
# with `use_reentrant` left out (`None`; torch 2.13):

# %%
def probe(t):
    result = lin(t)
    probe.seen = (torch.is_grad_enabled(), result.requires_grad)
    return result
_ = torch.manual_seed(0)
lin = nn.Linear(100, 100)
print("use_reentrant | x requires grad | grad mode inside | inside result rg | output rg")
for reentrant, x_rg in itertools.product((True, False, None), (True, False)):  # None: left out
    kwargs = {} if reentrant is None else {"use_reentrant": reentrant}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch_checkpoint(probe, torch.randn(2, 100, requires_grad=x_rg), **kwargs)
    inside, result_rg = probe.seen
    print(f"{reentrant!s:13} | {x_rg!s:15} | {inside!s:16} | {result_rg!s:16} |", out.requires_grad)
print("warnings, use_reentrant left out, x needs no grad (the last run):",
      *[f"{w.category.__name__}: {w.message}" for w in caught], sep="\n  ")

# %% [markdown]
# * **`use_reentrant=True`**: grad is off in the block, but `apply` attaches its node if the call is
#   [executable](glossary.md#executable): grad on and a tensor **argument** requiring grad
#   (notebook 01's rule, below). Parameters are not arguments: with an input needing no grad, the
#   output is a constant. The thread's premise and second observation hold for this variant only.
# * **`use_reentrant=False`** (notebook 03b): grad is **on** in the block; the output requires grad
#   if anything in it does (here the weight), **even when no input requires grad**.
# * **Left out**: torch warns, then runs the reentrant variant (the rows of `True`); the second
#   warning is that variant's own (§5). The first warning's "Starting in PyTorch 2.9 … will raise" is
#   stale: torch 2.13, shown here, does not raise, nor do 2.11 and 2.14.1, which warn and default
#   alike (the site's "Torch versions" page; pytorch/pytorch#160534); 2.15 warns "In a future release"
#   instead, and defaults alike. Pass `use_reentrant` always.
#
# Notebook 01's rule:

# %%
Image(filename="../images/01_requires_grad_rule.png")

# %% [markdown]
# ## 5. Checkpointing a whole sub-network
#
# The thread *"Checkpoint for a whole subnet"*: train `net`'s parameters through
# `checkpoint(net, x, y)[0]`, where `x`, `y` need no gradient. A stand-in:

# %%
class SubNet(nn.Module):  # two inputs, a tuple out
    def __init__(self):
        super().__init__()
        self.embed_x, self.embed_y, self.head = nn.Linear(32, 128), nn.Linear(32, 128), nn.Linear(128, 1)
    def forward(self, x, y):
        h = nn.functional.gelu(self.embed_x(x) + self.embed_y(y))
        return self.head(h), h
_ = torch.manual_seed(0)
net = SubNet()
data_x, data_y = torch.randn(64, 32), torch.randn(64, 32)  # no requires_grad: data, or a frozen encoder
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loss = torch_checkpoint(net, data_x, data_y, use_reentrant=True)[0].sum()
print("warning:", caught[0].message, "| loss.grad_fn:", loss.grad_fn)
try:
    loss.backward()
except RuntimeError as error:
    print("RuntimeError:", error)

# %% [markdown]
# `apply` sees only its arguments (`net`, `x`, `y`); none requires grad, so no node is recorded and
# the loss is a constant. albanD's first answer assumed an input that requires grad. Ways out (last
# line: the poster's worry, does `tuple(net.parameters())` hold other objects?):

# %%
y_needs_grad = data_y.detach().requires_grad_()  # the thread's final fix, on a new leaf
dummy = torch.empty(0, requires_grad=True)  # a zero-size input whose only job is to require grad
ways_out = {
    "no checkpoint (reference)": lambda: net(data_x, data_y)[0].sum(),
    "make y require grad": lambda: reentrant_checkpoint(net, data_x, y_needs_grad)[0].sum(),
    "a dummy input": lambda: reentrant_checkpoint(lambda a, b, _: net(a, b), data_x, data_y, dummy)[0].sum(),
    "parameters as ignored arguments": lambda: reentrant_checkpoint(
        lambda a, b, *_params: net(a, b), data_x, data_y, *net.parameters())[0].sum(),
    "use_reentrant=False": lambda: ckpt_lab.checkpoint(net, data_x, data_y)[0].sum(),
}
weighed = {}
for name, run in ways_out.items():
    clear_grads(*net.parameters(), y_needs_grad, dummy)
    report = measure_memory(run)
    weighed[name] = [p.grad for p in net.parameters()]
    same = all_equal(weighed[name], weighed["no checkpoint (reference)"])
    print(f"{name:32} grads = plain: {same!s:5} | grad bytes {report.grad_bytes:>7,}"
          f" | retained {report.retained_bytes}")
net_params = tuple(net.parameters())  # as the poster builds it
print("same objects:", all(p is q for p, q in zip(net_params, net.parameters(), strict=True)))

# %% [markdown]
# All give the plain gradients and keep only the loss; making `y` require grad costs an unwanted
# gradient (+8,192 bytes). And a tuple holds references: the same `Parameter` objects, so their
# `.grad` is `net`'s.
#
# **The thread's `_NetCheckpointWrapper` is not one of them.** It passes the parameters but holds `x`
# and `y` as **attributes**, outside `save_for_backward`. When `x` comes from a trained layer and is
# used again (a residual), the nested backward runs *into the outer graph* through `x` and frees it:

# %%
class _NetCheckpointWrapper:  # the forum's code, made runnable
    def __init__(self, net, x, y):
        self.net, self.x, self.y = net, x, y
    def __call__(self, *args, **kwargs):
        return self.net(self.x, self.y)
encoder = nn.Linear(32, 32)
torch_reentrant = lambda f, *args: torch_checkpoint(f, *args, use_reentrant=True)
forms = {"_NetCheckpointWrapper": lambda t: (_NetCheckpointWrapper(net, t, data_y),),
         "safe form": lambda t: (lambda a, b, *_: net(a, b), t, data_y)}
checkpoints = {"torch's": torch_reentrant, "ours": reentrant_checkpoint}
residual = {}
for (form, make), (name, ckpt) in itertools.product(forms.items(), checkpoints.items()):
    enc_x = encoder(data_x)  # requires grad: the encoder is trained
    result = ckpt(*make(enc_x), *net.parameters())[0]
    try:
        (result.sum() + enc_x.pow(2).sum()).backward()  # enc_x used twice: a residual
        residual[form, name] = "backward ran"
    except RuntimeError as error:
        residual[form, name] = f"{type(error).__name__}: {str(error)[:48]}..."
    print(f"{form:21} {name:7} {residual[form, name]}")

# %% [markdown]
# And an attribute escapes autograd's version check: change `x` in place after the forward (a reused
# buffer), and the wrapper recomputes with the new values; the safe form (tensors as arguments) raises:

# %%
inplace = {}
for (form, make), (name, ckpt) in itertools.product(forms.items(), checkpoints.items()):
    clear_grads(*net.parameters())
    buffer = data_x.clone()
    result = ckpt(*make(buffer), *net.parameters())[0]
    buffer.mul_(2)  # in place, between forward and backward
    try:
        result.sum().backward()
        same = all_equal([p.grad for p in net.parameters()], weighed["no checkpoint (reference)"])
        inplace[form, name] = f"no error; gradients equal plain: {same}"
    except RuntimeError as error:
        inplace[form, name] = f"{type(error).__name__}: {str(error)[:48]}..."
    print(f"{form:21} {name:7} {inplace[form, name]}")

# %% [markdown]
# Torch's gives wrong gradients silently; ours raises only through a check of its own (the re-run's
# outputs against the forward's). The three experiments, each on its own:

# %%
how = {"_NetCheckpointWrapper": "an attribute: not saved,\\nnot detached from the encoder",
       "safe form": "an argument: saved,\\ndetached to a fresh leaf"}
said = lambda measured, f: f + "".join(f"\\n{c}: " + "\\n".join(textwrap.wrap(measured[f, c], 36))
                                       for c in checkpoints)
show_rows({"1 · how enc_x reaches the block": [f"{f}:\\n{how[f]}" for f in forms],
           "2 · enc_x used again after it (a residual)": [said(residual, f) for f in forms],
           "3 · x *= 2 between forward and backward": [said(inplace, f) for f in forms]},
          "02_wrapper_traps", arrows=False)

# %% [markdown]
# **Is it idiomatic? No.** Captured tensors are hidden from the checkpoint: no version check, no cut
# from the outer graph (it detaches only its *arguments*). Idiomatic: `checkpoint(net, x, y,
# use_reentrant=False)`; reentrant, pass the tensors as arguments, plus a dummy or the parameters:
# `reentrant_checkpoint(lambda x, y, *_: net(x, y), x, y, *net.parameters())`.
#
# ## 6. `autograd.grad` is reverse mode too, and why this checkpoint can't serve it
#
# *"autograd.grad does forward differentiation, doesn't it?"* No: the same backward pass as
# `.backward()`, returning the gradients you name instead of accumulating them into `.grad`:

# %%
params = list(block.parameters())
clear_grads(x, *params)
loss_a, loss_b = block(x).sum(), block(x).sum()
with OpCounter() as ops_grad:
    grads_by_grad = torch.autograd.grad(loss_a, [x, *params])
print("after autograd.grad, tensors with a .grad:", sum(t.grad is not None for t in [x, *params]))
with OpCounter() as ops_backward:
    loss_b.backward()
print("same numbers as .backward():", all_equal(grads_by_grad, [x.grad, *(p.grad for p in params)]),
      "| .backward() runs the same ops plus:", dict(ops_backward.counts - ops_grad.counts))

# %% [markdown]
# (Forward mode would need one pass per input entry: 65,536 for `x`.) The nested backward writes
# `.grad` of every leaf it reaches: that is how parameters get gradients without being inputs, the
# reason albanD gives for the limitation (*"You don't need to pass all the things that require
# gradients as input"*). `autograd.grad` must leave `.grad` alone, so `backward` first asks
# `torch.autograd._is_checkpoint_valid()` (private torch API, as in torch's own checkpoint). In
# [`engine.cpp`](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/csrc/autograd/engine.cpp) it
# reads a thread-local flag that `CheckpointValidGuard`, atop `call_function` (a node's hooks and
# backward), sets to the graph task's `can_checkpoint()`, i.e. `exec_info_.empty()`, ANDed with
# the enclosing task's flag. `Engine::execute`
# fills the exec-info (`init_to_execute`) when the call names the tensors to differentiate
# (`autograd.grad`, `backward(inputs=...)`): only a plain `backward()` leaves it empty. A hook reads it:

# %%
def engine_flag(run):  # torch.autograd._is_checkpoint_valid() while backward runs through y
    t = torch.ones(3, requires_grad=True)
    (y := t * 2).register_hook(lambda g: flags.append(torch.autograd._is_checkpoint_valid()))
    run(y.sum(), t)
    return flags.pop()
flags, calls = [], {"backward()": lambda loss, t: loss.backward(), "autograd.grad": torch.autograd.grad,
                    "backward(inputs=...)": lambda loss, t: loss.backward(inputs=[t])}
print({name: engine_flag(run) for name, run in calls.items()},
      "| outside a backward:", torch.autograd._is_checkpoint_valid())

# %% [markdown]
# Ours raises when it is False; draft 2, unguarded, writes the parameters' `.grad`; the
# non-reentrant checkpoint (03b) serves `autograd.grad`. §2's timeline: the nested backward's
# [`AccumulateGrad`](glossary.md#accumulategrad) nodes write `.grad`:

# %%
schedule_fig

# %%
clear_grads(x, *params)
try:
    torch.autograd.grad(reentrant_checkpoint(block, x).sum(), x)
except RuntimeError as error:
    print("ours: RuntimeError:", str(error)[:90], "...")
(grad_x,) = torch.autograd.grad(DraftCheckpointNoRNG.apply(block, x).sum(), x)
print("draft 2: right value:", torch.equal(grad_x, reference[0]),
      "| parameters whose .grad it wrote anyway:", sum(p.grad is not None for p in params))
grads_nonreentrant = torch.autograd.grad(ckpt_lab.checkpoint(block, x).sum(), [x, *params])
print("non-reentrant checkpoint + autograd.grad equals plain:", all_equal(grads_nonreentrant, grads_by_grad))

# %% [markdown]
# ## 7. The redundant `no_grad`
#
# The thread *"Tensor.requires_grad in torch.autograd.Function"* asks whether the `no_grad` in
# torch's `CheckpointFunction.forward` is redundant. albanD: *"It is indeed redundant."* torch's,
# after `ctx.save_for_backward(*tensor_inputs)`, ends:

# %%
show_source(torch.utils.checkpoint.CheckpointFunction.forward, start="with torch.no_grad():")

# %% [markdown]
# `ckpt_lab`'s has none; the block sees grad off anyway: `apply` switches it off before `forward`
# (step 2 of notebook 01's picture):

# %%
Image(filename="../images/01_apply_sequence.png")

# %%
seen = []
reentrant_checkpoint(lambda t: seen.append(torch.is_grad_enabled()) or block(t), x).sum().backward()
print("grad mode inside the block: forward =", seen[0], "| recomputation =", seen[1])
clear_grads(x, *params)
theirs = measure_memory(lambda: torch_reentrant(block, x).sum())
print("memory report equals torch's, to the byte:", memory["checkpoint"] == theirs)

# %% [markdown]
# ## 8. RNG: replaying dropout, and leaving the caller's random stream alone
#
# Dropout's masks come from the global generator, which by backward has moved on (§3). **Draft 3**
# snapshots it in `forward` and restores it before recomputing, so leaves it where the *forward* did:

# %%
class DraftCheckpointNoFork(DraftCheckpointGradOnly):  # DRAFT 3: restores the RNG state, no fork
    @staticmethod
    def forward(ctx, function, x):
        ctx.rng_state = torch.get_rng_state()
        return DraftCheckpointGradOnly.forward(ctx, function, x)
    @staticmethod
    def backward(ctx, grad_output):
        torch.set_rng_state(ctx.rng_state)  # the forward's masks again; the caller's stream is rewound
        return DraftCheckpointNoRNG.backward(ctx, grad_output)


# %% [markdown]
# One step: seed, forward, **draw between forward and backward** (a shuffle), backward, draw again:

# %%
def dropout_step(ckpt):
    clear_grads(x, *dropout_block.parameters())
    _ = torch.manual_seed(1)
    out = ckpt(dropout_block, x)
    between = torch.rand(4)
    out.sum().backward()
    return [x.grad, *(p.grad for p in dropout_block.parameters())], between, torch.rand(4)
plain_step = dropout_step(lambda f, t: f(t))
print(f"{'':32} {'wrong grad entries':>18} {'draw after = plain':>19} {'= draw between':>15}")
rng = {}
for name, ckpt in {"draft 2 (no RNG restore)": DraftCheckpointNoRNG.apply,
                   "draft 3 (restore, no fork)": DraftCheckpointNoFork.apply,
                   "ours (restore inside a fork)": reentrant_checkpoint, "torch's": torch_reentrant}.items():
    grads, between, after = dropout_step(ckpt)
    wrong = sum(int((a != b).sum()) for a, b in zip(grads, plain_step[0], strict=True))
    same, repeated = torch.equal(after, plain_step[2]), torch.equal(after, between)
    rng[name] = wrong, same, repeated
    print(f"{name:32} {wrong:>18,} {same!s:>19} {repeated!s:>15}")
print("CPU RNG snapshot kept per checkpointed call:", torch.get_rng_state().numel(), "bytes")
show_rows({name: ["seed 1", "forward: dropout draws\\nthe masks from state S", "a draw between\\n(a shuffle)",
                  f"backward: {fix}; recompute\\nwrong grad entries: {rng[name][0]:,}",
                  f"the caller's next draw\\n= plain: {rng[name][1]} | = the one between: {rng[name][2]}"]
           for name, fix in [("draft 3 (restore, no fork)", "set state S, leave it there"),
                             ("ours (restore inside a fork)", "fork, set S, put the state back")]},
          "02_rng_stream")

# %% [markdown]
# * Without a restore (draft 2, or `preserve_rng_state=False`), every gradient entry is wrong.
# * Draft 3 gets them right but **rewinds** the caller's stream: the draw after backward repeats the
#   one between (a training loop would reuse shuffles).
# * torch's `CheckpointFunction.backward` re-runs inside `torch.random.fork_rng`, which saves the
#   CPU generator and those of the devices the forward stashed (its tensors' devices, if that device
#   type was initialised), and puts them back after. Autocast is not forked but re-entered:
#   `torch.amp.autocast(...)` for the device type and for the CPU, with the forward's settings.
#   Ours, `ReplayState.replay`, does the same (`measure_memory` does not count the CPU snapshot):

# %%
show_source(ckpt_lab.rng.ReplayState.replay, start="with fork_rng")

# %% [markdown]
# **Your turn.** Rebuild `CheckpointFunction` in `exercises/02_checkpoint_function.py` (open it from
# the file browser): `forward(ctx, run_function, preserve_rng_state, *args)` keeps only the tensor
# inputs; `backward(ctx, *grads)` re-runs the block (§3, this section) and returns one gradient per
# argument. The cell below grades it against the plain block: what it keeps, the re-runs, the
# gradients bit for bit, a residual input, dropout.

# %%
from ckpt_lab.exercises import check

check("02-checkpoint-function", "exercises/02_checkpoint_function.py")

# %% [markdown]
# <a id="saves-nothing"></a>
# ## 9. Where checkpointing saves nothing
#
# A checkpoint frees only what is made inside it *and* referenced by nothing else, and lowers the
# [peak](glossary.md#peak) only if backward does not re-run it while the rest is alive. Backward
# starts at the loss: the checkpoint that made the output re-runs first, and each re-run brings its
# whole block back at once. Four blocks of §1 (`a` = one activation, 262,144 bytes), five ways.
#
# **Predict.** With a checkpoint around *every single op* (each `Linear`, each `GELU`), how many
# activations does the stack retain after the forward?

# %%
guess = None  # your guess: a number of activations (a)

# %%
_ = torch.manual_seed(0)
stack4 = nn.Sequential(*[make_block() for _ in range(4)])
each = lambda t, fns: [t := reentrant_checkpoint(f, t) for f in fns][-1]  # one checkpoint per function
placements = {
    "no checkpoint": lambda: stack4(x).sum(),
    "one around the whole stack": lambda: reentrant_checkpoint(stack4, x).sum(),
    "around the last block only": lambda: reentrant_checkpoint(stack4[3], stack4[:3](x)).sum(),
    "around every single op": lambda: each(x, [op for b in stack4 for op in b]).sum(),
    "around each block but the last": lambda: stack4[3](each(x, stack4[:3])).sum(),
}
a, placed = x.nbytes, {}
for name, run in placements.items():
    clear_grads(x, *stack4.parameters())
    placed[name] = r = measure_memory(run)
    print(f"{name:32} retained {r.retained_bytes / a:5.2f} a  peak {r.peak_bytes / a:5.2f} a")
reveal(guess, placed["around every single op"].retained_bytes // a, "activations retained, ops checkpointed")
fig, axes = plt.subplots(1, 2, figsize=(11, 2.4))
for ax, what in zip(axes, ["retained", "peak"], strict=True):
    plot_memory_bars(ax, {n: getattr(r, f"{what}_bytes") for n, r in placed.items()}, f"{what} (a)", unit=a)
    ax.set_xlabel("activations of 262,144 bytes (a)")
save_figure(fig, "02_where_it_saves_nothing")
plt.show()

# %% [markdown]
# * **No checkpoint**: 31 a retained (32 saves less `x`, which existed before), peak 32 a.
# * **Around the whole function**: nothing retained, but backward starts by re-running it all:
#   peak 33 a.
# * **Around the last stage only**: retained falls (24 a), the peak does not (33 a): that re-run
#   comes first, while the other blocks' activations are alive.
# * **Around inputs the caller keeps alive**: a checkpoint keeps its input; around a single op, that
#   is what the op saved anyway: 31 a, as without. Likewise for a residual or logged activations.
# * **What works: one per block, the last left plain**: 10 a retained (the checkpoints' inputs, the
#   last block's saves), **12 a peak**: each re-run rebuilds one block, the blocks above it freed.
#
# More checkpoints along a chain (√N segments, recursion): [notebook 02b](02b_checkpoint_schedules_appendix.ipynb).

# %% [markdown]
# ## Summary
#
# | question | answer | § |
# |---|---|---|
# | What does a checkpointed block keep? | its input: 1 tensor, not 8; 4 bytes retained, not 1,835,012 | 1 |
# | What runs when? | forward, grad off; backward recomputes, then a nested graph task | 2 |
# | Why a nested `.backward()`? | parameters are not inputs (draft 1: 8 of 8 without gradient) | 3 |
# | Why does the output require grad, not when no input does? | reentrant (2.13's default, warned): only if an argument does; non-reentrant: also if a parameter does | 4 |
# | "element 0 … does not require grad"? | parameters are not arguments of `apply`: add a dummy input, or `use_reentrant=False` | 5 |
# | Is `_NetCheckpointWrapper` idiomatic? | no: a residual breaks backward; torch's misses in-place changes (wrong gradients) | 5 |
# | Are the tuple's parameters `net.parameters()`? | yes, the same objects | 5 |
# | `autograd.grad` forward mode? Why unsupported? | reverse mode; the nested backward writes `.grad`: allowed in a plain `backward()` only (`can_checkpoint()`) | 6 |
# | Is the inner `no_grad` redundant? | yes; same memory | 7 |
# | Why replay the RNG in a fork? | else 131,584 of 131,584 gradient entries wrong, or the caller's stream rewound (autocast: re-entered) | 8 |
# | Where does it save nothing? | around everything or the last stage (peak 33 a vs 32 a), inputs the caller keeps (31 a) | 9 |
# | √N? Recursion? | 11 a vs 36 a for 1.278 × FLOPs; log₂ N + 1 | 02b |
#
# Notebooks 03 and 03b drop the `autograd.Function`: saved-tensor hooks, then the non-reentrant
# checkpoint, which keeps the graph and changes only what it stores.
