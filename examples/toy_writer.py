"""A toy closed-book writer for the loop (`make example`, tests/test_loop.py). Stdlib only.

    toy_writer.py RUN_DIR EPOCH STEP [--work NAME:EPISODES ...] [--steps-per-epoch K]
                  [--scenes 1,2,3] [--action 0,1,2] [--prev-reports DIR] [--journal FILE]
                  [--fail-while FILE] [--hold-while FILE]

Writes runs/<run>/epoch_EE/step_SS/<work>/scripts/epNN.txt for every
episode of each work, then `_SUCCESS`. It invents its text from a
vocabulary of its own (it never sees an answer key). What it learns is only
the shape: at the run's k-th step (k = EPOCH * K + STEP) each episode has
`--scenes[k]` scenes sharing the same number of dialogue lines, each
opening with `--action[k]` action paragraphs, so schedules like 1,2,3 move
the episodes' craft distance step by step (the last value holds after).
A real writer would read its skill (what the optimizer wrote from the
reports of the step before, --prev-reports); this one only counts them.

Safe to re-run (the daemon may run a step's writer twice after a crash):
the text is a function of (run, epoch, step, work, episode), and each file
is written to a temp name and renamed into place.

--journal FILE appends one JSON line when it starts and one when it ends
(tests count the runs); --fail-while FILE exits 1 while FILE exists;
--hold-while FILE waits (up to a minute) while FILE exists before writing.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

CUES = ["MARA", "JONAH", "THE WARDEN", "ISKRA", "OLD PELL", "DISPATCH"]
PLACES = ["LIGHTHOUSE", "FERRY DECK", "SALT MARSH", "RADIO SHACK", "DRY DOCK", "CHAPEL"]
WORDS = ("oar pewter quay rigging rust sable shingle skiff sorrel spindle tallow thistle "
         "tinder umber vellum wicker willow wren yarrow zinc basalt cormorant dune estuary").split()
LINES_PER_EPISODE = 18


def episode(seed: str, scenes: int, action: int = 0) -> str:
    rng = random.Random(seed)
    per_scene = max(1, LINES_PER_EPISODE // scenes)
    out: list[str] = []
    for n in range(scenes):
        out += [f"{rng.choice(['INT.', 'EXT.'])} {rng.choice(PLACES)} - "
                f"{rng.choice(['DAY', 'NIGHT'])}", ""]
        for _ in range(action):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 18)))
            out += [words.capitalize() + ".", ""]
        for _ in range(per_scene):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12)))
            out += [rng.choice(CUES), words.capitalize() + rng.choice([".", "?", "!"]), ""]
        out += ["CUT TO:" if n + 1 < scenes else "FADE OUT.", ""]
    return "\n".join(out)


def at_step(k: int, schedule: str) -> int:
    values = [int(n) for n in schedule.split(",")]
    return values[min(k, len(values) - 1)]


def write_atomically(path: Path, text: str) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    temp.write_text(text, encoding="utf-8")
    os.replace(temp, path)


def journal(path: str | None, stage: str, **fields: object) -> None:
    """One JSON line per start and end of a stage (the toy optimizer uses it too)."""
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"stage": stage, "pid": os.getpid(), "t": time.time(),
                                **fields}) + "\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("epoch", type=int)
    parser.add_argument("step", type=int)
    parser.add_argument("--work", action="append", default=None, metavar="NAME:EPISODES")
    parser.add_argument("--steps-per-epoch", type=int, default=1)
    parser.add_argument("--scenes", default="1,2,3")
    parser.add_argument("--action", default="0")
    parser.add_argument("--prev-reports", default="")
    parser.add_argument("--journal", default=None)
    parser.add_argument("--fail-while", default=None)
    parser.add_argument("--hold-while", default=None)
    args = parser.parse_args(argv)
    journal(args.journal, "writer", event="start", epoch=args.epoch, step=args.step)
    if args.fail_while and os.path.exists(args.fail_while):
        print(f"toy writer: {args.fail_while} exists, failing", file=sys.stderr)
        return 1
    deadline = time.monotonic() + 60
    while args.hold_while and os.path.exists(args.hold_while) and time.monotonic() < deadline:
        time.sleep(0.02)
    k = args.epoch * args.steps_per_epoch + args.step
    scenes, action = (at_step(k, schedule) for schedule in (args.scenes, args.action))
    step_dir = args.run_dir / f"epoch_{args.epoch:02d}" / f"step_{args.step:02d}"
    for spec in args.work or ["example:6"]:
        work, _, count = spec.partition(":")
        scripts = step_dir / work / "scripts"
        scripts.mkdir(parents=True, exist_ok=True)
        for ep in range(1, int(count) + 1):
            seed = f"{args.run_dir.name}/{args.epoch}/{args.step}/{work}/{ep}"
            write_atomically(scripts / f"ep{ep:02d}.txt", episode(seed, scenes, action))
        (scripts / "_SUCCESS").touch()
    before = len(list(Path(args.prev_reports).glob("*.md"))) if args.prev_reports else 0
    print(f"toy writer: epoch {args.epoch} step {args.step}: {scenes} scene(s) per episode, "
          f"{action} action paragraph(s) per scene "
          f"(the step before left {before} report file(s))", flush=True)
    journal(args.journal, "writer", event="end", epoch=args.epoch, step=args.step)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
