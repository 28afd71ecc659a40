"""Pacing on a provider's stated rate (issue 36), the rule on its own: the refill
rate read off the headers, calls spaced evenly at just under it, the aim lowered
by a 429 episode and raised again by successes; and the limiter that uses it."""

from __future__ import annotations

import time

import pytest

from skilltrain.daemon.commands.tail_format import _f_llm_limit_changed
from skilltrain.daemon.infra.llm_limit import Limiter
from skilltrain.daemon.infra.llm_pace import (
    AIM,
    AIM_FLOOR,
    AIM_STEP,
    AIM_STEP_S,
    BURST_S,
    RatePacer,
)
from tests.test_llm_limit import limiter, run


def test_the_rate_is_the_least_reading_of_limit_minus_remaining_over_reset() -> None:
    pace = RatePacer()
    pace.observe(2400, 2400, 0.0)  # a full window says nothing of the rate
    pace.observe(None, 10, 1.0)
    assert pace.rate is None and pace.ready(0.0) and pace.next_at() == 0.0
    pace.observe(20, 19, 1767225600.0)  # a Unix time where a duration belongs
    pace.observe(20, 19, float("inf"))
    pace.observe(14400, 14399, 6.0)  # Groq: requests per DAY as the limit (a 24 h window)
    assert pace.rate is None  # none of them a rate to pace on
    pace.observe(2400, 2399, 0.025)  # OpenAI's own example: 2400/min, 25 ms for one
    assert pace.rate == pytest.approx(40.0)
    pace.observe(40, 39, 0.0125)  # remaining rounded down: a reading too high is ignored
    assert pace.rate == pytest.approx(40.0)
    pace.observe(20, 0, 1.0)  # the provider halved it: at once
    assert pace.rate == pytest.approx(20.0)
    pace.restart()  # the stated limit went back up: the old readings go, the rate stays
    assert pace.rate == pytest.approx(20.0)
    pace.observe(40, 0, 1.0)
    assert pace.rate == pytest.approx(40.0)  # not held at 20 for 32 more readings
    pace.forget()
    assert pace.rate is None and pace.ready(123.0)


def test_calls_start_evenly_spaced_at_the_aim_with_a_little_slack() -> None:
    pace = RatePacer()
    pace.observe(40, 0, 1.0)  # 40 a second
    interval = 1.0 / (40 * AIM)
    started = 0
    while pace.ready(0.0):  # at one instant: only the slack's worth go
        pace.took(0.0)
        started += 1
    assert started == int(BURST_S / interval) + 1
    assert pace.next_at() == pytest.approx(started * interval - BURST_S)
    # Over a second of a fine clock: the aim's rate, not more.
    now, n = 0.0, 0
    pace = RatePacer()
    pace.observe(40, 0, 1.0)
    while now < 10.0:
        if pace.ready(now):
            pace.took(now)
            n += 1
        now += 0.001
    assert n / 10.0 == pytest.approx(40 * AIM, rel=0.02)


def test_a_429_episode_lowers_the_aim_and_successes_bring_it_back() -> None:
    pace = RatePacer()
    for _ in range(40):
        pace.rate_limited(0.0, new_episode=True)
    assert pace.aim == AIM_FLOOR
    pace.rate_limited(10.0, new_episode=False)  # a 429 of the same episode: no lower
    assert pace.aim == AIM_FLOOR
    pace.succeeded(11.0)
    assert pace.aim == AIM_FLOOR  # a second of successes: not yet
    pace.succeeded(10.0 + AIM_STEP_S * 10)  # by time, not by calls: a slow endpoint too
    assert pace.aim == pytest.approx(AIM_FLOOR + 10 * AIM_STEP)
    pace.succeeded(10.0 + AIM_STEP_S * 100)
    assert pace.aim == AIM

    async def scenario() -> None:
        lim, events, clock = limiter()
        # The first stated window ends slow start: paced, the limit is only a cap.
        lim.release(await lim.acquire(), "ok", headers={
            "x-ratelimit-limit-requests": "20", "x-ratelimit-remaining-requests": "19",
            "x-ratelimit-reset-requests": "50ms"})
        assert lim.pace.rate == pytest.approx(20.0) and lim.limit == 64
        (paced,) = [e for e in events if e["event"] == "llm.limit_changed"]
        assert paced["reason"] == "paced on the stated rate" and paced["rate_per_s"] == 20.0
        assert "limit 4 -> 64 (paced on the stated rate: 20/s)" in " ".join(
            _f_llm_limit_changed(paced))
        gens = [await lim.acquire() for _ in range(2)]  # the slack: 0.1 s at 19.6/s
        assert not lim._room()  # the next one waits for its turn, not for a slot
        clock.now += 1.0 / (20 * AIM)
        assert lim._room()
        lim.release(gens[0], "rate_limited", headers={
            "x-ratelimit-limit-requests": "20", "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": "1s"})
        assert lim.pace.aim == pytest.approx(AIM * 0.9) and lim.limit == 51
        assert 0 < lim.hold_until - clock.now <= 0.05 + 1e-9  # one request's refill
        for g in gens[1:]:
            lim.release(g, "ok")

    run(scenario())


def test_anthropic_whole_second_resets_never_read_as_a_slow_rate() -> None:
    """4000 requests a minute (66.7/s), one used, `reset` the next whole second:
    read naively, 0.1 s before that second, it would be 10/s; a second's
    error taken off, it says nothing until the window is far from full."""
    from datetime import UTC, datetime

    from skilltrain.daemon.infra.llm_headers import read_rate_headers

    def at(seconds_from_now: float) -> str:
        when = datetime.fromtimestamp(time.time() + seconds_from_now, UTC)
        return when.strftime("%Y-%m-%dT%H:%M:%SZ")  # Anthropic's form: whole seconds

    def headers(left: int, reset_in: float) -> dict[str, str]:
        return {"anthropic-ratelimit-requests-limit": "4000",
                "anthropic-ratelimit-requests-remaining": str(left),
                "anthropic-ratelimit-requests-reset": at(reset_in)}

    pace = RatePacer()
    window = read_rate_headers(headers(3999, 0.9))
    assert window.requests_reset_error_s == 2.0
    pace.observe(window.requests_limit, window.requests_left, window.requests_reset_s,
                 window.requests_reset_error_s)
    assert pace.rate is None  # too coarse to say
    window = read_rate_headers(headers(0, 60.0))  # spent: a whole minute to refill
    pace.observe(window.requests_limit, window.requests_left, window.requests_reset_s,
                 window.requests_reset_error_s)
    assert pace.rate is not None and 4000 / 60 <= pace.rate <= 4000 / 57
    assert read_rate_headers({"x-ratelimit-reset-requests": "25ms"}).requests_reset_error_s == 0


def test_a_waiter_is_never_left_without_a_timer_when_nothing_is_in_flight() -> None:
    """Two lost wakeups the paced limiter had (an independent review found them;
    one explains a limiter test idle for 120 s under load): an acquire() in the
    loop iteration in which the pacing timer fell due cancelled that timer and
    armed none; a release() whose two clock reads straddled the due time did
    the same. With nothing in flight, nothing else would ever wake the waiter."""
    import asyncio

    class TickingClock:
        def __init__(self) -> None:
            self.now, self.tick = 1000.0, 0.0

        def __call__(self) -> float:
            t = self.now
            self.now += self.tick  # a pause between two reads of the clock
            return t

    async def admitted(waiter: asyncio.Future[int]) -> bool:
        try:
            await asyncio.wait_for(asyncio.shield(waiter), 1.0)
            return True
        except TimeoutError:
            return False

    async def acquire_after_the_due_time() -> None:
        lim, _, clock = limiter()
        lim.pace.observe(60, 59, 1.0)  # one a second
        g = await lim.acquire()
        b = asyncio.ensure_future(lim.acquire())
        await asyncio.sleep(0)
        lim.release(g, "ok")
        clock.now = lim.pace.next_at() + 0.01  # due; the timer has not run yet
        c = asyncio.ensure_future(lim.acquire())
        await asyncio.sleep(0)
        assert await admitted(b)
        c.cancel()  # its turn is a paced interval away: not what this is about

    async def release_straddling_the_due_time() -> None:
        clock = TickingClock()
        lim = Limiter("m@h", fixed=None, clock=clock)
        lim.pace.observe(60, 59, 1.0)
        g = await lim.acquire()
        b = asyncio.ensure_future(lim.acquire())
        await asyncio.sleep(0)
        clock.now, clock.tick = lim.pace.next_at() - 0.0005, 0.001
        lim.release(g, "ok")  # _room() just before the due time, _arm_timer() just after
        clock.tick, clock.now = 0.0, clock.now + 10.0
        assert await admitted(b)

    run(acquire_after_the_due_time())
    run(release_straddling_the_due_time())
