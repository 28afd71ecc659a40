"""A toy optimizer for the loop (`make example`, tests/test_loop.py). Stdlib only.

    toy_optimizer.py RUN_DIR REPORTS_DIR EPOCH STEP [--journal FILE] [--fail-while FILE]
                     [--hold-while FILE]

A real optimizer rewrites the writer's skill from the step's reports. This
one writes runs/<run>/skill.md with one line per step it learned from (how
many reports, how long), so the loop has something to show. Safe to re-run:
the line of a step is replaced, not appended twice, and the file is
renamed into place.

--journal FILE appends one JSON line when it starts and one when it ends;
--fail-while FILE exits 1 while FILE exists (tests of a failing optimizer);
--hold-while FILE waits (up to a minute) while FILE exists before writing
(tests that need the daemon caught while its optimizer runs).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from toy_writer import journal, write_atomically  # this folder is on sys.path (the script's)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("reports_dir", type=Path)
    parser.add_argument("epoch", type=int)
    parser.add_argument("step", type=int)
    parser.add_argument("--journal", default=None)
    parser.add_argument("--fail-while", default=None)
    parser.add_argument("--hold-while", default=None)
    args = parser.parse_args(argv)
    journal(args.journal, "optimizer", event="start", epoch=args.epoch, step=args.step)
    if args.fail_while and os.path.exists(args.fail_while):
        print(f"toy optimizer: {args.fail_while} exists, failing", file=sys.stderr)
        return 1
    deadline = time.monotonic() + 60
    while args.hold_while and os.path.exists(args.hold_while) and time.monotonic() < deadline:
        time.sleep(0.02)
    reports = sorted(p for p in args.reports_dir.glob("*.md") if not p.stem.endswith("_prompt"))
    words = sum(len(p.read_text(encoding="utf-8").split()) for p in reports)
    key = f"epoch {args.epoch} step {args.step}:"
    skill = args.run_dir / "skill.md"
    lines = skill.read_text(encoding="utf-8").splitlines() if skill.exists() else []
    lines = [line for line in lines if not line.startswith(key)]
    lines.append(f"{key} learned from {len(reports)} report(s), {words} words")
    write_atomically(skill, "\n".join(sorted(lines)) + "\n")
    print(f"toy optimizer: {key} {len(reports)} report(s)", flush=True)
    journal(args.journal, "optimizer", event="end", epoch=args.epoch, step=args.step)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
