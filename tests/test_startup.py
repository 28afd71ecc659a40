"""Start-up on a tree that takes long to scan: systemd never kills a start
that is making progress, and a start killed while it catches up keeps what
it recorded.

READY=1 comes once the state is loaded and the watcher is up; the scan that
looks at every set runs after it, feeding the watchdog and saying how far it
is (systemd/README.md, "When is it ready"). A scan made slow on purpose
stands in for a tree of 100,000 sets: each look at a set waits, as on a slow
disk (no test can make a real tree that large in seconds).
"""

from __future__ import annotations

import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_helpers import (
    InProcessDaemon,
    SetId,
    Workspace,
    build_workspace,
    run_once_in_process,
    subprocess_env,
    wait_until,
)
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.llm_server import LLMServer
from tests.test_notify import listener, received  # noqa: F401 - the fixture is used by name

pytestmark = DAEMON_TEST_MARKS

SLOW_LOOK_S = 0.05  # each set's look, as on a slow disk
STEPS = 24  # one set each: a scan of at least 1.2 s


def reported_tree(tmp_path: Path, server: LLMServer) -> tuple[Workspace, list[SetId]]:
    """A fully reported tree whose state was lost: the next start scans it cold."""
    ws = build_workspace(tmp_path, server.url, works={"alpha": 3})
    sets = [s for step in range(STEPS) for s in ws.write_step("r1", 0, step, success=True)]
    run_once_in_process(ws)
    assert all(ws.has_report(s) for s in sets)
    ws.state_file.unlink()
    return ws, sets


def test_ready_comes_before_a_long_scan_which_feeds_the_watchdog_and_says_how_far_it_is(
    tmp_path: Path, llm_server: LLMServer, listener: tuple[socket.socket, str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from skilltrain.daemon.service import reconcile

    ws, sets = reported_tree(tmp_path, llm_server)
    requests = llm_server.request_count
    sock, path = listener
    # WatchdogSec=0.4 s: a start that fed nothing for longer would be killed,
    # and the scan below takes three times that.
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "400000")
    monkeypatch.setattr(reconcile, "PROGRESS_EVERY_S", 0.1)
    real_observe = reconcile.observe

    def slow_observe(*args: Any, **kwargs: Any) -> Any:
        time.sleep(SLOW_LOOK_S)
        return real_observe(*args, **kwargs)

    monkeypatch.setattr(reconcile, "observe", slow_observe)
    d = InProcessDaemon(ws)
    # Like systemd: read the socket while the start runs (start() returns caught up).
    notes: list[tuple[float, bytes]] = []
    starting = threading.Thread(target=d.start)
    t0 = time.monotonic()
    starting.start()
    try:
        while starting.is_alive():
            notes += [(time.monotonic() - t0, m) for m in received(sock, 0.02)]
        caught_up_s = time.monotonic() - t0
        notes += [(time.monotonic() - t0, m) for m in received(sock, 0.05)]
        assert d.daemon.metrics.startup_catching_up._value.get() == 0
    finally:
        starting.join(10)
        d.stop()

    ready_s = next(at for at, m in notes if b"READY=1" in m)
    scan_s = caught_up_s - ready_s
    assert scan_s >= STEPS * SLOW_LOOK_S * 0.9
    assert ready_s < scan_s / 3, f"READY after {ready_s:.2f} s of a {scan_s:.2f} s scan"
    during = [(at, m) for at, m in notes if ready_s <= at <= caught_up_s]
    pings = [at for at, m in during if b"WATCHDOG=1" in m]
    # Fed all along: no gap near WatchdogSec between READY, the pings and the end.
    stamps = [ready_s, *pings, caught_up_s]
    assert max(b - a for a, b in zip(stamps, stamps[1:], strict=False)) < 0.4, stamps
    progress = [m.decode() for _, m in during if b"STATUS=catching up" in m]
    assert progress, [m for _, m in notes]
    assert any(f"of {STEPS} sets" in p and f"{STEPS} of {STEPS}" not in p for p in progress)
    # Caught up when start() returns: systemctl status says so at once, not a tick later.
    statuses = [m.decode() for _, m in notes if m.startswith(b"STATUS=")]
    assert "catching up" not in statuses[-1], statuses[-3:]

    ready = ws.events("daemon.ready")[-1]  # the first was the --once run's that made the tree
    (caught_up,) = ws.events("daemon.caught_up")
    assert ready["catching_up"] is True and caught_up["sets"] == STEPS
    assert not ws.events("daemon.unhealthy")
    assert llm_server.request_count == requests  # a reported tree costs nothing
    assert {d.daemon.state.get(s.id).state for s in sets} == {"done"}


SLOW_DAEMON = """
import sys, time
from skilltrain.daemon.commands import cli
from skilltrain.daemon.service import reconcile
real = reconcile.observe
def slow(*args, **kwargs):
    time.sleep(float(sys.argv[1]))
    return real(*args, **kwargs)
reconcile.observe = slow
reconcile.PROGRESS_EVERY_S = 0.1
sys.exit(cli.main(["daemon", "--config", sys.argv[2]]))
"""


def state_rows(ws: Workspace) -> int:
    try:
        with sqlite3.connect(f"file:{ws.state_file}?mode=ro", uri=True) as conn:
            return int(conn.execute("SELECT count(*) FROM sets").fetchone()[0])
    except sqlite3.OperationalError:
        return 0  # created, its tables not yet committed


def test_a_start_killed_while_it_catches_up_keeps_what_it_looked_at(
    tmp_path: Path, llm_server: LLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws, sets = reported_tree(tmp_path, llm_server)
    requests = llm_server.request_count
    slow = subprocess.Popen(
        [sys.executable, "-c", SLOW_DAEMON, str(SLOW_LOOK_S * 4), str(ws.config_path)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env=subprocess_env(), cwd=ws.root)
    try:
        # Killed once part of the tree is recorded, well before the scan's end.
        kept = wait_until(lambda: ws.state_file.exists() and state_rows(ws), 30,
                          message="part of the scan recorded")
        slow.send_signal(signal.SIGKILL)
        assert slow.wait(10) == -signal.SIGKILL
    finally:
        if slow.poll() is None:
            slow.kill()
        assert slow.stderr is not None
        slow.stderr.close()
    assert not ws.events("daemon.caught_up"), "the scan ended before the kill: a weak test"
    recorded = state_rows(ws)
    assert 0 < kept <= recorded < STEPS

    # The next start begins from what was recorded: those sets are up to date
    # by their recorded fingerprint; only the others read their sidecar.
    from skilltrain.handlers import loss

    read: list[Path] = []
    real_read = loss.read_sidecar

    def counted(report: Path) -> Any:
        read.append(report)
        return real_read(report)

    monkeypatch.setattr(loss, "read_sidecar", counted)
    with InProcessDaemon(ws) as d:
        assert {d.daemon.state.get(s.id).state for s in sets} == {"done"}
    assert len(read) == STEPS - recorded
    assert llm_server.request_count == requests


def test_sidecars_of_an_older_daemon_are_checked_by_hashing_the_episodes(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    # Sidecars written before they kept the episodes' stat signature: a start
    # with no state must hash the files, find them unchanged, and ask nothing;
    # an episode changed since is redone.
    import json

    ws, sets = reported_tree(tmp_path, llm_server)
    for s in sets:
        sidecar = json.loads(ws.sidecar(s).read_text(encoding="utf-8"))
        del sidecar["model_stat_sigs"]
        ws.sidecar(s).write_text(json.dumps(sidecar), encoding="utf-8")
    changed = sets[0]
    episode = ws.scripts(changed.run, changed.epoch, changed.step, changed.work) / "ep02.txt"
    episode.write_text(episode.read_text(encoding="utf-8") + "\nA new line.\n", encoding="utf-8")
    requests = llm_server.request_count
    run_once_in_process(ws)
    assert requests_for(llm_server, requests) == [changed.id]


def requests_for(server: LLMServer, after: int) -> list[str]:
    from tests.daemon_helpers import set_of_request

    found = [set_of_request(r) for r in server.requests[after:]]
    return [SetId(*f).id for f in found if f is not None]
