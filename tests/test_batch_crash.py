"""Batch mode, SIGKILL at each point of a batch's life: never paid twice, never lost.

The real `skilltrain daemon` as a child process against the loopback batch
API. The server holds its reply at a point (after the upload, after the
create: the batch exists, the daemon has not heard its id), or the batch
is open, or completed and not yet handled, or its results half written;
the daemon is killed there with SIGKILL, started again, and must end with
one report per set, each request paid once, one batch created where one
was created, and the step reported once.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.batch_server import BatchPlan, BatchServer
from tests.daemon_helpers import DaemonProcess, Workspace, build_workspace, stays, wait_until

pytestmark = [pytest.mark.slow]

FAST = {"batch_gather_s": 0.3, "batch_poll_s": 0.2, "batch_poll_max_s": 0.5}
START_TIMEOUT_S = 90.0  # the child imports litellm first


@pytest.fixture
def server() -> Iterator[BatchServer]:
    with BatchServer() as s:
        yield s


def workspace(tmp_path: Path, server: BatchServer, **llm: object) -> Workspace:
    keys = {**FAST, "mode": "batch", **llm}
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
    ws = build_workspace(tmp_path, server.url, works={"alpha": 6, "beta": 3}, settle_s=0.2,
                         retry_backoff_s=0.2, concurrency=1)
    text = ws.config_path.read_text(encoding="utf-8")
    text = text.replace('model = "openai/loopback-model"\n',
                        'model = "openai/gpt-4o-mini"\n' + extra)
    ws.config_path.write_text(text, encoding="utf-8")
    ws.write_step("r1", 0, 0, success=True)
    return ws


def finish_and_check(ws: Workspace, server: BatchServer, *, creates: int) -> None:
    """Start again, let it finish: one report per set, each paid once."""
    # A kill between the step's marker (durable: the step is reported) and its
    # step.reported line loses the line (the log is at most once; the marker
    # decides): then the restart must not say it either.
    marker = ws.runs / "r1" / "loss" / ".steps" / "epoch_00-step_00.json"
    lost_in_the_kill = marker.exists() and not ws.events("step.reported")
    with DaemonProcess(ws, prewarmed=True, name="after") as d:
        wait_until(lambda: all(ws.has_report(s) for s in ws.sets_of_step("r1", 0, 0)),
                   START_TIMEOUT_S, message=lambda: f"reports; {d.stderr()[-800:]}")
        wait_until(lambda: not list(ws.runs.glob("r1/loss/.batches/*.json")), 20,
                   message="the batch record closed")
        # The step is reported a moment after its last report: wait for it, then
        # check that it stays once.
        if lost_in_the_kill:
            assert stays(lambda: not ws.events("step.reported"), 1.0)
        else:
            d.wait_event("step.reported", 20)
            assert stays(lambda: len(ws.events("step.reported")) == 1, 0.3)
        assert marker.exists()
    sets = ws.sets_of_step("r1", 0, 0)
    assert server.creates == creates
    assert len(server.billed) == len(sets), server.billed  # every request paid once
    assert len(ws.events("step.reported")) == (0 if lost_in_the_kill else 1)
    ids = {ws.read_sidecar(s)["batch_id"] for s in sets}
    assert ids <= {b.id for b in server.batch_list()}
    assert not ws.temp_files()


def test_killed_after_the_upload_before_the_batch_exists(
        tmp_path: Path, server: BatchServer) -> None:
    ws = workspace(tmp_path, server)
    hold = threading.Event()
    server.plan = BatchPlan(hold_after_upload=hold)
    with DaemonProcess(ws, prewarmed=True) as d:
        wait_until(lambda: server.uploads == 1, START_TIMEOUT_S, message="the upload")
        d.kill()
    hold.set()
    server.plan = BatchPlan()
    assert server.creates == 0
    finish_and_check(ws, server, creates=1)


def test_killed_after_the_create_before_its_id_was_recorded(
        tmp_path: Path, server: BatchServer) -> None:
    ws = workspace(tmp_path, server)
    hold = threading.Event()
    server.plan = BatchPlan(hold_after_create=hold)
    with DaemonProcess(ws, prewarmed=True) as d:
        wait_until(lambda: server.creates == 1, START_TIMEOUT_S, message="the create")
        time.sleep(0.1)
        d.kill()
    hold.set()
    records = list(ws.runs.glob("r1/loss/.batches/*.json"))
    assert len(records) == 1
    assert json.loads(records[0].read_text())["state"] == "submitting"
    finish_and_check(ws, server, creates=1)  # found again by its key, not sent again
    assert ws.events("batch.submitted", recovered=True)


def test_killed_while_the_batch_is_open(tmp_path: Path, server: BatchServer) -> None:
    ws = workspace(tmp_path, server)
    server.plan = BatchPlan(latency_s=4.0)
    with DaemonProcess(ws, prewarmed=True) as d:
        d.wait_event("batch.submitted", START_TIMEOUT_S)
        d.kill()
    finish_and_check(ws, server, creates=1)


def test_killed_after_the_batch_completed_before_its_results_were_handled(
        tmp_path: Path, server: BatchServer) -> None:
    ws = workspace(tmp_path, server, batch_poll_s=30.0, batch_poll_max_s=30.0)
    server.plan = BatchPlan(latency_s=0.1)
    with DaemonProcess(ws, prewarmed=True) as d:
        d.wait_event("batch.submitted", START_TIMEOUT_S)
        wait_until(lambda: server.billed or server.retrieve(server.batch_list()[0].id),
                   10, message="completed on the server")
        d.kill()
    assert not any(ws.has_report(s) for s in ws.sets_of_step("r1", 0, 0))
    finish_and_check(ws, server, creates=1)


def test_killed_while_its_results_are_being_written(
        tmp_path: Path, server: BatchServer) -> None:
    ws = workspace(tmp_path, server)
    server.plan = BatchPlan(latency_s=0.5)
    with DaemonProcess(ws, prewarmed=True) as d:
        d.wait_event("loss.completed", START_TIMEOUT_S)
        d.kill()
    finish_and_check(ws, server, creates=1)
