"""One command for a machine with a GPU: every CUDA test, the benchmark's workloads on CUDA, and torch's
allocator peaks beside LiveMemory's, written into one folder.

    make gpu-check OUT=dir
    PYTHONPATH=$PWD python3 -m ckpt_lab.gpu_check --out DIR

It runs with the machine's own Python (3.11 or later, torch, pytest, hypothesis, matplotlib; no
virtual environment, no nbval) and the checkout on ``PYTHONPATH``, and writes only into ``DIR``:

* ``gpu_check.json``: the machine (torch, CUDA, device), the private torch API this torch lacks
  (``ckpt_lab.torch_private``), every CUDA test's outcome, and per workload and strategy the
  benchmark's figures (LiveMemory's retained and peak bytes, gradients, time ratios) beside torch's
  allocator: ``torch.cuda.max_memory_allocated`` and ``torch.cuda.memory_stats()``'s allocated and
  reserved peaks over one training step;
* ``summary.txt``: the same, short; ``pytest.xml`` and ``pytest.log``: the test run.

The tests are those the ``cuda`` mark of tests/oracle.py skips without a GPU (the checkpoints, the
scope, offload, the parity cases, explain's CUDA memory, tests/test_cuda.py), run in a pytest of their
own. The benchmark measures its usual workloads with fewer timing rounds, and starts no workload
once ``--bench-seconds`` have passed, so the whole command stays within about 8 minutes on an H100.
The JSON is rewritten after every step: a run cut short still leaves what it measured.

Without CUDA it says so, runs the same steps on the CPU (every selected test is skipped; one small
workload, one round) and exits 0: a dry run, which tests/test_gpu_check.py runs in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

CHECKOUT = Path(__file__).resolve().parents[1]
TESTS = CHECKOUT / "tests"


# -------------------------------------------------------------------------------------- the machine
def machine() -> dict[str, Any]:
    from ckpt_lab import torch_private

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "private_api_missing": [use.path for use in torch_private.missing()],
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {
            "device": torch.cuda.get_device_name(0),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
            "device_memory_bytes": props.total_memory,
            "devices": torch.cuda.device_count(),
        }
    commit = None
    if shutil.which("git") and (CHECKOUT / ".git").exists():
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=CHECKOUT, capture_output=True, text=True)
        commit = done.stdout.strip() if done.returncode == 0 else None
    info["commit"] = commit
    return info


# ---------------------------------------------------------------------------------------- the tests
class CudaTests:
    """pytest plugin: keep the tests that the ``cuda`` mark of tests/oracle.py skips without a GPU."""

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        from oracle import cuda  # tests/ is on the path (pyproject's pythonpath)

        reason = cuda.kwargs["reason"]

        def needs_cuda(item: Any) -> bool:
            return any(m.name == "skipif" and m.kwargs.get("reason") == reason for m in item.iter_markers())

        kept = [item for item in items if needs_cuda(item)]
        config.hook.pytest_deselected(items=[item for item in items if not needs_cuda(item)])
        items[:] = kept


def _test_files() -> list[Path]:
    """The test files that use the ``cuda`` mark (the others need not even be imported)."""
    return sorted(
        f for f in TESTS.glob("test_*.py") if "@cuda" in (text := f.read_text()) or "marks=cuda" in text
    )


def run_tests(out: Path, timeout: float) -> dict[str, Any]:
    junit, log = out / "pytest.xml", out / "pytest.log"
    files = _test_files()
    with tempfile.TemporaryDirectory(prefix="ckpt_lab-gpu-check-") as scratch:
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(CHECKOUT), *filter(None, [os.environ.get("PYTHONPATH")])]),
            # Nothing written into the checkout: bytecode and pytest's files go to the scratch folder.
            PYTHONPYCACHEPREFIX=str(Path(scratch) / "pycache"),
            MPLBACKEND="Agg",
        )
        code = (
            "import sys, pytest; from ckpt_lab.gpu_check import CudaTests; "
            "sys.exit(pytest.main(sys.argv[1:], plugins=[CudaTests()]))"
        )
        args = ["-c", str(CHECKOUT / "pyproject.toml"), "--rootdir", str(CHECKOUT), "-p", "no:cacheprovider"]
        args += ["-q", "-rfEs", f"--junitxml={junit}", *map(str, files)]
        start = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, "-c", code, *args],
                cwd=scratch,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            exit_code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as expired:
            exit_code = None
            # Bytes here whatever text= says (subprocess's documentation).
            said = [
                o.decode(errors="replace") if isinstance(o, bytes) else o or ""
                for o in (expired.output, expired.stderr)
            ]
            output = "".join(said) + f"\n[timed out after {timeout:.0f} s]"
    log.write_text(output)
    result: dict[str, Any] = {
        "files": [f.name for f in files],
        "exit_code": exit_code,
        "seconds": round(time.perf_counter() - start, 1),
        "tests": _junit_cases(junit) if junit.is_file() else [],
    }
    outcomes = [case["outcome"] for case in result["tests"]]
    result["counts"] = {o: outcomes.count(o) for o in ("passed", "failed", "error", "skipped")}
    return result


def _junit_cases(junit: Path) -> list[dict[str, Any]]:
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        tags = {child.tag: child for child in case}
        outcome = next(
            (o for o, t in (("failed", "failure"), ("error", "error"), ("skipped", "skipped")) if t in tags),
            "passed",
        )
        entry: dict[str, Any] = {
            "test": f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}",
            "outcome": outcome,
            "seconds": float(case.get("time") or 0),
        }
        problem = tags.get("failure", tags.get("error"))
        if problem is not None:
            entry["message"] = (problem.get("message") or "")[:2000]
        properties = case.find("properties")
        if properties is not None:
            entry["properties"] = {p.get("name"): p.get("value") for p in properties.iter("property")}
        cases.append(entry)
    return cases


# ------------------------------------------------------------------------------------ the benchmark
def allocator_peaks(strategy: Any, wl: Any) -> dict[str, int]:
    """One training step of ``strategy`` on ``wl`` with nothing else watching: torch's allocator
    figures, in bytes above what was allocated before the step (gradients included, unlike
    LiveMemory's ``peak_bytes``)."""
    from ckpt_lab.bench.measure import _loss, _zero_grads

    _zero_grads(wl)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    _loss(strategy, wl).backward()
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    peaks = {
        "max_memory_allocated": torch.cuda.max_memory_allocated() - start,
        "memory_stats_allocated_peak": stats["allocated_bytes.all.peak"] - start,
        "memory_stats_reserved_peak": stats["reserved_bytes.all.peak"],
        "allocated_before": start,
    }
    _zero_grads(wl)
    return peaks


def run_bench(device: str, rounds: int, budget: float, dry: bool, report: Any) -> dict[str, Any]:
    from dataclasses import asdict

    from ckpt_lab.bench.measure import Result, check_targets, measure
    from ckpt_lab.bench.workloads import mlp, suite
    from ckpt_lab.strategies import strategies

    # Strategies that leave global state behind (RETURNN's) are measured in a process of their own by
    # the benchmark; not here.
    strats = [s for s in strategies(include_returnn=False) if not s.isolated]
    workloads = [lambda: mlp(2, width=64, batch=8, device=device)] if dry else None
    bench: dict[str, Any] = {"device": device, "rounds": rounds, "budget_seconds": budget, "workloads": {}}
    start = time.perf_counter()
    results: list[Result] = []

    def log(message: str) -> None:
        print(message, flush=True)

    for i, wl in enumerate((w() for w in workloads) if workloads else suite(False, device)):
        if time.perf_counter() - start > budget:
            bench["workloads"][wl.name] = {"skipped": f"the {budget:.0f} s budget was spent"}
            continue
        began = time.perf_counter()
        entry: dict[str, Any] = {}
        try:
            try:
                got = measure(wl, strats, rounds, device, log)
            except Exception:
                # One strategy (or the planner's profiling) broke the whole workload: measure each
                # beside "none" on its own, to keep the others' figures and find the culprit.
                entry["error"] = traceback.format_exc()
                got = []
                for s in strats[1:]:
                    try:
                        pair = measure(wl, [strats[0], s], rounds, device, log)
                    except Exception:
                        entry.setdefault("errors", {})[s.name] = traceback.format_exc()
                        continue
                    got += pair if not got else pair[1:]
            results += got
            allocator: dict[str, Any] = {}
            for s in strats if device == "cuda" else []:
                try:
                    allocator[s.name] = allocator_peaks(s, wl)
                except Exception as error:  # reported beside the strategy, not fatal for the others
                    allocator[s.name] = {"error": f"{type(error).__name__}: {error}"}
            entry["results"] = [
                {k: v for k, v in asdict(r).items() if k != "samples"}
                | {"allocator": allocator.get(r.strategy)}
                for r in got
            ]
        except Exception:
            entry["error"] = traceback.format_exc()
        entry["seconds"] = round(time.perf_counter() - began, 1)
        bench["workloads"][wl.name] = entry
        report(bench)
        del wl
        if i == 0 and dry:
            break
    bench["targets"] = check_targets(results)
    bench["seconds"] = round(time.perf_counter() - start, 1)
    return bench


# -------------------------------------------------------------------------------------- the summary
def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def summary(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"ckpt_lab gpu-check: {'CUDA' if report['cuda'] else 'NO CUDA: a dry run on the CPU'}",
        f"torch {m['torch']} (CUDA {m['cuda']}), Python {m['python']}, {m.get('device', 'cpu')}, "
        f"commit {m['commit']}",
        f"private torch API missing here: {', '.join(m['private_api_missing']) or 'none'}",
    ]
    tests = report.get("tests")
    if tests:
        c = tests["counts"]
        lines.append(
            f"\nCUDA tests ({len(tests['files'])} files, {tests['seconds']:.0f} s, "
            f"exit {tests['exit_code']}): {c['passed']} passed, {c['failed']} failed, "
            f"{c['error']} errors, {c['skipped']} skipped"
        )
        for case in tests["tests"]:
            if case["outcome"] in ("failed", "error"):
                lines.append(f"  {case['outcome'].upper()} {case['test']}: {case.get('message', '')[:300]}")
            for name, value in case.get("properties", {}).items():
                lines.append(f"  {case['test']}: {name} = {value}")
    bench = report.get("bench")
    if bench:
        lines.append(
            f"\nbenchmark on {bench['device']} ({bench.get('seconds', '?')} s, {bench['rounds']} rounds); "
            "MiB; allocator = one step, gradients included; live = LiveMemory, gradients excluded"
        )
        header = (
            f"{'workload':14} {'strategy':22} {'max_alloc':>9} {'stats_pk':>9} {'live_pk':>8} "
            f"{'retained':>8} {'x none':>6} {'x torch-nr':>10} grad"
        )
        lines.append(header)
        for name, entry in bench["workloads"].items():
            if "error" in entry or "errors" in entry:
                last = (entry.get("error") or "").strip().splitlines()[-1:] or ["(see errors)"]
                lines.append(f"{name:14} RAISED {last[0]} {sorted(entry.get('errors', {}))}")
            if "results" not in entry:
                if "skipped" in entry:
                    lines.append(f"{name:14} skipped: {entry['skipped']}")
                continue
            for r in entry["results"]:
                alloc = r["allocator"] or {}
                vs_torch = r["time_vs_torch_nonreentrant"]
                lines.append(
                    f"{name:14} {r['strategy']:22} {_mib(alloc.get('max_memory_allocated')):>9} "
                    f"{_mib(alloc.get('memory_stats_allocated_peak')):>9} {_mib(r['peak_bytes']):>8} "
                    f"{_mib(r['retained_bytes']):>8} {r['time_vs_none']:>6.2f} "
                    f"{'-' if vs_torch is None else f'{vs_torch:.2f}':>10} "
                    f"{'ok' if r['grad_ok'] and r['state_ok'] else 'FAIL ' + r['state_error'][:60]}"
                )
        missed = [t for t in bench.get("targets", []) if not t["ok"]]
        lines.append(
            f"benchmark targets: {len(bench.get('targets', [])) - len(missed)} PASS, {len(missed)} MISS"
        )
        lines += [f"  MISS {t['workload']} {t['target']}: {t['figure']}" for t in missed]
    lines.append(f"\nverdict: {report['verdict']}")
    return "\n".join(lines) + "\n"


def _verdict(report: dict[str, Any]) -> tuple[bool, str]:
    tests, bench = report.get("tests") or {}, report.get("bench") or {}
    problems = []
    counts = tests.get("counts", {})
    if tests.get("exit_code") not in (0, None) and not (counts.get("failed") or counts.get("error")):
        problems.append(f"pytest exited {tests.get('exit_code')}")
    if tests.get("exit_code") is None:
        problems.append("the tests timed out")
    if counts.get("failed") or counts.get("error"):
        problems.append(f"{counts.get('failed', 0)} tests failed, {counts.get('error', 0)} errors")
    if not report["cuda"] and counts.get("skipped", 0) == 0:
        problems.append("no CUDA test was selected (the selection is broken)")
    if report["cuda"] and counts.get("passed", 0) == 0:
        problems.append("no CUDA test passed")
    for name, entry in bench.get("workloads", {}).items():
        if "error" in entry:
            problems.append(f"benchmark {name} raised")
        for r in entry.get("results", []):
            if not (r["grad_ok"] and r["state_ok"]):
                problems.append(f"{name}/{r['strategy']}: gradients or state wrong")
    if problems:
        return False, "; ".join(problems)
    if not report["cuda"]:
        return True, (
            f"dry run worked: {counts.get('skipped', 0)} CUDA tests selected (skipped without CUDA), "
            "every strategy's gradients right on the CPU"
        )
    return True, f"all {counts.get('passed', 0)} CUDA tests passed, every strategy's gradients right"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ckpt_lab.gpu_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and summary.txt")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="cpu: the dry run even where CUDA is")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds per workload (default 3)")
    parser.add_argument("--bench-seconds", type=float, default=240, help="start no workload after this")
    parser.add_argument("--tests-seconds", type=float, default=300, help="time limit of the test run")
    parser.add_argument("--no-tests", action="store_true")
    parser.add_argument("--no-bench", action="store_true")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    if not cuda:
        why = "--device cpu" if torch.cuda.is_available() else "torch.cuda.is_available() is False"
        print(f"gpu-check: no CUDA ({why}): a dry run of the same steps on the CPU", flush=True)
    started = time.perf_counter()
    report: dict[str, Any] = {"cuda": cuda, "machine": machine(), "verdict": "running"}

    def write(_: Any = None) -> None:
        report["seconds"] = round(time.perf_counter() - started, 1)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")

    write()
    if not args.no_tests:
        print("gpu-check: the CUDA tests", flush=True)
        report["tests"] = run_tests(args.out, args.tests_seconds)
        write()
    if not args.no_bench:
        print("gpu-check: the benchmark's workloads", flush=True)
        report["bench"] = {}
        report["bench"] = run_bench(
            "cuda" if cuda else "cpu",
            args.rounds if cuda else 1,
            args.bench_seconds,
            dry=not cuda,
            report=lambda bench: (report.__setitem__("bench", bench), write()),
        )
    ok, report["verdict"] = _verdict(report)
    write()
    try:
        text = summary(report)
    except Exception:  # the JSON is written already; a summary that breaks must not hide it
        text = f"(the summary failed: {traceback.format_exc()})\nverdict: {report['verdict']}\n"
    (args.out / "summary.txt").write_text(text)
    print("\n" + text, end="")
    if not cuda:
        print("no CUDA: the dry run on the CPU " + ("worked" if ok else "FAILED") + "; nothing ran on a GPU")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
