"""`skilltrain status`: every set and its state, from the daemon's state database.

Reads [paths] state read-only (the running daemon writes its changes there
within a second; WAL lets both go on at once) and asks the lock file whether
a daemon is alive.
No scan, no litellm: it answers in a few tens of milliseconds.
"""
from __future__ import annotations

import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, TextIO

from . import config, layout, run_record
from .lock import holder_pid
from .state import SetState, StateStore

STATE_ORDER = [s.value for s in SetState]


def collect(runs: Path, state_path: Path | None = None) -> dict[str, Any]:
    """Everything status shows, as plain data (this is also the --json output)."""
    # Read-only, creating nothing: a bad file is the daemon's to move aside.
    store, unreadable = StateStore.read_snapshot(runs, state_path)
    pid = holder_pid(runs / layout.STATE_DIR)
    steps: dict[str, Counter[str]] = defaultdict(Counter)
    sets = []
    for set_id, rec in sorted(store.sets.items()):
        step_id = set_id.rsplit("/", 2)[0]
        steps[step_id][rec.state.value] += 1
        sets.append({"set": set_id, "state": rec.state.value, "reason": rec.reason,
                     "attempts": rec.attempts, "next_retry_at": rec.next_retry_at,
                     "updated_at": rec.updated_at})
    step_rows = []
    for step_id, counts in sorted(steps.items()):
        step_rec = store.steps.get(step_id)
        step_rows.append({
            "step": step_id, "sets": sum(counts.values()),
            **{state: counts.get(state, 0) for state in STATE_ORDER},
            "reported": bool(step_rec and step_rec.reported_at),
            "optimizer": _optimizer_state(step_rec),
        })
    return {
        "runs_dir": str(runs),
        "daemon": {"running": pid is not None, "pid": pid,
                   "state_written_at": store.heartbeat, "state_unreadable": unreadable},
        "totals": dict(Counter(rec.state.value for rec in store.sets.values())),
        "steps": step_rows,
        "sets": sets,
        "spend": {run: vars(spend) for run, spend in sorted(store.spend.items())},
        "notices": [{"path": path, **notice} for path, notice in sorted(store.notices.items())],
        "loop": run_record.status_rows(runs),
    }


def _optimizer_state(rec: Any) -> str:
    if rec is None or rec.reported_at is None:
        return "-"
    if rec.optimizer_done:
        return "done" if rec.optimizer_exit_code is not None else "event only"
    if rec.optimizer_attempts == 0:
        return "pending"
    return f"failed x{rec.optimizer_attempts} (exit {rec.optimizer_exit_code})"


def render(data: dict[str, Any], out: TextIO) -> None:
    from rich.console import Console
    from rich.table import Table

    # Piped output (less, grep, a CI log) gets room for every column.
    console = Console(file=out, highlight=False, width=None if out.isatty() else 160)
    daemon = data["daemon"]
    written = daemon["state_written_at"]
    age = f", state written {time.time() - written:.0f}s ago" if written else ""
    who = f"daemon running (pid {daemon['pid']})" if daemon["running"] else "daemon not running"
    console.print(f"{data['runs_dir']}: {who}{age}")
    if daemon.get("state_unreadable"):
        console.print(f"state not used: {daemon['state_unreadable']}")
    if data["loop"]:
        run_record.render_status(data["loop"], console)
    if not data["steps"]:
        console.print("no sets known yet: start `skilltrain daemon` "
                      "(or `skilltrain daemon --once`)")
        _render_notices(data["notices"], console)
        return
    steps = Table(title="steps", title_justify="left")
    for column in ["step", "sets", *STATE_ORDER, "reported", "optimizer"]:
        steps.add_column(column, justify="right" if column in STATE_ORDER + ["sets"] else "left")
    for row in data["steps"]:
        steps.add_row(row["step"], str(row["sets"]),
                      *[str(row[s]) if row[s] else "." for s in STATE_ORDER],
                      "yes" if row["reported"] else "no", row["optimizer"])
    console.print(steps)
    pending = [s for s in data["sets"] if s["state"] != SetState.DONE.value]
    if pending:
        sets = Table(title="sets not done", title_justify="left")
        for column in ("set", "state", "attempts", "reason"):
            sets.add_column(column)
        for s in pending:
            sets.add_row(s["set"], s["state"], str(s["attempts"] or ""), s["reason"] or "")
        console.print(sets)
    _render_notices(data["notices"], console)
    if data["spend"]:
        spend = Table(title="spend", title_justify="left")
        for column in ("run", "reports", "tokens in", "tokens out", "cached", "cache write",
                       "cost USD"):
            spend.add_column(column, justify="left" if column == "run" else "right")
        for run, s in data["spend"].items():
            spend.add_row(run, str(s["reports"]), f"{s['tokens_in']:,}", f"{s['tokens_out']:,}",
                          f"{s['tokens_cached']:,}", f"{s.get('tokens_cache_write', 0):,}",
                          f"{s['cost_usd']:.4f}")
        console.print(spend)


def _render_notices(notices: list[dict[str, str]], console: Any) -> None:
    """A set's own problem is in its row; these are the folders that hold no
    set the daemon can see (epoch_1, a linked run folder, a gap in human/)."""
    from rich.table import Table

    paths = [n for n in notices if not n["path"].endswith("/scripts")]
    if not paths:
        return
    table = Table(title="paths not used", title_justify="left")
    for column in ("path", "event", "reason"):
        table.add_column(column)
    for n in paths:
        table.add_row(n["path"], n["event"], n["reason"])
    console.print(table)


def main(config_path: Path | None, as_json: bool, out: TextIO = sys.stdout) -> int:
    cfg = config.load(config_path)
    if notice := config.defaults_notice(cfg):
        print(f"skilltrain: {notice}", file=sys.stderr)
    if not cfg.paths.runs.is_dir():
        print(f"skilltrain: {cfg.paths.runs} does not exist: no daemon has run with this "
              "configuration", file=sys.stderr)
        return 1
    data = collect(cfg.paths.runs, cfg.paths.state)
    if as_json:
        json.dump(data, out, indent=2)
        out.write("\n")
    else:
        render(data, out)
    return 0
