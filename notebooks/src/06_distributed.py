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
# # 06 · Checkpointing under DDP and FSDP
#
# **TL;DR.** Checkpointing does not change what `DistributedDataParallel` (DDP) or FSDP compute:
# with each of five checkpoints, DDP trains bitwise like DDP without checkpointing. But the
# **reentrant** checkpoint (torch's `use_reentrant=True`, which torch still picks when the argument
# is omitted, and ours from notebook 02) breaks DDP once `find_unused_parameters=True` is set or a
# block's weights are used twice: *"Expected to mark a variable ready only once"*. DDP marks each
# parameter ready exactly once per backward; a reentrant checkpoint hides the block's parameters
# from the graph and accumulates their gradients in a nested backward, so they are marked twice.
# The fix: the **non-reentrant** checkpoint, which needs no DDP option, or `static_graph=True`.
# Under FSDP2 (`fully_shard`), `ckpt_lab.checkpoint` goes in through `checkpoint_wrapper` and cuts
# the activations a rank keeps from 230,400 to 132,096 bytes. All on the **gloo** backend: two
# CPU processes play two GPUs.
#
# **After this notebook you can**
#
# 1. read DDP's "marked as ready twice" and name its cause in the reducer's terms (checked: §2's
#    assert on the message; §3's assert on the step where DDP raises);
# 2. tell from a parameter's hook firings whether DDP will raise (checked: §3's prediction; the
#    replay agrees with DDP in 18 of 18 configurations);
# 3. pick a fix and say what it changes: the graph, or what DDP waits for (checked: §4's asserts);
# 4. checkpoint blocks under FSDP2 in the right order and account for the bytes a rank keeps
#    (checked: §5's prediction and asserts).
#
# | question | § |
# |---|---|
# | Does checkpointing change what DDP computes? | 1 |
# | When does the reentrant checkpoint break DDP, with what error? | 2 |
# | Why "marked as ready twice", and not with the non-reentrant checkpoint or the scope? | 3 |
# | The fixes? Why is PyTorch moving checkpointing away from `autograd.Function`? (the forum thread "Tensor.requires_grad in torch.autograd.Function"; one reason, measured) | 3, 4 |
# | `ckpt_lab.checkpoint` under FSDP2: what does a rank keep? | 5 |
# | What would a GPU change? | 6 |
# | Starting distributed workers from a notebook; a worker that fails or hangs | Appendix |

# %%
import warnings
from collections import Counter

import matplotlib.pyplot as plt
import torch

from ckpt_lab import distributed
from ckpt_lab.distributed import (
    REENTRANT,
    STRATEGIES,
    ParameterHooks,
    TinyNet,
    ddp_train_steps,
    fail_on_rank,
    fsdp_train_steps,
    sum_of_ranks,
    trace_parameter_hooks,
)
from ckpt_lab.helpers.predict import reveal
from ckpt_lab.helpers.processes import WorkerError, run_workers
from ckpt_lab.helpers.show import show_source
from ckpt_lab.helpers.viz import draw_graph, plot_memory_bars, save_figure

_ = torch.manual_seed(0)
print("torch", torch.__version__)

# %% [markdown]
# ## 1. DDP with checkpointed blocks: the same result
#
# A distributed job is several processes, one per device, each a **rank**; they meet in a *process
# group* and exchange tensors with **collectives** (an `all_reduce` sums a tensor over all ranks and
# gives every rank the total). `run_workers(fn, **kwargs)` starts 2 processes, runs `fn(rank,
# world_size, **kwargs)` in each and returns their results in rank order; `fn` must live in a module
# (here `ckpt_lab.distributed`), not a notebook cell ([Appendix](#Appendix:-the-process-launcher)).
#
# **DDP** keeps a full copy of the model on every rank; each rank runs forward and backward on its
# own slice of the batch, and DDP **averages the gradients** across ranks during backward, so every
# copy takes the same step. It learns that a parameter's gradient is ready from a hook on the
# parameter's [`AccumulateGrad`](glossary.md#accumulategrad) node (§3), and all-reduces gradients in
# buckets as soon as a bucket is complete, overlapping communication with backward.
#
# The model, `TinyNet`: a stem (`Linear`), three residual blocks (`x + tanh(linear(x))`), a head.
# Each block runs through one of six strategies, by their labels in the project's registry
# (`ckpt_lab/strategies.py`; a string travels to the workers):
#
# | label | what runs per block |
# |---|---|
# | `none` | `block(x)` |
# | `torch reentrant` | `torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)` |
# | `ckpt_lab.reentrant_checkpoint` | `reentrant_checkpoint(block, x)` (notebook 02) |
# | `torch non-reentrant` | `torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)` |
# | `ckpt_lab.checkpoint` | `checkpoint(block, x)` (notebook 03b) |
# | `ckpt_lab.gradient_checkpoint_scope` | `with gradient_checkpoint_scope(): block(x)` (notebook 04) |
#
# The worker `ddp_train_steps` (`ckpt_lab/distributed.py`) trains 3 SGD steps in float64 under DDP
# (2 ranks × 4 samples) and checks itself three ways: against one process trained on the whole
# batch of 8, bitwise against DDP without checkpointing, and against rank 0's parameters, broadcast
# to every rank. It returns the verdicts as booleans; an error DDP raises comes back as `error`.

# %%
default_runs = {s: run_workers(ddp_train_steps, timeout=120, strategy=s) for s in STRATEGIES}
print(f"{'strategy':36} {'error':6} {'params=ref':11} {'grads=ref':10} {'bitwise=plain DDP':18} "
      f"{'ranks agree':12} block forwards")
for strategy, (rank0, rank1) in default_runs.items():
    assert rank0 == rank1  # both ranks reach the same verdicts
    print(f"{strategy:36} {rank0.error is not None!s:6} {rank0.params_match_reference!s:11} "
          f"{rank0.grads_match_reference!s:10} {rank0.bitwise_equal_to_no_checkpoint!s:18} "
          f"{rank0.ranks_agree!s:12} {rank0.block_forwards}")
    assert rank0.params_match_reference and rank0.grads_match_reference
    assert rank0.bitwise_equal_to_no_checkpoint and rank0.ranks_agree

# %% [markdown]
# Every strategy trains like the single-process reference (to 1e-12 in float64: the sum over ranks
# adds in another order) and **bitwise** like DDP without checkpointing. The first block ran 6 times
# in 3 steps under the four checkpoints (forward, then backward's recomputation), 3 times without;
# the scope replays the block's recorded aten ops without calling the module, so its count stays 3.
#
# **Why the reference matches**: the all-reduce, replayed in this process on the workers' model and
# batch. Each rank's gradient of the head's weight on its 4 samples, their average (what every rank
# steps with), and one process's gradient on all 8:

# %%
net, (inputs, targets) = distributed.build_model(), distributed.global_batch(8)
def head_grad(rows):
    net.zero_grad()
    torch.nn.functional.mse_loss(net(inputs[rows]), targets[rows]).backward()
    return net.head.weight.grad.flatten().clone()
grads = {"rank 0, samples 0-3": head_grad(slice(0, 4)), "rank 1, samples 4-7": head_grad(slice(4, 8))}
grads["all-reduce / 2: each rank's step"] = (grads["rank 0, samples 0-3"] + grads["rank 1, samples 4-7"]) / 2
grads["one process, samples 0-7"] = head_grad(slice(0, 8))
fig, ax = plt.subplots(figsize=(11, 2.6), layout="constrained")
for k, (label, g) in enumerate(grads.items()):
    ax.bar(torch.arange(len(g)) + 0.2 * k - 0.3, g, width=0.2, label=label)
ax.set(xlabel="head.weight, entry by entry", ylabel="gradient", xticks=range(16))
ax.legend(fontsize=8, ncols=2)
save_figure(fig, "06_ddp_average")
plt.show()
average, whole = list(grads.values())[2:]
print("average of the ranks == whole batch, to 1e-12:", torch.allclose(average, whole, rtol=0, atol=1e-12))

# %% [markdown]
# The ranks' gradients differ (different samples); their average is the whole batch's, to rounding,
# because the loss is a mean over samples. With DDP's default options even the reentrant
# checkpoints work. Two settings that real models need break them.
#
# ## 2. The failure: "marked as ready twice"
#
# * `find_unused_parameters=True`: needed whenever some parameters take no part in a step (a
#   mixture-of-experts layer, a frozen branch). After each forward, DDP must find out which
#   parameters will get no gradient, so that it does not wait for them.
# * **tied weights** (`repeat=2`): the same blocks run twice, as in ALBERT, so each checkpointed
#   block is called twice per forward.

# %%
failing_options = {"find_unused_parameters=True": {"find_unused_parameters": True},
                   "tied weights": {"repeat": 2}}
runs = {(strategy, label): run_workers(ddp_train_steps, timeout=120, strategy=strategy, **options)
        for strategy in STRATEGIES for label, options in failing_options.items()}
print(f"{'strategy':36} {'find_unused_parameters=True':28} tied weights (repeat=2)")
for strategy in STRATEGIES:
    cells = []
    for label in failing_options:
        rank0, rank1 = runs[strategy, label]
        assert rank0 == rank1
        assert (rank0.error is not None) == (strategy in REENTRANT)
        cells.append("error" if rank0.error else f"ok, params=ref {rank0.params_match_reference}")
    print(f"{strategy:36} {cells[0]:28} {cells[1]}")

# %% [markdown]
# Both reentrant checkpoints, torch's and ours, fail in both settings, on both ranks; the three
# non-reentrant strategies train correctly. The error (torch's reentrant checkpoint with
# `find_unused_parameters=True`, rank 0), first and last sentence:

# %%
message = runs["torch reentrant", "find_unused_parameters=True"][0].error
print(message.split(". ")[0] + ".")
print(message.splitlines()[-1])
same = [run[0].error == message for key, run in runs.items() if key[0] in REENTRANT]
print(f"reentrant failures with exactly this message: {sum(same)} of {len(same)}")
assert all(same)

# %% [markdown]
# And the failing variant is the one you get when you do not choose: `checkpoint` without
# `use_reentrant` warns, then runs the reentrant `CheckpointFunction`. Shown on torch 2.13; 2.11 and
# 2.14.1 do the same, and none of them raises as the warning's "Starting in PyTorch 2.9, calling
# checkpoint without use_reentrant will raise" says (the site's "Torch versions" page):

# %%
block = TinyNet().double().blocks[0]
h = torch.randn(2, 16, dtype=torch.float64, requires_grad=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = torch.utils.checkpoint.checkpoint(block, h)  # no use_reentrant: on purpose
warned = str(caught[0].message).split(": ")[1].split(".")[0]
print("grad_fn:", type(out.grad_fn).__name__, "| warned:", warned)
assert type(out.grad_fn).__name__ == "CheckpointFunctionBackward"

# %% [markdown]
# ## 3. Why: what DDP's reducer counts
#
# DDP's *reducer* (the part that buckets and all-reduces gradients) keeps one rule: **in every
# backward, each parameter is marked ready exactly once**. It marks a parameter ready when its hook
# fires: a C++ post-hook the reducer registers on the parameter's `AccumulateGrad` node
# (`grad_accumulator->add_post_hook(...)`, calling `autograd_hook`, in `Reducer::Reducer`,
# [reducer.cpp](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/csrc/distributed/c10d/reducer.cpp)),
# so once per run of that node. With `find_unused_parameters=True` it also walks the autograd graph
# from the forward's output, and every parameter the walk does not reach is declared unused and
# marked ready when backward's first hook fires, since no gradient will come for it.
#
# Now recall notebooks 01 and 02. A reentrant checkpoint is a custom `autograd.Function`; its node
# links only to its **tensor inputs**. The block's parameters are not inputs: they are used inside
# `forward` under `no_grad`, so the graph does not reach them. The graph of `TinyNet` with torch's
# reentrant checkpoint, parameters labelled:

# %%
model = TinyNet(strategy="torch reentrant").double()
x = torch.randn(2, 4, dtype=torch.float64)
draw_graph(model(x).sum(), dict(model.named_parameters()), name="06_reentrant_graph_hides_parameters")

# %% [markdown]
# Three `CheckpointFunctionBackward` nodes, each linked only to the node that made its input (in
# orange, the one tensor each saved: that input). The stem's and head's parameters (blue) hang off
# the graph; the blocks' six parameters appear nowhere.
#
# ### What runs when
#
# The node's backward recomputes the block with grad on and runs a **nested** backward through that
# private graph (notebook 02), and *that* is where the parameters' gradients are accumulated and
# their hooks fire: in a second [graph task](glossary.md#graph-task) (its id:
# `torch._C._current_graph_task_id()`, private torch API, -1 outside backward).
#
# DDP's C++ hook is out of Python's sight; `register_post_accumulate_grad_hook` stands in for it. It
# runs inside the same `AccumulateGrad` node, right after the node wrote `.grad`, and the node's
# post-hooks (DDP's among them) run as the node returns. A Python post-hook on the node itself
# (`Node.register_hook`, the kind DDP registers) fires right after it, every time:

# %%
tied, fired, nodes = TinyNet(strategy="torch reentrant", repeat=2).double(), [], []
for name, p in tied.named_parameters():
    p.register_post_accumulate_grad_hook(lambda _p, name=name: fired.append(("tensor hook", name)))
    nodes.append(p.view_as(p).grad_fn.next_functions[0][0])  # p's AccumulateGrad, kept alive as DDP does
    nodes[-1].register_hook(lambda *_, name=name: fired.append(("node post-hook", name)))
tied(x).sum().backward()
tensor_hooks, node_hooks = fired[::2], fired[1::2]
pairs = all(t == ("tensor hook", n) for t, (_, n) in zip(tensor_hooks, node_hooks, strict=True))
print(f"{len(tensor_hooks)} firings; each followed by the node post-hook of the same parameter:",
      pairs and all(kind == "node post-hook" for kind, _ in node_hooks))


# %% [markdown]
# `what_runs_when` records, in one process and without DDP, each module call (with its grad mode)
# and each firing of that stand-in, with its graph task:

# %%
def what_runs_when(strategy, repeat=1):
    """One forward and backward of TinyNet: (step, module) in order; a parameter's hook firing is
    reported once per module, as 'hooks, outer backward' or 'hooks, nested backward'."""
    _ = torch.manual_seed(0)
    model = TinyNet(strategy=strategy, repeat=repeat).double()
    task, events = torch._C._current_graph_task_id, []
    modules = {"stem": model.stem, "head": model.head}
    modules |= {f"blocks.{i}": b for i, b in enumerate(model.blocks)}
    for name, module in modules.items():
        module.register_forward_pre_hook(lambda _m, _a, name=name: events.append(
            ("recompute" if task() >= 0 else "forward", name, torch.is_grad_enabled(), task())))
    for name, p in model.named_parameters():
        module_name = name.removesuffix(".weight").removesuffix(".bias").removesuffix(".linear")
        p.register_post_accumulate_grad_hook(
            lambda _p, m=module_name: events.append(("hooks", m, True, task())))
    out = model(torch.randn(2, 4, dtype=torch.float64))
    out.register_hook(lambda _g: events.append(("backward starts", "", True, task())))
    out.sum().backward()
    outer = next(t for kind, *_, t in events if kind == "backward starts")
    steps = []
    for kind, name, grad_on, t in events:
        if kind == "forward":
            kind = "forward, grad on" if grad_on else "forward, no grad"
        elif kind == "hooks":
            kind = "hooks, outer backward" if t == outer else "hooks, nested backward"
        if (kind, name) != (steps[-1] if steps else None):  # weight and bias: one step
            steps.append((kind, name))
    return steps


# %% [markdown]
# The reentrant checkpoint's schedule, with DDP's marks replayed for `find_unused_parameters=True`
# (the walk declares the six block parameters unused; each is marked once for that at the first
# hook, and once more for each hook firing):

# %%
reentrant_steps = what_runs_when("torch reentrant")
hooks = trace_parameter_hooks(TinyNet(strategy="torch reentrant").double(), x)
unused = [h.name for h in hooks if not h.reachable]
marks, first_error = Counter(), None
for i, (kind, name) in enumerate(reentrant_steps, 1):
    note = "inside the checkpoint's forward: the graph keeps its input" if kind.endswith("no grad") else ""
    if kind.startswith("hooks"):
        if not marks:
            marks.update(unused)
            note = f"DDP marks the {len(unused)} unreached block parameters ready; "
        params = [p for p, _ in model.named_parameters() if p.startswith(name + ".")]
        marks.update(params)
        note += f"marks of {name}.*: {marks[params[0]]}"
        if marks[params[0]] > 1 and first_error is None:
            first_error, note = i, note + "  <- DDP raises here"
    print(f"{i:2}. {kind:23} {name:9} {note}".rstrip())
assert first_error == 9 and reentrant_steps[first_error - 1] == ("hooks, nested backward", "blocks.2")

# %% [markdown]
# Step 9 is where DDP raised in §2: the last block's parameters, the first checkpointed ones
# backward reaches, marked a second time by a hook in a nested backward. The same recording for
# `ckpt_lab.checkpoint` (non-reentrant, on saved-tensor hooks: notebook 03b) has the same 14 steps
# in the same order, but the blocks run with grad on in forward, the graph reaches their parameters,
# and their hooks fire in the outer backward:

# %%
nonreentrant_steps = what_runs_when("ckpt_lab.checkpoint")
colors = {"forward, grad on": "tab:blue", "forward, no grad": "lightsteelblue",
          "backward starts": "lightgrey", "recompute": "tab:orange",
          "hooks, outer backward": "tab:green", "hooks, nested backward": "tab:red"}
fig, axes = plt.subplots(1, 2, figsize=(10, 5), sharey=True)
columns = [("torch reentrant", reentrant_steps), ("ckpt_lab.checkpoint (non-reentrant)", nonreentrant_steps)]
for ax, (title, steps) in zip(axes, columns, strict=True):
    for i, (kind, name) in enumerate(steps, 1):
        ax.barh(i, 1, color=colors[kind], edgecolor="white")
        mark = "   <- 2nd mark: DDP raises" if steps is reentrant_steps and i == first_error else ""
        ax.text(0.03, i, f"{i}. {kind}  {name}{mark}", va="center", fontsize=9,
                color="white" if kind in ("forward, grad on", "hooks, nested backward") else "black")
    ax.set_title(title)
    ax.set_xticks([])
axes[0].invert_yaxis()
axes[0].set_yticks([])
fig.suptitle("What runs when: one forward and backward of TinyNet (measured)")
fig.tight_layout()
save_figure(fig, "06_what_runs_when")
plt.show()
same_order = [n for _, n in reentrant_steps] == [n for _, n in nonreentrant_steps]
print("steps:", len(reentrant_steps), "and", len(nonreentrant_steps), "| same order:", same_order)

# %% [markdown]
# ### Marked ready, parameter by parameter
#
# `trace_parameter_hooks(model, x)` sums that recording up per parameter: whether the walk reaches
# it, how often its hook fired in the outer backward and in nested ones. The reducer's count is then
# one line:

# %%
show_source(ParameterHooks.ready_marks)

# %% [markdown]
# **Predict.** With tied weights each block runs twice per forward. Under the non-reentrant
# `ckpt_lab.checkpoint`, how many times does the hook of `blocks.0.linear.weight` fire in one
# backward?

# %%
guess = None  # your guess: a number


# %%
def traced(strategy, repeat=1):
    _ = torch.manual_seed(0)
    return trace_parameter_hooks(TinyNet(strategy=strategy, repeat=repeat).double(), x)


weight = {h.name: h for h in traced("ckpt_lab.checkpoint", repeat=2)}["blocks.0.linear.weight"]
reveal(guess, weight.fired_outer + weight.fired_nested, "hook firings (tied weights, non-reentrant)")
print(f"{'strategy':22} {'setting':28} parameters marked != 1 (max marks)")
for label, options in failing_options.items():
    for strategy in ["torch reentrant", "ckpt_lab.checkpoint"]:
        hooks = traced(strategy, options.get("repeat", 1))
        counts = [h.ready_marks(options.get("find_unused_parameters", False)) for h in hooks]
        print(f"{strategy:22} {label:28} {sum(c != 1 for c in counts)} of {len(counts)} ({max(counts)})")

# %% [markdown]
# The non-reentrant checkpoint leaves the graph as a plain forward builds it, and autograd
# *sums* the two incoming gradients before it runs the accumulator once, as for any tensor used
# twice. The reentrant checkpoint marks the six block parameters twice in both settings: the walk
# and then a nested backward, or, with tied weights, two nested backwards per block, each
# accumulating on its own. The replay predicts DDP exactly: for every strategy and setting, "some
# parameter is marked a number of times other than one" holds exactly when DDP raised.

# %%
agree = []
for strategy in STRATEGIES:
    for label, options in {"default": {}, **failing_options}.items():
        hooks = traced(strategy, options.get("repeat", 1))
        predicted = any(h.ready_marks(options.get("find_unused_parameters", False)) != 1 for h in hooks)
        rank0 = default_runs[strategy][0] if label == "default" else runs[strategy, label][0]
        agree.append(predicted == (rank0.error is not None))
print("configurations:", len(agree), "| prediction == DDP's verdict in all:", all(agree))
assert all(agree)

# %% [markdown]
# ## 4. The fixes
#
# **`static_graph=True`** tells DDP the graph is the same in every iteration. DDP then neither walks
# the graph nor marks anything in the first iteration: it *counts* how often each parameter's hook
# fires, and from the second iteration on marks a parameter ready when its hook has fired that many
# times. Two firings for a tied weight are then expected, and an "unused" parameter is one whose hook
# did not fire in the first iteration, not one the walk missed:

# %%
lines, static = [f"{'strategy':32} {'setting':28} {'error':6} {'params=ref':11} grads=ref"], {}
for strategy in REENTRANT:
    for label, options in failing_options.items():
        static[strategy, label] = rank0, rank1 = run_workers(
            ddp_train_steps, timeout=120, strategy=strategy, static_graph=True, **options)
        assert rank0 == rank1
        assert rank0.error is None and rank0.params_match_reference and rank0.grads_match_reference
        lines.append(f"{strategy:32} {label:28} {rank0.error is not None!s:6} "
                     f"{rank0.params_match_reference!s:11} {rank0.grads_match_reference}")
print("\n".join(lines))

# %% [markdown]
# It works, with conditions: the graph must really be static (no data-dependent choice of which
# parameters are used), and the first iteration reduces all gradients at its very end, without
# overlap. **The non-reentrant checkpoint needs no flag at all** (§2's table): `ckpt_lab.checkpoint`,
# torch's `use_reentrant=False` and the scope all keep the ordinary graph.
#
# **Why each fix works**, in the reducer's terms. `block_marks` runs two iterations of one model in
# this process (`trace_parameter_hooks` twice) and reports for one block parameter (the blocks' six
# behave alike, §3) what the second iteration brings, the walk's mark (only without `static_graph`)
# and the hook firings, against the count DDP waits for: one, or under `static_graph` the firings it
# counted in the first iteration:

# %%
def block_marks(strategy, options, static_graph=False, name="blocks.0.linear.weight"):
    """(walk's mark, outer firings, nested firings) of one parameter in a model's second iteration, and
    the count DDP waits for: 1, or with static_graph the firings of the first iteration."""
    _ = torch.manual_seed(0)
    model = TinyNet(strategy=strategy, repeat=options.get("repeat", 1)).double()
    first, later = ({h.name: h for h in trace_parameter_hooks(model, x)}[name] for _ in range(2))
    walk = int(options.get("find_unused_parameters", False) and not static_graph and not later.reachable)
    waits = first.fired_outer + first.fired_nested if static_graph else 1
    return walk, later.fired_outer, later.fired_nested, waits


# %%
configs = [("torch reentrant", False), ("torch reentrant", True), ("torch non-reentrant", False),
           ("ckpt_lab.checkpoint", False), ("ckpt_lab.gradient_checkpoint_scope", False)]
names = [s + (" + static_graph=True" if g else "") for s, g in configs]
legends = ["declared unused by the walk", "hook, outer backward", "hook, nested backward"]
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True, layout="constrained")
for ax, (label, options) in zip(axes, failing_options.items(), strict=True):
    summary = []
    for row, (strategy, static_graph) in enumerate(configs):
        *parts, waits = block_marks(strategy, options, static_graph)
        for i, (value, color) in enumerate(zip(parts, ["grey", "tab:green", "tab:red"], strict=True)):
            ax.barh(row, value, left=sum(parts[:i]), color=color, label=legends[i] if row == 0 else "_")
        ax.plot([waits] * 2, [row - 0.45, row + 0.45], "k", lw=3, label="DDP waits for" if row == 0 else "_")
        error = (static if static_graph else runs)[strategy, label][0].error
        ax.text(2.1, row, "DDP raised" if error else "DDP trained", va="center", fontsize=9)
        assert (sum(parts) != waits) == (error is not None)  # the replay predicts DDP's verdict
        summary.append(f"{names[row]} {sum(parts)}/{waits}")
    ax.set(title=label, xlim=(0, 2.9), xticks=[0, 1, 2], xlabel="blocks.0.linear.weight: marks, one backward")
    print(f"{label}, marks/waits for: " + ", ".join(summary))
axes[0].set_yticks(range(len(configs)), names)
axes[0].invert_yaxis()
fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=4, fontsize=8)
save_figure(fig, "06_fixes")
plt.show()

# %% [markdown]
# First row, the failure: two marks where DDP waits for one. `static_graph=True` changes what DDP
# waits for, not the graph: no walk, and the count it learned (one firing with
# `find_unused_parameters`, two with tied weights). The non-reentrant checkpoints change the graph
# instead: one firing, in the outer backward, as without checkpointing. The replay agrees with DDP's
# own verdicts in all ten. This is one reason PyTorch moved checkpointing away from a custom
# `autograd.Function`, asks every caller to pass `use_reentrant`, and recommends `False`.
#
# ## 5. FSDP: sharded parameters, checkpointed activations
#
# DDP keeps a full copy of the parameters on every rank. FSDP (here the current API,
# `torch.distributed.fsdp.fully_shard`, "FSDP2") keeps only a **shard** of each parameter per rank,
# gathers a block's full parameters just before its forward (and again before its backward), and
# frees them afterwards; gradients are reduce-scattered back to shards. It runs on CPU with gloo in
# torch 2.13. FSDP shards *parameters*; the *activations* a rank keeps for backward depend on its
# batch, and that is what checkpointing reduces. The two combine:

# %%
show_source(distributed.shard_model, start="    if checkpointed")

# %% [markdown]
# `checkpoint_wrapper` accepts any `checkpoint_fn(module, *args)`, so `ckpt_lab.checkpoint` goes in
# unchanged. Order matters: checkpoint inside, shard outside. FSDP's pre-backward hook, which
# gathers a block's parameters, fires on the block's output gradient, before the checkpoint's
# recomputation needs them. The worker `fsdp_train_steps` trains 3 steps (2 ranks × 64 samples,
# width 64, float64), compares with a single-process reference, then measures one more forward's
# [retained](glossary.md#retained) bytes on each rank (`measure_memory`).
#
# **Predict.** Without checkpointing a rank keeps 7 block-sized tensors (64 × 64 float64, 32,768
# bytes) and 1,024 bytes more. With `ckpt_lab.checkpoint` around each of the 3 blocks, how many
# block-sized tensors does it keep?

# %%
guess = None  # your guess: a number

# %%
fsdp = {flag: run_workers(fsdp_train_steps, timeout=120, checkpointed=flag) for flag in (False, True)}
block_tensor = 64 * 64 * 8
reveal(guess, (fsdp[True][0].retained_bytes - 1024) // block_tensor, "block-sized tensors kept, checkpointed")
print(f"{'':20} {'rank':5} {'params=ref':11} {'grads=ref':10} {'param bytes':>12} {'retained bytes':>15} "
      f"block forwards")
for checkpointed, results in fsdp.items():
    for rank, r in enumerate(results):
        label = "ckpt_lab.checkpoint" if checkpointed else "no checkpoint"
        print(f"{label:20} {rank:<5} {r.params_match_reference!s:11} {r.grads_match_reference!s:10} "
              f"{r.local_param_bytes:>12,} {r.retained_bytes:>15,} {r.block_forwards}")
        assert r.params_match_reference and r.grads_match_reference
single = fsdp[False][0]
print(f"one process, whole batch: param bytes {single.full_param_bytes:,}, "
      f"retained bytes {single.single_process_retained_bytes:,}")

# %% [markdown]
# Reading the numbers:
#
# * **Gradients and parameters** equal the single-process reference on both ranks, with and without
#   `ckpt_lab.checkpoint`.
# * **Parameters are sharded**: the ranks' shards add up to the model's 102,920 bytes, about half
#   each. FSDP2 splits every parameter along dim 0; the head has a single output row (512 bytes of
#   weight, 8 of bias), which lands on rank 0: hence the 520 bytes of difference.
# * **Activations are not sharded, but split by batch**: without checkpointing a rank keeps half of
#   what one process keeps for the whole batch: 230,400 bytes = 7 block-sized tensors (each block's
#   input and `tanh` output, and the head's input) + 1,024 bytes (the head's 64 × 1 output, and the
#   loss, whose storage `mse_loss` allocates at its input's size). With `ckpt_lab.checkpoint` a
#   block keeps only its input: 4 block-sized tensors remain (the three blocks' inputs, and the last
#   block's output, which the head saves), 132,096 bytes. The price: the first block ran twice.

# %%
for results in fsdp.values():
    assert sum(r.local_param_bytes for r in results) == results[0].full_param_bytes
for rank in range(2):
    plain, checkpointed = fsdp[False][rank], fsdp[True][rank]
    assert plain.retained_bytes == 7 * block_tensor + 1024
    assert checkpointed.retained_bytes == 4 * block_tensor + 1024
    assert 2 * plain.retained_bytes == plain.single_process_retained_bytes
    assert (plain.block_forwards, checkpointed.block_forwards) == (1, 2)
print("retained per rank, no checkpoint / checkpointed:",
      f"{fsdp[False][0].retained_bytes:,} / {fsdp[True][0].retained_bytes:,} bytes",
      f"({fsdp[True][0].retained_bytes / fsdp[False][0].retained_bytes:.0%})")

fig, ax = plt.subplots(figsize=(7, 2))
plot_memory_bars(ax, {
    "one process, batch 128": single.single_process_retained_bytes,
    "FSDP rank 0, batch 64": fsdp[False][0].retained_bytes,
    "FSDP rank 0 + ckpt_lab.checkpoint": fsdp[True][0].retained_bytes,
}, "activations kept for backward (bytes created in forward, alive at its end)")
save_figure(fig, "06_fsdp_memory_per_rank")
plt.show()

# %% [markdown]
# What the instrument sees: FSDP allocates the buffers it gathers parameters into in the first step,
# then only resizes their storages, which `LiveMemory` does not count as new; a block's gathered
# buffer is freed after its forward. What remains is activations, what we wanted to measure.
#
# ## 6. What would a GPU change?
#
# Nothing here needed one: gloo implements every collective DDP and FSDP2 use here, `fully_shard`
# accepts a CPU device mesh, and the byte counts are storage sizes, the same on any device. A GPU
# adds the NCCL backend, communication overlapped on CUDA streams, FSDP's mixed precision and
# offload, and allocator-level numbers (`torch.cuda.max_memory_allocated`, which `measure_memory`
# also reports on CUDA). The reducer's rule and the nested backward of §3–§4 are the same on every
# device.
#
# ## Summary
#
# | question | answer | shown by |
# |---|---|---|
# | Does checkpointing change DDP's result? | no: equal to one process on the whole batch, bitwise equal to DDP without checkpointing | §1, 6 strategies |
# | When does the reentrant checkpoint break DDP? | `find_unused_parameters=True` or tied weights: "marked as ready twice"; torch (2.11 to 2.14.1) picks it when `use_reentrant` is omitted | §2, 4 of 4 runs |
# | Why? | its node hides the block's parameters from DDP's walk, and each nested backward fires their hooks again | §3; replay = DDP in 18 of 18 configurations |
# | Why not the non-reentrant checkpoint or the scope? | the ordinary graph: all parameters reachable, one firing each, in the outer backward | §3 |
# | The fixes? | the non-reentrant checkpoint, or `static_graph=True` (DDP learns the counts) | §4 |
# | FSDP2 with `ckpt_lab.checkpoint`? | checkpoint inside, shard outside; per rank, parameters halved, activations 230,400 → 132,096 bytes | §5 |
# | Workers from a notebook? | importable functions, a fork server, gloo on `127.0.0.1`; errors with their traceback, hangs killed | Appendix |
#
# ## Appendix: the process launcher
#
# *Optional: how `run_workers` (`ckpt_lab/helpers/processes.py`, a notebook helper that knows
# nothing of DDP) starts processes from a notebook.* It starts `world_size` processes, joins them in
# a gloo group (rank 0 listens on `127.0.0.1` and a free port), runs `fn(rank, world_size, **kwargs)`
# in each and returns their results in rank order. Three details matter in a notebook:
#
# * **How workers start.** A worker must not inherit the notebook's process (threads, half-run
#   cells): it starts clean and finds `fn` by module and name, which is why `fn` must live in a
#   module. `spawn` would do, but costs an `import torch` per worker per call (about 5 s each here);
#   a `forkserver` imports torch once, then forks clean workers in milliseconds.
# * **Failures.** A worker's exception is sent to the parent with its traceback *before* the worker
#   leaves the group (leaving breaks its peers' connections, and their errors would arrive first).
#   The parent then stops the other workers, which may wait for the failed one forever, and raises.
# * **Quiet.** Workers write to the notebook kernel's file descriptors; they capture what they print
#   (torch's warnings, gloo's messages) and show it only in an error.
#
# A deadline covers the whole run; the parent's loop, until every rank has reported or one failed:

# %%
show_source(run_workers, start="while inbox.pending() and not", stop="        if inbox.failures")

# %% [markdown]
# The smallest collective, `sum_of_ranks`: each rank contributes its rank number to an `all_reduce`,
# and every rank gets the total back. (The first call of the notebook started the fork server.)

# %%
print("2 ranks, each returns:", run_workers(sum_of_ranks, world_size=2))
print("3 ranks, each returns:", run_workers(sum_of_ranks, world_size=3))

# %% [markdown]
# Failures must be loud and must not hang. `fail_on_rank` lets rank 1 fail while rank 0 waits for
# it in a `barrier`, which on its own it would never leave, in three ways: raise, die without a
# word (as with a segfault or the OOM killer), or hang.

# %%
def failure_of(how, **options):
    """Run fail_on_rank; return the exception run_workers raised (None if it returned)."""
    try:
        run_workers(fail_on_rank, how=how, **options)
    except (WorkerError, TimeoutError) as error:
        return error
    return None


raised, died, hung = failure_of("raise"), failure_of("exit"), failure_of("hang", timeout=3)
assert isinstance(raised, WorkerError) and isinstance(died, WorkerError) and isinstance(hung, TimeoutError)
print(f"how='raise': WorkerError on rank {raised.rank}: {raised.failures[raised.rank]}")
print("             traceback names fail_on_rank:", "in fail_on_rank" in raised.worker_traceback)
print(f"how='exit':  WorkerError on rank {died.rank}: {died.failures[died.rank]}")
print("how='hang':  TimeoutError:", hung)

# %% [markdown]
# In each case rank 0, stuck in the barrier, was stopped by the launcher; in the last, both were
# killed after 3 s. (`tests/test_distributed.py` also checks that the processes are really gone and
# that each worker destroys its process group, on success and on failure alike.)
