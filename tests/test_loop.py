"""The closed loop: the daemon drives writer -> loss -> optimizer, step after step.

A real daemon (in-process, with its watchdog observer and APScheduler), the
loopback LLM server, and the repository's toy writer and optimizer
(examples/) as real subprocesses. Each stage appends a line to a journal
outside runs/ when it starts and when it ends, so a test counts the runs
that completed. The toy writer's episodes get closer to the human craft
along a schedule of scene counts, so the craft distance moves and the stop
rules have something to stop on.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.core import config
from skilltrain.daemon.core.errors import ConfigError
from skilltrain.daemon.service.loop import stop_reason
from skilltrain.handlers import optimizer
from tests.daemon_helpers import (
    REPO,
    InProcessDaemon,
    Workspace,
    build_workspace,
    read_events,
    run_cli,
    stays,
    wait_until,
)
from tests.llm_server import DEFAULT_REPORT, LLMServer, Reply, Request
from tests.test_events import catalogue_problems

pytestmark = [
    pytest.mark.usefixtures("litellm_frozen"),
    pytest.mark.filterwarnings(
        r"ignore:Exception ignored in. <socket\.socket fd=\d+, family=2:"
        "pytest.PytestUnraisableExceptionWarning"
    ),
    pytest.mark.filterwarnings("ignore:Callback with id .* already exists:RuntimeWarning"),
]

TOY_WRITER = REPO / "examples" / "toy_writer.py"
TOY_OPTIMIZER = REPO / "examples" / "toy_optimizer.py"
RUN = "r1"
FINISH_TIMEOUT_S = 60.0



def toml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"


def loop_workspace(root: Path, llm_url: str, *, steps_per_epoch: int = 2, max_epochs: int = 2,
                   scenes: str = "1,2,3", loop_extra: str = "", writer_attempts: int = 3,
                   optimizer_args: tuple[str, ...] = (), optimizer_attempts: int = 3,
                   **build: Any) -> Workspace:
    """One work of two episodes (one set per step), the toy writer and optimizer configured."""
    journal = str(root / "journal.jsonl")  # outside runs/
    writer = [sys.executable, str(TOY_WRITER), "{run_dir}", "{epoch}", "{step}",
              "--work", "alpha:2", "--steps-per-epoch", str(steps_per_epoch),
              "--scenes", scenes, "--prev-reports", "{prev_reports_dir}",
              "--journal", journal, "--fail-while", str(root / "writer-fails"),
              "--hold-while", str(root / "writer-holds")]
    optimizer = [sys.executable, str(TOY_OPTIMIZER), "{run_dir}", "{reports_dir}",
                 "{epoch}", "{step}", "--journal", journal, *optimizer_args]
    extra = f"""
[optimizer]
command = {toml_list(optimizer)}
timeout_s = 30
max_attempts = {optimizer_attempts}

[writer]
command = {toml_list(writer)}
timeout_s = 30
max_attempts = {writer_attempts}
retry_backoff_s = 0.2

[loop]
steps_per_epoch = {steps_per_epoch}
max_epochs = {max_epochs}
{loop_extra}
"""
    build.setdefault("per_report", 2)
    return build_workspace(root, llm_url, works={"alpha": 2}, extra=extra, **build)


def journal(ws: Workspace, stage: str, event: str = "end") -> list[tuple[int, int]]:
    """(epoch, step) of each journal line of this stage and kind, in order."""
    path = ws.root / "journal.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return [(x["epoch"], x["step"]) for x in lines if x["stage"] == stage and x["event"] == event]


def start_run(ws: Workspace, run: str = RUN) -> None:
    result, _ = run_cli("start", run, "--config", str(ws.config_path))
    assert result.returncode == 0, result.stderr


def finished(ws: Workspace, run: str = RUN) -> dict[str, Any]:
    return wait_until(lambda: (ws.events("run.finished", run=run) or [None])[-1],
                      FINISH_TIMEOUT_S, message=f"run.finished of {run}")


def loop_status(ws: Workspace) -> list[dict[str, Any]]:
    result, _ = run_cli("status", "--json", "--config", str(ws.config_path))
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["loop"]
    assert isinstance(rows, list)
    return rows


def steps_of(events: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [(e["epoch"], e["step"]) for e in events]


# ------------------------------------------------------------------ the loop


def test_a_2x2_loop_runs_every_stage_once_per_step_until_max_epochs(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    ws = loop_workspace(tmp_path, llm_server.url)
    steps = [(0, 0), (0, 1), (1, 0), (1, 1)]
    with InProcessDaemon(ws):
        start_run(ws)  # while the daemon runs: it sees runs/r1/START within a tick
        end = finished(ws)

    assert end["reason"] == "max_epochs"
    assert (end["epoch"], end["step"], end["steps"]) == (1, 1, 4)
    assert journal(ws, "writer") == steps  # each stage exactly once per step, in order
    assert journal(ws, "optimizer") == steps
    assert sorted(steps_of(ws.events("loss.completed"))) == steps
    assert steps_of(ws.events("writer.finished")) == steps
    assert steps_of(ws.events("run.advanced")) == steps[1:]
    # Each stage starts after the one before it ended.
    names = [(e["event"], e.get("epoch"), e.get("step")) for e in ws.events()]
    for n, (epoch, step) in enumerate(steps):
        order = [names.index(("writer.finished", epoch, step)),
                 names.index(("loss.completed", epoch, step)),
                 names.index(("step.reported", epoch, step)),
                 names.index(("optimizer.finished", epoch, step))]
        if n + 1 < len(steps):
            order.append(names.index(("writer.started", *steps[n + 1])))
        assert order == sorted(order), (epoch, step)
    # The writer is told where the step before it was reported ("" for the first).
    argvs = [e["argv"] for e in ws.events("writer.started")]
    prev = [argv[argv.index("--prev-reports") + 1] for argv in argvs]
    reports = ws.runs / RUN / "loss"
    assert prev == ["", *(str(reports / f"epoch_{e:02d}" / f"step_{s:02d}") for e, s in steps[:-1])]
    assert ws.events("run.started", run=RUN)[0]["trigger"] == "start"
    assert catalogue_problems(ws.events()) == []  # docs/events.md says what was logged
    [row] = loop_status(ws)
    assert (row["run"], row["phase"], row["finished"], row["epoch"], row["step"]) == (
        RUN, "finished", "max_epochs", 1, 1)
    text, _ = run_cli("status", "--config", str(ws.config_path))
    assert "finished: max_epochs" in text.stdout
    progress, _ = run_cli("progress", RUN, "--json", "--config", str(ws.config_path))
    assert [(r["epoch"], r["step"]) for r in json.loads(progress.stdout)] == steps


@pytest.mark.parametrize(
    ("rule", "scenes", "loop_extra"),
    [
        # distances about 0.19, 0.16, 0.04: the third step is under 0.1
        ("stop_below", "1,2,3", "stop_below = 0.1"),
        # about 0.04, then 0.19 twice: two steps without a better one
        ("patience", "3,1", "patience = 2"),
    ],
)
def test_a_stop_rule_ends_the_run(
    tmp_path: Path, llm_server: LLMServer, rule: str, scenes: str, loop_extra: str
) -> None:
    ws = loop_workspace(tmp_path, llm_server.url, steps_per_epoch=10, max_epochs=1,
                        scenes=scenes, loop_extra=loop_extra)
    (ws.runs / RUN).mkdir()  # an empty run folder appearing starts the run too
    with InProcessDaemon(ws):
        end = finished(ws)

    assert end["reason"] == rule
    assert (end["epoch"], end["step"], end["steps"]) == (0, 2, 3)
    distances = [e["craft_distance"] for e in ws.events("step.reported")]
    assert end["craft_distance"] == distances[-1]
    if rule == "stop_below":
        assert distances[-1] <= 0.1 < min(distances[:-1])
    else:
        assert end["best_craft_distance"] == distances[0] < min(distances[1:])
    assert journal(ws, "writer") == [(0, 0), (0, 1), (0, 2)]  # no writer after the end
    assert ws.events("run.started", run=RUN)[0]["trigger"] == "empty folder"


def test_stop_below_ends_the_run_at_a_distance_equal_to_it(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    """The rule is "at or under": a step whose distance is exactly stop_below ends
    the run there. The distance is measured by a first run of one step (the toy
    writer's text is a function of run, epoch and step, so the second run's first
    step has the same), then the second run stops on it."""
    probe = loop_workspace(tmp_path / "probe", llm_server.url, steps_per_epoch=1,
                           max_epochs=1)
    (probe.runs / RUN).mkdir()
    with InProcessDaemon(probe):
        finished(probe)
    [distance] = [e["craft_distance"] for e in probe.events("step.reported")]
    assert isinstance(distance, float) and distance > 0

    ws = loop_workspace(tmp_path / "equal", llm_server.url, steps_per_epoch=3, max_epochs=1,
                        loop_extra=f"stop_below = {distance!r}")
    (ws.runs / RUN).mkdir()
    with InProcessDaemon(ws):
        end = finished(ws)

    assert (end["reason"], end["epoch"], end["step"], end["steps"]) == ("stop_below", 0, 0, 1)
    assert end["craft_distance"] == distance
    assert journal(ws, "writer") == [(0, 0)]
    rule = config.LoopConfig(stop_below=0.25)
    assert stop_reason(rule, [0.5, 0.25], over_budget=False, next_epoch=0) == "stop_below"
    assert stop_reason(rule, [0.5, 0.2500001], over_budget=False, next_epoch=0) is None


@pytest.mark.parametrize("sets_per_step", [1, 2])
def test_the_budget_ends_the_run(
    tmp_path: Path, llm_server: LLMServer, sets_per_step: int
) -> None:
    """[llm] budget_usd, the budget that already holds loss jobs, also ends a looped run
    (gpt-4o-mini's offline price over the loopback: one report costs more than this).
    One set per step: the step is reported and the stop rule ends the run. Two sets,
    one job at a time: the budget holds the second set, the step is never reported,
    and only the check while scoring can end the run."""
    ws = loop_workspace(tmp_path, llm_server.url, steps_per_epoch=10, max_epochs=1,
                        per_report=2 // sets_per_step, concurrency=1)
    text = ws.config_path.read_text(encoding="utf-8")
    text = text.replace('model = "openai/loopback-model"', 'model = "openai/gpt-4o-mini"')
    ws.config_path.write_text(text.replace("[loss]", "budget_usd = 0.0001\n\n[loss]"))
    (ws.runs / RUN).mkdir()
    with InProcessDaemon(ws):
        end = finished(ws)

    assert (end["reason"], end["epoch"], end["step"]) == ("budget", 0, 0)
    assert len(ws.events("loss.completed")) == 1
    if sets_per_step == 2:
        assert end["steps"] == 0
    assert journal(ws, "writer") == [(0, 0)]


def test_pause_holds_the_run_after_the_stage_in_flight_and_removing_it_resumes(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    ws = loop_workspace(tmp_path, llm_server.url, steps_per_epoch=2, max_epochs=1)
    pause = ws.runs / RUN / "PAUSE"

    def pause_while_scoring(request: Request) -> Reply:
        pause.touch()  # the first loss job of step 0 is in flight
        return Reply.ok(DEFAULT_REPORT)

    llm_server.default = pause_while_scoring
    with InProcessDaemon(ws):
        start_run(ws)
        held = wait_until(lambda: ws.events("run.paused", run=RUN), FINISH_TIMEOUT_S,
                          message="run.paused")[0]
        # Step 0 finished its stages (loss, optimizer); the writer of step 1 waits.
        assert (held["epoch"], held["step"]) == (0, 1)
        assert journal(ws, "optimizer") == [(0, 0)]
        assert stays(lambda: journal(ws, "writer", "start") == [(0, 0)], 1.5)
        [row] = loop_status(ws)
        assert row["paused"] and (row["phase"], row["epoch"], row["step"]) == ("writing", 0, 1)
        llm_server.default = lambda request: Reply.ok(DEFAULT_REPORT)
        pause.unlink()
        end = finished(ws)

    assert ws.events("run.resumed", run=RUN, trigger="PAUSE")
    assert end["reason"] == "max_epochs"
    assert journal(ws, "writer") == [(0, 0), (0, 1)]


def test_a_failing_writer_is_retried_then_the_run_stalls_until_retry(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    ws = loop_workspace(tmp_path, llm_server.url, steps_per_epoch=1, max_epochs=1,
                        writer_attempts=2)
    fails = ws.root / "writer-fails"
    fails.touch()
    with InProcessDaemon(ws):
        start_run(ws)
        stalled = wait_until(lambda: ws.events("run.stalled", run=RUN), FINISH_TIMEOUT_S,
                             message="run.stalled")[0]
        assert "the writer failed 2 times: exit code 1" in stalled["reason"]
        failed = ws.events("writer.failed", run=RUN)
        assert [(e["attempt"], e["will_retry"]) for e in failed] == [(1, True), (2, False)]
        # Held: no third attempt, whatever the time.
        assert stays(lambda: len(journal(ws, "writer", "start")) == 2, 1.0)
        [row] = loop_status(ws)
        assert row["stalled"] == stalled["reason"]
        fails.unlink()
        (ws.runs / RUN / "RETRY").touch()
        end = finished(ws)

    assert ws.events("run.resumed", run=RUN, trigger="RETRY")
    assert not (ws.runs / RUN / "RETRY").exists()  # consumed: a later stall waits again
    assert end["reason"] == "max_epochs"
    assert journal(ws, "writer") == [(0, 0)]
    assert journal(ws, "optimizer") == [(0, 0)]
    assert catalogue_problems(ws.events()) == []


def test_an_optimizer_that_used_its_attempts_stalls_the_run_and_retry_gives_it_fresh_ones(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    fails = tmp_path / "optimizer-fails"
    ws = loop_workspace(tmp_path, llm_server.url, steps_per_epoch=1, max_epochs=1,
                        optimizer_args=("--fail-while", str(fails)), optimizer_attempts=1)
    fails.touch()
    with InProcessDaemon(ws):
        start_run(ws)
        stalled = wait_until(lambda: ws.events("run.stalled", run=RUN), FINISH_TIMEOUT_S,
                             message="run.stalled")[0]
        assert stalled["phase"] == "optimizing"
        assert "the optimizer failed 1 times" in stalled["reason"]
        assert len(ws.events("optimizer.failed")) == 1
        fails.unlink()
        (ws.runs / RUN / "RETRY").touch()
        end = finished(ws)

    assert ws.events("run.resumed", run=RUN, trigger="RETRY")
    assert end["reason"] == "max_epochs"
    assert journal(ws, "optimizer", "start") == [(0, 0), (0, 0)]  # the failed run, the retry
    assert journal(ws, "optimizer") == [(0, 0)]
    assert [e["exit_code"] for e in ws.events("optimizer.finished")] == [1, 0]
    assert catalogue_problems(ws.events()) == []


def test_a_writer_cut_short_by_a_stop_is_not_a_failure_and_runs_again_at_the_next_start(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    ws = loop_workspace(tmp_path, llm_server.url, steps_per_epoch=1, max_epochs=1,
                        writer_attempts=1, shutdown_timeout_s=0.3)
    hold = ws.root / "writer-holds"
    hold.touch()
    start_run(ws)  # no daemon yet: the next one to start picks it up
    with InProcessDaemon(ws):
        wait_until(lambda: ws.events("writer.started"), FINISH_TIMEOUT_S,
                   message="writer.started")
    # The stop waited 0.3 s for the writer, then killed it: not a failed attempt.
    [stopped] = ws.events("writer.stopped")
    assert stopped["attempt"] == 1
    assert ws.events("writer.failed") == [] and ws.events("run.stalled") == []
    hold.unlink()
    with InProcessDaemon(ws):
        end = finished(ws)

    assert end["reason"] == "max_epochs"
    assert journal(ws, "writer", "start") == [(0, 0), (0, 0)]
    assert journal(ws, "writer") == [(0, 0)]
    assert [e["attempt"] for e in ws.events("writer.started")] == [1, 1]
    assert catalogue_problems(ws.events()) == []


def test_a_restart_while_scoring_scores_on_and_never_runs_the_writer_again(
    tmp_path: Path
) -> None:
    """Deterministic, no kill order: the first daemon stops while the step's
    loss job hangs (its writer recorded finished, the run recorded scoring);
    the second scores it and finishes the run with that writer's episodes."""
    with LLMServer() as server:
        server.script(Reply.hang(30))  # the step's loss job: in flight at the stop
        ws = loop_workspace(tmp_path, server.url, steps_per_epoch=1, max_epochs=1,
                            shutdown_timeout_s=0.3)
        start_run(ws)
        with InProcessDaemon(ws):
            wait_until(lambda: ws.events("loss.started", run=RUN), FINISH_TIMEOUT_S,
                       message="loss.started")
        [row] = loop_status(ws)
        assert (row["phase"], row["epoch"], row["step"]) == ("scoring", 0, 0)
        assert ws.events("loss.completed") == []
        first = len(ws.events())
        with InProcessDaemon(ws):
            end = finished(ws)

    assert end["reason"] == "max_epochs"
    again = ws.events()[first:]
    assert [e for e in again if e["event"].startswith("writer.")] == []
    assert journal(ws, "writer", "start") == [(0, 0)]
    assert [(e["epoch"], e["step"]) for e in again if e["event"] == "loss.completed"] == [(0, 0)]


def test_a_run_deleted_and_started_again_under_its_name_runs_afresh(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    """state.json must not remember the steps of a run folder that is gone."""
    ws = loop_workspace(tmp_path, llm_server.url, steps_per_epoch=1, max_epochs=1)
    start_run(ws)
    with InProcessDaemon(ws):
        finished(ws)
    shutil.rmtree(ws.runs / RUN)
    start_run(ws)
    with InProcessDaemon(ws):
        wait_until(lambda: len(ws.events("run.finished", run=RUN)) == 2, FINISH_TIMEOUT_S,
                   message="the second run.finished")

    assert journal(ws, "writer") == [(0, 0), (0, 0)]
    assert journal(ws, "optimizer") == [(0, 0), (0, 0)]


# -------------------------------------------------------------------- config


def test_a_commands_program_is_checked_at_start_unless_a_placeholder_names_it(
    tmp_path: Path,
) -> None:
    optimizer.check_command([sys.executable, "-c", "pass", "{run}"])
    optimizer.check_command(["{run_dir}/train.sh", "{epoch}"])  # found when it runs
    not_executable = tmp_path / "train.sh"
    not_executable.write_text("#!/bin/sh\n")
    for program in (str(not_executable), str(tmp_path / "absent"), "no-such-program-xyz"):
        with pytest.raises(ConfigError, match="program"):
            optimizer.check_command([program])
    not_executable.chmod(0o755)
    optimizer.check_command([str(not_executable)])


def test_loop_config_errors_name_the_key_and_exit_2(tmp_path: Path) -> None:
    ws = build_workspace(tmp_path / "a", "http://127.0.0.1:9/v1",
                         extra="[loop]\nsteps_per_epoch = 2\n")
    before = sorted(tmp_path.rglob("*"))
    result, _ = run_cli("daemon", "--config", str(ws.config_path))
    assert result.returncode == 2
    assert "[writer] command = []: [loop] is configured" in result.stderr
    # Found by the preflight: no lock, no state, runs/ untouched; only the line
    # saying why is added to a log file whose folder exists.
    assert sorted(p for p in tmp_path.rglob("*") if p != ws.log_file) == before
    (failed,) = read_events(ws.log_file, "daemon.failed")
    assert read_events(ws.log_file) == [failed]

    # A command whose program is not there: every step would fail its attempts.
    for section, program, says in (
        ("writer", "no-such-writer-program", "not found on PATH"),
        ("optimizer", str(tmp_path / "gone" / "optimize.sh"), "no such file, or not executable"),
    ):
        root = tmp_path / f"missing-{section}"
        extra = f'[{section}]\ncommand = ["{program}", "{{run_dir}}"]\n'
        if section == "writer":
            extra += "[loop]\nsteps_per_epoch = 2\n"
        missing = build_workspace(root, "http://127.0.0.1:9/v1", extra=extra)
        before = sorted(root.rglob("*"))
        result, _ = run_cli("daemon", "--config", str(missing.config_path))
        assert result.returncode == 2, result.stderr
        assert f"[{section}] command" in result.stderr and says in result.stderr
        assert sorted(p for p in root.rglob("*") if p != missing.log_file) == before

    bad = build_workspace(tmp_path / "b", "http://127.0.0.1:9/v1",
                          extra="[loop]\nstop_belw = 0.1\n")
    result, _ = run_cli("start", RUN, "--config", str(bad.config_path))
    assert result.returncode == 2
    assert "unknown key [loop] stop_belw (did you mean 'stop_below'?)" in result.stderr

    nul = build_workspace(tmp_path / "d", "http://127.0.0.1:9/v1",
                          extra='[optimizer]\ncommand = ["/bin/true", "a\\u0000b"]\n')
    result, _ = run_cli("daemon", "--once", "--config", str(nul.config_path))
    assert result.returncode == 2 and "holds a NUL character" in result.stderr

    plain = build_workspace(tmp_path / "c", "http://127.0.0.1:9/v1")
    result, _ = run_cli("start", RUN, "--config", str(plain.config_path))
    assert result.returncode == 2 and "[loop] is not configured" in result.stderr
    assert not (plain.runs / RUN).exists()


def test_a_symlinked_run_folder_is_never_looped(tmp_path: Path, llm_server: LLMServer) -> None:
    # An empty real folder starts a run; a link to an empty folder outside
    # runs/ must not: the loop sees the runs the scan sees, never a symlink.
    ws = loop_workspace(tmp_path, llm_server.url)
    elsewhere = ws.outside / "linked-target"
    elsewhere.mkdir(parents=True)
    (ws.runs / "linked").symlink_to(elsewhere, target_is_directory=True)
    with InProcessDaemon(ws):
        wait_until(lambda: ws.events("set.unusable"), 10, message="the link named unusable")
        (ws.runs / "real").mkdir()  # a real empty run folder, to show the loop is looking
        wait_until(lambda: ws.events("writer.started", run="real"), 10,
                   message="the real run's writer")
    assert ws.events("run.started", run="linked") == []
    assert ws.events("writer.started", run="linked") == []
    assert list(elsewhere.iterdir()) == []  # no loop.json, no episodes outside runs/
