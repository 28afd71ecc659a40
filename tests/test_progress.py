"""Progress you can see: the craft distance, `skilltrain progress`, /metrics.

The distance is checked as a number (0 at a match, bounded shares, growing
with a gap) and end to end: a real daemon reports two steps of one run over
the loopback LLM server, the second written closer to the human craft, and
the events, sidecars, `progress --json` and a real HTTP scrape of /metrics
must all tell the same story.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from skilltrain.daemon.commands import tail_format
from skilltrain.daemon.reviewer import craft_distance, craft_measuring, craft_parsing
from tests.daemon_helpers import (
    InProcessDaemon,
    SetId,
    Workspace,
    build_workspace,
    mark_success,
    run_cli,
    run_once_in_process,
    screenplay,
    subprocess_env,
    wait_until,
)
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.llm_server import DEFAULT_REPORT, LLMServer, Reply, Request

pytestmark = DAEMON_TEST_MARKS


# ------------------------------------------------------------------- the number


def _episodes(seed: str, scenes: int, lines: int, *, model: bool) -> dict[int, str]:
    return {n: screenplay(f"{seed}/{n}", scenes, lines, model=model) for n in (1, 2, 3)}


HUMAN = _episodes("human", 3, 6, model=False)


def test_distance_is_zero_at_a_match_and_grows_with_every_gap() -> None:
    assert craft_distance.of_episodes(HUMAN, HUMAN).value == 0.0
    human = craft_measuring.measure([craft_parsing.parse_screenplay(t) for t in HUMAN.values()])
    assert human.scene_words_mean and human.speech_words_mean
    last = 0.0
    for factor in (1.1, 1.5, 2, 4, 16, 1000):
        longer = dataclasses.replace(human, scene_words_mean=human.scene_words_mean * factor)
        d = craft_distance.between(human, longer)
        assert last < d.value < craft_distance.SHARES["scene_words_mean"]  # bounded share
        assert d.value == d.parts["scene_words_mean"]
        # Too long weighs what too short weighs by the same factor (floor aside).
        shorter = dataclasses.replace(human, speech_words_mean=human.speech_words_mean / factor)
        assert craft_distance.between(human, shorter).value > 0
        last = d.value
    both = dataclasses.replace(longer, speech_words_mean=human.speech_words_mean * 2)
    assert craft_distance.between(human, both).value > last  # a second gap adds to the first
    assert set(both.__dict__) >= set(craft_distance.SHARES)
    assert abs(sum(craft_distance.SHARES.values()) - 1) < 1e-12
    far = craft_distance.of_episodes(HUMAN, _episodes("m", 1, 30, model=True))
    assert abs(sum(far.parts.values()) - far.value) < 1e-12
    assert all(0 <= far.parts[k] < craft_distance.SHARES[k] for k in far.parts)
    assert 0 < far.value < 1


def test_distance_is_scale_free_and_saturates_per_statistic() -> None:
    assert craft_distance.saturate(0) == 0
    assert craft_distance.saturate(craft_distance.HALF_AT) == pytest.approx(0.5)
    assert craft_distance.saturate(100) < 1
    # Both sides twice as long: the gaps keep their proportions, so does the distance.
    model = _episodes("m", 1, 12, model=True)
    twice_human = {n: text + "\n\n" + text for n, text in HUMAN.items()}
    twice_model = {n: text + "\n\n" + text for n, text in model.items()}
    once = craft_distance.of_episodes(HUMAN, model).value
    twice = craft_distance.of_episodes(twice_human, twice_model).value
    assert twice == pytest.approx(once, abs=0.02)
    assert once > 0.1


def test_a_statistic_one_side_lacks_counts_its_full_share() -> None:
    # Prose without a single cue: no speeches, so no words per speech at all.
    prose = {n: "INT. ROOM - DAY\n\nRain on the glass. Nobody speaks.\n" for n in HUMAN}
    d = craft_distance.of_episodes(HUMAN, prose)
    assert d.parts["speech_words_mean"] == pytest.approx(craft_distance.SHARES["speech_words_mean"])
    assert d.value < 1


# docs/craft-distance.md, "The statistics and their shares", as written there:
# (statistic, floor, weight). The spec, not the code's table: a SHARES that
# agrees with itself but not with this (all shares equal, every weight 1.0)
# must fail.
DOCUMENTED = [
    ("scene_words_mean", 10, 1.0),
    ("dialogue_share", 0.05, 1.0),
    ("speech_words_mean", 3, 1.0),
    ("scenes_per_episode", 1, 1.0),
    ("words_per_episode", 100, 1.0),
    ("parentheticals_per_100_speeches", 2, 0.9),
    ("question_share", 0.05, 0.9),
    ("action_block_words_mean", 3, 0.9),
    ("scene_words_cv", 0.1, 0.8),
    ("speaking_characters", 1, 0.8),
    ("top_speaker_share", 0.05, 0.8),
    ("longest_speech_words", 10, 0.7),
    ("exclamations_per_1k_words", 1, 0.6),
    ("transitions_per_episode", 1, 0.5),
]
DOCUMENTED_TOTAL = 11.9  # the sum of the documented weights


def _human_stats() -> craft_measuring.ScreenplayStats:
    """Measured human episodes, with a value for every statistic (none left out)."""
    stats = craft_measuring.measure([craft_parsing.parse_screenplay(t) for t in HUMAN.values()])
    missing = {key: 5.0 for key, _, _ in DOCUMENTED if getattr(stats, key) is None}
    return dataclasses.replace(stats, **missing)


def test_the_documented_statistics_are_the_measured_ones() -> None:
    assert sum(w for _, _, w in DOCUMENTED) == pytest.approx(DOCUMENTED_TOTAL)
    d = craft_distance.between(_human_stats(), _human_stats())
    assert sorted(d.parts) == sorted(key for key, _, _ in DOCUMENTED)


@pytest.mark.parametrize(("key", "floor", "weight"), DOCUMENTED)
def test_each_statistic_weighs_its_documented_share(key: str, floor: float,
                                                    weight: float) -> None:
    human = _human_stats()
    # Only this statistic missing on the model's side: its part is its full share.
    lacking = dataclasses.replace(human, **{key: None})
    d = craft_distance.between(human, lacking)
    assert d.value == pytest.approx(weight / DOCUMENTED_TOTAL, rel=1e-9)
    assert d.parts[key] == pytest.approx(weight / DOCUMENTED_TOTAL, rel=1e-9)
    # Off by a factor of 2 counted with its documented floor: half its share.
    h = getattr(human, key)
    assert h is not None
    doubled = dataclasses.replace(human, **{key: 2 * (h + floor) - floor})
    assert craft_distance.between(human, doubled).value == pytest.approx(
        weight / DOCUMENTED_TOTAL / 2, rel=1e-9)


def test_transitions_weigh_half_what_scene_length_weighs() -> None:
    human = _human_stats()
    transitions = craft_distance.between(
        human, dataclasses.replace(human, transitions_per_episode=None)).value
    scenes = craft_distance.between(
        human, dataclasses.replace(human, scene_words_mean=None)).value
    assert transitions == pytest.approx(0.5 / 11.9)
    assert scenes == pytest.approx(1 / 11.9)
    assert transitions / scenes == pytest.approx(0.5)


def test_the_step_before_is_the_last_reported_one_before_a_gap_and_an_epoch(
    tmp_path: Path,
) -> None:
    """step.reported's change is against the last reported step: the step just
    before when it is reported (one marker read), else the newest reported one."""
    from skilltrain.daemon.core import layout
    from skilltrain.daemon.service import curve

    reported = {(0, 0): True, (0, 1): True, (0, 2): False, (1, 0): True}
    for (epoch, step), done in reported.items():
        marker = layout.StepKey("r1", epoch, step).marker(tmp_path)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"reported_at": 1.0 if done else None}), encoding="utf-8")

    def before(epoch: int, step: int) -> tuple[int, int] | None:
        return curve._previous_reported(tmp_path, layout.StepKey("r1", epoch, step))

    assert before(0, 0) is None
    assert before(0, 1) == (0, 0)  # the step just before
    assert before(0, 3) == (0, 1)  # step 2 is not reported: the one before it
    assert before(1, 0) == (0, 1)  # across the epoch
    assert before(1, 1) == (1, 0)
    assert before(1, 5) == (1, 0)  # steps 1-4 have no marker at all


# ---------------------------------------------------------------- end to end


def _write_step(ws: Workspace, run: str, step: int, scenes: int, lines: int) -> list[SetId]:
    """Episodes whose craft proportions are set by scenes and lines per scene."""
    for work, count in ws.works.items():
        scripts = ws.scripts(run, 0, step, work)
        scripts.mkdir(parents=True, exist_ok=True)
        for ep in range(1, count + 1):
            text = screenplay(f"model/{run}/{step}/{work}/{ep}", scenes, lines, model=True)
            (scripts / f"ep{ep:02d}.txt").write_text(text, encoding="utf-8")
        mark_success(scripts)
    return ws.sets_of_step(run, 0, step)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(skilltrain_\w+(?:\{[^}]*\})?) (\S+)", line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


def test_a_step_closer_to_the_human_craft_has_a_smaller_distance(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 6})
    llm_server.default = lambda request: Reply.ok(DEFAULT_REPORT, cache_write_tokens=40)
    far = _write_step(ws, "r1", 0, scenes=1, lines=30)  # one long talky scene
    run_once_in_process(ws)
    near = _write_step(ws, "r1", 1, scenes=3, lines=6)  # the human proportions
    run_once_in_process(ws)

    steps = ws.events("step.reported", run="r1")
    assert [(e["step"], e["sets"]) for e in steps] == [(0, 2), (1, 2)]
    first, second = steps
    assert first["craft_distance_change"] is None
    assert 0 < second["craft_distance"] < first["craft_distance"] < 1
    assert second["craft_distance_change"] == pytest.approx(
        second["craft_distance"] - first["craft_distance"], abs=1e-6)

    # Each report's sidecar has its own number and its parts; the event has the mean.
    for sets, event in ((far, first), (near, second)):
        sidecars = [ws.read_sidecar(s) for s in sets]
        for sc in sidecars:
            assert sc["craft_distance"] == pytest.approx(sum(sc["craft_distance_parts"].values()),
                                                         abs=1e-5)
            assert sc["tokens_cache_write"] == 40
        mean = sum(sc["craft_distance"] for sc in sidecars) / len(sidecars)
        assert event["craft_distance"] == pytest.approx(mean, abs=1e-6)
    completed = ws.events("loss.completed")
    assert len(completed) == 4 and all(e["craft_distance"] > 0 for e in completed)
    assert ws.events("cost.total")[-1]["tokens_cache_write"] == 160

    # `progress --json` is what the sidecars say, step by step; it never imports litellm.
    result, took = run_cli("progress", "r1", "--json", "--config", str(ws.config_path),
                           python_flags=["-X", "importtime"])
    assert result.returncode == 0, result.stderr
    assert "litellm" not in result.stderr and "matplotlib" not in result.stderr
    rows = json.loads(result.stdout)
    assert [(r["run"], r["epoch"], r["step"], r["sets"]) for r in rows] == [
        ("r1", 0, 0, 2), ("r1", 0, 1, 2)]
    for row, sets, event in ((rows[0], far, first), (rows[1], near, second)):
        sidecars = [ws.read_sidecar(s) for s in sets]
        assert row["craft_distance"] == event["craft_distance"]
        assert row["craft_distance_change"] == event["craft_distance_change"]
        assert row["tokens_in"] == sum(sc["tokens_in"] for sc in sidecars)
        assert row["tokens_cache_write"] == 80
        assert row["cost_usd"] is None  # the loopback model has no price: unknown, not 0

    # The table and the terminal chart; --plot writes a file a browser can open.
    svg = tmp_path / "curve.svg"
    text, _ = run_cli("progress", "--plot", str(svg), "--config", str(ws.config_path))
    assert text.returncode == 0, text.stderr
    assert "craft distance per reported step" in text.stdout
    assert f"{second['craft_distance']:.4f}" in text.stdout
    assert svg.read_text(encoding="utf-8").lstrip().startswith("<?xml")
    bad, _ = run_cli("progress", "--plot", str(tmp_path / "x.pdf"), "--config", str(ws.config_path))
    assert bad.returncode == 2 and "svg or .png" in bad.stderr
    assert not (tmp_path / "x.pdf").exists()
    # matplotlib is the [plot] extra: without it --plot says how to get it.
    hidden = ["-c", "import sys; sys.modules['matplotlib'] = None; "
              "from skilltrain.daemon.commands.cli import main; main(sys.argv[1:])"]
    bare = subprocess.run([sys.executable, *hidden, "progress", "--plot", str(tmp_path / "y.svg"),
                           "--config", str(ws.config_path)], capture_output=True, text=True,
                          env=subprocess_env(), timeout=60)
    assert bare.returncode == 2, bare.stderr
    assert "pip install 'skilltrain[plot]'" in bare.stderr
    assert not (tmp_path / "y.svg").exists()
    print(f"progress --json: {took:.3f}s")

    # The step line of `skilltrain tail` shows both numbers.
    line = tail_format.format_event(second)
    assert f"distance={second['craft_distance']:.4f}" in line
    assert f"change={second['craft_distance_change']:+.4f}" in line
    assert "change=-" in tail_format.format_event(first)
    assert "cached=0 cache_write=40 " in tail_format.format_event(completed[0])


def test_metrics_endpoint_counts_what_the_daemon_does(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    port = _free_port()
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, max_attempts=1,
                         extra=f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n')
    calls = []

    def first_a_500(request: Request) -> Reply:  # then the reply: one retried attempt
        calls.append(request)
        if len(calls) == 1:
            return Reply.status(500)
        return Reply.ok(DEFAULT_REPORT, cached_tokens=7, cache_write_tokens=40)

    llm_server.default = first_a_500
    daemon = InProcessDaemon(ws).start()
    try:
        before = _scrape(port)
        assert before["skilltrain_reports_total"] == 0
        assert before['skilltrain_sets{state="done"}'] == 0
        assert before["skilltrain_jobs_running"] == 0
        _write_step(ws, "r1", 0, scenes=3, lines=6)
        wait_until(lambda: ws.events("step.reported"), 20, message="step.reported")
        # step.reported is logged a moment before /metrics counts it (emit logs,
        # then observes): wait for the distance asserted below, not only the set.
        after = wait_until(lambda: (s := _scrape(port))['skilltrain_sets{state="done"}'] == 1
                           and 'skilltrain_craft_distance{run="r1"}' in s and s, 5,
                           message="the done set and the step's distance in /metrics")
        llm_server.default = lambda request: Reply.status(400)
        _write_step(ws, "r2", 0, scenes=3, lines=6)
        wait_until(lambda: ws.events("loss.failed"), 20, message="loss.failed")
        # loss.failed is logged as the outcome is decided, a moment before the
        # owner writes the set's state: wait for what is asserted below.
        failed = wait_until(lambda: (s := _scrape(port))['skilltrain_sets{state="failed"}'] == 1
                            and s, 5, message="the failed set in /metrics")
    finally:
        daemon.stop()
    sidecar = ws.read_sidecar(ws.sets_of_step("r1", 0, 0)[0])
    event = ws.events("step.reported")[0]
    assert after["skilltrain_reports_total"] == 1
    assert after['skilltrain_llm_tokens_total{kind="in"}'] == sidecar["tokens_in"] > 0
    assert after['skilltrain_llm_tokens_total{kind="out"}'] == sidecar["tokens_out"] > 0
    assert after['skilltrain_llm_tokens_total{kind="cached"}'] == 7
    assert after['skilltrain_llm_tokens_total{kind="cache_write"}'] == 40
    assert after['skilltrain_craft_distance{run="r1"}'] == pytest.approx(event["craft_distance"])
    assert after["skilltrain_llm_request_seconds_count"] == 1
    assert after['skilltrain_set_failures_total{kind="failed"}'] == 0
    assert failed['skilltrain_set_failures_total{kind="failed"}'] == 1
    assert failed['skilltrain_sets{state="failed"}'] == 1
    assert failed["skilltrain_llm_request_seconds_count"] == 2
    # Per attempt at the provider (the failure-ratio alert): the retried 500 and
    # the reply in one call, then the 400 it gives up on.
    assert after['skilltrain_llm_attempts_total{outcome="ok"}'] == 1
    assert after['skilltrain_llm_attempts_total{outcome="error"}'] == 1
    assert failed['skilltrain_llm_attempts_total{outcome="ok"}'] == 1
    assert failed['skilltrain_llm_attempts_total{outcome="error"}'] == 2
    assert failed["skilltrain_reports_total"] == 1
    # Stopped daemon, closed endpoint.
    with pytest.raises(OSError):
        _scrape(port)


@pytest.mark.parametrize("listen", ["9464", "192.0.2.1:9464"])
def test_a_bad_listen_address_is_a_config_error(tmp_path: Path, listen: str) -> None:
    """Malformed (caught by validation) or not an address of this machine (caught at bind)."""
    ws = build_workspace(tmp_path, "http://127.0.0.1:9/v1",
                         extra=f'\n[metrics]\nlisten = "{listen}"\n')
    result, _ = run_cli("daemon", "--config", str(ws.config_path))
    assert result.returncode == 2, result.stderr
    assert "[metrics] listen" in result.stderr and listen in result.stderr
