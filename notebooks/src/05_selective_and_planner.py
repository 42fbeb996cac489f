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
# keep but 98% of the FLOPs it would redo. *Selective activation checkpointing* (**SAC**: a
# non-reentrant checkpoint that asks a *policy*, op by op, whether to keep the op's output) keeps
# them and recomputes the rest: 416 KiB kept instead of 994, for 3% of a plain checkpoint's
# recomputation. In-place, view and random ops run again whatever the policy says; torch 2.13's
# eager SAC gets kept random ops silently wrong. For a byte budget, "what to keep" is a 0/1
# knapsack, solved exactly; measured bytes and FLOPs equal the plan's. Under any checkpoint
# BatchNorm counts two batches per step; hooks fix it.
#
# | question | section |
# |---|---|
# | Which ops of a block hold the bytes, which the FLOPs? | 1 |
# | How does a per-op policy decide, and what runs when? | 2.2 |
# | Why must in-place, view and random ops run again? | 2.1, 2.3 |
# | Torch's SAC and ours: same bytes and FLOPs? Where is torch's wrong? | 2.3, 3 |
# | Where does selective checkpointing save nothing? | 3.1 |
# | What to keep for a byte budget? Greedy or exact? Checkmate and DTR? | 4 |
# | Where does each strategy sit on the memory/recompute frontier? | 5 |
# | What does CPU offload cost instead? | 6 |
# | Why does BatchNorm count two batches per step, and the fix? | 7 |
#
# All eager (torch's `activation_memory_budget` exists only under `torch.compile`: notebook 08); every number
# is bytes or FLOPs, the same on every machine.

# %%
import functools
import itertools
import random

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ckpt_lab import CheckpointError, bench, checkpoint, measure_memory, planner, reentrant_checkpoint
from ckpt_lab.batchnorm import skip_stats_update_in_recompute
from ckpt_lab.bench import pareto
from ckpt_lab.helpers.show import show_source
from ckpt_lab.helpers.viz import save_figure
from ckpt_lab.instruments.counting import OpCounter
from ckpt_lab.offload import offload_to_cpu
from ckpt_lab.planner import CostCounter, budget_range, plan_sequential, profile, solve
from ckpt_lab.selective import SaveMode, must_rerun, selective_checkpoint

print("torch", torch.__version__)


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
def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# %% [markdown]
# ## 1 · What a transformer block is made of
#
# A small `nn.TransformerEncoderLayer` (d_model 64, 4 heads, feed-forward 256, dropout 0.1; 4
# sequences of 32 tokens). `planner.profile` runs it once under a `TorchDispatchMode` and notes,
# per aten op, the bytes of *new* memory its output owns and its cost to compute again (torch's
# FLOPs for matmuls, one per element otherwise). A *candidate* is an op a policy can really
# choose: not a view, not in place, not random, not filled in place later.

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
# Red bars: a third of the candidate bytes, nearly all of the FLOPs. Keeping them is the "save
# the matmuls" policy of torch's SAC examples and torchtitan; Korthikanti et al. 2022
# (arXiv:2205.05198) recompute only attention's large, cheap intermediates and cut the overhead by
# over 90%. Grey ops (dropout's `empty_like`, `bernoulli_`, `div_`) run again whatever a policy says.
#
# ## 2 · Selective checkpointing
#
# To keep *some* outputs we must see each op: one `TorchDispatchMode` asks the policy about each op
# in the forward and caches what it keeps; a second serves those in the recomputation. Both reach
# `ckpt_lab.checkpoint` (notebook 03b) through `context_fn`, as with torch's checkpoint.
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
# "Save the matmuls" on the block works. Two small functions, each with a policy that keeps one
# op's output: `two_draws` keeps its first random draw; `in_place` keeps `mul_(2)`.

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
# * **Random ops.** The recomputation restores the forward's RNG state, then *skips* the served
#   first `rand_like`, so the second draws what the first drew in the forward.
# * **In-place ops.** Served instead of run, `mul_` never doubles the re-run's `h`.
# * **Views** must alias the re-run's tensors; a cached tensor that a later op fills in place
#   (`empty_like` before `bernoulli_`) is no longer the op's output.
#
# ### 2.2 · The package's version, and what runs when
#
# `ckpt_lab.selective_checkpoint` asks the policy about every op, with torch's signature
# `policy(ctx, op, *args, **kwargs)` (one policy drives both), but runs three kinds of op again
# whatever it answers:

# %%
show_source(must_rerun, start="if op._schema")

# %% [markdown]
# The forward mode keeps a detached alias of what the policy saves, unless `must_rerun` says no
# (it also notes each entry's version counter, to notice a later in-place change):

# %%
show_source(SaveMode, start="self.cache.policy", stop="return out")

# %% [markdown]
# Not shown: ops torch's SAC skips too (`detach`, metadata queries) are not asked about; entries a
# later in-place op changed are dropped. In the recomputation, `ServeMode` checks each op against
# the forward's (appendix A) and serves the cached entry instead of running it; backward frees it
# after use, like a recomputed tensor.
#
# **What runs when.** A small MLP block (`mm`, `gelu`, dropout, `mm`), a policy that keeps the
# first `mm` and notes when it is asked, and a `TorchDispatchMode` *outside* the checkpoint that
# logs each op that really runs (a served op never reaches it), with its phase:

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
with trace:
    selective_checkpoint(mlp_block, h0, policy=save_first_mm).sum().backward()

# %%
forward = [name for phase, name in trace.events if phase == "forward"]
recomputed = [name for phase, name in trace.events if phase == "recompute"]
assert recomputed == forward[1 : 1 + len(recomputed)]  # op 0 served, the next ones re-run in order
fate = ["served"] + ["re-run"] * len(recomputed) + ["not re-run"] * (len(forward) - 1 - len(recomputed))
print(f"policy asked {asked.count('forward')} times in forward, {asked.count('backward')} in backward;",
      "recomputation:", ", ".join(f"{n} {f}" for n, f in zip(forward, fate, strict=True)))
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
# Read off the picture:
#
# 1. **Forward.** Every op runs once; the policy, asked 7 times, keeps the first `mm`'s output
#    (red). The checkpoint also keeps the block's input.
# 2. **Backward reaches the block.** The first unpack starts one recomputation: the kept `mm` is
#    *served* (nothing runs), `gelu` and dropout *run again* (orange), the policy is not asked
#    again, and the last `mm` never runs: the recomputation stops once every saved tensor is
#    filled (notebook 03b).
# 3. **Gradients** use the served and recomputed tensors, freed as they are used.
#
# ### 2.3 · The two failing cases, with the package and with torch's SAC (same policies)


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
# The package is right in both. torch 2.13's eager SAC refuses the in-place case (its cache checks
# version counters) but serves the first draw: wrong gradients, silently. Keeping random ops is
# unusual, but no policy is stopped from it; `tests/test_selective.py` pins both behaviours.
#
# ## 3 · The same policy, ours and torch's, side by side
#
# "Save the matmuls" on the transformer block: gradients, bytes kept for backward
# (`measure_memory`'s retained bytes) and FLOPs recomputed (`CostCounter`, the step with
# checkpointing minus the step without).

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
# Keeping an output costs its bytes whether or not autograd would have saved it. Two cases:

# %%
save_all = retained(lambda: selective_checkpoint(block, x, policy=lambda ctx, op, *a, **k: True))
torch.manual_seed(0)
linears = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(4)))
lin_runs = {"none": lambda: linears(x), "plain checkpoint": lambda: checkpoint(linears, x),
            "SAC, save matmuls": lambda: selective_checkpoint(linears, x, policy=MATMULS)}
none_kib = table["no checkpointing"][1] / 1024
print(f"block: policy 'save everything' {save_all / 1024:.1f} KiB, no checkpointing {none_kib:.1f} KiB")
print("4 Linear layers:", ", ".join(f"{k} {retained(r) / 1024:.1f} KiB" for k, r in lin_runs.items()))

# %% [markdown]
# * **Saving everything** keeps *more* than no checkpointing (1282 against 994 KiB): outputs
#   autograd would never save (a `clone`, a residual `add`), and dropout still re-runs.
# * **A block made only of the ops you keep** (Linear layers, "save the matmuls") keeps every
#   activation: no checkpointing's 128 KiB, against 32 KiB for the plain checkpoint.
# * As for any checkpoint (notebook 02): around the whole model, or around inputs the caller
#   keeps alive, it saves nothing.
#
# ## 4 · A memory-budget planner
#
# Given a *budget* (bytes the forward may keep for backward), which outputs to keep?
# Keeping op *i* costs `nbytes[i]` and saves `cost[i]` of recomputation, independently of the
# others (a recomputation runs every op it does not find cached): the 0/1 knapsack problem,
#
# maximise $\sum_{i \in S} \mathrm{cost}_i$ subject to $\mathrm{inputs} + \sum_{i \in S} \mathrm{nbytes}_i \le \mathrm{budget}$.
#
# `solve_greedy` keeps the best cost per byte first (fast, not always optimal); `solve_dp` is
# exact: a dynamic program over bytes, in units of the sizes' greatest common divisor to keep the
# table small. Its core (the walk back that reads off the choice follows):

# %%
show_source(planner.solve_dp, start="best = np.zeros", stop="# Walk back")

# %% [markdown]
# The exact program against brute force (every subset) on 300 random problems of up to 12 items
# (`tests/test_planner.py` runs the same check under hypothesis):

# %%
SOLVERS = (planner.solve_greedy, planner.solve_dp, planner.solve_brute_force)
rng = random.Random(0)
agree, greedy_worse = 0, 0
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
# One region per block keeps each block's input, as per-block checkpointing does; the planner
# spends the rest of the budget across all blocks at once. Calling the `Plan` runs one
# `selective_checkpoint` per block, keeping the chosen ops *by position* (and checking that the
# block still runs the ops it was profiled with). Four transformer blocks, five budgets from the
# minimum (plain checkpointing) to keeping every candidate; each plan is run and measured (in the
# budget's terms: plus the first input, minus the output and the 4-byte loss).

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
# checkpointing buy back almost all of the recomputation. **What each plan keeps**: on top what
# keeping a candidate saves, below its bytes, red where kept; then what one plan keeps that the
# other does not (block·op):

# %%
cands = [(b, r) for b, p in enumerate(profiles) for r in p.candidates]
shown_plans, at = [plans["dp", 0.1], plans["greedy", 0.1], plans["dp", 0.25]], range(len(cands))
fig, axes = plt.subplots(1 + len(shown_plans), 1, figsize=(13, 8), sharex=True, layout="constrained")
axes[0].bar(at, [r.cost / 1e6 for _, r in cands], color="tab:purple", log=True)
axes[0].set(ylabel="MFLOPs saved\nif kept", title="the 22 candidates of blocks 0, 1, 2, 3, in forward order")
for ax, p in zip(axes[1:], shown_plans, strict=True):
    kept = [i for i, (b, r) in enumerate(cands) if r.index in p.saved[b]]
    ax.bar(at, [r.nbytes / 1024 for _, r in cands], color=["tab:red" if i in kept else "silver" for i in at])
    ax.scatter(kept, [cands[i][1].nbytes / 1024 + 12 for i in kept], marker="v", color="tab:red", s=14)
    ax.set(ylabel="KiB", ylim=(0, 150), title=f"{p.method}, budget {p.budget / 1024:.0f} KiB: red = kept "
           f"({len(kept)} ops), grey = recomputed; {p.recompute_cost / 1e6:.2f} MFLOPs recomputed")
for ax, b in itertools.product(axes, range(1, len(blocks))):  # black lines between blocks
    ax.axvline(b * len(cands) / len(blocks) - 0.5, color="k", lw=0.8)
axes[-1].set_xticks(at, [r.op.overloadpacket.__name__ for _, r in cands], rotation=90, size=7)
save_figure(fig, "05_plans")
plt.show()
for p, q in (shown_plans[:2], shown_plans[1::-1]):  # what dp keeps that greedy does not, and back
    extra = [(b, p.profiles[b].ops[i]) for b, ks in enumerate(p.saved) for i in sorted(ks - q.saved[b])]
    kib, mflops = sum(r.nbytes for _, r in extra) / 1024, sum(r.cost for _, r in extra) / 1e6
    names = [f"{b}·{r.op.overloadpacket.__name__}" for b, r in extra]
    print(f"at {p.budget // 1024} KiB only {p.method} keeps {names}: {kib:.0f} KiB, {mflops:.2f} MFLOPs")

# %% [markdown]
# Matmul outputs and the blocks' last layer norm (1 KiB, marked ▼) come first, as a rule of thumb
# would guess, but chosen by bytes (appendix B plans by measured time). At 628 KiB greedy falls
# short: three matmul outputs per block (32, 96 and 128 KiB) tie on FLOPs per byte; greedy fills
# the room with four 32 KiB ones, the exact plan keeps block 0's 128 KiB feed-forward `addmm`
# instead and recomputes 0.52 MFLOPs less. Does the plan run under torch's checkpoint
# (`Plan.torch_context_fn`)?

# %%
quarter = plans["dp", 0.25]
def run_stack_torch(v, p=quarter):
    for i, b in enumerate(blocks):
        v = torch_checkpoint(b, v, use_reentrant=False, context_fn=p.torch_context_fn(i))
    return v
torch_planned = grads_of(lambda: run_stack_torch(x), stack_leaves)
print("torch checkpoint with the plan == no checkpointing:", same(torch_planned, stack_expected))

# %% [markdown]
# **What the model leaves out.** The budget bounds what is kept *between* forward and backward,
# not the peak during backward. Checkmate (Jain et al., MLSys 2020) bounds the true peak with an
# integer linear program over every tensor's lifetime; our knapsack is its special case "one
# recomputation per region". Our plan is made once, for fixed shapes; Dynamic Tensor
# Rematerialization (DTR; Kirisame et al., ICLR 2021) decides *online*, evicting the tensor with
# the smallest `cost / (bytes × staleness)` (`solve_greedy` without staleness, applied once).
#
# ## 5 · The Pareto frontier
#
# The benchmark's two stacks: four `TransformerEncoderLayer`s (d_model 256, 8 × 128 tokens) and
# eight Linear(1024) + GELU + Dropout blocks (batch 64), each strategy measured as in section 4:
# none, per-block, √N segments, "save the matmuls" (ours and torch's), the planner at six budgets
# per solver, and CPU offload:

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
#   (the matmul outputs) buy back almost all of the recomputation. "Save the matmuls" (ours and
#   torch's, on top of each other) sits at the cliff's foot, on the frontier.
# * **√N segments** is off it: 4 blocks make 2 segments, the last unchecked. It shines on long
#   chains of equal blocks (notebook 02).
# * **The planner's top end** keeps more than "no checkpointing": every block stays a checkpoint
#   (section 3.1).
# * **Under `torch.compile`** the partitioner makes this trade by itself, across block boundaries:
#   [notebook 08](08_compiler_checkpointing.ipynb) puts its `activation_memory_budget` points on
#   this picture and hands this planner's plan to it.
#
# ## 6 · CPU offload
#
# Move saved tensors to host memory in the forward and back in backward: no FLOPs, every byte over
# PCIe twice. `ckpt_lab.offload.offload_to_cpu` is notebook 03's pack/unpack hook with pinned,
# non-blocking copies on CUDA, byte counts, and parameters left in place. On this CPU-only machine
# `include_cpu_tensors=True` is a dry run.

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
fig, ax = plt.subplots(figsize=(6, 1.4))  # where the saved tensors wait for backward
ax.barh(["offload", "no offload"], [hooks.bytes_kept / 1024, (hooks.bytes_kept + hooks.bytes_moved) / 1024])
ax.barh(["offload"], [hooks.bytes_moved / 1024], left=[hooks.bytes_kept / 1024])
ax.set(xlabel="saved KiB: blue stays on the device, orange moves to the host")
save_figure(fig, "05_offload")

# %% [markdown]
# On a GPU, `tests/test_offload.py` checks that `memory_allocated` drops (not run here).
#
# ## 7 · The BatchNorm pitfall
#
# In training mode BatchNorm also does `num_batches_tracked += 1` and blends the batch statistics
# into `running_mean` / `running_var` in place. A checkpoint runs the block twice, so both happen
# twice. One step under each checkpoint, without and with the fix:


# %%
def one_step(wrap, fix=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 8)).train()
    if fix:
        skip_stats_update_in_recompute(model)
    grads = grads_of(lambda: wrap(model, torch.randn(16, 32, requires_grad=True)), list(model.parameters()))
    return model[1].num_batches_tracked.item(), model[1].running_mean.clone(), grads
variants = {"no checkpointing": lambda m, w: m(w), "ckpt_lab.checkpoint": checkpoint,
            "ckpt_lab.reentrant_checkpoint": reentrant_checkpoint,
            "torch reentrant": lambda m, w: torch_checkpoint(m, w, use_reentrant=True),
            "torch non-reentrant": lambda m, w: torch_checkpoint(m, w, use_reentrant=False)}
_, ref_mean, ref_grads = one_step(variants["no checkpointing"])
steps = {name: (one_step(wrap), one_step(wrap, fix=True)) for name, wrap in variants.items()}
print(f"{'':<30} batches mean / plain grads ok | fixed: batches mean ok grads ok")
for name, ((count, mean, grads), (fixed_count, fixed_mean, fixed_grads)) in steps.items():
    ratio = (mean / ref_mean).mean().item()  # the running mean starts at 0; each update: 0.1 of the gap
    print(f"{name:<30} {count:>7} {ratio:>12.2f} {same(grads, ref_grads)!s:>8} | "
          f"{fixed_count:>14} {torch.equal(fixed_mean, ref_mean)!s:>7} {same(fixed_grads, ref_grads)!s:>8}")
fig, ax = plt.subplots(figsize=(6, 2.2))
for k in range(2):  # num_batches_tracked after one step, without the fix and with it
    ax.barh([i + 0.4 * k - 0.2 for i in range(len(steps))], [s[k][0] for s in steps.values()], 0.4)
ax.set(yticks=range(len(steps)), yticklabels=list(steps), ylim=(len(steps) - 0.5, -0.5), xticks=[0, 1, 2],
       xlabel="num_batches_tracked after one step: blue without the fix, orange with it")
save_figure(fig, "05_batchnorm")

# %% [markdown]
# Every checkpoint counts two batches and moves the running mean 1.9 times as far (0.1 of the batch
# mean, then 0.1 more of what is left). Gradients are unaffected, so nothing fails.
# `skip_stats_update_in_recompute` hooks each BatchNorm. In training, a forward *inside backward*
# is a recomputation: the pre-hook stashes the real buffers and swaps in copies; a post-hook
# with `always_call=True` puts them back, even when the recomputation stops early by raising:

# %%
show_source(skip_stats_update_in_recompute, start="with _disable_current_modes", stop="def post_hook")

# %% [markdown]
# Why not `track_running_stats = False` instead? `native_batch_norm` then saves two tensors fewer
# than in the forward, and the non-reentrant checkpoints, which match saved tensors by position,
# refuse (`tests/test_batchnorm.py`). `gradient_checkpoint_scope` (notebook 04) needs no fix: it
# already redirects in-place writes to outside tensors into copies.
#
# ## Summary
#
# | topic | answer | § |
# |---|---|---|
# | bytes and FLOPs | matmuls: 31% of a block's candidate bytes, 98% of its FLOPs | 1 |
# | what runs when | policy asked in forward; backward re-runs the block, serving kept outputs | 2.2 |
# | runs again anyway | in-place, view, random ops (torch 2.13's SAC: kept random ops wrong) | 2.1, 2.3 |
# | kept output changed in place; second backward | ours: one op more; torch's errors with `strict=True` | app. C |
# | ours and torch's SAC | same 416 KiB and FLOPs: 3% of a plain checkpoint's recompute | 3 |
# | SAC saves nothing | keeping everything (1282 > 994 KiB); a block of kept ops only | 3.1 |
# | byte budget | 0/1 knapsack, exact DP (greedy 1.9% worse at 628 KiB); measured = predicted | 4 |
# | the frontier | SAC on it; √N off it for few large blocks | 5 |
# | offload | every saved byte out and back over PCIe, no FLOPs | 6 |
# | BatchNorm | two batches per step; `skip_stats_update_in_recompute` makes it one | 7 |
#
# ---
#
# ## Appendix (optional)
#
# ### A · Refusals
#
# Each refused, with its reason: an overload family as a policy, a function that runs other ops
# when recomputed, a budget below the minimum, a plan used for another computation:

# %%
calls = itertools.count()
moody = lambda v: v.sin().exp() if next(calls) == 0 else v.cos().exp()  # other ops when recomputed
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
# ### B · Planning by measured time
#
# With `cost="time"` the profile times each op instead of counting FLOPs (machine-dependent: nbval
# does not check this output):

# %% tags=["nbval-ignore-output"]
timed = plan_sequential(blocks, x, budget=quarter.budget, cost="time")
print("kept, by time:", timed.saved_ops, "| within budget:", timed.retained_bytes <= quarter.budget)
print(f"predicted recomputation: {timed.recompute_cost * 1e3:.2f} ms per step")


# %% [markdown]
# ### C · `strict=True`: torch's errors where ours recomputes
#
# A kept output changed in place later in the forward, and a second backward (`retain_graph=True`):
# torch's SAC raises in both; ours runs the op again, or raises torch's error with `strict=True`:

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
# The default gets no checkpointing's gradients for one `sin` more (the backward of `cos` runs one
# anyway). We keep it: a right gradient for one op's FLOPs beats an error mid-training, and torch's
# way out (`allow_cache_entry_mutation=True`) serves the changed tensor. `strict=True` flags a
# policy that keeps an output the forward then overwrites.
