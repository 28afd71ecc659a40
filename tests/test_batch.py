"""Batch mode against a loopback OpenAI files + batches API (tests/batch_server.py).

A real in-process daemon, litellm over HTTP, real files: a step's ready sets
go out as one batch, each result is checked like a live reply, failed items
are retried, expired and cancelled batches send their unfinished sets again,
and a changed input discards the reply.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.batch_server import BatchPlan, BatchServer
from tests.daemon_helpers import (
    Workspace,
    build_workspace,
    human_screenplays,
    model_episode,
    run_once_in_process,
    stays,
    wait_until,
)
from tests.daemon_marks import DAEMON_TEST_MARKS

pytestmark = DAEMON_TEST_MARKS

PRICED = "openai/gpt-4o-mini"  # litellm's cost map has its batch price
FAST = {"batch_gather_s": 0.3, "batch_poll_s": 0.1, "batch_poll_max_s": 0.3}


@pytest.fixture
def server() -> Iterator[BatchServer]:
    with BatchServer() as s:
        yield s


def request_numbers(server: BatchServer) -> list[str]:
    """The requests' numbers in their one batch: custom_ids are `<nonce>-<n>`, the
    nonce the batch's own (unique across batches: batch_results.submit)."""
    ids = [line["custom_id"] for line in server.request_lines()]
    (nonce,) = {i.split("-")[0] for i in ids}
    assert re.fullmatch("[0-9a-f]{16}", nonce)
    return sorted(i.split("-")[1] for i in ids)


def workspace(tmp_path: Path, server: BatchServer, *, model: str = PRICED,
              run_toml: dict[str, str] | None = None, max_attempts: int = 5,
              retry_backoff_s: float = 0.2, **llm: Any) -> Workspace:
    keys = {**FAST, "mode": "batch", **llm}
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
    ws = build_workspace(tmp_path, server.url, works={"alpha": 6, "beta": 3}, settle_s=0.2,
                         retry_backoff_s=retry_backoff_s, max_attempts=max_attempts)
    text = ws.config_path.read_text(encoding="utf-8")
    text = text.replace('model = "openai/loopback-model"\n', f'model = "{model}"\n' + extra)
    ws.config_path.write_text(text, encoding="utf-8")
    return ws


def records(ws: Workspace) -> list[Path]:
    return sorted(ws.runs.glob("*/loss/.batches/*.json"))


def all_reported(ws: Workspace, run: str = "r1") -> Callable[[], bool]:
    return lambda: all(ws.has_report(s) for s in ws.sets_of_step(run, 0, 0))


def test_a_step_goes_as_one_batch_priced_at_the_batch_price(
        tmp_path: Path, server: BatchServer, start: Any) -> None:
    ws = workspace(tmp_path, server)
    sets = ws.write_step("r1", 0, 0, success=True)
    d = start(ws)
    wait_until(lambda: ws.events("step.reported"), 60, message="step.reported")
    assert server.creates == 1 and server.live_requests == 0
    assert request_numbers(server) == [f"{n:04d}" for n in range(len(sets))]
    batch_id = server.batch_list()[0].id
    from skilltrain.daemon.infra import llm

    info = llm.litellm().get_model_info(PRICED)
    for s in sets:
        side = ws.read_sidecar(s)
        assert side["mode"] == "batch" and side["batch_id"] == batch_id
        batch = (side["tokens_in"] * info["input_cost_per_token_batches"]
                 + side["tokens_out"] * info["output_cost_per_token_batches"])
        live = (side["tokens_in"] * info["input_cost_per_token"]
                + side["tokens_out"] * info["output_cost_per_token"])
        assert side["cost_usd"] == pytest.approx(batch) and batch == pytest.approx(live / 2)
    spent = d.daemon.state.spend["r1"].cost_usd
    assert spent == pytest.approx(sum(ws.read_sidecar(s)["cost_usd"] for s in sets))
    assert [e["batch_id"] for e in ws.events("batch.submitted")] == [batch_id]
    assert ws.events("batch.completed")[0]["replies"] == len(sets)
    wait_until(lambda: not records(ws), 10, message="the record removed once closed")


def test_per_run_mode_in_run_toml(tmp_path: Path, server: BatchServer, start: Any) -> None:
    ws = workspace(tmp_path, server, mode="live")
    ws.write_step("cheap", 0, 0, success=True)
    ws.write_step("urgent", 0, 0, success=True)
    (ws.runs / "cheap" / "run.toml").write_text('[llm]\nmode = "batch"\n', encoding="utf-8")
    start(ws)
    wait_until(lambda: len(ws.events("step.reported")) == 2, 60, message="both steps")
    assert server.creates == 1
    assert request_numbers(server) == ["0000", "0001", "0002"]
    assert server.live_requests == 3  # the urgent run's three sets
    assert all(ws.read_sidecar(s).get("mode") == "batch" for s in ws.sets_of_step("cheap", 0, 0))
    assert all("mode" not in ws.read_sidecar(s) for s in ws.sets_of_step("urgent", 0, 0))


def _first_request_of(work: str) -> Callable[[dict[str, Any]], bool]:
    seen: set[str] = set()

    def fail(line: dict[str, Any]) -> bool:
        text = json.dumps(line["body"]["messages"])
        if f"work={work} ep=1" in text and work not in seen:
            seen.add(work)
            return True
        return False
    return fail


@pytest.mark.parametrize("failed_to", ["batch", "live"])
def test_a_failed_item_is_retried_and_its_error_text_is_guarded(
        tmp_path: Path, server: BatchServer, start: Any, failed_to: str) -> None:
    ws = workspace(tmp_path, server, batch_failed=failed_to)
    leaked = " ".join(human_screenplays("alpha", 6)[2].split()[:40])  # a passage of the key
    server.plan = BatchPlan(fail=_first_request_of("alpha"), fail_message=f"bad: {leaked}")
    ws.write_step("r1", 0, 0, success=True)
    start(ws)
    wait_until(all_reported(ws), 60, message="every set reported after the retry")
    failed = ws.events("loss.failed")
    assert len(failed) == 1 and "withheld" in failed[0]["reason"]
    assert leaked.split()[5] not in ws.log_file.read_text(encoding="utf-8")
    assert server.creates == (2 if failed_to == "batch" else 1)
    assert server.live_requests == (1 if failed_to == "live" else 0)


def test_an_expired_batch_sends_its_unanswered_sets_again(
        tmp_path: Path, server: BatchServer, start: Any) -> None:
    ws = workspace(tmp_path, server)
    server.next_plans = [BatchPlan(end="expired", answered=1)]  # the first batch only
    ws.write_step("r1", 0, 0, success=True)
    start(ws)
    wait_until(lambda: ws.events("batch.expired"), 60, message="batch.expired")
    wait_until(all_reported(ws), 60, message="every set reported")
    assert ws.events("batch.expired")[0]["unanswered"] == 2
    assert server.creates == 2 and len(server.billed) == 3  # each set paid once
    assert not ws.events("loss.failed")  # not an attempt used up


def test_a_batch_the_provider_does_not_accept_is_sent_again_after_a_backoff(
        tmp_path: Path, server: BatchServer, start: Any) -> None:
    ws = workspace(tmp_path, server, retry_backoff_s=1.0)  # ~1 s, then ~2 s
    server.reject_creates = 2
    sets = ws.write_step("r1", 0, 0, success=True)
    d = start(ws)
    wait_until(lambda: server.rejected == 1 and all(
        (r := d.daemon.state.get(s.id)) and r.state == "failed" and r.next_retry_at
        for s in sets), 30, message="the sets waiting out the first refusal")
    wait_until(all_reported(ws), 60, message="every set reported")
    assert server.rejected == 2 and server.creates == 1 and len(server.billed) == 3
    assert len(ws.events("batch.error")) == 2 and not ws.events("batch.gave_up")
    assert len(ws.events("loss.queued")) == 9  # each set sent three times
    assert not ws.events("loss.failed")  # the sets did not fail: the batch was not accepted


def test_a_batch_never_accepted_gives_up_after_max_attempts(
        tmp_path: Path, server: BatchServer, start: Any) -> None:
    ws = workspace(tmp_path, server, max_attempts=2)
    server.reject_creates = 1000
    sets = ws.write_step("r1", 0, 0, success=True)
    d = start(ws)
    def given_up(s: Any) -> bool:
        rec = d.daemon.state.get(s.id)
        return bool(rec and rec.state == "failed" and rec.next_retry_at is None
                    and rec.reason and rec.reason.startswith("gave up after 2 batches"))

    wait_until(lambda: all(given_up(s) for s in sets), 60, message="every set given up")
    (gave_up,) = wait_until(lambda: ws.events("batch.gave_up"), 10, message="batch.gave_up")
    assert gave_up["level"] == "error" and gave_up["attempts"] == 2 and gave_up["sets"] == 3
    assert "not accepted" in gave_up["error"]
    assert stays(lambda: server.rejected == 2, 1.5)  # no third batch by itself
    assert not any(ws.has_report(s) for s in sets)
    # Each upload no batch reads is deleted, and the run is told its key went there.
    assert server.uploads == server.deleted == 2 and server.files == {}
    (said,) = ws.events("batch.key_at_provider")
    assert said["run"] == "r1" and said["provider"] == "openai"


def test_a_refused_batch_counts_against_max_attempts_across_a_restart(
        tmp_path: Path, server: BatchServer, start: Any) -> None:
    """The refusal is kept (the set's attempts, the record's create_error): a
    daemon stopped before it looked the refusal up, and started again, goes on
    counting instead of starting afresh."""
    ws = workspace(tmp_path, server, max_attempts=2, batch_poll_s=2.0, batch_poll_max_s=2.0)
    server.reject_creates = 1000
    sets = ws.write_step("r1", 0, 0, success=True)
    first = start(ws)
    wait_until(lambda: server.rejected == 1, 60, message="the first batch refused")
    first.stop()
    (path,) = records(ws)
    assert json.loads(path.read_text())["create_error"]  # kept for the next start
    d = start(ws)

    def given_up(s: Any) -> bool:
        rec = d.daemon.state.get(s.id)
        return bool(rec and rec.state == "failed" and rec.next_retry_at is None)

    wait_until(lambda: all(given_up(s) for s in sets), 60, message="every set given up")
    assert server.rejected == 2  # the first refusal counted after the restart
    assert all(d.daemon.state.get(s.id).attempts == 2 for s in sets)  # type: ignore[union-attr]
    assert stays(lambda: server.rejected == 2, 1.0)


def test_cancel_file_cancels_and_sends_the_sets_live(
        tmp_path: Path, server: BatchServer, start: Any) -> None:
    ws = workspace(tmp_path, server)
    server.plan = BatchPlan(latency_s=3600)
    ws.write_step("r1", 0, 0, success=True)
    start(ws)
    wait_until(lambda: ws.events("batch.submitted"), 60, message="batch.submitted")
    from skilltrain.daemon.service.batch import write_cancel_file

    write_cancel_file(ws.runs, "r1", live=True)
    wait_until(all_reported(ws), 60, message="every set reported live")
    assert server.cancels == 1 and ws.events("batch.cancelled")
    assert server.live_requests == 3 and server.creates == 1 and not server.billed
    assert not (ws.runs / "r1" / "CANCEL_BATCH").exists()


def test_inputs_changed_since_the_batch_was_sent_discard_the_reply(
        tmp_path: Path, server: BatchServer, start: Any) -> None:
    ws = workspace(tmp_path, server)
    server.plan = BatchPlan(latency_s=1.5)
    sets = ws.write_step("r1", 0, 0, works=["beta"], success=True)
    ws.write_step("r1", 0, 0, works=["alpha"], success=True)
    start(ws)
    wait_until(lambda: ws.events("batch.submitted"), 60, message="batch.submitted")
    scripts = ws.scripts("r1", 0, 0, "beta")
    (scripts / "ep02.txt").write_text(model_episode("r1", 0, 0, "beta", 2, version=1),
                                      encoding="utf-8")
    (discarded,) = wait_until(lambda: ws.events("loss.discarded"), 60,
                              message="loss.discarded")
    assert discarded["tokens_in"] > 0  # paid for all the same: in the run's spend
    wait_until(all_reported(ws), 60, message="redone")
    side = ws.read_sidecar(sets[0])
    assert side["model_episodes"]["ep02.txt"] == __import__("hashlib").sha256(
        (scripts / "ep02.txt").read_bytes()).hexdigest()
    assert server.creates == 2


def test_a_model_without_a_batch_price_says_so(
        tmp_path: Path, server: BatchServer, start: Any) -> None:
    ws = workspace(tmp_path, server, model="openai/loopback-model")
    sets = ws.write_step("r1", 0, 0, works=["beta"], success=True)
    start(ws)
    wait_until(lambda: ws.has_report(sets[0]), 60, message="reported")
    side = ws.read_sidecar(sets[0])
    assert side["cost_usd"] is None and side["mode"] == "batch"
    assert "cost unknown" in side["cost_note"]


def test_a_restart_resumes_polling_and_pays_once(
        tmp_path: Path, server: BatchServer, start: Any) -> None:
    ws = workspace(tmp_path, server)
    server.plan = BatchPlan(latency_s=2.0)
    ws.write_step("r1", 0, 0, success=True)
    first = start(ws)
    wait_until(lambda: ws.events("batch.submitted"), 60, message="batch.submitted")
    first.stop()
    assert len(records(ws)) == 1
    start(ws)
    wait_until(all_reported(ws), 60, message="reported after the restart")
    # The reports land a moment before the step is: wait for what is asserted.
    wait_until(lambda: ws.events("step.reported"), 10, message="step.reported")
    assert server.creates == 1 and len(server.billed) == 3
    assert stays(lambda: len(ws.events("step.reported")) == 1, 0.3)


def test_a_result_already_written_is_not_written_again(
        tmp_path: Path, server: BatchServer, start: Any) -> None:
    """A restart between a report's write and its record's update: not written twice."""
    ws = workspace(tmp_path, server)
    server.plan = BatchPlan(latency_s=1.0)
    sets = ws.write_step("r1", 0, 0, works=["beta"], success=True)
    first = start(ws)
    wait_until(lambda: ws.events("batch.submitted"), 60, message="batch.submitted")
    record = records(ws)[0]
    saved = record.read_text(encoding="utf-8")  # open, no outcome yet
    wait_until(lambda: ws.has_report(sets[0]) and not records(ws), 60, message="closed")
    first.stop()
    written = ws.sidecar(sets[0]).stat().st_mtime_ns
    record.write_text(saved, encoding="utf-8")
    start(ws)
    wait_until(lambda: not records(ws), 60, message="closed again")
    assert ws.sidecar(sets[0]).stat().st_mtime_ns == written
    assert ws.events("batch.completed")[-1]["written_before"] == 1
    assert server.creates == 1 and len(server.billed) == 1


def test_a_record_once_closed_is_not_written_back_by_a_result_handled_late(
        tmp_path: Path, server: BatchServer, start: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two results end on two threads: the last one closes the record; the other
    one's save, a moment later, must not write it back (a kill then would leave
    a closed batch's record, or its temp file, behind)."""
    from skilltrain.daemon.service import batch_store

    closed: list[batch_store.BatchRecord] = []
    remove = batch_store.remove
    monkeypatch.setattr(batch_store, "remove",
                        lambda runs, rec: (closed.append(rec), remove(runs, rec))[1])
    ws = workspace(tmp_path, server)
    ws.write_step("r1", 0, 0, works=["beta"], success=True)
    d = start(ws)
    wait_until(lambda: closed and not records(ws), 60, message="the record closed")
    d.daemon.batcher.results.save(closed[0])  # what the slower thread does next
    assert not records(ws) and not ws.temp_files()


def test_a_retired_report_comes_back_in_batch_mode_unsent_and_said_of_its_set(
        tmp_path: Path, server: BatchServer) -> None:
    # The batch transport asks for a retired report too: the set back with its
    # very inputs is in no batch, and its line names the set (the batch thread
    # has no job's context of its own).
    ws = workspace(tmp_path, server)
    ws.write_step("r1", 0, 0, success=True)
    run_once_in_process(ws)
    episode = ws.data / "alpha" / "human" / "ep06.txt"
    kept = episode.read_bytes()
    episode.unlink()
    run_once_in_process(ws)
    creates = server.creates
    episode.write_bytes(kept)

    run_once_in_process(ws)

    (back,) = [e for e in ws.events("loss.completed") if e.get("reused_from")]
    assert (back["run"], back["step"], back["work"], back["range"]) == ("r1", 0, "alpha", "04-06")
    assert back["job_id"] and back["cost_usd"] == 0
    assert server.creates == creates  # no batch: nothing else to report, 04-06 unsent
