"""Text hidden in an encoding: base64 (standard or URL-safe, padded or not,
wrapped over lines, glued to other text), base32, hex, lists of byte values
(textnorm_numbers), rot13, and text written backwards.

A reply that quotes the answer key base64-encoded is still a quote: textnorm
reads the decoded text as one more reading of the original (its characters
all come from the stretch that encoded them, so a redaction cuts all of it).
Only stretches that decode to text count: a sha256 digest, a path or a long
word decodes to bytes that are no text (UTF-8, UTF-16 in either byte order,
or nearly-ASCII cp1252) and is left.

A stretch starts at a run of MIN_RUN_CHARS characters of one alphabet and
goes on over the lines after it (a wrapped block; in a JSON string, lines
joined by an escaped newline); or it is a block of narrower lines
(textnorm_wrapped). It is decoded whole, at
each alignment of its groups (what is glued before it shifts them), as
base64, else as base32; failing that, each line alone, lines that decode
side by side joined again (a digest on the line above is no part of it).
Linear in the text. Most texts have no such run: a bytes.translate and a
bytes.find or a scan that skips to line breaks (C) say so.

rot13 maps words to words, and so does reading backwards (letter by letter,
word by word, or each word's letters): their readings are the other
readings' words rotated or reversed, at their offsets, made for every text
(no cheap test tells one such line in English prose) and screened by the
key's words before their runs are hashed.

Base85 and Ascii85: textnorm_base85. Morse code: textnorm_morse. Base64 or
hex in words (each word alone, or the run cut in groups): textnorm_tokens.
ROT47: textnorm_rot47. uuencode: textnorm_uu. Leetspeak (digits for the
letters they look like) is one more reading of a text with such digits
inside words. Caesar's other shifts and Atbash are read by the guard, by the
cipher its index finds (leakguard_caesar), with `substitution_reading`. A
quote part plain, part encoded: one more reading, the text with its
stretches decoded in place (`_decoded_in_place`). Quoted-printable is an
escape, decoded in place (textnorm). Not read (bench/RESULTS.md): pig
latin, vowels left out, an encoded part under MIN_RUN_CHARS.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import re
import string
from collections.abc import Callable

from . import (
    textnorm_base85,
    textnorm_morse,
    textnorm_numbers,
    textnorm_rot47,
    textnorm_tokens,
    textnorm_uu,
    textnorm_wrapped,
)
from .textnorm_reading import WORD_TRANSFORMS, DerivedReading, Reading

# 24 base64 characters are 18 bytes: fewer than any quote the guard acts on
# (7 words), so a quote's encoding is always long enough to be looked at.
MIN_RUN_CHARS = 24
# A decoded run is text if nearly all of it is shown: letters, digits,
# punctuation, spaces. Bytes that happen to be UTF-8 are rarely so.
MIN_SHOWN_SHARE = 0.9
# Base64 of text has few of its alphabet's two marks (+/ or -_): in base64 of
# ASCII they stand only for '>', '?', '~' in a group's last place. A run with
# more than this share of them is a path or a slug.
MAX_MARK_SHARE = 1 / 8

_ALPHABET = (string.ascii_letters + string.digits + "+/-_").encode("ascii")
_ONLY_ALPHABET = bytes(
    ord("A") if byte in _ALPHABET else ord(" ") for byte in range(256))
_LONG_RUN = b"A" * MIN_RUN_CHARS
REGION_GAP = 512  # long runs closer than this are scanned as one region (a sidecar's digests)
_ANY_LONG_RUN = re.compile(rf"[A-Za-z0-9+/_-]{{{MIN_RUN_CHARS},}}")
_HEX_DIGITS = (string.hexdigits).encode("ascii")
_HEX_OR_APART = bytes(
    ord("h") if byte in _HEX_DIGITS else ord(" ") if byte in b" :-\n" else ord("x")
    for byte in range(256))
_HEX_APART_DROPPED = b",\r"  # ", " and "\r\n" read as one separator by the gate
_SHOWN_ASCII = bytes(range(32, 127)) + b"\t\n\r"
_LONG_SPACED_HEX = b" ".join([b"hh"] * (MIN_RUN_CHARS // 2))
# Each base64 alphabet, and hex digits, as a pair: the long run that starts a
# block, and the run of a line after it that goes on with it. Whatever is
# glued to a run ("b64_", "0x", "/p/") is cut by another alphabet, or read
# past by trying each of the four alignments of base64's groups.
_ALPHABETS = tuple((re.compile(rf"{chars}{{{MIN_RUN_CHARS},}}={{0,2}}"),
                    # A whole word: "af" of "afterwards" on the line after hex is prose.
                    re.compile(rf"{chars}{{2,}}={{0,2}}(?![A-Za-z0-9+/_=-])"))
                   for chars in ("[A-Za-z0-9+/]", "[A-Za-z0-9_-]", "[0-9a-fA-F]"))
# Between two runs of one wrapped block: a line break; or, in a JSON string,
# an escaped one (its "n" reads as the first letter of the next run).
_WRAP = re.compile(r"[ \t]*\r?\n[ \t]*")
_ESCAPED_WRAP = re.compile(r"\\(?:r\\)?")
# Hex bytes written apart ("48 65 6c", "48:65:6c", "48-65", "48, 65", rows of
# them as a hex dump prints them): the pairs are the run.
_SPACED_HEX = re.compile(
    rf"(?<![0-9A-Za-z])[0-9a-fA-F]{{2}}(?:(?:[ :-]|, ?|[ \t]*\r?\n[ \t]*)[0-9a-fA-F]{{2}})"
    rf"{{{MIN_RUN_CHARS // 2 - 1},}}+(?![0-9A-Za-z])")
_HEX_PAIR = re.compile(r"[0-9a-fA-F]{2}")
_QUOTED_HEX = re.compile(rf'"([0-9a-fA-F]{{{MIN_RUN_CHARS},}})"')

_BASE32 = re.compile(r"[A-Z2-7]+|[a-z2-7]+")
_BASE32_HEX = re.compile(r"[0-9A-V]+|[0-9a-v]+")
_ASCII_LETTER = re.compile(r"[A-Za-z]")

# The letters substituted one for one: a Caesar shift (1 to 25) or Atbash
# (a for z, b for y, ...; its id ATBASH). rot13 is a reading of every text
# (below); the others are read only when the guard finds a text's words
# substituted from the key's (leakguard_caesar), by that cipher.
ROT13 = 13
SHIFTS = tuple(k for k in range(1, 26) if k != ROT13)
ATBASH = 26
CIPHERS = (*SHIFTS, ATBASH)
_MOVED = {k: "".join(letters[k:] + letters[:k]
                     for letters in (string.ascii_lowercase, string.ascii_uppercase))
          for k in range(1, 26)}
_MOVED[ATBASH] = string.ascii_lowercase[::-1] + string.ascii_uppercase[::-1]
_SUBSTITUTED_BYTES = {k: bytes.maketrans(string.ascii_letters.encode("ascii"),
                                         moved.encode("ascii")) for k, moved in _MOVED.items()}
_SUBSTITUTED_TEXT = {k: str.maketrans(string.ascii_letters, moved) for k, moved in _MOVED.items()}


def substitute(text: str, cipher: int) -> str:
    """`text` with its ASCII letters moved `cipher` (1 to 25) places on, or in
    Atbash (ATBASH); ASCII text by bytes.translate: C, no dict lookup a
    character."""
    if text.isascii():
        return text.encode("ascii").translate(_SUBSTITUTED_BYTES[cipher]).decode("ascii")
    return text.translate(_SUBSTITUTED_TEXT[cipher])


def undone_by(cipher: int) -> int:
    """The cipher that undoes `cipher` (a shift back; Atbash is its own)."""
    return cipher if cipher == ATBASH else 26 - cipher


def substitution_reading(reading: Reading, cipher: int) -> Reading:
    """`reading` with its letters substituted by `cipher`, at its offsets."""
    return _letters_changed(reading, lambda text: substitute(text, cipher))


def _letters_changed(reading: Reading, change: Callable[[str], str]) -> Reading:
    """`reading` with `change` (one character for one) made to its text and
    words, at its offsets; screened by its words first, as rot13's is."""
    return Reading(reading.original, change(reading.text), reading.starts, reading.ends,
                   change(" ".join(reading.tokens)).split(), screen_first=True)


# Leetspeak: digits written for the letters they look like ("7h3 m0n3y").
# Read only in a text with MIN_LEET_WORDS words of three characters or more
# that mix letters and such digits, a word's length (a base64 run or a digest
# mixes them too, at length), or MIN_LEET_WORDS_ANY such words of any length:
# a bytes.translate and a count (C) first; then the words, each kind of them
# once (every letter is "a" in the marks, so "th3" and "wh0" are one kind,
# and a text has few: a regex over the marks cost a sidecar ~110 us, this
# ~45). A quote of 7 words in it has more, and most prose has none. Our own
# files have a few: a sidecar names its model twice ("gpt-4o-mini") and
# "exclamations_per_1k_words" twice, and two or three episodes; so two
# characters alone ("4o", "1k") are not enough, and an episode's file name
# (ep01, ep05) is not counted. No word of a key reads as "ep" and digits.
# (Each sidecar had a leetspeak reading made and read: bench/RESULTS.md,
# issue 36.)
_LEET_DIGITS, _LEET_LETTERS = "013457", "oieast"
_LEET = str.maketrans(_LEET_DIGITS, _LEET_LETTERS)
_LEET_MARKS = bytes(ord("d") if chr(c) in _LEET_DIGITS else ord("x") if chr(c).isdigit()
                    else ord("a") if chr(c).isalpha() else ord(" ") for c in range(128)) \
    + b" " * 128
MAX_LEET_WORD = 12
# The episode names counted as words (their digits all 0 1 3 4 5 7): found
# from their "ep" (a literal: a fast search), to be taken off the count.
_EPISODE_NAME = re.compile(rb"ep(?<![A-Za-z0-9]ep)[013457]{1,10}(?![A-Za-z0-9])")
MIN_LEET_WORDS = 3
MIN_LEET_WORDS_ANY = 5


def leet_reading(reading: Reading) -> Reading | None:
    """`reading` with 0 1 3 4 5 7 read as o i e a s t, at its offsets; None
    when too few of its words mix them with letters."""
    data = reading.text.encode("utf-8", "surrogatepass")
    marks = data.translate(_LEET_MARKS)
    if marks.count(b"ad") + marks.count(b"da") < MIN_LEET_WORDS:
        return None
    longer, short = _leet_words(marks)
    names = len(_EPISODE_NAME.findall(data))  # three characters or more each
    if longer - names < MIN_LEET_WORDS and longer - names + short < MIN_LEET_WORDS_ANY:
        return None
    return _letters_changed(reading, lambda text: text.translate(_LEET))


def _leet_words(marks: bytes) -> tuple[int, int]:
    """Words of letters ("a") and 0 1 3 4 5 7 ("d") both, and no other digit
    ("x"): those of three characters or more, and those of two."""
    words = marks.split()
    longer = short = 0
    for kind in set(words):
        if len(kind) <= MAX_LEET_WORD and b"x" not in kind and (b"ad" in kind or b"da" in kind):
            if len(kind) > 2:
                longer += words.count(kind)
            else:
                short += words.count(kind)
    return longer, short


def rot13(text: str) -> str:
    """`text` with its ASCII letters rotated by 13."""
    return substitute(text, ROT13)


def rot13_reading(reading: Reading) -> Reading:
    """`reading` in rot13, at its offsets. (A list of rot13'd common words as
    the test for making it missed whole lines of the key: "That's somebody's
    salary. That's somebody who's gonna get fired.")"""
    return DerivedReading(reading, "rot13", rot13(reading.text), reading.starts, reading.ends,
                          focus=reading.focus)


def backwards_readings(reading: Reading, offsets: bool) -> list[Reading]:
    """`reading` backwards three ways: from its last letter to its first (its
    words in reverse order, each reversed), its words in reverse order, and
    each word's letters reversed in place."""
    size = len(reading.text)
    starts = ends = None
    if offsets:
        starts = (reading.starts if reading.starts is not None else list(range(size)))[::-1]
        ends = (reading.ends if reading.ends is not None else list(range(1, size + 1)))[::-1]
    backwards = reading.text[::-1]
    # Word k of a reading is where its text's k-th word is (Reading.token_spans):
    # the words in reverse order stand where the backwards text has them.
    return [DerivedReading(reading, "reversed", backwards, starts, ends),
            DerivedReading(reading, "word_order", backwards, starts, ends),
            DerivedReading(reading, "each_word", reading.text, reading.starts, reading.ends)]


# Each word list made by one C call a step: joined, rotated or reversed, split.
WORD_TRANSFORMS.update(rot13=lambda words: rot13(" ".join(words)).split(),
                       reversed=lambda words: " ".join(words)[::-1].split(),
                       word_order=lambda words: words[::-1],
                       each_word=lambda words: " ".join(words)[::-1].split()[::-1])


def encoded_readings(text: str, offsets: bool, read: Callable[[str, bool], list[Reading]],
                     read_first: Callable[[str, bool], Reading], unescaped: str,
                     unescaped_at: Callable[[], tuple[str, list[int], list[int]]]
                     ) -> list[Reading]:
    """The readings (`read`: textnorm's, one level down) of what each encoded
    stretch of `text` decodes to, as readings of `text`: every character of
    them comes from the whole stretch. One stretch at a time: no quote is made
    of the end of one and the start of the next; the text with them all
    decoded in place is one more reading (`read_first`: textnorm's first
    reading of a text, the only one it needs). `unescaped`: the text with its
    escapes decoded (a base64 block in a JSON string with \\/ in it), and
    `unescaped_at()` where each of its characters came from, asked only when
    that view holds a stretch the text does not. [] for most texts."""
    found = decoded_runs(text)
    if unescaped != text:
        in_view = decoded_runs(unescaped)
        if {d for *_, d in in_view} - {d for *_, d in found}:
            _, starts, ends = unescaped_at()  # the same view, with its origins
            found += [(starts[s], ends[e - 1], decoded) for s, e, decoded in in_view]
    out = []
    stretches = sorted(set(found))
    for start, end, decoded in stretches:
        for inner in read(decoded, offsets):
            size = len(inner.text)
            out.append(Reading(text, inner.text, [start] * size if offsets else None,
                               [end] * size if offsets else None, inner.tokens,
                               focus=inner.focus, screen_first=inner.screen_first))
    if stretches:
        out.append(_decoded_in_place(text, stretches, offsets, read_first))
    return out


def _decoded_in_place(text: str, stretches: list[tuple[int, int, str]], offsets: bool,
                      read_first: Callable[[str, bool], Reading]) -> Reading:
    """The text with its stretches decoded where they stand (the first of any
    that overlap), read as written: a quote half plain and half encoded has
    its run across the seam. Each decoded character comes from its stretch."""
    parts: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    pos = 0
    for start, end, decoded in stretches:
        if start < pos:
            continue
        parts += [text[pos:start], decoded]
        if offsets:
            starts += [*range(pos, start), *[start] * len(decoded)]
            ends += [*range(pos + 1, start + 1), *[end] * len(decoded)]
        pos = end
    parts.append(text[pos:])
    if offsets:
        starts += range(pos, len(text))
        ends += range(pos + 1, len(text) + 1)
    inner = read_first("".join(parts), offsets)
    if not offsets:
        return Reading(text, inner.text, None, None, inner.tokens, in_place=True)
    at = inner.starts or range(len(inner.text))
    upto = inner.ends or range(1, len(inner.text) + 1)
    return Reading(text, inner.text, [starts[i] for i in at], [ends[i - 1] for i in upto],
                   inner.tokens, in_place=True)


def decoded_runs(text: str) -> list[tuple[int, int, str]]:
    """(start, end, decoded text) of every stretch of `text` in base64 or hex that
    reads as text: a run, or a block of runs wrapped over lines."""
    raw = text.encode("utf-8", "surrogatepass")
    found: list[tuple[int, int, str]] = []
    marked = raw.translate(_ONLY_ALPHABET)
    if _LONG_RUN in marked and len(marked) == len(text):
        found, marked = _quoted_hex(text, marked)
    if _LONG_RUN in marked:
        regions = _long_regions(text, marked)
        tried: set[tuple[tuple[int, int], ...]] = set()  # a digest is a run of all three
        for long_run, run in _ALPHABETS:  # each on its own: its runs may overlap another's
            for block in _blocks(text, regions, long_run, run):
                if (spans := tuple(block)) not in tried:
                    tried.add(spans)
                    found += _decoded_block(text, block)
    if _LONG_SPACED_HEX in raw.translate(_HEX_OR_APART, _HEX_APART_DROPPED):
        for m in _SPACED_HEX.finditer(text):
            pairs = "".join(_HEX_PAIR.findall(m.group()))
            if (decoded := _as_text(bytes.fromhex(pairs))) is not None:
                found.append((m.start(), m.end(), decoded))
    found += [(start, end, decoded) for start, end, data in textnorm_numbers.byte_lists(text)
              if (decoded := _as_text(data)) is not None]
    found += textnorm_wrapped.narrow_blocks(text, raw, MIN_RUN_CHARS, _decode_run)
    found += textnorm_base85.decoded_runs(text, MIN_RUN_CHARS, _as_text)
    found += textnorm_morse.decoded_runs(text, raw)
    found += textnorm_tokens.decoded_runs(text, raw, _decode_run, _as_text)
    found += textnorm_rot47.decoded_runs(text, raw, MIN_RUN_CHARS)
    found += textnorm_uu.decoded_runs(text, raw, MIN_RUN_CHARS, _as_text)
    return sorted(set(found))


def _quoted_hex(text: str, marked: bytes) -> tuple[list[tuple[int, int, str]], bytes]:
    """Runs of hex digits in double quotes (a JSON digest: a sidecar has nine),
    decoded alone as the blocks below would decode them (a quote on each side:
    in no block with a line before or after), and taken out of `marked`, so
    the scan for blocks does not try them thrice. `text` is ASCII (its offsets
    are `marked`'s)."""
    found: list[tuple[int, int, str]] = []
    blanked = bytearray(marked)
    for m in _QUOTED_HEX.finditer(text):
        start, end = m.span(1)
        blanked[start:end] = b" " * (end - start)
        if (decoded := _decode_run(m.group(1))) is not None:
            found.append((start, end, decoded))
    return found, bytes(blanked)


def _long_regions(text: str, marked: bytes) -> list[tuple[int, int]]:
    """Where `text` has runs of MIN_RUN_CHARS characters of either base64 alphabet
    (`marked`: its bytes, those characters as "A"). For ASCII text, found by
    bytes.find (C): a regex over 100 KB of prose costs a millisecond an alphabet."""
    if len(marked) != len(text):  # not ASCII: byte offsets are not the text's
        return [m.span() for m in _ANY_LONG_RUN.finditer(text)]
    regions: list[tuple[int, int]] = []
    start = marked.find(_LONG_RUN)
    while start >= 0:
        end = marked.find(b" ", start)
        end = len(marked) if end < 0 else end
        padded = end + len(text[end:end + 2]) - len(text[end:end + 2].lstrip("="))
        if regions and start - regions[-1][1] < REGION_GAP:  # one scan for runs close by
            regions[-1] = (regions[-1][0], padded)
        else:
            regions.append((start, padded))
        start = marked.find(_LONG_RUN, end)
    return regions


def _blocks(text: str, regions: list[tuple[int, int]], long_run: re.Pattern[str],
            run: re.Pattern[str]) -> list[list[tuple[int, int]]]:
    """Each long run of one alphabet in `regions`, and the runs on the lines after
    it: wrapped lines of one encoding. Each run in one block."""
    blocks: list[list[tuple[int, int]]] = []
    end = 0
    for region_start, region_end in regions:
        for m in long_run.finditer(text, max(region_start, end), region_end):
            if m.start() < end:
                continue  # a line of the block before
            block = [m.span()]
            end = m.end()
            while (nxt := _next_line(text, end, run)) is not None:
                block.append(nxt)
                end = nxt[1]
            blocks.append(block)
            if end > region_end:
                break  # the block ran on past this region: the next starts after it
    return blocks


def _next_line(text: str, end: int, run: re.Pattern[str]) -> tuple[int, int] | None:
    """The run that wraps on from the one ending at `end`: after a line break; or,
    in a JSON string, after an escaped one (whose "n" is no part of it)."""
    if (wrap := _WRAP.match(text, end)) is not None:
        found = run.match(text, wrap.end())
    elif (escaped := _ESCAPED_WRAP.match(text, end)) is not None \
            and text.startswith("n", escaped.end()):
        found = run.match(text, escaped.end() + 1)
    else:
        return None
    return found.span() if found is not None else None


def _decoded_block(text: str, block: list[tuple[int, int]]) -> list[tuple[int, int, str]]:
    """The block decoded whole; failing that, each run alone (a line above or
    below it that is no part of it: a digest, the next paragraph's word), runs
    that decode side by side joined again."""
    whole = _decode_run("".join(text[s:e] for s, e in block))
    if whole is not None:
        return [(block[0][0], block[-1][1], whole)]
    if len(block) == 1:
        return []
    out: list[tuple[int, int, str]] = []
    last = None
    for s, e in block:
        decoded = _decode_run(text[s:e])
        if decoded is None:
            last = None
            continue
        if last is not None:  # the run after one that decoded: one stretch
            out[-1] = (out[-1][0], e, out[-1][2] + decoded)
        else:
            out.append((s, e, decoded))
        last = e
    return [(s, e, decoded) for s, e, decoded in out if e - s >= MIN_RUN_CHARS]


def _decode_run(run: str) -> str | None:
    """Hex or base64 (either alphabet), at whichever of its alignments reads as text."""
    if len(run) >= MIN_RUN_CHARS // 2 and not run.strip(string.hexdigits):
        for cut in (0, 1):
            if (decoded := _as_text(bytes.fromhex(run[cut: len(run) - (len(run) - cut) % 2]))):
                return decoded
        return None  # base64 of text has capitals: a digest is no such thing
    body = run.rstrip("=").replace("-", "+").replace("_", "/")
    if body.count("+") + body.count("/") > len(body) * MAX_MARK_SHARE:
        return None  # a path or a slug (skilltrain-bench-e0_b1), not base64 of text
    decoded = _aligned(body, 4, (1,), lambda piece: binascii.a2b_base64(piece, strict_mode=True))
    return decoded if decoded is not None else _decode_base32(run.rstrip("="))


def _decode_base32(body: str) -> str | None:
    """Base32 (RFC 4648: A-Z and 2-7, in one case), or its extended-hex
    alphabet (0-9 and A-V), at whichever of its eight alignments reads as
    text. (Base32 of text has digits: a fifth of its groups or so stand for
    one; a long word or a run of letters has none, and b32decode is Python,
    slow over 100 KB of them.)"""
    if any(d in body for d in "234567") and _BASE32.fullmatch(body):
        return _aligned(body, 8, (1, 3, 6), lambda piece: base64.b32decode(piece, casefold=True))
    if any(d in body for d in string.digits) and _BASE32_HEX.fullmatch(body):  # RFC 4648's other
        return _aligned(body, 8, (1, 3, 6),
                        lambda piece: base64.b32hexdecode(piece, casefold=True))
    return None


def _aligned(body: str, group: int, partial: tuple[int, ...],
             decode: Callable[[str], bytes]) -> str | None:
    """`body` decoded at whichever alignment of its `group`-character groups
    reads as text (what is glued before a run, or cut from a longer one,
    shifts them); a last group of a length in `partial`, which decodes to no
    byte, let go; the rest padded."""
    for cut in range(group):
        piece = body[cut:]
        piece = piece[: len(piece) - len(piece) % group] if len(piece) % group in partial \
            else piece
        try:
            data = decode(piece + "=" * (-len(piece) % group))
        except binascii.Error:
            continue
        if (decoded := _as_text(data)) is not None:
            return decoded
    return None


def _as_text(data: bytes) -> str | None:
    """`data` as text if it reads: UTF-8 (a character cut at either end let go),
    else UTF-16, else a single-byte text that is nearly all ASCII (cp1252)."""
    text = data.decode("utf-8", "replace").strip("\ufffd")
    if "\ufffd" in text or "\x00" in text:
        text = _other_encoding(data) or ""
    if not text or not any(c.isalpha() for c in text):
        return None
    shown = sum(c.isprintable() or c in "\n\r\t" for c in text)
    return text if shown >= MIN_SHOWN_SHARE * len(text) else None


def _other_encoding(data: bytes) -> str | None:
    if len(data) >= 4 and data.count(0) >= len(data) // 3:  # UTF-16 or UTF-32 text
        # Each byte order decodes; the wrong one is letters of no script the
        # text is in. Kept: the one with the most ASCII letters.
        decoded = []
        for codec in ("utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-be"):
            with contextlib.suppress(UnicodeDecodeError):
                decoded.append(data.decode(codec))
        return max(decoded, key=lambda t: len(_ASCII_LETTER.findall(t)), default=None)
    other = len(data.translate(None, _SHOWN_ASCII))  # bytes that are not shown ASCII
    return data.decode("cp1252", "replace") if other <= (1 - MIN_SHOWN_SHARE) * len(data) \
        else None
