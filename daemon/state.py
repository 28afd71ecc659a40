"""The daemon's memory: every set's state, step barriers, spend per run.

The filesystem is the truth (sidecars say which reports are up to date);
this store is a cache of it plus what the filesystem cannot say: why a set
failed and when to retry it, whether a step's optimizer already ran, what a
run has spent. It lives in runs/.skilltrain/state.json, written atomically,
and holds names, hashes, numbers and our own messages -- never file
contents, so no human text.
"""
from __future__ import annotations

import enum
import json
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from skilltrain import atomic, leakguard
from skilltrain.layout import STATE_DIR

STATE_FILE = "state.json"
STATE_VERSION = 1


class SetState(enum.StrEnum):
    WAITING = "waiting"  # range incomplete: episodes missing or empty
    SETTLING = "settling"  # complete, still being written (changed < settle_seconds ago)
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


@dataclass
class StepRecord:
    reported_at: float | None = None
    optimizer_attempts: int = 0
    optimizer_exit_code: int | None = None
    optimizer_done: bool = False
    optimizer_next_at: float | None = None


@dataclass
class RunSpend:
    tokens_in: int = 0
    tokens_out: int = 0
    tokens_cached: int = 0
    cost_usd: float = 0.0
    reports: int = 0
    tokens_cache_write: int = 0


class StateStore:
    """Its methods take `lock`; `flush()` writes when something changed.

    The records it hands out (`get`, `step`, `sets[...]`) are the live ones,
    not copies: a caller that changes one, or reads several fields that must
    agree, holds `lock` while it does.
    """

    def __init__(self, runs: Path) -> None:
        self.path = runs / STATE_DIR / STATE_FILE
        self.sets: dict[str, SetRecord] = {}
        self.steps: dict[str, StepRecord] = {}
        self.spend: dict[str, RunSpend] = {}
        self.lock = threading.RLock()
        self._dirty = False
        self.daemon_pid: int | None = None
        self.heartbeat: float | None = None

    def load(self) -> None:
        """Read the last saved state; a missing or unreadable file means start afresh."""
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if not isinstance(raw, dict) or raw.get("version") != STATE_VERSION:
            return
        with self.lock:
            for set_id, rec in raw.get("sets", {}).items():
                try:
                    rec["state"] = SetState(rec["state"])
                    self.sets[set_id] = SetRecord(**rec)
                except (KeyError, TypeError, ValueError):
                    continue
            for step_id, rec in raw.get("steps", {}).items():
                try:
                    self.steps[step_id] = StepRecord(**rec)
                except TypeError:
                    continue
            for run, rec in raw.get("spend", {}).items():
                try:
                    self.spend[run] = RunSpend(**rec)
                except TypeError:
                    continue
            self.daemon_pid = raw.get("daemon_pid")
            self.heartbeat = raw.get("heartbeat")

    def get(self, set_id: str) -> SetRecord | None:
        with self.lock:
            return self.sets.get(set_id)

    def update(self, set_id: str, state: SetState, **changes: Any) -> SetRecord:
        with self.lock:
            rec = self.sets.get(set_id) or SetRecord(state=state)
            if rec.state != state or changes:
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
                self._dirty = True
            return rec

    def step(self, step_id: str) -> StepRecord:
        with self.lock:
            self._dirty = True  # callers mutate the record they get
            return self.steps.setdefault(step_id, StepRecord())

    def add_spend(self, run: str, tokens_in: int, tokens_out: int, tokens_cached: int,
                  cost_usd: float | None, tokens_cache_write: int = 0) -> RunSpend:
        with self.lock:
            spend = self.spend.setdefault(run, RunSpend())
            spend.tokens_in += tokens_in
            spend.tokens_out += tokens_out
            spend.tokens_cached += tokens_cached
            spend.tokens_cache_write += tokens_cache_write
            spend.cost_usd += cost_usd or 0.0
            spend.reports += 1
            self._dirty = True
            return spend

    def counts(self) -> Counter[str]:
        with self.lock:
            return Counter(rec.state.value for rec in self.sets.values())

    def mark_dirty(self) -> None:
        self._dirty = True

    def flush(self, *, force: bool = False, pid: int | None = None) -> bool:
        with self.lock:
            if not (self._dirty or force):
                return False
            payload = {
                "version": STATE_VERSION,
                "daemon_pid": pid,
                "heartbeat": time.time(),
                "sets": {k: _record_json(v) for k, v in sorted(self.sets.items())},
                "steps": {k: asdict(v) for k, v in sorted(self.steps.items())},
                "spend": {k: asdict(v) for k, v in sorted(self.spend.items())},
            }
            self._dirty = False
        atomic.write_text(self.path, json.dumps(payload, separators=(",", ":")) + "\n")
        return True


def _record_json(rec: SetRecord) -> dict[str, Any]:
    data = asdict(rec)
    data["state"] = rec.state.value
    return data
