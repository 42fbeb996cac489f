"""``python -m ckpt_lab.exercises list | check NAME FILE... | stubs DIR [NAME...] [--force]``.

* ``list``: one line per exercise: its name, the notebook section, what the file must define;
* ``check NAME FILE...``: grade one file or a class's files and print each report (several files:
  then one summary line per file). Exit status 0 when every file passes, 1 when one does not
  (a check failed, or it is not implemented yet), 2 when one does not load (with the reason);
* ``stubs DIR``: write the stubs (never the solutions) into DIR, to hand out; existing files are
  kept unless ``--force``.
"""

from __future__ import annotations

import argparse
import sys

from ckpt_lab.exercises import EXERCISES, exercise, grade, write_stubs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ckpt_lab.exercises", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the exercises, one line each")
    grading = commands.add_parser("check", help="grade learners' files")
    grading.add_argument("name", help="the exercise, e.g. 02-checkpoint-function (or its number, 02)")
    grading.add_argument("files", nargs="+", help="one learner's file, or a class's")
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
        report = grade(args.name, path)
        reports.append(report)
        print(report, end="\n\n" if len(args.files) > 1 else "\n")
    if len(reports) > 1:
        print("summary:")
        for r in reports:
            passed = sum(o.status == "passed" for o in r.outcomes)
            counted = f" ({passed} of {len(r.outcomes)} checks)" if r.outcomes else ""
            print(f"  {r.status.upper():<16}{counted:<18} {r.shown}")
    return max(r.exit_code for r in reports)


if __name__ == "__main__":
    sys.exit(main())
