"""The key in a Caesar shift other than 13 (rot13 is a reading of every text:
textnorm) or in Atbash: a text is read by the cipher that makes n of its
words in a row the key's.

No cheap test tells a shifted line in prose, and 25 more readings of every
text would cost more than all the others together. The index keeps each key
word in every cipher (HumanIndex.shifted: the word's hash -> the ciphers,
as bits, that make it), so a text's first readings are screened by C calls:
a set test of its longer words first (two of them), then a pass over all of
them; only a run of n words whose ciphers have one in common is read again,
with that cipher undone.
"""
from __future__ import annotations

import functools
import operator
import re
from collections.abc import Sequence

from ..core.textnorm_encoded import CIPHERS, substitution_reading, undone_by
from ..core.textnorm_reading import Reading
from .leakguard_index import HumanIndex

# Longer words of the key shifted that a text must have, each its own (C):
# prose has one now and then ("meet" is "wood" shifted), a quote more.
SCREEN_WORDS = 2


def shifted_back(view: Reading, index: HumanIndex) -> list[tuple[int, Reading]]:
    """(the cipher undoing one, the reading with it undone) for each cipher
    that makes n words in a row of `view` the key's words; [] for most texts."""
    return [(back, substitution_reading(view, back)) for back in _backs(view, index)]


def may_hold(views: Sequence[Reading], index: HumanIndex) -> bool:
    """Does a first reading have n words in a row of the key in one cipher?"""
    return any(_backs(view, index) for view in views if view.is_first)


def may_hold_any(views: Sequence[Reading], indexes: Sequence[HumanIndex],
                 shifted_long: frozenset[int]) -> bool:
    """may_hold for any of `indexes`, screened first by `shifted_long`, the
    union of theirs: one set test a first reading, not one a work (a log
    line's string against 32 works cost ~100 us: bench/RESULTS.md, issue 36)."""
    if not any(len(shifted_long.intersection(view.word_hashes())) >= SCREEN_WORDS
               for view in views if view.is_first):
        return False
    return any(may_hold(views, index) for index in indexes)


def _backs(view: Reading, index: HumanIndex) -> list[int]:
    shifted, n = index.shifted, index.n
    hashes = view.word_hashes()
    if not shifted or len(index.shifted_long.intersection(hashes)) < SCREEN_WORDS:
        return []
    known = bytes(map(shifted.__contains__, hashes))
    if b"\x01" * n not in known:
        return []
    common = 0
    for run in re.finditer(b"\x01{%d,}" % n, known):
        masks = [shifted[h] for h in hashes[run.start():run.end()]]
        for first in range(len(masks) - n + 1):
            common |= functools.reduce(operator.and_, masks[first:first + n])
    return [undone_by(cipher) for cipher in CIPHERS if common >> cipher & 1]
