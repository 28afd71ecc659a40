"""Atomic file writes: a reader sees the old file or the new one, never half.

Temp file in the same directory (so os.replace is a rename on one
filesystem), fsync of the file, os.replace, fsync of the directory (so the
rename itself survives a power cut). Temp names share one prefix, so the
files a crash left behind are found and removed after a restart, and end in
".tmp", so no reader's `*.md` or `*.json` takes one for a finished file.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
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
    mode = 0o666 & ~_umask()  # mkstemp makes 0600; the umask decides
    try:
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{path.name}.", suffix=".tmp",
                                       dir=path.parent)
            temps.append((tmp, path))
            with os.fdopen(fd, "wb") as f:
                f.write(text.encode("utf-8") if isinstance(text, str) else text)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
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


def _umask() -> int:
    """The process umask, read without setting it (os.umask would change it for
    every thread for an instant)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


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
