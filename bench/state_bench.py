"""The state database against the state.json it replaced (issue 14, item 3).

    .venv/bin/python bench/state_bench.py [--sets 20000 100000] [--changes 400]

For each size, in a child process of its own (so peak RSS is its own):
- cost per recorded change: one set updated, then flushed (one transaction),
  against the old flush, which rewrote every set to state.json atomically;
  also 100 changes per flush, as a busy daemon's 1 s flush loop batches them,
  and one change per flush with synchronous=FULL (an fsync per commit, as
  the old rewrite did; the daemon uses NORMAL);
- warm start of the state: StateStore.load() of a database of that size,
  against parsing the old state.json of the same sets;
then `find runs -name 'ep*.txt'` on a reported tree of the same number of
sets (bench/daemon_bench.py's scale tree), the yardstick of the warm start.
Records are the daemon's own (SetRecord with a fingerprint, as after a scan).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skilltrain.daemon.core import atomic  # noqa: E402
from skilltrain.daemon.infra.state import SetState, StateStore  # noqa: E402

BATCH = 100
HEX = "0123456789abcdef" * 4


def set_ids(n: int) -> list[str]:
    # The scale tree's shape: 10 epochs x 20 steps x 10 works per run.
    return [f"r{i // 2000:02d}/epoch_{i // 200 % 10:02d}/step_{i // 10 % 20:02d}/"
            f"w{i % 10:02d}/01-05" for i in range(n)]


def filled_store(path: Path, n: int) -> StateStore:
    store = StateStore(path.parent, path)
    for k, set_id in enumerate(set_ids(n)):
        store.update(set_id, SetState.DONE, reason=None, attempts=0, fingerprint={
            "sigs": f"{k:016x}", "human": HEX, "template": HEX,
            "model_id": "openai/gpt-4o-mini"})
    for run in {s.split("/")[0] for s in set_ids(n)}:
        store.add_spend(run, 1000, 200, 0, 0.01)
    return store


def legacy_flush(store: StateStore, path: Path) -> None:
    """What StateStore.flush did before the database: every record, rewritten."""
    payload = {
        "version": 1, "daemon_pid": None, "heartbeat": time.time(),
        "sets": {k: {**asdict(v), "state": v.state.value} for k, v in sorted(store.sets.items())},
        "steps": {k: asdict(v) for k, v in sorted(store.steps.items())},
        "spend": {k: asdict(v) for k, v in sorted(store.spend.items())},
        "notices": dict(sorted(store.notices.items())),
    }
    atomic.write_text(path, json.dumps(payload, separators=(",", ":")) + "\n")


def measure(n: int, changes: int) -> dict[str, Any]:
    """One size, in this process: the numbers the parent prints."""
    with tempfile.TemporaryDirectory(prefix="state-bench-", dir="/var/tmp") as tmp:
        db = Path(tmp) / "state.sqlite3"
        legacy = Path(tmp) / "state.json"
        store = filled_store(db, n)
        t0 = time.perf_counter()
        store.flush(force=True)
        first_s = time.perf_counter() - t0
        ids = set_ids(n)
        states = [SetState.QUEUED, SetState.RUNNING, SetState.DONE]

        one = []
        for k in range(changes):
            t0 = time.perf_counter()
            store.update(ids[(k * 7919) % n], states[k % 3], reason=None)
            store.flush()
            one.append(time.perf_counter() - t0)
        batched = []
        for k in range(max(1, changes // BATCH)):
            t0 = time.perf_counter()
            for j in range(BATCH):
                store.update(ids[(k * BATCH + j) * 104729 % n], states[j % 3], reason=None)
            store.flush()
            batched.append((time.perf_counter() - t0) / BATCH)
        # The daemon commits with synchronous=NORMAL (no fsync per commit, WAL
        # keeps the file whole); the old rewrite fsynced. The same with FULL:
        assert store._db is not None
        store._db._conn.execute("PRAGMA synchronous=FULL")
        full = []
        for k in range(max(20, changes // 4)):
            t0 = time.perf_counter()
            store.update(ids[(k * 31) % n], states[k % 3], reason=None)
            store.flush()
            full.append(time.perf_counter() - t0)
        old = []
        for k in range(max(3, min(20, changes // 20))):
            t0 = time.perf_counter()
            store.update(ids[k], states[k % 3], reason=None)
            legacy_flush(store, legacy)
            old.append(time.perf_counter() - t0)
        store.close()

        t0 = time.perf_counter()
        loaded = StateStore(Path(tmp), db)
        problem = loaded.load()
        load_s = time.perf_counter() - t0
        assert problem is None and len(loaded.sets) == n, problem
        loaded.close()
        t0 = time.perf_counter()
        json.loads(legacy.read_text(encoding="utf-8"))
        legacy_load_s = time.perf_counter() - t0
        return {
            "sets": n, "first_write_s": first_s,
            "change_ms": statistics.median(one) * 1000,
            "change_p99_ms": sorted(one)[int(len(one) * 0.99) - 1] * 1000,
            "batched_ms": statistics.median(batched) * 1000,
            "full_ms": statistics.median(full) * 1000,
            "old_change_ms": statistics.median(old) * 1000,
            "db_mb": (db.stat().st_size + _size(db, "-wal")) / 2**20,
            "json_mb": legacy.stat().st_size / 2**20,
            "load_s": load_s, "legacy_load_s": legacy_load_s,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }


def _size(db: Path, suffix: str) -> int:
    other = db.with_name(db.name + suffix)
    return other.stat().st_size if other.exists() else 0


def find_on_tree(n: int) -> tuple[float, int]:
    """`find` on daemon_bench's reported scale tree of n sets (runs of 2,000 sets)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import daemon_bench

    shape = daemon_bench.ScaleShape(runs=max(1, n // 2000), episode_bytes=200)
    with daemon_bench.workspace("state-tree", Path("/var/tmp")) as ws:
        daemon_bench.generate_scale_tree(ws, shape)
        return daemon_bench.time_find(ws.runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", type=int, nargs="+", default=[20000, 100000])
    parser.add_argument("--changes", type=int, default=400)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--no-find", action="store_true", help="skip building the trees")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.changes)))
        return 0
    print(f"{'sets':>7} {'change ms':>9} {'p99':>6} {'batched':>8} {'FULL':>6} {'old JSON':>9} "
          f"{'ratio':>7} {'load s':>7} {'old load':>8} {'find s':>7} {'load/find':>9} "
          f"{'db MB':>6} {'json MB':>7} {'RSS MB':>6}")
    for n in args.sets:
        out = subprocess.run([sys.executable, __file__, "--child", str(n),
                              "--changes", str(args.changes)],
                             check=True, capture_output=True, text=True).stdout
        r = json.loads(out)
        find_s = files = 0.0
        if not args.no_find:
            find_s, files = find_on_tree(n)
        ratio = r["old_change_ms"] / r["change_ms"]
        load_find = f"{r['load_s'] / find_s:.2f}x" if find_s else "-"
        print(f"{n:>7} {r['change_ms']:>9.3f} {r['change_p99_ms']:>6.2f} {r['batched_ms']:>8.3f} "
              f"{r['full_ms']:>6.2f} {r['old_change_ms']:>9.1f} {ratio:>6.0f}x {r['load_s']:>7.2f} "
              f"{r['legacy_load_s']:>8.2f} {find_s:>7.2f} {load_find:>9} {r['db_mb']:>6.1f} "
              f"{r['json_mb']:>7.1f} {r['peak_rss_mb']:>6.0f}", flush=True)
        if files:
            print(f"        (find listed {files:,} episode files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
