"""The spans the guard finds in one text, over all its readings: each
(start, end, episode, words), start and end the text's characters."""
from __future__ import annotations

import bisect

Span = tuple[int, int, int, int]  # start, end, episode, words


def merge(spans: list[Span]) -> list[Span]:
    """Character spans found by several readings of one text, overlapping ones as one."""
    merged: list[Span] = []
    for start, end, episode, words in sorted(spans):
        if merged and start < merged[-1][1]:
            prev = merged[-1]
            merged[-1] = (prev[0], max(prev[1], end), prev[2], max(prev[3], words))
        else:
            merged.append((start, end, episode, words))
    return merged


def apart(in_place: list[Span], found: list[Span]) -> list[Span]:
    """The finds of readings in place (Reading.in_place: stretches decoded or
    words undone where they stand) that overlap none of `found`: such a
    reading's find counts across a seam, not around a passage found.

    Against `found` merged: disjoint and in order, so only the last stretch
    that starts before a span ends can reach back into it (a report quoting
    the key a thousand times had made this a thousand by a thousand)."""
    covered = merge(found)
    starts = [start for start, *_ in covered]
    return [span for span in in_place
            if (k := bisect.bisect_left(starts, span[1]) - 1) < 0 or covered[k][1] <= span[0]]
