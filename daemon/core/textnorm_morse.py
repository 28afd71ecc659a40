"""Text in Morse code: `- .... . / -- --- -. . -.--` (letters apart by a space,
words by a slash, a bar or three spaces or more).

A run is MIN_CODES codes or more in a row; it is read if nearly every code is
one of the table's, as a stretch of textnorm_encoded (its decoded text one
more reading, every character of it from the whole run). Prose has few dots
and dashes one space apart: a bytes.translate and a count (C) say so first.
"""
from __future__ import annotations

import re

# A 7-word quote is 20 letters or more; 12 codes is fewer than any such one.
MIN_CODES = 12
MIN_KNOWN_SHARE = 0.9
_CODES = dict(zip(
    ".- -... -.-. -.. . ..-. --. .... .. .--- -.- .-.. -- -. --- .--. --.- .-. ... - ..- "
    "...- .-- -..- -.-- --.. ----- .---- ..--- ...-- ....- ..... -.... --... ---.. ----. "
    ".-.-.- --..-- ..--.. .----. -.-.-- -..-. -.--. -.--.- .-... ---... -.-.-. -...- .-.-. "
    "-....- ..--.- .-..-. ...-..- .--.-.".split(),
    "abcdefghijklmnopqrstuvwxyz0123456789.,?'!/()&:;=+-_\"$@", strict=True))
# Dots and dashes as "m", a space as itself, anything else "x": a run of
# codes leaves "m m" on every letter of a word but its last.
_MARKS = bytes(ord("m") if chr(c) in ".-" else ord(" ") if c == 32 else ord("x")
               for c in range(256))
_RUN = re.compile(rf"[.\-]{{1,7}}(?:(?: {{1,7}}| *[/|] *)[.\-]{{1,7}}){{{MIN_CODES - 1},}}")
_WORD_BREAK = re.compile(r" *[/|] *| {3,}")


def decoded_runs(text: str, raw: bytes) -> list[tuple[int, int, str]]:
    """(start, end, decoded text) of each run of `text` in Morse code that
    reads (`raw`: the text in UTF-8, as textnorm_encoded has it)."""
    if raw.translate(_MARKS).count(b"m m") < MIN_CODES // 2:
        return []
    found = []
    for m in _RUN.finditer(text):
        words = [word.split() for word in _WORD_BREAK.split(m.group())]
        codes = [code for word in words for code in word]
        known = sum(code in _CODES for code in codes)
        if known >= MIN_KNOWN_SHARE * len(codes):
            decoded = " ".join("".join(_CODES.get(code, "") for code in word) for word in words)
            found.append((m.start(), m.end(), decoded))
    return found
