"""The closed loop: a looped run advances writer -> loss -> optimizer, step after step.

    start ──> writing(E,S) ──> scoring ──> optimizing ──> stop rule? ──yes──> finished(reason)
                  ^                                           │ no
                  └─────────── writing(next step) <───────────┘

writing: the loop runs the writer (handlers/writer.py) for epoch E step S.
scoring: the daemon scores the episodes as it does any writer's (loss jobs).
optimizing: the daemon's step barrier saw the step reported and runs the
optimizer. The loop launches only the writer; it learns that the other two
stages finished from the step marker the daemon writes
(runs/<run>/loss/.steps/epoch_EE-step_SS.json: `reported_at`,
`optimizer_done`), not from a record of its own, so each fact has one record.

Exactly once across SIGKILL: every transition is written to the run's record
(daemon/service/run_record.py, atomic + fsync) before the next stage starts, and
the machine is level-triggered: at start and every TICK_S it reads each
run's record and marker and does what they say is next. A stage recorded as
started but not finished is run again (the writer; the daemon re-runs an
optimizer whose marker does not say done); a finished one is never repeated.
The steps own the optimizer's attempts (daemon/service/steps.py): the loop
asks them whether a step's are used up (its run stalls) and hands them the
user's RETRY. A changed marker sets `wake` (the steps hold the same event)
and a finished writer asks for a rescan: both only make things happen sooner.

Next step: step + 1, or epoch + 1 and step 0 after `steps_per_epoch`. Stop
rules, checked when the optimizer of a step has finished: `stop_below` (the
step's craft distance at or under it), `patience` (that many steps without
a better distance than the best so far), `[llm] budget_usd` (the run's spend;
also checked while scoring, where the budget holds the loss jobs), and
`max_epochs`. The craft distance is curve.run_rows', the same numbers
`skilltrain progress` shows.

The user steers with files in runs/<run>/: START (what `skilltrain start`
writes; an empty run folder also starts), PAUSE (no new writer while it
exists; the stages in flight finish), RETRY (a stalled run tries again;
the loop deletes the file when it acts on it).
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ...handlers import writer
from ...handlers.optimizer import OptimizerResult
from ..core import backoff, config, layout
from ..infra import log
from . import curve, discovery
from .revisit import Revisits
from .run_record import PAUSE, RETRY, START, Phase, RunRecord
from .run_record import read as read_record
from .run_record import write as write_record
from .steps import Steps

TICK_S = 0.5  # how soon a control file (START, PAUSE, RETRY) or a new run folder is seen
WRITERS = 4  # runs writing at once
Emit = Callable[..., None]


def stop_reason(loop: config.LoopConfig, distances: list[float | None], *,
                over_budget: bool, next_epoch: int) -> str | None:
    """Why the run ends after its last reported step (distances: every step so far, in order)."""
    known = [d for d in distances if d is not None]
    if loop.stop_below is not None and distances and distances[-1] is not None \
            and distances[-1] <= loop.stop_below:
        return "stop_below"
    if loop.patience is not None and known:
        best = known.index(min(known))
        if len(known) - 1 - best >= loop.patience:
            return "patience"
    if over_budget:
        return "budget"
    if next_epoch >= loop.max_epochs:
        return "max_epochs"
    return None


class Loop:
    """Owns the looped runs' phase machine and their writers. Cheap to build; start() runs it."""

    def __init__(self, cfg: config.Config, emit: Emit, *, stopping: threading.Event,
                 over_budget: Callable[[str], bool], revisits: Revisits, steps: Steps,
                 wake: threading.Event, once: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        self.enabled = cfg.loop is not None and not once
        self.loop_cfg = cfg.loop or config.LoopConfig()
        self.writer_cfg = cfg.writer
        self.writer_backoff = backoff.writer(cfg)
        self.runs = cfg.paths.runs
        self.emit = emit
        self.stopping = stopping  # the daemon's intake flag: once set, no writer starts
        self.over_budget = over_budget
        self.revisits = revisits  # a finished writer's episodes are looked at at once
        self.steps = steps  # the optimizer's attempts: all failed? the user's RETRY
        self.clock = clock
        self.log = log.get_logger("skilltrain.loop")
        self._lock = threading.Lock()  # record transitions, one at a time
        self._wake = wake  # set by the steps when a marker changes: look now, not at the tick
        self._cancel = threading.Event()  # the shutdown bound passed: kill the writers
        self._writing: dict[str, Future[None]] = {}  # run -> its writer in flight
        self._held: set[str] = set()  # runs whose PAUSE hold was logged
        self._writing_steps: dict[str, tuple[int, int]] = {}  # run -> (epoch, step) in writing
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(WRITERS, thread_name_prefix="writer")

    # -------------------------------------------------------------- lifecycle
    def prepare(self) -> None:
        """Before the daemon's first scan: read which steps are still being written,
        so none of their sets is scored (the config is checked by the preflight)."""
        if not self.enabled:
            return
        for run in self._run_names():
            rec = read_record(self.runs, run)
            if rec is not None:
                self._note(run, rec)

    def writing(self, step: layout.StepKey) -> bool:
        """Is this step's writer still to finish? (The daemon holds its sets until then.)"""
        return self._writing_steps.get(step.run) == (step.epoch, step.step)

    def start(self) -> None:
        if not self.enabled:
            return
        for run in self._run_names():
            rec = read_record(self.runs, run)
            if rec is not None and rec.stalled and rec.phase == Phase.WRITING:
                self._resume(run, rec, "restart")
        self._thread = threading.Thread(target=self._tick, name="loop", daemon=True)
        self._thread.start()

    def stop(self, wait_s: float) -> None:
        """After the daemon stopped intake: let writers finish up to wait_s, then kill them.

        A killed writer is not a failed attempt: its step is still recorded as
        writing, so the next start runs it again (or, `outlives_daemon`, waits
        for the job it submitted).
        """
        if not self.enabled:
            return
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            futures = list(self._writing.values())
        if self.writer_cfg.outlives_daemon:
            wait_s = 0  # only a waiting client to end: the job runs on, the next start waits
        deadline = time.monotonic() + wait_s
        for future in futures:
            with contextlib.suppress(Exception):
                future.result(timeout=max(0.0, deadline - time.monotonic()))
        self._cancel.set()
        for future in futures:
            with contextlib.suppress(Exception):
                future.result(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _tick(self) -> None:
        while not self.stopping.is_set():
            self._wake.clear()
            for run in self._run_names():
                try:
                    self.reconcile(run)
                except Exception:
                    self.log.exception("loop.error", run=run)
            self._wake.wait(TICK_S)

    def _run_names(self) -> list[str]:
        return discovery.usable_runs(self.runs)  # the scan's runs: never a symlink

    # ---------------------------------------------------------- phase machine
    def reconcile(self, run: str) -> None:
        """Read the run's record and marker; make every transition they allow now."""
        with self._lock:
            if run in self._writing:
                return  # its writer's end makes the next transition
            rec = read_record(self.runs, run)
            if rec is None:
                trigger = self._start_trigger(run)
                if trigger is None:
                    return  # not a looped run: scored as any writer's, never advanced
                rec = RunRecord()
                self._save(run, rec)
                self.emit("run.started", run=run, trigger=trigger,
                          steps_per_epoch=self.loop_cfg.steps_per_epoch,
                          max_epochs=self.loop_cfg.max_epochs)
            while self._transition(run, rec):
                pass

    def _start_trigger(self, run: str) -> str | None:
        run_dir = self.runs / run
        if layout.control_file(self.runs, run, START).is_file():
            return "start"
        try:
            empty = not any(run_dir.iterdir())
        except OSError:
            return None
        return "empty folder" if empty else None

    def _transition(self, run: str, rec: RunRecord) -> bool:
        """One transition, recorded before anything it starts; False: nothing to do now."""
        if rec.phase == Phase.FINISHED:
            return False
        if rec.stalled:
            if not self._take(run, RETRY):
                return False
            self._resume(run, rec, "RETRY")
            if rec.phase == Phase.OPTIMIZING:
                # Its attempts are used up: the step gets fresh ones, or it stalls again.
                self.steps.retry_optimizer(layout.StepKey(run, rec.epoch, rec.step))
            return True
        if rec.phase == Phase.WRITING:
            self._maybe_write(run, rec)
            return False
        step = layout.StepKey(run, rec.epoch, rec.step)
        marker = curve.read_step_marker(self.runs, step)
        if rec.phase == Phase.SCORING:
            if marker.get("reported_at") is not None:
                rec.phase = Phase.OPTIMIZING
                self._save(run, rec)
                return True
            if self.over_budget(run):
                return self._finish(run, rec, "budget")
            return False
        if marker.get("optimizer_done"):
            return self._after_step(run, rec)
        attempts = self.steps.optimizer_exhausted(step)  # not while its last attempt runs
        if attempts is not None:
            rec.stalled = f"the optimizer failed {attempts} times"
            self._save(run, rec)
            self.emit("run.stalled", level="error", run=run, epoch=rec.epoch, step=rec.step,
                      phase=rec.phase.value, reason=rec.stalled)
        return False

    def _after_step(self, run: str, rec: RunRecord) -> bool:
        """The optimizer learned from (E,S): finish by a stop rule, or record the next step."""
        rows = [r for r in curve.run_rows(self.runs, run) if (r.epoch, r.step) <= rec.step_key]
        epoch, step = rec.epoch, rec.step + 1
        if step >= self.loop_cfg.steps_per_epoch:
            epoch, step = epoch + 1, 0
        reason = stop_reason(self.loop_cfg, [r.craft_distance for r in rows],
                             over_budget=self.over_budget(run), next_epoch=epoch)
        if reason is not None:
            return self._finish(run, rec, reason, rows)
        done = rows[-1].craft_distance if rows else None
        rec.epoch, rec.step, rec.phase = epoch, step, Phase.WRITING
        rec.writer_failures, rec.next_writer_at = 0, None
        self._save(run, rec)
        self.emit("run.advanced", run=run, epoch=epoch, step=step, craft_distance=done)
        return True

    def _finish(self, run: str, rec: RunRecord, reason: str,
                rows: list[curve.StepRow] | None = None) -> bool:
        rows = curve.run_rows(self.runs, run) if rows is None else rows
        known = [r.craft_distance for r in rows if r.craft_distance is not None]
        rec.phase, rec.finished = Phase.FINISHED, reason
        self._save(run, rec)
        self.emit("run.finished", run=run, reason=reason, epoch=rec.epoch, step=rec.step,
                  steps=len(rows), craft_distance=rows[-1].craft_distance if rows else None,
                  best_craft_distance=min(known) if known else None)
        return True

    def _resume(self, run: str, rec: RunRecord, trigger: str) -> None:
        rec.stalled, rec.writer_failures, rec.next_writer_at = None, 0, None
        self._save(run, rec)
        self.emit("run.resumed", run=run, epoch=rec.epoch, step=rec.step, trigger=trigger)

    def _save(self, run: str, rec: RunRecord) -> None:
        """Record a transition (atomic, fsync) before the stage it names starts."""
        write_record(self.runs, run, rec)
        self._note(run, rec)

    def _note(self, run: str, rec: RunRecord) -> None:
        if rec.phase == Phase.WRITING:
            self._writing_steps[run] = rec.step_key
        else:
            self._writing_steps.pop(run, None)

    def _take(self, run: str, name: str) -> bool:
        """Consume a one-shot control file (RETRY): True when it was there."""
        try:
            (self.runs / run / name).unlink()
        except FileNotFoundError:
            return False
        return True

    # ----------------------------------------------------------------- writer
    def _maybe_write(self, run: str, rec: RunRecord) -> None:
        if self.stopping.is_set():
            return
        if layout.control_file(self.runs, run, PAUSE).exists():
            if run not in self._held:
                self._held.add(run)
                self.emit("run.paused", run=run, epoch=rec.epoch, step=rec.step)
            return
        if run in self._held:
            self._held.discard(run)
            self.emit("run.resumed", run=run, epoch=rec.epoch, step=rec.step, trigger="PAUSE")
        if rec.next_writer_at is not None and rec.next_writer_at > self.clock():
            return
        step = layout.StepKey(run, rec.epoch, rec.step)
        job = writer.WriterJob(step, self._previous(step))
        self._writing[run] = self._pool.submit(self._write, job, rec.writer_failures + 1)

    def _previous(self, step: layout.StepKey) -> layout.StepKey | None:
        if step.step > 0:
            return layout.StepKey(step.run, step.epoch, step.step - 1)
        if step.epoch > 0:
            return layout.StepKey(step.run, step.epoch - 1, self.loop_cfg.steps_per_epoch - 1)
        return None

    def _write(self, job: writer.WriterJob, attempt: int) -> None:
        fields = job.log_fields()

        def emit(event: str, **kw: Any) -> None:
            # The output relays are plain threads: bound context does not reach them.
            self.emit(event, **fields, **kw)

        try:
            with log.bound_job(**fields):
                result = writer.run(self.writer_cfg.command, job, self.runs,
                                    timeout_s=self.writer_cfg.timeout_s, emit=emit,
                                    attempt=attempt, cancel=self._cancel,
                                    outlives_daemon=self.writer_cfg.outlives_daemon)
                self._written(job, attempt, result, emit)
        except Exception:
            self.log.exception("writer.error", **fields)
        finally:
            with self._lock:
                self._writing.pop(job.step.run, None)
            self._wake.set()

    def _written(self, job: writer.WriterJob, attempt: int, result: OptimizerResult,
                 emit: Emit) -> None:
        """Record the writer's end before anything else: scoring, a retry, or a stall."""
        run = job.step.run
        with self._lock:
            rec = read_record(self.runs, run)
            if rec is None or rec.phase != Phase.WRITING \
                    or rec.step_key != (job.step.epoch, job.step.step):
                return  # the record moved on (edited by hand): this writer's end is no news
            if result.exit_code == 0:
                rec.phase, rec.writer_failures, rec.next_writer_at = Phase.SCORING, 0, None
                self._save(run, rec)
                emit("writer.finished", exit_code=0, duration_ms=result.duration_ms,
                     attempt=attempt)
                self.revisits.scan_soon()  # the episodes are there: no need to wait for a hint
                return
            if self._cancel.is_set():
                emit("writer.stopped", reason=result.reason, attempt=attempt)  # runs at next start
                return
            rec.writer_failures += 1
            will_retry = rec.writer_failures < self.writer_cfg.max_attempts
            wait_s = self.writer_backoff.delay_s(rec.writer_failures)
            if will_retry:
                rec.next_writer_at = self.clock() + wait_s
            else:
                rec.stalled = f"the writer failed {rec.writer_failures} times: {result.reason}"
            self._save(run, rec)
            emit("writer.finished", level="error", exit_code=result.exit_code,
                 duration_ms=result.duration_ms, attempt=attempt)
            emit("writer.failed", level="error", reason=result.reason, attempt=attempt,
                 will_retry=will_retry, next_attempt_s=round(wait_s, 3) if will_retry else None)
            if not will_retry:
                emit("run.stalled", level="error", phase=rec.phase.value, reason=rec.stalled)

