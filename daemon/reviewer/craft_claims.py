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
value against the human's (docs/grounded-reports.md), read as reviewers
write it (craft_claims_reading). Each claim is checked against the
measurements with the statistic's floor (craft_report.METRICS):

    g = ln((model + floor) / (human + floor))
    higher   contradicted when g < -DIRECTION_TOLERANCE, else confirmed
    lower    contradicted when g > +DIRECTION_TOLERANCE, else confirmed
    similar  contradicted when |g| > SIMILAR_TOLERANCE, else confirmed
    an unknown statistic, or one a side lacks: not checkable

A report without the list is still a report: "not checked", counted. A line
that tries to be a claim and cannot be read is reported by line number and
reason, never a crash; prose beside the claims is passed over. Unreadable
claim lines are seen like a contradiction, annotated ("N of M claims above
could not be checked"), when one names a statistic of the tables: a wrong
claim must not pass by its wording. A list
that is mostly unreadable (more than half its lines, or no readable claim at
all) cannot vouch for its report: in refuse mode its unreadable lines count
as contradicted.
Pure, no I/O; numbers and statistic names only, never screenplay text.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .craft_claims_reading import BY_NAME, SECTION, Claim, ClaimList, read_claims
from .craft_measuring import ScreenplayStats
from .craft_metrics import METRICS, Metric

__all__ = ["Claim", "ClaimCheck", "ClaimList", "ScreenplayStats", "Unreadable", "Verdict",
           "annotation", "check", "check_report", "facts_table", "grounded_claims", "judge",
           "read_claims", "section", "stats_values"]

STATISTICS = tuple(m.key for m in METRICS)  # the checkable ones, as the prompt's tables name them
# A direction claim is wrong only when the measurement points the other way
# by more than about 5 %: a hair's difference either way is not a lie.
DIRECTION_TOLERANCE = 0.05
# "similar" holds within about 16 %: the built-in reviewer's own "close" line.
SIMILAR_TOLERANCE = 0.15
# In refuse mode, a report with more than this share of its checked claims
# contradicted is bogus signal ([integrity] refuse_share overrides it).
REFUSE_SHARE = 0.5

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
    """Claim lines that could not be read. They are seen like a contradicted
    claim (annotated): a wrong claim must not pass by being misspelt, nor a list
    of them; in refuse mode they count only when most of the list is unreadable."""

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
    malformed_naming: int = 0  # malformed lines that name a statistic of the tables

    @property
    def mostly_unreadable(self) -> bool:
        """More than half the list's lines could not be read (so too a Claims
        heading with no readable claim): such a list cannot vouch for its report."""
        return 2 * len(self.malformed) > len(self.malformed) + len(self.verdicts)

    @property
    def contradicted(self) -> tuple[Verdict | Unreadable, ...]:
        """What the report must be seen for (annotation): each contradicted
        claim, and its unreadable claim lines if one names a statistic of the
        tables (a claim about it could be wrong) or most of them are unreadable."""
        wrong: tuple[Verdict | Unreadable, ...] = tuple(
            v for v in self.verdicts if v.verdict == "contradicted")
        if self.malformed_naming or self.mostly_unreadable:
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
    metric = BY_NAME.get(claim.statistic) or BY_NAME.get(claim.statistic.replace(" ", "_"))
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
                      counts=counts, malformed_naming=len(claims.naming))


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
    metric = BY_NAME[v.statistic]
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
