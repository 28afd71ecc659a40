"""The evaluation of one set, decision by decision (daemon/service/reconcile.py).

Each way out of `Reconciler.evaluate` on its own, applied by the real owner
(owner.py): the state it records, the next look it asks for (a Revisit), and
whether it sends the set for a report. Real files under tmp_path, a real
state store, discovery, settle clock, budget and owner; a clock the test
sets; no daemon, scheduler, watcher or LLM (the ticket a set would get is
recorded, not run).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.core import config, layout
from skilltrain.daemon.core.notify import Heartbeat
from skilltrain.daemon.core.templates import PromptTemplates
from skilltrain.daemon.infra.state import SetState, StateStore
from skilltrain.daemon.service import reconcile
from skilltrain.daemon.service.budget import Budget
from skilltrain.daemon.service.decision import NOTHING, Outcome, Ticket
from skilltrain.daemon.service.discovery import Discovery
from skilltrain.daemon.service.observe import Fingerprint
from skilltrain.daemon.service.owner import SetOwner
from skilltrain.daemon.service.reconcile import Reconciler
from skilltrain.daemon.service.revisit import Revisit, Why
from skilltrain.daemon.service.settle import SettleClock
from tests.daemon_helpers import Workspace, build_workspace

SETTLE_S = 30.0


class RecordingTransport:
    """Records each ticket sent; its outcome ends at once (nothing decided) unless held."""

    QUEUED_REASON = None

    def __init__(self) -> None:
        self.submitted: list[tuple[layout.SetKey, Fingerprint, int]] = []
        self.hold = False
        self.held: list[Outcome] = []

    def send(self, ticket: Ticket) -> Outcome:
        self.submitted.append((ticket.key, ticket.fp, ticket.attempts))
        outcome = Outcome()
        if self.hold:
            self.held.append(outcome)
        else:
            outcome.set_result(NOTHING)
        return outcome


class RecordingRevisits:
    """The looks the owner asks for; the earliest of a look's is what `evaluate` returns."""

    def __init__(self) -> None:
        self.asked: list[Revisit] = []

    def serve(self, *parts: Any) -> None:
        pass

    def ask(self, *revisits: Revisit | None) -> None:
        self.asked += [r for r in revisits if r is not None]


class FakeLoop:
    def __init__(self) -> None:
        self.writing_steps: set[layout.StepKey] = set()

    def writing(self, step: layout.StepKey) -> bool:
        return step in self.writing_steps


class FakeSteps:
    def serve(self, look: Any) -> None:
        pass

    def optimized(self, step: layout.StepKey) -> bool:
        return False

    def check(self, step: layout.StepKey, keys: Any = None) -> None:
        pass

    def check_unless_open(self, step: layout.StepKey) -> None:
        pass

    def reopen(self, key: layout.SetKey) -> None:
        pass


class Bench:
    """A Reconciler over a real workspace, its clock in the test's hand."""

    def __init__(self, tmp_path: Path, **loss: Any) -> None:
        self.ws: Workspace = build_workspace(tmp_path, "http://127.0.0.1:9/v1",
                                             works={"alpha": 3}, settle_s=SETTLE_S)
        cfg = config.load(self.ws.config_path)
        cfg = cfg.model_copy(update={"loss": cfg.loss.model_copy(update=loss)})
        self.cfg = cfg
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.now = 2_000_000_000.0  # far ahead of the files' mtimes: settled by mtime
        self.state = StateStore(cfg.paths.runs, cfg.paths.state)
        self.state.load()
        discovery = Discovery(cfg, self.state, self.emit)
        discovery.load_works()
        settle = SettleClock(cfg.loss.settle_s, cfg.paths.runs, discovery.ignore)
        stopping = threading.Event()
        self.revisits = RecordingRevisits()
        self.budget = Budget(cfg.llm.budget_usd, self.state, self.emit, runs=cfg.paths.runs)
        self.jobs = RecordingTransport()
        self.loop = FakeLoop()
        self.owner = SetOwner(self.state, self.emit, revisits=self.revisits,  # type: ignore[arg-type]
                              steps=FakeSteps(), heartbeat=Heartbeat(),  # type: ignore[arg-type]
                              live=self.jobs, batch=None)
        self.reconciler = Reconciler(
            cfg, self.state, self.emit, clock=lambda: self.now, stopping=stopping,
            revisits=self.revisits, settle=settle, discovery=discovery,  # type: ignore[arg-type]
            owner=self.owner, budget=self.budget, steps=FakeSteps(),  # type: ignore[arg-type]
            loop=self.loop, templates=PromptTemplates(cfg.paths.prompts),  # type: ignore[arg-type]
            heartbeat=Heartbeat(), scanned=lambda dirs: None)
        (s,) = self.ws.write_step("r1", 1, 1)
        self.set = s
        self.key = layout.SetKey(s.run, s.epoch, s.step, s.work, s.first, s.last)

    def emit(self, event: str, level: str = "info", **fields: Any) -> None:
        self.events.append((event, {"level": level, **fields}))

    def evaluate(self) -> Revisit | None:
        """One look, applied by the owner; the earliest look it asked for (now first)."""
        before = len(self.revisits.asked)
        self.reconciler.look(self.key)
        asked = self.revisits.asked[before:]
        return min(asked, key=lambda r: -1.0 if r.at is None else r.at, default=None)

    def settled(self) -> Fingerprint:
        """Past the settle wait: the set's first look starts it, the second ends it."""
        first = self.evaluate()
        assert first is not None and first.why == Why.SETTLE
        self.now = first.at + 1 if first.at is not None else self.now
        assert self.evaluate() is None
        ((_, fp, _),) = self.jobs.submitted[-1:]
        return fp

    def record(self) -> Any:
        rec = self.state.get(self.key.id)
        assert rec is not None
        return rec

    def write_report(self, sidecar: dict[str, Any] | None = None) -> None:
        report = self.key.report_path(self.cfg.paths.runs)
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text("the report\n", encoding="utf-8")
        report.with_suffix(".json").write_text(json.dumps(sidecar or {}), encoding="utf-8")


@pytest.fixture
def bench(tmp_path: Path) -> Bench:
    return Bench(tmp_path)


def test_a_set_in_a_step_the_loops_writer_is_writing_waits_for_the_writer(bench: Bench) -> None:
    bench.loop.writing_steps.add(bench.key.step_key)
    assert bench.evaluate() is None  # the writer's end asks for a scan
    assert bench.record().state == SetState.WAITING
    assert bench.record().reason == "the loop's writer is running"
    assert bench.jobs.submitted == []


def test_a_set_on_its_way_to_a_report_is_not_looked_at_beside_it_but_once_more_after(
    bench: Bench,
) -> None:
    bench.jobs.hold = True
    bench.settled()  # sent: claimed until its outcome
    assert bench.evaluate() is None and bench.evaluate() is None
    assert len(bench.jobs.submitted) == 1 and bench.record().state == SetState.QUEUED
    bench.jobs.held.pop().set_result(NOTHING)
    assert bench.revisits.asked[-1] == Revisit(bench.key)  # its end: look again


def test_a_look_asked_for_while_it_ran_returns_a_look_now(
    bench: Bench, monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = reconcile.observe

    def observe(key: layout.SetKey, *args: Any) -> Any:
        # A hint meanwhile: coalesced, not evaluated beside this look.
        bench.owner.look(key, lambda k: pytest.fail("evaluated twice at once"))
        return real(key, *args)

    monkeypatch.setattr(reconcile, "observe", observe)
    assert bench.evaluate() == Revisit(bench.key)  # not the settle wait: decided afresh now


def test_an_incomplete_range_waits_and_asks_for_no_look(bench: Bench) -> None:
    bench.ws.scripts("r1", 1, 1, "alpha").joinpath("ep02.txt").unlink()
    assert bench.evaluate() is None  # the missing file's event is the next look
    assert bench.record().state == SetState.WAITING
    assert bench.record().reason is not None and "ep02" in bench.record().reason
    assert [e for e, _ in bench.events if e == "set.unusable"] == []


def test_an_empty_episode_is_looked_at_when_it_should_have_been_written(bench: Bench) -> None:
    episode = bench.ws.scripts("r1", 1, 1, "alpha") / "ep02.txt"
    episode.write_bytes(b"")
    bench.now = episode.stat().st_mtime  # just created: being written
    look = bench.evaluate()
    assert look is not None and look.why == Why.SETTLE
    assert look.at == pytest.approx(episode.stat().st_mtime + SETTLE_S + 0.05)
    assert bench.record().state == SetState.WAITING
    assert [e for e, _ in bench.events if e == "set.unusable"] == []
    bench.now = look.at  # still empty after the settle wait: said once, counted
    assert bench.evaluate() is None and bench.evaluate() is None
    assert [e for e, _ in bench.events if e == "set.unusable"] == ["set.unusable"]
    assert bench.reconciler.failures == 1


def test_a_complete_range_settles_first_then_gets_a_job(bench: Bench) -> None:
    look = bench.evaluate()
    assert look == Revisit(bench.key, bench.now + SETTLE_S, Why.SETTLE)  # first sighting
    assert bench.record().state == SetState.SETTLING and bench.jobs.submitted == []
    bench.now += SETTLE_S - 1
    assert bench.evaluate() == look  # the same wait, not a new one
    bench.now += 1
    assert bench.evaluate() is None
    ((key, _, attempts),) = bench.jobs.submitted
    assert key == bench.key and attempts == 0


def test_a_range_that_changes_while_settling_starts_its_wait_again(bench: Bench) -> None:
    first = bench.evaluate()
    assert first is not None
    bench.now += 10
    (bench.ws.scripts("r1", 1, 1, "alpha") / "ep01.txt").write_text("changed\n")
    assert bench.evaluate() == Revisit(bench.key, bench.now + SETTLE_S, Why.SETTLE)


def test_a_report_of_exactly_these_inputs_is_done(bench: Bench) -> None:
    fp = bench.settled()
    bench.write_report()
    bench.state.update(bench.key.id, SetState.RUNNING, fingerprint=fp.as_json())
    assert bench.evaluate() is None
    assert bench.record().state == SetState.DONE and len(bench.jobs.submitted) == 1


def test_after_a_lost_state_the_sidecar_says_the_report_is_current(bench: Bench) -> None:
    fp = bench.settled()
    bench.write_report({"inputs": {"human_sha256": fp.human, "template_sha256": fp.template,
                                   "model_id": fp.model_id}, "model_stat_sigs": fp.sigs})
    bench.state.forget(bench.key.id)
    assert bench.evaluate() is None
    assert bench.record().state == SetState.DONE and len(bench.jobs.submitted) == 1


def test_a_report_whose_inputs_changed_is_stale_while_they_settle_then_redone(
    bench: Bench,
) -> None:
    fp = bench.settled()
    bench.write_report()
    bench.state.update(bench.key.id, SetState.DONE, fingerprint=fp.as_json())
    (bench.ws.scripts("r1", 1, 1, "alpha") / "ep03.txt").write_text("a new draft\n")
    look = bench.evaluate()
    assert look == Revisit(bench.key, bench.now + SETTLE_S, Why.SETTLE)
    assert bench.record().state == SetState.STALE
    bench.now = look.at
    assert bench.evaluate() is None
    assert [e for e, _ in bench.events if e == "set.stale"] == ["set.stale"]
    assert len(bench.jobs.submitted) == 2


def test_an_input_refused_once_is_not_tried_again_until_it_changes(bench: Bench) -> None:
    fp = bench.settled()
    bench.state.update(bench.key.id, SetState.REFUSED, refused_fingerprint=fp.as_json())
    assert bench.evaluate() is None and len(bench.jobs.submitted) == 1
    (bench.ws.scripts("r1", 1, 1, "alpha") / "ep01.txt").write_text("fixed\n")
    look = bench.evaluate()  # changed: settles, then runs
    assert look is not None and look.why == Why.SETTLE


def test_a_failed_set_waits_for_its_backoff_then_runs_with_its_attempts(bench: Bench) -> None:
    fp = bench.settled()
    retry_at = bench.now + 100
    bench.state.update(bench.key.id, SetState.FAILED, fingerprint=fp.as_json(), attempts=2,
                       next_retry_at=retry_at)
    assert bench.evaluate() == Revisit(bench.key, retry_at, Why.RETRY)
    assert len(bench.jobs.submitted) == 1
    bench.now = retry_at
    assert bench.evaluate() is None
    assert bench.jobs.submitted[-1][2] == 2  # the attempts so far go on counting


def test_a_set_that_used_its_attempts_stays_failed_until_its_input_changes(
    bench: Bench,
) -> None:
    fp = bench.settled()
    bench.state.update(bench.key.id, SetState.FAILED, fingerprint=fp.as_json(),
                       attempts=bench.cfg.loss.max_attempts, next_retry_at=None)
    assert bench.evaluate() is None and len(bench.jobs.submitted) == 1
    assert bench.record().state == SetState.FAILED


def test_a_run_over_its_budget_holds_the_set(tmp_path: Path) -> None:
    bench = Bench(tmp_path)
    bench.budget.limit_usd = 1.0
    bench.state.add_spend("r1", 10, 10, 0, 1.0)
    first = bench.evaluate()
    assert first is not None and first.at is not None
    bench.now = first.at
    assert bench.evaluate() is None
    assert bench.record().state == SetState.HELD and bench.jobs.submitted == []
    assert [e for e, _ in bench.events if e == "budget.reached"] == ["budget.reached"]
