"""The shared facts: ``ckpt_lab.instruments.state`` (what a checkpoint must leave as it found it) and
``ckpt_lab._aten`` (storage identity, what an op writes, which ops return views)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode

from ckpt_lab._aten import is_view, op_info, storage_key, storage_keys, storage_of, tensors_in
from ckpt_lab.instruments.counting import OpCounter
from ckpt_lab.instruments.memory import LiveMemory
from ckpt_lab.instruments.saved import SavedTensorLog
from ckpt_lab.instruments.state import CLEAN, assert_no_global_state, changes, global_state
from ckpt_lab.scope import gradient_checkpoint_scope

aten = torch.ops.aten


# ------------------------------------------------------------------------------------ global state
def test_a_fresh_state_is_clean() -> None:
    assert global_state() == CLEAN
    assert changes(CLEAN, global_state()) == []
    assert assert_no_global_state() is True


def test_changes_names_each_key_that_differs() -> None:
    after = {**CLEAN, "dispatch_modes": 2, "grad_enabled": False}
    assert changes(CLEAN, after) == ["dispatch_modes: 0 -> 2", "grad_enabled: True -> False"]


def test_detects_a_leftover_saved_tensors_hooks_entry() -> None:
    with saved_tensors_hooks(lambda t: t, lambda t: t):
        pass
    assert_no_global_state()  # entered and exited: nothing left
    hooks = saved_tensors_hooks(lambda t: t, lambda t: t)
    hooks.__enter__()
    try:
        assert changes(CLEAN, global_state()) == ["saved_tensors_hooks_on_stack: False -> True"]
        with pytest.raises(AssertionError, match="global state left behind: saved_tensors_hooks_on_stack"):
            assert_no_global_state()
    finally:
        hooks.__exit__()
    assert_no_global_state()


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def test_detects_a_leftover_dispatch_mode() -> None:
    mode = _Passthrough()
    mode.__enter__()
    try:
        assert changes(CLEAN, global_state()) == ["dispatch_modes: 0 -> 1"]
        with pytest.raises(AssertionError, match="dispatch_modes: 0 -> 1"):
            assert_no_global_state()
    finally:
        mode.__exit__(None, None, None)
    assert_no_global_state()


def test_detects_grad_mode_left_off_and_compares_with_any_before() -> None:
    torch.set_grad_enabled(False)
    try:
        with pytest.raises(AssertionError, match="grad_enabled: True -> False"):
            assert_no_global_state()
        # Against a reading taken with grad off, nothing has changed.
        assert assert_no_global_state(global_state()) is True
    finally:
        torch.set_grad_enabled(True)
    assert_no_global_state()


def test_detects_a_patched_saved_tensors_hooks_enter() -> None:
    original = saved_tensors_hooks.__enter__

    def patched(self: saved_tensors_hooks) -> None:  # what a peer library's scope might install
        return original(self)

    saved_tensors_hooks.__enter__ = patched  # type: ignore[method-assign]
    try:
        (left,) = changes(CLEAN, global_state())
        assert left.startswith("saved_tensors_hooks_methods: ")
        assert "patched" in left
        with pytest.raises(AssertionError, match="saved_tensors_hooks_methods"):
            assert_no_global_state()
    finally:
        saved_tensors_hooks.__enter__ = original  # type: ignore[method-assign]
    assert_no_global_state()


def test_detects_what_a_scope_still_holds_until_its_last_tensor_dies() -> None:
    a, c = torch.randn(100, requires_grad=True), torch.randn(100, requires_grad=True)
    with gradient_checkpoint_scope():
        x = a.sin()
    y = x * c  # saves x: the scope's resident entry stays while x lives
    left = changes(CLEAN, global_state())
    assert left == [
        "saved_tensors_hooks_on_stack: False -> True",
        "scope_storages_registered: 0 -> 1",
        "scope_hooks_held: False -> True",
    ]
    y.sum().backward()
    del x, y
    assert_no_global_state()


def test_the_instruments_leave_nothing_behind_even_when_the_block_raises() -> None:
    with pytest.raises(ValueError, match="inside"), LiveMemory(), OpCounter(), SavedTensorLog():
        assert global_state() != CLEAN  # each pushed something while the block runs
        raise ValueError("inside")
    assert_no_global_state()


# -------------------------------------------------------------------------------- storage identity
def test_storage_key_is_shared_by_views_and_in_place_results_not_by_clones() -> None:
    t = torch.randn(4, 4)
    key = storage_key(t)
    assert key is not None and key == id(storage_of(t))
    for alias in (t, t.view(16), t[1], t.t(), t.expand(2, 4, 4), t.add_(1), t.detach()):
        assert storage_key(alias) == key
    clone = t.clone()
    assert storage_key(clone) != key
    assert storage_keys([t, t.t(), clone]) == {key, storage_key(clone)}


def test_a_sparse_tensor_has_no_storage() -> None:
    sparse = torch.randn(3, 3).to_sparse()
    assert storage_of(sparse) is None and storage_key(sparse) is None
    dense = torch.randn(3)
    assert storage_keys([sparse, dense]) == {storage_key(dense)}  # None is left out


def test_tensors_in_a_nested_structure() -> None:
    a, b, c = torch.randn(1), torch.randn(2), torch.randn(3)
    found = tensors_in(((a, 1, "x"), {"k": [b, None]}, c))
    assert len(found) == 3 and all(f is t for f, t in zip(found, (a, b, c), strict=True))


# ------------------------------------------------------------------------------- what an op writes
def test_add_in_place_writes_self_and_returns_no_fresh_memory() -> None:
    a, b = torch.randn(3), torch.randn(3)
    info = op_info(aten.add_.Tensor)
    assert info.writes == ((0, "self", True),)
    ((written, marked),) = info.written((a, b), {})
    assert written is a and marked
    assert info.fresh == (False,)  # add_ returns self
    assert op_info(aten.add_.Tensor) is info  # looked up once


def test_an_out_argument_is_written() -> None:
    a, b, out = torch.randn(3), torch.randn(3), torch.empty(3)
    info = op_info(aten.add.out)
    assert info.writes == ((3, "out", True),)
    ((written, marked),) = info.written((a, b), {"out": out})
    assert written is out and marked


def test_a_pure_op_writes_nothing_and_returns_fresh_memory() -> None:
    info = op_info(aten.mm.default)
    assert info.writes == () and info.fresh == (True,)
    assert info.written((torch.randn(2, 2), torch.randn(2, 2)), {}) == []


def test_batch_norm_writes_its_running_statistics_without_marking_them() -> None:
    info = op_info(aten.native_batch_norm.default)
    assert info.writes == ((3, "running_mean", False), (4, "running_var", False))
    names = [argument.name for argument in aten.native_batch_norm.default._schema.arguments]
    assert (names[3], names[4]) == ("running_mean", "running_var")
    x, weight, bias = torch.randn(8, 3), torch.ones(3), torch.zeros(3)
    mean, var = torch.zeros(3), torch.ones(3)
    args = (x, weight, bias, mean, var, True, 0.1, 1e-5)
    ((w0, marked0), (w1, marked1)) = info.written(args, {})
    assert w0 is mean and w1 is var and not marked0 and not marked1
    # Why the table: training mode updates them in place, and no version counter says so (add_'s does).
    aten.native_batch_norm.default(*args)
    assert not torch.equal(mean, torch.zeros(3)) and (mean._version, var._version) == (0, 0)
    aten.add_.Tensor(mean, 1.0)
    assert mean._version == 1


def test_is_view() -> None:
    x = torch.randn(3, 4)

    def ask(op: Any, *args: Any) -> bool:
        return is_view(op, args, {}, op(*args))

    assert ask(aten.t.default, x) and ask(aten.view.default, x, [12])
    assert ask(aten.expand.default, x, [2, 3, 4]) and ask(aten.select.int, x, 0, 1)
    assert not ask(aten.sin.default, x) and not ask(aten.clone.default, x)
    # In place: the output is self, but a mutation, not a view.
    assert not ask(aten.add_.Tensor, x.clone(), 1.0)


def test_checkpoint_error_is_torchs():
    """Code written for torch (``except torch.utils.checkpoint.CheckpointError``) catches ours after the
    drop-in swap, from every place it is importable."""
    import torch.utils.checkpoint as torch_checkpoint

    import ckpt_lab
    from ckpt_lab.errors import CheckpointError
    from ckpt_lab.nonreentrant import CheckpointError as from_nonreentrant

    assert ckpt_lab.CheckpointError is CheckpointError is from_nonreentrant
    assert issubclass(CheckpointError, torch_checkpoint.CheckpointError)
    assert issubclass(CheckpointError, RuntimeError)
    x = torch.ones(2, requires_grad=True)
    calls = []

    def changes_shape(t):
        calls.append(1)
        return t.sin() if len(calls) == 1 else t[:1].sin()

    out = ckpt_lab.checkpoint(changes_shape, x, use_reentrant=False)
    try:
        out.sum().backward()
    except torch_checkpoint.CheckpointError as error:
        assert type(error) is CheckpointError
    else:
        raise AssertionError("the shape change was not caught")
