"""The key spelled out: letter by letter ("w h a t  a  l a m e - o") or its
words run together ("WhatALameO").

Words are gone in such text, so shingles of words cannot find it; letters
are still there. The index keeps, for every word of the key, the hash of
the SPELLED_CHARS letters that start at it (the key's words run together),
if those letters hold a whole word that is not stock or a name (a spelled
"idontknowwhatyoumean" is no leak: rule 2's bar, lowered, as a text
spelled out at all is rare and never a coincidence). The
guard slides the same window over each stretch a reading spells
(textnorm_reading.Reading.spelled); a window the model's own text also has
is allowed, as its shingles are.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence

from ..core.textnorm_reading import SPELLED_CHARS

SPELLED_MIN_CONTENT = 1  # whole words in a window that are not stock or names

# Hex digits only: a sha256, a UUID (every sidecar holds several). Such a
# stretch holds no window of a key whose run-together text has no
# SPELLED_CHARS hex digits in a row (as good as every key), and sliding the
# window over a sidecar's hashes was ~40 % of the guard's reading of it.
_HEX_RUN = re.compile(f"[0-9a-f]{{{SPELLED_CHARS}}}")
_HEX_ONLY = re.compile("[0-9a-f]+")


def key_windows(toks: Sequence[str], weak: Sequence[bool],
                episode: int) -> dict[int, tuple[int, int]]:
    """hash of the SPELLED_CHARS letters from each word on -> (episode, whole
    words among them), for windows with SPELLED_MIN_CONTENT words not `weak`."""
    stream = "".join(toks)
    starts = list(itertools.accumulate(map(len, toks), initial=0))
    out: dict[int, tuple[int, int]] = {}
    inside = content = 0  # words wholly in the window [starts[i], end), and how many not weak
    for i in range(len(toks)):
        end = starts[i] + SPELLED_CHARS
        if end > len(stream):
            break
        if inside < i:  # a word longer than the window: start afresh after it
            inside, content = i, 0
        while inside < len(toks) and starts[inside + 1] <= end:
            content += not weak[inside]
            inside += 1
        if content >= SPELLED_MIN_CONTENT:
            out[hash(stream[starts[i]:end])] = (episode, inside - i)
        if inside > i:
            content -= not weak[i]
    return out


def has_hex_window(toks: Sequence[str]) -> bool:
    """Do the words run together hold SPELLED_CHARS hex digits in a row, at any
    letter (a window starts at a word, so this is the wider question)?"""
    return _HEX_RUN.search("".join(toks)) is not None


def may_hit(letters: str, key_has_hex: bool) -> bool:
    """False if no window of the key can be in `letters`: hex digits only, and
    the key has no window of them (HumanIndex.spelled_hex)."""
    return key_has_hex or _HEX_ONLY.fullmatch(letters) is None


def allowed_windows(toks: Sequence[str]) -> frozenset[int]:
    """Every window of the model's text (run together), from each word on."""
    stream = "".join(toks)
    return frozenset(hash(stream[s:s + SPELLED_CHARS])
                     for s in itertools.accumulate(map(len, toks[:-1]), initial=0)
                     if s + SPELLED_CHARS <= len(stream))


def hits(letters: str, windows: Mapping[int, tuple[int, int]],
         allowed: frozenset[int] = frozenset()) -> list[tuple[int, int, int, int]]:
    """(first letter, end, episode, words) of each stretch of `letters` made of
    key windows, overlapping windows merged; windows in `allowed` left out."""
    found: list[tuple[int, int, int, int]] = []
    for at in range(len(letters) - SPELLED_CHARS + 1):
        window = hash(letters[at:at + SPELLED_CHARS])
        if (hit := windows.get(window)) is None or window in allowed:
            continue
        episode, words = hit
        if found and at <= found[-1][1]:  # overlaps or touches the stretch before
            first, _, ep, n = found[-1]
            found[-1] = (first, at + SPELLED_CHARS, ep, n + 1)
        else:
            found.append((at, at + SPELLED_CHARS, episode, words))
    return found
