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
# # 07 · Why didn't my memory drop? A failure zoo
#
# **TL;DR.** A checkpoint frees only what is made inside it *and* referenced by nothing else, and
# helps the peak only if backward does not re-run it while everything else is still alive. Eight
# ways to miss that, each a small CPU case below, with `ckpt_lab.explain`'s output naming the
# cause and the fix measured:
#
# | # | symptom | cause | fix |
# |---|---|---|---|
# | [1](#c1) | peak unchanged | the whole function, or only its last block, is checkpointed | one checkpoint per block, the last block plain |
# | [2](#c2) | kept bytes unchanged | the caller keeps what the checkpoint should free: its input, logged activations | checkpoint more than one op; log floats, not tensors |
# | [3](#c3) | nothing to drop, or no gradient | under `torch.no_grad()`; a reentrant checkpoint whose inputs need no grad | nothing to do in eval; use the non-reentrant checkpoint |
# | [4](#c4) | (memory fine) BatchNorm counts 2 batches per step | the recomputation updates the running statistics again | `skip_stats_update_in_recompute(model)` |
# | [5](#c5) | an error, or gradients off by rounding | autocast's weight-cast cache differs between forward and recomputation | ours handles it; with torch's selective checkpointing ([SAC](glossary.md#sac)), don't save the casts |
# | [6](#c6) | kept bytes differ from block to block | a selective policy with a counter shared by all calls | a fresh counter per checkpointed call |
# | [7](#c7) | DDP: "marked ready twice" | the reentrant checkpoint | the non-reentrant one, or `static_graph=True` (notebook 06) |
# | [8](#c8) | an error, or silently wrong gradients (which checkpoint does which: §8's prediction) | the recomputation takes another branch (Python's `random`) | draw the choice outside the checkpoint, pass it in |
#
# Every case's broken and fixed model lives in one module, `ckpt_lab.cases.zoo`, which the tests
# (`tests/test_zoo.py`) use too; `python -m ckpt_lab.explain ckpt_lab.cases.zoo:last_stage` explains
# any of its factories from a shell. [Notebook 07b](07b_explain_real_model.ipynb) runs `explain` on a
# real Hugging Face model.
#
# **After this notebook you can**
# 1. tell from `explain`'s verdicts and its peak ledger why a checkpoint lowered the retained bytes
#    but not the peak, and place checkpoints so that it does (checked: §1's prediction and asserts;
#    exercise 07);
# 2. find what the caller keeps alive behind a checkpoint's back, and fix it (checked: §2's asserts;
#    exercise 07);
# 3. say which checkpoint leaves parameters untrained when its inputs need no grad (checked: §3's assert);
# 4. say which checkpoints catch a re-run that took another branch, and keep it from happening
#    (checked: §8's prediction and asserts).
#
# Terms ([glossary](glossary.md)). [**Retained**](glossary.md#retained), printed "kept after
# forward": the bytes of the storages the forward made that are still alive when it ends, the loss
# included: what it keeps for backward. [**Peak**](glossary.md#peak): the most bytes alive at one
# moment over forward and backward, the leaves' gradients not counted. Both are exact
# [storage](glossary.md#storage) sizes, the same on every machine. `explain` (the function
# `ckpt_lab.explain`) runs one step and says which storages were kept and who made them, what was
# alive at the peak and in which role (its *peak ledger*), and gives each checkpoint a *verdict*.

# %%
import random
import warnings

import matplotlib.pyplot as plt
import torch
from torch.utils.checkpoint import CheckpointError, DefaultDeviceType

from ckpt_lab import checkpoint, explain, measure_memory
from ckpt_lab.cases import zoo
from ckpt_lab.helpers.predict import reveal
from ckpt_lab.helpers.show import show_source
from ckpt_lab.helpers.viz import save_figure
from ckpt_lab.rng import ReplayState

print("torch", torch.__version__)

# %%
def step(factory, *args):
    """explain one training step of a zoo factory's model."""
    model, x, loss_fn = factory(*args)
    return explain(model, x, loss_fn=loss_fn)


def verdicts(report):
    """The summary's last lines: one verdict per checkpoint."""
    lines = report.summary().splitlines()
    return "\n".join(lines[lines.index("regions:") + 1 :])


def at_peak(report):
    """The peak ledger's first line: what was alive at the peak, by role."""
    return report.peak_ledger.lines()[0]


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


# %% [markdown]
# <a id="c1"></a>
# ## 1. The whole function, or only its last block
#
# Four blocks (Linear 64→256, GELU, Linear 256→64; a batch of 32), an MSE loss. The checkpoint
# (`ckpt_lab.checkpoint`) goes around all four blocks, around the last one only, or around each
# block but the last.
#
# **Predict.** Around all four blocks, the checkpoint cuts the retained bytes from 304 KiB to 24 KiB
# (the next cell prints both). By how many bytes does it lower the step's peak?

# %%
guess = None  # your guess, in bytes

# %%
placements = {
    "no checkpoint": zoo.no_checkpoint,
    "whole function": zoo.whole_function,
    "last block only": zoo.last_stage,
    "each block but the last": zoo.each_block_but_last,
}
reports = {name: step(factory) for name, factory in placements.items()}
for name, r in reports.items():
    print(f"{name:24} kept after forward {r.retained_bytes:>8,} B   peak {r.peak_bytes:>8,} B")
plain, whole, last, fixed = reports.values()
reveal(guess, plain.peak_bytes - whole.peak_bytes, "bytes the peak drops")
assert whole.retained_bytes < last.retained_bytes < plain.retained_bytes
assert whole.peak_bytes == last.peak_bytes == plain.peak_bytes

# %% [markdown]
# Retained bytes fall, the peak does not move: why, activation by activation, is
# [notebook 02, §9 *Where checkpointing saves nothing*](02_reentrant_checkpoint.ipynb#saves-nothing) (the same
# placements on 02's stack). What `explain` adds is that it says so on any model. Its peak ledger:
# the same 280 KiB at the peak, kept for backward without the checkpoint, rebuilt by its re-run
# with it. Its verdict names the *last stage* (the checkpoint that made the function's output),
# which backward re-runs first, while the rest of the forward is alive:

# %%
print("plain:", at_peak(plain))
print("whole:", at_peak(whole))
print("whole:", verdicts(whole))
print("last: ", verdicts(last))
assert whole.peak_ledger.roles["re-run of checkpoint #1 (ckpt_lab.checkpoint)"] == \
    plain.peak_ledger.roles["kept for backward"]

# %% [markdown]
# The fix: one checkpoint per block, the last block left plain:

# %%
print("each block but the last:", verdicts(fixed), sep="\n")
print(f"peak {fixed.peak_bytes:,} B = {fixed.peak_bytes / plain.peak_bytes:.2f} × the plain step's")
assert fixed.peak_bytes < 0.45 * plain.peak_bytes

# %% [markdown]
# The same three steps over time, from `report.plot()` (live bytes after each storage born or freed;
# orange: backward re-running a checkpoint; the box: the peak ledger by role):

# %%
fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), sharey=True)
for ax, name in zip(axes, ["no checkpoint", "whole function", "each block but the last"], strict=True):
    reports[name].plot(ax)
    ax.set_title(f"{name}: peak {reports[name].peak_bytes / 1024:.0f} KiB")
# Head room for the peak's box that plot() writes in the top left corner, above the curves.
axes[0].set_ylim(0, 2.3 * plain.peak_bytes / 2**20)
fig.tight_layout()
save_figure(fig, "07_where_the_checkpoint_goes")
plt.show()

# %% [markdown]
# Left and middle reach the same height: the whole-function checkpoint only moves the activations'
# lifetime into backward. Right: each re-run rebuilds one block, after the blocks above it have
# been freed.

# %% [markdown]
# <a id="c2"></a>
# ## 2. The caller keeps what the checkpoint should free
#
# A checkpoint keeps its inputs and frees what is made inside it, *if nothing else holds it*. Two
# ways the caller holds it. First, a checkpoint around one op whose only saved tensor is its input
# (GELU saves its input; the checkpoint keeps that same input; 02 §9 measures it too):

# %%
one_op = step(zoo.around_one_op)
print(f"kept after forward: {one_op.retained_bytes:,} B with a checkpoint per GELU, "
      f"{plain.retained_bytes:,} B without")
print(verdicts(one_op))
assert one_op.retained_bytes == plain.retained_bytes

# %% [markdown]
# Second, a forward hook that keeps each GELU output for logging, with every block but the last
# checkpointed as in the fix of §1:

# %%
show_source(zoo.Chain._log_tensor, start="self.logged")

# %%
model, x, loss_fn = zoo.logged_tensors()
logged = explain(model, x, loss_fn=loss_fn)
print(f"kept after forward: {logged.retained_bytes:,} B (without the hook {fixed.retained_bytes:,} B); "
      f"{len(model.logged)} tensors logged")
print(verdicts(logged))
assert logged.retained_bytes > fixed.retained_bytes and len(model.logged) == 7

# %% [markdown]
# "Keeps 32.0 KiB of its own besides its outputs ...: tensors referenced from outside it": the
# logged GELU outputs. And 7 entries for 4 GELUs: the recomputation runs the hook again. The fix logs a
# number, and only in the forward (`ckpt_lab.batchnorm.in_backward` tells a recomputation apart):

# %%
show_source(zoo.Chain._log_number, start="if not")

# %%
model, x, loss_fn = zoo.logged_numbers()
numbers = explain(model, x, loss_fn=loss_fn)
print(f"kept after forward: {numbers.retained_bytes:,} B; logged: {len(model.logged)} floats")
assert numbers.retained_bytes == fixed.retained_bytes and len(model.logged) == 4

# %% [markdown]
# **Your turn.** `exercises/07_memory_target.py` holds a model whose memory does not drop (open it
# from the file browser): find why with `explain`, fix it to the byte targets the file states; the
# cell below grades it.

# %%
from ckpt_lab.exercises import check

check("07-memory-target", "exercises/07_memory_target.py")

# %% [markdown]
# <a id="c3"></a>
# ## 3. No gradient to track
#
# Under `torch.no_grad()` (evaluation) no graph is built, so a plain forward keeps nothing already:
# the checkpoint has nothing to drop. What each variant does there:

# %%
layer, x = zoo.block(), torch.randn(zoo.BATCH, zoo.WIDTH)
with torch.no_grad(), warnings.catch_warnings():
    warnings.simplefilter("ignore")  # counted by zoo.called_under_no_grad below
    kept = {"plain": measure_memory(lambda: layer(x).sum(), backward=False).retained_bytes}
    for name, run in zoo.CHECKPOINTS.items():
        kept[name] = measure_memory(lambda run=run: run(layer, x).sum(), backward=False).retained_bytes
for name in zoo.CHECKPOINTS:
    print(f"{name:30} kept {kept[name]} B (plain: {kept['plain']} B)", zoo.called_under_no_grad(name))
assert len(set(kept.values())) == 1
assert all(zoo.called_under_no_grad(name)["forward runs"] == 1 for name in zoo.CHECKPOINTS)

# %% [markdown]
# All four just run the function once; torch's reentrant one also warns that no input requires
# grad. Dropping the checkpoint in eval changes nothing.
#
# The trap is in training: the first block's input is the data, which needs no grad, but its
# parameters do. A *reentrant* checkpoint joins the graph only through inputs that require grad:

# %%
for name in zoo.CHECKPOINTS:
    print(f"{name:30}", zoo.params_without_grad(name))
no_grad = {name: zoo.params_without_grad(name) for name in zoo.CHECKPOINTS}
assert [r["first block's parameters without gradient"] for r in no_grad.values()] == [0, 4, 0, 4]

# %% [markdown]
# Both reentrant variants warn, and the first block's 4 parameter tensors get no gradient. The
# bytes kept are the same in all four; `explain`'s verdicts show the difference: the reentrant
# checkpoint is never re-run in backward (no "re-running it allocates"), because backward never
# reaches it:

# %%
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the warning counted above
    for name in ["torch, use_reentrant=False", "torch, use_reentrant=True"]:
        report = step(zoo.first_block_checkpointed, name)
        print(f"{name}: kept {report.retained_bytes:,} B;", verdicts(report).strip())
        assert report.regions[0].recomputed_bytes == (0 if "True" in name else 64 * 1024)

# %% [markdown]
# Fix: the non-reentrant checkpoint (`use_reentrant=False`, `ckpt_lab.checkpoint`), or
# `x.requires_grad_()` on the input.

# %% [markdown]
# <a id="c4"></a>
# ## 4. BatchNorm's running statistics, updated twice
#
# Linear, BatchNorm1d, ReLU, Linear; one training step, checkpointed or not. Why a re-run updates
# BatchNorm's running statistics a second time, and how the fix works:
# [notebook 05, §7 *The BatchNorm pitfall*](05_selective_and_planner.ipynb#batchnorm). The zoo's case:

# %%
plain_bn, plain_grads = zoo.batchnorm_step(None)
print(f"{'plain':30} num_batches_tracked {plain_bn[1].num_batches_tracked.item()}")
for name in zoo.CHECKPOINTS:
    for fixed_bn in (False, True):
        model, grads = zoo.batchnorm_step(name, fixed=fixed_bn)
        tracked = model[1].num_batches_tracked.item()
        mean_off = (model[1].running_mean - plain_bn[1].running_mean).abs().max().item()
        label = name + (" + fix" if fixed_bn else "")
        print(f"{label:36} num_batches_tracked {tracked}  running_mean off by {mean_off:.4f}  "
              f"gradients off by {max_diff(grads, plain_grads)}")
        assert tracked == (1 if fixed_bn else 2) and (mean_off == 0) == fixed_bn
        assert max_diff(grads, plain_grads) == 0

# %% [markdown]
# Gradients equal to the bit, so a test that compares gradients passes; the model evaluates worse
# later. `explain` does not name BatchNorm; its verdict shows only that backward re-runs the block
# ("re-running it allocates"), which is the second count in `num_batches_tracked`:

# %%
print(verdicts(step(zoo.batchnorm_checkpointed)))

# %% [markdown]
# <a id="c5"></a>
# ## 5. Autocast during the recomputation
#
# A checkpoint records the autocast state at its call and restores it for the re-run, so a
# `loss.backward()` outside `torch.autocast` still recomputes in bfloat16 (all four checkpoints do).
# What can still differ is autocast's **cast cache**: inside one autocast region, a weight (a leaf
# that requires grad) is cast once and the cast reused. Here the first Linear runs before the
# checkpoint in the same region, so the checkpoint's forward takes its weight from the cache, while
# the recomputation, after the region, casts it again:

# %%
reference = zoo.autocast_step(None)
autocast_results = {name: zoo.autocast_step(name) for name in zoo.AUTOCAST_RUNS}
for name, result in autocast_results.items():
    shown = result if isinstance(result, str) else f"gradients off by {max_diff(result, reference)}"
    print(f"{name:44} {shown}")

# %% [markdown]
# * torch's selective checkpointing (SAC) with a policy that saves `_to_copy` (the casts) raises:
#   the recomputation runs one more cast than the forward did.
# * `ckpt_lab.selective_checkpoint` leaves autocast's weight casts out of its op-by-op matching
#   (`ckpt_lab.selective`, NOTE [ Autocast's weight casts ]): same policy, exact gradients.
# * The reentrant variants differ by rounding, not by a bug, and only in the first Linear's weight
#   and bias (used twice): their nested backward sums the two uses' gradients in float32 in
#   `.grad`, where the plain step sums them in bfloat16 through the one cached cast. Relative to
#   the gradient:

# %%
first_weight = reference[0]
spacing = torch.finfo(torch.bfloat16).eps  # 2⁻⁷, the gap between 1 and the next bfloat16
for name in ["torch, use_reentrant=True", "ckpt_lab.reentrant_checkpoint"]:
    off = (autocast_results[name][0] - first_weight).abs().max().item()
    relative = off / first_weight.abs().max().item()
    print(f"{name:30} {relative:.4f} of the largest entry (bfloat16's spacing at 1: {spacing:.4f})")
    assert relative < 2**-6
assert all(max_diff(autocast_results[name], reference) == 0
           for name in ["torch, use_reentrant=False", "ckpt_lab.checkpoint",
                        "ckpt_lab.selective_checkpoint (same policy)"])
assert isinstance(autocast_results["torch SAC (saves matmuls and casts)"], str)

# %% [markdown]
# **Whose autocast state is restored?** torch's checkpoint and ours record the CPU's and one more
# device type's: that of the tensor arguments, or, when they are all on the CPU, the *default device
# type* (`_infer_device_type` → `DefaultDeviceType.get_device_type()` in
# [torch/utils/checkpoint.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/utils/checkpoint.py):
# the machine's accelerator type, `"cpu"` without one; ours: `ckpt_lab.rng.autocast_device_types`).
# So a GPU block called with CPU tensors inside `torch.autocast("cuda")` recomputes under it too. On
# a CPU the rule shows with another default: `"xpu"`, whose autocast a CPU build can switch on. Each
# checkpoint runs inside `torch.autocast("xpu")`, backward outside it; the default is restored after:

# %%
def block_on_xpu(v):
    xpu_autocast[name].append(torch.is_autocast_enabled("xpu"))  # in the forward, then in the re-run
    return v.sin()
xpu_autocast, default = {}, DefaultDeviceType.get_device_type()
DefaultDeviceType.set_device_type("xpu")
try:
    recorded = [device for device, _, _ in ReplayState.capture(torch.randn(2)).autocast.settings]
    for name, run in zoo.CHECKPOINTS.items():
        xpu_autocast[name] = []
        with torch.autocast("xpu", dtype=torch.float16):
            out = run(block_on_xpu, torch.randn(3, requires_grad=True))
        out.sum().backward()
finally:
    DefaultDeviceType.set_device_type(default)
print("CPU arguments, default device type 'xpu': ours records autocast for", recorded)
for name, on in xpu_autocast.items():
    print(f"{name:30} xpu autocast on in the forward, in the re-run: {on}")
assert recorded == ["cpu", "xpu"] and all(on == [True, True] for on in xpu_autocast.values())

# %% [markdown]
# <a id="c6"></a>
# ## 6. A selective policy with a counter
#
# "Save every other matmul", written with a counter in the policy's closure:

# %%
show_source(zoo.every_other_matmul, start="seen = [0]", stop="policy.seen")

# %% [markdown]
# Three blocks of three matmuls, each block in a selective checkpoint. If one policy object serves
# every call, the counter runs on from block to block: the second block starts on an even count and keeps
# its 8 KiB middle matmul instead of its 32 KiB first one. (Each block's last matmul is its output,
# handed on, not counted as kept.) A fresh counter per call:

# %%
for implementation in ["ours", "torch"]:
    kept = {}
    for factory in [zoo.counter_shared, zoo.counter_fresh]:
        kept[factory.__name__] = [r.kept_bytes for r in step(factory, implementation).regions]
    print(f"{implementation:6} kept per block: shared counter {kept['counter_shared']}, "
          f"fresh {kept['counter_fresh']}")
    assert kept["counter_shared"] == [32768, 8192, 32768] and kept["counter_fresh"] == [32768] * 3

# %% [markdown]
# Do the gradients suffer? That depends on torch's version. torch 2.11 asks the policy again
# during the recomputation (`ctx.is_recompute=True`), where the shared counter sees other calls:
# its backward raises `CheckpointError` (recomputed metadata at position 5: [32, 64] against
# [32, 256]). From 2.13 (shown here; 2.14.1 alike) torch's SAC asks only in the forward and the
# re-run looks its decisions up by position (in torch/utils/checkpoint.py the private
# `_CachingTorchDispatchMode` calls the policy, `_CachedTorchDispatchMode` only looks up); ours
# does the same. The policy is called 9 times for 9 matmuls, and the gradients equal a plain step's:

# %%
for implementation in ["ours", "torch"]:
    model, x, loss_fn = zoo.counter_shared(implementation)
    shared = model.policy_for_call()
    grads = zoo.gradients(model, x)
    plain_grads = zoo.gradients(zoo.counter_shared("none")[0], x)
    print(f"{implementation:6} policy calls on matmuls: {shared.seen[0]}, "
          f"gradients off by {max_diff(grads, plain_grads)}")
    assert shared.seen[0] == 9 and max_diff(grads, plain_grads) == 0

# %% [markdown]
# The safe form on every version: make the policy per call (`policy=every_other_matmul()` inside
# the loop; for torch, inside `context_fn`, which is called once per checkpointed call). Testing
# `ctx.is_recompute` no longer helps: in 2.13 and 2.14 it is deprecated and always `False`
# (`SelectiveCheckpointContext`, which now carries `op_output`, the op's result); only in 2.11 and
# earlier does counting under `if not ctx.is_recompute:` keep a counter right.

# %% [markdown]
# <a id="c7"></a>
# ## 7. The reentrant checkpoint under DDP
#
# "Expected to mark a variable ready only once": shown, explained and fixed in
# [notebook 06](06_distributed.ipynb), §2 *The failure: "marked as ready twice"* and §4 *The
# fixes* (the non-reentrant checkpoint, or `static_graph=True`).

# %% [markdown]
# <a id="c8"></a>
# ## 8. A recomputation that differs from the forward
#
# LayerDrop skips a block at random during training. Drawn with Python's `random` inside the
# checkpoint, it is drawn *again* when backward re-runs the block: a checkpoint replays torch's RNG,
# not Python's.

# %%
show_source(zoo.LayerDrop._maybe, start="if random")

# %% [markdown]
# With seed 10 the forward keeps the block and the recomputation skips it. The non-reentrant
# checkpoint's *determinism check* compares what the re-run saves with what the forward saved:

# %%
random.seed(10)
try:
    zoo.gradients(zoo.LayerDrop(checkpoint), torch.randn(zoo.BATCH, zoo.WIDTH, requires_grad=True))
except CheckpointError as error:  # the message; the traceback would show this machine's file paths
    print(f"{type(error).__name__}: {error}")

# %% [markdown]
# torch's (`use_reentrant=False`, `determinism_check="default"`) raises too. torch's reentrant
# checkpoint has no check and returns wrong gradients; ours (`ckpt_lab.reentrant_checkpoint`)
# compares the re-run's outputs with the forward's, norm included, and raises:

# %%
for seed in [10, 1]:
    right = zoo.layer_drop_step(None, seed)
    for name in zoo.CHECKPOINTS:
        got = zoo.layer_drop_step(name, seed)
        shown = got.split(". ")[0].split(", with")[0] if isinstance(got, str) else \
            f"gradients off by {max_diff(got, right):.4f}"
        print(f"seed {seed:2} {name:30}", shown)
    torch_wrong = zoo.layer_drop_step("torch, use_reentrant=True", seed)
    assert max_diff(torch_wrong, right) > 0.01
    assert isinstance(zoo.layer_drop_step("ckpt_lab.reentrant_checkpoint", seed), str)
assert all(isinstance(zoo.layer_drop_step(name, 10), str)
           for name in ["torch, use_reentrant=False", "ckpt_lab.checkpoint"])

# %% [markdown]
# Seed 1 is the other way round: the forward skips the block and saves nothing, so the
# non-reentrant checkpoints re-run nothing and are right by luck; torch's reentrant one recomputes
# the block and is silently wrong.
#
# A harder case: `RandomActivation` picks tanh or sigmoid at random. Each saves one tensor, of the
# same shape, dtype and device: a re-run that picks the other saves a tensor that looks the same
# from outside.
#
# **Predict.** Of the four checkpoints, how many raise an error (the other ones return wrong
# gradients)?

# %%
guess = None  # your guess: 0 to 4

# %%
right = zoo.layer_drop_step(None, 10, model=zoo.RandomActivation)
same_shape = {name: zoo.layer_drop_step(name, 10, model=zoo.RandomActivation) for name in zoo.CHECKPOINTS}
for name, got in same_shape.items():
    verdict = "raises" if isinstance(got, str) else f"no error; gradients off by {max_diff(got, right):.4f}"
    print(f"{name:30}", verdict)
reveal(guess, sum(isinstance(got, str) for got in same_shape.values()), "checkpoints that raise")
torchs = [same_shape[name] for name in ["torch, use_reentrant=False", "torch, use_reentrant=True"]]
assert all(not isinstance(got, str) and max_diff(got, right) > 1e-3 for got in torchs)
ours = ["ckpt_lab.checkpoint", "ckpt_lab.reentrant_checkpoint"]
assert all(isinstance(same_shape[name], str) for name in ours)

# %% [markdown]
# torch's non-reentrant check compares shapes, dtypes and devices, so it cannot see a re-run that
# picks the other activation; its reentrant checkpoint has no check. Ours records, for each tensor the forward saves, the op that made it (its `grad_fn`'s name, read
# at no extra cost), and names the first difference. Its `CheckpointError` is torch's subclass, so
# code written for torch catches it:

# %%
random.seed(10)
try:
    zoo.gradients(zoo.RandomActivation(checkpoint), torch.randn(zoo.BATCH, zoo.WIDTH, requires_grad=True))
except CheckpointError as error:  # torch.utils.checkpoint's
    print(str(error).split(". ")[0])

# %% [markdown]
# What the checks cost (paired time ratios on the benchmark's workloads, not re-measured here): the
# non-reentrant check reads one attribute per saved tensor, within about 2%; the reentrant one,
# whose forward saves nothing to compare, takes one norm per output in the forward and again in
# the re-run, up to +12% on tiny blocks. `determinism_check="none"` turns either off.
#
# Silently wrong gradients, then, only in torch's checkpoints. The cure is the same for all: make
# the choice outside the checkpoint and pass it in (or draw it with torch's RNG, which the
# checkpoint replays). Data-dependent branches on the *inputs* are safe (the re-run sees the same
# inputs); branches on Python state that changes (a step counter, a flag) are not.

# %%
show_source(zoo.LayerDropFixed.forward, start="keep =")

# %%
for seed in [10, 1]:
    right = zoo.layer_drop_step(None, seed, fixed=True)
    offs = [max_diff(zoo.layer_drop_step(name, seed, fixed=True), right) for name in zoo.CHECKPOINTS]
    print(f"seed {seed:2}: gradients off by {offs} (4 checkpoints)")
    assert offs == [0, 0, 0, 0]

# %% [markdown]
# ## Summary
#
# | # | cause | measured | fix, measured |
# |---|---|---|---|
# | 1 | whole function / last block checkpointed | peak 335,876 B either way, as without | each block but the last: 139,268 B |
# | 2 | caller keeps the input / logged activations | one-op checkpoint keeps as much as none; hook: 212,992 B | log floats: 114,688 B |
# | 3 | no grad | under `no_grad`: 4 B kept with or without; reentrant on data: 4 parameters untrained, never re-run | non-reentrant checkpoint |
# | 4 | BatchNorm | `num_batches_tracked` 2, gradients equal | `skip_stats_update_in_recompute`: 1 |
# | 5 | autocast cast cache | torch's SAC saving casts raises; reentrant: rounding; with CPU arguments all four restore the default device type's autocast | ours matches to the bit |
# | 6 | counter policy shared by calls | kept per block 32, 8, 32 KiB; gradients right (2.13, 2.14.1, ours); 2.11 raises | fresh counter per call: 32 KiB each |
# | 7 | reentrant + DDP | notebook 06 | notebook 06 |
# | 8 | Python `random` inside the checkpoint | ours raise `CheckpointError` wherever the gradients would be wrong; silently wrong only in torch's: reentrant (off by 0.0189), and both when shapes match | choice made outside, passed in: exact |
