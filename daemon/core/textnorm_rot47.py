"""Text in ROT47: every printable ASCII character but the space moved 47
places along `!`..`~` (`96==@ H@C=5` is "hello world"); it undoes itself.

rot13 leaves letters letters, and its reading is the words rotated; ROT47
makes small letters digits, `:;<=>?@` and capitals A-K, so its words are no
words at all. A run here is MIN_WORDS words or more in a row that ROT47
turns into words (a letter first, letters and digits, an apostrophe or
hyphen inside, punctuation around); it is read as a stretch of
textnorm_encoded (its decoded text one more reading, every character of it
from the whole run). ROT47 keeps the spaces and the line breaks, so a run
over lines is one stretch.

Prose rotated mixes digits, punctuation and capitals inside its words;
prose as written seldom does: a bytes.translate and a few counts (C) say so
first (the regex over a rotated text costs ~40 ns a character).
"""
from __future__ import annotations

import re

MIN_WORDS = 5
_PRINTABLE = "".join(map(chr, range(33, 127)))
_ROT47 = str.maketrans(_PRINTABLE, _PRINTABLE[47:] + _PRINTABLE[:47])
# What ROT47 makes of the small letters a-o (digits and punctuation, "d") and
# p-z (capitals A-K, "c"). Two kinds side by side: about half the pairs of
# letters in a word of prose rotated, hardly any in prose as written (a
# number or a time of day is of one kind, a heading of the other). 96 % of the
# 8-word stretches of three screenplays, rotated, have 3 such pairs or more;
# our sidecars, reports, archives and screenplays as written 0 or 1.
_KINDS = bytes(ord("d") if ord("2") <= c <= ord("@") else ord("c") if ord("A") <= c <= ord("K")
               else ord("x") for c in range(256))
MIN_MIXED = 3
# A word: a letter first, letters and digits ("ML320"), an apostrophe or hyphen
# inside, punctuation around.
_WORD = r"[^\w\s]*[A-Za-z][A-Za-z0-9]*(?:['’-][A-Za-z0-9]+)*[^\w\s]*"
_RUN = re.compile(rf"(?<!\S){_WORD}(?:\s+{_WORD}){{{MIN_WORDS - 1},}}(?!\S)")


def rot47(text: str) -> str:
    return text.translate(_ROT47)


def decoded_runs(text: str, raw: bytes, min_chars: int) -> list[tuple[int, int, str]]:
    """(start, end, decoded text) of each run of `text` in ROT47 of `min_chars`
    characters or more (`raw`: the text in UTF-8, as textnorm_encoded has it).
    ROT47 moves each character alone: the runs of words in the text rotated
    are where the text has them."""
    kinds = raw.translate(_KINDS)
    if kinds.count(b"dc") + kinds.count(b"cd") < MIN_MIXED:
        return []
    rotated = rot47(text)
    return [(m.start(), m.end(), m.group()) for m in _RUN.finditer(rotated)
            if m.end() - m.start() >= min_chars]
