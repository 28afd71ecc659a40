"""Grounded reports: the measurable claims of a loss report, checked against
the craft statistics of both screenplays.

A reviewer can write a whole, well-formed report that is wrong ("the model's
speeches run long" when they are shorter than the human's). The optimizer
would learn from that sentence like from any other and move the skill the
wrong way. The loss template shows the reviewer the measured statistics of
both sides (`facts_table`) and asks it to end with a list of its claims:

    ## Claims

    - speech_words_mean: higher
    - scenes_per_episode: lower
    - dialogue_share: similar

one line per claim, `statistic: higher | lower | similar`, about the model's
value against the human's (docs/grounded-reports.md). Reviewers write it as
people do: "much higher", "compared with the original, higher", "similar
(slightly higher)", "higher, not lower", an em dash for the colon, a table,
sub-headings, two sections. So the direction is read wherever it stands in
the value and every Claims section is read: a qualifier or a layout must not
turn a wrong claim into an unreadable one, which would count for nothing,
nor an honest one. Each claim is checked against the measurements with the
statistic's floor (craft_report.METRICS):

    g = ln((model + floor) / (human + floor))
    higher   contradicted when g < -DIRECTION_TOLERANCE, else confirmed
    lower    contradicted when g > +DIRECTION_TOLERANCE, else confirmed
    similar  contradicted when |g| > SIMILAR_TOLERANCE, else confirmed
    an unknown statistic, or one a side lacks: not checkable

A report without the list is still a report: "not checked", counted. A line
that tries to be a claim and cannot be read is reported by line number and
reason, never a crash; prose beside the claims is passed over. A list that
is mostly unreadable (more than half its lines, or no readable claim at all)
cannot vouch for its report: it is seen like a contradiction, annotated, and
in refuse mode its unreadable lines count as contradicted.
Pure, no I/O; numbers and statistic names only, never screenplay text.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core import textnorm
from .craft_measuring import ScreenplayStats
from .craft_metrics import METRICS, Metric

SECTION = "Claims"
STATISTICS = tuple(m.key for m in METRICS)  # the checkable ones, as the prompt's tables name them
DIRECTIONS = ("higher", "lower", "similar")
# A direction claim is wrong only when the measurement points the other way
# by more than about 5 %: a hair's difference either way is not a lie.
DIRECTION_TOLERANCE = 0.05
# "similar" holds within about 16 %: the built-in reviewer's own "close" line.
SIMILAR_TOLERANCE = 0.15
# In refuse mode, a report with more than this share of its checked claims
# contradicted is bogus signal ([integrity] refuse_share overrides it).
REFUSE_SHARE = 0.5

_BY_NAME: dict[str, Metric] = {
    **{m.key: m for m in METRICS},
    **{m.label.lower(): m for m in METRICS},
}
# A statistic by how a reader reads its key or its label: words joined.
_BY_READING: dict[str, Metric] = {
    "".join(textnorm.words_as_read(name)): m for name, m in _BY_NAME.items()}
_NAME_WORDS = max(len(textnorm.words_as_read(name)) for name in _BY_NAME)  # most of any name
# An unknown statistic's name is kept (not checkable) up to this many words.
UNKNOWN_NAME_WORDS = 4
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s*(.*?)\s*#*\s*$")
_SECTION = re.compile(rf"^\**{SECTION}\**\s*:?$", re.IGNORECASE)
_BULLET = re.compile(r"^(?:[-*+•]|\d+[.)])\s+")
_FENCE = re.compile(r"^\s*(```|~~~)")
# A Markdown rule, a table's |---|:--:| or a thematic break: layout, not a claim.
_RULE = re.compile(r"^[\s|:]*-[\s|:-]*$")
# Between a statistic and its direction, in textnorm's reading of the line
# (where an em or en dash is "-"): a colon, "=", a table's "|", a dash apart
# from a word on one side, or "is"/"are". A hyphen inside a word does not
# split it: "speech-words-mean" names a statistic.
_SEPARATOR = re.compile(r"[:=|]|\s-+|-+\s|--+|\b(?:is|are)\b", re.IGNORECASE)
# A line with none of them may have an em dash between words, read as a
# hyphen: "speech_words_mean—higher". The dash is then the last one before
# the direction, so that a hyphenated name stays whole.
_DASH = re.compile(rf"-+(?=[^-]*?\b(?:{'|'.join(DIRECTIONS)})\b)", re.IGNORECASE)
# Words that, before a direction in its clause, deny it: "higher, not lower as
# the draft suggests" claims higher; "not higher" alone claims nothing.
_NEGATION = frozenset({"not", "no", "never", "nor", "neither", "isnt", "arent"})
# The human's side as the subject ("the human's is higher", "human higher"): the
# model's is the other way, read so and checked, or a wrong claim could hide there.
_HUMAN = frozenset({"human", "humans", "original", "originals"})
_INVERSE = {"higher": "lower", "lower": "higher", "similar": "similar"}
# ...but after one of these it is only what the model is measured against:
# "compared with the human original, higher" is the model's direction.
_AGAINST = frozenset({"with", "to", "than", "against", "versus", "vs", "unlike",
                      "over", "from", "relative", "compared", "beside"})
_ARTICLES = frozenset({"the", "a", "an", "its", "their"})  # skipped back to _AGAINST
# A parenthesis is commentary on the claim beside it: "similar (slightly higher)".
_ASIDE = re.compile(r"\([^()]*\)?|\[[^\[\]]*\]?")
# Where a clause ends, in textnorm's reading: "compared with the original, higher".
_CLAUSE = re.compile(r"[,;:.!?]|\s-+\s")


@dataclass(frozen=True)
class Claim:
    statistic: str  # as written, normalised to lower case
    direction: str  # higher | lower | similar: the model's value against the human's
    line: int  # 1-based line of the report


@dataclass(frozen=True)
class ClaimList:
    """What the report's claims section said; found=False: it has none."""

    found: bool
    claims: tuple[Claim, ...] = ()
    malformed: tuple[tuple[int, str], ...] = ()  # (line, why), no text of the line


@dataclass(frozen=True)
class Verdict:
    statistic: str
    claimed: str
    verdict: str  # confirmed | contradicted | not_checkable
    human: float | None = None
    model: float | None = None
    measured: str | None = None  # higher | lower | similar, by SIMILAR_TOLERANCE
    log_ratio: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"statistic": self.statistic, "claimed": self.claimed, "verdict": self.verdict,
                "human": _round(self.human), "model": _round(self.model),
                "measured": self.measured, "log_ratio": _round(self.log_ratio)}


@dataclass(frozen=True)
class Unreadable:
    """A claims list most of whose lines could not be read. It is seen like a
    contradicted claim: a list of wrong claims must not pass by being misspelt."""

    malformed: int
    lines: int  # the list's claim lines, read or not

    @property
    def statistic(self) -> str:
        # A refusal names what it was refused for by each item's statistic (handlers/loss.py).
        return f"{self.malformed} of {self.lines} claims unreadable"


@dataclass(frozen=True)
class ClaimCheck:
    """Every claim of one report with its verdict."""

    status: str  # checked | not_checked (no list) | malformed (a list with no readable claim)
    verdicts: tuple[Verdict, ...] = ()
    malformed: tuple[tuple[int, str], ...] = ()
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def mostly_unreadable(self) -> bool:
        """More than half the list's lines could not be read (so too a Claims
        heading with no readable claim): such a list cannot vouch for its report."""
        return 2 * len(self.malformed) > len(self.malformed) + len(self.verdicts)

    @property
    def contradicted(self) -> tuple[Verdict | Unreadable, ...]:
        """What the report must be seen for (annotation): each contradicted
        claim, and the list itself when it is mostly unreadable."""
        wrong: tuple[Verdict | Unreadable, ...] = tuple(
            v for v in self.verdicts if v.verdict == "contradicted")
        if self.mostly_unreadable:
            lines = len(self.malformed) + len(self.verdicts)
            wrong += (Unreadable(malformed=len(self.malformed), lines=lines),)
        return wrong

    @property
    def contradicted_share(self) -> float | None:
        """Contradicted among the claims that could be checked; None: none could."""
        checked = self.counts["confirmed"] + self.counts["contradicted"]
        return self.counts["contradicted"] / checked if checked else None

    def too_contradicted(self, share: float) -> bool:
        """Refuse mode's bar: more than `share` of the checked claims contradicted,
        a mostly unreadable list's lines counted as contradicted claims."""
        wrong = self.counts["contradicted"]
        checked = wrong + self.counts["confirmed"]
        if self.mostly_unreadable:
            wrong += len(self.malformed)
            checked += len(self.malformed)
        return checked > 0 and wrong / checked > share

    def event_fields(self) -> dict[str, Any]:
        """What loss.completed (and loss.contradicted) carry."""
        share = self.contradicted_share
        return {"claims_status": self.status,
                "claims_confirmed": self.counts["confirmed"],
                "claims_contradicted": self.counts["contradicted"],
                "claims_not_checkable": self.counts["not_checkable"],
                "claims_malformed": len(self.malformed),
                "claims_contradicted_share": None if share is None else round(share, 4)}

    def sidecar_fields(self, mode: str) -> dict[str, Any]:
        return {"claims": {
            **{k.removeprefix("claims_"): v for k, v in self.event_fields().items()},
            "on_contradiction": mode,
            "tolerance": {"direction": DIRECTION_TOLERANCE, "similar": SIMILAR_TOLERANCE},
            "verdicts": [v.as_dict() for v in self.verdicts],
            "malformed_lines": [{"line": n, "why": why} for n, why in self.malformed],
        }}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


# ---------------------------------------------------------------- reading


def read_claims(report: str) -> ClaimList:
    """The claims of every `## Claims` section (any heading level): a later
    section must not hide a wrong claim of an earlier one, nor the reverse."""
    lines = report.splitlines()
    sections = list(_sections(lines))
    if not sections:
        return ClaimList(found=False)
    claims: list[Claim] = []
    malformed: list[tuple[int, str]] = []
    for start, end in sections:
        read, unread = _read_section(lines, start, end)
        if not read and not unread:
            unread.append((start, "the claims section is empty"))  # its heading's line
        claims += read
        malformed += unread
    return ClaimList(found=True, claims=tuple(claims), malformed=tuple(malformed))


def _sections(lines: list[str]) -> Iterator[tuple[int, int]]:
    """(start, end) line indexes of each Claims section's body: from below
    its heading to the next heading of its level or above, or the end."""
    start, level = None, 0
    for i, line in enumerate(lines):
        m = _HEADING.match(line)
        if m is None:
            continue
        depth = len(m.group(1))
        if start is not None:
            if depth > level:
                continue  # a sub-heading ("### Dialogue"): its claims are the section's
            yield start, i
        start, level = (i + 1, depth) if _SECTION.match(m.group(2)) else (None, 0)
    if start is not None:
        yield start, len(lines)


def _read_section(lines: list[str], start: int,
                  end: int) -> tuple[list[Claim], list[tuple[int, str]]]:
    """The claims of lines[start:end], and (line, why) for each line that tries
    to be one (_claim_like) and is not. Other prose ("**Next steps**" and its
    bullets) is passed over, unless the section has no claim to pass it for."""
    claims: list[Claim] = []
    malformed: list[tuple[int, str]] = []
    prose: list[tuple[int, str]] = []
    for i in range(start, end):
        line = lines[i].strip()
        if (not line or _FENCE.match(line) or _RULE.match(line)
                or _HEADING.match(lines[i]) or _table_header(lines, i)):
            continue  # layout; a table header ("| statistic | direction |") names columns
        claim = _read_line(line, i + 1)
        if isinstance(claim, Claim):
            claims.append(claim)
        else:
            (malformed if _claim_like(line) else prose).append((i + 1, claim))
    return claims, malformed if claims else sorted(malformed + prose)


def _table_header(lines: list[str], i: int) -> bool:
    """Line i is a Markdown table's header: the next line is the table's rule."""
    below = lines[i + 1].strip() if i + 1 < len(lines) else ""
    return "|" in below and _RULE.match(below) is not None


def _read_line(line: str, number: int) -> Claim | str:
    """One `statistic: direction` line, or why it is not one.

    Read through the guard's normalisation (textnorm), as a person reads it:
    `speech_words_mean`, **Speech words mean** and spee&#96;ch_words_mean
    name one statistic. What is kept is the statistic's key from the facts
    table, or, for a name the table lacks, its first words (at most
    UNKNOWN_NAME_WORDS): never more of the line than a name, so no passage of
    a report reaches the sidecar through a claim (issue 34).
    """
    split = _name_and_value(_BULLET.sub("", line))
    if split is None:
        return "not 'statistic: higher|lower|similar'"
    name, value = split
    direction = _direction(value)
    if direction not in DIRECTIONS:
        return direction
    read = textnorm.words_as_read(name)
    if not read:
        return "no statistic named"
    metric = _BY_READING.get("".join(read))
    if metric is not None:
        return Claim(statistic=metric.key, direction=direction, line=number)
    words = textnorm.tokens(name)
    if len(words) > UNKNOWN_NAME_WORDS:
        return "not a statistic of the facts table, nor a name"
    return Claim(statistic="_".join(words), direction=direction, line=number)


def _claim_like(line: str) -> bool:
    """The line is a claim, if an unreadable one: it names a statistic, or has a
    separator with a direction after it ("speeches ran: higher"). A next-steps
    bullet ("- Pacing: tighten act two.") is prose, not an unreadable claim."""
    if _names_statistic(line):
        return True
    split = _name_and_value(_BULLET.sub("", line))
    return split is not None and not set(textnorm.words_as_read(split[1])).isdisjoint(
        DIRECTIONS)


def _names_statistic(line: str) -> bool:
    """Some words of the line are a statistic's key or label, as a name is read."""
    words = textnorm.words_as_read(line)
    return any("".join(words[i:i + n]) in _BY_READING
               for i in range(len(words)) for n in range(1, _NAME_WORDS + 1))


def _name_and_value(line: str) -> tuple[str, str] | None:
    """A claim line cut at its first separator (a table row: after its first
    cell); None: it has none. Cut in textnorm's reading of the line, where
    an em dash, "&mdash;" and a full-width colon are the ASCII "-" and ":"."""
    text = textnorm.readings(line)[0].text.removeprefix("|")
    m = _SEPARATOR.search(text) or _DASH.search(text)
    return None if m is None else (text[:m.start()], text[m.end():])


def _direction(value: str) -> str:
    """The one direction a claim's value names for the model, wherever it stands
    ("much higher"); else why there is none (a sentence, never one of DIRECTIONS).
    One in a parenthesis is commentary unless it is the only one ("5 (higher)")."""
    said = _said(_ASIDE.sub(",", value)) or _said(value)
    if not said:
        return "the direction must be higher, lower or similar"
    claimed = {d for d in said if d is not None}
    if not claimed:
        return "a direction negated, none claimed"
    if len(claimed) > 1:
        return "more than one direction: higher, lower or similar, one of them"
    return claimed.pop()


def _said(text: str) -> list[str | None]:
    """Each direction `text` names, as the model's value against the human's:
    inverted where said of the human's, None where denied. A word turns only
    the direction after it in its clause: "higher, not lower" claims higher."""
    said: list[str | None] = []
    for clause in _CLAUSE.split(text):
        words = textnorm.words_as_read(clause)
        since = 0
        for i, word in enumerate(words):
            if word not in DIRECTIONS:
                continue
            before, since = words[since:i], i + 1
            if _NEGATION.intersection(before):
                said.append(None)
            else:
                said.append(_INVERSE[word] if _of_the_human(before) else word)
    return said


def _of_the_human(words: list[str]) -> bool:
    """These words have the human's side for their subject ("the human's is",
    "human"), not as what the model is compared with ("compared with the human")."""
    before = ""  # the last word before it, articles and the human's own words skipped
    for word in words:
        if word in _HUMAN and before not in _AGAINST:
            return True
        if word not in _HUMAN and word not in _ARTICLES:
            before = word
    return False


# --------------------------------------------------------------- checking


def measured_direction(metric: Metric, human: float, model: float) -> tuple[str, float]:
    """higher | lower | similar for the model against the human, and the log ratio."""
    g = math.log((model + metric.floor) / (human + metric.floor))
    if g > SIMILAR_TOLERANCE:
        return "higher", g
    if g < -SIMILAR_TOLERANCE:
        return "lower", g
    return "similar", g


def judge(claim: Claim, human: ScreenplayStats, model: ScreenplayStats) -> Verdict:
    metric = _BY_NAME.get(claim.statistic) or _BY_NAME.get(claim.statistic.replace(" ", "_"))
    if metric is None:
        return Verdict(claim.statistic, claim.direction, "not_checkable")
    h, m = getattr(human, metric.key), getattr(model, metric.key)
    if h is None or m is None:
        return Verdict(metric.key, claim.direction, "not_checkable",
                       None if h is None else float(h), None if m is None else float(m))
    measured, g = measured_direction(metric, float(h), float(m))
    wrong = {"higher": g < -DIRECTION_TOLERANCE, "lower": g > DIRECTION_TOLERANCE,
             "similar": abs(g) > SIMILAR_TOLERANCE}[claim.direction]
    return Verdict(metric.key, claim.direction, "contradicted" if wrong else "confirmed",
                   float(h), float(m), measured, g)


def check(claims: ClaimList, human: ScreenplayStats, model: ScreenplayStats) -> ClaimCheck:
    verdicts = tuple(judge(c, human, model) for c in claims.claims)
    counts = {k: sum(v.verdict == k for v in verdicts)
              for k in ("confirmed", "contradicted", "not_checkable")}
    if not claims.found:
        status = "not_checked"
    else:
        status = "checked" if claims.claims else "malformed"
    return ClaimCheck(status=status, verdicts=verdicts, malformed=claims.malformed,
                      counts=counts)


def check_report(report: str, human: ScreenplayStats, model: ScreenplayStats) -> ClaimCheck:
    return check(read_claims(report), human, model)


# ---------------------------------------------------------------- writing


def annotation(contradicted: Iterable[Verdict | Unreadable]) -> str:
    """The section annotate mode appends: what each contradicted claim got
    wrong, and how much of an unreadable list could not be checked."""
    seen = list(contradicted)
    wrong = [v for v in seen if isinstance(v, Verdict)]
    lines = ["## Measured facts (checked by the daemon)"]
    if wrong:
        lines += ["", "These claims above are contradicted by the measurements of both "
                  "screenplays; trust the numbers:", "", *map(_correction, wrong)]
    for u in seen:
        if isinstance(u, Unreadable):
            lines += ["", f"{u.malformed} of {u.lines} claims above could not be checked "
                      "against the measurements: they are the reviewer's impressions, not "
                      "measured facts."]
    return "\n".join(lines)


def _correction(v: Verdict) -> str:
    """One contradicted claim, with what the measurements say instead."""
    metric = _BY_NAME[v.statistic]
    said = "about the same as" if v.claimed == "similar" else f"{v.claimed} than"
    actual = {"higher": "higher than", "lower": "lower than",
              "similar": "about the same as"}[v.measured or "similar"]
    return (f"- `{v.statistic}` ({metric.label}): the report says the model's is {said} the "
            f"human's; measured, it is {actual} the human's: model "
            f"{_value(metric, v.model)} against human {_value(metric, v.human)}.")


def _value(metric: Metric, value: float | None) -> str:
    return "-" if value is None else metric.fmt(value)


def section(claims: Iterable[tuple[str, str]]) -> str:
    """A `## Claims` section from (statistic, direction) pairs."""
    return "\n".join([f"## {SECTION}", "", *(f"- {s}: {d}" for s, d in claims)])


def grounded_claims(human: ScreenplayStats, model: ScreenplayStats) -> list[tuple[str, str]]:
    """Every statistic both sides have, with its measured direction (the built-in reviewer's)."""
    pairs = []
    for metric in METRICS:
        h, m = getattr(human, metric.key), getattr(model, metric.key)
        if h is not None and m is not None:
            pairs.append((metric.key, measured_direction(metric, float(h), float(m))[0]))
    return pairs


def facts_table(stats: ScreenplayStats) -> str:
    """One side's statistics as a Markdown table for the prompt: numbers and names only."""
    rows = ["| statistic | what it measures | value |", "|---|---|---:|"]
    rows += [f"| `{m.key}` | {m.label} | {_value(m, getattr(stats, m.key))} |" for m in METRICS]
    return "\n".join(rows)


def stats_values(stats: ScreenplayStats) -> Mapping[str, float | None]:
    """statistic -> value, for templates that lay the numbers out themselves."""
    return {m.key: getattr(stats, m.key) for m in METRICS}
