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
import logging
import os
import random
import signal
import sys
import threading
import time
import tomllib
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.base import SchedulerNotRunningError

from skilltrain import atomic, config, dataset, layout, llm, log, notify, progress
from skilltrain.errors import (
    BadOutputError,
    ConfigError,
    ExitCode,
    InputsChangedError,
    LLMError,
    RefusedError,
    SkilltrainError,
)
from skilltrain.handlers import loss, optimizer
from skilltrain.lock import RunsLock
from skilltrain.loop import Loop
from skilltrain.metrics import Metrics
from skilltrain.observe import (
    Fingerprint,
    HumanDigests,
    Observation,
    observe,
    report_is_current,
    sigs_digest,
)
from skilltrain.state import SetState, StateStore, StepRecord
from skilltrain.templates import PromptTemplates
from skilltrain.watcher import Watcher

HINT_DEBOUNCE_S = 0.02  # coalesce the burst of events one file write makes
RESCAN_DEBOUNCE_S = 0.5
LOOP_TICK_S = 1.0
STALL_S = 60.0  # no scan, job end or loop tick for this long: the daemon is stuck
RESYNC_JITTER = 0.1  # +-10%: daemons on one NFS server do not scan in lockstep
CLOCK_SKEW_TOLERANCE_S = 2.0  # mtimes this far ahead of our clock are normal jitter
ONCE_SETTLE_ROUNDS = 5  # --once: rescans after a settle wait before it gives up on a set
AUDIT_CACHE = "audit-cache.json"  # in runs/.skilltrain/
STEP_MARKERS = layout.STEP_MARKERS  # runs/<run>/loss/.steps/epoch_EE-step_SS.json


class Abandoned(Exception):
    """Raised inside a job when the daemon shuts down while the job waits to retry."""


class Daemon:
    """The service. Construction is cheap; `start()` does the work."""

    def __init__(self, cfg: config.Config, *, once: bool = False,
                 runs_existed: bool | None = None) -> None:
        self.cfg = cfg
        self.runs_existed = runs_existed  # None: look at start()
        self.runs = cfg.paths.runs
        self.once = once
        self.log = log.get_logger("skilltrain.daemon")
        self._notify_warned = False
        self.notifier = notify.Notifier.from_env(on_error=self._notify_failed)
        self.metrics = Metrics(lambda: self.state.counts(), [s.value for s in SetState])
        self.complete = self.metrics.timed(llm.complete)
        self.clock = time.time  # wall clock: retry times are kept in the state
        self.stop_event = threading.Event()  # stop intake: set by signals or fatal errors
        self.abort_event = threading.Event()  # abandon jobs waiting to retry
        self.kill_optimizer = threading.Event()  # shutdown bound passed: end the optimizer
        self.exit_code = ExitCode.OK
        self.state = StateStore(self.runs, cfg.paths.state)
        self.templates = PromptTemplates(cfg.paths.prompts)
        self.human_digests = HumanDigests()
        self.works: dict[str, dataset.Work] = {}
        self._lock = threading.RLock()
        self._active: dict[str, Future[None]] = {}  # set id -> queued or running job
        self._recheck: set[str] = set()  # changed while active: evaluate again afterwards
        self._last_sigs: dict[str, Any] = {}  # set id -> (sigs, monotonic time they changed)
        self._ignored: set[str] = set()
        self._noticed_this_scan: set[str] = set()
        self._budget_reported: set[str] = set()
        self._evaluating: set[str] = set()  # set ids being evaluated (outside _lock)
        self._optimizer_futures: list[Future[None]] = []  # under _lock
        self._optimizer_pending: set[str] = set()  # step ids with an optimizer run claimed
        self.heartbeat = notify.Heartbeat()  # the main loop, a scan or a job made progress
        self._waiting_for_root = False  # runs/ was deleted: waiting is healthy
        self._scan_guard = threading.Lock()
        self._scanning = False  # one full scan at a time; under _scan_guard
        self._scan_wanted = False  # asked for while one ran: it goes round once more
        self._run_lock = RunsLock(self.runs / layout.STATE_DIR)
        self.scheduler = BackgroundScheduler(
            executors={"default": {"type": "threadpool", "max_workers": 2}},
            job_defaults={"misfire_grace_time": None, "coalesce": True, "max_instances": 4},
            timezone=UTC)
        self.pool = ThreadPoolExecutor(cfg.loss.concurrency, thread_name_prefix="loss")
        self.optimizer_pool = ThreadPoolExecutor(1, thread_name_prefix="optimizer")
        self.watcher = Watcher(self.runs, cfg.watch.observer, self.hint, self.emit,
                               rescan=self._schedule_scan)
        self.loop = Loop(cfg, self.emit, stopping=self.stop_event, over_budget=self._over_budget,
                         request_scan=self._schedule_scan, once=once, clock=self.clock)
        self._template_hash: tuple[float, str] | None = None
        self.abandoned = 0
        self._next_flush_at = 0.0
        self._once_rescan_at = 0.0  # --once: when sets waiting to settle are ready
        self.failures = 0  # sets failed or refused, optimizer runs failed (--once exit code)

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
        """Check config, lock, clean up, first scan, start intake. Raises on bad config."""
        preflight(self.cfg)  # before anything is created
        _quiet_inotify_stop_race()  # every stop of the observer: at SIGTERM, on fallback
        runs_existed = self.runs_existed if self.runs_existed is not None else self.runs.is_dir()
        self.runs.mkdir(parents=True, exist_ok=True)
        self._run_lock.acquire()
        self.emit("daemon.started", pid=os.getpid(), version=_version(),
                  config=str(self.cfg.source), runs_dir=str(self.runs),
                  observer=self.cfg.watch.observer, concurrency=self.cfg.loss.concurrency,
                  model=self.cfg.llm.model, once=self.once)
        if not runs_existed:
            self.emit("daemon.runs_created", runs_dir=str(self.runs))
        # The daemon writes only under runs/*/loss/ and runs/.skilltrain/.
        removed = sum(atomic.remove_leftover_temp_files(d) for d in self._own_dirs())
        if removed:
            self.emit("daemon.cleaned", temp_files=removed)
        self.loop.prepare()
        self.works = dataset.discover_works(self.cfg.paths.data)
        if not self.works:
            self.emit("daemon.no_works", level="warning", data_dir=str(self.cfg.paths.data))
        self._install_answer_keys()
        self._check_human_ranges()
        problem = self.state.load()
        if problem:
            self.emit("state.unreadable", level="error", path=str(self.state.path),
                      reason=f"{problem}; rebuilt from runs/")
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

    def _install_answer_keys(self) -> None:
        """Every work's index, for what belongs to no one work: log lines, error reasons."""
        from skilltrain import leakguard

        leakguard.install(leakguard.AnswerKeys(
            leakguard.index_for(name, episodes) for name, work in sorted(self.works.items())
            if (episodes := work.read_all_human())))

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

        result = audit.scan(self.runs, indexes, unchanged=unchanged,
                            data_root=self.cfg.paths.data)
        for link in result.links:
            self.emit("audit.link", level="error", file=str(link.file), target=str(link.target))
        for error in result.errors:
            # "<path>: why": a file that could not be read is not clean.
            for path in [p for p in new if error.startswith(f"{p}: ")]:
                del new[path]
        for hit in result.hits:
            new.pop(str(hit.file), None)  # never remembered as clean
            self.emit("audit.leak", level="error", file=str(hit.file), line=hit.line,
                      work=hit.work, episode=hit.episode, n_words=hit.n_words)
        new.pop(str(cache_path), None)
        with contextlib.suppress(OSError):
            atomic.write_text(cache_path, json.dumps({"keys": keys_digest, "files": new}))
        self.emit("audit.completed", level="warning" if result.hits or result.links else "info",
                  files=result.files, skipped=result.skipped, leaks=len(result.hits),
                  links=len(result.links),
                  errors=len(result.errors), duration_ms=int((time.monotonic() - t0) * 1000))

    def _own_dirs(self) -> list[Path]:
        dirs = [self.runs / layout.STATE_DIR]
        dirs += [run / layout.LOSS_DIR for run in _subdirs(self.runs)
                 if (run / layout.LOSS_DIR).is_dir()]
        return dirs

    # ------------------------------------------------------------------- scan
    def scan(self) -> None:
        """Level-triggered reconciliation: look at every set under runs/.

        One full scan at a time (the periodic resync and a rescan can fall
        due together): a scan asked for while one runs makes that one go
        round once more, so what prompted it is still seen.
        """
        with self._scan_guard:
            if self._scanning:
                self._scan_wanted = True
                return
            self._scanning = True
        try:
            while True:
                self._scan_tree()
                with self._scan_guard:
                    if not self._scan_wanted or self.stop_event.is_set():
                        break
                    self._scan_wanted = False
        finally:
            with self._scan_guard:
                self._scanning = self._scan_wanted = False

    def _scan_tree(self) -> None:
        t0 = time.monotonic()
        self._template_hash = None  # a scan reads the template afresh
        self._noticed_this_scan = set()
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
                    self.state.forget(set_id)  # its folder is gone
            for step_id in set(self.state.steps) - {step.id for step in steps}:
                # Its folder is gone: a run made again under the same name is
                # reported (and looped) afresh, not taken as reported already.
                self.state.forget_step(step_id)
        for step in sorted(steps):
            self.check_step(step, steps[step])
        self.watcher.watch_open_steps(self._open_step_dirs(steps))
        self._forget_fixed_paths()
        counts = self.state.counts()
        by_state: dict[str, Any] = {s.value: counts.get(s.value, 0) for s in SetState}
        self.emit("scan.completed", sets=len(seen),
                  duration_ms=int((time.monotonic() - t0) * 1000), **by_state)
        self.watcher.check_coverage()
        self.heartbeat.beat()

    def _open_step_dirs(self, steps: dict[layout.StepKey, list[layout.SetKey]]) -> set[Path]:
        """Step folders with a set not yet reported: where the watcher looks."""
        with self.state.lock:
            return {step.step_dir(self.runs) for step, keys in steps.items()
                    if any((r := self.state.sets.get(k.id)) is None or r.state != SetState.DONE
                           for k in keys)}

    def _discover_steps(self) -> Iterator[tuple[layout.StepKey, list[layout.SetKey]]]:
        """Every step folder under runs/ with the sets it is expected to have."""
        self._report_linked_folders(self.runs)
        for run in _subdirs(self.runs):
            if run.name.startswith("."):
                continue
            works = self._expected_works(run.name)
            self._report_linked_folders(run)
            for epoch_dir in _subdirs(run):
                epoch = layout.EPOCH_DIR.fullmatch(epoch_dir.name)
                if epoch is None or epoch_dir.name != f"epoch_{int(epoch.group(1)):02d}":
                    if epoch_dir.name != layout.LOSS_DIR:
                        self._ignore(epoch_dir, _misnumbered(epoch_dir.name, "epoch"))
                    continue
                self._report_linked_folders(epoch_dir)
                for step_dir in _subdirs(epoch_dir):
                    step = layout.STEP_DIR.fullmatch(step_dir.name)
                    if step is None or step_dir.name != f"step_{int(step.group(1)):02d}":
                        self._ignore(step_dir, _misnumbered(step_dir.name, "step"))
                        continue
                    step_key = layout.StepKey(run.name, int(epoch.group(1)), int(step.group(1)))
                    yield step_key, list(self._sets_of_step(step_key, works))

    def _sets_of_step(self, step: layout.StepKey,
                      works: list[dataset.Work] | None = None) -> Iterator[layout.SetKey]:
        step_dir = step.step_dir(self.runs)
        works = works if works is not None else self._expected_works(step.run)
        for name in _subdir_names(step_dir):
            if name not in self.works:
                self._ignore(step_dir / name, "unknown work (no data/<work>/human/)")
            elif all(work.name != name for work in works):
                self._ignore(step_dir / name, f"work not listed in {step.run}/run.toml")
        for work in works:
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
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            # A list or table in it would be unhashable below: a crash at start.
            self._ignore(run_toml, "works must be a list of work names; using all works")
            return list(self.works.values())
        for name in names:
            if name not in self.works:
                self._ignore(run_toml, f"lists unknown work {name!r}")
        return [self.works[n] for n in names if n in self.works]

    def _forget_fixed_paths(self) -> None:
        """A path under runs/ not noticed again by a whole scan is fixed (or gone)."""
        runs = f"{self.runs}/"
        noticed = self._noticed_this_scan
        self.state.keep_notices(lambda path: path in noticed or not path.startswith(runs))

    def _report_linked_folders(self, parent: Path) -> None:
        """Run, epoch and step folders that are symlinks are not followed (work
        and scripts/ folders: see observe); each is named once, with why."""
        for name in _symlinked_subdirs(parent):
            link = parent / name
            try:
                dataset.confine(str(link), self.runs, answer_key=self.cfg.paths.data)
                reason = "a symlinked folder; not followed (copy or move it into runs/)"
            except (RefusedError, OSError) as e:
                reason = str(e) if isinstance(e, RefusedError) else f"unreadable link ({e})"
            self._ignore(link, reason, event="set.unusable")

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

    def _ignore(self, path: Path, reason: str, event: str = "set.ignored") -> bool:
        """Log a path we cannot use once, not at every scan. True when logged now."""
        self.state.notice(str(path), event, reason)  # for status, while it lasts
        self._noticed_this_scan.add(str(path))
        if f"{path}: {reason}" in self._ignored:
            return False
        self._ignored.add(f"{path}: {reason}")
        self.emit(event, level="warning", path=str(path), reason=reason)
        return True

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
        try:
            self.scheduler.add_job(self._evaluate_job, "date", args=[key], id=key.id,
                                   replace_existing=True, run_date=_at(when))
        except SchedulerNotRunningError:
            pass  # shutting down: the next start finds the set again
        except Exception:
            # The set now waits for its next event or the resync: say so.
            self.log.exception("set.error", **key.log_fields())

    def _settle_later(self, key: layout.SetKey, at: float) -> None:
        """Look at a set again when its settle window ends. --once has no
        scheduler: its rescan after the wait looks at every such set."""
        if self.once:
            self._once_rescan_at = max(self._once_rescan_at, at)
        self.schedule_evaluate(key, at=at)

    def _evaluate_job(self, key: layout.SetKey) -> None:
        try:
            self.evaluate(key)
        except Exception:
            self.log.exception("set.error", **key.log_fields())
        self.check_step(key.step_key)

    # --------------------------------------------------------------- evaluate
    def evaluate(self, key: layout.SetKey) -> None:
        """Look at one set and do the one right thing for it now."""
        if self.loop.writing(key.step_key):
            # Scored once the loop recorded its writer's end: a writer re-run
            # after a crash must not leave a report of the first run's episodes.
            self.state.update(key.id, SetState.WAITING, reason="the loop's writer is running")
            return
        with self._lock:
            if key.id in self._active or key.id in self._evaluating:
                self._recheck.add(key.id)  # coalesce: look again when the job or look ends
                return
            self._evaluating.add(key.id)  # claimed: stats and hashes run unlocked
        try:
            self._evaluate_claimed(key)
        finally:
            with self._lock:
                self._evaluating.discard(key.id)
                again = key.id in self._recheck and key.id not in self._active
                if again:
                    self._recheck.discard(key.id)
        if again:
            self.schedule_evaluate(key)

    def _evaluate_claimed(self, key: layout.SetKey) -> None:
        obs = observe(key, self.runs, self.cfg.paths.data)
        rec = self.state.get(key.id)
        if not obs.complete:
            self._waiting(key, obs)
            return
        work = self.works[key.work]
        human = self.human_digests.digest(work, key.first, key.last) or ""
        fp = Fingerprint.of(obs.sigs, human, self.template_hash(), self.cfg.llm.model)
        recorded = Fingerprint.from_json(rec.fingerprint) if rec and rec.fingerprint else None
        if human and report_is_current(key, self.runs, fp, recorded, self.cfg.paths.data):
            if rec is None or rec.state != SetState.DONE or recorded != fp:
                self.state.update(key.id, SetState.DONE, reason=None, attempts=0,
                                  fingerprint=fp.as_json(), next_retry_at=None)
            return

        now = self.clock()
        ready_at = max(self._mtime_ready_at(key, obs, now), self._changed_at(key, obs, now))
        report_exists = key.report_path(self.runs).exists()
        if ready_at > now:
            self.state.update(key.id, SetState.STALE if report_exists else SetState.SETTLING,
                              reason=f"settling until {_iso(ready_at)}")
            self._settle_later(key, ready_at)
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
            self.state.update(key.id, SetState.STALE if report_exists else SetState.HELD,
                              reason="budget reached")
            return
        if report_exists:
            self._report_stale(key)
        attempts = rec.attempts if rec and rec.state == SetState.FAILED \
            and rec.fingerprint == fp.as_json() else 0
        self._submit(key, fp, attempts)

    def _waiting(self, key: layout.SetKey, obs: Observation) -> None:
        """An incomplete range: one event when it will not complete by itself."""
        problem = obs.problem or "incomplete"
        stuck = obs.unusable
        if obs.zero_byte and not obs.unusable:
            # A file is created empty an instant before it is written: only
            # one still empty after the settle window is worth a line.
            quiet_until = obs.newest_mtime_ns / 1e9 + self.cfg.loss.settle_seconds
            stuck = quiet_until <= self.clock()
            if not stuck:
                self._settle_later(key, quiet_until + 0.05)
        # Not a range still being written but something that will not do by
        # itself (a symlink out of runs/, a misspelt name): say so once.
        if stuck and self._ignore(key.scripts_dir(self.runs), problem, event="set.unusable"):
            self.failures += 1
        self.state.update(key.id, SetState.WAITING, reason=problem)

    def _mtime_ready_at(self, key: layout.SetKey, obs: Observation, now: float) -> float:
        """When the episodes' mtimes say the range is finished; a writer's clock
        ahead of ours (NFS, a remote copy) is capped, and said once."""
        ready_at = obs.ready_at(self.cfg.loss.settle_seconds)
        ahead_s = obs.newest_mtime_ns / 1e9 - now
        if obs.success_marker or ahead_s <= CLOCK_SKEW_TOLERANCE_S:
            return ready_at
        self._ignore(key.scripts_dir(self.runs),
                     f"newest episode mtime {_iso(obs.newest_mtime_ns / 1e9)} is in the "
                     "future: the writer's clock is ahead of ours; settling from when the "
                     "files last changed instead",
                     event="set.clock_skew")
        return 0.0  # _changed_at's settle window from our own clock applies

    def _changed_at(self, key: layout.SetKey, obs: Observation, now: float) -> float:
        """A set whose files changed since we last looked waits settle_seconds from now.

        mtimes alone would do on a local disk; this guards against a writer
        whose clock (NFS) or copy tool (`cp -p`, rsync -t) sets old mtimes.
        The first sighting counts as a change: a slow writer appending to a
        file with an old mtime is not finished just because we looked late
        (unless _SUCCESS, newer than every episode, says it is).
        """
        previous = self._last_sigs.get(key.id)
        if previous is None:
            self._last_sigs[key.id] = (obs.sigs, now)
            if obs.success_marker:
                return 0.0
            return now + self.cfg.loss.settle_seconds
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
                  + ("; the optimizer already ran for this step: the step is reported "
                     "again and the optimizer re-run once the new report is written"
                     if after_optimizer else ""), after_optimizer=after_optimizer,
                  **key.log_fields())

    def template_hash(self) -> str:
        """The loss template's hash, read at most once a second (and afresh by
        each scan): a burst of evaluations reads the file once, an edit is
        seen within a second."""
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
        with self._lock:  # evaluations run in parallel: one line per run
            first = run not in self._budget_reported
            self._budget_reported.add(run)
        if first:
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
        with self._lock:  # before the job's own end can look for it
            future = self.pool.submit(self._run_job, key, fp, job_id, attempts)
            self._active[key.id] = future
        future.add_done_callback(self._report_crash)

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
            self.heartbeat.beat()

    def _still_wanted(self, key: layout.SetKey, fp: Fingerprint) -> bool:
        """Is a queued job still to run, now that it has a worker?"""
        if self.stop_event.is_set():
            return False
        if sigs_digest(observe(key, self.runs, self.cfg.paths.data).sigs) != fp.sigs:
            # Changed while queued: the settle wait starts again.
            self.schedule_evaluate(key)
            return False
        if self._over_budget(key.run):
            # Queued before the budget ran out; it must not start now.
            report_exists = key.report_path(self.runs).exists()
            self.state.update(key.id, SetState.STALE if report_exists else SetState.HELD,
                              reason="budget reached")
            return False
        return True

    def _inputs_changed(self, key: layout.SetKey, error: InputsChangedError) -> None:
        """Not a report of what is on disk now: nothing written, the step not
        counted; the set settles again and is made anew."""
        self.emit("loss.discarded", level="warning", reason=str(error))
        self._last_sigs.pop(key.id, None)
        self.state.update(key.id, SetState.SETTLING, reason=str(error))
        self._settle_later(key, self.clock() + self.cfg.loss.settle_seconds)

    def _run_loss(self, key: layout.SetKey, fp: Fingerprint, attempts: int) -> None:
        if not self._still_wanted(key, fp):
            return
        self.state.update(key.id, SetState.RUNNING)
        job = loss.LossJob(work=self.works[key.work], scripts_dir=key.scripts_dir(self.runs),
                           report_path=key.report_path(self.runs), first=key.first,
                           last=key.last)

        def started(chars: int, tokens: int | None) -> None:
            self.emit("loss.started", prompt_chars=chars, prompt_tokens=tokens,
                      attempt=attempts + 1)

        def retry(attempt: int, wait_s: float, error: BaseException) -> None:
            self.emit("loss.retry", level="warning", attempt=attempt, wait_s=round(wait_s, 3),
                      error=str(error))

        try:
            result = loss.run(job, settings=self.cfg.llm, templates=self.templates,
                              on_leak=self.cfg.integrity.on_leak, confine_to=self.runs,
                              answer_key=self.cfg.paths.data,
                              hooks=loss.LossHooks(started=started, retry=retry),
                              complete=self.complete, sleep=self._interruptible_sleep)
        except InputsChangedError as e:
            self._inputs_changed(key, e)
            return
        except BadOutputError as e:
            # The reply, not the input, was bad: refused, and retried like a failure.
            self._fail(key, fp, attempts, str(e), event="loss.refused")
            return
        except RefusedError as e:
            self.failures += 1
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
        self._reopen_step(key)
        self.state.update(key.id, SetState.DONE, reason=None, attempts=0, next_retry_at=None,
                          fingerprint=fp.as_json())

    def _reopen_step(self, key: layout.SetKey) -> None:
        """A new report in a step already reported: the optimizer learnt from the
        report this one replaces, so the step is reported again and re-optimized."""
        step = key.step_key
        with self.state.lock:
            # After a lost state the step's marker file still knows.
            rec = self.state.steps.get(step.id) or self._step_from_marker(step)
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
        self._write_step_marker(step)

    def _fail(self, key: layout.SetKey, fp: Fingerprint, attempts: int, reason: str,
              retry_after_s: float | None = None, event: str = "loss.failed") -> None:
        attempts += 1
        self.failures += 1
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
            again: dict[str, Any] = ({"again": True, "reason": rec.reopened_reason}
                                     if rec.generation else {})
            self.emit("step.reported", run=step.run, epoch=step.epoch, step=step.step,
                      reports_dir=str(step.reports_dir(self.runs)), sets=len(keys),
                      **again, **progress.step_fields(self.runs, step))
            self.loop.notice(step)
        if due:
            self._trigger_optimizer(step)

    def _step_from_marker(self, step: layout.StepKey) -> StepRecord | None:
        """The step's record from its marker file, when the state was lost.

        The state is a cache; the marker beside the reports is what keeps
        step.reported (and the optimizer) from happening twice after it is
        deleted or corrupted.
        """
        try:
            data = json.loads(self._step_marker(step).read_text("utf-8"))
            rec = StepRecord(**data)
        except (OSError, ValueError, TypeError):
            return None
        self.state.put_step(step.id, rec)
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
        future.add_done_callback(self._report_crash)
        with self._lock:  # jobs finishing together trigger steps from several threads
            self._optimizer_futures = [f for f in self._optimizer_futures if not f.done()]
            self._optimizer_futures.append(future)

    def _report_crash(self, future: Future[None]) -> None:
        """A loss job or optimizer run that raised: in forever mode nobody asks its future."""
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            self.log.error("daemon.task_failed", error=type(error).__name__, exc_info=error)

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
            if bad_command is None:
                self.emit("optimizer.started", argv=argv)
            try:
                result = bad_command or optimizer.run(
                    argv, timeout_s=self.cfg.optimizer.timeout_s, emit=emit,
                    cancel=self.kill_optimizer)
            finally:
                with self.state.lock:
                    self._optimizer_pending.discard(step.id)
            with self.state.lock:
                rec = self.state.step(step.id)  # under the lock: a flush sees all or nothing
                reopened = rec.generation != generation
                if not reopened:  # else a report changed meanwhile: this run is not the last
                    rec.optimizer_exit_code = result.exit_code
                    rec.optimizer_done = result.exit_code == 0
                    if not rec.optimizer_done:
                        rec.optimizer_next_at = self.clock() + self.cfg.loss.retry_backoff_s
            self._write_step_marker(step)
            if result.exit_code != 0:
                self.failures += 1
            self.emit("optimizer.finished", level="info" if result.exit_code == 0 else "error",
                      exit_code=result.exit_code, duration_ms=result.duration_ms)
            if result.reason is not None:
                self.emit("optimizer.failed", level="error", reason=result.reason,
                          attempt=rec.optimizer_attempts,
                          will_retry=rec.optimizer_attempts < self.cfg.optimizer.max_attempts)
            self.loop.notice(step)  # after the events: the next writer's come later
        if reopened:
            self.check_step(step)

    # ------------------------------------------------------------- main loop
    def status_line(self) -> str:
        counts = self.state.counts()
        spent = sum(s.cost_usd for s in self.state.spend.values())
        return (f"{counts.get('done', 0)} done, {counts.get('queued', 0)} queued, "
                f"{counts.get('running', 0)} running, {counts.get('failed', 0)} failed, "
                f"${spent:.2f}")

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
        return problems

    def _unhealthy(self) -> None:
        # Logged before systemd's WatchdogSec runs out, so the kill has a reason.
        self.emit("daemon.unhealthy", level="error", reasons=self.health_problems(),
                  watchdog_s=self.notifier.watchdog_interval_s)

    def run_forever(self) -> None:
        """The main thread's loop: health, state flush, status; until stopped."""
        pinger = notify.WatchdogPinger(self.notifier, self.healthy, self.stop_event,
                                       on_unhealthy=self._unhealthy)
        pinger.start()
        last_status = ""
        while not self.stop_event.wait(LOOP_TICK_S):
            self.heartbeat.beat()
            if self.watcher.root_replaced() or not self.watcher.alive():
                self._watcher_died()
                continue
            self._flush_state()
            line = self.status_line()
            if line != last_status:
                self.notifier.status(line)
                last_status = line

    def _flush_state(self) -> None:
        """Write the state's changes since the last flush, at most every 10x
        its last write's cost.

        A flush costs the size of its batch (a millisecond or so for a tick's
        changes; the first scan's 100,000 new sets take a second): a busy
        daemon must not spend its time writing every tick.
        """
        now = time.monotonic()
        if now < self._next_flush_at:
            return
        try:
            written = self.state.flush(pid=os.getpid())
        except OSError as e:
            # A full disk must not take the daemon down; the state is a cache.
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
            self._schedule_scan()
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
            self._drain_once()
            wait_s = self._once_rescan_at - time.time()
            if self._once_rescan_at == 0.0 or rounds == ONCE_SETTLE_ROUNDS:
                break
            self._once_rescan_at = 0.0
            # A settle window is never longer than settle_seconds from now.
            wait_s = min(wait_s, self.cfg.loss.settle_seconds + CLOCK_SKEW_TOLERANCE_S)
            if self.stop_event.wait(max(0.0, wait_s) + 0.05):
                break
            self.scan()

    def _drain_once(self) -> None:
        while True:
            with self._lock:
                futures = list(self._active.values())
            if not futures:
                break
            for future in futures:
                future.result()
        with self._lock:
            optimizers = list(self._optimizer_futures)
        for future in optimizers:
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
        with self._lock:
            optimizers = list(self._optimizer_futures)
        for future in optimizers:
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
        self.state.close()
        counts = self.state.counts()
        self.emit("daemon.stopped", level="info" if self.exit_code == ExitCode.OK else "error",
                  exit_code=int(self.exit_code), done=counts.get("done", 0),
                  failed=counts.get("failed", 0), abandoned=abandoned)
        self.metrics.close()
        self._run_lock.release()
        self.abandoned = abandoned


def preflight(cfg: config.Config) -> None:
    """Every configuration error found before anything is created or any job runs."""
    if not cfg.paths.data.is_dir():
        raise ConfigError(f"[paths] data = {str(cfg.paths.data)!r}: no such folder "
                          "(the answer keys live in data/<work>/human/)")
    # A syntax error or a misspelt variable stops us here, with its line.
    loss.check_template(PromptTemplates(cfg.paths.prompts))
    optimizer.check_command(cfg.optimizer.command)
    llm.check_credentials(cfg.llm)


def main(config_path: Path | None, once: bool = False) -> int:
    cfg = config.load(config_path)
    if notice := config.defaults_notice(cfg):
        print(f"skilltrain: {notice}", file=sys.stderr)
    try:
        preflight(cfg)  # before the log file (in runs/) is opened: a bad config creates nothing
    except ConfigError as e:
        _log_if_possible(cfg, e)
        raise
    runs_existed = cfg.paths.runs.is_dir()
    log.configure(log_file=cfg.log.file, level=cfg.log.level)
    daemon = Daemon(cfg, once=once, runs_existed=runs_existed)
    _install_signal_handlers(daemon)
    try:
        daemon.start()
    except SkilltrainError as e:
        daemon.emit("daemon.failed", level="error", reason=str(e), exit_code=int(e.exit_code))
        e.logged = True
        daemon.stop_event.set()
        with contextlib.suppress(Exception):
            daemon.scheduler.shutdown(wait=False)
        daemon.watcher.stop()
        raise
    if once:
        daemon.run_once()
        if daemon.failures and daemon.exit_code == ExitCode.OK:
            daemon.exit_code = ExitCode.FAILURE  # cron and scripts must see it
        daemon.shutdown("once: idle")
    else:
        daemon.run_forever()
        daemon.shutdown("signal" if daemon.exit_code == ExitCode.OK else "watcher died")
    # Everything is written and the lock released. Abandoned jobs sit in an
    # LLM call we cannot interrupt (their writes are atomic, so nothing is
    # partial), and litellm's exit handlers take seconds: end the process now.
    logging_flush()
    os._exit(int(daemon.exit_code))


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


def _log_if_possible(cfg: config.Config, error: SkilltrainError) -> None:
    """daemon.failed in the log file too, when its folder exists (created for
    this, it would not be "nothing created"). Marks the error as logged."""
    if cfg.log.file is None or not cfg.log.file.parent.is_dir():
        return
    log.configure(log_file=cfg.log.file, level=cfg.log.level)
    log.get_logger("skilltrain.daemon").error("daemon.failed", reason=str(error),
                                              exit_code=int(error.exit_code))
    log.shutdown()
    error.logged = True


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


def _entries(path: Path) -> list[os.DirEntry[str]]:
    try:
        entries = os.scandir(path)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    with entries:
        return list(entries)


def _subdir_names(path: Path) -> list[str]:
    return sorted(e.name for e in _entries(path) if e.is_dir(follow_symlinks=False))


def _symlinked_subdirs(path: Path) -> list[str]:
    """Names of the symlinks in `path` that lead to a folder (or nowhere)."""
    return sorted(e.name for e in _entries(path)
                  if e.is_symlink() and not e.name.startswith(".")
                  and (e.is_dir() or not os.path.exists(e.path)))


def _misnumbered(name: str, kind: str) -> str:
    """Why a folder is not an epoch/step folder, with the name that would be."""
    match = (layout.EPOCH_DIR if kind == "epoch" else layout.STEP_DIR).fullmatch(name)
    article = "an" if kind == "epoch" else "a"
    if match is None:
        return f"not {article} {kind}_NN folder"
    return (f"not {article} {kind}_NN folder: numbers have two or more digits, zero-padded "
            f"(expected {kind}_{int(match.group(1)):02d})")


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
