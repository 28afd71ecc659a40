"""Service details: umask, the optimizer's environment, a quiet stop."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import sys
import time
from pathlib import Path

import pytest

from tests.daemon_helpers import (
    InProcessDaemon,
    SetId,
    Workspace,
    build_workspace,
    run_once_in_process,
    wait_until,
)
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.llm_server import LLMServer

pytestmark = DAEMON_TEST_MARKS

NO_AUDIT = "[integrity]\naudit_on_start = false\n"
S = SetId("r1", 1, 1, "alpha", 1, 3)
ENV_DUMP = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"



def workspace(root: Path, url: str, extra: str = "") -> Workspace:
    ws = build_workspace(root, url, works={"alpha": 3}, settle_s=0.2, extra=NO_AUDIT + extra)
    ws.write_step("r1", 1, 1, success=True)
    return ws


@pytest.mark.parametrize("umask", [0o027, 0o002])
def test_reports_follow_the_umask(tmp_path: Path, llm_server: LLMServer, umask: int) -> None:
    ws = workspace(tmp_path, llm_server.url)
    old = os.umask(umask)
    try:
        run_once_in_process(ws)
    finally:
        os.umask(old)
    for path in (ws.report(S), ws.sidecar(S), ws.archive(S), ws.state_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path


def test_the_optimizer_does_not_inherit_the_service_managers_sockets(
    tmp_path: Path, llm_server: LLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    dump = tmp_path / "optimizer-env.json"
    command = json.dumps([sys.executable, "-c", ENV_DUMP, str(dump)])
    ws = workspace(tmp_path / "ws", llm_server.url, f"[optimizer]\ncommand = {command}\n")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(tmp_path / "notify.sock"))
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
        monkeypatch.setenv("WATCHDOG_USEC", "30000000")
        monkeypatch.setenv("SKILLTRAIN_TEST_MARK", "inherited")
        run_once_in_process(ws)
    env = json.loads(dump.read_text())
    assert env["SKILLTRAIN_TEST_MARK"] == "inherited"  # the rest of the environment is kept
    assert not {"NOTIFY_SOCKET", "WATCHDOG_PID", "WATCHDOG_USEC"} & set(env)


def test_the_inotify_stop_race_is_not_an_error_line(tmp_path: Path, llm_server: LLMServer) -> None:
    # watchdog logs this error when its thread reads one last event while being
    # stopped (14 of 80 SIGTERMs); here it is made to happen at that very point.
    ws = workspace(tmp_path, llm_server.url)
    d = InProcessDaemon(ws).start()
    stop = d.daemon.watcher.stop

    def racy_stop() -> None:
        logging.getLogger("watchdog.observers.inotify").error(
            "InotifyEmitter.queue_events() called when the thread is inactive"
        )
        stop()

    d.daemon.watcher.stop = racy_stop
    d.stop()
    assert [e for e in ws.events() if e["level"] == "error"] == []
    assert ws.events("daemon.stopped")


def test_temp_files_a_crash_left_in_loss_are_removed_after_ready_and_live_ones_kept(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    # The loss folders hold a folder per step: their cleanup runs after ready,
    # and must not take a temp file of a write this daemon has in flight.
    from skilltrain.daemon.core.atomic import TEMP_PREFIX

    ws = workspace(tmp_path, llm_server.url)
    reports = ws.report(S).parent
    reports.mkdir(parents=True)
    crashed = reports / f"{TEMP_PREFIX}{ws.report(S).name}.crash1.tmp"
    crashed.write_text("half a rep")
    old = time.time() - 60
    os.utime(crashed, (old, old))
    in_flight = reports / f"{TEMP_PREFIX}other_ep01-03.md.live22.tmp"
    in_flight.write_text("being written")
    later = time.time() + 30  # written after the daemon started
    os.utime(in_flight, (later, later))

    with InProcessDaemon(ws):
        (cleaned,) = wait_until(lambda: ws.events("daemon.cleaned"), 10, message="the cleanup")
        assert cleaned["temp_files"] == 1
        assert not crashed.exists() and in_flight.exists()
        wait_until(lambda: ws.has_report(S), 10, message="the report")
    assert not [p for p in reports.iterdir() if p.name.endswith(".md") and
                p.name.startswith(TEMP_PREFIX)]
