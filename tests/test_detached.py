"""handlers/detached.py on its own: the handle recorded before a stage's
command starts, and what a later daemon does with it. Real files under
tmp_path and real subprocesses; the daemon-level test with a stand-in
`sbatch --wait` is tests/test_stage_outlives_daemon.py."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.core import layout
from skilltrain.handlers import detached

pytestmark = pytest.mark.timeout(20)

STEP = layout.StepKey("r1", 0, 2)


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.reattached = threading.Event()

    def __call__(self, event: str, **fields: Any) -> None:
        self.seen.append((event, fields))
        if event.endswith(".reattached"):
            self.reattached.set()


def handle_of(tmp_path: Path) -> Path:
    return detached.handle_path(tmp_path / "runs", STEP, "writer")


def leave_handle(handle: Path, token: str, *, deadline_in_s: float) -> None:
    """What a daemon killed after submitting leaves behind."""
    handle.parent.mkdir(parents=True)
    now = time.time()
    handle.write_text(json.dumps({"token": token, "argv": ["sbatch", "job.sh"],
                                  "submitted_at": now - 5, "deadline_at": now + deadline_in_s}))


def run(tmp_path: Path, argv: list[str], emit: Events | None = None,
        cancel: threading.Event | None = None) -> detached.OptimizerResult:
    return detached.run(argv, handle=handle_of(tmp_path), stage="writer", timeout_s=10,
                        emit=emit or Events(), cancel=cancel or threading.Event(),
                        started=lambda: None)


def marks(tmp_path: Path) -> list[str]:
    return [sys.executable, "-c", f"open({str(tmp_path / 'ran')!r}, 'a').write('x')"]


def test_the_handle_is_recorded_before_the_command_runs_and_forgotten_after(
    tmp_path: Path,
) -> None:
    handle = handle_of(tmp_path)
    at_start: list[bool] = []
    argv = [sys.executable, "-c",
            "import os, sys; p = os.environ['SKILLTRAIN_STAGE_DONE']; "
            "open(p, 'w').write('0'); sys.exit(0 if os.path.isfile(p) else 9)"]
    result = detached.run(argv, handle=handle, stage="writer", timeout_s=10, emit=Events(),
                          cancel=threading.Event(),
                          started=lambda: at_start.append(handle.exists()))
    assert at_start == [True]  # a kill from the submission on finds it
    assert (result.exit_code, result.reattached, result.detached) == (0, False, False)
    assert list(handle.parent.iterdir()) == []  # handle and marker both gone


def test_a_job_that_ended_while_no_daemon_waited_is_not_run_again(tmp_path: Path) -> None:
    handle = handle_of(tmp_path)
    leave_handle(handle, "abc", deadline_in_s=60)
    detached.done_path(handle, "abc").write_text("3\n")
    events = Events()
    result = run(tmp_path, marks(tmp_path), events)
    assert (result.exit_code, result.reason, result.reattached) == (3, "exit code 3", True)
    assert not (tmp_path / "ran").exists()
    assert [(e, f["ended"]) for e, f in events.seen] == [("writer.reattached", True)]
    assert list(handle.parent.iterdir()) == []


def test_a_marker_of_another_attempt_does_not_end_the_wait(tmp_path: Path) -> None:
    handle = handle_of(tmp_path)
    leave_handle(handle, "new", deadline_in_s=1.0)
    detached.done_path(handle, "old").write_text("0\n")  # a late job of an abandoned attempt
    result = run(tmp_path, marks(tmp_path))
    assert result.exit_code is None and "deadline" in (result.reason or "")
    assert not handle.exists()  # the next attempt submits anew
    assert not (tmp_path / "ran").exists()


def test_deleting_the_handle_ends_the_wait(tmp_path: Path) -> None:
    handle = handle_of(tmp_path)
    leave_handle(handle, "abc", deadline_in_s=600)
    events = Events()
    threading.Thread(target=lambda: events.reattached.wait(5) and handle.unlink()).start()
    result = run(tmp_path, marks(tmp_path), events)
    assert events.reattached.is_set()
    assert (result.exit_code, result.reason) == (None, "its handle was deleted")


def test_a_marker_without_a_status_is_a_failed_attempt(tmp_path: Path) -> None:
    handle = handle_of(tmp_path)
    leave_handle(handle, "abc", deadline_in_s=60)
    detached.done_path(handle, "abc").write_text("oops\n")
    result = run(tmp_path, marks(tmp_path))
    assert result.exit_code is None and "holds no exit status" in (result.reason or "")


def test_a_stop_while_waiting_keeps_the_handle(tmp_path: Path) -> None:
    handle = handle_of(tmp_path)
    leave_handle(handle, "abc", deadline_in_s=600)
    cancel = threading.Event()
    cancel.set()
    result = run(tmp_path, marks(tmp_path), cancel=cancel)
    assert (result.detached, result.exit_code) == (True, None)
    assert handle.exists()  # the next start waits again
