"""Notebook 07c's cases from the field: how checkpointing goes wrong in real training code, each one
step on the CPU in well under a second, run three ways: with torch's checkpoint, with ours, and fixed.

Every case is one ``Case`` record: a model factory, the step to run, and in words what torch does, what
ours does and the fix; ``run(case, how)`` runs the step ``how`` ("torch", "ours" or "fix") and returns
the measured outcome as one line. Adding a case is adding one record to ``CASES``.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckpt_lab

__all__ = [
    "CASES",
    "Attention",
    "Case",
    "DecoderLayer",
    "LastActivation",
    "LoadCountingMoE",
    "TieRouterMoE",
    "run",
]

WIDTH, TOKENS, EXPERTS = 8, 5, 2


@dataclass(frozen=True)
class Case:
    """One case: ``make()`` builds a fresh model, ``step(model, how)`` runs one training step and
    returns what it measured (a line); ``torch``/``ours``/``fix`` say in words what to expect."""

    name: str
    source: str
    make: Callable[[], Any]
    step: Callable[[Any, str], str]
    torch: str
    ours: str
    fix: str


def checkpointed(how: str, **ours: Any) -> Callable[..., Any]:
    """The checkpoint for ``how``: torch's non-reentrant one, or ours with the keywords ``ours``."""
    if how == "torch":
        return lambda f, *a: torch_checkpoint(f, *a, use_reentrant=False)
    return lambda f, *a: ckpt_lab.checkpoint(f, *a, **ours)


def outcome(step: Callable[[], str]) -> str:
    """The step's line, or the first line of the error it raised."""
    try:
        return step()
    except RuntimeError as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0][:110]}"


def same_grads(
    run: Callable[[], torch.Tensor], params: list[torch.Tensor], right: list[torch.Tensor]
) -> bool:
    """Whether one step's gradients equal ``right`` (the plain run's)."""
    for p in params:
        p.grad = None
    run().sum().backward()
    return all(torch.allclose(p.grad, r) for p, r in zip(params, right, strict=True))


# ------------------------------------------------------------------ an expert-load counter, counted twice
class LoadCountingMoE(nn.Module):
    """Top-1 routing over two experts that counts the tokens each expert got, in a buffer: the metric
    a load-balancing loss reads (the Automodel pull request that counted it twice under checkpointing)."""

    def __init__(self, guard_with_is_recomputing: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS))
        self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS))
        self.guard = guard_with_is_recomputing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        if not self.guard or not ckpt_lab.is_recomputing():
            # Counted in place: a second run of this line counts every token again.
            self.tokens_per_expert += torch.bincount(choice, minlength=EXPERTS)
        return sum(self.experts[e](x) * (choice == e).unsqueeze(-1) for e in range(EXPERTS))


def load_counter_step(model: LoadCountingMoE, how: str) -> str:
    x = torch.randn(TOKENS, WIDTH)
    run = {
        "torch": checkpointed("torch"),
        "ours": checkpointed("ours", state_check="warn"),
        "fix": checkpointed("ours", state_check="restore"),
    }[how]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(model, x).sum().backward()
    # The guard's warning (state_check="warn"): the line that names the change.
    named = [line.strip() for w in caught for line in str(w.message).splitlines() if "->" in line]
    said = f"; the guard warned: {named[0]}" if named else ""
    return f"counted {int(model.tokens_per_expert.sum())} tokens for {TOKENS}{said}"


# ----------------------------------------------------------------------- a KV cache appended in forward
class Attention(nn.Module):
    """Single-head attention that appends each call's keys and values to a cache (generation code left
    on in training: the "use_cache=True is incompatible with gradient checkpointing" warning)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        self.cache.append((k, v))
        keys = torch.cat([k for k, _ in self.cache])
        values = torch.cat([v for _, v in self.cache])
        return torch.softmax(q @ keys.T, dim=-1) @ values


def kv_cache_step(model: Attention, how: str) -> str:
    x = torch.randn(TOKENS, WIDTH)
    run = {
        "torch": checkpointed("torch"),
        "ours": checkpointed("ours", state_check="raise"),
        "fix": checkpointed("ours", state_check="restore"),
    }[how]
    params = list(model.parameters())
    # The plain run's gradients, from a fresh model with an empty cache, as the forward saw it.
    fresh = Attention()
    right = torch.autograd.grad(fresh(x).sum(), list(fresh.parameters()))
    ok = same_grads(lambda: run(model, x), params, list(right))
    return f"gradients equal the plain run's: {ok}; cache holds {len(model.cache)} entry"


# ------------------------------------------------------------------------ ctx.saved_tensors read twice
class TwiceSaved(torch.autograd.Function):
    """A custom op whose backward reads ``ctx.saved_tensors`` twice (the mamba issues)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        cos = ctx.saved_tensors[0].cos()
        return grad * cos * (ctx.saved_tensors[0] * 0 + 1)


class OnceSaved(TwiceSaved):
    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # once, into a variable
        return grad * x.cos()


def saved_twice_step(model: None, how: str) -> str:
    x = torch.randn(TOKENS, requires_grad=True)
    function = OnceSaved.apply if how == "fix" else TwiceSaved.apply
    checkpointed(how)(lambda t: function(t * 2), x).sum().backward()
    return f"gradient equals the plain run's: {torch.allclose(x.grad, 2 * (2 * x).detach().cos())}"


# ---------------------------------------------------------------- determinism_check="none" as a silencer
def silenced_step(model: None, how: str) -> str:
    calls = itertools.count()
    # A branch on a call counter: the forward runs sin, the re-run cos (a flag flipped in between).
    branchy = lambda t: (t.sin() if next(calls) == 0 else t.cos()).exp()
    x = torch.randn(TOKENS, requires_grad=True)
    right = (x.sin().exp() * x.cos()).detach()
    if how == "torch":
        out = torch_checkpoint(branchy, x, use_reentrant=False, determinism_check="none")
    elif how == "ours":
        out = ckpt_lab.checkpoint(branchy, x)
    else:
        out = ckpt_lab.checkpoint(lambda t: t.sin().exp(), x)  # the branch fixed, the check left on
    out.sum().backward()
    return f"gradient equals the plain run's: {torch.allclose(x.grad, right)}"


# ------------------------------------------------------------ an MoE router whose top-1 flips on a near-tie
# Which run this is, for the stand-in of a kernel whose reduction order changes the last bit (atomics
# in bf16, another tiling in the re-run): the forward (0) and the re-run (1) break a tie differently.
# Global on purpose: such a difference lives in no module's state.
_run = itertools.count()
# The experts each token goes to: in the forward, and in the re-run (two tokens flip: the same counts;
# one token flips: other counts, other shapes).
CHOICES = {
    "forward": [0, 0, 1, 1, 1],
    "same shape": [1, 0, 0, 1, 1],
    "changed shape": [1, 0, 1, 1, 1],
}


class TieRouterMoE(nn.Module):
    """Top-1 routing over two experts whose router scores every token a near-tie: the choice rests on
    the last bit, which the forward and the re-run compute differently (``CHOICES``)."""

    def __init__(self, rerun: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS))
        self.rerun = rerun

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's output and its top-1: gate weight and expert of each token."""
        logits = self.router(x) * 1e-6  # a near-tie: every score about the same
        choice = torch.tensor(CHOICES["forward" if next(_run) == 0 else self.rerun])
        last_bit = 1e-3 * nn.functional.one_hot(choice, EXPERTS)
        gate, top = (logits + last_bit).softmax(-1).topk(1)
        return gate.squeeze(-1), top.squeeze(-1)

    def experts_forward(self, x: torch.Tensor, gate: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tokens = (top == e).nonzero().squeeze(1)
            out = out.index_add(0, tokens, expert(x[tokens]) * gate[tokens, None])
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts_forward(x, *self.route(x))


def router_step(model: TieRouterMoE, how: str) -> str:
    global _run
    x = torch.randn(TOKENS, WIDTH)
    params = list(model.parameters())
    _run = itertools.count()
    right = list(torch.autograd.grad(model(x).sum(), params))
    _run = itertools.count()
    if how == "fix":
        # Save the router's output and its top-k: route outside the checkpoint, pass them in.
        ok = same_grads(lambda: ckpt_lab.checkpoint(model.experts_forward, x, *model.route(x)), params, right)
    else:
        ok = same_grads(lambda: checkpointed(how)(model, x), params, right)
    return f"gradients equal the plain run's: {ok}"


# ------------------------------------------------------------------ a module that caches its last activation
class LastActivation(nn.Module):
    """A block that keeps its output for a later look (a probe, a logger): ``self.last``."""

    def __init__(self, detach: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(WIDTH, 4 * WIDTH)
        self.out = nn.Linear(4 * WIDTH, WIDTH)
        self.detach = detach
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).relu()
        self.last = h.detach() if self.detach else h
        return self.out(h)


def last_activation_step(model: LastActivation, how: str) -> str:
    if how == "fix":
        model = LastActivation(detach=True)
    x = torch.randn(TOKENS, WIDTH, requires_grad=True)
    checkpointed(how)(model, x).sum().backward()
    graph = model.last.grad_fn is not None
    return f"after the step, model.last holds {model.last.nbytes} B and the forward's graph: {graph}"


# ------------------------------------------------------------- a wrapper that checkpoints each child
class DecoderLayer(nn.Module):
    """A toy decoder layer: norm, attention, norm, MLP, with residuals (its children: four modules)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, wrap: Callable[..., Any] | None = None) -> torch.Tensor:
        # ``wrap``: what a wrapper that checkpoints each child does to every call of a child.
        call = wrap or (lambda f, *a: f(*a))
        h = call(self.norm1, x)
        x = x + call(lambda t: self.attn(t, t, t, need_weights=False)[0], h)
        return x + call(self.mlp, call(self.norm2, x))


def per_child_step(model: DecoderLayer, how: str) -> str:
    x = torch.randn(4, 32, 64, requires_grad=True)
    ckpt = checkpointed(how)
    if how == "fix":
        run = lambda: ckpt(model, x).sum()
    else:
        run = lambda: model(x, wrap=ckpt).sum()
    kept = ckpt_lab.measure_memory(run).retained_bytes
    plain = ckpt_lab.measure_memory(lambda: model(x).sum()).retained_bytes
    return f"keeps {kept} B between forward and backward ({kept / plain:.0%} of no checkpoint's)"


# ------------------------------------------------------- a SAC policy that compares with the op packet
def sac_packet_step(model: None, how: str) -> str:
    """A callable policy meant to save the matmuls, written ``op == aten.mm`` (the packet): the op it
    is shown is ``aten.mm.default`` (an overload), so it matches nothing and saves nothing."""
    aten = torch.ops.aten
    wanted = aten.mm.default if how == "fix" else aten.mm
    saved = []

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        saved.append(op == wanted)
        return CheckpointPolicy.MUST_SAVE if op == wanted else CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    x, w = torch.randn(TOKENS, WIDTH, requires_grad=True), torch.randn(WIDTH, WIDTH, requires_grad=True)
    block = lambda t: (t @ w).relu() @ w
    if how == "torch":
        context = functools.partial(create_selective_checkpoint_contexts, policy)
        torch_checkpoint(block, x, use_reentrant=False, context_fn=context).sum().backward()
        said = ""
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ckpt_lab.selective_checkpoint(block, x, policy=policy).sum().backward()
        said = "".join(f"; ours warned: {str(w.message)[:62]}..." for w in caught)
    return f"the policy saved {sum(saved)} of the {len(saved)} ops it was shown{said}"


# ------------------------------------------------------------------------------------------- the cases
CASES = [
    Case(
        "an MoE router whose top-1 flips on a near-tie, other counts",
        "the NeMo Automodel and NeMo RL issues on per-expert token counts that change in the re-run",
        lambda: TieRouterMoE("changed shape"),
        router_step,
        torch="CheckpointError: other shapes in the re-run",
        ours="CheckpointError: other shapes in the re-run",
        fix="save the router's output and top-k (route outside the checkpoint): the right gradients",
    ),
    Case(
        "an MoE router whose top-1 flips on a near-tie, the same counts",
        "the same issues, and the torchtitan issue on MoE routing under activation checkpointing",
        lambda: TieRouterMoE("same shape"),
        router_step,
        torch="no error, wrong gradients",
        ours="the same: the same ops on the same shapes, other tokens",
        fix="save the router's output and top-k: the right gradients",
    ),
    Case(
        "an expert-load counter counted twice",
        "the NeMo Automodel pull request on double-counted expert load under activation checkpointing",
        LoadCountingMoE,
        load_counter_step,
        torch="counts every token twice, silently",
        ours="state_check='warn' names LoadCountingMoE.tokens_per_expert (version 1 -> 2)",
        fix="state_check='restore', or `if not ckpt_lab.is_recomputing():` around the count",
    ),
    Case(
        "a KV cache appended in forward",
        "the TRL pull request and the LongLive issue on use_cache with gradient checkpointing",
        Attention,
        kv_cache_step,
        torch="CheckpointError (the re-run attends over a longer cache: other shapes)",
        ours="state_check='raise' names Attention.cache (a list of length 0 -> 1)",
        fix="state_check='restore' (or use_cache=False in training)",
    ),
    Case(
        "a module that caches its last activation",
        "the TRL and LongLive threads (a module keeping what its forward made)",
        LastActivation,
        last_activation_step,
        torch="the cached activation keeps the forward's graph alive after the step",
        ours="the same",
        fix="cache h.detach()",
    ),
    Case(
        "a wrapper that checkpoints each child instead of the layer",
        "the accelerate issue and pull request (29 GB of a 40.8 GB peak kept by per-child checkpoints)",
        DecoderLayer,
        per_child_step,
        torch="each child's input is kept: near no checkpoint's bytes",
        ours="the same (explain shows each child's input kept)",
        fix="checkpoint the whole layer",
    ),
    Case(
        "a SAC policy written as a callable that compares with aten.mm, not aten.mm.default",
        "the PyTorch issue on selective checkpointing policies that match nothing",
        lambda: None,
        sac_packet_step,
        torch="saves nothing, silently (torch refuses packets only in the list form)",
        ours="a warning: the policy saved none of the ops it was shown, and why",
        fix="compare with aten.mm.default (or op.overloadpacket == aten.mm)",
    ),
    Case(
        "a custom Function that reads ctx.saved_tensors twice",
        "the mamba issues on checkpointing its selective-scan Function",
        lambda: None,
        saved_twice_step,
        torch="CheckpointError: unpack triggered twice",
        ours="the same sentence, then how to read it once",
        fix="read ctx.saved_tensors once, into a variable",
    ),
    Case(
        'determinism_check="none" used to silence the error',
        "the OLMo-core pull request that turned the determinism check off",
        lambda: None,
        silenced_step,
        torch="no error, wrong gradients",
        ours="CheckpointError naming sin and cos (the check is what found it)",
        fix="make the re-run take the forward's path; keep the check on",
    ),
]


def run(case: Case, how: str) -> str:
    """One step of ``case`` run ``how`` ("torch", "ours" or "fix") on a fresh model: what it measured."""
    model = case.make()
    return outcome(lambda: case.step(model, how))
