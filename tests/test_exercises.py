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
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ckpt_lab.exercises import EXERCISES, check, exercise, grade, load_file, write_stubs
from ckpt_lab.exercises.__main__ import main
from ckpt_lab.instruments import assert_no_global_state, measure_memory

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_STUBS = ROOT / "notebooks" / "exercises"


@dataclass(frozen=True)
class Mistake:
    label: str
    old: str  # in the reference solution
    new: str
    check: str  # the check that must catch it
    says: str  # a phrase of that check's message that tells this mistake apart


MISTAKES: dict[str, list[Mistake]] = {
    "01-requires-grad": [
        Mistake(
            "apply under no_grad still records",
            '    "c": False,',
            '    "c": True,',
            "predictions",
            "case c: with torch.no_grad()",
        ),
        Mistake(
            "an input returned as it is keeps its flag",
            '    "f": True,',
            '    "f": False,',
            "predictions",
            "case f: Select.apply",
        ),
        Mistake(
            "parameters count as arguments",
            '    "h": False,',
            '    "h": True,',
            "predictions",
            "case h: torch.utils.checkpoint",
        ),
        Mistake("the wrong reason", 'WHY = {"h": "B"}', 'WHY = {"h": "A"}', "explanation", 'WHY["h"] = "A"'),
        Mistake("a string for a bool", '    "a": True,', '    "a": "True",', "answered", "'True' is a str"),
    ],
    "02-checkpoint-function": [
        Mistake(
            "saves the block's intermediates (forward keeps its graph)",
            "        return run_function(*args)\n",
            "        with torch.enable_grad():\n"
            "            ctx.outputs = run_function(*[t.detach().requires_grad_() for t in args])\n"
            "        return ctx.outputs.detach()\n",
            "keeps-only-inputs",
            "keeps 4 tensors made by the block",
        ),
        Mistake(
            "does not detach the inputs in the re-run",
            "        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]\n",
            "        inputs = list(ctx.saved_tensors)\n",
            "gradients",
            "x's gradient was added twice",
        ),
        Mistake(
            "forgets the RNG replay",
            "                torch.set_rng_state(ctx.rng_state)\n",
            "                pass\n",
            "dropout",
            "drew new dropout masks",
        ),
        Mistake(
            "re-runs under no_grad",
            "            with torch.enable_grad():",
            "            with torch.no_grad():",
            "re-run",
            "re-ran the block with grad mode off",
        ),
        Mistake(
            "restores the RNG without a fork",
            "        with torch.random.fork_rng(devices=[]):",
            "        if True:",
            "random-stream",
            "random stream was rewound",
        ),
        Mistake(
            "autograd.grad for the inputs only (draft 1)",
            "        torch.autograd.backward(outputs, grads)\n"
            "        return (None, None, *(t.grad for t in inputs))\n",
            "        return (None, None, *torch.autograd.grad(outputs, inputs, grads))\n",
            "gradients",
            "None of the block's parameters got a gradient",
        ),
    ],
    "02b-segments": [
        Mistake(
            "√n whatever the limit",
            "    for s in range(1, n_layers + 1):\n"
            "        if n_layers % s == 0 and (s - 1 + n_layers // s) * activation_bytes <= limit_bytes:\n"
            "            return s\n    return None\n",
            "    return min((s for s in range(1, n_layers + 1) if n_layers % s == 0), "
            "key=lambda s: abs(s * s - n_layers))\n",
            "fewest-runs",
            "√n minimises memory, not re-runs",
        ),
        Mistake(
            "the largest s that fits",
            "    for s in range(1, n_layers + 1):",
            "    for s in range(n_layers, 0, -1):",
            "fewest-runs",
            "the largest s that fits",
        ),
        Mistake(
            "s + n/s: the last segment counted as checkpointed",
            "(s - 1 + n_layers // s)",
            "(s + n_layers // s)",
            "none",
            "you answered None, but s=4 keeps 7 activations",
        ),
        Mistake(
            "forgets s = 1 (no checkpoint)",
            "    for s in range(1, n_layers + 1):",
            "    for s in range(2, n_layers + 1):",
            "fewest-runs",
            "s=1 fits too (16 activations)",
        ),
        Mistake(
            "the limit taken for activations, not bytes",
            "* activation_bytes <= limit_bytes",
            "<= limit_bytes",
            "fits",
            "s=1 keeps 8,192 B = 16 activations",
        ),
    ],
    "03-pack-unpack": [
        Mistake(
            "pack keeps the tensor as it is",
            "    return tensor.dtype, tensor.to(torch.bfloat16)",
            "    return tensor.dtype, tensor",
            "bytes",
            "20,004 B stay alive",
        ),
        Mistake(
            "unpack does not cast back",
            "    return tensor.to(dtype)",
            "    return tensor",
            "unpack-returns",
            "unpack returned bf16[1000] on cpu for f32[1000]",
        ),
        Mistake(
            "compresses to an integer type",
            "tensor.to(torch.bfloat16)",
            "tensor.to(torch.uint8)",
            "gradient",
            "relative error 0.544",
        ),
        Mistake(
            "a debugging list keeps every saved tensor",
            "def pack(tensor):\n",
            "SEEN = []\n\n\ndef pack(tensor):\n    SEEN.append(tensor)  # for debugging\n",
            "bytes",
            "30,004 B stay alive",
        ),
    ],
    "03b-checkpoint": [
        Mistake(
            "every unpack re-runs the function (unpacking again and again)",
            "        if position not in recomputed:",
            "        if True:",
            "re-run",
            "Each unpack re-ran it",
        ),
        Mistake(
            "keeps the recomputed tensors after use",
            "        return recomputed.pop(position)",
            "        return recomputed[position]",
            "frees-after-use",
            "still holds 5 tensors its re-run made",
        ),
        Mistake(
            "pushes the hooks without popping them on error",
            "    with saved_tensors_hooks(pack, unpack):\n        return function(*args)\n",
            "    hooks = saved_tensors_hooks(pack, unpack)\n    hooks.__enter__()\n"
            "    out = function(*args)\n    hooks.__exit__(None, None, None)\n    return out\n",
            "error-leaves-nothing",
            "a saved-tensor hook is still on the stack",
        ),
        Mistake(
            "forgets the RNG replay",
            "            torch.set_rng_state(rng_state)\n",
            "            pass\n",
            "dropout",
            "The re-run drew new dropout masks",
        ),
        Mistake(
            "re-runs under no_grad",
            "            with torch.enable_grad(), saved_tensors_hooks",
            "            with torch.no_grad(), saved_tensors_hooks",
            "re-run",
            "ran the block with grad mode off",
        ),
        Mistake(
            "pack keeps the tensor (no checkpoint at all)",
            "        return count - 1  # autograd stores the ticket, not the tensor",
            "        return tensor",
            "keeps-only-inputs",
            "Its pack hook should store a ticket",
        ),
    ],
    "05-selective-budget": [
        Mistake(
            "a greedy knapsack",
            "    best = {0: (0, frozenset())}\n",
            "    chosen, left = set(), capacity\n"
            "    for key, nbytes, cost in sorted(items, key=lambda i: -i[2] / max(i[1], 1e-9)):\n"
            "        if nbytes <= left:\n            chosen.add(key)\n            left -= nbytes\n"
            "    return chosen\n    best = {0: (0, frozenset())}\n",
            "knapsack-optimal",
            "greedy, not exact",
        ),
        Mistake(
            "a strict < in the knapsack",
            "if total <= capacity and",
            "if total < capacity and",
            "knapsack-optimal",
            "`<` for `<=`?",
        ),
        Mistake(
            "the knapsack returns positions",
            "    return set(max(best.values(), key=lambda v: v[0])[1])",
            "    chosen = max(best.values(), key=lambda v: v[0])[1]\n"
            "    return {i for i, item in enumerate(items) if item[0] in chosen}",
            "knapsack-keys",
            "not their positions",
        ),
        Mistake(
            "keeps every matmul",
            '        return (block, f"{name} {seen[name]}") in KEEP',
            '        return name == "addmm"',
            "policy-budget",
            "The first one over the budget",
        ),
        Mistake(
            "a counter shared by every call",
            'def make_policy(block):\n    seen = {"addmm": 0, "gelu": 0}',
            'SEEN = {"addmm": 0, "gelu": 0}\n\n\ndef make_policy(block):\n    seen = SEEN',
            "policy-steady",
            "in the first training step and 0 B in the second",
        ),
        Mistake(
            "keeps only the costliest matmul",
            '        return (block, f"{name} {seen[name]}") in KEEP',
            '        return name == "addmm" and seen[name] == 2',
            "policy-recompute",
            "Backward recomputes 3,194,880 FLOPs",
        ),
    ],
    "07-memory-target": [
        Mistake(
            "only the log fixed: the whole function still checkpointed",
            "        last = len(self.blocks) - 1\n        for i, block in enumerate(self.blocks):\n"
            "            x = block(x) if i == last else checkpoint(block, x)\n        return x\n",
            "        return checkpoint(self.run_blocks, x)\n",
            "peak",
            "The step peaks at 335,876 B",
        ),
        Mistake(
            "only the checkpoints moved: the log keeps the activations",
            "        if not in_backward():  # a re-run in backward calls the hook again: "
            "log the forward only\n"
            "            self.logged.append(output.detach().abs().mean().item())  "
            "# a number keeps no tensor alive\n",
            "        self.logged.append(output)\n",
            "kept",
            "212,992 B stay alive",
        ),
        Mistake(
            "logs detached tensors",
            "            self.logged.append(output.detach().abs().mean().item())",
            "            self.logged.append(output.detach())",
            "logging",
            "entry 0 is a whole tensor",
        ),
        Mistake(
            "logs in the re-runs too",
            "        if not in_backward():  # a re-run in backward calls the hook again: "
            "log the forward only\n",
            "        if True:\n",
            "logging",
            "holds 7 entries",
        ),
        Mistake(
            "removes the checkpoints",
            "            x = block(x) if i == last else checkpoint(block, x)",
            "            x = block(x)",
            "kept",
            "311,296 B stay alive",
        ),
        Mistake(
            "removes the log",
            "            self.logged.append(output.detach().abs().mean().item())",
            "            pass",
            "logging",
            "holds 0 entries",
        ),
        Mistake("names the wrong causes", "CAUSES = {1, 2}", "CAUSES = {3}", "causes", "Not a cause here: 3"),
    ],
}

# Exercise 04's mistakes are whole files (its reference solution is the package's scope core): notebook
# 04's two drafts, a scope that recomputes nothing, and the shipped scope without its RNG replay.
_DRAFT_1 = '''"""Notebook 04's draft 1: record, hand out handles, replay; the hooks popped at __exit__."""

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode


class Made(int):
    """A tensor argument made by the scope, recorded as the position of the op that made it."""


class gradient_checkpoint_scope(TorchDispatchMode):  # noqa: N801
    def __enter__(self):
        self.tape, self.made = [], {}
        self.hooks = saved_tensors_hooks(self.pack, self.unpack)
        self.hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.hooks.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tape.append((func, [self.pack(v) if isinstance(v, torch.Tensor) else v for v in args], kwargs))
        self.made[id(out.untyped_storage())] = Made(len(self.tape) - 1)
        return out

    def pack(self, tensor):
        return self.made.get(id(tensor.untyped_storage()), tensor)

    def unpack(self, packed):
        if type(packed) is not Made:
            return packed
        values = []
        with torch.no_grad():
            for func, args, kwargs in self.tape:
                values.append(func(*[values[v] if type(v) is Made else v for v in args], **(kwargs or {})))
        return values[packed]
'''
_DRAFT_2 = _DRAFT_1.replace(
    "        super().__exit__(*exc)\n        self.hooks.__exit__(*exc)\n",
    "        super().__exit__(*exc)  # stop recording only: the hooks stay, for tensors used later\n",
)
MISTAKES["04-scope"] = [
    Mistake(
        "stores everything (a scope that recomputes nothing)",
        "",
        "import contextlib\n\n\ndef gradient_checkpoint_scope():\n    return contextlib.nullcontext()\n",
        "api-page-example",
        "yet its memory is still alive after y = x * c",
    ),
    Mistake(
        "forgets the RNG replay",
        "",
        "import functools\n\nfrom ckpt_lab import gradient_checkpoint_scope as scope\n\n"
        "gradient_checkpoint_scope = functools.partial(scope, preserve_rng_state=False)\n",
        "dropout",
        "dropout in the scope",
    ),
    Mistake(
        "pops its hooks at __exit__ (notebook 04's draft 1)",
        "",
        _DRAFT_1,
        "hooks-released",
        "no hook is on the stack: x * c would store x",
    ),
    Mistake(
        "leaves its hooks on the stack (notebook 04's draft 2)",
        "",
        _DRAFT_2,
        "enclosing-hooks",
        "the enclosing hook packed []",
    ),
]

CASES = [(name, m) for name, ms in MISTAKES.items() for m in ms if name in EXERCISES]


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


# The package's own implementations, in a learner's file: the graders hold them to the same checks.
PACKAGE_AS_SOLUTION = {
    "02-checkpoint-function": "from ckpt_lab.reentrant import CheckpointFunction  # noqa: F401\n",
    "03b-checkpoint": "from ckpt_lab import checkpoint  # noqa: F401\n",
    "04-scope": "from ckpt_lab import gradient_checkpoint_scope  # noqa: F401\n",
}


@pytest.mark.parametrize("name", [name for name in PACKAGE_AS_SOLUTION if name in EXERCISES])
def test_the_package_passes_its_own_exercise(name: str, tmp_path: Path) -> None:
    path = tmp_path / exercise(name).file_name
    path.write_text(PACKAGE_AS_SOLUTION[name])
    report = grade(name, path)
    assert report.passed, str(report)


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
    stubs = {p.name: p.read_text() for p in (ROOT / "ckpt_lab" / "exercises" / "stubs").glob("*.py")}
    assert {e.file_name for e in EXERCISES.values()} <= set(stubs)
    found = {p.name: p.read_text() for p in NOTEBOOK_STUBS.glob("*.py")}
    assert found == stubs, "notebooks/exercises/ must hold the package's stubs (ckpt_lab/exercises/stubs/)"


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
    from ckpt_lab.exercises import ex05_selective_budget as ex05

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
    from ckpt_lab.exercises import ex07_memory_target as ex07

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
    from ckpt_lab.exercises import ex03_pack_unpack as ex03

    x = torch.randn(1000, requires_grad=True)
    assert measure_memory(lambda: ex03._sin_chain(x).sum()).retained_bytes == 20_004
    said = " ".join(exercise("03").stub_path.read_text().split())
    assert "(1,000 floats: 20,004 bytes without hooks)" in said
