"""Which 429s of an endpoint are one rate-limit episode, and where its wall is.

The adaptive limiter (llm_limit.py) cuts once per episode and, near the wall
the last cut found, grows slowly (TCP CUBIC's plateau); this keeps the
episodes' clock and the successes' round trips that say both.
"""
from __future__ import annotations

import itertools
from collections import deque

EPISODE_S = 15.0  # 429s within this long of a cut are the same episode
PROBE_WINDOWS = 4  # near the last wall, the limit grows by one every this many windows
NEAR_WALL = 0.9  # "near": at this share of the wall or above


class Episodes:
    """Which 429s are one rate-limit episode, and what the provider served.

    A cut begins an episode and a generation. A later 429 is the same
    episode when its call was admitted under an older generation, or within
    the settling time after the cut (the longest wait the cutting 429
    stated: Retry-After, the requests' or the tokens' reset; at most
    EPISODE_S, EPISODE_S when it stated none: before the provider could
    refill, a refusal says nothing of the new limit), or when it comes back
    less than a success's round trip after the cut (one cut a round trip at
    most, as TCP: a provider refusing every call with `Retry-After: 0` in
    50 ms must not take the limit to the floor in a second).
    Successes are kept by when they came back, with a running mean of their
    round trip: the calls at once the provider served in the last round trip
    (TCP Westwood's estimate), and, read when a cut comes, the wall near
    which the limit only probes.
    """

    def __init__(self, keep: int) -> None:
        self.generation = 0
        self._cut_at: float | None = None
        self._settle_s = EPISODE_S
        self._ok_at: deque[float] = deque(maxlen=keep)
        self._round_trip_s: float | None = None
        self._wall: int | None = None  # calls served in a round trip when the last cut came
        self._probes = 0  # windows of successes since the limit last grew

    def same(self, generation: int, admitted_at: float, now: float) -> bool:
        if generation != self.generation or self._cut_at is None:
            return generation != self.generation
        return (admitted_at < self._cut_at + self._settle_s
                or now < self._cut_at + (self._round_trip_s or 0.0))

    def begin(self, now: float, settle_s: float | None) -> int:
        """A new episode; the calls served in the last round trip."""
        self.generation += 1
        self._cut_at = now
        self._settle_s = EPISODE_S if settle_s is None else min(EPISODE_S, max(0.0, settle_s))
        served = self.served(now)
        self._wall, self._probes = served or None, 0
        return served

    def lower_wall(self, limit: int) -> None:
        """The wall is no higher than `limit` (what slow start's burst-fed
        successes overstate)."""
        if self._wall is not None:
            self._wall = min(self._wall, limit)

    def restated(self, now: float, *, lower: bool) -> None:
        """The provider stated a new limit: what was served says nothing of it
        (no wall); a lower one is an episode for the calls admitted before."""
        if lower:
            self.generation += 1
            self._cut_at, self._settle_s = now, EPISODE_S
        self._wall, self._probes = None, 0

    def success(self, now: float, round_trip_s: float | None) -> None:
        self._ok_at.append(now)
        if round_trip_s is not None and round_trip_s >= 0:
            mean = self._round_trip_s
            self._round_trip_s = round_trip_s if mean is None \
                else mean + (round_trip_s - mean) * 0.1

    def served(self, now: float) -> int:
        """Successes in the last round trip: the calls at once the provider just served."""
        since = now - (self._round_trip_s or 0.0)
        return sum(1 for _ in itertools.takewhile(lambda at: at >= since, reversed(self._ok_at)))

    def may_grow(self, limit: int) -> bool:
        """After a window of successes: near the wall, one step every PROBE_WINDOWS."""
        past = self._wall is not None and limit >= self._wall * NEAR_WALL
        self._probes += 1
        if past and self._probes < PROBE_WINDOWS:
            return False
        self._probes = 0
        return True
