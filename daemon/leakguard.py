"""Answer-key integrity: find the passages of a text that reproduce the human screenplay.

An LLM asked to compare two screenplays readily quotes the original, and the
optimizer would copy those quotes into the writer's skill, where the next
closed-book writer reads them. So every report is checked against the human
text of its work before it is written, and `skilltrain audit` checks every
file under runs/.

How: both texts become normalised word tokens (case, punctuation, whitespace,
straight/curly quotes, dashes and accents do not matter), and every run of
SHINGLE_WORDS consecutive tokens (a shingle) of the report is looked up in a
hashed set of the human shingles. Hit windows that touch or overlap merge
into one span, mapped back to character offsets in the original report so
that it can be redacted.

Why 7 words (SHINGLE_WORDS): stock screenplay phrases are short ("CUT TO:",
"INT. KITCHEN - NIGHT", "What are you doing here?" = 2-5 words) while a
quoted line of dialogue is typically 7-15 words, and 7 is the largest n that
still catches a single quoted 7-word line. Measured on data/example (an
independent draft of the same story against the human script, ~4,000 words
each), the distinctive shingles the two share fall from 13 at n=4 to 5 at
n=5 and 0 at n=6 and 7: at 7 a closed-book writer's own lines keep a word of
margin in works fifty times that size.

Length alone does not separate clichés: "I don't know what you're talking
about" and "What the hell are you doing here?" are 7 words, and 17 of 40
stock lines in the bench have 7 or more. So a shingle can only *start* a leak
when at least MIN_CONTENT_WORDS of its words are neither function words nor
conversational filler nor cue names, and do not stand in screenplay
furniture (scene headings, transitions, cues, parentheticals). A cliché
teaches the optimizer nothing, a distinctive line does. Weak shingles still
*extend* a span that a distinctive one started, so a long quotation is
removed whole. bench/leakguard_bench.py prints the recall and false-positive
rates behind these numbers for n = 5..9 with and without that rule.

The index holds only hashes, never human text. Python's str hash is salted
per process, so an index is only meaningful in the process that built it:
it is cached in memory by content hash and never persisted.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import operator
import re
import threading
import unicodedata
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

SHINGLE_WORDS = 7
MIN_CONTENT_WORDS = 2
REDACTION_MARKER = "[verbatim answer-key passage removed]"

# Apostrophes join a word ("don't", "don’t" -> "dont"); everything else that is
# not a letter or digit separates words. Combining marks are part of a word so
# that decomposed accents (e + U+0301) fold like precomposed ones.
_APOSTROPHES = "'\u2019\u2018\u02bc"
# (The underscore, a \w character, is split off when a token is folded: one
# character class matches faster than an alternation.)
_WORDCH = r"[\w\u0300-\u036f]"
_TOKEN = re.compile(rf"{_WORDCH}+(?:[{_APOSTROPHES}]+{_WORDCH}+)*")
_WORD = re.compile(r"[^\W_]+")
# In ASCII text, exactly the tokens of `tokens()`, one match each.
_ASCII_TOKEN = re.compile(r"[A-Za-z0-9]+(?:'+[A-Za-z0-9]+)*")
_MARKS = re.compile(r"[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]+")
_DROP_APOSTROPHES = {ord(c): None for c in _APOSTROPHES}
# Letters that NFKD does not decompose but an English writer types without.
_LETTERS = str.maketrans({"œ": "oe", "æ": "ae", "ø": "o", "ł": "l", "đ": "d", "ı": "i"})

# Typography that an ASCII character stands for without changing a token:
# apostrophes stay apostrophes, separators stay separators. One character for
# one, so offsets carry over.
_TYPOGRAPHY = (
    {c: "'" for c in _APOSTROPHES[1:]}
    | {c: '"' for c in "\u201c\u201d\u201e\u00ab\u00bb\u2032\u2033"}
    | {c: "-" for c in "\u2010\u2011\u2012\u2013\u2014\u2015\u2212"}
    | {c: " " for c in "\u00a0\u2009\u200a\u202f\u2026\u2022\u00b7"}
)
# A regex finds them in C; str.translate would look up every character.
_TYPOGRAPHY_RE = re.compile("[" + "".join(_TYPOGRAPHY) + "]")


def _plain(text: str) -> str:
    """`text` with its typography in ASCII: same length, same tokens."""
    if text.isascii():
        return text
    return _TYPOGRAPHY_RE.sub(lambda m: _TYPOGRAPHY[m.group()], text)


# ASCII fast path: lower-case letters and digits stay, the
# apostrophe is deleted, everything else becomes a space.
_ASCII_TABLE = bytes(
    (c + 32 if 65 <= c <= 90 else c) if chr(c).isalnum() and c < 128 else 32 for c in range(256)
)

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

_HEADING = re.compile(
    r"^\s*(?:\d+[A-Z]?[.)]?\s+)?(?:INT|EXT|EST|I/E|INT\.?/EXT)\b[.\s/]", re.IGNORECASE
)
_CUE_COLON = re.compile(r"^\s*([A-Z][A-Z0-9 .'\u2019\-]{0,40}?)\s*(?:\([^)]*\))?\s*:\s")
_PARENS = re.compile(r"\([^)\n]*\)")


@functools.lru_cache(maxsize=65536)
def _fold_token(raw: str) -> tuple[str, ...]:
    """One raw token in its normalised form(s); folding may split it (rarely)."""
    if raw.isascii():
        folded = raw.lower().replace("'", "")
        return (folded,) if "_" not in folded else tuple(w for w in folded.split("_") if w)
    return tuple(_WORD.findall(_fold_text(raw)))


def _fold_text(text: str) -> str:
    """Case, accents and apostrophes removed from a whole text (length changes)."""
    text = text.casefold()
    if not text.isascii():
        text = _MARKS.sub("", unicodedata.normalize("NFKD", text)).translate(_LETTERS)
    return text.translate(_DROP_APOSTROPHES)


def tokens(text: str) -> list[str]:
    """The normalised word tokens of a text: letters and digits, apostrophes joining."""
    text = _plain(text)  # LLM prose: curly quotes and dashes around ASCII words
    if text.isascii():  # same result, without a Python call per word
        return text.encode("ascii").translate(_ASCII_TABLE, b"'").decode("ascii").split()
    out: list[str] = []
    for raw in _TOKEN.findall(text):
        out.extend(_fold_token(raw))
    return out


def _tokens_with_offsets(text: str) -> tuple[list[str], list[tuple[int, int]]]:
    """`tokens(text)` plus the (start, end) character offsets of each in `text`."""
    toks: list[str] = []
    spans: list[tuple[int, int]] = []
    for m in _TOKEN.finditer(text):
        folded = _fold_token(m.group())
        if len(folded) == 1:
            toks.append(folded[0])
            spans.append(m.span())
        else:
            toks.extend(folded)
            spans.extend([m.span()] * len(folded))
    return toks, spans


def fast_tokens(text: str) -> list[str]:
    """Nearly `tokens(text)`, faster on long non-ASCII text (for bulk scanning).

    It folds the whole text before splitting it, so it differs from `tokens`
    only on characters that are not letters but fold into letters ("™" ->
    "tm", "½" -> "1⁄2"), which no screenplay quote depends on.
    """
    text = _plain(text)
    if text.isascii():
        return tokens(text)
    return _WORD.findall(_fold_text(text))


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


def _digest(work: str, episodes: Mapping[int, str], n: int, min_content: int) -> str:
    h = hashlib.sha256(f"{work}\0{n}\0{min_content}\0".encode())
    for number in sorted(episodes):
        h.update(f"{number}\0{len(episodes[number])}\0".encode())
        h.update(episodes[number].encode("utf-8", "surrogatepass"))
    return h.hexdigest()


@dataclass(frozen=True, eq=False)
class HumanIndex:
    """Hashed shingles of one work's human text; no human text is kept."""

    work: str
    digest: str
    n: int
    n_words: int
    episode_of: Mapping[int, int]  # shingle hash -> first episode it occurs in
    seeds: frozenset[int]  # the shingles distinctive enough to start a leak
    words: frozenset[int]  # hash of every word: only runs of these can match

    @classmethod
    def build(
        cls,
        work: str,
        episodes: Mapping[int, str],
        *,
        n: int = SHINGLE_WORDS,
        min_content: int = MIN_CONTENT_WORDS,
    ) -> HumanIndex:
        if n < 1:
            raise ValueError(f"shingle length must be >= 1, got {n}")
        streams = {number: _Streams.of(text) for number, text in episodes.items()}
        names = set().union(*(st.names for st in streams.values()))
        # "Martha's" folds to "marthas": a possessive is as much a name as the name.
        weak_words = _FILLER | _FURNITURE | names | {w + "s" for w in names}
        episode_of: dict[int, int] = {}
        seeds: set[int] = set()
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
            for toks, weak in ((st.full, full_weak), (st.free, free_weak)):
                hashes = shingle_hashes(toks, n)
                episode_of.update(dict.fromkeys(hashes, number))
                # Content words per window from a running sum of 0/1 flags.
                sums = [0, *itertools.accumulate(not w for w in weak)]
                counts = map(operator.sub, sums[n:], sums)
                enough = map(operator.le, itertools.repeat(min_content), counts)
                seeds.update(itertools.compress(hashes, enough))
        return cls(
            work=work,
            digest=_digest(work, episodes, n, min_content),
            n=n,
            n_words=n_words,
            episode_of=episode_of,
            seeds=frozenset(seeds),
            words=frozenset(words),
        )

    def may_match(self, toks: Sequence[str]) -> bool:
        """False if no distinctive shingle can be in `toks`; True means look closer.

        For bulk scans (a log is mostly words the screenplay never uses): only
        runs of at least n words that all occur in the human text are hashed.
        """
        known = bytes(map(self.words.__contains__, map(hash, toks)))
        for run in re.finditer(b"\x01{%d,}" % self.n, known):
            if not self.seeds.isdisjoint(shingle_hashes(toks[run.start() : run.end()], self.n)):
                return True
        return False

    def __repr__(self) -> str:  # the default would print every hash
        return (
            f"HumanIndex(work={self.work!r}, n={self.n}, words={self.n_words}, "
            f"shingles={len(self.episode_of)}, seeds={len(self.seeds)})"
        )


_CACHE_SIZE = 16
_cache: OrderedDict[str, HumanIndex] = OrderedDict()
_cache_lock = threading.Lock()


def index_for(work: str, episodes: Mapping[int, str]) -> HumanIndex:
    """The index of this exact text, built once per process (LRU, _CACHE_SIZE works)."""
    key = _digest(work, episodes, SHINGLE_WORDS, MIN_CONTENT_WORDS)
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


def find_leaks(text: str, index: HumanIndex, *, allow_text: str = "") -> list[Leak]:
    """Every span of `text` that reproduces the indexed human text, in order.

    Spans that also occur in `allow_text` (the model's own episodes) are not
    leaks: a report may quote the model it is judging.
    """
    n = index.n
    # Same length as text, so offsets carry over; mostly ASCII afterwards.
    plain = _plain(text)
    toks = tokens(plain)
    hashes = shingle_hashes(toks, n)
    if index.seeds.isdisjoint(hashes):
        return []  # the common case: no offsets needed
    all_spans: list[tuple[int, int]] | None = None
    if not plain.isascii():  # letters beyond ASCII: tokenise with offsets throughout
        toks, all_spans = _tokens_with_offsets(text)
        hashes = shingle_hashes(toks, n)
    allowed = set(shingle_hashes(tokens(allow_text), n)) if allow_text else set()
    episode_of, seeds = index.episode_of, index.seeds
    hits = [(i, h) for i, h in enumerate(hashes) if h in episode_of and h not in allowed]
    found: list[tuple[int, int, int]] = []  # first token, last token, seed hash
    for run in _runs(hits, n):
        seed = next((h for _, h in run if h in seeds), None)
        if seed is not None:  # else only stock phrases and furniture: not a leak
            found.append((run[0][0], run[-1][0] + n - 1, seed))
    ends = [i for first, last, _ in found for i in (first, last)]
    where = _ascii_spans(plain, ends) if all_spans is None else {i: all_spans[i] for i in ends}
    return [
        Leak(
            start=where[first][0],
            end=where[last][1],
            episode=episode_of[seed],
            n_words=last - first + 1,
            line=text.count("\n", 0, where[first][0]) + 1,
        )
        for first, last, seed in found
    ]


def _ascii_spans(text: str, wanted: Iterable[int]) -> dict[int, tuple[int, int]]:
    """(start, end) of the tokens numbered `wanted` in an ASCII text, one pass, no folding."""
    need = set(wanted)
    out: dict[int, tuple[int, int]] = {}
    if not need:
        return out
    last = max(need)
    for i, m in enumerate(_ASCII_TOKEN.finditer(text)):
        if i in need:
            out[i] = m.span()
            if i == last:
                break
    return out


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
    """`text` with every leaked span replaced by `marker`."""
    parts: list[str] = []
    pos = 0
    for leak in sorted(leaks, key=lambda k: k.start):
        if leak.start < pos:  # overlapping spans (from two indexes): extend the cut
            pos = max(pos, leak.end)
            continue
        parts += [text[pos : leak.start], marker]
        pos = leak.end
    parts.append(text[pos:])
    return "".join(parts)


def leaked_words(leaks: Iterable[Leak]) -> int:
    """How many words the leaks cover: a measure for the log line."""
    return sum(leak.n_words for leak in leaks)
