"""What a loss job came to, and when its set is tried again: the retry policy
on its own (daemon/service/outcomes.py, core/backoff.py), with a clock the
test sets, a real state store, and no daemon, watcher or LLM. The look a
set needs next is in the Decision `record` returns; here it is applied to
the store as the owner (owner.py) applies it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.core import config, layout
from skilltrain.daemon.core.errors import (
    BadOutputError,
    InputsChangedError,
    LLMError,
    RefusedError,
)
from skilltrain.daemon.infra.state import SetState, StateStore
from skilltrain.daemon.service.observe import Fingerprint
from skilltrain.daemon.service.outcomes import Abandoned, Outcomes
from skilltrain.daemon.service.revisit import Revisit, Why

KEY = layout.SetKey("r1", 1, 2, "alpha", 1, 3)
FP = Fingerprint("sigs", "human", "template", "model")
NOW = 1_000_000.0
SETTLE_S = 7.0


class Recorder:
    """The events Outcomes said."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def emit(self, event: str, level: str = "info", **fields: Any) -> None:
        self.events.append((event, {"level": level, **fields}))


class Applied:
    """Outcomes, each Decision written to the store as the owner writes it; the look."""

    def __init__(self, outcomes: Outcomes, state: StateStore) -> None:
        self.outcomes = outcomes
        self.state = state

    @property
    def failures(self) -> int:
        return self.outcomes.failures

    def record(self, key: layout.SetKey, fp: Fingerprint, attempts: int, result: Any,
               error: BaseException | None) -> Revisit | None:
        decision = self.outcomes.record(key, fp, attempts, result, error)
        assert decision.send is None  # an outcome never sends: a look decides that
        if decision.state is not None:
            self.state.update(key.id, decision.state, **decision.changes)
        return decision.revisit


def outcomes(tmp_path: Path, rec: Recorder, **loss: Any) -> tuple[Applied, StateStore]:
    cfg = config.Config.model_validate(
        {"loss": {"max_attempts": 3, "retry_backoff_s": 10.0, "settle_s": SETTLE_S, **loss},
         "llm": {"backoff_max_s": 120.0}})
    state = StateStore(tmp_path / "runs", tmp_path / "state.sqlite3")
    return Applied(Outcomes(cfg, state, rec.emit, clock=lambda: NOW,
                            steps=None), state), state  # type: ignore[arg-type]


def test_a_failed_call_is_retried_after_a_doubling_jittered_backoff_up_to_max_attempts(
    tmp_path: Path,
) -> None:
    rec = Recorder()
    out, state = outcomes(tmp_path, rec)
    looks = [out.record(KEY, FP, attempts, None, LLMError("HTTP 500")) for attempts in range(3)]
    waits = [None if r is None or r.at is None else r.at - NOW for r in looks]
    # 10 s, then 20 s, each +-20 %; the third failure is the last (max_attempts 3).
    assert waits[0] is not None and 8.0 <= waits[0] <= 12.0
    assert waits[1] is not None and 16.0 <= waits[1] <= 24.0
    assert looks[2] is None
    assert all(r.key == KEY and r.why == Why.RETRY for r in looks[:2] if r is not None)
    assert [e["attempts"] for name, e in rec.events if name == "loss.failed"] == [1, 2, 3]
    assert rec.events[-1][1]["next_retry_s"] is None  # gave up: said so
    final = state.get(KEY.id)
    assert final is not None and final.state == SetState.FAILED and final.attempts == 3
    assert final.next_retry_at is None and out.failures == 3


def test_a_retry_after_longer_than_the_backoff_wins_and_is_capped(tmp_path: Path) -> None:
    rec = Recorder()
    out, _ = outcomes(tmp_path, rec)
    first = out.record(KEY, FP, 0, None, LLMError("HTTP 503", retry_after_s=90.0))
    assert first == Revisit(KEY, NOW + 90.0, Why.RETRY)
    second = out.record(KEY, FP, 1, None, LLMError("HTTP 503", retry_after_s=10_000.0))
    assert second == Revisit(KEY, NOW + 120.0, Why.RETRY)  # [llm] backoff_max_s


def test_a_rate_limited_call_is_retried_without_using_an_attempt(tmp_path: Path) -> None:
    rec = Recorder()
    out, state = outcomes(tmp_path, rec)
    looks = [out.record(KEY, FP, 0, None, LLMError("HTTP 429", retry_after_s=30.0,
                                                   rate_limited=True))
             for _ in range(5)]  # more than max_attempts: none of them counts
    assert [name for name, _ in rec.events] == ["loss.rate_limited"] * 5
    assert all(r is not None and r.at is not None and r.at >= NOW + 30.0 for r in looks)
    # Each in a row waits longer (10 s doubling, +-20 %), up to [llm] backoff_max_s.
    assert [e["in_a_row"] for _, e in rec.events] == [1, 2, 3, 4, 5]
    waits = [e["next_retry_s"] for _, e in rec.events]
    assert waits[:2] == [30.0, 30.0]  # the server's Retry-After is longer still
    assert 32 <= waits[2] <= 48 and 64 <= waits[3] <= 96 and 96 <= waits[4] <= 120
    final = state.get(KEY.id)
    assert final is not None and final.attempts == 0 and out.failures == 0


@pytest.mark.parametrize("error, event, state", [
    (RefusedError("ep02.txt is empty"), "loss.refused", SetState.REFUSED),
    (BadOutputError("the reply was cut off"), "loss.refused", SetState.FAILED),
    (InputsChangedError("ep02.txt changed during the call"), "loss.discarded",
     SetState.SETTLING),
    (Abandoned(), None, SetState.QUEUED),
])
def test_each_other_way_out_sets_its_state_and_says_it_once(
    tmp_path: Path, error: BaseException, event: str | None, state: SetState,
) -> None:
    rec = Recorder()
    out, store = outcomes(tmp_path, rec)
    look = out.record(KEY, FP, 0, None, error)
    assert [name for name, _ in rec.events] == ([event] if event else [])
    final = store.get(KEY.id)
    assert final is not None and final.state == state
    # Bad input waits for its files to change; a changed input settles again
    # (its settle wait starts afresh: [loss] settle_s from now); a bad reply
    # is retried; a shutdown leaves it for the next start.
    expected = {SetState.SETTLING: Why.RESETTLE, SetState.FAILED: Why.RETRY}.get(state)
    assert (look.why if look else None) == expected
    if state == SetState.SETTLING:
        assert look == Revisit(KEY, NOW + SETTLE_S, Why.RESETTLE)


def test_a_rate_limited_wait_starts_over_once_a_call_gets_through(tmp_path: Path) -> None:
    rec = Recorder()
    out, state = outcomes(tmp_path, rec)
    limited = LLMError("HTTP 429", rate_limited=True)
    for _ in range(3):
        out.record(KEY, FP, 0, None, limited)
    out.record(KEY, FP, 0, None, LLMError("HTTP 500"))  # the provider answered: not a limit
    final = state.get(KEY.id)
    assert final is not None and final.rate_limited == 0
    look = out.record(KEY, FP, 1, None, limited)
    assert rec.events[-1][1]["in_a_row"] == 1
    assert look is not None and look.at is not None and look.at - NOW <= 12.0
