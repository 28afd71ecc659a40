"""craft_claims: a report's claims list read, checked against the measurements,
and the built-in reviewer's own list always confirmed (issue 25)."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.reviewer import craft_claims, craft_distance, craft_report
from skilltrain.daemon.reviewer.craft_claims import check_report, read_claims

EXAMPLE = Path(__file__).resolve().parent.parent / "data" / "example"


def _episodes(folder: Path, first: int = 1, last: int = 3) -> dict[int, str]:
    return {n: (folder / f"ep{n:02d}.txt").read_text("utf-8") for n in range(first, last + 1)}


@pytest.fixture(scope="module")
def stats() -> tuple[craft_claims.ScreenplayStats, craft_claims.ScreenplayStats]:
    # The example, measured: the model's speeches are longer (21.8 words against
    # 5.2), its scenes fewer (2.7 against 6.3), its episodes similar (669 / 621).
    return craft_distance.measure_pair(_episodes(EXAMPLE / "human"),
                                       _episodes(EXAMPLE / "model_draft"))


def test_the_list_format_is_read_leniently() -> None:
    report = """Prose first.

## Claims:
```
- `speech_words_mean`: higher (speeches run long)
* Scenes per episode: LOWER
1. dialogue_share : similar.
```
"""
    claims = read_claims(report)
    assert claims.found and claims.malformed == ()
    assert [(c.statistic, c.direction, c.line) for c in claims.claims] == [
        ("speech_words_mean", "higher", 5), ("scenes_per_episode", "lower", 6),
        ("dialogue_share", "similar", 7)]


def test_every_claims_section_is_read_and_each_ends_at_a_heading_of_its_level() -> None:
    report = ("## Claims\n- speech_words_mean: lower\n\n# Claims\n- scenes_per_episode: lower\n"
              "\n# Afterword\n- dialogue_share: higher\n")
    assert [c.statistic for c in read_claims(report).claims] == [
        "speech_words_mean", "scenes_per_episode"]


def test_a_report_without_the_list_is_not_checked(stats: tuple) -> None:
    check = check_report("Scenes run long. Speeches are short.", *stats)
    assert check.status == "not_checked" and check.verdicts == ()
    assert check.contradicted_share is None and not check.too_contradicted(0.0)
    assert check.event_fields()["claims_status"] == "not_checked"


def test_a_malformed_list_is_reported_never_a_crash(stats: tuple) -> None:
    report = ("Text.\n\n## Claims\n\nspeech_words_mean: not higher\n"
              "scenes_per_episode: similar or lower\n: higher\n- speech_words_mean: higher\n")
    check = check_report(report, *stats)
    assert check.status == "checked" and check.counts["confirmed"] == 1
    assert [n for n, _ in check.malformed] == [5, 6, 7]
    assert "higher, lower or similar" in check.malformed[1][1]
    empty = check_report("Text.\n\n## Claims\n\n## Next\n", *stats)
    assert empty.status == "malformed" and empty.malformed
    for junk in ("## Claims\n\x00\x01:::\n", "## Claims\n" + "a: " * 10_000, "#" * 7 + " Claims"):
        check_report(junk, *stats)  # no exception


def test_each_claim_gets_its_verdict_with_both_numbers(stats: tuple) -> None:
    human, model = stats
    report = ("## Claims\n- speech_words_mean: lower\n- scenes_per_episode: lower\n"
              "- words_per_episode: similar\n- dialogue_share: similar\n"
              "- plot_quality: higher\n")
    check = check_report(report, human, model)
    by = {v.statistic: v for v in check.verdicts}
    assert by["speech_words_mean"].verdict == "contradicted"
    assert by["speech_words_mean"].human == pytest.approx(human.speech_words_mean)
    assert by["speech_words_mean"].model == pytest.approx(model.speech_words_mean)
    assert by["speech_words_mean"].measured == "higher"
    assert by["scenes_per_episode"].verdict == "confirmed"
    assert by["words_per_episode"].verdict == "confirmed"
    assert by["dialogue_share"].verdict == "contradicted"
    assert by["plot_quality"].verdict == "not_checkable"
    assert check.counts == {"confirmed": 2, "contradicted": 2, "not_checkable": 1}
    assert check.contradicted_share == 0.5
    assert not check.too_contradicted(0.5) and check.too_contradicted(0.49)
    side = check.sidecar_fields("annotate")["claims"]
    assert side["tolerance"] == {"direction": 0.05, "similar": 0.15}
    assert {"statistic": "speech_words_mean", "claimed": "lower", "verdict": "contradicted",
            "measured": "higher"}.items() <= side["verdicts"][0].items()


def test_the_tolerances_are_the_stated_ones(stats: tuple) -> None:
    human, _ = stats
    metric = craft_report.METRICS[0]  # scene_words_mean, floor 10
    h = human.scene_words_mean + metric.floor

    def at(g: float) -> craft_claims.ScreenplayStats:
        from dataclasses import replace
        return replace(human, scene_words_mean=h * math.exp(g) - metric.floor)

    def verdict(direction: str, g: float) -> str:
        return check_report(f"## Claims\n- scene_words_mean: {direction}", human,
                            at(g)).verdicts[0].verdict

    assert verdict("higher", -0.04) == "confirmed" and verdict("higher", -0.06) == "contradicted"
    assert verdict("lower", 0.04) == "confirmed" and verdict("lower", 0.06) == "contradicted"
    assert verdict("similar", 0.14) == "confirmed" and verdict("similar", -0.16) == "contradicted"


def test_a_statistic_one_side_lacks_is_not_checkable(stats: tuple) -> None:
    human, _ = stats
    model = craft_distance.measure_pair({1: "INT. ROOM - DAY\n\nRain on glass."},
                                        {1: "INT. ROOM - DAY\n\nRain."})[1]
    (v,) = check_report("## Claims\n- speech_words_mean: higher", human, model).verdicts
    assert v.verdict == "not_checkable" and v.model is None


def test_the_annotation_states_the_measured_facts(stats: tuple) -> None:
    check = check_report("## Claims\n- speech_words_mean: lower\n", *stats)
    text = craft_claims.annotation(check.contradicted)
    assert "`speech_words_mean`" in text and "21.8" in text and "5.2" in text
    assert "higher than the human's" in text


def test_every_claim_of_the_built_in_reviewer_is_confirmed() -> None:
    # The example, and random ranges of random screenplay-shaped texts.
    human, model = _episodes(EXAMPLE / "human", 1, 6), _episodes(EXAMPLE / "model_draft", 1, 6)
    rng = random.Random(25)
    pairs = [(human, model)] + [
        ({n: human[n] for n in eps}, {n: model[n] for n in eps})
        for eps in ([rng.randint(1, 6)] for _ in range(20))]
    for h, m in pairs:
        report = craft_report.build_report(h, m)
        check = check_report(report, *craft_distance.measure_pair(h, m))
        assert check.status == "checked" and check.malformed == ()
        assert check.counts["contradicted"] == 0 and check.counts["not_checkable"] == 0
        assert check.counts["confirmed"] == len(craft_claims.grounded_claims(
            *craft_distance.measure_pair(h, m))) >= 10


def test_facts_tables_hold_numbers_and_names_only(stats: tuple) -> None:
    table = craft_claims.facts_table(stats[0])
    assert table.count("\n") == len(craft_report.METRICS) + 1
    assert "MARTA" not in table  # the top speaker's name is not a statistic


# ------------------------------------------------------------ visible (events in, text out)

CHECKED = {"claims_status": "checked", "claims_confirmed": 5, "claims_contradicted": 1,
           "claims_not_checkable": 2, "claims_malformed": 0, "claims_contradicted_share": 0.1667}


def test_prometheus_counts_claims_by_verdict_and_unchecked_reports() -> None:
    from prometheus_client import generate_latest

    from skilltrain.daemon.service.metrics import Metrics

    metrics = Metrics(lambda: {}, ["done"])
    metrics.observe("loss.completed", CHECKED)
    metrics.observe("loss.completed", {"claims_status": "not_checked", "claims_confirmed": 0,
                                       "claims_contradicted": 0, "claims_not_checkable": 0})
    metrics.observe("loss.contradicted", {**CHECKED, "claims_confirmed": 0})
    metrics.observe("step.reported", {"run": "r1", "claims_contradicted_share": 0.25})
    text = generate_latest(metrics.registry).decode()
    assert 'skilltrain_claims_total{verdict="confirmed"} 5.0' in text
    assert 'skilltrain_claims_total{verdict="contradicted"} 2.0' in text
    assert 'skilltrain_claims_total{verdict="not_checkable"} 4.0' in text
    assert 'skilltrain_reports_claims_unchecked_total{status="not_checked"} 1.0' in text
    assert 'skilltrain_set_failures_total{kind="contradicted"} 1.0' in text
    assert 'skilltrain_claims_contradicted_share{run="r1"} 0.25' in text


def test_tail_shows_the_claims_of_each_report_and_the_share_of_each_step() -> None:
    from skilltrain.daemon.commands.tail_format import format_event

    base = {"timestamp": "2026-05-04T09:12:03.120431Z", "level": "info", "run": "r1",
            "epoch": 0, "step": 0, "work": "example", "range": "01-03"}
    line = format_event({**base, "event": "loss.completed", "tokens_in": 1, **CHECKED})
    assert "claims=5ok/1contradicted/2unknown" in line
    line = format_event({**base, "event": "loss.completed", "claims_status": "not_checked"})
    assert "claims=not-checked" in line
    line = format_event({**base, "event": "loss.contradicted", "reason": "x", "attempts": 1,
                         "next_retry_s": 60.0, **CHECKED})
    assert "claims=5ok/1contradicted" in line and "retry in" in line
    line = format_event({**base, "event": "step.reported", "sets": 2, "craft_distance": 0.3,
                         "craft_distance_change": None, "claims_contradicted_share": 0.25})
    assert "distance=0.3000" in line and "contradicted=25%" in line


def test_progress_pools_the_steps_checked_claims() -> None:
    from skilltrain.daemon.service import curve

    sidecars = [{"claims": {"status": "checked", "confirmed": 3, "contradicted": 1}},
                {"claims": {"status": "checked", "confirmed": 4, "contradicted": 0}},
                {"claims": {"status": "not_checked", "confirmed": 0, "contradicted": 0}},
                {"craft_distance": 0.2}]  # a sidecar of a daemon from before claims
    row = curve.summarize("r1", 0, 0, sidecars, None)
    assert row.claims_contradicted_share == 0.125 and row.claims_unchecked == 1
    assert curve.summarize("r1", 0, 1, [{}], None).claims_contradicted_share is None


def test_a_claim_line_keeps_no_more_than_a_statistic_name(stats: tuple) -> None:
    # Issue 34: the parser stripped backticks and stars after the guard had
    # read the line split at them, and saved the rejoined line, a quote, as
    # the statistic. Now a name is read as the guard reads it and kept only
    # as a key of the facts table or a name of a few words.
    quote = "He grab`bed it before the ring ev`en hit the wa*ter, and Walter laughed"
    report = (f"## Claims\n- {quote}: higher\n- spee`ch_wo*rds_mean: lower\n"
              "- **Scenes per episode**: similar\n- plot_quality: higher\n")
    check = check_report(report, *stats)
    assert [v.statistic for v in check.verdicts] == [
        "speech_words_mean", "scenes_per_episode", "plot_quality"]
    assert [n for n, _ in check.malformed] == [2]
    dumped = json.dumps(check.sidecar_fields("annotate"))
    for word in ("grab", "ring", "water", "Walter", "laughed"):
        assert word not in dumped


# ------------------------------------- a list of wrong claims is seen however it is written

FLIP = {"higher": "lower", "lower": "higher", "similar": "higher"}
PLAIN = "- {s}: {d}"
# How reviewers write "statistic: direction" that the first-word parser read
# as malformed, so that a list of wrong claims counted no contradiction.
WRITTEN = {
    "much": "- {s}: much {d}",
    "slightly": "- {s}: slightly {d}",
    "a bit": "- {s}: a bit {d}",
    "model": "- {s}: model {d}",
    "the model's is": "- {s}: the model's is {d}",
    "is": "- {s} is {d}",
    "em dash": "- {s} \u2014 {d}",
    "em dash unspaced": "- {s}\u2014{d}",
    "en dash": "- {s} \u2013 {d}",
    "hyphen": "- {s} - {d}",
    "equals": "- {s} = {d}",
    "table row": "| {s} | {d} |",
    # Read as malformed by 14f779d: "original"/"human" before the direction,
    # a denied or a parenthesised second direction.
    "compared with the original": "- {s}: compared with the original, {d}",
    "against the human's": "- {s}: against the human's, {d}",
    "the human's is (inverse)": "- {s}: the human's is {inverse}",
    "human (inverse)": "- {s}: human {inverse}",
    "a denied second direction": "- {s}: {d}, not {other}",
    "a parenthesised second direction": "- {s}: {d} ({other}?)",
}
INVERSE = {"higher": "lower", "lower": "higher", "similar": "similar"}


def _truth(stats: tuple) -> list[tuple[str, str]]:
    return craft_claims.grounded_claims(*stats)


def _wrong(stats: tuple) -> list[tuple[str, str]]:
    return [(s, FLIP[d]) for s, d in _truth(stats)]


def _claims_section(form: str, pairs: list[tuple[str, str]]) -> str:
    header = "| statistic | direction |\n|---|:---:|\n" if form.startswith("|") else ""
    return f"## Claims\n\n{header}" + "".join(
        form.format(s=s, d=d, inverse=INVERSE.get(d), other=FLIP.get(d)) + "\n"
        for s, d in pairs)


def _verdicts(check: craft_claims.ClaimCheck) -> list[tuple[str, str, str]]:
    return [(v.statistic, v.claimed, v.verdict) for v in check.verdicts]


@pytest.mark.parametrize("form", WRITTEN.values(), ids=WRITTEN.keys())
def test_a_wrong_list_is_contradicted_however_it_is_written(stats: tuple, form: str) -> None:
    plain = check_report(f"Prose.\n\n{_claims_section(PLAIN, _wrong(stats))}", *stats)
    check = check_report(f"Prose.\n\n{_claims_section(form, _wrong(stats))}", *stats)
    assert check.malformed == () and _verdicts(check) == _verdicts(plain)
    assert check.counts["contradicted"] >= 10
    assert check.too_contradicted(craft_claims.REFUSE_SHARE)


@pytest.mark.parametrize("wrong_first", [True, False], ids=["wrong-then-right", "right-then-wrong"])
def test_no_claims_section_hides_the_wrong_claims_of_another(stats: tuple,
                                                             wrong_first: bool) -> None:
    wrong = _claims_section(PLAIN, _wrong(stats))
    true = ("dialogue_share", dict(_truth(stats))["dialogue_share"])
    right = _claims_section(PLAIN, [true])
    sections = [wrong, right] if wrong_first else [right, wrong]
    check = check_report("Prose.\n\n" + "\n".join(sections), *stats)
    confirmed = [(*true, "confirmed")]
    alone = _verdicts(check_report(wrong, *stats))
    assert _verdicts(check) == (alone + confirmed if wrong_first else confirmed + alone)
    assert check.counts["contradicted"] >= 10
    assert check.too_contradicted(craft_claims.REFUSE_SHARE)


@pytest.mark.parametrize("value", ["similar or higher", "higher; the draft said lower",
                                   "not higher", "isn't much lower", "neither higher nor lower",
                                   "not higher (lower)"])
def test_a_value_with_two_directions_or_only_a_denied_one_is_malformed(value: str) -> None:
    claims = read_claims(f"## Claims\n- speech_words_mean: {value}\n")
    assert claims.claims == () and [n for n, _ in claims.malformed] == [2]


READ_AS = {  # value -> the model's direction
    "similar (slightly higher)": "similar",
    "lower (the human's count is higher)": "lower",
    "21.8 against 5.2 (higher)": "higher",
    "higher, not lower as the draft suggests": "higher",
    "not lower but higher": "higher",
    "compared with the human original, higher": "higher",
    "compared with the human original higher": "higher",
    "higher than the human's": "higher",
    "the model's is higher than the original": "higher",
    "the human's is higher": "lower",
    "the original's is higher": "lower",
    "human higher": "lower",
    "the human's is much lower": "higher",
    "human 5.2, model 21.8: higher": "higher",
    # The human's side in another clause, or as what the model is compared with
    # (each was read the other way round: a wrong claim so written was confirmed).
    "lower while the original leans on action lines": "lower",
    "higher whereas the human script stays terse": "higher",
    "higher and the original is terse": "higher",
    "the model outpaces the human original (higher)": "higher",
    "above the human's (higher)": "higher",
    "similar to the original": "similar",
    "while the original's is lower, the model's is higher": "higher",
    "for the human it is lower": "higher",
    "higher overall in the original": "lower",
    "lower but only for the human": "higher",
    "higher and notably so in the original": "lower",
    "higher, where the original is lower": "higher",
    "matches the original (similar)": "similar",
    # "more", "less", "fewer" of a count, or alone; more of the size words.
    "more scenes than the original": "higher",
    "much less": "lower",
    "greater than the human's": "higher",
    "smaller": "lower",
}


@pytest.mark.parametrize(("value", "direction"), READ_AS.items(), ids=READ_AS.keys())
def test_the_direction_is_the_models_one_claimed(value: str, direction: str) -> None:
    # A parenthesis is commentary, a denied direction is not the claim, and a
    # direction said of the human's is the model's inverted: read and checked.
    (claim,) = read_claims(f"## Claims\n- speech_words_mean: {value}\n").claims
    assert claim.direction == direction


# Honest lists (every readable claim confirmed) that 14f779d refused in refuse
# mode and annotated "could not be checked": none is flagged in either mode.
HONEST = {
    "next steps with a colon after the list": (
        "- speech_words_mean: higher\n- scenes_per_episode: lower\n\n**Next steps**\n"
        "- Pacing: tighten act two.\n- Dialogue: let a look carry it.\n"
        "- Endings: leave the scene early.\n", 2),
    "prose bullets after the list": (
        "- speech_words_mean: higher\n- scenes_per_episode: lower\n\n**Next steps**\n"
        "- Cut speeches to a line or two.\n- Break long scenes in two.\n"
        "- Keep the episode length.\n", 2),
    "a direction in a parenthesis": (
        "- speech_words_mean: higher\n- words_per_episode: similar (slightly higher)\n"
        "- scenes_per_episode: lower (the human's count is higher)\n", 3),
    "a denied direction": (
        "- speech_words_mean: higher, not lower as the draft suggests\n"
        "- scenes_per_episode: lower, not similar\n- words_per_episode: similar\n", 3),
    "compared with the human's first": (
        "- speech_words_mean: compared with the human original, higher\n"
        "- scenes_per_episode: against the original, lower\n- words_per_episode: similar\n", 3),
    "claims under sub-headings": (
        "### Dialogue\n- speech_words_mean: higher\n### Scenes\n- scenes_per_episode: lower\n"
        "- words_per_episode: similar\n", 3),
}


@pytest.mark.parametrize(("body", "confirmed"), HONEST.values(), ids=HONEST.keys())
def test_an_honest_list_is_not_flagged_however_it_is_written(
        stats: tuple, body: str, confirmed: int) -> None:
    check = check_report(f"Prose.\n\n## Claims\n\n{body}\n## Afterword\n\nMore.\n", *stats)
    assert check.malformed == () and check.counts["confirmed"] == confirmed
    assert check.contradicted == ()  # annotate mode: nothing appended
    assert not check.too_contradicted(craft_claims.REFUSE_SHARE)  # refuse mode: written


@pytest.mark.parametrize("value", ["here the human's is higher", "higher the original",
                                   "then the original's is higher",
                                   # a manner, not a number: often the opposite
                                   "more clipped than the human's", "more sparing",
                                   "more evenly spread across the cast",
                                   # negations as contractions
                                   "the model's speeches don't run longer",
                                   "the model didn't use fewer scenes", "hardly higher"])
def test_a_direction_beside_the_human_side_in_no_known_role_is_malformed(value: str) -> None:
    # Neither its subject nor what the model is measured against: read either
    # way, a wrong claim could be confirmed; unreadable, the report says so.
    claims = read_claims(f"## Claims\n- speech_words_mean: {value}\n")
    assert claims.claims == () and [n for n, _ in claims.malformed] == [2]


def test_the_human_side_in_the_name_is_read_or_the_line_is_malformed() -> None:
    claims = read_claims("## Claims\n- speech_words_mean of the original: lower\n"
                         "- Then the original's scenes_per_episode: lower\n")
    assert [(c.statistic, c.direction) for c in claims.claims] == [
        ("speech_words_mean", "higher")]
    assert [n for n, _ in claims.malformed] == [3]


def test_a_wrong_claim_beside_a_clause_on_the_original_is_contradicted(stats: tuple) -> None:
    truth = dict(_truth(stats))
    wrong = [f"- {s}: {FLIP[truth[s]]} while the original leans on action lines"
             for s in ("speech_words_mean", "scenes_per_episode")]
    check = check_report("## Claims\n" + "\n".join(wrong) + "\n", *stats)
    assert check.counts["contradicted"] == 2 and check.counts["confirmed"] == 0


def test_wrong_claims_said_against_the_original_are_contradicted(stats: tuple) -> None:
    # Three right claims and two wrong ones "compared with the original":
    # 14f779d set the two aside as malformed, and annotated nothing.
    truth = dict(_truth(stats))
    right = [f"- {s}: {truth[s]}" for s in ("scene_words_mean", "dialogue_share",
                                            "words_per_episode")]
    wrong = [f"- {s}: compared with the original, {FLIP[truth[s]]}"
             for s in ("speech_words_mean", "scenes_per_episode")]
    check = check_report("## Claims\n" + "\n".join(right + wrong) + "\n", *stats)
    assert check.malformed == () and check.counts == {
        "confirmed": 3, "contradicted": 2, "not_checkable": 0}
    assert [v.statistic for v in check.contradicted] == ["speech_words_mean",
                                                          "scenes_per_episode"]
    assert "`scenes_per_episode`" in craft_claims.annotation(check.contradicted)
    assert check.too_contradicted(0.3) and not check.too_contradicted(0.5)


def test_an_honest_list_with_qualifiers_is_not_flagged(stats: tuple) -> None:
    # The model's speeches are much longer (21.8 words against 5.2): saying so is right.
    qualified = {"higher": "much higher", "lower": "the model's is a bit lower",
                 "similar": "roughly similar (model against human)"}
    report = "Prose.\n\n" + _claims_section("- {s}: {d}", [(s, qualified[d])
                                                         for s, d in _truth(stats)])
    check = check_report(report, *stats)
    assert "- speech_words_mean: much higher" in report
    assert check.malformed == () and check.counts["confirmed"] == len(_truth(stats)) >= 10
    assert check.counts["contradicted"] == 0 and check.contradicted == ()
    assert not check.too_contradicted(0.0)


UNREADABLE = {
    "prose": ("The model's speeches run long.\nIts scenes are fewer.\nDialogue is about even.\n",
              3, 3),
    "empty": ("", 1, 1),
    # "speeches run long" names no statistic: prose beside the claims, passed over.
    "two of three": ("speeches run long\nscenes_per_episode: higher or lower\n: higher\n"
                     "- speech_words_mean: higher\n", 2, 3),
}


@pytest.mark.parametrize(("body", "malformed", "lines"), UNREADABLE.values(),
                         ids=UNREADABLE.keys())
def test_a_mostly_unreadable_list_is_seen_like_a_contradiction(
        stats: tuple, body: str, malformed: int, lines: int) -> None:
    # Unreadable claims count for nothing; a list that is mostly them would
    # let a wrong report pass as clean, so the list itself is what is seen.
    check = check_report(f"Prose.\n\n## Claims\n\n{body}\n## Afterword\n", *stats)
    assert check.mostly_unreadable and check.counts["contradicted"] == 0
    assert craft_claims.Unreadable(malformed=malformed, lines=lines) in check.contradicted
    assert check.too_contradicted(craft_claims.REFUSE_SHARE)
    text = craft_claims.annotation(check.contradicted)
    assert (f"{malformed} of {lines} claims above could not be checked against the "
            "measurements") in text


def test_a_list_mostly_read_and_a_report_without_one_are_not_flagged(stats: tuple) -> None:
    half = check_report("## Claims\n\nspeeches are long\n- speech_words_mean: higher\n", *stats)
    assert not half.mostly_unreadable and half.contradicted == ()
    assert not half.too_contradicted(0.0)
    none = check_report("Scenes run long. Speeches are short.", *stats)
    assert none.contradicted == () and not none.too_contradicted(0.0)


# ------------------------------------------------ through the loss step (a scripted reply)


def _loss_step(job: Any, reply: str, on_contradiction: str) -> Any:
    """The real loss step (template, guard, claims check, sealed write) with
    `reply` for the reviewer's completion."""
    from skilltrain.daemon.core.config import LLMConfig
    from skilltrain.daemon.core.templates import PromptTemplates
    from skilltrain.daemon.infra import llm
    from skilltrain.handlers import loss

    def reviewer(messages: object, settings: object, **_: object) -> llm.Completion:
        return llm.Completion(text=reply, finish_reason="stop", tokens_in=1, tokens_out=1,
                              tokens_cached=0, cost_usd=None, attempts=1)

    return loss.run(job, settings=LLMConfig(model="openai/loopback-model",
                                            api_base="http://127.0.0.1:9"),
                    templates=PromptTemplates(EXAMPLE.parent.parent / "prompts"),
                    on_contradiction=on_contradiction, complete=reviewer)


def test_the_loss_step_refuses_a_wrong_list_written_with_qualifiers(
        example_loss_job: Any, stats: tuple) -> None:
    from skilltrain.daemon.core.errors import ContradictedReportError

    reply = "Speeches differ.\n\n" + _claims_section(WRITTEN["much"], _wrong(stats))
    with pytest.raises(ContradictedReportError):
        _loss_step(example_loss_job, reply, "refuse")
    assert not example_loss_job.report_path.exists()


def test_the_loss_step_annotates_a_list_it_cannot_read(example_loss_job: Any) -> None:
    reply = "Speeches differ.\n\n## Claims\n\nThe speeches run long.\nThe scenes are fewer.\n"
    result = _loss_step(example_loss_job, reply, "annotate")
    written = example_loss_job.report_path.read_text(encoding="utf-8")
    assert "## Measured facts" in written
    assert "2 of 2 claims above could not be checked against the measurements" in written
    assert result.sidecar["claims"]["malformed"] == 2


def test_the_loss_step_writes_an_honest_list_with_next_steps_as_is(example_loss_job: Any) -> None:
    # Refused by 14f779d: the bullets under "**Next steps**" counted as unreadable claims.
    reply = ("Speeches differ.\n\n## Claims\n\n- speech_words_mean: higher\n"
             "- scenes_per_episode: lower\n\n**Next steps**\n\n- Cut speeches to a line.\n"
             "- Break long scenes in two.\n- Keep the episode length.\n")
    result = _loss_step(example_loss_job, reply, "refuse")
    written = example_loss_job.report_path.read_text(encoding="utf-8")
    assert "## Measured facts" not in written and "Keep the episode length." in written
    assert result.sidecar["claims"]["malformed"] == 0
    assert result.sidecar["claims"]["confirmed"] == 2


# ------------------------- how reviewers write an honest list, a wrong one, a label (review 2)

# Honest lists of the example (speeches longer, scenes fewer, episodes similar)
# that the parser before this change flagged, or refused in refuse mode.
HONEST_AS_WRITTEN = {
    # 1a: a prose bullet naming a statistic, with no separator and direction, is prose.
    "next steps naming statistics": (
        "- speech_words_mean: higher\n- scenes_per_episode: lower\n\n**Next steps**\n"
        "- Bring speech_words_mean down by cutting speeches.\n"
        "- Raise scenes_per_episode: break long scenes.\n"
        "- Keep words_per_episode where it is.\n"),
    # 1b: a parenthesis on the name side, the statistic anywhere in the name.
    "numbers in a parenthesis": (
        "- `speech_words_mean` (12.1 vs 8.3): higher\n- `scenes_per_episode` (5 vs 9): lower\n"
        "- `words_per_episode` (700 vs 690): similar\n"),
    "a label in a parenthesis": (
        "- speech_words_mean (words per speech): higher\n"
        "- scenes_per_episode (scenes per episode): lower\n"
        "- words_per_episode (episode length): similar\n"),
    "the model's statistic is": (
        "- The model's speech_words_mean is higher\n- The model's scenes_per_episode is lower\n"
        "- words_per_episode: similar\n"),
    # 1c: the prompt's own words for a direction.
    "longer, fewer, about the same": (
        "- speech_words_mean: longer\n- scenes_per_episode: fewer\n"
        "- words_per_episode: about the same\n"),
    "more, shorter, the same, equal": (
        "- speech_words_mean: more\n- scenes_per_episode: shorter\n"
        "- words_per_episode: the same\n- scene_words_cv: equal\n"),
    # 1d: the human's side after the direction, or as a label before it.
    "lower for the human": (
        "- speech_words_mean: lower for the human\n"
        "- scenes_per_episode: higher in the original\n- words_per_episode: similar\n"),
    "human: lower": (
        "- speech_words_mean: human: lower\n- scenes_per_episode: original: higher\n"
        "- words_per_episode: similar\n"),
    "the human's statistic is": (
        "- The human's speech_words_mean is lower\n- scenes_per_episode: higher for the human, "
        "lower for the model\n- words_per_episode: similar\n"),
    # 3: a label without its note or its part after a comma.
    "short labels": (
        "- Words per speech: higher\n- Scene length: higher\n- Speaking characters: lower\n"
        "- Episode length: similar\n"),
}


@pytest.mark.parametrize("body", HONEST_AS_WRITTEN.values(), ids=HONEST_AS_WRITTEN.keys())
def test_an_honest_list_as_reviewers_write_it_is_read_and_confirmed(
        stats: tuple, body: str) -> None:
    claims = body.split("**Next steps**")[0].count("\n- ") + body.startswith("- ")
    check = check_report(f"Prose.\n\n## Claims\n\n{body}\n## Afterword\n\nMore.\n", *stats)
    assert check.malformed == () and check.counts["not_checkable"] == 0
    assert check.counts["confirmed"] == claims and check.contradicted == ()
    assert not check.too_contradicted(craft_claims.REFUSE_SHARE)


@pytest.mark.parametrize("value", ["higher than in the original", "higher than the human",
                                   "higher for the model, lower for the human",
                                   "not lower for the model, but higher"])
def test_the_human_after_a_direction_inverts_it_only_as_its_subject(value: str) -> None:
    (claim,) = read_claims(f"## Claims\n- speech_words_mean: {value}\n").claims
    assert claim.direction == "higher"


def test_a_synonym_names_a_direction_only_for_a_statistic_of_the_table() -> None:
    # "Its scenes are fewer" is prose that tries to be a claim, not a claim about
    # a statistic called "its scenes": a list of such lines stays unreadable.
    claims = read_claims("## Claims\nIts scenes are fewer.\nplot_quality: higher\n")
    assert [(c.statistic, c.direction) for c in claims.claims] == [("plot_quality", "higher")]
    assert [n for n, _ in claims.malformed] == [2]


HEADINGS = {
    "with a note": "## Claims (model vs. human)",
    "numbered": "## 5. Claims",
    "qualified": "## Measurable claims",
    "bold line": "**Claims**",
    "bold line with a colon": "**Claims:**",
}


@pytest.mark.parametrize("heading", HEADINGS.values(), ids=HEADINGS.keys())
def test_a_wrong_list_under_any_claims_heading_is_contradicted(
        stats: tuple, heading: str) -> None:
    body = "".join(f"- {s}: {d}\n" for s, d in _wrong(stats))
    check = check_report(f"Report.\n\n{heading}\n\n{body}\n## Afterword\n\n- dialogue_share: "
                         "lower\n", *stats)
    assert check.status == "checked" and check.counts["contradicted"] >= 10
    assert len(check.verdicts) == len(_wrong(stats))  # the Afterword is not read
    assert check.too_contradicted(craft_claims.REFUSE_SHARE)


def test_a_bold_claims_line_ends_at_the_next_bold_line_and_is_prose_in_a_section() -> None:
    report = ("**Claims**\n- speech_words_mean: higher\n**Next steps**\n"
              "- dialogue_share: lower\n\n## Claims\n- scenes_per_episode: lower\n"
              "**Claims**\n- words_per_episode: similar\n")
    assert [c.statistic for c in read_claims(report).claims] == [
        "speech_words_mean", "scenes_per_episode", "words_per_episode"]
    # A heading that starts or ends with "Claims" heads a list, whatever else it says:
    # a list of wrong claims must not pass by its heading's wording.
    assert read_claims("## Claims about pacing\n- speech_words_mean: higher\n").found


NEAR_NAMES = {  # a shortened label -> its statistic
    "Words per speech": "speech_words_mean",
    "Scene length": "scene_words_mean",
    "Scene length spread": "scene_words_cv",
    "Episode length": "words_per_episode",
    "Action paragraph": "action_block_words_mean",
    "Longest speech": "longest_speech_words",
}


@pytest.mark.parametrize(("name", "key"), NEAR_NAMES.items(), ids=NEAR_NAMES.keys())
def test_a_label_is_read_without_its_note_or_its_part_after_a_comma(name: str, key: str) -> None:
    (claim,) = read_claims(f"## Claims\n- {name}: lower\n").claims
    assert claim.statistic == key


# Wrong claims in layouts reviewers use that were passed over as prose, read
# from the wrong cell, or hidden by the heading: each is now contradicted, or
# unreadable and annotated; none is confirmed (a helper's adversarial review).
WRONG_LAYOUTS = {
    "a numbered table": "## Claims\n\n| # | Statistic | Direction |\n|---|---|---|\n"
                        "| 1 | {a} | {fa} |\n| 2 | {b} | {fb} |\n",
    "a category column": "## Claims\n\n| Area | Statistic | Model vs human |\n|---|---|---|\n"
                         "| Dialogue | {a} | {fa} |\n| Structure | {b} | {fb} |\n",
    "arrows": "## Claims\n\n- {a} → {fa}\n- {b} ⟶ {fb}\n",
    "no separator": "## Claims\n\n- words_per_episode: similar\n- {a} was {fa}\n- {b} {fb}\n",
    "grouped by direction": "## Claims\n\n- words_per_episode: similar\n- {FA}: {a}\n"
                            "- {FB}: {b}\n",
    "an emoji heading": "## 📊 Claims\n\n- {a}: {fa}\n- {b}: {fb}\n",
    "a heading of five words": "## Claims about the measured craft statistics\n\n"
                               "- {a}: {fa}\n- {b}: {fb}\n",
    "a plain Claims: line": "Claims:\n- {a}: {fa}\n- {b}: {fb}\n",
    "a comment in a fence": "## Claims\n\n```yaml\nwords_per_episode: similar\n# dialogue\n"
                            "{a}: {fa}\n{b}: {fb}\n```\n",
}


@pytest.mark.parametrize("layout", WRONG_LAYOUTS.values(), ids=WRONG_LAYOUTS.keys())
def test_wrong_claims_in_any_layout_are_never_confirmed_unseen(stats: tuple, layout: str) -> None:
    truth = dict(_truth(stats))
    a, b = "speech_words_mean", "scenes_per_episode"
    fa, fb = FLIP[truth[a]], FLIP[truth[b]]
    report = layout.format(a=a, b=b, fa=fa, fb=fb, FA=fa.capitalize(), FB=fb.capitalize())
    check = check_report(report, *stats)
    assert not [v for v in check.verdicts if v.statistic in (a, b) and v.verdict == "confirmed"]
    assert check.contradicted  # annotated: contradicted, or unreadable lines said so
    assert len(check.contradicted) + len(check.malformed) >= 2 or any(
        isinstance(u, craft_claims.Unreadable) for u in check.contradicted)


def test_the_reference_or_the_source_is_the_human_side() -> None:
    claims = read_claims("## Claims\n- speech_words_mean: the source screenplay's is higher\n"
                         "- scenes_per_episode: the reference has fewer\n")
    assert [c.direction for c in claims.claims] == ["lower", "higher"]


# Honest lines that the readings above first made malformed or misread (a
# helper's corpus of 208 honest lines: 35 worse, then 2, both by design: "the
# human version cuts more often" says a manner, not a number).
HONEST_LINES = [
    "- `dialogue_share`: higher — the draft is far more talky",
    "- `speech_words_mean`: higher — the model's speeches are more expansive",
    "- `question_share`: higher — characters ask questions more often",
    "- `scenes_per_episode`: lower — fewer but bigger scenes",
    "- `speaking_characters`: lower — fewer speaking roles than the original",
    "- `scenes_per_episode`: lower; the model prefers larger set pieces",
    "- `dialogue_share`: higher — action gets a smaller slice",
    "- `speech_words_mean`: higher per the source table",
    "- `speech_words_mean`, human vs model: lower",
    "- `speech_words_mean` was higher",
    "- `speech_words_mean` ↑ (higher)",
    "- **Higher:** `speech_words_mean`",
    "- `dialogue_share`: 52% vs 23% in the original (higher)",
    "| `speaking_characters` | 7 | 4 | lower — fewer speaking roles |",
    "| `dialogue_share` | 23% | 52% | higher | The draft is far more talky |",
]


@pytest.mark.parametrize("line", HONEST_LINES)
def test_an_honest_line_is_read_and_confirmed(stats: tuple, line: str) -> None:
    header = "| statistic | human | model | direction |\n|---|---|---|---|\n" \
        if line.startswith("|") else ""
    check = check_report(f"## Claims\n\n{header}{line}\n", *stats)
    assert check.malformed == () and check.counts["confirmed"] == 1, check
    assert check.contradicted == ()


def test_prose_under_a_heading_about_the_claims_is_not_a_claim(stats: tuple) -> None:
    report = ("## Claims\n\n- speech_words_mean: higher\n\n## Notes on the claims\n\n"
              "- Three episodes is a small sample.\n\n## Why these claims matter\n\n"
              "Long speeches slow the pace.\n")
    check = check_report(report, *stats)
    assert check.malformed == () and check.contradicted == ()
    assert check.counts["confirmed"] == 1


def test_a_direction_grouping_several_statistics_is_one_claim_each(stats: tuple) -> None:
    truth = dict(_truth(stats))
    higher = [s for s, d in truth.items() if d == "higher"][:3]
    lower = [s for s, d in truth.items() if d == "lower"][:2]
    report = (f"## Claims\n\n**Higher in the model:** {', '.join(f'`{s}`' for s in higher)}\n"
              f"**Lower in the model:** {', '.join(f'`{s}`' for s in lower)}\n"
              f"- Higher: {lower[0]}\n")  # this one wrong
    check = check_report(report, *stats)
    assert check.malformed == () and check.counts == {
        "confirmed": len(higher) + len(lower), "contradicted": 1, "not_checkable": 0}
    assert [v.statistic for v in check.contradicted] == [lower[0]]
