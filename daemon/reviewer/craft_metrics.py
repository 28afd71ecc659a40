"""The craft statistics the reviewer compares: each one's label, floor, weight,
format and the advice for a model above or below the human.

One table, read by the report (daemon/reviewer/craft_report.py), the claims
check (craft_claims.py) and the craft distance (craft_distance.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def words(v: float) -> str:
    return f"{v:,.0f}"


def _one(v: float) -> str:
    return f"{v:,.1f}"


def _pct(v: float) -> str:
    return f"{100 * v:.0f}%"


@dataclass(frozen=True)
class Metric:
    """How one statistic is compared and what to say when the model is off."""

    key: str
    label: str
    floor: float  # keeps the log ratio sane near zero
    weight: float
    fmt: Callable[[float], str]
    more: str  # advice when the model's value is higher; {m} {h} are formatted values
    less: str


# fmt: off
# One row per measure, kept as a table: key, label, floor, weight, format, advice.
METRICS: tuple[Metric, ...] = (
    Metric(
        "scene_words_mean", "Scene length, mean (words)", 10, 1.0, words,
        "Scenes run long: the model's scenes average {m} words against {h} in the human "
        "version. Enter later and cut out once the turn lands.",
        "Scenes are clipped: the model's scenes average {m} words against {h} in the human "
        "version. Let the central scenes play out their turn before cutting away.",
    ),
    Metric(
        "dialogue_share", "Dialogue share of words", 0.05, 1.0, _pct,
        "Too talky: dialogue is {m} of the words against {h}. Move information into action "
        "and behaviour; let images carry the beats the characters now explain.",
        "Too much description: dialogue is {m} of the words against {h}. Dramatise more in "
        "exchanges, and trim action the scene does not need.",
    ),
    Metric(
        "speech_words_mean", "Words per speech (mean)", 3, 1.0, _one,
        "Speeches run long: {m} words per speech against {h}. Break speeches into exchanges, "
        "and cut the sentence that explains the one before it.",
        "Speeches are clipped: {m} words per speech against {h}. Let key characters finish a "
        "thought; not every line has to be a retort.",
    ),
    Metric(
        "scenes_per_episode", "Scenes per episode", 1, 1.0, _one,
        "Too many scenes: {m} per episode against {h}. Merge scenes that serve the same beat "
        "and drop scenes that only move characters between places.",
        "Too few scenes: {m} per episode against {h}. Break long stretches at changes of place "
        "or time, and intercut storylines to keep momentum.",
    ),
    Metric(
        "words_per_episode", "Episode length (words)", 100, 1.0, words,
        "Episodes run long: {m} words per episode against {h}. Cut scenes that repeat a beat "
        "and tighten entrances and exits.",
        "Episodes run short: {m} words per episode against {h}. Dramatise the beats that are "
        "now summarised or skipped.",
    ),
    Metric(
        "scene_words_cv", "Scene length spread (SD as % of mean)", 0.1, 0.8, _pct,
        "Scene lengths swing more: they spread {m} around the mean against {h}. Keep short "
        "scenes purposeful and trim the longest ones.",
        "Scene lengths are uniform: they spread {m} around the mean against {h}. Vary the "
        "rhythm, with short punctuating scenes between longer set pieces.",
    ),
    Metric(
        "parentheticals_per_100_speeches", "Parentheticals per 100 speeches", 2, 0.9, _one,
        "Over-directed dialogue: {m} parentheticals per 100 speeches against {h}. Trust the "
        "line and the actor; keep a parenthetical only where the reading is not obvious.",
        "Few parentheticals: {m} per 100 speeches against {h}. Where a reading runs against "
        "the words, a brief parenthetical helps the actor.",
    ),
    Metric(
        "question_share", "Speeches with a question", 0.05, 0.9, _pct,
        "Too many questions: {m} of speeches ask one against {h}. Question-and-answer "
        "dialogue turns into exposition; let characters assert, deflect or act.",
        "Characters rarely ask: {m} of speeches ask a question against {h}. Use questions to "
        "put pressure on the other character and pull the scene forward.",
    ),
    Metric(
        "action_block_words_mean", "Action paragraph (words, mean)", 3, 0.9, _one,
        "Action paragraphs are dense: {m} words per paragraph against {h}. Give each image or "
        "beat its own short paragraph and cut interior states the camera cannot see.",
        "Action paragraphs are thin: {m} words per paragraph against {h}. Give key images "
        "enough concrete detail to be seen.",
    ),
    Metric(
        "speaking_characters", "Speaking characters", 1, 0.8, words,
        "More speaking parts: {m} against {h}. Fold minor voices together, or let minor "
        "characters act without lines.",
        "Fewer speaking parts: {m} against {h}. Let secondary characters speak for themselves "
        "instead of being described.",
    ),
    Metric(
        "top_speaker_share", "Top speaker's share of speeches", 0.05, 0.8, _pct,
        "One voice dominates: {mtop} has {m} of the speeches, against {h} for {htop} in the "
        "human version. Give other characters lines that turn the scene.",
        "Dialogue is spread thinner: the top speaker, {mtop}, has {m} of the speeches against "
        "{h} for {htop}. Anchor scenes on the central character's voice.",
    ),
    Metric(
        "longest_speech_words", "Longest speech (words)", 10, 0.7, words,
        "The longest speech runs {m} words against {h}. Cut monologues down, or break them "
        "with interruptions and reactions.",
        "No speech runs longer than {m} words, against {h} in the human version. Give the "
        "pivotal moment room for one sustained speech.",
    ),
    Metric(
        "exclamations_per_1k_words", "Exclamation marks per 1,000 words", 1, 0.6, _one,
        "Exclamation-heavy: {m} exclamation marks per 1,000 words against {h}. Let the "
        "situation carry the intensity instead of the punctuation.",
        "Even-tempered punctuation: {m} exclamation marks per 1,000 words against {h}. Where "
        "tempers break, let the lines show it.",
    ),
    Metric(
        "transitions_per_episode", "Transitions per episode", 1, 0.5, _one,
        "Transitions are overused: {m} per episode against {h}. A cut is implied; write a "
        "transition only when it carries meaning.",
        "Fewer transitions: {m} per episode against {h}. A marked transition can still signal "
        "a jump in time or tone.",
    ),
)
# fmt: on
