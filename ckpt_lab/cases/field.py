"""Notebook 07c's cases from the field: how checkpointing goes wrong in real training code, each one
step on the CPU in well under a second, run three ways: with torch's checkpoint, with ours, and fixed.

Every case is one ``Case`` record: a model factory, the step to run, and in words what torch does, what
ours does and the fix; ``run(case, how)`` runs the step ``how`` ("torch", "ours" or "fix") and returns
the measured outcome as one line. Adding a case is adding one record to ``CASES``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckpt_lab

__all__ = ["CASES", "Attention", "Case", "LoadCountingMoE", "run"]

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
    run(model, x).sum().backward()
    return f"counted {int(model.tokens_per_expert.sum())} tokens for {TOKENS}"


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


# ------------------------------------------------------------------------------------------- the cases
CASES = [
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
