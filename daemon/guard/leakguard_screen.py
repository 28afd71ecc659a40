"""Which readings of a text may hold a key: the bulk tests before a close
look (leakguard._find), each a pass of C calls over the words.

A reading that seldom holds a quote (rot13, backwards: textnorm) is screened
by the key's words first; one derived from another is screened by its
source's words against the key's words transformed the same way, so its
own words are never made for most texts. A reading that spells text out has
no words to screen by: it is always looked at (leakguard_spelled).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..core.textnorm_reading import DerivedReading, Reading
from . import leakguard_caesar
from .leakguard_index import HumanIndex, has_known_run


def may_leak(views: Sequence[Reading], index: HumanIndex) -> bool:
    """False if no reading can hold the key: a bulk test before `find_leaks`
    (the audit, the log seal). True: look closer."""
    return any(not screened_out(v, index) and index.may_match(v.tokens) for v in views) \
        or spells(views) or leakguard_caesar.may_hold(views, index)


def screened_out(view: Reading, index: HumanIndex) -> bool:
    """Can a reading that seldom holds a quote (rot13, backwards) not hold this
    key? A derived one is asked by its source's words, its own not made; the
    words in reverse order by its source's runs against the key's runs
    reversed (HumanIndex.backward): exactly the runs it would have."""
    if not view.screen_first:
        return False
    if isinstance(view, DerivedReading) and view.kind == "word_order":
        # Its runs are its source's reversed: one set test on runs the source's
        # own look hashed already (a words screen first would be its own again).
        return index.backward.isdisjoint(view.source.run_hashes(index.n))
    return not known_run(view, index.words, index.words_as, index.n) \
        or not index.may_match(view.tokens)


def known_run(view: Reading, words: frozenset[int], words_as: Mapping[str, frozenset[int]],
              n: int) -> bool:
    """Has the reading a run of n words that are in `words` (for a derived
    reading: its source's words in `words_as` of its kind)?"""
    if isinstance(view, DerivedReading) and view.kind in words_as:
        return has_known_run(view.source.word_hashes(), words_as[view.kind], n)
    return has_known_run(view.word_hashes(), words, n)


def spells(views: Sequence[Reading]) -> bool:
    """Does a reading spell text out (leakguard_spelled)? Its words are no
    test of that."""
    return any(v.spelled() for v in views if reads_spelled(v))


def reads_spelled(view: Reading) -> bool:
    """The readings the key spelled out is looked for in: the first ones, not
    rot13 or backwards (screened) or the markup reading (the first's words)."""
    return view.is_first
