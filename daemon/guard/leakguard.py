"""Answer-key integrity: find the passages of a text that reproduce the human screenplay.

An LLM asked to compare two screenplays readily quotes the original, and the
optimizer would copy those quotes into the writer's skill, where the next
closed-book writer reads them. So every report and prompt archive is checked
against the human text of its whole work (every episode, not only the range
it reviews: the writer has no more right to episode 6 than to episode 2)
before it is written; every log line, error reason and state entry is
checked against every work (`AnswerKeys`); and `skilltrain audit` checks
every file under runs/ against every work.

How: both texts become normalised words (textnorm: case, punctuation,
accents, typography, HTML entities, escapes, URL encoding, zero-width and
format characters, look-alike letters do not matter), and every run of n
consecutive words (a shingle) of the checked text is looked up in hashed
sets of the human shingles. Two rules start a leak:

1. LONG_RUN_WORDS (8) consecutive words of the human text, whatever the
   words (LONG_MIN_CONTENT_WORDS = 0). A voice-over line of common words
   ("What in the world is wrong with her? She had a walk this morning.") is
   as much the answer key as a distinctive one. The windows read are the
   lines (dialogue and action), any one line whole whatever its kind (a
   nine-word scene heading of rare names, a long parenthetical: issue 25)
   and, for a quoted exchange that keeps its cue names, windows of the full
   text of which at least half are lines. A run across a heading and the
   cue after it is the story's (a closed-book writer of the same story names
   the same places and people: data/example's independent draft shares a
   7-word heading and the cue after it with its human script); stock
   headings are short ("INT. KITCHEN - NIGHT").
2. SHINGLE_WORDS (7) words with at least MIN_CONTENT_WORDS (2) that are not
   stock: a distinctive 7-word line is a quote too.

Windows that touch or overlap a started run extend it (a stock stretch inside
a quote goes with the quote), so a long quotation is removed whole; the span
is mapped back to the exact characters of the original text (escapes and
zero-width characters inside it included) so that it can be redacted. Text
that also occurs in the model's own episodes (`allow_text`) is not a leak: a
report may quote the model it judges. Runs inside STOCK_LINES (lines every
screenwriter writes) start nothing.

Why these numbers (bench/leakguard_bench.py; bench/RESULTS.md "Issue 11"):
on the corpus of tests/corpus (a real screenplay as key, 82 lines of 8+ words
in 26 disguises) rule 2 alone catches 90.2%, rules 1+2 100%; false-positive
spans on independent real screenplays (Brick & Steel), on data/example's
independent draft and on reports that do not quote are 0 with either. A
stock line of 8+ words that the key itself holds is a leak by rule 1 (the
issue's definition: the words occur in the human text); a report may still
say it when the model's episodes say it too (`allow_text`), and the 28
STOCK_LINES below start nothing. Requiring one word that is not stock
(LONG_MIN_CONTENT_WORDS = 1) would let through a line made only of common
words ("I don't know what you want me to say to you"): a hole in rule 1
for no gain measured on real text. At 7 words, length alone does not separate
cliches ("What the hell are you doing here?" is 7), a content word does.

The index holds only hashes, never human text. Python's str hash is salted
per process, so an index is only meaningful in the process that built it:
it is cached in memory by content hash and never persisted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..core import textnorm
from ..core.textnorm import Reading
from ..core.textnorm_reading import SPELLED_CHARS
from . import leakguard_caesar, leakguard_spelled
from .leakguard_index import (
    LONG_MIN_CONTENT_WORDS,
    LONG_RUN_WORDS,
    MIN_CONTENT_WORDS,
    SHINGLE_WORDS,
    STOCK_LINES,
    HumanIndex,
    index_for,
    shingle_hashes,
    tokens,
)
from .leakguard_screen import known_run, may_leak, reads_spelled, screened_out, spells
from .leakguard_spans import Span, apart, merge

REDACTION_MARKER = "[verbatim answer-key passage removed]"
_WordSpan = tuple[int, int, int, int]  # first word, last word, episode, words: of a reading

# The index (leakguard_index.py) is re-exported: callers know one module, the guard.
__all__ = [
    "LONG_MIN_CONTENT_WORDS", "LONG_RUN_WORDS", "MIN_CONTENT_WORDS", "REDACTION_MARKER",
    "SHINGLE_WORDS", "STOCK_LINES", "AnswerKeys", "HumanIndex", "KeySource", "Leak",
    "find_leaks", "index_for", "install", "installed", "keep_current", "redact",
    "shingle_hashes", "tokens",
]


@dataclass(frozen=True)
class Leak:
    """A span of the checked text that reproduces the human text.

    start/end are character offsets into the checked text; line is 1-based;
    n_words counts the normalised words in the span.
    """

    start: int
    end: int
    episode: int
    n_words: int
    line: int


@dataclass(frozen=True)
class _Allowed:
    """Shingles of the model's own text: quoting them is not a leak."""

    short: frozenset[int] = frozenset()
    long: frozenset[int] = frozenset()
    spelled: frozenset[int] = frozenset()  # its letter windows (leakguard_spelled)

    @classmethod
    def of(cls, text: str, index: HumanIndex) -> _Allowed:
        if not text:
            return cls()
        toks = tokens(text)
        return cls(frozenset(shingle_hashes(toks, index.n)),
                   frozenset(shingle_hashes(toks, index.long_n)),
                   leakguard_spelled.allowed_windows(toks))

    @classmethod
    def union(cls, parts: Iterable[_Allowed]) -> _Allowed:
        both = list(parts)
        return cls(frozenset().union(*(a.short for a in both)),
                   frozenset().union(*(a.long for a in both)),
                   frozenset().union(*(a.spelled for a in both)))


_recent_allowed: dict[tuple[str, int, str], _Allowed] = {}
_RECENT_ALLOWED = 8
_recent_lock = threading.Lock()


def _allowed(text: str, index: HumanIndex) -> _Allowed:
    """_Allowed.of, for the last few (text, index): a loss job checks its
    report, archive and sidecar with the same model episodes allowed (the
    str caches its hash, so the lookup costs nothing after the first)."""
    key = (index.digest, index.n, text)
    found = _recent_allowed.get(key)
    if found is None:
        found = _Allowed.of(text, index)
        with _recent_lock:  # the job pool's threads share it
            while len(_recent_allowed) >= _RECENT_ALLOWED:
                _recent_allowed.pop(next(iter(_recent_allowed)))
            _recent_allowed[key] = found
    return found


def find_leaks_of_any(text: str, indexes: Sequence[HumanIndex], *,
                      allow_text: str | tuple[str, ...] = "") -> list[Leak]:
    """find_leaks against several works' indexes, in order; the text is read
    and hashed once (indexes of one build share their shingle lengths)."""
    if not indexes:
        return []
    views = textnorm.readings(text)
    hashed: dict[tuple[int, int, int], list[int]] = {}
    found: list[Leak] = []
    for index in indexes:
        found += find_leaks(text, index, allow_text=allow_text, views=views, hashed=hashed)
    return sorted(found, key=lambda k: k.start)


def find_leaks(text: str, index: HumanIndex, *, allow_text: str | tuple[str, ...] = "",
               views: Sequence[Reading] | None = None,
               hashed: dict[tuple[int, int, int], list[int]] | None = None) -> list[Leak]:
    """Every span of `text` that reproduces the indexed human text, in order.

    Spans that also occur in `allow_text` (the model's own episodes) are not
    leaks: a report may quote the model it is judging. A tuple: pieces of
    the model's text, each read alone (no run spans two; not kept for reuse).
    `views`: textnorm.readings(text), when the caller has them already.
    """
    if views is None:
        views = textnorm.readings(text)
    if isinstance(allow_text, tuple):
        pieces = allow_text
        return _find(text, views, index, lambda: _Allowed.union(
            _Allowed.of(piece, index) for piece in pieces), hashed)
    return _find(text, views, index, lambda: _allowed(allow_text, index), hashed)


def _find(text: str, views: Sequence[Reading], index: HumanIndex,
          allow: Callable[[], _Allowed],
          hashed: dict[tuple[int, int, int], list[int]] | None = None) -> list[Leak]:
    """`allow` builds the allowed shingles; called only on a hit (the model's
    episodes are the bulk of a prompt, and most texts hit nothing). `hashed`:
    the views' shingle hashes by (view, n, long_n), kept across indexes."""
    spans: list[Span] = []
    allowed: _Allowed | None = None
    mapped: list[Reading] | None = None  # the readings with offsets: made once, on a hit

    def allowed_now() -> _Allowed:
        nonlocal allowed
        allowed = allowed or allow()
        return allowed

    def mapped_view(k: int, view: Reading, change: Callable[[Reading], Reading] | None = None
                    ) -> Reading:
        """The view with offsets (escapes decoded or letters folded: map back)."""
        nonlocal mapped
        if view.text is text and change is None:
            return view
        mapped = mapped or textnorm.readings(text, offsets=True)
        return mapped[k] if change is None else change(mapped[k])

    in_place: list[Span] = []  # finds of readings in place: kept apart from the others'
    for k, view in enumerate(views):
        if found := _view_spans(view, index, allowed_now, hashed, (k, index.n, index.long_n)):
            (in_place if view.in_place else spans).extend(_char_spans(mapped_view(k, view), found))
        if index.shifted and view.is_first:  # the key in a Caesar shift or Atbash
            for change, shifted in leakguard_caesar.shifted_back(view, index):
                if found := _view_spans(shifted, index, allowed_now):
                    (in_place if shifted.in_place else spans).extend(
                        _char_spans(mapped_view(k, view, change), found))
    return [Leak(start=s, end=e, episode=ep, n_words=w, line=text.count("\n", 0, s) + 1)
            for s, e, ep, w in merge(spans + apart(in_place, spans))]


def _view_spans(view: Reading, index: HumanIndex, allowed: Callable[[], _Allowed],
                hashed: dict[tuple[int, int, int], list[int]] | None = None,
                key: tuple[int, int, int] | None = None) -> list[_WordSpan]:
    """(first word, last word, episode, words) of each run of the key in one
    reading; `hashed[key]`: its shingle hashes, kept across indexes."""
    found = _spelled_spans(view, index, allowed)
    if not screened_out(view, index):
        hashes = hashed.get(key) if hashed is not None and key is not None else None
        if hashes is None:
            hashes = _hashes(view, index.n, index.long_n)
            if hashed is not None and key is not None:
                hashed[key] = hashes
        if not index.episode_of.keys().isdisjoint(hashes):  # rare: offsets needed
            found += [(first, last, episode, last - first + 1) for first, last, episode
                      in _token_spans(view.tokens, hashes, index, allowed())]
    return found


def _char_spans(view: Reading, found: list[_WordSpan]) -> list[Span]:
    """(start, end, episode, words) in the text of each run found in `view`
    (the reading with offsets)."""
    where = view.token_spans({i for first, last, *_ in found for i in (first, last)})
    # min/max: a reading backwards (textnorm) has its first word last.
    return [(min(where[first][0], where[last][0]), max(where[first][1], where[last][1]),
             episode, words) for first, last, episode, words in found]


def _spelled_spans(view: Reading, index: HumanIndex,
                   allowed: Callable[[], _Allowed]) -> list[_WordSpan]:
    """(first word, last word, episode, words) of the key spelled out in the
    view (leakguard_spelled): in its first readings, not rot13 or backwards."""
    if not reads_spelled(view) or not index.spelled:
        return []
    out = []
    for letters, word_of in view.spelled():
        if not leakguard_spelled.may_hit(letters, index.spelled_hex):
            continue
        if found := leakguard_spelled.hits(letters, index.spelled):
            found = leakguard_spelled.hits(letters, index.spelled, allowed().spelled)
        out += [(word_of[first], word_of[end - 1], episode, words)
                for first, end, episode, words in found]
    return out


def _hashes(view: Reading, n: int, long_n: int) -> list[int]:
    """The view's shingle hashes; for a view with a focus (textnorm: the
    markup reading), only the windows whose long run (rule 1) holds a focus
    word, the rest -1 (no hash is -1 in CPython: never a hit). Every other
    window holds words the first reading has in the same order, and that
    reading is read whole."""
    if view.focus is None:
        return view.run_hashes(n)
    toks = view.tokens
    out = [-1] * max(0, len(toks) - n + 1)
    for first in sorted({i for f in view.focus
                         for i in range(max(0, f - long_n + 1), min(len(out) - 1, f) + 1)}):
        out[first] = hash(tuple(toks[first:first + n]))
    return out


def _token_spans(toks: Sequence[str], hashes: Sequence[int], index: HumanIndex,
                 allowed: _Allowed) -> list[tuple[int, int, int]]:
    """(first token, last token, episode) of every leak, merged, in order."""
    n, long_n = index.n, index.long_n
    episode_of, seeds = index.episode_of, index.seeds
    hits = [(i, h) for i, h in enumerate(hashes) if h in episode_of]
    found: list[tuple[int, int, int]] = []
    # Rule 2: a run of touching or overlapping hit windows with a distinctive one.
    for run in _runs([(i, h) for i, h in hits if h not in allowed.short], n):
        seed = next((h for _, h in run if h in seeds), None)
        if seed is not None:  # else only stock phrases and furniture
            found.append((run[0][0], run[-1][0] + n - 1, episode_of[seed]))
    # Rule 1: long runs of the human text. Their first n words are a hit, so
    # only hit positions are hashed again.
    long_hits = []
    for i, _ in hits:
        if i + long_n <= len(toks):
            long_hash = hash(tuple(toks[i : i + long_n]))
            if long_hash in index.long_runs and long_hash not in allowed.long:
                long_hits.append((i, long_hash))
    for run in _runs(long_hits, long_n):
        if any(h in index.long_seeds for _, h in run):  # else a stock line alone
            first = run[0][0]
            found.append((first, run[-1][0] + long_n - 1, episode_of[hashes[first]]))
    return _merge_token_spans(found)


def _merge_token_spans(found: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Spans that overlap or touch (no word between them) become one."""
    merged: list[tuple[int, int, int]] = []
    for first, last, episode in sorted(found):
        if merged and first <= merged[-1][1] + 1:
            prev = merged[-1]
            merged[-1] = (prev[0], max(prev[1], last), prev[2])
        else:
            merged.append((first, last, episode))
    return merged


def _runs(hits: list[tuple[int, int]], n: int) -> Iterable[list[tuple[int, int]]]:
    """Group hit windows whose tokens overlap or touch (window i covers i..i+n-1)."""
    run: list[tuple[int, int]] = []
    for hit in hits:
        if run and hit[0] > run[-1][0] + n:
            yield run
            run = []
        run.append(hit)
    if run:
        yield run


def redact(text: str, leaks: Iterable[Leak], marker: str = REDACTION_MARKER) -> str:
    """`text` with every leaked span replaced by `marker`.

    Leaks found against several works (`AnswerKeys.leaks`) may overlap: the
    cut then runs to the end of the longer one, under one marker.
    """
    parts: list[str] = []
    pos = 0
    for leak in sorted(leaks, key=lambda k: k.start):
        if leak.start < pos:
            pos = max(pos, leak.end)
            continue
        parts += [text[pos : leak.start], marker]
        pos = leak.end
    parts.append(text[pos:])
    return "".join(parts)


class AnswerKeys:
    """Every work's index: the check for text that belongs to no one work.

    Log lines, provider error messages and state reasons can carry text of
    any work (a provider echoes the prompt it was sent), so they are checked
    against all of them, with no allowed text.
    """

    def __init__(self, indexes: Iterable[HumanIndex]) -> None:
        self.indexes = tuple(indexes)
        # Every work's words in one set: a text with no run of n words that some
        # work uses (a log line's path, an id) is passed with one look per
        # reading, not one per work (bench/RESULTS.md, issue 36).
        self._n = min((index.n for index in self.indexes), default=0)
        # Fewer ASCII characters than the shortest text any reading holds a
        # leak in: n words need n - 1 characters between them, and no reading
        # of ASCII text has more characters than it (a decoding has fewer);
        # the key spelled out takes SPELLED_CHARS letters. A log line's job
        # id, range or event name is that short.
        self._shortest = min(2 * self._n - 1, SPELLED_CHARS)
        self._words = frozenset().union(*(index.words for index in self.indexes))
        self._shifted_long = frozenset().union(*(index.shifted_long for index in self.indexes))
        # The kinds every index has (one built without them is screened by the
        # derived reading's own words, against _words).
        kinds = set.intersection(*(set(index.words_as) for index in self.indexes)) \
            if self.indexes else set()
        self._words_as = {kind: frozenset().union(*(index.words_as[kind]
                                                    for index in self.indexes))
                          for kind in kinds}

    def leaks(self, text: str) -> list[Leak]:
        """Leaks of any work, in order; those of two works may overlap."""
        if not self.indexes or (len(text) < self._shortest and text.isascii()):
            return []
        views = textnorm.readings(text)
        if not any(known_run(v, self._words, self._words_as, self._n) for v in views) \
                and not spells(views) \
                and not leakguard_caesar.may_hold_any(views, self.indexes, self._shifted_long):
            return []  # no run of any work's words: the common log field
        found: list[Leak] = []
        for index in self.indexes:
            if may_leak(views, index):
                found += _find(text, views, index, _Allowed)
        return sorted(found, key=lambda k: k.start)

    def clean(self, text: str, marker: str = REDACTION_MARKER) -> str:
        """`text` with the passages of every work redacted."""
        leaks = self.leaks(text)
        return redact(text, leaks, marker) if leaks else text


class LineStream:
    """A program's output as it comes, line by line (the writer's and the
    optimizer's, relayed to the log): a passage wrapped over several lines,
    each under the guard's length, is a passage all the same. Each line is
    read with the lines before it (WINDOW_CHARS of them): those of its own
    stream, and those of every stream as they came (a passage may alternate
    between stdout and stderr; a progress bar on one must not push the
    other's lines out of the window). What of a passage falls in the new
    line is cut; the lines before it went out as they were, none of them a
    passage alone."""

    WINDOW_CHARS = 600
    _EVERY = ""  # the window of all streams together

    def __init__(self) -> None:
        self._before: dict[str, str] = {}
        self._lock = threading.Lock()  # stdout's and stderr's relay threads

    def guard(self, line: str, stream: str = "") -> str:
        """`line` of `stream` with the part of any passage it ends or continues cut."""
        keys = installed()
        if keys is None:
            return line
        with self._lock:
            texts = [self._read_on(name, line) for name in dict.fromkeys((stream, self._EVERY))]
        cuts = [Leak(start=max(leak.start, start) - start, end=leak.end - start,
                     episode=leak.episode, n_words=leak.n_words, line=1)
                for text, start in texts for leak in keys.leaks(text) if leak.end > start]
        return redact(line, cuts) if cuts else line

    def _read_on(self, name: str, line: str) -> tuple[str, int]:
        """The window `name` with `line` after it, and where the line starts in it."""
        before = self._before.get(name, "")
        text = f"{before}\n{line}" if before else line
        self._before[name] = text[-self.WINDOW_CHARS:]
        return text, len(text) - len(line)


class KeySource(Protocol):
    """Answer keys that follow data/ (leakguard_live.LiveAnswerKeys)."""

    def current(self) -> AnswerKeys: ...
    def holds(self, index: HumanIndex) -> bool: ...
    def check(self) -> bool: ...


_installed: AnswerKeys | KeySource | None = None
_installed_lock = threading.Lock()


def install(keys: AnswerKeys | KeySource | None) -> None:
    """Make `keys` the process's answer keys (the daemon, once works are loaded).

    Logging (log._seal_answer_key), provider error messages (llm) and state
    reasons are checked against them. None: no keys (library log records are
    then withheld whole). A KeySource is asked each time, so that a key
    edited or added while the daemon runs is guarded without a restart.
    """
    global _installed
    with _installed_lock:
        _installed = keys


def installed() -> AnswerKeys | None:
    """The answer keys installed in this process, None before `install`."""
    source = _installed
    if source is None or isinstance(source, AnswerKeys):
        return source
    return source.current()


def keep_current(index: HumanIndex) -> None:
    """A job has read this work's key: the installed keys must hold it now, not
    at their next look (a provider error about this job may echo it)."""
    source = _installed
    if source is not None and not isinstance(source, AnswerKeys) and not source.holds(index):
        source.check()
