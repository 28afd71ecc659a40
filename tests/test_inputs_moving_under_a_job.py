"""No bogus training signal from inputs that move under a job.

The daemon is real (watchdog, APScheduler, litellm over HTTP to the loopback
server, a real optimizer subprocess); the writers are real file operations,
timed by the server's responder so they happen while the LLM call is in
flight.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon_helpers import (
    REPO,
    InProcessDaemon,
    SetId,
    Workspace,
    build_workspace,
    mark_success,
    model_episode,
    stays,
    wait_until,
)
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.llm_server import DEFAULT_REPORT, LLMServer, Reply, Request

pytestmark = DAEMON_TEST_MARKS

RECORDER = REPO / "tests" / "optimizer_recorder.py"
S = SetId("r1", 1, 1, "alpha", 1, 3)



def workspace(root: Path, server: LLMServer, settle_s: float = 0.3) -> Workspace:
    record = root / "optimizer.jsonl"
    command = json.dumps([sys.executable, str(RECORDER), str(record), "0", "-", "{run}"])
    return build_workspace(
        root / "ws",
        server.url,
        works={"alpha": 3},
        settle_s=settle_s,
        retry_backoff_s=0.2,
        extra=f"[integrity]\naudit_on_start = false\n[optimizer]\ncommand = {command}\n",
    )


def optimizer_runs(ws: Workspace) -> int:
    record = ws.root.parent / "optimizer.jsonl"
    return len(record.read_text().splitlines()) if record.exists() else 0


def during_the_call(action: Callable[[], None]) -> Callable[[Request], Reply]:
    """A responder that does `action` once, on the first request, before replying."""
    done = threading.Event()

    def respond(request: Request) -> Reply:
        if not done.is_set():
            done.set()
            action()
        return Reply.ok(DEFAULT_REPORT)

    return respond


@pytest.mark.parametrize("change", ["deleted", "rewritten", "replaced"])
def test_an_episode_changed_during_the_call_discards_the_report(
    tmp_path: Path, llm_server: LLMServer, change: str
) -> None:
    ws = workspace(tmp_path, llm_server)
    scripts = ws.scripts("r1", 1, 1, "alpha")
    ws.write_step("r1", 1, 1, success=True)
    ep02 = scripts / "ep02.txt"

    def act() -> None:
        if change == "deleted":
            ep02.unlink()
        elif change == "rewritten":  # in place, same size, old mtime: only the content says
            st = ep02.stat()
            ep02.write_text(ep02.read_text().swapcase(), encoding="utf-8")
            os.utime(ep02, ns=(st.st_atime_ns, st.st_mtime_ns))
        else:
            tmp = scripts / ".ep02.txt.new"
            tmp.write_text(model_episode("r1", 1, 1, "alpha", 2, version=7), encoding="utf-8")
            os.replace(tmp, ep02)

    llm_server.default = during_the_call(act)
    with InProcessDaemon(ws):
        (line,) = wait_until(lambda: ws.events("loss.discarded"), 15, message="loss.discarded")
        assert "changed during the call" in line["reason"] and line["level"] == "warning"
        assert not ws.has_report(S) and not ws.archive(S).exists()
        assert ws.events("step.reported") == [] and optimizer_runs(ws) == 0
        if change == "deleted":
            wait_until(
                lambda: ws.state_file.is_file()
                and ws.state()["sets"].get(S.id, {}).get("state") == "waiting",
                5,
                message="the set waiting for its missing episode",
            )
            assert not ws.has_report(S)
            ep02.write_text(model_episode("r1", 1, 1, "alpha", 2, version=3), encoding="utf-8")
            mark_success(scripts)
        wait_until(lambda: ws.events("step.reported"), 15, message="step.reported")
    sidecar = ws.read_sidecar(S)
    expected = hashlib.sha256(ep02.read_bytes()).hexdigest()
    assert sidecar["model_episodes"]["ep02.txt"] == expected
    assert len(ws.events("step.reported")) == 1 and optimizer_runs(ws) == 1


@pytest.mark.parametrize("restart", [False, True], ids=["running", "after-lost-state"])
def test_a_report_replaced_after_the_step_was_reported_reports_it_again(
    tmp_path: Path, llm_server: LLMServer, restart: bool
) -> None:
    # _SUCCESS touched while the writer was still writing ep03: the first
    # report describes half an episode, and the optimizer learnt from it.
    ws = workspace(tmp_path, llm_server)
    scripts = ws.scripts("r1", 1, 1, "alpha")
    full = model_episode("r1", 1, 1, "alpha", 3)
    ws.write_step("r1", 1, 1)
    (scripts / "ep03.txt").write_text(full[: len(full) // 2], encoding="utf-8")
    mark_success(scripts)
    d = InProcessDaemon(ws).start()
    try:
        wait_until(lambda: optimizer_runs(ws) == 1, 15, message="first optimizer run")
        if restart:  # the writer finishes while the daemon is down and state.json is lost
            d.stop()
            ws.state_file.unlink()
        with open(scripts / "ep03.txt", "a", encoding="utf-8") as f:
            f.write(full[len(full) // 2 :])
        if restart:  # the step's marker beside the reports remembers it was reported
            d = InProcessDaemon(ws).start()
        wait_until(lambda: optimizer_runs(ws) == 2, 15, message="optimizer run again")
        assert stays(lambda: optimizer_runs(ws) == 2, 0.5)
    finally:
        d.stop()
    first, again = ws.events("step.reported")
    assert "again" not in first
    assert again["again"] is True and S.id in again["reason"]
    assert len(ws.events("loss.completed")) == 2
    assert full in llm_server.requests[-1].messages[0]["content"]
    step = ws.state()["steps"]["r1/epoch_01/step_01"]
    assert step["optimizer_done"] and step["generation"] == 1


def test_first_sighting_waits_out_the_settle_window(tmp_path: Path, llm_server: LLMServer) -> None:
    # A slow writer appends to ep03 and keeps its old mtime (rsync --inplace -t):
    # mtimes say "settled long ago" at the first look; only waiting says otherwise.
    ws = workspace(tmp_path, llm_server, settle_s=1.0)
    scripts = ws.scripts("r1", 1, 1, "alpha")
    full = model_episode("r1", 1, 1, "alpha", 3)
    ws.write_step("r1", 1, 1)
    old = time.time() - 3600
    (scripts / "ep03.txt").write_text(full[:100], encoding="utf-8")
    for path in scripts.iterdir():
        os.utime(path, (old, old))

    def append_slowly() -> None:
        for i in range(1, 5):
            time.sleep(0.25)
            with open(scripts / "ep03.txt", "a", encoding="utf-8") as f:
                f.write(full[100 * i : 100 * (i + 1)] if i < 4 else full[100 * i :])
            os.utime(scripts / "ep03.txt", (old, old))

    writer = threading.Thread(target=append_slowly)
    with InProcessDaemon(ws):
        writer.start()
        writer.join()
        written_at = time.monotonic()
        wait_until(lambda: ws.has_report(S), 15, message="report")
    (request,) = llm_server.requests
    assert request.monotonic > written_at
    assert full in request.messages[0]["content"]
