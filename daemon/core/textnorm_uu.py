"""Text in uuencode: lines of characters from the space to the backquote, each
led by one that says how many bytes the line holds (`M` for 45, the usual
full line), between `begin 644 name` and `end` when a tool wrote them.

A line is read only when its length agrees with what its first character
says (its trailing blanks may have been cut, or a character added after
it); lines that read, one after another, are one stretch of
textnorm_encoded, decoded together (a quote longer than 45 bytes is on
several lines). Prose has few runs of `min_chars` characters without a small
letter (a scene heading, a stamp), and a run's length seldom agrees with
its first character: a bytes.translate and a find (C) say so first.
"""
from __future__ import annotations

import binascii
import re
from collections.abc import Callable

from .textnorm_tables import ONE_BYTE

# The space to the backquote as "u", anything else (a small letter, a line break) "x".
_MARKS = bytes(ord("u") if 32 <= c <= 96 else ord("x") for c in range(256))
_LINE = re.compile(r"[ -`]+")
# A line break, a JSON string's escaped one, or the blank one reads as.
_BREAK = re.compile(r"`*(?:\\?\r?\n|\\n| )")  # after the padding
_SKIPPED = 3  # characters before a line that are no part of it: "> ", ": "
_SLACK = 3  # characters missing (blanks cut) or added (an escaped line break's backslash)
# A line of text's bytes: nearly all printable ASCII (a time of day or a heading
# that only looks like a line is not), told in C before the caller's test.
_SHOWN = bytes(range(32, 127)) + b"\t\n\r"
MIN_SHOWN_SHARE = 0.75
# A uuencoded line of text is a third capitals (a letter's last six bits are
# one; the corpus key's lines a sixth at least); a time of day and the JSON
# around it a sixteenth.
_CAPITALS = bytes(ord("U") if 65 <= c <= 90 else ord("x") for c in range(256))
MIN_CAPITALS_SHARE = 0.1


def decoded_runs(text: str, raw: bytes, min_chars: int,
                 as_text: Callable[[bytes], str | None]) -> list[tuple[int, int, str]]:
    """(start, end, decoded text) of each block of uuencoded lines in `text` that
    reads (`raw`: the text in UTF-8; `min_chars`, `as_text`: textnorm_encoded's)."""
    marked = raw.translate(_MARKS)
    long_run = b"u" * min_chars
    if long_run not in marked:
        return []
    if len(raw) != len(text):  # one byte a character, so the marks' offsets are the text's
        raw = text.encode("ascii", ONE_BYTE)
        marked = raw.translate(_MARKS)
    capitals = raw.translate(_CAPITALS)
    runs, at = [], marked.find(long_run)
    while at >= 0:
        end = marked.find(b"x", at)
        end = len(text) if end < 0 else end
        if capitals.count(b"U", at, end) >= MIN_CAPITALS_SHARE * (end - at):
            runs.append((at, end))
        at = marked.find(long_run, end)
    found: list[tuple[int, int, str]] = []
    done = 0
    for run_start, run_end in runs:
        if run_start < done or (first := _line(text, run_start, run_end)) is None:
            continue  # a line of the block before, or no line
        block = [first]
        while (gap := _BREAK.match(text, block[-1][1])) is not None and \
                (nxt := _LINE.match(text, gap.end())) is not None and \
                (line := _line(text, *nxt.span())) is not None:
            block.append(line)
        done = block[-1][1]
        # A line after the block's last that only looks like one: read without it.
        for lines in (block, block[:-1]) if len(block) > 1 else (block,):
            decoded = as_text(b"".join(data for *_, data in lines))
            if decoded is not None and lines[-1][1] - lines[0][0] >= min_chars:
                found.append((lines[0][0], lines[-1][1], decoded))
                break
    return found


def _line(text: str, start: int, end: int) -> tuple[int, int, bytes] | None:
    """(start, end, its bytes) of the uuencoded line in text[start:end], if one is:
    its first character, then the characters that hold as many bytes as that
    one says (up to _SLACK of them may be cut: blanks at its end), then
    nothing but padding, an escaped line break's backslash, or a blank before
    whatever follows (line breaks read as spaces)."""
    for skipped in range(min(_SKIPPED, end - start - 1)):
        at = start + skipped
        count = (ord(text[at]) - 32) & 63
        need = 1 + (count * 4 + 2) // 3
        after = text[at + need:end].lstrip("`")
        if not count or end - at < need - _SLACK or after.rstrip("\\") and after[0] != " ":
            continue
        line = text[at:min(at + need, end)]
        try:  # a character cut reads as a blank, as uudecode reads it; none is in its span
            data = binascii.a2b_uu(line)
        except binascii.Error:
            continue
        if len(data.translate(None, _SHOWN)) <= (1 - MIN_SHOWN_SHARE) * len(data):
            return at, at + len(line.rstrip(" ")), data
    return None
