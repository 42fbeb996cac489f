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
# # 02b · Appendix (optional): √N segments and recursive checkpointing
#
# **Optional.** [Notebook 02](02_reentrant_checkpoint.ipynb) builds the reentrant checkpoint and
# places one checkpoint per block; it is complete without this appendix. Here we place many along a
# chain of N layers: in `s` segments, and recursively (checkpoints inside a recomputation).
#
# **TL;DR.** Cut into `s` segments, N = 36 layers retain exactly (s − 1 + N/s) activations,
# fewest at s = √N = 6: 11 instead of 36, peak 2.85 × lower, for 1.278 × the FLOPs. Halving
# recursively retains log₂ N + 1 activations and peaks at 2 log₂ N + 1: O(log N) memory for
# O(N log N) layer runs.
#
# **After this appendix you can**
#
# 1. choose the number of segments for a chain under a memory limit, and predict what it retains
#    and how many layers it re-runs (checked: A's assert for every divisor, A's prediction;
#    exercise 02b);
# 2. say what recursive checkpointing costs (checked: B's printed equality).
#
# | question | section |
# |---|---|
# | How many segments should `checkpoint_sequential` use, and what does it cost? | A |
# | What does recursive checkpointing cost (O(log N) memory)? | B |

# %%
import math

import matplotlib.pyplot as plt
import torch
from torch import nn

from ckpt_lab import CallCounter, checkpoint_sequential, count_flops, measure_memory
from ckpt_lab.helpers.predict import reveal
from ckpt_lab.helpers.viz import save_figure
from ckpt_lab.reentrant import reentrant_checkpoint

_ = torch.manual_seed(0)
print("torch", torch.__version__)


def clear_grads(*tensors):  # so that every measurement starts without .grad
    for t in tensors:
        t.grad = None


# %% [markdown]
# ## A. √N segments
#
# `checkpoint_sequential(functions, segments, input)` cuts `N` layers into `s` chunks and
# checkpoints all but the last. Chen et al. 2016 (*Training Deep Nets with Sublinear Memory Cost*)
# show that s segments keep O(N/s + s) activations, fewest at **s = √N**, for one extra forward
# pass per step. The exact counts are ours, with one activation `a` per layer: it retains
# **(s − 1 + N/s) · a**, peaks near **(s + N/s) · a**, and re-runs all but the last segment once,
# so a step (backward ≈ two forwards) costs FLOPs × **(1 + (1 − 1/s)/3)**: our refinement of their
# one extra forward, which it approaches as s grows. N = 36 layers of `Linear(128, 128)` + `Tanh`,
# batch 32; `CallCounter` counts each layer's runs.
#
# **Predict.** At s = 6 segments, how many layer runs does a training step take (plain: 36)?

# %%
guess = None  # your guess: a number of layer runs

# %%
N, batch, width = 36, 32, 128
a = batch * width * 4
_ = torch.manual_seed(0)
stack = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(N)])
stack_x = torch.randn(batch, width, requires_grad=True)
layer_calls = [CallCounter(layer) for layer in stack]
plain_flops = count_flops(lambda: stack(stack_x).sum().backward())
rows, runs_at = [], {}
for s in [d for d in range(1, N + 1) if N % d == 0]:
    clear_grads(stack_x, *stack.parameters())
    _ = [c.reset() for c in layer_calls]
    report = measure_memory(lambda s=s: checkpoint_sequential(stack, s, stack_x, use_reentrant=True).sum())
    runs = sum(c.count for c in layer_calls)
    assert report.retained_bytes == (s - 1 + N // s) * a + 4 and runs == N + (s - 1) * (N // s)
    flops = plain_flops + (runs - N) * 2 * batch * width * width  # one more Linear forward per extra run
    rows.append((s, report.retained_bytes / a, report.peak_bytes / a, flops / plain_flops))
    runs_at[s] = runs
    if s in (1, 2, 6, 18, 36):
        print(f"s = {s:2}: retained {rows[-1][1]:4.1f} a, peak {rows[-1][2]:4.1f} a, layer runs {runs:2}, "
              f"FLOPs × {rows[-1][3]:.3f} (theory {1 + (1 - 1 / s) / 3:.3f})")
best = min(rows, key=lambda row: row[1])
print("fewest at s = √N:", best[0] == math.isqrt(N), f"| plain peak ÷ this: {rows[0][2] / best[2]:.2f}")
reveal(guess, runs_at[6], "layer runs at s = 6")

# %%
segments, fine = [row[0] for row in rows], [1 + i * (N - 1) / 200 for i in range(201)]
fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
for col, theory, label in [(1, lambda s: s - 1 + N / s, "retained: (s − 1 + N/s)·a"),
                           (2, lambda s: s + N / s, "peak: (s + N/s)·a"),
                           (3, lambda s: 1 + (1 - 1 / s) / 3, "FLOPs of a step ÷ plain: 1 + (1 − 1/s)/3")]:
    ax = axes[col // 3]
    # Bytes are measured; a step's FLOPs are computed from the measured layer runs (so they sit on
    # the curve by construction: the runs are what they count).
    marks = "markers: from measured layer runs" if col == 3 else "markers: measured"
    dots = ax.plot(segments, [row[col] for row in rows], "os"[col % 2], label=f"{label}; {marks}")
    ax.plot(fine, [theory(s) for s in fine], "-", color=dots[0].get_color(), alpha=0.5)
    ax.set(xscale="log", xlabel=f"segments s (N = {N})", ylabel="× plain" if col == 3 else "activations a")
    ax.set_xticks(segments, [str(s) for s in segments])
    ax.axvline(math.sqrt(N), color="gray", linestyle=":")
    # Below the axes: inside, the legend covers the s = 1 markers at the left edge.
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2))
save_figure(fig, "02b_sqrt_n")
plt.show()

# %% [markdown]
# Retained bytes follow the formula to the byte: at s = 6 = √36, 11 a instead of 36 a; the peak
# (13 a vs 37 a) is 2.85 × lower, for 1.278 × the FLOPs. The FLOPs markers are not a separate
# measurement: they are computed from the measured layer runs (each extra run is one more Linear
# forward), so they fall on the curve by construction; what is measured is the number of runs.
#
# **Your turn.** Write `choose_segments(n_layers, activation_bytes, limit_bytes)` in
# `exercises/02b_segments.py` (open it from the file browser): the number of segments (a divisor of
# `n_layers`) whose retained bytes, less the loss, stay within the limit with the fewest layer runs,
# or `None`. The cell below grades it by running `checkpoint_sequential` on chains and measuring.

# %%
from ckpt_lab.exercises import check

check("02b-segments", "exercises/02b_segments.py")

# %% [markdown]
# ## B. Recursive checkpointing, O(log N) memory
#
# A recomputation runs with grad on, so checkpoints inside it create nodes of their own. Checkpoint
# the first half of a chain and recurse into the second; backward recomputes the first half by the
# same rule. N of the `Linear` + `Tanh` layers above:

# %%
def recursive(layers, t):
    if len(layers) == 1:
        return layers[0](t)
    t = reentrant_checkpoint(lambda u: recursive(layers[: len(layers) // 2], u), t)
    return recursive(layers[len(layers) // 2 :], t)

_ = torch.manual_seed(0)
deep = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(64)]
deep_calls, depth_rows = [CallCounter(layer) for layer in deep], []
for n in (4, 8, 16, 32, 64):
    _ = [c.reset() for c in deep_calls]
    clear_grads(stack_x, *(p for layer in deep for p in layer.parameters()))
    report = measure_memory(lambda n=n: recursive(deep[:n], stack_x).sum())
    runs = sum(c.count for c in deep_calls)
    depth_rows.append((math.log2(n), report.retained_bytes / a, report.peak_bytes / a))
    print(f"N = {n:2}: retained {depth_rows[-1][1]:4.1f} a, peak {depth_rows[-1][2]:4.1f} a, "
          f"layer runs {runs:3} = N (log2 N / 2 + 1): {runs == n * (math.log2(n) / 2 + 1)}")

# %%
fig, ax = plt.subplots(figsize=(5.5, 3))
logs, retained, peaks = zip(*depth_rows, strict=True)
ax.plot(logs, retained, "o-", logs, peaks, "s-", logs, [2**k + 1 for k in logs], ":")
ax.set(ylim=(0, 16), xlabel="log₂ N (N = 4 … 64 layers)", ylabel="activations a")
ax.legend(["retained (measured)", "peak (measured)", "plain: N + 1"], fontsize=8)
save_figure(fig, "02b_recursive")
plt.show()

# %% [markdown]
# Each doubling of N adds one activation retained (log₂ N + 1) and two to the peak (2 log₂ N + 1):
# O(log N) memory, for O(N log N) layer runs (256 for N = 64).
#
# ## Summary
#
# | question | answer | § |
# |---|---|---|
# | How many segments? | s = √N: retained (s − 1 + N/s) · a, to the byte; 11 a instead of 36 a for N = 36 | A |
# | At what cost? | peak 13 a vs 37 a (2.85 × lower) for 1.278 × the FLOPs, as our 1 + (1 − 1/s)/3 predicts (Chen et al.: one extra forward at most) | A |
# | Recursive checkpointing? | retained log₂ N + 1, peak 2 log₂ N + 1 activations; N (log₂ N / 2 + 1) layer runs (256 for N = 64) | B |
#
# Back to [notebook 02](02_reentrant_checkpoint.ipynb), or on to notebook 03.
