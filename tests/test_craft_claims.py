"""craft_claims: a report's claims list read, checked against the measurements,
and the built-in reviewer's own list always confirmed (issue 25)."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

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


def test_only_the_last_claims_section_counts_and_it_ends_at_the_next_heading() -> None:
    report = ("## Claims\n- speech_words_mean: lower\n\n# Claims\n- scenes_per_episode: lower\n"
              "\n## Afterword\n- dialogue_share: higher\n")
    assert [c.statistic for c in read_claims(report).claims] == ["scenes_per_episode"]


def test_a_report_without_the_list_is_not_checked(stats: tuple) -> None:
    check = check_report("Scenes run long. Speeches are short.", *stats)
    assert check.status == "not_checked" and check.verdicts == ()
    assert check.contradicted_share is None and not check.too_contradicted(0.0)
    assert check.event_fields()["claims_status"] == "not_checked"


def test_a_malformed_list_is_reported_never_a_crash(stats: tuple) -> None:
    report = ("Text.\n\n## Claims\n\nspeech_words_mean higher\nscenes_per_episode: fewer\n"
              ": higher\n- speech_words_mean: higher\n")
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
