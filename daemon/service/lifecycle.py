"""The service's life: build the parts, start, ready, catch-up scan, run, shutdown.

    watcher (watchdog events) ──> reconcile (scan, evaluate a set; discovery, settle)
                                      │ submit
                                      v
                                  jobs (bounded queue, retries, budget) ──> handlers/loss
                                      │ a set done
                                      v
                                  steps (barrier, markers, optimizer) ──> loop (next writer)

Data flows one way, down this picture. A part that needs a set looked at
again says so with a value, never a call back up: evaluation and a job's
outcome return a `Revisit` (key, when, why: revisit.py), and `Revisits`,
built before them, is the one place a look or a rescan is scheduled; the
reconciler, built last, serves it. When a retry falls due is one policy
(core/backoff.py) with each stage's numbers from config. The reconciler asks
the loop directly whether its writer is writing a step.

The wiring that remains, all in `Daemon.__init__` below:
- the loop asks the steps (below it) whether a step's optimizer attempts are
  used up and hands them the user's RETRY; the steps set `marker_changed`,
  the event the loop waits on, so it looks at once instead of at its tick;
- loop -> jobs' budget: `over_budget(run)` (a stop rule);
- batch mode -> jobs: `run_result` (a batch's reply runs through a job);
- watcher -> reconcile: `hint(path)`; reconcile -> here: `scanned(dirs)`.

This module builds the parts, starts them in order, runs the main thread's
loop (health, state flush, systemd status) and shuts them down within
`[daemon] shutdown_timeout_s`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import UTC
from pathlib import Path
from typing import Any

from ...handlers import loss, optimizer, writer
from ..core import atomic, config, layout, notify
from ..core.errors import ConfigError, ExitCode
from ..core.lock import RunsLock
from ..core.templates import PromptTemplates
from ..guard import leakguard, leakguard_live
from ..infra import cpu, llm, llm_flex, llm_loop, log
from ..infra.state import SetState, StateStore
from . import metrics_runs
from .batch import Batcher
from .budget import Budget
from .discovery import Discovery
from .jobs import Jobs
from .loop import Loop
from .metrics import Metrics
from .outcomes import Outcomes
from .owner import SetOwner
from .pipeline import Pipeline
from .reconcile import Reconciler
from .revisit import Revisits, Scheduler
from .settle import CLOCK_SKEW_TOLERANCE_S, SettleClock
from .steps import Steps
from .watcher import Watcher

LOOP_TICK_S = 1.0
STALL_S = 60.0  # no scan, job end or loop tick for this long: the daemon is stuck
LLM_LOOP_STALL_S = 30.0  # its callbacks take milliseconds: one this late, it is blocked
RESYNC_JITTER = 0.1  # +-10%: daemons on one NFS server do not scan in lockstep
ONCE_SETTLE_ROUNDS = 5  # --once: rescans after a settle wait before it gives up on a set


class Daemon:
    """The service: builds its parts cheaply; `start()` and the rest run their life."""

    def __init__(self, cfg: config.Config, *, once: bool = False,
                 runs_existed: bool | None = None, pinned_cpu: int | None = None) -> None:
        self.cfg, self.runs, self.once = cfg, cfg.paths.runs, once
        self.pinned_cpu = pinned_cpu  # its threads' one CPU (process.py), None: not pinned
        self.runs_existed = runs_existed  # None: look at start()
        self.log = log.get_logger("skilltrain.daemon")
        self.notifier = notify.Notifier.from_env(on_error=_warn_once(self.emit))
        self.clock = time.time  # wall clock: retry times are kept in the state
        self.stop_event = threading.Event()  # stop intake: set by signals or fatal errors
        self.reload_asked = threading.Event()  # SIGHUP: look again now (a key fixed, a file)
        self.exit_code = ExitCode.OK
        self.state = StateStore(self.runs, cfg.paths.state)
        self.metrics = Metrics(lambda: self.state.counts(), [s.value for s in SetState])
        self.templates = PromptTemplates(cfg.paths.prompts)
        self.heartbeat = notify.Heartbeat()  # the main loop, a scan or a job made progress
        self.pinger = notify.WatchdogPinger(self.notifier, self.healthy, self.stop_event,
                                            on_unhealthy=self._unhealthy)
        self._waiting_for_root = False  # runs/ was deleted: waiting is healthy
        self.catching_up = not once  # until the start-up's first scan has looked at every set
        self._run_lock = RunsLock(self.runs / layout.STATE_DIR)
        self.abandoned = 0
        self.scheduler = Scheduler(
            executors={"default": {"type": "threadpool", "max_workers": 2}},
            job_defaults={"misfire_grace_time": None, "coalesce": True, "max_instances": 4},
            timezone=UTC)
        # Built bottom-up; the reconciler, built last, serves the revisits.
        self.discovery = Discovery(cfg, self.state, self.emit)
        settle = SettleClock(cfg.loss.settle_s, self.runs, self.discovery.ignore)
        self.revisits = Revisits(self.scheduler, settle, stopping=self.stop_event, once=once,
                                 clock=self.clock)
        self.budget = Budget(cfg.llm.budget_usd, self.state, self.emit, runs=self.runs)
        marker_changed = threading.Event()
        self.steps = Steps(cfg, self.state, self.emit, clock=self.clock,
                           discovery=self.discovery, marker_changed=marker_changed)
        self.loop = Loop(cfg, self.emit, stopping=self.stop_event, over_budget=self.budget.reached,
                         revisits=self.revisits, steps=self.steps, wake=marker_changed,
                         once=once, clock=self.clock)
        # A set's way to a report, and its two transports: a live call, a provider batch.
        self.outcomes = Outcomes(cfg, self.state, self.emit, clock=self.clock, steps=self.steps)
        pipeline = Pipeline(cfg, self.templates, self.outcomes, self.steps.folders)
        self.jobs = Jobs(cfg, self.state, self.emit, stopping=self.stop_event,
                         metrics=self.metrics, pipeline=pipeline, budget=self.budget,
                         llm_loop=llm_loop.shared(), on_unblocked=self.revisits.scan_soon,
                         llm_settings=self.discovery.llm_settings)
        self.batcher = Batcher(cfg, self.state, self.emit, stopping=self.stop_event,
                               pipeline=pipeline, discovery=self.discovery,
                               live=self.jobs, wall_clock=self.clock)
        self.metrics.register(metrics_runs.BatchGauges(self.batcher.snapshot))
        # The one owner of every set's life; the reconciler decides, it applies.
        self.owner = SetOwner(self.state, self.emit, revisits=self.revisits, steps=self.steps,
                              heartbeat=self.heartbeat, live=self.jobs, batch=self.batcher)
        self.reconcile = Reconciler(cfg, self.state, self.emit, clock=self.clock,
                                    stopping=self.stop_event, revisits=self.revisits,
                                    settle=settle, discovery=self.discovery, owner=self.owner,
                                    budget=self.budget, steps=self.steps, loop=self.loop,
                                    templates=self.templates, heartbeat=self.heartbeat,
                                    scanned=lambda dirs: self.watcher.scanned(dirs),
                                    refused_key=self.jobs.refused_key)
        self.watcher = Watcher(self.runs, cfg.watch.observer, self.reconcile.hint, self.emit,
                               rescan=self.revisits.scan_soon)
        metrics_runs.install(self.metrics, cfg, self.state, lambda: self.watcher.kind)

    @property
    def failures(self) -> int:
        """Sets failed, refused or unusable, optimizer runs failed, keys refused: --once's exit."""
        return (self.reconcile.failures + self.outcomes.failures + self.steps.failures
                + len(self.jobs.limiters.blocked()))

    # ----------------------------------------------------------------- events
    def emit(self, event: str, level: str = "info", **fields: Any) -> None:
        getattr(self.log, level)(event, **fields)
        self.metrics.observe(event, fields)

    # --------------------------------------------------------------- start-up
    def start(self) -> None:
        """Check config, lock, clean up, first scan, start intake. Raises on bad config."""
        preflight(self.cfg, once=self.once)  # before anything is created
        _quiet_inotify_stop_race()  # every stop of the observer: at SIGTERM, on fallback
        runs_existed = self.runs_existed if self.runs_existed is not None else self.runs.is_dir()
        self.runs.mkdir(parents=True, exist_ok=True)
        self._run_lock.acquire()
        self.state.note_daemon(started_at=time.time())
        self.emit("daemon.started", pid=os.getpid(), version=_version(),
                  config=str(self.cfg.source), runs_dir=str(self.runs),
                  observer=self.cfg.watch.observer, concurrency=self.cfg.loss.concurrency,
                  model=self.cfg.llm.model, once=self.once, cpu=self.pinned_cpu)
        if not runs_existed:
            self.emit("daemon.runs_created", runs_dir=str(self.runs))
        # Temp files of writes a crash cut short: the state folder's now (it
        # is read next); the loss folders' too with --once, else after ready.
        started_at = self.clock()
        _clean_leftovers([self.runs / layout.STATE_DIR, *(_loss_dirs(self.runs) if self.once
                                                          else [])], started_at, self.emit)
        self.loop.prepare()
        self.discovery.load_works()
        _install_answer_keys(self.cfg.paths.data, self.emit)
        self.discovery.check_human_ranges()
        if problem := self.state.load():
            self.emit("state.unreadable", level="error", path=str(self.state.path),
                      reason=f"{problem}; rebuilt from runs/")
        if self.cfg.metrics.listen and not self.once:
            self.metrics.serve(self.cfg.metrics.listen)  # a bad address stops us here (exit 2)
        self.scheduler.start()
        # Before the first scan: the sets open batches carry are claimed, not sent again.
        self.owner.adopt(self.batcher.start())
        if self.once:
            self.reconcile.scan()
            self._ready()
            return
        # Ready before the first scan (systemd/README.md, "When is it ready"):
        # nothing is missed from here on, and a tree of any size cannot
        # outlast systemd's start timeout; the scan feeds the watchdog.
        self.watcher.start()
        self.pinger.start()
        self._ready()
        self.reconcile.scan(progress=self._catching_up)
        if self.stop_event.is_set():
            return  # stopped while catching up: the next start goes on from the state
        self.catching_up = False
        self.notifier.status(_status_line(self.state))  # not "catching up" until the next tick
        self.metrics.caught_up()
        self.emit("daemon.caught_up", sets=sum(self.state.counts().values()),
                  duration_ms=int((time.monotonic() - self._ready_at) * 1000))
        # litellm's import (~5 s) after the scan, which it would slow, and
        # before the first job's pickup latency would pay for it.
        threading.Thread(target=self.jobs.warm_up, name="litellm-import", daemon=True).start()
        # What changed in a part of the tree the first scan had passed before
        # its step was watched: one more scan finds it.
        self.revisits.scan_soon()
        interval = self.cfg.watch.resync_s
        self.scheduler.add_job(self.reconcile.scan, "interval", seconds=interval,
                               id="resync", jitter=max(1, int(interval * RESYNC_JITTER)),
                               replace_existing=True)
        self.loop.start()
        # A folder per report step: on a large tree, seconds of directory
        # reads. Nothing reads a temp file meanwhile (exact names, and temp
        # names end in .tmp); our own writes are newer.
        threading.Thread(target=lambda: _clean_leftovers(_loss_dirs(self.runs), started_at,
                                                         self.emit),
                         name="cleanup", daemon=True).start()
        if self.cfg.integrity.audit_on_start:
            # Full leak audit of runs/; hits logged without their text.
            from .start_audit import audit_runs  # the audit's reading code: only when it runs

            threading.Thread(target=audit_runs, name="audit", daemon=True,
                             args=[self.runs, self.discovery.works, self.cfg.paths.data,
                                   self.emit]).start()

    def _ready(self) -> None:
        self._ready_at = time.monotonic()
        self.metrics.startup_catching_up.set(int(self.catching_up))
        self.notifier.ready()
        self.emit("daemon.ready", observer=self.watcher.kind or "none",
                  catching_up=self.catching_up)

    def _catching_up(self, looked: int, total: int) -> None:
        """The start-up scan's progress: systemd's STATUS=, the metric, the state."""
        self.notifier.status(f"catching up: {looked:,} of {total:,} sets looked at")
        self.metrics.catching_up(looked, total)
        self._flush_state()  # a start killed now keeps what it has looked at

    # ------------------------------------------------------------- main loop
    def healthy(self) -> bool:
        """For the systemd watchdog: intake alive and the loop not stuck."""
        return not self.health_problems()

    def health_problems(self) -> list[str]:
        """Why the daemon is not healthy (empty: it is)."""
        problems = []
        if not (self.once or self._waiting_for_root or self.watcher.alive()):
            problems.append("the filesystem watcher is not running")
        if not self.scheduler.running:
            problems.append("the scheduler is not running")
        if not self.heartbeat.recent(STALL_S):
            problems.append(f"no progress for {self.heartbeat.age_s():.0f} s")
        if (unanswered_s := self.jobs.llm.unanswered_s()) > LLM_LOOP_STALL_S:
            problems.append(f"the LLM event loop has not run for {unanswered_s:.0f} s")
        return problems

    def _unhealthy(self) -> None:
        # Logged before systemd's WatchdogSec runs out, so the kill has a reason.
        self.emit("daemon.unhealthy", level="error", reasons=self.health_problems(),
                  watchdog_s=self.notifier.watchdog_interval_s)

    def run_forever(self) -> None:
        """The main thread's loop: health, state flush, status; until stopped."""
        self.pinger.start()  # started already at ready, unless start() was cut short
        last_status = ""
        while not self.stop_event.wait(LOOP_TICK_S):
            self.heartbeat.beat()
            self.jobs.llm.probe()  # every call runs on it: its lag, and whether it runs
            if self.watcher.root_replaced() or not self.watcher.alive():
                self._watcher_died()
                continue
            if self.reload_asked.is_set():  # SIGHUP: blocked keys probed now, and a scan
                self.reload_asked.clear()
                self.jobs.look_again()
            self._flush_state()
            leakguard.installed()  # an idle daemon still picks up (and says) a key's edit
            if (line := _status_line(self.state)) != last_status:
                self.notifier.status(line)
                last_status = line

    def _flush_state(self) -> None:
        try:
            self.state.flush_when_due(pid=os.getpid(), tick_s=LOOP_TICK_S)
        except OSError as e:
            self._state_write_failed(e)  # a full disk must not take the daemon down

    def _state_write_failed(self, error: OSError) -> None:
        self.emit("state.write_failed", level="warning", path=str(self.state.path),
                  error=error.strerror or type(error).__name__)

    def _watcher_died(self) -> None:
        if self.watcher.root_replaced():
            # runs/ was deleted (and maybe recreated): its watch went with it.
            # Wait for it to exist, then take the lock and watch it anew.
            self.emit("watch.root_missing", level="warning", runs_dir=str(self.runs))
            self._waiting_for_root = True  # healthy: waiting is what it should do
            try:
                self.watcher.stop()
                while not self.runs.is_dir() and not self.stop_event.wait(LOOP_TICK_S):
                    self.heartbeat.beat()
                if self.stop_event.is_set():
                    return
                self._run_lock.release()
                self._run_lock.acquire()
                self.watcher.start()
            finally:
                self._waiting_for_root = False
            self.emit("watch.restarted", runs_dir=str(self.runs), observer=self.watcher.kind)
            self.revisits.scan_soon()
            return
        self.emit("watch.died", level="error", thread="observer")
        self.exit_code = ExitCode.WATCHER_DIED
        self.stop_event.set()

    def run_once(self) -> None:
        """After the first scan: wait for every job (and optimizer) it started.

        Sets that were only settling (first seen, still being written, their
        inputs changed during the call) are looked at again once the settle
        window has passed, a few rounds at most: --once ends, it does not
        wait for a writer that never stops.
        """
        for rounds in range(ONCE_SETTLE_ROUNDS + 1):
            self.batcher.wait_idle(self.jobs.wait_all, self.stop_event)  # and its batches
            self.steps.wait_optimizers()
            rescan_at = self.revisits.take_once_rescan_at()
            if rescan_at == 0.0 or rounds == ONCE_SETTLE_ROUNDS:
                break
            # A settle window is never longer than settle_s from now.
            wait_s = min(rescan_at - time.time(),
                         self.cfg.loss.settle_s + CLOCK_SKEW_TOLERANCE_S)
            if self.stop_event.wait(max(0.0, wait_s) + 0.05):
                break
            self.reconcile.scan()
        if self.failures and self.exit_code == ExitCode.OK:
            self.exit_code = ExitCode.FAILURE  # cron and scripts must see it

    def abort_start(self) -> None:
        """A start that failed: intake stopped, before the error is raised on."""
        self.stop_event.set()
        with contextlib.suppress(Exception):
            self.scheduler.shutdown(wait=False)
        self.watcher.stop()

    def shutdown(self, reason: str) -> None:
        """Stop intake, drain running jobs up to the bound, abandon the rest."""
        jobs = self.jobs.futures()
        running = min(self.jobs.in_call, len(jobs))
        self.emit("daemon.stopping", reason=reason, running=running, queued=len(jobs) - running)
        self.notifier.stopping()
        # 1. intake: no new events, scans, jobs or batches; jobs waiting to retry give up,
        #    jobs not started are cancelled, open batches stay recorded (all found again
        #    at the next start), like an optimizer run not started yet
        self.stop_event.set()
        self.jobs.stop_intake()
        self.watcher.stop()
        with contextlib.suppress(Exception):
            self.scheduler.shutdown(wait=False)
        self.steps.stop_intake()
        self.batcher.stop()
        # 2. running jobs and the optimizer may finish (their writes are atomic)
        #    up to the bound; a cancelled optimizer is retried at the next start
        deadline = time.monotonic() + self.cfg.daemon.shutdown_timeout_s
        futures = self.jobs.futures() + self.steps.optimizer_runs()
        for future in futures:
            with contextlib.suppress(Exception):
                future.result(timeout=max(0.0, deadline - time.monotonic()))
        self.loop.stop(max(0.0, deadline - time.monotonic()))  # a killed writer reruns at start
        # 3. still in an LLM call: abandoned, its request cancelled (writes are atomic)
        self.steps.kill_optimizer.set()
        for future in self.steps.optimizer_runs():
            with contextlib.suppress(Exception):
                future.result(timeout=5)
        abandoned = sum(1 for f in futures if not f.done())
        self.jobs.cancel_running()  # their requests are cancelled: no call outlives the bound
        _close_state(self.state, self.emit, on_error=self._state_write_failed)
        counts = self.state.counts()
        self.emit("daemon.stopped", level="info" if self.exit_code == ExitCode.OK else "error",
                  exit_code=int(self.exit_code), done=counts.get("done", 0),
                  failed=counts.get("failed", 0), abandoned=abandoned)
        self.metrics.close()
        self._run_lock.release()
        self.abandoned = abandoned



def _warn_once(emit: Callable[..., None]) -> Callable[[str, BaseException], None]:
    """notify.failed, said once: a vanished socket would fail every tick."""
    said = threading.Event()

    def warn(field: str, error: BaseException) -> None:
        if not said.is_set():
            said.set()
            emit("notify.failed", level="warning", field=field, error=str(error))
    return warn


def _close_state(state: StateStore, emit: Callable[..., None], *,
                 on_error: Callable[[OSError], None]) -> None:
    """Each run's spend said once more, the state written whole and closed."""
    for run, spend in sorted(state.spend.items()):
        emit("cost.total", run=run, tokens_in=spend.tokens_in, tokens_out=spend.tokens_out,
             cost_usd=round(spend.cost_usd, 6), tokens_cached=spend.tokens_cached,
             tokens_cache_write=spend.tokens_cache_write)
    try:
        state.flush(force=True, pid=None)
    except OSError as e:
        on_error(e)
    state.close()


def _status_line(state: StateStore) -> str:
    """systemd's STATUS= once caught up."""
    counts = state.counts()
    spent = sum(s.cost_usd for s in state.spend.values())
    return (f"{counts.get('done', 0)} done, {counts.get('queued', 0)} queued, "
            f"{counts.get('running', 0)} running, {counts.get('failed', 0)} failed, "
            f"${spent:.2f}")


def _install_answer_keys(data: Path, emit: Callable[..., None]) -> None:
    """Every work's index, for what belongs to no one work: log lines, error
    reasons, other works' keys. Kept current with data/ (leakguard_live)."""
    leakguard_live.install(data, lambda works, eps: emit("answer_keys.reloaded", works=works,
                                                          episodes=eps))


def _loss_dirs(runs: Path) -> list[Path]:
    """Where the daemon writes besides runs/.skilltrain/: runs/*/loss/."""
    return [run / layout.LOSS_DIR for run in layout.run_dirs(runs)
            if (run / layout.LOSS_DIR).is_dir()]


def _clean_leftovers(dirs: list[Path], written_before: float, emit: Callable[..., None]) -> None:
    """Temp files a killed daemon left in these folders, older than this start."""
    removed = sum(atomic.remove_leftover_temp_files(d, written_before) for d in dirs)
    if removed:
        emit("daemon.cleaned", temp_files=removed)


def preflight(cfg: config.Config, *, once: bool = False) -> None:
    """Every configuration error found before anything is created, a lock
    taken, a log opened or any job run (exit 2)."""
    if not cfg.paths.data.is_dir():
        raise ConfigError(f"[paths] data = {str(cfg.paths.data)!r}: no such folder "
                          "(the answer keys live in data/<work>/human/)")
    # A syntax error or a misspelt variable stops us here, with its line.
    loss.check_template(PromptTemplates(cfg.paths.prompts))
    optimizer.check_command(cfg.optimizer.command)
    if cfg.loop is not None and not once:
        if not cfg.writer.command:
            raise ConfigError("[writer] command = []: [loop] is configured, so a writer "
                              "command is needed to write each step")
        writer.check_command(cfg.writer.command)
    llm.check_credentials(cfg.llm)
    cpu.check(cfg.daemon.cpu)
    if why := llm_flex.check(cfg.llm):
        raise ConfigError(why)
    if cfg.llm.mode == "batch":
        from ..infra.batch_api import supported

        if why := supported(cfg.llm):
            raise ConfigError(f"[llm] mode = \"batch\": {why}")


class _InotifyStopRace(logging.Filter):
    """watchdog logs an *error* when its inotify thread reads one last event
    while being stopped ("queue_events() called when the thread is inactive"):
    a benign race of every stop (SIGTERM, runs/ replaced, the fallback to
    polling), which must not look like a fault. Nothing else logs it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()


_INOTIFY_STOP_RACE = _InotifyStopRace()


def _quiet_inotify_stop_race() -> None:
    logging.getLogger("watchdog.observers.inotify").addFilter(_INOTIFY_STOP_RACE)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("skilltrain")
    except PackageNotFoundError:
        return "unknown"
