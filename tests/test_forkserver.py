"""The fork server the restart tests start their daemons with (tests/forkserver.py):
a daemon forked from it reports, exits and dies as an exec'd one does."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.daemon_helpers import (
    SKILLTRAIN,
    DaemonProcess,
    build_workspace,
    subprocess_env,
    wait_until,
)
from tests.forkserver import ForkServer
from tests.llm_server import LLMServer


def spawn(tmp_path: Path, *args: str) -> tuple[int | None, str, str]:
    out, err = tmp_path / "out", tmp_path / "err"
    with open(os.devnull, "rb") as devnull, open(out, "wb") as o, open(err, "wb") as e:
        proc = ForkServer.start(subprocess_env()).spawn(
            [str(SKILLTRAIN), *args], env=subprocess_env(), cwd=tmp_path,
            stdin=devnull.fileno(), stdout=o.fileno(), stderr=e.fileno())
    code = proc.wait(60)
    return code, out.read_text(), err.read_text()


def test_a_forked_command_gets_its_argv_stdio_and_exit_code(tmp_path: Path) -> None:
    code, out, _ = spawn(tmp_path, "--help")
    assert code == 0 and "daemon" in out
    code, _, err = spawn(tmp_path, "status", "--config", str(tmp_path / "missing.toml"))
    assert code not in (0, None) and "missing.toml" in err


def test_a_forked_command_gets_its_environment_and_folder(
        tmp_path: Path, llm_server: LLMServer) -> None:
    # A relative --config is found in the child's folder, and a variable set
    # for this child alone is what it reads (an [llm] override, not the server's).
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3})
    env = {**subprocess_env(), "SKILLTRAIN_LLM_MODEL": "openai/set-for-this-child"}
    with open(os.devnull, "rb") as devnull:
        proc = ForkServer.start(subprocess_env()).spawn(
            [str(SKILLTRAIN), "daemon", "--config", ws.config_path.name], env=env,
            cwd=ws.config_path.parent, stdin=devnull.fileno(), stdout=devnull.fileno(),
            stderr=devnull.fileno())
    try:
        started = wait_until(lambda: ws.events("daemon.started"), 60, message="daemon.started")
    finally:
        proc.kill()
        proc.wait(10)
    assert started[-1]["model"] == "openai/set-for-this-child"
    assert started[-1]["config"] == str(ws.config_path)


def test_a_forked_daemon_is_killed_and_reaped_like_a_child(
        tmp_path: Path, llm_server: LLMServer) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3})
    daemon = DaemonProcess(ws, prewarmed=True)
    daemon.wait_event("daemon.ready", 60)
    assert daemon.alive()
    daemon.signal(signal.SIGKILL)
    assert daemon.wait(10) == -signal.SIGKILL
    assert not daemon.alive()
    with pytest.raises(ProcessLookupError):
        os.kill(daemon.pid, 0)  # reaped by the server: no zombie left behind


def test_a_wait_that_times_out_says_so(tmp_path: Path, llm_server: LLMServer) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3})
    with DaemonProcess(ws, prewarmed=True) as daemon:
        with pytest.raises(subprocess.TimeoutExpired):
            daemon.wait(0.1)
