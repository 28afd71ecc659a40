"""Where the daemon's state lives: a SQLite database (stdlib sqlite3, WAL).

One row per set, per step, per run's spend and per notice, each the JSON of
its record (a set's step, state and updated_at also in indexed columns, for
status's counts); a `meta` table holds the daemon's pid, when it started,
last scanned and last wrote. A
flush writes only the rows that changed, in one transaction, so its cost is
the size of the change, not of the state. WAL lets `skilltrain status` read
while the daemon writes, without either waiting for the other.

Every reader and writer of the file is here; `state.StateStore` decides what
to write, this module how.
"""
from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from . import layout

SCHEMA_VERSION = 2
# Version 2 keeps each set's step, state and updated_at in columns of their
# own beside its JSON, indexed: status counts 100,000 sets per step and state
# from the index instead of parsing every row's JSON (~0.3 s, ~0.7 s on a
# loaded machine). A version 1 file is upgraded in place by the daemon.
# Tables of keyed records, in the shape the old state.json had them.
TABLES = ("sets", "steps", "spend", "notices")
_SET_COLUMNS = "step TEXT, state TEXT, updated_at REAL"
_SET_INDEXES = ("CREATE INDEX sets_by_step ON sets (step, state, updated_at)",
                "CREATE INDEX sets_by_state ON sets (state, updated_at)")
BUSY_TIMEOUT_S = 5.0

# A change: table -> key -> the record as JSON-able data, or None to delete it.
Changes = Mapping[str, Mapping[str, Any]]


class StateDB:
    """The daemon's read-write connection. Not thread-safe: the store serialises."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        # Created here, so its mode follows the umask like every file the
        # daemon writes (SQLite's own default is 0644); -wal and -shm copy it.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o666))
        self._conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                     check_same_thread=False)
        try:
            self._prepare()
        except BaseException:
            self._conn.close()
            raise

    def _prepare(self) -> None:
        conn = self._conn
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            if conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
                raise sqlite3.DatabaseError("a SQLite database of something else")
            conn.execute("PRAGMA journal_mode=WAL")
            with _transaction(conn):
                _create_tables(conn)
        elif version == 1:
            conn.execute("PRAGMA journal_mode=WAL")
            with _transaction(conn):
                _upgrade_from_1(conn)
        elif version != SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"schema version {version}, this daemon reads "
                                        f"{SCHEMA_VERSION}")
        else:
            conn.execute("PRAGMA journal_mode=WAL")
        # A cache of the filesystem: losing the last commits to a power cut is
        # fine, a corrupt file is not (WAL with NORMAL gives exactly that).
        conn.execute("PRAGMA synchronous=NORMAL")

    def read(self) -> dict[str, Any]:
        """Everything, in the old state.json shape (`state.StateStore` reads that)."""
        return _read_all(self._conn)

    def write(self, changes: Changes, meta: Mapping[str, Any]) -> None:
        """The changed rows and the meta values, in one transaction."""
        with _transaction(self._conn):
            _write_rows(self._conn, changes, meta)

    def close(self) -> None:
        # The last connection to close checkpoints the WAL and removes it.
        self._conn.close()


def read_only(path: Path) -> dict[str, Any] | None:
    """The state as a reader sees it, every row; None when there is no database."""
    with open_read_only(path) as conn:
        return None if conn is None else _read_all(conn)


@contextlib.contextmanager
def open_read_only(path: Path) -> Iterator[sqlite3.Connection | None]:
    """A read-only connection for status's queries; None when there is no database.

    Creates nothing: with no -wal file (no daemon has it open) the file is
    opened immutable; with one, read-only through the WAL the daemon keeps.
    The caller's queries run in one read transaction, so the counts they
    add up come from one moment of the daemon's writes.
    """
    if not path.is_file():
        yield None
        return
    wal = path.with_name(path.name + "-wal")
    for attempt in (1, 2):
        mode = "ro" if wal.exists() else "ro&immutable=1"
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode={mode}", uri=True,
                               timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (1, SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"schema version {version}")
            conn.execute("BEGIN")
            conn.execute("SELECT count(*) FROM meta").fetchone()  # the snapshot starts here
            if version == 1:
                # A daemon from before version 2 still runs: its rows, copied
                # into the current shape in memory (slower, until it restarts).
                raw = _read_all(conn)
                conn.close()
                conn = in_memory({table: raw.pop(table) for table in TABLES}, raw)
        except sqlite3.DatabaseError:
            conn.close()
            if attempt == 2:
                raise
            continue  # a daemon started or stopped between the look and the open: once more
        try:
            yield conn
        finally:
            conn.close()
        return


def in_memory(changes: Changes, meta: Mapping[str, Any]) -> sqlite3.Connection:
    """A database in memory holding these rows: a state.json of an older daemon,
    read through the same queries as the file."""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    with _transaction(conn):
        _create_tables(conn)
        _write_rows(conn, changes, meta)
    return conn


def move_aside(path: Path) -> Path | None:
    """A bad database (and its -wal and -shm) renamed beside it; None if it could not be."""
    kept = path.with_name(f"{path.name}.bad-{time.strftime('%Y%m%dT%H%M%S')}")
    try:
        path.rename(kept)
    except OSError:
        return None
    for suffix in ("-wal", "-shm"):
        with contextlib.suppress(OSError):
            path.with_name(path.name + suffix).rename(kept.with_name(kept.name + suffix))
    return kept


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _text(key: str) -> str:
    """A key SQLite can store: a path with undecodable bytes (surrogate escapes,
    a notice about a run folder's non-UTF-8 name) keeps them as \\udcNN."""
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def _create_tables(conn: sqlite3.Connection) -> None:
    for table in (*TABLES, "meta"):
        extra = f", {_SET_COLUMNS}" if table == "sets" else ""
        conn.execute(f"CREATE TABLE {table} (key TEXT PRIMARY KEY, value TEXT NOT NULL{extra})")
    for index in _SET_INDEXES:
        conn.execute(index)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _upgrade_from_1(conn: sqlite3.Connection) -> None:
    """Version 1 -> 2: the sets' columns filled from their JSON, once."""
    for column in _SET_COLUMNS.split(", "):
        conn.execute(f"ALTER TABLE sets ADD COLUMN {column}")
    rows = [(_set_columns(key, json.loads(value)), key)
            for key, value in conn.execute("SELECT key, value FROM sets")]
    conn.executemany("UPDATE sets SET step = ?, state = ?, updated_at = ? WHERE key = ?",
                     [(*columns, key) for columns, key in rows])
    for index in _SET_INDEXES:
        conn.execute(index)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _set_columns(key: str, value: Any) -> tuple[str, Any, Any]:
    """A set row's step (its id's first three parts), state and updated_at."""
    record = value if isinstance(value, dict) else {}
    updated_at = record.get("updated_at")
    return (layout.step_of(key), record.get("state"),
            updated_at if isinstance(updated_at, int | float) else None)


def _write_rows(conn: sqlite3.Connection, changes: Changes, meta: Mapping[str, Any]) -> None:
    for table, rows in changes.items():
        gone = [(_text(key),) for key, value in rows.items() if value is None]
        kept = [(_text(key), value) for key, value in rows.items() if value is not None]
        if gone:
            conn.executemany(f"DELETE FROM {table} WHERE key = ?", gone)
        if kept and table == "sets":
            conn.executemany("INSERT OR REPLACE INTO sets VALUES (?, ?, ?, ?, ?)",
                             [(key, _json(value), *_set_columns(key, value))
                              for key, value in kept])
        elif kept:
            conn.executemany(f"INSERT OR REPLACE INTO {table} VALUES (?, ?)",
                             [(key, _json(value)) for key, value in kept])
    conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                     [(key, json.dumps(value)) for key, value in meta.items()])


def _read_all(conn: sqlite3.Connection) -> dict[str, Any]:
    raw: dict[str, Any] = {"version": SCHEMA_VERSION}
    for table in TABLES:
        raw[table] = {key: json.loads(value)
                      for key, value in conn.execute(f"SELECT key, value FROM {table}")}
    for key, value in conn.execute("SELECT key, value FROM meta"):
        raw[key] = json.loads(value)
    return raw


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Any:
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if conn.in_transaction:  # SQLite rolls some errors back itself (a full disk)
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
