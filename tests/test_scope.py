"""Tests for ``ckpt_lab.scope.gradient_checkpoint_scope``; the same code without the scope is the oracle.

What every scope must do (``ckpt_lab.scope_checks``) is tested on both scopes, this one and
``ckpt_lab.scope_core``, in tests/test_scope_mechanism.py; the tests here go beyond those checks.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._C._autograd import _top_saved_tensors_default_hooks
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckpt_lab.scope as scope_module
from ckpt_lab.instruments.counting import OpCounter
from ckpt_lab.instruments.memory import LiveMemory, measure_memory
from ckpt_lab.instruments.state import assert_no_global_state
from ckpt_lab.nonreentrant import CheckpointError
from ckpt_lab.nonreentrant import checkpoint as ckpt_lab_checkpoint
from ckpt_lab.scope import gradient_checkpoint_scope
from oracle import assert_all_equal, cuda, grads, leaves

ORIGINAL_HOOKS = (saved_tensors_hooks.__enter__, saved_tensors_hooks.__exit__)


def top_hooks() -> Any:
    return _top_saved_tensors_default_hooks(False)


def assert_clean() -> bool:
    """The project's one check: no hooks, dispatch modes, grad mode or patched methods left, and the
    scope holds nothing (no storage registered, this thread's resident entry released)."""
    return assert_no_global_state()


@pytest.fixture(autouse=True)
def clean_before_and_after() -> Iterator[None]:
    assert_clean()
    yield
    # No gc.collect(): everything must be freed by reference counting alone.
    assert_clean()


def storage_ref(t: torch.Tensor) -> weakref.ref:
    return weakref.ref(t.untyped_storage())


def with_and_without(case: Callable[[Callable[[], Any]], list[torch.Tensor | None]]) -> list:
    """Run ``case(scope)`` with the real scope and with a no-op one, seeded alike; bitwise equal results."""
    results = {}
    for name, scope in (("plain", contextlib.nullcontext), ("scope", gradient_checkpoint_scope)):
        torch.manual_seed(0)
        results[name] = case(scope)
    # A gradient that is None without the scope must be None with it.
    assert_all_equal(results["plain"], results["scope"], allow_none=True)
    return results["scope"]


# ------------------------------------------------------------------------------------ the basics
def test_torch_checkpoint_keeps_the_output_the_scope_frees() -> None:
    a, b, c = leaves((1000,), (1000,), (1000,))
    with LiveMemory() as mem:
        x = torch_checkpoint(lambda a, b: a + b, a, b, use_reentrant=False)
        y = x * c
        del x
        checkpointed = mem.live_bytes
        with gradient_checkpoint_scope():
            x = a + b
        y2 = x * c
        del x
        scoped = mem.live_bytes - checkpointed
    # checkpoint: x (kept by mul) and y; scope: y only.
    assert (checkpointed, scoped) == (8000, 4000)
    (y.sum() + y2.sum()).backward()


def test_training_step_with_weight_noise_created_in_the_scope() -> None:
    def case(scope: Callable[[], Any]) -> list:
        w = torch.randn(32, 16, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        for _ in range(3):
            x = torch.randn(8, 32)
            with scope():
                noisy = w + 0.01 * torch.randn_like(w)
            loss = (x @ noisy).relu().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [w.detach().clone()]

    with_and_without(case)


def test_mlp_block_gradients_and_memory() -> None:
    batch, seq, dim = 4, 16, 32
    hidden_bytes = batch * seq * 4 * dim * 4

    def build() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1)), nn.Linear(4 * dim, dim)

    def case(scope: Callable[[], Any]) -> list:
        up, down = build()
        x = torch.randn(batch, seq, dim, requires_grad=True)
        with scope():
            h = up(x)
        # A 3-d Linear outside the scope saves a *view* of h: recognised by its storage.
        out = x + down(h)
        del h
        out.sum().backward()
        return [x.grad, *(p.grad for p in [*up.parameters(), *down.parameters()])]

    with_and_without(case)

    def measured(scope: Callable[[], Any]) -> int:
        up, down = build()
        x = torch.randn(batch, seq, dim, requires_grad=True)

        def forward() -> torch.Tensor:
            with scope():
                h = up(x)
            return (x + down(h)).sum()

        return measure_memory(forward).retained_bytes

    plain, scoped = measured(contextlib.nullcontext), measured(gradient_checkpoint_scope)
    # Plain keeps linear's output, the dropout mask and dropout's output (4 bytes: the loss).
    assert (plain, scoped) == (3 * hidden_bytes + 4, 4)


# ------------------------------------------------------------------------------ no global state
def test_no_state_left_and_the_next_hooks_checkpoint_and_save_on_cpu_work() -> None:
    a, c = leaves((100,), (100,))
    with gradient_checkpoint_scope():
        x = a.sin()
    assert top_hooks() is not None  # resident: x may still be saved
    (x * c).sum().backward()
    del x
    assert_clean()

    packed = []
    with saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        (a * c).sum().backward()
    assert len(packed) == 2
    y = torch_checkpoint(lambda u: u.sin().exp(), a, use_reentrant=False)
    y.sum().backward()
    with save_on_cpu():
        (a.sin() * c).sum().backward()
    assert_clean()


def test_user_hooks_entered_while_the_resident_entry_is_there() -> None:
    a, c = leaves((100,), (100,))
    with gradient_checkpoint_scope():
        x = a.sin()
    packed: list[torch.Tensor] = []
    with saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = (x * c).exp()  # the innermost hook wins: it gets x too
    z = torch_checkpoint(lambda u: (u * c).cos(), x, use_reentrant=False)
    (y.sum() + z.sum()).backward()
    assert (len(packed), sum(p is x for p in packed)) == (3, 1)
    s = a.detach().sin()
    torch.testing.assert_close(c.grad, s * (s * c).exp() - s * (s * c).sin())
    packed.clear()
    del x, y, z


def test_the_stack_is_restored_exactly_when_the_last_scope_tensor_dies() -> None:
    a = leaves((10,))[0]
    pair = (lambda t: t, lambda t: t)
    with saved_tensors_hooks(*pair):
        with gradient_checkpoint_scope():
            x = a.sin()
        # The resident entry went to the bottom, and a wrapper of ours stands in for the user's entry.
        assert top_hooks()[0] is not pair[0]
        del x
        # Nothing to recompute any more: the user's own entry is back, nothing of ours below it.
        assert top_hooks() == pair
    assert_clean()
    with gradient_checkpoint_scope():
        x = a.sin()
    with saved_tensors_hooks(*pair):
        del x  # the resident entry is taken out from under the user's entry
        assert top_hooks() == pair
        torch._C._autograd._pop_saved_tensors_default_hooks()
        assert top_hooks() is None
        torch._C._autograd._push_saved_tensors_default_hooks(*pair)


def test_last_scope_tensor_freed_on_another_thread_release_waits_for_a_safe_point() -> None:
    a = leaves((10,))[0]
    with gradient_checkpoint_scope():
        box = [a.sin()]
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join()
    # The stack belongs to this thread: the other one could not touch it.
    assert top_hooks() is not None
    with gradient_checkpoint_scope():  # the next safe point on this thread
        pass
    assert top_hooks() is None


# -------------------------------------------------------------------------- several scopes at once
def test_a_chain_of_scoped_blocks_lowers_peak_memory() -> None:
    dim = 32

    def measured(scope: Callable[[], Any]) -> tuple[int, int]:
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in "abcd"]
        x = torch.randn(4, 16, dim, requires_grad=True)

        def forward() -> torch.Tensor:
            h = x
            for block in blocks:
                with scope():
                    h = h + block(h)
            return h.sum()

        report = measure_memory(forward)
        return report.retained_bytes, report.peak_bytes

    plain_kept, plain_peak = measured(contextlib.nullcontext)
    kept, peak = measured(gradient_checkpoint_scope)
    boundary = 4 * 16 * dim * 4
    # Kept: the three block outputs the next block reads, plus the loss. Peak: about one block's worth.
    assert kept == 3 * boundary + 4
    assert plain_kept > 20 * boundary
    assert peak < plain_peak / 2


def scoped_chain(depth: int = 3, dim: int = 16) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
    """Blocks each in its scope: the block outputs and the leaves, and a plain run's gradients."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(depth)]
    x = torch.randn(4, dim, requires_grad=True)
    params = [x, *(p for b in blocks for p in b.parameters())]
    h = x
    for block in blocks:
        h = block(h)
    expected = torch.autograd.grad(h.square().sum(), params)
    outputs, h = [], x
    for block in blocks:
        with gradient_checkpoint_scope():
            h = block(h)
        outputs.append(h)
    return outputs, params, expected


def test_a_later_scope_lets_go_of_an_earlier_scopes_tensor_once_replayed() -> None:
    # Scope 2 keeps h1 (an input it reads) until its first replay; then scope 1 recomputes it. (That
    # replay, for the loss, keeps the block's Linear output in h1's stead, so that the second, for
    # the block's own backward, needs no h1: NOTE [ The first replay of a backward ].)
    (h1, h2), params, expected = scoped_chain(depth=2)
    ref = weakref.ref(h1)
    del h1
    alive = []
    h2.register_hook(lambda grad: alive.append(ref() is not None))  # after the loss's backward
    params[3].register_hook(lambda grad: alive.append(ref() is not None))  # in block 2's backward
    h2.square().sum().backward()
    del h2
    assert alive == [False, False]
    assert_all_equal([p.grad for p in params], expected)


def test_a_second_backward_through_a_chain_does_not_cascade() -> None:
    # The later scope's copy of h2 comes back from scope 2's replay in the first backward, so the
    # second backward's replay of scope 3 does not first make scopes 2 and 1 replay (all of the
    # chain's recomputed tensors alive at once).
    outputs, params, expected = scoped_chain(depth=3)
    replays_when_h3_served = []
    with OpCounter() as counter:
        outputs[-1].register_hook(lambda grad: replays_when_h3_served.append(counter.counts["addmm"]))
        loss = outputs[-1].square().sum()
        del outputs
        loss.backward(retain_graph=True)
        loss.backward()
    assert replays_when_h3_served == [1, 3 + 1]  # scope 3 alone, in each backward
    # A replay of each block's matmul per backward (NOTE [ The first replay of a backward ]): in the
    # first, the last block's second replay starts from the Linear output its first replay kept in
    # h2's stead; in the second, h2 is the copy scope 2 handed back (kept for this backward, not let
    # go), so nothing is kept in its stead and the last block's matmul runs once more: 3 + 4.
    assert counter.counts["addmm"] == 7
    assert_all_equal([p.grad for p in params], [2 * g for g in expected])
    del loss
    gc.collect()


def test_the_first_replay_of_a_backward_serves_only_the_loss_so_the_peak_is_torchs() -> None:
    # NOTE [ The first replay of a backward ]: in a chain of scoped blocks the loss's unpack replays
    # the last block for the loss alone; the block's own saved tensors come from a second replay in
    # its own backward, so they are not alive beside the loss's backward temporaries.
    depth, width = 4, 64

    def stack() -> tuple[list[nn.Module], torch.Tensor]:
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1)) for _ in range(depth)]
        return blocks, torch.randn(16, width, requires_grad=True)

    def run(wrap: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> tuple[int, list, int]:
        blocks, x = stack()

        def loss() -> torch.Tensor:
            torch.manual_seed(1)
            h = x
            for block in blocks:
                h = wrap(block, h)
            return h.square().mean()

        peak = measure_memory(loss).peak_bytes
        with OpCounter() as counter:
            loss().backward()
        return peak, grads(x, *(p for b in blocks for p in b.parameters())), counter.counts["addmm"]

    def scoped(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        with gradient_checkpoint_scope():
            return block(h)

    _, plain, _ = run(lambda block, h: block(h))
    torch_peak, torch_grads, torch_addmm = run(
        lambda block, h: torch_checkpoint(block, h, use_reentrant=False)
    )
    scope_peak, scope_grads, scope_addmm = run(scoped)
    assert_all_equal(scope_grads, plain)
    assert_all_equal(torch_grads, plain)
    assert scope_peak <= torch_peak
    # The forward and a re-run of each block's matmul, as torch: the last block's second replay starts
    # from the Linear output its first replay kept in place of the block's input (the same bytes).
    assert (torch_addmm, scope_addmm) == (2 * depth, 2 * depth)


# ------------------------------------------------------------------------------- in-place updates
def test_batchnorm_running_statistics_are_updated_once() -> None:
    def case(scope: Callable[[], Any]) -> list:
        torch.manual_seed(2)
        bn = nn.BatchNorm1d(8)
        x = torch.randn(16, 8, requires_grad=True)
        with scope():
            y = bn(x).relu()
        (y * y).sum().backward(retain_graph=True)
        (y * 2).sum().backward()  # a second backward: a second replay
        return [x.grad, bn.weight.grad, bn.running_mean, bn.running_var, bn.num_batches_tracked]

    running = with_and_without(case)
    assert int(running[-1]) == 1


def test_outside_buffer_written_inside_the_scope() -> None:
    a = leaves((20,))[0]

    def case(scope: Callable[[], Any]) -> list:
        buf = torch.zeros(20)
        with scope():
            buf.add_(1)
            y = (a + buf).sin()  # reads the updated buffer
            buf.mul_(3)
            z = (y + buf).exp()
        z.sum().backward()
        return [*grads(a), buf]

    buf = with_and_without(case)[-1]
    assert torch.equal(buf, torch.full((20,), 3.0))


def test_an_outside_tensor_modified_in_place_before_backward_is_refused() -> None:
    a, w = leaves((20,), (20,))
    with gradient_checkpoint_scope():
        h = (a + w).sin()  # add saves nothing: autograd alone would not notice
    loss = h.sum()
    del h
    with torch.no_grad():
        w.add_(1)
    with pytest.raises(CheckpointError, match="modified in place before backward"):
        loss.backward()
    del loss


def test_a_replay_with_different_shapes_is_refused() -> None:
    x = leaves((10,))[0]
    m = torch.arange(10.0) - 6.5  # 3 positive entries
    with gradient_checkpoint_scope():
        y = x[m > 0].sin()  # data-dependent shape
    loss = y.sum()
    del y
    m.data.neg_()  # through .data: no version bump; 7 positive entries now
    with pytest.raises(CheckpointError, match=r"aten\.index.*shape=\[7\].*shape=\[3\]"):
        loss.backward()
    del loss


def test_a_scope_tensor_modified_in_place_after_autograd_saved_it() -> None:
    a = leaves((10,))[0]
    with gradient_checkpoint_scope():
        x = a * 2
        y = x.sin()  # saves x
        x.add_(1)
    loss = (y + x).sum()
    del x, y
    # Autograd without the scope raises the same; with it we must not hand out the new x.
    with pytest.raises(CheckpointError, match="modified in place after autograd saved it"):
        loss.backward()
    del loss


# -------------------------------------------------------------------------------- other features
def test_inputs_are_kept_until_the_last_handle_dies_then_released() -> None:
    a = leaves((100,))[0]
    inp = a * 1  # from outside the scope: the replay reads it, so the recording holds it
    ref = storage_ref(inp)
    with gradient_checkpoint_scope():
        x = (inp + 1).sin()
    loss = x.sum()
    del inp, x
    assert ref() is not None  # the cost of a strong reference: add saved nothing, yet inp lives on
    loss.backward()
    del loss
    assert ref() is None


def test_retain_graph_replays_once_per_backward() -> None:
    a = leaves((30,))[0]
    with gradient_checkpoint_scope():
        x = a.sin().exp()
    y = (x * x).sum()
    with OpCounter() as counter:
        y.backward(retain_graph=True)
        y.backward()
    del x, y
    assert (counter.counts["sin"], counter.counts["exp"]) == (2, 2)
    expected = 2 * (2 * a.sin().exp() ** 2 * a.cos()).detach()
    torch.testing.assert_close(a.grad, expected)


def test_torch_checkpoints_pack_hooks_are_found() -> None:
    # Read from torch's source once, at import: a torch that renamed them would show here.
    names = sorted(code.co_qualname for code in scope_module._TORCH_CHECKPOINT_PACK_HOOKS)
    assert names == [
        "_checkpoint_hook.__init__.<locals>.pack_hook",
        "_recomputation_hook.__init__.<locals>.pack_hook",
    ]


@pytest.mark.parametrize("checkpoint", ["torch", "ckpt_lab"])
def test_a_scope_inside_a_checkpoint_re_run_outside_backward(checkpoint: str) -> None:
    a = leaves((30,))[0]

    def function(x: torch.Tensor) -> torch.Tensor:
        with gradient_checkpoint_scope():
            h = x.sin()
        return h.cos().exp()

    if checkpoint == "torch":
        y = torch_checkpoint(function, a, use_reentrant=False)
    else:
        y = ckpt_lab_checkpoint(function, a)
    # exp saved its output; reading it outside backward re-runs the region under the checkpoint's
    # re-run hook (not inside backward): the scope must do nothing there too.
    saved = y.grad_fn._saved_result
    torch.testing.assert_close(saved, a.detach().sin().cos().exp())
    del y, saved


def position_checkpoint(
    function: Callable[..., torch.Tensor], x: torch.Tensor, says_so: bool
) -> torch.Tensor:
    """A checkpoint defined here, outside torch and ckpt_lab: backward re-runs ``function`` and hands
    out what the re-run saved by position. ``says_so``: its pack hooks carry ``recomputes_region``."""
    saved_in_forward = []
    recomputed: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> int:
        saved_in_forward.append(tensor.shape)
        return len(saved_in_forward) - 1

    def unpack(position: int) -> torch.Tensor:
        if not recomputed:

            def save(tensor: torch.Tensor) -> torch.Tensor:
                recomputed.append(tensor.detach())
                return tensor

            save.recomputes_region = says_so  # type: ignore[attr-defined]
            with torch.enable_grad(), saved_tensors_hooks(save, lambda t: t):
                function(x)
            if [t.shape for t in recomputed] != saved_in_forward:
                raise RuntimeError(
                    f"the re-run saved {len(recomputed)} tensors, the forward {len(saved_in_forward)}"
                )
        return recomputed[position]

    pack.recomputes_region = says_so  # type: ignore[attr-defined]
    with saved_tensors_hooks(pack, unpack):
        return function(x)


def test_a_checkpoint_from_another_module_is_recognised_by_recomputes_region() -> None:
    a, c = leaves((30,), (30,))

    def function(x: torch.Tensor, scope: Callable[[], Any]) -> torch.Tensor:
        with scope():
            h = x.sin().exp()
        return (h * c).cos()

    def case(scope: Callable[[], Any]) -> list:
        y = position_checkpoint(lambda x: function(x, scope), a, says_so=True)
        y.sum().backward()
        return grads(a, c)

    with_and_without(case)
    # Without the attribute the scope takes part in the forward only, and the positions disagree.
    y = position_checkpoint(lambda x: function(x, gradient_checkpoint_scope), a, says_so=False)
    with pytest.raises(RuntimeError, match="the re-run saved 5 tensors, the forward 3"):
        y.sum().backward()
    del y


OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sin": torch.sin,
    "exp": lambda x: (x * 0.1).exp(),
    "mul": lambda x: x * x,
    "relu": F.relu,
    "dropout": lambda x: F.dropout(x, 0.3),
    "t": lambda x: x.t().contiguous().t(),
    "view": lambda x: x.reshape(-1).view(x.shape) + 1,
    "cat": lambda x: torch.cat([x, x.flip(0)])[: x.shape[0]],
    "inplace": lambda x: (x * 1).add_(0.5),
}


@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=8),
    scoped=st.lists(st.booleans(), min_size=8, max_size=8),
)
def test_random_op_chains_with_random_scopes(ops: list[str], scoped: list[bool]) -> None:
    a = torch.randn(4, 6, requires_grad=True)

    def case(scope: Callable[[], Any]) -> list:
        x = a
        for op, inside in zip(ops, scoped, strict=False):
            with scope() if inside else contextlib.nullcontext():
                x = OPS[op](x)
        x.pow(2).sum().backward()
        del x
        return grads(a)

    with_and_without(case)


# --------------------------------------------------------------------------------------- the peer
@contextlib.contextmanager
def cleaning_up_after_the_peer() -> Iterator[list[bool]]:
    """Reports whether the peer left a hook entry behind (it does), and removes it and any patch."""
    left = []
    try:
        yield left
    finally:
        left.append(top_hooks() is not None)
        gc.collect()  # the peer's finalizers may still exit its hooks
        while top_hooks() is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        saved_tensors_hooks.__enter__, saved_tensors_hooks.__exit__ = ORIGINAL_HOOKS


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
def test_peer_keeps_the_first_tensor_and_its_hook_returnn_1583() -> None:
    peer_module = pytest.importorskip("returnn.torch.util.gradient_checkpoint")
    p1, p2 = leaves((200,), (200,))
    refs = []

    def get_var(scope: Callable[[], Any], p: torch.Tensor) -> torch.Tensor:
        with scope():
            v = p * 3
        refs.append(storage_ref(v))
        return v

    peer = peer_module.gradient_checkpoint_scope
    with cleaning_up_after_the_peer() as peer_left_hook:
        y = get_var(peer, p1) * get_var(peer, p2)
        peer_alive = [ref() is not None for ref in refs]
        y.sum().backward()
        del y
    refs.clear()
    y = get_var(gradient_checkpoint_scope, p1) * get_var(gradient_checkpoint_scope, p2)
    ours_alive = [ref() is not None for ref in refs]
    y.sum().backward()
    del y
    assert (peer_alive, peer_left_hook) == ([True, False], [True])
    assert ours_alive == [False, False]


# ------------------------------------------------------------------------------------------- CUDA
@cuda
def test_cuda_dropout_rng_and_memory() -> None:
    a, c = (torch.randn(1024, 1024, device="cuda", requires_grad=True) for _ in range(2))
    freed = {}

    def case(scope: Callable[[], Any]) -> list:
        with scope():
            x = F.dropout(a.sin(), 0.5)
        y = x * c
        before = torch.cuda.memory_allocated()
        del x
        freed[scope.__name__] = before - torch.cuda.memory_allocated()
        y.sum().backward()
        return [*grads(a, c), torch.rand(3, device="cuda")]

    with_and_without(case)
    # x (4 MiB) is freed at once with the scope; without it mul keeps it for backward.
    assert freed == {"nullcontext": 0, "gradient_checkpoint_scope": 4 << 20}


@cuda
def test_cuda_device_first_initialised_inside_the_scope() -> None:
    import subprocess
    import sys

    code = """
import torch, torch.nn.functional as F
from ckpt_lab.scope import gradient_checkpoint_scope
torch.manual_seed(0)
a = torch.randn(1000, requires_grad=True)
assert not torch.cuda.is_initialized()
with gradient_checkpoint_scope():
    x = F.dropout(a.cuda(), 0.5)   # CUDA is initialised right here, then drawn from
(x * 2).sum().backward()
g = a.grad.clone(); a.grad = None
torch.cuda.manual_seed(torch.cuda.initial_seed())  # the same fresh state once more
x = F.dropout(a.cuda(), 0.5)
(x * 2).sum().backward()
assert torch.equal(g, a.grad), "replay did not reproduce the dropout mask"
"""
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
def test_peer_keeps_a_view_saved_outside_the_scope() -> None:
    peer_module = pytest.importorskip("returnn.torch.util.gradient_checkpoint")
    batch, seq, dim = 4, 16, 32
    retained = {}
    scopes = (("peer", peer_module.gradient_checkpoint_scope), ("ours", gradient_checkpoint_scope))
    for name, scope in scopes:
        torch.manual_seed(1)
        up, down = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU()), nn.Linear(4 * dim, dim)
        x = torch.randn(batch, seq, dim, requires_grad=True)

        def forward() -> torch.Tensor:
            with scope():  # noqa: B023 (called right away)
                h = up(x)  # noqa: B023
            return (x + down(h)).sum()  # noqa: B023

        with cleaning_up_after_the_peer() if name == "peer" else contextlib.nullcontext():
            retained[name] = measure_memory(forward).retained_bytes
    # The 3-d Linear saves h.view(-1, 128): the peer looks tensors up by identity and keeps it.
    assert retained == {"peer": batch * seq * 4 * dim * 4 + 4, "ours": 4}


# ----------------------------------------------------------------------------------- torch.compile
def test_dynamo_skips_the_recording_mode_as_torch_would_have_it() -> None:
    # NOTE [ Speed ] (j): no torch._dynamo.disable wrapper per op, the code object marked once
    # instead. A function compiled and called inside the scope: Dynamo traces as many frames as
    # under a dispatch mode that keeps torch's wrapper (none of ours), and gradients are right.
    from torch._dynamo.utils import counters
    from torch.utils._python_dispatch import TorchDispatchMode

    class Plain(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 2).cos()

    def frames(context: Callable[[], Any], x: torch.Tensor) -> tuple[int, torch.Tensor]:
        torch._dynamo.reset()
        counters.clear()
        with context():
            y = torch.compile(f, backend="eager")(x)
        (y * 3).sum().backward()
        return counters["frames"]["total"], x.grad

    x = torch.randn(8, requires_grad=True)
    expected, _ = frames(Plain, x.detach().requires_grad_())
    traced, grad = frames(gradient_checkpoint_scope, x)
    assert traced == expected
    assert_all_equal([grad], [torch.autograd.grad((f(x) * 3).sum(), x)[0]])
    assert "__torch_dispatch__" in scope_module._RecordingMode.__dict__
    assert not hasattr(scope_module._RecordingMode.__torch_dispatch__, "__wrapped__")
    torch._dynamo.reset()


# ------------------------------------------------------------------------------ public accessors
def test_accessors_name_the_scopes_entries_on_the_hooks_stack() -> None:
    from ckpt_lab.scope import is_scope_pack_hook, pack_hook_below

    a = leaves((10,))[0]

    def user_pack(t: torch.Tensor) -> torch.Tensor:
        return t

    with saved_tensors_hooks(user_pack, lambda t: t):
        assert not is_scope_pack_hook(top_hooks()[0])
        with gradient_checkpoint_scope():
            own = top_hooks()[0]  # the open scope's entry: scope tensors to us, the rest to user_pack
            x = a.sin()
        wrapper = top_hooks()[0]  # the closed scope left a resident entry; user_pack is wrapped
        assert [is_scope_pack_hook(own), is_scope_pack_hook(wrapper)] == [True, True]
        assert [pack_hook_below(own), pack_hook_below(wrapper)] == [user_pack, user_pack]
        torch._C._autograd._pop_saved_tensors_default_hooks()  # look below the wrapper, then put it back
        resident = top_hooks()[0]
        torch._C._autograd._push_saved_tensors_default_hooks(*[wrapper, scope_module._unpack])
        assert is_scope_pack_hook(resident) and pack_hook_below(resident) is None
        with pytest.raises(TypeError, match="not one of gradient_checkpoint_scope's pack hooks"):
            pack_hook_below(user_pack)
        del x
    # The private names notebooks used stay: the class, and its ``below`` pair.
    assert scope_module._PackHook is type(own) and own.below[0] is user_pack


def test_inside_scope_hook_is_true_exactly_while_a_replay_runs() -> None:
    from ckpt_lab.scope import inside_scope_hook

    seen: list[tuple[str, bool]] = []

    class Log(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            seen.append((func.overloadpacket.__name__, inside_scope_hook()))
            return func(*args, **(kwargs or {}))

    a, c = leaves((10,), (10,))
    with gradient_checkpoint_scope():
        x = a.exp()
    y = (x * c).sum()
    del x
    with Log():
        y.backward()
    # exp runs once more in backward, in the replay; nothing else runs inside our hooks.
    assert [name for name, inside in seen if inside] == ["exp"]
    assert not inside_scope_hook() and scope_module._thread.in_hook == 0
    del y


def test_recomputes_region_recognises_checkpoints_by_their_pack_hooks() -> None:
    from ckpt_lab.scope import recomputes_region

    seen = []

    def function(x: torch.Tensor) -> torch.Tensor:
        seen.append(top_hooks()[0])
        return x.sin()

    a = leaves((3,))[0]
    torch_checkpoint(function, a, use_reentrant=False)
    ckpt_lab_checkpoint(function, a)
    with saved_tensors_hooks(lambda t: t, lambda t: t):
        seen.append(top_hooks()[0])
    assert [recomputes_region(pack) for pack in seen] == [True, True, False]
    assert [scope_module._recomputes_region(pack) for pack in seen] == [True, True, False]


def test_is_recomputing_is_true_inside_the_scopes_replay_only():
    # Python that runs while the scope replays (here another dispatch mode's __torch_dispatch__) is told
    # so by ckpt_lab.is_recomputing(), as in our checkpoints' re-runs; in the forward it is False.
    from torch.utils._python_dispatch import TorchDispatchMode

    import ckpt_lab

    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.sin.default:
                seen.append(ckpt_lab.is_recomputing())
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, requires_grad=True)
    with Spy():
        with ckpt_lab.gradient_checkpoint_scope():
            y = x.sin()
        z = y * y
        z.sum().backward()
    assert seen == [False, True]
    assert not ckpt_lab.is_recomputing()
