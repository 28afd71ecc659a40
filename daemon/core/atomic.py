"""Atomic file writes: a reader sees the old file or the new one, never half.

Temp file in the same directory (so os.replace is a rename on one
filesystem), fsync of the file, os.replace, fsync of the directory (so the
rename itself survives a power cut). Temp names share one prefix, so the
files a crash left behind are found and removed after a restart, and end in
".tmp", so no reader's `*.md` or `*.json` takes one for a finished file.
"""
from __future__ import annotations

import contextlib
import errno
import os
import random
from collections.abc import Iterator, Mapping
from pathlib import Path

TEMP_PREFIX = ".skilltrain-tmp-"


def write_text(path: Path, text: str) -> None:
    write_all({path: text})


def write_all(files: Mapping[Path, str | bytes]) -> None:
    """Several files, all or none if the write fails, in order if we crash.

    Every temp file is written and synced before any is renamed into place,
    so a full disk leaves none of them, not some. The renames are not one
    atomic step: they happen one after another, in the order of `files`, and
    a crash between two leaves the first ones new and the rest old. So the
    caller puts its commit marker last (the loss handler: the sidecar, whose
    hashes say which inputs the files beside it were made from); until it is
    renamed, the old marker still names the old inputs, so changed inputs are
    seen and the set is redone.
    """
    temps: list[tuple[str, Path]] = []
    try:
        for folder in dict.fromkeys(path.parent for path in files):
            folder.mkdir(parents=True, exist_ok=True)  # once a folder, not once a file
        for path, text in files.items():
            fd, tmp = _create_temp(path)
            temps.append((tmp, path))
            try:
                _write_fully(fd, text.encode("utf-8") if isinstance(text, str) else text)
                os.fsync(fd)
            finally:
                os.close(fd)
    except BaseException:
        for tmp, _ in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise
    done = 0
    try:
        for tmp, path in temps:  # renames within one folder: they do not run out of space
            os.replace(tmp, path)
            done += 1
    except BaseException:
        for tmp, _ in temps[done:]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise
    for directory in {path.parent for _, path in temps}:
        fsync_dir(directory)


# Temp names only have to differ from each other: O_EXCL refuses a taken one
# and the next is tried. A process's own generator, no syscall a name (a
# forked child repeating its parent's names just tries again).
_names = random.Random()
_TRIES = 100


def _create_temp(path: Path) -> tuple[int, str]:
    """A new empty temp file beside `path`, opened for writing, made as `open()`
    makes a file: mode 0666 less the umask, or what the folder's default ACL
    says where it has one (tempfile.mkstemp's 0600 needed a chmod, and the
    umask read from /proc, for every file). The random part is as long as
    mkstemp's: a name that fitted before fits now."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    for _ in range(_TRIES):
        tmp = f"{path.parent}/{TEMP_PREFIX}{path.name}.{_names.getrandbits(32):08x}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temp name beside {path} in {_TRIES} tries")


def _write_fully(fd: int, data: bytes) -> None:
    """All of `data` (os.write may write less than asked: a signal, a pipe)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written == 0:  # not a regular file's answer; an endless loop otherwise
            raise OSError(errno.ENOSPC, f"no byte written of {len(view):,}")
        view = view[written:]


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def leftover_temp_files(root: Path) -> Iterator[Path]:
    """Temp files of interrupted writes anywhere under root."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            if name.startswith(TEMP_PREFIX):
                yield Path(dirpath) / name


def remove_leftover_temp_files(root: Path, older_than: float | None = None) -> int:
    """Delete what crashed writes left behind; returns how many. `older_than`
    (a wall-clock time): only files last written before it, so the writes
    this process has in flight are left alone."""
    removed = 0
    for path in leftover_temp_files(root):
        with contextlib.suppress(FileNotFoundError):
            if older_than is not None and path.stat().st_mtime >= older_than:
                continue
            path.unlink()
            removed += 1
    return removed
