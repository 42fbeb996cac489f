"""A model people really train, explained: GPT-2 from Hugging Face ``transformers``, small, built
from a config (no download), and the ways to checkpoint it, ours included.

``python -m ckpt_lab.explain ckpt_lab.cases.real:FACTORY`` with FACTORY one of ``VARIANTS``:

* ``gpt2_plain``: no checkpointing;
* ``gpt2_transformers``: the library's own switch, ``model.activation_checkpointing_enable()``
  (``gradient_checkpointing_enable()`` before transformers 5.23; that name still works, with a
  ``FutureWarning``): torch's non-reentrant checkpoint around each block;
* ``gpt2_ckpt_lab``: the same switch, ``ckpt_lab.checkpoint`` plugged into it
  (``use_checkpoint_function``);
* ``gpt2_scope_mlp`` / ``gpt2_scope_attn``: ``ckpt_lab.gradient_checkpoint_scope`` around each
  block's MLP or attention (``scope_submodules``), the switch off;
* ``gpt2_planned``: ``ckpt_lab.planner`` at half of its budget range, one selective checkpoint per
  block, plugged into the same switch (``plan_layers``).

NOTE [ How transformers checkpoints a block ] (transformers 5.23, ``modeling_utils.py`` and
``modeling_layers.py``). ``activation_checkpointing_enable(activation_checkpointing_kwargs)`` makes
``partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)`` (the kwargs are only torch's) and
stores it on every module that has a ``gradient_checkpointing`` flag, as the attribute
``_gradient_checkpointing_func``, setting the flag. Each decoder block is a
``GradientCheckpointingLayer``, whose ``forward`` is wrapped at class creation: in training, with
the flag set, it calls ``self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)``.
So the positional arguments (the hidden states; GPT-2 passes its attention mask positionally too)
are the checkpoint's inputs, keyword arguments ride in the ``partial``, and module hooks stay
outside the checkpoint. The switch has no parameter for another function, but the attribute is the
plug: anything called like torch's checkpoint can be stored there, per block. ``ckpt_lab.checkpoint``
is (it takes and drops ``use_reentrant=False``); so is a ``selective_checkpoint`` with a policy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ckpt_lab import planner
from ckpt_lab.nonreentrant import checkpoint
from ckpt_lab.rng import fork_rng
from ckpt_lab.scope import gradient_checkpoint_scope
from ckpt_lab.selective import selective_checkpoint

__all__ = [
    "VARIANTS",
    "checkpointed_layers",
    "gpt2",
    "gpt2_ckpt_lab",
    "gpt2_plain",
    "gpt2_planned",
    "gpt2_scope_attn",
    "gpt2_scope_mlp",
    "gpt2_transformers",
    "plan_layers",
    "scope_submodules",
    "use_checkpoint_function",
]

# Small enough for a CPU in CI (one explained step takes about half a second on 2 cores), large
# enough that activations outweigh the parameters ten to one, as in real training.
SIZES = {"n_layer": 4, "n_embd": 128, "n_head": 4, "seq": 128, "batch": 4, "vocab": 512}


# ------------------------------------------------------------------------------------- the model
def gpt2(seed: int = 0, activation: str = "gelu_new", **sizes: Any) -> tuple[nn.Module, torch.Tensor]:
    """``GPT2LMHeadModel`` from a small ``GPT2Config`` (dropout as GPT-2's: 0.1), in training mode,
    and a batch of token ids; the same weights and tokens for the same seed. ``activation`` is the
    config's ``activation_function`` (GPT-2's ``gelu_new``, written as Python arithmetic, or
    ``gelu_pytorch_tanh``, the same function as one fused op)."""
    from transformers import GPT2Config, GPT2LMHeadModel  # imported here: an optional dependency

    s = {**SIZES, **sizes}
    config = GPT2Config(
        vocab_size=s["vocab"], n_positions=s["seq"], n_embd=s["n_embd"], n_layer=s["n_layer"],
        n_head=s["n_head"], activation_function=activation,
        # Eager attention: softmax, dropout and the two matmuls as separate ops, which explain can
        # name (SDPA fuses them into one op that keeps less).
        attn_implementation="eager",
        # GPT-2's token ids 50256 are outside a small vocabulary; no cache in training.
        bos_token_id=s["vocab"] - 1, eos_token_id=s["vocab"] - 1, use_cache=False,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).train()
    # transformers finds the loss by the class name; "GPT2LMHeadModel" predates the naming, so it
    # warns and falls back to this one. Said here, no warning.
    model.loss_type = "ForCausalLM"
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=generator)
    return model, tokens


def lm_loss(output: Any) -> torch.Tensor:
    """The model's own language-model loss: the model is called with ``labels=input_ids``."""
    return output.loss


# ------------------------------------------------------------------- plugging into the switch
def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The modules transformers' switch checkpoints (``GradientCheckpointingLayer``s), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def use_checkpoint_function(
    model: nn.Module, function: Callable[..., Any] | Sequence[Callable[..., Any]] = checkpoint
) -> nn.Module:
    """Turn on transformers' own switch, then plug ``function`` in where it put torch's checkpoint.

    ``function`` is called as ``function(block_forward, *args)``, as torch's checkpoint is; a list
    gives one function per checkpointed layer (``checkpointed_layers``). The switch's other work
    stays: which blocks, ``use_cache`` off, inputs that require grad.
    """
    if not model.is_activation_checkpointing:
        # Once: each call would also add another forward hook on the input embeddings.
        model.activation_checkpointing_enable()
    layers = checkpointed_layers(model)
    functions = list(function) if isinstance(function, Sequence) else [function] * len(layers)
    if len(functions) != len(layers):
        raise ValueError(f"use_checkpoint_function: {len(functions)} functions for {len(layers)} layers.")
    for layer, f in zip(layers, functions, strict=True):
        layer._gradient_checkpointing_func = f
    return model


# --------------------------------------------------------------------------------------- scope
def _scoped(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def scoped_forward(*args: Any, **kwargs: Any) -> Any:
        with gradient_checkpoint_scope():
            return forward(*args, **kwargs)

    return scoped_forward


def scope_submodules(model: nn.Module, name: str) -> list[str]:
    """Run every submodule called ``name`` ("mlp", "attn") inside ``gradient_checkpoint_scope``.

    The scope is a ``with`` block, so it goes around the code, not a function: here the module's
    ``forward``, replaced on the instance (``module.forward = scoped(module.forward)``): module
    paths, ``state_dict`` keys and hooks stay as they were. Returns the paths changed.
    """
    paths = [p for p, m in model.named_modules() if p.rsplit(".", 1)[-1] == name]
    for path in paths:
        module = model.get_submodule(path)
        module.forward = _scoped(module.forward)
    if not paths:
        raise ValueError(f"scope_submodules: no submodule called {name!r}.")
    return paths


# ------------------------------------------------------------------------------------- planner
def plan_layers(model: nn.Module, *args: Any, fraction: float = 0.5, **kwargs: Any) -> planner.Plan:
    """Plan one byte budget over every checkpointed layer and plug the plan into the switch.

    ``planner.plan`` takes a function and its arguments; a transformers block is called with keyword
    arguments (masks, position ids) that only the model knows. So the switch is used to find them:
    one forward of ``model(*args, **kwargs)`` runs with a function in the plug that profiles each
    block exactly as the model calls it (``planner.profile``), then the budget is solved over all
    blocks at once (``planner.solve``) and each block gets a ``selective_checkpoint`` with its share
    of the plan. The budget is ``fraction`` of the way from the smallest (the blocks' inputs) to the
    largest useful one, as the benchmark's ``ckpt-plan-50``. The profiling forward leaves no trace.
    """
    layers = checkpointed_layers(model)
    profiles: list[planner.Profile | None] = [None] * len(layers)

    def profiling(i: int) -> Callable[..., Any]:
        def run(function: Callable[..., Any], *inputs: Any, use_reentrant: bool = False) -> Any:
            profiles[i] = planner.profile(function, *inputs)
            return function(*inputs)

        return run

    use_checkpoint_function(model, [profiling(i) for i in range(len(layers))])
    with fork_rng():
        model(*args, **kwargs)
    found = [p for p in profiles if p is not None]
    if len(found) != len(layers):
        raise ValueError("plan_layers: the forward did not run every checkpointed layer (eval mode?).")
    low, high = planner.budget_range(found)
    plan = planner.solve(found, low + round(fraction * (high - low)))

    def planned(i: int) -> Callable[..., Any]:
        def run(function: Callable[..., Any], *inputs: Any, use_reentrant: bool = False) -> Any:
            # A fresh policy per call: it counts the ops it is asked about.
            return selective_checkpoint(function, *inputs, policy=plan.policy(i), use_reentrant=use_reentrant)

        return run

    use_checkpoint_function(model, [planned(i) for i in range(len(layers))])
    return plan


# ------------------------------------------------------------------------------------ factories
# Each returns (model, (input_ids,), lm_loss, {"labels": input_ids}), the form the command takes.
Made = tuple[nn.Module, tuple[torch.Tensor], Callable[[Any], torch.Tensor], dict[str, Any]]


def _made(model: nn.Module, tokens: torch.Tensor) -> Made:
    return model, (tokens,), lm_loss, {"labels": tokens}


def gpt2_plain() -> Made:
    """GPT-2, no checkpointing."""
    return _made(*gpt2())


def gpt2_transformers() -> Made:
    """GPT-2 with transformers' switch: torch's non-reentrant checkpoint around each block."""
    model, tokens = gpt2()
    model.activation_checkpointing_enable()
    return _made(model, tokens)


def gpt2_ckpt_lab() -> Made:
    """GPT-2 with transformers' switch, ``ckpt_lab.checkpoint`` plugged into it."""
    model, tokens = gpt2()
    return _made(use_checkpoint_function(model, checkpoint), tokens)


def gpt2_scope_mlp() -> Made:
    """GPT-2, each block's MLP inside ``gradient_checkpoint_scope``."""
    model, tokens = gpt2()
    scope_submodules(model, "mlp")
    return _made(model, tokens)


def gpt2_scope_attn() -> Made:
    """GPT-2, each block's attention inside ``gradient_checkpoint_scope``."""
    model, tokens = gpt2()
    scope_submodules(model, "attn")
    return _made(model, tokens)


def gpt2_planned() -> Made:
    """GPT-2, ``ckpt_lab.planner`` at half its budget range over the four blocks, in the switch."""
    model, tokens = gpt2()
    plan_layers(model, tokens, labels=tokens)
    return _made(model, tokens)


VARIANTS: dict[str, Callable[[], Made]] = {
    "plain": gpt2_plain,
    "transformers' switch": gpt2_transformers,
    "ckpt_lab.checkpoint in the switch": gpt2_ckpt_lab,
    "scope around each MLP": gpt2_scope_mlp,
    "scope around each attention": gpt2_scope_attn,
    "planner, half its range": gpt2_planned,
}
