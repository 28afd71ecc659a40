"""The daemon's answer keys, kept current while it runs.

Log lines, provider error messages and state reasons are checked against
every work's answer key (leakguard.AnswerKeys). Built once at start, those
indexes would miss a human episode edited or added later: the reports
(whose job reads the key afresh) would be guarded at once, the log only
after a restart. So the keys are rebuilt when data/ changes.

How a change is seen cheaply: the signature of data/ is the list of work
folders with a human/ folder and, per episode file, its size, mtime, ctime
and inode (one scandir per folder and one stat per file: about 2 us a file).
It is taken at most every CHECK_EVERY_S, by whichever thread asks for the
keys then, and at once when a loss job has read a key the installed indexes
do not hold (`leakguard.keep_current`). Only works whose text changed are
indexed again (leakguard.index_for caches by content).

A file changed less than dataset.RACY_MTIME_NS ago may change again within
the clock's tick with the same size and mtime: its signature is not trusted
yet, and the next checks re-read the text until it is older (as git treats
"racily clean" files).
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..core import dataset
from . import leakguard

CHECK_EVERY_S = 0.5

Signature = tuple[tuple[str, int, int, int, int], ...]


class LiveAnswerKeys:
    """Every work's index under data/, rebuilt when its files change.

    `on_change(works, episodes)` is called after a rebuild that changed the
    keys (outside the lock: it may log, and logging asks for the keys).
    """

    def __init__(self, data_root: Path, *, every_s: float = CHECK_EVERY_S,
                 clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[int, int], None] | None = None) -> None:
        self.data_root = data_root
        self.every_s = every_s
        self._clock = clock
        self.on_change = on_change
        self._lock = threading.Lock()
        self._keys = leakguard.AnswerKeys(())
        self._signature: Signature | None = None
        self._checked_at: float | None = None

    def current(self) -> leakguard.AnswerKeys:
        """The keys, looked at again if CHECK_EVERY_S has passed since the last look."""
        checked = self._checked_at
        if checked is None or self._clock() - checked >= self.every_s:
            self.check()
        return self._keys

    def holds(self, index: leakguard.HumanIndex) -> bool:
        return any(mine.digest == index.digest for mine in self._keys.indexes)

    def check(self) -> bool:
        """Look at data/ now; rebuild if it changed. True when the keys changed."""
        with self._lock:
            self._checked_at = self._clock()
            signature, racy = _signature(self.data_root)
            if signature == self._signature:
                return False
            works = _read_works(self.data_root)
            indexes = tuple(leakguard.index_for(name, episodes)
                            for name, episodes in sorted(works.items()))
            # Not trusted while a file may still change unseen: read again next time.
            self._signature = None if racy else signature
            if tuple(map(id, indexes)) == tuple(map(id, self._keys.indexes)):
                return False  # same text: keep the object (the log caches by it)
            self._keys = leakguard.AnswerKeys(indexes)
        if self.on_change is not None:
            self.on_change(len(indexes), sum(len(e) for e in works.values()))
        return True


def install(data_root: Path,
            on_change: Callable[[int, int], None] | None = None) -> LiveAnswerKeys:
    """Every work under data_root guarded from now on (leakguard.install): log
    lines and error reasons, and each job's check against the other works'
    keys (job_keys.other_works). Built now; the first build is no change."""
    keys = LiveAnswerKeys(data_root)
    keys.check()
    if on_change is not None:
        keys.on_change = on_change
    leakguard.install(keys)
    return keys


def _signature(data_root: Path) -> tuple[Signature, bool]:
    """What data/'s answer keys look like on disk, and whether a file is too new to trust."""
    entries: list[tuple[str, int, int, int, int]] = []
    newest = 0
    try:
        works = sorted(os.scandir(data_root), key=lambda e: e.name)
    except OSError:
        return (), False
    for work in works:
        human = os.path.join(work.path, "human")
        try:
            files = sorted(os.scandir(human), key=lambda e: e.name)
        except OSError:
            continue  # not a work (no human/), or unreadable: read_all_human skips it too
        for entry in files:
            if dataset.episode_number(entry.name) is None:
                continue
            try:
                st = os.stat(entry.path)  # through a link: the text it reaches
            except OSError:
                continue
            entries.append((f"{work.name}/{entry.name}", st.st_size, st.st_mtime_ns,
                            st.st_ctime_ns, st.st_ino))
            newest = max(newest, st.st_mtime_ns, st.st_ctime_ns)
    return tuple(entries), dataset.racily_clean(newest)


def _read_works(data_root: Path) -> dict[str, dict[int, str]]:
    """Every work folder's answer key, read as the jobs read it (Work.read_all_human:
    every episode file, two of one number both kept)."""
    works: dict[str, dict[int, str]] = {}
    try:
        folders = sorted(os.scandir(data_root), key=lambda e: e.name)
    except OSError:
        return works
    for folder in folders:
        work = dataset.Work(name=folder.name, root=Path(folder.path), title=folder.name,
                            explicit_ranges=None)
        if episodes := work.read_all_human():
            works[folder.name] = episodes
    return works
