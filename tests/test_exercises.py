"""Tests for ``ckpt_lab.exercises``: each grader against its reference solution, the package's own
implementation where it is one, the untouched stub, and the typical mistakes learners make.

Every mistake is a one-line change (or a few lines) of the reference solution, written to a file
outside the package (so the feedback names its lines, as it does for a learner), graded, and must
fail the check it is aimed at with a message of its own. A mistake the grader let through would be
a grader that says "passed" to a wrong checkpoint.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_lab.exercises import EXERCISES, check, exercise, grade, load_file, write_stubs
from ckpt_lab.exercises.__main__ import main
from ckpt_lab.exercises._grading import Mistake
from ckpt_lab.instruments import assert_no_global_state, measure_memory

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_STUBS = ROOT / "notebooks" / "exercises"

# Every exercise's catalogued mistakes (its folder's mistakes.py).
MISTAKES: dict[str, list[Mistake]] = {name: e.mistakes for name, e in EXERCISES.items()}

CASES = [(name, m) for name, ms in MISTAKES.items() for m in ms]


@functools.cache
def _graded(name: str, label: str, folder: str):
    """Grade the mistake ``label`` of exercise ``name`` (once per session: two tests read it)."""
    e = exercise(name)
    (mistake,) = [m for m in MISTAKES[name] if m.label == label]
    source = e.solution_path.read_text()
    assert mistake.old in source, f"{name}: the reference solution no longer has {mistake.old!r}"
    path = Path(folder) / name / e.file_name
    path.parent.mkdir(parents=True, exist_ok=True)
    # A mistake without `old` is a whole file of its own.
    path.write_text(source.replace(mistake.old, mistake.new, 1) if mistake.old else mistake.new)
    return grade(name, path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("mistakes"))


# ------------------------------------------------------------------------ the graders and their answers
@pytest.mark.parametrize("name", list(EXERCISES))
def test_reference_solution_passes(name: str) -> None:
    report = grade(name, EXERCISES[name].solution_path)
    assert report.passed, str(report)
    assert report.exit_code == 0 and str(report).endswith(f"PASSED: all {len(report.outcomes)} checks.")
    assert_no_global_state()


# Delegation: a file that hands the exercise to torch's or ckpt_lab's own version fails, whatever its checks
# would say, and says what it used, where, and where to learn to write it. (file, a phrase of the message)
DELEGATIONS = {
    "01-requires-grad": [
        ("from ckpt_lab.exercises.ex01_requires_grad.solution import PREDICTIONS, WHY  # noqa: F401\n",
         "your file imports ckpt_lab.exercises.ex01_requires_grad.solution.PREDICTIONS at {f}:1: write it "
         "yourself (notebook 01 §2, §3 and §5)."),
    ],
    "02-checkpoint-function": [
        ("import torch\n\nCheckpointFunction = torch.utils.checkpoint.CheckpointFunction\n",
         "your file uses torch.utils.checkpoint.CheckpointFunction at {f}:3: write it yourself "
         "(notebook 02 §3 and §8)."),
        ("from ckpt_lab.reentrant import CheckpointFunction  # noqa: F401\n",
         "your file imports ckpt_lab.reentrant.CheckpointFunction at {f}:1"),
        ("import importlib\n\nCheckpointFunction = getattr(\n"
         "    importlib.import_module('torch.utils.' + 'checkpoint'), 'CheckpointFunction'\n)\n",
         "your file's `CheckpointFunction` is torch.utils.checkpoint.CheckpointFunction: write it yourself"),
        ("import torch\n\n\nclass CheckpointFunction(torch.utils.checkpoint.CheckpointFunction):\n    pass\n",
         "your file uses torch.utils.checkpoint.CheckpointFunction at {f}:4"),
    ],
    "02b-segments": [
        ("from ckpt_lab import planner\n\n\ndef choose_segments(n_layers, activation_bytes, limit_bytes):\n"
         "    return planner.plan_sequential(n_layers, activation_bytes, limit_bytes)\n",
         "your file calls ckpt_lab.planner.plan_sequential at {f}:5: write it yourself (notebook 02b A)."),
    ],
    "03-pack-unpack": [
        ("from torch.autograd.graph import save_on_cpu\n\n_hooks = save_on_cpu()\n"
         "pack, unpack = _hooks.pack_hook, _hooks.unpack_hook\n",
         "your file calls torch.autograd.graph.save_on_cpu at {f}:3: write it yourself (notebook 03 §3)."),
    ],
    "03b-checkpoint": [
        ("import torch\n\n\ndef checkpoint(function, *args):\n"
         "    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)\n",
         "your file calls torch.utils.checkpoint.checkpoint at {f}:5: write it yourself "
         "(notebook 03b §1 and §2)."),
        ("from ckpt_lab import checkpoint  # noqa: F401\n", "your file imports ckpt_lab.checkpoint at {f}:1"),
    ],
    "04-scope": [
        ("from ckpt_lab.scope_core import gradient_checkpoint_scope  # noqa: F401\n",
         "your file imports ckpt_lab.scope_core.gradient_checkpoint_scope at {f}:1: write it yourself "
         "(notebook 04 §3 and §4)."),
        ("from ckpt_lab import gradient_checkpoint_scope  # noqa: F401\n",
         "your file imports ckpt_lab.gradient_checkpoint_scope at {f}:1"),
    ],
    "04b-scope": [
        ("from ckpt_lab.scope_core import gradient_checkpoint_scope  # noqa: F401\n",
         "your file imports ckpt_lab.scope_core.gradient_checkpoint_scope at {f}:1: write it yourself "
         "(notebook 04b §1 to §11)."),
        ("from ckpt_lab.exercises.ex04_scope.solution import gradient_checkpoint_scope  # noqa: F401\n",
         "your file imports ckpt_lab.exercises.ex04_scope.solution.gradient_checkpoint_scope at {f}:1"),
    ],
    "05-selective-budget": [
        ("from ckpt_lab.planner import solve_dp as knapsack  # noqa: F401\n\n\ndef make_policy(block):\n"
         "    return lambda ctx, op, *args, **kwargs: False\n",
         "your file imports ckpt_lab.planner.solve_dp at {f}:1: write it yourself "
         "(notebook 05 §2.2 and §4)."),
    ],
    "07-memory-target": [
        ("import importlib\n\n"
         "solution = importlib.import_module('ckpt_lab.exercises.ex07_memory_target.solution')\n"
         "CAUSES, make_model = solution.CAUSES, solution.make_model\n",
         "your file's `make_model` is ckpt_lab.exercises.ex07_memory_target.solution.make_model: write it "
         "yourself (notebook 07 §1 and §2)."),
    ],
}
DELEGATION_CASES = [(name, i) for name, cases in DELEGATIONS.items()
                    if name in EXERCISES for i in range(len(cases))]


@pytest.mark.parametrize(("name", "case"), DELEGATION_CASES, ids=[f"{n}-{i}" for n, i in DELEGATION_CASES])
def test_a_file_that_delegates_the_exercise_fails(name: str, case: int, tmp_path: Path) -> None:
    text, says = DELEGATIONS[name][case]
    path = tmp_path / exercise(name).file_name
    path.write_text(text)
    report = grade(name, path)
    assert report.status == "failed" and report.exit_code == 1, str(report)
    first, *rest = report.outcomes
    assert first.check.id == "own-work" and first.status == "failed"
    assert says.format(f=path) in first.message, str(report)
    assert all(o.status == "skipped" for o in rest), "the checks would grade someone else's code"


def test_every_exercise_has_a_delegation_tested() -> None:
    assert set(EXERCISES) <= set(DELEGATIONS)


def test_the_building_blocks_are_not_refused(tmp_path: Path) -> None:
    """saved_tensors_hooks, TorchDispatchMode, fork_rng, Function: how the exercises are done."""
    path = tmp_path / "mine.py"
    path.write_text(
        "import torch\nfrom torch.autograd.graph import saved_tensors_hooks\n"
        "from torch.utils._python_dispatch import TorchDispatchMode\n"
        "from torch.utils.checkpoint import CheckpointError\n\n\n"
        "class CheckpointFunction(torch.autograd.Function):\n    pass\n\n\n"
        "def checkpoint(function, *args):\n"
        "    with torch.random.fork_rng(devices=[]), saved_tensors_hooks(id, id):\n"
        "        return TorchDispatchMode, CheckpointError\n"
    )
    from ckpt_lab.exercises._delegation import CHECKPOINTS, delegations

    assert delegations(path, "mine.py", load_file(path), CHECKPOINTS, "notebook 03b") == []


@pytest.mark.parametrize(("name", "mistake"), CASES, ids=[f"{n}: {m.label}" for n, m in CASES])
def test_each_mistake_is_caught_by_its_check(name: str, mistake: Mistake, folder: str) -> None:
    report = _graded(name, mistake.label, folder)
    assert not report.passed and report.exit_code == 1
    failed = [o.check.id for o in report.failed()]
    assert mistake.check in failed, f"expected `{mistake.check}` to fail, failed: {failed}\n{report}"
    assert mistake.says in report.message(mistake.check), str(report)
    # Whatever the learner's code left behind, the grader put back.
    assert_no_global_state()


@pytest.mark.parametrize("name", [name for name in MISTAKES if name in EXERCISES])
def test_each_mistake_gets_its_own_message(name: str, folder: str) -> None:
    assert len(MISTAKES[name]) >= 3
    messages = [_graded(name, m.label, folder).message(m.check) for m in MISTAKES[name]]
    assert len(set(messages)) == len(messages)


def test_every_exercise_has_mistakes_catalogued() -> None:
    assert set(EXERCISES) <= set(MISTAKES)


# --------------------------------------------------------------------------------------------------- stubs
@pytest.mark.parametrize("name", list(EXERCISES))
def test_an_untouched_stub_is_not_implemented_yet(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    e = exercise(name)
    report = grade(name, e.stub_path)
    assert report.status == "not implemented" and report.exit_code == 1, str(report)
    assert str(report).splitlines()[1].startswith("NOT IMPLEMENTED YET: ")
    assert f"Read notebook {e.notebook} " in str(report)


def test_the_notebooks_stubs_are_the_packages() -> None:
    stubs = {e.file_name: e.stub_path.read_text() for e in EXERCISES.values()}
    found = {p.name: p.read_text() for p in NOTEBOOK_STUBS.glob("*.py")}
    assert found == stubs, (
        "notebooks/exercises/ must hold a copy of each exercise's stub.py, and nothing else; after editing a "
        "stub, run: python -m ckpt_lab.exercises stubs notebooks/exercises --force"
    )


def test_every_exercise_folder_is_found_and_complete() -> None:
    folders = sorted(p.name for p in (ROOT / "ckpt_lab" / "exercises").glob("ex*") if p.is_dir())
    assert folders == [e.folder.name for e in EXERCISES.values()]
    for e in EXERCISES.values():
        # Exercise 04's reference solution is a module of the package (Exercise.reference).
        files = {"grader.py", "stub.py", "mistakes.py"} | ({"solution.py"} if e.reference is None else set())
        assert files <= {p.name for p in e.folder.iterdir()}
        assert e.solution_path.is_file()


def test_a_your_turn_cell_prints_the_same_on_every_run(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """What a notebook's "Your turn" cell stores for an unfilled stub (nbval compares it exactly)."""
    monkeypatch.chdir(ROOT / "notebooks")
    check("02-checkpoint-function", "exercises/02_checkpoint_function.py")
    first = capsys.readouterr().out
    check("02-checkpoint-function", "exercises/02_checkpoint_function.py")
    assert (
        capsys.readouterr().out
        == first
        == (
            "02-checkpoint-function: exercises/02_checkpoint_function.py\n"
            "NOT IMPLEMENTED YET: CheckpointFunction.forward raises NotImplementedError.\n"
            "Read notebook 02 §3 and §8, fill in the file, then check it again.\n"
        )
    )


def test_stubs_writes_the_stubs_and_never_the_solutions(tmp_path: Path) -> None:
    written = write_stubs(tmp_path)
    assert sorted(p.name for p in written) == sorted(e.file_name for e in EXERCISES.values())
    assert all(p.read_text() == exercise_of(p).stub_path.read_text() for p in written)
    assert all("reference solution" not in p.read_text() for p in written)
    (tmp_path / "02_checkpoint_function.py").write_text("# my work\n")
    assert write_stubs(tmp_path) == []  # an existing file is kept
    assert (tmp_path / "02_checkpoint_function.py").read_text() == "# my work\n"
    assert write_stubs(tmp_path, ["02"], force=True) == [tmp_path / "02_checkpoint_function.py"]


def exercise_of(path: Path):
    return next(e for e in EXERCISES.values() if e.file_name == path.name)


# ----------------------------------------------------------------------------------------- the command line
def test_list_prints_one_line_per_exercise_name_section_and_what_to_define(capsys) -> None:
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(EXERCISES)
    for line, e in zip(lines, EXERCISES.values(), strict=True):
        assert line.startswith(e.name + " ")
        assert f"notebook {e.notebook} " in line and line.endswith(e.defines)
    assert any("checkpoint(function, *args)" in line for line in lines)
    assert any("CheckpointFunction" in line for line in lines)


def test_check_exit_codes_pass_fail_and_does_not_load(tmp_path: Path, capsys) -> None:
    e = exercise("02b-segments")
    assert main(["check", e.name, str(e.solution_path)]) == 0
    assert main(["check", e.name, str(e.stub_path)]) == 1
    broken = tmp_path / "broken.py"
    broken.write_text("def choose_segments(n_layers, activation_bytes, limit_bytes:\n")
    assert main(["check", e.name, str(broken)]) == 2
    assert "DID NOT LOAD: SyntaxError at " in capsys.readouterr().out
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    assert main(["check", "02b", str(empty)]) == 2
    assert "defines no `choose_segments`" in capsys.readouterr().out
    assert main(["check", "no-such-exercise", str(empty)]) == 2


def test_check_grades_a_class_and_sums_up(tmp_path: Path, capsys) -> None:
    e = exercise("02b-segments")
    assert main(["check", e.name, str(e.solution_path), str(e.stub_path)]) == 1
    summary = capsys.readouterr().out.split("summary:\n")[1].splitlines()
    assert summary[0].split()[:3] == ["PASSED", "(4", "of"] and summary[1].split()[0] == "NOT"


# --------------------------------------------------------------------- a grader a class can run unattended
def _file(folder: Path, name: str, text: str) -> str:
    path = folder / name
    path.write_text(text)
    return str(path)


def test_sys_exit_in_a_learners_file_never_passes(tmp_path: Path, capsys) -> None:
    at_import = _file(tmp_path, "at_import.py", "import sys\n\nsys.exit(0)\n")
    assert main(["check", "02b", at_import]) == 2
    assert "DID NOT LOAD: the file exited (SystemExit(0)) while it loads, at " in capsys.readouterr().out
    exits = {
        "__import__('sys').exit(0)": "exited (SystemExit(0)) at ",
        "exit()": "exited (SystemExit(None)) at ",
        "__import__('os')._exit(0)": "called os._exit(0) at ",
        "raise KeyboardInterrupt": "raised KeyboardInterrupt at ",
        "raise GeneratorExit": "raised GeneratorExit at ",
    }
    for i, (call, says) in enumerate(exits.items()):
        path = _file(tmp_path, f"inside_{i}.py", f"def choose_segments(n, a, limit):\n    {call}\n")
        assert main(["check", "02b", path]) == 1, call
        out = capsys.readouterr().out
        assert says + f"{path}:2 (in choose_segments)" in out and "FAILED: 0 of 4" in out, out
    assert_no_global_state()


def test_a_file_that_does_not_load_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    solution = exercise("02b").solution_path.read_text()
    (tmp_path / "folder").mkdir()
    cases = {
        _file(tmp_path, "notes.txt", solution): "is not a Python file: its name must end in .py",
        str(tmp_path / "missing.py"): "no such file: ",
        str(tmp_path / "folder"): "is a folder: give the learner's .py file",
        _file(tmp_path, "syntax.py", "def choose_segments(:\n"): "SyntaxError at ",
        _file(tmp_path, "imports.py", "import no_such_module_here\n"): "ModuleNotFoundError at ",
    }
    for path, says in cases.items():
        assert main(["check", "02b", path]) == 2, path
        captured = capsys.readouterr()
        assert captured.out.count("\n") == 1 and "DID NOT LOAD: " in captured.out and says in captured.out
        assert "Traceback" not in captured.out + captured.err


def test_a_runaway_loop_is_stopped_at_the_time_limit(tmp_path: Path, capsys) -> None:
    # A loop that catches Exception does not catch the time limit.
    loop = "def choose_segments(n, a, limit):\n    while True:\n        try:\n            pass\n"
    path = _file(tmp_path, "loop.py", loop + "        except Exception:\n            pass\n")
    assert main(["check", "02b", path, "--time-limit", "0.5"]) == 1
    out = capsys.readouterr().out
    assert f"Stopped after 0.5 s, the time limit of a check: your code was still running at {path}:" in out
    assert "An endless loop?" in out
    at_import = _file(tmp_path, "loop_at_import.py", "while True:\n    pass\n")
    assert main(["check", "02b", at_import, "--time-limit", "0.5"]) == 2
    said = "DID NOT LOAD: Stopped after 0.5 s, the time limit: your code was still running. An endless loop?"
    assert said in capsys.readouterr().out
    assert_no_global_state()


def test_what_the_learners_code_prints_is_captured_and_capped(tmp_path: Path, capsys) -> None:
    path = _file(tmp_path, "chatty.py", "print('loading')\n\n\ndef choose_segments(n, a, limit):\n"
                 "    for i in range(10_000):\n        print(i)\n    return 1\n")
    report = grade("02b", path)
    printed = report.outcomes[0].printed.splitlines()
    assert printed[:3] == ["0", "1", "2"] and len(printed) == 11
    # 48,890 characters per call of choose_segments; the check calls it once per case.
    total = int(printed[-1].removeprefix("... (").split()[0].replace(",", ""))
    assert total % 48_890 == 0 and printed[-1].endswith(" characters printed in all; the first shown)")
    assert "  (printed while loading) loading" in str(report)
    assert capsys.readouterr().out == ""  # nothing reached the page but the report


def test_a_class_ends_with_one_line_per_file_and_writes_a_gradebook(tmp_path: Path, capsys) -> None:
    import json

    e = exercise("02b")
    wrong = _file(tmp_path, "wrong.py", "def choose_segments(n, a, limit):\n    return 5\n")
    files = [str(e.solution_path), wrong, _file(tmp_path, "broken.py", "def choose_segments(:\n")]
    gradebook = tmp_path / "gradebook.json"
    assert main(["check", e.name, *files, "--json", str(gradebook)]) == 2
    summary = capsys.readouterr().out.rstrip("\n").split("summary:\n")[1].splitlines()
    assert [line.split()[0] for line in summary] == ["PASSED", "FAILED", "DID"]
    assert [line.split()[-1] for line in summary] == files
    rows = json.loads(gradebook.read_text())
    got = [(r["file"], r["checks_passed"], r["checks_total"], r["status"], r["exit_status"]) for r in rows]
    assert got == [
        (files[0], 4, 4, "passed", 0), (files[1], 0, 4, "failed", 1), (files[2], 0, 4, "did not load", 2)
    ]


def test_python_dash_m_runs_the_command_line() -> None:
    out = subprocess.run([sys.executable, "-m", "ckpt_lab.exercises", "list"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout  # fmt: skip
    assert out.splitlines()[0].startswith("01-requires-grad ")


def test_a_learners_file_loads_fresh_each_time(tmp_path: Path) -> None:
    path = tmp_path / "mine.py"
    path.write_text("VALUE = 1\n")
    assert load_file(path).VALUE == 1
    path.write_text("VALUE = 2\n")
    assert load_file(path).VALUE == 2


# ------------------------------------------------------------------------------ numbers the stubs state
def test_exercise_05_target_is_the_planners_optimum_at_the_budget() -> None:
    from ckpt_lab import planner
    from ckpt_lab.exercises.ex05_selective_budget import grader as ex05

    torch.manual_seed(0)
    blocks = [ex05.make_block() for _ in range(ex05.BLOCKS)]
    x = torch.randn(ex05.BATCH, ex05.WIDTH_IN, requires_grad=True)
    # The planner's budget counts every block's input (the first one too) and no loss.
    inputs = ex05.BLOCKS * ex05.BATCH * ex05.WIDTH_IN * 4
    budget = ex05.BUDGET - ex05.BOUNDARY_BYTES - ex05.LOSS_BYTES + inputs
    plan = planner.plan_sequential(blocks, x, budget=budget)
    assert plan.recompute_cost == ex05.TARGET_RECOMPUTE
    assert plan.retained_bytes == budget


def test_exercise_07_stub_keeps_and_peaks_as_it_says_and_the_fix_meets_the_targets_exactly() -> None:
    from ckpt_lab.exercises.ex07_memory_target import grader as ex07

    def step(path: Path) -> tuple[int, int]:
        model, x, loss_fn = load_file(path).make_model()
        report = measure_memory(lambda: loss_fn(model(x)))
        return report.retained_bytes, report.peak_bytes

    stub = exercise("07").stub_path
    kept, peak = step(stub)
    said = " ".join(stub.read_text().split())
    assert f"keeps {kept:,} bytes after the forward and peaks at {peak:,}" in said
    assert step(exercise("07").solution_path) == (ex07.KEPT_TARGET, ex07.PEAK_TARGET)


def test_exercise_03_chain_keeps_what_the_stub_says_without_hooks() -> None:
    from ckpt_lab.exercises.ex03_pack_unpack import grader as ex03

    x = torch.randn(1000, requires_grad=True)
    assert measure_memory(lambda: ex03._sin_chain(x).sum()).retained_bytes == 20_004
    said = " ".join(exercise("03").stub_path.read_text().split())
    assert "(1,000 floats: 20,004 bytes without hooks)" in said
