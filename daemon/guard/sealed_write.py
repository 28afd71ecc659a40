"""The one writer of files under runs/: the guard reads the exact final text.

Rule 1 held only as long as nothing changed text after the leak guard had
read it; the claims parser did (issue 34: it stripped the backticks the
guard had split words at, and saved the rejoined key line in the sidecar).
So the check happens here, at the last moment, on what is written: the
report after its annotation, the sidecar after json.dumps, the archive as
rendered, a marker or record as serialised. The text is encoded to the
bytes that go to disk and those bytes, decoded, are what the guard reads.
Whatever transformed the text before, the guard has the last word.

A hit here is never redacted: redaction belongs to the loss step, before
the claims are read; a passage found in the final text means something put
it back after that, and cutting into serialised JSON could break it. So it
refuses (SealRefused, a RefusedError): nothing of the call is written.

Which key: a loss job's files are checked against its work's key with the
model's own episodes allowed (`Seal`, the guard's rule for reports); every
other file under runs/ against every work's installed key with nothing
allowed (`write_text`). tests/test_structure.py finds any other writer.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import atomic
from ..core.errors import RefusedError
from . import leakguard
from .leakguard import HumanIndex


class SealRefused(RefusedError):
    """Raised when the final text of a file for runs/ holds answer-key text."""


@dataclass(frozen=True)
class Archive:
    """A prompt archive as the loss step renders it: the template's own text
    (`skeleton`, with `slot` where the model's episodes go) and the block.

    `text` is what is written. When it is the skeleton with the block pasted
    in, only the skeleton's pieces are read, each with the block's edges
    beside it (the block is the model's own text, allowed, and most of the
    archive: bench/RESULTS.md, issue 14). Otherwise the whole text is read.
    """

    text: str
    skeleton: str
    slot: str
    block: str


@dataclass
class Seal:
    """One work's key, the other works' keys, and the text that may be quoted
    (the model's episodes).

    `others`: every other work the daemon knows (a model may quote a
    screenplay it memorised, and the operator may train on that one too);
    the model's text is allowed against them as against its own work's key.
    A text this seal found clean is remembered (`_clean`): written as it is,
    or with text appended (a report and its annotation), only what is new is
    read again, with the words before it (the guard's cost per report stays
    one reading of the report: bench/RESULTS.md, issue 34).
    """

    index: HumanIndex
    allow_text: str = ""
    others: tuple[HumanIndex, ...] = ()
    _clean: list[str] = field(default_factory=list, repr=False)

    @property
    def keys(self) -> tuple[HumanIndex, ...]:
        """The work's key first, then the others'."""
        return (self.index, *self.others)

    def find(self, text: str) -> list[leakguard.Leak]:
        """The guard's reading of `text` (leakguard.find_leaks, against every key,
        the text read once); clean: remembered."""
        found = leakguard.find_leaks_of_any(text, self.keys, allow_text=self.allow_text)
        if not found:
            self._clean.append(text)
        return found

    def leaks(self, text: str) -> int:
        """Passages of any key in `text` as it will be written."""
        if text in self._clean:
            return 0
        base = max((c for c in self._clean if text.startswith(c)), key=len, default="")
        if base:  # what was appended, with the words before it (a passage across the seam)
            added = text[len(base):]
            if added.isspace():  # a final newline: no word, nothing after to join
                return 0
            text = _edges(base, self.index.long_n)[1] + added
        return len(leakguard.find_leaks_of_any(text, self.keys, allow_text=self.allow_text))

    def archive_leaks(self, archive: Archive) -> bool:
        """Does the archive hold key text outside the model's episodes?"""
        if archive.text in self._clean:
            return False
        found = any(self._archive_leaks(archive, index) for index in self.keys)
        if not found:
            self._clean.append(archive.text)
        return found

    def _archive_leaks(self, archive: Archive, index: HumanIndex) -> bool:
        """One key's text in the archive: its own text (the template's, the facts)
        and across each seam with the model's episodes, which are allowed."""
        pieces = archive.skeleton.split(archive.slot)
        if len(pieces) == 1 or archive.block.join(pieces) != archive.text:
            return bool(leakguard.find_leaks(archive.text, index,
                                             allow_text=archive.block))
        head, tail = _edges(archive.block, index.long_n)
        for k, piece in enumerate(pieces):
            before, after = (tail if k > 0 else ""), (head if k < len(pieces) - 1 else "")
            if _clean_pieces.holds(index, piece) or _clean_alone_again(index, piece):
                # Clean alone (the template's text before the model's episodes is
                # the same for every step of a range): only runs across a seam
                # are new, and each lies in the piece's edge and the block's.
                first, last = _edges(piece, index.long_n)
                seams = [(before + first, (before,)), (last + after, (after,))]
                if any(leakguard.find_leaks(text, index, allow_text=allow)
                       for text, allow in seams if allow[0]):
                    return True
                continue
            # Allowed: the block's text that stands in this text, its edges, each
            # read alone (built only on a hit). A run of the block that is not
            # in an edge is not in this text either. The whole block's shingles,
            # built whenever the model's first scene heading was the key's,
            # cost ~0.6 ms a job.
            if leakguard.find_leaks(before + piece + after, index,
                                    allow_text=(before, after)):
                return True
        return False


def _clean_alone_again(index: HumanIndex, piece: str) -> bool:
    """A piece seen before (the template's text before the model's episodes, at
    a range's next step), read alone with nothing allowed: clean, it is
    remembered, and only its seams are read, now and from then on. (Read with
    its seams first and alone after, as it was, it cost two readings.)"""
    if not _clean_pieces.seen_again(index, piece) or leakguard.find_leaks(piece, index):
        return False
    _clean_pieces.add(index, piece)
    return True


class _CleanPieces:
    """Archive pieces found clean with nothing allowed, per key: the template's
    text before the model's episodes is the same for every step of a range,
    so it is read alone the second time it is seen and then no more (a
    piece seen once, the model's facts, costs a lookup). The key's digest is
    part of the entry: a changed key knows none of its old pieces. Sizes:
    a step's ranges, twice (seen: each job's pieces, by hash only)."""

    def __init__(self, clean: int, seen: int) -> None:
        self._clean: dict[tuple[str, int, int, str], None] = {}
        self._seen: dict[int, None] = {}
        self._sizes = clean, seen
        self._lock = threading.Lock()  # the job pool's threads share it

    def holds(self, index: HumanIndex, piece: str) -> bool:
        return _entry(index, piece) in self._clean

    def seen_again(self, index: HumanIndex, piece: str) -> bool:
        entry = hash(_entry(index, piece))  # a collision costs one reading, no more
        with self._lock:
            if entry in self._seen:
                return True
            _bounded_put(self._seen, entry, self._sizes[1])
            return False

    def add(self, index: HumanIndex, piece: str) -> None:
        with self._lock:
            _bounded_put(self._clean, _entry(index, piece), self._sizes[0])


def _entry(index: HumanIndex, piece: str) -> tuple[str, int, int, str]:
    return index.digest, index.n, index.long_n, piece


def _bounded_put(items: dict[Any, None], entry: object, size: int) -> None:
    while len(items) >= size:  # the oldest first: a dict keeps insertion order
        del items[next(iter(items))]
    items[entry] = None


_clean_pieces = _CleanPieces(clean=256, seen=4096)


def _edges(block: str, words: int) -> tuple[str, str]:
    """The text's first and last characters holding more than `words` words each
    (one more: a cut may split a word or an escape at the far end)."""
    size = 256
    while True:
        head, tail = block[:size], block[-size:]
        if size >= len(block) or min(len(leakguard.tokens(head)),
                                     len(leakguard.tokens(tail))) > words:
            return head, tail
        size *= 4


def _final(text: str) -> tuple[bytes, str]:
    """The bytes written, and the text the guard reads: those bytes decoded."""
    data = text.encode("utf-8")
    return data, data.decode("utf-8")


def write_all(files: Mapping[Path, str | Archive], seal: Seal) -> None:
    """A loss job's files, all or none (atomic.write_all: in order, the commit
    marker last), each checked in its final form first.

    Raises SealRefused naming the file; nothing is written then.
    """
    out: dict[Path, bytes] = {}
    for path, content in files.items():
        if isinstance(content, Archive):
            data, final = _final(content.text)
            found = seal.archive_leaks(Archive(final, content.skeleton, content.slot,
                                               content.block))
        else:
            data, final = _final(content)
            found = seal.leaks(final) > 0
        if found:
            raise SealRefused(f"{path.name} would hold answer-key text of "
                              f"{seal.index.work} in its final form; nothing written")
        out[path] = data
    atomic.write_all(out)


def write_text(path: Path, text: str) -> None:
    """Any other file under runs/ (a step marker, a loop or batch record, a
    control file, a cache), checked against every installed key.

    With no keys installed (a command run outside the daemon) there is no
    key to hold it against, and the text is written as it is.
    """
    data, final = _final(text)
    keys = leakguard.installed()
    if keys is not None and keys.leaks(final):
        raise SealRefused(f"{path.name} would hold answer-key text; not written")
    atomic.write_all({path: data})
