"""The jobs' bookkeeping on its own (daemon/service/jobs.py): one look or one
job per set at a time with a look asked for meanwhile made afterwards, and
the budget said once per run. Real state store; no daemon, LLM or loop.
(The retry policy of a job's outcome: test_outcomes.py.)"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from skilltrain.daemon.infra.state import StateStore
from skilltrain.daemon.service.jobs import Budget, Claims

SET = "r1/epoch_01/step_01/alpha/01-03"


def started(claims: Claims) -> Future[None]:
    return claims.start_job(SET, Future)


def test_a_look_while_a_job_runs_is_made_once_after_it() -> None:
    claims = Claims()
    started(claims)
    assert claims.has_job(SET)
    assert not claims.claim_look(SET) and not claims.claim_look(SET)  # coalesced
    assert claims.end_job(SET)  # one look afterwards
    assert not claims.has_job(SET)
    assert claims.claim_look(SET)
    assert not claims.end_look(SET)  # nothing more was asked


def test_two_looks_at_once_are_one_and_the_second_is_made_afterwards() -> None:
    claims = Claims()
    assert claims.claim_look(SET)
    assert not claims.claim_look(SET)
    assert claims.end_look(SET)  # the caller looks once more
    assert claims.claim_look(SET)


def test_a_look_that_ends_while_a_job_runs_leaves_the_again_to_the_job() -> None:
    claims = Claims()
    assert claims.claim_look(SET)
    started(claims)  # the look submitted a job
    assert not claims.claim_look(SET)  # a hint meanwhile
    assert not claims.end_look(SET)  # not now: the job is running
    assert claims.end_job(SET)  # the job's end makes it


def test_a_job_with_nothing_asked_meanwhile_asks_for_no_look() -> None:
    claims = Claims()
    started(claims)
    assert claims.jobs() and not claims.end_job(SET) and claims.jobs() == []


def test_the_budget_is_reached_at_its_limit_and_said_once_per_run(tmp_path: Path) -> None:
    said: list[dict[str, Any]] = []
    state = StateStore(tmp_path / "runs", tmp_path / "state.sqlite3")
    budget = Budget(2.0, state, lambda event, **f: said.append({"event": event, **f}))
    assert not budget.reached("r1")  # nothing spent
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
    assert not Budget(None, state, lambda *a, **k: None).reached("r1")  # no limit set
