"""Base64 or hex split into words: each word of a line encoded alone
(`VGhl bW9uZXk= aXM=`, `546865 6d6f6e6579`), or the encoded line cut into
groups apart by spaces (`VGhl IG1v bmV5`, `5468 6520 6d6f`).

Neither leaves a run long enough for textnorm_encoded's blocks. A run of
MIN_TOKENS words of one alphabet or more is read both ways: joined whole
(groups), and word by word (each stretch of MIN_TOKENS words or more that
decode one by one to words). Each is one more encoded stretch of
textnorm_encoded.

Prose is words of base64's alphabet too, so C calls say first whether a text
has such words at all: base64 of text puts a capital after a small letter
inside a word (`dGhl`, `aGVy`) a few times a line, and prose seldom does;
hex in words of four digits or more, two of them apart by one space, is
rarer still in prose (the corpus: none in any of its texts).
"""
from __future__ import annotations

import binascii
import re
from collections.abc import Callable

# A quote of 7 words is 7 words encoded alone; cut in groups, more.
MIN_TOKENS = 4
# Small letter, capital: a few in every line of base64 words; none in most prose.
MIN_INNER_CAPITALS = 3
REACH = 2  # plain-looking words tried at each end of a run's encoded ones
MIN_HEX_PAIRS = 2  # "hhhh hhhh": two hex words of four digits or more, one space apart
_CASE = bytes(ord("a") if 97 <= c <= 122 else ord("U") if 65 <= c <= 90 else ord(" ")
              for c in range(256))
_HEX_CLASS = bytes(ord("h") if chr(c) in "0123456789abcdefABCDEF" else ord(" ") if c == 32
                   else ord("x") for c in range(256))
_HEX_WORDS = b"hhhh hhhh"
# Words apart by spaces, none glued to other text. (Lines of one encoding are
# textnorm_encoded's blocks.)
_APART = r"[ \t]+"


def _words_run(word: str) -> re.Pattern[str]:
    """MIN_TOKENS words or more, each matching `word`, apart by spaces."""
    return re.compile(rf"(?<![^\s]){word}(?:{_APART}{word}){{{MIN_TOKENS - 1},}}(?![^\s])")


_BASE64_RUN = _words_run(r"[A-Za-z0-9+/]{2,}={0,2}")
_HEX_RUN = _words_run(r"(?:[0-9a-fA-F]{2})+")
_WORD = re.compile(r"\S+")
# Looks encoded: a digit, "+", "/" or "=", or a capital after a small letter
# (base64); a digit (hex: every byte of text has one).
_BASE64_LOOK = re.compile(r"[0-9+/=]|[a-z][A-Z]")
_HEX_LOOK = re.compile(r"[0-9]")
_A_WORD = re.compile(r"[-\"'(\[*_\u2014\u2018\u201c]{0,4}[^\W_]+(?:['\u2019-][^\W_]+)*"
                     r"[-.,;:!?'\")\]*_\u2014\u2019\u201d\u2026]{0,6}")

AsText = Callable[[bytes], "str | None"]


def decoded_runs(text: str, raw: bytes, decode_run: Callable[[str], str | None],
                 as_text: AsText) -> list[tuple[int, int, str]]:
    """(start, end, decoded text) of each run of `text` (`raw`: its UTF-8) in
    base64 or hex words that reads, joined (`decode_run`: textnorm_encoded's
    run decoder) or word by word (`as_text`: whether bytes read as text)."""
    found: list[tuple[int, int, str]] = []
    if raw.translate(_CASE).count(b"aU") >= MIN_INNER_CAPITALS:
        found += _runs(text, _BASE64_RUN, _BASE64_LOOK, decode_run,
                       lambda word: _base64_word(word, as_text))
    if raw.translate(_HEX_CLASS).count(_HEX_WORDS) >= MIN_HEX_PAIRS:
        found += _runs(text, _HEX_RUN, _HEX_LOOK, decode_run,
                       lambda word: as_text(bytes.fromhex(word)))
    return found


def _runs(text: str, pattern: re.Pattern[str], looks_encoded: re.Pattern[str],
          decode_run: Callable[[str], str | None],
          decode_word: Callable[[str], str | None]) -> list[tuple[int, int, str]]:
    """Each run of words of the alphabet, from its first word that looks
    encoded to its last (prose around it is of the alphabet too), and up to
    REACH words more at each end that decode alone ("Smlt" is "Jim": a
    group or a word may look plain)."""
    found: list[tuple[int, int, str]] = []
    for run in pattern.finditer(text):
        words = [(m.start() + run.start(), m.end() + run.start(), m.group())
                 for m in _WORD.finditer(run.group())]
        encoded = [k for k, (*_, word) in enumerate(words) if looks_encoded.search(word)]
        if len(encoded) < 2 or encoded[-1] - encoded[0] + 1 < MIN_TOKENS:
            continue
        first, last = encoded[0], encoded[-1]
        for _ in range(REACH):
            if first > 0 and decode_word(words[first - 1][2]) is not None:
                first -= 1
            if last < len(words) - 1 and decode_word(words[last + 1][2]) is not None:
                last += 1
        words = words[first:last + 1]
        if (whole := decode_run("".join(word for *_, word in words))) is not None:
            found.append((words[0][0], words[-1][1], whole))
        found += _word_by_word(words, lambda word: _word(decode_word(word)))
    return found


def _word_by_word(words: list[tuple[int, int, str]], decode_word: Callable[[str], str | None]
                  ) -> list[tuple[int, int, str]]:
    """Each stretch of MIN_TOKENS words or more that decode to text one by one."""
    found: list[tuple[int, int, str]] = []
    stretch: list[tuple[int, int, str]] = []
    for start, end, word in [*words, (0, 0, "")]:  # "": the last stretch ends
        decoded = decode_word(word) if word else None
        if decoded is not None:
            stretch.append((start, end, decoded))
            continue
        if len(stretch) >= MIN_TOKENS:
            found.append((stretch[0][0], stretch[-1][1], " ".join(d for *_, d in stretch)))
        stretch = []
    return found


def _base64_word(word: str, as_text: AsText) -> str | None:
    """One word of base64 (padded or not) decoded, if it reads as text."""
    body = word.rstrip("=")
    if len(body) % 4 == 1:
        return None
    try:
        decoded = as_text(binascii.a2b_base64(body + "=" * (-len(body) % 4), strict_mode=True))
    except binascii.Error:
        return None
    return decoded if decoded is not None and decoded.isprintable() else None


def _word(decoded: str | None) -> str | None:
    """`decoded` if it is one word as a line's words are (letters, an
    apostrophe or stop beside them): not a blank, not bytes that only happen
    to be printable."""
    return decoded if decoded is not None and _A_WORD.fullmatch(decoded) else None
