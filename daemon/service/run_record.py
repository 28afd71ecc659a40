"""The durable record of a looped run: where it is, so a restart goes on from there.

    runs/<run>/loss/.steps/loop.json        {"epoch": 1, "step": 3, "phase": "scoring", ...}
    runs/<run>/START, PAUSE, RETRY          the user's control files

One small JSON file per run, beside the step markers (which already record
"step reported" and "optimizer ran"), written atomically with fsync before
the stage it names is started: whatever moment a SIGKILL hits, the file says
either the stage before or the stage after, never half. The loop
(daemon/service/loop.py) is the only writer; `status` and `skilltrain start` read it.

Phases: writing (the writer of epoch/step has not finished), scoring (it
has; the loss jobs run), optimizing (the step is reported; the optimizer
runs), finished (with the reason a stop rule gave).
"""
from __future__ import annotations

import enum
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core import config, layout
from ..core.errors import ConfigError
from ..guard import sealed_write

START, PAUSE, RETRY = layout.START, layout.PAUSE, layout.RETRY
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class Phase(enum.StrEnum):
    WRITING = "writing"
    SCORING = "scoring"
    OPTIMIZING = "optimizing"
    FINISHED = "finished"


@dataclass
class RunRecord:
    epoch: int = 0
    step: int = 0
    phase: Phase = Phase.WRITING
    writer_failures: int = 0  # failed writer runs of this step (a stop's kill is not one)
    next_writer_at: float | None = None  # wall clock: the retry's backoff
    stalled: str | None = None  # held until runs/<run>/RETRY or a restart
    finished: str | None = None  # the stop rule: max_epochs, stop_below, patience, budget
    updated_at: float = field(default_factory=time.time)

    @property
    def step_key(self) -> tuple[int, int]:
        return self.epoch, self.step


def record_path(runs: Path, run: str) -> Path:
    return layout.loop_record(runs, run)


def read(runs: Path, run: str) -> RunRecord | None:
    """The run's record; None when it has none (or it is unreadable: never ours half-written)."""
    try:
        data = json.loads(record_path(runs, run).read_bytes())
        data["phase"] = Phase(data["phase"])
        return RunRecord(**data)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def write(runs: Path, run: str, rec: RunRecord) -> None:
    rec.updated_at = time.time()
    data = asdict(rec)
    data["phase"] = rec.phase.value
    sealed_write.write_text(record_path(runs, run), json.dumps(data) + "\n")


def describe(rec: RunRecord) -> str:
    """The phase as status shows it: "writing", "finished: patience", "stalled: ..."."""
    if rec.phase == Phase.FINISHED:
        return f"finished: {rec.finished}"
    if rec.stalled:
        return f"{rec.phase.value} (stalled: {rec.stalled})"
    return rec.phase.value


def status_rows(runs: Path) -> list[dict[str, Any]]:
    """One row per looped run, for `skilltrain status`."""
    rows = []
    for run in (p.name for p in layout.run_dirs(runs)):  # never a symlinked run folder
        rec = read(runs, run)
        if rec is None:
            continue
        paused = layout.control_file(runs, run, PAUSE).exists()
        rows.append({"run": run, "phase": rec.phase.value, "epoch": rec.epoch,
                     "step": rec.step, "finished": rec.finished, "stalled": rec.stalled,
                     "paused": paused, "describe": describe(rec), "updated_at": rec.updated_at})
    return rows


def start_main(config_path: Path | None, run: str, out: Any = sys.stdout) -> int:
    """`skilltrain start RUN`: ask the daemon to begin a looped run at epoch 0 step 0.

    It writes runs/RUN/START (and the folder); the daemon, running now or
    started later, sees it within a second and launches the writer.
    """
    cfg = config.load(config_path)
    if cfg.loop is None:
        raise ConfigError("[loop] is not configured in the config file: "
                              "a run cannot advance on its own without it")
    if not RUN_NAME.fullmatch(run) or run == layout.LOSS_DIR:
        raise ConfigError(f"bad run name {run!r}: letters, digits, '.', '_', '-', "
                              "not starting with '.' or '-'")
    runs = cfg.paths.runs
    rec = read(runs, run)
    if rec is not None:
        print(f"{run}: already started ({describe(rec)}, epoch {rec.epoch} step {rec.step})",
              file=out)
        return 1
    run_dir = runs / run
    if any(layout.EPOCH_DIR.fullmatch(p.name) for p in _safe_iterdir(run_dir)):
        print(f"{run}: {run_dir} already has epoch folders; the loop starts fresh runs only",
              file=out)
        return 1
    run_dir.mkdir(parents=True, exist_ok=True)
    sealed_write.write_text(layout.control_file(runs, run, START), "")
    print(f"{run}: requested; the daemon starts the writer for epoch 0 step 0", file=out)
    return 0


def _safe_iterdir(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except OSError:
        return []
