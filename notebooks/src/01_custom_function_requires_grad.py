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
# # 01 · Why a custom `autograd.Function`'s output requires grad although `forward` ran without grad
#
# **TL;DR.** `Function.apply` (C++: `THPFunction_apply`) does three things, in order:
#
# 1. it decides whether the call is **[executable](glossary.md#executable)**: grad mode on *and*
#    some tensor input requires grad;
# 2. it runs `forward` with grad mode and forward-mode AD **off**: results inside have
#    `requires_grad=False`;
# 3. it **wraps the outputs**: if executable, each differentiable output gets the Function's
#    backward node as `grad_fn` (so `requires_grad=True` outside); what happens when it is not is
#    §2's prediction.
#
# The reentrant [checkpoint](glossary.md#checkpoint) (`use_reentrant=True`; torch 2.13 warns and
# runs it when `use_reentrant` is omitted) is such a Function. Grad is off in `forward` because `backward` replaces the graph
# `forward` would build: skipping it spares building that graph (what it spares in bytes, and
# when, is §4's prediction).
#
# **After this notebook you can**
#
# 1. predict whether a custom Function's outputs require grad, from grad mode, its tensor
#    arguments and its outputs (checked: §2's prediction, §3's assert against torch, exercise 01);
# 2. name the C++ steps of `apply` that decide it, in order (checked: §2's prediction and probe);
# 3. say what a grad-off `forward` saves and what it does not (checked: §4's prediction and table);
# 4. tell why a reentrant checkpoint's output requires grad only when an input does, and a
#    non-reentrant one's also when a parameter does (checked: §5's cells; exercise 01, cases h and i).
#
# **Questions answered here**, from two PyTorch forum threads:
#
# | question | thread | section |
# |---|---|---|
# | Why does a checkpointed block's output require grad although the block runs under `torch.no_grad()`? | "About the implementation of activation checkpointing" | §1, §5 |
# | … and not when no input requires grad? | same | §2, §3, §5 |
# | Why is `output.requires_grad` `False` inside `forward`, `True` outside? | "Tensor.requires_grad in torch.autograd.Function" | §1 |
# | Where is the `no_grad` around `forward`; where is the grad metadata attached (C++)? | same | §2 |
# | Why is it designed so? To save GPU memory? | same | §4 |
# | How do `autograd.Function` and `torch.utils.checkpoint` relate; how does `CheckpointFunction` save memory? Is its inner `no_grad` redundant? | same | §5 (built in notebook 02) |
# | Why is PyTorch moving checkpointing away from `autograd.Function`? | same | notebook 03b |

# %%
import itertools
import timeit
import warnings

import matplotlib.pyplot as plt
import torch
from torch import nn

from ckpt_lab.grad_rule import InputSpec, LinearFunction, OutputSpec, predict_requires_grad
from ckpt_lab.helpers.predict import reveal
from ckpt_lab.helpers.show import show_source
from ckpt_lab.helpers.viz import draw_graph, plot_timeline, save_figure, show_dot
from ckpt_lab.instruments import LiveMemory, OpCounter, SavedTensorLog, measure_memory

_ = torch.manual_seed(0)
print("torch", torch.__version__)

# %% [markdown]
# ## 1. Inside `forward` vs outside `apply`
#
# The second thread's `LinearFunction` (the PyTorch docs' custom-Function tutorial, typos fixed), in
# `ckpt_lab.grad_rule`, appends what its three-line `forward` saw (grad mode; `requires_grad` of
# input, weight, output) to `LinearFunction.observations`; `setup_context` saves input, weight and
# bias; `backward` is the tutorial's.

# %%
show_source(LinearFunction, start="def forward", stop="LinearFunction.observations.append")

# %%
LinearFunction.observations.clear()
x, weight, bias = (torch.rand(*shape, requires_grad=True) for shape in [(2, 128), (256, 128), (256,)])
out = LinearFunction.apply(x, weight, bias)
(inside,) = LinearFunction.observations
print(f"inside forward: grad mode on={inside.grad_enabled}, input/weight/output requires_grad="
      f"{inside.input_requires_grad}/{inside.weight_requires_grad}/{inside.output_requires_grad}")
print(f"outside apply:  out.requires_grad={out.requires_grad}, out.grad_fn={type(out.grad_fn).__name__}")

# %% [markdown]
# Inside `forward`, grad mode is **off**: `mm` sees inputs that require grad and still returns a
# tensor that does not. After `apply`, the same values come back with `grad_fn`
# `LinearFunctionBackward`, the [node](glossary.md#node) that will call our `backward`. In the graph it stands for all
# of `forward`; the `mm`, `add` and `expand` inside left no trace:

# %%
draw_graph(out.sum(), {"x": x, "weight": weight, "bias": bias}, name="01_linear_function_graph")

# %% [markdown]
# Gradients still flow through it correctly:

# %%
grads = torch.autograd.grad(out.sum(), (x, weight, bias))
reference = torch.autograd.grad(nn.functional.linear(x, weight, bias).sum(), (x, weight, bias))
print("gradients equal nn.functional.linear's:", all(map(torch.allclose, grads, reference)))

# %% [markdown]
# ## 2. What `apply` does, in order
#
# Forward-mode AD is autograd's other mode: instead of recording a graph for a later backward, it
# carries a tangent (a directional derivative) beside each value as the forward runs, through "dual
# tensors" (`torch.autograd.forward_ad`); `apply` switches it off inside `forward` as it does grad
# mode. A probe Function records both modes inside `forward`, and calls `save_for_backward(x)`. `torch._C._is_fwd_grad_enabled` is private
# torch API: no public function reads that mode, and we only read it. `SavedTensorLog` (a
# [pack hook](glossary.md#pack-unpack) logging every [saved tensor](glossary.md#saved-tensor))
# counts the saves, with an input that requires grad and with one that does not.
#
# **Predict.** `forward` calls `ctx.save_for_backward(x)` on every call. How many tensors does
# autograd save when the input does *not* require grad?

# %%
guess = None  # your guess: a number of tensors

# %%
class Probe(torch.autograd.Function):  # no backward: never differentiated (it would raise)
    @staticmethod
    def forward(ctx, x):
        y = x * 2
        Probe.seen = {"grad": torch.is_grad_enabled(), "fw_grad": torch._C._is_fwd_grad_enabled(),
                      "y.requires_grad": y.requires_grad}
        ctx.save_for_backward(x)
        return y

runs = {}
for requires_grad in (True, False):
    with SavedTensorLog() as log:
        y = Probe.apply(torch.ones(3, requires_grad=requires_grad))
    runs[requires_grad] = dict(Probe.seen, saved=log.count, out_requires_grad=y.requires_grad,
                               grad_fn=type(y.grad_fn).__name__)
    print(f"input requires grad={requires_grad!s:5}:", runs[requires_grad])
reveal(guess, runs[False]["saved"], "tensors saved when the input needs no grad")

# %% [markdown]
# The picture puts those measurements on the steps of `THPFunction_apply`, in the order they run:

# %%
ex, no = runs[True], runs[False]
steps = [  # (what the C++ does, what the probe measured)
    ("1 unpack_input:\nis_executable =\n GradMode::is_enabled() &&\n any_variable_requires_grad(\n"
     "   unpacked.input_vars)", "input requires grad: True / False"),
    ("2 call forward under\nAutoGradMode(false)\nAutoFwGradMode(false)",
     f"inside: grad={ex['grad']}, fw_grad={ex['fw_grad']}\ny.requires_grad={ex['y.requires_grad']}"),
    ("3 _wrap_outputs(...,\n   is_executable ? cdata\n                 : nullptr)\n"
     "→ _process_backward_mode_ad\n→ set_history\n→ impl::set_gradient_edge",
     f"executable: grad_fn={ex['grad_fn']}\n"
     f"not: requires_grad={no['out_requires_grad']}, grad_fn={no['grad_fn']}"),
    ("4 _save_variables\n(save_for_backward,\n only if executable)",
     f"saved: {ex['saved']} tensor / {no['saved']} tensors"),
]
colors = ["#dbe9f6", "#fde7c8", "#d9f0d3", "#eadcf2"]
fig, ax = plt.subplots(figsize=(13, 3.3))
boxes = []
for i, ((text, measured), color) in enumerate(zip(steps, colors, strict=True)):
    boxes.append(ax.text(1.5 + 3 * i, 1.25, text, ha="center", va="center", ma="left", fontsize=8,
                         family="monospace", bbox={"boxstyle": "round,pad=0.5", "fc": color, "ec": "0.3"}))
    ax.text(1.5 + 3 * i, 0.05, measured, ha="center", va="center", fontsize=8, color="0.2")
for left, right in itertools.pairwise(boxes):  # arrows from box edge to box edge
    ax.annotate("", (0, 0.5), (1, 0.5), xycoords=right.get_bbox_patch(), textcoords=left.get_bbox_patch(),
                arrowprops={"arrowstyle": "->"})
ax.axis("off")
ax.set(xlim=(0, 12), ylim=(-0.45, 2.2),
       title="Function.apply, in order (bottom row: measured with an input that requires grad / does not)")
save_figure(fig, "01_apply_sequence")
plt.show()

# %% [markdown]
# Where each step lives in C++, at torch's release tag v2.13.0 (we name functions, not line
# numbers: lines move between releases):
#
# 1. **The executable check**, before `forward` runs. `unpack_input` in
#    [`python_function.cpp`](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/csrc/autograd/python_function.cpp)
#    sets `flags.is_executable = GradMode::is_enabled() && any_variable_requires_grad(unpacked.input_vars);`
#    (`input_vars`: the tensor arguments only), then collects the next edges only when it is true.
#    This is the first thread's second observation, and `apply` under `no_grad()`.
# 2. **The "`no_grad`" the second thread looks for**: `THPFunction_apply` calls `forward` in a C++
#    block that opens with two RAII guards, `AutoGradMode grad_mode(false);` and
#    `at::AutoFwGradMode fw_grad_mode(false);`. There is no Python `with torch.no_grad()`.
# 3. **Where the metadata is attached.** After `forward`, `process_outputs` calls this file's
#    `_wrap_outputs`, which passes `is_executable ? cdata : nullptr` (`cdata`: the backward node) to
#    `_wrap_outputs` in
#    [`custom_function.cpp`](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/csrc/autograd/custom_function.cpp).
#    That one calls `_process_backward_mode_ad`, whose lambda `set_history` calls
#    `impl::set_gradient_edge(var, {cdata, output_nr})` on each differentiable output, setting
#    `grad_fn` and so `requires_grad`; `nullptr` attaches nothing. (The thread's answer links lines
#    355–362 of that file at commit `d9c0e37`; we link the release tag and name the functions.)
# 4. **Saving.** `process_outputs` calls `_save_variables` after the wrapping, and only
#    `if (is_executable)`: 0 saves above when the input did not require grad.

# %% [markdown]
# ## 3. The rule, case by case
#
# An output gets the node when the call is executable and the output is *differentiable* (floating
# or complex, not marked with `ctx.mark_non_differentiable`). The first thread's
# `MyCheckpointFunction`, made runnable (`forward` needs `@staticmethod`; without a `backward`,
# backward would raise `NotImplementedError`), shows the executable check from outside:

# %%
class MyCheckpointFunction(torch.autograd.Function):  # the first thread's demo
    @staticmethod
    def forward(ctx, x):
        with torch.no_grad():
            y = x + 1
        return y
    @staticmethod
    def backward(ctx, grad_y):
        return grad_y

f = MyCheckpointFunction.apply
with torch.no_grad():
    out = f(torch.randn(1, requires_grad=True))
print("output requires grad: input requires grad ->", f(torch.randn(1, requires_grad=True)).requires_grad,
      "| input doesn't ->", f(torch.randn(1)).requires_grad, "| apply under no_grad() ->", out.requires_grad)

# %% [markdown]
# The rest of the rule, with the knobs `ctx` offers: `ctx.mark_non_differentiable(t)` keeps the node
# from `t` (think of `sort`'s indices); an integer output never requires grad; an input returned
# *as-is* comes back as a **new** tensor (a view) carrying the node, so the graph stays correct;
# `ctx.needs_input_grad` tells `backward` which inputs want a gradient.

# %%
class SortWithIndices(torch.autograd.Function):  # values differentiable, indices not, input as-is
    @staticmethod
    def forward(ctx, x):
        values, indices = x.sort()
        ctx.mark_non_differentiable(indices)
        ctx.save_for_backward(indices)
        SortWithIndices.last_needs_input_grad = ctx.needs_input_grad
        return values, indices, x
    @staticmethod
    def backward(ctx, grad_values, grad_indices, grad_x):
        (indices,) = ctx.saved_tensors
        return torch.zeros_like(grad_values).scatter(-1, indices, grad_values) + grad_x

x = torch.tensor([3.0, 1.0, 2.0], requires_grad=True)
values, indices, same = SortWithIndices.apply(x)
for name, t in [("values", values), ("indices", indices), ("x returned as-is", same)]:
    print(f"{name:17} requires_grad={t.requires_grad!s:5} grad_fn={type(t.grad_fn).__name__}")
print("x returned as-is is x:", same is x, "| shares its memory:", same.data_ptr() == x.data_ptr())
print("ctx.needs_input_grad:", SortWithIndices.last_needs_input_grad)

# %% [markdown]
# ### The rule as a model, checked against torch
#
# `ckpt_lab.grad_rule.predict_requires_grad` models the wrapping step in Python: whether each output
# will require grad, and why (the tests check it against torch on hundreds of random cases with
# hypothesis). `torch_says` asks torch: it builds a Function with the given outputs, calls it, reads
# `requires_grad` off the results. They agree on every case:

# %%
def torch_says(inputs, outputs, grad_enabled):
    class Probe(torch.autograd.Function):  # no backward: only its outputs' flags are read
        @staticmethod
        def forward(ctx, *args):
            results = [args[o.returns_input] if o.returns_input is not None
                       else (torch.ones(2) if o.floating else torch.arange(2)) for o in outputs]
            marked = [r for r, o in zip(results, outputs, strict=True) if o.non_differentiable]
            ctx.mark_non_differentiable(*marked)
            return tuple(results)
    args = [torch.zeros(2, requires_grad=i.requires_grad) if i.is_tensor else 1.0 for i in inputs]
    with torch.set_grad_enabled(grad_enabled):
        return [r.requires_grad for r in Probe.apply(*args)]

# %%
grad_in, plain_in = InputSpec(requires_grad=True), InputSpec()
cases = {
    "x requires grad": ([grad_in], [OutputSpec()], True),
    "no input requires grad": ([plain_in, InputSpec(is_tensor=False)], [OutputSpec()], True),
    "apply under no_grad": ([grad_in], [OutputSpec()], False),
    "integer output": ([grad_in], [OutputSpec(floating=False)], True),
    "marked non-differentiable": ([grad_in], [OutputSpec(non_differentiable=True)], True),
    "returns a no-grad input as-is": ([grad_in, plain_in], [OutputSpec(returns_input=1)], True),
}
table = []  # per case: number, grad mode, whether a tensor input requires grad, torch's answer
for number, (label, (inputs, outputs, grad_enabled)) in enumerate(cases.items(), start=1):
    (verdict,) = predict_requires_grad(inputs, outputs, grad_enabled)
    (actual,) = torch_says(inputs, outputs, grad_enabled)
    assert verdict.requires_grad == actual
    table.append((number, grad_enabled, any(i.is_tensor and i.requires_grad for i in inputs), actual))
    print(f"{number} {label:30} requires_grad={actual!s:5} because {verdict.reason}")

# %% [markdown]
# The rule as a decision diagram: each case above is routed by its facts (grad mode, inputs,
# torch's answer) to its leaf, which lists the case numbers and their `requires_grad`:

# %%
# the leaf of each (executable, torch's answer); a case that fits none would raise KeyError
leaf = {(False, False): "not_exec", (True, False): "not_diff", (True, True): "wrapped"}
at = {name: "\\ncases " + ", ".join(str(n) for n, g, a, rg in table if leaf[g and a, rg] == name)
      + f"\\nrequires_grad={answer}" for (_, answer), name in leaf.items()}
dot = f"""digraph {{ node [shape=box, fontname=Helvetica, fontsize=11]; edge [fontname=Helvetica];
mode [shape=diamond, label="grad mode on\\nwhen apply runs?"];
anyrg [shape=diamond, label="some tensor input\\nrequires grad?"];
exe [label="is_executable:\\n_wrap_outputs(..., cdata)", style=filled, fillcolor="#d9f0d3"];
diff [shape=diamond, label="output differentiable?\\n(floating or complex,\\nnot marked)"];
node [style=filled, fillcolor="#f6dddd"]; {{rank=same; anyrg; not_exec}}
not_exec [label="not executable:\\n_wrap_outputs(..., nullptr)\\nno grad_fn, nothing saved{at['not_exec']}"];
wrapped [label="set_history: grad_fn =\\nthe Function's node{at['wrapped']}", fillcolor="#d9f0d3"];
not_diff [label="no grad_fn{at['not_diff']}"]; mode -> anyrg [label="yes"]; mode -> not_exec [label="no"];
anyrg -> exe [label="yes"]; anyrg -> not_exec [label="no"]; exe -> diff;
diff -> wrapped [label="yes"]; diff -> not_diff [label="no"]; }}"""
show_dot(dot, "01_requires_grad_rule")  # when regenerating the notebook: images/01_requires_grad_rule.png

# %% [markdown]
# ## 4. Why `forward` runs with grad off
#
# The second thread's answer: *"you are providing the backward formula … so we don't need to track
# autograd information during the forward … mainly for performance … [and] not saving things for
# backward twice."* Measured: `Sin4` computes `y = sin(sin(sin(sin(x))))`, saves only `x`, and
# recomputes the chain in `backward` (a checkpoint in miniature). Two **drafts** switch grad back on
# in `forward`, as if `apply` had no guard; the second also keeps the inner result on `ctx`:

# %%
sin4 = lambda t: t.sin().sin().sin().sin()

class Sin4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return sin4(x)
    @staticmethod
    def backward(ctx, grad_y):
        (s,) = ctx.saved_tensors
        for _ in range(4):  # dy/dx = cos(x) * cos(s1) * cos(s2) * cos(s3), with s1 = sin(x), ...
            grad_y, s = grad_y * s.cos(), s.sin()
        return grad_y

class DraftGradOn(Sin4):  # DRAFT: grad on in forward, so its four sins record a graph and save inputs
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        with torch.enable_grad():
            y = sin4(x.detach().requires_grad_())
        ctx.grad_fn_inside = type(y.grad_fn).__name__
        return y

# %%
class DraftKeepsInner(Sin4):  # DRAFT: grad on, and ctx.inner holds the inner result, and its graph
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        with torch.enable_grad():
            ctx.inner = sin4(x.detach().requires_grad_())
        return ctx.inner.detach()

x = torch.randn(100_000, requires_grad=True)
y = DraftGradOn.apply(x)
print("grad_fn inside forward:", y.grad_fn.grad_fn_inside, "| after apply:", type(y.grad_fn).__name__)
print("gradient equals autograd's:", torch.allclose(torch.autograd.grad(y.sum(), x)[0],
                                                    torch.autograd.grad(sin4(x).sum(), x)[0]))

# %% [markdown]
# Side by side: saves and [aten ops](glossary.md#aten-op) during
# `apply` (`SavedTensorLog`, `OpCounter`), live bytes during `apply` (`LiveMemory`: every
# [storage](glossary.md#storage) an aten op creates, until freed; its most is "peak in apply"), and
# `measure_memory` over the step: [retained](glossary.md#retained) after the forward and the
# [peak](glossary.md#peak) over forward and backward.
#
# **Predict.** The grad-on draft's four `sin`s record a graph inside `forward`. How many bytes does
# it retain after the forward (grad off: 4, the loss)?

# %%
guess = None  # your guess: a number of bytes

# %%
variants = {"apply's way (grad off)": Sin4, "draft: grad on inside": DraftGradOn,
            "draft + ctx.inner": DraftKeepsInner}
forward_mems, steps = {}, {}
print(f"{'':24}{'saves':>6}{'saved bytes':>13}{'aten ops':>9}{'peak in apply':>14}"
      f"{'retained':>10}{'peak':>11}")
for name, fn in variants.items():
    with SavedTensorLog() as log, OpCounter() as ops, LiveMemory() as mem:
        y = fn.apply(x)
        mem.snapshot("after apply")
    forward_mems[name] = mem
    x.grad = None
    steps[name] = step = measure_memory(lambda fn=fn: fn.apply(x).sum())
    print(f"{name:24}{log.count:6}{log.activation_bytes:13,}{ops.total:9}{mem.peak_bytes:14,}"
          f"{step.retained_bytes:10,}{step.peak_bytes:11,}")
reveal(guess, steps["draft: grad on inside"].retained_bytes, "bytes the grad-on draft retains")

# %% [markdown]
# `set_history` *replaced* the output's `grad_fn` (`SinBackward0`, printed above) with the
# Function's node: the inner graph has no owner left.
#
# * **Grad off** (`apply`'s way): one save, `x` (400,000 bytes, the caller's tensor); the forward
#   peaks at two 400,000-byte tensors (one `sin`'s input and output); then only the 4-byte loss is
#   retained.
# * **Grad on, graph discarded**: the same four `sin`s (plus a `detach`), four more saves (each `sin`
#   saves its input: `x`, `s1`, `s2`, `s3`: +1,200,000 bytes), twice the forward peak (the inner
#   graph keeps every intermediate until `apply` returns). `set_history` then drops that graph:
#   **4 bytes retained, as with grad off**, and the same peak (our `backward`'s).
# * **Grad on + `ctx.inner`**: 1,600,004 bytes retained; all but the loss's 4 are the draft's own
#   `ctx.inner`, the inner output and the tensors its graph saved (`s1`, `s2`, `s3`). A cost of the
#   draft, not of autograd.
#
# So grad off saves building a graph that would be thrown away (nodes, saved tensors, transient
# peak in apply); what is kept for backward is only what `save_for_backward` names:

# %%
fig, ax = plt.subplots(figsize=(7, 2.8))
for (name, mem), style in zip(forward_mems.items(), ["-", "--", ":"], strict=True):
    plot_timeline(ax, mem, name)
    line = ax.lines[-1]
    line.set(linestyle=style, linewidth=2.5 if style == "-" else 1.8)  # then the level apply leaves:
    ax.plot([len(mem.events) - 1, 7], [mem.marks["after apply"] / 1024] * 2, style, color=line.get_color())
ax.set_title("live KiB during apply (forward only; the output y stays alive)")
ax.legend(fontsize=8)
save_figure(fig, "01_grad_off_in_forward")
plt.show()

# %% [markdown]
# Building the graph also costs time, most visibly on small tensors, where bookkeeping dominates
# (when this was written, on two shared CPU cores, grad on took 1.3 to 2 times as long per call over
# several runs). Timings vary; nbval does not compare this cell:

# %% tags=["nbval-ignore-output"]
small = torch.randn(100, requires_grad=True)
seconds = {name: [] for name in list(variants)[:2]}
for _ in range(7):  # interleaved, best of 7: the machine is shared
    for name in seconds:
        seconds[name].append(timeit.timeit(lambda name=name: variants[name].apply(small), number=1000) / 1000)
for name, times in seconds.items():
    print(f"{name:24} {min(times) * 1e6:6.1f} µs per call")

# %% [markdown]
# ## 5. What this means for checkpointing
#
# `torch.utils.checkpoint` with `use_reentrant=True` *is* such a Function (`CheckpointFunction`): it
# saves its inputs with `save_for_backward`, runs the block in `forward` and again in `backward`
# (notebook 02 builds it). Grad is off in its `forward`, so it saves only the inputs, none of the
# block's intermediates (as `Sin4` in §4): that is how it saves memory. The first thread's
# observations follow from §3's rule alone. Its model, made runnable (it lacked `super().__init__()`
# and a closing bracket):

# %%
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(100, 100)
        self.blocks = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 100))
    def forward(self, x):
        x = self.linear(x)
        x1 = x2 = x
        with torch.no_grad():
            for block in self.blocks:
                x1 = block(x1)
                print(f"no_grad requires_grad: {x1.requires_grad}")
        for block in self.blocks:
            x2 = torch.utils.checkpoint.checkpoint(block, x2, use_reentrant=True)
            print(f"checkpoint requires_grad: {x2.requires_grad}")
        return x2

model = Model()
outs = model(torch.randn(2, 100))
draw_graph(outs.sum(), dict(model.named_parameters()), name="01_checkpoint_graph")

# %% [markdown]
# The block ran with grad off, yet its output requires grad: its input `x2` requires grad (it came
# out of `self.linear`), so the call was executable. In the graph each checkpointed block is one
# `CheckpointFunctionBackward` node with one edge, to its input; the orange box beside it, all it
# saved, is that input, 2 × 100 floats (torchviz draws a Python Function's `saved_tensors` so). The
# blocks' weights are not in the graph: the reentrant backward reaches them by running the block
# again (notebook 02). Without an input requiring grad, the output would not require grad.
#
# That holds for the **reentrant** checkpoint only. With `use_reentrant=False` (saved-tensor hooks,
# notebook 03b) the block runs with grad **on**: its output requires grad whenever its parameters do.
# Without `use_reentrant`, `checkpoint` warns, then runs the reentrant one (torch 2.13, shown here;
# 2.11, 2.14.1 and 2.15.0 warn and default alike: the site's "Torch versions" page). With an input that does
# not require grad:

# %%
block, plain_input = nn.Linear(100, 100), torch.randn(2, 100)
for use_reentrant in (None, True, False):
    kwargs = {} if use_reentrant is None else {"use_reentrant": use_reentrant}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.utils.checkpoint.checkpoint(block, plain_input, **kwargs)
    said = "; ".join(str(w.message).split(". ")[0] for w in caught) or "-"
    print(f"use_reentrant={use_reentrant!s:5}: requires_grad={out.requires_grad!s:5} | warns: {said}")

# %% [markdown]
# With the reentrant checkpoint the block's parameters get no gradient here (the trap of notebook
# 02). Last, is the `with torch.no_grad():` inside `CheckpointFunction.forward` redundant (second
# thread)? Yes: `apply` already switched grad mode off. A Function without it, around a block that
# would save tensors if grad were on:

# %%
class WithoutInnerNoGrad(torch.autograd.Function):  # no backward: not needed for this check
    @staticmethod
    def forward(ctx, run_function, x):
        ctx.grad_mode_inside = torch.is_grad_enabled()
        return run_function(x)

with SavedTensorLog() as log:
    y = WithoutInnerNoGrad.apply(lambda t: t.exp().sin(), torch.randn(1000, requires_grad=True))
print("grad mode inside forward:", y.grad_fn.grad_mode_inside, "| saved by the block's ops:", log.count,
      "| output requires grad:", y.requires_grad)

# %% [markdown]
# **Your turn.** Predict `requires_grad` for nine Functions in `exercises/01_requires_grad.py` (open it from the file browser) and say why for one; then run the cell below: it grades your file against torch.

# %%
from ckpt_lab.exercises import check

check("01-requires-grad", "exercises/01_requires_grad.py")

# %% [markdown]
# ## Summary
#
# | question | answer | shown by |
# |---|---|---|
# | Why is `output.requires_grad` False inside `forward`? | `THPFunction_apply` runs it under `AutoGradMode(false)` and `AutoFwGradMode(false)` | §1, §2 (grad=False, fw_grad=False) |
# | Why True outside? | `_wrap_outputs(..., is_executable ? cdata : nullptr)` → `_process_backward_mode_ad` → `set_history` → `impl::set_gradient_edge` gives each differentiable output the Function's node | §1 graph, §2 picture |
# | When is it False? | not executable (no input requires grad, or `apply` under `no_grad`: nothing saved either); non-differentiable or integer outputs | §2 (0 saves), §3 (model = torch; diagram) |
# | Why designed so? | `backward` replaces the inner graph; grad off skips building it (4 extra saves, 2× peak in `apply`, more time); retained: the same 4 bytes | §4 table, timeline |
# | Why does a checkpoint's output require grad? | the reentrant `CheckpointFunction` is a Function: same rule; the non-reentrant one runs the block with grad on | §5 |
# | Is the inner `no_grad` redundant? | yes: grad mode is already off (0 saves without it) | §5 |
#
# Next, notebook 02 builds `CheckpointFunction` from scratch and meets its limits.
#
# ---
#
# ## Appendix: two more `ctx` details (optional)
#
# `ctx.set_materialize_grads(False)`: by default an output that received no gradient reaches
# `backward` as a tensor of zeros; with materialization off it arrives as `None`, and `backward` can
# skip work:

# %%
class ShowsGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, materialize):
        ctx.set_materialize_grads(materialize)
        return x * 2, x * 3
    @staticmethod
    def backward(ctx, grad_a, grad_b):
        print("backward got:", type(grad_a).__name__, type(grad_b).__name__)
        return (grad_a * 2 if grad_a is not None else 0) + (grad_b * 3 if grad_b is not None else 0), None

x = torch.ones(2, requires_grad=True)
for materialize in (True, False):
    a, _b = ShowsGrads.apply(x, materialize)
    print(f"materialize={materialize}:", end=" ")
    a.sum().backward()  # only `a` is used

# %% [markdown]
# `ctx.needs_input_grad` mirrors each input's `requires_grad` and ignores grad mode (a surprise the
# model's property test found): under `torch.no_grad()` it can say `True` for a call whose backward
# will never run:

# %%
from ckpt_lab.grad_rule import predict_needs_input_grad

with torch.no_grad():
    _ = SortWithIndices.apply(torch.tensor([3.0, 1.0, 2.0], requires_grad=True))
print("torch:   ", SortWithIndices.last_needs_input_grad)
print("modelled:", predict_needs_input_grad([InputSpec(requires_grad=True)], grad_enabled=False))
