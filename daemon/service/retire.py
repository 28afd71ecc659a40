"""A step's reports folder holds the reports of the sets it has now, and no others.

The optimizer is given the folder ({reports_dir}) and reads what is in it.
A set the step no longer has -- its human episode deleted, work.toml's
ranges or `episodes_per_report` changed -- leaves its report, sidecar and
prompt archive behind, and the optimizer would learn from a report of a
range that no longer exists. So before the step is reported, every loss
file of another set is moved out of the folder, to

    runs/.skilltrain/retired/<run>/epoch_EE/step_SS/<its name>[.2, .3, ...]

kept for a person to read (a second retirement of a set never replaces the
first), outside every folder the optimizer is given (its reports folder and
its run's). A file named like a set's but not written by the daemon
(x_ep001-003.md beside x_ep01-03.md) goes the same way, and any link in the
folder is removed (it may point at an answer key: nothing of ours is a
link). A set that comes back with the very inputs its retired report was
made from (the same episodes, key, template and model: the sidecar's hashes)
gets that report back, unpaid (`retired_copies`: its report and sidecar,
written again through the seal by the pipeline with an archive rendered
anew); with other inputs it is reported afresh.

A report still in flight when its set leaves the step (a live call, a
provider batch that answers hours later) must not land after the strays
were moved: `StepFolders` lets a report land only while its set is one its
step has, checked under the gate the retirement holds. Reports land side by
side; a retirement waits for those landing and holds new ones back, and it
moves what the step's sets are at that moment.
"""
from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ..core import atomic, dataset, layout
from ..core.errors import LeftStepError

RETIRED = "retired"  # in runs/.skilltrain/
MAX_RETIRED_BYTES = 16 * 2**20  # a report or sidecar is kilobytes: a larger file is not ours

Emit = Callable[..., None]


class StepFolders:
    """The one gate between a report landing in its step's folder and the
    retirement of the step's strays (a readers-writer lock, retirements first)."""

    def __init__(self, runs: Path, emit: Emit, *,
                 expects: Callable[[layout.SetKey], bool],
                 sets_of_step: Callable[[layout.StepKey], Iterable[layout.SetKey]]) -> None:
        self.runs = runs
        self.emit = emit
        self.expects = expects  # is this set one its step has now?
        self.sets_of_step = sets_of_step
        self._gate = threading.Condition()
        self._landing = 0  # reports being checked and written now
        self._retiring = False
        self._retirements_waiting = 0

    @contextlib.contextmanager
    def landing(self, key: layout.SetKey) -> Iterator[None]:
        """Write the set's report inside this; LeftStepError if the set is not one
        its step has (then nothing may be written)."""
        with self._gate:
            while self._retiring or self._retirements_waiting:
                self._gate.wait()
            self._landing += 1
        try:
            if not self.expects(key):
                raise LeftStepError(f"{key.work} ep{key.range_label} is no longer a set of "
                                    f"{key.run} epoch {key.epoch} step {key.step} (its "
                                    "ranges or works changed during the call): its report "
                                    "is not written")
            yield
        finally:
            with self._gate:
                self._landing -= 1
                if not self._landing:
                    self._gate.notify_all()

    def retire(self, step: layout.StepKey, expected: Iterable[layout.SetKey]) -> bool | None:
        """Move the strays of `step` out, no report landing meanwhile. True: the
        folder holds `expected`'s reports alone; False: a stray could not be
        moved (step.retire_failed); None: the step's sets are no longer
        `expected` (ask again with its sets now)."""
        with self._gate:
            self._retirements_waiting += 1
            try:
                while self._retiring or self._landing:
                    self._gate.wait()
            finally:
                self._retirements_waiting -= 1
            self._retiring = True
        try:
            wanted = set(expected)
            if set(self.sets_of_step(step)) != wanted:
                return None
            return retire_strays(self.runs, step, wanted, self.emit)
        finally:
            with self._gate:
                self._retiring = False
                self._gate.notify_all()


def retired_dir(runs: Path, step: layout.StepKey) -> Path:
    return (runs / layout.STATE_DIR / RETIRED / step.run / f"epoch_{step.epoch:02d}"
            / f"step_{step.step:02d}")


def has_retired(runs: Path, key: layout.SetKey) -> bool:
    """Does the step keep a retired sidecar of this set's name (retired_copies
    may give its report back)? One stat for a step that retired nothing."""
    folder = retired_dir(runs, key.step_key)
    if not folder.is_dir():
        return False
    sidecar_name = f"{key.report_path(runs).stem}.json"
    with contextlib.suppress(OSError):
        return any(_copy_of(name, sidecar_name) for name in os.listdir(folder))
    return False


def retire_strays(runs: Path, step: layout.StepKey, expected: Iterable[layout.SetKey],
                  emit: Emit) -> bool:
    """Move the loss files of sets `step` does not have out of its reports folder
    (one `step.retired` line when any). False if that failed: the optimizer
    would read them, so the step must not be reported (`step.retire_failed`).
    Called by StepFolders.retire alone, under its gate: one retirement at a
    time (the scan's look and a job's end may check one step at once)."""
    try:
        _retire(runs, step, {key.id for key in expected}, emit)
    except OSError as e:
        emit("step.retire_failed", level="error", run=step.run, epoch=step.epoch,
             step=step.step, reason=str(e))
        return False
    return True


def _retire(runs: Path, step: layout.StepKey, wanted: set[str], emit: Emit) -> None:
    reports = step.reports_dir(runs)
    try:
        entries = [e for e in os.scandir(reports) if not e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return
    links = [e.name for e in entries if e.is_symlink()]
    strays = {e.name: key for e in entries
              if not e.is_symlink()
              and (key := layout.parse_loss_file(runs, Path(e.path))) is not None
              and (key.id not in wanted or not _ours(e.name, key))}
    if not strays and not links:
        return
    for name in links:  # not kept under runs/ at all: it may point at an answer key
        os.unlink(reports / name)
    target = retired_dir(runs, step)
    if strays:
        target.mkdir(parents=True, exist_ok=True)
    for name in strays:  # never onto an older retired copy of the same set
        os.replace(reports / name, _free_name(target, name))
    atomic.fsync_dir(reports)  # gone from the folder before the optimizer is started
    emit("step.retired", level="warning", run=step.run, epoch=step.epoch, step=step.step,
         sets=sorted({f"{key.work}_ep{key.range_label}" for key in strays.values()}),
         files=len(strays), links_removed=len(links), to=str(target))


def _ours(name: str, key: layout.SetKey) -> bool:
    """Is `name` one the daemon writes for `key`? x_ep001-003.md parses as set
    01-03 too, but only a hand (or another program) made it: the optimizer
    would read it beside the set's own report."""
    return name in {f"{key.work}_ep{key.range_label}{suffix}"
                    for suffix in (".md", "_prompt.md", ".json")}


def _free_name(folder: Path, name: str) -> Path:
    """`name` in `folder`, or name.2, name.3, ... if a set was retired there before."""
    path, k = folder / name, 1
    while os.path.lexists(path):
        k += 1
        path = folder / f"{name}.{k}"
    return path


def retired_copies(runs: Path, key: layout.SetKey, report: Path, inputs: dict[str, str]
                   ) -> Iterator[tuple[list[Path], str, str, dict[str, Any]]]:
    """Every retired report of `key` made from exactly `inputs`: its retired
    files (report, sidecar), its text, its sidecar's and what it says. A sidecar is matched by
    its input hashes, and its report by the hash the sidecar names, whatever
    copy number each was given (each file's is its own: a retirement may have
    found some of the three names taken, or a crash may have left one alone)."""
    folder = retired_dir(runs, key.step_key)
    sidecar_name = f"{report.stem}.json"
    try:
        names = os.listdir(folder)
    except OSError:
        return
    reports = [folder / n for n in names if _copy_of(n, report.name)]
    for name in names:
        if not _copy_of(name, sidecar_name) or (sidecar := _regular_text(folder / name)) is None:
            continue
        try:
            data = json.loads(sidecar)
        except (ValueError, RecursionError):
            continue  # not a sidecar of ours
        if not isinstance(data, dict) or data.get("inputs") != inputs:
            continue
        for path in reports:
            text = _regular_text(path)
            if text is not None and dataset.sha256_text(text) == data.get("report_sha256"):
                yield [path, folder / name], text, sidecar, data
                break


def _copy_of(name: str, original: str) -> bool:
    """`name` is `original` or a later retirement's copy of it (original.2, .3, ...)."""
    return name == original or (name.startswith(original + ".")
                                and name[len(original) + 1:].isdigit())


def _regular_text(path: Path) -> str | None:
    """A regular file's UTF-8 text, not followed through a link, no larger than
    any file of ours (None: not that)."""
    def regular(fd: int) -> None:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")

    try:
        data = dataset.read_bytes(path, 1 << 16, MAX_RETIRED_BYTES, opened=regular)
        return None if data is None else data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
