"""The daemon's own health and concurrency: what systemd's watchdog sees, one
scan at a time, evaluations that do not wait on each other, and failures
that are said instead of swallowed.

Real daemon, real systemd-style notify socket, real watcher and scheduler.
One test stands in for slow storage (an NFS server that stops answering)
by making the look at one set block: nothing else can make a stat hang on
demand without root.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.core import layout
from tests.daemon_helpers import (
    InProcessDaemon,
    Workspace,
    build_workspace,
    stays,
    wait_until,
)
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.llm_server import LLMServer
from tests.test_notify import listener, received  # noqa: F401 - the fixture is used by name

pytestmark = DAEMON_TEST_MARKS

Start = Callable[..., InProcessDaemon]


# ------------------------------------------------------------- systemd watchdog


def test_a_daemon_that_stops_feeding_the_watchdog_says_why_first(
    tmp_path: Path, llm_server: LLMServer, start: Start,
    listener: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    sock, path = listener
    # What systemd sets for a unit with WatchdogSec=0.2s: a ping every 0.1 s.
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3})
    d = start(ws)
    assert b"WATCHDOG=1" in wait_until(lambda: received(sock, 0.3), 5, message="a ping")
    assert d.daemon.healthy() and not ws.events("daemon.unhealthy")

    d.daemon.scheduler.shutdown(wait=False)  # APScheduler's thread is gone
    assert not d.daemon.healthy()
    (said,) = wait_until(lambda: ws.events("daemon.unhealthy"), 2, message="daemon.unhealthy")
    assert said["level"] == "error"
    assert said["reasons"] == ["the scheduler is not running"]
    time.sleep(0.15)  # a ping decided before the break may still be on its way
    received(sock)
    assert b"WATCHDOG=1" not in received(sock, 0.5)  # systemd will restart it, and the log says why


def test_an_llm_event_loop_that_stops_running_makes_the_daemon_unhealthy(
    tmp_path: Path, llm_server: LLMServer, start: Start,
    listener: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """Every call runs on the one LLM loop: a callback that blocks it (a
    synchronous library call by mistake) stops every job while the rest of
    the daemon looks fine. The health tick's probe sees it; the lag is a metric."""
    from skilltrain.daemon.service import lifecycle

    sock, path = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    monkeypatch.setattr(lifecycle, "LLM_LOOP_STALL_S", 1.5)
    d = start(build_workspace(tmp_path, llm_server.url, works={"alpha": 3}))
    llm, ws = d.daemon.jobs.llm, d.ws
    lag = lambda: d.daemon.metrics.registry.get_sample_value(  # noqa: E731
        "skilltrain_llm_loop_lag_seconds")
    llm.run(asyncio.sleep(0))  # the loop runs (it starts on first use)
    wait_until(lambda: llm.unanswered_s() == 0 and lag() is not None and lag() < 1, 5,
               message="a probe answered")
    assert d.daemon.healthy()

    release = threading.Event()
    llm.call_soon(release.wait, 10)  # blocks the loop's thread
    try:
        (said,) = wait_until(lambda: ws.events("daemon.unhealthy"), 6, message="unhealthy")
        assert any("LLM event loop has not run" in r for r in said["reasons"]), said
        assert lag() >= 1.5
        received(sock)
        assert b"WATCHDOG=1" not in received(sock, 0.5)  # systemd restarts it
    finally:
        release.set()
    wait_until(d.daemon.healthy, 5, message="healthy again once the loop runs")
    assert llm.lag_s >= 1.5  # the late answer is the lag it had


# -------------------------------------------------------------------- scans


def scan_spans(ws: Workspace) -> list[tuple[datetime, datetime]]:
    spans = []
    for e in ws.events("scan.completed"):
        end = datetime.fromisoformat(e["timestamp"])
        spans.append((end - timedelta(milliseconds=e["duration_ms"]), end))
    return sorted(spans)


def test_only_one_full_scan_runs_at_a_time_and_none_is_lost(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 6, "beta": 6})
    for step in range(1, 41):
        for work in ("alpha", "beta"):
            ws.scripts("r1", 1, step, work).mkdir(parents=True)  # 160 waiting sets
    d = start(ws, loop=False)
    before = len(ws.events("scan.completed"))
    gate = threading.Barrier(3)

    def scan() -> None:
        gate.wait()
        d.daemon.reconcile.scan()

    threads = [threading.Thread(target=scan) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    spans = scan_spans(ws)[before:]
    # The resync and a rescan falling due together: one after the other, and
    # the ones asked for meanwhile make the running one go round again.
    assert 2 <= len(spans) <= 3, spans
    slack = timedelta(milliseconds=2)  # duration_ms is whole milliseconds
    for (_, end), (begin, _) in zip(spans, spans[1:], strict=False):
        assert begin >= end - slack, f"two scans overlapped: {spans}"


# --------------------------------------------------------------- evaluations


def test_a_set_whose_storage_hangs_does_not_hold_up_the_others(
    tmp_path: Path, llm_server: LLMServer, start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skilltrain.daemon.service import reconcile

    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 6})
    slow, other = ws.sets_of_step("r1", 1, 1)
    d = start(ws, loop=False)
    keys = {s.id: layout.SetKey(s.run, s.epoch, s.step, s.work, s.first, s.last)
            for s in (slow, other)}
    hung, release = threading.Event(), threading.Event()
    looks: list[str] = []
    real_observe = reconcile.observe

    def observe(key: layout.SetKey, runs: Path, data: Path | None = None) -> Any:
        looks.append(key.id)
        if key.id == slow.id and not release.is_set():
            hung.set()
            release.wait(10)  # the NFS server stopped answering
        return real_observe(key, runs, data)

    monkeypatch.setattr(reconcile, "observe", observe)
    stuck = threading.Thread(target=d.daemon.reconcile.look, args=[keys[slow.id]])
    stuck.start()
    try:
        assert hung.wait(5)
        for key in (keys[other.id], keys[slow.id]):
            t = threading.Thread(target=d.daemon.reconcile.look, args=[key])
            t.start()
            t.join(2)
            assert not t.is_alive(), f"evaluate({key.id}) waited for the hung set"
        assert d.daemon.state.get(other.id) is not None  # looked at and recorded
        assert looks.count(slow.id) == 1  # the second look is coalesced, not run beside
    finally:
        release.set()
        stuck.join(10)
    wait_until(lambda: looks.count(slow.id) == 2, 5, message="the coalesced look, afterwards")


def test_a_later_look_never_postpones_an_earlier_pending_one(
    tmp_path: Path, llm_server: LLMServer, start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An evaluation that ends in a settle wait (look again in 30 s) races the
    `_SUCCESS` event that asked for a look now: the earlier look must stay."""
    from skilltrain.daemon.service import reconcile
    from skilltrain.daemon.service.revisit import Revisit, Why

    monkeypatch.setattr(reconcile, "HINT_DEBOUNCE_S", 3.0)  # room to race it by hand
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, settle_s=30.0)
    (s,) = ws.sets_of_step("r1", 1, 1)
    key = layout.SetKey(s.run, s.epoch, s.step, s.work, s.first, s.last)
    d = start(ws, loop=False)
    scripts = ws.scripts("r1", 1, 1, "alpha")
    ws.write_step("r1", 1, 1)  # complete, no _SUCCESS: settling for 30 s
    wait_until(lambda: (r := d.daemon.state.get(s.id)) and r.state == "settling", 10,
               message="the set settling")
    # The scan that found it has ended: its step folder is watched (scoped watches
    # are set at a scan's end), so the _SUCCESS below is seen.
    wait_until(lambda: ws.events("scan.completed", sets=1), 10, message="that scan's end")

    def pending_in(seconds: float) -> bool:
        job = d.daemon.scheduler.get_job(key.id)
        return job is not None and job.next_run_time.timestamp() < time.time() + seconds

    (scripts / "_SUCCESS").write_bytes(b"")
    wait_until(lambda: pending_in(4.0), 5, message="the look _SUCCESS asked for")
    d.daemon.revisits.ask(Revisit(key, time.time() + 30, Why.SETTLE))  # the racing settle wait
    assert pending_in(4.0)
    wait_until(lambda: ws.has_report(s), 10, message="the report, long before 30 s")


# ------------------------------------------------------------------ optimizer


def test_an_optimizer_command_these_values_cannot_fill_fails_and_is_retried(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    # "{epoch[4]}" passes the start-up check (the name "epoch" has a 5th
    # letter) but not a real step's "01".
    ws = build_workspace(
        tmp_path, llm_server.url, works={"alpha": 3}, resync_s=1.0, retry_backoff_s=0.1,
        extra='\n[optimizer]\ncommand = ["/bin/true", "{epoch[4]}"]\nmax_attempts = 2\n',
    )
    ws.write_step("r1", 1, 1, success=True)
    d = start(ws)
    failed = wait_until(lambda: len(ws.events("optimizer.failed")) == 2 and
                        ws.events("optimizer.failed"), 10, message="two failed attempts")
    assert all("bad placeholder" in e["reason"] for e in failed)
    assert [e["attempt"] for e in failed] == [1, 2]
    assert [e["will_retry"] for e in failed] == [True, False]
    assert not ws.events("optimizer.started")
    assert stays(lambda: len(ws.events("optimizer.failed")) == 2, 1.5)  # max_attempts
    assert d.daemon.healthy()


def test_a_run_toml_listing_odd_things_is_ignored_not_a_crash(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3})
    (s,) = ws.write_step("r1", 1, 1, success=True)
    (ws.runs / "r1" / "run.toml").write_text('works = [["alpha"], {name = "alpha"}, 3]\n')
    d = start(ws)
    wait_until(lambda: ws.has_report(s), 20, message="the report (all works, as without run.toml)")
    (ignored,) = [e for e in ws.events("set.ignored") if e["path"].endswith("run.toml")]
    assert "work names" in ignored["reason"]
    assert d.daemon.healthy()


def test_an_exception_escaping_an_optimizer_run_is_logged_in_forever_mode(
    tmp_path: Path, llm_server: LLMServer, start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A NUL in an argument: Popen raises ValueError, which optimizer.run does not
    # expect. Nobody waits on the future in forever mode; the log must say it.
    # (The start-up check refuses such a command; it is let through here, as
    # the one real way found to make the run itself raise.)
    from skilltrain.handlers import optimizer

    monkeypatch.setattr(optimizer, "check_command", lambda *args, **kwargs: None)
    ws = build_workspace(
        tmp_path, llm_server.url, works={"alpha": 3},
        extra='\n[optimizer]\ncommand = ["/bin/true", "a\\u0000b"]\nmax_attempts = 1\n',
    )
    ws.write_step("r1", 1, 1, success=True)
    start(ws)
    (crash,) = wait_until(lambda: ws.events("daemon.task_failed"), 10, message="the crash")
    assert crash["level"] == "error" and crash["error"] == "ValueError"
    assert "embedded null byte" in json.dumps(crash["exception"])
