"""``explain`` on a model people really train (GPT-2 from transformers, ``ckpt_lab.cases.real``):
every way to checkpoint it gives the plain step's gradients, and explain's numbers are the
instruments', to the byte, the peak's ledger included."""

from __future__ import annotations

import matplotlib
import pytest
import torch

pytest.importorskip("transformers")

from ckpt_lab.cases.real import VARIANTS, checkpointed_layers, gpt2, use_checkpoint_function
from ckpt_lab.explain import explain
from ckpt_lab.explain.__main__ import main
from ckpt_lab.instruments.memory import measure_memory
from ckpt_lab.instruments.state import assert_no_global_state
from test_explain import check_ledger

matplotlib.use("Agg")

# Smaller than the notebook's model (the same code paths): two blocks, 32 tokens.
SMALL = {"n_layer": 2, "n_embd": 64, "n_head": 2, "seq": 32, "batch": 2, "vocab": 128}


def _small(name: str):
    """The variant ``name`` built on the small model (the factories take no sizes)."""
    from ckpt_lab.cases import real

    original = real.SIZES
    real.SIZES = {**original, **SMALL}
    try:
        return VARIANTS[name]()
    finally:
        real.SIZES = original


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _clear(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


@pytest.mark.parametrize("name", list(VARIANTS))
def test_numbers_match_the_instruments_to_the_byte(name: str) -> None:
    model, inputs, loss_fn, kwargs = _small(name)
    reference = measure_memory(lambda: loss_fn(model(*inputs, **kwargs)))
    _clear(model)
    report = explain(model, *inputs, loss_fn=loss_fn, **kwargs)
    assert_no_global_state()
    assert report.retained_bytes == reference.retained_bytes
    assert report.peak_bytes == reference.peak_bytes
    assert report.peak_bytes_with_grads == reference.peak_bytes_with_grads
    assert report.grad_bytes == reference.grad_bytes
    # The model returns its loss inside its output: counted once, as the loss (a float32 scalar).
    assert (report.loss_bytes, report.output_bytes) == (4, 0)
    assert report.retained_bytes == report.saved_bytes + report.loss_bytes
    timeline = report.timeline
    assert timeline.live_bytes[timeline.backward_start - 1] == report.retained_bytes
    assert sum(h.bytes for h in report.parameters) == sum(p.nbytes for p in model.parameters())
    # Every storage alive at the peak, by role: they add up to measure_memory's peak_bytes.
    check_ledger(report, reference)
    ledger = report.peak_ledger
    assert ledger.phase == "backward"
    if name == "plain":
        # The peak comes early in backward: what the forward kept (the model's own loss among it),
        # and backward's work on the loss and the last layers; nothing re-run.
        assert list(ledger.roles) == ["kept for backward", "made by the loss", "backward temporaries"]
    if name in ("transformers' switch", "ckpt_lab.checkpoint in the switch"):
        # Past the last block's re-run, some weights' gradients are made: listed, not counted.
        assert ledger.not_counted["leaves' gradients"] > 0
        assert any(label.startswith("re-run of checkpoint #2 (") for label in ledger.roles)


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "plain"])
def test_every_variant_gives_the_plain_steps_gradients(name: str) -> None:
    # Dropout is on (GPT-2's 0.1): equal gradients also mean the recomputations drew the same masks.
    plain, inputs, loss_fn, kwargs = _small("plain")
    torch.manual_seed(1)
    loss_fn(plain(*inputs, **kwargs)).backward()
    model, inputs, loss_fn, kwargs = _small(name)
    torch.manual_seed(1)
    explain(model, *inputs, loss_fn=loss_fn, **kwargs)
    expected, got = _grads(plain), _grads(model)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), name


# Which regions explain finds, per variant, and where (the blocks are transformer.h.0 and .1).
REGIONS = {
    "plain": [],
    "transformers' switch": [("checkpoint", "torch.utils.checkpoint", f"transformer.h.{i}") for i in (0, 1)],
    "ckpt_lab.checkpoint in the switch": [("checkpoint", "ckpt_lab.checkpoint", f"transformer.h.{i}")
                                          for i in (0, 1)],
    "scope around each MLP": [("scope", "gradient_checkpoint_scope", f"transformer.h.{i}.mlp")
                              for i in (0, 1)],
    "scope around each attention": [("scope", "gradient_checkpoint_scope", f"transformer.h.{i}.attn")
                                    for i in (0, 1)],
    "planner, half its range": [("checkpoint", "selective checkpoint", f"transformer.h.{i}") for i in (0, 1)],
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_regions_are_named_by_what_made_them_and_where(name: str) -> None:
    model, inputs, loss_fn, kwargs = _small(name)
    report = explain(model, *inputs, loss_fn=loss_fn, **kwargs)
    assert [(r.kind, r.module) for r in report.regions] == [(k, m) for k, _, m in REGIONS[name]]
    assert all(word in r.name for r, (_, word, _) in zip(report.regions, REGIONS[name], strict=True))
    if report.regions:
        assert any(span.kind == "recompute" for span in report.timeline.spans)
    # A checkpoint around a whole block keeps only its inputs; a scope only what comes in from outside.
    if name in ("transformers' switch", "ckpt_lab.checkpoint in the switch") or "scope" in name:
        assert all(r.kept_bytes == 0 for r in report.regions)


def test_the_switch_plugs_one_function_per_layer_and_refuses_a_wrong_count() -> None:
    model, _ = gpt2(**SMALL)
    calls: list[int] = []

    def counting(i):
        def run(function, *args, **kwargs):
            calls.append(i)
            return function(*args)

        return run

    use_checkpoint_function(model, [counting(i) for i in range(2)])
    assert [layer.gradient_checkpointing for layer in checkpointed_layers(model)] == [True, True]
    ids = torch.zeros(1, 8, dtype=torch.long)
    model(ids)
    assert calls == [0, 1]
    with pytest.raises(ValueError, match="3 functions for 2 layers"):
        use_checkpoint_function(model, [counting(i) for i in range(3)])


def test_the_command_takes_a_real_models_factory(tmp_path, monkeypatch, capsys) -> None:
    from ckpt_lab.cases import real

    monkeypatch.setattr(real, "SIZES", {**real.SIZES, **SMALL})
    main(["ckpt_lab.cases.real:gpt2_ckpt_lab", "--plot", str(tmp_path / "gpt2.png")])
    out = capsys.readouterr().out
    assert "2× checkpoint (ckpt_lab.checkpoint) on transformer.h.*" in out
    assert (tmp_path / "gpt2.png").stat().st_size > 0


def test_gpt2s_gelu_keeps_four_hidden_sized_tensors_and_the_fused_one_keeps_one() -> None:
    # gelu_new is Python arithmetic: each mul, add and tanh keeps a tensor the size of the MLP's
    # hidden layer (batch x seq x 4 * n_embd); gelu_pytorch_tanh is one op whose backward reads its
    # input (c_fc's output, kept anyway): only its output (which c_proj keeps) stays in mlp.act.
    hidden = SMALL["batch"] * SMALL["seq"] * 4 * SMALL["n_embd"] * 4  # float32 bytes
    kept = {}
    for activation in ("gelu_new", "gelu_pytorch_tanh"):
        model, ids = gpt2(activation=activation, **SMALL)
        report = explain(model, ids, labels=ids, loss_fn=lambda out: out.loss)
        kept[activation] = sum(r.bytes for r in report.saved if r.module.endswith("mlp.act"))
    assert kept == {"gelu_new": 4 * hidden * SMALL["n_layer"], "gelu_pytorch_tanh": hidden * SMALL["n_layer"]}
