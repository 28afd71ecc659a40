"""Looking at a set again: what a part says, and the one place that schedules it.

    reconcile.evaluate ──returns──┐
    a job's outcome ───returns────┤ Revisit(key, at, why)
    batch mode, the loop ─────────┤ (their own threads: handed over directly)
                                  v
                              Revisits.ask ──> an APScheduler date job per set
                                                (id = set id, the earliest time wins)
                                                  └──> reconcile evaluates the set

No part below the reconciler calls back up into it: evaluation and a job's
outcome return a `Revisit` ("look at this set again, at this time, for this
reason") and hand it here; `Revisits` is built before them and served by the
reconciler once that is built. When a retry falls due is decided where the
failure is seen (outcomes.py, core/backoff.py); here only when a look runs.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from apscheduler.jobstores.base import JobLookupError
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.base import STATE_STOPPED, SchedulerNotRunningError

from ..core import layout
from ..infra import log
from .settle import SettleClock, at

RESCAN_DEBOUNCE_S = 0.5


class Scheduler(BackgroundScheduler):
    """APScheduler's background scheduler, quiet about a look that ran as it stopped.

    APScheduler 3.11's shutdown() marks the scheduler stopped without its job
    stores' lock; a date job run at that moment is then removed from the
    pending jobs, not from its store, and JobLookupError kills the scheduler's
    thread (seen as a CI failure: test_loop, job "rescan"). Stopped, the job
    is gone with its store: there is nothing left to remove.
    """

    def remove_job(self, job_id: str, jobstore: str | None = None) -> None:
        try:
            super().remove_job(job_id, jobstore)
        except JobLookupError:
            if self.state != STATE_STOPPED:
                raise


class Why(Enum):
    AGAIN = "again"  # something changed: a job or look ended, a batch gave the set back
    SETTLE = "settle"  # its settle window ends (--once waits for these)
    RETRY = "retry"  # a failed job's backoff ends (--once does not wait)
    RESETTLE = "resettle"  # its inputs changed under a job: the settle wait starts again


@dataclass(frozen=True)
class Revisit:
    """Look at `key` again at `at` (wall clock; None: now)."""

    key: layout.SetKey
    at: float | None = None
    why: Why = Why.AGAIN


class Revisits:
    """Schedules every look at a set and every rescan; the reconciler serves them.

    One pending look per set, at the earliest time asked for: a later time
    never replaces an earlier pending look (a settle wait of 30 s must not
    swallow the look a `_SUCCESS` event asked for in 20 ms); the look runs
    after every request made before it, sees what they saw, and returns its
    own next look if it needs one. --once has no scheduler: it rescans once
    the latest settle wait asked for has passed (`once_rescan_at`).
    """

    def __init__(self, scheduler: BackgroundScheduler, settle: SettleClock, *,
                 stopping: threading.Event, once: bool,
                 clock: Callable[[], float] = time.time) -> None:
        self.scheduler = scheduler
        self.clock = clock  # wall clock: a Revisit's time is one
        self.settle = settle
        self.stopping = stopping
        self.once = once
        self.once_rescan_at = 0.0  # --once: when sets waiting to settle are ready
        self.log = log.get_logger("skilltrain.daemon")
        self._evaluate: Callable[[layout.SetKey], None] | None = None
        self._scan: Callable[[], None] | None = None
        self._guard = threading.Lock()  # a look's time: read and set at once

    def serve(self, evaluate: Callable[[layout.SetKey], None], scan: Callable[[], None]) -> None:
        """The reconciler, once built: what a look and a rescan run."""
        self._evaluate, self._scan = evaluate, scan

    def take_once_rescan_at(self) -> float:
        """--once: when the sets waiting to settle are ready (0.0: none), and forget it."""
        with self._guard:
            at_, self.once_rescan_at = self.once_rescan_at, 0.0
            return at_

    def ask(self, *revisits: Revisit | None) -> None:
        for revisit in revisits:
            if revisit is not None:
                self._ask(revisit)

    def look(self, key: layout.SetKey, *, delay_s: float = 0.0) -> None:
        """Look at a set again, now or after a short delay (a debounce)."""
        self._ask(Revisit(key, self.clock() + delay_s if delay_s else None))

    def scan_soon(self) -> None:
        """Look at every set again soon: a burst of asks makes one scan."""
        assert self._scan is not None, "Revisits.serve() first"
        self.scheduler.add_job(self._scan, "date", id="rescan", replace_existing=True,
                               run_date=at(self.clock() + RESCAN_DEBOUNCE_S))

    def _ask(self, revisit: Revisit) -> None:
        key = revisit.key
        if revisit.why == Why.RESETTLE:
            self.settle.forget(key)
        if self.once:
            if revisit.why in (Why.SETTLE, Why.RESETTLE) and revisit.at is not None:
                with self._guard:
                    self.once_rescan_at = max(self.once_rescan_at, revisit.at)
            return
        if self.stopping.is_set():
            return
        assert self._evaluate is not None, "Revisits.serve() first"
        when = at(revisit.at if revisit.at is not None else self.clock())
        try:
            with self._guard:
                pending = self.scheduler.get_job(key.id)
                if pending is not None and pending.next_run_time is not None \
                        and pending.next_run_time <= when:
                    return
                self.scheduler.add_job(self._evaluate, "date", args=[key], id=key.id,
                                       replace_existing=True, run_date=when)
        except SchedulerNotRunningError:
            pass  # shutting down: the next start finds the set again
        except Exception:
            # The set now waits for its next event or the resync: say so.
            self.log.exception("set.error", **key.log_fields())
