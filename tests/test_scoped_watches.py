"""The native watcher watches only where a set can still appear or change.

runs/, run and epoch folders one level each, open steps whole. A reported
step is not watched: a change there is found by the periodic resync. The
real daemon, the real watchdog observer and the loopback server.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

from tests.daemon_helpers import (
    InProcessDaemon,
    Workspace,
    build_workspace,
    model_episode,
    wait_until,
)
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.llm_server import LLMServer

pytestmark = DAEMON_TEST_MARKS

NO_AUDIT = "[integrity]\naudit_on_start = false\n"


def reported_workspace(tmp_path: Path, url: str, resync_s: float) -> Workspace:
    ws = build_workspace(tmp_path, url, works={"a": 2}, per_report=2, settle_s=0.2,
                         resync_s=resync_s, observer="native", extra=NO_AUDIT)
    for step in (1, 2):
        ws.write_step("r0", 1, step, success=True)
    return ws


def watched(d: InProcessDaemon) -> set[tuple[Path, bool]]:
    return set(d.daemon.watcher._scheduled)


def test_only_open_places_are_watched_and_a_new_run_and_step_are_picked_up(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    ws = reported_workspace(tmp_path, llm_server.url, resync_s=600)
    old = [s for step in (1, 2) for s in ws.sets_of_step("r0", 1, step)]
    with InProcessDaemon(ws) as d:
        wait_until(lambda: all(ws.has_report(s) for s in old), 20, message="the first reports")
        step1 = (ws.step_dir("r0", 1, 1), True)
        # A scan (as the resync would) once the sets are done: the watches follow.
        wait_until(lambda: d.daemon.reconcile.scan() or step1 not in watched(d), 10,
                   message="the reported step's watch to go")
        scoped = watched(d)
        assert (ws.runs / "r0" / "epoch_01", False) in scoped  # new steps appear here
        assert (ws.runs / "r0" / "loss", False) not in scoped  # the daemon's own writes
        # A new step in the old run, with no scan to find it: the epoch's watch
        # sees the folder, the step's own watch the files.
        scans = len(ws.events("scan.completed"))
        step3 = ws.write_step("r0", 1, 3, success=True)
        wait_until(lambda: all(ws.has_report(s) for s in step3), 20, message="step 3's report")
        assert len(ws.events("scan.completed")) == scans
        # A whole new run: runs/ sees it (and asks for a rescan, as it always did).
        new_run = ws.write_step("r1", 1, 1, success=True)
        wait_until(lambda: all(ws.has_report(s) for s in new_run), 20, message="r1's report")
        assert d.daemon.watcher.kind == "native"


def test_a_changed_episode_in_a_reported_step_is_found_by_the_resync(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    """Unwatched means no event: the change waits, untouched, for the resync.
    The resync is set far out and fired by hand, so nothing else can find it."""
    ws = reported_workspace(tmp_path, llm_server.url, resync_s=600)
    (first,) = ws.sets_of_step("r0", 1, 1)
    with InProcessDaemon(ws) as d:
        scheduler = d.daemon.scheduler
        wait_until(lambda: ws.has_report(first), 20, message="the first report")
        step1 = (ws.step_dir("r0", 1, 1), True)

        def quiet_scan() -> bool:
            """A whole scan run here, with the start's follow-up scan gone by: when
            it returns, no scan runs (one asked for meanwhile is folded into it,
            and its progress is called only by the scan that runs), and none is
            due but the resync."""
            if scheduler.get_job("rescan") is not None:
                return False
            ran: list[int] = []
            d.daemon.reconcile.scan(progress=lambda seen, total: ran.append(total))
            return bool(ran) and scheduler.get_job("rescan") is None \
                and step1 not in watched(d)

        # A scan (as the resync would) once the set is done: the watches follow.
        wait_until(quiet_scan, 10, message="the reported step's watch to go, no scan running")
        scans = len(ws.events("scan.completed"))
        (ws.scripts("r0", 1, 1, "a") / "ep01.txt").write_text(
            model_episode("r0", 1, 1, "a", 1, version=1), encoding="utf-8")
        # A watch would have the set looked at within the settle window (0.2 s).
        time.sleep(1.5)
        assert ws.events("set.stale") == [], "the reported step is still watched"
        assert len(ws.events("scan.completed")) == scans
        t0 = time.monotonic()
        scheduler.get_job("resync").modify(next_run_time=datetime.now(UTC))
        wait_until(lambda: len(ws.events("loss.completed", run="r0", step=1)) == 2, 20,
                   message="the report made again")
        (stale,) = ws.events("set.stale")
        assert stale["work"] == "a" and stale["step"] == 1
        assert len(ws.events("scan.completed")) > scans
        print(f"re-reported {time.monotonic() - t0:.1f} s after the resync fired")
