"""The step marker against a state database that is lost, corrupt or lagging.

The marker beside the reports (runs/<run>/loss/.steps/) is written when the
step changes; the state database is flushed later (daemon/service/steps.py). After a
SIGKILL in between, the database a new daemon reads is valid but older than
the markers. These tests make that lag for real: a copy of the database
taken at an earlier moment of the same run, restored after, with the
optimizer held at the moment that matters (the toy optimizer's --hold-while).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_helpers import InProcessDaemon, Workspace, run_once_in_process, wait_until
from tests.llm_server import LLMServer
from tests.test_loop import FINISH_TIMEOUT_S, RUN, journal, loop_workspace

pytestmark = [
    pytest.mark.usefixtures("litellm_frozen"),
    pytest.mark.filterwarnings(
        r"ignore:Exception ignored in. <socket\.socket fd=\d+, family=2:"
        "pytest.PytestUnraisableExceptionWarning"
    ),
    pytest.mark.filterwarnings("ignore:Callback with id .* already exists:RuntimeWarning"),
]

STEP_ID = f"{RUN}/epoch_00/step_00"


def step_record(ws: Workspace) -> dict[str, Any]:
    """The step's row in the state database ({} when it has none), read as status reads it."""
    from skilltrain.daemon.core import state_db

    data = state_db.read_only(ws.state_file) or {}
    record = data.get("steps", {}).get(STEP_ID, {})
    assert isinstance(record, dict)
    return record


def marker_path(ws: Workspace) -> Path:
    return ws.runs / RUN / "loss" / ".steps" / "epoch_00-step_00.json"


def copy_database(source: Path, target: Path) -> None:
    """A consistent copy of a live SQLite database (its WAL included), as a backup takes."""
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True)
    dst = sqlite3.connect(target)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()


def restore_database(copy: Path, ws: Workspace) -> None:
    """Put an older copy back in place of the state database (the daemon is stopped)."""
    for stale in (ws.state_file.with_name(ws.state_file.name + s) for s in ("-wal", "-shm")):
        stale.unlink(missing_ok=True)
    copy_database(copy, ws.state_file)


def test_a_state_file_that_is_no_database_is_rebuilt_and_the_marker_says_the_optimizer_ran(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    """state.sqlite3 overwritten with text is moved aside and rebuilt: the step's
    marker still knows its optimizer ran, so it does not run again."""
    ws = loop_workspace(tmp_path, llm_server.url)
    ws.write_step(RUN, 0, 0, success=True)
    run_once_in_process(ws)
    assert journal(ws, "optimizer") == [(0, 0)]
    state = ws.state()
    record = state["steps"][STEP_ID]
    assert record["optimizer_done"] and record["optimizer_attempts"] == 1
    record["optimizer_done"] = False
    ws.state_file.write_text(json.dumps(state), encoding="utf-8")

    run_once_in_process(ws)

    assert [e["reason"].startswith("not a state database")
            for e in ws.events("state.unreadable")] == [True]
    assert journal(ws, "optimizer") == [(0, 0)]


def test_a_marker_that_says_the_optimizer_ran_wins_over_a_lagging_state_database(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    """A SIGKILL after the optimizer's marker was written and before the state
    was flushed leaves a valid database that lags: it says the optimizer is
    running. The next start must not run the optimizer again (the loop builds on it).

    The database is copied while the optimizer runs (held by a file), and
    restored after the daemon recorded its end.
    """
    hold = tmp_path / "optimizer-holds"
    ws = loop_workspace(tmp_path, llm_server.url, optimizer_args=("--hold-while", str(hold)))
    hold.touch()
    ws.write_step(RUN, 0, 0, success=True)
    lagging = tmp_path / "state-while-the-optimizer-ran.sqlite3"
    with InProcessDaemon(ws):
        wait_until(lambda: journal(ws, "optimizer", "start"), FINISH_TIMEOUT_S,
                   message="the optimizer's start")
        wait_until(lambda: step_record(ws).get("optimizer_attempts") == 1,
                   FINISH_TIMEOUT_S, message="the flush of the optimizer's first attempt")
        copy_database(ws.state_file, lagging)
        hold.unlink()
        wait_until(lambda: ws.events("optimizer.finished"), FINISH_TIMEOUT_S,
                   message="optimizer.finished")
    assert step_record(ws)["optimizer_done"] is True
    assert json.loads(marker_path(ws).read_text(encoding="utf-8"))["optimizer_done"] is True
    restore_database(lagging, ws)
    record = step_record(ws)  # the state lags, and is a valid database
    assert record["reported_at"] is not None
    assert (record["optimizer_done"], record["optimizer_attempts"]) == (False, 1)

    run_once_in_process(ws)

    assert ws.events("state.unreadable") == []
    assert journal(ws, "optimizer", "start") == [(0, 0)]
    assert len(ws.events("optimizer.started")) == 1
    assert len(ws.events("step.reported")) == 1
    assert step_record(ws)["optimizer_done"] is True


def test_a_report_replaced_after_the_state_was_flushed_is_still_optimized(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    """The other way a state lags: the step was reopened (a report replaced,
    marker generation 1) and the daemon killed while that optimizer ran, with
    the state last flushed before the replacement (generation 0, optimizer
    done). The next start must run the optimizer on the new report, not take
    the old generation's "done" for it.

    The database is copied before the episode is rewritten; the marker as it
    was while the second optimizer ran (held by a file) is put back with it.
    """
    hold = tmp_path / "optimizer-holds"
    ws = loop_workspace(tmp_path, llm_server.url, optimizer_args=("--hold-while", str(hold)))
    ws.write_step(RUN, 0, 0, success=True)
    run_once_in_process(ws)
    assert journal(ws, "optimizer") == [(0, 0)]
    before = tmp_path / "state-before-the-rewrite.sqlite3"
    copy_database(ws.state_file, before)
    assert (step_record(ws)["generation"], step_record(ws)["optimizer_done"]) == (0, True)

    episode = ws.scripts(RUN, 0, 0, "alpha") / "ep01.txt"  # the writer rewrites an episode
    episode.write_text(episode.read_text(encoding="utf-8") + "\nA last line, added.\n",
                       encoding="utf-8")
    hold.touch()
    with InProcessDaemon(ws):
        wait_until(lambda: len(journal(ws, "optimizer", "start")) == 2, FINISH_TIMEOUT_S,
                   message="the second optimizer's start")
        in_flight = marker_path(ws).read_text(encoding="utf-8")
        hold.unlink()
        wait_until(lambda: len(ws.events("optimizer.finished")) == 2, FINISH_TIMEOUT_S,
                   message="the second optimizer.finished")
    marker = json.loads(in_flight)
    assert (marker["generation"], marker["optimizer_done"], marker["optimizer_attempts"]) \
        == (1, False, 1)
    marker_path(ws).write_text(in_flight, encoding="utf-8")
    restore_database(before, ws)

    run_once_in_process(ws)

    assert ws.events("state.unreadable") == []
    assert journal(ws, "optimizer", "start") == [(0, 0)] * 3  # the interrupted one again
    record = step_record(ws)
    assert (record["generation"], record["optimizer_done"]) == (1, True)
    assert json.loads(marker_path(ws).read_text(encoding="utf-8"))["optimizer_done"] is True
