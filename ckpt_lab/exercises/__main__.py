"""``python -m ckpt_lab.exercises list | check NAME FILE... | stubs DIR [NAME...] [--force]``.

* ``list``: one line per exercise: its name, the notebook section, what the file must define;
* ``check NAME FILE... [--time-limit SECONDS] [--json GRADEBOOK]``: grade one file or a class's
  files and print each report (several files: then one summary line per file). Exit status 0 when
  every file passes, 1 when one does not (a check failed, or it is not implemented yet; the
  learner's code exited, was interrupted or ran past the time limit), 2 when one does not load
  (one line: not a .py file, missing, a folder, a syntax error, an import that fails, a name it
  lacks). ``--json`` writes a gradebook: one row per file, with its checks passed, the total and
  its status;
* ``stubs DIR``: write the stubs (never the solutions) into DIR, to hand out; existing files are
  kept unless ``--force``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ckpt_lab.exercises import DEFAULT_TIME_LIMIT, EXERCISES, Report, exercise, grade, write_stubs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ckpt_lab.exercises", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the exercises, one line each")
    grading = commands.add_parser("check", help="grade learners' files")
    grading.add_argument("name", help="the exercise, e.g. 02-checkpoint-function (or its number, 02)")
    grading.add_argument("files", nargs="+", help="one learner's file, or a class's")
    grading.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT, metavar="SECONDS",
                         help="stop a check after SECONDS, as a runaway loop "
                         f"(default {DEFAULT_TIME_LIMIT:g}; 0: no limit)")
    grading.add_argument("--json", metavar="GRADEBOOK", help="write a gradebook: one row per file (JSON)")
    stubs = commands.add_parser("stubs", help="write the stubs (no solutions) into a folder")
    stubs.add_argument("folder")
    stubs.add_argument("names", nargs="*", help="only these exercises (default: all)")
    stubs.add_argument("--force", action="store_true", help="overwrite existing files")
    args = parser.parse_args(argv)

    if args.command == "list":
        width = max(len(name) for name in EXERCISES)
        sections = {e.name: e.where_taught for e in EXERCISES.values()}
        swidth = max(map(len, sections.values()))
        for e in EXERCISES.values():
            print(f"{e.name:<{width}}  {sections[e.name]:<{swidth}}  {e.defines}")
        return 0
    if args.command == "stubs":
        try:
            written = write_stubs(args.folder, args.names or None, force=args.force)
        except KeyError as error:
            print(error.args[0], file=sys.stderr)
            return 2
        for path in written:
            print(path)
        return 0
    try:
        exercise(args.name)
    except KeyError as error:
        print(error.args[0], file=sys.stderr)
        return 2
    reports = []
    for path in args.files:
        report = grade(args.name, path, args.time_limit or None)
        reports.append(report)
        print(report, end="\n\n" if len(args.files) > 1 else "\n")
    if len(reports) > 1:
        print("summary:")
        for r in reports:
            passed = sum(o.status == "passed" for o in r.outcomes)
            counted = f" ({passed} of {len(r.outcomes)} checks)" if r.outcomes else ""
            print(f"  {r.status.upper():<16}{counted:<18} {r.shown}")
    if args.json:
        Path(args.json).write_text(json.dumps([_row(r) for r in reports], indent=1) + "\n")
    return max(r.exit_code for r in reports)


def _row(report: Report) -> dict[str, object]:
    """The gradebook's row of one file: a file that did not load passed none of the exercise's checks."""
    total = len(report.outcomes) or len(report.exercise.checks())
    return {
        "file": report.shown,
        "exercise": report.exercise.name,
        "checks_passed": sum(o.status == "passed" for o in report.outcomes),
        "checks_total": total,
        "status": report.status,
        "exit_status": report.exit_code,
    }


if __name__ == "__main__":
    sys.exit(main())
