"""leakguard: verbatim answer-key passages are found, mapped back and redacted."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.core import textnorm, textnorm_encoded
from skilltrain.daemon.guard import leakguard, leakguard_index, leakguard_spelled
from skilltrain.daemon.guard.leakguard import REDACTION_MARKER, HumanIndex, find_leaks, redact

# A human screenplay written for these tests (two episodes).
HUMAN_EP1 = """\
FADE IN:

EXT. HOLLIS FARM - GATE - DAWN

Fog on the fields. The gate swings in the wind, unlatched.

INT. FARMHOUSE KITCHEN - CONTINUOUS

MARTHA (60s, flour to the elbows) scrubs a pot that is already clean.

MARTHA
You left the gate open again, Walter. The goats are halfway to Hollis.

WALTER (O.S.)
I don't know what you're talking about.

MARTHA
(beat)
The money in the biscuit tin was never yours to spend.

Walter appears in the doorway, boots in hand, caught.

WALTER
I was going to put every penny back before the auction.

MARTHA
What are you doing here?

WALTER
I live here.

CUT TO:

INT. FARMHOUSE KITCHEN - NIGHT

MARTHA
Where's the truck?

WALTER
Sold.

MARTHA
To who?

WALTER
Hollis.
"""

HUMAN_EP2 = """\
EXT. AUCTION YARD - DAY

Rain. A tractor with a handwritten price on the windshield.

AUCTIONEER
Lot forty-two, one Ferguson tractor, runs when it feels like it.

MARTHA
(to Walter, not looking at him)
Your father sold this same tractor to my father for a handshake and a pie.

WALTER
Then let's buy it back with the pie.
"""

HUMAN = {1: HUMAN_EP1, 2: HUMAN_EP2}

# The closed-book model's version of the same scenes: same story, own words,
# some shared stock phrases.
MODEL_EP1 = """\
INT. FARMHOUSE KITCHEN - NIGHT

MARTHA
What are you doing here? I don't know what you're talking about, she says.

WALTER
I took the money from the tin. I meant to return it before the sale.

MARTHA
The goats are out again and you took our savings, Walter.
"""

STOCK_PHRASES = [
    "INT. KITCHEN - NIGHT",
    "CUT TO:",
    "I don't know",
    "What are you doing here?",
    "(beat)",
    "CONTINUOUS",
    "FADE IN:",
    "I don't know what you're talking about.",
    "I don't want to talk about it.",
    "What the hell are you doing here?",
    "We need to talk.",
    "Are you okay?",
    "I'll be right back.",
    "Get out of here!",
    "INT. FARMHOUSE KITCHEN - CONTINUOUS",
    "WALTER (O.S.)",
    "I live here.",
]

HUMAN_STOCK = (
    "INT. KITCHEN - NIGHT\n\nMARTHA\nI don't want to talk about it.\n\nWALTER\n"
    "What the hell are you doing here?\n\nMARTHA\nWe need to talk.\n\nWALTER\n"
    "Are you okay?\n\nMARTHA\nI'll be right back.\n\nWALTER\nGet out of here!\n\n"
    "MARTHA\nI don't know what you're talking about.\n\nCUT TO:\n\n"
    "INT. FARMHOUSE KITCHEN - CONTINUOUS\n\nWALTER (O.S.)\nI live here.\n"
)


@pytest.fixture(scope="module")
def index() -> HumanIndex:
    return HumanIndex.build("hollis", HUMAN)


def _span(text: str, leak: leakguard.Leak) -> str:
    return text[leak.start : leak.end]


def test_quoted_lines_found_and_redacted(index: HumanIndex) -> None:
    quotes = [
        "You left the gate open again, Walter. The goats are halfway to Hollis.",
        "The money in the biscuit tin was never yours to spend.",
        "Your father sold this same tractor to my father for a handshake and a pie.",
    ]
    # The fourth line with its case and punctuation changed.
    altered = "i WAS going to put every penny back -- before the auction!!"
    prose = [
        "The model's Martha never raises her voice.",
        "Where the original has her say",
        "the model settles for a shrug.",
        "Later, Walter pleads:",
        "and at the auction Martha remembers:",
        "Finally the confession changes:",
        "which lands harder than anything in the model.",
    ]
    report = (
        f"{prose[0]} {prose[1]} \u201c{quotes[0]}\u201d, {prose[2]}\n\n"
        f'{prose[3]} "{quotes[1]}"\n\n'
        f"{prose[4]} '{quotes[2]}'\n\n"
        f"{prose[5]} {altered} {prose[6]}\n"
    )
    leaks = find_leaks(report, index)
    assert len(leaks) == 4
    # A span runs from the first to the last word: the closing period stays.
    assert [_span(report, k) for k in leaks[:3]] == [q.rstrip(".") for q in quotes]
    assert _span(report, leaks[3]) == "i WAS going to put every penny back -- before the auction"
    assert [k.episode for k in leaks] == [1, 1, 2, 1]
    assert [k.line for k in leaks] == [1, 3, 5, 7]
    assert leaks[0].n_words == 13
    redacted = redact(report, leaks)
    assert redacted.count(REDACTION_MARKER) == 4
    for sentence in prose:
        assert sentence in redacted
    for quote in quotes:
        assert quote.rstrip(".") not in redacted
    assert "penny" not in redacted
    assert find_leaks(redacted, index) == []


def test_quotes_of_the_model_are_allowed(index: HumanIndex) -> None:
    report = (
        "The model writes: \u201cWhat are you doing here? I don't know what you're talking "
        "about, she says.\u201d and \u201cI took the money from the tin. I meant to return "
        "it before the sale.\u201d The goats are out again and you took our savings, Walter.\n"
    )
    assert find_leaks(report, index, allow_text=MODEL_EP1) == []
    # The model text shares stock phrases with the human one; a model line that
    # happens to equal a human line is the model's too.
    shared = "Walter: You left the gate open again, Walter. The goats are halfway to Hollis."
    leaking = f"{report}\n{shared}\n"
    assert len(find_leaks(leaking, index)) == 1
    model_with_line = MODEL_EP1 + "\nYou left the gate open again, Walter. The goats are halfway"
    leaks = find_leaks(leaking, index, allow_text=model_with_line)
    # What the model did not write ("to Hollis") is human text the report
    # reproduces; the words the model wrote before it stay.
    # (rule 1: "open ... halfway to" is 8 human words the model did not write.)
    assert [_span(leaking, k) for k in leaks] == [
        "open again, Walter. The goats are halfway to Hollis"
    ]
    assert redact(report, find_leaks(report, index, allow_text=MODEL_EP1)) == report


def test_allow_text_does_not_hide_human_only_lines(index: HumanIndex) -> None:
    report = "Compare: I was going to put every penny back before the auction. Weak."
    assert len(find_leaks(report, index, allow_text=MODEL_EP1)) == 1


def test_stock_phrases_are_not_leaks() -> None:
    index = HumanIndex.build("stock", {1: HUMAN_STOCK, 2: HUMAN_EP1})
    report = "\n".join(
        f"Both versions use the line {phrase!r}, which is fine." for phrase in STOCK_PHRASES
    )
    # Run together with a word between them: each alone is stock. (Side by
    # side, "here?" + "I don't know what you're talking about" would be 8
    # words in a row of HUMAN_STOCK, a leak by rule 1.)
    report += "\n" + " so ".join(STOCK_PHRASES) + "\n" + "\nso ".join(STOCK_PHRASES)
    assert find_leaks(report, index) == []
    # In the script's order they are its exchange: 8+ words in a row of the
    # human text, a leak by rule 1 although every word is stock.
    in_order = "MARTHA: " + " ".join(STOCK_PHRASES[8:14])
    assert len(find_leaks(in_order, index)) == 1
    # One more line, and the stock run around it goes with it.
    goats = HumanIndex.build("stock", {1: HUMAN_STOCK.replace("here!", "here, goats!")})
    exchange = " ".join(STOCK_PHRASES[8:14]).replace("here!", "here, goats!")
    text = f"Report: {exchange} I don't know what you're talking about. Fine."
    (leak,) = find_leaks(text, goats)
    assert _span(text, leak) == exchange + " I don't know what you're talking about"
    # The long ones are in the index (matched), just not distinctive enough to
    # start a leak; without the content-word rule they would be flagged.
    long = [p for p in STOCK_PHRASES if len(leakguard.tokens(p)) >= index.n]
    assert len(long) == 3
    for phrase in long:
        assert set(leakguard.shingle_hashes(leakguard.tokens(phrase), index.n)) <= set(
            index.episode_of
        )
    unfiltered = HumanIndex.build("stock", {1: HUMAN_STOCK, 2: HUMAN_EP1}, min_content=0,
                                  long_n=99)
    assert find_leaks(report, unfiltered) != []
    # The same report with one distinctive line is flagged: the index works.
    flagged = f"{report}\nAnd: the money in the biscuit tin was never yours to spend.\n"
    leaks = find_leaks(flagged, index)
    assert [_span(flagged, k) for k in leaks] == [
        "the money in the biscuit tin was never yours to spend"
    ]


def test_screenplay_furniture_alone_is_not_a_leak(index: HumanIndex) -> None:
    report = (
        "The original opens FADE IN: EXT. HOLLIS FARM - GATE - DAWN and cuts "
        "INT. FARMHOUSE KITCHEN - CONTINUOUS then MARTHA (beat) WALTER (O.S.) CUT TO: "
        "INT. FARMHOUSE KITCHEN - NIGHT MARTHA WALTER."
    )
    assert find_leaks(report, index) == []


def test_quoted_exchange_across_cues_is_a_leak(index: HumanIndex) -> None:
    report = "Their best exchange: 'Where’s the truck?' 'Sold.' 'To who?' 'Hollis.' (ep 1)."
    leaks = find_leaks(report, index)
    assert len(leaks) == 1
    assert _span(report, leaks[0]) == "Where’s the truck?' 'Sold.' 'To who?' 'Hollis"
    # With the cue names, as a screenplay excerpt, it is one too.
    excerpt = "MARTHA: Where's the truck?\nWALTER: Sold.\nMARTHA: To who?\nWALTER: Hollis.\n"
    assert len(find_leaks(excerpt, index)) == 1


def test_offsets_with_unicode_curly_quotes_and_line_breaks() -> None:
    human = {4: "ÉLODIE\nC’est la vie, mon cœur — we’ll sell the café before the frost comes.\n"}
    index = HumanIndex.build("paris", human)
    # Emoji and accents before the span: offsets are in code points, not bytes.
    # Decomposed accents, straight apostrophes and a line break inside the quote.
    report = (
        "# Report 🎬🎬\n\nNotes on Élodie — “naïve” staging.\n"
        "She says: «C'est la vie, mon COEUR: we'll sell the\n"
        "cafe\u0301 before the frost» — lovely.\n"
    )
    leaks = find_leaks(report, index)
    assert len(leaks) == 1
    leak = leaks[0]
    assert _span(report, leak) == (
        "C'est la vie, mon COEUR: we'll sell the\ncafe\u0301 before the frost"
    )
    assert leak.line == 4
    assert leak.episode == 4
    assert leak.n_words == 12
    assert redact(report, leaks) == (
        "# Report 🎬🎬\n\nNotes on Élodie — “naïve” staging.\n"
        f"She says: «{REDACTION_MARKER}» — lovely.\n"
    )


# One human line (11 words, ep 1) dressed so that, read as it stands, no 8
# words of it are in a row: only the guard's own normalisation finds it.
QUOTE = "The money in the biscuit tin was never yours to spend"
_WORDS = QUOTE.split()
HTML_DRESSED = {
    "named entities": "&nbsp;".join(_WORDS),
    "double-encoded": "&amp;nbsp;".join(_WORDS),
    "numeric entities": " ".join(f"{w[0]}&#{ord(w[1])};{w[2:]}" if len(w) > 1 else w
                                 for w in _WORDS).replace(" ", "&#x20;"),
}
ZERO_WIDTH_DRESSED = {
    "zero-width space": " ".join(w[:1] + "\u200b" + w[1:] for w in _WORDS),
    "soft hyphen": " ".join(w[:2] + "\u00ad" + w[2:] for w in _WORDS),
    "word joiner and BOM": " ".join(w[:1] + "\u2060" + w[1:-1] + "\ufeff" + w[-1:]
                                    for w in _WORDS),
}


@pytest.mark.parametrize("dressed", list(HTML_DRESSED.values()), ids=list(HTML_DRESSED))
def test_a_quote_in_html_entities_is_found_and_cut_whole(index: HumanIndex,
                                                         dressed: str) -> None:
    report = f"Martha's line lands: {dressed}. The model's does not.\n"
    (leak,) = find_leaks(report, index)
    assert (leak.episode, leak.n_words) == (1, len(_WORDS))
    # The span maps back to the original characters, entities and all.
    assert _span(report, leak) == dressed
    assert redact(report, [leak]) == (
        f"Martha's line lands: {REDACTION_MARKER}. The model's does not.\n")


@pytest.mark.parametrize("dressed", list(ZERO_WIDTH_DRESSED.values()),
                         ids=list(ZERO_WIDTH_DRESSED))
def test_a_quote_with_zero_width_characters_inside_its_words_is_found_and_cut_whole(
        index: HumanIndex, dressed: str) -> None:
    report = f"Martha's line lands: {dressed}. The model's does not.\n"
    (leak,) = find_leaks(report, index)
    assert (leak.episode, leak.n_words) == (1, len(_WORDS))
    assert _span(report, leak) == dressed
    redacted = redact(report, [leak])
    assert redacted == f"Martha's line lands: {REDACTION_MARKER}. The model's does not.\n"
    assert find_leaks(redacted, index) == []


def test_redact_multiple_and_no_leaks() -> None:
    text = "0123456789abcdefghij"
    leaks = [
        leakguard.Leak(start=12, end=15, episode=1, n_words=7, line=1),
        leakguard.Leak(start=2, end=5, episode=1, n_words=7, line=1),
    ]
    assert redact(text, leaks, marker="#") == "01#56789ab#fghij"
    assert redact(text, []) == text


def test_index_for_caches_by_content(monkeypatch: pytest.MonkeyPatch) -> None:
    first = leakguard.index_for("cache-test", {1: HUMAN_EP1})
    again = leakguard.index_for("cache-test", {1: str(HUMAN_EP1)})
    assert again is first
    changed = leakguard.index_for("cache-test", {1: HUMAN_EP1 + "\nMARTHA\nOne more line."})
    assert changed is not first
    renumbered = leakguard.index_for("cache-test", {2: HUMAN_EP1})
    assert renumbered is not first
    kept = leakguard.index_for("cache-test", {1: HUMAN_EP1})
    assert kept is first
    # Bounded by words, not works: fillers of first.n_words words push it out.
    monkeypatch.setattr(leakguard_index, "CACHE_WORDS", first.n_words * 2)
    filler = " ".join(f"word{i}" for i in range(first.n_words))
    for i in range(2):
        leakguard.index_for(f"filler-{i}", {1: filler})
    assert leakguard.index_for("cache-test", {1: HUMAN_EP1}) is not first


def test_index_for_builds_a_work_once_for_jobs_that_start_together(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """32 jobs of one new work at once: one build, and all of them get it."""
    builds: list[str] = []
    real_build = leakguard_index.HumanIndex.build

    def slow_build(work: str, episodes: Any, **kw: Any) -> HumanIndex:
        builds.append(work)
        time.sleep(0.2)  # the other jobs arrive while it builds
        return real_build(work, episodes, **kw)

    monkeypatch.setattr(leakguard_index.HumanIndex, "build", slow_build)
    text = {1: HUMAN_EP1 + "\nA line only this test has."}
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: leakguard.index_for("together", text), range(32)))
    assert builds == ["together"]
    assert all(index is got[0] for index in got)


def test_index_holds_no_human_text(index: HumanIndex) -> None:
    shown = repr(index)
    assert "goats" not in shown and "Walter" not in shown
    assert all(isinstance(h, int) for h in index.seeds)
    assert index.n == leakguard.SHINGLE_WORDS
    assert index.n_words == len(leakguard.tokens(HUMAN_EP1)) + len(leakguard.tokens(HUMAN_EP2))


def test_token_spans_match_tokens() -> None:
    samples = [
        HUMAN_EP1,
        "Don’t — STOP! l'été, naïve café, O'Brien's 42nd_street, ß ﬁne",
        "‘quoted’ rock 'n' roll, a''b, x ʼyʼ, 'tis “so”… ok",
        '{"msg": "tab\\there", "x": [1, 2]}',
        "fa\u200bther &amp;rsquo; %E2%80%99 \\u00e9t\\u00e9 Тhе",
    ]
    for text in samples:
        fast = textnorm.readings(text)
        mapped = textnorm.readings(text, offsets=True)
        assert [r.tokens for r in fast] == [r.tokens for r in mapped]
        for r in mapped:
            spans = r.token_spans()
            assert len(spans) == len(r.tokens)
            assert all(text[a:b].strip() for a, b in spans.values())
            assert r.token_spans({1, 3}) == {i: spans[i] for i in (1, 3) if i in spans}
    assert leakguard.tokens("Don’t STOP-now, café foo_bar a''b") == [
        "dont", "stop", "now", "cafe", "foo", "bar", "ab",
    ]  # fmt: skip


def test_may_match_is_a_cheap_superset(index: HumanIndex) -> None:
    line = leakguard.tokens("The money in the biscuit tin was never yours to spend.")
    prose = leakguard.tokens("the event loss completed in 3 s for run 7 with 1200 tokens " * 50)
    assert index.may_match(prose + line + prose)
    assert not index.may_match(prose)
    # Stock phrases are known words but no distinctive shingle.
    assert not index.may_match(leakguard.tokens("I don't know what you're talking about."))


def test_short_texts() -> None:
    index = HumanIndex.build("tiny", {1: "Hello there."})
    assert find_leaks("Hello there.", index) == []
    assert find_leaks("", HumanIndex.build("x", {1: HUMAN_EP1})) == []
    with pytest.raises(ValueError):
        HumanIndex.build("bad", {1: HUMAN_EP1}, n=0)


def test_check_is_fast(index: HumanIndex) -> None:
    words = ("the model's pacing is slower and the scenes run long " * 1000).split()
    report = " ".join(words) + " The money in the biscuit tin was never yours to spend."
    assert len(words) == 10_000
    best = min(_timed(lambda: find_leaks(report, index, allow_text=MODEL_EP1)) for _ in range(3))
    # Milliseconds in practice (see bench/leakguard_bench.py); generous for a busy CI.
    assert best < 0.25


def _timed(fn: object) -> float:
    assert callable(fn)
    start = time.perf_counter()
    leaks = fn()
    elapsed = time.perf_counter() - start
    assert len(leaks) == 1
    return elapsed


# Two distinctive lines of HUMAN_EP1 that are not next to each other there.
LINE_A = "The money in the biscuit tin was never yours to spend."
LINE_B = "Your father sold this same tractor to my father for a handshake and a pie."


def test_touching_quotes_merge_into_one_span(index: HumanIndex) -> None:
    # Back to back, the last window of A and the first of B touch (no word
    # between): one passage, one marker. A window is n words, so "touch"
    # means the next hit starts exactly n words after the previous one.
    touching = f"Both: {LINE_A} {LINE_B} End."
    (leak,) = find_leaks(touching, index)
    assert _span(touching, leak) == f"{LINE_A} {LINE_B}".rstrip(".")
    assert redact(touching, [leak]) == f"Both: {REDACTION_MARKER}. End."
    # A stock line (no seed of its own) touching a quote goes with it.
    stock = "I don't know what you're talking about"
    extended = f"{LINE_A} {stock}. End."
    (leak,) = find_leaks(extended, index)
    assert _span(extended, leak) == f"{LINE_A} {stock}"
    assert find_leaks(f"So: {stock}. End.", index) == []
    # One word between them: two passages, the word stays.
    apart = f"Both: {LINE_A} and {LINE_B} End."
    first, second = find_leaks(apart, index)
    assert redact(apart, [first, second]) == (
        f"Both: {REDACTION_MARKER}. and {REDACTION_MARKER}. End.")


def test_overlapping_windows_make_one_span_per_quote(index: HumanIndex) -> None:
    report = f"x {LINE_B} y"
    (leak,) = find_leaks(report, index)  # 9 overlapping windows, one passage
    assert leak.n_words == len(leakguard.tokens(LINE_B))


def test_span_merging_rules() -> None:
    merge = leakguard._merge_token_spans
    assert merge([(8, 15, 2), (0, 7, 1)]) == [(0, 15, 1)]  # touching
    assert merge([(0, 7, 1), (9, 15, 1)]) == [(0, 7, 1), (9, 15, 1)]  # a word between
    assert merge([(0, 9, 1), (3, 7, 2), (5, 12, 1)]) == [(0, 12, 1)]  # overlapping
    from skilltrain.daemon.guard import leakguard_spans

    chars = leakguard_spans.merge
    assert chars([(10, 20, 1, 3), (0, 12, 2, 4)]) == [(0, 20, 2, 4)]
    assert chars([(0, 10, 1, 3), (10, 20, 1, 3)]) == [(0, 10, 1, 3), (10, 20, 1, 3)]
    # A reading in place's find counts only apart from the others'.
    assert leakguard_spans.apart([(0, 9, 1, 8), (30, 40, 1, 8)], [(5, 20, 1, 8)]) == [
        (30, 40, 1, 8)]


def test_answer_keys_of_two_works_overlap_under_one_marker() -> None:
    # Two works share a passage (a public-domain poem both quote, say); a
    # report quoting more than either holds gets overlapping leaks from the
    # two indexes, and redact cuts their union under one marker.
    shared = "the woods are lovely dark and deep but I have promises to keep"
    first = HumanIndex.build("frost1", {1: f"ADA\nWhispering {shared} tonight again.\n"})
    second = HumanIndex.build("frost2", {1: f"TOM\n{shared} and miles to go before I sleep.\n"})
    keys = leakguard.AnswerKeys([first, second])
    text = f"Note: Whispering {shared} and miles to go before I sleep. Done."
    leaks = keys.leaks(text)
    assert len(leaks) == 2 and leaks[1].start < leaks[0].end  # they overlap
    assert keys.clean(text) == f"Note: {REDACTION_MARKER}. Done."
    assert keys.clean("a short field") == "a short field"
    assert leakguard.AnswerKeys([]).leaks(text) == []


def test_redact_cuts_to_the_furthest_end_when_a_leak_nests_in_another() -> None:
    # Sorted by start, the outer passage comes first and the inner one ends
    # before it: the cut must resume at the outer end, not the last one seen.
    text = "0123456789abcdefghijKLMNOP"
    outer = leakguard.Leak(start=2, end=16, episode=1, n_words=9, line=1)
    inner = leakguard.Leak(start=5, end=9, episode=1, n_words=7, line=1)
    later = leakguard.Leak(start=20, end=23, episode=1, n_words=7, line=1)
    assert redact(text, [inner, later, outer], marker="#") == "01#ghij#NOP"
    # Several nested in one, and one that starts with the outer one.
    same_start = leakguard.Leak(start=2, end=4, episode=1, n_words=7, line=1)
    assert redact(text, [same_start, inner, outer], marker="#") == "01#ghijKLMNOP"
    assert redact(text, [outer, same_start, inner], marker="#") == "01#ghijKLMNOP"


def test_answer_keys_leak_nested_in_a_longer_one_is_cut_whole() -> None:
    # One work holds a line wholly inside a longer line of another (a shared
    # quotation): the report quoting the longer line gets the short leak
    # inside the long one, and the tail of the long one must not survive.
    inner = "the woods are lovely dark and deep but I have promises to keep"
    outer = f"Whispering low, {inner} and miles to go before I sleep tonight"
    long_work = HumanIndex.build("frost-long", {1: f"ADA\n{outer}.\n"})
    short_work = HumanIndex.build("frost-short", {1: f"TOM\nHe said {inner}, then left.\n"})
    text = f"Note: {outer}. Done."
    for keys in (leakguard.AnswerKeys([long_work, short_work]),
                 leakguard.AnswerKeys([short_work, long_work])):
        leaks = keys.leaks(text)
        assert len(leaks) == 2
        first, second = leaks
        assert first.start < second.start and second.end < first.end  # nested
        cleaned = keys.clean(text)
        assert cleaned == f"Note: {REDACTION_MARKER}. Done."
        assert "miles to go" not in cleaned and "sleep tonight" not in cleaned


def test_long_run_of_common_words_is_a_leak_alone() -> None:
    # No 7-word window of it holds two content words (rule 2 cannot start),
    # but 8 human words in a row with one that is not stock (rule 1) can.
    human = {1: "JANE\nWhat in the world is wrong with her? She had a walk this morning.\n"}
    rule2_only = HumanIndex.build("w", human, long_n=99)
    both = HumanIndex.build("w", human)
    report = "She asks what in the world is wrong with her, she had a walk this morning!"
    assert find_leaks(report, rule2_only) == []
    (leak,) = find_leaks(report, both)
    assert _span(report, leak) == "what in the world is wrong with her, she had a walk this morning"


def test_eight_common_words_in_a_row_are_a_leak_whatever_the_words() -> None:
    # Every word is filler: rule 2 cannot start a span, rule 1 must.
    human = "INT. KITCHEN - NIGHT\n\nMARTHA\nI don't know what you want me to say to you.\n"
    index = HumanIndex.build("common", {1: human})
    report = "The human line is 'I don't know what you want me to say to you' and it lands."
    (leak,) = find_leaks(report, index)
    assert report[leak.start:leak.end].startswith("I don't know")
    # Seven of them are not (nor is the same text when the model wrote it too).
    assert find_leaks("She says: I don't know what you want me.", index) == []
    assert find_leaks(report, index, allow_text="I don't know what you want me to say to you") == []


def test_a_quoted_exchange_with_its_cue_names_is_a_leak() -> None:
    human = ("INT. BARN - DAY\n\nMARTHA\nAre you coming?\n\nWALTER\nNot yet.\n\n"
             "MARTHA\nWhy not?\n\nWALTER\nBecause.\n")
    index = HumanIndex.build("exchange", {1: human})
    report = "It goes MARTHA: Are you coming? WALTER: Not yet. MARTHA: Why not? and on."
    assert len(find_leaks(report, index)) == 1
    # A heading and a cue shared with the human script are the story's.
    assert find_leaks("INT. BARN - DAY. MARTHA enters.", index) == []


# Issue 25: headings were exempt from rule 1; a long one is the key like any line.
RARE_HEADING = "INT. QUIXWELL-ARBANOV OBSERVATORY - ZELTRANE ANNEX - VORSK BASEMENT - NIGHT"
HEADING_KEY = (f"{RARE_HEADING}\n\nMARTHA\nAre you coming?\n\n"
               "EXT. BARN - DAY\n\nWALTER\n(leaning on the gate, not looking up from the muddy "
               "ledger in his hands)\nNot yet.\n")


def test_a_long_scene_heading_quoted_whole_is_a_leak() -> None:
    index = HumanIndex.build("heading", {1: HEADING_KEY})
    assert len(textnorm.tokens(RARE_HEADING)) == 9
    report = f"The original opens on {RARE_HEADING.lower()} and never says why."
    (leak,) = find_leaks(report, index)
    assert _span(report, leak).upper() == RARE_HEADING
    assert RARE_HEADING.lower() not in redact(report, [leak])
    # Seen through the normalisation like any quote, and by the log's check too.
    disguised = report.replace(" ", "\u200b ").replace("o", "\u043e")
    assert find_leaks(disguised, index)
    assert leakguard.AnswerKeys([index]).leaks(report)
    # Eight of its words are enough; seven are not.
    eight = " ".join(textnorm.tokens(RARE_HEADING)[1:])
    assert find_leaks(f"It reads {eight}, in capitals.", index)
    seven = " ".join(textnorm.tokens(RARE_HEADING)[2:])
    assert find_leaks(f"It reads {seven}, in capitals.", index) == []


def test_a_long_parenthetical_quoted_whole_is_a_leak() -> None:
    index = HumanIndex.build("heading", {1: HEADING_KEY})
    report = "Walter is leaning on the gate, not looking up from the muddy ledger in his hands."
    assert find_leaks(report, index)


def test_headings_the_model_wrote_too_and_short_stock_headings_stay_allowed() -> None:
    index = HumanIndex.build("heading", {1: HEADING_KEY})
    model = f"{RARE_HEADING}\n\nMARTHA\nWe should go.\n"
    report = f"Both open on {RARE_HEADING}, a good choice."
    assert find_leaks(report, index, allow_text=model) == []
    assert find_leaks("EXT. BARN - DAY. WALTER waits; MARTHA: Are you coming?", index) == []


def test_a_heading_and_the_cue_after_it_are_the_storys() -> None:
    # data/example's independent draft has this pair: 7 heading words and the
    # cue make 8 words of the key, across two lines, written closed-book.
    key = "EXT. HILLCREST CARE HOME - CAR PARK - DAY\n\nDEV\nKeys. Where are the keys?\n"
    draft = "EXT. HILLCREST CARE HOME - CAR PARK - DAY\n\nDev circles the van twice.\n"
    assert find_leaks(draft, HumanIndex.build("example", {1: key})) == []
    assert find_leaks(draft, HumanIndex.build("example", {1: key}, long_reach="any"))
    with pytest.raises(ValueError, match="long_reach"):
        HumanIndex.build("example", {1: key}, long_reach="headings")


def _live_data(tmp_path: Path) -> Path:
    human = tmp_path / "data" / "farm" / "human"
    human.mkdir(parents=True)
    (human / "ep01.txt").write_text(HUMAN_EP1, encoding="utf-8")
    return tmp_path / "data"


def test_live_keys_follow_edits_added_works_and_same_size_rewrites(tmp_path: Path) -> None:
    from skilltrain.daemon.guard.leakguard_live import LiveAnswerKeys

    data = _live_data(tmp_path)
    now = [0.0]
    changes: list[tuple[int, int]] = []
    live = LiveAnswerKeys(data, clock=lambda: now[0],
                          on_change=lambda w, e: changes.append((w, e)))
    leakguard.install(live)
    try:
        first = leakguard.installed()
        assert first is not None and [i.work for i in first.indexes] == ["farm"]
        line_a = "Quillon pawned the brass sextant to settle the ferry debt."
        line_b = "Zelda burned the brass ledger to settle the harbour feuds."
        assert len(line_a) == len(line_b)
        episode = data / "farm" / "human" / "ep01.txt"
        with episode.open("a", encoding="utf-8") as f:
            f.write(f"\nMARTHA\n{line_a}\n")
        # Not looked at again before the interval: the same object, cheaply.
        assert leakguard.installed() is first
        now[0] += live.every_s
        assert leakguard.installed() is not first
        assert leakguard.installed().leaks(f"She says {line_a}")  # type: ignore[union-attr]
        # Rewritten in place at once, same size (mtime may not move within a
        # tick): still seen, since a file this new is read again.
        episode.write_text(episode.read_text("utf-8").replace(line_a, line_b), "utf-8")
        now[0] += live.every_s
        keys = leakguard.installed()
        assert keys is not None and keys.leaks(f"She says {line_b}")
        assert not keys.leaks(f"She says {line_a}")
        # A work added while running.
        added = data / "mill" / "human"
        added.mkdir(parents=True)
        (added / "ep02.txt").write_text("ODO\nThe tallow clerk sold every ledger of the marsh "
                                        "parish to the glassblowers.\n", encoding="utf-8")
        now[0] += live.every_s
        keys = leakguard.installed()
        assert keys is not None and sorted(i.work for i in keys.indexes) == ["farm", "mill"]
        assert changes[-1] == (2, 2)
        # Nothing changed: the same object (the log's cache is kept by it).
        time.sleep(0.01)
        now[0] += live.every_s
        assert leakguard.installed() is keys
    finally:
        leakguard.install(None)


def test_a_job_that_read_a_key_the_log_does_not_hold_makes_it_look_now(
        tmp_path: Path) -> None:
    from skilltrain.daemon.guard.leakguard_live import LiveAnswerKeys

    data = _live_data(tmp_path)
    live = LiveAnswerKeys(data, every_s=3600)
    leakguard.install(live)
    try:
        assert leakguard.installed() is not None
        line = "Quillon pawned the brass sextant to settle the ferry debt."
        text = HUMAN_EP1 + f"\nMARTHA\n{line}\n"
        (data / "farm" / "human" / "ep01.txt").write_text(text, encoding="utf-8")
        assert not leakguard.installed().leaks(line)  # type: ignore[union-attr]
        leakguard.keep_current(leakguard.index_for("farm", {1: text}))
        assert leakguard.installed().leaks(line)  # type: ignore[union-attr]
    finally:
        leakguard.install(None)


@pytest.mark.parametrize("second_name", ["ep001.txt", "ep0001.txt", "ep00001.txt"])
def test_two_files_of_one_episode_are_both_the_key(tmp_path: Path, second_name: str) -> None:
    # ep01.txt and ep001.txt both name episode 1. The live keys kept whichever
    # the folder listing gave last, so the log was checked against the other
    # text; a job's own index (and its copy check) saw only ep01.txt.
    from skilltrain.daemon.core import dataset
    from skilltrain.daemon.guard.leakguard_live import LiveAnswerKeys

    data = _live_data(tmp_path)
    human = data / "farm" / "human"
    line = "Quillon pawned the brass sextant to settle the ferry debt of the marsh parish."
    (human / second_name).write_text(f"MARTHA\n{line}\n", encoding="utf-8")
    for name in ("ep01.txt", second_name):
        assert dataset.episode_number(name) == 1
    keys = LiveAnswerKeys(data).current()
    work = dataset.load_work(data / "farm")
    job_index = leakguard.index_for("farm", work.read_all_human())
    for quoted in (line, "I was going to put every penny back before the auction."):
        assert keys.leaks(f"She says {quoted}"), quoted
        assert find_leaks(f"She says {quoted}", job_index), quoted
    assert work.human_episodes() == [1]
    assert sorted(work.read_human_files()) == sorted(["ep01.txt", second_name])


MARKUP_DISGUISES = ["backtick inside", "star inside", "bold inside", "underscore inside",
                    "tilde inside", "backtick for apostrophe", "HTML backtick inside",
                    "soft hyphen at line breaks", "hyphen at line breaks",
                    "backtick inside, line-wrapped", "HTML tags inside",
                    "Markdown escape inside"]


INVISIBLE_AND_LATIN_DISGUISES = [
    "Mongolian free variation selector inside", "variation selector 17 inside",
    "combining grapheme joiner inside", "Hangul filler between",
    "halfwidth Hangul filler between", "small capitals", "Latin alpha and script g",
    "Latin letters with hooks"]


# Quoted-printable, CSS's and %u escapes decode in place, as %XX does: a word
# of the report next to the quote may join its run, so these are read as the
# markup ones are.
QUOTED_PRINTABLE_DISGUISES = ["quoted-printable, spaces quoted",
                              "quoted-printable, curly apostrophes",
                              "quoted-printable, every byte", "code points, U+",
                              "CSS escapes", "%u escapes"]
# Leetspeak leaves the prose around a quote as it is: read as a plain quote.
LEET_DISGUISES = ["leetspeak", "leetspeak, vowels only"]
# Part plain, part encoded: read decoded in place, the cut takes both parts.
PART_ENCODED_DISGUISES = ["a third plain, the rest base64", "a third plain, the rest hex",
                          "a third plain, the rest Caesar 3", "a third plain, the rest Atbash"]


@pytest.mark.parametrize("disguise", MARKUP_DISGUISES + INVISIBLE_AND_LATIN_DISGUISES
                         + QUOTED_PRINTABLE_DISGUISES + LEET_DISGUISES
                         + PART_ENCODED_DISGUISES)
def test_markup_invisible_characters_and_letter_variants_do_not_hide_a_quote(
        disguise: str) -> None:
    # Issue 34: grab`bed, gr*abbed, Wouldn`t are one word to a reader; a guard
    # that split them there passed 14-word lines of the key. A later review got
    # lines past the guard, the log seal and the audit with characters Unicode
    # shows as nothing or as a blank (Default_Ignorable_Code_Point) that are not
    # format characters, and Latin letters NFKC leaves alone (small capitals,
    # alpha, letters with hooks).
    from tests.corpus import adversarial

    key = adversarial.key()
    index = leakguard.index_for(adversarial.WORK, key)
    for line in adversarial.quotable_lines(key):
        report = adversarial.report_quoting(adversarial.DISGUISES[disguise](line))
        leaks = find_leaks(report, index)
        assert leaks, line
        # The cut covers the disguised quote: nothing of it is found again.
        assert find_leaks(redact(report, leaks), index) == []
        assert leakguard.AnswerKeys([index]).leaks(report)  # the log's and state's check


def test_episode_names_do_not_make_a_leetspeak_reading() -> None:
    # Issue 36: every sidecar names two or three episodes (ep01, ep03) beside
    # "exclamations_per_1k_words", and each had a leetspeak reading made and
    # read. A name is "ep" and its digits alone: other words still count.
    def leet(text: str) -> bool:
        return textnorm_encoded.leet_reading(textnorm.readings(text)[0]) is not None

    sidecar = ('{"ep01.txt": "9f", "ep03.txt": "c2", "ep05.txt": "e9", "per_1k_words": 0.1,'
               ' "model": "gpt-4o-mini", "model_id": "gpt-4o-mini", "x_1k": 1}')
    assert not leet(sidecar)
    assert leet(sidecar + " th3 m0n3y 1s g0n3")
    assert leet("xep01 ep0a 4nd")  # not names: each a word mixing letters and digits
    assert not leet("ep01, ep013, ep4 and 3ab")
    # Two characters alone: five such words, or with longer ones three.
    assert leet("1 4m s0 s4d t0 g0 h0m3")
    assert not leet("4o 1k 3d s0 and the rest")


def test_leetspeak_words_are_counted_as_a_reader_counts_them() -> None:
    # The gate counts kinds of words in its marks; held here to the words of
    # the text itself: ASCII letters and digits, 2-12 of them, letters and
    # 0 1 3 4 5 7 both, no other digit.
    import random

    rng = random.Random(36)
    alphabet = "abceopz0123456789 .-_\u00e9\n"
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        words = re.findall(r"[A-Za-z0-9]+", text)
        expected = sum(len(w) <= 12 and not re.search(r"[2689]", w)
                       and re.search(r"[a-z]", w) is not None
                       and re.search(r"[013457]", w) is not None for w in words)
        marks = text.encode("utf-8").translate(textnorm_encoded._LEET_MARKS)
        assert sum(textnorm_encoded._leet_words(marks)) == expected, text


def test_the_markup_reading_keeps_offsets_and_the_split_reading() -> None:
    text = "He grab`bed it, what_in_the_world, Wouldn`t he?"
    views = textnorm.readings(text, offsets=True)
    assert [v.tokens for v in views[:2]] == [
        ["he", "grab", "bed", "it", "what", "in", "the", "world", "wouldn", "t", "he"],
        ["he", "grabbed", "it", "whatintheworld", "wouldnt", "he"]]
    assert views[2].tokens == [  # the first in rot13 ("gur" is "the")
        "ur", "teno", "orq", "vg", "jung", "va", "gur", "jbeyq", "jbhyqa", "g", "ur"]
    spans = views[1].token_spans()
    assert [text[s:e] for s, e in spans.values()] == [
        "He", "grab`bed", "it", "what_in_the_world", "Wouldn`t", "he"]
    # Without offsets the same readings, in the same order (leakguard maps back by index).
    assert [v.tokens for v in textnorm.readings(text)] == [v.tokens for v in views]


def test_the_markup_reading_has_the_words_of_its_own_text() -> None:
    # The joined reading is built from the first reading's words (no second
    # tokenisation); seeded random texts hold it to reading its text afresh.
    import random
    import re

    rng = random.Random(34)
    words = ["grab", "bed", "Wouldn't", "don't", "the", "caf\u00e9", "x1", "a", "I"]
    marks = ["", "", "`", "**", "_", "~", "-\n", "\u200b", "\u00ad\n", "<b>",
             "</i><em class='x y'>", "<!-- z q -->", "\\_", "`<b>", "*</b>_", "&#96;"]
    for _ in range(3000):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 8)))
        text = re.sub(r"(?<=\w)(?=\w)", lambda m: rng.choice(marks), text)
        plain, offsets = textnorm.readings(text), textnorm.readings(text, offsets=True)
        assert [v.tokens for v in plain] == [v.tokens for v in offsets], text
        for view in offsets:
            fresh = [w.replace("'", "").lower()
                     for w in re.findall(r"[^\W_]+(?:'+[^\W_]+)*", view.text)]
            if getattr(view, "kind", None) in ("word_order", "each_word"):
                # Words reversed: its text's words, each read back to front.
                fresh = [w[::-1] for w in fresh]
            assert view.tokens == fresh, text
            assert len(view.token_spans()) == len(view.tokens), text


def test_marks_alone_are_cut_as_the_offsets_reading_cuts_them() -> None:
    # Without offsets, a text whose only markup is marks (`*_~\\) is joined by
    # one regex pass: the same words as the cut-by-cut reading, letters,
    # digits, apostrophes, escapes and non-ASCII around the marks included.
    import random

    rng = random.Random(36)
    pieces = ["ab", "Cd", "x", "9", "'", "''", " ", "`", "*", "**", "_", "~", "\\", ".",
              "\n", "don't", "\u00e9", "\u00df", "\u0663", "&amp;", "%41", "\u200b", "\uff46"]
    joined = 0
    for _ in range(4000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 30)))
        plain, offsets = textnorm.readings(text), textnorm.readings(text, offsets=True)
        assert [(v.text, v.tokens) for v in plain] == [(v.text, v.tokens) for v in offsets], text
        unmarked = text.translate(str.maketrans("", "", "`*_~\\"))
        joined += len(plain) > len(textnorm.readings(unmarked))
    assert joined > 1000  # the marks' reading was made, not only the plain one


ENCODED_DISGUISES = ["base64", "base64 URL-safe, unpadded", "base64 wrapped at 76",
                     "base64 of base64", "base64 of escaped", "hex", "hex bytes apart", "rot13",
                     "base64 under a digest line", "base64 glued to a word", "base64 in a URL",
                     "hex after 0x", "base64 wrapped, in a JSON string",
                     "rot13, zero-width spaces between", "rot13, backticks inside",
                     "base64 of UTF-16", "base64 of cp1252", "base32",
                     "base32, lower case, unpadded", "bytes in decimal", "bytes as 0x, apart",
                     "bytes in binary", "octal escapes", "hex of UTF-16, big-endian",
                     "base64 wrapped at 16", "reversed", "words in reverse order",
                     "each word reversed", "Ascii85", "Ascii85, Adobe, wrapped", "base85",
                     "base32hex", "bytes in decimal, 12 a line",
                     "bytes as 0x, a C array's rows", "hex bytes apart by commas",
                     "octal escapes in a JSON string", "base64 at 16, in a JSON string",
                     "base64 at 16, quoted in Markdown", "Caesar, shifted by 3",
                     "Caesar, shifted by 1", "Caesar, shifted back by 5", "Atbash",
                     "bytes in binary, nothing between", "base64, each word",
                     "base64 in groups of 4", "hex, each word",
                     "hex in groups of 4", "Morse code",
                     "Morse code, words three spaces apart", "ROT47", "uuencode"]


@pytest.mark.parametrize("disguise", ENCODED_DISGUISES)
def test_a_quote_in_an_encoding_is_found_and_its_whole_run_cut(disguise: str) -> None:
    # Rule 1's "text in an encoding": a model asked to hide a line can write it
    # in base64, hex or rot13. Every quotable line of the corpus key, in a
    # report's prose; the cut takes the encoded run and leaves the prose.
    from tests.corpus import adversarial

    key = adversarial.key()
    index = leakguard.index_for(adversarial.WORK, key)
    for line in adversarial.quotable_lines(key):
        encoded = adversarial.DISGUISES[disguise](line).strip()
        report = adversarial.report_quoting(encoded)
        leaks = find_leaks(report, index)
        assert len(leaks) == 1, line
        cut_away = report[leaks[0].start:leaks[0].end]
        assert cut_away in encoded  # the encoded stretch: what is glued on may stay
        cut = redact(report, leaks)
        assert "The model explains the same beat twice." in cut
        assert find_leaks(cut, index) == []
        assert leakguard.AnswerKeys([index]).leaks(report)  # the log's and state's check


def test_prose_of_base64s_alphabet_is_not_read_as_encoded_words() -> None:
    # Issue 36's census: base64 and hex in words (each word alone, or groups)
    # are read (textnorm_tokens). Prose is of base64's alphabet too: its
    # CamelCase names, hex-looking words and ids decode to nothing that reads.
    from skilltrain.daemon.core import textnorm_tokens

    prose = ("The iPhone scene in McDonald's reads like JavaScript: deadbeef cafe "
             "face bead 1234 abcd ef01 2345 6789 ab12 cd34 ef56 and the McKay "
             "LaRue DeVito McGregor O'Brien scenes run 4096 8192 words. ") * 3
    raw = prose.encode("utf-8")
    assert textnorm_tokens.decoded_runs(prose, raw, textnorm_encoded._decode_run,
                                        textnorm_encoded._as_text) == []


def test_prose_json_and_headings_are_not_read_as_rot47_or_uuencode() -> None:
    # Issue 36: ROT47 and uuencode are read (textnorm_rot47, textnorm_uu). What
    # we write and read most is not: screenplays (headings and cues in
    # capitals), reports, a sidecar's numbers and times of day.
    from skilltrain.daemon.core import textnorm_rot47, textnorm_uu
    from tests.corpus import adversarial

    root = Path(__file__).resolve().parent.parent
    texts = [p.read_text(encoding="utf-8") for p in sorted(
        (root / "data" / "example").glob("*/ep*.txt"))]
    texts += [(root / "tests" / "corpus" / name).read_text(encoding="utf-8")
              for name in ("brick_and_steel.txt", "reports.md")]
    texts += list(adversarial.key().values())
    texts.append(json.dumps({"started_at": "2026-12-07T16:39:57.962831+00:00",
                             "finished_at": "2026-12-07T23:59:59.999999+00:00",
                             "verdicts": [{"human": 88.157895, "model": 237.375}] * 9,
                             "heading": "INT. BURNHAM HOUSE - UPSTAIRS HALLWAY - NIGHT"},
                            indent=2))
    for text in texts:
        raw = text.encode("utf-8")
        assert textnorm_rot47.decoded_runs(text, raw, textnorm_encoded.MIN_RUN_CHARS) == []
        assert textnorm_uu.decoded_runs(text, raw, textnorm_encoded.MIN_RUN_CHARS,
                                        textnorm_encoded._as_text) == []


def test_rot47_and_uuencode_are_read_over_lines_and_behind_quote_marks() -> None:
    # A ROT47 quote wrapped over lines is one stretch (ROT47 keeps the breaks);
    # uuencoded lines quoted in Markdown ("> "), in curly quotes, are one block.
    import binascii

    from tests.corpus import adversarial

    key = adversarial.key()
    index = leakguard.index_for(adversarial.WORK, key)
    line = max(adversarial.quotable_lines(key), key=len)
    wrapped = adversarial.DISGUISES["line-wrapped"](adversarial.DISGUISES["ROT47"](line))
    data = line.encode()
    quoted = "\u201c" + "\n".join("> " + binascii.b2a_uu(data[i:i + 45]).decode().rstrip()
                                  for i in range(0, len(data), 45)) + "\u201d"
    assert len(data) > 90  # three lines
    for encoded in (wrapped, quoted):
        report = adversarial.report_quoting(encoded)
        leaks = find_leaks(report, index)
        assert len(leaks) == 1, encoded
        assert find_leaks(redact(report, leaks), index) == []


def test_a_quote_part_as_written_part_in_rot13_is_read_with_only_its_rot13_undone() -> None:
    # Issue 36: a line part plain, part rot13, neither part n words: the rot13
    # reading garbles the plain part and the plain reading the rest. Only the
    # words that are the key's in rot13 and not as written are undone; "or"
    # is both ("be" in rot13), and is undone beside such words.
    import codecs

    from tests.corpus import adversarial

    key = adversarial.key()
    index = leakguard.index_for(adversarial.WORK, key)
    line = "Possibly. But you don't want to be unemployed."
    assert any(line in text for text in key.values())
    words = line.split()
    quote = " ".join(words[:2]) + " " + codecs.encode(" ".join(words[2:]), "rot13")
    report = adversarial.report_quoting(quote)
    (leak,) = find_leaks(report, index)
    assert report[leak.start:leak.end] in quote
    assert leakguard.AnswerKeys([index]).leaks(report)  # the log's and state's check
    assert find_leaks(redact(report, [leak]), index) == []


def test_the_logs_check_reads_a_shift_of_any_of_several_works() -> None:
    # Issue 36: the log's check screens the Caesar shifts by every work's
    # longer words at once (one set test, not one a work); a line of the last
    # of several works, shifted, is still found, and a shifted line of none
    # is not.
    from tests.corpus import adversarial

    example = Path(__file__).resolve().parent.parent / "data" / "example" / "human"
    others = [leakguard.index_for(f"other{k}", {
        1: "\n".join(f"{line} {k}" for line in (example / "ep01.txt").read_text(
            encoding="utf-8").splitlines())}) for k in range(3)]
    key = adversarial.key()
    keys = leakguard.AnswerKeys([*others, leakguard.index_for(adversarial.WORK, key)])
    lines = adversarial.quotable_lines(key)[:10]
    for line in lines:
        assert keys.leaks(adversarial.report_quoting(adversarial.DISGUISES[
            "Caesar, shifted by 3"](line))), line
    shifted_prose = adversarial.DISGUISES["Caesar, shifted by 3"](
        "The model explains the same beat twice, and the second time it is slower.")
    assert keys.leaks(adversarial.report_quoting(shifted_prose)) == []


@pytest.mark.parametrize("disguise", [
    "letter-spaced", "letter-spaced, words three apart", "letters dotted",
    "letters hyphenated, upper", "letters spaced by zero-width spaces",
    "words run together, marks kept"])
def test_a_quote_spelled_out_is_found_by_its_letters_and_cut(disguise: str) -> None:
    # Spelled letter by letter, or its words run together, a line has no words
    # left to match: its letters are matched (leakguard_spelled). Every line of
    # the key but those too short or of stock words only, by the guard, the
    # log's and state's check, and the audit's bulk test.
    from tests.corpus import adversarial

    key = adversarial.key()
    index = leakguard.index_for(adversarial.WORK, key)
    missed = set()
    for line in adversarial.quotable_lines(key):
        report = adversarial.report_quoting(adversarial.SPELLED_DISGUISES[disguise](line))
        leaks = find_leaks(report, index)
        if not leaks:
            missed.add(line)
            continue
        cut = redact(report, leaks)
        assert "The model explains the same beat twice." in cut
        assert find_leaks(cut, index) == []
        assert leakguard.AnswerKeys([index]).leaks(report)
        assert leakguard.may_leak(textnorm.readings(report), index)
    assert missed <= adversarial.SPELLED_MISSES


def test_only_a_sentence_run_together_is_read_as_one_stretch_of_letters() -> None:
    # Words and a sentence's marks with no space between them are one stretch;
    # a path, a URL, a slug or a line of JSON is not (each would be
    # read letter window by letter window, for nothing, in every log line).
    def stretches(text: str) -> list[str]:
        return [letters for letters, _ in textnorm.readings(text)[0].spelled()]

    assert stretches("He said: Well,I'lltellyou.EggshellsandMiracleGrow. Then left.") == [
        "wellilltellyoueggshellsandmiraclegrow"]
    for text in ("/srv/runs/r1/epoch_00/step_01/work/reports/ep01-03.md",
                 "https://example.com/a,b;c/eggshells-and-miracle-grow?x=1",
                 "skilltrain-bench-cpuprobe-ns8kjsje-and-more-of-it",
                 '{"claims_status":"not_checked","claims_confirmed":0,"tokens_in":12}'):
        assert stretches(text) == [], text


def test_text_spelled_out_that_is_not_the_key_or_is_the_models_own_is_no_leak() -> None:
    # Independent text spelled out shares no window of the key's letters; a
    # line the model wrote too (allowed) may be spelled out in its report.
    from tests.corpus import adversarial

    key = adversarial.key()
    index = leakguard.index_for(adversarial.WORK, key)
    example = "\n".join(p.read_text(encoding="utf-8") for p in sorted(
        (Path(__file__).resolve().parent.parent / "data" / "example").glob("*/ep*.txt")))
    for text in ((adversarial.CORPUS / "brick_and_steel.txt").read_text(encoding="utf-8"),
                 (adversarial.CORPUS / "reports.md").read_text(encoding="utf-8"), example):
        lines = [line for line in text.splitlines() if len(line.split()) >= 3]
        assert len(lines) > 30
        for spell in adversarial.SPELLED_DISGUISES.values():
            assert find_leaks("\n".join(map(spell, lines)), index) == []
    line = "Lester thrusts his face directly into a steaming hot shower."
    report = adversarial.report_quoting(adversarial.SPELLED_DISGUISES["letter-spaced"](line))
    assert find_leaks(report, index)
    assert find_leaks(report, index, allow_text=f"He sits.\n{line}\nHe stands.") == []


def test_a_run_of_hex_digits_is_read_for_the_key_spelled_out_only_if_the_key_can_be_one() -> None:
    # Sidecars hold sha256s: a stretch of hex digits is skipped when no window
    # of the key's letters is all hex digits (leakguard_spelled.may_hit), and
    # read when one is: a key whose words run together spell a hex run.
    hexy = "A bad decade faced Abe. Dad added a bead, a fab cafe bead.\n"
    index = leakguard.index_for("hexy", {1: "INT. CAFE - DAY\n\nANNA\n" + hexy})
    plain = leakguard.index_for("plain", {1: "INT. CAFE - DAY\n\nANNA\nShe turns away.\n"})
    assert index.spelled_hex and not plain.spelled_hex
    run_together = "".join(re.findall("[a-z]", hexy.lower()))
    assert re.fullmatch("[a-f]+", run_together) and len(run_together) >= 24
    report = f"The draft is flat. Compare: {run_together}. The model explains the same beat."
    assert find_leaks(report, index)
    digest = hashlib.sha256(b"x").hexdigest()
    assert not leakguard_spelled.may_hit(digest, plain.spelled_hex)
    assert leakguard_spelled.may_hit(digest, index.spelled_hex)
    assert leakguard_spelled.may_hit("whatalameoisthisfellow1234", plain.spelled_hex)


def test_the_shortest_text_that_can_leak_is_read_and_shorter_ascii_is_passed() -> None:
    # AnswerKeys passes an ASCII string shorter than 2n - 1 characters unread
    # (a log line's job id): seven one-letter words of the key are 13.
    index = leakguard.index_for("short", {1: "INT. ROOM - DAY\n\nANNA\nQ X Z J K V W.\n"})
    keys = leakguard.AnswerKeys([index])
    for text in ("q x z j k v w", "Q-X-Z-J-K-V-W", "q.x.z.j.k.v.w"):
        assert keys.leaks(text) == find_leaks(text, index) != [], text
    assert keys.leaks("qx z j k v w") == [] == find_leaks("qx z j k v w", index)
    assert keys.clean("1315639c9f21") == "1315639c9f21"


def test_a_quoted_hex_run_is_read_as_the_scan_for_blocks_would_read_it() -> None:
    # textnorm_encoded reads a hex run in double quotes (a JSON digest) alone,
    # before the scan for blocks: the same runs found, decoded alike, as when
    # the quotes are apostrophes (which the scan reads past the same way).
    from skilltrain.daemon.core import textnorm_encoded

    line = "The money in the biscuit tin was never yours to spend."
    digests = [hashlib.sha256(bytes([n])).hexdigest() for n in range(4)]
    quoted = line.encode().hex()
    texts = [
        f'{{"human_sha256": "{digests[0]}", "quote": "{quoted}"}}',
        f'"{digests[1]}"\n"{digests[2]}", "{digests[3]}"x"{quoted.upper()}"',
        # glued to a digest's half: found by neither (a run is tried at two cuts)
        f'"{digests[2][:30]}{quoted}" and "{"ab" * 11}"',
    ]
    for text in texts:
        found = textnorm_encoded.decoded_runs(text)
        assert found == textnorm_encoded.decoded_runs(text.replace('"', "'")), text
        assert any(line in decoded for *_, decoded in found) == (text is not texts[2])


def test_an_encoded_block_on_lines_of_its_own_is_cut_without_the_prose_around_it() -> None:
    # A block alone on its lines: the word that ends the line above and the one
    # that starts the line below are prose, not its first or last run.
    import base64
    import re

    from tests.corpus import adversarial

    key = adversarial.key()
    index = leakguard.index_for(adversarial.WORK, key)
    line = adversarial.quotable_lines(key)[0]
    b64 = base64.b64encode(line.encode()).decode()
    for block in (b64, base64.b32encode(line.encode()).decode(), line.encode().hex(),
                  "\n".join(re.findall(".{1,16}", b64))):
        report = f"The scene encoded\n{block}\nafterwards the model explains it twice.\n"
        cut = redact(report, find_leaks(report, index))
        assert cut == ("The scene encoded\n[verbatim answer-key passage removed]\n"
                       "afterwards the model explains it twice.\n"), block


def test_runs_that_decode_to_no_text_are_not_read() -> None:
    # A digest, a path, an identifier, a token: base64 or hex by their letters,
    # but what they decode to is not text, so no reading is added for them.
    plain = [
        "report_sha256 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        "/mnt/benchfs/skilltrain-bench-cpuprobe-e0_b1/runs/bench/epoch_01/step_02",
        "internationalizationalism antidisestablishmentarianism",
        "sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcdefGHIJ",
        "de ad be ef ca fe ba be 00 01 02 03 04 05 06 07 08 09",
    ]
    for text in plain:
        assert len(textnorm.readings(text)) == len(textnorm.readings(text, encoded_levels=0))


def test_an_encoded_run_is_read_once_per_run_and_never_across_two() -> None:
    # Two runs side by side are two readings: a shingle across their seam
    # would cut the prose between them.
    import base64

    first, second = (base64.b64encode(s.encode()).decode() for s in
                     ("the farm was never his", "to sell at any price"))
    views = textnorm.readings(f"{first} and then {second}", offsets=True)
    # After the first reading, its rot13 and its three backwards readings; each
    # run's, so read too; last, the text with both decoded in place (a quote
    # part plain, part encoded), each decoded character from its own run.
    encoded, in_place = views[5:-1], views[-1]
    assert [v.tokens for v in encoded[::5]] == [["the", "farm", "was", "never", "his"],
                                                ["to", "sell", "at", "any", "price"]]
    assert {(v.starts[0], v.ends[-1]) for v in encoded} == {  # type: ignore[index]
        (0, len(first)), (len(first) + 10, len(first) + 10 + len(second))}
    assert in_place.tokens == ["the", "farm", "was", "never", "his", "and", "then",
                               "to", "sell", "at", "any", "price"]
    spans = in_place.token_spans()
    assert spans[0] == (0, len(first)) and spans[5] == (len(first) + 1, len(first) + 4)


def test_two_base64_lines_are_both_cut_by_one_clean() -> None:
    # The log seal cleans once: a first blob's padding stopped the second from
    # being read, and half the key was left in a line cleaned "once".
    import base64

    from tests.corpus import adversarial

    key = adversarial.key()
    keys = leakguard.AnswerKeys([leakguard.index_for(adversarial.WORK, key)])
    lines = adversarial.quotable_lines(key)
    for first, second in zip(lines, lines[1:], strict=False):
        text = "\n".join(base64.b64encode(s.encode()).decode() for s in (first, second))
        assert keys.leaks(text) and keys.leaks(keys.clean(text)) == []


def test_quoted_printable_is_read_only_in_a_text_that_is_quoted_printable() -> None:
    # Review: "top_k=20" once in a report turned on the soft break for the
    # whole text, and base64's padding at a line's end joined the next line's
    # first word to it; a claim "mean=20% higher" lost its "=" and number.
    import base64

    from tests.corpus import adversarial

    key = adversarial.key()
    index = leakguard.index_for(adversarial.WORK, key)
    for line in adversarial.quotable_lines(key):
        blob = base64.b64encode(b"foobar!").decode()  # ends in "=": padding
        report = f"Run it with top_k=20.\nData:\n{blob}\n{line}\nThe model explains it."
        leaks = find_leaks(report, index)
        # The quote's first word is cut with it, and nothing of it is left.
        first_word = report.index(line) + re.search(r"\w", line).start()  # type: ignore[union-attr]
        assert leaks and leaks[0].start <= first_word, line
        assert find_leaks(redact(report, leaks), index) == [], line
        assert blob in redact(report, leaks)
    for text in ("- scene_words_mean=20% higher than the human", "per_page=20, month=09"):
        assert textnorm.readings(text)[0].text == text


@pytest.mark.parametrize("encode", [base64.a85encode, base64.b85encode])
def test_base85_in_curly_quotes_or_before_a_dash_is_read(encode: Any) -> None:
    # Review: a character past ASCII after the run was taken into it, and the
    # run then decoded at no alignment.
    from tests.corpus import adversarial

    key = adversarial.key()
    index = leakguard.index_for(adversarial.WORK, key)
    for line in adversarial.quotable_lines(key):
        encoded = encode(line.encode()).decode()
        for report in (f"He wrote \u201c{encoded}\u201d.", f"{encoded}\u2014then\u00a0more"):
            leaks = find_leaks(report, index)
            assert leaks and report[leaks[0].start:leaks[0].end] == encoded, (line, report)

