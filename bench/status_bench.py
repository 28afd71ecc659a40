"""`skilltrain status` at scale (issue 28): wall time and lines, against the alternatives.

    .venv/bin/python bench/status_bench.py [--sets 20000 100000] [--repeat 5] [--base REF]

For each size, a state database written by the daemon's own store (records
with fingerprints, as after a scan; runs of 2,000 sets, 10 sets per step,
0.1 % failed and 0.1 % refused), then, each the median of --repeat runs in a
fresh process (what a person typing the command waits for):
- `status` (the default view), `status RUN`, `status --all`, `status --json`;
- the daemon's own counts: StateStore.load() + counts() of the same database,
  what a daemon pays to know them at start (in-process, after imports),
  and whether status's totals equal them;
- `python -c pass`, the floor of any command;
- with --base REF, `status` of that commit (git archive into a temp folder):
  the implementation before this one, which loaded every set, on a copy of
  the database in the schema it reads (version 1: the same rows, without
  the indexed columns); and today's `status` on that copy (a daemon of
  before still running: the rows are copied into memory).
No runs/ tree is built: status reads only the state, the lock and run records.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skilltrain.daemon.infra.state import SetState, StateStore  # noqa: E402

HEX = "0123456789abcdef" * 4
SETS_PER_RUN, SETS_PER_STEP = 2000, 10


def build(runs: Path, n: int) -> None:
    store = StateStore(runs)
    store.load()
    for k in range(n):
        run, i = divmod(k, SETS_PER_RUN)
        step = i // SETS_PER_STEP
        set_id = (f"r{run:02d}/epoch_{step // 20:02d}/step_{step % 20:02d}/"
                  f"w{i % SETS_PER_STEP:02d}/01-05")
        state, reason = SetState.DONE, None
        if k % 1000 == 7:
            state, reason = SetState.FAILED, "InternalServerError (HTTP 500)"
        elif k % 1000 == 503:
            state, reason = SetState.REFUSED, "ep03.txt is empty"
        store.update(set_id, state, reason=reason, attempts=5 if state == SetState.FAILED else 0,
                     fingerprint={"sigs": f"{k:016x}", "human": HEX, "template": HEX,
                                  "model_id": "openai/gpt-4o-mini"})
        if i % SETS_PER_STEP == SETS_PER_STEP - 1:
            rec = store.step(set_id.rsplit("/", 2)[0])
            rec.reported_at, rec.optimizer_done, rec.optimizer_exit_code = time.time(), True, 0
    for run in range((n + SETS_PER_RUN - 1) // SETS_PER_RUN):
        (runs / f"r{run:02d}").mkdir(parents=True, exist_ok=True)
        store.add_spend(f"r{run:02d}", 2_000_000, 200_000, 0, 12.5)
    store.flush(force=True)
    store.close()


def timed(argv: list[str], repeat: int, env: dict[str, str] | None = None) -> tuple[float, int]:
    """Median wall seconds of `argv`, and the lines it printed."""
    walls, lines = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = subprocess.run(argv, check=True, capture_output=True, env=env).stdout
        walls.append(time.perf_counter() - t0)
        lines = out.count(b"\n")
    return statistics.median(walls), lines


def version_1_copy(runs: Path, to: Path) -> Path:
    """The state database as schema version 1 had it (what --base's status reads)."""
    path = to / "state.sqlite3"
    to.mkdir(parents=True)
    shutil.copy(runs / ".skilltrain" / "state.sqlite3", path)
    conn = sqlite3.connect(path, isolation_level=None)
    for statement in ("DROP INDEX sets_by_step", "DROP INDEX sets_by_state",
                      "ALTER TABLE sets DROP COLUMN step", "ALTER TABLE sets DROP COLUMN state",
                      "ALTER TABLE sets DROP COLUMN updated_at", "PRAGMA user_version = 1",
                      "VACUUM"):
        conn.execute(statement)
    conn.close()
    return path


def daemon_counts(runs: Path) -> tuple[float, dict[str, int]]:
    t0 = time.perf_counter()
    store = StateStore(runs)
    store.load()
    counts = dict(store.counts())
    took = time.perf_counter() - t0
    store.close()
    return took, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", type=int, nargs="+", default=[20000, 100000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--base", default=None, help="git ref of the status to compare with")
    args = parser.parse_args(argv)
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="status-bench-", dir="/var/tmp") as tmp:
        base_env = None
        if args.base:
            base = Path(tmp) / "base" / "skilltrain"
            base.mkdir(parents=True)
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
            base_env = {**os.environ, "PYTHONPATH": str(base.parent)}
        floor, _ = timed([py, "-c", "pass"], args.repeat)
        print(f"python -c pass: {floor * 1000:.0f} ms")
        print(f"{'sets':>7} {'view':<14} {'wall ms':>8} {'lines':>7} {'x pass':>7} "
              f"{'x daemon counts':>15}")
        for n in args.sets:
            runs = Path(tmp) / f"runs{n}"
            build(runs, n)
            config = Path(tmp) / f"config{n}.toml"
            config.write_text(f'[paths]\nruns = "{runs}"\ndata = "{ROOT / "data"}"\n')
            load_s, counts = daemon_counts(runs)
            cli = [py, "-m", "skilltrain", "status", "--config", str(config)]
            shown = json.loads(subprocess.run([*cli, "--json"], check=True,
                                              capture_output=True).stdout)
            agree = "agree" if shown["totals"] == counts else f"DIFFER {shown['totals']}"
            print(f"{n:>7} {'daemon counts':<14} {load_s * 1000:>8.0f} {'':>7} "
                  f"{load_s / floor:>6.1f}x {'1.00x':>15}   {counts} ({agree})")
            views = {"status": [], "status RUN": ["r00"], "status --all": ["--all"],
                     "status --json": ["--json"]}
            for name, extra in views.items():
                wall, lines = timed([*cli, *extra], args.repeat)
                print(f"{n:>7} {name:<14} {wall * 1000:>8.0f} {lines:>7} {wall / floor:>6.1f}x "
                      f"{wall / load_s:>14.2f}x", flush=True)
            if base_env is not None:
                old = version_1_copy(runs, Path(tmp) / f"v1-{n}")
                config.write_text(f'[paths]\nruns = "{runs}"\ndata = "{ROOT / "data"}"\n'
                                  f'state = "{old}"\n')
                for name, env in (("status on v1", None), ("base status", base_env)):
                    wall, lines = timed(cli, max(1, args.repeat // 2), env=env)
                    print(f"{n:>7} {name:<14} {wall * 1000:>8.0f} {lines:>7} "
                          f"{wall / floor:>6.1f}x {wall / load_s:>14.2f}x", flush=True)
                print(f"        (base: {args.base})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
