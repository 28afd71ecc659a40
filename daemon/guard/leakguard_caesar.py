"""The key in a Caesar shift other than 13 (rot13 is a reading of every text:
textnorm) or in Atbash: a text is read by the cipher that makes n of its
words in a row the key's. And a quote part as written, part in any of those
or rot13: read with the cipher undone on the other words only.

No cheap test tells a shifted line in prose, and 25 more readings of every
text would cost more than all the others together. The index keeps each key
word in every cipher (HumanIndex.shifted: the word's hash -> the ciphers,
as bits, that make it), so a text's first readings are screened by C calls:
a set test of its longer words first (two of them), then a pass over all of
them; only a run of n words whose ciphers have one in common (the key's
words as written among them standing for any) is read again, with that
cipher undone.
"""
from __future__ import annotations

import bisect
import functools
import operator
import re
from collections.abc import Callable, Sequence

from ..core.textnorm_encoded import CIPHERS, ROT13, substitute, substitution_reading, undone_by
from ..core.textnorm_reading import WORD, Reading
from .leakguard_index import HumanIndex

# Longer words of the key shifted that a text must have, each its own (C):
# prose has one now and then ("meet" is "wood" shifted), a quote more.
SCREEN_WORDS = 2
# Ciphered words beside the key's words as written, with a cipher in common,
# in a run of n: one or two are prose now and then (a stray shift of a short
# word: 9 MiB of a synthetic key's words had such windows, and read the whole
# text again for them, 2.6 -> 6.4 s; bench/RESULTS.md, issue 36).
MIN_CIPHERED = 3


def shifted_back(view: Reading, index: HumanIndex
                 ) -> list[tuple[Callable[[Reading], Reading], Reading]]:
    """(how the reading is made, the reading) for each cipher that makes n
    words in a row of `view` the key's: undone on every word, or, where the
    key's words as written stand among them, on the other words only; [] for
    most texts."""
    whole, beside_plain = _backs(view, index)
    changes = [functools.partial(substitution_reading, cipher=back) for back in whole]
    changes += [functools.partial(_undone_beside_plain, index=index, back=back)
                for back in beside_plain]
    return [(change, change(view)) for change in changes]


def may_hold(views: Sequence[Reading], index: HumanIndex) -> bool:
    """Does a first reading have n words in a row of the key in one cipher?"""
    return any(any(_backs(view, index)) for view in views if view.is_first)


def may_hold_any(views: Sequence[Reading], indexes: Sequence[HumanIndex],
                 shifted_long: frozenset[int]) -> bool:
    """may_hold for any of `indexes`, screened first by `shifted_long`, the
    union of theirs: one set test a first reading, not one a work (a log
    line's string against 32 works cost ~100 us: bench/RESULTS.md, issue 36)."""
    if not any(len(shifted_long.intersection(view.word_hashes())) >= SCREEN_WORDS
               for view in views if view.is_first):
        return False
    return any(may_hold(views, index) for index in indexes)


def _backs(view: Reading, index: HumanIndex) -> tuple[list[int], list[int]]:
    """The ciphers that undo n words in a row of `view` into the key's: all of
    them ciphered (rot13 is left to its own reading), and some with the key's
    words as written among them (rot13 too). Both, when a text has a quote all
    ciphered and another part plain."""
    shifted, n = index.shifted, index.n
    hashes = view.word_hashes()
    if not shifted or len(index.shifted_long.intersection(hashes)) < SCREEN_WORDS:
        return [], []  # (its longer words in rot13 too)
    known = bytes(map(shifted.__contains__, hashes))
    whole = 0
    for run in re.finditer(b"\x01{%d,}" % n, known):
        masks = [shifted[h] for h in hashes[run.start():run.end()]]
        for first in range(len(masks) - n + 1):
            whole |= functools.reduce(operator.and_, masks[first:first + n])
    beside = _beside_plain(hashes, known, index)
    return ([undone_by(cipher) for cipher in CIPHERS if whole >> cipher & 1],
            [undone_by(cipher) for cipher in (*CIPHERS, ROT13) if beside >> cipher & 1])


def _ciphers(word: int, index: HumanIndex) -> int:
    """The ciphers (bits) that make the key's words `word` (a hash): rot13 from
    the words its reading has (HumanIndex.words_as)."""
    in_rot13 = word in index.words_as.get("rot13", frozenset())
    return index.shifted.get(word, 0) | in_rot13 << ROT13


def _beside_plain(hashes: list[int], known: bytes, index: HumanIndex) -> int:
    """The ciphers (bits) common to the ciphered words of a run of n words that
    are the key's, some as written (any cipher), some ciphered and not. Such a
    run has a word of each kind side by side: only the windows across each
    such seam are looked at (sets, bytes and a regex, C: a text of the key's
    own words has none)."""
    n, size = index.n, len(hashes)
    rot13 = index.words_as.get("rot13", frozenset())
    others = set(hashes).difference(index.words)  # set operations (C) first
    if rot13.isdisjoint(others) and index.shifted.keys().isdisjoint(others):
        return 0
    plain = int.from_bytes(bytes(map(index.words.__contains__, hashes)), "big")
    ciphers = int.from_bytes(known, "big") | int.from_bytes(
        bytes(map(rot13.__contains__, hashes)), "big")
    alone = (ciphers & ~plain).to_bytes(size, "big")  # ciphered, not the key's as written
    if b"\x01" not in alone:
        return 0
    either = (ciphers | plain).to_bytes(size, "big")
    ciphered = [m.start() for m in re.finditer(b"\x01", alone)]
    starts: set[int] = set()
    for run in re.finditer(b"\x01{%d,}" % n, either):
        for seam in re.finditer(b"(?=\x00\x01|\x01\x00)", alone[run.start():run.end()]):
            at = run.start() + seam.start()  # the last word before the seam
            starts.update(range(max(run.start(), at - n + 2), min(at, run.end() - n) + 1))
    common = 0
    for first in starts:
        masks = [_ciphers(hashes[k], index) for k in ciphered[
            bisect.bisect_left(ciphered, first):bisect.bisect_left(ciphered, first + n)]]
        if MIN_CIPHERED <= len(masks) < n:
            common |= functools.reduce(operator.and_, masks)
    return common


def _undone_beside_plain(view: Reading, *, index: HumanIndex, back: int) -> Reading:
    """`view` with `back` undoing its words that are the key's in that cipher
    and not as written; and those that are both ("or" is "be" in rot13) with
    such a word beside them. At its offsets: a substitution is one character
    for one."""
    bit = 1 << undone_by(back)  # the cipher that made them
    ciphered = [bool(_ciphers(h, index) & bit) for h in view.word_hashes()]
    plain = [h in index.words for h in view.word_hashes()]
    alone = [c and not p for c, p in zip(ciphered, plain, strict=True)]
    undo = [a or (c and any(alone[max(0, k - 1):k + 2]))
            for k, (a, c) in enumerate(zip(alone, ciphered, strict=True))]
    tokens, parts, pos = list(view.tokens), [], 0
    # A word of `tokens` for each of its text (as Reading.token_spans has them).
    for k, m in zip(range(len(tokens)), WORD.finditer(view.text), strict=False):
        if undo[k]:
            tokens[k] = substitute(tokens[k], back)
            parts += [view.text[pos:m.start()], substitute(m.group(), back)]
            pos = m.end()
    parts.append(view.text[pos:])
    # In place (Reading.in_place): its finds count only across the seam.
    return Reading(view.original, "".join(parts), view.starts, view.ends, tokens,
                   screen_first=True, in_place=True)
