"""The built-in reviewer: measured statistics, the prompt blocks, the report, litellm."""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Before litellm is imported anywhere: no cost-map download.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from skilltrain.daemon.core.errors import RefusedError  # noqa: E402
from skilltrain.daemon.reviewer import (
    craft_measuring,
    craft_parsing,
    craft_prompt,
    craft_provider,
    craft_report,
)

EXAMPLE_EPISODES = sorted((Path(__file__).resolve().parent.parent / "data" / "example")
                          .glob("*/ep*.txt"))

# Hand-counted: 51 words in all (CONT'D is one word, V.O. two), three scenes of
# 19, 9 and 1 words (headings and cues excluded), four speeches.
SMALL = """\
FADE IN:

INT. KITCHEN - NIGHT

Rain on the glass. Mara scrubs a pot.

MARA
(quietly)
You came back?

JONAH
I did.
I brought the dog!

BANG.

EXT. YARD - DAY

Jonah walks to the fence.

JONAH (V.O.)
Nine posts were down.

CUT TO:

INT./EXT. TRUCK - NIGHT

MARA (CONT'D)
Drive.
"""

HUMAN_EP1 = """\
INT. FARMHOUSE KITCHEN - NIGHT

Rain hammers the window. MARA (40s) scrubs a pot that is already clean.

JONAH enters, soaked, a duffel over one shoulder.

MARA
(not turning)
You came back.

JONAH
I never left the county.

MARA
Same thing, to the cows.

She sets the pot down. Looks at him at last.

JONAH
Is Dad asleep?

MARA
He's been asleep since March.

EXT. BARN - CONTINUOUS

Jonah crosses the yard. The barn door bangs in the wind.

JONAH (V.O.)
I counted the fence posts on the way in. Nine were down.

CUT TO:

INT. BARN - NIGHT

A single bulb. The tractor sits under a tarp.

MARA
Don't touch it!
"""

HUMAN_EP2 = """\
EXT. FIELD - DAWN

Frost on the stubble. Jonah walks the fence line with a hammer.

A truck idles at the gate. SHERIFF TATE leans out of the window.

SHERIFF TATE
Heard you were back.

JONAH
News travels.

SHERIFF TATE
Your father owes the county a great deal of money.

JONAH
Then the county can wait its turn behind me.

Tate laughs and drives off. Jonah drives a nail home.

INT. FARMHOUSE KITCHEN - DAY

Mara reads a letter at the table and folds it small.

MARA
They want the north field by spring.
"""

MODEL_EP1 = """\
INT. FARMHOUSE KITCHEN - NIGHT

The storm pours down relentlessly against the old window while Mara, a tired woman in her
forties with lines of worry etched across her face, scrubs a pot that has clearly been
cleaned many times tonight, lost in thought about the farm and what is left of her family.

Jonah walks in through the back door, completely soaked from the storm, carrying a heavy
duffel bag over his shoulder and looking nervous about how she will react to him.

MARA
(angrily)
Jonah? Is that really you? Why did you come home after all this time? Do you have any idea
what we have been through while you were away?

JONAH
(sadly)
I know, Mara. I was away for a long time, and I hurt everyone when I went, but I have come
home because I want to make things right with you and with our father.

MARA
(bitterly)
Make things right? How exactly do you plan to do that?

JONAH
(quietly)
I have no plan yet. But I want to try!

INT. BARN - NIGHT

The two of them walk into the barn together, where a single bulb hangs from the ceiling and
the old tractor their father loved sits under a dusty tarp in the corner.

MARA
(warning)
Leave that alone! Our father would never forgive you for it!
"""

MODEL_EP2 = """\
EXT. FIELD - DAWN

The morning frost covers the stubble of the field as Jonah walks slowly along the fence line
with a hammer in his hand, thinking hard about everything he has lost over the years.

A police truck pulls up at the gate and the engine idles loudly while SHERIFF TATE, a heavy
man with a moustache, leans out of the driver's window to get a better look.

SHERIFF TATE
(smugly)
Well, well. So the rumours are true and the prodigal son has finally returned to the farm?

JONAH
(defensively)
What do you want, Sheriff? Are you here to welcome me home or to threaten my family?

SHERIFF TATE
(seriously)
Your father has debts with the county, Jonah. Large debts. Did he tell you about them?

INT. FARMHOUSE KITCHEN - DAY

Mara sits at the kitchen table reading an official letter, her hands trembling as she
realises what it means for the farm and for everyone who depends on it.

MARA
(worried)
They are going to take the north field from us by the spring. What are we going to do?
"""

HUMAN = {1: HUMAN_EP1, 2: HUMAN_EP2}
MODEL = {1: MODEL_EP1, 2: MODEL_EP2}


def prompt_for(human: dict[int, str], model: dict[int, str]) -> str:
    """A rendered loss prompt as a user's template might shape it."""
    return (
        "You are a script editor. Compare the two screenplays.\n\n"
        f"{craft_prompt.format_episodes('human', human)}\n\n"
        "And here is the model's attempt:\n\n"
        f"{craft_prompt.format_episodes('model', model)}\n\n"
        "Write the report below, ordered by importance.\n"
    )


def synthetic(
    *, scenes: int = 4, action_words: int = 10, speech_words: int = 5, speeches: int = 2
) -> str:
    """A regular screenplay whose numbers are known by construction."""
    out = []
    for s in range(scenes):
        out += [f"INT. ROOM {s} - DAY", "", " ".join(["walk"] * action_words), ""]
        for k in range(speeches):
            out += ["ANNA" if k % 2 == 0 else "BORIS", " ".join(["talk"] * speech_words), ""]
    return "\n".join(out)


# --------------------------------------------------------------------------- metrics


def test_parse_screenplay_counts_a_hand_made_episode() -> None:
    b = craft_parsing.parse_screenplay(SMALL)
    assert b.words == 50
    assert b.scene_words == (19, 9, 1)
    assert b.speeches == (
        craft_parsing.Speech("MARA", 3, 1, True),
        craft_parsing.Speech("JONAH", 6, 0, False),
        craft_parsing.Speech("JONAH", 4, 0, False),
        craft_parsing.Speech("MARA", 1, 0, False),
    )
    assert b.action_blocks == (8, 1, 5)  # "BANG." stands alone: action, not a cue
    assert b.transitions == 2
    assert b.exclamations == 1


# Characters where the fast count could part from the regex: apostrophes of
# both kinds and runs of them, typography, Unicode letters and digits, the
# breaks only str.splitlines() knows, underscores, CR/LF.
_WORD_EDGES = ("ab9Z'''\u2019\u2018\u201c\u201d\u2014\u2013\u2026\u00a0"
               "\u00e9\u00df_-. \t\n\r\x0b\x1c\u2028\u0663")


@pytest.mark.parametrize("seed", range(3))
def test_line_word_counts_matches_the_regex_line_by_line(seed: int) -> None:
    rng = random.Random(seed)
    texts = [SMALL, *(p.read_text(encoding="utf-8") for p in EXAMPLE_EPISODES)]
    texts += ["".join(rng.choice(_WORD_EDGES) for _ in range(rng.randrange(80)))
              for _ in range(3000)]
    # The ASCII and the typography paths each taken, not only the fallback.
    texts += ["".join(rng.choice("ab9'\u2019\u2014 .\n") for _ in range(60)) for _ in range(1000)]
    for text in texts:
        expected = [craft_parsing.count_words(line) for line in text.splitlines()]
        assert craft_parsing.line_word_counts(text) == expected, repr(text)


def test_measure_pools_episodes_with_exact_values() -> None:
    s = craft_measuring.measure(
        [craft_parsing.parse_screenplay(SMALL), craft_parsing.parse_screenplay(SMALL)]
    )
    assert s.episodes == 2
    assert s.words == 100 and s.words_per_episode == 50.0
    assert s.scenes == 6 and s.scenes_per_episode == 3.0
    assert s.scene_words_mean == pytest.approx(29 / 3)
    assert s.scene_words_median == 9.0
    assert s.scene_words_sd == pytest.approx(statistics.pstdev([19, 9, 1, 19, 9, 1]))
    assert s.dialogue_words == 28 and s.action_words == 28 and s.dialogue_share == 0.5
    assert s.speeches == 8 and s.speech_words_mean == 3.5 and s.longest_speech_words == 6
    assert s.parentheticals == 2 and s.parentheticals_per_100_speeches == 25.0
    assert s.speaking_characters == 2
    assert (s.top_speaker, s.top_speaker_share) == ("JONAH", 0.5)  # a tie goes to A-Z order
    assert s.question_share == 0.25
    assert s.action_blocks == 6 and s.action_block_words_mean == pytest.approx(28 / 6)
    assert s.exclamations == 2 and s.exclamations_per_1k_words == 20.0
    assert s.transitions_per_episode == 2.0


def test_measure_of_text_without_scenes_or_speech_reports_none() -> None:
    s = craft_measuring.measure(
        [craft_parsing.parse_screenplay("A field. Wind.\n\nNothing moves.\n")]
    )
    assert (s.scenes, s.speeches, s.words) == (0, 0, 5)
    assert s.scene_words_mean is None and s.speech_words_mean is None
    assert s.dialogue_share == 0.0 and s.top_speaker is None


@pytest.mark.parametrize(
    ("line", "name"),
    [
        ("JONAH", "JONAH"),
        ("JONAH (V.O.)", "JONAH"),
        ("MARA (CONT'D)", "MARA"),
        ("MARA (into phone)", "MARA"),
        ("SHERIFF TATE ^", "SHERIFF TATE"),
        ("DR. NO", "DR. NO"),
        ("BANG.", None),
        ("Mara", None),
        ("CUT TO:", None),
        ("INT. BARN - DAY", None),
        ("THE MAN IN THE GREY COAT", None),
    ],
)
def test_cue_name(line: str, name: str | None) -> None:
    assert craft_parsing.cue_name(line) == name


# --------------------------------------------------------------------------- prompt blocks


def test_format_parse_round_trip_keeps_indentation_and_trims_blank_lines() -> None:
    human = {2: "\n\n    INT. HALL - DAY\n\n  Steps.\n\n", 1: "EXT. ROAD - NIGHT\n\nCars.\n"}
    model = {1: "EXT. ROAD - NIGHT\n\nA car.", 2: "INT. HALL - DAY\n\n\nSteps echo.\n"}
    block = craft_prompt.format_episodes("human", human)
    assert block.splitlines()[0] == craft_prompt.HUMAN_HEADER.format(n=1) == "=== Human EP 01 ==="
    assert craft_prompt.MODEL_HEADER.format(n=12) == "=== Model EP 12 ==="
    pair = craft_prompt.parse_episodes(prompt_for(human, model))
    assert pair.human == {1: "EXT. ROAD - NIGHT\n\nCars.", 2: "    INT. HALL - DAY\n\n  Steps."}
    assert pair.model == {1: "EXT. ROAD - NIGHT\n\nA car.", 2: "INT. HALL - DAY\n\n\nSteps echo."}
    # Formatting what was parsed gives the same block again.
    assert craft_prompt.format_episodes("human", pair.human) == block


def test_parse_sections_end_at_the_next_header_or_an_end_line() -> None:
    text = (
        "=== Model EP 01 ===\nA.\n=== Human EP 01 ===\nB.\n=== End of screenplays\n"
        "Template prose that is not a screenplay.\n"
    )
    pair = craft_prompt.parse_episodes(text)
    assert pair.model == {1: "A."} and pair.human == {1: "B."}


def test_missing_side_is_refused_without_quoting_the_text() -> None:
    only_human = craft_prompt.format_episodes("human", HUMAN)
    with pytest.raises(craft_prompt.CraftMetricsError, match="no model episodes") as info:
        craft_prompt.parse_episodes(only_human)
    assert isinstance(info.value, RefusedError)
    assert "Rain" not in str(info.value)
    with pytest.raises(craft_prompt.CraftMetricsError, match="no human and no model"):
        craft_prompt.parse_episodes("Compare the screenplays.")
    with pytest.raises(craft_prompt.CraftMetricsError, match="no human episodes"):
        craft_report.build_report({}, MODEL)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("=== Human EP 01 ===\nA.\n=== Model EP 02 ===\nB.\n", "human 01, model 02"),
        ("=== Human EP 01 ===\n\n=== Model EP 01 ===\nB.\n", "human episode 01 is empty"),
        ("=== Human EP 01 ===\nA.\n=== Human EP 01 ===\nA.\n=== Model EP 01 ===\nB.", "twice"),
    ],
)
def test_incomplete_pairs_are_refused(text: str, message: str) -> None:
    with pytest.raises(craft_prompt.CraftMetricsError, match=message):
        craft_prompt.parse_episodes(text)


def test_format_refuses_empty_episodes_and_marker_lines() -> None:
    with pytest.raises(craft_prompt.CraftMetricsError, match="episode 03 is empty"):
        craft_prompt.format_episodes("model", {3: "\n  \n"})
    with pytest.raises(craft_prompt.CraftMetricsError, match="marker"):
        craft_prompt.format_episodes("model", {1: "A.\n=== Human EP 02 ===\nB."})
    with pytest.raises(ValueError, match="kind"):
        craft_prompt.format_episodes("writer", {1: "A."})


# --------------------------------------------------------------------------- report


def test_report_is_deterministic_and_opens_with_the_required_line() -> None:
    first = craft_report.report_for_prompt(prompt_for(HUMAN, MODEL))
    assert first == craft_report.report_for_prompt(prompt_for(HUMAN, MODEL))
    assert first.startswith(
        "Built-in metrics reviewer (builtin/craft-metrics): this report compares measured "
        "statistics of the two screenplays, not a reading of the text.\n"
    )
    assert "| Measure | Human | Model |" in first
    assert 250 <= len(first.split()) <= 600


def test_report_names_the_biggest_gap_first() -> None:
    human = {1: synthetic(), 2: synthetic()}
    model = {1: synthetic(speech_words=40), 2: synthetic(speech_words=40)}
    ranked = craft_report.rank_gaps(
        craft_measuring.measure_side(human).overall, craft_measuring.measure_side(model).overall
    )
    assert ranked[0].metric.key == "speech_words_mean"
    assert [g.score for g in ranked] == sorted((g.score for g in ranked), reverse=True)
    report = craft_report.build_report(human, model)
    assert "\n1. Speeches run long: 40.0 words per speech against 5.0." in report
    assert report.index("Speeches run long") < report.index("Scenes run long")


def test_report_flags_the_episode_that_deviates() -> None:
    human = {n: synthetic() for n in (1, 2, 3)}
    model = {1: synthetic(), 2: synthetic(scenes=12), 3: synthetic()}
    report = craft_report.build_report(human, model)
    notes = report.split("## Episode notes")[1]
    assert "- EP 02: the model's episode runs 312 words against 104." in notes
    assert "EP 01" not in notes and "EP 03" not in notes
    calm = craft_report.build_report(human, human).split("## Episode notes")[1]
    assert "No single episode departs strongly" in calm


def _six_grams(text: str) -> set[tuple[str, ...]]:
    return set(craft_report.ngrams(craft_report.normalized_words(text), 6))


def test_report_quotes_no_six_word_sequence_of_the_human_text() -> None:
    report = craft_report.build_report(HUMAN, MODEL)
    human_grams = set().union(*(_six_grams(t) for t in HUMAN.values()))
    assert human_grams, "the sample must be long enough to test anything"
    assert not human_grams & _six_grams(report)
    assert "MARA" in report  # names are shared plot and may appear


def test_no_quote_guard_refuses_a_copied_line() -> None:
    with pytest.raises(craft_prompt.CraftMetricsError, match="6-word"):
        craft_report.assert_no_quote(
            "Note: I counted the fence posts on the way in.", HUMAN.values()
        )


# --------------------------------------------------------------------------- through litellm


@pytest.fixture(scope="module")
def litellm_module() -> Iterator[Any]:
    import litellm

    saved = list(litellm.custom_provider_map)
    yield litellm
    litellm.custom_provider_map[:] = saved


def test_completion_through_litellm(litellm_module: Any) -> None:
    litellm = litellm_module
    from litellm import CustomLLM

    other = {"provider": "skilltrain-test-other", "custom_handler": CustomLLM()}
    litellm.custom_provider_map.append(other)
    threads = [threading.Thread(target=craft_provider.register) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    craft_provider.register()
    providers = [e["provider"] for e in litellm.custom_provider_map]
    assert providers.count("builtin") == 1 and other in litellm.custom_provider_map

    prompt = prompt_for(HUMAN, MODEL)
    response = litellm.completion(
        model="builtin/craft-metrics", messages=[{"role": "user", "content": prompt}]
    )
    assert response.choices[0].message.content == craft_report.report_for_prompt(prompt)
    assert response.choices[0].finish_reason == "stop"
    assert response.model == "builtin/craft-metrics"
    assert response.usage.prompt_tokens > len(prompt) // 8
    assert response.usage.completion_tokens > 100
    assert litellm.completion_cost(completion_response=response) == 0.0

    info = litellm.get_model_info("builtin/craft-metrics")
    assert info["max_input_tokens"] == 1_000_000 and info["mode"] == "chat"
    assert info["input_cost_per_token"] == 0.0 and info["output_cost_per_token"] == 0.0


def test_missing_side_through_litellm_is_a_bad_request(litellm_module: Any) -> None:
    litellm = litellm_module
    craft_provider.register()
    prompt = craft_prompt.format_episodes("human", HUMAN)
    with pytest.raises(litellm.BadRequestError, match="no model episodes") as info:
        litellm.completion(
            model="builtin/craft-metrics", messages=[{"role": "user", "content": prompt}]
        )
    assert "Rain" not in str(info.value)


# litellm's stream wrapper builds a pydantic schema lazily, and pydantic warns about a
# ReadOnly TypedDict items in litellm's own types: their warning, not ours.
@pytest.mark.filterwarnings("ignore:Item '.*' on TypedDict class .* `ReadOnly`:UserWarning")
def test_streaming_through_litellm_yields_the_same_report(litellm_module: Any) -> None:
    litellm = litellm_module
    craft_provider.register()
    prompt = prompt_for(HUMAN, MODEL)
    chunks = list(
        litellm.completion(
            model="builtin/craft-metrics",
            messages=[{"role": "user", "content": prompt}],
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == craft_report.report_for_prompt(prompt)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_register_refuses_a_foreign_builtin_provider(litellm_module: Any) -> None:
    litellm = litellm_module
    from litellm import CustomLLM

    saved = list(litellm.custom_provider_map)
    litellm.custom_provider_map[:] = [{"provider": "builtin", "custom_handler": CustomLLM()}]
    try:
        with pytest.raises(RuntimeError, match="already taken"):
            craft_provider.register()
    finally:
        litellm.custom_provider_map[:] = saved


def test_importing_the_module_does_not_import_litellm() -> None:
    code = ("import sys, skilltrain.daemon.reviewer.craft_provider; "
            "sys.exit('litellm' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_model_without_scene_headings_or_cues_is_told_so_first() -> None:
    prose = {1: "Mara scrubs a pot. Jonah comes home.\n\nThey talk about the farm."}
    report = craft_report.build_report({1: HUMAN_EP1}, prose)
    findings = report.split("## What to change, largest gap first\n\n")[1]
    assert findings.startswith("1. No scene headings found in the model's episodes, against 3")
    assert "\n2. No character cues found in the model's episodes, against 7 speeches" in findings
    assert "Too few scenes" not in report and "Fewer speaking parts" not in report
