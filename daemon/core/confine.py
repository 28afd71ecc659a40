"""The one symlink rule for what the daemon reads under runs/: a link is
followed only while it stays inside runs/ and out of the answer key.

It holds for episodes, scripts/ folders, work and run folders, and for what
was actually opened: a path is checked, then opened, and what the kernel
opened is confined again (/proc's name for the descriptor), so a link
flipped between the check and the open is not read through.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

from .errors import RefusedError


def confine(path: str, root: Path | None, *, answer_key: Path | None = None,
            label: str = "") -> str:
    """The real path of `path`, which must lie inside `root` and outside `answer_key`.

    The one symlink rule for episodes, scripts/ folders, work and run folders:
    a link is followed only while it stays inside `root` (runs/) and out of
    the answer key. Raises RefusedError naming the link (not just the file
    reached through it) and why: out of the root, into the answer key, a
    loop, or a dangling target. FileNotFoundError when `path` itself is absent.
    """
    os.lstat(path)  # absent: FileNotFoundError for the caller ("missing")
    prefix = f"{label} " if label else ""
    try:
        real = os.path.realpath(path, strict=True)
    except OSError as e:
        link = _first_link(path, root)
        if e.errno == errno.ELOOP:
            raise RefusedError(f"{prefix}{link} is a symlink loop; not followed") from None
        if isinstance(e, FileNotFoundError):
            target = os.readlink(link) if os.path.islink(link) else "?"
            raise RefusedError(f"{prefix}{link} is a dangling symlink (its target {target} "
                               "does not exist)") from None
        raise
    broken = broken_rule(real, root, answer_key)
    if broken == "answer key":
        raise RefusedError(f"{prefix}{_first_link(path, root)} leads into the answer key "
                           f"({real}); not followed")
    if broken == "root" and root is not None:
        raise RefusedError(f"{prefix}{_first_link(path, root)} is a symlink out of "
                           f"{root.name}/; not followed")
    return real


def confine_opened(fd: int, path: Path, label: str, root: Path | None,
                    answer_key: Path | None, st: os.stat_result) -> None:
    """A link is confined by its path and then opened by it: a link or folder
    swapped in between (a writer flipping it to another work's key) would be
    read. So what was opened is confined again, by /proc's name for it; where
    /proc cannot say, it must be the very file confined (device and inode)."""
    try:
        if broken_rule(os.readlink(f"/proc/self/fd/{fd}"), root, answer_key) is None:
            return
    except OSError:
        got = os.fstat(fd)
        if (got.st_dev, got.st_ino) == (st.st_dev, st.st_ino):
            return
    raise RefusedError(f"{label} {path} is a symlink that changed while it was read; "
                       "not followed")


def broken_rule(real: str, root: Path | None, answer_key: Path | None) -> str | None:
    """The symlink rule for a real path, in one place: "answer key" if it lies in
    the answer key, "root" if out of `root`, None if it may be read."""
    if answer_key is not None and _is_within(real, os.path.realpath(answer_key)):
        return "answer key"
    if root is not None and not _is_within(real, os.path.realpath(root)):
        return "root"
    return None


def _is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _first_link(path: str, root: Path | None) -> str:
    """The first symlink on the way from `root` down to `path` (path itself if none)."""
    start = str(root) if root is not None and _is_within(path, str(root)) else os.path.dirname(path)
    current = start
    for part in os.path.relpath(path, start).split(os.sep):
        current = os.path.join(current, part)
        if os.path.islink(current):
            return current
    return path


def open_confined(directory: Path, root: Path, answer_key: Path | None,
                   label: str) -> int | None:
    """`directory` opened once for a range, and what the kernel opened confined:
    its episodes are looked up in it, so a folder swapped for a link to the
    answer key after the check is not read through. Only a refusal walks the
    path (a dozen lstats), to name the link (the first below `root`). None
    where /proc cannot say what was opened: each file is confined then."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        fd = -1  # absent, a dangling link, a loop, not a folder: confine says which
    if fd >= 0:
        inside = False
        try:
            inside = broken_rule(os.readlink(f"/proc/self/fd/{fd}"), root, answer_key) is None
        except OSError:
            pass
        finally:
            if not inside:
                os.close(fd)
        if inside:
            return fd
    real = confine(str(directory), root, answer_key=answer_key, label=label)
    fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
        if opened != real:  # moved between the check and the open
            confine(opened, root, answer_key=answer_key, label=label)
    except OSError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd
