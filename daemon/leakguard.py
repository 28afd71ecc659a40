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
   lines (dialogue and action) and, for a quoted exchange that keeps its cue
   names, windows of the full text of which at least half are lines; a run
   made mostly of scene headings and cues is the story's (a closed-book
   writer of the same story names the same places and people: data/example's
   independent draft shares an 8-word heading with its human script).
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

import hashlib
import itertools
import operator
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from skilltrain import textnorm
from skilltrain.textnorm import Reading

SHINGLE_WORDS = 7
LONG_RUN_WORDS = 8
MIN_CONTENT_WORDS = 2
LONG_MIN_CONTENT_WORDS = 0
REDACTION_MARKER = "[verbatim answer-key passage removed]"

tokens = textnorm.tokens

# Words that cannot make a shingle distinctive: function words, conversational
# filler and the commonest verbs of dialogue, in their normalised form.
_FILLER = frozenset(
    """
a about above after again against all almost also always am an and another any anybody
anyone anything anyway are around as at away back be because been before being below
between both but by can cant could couldnt did didnt do does doesnt doing done dont down
during each either else enough even ever every everybody everyone everything few for
from further had hadnt has hasnt have havent having he hed hell her here heres hers
herself hes him himself his how hows i id if ill im in into is isnt it itd itll its
itself ive just least less let lets like many may maybe me might mine more most much
must my myself neither never no nobody none nor not nothing now of off often oh ok okay
on once one only or other others otherwise our ours ourselves out over own perhaps
please quite rather really right same she shed shell shes should shouldnt since so some
somebody someone something sometimes somewhere soon still such sure than that thats the
their theirs them themselves then there theres these they theyd theyll theyre theyve
thing things this those though through till to too under until up upon us very was
wasnt way we wed well were werent weve what whatever whats when whenever where wheres
whether which while who whod whole whom whos whose why will with within without wont
would wouldnt yet you youd youll your youre yours yourself yourselves youve
ah aha alright eh er hey hi hello huh hmm mm mhm nah oops ow uh uhh um umm wow yeah yep
yes yo god gosh damn hell jeez sorry thanks thank bye goodbye
ain aint gonna gotta wanna lemme gimme kinda sorta cause cuz til ya yall
go goes going gone went get gets getting got gotten come comes coming came know knows
knew known knowing think thinks thought thinking want wants wanted wanting say says said
saying tell tells told telling see sees saw seen seeing look looks looked looking make
makes made making take takes took taken taking give gives gave given giving need needs
needed mean means meant talk talks talking talked feel feels felt try tries tried trying
keep keeps kept put puts leave leaves left call called happen happened happening believe
remember stop wait listen hear heard
good bad fine great little big lot lots kind sort man guy guys people time times day
today tonight tomorrow yesterday night morning moment minute second two three first last
next new old long mr mrs ms sir maam mom dad
home house room door place car phone work job life world year years week idea sleep eat
help care worry ask asked understand stay guess hope love wrong true real
""".split()
)

# Screenplay furniture that can stand inside a line of text: cue extensions
# ("V.O." -> "v o", "CONT'D" -> "contd"), inline parentheticals, camera terms.
# Whole heading, transition, cue and parenthetical lines are weak anyway.
_FURNITURE = frozenset(
    """
int ext est ie vo os oc v o s c contd cont d beat pause pov continuous intercut dissolve
fade cu ecu ws ots sfx fx
""".split()
)

# Lines of 8+ words that every screenwriter writes: a run inside one of them
# starts no leak by either rule (it still extends one). The content-word
# rules already let the all-stock ones pass ("What the hell do you think
# you're doing?"); these hold words that are not filler.
STOCK_LINES = (
    "Get out of here before I call the police.",
    "It's not what it looks like, I can explain.",
    "I'm going to need you to calm down.",
    "Tell me what happened. Start from the beginning.",
    "You don't know what you're dealing with here.",
    "I can't believe you would do this to me.",
    "Whatever happens, I want you to know that I love you.",
    "What are you doing here in the middle of the night?",
    "I don't want to talk about it right now.",
    "There's something I need to tell you about.",
    "I need you to trust me on this one.",
    "You have no idea what you're talking about.",
    "We don't have much time, we have to go.",
    "Why didn't you tell me about this before?",
    "I'm not going to tell you again, get out.",
    "I told you I don't want to see you again.",
    "Do you have any idea how dangerous that is?",
    "If you're hearing this, it means I'm already dead.",
    "I'm not going anywhere until you tell me the truth.",
    "You're the last person I expected to see here.",
    "Don't you dare walk away from me when I'm talking to you.",
    "We're not so different, you and I.",
    "I've been waiting for this moment for a long time.",
    "It's been a long time since I've seen you.",
    "I have no idea what you're talking about.",
    "You're not going to believe what just happened.",
    "Promise me you won't tell anyone about this.",
    "Is there something you want to tell me?",
)


def _stock_runs(n: int) -> frozenset[int]:
    return frozenset(h for line in STOCK_LINES for h in shingle_hashes(tokens(line), n))


_HEADING = re.compile(
    r"^\s*(?:\d+[A-Z]?[.)]?\s+)?(?:INT|EXT|EST|I/E|INT\.?/EXT)\b[.\s/]", re.IGNORECASE
)
_CUE_COLON = re.compile(r"^\s*([A-Z][A-Z0-9 .'\u2019\-]{0,40}?)\s*(?:\([^)]*\))?\s*:\s")
_PARENS = re.compile(r"\([^)\n]*\)")


def shingle_hashes(toks: Sequence[str], n: int) -> list[int]:
    """hash() of every run of n consecutive tokens, in order (len(toks) - n + 1 of them)."""
    windows = zip(*(itertools.islice(toks, k, None) for k in range(n)), strict=False)
    return list(map(hash, windows))


def _line_kind(line: str) -> str:
    """heading, transition, cue, parenthetical or text (action and dialogue)."""
    s = line.strip()
    if not s:
        return "text"
    if (s[:3].upper() in ("INT", "EXT", "EST", "I/E") or s[0].isdigit()) and _HEADING.match(s):
        return "heading"
    if s[0] == "(" and s.endswith(")"):
        return "parenthetical"
    bare = _PARENS.sub(" ", s).strip() if "(" in s else s
    if not bare.isupper():
        return "text"
    if s.endswith("TO:") or s.startswith(("FADE", "CUT TO", "SMASH CUT")):
        return "transition"
    bare = bare.removesuffix(":").rstrip()
    if len(bare.split()) <= 5 and not bare.endswith(("!", "?", ".")):
        return "cue"
    return "text"


@dataclass
class _Streams:
    """One episode as a screenplay reads (all lines) and without its furniture.

    Without headings, transitions, cues and parentheticals, a quoted exchange
    ("Where's the truck?" "Sold." "To who?" "Hollis.") is contiguous; in the
    script it is interleaved with cue names.
    """

    full: list[str] = field(default_factory=list)
    furniture: list[bool] = field(default_factory=list)  # per token of full
    free: list[str] = field(default_factory=list)
    names: set[str] = field(default_factory=set)  # the words of cue names

    @classmethod
    def of(cls, text: str) -> _Streams:
        st = cls()
        for line in text.splitlines():
            if not line or line.isspace():
                continue
            kind = _line_kind(line)
            if kind != "text":
                if kind == "cue":
                    st.names.update(tokens(_PARENS.sub(" ", line)))
                st._add(line, furniture=True)
                continue
            pos = 0
            if (m := _CUE_COLON.match(line)) is not None:  # "WALTER: Sold."
                st.names.update(tokens(m.group(1)))
                st._add(line[: m.end()], furniture=True)
                pos = m.end()
            for paren in _PARENS.finditer(line, pos):
                st._add(line[pos : paren.start()], furniture=False)
                st._add(paren.group(), furniture=True)
                pos = paren.end()
            st._add(line[pos:], furniture=False)
        return st

    def _add(self, segment: str, *, furniture: bool) -> None:
        toks = tokens(segment)
        self.full += toks
        self.furniture += [furniture] * len(toks)
        if not furniture:
            self.free += toks


def _digest(work: str, episodes: Mapping[int, str], n: int, min_content: int,
            long_n: int, long_min_content: int) -> str:
    h = hashlib.sha256(f"{work}\0{n}\0{min_content}\0{long_n}\0{long_min_content}\0".encode())
    for number in sorted(episodes):
        h.update(f"{number}\0{len(episodes[number])}\0".encode())
        h.update(episodes[number].encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _with_content(hashes: list[int], weak: Sequence[bool], n: int, minimum: int) -> list[int]:
    """The windows (of n words, hashed) with at least `minimum` words that are not weak."""
    # Content words per window from a running sum of 0/1 flags.
    sums = [0, *itertools.accumulate(not w for w in weak)]
    counts = map(operator.sub, sums[n:], sums)
    enough = map(operator.le, itertools.repeat(minimum), counts)
    return list(itertools.compress(hashes, enough))


@dataclass(frozen=True, eq=False)
class HumanIndex:
    """Hashed shingles of one work's human text; no human text is kept."""

    work: str
    digest: str
    n: int
    long_n: int
    n_words: int
    episode_of: Mapping[int, int]  # n-shingle hash -> first episode it occurs in
    seeds: frozenset[int]  # the n-shingles distinctive enough to start a leak
    long_runs: frozenset[int]  # every long_n-shingle of the lines
    long_seeds: frozenset[int]  # those with a word that is not stock: they start a leak
    words: frozenset[int]  # hash of every word: only runs of these can match

    @classmethod
    def build(
        cls,
        work: str,
        episodes: Mapping[int, str],
        *,
        n: int = SHINGLE_WORDS,
        min_content: int = MIN_CONTENT_WORDS,
        long_n: int = LONG_RUN_WORDS,
        long_min_content: int = LONG_MIN_CONTENT_WORDS,
    ) -> HumanIndex:
        if n < 1 or long_n < n:
            raise ValueError(f"shingle lengths must be 1 <= n <= long_n, got {n}, {long_n}")
        streams = {number: _Streams.of(text) for number, text in episodes.items()}
        names = set().union(*(st.names for st in streams.values()))
        # "Martha's" folds to "marthas": a possessive is as much a name as the name.
        weak_words = _FILLER | _FURNITURE | names | {w + "s" for w in names}
        episode_of: dict[int, int] = {}
        seeds: set[int] = set()
        long_runs: set[int] = set()
        long_seeds: set[int] = set()
        words: set[int] = set()
        n_words = 0
        # Last episode first, so that the first episode a shingle occurs in wins.
        for number in sorted(streams, reverse=True):
            st = streams[number]
            n_words += len(st.full)
            words.update(map(hash, st.full))
            # A word is weak if it is filler or a name, or stands in a furniture
            # line or parenthetical: "AUCTION" in a scene heading says nothing,
            # "auction" in a line of dialogue does.
            full_weak = [f or t in weak_words for t, f in zip(st.full, st.furniture, strict=True)]
            free_weak = [t in weak_words for t in st.free]
            # Rule 1 reads the lines only: a scene heading or a cue is the
            # story's (a closed-book writer of the same story names the same
            # places and people), and "EXT. HILLCREST CARE HOME - CAR PARK -
            # NIGHT" is 7 words already.
            long_hashes = shingle_hashes(st.free, long_n)
            long_runs.update(long_hashes)
            long_seeds.update(_with_content(long_hashes, free_weak, long_n, long_min_content))
            # A quoted exchange keeps its cue names ("LESTER: ... CAROLYN: ..."):
            # windows of the full text count when most of their words are lines.
            full_long = shingle_hashes(st.full, long_n)
            long_runs.update(full_long)
            mostly_lines = set(_with_content(full_long, st.furniture, long_n, long_n // 2))
            long_seeds.update(h for h in _with_content(full_long, full_weak, long_n,
                                                       long_min_content) if h in mostly_lines)
            for toks, weak in ((st.full, full_weak), (st.free, free_weak)):
                hashes = shingle_hashes(toks, n)
                episode_of.update(dict.fromkeys(hashes, number))
                seeds.update(_with_content(hashes, weak, n, min_content))
        seeds -= _stock_runs(n)
        long_seeds -= _stock_runs(long_n)
        return cls(
            work=work,
            digest=_digest(work, episodes, n, min_content, long_n, long_min_content),
            n=n,
            long_n=long_n,
            n_words=n_words,
            episode_of=episode_of,
            seeds=frozenset(seeds),
            long_runs=frozenset(long_runs),
            long_seeds=frozenset(long_seeds),
            words=frozenset(words),
        )

    def may_match(self, toks: Sequence[str]) -> bool:
        """False if no leak can be in `toks`; True means look closer.

        For bulk scans (a log is mostly words the screenplay never uses): only
        runs of at least n words that all occur in the human text are hashed.
        """
        known = bytes(map(self.words.__contains__, map(hash, toks)))
        for run in re.finditer(b"\x01{%d,}" % self.n, known):
            part = toks[run.start() : run.end()]
            if not self.seeds.isdisjoint(shingle_hashes(part, self.n)):
                return True
            if not self.long_seeds.isdisjoint(shingle_hashes(part, self.long_n)):
                return True
        return False

    def __repr__(self) -> str:  # the default would print every hash
        return (
            f"HumanIndex(work={self.work!r}, n={self.n}, long_n={self.long_n}, "
            f"words={self.n_words}, shingles={len(self.episode_of)}, seeds={len(self.seeds)})"
        )


_CACHE_SIZE = 16
_cache: OrderedDict[str, HumanIndex] = OrderedDict()
_cache_lock = threading.Lock()


def index_for(work: str, episodes: Mapping[int, str]) -> HumanIndex:
    """The index of this exact text, built once per process (LRU, _CACHE_SIZE works)."""
    key = _digest(work, episodes, SHINGLE_WORDS, MIN_CONTENT_WORDS, LONG_RUN_WORDS,
                  LONG_MIN_CONTENT_WORDS)
    with _cache_lock:
        index = _cache.get(key)
        if index is not None:
            _cache.move_to_end(key)
            return index
    # Built outside the lock: two jobs of one work may both build it once, but a
    # big work never blocks the jobs of another.
    index = HumanIndex.build(work, episodes)
    with _cache_lock:
        _cache[key] = index
        _cache.move_to_end(key)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return index


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

    @classmethod
    def of(cls, text: str, index: HumanIndex) -> _Allowed:
        if not text:
            return cls()
        toks = tokens(text)
        return cls(frozenset(shingle_hashes(toks, index.n)),
                   frozenset(shingle_hashes(toks, index.long_n)))


def find_leaks(text: str, index: HumanIndex, *, allow_text: str = "",
               views: Sequence[Reading] | None = None) -> list[Leak]:
    """Every span of `text` that reproduces the indexed human text, in order.

    Spans that also occur in `allow_text` (the model's own episodes) are not
    leaks: a report may quote the model it is judging. `views`:
    textnorm.readings(text), when the caller has them already.
    """
    if views is None:
        views = textnorm.readings(text)
    return _find(text, views, index, lambda: _Allowed.of(allow_text, index))


def _find(text: str, views: Sequence[Reading], index: HumanIndex,
          allow: Callable[[], _Allowed]) -> list[Leak]:
    """`allow` builds the allowed shingles; called only on a hit (the model's
    episodes are the bulk of a prompt, and most texts hit nothing)."""
    spans: list[tuple[int, int, int, int]] = []  # start, end, episode, words
    allowed: _Allowed | None = None
    for k, view in enumerate(views):
        hashes = shingle_hashes(view.tokens, index.n)
        if index.episode_of.keys().isdisjoint(hashes):
            continue  # the common case: no offsets needed
        allowed = allowed or allow()
        found = _token_spans(view.tokens, hashes, index, allowed)
        if not found:
            continue
        wanted = {i for first, last, _ in found for i in (first, last)}
        if view.text is not text:  # escapes decoded or letters folded: map back
            view = textnorm.readings(text, offsets=True)[k]
        where = view.token_spans(wanted)
        spans += [(where[first][0], where[last][1], episode, last - first + 1)
                  for first, last, episode in found]
    return [Leak(start=s, end=e, episode=ep, n_words=w, line=text.count("\n", 0, s) + 1)
            for s, e, ep, w in _merge_spans(spans)]


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


def _merge_spans(spans: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Character spans found by several readings of one text, overlapping ones as one."""
    merged: list[tuple[int, int, int, int]] = []
    for start, end, episode, words in sorted(spans):
        if merged and start < merged[-1][1]:
            prev = merged[-1]
            merged[-1] = (prev[0], max(prev[1], end), prev[2], max(prev[3], words))
        else:
            merged.append((start, end, episode, words))
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

    def leaks(self, text: str) -> list[Leak]:
        """Leaks of any work, in order; those of two works may overlap."""
        if not self.indexes:
            return []
        views = textnorm.readings(text)
        if all(len(v.tokens) < index.n for v in views for index in self.indexes):
            return []  # a word or two: the common log field
        found: list[Leak] = []
        for index in self.indexes:
            if any(index.may_match(v.tokens) for v in views):
                found += _find(text, views, index, _Allowed)
        return sorted(found, key=lambda k: k.start)

    def clean(self, text: str, marker: str = REDACTION_MARKER) -> str:
        """`text` with the passages of every work redacted."""
        leaks = self.leaks(text)
        return redact(text, leaks, marker) if leaks else text


_installed: AnswerKeys | None = None
_installed_lock = threading.Lock()


def install(keys: AnswerKeys | None) -> None:
    """Make `keys` the process's answer keys (the daemon, once works are loaded).

    Logging (log._seal_answer_key), provider error messages (llm) and state
    reasons are checked against them. None: no keys (library log records are
    then withheld whole).
    """
    global _installed
    with _installed_lock:
        _installed = keys


def installed() -> AnswerKeys | None:
    """The answer keys installed in this process, None before `install`."""
    return _installed
