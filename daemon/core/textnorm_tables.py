"""Characters textnorm folds to the ASCII an English reader sees in them:
letters of other scripts that look like Latin ones, typography, letters
NFKD does not decompose, and characters shown as nothing. Data, and what
textnorm's modules share about characters: is_format, and ONE_BYTE (an
encoding that keeps a text's offsets); textnorm applies them."""
from __future__ import annotations

import codecs
import unicodedata

APOSTROPHE = "'"
# Letters that look like Latin ones, mapped to them (lower case: folded after).
LOOKALIKES = str.maketrans({
    # Cyrillic
    "а": "a", "в": "b", "е": "e", "ё": "e", "к": "k", "м": "m", "н": "h", "о": "o",
    "р": "p", "с": "c", "т": "t", "у": "y", "х": "x", "і": "i", "ї": "i", "ј": "j",
    "ѕ": "s", "ԁ": "d", "һ": "h", "ԛ": "q", "ԝ": "w", "ӏ": "l", "ь": "b", "ɡ": "g",
    "А": "a", "В": "b", "Е": "e", "Ё": "e", "К": "k", "М": "m", "Н": "h", "О": "o",
    "Р": "p", "С": "c", "Т": "t", "У": "y", "Х": "x", "І": "i", "Ї": "i", "Ј": "j",
    "Ѕ": "s", "Һ": "h", "Ԛ": "q", "Ԝ": "w", "Ӏ": "l",
    # Greek
    "α": "a", "β": "b", "ε": "e", "ι": "i", "κ": "k", "ν": "v", "ο": "o", "ρ": "p",
    "τ": "t", "υ": "u", "χ": "x", "ϲ": "c", "ϳ": "j",
    "Α": "a", "Β": "b", "Ε": "e", "Ζ": "z", "Η": "h", "Ι": "i", "Κ": "k", "Μ": "m",
    "Ν": "n", "Ο": "o", "Ρ": "p", "Τ": "t", "Υ": "y", "Χ": "x", "Ϲ": "c",
})
# Typography an ASCII character stands for without changing a word.
TYPOGRAPHY = (
    {c: APOSTROPHE for c in "\u2019\u2018\u02bc\u2032\uff07"}
    | {c: '"' for c in "\u201c\u201d\u201e\u00ab\u00bb\u2033"}
    | {c: "-" for c in "\u2010\u2011\u2012\u2013\u2014\u2015\u2212"}
    | {c: " " for c in "\u00a0\u2009\u200a\u202f\u2026\u2022\u00b7\u3000"}
)
# Letters that NFKD does not decompose but an English writer types without.
LETTERS = str.maketrans({"œ": "oe", "æ": "ae", "ø": "o", "ł": "l", "đ": "d", "ı": "i"})
# Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties.txt) beyond
# category Cf: shown as nothing, or as a blank (the Hangul fillers), so a
# reader sees through them as through a zero-width space.
IGNORABLE_RANGES = ((0x034F, 0x034F), (0x115F, 0x1160), (0x17B4, 0x17B5), (0x180B, 0x180F),
                    (0x2065, 0x2065), (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFFA0, 0xFFA0),
                    (0xFFF0, 0xFFF8), (0xE0000, 0xE0FFF))
# Those that attach to the character before them (selectors, the grapheme
# joiner, Khmer's inherent vowels): inside a word in the reading by use.
ATTACHING = "".join(chr(c) for lo, hi in ((0x034F, 0x034F), (0x17B4, 0x17B5), (0x180B, 0x180D),
                                         (0x180F, 0x180F), (0xFE00, 0xFE0F), (0xE0100, 0xE01EF))
                    for c in range(lo, hi + 1))


def is_format(ch: str) -> bool:
    """A format character, or another one Unicode says to show as nothing."""
    code = ord(ch)
    return unicodedata.category(ch) == "Cf" or any(lo <= code <= hi
                                                   for lo, hi in IGNORABLE_RANGES)


def _as_delete(error: UnicodeError) -> tuple[str, int]:
    assert isinstance(error, UnicodeEncodeError)
    return "\x7f" * (error.end - error.start), error.end


# An encoding error handler: each character past ASCII (a surrogate too) as
# one DEL, a byte of no encoding's alphabet, so `text.encode("ascii",
# ONE_BYTE)` has the text's offsets and its scans can be bytes.translate and
# bytes.find (C: a regex over a 50 MiB log cost seconds).
ONE_BYTE = "skilltrain-one-byte"
codecs.register_error(ONE_BYTE, _as_delete)
