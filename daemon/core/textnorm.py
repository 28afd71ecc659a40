"""One normalisation of text for the leak guard and the audit.

A quote of the answer key must be found however it is dressed: in upper
case, with curly quotes, accents, HTML entities (`&#x27;`, `&rsquo;`,
`&amp;rsquo;`), JSON or Python escapes (`\\u2019`, `\\xe9`, `\\"`), URL
encoding (`%E2%80%99`), quoted-printable (`=E2=80=99`), zero-width
characters or soft hyphens inside words, words joined by zero-width
joiners, or letters swapped for their Cyrillic or Greek look-alikes. The
guard (before a report is written) and the audit (after the fact) see text
through this one module, so what one finds the other finds.

Steps, in order:
1. escapes decoded (textnorm_escapes): HTML entities, \\uXXXX \\UXXXXXXXX \\xHH
   and the one-letter escapes (\\n \\t \\" ...), CSS's and %uXXXX, %XX and =XX
   runs that form UTF-8 characters (quoted-printable's soft line breaks too,
   in a text with an =XX), code points (U+0054); repeated
   while anything changes (up to DECODE_LEVELS: `&amp;#x27;`, a JSON string
   inside a JSON log line). Decoded control characters separate words;
   decoded format characters (`&shy;`) are kept for step 2.
   Then a soft hyphen at a line's end joins the word across the break.
2. every non-ASCII character folded on its own: format characters (category
   Cf: zero-width space and joiners, soft hyphen, word joiner, BOM, bidi
   marks) and every other character Unicode says to show as nothing
   (Default_Ignorable_Code_Point: variation selectors, Mongolian free
   variation selectors, the combining grapheme joiner, Hangul fillers)
   removed -- or, in the second reading, made a word separator; look-alike
   letters to Latin; typography to ASCII (’ -> ', — -> -, nbsp -> space);
   NFKC (full-width letters, ligatures); case folded; accents stripped
   (NFKD without any combining mark); œ æ ø ł đ ı spelled out; a Latin
   letter NFKD keeps (small capital, alpha, script g, a letter with a hook)
   read as the letter its Unicode name says.
3. ASCII lower-cased; words are runs of letters and digits, apostrophes
   joining ("don't" -> "dont").
4. A reading with markup inside words is read once more with it removed
   (`_joined`): a backtick, star, underscore or tilde between two letters
   (grab`bed, gr*abbed, Wouldn`t for Wouldn't), a hyphen at a line's end
   inside a word. A person reads through them; the split reading stays
   beside it for words joined by them (what_in_the_world). The claims
   parser reads statistic names this way too (`words_as_read`).
5. Text in an encoding (textnorm_encoded): each reading in rot13 and
   backwards, and what each base64, base32, hex, byte-list, ROT47 or
   uuencoded stretch decodes to, read by steps 1-5 in turn (base64 of
   base64 too), each character of it mapped to the whole stretch.

A format character may sit inside a word ("fa<ZWSP>ther") or between words
("the<ZWJ>truth<ZWJ>is"); no rule tells which from the text alone. So a
text that has one is read three times: with them all removed, all as
separators, and each by its use (soft hyphen, joiners, word joiner and BOM
removed, zero-width space and bidi marks as separators, for a text that
mixes both); a quote found in any reading counts.

Every character of a reading remembers the span of original characters it
came from, so a word found in the normalised text maps back to the exact
characters of the original (an entity, an escape, a zero-width character
inside the word included) and the redaction cuts precisely those.

The common case -- ASCII prose without `&`, `\\` or `%` escapes -- is one C
call per step: bytes.translate and str.split, no Python loop per word.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable

from . import textnorm_encoded, textnorm_escapes
from .textnorm_reading import WORD as _WORD
from .textnorm_reading import Reading
from .textnorm_tables import APOSTROPHE as _APOSTROPHE
from .textnorm_tables import ATTACHING as _ATTACHING
from .textnorm_tables import IGNORABLE_RANGES as _IGNORABLE_RANGES
from .textnorm_tables import LETTERS as _LETTERS
from .textnorm_tables import LOOKALIKES as _LOOKALIKES
from .textnorm_tables import TYPOGRAPHY as _TYPOGRAPHY
from .textnorm_tables import is_format

DECODE_LEVELS = 4
# base64 of base64 of the key is read; a third encoding is not looked into.
ENCODED_LEVELS = 2
# Bump when any text reads differently: what was found clean before (the
# start audit's cache) may not be clean now.
VERSION = 10

# A Latin letter by its Unicode name: "LATIN LETTER SMALL CAPITAL H",
# "LATIN SMALL LETTER D WITH HOOK", "LATIN SMALL LETTER SCRIPT G". Turned and
# reversed letters do not match: they read as other letters.
_LATIN_NAME = re.compile(r"LATIN (?:SMALL |CAPITAL )?LETTER (?:SMALL CAPITAL |DOTLESS |SCRIPT )?"
                         r"([A-Z])(?: WITH [A-Z ]+)?")
_LATIN_NAMED = {"LATIN SMALL LETTER ALPHA": "a", "LATIN CAPITAL LETTER ALPHA": "a",
                "LATIN SMALL LETTER IOTA": "i", "LATIN CAPITAL LETTER IOTA": "i",
                "LATIN SMALL LETTER OPEN E": "e", "LATIN SMALL LETTER OPEN O": "o",
                "LATIN SMALL LETTER UPSILON": "u"}


def _fold_char(ch: str, format_as: str) -> str:
    """One non-ASCII character in its normalised form (any length, maybe empty)."""
    if is_format(ch):
        return format_as
    if ch in _TYPOGRAPHY:
        return _TYPOGRAPHY[ch]
    ch = ch.translate(_LOOKALIKES)
    s = unicodedata.normalize("NFKC", ch).casefold()
    if not s.isascii():
        s = "".join(c for c in unicodedata.normalize("NFKD", s)
                    if unicodedata.category(c) not in ("Mn", "Me")).translate(_LETTERS)
        s = "".join(_TYPOGRAPHY.get(c, c) for c in s.translate(_LOOKALIKES))
        s = "".join(c if c.isascii() else _latin_letter(c) for c in s)
    return s


def _latin_letter(ch: str) -> str:
    """The Latin letter `ch` is a variant of, by its Unicode name; else `ch`."""
    name = unicodedata.name(ch, "")
    if (match := _LATIN_NAME.fullmatch(name)) is not None:
        return match.group(1).lower()
    return _LATIN_NAMED.get(name, ch)


class _FoldTable(dict[int, str]):
    """str.translate table that folds each character the first time it is seen."""

    def __init__(self, format_as: str, joiners: str = "") -> None:
        super().__init__()
        self.format_as = format_as
        self.joiners = joiners  # format characters removed even when format_as is a space

    def fold_run(self, m: re.Match[str]) -> str:
        """A run of non-ASCII characters, folded (one translate per run)."""
        return m.group().translate(self)

    def fold_match(self, m: re.Match[str]) -> str:
        """The folded form of a one-character match, for `_sub`."""
        return self[ord(m.group())]

    def __missing__(self, code: int) -> str:
        ch = chr(code)
        folded = ch if code < 128 else _fold_char(ch, "" if ch in self.joiners else self.format_as)
        self[code] = folded
        return folded


_JOIN = _FoldTable("")  # format characters removed: inside a word
_SPLIT = _FoldTable(" ")  # format characters as separators: between words
# Each by its use: soft hyphen, joiners, word joiner and BOM inside words, the
# rest (zero-width space, bidi marks) between them; for a text that mixes both.
_BY_USE = _FoldTable(" ", joiners="\u00ad\u200c\u200d\u2060\ufeff" + _ATTACHING)

_NON_ASCII = re.compile(r"[^\x00-\x7f]")
_NON_ASCII_RUN = re.compile(r"[^\x00-\x7f]+")
# Every format character (category Cf) and other ignorable one: a text with
# none is read once.
_FORMAT = re.compile(
    "["
    + "".join(re.escape(chr(c)) for c in range(0x80, 0x10000)
              if unicodedata.category(chr(c)) == "Cf")
    + "\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3"
    + "\U0001d173-\U0001d17a\U000e0001-\U000e007f"
    + "".join(f"{re.escape(chr(lo))}-{re.escape(chr(hi))}" for lo, hi in _IGNORABLE_RANGES)
    + "]"
)
_ASCII_UPPER = str.maketrans({chr(c): chr(c + 32) for c in range(65, 91)})
# ASCII: letters and digits stay (lower-cased), the apostrophe goes, the rest separates.
_ASCII_TABLE = bytes(
    (c + 32 if 65 <= c <= 90 else c) if chr(c).isalnum() and c < 128 else 32 for c in range(256)
)
# Markup a reader does not see inside a word: Markdown's emphasis and code
# marks, a backtick typed for an apostrophe, a hyphen where a line broke a word.
_HYPHEN_BREAK = re.compile(r"-\r?\n[ \t]*")
_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9]{0,20}(?:\s[^<>]{0,200})?/?>|<!--.{0,200}?-->", re.S)
# _cuts' rule for the marks alone: a run of them with a letter or digit on
# both sides ([^\W_] is str.isalnum). A mark first, then what is before it:
# sre then skips to the marks instead of trying the class at every character.
_MARK_RUN = re.compile(r"[`*_~\\](?<=[^\W_][`*_~\\])[`*_~\\]*(?=[^\W_])")
# A soft hyphen where a line breaks (and the spaces around the break).
_SOFT_BREAK = re.compile(r"\u00ad[ \t]*\r?\n[ \t]*")


def _sub(pattern: re.Pattern[str], repl: Callable[[re.Match[str]], str], text: str,
         starts: list[int], ends: list[int]) -> tuple[str, list[int], list[int]]:
    """pattern.sub with the origin of every output character carried along."""
    out: list[str] = []
    new_starts: list[int] = []
    new_ends: list[int] = []
    pos = 0
    for m in pattern.finditer(text):
        s, e = m.span()
        out.append(text[pos:s])
        new_starts += starts[pos:s]
        new_ends += ends[pos:s]
        r = repl(m)
        out.append(r)
        new_starts += [starts[s]] * len(r)
        new_ends += [ends[e - 1]] * len(r)
        pos = e
    out.append(text[pos:])
    new_starts += starts[pos:]
    new_ends += ends[pos:]
    return "".join(out), new_starts, new_ends


def _decode_escapes(text: str, starts: list[int] | None,
                    ends: list[int] | None) -> tuple[str, list[int] | None, list[int] | None]:
    for _ in range(DECODE_LEVELS):
        before = text
        for first, pattern in textnorm_escapes.FAMILIES:
            if first not in text or (first == "=" and not textnorm_escapes.quoted_printable(text)):
                continue
            if starts is None or ends is None:
                text = pattern.sub(textnorm_escapes.decode, text)
            else:
                text, starts, ends = _sub(pattern, textnorm_escapes.decode, text, starts, ends)
        if text == before:
            break
    return text, starts, ends


def decode_escapes(text: str) -> str:
    """`text` with its entities, escapes and URL encoding decoded (step 1 only)."""
    return _decode_escapes(text, None, None)[0]


def _words(text: str) -> list[str]:
    if text.isascii():  # one C call per step, no Python call per word
        return text.encode("ascii").translate(_ASCII_TABLE, b"'").decode("ascii").split()
    return [w.replace(_APOSTROPHE, "") for w in _WORD.findall(text)]


def readings(text: str, *, offsets: bool = False,
             encoded_levels: int = ENCODED_LEVELS) -> list[Reading]:
    """The readings of `text`: one, or three when it has format characters;
    each once more with mid-word markup joined when it has some (`_joined`);
    each of those in rot13, the first backwards (three ways), the first ones
    in leetspeak if they have it; then those of what its encoded
    stretches decode to (textnorm_encoded), down to `encoded_levels`
    encodings deep.

    With offsets=False the origin lists are not built (the check of a clean
    text needs none); call again with offsets=True to map a hit back. The
    list has the same length and order either way.
    """
    unescaped = _decode_escapes(text, None, None)[0]
    out = _readings(text, offsets, unescaped)
    leet = [r for r in map(textnorm_encoded.leet_reading, out) if r is not None]
    out += [j for r in out if (j := _joined(r, offsets)) is not None]
    # Backwards: the first reading alone (a reversal with markup inside words
    # too is one disguise on another; each reading more costs the audit ~15 %).
    out += [textnorm_encoded.rot13_reading(r) for r in out] + \
        textnorm_encoded.backwards_readings(out[0], offsets) + leet
    if encoded_levels:
        out += textnorm_encoded.encoded_readings(
            text, offsets, lambda inner, at: readings(
                inner, offsets=at, encoded_levels=encoded_levels - 1),
            lambda inner, at: _readings(inner, at)[0], unescaped, lambda: _unescaped(text))
    return out


def _unescaped(text: str) -> tuple[str, list[int], list[int]]:
    """`text` with its escapes decoded, and the span each character came from."""
    decoded, starts, ends = _decode_escapes(text, list(range(len(text))),
                                            list(range(1, len(text) + 1)))
    assert starts is not None and ends is not None
    return decoded, starts, ends


def _readings(text: str, offsets: bool, decoded: str | None = None) -> list[Reading]:
    """The readings before the markup and encoded ones (`decoded`: the text's
    escapes decoded, if the caller has it)."""
    starts = ends = None
    if decoded is None:
        decoded = _decode_escapes(text, None, None)[0]
    if decoded.isascii() and decoded == text:  # nothing moved: offsets are the text's
        return [Reading(text, text, None, None, _words(text))]
    if offsets:
        decoded, starts, ends = _unescaped(text)
    if "\u00ad" in decoded:  # a soft hyphen at a line's end: the word goes on
        if starts is None or ends is None:
            decoded = _SOFT_BREAK.sub("", decoded)
        else:
            decoded, starts, ends = _sub(_SOFT_BREAK, _nothing, decoded, starts, ends)
    if decoded.isascii():
        return [Reading(text, decoded, starts, ends, _words(decoded))]
    # Only the non-ASCII runs are looked at: prose and logs are mostly ASCII.
    has_format: list[bool] = []

    def fold_joined(m: re.Match[str]) -> str:
        run = m.group()
        if not has_format and _FORMAT.search(run):
            has_format.append(True)
        return run.translate(_JOIN)

    joined = _NON_ASCII_RUN.sub(fold_joined, decoded)
    tables = [_JOIN, _SPLIT, _BY_USE] if has_format else [_JOIN]
    out = []
    for table in tables:
        if not offsets:
            folded = joined if table is _JOIN else _NON_ASCII_RUN.sub(table.fold_run, decoded)
            r_starts = r_ends = None
        else:
            assert starts is not None and ends is not None
            folded, r_starts, r_ends = _sub(_NON_ASCII, table.fold_match, decoded, starts, ends)
        low = folded.lower()
        if len(low) != len(folded):  # a letter lower() would expand: keep offsets aligned
            low = folded.translate(_ASCII_UPPER)
        out.append(Reading(text, low, r_starts, r_ends, _words(low)))
    return out


def _nothing(m: re.Match[str]) -> str:
    return ""


def _joined(reading: Reading, offsets: bool) -> Reading | None:
    """`reading` with markup inside words removed, as a person reads it
    (None: it has none).

    A backtick, star, underscore or tilde between two letters (grab`bed,
    gr*abbed, Wouldn`t, gr**ab**bed) and a hyphen at a line's end inside a
    word (grab-\\nbed) do not split the word for a reader. Nor can a rule
    tell `what_in_the_world` (words joined) from `grab_bed` (a word split),
    so this is a second reading beside the one that splits there: a quote
    found in either counts. `focus`: the joined words, the only ones whose
    shingles differ from the first reading's (None for marks alone without
    offsets: cut in one pass, the reading is read whole).
    """
    text = reading.text
    # One C scan per mark first: most texts have none.
    if not (any(c in text for c in "`*_~\\<") or "-\n" in text or "-\r\n" in text):
        return None
    if not offsets and "<" not in text and "-\n" not in text and "-\r\n" not in text:
        # Marks only (a sidecar's every "tokens_in", a Markdown table's
        # `names`): one regex pass cuts them all, one split reads the words.
        # No focus: the guard reads this reading whole, in C, instead of
        # finding the words around each cut in Python (~1.5 us a cut).
        low = _MARK_RUN.sub("", text)
        if len(low) == len(text):
            return None
        return Reading(reading.original, low, None, None, _words(low))
    cuts = _cuts(text)
    if not cuts:
        return None
    parts, pos = [], 0
    for s, e in cuts:
        parts.append(text[pos:s])
        pos = e
    parts.append(text[pos:])
    low = "".join(parts)
    # The first reading splits at each cut (a mark separates words there), so
    # its words before cut k are those of the parts before it; the two words
    # at a cut become one (three or more at cuts in a row: gr**ab**bed).
    # (A tag's own words, <b>, are words of the first reading: skipped.)
    first = reading.tokens
    toks: list[str] = []
    focus: list[int] = []
    done = words = 0  # first-reading words emitted; words before this cut
    for part, (s, e) in zip(parts, cuts, strict=False):
        words += len(_words(part))
        i = words - 1  # the word before the cut
        inside = len(_words(text[s:e])) if "<" in text[s:e] else 0
        words += inside
        after = i + inside + 1  # the word after it
        if i < done:  # the cut before ended in this same word: it goes on
            toks[-1] += first[after]
        else:
            toks += first[done:i]
            toks.append(first[i] + first[after])
            focus.append(len(toks) - 1)
        done = after + 1
    toks += first[done:]
    starts = ends = None
    if offsets:
        starts, ends = reading.starts, reading.ends
        if starts is None or ends is None:  # the text is the original: identity offsets
            starts, ends = list(range(len(text))), list(range(1, len(text) + 1))
        keep_s: list[int] = []
        keep_e: list[int] = []
        pos = 0
        for s, e in [*cuts, (len(text), len(text))]:
            keep_s += starts[pos:s]
            keep_e += ends[pos:s]
            pos = e
        starts, ends = keep_s, keep_e
    return Reading(reading.original, low, starts, ends, toks, focus=frozenset(focus))


def _cuts(text: str) -> list[tuple[int, int]]:
    """(start, end) of each run of markup with a letter or digit on both sides:
    Markdown's marks and its backslash escapes (gr\\_abbed), HTML tags and
    comments (gr<b>a</b>bbed), a hyphen where a line broke a word.

    str.find per mark (memchr) rather than a regex: sre scans a character
    class at ~10 ns a character, and a report has a few dozen marks at most.
    """
    runs: list[tuple[int, int]] = []
    for mark in "`*_~\\":
        i = text.find(mark)
        while i >= 0:
            runs.append((i, i + 1))
            i = text.find(mark, i + 1)
    for start, pattern in (("-\n", _HYPHEN_BREAK), ("-\r\n", _HYPHEN_BREAK), ("<", _TAG)):
        i = text.find(start)
        while i >= 0:
            if m := pattern.match(text, i):
                runs.append((i, m.end()))
            i = text.find(start, i + 1)
    merged: list[tuple[int, int]] = []
    for s, e in sorted(runs):  # marks and tags side by side are one run (**, <b><i>)
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    end = len(text)
    return [(s, e) for s, e in merged
            if 0 < s and e < end and text[s - 1].isalnum() and text[e].isalnum()]


def words_as_read(text: str) -> list[str]:
    """The words a person reads in `text`: format characters and markup inside
    words removed (the claims parser's reading of a statistic's name)."""
    first = _readings(text, False)[0]
    return (_joined(first, False) or first).tokens


def tokens(text: str) -> list[str]:
    """The normalised words of `text` (format characters removed inside words)."""
    return _readings(text, False)[0].tokens
