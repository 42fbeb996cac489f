"""The scope's mechanism test suite: what every ``gradient_checkpoint_scope`` must do.

One suite, two users: the tests run every check on the package's two scopes
(``ckpt_lab.scope``, the shipped one, and ``ckpt_lab.scope_core``, its core; see
tests/test_scope_mechanism.py), so that they cannot drift; and an exercise grader runs the same
checks on a learner's file that defines ``gradient_checkpoint_scope``, a context manager::

    from ckpt_lab.scope_checks import run_checks
    for name, failure in run_checks(my_module.gradient_checkpoint_scope).items():
        print(name, "ok" if failure is None else failure)

Each check is a plain function that takes the implementation, ``check_dropout(gradient_checkpoint_scope)``,
and returns None, or raises ``AssertionError`` with a message that says which tensor, which gradient,
by how much, and what was left behind. The oracle is the same code without any scope (the *plain
run*) and ``torch.utils.checkpoint``; gradients must be equal bit for bit. Each check ends by asking
for a clean global state: no saved-tensor hooks, dispatch modes or grad mode left behind, and
nothing held by the implementation's module (its ``leftovers()``, where it has one).

The checks, in ``CHECKS``, go from the API page's example to the hooks' lifetime: recompute
instead of store; dropout (RNG replay); tensors used long after the scope; enclosing hooks; nested
and several scopes; exceptions; a second backward; a scope inside a checkpoint; the hooks released
when the last scope tensor dies; a scope tensor modified after it was saved; the replays that must be
refused; no reference cycles; threads.
What only the shipped scope handles (in-place writes to outside tensors, ``.data`` aliases, views
autograd makes after the scope, ...) is tested on it alone (tests/test_scope*.py).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch._C._autograd import _pop_saved_tensors_default_hooks, _top_saved_tensors_default_hooks
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ckpt_lab.instruments.counting import OpCounter
from ckpt_lab.instruments.memory import LiveMemory
from ckpt_lab.instruments.state import assert_no_global_state
from ckpt_lab.nonreentrant import checkpoint as ckpt_lab_checkpoint

__all__ = ["CHECKS", "run_checks"]

Scope = Callable[..., Any]  # gradient_checkpoint_scope: called with no arguments, a context manager


def _PLAIN() -> contextlib.nullcontext:
    """The oracle: the same code without any scope (a function of its own, so that a case can tell
    the plain run from an implementation, even one that does nothing)."""
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------------ helpers
def _leaves(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.randn(*shape, requires_grad=True) for shape in shapes]


def _grads(**named: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """``{name: a copy of tensor.grad}``, and every .grad reset for the next run."""
    out = {name: None if t.grad is None else t.grad.clone() for name, t in named.items()}
    for t in named.values():
        t.grad = None
    return out


def _differences(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """What differs between two ``{name: tensor}`` results, one line per tensor, bit for bit."""
    lines = []
    for name, want in expected.items():
        have = got.get(name)
        if want is None or have is None:
            if (want is None) != (have is None):
                lines.append(f"{name} is {'None' if have is None else 'a tensor'}, the oracle's is not")
        elif have.shape != want.shape or have.dtype != want.dtype:
            oracle = f"{list(want.shape)} {want.dtype}"
            lines.append(f"{name} has shape {list(have.shape)} {have.dtype}, the oracle's {oracle}")
        elif not torch.equal(have, want):
            diff = (have.double() - want.double()).abs()
            where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
            lines.append(
                f"{name} differs: max |difference| {diff.max().item():.3g} at index {list(where)} "
                f"({(diff > 0).sum().item()} of {diff.numel()} elements differ)"
            )
    return lines


def _compare(
    what: str, case: Callable[[Scope], dict[str, Any]], scope: Scope, seed: int = 0
) -> dict[str, Any]:
    """Run ``case`` without a scope and with ``scope``, seeded alike; their results must be equal."""
    torch.manual_seed(seed)
    expected = case(_PLAIN)
    torch.manual_seed(seed)
    got = case(scope)
    lines = _differences(expected, got)
    assert not lines, f"{what}: with the scope, not as without it (bit for bit):\n  " + "\n  ".join(lines)
    return got


def _storage_ref(tensor: torch.Tensor) -> weakref.ref:
    """Dead exactly when the tensor's memory is freed."""
    return weakref.ref(tensor.untyped_storage())


def _top_hooks() -> Any:
    return _top_saved_tensors_default_hooks(False)


def _assert_clean(scope: Scope, after: str) -> None:
    """No global state left behind, and nothing held by the implementation's module."""
    try:
        assert_no_global_state()
    except AssertionError as error:
        raise AssertionError(
            f"after {after}: {error}. Once its tensors are gone a scope must leave the saved-tensors-hooks "
            "stack, the dispatch modes and grad mode as it found them."
        ) from None
    leftovers = getattr(sys.modules.get(getattr(scope, "__module__", ""), None), "leftovers", None)
    held = {key: value for key, value in (leftovers() if callable(leftovers) else {}).items() if value}
    assert not held, f"after {after}: the scope's module still holds {held} (its leftovers())"


def _raises(what: str, run: Callable[[], Any], because: str) -> str:
    """``run()`` must raise a RuntimeError (``CheckpointError`` is one); returns its message."""
    try:
        run()
    except RuntimeError as error:
        return str(error)
    raise AssertionError(f"{what}: backward ran without an error, but {because}: the gradients are wrong")


# ------------------------------------------------------------------------------------------- checks
def check_api_page_example(gradient_checkpoint_scope: Scope) -> None:
    """RETURNN's API page: ``x = a + b`` inside, ``y = x * c`` after; x is freed as soon as the user
    drops it (mul's saved x is recomputed), and the gradients equal the plain run's."""

    def case(scope: Scope) -> dict[str, Any]:
        a, b, c = _leaves((1000,), (1000,), (1000,))
        with scope():
            x = a + b
        memory = _storage_ref(x)
        y = x * c  # saves x, after the with block has closed
        del x
        if scope is _PLAIN:
            assert memory() is not None, "without a scope, mul must keep x for backward (the oracle's run)"
        else:
            assert memory() is None, (
                "x = a + b was made in the scope and then dropped by the user (del x), yet its memory is "
                "still alive after y = x * c: the scope must store a small reference for x, not x itself"
            )
        y.sum().backward()
        return _grads(a=a, b=b, c=c)

    _compare("x = a + b in the scope, y = x * c after it", case, gradient_checkpoint_scope)
    _assert_clean(gradient_checkpoint_scope, "the API page's example")


def check_recomputes_each_op_once(gradient_checkpoint_scope: Scope) -> None:
    """Backward re-runs each op of the scope exactly once, however many of its tensors are saved."""
    a, c = _leaves((64,), (64,))

    def run(scope: Scope) -> tuple[OpCounter, OpCounter]:
        with OpCounter() as forward:
            with scope():
                x = a.sin()
                y = x.exp() * 3
                z = y.tanh()
            loss = (x * c + y * c + z.cos()).sum()  # saves x, y and z
        with OpCounter() as backward:
            loss.backward()
        return forward, backward

    _, plain = run(_PLAIN)
    forward, scoped = run(gradient_checkpoint_scope)
    ops = ["sin", "exp", "mul", "tanh"]
    ran = {op: forward.counts[op] for op in ops}
    assert ran == {"sin": 1, "exp": 1, "mul": 3, "tanh": 1}, (
        f"the forward ran {ran}: the scope must not re-run ops then"
    )
    again = {op: scoped.counts[op] - plain.counts[op] for op in ops}
    assert again == {"sin": 1, "exp": 1, "mul": 1, "tanh": 1}, (
        f"ops run again in backward, beyond the plain run's: {again}; expected sin, exp, the scope's mul "
        "and tanh once each (x, y and z are saved: one replay serves all three)"
    )
    a.grad = c.grad = None
    _assert_clean(gradient_checkpoint_scope, "x, y, z saved from one scope")


def check_tensor_used_long_after_the_scope(gradient_checkpoint_scope: Scope) -> None:
    """A tensor returned from inside the with block, used twice, long after it closed."""

    def case(scope: Scope) -> dict[str, Any]:
        a, c = _leaves((50,), (50,))

        def make() -> torch.Tensor:
            with scope():
                return (a * 3).sin()

        x = make()
        y = (x * c).exp()
        z = (x.cos() * y).sum()
        del x
        z.backward()
        return _grads(a=a, c=c)

    _compare("x returned from the with block, used twice later", case, gradient_checkpoint_scope)
    _assert_clean(gradient_checkpoint_scope, "a tensor used after the scope")


def check_dropout(gradient_checkpoint_scope: Scope) -> None:
    """Dropout in the scope: the replay draws the forward's masks (the generator's state recorded
    before each random op), even if the code reseeds between them; the caller's random stream goes
    on as if there had been no replay. Against the plain run and torch.utils.checkpoint."""

    def function(a: torch.Tensor) -> torch.Tensor:
        return F.dropout(F.dropout(a.sin(), p=0.5) * 2, p=0.3)

    def case(scope: Scope) -> dict[str, Any]:
        a, c = _leaves((4, 256), (256,))
        with scope():
            x = function(a)
        (x * c).sum().backward()
        # The next random numbers: a replay must draw in a fork, not from the caller's stream.
        return {**_grads(a=a, c=c), "the next torch.rand(5) after backward": torch.rand(5)}

    _compare("dropout in the scope", case, gradient_checkpoint_scope)

    def checkpointed(scope: Scope) -> dict[str, Any]:
        a, c = _leaves((4, 256), (256,))
        if scope is _PLAIN:
            x = torch_checkpoint(function, a, use_reentrant=False)
        else:
            with scope():
                x = function(a)
        (x * c).sum().backward()
        return {**_grads(a=a, c=c), "the next torch.rand(5) after backward": torch.rand(5)}

    _compare(
        "dropout, against torch.utils.checkpoint (the oracle here)", checkpointed, gradient_checkpoint_scope
    )

    def reseeded(scope: Scope) -> dict[str, Any]:
        a, c = _leaves((4, 256), (256,))
        with scope():
            x = F.dropout(a.sin(), p=0.5)
            torch.manual_seed(7)  # not an aten op: only the generator's state before each draw shows it
            x = F.dropout(x, p=0.3)
        (x * c).sum().backward()
        return _grads(a=a, c=c)

    _compare("dropout, reseeded between two masks inside the scope", reseeded, gradient_checkpoint_scope)

    def explicit_generator(scope: Scope) -> dict[str, Any]:
        a = _leaves((40,))[0]
        g = torch.Generator().manual_seed(5)
        with scope():
            x = a * torch.randn(40, generator=g)
        after_forward = g.get_state()
        x.sin().sum().backward()
        assert torch.equal(g.get_state(), after_forward), "the replay advanced the user's torch.Generator"
        return _grads(a=a)

    _compare("a random op with an explicit torch.Generator", explicit_generator, gradient_checkpoint_scope)
    _assert_clean(gradient_checkpoint_scope, "dropout in the scope")


def check_enclosing_hooks(gradient_checkpoint_scope: Scope) -> None:
    """An enclosing saved_tensors_hooks still gets every saved tensor the scope does not recompute,
    during and after the scope; an enclosing save_on_cpu still offloads them."""
    seen: dict[str, list[str]] = {}

    def case(scope: Scope) -> dict[str, Any]:
        a, c = _leaves((100,), (100,))
        packed: list[torch.Tensor] = []
        with saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            with scope():
                x = a.sin()  # saves a: not made in the scope
            y = x.cos()  # saves x: made in the scope
            z = y * c  # saves y and c
        z.sum().backward()
        names = {id(a): "a", id(c): "c", id(x): "x", id(y): "y"}
        seen["scope" if scope is not _PLAIN else "plain"] = sorted(names.get(id(t), "?") for t in packed)
        packed.clear()
        return _grads(a=a, c=c)

    _compare("inside an enclosing saved_tensors_hooks", case, gradient_checkpoint_scope)
    assert seen["plain"] == ["a", "c", "x", "y"], f"without a scope the hook packed {seen['plain']}"
    assert seen["scope"] == ["a", "c", "y"], (
        f"the enclosing hook packed {seen['scope']} (without a scope: {seen['plain']}); it must get every "
        "saved tensor but x, which the scope recomputes: ['a', 'c', 'y']"
    )

    def offloaded(scope: Scope) -> dict[str, Any]:
        a, c = _leaves((100,), (100,))
        hooks, shapes = save_on_cpu(), []
        pack = hooks.pack_hook
        hooks.pack_hook = lambda t: shapes.append(t.shape) or pack(t)
        with hooks:
            with scope():
                x = a.sin().exp()  # saves a and exp's output
            y = (x * c).sum()  # saves x and c
        y.backward()
        return {**_grads(a=a, c=c), "tensors offloaded": torch.tensor(len(shapes))}

    torch.manual_seed(0)
    plain = offloaded(_PLAIN)
    torch.manual_seed(0)
    got = offloaded(gradient_checkpoint_scope)
    count, plain_count = int(got.pop("tensors offloaded")), int(plain.pop("tensors offloaded"))
    assert plain_count == 4, f"without a scope save_on_cpu offloaded {plain_count} tensors; expected 4"
    lines = _differences(plain, got)
    assert not lines, "inside an enclosing save_on_cpu:\n  " + "\n  ".join(lines)
    assert count == 2, (
        f"save_on_cpu offloaded {count} tensors; expected 2 (a and c; the scope recomputes the rest)"
    )
    _assert_clean(gradient_checkpoint_scope, "a scope inside saved_tensors_hooks and save_on_cpu")


def check_nested_scopes(gradient_checkpoint_scope: Scope) -> None:
    """A scope inside a scope: both sets of tensors are recomputed, and all are freed."""

    def case(scope: Scope) -> dict[str, Any]:
        a, c = _leaves((300,), (300,))
        with scope():
            x = a.sin()
            with scope():
                y = x.exp()
            memories = {"y (inner scope)": _storage_ref(y), "x (outer scope)": _storage_ref(x)}
            z = y * x
        w = z.cos() * c
        del x, y
        alive = [name for name, memory in memories.items() if memory() is not None]
        if scope is _PLAIN:
            assert alive == list(memories), f"without a scope, z = y * x must keep x and y; alive: {alive}"
        else:
            assert not alive, f"nested scopes: {alive} still alive after the forward, though only saved"
        w.sum().backward()
        return _grads(a=a, c=c)

    _compare("nested scopes", case, gradient_checkpoint_scope)
    _assert_clean(gradient_checkpoint_scope, "nested scopes")


def check_several_scopes(gradient_checkpoint_scope: Scope) -> None:
    """Two scopes whose tensors are alive at once, ``get_var1() * get_var2()`` (the RETURNN issue
    "Torch multiple simultaneous gradient_checkpoint_scope"): both freed right after the product."""

    def case(scope: Scope) -> dict[str, Any]:
        p1, p2 = _leaves((200,), (200,))
        memories = []

        def get_var(p: torch.Tensor) -> torch.Tensor:
            with scope():
                v = p * torch.randn_like(p)
            memories.append(_storage_ref(v))
            return v

        y = get_var(p1) * get_var(p2)
        alive = [memory() is not None for memory in memories]
        if scope is _PLAIN:
            assert alive == [True, True], f"without a scope, the product must keep both factors: {alive}"
        else:
            assert alive == [False, False], (
                f"get_var1() * get_var2(): scope tensors alive after the product: {alive}"
            )
        y.sum().backward()
        return _grads(p1=p1, p2=p2)

    _compare("two scopes' tensors alive at once", case, gradient_checkpoint_scope)
    _assert_clean(gradient_checkpoint_scope, "two scopes alive at once")


def check_chain_of_scopes(gradient_checkpoint_scope: Scope) -> None:
    """Blocks each in its own scope, a later one reading an earlier one's output: gradients equal,
    and every tensor freed after backward."""

    def case(scope: Scope) -> dict[str, Any]:
        torch.manual_seed(0)
        blocks = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(3)]
        x = torch.randn(4, 16, requires_grad=True)
        h = x
        for block in blocks:
            with scope():
                h = block(h)
        memory = _storage_ref(h)
        (h.square().sum()).backward()
        del h
        assert memory() is None, "the chain's last output is still alive after backward and del"
        named = {f"block {k} {name}": p for k, b in enumerate(blocks) for name, p in b.named_parameters()}
        return _grads(x=x, **named)

    _compare("a chain of scoped blocks", case, gradient_checkpoint_scope)
    _assert_clean(gradient_checkpoint_scope, "a chain of scoped blocks")


def check_exception_inside(gradient_checkpoint_scope: Scope) -> None:
    """An exception inside the scope propagates, leaves nothing behind, and a tensor that escaped the
    failed scope is an ordinary tensor."""
    a, c = _leaves((10,), (10,))
    kept = []
    try:
        with gradient_checkpoint_scope():
            kept.append(a.sin())
            raise ValueError("boom")
    except ValueError as error:
        assert str(error) == "boom", f"the exception changed on its way out of the scope: {error!r}"
    else:
        raise AssertionError("a ValueError raised inside the scope did not propagate")
    assert torch._C._len_torch_dispatch_stack() == 0, (
        "a dispatch mode is left on the stack after the exception"
    )
    _assert_clean(gradient_checkpoint_scope, "the exception (a tensor made in the failed scope still alive)")
    y = (kept.pop() * c).sum()
    y.backward()
    del y
    expected = a.detach().sin()
    assert torch.equal(c.grad, expected), "after the exception, c.grad of (a.sin() * c).sum() is not a.sin()"
    a.grad = c.grad = None
    _assert_clean(gradient_checkpoint_scope, "an exception inside the scope")


def check_second_backward(gradient_checkpoint_scope: Scope) -> None:
    """retain_graph: each backward replays once more; and a double backward (create_graph)."""

    def retained(scope: Scope) -> dict[str, Any]:
        a = _leaves((30,))[0]
        with scope():
            x = a.sin().exp()
        y = (x * x).sum()
        del x
        with OpCounter() as counter:
            y.backward(retain_graph=True)
            y.backward()
        replays = counter.counts["sin"], counter.counts["exp"]
        if scope is not _PLAIN:
            assert replays == (2, 2), (
                f"two backwards ran (sin, exp) {replays} times; expected once per backward"
            )
        return _grads(a=a)

    _compare("two backwards through the same graph (retain_graph=True)", retained, gradient_checkpoint_scope)

    def double(scope: Scope) -> dict[str, Any]:
        a = _leaves((20,))[0]
        with scope():
            x = a.sin() * a
        (g,) = torch.autograd.grad((x**3).sum(), a, create_graph=True)
        (g * g).sum().backward()
        return _grads(a=a)

    _compare("double backward (create_graph=True)", double, gradient_checkpoint_scope)
    _assert_clean(gradient_checkpoint_scope, "a second backward")


def check_scope_inside_a_checkpoint(gradient_checkpoint_scope: Scope) -> None:
    """A scope inside a checkpointed function (torch's non-reentrant checkpoint, ckpt_lab's) must do
    nothing: such a checkpoint matches what its re-run saves to what the forward saved by position."""
    for name, run in {
        "torch.utils.checkpoint": lambda f, x: torch_checkpoint(f, x, use_reentrant=False),
        "ckpt_lab.checkpoint": ckpt_lab_checkpoint,
    }.items():

        def case(scope: Scope, run: Callable[..., Any] = run) -> dict[str, Any]:
            a, c = _leaves((30,), (30,))

            def function(x: torch.Tensor) -> torch.Tensor:
                with save_on_cpu():  # a hook between the checkpoint's and the scope's
                    with scope():
                        h = x.sin().exp()
                return (h * c).cos()

            run(function, a).sum().backward()
            return _grads(a=a, c=c)

        _compare(f"a scope inside {name}", case, gradient_checkpoint_scope)
    _assert_clean(gradient_checkpoint_scope, "a scope inside a checkpoint")


def check_checkpoint_inside_the_scope(gradient_checkpoint_scope: Scope) -> None:
    """torch's checkpoint inside the scope."""

    def case(scope: Scope) -> dict[str, Any]:
        a, c = _leaves((30,), (30,))
        with scope():
            x = torch_checkpoint(lambda u: u.sin().exp(), a, use_reentrant=False).cos()
        (x * c).sum().backward()
        return _grads(a=a, c=c)

    _compare("torch.utils.checkpoint inside the scope", case, gradient_checkpoint_scope)
    _assert_clean(gradient_checkpoint_scope, "a checkpoint inside the scope")


def check_hooks_released(gradient_checkpoint_scope: Scope) -> None:
    """The scope's hook stays on the stack while a scope tensor lives (it may still be saved) and is
    gone when the last one dies; an enclosing user's hooks entry is exactly as the user pushed it."""
    a = _leaves((10,))[0]
    with gradient_checkpoint_scope():
        x = a.sin()
    assert _top_hooks() is not None, (
        "the scope closed with x alive, but no hook is on the stack: x * c would store x"
    )
    del x
    assert _top_hooks() is None, "every scope tensor is dead, yet a saved-tensor hook is still on the stack"
    pair = (lambda t: t, lambda t: t)
    with saved_tensors_hooks(*pair):
        with gradient_checkpoint_scope():
            x = a.sin()
        del x
        top = _top_hooks()
        assert top == pair, (
            f"inside the user's saved_tensors_hooks after the scope's tensors died, the top is {top}"
        )
    assert _top_hooks() is None, "the user's saved_tensors_hooks exited, but an entry is left on the stack"
    _assert_clean(gradient_checkpoint_scope, "the hooks' release")


def check_release_after_backward(gradient_checkpoint_scope: Scope) -> None:
    """The last scope tensor dies inside backward (a later scope kept it as an input): the engine
    undoes any change to the hooks stack made there, so the release must come after backward."""

    def case(scope: Scope) -> dict[str, Any]:
        a, c = _leaves((300,), (300,))
        with scope():
            x = a.sin()
        memory = _storage_ref(x)
        with scope():
            y = (x * x).exp()
        z = y * c
        del x, y
        assert memory() is not None, "x, an input the later scope reads, must be kept until backward"
        z.sum().backward()
        del z
        assert memory() is None, "x is still alive after backward, though nothing uses it any more"
        if scope is not _PLAIN:
            assert _top_hooks() is None, (
                "the last scope tensor died in backward; after it a hook is still on the stack"
            )
        return _grads(a=a, c=c)

    _compare("a scope tensor dying inside backward", case, gradient_checkpoint_scope)
    _assert_clean(gradient_checkpoint_scope, "a release after backward")


def check_refused_replays(gradient_checkpoint_scope: Scope) -> None:
    """A replay that would give wrong gradients raises (a RuntimeError, such as CheckpointError)."""
    a, w = _leaves((20,), (20,))
    with gradient_checkpoint_scope():
        h = (a + w).sin()  # add saves nothing: autograd alone would not notice
    loss = h.sum()
    del h
    with torch.no_grad():
        w.add_(1)
    _raises(
        "w, read in the scope, then modified in place before backward",
        loss.backward,
        "the replay would read w's new values",
    )
    del loss
    x = _leaves((10,))[0]
    m = torch.arange(10.0) - 6.5  # 3 positive entries
    with gradient_checkpoint_scope():
        y = x[m > 0].sin()  # data-dependent shape
    loss = y.sum()
    del y
    m.data.neg_()  # through .data: no version bump; 7 positive entries now
    _raises(
        "m changed through .data before backward",
        loss.backward,
        "the replay's x[m > 0] has 7 elements, the forward's 3 (the metadata check)",
    )
    del loss
    x.grad = None
    _assert_clean(gradient_checkpoint_scope, "the refused replays")


def check_modified_after_saved(gradient_checkpoint_scope: Scope) -> None:
    """A scope tensor modified in place after autograd saved it is refused, as autograd refuses it,
    even when the tensor itself is gone by backward (its version cannot be read then)."""
    x = _leaves((10,))[0]
    with gradient_checkpoint_scope():
        x2 = x * 2
        y = x2.sin()  # saves x2
        x2.add_(1)
    loss = (y + x2).sum()
    del x2, y
    _raises(
        "x2, made in the scope, modified in place after sin saved it (x2 itself gone by backward)",
        loss.backward,
        "without the scope autograd raises too",
    )
    del loss
    x.grad = None
    _assert_clean(gradient_checkpoint_scope, "a scope tensor modified after it was saved")


def check_writes_outside_the_recording(gradient_checkpoint_scope: Scope) -> None:
    """A scope tensor modified in place after the scope (not recorded) is stored, not recomputed; a
    stored tensor modified in place before backward is refused, as autograd refuses it."""

    def case(scope: Scope) -> dict[str, Any]:
        a = _leaves((10,))[0]
        with scope():
            x = a * 2
        x.mul_(3)
        x.sin().sum().backward()
        return _grads(a=a)

    _compare("a scope tensor modified in place after the scope", case, gradient_checkpoint_scope)
    a, c = _leaves((10,), (10,))
    with gradient_checkpoint_scope():
        x = a.sin()
    b = c * 1
    y = x * b  # the scope's hook gets b too (not made in a scope)
    with torch.no_grad():
        b.add_(1)
    message = _raises(
        "b, saved after the scope, modified in place before backward",
        y.sum().backward,
        "autograd raises for it",
    )
    assert "modified by an inplace operation" in message, f"the error should be autograd's own: {message}"
    del x, y
    _assert_clean(gradient_checkpoint_scope, "writes outside the recording")


def check_no_reference_cycles(gradient_checkpoint_scope: Scope) -> None:
    """Everything is freed by reference counting alone (no garbage collector), the stack included."""
    a, c = _leaves((1000,), (1000,))
    gc.disable()
    try:
        with LiveMemory() as memory:
            with gradient_checkpoint_scope():
                x = a.sin()
            y = (x * c).exp()  # exp saves its output: stored by the scope's hook
            z = y.sum()
            del x, y
            z.backward()
            del z
            a.grad = c.grad = None
            left = memory.live_bytes
            hook_left = _top_hooks() is not None
    finally:
        gc.enable()
    assert left == 0, (
        f"{left} bytes made during the step are still alive without a garbage collection (a cycle)"
    )
    assert not hook_left, (
        "after the step a saved-tensor hook is still on the stack without a garbage collection"
    )
    _assert_clean(gradient_checkpoint_scope, "a step without the garbage collector")


def check_autocast(gradient_checkpoint_scope: Scope) -> None:
    """Under CPU autocast (bfloat16), backward inside autocast too, in the forward's autocast region
    or in a second one (its cast cache fresh): the replay runs the recorded, already cast ops as they
    were."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(16, 16)

    def case(scope: Scope, same_region: bool = True) -> dict[str, Any]:
        x = torch.randn(8, 16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with scope():
                h = F.gelu(lin(x))
            out = lin(h).float().sum()
            if same_region:
                out.backward()
        if not same_region:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out.backward()
        return _grads(x=x, weight=lin.weight, bias=lin.bias)

    _compare("under torch.autocast('cpu', dtype=torch.bfloat16)", case, gradient_checkpoint_scope)
    _compare(
        "under torch.autocast('cpu', dtype=torch.bfloat16), backward in a second autocast region",
        lambda scope: case(scope, same_region=False),
        gradient_checkpoint_scope,
    )
    _assert_clean(gradient_checkpoint_scope, "autocast")


def check_op_chains(gradient_checkpoint_scope: Scope) -> None:
    """Chains of views, in-place ops, concatenation and dropout, each op in a scope or not."""
    ops: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "sin": torch.sin,
        "mul": lambda x: x * x,
        "dropout": lambda x: F.dropout(x, 0.3),
        "transpose": lambda x: x.t().contiguous().t(),
        "view": lambda x: x.reshape(-1).view(x.shape) + 1,
        "cat": lambda x: torch.cat([x, x.flip(0)])[: x.shape[0]],
        "in-place": lambda x: (x * 1).add_(0.5),
    }
    chains = [
        ("sin", "mul", "view", "in-place"),
        ("dropout", "cat", "transpose", "sin"),
        ("view", "dropout", "in-place", "mul", "cat"),
    ]
    for n, chain in enumerate(chains):
        for scoped in ((True,) * len(chain), tuple(i % 2 == n % 2 for i in range(len(chain)))):

            def case(scope: Scope, chain: tuple = chain, scoped: tuple = scoped) -> dict[str, Any]:
                a = _leaves((4, 6))[0]
                x = a
                for op, inside in zip(chain, scoped, strict=True):
                    with scope() if inside else _PLAIN():
                        x = ops[op](x)
                x.pow(2).sum().backward()
                return _grads(a=a)

            where = ", ".join(
                f"{op}{' (scoped)' if inside else ''}" for op, inside in zip(chain, scoped, strict=True)
            )
            _compare(f"the chain {where}", case, gradient_checkpoint_scope)
    _assert_clean(gradient_checkpoint_scope, "op chains")


def check_another_thread(gradient_checkpoint_scope: Scope) -> None:
    """A scope on another thread: its hook lives on that thread's stack only, and is removed there."""
    a, c = _leaves((50,), (50,))
    expected = (a.cos() * c).detach(), a.sin().detach()
    seen: dict[str, Any] = {}

    def worker() -> None:
        try:
            with gradient_checkpoint_scope():
                x = a.sin()
            seen["hook while x lives"] = _top_hooks() is not None
            (x * c).sum().backward()
            del x
            seen["hook after"] = _top_hooks() is not None
        except Exception as error:  # reported below, on the caller's thread
            seen["error"] = repr(error)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == {"hook while x lives": True, "hook after": False}, f"on a worker thread: {seen}"
    assert _top_hooks() is None, "a scope on another thread left a hook on this thread's stack"
    assert torch.equal(a.grad, expected[0]) and torch.equal(c.grad, expected[1]), (
        "gradients on the worker differ"
    )
    a.grad = c.grad = None
    _assert_clean(gradient_checkpoint_scope, "a scope on another thread")


CHECKS: list[Callable[[Scope], None]] = [
    check_api_page_example,
    check_recomputes_each_op_once,
    check_tensor_used_long_after_the_scope,
    check_dropout,
    check_enclosing_hooks,
    check_nested_scopes,
    check_several_scopes,
    check_chain_of_scopes,
    check_exception_inside,
    check_second_backward,
    check_scope_inside_a_checkpoint,
    check_checkpoint_inside_the_scope,
    check_hooks_released,
    check_release_after_backward,
    check_modified_after_saved,
    check_refused_replays,
    check_writes_outside_the_recording,
    check_no_reference_cycles,
    check_autocast,
    check_op_chains,
    check_another_thread,
]


def run_checks(gradient_checkpoint_scope: Scope) -> dict[str, str | None]:
    """Every check on one implementation: ``{check name: None if it passed, else what failed}``.

    After a failed check the saved-tensors-hooks stack is emptied (and the garbage collected), so
    that what one check left behind does not fail the next ones too."""
    results: dict[str, str | None] = {}
    for check in CHECKS:
        try:
            check(gradient_checkpoint_scope)
            results[check.__name__] = None
        except Exception as error:
            results[check.__name__] = f"{type(error).__name__}: {error}"
            gc.collect()
            while _top_hooks() is not None:
                _pop_saved_tensors_default_hooks()
    return results
