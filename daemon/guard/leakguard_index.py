"""The answer-key index: hashed word runs of a work's human episodes (see
leakguard.py for the two rules that start a leak and why these numbers).

Both texts become normalised words (textnorm); the index holds the hashes
of every run of SHINGLE_WORDS and LONG_RUN_WORDS consecutive words of the
human text, read as streams (the lines; a quoted exchange that keeps its cue
names), minus the runs of STOCK_LINES, with each run's count of content
words (not filler or screenplay furniture). Only hashes, never human text.
Python's str hash is salted per process, so an index is only meaningful in
the process that built it: it is cached in memory by content hash and never
persisted.
"""

from __future__ import annotations

import hashlib
import itertools
import operator
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from ..core import dataset, textnorm
from ..core.textnorm_encoded import CIPHERS, ROT13, substitute
from ..core.textnorm_reading import WORD_TRANSFORMS, hashed_runs
from . import leakguard_spelled
from .leakguard_spelled import SPELLED_CHARS

SHINGLE_WORDS = 7
LONG_RUN_WORDS = 8
MIN_CONTENT_WORDS = 2
LONG_MIN_CONTENT_WORDS = 0
# Rule 1 reads every line of the key, headings and parentheticals included
# (HumanIndex.build's long_reach; bench/RESULTS.md "Issue 25").
LONG_REACH = "line"

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


shingle_hashes = hashed_runs  # the one hashing of runs, readings' and the index's


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
    line_of: list[int] = field(default_factory=list)  # per token of full: its source line
    free: list[str] = field(default_factory=list)
    names: set[str] = field(default_factory=set)  # the words of cue names

    @classmethod
    def of(cls, text: str) -> _Streams:
        st = cls()
        for number, line in enumerate(text.splitlines()):
            if not line or line.isspace():
                continue
            kind = _line_kind(line)
            if kind != "text":
                if kind == "cue":
                    st.names.update(tokens(_PARENS.sub(" ", line)))
                st._add(line, furniture=True, line=number)
                continue
            pos = 0
            if (m := _CUE_COLON.match(line)) is not None:  # "WALTER: Sold."
                st.names.update(tokens(m.group(1)))
                st._add(line[: m.end()], furniture=True, line=number)
                pos = m.end()
            for paren in _PARENS.finditer(line, pos):
                st._add(line[pos : paren.start()], furniture=False, line=number)
                st._add(paren.group(), furniture=True, line=number)
                pos = paren.end()
            st._add(line[pos:], furniture=False, line=number)
        return st

    def _add(self, segment: str, *, furniture: bool, line: int) -> None:
        toks = tokens(segment)
        self.full += toks
        self.furniture += [furniture] * len(toks)
        self.line_of += [line] * len(toks)
        if not furniture:
            self.free += toks


def _digest(work: str, episodes: Mapping[int, str], n: int, min_content: int,
            long_n: int, long_rule: int | str) -> str:
    h = hashlib.sha256(f"{work}\0{n}\0{min_content}\0{long_n}\0{long_rule}\0".encode())
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
    # sha256 of each episode's text: two indexes with the same set are one key
    # under two names (job_keys.other_works reads it once).
    episode_digests: frozenset[str]
    # The key's words run together: letter windows (leakguard_spelled).
    spelled: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    # Can a window of hex digits only be one of them (leakguard_spelled.may_hit)?
    spelled_hex: bool = True
    # Its words as a derived reading has them (rot13, backwards): that
    # reading is screened by its source's words against these.
    words_as: Mapping[str, frozenset[int]] = field(default_factory=dict)
    # Every n-shingle of the key with its words in reverse order: a text's own
    # shingles that are one hold the key's words in reverse order
    # (leakguard_screen), a test with no second pass over the text.
    backward: frozenset[int] = frozenset()
    # Each word of the key in each Caesar shift but 13 and in Atbash: the
    # hash of the word so written -> the ciphers (bits) that make it
    # (leakguard_caesar); and those of SHIFTED_SCREEN_LETTERS letters or
    # more, rot13's too, its first screen.
    shifted: Mapping[int, int] = field(default_factory=dict)
    shifted_long: frozenset[int] = frozenset()

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
        long_reach: str = LONG_REACH,
    ) -> HumanIndex:
        """`long_reach`: which runs of long_n words start a leak by rule 1 --
        "lines" (dialogue and action, and windows mostly of them), "line"
        (those, and long_n words of any one line: a heading, a parenthetical),
        "any" (every run of the text, across headings and cues too)."""
        if n < 1 or long_n < n:
            raise ValueError(f"shingle lengths must be 1 <= n <= long_n, got {n}, {long_n}")
        if long_reach not in ("lines", "line", "any"):
            raise ValueError(f"long_reach must be 'lines', 'line' or 'any', not {long_reach!r}")
        streams = {number: _Streams.of(text) for number, text in episodes.items()}
        names = set().union(*(st.names for st in streams.values()))
        # "Martha's" folds to "marthas": a possessive is as much a name as the name.
        weak_words = _FILLER | _FURNITURE | names | {w + "s" for w in names}
        episode_of: dict[int, int] = {}
        seeds: set[int] = set()
        long_runs: set[int] = set()
        long_seeds: set[int] = set()
        words: set[int] = set()
        spelled: dict[int, tuple[int, int]] = {}
        spelled_hex = False
        backward: set[int] = set()
        vocabulary: set[str] = set()
        n_words = 0
        # Last episode first, so that the first episode a shingle occurs in wins.
        for number in sorted(streams, reverse=True):
            st = streams[number]
            n_words += len(st.full)
            words.update(map(hash, st.full))
            vocabulary.update(st.full)
            # A word is weak if it is filler or a name, or stands in a furniture
            # line or parenthetical: "AUCTION" in a scene heading says nothing,
            # "auction" in a line of dialogue does.
            full_weak = [f or t in weak_words for t, f in zip(st.full, st.furniture, strict=True)]
            spelled.update(leakguard_spelled.key_windows(st.full, full_weak, number))
            spelled_hex = spelled_hex or leakguard_spelled.has_hex_window(st.full)
            free_weak = [t in weak_words for t in st.free]
            # Rule 1 reads the lines, and any one line whole; a run across
            # a heading and the cue after it is the story's (a closed-book
            # writer of the same story names the same places and people:
            # "EXT. HILLCREST CARE HOME - CAR PARK - NIGHT" is 7 words, and
            # the cue after it makes 8).
            long_hashes = shingle_hashes(st.free, long_n)
            long_runs.update(long_hashes)
            long_seeds.update(_with_content(long_hashes, free_weak, long_n, long_min_content))
            # A quoted exchange keeps its cue names ("LESTER: ... CAROLYN: ..."):
            # windows of the full text count when most of their words are lines.
            full_long = shingle_hashes(st.full, long_n)
            long_runs.update(full_long)
            starts = set(_with_content(full_long, st.furniture, long_n, long_n // 2))
            # Any long_n words of one line are the key, whatever the line: a
            # scene heading or a parenthetical quoted whole is as much a quote
            # as dialogue (stock headings are short: "INT. KITCHEN - NIGHT").
            if long_reach == "any":
                starts.update(full_long)
            elif long_reach == "line":
                line_of = st.line_of
                starts.update(h for i, h in enumerate(full_long)
                              if line_of[i] == line_of[i + long_n - 1])
            long_seeds.update(h for h in _with_content(full_long, full_weak, long_n,
                                                       long_min_content) if h in starts)
            for toks, weak in ((st.full, full_weak), (st.free, free_weak)):
                backward.update(shingle_hashes(toks[::-1], n))
                hashes = shingle_hashes(toks, n)
                episode_of.update(dict.fromkeys(hashes, number))
                seeds.update(_with_content(hashes, weak, n, min_content))
        seeds -= _stock_runs(n)
        long_seeds -= _stock_runs(long_n)
        return cls(
            work=work,
            digest=_digest(work, episodes, n, min_content, long_n,
                           f"{long_min_content}/{long_reach}/{SPELLED_CHARS}"),
            n=n,
            long_n=long_n,
            n_words=n_words,
            episode_of=episode_of,
            seeds=frozenset(seeds),
            long_runs=frozenset(long_runs),
            long_seeds=frozenset(long_seeds),
            words=frozenset(words),
            episode_digests=frozenset(map(dataset.sha256_text, episodes.values())),
            spelled=spelled,
            spelled_hex=spelled_hex,
            backward=frozenset(backward),
            shifted=(shifted := _shifted(vocabulary))[0],
            shifted_long=shifted[1],
            words_as={kind: frozenset(map(hash, transform(sorted(vocabulary))))
                      for kind, transform in WORD_TRANSFORMS.items()},
        )

    def may_match(self, toks: Sequence[str]) -> bool:
        """False if no leak can be in `toks`; True means look closer.

        For bulk scans (a log is mostly words the screenplay never uses): only
        runs of at least n words that all occur in the human text are hashed.
        """
        for part in known_runs(toks, self.words, self.n):
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


# A shifted quote has a word this long: most words this long in prose are no
# shift of a key word, so a set test (C) passes most texts at once.
SHIFTED_SCREEN_LETTERS = 4


def _shifted(vocabulary: set[str]) -> tuple[dict[int, int], frozenset[int]]:
    """HumanIndex.shifted and .shifted_long: each word with a letter, in each
    cipher, a Caesar shift or Atbash (one C call a cipher)."""
    words = " ".join(sorted(w for w in vocabulary if not w.isdigit()))
    shifted: dict[int, int] = {}
    long: set[int] = set()
    for cipher in CIPHERS:
        for word in substitute(words, cipher).split():
            key = hash(word)
            shifted[key] = shifted.get(key, 0) | 1 << cipher
            if len(word) >= SHIFTED_SCREEN_LETTERS:
                long.add(key)
    # rot13's too (its reading is every text's; a quote part plain, part rot13
    # is read by leakguard_caesar), where it is no word of the key as written.
    long.update(hash(word) for word in substitute(words, ROT13).split()
                if len(word) >= SHIFTED_SCREEN_LETTERS and word not in vocabulary)
    return shifted, frozenset(long)


def has_known_run(hashes: Sequence[int], words: frozenset[int], n: int) -> bool:
    """Are `n` words in a row (their hashes) all in `words`? Two C calls."""
    return b"\x01" * n in bytes(map(words.__contains__, hashes))


def known_runs(toks: Sequence[str], words: frozenset[int], n: int) -> Iterator[Sequence[str]]:
    """The runs of at least `n` tokens that are all in `words` (hashes of words)."""
    known = bytes(map(words.__contains__, map(hash, toks)))
    for run in re.finditer(b"\x01{%d,}" % n, known):
        yield toks[run.start() : run.end()]


# The indexes kept, by their words: an index costs ~340 bytes a word of key
# (the example work: 3,800 words, 1.3 MB), so 400,000 words is ~130 MB, some
# 16 feature-length screenplays, or a hundred works the example's size. A
# count of works would be wrong both ways: a step of 32 small works rebuilt
# every index on every job (47 ms each), while 16 huge ones could take GBs.
CACHE_WORDS = 400_000
_cache: OrderedDict[str, HumanIndex] = OrderedDict()
_building: dict[str, threading.Event] = {}  # key -> set once its one build is done
_cache_lock = threading.Lock()


def index_for(work: str, episodes: Mapping[int, str]) -> HumanIndex:
    """The index of this exact text, built once per process (LRU, CACHE_WORDS).

    Jobs of one work that start together wait for the one build rather than
    each building it; a big work never blocks the jobs of another.
    """
    key = _digest(work, episodes, SHINGLE_WORDS, MIN_CONTENT_WORDS, LONG_RUN_WORDS,
                  f"{LONG_MIN_CONTENT_WORDS}/{LONG_REACH}/{SPELLED_CHARS}")
    while True:
        with _cache_lock:
            index = _cache.get(key)
            if index is not None:
                _cache.move_to_end(key)
                return index
            building = _building.get(key)
            if building is None:
                _building[key] = threading.Event()
                break
        building.wait()  # then found in the cache (or, if that build failed, build it here)
    try:
        index = HumanIndex.build(work, episodes)
        with _cache_lock:
            _cache[key] = index
            words = sum(i.n_words for i in _cache.values())
            while words > CACHE_WORDS and len(_cache) > 1:
                words -= _cache.popitem(last=False)[1].n_words
    finally:
        with _cache_lock:
            _building.pop(key).set()
    return index
