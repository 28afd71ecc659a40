"""How many LLM calls one provider endpoint gets at once: a fixed number, or adaptive.

Adaptive (`[loss] concurrency = "adaptive"`), one limiter per endpoint
(model + api_base), after inspect_ai's adaptive connections and Netflix's
concurrency-limits:

- slow start: the limit doubles after each window of successes (a window is
  as many successes as the limit) up to DOUBLE_UP_TO, then grows by half
  (RFC 3742's limited slow start), until the first rate-limit episode;
- then AIMD: one more after each window of successes, x0.8 on a 429 (or a
  503 that says Retry-After), once per rate-limit episode: the 429s of calls
  admitted under a limit already cut, or admitted within the longest wait
  the cutting 429 stated (at most EPISODE_S, EPISODE_S when it stated none),
  or back within a success's round trip of the cut, are the same episode,
  not a collapse to the floor (inspect_ai's adaptive connections: x0.8,
  15 s; llm_episodes.py). A provider whose bucket refills in 25 ms shows
  within a round trip whether the cut was enough, and a call admitted under
  the cut limit that is still refused then says it was not (a flat 15 s
  debounce there let a limit 25 % too high run into the wall for 15 s: 4-13 %
  of calls refused in the bench);
- the first 429 ends slow start, and its cut also keeps no more calls than
  the provider served in the last round trip, and no fewer than the window
  before the last growth (all successes): TCP Westwood's estimate of what
  got through, so one step past the wall is one episode, not two;
- from NEAR_WALL of the calls served in a round trip when the last cut
  came (the wall), the limit grows by one every PROBE_WINDOWS windows, not
  every window (TCP CUBIC's plateau): a provider's burst allowance hides a
  limit above its rate until the burst is spent, so a quick climb past the
  wall meets it far above (44 -> 52 at 40/s, then 8-18 429s an episode: 2 %
  of calls). Slow start's last successes were fed by that burst: the wall
  is then no higher than the cut (a climb 51 -> 56 on them refused 15 calls
  in a second at 40/s);
- a 5xx or a timeout pauses growth (the window of successes starts again)
  without shrinking: an overloaded server is not a rate limit;
- a Retry-After holds every call of the endpoint back until it has passed,
  unless the 429 states the provider's window (x-ratelimit-reset-requests,
  anthropic-ratelimit-requests-reset): then only the refused call waits its
  Retry-After, and the endpoint pauses for the window's refill alone;
- paced on the stated rate: a provider that states its requests window
  (limit, remaining, reset) tells its refill rate, and calls start evenly
  spaced at just under it (llm_pace.py); the calls-at-once limit then skips
  slow start and is only a cap. Without a stated rate, before the wall: when
  a reply's remaining requests are no more than the calls in flight, or the
  remaining tokens would not cover them, no new call starts until enough of
  the window refills (x-ratelimit-reset-*: `0.2s`, `6m0s`; Anthropic: an
  RFC 3339 time);
- the limit only grows while the calls actually reach it (a limit nobody
  uses says nothing about the provider).

A key the provider refuses (insufficient_quota, billing, 401/403: llm.py's
`refused_key`) is not a rate limit: no wait fixes it. It blocks the
endpoint: one `llm.blocked` event, the calls waiting for a slot and every
new one refused at once (LLMError with `blocked`, their sets wait: not an
attempt), and every `probe_s` one small real call (llm_probe.py) asks
whether the key works again; when it does, `llm.unblocked` and the calls go on.

Quiet by default: state changes only, with counts. A slow-start step,
the start of pacing and an episode's cut are `llm.limit_changed` (with the
429s, holds and seconds held since the last line); the stated limit
appearing, changing or going (llm_headers.GONE_AFTER replies without it) is
`llm.pacing`. A changed figure re-anchors the calls-at-once limit at once,
in proportion (2400 -> 1200 a minute: half the calls); a cut begins a new
episode. A step of one and each hold are debug lines only; Prometheus counts
every hold and its seconds (docs/metrics.md).

A call gives its slot back when it ends, also while it waits out a backoff
(llm.acomplete), and takes one again for its next attempt.

Everything here runs on the LLM loop's thread (daemon/llm_loop.py): no locks.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core.errors import LLMError
from .llm_episodes import Episodes
from .llm_headers import RateWindow, StatedLimits, read_rate_headers, refill_s
from .llm_pace import RatePacer
from .llm_probe import PROBE_S, Probe, Prober

OnChange = Callable[..., None]  # (event name, **fields)
SLOW_START_LIMIT = 4  # where an adaptive limit starts (within its floor and ceiling)
DOUBLE_UP_TO = 16  # slow start doubles the limit up to this, then grows it by half
CUT = 0.8  # a rate-limit episode's cut (inspect_ai's adaptive connections)
MAX_HOLD_S = 300.0  # a reset header further out than this is not believed


@dataclass
class Usage:
    """Counters of one endpoint, read by the metrics at scrape time."""

    rate_limited: int = 0
    calls: int = 0
    blocked: int = 0  # times the endpoint was blocked (a refused key)
    holds: int = 0  # times no new call could start for a while (Retry-After, headers)
    held_s: float = 0.0  # seconds of those holds


def slow_start_step(limit: int) -> int:
    """x2 up to DOUBLE_UP_TO, then x1.5 (RFC 3742's limited slow start): the step
    that meets the wall overshoots it by half of it at most, not all of it (a
    doubling 32 -> 64 against 40 at once refused 10-20 calls of 600)."""
    if limit < DOUBLE_UP_TO:
        return min(DOUBLE_UP_TO, limit * 2)
    return limit + max(1, limit // 2)


def _longest_wait(window: RateWindow, retry_after_s: float | None) -> float | None:
    """The longest wait a 429 stated (Retry-After, the requests' or the tokens' reset)."""
    waits = [w for w in (retry_after_s, window.requests_reset_s, window.tokens_reset_s)
             if w is not None]
    return max(waits) if waits else None


class Limiter:
    """The slots of one endpoint. `fixed` is a number: a plain semaphore (today's behaviour)."""

    def __init__(self, endpoint: str, *, fixed: int | None, floor: int = 1, ceiling: int = 64,
                 on_change: OnChange | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 probe: Probe | None = None, probe_s: float = PROBE_S) -> None:
        self.endpoint = endpoint
        self.adaptive = fixed is None
        self.floor, self.ceiling = (fixed, fixed) if fixed is not None else (floor, ceiling)
        self.limit = fixed if fixed is not None else max(floor, min(SLOW_START_LIMIT, ceiling))
        self.slow_start = self.adaptive
        self.in_flight = 0
        self.hold_until = 0.0
        self.usage = Usage()
        self.on_change = on_change or (lambda *a, **k: None)
        self.clock = clock
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._successes = 0  # in the current window
        self._peak = 0  # most calls in flight or waiting since the limit last moved
        self._timer: asyncio.TimerHandle | None = None
        self._tokens_per_call = 0.0  # a running mean, for the remaining-tokens check
        self.stated = StatedLimits()  # the provider's limits, as its replies say them
        self.episodes = Episodes(keep=4 * self.ceiling + 16)
        self._grown_from: int | None = None  # slow start's last window, all successes
        self._since = Usage()  # counts at the last logged line (its counts are the change)
        # A refused key (quota, billing, auth): why, since when; None while it works.
        self.blocked: tuple[str, str] | None = None
        self.blocked_since = 0.0
        self.prober = Prober(probe, probe_s, clock=clock, works=self.unblock, said=self._probed)
        self.pace = RatePacer()  # the provider's stated rate, once its replies state it

    # ------------------------------------------------------------- slots
    async def acquire(self) -> int:
        """Wait for a slot; the generation it was granted under (give it to release)."""
        if self.blocked is not None:
            raise self.refusal()
        self._peak = max(self._peak, self.in_flight + len(self._waiters) + 1)
        if not self._waiters and self._room():
            self._admit()
            return self.episodes.generation
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._arm_timer()
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.in_flight -= 1  # granted as we were cancelled: hand it on (its
                # paced interval stays spent: one lost, not worth tracking grants)
                self._wake()
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise
        return self.episodes.generation

    def release(self, generation: int, outcome: str, *, retry_after_s: float | None = None,
                headers: Mapping[str, str] | None = None, tokens: int = 0,
                blocked: tuple[str, str] | None = None,
                round_trip_s: float | None = None) -> None:
        """A slot given back. `outcome`: "ok", "rate_limited", "error", "blocked"
        (with `blocked`: the kind and the provider's words) or "unused";
        `round_trip_s`: how long the call held its slot."""
        self.in_flight -= 1
        self.record(generation, outcome, retry_after_s=retry_after_s, headers=headers,
                    tokens=tokens, round_trip_s=round_trip_s)
        if outcome == "blocked" and blocked is not None:
            self.block(*blocked)
        self._wake()

    def record(self, generation: int, outcome: str, *, retry_after_s: float | None = None,
               headers: Mapping[str, str] | None = None, tokens: int = 0,
               round_trip_s: float | None = None) -> None:
        """What a call came to, for the limit (its slot may still be held)."""
        if outcome != "unused":
            self.usage.calls += 1
        if outcome == "rate_limited":
            self.usage.rate_limited += 1
        if self.adaptive:
            if outcome == "ok":
                self.episodes.success(self.clock(), round_trip_s)
                self._grow()
            elif outcome == "error":
                self._successes = 0  # a 5xx, a timeout: growth waits, nothing is cut
            elif outcome == "rate_limited":
                # A 429 that states the provider's window (its reset) holds the
                # endpoint only as long as that window says (_pace, below); its
                # Retry-After (whole seconds) is the refused call's own wait.
                window = read_rate_headers(headers) if headers else RateWindow()
                self._cut(generation, self.clock() - (round_trip_s or 0.0),
                          retry_after_s if window.requests_reset_s is None else None,
                          settle_s=_longest_wait(window, retry_after_s))
            if tokens > 0:
                self._tokens_per_call += (tokens - self._tokens_per_call) * 0.2
            if headers or outcome == "ok":  # a reply without them: the headers may be gone
                self._pace(headers or {})

    # ------------------------------------------------------------- a refused key
    def refusal(self) -> LLMError:
        """What a call of a blocked endpoint is refused with (its set waits)."""
        assert self.blocked is not None
        kind, said = self.blocked
        return LLMError(f"the provider refuses the API key ({kind}): no call to "
                        f"{self.endpoint} until it works again (probed every "
                        f"{self.probe_s:g}s): {said}", blocked=kind)

    def block(self, kind: str, said: str) -> None:
        """The provider refused the key: no new call until a probe passes. One event."""
        if self.blocked is not None:
            return
        self.blocked, self.blocked_since = (kind, said), self.clock()
        self.usage.blocked += 1
        self.prober.start()
        self.on_change("llm.blocked", level="error", endpoint=self.endpoint, kind=kind, reason=said,
                       probe_s=self.probe_s, in_flight=self.in_flight, waiting=len(self._waiters))
        error = self.refusal()
        while self._waiters:  # their sets wait too, without an attempt
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)

    def _probed(self, said: str, probes: int) -> None:
        # the next probe's time is news for `status` only
        self.on_change("llm.probed", level="debug", endpoint=self.endpoint, said=said,
                       probes=probes)

    def unblock(self) -> None:
        if self.blocked is None:
            return
        kind = self.blocked[0]
        self.blocked = None
        self.prober.stop()
        self.on_change("llm.unblocked", endpoint=self.endpoint, kind=kind,
                       blocked_s=round(self.clock() - self.blocked_since, 1),
                       probes=self.prober.count)

    @property
    def probe_s(self) -> float:
        return self.prober.probe_s

    def close(self) -> None:
        """Shutting down: no probe left scheduled or running."""
        self.prober.stop()

    def _room(self) -> bool:
        now = self.clock()
        return self.in_flight < self.limit and now >= self.hold_until and self.pace.ready(now)

    def _admit(self) -> None:
        self.in_flight += 1
        self.pace.took(self.clock())

    def _wake(self) -> None:
        while self._waiters and self._room():
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._admit()
                waiter.set_result(None)
        self._arm_timer()

    def _arm_timer(self) -> None:
        """Wake the waiters when a hold ends or the next paced call is due: armed
        whenever only time holds them, even if it just passed (a timer due in this
        iteration is cancelled here; with nothing in flight none would wake them)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._waiters and self.in_flight < self.limit:
            delay = max(0.0, max(self.hold_until, self.pace.next_at()) - self.clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self._wake)

    # ------------------------------------------------------------- the limit
    def _grow(self) -> None:
        self.pace.succeeded(self.clock())
        self._successes += 1
        if self._successes < self.limit:
            return
        used = self._peak >= self.limit
        self._successes, self._peak = 0, self.in_flight + len(self._waiters)
        if not used or self.limit >= self.ceiling:
            return
        if not self.slow_start and not self.episodes.may_grow(self.limit):
            return
        new = min(self.ceiling, slow_start_step(self.limit) if self.slow_start else self.limit + 1)
        # The window before (all successes), at most 2/3 of a step the ceiling cut short.
        self._grown_from = min(self.limit, new * 2 // 3) if self.slow_start else None
        self._set(new, "slow start" if self.slow_start else "calls succeeded")

    def _cut(self, generation: int, admitted_at: float, retry_after_s: float | None, *,
             settle_s: float | None) -> None:
        """A 429 of a call admitted at `admitted_at`: hold for its Retry-After
        (`retry_after_s`) and, once per episode, cut the limit; `settle_s`: the
        longest wait it stated, how soon a cut can show (llm_episodes)."""
        slow_start, self.slow_start = self.slow_start, False
        if retry_after_s is not None and retry_after_s > 0:
            self._hold(retry_after_s, "Retry-After")
        now = self.clock()
        same_episode = self.episodes.same(generation, admitted_at, now)
        if self.pace.rate is not None:
            self.pace.rate_limited(now, new_episode=not same_episode)
        if same_episode:
            return  # admitted under a limit already cut, or before the cut could show
        served = self.episodes.begin(now, settle_s)
        self._successes = 0
        new = int(self.limit * CUT)
        if slow_start and self._grown_from is not None:  # the growth overshot: keep what
            new = min(new, max(self._grown_from, served))  # got through, at least the window
            self.episodes.lower_wall(new)  # before it; a burst fed it: no wall above the cut
        self._set(max(self.floor, min(self.limit - 1, new)), "rate limited",
                  served_in_round_trip=served)

    def _set(self, new: int, reason: str, **extra: Any) -> None:
        if new == self.limit:
            return
        old, self.limit = self.limit, new
        self._peak = self.in_flight + len(self._waiters)
        if reason == "calls succeeded":  # a step of one: not a change of state
            self.on_change("llm.limit_changed", level="debug", endpoint=self.endpoint,
                           limit=new, previous=old, reason=reason, in_flight=self.in_flight)
            return
        self.on_change("llm.limit_changed", endpoint=self.endpoint, limit=new, previous=old,
                       reason=reason, in_flight=self.in_flight, **extra, **self._counts())

    def _counts(self) -> dict[str, float]:
        """What happened since the last logged line: 429s, holds, seconds held."""
        now, since = self.usage, self._since
        self._since = Usage(rate_limited=now.rate_limited, holds=now.holds, held_s=now.held_s)
        return {"rate_limited": now.rate_limited - since.rate_limited,
                "holds": now.holds - since.holds,
                "held_s": round(now.held_s - since.held_s, 3)}

    def _hold(self, seconds: float, reason: str) -> None:
        now = self.clock()
        until = now + min(seconds, MAX_HOLD_S)
        if until <= self.hold_until + 0.05:
            return  # already held at least as long
        started = self.hold_until <= now
        self.usage.held_s += until - max(now, self.hold_until)
        self.hold_until = until
        if started:
            self.usage.holds += 1  # counted, not logged: a hold is not a change of state
            self.on_change("llm.held", level="debug", endpoint=self.endpoint,
                           wait_s=round(seconds, 3), reason=reason, limit=self.limit,
                           in_flight=self.in_flight)

    @property
    def stated_limits(self) -> tuple[int | None, int | None]:
        return self.stated.limits

    def _restate(self, old: tuple[int | None, int | None],
                 stated: tuple[int | None, int | None]) -> None:
        """The provider's stated limit appeared, changed or went: one line, and the
        calls-at-once limit re-anchored on the new figure at once (2400 -> 1200 a
        minute: half as many calls), not left to meet 429s first."""
        was, now = old[0], stated[0]
        if stated == (None, None):
            self.pace.forget()
        previous = self.limit
        if was and now and was != now:
            self.pace.restart()
            new = max(self.floor, min(self.ceiling, round(self.limit * now / was)))
            lower = new < self.limit  # the calls admitted under the old figure: this episode
            if lower:
                self._successes = 0
            self.episodes.restated(self.clock(), lower=lower)
            self.slow_start = False
            self.limit = new
            self._peak = self.in_flight + len(self._waiters)
            self._wake()
        change = "gone" if stated == (None, None) else "stated" if old == (None, None) \
            else "changed"
        self.on_change("llm.pacing", endpoint=self.endpoint, change=change,
                       requests_limit=now, tokens_limit=stated[1],
                       previous_requests_limit=was, previous_tokens_limit=old[1],
                       limit=self.limit, previous=previous, in_flight=self.in_flight,
                       **self._counts())

    def _pace(self, headers: Mapping[str, str]) -> None:
        """What a reply says of the provider's window: its stated limit (restated
        on a change), a reading of its refill rate, and a hold when it is spent."""
        window = read_rate_headers(headers)
        if (change := self.stated.read(window.requests_limit, window.tokens_limit)) is not None:
            self._restate(*change)
        self._observe_rate(window)
        if self.pace.rate is not None:  # paced: only a spent window waits, one request's refill
            if window.requests_left == 0:
                self._hold(refill_s(window.requests_reset_s, window.requests_limit, 0, 1),
                           "requests spent")
        elif window.requests_left is not None:
            short = self.in_flight + 1 - window.requests_left  # requests we lack
            if short > 0:
                self._hold(refill_s(window.requests_reset_s, window.requests_limit,
                                     window.requests_left, short), "requests nearly spent")
        if window.tokens_left is not None and self._tokens_per_call > 0:
            need = self._tokens_per_call * (self.in_flight + 1) - window.tokens_left
            if need > 0:
                self._hold(refill_s(window.tokens_reset_s, window.tokens_limit,
                                     window.tokens_left, need), "tokens nearly spent")

    def _observe_rate(self, window: RateWindow) -> None:
        """One more reading of the stated refill rate; the first one ends slow start:
        the pacing keeps the provider's rate, the calls-at-once limit is a cap."""
        known = self.pace.rate is not None
        self.pace.observe(window.requests_limit, window.requests_left, window.requests_reset_s,
                          window.requests_reset_error_s)
        if not known and self.pace.rate is not None and self.slow_start:
            self.slow_start = False
            self._set(self.ceiling, "paced on the stated rate",
                      rate_per_s=round(self.pace.rate, 2))
