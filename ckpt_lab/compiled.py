"""Checkpointing in the compiler: what torch.compile saves, its memory budget, and our checkpoints under it.

Introduced in notebook 08. The entry point measures one compiled training step:

    step = compile_step(fn, x, budget=0.5)    # torch._functorch.config.activation_memory_budget
    step.saved_bytes, step.saved               # what the compiled forward keeps for backward
    step.recomputed, step.recompute_flops      # forward ops the backward graph runs again
    print(step.summary())                      # saved tensors by graph name, recomputed ops
    print(step.describe())                     # both partitioned graphs, one line per op

``compiled_points(workload, budgets)`` does it for a benchmark stack at several budgets, as records
of this module's own (``BudgetPoint``), which ``python -m ckpt_lab.bench.pareto --compile`` plots;
this module imports nothing from the harness (NOTE [ Records of its own ]).

NOTE [ Which backend ]
Every number here comes from ``BACKEND``: AOTAutograd with inductor's decompositions and inductor's
min-cut partitioner, and no code generation (the graphs run op by op in eager). It decides what to
save exactly as ``torch.compile``'s default ``inductor`` backend does, without the C++ build (under a
second per compilation instead of 15 s on 2 cores); inductor would add fused kernels (times), not
different saved tensors. The partitioned graphs are recorded as they are handed to the (no-op)
compilers.

NOTE [ Measuring what a compiled function saves ]
AOTAutograd runs the whole compiled forward as one ``autograd.Function`` (``CompiledFunction``),
whose ``save_for_backward`` goes through the saved-tensor hooks active at call time: a hook around
the compiled call sees exactly what the partitioner chose to keep. Bytes are per storage (two views
of one buffer count once), parameters left out (every strategy keeps them). The backward graph's
ops that the joint graph tagged as forward ops are the recomputation; their cost is
``instruments.flops.op_cost`` on the decomposed ops (exact for matmuls; one per element for each
pointwise op, so a decomposed GELU costs several).

NOTE [ Memory inside the compiled graphs ]
Our dispatch-mode instruments cannot wrap a compiled call: with a ``TorchDispatchMode`` active,
Dynamo runs the function eagerly (the numbers would be eager's). So the recording backend enters
them *inside* the compiled forward and backward (``_INSIDE``): ``LiveMemory`` then sees every
storage the graphs create and when it is freed, and ``peak_bytes`` / ``retained_bytes`` are exact
for the compiled schedule, in the benchmark's terms (created in the step; gradients left out of the
peak; the loss, computed outside the graphs, left out of both). Matmul FLOPs and aten ops are
counted from the two graphs (the same totals ``CostCounter`` and ``OpCounter`` count at run time).

NOTE [ Random ops under a memory budget ]
With dropout, any ``activation_memory_budget`` below 1 can make the partitioner recompute the random
draw in the backward graph, where it draws *fresh* numbers: the backward applies another mask than
the forward and the gradients are silently wrong (the PyTorch issue "Memory-budget partitioner
recomputes RNG ops with fresh randomness in backward", open in torch 2.13; inductor too, on CPU).
``compile_step`` therefore checks every compiled step's gradients against the same compiled step at
budget 1 and reports ``grads_ok``; the budget's bytes and FLOPs are real either way.

NOTE [ Checkpoints under torch.compile ]
torch's own checkpoints are understood by Dynamo: ``torch.utils.checkpoint`` (both variants, and
selective checkpointing with a ``context_fn`` defined at module level) becomes a higher-order op
that the partitioner obeys. Ours are Python: saved-tensor hooks, dispatch modes, a frame that
recomputes in backward. Traced by Dynamo, the non-reentrant checkpoint crashed in backward with a
bare ``StopIteration`` (the recomputation ran on traced tensors it could not match), and CPU offload
crashed inside Dynamo's fake-tensor tracing of its pack hook. So each of our entry points (``checkpoint``,
``reentrant_checkpoint``, ``selective_checkpoint``, ``offload_to_cpu``'s hooks) starts with
``if torch.compiler.is_compiling(): return run_eagerly(...)``: Dynamo meets a function it is told not
to trace, breaks the graph there, and runs the checkpoint eagerly, with its eager memory and
gradients. ``gradient_checkpoint_scope`` needs nothing: Dynamo cannot trace its thread-local set-up,
breaks the graph there and runs it eagerly. The cost is the graph break: the compiler
optimises only around our checkpoints, never through them; to let it see the block, use torch's
checkpoint (``Plan.torch_context_fn`` hands the planner's plan to it).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt_lab._eager import run_eagerly
from ckpt_lab.errors import missing_error, optional

__all__ = [
    "BACKEND",
    "BudgetPoint",
    "BudgetRow",
    "CompiledStep",
    "compile_step",
    "compiled_points",
    "compiled_results",
    "graph_breaks",
    "run_eagerly",
]


# What this module compiles with, by name (see NOTE [ Which backend ]).
BACKEND = "aot_eager_decomp_partition (recorded)"
SEED = 1


@dataclass
class CompiledStep:
    """One compiled forward + backward at one memory budget (see the module's NOTEs)."""

    budget: float
    saved: list[tuple[tuple[int, ...], str, int]]  # (shape, dtype, storage bytes) per saved storage
    recomputed: list[str]  # forward ops the backward graph runs again, in order
    recompute_flops: int
    forward_graph: torch.fx.GraphModule
    backward_graph: torch.fx.GraphModule
    grads: list[torch.Tensor | None] = field(repr=False)  # see ``compile_step``
    grads_ok: bool | None = None
    storages: set[int] = field(default_factory=set, repr=False)  # data pointers of the saved storages
    # Measured inside the compiled graphs (NOTE [ Memory inside the compiled graphs ]).
    retained_bytes: int = 0  # alive when the forward ends: what it keeps, plus its output
    peak_bytes: int = 0  # most alive at once over forward and backward, gradients excluded
    peak_bytes_with_grads: int = 0  # the same, counting the gradients backward leaves behind
    flops: int = 0  # matmul FLOPs of both graphs, as the benchmark counts them
    aten_ops: int = 0  # aten ops in both graphs (a higher-order op's insides not counted)
    # False where a graph held higher-order ops and ran unmeasured: the four numbers above are then 0.
    measured: bool = True

    @property
    def saved_bytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self.saved)

    @property
    def saved_names(self) -> list[str]:
        """Graph names of what the forward hands to backward: the backward graph's inputs other than
        ``tangents_*`` (the output gradients). Parameters included, unlike ``saved``."""
        return [
            n.name
            for n in self.backward_graph.graph.nodes
            if n.op == "placeholder" and not n.name.startswith("tangents")
        ]

    def summary(self) -> str:
        """What crosses to backward, one line per tensor (graph name, the forward op that made it or
        ``input``, shape, bytes), then the recomputed ops: ``describe`` without the full op lists."""
        made = {n.name: n for n in self.forward_graph.graph.nodes}
        lines = []
        for name in self.saved_names:
            node = made.get(name)
            val = node.meta.get("val") if node is not None else None
            by = "input" if node is None or node.op == "placeholder" else _short(node.target)
            shape = f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}" if val is not None else "?"
            size = val.numel() * val.element_size() if val is not None else 0
            lines.append(f"saved {name:10} made by {by:6} {shape:16} {size:6d} B")
        lines.append("recomputed in backward: " + (" ".join(self.recomputed) or "-"))
        return "\n".join(lines)

    def describe(self) -> str:
        """Both partitioned graphs, one short line per op (see ``compact``)."""
        return "forward:\n" + compact(self.forward_graph) + "\nbackward:\n" + compact(self.backward_graph)


# The compiler's private API this module reads (ckpt_lab/torch_private.py lists each use): the backend's
# parts, the partitioner's budget, Dynamo's explain. On a torch without one, the measurement that needs
# it raises a clear error naming it and the torch version; never numbers of another compilation.
def _private(path: str) -> Any:
    found = optional(path)
    if found is None:
        raise missing_error(path, "ckpt_lab.compiled")
    return found


def _memory_budget(budget: float) -> contextlib.AbstractContextManager:
    """``torch._functorch.config.patch(activation_memory_budget=budget)``, or the clear error."""
    _private("torch._functorch.config.activation_memory_budget")
    return torch._functorch.config.patch(activation_memory_budget=budget)


# Dispatch modes the compiled graphs run under (NOTE [ Memory inside the compiled graphs ]).
_INSIDE: list[Any] = []


def _graph_memory() -> Any:
    """``LiveMemory`` that lets higher-order ops through (torch's checkpoint puts
    ``run_and_save_rng_state`` in the graph): their outputs are counted, their insides are not."""
    from ckpt_lab.instruments.memory import LiveMemory

    class GraphMemory(LiveMemory):
        supports_higher_order_operators = True

    return GraphMemory()


_UNMEASURED: list[str] = []  # graphs that ran without them (``_has_higher_order_ops``)


def _has_higher_order_ops(gm: torch.fx.GraphModule) -> bool:
    # torch's checkpoint with dropout leaves run_and_save_rng_state / run_with_rng_state in the graphs:
    # higher-order ops our dispatch modes do not handle, so such graphs run unmeasured.
    higher_order = _private("torch._ops.HigherOrderOperator")
    return any(isinstance(n.target, higher_order) for n in gm.graph.nodes)


def _run_inside(kind: str, compiled_fn: Callable[..., Any], measurable: bool = True) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        # Boxed (one list, as ``_boxed_call`` asks); or, were torch to stop reading that attribute, the
        # graph's inputs one by one: the compiled graph takes them as one list either way.
        args = args[0] if len(args) == 1 and isinstance(args[0], list) else list(args)
        if not measurable:
            _UNMEASURED.append(kind)
            return compiled_fn(args)
        from ckpt_lab.instruments.memory import LiveMemory

        with contextlib.ExitStack() as stack:
            for mode in _INSIDE:
                if isinstance(mode, LiveMemory):
                    mode.phase = kind
                stack.enter_context(mode)
            out = compiled_fn(args)
        for mode in _INSIDE:
            if isinstance(mode, LiveMemory):
                mode.closed = False  # keep recording frees between the graphs
        return out

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _recording_backend(graphs: dict[str, torch.fx.GraphModule]) -> Callable[..., Any]:
    """``aot_eager_decomp_partition``, with its forward and backward graphs kept in ``graphs``."""
    from functorch.compile import min_cut_rematerialization_partition

    aot_autograd = _private("torch._dynamo.backends.common.aot_autograd")
    boxed_nop = _private("torch._dynamo.backends.debugging.boxed_nop")

    def recorder(kind: str) -> Callable[..., Any]:
        def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            graphs[kind] = gm
            return _run_inside(kind, boxed_nop(gm, example_inputs), not _has_higher_order_ops(gm))

        return compiler

    return aot_autograd(
        fw_compiler=recorder("forward"),
        bw_compiler=recorder("backward"),
        # The decompositions and partitioner torch.compile's inductor backend uses.
        decompositions=lambda: _private("torch._inductor.compile_fx.select_decomp_table")(),
        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
    )


def _is_recomputed(node: torch.fx.Node) -> bool:
    # The joint graph tags each node forward or backward; a forward node in the backward graph is
    # an op the partitioner chose to run again rather than save its output.
    return node.op == "call_function" and node.meta.get("partitioner_tag") != "is_backward"


def _node_cost(node: torch.fx.Node, cost: Callable[..., int] | None = None) -> int:
    from ckpt_lab.instruments.flops import op_cost

    if not isinstance(node.target, torch._ops.OpOverload):
        return 0
    meta = lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a
    args = torch.fx.node.map_aggregate(node.args, meta)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, meta)
    try:
        return (cost or op_cost)(node.target, args, kwargs, node.meta.get("val"))
    except Exception:  # an op the cost model cannot size from metadata alone: count its elements
        val = node.meta.get("val")
        return val.numel() if isinstance(val, torch.Tensor) else 0


def _mean_square(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


class _NotCallable(TypeError, AssertionError):
    """torch.compile raises ``AssertionError`` for a function that is not callable; a ``TypeError`` is
    what Python code expects. Both ``except`` clauses catch this one."""


def compile_step(
    fn: Callable[..., torch.Tensor],
    *inputs: torch.Tensor,
    budget: float = 1.0,
    params: Sequence[torch.Tensor] = (),
    check: bool = True,
    loss: Callable[[torch.Tensor], torch.Tensor] | None = _mean_square,
) -> CompiledStep:
    """Compile ``fn`` at ``activation_memory_budget=budget``, run one seeded forward and backward
    (loss = mean of the output squared) and report what it saved and recomputed.

    ``params``: tensors whose gradients are compared (besides the inputs that require grad; an
    ``nn.Module`` given as ``fn`` brings its own parameters when ``params`` is empty); ``grads`` holds
    their gradients, in that order (``None`` where backward left none). An input need not require
    grad: an ordinary data batch is differentiated through the parameters only. With ``check`` the
    step is run again at budget 1 and ``grads_ok`` says whether the gradients agree (NOTE [ Random
    ops ... ]). ``loss`` makes the step's loss from ``fn``'s output; ``None`` when ``fn`` returns it
    (then the loss is computed, and measured, inside the compiled graphs).
    """
    if not callable(fn):
        # torch.compile(fn) would take a non-callable for its decorator form and blame the tensor.
        raise _NotCallable(
            f"A callable function is expected, but {type(fn)} is provided. compile_step: the first "
            f"argument, fn, is the function (or nn.Module) to compile, and {fn!r:.60} is not callable; "
            "the tensors it runs on come after it: compile_step(fn, *inputs)."
        )
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
        # The partitioner reads any float; outside [0, 1] it fails deep inside the compiler, and NaN
        # compares false with everything, so it would pass silently as some budget.
        raise ValueError(
            f"compile_step: budget must be a number from 0 to 1 (activation_memory_budget: the fraction "
            f"of the activations' bytes torch.compile may keep; 1 keeps all, 0 recomputes all it can), "
            f"got {budget!r}."
        )
    if not params and isinstance(fn, torch.nn.Module):
        params = [p for p in fn.parameters() if p.requires_grad]
    graphs: dict[str, torch.fx.GraphModule] = {}
    # What backward differentiates: inputs that require grad (a data batch does not), then parameters.
    leaves = [t for t in (*inputs, *params) if isinstance(t, torch.Tensor) and t.requires_grad]
    saved: dict[int, tuple[tuple[int, ...], str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            saved.setdefault(
                storage.data_ptr(), (tuple(t.shape), str(t.dtype).removeprefix("torch."), storage.nbytes())
            )
        return t

    from ckpt_lab.instruments.flops import matmul_flops

    torch.compiler.reset()
    mem = _graph_memory()
    with _memory_budget(budget):
        compiled = torch.compile(fn, backend=_recording_backend(graphs))
        for t in leaves:
            t.grad = None
        torch.manual_seed(SEED)
        _INSIDE[:] = [mem]
        _UNMEASURED.clear()
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = compiled(*inputs)
            retained = mem.snapshot("after forward")
            # The output is held until backward is done (its bytes count until then).
            scalar = out if loss is None else loss(out)
            if not scalar.requires_grad:
                raise RuntimeError(
                    "element 0 of tensors does not require grad and does not have a grad_fn. compile_step: "
                    "the loss does not depend on anything that requires grad (no input requires grad and "
                    "fn uses no trainable parameter): there is no backward to compile."
                )
            if loss is None:
                # The step's loss is the graphs' output: the gradient backward starts from is the
                # step's too (eager's measure_memory counts it), so it is made where it is counted.
                mem.phase = "backward"
                with mem:
                    start = torch.ones_like(scalar)
                mem.closed = False
                scalar.backward(start)
                del start
            else:
                scalar.backward()
            del out, scalar
            mem.snapshot("after backward")
        finally:
            _INSIDE.clear()
            mem.closed = True
    torch.compiler.reset()
    grads = [None if t.grad is None else t.grad.detach().clone() for t in leaves]
    backward = graphs["backward"]
    recomputed = [n for n in backward.graph.nodes if _is_recomputed(n)]
    ops = [
        n
        for gm in (graphs["forward"], backward)
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
    ]
    step = CompiledStep(
        budget,
        list(saved.values()),
        [_short(n.target) for n in recomputed],
        sum(_node_cost(n) for n in recomputed),
        graphs["forward"],
        backward,
        grads,
        storages=set(saved),
        retained_bytes=retained,
        peak_bytes=mem.peak(exclude=mem.born_in("backward")),
        peak_bytes_with_grads=mem.peak(),
        flops=sum(_node_cost(n, matmul_flops) for n in ops),
        aten_ops=len(ops),
    )
    if _UNMEASURED:
        step.measured = False
        step.retained_bytes = step.peak_bytes = step.peak_bytes_with_grads = step.flops = step.aten_ops = 0
    if check:
        reference = (
            step
            if budget == 1.0
            else compile_step(fn, *inputs, budget=1.0, params=params, check=False, loss=loss)
        )
        step.grads_ok = _same_grads(step, reference)
    return step


def _same_grads(a: CompiledStep, b: CompiledStep) -> bool:
    """Gradients agree (to float tolerance: the budget reorders the arithmetic), ``None`` with ``None``."""
    return all(
        (u is None and v is None)
        or (u is not None and v is not None and torch.allclose(u, v, rtol=1e-4, atol=1e-6))
        for u, v in zip(a.grads, b.grads, strict=True)
    )


def _short(target: Any) -> str:
    """``aten.addmm.default`` -> ``addmm``."""
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def compact(gm: torch.fx.GraphModule, width: int = 96) -> str:
    """A graph in a few lines: its inputs, its ops in order (``addmm erf mul ...``), its outputs."""
    nodes = list(gm.graph.nodes)
    inputs = [n.name for n in nodes if n.op == "placeholder"]
    ops = [_short(n.target) for n in nodes if n.op == "call_function"]
    outputs = (
        [a.name for a in nodes[-1].args[0] if isinstance(a, torch.fx.Node)]
        if nodes[-1].op == "output"
        else []
    )
    lines = []
    for label, words in (("in ", inputs), ("ops", ops), ("out", outputs)):
        line = f"  {label} ({len(words)}):"
        for w in words:
            if len(line) + len(w) + 1 > width:
                lines.append(line)
                line = "        "
            line += " " + w
        lines.append(line)
    return "\n".join(lines)


def graph_breaks(fn: Callable[..., Any], *inputs: Any) -> tuple[int, int]:
    """(graphs, graph breaks) that Dynamo makes of ``fn(*inputs)``, from ``torch._dynamo.explain``."""
    torch.compiler.reset()
    explained = _private("torch._dynamo.explain")(fn)(*inputs)
    torch.compiler.reset()
    return explained.graph_count, explained.graph_break_count


# ------------------------------------------------------------------ a stack's budget sweep, as records
# NOTE [ Records of its own ]
# This module is notebook 08's; the harness (``ckpt_lab.bench``) is a user of it, never the other way
# round. The two sweeps below run a benchmark stack (anything with ``blocks``, ``input`` and
# ``parameters()``) and return records defined here, ``BudgetPoint`` and ``BudgetRow``; the harness
# turns them into its own ``Point`` (``bench.pareto``) and ``Result`` (``bench.measure``). Built the
# other way, importing the benchmark's classes here, it was an import circle: the Pareto sweep
# imported this module, and this module the Pareto sweep.
@dataclass(frozen=True)
class BudgetPoint:
    """One budget of ``compiled_points``, in the planner's terms (``bench.pareto`` plots it)."""

    budget: float
    retained_bytes: int  # what the compiled forward saves, plus the first block's input
    recompute_flops: int  # the backward graph's recomputed forward ops, planner cost model
    saved: int  # storages saved
    recomputed: int  # ops recomputed
    grads_ok: bool  # gradients equal the same compiled stack at budget 1


@dataclass(frozen=True)
class BudgetRow:
    """One budget of ``compiled_results``, measured as the benchmark measures a strategy."""

    budget: float
    retained_bytes: int
    peak_bytes: int
    flops: int
    aten_ops: int
    grads_ok: bool
    seconds: float
    time_vs_none: float
    activation_bytes: int  # planner terms: saved bytes plus the first block's input


def _stack(workload: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    blocks = workload.blocks

    def run(x: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            x = b(x)
        return x

    return run


def compiled_points(
    workload: Any, budgets: Sequence[float] = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)
) -> list[BudgetPoint]:
    """The compiler's budget sweep on a benchmark stack, in the planner's terms (``BudgetPoint``).

    Retained bytes count the first block's input (as ``bench.pareto`` does) whether or not the
    compiled forward saved it; recompute FLOPs are the backward graph's recomputed ops.
    """
    run, x, params = _stack(workload), workload.input, workload.parameters()
    x_bytes = x.untyped_storage().nbytes()
    reference = compile_step(run, x, budget=1.0, params=params, check=False)
    points = []
    for budget in budgets:
        step = reference if budget == 1.0 else compile_step(run, x, budget=budget, params=params, check=False)
        retained = step.saved_bytes + (0 if x.untyped_storage().data_ptr() in step.storages else x_bytes)
        ok = _same_grads(step, reference)
        points.append(
            BudgetPoint(budget, retained, step.recompute_flops, len(step.saved), len(step.recomputed), ok)
        )
    return points


def compiled_results(
    workload: Any, budgets: Sequence[float] = (1.0, 0.5, 0.0), rounds: int = 3
) -> list[BudgetRow]:
    """``python -m ckpt_lab.bench --compile``: the compiler's budgets, measured as the benchmark's rows.

    Memory, matmul FLOPs and aten ops are measured inside the compiled graphs (NOTE [ Memory inside
    the compiled graphs ]); ``grads_ok`` compares with the compiled step at budget 1 (compiled dropout
    draws other masks than eager's, so eager's gradients are no reference); time is the median over
    ``rounds`` of the compiled step's time divided by eager no-checkpointing's in the same round.
    """
    import statistics
    import time

    wl = workload
    params = wl.parameters()
    run = _stack(wl)

    def timed(f: Callable[..., torch.Tensor]) -> float:
        for t in [wl.input, *params]:
            t.grad = None
        if wl.input.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.manual_seed(SEED)
        f(wl.input).square().mean().backward()
        if wl.input.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    x_ptr, x_bytes = wl.input.untyped_storage().data_ptr(), wl.input.untyped_storage().nbytes()
    reference = compile_step(run, wl.input, budget=1.0, params=params, check=False)
    rows = []
    for budget in budgets:
        step = (
            reference
            if budget == 1.0
            else compile_step(run, wl.input, budget=budget, params=params, check=False)
        )
        torch.compiler.reset()
        with _memory_budget(budget):
            fast = torch.compile(run, backend=_recording_backend({}))
            timed(fast)  # compiles
            timed(run)
            seconds, ratios = [], []
            for _ in range(rounds):
                eager, compiled_ = timed(run), timed(fast)
                seconds.append(compiled_)
                ratios.append(compiled_ / eager)
        torch.compiler.reset()
        rows.append(
            BudgetRow(
                budget,
                retained_bytes=step.retained_bytes,
                peak_bytes=step.peak_bytes,
                flops=step.flops,
                aten_ops=step.aten_ops,
                grads_ok=_same_grads(step, reference),
                seconds=statistics.median(seconds),
                time_vs_none=statistics.median(ratios),
                activation_bytes=step.saved_bytes + (0 if x_ptr in step.storages else x_bytes),
            )
        )
    return rows
