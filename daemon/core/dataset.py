"""Works and episodes: data/<work>/human/epNN.txt and the writer's scripts/.

Reading is strict on purpose. An episode that is missing, empty, not UTF-8,
not a regular file, or a symlink out of its allowed root is refused with a
reason that names the file; the seed skipped such files silently and so
compared a screenplay against a hole. Refusal messages name paths and
numbers only, never file contents.
"""
from __future__ import annotations

import errno
import functools
import hashlib
import os
import re
import stat
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .confine import confine, confine_opened, open_confined
from .errors import ConfigError, RefusedError

# Exactly `ep` + two or more digits + `.txt`; rsync temp files (.ep01.txt.XYZ),
# ep01.txt.tmp and editor swap files do not match.
EPISODE_NAME = re.compile(r"ep(\d{2,})\.txt")


def episode_number(name: str) -> int | None:
    match = EPISODE_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def episode_name(n: int) -> str:
    return f"ep{n:02d}.txt"


def format_range(first: int, last: int) -> str:
    return f"{first:02d}-{last:02d}"


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def episodes_digest(episodes: Mapping[int, str]) -> str:
    """One hash over a range of episodes, sensitive to numbering and content."""
    return _range_digest({n: sha256_text(text) for n, text in episodes.items()})


def files_digest(paths: Mapping[int, str], max_bytes: int | None = None) -> str | None:
    """`episodes_digest` of the files' bytes, without decoding or checking them;
    None when one cannot be read, or holds over `max_bytes` (a link to a
    device that never ends).

    Equal to the digest of the episodes read as text exactly when the bytes
    are those of the text (UTF-8 round-trips), so it answers "are these the
    inputs a report was made from?" at the cost of the hashing alone: a cold
    start asks it for every set. Nothing read here leaves the process.
    """
    hashes = {}
    for n, path in paths.items():
        try:  # non-blocking: a FIFO swapped in since it was looked at reads as empty
            data = read_bytes(Path(path), 0, max_bytes, nofollow=False, opened=_regular_only)
        except OSError:
            return None
        if data is None:
            return None
        hashes[n] = hashlib.sha256(data or b"").hexdigest()
    return _range_digest(hashes)


def _regular_only(fd: int) -> None:
    """A link may have been swapped in: read a regular file's bytes, nothing else
    (a device read never ends, a FIFO never answers)."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise OSError(errno.EINVAL, "not a regular file")


def _range_digest(hashes: Mapping[int, str]) -> str:
    """The one way a range's per-episode hashes become its digest (both above use it)."""
    h = hashlib.sha256()
    for n in sorted(hashes):
        h.update(f"{n}:{hashes[n]}\n".encode())
    return h.hexdigest()


def read_episode(path: Path, *, label: str, confine_to: Path | None = None,
                 answer_key: Path | None = None, max_bytes: int | None = None,
                 folder_fd: int | None = None, stated: Stated | None = None) -> str:
    """Read one episode or raise RefusedError saying which file and why.

    `confine_to`: the file's real path must stay inside this directory (a
    symlink anywhere on the way may only lead within it); None: the file
    itself must not be a symlink. `answer_key`: the real path must not lie
    in this directory (data/: a writer's link to the answer key).
    `max_bytes`: refuse a larger file before reading it into memory.
    `folder_fd`: path's folder, opened and confined by the caller (read_range,
    once for the range): the file is looked up in it, and only a link at the
    file itself is confined by path. `stated`: its _stat_confined, taken by the caller.
    """
    try:
        return _read_episode(path, label, confine_to, answer_key, max_bytes, folder_fd, stated)
    except FileNotFoundError:
        raise RefusedError(f"{label} {path.name} is missing in {path.parent}") from None
    except (OSError, RuntimeError) as e:  # permissions, a file gone mid-read
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise RefusedError(f"{label} {path} cannot be read ({reason})") from None


def _read_episode(path: Path, label: str, confine_to: Path | None, answer_key: Path | None,
                  max_bytes: int | None, folder_fd: int | None, stated: Stated | None) -> str:
    st, link = stated or _stat_confined(path, label, confine_to, answer_key, folder_fd)
    if not stat.S_ISREG(st.st_mode):
        raise RefusedError(f"{label} {path} is not a regular file")
    if st.st_size == 0:
        raise RefusedError(f"{label} {path} is empty (0 bytes)")
    if max_bytes is not None and st.st_size > max_bytes:
        raise RefusedError(f"{label} {path} is {st.st_size:,} bytes, over the "
                           f"{max_bytes:,}-byte limit the model's context window allows")
    # The answer key's own files (no confinement asked: data/, the operator's)
    # are read again for every set of every step: kept while their identity
    # holds. A writer's scripts are read afresh every time. A write through a
    # shared mmap moves no time: the check after a call reads the disk
    # (loss.check_unchanged), and a change it finds drops what was kept.
    keep = confine_to is None and answer_key is None
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if keep and (kept := _kept_text.get(path)) is not None and kept[0] == identity:
        return kept[1]
    # A link is confined, and followed, by its path; a plain file is opened in
    # the checked folder.
    data = read_bytes(path, st.st_size, max_bytes, nofollow=not link,
                       folder_fd=None if link else folder_fd,
                       opened=(lambda fd: confine_opened(fd, path, label, confine_to,
                                                          answer_key, st)) if link else None)
    if data is None:
        raise RefusedError(f"{label} {path} grew over the {max_bytes:,}-byte limit the "
                           "model's context window allows while it was read")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RefusedError(f"{label} {path} is not valid UTF-8 (byte {e.start})") from None
    if problem := control_characters(text):
        raise RefusedError(f"{label} {path} is not a screenplay: {problem}")
    if not has_words(text):
        raise RefusedError(f"{label} {path} is empty (no letter or digit: whitespace or "
                           "invisible characters only)")
    if (keep and len(data) == st.st_size
            and not racily_clean(max(st.st_mtime_ns, st.st_ctime_ns))):
        _keep_text(path, identity, text)
    return text


# Episode path -> (its identity when read, the text it had): the answer key's
# episodes, see _read_episode. Bounded by characters, emptied when full.
_KEPT_MAX_CHARS = 64_000_000
_kept_text: dict[Path, tuple[tuple[int, ...], str]] = {}


Stated = tuple[os.stat_result, bool]  # a file's stat (its target's, for a link), is it a link


def _stat_confined(path: Path, label: str, confine_to: Path | None,
                   answer_key: Path | None, folder_fd: int | None) -> Stated:
    """The file's stat (its target's, for a link that may be followed), and
    whether the file itself is a link."""
    st = os.lstat(path) if folder_fd is None else os.lstat(path.name, dir_fd=folder_fd)
    link = stat.S_ISLNK(st.st_mode)
    if confine_to is None and link:
        raise RefusedError(f"{label} {path} is a symlink out of its folder; not followed")
    # Not a link, in a confined open folder: it is that folder's, so the walk
    # of every component of its path (a dozen lstats) proves nothing new.
    if (confine_to is not None or answer_key is not None) and (link or folder_fd is None):
        st = os.stat(confine(str(path), confine_to, answer_key=answer_key, label=label))
    return st, link


def read_bytes(path: Path, size: int, max_bytes: int | None = None, *,
                nofollow: bool = True, folder_fd: int | None = None,
                opened: Callable[[int], None] | None = None) -> bytes | None:
    """The whole file, by descriptor: open, read, close (Path.read_bytes adds
    an fstat, an ioctl and an lseek); None if it grew past `max_bytes`.
    `size`: what stat said, a first guess. `nofollow`: a link swapped in since
    the lstat is refused, not followed. `folder_fd`: looked up in that folder.
    `opened(fd)`: checks what was opened before anything is read."""
    # Non-blocking: a FIFO swapped in since the stat reads as empty, not forever.
    # No controlling terminal: a link to a tty swapped in must not become ours.
    flags = (os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
             | (os.O_NOFOLLOW if nofollow else 0))
    fd = os.open(path, flags) if folder_fd is None else os.open(path.name, flags,
                                                                 dir_fd=folder_fd)
    try:
        if opened is not None:
            opened(fd)
        chunks, total = [os.read(fd, size + 1)], 0
        while chunks[-1]:  # grown since the stat: read on to the end
            total += len(chunks[-1])
            if max_bytes is not None and total > max_bytes:
                return None
            chunks.append(os.read(fd, max(size, 65536)))
        return b"".join(chunks)
    finally:
        os.close(fd)


def forget_kept(paths: Iterable[str | Path]) -> None:
    """The answer key's texts kept for these files dropped: a change that moved
    no time (a write through a shared mmap) was seen, and the next read must
    be the disk's."""
    for path in paths:
        _kept_text.pop(Path(path), None)


def _keep_text(path: Path, identity: tuple[int, ...], text: str) -> None:
    # Summed, not counted: a text is kept once per content, and two pool
    # threads keeping at once cannot make a sum drift as a counter would.
    kept = sum(len(other) for _, other in list(_kept_text.values()))
    if kept + len(text) > _KEPT_MAX_CHARS:
        _kept_text.clear()
    _kept_text[path] = (identity, text)


# C0 and C1 control characters and DEL, except tab, newline, carriage return
# and form feed (page breaks in screenplay exports). A NUL-filled file, a
# binary, or terminal escape codes are not text a report can be made from.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f]")


# A letter or digit of any script: what text with something to read has (a BOM,
# zero-width spaces and other format characters are neither, nor whitespace).
_WORD_CHARACTER = re.compile(r"[^\W_]")


def has_words(text: str) -> bool:
    """Whether `text` has anything to read: at least one letter or digit."""
    return _WORD_CHARACTER.search(text) is not None


def not_unicode(text: str) -> str | None:
    """Why `text` cannot be written as UTF-8 (a lone surrogate from a JSON escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate U+{ord(text[e.start]):04X} at character {e.start:,}"
    return None


def control_characters(text: str) -> str | None:
    """Why `text` is binary or control-character content, or None when it is not."""
    match = _CONTROL.search(text)
    if match is None:
        return None
    count = len(_CONTROL.findall(text))
    return (f"{count:,} control character(s), the first U+{ord(match.group()):04X} at "
            f"character {match.start():,}")


def read_range(directory: Path, first: int, last: int, *, label: str,
               confine_to: Path | None = None, answer_key: Path | None = None,
               max_bytes: int | None = None) -> dict[int, str]:
    """Every episode first..last, or RefusedError naming the first bad one.

    A range with no episode at all gets the seed's message; a range with some
    present names the first missing one. `max_bytes` bounds the whole range,
    checked from the stats the reads then use, before anything is read.
    """
    numbers = range(first, last + 1)
    paths = [directory / episode_name(n) for n in numbers]
    if not any(os.path.lexists(p) for p in paths):
        raise RefusedError(f"no {label} episodes {first}-{last} in {directory}")
    folder_fd = None
    if confine_to is not None:
        try:
            folder_fd = open_confined(directory, confine_to, answer_key, f"{label} episode")
        except FileNotFoundError:
            pass  # each episode is then "missing", as read_episode says
    try:
        stats: dict[Path, Stated | None] = {}
        if max_bytes is not None:
            stats = {p: _stat_or_none(p, label, confine_to, answer_key, folder_fd) for p in paths}
            _check_total(stats, max_bytes, f"{label} episodes {first}-{last} in {directory}")
        return {n: read_episode(p, label=f"{label} episode", confine_to=confine_to,
                                answer_key=answer_key, max_bytes=max_bytes, folder_fd=folder_fd,
                                stated=stats.get(p))
                for n, p in zip(numbers, paths, strict=True)}
    finally:
        if folder_fd is not None:
            os.close(folder_fd)


def _stat_or_none(path: Path, label: str, confine_to: Path | None, answer_key: Path | None,
                  folder_fd: int | None) -> Stated | None:
    try:
        return _stat_confined(path, label, confine_to, answer_key, folder_fd)
    except (OSError, RuntimeError, RefusedError):
        return None  # read_episode will say what is wrong with it


def _check_total(stats: Mapping[Path, Stated | None], max_bytes: int, what: str) -> None:
    sizes = {p: st[0].st_size if st else 0 for p, st in stats.items()}
    total = sum(sizes.values())
    if total > max_bytes:
        largest = max(sizes, key=lambda p: sizes[p])
        raise RefusedError(f"{what} total {total:,} bytes, over the {max_bytes:,}-byte limit "
                           f"the model's context window allows (largest: {largest.name}, "
                           f"{sizes[largest]:,} bytes)")


RACY_MTIME_NS = 2_000_000_000


def racily_clean(changed_ns: int) -> bool:
    """Whether what changed at `changed_ns` (an mtime or ctime) changed too
    recently to be trusted by its stat: within the clock's tick it may change
    again with the same size and times (as git treats "racily clean" files)."""
    return time.time_ns() - changed_ns <= RACY_MTIME_NS


# human/ folder -> ((inode, mtime_ns), (episode file names, their numbers)) when last listed.
_human_listing: dict[Path, tuple[tuple[int, int], tuple[tuple[str, ...], tuple[int, ...]]]] = {}


@dataclass(frozen=True)
class Work:
    """One work: its answer key under human/ and optional work.toml."""

    name: str
    root: Path
    title: str
    explicit_ranges: tuple[tuple[int, int], ...] | None

    @functools.cached_property
    def human_dir(self) -> Path:  # asked ~10 times a job: a Path made once
        return self.root / "human"

    def human_episodes(self) -> list[int]:
        """Episode numbers present in human/, sorted."""
        return list(self._listing()[1])

    def human_files(self) -> tuple[str, ...]:
        """The names in human/ that are episodes, sorted (ep01.txt and ep001.txt are
        both episode 1: both are the answer key)."""
        return self._listing()[0]

    def _listing(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """human/'s episode files and their numbers, both sorted."""
        try:
            st = os.stat(self.human_dir)
        except OSError:
            return (), ()
        if not stat.S_ISDIR(st.st_mode):
            return (), ()
        # Asked after every job (is the step complete?): the folder is listed
        # again only when its mtime says a name was added, removed or renamed.
        seen = (st.st_ino, st.st_mtime_ns)
        cached = _human_listing.get(self.human_dir)
        if cached is not None and cached[0] == seen:
            return cached[1]
        names = {entry.name: n for entry in os.scandir(self.human_dir)
                 if (n := episode_number(entry.name)) is not None}
        found = tuple(sorted(names)), tuple(sorted(set(names.values())))
        if not racily_clean(st.st_mtime_ns):
            _human_listing[self.human_dir] = (seen, found)
        return found

    def ranges(self, episodes_per_report: int) -> list[tuple[int, int]]:
        """work.toml's ranges, else the human episodes in chunks (last may be shorter)."""
        if self.explicit_ranges is not None:
            return list(self.explicit_ranges)
        return list(chunk(self.human_episodes(), episodes_per_report))

    def read_human(self, first: int, last: int, max_bytes: int | None = None) -> dict[int, str]:
        return read_range(self.human_dir, first, last, label="human", max_bytes=max_bytes)

    def read_all_human(self) -> dict[int, str]:
        """The whole answer key, by episode (the leak indexes, the audit): every
        readable episode file; unreadable ones are skipped. Two files of one
        number (ep01.txt, ep001.txt) are both key text: joined under it."""
        return by_episode(self.read_human_files())

    def read_human_files(self) -> dict[str, str]:
        """Every readable episode file of human/ by name (a copy of any of them is
        the answer key under another name); unreadable ones are skipped."""
        files = {}
        for name in self.human_files():
            try:
                files[name] = read_episode(self.human_dir / name, label="human episode")
            except RefusedError:
                continue
        return files


def by_episode(files: Mapping[str, str]) -> dict[int, str]:
    """Episode files' texts by number; two files of one number joined, in name order."""
    episodes: dict[int, str] = {}
    for name in sorted(files):
        if (n := episode_number(name)) is not None:
            episodes[n] = f"{episodes[n]}\n\n{files[name]}" if n in episodes else files[name]
    return episodes


def chunk(numbers: Iterable[int], size: int) -> Iterable[tuple[int, int]]:
    ordered = sorted(numbers)
    for i in range(0, len(ordered), size):
        part = ordered[i:i + size]
        yield part[0], part[-1]


def load_work(root: Path) -> Work:
    """A work folder; work.toml (title, ranges) is optional."""
    root = root.resolve()
    if not root.is_dir():
        raise ConfigError(f"work folder {root} does not exist")
    title, ranges = root.name, None
    meta = root / "work.toml"
    if meta.exists():
        try:
            raw = tomllib.loads(meta.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{meta}: not valid TOML: {e}") from None
        title = str(raw.get("title", title))
        if "ranges" in raw:
            ranges = _parse_ranges(meta, raw["ranges"])
    return Work(name=root.name, root=root, title=title, explicit_ranges=ranges)


def _parse_ranges(meta: Path, value: object) -> tuple[tuple[int, int], ...]:
    allowed = "a list of [first, last] pairs of episode numbers, first <= last"
    if not isinstance(value, list):
        raise ConfigError(f"{meta}: ranges = {value!r}: must be {allowed}")
    ranges = []
    for item in value:
        ok = (isinstance(item, list) and len(item) == 2
              and all(isinstance(n, int) and n >= 0 for n in item) and item[0] <= item[1])
        if not ok:
            raise ConfigError(f"{meta}: ranges item {item!r}: must be {allowed}")
        ranges.append((item[0], item[1]))
    return tuple(ranges)


def discover_works(data_dir: Path) -> dict[str, Work]:
    """Every folder of data/ that has a human/ folder, by name."""
    if not data_dir.is_dir():
        return {}
    works = {}
    for entry in sorted(os.scandir(data_dir), key=lambda e: e.name):
        if entry.is_dir() and os.path.isdir(os.path.join(entry.path, "human")):
            works[entry.name] = load_work(Path(entry.path))
    return works
