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
value against the human's (docs/grounded-reports.md). Each claim is checked
against the measurements with the statistic's floor (craft_report.METRICS):

    g = ln((model + floor) / (human + floor))
    higher   contradicted when g < -DIRECTION_TOLERANCE, else confirmed
    lower    contradicted when g > +DIRECTION_TOLERANCE, else confirmed
    similar  contradicted when |g| > SIMILAR_TOLERANCE, else confirmed
    an unknown statistic, or one a side lacks: not checkable

A report without the list is still a report: "not checked", counted. A list
that cannot be read is reported by line number and reason, never a crash.
Pure, no I/O; numbers and statistic names only, never screenplay text.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
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
# An unknown statistic's name is kept (not checkable) up to this many words.
UNKNOWN_NAME_WORDS = 4
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s*(.*?)\s*#*\s*$")
_SECTION = re.compile(rf"^\**{SECTION}\**\s*:?$", re.IGNORECASE)
_BULLET = re.compile(r"^(?:[-*+•]|\d+[.)])\s+")
_FENCE = re.compile(r"^\s*(```|~~~)")


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
class ClaimCheck:
    """Every claim of one report with its verdict."""

    status: str  # checked | not_checked (no list) | malformed (a list with no readable claim)
    verdicts: tuple[Verdict, ...] = ()
    malformed: tuple[tuple[int, str], ...] = ()
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def contradicted(self) -> tuple[Verdict, ...]:
        return tuple(v for v in self.verdicts if v.verdict == "contradicted")

    @property
    def contradicted_share(self) -> float | None:
        """Contradicted among the claims that could be checked; None: none could."""
        checked = self.counts["confirmed"] + self.counts["contradicted"]
        return self.counts["contradicted"] / checked if checked else None

    def too_contradicted(self, share: float) -> bool:
        found = self.contradicted_share
        return found is not None and found > share

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
    """The claims of the report's last `## Claims` section (any heading level)."""
    lines = report.splitlines()
    start = None
    for i, line in enumerate(lines):
        m = _HEADING.match(line)
        if m and _SECTION.match(m.group(2)):
            start = i + 1
    if start is None:
        return ClaimList(found=False)
    claims: list[Claim] = []
    malformed: list[tuple[int, str]] = []
    for i in range(start, len(lines)):
        line = lines[i].strip()
        if _HEADING.match(lines[i]) and lines[i].lstrip().startswith("#"):
            break  # the next section: the list has ended
        if not line or _FENCE.match(line):
            continue
        claim = _read_line(line, i + 1)
        if isinstance(claim, Claim):
            claims.append(claim)
        else:
            malformed.append((i + 1, claim))
    if not claims and not malformed:
        malformed.append((start, "the claims section is empty"))
    return ClaimList(found=True, claims=tuple(claims), malformed=tuple(malformed))


def _read_line(line: str, number: int) -> Claim | str:
    """One `statistic: direction` line, or why it is not one.

    Read through the guard's normalisation (textnorm), as a person reads it:
    `speech_words_mean`, **Speech words mean** and spee&#96;ch_words_mean
    name one statistic. What is kept is the statistic's key from the facts
    table, or, for a name the table lacks, its first words (at most
    UNKNOWN_NAME_WORDS): never more of the line than a name, so no passage of
    a report reaches the sidecar through a claim (issue 34).
    """
    name, colon, rest = _BULLET.sub("", line).partition(":")
    if not colon:
        return "not 'statistic: higher|lower|similar'"
    words = textnorm.words_as_read(rest)
    direction = words[0] if words else ""
    if direction not in DIRECTIONS:
        return "the direction must be higher, lower or similar"
    read = textnorm.words_as_read(name)
    if not read:
        return "no statistic named"
    metric = _BY_READING.get("".join(read))
    if metric is not None:
        return Claim(statistic=metric.key, direction=direction, line=number)
    split = textnorm.tokens(name)
    if len(split) > UNKNOWN_NAME_WORDS:
        return "not a statistic of the facts table, nor a name"
    return Claim(statistic="_".join(split), direction=direction, line=number)


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


def annotation(contradicted: Iterable[Verdict]) -> str:
    """The section annotate mode appends: what each contradicted claim got wrong."""
    lines = ["## Measured facts (checked by the daemon)", "",
             "These claims above are contradicted by the measurements of both screenplays; "
             "trust the numbers:", ""]
    for v in contradicted:
        metric = _BY_NAME[v.statistic]
        said = "about the same as" if v.claimed == "similar" else f"{v.claimed} than"
        actual = {"higher": "higher than", "lower": "lower than",
                  "similar": "about the same as"}[v.measured or "similar"]
        lines.append(
            f"- `{v.statistic}` ({metric.label}): the report says the model's is {said} the "
            f"human's; measured, it is {actual} the human's: model "
            f"{_value(metric, v.model)} against human {_value(metric, v.human)}.")
    return "\n".join(lines)


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
