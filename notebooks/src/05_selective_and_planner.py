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
# # 05 · Choosing what to keep: selective recomputation and an eager memory-budget planner
#
# Notebooks 02–04 knew two settings: keep every activation (no checkpointing), or keep only a
# block's inputs and recompute the rest (checkpointing). Between them lies a whole range, because
# activations are not alike. A matmul's output costs `2·m·k·n` FLOPs to redo and `4·m·n` bytes to
# keep; a GELU's output costs one FLOP per element and the same bytes; attention's softmax and
# dropout outputs grow with the square of the sequence length and are among the cheapest to redo.
# Korthikanti et al. 2022 (arXiv:2205.05198) built on exactly this: recompute only the cheap, large
# attention intermediates and the recomputation overhead drops by over 90%.
#
# This notebook makes the choice per op, in eager mode:
#
# 1. What a block is made of: every aten op with the bytes it would keep and the FLOPs it would cost
# 2. Selective checkpointing: a policy per op, a draft that falls short, then `ckpt_lab.selective`
# 3. The same policy in torch's SAC: identical gradients, bytes and FLOPs — and one case where
#    torch's gradients are wrong
# 4. A memory-budget planner: profile once, solve a knapsack (greedy, and an exact dynamic program
#    checked by brute force), run the plan, measure it against its prediction
# 5. The Pareto frontier: none, per block, √N, SAC, the planner, CPU offload; Checkmate and DTR
# 6. CPU offload as a point on that frontier
# 7. The BatchNorm pitfall: running statistics updated twice, and a fix
#
# torch's own answer to "fit this budget" (`activation_memory_budget`) exists only under
# `torch.compile`; here everything runs eagerly and fits in three short modules:
# `ckpt_lab/selective.py`, `ckpt_lab/planner.py`, `ckpt_lab/batchnorm.py` (plus `ckpt_lab/offload.py`).
# Numbers printed here are bytes and FLOPs: the same on every machine, and re-checked by nbval.

# %%
import functools
import itertools
import random

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ckpt_lab import CheckpointError, bench, checkpoint, measure_memory, reentrant_checkpoint
from ckpt_lab import planner as planner_module
from ckpt_lab.batchnorm import skip_stats_update_in_recompute
from ckpt_lab.bench import pareto as pareto_module
from ckpt_lab.helpers.show import show_source
from ckpt_lab.helpers.viz import save_figure
from ckpt_lab.offload import offload_to_cpu
from ckpt_lab.planner import (
    CostCounter,
    budget_range,
    plan,
    plan_sequential,
    profile,
    profile_sequential,
    solve,
    solve_brute_force,
    solve_dp,
    solve_greedy,
)
from ckpt_lab.selective import SAVE, _SaveMode, _ServeMode, must_rerun, selective_checkpoint

_ = torch.manual_seed(0)
print("torch", torch.__version__)

MiB = 2**20


def torch_sac(function, *args, policy):
    """torch's selective checkpointing, use_reentrant spelled out."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    return torch_checkpoint(function, *args, use_reentrant=False, context_fn=context_fn)


def grads_of(forward, leaves, seed=1):
    """Gradients of forward().square().mean() w.r.t. leaves, dropout seeded the same every time."""
    for t in leaves:
        t.grad = None
    torch.manual_seed(seed)
    forward().square().mean().backward()
    return [t.grad.clone() for t in leaves]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# %% [markdown]
# ## 1 · What a transformer block is made of
#
# A small `nn.TransformerEncoderLayer` (d_model 64, 4 heads, feed-forward 256, dropout 0.1) on a
# batch of 4 sequences of 32 tokens. `planner.profile` runs it once under a `TorchDispatchMode`
# and notes, for each aten op below autograd, the bytes of *new* memory its output owns (views and
# in-place ops own none), what it costs to compute again (torch's FLOP count for matmuls, one per
# element for everything else), and whether a recomputation would have to run it anyway.

# %%
torch.manual_seed(0)
block = nn.TransformerEncoderLayer(64, 4, dim_feedforward=256, dropout=0.1, batch_first=True).train()
x = torch.randn(4, 32, 64, requires_grad=True)
leaves = [x, *block.parameters()]

prof = profile(block, x)
print(f"{len(prof.ops)} ops; the block's input is {prof.input_bytes} bytes")
print(f"{'#':>3} {'op':<22} {'bytes':>8} {'FLOPs':>10}  note")
for r in prof.ops:
    note = "runs again anyway" if r.rerun else "filled in place later" if r.mutated else ""
    if r.nbytes or r.cost:
        print(f"{r.index:>3} {r.op.overloadpacket.__name__:<22} {r.nbytes:>8} {int(r.cost):>10}  {note}")

# %% [markdown]
# Where the bytes are, and where the FLOPs are, among the ops a policy can actually choose
# (`candidate`: not a view, not in place, not random, not filled in place later, and reached by a
# recomputation):

# %%
cands = prof.candidates
by_kind = {}
for r in cands:
    kind = "matmul" if r.op.overloadpacket.__name__ in ("mm", "addmm", "bmm", "baddbmm") else "other"
    b, c = by_kind.get(kind, (0, 0))
    by_kind[kind] = (b + r.nbytes, c + r.cost)
total_b = sum(b for b, _ in by_kind.values())
total_c = sum(c for _, c in by_kind.values())
for kind, (b, c) in by_kind.items():
    print(f"{kind:>6}: {b / total_b:.0%} of the bytes, {c / total_c:.0%} of the recompute FLOPs")

# %% [markdown]
# Matmuls are about a third of the bytes but nearly all of the FLOPs: keep those, recompute the
# rest, and most of the recomputation is gone for a third of the memory. That is the idea behind
# "save the matmuls" policies (torch's SAC examples, torchtitan's `op_sac`). A planner goes further
# and weighs every op (section 4).
#
# ## 2 · Selective checkpointing
#
# The non-reentrant checkpoint of notebook 03 keeps handles, not tensors, and its recomputation
# fills them. To keep *some* outputs we need to see each op, so: a `TorchDispatchMode` in the
# forward that asks a policy about each op and caches the outputs it wants; a second one in the
# recomputation that serves cached outputs instead of running their ops.
#
# ### A first draft (it falls short)
#
# `DraftSaveMode` keeps what the policy says, `DraftServeMode` serves it back in order. About twenty lines,
# they show the mechanism; below them are the numbers that show where it breaks.


# %%
class DraftSaveMode(TorchDispatchMode):
    """DRAFT: cache the outputs of the ops the policy names, in order."""

    def __init__(self, cache, policy):
        super().__init__()
        self.cache, self.policy = cache, policy

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is not torch.ops.aten.detach.default:
            self.cache.append(out.detach() if self.policy(func) else None)
        return out


class DraftServeMode(TorchDispatchMode):
    """DRAFT: in the recomputation, return the cached output instead of running the op."""

    def __init__(self, cache):
        super().__init__()
        self.cache, self.position = cache, itertools.count()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return func(*args, **(kwargs or {}))
        cached = self.cache[next(self.position)]
        return cached.detach() if cached is not None else func(*args, **(kwargs or {}))


def draft_selective(function, x, policy):
    cache = []
    # ckpt_lab.checkpoint takes torch's context_fn: a forward mode and a recompute mode.
    return checkpoint(function, x, context_fn=lambda: (DraftSaveMode(cache, policy), DraftServeMode(cache)))


# %% [markdown]
# With "save the matmuls" it gives the right gradients:

# %%
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
expected = grads_of(lambda: block(x), leaves)
print(
    "draft, save matmuls == no checkpointing:",
    same(grads_of(lambda: draft_selective(block, x, lambda op: op in MATMULS), leaves), expected),
)

# %% [markdown]
# Now a function that draws two random tensors, with a policy that keeps the first one (say,
# because it is expensive to generate) and recomputes the second:


# %%
def two_draws(v):
    a = v.sin() * torch.rand_like(v)
    return a.cos() * torch.rand_like(v)


def first_draw_only():
    seen = []

    def policy(op):
        seen.append(op)
        return op is torch.ops.aten.rand_like.default and seen.count(op) == 1

    return policy


v = torch.randn(1000, requires_grad=True)
plain = grads_of(lambda: two_draws(v), [v])
draft = grads_of(lambda: draft_selective(two_draws, v, first_draw_only()), [v])
print("draft, keep first draw == no checkpointing:", same(draft, plain))
print(f"gradient elements that differ: {(draft[0] != plain[0]).sum().item()} of {v.numel()}")

# %% [markdown]
# Wrong, silently. The recomputation restores the forward's RNG state, then *skips* the first
# `rand_like` (it is served from the cache), so the generator is not advanced and the second
# `rand_like` draws the numbers the first one drew in the forward.
#
# The same trap waits for any op that must run for its side effect. An in-place op modifies its
# input; serve a cached copy instead, and the re-run's input stays unmodified. Here `h.mul_(2)`'s
# return value is ignored, as it usually is, and `h` is what the next op uses:


# %%
def in_place(v):
    h = v.sin()
    h.mul_(2)
    return h * h


def keep_mul_(op):
    return op.overloadpacket is torch.ops.aten.mul_


plain_inplace = grads_of(lambda: in_place(v), [v])
draft_inplace = grads_of(lambda: draft_selective(in_place, v, keep_mul_), [v])
print("draft, keep mul_ == no checkpointing:", same(draft_inplace, plain_inplace))
print(f"gradient elements that differ: {(draft_inplace[0] != plain_inplace[0]).sum().item()} of {v.numel()}")

# %% [markdown]
# A view must likewise alias the re-run's tensor, not a cached one; and a cached tensor that a
# later op fills in place (`empty_like` before `bernoulli_` in dropout) is not the op's output any
# more.
#
# ### The package's version
#
# `ckpt_lab.selective` asks the policy about every op — with torch's signature
# `policy(ctx, op, *args, **kwargs)`, so one policy drives both implementations — but three kinds
# of op run again whatever it answers:

# %%
show_source(must_rerun)

# %%
show_source(_SaveMode)

# %%
show_source(_ServeMode)

# %%
show_source(selective_checkpoint)

# %% [markdown]
# The in-place case with the package: `mul_` runs again, whatever the policy says.

# %%
ours_inplace = grads_of(
    lambda: selective_checkpoint(in_place, v, policy=lambda ctx, op, *a, **k: keep_mul_(op)), [v]
)
print("ckpt_lab.selective_checkpoint, keep mul_ == no checkpointing:", same(ours_inplace, plain_inplace))

# %% [markdown]
# The same two-draw function, the same policy, now in torch's signature:


# %%
def keep_first_draw():
    count = itertools.count()

    def policy(ctx, op, *args, **kwargs):
        if op is torch.ops.aten.rand_like.default and next(count) == 0:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


ours = grads_of(lambda: selective_checkpoint(two_draws, v, policy=keep_first_draw()), [v])
theirs = grads_of(lambda: torch_sac(two_draws, v, policy=keep_first_draw()), [v])
print("ckpt_lab.selective_checkpoint == no checkpointing:", same(ours, plain))
print(f"torch {torch.__version__} SAC == no checkpointing:", same(theirs, plain))

# %% [markdown]
# torch's eager SAC serves the first draw from its cache and has the same problem as the draft: the
# gradients differ, without an error or a warning. (torch's compiled memory-budget partitioner has
# a bug of the same family, pytorch/pytorch#190758.) A policy that keeps random ops is unusual —
# torch's own examples keep matmuls — but nothing stops one, and `tests/test_selective.py` pins
# both behaviours.
#
# ## 3 · The same policy, ours and torch's, side by side
#
# "Save the matmuls" on the transformer block: gradients, bytes kept between forward and backward,
# and the FLOPs the recomputation spends (counted with `CostCounter`: the whole step with
# checkpointing minus the whole step without).

# %%
SAVE_MATMULS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default]


def step_cost(forward):
    torch.manual_seed(1)
    with CostCounter() as counter:
        forward().square().mean().backward()
    return counter.total


def retained(forward):
    torch.manual_seed(1)
    return measure_memory(lambda: forward().square().mean()).retained_bytes


runs = {
    "no checkpointing": lambda: block(x),
    "ckpt_lab.checkpoint": lambda: checkpoint(block, x),
    "torch SAC, save matmuls": lambda: torch_sac(block, x, policy=SAVE_MATMULS),
    "ckpt_lab SAC, save matmuls": lambda: selective_checkpoint(block, x, policy=SAVE_MATMULS),
}
base_cost = step_cost(runs["no checkpointing"])
print(f"{'':<28} {'grads ok':>8} {'retained KiB':>13} {'recompute kFLOPs':>17}")
table = {}
for name, run in runs.items():
    table[name] = (retained(run), step_cost(run) - base_cost)
    ok = same(grads_of(run, leaves), expected)
    print(f"{name:<28} {ok!s:>8} {table[name][0] / 1024:>13.1f} {table[name][1] / 1000:>17.1f}")
assert table["torch SAC, save matmuls"] == table["ckpt_lab SAC, save matmuls"]

# %% [markdown]
# Identical to the byte and to the FLOP. Saving the matmuls costs a fraction of no checkpointing's
# memory and removes almost all of plain checkpointing's recomputation; what is still recomputed is
# pointwise work (softmax, ReLU, dropout's mask multiply, layer norm, the residual adds).
#
# Bad policies get a message that says what to return:


# %%
def forgetful(ctx, op, *args, **kwargs):
    if op is torch.ops.aten.addmm.default:
        return SAVE
    # ... and falls off its end for every other op: None


for bad in (forgetful, lambda ctx, op, *a, **k: "save", [torch.ops.aten.mm]):
    try:
        selective_checkpoint(block, x, policy=bad)
    except TypeError as error:
        print(f"TypeError: {error}\n")

# %% [markdown]
# And a function that runs different ops when it is recomputed (here: a branch on a call counter)
# is stopped before it can hand backward a wrong tensor:

# %%
calls = itertools.count()


def moody(v):
    return v.sin().exp() if next(calls) == 0 else v.cos().exp()


try:
    selective_checkpoint(moody, v, policy=[torch.ops.aten.sin.default]).sum().backward()
except CheckpointError as error:
    print(f"CheckpointError: {error}")

# %% [markdown]
# ## 4 · A memory-budget planner
#
# A policy that names op types is a rule of thumb. Given a *budget* — bytes the forward may keep
# for backward — which outputs should be kept? Keeping op *i* costs `nbytes[i]` and saves
# `cost[i]` of recomputation, independently of the others (a recomputation runs every op it does
# not find cached). That is the 0/1 knapsack problem:
#
# maximise $\sum_{i \in S} \mathrm{cost}_i$ subject to $\mathrm{inputs} + \sum_{i \in S} \mathrm{nbytes}_i \le \mathrm{budget}$.
#
# Two solvers: the greedy one keeps the best cost per byte first (fast, not always optimal), the
# dynamic program is exact, and runs in `items × capacity / g` steps where `g` is the greatest
# common divisor of the sizes.

# %%
show_source(solve_greedy)

# %%
show_source(solve_dp)

# %% [markdown]
# The textbook case where greedy loses: one dense item that leaves no room for two that fill the
# capacity exactly.

# %%
items = [("a", 21, 60.0), ("b", 20, 50.0), ("c", 20, 50.0)]
for solver in (solve_greedy, solve_dp, solve_brute_force):
    chosen = sorted(solver(items, 40))
    print(f"{solver.__name__:<18} keeps {chosen}, saves {sum(c for k, _, c in items if k in chosen):.0f}")

# %% [markdown]
# The dynamic program against brute force (every subset) on 300 random problems of up to 12 items
# — `tests/test_planner.py` runs the same check under hypothesis:

# %%
rng = random.Random(0)
agree, greedy_worse = 0, 0
for _ in range(300):
    items = [(i, 4 * 2 ** rng.randint(0, 10), float(rng.randint(0, 1000))) for i in range(rng.randint(1, 12))]
    capacity = rng.randint(0, 8000)

    def value(chosen, items=items):
        return sum(c for k, _, c in items if k in chosen)

    agree += value(solve_dp(items, capacity)) == value(solve_brute_force(items, capacity))
    greedy_worse += value(solve_greedy(items, capacity)) < value(solve_dp(items, capacity))
print(f"DP optimal in {agree}/300; greedy below the optimum in {greedy_worse}/300")

# %% [markdown]
# ### Planning a stack
#
# One region per block keeps what per-block checkpointing keeps (each block's input) and bounds the
# recomputation in backward to one block at a time; the planner then spends the rest of the budget
# across all blocks at once. `plan_sequential` profiles each block and solves one knapsack.
# `Plan.__call__` runs it: one `selective_checkpoint` per block, with a policy that keeps the chosen
# ops *by position* and checks that the block still runs the ops it was profiled with.

# %%
show_source(planner_module.Plan, start="def __call__", stop="def torch_context_fn")

# %% [markdown]
# Four transformer blocks, profiled once (`profile_sequential`); budgets from the minimum (the four
# block inputs: plain checkpointing) up to keeping every candidate (`budget_range`), each solved in
# milliseconds (`solve`). For each: the plan's predicted memory and recompute FLOPs, and the
# measured ones.
# The measured memory is `measure_memory`'s retained bytes, converted to the budget's terms (plus
# the first input, which it does not count because it was made before the call; minus the output
# and the loss, which are not activations).

# %%
torch.manual_seed(0)
blocks = [
    nn.TransformerEncoderLayer(64, 4, dim_feedforward=256, dropout=0.1, batch_first=True).train()
    for _ in range(4)
]
stack_leaves = [x, *(p for b in blocks for p in b.parameters())]


def run_stack(v):
    for b in blocks:
        v = b(v)
    return v


profiles = profile_sequential(blocks, x)
minimum, maximum = budget_range(profiles)
print(f"minimum budget {minimum / 1024:.0f} KiB (block inputs), everything kept {maximum / 1024:.0f} KiB")
stack_expected = grads_of(lambda: run_stack(x), stack_leaves)
with torch.no_grad():
    OUTPUT_BYTES = run_stack(x).nbytes
stack_base = step_cost(lambda: run_stack(x))

rows = []
print(
    f"{'budget KiB':>10} {'method':>7} {'kept ops':>8} {'predicted KiB':>13} {'measured KiB':>12} "
    f"{'pred. MFLOPs':>12} {'meas. MFLOPs':>12} {'grads':>6}"
)
for fraction in (0.0, 0.1, 0.25, 0.5, 1.0):
    budget = int(minimum + fraction * (maximum - minimum))
    for method in ("dp", "greedy"):
        p = solve(profiles, budget, method)
        # measure_memory counts what the forward made and kept: not the first input (made before;
        # the checkpoint keeps it, so add it), but the final output and the 4-byte loss (take them out).
        measured = retained(lambda p=p: p(x)) + x.nbytes - OUTPUT_BYTES - 4
        cost = step_cost(lambda p=p: p(x)) - stack_base
        ok = same(grads_of(lambda p=p: p(x), stack_leaves), stack_expected)
        assert measured == p.retained_bytes <= budget and cost == p.recompute_cost and ok
        rows.append((budget, method, p))
        print(
            f"{budget / 1024:>10.0f} {method:>7} {len(p.saved_ops):>8} {p.retained_bytes / 1024:>13.1f} "
            f"{measured / 1024:>12.1f} {p.recompute_cost / 1e6:>12.2f} {cost / 1e6:>12.2f} {ok!s:>6}"
        )

# %%
at = {(m, b): p for b, m, p in rows}
b10 = int(minimum + 0.1 * (maximum - minimum))
extra = at["greedy", b10].recompute_cost / at["dp", b10].recompute_cost - 1
print(f"at {b10 / 1024:.0f} KiB the greedy plan recomputes {extra:.1%} more than the optimum")

# %% [markdown]
# Every plan stays within its budget, and the measurement equals the prediction to the byte and to
# the FLOP: the planner's model is exact for what it models. The greedy solver comes close, but not
# always to the optimum: at 628 KiB it recomputes more than the dynamic program and keeps more ops
# for the same bytes. The exact program is the default.
#
# What did it keep at a quarter of the range?

# %%
quarter = next(p for b, m, p in rows if m == "dp" and b == int(minimum + 0.25 * (maximum - minimum)))
print(
    "block 0 keeps:",
    [quarter.profiles[0].ops[i].op.overloadpacket.__name__ for i in sorted(quarter.saved[0])],
)

# %% [markdown]
# With `cost="time"` the profile times each op (a few repeats) instead of counting FLOPs, so
# memory-bound ops weigh what they really cost on this machine. Machine-dependent: nbval does not
# check this cell's output.

# %% tags=["nbval-ignore-output"]
timed = plan_sequential(blocks, x, budget=quarter.budget, cost="time")
kept = [timed.profiles[0].ops[i].op.overloadpacket.__name__ for i in sorted(timed.saved[0])]
print("block 0 keeps (by time):", kept)
within = timed.retained_bytes <= quarter.budget
print(f"predicted recomputation: {timed.recompute_cost * 1e3:.2f} ms per step, within budget: {within}")

# %% [markdown]
# The same plan runs under torch's checkpoint too (`Plan.torch_context_fn`), with the same
# gradients — the planner is not tied to this project's engine:


# %%
def run_stack_torch(v, p=quarter):
    for i, b in enumerate(blocks):
        v = torch_checkpoint(b, v, use_reentrant=False, context_fn=p.torch_context_fn(i))
    return v


print(
    "torch checkpoint with the plan == no checkpointing:",
    same(grads_of(lambda: run_stack_torch(x), stack_leaves), stack_expected),
)

# %% [markdown]
# Budgets that cannot be met, and plans used for another computation, are refused with the reason:

# %%
for attempt in (
    lambda: plan_sequential(blocks, x, budget=minimum - 1),
    lambda: plan(run_stack, x, budget="1 GB"),
):
    try:
        attempt()
    except (ValueError, TypeError) as error:
        print(f"{type(error).__name__}: {error}\n")

blocks[2].eval()  # dropout off in one block: its ops change
try:
    quarter(x)
except CheckpointError as error:
    print(f"CheckpointError: {error}")
_ = blocks[2].train()

# %% [markdown]
# ### What the model leaves out: Checkmate and DTR
#
# * **Retained, not peak.** The budget bounds what is kept *between* forward and backward. During
#   backward each block's recomputation adds its own tensors on top, one block at a time.
#   Checkmate (Jain et al., MLSys 2020) models the whole schedule — which tensor is alive at every
#   step of forward *and* backward — as an integer linear program, and so bounds the true peak; it
#   is optimal but needs an integer-programming solver. Our knapsack is the special
#   case "one recomputation per region, everything before the backward".
# * **Ahead of time, fixed shapes.** The plan is made once, from one profiled run. Dynamic Tensor
#   Rematerialization (Kirisame et al., ICLR 2021) decides *online*: when memory runs out, it evicts
#   the tensor with the smallest `cost / (bytes × staleness)` and recomputes it on demand, and it
#   handles dynamic shapes and control flow. `solve_greedy` is DTR's heuristic without staleness,
#   applied once. DTR proves an N-layer chain trains in Ω(√N) memory with O(N) operations — the
#   same bound as Chen et al.'s √N segments (notebook 02).
#
# ## 5 · The Pareto frontier
#
# Memory kept against recomputation, for a transformer stack and an MLP stack: no checkpointing,
# per-block checkpointing, √N segments, "save the matmuls" (ours and torch's, which coincide), the
# planner at several budgets, and CPU offload. `ckpt_lab.bench.pareto` measures every point the way
# section 4 did.

# %%
show_source(pareto_module.measure_points)

# %% [markdown]
# The two stacks of the benchmark (`python -m ckpt_lab.bench`): four `TransformerEncoderLayer`s
# (d_model 256, 8 sequences of 128 tokens) and eight Linear(1024) + GELU + Dropout blocks (batch 64).
# Memory is what is kept between forward and backward, counting the first block's input (the
# planner's budget terms); recomputation is FLOPs in the planner's cost model, counted during the
# step. This cell takes about half a minute.

# %%
workloads = {"transformer-4": bench.transformer(4), "mlp-8": bench.mlp(8)}
points = {name: pareto_module.measure_points(wl) for name, wl in workloads.items()}
frontiers = {name: pareto_module.exact_frontier(wl) for name, wl in workloads.items()}
for name, pts in points.items():
    print(name)
    print(pareto_module.table(pts))
    assert all(p.grads_ok for p in pts)
    assert all(p.within_budget and p.as_planned for p in pts if p.budget is not None)
    print()

# %%
fig = pareto_module.plot(points, frontiers)
save_figure(fig, "05_pareto")
plt.show()

# %%
for name, pts in points.items():
    by = {p.strategy: p for p in pts}
    sac, block_ckpt, none = by["torch SAC (matmuls)"], by["per-block"], by["none"]
    print(
        f"{name}: saving the matmuls keeps {sac.retained_bytes / none.retained_bytes:.0%} of no "
        f"checkpointing's memory and removes {1 - sac.recompute_flops / block_ckpt.recompute_flops:.1%} "
        "of per-block checkpointing's recomputation"
    )
    # The planner, given exactly what SAC and sqrt(N) keep: on the frontier means it does no better.
    planner_profiles = bench.planner_range(workloads[name].blocks, workloads[name].input).profiles
    for other in (sac, by["sqrt(N)"]):
        best = solve(planner_profiles, other.retained_bytes).recompute_cost
        print(
            f"  {other.strategy}: {other.recompute_flops / 1e9:.4f} GFLOP recomputed; the planner with the "
            f"same memory: {best / 1e9:.4f}"
        )

# %% [markdown]
# Reading the picture:
#
# * **The frontier is a staircase** with a cliff. On the transformer, the first ~50 MiB above
#   plain checkpointing buy almost all of the recomputation back: that is where the matmul outputs
#   go. "Save the matmuls" (torch's SAC and ours, on top of each other) sits at the foot of the
#   cliff, and on the frontier: given the same memory, the planner recomputes no less.
# * **√N segments** is off the frontier here. With 4 blocks it makes 2 segments and leaves the last
#   one unchecked; it shines on long chains of equal blocks (notebook 02's 36-layer stack), not on
#   four large ones, where choosing *inside* the blocks recomputes far less for the same memory.
# * **The planner's top end** is not "no checkpointing": every block stays a checkpoint, so to
#   recompute nothing it would have to keep outputs autograd itself would not save (the planner's
#   last point keeps more memory than no checkpointing and still re-runs dropout and views). The
#   honest range of this planner is from plain checkpointing to the cliff; letting it also leave a
#   block unchecked (a multiple-choice knapsack) would close the gap at the top. Not built.
# * **CPU offload** sits at the bottom left: only the input stays on the device and nothing is
#   recomputed, for the transfer of every saved byte (the note gives the amount) out and back.

# %% [markdown]
# ## 6 · CPU offload
#
# Instead of recomputing a saved tensor, move it to host memory in the forward and back in backward:
# no FLOPs, but bytes over the PCIe bus twice (with pinned memory and non-blocking copies the copy
# can overlap compute). Notebook 03 drafted this hook and read torch's `save_on_cpu`;
# `ckpt_lab.offload.offload_to_cpu` is the package's version: pinned, non-blocking copies on CUDA,
# leaves that require grad left where they are (their `AccumulateGrad` node keeps them alive
# anyway), and byte counts. On this
# CPU-only machine there is no device memory to free, so `include_cpu_tensors=True` runs the same
# path as a dry run (CPU → separate CPU buffer → back) to count what would move.

# %%
show_source(offload_to_cpu, start="def _should_move", stop="def _unpack")

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
print(
    f"moved to host: {hooks.tensors_moved} tensors, {hooks.bytes_moved / 1024:.0f} KiB; "
    f"brought back: {hooks.bytes_returned / 1024:.0f} KiB; kept on device: {hooks.tensors_kept} tensors "
    f"({hooks.bytes_kept / 1024:.0f} KiB: parameters, which stay alive anyway)"
)

# %%
# What those bytes would cost over PCIe 4.0 x16 (~25 GB/s each way), out in forward and back in backward.
PCIE_BYTES_PER_S = 25e9
print(f"estimated transfer: {2 * hooks.bytes_moved / PCIE_BYTES_PER_S * 1e6:.0f} µs per step for this MLP")

# %% [markdown]
# On a GPU those moved bytes leave device memory entirely: the frontier point has the retained
# memory of checkpointing's minimum and zero recomputation, paid for in transfer time (about
# `2 × bytes / bandwidth`; at ~25 GB/s per direction on PCIe 4 x16, 1 MiB costs about 80 µs).
# `tests/test_offload.py` checks on CUDA that `memory_allocated` drops; that test has not run on
# these machines (no GPU).
#
# ## 7 · The BatchNorm pitfall
#
# In training mode BatchNorm does two things besides normalising: `num_batches_tracked += 1`, and
# blending the batch statistics into `running_mean` / `running_var` in place. A checkpoint runs the
# block twice, so both happen twice:


# %%
def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 8)).train()


def one_step(wrap, fix=False):
    model = bn_model()
    hooks = skip_stats_update_in_recompute(model) if fix else None
    torch.manual_seed(1)
    w = torch.randn(16, 32, requires_grad=True)
    wrap(model, w).square().mean().backward()
    if hooks is not None:
        hooks.remove()
    bn = model[1]
    return bn.num_batches_tracked.item(), bn.running_mean.clone(), [p.grad for p in model.parameters()]


variants = {
    "no checkpointing": lambda m, w: m(w),
    "torch reentrant": lambda m, w: torch_checkpoint(m, w, use_reentrant=True),
    "torch non-reentrant": lambda m, w: torch_checkpoint(m, w, use_reentrant=False),
    "ckpt_lab.reentrant_checkpoint": lambda m, w: reentrant_checkpoint(m, w),
    "ckpt_lab.checkpoint": lambda m, w: checkpoint(m, w),
}
ref_count, ref_mean, ref_grads = one_step(variants["no checkpointing"])
print(
    f"{'':<30} {'batches':>7} {'mean / plain':>12} {'grads ok':>8} | "
    f"fixed: {'batches':>7} {'mean ok':>7} {'grads ok':>8}"
)
for name, wrap in variants.items():
    count, mean, grads = one_step(wrap)
    fixed_count, fixed_mean, fixed_grads = one_step(wrap, fix=True)
    # The running mean starts at 0, so each update moves it by a fixed fraction of the batch mean.
    ratio = (mean / ref_mean).mean().item()
    print(
        f"{name:<30} {count:>7} {ratio:>12.2f} {same(grads, ref_grads)!s:>8} | "
        f"{fixed_count:>14} {torch.equal(fixed_mean, ref_mean)!s:>7} {same(fixed_grads, ref_grads)!s:>8}"
    )

# %% [markdown]
# Every checkpoint counts two batches and moves the running mean 1.9 times as far (0.1 of the batch
# mean, then 0.1 more of what is left: 0.19); the gradients are unaffected (training mode normalises with the batch's own statistics), so nothing fails — the
# model just evaluates worse later. `skip_stats_update_in_recompute` hooks every BatchNorm module:
# a forward that runs *inside backward* is a recomputation, and for its duration the module's
# buffers are swapped for scratch copies.

# %%
show_source(skip_stats_update_in_recompute)

# %% [markdown]
# Why not simply switch `track_running_stats` off during the recomputation? It would give the same
# output, but `native_batch_norm` saves the running statistics for backward when it receives them,
# so the recomputation would save two tensors fewer than the forward — and the non-reentrant
# checkpoints, which match recomputed tensors to saved ones by position, refuse:


# %%
class NaiveFix:
    """DRAFT: turn track_running_stats off while a forward runs inside backward."""

    def __init__(self, bn):
        bn.register_forward_pre_hook(self.pre)
        bn.register_forward_hook(self.post, always_call=True)

    def pre(self, bn, args):
        if torch._C._current_graph_task_id() != -1:
            bn.track_running_stats = False

    def post(self, bn, args, out):
        bn.track_running_stats = True


model = bn_model()
NaiveFix(model[1])
w = torch.randn(16, 32, requires_grad=True)
try:
    checkpoint(model, w).sum().backward()
except CheckpointError as error:
    print(f"CheckpointError: {str(error)[:160]}...")

# %% [markdown]
# `gradient_checkpoint_scope` (notebook 04) needs no fix: it replays aten ops, not modules, and
# already redirects in-place writes to tensors from outside the scope (the running statistics)
# into copies (`tests/test_batchnorm.py` measures `num_batches_tracked == 1` under the scope).
#
# ## Summary
#
# * A selective policy chooses per op; the engine must still re-run in-place ops, views and random
#   ops, or the recomputation is not the forward — torch 2.13's eager SAC skips saved random ops
#   and its gradients are then wrong.
# * With the same policy, `ckpt_lab.selective_checkpoint` and torch's SAC keep the same bytes and
#   recompute the same FLOPs.
# * A budget turns "what to keep" into a 0/1 knapsack. The planner's predictions equal the
#   measurements; every plan stays within its budget; the exact dynamic program is checked against
#   brute force.
# * CPU offload trades recomputation for transfers; BatchNorm needs its statistics protected from
#   the recomputation.
