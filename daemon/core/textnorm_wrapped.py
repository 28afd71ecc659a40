"""Base64 (or base32) wrapped in lines too narrow to start a block: 8 to 23
characters a line, as a model wraps a block to fit a quote, a list or a table.

A block is lines of one width that hold nothing but one alphabet (the last
may be narrower), each maybe behind a Markdown mark ("> ", "- ", "1. ", "| "),
with the run that ends the line before it and the one that starts the line
after it (a block set in prose). In a JSON string, an escaped line break
(`\\n`) breaks a line too. It is decoded whole, with or without those two
runs: the reading that decodes cleanest is kept, so a word of prose next to
the block is not cut with it.

Most texts have no such lines: two scans of bytes (C) that skip to each line
break say so.
"""
from __future__ import annotations

import re
import string
from collections.abc import Callable

# A line of base64 at its narrowest that is read: 8 characters (6 bytes).
SHORT_LINE_CHARS = 8
_LINE_MIN = SHORT_LINE_CHARS // 2  # the last line of a block may be narrower
_ALPHABET = (string.ascii_letters + string.digits + "+/-_=").encode("ascii")
_MARKED = bytes(ord("A") if byte in _ALPHABET else byte if byte == 10 else ord(" ")
                for byte in range(256))
# Before a line's run: up to four characters of no alphabet ("> ", "| "), or a
# list's mark ("- ", "12. ").
_PREFIX = rb"[^\nA]{0,4}(?:A{1,3}[^\nA]{1,2})?"
# Two whole lines in a row, or one between a line that ends in a run and a
# line that starts with one (the first run's line break is checked after).
_TWO_LINES = re.compile(rb"\n%sA{%d,}[^\nA]{0,3}\n%sA{%d,}[^\nA]{0,3}(?:\n|$)"
                        % (_PREFIX, SHORT_LINE_CHARS, _PREFIX, _LINE_MIN))
_BETWEEN = re.compile(rb"\n%sA{%d,}[^\nA]{0,3}\n%sA" % (_PREFIX, SHORT_LINE_CHARS, _PREFIX))
# Base64 of text has digits or a capital inside a run of letters; a list of
# words (capitalised, snake_case) has neither.
_ENCODED_LOOK = re.compile(r"[0-9+/]|[a-z][A-Z]")
_MARK = r"(?:[>|]|[-*+]|\d{1,3}[.):])"
_WHOLE_LINE = re.compile(
    rf"^[ \t]*(?:{_MARK}[ \t]+)*([A-Za-z0-9+/]{{{_LINE_MIN},}}={{0,2}}"
    rf"|[A-Za-z0-9_-]{{{_LINE_MIN},}}={{0,2}})[ \t]*\|?[ \t]*\r?$", re.MULTILINE)
_TAIL = re.compile(r"(?<![A-Za-z0-9+/_=-])([A-Za-z0-9+/_-]{2,}={0,2})[ \t\r]*$")
_HEAD = re.compile(rf"[ \t]*(?:{_MARK}[ \t]+)?([A-Za-z0-9+/_-]{{2,}}={{0,2}})(?![A-Za-z0-9+/_=-])")


def narrow_blocks(text: str, raw: bytes, min_chars: int,
                  decode: Callable[[str], str | None]) -> list[tuple[int, int, str]]:
    """(start, end, decoded text) of every narrow block of `text` (`raw`: its
    UTF-8 bytes) of `min_chars` characters or more that `decode` reads as text."""
    if "\\n" in text:  # a JSON string's line breaks, in place: offsets stay the text's
        text = text.replace("\\r\\n", "\r\n  ").replace("\\n", "\n ")
        raw = text.encode("utf-8", "surrogatepass")
    marked = raw.translate(_MARKED, b"\r")
    if not (_TWO_LINES.search(marked) or any(
            marked[max(0, m.start() - 8):m.start()].rstrip(b" ").endswith(b"A")
            for m in _BETWEEN.finditer(marked))):
        return []
    found: list[tuple[int, int, str]] = []
    for block in _blocks(text):
        first, last = block[0], block[-1]
        before_line = text.rfind("\n", 0, first[0]) if first[0] else -1
        tail = (_TAIL.search(text, text.rfind("\n", 0, before_line) + 1, before_line)
                if before_line > 0 else None)
        after_line = text.find("\n", last[1])
        head = _HEAD.match(text, after_line + 1, _line_end(text, after_line + 1)) \
            if after_line >= 0 else None
        if len(block) == 1 and not (tail and head and block[0][1] - block[0][0] < min_chars):
            continue  # a line of one word; or long enough for textnorm_encoded's blocks
        if not any(_ENCODED_LOOK.search(text, s, e) for s, e in block):
            continue  # words, one a line: a list of names or ids
        before = [tail.span(1)] if tail else []
        after = [head.span(1)] if head else []
        decoded = [(runs[0][0], runs[-1][1], out)
                   for runs in (before + block + after, before + block, block + after, block)
                   if len(runs) > 1 and sum(e - s for s, e in runs) >= min_chars
                   and (out := decode("".join(text[s:e] for s, e in runs)))]
        if decoded:  # the cleanest reading; of those, the longest
            found.append(max(decoded, key=lambda d: (_shown_share(d[2]), len(d[2]))))
    return found


def _blocks(text: str) -> list[list[tuple[int, int]]]:
    """The runs of each block: whole lines in a row of one width (the last may
    be narrower), two or more, the first SHORT_LINE_CHARS wide or more; or one
    such line alone between lines of prose (a block set in prose, its first
    and last runs on those lines)."""
    groups: list[list[tuple[int, int]]] = []  # whole lines in a row
    line_end = -1
    for m in _WHOLE_LINE.finditer(text):  # one scan; a Python step a whole line only
        if groups and text[line_end:m.start()] in ("\n", "\r\n"):
            groups[-1].append(m.span(1))
        else:
            groups.append([m.span(1)])
        line_end = m.end()
    blocks = []
    for group in groups:
        if len(group) == 1:
            if group[0][1] - group[0][0] >= SHORT_LINE_CHARS:
                blocks.append(group)
            continue
        block: list[tuple[int, int]] = []
        for span in group:
            width = span[1] - span[0]
            full = block and block[-1][1] - block[-1][0] == block[0][1] - block[0][0]
            if full and width <= block[0][1] - block[0][0]:
                block.append(span)  # of the block's width, or its last, narrower line
                continue
            if len(block) > 1:
                blocks.append(block)
            block = [span] if width >= SHORT_LINE_CHARS else []
        if len(block) > 1:
            blocks.append(block)
    return blocks


def _line_end(text: str, start: int) -> int:
    end = text.find("\n", start)
    return len(text) if end < 0 else end


def _shown_share(text: str) -> float:
    """How much of a decoded text is ASCII letters, digits, punctuation and
    spaces: a word of prose read as base64 before a block decodes to bytes
    that are mostly not."""
    return len(text.encode("ascii", "ignore").translate(None, _NOT_SHOWN)) / max(1, len(text))


_NOT_SHOWN = bytes(b for b in range(128) if not (32 <= b < 127 or b in b"\t\n\r"))
