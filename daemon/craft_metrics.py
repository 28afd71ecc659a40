"""The built-in reviewer: a deterministic craft report from measured statistics.

`builtin/craft-metrics` is the default "model" on a machine with no API key. It
is reached through litellm like any other model, reads the two screenplays out
of the rendered loss prompt by their episode headers, measures both and writes
a prose report of the largest gaps. It never reads the text for meaning, so the
report holds only numbers, character names and generic craft advice: nothing
of the answer key can travel through it.

litellm is imported inside `register()` only: the pure part (headers, parsing,
metrics, report) stays cheap to import for the CLI and the tests.
"""

from __future__ import annotations

import math
import re
import statistics
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from skilltrain.errors import RefusedError

PROVIDER = "builtin"
MODEL_NAME = "craft-metrics"
MODEL_ID = f"{PROVIDER}/{MODEL_NAME}"

HUMAN_HEADER = "=== Human EP {n:02d} ==="
MODEL_HEADER = "=== Model EP {n:02d} ==="
# Closes a block so that template prose placed after the screenplays is not
# measured as part of the last episode.
END_MARKER = "=== End {kind} episodes ==="

FIRST_LINE = (
    f"Built-in metrics reviewer ({MODEL_ID}): this report compares measured statistics "
    "of the two screenplays, not a reading of the text."
)

_HEADERS = {"human": HUMAN_HEADER, "model": MODEL_HEADER}
_HEADER_RE = re.compile(r"^=== (Human|Model) EP (\d{2,}) ===\s*$")
_END_RE = re.compile(r"^=== End")


class CraftMetricsError(RefusedError):
    """Raised when the prompt holds no usable pair of screenplays, or a report
    would repeat screenplay text. The message names numbers only."""


# --------------------------------------------------------------------------- episode blocks


def _trim_blank_lines(text: str) -> str:
    """Drop leading and trailing blank lines but keep the indentation of the rest."""
    lines = text.splitlines()
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return "\n".join(lines)


def format_episodes(kind: str, episodes: Mapping[int, str]) -> str:
    """The prompt block for one side ("human" or "model"), episodes in order."""
    header = _HEADERS.get(kind.lower())
    if header is None:
        raise ValueError(f"kind must be 'human' or 'model', not {kind!r}")
    if not episodes:
        raise CraftMetricsError(f"no {kind} episodes to format")
    parts = []
    for n in sorted(episodes):
        body = _trim_blank_lines(episodes[n])
        if not body:
            raise CraftMetricsError(f"{kind} episode {n:02d} is empty")
        # A header-like line inside an episode would split or cut it when parsed.
        for line in body.splitlines():
            if _HEADER_RE.match(line.strip()) or _END_RE.match(line.strip()):
                raise CraftMetricsError(f"{kind} episode {n:02d} contains an episode marker line")
        parts.append(f"{header.format(n=n)}\n\n{body}")
    parts.append(END_MARKER.format(kind=kind.capitalize()))
    return "\n\n".join(parts)


@dataclass(frozen=True)
class EpisodePair:
    """Both sides of the comparison, episode number -> text."""

    human: dict[int, str]
    model: dict[int, str]


def parse_episodes(text: str) -> EpisodePair:
    """Read the episode sections out of a prompt; refuse anything incomplete."""
    sides: dict[str, dict[int, str]] = {"Human": {}, "Model": {}}
    current: tuple[str, int] | None = None
    buffer: list[str] = []

    def close() -> None:
        if current is None:
            return
        kind, n = current
        if n in sides[kind]:
            raise CraftMetricsError(f"{kind.lower()} episode {n:02d} appears twice in the prompt")
        body = _trim_blank_lines("\n".join(buffer))
        if not body:
            raise CraftMetricsError(f"{kind.lower()} episode {n:02d} is empty in the prompt")
        sides[kind][n] = body

    for line in text.splitlines():
        header = _HEADER_RE.match(line.strip())
        if header or _END_RE.match(line.strip()):
            close()
            current = (header.group(1), int(header.group(2))) if header else None
            buffer = []
        elif current is not None:
            buffer.append(line)
    close()
    _check_sides(sides["Human"], sides["Model"])
    return EpisodePair(human=sides["Human"], model=sides["Model"])


def _check_sides(human: Mapping[int, str], model: Mapping[int, str]) -> None:
    missing = [k for k, side in (("human", human), ("model", model)) if not side]
    if missing:
        # Comparing against nothing gives a confident report about a gap that does not exist.
        raise CraftMetricsError(f"no {' and no '.join(missing)} episodes found in the prompt")
    if set(human) != set(model):
        raise CraftMetricsError(
            f"episode numbers differ: human {_numbers(human)}, model {_numbers(model)}"
        )


def _numbers(episodes: Iterable[int]) -> str:
    return ",".join(f"{n:02d}" for n in sorted(episodes))


def messages_text(messages: Sequence[Any]) -> str:
    """The text of all chat messages, joined: string contents and text parts."""
    chunks: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if content is None:
            content = getattr(message, "content", None)
        if isinstance(content, str):
            chunks.append(content)
        elif isinstance(content, list):
            chunks.extend(p["text"] for p in content if isinstance(p, Mapping) and "text" in p)
    return "\n".join(chunks)


# --------------------------------------------------------------------------- screenplay parsing

_WORD_RE = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")
_HEADING_RE = re.compile(
    r"^(?:\d+[A-Z]?\s+)?(?:INT\.?/EXT\.?|EXT\.?/INT\.?|I/E\.?|INT\.|EXT\.|INT |EXT )"
)
_TRANSITION_RE = re.compile(r"^(?:[A-Z][A-Z ]*TO:|FADE IN:|FADE OUT\.?|FADE TO BLACK\.?)$")
_CUE_EXTENSION_RE = re.compile(r"\s*\([^)]*\)\s*")
_CUE_NAME_RE = re.compile(r"^[^\W\d_][^\W_]*(?:[ .'’-]+[^\W_]+)*$")


def count_words(text: str) -> int:
    return len(_WORD_RE.findall(text))


def is_scene_heading(line: str) -> bool:
    return bool(_HEADING_RE.match(line.strip()))


def is_transition(line: str) -> bool:
    return bool(_TRANSITION_RE.match(line.strip()))


def cue_name(line: str) -> str | None:
    """The character named by a cue line (extensions removed), or None if not a cue."""
    s = line.strip()
    if is_scene_heading(s) or is_transition(s):
        return None
    # The extension may be lower case, "(into phone)"; the name itself may not.
    name = " ".join(_CUE_EXTENSION_RE.sub(" ", s).rstrip("^ ").split())
    if not name or name != name.upper() or len(name) > 30 or len(name.split()) > 4:
        return None
    return name if _CUE_NAME_RE.match(name) else None


@dataclass(frozen=True)
class Speech:
    """One character cue with its dialogue."""

    character: str
    words: int
    parentheticals: int
    has_question: bool


@dataclass(frozen=True)
class Breakdown:
    """The measured elements of one episode."""

    words: int
    scene_words: tuple[int, ...]
    speeches: tuple[Speech, ...]
    action_blocks: tuple[int, ...]  # words per action paragraph
    transitions: int
    exclamations: int


def _read_speech(lines: Sequence[str], start: int, name: str) -> tuple[Speech, int]:
    """Read the speech whose cue is lines[start]; return it and the next line index."""
    words = parens = 0
    question = in_paren = False
    i = start + 1
    while i < len(lines) and lines[i].strip() and not is_scene_heading(lines[i]):
        s = lines[i].strip()
        if in_paren or s.startswith("("):
            parens += 0 if in_paren else 1
            in_paren = not s.endswith(")")
        else:
            words += count_words(s)
            question = question or "?" in s
        i += 1
    return Speech(name, words, parens, question), i


def _starts_speech(lines: Sequence[str], i: int, after_blank: bool) -> str | None:
    # Fountain's rule: a cue follows a blank line and is followed by its dialogue.
    if not after_blank or i + 1 >= len(lines):
        return None
    following = lines[i + 1].strip()
    if not following or is_scene_heading(following):
        return None
    return cue_name(lines[i])


def parse_screenplay(text: str) -> Breakdown:
    """Split an episode into scenes, speeches, action paragraphs and transitions."""
    lines = text.splitlines()
    scenes: list[int] = []
    speeches: list[Speech] = []
    blocks: list[int] = []
    transitions = 0
    after_blank, in_action = True, False
    i = 0
    while i < len(lines):
        s = lines[i].strip()
        name = _starts_speech(lines, i, after_blank) if s else None
        if not s:
            after_blank, in_action = True, False
        elif is_scene_heading(s):
            scenes.append(0)
            after_blank, in_action = True, False
        elif is_transition(s):
            transitions += 1
            after_blank, in_action = True, False
        elif name is not None:
            speech, end = _read_speech(lines, i, name)
            speeches.append(speech)
            if scenes:
                scenes[-1] += sum(count_words(x) for x in lines[i + 1 : end])
            i, after_blank, in_action = end, False, False
            continue
        else:
            if not in_action:
                blocks.append(0)
            blocks[-1] += count_words(s)
            if scenes:
                scenes[-1] += count_words(s)
            after_blank, in_action = False, True
        i += 1
    return Breakdown(
        words=count_words(text),
        scene_words=tuple(scenes),
        speeches=tuple(speeches),
        action_blocks=tuple(blocks),
        transitions=transitions,
        exclamations=text.count("!"),
    )


# --------------------------------------------------------------------------- statistics


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


# --------------------------------------------------------------------------- report

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
    _check_sides(human, model)
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
    report = "\n".join(out) + "\n"
    assert_no_quote(report, [*human.values(), *model.values()])
    return report


def report_for_prompt(prompt: str) -> str:
    """Parse the episode blocks out of a rendered prompt and report on them."""
    pair = parse_episodes(prompt)
    return build_report(pair.human, pair.model)


# --------------------------------------------------------------------------- no-quote guard

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


# --------------------------------------------------------------------------- litellm provider

_LOCK = threading.Lock()
_MARK = "skilltrain_craft_metrics"
_handler: Any = None

MODEL_INFO: dict[str, Any] = {
    "max_tokens": 8192,
    "max_input_tokens": 1_000_000,
    "max_output_tokens": 8192,
    "input_cost_per_token": 0.0,
    "output_cost_per_token": 0.0,
    # Without the cache prices register_model logs a warning about defaulting them.
    "cache_creation_input_token_cost": 0.0,
    "cache_read_input_token_cost": 0.0,
    "litellm_provider": PROVIDER,
    "mode": "chat",
}


def _make_handler() -> Any:
    """Build the CustomLLM subclass; litellm is imported here, not at module import."""
    import litellm
    from litellm.llms.custom_llm import CustomLLM, CustomLLMError

    def answer(messages: Sequence[Any]) -> tuple[str, int, int]:
        try:
            report = report_for_prompt(messages_text(messages))
        except CraftMetricsError as exc:
            # 400 maps to litellm.BadRequestError; the message names numbers only.
            raise CustomLLMError(status_code=400, message=str(exc)) from None
        # litellm's token_counter reads its bundled tiktoken files: offline and deterministic.
        prompt_tokens = litellm.token_counter(model=MODEL_ID, messages=list(messages))
        return report, prompt_tokens, litellm.token_counter(model=MODEL_ID, text=report)

    def respond(messages: Sequence[Any], model_response: Any) -> Any:
        report, prompt_tokens, completion_tokens = answer(messages)
        model_response.choices[0].message.content = report
        model_response.choices[0].finish_reason = "stop"
        model_response.model = MODEL_ID
        model_response.usage = litellm.Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        return model_response

    def one_chunk(messages: Sequence[Any]) -> dict[str, Any]:
        # The whole report as one GenericStreamingChunk: stream=True callers work too.
        report, prompt_tokens, completion_tokens = answer(messages)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return {"text": report, "is_finished": True, "finish_reason": "stop", "usage": usage}

    class CraftMetricsLLM(CustomLLM):
        """litellm handler for builtin/craft-metrics."""

        skilltrain_craft_metrics = True  # _MARK: recognises our entry across re-imports

        def completion(self, model: str, messages: list[Any], *args: Any, **kwargs: Any) -> Any:
            return respond(messages, kwargs["model_response"])

        async def acompletion(
            self, model: str, messages: list[Any], *args: Any, **kwargs: Any
        ) -> Any:
            # Measuring takes milliseconds: no reason to leave the event loop.
            return respond(messages, kwargs["model_response"])

        def streaming(
            self, model: str, messages: list[Any], *args: Any, **kwargs: Any
        ) -> Iterator[Any]:
            yield one_chunk(messages)

        # litellm types this as a coroutine returning an iterator, but its stream
        # wrapper consumes an async generator, which is what it gets here.
        async def astreaming(  # type: ignore[override]
            self, model: str, messages: list[Any], *args: Any, **kwargs: Any
        ) -> AsyncIterator[Any]:
            yield one_chunk(messages)

    return CraftMetricsLLM()


def register() -> None:
    """Make `builtin/craft-metrics` callable through litellm. Idempotent, thread-safe.

    Appends to litellm.custom_provider_map instead of assigning it, so other
    custom providers stay. Call it again before use if other code may have
    reassigned that list.
    """
    global _handler
    import litellm

    with _LOCK:
        if _handler is None:
            _handler = _make_handler()
        entries = [e for e in litellm.custom_provider_map if e.get("provider") == PROVIDER]
        if not entries:
            litellm.custom_provider_map.append({"provider": PROVIDER, "custom_handler": _handler})
        elif not any(getattr(e["custom_handler"], _MARK, False) for e in entries):
            raise RuntimeError(
                f"litellm custom provider {PROVIDER!r} is already taken by another handler"
            )
        # register_model also teaches get_llm_provider the "builtin/" prefix, so
        # get_model_info and completion_cost work before the first completion.
        if MODEL_ID not in litellm.model_cost:
            litellm.register_model({MODEL_ID: dict(MODEL_INFO)})
