"""Batch mode against a loopback Anthropic Message Batches API (tests/anthropic_batch_server.py).

The same transport as the OpenAI shape (daemon/service/batch.py), another
API behind it (daemon/infra/anthropic_batches.py): a step's sets go as one
batch with the key prefix cached for an hour, results come back in another
order and are matched by custom_id, priced at the batch price; an errored
item is retried like a failed call, an expired one sent again unpaid; and a
SIGKILL at each point of a batch's life neither pays twice nor loses a set,
counted by the server.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.anthropic_batch_server import AnthropicBatchServer, AnthropicPlan
from tests.daemon_helpers import DaemonProcess, Workspace, build_workspace, stays, wait_until
from tests.daemon_marks import DAEMON_TEST_MARKS

pytestmark = DAEMON_TEST_MARKS

MODEL = "anthropic/claude-sonnet-4-6"  # litellm's cost map has its batch price
FAST = {"mode": "batch", "batch_gather_s": 0.3, "batch_poll_s": 0.1, "batch_poll_max_s": 0.3}
START_TIMEOUT_S = 90.0


@pytest.fixture
def server() -> Iterator[AnthropicBatchServer]:
    with AnthropicBatchServer() as s:
        yield s


def workspace(tmp_path: Path, server: AnthropicBatchServer, **llm: Any) -> Workspace:
    ws = build_workspace(tmp_path, server.url, works={"alpha": 6, "beta": 3}, settle_s=0.2,
                         retry_backoff_s=0.2)
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in {**FAST, **llm}.items())
    text = ws.config_path.read_text(encoding="utf-8")
    ws.config_path.write_text(text.replace('model = "openai/loopback-model"\n',
                                           f'model = "{MODEL}"\n' + extra), encoding="utf-8")
    return ws


def finished(ws: Workspace) -> bool:
    return all(ws.has_report(s) for s in ws.sets_of_step("r1", 0, 0)) and not list(
        ws.runs.glob("r1/loss/.batches/*.json"))


def test_a_step_goes_as_one_anthropic_batch_at_its_batch_price(
        tmp_path: Path, server: AnthropicBatchServer, start: Any) -> None:
    ws = workspace(tmp_path, server)
    sets = ws.write_step("r1", 0, 0, success=True)
    d = start(ws)
    wait_until(lambda: ws.events("step.reported"), 60, message="step.reported")
    assert server.creates == 1 and len(server.billed) == len(sets)
    requests = server.requests()
    # Unique across every batch: one nonce for the batch, then the set's number.
    (nonce,) = {r["custom_id"].split("-")[0] for r in requests}
    assert re.fullmatch("[0-9a-f]{16}", nonce)
    assert sorted(r["custom_id"] for r in requests) == [f"{nonce}-{n:04d}"
                                                         for n in range(len(sets))]
    for request in requests:  # a live call's body, the key prefix cached for an hour
        params = request["params"]
        assert params["model"] == "claude-sonnet-4-6" and params["max_tokens"] > 0
        (message,) = params["messages"]
        marks = [p["cache_control"] for p in message["content"] if "cache_control" in p]
        assert marks == [{"type": "ephemeral", "ttl": "1h"}]
    assert all(h.get("anthropic-version") for h in server.headers_seen)
    from skilltrain.daemon.infra import llm

    info = llm.litellm().get_model_info(MODEL)
    batch_id = next(iter(server.batches))
    for s in sets:  # results came back reversed: each matched by its custom_id
        side = ws.read_sidecar(s)
        assert side["mode"] == "batch" and side["batch_id"] == batch_id
        assert side["tokens_cache_write"] > 0 and side["tokens_in"] > side["tokens_cache_write"]
        written = side["tokens_cache_write"]
        plain = side["tokens_in"] - written
        live = (plain * info["input_cost_per_token"] + side["tokens_out"]
                * info["output_cost_per_token"] + written * info["cache_creation_input_token_cost"])
        assert side["cost_usd"] == pytest.approx(live / 2)  # Anthropic's batches: half price
    assert d.daemon.state.spend["r1"].cost_usd == pytest.approx(
        sum(ws.read_sidecar(s)["cost_usd"] for s in sets))
    wait_until(lambda: finished(ws), 10, message="the record removed once closed")
    (said,) = ws.events("batch.key_at_provider")  # where the key now is, once
    assert said["provider"] == "anthropic" and "zero data retention" in said["retention"]


def test_an_errored_item_is_retried_and_an_expired_one_sent_again_unpaid(
        tmp_path: Path, server: AnthropicBatchServer, start: Any) -> None:
    ws = workspace(tmp_path, server)
    seen: set[str] = set()

    def once(mark: str) -> Any:
        def first(request: dict[str, Any]) -> bool:
            if mark in json.dumps(request["params"]) and mark not in seen:
                seen.add(mark)
                return True
            return False
        return first

    server.plan = AnthropicPlan(errored=once("work=alpha ep=1"), expired=once("work=beta ep=1"))
    sets = ws.write_step("r1", 0, 0, success=True)
    start(ws)
    wait_until(lambda: finished(ws), 60, message="every set reported")
    assert len(server.billed) == len(sets)  # each set paid once
    (failed,) = ws.events("loss.failed")
    assert "loopback: this request failed" in failed["reason"] and failed["attempts"] == 1
    (done,) = ws.events("batch.completed")[:1]
    assert done["replies"] == 1 and done["errors"] == 1 and done["unanswered"] == 1
    assert server.creates == 2  # the errored and the expired set went in the next batch


def test_a_create_that_failed_adopts_no_other_records_batch(
        tmp_path: Path, server: AnthropicBatchServer, start: Any) -> None:
    """Two runs' steps of as many sets: the first create gets a 500 (nothing
    made), and the search for it must not take the other run's batch, made
    since, of the same size (it did: that run's replies became this run's
    reports)."""
    ws = workspace(tmp_path, server)
    server.failing_creates = 1
    ws.write_step("r1", 0, 0, success=True)
    ws.write_step("r2", 0, 0, success=True)
    start(ws)
    done = lambda: all(ws.has_report(s) for run in ("r1", "r2")  # noqa: E731
                       for s in ws.sets_of_step(run, 0, 0))
    wait_until(done, 60, message="every set reported")
    assert not ws.events("batch.submitted", recovered=True)
    for run in ("r1", "r2"):
        for s in ws.sets_of_step(run, 0, 0):
            asked = [r["params"] for r in server.batches[ws.read_sidecar(s)["batch_id"]].requests]
            assert all(run in json.dumps(params) for params in asked), (run, s.id)


def test_two_lost_batches_of_one_size_are_each_found_by_their_own_record() -> None:
    """Each record's own batch is the first made after it: taking the newest
    match, the first record took the second's batch and the second the first's."""
    from skilltrain.daemon.core.config import LLMConfig
    from skilltrain.daemon.infra.anthropic_batches import AnthropicBatchAPI

    def line(custom_id: str) -> str:
        return json.dumps({"custom_id": custom_id, "params": {
            "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}})

    with AnthropicBatchServer() as server:
        api = AnthropicBatchAPI(LLMConfig(model=MODEL, api_base=server.url, timeout_s=5))
        first_saved = time.time()
        first = api.submit([line("a" * 16 + "-0000")], {})
        time.sleep(0.05)
        second_saved = time.time()
        second = api.submit([line("b" * 16 + "-0000")], {})
        found = api.find("first", first_saved, 1)
        assert found == first
        assert api.find("second", second_saved, 1, taken={found}) == second
        api.close()


def test_a_batch_found_by_mistake_answers_none_of_the_sets(
        tmp_path: Path, server: AnthropicBatchServer, start: Any) -> None:
    """Another daemon on the same key makes a batch of as many requests just as
    this one's create fails: the search adopts it (size and time are all the
    API lets it match), and its results answer none of this batch's request
    ids, so the sets go again and no report is another daemon's reply."""
    ws = workspace(tmp_path, server)
    server.failing_creates, server.impostor = 1, True
    sets = ws.write_step("r1", 0, 0, success=True)
    start(ws)
    wait_until(lambda: finished(ws), 60, message="every set reported")
    (adopted,) = ws.events("batch.submitted", recovered=True)
    (impostor,) = server.impostors
    assert adopted["batch_id"] == impostor
    (answered_none,) = ws.events("batch.completed", batch_id=impostor)
    assert answered_none["unanswered"] == len(sets) and answered_none["replies"] == 0
    assert all(ws.read_sidecar(s)["batch_id"] != impostor for s in sets)


@pytest.mark.slow
def test_killed_after_the_create_before_its_id_was_recorded(
        tmp_path: Path, server: AnthropicBatchServer) -> None:
    ws = workspace(tmp_path, server)
    ws.write_step("r1", 0, 0, success=True)
    hold = threading.Event()
    server.plan = AnthropicPlan(hold_after_create=hold)
    with DaemonProcess(ws, prewarmed=True) as d:
        wait_until(lambda: server.creates == 1, START_TIMEOUT_S, message="the create")
        time.sleep(0.1)
        d.kill()
    hold.set()
    server.plan = AnthropicPlan()
    (record,) = ws.runs.glob("r1/loss/.batches/*.json")
    assert json.loads(record.read_text())["state"] == "submitting"
    _finish_and_check(ws, server)
    assert ws.events("batch.submitted", recovered=True)  # found by the list, adopted


@pytest.mark.slow
@pytest.mark.parametrize("point", ["open", "ended"])
def test_killed_while_the_batch_is_open_or_ended_unhandled(
        tmp_path: Path, server: AnthropicBatchServer, point: str) -> None:
    ws = workspace(tmp_path, server, batch_poll_s=30.0 if point == "ended" else 0.1,
                   batch_poll_max_s=30.0 if point == "ended" else 0.3)
    ws.write_step("r1", 0, 0, success=True)
    server.plan = AnthropicPlan(latency_s=4.0 if point == "open" else 0.1)
    with DaemonProcess(ws, prewarmed=True) as d:
        d.wait_event("batch.submitted", START_TIMEOUT_S)
        if point == "ended":
            batch_id = next(iter(server.batches))
            wait_until(lambda: server.retrieve(batch_id)["processing_status"] == "ended", 10,
                       message="ended on the server")
        d.kill()
    _finish_and_check(ws, server)


def _finish_and_check(ws: Workspace, server: AnthropicBatchServer) -> None:
    with DaemonProcess(ws, prewarmed=True, name="after") as d:
        wait_until(lambda: finished(ws), START_TIMEOUT_S,
                   message=lambda: f"reports; {d.stderr()[-800:]}")
        wait_until(lambda: ws.events("step.reported"), 20, message="step.reported")
        assert stays(lambda: len(ws.events("step.reported")) == 1, 0.3)
    sets = ws.sets_of_step("r1", 0, 0)
    assert server.creates == 1  # never sent twice
    assert len(server.billed) == len(sets), server.billed  # every request paid once
