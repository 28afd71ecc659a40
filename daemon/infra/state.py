"""The daemon's memory: every set's state, step barriers, spend per run.

The filesystem is the truth (sidecars say which reports are up to date);
this store is a cache of it plus what the filesystem cannot say: why a set
failed and when to retry it, whether a step's optimizer already ran, what a
run has spent. The records live in memory, the daemon's working copy; each
flush writes the ones that changed since the last to a SQLite database
([paths] state, see state_db). It holds names, hashes, numbers and our own
messages -- never file contents, so no human text.
"""
from __future__ import annotations

import enum
import errno
import json
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.layout import STATE_DIR, default_state_path, step_of
from ..core.state_db import StateDB, move_aside, read_only
from ..guard import leakguard

# The state file of daemons before the database: migrated once, then renamed.
LEGACY_FILE = "state.json"
LEGACY_VERSION = 1


# A set's reason while [llm] budget_usd holds it back (held, or stale: a report
# exists whose inputs changed); status counts these as held, not as backlog.
BUDGET_REASON = "budget reached"


class SetState(enum.StrEnum):
    WAITING = "waiting"  # range incomplete: episodes missing or empty
    SETTLING = "settling"  # complete, still being written (changed < settle_s ago)
    HELD = "held"  # complete and settled, no report: held back by [llm] budget_usd
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"  # an up-to-date report exists
    STALE = "stale"  # a report exists but its inputs changed; will be redone
    FAILED = "failed"  # LLM or output failure; retried with backoff up to max_attempts
    REFUSED = "refused"  # bad input; retried when the input changes


@dataclass
class SetRecord:
    state: SetState
    reason: str | None = None
    attempts: int = 0
    next_retry_at: float | None = None  # wall clock
    fingerprint: dict[str, Any] | None = None  # observe.Fingerprint.as_json() of the last report
    refused_fingerprint: dict[str, Any] | None = None
    updated_at: float = field(default_factory=time.time)
    rate_limited: int = 0  # calls in a row that gave up on the provider's rate limit alone


@dataclass
class StepRecord:
    reported_at: float | None = None
    optimizer_attempts: int = 0
    optimizer_exit_code: int | None = None
    optimizer_done: bool = False
    optimizer_next_at: float | None = None
    generation: int = 0  # times the step was reopened: a report replaced after it was reported
    reopened_reason: str | None = None


@dataclass
class RunSpend:
    tokens_in: int = 0
    tokens_out: int = 0
    tokens_cached: int = 0
    cost_usd: float = 0.0
    reports: int = 0
    tokens_cache_write: int = 0
    # Wall clock of the run's last report: /metrics' "no report for an hour"
    # must survive a restart (a crash loop would otherwise reset it).
    last_report_at: float | None = None


class SetTally:
    """Set records counted as they change (under the store's lock): per state, for
    the main loop's status line and /metrics, asked every second (100,000 sets
    took ~10 ms to count); and those not DONE per step id, so the step barrier,
    asked at every job's end, knows "not yet" without listing a step's sets."""

    def __init__(self) -> None:
        self.by_state: Counter[str] = Counter()
        self.open_in: Counter[str] = Counter()

    def add(self, set_id: str, state: SetState, by: int) -> None:
        self.by_state[state.value] += by
        if state != SetState.DONE:
            self.open_in[step_of(set_id)] += by


class StateStore:
    """Its methods take `lock`; `flush()` writes what changed.

    The records it hands out (`get`, `step`, `sets[...]`) are the live ones,
    not copies: a caller that changes one, or reads several fields that must
    agree, holds `lock` while it does, and changes a step only through the
    record `step()` hands out under that same hold (that marks it for the
    next flush).
    """

    def __init__(self, runs: Path, path: Path | None = None) -> None:
        self.runs = runs
        self.path = path or default_state_path(runs)
        self.sets: dict[str, SetRecord] = {}
        self.steps: dict[str, StepRecord] = {}
        self.spend: dict[str, RunSpend] = {}
        # Paths under runs/ (and human folders) the daemon cannot use, with why:
        # what `skilltrain status` shows besides the sets (epoch_1, a linked run).
        self.notices: dict[str, dict[str, str]] = {}
        self.tally = SetTally()
        self.lock = threading.RLock()
        # Keys changed since the last flush, per table; a key no longer in its
        # dict is deleted. Only these rows are written.
        self._dirty: dict[str, set[str]] = {"sets": set(), "steps": set(), "spend": set(),
                                             "notices": set()}
        self._write_lock = threading.Lock()  # one flush at a time, in order
        self._next_flush_at = 0.0  # monotonic; flush_when_due
        self._db: StateDB | None = None
        self.daemon_pid: int | None = None
        self.heartbeat: float | None = None
        # For status's daemon line (meta rows, wall clock): since when this
        # daemon runs, and when its last full scan ended (before the first
        # one ends, what the state says may be a previous run's).
        self.started_at: float | None = None
        self.scanned_at: float | None = None
        self.llm_endpoints: dict[str, dict[str, Any]] = {}  # endpoint -> its limiter (whole)
        self._meta_changed = False

    @property
    def legacy_path(self) -> Path:
        return self.runs / STATE_DIR / LEGACY_FILE

    # ------------------------------------------------------------- reading
    def load(self) -> str | None:
        """The daemon's start: open the database and read it, or migrate state.json.

        Nothing here is fatal: the state is a cache of the filesystem and is
        rebuilt from it. A database that cannot be read is moved aside (with
        its -wal and -shm) and a new one started; a state.json of the wrong
        shape is moved aside too. Returns why the old state was not used, or None.
        """
        problem = None
        fresh = not self.path.exists()
        try:
            self._db = StateDB(self.path)
            raw = self._db.read()
        except (sqlite3.Error, ValueError) as e:
            if self._db is not None:
                self._db.close()
            kept = move_aside(self.path)
            problem = f"not a state database ({type(e).__name__}: {_short(e)})"
            problem += f"; the bad file is kept as {kept}" if kept else ""
            self._db = _fresh_db(self.path)
            raw = {}
        if fresh and self.legacy_path.exists():
            return self._migrate() or problem
        try:
            self._load_raw(raw)
        except (ValueError, TypeError, AttributeError) as e:
            problem = f"not a state database ({type(e).__name__}: {_short(e)})"
        return problem

    def _migrate(self) -> str | None:
        """state.json of an older daemon, written into the database once and renamed aside."""
        problem = _read_legacy(self.legacy_path, self._load_raw)
        if problem and problem.startswith("cannot read"):
            return problem  # left where it is: maybe readable next time
        suffix = ".bad-" + time.strftime("%Y%m%dT%H%M%S") if problem else ".migrated"
        target = self.legacy_path.with_name(LEGACY_FILE + suffix)
        kept: Path | None = target
        try:
            self.legacy_path.rename(target)
        except OSError:
            kept = None
        if problem:
            with self.lock:
                self.sets, self.steps, self.spend, self.notices = {}, {}, {}, {}
                self.tally = SetTally()
            return f"{problem}; the bad file is kept as {kept}" if kept else problem
        with self.lock:
            for table, records in self._tables().items():
                self._dirty[table].update(records)
        return None

    @classmethod
    def read_snapshot(cls, runs: Path, path: Path | None = None
                      ) -> tuple[StateStore, str | None]:
        """The state as `status` sees it, read-only and creating nothing."""
        store = cls(runs, path)
        try:
            raw = read_only(store.path)
        except (sqlite3.Error, ValueError) as e:
            return store, f"not a state database ({type(e).__name__}: {_short(e)})"
        if raw is None:  # no database yet: a daemon of before may have left state.json
            return store, (_read_legacy(store.legacy_path, store._load_raw)
                           if store.legacy_path.exists() else None)
        try:
            store._load_raw(raw)
        except (ValueError, TypeError, AttributeError) as e:
            return store, f"not a state database ({type(e).__name__}: {_short(e)})"
        return store, None

    def _load_raw(self, raw: dict[str, Any]) -> None:
        sections = {name: raw.get(name, {}) for name in ("sets", "steps", "spend")}
        for name, value in sections.items():
            if not isinstance(value, dict):
                raise TypeError(f"{name!r} is a {type(value).__name__}, not an object")
        with self.lock:
            for set_id, rec in sections["sets"].items():
                try:
                    rec = dict(rec)
                    rec["state"] = SetState(rec["state"])
                    new = SetRecord(**rec)
                except (KeyError, TypeError, ValueError):
                    continue
                if (old := self.sets.get(set_id)) is not None:
                    self.tally.add(set_id, old.state, -1)
                self.sets[set_id] = new
                self.tally.add(set_id, new.state, 1)
            for step_id, rec in sections["steps"].items():
                try:
                    self.steps[step_id] = StepRecord(**rec)
                except TypeError:
                    continue
            for run, rec in sections["spend"].items():
                try:
                    self.spend[run] = RunSpend(**rec)
                except TypeError:
                    continue
            notices = raw.get("notices", {})
            if isinstance(notices, dict):
                self.notices = {str(p): n for p, n in notices.items() if isinstance(n, dict)}
            pid, heartbeat = raw.get("daemon_pid"), raw.get("heartbeat")
            self.daemon_pid = pid if isinstance(pid, int) else None
            self.heartbeat = heartbeat if isinstance(heartbeat, (int, float)) else None

    # ------------------------------------------------------------ changing
    def get(self, set_id: str) -> SetRecord | None:
        with self.lock:
            return self.sets.get(set_id)

    def update(self, set_id: str, state: SetState, **changes: Any) -> SetRecord:
        with self.lock:
            known = self.sets.get(set_id)
            rec = known or SetRecord(state=state)
            if known is None or rec.state != state or changes:  # a new set is kept
                if known is not None:
                    self.tally.add(set_id, rec.state, -1)
                self.tally.add(set_id, state, 1)
                rec.state = state
                keys = leakguard.installed()
                for name, value in changes.items():
                    # A reason may hold a provider's or a library's words: it is
                    # checked against every work like a log line.
                    if isinstance(value, str) and keys is not None:
                        value = keys.clean(value)
                    setattr(rec, name, value)
                rec.updated_at = time.time()
                self.sets[set_id] = rec
                self._dirty["sets"].add(set_id)
            return rec

    def forget(self, set_id: str) -> None:
        """A set whose folder is gone."""
        with self.lock:
            if (rec := self.sets.pop(set_id, None)) is not None:
                self.tally.add(set_id, rec.state, -1)
                self._dirty["sets"].add(set_id)

    def forget_step(self, step_id: str) -> None:
        """A step whose folder is gone: a run made again under its name starts afresh."""
        with self.lock:
            if self.steps.pop(step_id, None) is not None:
                self._dirty["steps"].add(step_id)

    def step(self, step_id: str) -> StepRecord:
        with self.lock:
            self._dirty["steps"].add(step_id)  # callers mutate the record they get
            return self.steps.setdefault(step_id, StepRecord())

    def put_step(self, step_id: str, rec: StepRecord) -> None:
        with self.lock:
            self.steps[step_id] = rec
            self._dirty["steps"].add(step_id)

    def add_spend(self, run: str, tokens_in: int, tokens_out: int, tokens_cached: int,
                  cost_usd: float | None, tokens_cache_write: int = 0,
                  report: bool = True) -> RunSpend:  # report=False: a reply refused
        with self.lock:
            spend = self.spend.setdefault(run, RunSpend())
            spend.tokens_in += tokens_in
            spend.tokens_out += tokens_out
            spend.tokens_cached += tokens_cached
            spend.tokens_cache_write += tokens_cache_write
            spend.cost_usd += cost_usd or 0.0
            if report:
                spend.reports += 1
                spend.last_report_at = time.time()
            self._dirty["spend"].add(run)
            return spend

    def notice(self, path: str, event: str, reason: str) -> str:
        """Keep why `path` cannot be used; returns the key it is kept under."""
        keys = leakguard.installed()
        if keys is not None:  # a writer named these files: checked like a log line
            path, reason = keys.clean(path), keys.clean(reason)
        with self.lock:
            entry = {"event": event, "reason": reason}
            if self.notices.get(path) != entry:
                self.notices[path] = entry
                self._dirty["notices"].add(path)
        return path

    def keep_notices(self, keep: Callable[[str], bool]) -> None:
        """Drop the notices of paths that no longer have a problem."""
        with self.lock:
            for path in [path for path in self.notices if not keep(path)]:
                del self.notices[path]
                self._dirty["notices"].add(path)

    def note_daemon(self, *, started_at: float | None = None, scanned_at: float | None = None,
                    llm_endpoint: tuple[str, dict[str, Any]] | None = None) -> None:
        """Record when the daemon started or finished a scan, what an endpoint's limiter
        does now (llm_endpoints.describe; for `status`: written by the next flush)."""
        with self.lock:
            self.started_at = started_at or self.started_at
            self.scanned_at = scanned_at or self.scanned_at
            if llm_endpoint is not None:
                name, now = llm_endpoint
                self.llm_endpoints = {**self.llm_endpoints, name: _guarded(now)}
            self._meta_changed = True

    def counts(self) -> Counter[str]:
        """Sets per state (a copy; states with none left out)."""
        with self.lock:
            return +self.tally.by_state

    # ------------------------------------------------------------- writing
    def flush(self, *, force: bool = False, pid: int | None = None) -> bool:
        """Write the records changed since the last flush, in one transaction.

        `force` writes the pid and heartbeat even with nothing changed. A
        failed write keeps the changes for the next flush and raises OSError.
        """
        with self._write_lock:
            with self.lock:
                if not (force or self._meta_changed or any(self._dirty.values())):
                    return False
                self._meta_changed = False
                dirty, self._dirty = self._dirty, {table: set() for table in self._dirty}
                tables = self._tables()
                changes = {table: {key: record_json(tables[table].get(key)) for key in keys}
                           for table, keys in dirty.items() if keys}
            try:
                if self._db is None:
                    self._db = StateDB(self.path)
                self._db.write(changes, {"daemon_pid": pid, "heartbeat": time.time(),
                                         "started_at": self.started_at,
                                         "scanned_at": self.scanned_at,
                                         "llm_limits": _limits(self.llm_endpoints),
                                         "llm_endpoints": self.llm_endpoints})
            except (sqlite3.Error, OSError) as e:
                with self.lock:
                    self._meta_changed = True
                    for table, keys in dirty.items():
                        self._dirty[table] |= keys
                if isinstance(e, OSError):
                    raise
                raise OSError(errno.EIO, f"{self.path.name}: {_short(e)}") from None
            return True

    def flush_when_due(self, *, pid: int | None, tick_s: float) -> None:
        """flush(), at most every 10x its last write's cost (called every tick).

        A flush costs the size of its batch (a millisecond or so for a tick's
        changes; the first scan's 100,000 new sets take a second): a busy
        daemon must not spend its time writing every tick. A failed write
        (OSError, raised) is tried again ten ticks later.
        """
        now = time.monotonic()
        if now < self._next_flush_at:
            return
        try:
            written = self.flush(pid=pid)
        except OSError:
            self._next_flush_at = now + 10 * tick_s
            raise
        if written:
            cost = time.monotonic() - now
            self._next_flush_at = time.monotonic() + max(0.0, 10 * cost - tick_s)

    def close(self) -> None:
        with self._write_lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def _tables(self) -> dict[str, dict[str, Any]]:
        return {"sets": self.sets, "steps": self.steps, "spend": self.spend,
                "notices": self.notices}


def _limits(endpoints: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each endpoint's calls-at-once limit (what a `status` before the endpoints read)."""
    return {name: e.get("limit") for name, e in endpoints.items()}


def _guarded(endpoint: dict[str, Any]) -> dict[str, Any]:
    """An endpoint's state with the provider's words checked like a log line."""
    keys = leakguard.installed()
    if keys is not None and isinstance(endpoint.get("reason"), str):
        return {**endpoint, "reason": keys.clean(endpoint["reason"])}
    return endpoint


def _fresh_db(path: Path) -> StateDB | None:
    """A new database where a bad one was; None (memory only) if even that fails,
    so a broken state directory never keeps the daemon from starting."""
    try:
        return StateDB(path)
    except (sqlite3.Error, OSError):
        return None


def _read_legacy(path: Path, load_raw: Callable[[dict[str, Any]], None]) -> str | None:
    """A state.json of an older daemon into `load_raw`; why it could not be, or None."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return f"cannot read it ({getattr(e, 'strerror', None) or type(e).__name__})"
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        if raw.get("version") != LEGACY_VERSION:
            return None  # another version's state: start afresh, quietly
        load_raw(raw)
    except (ValueError, TypeError, AttributeError) as e:
        return f"not a state file ({type(e).__name__}: {_short(e)})"
    return None


def _short(error: BaseException) -> str:
    return " ".join(str(error).split())[:120]


def record_json(rec: Any) -> Any:
    """A record as its row holds it; None (a deleted key) stays None."""
    if rec is None or isinstance(rec, dict):
        return rec
    data = asdict(rec)
    if isinstance(rec, SetRecord):
        data["state"] = rec.state.value
    return data
