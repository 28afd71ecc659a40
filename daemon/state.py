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
from collections.abc import Callable
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
        # Paths under runs/ (and human folders) the daemon cannot use, with why:
        # what `skilltrain status` shows besides the sets (epoch_1, a linked run).
        self.notices: dict[str, dict[str, str]] = {}
        self.lock = threading.RLock()
        self._dirty = False
        self.daemon_pid: int | None = None
        self.heartbeat: float | None = None

    def load(self, *, keep_bad_copy: bool = False) -> str | None:
        """Read the last saved state; a missing file means start afresh.

        A file that is not a state file (bad JSON, the wrong shape) is not
        fatal either: the state is a cache of the filesystem and is rebuilt
        from it. Returns why the file was not used, or None. `keep_bad_copy`
        (the daemon; `status` writes nothing) keeps the bad file beside it.
        """
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            return f"cannot read it ({getattr(e, 'strerror', None) or type(e).__name__})"
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise TypeError("not a JSON object")
            if raw.get("version") != STATE_VERSION:
                return None  # another version's state: start afresh, quietly
            self._load_raw(raw)
        except (ValueError, TypeError, AttributeError) as e:
            with self.lock:
                self.sets, self.steps, self.spend = {}, {}, {}
            kept = self._keep_copy(text) if keep_bad_copy else None
            reason = f"not a state file ({type(e).__name__}: {_short(e)})"
            return f"{reason}; the bad file is kept as {kept}" if kept else reason
        return None

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
                    self.sets[set_id] = SetRecord(**rec)
                except (KeyError, TypeError, ValueError):
                    continue
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

    def _keep_copy(self, text: str) -> str | None:
        copy = self.path.with_name(f"{STATE_FILE}.bad-{time.strftime('%Y%m%dT%H%M%S')}")
        try:
            atomic.write_text(copy, text)
        except OSError:
            return None
        return str(copy)

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

    def notice(self, path: str, event: str, reason: str) -> None:
        with self.lock:
            entry = {"event": event, "reason": reason}
            if self.notices.get(path) != entry:
                self.notices[path] = entry
                self._dirty = True

    def keep_notices(self, keep: Callable[[str], bool]) -> None:
        """Drop the notices of paths that no longer have a problem."""
        with self.lock:
            kept = {path: n for path, n in self.notices.items() if keep(path)}
            if kept != self.notices:
                self.notices = kept
                self._dirty = True

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
                "notices": dict(sorted(self.notices.items())),
            }
            self._dirty = False
        atomic.write_text(self.path, json.dumps(payload, separators=(",", ":")) + "\n")
        return True


def _short(error: BaseException) -> str:
    return " ".join(str(error).split())[:120]


def _record_json(rec: SetRecord) -> dict[str, Any]:
    data = asdict(rec)
    data["state"] = rec.state.value
    return data
