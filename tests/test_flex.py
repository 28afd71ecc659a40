"""OpenAI flex processing (`[llm] service_tier = "flex"`) as a live setting.

Real HTTP to the loopback provider throughout (tests/llm_server.FlexCapacity
answers flex requests with OpenAI's "429 Resource Unavailable" on a
schedule). Flex's refusal is not a rate limit: it waits
`flex_unavailable_wait_s`, then falls back to the standard tier (or asks flex
again), cuts no limit, uses no attempt, and is said in one line per episode.
"""

from __future__ import annotations

import json
import signal
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.core.config import LLMConfig
from skilltrain.daemon.core.errors import ConfigError
from skilltrain.daemon.infra import llm, llm_errors, llm_flex, llm_loop
from skilltrain.daemon.infra.llm_endpoints import Slot
from skilltrain.daemon.infra.llm_limit import Limiter
from tests.conftest import LOOPBACK_MODEL
from tests.daemon_helpers import (
    DaemonProcess,
    Start,
    Workspace,
    build_workspace,
    release_llm_clients,
    set_of_request,
    wait_until,
)
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.llm_server import FlexCapacity, LLMServer, Reply, Request

pytestmark = DAEMON_TEST_MARKS
MESSAGES = [{"role": "user", "content": "Compare these two screenplays. " * 20}]
WAIT_S = 0.3
PRICED = "openai/o3"  # litellm 1.110.2 has its flex prices (input_cost_per_token_flex ...)


@pytest.fixture(autouse=True)
def _release_llm_clients() -> Iterator[None]:
    yield
    release_llm_clients()


def flex_workspace(tmp_path: Path, server: LLMServer, *, model: str = LOOPBACK_MODEL,
                   works: dict[str, int] | None = None, **llm_keys: Any) -> Workspace:
    ws = build_workspace(tmp_path, server.url, works=works or {"w0": 6}, settle_s=0.0,
                         retry_backoff_s=0.1, max_attempts=2)
    keys = {"flex_unavailable_wait_s": WAIT_S, **llm_keys}
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
    text = ws.config_path.read_text(encoding="utf-8")
    ws.config_path.write_text(text.replace(f'model = "{LOOPBACK_MODEL}"\n',
                                           f'model = "{model}"\n{extra}'), encoding="utf-8")
    return ws


def by_set(requests: list[Request]) -> dict[tuple[Any, ...], list[Request]]:
    sets: dict[tuple[Any, ...], list[Request]] = defaultdict(list)
    for r in requests:
        if (key := set_of_request(r)) is not None:
            sets[key].append(r)
    return sets


def flex_price(model: str, tokens_in: int, tokens_out: int, *, tier: str | None) -> float:
    info = llm.litellm().get_model_info(model)
    suffix = "_flex" if tier == "flex" else ""
    return float(tokens_in * info[f"input_cost_per_token{suffix}"]
                 + tokens_out * info[f"output_cost_per_token{suffix}"])


# ---------------------------------------------------------------- the call


def test_flex_is_sent_and_its_refusal_is_told_from_a_rate_limit() -> None:
    lim = Limiter("loopback", fixed=None)
    limit = lim.limit
    settings = LLMConfig(model=LOOPBACK_MODEL, service_tier="flex", max_retries=3,
                         backoff_initial_s=0.05, backoff_max_s=0.1)
    with LLMServer() as server:
        server.script(Reply.flex_unavailable())
        settings = settings.model_copy(update={"api_base": server.url})

        async def one() -> BaseException | None:
            try:
                await llm.acomplete(MESSAGES, settings, slot=Slot(lim))
            except llm.LLMError as e:
                return e
            return None

        refused = llm_loop.shared().run(one())
        sent = server.requests
    assert isinstance(refused, llm_flex.FlexUnavailable), refused
    assert not refused.rate_limited and refused.blocked is None
    assert len(sent) == 1 and sent[0].service_tier == "flex"  # not retried at once
    assert lim.usage.rate_limited == 0 and lim.limit == limit  # the limit is not cut
    assert lim.in_flight == 0


@pytest.mark.parametrize(("body", "flex"), [
    ({"error": {"message": "Resource Unavailable", "type": "x", "code": None}}, True),
    ({"error": {"message": "busy", "type": "y", "code": "resource_unavailable"}}, True),
    ({"error": {"message": "Rate limit reached", "type": "requests",
                "code": "rate_limit_exceeded"}}, False),
    ({"error": {"message": "You exceeded your current quota", "type": "insufficient_quota",
                "code": "insufficient_quota"}}, False),
])
def test_resource_unavailable_is_told_by_code_type_or_message(body: dict[str, Any],
                                                              flex: bool) -> None:
    error = Exception(body["error"]["message"])
    error.body = body  # type: ignore[attr-defined]
    error.status_code = 429  # type: ignore[attr-defined]
    assert llm_errors.flex_unavailable(error) is flex
    assert (llm_errors.refused_key(error) == "quota") is ("quota" in body["error"]["message"])


def test_the_timeout_is_fifteen_minutes_under_flex_unless_set() -> None:
    assert LLMConfig().timeout_s == 600
    assert LLMConfig(service_tier="flex").timeout_s == 900
    assert LLMConfig(service_tier="flex", timeout_s=30.0).timeout_s == 30
    assert LLMConfig().with_tier("flex").timeout_s == 900
    assert LLMConfig(service_tier="flex").with_tier("standard").timeout_s == 600
    assert LLMConfig(timeout_s=30.0).with_tier("flex").timeout_s == 30


def test_a_model_without_flex_price_is_said_once_and_a_non_openai_model_refused() -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    watch = llm_flex.FlexWatch(on_change=lambda event, **f: events.append((event, f)))
    for model in ("openai/gpt-4o-mini", "openai/gpt-4o-mini", PRICED, LOOPBACK_MODEL):
        watch.check_price(LLMConfig(model=model, service_tier="flex"))
    assert [(e, f["model"]) for e, f in events] == [("llm.flex_unpriced", "openai/gpt-4o-mini")]
    assert llm_flex.check(LLMConfig(model="anthropic/claude-sonnet-4-5", service_tier="flex"))
    assert llm_flex.check(LLMConfig(model="anthropic/claude-sonnet-4-5")) is None
    from skilltrain.daemon.core import config as config_module

    with pytest.raises(ConfigError, match="not an OpenAI model"):
        from skilltrain.daemon.service.lifecycle import preflight

        cfg = config_module.Config(llm=LLMConfig(model="anthropic/claude-sonnet-4-5",
                                                 api_base="http://127.0.0.1:1/v1",
                                                 service_tier="flex"))
        preflight(cfg.model_copy(update={"paths": cfg.paths.model_copy(
            update={"data": Path(__file__).parent, "prompts": Path(__file__).parents[1]
                    / "prompts"})}))


# ---------------------------------------------------------------- the daemon


def test_flex_refused_waits_then_falls_back_said_once_at_standard_price(
        tmp_path: Path, start: Start) -> None:
    """Flex unavailable: each set's flex call is refused, waits, goes at the
    standard tier (and price); one line says so. Flex back: its calls go at
    flex price and one line counts what happened meanwhile."""
    capacity = FlexCapacity()
    capacity.unavailable.set()
    with LLMServer(default=capacity) as server:
        ws = flex_workspace(tmp_path, server, model=PRICED, service_tier="flex")
        first = ws.write_step("r1", 1, 1, success=True)
        d = start(ws)
        wait_until(lambda: all(ws.has_report(s) for s in first), 30, message="step 1's reports")
        fell_back = by_set(server.requests)
        capacity.unavailable.clear()
        second = ws.write_step("r1", 1, 2, success=True)
        wait_until(lambda: all(ws.has_report(s) for s in second), 30, message="step 2's reports")
        wait_until(lambda: ws.events("llm.flex_available"), 10, message="flex available")
        from prometheus_client import generate_latest

        scraped = generate_latest(d.daemon.metrics.registry).decode()
        limiters = d.daemon.jobs.limiters.all()
        everything = by_set(server.requests)
    # Step 1: per set, a flex request refused, then WAIT_S later one with no tier.
    assert len(fell_back) == len(first)
    for requests in fell_back.values():
        assert [r.service_tier for r in requests] == ["flex", None]
        assert requests[1].monotonic - requests[0].monotonic >= WAIT_S - 0.02
    # Step 2: one flex request per set, served.
    step2 = [rs for key, rs in everything.items() if key[2] == 2]
    assert len(step2) == len(second) and all([r.service_tier for r in rs] == ["flex"]
                                              for rs in step2)
    (unavailable,) = ws.events("llm.flex_unavailable")
    assert unavailable["action"] == f"falling back to the standard tier after {WAIT_S:g} s"
    assert unavailable["level"] == "warning"
    (available,) = ws.events("llm.flex_available")
    assert (available["refused"], available["fell_back"], available["waited"]) == (2, 2, 0)
    # No attempt used, no retry, no limit cut.
    assert not ws.events("loss.retry") and not ws.events("loss.failed")
    assert {e["attempt"] for e in ws.events("loss.started")} == {1}
    assert all(lim.usage.rate_limited == 0 for lim in limiters)
    assert not [e for e in ws.events("llm.limit_changed") if e.get("reason") == "rate_limited"
                or "cut" in json.dumps(e)]
    assert 'skilltrain_llm_flex_unavailable_total{what="fell_back"} 2.0' in scraped
    assert 'skilltrain_llm_flex_unavailable_total{what="refused"} 2.0' in scraped
    # Cost: the fallen-back calls at the standard price, the flex ones at flex price.
    for sets, tier in ((first, None), (second, "flex")):
        for s in sets:
            side = ws.read_sidecar(s)
            want = flex_price(PRICED, side["tokens_in"], side["tokens_out"], tier=tier)
            assert side["cost_usd"] == pytest.approx(want, rel=1e-6), (tier, side)
            assert side["service_tier"] == (tier or "standard")
    # Where the key went: one line for the run, however many flex calls.
    (said,) = ws.events("batch.key_at_provider")
    assert (said["run"], said["via"], said["provider"]) == ("r1", "flex", "openai")
    assert "30 days" in said["retention"]


def test_wait_asks_flex_again_and_never_sends_standard(tmp_path: Path, start: Start) -> None:
    capacity = FlexCapacity(refuse_first=2)
    with LLMServer(default=capacity) as server:
        ws = flex_workspace(tmp_path, server, works={"w0": 3}, service_tier="flex",
                            flex_fallback="wait")
        (s,) = ws.write_step("r1", 1, 1, success=True)
        start(ws)
        wait_until(lambda: ws.has_report(s), 30, message="the report")
        wait_until(lambda: ws.events("llm.flex_available"), 10, message="flex available")
        sent = server.requests
    assert [r.service_tier for r in sent] == ["flex"] * 3
    assert all(b.monotonic - a.monotonic >= WAIT_S - 0.02 for a, b in pairwise(sent))
    (unavailable,) = ws.events("llm.flex_unavailable")
    assert unavailable["action"] == f"waiting {WAIT_S:g} s and asking flex again"
    (available,) = ws.events("llm.flex_available")
    assert (available["refused"], available["fell_back"], available["waited"]) == (2, 0, 2)
    assert not ws.events("loss.retry") and not ws.events("loss.failed")
    assert ws.state()["sets"][s.id]["attempts"] == 0


@pytest.mark.parametrize("configured", [None, "flex"])
def test_a_runs_run_toml_sets_its_tier(tmp_path: Path, start: Start,
                                       configured: str | None) -> None:
    """Run "cheap" asks flex, run "std" the standard tier, run "odd" names no
    tier we know (a problem, said once: config.toml's applies, as for "plain")."""
    with LLMServer(default=FlexCapacity()) as server:
        keys = {"service_tier": configured} if configured else {}
        ws = flex_workspace(tmp_path, server, works={"w0": 3}, **keys)
        for run, tier in (("cheap", "flex"), ("std", "standard"), ("odd", "slow")):
            (ws.runs / run).mkdir(parents=True)
            (ws.runs / run / "run.toml").write_text(f'[llm]\nservice_tier = "{tier}"\n',
                                                    encoding="utf-8")
        runs = ("plain", "cheap", "std", "odd")
        sets = [s for run in runs for s in ws.write_step(run, 1, 1, success=True)]
        start(ws)
        wait_until(lambda: all(ws.has_report(s) for s in sets), 30, message="every report")
        tiers = {key[0]: [r.service_tier for r in rs] for key, rs in by_set(server.requests)
                 .items()}
    assert tiers == {"plain": [configured], "cheap": ["flex"], "std": [None],
                     "odd": [configured]}
    problems = [e for e in ws.events() if "service_tier = 'slow'" in json.dumps(e)]
    assert len(problems) == 1, problems
    said = {e["run"] for e in ws.events("batch.key_at_provider") if e["via"] == "flex"}
    assert said == {run for run, tier in tiers.items() if tier == ["flex"]}


# ---------------------------------------------------------------- SIGKILL


def _killed_at(ws: Workspace, server: LLMServer, name: str, seen: int) -> None:
    """A daemon life, SIGKILLed once the server has seen `seen` requests in all."""
    with DaemonProcess(ws, prewarmed=True, name=name) as d:
        d.wait_event("daemon.started", 60, pid=d.pid)
        wait_until(lambda: server.request_count >= seen, 60,
                   message=lambda: f"{seen} requests; {d.stderr()[-600:]}")
        threading.Event().wait(WAIT_S)  # well inside the wait / the call
        d.kill()


@pytest.mark.slow
def test_sigkill_while_flex_waits_or_is_in_flight_loses_no_set_and_sends_none_twice(
        tmp_path: Path) -> None:
    """Life 1 is killed while each set waits out flex's "unavailable" (a long
    wait); life 2 while each set's flex call is in flight; life 3 finishes.
    Per life, each set is asked at most once; no set is lost; each report is
    written once."""
    capacity = FlexCapacity()
    capacity.unavailable.set()
    with LLMServer(default=capacity) as server:
        ws = flex_workspace(tmp_path, server, service_tier="flex", flex_unavailable_wait_s=60)
        sets = ws.write_step("r1", 1, 1, success=True)
        lives: list[tuple[int, int]] = []

        def life(name: str, seen: int) -> None:
            before = server.request_count
            _killed_at(ws, server, name, seen)
            lives.append((before, server.request_count))

        life("waiting", len(sets))  # each set refused, waiting its 60 s
        capacity.unavailable.clear()
        capacity.reply = Reply.hang(120)
        life("in_flight", 2 * len(sets))  # each set's flex call held by the server
        capacity.reply = Reply.ok("A craft report. " * 30)
        with DaemonProcess(ws, prewarmed=True, name="last") as d:
            d.wait_event("daemon.started", 60, pid=d.pid)
            wait_until(lambda: all(ws.has_report(s) for s in sets), 60,
                       message=lambda: f"every report; {d.stderr()[-600:]}")
            wait_until(lambda: len(ws.events("loss.completed")) >= len(sets), 10,
                       message="loss.completed")
            # The state file is flushed at most every 10x a flush's cost
            # (StateStore.flush_when_due): under a loaded CI, seconds apart. A
            # stop flushes it: read after that, not within a guessed wait.
            d.signal(signal.SIGTERM)
            assert d.wait(60) == 0, d.stderr()[-2000:]
        states = {s.id: ws.state().get("sets", {}).get(s.id, {}) for s in sets}
        assert {r.get("state") for r in states.values()} == {"done"}, states
        requests = server.requests
        lives.append((lives[-1][1], len(requests)))
    for first, end in lives:
        asked = Counter(set_of_request(r) for r in requests[first:end])
        assert len(asked) == len(sets) and set(asked.values()) == {1}, asked
    assert all(r.service_tier == "flex" for r in requests)  # killed before any fallback
    completed = Counter((e["work"], e["range"]) for e in ws.events("loss.completed"))
    assert len(completed) == len(sets) and set(completed.values()) == {1}, completed
    assert not ws.events("loss.failed")


def test_tail_says_the_two_flex_lines_in_words() -> None:
    from skilltrain.daemon.commands.tail_format import format_event

    at = "2026-12-04T18:00:00Z"
    gone = format_event({"event": "llm.flex_unavailable", "level": "warning", "timestamp": at,
                         "model": "openai/o3", "wait_s": 60.0, "fallback": "standard",
                         "action": "falling back to the standard tier after 60 s"})
    back = format_event({"event": "llm.flex_available", "level": "info", "timestamp": at,
                         "model": "openai/o3", "refused": 3, "fell_back": 2, "waited": 0,
                         "unavailable_s": 75.0})
    assert gone.endswith("openai/o3: flex has no capacity (429 Resource Unavailable); "
                         "falling back to the standard tier after 60 s")
    assert back.endswith("flex served again after 1m15s; refused=3 fell_back=2 waited=0")
