"""Pacing on the rate a provider states: calls spaced evenly at just under it.

A provider that states its window (x-ratelimit-limit-/remaining-/reset-
requests, anthropic-ratelimit-requests-*) refills it continuously, a token
bucket: `reset` is when it is full again. So every reply tells its refill
rate: (limit - remaining) / reset, `2400 - 2399` over `25ms` = 40 a second.
Remaining is a whole number rounded down, so a reading is an upper bound of
the rate (if the reset is not rounded up), and the rate is the least of the
last ESTIMATES readings. A reset given as a time of day in whole seconds
(Anthropic's RFC 3339 times, read against the reply's Date) may be up to two
seconds off: its reading takes two seconds off the reset, so it stays an
upper bound (a refill of one request "by 10:00:01" read at 10:00:00.1 is not
1.1 requests a second), and says nothing until the window is far enough from
full that the seconds no longer matter. A reading whose whole window would
take over MAX_WINDOW_S to refill is no rate to pace on (a daily quota stated
as the requests limit, as Groq does; a fixed window read early; a Unix time
where a duration belongs): those are left to AIMD and the holds.

Calls then start one every 1 / (rate x aim) seconds (GCRA: a theoretical
arrival time moved on by one interval per call, with BURST_S of slack so a
timer's lateness is not lost). `aim` starts at AIM, just under the limit; a
429 episode while paced lowers it by AIM_CUT (the readings were too high, or
another client shares the key), and successes bring it back up by AIM_STEP
for every AIM_STEP_S since the last 429 (by time, not by calls: a slow
endpoint recovers as fast as a quick one). Aiming at the limit itself, rather
than at a margin below it, is what reaches the rate the provider sells
(issue 36: 84-88 % before).

Runs on the LLM loop's thread, like the limiter that owns it: no locks.
"""
from __future__ import annotations

import math
from collections import deque

AIM = 0.98  # the share of the stated rate aimed at
AIM_CUT = 0.9  # a rate-limit episode while paced: aim this much lower
AIM_STEP = 0.01  # aim this much higher again (up to AIM) for every AIM_STEP_S of successes
AIM_STEP_S = 2.0  # with no 429: from 0.71 (three cuts) back to 0.98 in about a minute, at any rate
AIM_FLOOR = 0.5  # however many episodes, never below half the stated rate
BURST_S = 0.1  # a call may start this far ahead of its even spacing
ESTIMATES = 32  # readings of the refill rate kept; the rate is their least
MAX_WINDOW_S = 120.0  # a window that takes longer to refill is not a rate to pace on (a
# daily quota stated as the requests limit, a fixed window read early, a Unix time as reset)
MAX_INTERVAL_S = 60.0  # calls are never spaced further apart than this


class RatePacer:
    """The stated refill rate of one endpoint and the even spacing of its calls."""

    def __init__(self) -> None:
        self.rate: float | None = None  # requests a second the provider refills, once stated
        self.aim = AIM
        self._readings: deque[float] = deque(maxlen=ESTIMATES)
        self._next = 0.0  # when the next call is due (the clock of the limiter)
        self._grown_at = 0.0  # since when successes count towards the aim

    def observe(self, limit: int | None, left: int | None, reset_s: float | None,
                error_s: float = 0.0) -> None:
        """A reply's stated window: one more reading of the refill rate.
        `error_s`: how much earlier than `reset_s` the window may be full."""
        if limit is None or left is None or reset_s is None or left >= limit:
            return  # a full window, or no reset: says nothing of the rate
        refill_s = reset_s - error_s
        if not math.isfinite(refill_s) or refill_s <= 0:
            return  # too coarse to say
        if refill_s * limit / (limit - left) > MAX_WINDOW_S:
            return  # the whole window would take longer than a rate to pace on
        self._readings.append((limit - left) / refill_s)
        self.rate = min(self._readings)

    def restart(self) -> None:
        """The stated limit changed: older readings are of the old window (the
        rate stays until the next reading replaces it, so a raise is not
        held back by 32 readings of the old, lower rate)."""
        self._readings.clear()
        self._next = 0.0

    def forget(self) -> None:
        """The provider stopped stating its window: no pacing until it does again."""
        self._readings.clear()
        self.rate = None
        self._next = 0.0

    def ready(self, now: float) -> bool:
        return self.rate is None or now >= self._next - BURST_S

    def next_at(self) -> float:
        """When the next call may start (0.0: now, nothing is paced)."""
        return self._next - BURST_S if self.rate is not None else 0.0

    def took(self, now: float) -> None:
        """A call started: the next one is due an interval later."""
        if self.rate is not None:
            self._next = max(self._next, now) + min(MAX_INTERVAL_S, 1.0 / (self.rate * self.aim))

    def rate_limited(self, now: float, *, new_episode: bool) -> None:
        """A 429 although paced: the aim grows back from now; a new episode's
        first 429 also aims lower."""
        if new_episode:
            self.aim = max(AIM_FLOOR, self.aim * AIM_CUT)
        self._grown_at = now

    def succeeded(self, now: float) -> None:
        """A success: AIM_STEP more aim for every AIM_STEP_S since the last 429."""
        if self.aim >= AIM:
            self._grown_at = now
            return
        steps = int((now - self._grown_at) / AIM_STEP_S)
        if steps > 0:
            self.aim = min(AIM, self.aim + steps * AIM_STEP)
            self._grown_at += steps * AIM_STEP_S
