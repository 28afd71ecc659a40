"""The one backoff policy (daemon/core/backoff.py) and each stage's numbers:
the waits every stage had before it shared the policy, kept."""

from __future__ import annotations

import pytest

from skilltrain.daemon.core import backoff, config
from skilltrain.daemon.core.backoff import Backoff

LOW, HIGH = (lambda a, b: a), (lambda a, b: b)  # the ends of every jitter range


def cfg(**sections: dict[str, object]) -> config.Config:
    return config.Config.model_validate(sections)


def test_a_wait_doubles_from_its_base_and_stops_at_its_cap() -> None:
    policy = Backoff(2.0, cap_s=10.0)
    assert [policy.delay_s(n) for n in range(1, 6)] == [2.0, 4.0, 8.0, 10.0, 10.0]
    assert policy.delay_s(0) == 2.0  # no failure counted yet: the base wait


def test_a_retry_after_wins_when_later_and_is_capped_on_its_own() -> None:
    policy = Backoff(10.0, retry_after_max_s=60.0)
    assert policy.delay_s(1, retry_after_s=5.0) == 10.0
    assert policy.delay_s(1, retry_after_s=45.0) == 45.0
    assert policy.delay_s(1, retry_after_s=3600.0) == 60.0


def test_a_loss_job_doubles_with_twenty_percent_jitter() -> None:
    policy = backoff.loss_job(cfg(loss={"retry_backoff_s": 10.0}))
    assert [policy.delay_s(n, uniform=LOW) for n in (1, 2, 3)] == pytest.approx([8, 16, 32])
    assert [policy.delay_s(n, uniform=HIGH) for n in (1, 2, 3)] == pytest.approx([12, 24, 48])
    # No cap of its own: [llm] backoff_max_s caps only what a server asks for.
    assert policy.delay_s(10, uniform=HIGH) == pytest.approx(10 * 2**9 * 1.2)


def test_a_rate_limited_job_doubles_up_to_the_larger_of_its_base_and_the_llm_cap() -> None:
    policy = backoff.rate_limited(cfg(loss={"retry_backoff_s": 10.0}, llm={"backoff_max_s": 50}))
    assert [policy.delay_s(n, uniform=LOW) for n in (1, 2, 3, 4, 9)] == pytest.approx(
        [8, 16, 32, 40, 40])
    assert policy.delay_s(1, retry_after_s=500.0, uniform=HIGH) == 50.0
    big_base = backoff.rate_limited(cfg(loss={"retry_backoff_s": 300.0}, llm={"backoff_max_s": 50}))
    assert big_base.delay_s(3, uniform=LOW) == pytest.approx(240.0)  # never under its base


def test_the_writer_doubles_without_jitter_and_the_optimizer_waits_the_same() -> None:
    writer = backoff.writer(cfg(writer={"retry_backoff_s": 3.0}))
    assert [writer.delay_s(n) for n in (1, 2, 3)] == [3.0, 6.0, 12.0]
    own = backoff.optimizer(cfg(optimizer={"retry_backoff_s": 7.0}))
    assert [own.delay_s(n) for n in (1, 2, 3)] == [7.0, 7.0, 7.0]
    borrowed = backoff.optimizer(cfg(loss={"retry_backoff_s": 9.0}))  # its key unset
    assert borrowed.delay_s(2) == 9.0


def test_an_llm_calls_attempts_wait_anywhere_up_to_a_capped_doubling() -> None:
    policy = backoff.llm_call(config.LLMConfig(backoff_initial_s=1.0, backoff_max_s=5.0))
    assert [policy.delay_s(n, uniform=HIGH) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]
    assert policy.delay_s(4, uniform=LOW) == 0.0  # full jitter
    assert policy.delay_s(1, retry_after_s=3.0, uniform=LOW) == 3.0
