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
# # 06 · Checkpointing at scale: DDP and FSDP with `torch.distributed`, on a CPU
#
# People who checkpoint activations train on more than one device, and that is where the best-known
# failures of checkpointing show up. The most famous one, seen in countless issues:
#
# > `RuntimeError: Expected to mark a variable ready only once. ... 2) Reused parameters in multiple
# > reentrant backward passes ... You can try to use _set_static_graph() as a workaround`
#
# This notebook reproduces it, explains it with nothing but what notebooks 01–03 taught (an
# `autograd.Function`'s node, the nested backward of the reentrant checkpoint), fixes it two ways,
# and then checkpoints a model sharded with FSDP. It runs on the engine people already use,
# `torch.distributed`, with the **gloo** backend, so that it works on a CPU-only machine: two
# processes on this machine play two GPUs.
#
# 1. A launcher: processes from a notebook, results back, failures reported, hangs ended
# 2. DDP with checkpointed blocks: gradients equal a single process's
# 3. The failure: reentrant checkpoint + `find_unused_parameters=True`, or tied weights
# 4. Why: what DDP's reducer counts, replayed in one process
# 5. The fixes: `static_graph=True`, or (better) the non-reentrant checkpoint
# 6. FSDP (`fully_shard`) with `ckpt_lab.checkpoint`: gradients, and memory per rank
# 7. What needed a GPU, and what did not
#
# Every claim stands on a printed or asserted number (booleans, counts, bytes), and nbval re-checks
# them. The code lives in `ckpt_lab/distributed.py` (the workers, the model, the replay of DDP's
# bookkeeping) and `ckpt_lab/helpers/processes.py` (the launcher); the notebook shows it rather than
# copying it.

# %%
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

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
from ckpt_lab.helpers import processes
from ckpt_lab.helpers.processes import WorkerError, run_workers
from ckpt_lab.helpers.show import show_source
from ckpt_lab.helpers.viz import draw_graph, plot_memory_bars, save_figure

_ = torch.manual_seed(0)
print("torch", torch.__version__, "| gloo available:", dist.is_gloo_available())

# %% [markdown]
# ## 1. A launcher that a notebook can use
#
# A distributed job is several processes, one per device ("rank"), that meet in a *process group*
# and then exchange tensors with collectives (`all_reduce`, `broadcast`, ...). `torchrun` starts
# them from a shell; from a notebook we start them ourselves. `run_workers(fn, world_size, timeout,
# **kwargs)` (a notebook helper, `ckpt_lab/helpers/processes.py`, which knows nothing of DDP) starts
# `world_size` processes, joins them in a gloo group (rank 0 listens on `127.0.0.1` and a free port),
# runs `fn(rank, world_size, **kwargs)` in each and returns their results in rank order:

# %%
show_source(run_workers)

# %% [markdown]
# Three details matter in a notebook:
#
# * **How workers start.** A worker must not inherit the notebook's process (threads, open state,
#   half-run cells): it starts clean and finds `fn` by module and name, which is why `fn` must live
#   in a module (`ckpt_lab.distributed`), never in a notebook cell. `spawn` would do, but costs
#   an `import torch` per worker per call (about 5 s each on this machine). A `forkserver` imports
#   torch once, then forks clean workers in milliseconds.
# * **Failures.** A worker's exception is sent to the parent with its traceback, *before* the worker
#   leaves the group (leaving breaks its peers' connections, and their errors would arrive first).
#   The parent then stops the other workers, which may be waiting for the failed one forever, and
#   raises. A deadline covers the whole run: past it, every worker is killed.
# * **Quiet.** Workers write to the notebook kernel's file descriptors; whatever they print (torch's
#   warnings, gloo's messages) would land in this page and change from run to run. They capture it
#   and show it only in an error.
#
# The smallest collective: each rank contributes its rank number to an `all_reduce` (a sum), and
# every rank gets the total back. The first call also starts the fork server.

# %%
show_source(sum_of_ranks)

# %%
print("2 ranks, each returns:", run_workers(sum_of_ranks, world_size=2))
print("3 ranks, each returns:", run_workers(sum_of_ranks, world_size=3))

# %% [markdown]
# Failures must be loud and must not hang. `fail_on_rank` lets rank 1 fail while rank 0 waits for
# it in a `barrier`, which on its own it would never leave. Three ways to fail: raise, die without
# a word (as with a segfault or the OOM killer), or hang.

# %%
show_source(fail_on_rank)

# %% [markdown]
# And the worker's side of the launcher: join the group, run `fn`, report, always leave the group.

# %%
show_source(processes._worker_main)

# %%
def failure_of(how, **options):
    """Run fail_on_rank; return the exception run_workers raised (None if it returned)."""
    try:
        run_workers(fail_on_rank, how=how, **options)
    except (WorkerError, TimeoutError) as error:
        return error
    return None


raised = failure_of("raise")
assert isinstance(raised, WorkerError)
print("how='raise': WorkerError, cause on rank", raised.rank)
print("  summary:", raised.failures[raised.rank])
print("  the parent holds the worker's traceback, which names fail_on_rank:",
      "in fail_on_rank" in raised.worker_traceback)

died = failure_of("exit")
assert isinstance(died, WorkerError)
print("how='exit':  WorkerError, cause on rank", died.rank)
print("  summary:", died.failures[died.rank])

hung = failure_of("hang", timeout=3)
assert isinstance(hung, TimeoutError)
print("how='hang':  TimeoutError:", hung)

# %% [markdown]
# In each case rank 0, stuck in the barrier, was stopped by the launcher; in the last, both were
# killed after 3 s. (`tests/test_distributed.py` also checks that the processes are really gone and
# that each worker destroys its process group, on success and on failure alike.)
#
# ## 2. DDP with checkpointed blocks
#
# `DistributedDataParallel` keeps a full replica of the model on every rank; each rank runs forward
# and backward on its own slice of the batch, and DDP **averages the gradients** across ranks
# during backward, so that every replica takes the same optimizer step. It learns that a gradient
# is ready through a hook on each parameter's gradient accumulator (the `AccumulateGrad` node of
# notebook 01), and all-reduces gradients in buckets as soon as a bucket is complete, overlapping
# communication with the rest of backward.
#
# The model: a stem, three residual blocks, a head. Each block runs through one of six strategies,
# named by their labels in the project's one registry of strategies, `ckpt_lab/strategies.py`
# (the benchmark measures the same entries). A label is a string, so it travels to the workers;
# each worker looks up the function there. What each label runs per block:
#
# | label | the registry's per-block wrapper |
# |---|---|
# | `none` | `block(x)` |
# | `torch reentrant` | `torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)` |
# | `ckpt_lab.reentrant_checkpoint` | `reentrant_checkpoint(block, x)` (notebook 02) |
# | `torch non-reentrant` | `torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)` |
# | `ckpt_lab.checkpoint` | `checkpoint(block, x)` (notebook 03) |
# | `ckpt_lab.gradient_checkpoint_scope` | `with gradient_checkpoint_scope(): block(x)` (notebook 04) |

# %%
show_source(distributed, start="# The strategies notebook 06 runs", stop="class TinyNet")

# %%
show_source(TinyNet, start="    def forward")

# %% [markdown]
# The worker trains for 3 SGD steps in float64 under DDP (2 ranks, 4 samples each), and then checks
# itself against a **single-process reference** trained on the whole batch of 8 (for a mean loss,
# the average of the ranks' gradients is the gradient of the whole batch). It returns booleans:

# %%
show_source(ddp_train_steps, start="    x_all, y_all")

# %%
default_runs = {strategy: run_workers(ddp_train_steps, strategy=strategy) for strategy in STRATEGIES}
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
# Every strategy trains exactly like the single-process reference (to 1e-12 in float64: the sum
# over ranks adds in another order), and **bitwise** like DDP without checkpointing: recomputation
# reproduces the forward exactly. The first block ran 6 times in 3 steps under the four
# checkpoints (once in forward, once in backward's recomputation), 3 times without; the scope
# replays the block's recorded aten ops instead of calling the module, so its module count stays 3.
#
# With DDP's default options, even the reentrant checkpoints work here. They stop working with two
# settings that real models need all the time.
#
# ## 3. The failure
#
# * `find_unused_parameters=True`: needed whenever some parameters don't take part in a step
#   (a mixture-of-experts layer, a frozen branch, a head used every other step). DDP must then find
#   out, after each forward, which parameters will get no gradient, so that it does not wait for
#   them.
# * **tied weights** (`repeat=2`): the same blocks run twice, as in ALBERT or a universal
#   transformer, so each checkpointed block is called twice per forward.

# %%
failing_options = {
    "find_unused_parameters=True": {"find_unused_parameters": True},
    "tied weights": {"repeat": 2},
}
runs = {
    (strategy, label): run_workers(ddp_train_steps, strategy=strategy, **options)
    for strategy in STRATEGIES
    for label, options in failing_options.items()
}
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
# non-reentrant ones train correctly, as does the model without checkpointing. The error (rank 0,
# torch's reentrant checkpoint with `find_unused_parameters=True`), first and last sentence:

# %%
message = runs["torch reentrant", "find_unused_parameters=True"][0].error
print(message.split(". ")[0] + ".")
print(message.splitlines()[-1])
same = [run[0].error == message for key, run in runs.items() if key[0] in REENTRANT]
print(f"reentrant failures with exactly this message: {sum(same)} of {len(same)}")
assert all(same)

# %% [markdown]
# "Parameter at index 7 with name blocks.2.linear.bias has been marked as ready twice": the last
# block's bias, the first checkpointed parameter backward reaches. Why twice?
#
# ## 4. Why: what DDP's reducer counts
#
# DDP's reducer keeps one rule: **in every backward, each parameter is marked ready exactly once**.
# It marks a parameter ready when the hook on its gradient accumulator fires, and, with
# `find_unused_parameters=True`, it also marks at once (when backward's first hook fires) every
# parameter that a walk of the autograd graph from the forward's output did not reach, since no
# gradient will come for those.
#
# Now recall notebooks 01 and 02. A reentrant checkpoint is a custom `autograd.Function`; its node
# in the graph links only to its **tensor inputs** (notebook 01's rule). The block's parameters are
# not inputs: they are used inside `forward` under `no_grad`, so the graph does not reach them. Its
# backward recomputes the block with grad on and runs a **nested** `torch.autograd.backward` through
# that private graph (notebook 02), and *that* is where the parameters' gradients are accumulated
# and their hooks fire. The graph of our model with torch's reentrant checkpoint, parameters
# labelled:

# %%
model = TinyNet(strategy="torch reentrant").double()
x = torch.randn(2, 4, dtype=torch.float64)
draw_graph(model(x).sum(), dict(model.named_parameters()), name="06_reentrant_graph_hides_parameters")

# %% [markdown]
# Three `CheckpointFunctionBackward` nodes, each linked only to the node that made its input, and
# showing in orange the one tensor it saved: that input. The stem's and head's parameters (blue)
# hang off the graph; the blocks' six parameters appear nowhere.
# `trace_parameter_hooks` replays the reducer's bookkeeping in this process, without DDP: for each
# parameter, whether the walk reaches it, and how often its gradient hook fires, in the outer
# backward and in nested ones (told apart by the autograd engine's graph-task id):

# %%
show_source(trace_parameter_hooks)

# %%
show_source(ParameterHooks.ready_marks)


# %%
def hooks_table(strategy, repeat=1):
    """Print what the reducer would see of each parameter, and return the traced hooks."""
    _ = torch.manual_seed(0)
    hooks = trace_parameter_hooks(TinyNet(strategy=strategy, repeat=repeat).double(), x)
    print(f"{strategy}, repeat={repeat}")
    print(f"  {'parameter':22} {'reachable':10} {'outer':6} {'nested':7} marks: default / find_unused")
    for h in hooks:
        print(f"  {h.name:22} {h.reachable!s:10} {h.fired_outer:<6} {h.fired_nested:<7} "
              f"{h.ready_marks(False)} / {h.ready_marks(True)}")
    return hooks


_ = hooks_table("torch reentrant")

# %% [markdown]
# Read the rows of `blocks.*`: not reachable, so with `find_unused_parameters=True` DDP marks them
# ready as soon as backward starts; then each one's hook fires in a nested backward: a second mark,
# and the error. Without `find_unused_parameters` the walk does not happen and one mark is right,
# which is why section 2 worked. With tied weights, each block is checkpointed twice, so backward
# runs two nested backwards per block, and each accumulates into the parameter separately: two
# hook firings, two marks, even without the walk:

# %%
_ = hooks_table("torch reentrant", repeat=2)

# %% [markdown]
# The non-reentrant checkpoint (saved-tensor hooks, notebook 03) leaves the graph exactly as a plain
# forward builds it: every parameter is reachable, and with tied weights autograd *sums* the two
# incoming gradients before it runs the accumulator once, as it does for any tensor used twice.
# One firing, in the outer backward:

# %%
_ = hooks_table("ckpt_lab.checkpoint", repeat=2)

# %% [markdown]
# The replay predicts DDP exactly. For every strategy and setting, "some parameter gets a number of
# marks other than one" must hold exactly when DDP raised:

# %%
agree = []
for strategy in STRATEGIES:
    for label, options in {"default": {}, **failing_options}.items():
        repeat = options.get("repeat", 1)
        find_unused = options.get("find_unused_parameters", False)
        _ = torch.manual_seed(0)
        hooks = trace_parameter_hooks(TinyNet(strategy=strategy, repeat=repeat).double(), x)
        predicted = any(h.ready_marks(find_unused) != 1 for h in hooks)
        rank0 = default_runs[strategy][0] if label == "default" else runs[strategy, label][0]
        agree.append(predicted == (rank0.error is not None))
print("configurations:", len(agree), "| prediction == DDP's verdict in all:", all(agree))
assert all(agree)

# %% [markdown]
# ## 5. The fixes
#
# **`static_graph=True`** tells DDP the graph is the same in every iteration. DDP then does not walk
# the graph nor mark anything in the first iteration: it *counts* how often each parameter's hook
# fires, and from the second iteration on it marks a parameter ready when its hook has fired that
# many times. Two firings for a tied weight are then expected, and an "unused" parameter is one
# whose hook did not fire in the first iteration, not one the walk missed:

# %%
lines = [f"{'strategy':32} {'setting':28} {'error':6} {'params=ref':11} grads=ref"]
for strategy in REENTRANT:
    for label, options in failing_options.items():
        rank0, rank1 = run_workers(ddp_train_steps, strategy=strategy, static_graph=True, **options)
        assert rank0 == rank1
        assert rank0.error is None and rank0.params_match_reference and rank0.grads_match_reference
        lines.append(f"{strategy:32} {label:28} {rank0.error is not None!s:6} "
                     f"{rank0.params_match_reference!s:11} {rank0.grads_match_reference}")
print("\n".join(lines))

# %% [markdown]
# It works, with conditions: the graph must really be static (no data-dependent control flow over
# which parameters are used), and the first iteration reduces all gradients at its very end,
# without overlap. **The non-reentrant checkpoint needs no flag at all** (section 3's table):
# `ckpt_lab.checkpoint`, torch's `use_reentrant=False` and the scope all keep the ordinary graph.
# This is one of the reasons PyTorch asks every caller to pass `use_reentrant` explicitly, and
# recommends `False`.
#
# ## 6. FSDP: sharded parameters, checkpointed activations
#
# DDP keeps a full copy of the parameters on every rank. FSDP (here the current API,
# `torch.distributed.fsdp.fully_shard`, "FSDP2") keeps only a **shard** of each parameter per rank,
# gathers a block's full parameters just before its forward (and again before its backward), and
# frees them afterwards; gradients are reduce-scattered back to shards. It runs on CPU with gloo in
# torch 2.13. FSDP shards *parameters*; the *activations* a rank keeps for backward depend on its
# batch, and that is what checkpointing reduces. The two combine:

# %%
show_source(distributed._shard)

# %% [markdown]
# `checkpoint_wrapper` accepts any `checkpoint_fn(module, *args)`, so `ckpt_lab.checkpoint` goes in
# unchanged. Order matters: checkpoint inside, shard outside. FSDP's pre-backward hook, which
# gathers a block's parameters, fires on the block's output gradient, before the checkpoint's
# recomputation needs them. The worker trains 3 steps (2 ranks × 64 samples, width 64, float64),
# compares with a single-process reference, then measures one more forward and backward with
# `measure_memory` (notebook 01's storage-level instrument) on each rank:

# %%
show_source(fsdp_train_steps, start="    model = _shard")

# %%
fsdp = {flag: run_workers(fsdp_train_steps, checkpointed=flag) for flag in (False, True)}
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
#   what one process keeps for the whole batch: 230,400 bytes = 7 block-sized tensors (64 × 64
#   float64 = 32,768 bytes: each block's input and `tanh` output, and the head's input) + 1,024
#   bytes (the head's 64 × 1 output, and the loss, whose storage `mse_loss` allocates at the size
#   of its input). With `ckpt_lab.checkpoint`, a block keeps only its input, so 4 block-sized
#   tensors remain (the three blocks' inputs, and the last block's output, which the head saves):
#   4 × 32,768 + 1,024 = 132,096 bytes. The price: the first block ran twice.

# %%
block_tensor = 64 * 64 * 8
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
plot_memory_bars(
    ax,
    {
        "one process, batch 128": single.single_process_retained_bytes,
        "FSDP rank 0, batch 64": fsdp[False][0].retained_bytes,
        "FSDP rank 0 + ckpt_lab.checkpoint": fsdp[True][0].retained_bytes,
    },
    "activations kept for backward (bytes created in forward, alive at its end)",
)
save_figure(fig, "06_fsdp_memory_per_rank")
plt.show()

# %% [markdown]
# Two notes on what the instrument sees here. FSDP allocates the buffers it gathers parameters into
# during the first step, before the measured one, and afterwards only resizes their storages, which
# `LiveMemory` does not count as new memory; and the gathered buffer of a block is freed after its
# forward, so it is not retained. What remains is activations, which is what we wanted to measure.
#
# ## 7. What needed a GPU, and what did not
#
# Nothing in this notebook needed one. Gloo implements every collective that DDP and FSDP2 use here
# (all-reduce, broadcast, all-gather, reduce-scatter), `fully_shard` accepts a CPU device mesh,
# and the byte counts above are storage sizes, the same on any device. What a GPU would add, and
# this notebook leaves out: the NCCL backend (GPUs only, and what real jobs use), the overlap of
# communication with computation on separate CUDA streams (timings on a shared 2-core CPU would
# show nothing worth printing), FSDP's mixed precision and parameter offload to the CPU, and
# allocator-level numbers (`torch.cuda.max_memory_allocated`, which `measure_memory` also reports
# when it runs on CUDA). None of these changes the bookkeeping that §3–§5 explain: the reducer's
# rule and the reentrant checkpoint's nested backward are the same on every device.
#
# ## Summary
#
# | question | answer | shown by |
# |---|---|---|
# | Can a notebook start distributed workers? | yes: importable worker functions, a fork server, gloo on `127.0.0.1` | §1 |
# | Are failures clear? | a worker's exception arrives with its traceback; a silent death and a hang are named; all workers are stopped | §1 |
# | Does checkpointing change DDP's result? | no: equal to one process on the whole batch, bitwise equal to DDP without checkpointing | §2, 6 strategies |
# | When does the reentrant checkpoint break DDP? | `find_unused_parameters=True` or tied weights: "marked as ready twice" | §3, torch's and ours |
# | Why? | its node hides the parameters from DDP's graph walk, and each nested backward fires their hooks again | §4, replayed and matched in 18 of 18 configurations |
# | The fixes? | `static_graph=True` (DDP learns the counts), or the non-reentrant checkpoint (nothing to fix) | §5 |
# | FSDP with `ckpt_lab.checkpoint`? | equal to one process; per rank, parameters are halved by sharding and activations cut from 7 to 4 block-sized tensors by checkpointing | §6 |
