"""`skilltrain daemon`: turn every finished episode range into one up-to-date report.

    watchdog event (hint) ─┐
    periodic resync scan ──┼─> evaluate(set)  (APScheduler date job, id = set id,
    startup scan ──────────┘                   replace_existing: the debounce)
                                   │ complete? settled? up to date? failed/backoff? budget?
                                   v
                         loss job (bounded pool; one per set at a time)
                                   v
                         report + archive + sidecar (atomic, by the loss handler)
                                   v
                         events -> step barrier -> optimizer

Events are hints; the filesystem is the truth. `evaluate` is level-triggered:
it looks at the set on disk and decides from what it sees, so a lost event,
a restart or a second event for the same file changes nothing.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from apscheduler.schedulers.background import BackgroundScheduler

from skilltrain import atomic, config, dataset, layout, llm, log, notify, progress
from skilltrain.errors import (
    BadOutputError,
    ConfigError,
    ExitCode,
    LLMError,
    RefusedError,
    SkilltrainError,
)
from skilltrain.handlers import loss, optimizer
from skilltrain.lock import RunsLock
from skilltrain.loop import Loop
from skilltrain.metrics import Metrics
from skilltrain.observe import Fingerprint, HumanDigests, observe, report_is_current, sigs_digest
from skilltrain.state import SetState, StateStore, StepRecord
from skilltrain.templates import PromptTemplates
from skilltrain.watcher import Watcher

HINT_DEBOUNCE_S = 0.02  # coalesce the burst of events one file write makes
RESCAN_DEBOUNCE_S = 0.5
LOOP_TICK_S = 1.0
RESYNC_JITTER = 0.1  # +-10%: daemons on one NFS server do not scan in lockstep
AUDIT_CACHE = "audit-cache.json"  # in runs/.skilltrain/
STEP_MARKERS = layout.STEP_MARKERS  # runs/<run>/loss/.steps/epoch_EE-step_SS.json


class Abandoned(Exception):
    """Raised inside a job when the daemon shuts down while the job waits to retry."""


class Daemon:
    """The service. Construction is cheap; `start()` does the work."""

    def __init__(self, cfg: config.Config, *, once: bool = False,
                 notifier: notify.Notifier | None = None,
                 complete: Callable[..., llm.Completion] = llm.complete,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.runs = cfg.paths.runs
        self.once = once
        self.log = log.get_logger("skilltrain.daemon")
        self._notify_warned = False
        self.notifier = notifier or notify.Notifier.from_env(on_error=self._notify_failed)
        self.metrics = Metrics(lambda: self.state.counts(), [s.value for s in SetState])
        self.complete = self.metrics.timed(complete)
        self.clock = clock
        self.stop_event = threading.Event()  # stop intake: set by signals or fatal errors
        self.abort_event = threading.Event()  # abandon jobs waiting to retry
        self.kill_optimizer = threading.Event()  # shutdown bound passed: end the optimizer
        self.exit_code = ExitCode.OK
        self.state = StateStore(self.runs)
        self.templates = PromptTemplates(cfg.paths.prompts)
        self.human_digests = HumanDigests()
        self.works: dict[str, dataset.Work] = {}
        self._lock = threading.RLock()
        self._active: dict[str, Future[None]] = {}  # set id -> queued or running job
        self._recheck: set[str] = set()  # changed while active: evaluate again afterwards
        self._last_sigs: dict[str, Any] = {}  # set id -> (sigs, monotonic time they changed)
        self._ignored: set[str] = set()
        self._budget_reported: set[str] = set()
        self._optimizer_futures: list[Future[None]] = []
        self._optimizer_pending: set[str] = set()  # step ids with an optimizer run claimed
        self._progress_at = time.monotonic()
        self._run_lock = RunsLock(self.runs / layout.STATE_DIR)
        self.scheduler = BackgroundScheduler(
            executors={"default": {"type": "threadpool", "max_workers": 2}},
            job_defaults={"misfire_grace_time": None, "coalesce": True, "max_instances": 4},
            timezone=UTC)
        self.pool = ThreadPoolExecutor(cfg.loss.concurrency, thread_name_prefix="loss")
        self.optimizer_pool = ThreadPoolExecutor(1, thread_name_prefix="optimizer")
        self.watcher = Watcher(self.runs, cfg.watch.observer, self.hint, self.emit)
        self.loop = Loop(cfg, self.emit, stopping=self.stop_event, over_budget=self._over_budget,
                         request_scan=self._schedule_scan, once=once, clock=clock)
        self._template_hash: tuple[float, str] | None = None
        self.abandoned = 0
        self._next_flush_at = 0.0

    # ----------------------------------------------------------------- events
    def emit(self, event: str, level: str = "info", **fields: Any) -> None:
        getattr(self.log, level)(event, **fields)
        self.metrics.observe(event, fields)

    def _notify_failed(self, field: str, error: BaseException) -> None:
        if not self._notify_warned:
            self._notify_warned = True  # once: a vanished socket would fail every tick
            self.emit("notify.failed", level="warning", field=field, error=str(error))

    # --------------------------------------------------------------- start-up
    def start(self) -> None:
        """Lock, clean up, check config, first scan, start intake. Raises on bad config."""
        self.runs.mkdir(parents=True, exist_ok=True)
        self._run_lock.acquire()
        self.emit("daemon.started", pid=os.getpid(), version=_version(),
                  config=str(self.cfg.source), runs_dir=str(self.runs),
                  observer=self.cfg.watch.observer, concurrency=self.cfg.loss.concurrency,
                  model=self.cfg.llm.model, once=self.once)
        # The daemon writes only under runs/*/loss/ and runs/.skilltrain/.
        removed = sum(atomic.remove_leftover_temp_files(d) for d in self._own_dirs())
        if removed:
            self.emit("daemon.cleaned", temp_files=removed)
        self.templates.check(loss.TEMPLATE)  # a syntax error stops us here, with its line
        optimizer.check_command(self.cfg.optimizer.command)
        self.loop.prepare()
        self.works = dataset.discover_works(self.cfg.paths.data)
        if not self.works:
            self.emit("daemon.no_works", level="warning", data_dir=str(self.cfg.paths.data))
        self._check_human_ranges()
        self.state.load()
        if self.cfg.metrics.listen and not self.once:
            self.metrics.serve(self.cfg.metrics.listen)  # a bad address stops us here (exit 2)
        self.scheduler.start()
        # The first scan runs alone: watchdog's initial walk (one watch per
        # folder) and litellm's import would triple its time on a large tree.
        # What changes before the watch is up is caught by a catch-up scan.
        self.scan()
        if not self.once:
            # Pay litellm's ~5 s import now, not in the first job's pickup latency.
            threading.Thread(target=llm.warm_up, args=[self.cfg.llm.model],
                             name="litellm-import", daemon=True).start()
            self.watcher.start()
            self._schedule_scan()
            interval = self.cfg.watch.resync_seconds
            self.scheduler.add_job(self.scan, "interval", seconds=interval, id="resync",
                                   jitter=max(1, int(interval * RESYNC_JITTER)),
                                   replace_existing=True)
            self.loop.start()
        self.notifier.ready()
        self.emit("daemon.ready", observer=self.watcher.kind or "none")
        if self.cfg.integrity.audit_on_start and not self.once:
            threading.Thread(target=self.audit, name="audit", daemon=True).start()

    def audit(self) -> None:
        """Full leak audit of runs/; hits are logged without their text.

        Files found clean before, unchanged since (size, mtime, inode) and
        checked against the same answer keys are skipped: on a large tree
        the first audit costs minutes of CPU, the next ones seconds.
        """
        from skilltrain import audit, leakguard

        t0 = time.monotonic()
        human = {name: episodes for name, work in self.works.items()
                 if (episodes := work.read_all_human())}
        indexes = [leakguard.index_for(name, episodes) for name, episodes in human.items()]
        keys_digest = dataset.sha256_text(
            "".join(f"{name}:{dataset.episodes_digest(eps)}\n" for name, eps in human.items()))
        cache_path = self.runs / layout.STATE_DIR / AUDIT_CACHE
        old = _read_audit_cache(cache_path, keys_digest)
        new: dict[str, list[int]] = {}

        def unchanged(path: Path) -> bool:
            try:
                st = os.lstat(path)
            except OSError:
                return False
            new[str(path)] = [st.st_size, st.st_mtime_ns, st.st_ino]
            return old.get(str(path)) == new[str(path)]

        result = audit.scan(self.runs, indexes, unchanged=unchanged)
        for hit in result.hits:
            new.pop(str(hit.file), None)  # never remembered as clean
            self.emit("audit.leak", level="error", file=str(hit.file), line=hit.line,
                      work=hit.work, episode=hit.episode, n_words=hit.n_words)
        new.pop(str(cache_path), None)
        with contextlib.suppress(OSError):
            atomic.write_text(cache_path, json.dumps({"keys": keys_digest, "files": new}))
        self.emit("audit.completed", level="warning" if result.hits else "info",
                  files=result.files, skipped=result.skipped, leaks=len(result.hits),
                  errors=len(result.errors), duration_ms=int((time.monotonic() - t0) * 1000))

    def _own_dirs(self) -> list[Path]:
        dirs = [self.runs / layout.STATE_DIR]
        dirs += [run / layout.LOSS_DIR for run in _subdirs(self.runs)
                 if (run / layout.LOSS_DIR).is_dir()]
        return dirs

    # ------------------------------------------------------------------- scan
    def scan(self) -> None:
        """Level-triggered reconciliation: look at every set under runs/."""
        t0 = time.monotonic()
        self._template_hash = None  # re-read the template once per scan
        steps = dict(self._discover_steps())
        for keys in steps.values():
            for key in keys:
                try:
                    self.evaluate(key)
                except Exception:
                    self.log.exception("set.error", **key.log_fields())
        seen = {key.id for keys in steps.values() for key in keys}
        with self.state.lock:
            for set_id in set(self.state.sets) - seen:
                if set_id not in self._active:
                    del self.state.sets[set_id]  # its folder is gone
                    self.state.mark_dirty()
            step_ids = {step.id for step in steps}
            for step_id in set(self.state.steps) - step_ids:
                # Its folder is gone: a run made again under the same name is
                # reported (and looped) afresh, not taken as reported already.
                del self.state.steps[step_id]
                self.state.mark_dirty()
        for step in sorted(steps):
            self.check_step(step, steps[step])
        counts = self.state.counts()
        by_state: dict[str, Any] = {s.value: counts.get(s.value, 0) for s in SetState}
        self.emit("scan.completed", sets=len(seen),
                  duration_ms=int((time.monotonic() - t0) * 1000), **by_state)
        self.watcher.check_coverage()
        self._progress_at = time.monotonic()

    def _discover_steps(self) -> Iterator[tuple[layout.StepKey, list[layout.SetKey]]]:
        """Every step folder under runs/ with the sets it is expected to have."""
        for run in _subdirs(self.runs):
            if run.name.startswith("."):
                continue
            works = self._expected_works(run.name)
            for epoch_dir in _subdirs(run):
                epoch = layout.EPOCH_DIR.fullmatch(epoch_dir.name)
                if epoch is None:
                    if epoch_dir.name != layout.LOSS_DIR:
                        self._ignore(epoch_dir, "not an epoch_NN folder")
                    continue
                for step_dir in _subdirs(epoch_dir):
                    step = layout.STEP_DIR.fullmatch(step_dir.name)
                    if step is None:
                        self._ignore(step_dir, "not a step_NN folder")
                        continue
                    step_key = layout.StepKey(run.name, int(epoch.group(1)), int(step.group(1)))
                    yield step_key, list(self._sets_of_step(step_key, works))

    def _sets_of_step(self, step: layout.StepKey,
                      works: list[dataset.Work] | None = None) -> Iterator[layout.SetKey]:
        step_dir = step.step_dir(self.runs)
        for name in _subdir_names(step_dir):
            if name not in self.works:
                self._ignore(step_dir / name, "unknown work (no data/<work>/human/)")
        for work in works if works is not None else self._expected_works(step.run):
            for first, last in work.ranges(self.cfg.loss.episodes_per_report):
                yield layout.SetKey(step.run, step.epoch, step.step, work.name, first, last)

    def _expected_works(self, run: str) -> list[dataset.Work]:
        """All works in data/, or the subset runs/<run>/run.toml lists."""
        run_toml = self.runs / run / "run.toml"
        if not run_toml.exists():
            return list(self.works.values())
        try:
            names = tomllib.loads(run_toml.read_text(encoding="utf-8")).get("works")
        except (OSError, ValueError) as e:
            self._ignore(run_toml, f"unreadable run.toml ({type(e).__name__}); using all works")
            return list(self.works.values())
        if not isinstance(names, list):
            return list(self.works.values())
        for name in names:
            if name not in self.works:
                self._ignore(run_toml, f"lists unknown work {name!r}")
        return [self.works[n] for n in names if n in self.works]

    def _check_human_ranges(self) -> None:
        """A range with a hole in the answer key can never be reported: say so at start."""
        for work in self.works.values():
            present = set(work.human_episodes())
            for first, last in work.ranges(self.cfg.loss.episodes_per_report):
                missing = [n for n in range(first, last + 1) if n not in present]
                if missing:
                    names = ", ".join(dataset.episode_name(n) for n in missing)
                    self._ignore(work.human_dir, f"range {dataset.format_range(first, last)} "
                                 f"can never be reported: human {names} missing",
                                 event="work.range_incomplete")

    def _ignore(self, path: Path, reason: str, event: str = "set.ignored") -> None:
        """Log a path we cannot use once, not at every scan."""
        if f"{path}: {reason}" not in self._ignored:
            self._ignored.add(f"{path}: {reason}")
            self.emit(event, level="warning", path=str(path), reason=reason)

    # ------------------------------------------------------------------ hints
    def hint(self, path: Path) -> None:
        """A filesystem event: schedule a look at whatever it touches."""
        if self.stop_event.is_set():
            return
        parsed = layout.parse_runs_path(self.runs, path)
        if parsed is None:
            try:
                parts = path.relative_to(self.runs).parts
            except ValueError:
                return
            if (0 < len(parts) <= 2 and not parts[0].startswith(".")
                    and parts[-1] != layout.LOSS_DIR and path.is_dir()):
                self._schedule_scan()  # a run or epoch folder appeared or moved in
            return
        step = layout.StepKey(parsed.run, parsed.epoch, parsed.step)
        for key in self._sets_of_step(step):
            if parsed.work and key.work != parsed.work:
                continue
            if parsed.episode is not None and not key.first <= parsed.episode <= key.last:
                continue
            self.schedule_evaluate(key, delay_s=HINT_DEBOUNCE_S)

    def _schedule_scan(self) -> None:
        self.scheduler.add_job(self.scan, "date", id="rescan", replace_existing=True,
                               run_date=_at(time.time() + RESCAN_DEBOUNCE_S))

    def schedule_evaluate(self, key: layout.SetKey, *, delay_s: float = 0.0,
                          at: float | None = None) -> None:
        """Debounce: one pending evaluation per set; a new one replaces it."""
        if self.once or self.stop_event.is_set():
            return
        when = at if at is not None else time.time() + delay_s
        with contextlib.suppress(Exception):  # scheduler already shut down
            self.scheduler.add_job(self._evaluate_job, "date", args=[key], id=key.id,
                                   replace_existing=True, run_date=_at(when))

    def _evaluate_job(self, key: layout.SetKey) -> None:
        try:
            self.evaluate(key)
        except Exception:
            self.log.exception("set.error", **key.log_fields())
        self.check_step(key.step_key)

    # --------------------------------------------------------------- evaluate
    def evaluate(self, key: layout.SetKey) -> None:
        """Look at one set and do the one right thing for it now."""
        with self._lock:
            if key.id in self._active:
                self._recheck.add(key.id)  # coalesce: look again when the job ends
                return
            if self.loop.writing(key.step_key):
                # Scored once the loop recorded its writer's end: a writer re-run
                # after a crash must not leave a report of the first run's episodes.
                self.state.update(key.id, SetState.WAITING, reason="the loop's writer is running")
                return
            self._evaluate_locked(key)

    def _evaluate_locked(self, key: layout.SetKey) -> None:
        obs = observe(key, self.runs)
        rec = self.state.get(key.id)
        if not obs.complete:
            if obs.unusable and obs.problem:
                # Not a range still being written but a file that will never
                # do (a symlink out of runs/, a folder named epNN.txt): say so once.
                self._ignore(key.scripts_dir(self.runs), obs.problem, event="set.unusable")
            self.state.update(key.id, SetState.WAITING, reason=obs.problem)
            return
        work = self.works[key.work]
        human = self.human_digests.digest(work, key.first, key.last) or ""
        fp = Fingerprint.of(obs.sigs, human, self.template_hash(), self.cfg.llm.model)
        recorded = Fingerprint.from_json(rec.fingerprint) if rec and rec.fingerprint else None
        if human and report_is_current(key, self.runs, fp, recorded):
            if rec is None or rec.state != SetState.DONE or recorded != fp:
                self.state.update(key.id, SetState.DONE, reason=None, attempts=0,
                                  fingerprint=fp.as_json(), next_retry_at=None)
            return

        now = self.clock()
        ready_at = max(obs.ready_at(self.cfg.loss.settle_seconds), self._changed_at(key, obs))
        report_exists = key.report_path(self.runs).exists()
        if ready_at > now:
            self.state.update(key.id, SetState.STALE if report_exists else SetState.SETTLING,
                              reason=f"settling until {_iso(ready_at)}")
            self.schedule_evaluate(key, at=ready_at)
            return
        if rec and rec.state == SetState.REFUSED and rec.refused_fingerprint == fp.as_json():
            return  # the same input was refused already; wait for it to change
        if rec and rec.state == SetState.FAILED and rec.fingerprint == fp.as_json():
            if rec.attempts >= self.cfg.loss.max_attempts:
                return  # gave up; stays visible as failed until its input changes
            if rec.next_retry_at and rec.next_retry_at > now:
                self.schedule_evaluate(key, at=rec.next_retry_at)
                return
        if self._over_budget(key.run):
            self.state.update(key.id, SetState.STALE if report_exists else SetState.SETTLING,
                              reason="budget reached")
            return
        if report_exists:
            self._report_stale(key)
        attempts = rec.attempts if rec and rec.state == SetState.FAILED \
            and rec.fingerprint == fp.as_json() else 0
        self._submit(key, fp, attempts)

    def _changed_at(self, key: layout.SetKey, obs: Any) -> float:
        """A set whose files changed since we last looked waits settle_seconds from now.

        mtimes alone would do on a local disk; this guards against a writer
        whose clock (NFS) or copy tool (`cp -p`, rsync -t) sets old mtimes.
        """
        previous = self._last_sigs.get(key.id)
        now = self.clock()
        if previous is None:
            self._last_sigs[key.id] = (obs.sigs, 0.0)
            return 0.0
        sigs, changed = previous
        if sigs != obs.sigs:
            self._last_sigs[key.id] = (obs.sigs, now)
            return now + self.cfg.loss.settle_seconds if not obs.success_marker else 0.0
        return changed + self.cfg.loss.settle_seconds if changed and not obs.success_marker \
            else 0.0

    def _report_stale(self, key: layout.SetKey) -> None:
        step = self.state.steps.get(key.step_key.id)
        after_optimizer = bool(step and step.optimizer_done)
        self.emit("set.stale", reason="inputs changed since the report was written"
                  + ("; the optimizer already ran for this step and is NOT re-triggered"
                     if after_optimizer else ""), after_optimizer=after_optimizer,
                  **key.log_fields())

    def template_hash(self) -> str:
        cached = self._template_hash
        if cached is None or time.monotonic() - cached[0] > 1.0:
            cached = (time.monotonic(), self.templates.source_hash(loss.TEMPLATE))
            self._template_hash = cached
        return cached[1]

    def _over_budget(self, run: str) -> bool:
        budget = self.cfg.llm.budget_usd
        if budget is None:
            return False
        spent = self.state.spend.get(run)
        if spent is None or spent.cost_usd < budget:
            return False
        if run not in self._budget_reported:
            self._budget_reported.add(run)
            self.emit("budget.reached", level="warning", run=run,
                      spent_usd=round(spent.cost_usd, 6), budget_usd=budget)
        return True

    # ------------------------------------------------------------------- jobs
    def _submit(self, key: layout.SetKey, fp: Fingerprint, attempts: int) -> None:
        job_id = uuid.uuid4().hex[:12]
        self.state.update(key.id, SetState.QUEUED, reason=None, fingerprint=fp.as_json(),
                          attempts=attempts)
        self.emit("set.ready", **key.log_fields())
        self.emit("loss.queued", job_id=job_id, **key.log_fields())
        future = self.pool.submit(self._run_job, key, fp, job_id, attempts)
        self._active[key.id] = future

    def _run_job(self, key: layout.SetKey, fp: Fingerprint, job_id: str, attempts: int) -> None:
        try:
            # Context for every line this job logs, in this worker thread.
            with log.bound_job(job_id=job_id, **key.log_fields()):
                try:
                    self._run_loss(key, fp, attempts)
                except Exception:
                    self.log.exception("loss.failed", reason="internal error")
                    self._fail(key, fp, attempts, "internal error")
        finally:
            with self._lock:
                self._active.pop(key.id, None)
                again = key.id in self._recheck
                self._recheck.discard(key.id)
            if again:
                self.schedule_evaluate(key)
            self.check_step(key.step_key)
            self._progress_at = time.monotonic()

    def _run_loss(self, key: layout.SetKey, fp: Fingerprint, attempts: int) -> None:
        if self.stop_event.is_set():
            return
        if sigs_digest(observe(key, self.runs).sigs) != fp.sigs:
            # Changed while queued: the settle wait starts again.
            self.schedule_evaluate(key)
            return
        if self._over_budget(key.run):
            # Queued before the budget ran out; it must not start now.
            self.state.update(key.id, SetState.SETTLING, reason="budget reached")
            return
        self.state.update(key.id, SetState.RUNNING)
        job = loss.LossJob(work=self.works[key.work], scripts_dir=key.scripts_dir(self.runs),
                           report_path=key.report_path(self.runs), first=key.first,
                           last=key.last)

        def started(chars: int, tokens: int) -> None:
            self.emit("loss.started", prompt_chars=chars, prompt_tokens=tokens,
                      attempt=attempts + 1)

        def retry(attempt: int, wait_s: float, error: BaseException) -> None:
            self.emit("loss.retry", level="warning", attempt=attempt, wait_s=round(wait_s, 3),
                      error=str(error))

        try:
            result = loss.run(job, settings=self.cfg.llm, templates=self.templates,
                              on_leak=self.cfg.integrity.on_leak, confine_to=self.runs,
                              hooks=loss.LossHooks(started=started, retry=retry),
                              complete=self.complete, sleep=self._interruptible_sleep)
        except BadOutputError as e:
            # The reply, not the input, was bad: refused, and retried like a failure.
            self._fail(key, fp, attempts, str(e), event="loss.refused")
            return
        except RefusedError as e:
            self.emit("loss.refused", level="warning", reason=str(e))
            self.state.update(key.id, SetState.REFUSED, reason=str(e),
                              refused_fingerprint=fp.as_json())
            return
        except LLMError as e:
            self._fail(key, fp, attempts, str(e), retry_after_s=e.retry_after_s)
            return
        except ConfigError as e:
            self._fail(key, fp, attempts, str(e))
            return
        except OSError as e:
            # A full disk, a permission: the job wrote nothing (all or none).
            where = f" {e.filename}" if e.filename else ""
            self._fail(key, fp, attempts,
                       f"cannot write the report{where}: {e.strerror or type(e).__name__}")
            return
        except Abandoned:
            self.state.update(key.id, SetState.QUEUED, reason="abandoned at shutdown")
            return
        c = result.completion
        spend = self.state.add_spend(key.run, c.tokens_in, c.tokens_out, c.tokens_cached,
                                     c.cost_usd, tokens_cache_write=c.tokens_cache_write)
        # Logged before the set turns DONE: DONE may complete the step, and
        # step.reported must come after the step's last loss.completed.
        self.emit("loss.completed", report=str(result.report_path), tokens_in=c.tokens_in,
                  tokens_out=c.tokens_out, tokens_cached=c.tokens_cached, cost_usd=c.cost_usd,
                  duration_ms=result.duration_ms, leaks_redacted=result.leaks_redacted,
                  attempts=c.attempts, tokens_cache_write=c.tokens_cache_write,
                  craft_distance=result.sidecar.get("craft_distance"))
        self.emit("cost.total", tokens_in=spend.tokens_in, tokens_out=spend.tokens_out,
                  cost_usd=round(spend.cost_usd, 6), tokens_cached=spend.tokens_cached,
                  tokens_cache_write=spend.tokens_cache_write)
        self.state.update(key.id, SetState.DONE, reason=None, attempts=0, next_retry_at=None,
                          fingerprint=fp.as_json())

    def _fail(self, key: layout.SetKey, fp: Fingerprint, attempts: int, reason: str,
              retry_after_s: float | None = None, event: str = "loss.failed") -> None:
        attempts += 1
        gave_up = attempts >= self.cfg.loss.max_attempts
        next_at = None if gave_up else self._next_retry(attempts - 1)
        if next_at is not None and retry_after_s is not None:
            # The server's last word on when to come back, capped like in llm.complete.
            next_at = max(next_at, self.clock() + min(retry_after_s, self.cfg.llm.backoff_max_s))
        self.emit(event, level="error" if event == "loss.failed" else "warning", reason=reason,
                  attempts=attempts,
                  next_retry_s=None if next_at is None else round(next_at - self.clock(), 1))
        self.state.update(key.id, SetState.FAILED, reason=reason, attempts=attempts,
                          next_retry_at=next_at, fingerprint=fp.as_json())
        if next_at is not None:
            self.schedule_evaluate(key, at=next_at)

    def _next_retry(self, failures_before: int) -> float:
        base = self.cfg.loss.retry_backoff_s * 2 ** failures_before
        return self.clock() + base * random.uniform(0.8, 1.2)

    def _interruptible_sleep(self, seconds: float) -> None:
        if self.abort_event.wait(seconds):
            raise Abandoned()

    # ------------------------------------------------------------ step barrier
    def check_step(self, step: layout.StepKey, keys: list[layout.SetKey] | None = None) -> None:
        """When every expected set of a step is done: step.reported once, then the optimizer."""
        keys = list(self._sets_of_step(step)) if keys is None else keys
        if not keys:
            return
        with self.state.lock:
            if not all((r := self.state.sets.get(k.id)) and r.state == SetState.DONE
                       for k in keys):
                return
            rec = self.state.steps.get(step.id) or self._step_from_marker(step) or StepRecord()
            if (not rec.optimizer_done and rec.optimizer_attempts
                    and progress.read_step_marker(self.runs, step).get("optimizer_done")):
                # state.json lags the marker by up to a flush: after a SIGKILL in
                # between, the marker's "optimizer ran" must win, or it runs twice.
                rec = self._step_from_marker(step) or rec
            first_time = rec.reported_at is None
            due = (not rec.optimizer_done
                   and rec.optimizer_attempts < self.cfg.optimizer.max_attempts
                   and (rec.optimizer_next_at or 0) <= self.clock()
                   and step.id not in self._optimizer_pending)
            if first_time or due:
                rec = self.state.step(step.id)  # only now: it marks the state for a write
            if first_time:
                rec.reported_at = self.clock()
            if due:
                rec.optimizer_attempts += 1
                self._optimizer_pending.add(step.id)  # decided and claimed under one lock
        if first_time:
            self._write_step_marker(step)
            self.emit("step.reported", run=step.run, epoch=step.epoch, step=step.step,
                      reports_dir=str(step.reports_dir(self.runs)), sets=len(keys),
                      **progress.step_fields(self.runs, step))
            self.loop.notice(step)
        if due:
            self._trigger_optimizer(step)

    def _step_from_marker(self, step: layout.StepKey) -> StepRecord | None:
        """The step's record from its marker file, when state.json was lost.

        state.json is a cache; the marker beside the reports is what keeps
        step.reported (and the optimizer) from happening twice after it is
        deleted or corrupted.
        """
        try:
            data = json.loads(self._step_marker(step).read_text("utf-8"))
            rec = StepRecord(**data)
        except (OSError, ValueError, TypeError):
            return None
        self.state.steps[step.id] = rec
        self.state.mark_dirty()
        return rec

    def _step_marker(self, step: layout.StepKey) -> Path:
        # Beside the reports folders, not in them: the optimizer reads those.
        return (self.runs / step.run / layout.LOSS_DIR / STEP_MARKERS
                / f"epoch_{step.epoch:02d}-step_{step.step:02d}.json")

    def _write_step_marker(self, step: layout.StepKey) -> None:
        with self.state.lock:
            rec = self.state.steps.get(step.id)
            payload = json.dumps(asdict(rec)) if rec else None
        if payload is not None:
            try:
                atomic.write_text(self._step_marker(step), payload + "\n")
            except OSError as e:
                self.emit("step.marker_failed", level="warning", step=step.id,
                          error=e.strerror or type(e).__name__)

    def _trigger_optimizer(self, step: layout.StepKey) -> None:
        if not self.cfg.optimizer.command:
            with self.state.lock:
                self.state.step(step.id).optimizer_done = True  # event only: consumers tail the log
                self._optimizer_pending.discard(step.id)
            self._write_step_marker(step)
            self.loop.notice(step)
            return
        future = self.optimizer_pool.submit(self._run_optimizer, step)
        self._optimizer_futures = [f for f in self._optimizer_futures if not f.done()] + [future]

    def _run_optimizer(self, step: layout.StepKey) -> None:
        values = {"run": step.run, "epoch": f"{step.epoch:02d}", "step": f"{step.step:02d}",
                  "reports_dir": str(step.reports_dir(self.runs)),
                  "run_dir": str(step.run_dir(self.runs))}
        argv = optimizer.render_argv(self.cfg.optimizer.command, values)
        fields: dict[str, Any] = {"run": step.run, "epoch": step.epoch, "step": step.step}

        def emit(event: str, **kw: Any) -> None:
            # The output relays are plain threads: bound context does not reach them.
            self.emit(event, **fields, **kw)

        with log.bound_job(**fields):
            self.emit("optimizer.started", argv=argv)
            try:
                result = optimizer.run(argv, timeout_s=self.cfg.optimizer.timeout_s, emit=emit,
                                       cancel=self.kill_optimizer)
            finally:
                with self.state.lock:
                    self._optimizer_pending.discard(step.id)
            rec = self.state.step(step.id)
            with self.state.lock:
                rec.optimizer_exit_code = result.exit_code
                rec.optimizer_done = result.exit_code == 0
                if not rec.optimizer_done:
                    rec.optimizer_next_at = self.clock() + self.cfg.loss.retry_backoff_s
            self._write_step_marker(step)
            self.emit("optimizer.finished", level="info" if result.exit_code == 0 else "error",
                      exit_code=result.exit_code, duration_ms=result.duration_ms)
            if result.reason is not None:
                self.emit("optimizer.failed", level="error", reason=result.reason,
                          attempt=rec.optimizer_attempts,
                          will_retry=rec.optimizer_attempts < self.cfg.optimizer.max_attempts)
            self.loop.notice(step)  # after the events: the next writer's come later

    # ------------------------------------------------------------- main loop
    def status_line(self) -> str:
        counts = self.state.counts()
        spent = sum(s.cost_usd for s in self.state.spend.values())
        return (f"{counts.get('done', 0)} done, {counts.get('queued', 0)} queued, "
                f"{counts.get('running', 0)} running, {counts.get('failed', 0)} failed, "
                f"${spent:.2f}")

    def healthy(self) -> bool:
        """For the systemd watchdog: intake alive and the loop not stuck."""
        watcher_ok = self.once or self.watcher.alive()
        return (watcher_ok and self.scheduler.running
                and time.monotonic() - self._progress_at < max(60.0, 3 * LOOP_TICK_S))

    def run_forever(self) -> None:
        """The main thread's loop: health, state flush, status; until stopped."""
        pinger = notify.WatchdogPinger(self.notifier, self.healthy, self.stop_event)
        pinger.start()
        last_status = ""
        while not self.stop_event.wait(LOOP_TICK_S):
            self._progress_at = time.monotonic()
            if self.watcher.root_replaced() or not self.watcher.alive():
                self._watcher_died()
                continue
            self._flush_state()
            line = self.status_line()
            if line != last_status:
                self.notifier.status(line)
                last_status = line

    def _flush_state(self) -> None:
        """Write state.json when dirty, at most every 10x its last write's cost.

        A state of 20,000 sets takes a good fraction of a second to write; a
        busy daemon must not spend its time rewriting it every tick.
        """
        now = time.monotonic()
        if now < self._next_flush_at:
            return
        try:
            written = self.state.flush(pid=os.getpid())
        except OSError as e:
            # A full disk must not take the daemon down; the state is a cache.
            self.state.mark_dirty()
            self._next_flush_at = now + 10 * LOOP_TICK_S
            self.emit("state.write_failed", level="warning", path=str(self.state.path),
                      error=e.strerror or type(e).__name__)
            return
        if written:
            cost = time.monotonic() - now
            self._next_flush_at = time.monotonic() + max(0.0, 10 * cost - LOOP_TICK_S)

    def _watcher_died(self) -> None:
        if self.watcher.root_replaced():
            # runs/ was deleted (and maybe recreated): its watch went with it.
            # Wait for it to exist, then take the lock and watch it anew.
            self.emit("watch.root_missing", level="warning", runs_dir=str(self.runs))
            self.watcher.stop()
            while not self.runs.is_dir() and not self.stop_event.wait(LOOP_TICK_S):
                pass
            if self.stop_event.is_set():
                return
            self._run_lock.release()
            self._run_lock.acquire()
            self.watcher.start()
            self.emit("watch.restarted", runs_dir=str(self.runs), observer=self.watcher.kind)
            self._schedule_scan()
            return
        self.emit("watch.died", level="error", thread="observer")
        self.exit_code = ExitCode.WATCHER_DIED
        self.stop_event.set()

    def run_once(self) -> None:
        """After the first scan: wait for every job (and optimizer) it started."""
        while True:
            with self._lock:
                futures = list(self._active.values())
            if not futures:
                break
            for future in futures:
                future.result()
        for future in list(self._optimizer_futures):
            future.result()

    def shutdown(self, reason: str) -> None:
        """Stop intake, drain running jobs up to the bound, abandon the rest."""
        with self._lock:
            running = sum(1 for f in self._active.values() if f.running())
            queued = len(self._active) - running
        self.emit("daemon.stopping", reason=reason, running=running, queued=queued)
        self.notifier.stopping()
        # 1. intake: no new events, no new evaluations or scans; jobs waiting
        #    to retry give up now (they are found again at the next start)
        self.stop_event.set()
        self.abort_event.set()
        self.watcher.stop()
        with contextlib.suppress(Exception):
            self.scheduler.shutdown(wait=False)
        # 2. jobs not started yet are cancelled; they are found again at next start
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.optimizer_pool.shutdown(wait=False, cancel_futures=True)
        # 3. running jobs and the optimizer may finish (their writes are atomic)
        #    up to the bound; a cancelled optimizer is retried at the next start
        deadline = time.monotonic() + self.cfg.daemon.shutdown_timeout_s
        with self._lock:
            futures = list(self._active.values()) + self._optimizer_futures
        for future in futures:
            with contextlib.suppress(Exception):
                future.result(timeout=max(0.0, deadline - time.monotonic()))
        self.loop.stop(max(0.0, deadline - time.monotonic()))  # a killed writer reruns at start
        # 4. what is still running (inside an LLM call) is abandoned: it dies
        #    with the process, and its writes are atomic, so nothing is partial
        self.kill_optimizer.set()
        for future in self._optimizer_futures:
            with contextlib.suppress(Exception):
                future.result(timeout=5)
        abandoned = sum(1 for f in futures if not f.done())
        for run, spend in sorted(self.state.spend.items()):
            self.emit("cost.total", run=run, tokens_in=spend.tokens_in,
                      tokens_out=spend.tokens_out, cost_usd=round(spend.cost_usd, 6),
                      tokens_cached=spend.tokens_cached,
                      tokens_cache_write=spend.tokens_cache_write)
        try:
            self.state.flush(force=True, pid=None)
        except OSError as e:
            self.emit("state.write_failed", level="warning", path=str(self.state.path),
                      error=e.strerror or type(e).__name__)
        counts = self.state.counts()
        self.emit("daemon.stopped", level="info" if self.exit_code == ExitCode.OK else "error",
                  exit_code=int(self.exit_code), done=counts.get("done", 0),
                  failed=counts.get("failed", 0), abandoned=abandoned)
        self.metrics.close()
        self._run_lock.release()
        self.abandoned = abandoned


def main(config_path: Path | None, once: bool = False) -> int:
    cfg = config.load(config_path)
    log.configure(log_file=cfg.log.file, level=cfg.log.level)
    daemon = Daemon(cfg, once=once)
    _install_signal_handlers(daemon)
    try:
        daemon.start()
    except SkilltrainError as e:
        daemon.emit("daemon.failed", level="error", reason=str(e), exit_code=int(e.exit_code))
        daemon.stop_event.set()
        with contextlib.suppress(Exception):
            daemon.scheduler.shutdown(wait=False)
        daemon.watcher.stop()
        raise
    if once:
        daemon.run_once()
        daemon.shutdown("once: idle")
    else:
        daemon.run_forever()
        daemon.shutdown("signal" if daemon.exit_code == ExitCode.OK else "watcher died")
    # Everything is written and the lock released. Abandoned jobs sit in an
    # LLM call we cannot interrupt (their writes are atomic, so nothing is
    # partial), and litellm's exit handlers take seconds: end the process now.
    logging_flush()
    os._exit(int(daemon.exit_code))


def _install_signal_handlers(daemon: Daemon) -> None:
    def handle(signum: int, frame: FrameType | None) -> None:
        if daemon.stop_event.is_set() and signum == signal.SIGINT:
            logging_flush()
            os._exit(130)  # second Ctrl-C: the user means it
        daemon.stop_event.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


def logging_flush() -> None:
    import logging

    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()


def _read_audit_cache(path: Path, keys_digest: str) -> dict[str, list[int]]:
    """Signatures of files found clean against these answer keys ({} if none)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("keys") != keys_digest:
        return {}
    files = data.get("files")
    return files if isinstance(files, dict) else {}


def _subdir_names(path: Path) -> list[str]:
    try:
        entries = os.scandir(path)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    with entries:
        return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))


def _subdirs(path: Path) -> list[Path]:
    return [path / name for name in _subdir_names(path)]


def _at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def _iso(ts: float) -> str:
    return _at(ts).isoformat(timespec="seconds")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("skilltrain")
    except PackageNotFoundError:
        return "unknown"
