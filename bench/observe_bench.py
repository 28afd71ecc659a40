"""What issue 12's checks cost the scan: observe() now vs before them.

observe() runs for every set at every scan. Issue 12 added two lstat calls
per set (the work and scripts/ folders: symlink out of runs/ or into data/,
a file where the folder should be) and, only for incomplete sets, a listing
of scripts/ (misspelt names). This times observe() over a tree of complete
sets with the current code and with the code before the change (read from
git, same process, interleaved rounds), and prints the ratio.

    .venv/bin/python bench/observe_bench.py [--sets 5000] [--rounds 5] [--base 4c97278]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

from skilltrain.daemon.core.layout import SetKey
from skilltrain.daemon.service import observe

REPO = Path(__file__).resolve().parent.parent


def old_observe(base: str) -> Callable[..., observe.Observation]:
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{base}:daemon/observe.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    module = types.ModuleType("skilltrain.daemon._observe_before")
    module.__dict__["__name__"] = "skilltrain.daemon._observe_before"
    sys.modules[module.__name__] = module
    exec(compile(source, "observe_before.py", "exec"), module.__dict__)
    return module.observe  # type: ignore[no-any-return]


def build(root: Path, sets: int) -> tuple[Path, list[SetKey]]:
    runs = root / "runs"
    keys = []
    for i in range(sets):
        run, step = f"r{i // 500}", (i // 10) % 50
        key = SetKey(run, 1, step, f"w{i % 10}", 1, 3)
        scripts = key.scripts_dir(runs)
        scripts.mkdir(parents=True, exist_ok=True)
        for n in (1, 2, 3):
            (scripts / f"ep{n:02d}.txt").write_text(f"INT. ROOM {i} {n} - DAY\n")
        keys.append(key)
    return runs, keys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sets", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--base", default="4c97278")
    args = parser.parse_args()
    before = old_observe(args.base)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        runs, keys = build(Path(tmp), args.sets)
        data = Path(tmp) / "data"
        data.mkdir()
        best = {"before": float("inf"), "now": float("inf")}
        for _ in range(args.rounds):
            for name, fn in (
                ("before", lambda k: before(k, runs)),
                ("now", lambda k: observe.observe(k, runs, data)),
            ):
                t0 = time.perf_counter()
                for key in keys:
                    assert fn(key).complete
                best[name] = min(best[name], time.perf_counter() - t0)
    per_set = {k: v / args.sets * 1e6 for k, v in best.items()}
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.sets} complete sets, best of {args.rounds} rounds")
    print(f"  before ({args.base}): {best['before']:.3f} s, {per_set['before']:.1f} us/set")
    print(f"  now:              {best['now']:.3f} s, {per_set['now']:.1f} us/set")
    print(f"  ratio now/before: {best['now'] / best['before']:.2f}x; peak RSS {peak_mb:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
