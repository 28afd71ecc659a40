"""Where every look at a set is scheduled (daemon/service/revisit.py): one
pending look per set at the earliest time asked for, a changed input's settle
wait started afresh, --once's rescan time. A real APScheduler (paused, so
nothing runs), a real settle clock; no daemon."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from apscheduler.schedulers.background import BackgroundScheduler

from skilltrain.daemon.core import layout
from skilltrain.daemon.service.observe import Observation
from skilltrain.daemon.service.revisit import Revisit, Revisits, Why
from skilltrain.daemon.service.settle import SettleClock

KEY = layout.SetKey("r1", 1, 1, "alpha", 1, 3)


@pytest.fixture
def scheduler() -> Iterator[BackgroundScheduler]:
    scheduler = BackgroundScheduler(timezone=UTC)
    scheduler.start(paused=True)  # jobs get their times; none runs
    yield scheduler
    scheduler.shutdown(wait=False)


def revisits(scheduler: BackgroundScheduler | None, tmp_path: Path, *,
             once: bool = False) -> tuple[Revisits, SettleClock, threading.Event]:
    settle = SettleClock(30.0, tmp_path, lambda path, reason, event: True)
    stopping = threading.Event()
    r = Revisits(scheduler, settle, stopping=stopping, once=once)  # type: ignore[arg-type]
    r.serve(lambda key: None, lambda: None)
    return r, settle, stopping


def pending_at(scheduler: BackgroundScheduler) -> float | None:
    job = scheduler.get_job(KEY.id)
    return None if job is None else job.next_run_time.timestamp()


def test_the_earliest_look_asked_for_wins(scheduler: BackgroundScheduler, tmp_path: Path) -> None:
    r, _, _ = revisits(scheduler, tmp_path)
    now = time.time()
    r.ask(Revisit(KEY, now + 30, Why.SETTLE))
    assert pending_at(scheduler) == pytest.approx(now + 30, abs=1e-3)
    r.ask(Revisit(KEY, now + 5, Why.RETRY))
    assert pending_at(scheduler) == pytest.approx(now + 5, abs=1e-3)
    r.ask(Revisit(KEY, now + 60, Why.SETTLE))  # a later wait never swallows an earlier look
    assert pending_at(scheduler) == pytest.approx(now + 5, abs=1e-3)
    r.ask(None, Revisit(KEY))  # now
    at = pending_at(scheduler)
    assert at is not None and at <= time.time()
    assert len(scheduler.get_jobs()) == 1


def test_a_changed_input_starts_its_settle_wait_afresh(
    scheduler: BackgroundScheduler, tmp_path: Path,
) -> None:
    r, settle, _ = revisits(scheduler, tmp_path)
    obs = Observation(KEY, sigs=((1, (1, 2, 3)),), problem=None, success_marker=False,
                      newest_mtime_ns=0)
    settle.ready_at(KEY, obs, 100.0)  # first sighting at 100
    assert settle.ready_at(KEY, obs, 200.0) == 130.0  # unchanged since: settled at 130
    r.ask(Revisit(KEY, time.time() + 30, Why.RESETTLE))
    assert settle.ready_at(KEY, obs, 200.0) == 230.0  # seen anew: 30 s from now
    assert pending_at(scheduler) is not None


def test_once_waits_for_settle_waits_but_not_for_retries(tmp_path: Path) -> None:
    r, _, _ = revisits(None, tmp_path, once=True)  # --once has no scheduler
    r.ask(Revisit(KEY, 500.0, Why.RETRY), Revisit(KEY), Revisit(KEY, 300.0, Why.SETTLE))
    assert r.once_rescan_at == 300.0
    r.ask(Revisit(KEY, 400.0, Why.RESETTLE), Revisit(KEY, 350.0, Why.SETTLE))
    assert r.once_rescan_at == 400.0


def test_after_stop_nothing_is_scheduled(scheduler: BackgroundScheduler, tmp_path: Path) -> None:
    r, _, stopping = revisits(scheduler, tmp_path)
    stopping.set()
    r.ask(Revisit(KEY))
    r.look(KEY, delay_s=0.02)
    assert scheduler.get_jobs() == []


def test_a_burst_of_rescans_is_one(scheduler: BackgroundScheduler, tmp_path: Path) -> None:
    r, _, _ = revisits(scheduler, tmp_path)
    for _ in range(5):
        r.scan_soon()
    assert [job.id for job in scheduler.get_jobs()] == ["rescan"]


def test_a_look_that_ran_as_the_scheduler_stopped_is_not_an_error() -> None:
    # shutdown() marks the scheduler stopped without its job stores' lock; its
    # thread, removing a date job it just ran, then looked among the pending
    # jobs and died on JobLookupError ("rescan", a CI run of test_loop).
    from apscheduler.jobstores.base import JobLookupError

    from skilltrain.daemon.service.revisit import Scheduler

    for cls, raises in ((BackgroundScheduler, True), (Scheduler, False)):
        s = cls(timezone=UTC)
        s.start(paused=True)
        s.add_job(lambda: None, "date", id="rescan", run_date=datetime.now(UTC))
        s.shutdown(wait=False)
        if raises:
            with pytest.raises(JobLookupError):
                s.remove_job("rescan")  # what the scheduler's thread does at that moment
        else:
            s.remove_job("rescan")
    running = Scheduler(timezone=UTC)
    running.start(paused=True)
    with pytest.raises(JobLookupError):  # running, it still says so of a job never added
        running.remove_job("rescan")
    running.shutdown(wait=False)
