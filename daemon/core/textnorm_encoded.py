"""Text hidden in an encoding: base64 (standard or URL-safe, padded or not,
wrapped over lines) and hex runs that decode to readable text, and rot13.

A reply that quotes the answer key base64-encoded is still a quote: textnorm
reads the decoded text as one more reading of the original (its characters
all come from the run that encoded them, so a redaction cuts the whole run).
Only runs that decode to text count: a sha256 digest, a path or a long word
decodes to bytes that are not UTF-8, or to control characters, and is left.

Most texts have no run of MIN_RUN_CHARS characters of the base64 alphabet:
one bytes.translate and one bytes.find (both C) say so, no regex runs.

rot13 maps words to words: its reading is the first reading's words rotated,
at the same offsets, made for every text (no cheap test tells one rot13 line
in English prose) and screened by the key's words before its runs are hashed.
"""

from __future__ import annotations

import base64
import binascii
import re
import string
from collections.abc import Callable

from .textnorm_reading import Reading

# 24 base64 characters are 18 bytes: fewer than any quote the guard acts on
# (7 words), so a quote's encoding is always long enough to be looked at.
MIN_RUN_CHARS = 24
# A decoded run is text if nearly all of it is shown: letters, digits,
# punctuation, spaces. Bytes that happen to be UTF-8 are rarely so.
MIN_SHOWN_SHARE = 0.9

_ALPHABET = (string.ascii_letters + string.digits + "+/-_").encode("ascii")
_ONLY_ALPHABET = bytes(
    ord("A") if byte in _ALPHABET else ord(" ") for byte in range(256))
_LONG_RUN = b"A" * MIN_RUN_CHARS
_HEX_DIGITS = (string.hexdigits).encode("ascii")
_HEX_OR_APART = bytes(
    ord("h") if byte in _HEX_DIGITS else ord(" ") if byte in b" :" else ord("x")
    for byte in range(256))
_LONG_SPACED_HEX = b" ".join([b"hh"] * (MIN_RUN_CHARS // 2))
# A run, and the first word of each line after it (MIME wraps base64 at 76;
# _wrapped_run keeps the lines that decode with it).
_RUN = re.compile(
    rf"[A-Za-z0-9+/_-]{{{MIN_RUN_CHARS},}}={{0,2}}"
    r"(?:[ \t]*\r?\n[ \t]*[A-Za-z0-9+/_-]{2,}={0,2})*")
_LINE = re.compile(r"[A-Za-z0-9+/_=-]+")
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+")
# Hex bytes written apart ("48 65 6c", "48:65:6c"): the pairs are the run.
_SPACED_HEX = re.compile(
    rf"(?<![0-9A-Za-z])[0-9a-fA-F]{{2}}(?:[ :][0-9a-fA-F]{{2}}){{{MIN_RUN_CHARS // 2 - 1},}}"
    r"(?![0-9A-Za-z])")
_ROT13 = bytes.maketrans(string.ascii_letters.encode("ascii"), "".join(
    letters[13:] + letters[:13] for letters in (string.ascii_lowercase, string.ascii_uppercase)
).encode("ascii"))


def rot13(text: str) -> str:
    """`text` with its ASCII letters rotated by 13 (bytes.translate: C, no dict lookups)."""
    if text.isascii():
        return text.encode("ascii").translate(_ROT13).decode("ascii")
    return "".join(rot13(c) if c.isascii() else c for c in text)


def rot13_reading(first: Reading) -> Reading:
    """`first` (a text's first reading) in rot13, at its offsets. (A list of
    rot13'd common words as the test for making it missed whole lines of the
    key: "That's somebody's salary. That's somebody who's gonna get fired.")"""
    return Reading(first.original, rot13(first.text), first.starts, first.ends,
                   rot13(" ".join(first.tokens)).split(), screen_first=True)


def encoded_readings(text: str, offsets: bool,
                     read: Callable[[str, bool], list[Reading]]) -> list[Reading]:
    """The readings (`read`: textnorm's, one level down) of what each encoded
    run of `text` decodes to, as readings of `text`: every character of them
    comes from the whole run. One run at a time: no quote is made of the end
    of one run and the start of the next. [] for most texts."""
    out = []
    for start, end, decoded in decoded_runs(text):
        for inner in read(decoded, offsets):
            size = len(inner.text)
            out.append(Reading(text, inner.text, [start] * size if offsets else None,
                               [end] * size if offsets else None, inner.tokens,
                               focus=inner.focus, screen_first=inner.screen_first))
    return out


def decoded_runs(text: str) -> list[tuple[int, int, str]]:
    """(start, end, decoded text) of every encoded run of `text` that reads as text."""
    raw = text.encode("utf-8", "surrogatepass")
    runs: list[tuple[int, int, str]] = []
    if _LONG_RUN in raw.translate(_ONLY_ALPHABET):
        for m in _RUN.finditer(text):
            runs += _wrapped_run(m)
    if _LONG_SPACED_HEX in raw.translate(_HEX_OR_APART):
        for m in _SPACED_HEX.finditer(text):
            if (decoded := _as_text(bytes.fromhex(m.group().replace(":", " ")))) is not None:
                runs.append((m.start(), m.end(), decoded))
    return sorted(runs)


def _wrapped_run(m: re.Match[str]) -> list[tuple[int, int, str]]:
    """A run over lines, as long as it decodes: the line after a wrapped run
    may be prose that starts with a word of the alphabet ("QUFB...\nThen")."""
    lines = list(_LINE.finditer(m.group()))
    for last in range(len(lines), 0, -1):
        decoded = _decode_run("".join(line.group() for line in lines[:last]))
        if decoded is not None:
            return [(m.start(), m.start() + lines[last - 1].end(), decoded)]
    return []


def _decode_run(run: str) -> str | None:
    if _HEX.fullmatch(run) and (decoded := _as_text(bytes.fromhex(run))) is not None:
        return decoded
    body = run.rstrip("=")
    if ("-" in body or "_" in body) and ("+" in body or "/" in body):
        return None  # two alphabets: not one encoding (a path, a slug)
    body = body.replace("-", "+").replace("_", "/")
    body = body[: len(body) - len(body) % 4] if len(body) % 4 == 1 else body
    try:
        data = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None
    return _as_text(data)


def _as_text(data: bytes) -> str | None:
    """`data` as text if it is UTF-8 that reads (a cut-off last character is let go)."""
    for cut in range(4):  # an encoding cut short may end inside a character
        try:
            text = data[: len(data) - cut].decode("utf-8")
            break
        except UnicodeDecodeError:
            continue
    else:
        return None
    if not text or not any(c.isalpha() for c in text):
        return None
    shown = sum(c.isprintable() or c in "\n\r\t" for c in text)
    return text if shown >= MIN_SHOWN_SHARE * len(text) else None
