"""What a GPU changes: the scope, the checkpoints and offload on CUDA.

Each test runs on CUDA where there is one (``make gpu-check``) and, where the same question can be
asked of the CPU, on the CPU too, so that its logic is checked on every machine. What CUDA adds:

* the autograd engine runs a CUDA backward on its device thread, not the caller's;
* a random op draws from the device's own generator (Philox: a seed and an offset);
* autocast's low-precision type and its cast cache are per device;
* a forward may run on a side stream, and backward runs each op on its forward's stream;
* offload copies into pinned host memory, asynchronously.

The oracle is the plain run, seeded alike: gradients bitwise equal (``assert_all_equal``).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ckpt_lab import checkpoint, gradient_checkpoint_scope, reentrant_checkpoint
from ckpt_lab.instruments.state import assert_no_global_state, global_state
from ckpt_lab.offload import offload_to_cpu
from oracle import assert_all_equal, cuda, grads

DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]

# Every checkpoint, called as ``ck(function, *args)``.
CHECKPOINTS: dict[str, Callable[..., Any]] = {
    "torch non-reentrant": lambda f, *a: torch_checkpoint(f, *a, use_reentrant=False),
    "torch reentrant": lambda f, *a: torch_checkpoint(f, *a, use_reentrant=True),
    "ckpt_lab.checkpoint": checkpoint,
    "ckpt_lab.reentrant_checkpoint": reentrant_checkpoint,
}


@pytest.fixture(autouse=True)
def state_before() -> Iterator[dict[str, Any]]:
    """Each test leaves the global state as it found it. Compared with what it found, not with a fresh
    interpreter's: a test elsewhere that failed and left a hook behind (torch 2.11's checkpoint does,
    when the function under a ``context_fn`` raises) must not fail every test here too."""
    before = global_state()
    yield before
    assert_no_global_state(before)


def _allocated(device: str) -> int:
    """Device memory the caching allocator has handed out (0 on the CPU). Bookkeeping on the host,
    exact without a synchronisation: a tensor's memory counts as free the moment it dies."""
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def _leaf(*shape: int, device: str) -> torch.Tensor:
    return torch.randn(*shape, device=device, requires_grad=True)


# ------------------------------------------------------------------------ the scope's RNG replay
@pytest.mark.parametrize("device", DEVICES)
def test_scope_replays_dropout_bitwise_and_frees_what_it_made(device: str) -> None:
    torch.manual_seed(0)
    first = nn.Linear(64, 256).to(device)
    rest = nn.Sequential(nn.GELU(), nn.Dropout(0.5), nn.Linear(256, 64), nn.Dropout(0.5)).to(device)
    x = _leaf(32, 64, device=device)
    freed = {}

    def step(scope: Callable[[], Any]) -> list[torch.Tensor | None]:
        torch.manual_seed(1)
        with scope():
            h = first(x)
            out = rest(h)
        ref = weakref.ref(h.untyped_storage())
        before = _allocated(device)
        del h  # GELU saved it: kept by the graph without the scope, recomputed with it
        freed[scope.__name__] = (ref() is None, before - _allocated(device))
        (out * out).sum().backward()
        del out
        # The RNG stream after backward: a replay must not have moved it.
        return [*grads(x, first.weight, first.bias, *rest.parameters()), torch.rand(4, device=device)]

    plain = step(contextlib.nullcontext)
    scoped = step(gradient_checkpoint_scope)
    assert_all_equal(plain, scoped)
    h_bytes = 32 * 256 * 4
    assert freed["nullcontext"] == (False, 0)
    assert freed["gradient_checkpoint_scope"] == (True, h_bytes if device == "cuda" else 0)


# ------------------------------------------------------- backward on the device thread, hooks released
@pytest.mark.parametrize("device", DEVICES)
def test_backward_on_the_device_thread_then_the_resident_hooks_go(
    device: str, record_property: Callable[[str, Any], None], state_before: dict[str, Any]
) -> None:
    torch.manual_seed(0)
    a, c = _leaf(256, 256, device=device), _leaf(256, 256, device=device)
    threads: list[int] = []

    def step(scope: Callable[[], Any]) -> list[torch.Tensor | None]:
        torch.manual_seed(1)
        with scope():
            x = F.dropout(a.sin(), 0.5)
        with scope():
            y = (x * x).exp()  # x is an input of this scope: its recording keeps it
        z = y @ c  # saves y: the scope's resident hook takes it
        z.register_hook(lambda grad: threads.append(threading.get_ident()))
        del x, y
        if scope is gradient_checkpoint_scope:
            # The first scope's x lives on in the second's recording, which the graph holds.
            assert global_state()["scope_hooks_held"] is True
        # Backward replays y and drops the second recording, and with it x, the first scope's last
        # tensor: inside backward, where the hooks stack can't be changed.
        z.sum().backward()
        del z
        return grads(a, c)

    plain = step(contextlib.nullcontext)
    scoped = step(gradient_checkpoint_scope)
    assert_all_equal(plain, scoped)
    # Where the backward ran: the caller's thread on the CPU, the engine's device thread on CUDA.
    on_caller = [t == threading.get_ident() for t in threads]
    assert on_caller == [device == "cpu"] * 2
    released_at_once = not global_state()["scope_hooks_held"]
    record_property("resident_hooks_released_right_after_backward", released_at_once)
    if device == "cpu":
        # The engine ran the end-of-backward callback on this thread: released there.
        assert released_at_once
    # On CUDA the callback may run on the device thread, which can't touch this thread's stack: then
    # the entry goes at this thread's next safe point (NOTE [ Safe points ] in ckpt_lab/scope.py).
    with gradient_checkpoint_scope():
        pass
    assert_no_global_state(state_before)


# ------------------------------------------------------------------------ several scopes alive
@pytest.mark.parametrize("device", DEVICES)
def test_several_scopes_alive_at_once(device: str) -> None:
    torch.manual_seed(0)
    p1, p2 = _leaf(512, device=device), _leaf(512, device=device)

    def case(scope: Callable[[], Any]) -> list[torch.Tensor | None]:
        torch.manual_seed(1)
        refs = []

        def noisy(p: torch.Tensor) -> torch.Tensor:
            with scope():
                v = p * torch.randn_like(p)  # drawn from the device's generator, replayed in backward
            refs.append(weakref.ref(v.untyped_storage()))
            return v

        y = noisy(p1) * noisy(p2) * noisy(p1)
        alive = [ref() is not None for ref in refs]
        y.sum().backward()
        del y
        # Three recordings alive at once; their tensors freed at once with the scope.
        assert alive == [scope is contextlib.nullcontext] * 3
        return [*grads(p1, p2), torch.rand(4, device=device)]

    assert_all_equal(case(contextlib.nullcontext), case(gradient_checkpoint_scope))


# ------------------------------------------------------------------------------- autocast bf16
@pytest.mark.parametrize("order", ["scope inside autocast", "autocast inside the scope"])
@pytest.mark.parametrize("device", DEVICES)
def test_autocast_bf16(device: str, order: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.25), nn.Linear(128, 64)).to(device)
    x = _leaf(16, 64, device=device)

    def case(scope: Callable[[], Any]) -> list[torch.Tensor | None]:
        torch.manual_seed(1)
        autocast = torch.autocast(device, dtype=torch.bfloat16)
        outer, inner = (autocast, scope()) if order == "scope inside autocast" else (scope(), autocast)
        with outer, inner:
            h = net(x)
        assert h.dtype == torch.bfloat16
        (h.float() ** 2).sum().backward()
        del h
        return grads(x, *net.parameters())

    plain = case(contextlib.nullcontext)
    assert all(g is not None and g.dtype == torch.float32 for g in plain)
    assert_all_equal(plain, case(gradient_checkpoint_scope))


# ---------------------------------------------------------- the scope inside and around a checkpoint
@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("device", DEVICES)
def test_a_scope_inside_a_checkpoint(device: str, name: str) -> None:
    torch.manual_seed(0)
    a, c = _leaf(64, 32, device=device), _leaf(64, 32, device=device)

    def function(x: torch.Tensor, scope: Callable[[], Any]) -> torch.Tensor:
        with scope():
            h = F.dropout(x.sin(), 0.5).exp()
        return (h * c).cos()

    def case(ck: Callable[..., Any] | None, scope: Callable[[], Any]) -> list[torch.Tensor | None]:
        torch.manual_seed(1)
        y = function(a, scope) if ck is None else ck(function, a, scope)
        y.sum().backward()
        del y
        return [*grads(a, c), torch.rand(4, device=device)]

    plain = case(None, contextlib.nullcontext)
    # Inside the region the scope does nothing (the checkpoint recomputes it all): as without it.
    assert_all_equal(plain, case(CHECKPOINTS[name], contextlib.nullcontext))
    assert_all_equal(plain, case(CHECKPOINTS[name], gradient_checkpoint_scope))


@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpoint_inside_the_scope(device: str, name: str) -> None:
    torch.manual_seed(0)
    a, c = _leaf(64, 32, device=device), _leaf(64, 32, device=device)

    def block(u: torch.Tensor) -> torch.Tensor:
        return F.dropout(u.sin(), 0.5).exp()

    def case(ck: Callable[..., Any] | None, scope: Callable[[], Any]) -> list[torch.Tensor | None]:
        torch.manual_seed(1)
        with scope():
            x = (block(a) if ck is None else ck(block, a)).cos()
        (x * c).sum().backward()  # mul saves x: the scope recomputes it, checkpoint included
        del x
        return [*grads(a, c), torch.rand(4, device=device)]

    plain = case(None, contextlib.nullcontext)
    assert_all_equal(plain, case(None, gradient_checkpoint_scope))
    assert_all_equal(plain, case(CHECKPOINTS[name], gradient_checkpoint_scope))


# ------------------------------------------------------------------------------------- streams
def _scoped(function: Callable[..., Any], *args: Any) -> Any:
    with gradient_checkpoint_scope():
        return function(*args)


@cuda
@pytest.mark.parametrize("name", [*CHECKPOINTS, "gradient_checkpoint_scope"])
def test_a_checkpoint_whose_forward_runs_on_a_side_stream(name: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 256)).cuda()
    x = _leaf(128, 256, device="cuda")
    side = torch.cuda.Stream()
    runs = {"plain": lambda f, *a: f(*a), **CHECKPOINTS, "gradient_checkpoint_scope": _scoped}

    def step(how: str) -> list[torch.Tensor | None]:
        torch.manual_seed(1)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            loss = runs[how](net, x).square().sum()
        # Backward runs each op on its forward's stream (the recomputation included): torch's
        # stream semantics for backward, called from the default stream after waiting for the side.
        torch.cuda.current_stream().wait_stream(side)
        loss.backward()
        del loss
        torch.cuda.synchronize()
        return grads(x, *net.parameters())

    assert_all_equal(step("plain"), step(name))


# --------------------------------------------------------------------------------------- offload
@pytest.mark.parametrize("device", DEVICES)
def test_offload_pinned_copies_and_device_memory_drops(device: str) -> None:
    torch.manual_seed(0)
    width, batch = 1024, 512
    net = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU()).to(device)
    x = torch.randn(batch, width, device=device)
    grown: dict[str, int] = {}
    # On the CPU, include_cpu_tensors pushes CPU tensors through the same copies (a dry run).
    offload = offload_to_cpu(include_cpu_tensors=device == "cpu")

    def step(name: str) -> list[torch.Tensor | None]:
        torch.manual_seed(1)
        start = _allocated(device)
        with offload if name == "offload" else contextlib.nullcontext():
            out = net(x)
            loss = out.square().sum()
        del out
        grown[name] = _allocated(device) - start
        # At once, no synchronisation: the copies back are ordered on the stream, not by the host.
        loss.backward()
        del loss
        return grads(*net.parameters())

    assert_all_equal(step("plain"), step("offload"))
    one = batch * width * 4
    # Saved: x by the first Linear, each Linear's output by its GELU, the first GELU's output by the
    # second Linear, the last one by square; the weights (leaves) stay.
    assert (offload.tensors_moved, offload.bytes_moved, offload.bytes_returned) == (5, 5 * one, 5 * one)
    assert offload.pin_memory is (device == "cuda")
    if device == "cuda":
        # Four activations left the device (x, moved too, is still held by this test).
        assert grown["plain"] - grown["offload"] >= 4 * one
