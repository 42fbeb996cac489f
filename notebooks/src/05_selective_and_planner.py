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
# # 05 · Choosing what to keep: selective recomputation and a memory-budget planner
#
# **TL;DR.** In a transformer block the matmul outputs are a third of the bytes a checkpoint could
# keep but 98% of the FLOPs it would redo. [SAC](glossary.md#sac) (a checkpoint whose *policy*
# decides, op by op, whether to keep an op's output) keeps them: 416 KiB kept instead of 994, for 3%
# of a plain checkpoint's recomputation. In-place, view and random ops run again whatever the policy
# says (torch 2.13's SAC gets kept random ops silently wrong). For a byte budget, what to keep is a
# 0/1 knapsack, solved exactly; measured bytes and FLOPs equal the plan's.
#
# **After this notebook you can**
#
# 1. write a per-op policy and say what runs when (checked: §2.2's prediction and assert; exercise 05);
# 2. explain why in-place, view and random ops must run again (checked: §2.1, §2.3);
# 3. choose what to keep for a byte budget, exactly, and check it by measurement (checked: §4's
#    asserts; exercise 05);
# 4. say where a policy saves nothing, and what an enclosing offload sees of SAC's cache (checked:
#    §3.1's prediction; §6);
# 5. spot and fix BatchNorm's double update (checked: §7's assert).
#
# Shown on torch 2.13.0; where 2.11, 2.14.1 or 2.15.0 differ, the section says so (the site's "Torch
# versions" page). All eager: the compiler's budgets, global (`activation_memory_budget`, private
# `torch._functorch.config`) and per region (`region_activation_memory_budget`, a prototype that
# refuses eager code, below), are [notebook 08](08_compiler_checkpointing.ipynb)'s.

# %%
import functools
import itertools
import random

import matplotlib.pyplot as plt
import torch
from matplotlib.colors import ListedColormap
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ckpt_lab import CheckpointError, bench, checkpoint, measure_memory, planner, reentrant_checkpoint
from ckpt_lab.batchnorm import skip_stats_update_in_recompute
from ckpt_lab.bench import pareto
from ckpt_lab.helpers.predict import reveal
from ckpt_lab.helpers.show import show_source
from ckpt_lab.helpers.tensors import all_equal as same
from ckpt_lab.helpers.viz import save_figure
from ckpt_lab.instruments.counting import OpCounter
from ckpt_lab.offload import offload_to_cpu
from ckpt_lab.planner import CostCounter, budget_range, plan_sequential, profile, solve
from ckpt_lab.scope import gradient_checkpoint_scope
from ckpt_lab.selective import SaveMode, must_rerun, selective_checkpoint

print("torch", torch.__version__)
try:
    torch.autograd.graph.region_activation_memory_budget(0.5)
except RuntimeError as error:
    print("RuntimeError:", error)


# %%
def torch_sac(function, *args, policy):
    """torch's selective checkpointing (SAC), use_reentrant spelled out."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    return torch_checkpoint(function, *args, use_reentrant=False, context_fn=context_fn)
def grads_of(forward, leaves):
    """Gradients of forward().square().mean() w.r.t. leaves, dropout drawing the same masks every time."""
    for t in leaves:
        t.grad = None
    torch.manual_seed(1)
    forward().square().mean().backward()
    return [t.grad.clone() for t in leaves]


# %% [markdown]
# ## 1 · What a transformer block is made of
#
# A small `nn.TransformerEncoderLayer` (d_model 64, 4 heads, feed-forward 256, dropout 0.1; 4
# sequences of 32 tokens). `planner.profile` runs it once and notes, per
# [aten op](glossary.md#aten-op), the bytes of new [storage](glossary.md#storage) its output owns
# and its cost to recompute (FLOPs for matmuls, one per element otherwise). A *candidate* is an op a
# policy can really choose: not a view, in place, random, or filled in place later.

# %%
torch.manual_seed(0)
block = nn.TransformerEncoderLayer(64, 4, dim_feedforward=256, dropout=0.1, batch_first=True).train()
x = torch.randn(4, 32, 64, requires_grad=True)
leaves = [x, *block.parameters()]
prof = profile(block, x)
shown, cands = [r for r in prof.ops if r.nbytes or r.cost], prof.candidates
mms = [r for r in cands if r.op.overloadpacket.__name__ in ("mm", "addmm", "bmm")]
kind = {r.index: "other candidate" for r in cands} | {r.index: "matmul" for r in mms}
cb, cc = sum(r.nbytes for r in cands), sum(r.cost for r in cands)
print(f"{len(prof.ops)} ops, {len(shown)} own bytes or cost FLOPs, {len(cands)} are candidates ({cb} bytes, "
      f"{cc:.0f} FLOPs); matmuls: {sum(r.nbytes for r in mms) / cb:.0%} of those bytes, "
      f"{sum(r.cost for r in mms) / cc:.0%} of those FLOPs; block input {prof.input_bytes} bytes")

# %%
fig, (ax_b, ax_c) = plt.subplots(2, 1, figsize=(12, 5.5), sharex=True)
KINDS = {"matmul": "tab:red", "other candidate": "tab:blue", "runs again anyway": "tab:gray"}
for name, colour in KINDS.items():
    ops = [(i, r) for i, r in enumerate(shown) if kind.get(r.index, "runs again anyway") == name]
    ax_b.bar([i for i, _ in ops], [r.nbytes / 1024 for _, r in ops], color=colour, label=name)
    ax_c.bar([i for i, _ in ops], [r.cost / 1e6 for _, r in ops], color=colour)
ax_b.set(ylabel="output KiB (to keep)", title="one TransformerEncoderLayer, op by op in forward order")
ax_c.set_ylabel("MFLOPs (to recompute)")
ax_c.set_xticks(range(len(shown)), [f"{r.index} {r.op.overloadpacket.__name__}" for r in shown], rotation=90)
ax_b.legend(loc="upper left", fontsize=8)
save_figure(fig, "05_ops")

# %% [markdown]
# Red bars: a third of the candidate bytes, nearly all of the FLOPs: the "save the matmuls" policy
# of torch's SAC examples and torchtitan (after Korthikanti et al. 2022). Grey ops (dropout's) run
# again whatever a policy says.
#
# ## 2 · Selective checkpointing
#
# One `TorchDispatchMode` (notebook 04; from the private module `torch.utils._python_dispatch`,
# its only home) asks the policy about each op in the forward and caches what it keeps; a second
# serves those in the recomputation. Both reach `ckpt_lab.checkpoint` (notebook 03b) through
# `context_fn`, as with torch's checkpoint.
#
# ### 2.1 · A first draft (it falls short)


# %%
def draft_selective(function, x, policy):
    cache, position = [], itertools.count()
    class Save(TorchDispatchMode):
        """DRAFT, forward: cache the outputs of the ops the policy names, in order."""
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is not torch.ops.aten.detach.default:
                cache.append(out.detach() if policy(None, func) else None)
            return out
    class Serve(TorchDispatchMode):
        """DRAFT, recomputation: return the cached output instead of running the op."""
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.detach.default:
                return func(*args, **(kwargs or {}))
            cached = cache[next(position)]
            return cached.detach() if cached is not None else func(*args, **(kwargs or {}))
    return checkpoint(function, x, context_fn=lambda: (Save(), Serve()))


# %% [markdown]
# "Save the matmuls" on the block works. Two small functions: `two_draws` keeps its first random
# draw; `in_place` keeps `mul_(2)`.

# %%
def two_draws(v):
    return (v.sin() * torch.rand_like(v)).cos() * torch.rand_like(v)
def in_place(v):
    h = v.sin().mul_(2)
    return h * h
def keep_first(packet):
    """Policy (torch's signature): keep the first op of this family (True = save), recompute the rest."""
    seen = []
    def policy(ctx, op, *args, **kwargs):
        seen.append(op.overloadpacket)
        return op.overloadpacket is packet and seen.count(packet) == 1
    return policy
MATMULS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default]
expected = grads_of(lambda: block(x), leaves)
matmul_draft = grads_of(lambda: draft_selective(block, x, lambda ctx, op: op in MATMULS), leaves)
print("draft, block, keep matmuls == no checkpointing:", same(matmul_draft, expected))
v = torch.randn(1000, requires_grad=True)
for fn, packet in ((two_draws, torch.ops.aten.rand_like), (in_place, torch.ops.aten.mul_)):
    plain = grads_of(lambda fn=fn: fn(v), [v])
    draft = grads_of(lambda fn=fn, packet=packet: draft_selective(fn, v, keep_first(packet)), [v])
    print(f"draft, {fn.__name__}, keep {packet.__name__} == no checkpointing: {same(draft, plain)}", end="")
    print(f" ({(draft[0] != plain[0]).sum().item()} of 1000 differ)")

# %% [markdown]
# Wrong, silently, in every element:
#
# * **Random ops.** The re-run restores the forward's RNG state, *skips* the served first
#   `rand_like`, and the second draws what the first drew in the forward.
# * **In-place ops.** Served instead of run, `mul_` never doubles the re-run's `h`.
# * **Views** must alias the re-run's tensors; and a tensor a later op fills in place (`empty_like`
#   before `bernoulli_`) is no longer the op's output.
#
# ### 2.2 · The package's version, and what runs when
#
# `ckpt_lab.selective_checkpoint` asks the policy (torch's signature, `policy(ctx, op, *args,
# **kwargs)`) about every op, but runs three kinds of op again whatever it answers:

# %%
show_source(must_rerun, start="if op._schema")

# %% [markdown]
# The forward mode keeps a detached alias of what the policy saves, unless `must_rerun` says no:

# %%
show_source(SaveMode, start="self.cache.policy", stop="return out")

# %% [markdown]
# In the recomputation `ServeMode` checks each op against the forward's (appendix A) and serves
# the cached entry instead of running it.
#
# **What runs when.** A small MLP block (`mm`, `gelu`, dropout, `mm`), a policy that keeps the
# first `mm` and notes when it is asked, and a dispatch mode *outside* the checkpoint that logs
# each op that really runs. Both spot backward with `torch._C._current_graph_task_id()` (private
# API: the one way to ask whether a [graph task](glossary.md#graph-task) runs):

# %%
PHASE = {(True, False): "forward", (True, True): "recompute", (False, True): "backward"}
class Trace(TorchDispatchMode):
    """Every aten op that really runs, with its phase (ops outside the block and backward: not logged)."""
    events, in_block = [], False
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        phase = PHASE.get((self.in_block, torch._C._current_graph_task_id() != -1))
        if phase and func not in SAC_IGNORED_OPS:
            self.events.append((phase, func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))
trace, asked = Trace(), []
torch.manual_seed(0)
w1, w2, h0 = (torch.randn(*shape, requires_grad=True) for shape in ((16, 64), (64, 16), (8, 16)))
def mlp_block(h):
    trace.in_block = True
    try:
        return nn.functional.dropout(nn.functional.gelu(h @ w1), 0.1, training=True) @ w2
    finally:  # also when the recomputation stops early (by raising)
        trace.in_block = False
def save_first_mm(ctx, op, *args, **kwargs):
    asked.append("backward" if torch._C._current_graph_task_id() != -1 else "forward")
    return op is torch.ops.aten.mm.default and len(asked) == 1  # the block's first op


# %% [markdown]
# **Predict.** The forward asks the policy about each of the block's ops. How many times is it
# asked during backward, when the block runs again?

# %%
guess = None  # your guess: a number

# %%
with trace:
    selective_checkpoint(mlp_block, h0, policy=save_first_mm).sum().backward()
reveal(guess, asked.count("backward"), "policy calls during backward")
forward = [name for phase, name in trace.events if phase == "forward"]
recomputed = [name for phase, name in trace.events if phase == "recompute"]
assert recomputed == forward[1 : 1 + len(recomputed)]  # op 0 served, the next ones re-run in order
fate = ["served"] + ["re-run"] * len(recomputed) + ["not re-run"] * (len(forward) - 1 - len(recomputed))
print(f"policy asked {asked.count('forward')} times in forward; recomputation:",
      ", ".join(f"{n} {f}" for n, f in zip(forward, fate, strict=True)))

# %%
LANE = {"forward": 2, "recompute": 1, "backward": 0}
COLOUR = {"kept": "tab:red", "forward": "tab:blue", "re-run": "tab:orange", "backward": "tab:blue"}
boxes = []  # (lane, op, what happened) in time order; the recomputation drawn op by op against the forward
for n, (phase, name) in enumerate(trace.events):
    if phase != "recompute":
        boxes.append((phase, name, "kept" if n == 0 else phase))
    elif trace.events[n - 1][0] != "recompute":
        boxes += [("recompute", op, f) for op, f in zip(forward, fate, strict=True)]
fig, ax = plt.subplots(figsize=(12, 2.8))
for t, (lane, name, what) in enumerate(boxes):
    ran = what in COLOUR
    ax.bar(t, 0.8, bottom=LANE[lane] - 0.4, color=COLOUR.get(what, "w"), ec="k", ls="-" if ran else "--")
    ax.text(t, LANE[lane], name if ran else f"{name}\n{what}", rotation=90, ha="center", va="center", size=7)
ax.set_yticks([2, 1, 0], ["forward:\npolicy decides", "backward:\nre-run the block", "backward:\ngradients"])
ax.set(xlabel="time (op by op)",
       title="keep the first mm: red = kept in forward, orange = recomputed in backward, dashed = not run")
save_figure(fig, "05_what_runs_when")

# %% [markdown]
# The kept `mm` is *served*, `gelu` and dropout *run again* (orange), the last `mm` never runs (the
# re-run stops once every saved tensor is filled, notebook 03b). Ours asks the policy in the forward
# only, on every torch; so does torch's SAC on 2.13 and 2.14.1 (`ctx.is_recompute` always False).
# torch 2.11's asks again in the recomputation (`ctx.is_recompute=True`): a policy with a counter
# behaves differently there (notebook 07 §6).
#
# ### 2.3 · The two failing cases, ours and torch's SAC


# %%
for fn, packet in ((two_draws, torch.ops.aten.rand_like), (in_place, torch.ops.aten.mul_)):
    plain = grads_of(lambda fn=fn: fn(v), [v])
    for name, sac in (("ckpt_lab.selective_checkpoint", selective_checkpoint), ("torch SAC", torch_sac)):
        try:
            got = grads_of(lambda fn=fn, packet=packet, sac=sac: sac(fn, v, policy=keep_first(packet)), [v])
            print(f"{fn.__name__}, keep {packet.__name__}, {name:<29} == no checkpointing:", same(got, plain))
        except RuntimeError as error:
            print(f"{fn.__name__}, keep {packet.__name__}, {name:<29} raises RuntimeError: {error}")

# %% [markdown]
# Ours is right in both. torch 2.13's SAC refuses the in-place case (its cache checks version
# counters) but serves the first draw: wrong gradients, silently (`tests/test_selective.py`).
#
# ## 3 · The same policy, ours and torch's
#
# "Save the matmuls" on the transformer block: gradients, bytes kept
# ([retained](glossary.md#retained), `measure_memory`) and FLOPs recomputed (`CostCounter`).

# %%
def step_cost(forward):
    torch.manual_seed(1)
    with CostCounter() as counter:
        forward().square().mean().backward()
    return counter.total
def retained(forward):
    torch.manual_seed(1)
    return measure_memory(lambda: forward().square().mean()).retained_bytes
runs = {"no checkpointing": lambda: block(x), "ckpt_lab.checkpoint": lambda: checkpoint(block, x),
        "torch SAC, save matmuls": lambda: torch_sac(block, x, policy=MATMULS),
        "ckpt_lab SAC, save matmuls": lambda: selective_checkpoint(block, x, policy=MATMULS)}
base_cost = step_cost(runs["no checkpointing"])
table = {name: (same(grads_of(run, leaves), expected), retained(run), step_cost(run) - base_cost)
         for name, run in runs.items()}
print(f"{'':<28} {'grads ok':>8} {'retained KiB':>13} {'recompute kFLOPs':>17}")
for name, (ok, kept, cost) in table.items():
    print(f"{name:<28} {ok!s:>8} {kept / 1024:>13.1f} {cost / 1000:>17.1f}")
assert table["torch SAC, save matmuls"] == table["ckpt_lab SAC, save matmuls"]
sac_share = table["ckpt_lab SAC, save matmuls"][2] / table["ckpt_lab.checkpoint"][2]
print(f"saving the matmuls recomputes {sac_share:.1%} of what the plain checkpoint recomputes")

# %% [markdown]
# Identical to the byte and to the FLOP. What is still recomputed is pointwise work.
#
# ### 3.1 · Where selective checkpointing saves nothing
#
# Where *any* checkpoint saves nothing (around the whole model, the last stage, inputs the caller
# keeps) is [notebook 02, §9](02_reentrant_checkpoint.ipynb#9.-Where-checkpointing-saves-nothing).
# A policy adds its own cases: a kept output costs its bytes whether or not autograd would save it.
#
# **Predict.** The policy "save everything" on the block keeps more bytes than no checkpointing,
# fewer, or the same?

# %%
guess = None  # your guess: "more", "fewer" or "the same"

# %%
save_all = retained(lambda: selective_checkpoint(block, x, policy=lambda ctx, op, *a, **k: True))
plain = table["no checkpointing"][1]
reveal(guess, "more" if save_all > plain else "fewer" if save_all < plain else "the same", "save everything")
print(f"block: policy 'save everything' {save_all / 1024:.1f} KiB, no checkpointing {plain / 1024:.1f} KiB")
torch.manual_seed(0)
linears = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(4)))
lin_runs = {"none": lambda: linears(x), "plain checkpoint": lambda: checkpoint(linears, x),
            "SAC, save matmuls": lambda: selective_checkpoint(linears, x, policy=MATMULS)}
print("4 Linear layers:", ", ".join(f"{k} {retained(r) / 1024:.1f} KiB" for k, r in lin_runs.items()))

# %% [markdown]
# Saving everything keeps outputs autograd would never save (a `clone`, a residual `add`). A block
# made only of the ops you keep (Linear layers, "save the matmuls") keeps every activation: no
# checkpointing's 128 KiB, against 32 KiB for the plain checkpoint.
#
# ## 4 · A memory-budget planner
#
# Given a *budget* (bytes the forward may keep for backward), which outputs to keep? Keeping op
# *i* costs its bytes and saves its recomputation, independently of the others: a 0/1 knapsack,
#
# maximise $\sum_{i \in S} c_i$ subject to $\mathrm{inputs} + \sum_{i \in S} b_i \le \mathrm{budget}$ ($c$: cost, $b$: nbytes).
#
# `solve_greedy` keeps the best cost per byte first; `solve_dp` is exact: a dynamic program over
# bytes, in units of the sizes' greatest common divisor. Its core:

# %%
show_source(planner.solve_dp, start="best = np.zeros", stop="# Walk back")

# %% [markdown]
# Against brute force (every subset), 300 random problems of up to 12 items (as
# `tests/test_planner.py` does under hypothesis):

# %%
SOLVERS = (planner.solve_greedy, planner.solve_dp, planner.solve_brute_force)
rng, agree, greedy_worse = random.Random(0), 0, 0
for _ in range(300):
    items = [(i, 4 * 2 ** rng.randint(0, 10), float(rng.randint(0, 1000))) for i in range(rng.randint(1, 12))]
    capacity = rng.randint(0, 8000)
    value = {s: sum(c for k, _, c in items if k in s(items, capacity)) for s in SOLVERS}
    agree += value[planner.solve_dp] == value[planner.solve_brute_force]
    greedy_worse += value[planner.solve_greedy] < value[planner.solve_dp]
print(f"DP optimal in {agree}/300; greedy below the optimum in {greedy_worse}/300")

# %% [markdown]
# ### Planning a stack
#
# One region per block keeps each block's input; the planner spends the rest of the budget across
# all blocks. Calling the `Plan` runs one `selective_checkpoint` per block. Four transformer blocks,
# five budgets from plain checkpointing to every candidate; each plan is run and its retained bytes
# measured in the budget's terms (plus the first input, minus output and loss).

# %%
torch.manual_seed(0)
blocks = [nn.TransformerEncoderLayer(64, 4, 256, 0.1, batch_first=True).train() for _ in range(4)]
stack_leaves = [x, *(p for b in blocks for p in b.parameters())]
run_stack = nn.Sequential(*blocks)
profiles = planner.profile_sequential(blocks, x)
minimum, maximum = budget_range(profiles)
print(f"minimum budget {minimum / 1024:.0f} KiB (block inputs), everything kept {maximum / 1024:.0f} KiB")
stack_expected = grads_of(lambda: run_stack(x), stack_leaves)
OUTPUT_BYTES = run_stack(x).detach().nbytes
stack_base = step_cost(lambda: run_stack(x))

# %%
plans, rows = {}, ["budget KiB | dp: kept     KiB  MFLOPs | greedy: kept     KiB  MFLOPs"]
for fraction in (0.0, 0.1, 0.25, 0.5, 1.0):
    budget = int(minimum + fraction * (maximum - minimum))
    row = f"{budget / 1024:>10.0f}"
    for method, w in (("dp", 8), ("greedy", 12)):
        p = plans[method, fraction] = solve(profiles, budget, method)
        measured = retained(lambda p=p: p(x)) + x.nbytes - OUTPUT_BYTES - 4
        cost = step_cost(lambda p=p: p(x)) - stack_base
        ok = same(grads_of(lambda p=p: p(x), stack_leaves), stack_expected)
        assert measured == p.retained_bytes <= budget and cost == p.recompute_cost and ok
        row += f" | {len(p.saved_ops):>{w}} {p.retained_bytes / 1024:>7.1f} {p.recompute_cost / 1e6:>7.2f}"
    rows.append(row)
print(*rows, sep="\n")
print("every plan: measured bytes and FLOPs == predicted, within budget, gradients == no checkpointing")
extra = plans["greedy", 0.1].recompute_cost / plans["dp", 0.1].recompute_cost - 1
print(f"at {plans['dp', 0.1].budget / 1024:.0f} KiB greedy recomputes {extra:.1%} more than the exact plan")

# %% [markdown]
# Measured equals predicted, to the byte and the FLOP; the first ~1.2 MiB above plain
# checkpointing buy back almost all of the recomputation. **What each plan keeps** (top: the FLOPs
# each of a block's candidates saves if kept, and its bytes; below, per plan, one row per block: red
# where kept), and what one plan keeps that the other does not (block·op):

# %%
# The four blocks are alike: one axis of 22 candidates serves them all (asserted), one row per block.
cands = profiles[0].candidates
assert all([(r.op, r.nbytes, r.cost) for r in p.candidates] == [(r.op, r.nbytes, r.cost) for r in cands]
           for p in profiles)
shown_plans, at = [plans["dp", 0.1], plans["greedy", 0.1], plans["dp", 0.25]], range(len(cands))
fig, axes = plt.subplots(2 + len(shown_plans), 1, figsize=(10, 9), sharex=True, layout="constrained",
                         height_ratios=[1.2, 1, 1, 1, 1])
axes[0].bar(at, [r.cost / 1e6 for r in cands], color="tab:purple", log=True)
axes[0].set(ylabel="MFLOPs saved\nif kept",
            title=f"the {len(cands)} candidates of each block, in forward order")
axes[1].bar(at, [r.nbytes / 1024 for r in cands], color="tab:gray")
axes[1].set(ylabel="KiB kept\nif kept")
for ax, p in zip(axes[2:], shown_plans, strict=True):
    kept = [[r.index in p.saved[b] for r in cands] for b in range(len(blocks))]
    ax.imshow(kept, cmap=ListedColormap(["silver", "tab:red"]), aspect="auto", vmin=0, vmax=1)
    ax.set_yticks(range(len(blocks)), [f"block {b}" for b in range(len(blocks))])
    ax.set_title(f"{p.method}, budget {p.budget / 1024:.0f} KiB: red = kept ({sum(map(sum, kept))} ops), "
                 f"grey = recomputed; {p.recompute_cost / 1e6:.2f} MFLOPs recomputed", fontsize=10)
axes[-1].set_xticks(at, [r.op.overloadpacket.__name__ for r in cands], rotation=60, ha="right", size=9)
save_figure(fig, "05_plans")
plt.show()
for p, q in (shown_plans[:2], shown_plans[1::-1]):  # what dp keeps that greedy does not, and back
    extra = [(b, p.profiles[b].ops[i]) for b, ks in enumerate(p.saved) for i in sorted(ks - q.saved[b])]
    kib, mflops = sum(r.nbytes for _, r in extra) / 1024, sum(r.cost for _, r in extra) / 1e6
    names = [f"{b}·{r.op.overloadpacket.__name__}" for b, r in extra]
    print(f"at {p.budget // 1024} KiB only {p.method} keeps {names}: {kib:.0f} KiB, {mflops:.2f} MFLOPs")

# %% [markdown]
# Matmul outputs and the blocks' last layer norm (1 KiB) come first. At 628 KiB three matmul
# outputs per block (32, 96, 128 KiB) tie on FLOPs per byte; greedy fills the room with four 32 KiB
# ones, the exact plan keeps block 0's 128 KiB `addmm` and recomputes 0.52 MFLOPs less. The plan
# also runs under torch's checkpoint (`Plan.torch_context_fn`):

# %%
quarter = plans["dp", 0.25]
def run_stack_torch(v, p=quarter):
    for i, b in enumerate(blocks):
        v = torch_checkpoint(b, v, use_reentrant=False, context_fn=p.torch_context_fn(i))
    return v
torch_planned = grads_of(lambda: run_stack_torch(x), stack_leaves)
print("torch checkpoint with the plan == no checkpointing:", same(torch_planned, stack_expected))

# %% [markdown]
# **What the model leaves out.** The budget bounds the [retained](glossary.md#retained) bytes, not
# the [peak](glossary.md#peak); `ckpt_lab.peak_planner` budgets the peak ([notebook
# 07b](07b_explain_real_model.ipynb), "The peak, not the kept bytes"), as Checkmate (Jain et al.,
# MLSys 2020) does with an integer program over every tensor's lifetime. DTR (Kirisame et al., ICLR
# 2021) decides *online*, evicting the smallest `cost / (bytes × staleness)`; our plan is made once.
#
# **Your turn.** Write the knapsack solver and a selective policy that meets a budget in `exercises/05_selective_budget.py` (open it from the file browser); the cell below grades them with this notebook's instruments.

# %%
from ckpt_lab.exercises import check

check("05-selective-budget", "exercises/05_selective_budget.py")

# %% [markdown]
#
# ## 5 · The Pareto frontier
#
# The benchmark's stacks (four `TransformerEncoderLayer`s, d_model 256, 8 × 128 tokens; eight
# Linear(1024) + GELU + Dropout blocks, batch 64), each strategy measured as in §4: none,
# per-block, √N, "save the matmuls" (ours, torch's), the planner at six budgets per solver, offload:

# %%
workloads = {"transformer-4": bench.transformer(4), "mlp-8": bench.mlp(8)}
points = {name: pareto.measure_points(wl) for name, wl in workloads.items()}
frontiers = {name: pareto.exact_frontier(wl) for name, wl in workloads.items()}
for name, pts in points.items():
    planned = [p for p in pts if p.budget is not None]
    assert all(p.grads_ok for p in pts) and all(p.within_budget and p.as_planned for p in planned)
    print(f"{name}: {len(pts)} points, gradients == none; {len(planned)} plans, within budget, as predicted")

# %%
fig = pareto.plot(points, frontiers)
save_figure(fig, "05_frontier")

# %%
for name, pts in points.items():
    by = {p.strategy: p for p in pts}
    sac, block_ckpt, none = by["torch SAC (matmuls)"], by["per-block"], by["none"]
    keeps = sac.retained_bytes / none.retained_bytes
    removes = 1 - sac.recompute_flops / block_ckpt.recompute_flops
    print(f"{name}: save matmuls: {keeps:.0%} of none's memory, {removes:.1%} less recompute than per-block")
    planner_profiles = bench.planner_range(workloads[name].blocks, workloads[name].input).profiles
    for other in (sac, by["sqrt(N)"]):  # the planner, given exactly the memory SAC and sqrt(N) keep
        best = solve(planner_profiles, other.retained_bytes).recompute_cost
        flops = other.recompute_flops / 1e9
        print(f"  {other.strategy}: {flops:.4f} GFLOP recomputed; the planner, same memory: {best / 1e9:.4f}")

# %% [markdown]
# * **A staircase with a cliff.** On the transformer, the first ~50 MiB above plain checkpointing
#   (the matmul outputs) buy back almost all of the recomputation; "save the matmuls" (ours and
#   torch's, superposed) sits at the cliff's foot, on the frontier.
# * **√N segments** is off it: 4 blocks make 2 segments, the last unchecked.
# * **The planner's top end** keeps more than no checkpointing: every block stays a checkpoint.
# * **Under `torch.compile`** the partitioner makes this trade itself: [notebook
#   08](08_compiler_checkpointing.ipynb) puts its `activation_memory_budget` points on this picture.
#
# ## 6 · CPU offload
#
# Saved tensors go to host memory in the forward and come back in backward: no FLOPs, every byte
# over PCIe twice. `offload_to_cpu` is notebook 03's pack/unpack hook with pinned, non-blocking
# copies on CUDA, byte counts, leaves left in place; `include_cpu_tensors=True` is a dry run on CPU.

# %%
torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 256)).train()
u = torch.randn(64, 256, requires_grad=True)
mlp_leaves = [u, *mlp.parameters()]
mlp_expected = grads_of(lambda: mlp(u), mlp_leaves)
hooks = offload_to_cpu(include_cpu_tensors=True)
def offloaded():
    with hooks:
        return mlp(u)
print("gradients with offload == without:", same(grads_of(offloaded, mlp_leaves), mlp_expected))
print(f"moved to host: {hooks.tensors_moved} tensors, {hooks.bytes_moved / 1024:.0f} KiB; brought back: "
      f"{hooks.bytes_returned / 1024:.0f} KiB; kept on device: {hooks.tensors_kept} tensors "
      f"({hooks.bytes_kept / 1024:.0f} KiB: parameters, which stay alive anyway)")
PCIE_BYTES_PER_S = 25e9  # PCIe 4.0 x16, about 25 GB/s each way: out in forward, back in backward
print(f"estimated transfer: {2 * hooks.bytes_moved / PCIE_BYTES_PER_S * 1e6:.0f} µs per step for this MLP")

# %% [markdown]
# **Offload around SAC.** An enclosing hook sees what autograd saves (around SAC, the block's
# input), not SAC's cache, unless `respect_saved_tensors_hooks=True` (torch 2.14's keyword; ours
# accepts it on 2.13). `None` (default) and `False` bypass the hooks, as torch 2.13's SAC does;
# 2.14's bypasses too, but warns at `None` that a future release will not. §2.2's block, keeping
# both `mm`s:

# %%
sacs = {f"ckpt_lab, respect_saved_tensors_hooks={s}": functools.partial(
    selective_checkpoint, respect_saved_tensors_hooks=s) for s in (None, False, True)}
sacs["torch 2.13 SAC"] = torch_sac
for name, sac in sacs.items():
    with offload_to_cpu(include_cpu_tensors=True) as hooks:
        out = sac(mlp_block, h0, policy=[torch.ops.aten.mm.default])
    out.sum().backward()
    print(f"{name:<43} moved to host: {hooks.tensors_moved} tensors ({hooks.bytes_moved} bytes); "
          f"kept: {hooks.tensors_kept} ({hooks.bytes_kept} bytes, h0: a leaf)")

# %% [markdown]
# Only with `True` do the two cached `mm` outputs (2,048 + 512 bytes) move.
#
# ## 7 · The BatchNorm pitfall <a id="batchnorm"></a>
#
# In training mode every BatchNorm forward updates its buffers in place: `num_batches_tracked +=
# 1`, and the batch statistics blended into `running_mean` / `running_var`. A checkpoint runs the
# forward again in backward, so both happen twice. One step under each checkpoint and the scope
# (notebook 04), without and with the fix:


# %%
def one_step(wrap, fix=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 8)).train()
    if fix:
        skip_stats_update_in_recompute(model)
    grads = grads_of(lambda: wrap(model, torch.randn(16, 32, requires_grad=True)), list(model.parameters()))
    return model[1].num_batches_tracked.item(), model[1].running_mean.clone(), grads
def scoped(m, w):
    with gradient_checkpoint_scope():
        return m(w)
variants = {"no checkpointing": lambda m, w: m(w), "ckpt_lab.checkpoint": checkpoint,
            "ckpt_lab.reentrant_checkpoint": reentrant_checkpoint,
            "torch reentrant": lambda m, w: torch_checkpoint(m, w, use_reentrant=True),
            "torch non-reentrant": lambda m, w: torch_checkpoint(m, w, use_reentrant=False),
            "gradient_checkpoint_scope": scoped}
_, ref_mean, ref_grads = one_step(variants["no checkpointing"])
steps = {name: (one_step(wrap), one_step(wrap, fix=True)) for name, wrap in variants.items()}
print(f"{'':<30} batches mean / plain grads ok | fixed: batches mean ok grads ok")
for name, ((count, mean, grads), (fixed_count, fixed_mean, fixed_grads)) in steps.items():
    ratio = (mean / ref_mean).mean().item()  # the running mean starts at 0; each update: 0.1 of the gap
    print(f"{name:<30} {count:>7} {ratio:>12.2f} {same(grads, ref_grads)!s:>8} | "
          f"{fixed_count:>14} {torch.equal(fixed_mean, ref_mean)!s:>7} {same(fixed_grads, ref_grads)!s:>8}")
assert [s[0][0] for s in steps.values()] == [1, 2, 2, 2, 2, 1] and all(s[1][0] == 1 for s in steps.values())

# %% [markdown]
# All four checkpoints count two batches and move the running mean 1.9 times as far (0.1 of the
# batch mean, then 0.1 more of what is left). Gradients are unaffected (training mode normalises
# with the batch's statistics): no gradient test fails; the model evaluates worse later. The fix,
# `skip_stats_update_in_recompute(model)`: a training forward *inside backward* is a recomputation,
# so a pre-hook swaps in copies of the buffers and a post-hook (`always_call=True`) puts the real
# ones back, even when the recomputation stops early:

# %%
show_source(skip_stats_update_in_recompute, start="with _disable_current_modes", stop="def post_hook")

# %% [markdown]
# (`track_running_stats = False` is no fix: the non-reentrant checkpoints then refuse.) **The scope
# needs no fix**: it replays recorded ops, writing into copies of outside tensors (notebook 04b, §6).
#
# ## Summary
#
# | topic | answer | § |
# |---|---|---|
# | bytes, FLOPs | matmuls: 31% of the candidate bytes, 98% of the FLOPs | 1 |
# | what runs when | policy asked in forward only (torch 2.11's SAC: also in recompute) | 2.2 |
# | runs again anyway | in-place, view, random ops (torch 2.13's SAC: kept random wrong) | 2.1, 2.3 |
# | ours, torch's SAC | same 416 KiB, 3% of a plain checkpoint's recompute | 3 |
# | saves nothing | keeping everything (1282 > 994 KiB); a block of kept ops | 3.1 |
# | byte budget | exact knapsack (greedy 1.9% worse at 628 KiB); measured = predicted | 4 |
# | frontier | SAC on it; √N off it for few large blocks | 5 |
# | offload | no FLOPs; SAC's cache only with `respect_saved_tensors_hooks=True` | 6 |
# | BatchNorm | 2 batches per step under each checkpoint, 1 with the fix; scope: 1 | 7 |
# | kept output changed; 2nd backward | ours: one op more; `strict=True`: torch's errors | app. B |
#
# ---
#
# ## Appendix (optional)
#
# ### A · Refusals
#
# An overload family as a policy, a function that runs other ops when recomputed, a budget below
# the minimum, a plan used for another computation:

# %%
calls = itertools.count()
def moody(v):  # other ops when recomputed
    return v.sin().exp() if next(calls) == 0 else v.cos().exp()
blocks[2].eval()  # dropout off in one block: its ops change, and the quarter plan no longer fits
for attempt in (lambda: selective_checkpoint(block, x, policy=[torch.ops.aten.mm]),
                lambda: selective_checkpoint(moody, v, policy=[torch.ops.aten.sin.default]).sum().backward(),
                lambda: plan_sequential(blocks, x, budget=minimum - 1), lambda: quarter(x)):
    try:
        attempt()
    except (TypeError, ValueError, CheckpointError) as error:
        print(f"{type(error).__name__}: {error}")
_ = blocks[2].train()

# %% [markdown]
# ### B · `strict=True`: torch's errors where ours recomputes
#
# A kept output changed in place later in the forward, and a second backward: torch's SAC raises in
# both; ours runs the op again, or raises torch's error with `strict=True`:

# %%
keep_sin = {"policy": [torch.ops.aten.sin.default]}
def sin_ops_and_grad(fn, n, **sac):  # n backward passes through one forward: sin ops run, v's gradient
    v.grad, loss = None, (selective_checkpoint(fn, v, **sac) if sac else fn(v)).sum()
    with OpCounter() as ops:
        for _ in range(n):
            loss.backward(retain_graph=True)
    return ops.counts["sin"], v.grad.clone()
for case, fn, n in (("changed in place", lambda v: v.sin().mul_(2).cos().exp(), 1),
                    ("second backward", lambda v: v.sin().cos().exp(), 2)):
    (plain_ops, plain), (ops, grad) = sin_ops_and_grad(fn, n), sin_ops_and_grad(fn, n, **keep_sin)
    print(f"{case}, strict=False: gradient == no checkpointing: {torch.equal(grad, plain)},",
          f"sin ops {ops} vs {plain_ops}")
    try:
        sin_ops_and_grad(fn, n, **keep_sin, strict=True)
    except RuntimeError as error:
        print(f"{case}, strict=True: RuntimeError: {str(error).split(' (')[0].split('. ')[0]}")

# %% [markdown]
# The default: right gradients for one `sin` more, rather than an error mid-training (torch's way
# out, `allow_cache_entry_mutation=True`, serves the changed tensor). `strict=True` flags a policy
# that keeps an output the forward overwrites.
