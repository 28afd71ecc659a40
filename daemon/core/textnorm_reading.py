"""A reading of a text: its normalised words, and where each came from.

textnorm makes readings (the one normalisation); the guard maps the words it
finds back to the original characters through `token_spans`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

WORD = re.compile(r"[^\W_]+(?:'+[^\W_]+)*")


@dataclass
class Reading:
    """One normalised reading of a text: its words, and where each came from.

    `starts[i]`/`ends[i]`: the span of original characters that produced
    character i of `text` (None while no escape was decoded and no character
    folded: then text and original share offsets).
    """

    original: str
    text: str
    starts: list[int] | None = None
    ends: list[int] | None = None
    tokens: list[str] = field(default_factory=list)
    # Tokens that differ from the first reading's (None: any may): only the
    # shingles over them need a look (the markup reading: the joined words).
    focus: frozenset[int] | None = None
    # A reading that seldom holds a quote (rot13): the guard first asks whether
    # its words are the key's at all (HumanIndex.may_match) before hashing runs.
    screen_first: bool = False

    def token_spans(self, wanted: set[int] | None = None) -> dict[int, tuple[int, int]]:
        """(start, end) in the original text of the tokens numbered `wanted` (default all)."""
        spans: dict[int, tuple[int, int]] = {}
        last = max(wanted) if wanted else -1
        starts, ends = self.starts, self.ends
        for i, m in enumerate(WORD.finditer(self.text)):
            if wanted is None or i in wanted:
                s, e = m.span()
                # Both ends of the word looked at: a reading backwards runs its
                # origins from the last character to the first.
                spans[i] = (s, e) if starts is None or ends is None else (
                    min(starts[s], starts[e - 1]), max(ends[s], ends[e - 1]))
                if i == last:
                    break
        return spans
