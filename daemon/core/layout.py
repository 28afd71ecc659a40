"""Where things live under runs/, and what a path under runs/ means.

    runs/<run>/epoch_EE/step_SS/<work>/scripts/epNN.txt        the writer's episodes
    runs/<run>/loss/epoch_EE/step_SS/<work>_epFF-LL.md         report
    runs/<run>/loss/epoch_EE/step_SS/<work>_epFF-LL_prompt.md  redacted prompt
    runs/<run>/loss/epoch_EE/step_SS/<work>_epFF-LL.json       sidecar
    runs/<run>/loss/.steps/epoch_EE-step_SS.json               step reported / optimizer ran
    runs/.skilltrain/                                          daemon state, lock
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .dataset import episode_number, format_range

EPOCH_DIR = re.compile(r"epoch_(\d+)")
STEP_DIR = re.compile(r"step_(\d+)")
SCRIPTS = "scripts"
SUCCESS_MARKER = "_SUCCESS"
LOSS_DIR = "loss"
STATE_DIR = ".skilltrain"
STATE_FILE = "state.sqlite3"  # in runs/.skilltrain/ unless [paths] state says elsewhere
BATCHES_DIR = ".batches"  # in runs/<run>/loss/: the open provider batches' records
CANCEL_BATCH = "CANCEL_BATCH"  # in runs/<run>/: `skilltrain batch cancel RUN`
STEP_MARKERS = ".steps"  # in runs/<run>/loss/
LOOP_RECORD = "loop.json"  # in runs/<run>/loss/.steps/
RUN_TOML = "run.toml"  # in runs/<run>/: the works a run is scored on
START, PAUSE, RETRY = "START", "PAUSE", "RETRY"  # in runs/<run>/: the user's control files
STEP_MARKER_NAME = re.compile(r"epoch_(\d+)-step_(\d+)\.json")


@dataclass(frozen=True, order=True)
class StepKey:
    run: str
    epoch: int
    step: int

    @property
    def id(self) -> str:
        return f"{self.run}/epoch_{self.epoch:02d}/step_{self.step:02d}"

    def run_dir(self, runs: Path) -> Path:
        return runs / self.run

    def step_dir(self, runs: Path) -> Path:
        return runs / self.run / f"epoch_{self.epoch:02d}" / f"step_{self.step:02d}"

    def reports_dir(self, runs: Path) -> Path:
        return runs / self.run / LOSS_DIR / f"epoch_{self.epoch:02d}" / f"step_{self.step:02d}"

    def marker(self, runs: Path) -> Path:
        """The step's marker: reported, optimizer ran (beside the reports folders,
        not in them: the optimizer reads those)."""
        return markers_dir(runs, self.run) / f"epoch_{self.epoch:02d}-step_{self.step:02d}.json"


def markers_dir(runs: Path, run: str) -> Path:
    """runs/<run>/loss/.steps/: the step markers and the loop's record."""
    return runs / run / LOSS_DIR / STEP_MARKERS


def loop_record(runs: Path, run: str) -> Path:
    """A looped run's durable record (daemon/service/run_record.py)."""
    return markers_dir(runs, run) / LOOP_RECORD


def control_file(runs: Path, run: str, name: str) -> Path:
    """runs/<run>/START, PAUSE or RETRY."""
    return runs / run / name


@dataclass(frozen=True, order=True)
class SetKey:
    """One loss report's worth of work: (run, epoch, step, work, range)."""

    run: str
    epoch: int
    step: int
    work: str
    first: int
    last: int

    # Computed once: a scan of 20,000 sets asks for each of these several
    # times (functools.cached_property takes a lock per access: slower).
    step_key: StepKey = field(init=False, compare=False, repr=False)
    range_label: str = field(init=False, compare=False, repr=False)
    id: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        step_key = StepKey(self.run, self.epoch, self.step)
        range_label = format_range(self.first, self.last)
        object.__setattr__(self, "step_key", step_key)
        object.__setattr__(self, "range_label", range_label)
        object.__setattr__(self, "id", f"{step_key.id}/{self.work}/{range_label}")

    @classmethod
    def parse(cls, set_id: str) -> SetKey | None:
        """The SetKey of an id `run/epoch_EE/step_SS/work/FF-LL`; None for anything else."""
        parts = set_id.split("/")
        if len(parts) != 5:
            return None
        step = parse_step_id("/".join(parts[:3]))
        first, _, last = parts[4].partition("-")
        if step is None or not (first.isdigit() and last.isdigit()):
            return None
        return cls(parts[0], step[0], step[1], parts[3], int(first), int(last))

    def scripts_dir(self, runs: Path) -> Path:
        return Path(self.scripts_folder(runs))

    def scripts_folder(self, runs: Path) -> str:
        """scripts_dir as a plain string, for the scan's hot path."""
        return (f"{runs}/{self.run}/epoch_{self.epoch:02d}/step_{self.step:02d}/"
                f"{self.work}/{SCRIPTS}")

    def report_path(self, runs: Path) -> Path:
        return Path(self.report_file(runs))

    def report_file(self, runs: Path) -> str:
        """report_path as a plain string, for the scan's hot path."""
        return (f"{runs}/{self.run}/{LOSS_DIR}/epoch_{self.epoch:02d}/step_{self.step:02d}/"
                f"{self.work}_ep{self.range_label}.md")

    def log_fields(self) -> dict[str, Any]:
        return {"run": self.run, "epoch": self.epoch, "step": self.step,
                "work": self.work, "range": self.range_label}


def run_of(some_id: str) -> str:
    """The run a step id or a set id names (its first part)."""
    return some_id.split("/", 1)[0]


def step_of(set_id: str) -> str:
    """The step id of a set id `run/epoch_EE/step_SS/work/FF-LL` (its first three parts)."""
    return set_id.rsplit("/", 2)[0]


def default_state_path(runs: Path) -> Path:
    """Where the daemon's state lives unless [paths] state (or SKILLTRAIN_STATE) says."""
    return runs / STATE_DIR / STATE_FILE


def parse_step_id(step_id: str) -> tuple[int, int] | None:
    """(epoch, step) of a step id `run/epoch_EE/step_SS`; None for anything else."""
    parts = step_id.split("/")
    if len(parts) != 3:
        return None
    epoch, step = EPOCH_DIR.fullmatch(parts[1]), STEP_DIR.fullmatch(parts[2])
    if not (epoch and step):
        return None
    return int(epoch.group(1)), int(step.group(1))


@dataclass(frozen=True)
class ScriptsPath:
    """What a path under runs/ says about the writer's output."""

    run: str
    epoch: int
    step: int
    work: str
    episode: int | None  # None: the scripts folder itself, _SUCCESS, or a folder above it


def parse_runs_path(runs: Path, path: Path) -> ScriptsPath | None:
    """Map a path under runs/ to the (run, epoch, step, work) it belongs to.

    Returns None for anything outside the writer's layout (reports, state,
    logs, stray files). A folder above scripts/ (a step or work folder that
    was just created or moved in) maps with work="" or episode=None, so the
    caller can rescan it.
    """
    try:
        parts = path.relative_to(runs).parts
    except ValueError:
        return None
    if len(parts) < 3 or parts[0].startswith(".") or parts[1] == LOSS_DIR:
        return None
    epoch, step = EPOCH_DIR.fullmatch(parts[1]), STEP_DIR.fullmatch(parts[2])
    if not (epoch and step):
        return None
    if (parts[1], parts[2]) != (f"epoch_{int(epoch.group(1)):02d}",
                                f"step_{int(step.group(1)):02d}"):
        return None  # epoch_1, step_001: not ours (the scan says why, once)
    work = parts[3] if len(parts) > 3 else ""
    if len(parts) > 4 and parts[4] != SCRIPTS:
        return None
    episode = episode_number(parts[5]) if len(parts) == 6 else None
    if len(parts) == 6 and episode is None and parts[5] != SUCCESS_MARKER:
        return None  # temp, swap and other stray files in scripts/
    if len(parts) > 6:
        return None
    return ScriptsPath(parts[0], int(epoch.group(1)), int(step.group(1)), work, episode)


_LOSS_FILE = re.compile(r"(.+)_ep(\d{2,})-(\d{2,})(?:_prompt\.md|\.md|\.json)")


def parse_loss_file(runs: Path, path: Path) -> SetKey | None:
    """The set whose report, prompt archive or sidecar `path` is; None otherwise."""
    try:
        parts = path.relative_to(runs).parts
    except ValueError:
        return None
    if len(parts) != 5 or parts[1] != LOSS_DIR:
        return None
    epoch, step = EPOCH_DIR.fullmatch(parts[2]), STEP_DIR.fullmatch(parts[3])
    name = _LOSS_FILE.fullmatch(parts[4])
    if not (epoch and step and name):
        return None
    return SetKey(parts[0], int(epoch.group(1)), int(step.group(1)), name.group(1),
                  int(name.group(2)), int(name.group(3)))


# ------------------------------------------------------------------ folders
# The one symlink policy for the tree's folders: a symlinked run, epoch,
# step or work folder is never followed (discovery names it once as unusable).


def subdir_names(path: Path | str) -> list[str]:
    """The real (not symlinked) folders in `path`, sorted; none if it is unreadable."""
    try:
        with os.scandir(path) as entries:
            return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


def subdirs(path: Path) -> list[Path]:
    """subdir_names as paths."""
    return [path / name for name in subdir_names(path)]


def run_dirs(runs: Path) -> list[Path]:
    """The run folders: real folders in runs/, except the daemon's own (.skilltrain)."""
    return [runs / name for name in subdir_names(runs) if not name.startswith(".")]

