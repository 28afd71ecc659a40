"""`[daemon] cpu`: the daemon's threads on one CPU, its children on all of them.

The real process (`skilltrain daemon --once`), as systemd starts it. Its
optimizer, a child, records what Linux says of itself and of every thread of
the daemon while the daemon waits for it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from daemon.infra import cpu as cpu_module
from tests.daemon_helpers import Workspace, build_workspace, read_events, run_cli
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.llm_server import LLMServer

pytestmark = [
    *DAEMON_TEST_MARKS,
    pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                       reason="pinning needs two CPUs to choose from"),
]

NO_AUDIT = "[integrity]\naudit_on_start = false\n"
# A CPU named by number: the last this process may use (not "1": a cpuset may be 4-7).
LAST = str(max(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else "0"
# The optimizer's record: its own CPUs, and each thread of its parent (the daemon).
RECORD = r"""
import json, os, sys
def cpus(status):
    try:
        line = next(l for l in open(status) if l.startswith("Cpus_allowed_list:"))
    except FileNotFoundError:  # a thread that ended since the listing
        return None
    return line.split(":", 1)[1].strip()
parent = os.getppid()
threads = {t: cpus(f"/proc/{parent}/task/{t}/status") for t in os.listdir(f"/proc/{parent}/task")}
threads = {t: c for t, c in threads.items() if c is not None}
json.dump({"self": cpus("/proc/self/status"), "daemon_threads": threads}, open(sys.argv[1], "w"))
"""


def _cpus_list(cpus: set[int]) -> str:
    """/proc's Cpus_allowed_list for a set: "0-1", "3", "0,2"."""
    ordered, parts, start = sorted(cpus), [], None
    for i, c in enumerate(ordered):
        start = c if start is None else start
        if i + 1 == len(ordered) or ordered[i + 1] != c + 1:
            parts.append(f"{start}" if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)


def _run(tmp_path: Path, url: str, cpu: str) -> tuple[Workspace, Any, dict[str, Any]]:
    record, script = tmp_path / "record.json", tmp_path / "record_cpus.py"
    script.write_text(RECORD, encoding="utf-8")  # a file: {braces} are placeholders in a command
    command = json.dumps([sys.executable, str(script), str(record)])
    ws = build_workspace(tmp_path / "ws", url, works={"alpha": 3}, settle_s=0,
                         extra=f"{NO_AUDIT}[optimizer]\ncommand = {command}\n")
    text = ws.config_path.read_text(encoding="utf-8")
    ws.config_path.write_text(text.replace("[daemon]\n", f"[daemon]\ncpu = {cpu}\n"),
                              encoding="utf-8")
    ws.write_step("r1", 1, 1, success=True)
    result, _ = run_cli("daemon", "--config", str(ws.config_path), "--once", timeout=120)
    got = json.loads(record.read_text()) if record.exists() else {}
    return ws, result, got


@pytest.mark.parametrize("cpu", ['"one"', LAST])
def test_the_daemons_threads_share_one_cpu_and_its_optimizer_has_them_all(
    tmp_path: Path, llm_server: LLMServer, cpu: str
) -> None:
    ws, result, got = _run(tmp_path, llm_server.url, cpu)
    assert result.returncode == 0, result.stderr
    started = read_events(ws.log_file, "daemon.started")[0]
    pinned = started["cpu"]
    assert isinstance(pinned, int) and pinned in os.sched_getaffinity(0)
    if cpu == LAST:
        assert pinned == int(LAST)
    # Every thread, the LLM loop and the job pool among them (the daemon has
    # made its calls and reports before the optimizer runs).
    assert len(got["daemon_threads"]) >= 4, got
    assert set(got["daemon_threads"].values()) == {str(pinned)}, got
    assert got["self"] == _cpus_list(os.sched_getaffinity(0))


def test_cpu_any_leaves_the_threads_to_the_kernel(tmp_path: Path, llm_server: LLMServer) -> None:
    ws, result, got = _run(tmp_path, llm_server.url, '"any"')
    assert result.returncode == 0, result.stderr
    assert read_events(ws.log_file, "daemon.started")[0]["cpu"] is None
    every = _cpus_list(os.sched_getaffinity(0))
    assert set(got["daemon_threads"].values()) == {every}, got
    assert got["self"] == every


def test_a_cpu_the_process_may_not_use_is_a_config_error(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    missing = max(os.sched_getaffinity(0)) + 1
    ws, result, got = _run(tmp_path, llm_server.url, str(missing))
    assert result.returncode == 2
    assert f"[daemon] cpu = {missing}: not a CPU this process may run on" in result.stderr
    assert not got  # stopped before any job or step
    assert not read_events(ws.log_file, "daemon.started")
    assert "[daemon] cpu" in read_events(ws.log_file, "daemon.failed")[0]["reason"]


def test_the_cpu_it_starts_on_is_read_from_proc() -> None:
    # A thread of its own pinned to each CPU in turn: "one" must name where the
    # process runs (a wrong /proc field would still name some allowed CPU).
    allowed = os.sched_getaffinity(0)
    seen: dict[int, int] = {}

    def on(cpu: int) -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only
        sum(range(200_000))  # run there a moment
        seen[cpu] = cpu_module._running_on(allowed)

    for cpu in sorted(allowed)[:4]:
        thread = threading.Thread(target=on, args=(cpu,))
        thread.start()
        thread.join()
    assert seen == {cpu: cpu for cpu in seen}


def test_a_mask_the_kernel_refuses_does_not_stop_a_spawn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A cpuset changed since the start: the child starts on the daemon's CPU
    # rather than not at all, and the thread's own mask stays.
    monkeypatch.setattr(cpu_module, "_whole", {4096})
    before = os.sched_getaffinity(0)
    with cpu_module.unpinned():
        ran = True
    assert ran and os.sched_getaffinity(0) == before
