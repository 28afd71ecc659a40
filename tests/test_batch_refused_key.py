"""A quota is not a rate limit, in batch mode too (issue 36): a batch upload or
create the provider refuses for the key (OpenAI's 429 insufficient_quota,
Anthropic's "credit balance is too low") blocks the endpoint as a live call's
refusal does: one llm.blocked, the gauge, `status`, `daemon --once` exits 1,
the sets wait held and no attempt is counted; once a probe finds the key
working, the step goes out as a batch. The loopback batch servers answer the
refusal until the test lets them recover."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.infra.batch_api import BatchAPI
from skilltrain.daemon.infra.batch_api import BatchAPIError as APIError
from tests.anthropic_batch_server import AnthropicBatchServer
from tests.batch_server import BatchServer
from tests.daemon_helpers import InProcessDaemon, Workspace, build_workspace, run_cli, wait_until
from tests.daemon_marks import DAEMON_TEST_MARKS

pytestmark = DAEMON_TEST_MARKS

FAST = {"mode": "batch", "batch_gather_s": 0.3, "batch_poll_s": 0.1, "batch_poll_max_s": 0.3,
        "probe_refused_key_s": 0.5}
MODELS = {"openai": "openai/gpt-4o-mini", "anthropic": "anthropic/claude-sonnet-4-6"}
SAID = {"openai": "(quota)", "anthropic": "(billing)"}


def workspace(tmp_path: Path, url: str, model: str) -> Workspace:
    ws = build_workspace(tmp_path, url, works={"alpha": 6, "beta": 3}, settle_s=0.2,
                         retry_backoff_s=0.2, max_attempts=1)
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in FAST.items())
    text = ws.config_path.read_text(encoding="utf-8")
    ws.config_path.write_text(text.replace('model = "openai/loopback-model"\n',
                                           f'model = "{model}"\n' + extra), encoding="utf-8")
    return ws


def test_the_batch_api_tells_a_refused_key_from_other_errors() -> None:
    from skilltrain.daemon.core.config import LLMConfig

    with BatchServer() as server:
        api = BatchAPI(LLMConfig(model=MODELS["openai"], api_base=server.url))
        server.refuse_key = True
        with pytest.raises(APIError) as refused:
            api.submit(['{"custom_id": "s0000"}'], {"skilltrain_key": "k"})
        server.refuse_key, server.reject_creates = False, 1
        with pytest.raises(APIError) as rejected:
            api.submit(['{"custom_id": "s0000"}'], {"skilltrain_key": "k"})
        api.close()
    assert refused.value.blocked == "quota" and "current quota" in str(refused.value)
    assert rejected.value.blocked is None  # a batch not accepted is not a refused key


def test_an_input_file_is_deleted_only_when_its_create_was_refused() -> None:
    """A create refused (4xx) made no batch: its input file, the key, is deleted.
    One that timed out may have made the batch, which reads that file: kept."""
    import threading

    from skilltrain.daemon.core.config import LLMConfig

    with BatchServer() as server:
        api = BatchAPI(LLMConfig(model=MODELS["openai"], api_base=server.url, timeout_s=1.0))
        server.reject_creates = 1
        with pytest.raises(APIError) as refused:
            api.submit(['{"custom_id": "a-0000"}'], {"skilltrain_key": "k1"})
        assert refused.value.sent and refused.value.status == 400
        assert server.deleted == 1 and server.files == {}
        late = threading.Event()
        server.plan.hold_after_create = late  # made, and its answer comes too late
        with pytest.raises(APIError) as timed_out:
            api.submit(['{"custom_id": "b-0000"}'], {"skilltrain_key": "k2"})
        late.set()
        assert timed_out.value.sent and timed_out.value.status is None
        assert server.deleted == 1 and len(server.files) == 1
        assert api.find("k2", 0, 1) is not None  # the next poll adopts it, its input there
        api.close()


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_refused_batch_blocks_the_endpoint_holds_its_sets_and_goes_on(
        tmp_path: Path, start: Any, provider: str) -> None:
    server: Any = BatchServer() if provider == "openai" else AnthropicBatchServer()
    with server:
        server.refuse_key = True
        ws = workspace(tmp_path, server.url, MODELS[provider])
        sets = ws.write_step("r1", 0, 0, success=True)
        d = start(ws)
        wait_until(lambda: {ws.state()["sets"].get(s.id, {}).get("state") for s in sets}
                   == {"held"}, 30, message="every set held")
        state = ws.state()["sets"]
        assert all(f"refuses the API key {SAID[provider]}" in state[s.id]["reason"]
                   and state[s.id]["attempts"] == 0 for s in sets)
        assert len(ws.events("llm.blocked")) == 1 and not ws.events("batch.gave_up")
        assert not ws.events("batch.error") and not ws.events("loss.failed")
        assert server.creates == 0 and not list(ws.runs.glob("r1/loss/.batches/*.json"))
        (limiter,) = d.daemon.jobs.limiters.all()
        assert limiter.blocked is not None  # the gauge and alert read this
        status = json.loads(run_cli("status", "--json", "--config", str(ws.config_path))[0]
                            .stdout)
        assert status["attention_by_kind"]["blocked"] == 1
        server.refuse_key = False
        wait_until(lambda: all(ws.has_report(s) for s in sets), 60, message="every report")
    assert len(ws.events("llm.unblocked")) == 1 and server.creates == 1
    assert all(ws.read_sidecar(s)["mode"] == "batch" for s in sets)


def test_once_exits_non_zero_when_a_batch_is_refused_for_the_key(tmp_path: Path) -> None:
    with BatchServer() as server:
        server.refuse_key = True
        ws = workspace(tmp_path, server.url, MODELS["openai"])
        sets = ws.write_step("r1", 0, 0, success=True)
        d = InProcessDaemon(ws, once=True).start()
        try:
            d.run_once()
        finally:
            d.stop("once: idle")
    assert int(d.daemon.exit_code) == 1
    state = ws.state()["sets"]
    assert {state[s.id]["state"] for s in sets} == {"held"}
    assert {state[s.id]["attempts"] for s in sets} == {0}
    assert len(ws.events("llm.blocked")) == 1


def test_a_poll_refused_for_the_key_blocks_the_endpoint_once_and_polling_goes_on(
        tmp_path: Path, start: Any) -> None:
    from tests.batch_server import BatchPlan

    with BatchServer() as server:
        server.plan = BatchPlan(latency_s=1.5)
        ws = workspace(tmp_path, server.url, MODELS["openai"])
        sets = ws.write_step("r1", 0, 0, success=True)
        start(ws)
        wait_until(lambda: ws.events("batch.submitted"), 30, message="batch.submitted")
        server.refuse_key = True
        wait_until(lambda: ws.events("llm.blocked"), 10, message="llm.blocked")
        wait_until(lambda: server.key_refusals >= 4, 10, message="polls refused")
        server.refuse_key = False
        wait_until(lambda: all(ws.has_report(s) for s in sets), 60, message="every report")
    assert len(ws.events("llm.blocked")) == 1 and len(ws.events("llm.unblocked")) == 1
    assert not ws.events("batch.error") and server.creates == 1
