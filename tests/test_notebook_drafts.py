"""Notebook 04 teaches what exercise 04-scope grades: its draft cells (tagged ``04-scope-draft``),
assembled into one file as a learner would type them, pass ``04-scope``, and are its reference
solution (``ckpt_lab/exercises/ex04_scope/solution.py``, written by ``tools/notebook_drafts.py``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from ckpt_lab.exercises import exercise, grade
from ckpt_lab.instruments import assert_no_global_state

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("notebook_drafts", ROOT / "tools" / "notebook_drafts.py")
assert _spec is not None and _spec.loader is not None
drafts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(drafts)


def test_the_notebook_has_the_four_drafts_in_cells_a_learner_can_read() -> None:
    cells = drafts.draft_cells(drafts.NOTEBOOK.read_text())
    assert len(cells) >= 4
    assert max(len(cell.strip().splitlines()) for cell in cells) <= 30  # the notebooks' cell limit


def test_the_assembled_drafts_pass_exercise_04_scope(tmp_path: Path) -> None:
    path = tmp_path / "04_scope.py"
    path.write_text(drafts.assemble(drafts.NOTEBOOK.read_text()))
    report = grade("04-scope", path)
    assert report.passed, str(report)
    assert_no_global_state()


def test_the_reference_solution_is_the_assembled_drafts() -> None:
    solution = exercise("04-scope").solution_path
    assert solution == drafts.SOLUTION
    assert solution.read_text() == drafts.assemble(drafts.NOTEBOOK.read_text()), (
        "ex04_scope/solution.py differs from notebook 04's drafts: run python3 tools/notebook_drafts.py"
    )


def test_every_04_scope_failure_names_a_section_of_notebook_04() -> None:
    for check in exercise("04-scope").checks():
        assert check.teaches.startswith("§"), check.id
    for check in exercise("04b-scope").checks():
        assert check.teaches.startswith("§"), check.id


def test_04b_stores_the_peers_own_results_and_no_notebook_says_not_installed() -> None:
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert not [p.name for p in notebooks if "not installed" in p.read_text()]
    cells = json.loads((ROOT / "notebooks" / "04b_scope_appendix_returnn.ipynb").read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    printed = ["".join(o.get("text", "")) for c in code for o in c.get("outputs", [])]
    assert any(text.startswith("peer: returnn 1.20261022.211313") for text in printed)
    peer_cells = [c for c in code if "".join(c["source"]).startswith("run_peer(")]
    assert len(peer_cells) >= 6
    assert all("(peer):" in "".join(c["outputs"][-1].get("text", "")) for c in peer_cells)
    # nbval re-checks them: no peer cell ignores its output.
    assert not [c for c in peer_cells if "nbval-ignore-output" in c.get("metadata", {}).get("tags", [])]


def test_each_failure_names_the_section_that_teaches_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "04_scope.py"  # a scope that recomputes nothing
    path.write_text("import contextlib\n\ngradient_checkpoint_scope = contextlib.nullcontext\n")
    report = grade("04-scope", path)
    failed = report.failed()
    assert len(failed) >= 3, str(report)
    assert all("Taught in notebook 04 §3." in o.message for o in failed), str(report)
