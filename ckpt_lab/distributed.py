"""Checkpointing under DDP and FSDP with ``torch.distributed``, on CPU with gloo (notebook 06).

Workers, each run in every rank by ``run_workers(fn, world_size=2, timeout=60, **kwargs)``:

* ``ddp_train_steps(rank, world_size, strategy, ...)`` -> ``DDPResult``: ``TinyNet`` trained under
  ``DistributedDataParallel``, checked against one process on the whole batch;
* ``fsdp_train_steps(rank, world_size, checkpointed=True, ...)`` -> ``FSDPResult``: the same under
  FSDP2 (``fully_shard``), blocks wrapped with ``ckpt_lab.checkpoint``, and the memory per rank;
* ``sum_of_ranks`` (the smallest collective) and ``fail_on_rank`` (fails on purpose).

In one process: ``trace_parameter_hooks(model, x)`` -> a ``ParameterHooks`` per parameter, what
DDP's reducer counts, replayed without DDP.

The model: ``TinyNet(strategy=label)``, a stack of ``Block``; ``STRATEGIES``, the labels notebook 06
runs (from the registry, ``ckpt_lab.strategies``), and ``REENTRANT`` among them. The launcher
(``run_workers``, ``WorkerError``, ``free_port``) lives in ``ckpt_lab.helpers.processes`` and is
importable from here.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from ckpt_lab.errors import missing_error
from ckpt_lab.helpers.processes import WorkerError, free_port, run_workers
from ckpt_lab.instruments.counting import CallCounter
from ckpt_lab.instruments.memory import measure_memory
from ckpt_lab.nonreentrant import checkpoint
from ckpt_lab.strategies import REGISTRY, by_label

# torch's FSDP recipe, private (ckpt_lab/torch_private.py): without it this module can't be imported.
try:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
except ImportError as error:
    wrapper = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
    raise missing_error(f"{wrapper}.checkpoint_wrapper", "ckpt_lab.distributed") from error

__all__ = [
    "REENTRANT",
    "STRATEGIES",
    "Block",
    "DDPResult",
    "FSDPResult",
    "ParameterHooks",
    "TinyNet",
    "WorkerError",
    "build_model",
    "ddp_train_steps",
    "fail_on_rank",
    "free_port",
    "fsdp_train_steps",
    "global_batch",
    "run_workers",
    "shard_model",
    "sum_of_ranks",
    "trace_parameter_hooks",
]


# ====================================================================================== small workers
def sum_of_ranks(rank: int, world_size: int) -> int:
    """All-reduce each rank's number: every rank returns ``0 + 1 + ... + (world_size - 1)``."""
    value = torch.tensor([rank])
    dist.all_reduce(value)
    return int(value.item())


def fail_on_rank(
    rank: int, world_size: int, how: str = "raise", bad_rank: int = 1, pid_dir: str | None = None
) -> int:
    """Rank ``bad_rank`` fails; the others wait for it in a barrier, which on their own they would
    never leave. ``how``: ``"raise"`` an exception, ``"exit"`` without a word (``os._exit(3)``, as a
    crash or the OOM killer would), or ``"hang"`` (sleep for an hour). Every rank that gets here
    writes its process id into ``pid_dir`` first (if given), so that a test can check it is gone."""
    if pid_dir is not None:
        with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    if rank == bad_rank:
        if how == "raise":
            raise ValueError(f"rank {rank} failed on purpose")
        if how == "exit":
            os._exit(3)
        if how == "hang":
            time.sleep(3600)
    dist.barrier()
    return rank


# ========================================================================== the strategies and the model
# The strategies notebook 06 runs, by label, in the order its tables print them. Every one comes from
# the project's registry (ckpt_lab/strategies.py); the labels travel to the worker processes,
# and each worker looks its strategy up there: functions would have to be pickled, names needn't.
STRATEGIES: tuple[str, ...] = tuple(
    REGISTRY[name].label
    for name in (
        "none",
        "torch-reentrant",
        "ckpt-reentrant",
        "torch-nonreentrant",
        "ckpt-nonreentrant",
        "ckpt-scope",
    )
)
# The two whose checkpoint is one autograd.Function that runs a nested backward (notebook 02).
REENTRANT: tuple[str, ...] = tuple(REGISTRY[name].label for name in ("torch-reentrant", "ckpt-reentrant"))


class Block(nn.Module):
    """``x + tanh(linear(x))``: the unit we checkpoint, a stand-in for a transformer layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class TinyNet(nn.Module):
    """``stem -> blocks -> head``; each block runs through the registry's per-block wrapper of the
    strategy labelled ``strategy`` (one of ``STRATEGIES``, or any other per-block label).

    The stem is not checkpointed, so every checkpointed block gets an input that requires grad (a
    reentrant checkpoint whose inputs don't would silently train nothing, notebook 02). With
    ``repeat=2`` the blocks run twice (tied weights, as in ALBERT): each parameter is used in two
    checkpointed calls.
    """

    def __init__(
        self, in_features: int = 4, width: int = 16, depth: int = 3, strategy: str = "none", repeat: int = 1
    ) -> None:
        super().__init__()
        # Fail here, not in the first forward: by_label names the registered labels if it is unknown.
        if by_label(strategy).block is None:
            raise ValueError(f"TinyNet: {strategy!r} runs a whole stack of blocks, not one block at a time")
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.strategy = strategy
        self.repeat = repeat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        # The registry's wrapper: run_block(block, x) checkpoints one block (or just calls it: "none").
        run_block = by_label(self.strategy).block
        for _ in range(self.repeat):
            for block in self.blocks:
                x = run_block(block, x)
        return self.head(x)


# ================================================================================================ DDP
@dataclass(frozen=True)
class DDPResult:
    """One rank's view of a DDP run. Comparisons are ``None`` where the run failed."""

    strategy: str
    error: str | None
    # Parameters and gradients after the steps match single-process training on the global batch.
    params_match_reference: bool | None
    grads_match_reference: bool | None
    # Bitwise equal to the same DDP run without checkpointing (recomputation changes nothing).
    bitwise_equal_to_no_checkpoint: bool | None
    # Every rank holds bitwise the same parameters (DDP's promise).
    ranks_agree: bool | None
    # Forward calls of the first block on this rank over all steps: one per step without
    # checkpointing, two with a checkpoint that calls the block again in backward.
    block_forwards: int | None


def ddp_train_steps(
    rank: int,
    world_size: int,
    strategy: str,
    steps: int = 3,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
    repeat: int = 1,
    batch_per_rank: int = 4,
    lr: float = 0.1,
) -> DDPResult:
    """Train ``TinyNet`` under ``DistributedDataParallel`` for ``steps`` SGD steps, each block run
    through the strategy labelled ``strategy``; compare with single-process training on the global
    batch.

    A ``RuntimeError`` raised by DDP in training is the result (``error``), not a crash: it is the
    failure this worker exists to show (a reentrant checkpoint with ``find_unused_parameters=True``
    or ``repeat=2``; ``trace_parameter_hooks`` explains it).
    """
    x_all, y_all = global_batch(batch_per_rank * world_size)
    local = slice(rank * batch_per_rank, (rank + 1) * batch_per_rank)
    x, y = x_all[local], y_all[local]
    options = {"find_unused_parameters": find_unused_parameters, "static_graph": static_graph}
    try:
        with warnings.catch_warnings():
            # DDP warns that static_graph and find_unused_parameters together are redundant; known.
            warnings.simplefilter("ignore", UserWarning)
            model, block_forwards = _ddp_run(strategy, x, y, steps, lr, repeat, options)
    except RuntimeError as error:
        # The reducer raises on every rank alike (each counts its own marks), so no rank is left
        # waiting in a collective for the other.
        return DDPResult(strategy, str(error), None, None, None, None, None)

    reference = build_model("none", repeat)
    _train_reference(reference, x_all, y_all, steps, lr)
    # Gradients: the last step's, which both runs keep (zero_grad only runs at the start of a step).
    params = [p.detach() for p in model.parameters()]
    grads = [p.grad for p in model.parameters()]
    ref_params = [p.detach() for p in reference.parameters()]
    ref_grads = [p.grad for p in reference.parameters()]

    plain, _ = _ddp_run("none", x, y, steps, lr, repeat, {})
    bitwise = _all_equal(params, [p.detach() for p in plain.parameters()]) and _all_equal(
        grads, [p.grad for p in plain.parameters()]
    )

    # Rank 0's parameters, sent to everyone: each rank checks it holds exactly the same.
    flat = torch.cat([p.reshape(-1) for p in params])
    from_rank0 = flat.clone()
    dist.broadcast(from_rank0, src=0)
    return DDPResult(
        strategy=strategy,
        error=None,
        params_match_reference=_all_close(params, ref_params),
        grads_match_reference=_all_close(grads, ref_grads),
        bitwise_equal_to_no_checkpoint=bitwise,
        ranks_agree=torch.equal(flat, from_rank0),
        block_forwards=block_forwards,
    )


def _ddp_run(
    strategy: str,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    lr: float,
    repeat: int,
    ddp_options: dict[str, Any],
) -> tuple[TinyNet, int]:
    """``steps`` SGD steps of ``TinyNet`` under DDP on this rank's batch; the model and the number of
    times its first block ran."""
    model = build_model(strategy, repeat)
    calls = CallCounter(model.blocks[0])
    ddp = DistributedDataParallel(model, **ddp_options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        _loss(ddp, x, y).backward()
        optimizer.step()
    calls.remove()
    return model, calls.count


# ========================================================= the reducer's bookkeeping, in one process
# Why a reentrant checkpoint fails under DDP (notebooks 01–02 give the pieces). A reentrant checkpoint
# is one autograd.Function, whose node links only to its tensor *inputs*; the block's parameters hang
# off a private graph that the node's backward builds and runs with a nested torch.autograd.backward.
# DDP registers a hook on every parameter's gradient accumulator and expects each parameter to become
# "ready" exactly once per backward. With find_unused_parameters=True it walks the graph after
# forward, cannot see the parameters inside the checkpoint, declares them unused and marks them ready
# as soon as backward starts; then the nested backward fires their hooks and marks them again:
# "Expected to mark a variable ready only once". A checkpointed block run twice (tied weights) fires
# each hook twice even without the walk. static_graph=True makes DDP learn the real counts in the
# first iteration instead; the non-reentrant checkpoint keeps the ordinary graph, so DDP sees nothing
# unusual at all.
@dataclass(frozen=True)
class ParameterHooks:
    """What DDP's reducer sees of one parameter in one forward and backward.

    * ``reachable``: a walk of the autograd graph from the output finds the parameter's gradient
      accumulator (``find_unused_parameters=True`` does that walk after every forward);
    * ``fired_outer`` / ``fired_nested``: how often its gradient hook fired in the outer backward
      and in nested backwards (those a reentrant checkpoint runs inside its node).
    """

    name: str
    reachable: bool
    fired_outer: int
    fired_nested: int

    def ready_marks(self, find_unused_parameters: bool) -> int:
        """How often DDP marks the parameter ready: once per hook firing, plus once when backward's
        first hook fires if the walk declared it unused. Without ``static_graph`` the reducer
        insists on exactly one; a second mark raises "Expected to mark a variable ready only once"."""
        return self.fired_outer + self.fired_nested + int(find_unused_parameters and not self.reachable)


def trace_parameter_hooks(model: nn.Module, x: torch.Tensor) -> list[ParameterHooks]:
    """Run ``model(x).sum()`` forward and backward in this process; report each parameter's hooks."""
    fired: dict[str, list[int]] = {name: [] for name, _ in model.named_parameters()}
    handles = [
        # The hook DDP uses fires when autograd has accumulated the parameter's gradient; so does this
        # one. We note which backward (graph task) it fired in.
        p.register_post_accumulate_grad_hook(
            lambda _, name=name: fired[name].append(torch._C._current_graph_task_id())
        )
        for name, p in model.named_parameters()
    ]
    outer: list[int] = []
    try:
        out = model(x)
        reachable = _reachable_leaves(out)
        # A hook on the output runs in the outer backward: it tells us that backward's task id.
        out.register_hook(lambda grad: outer.append(torch._C._current_graph_task_id()))
        out.sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    return [
        ParameterHooks(
            name=name,
            reachable=id(p) in reachable,
            fired_outer=sum(task == outer[0] for task in fired[name]),
            fired_nested=sum(task != outer[0] for task in fired[name]),
        )
        for name, p in model.named_parameters()
    ]


def _reachable_leaves(output: torch.Tensor) -> set[int]:
    """``id``s of the leaf tensors whose ``AccumulateGrad`` nodes a walk from ``output`` reaches."""
    seen: set[Any] = set()
    leaves: set[int] = set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # only AccumulateGrad nodes have one
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


# =============================================================================================== FSDP
@dataclass(frozen=True)
class FSDPResult:
    """One rank's view of an FSDP2 (``fully_shard``) run."""

    checkpointed: bool
    params_match_reference: bool
    grads_match_reference: bool
    # Parameter bytes this rank holds (its shards) and the model's full parameter bytes.
    local_param_bytes: int
    full_param_bytes: int
    # Bytes created by one forward on this rank and still alive at its end: the activations kept for
    # backward, the model's output and the loss; measured by ckpt_lab.measure_memory.
    retained_bytes: int
    # The same, for the unsharded model run on the global batch in one process, for comparison.
    single_process_retained_bytes: int
    # Forward calls of the first block in the measured forward and backward: 2 when backward
    # recomputes it.
    block_forwards: int


def fsdp_train_steps(
    rank: int,
    world_size: int,
    checkpointed: bool = True,
    steps: int = 3,
    batch_per_rank: int = 64,
    width: int = 64,
    lr: float = 0.1,
) -> FSDPResult:
    """Train ``TinyNet`` sharded with FSDP2 (``fully_shard``, CPU, gloo) for ``steps`` SGD steps, each
    block wrapped with ``ckpt_lab.checkpoint`` through ``checkpoint_wrapper`` if ``checkpointed``;
    compare with single-process training; measure one more forward and backward's memory."""
    sizes = {"width": width}
    x_all, y_all = global_batch(batch_per_rank * world_size)
    local = slice(rank * batch_per_rank, (rank + 1) * batch_per_rank)
    x, y = x_all[local], y_all[local]
    mesh = init_device_mesh("cpu", (world_size,))

    model = shard_model(build_model(**sizes), checkpointed, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        _loss(model, x, y).backward()
        optimizer.step()

    reference = build_model(**sizes)
    _train_reference(reference, x_all, y_all, steps, lr)
    # Gather each sharded DTensor into a full tensor (a collective: every rank calls it in order).
    params = [p.full_tensor() for p in model.parameters()]
    grads = [p.grad.full_tensor() for p in model.parameters()]
    params_match = _all_close(params, [p.detach() for p in reference.parameters()])
    grads_match = _all_close(grads, [p.grad for p in reference.parameters()])

    # One more forward and backward, measured. Lazy initialisation (the buffers FSDP gathers into)
    # happened in the first step, before this region, so what is counted here is this pass's own.
    # Counted: the first Block itself, inside its checkpoint wrapper if any (the recomputation calls
    # the block, not the wrapper).
    # Measured three times, keeping the smallest: on a loaded machine one pass in a few kept one more
    # activation alive at the end of the forward (33,280 bytes; seen in tests, cause not pinned down,
    # most likely FSDP's asynchronous gloo work finishing late). The smallest is the pass's own memory.
    counter = CallCounter(next(m for m in model.modules() if isinstance(m, Block)))
    reports = []
    for _ in range(3):
        counter.reset()
        reports.append(measure_memory(lambda: _loss(model, x, y)))
    report = min(reports, key=lambda r: r.retained_bytes)
    counter.remove()
    single = measure_memory(lambda: _loss(reference, x_all, y_all))
    return FSDPResult(
        checkpointed=checkpointed,
        params_match_reference=params_match,
        grads_match_reference=grads_match,
        local_param_bytes=sum(p.to_local().nbytes for p in model.parameters()),
        full_param_bytes=sum(p.nbytes for p in reference.parameters()),
        retained_bytes=report.retained_bytes,
        single_process_retained_bytes=single.retained_bytes,
        block_forwards=counter.count,
    )


def shard_model(model: TinyNet, checkpointed: bool, mesh: Any) -> TinyNet:
    """Wrap each block with ``ckpt_lab.checkpoint`` (if asked), then shard blocks and root with FSDP2."""
    if checkpointed:
        # checkpoint_wrapper calls checkpoint_fn(module, *args): ckpt_lab.checkpoint has that signature.
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_fn=checkpoint),
            check_fn=lambda module: isinstance(module, Block),
        )
    # Checkpoint inside, shard outside (torchtitan's order): FSDP's pre-backward hook on the block's
    # output gathers the parameters before the checkpoint's recomputation needs them.
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# ================================================================= training, shared by DDP and FSDP
def build_model(strategy: str = "none", repeat: int = 1, **sizes: int) -> TinyNet:
    """The same float64 model on every rank and in every reference."""
    # Parameters are drawn at construction: the same generator state gives every rank the same model.
    torch.manual_seed(0)
    return TinyNet(strategy=strategy, repeat=repeat, **sizes).double()


def global_batch(batch: int, in_features: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of the whole (global) batch; every rank makes the same and takes its slice."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, in_features, dtype=torch.float64, generator=generator)
    y = torch.randn(batch, 1, dtype=torch.float64, generator=generator)
    return x, y


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # A mean over the local batch: averaging the ranks' gradients (what DDP and FSDP do) then gives
    # the gradient of the mean over the global batch, which is what the reference computes.
    return nn.functional.mse_loss(model(x), y)


def _train_reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float) -> None:
    """Single-process training on the global batch: what the distributed runs must reproduce."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        _loss(model, x, y).backward()
        optimizer.step()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # float64: summing in another order (per rank, then across ranks) moves the last bits only.
    return torch.allclose(a, b, rtol=0.0, atol=1e-12)


def _all_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(_close(u, v) for u, v in zip(a, b, strict=True))


def _all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
