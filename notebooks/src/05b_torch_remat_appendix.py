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
# # 05b · Appendix (optional): `torch_remat`, region policies without a dispatch mode
#
# **Optional.** [Notebook 05](05_selective_and_planner.ipynb) decides op by op what a checkpoint
# keeps, through a `TorchDispatchMode` that sees every aten op. `torch_remat` (Meta's `torch-remat`
# 0.2.2, pure Python, pinned in `requirements.txt`; torch's documentation points to it for region
# policies) decides by *region of source code* instead, and uses no dispatch mode at all.
#
# **TL;DR.** `remat.checkpoint` is torch's non-reentrant checkpoint whose `context_fn` returns two
# plain context managers that only set a context variable (forward or recompute). Inside,
# `remat.region(fn, name, recompute=False)` runs `fn` under its own `saved_tensors_hooks`, which
# shadow the checkpoint's: what `fn` saves stays an ordinary saved tensor, and the re-run skips
# `fn`. On one transformer block, "keep the attention, recompute the rest" written four ways (torch's
# SAC, ours, the scope, `torch_remat`) gives the same gradients to the bit; the two SAC versions keep
# every output of the attention, the scope and `torch_remat` only what autograd saves.
#
# **After this appendix you can**
#
# 1. say how `torch_remat` gets a region policy without a dispatch mode, citing its functions
#    (checked: §1's cells);
# 2. write one policy four ways and compare bytes, re-runs, peak and gradients (checked: §2's asserts);
# 3. say what each way can express that the others cannot (§3), and read `torch_remat`'s
#    saved-tensor report beside `explain`'s (§4).
#
# Shown on torch 2.13.0; timings only in cells nbval does not compare.

# %%
import statistics
import time

import torch
import torch_remat as remat
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import ckpt_lab
from ckpt_lab import measure_memory
from ckpt_lab.helpers.show import show_source
from ckpt_lab.helpers.tensors import all_equal as same
from ckpt_lab.instruments.counting import OpCounter
from ckpt_lab.planner import CostCounter
from ckpt_lab.scope import gradient_checkpoint_scope
from ckpt_lab.selective import selective_checkpoint

print("torch", torch.__version__, "· torch_remat", remat.__name__, "0.2.2 (requirements.txt)")

# %% [markdown]
# ## 1 · How a region is kept without a dispatch mode
#
# Three pieces, all in `torch_remat`'s source (site-packages/torch_remat).
#
# **The checkpoint** (`_api.checkpoint`) calls torch's own non-reentrant checkpoint generator,
# `torch.utils.checkpoint._checkpoint_without_reentrant_generator`
# (`_compat._torch_checkpoint_with_forward_exception_cleanup`), with a `context_fn` that returns two
# `_CheckpointPhaseContext`s (`_region._checkpoint_context_fn`). Entering one sets a context
# variable, nothing more: no op reaches Python.

# %%
show_source(remat._region._CheckpointPhaseContext.__enter__, stop="region_state = self._region_state")

# %% [markdown]
# **A saved region** (`_api.region` → `_run_save_op`): in the forward, `fn` runs under a nested
# `saved_tensors_hooks(pack, unpack)`. The innermost hooks win ([notebook 03](03_saved_tensor_hooks.ipynb)),
# so the checkpoint's pack hook never sees what `fn`'s ops save: each stays an ordinary saved
# tensor on the forward's graph (`_default_pack` hands autograd a detached alias). In the re-run the
# same call finds the phase RECOMPUTE and skips `fn` (`_replay_save_op`):

# %%
show_source(remat._api._run_save_op, start="if state.phase is _Phase.RECOMPUTE", stop="# The wrapper")

# %% [markdown]
# What does the skipped call return? Its output, if something in the re-run needs it and it was
# *persisted* in the forward (`_PersistOutputThunk`, fired by a consuming `remat.region`, by
# `remat.recompute_needs_tensor`, or at once if autograd saved it anyway); otherwise a placeholder of
# the right shape whose storage raises on any read (`_placeholder._make_placeholder_tensor`).
#
# **The boundary** (`_recompute_boundary._TriggerCheckpointRecompute`): each output of the checkpoint
# goes through an identity Function that saves a 0-element tensor through the checkpoint's hooks, so
# the first unpack in backward starts the re-run at the output. The re-run does not stop early
# ("replay does not stop early: the whole function reruns", `checkpoint`'s docstring).
#
# **Random numbers.** `preserve_rng_state=True` raises: a skipped region's draws would shift every
# later one. A `RecomputeStateHook` (`snapshot()`, `restore(state)`) is restored at entry and after
# each skipped region instead. The CPU generator's hook:


# %%
class CPURNG:
    """A torch_remat RecomputeStateHook for the CPU generator (what preserve_rng_state keeps in torch)."""
    def snapshot(self):
        return torch.get_rng_state()
    def restore(self, state):
        torch.set_rng_state(state)
assert isinstance(CPURNG(), remat.RecomputeStateHook)


# %% [markdown]
# ## 2 · One block, one policy, four ways
#
# [Notebook 05](05_selective_and_planner.ipynb)'s `nn.TransformerEncoderLayer` (d_model 64, 4 heads,
# feed-forward 256, dropout 0.1), written out as its `forward` runs it (post-norm), so that each
# tool can name a part. The policy: **keep the attention sublayer, recompute the rest.**

# %%
torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=256, dropout=0.1, batch_first=True).train()
x = torch.randn(4, 32, 64, requires_grad=True)
leaves = [x, *layer.parameters()]
def attention(h):
    return layer.self_attn(h, h, h, need_weights=False)[0]
def rest(h, a):  # everything after the attention: residual, norms, feed-forward
    h = layer.norm1(h + layer.dropout1(a))
    return layer.norm2(h + layer.dropout2(layer.linear2(layer.dropout(layer.activation(layer.linear1(h))))))
def block(h):
    return rest(h, attention(h))
def grads_of(forward):
    for t in leaves:
        t.grad = None
    torch.manual_seed(1)
    forward().square().mean().backward()
    return [t.grad.clone() for t in leaves]
expected = grads_of(lambda: layer(x))
print("block == layer.forward, gradients bitwise:", same(grads_of(lambda: block(x)), expected))

# %% [markdown]
# The four versions. SAC can name a region only through state its policy reads: a flag the block
# sets around the attention. The policy leaves in-place ops (the dropout mask's `bernoulli_`, `div_`)
# and the buffer they fill (`empty_like`) to re-run: torch's SAC raises when a cached output was
# modified in place (notebook 05 §2.3). The scope is a `with` block around what to recompute;
# `torch_remat` wraps what to keep.

# %%
in_attention = [False]
def flagged_block(h):
    in_attention[0] = True
    try:
        a = attention(h)
    finally:
        in_attention[0] = False
    return rest(h, a)
def keep_attention(ctx, op, *args, **kwargs):
    return in_attention[0] and not op._schema.is_mutable and op is not torch.ops.aten.empty_like.default
def torch_sac(h):
    def context_fn():
        return create_selective_checkpoint_contexts(keep_attention)
    return torch_checkpoint(flagged_block, h, use_reentrant=False, context_fn=context_fn)
def scoped(h):
    a = attention(h)
    with gradient_checkpoint_scope():
        return rest(h, a)
def remat_block(h):
    a = remat.region(attention, "attention", recompute=False)(h)
    remat.recompute_needs_tensor(a)  # the residual add, a bare op, reads it in the re-run
    return rest(h, a)
def with_remat(h, body=remat_block):
    return remat.checkpoint(region_name="block", recompute_state_hooks=(CPURNG(),))(body)(h)


# %% [markdown]
# Without `recompute_needs_tensor`, the re-run's residual add would read the skipped region's
# placeholder, whose storage raises on any read. Making that placeholder needs a private torch name
# (`torch._C._set_storage_data_ptr_access_error_msg`, CUDA graphs' own) that torch 2.13's CPU
# build lacks (2.15's CUDA build has it), so here the re-run stops earlier, with an `AttributeError` from
# inside backward:

# %%
def remat_unmarked(h):
    return rest(h, remat.region(attention, "attention", recompute=False)(h))
try:
    grads_of(lambda: with_remat(x, remat_unmarked))
except (RuntimeError, AttributeError) as error:
    print(f"{type(error).__name__}: {error}")

# %% [markdown]
# Each run, beside no checkpointing and plain checkpoints (torch's, and `torch_remat`'s with
# nothing kept): gradients against no checkpointing, bytes kept for backward
# ([retained](glossary.md#retained)), peak, and what backward runs again: aten ops, matmuls and
# FLOPs above no checkpointing's step.

# %%
runs = {
    "no checkpointing": lambda: block(x),
    "torch checkpoint": lambda: torch_checkpoint(block, x, use_reentrant=False),
    "torch_remat, nothing kept": lambda: with_remat(x, block),
    "torch SAC, keep attention": lambda: torch_sac(x),
    "ckpt_lab SAC, keep attention": lambda: selective_checkpoint(flagged_block, x, policy=keep_attention),
    "ckpt_lab scope, rest in scope": lambda: scoped(x),
    "torch_remat, attention region": lambda: with_remat(x),
}

# %%
MATMUL = {"mm", "addmm", "bmm", "baddbmm"}
def step_counts(forward):
    for t in leaves:
        t.grad = None
    torch.manual_seed(1)
    with OpCounter() as ops, CostCounter() as flops:
        forward().square().mean().backward()
    return ops.total, sum(n for op, n in ops.counts.items() if op in MATMUL), flops.total
def memory(forward):
    torch.manual_seed(1)
    report = measure_memory(lambda: forward().square().mean())
    return report.retained_bytes, report.peak_bytes
base = step_counts(runs["no checkpointing"])
def rerun(forward):  # above no checkpointing's step: (aten ops, matmuls, FLOPs)
    return tuple(c - b for c, b in zip(step_counts(forward), base, strict=True))
table = {name: (same(grads_of(run), expected), *memory(run), *rerun(run)) for name, run in runs.items()}
print(f"{'':<30} {'grads ok':>8} {'kept KiB':>9} {'peak KiB':>9} {'re-run ops':>10} {'matmuls':>7} "
      f"{'kFLOPs':>8}")
for name, (ok, kept, peak, n_ops, n_mm, cost) in table.items():
    print(f"{name:<30} {ok!s:>8} {kept / 1024:>9.1f} {peak / 1024:>9.1f} {n_ops:>10} {n_mm:>7} "
          f"{cost / 1000:>8.1f}")
assert all(row[0] for row in table.values())

# %% [markdown]
# Read it row by row:
#
# * **Gradients**: all equal to no checkpointing's, bitwise (`torch_remat` thanks to `CPURNG`).
# * **The plain checkpoints** keep the same bytes; `torch_remat`'s runs 4 ops more: its boundary
#   Function's `empty` and `view`, in the forward and in the re-run.
# * **Keeping the attention**: its 4 matmuls run once in all four versions (2 re-run, the
#   feed-forward's). The two SAC versions keep every output the policy names (a dispatch mode sees
#   outputs, not what autograd saves: the copies and scaled copies too); the scope and
#   `torch_remat` keep what the attention's own backward saves. The scope keeps the attention's
#   output as the scope's input; `torch_remat` persists it for the re-run (`recompute_needs_tensor`).
# * **Re-runs**: ours re-runs more ops than torch's SAC: the attention's views, which the policy
#   names and ours runs again whatever it says (notebook 05 §2.2); the scope replays only what its
#   saved tensors need, never the attention.

# %%
kept = {name: row[1] for name, row in table.items()}
assert kept["torch SAC, keep attention"] == kept["ckpt_lab SAC, keep attention"]
scope, regions = kept["ckpt_lab scope, rest in scope"], kept["torch_remat, attention region"]
assert scope <= regions < kept["torch SAC, keep attention"]
assert {row[4] for name, row in table.items() if "attention" in name or "scope" in name} == {2}
print("kept for 'keep the attention': SAC", kept["torch SAC, keep attention"], "B; torch_remat",
      kept["torch_remat, attention region"], "B; scope", kept["ckpt_lab scope, rest in scope"], "B")

# %% [markdown]
# **Time**, paired: each round runs every version once in a fresh order, one thread; each time is
# divided by torch's checkpoint's in the same round, and the median of those ratios is printed.
# Timings vary (nbval does not compare this cell):

# %% tags=["nbval-ignore-output"]
def paired_ratios(runs, reference, rounds=15):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ratios = {name: [] for name in runs}
        for r in range(rounds + 1):  # round 0 warms up
            order = sorted(runs, key=lambda n: hash((n, r)))
            seconds = {}
            for name in order:
                start = time.process_time()
                grads_of(runs[name])
                seconds[name] = time.process_time() - start
            for name in runs:
                if r:
                    ratios[name].append(seconds[name] / seconds[reference])
    finally:
        torch.set_num_threads(threads)
    return {name: statistics.median(v) for name, v in ratios.items()}
for name, ratio in paired_ratios(runs, "torch checkpoint").items():
    print(f"{name:<30} {ratio:.2f}x torch checkpoint")

# %% [markdown]
# ## 3 · What each can express that the others cannot
#
# | | names | can express | cannot |
# |---|---|---|---|
# | torch's SAC | aten ops, through a policy | a rule by op and arguments, for every block at once ("save the matmuls"); the same policy under `torch.compile` | a place in the source (only through a flag, as above); an op it cannot see (a Python-side kernel) |
# | `ckpt_lab.selective_checkpoint` | the same | torch's policies; random, in-place and view ops always re-run (right gradients where torch 2.13's SAC is silently wrong); a second backward | the same; its dispatch mode costs a Python call per op |
# | `ckpt_lab.gradient_checkpoint_scope` | a `with` block: what to **recompute** | any stretch of code, across module boundaries, with no function to wrap; what is born outside stays as autograd keeps it | keeping part of the stretch (it recomputes what it records) |
# | `torch_remat` | regions: what to **keep**, inside a checkpoint that recomputes the rest | one matmul kept and another recomputed by where they are; any callable kept whole (a custom Function's `.apply`, a kernel with no custom op); its own RNG and state hooks | a rule over ops; nested checkpoints; a bare consumer of a kept output without `recompute_needs_tensor` (above); early stop |
#
# One matmul and not its twin: the feed-forward's first `Linear` kept, its second recomputed. A SAC
# policy sees two `addmm` of the same kind; a region just wraps the first call:


# %%
def remat_ff1(h):
    h = layer.norm1(h + layer.dropout1(attention(h)))
    up = remat.region(layer.linear1, "ff.linear1", recompute=False)(h)
    remat.recompute_needs_tensor(up)
    return layer.norm2(h + layer.dropout2(layer.linear2(layer.dropout(layer.activation(up)))))
def ff1():
    return with_remat(x, remat_ff1)
assert same(grads_of(ff1), expected)
_, n_mm, _ = rerun(ff1)
print(f"torch_remat, linear1 kept: gradients bitwise equal; matmuls re-run {n_mm} "
      f"(nothing kept: {table['torch_remat, nothing kept'][4]})")

# %% [markdown]
# ## 4 · Two reports of what the forward keeps
#
# `remat.print_saved_tensors_report(loss)`, called after the forward, walks the live regions' tapes
# (`_saved_report`) and the autograd graph from the loss. `ckpt_lab.explain` runs a step under its
# two dispatch modes and lists every storage alive between forward and backward, with the op,
# module and region that made it.

# %%
torch.manual_seed(1)
loss = with_remat(x).square().mean()
remat.print_saved_tensors_report(loss)
loss.backward()

# %%
torch.manual_seed(1)
report = ckpt_lab.explain(with_remat, x, loss_fn=lambda out: out.square().mean())
print(report.summary())

# %% [markdown]
# `torch_remat`'s report is by **region and name**: what each kept region's ops saved, as autograd
# holds it, parameters left out; tensors the checkpoint itself keeps (its input) and those upstream
# of a checkpoint are not walked (its own docstring: "the walk dead-ends at the topmost checkpoint
# node"). `explain`'s is by **storage**: every byte alive after the forward, the checkpoint's input
# included, named by op, module and line, adding up to `measure_memory`'s retained bytes; it knows
# nothing of `torch_remat`'s region names.
#
# ## 5 · The scope and `torch_remat`: the design difference
#
# * **The scope names what to recompute**: a `with` block, anywhere in a function; what it records
#   is replayed when backward needs it, everything else is kept as autograd keeps it. It sees every
#   op through a dispatch mode (notebook 04), which is what lets it replay any stretch, and what it
#   costs per op.
# * **`torch_remat` names what to keep**: a function under `remat.checkpoint` is recomputed whole,
#   and regions inside it (`recompute=False`) opt out. No op is seen; it works on calls: a region is
#   skipped or run as a whole, and the dataflow between kept and recomputed code has to be declared
#   (`recompute_needs_tensor`) where a bare op crosses it.
# * Both keep what autograd saves inside the part that is not recomputed (§2's bytes), unlike SAC.
