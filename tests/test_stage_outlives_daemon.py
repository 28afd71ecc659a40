"""Stage commands whose job outlives the daemon (`outlives_daemon = true`,
handlers/detached.py, docs/scale-out.md).

The writer and the optimizer of a looped run are submitted through a
stand-in for `sbatch --wait` (tests/fake_sbatch.py): the job runs detached,
in a session of its own, inside the user's batch script (tests/stage_job.sh,
which writes its exit status to $SKILLTRAIN_STAGE_DONE). The real daemon
command is SIGKILLed while one stage's job runs, and its waiting client is
killed too, as systemd kills what is left in the unit's cgroup; the job
lives on. The restarted daemon must wait for that job, not submit the stage
again: submissions are counted in the stand-in's own log, and each stage's
runs in the toy commands' journal.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.core import layout
from skilltrain.daemon.service.curve import read_step_marker
from skilltrain.handlers import detached
from tests.daemon_helpers import REPO, DaemonProcess, Workspace, build_workspace, wait_until
from tests.llm_server import LLMServer
from tests.test_events import catalogue_problems
from tests.test_loop import RUN, journal, start_run, toml_list

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

FAKE_SBATCH = REPO / "tests" / "fake_sbatch.py"
STAGE_JOB = REPO / "tests" / "stage_job.sh"
TOY = REPO / "examples"
# A daemon child imports litellm (~6 s, more on a busy machine) before its first loss job.
STAGE_TIMEOUT_S = 60.0
# A stop waits this long for work in flight; a client whose job goes on is not waited for.
SHUTDOWN_S = 30.0


def cluster_workspace(root: Path, llm_url: str) -> Workspace:
    """One step (1 epoch x 1 step), writer and optimizer both submitted through fake sbatch."""
    j = str(root / "journal.jsonl")

    def submitted(stage: str, *command: str) -> list[str]:
        return [sys.executable, str(FAKE_SBATCH), "--log", str(root / "sbatch.log"), "--wait",
                str(STAGE_JOB), sys.executable, *command, "--journal", j,
                "--hold-while", str(root / f"{stage}-holds")]

    writer = submitted("writer", str(TOY / "toy_writer.py"), "{run_dir}", "{epoch}", "{step}",
                       "--work", "alpha:2", "--steps-per-epoch", "1",
                       "--prev-reports", "{prev_reports_dir}")
    optimizer = submitted("optimizer", str(TOY / "toy_optimizer.py"), "{run_dir}",
                          "{reports_dir}", "{epoch}", "{step}")
    extra = f"""
[optimizer]
command = {toml_list(optimizer)}
timeout_s = 60
outlives_daemon = true
# One attempt: the job a killed daemon submitted is that attempt, still running,
# not a reason to stall the run.
max_attempts = 1

[writer]
command = {toml_list(writer)}
timeout_s = 60
outlives_daemon = true

[loop]
steps_per_epoch = 1
max_epochs = 1
"""
    return build_workspace(root, llm_url, works={"alpha": 2}, per_report=2, extra=extra,
                           shutdown_timeout_s=SHUTDOWN_S)


def submissions(ws: Workspace) -> list[dict[str, Any]]:
    path = ws.root / "sbatch.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def of_stage(subs: list[dict[str, Any]], stage: str) -> list[dict[str, Any]]:
    script = f"toy_{stage}.py"
    return [s for s in subs if any(arg.endswith(script) for arg in s["argv"])]


def alive(pid: int, program: str) -> bool:
    """Is `pid` still running `program`? (Its pid may be another process's by
    now: see kill_if_client.)"""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if program.encode() not in f.read():
                return False
        # A job reparented to a PID 1 that does not reap stays a zombie: ended all the same.
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def kill_if_client(pid: int) -> None:
    """SIGKILL `pid` if it is still the fake sbatch client. After a SIGTERM the
    daemon has ended and reaped it, and its pid may be anyone's by now (a
    thread of a pytest worker: pid_max is 32768 here and the suite makes tens
    of thousands of threads; one such kill took a worker down in CI). A pidfd
    holds the process the name was read from, so the check and the kill are
    of one process."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"fake_sbatch.py" in f.read():
                signal.pidfd_send_signal(fd, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):
        pass  # it ended between the two looks
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("stage", ["writer", "optimizer"])
def test_a_restarted_daemon_waits_for_the_job_the_one_before_submitted(
    tmp_path: Path, llm_server: LLMServer, stage: str, how: str
) -> None:
    ws = cluster_workspace(tmp_path, llm_server.url)
    hold = tmp_path / f"{stage}-holds"
    hold.touch()
    with DaemonProcess(ws, prewarmed=True, name="first") as first:
        start_run(ws)
        # The job has started on the "cluster": the toy command's own start line.
        wait_until(lambda: journal(ws, stage, "start"), STAGE_TIMEOUT_S,
                   message=f"the {stage} job's start")
        if how == "SIGKILL":
            first.kill()
        else:
            # A stop: the daemon ends the waiting client at once, not after the
            # shutdown bound, and leaves the job running.
            first.signal(signal.SIGTERM)
            first.wait(SHUTDOWN_S / 2)
            assert ws.events(f"{stage}.stopped")
    [sub] = of_stage(submissions(ws), stage)
    kill_if_client(sub["client"])  # systemd kills what is left in the unit's cgroup
    wait_until(lambda: not alive(sub["client"], "fake_sbatch.py"), 5,
               message="the client's end")
    assert alive(sub["job"], f"toy_{stage}.py"), "the job must outlive the daemon and its client"
    handle = detached.handle_path(ws.runs, layout.StepKey(RUN, 0, 0), stage)
    assert handle.exists()

    offset = len(ws.events())
    with DaemonProcess(ws, prewarmed=True, name="second") as second:
        reattached = second.wait_event(f"{stage}.reattached", STAGE_TIMEOUT_S)
        assert reattached["ended"] is False  # still running, not found ended
        assert reattached["argv"][-len(sub["argv"]):] == sub["argv"]
        hold.unlink()  # the job goes on and ends
        second.wait_event("run.finished", STAGE_TIMEOUT_S, run=RUN)

    later = ws.events()[offset:]
    assert [e for e in later if e["event"] == f"{stage}.started"] == []
    assert len(of_stage(submissions(ws), stage)) == 1  # submitted once, by the first daemon
    assert journal(ws, stage, "start") == [(0, 0)]  # and run once on the "cluster"
    assert journal(ws, stage, "end") == [(0, 0)]
    [finished] = [e for e in later if e["event"] == f"{stage}.finished"]
    assert finished["exit_code"] == 0
    assert not handle.exists()
    # One attempt of the optimizer, however many daemons saw it.
    assert read_step_marker(ws.runs, layout.StepKey(RUN, 0, 0))["optimizer_attempts"] == 1
    assert [p.name for p in handle.parent.glob("*.done")] == []
    assert catalogue_problems(ws.events()) == []  # docs/events.md says what was logged
