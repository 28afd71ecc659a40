"""The step barrier and the stages after it: a step is reported once every
expected set of it is done, then its optimizer runs, then (a looped run) the
writer of the next step (daemon/service/loop.py).

    every set DONE ──> step.reported (once; marker written) ──> optimizer ──> marker_changed
                              ^                                    │ failed: retried
    a report replaced ────────┘ (reported again, re-optimized)     v         after backoff

The marker beside the reports (runs/<run>/loss/.steps/epoch_EE-step_SS.json)
is the durable record: the state database is a cache of it, so a lost or
lagging state never reports a step twice, runs its optimizer twice, or
forgets that a replaced report reopened it.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ...handlers import detached, optimizer
from ..core import backoff, config, layout
from ..core.errors import ConfigError
from ..guard import sealed_write
from ..infra import log
from ..infra.state import SetState, StateStore, StepRecord
from . import curve, retire
from .discovery import Discovery
from .observe import Fingerprint, ReportCheck

Emit = Callable[..., None]


class Steps:
    """Barrier, markers and the optimizer stage; hands finished steps to the loop."""

    def __init__(self, cfg: config.Config, state: StateStore, emit: Emit, *,
                 clock: Callable[[], float], discovery: Discovery,
                 marker_changed: threading.Event) -> None:
        self.cfg = cfg
        self.runs = cfg.paths.runs
        self.state = state
        self.emit = emit
        self.clock = clock
        self.marker_changed = marker_changed  # the loop waits on it: looks at once
        self.discovery = discovery  # which sets a step is expected to have
        self.folders = retire.StepFolders(  # a report lands while its set is the step's
            self.runs, emit, expects=discovery.expects, sets_of_step=discovery.sets_of_step)
        self.backoff = backoff.optimizer(cfg)
        self.failures = 0  # optimizer runs that failed (--once exit code)
        self.kill_optimizer = threading.Event()  # shutdown bound passed: end the optimizer
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="optimizer")
        self._futures_lock = threading.Lock()  # jobs finishing together trigger steps
        self._futures: list[Future[None]] = []
        self._pending: set[str] = set()  # step ids with an optimizer run claimed; state.lock
        self._compared: set[str] = set()  # step ids whose record met its marker; state.lock
        self.reports = ReportCheck(self.runs, cfg.paths.data, cfg.paths.prompts, cfg.llm.model)
        self._look: Callable[[layout.SetKey], None] = lambda key: None  # until served

    def serve(self, look: Callable[[layout.SetKey], None]) -> None:
        """The reconciler, once built: how a set found changed at the barrier is looked at."""
        self._look = look

    def optimized(self, step: layout.StepKey) -> bool:
        rec = self.state.steps.get(step.id)
        return bool(rec and rec.optimizer_done)

    # ---------------------------------------------------------------- barrier
    def check_unless_open(self, step: layout.StepKey) -> None:
        """check(), unless a set record of it is not DONE: "not yet" without a listing."""
        if not self.state.tally.open_in[step.id]:  # an int read: no lock needed
            self.check(step)

    def check(self, step: layout.StepKey, keys: list[layout.SetKey] | None = None) -> None:
        """When every expected set of a step is done: step.reported once, then the optimizer.

        "Done" is the state's word, a look behind the disk (an episode changed
        just now, its hint not yet looked at): each set is checked on disk once
        more; one whose report is not current holds the step back and is looked at.
        """
        asked, keys = keys, list(self.discovery.sets_of_step(step)) if keys is None else keys
        with self.state.lock:
            recorded = self._to_confirm(step, keys)
        if recorded is None:
            return
        try:  # outside the lock: stat calls, a read only of what changed
            stale = self.reports.stale(keys, self.discovery.works, recorded)
        except ConfigError:
            return  # no template to confirm against: each look at a set says why
        for key in stale:
            self._look(key)
        if stale:
            return
        retired = self.folders.retire(step, keys)
        if retired:
            self._report(step, keys)
        elif retired is None and asked is not None:  # its sets changed since the caller
            self.check(step)  # listed them: again, with its sets now
        elif retired is None:  # changed since this check listed them: a look soon checks again
            self._look(keys[0])

    def _to_confirm(self, step: layout.StepKey, keys: list[layout.SetKey]
                    ) -> dict[str, Fingerprint | None] | None:
        """Each set's fingerprint if the step is to be reported or optimized now (lock held)."""
        if not keys or not _all_done(self.state, keys):
            return None
        rec = self._record(step) or StepRecord()
        if rec.reported_at is not None and not self._due(step, rec):
            return None
        return {k.id: Fingerprint.from_json(self.state.sets[k.id].fingerprint or {})
                for k in keys}

    def _due(self, step: layout.StepKey, rec: StepRecord) -> bool:  # run its optimizer now?
        return (not rec.optimizer_done
                and (rec.optimizer_attempts < self.cfg.optimizer.max_attempts
                     or _job_out_there(self.cfg, self.runs, step))  # its last attempt, submitted
                and (rec.optimizer_next_at or 0) <= self.clock()
                and step.id not in self._pending)

    def _report(self, step: layout.StepKey, keys: list[layout.SetKey]) -> None:
        with self.state.lock:
            if not _all_done(self.state, keys):  # a look since they were confirmed
                return
            rec = self._record(step) or StepRecord()
            first_time = rec.reported_at is None
            due = self._due(step, rec)
            if first_time or due:
                rec = self.state.step(step.id)  # only now: it marks the state for a write
            if first_time:
                rec.reported_at = self.clock()
            no_command = due and not self.cfg.optimizer.command
            if no_command:
                rec.optimizer_done = True  # event only: consumers tail the log
                due = False
            elif due:
                rec.optimizer_attempts += 1
                self._pending.add(step.id)  # decided and claimed under one lock
        if first_time or no_command:
            self._write_marker(step)  # one write says both when there is nothing to run
        if first_time:
            again: dict[str, Any] = ({"again": True, "reason": rec.reopened_reason}
                                     if rec.generation else {})
            self.emit("step.reported", run=step.run, epoch=step.epoch, step=step.step,
                      reports_dir=str(step.reports_dir(self.runs)), sets=len(keys),
                      **again, **curve.step_fields(self.runs, step))
            _cost_total(self.state, self.emit, step.run)
        if first_time or no_command:
            self.marker_changed.set()
        if due:
            self._trigger_optimizer(step)

    def reopen(self, key: layout.SetKey) -> None:
        """A new report in a step already reported: the optimizer learnt from the
        report this one replaces, so the step is reported again and re-optimized."""
        step = key.step_key
        with self.state.lock:
            # After a lost or lagging state the step's marker file still knows.
            rec = self._record(step)
            if rec is None or rec.reported_at is None:
                return
            rec.reported_at = None
            rec.optimizer_done = False
            rec.optimizer_attempts = 0
            rec.optimizer_exit_code = None
            rec.optimizer_next_at = None
            rec.generation += 1
            rec.reopened_reason = f"report {key.id} replaced"
            self.state.put_step(step.id, rec)
        self._write_marker(step)

    def optimizer_exhausted(self, step: layout.StepKey) -> int | None:
        """The attempts used when every one failed and none is running; else None.

        Asked of the state, not the marker: the marker says an attempt is
        used when it starts, so its last attempt would look failed while it runs.
        """
        with self.state.lock:
            rec = self.state.steps.get(step.id)
            if (rec is None or rec.optimizer_done or step.id in self._pending
                    or rec.optimizer_attempts < self.cfg.optimizer.max_attempts
                    or _job_out_there(self.cfg, self.runs, step)):
                return None
            return rec.optimizer_attempts

    def retry_optimizer(self, step: layout.StepKey) -> None:
        """The user's RETRY of a run stalled on this step's optimizer: fresh
        attempts, and a run now (the failed ones stay in the log)."""
        with self.state.lock:
            rec = self._record(step)
            if rec is None or rec.optimizer_done:
                return
            rec = self.state.step(step.id)  # marks it for a write
            rec.optimizer_attempts = 0
            rec.optimizer_next_at = None
        self._write_marker(step)
        self.check(step)

    # ---------------------------------------------------------------- markers
    def _record(self, step: layout.StepKey) -> StepRecord | None:
        """The step's record: the state's, unless the step's marker is newer.

        The state lags the marker by up to a flush: after a SIGKILL in
        between, a record read at the start may miss the optimizer's end (it
        would run twice) or the step's reopening by a replaced report (the
        optimizer would never learn from the new one). Each record is
        compared once per process, at its first use (state.lock held): later
        changes are this process's own, written to both.
        """
        rec = self.state.steps.get(step.id)
        if rec is None:
            return self._from_marker(step)
        if step.id not in self._compared:
            self._compared.add(step.id)
            if _marker_is_newer(curve.read_step_marker(self.runs, step), rec):
                return self._from_marker(step) or rec
        return rec

    def _from_marker(self, step: layout.StepKey) -> StepRecord | None:
        """The step's record from its marker file, when the state was lost.

        The state is a cache; the marker beside the reports is what keeps
        step.reported (and the optimizer) from happening twice after it is
        deleted or corrupted.
        """
        try:
            data = json.loads(self._marker(step).read_text("utf-8"))
            rec = StepRecord(**data)
        except (OSError, ValueError, TypeError):
            return None
        self.state.put_step(step.id, rec)
        return rec

    def _marker(self, step: layout.StepKey) -> Path:
        # Beside the reports folders, not in them: the optimizer reads those.
        return step.marker(self.runs)

    def _write_marker(self, step: layout.StepKey) -> None:
        with self.state.lock:
            rec = self.state.steps.get(step.id)
            payload = json.dumps(asdict(rec)) if rec else None
        if payload is not None:
            try:
                sealed_write.write_text(self._marker(step), payload + "\n")
            except OSError as e:
                self.emit("step.marker_failed", level="warning", step=step.id,
                          error=e.strerror or type(e).__name__)

    # -------------------------------------------------------------- optimizer
    def _trigger_optimizer(self, step: layout.StepKey) -> None:
        future = self.pool.submit(self._run_optimizer, step)
        future.add_done_callback(log.report_task_failure)
        with self._futures_lock:
            self._futures = [f for f in self._futures if not f.done()]
            self._futures.append(future)

    def _run_optimizer(self, step: layout.StepKey) -> None:
        values = {"run": step.run, "epoch": f"{step.epoch:02d}", "step": f"{step.step:02d}",
                  "reports_dir": str(step.reports_dir(self.runs)),
                  "run_dir": str(step.run_dir(self.runs))}
        fields: dict[str, Any] = {"run": step.run, "epoch": step.epoch, "step": step.step}
        bad_command: optimizer.OptimizerResult | None = None
        try:
            argv = optimizer.render_argv(self.cfg.optimizer.command, values)
        except ConfigError as e:
            # A placeholder only these values break ({epoch[4]}): a failed
            # attempt like any other, never a step left claimed for good.
            argv, bad_command = [], optimizer.OptimizerResult(None, 0, str(e))

        def emit(event: str, **kw: Any) -> None:
            # The output relays are plain threads: bound context does not reach them.
            self.emit(event, **fields, **kw)

        with self.state.lock:
            generation = self.state.step(step.id).generation
        with log.bound_job(**fields):
            try:
                result = bad_command or self._optimize(step, argv, emit)
            except BaseException:
                with self.state.lock:
                    self._pending.discard(step.id)
                raise
            with self.state.lock:
                # Unclaimed with its outcome recorded, in one step: the loop asks
                # optimizer_exhausted and must not see one without the other.
                self._pending.discard(step.id)
                rec = self.state.step(step.id)  # under the lock: a flush sees all or nothing
                reopened = rec.generation != generation
                if result.reattached:
                    rec.optimizer_attempts -= 1  # counted once, when its job was submitted
                # A job left running at a stop is no failure: the next start waits for it.
                if not (reopened or result.detached):  # reopened: this run is not the last
                    rec.optimizer_exit_code = result.exit_code
                    rec.optimizer_done = result.exit_code == 0
                    if not rec.optimizer_done:
                        wait_s = self.backoff.delay_s(rec.optimizer_attempts)
                        rec.optimizer_next_at = self.clock() + wait_s
            self._write_marker(step)
            if result.detached:
                emit("optimizer.stopped", reason=result.reason)
                return
            if result.exit_code != 0:
                self.failures += 1
            # With the step's fields, not only its bound context: /metrics counts
            # the failures per run from the event itself.
            emit("optimizer.finished", level="info" if result.exit_code == 0 else "error",
                 exit_code=result.exit_code, duration_ms=result.duration_ms)
            if result.reason is not None:
                emit("optimizer.failed", level="error", reason=result.reason,
                     attempt=rec.optimizer_attempts,
                     will_retry=rec.optimizer_attempts < self.cfg.optimizer.max_attempts)
            self.marker_changed.set()  # after the events: the next writer's come later
        if reopened:
            self.check(step)

    def _optimize(self, step: layout.StepKey, argv: list[str], emit: Emit
                  ) -> optimizer.OptimizerResult:
        cfg = self.cfg.optimizer
        if cfg.outlives_daemon:
            return detached.run(argv, handle=detached.handle_path(self.runs, step, "optimizer"),
                                stage="optimizer", timeout_s=cfg.timeout_s, emit=emit,
                                cancel=self.kill_optimizer,
                                started=lambda: self.emit("optimizer.started", argv=argv))
        self.emit("optimizer.started", argv=argv)
        return optimizer.run(argv, timeout_s=cfg.timeout_s, emit=emit,
                             cancel=self.kill_optimizer)

    # --------------------------------------------------------------- shutdown
    def optimizer_runs(self) -> list[Future[None]]:
        """Optimizer runs submitted and not yet known to be done."""
        with self._futures_lock:
            return list(self._futures)

    def wait_optimizers(self) -> None:
        """--once: every optimizer run this process started has ended."""
        for future in self.optimizer_runs():
            future.result()

    def stop_intake(self) -> None:
        """No new optimizer runs; one not started yet is retried at the next start."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.cfg.optimizer.outlives_daemon:
            # Only a waiting client to end: its job runs on, the next start waits for it.
            self.kill_optimizer.set()


def _cost_total(state: StateStore, emit: Emit, run: str) -> None:
    """The run's spend, once per step reported (not per job; and at stop)."""
    spend = state.spend.get(run)
    if spend is not None:
        emit("cost.total", run=run, tokens_in=spend.tokens_in, tokens_out=spend.tokens_out,
             cost_usd=round(spend.cost_usd, 6), tokens_cached=spend.tokens_cached,
             tokens_cache_write=spend.tokens_cache_write)


def _job_out_there(cfg: config.Config, runs: Path, step: layout.StepKey) -> bool:
    """An optimizer job an earlier daemon submitted, not known to have ended."""
    return (cfg.optimizer.outlives_daemon
            and detached.handle_path(runs, step, "optimizer").exists())


def _all_done(state: StateStore, keys: list[layout.SetKey]) -> bool:
    """Every set is DONE in the state (state.lock held)."""
    return all((r := state.sets.get(k.id)) and r.state == SetState.DONE for k in keys)


def _marker_is_newer(marker: dict[str, Any], rec: StepRecord) -> bool:
    """Whether the marker records a later moment of the step than `rec`.

    A reopening raises the generation and is written to the marker at once;
    within a generation "optimizer done" never turns false again. A marker
    that failed to be written (step.marker_failed) is older, never newer.
    """
    generation = marker.get("generation", 0)
    if not isinstance(generation, int):
        return False
    if generation != rec.generation:
        return generation > rec.generation
    return bool(marker.get("optimizer_done")) and not rec.optimizer_done
