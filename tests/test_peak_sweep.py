"""The peak sweep's plumbing (``python -m ckpt_lab.bench.peak``), on tiny models: every method is
measured and predicted as documented, the targets are checked, the JSON and the picture are written;
and the GPT-2 chain is the model it is cut from.
"""

from __future__ import annotations

import json

import pytest
import torch

from ckpt_lab.bench import peak
from ckpt_lab.bench.workloads import mlp, transformer


def _tiny(quick: bool):
    return [
        lambda: peak.chain_of(mlp(2, width=32, batch=4)),
        lambda: peak.chain_of(transformer(1, d_model=16, nhead=2, seq=8, batch=2)),
    ]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("peak")
    code = peak.main(["--out", str(out), "--no-compile"], chains=_tiny)
    return code, out, json.loads((out / "peak.json").read_text())


def test_cli_succeeds_and_writes_json_and_picture(run):
    code, out, report = run
    assert code == 0
    assert (out / "peak_sweep.png").stat().st_size > 10_000
    assert report["meta"]["seconds"] >= 0 and report["meta"]["torch"] == torch.__version__


def test_every_point_has_measured_and_predicted_numbers(run):
    _, _, report = run
    points = report["points"]
    for model in ("mlp-2", "transformer-1"):
        mine = [p for p in points if p["model"] == model]
        methods = {p["method"] for p in mine}
        assert methods == {"none", "peak planner", "planner"}
        assert len([p for p in mine if p["method"] == "peak planner"]) == len(peak.FRACTIONS)
        for p in mine:
            assert p["peak_bytes"] > p["retained_bytes"] > 0 and p["grads_ok"]
            if p["method"] != "none":
                assert p["predicted_peak"] > 0 and p["predicted_recompute_flops"] == p["recompute_flops"]
            if p["method"] == "peak planner":
                assert p["predicted_peak"] <= p["budget"]


def test_targets_are_reported_and_the_predictions_pass(run):
    _, _, report = run
    targets = report["targets"]
    predictions = [t for t in targets if "of the prediction" in t["target"]]
    assert len(predictions) == 4 and all(t["ok"] for t in predictions)
    assert any("never rises as the budget falls" in t["target"] for t in targets)
    compared = [t for t in targets if t["target"].startswith("at equal recomputation")]
    # One comparison per point of the retained-bytes planner, on each model.
    assert len(compared) == 2 * len(peak.FRACTIONS)
    assert all(t["ok"] or "; " in t["figure"] for t in compared)  # a MISS says why


def test_torch_compile_points_are_measured_inside_the_graphs():
    chain = peak.chain_of(mlp(2, width=32, batch=4))
    result = peak.sweep(chain, fractions=(0.0, 1.0), compile_budgets=(1.0, 0.0))
    compiled = [p for p in result.points if p.method == "torch.compile"]
    assert [p.budget for p in compiled] == [1.0, 0.0]
    assert all(p.peak_bytes > 0 and p.predicted_peak is None for p in compiled)
    assert compiled[0].grads_ok
    # Budget 0 recomputes more than budget 1 and saves less.
    assert compiled[1].recompute_flops > compiled[0].recompute_flops
    assert compiled[1].retained_bytes < compiled[0].retained_bytes
    targets = peak.check_targets(result.points, result.comparisons)
    assert any("pytorch/pytorch#197838" in t["target"] for t in targets)
    assert peak.table(result.points).count("compile ") == 2


def test_the_gpt2_chain_is_the_model():
    chain = peak.gpt2_chain(n_layer=2, n_embd=32, n_head=2, seq=16, batch=2, vocab=64)
    model = chain.model
    torch.manual_seed(3)
    loss = chain.step(chain.input)
    loss.backward()
    ours = [p.grad.clone() for p in chain.params]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    theirs = model(chain.input, labels=chain.input).loss
    theirs.backward()
    assert torch.equal(loss, theirs)
    assert all(torch.equal(a, p.grad) for a, p in zip(ours, chain.params, strict=True))
    assert len(chain.regions) == 3  # the embedding and two blocks; the head is the loss


def test_refresh_site_writes_the_picture_and_the_frontier_page_s_table(tmp_path, monkeypatch):
    """make peak (--refresh-site) writes images/peak_sweep.png and the table the site's frontier page
    includes, docs/results/generated/peak_table.md: here into a stand-in checkout."""
    checkout = tmp_path / "checkout"
    (checkout / "images").mkdir(parents=True)
    (checkout / "docs" / "results" / "generated").mkdir(parents=True)
    monkeypatch.setattr(peak, "in_checkout", lambda *parts: checkout.joinpath(*parts))
    out = tmp_path / "out"
    code = peak.main(["--out", str(out), "--no-compile", "--refresh-site"], chains=_tiny)
    assert code == 0
    assert (checkout / "images" / "peak_sweep.png").stat().st_size > 10_000
    table = (checkout / "docs" / "results" / "generated" / "peak_table.md").read_text()
    assert table == (out / "peak.md").read_text()
    assert table.startswith("| model | method (budgets, largest first) |")


@pytest.mark.parametrize("option", ["--refresh-site", "--refresh-readme"])
def test_refreshing_the_site_is_never_quick(option):
    with pytest.raises(SystemExit):
        peak.main(["--quick", option], chains=_tiny)
