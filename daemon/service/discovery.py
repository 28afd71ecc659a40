"""What runs/ holds: step folders, the sets each is expected to have, and the
paths that cannot be used.

    runs/<run>/epoch_EE/step_SS/<work>/   one set per episode range of <work>
                                          (data/ lists the works, run.toml may narrow them)

A path that cannot be used (a misnumbered folder, a symlink, an unknown work)
is named once in the log, not at every scan, and kept in the state for
`skilltrain status` while a whole scan still notices it.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

from ..core import config, dataset, layout, run_toml
from ..core.errors import ConfigError, RefusedError
from ..core.short_memo import ShortStringMemo
from ..guard import leakguard
from ..infra.state import StateStore

Emit = Callable[..., None]


class Discovery:
    """Step folders and their expected sets, read from the tree as it is now."""

    def __init__(self, cfg: config.Config, state: StateStore, emit: Emit) -> None:
        self.cfg = cfg
        self.runs = cfg.paths.runs
        self.state = state
        self.emit = emit
        self.works: dict[str, dataset.Work] = {}  # data/<work>/human/: at start, then on change
        self._data_signature: tuple[tuple[str, int], ...] | None = None
        self._named: set[str] = set()  # "<path>: <reason>" already logged
        self._noticed_this_scan: set[str] = set()
        # run -> (its run.toml's stat signature, what it says): read once per change
        self._run_tomls: dict[str, tuple[tuple[int, int, int], run_toml.RunToml]] = {}

    def load_works(self) -> None:
        """Read data/ at start (a bad work.toml is a ConfigError: exit 2)."""
        self._data_signature = _data_signature(self.cfg.paths.data)
        self.works = dataset.discover_works(self.cfg.paths.data)
        if not self.works:
            self.emit("daemon.no_works", level="warning", data_dir=str(self.cfg.paths.data))

    def refresh_works(self) -> bool:
        """Read data/ again if its works changed (one scandir and a stat per
        work when not); True when the works changed. A work added while the
        daemon runs is then scored without a restart, as its key is guarded
        (leakguard_live). A work.toml gone bad keeps the works as they were."""
        signature = _data_signature(self.cfg.paths.data)
        if signature == self._data_signature:
            return False
        try:
            works = dataset.discover_works(self.cfg.paths.data)
        except ConfigError as e:
            self.ignore(self.cfg.paths.data, f"data/ not re-read: {e}", event="works.unreadable")
            return False
        if works.keys() == self.works.keys() and all(
                works[n].explicit_ranges == self.works[n].explicit_ranges
                and works[n].title == self.works[n].title for n in works):
            self._data_signature = signature
            return False
        added = sorted(works.keys() - self.works.keys())
        self.works = works
        self._data_signature = signature  # after the works: a reader never sees it first
        self.emit("works.reloaded", works=len(works), added=added)
        return True

    # ------------------------------------------------------------------ a scan
    def begin_scan(self) -> None:
        self._noticed_this_scan = set()

    def end_scan(self) -> None:
        """A path under runs/ not noticed again by a whole scan is fixed (or gone)."""
        runs = f"{self.runs}/"
        noticed = self._noticed_this_scan
        self.state.keep_notices(lambda path: path in noticed or not path.startswith(runs))

    def steps(self) -> Iterator[tuple[layout.StepKey, list[layout.SetKey]]]:
        """Every step folder under runs/ with the sets it is expected to have."""
        self.refresh_works()
        self._report_linked_folders(self.runs)
        for run in layout.run_dirs(self.runs):
            if self._quotes_the_key(run.name):
                continue
            works = self.expected_works(run.name)
            self._report_linked_folders(run)
            for epoch_dir in layout.subdirs(run):
                epoch = layout.EPOCH_DIR.fullmatch(epoch_dir.name)
                if epoch is None or epoch_dir.name != f"epoch_{int(epoch.group(1)):02d}":
                    if epoch_dir.name != layout.LOSS_DIR:
                        self.ignore(epoch_dir, _misnumbered(epoch_dir.name, "epoch"))
                    continue
                self._report_linked_folders(epoch_dir)
                for step_dir in layout.subdirs(epoch_dir):
                    step = layout.STEP_DIR.fullmatch(step_dir.name)
                    if step is None or step_dir.name != f"step_{int(step.group(1)):02d}":
                        self.ignore(step_dir, _misnumbered(step_dir.name, "step"))
                        continue
                    step_key = layout.StepKey(run.name, int(epoch.group(1)), int(step.group(1)))
                    yield step_key, list(self.sets_of_step(step_key, works))

    def sets_of_step(self, step: layout.StepKey,
                     works: list[dataset.Work] | None = None) -> Iterator[layout.SetKey]:
        if self._quotes_the_key(step.run):
            return
        step_dir = step.step_dir(self.runs)
        names = layout.subdir_names(step_dir)
        if any(name not in self.works for name in names) and self.refresh_works():
            works = None  # the run's works as data/ holds them now
        works = works if works is not None else self.expected_works(step.run)
        for name in names:
            if name not in self.works:
                self.ignore(step_dir / name, "unknown work (no data/<work>/human/)")
            elif all(work.name != name for work in works):
                self.ignore(step_dir / name, f"work not listed in {step.run}/run.toml")
        for work in works:
            for first, last in work.ranges(self.cfg.loss.episodes_per_report):
                yield layout.SetKey(step.run, step.epoch, step.step, work.name, first, last)

    def expects(self, key: layout.SetKey) -> bool:
        """Is `key` one of the sets its step has now (sets_of_step, for one work)?"""
        if self._quotes_the_key(key.run):
            return False
        if key.work not in self.works:
            self.refresh_works()  # a work added since data/ was read
        # By name, from one reading of the works: another thread may read data/
        # again meanwhile and replace every Work object.
        works = {w.name: w for w in self.expected_works(key.run)}
        work = works.get(key.work)
        return work is not None and (key.first, key.last) in work.ranges(
            self.cfg.loss.episodes_per_report)

    def run_settings(self, run: str) -> run_toml.RunToml:
        """runs/<run>/run.toml, each of its problems named once (and shown by status).

        Asked for every job (its works, its mode): parsed again only when the
        file changed (inode, size, mtime), a stat otherwise.
        """
        path = run_toml.path_of(self.runs, run)
        try:
            st = path.stat()
            signature: tuple[int, int, int] | None = (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            self._run_tomls.pop(run, None)
            return run_toml.RunToml()  # no file, no setting (run_toml.read says the same)
        except OSError:
            signature = None  # unreadable: run_toml.read names the problem
        cached = self._run_tomls.get(run)
        if cached is not None and cached[0] == signature:
            settings = cached[1]
        else:
            settings = _held(run_toml.read(path), cached[1] if cached else None,
                             empty=signature is not None and signature[1] == 0)
            if signature is not None:
                self._run_tomls[run] = (signature, settings)
        for problem in settings.problems:
            self.ignore(path, problem)
        return settings

    def llm_settings(self, run: str) -> config.LLMConfig:
        """[llm] for the run's live calls: config.toml's at the service_tier its
        run.toml names, if it names one (run_settings reads it once per change)."""
        tier = self.run_settings(run).service_tier
        return self.cfg.llm if tier is None else self.cfg.llm.with_tier(tier)

    def expected_works(self, run: str) -> list[dataset.Work]:
        """All works in data/, or the subset runs/<run>/run.toml lists."""
        names = self.run_settings(run).works
        if names is None:
            return list(self.works.values())
        for name in names:
            if name not in self.works:
                self.ignore(run_toml.path_of(self.runs, run), f"lists unknown work {name!r}")
        return [self.works[n] for n in names if n in self.works]

    # ---------------------------------------------------------- unusable paths
    def _quotes_the_key(self, run: str) -> bool:
        if not quotes_the_key(run):
            return False
        self.ignore(self.runs / run, "the folder name quotes the answer key; not scored "
                    "(rename the run)", event="set.unusable")
        return True

    def ignore(self, path: Path, reason: str, event: str = "set.ignored") -> bool:
        """Log a path we cannot use once, not at every scan. True when logged now."""
        # For status, while it lasts (under the key the state keeps it by).
        self._noticed_this_scan.add(self.state.notice(str(path), event, reason))
        if f"{path}: {reason}" in self._named:
            return False
        self._named.add(f"{path}: {reason}")
        self.emit(event, level="warning", path=str(path), reason=reason)
        return True

    def _report_linked_folders(self, parent: Path) -> None:
        """Run, epoch and step folders that are symlinks are not followed (work
        and scripts/ folders: see observe); each is named once, with why."""
        for name in _symlinked_subdirs(parent):
            link = parent / name
            try:
                dataset.confine(str(link), self.runs, answer_key=self.cfg.paths.data)
                reason = "a symlinked folder; not followed (copy or move it into runs/)"
            except (RefusedError, OSError) as e:
                reason = str(e) if isinstance(e, RefusedError) else f"unreadable link ({e})"
            self.ignore(link, reason, event="set.unusable")

    def check_human_ranges(self) -> None:
        """A range with a hole in the answer key can never be reported: say so at start."""
        for work in self.works.values():
            present = set(work.human_episodes())
            for first, last in work.ranges(self.cfg.loss.episodes_per_report):
                missing = [n for n in range(first, last + 1) if n not in present]
                if missing:
                    names = ", ".join(dataset.episode_name(n) for n in missing)
                    self.ignore(work.human_dir, f"range {dataset.format_range(first, last)} "
                                f"can never be reported: human {names} missing",
                                event="work.range_incomplete")


def _held(read: run_toml.RunToml, last: run_toml.RunToml | None, *,
          empty: bool) -> run_toml.RunToml:
    """What a run.toml says now. Empty or not TOML after a reading that was, it
    is most likely being written (an editor truncates first): the last settings
    hold, so a run does not widen to every work for a moment and let a set it
    left land a report in its step. Deleting the file means every work."""
    if last is None or last.unreadable or not (empty or read.unreadable):
        return read
    return run_toml.RunToml(last.works, last.llm_mode, last.service_tier, problems=(
        "run.toml is empty or not TOML; keeping its last readable settings (delete the "
        "file for every work and config.toml's [llm])",))


def _data_signature(data: Path) -> tuple[tuple[str, int], ...]:
    """data/'s work folders with their human/ and work.toml mtimes (0: absent)."""
    found = []
    try:
        entries = sorted(os.scandir(data), key=lambda e: e.name)
    except OSError:
        return ()
    for entry in entries:
        mtimes = []
        for name in ("human", "work.toml"):
            try:
                mtimes.append(os.stat(os.path.join(entry.path, name)).st_mtime_ns)
            except OSError:
                mtimes.append(0)
        if mtimes[0]:
            found.append((entry.name, mtimes[0] ^ mtimes[1]))
    return tuple(found)


def quotes_the_key(run: str) -> bool:
    """A run folder named with a line of the answer key is not scored (nor
    looped): its name would be in every report path, state row and log line.
    Asked several times a job (its step's sets, its landing): each name's
    answer is kept while the installed keys are the same."""
    keys = leakguard.installed()
    return keys is not None and _quoting.get(run, keys, _leak_or_empty) != ""


def _leak_or_empty(run: str, keys: leakguard.AnswerKeys) -> str:
    return "leaks" if keys.leaks(run) else ""


_quoting = ShortStringMemo(max_chars=255, max_entries=1024)  # a folder name: 255 at most


def usable_runs(runs: Path) -> list[str]:
    """The runs every part works on: real folders (layout.run_dirs) whose name
    does not quote the answer key."""
    return [run.name for run in layout.run_dirs(runs) if not quotes_the_key(run.name)]


def _entries(path: Path) -> list[os.DirEntry[str]]:
    try:
        entries = os.scandir(path)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    with entries:
        return list(entries)


def _symlinked_subdirs(path: Path) -> list[str]:
    """Names of the symlinks in `path` that lead to a folder (or nowhere)."""
    return sorted(e.name for e in _entries(path)
                  if e.is_symlink() and not e.name.startswith(".")
                  and (e.is_dir() or not os.path.exists(e.path)))


def _misnumbered(name: str, kind: str) -> str:
    """Why a folder is not an epoch/step folder, with the name that would be."""
    match = (layout.EPOCH_DIR if kind == "epoch" else layout.STEP_DIR).fullmatch(name)
    article = "an" if kind == "epoch" else "a"
    if match is None:
        return f"not {article} {kind}_NN folder"
    return (f"not {article} {kind}_NN folder: numbers have two or more digits, zero-padded "
            f"(expected {kind}_{int(match.group(1)):02d})")
