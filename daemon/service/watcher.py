"""Filesystem events as hints: watchdog's observer on runs/.

Events only say "look here soon"; the scan decides. PITFALLS: past
fs.inotify.max_user_watches a recursive watch silently drops events in the
folders it could not watch, and a handler exception kills the dispatch
thread. So the handler never raises, the daemon checks the observer's
threads, and in "auto" mode the kernel's own count of our inotify watches
(/proc/self/fdinfo) is compared with the folders it means to watch: when
watches are missing the watcher falls back to polling.

Natively it watches only where a set can still appear or change: runs/ and
each run and epoch folder (one level each: new runs, epochs, steps,
run.toml), and each open step (a step with a set not yet reported) with
everything below it. A finished history of 100,000 sets needs 310,000
watches, more than a machine allows (fs.inotify.max_user_watches); its
open places need a few hundred (50 runs of 10 epochs: 551). A folder created in a watched one is
watched at once, whole, before its hint is passed on: it is new, so open.
What changes in a reported step (an episode rewritten after its report)
is found by the periodic resync, which looks at every set.
"""
from __future__ import annotations

import errno
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirModifiedEvent,
    DirMovedEvent,
    FileAttribEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver, ObservedWatch
from watchdog.observers.polling import PollingObserver

from ..core import layout

SYSCTL = "fs.inotify.max_user_watches"


def _quiet_double_watch() -> None:
    """watchdog warns when a new folder's watch is added twice (a folder created
    and seen by two events). Harmless; as an error (pytest -W error) it kills
    the emitter thread, and in production it prints a non-JSON line. Said at
    import and again at every start: the filters are the process's, and a
    warnings.catch_warnings() that began before a start (pytest's, around
    every test) takes it away when it ends."""
    warnings.filterwarnings("ignore", message="Callback with id '.*' already exists",
                            category=RuntimeWarning)


_quiet_double_watch()


# Only what can change a set. Asked of the kernel, not filtered afterwards:
# unrequested IN_OPEN/IN_CLOSE_NOWRITE events still fill inotify's queue, and
# on a tree of 60,000 folders every scan (which opens each folder) overflowed
# it; watchdog then re-walks the tree to re-add its watches, which overflows
# it again, for ever (measured: a core at 100% while idle, events lost).
# FileAttribEvent: `touch`, and rsync -t / cp -p setting mtimes after the write.
EVENT_FILTER = [FileCreatedEvent, FileModifiedEvent, FileAttribEvent, FileClosedEvent,
                FileMovedEvent, FileDeletedEvent, DirCreatedEvent, DirMovedEvent,
                DirDeletedEvent]

Hint = Callable[[Path], None]
Report = Callable[..., None]  # report(event_name, **fields)


class _HintHandler(FileSystemEventHandler):
    def __init__(self, hint: Hint, report: Report, rescan: Callable[[], None],
                 new_folder: Callable[[Path], None]) -> None:
        self._hint = hint
        self._report = report
        self._rescan = rescan
        self._new_folder = new_folder

    def on_any_event(self, event: FileSystemEvent) -> None:
        if isinstance(event, DirModifiedEvent):
            return  # a folder's mtime: the polling observer's echo of a change inside it
        try:
            if isinstance(event, DirCreatedEvent | DirMovedEvent):
                # Watched before the hint: what the hint's look misses, the watch sees.
                self._new_folder(Path(os.fsdecode(event.dest_path or event.src_path)))
            self._hint(Path(os.fsdecode(event.src_path)))
            # rsync and editors write a temp file and rename it: the final
            # name arrives only as dest_path of a moved event.
            if isinstance(event, FileMovedEvent | DirMovedEvent) and event.dest_path:
                self._hint(Path(os.fsdecode(event.dest_path)))
        except Exception as e:  # an exception here would kill watchdog's dispatch thread
            # The event is lost with it: a full scan finds what it pointed at.
            self._report("watch.handler_error", level="warning", error=type(e).__name__,
                         path=os.fsdecode(event.src_path))
            try:
                self._rescan()
            except Exception as again:
                self._report("watch.handler_error", level="warning",
                             error=type(again).__name__, path=os.fsdecode(event.src_path))


class Watcher:
    """Owns the observer; can swap native for polling while running."""

    def __init__(self, runs: Path, mode: str, hint: Hint, report: Report,
                 polling_interval_s: float = 1.0, *, rescan: Callable[[], None]) -> None:
        self.runs = runs
        self.mode = mode
        self.kind = ""  # "native" or "polling" once started
        self._handler = _HintHandler(hint, report, rescan, self._watch_new_folder)
        self._report = report
        self._rescan = rescan
        self._polling_interval_s = polling_interval_s
        self._observer: BaseObserver | None = None
        self._deficits = 0
        self._swap = threading.RLock()  # alive() must not see the gap of a swap
        self.root_ino: int | None = None
        self._open_steps: set[Path] = set()  # step folders with a set not yet reported
        self._scheduled: dict[tuple[Path, bool], ObservedWatch] = {}  # (folder, recursive)

    def start(self) -> None:
        _quiet_double_watch()
        self.runs.mkdir(parents=True, exist_ok=True)
        self.root_ino = self.runs.stat().st_ino
        with self._swap:
            self._start_observer()

    def root_replaced(self) -> bool:
        """runs/ itself was deleted (and maybe recreated): its watch is gone."""
        try:
            return self.runs.stat().st_ino != self.root_ino
        except FileNotFoundError:
            return True

    def _start_observer(self) -> None:
        if self.mode == "polling":
            self._start(polling=True)
            return
        try:
            self._start(polling=False)
        except OSError as e:
            if self.mode == "native" or e.errno not in (errno.ENOSPC, errno.EMFILE):
                raise
            self._fallback(f"inotify: {e.strerror}")

    def _start(self, *, polling: bool) -> None:
        observer: BaseObserver = (PollingObserver(timeout=self._polling_interval_s)
                                  if polling else Observer())
        self._scheduled = {}
        if polling:
            # A poll costs a stat per file whatever is watched: the whole tree.
            observer.schedule(self._handler, str(self.runs), recursive=True,
                              event_filter=EVENT_FILTER)
        observer.daemon = True
        observer.start()
        self._observer = observer
        self.kind = "polling" if polling else "native"
        if not polling:
            self._apply(observer)

    def scanned(self, step_dirs: set[Path]) -> None:
        """After a scan: the open steps, which the native watches follow; then
        whether the watches hold (check_coverage)."""
        with self._swap:
            self._open_steps = set(step_dirs)
            if self._observer is not None and self.kind == "native":
                self._apply(self._observer)
        self.check_coverage()

    def _plan(self) -> set[tuple[Path, bool]]:
        """(folder, recursive) for every place where a set can still appear or change."""
        plan = {(self.runs, False)}
        for run in layout.run_dirs(self.runs):  # not the daemon's own state and log
            plan.add((run, False))
            plan.update((e, False) for e in layout.subdirs(run) if e.name.startswith("epoch_"))
        plan.update((step, True) for step in list(self._open_steps) if step.is_dir())
        return plan

    def _apply(self, observer: BaseObserver) -> None:
        plan = self._plan()
        # New watches first: a folder moving from one kind to the other is never unwatched.
        for folder, recursive in sorted(plan - set(self._scheduled)):
            if not self._schedule(observer, folder, recursive):
                return  # fell back to polling: nothing left to plan
        removed = [k for k in list(self._scheduled) if k not in plan and k[0] != self.runs]
        for key in removed:
            watch = self._scheduled.pop(key)
            try:
                observer.unschedule(watch)
            except KeyError:
                pass  # its folder was deleted and watchdog dropped it already
        # Still watched is not still heard: watchdog drops what an unscheduled
        # watch had read and not yet passed on, and the watches that take over
        # did not exist when the kernel reported it (a new run's whole-run
        # watch handing over to its step watches: the `_SUCCESS` or the last
        # episode written meanwhile is lost). A scan, after the new watches, finds it.
        if any(recursive and any(place.is_relative_to(folder) for place, _ in plan)
               for folder, recursive in removed):
            self._rescan()

    def _schedule(self, observer: BaseObserver, folder: Path, recursive: bool) -> bool:
        """Watch `folder`; False when inotify ran out and the watcher fell back to polling."""
        try:
            self._scheduled[(folder, recursive)] = observer.schedule(
                self._handler, str(folder), recursive=recursive, event_filter=EVENT_FILTER)
        except FileNotFoundError:
            pass  # gone again: the resync forgets its sets
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EMFILE) or self.mode == "native":
                raise
            self._fallback(f"inotify: {e.strerror}")
            return False
        return True

    def _watch_new_folder(self, folder: Path) -> None:
        """A run, epoch or step folder created or moved in: watched whole at once."""
        try:
            depth = len(folder.relative_to(self.runs).parts)
        except ValueError:
            return
        if not 1 <= depth <= 3 or folder.name.startswith("."):
            return
        # Not under self._swap: this runs in watchdog's dispatch thread, which
        # holds the observer's lock, and a swap or _apply holds _swap while it
        # waits for that lock. A refused watch is left to the coverage check.
        observer = self._observer
        if (observer is None or self.kind != "native"
                or (folder, True) in self._scheduled or not folder.is_dir()):
            return
        if depth == 3:
            self._open_steps.add(folder)
        try:
            self._scheduled[(folder, True)] = observer.schedule(
                self._handler, str(folder), recursive=True, event_filter=EVENT_FILTER)
        except OSError:
            return  # gone again, or out of watches: the next scan's coverage check

    def _fallback(self, reason: str) -> None:
        with self._swap:
            self._stop_observer()
            self._report("watch.fallback", level="warning", reason=reason, sysctl=SYSCTL,
                         observer="polling",
                         hint=f"raise {SYSCTL} (sysctl -w {SYSCTL}=524288) to use inotify")
            self._start(polling=True)

    def check_coverage(self) -> None:
        """In auto mode, fall back to polling when inotify watches ran out.

        Two checks in a row must find folders missing a watch: a folder
        created a moment ago may simply not be watched yet.
        """
        if self.mode != "auto" or self.kind != "native":
            return
        watches = inotify_watch_count()
        if watches is None:
            return
        with self._swap:
            scheduled = list(self._scheduled)
        # The watches share descriptors where the watched folders overlap.
        folders = len({f for folder, recursive in scheduled
                       for f in (_folders_below(folder) if recursive else [str(folder)])})
        self._deficits = self._deficits + 1 if watches < folders else 0
        if self._deficits >= 2:
            self._fallback(f"inotify watches exhausted: {watches} watches "
                           f"for {folders} folders under {self.runs}")

    def alive(self) -> bool:
        """The observer and each of its emitter threads are running."""
        with self._swap:
            observer = self._observer
            if observer is None or not observer.is_alive():
                return False
            return all(emitter.is_alive() for emitter in observer.emitters)

    def stop(self) -> None:
        with self._swap:
            self._stop_observer()

    def _stop_observer(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            if observer.is_alive():
                observer.join(timeout=5)


def inotify_watch_count() -> int | None:
    """How many inotify watches this process holds, from /proc (None: unknown)."""
    total, found = 0, False
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != "anon_inode:inotify":
                continue
            with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as f:
                total += sum(1 for line in f if line.startswith("inotify wd:"))
            found = True
        except OSError:
            continue
    return total if found else None


def count_folders(root: Path) -> int:
    """Folders a recursive watch needs: root and every real (non-symlink) folder below."""
    return len(_folders_below(root))


def _folders_below(root: Path) -> list[str]:
    found, stack = [], [str(root)]
    while stack:
        folder = stack.pop()
        found.append(folder)
        try:
            with os.scandir(folder) as entries:
                stack.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))
        except OSError:
            continue
    return found

