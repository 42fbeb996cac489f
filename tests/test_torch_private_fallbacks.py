"""What the package does on a torch without one of its private names (NOTE [ Private torch API ] in
ckpt_lab/torch_private.py): a fallback whose gradients are bitwise those of a plain run, or a clear
error naming the feature, the name and the torch version. Never a silent difference.

Each test takes the name away (``monkeypatch.delattr``, or ``setattr`` to a stub where torch's object
can't lose an attribute) and runs the feature. Modules that look a name up once, at import, are
loaded again from their file as a copy (``_copy_of``), the way an engineer's copied module would
import on such a torch; the package's own modules are left as they are.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_lab
from ckpt_lab import planner, reentrant_checkpoint, selective_checkpoint
from ckpt_lab import scope as scope_module
from ckpt_lab.exercises._feedback import restore_state
from ckpt_lab.explain import regions
from ckpt_lab.instruments.state import UNKNOWN, global_state
from ckpt_lab.nonreentrant import _device_context, checkpoint
from ckpt_lab.selective import SAVE, is_autocast_weight_cast
from oracle import assert_all_equal, grads, leaves

PACKAGE = Path(ckpt_lab.__file__).parent
_copies = iter(range(10**6))


def _missing(path: str, feature: str | None) -> str:
    """The start of ``missing_error(path, feature)``'s message, as a regex (any feature for None)."""
    said = re.escape(f" needs torch's private {path}, which torch {torch.__version__} lacks.")
    return (".*" if feature is None else re.escape(feature)) + said


def _copy_of(monkeypatch: pytest.MonkeyPatch, module: str, *without: tuple[Any, str]) -> types.ModuleType:
    """``ckpt_lab/<module>.py`` imported afresh as a module of its own, while each ``(owner, name)`` in
    ``without`` is taken off torch; torch gets them back before this returns."""
    path = PACKAGE / f"{module.replace('.', '/')}.py"
    name = f"_copy_{next(_copies)}_{module.replace('.', '_')}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    copy = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, copy)  # dataclasses look their module up
    with monkeypatch.context() as patch:
        for owner, attr in without:
            patch.delattr(owner, attr)
        spec.loader.exec_module(copy)
    return copy


def _scope_case(scope: Callable[[], Any]) -> list[torch.Tensor | None]:
    """A scope whose replay switches grad mode (an op recorded under no_grad), then a later use."""
    torch.manual_seed(0)
    a, c = leaves((64,), (64,))
    with scope():
        h = a.sin() * 2
        with torch.no_grad():
            s = h.mean()
        y = (h * s).exp()
    (y * c).sum().backward()
    return grads(a, c)


# ------------------------------------------------------------------------------------------- scope
@pytest.mark.parametrize(
    "owner, name",
    [
        (torch._C._autograd, "_pop_saved_tensors_default_hooks"),
        (torch._C._autograd, "_push_saved_tensors_default_hooks"),
        (torch._C._autograd, "_saved_tensors_hooks_is_enabled"),
        (torch._C._autograd, "_top_saved_tensors_default_hooks"),
        (torch._C, "_current_graph_task_id"),
        (torch._C, "_AutoDispatchBelowAutograd"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_the_scope_refuses_to_open_without_a_name_it_needs(monkeypatch, owner, name) -> None:
    copy = _copy_of(monkeypatch, "scope", (owner, name))
    path = f"{owner.__name__}.{name}"
    a = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match=_missing(path, "gradient_checkpoint_scope")):
        with copy.gradient_checkpoint_scope():
            a.sin()
    assert not any(copy.leftovers().values())


def test_the_scope_switches_grad_mode_without_torch_C_set_grad_enabled(monkeypatch) -> None:
    copy = _copy_of(monkeypatch, "scope", (torch._C, "_set_grad_enabled"))
    assert copy._set_grad_enabled is torch.set_grad_enabled  # the public call stands in
    assert_all_equal(_scope_case(copy.gradient_checkpoint_scope), _scope_case(contextlib.nullcontext))
    assert not any(copy.leftovers().values())
    assert torch.is_grad_enabled()


class _EngineWithoutCallbacks:
    """autograd's engine, less ``queue_callback`` (the rest passes through)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        if name == "queue_callback":
            raise AttributeError(name)
        return getattr(self.engine, name)


def test_the_scope_releases_its_hooks_later_without_queue_callback(monkeypatch) -> None:
    # The last scope tensor dies inside backward (a later scope kept it): the release waits for a safe
    # point. Without queue_callback it is not one after backward but the next one, here the next
    # scope's entry; the gradients are those of a plain run either way.
    monkeypatch.setattr(
        torch.autograd.Variable,
        "_execution_engine",
        _EngineWithoutCallbacks(torch.autograd.Variable._execution_engine),
    )

    def case(scope: Callable[[], Any]) -> list[torch.Tensor | None]:
        torch.manual_seed(0)
        a, c = leaves((300,), (300,))
        with scope():
            x = a.sin()
        with scope():
            y = (x * x).exp()
        z = y * c
        del x, y
        z.sum().backward()
        del z
        return grads(a, c)

    assert_all_equal(case(scope_module.gradient_checkpoint_scope), case(contextlib.nullcontext))
    assert scope_module.leftovers()["scope_hooks_held"]  # not released after backward: no callback
    with scope_module.gradient_checkpoint_scope():  # a safe point: the release happens here
        pass
    assert not any(scope_module.leftovers().values())
    assert global_state()["saved_tensors_hooks_on_stack"] is False


def test_a_pack_hook_marked_checkpoint_internal_is_a_checkpoints() -> None:
    # torch 2.14 marks its checkpoint's pack hooks so; a scope inside one does nothing.
    def pack(t: torch.Tensor) -> torch.Tensor:
        return t

    assert not scope_module.recomputes_region(pack)
    pack._checkpoint_internal = True  # type: ignore[attr-defined]
    assert scope_module.recomputes_region(pack)


def test_torch_checkpoint_hooks_found_by_their_mark_or_the_scope_refuses(monkeypatch) -> None:
    # Were the code objects of torch's pack hooks not found, torch 2.14's mark still finds them; a
    # torch without the mark (2.13 and before) can't tell its checkpoint from another pack hook, and
    # the scope refuses to open under one rather than risk wrong gradients.
    copy = _copy_of(monkeypatch, "scope")
    monkeypatch.setattr(copy, "_TORCH_CHECKPOINT_PACK_HOOKS", frozenset())
    marks = copy._marks_its_pack_hooks("_checkpoint_hook", "_recomputation_hook")
    monkeypatch.setattr(copy, "_KNOWS_TORCH_PACK_HOOKS", marks)
    assert marks == hasattr(torch_checkpoint, "_checkpoint_internal_hook")  # torch 2.14's class of both

    def block(x: torch.Tensor) -> torch.Tensor:
        with copy.gradient_checkpoint_scope():
            h = x.sin()
        return h.exp()

    def case(checkpointed: bool) -> list[torch.Tensor | None]:
        (x,) = leaves((32,))
        y = torch_checkpoint.checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
        y.sum().backward()
        return grads(x)

    torch.manual_seed(0)
    expected = case(False)
    torch.manual_seed(0)
    if marks:
        assert_all_equal(case(True), expected)
    else:
        with pytest.raises(RuntimeError, match=_missing("torch.utils.checkpoint._checkpoint_hook", None)):
            case(True)
    assert not any(copy.leftovers().values())


def test_without_torch_checkpoint_hooks_a_scope_under_a_pack_hook_refuses(monkeypatch) -> None:
    copy = _copy_of(
        monkeypatch,
        "scope",
        (torch_checkpoint, "_checkpoint_hook"),
        (torch_checkpoint, "_recomputation_hook"),
    )
    assert copy._KNOWS_TORCH_PACK_HOOKS is False
    a = torch.randn(8, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():
        with pytest.raises(
            RuntimeError,
            match=r"gradient_checkpoint_scope under a pack hook it does not know \(save_on_cpu.*\)"
            + _missing("torch.utils.checkpoint._checkpoint_hook", "")
            + ".*open the scope outside this saved_tensors_hooks context",
        ):
            with copy.gradient_checkpoint_scope():
                a.sin()
    # With no foreign pack hook on the stack it works as ever.
    assert_all_equal(_scope_case(copy.gradient_checkpoint_scope), _scope_case(contextlib.nullcontext))
    assert not any(copy.leftovers().values())


def test_without_dynamos_code_marker_torch_keeps_its_wrapper(monkeypatch) -> None:
    # The shipped scope drops torch's torch._dynamo.disable wrapper, and marks its code for Dynamo
    # instead (NOTE [ Speed ] (j)); on a torch without the C function that marks, the wrapper stays.
    raw = scope_module._RecordingMode.__dict__["__torch_dispatch__"]
    assert not hasattr(raw, "__wrapped__")
    copy = _copy_of(monkeypatch, "scope", (torch._C._dynamo.eval_frame, "set_code_exec_strategy"))
    wrapped = copy._RecordingMode.__dict__["__torch_dispatch__"]
    assert wrapped.__wrapped__.__code__.co_filename == str(PACKAGE / "scope.py")
    assert_all_equal(_scope_case(copy.gradient_checkpoint_scope), _scope_case(contextlib.nullcontext))
    # torch's wrapper's code, shared by every function torch._dynamo.disable wraps, was not marked.
    assert copy._dynamo_skips == [wrapped.__code__] and wrapped.__code__ not in scope_module._dynamo_skips


# --------------------------------------------------------------------------------------- scope_core
def test_the_scope_core_fails_at_import_naming_the_name_and_the_torch(monkeypatch) -> None:
    with pytest.raises(ImportError, match=rf"ckpt_lab.scope_core, on torch {re.escape(torch.__version__)}: .*"
                       "_push_saved_tensors_default_hooks"):  # fmt: skip
        _copy_of(monkeypatch, "scope_core", (torch._C._autograd, "_push_saved_tensors_default_hooks"))


# --------------------------------------------------------------------------------------- checkpoints
def test_the_checkpoint_needs_the_graph_task_at_import(monkeypatch) -> None:
    with pytest.raises(
        RuntimeError, match=_missing("torch._C._current_graph_task_id", "ckpt_lab.checkpoint (non-reentrant)")
    ):
        _copy_of(monkeypatch, "nonreentrant", (torch._C, "_current_graph_task_id"))


def test_without_the_function_mode_stack_no_device_block_is_reentered(monkeypatch) -> None:
    import torch.overrides

    monkeypatch.delattr(torch.overrides, "_get_current_function_mode_stack")
    assert isinstance(_device_context(), contextlib.nullcontext)

    def run(ck: Callable[..., Any]) -> list[torch.Tensor | None]:
        torch.manual_seed(0)
        (x,) = leaves((16,))
        with torch.device("cpu"):
            ck(lambda t: (t.sin() * torch.ones(16)).cos(), x).sum().backward()
        return grads(x)

    assert_all_equal(run(checkpoint), run(lambda f, x: f(x)))


def test_reentrant_backward_raises_without_is_checkpoint_valid(monkeypatch) -> None:
    monkeypatch.delattr(torch.autograd, "_is_checkpoint_valid")
    (x,) = leaves((8,))
    y = reentrant_checkpoint(torch.sin, x)
    with pytest.raises(
        RuntimeError,
        match=_missing(
            "torch.autograd._is_checkpoint_valid", "reentrant_checkpoint's check against autograd.grad()"
        ),
    ):
        y.sum().backward()


# ----------------------------------------------------------------------------------------- selective
def test_selective_refuses_to_start_without_the_dispatch_key_guard(monkeypatch) -> None:
    (x,) = leaves((8,))
    policy = [torch.ops.aten.sin.default]
    with monkeypatch.context() as patch:
        patch.delattr(torch._C, "_SetExcludeDispatchKeyGuard")
        with pytest.raises(
            RuntimeError, match=_missing("torch._C._SetExcludeDispatchKeyGuard", "selective_checkpoint")
        ):
            selective_checkpoint(torch.sin, x, policy=policy)
    with monkeypatch.context() as patch:
        patch.setattr(torch._C, "DispatchKey", types.SimpleNamespace())
        with pytest.raises(
            RuntimeError, match=_missing("torch._C.DispatchKey.ADInplaceOrView", "selective_checkpoint")
        ):
            selective_checkpoint(torch.sin, x, policy=policy)


def test_an_op_packet_in_a_policy_list_is_named_by_its_public_name() -> None:
    with pytest.raises(ValueError, match=re.escape("e.g. torch.ops.aten.mm.default.")):
        selective_checkpoint(torch.sin, torch.randn(2, requires_grad=True), policy=[torch.ops.aten.mm])


def test_autocast_weight_casts_without_tensor_is_view(monkeypatch) -> None:
    w = torch.randn(4, 4, requires_grad=True)
    cast = torch.ops.aten._to_copy.default
    expected = [is_autocast_weight_cast(cast, (t,), {"dtype": torch.bfloat16}) for t in (w, w.t(), w[0])]
    assert expected == [True, False, False]

    def lacking(self: torch.Tensor) -> bool:
        raise AttributeError("_is_view")

    monkeypatch.setattr(torch.Tensor, "_is_view", lacking)
    assert [
        is_autocast_weight_cast(cast, (t,), {"dtype": torch.bfloat16}) for t in (w, w.t(), w[0])
    ] == expected

    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)

    def run(ck: Callable[..., Any]) -> list[torch.Tensor | None]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = ck(lambda t: lin(t).relu() @ lin.weight, x)
        y.float().sum().backward()
        return grads(x, lin.weight, lin.bias)

    assert_all_equal(
        run(lambda f, t: selective_checkpoint(f, t, policy=lambda *a, **k: SAVE)), run(lambda f, t: f(t))
    )


# ------------------------------------------------------------------------------------------- planner
def test_profiling_without_unsafe_set_version_counter_is_loud_never_wrong(monkeypatch) -> None:
    # The counters stay moved: a graph that saved the tensor before profiling raises autograd's own
    # in-place error in backward (with the counter put back, it would have run: test_hard_inputs).
    monkeypatch.delattr(torch._C._autograd, "_unsafe_set_version_counter")
    counter = torch.ones(3)
    w = torch.randn(3, requires_grad=True)
    earlier = (w * counter).sum()  # mul saves counter

    def function(x: torch.Tensor) -> torch.Tensor:
        counter.add_(1)
        return x.sin() * counter

    planner.plan(function, torch.randn(3, requires_grad=True), budget=10**9)
    assert torch.equal(counter, torch.ones(3)) and counter._version > 0  # bytes back, version moved
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        earlier.backward()


@pytest.mark.parametrize("traced", [False, True], ids=["PlanPolicy", "TracedPlanPolicy"])
def test_a_plan_answers_torch_2_11s_recompute_calls_with_the_forwards_decisions(traced: bool) -> None:
    # torch 2.11's SAC asks the policy again in the recomputation (ctx.is_recompute=True), op by op in
    # the forward's order; 2.13 asks only in the forward. Those calls must not count as the forward's.
    w = torch.randn(8, 8, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return ((x @ w).relu() @ w).sin() @ w

    x = torch.randn(4, 8, requires_grad=True)
    p = planner.plan(f, x, budget=x.nbytes + 4 * 8 * 4)
    profile = p.profiles[0]
    policy = (planner.TracedPlanPolicy if traced else planner.PlanPolicy)(profile, p.saved[0])
    forward, recompute = types.SimpleNamespace(is_recompute=False), types.SimpleNamespace(is_recompute=True)
    ops = [(r.op, ()) for r in profile.ops]
    first = [policy(forward, op, *args) for op, args in ops]
    assert SAVE in first and len(set(first)) == 2  # the plan keeps some, not all
    assert [policy(recompute, op, *args) for op, args in ops] == first
    # The counts stay apart: a second recomputation after the forward's would be another policy's call.
    with pytest.raises(ckpt_lab.CheckpointError, match="plan"):
        policy(forward, *ops[0])


# ------------------------------------------------------------------------------------------- explain
def test_explain_without_the_hooks_stack_shows_no_hooks_regions(monkeypatch) -> None:
    assert regions._hooks_stack() == []
    with torch.autograd.graph.save_on_cpu():
        assert len(regions._hooks_stack()) == 1
        monkeypatch.setattr(regions, "_pop_saved_tensors_default_hooks", None)
        assert regions._hooks_stack() == []


def test_explain_names_no_node_without_current_autograd_node(monkeypatch) -> None:
    monkeypatch.setattr(regions, "_current_autograd_node", None)
    context = regions._Regions()._backward_context("m", "line", None)
    assert context.node == ""


def test_explain_without_torchs_caching_mode_knows_only_ours(monkeypatch) -> None:
    copy = _copy_of(monkeypatch, "explain.regions", (torch_checkpoint, "_CachingTorchDispatchMode"))
    assert len(regions._SELECTIVE_FORWARD) == 2 and copy._SELECTIVE_FORWARD < regions._SELECTIVE_FORWARD
    assert len(copy._SELECTIVE_FORWARD) == 1


# ------------------------------------------------------------------------------------------ compiled
def test_compiled_names_what_it_lacks(monkeypatch) -> None:
    from ckpt_lab import compiled

    with monkeypatch.context() as patch:
        patch.delattr(torch._functorch.config, "activation_memory_budget")
        with pytest.raises(
            RuntimeError,
            match=_missing("torch._functorch.config.activation_memory_budget", "ckpt_lab.compiled"),
        ):
            compiled.compile_step(torch.sin, torch.randn(3, requires_grad=True), budget=0.5)
    assert torch._functorch.config.activation_memory_budget == 1.0
    import torch._dynamo.backends.common as dynamo_backends

    with monkeypatch.context() as patch:
        patch.delattr(dynamo_backends, "aot_autograd")
        with pytest.raises(
            RuntimeError, match=_missing("torch._dynamo.backends.common.aot_autograd", "ckpt_lab.compiled")
        ):
            compiled._recording_backend({})


# ----------------------------------------------------------------------------- batchnorm, state, grader
def test_batchnorm_finds_the_public_classes_without_BatchNorm_base(monkeypatch) -> None:
    import torch.nn.modules.batchnorm as bn_module

    copy = _copy_of(monkeypatch, "batchnorm", (bn_module, "_BatchNorm"))
    assert nn.BatchNorm2d in copy._BATCH_NORMS and nn.SyncBatchNorm in copy._BATCH_NORMS
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.LazyBatchNorm1d())
    with copy.skip_stats_update_in_recompute(model) as hooks:
        assert len(hooks.handles) == 4  # a pre-hook and a post-hook on each BatchNorm
        x = torch.randn(6, 4, requires_grad=True)
        checkpoint(model, x).sum().backward()
    assert int(model[1].num_batches_tracked) == 1 and int(model[2].num_batches_tracked) == 1


def test_batchnorm_names_disable_current_modes_when_it_lacks_it(monkeypatch) -> None:
    import torch.utils._python_dispatch as python_dispatch

    copy = _copy_of(monkeypatch, "batchnorm", (python_dispatch, "_disable_current_modes"))
    with pytest.raises(
        RuntimeError,
        match=_missing(
            "torch.utils._python_dispatch._disable_current_modes", "skip_stats_update_in_recompute"
        ),
    ):
        copy.skip_stats_update_in_recompute(nn.BatchNorm1d(4))


def test_global_state_says_unknown_where_torch_cannot_tell(monkeypatch) -> None:
    monkeypatch.delattr(torch._C, "_len_torch_dispatch_stack")
    monkeypatch.delattr(torch._C._autograd, "_top_saved_tensors_default_hooks")
    state = global_state()
    assert state["dispatch_modes"] == UNKNOWN and state["saved_tensors_hooks_on_stack"] == UNKNOWN


class _Leftover(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _left_on_the_stack() -> Iterator[_Leftover]:
    mode = _Leftover()
    mode.__enter__()
    try:
        yield mode
    finally:
        if torch._C._len_torch_dispatch_stack():
            mode.__exit__(None, None, None)


def test_the_grader_reports_a_leftover_mode_it_cannot_pop(monkeypatch) -> None:
    import torch.utils._python_dispatch as python_dispatch

    before = global_state()
    with _left_on_the_stack():
        with monkeypatch.context() as patch:
            patch.delattr(python_dispatch, "_pop_mode")
            said = restore_state(before)
        assert said is not None and said.startswith("Except 1 dispatch mode(s), still active")
        assert f"torch {torch.__version__}" in said
        assert torch._C._len_torch_dispatch_stack() == 1  # reported, not popped
    with _left_on_the_stack():
        assert restore_state(before) is None  # with _pop_mode: popped
        assert torch._C._len_torch_dispatch_stack() == 0


def test_the_grader_reports_leftover_hooks_it_cannot_pop(monkeypatch) -> None:
    before = global_state()
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    hooks.__enter__()
    try:
        with monkeypatch.context() as patch:
            patch.delattr(torch._C._autograd, "_pop_saved_tensors_default_hooks")
            said = restore_state(before)
        assert said is not None and said.startswith("Except saved-tensor hooks, still active")
        assert global_state()["saved_tensors_hooks_on_stack"] is True  # reported, not popped
    finally:
        hooks.__exit__(None, None, None)
    assert global_state() == before


def test_compiled_graph_calls_work_boxed_or_not() -> None:
    # _boxed_call asks aot_autograd for one list; were torch to stop reading it, the inputs would come
    # one by one, and the compiled graph (boxed_nop's, taking a list) must get its list all the same.
    from ckpt_lab import compiled

    seen = []
    run = compiled._run_inside("forward", lambda args: seen.append(list(args)) or args[0] + args[1], False)
    a, b = torch.ones(2), torch.full((2,), 2.0)
    assert run._boxed_call is True
    assert torch.equal(run([a, b]), torch.full((2,), 3.0)) and torch.equal(run(a, b), torch.full((2,), 3.0))
    assert [len(s) for s in seen] == [2, 2]


def test_an_op_packet_is_refused_without_torchs_packet_class(monkeypatch) -> None:
    from ckpt_lab.selective import OpListError

    packet = torch.ops.aten.mm
    monkeypatch.delattr(torch._ops, "OpOverloadPacket")
    with pytest.raises(
        OpListError, match=re.escape("The list must hold aten ops, e.g. torch.ops.aten.mm.default.")
    ):
        selective_checkpoint(torch.sin, torch.randn(2, requires_grad=True), policy=[packet])
