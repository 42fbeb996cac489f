"""Checkpoints under torch.compile, and the compiler's memory budget (``ckpt_lab.compiled``, notebook 08).

Every compiled run uses the debugging backends (``aot_eager``, or ``ckpt_lab.compiled``'s recording
one): no C++ build, tiny widths, a few seconds in all.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as torch_ckpt
from torch import nn

from ckpt_lab.compiled import compile_step, graph_breaks
from ckpt_lab.offload import offload_to_cpu
from ckpt_lab.planner import plan
from ckpt_lab.strategies import REGISTRY
from oracle import TORCH


def _offload(block, x):
    with offload_to_cpu(include_cpu_tensors=True):
        return block(x)


# Every checkpoint, as the benchmark runs it on one block (``ckpt_lab.strategies``), and offload.
CHECKPOINTS = [
    "torch-nonreentrant", "torch-reentrant", "torch-sac-matmul",
    "ckpt-nonreentrant", "ckpt-reentrant", "ckpt-sac-matmul", "ckpt-scope",
]
WAYS = {**{name: REGISTRY[name].block for name in CHECKPOINTS}, "offload_to_cpu": _offload}

# (graphs, graph breaks) of ``_stack`` with Dynamo: torch's become part of one graph; ours break it at
# each block, leaving one graph per ``x * 1.5`` (NOTE [ Checkpoints under torch.compile ]).
BREAKS = {
    "torch-nonreentrant": (1, 0),
    "torch-reentrant": (1, 0),
    "torch-sac-matmul": (1, 0),
    "ckpt-nonreentrant": (3, 2),
    "ckpt-reentrant": (3, 2),
    "ckpt-sac-matmul": (3, 2),
    "offload_to_cpu": (3, 2),
}


def _blocks() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.1)) for _ in range(3)
    ).train()


def _stack(blocks, way):
    # Unrolled, with an op between checkpoints: Dynamo gives up on a whole loop that breaks its graph,
    # and a graph break between two checkpoints shows as one more graph.
    def run(x):
        x = way(blocks[0], x * 1.5)
        x = way(blocks[1], x * 1.5)
        return way(blocks[2], x * 1.5)

    return run


def _grads(fn, blocks, x0):
    torch.manual_seed(1)
    x = x0.clone().requires_grad_()
    blocks.zero_grad(set_to_none=True)
    fn(x).square().mean().backward()
    return [x.grad, *(p.grad for p in blocks.parameters())]


@pytest.mark.parametrize("name", list(WAYS))
def test_compiled_gradients_equal_eager(name):
    blocks, x0 = _blocks(), torch.randn(4, 16)
    eager = _grads(_stack(blocks, WAYS[name]), blocks, x0)
    torch._dynamo.reset()
    compiled = _grads(torch.compile(_stack(blocks, WAYS[name]), backend="aot_eager"), blocks, x0)
    torch._dynamo.reset()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(eager, compiled, strict=True))


@pytest.mark.parametrize("name", list(BREAKS))
def test_graph_breaks_as_documented(name):
    blocks = _blocks()
    assert graph_breaks(_stack(blocks, WAYS[name]), torch.randn(4, 16, requires_grad=True)) == BREAKS[name]


def test_the_budget_trades_saved_bytes_for_recomputation():
    torch.manual_seed(0)
    blocks = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4)))
    x = torch.randn(8, 32, requires_grad=True)
    steps = [compile_step(blocks, x, budget=b, params=list(blocks.parameters())) for b in (1.0, 0.5, 0.0)]
    saved = [s.saved_bytes for s in steps]
    flops = [s.recompute_flops for s in steps]
    assert saved[0] > saved[1] > saved[2] and flops[0] < flops[1] < flops[2]
    assert all(s.grads_ok for s in steps)  # no random ops: every budget computes the same gradients
    assert "addmm" in steps[2].recomputed and "addmm" not in steps[0].recomputed


def test_random_ops_recomputed_under_a_budget_are_reported():
    # torch 2.13: below budget 1 the partitioner recomputes dropout's draw with fresh randomness
    # (NOTE [ Random ops under a memory budget ]). If this fails, torch fixed it: update the NOTE.
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5), nn.Linear(32, 32))
    x = torch.randn(8, 32, requires_grad=True)
    assert compile_step(block, x, budget=0.0, params=list(block.parameters())).grads_ok is False


def test_the_planners_plan_compiles_with_torchs_checkpoint():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    x0 = torch.randn(4, 16)
    p = plan(block, x0.clone().requires_grad_(), budget=10**9)
    context_fn = p.torch_context_fn()  # made outside the compiled function (see the test above's helper)

    def run(x):
        return torch_ckpt.checkpoint(block, x, use_reentrant=False, context_fn=context_fn)

    eager = _grads(run, block, x0)
    torch._dynamo.reset()
    compiled = _grads(torch.compile(run, backend="aot_eager"), block, x0)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(eager, compiled, strict=True))
    assert graph_breaks(run, x0.clone().requires_grad_()) == (1, 0)


def _planned_stack(blocks, p):
    contexts = [p.torch_context_fn(i) for i in range(len(blocks))]  # made outside the compiled function

    def run(x):
        for b, context_fn in zip(blocks, contexts, strict=True):
            x = torch_ckpt.checkpoint(b, x, use_reentrant=False, context_fn=context_fn)
        return x

    return run


# torch before 2.13 (2.11 checked) says torch.compiler.is_compiling() is False while it traces a
# checkpoint's context_fn (2.13 sets it for the whole compile session): Plan.torch_context_fn then hands
# the compiler the eager plan, matched by position, which refuses the traced op sequence ("plan: op 4 is
# aten.lift_fresh.default ..."), loudly; and torch 2.11's checkpoint, raised through, leaves its modes on
# the stack for every test after it. So these two run from 2.13 on.
needs_compile_flag_in_context_fn = pytest.mark.skipif(
    TORCH < (2, 13),
    reason="torch < 2.13: torch.compiler.is_compiling() is False inside context_fn under compile",
)


@needs_compile_flag_in_context_fn
def test_a_plan_with_dropout_steers_the_compiler():
    # Traced, dropout is one native_dropout instead of eager's four ops: the plan is matched by op
    # and occurrence (NOTE [ A plan under torch.compile ] in planner.py), not by position.
    from ckpt_lab.planner import plan_sequential

    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1)) for _ in range(4))
    x = torch.randn(8, 32, requires_grad=True)
    full = plan_sequential(list(blocks), x, budget=10**9)
    p = plan_sequential(list(blocks), x, budget=full.retained_bytes - 2 * 8 * 32 * 4 * 2)  # drop 2 saves
    assert p.saved_ops.count("addmm") >= 2
    params = list(blocks.parameters())

    def plain(y):
        for b in blocks:
            y = b(y)
        return y

    step = compile_step(_planned_stack(blocks, p), x, params=params, check=False)
    reference = compile_step(plain, x, params=params, check=False)
    pairs = zip(step.grads, reference.grads, strict=True)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in pairs)
    floats = sum(n for _, dtype, n in step.saved if dtype == "float32")
    assert floats <= p.retained_bytes  # the compiler may drop block inputs it recomputes from kept matmuls
    assert step.recomputed.count("addmm") == len(blocks) - p.saved_ops.count("addmm")


@needs_compile_flag_in_context_fn
def test_a_plan_for_another_computation_is_refused_under_compile():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.GELU())
    x = torch.randn(4, 16, requires_grad=True)
    context_fn = plan(block, x, budget=10**9).torch_context_fn()

    def twice(y):
        return torch_ckpt.checkpoint(lambda z: block(block(z)), y, use_reentrant=False, context_fn=context_fn)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"plan: under torch.compile, call 2 of aten\.t\.default"):
        torch.compile(twice, backend="aot_eager")(x)
    torch._dynamo.reset()


# ------------------------------------------------------------------ notebook 08's module and the harness
def _import_graph() -> dict[str, set[str]]:
    """Every ``ckpt_lab`` module -> the ``ckpt_lab`` modules its code imports (at the top or inside a
    function), read from the source with ``ast``: no module is executed."""
    import ast
    from pathlib import Path

    import ckpt_lab

    root = Path(ckpt_lab.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = ["ckpt_lab", *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                # ``from ckpt_lab.bench import pareto`` imports the module ckpt_lab.bench.pareto too.
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_notebook_08s_module_imports_nothing_from_the_harness():
    graph = _import_graph()
    # The graph is read right: the harness does import the compiler's module.
    assert "ckpt_lab.compiled" in _reachable(graph, "ckpt_lab.bench.pareto")
    reached = _reachable(graph, "ckpt_lab.compiled")
    assert not {m for m in reached if m == "ckpt_lab.bench" or m.startswith("ckpt_lab.bench.")}, reached
    # ... so no circle runs through it.
    assert "ckpt_lab.compiled" not in reached


def test_compiled_sweeps_return_records_of_their_own():
    import dataclasses

    from ckpt_lab import compiled

    for record in (compiled.BudgetPoint, compiled.BudgetRow):
        assert dataclasses.is_dataclass(record) and record.__module__ == "ckpt_lab.compiled"


# ------------------------------------------------------------------------------------- compile_step's inputs
def test_compile_step_differentiates_parameters_when_the_batch_does_not_require_grad():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    batch = torch.randn(5, 8)  # an ordinary data batch: requires_grad is False
    step = compile_step(model, batch)
    model.zero_grad(set_to_none=True)
    model(batch).square().mean().backward()
    expected = [p.grad for p in model.parameters()]
    # The module's parameters, in order; no entry for the batch.
    assert len(step.grads) == len(expected) == 4
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(step.grads, expected, strict=True))
    assert step.grads_ok is True and step.peak_bytes > 0


def test_compile_step_with_an_input_that_requires_grad_and_explicit_params():
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    step = compile_step(lambda t: model(t), x, params=list(model.parameters()))
    (gx, gw, gb) = step.grads
    assert gx.shape == x.shape and gw.shape == model.weight.shape and gb.shape == model.bias.shape


def test_compile_step_with_nothing_to_differentiate_says_so():
    with pytest.raises(RuntimeError, match=r"does not require grad.*compile_step: the loss does not depend"):
        compile_step(lambda t: t.sin(), torch.randn(4))


@pytest.mark.parametrize("fn", [None, torch.randn(3), "model"])
def test_compile_step_with_a_function_that_is_not_callable_names_it(fn):
    # torch.compile's sentence (and exception type) first; a TypeError to Python code too.
    for kind in (TypeError, AssertionError):
        with pytest.raises(kind) as caught:
            compile_step(fn, torch.randn(2, 3))
        message = str(caught.value)
        assert message.startswith(f"A callable function is expected, but {type(fn)} is provided.")
        assert "the first argument, fn" in message and "not callable" in message


def test_compile_step_loss_none_measures_a_function_that_returns_its_loss():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    x = torch.randn(4, 8)
    params = list(model.parameters())
    inside = compile_step(lambda t: model(t).square().mean(), x, params=params, loss=None, check=False)
    outside = compile_step(model, x, check=False)
    assert all(torch.allclose(a, b) for a, b in zip(inside.grads, outside.grads, strict=True))
    # The loss's temporaries and backward now run inside the measured graphs, on top of the rest.
    assert inside.peak_bytes > outside.peak_bytes
    assert inside.peak_bytes_with_grads >= inside.peak_bytes
