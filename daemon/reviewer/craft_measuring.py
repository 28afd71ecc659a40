"""Craft statistics of screenplays: the elements of each episode, pooled and
measured (scene lengths, dialogue share, speech lengths, ...).

Pure arithmetic over `craft_parsing.Breakdown`s; the report and the craft
distance both compare two `ScreenplayStats`.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .craft_parsing import Breakdown, parse_screenplay


@dataclass(frozen=True)
class ScreenplayStats:
    """Craft statistics of one or more episodes; None where nothing was measurable."""

    episodes: int
    words: int
    words_per_episode: float
    scenes: int
    scenes_per_episode: float
    scene_words_mean: float | None
    scene_words_median: float | None
    scene_words_sd: float | None
    scene_words_cv: float | None  # spread relative to the mean, comparable across lengths
    dialogue_words: int
    action_words: int
    dialogue_share: float | None  # dialogue / (dialogue + action) words
    speeches: int
    speech_words_mean: float | None
    longest_speech_words: int | None
    parentheticals: int
    parentheticals_per_100_speeches: float | None
    speaking_characters: int
    top_speaker: str | None
    top_speaker_share: float | None  # share of speeches
    question_share: float | None  # share of speeches with a question mark
    action_blocks: int
    action_block_words_mean: float | None
    exclamations: int
    exclamations_per_1k_words: float
    transitions: int
    transitions_per_episode: float


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def measure(breakdowns: Sequence[Breakdown]) -> ScreenplayStats:
    """Pool the elements of the given episodes and measure them together."""
    n_eps = len(breakdowns)
    scenes = [w for b in breakdowns for w in b.scene_words]
    speeches = [s for b in breakdowns for s in b.speeches]
    blocks = [w for b in breakdowns for w in b.action_blocks]
    words = sum(b.words for b in breakdowns)
    dialogue = sum(s.words for s in speeches)
    action = sum(blocks)
    parens = sum(s.parentheticals for s in speeches)
    exclamations = sum(b.exclamations for b in breakdowns)
    transitions = sum(b.transitions for b in breakdowns)
    # Ties go to the alphabetically first name so the report is deterministic.
    ranked = sorted(Counter(s.character for s in speeches).items(), key=lambda kv: (-kv[1], kv[0]))
    scene_mean = statistics.fmean(scenes) if scenes else None
    scene_sd = statistics.pstdev(scenes) if scenes else None
    return ScreenplayStats(
        episodes=n_eps,
        words=words,
        words_per_episode=words / n_eps if n_eps else 0.0,
        scenes=len(scenes),
        scenes_per_episode=len(scenes) / n_eps if n_eps else 0.0,
        scene_words_mean=scene_mean,
        scene_words_median=float(statistics.median(scenes)) if scenes else None,
        scene_words_sd=scene_sd,
        scene_words_cv=_ratio(scene_sd or 0.0, scene_mean or 0.0),
        dialogue_words=dialogue,
        action_words=action,
        dialogue_share=_ratio(dialogue, dialogue + action),
        speeches=len(speeches),
        speech_words_mean=_ratio(dialogue, len(speeches)),
        longest_speech_words=max((s.words for s in speeches), default=None),
        parentheticals=parens,
        parentheticals_per_100_speeches=_ratio(100 * parens, len(speeches)),
        speaking_characters=len(ranked),
        top_speaker=ranked[0][0] if ranked else None,
        top_speaker_share=_ratio(ranked[0][1], len(speeches)) if ranked else None,
        question_share=_ratio(sum(s.has_question for s in speeches), len(speeches)),
        action_blocks=len(blocks),
        action_block_words_mean=_ratio(action, len(blocks)),
        exclamations=exclamations,
        exclamations_per_1k_words=1000 * exclamations / words if words else 0.0,
        transitions=transitions,
        transitions_per_episode=transitions / n_eps if n_eps else 0.0,
    )


@dataclass(frozen=True)
class SideStats:
    """One side of the comparison: all episodes pooled, and each episode alone."""

    overall: ScreenplayStats
    per_episode: dict[int, ScreenplayStats]


def measure_side(episodes: Mapping[int, str]) -> SideStats:
    parsed = {n: parse_screenplay(episodes[n]) for n in sorted(episodes)}
    return SideStats(
        overall=measure(list(parsed.values())),
        per_episode={n: measure([b]) for n, b in parsed.items()},
    )
