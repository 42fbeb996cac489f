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
# # 07b · Why didn't my memory drop? `explain` on a real model
#
# **TL;DR.** GPT-2 from Hugging Face `transformers` (5.23, built from a small config: 4 blocks,
# width 128, 4 sequences of 128 tokens, GPT-2's dropout), one training step, six ways to
# checkpoint it, each measured by `ckpt_lab.explain` ([retained](glossary.md#retained): bytes
# alive when the forward ends; [peak](glossary.md#peak): the most alive at once over forward and
# backward, the leaves' gradients not counted; both exact storage bytes):
#
# | variant | retained MiB | peak MiB | retained / plain | largest holder `explain` names |
# |---|---|---|---|---|
# | plain | 43.8 | 45.8 | 1.00 | `mul` in `h.*.mlp.act` (GPT-2's GELU) |
# | transformers' switch (torch's checkpoint) | 3.0 | 14.0 | 0.07 | the loss's `_log_softmax` |
# | `ckpt_lab.checkpoint` in the same switch | 3.0 | 14.0 | 0.07 | the loss's `_log_softmax` |
# | scope around each MLP | 22.8 | 28.8 | 0.52 | attention's `_softmax` |
# | scope around each attention | 27.0 | 29.0 | 0.62 | `mul` in `h.*.mlp.act` |
# | planner, half its budget range | 38.0 | 45.5 | 0.87 | attention's `bmm`, kept by the plan |
# | peak planner, same recomputation (§7) | 25.0 | 27.0 | 0.57 | attention's `bmm`, kept by the plan |
#
# "Largest holder" is the first line of `explain`'s summary: the outputs of one op, grouped across
# the blocks, that hold the most bytes *kept after the forward*. §7's peak ledger is another
# measure: it splits the bytes alive *at the peak* by part (kept, re-run, backward's temporaries).
#
# Before any checkpoint, `explain` points at GPT-2's GELU: written as Python arithmetic, it keeps
# 16 MiB; the fused `gelu_pytorch_tanh` keeps 4 (43.8 → 31.8 MiB, §1). All seven give the plain
# step's gradients, bit for bit. `ckpt_lab.checkpoint` and the planner drop
# into the library's own switch; the scope goes around a submodule's `forward` (§4, §8). The
# planner bounds the retained bytes and leaves the peak where it was; the peak planner bounds the
# peak: at the same recomputation it peaks at 27.0 MiB where the retained-bytes plan peaks at 44.8
# (§7, with the model cut into a chain of regions).
#
# **After this notebook you can**
# 1. run `explain` on a Hugging Face model and read what it keeps and what stands at its peak
#    (checked: §1's asserts against `measure_memory`; §2's prediction);
# 2. put `ckpt_lab`'s checkpoints into `transformers`' own switch, or around a submodule (checked:
#    §3's same bytes; §8's gradients, bit for bit);
# 3. say why a budget on retained bytes leaves the peak in place, and plan the peak instead
#    (checked: §7's prediction and asserts).
#
# The companion notebook [07 · Why didn't my memory drop?](07_why_memory_did_not_drop.ipynb) shows
# the failure zoo on small models; this one is the same instrument on a model people train.
#
# | question | section |
# |---|---|
# | What does GPT-2 keep for backward, and who? | 1 |
# | How does `transformers` checkpoint a block, and where does ours plug in? | 2, 3 |
# | What does a scope around the MLP or the attention keep? | 4 |
# | What does the planner do at a budget, and why does the peak stay? | 5 |
# | The step over time, plain and checkpointed | 6 |
# | What stands at the peak, and what does a plan for the peak change? | 7 |
# | Which of ours drop into a real model's code, and how? | 8 |

# %%
import types
import warnings

import matplotlib.pyplot as plt
import torch

# transformers imports tqdm's notebook progress bars, which warn when ipywidgets is absent.
warnings.filterwarnings("ignore", message="IProgress not found")
import transformers

import ckpt_lab
from ckpt_lab.bench.peak import gpt2_chain
from ckpt_lab.cases.real import checkpointed_layers, gpt2, lm_loss, plan_layers, scope_submodules
from ckpt_lab.explain import explain
from ckpt_lab.helpers.predict import reveal
from ckpt_lab.helpers.viz import save_figure
from ckpt_lab.instruments.memory import measure_memory
from ckpt_lab.peak_planner import peak_frontier, profile_peak
from ckpt_lab.planner import budget_range, solve

print("torch", torch.__version__, "| transformers", transformers.__version__)

# %%
MiB = 2**20
reports, grads = {}, {}


def step(name, model, ids):
    """One explained training step (model's own LM loss), dropout seeded alike for every variant."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    reports[name] = explain(model, ids, labels=ids, loss_fn=lm_loss)
    grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return reports[name]


# %% [markdown]
# ## 1 · The model, plain
#
# `gpt2()` (in `ckpt_lab.cases.real`) builds `GPT2LMHeadModel` from a `GPT2Config`, seeded, in
# training mode. Two choices are spelled out: *eager* attention (softmax, dropout and the matmuls
# as separate ops, which `explain` can name; SDPA, PyTorch's fused
# `scaled_dot_product_attention`, would run them as one) and a vocabulary of 512 tokens. The
# loss is the model's own: `model(ids, labels=ids).loss`, which `explain` gets as `loss_fn`.

# %%
model, ids = gpt2()
params = sum(p.numel() for p in model.parameters())
print(f"{type(model).__name__}: {len(checkpointed_layers(model))} blocks, {params:,} parameters; "
      f"input ids {tuple(ids.shape)}")
print(step("plain", model, ids).summary(top=8))

# %% [markdown]
# Read top down: 43.8 MiB kept, thirteen times the parameters. The largest holders are in
# `mlp.act`: GPT-2's `gelu_new` is written as Python arithmetic (`0.5 * x * (1 + tanh(...))`), and
# each `mul`, `add` and `tanh` keeps a tensor as large as the MLP's hidden layer. In `attn`, the
# `empty_like` filled by `bernoulli_` and a `mul` are attention's dropout (its mask, its output);
# the `clone`s (256 KiB each) are contiguous copies that `torch.matmul` makes of query, key and
# value for its batched multiply, and one of the output before `c_proj`. None of it is inside a
# checkpoint yet.
#
# The largest holder is an implementation choice, not a law: `gelu_pytorch_tanh` is the same
# function as one fused op. Its backward reads its input (`c_fc`'s output, kept anyway), so of
# what `mlp.act` makes only its output stays (`c_proj` needs it). One config field, no checkpoint:

# %%
fused_model, _ = gpt2(activation="gelu_pytorch_tanh")  # the same weights and tokens, seed 0
fused = explain(fused_model, ids, labels=ids, loss_fn=lm_loss)
for name, r in (("gelu_new", reports["plain"]), ("gelu_pytorch_tanh", fused)):
    act = sum(row.bytes for row in r.saved if row.module.endswith("mlp.act"))
    print(f"{name:<18} kept {r.retained_bytes / MiB:5.1f} MiB, of it in mlp.act {act / MiB:4.1f} MiB; "
          f"peak {r.peak_bytes / MiB:5.1f} MiB")

# %% [markdown]
# 12 MiB less, a quarter of the step, before any checkpoint. The rest of this notebook keeps
# GPT-2's own `gelu_new`.
#
# Is the report right? `measure_memory`, the instrument every notebook measures with, runs the
# same step. The two must agree to the byte, and what `explain` lists must add up:

# %%
reference = measure_memory(lambda: model(ids, labels=ids).loss)
plain = reports["plain"]
print("retained:", plain.retained_bytes, "==", reference.retained_bytes, "| peak:", plain.peak_bytes,
      "==", reference.peak_bytes)
assert (plain.retained_bytes, plain.peak_bytes) == (reference.retained_bytes, reference.peak_bytes)
print(f"{plain.saved_bytes} in {len(plain.saved)} listed storages + {plain.loss_bytes} (the loss) "
      f"= {plain.saved_bytes + plain.loss_bytes}")
assert plain.retained_bytes == plain.saved_bytes + plain.loss_bytes

# %% [markdown]
# ## 2 · The library's own switch
#
# `transformers` 5.23 calls it `model.activation_checkpointing_enable()`; `gradient_checkpointing_enable()`,
# the name most code uses, still works and warns that it goes away in version 6. What it does
# (`modeling_utils.py` and `modeling_layers.py`):
#
# 1. it makes `partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)` (the switch's
#    keyword arguments are only torch's) and stores it on every block as the attribute
#    `_gradient_checkpointing_func` (the *plug*, below: whatever function sits in that attribute
#    does the checkpointing), and sets the block's `gradient_checkpointing` flag;
# 2. each block is a `GradientCheckpointingLayer`, whose `forward` was wrapped when the class was
#    made: in training mode, flag set, it calls
#    `self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)`.
#
# So the positional arguments (the hidden states, and GPT-2's attention mask) are the
# checkpoint's inputs, the keyword arguments ride inside the `partial`, and module hooks stay
# outside the checkpoint.

# %%
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gpt2()[0].gradient_checkpointing_enable()  # the old name
print("old name:", caught[0].category.__name__, "-", str(caught[0].message).split(". ")[0])
model, ids = gpt2()
model.activation_checkpointing_enable()
block = model.transformer.h[0]
print(type(block).__mro__[1].__name__, "| flag:", block.gradient_checkpointing, "| plug:",
      block._gradient_checkpointing_func.func.__module__, block._gradient_checkpointing_func.keywords)

# %% [markdown]
# **Predict.** Every block is checkpointed now. Without checkpoints the step retains 43.8 MiB and
# peaks at 45.8 MiB. What is its peak now, in MiB?

# %%
guess = None  # your guess, in MiB

# %%
switch = step("transformers' switch", model, ids)
print(switch.summary())
reveal(guess, round(switch.peak_bytes / MiB, 1), "peak in MiB", rel_tol=0.1)

# %% [markdown]
# 3.0 MiB retained, from 43.8: each checkpoint "keeps only its inputs", and the largest holder now
# is the loss's `_log_softmax` (4 × 128 tokens × 512 logits), outside any module. The peak, 14.0
# MiB, comes in backward, and the peak ledger (the "at the peak" line) says what stands there: 9.0
# MiB rebuilt by the re-run of checkpoint #4 (the last block, which backward re-runs first), alive
# while backward goes through it, beside backward's own temporaries and the 1.5 MiB kept. "Re-running
# it allocates 19.0 MiB in total" is a running total of the bytes born during one block's re-run,
# not bytes alive at once, so it can exceed the peak.

# %% [markdown]
# ## 3 · `ckpt_lab.checkpoint` in the same switch
#
# The switch takes no other function, but the attribute it sets is the plug (§2): anything called like
# torch's checkpoint can sit there. `ckpt_lab.checkpoint` is (it accepts `use_reentrant=False`).
# Switch on, then replace the function, block by block; the switch's other work stays (which
# blocks, `use_cache` off). `ckpt_lab.cases.real.use_checkpoint_function(model, fn)` is these lines.

# %%
model, ids = gpt2()
model.activation_checkpointing_enable()
for layer in checkpointed_layers(model):  # the GradientCheckpointingLayer modules
    layer._gradient_checkpointing_func = ckpt_lab.checkpoint
ours = step("ckpt_lab.checkpoint in the switch", model, ids)
print(ours.summary())
torchs = reports["transformers' switch"]
same = (ours.retained_bytes, ours.peak_bytes) == (torchs.retained_bytes, torchs.peak_bytes)
print("same bytes as torch's:", same)
assert same

# %% [markdown]
# The same bytes, and `explain` tells the two apart by their pack hooks: `checkpoint
# (ckpt_lab.checkpoint)` here, `(torch.utils.checkpoint)` in §2.
#
# ## 4 · The scope around each block's MLP, or its attention
#
# `gradient_checkpoint_scope` (notebook 04) is a `with` block: every tensor created inside it is
# recomputed in backward. It goes around code, not a function, so to put it around each MLP we
# wrap the module's `forward`, on the instance: module paths, `state_dict` keys and hooks stay as
# they were. `scope_submodules(model, "mlp")` does it for every submodule called `mlp`:
#
# ```python
# def scoped_forward(*args, **kwargs):          # for each module m to scope, forward = m.forward
#     with ckpt_lab.gradient_checkpoint_scope():
#         return forward(*args, **kwargs)
# m.forward = scoped_forward
# ```
#
# The switch stays off: a scope inside a checkpoint does nothing (notebook 04b, §A.8 *A scope inside a
# checkpointed function does nothing*).

# %%
for part in ("mlp", "attn"):
    model, ids = gpt2()
    paths = scope_submodules(model, part)
    report = step(f"scope around each {'MLP' if part == 'mlp' else 'attention'}", model, ids)
    print(f"--- {paths}\n{report.summary(top=3)}")
    made_inside = sum(r.bytes for r in report.saved if f".{part}" in r.module)
    ln = "ln_2" if part == "mlp" else "ln_1"  # the LayerNorm in front of the scoped part
    ln_bytes = sum(r.bytes for r in report.saved if r.module.endswith(ln))
    print(f"kept, made by modules inside the scoped {part}: {made_inside} bytes;",
          f"{ln} outputs: {ln_bytes} bytes\n")

# %% [markdown]
# Around the MLP: 22.8 MiB, about half. Nothing the MLP made is kept (0 bytes, the GELU's
# intermediates included); what is left is the attention's softmax, dropout mask and scaled
# output, which the scope does not cover, and what comes into the MLP from outside: its input,
# `ln_2`'s output (1.0 MiB over the four blocks), made before the scope opened. Around the
# attention: 27.0 MiB, and the GELU's tensors lead again. A scope frees exactly what its block of code makes;
# a checkpoint around the whole block frees everything but the block's input.

# %% [markdown]
# ## 5 · The planner at a budget
#
# `ckpt_lab.planner.plan(function, *args, budget=...)` profiles a function with its arguments and
# chooses which op outputs to keep within a byte budget (notebook 05). A `transformers` block is
# called with keyword arguments only the model knows (masks, position ids), so we let the switch
# find them: `plan_layers(model, ids, labels=ids)` runs one forward with a profiling function in
# the plug (`planner.profile` on each block as the model calls it), solves one budget over the
# four blocks (`planner.solve`), and plugs a `selective_checkpoint` per block. The budget: half of
# the planner's range, from keeping only the blocks' inputs to keeping every candidate.

# %%
model, ids = gpt2()
plan = plan_layers(model, ids, labels=ids, fraction=0.5)
planned = step("planner, half its budget range", model, ids)
inside = sum(row.bytes for row in planned.saved if row.region)
print(f"budget {plan.budget / MiB:.1f} MiB; the plan predicts {plan.retained_bytes / MiB:.1f} MiB kept by "
      f"the blocks; measured inside them {inside / MiB:.1f} MiB; {len(plan.saved_ops)} op outputs kept")
print("each block's inputs:", [p.input_bytes for p in plan.profiles], "bytes; hidden states",
      ids.numel() * 128 * 4, "bytes")
print(planned.summary(top=3))

# %% [markdown]
# The prediction is 1.0 MiB above the measurement: each block's inputs are its hidden states and
# the attention mask (256 KiB each, GPT-2 passes both positionally); the planner counts the mask
# once per block, but it is one tensor, made outside the blocks. The whole step keeps 38.0 MiB
# (36.0 of it inside the blocks), and the peak hardly moves (45.5 MiB against 45.8). The ledger
# says why: the budget bounds what is *kept* between forward and backward, and at the peak, in
# backward, 34.0 MiB of it is still alive while the last block is re-run (8.0 MiB). Its verdict
# offers a smaller budget, which costs recomputation, or the peak planner, which §7 uses.

# %% [markdown]
# ## 6 · The step over time
#
# `report.plot(ax)` draws the live bytes after every storage born or freed, the recomputations
# shaded, and the peak with what was alive at it. Plain, the library's switch, ours in it:

# %%
names = ["plain", "transformers' switch", "ckpt_lab.checkpoint in the switch"]
fig, axes = plt.subplots(len(names), 1, figsize=(14, 9))  # own y scale each; wide: the box clears backward
for ax, name in zip(axes, names, strict=True):
    reports[name].plot(ax)
    ax.set_title(f"GPT-2 (4 blocks), {name}: {reports[name].retained_bytes / MiB:.1f} MiB kept after forward")
fig.tight_layout()
save_figure(fig, "07b_gpt2_timeline")

# %% [markdown]
# Plain, the curve climbs through the forward and falls through backward. Checkpointed, it stays
# low in forward and rises in four teeth in backward: one block re-run at a time (orange), then
# freed. Torch's and ours: the same shape, the same 14.0 MiB peak.

# %% [markdown]
# ## 7 · The peak, not the kept bytes
#
# A step runs out of memory at its peak, and §5's peak is mostly the *kept* bytes plus one re-run.
# `ckpt_lab.peak_planner` budgets the peak itself. It needs the step as a chain of regions, each
# taking and returning one tensor: `ckpt_lab.bench.peak.gpt2_chain()` cuts this GPT-2 into its
# embedding, its four blocks, and its head with the loss (the same ops and, §8 checks, the same
# gradients bit for bit; the causal mask is made once, before the step). `profile_peak` runs every
# *way* of every region once, alone, forward and backward, and records what it makes and frees,
# byte for byte. A way is plain (not checkpointed) or checkpointed keeping a set of op outputs. Any
# choice of ways can then be simulated without running it:

# %%
chain = gpt2_chain()
profile = profile_peak(chain.regions, chain.input, chain.loss)
print(f"{len(chain.regions)} regions (embedding, 4 blocks), then the head and loss;",
      "ways per region:", [len(ways) for ways in profile.ways])

# %% [markdown]
# Two plans on these regions. The retained-bytes planner of §5 at half its budget range, its peak
# predicted by the same simulation. And, among the peak planner's plans that recompute no more
# than it, the one with the lowest predicted peak (`peak_frontier`: the plans that no other beats
# in both peak and recomputation; `solve_peak(profile, budget)` takes a peak budget instead).
#
# **Predict.** The peak plan chooses a way for each of the five regions. How many does it leave
# plain, not checkpointed at all?

# %%
guess = None  # your guess: 0 to 5

# %%
low, high = budget_range(profile.profiles)
retained_plan = solve(profile.profiles, low + (high - low) // 2)
peak_plan = min((p for p in peak_frontier(profile) if p.recompute_cost <= retained_plan.recompute_cost),
                key=lambda p: p.predicted_peak)
plans = {"retained-bytes plan": retained_plan, "peak plan": peak_plan}
predicted = {"retained-bytes plan": profile.predict(retained_plan.saved).peak_bytes,
             "peak plan": peak_plan.predicted_peak}
for name, plan in plans.items():
    torch.manual_seed(1)
    measured = measure_memory(lambda plan=plan: chain.loss(plan(chain.input)))
    print(f"{name:<20} peak predicted {predicted[name] / MiB:.1f} MiB, "
          f"measured {measured.peak_bytes / MiB:.1f} MiB ({measured.peak_bytes:,} B); "
          f"recomputes {plan.recompute_cost / 1e6:.2f} MFLOP")
    assert measured.peak_bytes == predicted[name]
print("retained-bytes plan:", [f"keep {len(kept)} of {len(p.candidates)}"
                               for kept, p in zip(retained_plan.saved, retained_plan.profiles, strict=True)])
print("peak plan:          ", peak_plan.ways)
reveal(guess, peak_plan.ways.count("plain"), "regions left plain")

# %% [markdown]
# Predicted equals measured, to the byte, for both; at the same recomputation the peak falls from
# 44.8 to 27.0 MiB (§5's plan peaked at 45.5: on the chain the embedding is a region too, and the
# mask is made before the step). The peak plan leaves the embedding and the last block plain. The last block is
# the one backward goes through first: checkpointed, its re-run stands at the peak on top of
# everything kept (notebook 07, §1). And a region checkpointed with everything kept still re-runs
# the rest (dropout, views, in-place ops) and keeps its input besides, where a plain one re-runs
# nothing; the retained-bytes planner checkpoints every region. The peak ledger of each plan, by
# role, as `explain` measures it (the bytes alive at the peak, by part; not the TL;DR's "largest
# holder", which groups the bytes kept after the forward by op):

# %%
def chain_step(plan):
    """One explained step of the chain run by ``plan``, seeded as ``step`` seeds the model's."""
    for p in chain.params:
        p.grad = None
    torch.manual_seed(1)
    run = types.MethodType(lambda model, x: plan(x), chain.model)  # bound: explain names the modules
    report = explain(run, chain.input, loss_fn=chain.loss)
    return report, {n: p.grad.clone() for n, p in chain.model.named_parameters()}
explained = {name: chain_step(plan) for name, plan in plans.items()}
for name, (report, _) in explained.items():
    ledger = report.peak_ledger
    kept = report.retained_bytes / MiB
    print(f"{name} (kept after forward {kept:.1f} MiB), at the peak, in {ledger.phase}:")
    print("\n".join(f"  {size:>12,} B  {role}" for role, size in ledger.roles.items()))
    print(f"  {ledger.bytes:>12,} B  the peak\n  to lower it: {ledger.verdict}")
    assert sum(ledger.roles.values()) == ledger.bytes == predicted[name]
reports["peak planner, same recomputation"], grads["peak planner, same recomputation"] = \
    explained["peak plan"]  # for §8's table and its gradient check

# %% [markdown]
# The retained-bytes plan's peak comes while backward goes through the last block: its kept bytes,
# the last block's re-run and backward's temporaries. The peak plan keeps less (the plain regions
# hold their activations, the checkpointed blocks keep a few outputs each) and re-runs nothing at
# its peak, which moves to the loss's backward. Over time (as in §6), on one scale:

# %%
fig, axes = plt.subplots(1, 2, figsize=(14, 4.2), sharey=True)
for ax, (name, (report, _)) in zip(axes, explained.items(), strict=True):
    report.plot(ax)
    ax.set_title(f"GPT-2 as a chain, {name}: peak {report.peak_bytes / MiB:.1f} MiB")
fig.tight_layout()
save_figure(fig, "07b_peak_plan")

# %% [markdown]
# ## 8 · The seven variants, and which of ours drop in
#
# The table of the TL;DR, from the reports above; and the gradients, compared with the plain
# step's bit for bit (dropout draws the same masks: every checkpoint replays the random state). The
# peak plan ran on §7's chain, a GPT-2 built from the same seed: its parameters have the same names.

# %%
plain = reports["plain"]
print(f"{'variant':<36}{'retained MiB':>13}{'peak MiB':>10}{'ratio':>7}  largest holder")
for name, r in reports.items():
    line = next(line for line in r.summary(top=1).splitlines() if line.startswith("  "))
    op = line.split("`")[1]  # "... outputs of `op` in 4 modules (path), kept by ..."
    where = "outside any module" if "outside any module" in line else "in " + (
        line.split("(")[1].split(")")[0] if " modules (" in line else line.split(" in ")[1].split(",")[0])
    print(f"{name:<36}{r.retained_bytes / MiB:>13.1f}{r.peak_bytes / MiB:>10.1f}"
          f"{r.retained_bytes / plain.retained_bytes:>7.2f}  `{op}` {where}")
same = {name: all(torch.equal(g[k], grads["plain"][k]) for k in g) for name, g in grads.items()}
print("gradients equal to the plain step's:", same)
assert all(same.values())

# %% [markdown]
# **Which of ours drop into a real model's code, and how.**
#
# * `ckpt_lab.checkpoint`: anywhere torch's non-reentrant checkpoint is called, with the same
#   arguments. In `transformers`, after the switch, store it in each block's plug:
#
#   ```python
#   model.activation_checkpointing_enable()
#   for layer in checkpointed_layers(model):      # isinstance(m, GradientCheckpointingLayer)
#       layer._gradient_checkpointing_func = ckpt_lab.checkpoint
#   ```
#
# * the planner: through the same plug, one `selective_checkpoint` per block with its share of one
#   budget; the blocks' keyword arguments are why it is profiled through the model
#   (`plan_layers(model, ids, labels=ids)`), not called as `planner.plan(block, x)`.
# * `gradient_checkpoint_scope`: around any code you can edit, or around a submodule's `forward`
#   without editing it (§4); not inside the switch's checkpoint, where it does nothing.
# * the peak planner: over a chain of regions that each take and return one tensor
#   (`plan_peak(regions, x, budget, loss)`); a `transformers` model is not one, so §7 cut it by hand
#   (`gpt2_chain`).
#
# From a shell, the same report and plot for any of these:
# `python -m ckpt_lab.explain ckpt_lab.cases.real:gpt2_ckpt_lab --plot gpt2.png`
# (factories: `gpt2_plain`, `gpt2_transformers`, `gpt2_ckpt_lab`, `gpt2_scope_mlp`,
# `gpt2_scope_attn`, `gpt2_planned`).
