"""The endpoints' limiters as the rest of the daemon meets them: one limiter
per endpoint (model + api_base), made on first use; a call's slot on its
endpoint's limiter; what each limiter does now, for `skilltrain status`.
The limiter itself, its rules and its arithmetic: llm_limit.py.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from ..core.errors import LLMError
from .llm_limit import Limiter, OnChange
from .llm_probe import PROBE_S, Probe


class Slot:
    """One call's hold on its endpoint's limiter (no limiter: always free).

    Taken before an attempt, given back when it ends with what happened, so
    that a call waiting out a backoff holds nothing. `keep_after_reply`: a
    successful reply's outcome is recorded but the slot kept until the next
    give_back() (a loss job holds it until its report and spend are
    recorded, so that the next job's budget check sees them).
    """

    def __init__(self, limiter: Limiter | None, *, keep_after_reply: bool = False) -> None:
        self.limiter = limiter
        self.held = False
        self.keep_after_reply = keep_after_reply
        self._generation = 0
        self._taken_at = 0.0

    async def take(self) -> None:
        if self.limiter is not None and not self.held:
            self._generation = await self.limiter.acquire()
            self._taken_at = self.limiter.clock()
            self.held = True

    def give_back(self, outcome: str = "unused", *, retry_after_s: float | None = None,
                  headers: Mapping[str, str] | None = None, tokens: int = 0,
                  blocked: tuple[str, str] | None = None) -> None:
        if self.limiter is not None and self.held:
            round_trip_s = self.limiter.clock() - self._taken_at
            if outcome == "ok" and self.keep_after_reply:
                self.keep_after_reply = False  # the next give_back() frees it
                self.limiter.record(self._generation, outcome, headers=headers, tokens=tokens,
                                    round_trip_s=round_trip_s)
                return
            self.held = False
            self.limiter.release(self._generation, outcome, retry_after_s=retry_after_s,
                                 headers=headers, tokens=tokens, blocked=blocked,
                                 round_trip_s=round_trip_s)


def describe(lim: Limiter, wall: float | None = None) -> dict[str, Any]:
    """What the limiter does now, for `skilltrain status` (kept on change only):
    "blocked" (a refused key: why, since when, the next probe), "stated"
    (paced on the provider's stated limit), "adaptive" (AIMD) or "fixed"."""
    wall = time.time() if wall is None else wall
    now = lim.clock()
    out: dict[str, Any] = {"limit": lim.limit, "requests_limit": lim.stated_limits[0],
                           "tokens_limit": lim.stated_limits[1]}
    if lim.blocked is not None:
        due = lim.prober.due if lim.prober.probe is not None else None
        return {**out, "mode": "blocked", "kind": lim.blocked[0],
                "reason": lim.blocked[1], "probe_s": lim.probe_s,
                "since": wall - (now - lim.blocked_since),
                "next_probe_at": None if due is None else wall + max(0.0, due - now)}
    mode = "fixed" if not lim.adaptive else \
        "stated" if lim.stated_limits != (None, None) else "adaptive"
    if mode == "stated" and lim.pace.rate is not None:
        out["paced_per_s"] = float(f"{lim.pace.rate * lim.pace.aim:.3g}")  # 39.2, 0.167
    return {**out, "mode": mode}


def endpoint_name(model: str, api_base: str | None) -> str:
    """A short, bounded label for an endpoint: `gpt-4o-mini@127.0.0.1:8000`."""
    name = model.rsplit("/", 1)[-1][:40]
    where = urlsplit(api_base).netloc[:40] if api_base else ""
    return f"{name}@{where}" if where else name


class Limiters:
    """One limiter per endpoint (model + api_base), made on first use."""

    def __init__(self, *, fixed: int | None, floor: int = 1, ceiling: int = 64,
                 on_change: OnChange | None = None,
                 probe: Callable[[str, str | None], Probe] | None = None,
                 probe_s: float = PROBE_S) -> None:
        self.fixed, self.floor, self.ceiling = fixed, floor, ceiling
        self.on_change = on_change
        self.probe, self.probe_s = probe, probe_s  # probe(model, api_base): that endpoint's
        self._by_endpoint: dict[tuple[str, str | None], Limiter] = {}

    def for_endpoint(self, model: str, api_base: str | None) -> Limiter:
        key = (model, api_base)
        limiter = self._by_endpoint.get(key)
        if limiter is None:
            # dict assignment is atomic: two threads racing make two, one is kept
            limiter = self._by_endpoint.setdefault(key, Limiter(
                endpoint_name(model, api_base), fixed=self.fixed, floor=self.floor,
                ceiling=self.ceiling, on_change=self.on_change,
                probe=None if self.probe is None else self.probe(model, api_base),
                probe_s=self.probe_s))
            if self.on_change is not None:  # a new endpoint: news for `status` only
                self.on_change("llm.endpoint", level="debug", endpoint=limiter.endpoint,
                               limit=limiter.limit)
        return limiter

    def all(self) -> list[Limiter]:
        return list(self._by_endpoint.values())

    def named(self, endpoint: str) -> Limiter | None:
        return next((lim for lim in self.all() if lim.endpoint == endpoint), None)

    def refusal(self, model: str, api_base: str | None) -> LLMError | None:
        """The endpoint is blocked (a refused key): what its calls are refused with."""
        limiter = self._by_endpoint.get((model, api_base))
        blocked = limiter is not None and limiter.blocked is not None
        return limiter.refusal() if blocked and limiter is not None else None

    def blocked(self) -> list[Limiter]:
        return [limiter for limiter in self.all() if limiter.blocked is not None]
