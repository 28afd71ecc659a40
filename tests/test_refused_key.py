"""A quota is not a rate limit: a key the provider refuses (OpenAI's
insufficient_quota 429, a billing error, 401/403) blocks the endpoint instead
of being retried forever. Real HTTP to the loopback provider throughout."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.core.config import LLMConfig
from skilltrain.daemon.infra import llm, llm_loop
from skilltrain.daemon.infra.llm_endpoints import Slot
from skilltrain.daemon.infra.llm_limit import Limiter
from tests.conftest import LOOPBACK_MODEL
from tests.daemon_helpers import (
    DaemonProcess,
    InProcessDaemon,
    Start,
    build_workspace,
    release_llm_clients,
    run_cli,
    wait_until,
)
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.llm_server import LLMServer, Reply, Request

pytestmark = DAEMON_TEST_MARKS
MESSAGES = [{"role": "user", "content": "Compare these two screenplays. " * 20}]

QUOTA = Reply.status(429, body={"error": {
    "message": "You exceeded your current quota, please check your plan and billing details.",
    "type": "insufficient_quota", "code": "insufficient_quota"}})
ANTHROPIC_CREDIT = Reply.status(400, body={"type": "error", "error": {
    "type": "invalid_request_error",
    "message": "Your credit balance is too low to access the Anthropic API."}})
PAYMENT = Reply.status(402, body={"type": "error", "error": {
    "type": "billing_error", "message": "billing"}})


@pytest.fixture(autouse=True)
def _release_llm_clients() -> Iterator[None]:
    yield
    release_llm_clients()


def settings(server: LLMServer, **kw: Any) -> LLMConfig:
    return LLMConfig(model=LOOPBACK_MODEL, api_base=server.url, timeout_s=10.0,
                     max_retries=kw.pop("max_retries", 3), backoff_initial_s=0.05,
                     backoff_max_s=0.2, **kw)


def call(cfg: LLMConfig, lim: Limiter) -> Any:
    async def one() -> Any:
        try:
            return await llm.acomplete(MESSAGES, cfg, slot=Slot(lim))
        except llm.LLMError as e:
            return e

    return llm_loop.shared().run(one())


@pytest.mark.parametrize(("reply", "kind"), [
    (QUOTA, "quota"), (Reply.status(401), "authentication"),
    (Reply.status(403), "authentication"), (ANTHROPIC_CREDIT, "billing"), (PAYMENT, "billing"),
])
def test_a_refused_key_is_not_retried_and_blocks_the_endpoint(reply: Reply, kind: str) -> None:
    events: list[dict[str, Any]] = []
    lim = Limiter("loopback", fixed=None,
                  on_change=lambda event, **f: events.append({"event": event, **f}))
    with LLMServer() as server:
        server.script(reply)
        first = call(settings(server), lim)
        second = call(settings(server), lim)  # the endpoint is blocked: not sent
        sent = server.request_count
    assert isinstance(first, llm.LLMError) and first.blocked == kind, first
    assert not first.rate_limited
    assert isinstance(second, llm.LLMError) and second.blocked == kind
    assert "refuses the API key" in str(second)
    assert sent == 1  # no retry, no second call
    blocked = [e for e in events if e["event"] == "llm.blocked"]
    assert len(blocked) == 1 and blocked[0]["kind"] == kind and blocked[0]["level"] == "error"
    assert lim.usage.rate_limited == 0


def test_a_plain_rate_limit_is_still_waited_out() -> None:
    lim = Limiter("loopback", fixed=None)
    with LLMServer() as server:
        server.script(Reply.status(429, retry_after=0.05), Reply.ok("fine"))
        done = call(settings(server), lim)
    assert not isinstance(done, Exception) and done.text == "fine"
    assert lim.blocked is None and lim.usage.rate_limited == 1


def test_a_blocked_endpoint_probes_with_a_small_call_and_goes_on_when_the_key_works() -> None:
    events: list[dict[str, Any]] = []
    answer = {"reply": QUOTA}
    with LLMServer(default=lambda request: answer["reply"]) as server:
        cfg = settings(server)
        lim = Limiter("loopback", fixed=None, probe=lambda: llm.probe(cfg), probe_s=0.2,
                      on_change=lambda event, **f: events.append({"event": event, **f}))
        assert isinstance(call(cfg, lim), llm.LLMError)
        wait_until(lambda: server.request_count >= 3, 10, message="two probes, still refused")
        assert lim.blocked is not None
        answer["reply"] = Reply.ok("fine")
        wait_until(lambda: lim.blocked is None, 10, message="a probe that passes")
        done = call(cfg, lim)
        probes = [r for r in server.requests[1:-1]]
    assert not isinstance(done, Exception) and done.text == "fine"
    assert probes and all(r.body and r.body.get("max_tokens") == 1 for r in probes)
    names = [e["event"] for e in events if e["event"].startswith("llm.")
             and e["event"] != "llm.limit_changed" and e.get("level") != "debug"]
    assert names == ["llm.blocked", "llm.unblocked"]  # one line each, not one per probe
    assert events[-1]["probes"] >= 3 if events[-1]["event"] == "llm.unblocked" else True


# ---------------------------------------------------------------- the daemon


def quota_until(opened: threading.Event) -> Any:
    """insufficient_quota until `opened`, then reports (probes included)."""
    def answer(request: Request) -> Reply:
        return Reply.ok("A craft report. " * 30) if opened.is_set() else QUOTA
    return answer


def test_the_daemon_holds_its_sets_says_so_once_and_goes_on_when_the_key_works(
    tmp_path: Path, start: Start
) -> None:
    opened = threading.Event()
    with LLMServer(default=quota_until(opened)) as server:
        ws = build_workspace(tmp_path, server.url, works={"w0": 6, "w1": 6}, settle_s=0.0,
                             max_attempts=1, retry_backoff_s=0.1)
        text = ws.config_path.read_text()
        ws.config_path.write_text(text.replace("[loss]", "probe_refused_key_s = 0.5\n[loss]"))
        sets = ws.write_step("r1", 1, 1, success=True)
        start(ws)
        wait_until(lambda: all(ws.state()["sets"].get(s.id, {}).get("state") == "held"
                               for s in sets), 30, message="every set held")
        state = ws.state()["sets"]
        for s in sets:
            assert "refuses the API key (quota)" in state[s.id]["reason"]
            assert state[s.id]["attempts"] == 0
        status = json.loads(run_cli("status", "--json", "--config", str(ws.config_path))[0]
                            .stdout)
        held = [a for a in status["attention"] if a["kind"] == "held"]
        assert {a["id"] for a in held} >= {s.id for s in sets}
        assert all("refuses the API key" in a["reason"] for a in held)
        assert len(ws.events("llm.blocked")) == 1
        assert not ws.events("loss.failed") and not ws.events("loss.rate_limited")
        opened.set()
        wait_until(lambda: all(ws.has_report(s) for s in sets), 30, message="every report")
    assert len(ws.events("llm.blocked")) == 1 and len(ws.events("llm.unblocked")) == 1
    assert not ws.events("loss.failed")


def test_once_exits_non_zero_when_the_key_is_refused(tmp_path: Path) -> None:
    with LLMServer(default=lambda request: QUOTA) as server:
        ws = build_workspace(tmp_path, server.url, works={"w0": 6}, settle_s=0.0,
                             concurrency=1)  # the second set waits for the slot
        sets = ws.write_step("r1", 1, 1, success=True)
        d = InProcessDaemon(ws, once=True).start()
        try:
            d.run_once()
        finally:
            d.stop("once: idle")
        sent = server.request_count
    assert int(d.daemon.exit_code) == 1
    assert sent == 1  # the first refusal blocks; the set waiting for a slot is not sent
    assert {ws.state()["sets"][s.id]["state"] for s in sets} == {"held"}
    assert len(ws.events("llm.blocked")) == 1
    stopped = ws.events("daemon.stopped")
    assert stopped and stopped[-1]["exit_code"] == 1


def test_prometheus_gets_the_blocked_endpoint_for_the_alert() -> None:
    from prometheus_client import generate_latest

    from skilltrain.daemon.infra.llm_endpoints import Limiters
    from skilltrain.daemon.service.metrics import Metrics

    limiters = Limiters(fixed=None)
    metrics = Metrics(lambda: {}, [])
    metrics.watch_limiters(limiters)
    with LLMServer() as server:
        lim = limiters.for_endpoint(LOOPBACK_MODEL, server.url)
        before = generate_latest(metrics.registry).decode()
        server.script(QUOTA)
        call(settings(server), lim)
    after = generate_latest(metrics.registry).decode()
    assert 'skilltrain_llm_endpoint_blocked{endpoint="loopback-model@' in before
    assert [line for line in before.splitlines()
            if line.startswith("skilltrain_llm_endpoint_blocked{")][0].endswith(" 0.0")
    (blocked,) = [line for line in after.splitlines()
                  if line.startswith("skilltrain_llm_endpoint_blocked{")]
    assert 'kind="quota"' in blocked and blocked.endswith(" 1.0")  # SkilltrainLLMKeyRefused


def test_a_reload_probes_a_blocked_endpoint_at_once(tmp_path: Path) -> None:
    """Credit topped up, `systemctl reload` (SIGHUP): the blocked endpoint is
    probed now, not at its next probe (here an hour away), and the held sets
    go on."""
    import signal

    opened = threading.Event()
    with LLMServer(default=quota_until(opened)) as server:
        ws = build_workspace(tmp_path, server.url, works={"w0": 3}, settle_s=0.0)
        text = ws.config_path.read_text()
        ws.config_path.write_text(text.replace("[loss]", "probe_refused_key_s = 3600\n[loss]"))
        (s,) = ws.write_step("r1", 1, 1, success=True)
        with DaemonProcess(ws) as daemon:
            daemon.wait_event("llm.blocked", 60)
            opened.set()
            daemon.signal(signal.SIGHUP)
            reload = daemon.wait_event("daemon.reload", 30)
            daemon.wait_event("llm.unblocked", 30)
            wait_until(lambda: ws.has_report(s), 30, message="the held set's report")
            assert daemon.alive()  # a reload is not a stop
    assert reload["blocked_probed"] == 1
