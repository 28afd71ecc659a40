"""The writer stage: run the user's closed-book writer for one step of a looped run.

    [writer] command = ["python", "-m", "my_writer", "--run", "{run_dir}",
                        "--epoch", "{epoch}", "--step", "{step}"]

It is the optimizer's runner (handlers/optimizer.py) with other placeholders
and event names: no shell, the command's own session (a timeout or a stop
kills its whole process group), its output relayed line by line as
`writer.output`. The writer writes
`runs/<run>/epoch_EE/step_SS/<work>/scripts/epNN.txt` (and `_SUCCESS` when
done, or the daemon waits `settle_s`); the daemon picks the episodes up
as it does those of any writer.

The daemon may run the writer of a step twice: when it is killed while the
writer runs (or after the writer exited, before the daemon recorded it), the
restarted daemon runs it again. A writer must be safe to re-run: write each
file atomically (temp file, rename) and produce the step's files again.
With `[writer] outlives_daemon = true` (a writer submitted to a cluster,
docs/scale-out.md) the restarted daemon instead waits for the job the
killed one submitted, through the done marker the job writes.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..daemon.core import layout
from . import detached, optimizer
from .optimizer import Emit, OptimizerResult

SECTION = "writer"
PLACEHOLDERS = ("run", "run_dir", "epoch", "step", "prev_reports_dir")


@dataclass(frozen=True)
class WriterJob:
    """The step to write, and where the step before it was reported (None: the first)."""

    step: layout.StepKey
    previous: layout.StepKey | None

    def values(self, runs: Path) -> dict[str, str]:
        return {
            "run": self.step.run,
            "run_dir": str(self.step.run_dir(runs)),
            # Two digits, as the folders (epoch_EE/step_SS) and the optimizer's.
            "epoch": f"{self.step.epoch:02d}",
            "step": f"{self.step.step:02d}",
            "prev_reports_dir": "" if self.previous is None
            else str(self.previous.reports_dir(runs)),
        }

    def log_fields(self) -> dict[str, Any]:
        return {"run": self.step.run, "epoch": self.step.epoch, "step": self.step.step}


def check_command(command: list[str]) -> None:
    """An unknown placeholder is a config error (exit 2), found at start-up."""
    optimizer.check_command(command, PLACEHOLDERS, section=SECTION)


def run(command: list[str], job: WriterJob, runs: Path, *, timeout_s: float, emit: Emit,
        attempt: int, cancel: threading.Event, outlives_daemon: bool = False) -> OptimizerResult:
    """Run the writer once; `writer.started` and `writer.output` are logged here.

    outlives_daemon: the command's job runs on when the daemon dies; a job an
    earlier daemon submitted is waited for, never submitted again
    (handlers/detached.py).
    """
    argv = optimizer.render_argv(command, job.values(runs), section=SECTION)
    if outlives_daemon:
        return detached.run(argv, handle=detached.handle_path(runs, job.step, SECTION),
                            stage=SECTION, timeout_s=timeout_s, emit=emit, cancel=cancel,
                            started=lambda: emit("writer.started", argv=argv, attempt=attempt))
    emit("writer.started", argv=argv, attempt=attempt)
    return optimizer.run(argv, timeout_s=timeout_s, emit=emit, cancel=cancel,
                         output_event="writer.output")
