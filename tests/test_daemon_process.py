"""The daemon as a real process: `skilltrain daemon` under SIGKILL, SIGTERM, SIGINT,
a second instance on the same runs/, `--once`, and `skilltrain status`.

Each test starts the installed `skilltrain` command in its own workspace,
talking to the loopback LLM server over HTTP. A child daemon that makes an
LLM call pays litellm's import (~5 s) first, so only the three signal tests
need a job in flight in a child; trees that must already be reported are
made in-process (`daemon --once` semantics), where litellm is imported once.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_helpers import (
    TEMP_PREFIX,
    DaemonProcess,
    InProcessDaemon,
    SetId,
    Workspace,
    build_workspace,
    mark_success,
    release_llm_clients,
    remove_tree,
    requested_sets,
    run_cli,
    run_once_in_process,
    sha256_text,
    stays,
    wait_until,
)
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.llm_server import DEFAULT_REPORT, LLMServer, Reply, Request

pytestmark = DAEMON_TEST_MARKS

# The child imports litellm (~5 s, far more on a loaded machine) before its first call.
FIRST_CALL_TIMEOUT_S = 60.0


@pytest.fixture(autouse=True)
def _release_llm_clients() -> Iterator[None]:
    yield
    release_llm_clients()


@pytest.fixture
def ws(tmp_path: Path, llm_server: LLMServer) -> Workspace:
    return build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, settle_s=0.2)


def old_files(ws: Workspace, run: str = "r1", step: int = 1) -> list[SetId]:
    """A step whose episodes were written a minute ago and marked finished (_SUCCESS):
    ready as soon as it is seen, in the scan's order. Old mtimes alone no longer
    do: a set seen for the first time waits out the settle window."""
    sets = ws.write_step(run, 1, step)
    past = time.time() - 60
    for work in ws.works:
        scripts = ws.scripts(run, 1, step, work)
        for path in scripts.iterdir():
            os.utime(path, (past, past))
        mark_success(scripts)
    return sets


def assert_complete_report(ws: Workspace, s: SetId) -> None:
    """Report, archive and sidecar present, whole, and made from the files on disk."""
    assert ws.report(s).read_text(encoding="utf-8").strip() == DEFAULT_REPORT
    assert ws.archive(s).is_file()
    sidecar = ws.read_sidecar(s)
    scripts = ws.scripts(s.run, s.epoch, s.step, s.work)
    for ep in range(s.first, s.last + 1):
        name = f"ep{ep:02d}.txt"
        assert sidecar["model_episodes"][name] == sha256_text((scripts / name).read_text())


# ------------------------------------------------------------------------ crashes


def test_sigkill_during_a_job_then_restart_completes_the_set(
    ws: Workspace, llm_server: LLMServer
) -> None:
    s = old_files(ws)[0]
    llm_server.script(Reply.hang(120))  # the first request never answers in time
    with DaemonProcess(ws) as daemon:
        wait_until(
            lambda: llm_server.request_count == 1, FIRST_CALL_TIMEOUT_S, message="the job's request"
        )
        daemon.wait_event("loss.started", 5)
        wait_until(
            lambda: ws.state_file.is_file()
            and ws.state()["sets"].get(s.id, {}).get("state") == "running",
            5,
            message="the state file to show the job running",
        )
        daemon.signal(signal.SIGKILL)
        assert daemon.wait(10) == -signal.SIGKILL
    assert not ws.report(s).exists() and not ws.sidecar(s).exists()
    assert ws.state()["sets"][s.id]["state"] == "running"  # what the dead daemon last wrote
    # What a crash in the middle of an atomic write leaves behind.
    leftover = ws.report(s).parent / f"{TEMP_PREFIX}{ws.report(s).name}.k1ll3d.tmp"
    leftover.parent.mkdir(parents=True, exist_ok=True)
    leftover.write_text("half a rep")

    run_once_in_process(ws)  # the restart: the kernel released the dead daemon's lock

    assert llm_server.request_count == 2
    assert_complete_report(ws, s)
    assert ws.temp_files() == []
    assert ws.events("daemon.cleaned")[-1]["temp_files"] == 1
    assert ws.state()["sets"][s.id]["state"] == "done"


# -------------------------------------------------------------------------- signals


def test_sigterm_drains_running_jobs_abandons_what_outlives_the_timeout_and_exits_0(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    """Three sets, concurrency 2: A answers after 1 s, B hangs, C is still queued."""
    ws = build_workspace(
        tmp_path,
        llm_server.url,
        works={"alpha": 9},
        settle_s=0.2,
        concurrency=2,
        shutdown_timeout_s=2,
        # B must outlive the shutdown bound however late a loaded machine
        # handles the signal: its own timeout must not end it first.
        llm_timeout_s=60,
    )
    a, b, c = old_files(ws)

    def answer(request: Request) -> Reply:
        if "ep=4" in str(request.body):  # set B (episodes 4-6)
            return Reply.hang(120)
        return Reply.delay(1.0, Reply.ok(DEFAULT_REPORT))

    llm_server.default = answer
    with DaemonProcess(ws) as daemon:
        wait_until(
            lambda: llm_server.request_count == 2,
            FIRST_CALL_TIMEOUT_S,
            message="two requests in flight",
        )
        t0 = time.monotonic()
        daemon.signal(signal.SIGTERM)
        code = daemon.wait(20)
        took = time.monotonic() - t0
    print(f"SIGTERM with a 1 s and a hung request in flight: exit {code} after {took:.2f}s")
    assert code == 0
    assert 1.0 < took < 2 + 4  # shutdown_timeout_s, plus a loop tick and the exit itself
    assert sorted(requested_sets(llm_server)) == sorted([a.id, b.id])  # C never started
    assert_complete_report(ws, a)  # drained
    for s in (b, c):
        assert not ws.report(s).exists() and not ws.sidecar(s).exists()
    stopping = ws.events("daemon.stopping")[-1]
    assert (stopping["reason"], stopping["running"], stopping["queued"]) == ("signal", 2, 1)
    stopped = ws.events("daemon.stopped")[-1]
    assert (stopped["exit_code"], stopped["done"], stopped["abandoned"]) == (0, 1, 1)
    assert ws.temp_files() == []
    assert ws.state()["daemon_pid"] is None


def test_second_sigint_exits_at_once(ws: Workspace, llm_server: LLMServer) -> None:
    s = old_files(ws)[0]
    llm_server.script(Reply.hang(120))
    with DaemonProcess(ws, name="sigint") as daemon:
        wait_until(
            lambda: llm_server.request_count == 1, FIRST_CALL_TIMEOUT_S, message="the job's request"
        )
        daemon.signal(signal.SIGINT)
        daemon.wait_event("daemon.stopping", 5)
        assert stays(daemon.alive, 0.5), "the first SIGINT drains; it must not exit yet"
        t0 = time.monotonic()
        daemon.signal(signal.SIGINT)
        code = daemon.wait(5)
        took = time.monotonic() - t0
    print(f"second SIGINT: exit {code} after {took:.3f}s")
    assert code == 130
    assert took < 2.0
    assert not ws.report(s).exists()
    assert ws.temp_files() == []


# ----------------------------------------------------------------- one per runs/


def test_second_instance_on_the_same_runs_exits_3_with_one_clear_line(
    ws: Workspace, llm_server: LLMServer
) -> None:
    first = InProcessDaemon(ws).start()
    try:
        lock_text = (ws.runs / ".skilltrain" / "daemon.lock").read_text()
        for args in ((), ("--once",)):
            second = DaemonProcess(ws, *args, name=f"second{len(args)}")
            code = second.wait(30)
            lines = [ln for ln in second.stderr().splitlines() if ln.strip()]
            human = [ln for ln in lines if not ln.startswith("{")]
            print(f"second instance {args}: exit {code}, stderr {lines}")
            assert code == 3
            # stderr is not a terminal (a journal): the one line is a JSON event.
            assert human == []
            (failed,) = [json.loads(ln) for ln in lines if '"daemon.failed"' in ln]
            assert failed["reason"] == (
                f"another skilltrain daemon (pid {os.getpid()}) is already running on {ws.runs}"
            )
        # The first daemon is untouched and still working.
        assert (ws.runs / ".skilltrain" / "daemon.lock").read_text() == lock_text
        assert not first.daemon.stop_event.is_set()
        sets = old_files(ws, step=2)
        wait_until(lambda: ws.has_report(sets[0]), 20, message="the first daemon's report")
    finally:
        first.stop()
    assert llm_server.request_count == 1


# ------------------------------------------------------------------------- --once


def test_runs_deleted_with_the_log_file_inside_it_is_survived(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    """runs/ removed under a running daemon whose JSON log lives in runs/ (the default)."""
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, settle_s=0.2)
    # The shipped default: the JSON log lives in runs/.
    text = ws.config_path.read_text().replace('file = "skilltrain.jsonl"', "")
    ws.config_path.write_text(text)
    ws.log_file = ws.runs / "skilltrain.jsonl"
    with DaemonProcess(ws, name="rmruns") as daemon:
        daemon.wait_event("daemon.ready", 30)
        remove_tree(ws.runs)
        # The main loop notices within a tick (1 s): logging that used to raise
        # FileNotFoundError out of the loop and end the process (exit 1).
        assert stays(daemon.alive, 1.5), f"exit {daemon.proc.returncode}: {daemon.stderr()[-600:]}"
        ws.runs.mkdir(exist_ok=True)
        daemon.wait_event("watch.restarted", 10)
        old_files(ws)
        daemon.wait_event("loss.queued", 10, run="r1", range="01-03")  # watched again
        assert ws.events("watch.root_missing")


@pytest.mark.parametrize("state_kept", [True, False], ids=["state-kept", "state-lost"])
def test_once_on_a_fully_reported_tree_makes_no_request(
    tmp_path: Path, llm_server: LLMServer, state_kept: bool
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 6, "beta": 3}, settle_s=0.2)
    sets = [s for step in (1, 2) for s in old_files(ws, step=step)]
    run_once_in_process(ws)
    assert llm_server.request_count == len(sets) == 6
    if not state_kept:
        ws.state_file.unlink()
    before = {s.id: ws.report(s).stat().st_mtime_ns for s in sets}

    daemon = DaemonProcess(ws, "--once", name="once")
    code = daemon.wait(30)
    took = time.monotonic() - daemon.started_at
    print(
        f"--once on a fully reported tree ({'state kept' if state_kept else 'no state'}): "
        f"exit {code} in {took:.2f}s"
    )
    assert code == 0, daemon.stderr()[-2000:]
    assert llm_server.request_count == 6
    assert {s.id: ws.report(s).stat().st_mtime_ns for s in sets} == before
    assert {rec["state"] for rec in ws.state()["sets"].values()} == {"done"}


# ------------------------------------------------------------------------- status


def test_status_is_fast_never_imports_litellm_and_shows_failures(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    ws = build_workspace(
        tmp_path, llm_server.url, works={"alpha": 3, "beta": 6}, settle_s=0.2, max_attempts=1
    )

    def beta_fails(request: Request) -> Reply:
        return Reply.status(500) if "work=beta" in str(request.body) else Reply.ok(DEFAULT_REPORT)

    llm_server.default = beta_fails
    old_files(ws)
    (ws.scripts("r1", 1, 1, "beta") / "ep06.txt").unlink()  # beta 04-06 waits
    alpha = SetId("r1", 1, 1, "alpha", 1, 3)
    beta_failed = SetId("r1", 1, 1, "beta", 1, 3)
    beta_waiting = SetId("r1", 1, 1, "beta", 4, 6)
    daemon = InProcessDaemon(ws).start()
    try:
        wait_until(lambda: ws.has_report(alpha), 20, message="alpha's report")
        wait_until(lambda: ws.events("loss.failed"), 10, message="beta's failure")
        wait_until(
            lambda: (
                ws.state_file.is_file()
                and ws.state()["sets"].get(beta_failed.id, {}).get("state") == "failed"
            ),
            5,
            message="the state file to show the failure",
        )
        live, took_live = run_cli("status", "--json", "--config", str(ws.config_path))
    finally:
        daemon.stop()
    assert live.returncode == 0, live.stderr
    data = json.loads(live.stdout)
    assert data["daemon"]["running"] is True and data["daemon"]["pid"] == os.getpid()

    stopped, took_json = run_cli("status", "--json", "--config", str(ws.config_path))
    text, took_text = run_cli("status", "--config", str(ws.config_path))
    traced, _ = run_cli(
        "status", "--config", str(ws.config_path), python_flags=["-X", "importtime"]
    )
    print(
        f"status --json: {took_live:.3f}s (daemon running), {took_json:.3f}s (stopped); "
        f"status: {took_text:.3f}s"
    )
    # Fast by what it loads (no litellm, below), not by a wall-clock bound a
    # loaded machine breaks: bench/ times status at scale.
    for result in (stopped, text):
        assert result.returncode == 0, result.stderr

    data = json.loads(stopped.stdout)
    assert data["daemon"]["running"] is False
    rows = {row["set"]: row for row in data["sets"]}
    assert rows[alpha.id]["state"] == "done"
    assert rows[beta_failed.id]["state"] == "failed"
    assert "500" in rows[beta_failed.id]["reason"]
    assert rows[beta_failed.id]["attempts"] == 1
    assert rows[beta_waiting.id]["state"] == "waiting"
    assert "ep06.txt missing" in rows[beta_waiting.id]["reason"]
    assert data["totals"] == {"done": 1, "failed": 1, "waiting": 1}

    assert "daemon not running" in text.stdout
    # The default view: the run's line, then only what needs someone: the
    # failure, and the range _SUCCESS closed with an episode missing.
    run_line = next(line for line in text.stdout.splitlines() if line.startswith("r1 "))
    assert run_line.split()[1:7] == ["waiting", "e01/s01", "1/3", "1", "0", "1"], run_line
    assert f"failed    {beta_failed.id}" in text.stdout and "500" in text.stdout
    assert f"unusable  {beta_waiting.id}  ep06.txt missing" in text.stdout
    assert data["attention_total"] == 2
    assert (data["runs"][0]["failed"], data["runs"][0]["unusable"]) == (1, 1)

    modules = [ln.split("|")[-1].strip() for ln in traced.stderr.splitlines() if "|" in ln]
    assert traced.returncode == 0 and "skilltrain.daemon.commands.status" in modules
    assert not [m for m in modules if m.split(".")[0] in ("litellm", "openai", "tiktoken")]
