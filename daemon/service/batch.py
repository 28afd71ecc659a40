"""The batch transport: a step's tickets go to the provider's batch API as one batch.

    owner (a set of a run in batch mode) ──send(ticket)──> gathering (per step)
        │ step complete, or [llm] batch_gather_s passed
        v
    record "submitting" ──> upload + create (metadata skilltrain_key) ──> record "open"
        │ poll: batch_poll_s, x1.5 each time up to batch_poll_max_s; idle between
        v
    completed / expired / cancelled / failed ──> each item's reply through the
    pipeline (pipeline.py: the same checks as a live reply), its Decision to the owner

Exactly once: every set here is claimed by the owner (owner.py) from the
look that sent it until its Decision is applied, gathered, uploading or
open alike; at a restart the records' sets are claimed before the first
look (`start` returns them for `SetOwner.adopt`). The record (batch_store)
is written before the provider hears of the batch and again with its id; a
"submitting" record found at start is looked for at the provider by its key
(list + metadata) and adopted, or, when the provider has no such batch, its
sets are sent again. A result already written (its sidecar names the batch)
is not written twice.

Per run: `[llm] mode` in runs/<run>/run.toml overrides config.toml's.
`runs/<run>/CANCEL_BATCH` (`skilltrain batch cancel RUN`) cancels the run's
open batches; their unfinished sets go to the next batch, or live when the
file says "live".
"""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core import config, layout
from ..infra import log
from ..infra.batch_api import FINAL, BatchAPIError, BatchStatus, api_for, supported
from ..infra.state import SetState, StateStore
from . import batch_store
from .batch_results import Results, back
from .batch_store import CANCELLING, OPEN, SUBMITTING, BatchItem, BatchRecord
from .decision import Outcome, Ticket
from .discovery import Discovery
from .jobs import Jobs
from .pipeline import Pipeline

CONTROL_CHECK_S = 1.0  # how soon CANCEL_BATCH is seen while a batch is open or gathering
POLL_GROWTH = 1.5
Emit = Callable[..., None]


@dataclass
class Waiting:
    """A ticket gathered for its step's next batch, and the outcome its owner waits on."""

    ticket: Ticket
    outcome: Outcome


class Batcher:
    """Gathers, submits and polls batches in one thread; idle in between."""

    QUEUED_REASON: str | None = "gathered for the next batch"

    def __init__(self, cfg: config.Config, state: StateStore, emit: Emit, *,
                 stopping: threading.Event, pipeline: Pipeline, discovery: Discovery,
                 live: Jobs, wall_clock: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.runs = cfg.paths.runs
        self.state = state
        self.emit = emit
        self.log = log.get_logger("skilltrain.daemon")
        self.stopping = stopping
        self.discovery = discovery  # which sets a step is expected to have
        self.clock = clock
        self.api = api_for(cfg.llm)
        self.refuse_key = live.refuse_key  # a key refused at a poll blocks the endpoint
        self.results = Results(cfg, emit, api=self.api, pipeline=pipeline,
                               finish_paid=live.finish_paid, save=self._save,
                               closed=self._closed, clock=wall_clock,
                               refused_key=live.refused_key, refuse_key=live.refuse_key,
                               taken=self._batch_ids)
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._gathering: dict[layout.StepKey, tuple[float, dict[str, Waiting]]] = {}
        self._records: dict[str, BatchRecord] = {}  # by our key
        self._next_poll: dict[str, float] = {}
        self._interval: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        self._submitting = 0  # steps taken from gathering, not yet recorded or decided
        self._unsupported: list[str | None] = []  # [why not], once asked (imports litellm)

    # ------------------------------------------------------------- for the owner
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

    def send(self, ticket: Ticket) -> Outcome:
        """Gathered for its step's next batch; its Decision comes once its result is handled."""
        outcome = Outcome()
        with self._lock:
            _, waiting = self._gathering.setdefault(ticket.key.step_key, (self.clock(), {}))
            waiting[ticket.key.id] = Waiting(ticket, outcome)
        self._wake.set()
        return outcome

    def mode(self, run: str) -> str:
        """`[llm] mode` of runs/<run>/run.toml, else config.toml's."""
        return self.discovery.run_settings(run).llm_mode or self.cfg.llm.mode

    # ------------------------------------------------------------ life
    def start(self) -> list[tuple[Ticket, Outcome, str]]:
        """Read the records, then poll and submit in the background. Returns the
        sets they carry, for the owner to claim before the first scan (so they
        are not sent again): each one's ticket, outcome and where it is."""
        records, bad = batch_store.load_all(self.runs)
        for path in bad:
            self.emit("batch.unreadable", level="error", path=str(path))
        carried = []
        for rec in records:
            carried += self.results.recover(rec, self.discovery.works)
        with self._lock:
            for rec in records:
                if not rec.waiting():
                    self._closed(rec)
                    continue
                self._records[rec.key] = rec
                self._next_poll[rec.key] = self.clock()
                self._interval[rec.key] = self.cfg.llm.batch_poll_s
        self._thread = threading.Thread(target=self._run, name="batch", daemon=True)
        self._thread.start()
        return carried

    def stop(self, timeout_s: float = 5.0) -> None:
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.api.close()

    def busy(self) -> bool:
        with self._lock:
            return bool(self._gathering or self._records or self._submitting)

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
            self._submitting += len(taken)  # busy() until each is recorded (or decided)
        left = len(taken)
        try:
            for step, waiting in taken:
                if self.stopping.is_set():
                    return
                self.results.submit(step, [(w.ticket, w.outcome) for w in waiting.values()],
                                    self._new_record)
                with self._lock:
                    self._submitting, left = self._submitting - 1, left - 1
        finally:
            with self._lock:
                self._submitting -= left  # those left at a stop or an error
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

    def _batch_ids(self) -> set[str]:
        """The provider batches our open records own: none is another's to adopt."""
        with self._lock:
            return {rec.batch_id for rec in self._records.values() if rec.batch_id}

    def _save(self, rec: BatchRecord) -> None:
        with self._lock:
            # Only a record still open: a result handled a moment after another
            # thread closed the record would write it back, and a kill then
            # leaves a closed batch's record (or its temp file) on disk.
            if rec.key in self._records:
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
            if key not in self._records:
                return  # closed since it was found due
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
            if e.blocked:  # the key refused: the endpoint's one llm.blocked says it
                self.refuse_key(e.blocked, str(e))
            else:
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
            path = self.runs / run / layout.CANCEL_BATCH
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
                self.results.send_live(w.ticket.key.id)
            w.outcome.set_result(back(w.ticket.key, "batch cancelled"))
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
                if rec.key in self._records:  # closed meanwhile: nothing to poll
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

    path = runs / run / layout.CANCEL_BATCH
    sealed_write.write_text(path, "live\n" if live else "")
    return path
