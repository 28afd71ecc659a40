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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from .craft_measuring import ScreenplayStats, SideStats, measure_side
from .craft_metrics import METRICS, Metric, words
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
        text += f" (median {words(stats.scene_words_median)})"
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
