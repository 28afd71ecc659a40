"""What `skilltrain status` asks the state database: aggregates, not rows.

At 100,000 sets, reading every row and building its record took ~2 s; the
questions status answers (how many sets per step and state, which ones
failed, when the last report was written) are GROUP BY and WHERE queries
on the sets' indexed step, state and updated_at columns (state_db), which
SQLite answers from its index without reading a row's JSON. Every
function takes a read-only connection (state_db.open_read_only) and
changes nothing.

Set ids are `run/epoch_EE/step_SS/work/FF-LL`; a step's id is the set id's
first three parts (the keys of the `steps` table).
"""
from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from . import layout

_SETS_BY_STEP = """
SELECT step, state, count(*), max(updated_at) FROM sets GROUP BY step, state
"""

SET_FIELDS = ("state", "reason", "attempts", "next_retry_at", "updated_at")
# The fields a row of attention or --json shows; only the rows fetched are parsed.
_SET_COLUMNS = ("state, json_extract(value, '$.reason'), json_extract(value, '$.attempts'), "
                "json_extract(value, '$.next_retry_at'), updated_at")


@dataclass
class StepCounts:
    """One step's sets per state, and when one of them last changed."""

    step: str
    run: str
    counts: dict[str, int]
    last_done_at: float | None  # the newest report's record (a done set's last change)


def step_counts(conn: sqlite3.Connection) -> list[StepCounts]:
    """Every step that has sets, in key order."""
    steps: dict[str, StepCounts] = {}
    for step, state, n, last_at in conn.execute(_SETS_BY_STEP):
        row = steps.get(step)
        if row is None:
            row = steps[step] = StepCounts(step, layout.run_of(step), {}, None)
        row.counts[str(state)] = n
        if state == "done" and isinstance(last_at, int | float):
            row.last_done_at = float(last_at)
    return [steps[k] for k in sorted(steps)]


def sets_in_states(conn: sqlite3.Connection, states: Iterable[str], *,
                   prefix: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """Sets in these states (under `prefix`, a run or step id), in key order."""
    wanted = list(states)
    if not wanted:
        return []
    return _select_sets(conn, f"state IN ({', '.join('?' * len(wanted))})", list(wanted),
                        prefix, limit)


def sets_under(conn: sqlite3.Connection, prefix: str | None = None) -> list[dict[str, Any]]:
    """Every set (under `prefix`), in key order: `--json`'s full list."""
    args: list[Any] = []
    where = f" WHERE {_under(prefix, args)}" if prefix is not None else ""
    return [_set_row(row) for row in
            conn.execute(f"SELECT key, {_SET_COLUMNS} FROM sets{where} ORDER BY key", args)]


def sets_by_id(conn: sqlite3.Connection, set_ids: Iterable[str]) -> list[dict[str, Any]]:
    ids = list(set_ids)
    rows = []
    for start in range(0, len(ids), 500):  # SQLite's limit on bound parameters
        chunk = ids[start:start + 500]
        rows += [_set_row(row) for row in conn.execute(
            f"SELECT key, {_SET_COLUMNS} FROM sets WHERE key IN "
            f"({', '.join('?' * len(chunk))})", chunk)]
    return sorted(rows, key=lambda row: row["set"])


def running_since(conn: sqlite3.Connection, before: float) -> list[dict[str, Any]]:
    """Sets still `running` whose record has not changed since `before`."""
    return [_set_row(row) for row in conn.execute(
        f"SELECT key, {_SET_COLUMNS} FROM sets WHERE state = 'running' AND updated_at < ? "
        "ORDER BY key", (before,))]


def stale_held(conn: sqlite3.Connection, reason: str) -> dict[str, int]:
    """Per step, `stale` sets held back for `reason` (the budget): only stale rows are read."""
    return dict(conn.execute(
        "SELECT step, count(*) FROM sets WHERE state = 'stale' "
        "AND json_extract(value, '$.reason') = ? GROUP BY step", (reason,)).fetchall())


def stale_held_sets(conn: sqlite3.Connection, reason: str, *, prefix: str | None = None,
                    limit: int | None = None) -> list[dict[str, Any]]:
    return _select_sets(conn, "state = 'stale' AND json_extract(value, '$.reason') = ?",
                        [reason], prefix, limit)


def _select_sets(conn: sqlite3.Connection, where: str, args: list[Any], prefix: str | None,
                 limit: int | None) -> list[dict[str, Any]]:
    """The sets matching `where` (and under `prefix`), in key order, at most `limit`."""
    query = f"SELECT key, {_SET_COLUMNS} FROM sets WHERE {where}"
    if prefix is not None:
        query += " AND " + _under(prefix, args)
    query += " ORDER BY key"
    if limit is not None:
        query += " LIMIT ?"
        args.append(limit)
    return [_set_row(row) for row in conn.execute(query, args)]


def table(conn: sqlite3.Connection, name: str) -> dict[str, Any]:
    """A small table whole (steps, spend, notices), each row's JSON decoded."""
    if name not in ("steps", "spend", "notices"):
        raise ValueError(name)
    return {key: json.loads(value)
            for key, value in conn.execute(f"SELECT key, value FROM {name} ORDER BY key")}


def meta(conn: sqlite3.Connection) -> dict[str, Any]:
    out = {}
    for key, value in conn.execute("SELECT key, value FROM meta"):
        try:
            out[key] = json.loads(value)
        except ValueError:
            continue
    return out


def _under(prefix: str, args: list[Any]) -> str:
    """Keys under `prefix/` as a range of the primary key (an index seek, not a scan)."""
    args += [prefix + "/", prefix + "0"]  # "0" is the character after "/"
    return "key >= ? AND key < ?"


def _set_row(row: tuple[Any, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"set": row[0]}
    out.update(zip(SET_FIELDS, row[1:], strict=True))
    out["attempts"] = out["attempts"] or 0
    return out
