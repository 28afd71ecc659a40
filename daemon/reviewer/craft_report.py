"""The built-in reviewer's report: a deterministic craft report from measured
statistics.

The measures are compared through the METRICS table (floor, weight, advice
per statistic); the largest gaps become findings in fixed prose, followed by
a table of key numbers and per-episode notes. The report holds only numbers,
character names and generic craft advice, never the text read, and
`assert_no_quote` refuses it should it ever share a six-word run with a
screenplay (rule 1).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from .craft_measuring import ScreenplayStats, SideStats, measure_side
from .craft_prompt import CraftMetricsError, check_sides, parse_episodes

PROVIDER = "builtin"
MODEL_NAME = "craft-metrics"
MODEL_ID = f"{PROVIDER}/{MODEL_NAME}"

FIRST_LINE = (
    f"Built-in metrics reviewer ({MODEL_ID}): this report compares measured statistics "
    "of the two screenplays, not a reading of the text."
)

GAP_THRESHOLD = 0.15  # |log ratio| below this (about 16 %) counts as "close"
EPISODE_THRESHOLD = 0.4  # about 1.5x: an episode worth a note of its own
MAX_FINDINGS = 7
MAX_EPISODE_NOTES = 6


def _words(v: float) -> str:
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
        "scene_words_mean", "Scene length, mean (words)", 10, 1.0, _words,
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
        "words_per_episode", "Episode length (words)", 100, 1.0, _words,
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
        "speaking_characters", "Speaking characters", 1, 0.8, _words,
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
        "longest_speech_words", "Longest speech (words)", 10, 0.7, _words,
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
_METRIC_BY_KEY = {m.key: m for m in METRICS}

# Episode notes look at the measures that vary most from episode to episode.
_EPISODE_KEYS = ("words_per_episode", "scene_words_mean", "dialogue_share", "speech_words_mean")
_EPISODE_PHRASES = {
    "words_per_episode": "the model's episode runs {m} words against {h}",
    "scene_words_mean": "scenes average {m} words against {h}",
    "dialogue_share": "dialogue is {m} of the words against {h}",
    "speech_words_mean": "{m} words per speech against {h}",
}


@dataclass(frozen=True)
class Gap:
    metric: Metric
    human: float
    model: float
    score: float  # weighted |log ratio|, the size of the gap


def _gap(metric: Metric, human: ScreenplayStats, model: ScreenplayStats) -> Gap | None:
    h, m = getattr(human, metric.key), getattr(model, metric.key)
    if h is None or m is None:
        return None
    raw = abs(math.log((m + metric.floor) / (h + metric.floor)))
    return Gap(metric, float(h), float(m), metric.weight * raw)


def rank_gaps(human: ScreenplayStats, model: ScreenplayStats) -> list[Gap]:
    """All comparable measures, largest gap first (ties keep the METRICS order)."""
    gaps = [g for g in (_gap(x, human, model) for x in METRICS) if g is not None]
    return sorted(gaps, key=lambda g: -g.score)


def _finding(gap: Gap, human: ScreenplayStats, model: ScreenplayStats) -> str:
    template = gap.metric.more if gap.model > gap.human else gap.metric.less
    return template.format(
        m=gap.metric.fmt(gap.model),
        h=gap.metric.fmt(gap.human),
        mtop=model.top_speaker or "-",
        htop=human.top_speaker or "-",
    )


def _format_findings(human: ScreenplayStats, model: ScreenplayStats) -> tuple[list[str], list[str]]:
    """The findings to spell out, and the labels of further gaps to list briefly."""
    lines: list[str] = []
    # A missing format element outranks every ratio: nothing else is comparable then.
    if model.scenes == 0 and human.scenes > 0:
        lines.append(
            f"No scene headings found in the model's episodes, against {human.scenes} in the "
            "human version. Open every scene with an INT./EXT. heading naming place and time."
        )
    if model.speeches == 0 and human.speeches > 0:
        lines.append(
            f"No character cues found in the model's episodes, against {human.speeches} "
            "speeches in the human version. Put each speaker's name in capitals on its own "
            "line above the dialogue."
        )
    # A count of zero is already said above; do not say it again as a ratio.
    covered = {"scenes_per_episode"} if model.scenes == 0 else set()
    covered |= {"speaking_characters"} if model.speeches == 0 else set()
    gaps = [
        g
        for g in rank_gaps(human, model)
        if g.score >= GAP_THRESHOLD and g.metric.key not in covered
    ]
    lines.extend(_finding(g, human, model) for g in gaps[:MAX_FINDINGS])
    return lines, [_short_label(g) for g in gaps[MAX_FINDINGS:]]


def _short_label(gap: Gap) -> str:
    return gap.metric.label.split(" (")[0].lower()


def _cell(stats: ScreenplayStats, metric: Metric) -> str:
    value = getattr(stats, metric.key)
    if value is None:
        return "-"
    text = metric.fmt(value)
    if metric.key == "top_speaker_share" and stats.top_speaker:
        text += f" ({stats.top_speaker})"
    if metric.key == "scene_words_mean" and stats.scene_words_median is not None:
        text += f" (median {_words(stats.scene_words_median)})"
    return text


def _table(human: ScreenplayStats, model: ScreenplayStats) -> list[str]:
    rows = ["| Measure | Human | Model |", "|---|---:|---:|"]
    rows += [f"| {x.label} | {_cell(human, x)} | {_cell(model, x)} |" for x in METRICS]
    return rows


def _episode_notes(human: SideStats, model: SideStats) -> list[str]:
    overall = {k: _gap(_METRIC_BY_KEY[k], human.overall, model.overall) for k in _EPISODE_KEYS}
    notes: list[tuple[float, int, str]] = []
    for n in sorted(human.per_episode):
        hs, ms = human.per_episode[n], model.per_episode[n]
        strong: list[tuple[float, str]] = []
        for key in _EPISODE_KEYS:
            gap = _gap(_METRIC_BY_KEY[key], hs, ms)
            if gap is None or gap.score < EPISODE_THRESHOLD:
                continue
            base = overall[key]
            same_way = base is not None and (base.model > base.human) == (gap.model > gap.human)
            # Only deviations beyond the overall pattern: the overall finding covers the rest.
            if base is not None and same_way and gap.score - base.score < 0.2:
                continue
            fmt = gap.metric.fmt
            phrase = _EPISODE_PHRASES[key].format(m=fmt(gap.model), h=fmt(gap.human))
            strong.append((gap.score, phrase))
        if strong:
            strong.sort(key=lambda sp: -sp[0])
            text = "; ".join(p for _, p in strong[:2])
            notes.append((strong[0][0], n, f"- EP {n:02d}: {text}."))
    notes.sort(key=lambda note: (-note[0], note[1]))
    return [line for _, _, line in notes[:MAX_EPISODE_NOTES]]


def build_report(human: Mapping[int, str], model: Mapping[int, str]) -> str:
    """The Markdown report comparing the model's episodes with the human ones."""
    check_sides(human, model)
    hs, ms = measure_side(human), measure_side(model)
    findings, smaller = _format_findings(hs.overall, ms.overall)
    close = [_short_label(g) for g in rank_gaps(hs.overall, ms.overall) if g.score < GAP_THRESHOLD]
    numbers = sorted(human)
    out = [
        FIRST_LINE,
        "",
        f"Episodes compared: {len(numbers)} (EP {numbers[0]:02d} to EP {numbers[-1]:02d}).",
        "",
        "## What to change, largest gap first",
        "",
    ]
    if findings:
        out += [f"{i}. {text}" for i, text in enumerate(findings, 1)]
    else:
        out.append("No measured gap is larger than about 16%; the proportions match.")
    if smaller:
        out += ["", "Smaller gaps (see the table): " + ", ".join(smaller) + "."]
    if close:
        out += ["", "Close to the human version: " + ", ".join(close) + "."]
    out += ["", "## Key numbers", "", *_table(hs.overall, ms.overall), "", "## Episode notes", ""]
    notes = _episode_notes(hs, ms)
    out += notes or ["No single episode departs strongly from the overall pattern."]
    # The claims list the loss step checks (craft_claims), from the same numbers:
    # every one of them is confirmed. Imported here: craft_claims reads METRICS.
    from .craft_claims import grounded_claims, section

    out += ["", section(grounded_claims(hs.overall, ms.overall))]
    report = "\n".join(out) + "\n"
    assert_no_quote(report, [*human.values(), *model.values()])
    return report


def report_for_prompt(prompt: str) -> str:
    """Parse the episode blocks out of a rendered prompt and report on them."""
    pair = parse_episodes(prompt)
    return build_report(pair.human, pair.model)


# The no-quote guard.

QUOTE_NGRAM = 6


def normalized_words(text: str) -> list[str]:
    """Lowercased words with punctuation stripped: the unit of the no-quote check."""
    return re.findall(r"[^\W_]+", text.lower())


def ngrams(words: Sequence[str], n: int = QUOTE_NGRAM) -> Iterator[tuple[str, ...]]:
    return (tuple(words[i : i + n]) for i in range(len(words) - n + 1))


def assert_no_quote(report: str, sources: Iterable[str], n: int = QUOTE_NGRAM) -> None:
    """Refuse a report sharing any n-word sequence with a screenplay.

    The report is built from numbers, names and fixed advice, so this should
    never fire; it is the last line of defence for rule 1, not the mechanism.
    """
    seen = set(ngrams(normalized_words(report), n))
    for text in sources:
        if any(g in seen for g in ngrams(normalized_words(text), n)):
            raise CraftMetricsError(f"report shares a {n}-word sequence with a screenplay")
