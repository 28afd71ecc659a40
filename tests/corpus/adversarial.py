"""Attacks on the leak guard, built from the corpus key (tests/corpus/README.md).

Stdlib only, so bench/leakguard_bench.py uses the same attacks as the tests.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import hashlib
import json
import quopri
import re
import string
import urllib.parse
from collections.abc import Callable
from pathlib import Path

CORPUS = Path(__file__).resolve().parent
KEY_DIR = CORPUS / "american_beauty"
WORK = "american_beauty"

# Lines of the key made of common words: no 7-word window of them holds two
# content words, so the 7-word rule alone let them through (issue 11, class 1);
# measured with HumanIndex.build(..., long_n=99), i.e. rule 1 off.
LONG_COMMON = [
    "What a lame-o. Somebody really should put him out of his misery.",
    "What in the world is wrong with her? She had a walk this morning.",
    "I just love your roses. How do you get them to flourish like this?",
    "But I don't want to lie to her.",
    "Possibly. But you don't want to be unemployed.",
    "--you couldn't possibly care any less, could you?",
    "Honey, I'm sorry. I... I'm sorry I haven't been more available, I just... I'm...",
    # and a long voice-over line, 33 words
    "I have lost something. I'm not exactly sure what it is, but I know I didn't "
    "always feel this... sedated. But you know what? It's never too late to get it back.",
]
CROSS_RANGE = "Oh, well, let's just all sell our souls and work for Satan, because it's more convenient that way."  # noqa: E501 - ep05

_CYRILLIC = str.maketrans("aeopcxyiAEOPCXHTMK", "аеорсхуіАЕОРСХНТМК")
_GREEK = str.maketrans("oivAEOTKIN", "οινΑΕΟΤΚΙΝ")


def _inside(mark: str) -> Callable[[str], str]:
    """`mark` in the middle of every word of four letters or more."""
    return lambda s: re.sub(r"\b(\w\w)(\w\w+)", lambda m: m.group(1) + mark + m.group(2), s)


def _between(mark: str) -> Callable[[str], str]:
    """Words joined by `mark` instead of spaces."""
    return lambda s: mark.join(s.split())


# Every disguise the guard must see through; each keeps the words, changes the text.
# Latin letter small capitals (IPA, and the "small caps" of Unicode text generators).
_SMALL_CAPITALS = str.maketrans({
    "a": "\u1d00", "b": "\u0299", "c": "\u1d04", "d": "\u1d05", "e": "\u1d07", "f": "\ua730",
    "g": "\u0262", "h": "\u029c", "i": "\u026a", "j": "\u1d0a", "k": "\u1d0b", "l": "\u029f",
    "m": "\u1d0d", "n": "\u0274", "o": "\u1d0f", "p": "\u1d18", "r": "\u0280", "s": "\ua731",
    "t": "\u1d1b", "u": "\u1d1c", "v": "\u1d20", "w": "\u1d21", "y": "\u028f", "z": "\u1d22",
})

_MORSE = dict(zip("abcdefghijklmnopqrstuvwxyz0123456789'-.,?!:", (
    ".- -... -.-. -.. . ..-. --. .... .. .--- -.- .-.. -- -. --- .--. --.- .-. ... - ..- "
    "...- .-- -..- -.-- --.. ----- .---- ..--- ...-- ....- ..... -.... --... ---.. ----. "
    ".----. -....- .-.-.- --..-- ..--.. -.-.-- ---...").split(), strict=True))

def _part_plain(line: str, encode: Callable[[str], str]) -> str:
    """The line's first third as it is, the rest encoded."""
    words = line.split()
    plain = len(words) // 3
    return " ".join(words[:plain]) + " " + encode(" ".join(words[plain:]))


_PRINTABLE = "".join(map(chr, range(33, 127)))
_ROT47 = str.maketrans(_PRINTABLE, _PRINTABLE[47:] + _PRINTABLE[:47])


_ATBASH = str.maketrans(string.ascii_lowercase + string.ascii_uppercase,
                        string.ascii_lowercase[::-1] + string.ascii_uppercase[::-1])


def _caesar(text: str, shift: int) -> str:
    lower, upper = string.ascii_lowercase, string.ascii_uppercase
    k = shift % 26
    return text.translate(str.maketrans(lower + upper,
                                        lower[k:] + lower[:k] + upper[k:] + upper[:k]))


DISGUISES: dict[str, Callable[[str], str]] = {
    "plain": lambda s: s,
    "upper": str.upper,
    "curly and dashes": lambda s: s.replace("'", "\u2019").replace("...", "\u2026").replace(
        ", ", " \u2014 "),
    "line-wrapped": lambda s: re.sub(r"(\S+ \S+ \S+) ", r"\1\n", s),
    "pipe-joined": _between("|"),
    "zero-width space between": _between("\u200b"),
    "zero-width joiner between": _between("\u200d"),
    "word joiner between": _between("\u2060"),
    "zero-width space inside": _inside("\u200b"),
    "soft hyphen inside": _inside("\u00ad"),
    "bidi mark inside": _inside("\u200e"),
    "BOM inside": _inside("\ufeff"),
    "soft hyphen inside, zero-width space between": lambda s: _between("\u200b")(
        _inside("\u00ad")(s)),
    "Cyrillic look-alikes": lambda s: s.translate(_CYRILLIC),
    "Greek look-alikes": lambda s: s.translate(_GREEK),
    "full-width": lambda s: "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in s),
    "HTML entities": lambda s: s.replace("'", "&#x27;").replace(" ", "&nbsp;"),
    "HTML rsquo": lambda s: s.replace("'", "&rsquo;"),
    "HTML numeric": lambda s: "".join(f"&#{ord(c)};" for c in s),
    "HTML nested": lambda s: s.replace("'", "&amp;#x27;").replace(" ", "&amp;nbsp;"),
    "JSON-escaped": lambda s: json.dumps(s.replace("'", "\u2019"))[1:-1],
    "JSON in JSON": lambda s: json.dumps(json.dumps({"msg": s}))[1:-1],
    "\\u escapes": lambda s: "".join(f"\\u{ord(c):04x}" for c in s),
    "\\x escapes": lambda s: "".join(f"\\x{ord(c):02x}" if ord(c) < 256 else c for c in s),
    "URL-encoded": urllib.parse.quote,
    "URL-encoded, every byte": lambda s: "".join(f"%{b:02X}" for b in s.encode()),
    # Markup inside words (issue 34): a reader does not see it, a scanner that
    # splits words there does.
    "backtick inside": _inside("`"),
    "star inside": _inside("*"),
    "bold inside": lambda s: re.sub(r"\b(\w\w)(\w\w)(\w+)", r"\1**\2**\3", s),
    "underscore inside": _inside("_"),
    "tilde inside": _inside("~"),
    "backtick for apostrophe": lambda s: _inside("`")(s.replace("'", "`")),
    "combining mark inside": _inside("\u0301"),
    "HTML backtick inside": _inside("&#96;"),
    "soft hyphen at line breaks": lambda s: re.sub(
        r"\b(\w\w)(\w\w+)", lambda m: m.group(1) + "\u00ad\n" + m.group(2), s),
    "hyphen at line breaks": lambda s: re.sub(
        r"\b(\w\w)(\w\w+)", lambda m: m.group(1) + "-\n" + m.group(2), s),
    "backtick inside, line-wrapped": lambda s: re.sub(r"(\S+ \S+ \S+) ", r"\1\n",
                                                      _inside("`")(s)),
    "HTML tags inside": _inside("<b></b>"),
    "Markdown escape inside": _inside("\\_"),
    # Characters Unicode shows as nothing or as a blank that are not format
    # characters (Default_Ignorable_Code_Point), and Latin letters NFKC keeps:
    # a helper's review got each past the guard.
    "Mongolian free variation selector inside": _inside("\u180b"),
    "variation selector 17 inside": _inside("\U000e0100"),
    "combining grapheme joiner inside": _inside("\u034f"),
    "Hangul filler between": _between("\u3164"),
    "halfwidth Hangul filler between": _between("\uffa0"),
    "small capitals": lambda s: s.translate(_SMALL_CAPITALS),
    "Latin alpha and script g": lambda s: s.replace("a", "\u0251").replace("g", "\u0261"),
    "Latin letters with hooks": lambda s: s.replace("d", "\u0257").replace("h", "\u0266"),
    # Encodings a model can write a line in (rule 1: "text in an encoding").
    "base64": lambda s: base64.b64encode(s.encode()).decode(),
    "base64 URL-safe, unpadded": lambda s: base64.urlsafe_b64encode(
        s.encode()).decode().rstrip("="),
    "base64 wrapped at 76": lambda s: base64.encodebytes(s.encode()).decode(),
    "base64 of base64": lambda s: base64.b64encode(base64.b64encode(s.encode())).decode(),
    "base64 of escaped": lambda s: base64.b64encode(json.dumps(s).encode()).decode(),
    "hex": lambda s: s.encode().hex(),
    "hex bytes apart": lambda s: s.encode().hex(" "),
    "rot13": lambda s: codecs.encode(s, "rot13"),
    # A review's holes in the first reading of encodings: a run on the line
    # above, a prefix glued on, a block in a JSON string, rot13 with a second
    # disguise, bytes in another encoding.
    "base64 under a digest line": lambda s: hashlib.sha256(s.encode()).hexdigest() + "\n"
    + base64.b64encode(s.encode()).decode(),
    "base64 glued to a word": lambda s: "b64_" + base64.b64encode(s.encode()).decode(),
    "base64 in a URL": lambda s: "https://x.example/p/" + base64.b64encode(s.encode()).decode(),
    "hex after 0x": lambda s: "0x" + s.encode().hex(),
    "base64 wrapped, in a JSON string": lambda s: json.dumps(
        base64.encodebytes(("Body: " + "x " * 40 + s).encode()).decode())[1:-1],
    "rot13, zero-width spaces between": lambda s: "\u200b".join(codecs.encode(s, "rot13").split()),
    "rot13, backticks inside": lambda s: _inside("`")(codecs.encode(s, "rot13")),
    "base64 of UTF-16": lambda s: base64.b64encode(s.encode("utf-16-le")).decode(),
    "base64 of cp1252": lambda s: base64.b64encode(
        s.replace("'", "\u2019").encode("cp1252", "replace")).decode(),
    # What the first readings of encodings left (issue 36, thirteenth pass):
    # other schemes, bytes as lists of numbers, narrow wrapping, a reversal.
    "base32": lambda s: base64.b32encode(s.encode()).decode(),
    "base32, lower case, unpadded": lambda s: base64.b32encode(s.encode()).decode().lower()
    .rstrip("="),
    "bytes in decimal": lambda s: ", ".join(str(b) for b in s.encode()),
    "bytes as 0x, apart": lambda s: " ".join(f"0x{b:02X}" for b in s.encode()),
    "bytes in binary": lambda s: " ".join(f"{b:08b}" for b in s.encode()),
    "octal escapes": lambda s: "".join(f"\\{b:03o}" for b in s.encode()),
    "hex of UTF-16, big-endian": lambda s: s.encode("utf-16-be").hex(),
    "base64 wrapped at 16": lambda s: "\n".join(re.findall(".{1,16}",
                                                          base64.b64encode(s.encode()).decode())),
    "reversed": lambda s: s[::-1],
    # Backwards by words: their order, or each word's letters (a word: a run of
    # letters, as the guard reads one; "king-sized" as one word is a miss).
    "words in reverse order": lambda s: " ".join(re.findall(r"[\w']+", s)[::-1]),
    "each word reversed": lambda s: re.sub(r"[\w']+", lambda m: m.group()[::-1], s),
    # The base64 module's other encodings.
    "Ascii85": lambda s: base64.a85encode(s.encode()).decode(),
    "Ascii85, Adobe, wrapped": lambda s: base64.a85encode(s.encode(), adobe=True,
                                                          wrapcol=40).decode(),
    "base85": lambda s: base64.b85encode(s.encode()).decode(),
    "base32hex": lambda s: base64.b32hexencode(s.encode()).decode(),
    # Quoted-printable: spaces quoted too, or curly apostrophes as bytes; its
    # lines broken at 76 characters, in a word too.
    "quoted-printable, spaces quoted": lambda s: quopri.encodestring(
        s.encode(), quotetabs=True).decode(),
    "quoted-printable, curly apostrophes": lambda s: quopri.encodestring(
        s.replace("'", "\u2019").encode()).decode(),
    # Every byte quoted (=54=68=65), and code points as Unicode writes them.
    "quoted-printable, every byte": lambda s: "".join(f"={b:02X}" for b in s.encode()),
    "code points, U+": lambda s: " ".join(f"U+{ord(c):04X}" for c in s),
    # CSS's escapes (zero-padded, a blank after each) and JavaScript's escape().
    "CSS escapes": lambda s: "".join(f"\\{ord(c):06x} " for c in s),
    "%u escapes": lambda s: "".join(f"%u{ord(c):04X}" for c in s),
    "bytes in binary, nothing between": lambda s: "".join(f"{b:08b}" for b in s.encode()),
    # A quote part plain, part encoded: its run crosses the seam. (An encoded
    # part under 24 characters, 18 bytes, is too short to be read at all.)
    "a third plain, the rest base64": lambda s: _part_plain(
        s, lambda rest: base64.b64encode(rest.encode()).decode()),
    "a third plain, the rest hex": lambda s: _part_plain(s, lambda rest: rest.encode().hex()),
    # Or in a cipher: only its words that are not the key's as written are undone.
    "a third plain, the rest Caesar 3": lambda s: _part_plain(s, lambda rest: _caesar(rest, 3)),
    "a third plain, the rest Atbash": lambda s: _part_plain(s, lambda rest: rest.translate(
        _ATBASH)),
    # Base64 or hex in words: each word encoded alone, or the run cut in groups.
    "base64, each word": lambda s: " ".join(base64.b64encode(w.encode()).decode()
                                            for w in s.split()),
    "base64 in groups of 4": lambda s: " ".join(re.findall(".{1,4}", base64.b64encode(
        s.encode()).decode())),
    "hex, each word": lambda s: " ".join(w.encode().hex() for w in s.split()),
    "hex in groups of 4": lambda s: " ".join(re.findall(".{1,4}", s.encode().hex())),
    # A review's holes in those: line breaks between numbers, a JSON string,
    # Markdown around a narrow block.
    "bytes in decimal, 12 a line": lambda s: "\n".join(
        " ".join(str(b) for b in s.encode()[i:i + 12]) for i in range(0, len(s.encode()), 12)),
    "bytes as 0x, a C array's rows": lambda s: ",\n".join(
        ", ".join(f"0x{b:02x}" for b in s.encode()[i:i + 8]) for i in range(0, len(s.encode()), 8)),
    "hex bytes apart by commas": lambda s: ", ".join(f"{b:02x}" for b in s.encode()),
    "octal escapes in a JSON string": lambda s: json.dumps(
        "".join(f"\\{b:03o}" for b in s.encode()))[1:-1],
    "base64 at 16, in a JSON string": lambda s: json.dumps(
        "\n".join(re.findall(".{1,16}", base64.b64encode(s.encode()).decode())))[1:-1],
    "base64 at 16, quoted in Markdown": lambda s: "\n> " + "\n> ".join(
        re.findall(".{1,16}", base64.b64encode(s.encode()).decode())) + "\n",
    # Caesar's other shifts (rot13 is above).
    "Caesar, shifted by 3": lambda s: _caesar(s, 3),
    "Caesar, shifted by 1": lambda s: _caesar(s, 1),
    "Caesar, shifted back by 5": lambda s: _caesar(s, -5),
    # Atbash: a for z, b for y, ... (its own inverse).
    "Atbash": lambda s: s.translate(_ATBASH),
    # Morse code: letters apart by a space, words by " / " (or three spaces).
    "Morse code": lambda s: " / ".join(" ".join(_MORSE[c] for c in w.lower() if c in _MORSE)
                                       for w in s.split()),
    "Morse code, words three spaces apart": lambda s: "   ".join(
        " ".join(_MORSE[c] for c in w.lower() if c in _MORSE) for w in s.split()),
    # Digits for the letters they look like (a o e i s t).
    "leetspeak": lambda s: s.translate(str.maketrans("aAoOeEiIsStT", "440033115577")),
    "leetspeak, vowels only": lambda s: s.translate(str.maketrans("aAoOeEiI", "44003311")),
    # ROT47: printable ASCII moved 47 places (letters become digits and punctuation).
    "ROT47": lambda s: s.translate(_ROT47),
    # uuencode as the tool writes it (begin, lines of 45 bytes, end), and its
    # lines alone with their trailing blanks cut, backquotes for blanks.
    "uuencode": lambda s: codecs.encode(s.encode(), "uu").decode(),
    "uuencode lines, blanks cut": lambda s: "\n".join(
        binascii.b2a_uu(s.encode()[i:i + 45]).decode().rstrip()
        for i in range(0, len(s.encode()), 45)),
    "uuencode lines, backquotes": lambda s: "\n".join(
        binascii.b2a_uu(s.encode()[i:i + 45], backtick=True).decode().rstrip()
        for i in range(0, len(s.encode()), 45)),
}

# The line spelled out: its words are gone, its letters stay (leakguard_spelled).
# Read by letter windows, so a line under SPELLED_CHARS letters, or of stock
# words only, is not found (SPELLED_MISSES); kept apart from DISGUISES, whose
# every entry finds every line.
SPELLED_DISGUISES: dict[str, Callable[[str], str]] = {
    "letter-spaced": lambda s: " ".join(s),
    "letter-spaced, words three apart": lambda s: "   ".join(" ".join(w) for w in s.split()),
    "letters dotted": lambda s: " ".join(".".join(w) for w in s.split()),
    "letters hyphenated, upper": lambda s: " ".join("-".join(w) for w in s.upper().split()),
    "letters spaced by zero-width spaces": lambda s: "\u200b".join(s.replace(" ", "")),
    "words run together, marks kept": lambda s: "".join(s.split()),
}
SPELLED_MISSES = {
    "But I don't want to lie to her.",  # 22 letters
    "Well, you want to know how things went at my job today?",  # stock words only
}


def key() -> dict[int, str]:
    """The answer key: episode number -> text."""
    return {int(p.stem[2:]): p.read_text(encoding="utf-8") for p in sorted(KEY_DIR.glob("ep*.txt"))}


def quotable_lines(episodes: dict[int, str], min_words: int = 8) -> list[str]:
    """Every dialogue or action line of the key with at least `min_words` words."""
    lines = []
    for text in episodes.values():
        for line in text.splitlines():
            line = line.strip()
            if len(line.split()) >= min_words and not line.isupper() and line[0] != "(":
                lines.append(line)
    return lines


def report_quoting(quote: str) -> str:
    """A craft report with `quote` in the middle of its prose."""
    return (
        "The human version lets the image carry the scene and keeps the narration dry.\n\n"
        f"Its best moment is this: {quote} The model explains the same beat twice.\n\n"
        "Cut the second explanation and end the scene on the look.\n"
    )


def error_echoes(prompt: str) -> dict[str, str]:
    """Provider error messages that echo `prompt`, in the disguises providers use.

    The echo is 60 words of the prompt from the first line of the key it holds.
    """
    start = min(i for line in quotable_lines(key()) if (i := prompt.find(line)) >= 0)
    tail = " ".join(prompt[start:].split()[:60])
    return {
        "upper-cased": f"Invalid request: {tail.upper()}",
        "pipe-joined": "tokens: " + "|".join(tail.split()),
        "zero-width-joined": "bad input " + "\u200b".join(tail.split()),
        "JSON-escaped": "body=" + json.dumps({"messages": [{"content": tail}]}),
        "base64": "request_b64=" + base64.b64encode(tail.encode()).decode(),
    }
