"""A stage command whose job outlives the daemon: `outlives_daemon = true` in
[writer] or [optimizer] (docs/scale-out.md).

A cluster command (`sbatch --wait job.sh`, a script that creates a
Kubernetes Job and waits for it) submits a job that runs elsewhere and only
waits for it here. A daemon killed meanwhile (SIGKILL, a watchdog kill, the
restart of an upgrade) takes the waiting client with it (systemd kills the
unit's cgroup) but not the job. Started again, the daemon would submit the
same stage of the same step a second time: a day of GPUs paid twice.

So the daemon records a handle before it starts the command, and the job
writes a done marker as its last act:

    runs/<run>/loss/.steps/epoch_EE-step_SS.<stage>.job.json      the handle: token, argv,
                                                                  submitted_at, deadline_at
    runs/<run>/loss/.steps/epoch_EE-step_SS.<stage>.<token>.done  the job's exit status

The command gets the done file's path in $SKILLTRAIN_STAGE_DONE (sbatch
hands the environment on; a Kubernetes wrapper puts it in the Job's env),
and the job writes its exit status there when it ends:
`trap 'echo $? > "$SKILLTRAIN_STAGE_DONE"' EXIT`. A daemon that finds a
handle does not run the command: it waits for the done file, whose status is
the stage's, up to the handle's deadline (submitted + timeout_s), then counts
a failed attempt and the stage is retried as any failed one. The token keeps
a late job of an abandoned attempt from ending the next one.

Why a marker the job writes rather than a scheduler's handle (a Slurm job id
asked with squeue/sacct, a Job name asked with kubectl): the writer and the
optimizer must share runs/ with the daemon anyway (one writes the episodes,
the other reads the reports), so a file there needs nothing per scheduler,
no credentials for its API, and says the exit status after the scheduler
has forgotten the job (Slurm drops finished jobs from squeue after
MinJobAge, 300 s by default; sacct needs accounting). The price: a job that
dies without writing it (a node lost) is waited for until the deadline, so
set the scheduler's own time limit under timeout_s; and a daemon killed in
the instant between recording the handle and the submission waits for a job
that never started. Deleting the handle file ends either wait at once.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ..daemon.core import layout
from ..daemon.guard import sealed_write
from . import optimizer
from .optimizer import Emit, OptimizerResult

DONE_ENV = "SKILLTRAIN_STAGE_DONE"
POLL_S = 0.5  # a stat of one file: how soon a re-attached stage sees its job's end


@dataclass(frozen=True)
class Handle:
    token: str
    argv: list[str]
    submitted_at: float  # wall clock: it must mean the same to the next process
    deadline_at: float


def handle_path(runs: Path, step: layout.StepKey, stage: str) -> Path:
    return step.marker(runs).with_name(
        f"epoch_{step.epoch:02d}-step_{step.step:02d}.{stage}.job.json")


def done_path(handle: Path, token: str) -> Path:
    return handle.with_name(handle.name.removesuffix("job.json") + f"{token}.done")


def read_handle(path: Path) -> Handle | None:
    try:
        data = json.loads(path.read_bytes())
        return Handle(token=str(data["token"]), argv=list(data["argv"]),
                      submitted_at=float(data["submitted_at"]),
                      deadline_at=float(data["deadline_at"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def run(argv: Sequence[str], *, handle: Path, stage: str, timeout_s: float, emit: Emit,
        cancel: threading.Event, started: Callable[[], None],
        clock: Callable[[], float] = time.time) -> OptimizerResult:
    """The stage's result: from the command, or from the job a previous daemon submitted.

    `started` is called just before the command starts (its `<stage>.started`
    event); a re-attached job logs `<stage>.reattached` instead. A cancel (the
    daemon stopping) leaves the handle: the job goes on, the next start waits.
    """
    previous = read_handle(handle)
    if previous is not None:
        return _wait(previous, handle, stage=stage, emit=emit, cancel=cancel, clock=clock)
    token = secrets.token_hex(8)
    now = clock()
    # Recorded (atomic, fsync) before the submission: a SIGKILL from here on
    # finds it at the next start.
    record = Handle(token, list(argv), now, now + timeout_s)
    sealed_write.write_text(handle, json.dumps(asdict(record)) + "\n")
    started()
    result = optimizer.run(argv, timeout_s=timeout_s, emit=emit, cancel=cancel,
                           output_event=f"{stage}.output",
                           extra_env={DONE_ENV: str(done_path(handle, token))})
    if cancel.is_set() and result.exit_code is None:
        # Only the waiting client was killed; the job was not, and its handle stays.
        return OptimizerResult(None, result.duration_ms, "the daemon stopped; the job goes on",
                               detached=True)
    _forget(handle, token)
    return result


def _wait(rec: Handle, handle: Path, *, stage: str, emit: Emit, cancel: threading.Event,
          clock: Callable[[], float]) -> OptimizerResult:
    done = done_path(handle, rec.token)
    emit(f"{stage}.reattached", argv=rec.argv, submitted_at=rec.submitted_at,
         ended=done.exists())
    t0 = time.monotonic()
    while True:
        if (status := _read_status(done)) is not None:
            code, reason = status
            _forget(handle, rec.token)
            return OptimizerResult(code, _ms(t0), reason, reattached=True)
        if not handle.exists():
            # Deleted by hand: give up on that job; the stage is run again.
            return OptimizerResult(None, _ms(t0), "its handle was deleted", reattached=True)
        if clock() >= rec.deadline_at:
            _forget(handle, rec.token)
            return OptimizerResult(None, _ms(t0), "the job submitted before the restart "
                                   "wrote no done marker by its deadline", reattached=True)
        if cancel.wait(POLL_S):
            return OptimizerResult(None, _ms(t0), "the daemon stopped; the job goes on",
                                   detached=True, reattached=True)


def _read_status(done: Path) -> tuple[int | None, str | None] | None:
    """(exit code, failure reason) from the job's done file; None: not there yet."""
    try:
        text = done.read_text("utf-8", errors="replace").strip()
    except FileNotFoundError:
        return None
    except OSError as e:
        return None, f"cannot read {done.name}: {e.strerror}"
    try:
        code = int(text.splitlines()[0])
    except (ValueError, IndexError):
        # Still being written, or not a status: a short wait tells.
        if not text:
            return None
        return None, f"{done.name} holds no exit status: {text[:40]!r}"
    return code, None if code == 0 else f"exit code {code}"


def _forget(handle: Path, token: str) -> None:
    for path in (done_path(handle, token), handle):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _ms(t0: float) -> int:
    return int((time.monotonic() - t0) * 1000)
