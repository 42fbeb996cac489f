"""``make compat TORCH=...`` (tools/compat.py): its plumbing, without installing anything.

The real run (a second torch, gigabytes of wheels) is not part of CI; here: the commands a dry run
prints, the summary read from pytest's report, and one small run with this interpreter as it is,
which must leave the checkout exactly as it found it.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch

CHECKOUT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("compat", CHECKOUT / "tools" / "compat.py")
compat = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compat)


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHECKOUT / "tools" / "compat.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def test_the_dry_run_prints_an_environment_outside_the_checkout_and_installs_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    done = _run("--torch", "2.14.1", "--dry-run", env={"XDG_CACHE_HOME": str(cache), "PATH": ""})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    venv = cache / "ckpt_lab" / f"venv-torch-2.14.1-py{sys.version_info[0]}.{sys.version_info[1]}"
    commands = [shlex.split(line[2:]) for line in lines if line.startswith("+ ")]
    assert commands[0] == [sys.executable, "-m", "venv", str(venv)]
    python = str(venv / "bin" / "python")
    assert commands[1] == [python, "-m", "pip", "install", "--quiet", "torch==2.14.1"]
    # Which pins contradict torch's own requirements, asked inside the environment.
    assert commands[2][:3] == [python, "-c", "<tools/compat.py: _CONFLICTS>"]
    rest_file = str(venv / "requirements-rest.txt")
    assert commands[3] == [python, "-m", "pip", "install", "--quiet", "-r", rest_file]
    # The rest of requirements.txt, as pinned, and torch again: the resolver may not swap it.
    rest = next(line for line in lines if line.startswith(f"# {rest_file}"))
    pins = rest.split(": ", 1)[1].split(" (")[0].split()
    assert "pytest==9.2.0" in pins and [p for p in pins if p.split("==")[0] == "torch"] == ["torch==2.14.1"]
    pytest_line = next(line for line in lines if " -m pytest " in line)
    # From a scratch folder outside the checkout, with the checkout on the path and its bytecode elsewhere.
    assert f"PYTHONPATH={CHECKOUT}" in pytest_line and "PYTHONPYCACHEPREFIX=" in pytest_line
    assert f"--rootdir {CHECKOUT}" in pytest_line and f"{CHECKOUT}/tests" in pytest_line
    assert pytest_line.startswith("+ (cd /") and not pytest_line.startswith(f"+ (cd {CHECKOUT}")
    assert "dry run: nothing was installed or run" in done.stdout
    assert not cache.exists()


def test_an_environment_inside_the_checkout_is_refused() -> None:
    done = _run("--torch", "2.14.1", "--dry-run", "--venv", str(CHECKOUT / "venv-x"))
    assert done.returncode == 2 and "is inside the checkout" in done.stderr


def test_outcomes_per_file_from_pytest_s_report(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_scope" name="a"/>'
        '<testcase classname="tests.test_scope" name="b"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_torch_parity.T" name="c"><skipped type="pytest.skip"/></testcase>'
        '<testcase classname="tests.test_torch_parity" name="d"><skipped type="pytest.xfail"/></testcase>'
        '<testcase classname="tests.test_offload" name="e"><error message="y"/></testcase>'
        "</testsuite></testsuites>"
    )
    counts = compat.per_file(junit)
    assert counts == {
        "tests/test_scope.py": Counter(passed=1, failed=1),
        "tests/test_torch_parity.py": Counter(skipped=1, xfailed=1),
        "tests/test_offload.py": Counter(error=1),
    }
    table = compat.table(counts).splitlines()
    assert table[0].split() == ["file", *compat.OUTCOMES]
    assert table[-1].split() == ["total", "1", "1", "1", "1", "1"]


def test_a_run_with_this_interpreter_reports_and_leaves_the_checkout_clean(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    done = _run(
        "--interpreter",
        sys.executable,
        "--tests",
        "tests/test_grad_rule.py",
        "--pytest-args",
        "-k test_an_input_returned_as_is_comes_back_as_a_new_tensor",
        "--json",
        str(summary),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "compat summary: torch " in done.stdout
    report = json.loads(summary.read_text())
    assert report["per_file"] == {"tests/test_grad_rule.py": {"passed": 1}}
    assert report["pytest_exit_code"] == 0
    assert report["torch"] == torch.__version__
    # git is asked before and after (here a checkout with .git): nothing appeared, ignored files included.
    if (CHECKOUT / ".git").exists():
        assert report["checkout_changes"] == [] and "checkout unchanged" in done.stdout
