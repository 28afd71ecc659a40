"""A step's reports folder holds the reports of the sets it has now, and no others.

The optimizer is given the folder ({reports_dir}) and reads what is in it.
A set the step no longer has -- its human episode deleted, work.toml's
ranges or `episodes_per_report` changed -- leaves its report, sidecar and
prompt archive behind, and the optimizer would learn from a report of a
range that no longer exists. So before the step is reported, every loss
file of another set is moved out of the folder, to

    runs/<run>/loss/.retired/epoch_EE/step_SS/<its name>[.2, .3, ...]

kept for a person to read (a second retirement of a set never replaces the
first), never in a folder the optimizer is given. A set that comes back is
reported afresh: its report is paid for again (its old one is not moved
back: bench/RESULTS.md lists it as a follow-up).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from ..core import atomic, layout

RETIRED = ".retired"  # in runs/<run>/loss/

Emit = Callable[..., None]
_one_at_a_time = threading.Lock()


def retired_dir(runs: Path, step: layout.StepKey) -> Path:
    return (runs / step.run / layout.LOSS_DIR / RETIRED / f"epoch_{step.epoch:02d}"
            / f"step_{step.step:02d}")


def retire_strays(runs: Path, step: layout.StepKey, expected: Iterable[layout.SetKey],
                  emit: Emit) -> bool:
    """Move the loss files of sets `step` does not have out of its reports folder
    (one `step.retired` line when any). False if that failed: the optimizer
    would read them, so the step must not be reported (`step.retire_failed`)."""
    try:
        with _one_at_a_time:  # the scan's look and a job's end may check one step at once
            _retire(runs, step, {key.id for key in expected}, emit)
    except OSError as e:
        emit("step.retire_failed", level="error", run=step.run, epoch=step.epoch,
             step=step.step, reason=str(e))
        return False
    return True


def _retire(runs: Path, step: layout.StepKey, wanted: set[str], emit: Emit) -> None:
    reports = step.reports_dir(runs)
    try:
        entries = [e for e in os.scandir(reports) if e.is_file(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return
    strays = {e.name: key for e in entries
              if (key := layout.parse_loss_file(runs, Path(e.path))) is not None
              and key.id not in wanted}
    if not strays:
        return
    target = retired_dir(runs, step)
    target.mkdir(parents=True, exist_ok=True)
    for name in strays:  # never onto an older retired copy of the same set
        os.replace(reports / name, _free_name(target, name))
    atomic.fsync_dir(reports)  # gone from the folder before the optimizer is started
    emit("step.retired", level="warning", run=step.run, epoch=step.epoch, step=step.step,
         sets=sorted({f"{key.work}_ep{key.range_label}" for key in strays.values()}),
         files=len(strays), to=str(target))


def _free_name(folder: Path, name: str) -> Path:
    """`name` in `folder`, or name.2, name.3, ... if a set was retired there before."""
    path, k = folder / name, 1
    while os.path.lexists(path):
        k += 1
        path = folder / f"{name}.{k}"
    return path
