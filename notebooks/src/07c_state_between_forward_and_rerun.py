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
# # 07c · Cases from the field: state that changes between the forward and the re-run
#
# **TL;DR.** A checkpoint runs the region's Python code twice: in the forward, and again in
# backward. Whatever the first run changes (a counter, a cache, a router's tie-break) the second run
# sees changed. Each case below is one training step on the CPU, run three ways: torch's
# non-reentrant checkpoint, ours, and fixed. The table is printed by the cell after it.
#
# | case | torch | ours | the fix |
# |---|---|---|---|
# | MoE router, top-1 flips on a near-tie, other counts | `CheckpointError` | `CheckpointError` | route outside the checkpoint |
# | the same, the same counts | wrong gradients, silently | the same | route outside the checkpoint |
# | expert-load counter | counts 10 tokens for 5 | `state_check="warn"` names the buffer | `state_check="restore"` or `is_recomputing()` |
# | KV cache appended in forward | `CheckpointError` (shapes) | `state_check="raise"` names the cache | `state_check="restore"` |
# | module caching its last activation | keeps the forward's graph | the same | cache `h.detach()` |
# | wrapper checkpointing each child | keeps each child's input | the same | checkpoint the layer |
# | SAC callable policy comparing with `aten.mm` | saves none of the ops, silently | a warning saying so | compare with `aten.mm.default` |
# | `ctx.saved_tensors` read twice | `CheckpointError` | the same sentence, and what to do | read it once |
# | `determinism_check="none"` as a silencer | wrong gradients | `CheckpointError` naming sin and cos | fix the branch, keep the check |
#
# Every case is one record in `ckpt_lab.cases.field.CASES` (a model factory, the step, the three
# outcomes in words); `ckpt_lab.cases.field.run(case, how)` runs it. Adding a case is adding one record.

# %%
import warnings

import torch

import ckpt_lab
from ckpt_lab.cases import field

warnings.simplefilter("ignore", DeprecationWarning)
torch.manual_seed(0)
for case in field.CASES:
    print(f"{case.name}  ({case.source})")
    for how in ("torch", "ours", "fix"):
        print(f"    {how:5}  {field.run(case, how)}")

# %% [markdown]
# ## 1 · What the guard says
#
# `ckpt_lab.checkpoint(..., state_check=...)` compares the state of the modules the region reaches
# (buffers; public attributes holding numbers, tensors, lists, dicts: their lengths) before the
# forward and before the re-run. `"warn"` and `"raise"` name what changed, module path and attribute;
# `"restore"` copies that state at the forward and puts it back for the re-run. The expert-load
# counter, a buffer the forward adds to in place:

# %%
model = field.LoadCountingMoE()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ckpt_lab.checkpoint(model, torch.randn(field.TOKENS, field.WIDTH), state_check="warn").sum().backward()
print(caught[0].message)
assert int(model.tokens_per_expert.sum()) == 2 * field.TOKENS

# %% [markdown]
# The KV cache, a list the forward appends to: torch raises on the shapes, after the fact; the guard
# raises before the re-run, naming the list.

# %%
x = torch.randn(field.TOKENS, field.WIDTH)
try:
    ckpt_lab.checkpoint(field.Attention(), x, state_check="raise").sum().backward()
except ckpt_lab.CheckpointError as error:
    print(error)

# %% [markdown]
# ## 2 · Code that must run once: `is_recomputing()`
#
# `ckpt_lab.is_recomputing()` is `True` inside the re-runs of our checkpoints (reentrant,
# non-reentrant, selective, sequential): a counter, a metric or a cache write asks it first.

# %%
model = field.LoadCountingMoE(guard_with_is_recomputing=True)
ckpt_lab.checkpoint(model, torch.randn(field.TOKENS, field.WIDTH)).sum().backward()
print("counted", int(model.tokens_per_expert.sum()), "tokens for", field.TOKENS)
assert int(model.tokens_per_expert.sum()) == field.TOKENS

# %% [markdown]
# What the guard cannot see: global variables, a closure's values other than modules, attributes
# whose names start with an underscore, the contents of lists and dicts (only their lengths), C++
# state, and Python's or NumPy's random generators. The near-tie router above is such a case: the
# tie breaks in the last bit of a kernel's result, which is no module's state. Its fix is to save
# what the router decided (its output and top-k) and pass it into the checkpoint.

# %% [markdown]
# ## 3 · The wrapper that checkpoints each child, through `explain`
#
# A wrapper that wraps every child of a layer in its own checkpoint keeps what flows between the
# children: each child's output is the next one's input. `explain` names each tensor kept between
# forward and backward; on the toy decoder layer, per child against the whole layer:

# %%
layer, x = field.DecoderLayer(), torch.randn(4, 32, 64, requires_grad=True)
per_child = ckpt_lab.explain(lambda t: layer(t, wrap=ckpt_lab.checkpoint), x)
whole = ckpt_lab.explain(lambda t: ckpt_lab.checkpoint(layer, t), x)
for row in per_child.saved:
    print(f"{row.bytes:>6} B  {row.op:18} {row.module:22} {row.where}")
print("kept, per child:", per_child.retained_bytes, "B; the whole layer:", whole.retained_bytes, "B")
assert whole.retained_bytes < per_child.retained_bytes
