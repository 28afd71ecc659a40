"""`skilltrain audit`: scan every file under runs/ for passages of the answer key.

The loss step redacts its reports before writing them, but runs/ also holds
prompt archives, sidecars, JSON logs, state files, optimizer outputs and
whatever a user or another tool put there. The audit reads every regular file
as text with undecodable bytes replaced, gzip-compressed files (rotated logs)
decompressed, through the one normalisation of the leak guard (textnorm:
JSON and HTML escapes, URL encoding, zero-width characters, look-alike
letters). Symlinks are followed: a closed-book writer reads through a link as
well as through a copy. A link whose target lies inside data/ is reported
whatever the target holds; a link to any other file is scanned as that file
(its hits are reported under the link's path); a link to a folder is walked
once (a loop cannot trap the scan).

The audit allows what the guard allows (issue 34), so that a clean run
audits clean and a hit means something: a report, prompt archive or sidecar
of a set may hold the text of that set's model episodes (the guard lets a
report quote the model it judges, and the archive holds them whole), and
runs of stock lines start nothing (leakguard's rules, shared). A model
episode is the writer's own text: the loss step sends it as it is unless it
is a copy of a human episode, and so the audit flags only such a copy
(`copies`: sha256 of every human episode). Everywhere else, nothing is
allowed: a quote planted in a report, a log, the state or a stray file is a
hit.

Files are read in chunks with an overlap, so a 50 MB log costs seconds and
little memory. A chunk is first tested against the hashed shingles in bulk;
only a chunk with a hit is tokenised again with offsets to report line and
excerpt. The result goes to the terminal, never into runs/: its excerpts
(at most EXCERPT_WORDS words) are human text.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import stat
import sys
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import dataset, layout, textnorm
from ..core.errors import ExitCode
from . import leakguard
from .leakguard import HumanIndex

EXCERPT_WORDS = 8
CHUNK_CHARS = 1 << 20
# Carried from one chunk into the next so that a passage cut by the chunk
# boundary is seen whole; far more than the span of one shingle of prose.
OVERLAP_CHARS = 4096
# A gzip file is decompressed up to this much; beyond, the file is reported as
# not fully scanned rather than read forever (a decompression bomb).
MAX_GZIP_CHARS = 4 << 30

_GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class Hit:
    """One passage of a work's human text found in a file under runs/."""

    file: Path
    line: int
    work: str
    episode: int
    n_words: int
    excerpt: str

    def to_json(self) -> dict[str, Any]:
        return {
            "file": str(self.file),
            "line": self.line,
            "work": self.work,
            "episode": self.episode,
            "n_words": self.n_words,
            "excerpt": self.excerpt,
        }


@dataclass(frozen=True)
class Link:
    """A symlink under runs/ whose target lies inside data/ (the answer key's home)."""

    file: Path
    target: Path

    def to_json(self) -> dict[str, Any]:
        return {"file": str(self.file), "target": str(self.target)}


@dataclass
class AuditResult:
    """Hits plus what was scanned and what could not be."""

    hits: list[Hit] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    files: int = 0
    chars: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)


def _open_text(path: Path, stack: contextlib.ExitStack) -> io.TextIOWrapper:
    """The file as text; not through a symlink, and only if it is a regular file.

    `path` is a real path (links resolved by the walk), but it may have been
    replaced since: O_NOFOLLOW refuses a symlink, O_NONBLOCK keeps a FIFO
    from blocking the scan.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    raw = stack.enter_context(open(fd, "rb"))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise OSError(f"{path} is no longer a regular file")
    compressed = raw.read(2) == _GZIP_MAGIC
    raw.seek(0)
    buffer: gzip.GzipFile | io.BufferedReader = raw
    if compressed:
        buffer = stack.enter_context(gzip.GzipFile(fileobj=raw, mode="rb"))
    # newline="" keeps \r\n as is, so line numbers count "\n" like an editor does.
    return stack.enter_context(
        io.TextIOWrapper(buffer, encoding="utf-8", errors="replace", newline="")
    )


def _chunks(f: io.TextIOWrapper, limit: int | None) -> Iterator[tuple[int, str, int]]:
    """(line number of its first character, chunk, characters new in it).

    Each chunk starts with the last OVERLAP_CHARS of the one before.
    """
    line = 1
    carry = ""
    read = 0
    while True:
        data = f.read(CHUNK_CHARS)
        if not data:
            return
        read += len(data)
        if limit is not None and read > limit:
            raise _TooLarge(limit)
        chunk = carry + data
        yield line, chunk, len(data)
        cut = max(0, len(chunk) - OVERLAP_CHARS)
        line += chunk.count("\n", 0, cut)
        carry = chunk[cut:]


class _TooLarge(Exception):
    pass


def _excerpt(text: str) -> str:
    words = textnorm.decode_escapes(text).split()
    short = " ".join(words[:EXCERPT_WORDS])
    return short + " …" if len(words) > EXCERPT_WORDS else short


def _scan_view(
    view: str, first_line: int, path: Path, indexes: Sequence[HumanIndex], allow_text: str = ""
) -> Iterator[Hit]:
    """Hits in one chunk: bulk hash test first, offsets only on a hit."""
    views = textnorm.readings(view)
    for index in indexes:
        if not leakguard.may_leak(views, index):
            continue
        for leak in leakguard.find_leaks(view, index, views=views, allow_text=allow_text):
            yield Hit(
                file=path,
                line=first_line + leak.line - 1,
                work=index.work,
                episode=leak.episode,
                n_words=leak.n_words,
                excerpt=_excerpt(view[leak.start : leak.end]),
            )


def scan_file(path: Path, indexes: Sequence[HumanIndex], *,
              real: Path | None = None, allow_text: str = "") -> tuple[list[Hit], int]:
    """Hits in one file (deduplicated) and the number of characters read.

    `real`: the file to read when `path` is a symlink to it. `allow_text`:
    text the file may hold (its set's model episodes).
    """
    hits: dict[tuple[int, str, int], Hit] = {}
    chars = 0
    with contextlib.ExitStack() as stack:
        f = _open_text(real or path, stack)
        limit = MAX_GZIP_CHARS if isinstance(f.buffer, gzip.GzipFile) else None
        for first_line, chunk, fresh in _chunks(f, limit):
            chars += fresh
            for hit in _scan_view(chunk, first_line, path, indexes, allow_text):
                # The overlap between chunks finds a passage again.
                key = (hit.line, hit.work, hit.episode)
                if key not in hits or hits[key].n_words < hit.n_words:
                    hits[key] = hit
    return sorted(hits.values(), key=lambda h: (h.line, h.work, h.episode)), chars


@dataclass(frozen=True)
class _Entry:
    """A file to scan: its path under runs/ and, for a symlink, the file it reaches."""

    path: Path
    real: Path | None = None


def _walk(root: Path, data_root: Path | None, result: AuditResult) -> Iterator[_Entry]:
    """Every regular file under root, sorted, depth first, symlinks followed.

    A link into data_root is recorded in result.links, not read. Folders are
    walked once by real path (a link loop ends there). FIFOs (reading one
    would block), sockets and devices are skipped. A loop, not recursion: a
    deep tree cannot exhaust the stack.
    """
    data_real = Path(os.path.realpath(data_root)) if data_root is not None else None
    seen_dirs = {os.path.realpath(root)}
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            result.errors.append(f"{folder}: cannot list ({e.strerror or e})")
            continue
        subfolders = []
        for entry in entries:
            path = Path(entry.path)
            real: Path | None = None
            if entry.is_symlink():
                real = Path(os.path.realpath(path))
                if data_real is not None and real.is_relative_to(data_real):
                    result.links.append(Link(path, real))
                    continue
            try:
                st = os.stat(real or path) if real is not None else entry.stat(
                    follow_symlinks=False)
            except OSError:
                continue  # a dangling link, or gone since the listing
            if stat.S_ISDIR(st.st_mode):
                key = os.path.realpath(path)
                if key not in seen_dirs:
                    seen_dirs.add(key)
                    subfolders.append(path)
            elif stat.S_ISREG(st.st_mode):
                yield _Entry(path, real)
        stack.extend(reversed(subfolders))


def scan(root: Path, indexes: Sequence[HumanIndex], *,
         unchanged: Callable[[Path], bool] | None = None,
         data_root: Path | None = None,
         copies: Mapping[str, tuple[str, int]] | None = None) -> AuditResult:
    """Audit every file under root (links followed) against every index.

    `unchanged(path)`: True skips a regular file already found clean (the
    daemon's start-up audit keeps a cache of file signatures); a link is
    always read, its target may have changed behind it. `data_root`: links
    into it are reported in `links`. `copies`: sha256 of each human episode
    -> (work, episode); a model episode is flagged only as such a copy.
    With None, model episodes are read like any other file.
    """
    result = AuditResult()
    if not root.is_dir():
        result.errors.append(f"{root}: not a directory")
        return result
    allowed = _Allowances(root, copies)
    for entry in _walk(root, data_root, result):
        path = entry.path
        if entry.real is None and unchanged is not None and unchanged(path):
            result.skipped += 1
            continue
        try:
            if copies is not None and _is_episode(root, path):
                hits, chars = _copy_of_the_key(path, entry.real, copies)
            else:
                hits, chars = scan_file(path, indexes, real=entry.real,
                                        allow_text=allowed.of(path))
        except _TooLarge as e:
            result.errors.append(
                f"{path}: decompresses to more than {e.args[0]:,} characters; not fully scanned"
            )
            continue
        except (OSError, EOFError, zlib.error) as e:  # EOFError, zlib: damaged gzip
            result.errors.append(f"{path}: unreadable ({getattr(e, 'strerror', None) or e})")
            continue
        result.files += 1
        result.chars += chars
        result.hits.extend(hits)
    return result


class _Allowances:
    """The model episodes of the set a report, archive or sidecar belongs to,
    read once per set ("" for any other file). Not through a symlink, and not
    a copy of a human episode: the loss step sends neither, so neither makes
    key text in a report the model's own."""

    def __init__(self, root: Path, copies: Mapping[str, tuple[str, int]] | None) -> None:
        self.root = root
        self.copies = copies or {}
        self._texts: dict[layout.SetKey, str] = {}

    def of(self, path: Path) -> str:
        key = layout.parse_loss_file(self.root, path)
        if key is None:
            return ""
        if key not in self._texts:
            scripts = key.scripts_dir(self.root)
            texts = []
            for n in range(key.first, key.last + 1):
                episode = scripts / dataset.episode_name(n)
                with contextlib.suppress(OSError, UnicodeDecodeError):
                    if not episode.is_symlink():
                        text = episode.read_text("utf-8")
                        if dataset.sha256_text(text) not in self.copies:
                            texts.append(text)
            self._texts[key] = "\n".join(texts)
        return self._texts[key]


def _is_episode(root: Path, path: Path) -> bool:
    found = layout.parse_runs_path(root, path)
    return found is not None and found.episode is not None


def _copy_of_the_key(path: Path, real: Path | None,
                     copies: Mapping[str, tuple[str, int]]) -> tuple[list[Hit], int]:
    """A model episode: a hit only when it is a copy of a human episode."""
    with contextlib.ExitStack() as stack:
        text = _open_text(real or path, stack).read()
    found = copies.get(dataset.sha256_text(text))
    if found is None:
        return [], len(text)
    work, episode = found
    return [Hit(file=path, line=1, work=work, episode=episode, n_words=len(text.split()),
                excerpt=f"(a copy of {work} {dataset.episode_name(episode)})")], len(text)


def human_copies(works: Mapping[str, Mapping[int, str]]) -> dict[str, tuple[str, int]]:
    """sha256 of every human episode -> (work, episode), for `scan(copies=...)`."""
    return {dataset.sha256_text(text): (work, n)
            for work, episodes in works.items() for n, text in episodes.items()}


def format_hits(hits: Sequence[Hit], root: Path | None = None) -> str:
    """Terminal lines, `file:line: work epNN, N words: "excerpt"`, paths relative to root."""
    lines = []
    for h in hits:
        shown = (
            h.file.relative_to(root) if root is not None and h.file.is_relative_to(root) else h.file
        )
        lines.append(
            f'{shown}:{h.line}: {h.work} ep{h.episode:02d}, {h.n_words} words: "{h.excerpt}"'
        )
    return "\n".join(lines)


def to_json(result: AuditResult, root: Path) -> dict[str, Any]:
    """The --json document."""
    return {
        "root": str(root),
        "clean": not result.hits and not result.links and not result.errors,
        "files_scanned": result.files,
        "chars_scanned": result.chars,
        "hits": [h.to_json() for h in result.hits],
        "links_into_data": [link.to_json() for link in result.links],
        "errors": result.errors,
    }


def run(runs_root: Path, works: Mapping[str, Mapping[int, str]], as_json: bool,
        data_root: Path | None = None) -> int:
    """Audit runs_root against every work, print the result, return the exit code.

    1 on a leak or a link into data_root, and also when a file could not be
    read or there is no answer key to compare with: the audit cannot then
    vouch that runs/ is clean.
    """
    indexes = [
        leakguard.index_for(work, episodes) for work, episodes in sorted(works.items()) if episodes
    ]
    result = scan(runs_root, indexes, data_root=data_root, copies=human_copies(works))
    if not indexes:
        result.errors.append("no human episodes to audit against (is [paths] data right?)")
    if as_json:
        print(json.dumps(to_json(result, runs_root), ensure_ascii=False, indent=2))
    else:
        _print_text(result, runs_root, len(indexes))
    return int(ExitCode.FAILURE if result.hits or result.links or result.errors else ExitCode.OK)


def _print_text(result: AuditResult, root: Path, n_works: int) -> None:
    if result.hits:
        print(format_hits(result.hits, root))
    for link in result.links:
        print(f"{link.file}: symlink into the answer key's folder ({link.target})")
    for error in result.errors:
        print(f"audit: {error}", file=sys.stderr)
    files = len({h.file for h in result.hits})
    summary = (
        f"{len(result.hits)} answer-key passage(s) in {files} file(s)"
        if result.hits
        else "no answer-key passages"
    )
    if result.links:
        summary += f"; {len(result.links)} symlink(s) into data/"
    print(
        f"audit: {summary}; {result.files} files, {result.chars:,} characters under "
        f"{root} checked against {n_works} work(s)"
    )
