"""The one owner of a set's life on its own (daemon/service/owner.py).

A set is free or claimed: a look that finds it claimed is remembered and
made once when the claim ends; a look that sends a report keeps the claim
until the transport's outcome is applied, so nothing in between sends it
again; sets a restart finds in a provider batch are claimed before any look.
A real state store; transports, revisits and steps are recorders. The
budget is here too (it decides with a Decision the owner applies).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.core import dataset, layout
from skilltrain.daemon.core.notify import Heartbeat
from skilltrain.daemon.infra.state import BUDGET_REASON, SetState, StateStore
from skilltrain.daemon.service.budget import Budget
from skilltrain.daemon.service.decision import NOTHING, Decision, Outcome, Ticket
from skilltrain.daemon.service.observe import Fingerprint
from skilltrain.daemon.service.owner import SetOwner
from skilltrain.daemon.service.revisit import Revisit, Why

KEY = layout.SetKey("r1", 1, 1, "alpha", 1, 3)
FP = Fingerprint("sigs", "human", "template", "model")
WORK = dataset.Work(name="alpha", root=Path("/nowhere"), title="Alpha", explicit_ranges=None)


class Transport:
    """Keeps every ticket it is sent and the outcome its owner waits on."""

    def __init__(self, reason: str | None = None, wants: bool = True) -> None:
        self.QUEUED_REASON = reason
        self._wants = wants
        self.sent: list[tuple[Ticket, Outcome]] = []

    def send(self, ticket: Ticket) -> Outcome:
        outcome = Outcome()
        self.sent.append((ticket, outcome))
        return outcome

    def wants(self, key: layout.SetKey) -> bool:
        return self._wants


class Recorder:
    def __init__(self) -> None:
        self.looks: list[Revisit] = []
        self.checked: list[layout.StepKey] = []
        self.events: list[str] = []

    def ask(self, *revisits: Revisit | None) -> None:
        self.looks += [r for r in revisits if r is not None]

    def check_unless_open(self, step: layout.StepKey) -> None:
        self.checked.append(step)

    def emit(self, event: str, level: str = "info", **fields: Any) -> None:
        self.events.append(event)


class Bench:
    def __init__(self, tmp_path: Path, *, batch: Transport | None = None) -> None:
        self.state = StateStore(tmp_path / "runs", tmp_path / "state.sqlite3")
        self.seen = Recorder()
        self.live = Transport()
        self.owner = SetOwner(self.state, self.seen.emit, revisits=self.seen,  # type: ignore[arg-type]
                              steps=self.seen, heartbeat=Heartbeat(),  # type: ignore[arg-type]
                              live=self.live, batch=batch)  # type: ignore[arg-type]
        self.evaluations = 0

    def look(self, decision: Decision) -> None:
        def evaluate(key: layout.SetKey) -> Decision:
            self.evaluations += 1
            return decision
        self.owner.look(KEY, evaluate)

    def state_of(self) -> SetState:
        rec = self.state.get(KEY.id)
        assert rec is not None
        return rec.state


SEND = Decision(send=Ticket(KEY, WORK, FP, attempts=2))


def test_a_look_that_sends_holds_the_set_until_its_outcome_is_applied(tmp_path: Path) -> None:
    bench = Bench(tmp_path)
    bench.look(SEND)
    ((ticket, outcome),) = bench.live.sent
    rec = bench.state.get(KEY.id)
    assert rec is not None and rec.state == SetState.QUEUED and rec.attempts == 2
    assert rec.fingerprint == FP.as_json()
    assert bench.seen.events == ["set.ready", "loss.queued"]
    for _ in range(3):  # a hint, a resync, a settle look: remembered, not evaluated
        bench.look(SEND)
    assert bench.evaluations == 1 and len(bench.live.sent) == 1 and bench.owner.held(KEY.id)
    outcome.note(SetState.RUNNING)  # the transport's progress, written by the owner
    assert bench.state_of() == SetState.RUNNING
    retry = Revisit(KEY, 123.0, Why.RETRY)
    outcome.set_result(Decision.write(SetState.FAILED, reason="HTTP 500", attempts=3,
                                      revisit=retry))
    assert bench.state_of() == SetState.FAILED and not bench.owner.held(KEY.id)
    # Its own look, and one now for the looks asked for meanwhile (once).
    assert bench.seen.looks == [retry, Revisit(KEY)]
    assert bench.seen.checked == [KEY.step_key]  # the step barrier after each outcome


def test_an_outcome_with_no_look_asked_meanwhile_asks_only_for_its_own(tmp_path: Path) -> None:
    bench = Bench(tmp_path)
    bench.look(SEND)
    bench.live.sent[0][1].set_result(Decision.write(SetState.DONE, reason=None))
    assert bench.state_of() == SetState.DONE and bench.seen.looks == []
    bench.look(NOTHING)  # free again: evaluated
    assert bench.evaluations == 2


def test_a_look_during_a_look_is_made_once_afterwards(tmp_path: Path) -> None:
    bench = Bench(tmp_path)
    inner: list[bool] = []

    def evaluate(key: layout.SetKey) -> Decision:
        bench.owner.look(KEY, lambda k: pytest.fail("evaluated while claimed"))
        inner.append(bench.owner.held(KEY.id))
        return Decision.write(SetState.WAITING, reason="incomplete")

    bench.owner.look(KEY, evaluate)
    assert inner == [True] and bench.seen.looks == [Revisit(KEY)]
    assert bench.state_of() == SetState.WAITING and not bench.owner.held(KEY.id)


def test_a_cancelled_outcome_ends_the_claim_and_writes_nothing(tmp_path: Path) -> None:
    bench = Bench(tmp_path)
    bench.look(SEND)
    assert bench.live.sent[0][1].cancel()  # shutting down before it ran
    assert bench.state_of() == SetState.QUEUED and not bench.owner.held(KEY.id)
    assert bench.seen.looks == [] and bench.seen.checked == []


def test_a_set_of_a_run_in_batch_mode_goes_to_the_batch_transport(tmp_path: Path) -> None:
    batch = Transport(reason="gathered for the next batch")
    bench = Bench(tmp_path, batch=batch)
    bench.look(SEND)
    assert len(batch.sent) == 1 and bench.live.sent == []
    rec = bench.state.get(KEY.id)
    assert rec is not None and rec.reason == "gathered for the next batch"
    live_only = Bench(tmp_path / "b", batch=Transport(wants=False))
    live_only.look(SEND)
    assert len(live_only.live.sent) == 1


def test_sets_a_restart_finds_in_a_batch_are_claimed_before_any_look(tmp_path: Path) -> None:
    bench = Bench(tmp_path)
    ticket, outcome = Ticket(KEY, WORK, FP, 0), Outcome()
    bench.owner.adopt([(ticket, outcome, "in batch b1")])
    rec = bench.state.get(KEY.id)
    assert rec is not None and rec.state == SetState.QUEUED and rec.reason == "in batch b1"
    bench.look(SEND)  # the first scan: remembered, nothing sent
    assert bench.evaluations == 0 and bench.live.sent == []
    outcome.set_result(Decision.write(SetState.DONE, reason=None))
    assert bench.state_of() == SetState.DONE and bench.seen.looks == [Revisit(KEY)]


def test_an_evaluation_that_raises_ends_its_claim(tmp_path: Path) -> None:
    bench = Bench(tmp_path)

    def broken(key: layout.SetKey) -> Decision:
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError):
        bench.owner.look(KEY, broken)
    assert not bench.owner.held(KEY.id)


def test_the_budget_is_reached_at_its_limit_and_said_once_per_run(tmp_path: Path) -> None:
    said: list[dict[str, Any]] = []
    state = StateStore(tmp_path / "runs", tmp_path / "state.sqlite3")
    budget = Budget(2.0, state, lambda event, **f: said.append({"event": event, **f}),
                    runs=tmp_path / "runs")
    assert not budget.reached("r1") and budget.hold(KEY) is None  # nothing spent
    state.add_spend("r1", 100, 100, 0, 1.5)
    assert not budget.reached("r1")
    state.add_spend("r1", 100, 100, 0, 0.5)  # exactly the limit
    threads = [threading.Thread(target=budget.reached, args=["r1"]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert budget.reached("r1") and not budget.reached("r2")
    assert [(s["event"], s["run"]) for s in said] == [("budget.reached", "r1")]
    assert budget.hold(KEY) == Decision.write(SetState.HELD, reason=BUDGET_REASON)
    assert not Budget(None, state, lambda *a, **k: None, runs=tmp_path).reached("r1")


def test_progress_noted_before_the_owner_listens_is_written_when_it_does(
        tmp_path: Path) -> None:
    class Quick(Transport):
        def send(self, ticket: Ticket) -> Outcome:
            outcome = super().send(ticket)
            outcome.note(SetState.RUNNING)  # the transport started before the owner listened
            return outcome

    bench = Bench(tmp_path)
    bench.owner.live = Quick()
    bench.look(SEND)
    assert bench.state_of() == SetState.RUNNING


def test_a_transport_that_cannot_take_the_ticket_ends_the_claim(tmp_path: Path) -> None:
    class Broken(Transport):
        def send(self, ticket: Ticket) -> Outcome:
            raise OSError("no room")

    bench = Bench(tmp_path)
    bench.owner.live = Broken()
    with pytest.raises(OSError):
        bench.look(SEND)
    assert not bench.owner.held(KEY.id)  # the next look may send it
