"""A reading of a text: its normalised words, and where each came from.

textnorm makes readings (the one normalisation); the guard maps the words it
finds back to the original characters through `token_spans`.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

WORD = re.compile(r"[^\W_]+(?:'+[^\W_]+)*")
# Letters in a row that `Reading.spelled` gives the guard (leakguard_spelled),
# and that are the key there: a short line of the key run together
# ("butidontwanttolietoher") is 22; at 20, a closed-book draft of the same
# story spelled out matched three phrases of it ("drivehimtothestation").
SPELLED_CHARS = 24
# Eight words of one character in a row: a text spelled letter by letter (a C
# scan of the words joined; then they are walked).
_SINGLES = re.compile(r" \w \w \w \w \w \w \w \w ")
# A quote with its spaces taken out and its marks kept ("Well,I'lltellyou.
# EggshellsandMiracleGrow."): a comma or a full stop splits it into words,
# each shorter than SPELLED_CHARS. A chunk with no space in it made of words
# and a sentence's marks between them, one of them a stop or a comma, is read
# as one stretch of letters. (A path, a URL, a slug or a digest is no such chunk.)
_CHUNK = re.compile(rf"\S{{{SPELLED_CHARS},}}")
# UTF-8 bytes: ASCII space as b" ", any other byte as b"x" (a character past
# ASCII is several: the test below may pass a chunk that is shorter, never
# miss one), so a chunk that long is one C search (split() cost 30 us a report).
_SPACE_OR_NOT = bytes(32 if b < 128 and chr(b).isspace() else 120 for b in range(256))
_LONG_CHUNK = b"x" * SPELLED_CHARS
# Where such a sentence's words meet: a mark, then a letter (a digest or a
# time of day has none).
_MARK_THEN_LETTER = re.compile(r"""[-.,;:!?'’]["'“‘(]?[^\W\d_]""")
_SENTENCE_RUN = re.compile(r"""[("'“‘]*[^\W_]+(?:[-.,;:!?'’"”]+[^\W_]+)+[-.,;:!?'’"”)]*""")
_STOPS = frozenset(".,;:!?")


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
    # The text with its encoded stretches decoded where they stand, or its
    # ciphered words undone (a quote part plain, part encoded): the guard
    # keeps only its finds that no other reading made (one there would only
    # grow into the prose beside it).
    in_place: bool = False
    _spelled: list[tuple[str, list[int]]] | None = field(default=None, repr=False,
                                                         compare=False)
    _hashes: list[int] | None = field(default=None, repr=False, compare=False)
    _runs: dict[int, list[int]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_first(self) -> bool:
        """A reading of the text as written (or decoded): not one screened
        first (rot13, backwards, leetspeak, a shift) nor the markup reading."""
        return not self.screen_first and self.focus is None

    def run_hashes(self, n: int) -> list[int]:
        """hash() of each run of n words (hashed_runs), kept: the guard's first
        look at this reading, and the screen of its words in reverse order
        (leakguard_screen), ask for the same."""
        if (found := self._runs.get(n)) is None:
            found = self._runs[n] = hashed_runs(self.tokens, n)
        return found

    def word_hashes(self) -> list[int]:
        """hash() of each word, kept: the screens of the readings derived from
        this one, for every key, ask for them (leakguard)."""
        if self._hashes is None:
            self._hashes = list(map(hash, self.tokens))
        return self._hashes

    def spelled(self) -> list[tuple[str, list[int]]]:
        """The stretches of this reading that spell text without its words: one
        character a word for SPELLED_CHARS words or more ("w h a t a l a m e o"),
        or one word of SPELLED_CHARS characters or more ("whatalameo..."), or a
        sentence run together with its marks ("Whatalame-o.Somebody..."). Each
        as its letters and the number of the word each letter is in."""
        if self._spelled is None:
            self._spelled = _spelled(self.tokens) + _run_together(self.text, self.tokens)
        return self._spelled

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


def hashed_runs(toks: Sequence[str], n: int) -> list[int]:
    """hash() of every run of n consecutive tokens, in order (len(toks) - n + 1 of them)."""
    windows = zip(*(itertools.islice(toks, k, None) for k in range(n)), strict=False)
    return list(map(hash, windows))


def _run_together(text: str, toks: list[str]) -> list[tuple[str, list[int]]]:
    """Each chunk of a sentence's words run together with its marks kept, as
    its letters and the number of the word each letter is in (the words are
    WORD's matches in `text`, as token_spans numbers them)."""
    marked = text.encode("utf-8", "surrogatepass").translate(_SPACE_OR_NOT)
    if _LONG_CHUNK not in marked or not _MARK_THEN_LETTER.search(text):
        return []  # most texts
    found = []
    before, pos = 0, 0  # words before `pos`
    for start, end in _long_chunks(text, marked):
        if not _MARK_THEN_LETTER.search(text, start, end):  # a digest: most chunks
            continue
        chunk = text[start:end]
        if not _SENTENCE_RUN.fullmatch(chunk) or _STOPS.isdisjoint(chunk):
            continue
        before += len(WORD.findall(text, pos, start))
        pos = start
        inside = len(WORD.findall(chunk))
        words = range(before, min(before + inside, len(toks)))
        letters = "".join(toks[k] for k in words)
        if inside > 1 and len(letters) >= SPELLED_CHARS:
            found.append((letters, [k for k in words for _ in toks[k]]))
    return found


def _long_chunks(text: str, marked: bytes) -> list[tuple[int, int]]:
    """(start, end) of each chunk of SPELLED_CHARS characters or more with no
    space in it. ASCII text: by bytes.find on `marked` (its offsets are the
    text's), ~40 times faster than the regex over a sidecar's JSON."""
    if len(marked) != len(text):
        return [m.span() for m in _CHUNK.finditer(text)]
    spans = []
    at = marked.find(_LONG_CHUNK)
    while at >= 0:
        start = marked.rfind(b" ", 0, at) + 1
        end = marked.find(b" ", at)
        end = len(marked) if end < 0 else end
        spans.append((start, end))
        at = marked.find(_LONG_CHUNK, end)
    return spans


def _spelled(toks: list[str]) -> list[tuple[str, list[int]]]:
    found = []
    if max(map(len, toks), default=0) >= SPELLED_CHARS:  # C: no Python step a word
        found += [(t, [k] * len(t)) for k, t in enumerate(toks) if len(t) >= SPELLED_CHARS]
    if _SINGLES.search(f" {' '.join(toks)} "):
        run: list[int] = []
        for k, t in enumerate([*toks, ""]):  # "": the last run ends
            if len(t) == 1:
                run.append(k)
                continue
            if len(run) >= SPELLED_CHARS:
                found.append(("".join(toks[i] for i in run), run))
            run = []
    return found


# How a derived reading's words come from its source's (textnorm_encoded): the
# index keeps its words transformed the same way (HumanIndex.words_as), so a
# derived reading is screened by its source's words, and its own are made
# only if that screen lets it through.
WORD_TRANSFORMS: dict[str, Callable[[list[str]], list[str]]] = {}


class DerivedReading(Reading):
    """A reading whose words are its source's transformed (`kind`: rot13,
    backwards), made when first asked for."""

    _derived: list[str] | None

    def __init__(self, source: Reading, kind: str, text: str, starts: list[int] | None,
                 ends: list[int] | None, focus: frozenset[int] | None = None) -> None:
        self.source, self.kind = source, kind
        super().__init__(source.original, text, starts, ends, [], focus=focus, screen_first=True)
        self._derived = None  # the [] above: made when first asked for

    @property
    def tokens(self) -> list[str]:
        if self._derived is None:
            self._derived = WORD_TRANSFORMS[self.kind](self.source.tokens)
        return self._derived

    @tokens.setter
    def tokens(self, value: list[str]) -> None:
        self._derived = value
