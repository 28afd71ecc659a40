"""Batch mode: a step's ready sets go to the provider's batch API as one batch.

    jobs (set wanted, run in batch mode) ──enqueue──> gathering (per step)
        │ step complete, or [llm] batch_gather_s passed
        v
    record "submitting" ──> upload + create (metadata skilltrain_key) ──> record "open"
        │ poll: batch_poll_s, x1.5 each time up to batch_poll_max_s; idle between
        v
    completed / expired / cancelled / failed ──> each item back to jobs: the same
    checks as a live reply (handlers/loss.finish), the same retries and barrier

Exactly once: the record (batch_store) is written before the provider hears
of the batch and again with its id; a "submitting" record found at start is
looked for at the provider by its key (list + metadata) and adopted, or,
when the provider has no such batch, its sets are sent again. A set carried
by an open record is never queued again; a result already written (its
sidecar names the batch) is not written twice.

Per run: `[llm] mode` in runs/<run>/run.toml overrides config.toml's.
`runs/<run>/CANCEL_BATCH` (`skilltrain batch cancel RUN`) cancels the run's
open batches; their unfinished sets go to the next batch, or live when the
file says "live".
"""
from __future__ import annotations

import threading
import time
import tomllib
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from ..core import config, dataset, layout
from ..core.templates import PromptTemplates
from ..infra import log
from ..infra.batch_api import FINAL, BatchAPI, BatchAPIError, BatchStatus, supported
from ..infra.state import SetState, StateStore
from . import batch_store
from .batch_results import Results
from .batch_store import CANCELLING, OPEN, SUBMITTING, BatchItem, BatchRecord
from .discovery import Discovery
from .observe import Fingerprint
from .revisit import Revisits

CANCEL_FILE = "CANCEL_BATCH"  # in runs/<run>/
CONTROL_CHECK_S = 1.0  # how soon CANCEL_BATCH is seen while a batch is open or gathering
POLL_GROWTH = 1.5
Emit = Callable[..., None]


@dataclass
class Waiting:
    """A set gathered for its step's next batch."""

    key: layout.SetKey
    work: dataset.Work
    fp: Fingerprint
    attempts: int


class Batcher:
    """Gathers, submits and polls batches in one thread; idle in between."""

    def __init__(self, cfg: config.Config, state: StateStore, emit: Emit, *,
                 stopping: threading.Event, templates: PromptTemplates,
                 discovery: Discovery, run_result: Callable[..., Future[None]],
                 revisits: Revisits,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.runs = cfg.paths.runs
        self.state = state
        self.emit = emit
        self.log = log.get_logger("skilltrain.daemon")
        self.stopping = stopping
        self.discovery = discovery  # which sets a step is expected to have
        self.revisits = revisits  # a set handed back to live jobs is looked at at once
        self.clock = clock
        self.api = BatchAPI(cfg.llm)
        self.results = Results(cfg, state, emit, api=self.api, templates=templates,
                               works=lambda: discovery.works,
                               run_result=run_result, revisits=revisits,
                               save=self._save, closed=self._closed)
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._gathering: dict[layout.StepKey, tuple[float, dict[str, Waiting]]] = {}
        self._records: dict[str, BatchRecord] = {}  # by our key
        self._next_poll: dict[str, float] = {}
        self._interval: dict[str, float] = {}
        self._modes: dict[str, tuple[int, str]] = {}  # run -> (run.toml mtime_ns, mode)
        self._said_mode: set[str] = set()
        self._thread: threading.Thread | None = None
        self._unsupported: list[str | None] = []  # [why not], once asked (imports litellm)

    # ------------------------------------------------------------- for jobs
    def wants(self, key: layout.SetKey) -> bool:
        """Is this set's run in batch mode (and not sent live once after a failure)?"""
        if self.mode(key.run) != "batch" or self.unsupported():
            return False
        return not self.results.take_live(key.id)

    def unsupported(self) -> str | None:
        """Why [llm] model cannot go through a batch API (said once; such runs stay live)."""
        with self._lock:
            if not self._unsupported:
                self._unsupported.append(supported(self.cfg.llm))
                if self._unsupported[0]:
                    self.emit("batch.unsupported", level="warning", model=self.cfg.llm.model,
                              reason=f"{self._unsupported[0]}; runs in batch mode stay live")
            return self._unsupported[0]

    def carries(self, set_id: str) -> bool:
        """Gathered, or in a batch whose result for it is not handled yet."""
        with self._lock:
            if any(set_id in waiting for _, waiting in self._gathering.values()):
                return True
            return any(item.set_id == set_id and item.outcome is None and not item.dispatched
                       for rec in self._records.values() for item in rec.items)

    def enqueue(self, key: layout.SetKey, work: dataset.Work, fp: Fingerprint,
                attempts: int) -> None:
        with self._lock:
            if self.carries(key.id):
                return
            since, waiting = self._gathering.setdefault(key.step_key, (self.clock(), {}))
            waiting[key.id] = Waiting(key, work, fp, attempts)
        self.state.update(key.id, SetState.QUEUED, reason="gathered for the next batch")
        self._wake.set()

    def mode(self, run: str) -> str:
        """`[llm] mode` of runs/<run>/run.toml, else config.toml's."""
        path = self.runs / run / "run.toml"
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            return self.cfg.llm.mode
        cached = self._modes.get(run)
        if cached and cached[0] == mtime:
            return cached[1]
        mode = self.cfg.llm.mode
        try:
            llm_table = tomllib.loads(path.read_text(encoding="utf-8")).get("llm", {})
            value = llm_table.get("mode", mode) if isinstance(llm_table, dict) else mode
        except (OSError, ValueError):
            value = mode
        if value in ("live", "batch"):
            mode = value
        elif run not in self._said_mode:
            self._said_mode.add(run)
            self.emit("set.ignored", level="warning", path=str(path),
                      reason=f"[llm] mode = {value!r} is not \"live\" or \"batch\"; "
                      f"using {mode!r}")
        self._modes[run] = (mtime, mode)
        return mode

    # ------------------------------------------------------------ life
    def start(self) -> None:
        """Read the records (before the first scan: their sets are not queued
        again), then poll and submit in the background."""
        records, bad = batch_store.load_all(self.runs)
        for path in bad:
            self.emit("batch.unreadable", level="error", path=str(path))
        with self._lock:
            for rec in records:
                self._records[rec.key] = rec
                self._next_poll[rec.key] = self.clock()
                self._interval[rec.key] = self.cfg.llm.batch_poll_s
        for rec in records:
            for item in rec.waiting():
                self.state.update(item.set_id, SetState.QUEUED,
                                  reason=f"in batch {rec.batch_id or rec.key}")
        self._thread = threading.Thread(target=self._run, name="batch", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.api.close()

    def busy(self) -> bool:
        with self._lock:
            return bool(self._gathering or self._records)

    def wait_idle(self, wait_jobs: Callable[[], None], stop: threading.Event) -> None:
        """--once: every job, and every batch the run sent, has ended."""
        wait_jobs()
        while self.busy() and not stop.wait(CONTROL_CHECK_S):
            wait_jobs()
        wait_jobs()

    def snapshot(self) -> tuple[int, dict[str, int]]:
        """Open batches, and their items by state (for the metrics)."""
        with self._lock:
            items: dict[str, int] = {"gathering": sum(len(w) for _, w in
                                                      self._gathering.values())}
            for rec in self._records.values():
                for item in rec.items:
                    name = ("waiting" if item.outcome is None and not item.dispatched else
                            "handling" if item.outcome is None else item.outcome)
                    items[name] = items.get(name, 0) + 1
            return len(self._records), items

    # ------------------------------------------------------------ the loop
    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                self._tick()
            except Exception:
                self.log.exception("batch.error", reason="internal error")
            if self.stopping.is_set():
                break
            self._wake.wait(self._next_wake())
            self._wake.clear()

    def _next_wake(self) -> float | None:
        """Seconds to the next thing due; None: nothing to do until enqueued."""
        with self._lock:
            due = [since + self.cfg.llm.batch_gather_s for since, _ in self._gathering.values()]
            due += list(self._next_poll.values())
            if not due:
                return None
            return max(0.0, min(min(due) - self.clock(), CONTROL_CHECK_S))

    def _tick(self) -> None:
        self._check_cancel_files()
        now = self.clock()
        with self._lock:
            steps = [step for step, (since, waiting) in self._gathering.items()
                     if now >= since + self.cfg.llm.batch_gather_s
                     or self._step_gathered(step, waiting)]
            taken = [(step, self._gathering.pop(step)[1]) for step in steps]
        for step, waiting in taken:
            if self.stopping.is_set():
                return
            self.results.submit(step, list(waiting.values()), self._new_record)
        with self._lock:
            due = [rec for key, rec in self._records.items() if self._next_poll[key] <= now]
        for rec in due:
            if self.stopping.is_set():
                return
            self._poll(rec)

    def _step_gathered(self, step: layout.StepKey, waiting: dict[str, Waiting]) -> bool:
        """Every set of the step that is not done is gathered: no reason to wait."""
        for key in self.discovery.sets_of_step(step):
            rec = self.state.get(key.id)
            if key.id not in waiting and not (rec and rec.state == SetState.DONE):
                return False
        return True

    def _new_record(self, step: layout.StepKey, items: list[BatchItem]) -> BatchRecord:
        rec = BatchRecord(key=uuid.uuid4().hex, run=step.run, step=step.id,
                          model=self.cfg.llm.model, items=items)
        with self._lock:
            self._records[rec.key] = rec
            self._interval[rec.key] = self.cfg.llm.batch_poll_s
            self._next_poll[rec.key] = self.clock() + self.cfg.llm.batch_poll_s
        return rec

    def _save(self, rec: BatchRecord) -> None:
        with self._lock:
            batch_store.save(self.runs, rec)

    def _closed(self, rec: BatchRecord) -> None:
        with self._lock:
            self._records.pop(rec.key, None)
            self._next_poll.pop(rec.key, None)
            self._interval.pop(rec.key, None)
            batch_store.remove(self.runs, rec)
        self._wake.set()

    def _poll(self, rec: BatchRecord) -> None:
        key = rec.key
        with self._lock:
            interval = self._interval[key]
            self._interval[key] = min(interval * POLL_GROWTH, self.cfg.llm.batch_poll_max_s)
            self._next_poll[key] = self.clock() + interval
        if rec.state == SUBMITTING:
            self.results.resolve_submitting(rec)
            return
        if not rec.waiting() or rec.batch_id is None:
            return  # its results are being handled
        try:
            status = self.api.retrieve(rec.batch_id)
        except BatchAPIError as e:
            self.emit("batch.error", level="warning", run=rec.run, batch_id=rec.batch_id,
                      error=str(e))
            return
        self._progress(rec, status)
        if status.status in FINAL:
            with self._lock:
                self._next_poll[key] = float("inf")  # handled now; closed when its items end
            self.results.close(rec, status)

    def _progress(self, rec: BatchRecord, status: BatchStatus) -> None:
        if status.counts == rec.counts and status.status == rec.provider_status:
            return
        rec.counts, rec.provider_status = status.counts, status.status
        self._save(rec)
        self.emit("batch.progress", run=rec.run, step=rec.step, batch_id=rec.batch_id,
                  status=status.status, **{f"requests_{k}": v for k, v in status.counts.items()})

    # ------------------------------------------------------------ cancel
    def _check_cancel_files(self) -> None:
        with self._lock:
            runs = {rec.run for rec in self._records.values()}
            runs |= {step.run for step in self._gathering}
        for run in sorted(runs):
            path = self.runs / run / CANCEL_FILE
            if path.exists():
                self.cancel(run, live=_says_live(path))
                path.unlink(missing_ok=True)

    def cancel(self, run: str, *, live: bool) -> None:
        """Cancel a run's batches: gathered sets go back now, open batches
        are cancelled at the provider (their finished items still count)."""
        with self._lock:
            gathered = [w for step in [s for s in self._gathering if s.run == run]
                        for w in self._gathering.pop(step)[1].values()]
            records = [rec for rec in self._records.values()
                       if rec.run == run and rec.state == OPEN]
        for w in gathered:
            if live:
                self.results.send_live(w.key.id)
            self.state.update(w.key.id, SetState.QUEUED, reason="batch cancelled")
            self.revisits.look(w.key)
        for rec in records:
            rec.state, rec.return_live = CANCELLING, live
            self._save(rec)
            try:
                assert rec.batch_id is not None
                self.api.cancel(rec.batch_id)
            except BatchAPIError as e:
                self.emit("batch.error", level="warning", run=run, batch_id=rec.batch_id,
                          error=str(e))
            with self._lock:
                self._next_poll[rec.key] = self.clock()
                self._interval[rec.key] = self.cfg.llm.batch_poll_s
        self.emit("batch.cancel_requested", run=run, batches=len(records),
                  gathered=len(gathered), to="live" if live else "batch")


def _says_live(path: Path) -> bool:
    try:
        return path.read_text(encoding="utf-8").strip().lower() == "live"
    except (OSError, UnicodeDecodeError):
        return False


def write_cancel_file(runs: Path, run: str, *, live: bool) -> Path:
    """`skilltrain batch cancel RUN`: the daemon cancels at its next look (a second)."""
    from ..guard import sealed_write

    path = runs / run / CANCEL_FILE
    sealed_write.write_text(path, "live\n" if live else "")
    return path
