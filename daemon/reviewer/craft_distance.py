"""The craft distance: one number per report saying how far the model's
episodes are from the human ones in measured craft.

It is a progress indicator, not the training signal. The prose report stays
the only thing the optimizer learns from; this number only lets a person (or
a stop rule) see whether step 7 is closer to the human craft than step 2.

    distance = sum over statistics s of  share_s * g / (g + ln 2)
    g        = |ln((model_s + floor_s) / (human_s + floor_s))|

- The statistics, their floors and their weights are the built-in reviewer's
  (`craft_report.METRICS`): one definition of "craft gap" in the project.
  The shares are those weights divided by their sum, so the distance lies
  in [0, 1).
- A log ratio is scale-free: 20 words against 10 is the same gap as 2,000
  against 1,000, and too long weighs the same as too short by the same
  factor. The floor keeps it finite near zero.
- g / (g + ln 2) is 0 at a match, grows with every gap and never reaches 1:
  a statistic off by a factor of 2 gives half its share, 4x two thirds, 8x
  three quarters. No single statistic can take more than its share, and a
  large gap still moves the number when it shrinks (a hard cap would not).
- A statistic one side has and the other cannot have (no speeches at all,
  so no words per speech) counts its full share; one neither side has, 0.

Deterministic, no LLM call, and it reads only the two texts it is given:
the parts hold numbers and statistic names, never screenplay text.
See docs/craft-distance.md.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from . import craft_measuring, craft_parsing, craft_report

# Bump when the definition changes: numbers of two versions are not comparable.
VERSION = 1
HALF_AT = math.log(2)  # the gap (a factor of 2) that gives half a statistic's share

_TOTAL_WEIGHT = sum(m.weight for m in craft_report.METRICS)
SHARES: dict[str, float] = {m.key: m.weight / _TOTAL_WEIGHT for m in craft_report.METRICS}


@dataclass(frozen=True)
class CraftDistance:
    value: float
    parts: dict[str, float]  # statistic -> its contribution; they add up to value

    def sidecar_fields(self) -> dict[str, object]:
        """What the loss sidecar records (rounded: 6 digits are plenty for a curve)."""
        return {
            "craft_distance": round(self.value, 6),
            "craft_distance_version": VERSION,
            "craft_distance_parts": {k: round(v, 6) for k, v in self.parts.items()},
        }


def saturate(gap: float) -> float:
    """0 at no gap, 1/2 at a factor of 2, towards 1 as the gap grows."""
    return gap / (gap + HALF_AT)


def between(human: craft_measuring.ScreenplayStats,
            model: craft_measuring.ScreenplayStats) -> CraftDistance:
    """The distance between two measured sides."""
    gaps = {g.metric.key: g.score / g.metric.weight
            for g in craft_report.rank_gaps(human, model)}
    parts: dict[str, float] = {}
    for metric in craft_report.METRICS:
        gap = gaps.get(metric.key)
        if gap is not None:
            fraction = saturate(gap)
        else:
            # Not comparable: one side lacks the element entirely (full gap),
            # or neither has it (no gap).
            has_h = getattr(human, metric.key) is not None
            has_m = getattr(model, metric.key) is not None
            fraction = 1.0 if has_h != has_m else 0.0
        parts[metric.key] = SHARES[metric.key] * fraction
    return CraftDistance(value=sum(parts.values()), parts=parts)


def of_episodes(human: Mapping[int, str], model: Mapping[int, str], *,
                human_digest: str | None = None) -> CraftDistance:
    """The distance of a report's model episodes from its human episodes."""
    return between(*measure_pair(human, model, human_digest=human_digest))


def measure_pair(human: Mapping[int, str], model: Mapping[int, str], *,
                 human_digest: str | None = None,
                 ) -> tuple[craft_measuring.ScreenplayStats, craft_measuring.ScreenplayStats]:
    """Both sides measured, pooled over their episodes.

    `human_digest` (dataset.episodes_digest of `human`) lets the measured
    human side be reused: it is the same for every step of every run.
    """
    human_stats = _HUMAN_CACHE.get(human_digest) if human_digest else None
    if human_stats is None:
        human_stats = _measure(human)
        if human_digest:
            _HUMAN_CACHE.put(human_digest, human_stats)
    return human_stats, _measure(model)


def _measure(episodes: Mapping[int, str]) -> craft_measuring.ScreenplayStats:
    return craft_measuring.measure([craft_parsing.parse_screenplay(episodes[n])
                                  for n in sorted(episodes)])


class _StatsCache:
    """A small LRU of measured human ranges, keyed by their digest (no text kept)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, craft_measuring.ScreenplayStats] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> craft_measuring.ScreenplayStats | None:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
            return self._items.get(key)

    def put(self, key: str, stats: craft_measuring.ScreenplayStats) -> None:
        with self._lock:
            self._items[key] = stats
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


_HUMAN_CACHE = _StatsCache(1024)
