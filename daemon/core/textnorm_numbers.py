"""Text written as a list of its byte values: `87, 104, 97, 116`, `0x57 0x68`,
`01010111 01101000` (or with nothing between), `\\127\\150\\141`.

A model told not to quote can spell a line's bytes as numbers, in the bases
code uses. Each form is a run of MIN_BYTES numbers or more, one byte each,
apart by spaces, commas or semicolons (or nothing, for escapes); the run's
bytes go to textnorm_encoded, which keeps them only if they read as text.
Most texts have no run of digits and separators long enough for a list: a
bytes.translate and a bytes.find (C) say so.
"""
from __future__ import annotations

import re

# 12 bytes: fewer than any quote the guard acts on (7 words) takes.
MIN_BYTES = 12
# What stands between two numbers of a list: a comma or semicolon, spaces, or
# a line break (a list wrapped, one number a line, a C array's rows).
_APART = r"(?:[ \t]*[,;]?[ \t]*\r?\n[ \t]*|[ \t]*[,;][ \t]*|[ \t]+)"


def _form(number: str, apart: str, base: int) -> tuple[re.Pattern[str], re.Pattern[str], int]:
    """A list's run, one number of it, and its base. The run starts with what
    the regex engine can skip ahead to (a lookbehind there cost a millisecond
    a form over 60 KB of prose); byte_lists looks at the character before it."""
    # Possessive: a run that fails is not tried again a number shorter.
    return (re.compile(rf"{number}(?:{apart}{number}){{{MIN_BYTES - 1},}}+(?![\w.])"),
            re.compile(number), base)


_DECIMAL = _form(r"(?:25[0-5]|2[0-4]\d|[01]\d\d|\d\d?)", _APART, 10)  # 87, 104, 097
_BINARY = _form(r"[01]{8}", rf"{_APART}?", 2)  # 01010111 01101000, or 0101011101101000
_HEX = _form(r"0[xX][0-9a-fA-F]{2}", _APART, 16)  # 0x57, 0x68
# \127\150, or in a JSON string \\127\\150 (the escapes decoded later take "\0"
# for a character of its own); wrapped over lines.
_OCTAL = _form(r"\\{1,2}[0-7]{3}", r"(?:\r?\n[ \t]*)?", 8)
# Digits as "d", what stands between numbers deleted, the rest "x": a list
# of twelve numbers of text (32 and up) leaves 24 digits in a row. Two C
# calls; a regex over the marks cost 2 ms over 60 KB of prose.
_DIGIT_OR_OTHER = bytes(ord("d") if chr(b).isdigit() and b < 128 else ord("x")
                        for b in range(256))
_LIST = b"d" * (2 * MIN_BYTES)


def byte_lists(text: str) -> list[tuple[int, int, bytes]]:
    """(start, end, the bytes) of every run of byte values in `text`."""
    forms = []
    if _LIST in text.encode("utf-8", "surrogatepass").translate(_DIGIT_OR_OTHER,
                                                               b" \t\r\n,;"):
        forms += [_DECIMAL, _BINARY]
    if "0x" in text or "0X" in text:
        forms.append(_HEX)
    if "\\" in text:
        forms.append(_OCTAL)
    found = []
    for run, number, base in forms:
        for m in run.finditer(text):
            if m.start() and (text[m.start() - 1].isalnum() or text[m.start() - 1] in "._\\"):
                continue  # the end of a longer number or word, not a list's start
            values = [int(n.group().lstrip("\\"), base) for n in number.finditer(m.group())]
            found.append((m.start(), m.end(), bytes(values)))
    return found
