"""A loopback provider with real rate limits, for the limiter's tests and the bench.

`RateLimits` is a responder for tests/llm_server.py's LLMServer: per API key
(the Authorization header), a token bucket of R requests per second (burst:
one second's worth) and, optionally, one of T tokens per minute (a request
costs its prompt's characters / 4 plus the reply's). Over either: 429, with
Retry-After (seconds, fractional), retry-after-ms, or no header at all.
Every reply, ok or 429, carries OpenAI's x-ratelimit-limit-/remaining-/reset-
requests and -tokens headers (resets as `0.05s`, `6m0s`). `set_rate()`
changes R mid-run (the provider halving a limit: its stated limit and its
real one alike); `stated = False` leaves the x-ratelimit-* headers out (a
provider that states nothing), also mid-run.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.llm_server import DEFAULT_REPORT, Reply, Request

RETRY_AFTER_FORMS = ("seconds", "ms", "none")


def go_duration(seconds: float) -> str:
    """OpenAI's reset format: `0.05s`, `1m30s`, `6m0s`."""
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{int(rest)}s"


@dataclass
class _Bucket:
    level: float
    at: float


@dataclass
class RateLimits:
    """R requests/s and T tokens/min per key; 429 when over (see the module note)."""

    requests_per_s: float
    tokens_per_min: float | None = None
    retry_after: str = "seconds"  # one of RETRY_AFTER_FORMS
    content: str = DEFAULT_REPORT
    stated: bool = True  # send the x-ratelimit-* headers
    clock: Callable[[], float] = time.monotonic
    served: int = 0
    limited: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _requests: dict[str, _Bucket] = field(default_factory=dict, repr=False)
    _tokens: dict[str, _Bucket] = field(default_factory=dict, repr=False)
    served_at: list[float] = field(default_factory=list, repr=False)

    def set_rate(self, requests_per_s: float) -> None:
        with self._lock:
            self.requests_per_s = requests_per_s
            for bucket in self._requests.values():
                bucket.level = min(bucket.level, requests_per_s)

    def __call__(self, request: Request) -> Reply:
        key = request.headers.get("authorization", "")
        cost = max(1, request.prompt_chars // 4) + max(1, len(self.content) // 4)
        with self._lock:
            now = self.clock()
            req = self._fill(self._requests, key, self.requests_per_s, self.requests_per_s, now)
            tok = None
            if self.tokens_per_min is not None:
                tok = self._fill(self._tokens, key, self.tokens_per_min,
                                 self.tokens_per_min / 60.0, now)
            wait_s = max((1 - req.level) / self.requests_per_s, 0.0)
            if tok is not None and self.tokens_per_min is not None:
                wait_s = max(wait_s, (cost - tok.level) / (self.tokens_per_min / 60.0))
            ok = req.level >= 1 and (tok is None or tok.level >= cost)
            if ok:
                req.level -= 1
                if tok is not None:
                    tok.level -= cost
                self.served += 1
                self.served_at.append(now)
            else:
                self.limited += 1
            headers = self._headers(req, tok)
        if ok:
            return dataclasses.replace(Reply.ok(self.content), headers=headers)
        return Reply(kind="error", code=429, headers=headers + self._retry_after(wait_s))

    def _fill(self, buckets: dict[str, _Bucket], key: str, capacity: float, per_s: float,
              now: float) -> _Bucket:
        bucket = buckets.setdefault(key, _Bucket(capacity, now))
        bucket.level = min(capacity, bucket.level + (now - bucket.at) * per_s)
        bucket.at = now
        return bucket

    def _headers(self, req: _Bucket, tok: _Bucket | None) -> tuple[tuple[str, str], ...]:
        if not self.stated:
            return ()
        r = self.requests_per_s
        headers = [
            ("x-ratelimit-limit-requests", str(int(r))),
            ("x-ratelimit-remaining-requests", str(max(0, int(req.level)))),
            ("x-ratelimit-reset-requests", go_duration(max(0.0, r - req.level) / r)),
        ]
        if tok is not None and self.tokens_per_min is not None:
            t = self.tokens_per_min
            headers += [
                ("x-ratelimit-limit-tokens", str(int(t))),
                ("x-ratelimit-remaining-tokens", str(max(0, int(tok.level)))),
                ("x-ratelimit-reset-tokens", go_duration(max(0.0, t - tok.level) / (t / 60))),
            ]
        return tuple(headers)

    def _retry_after(self, wait_s: float) -> tuple[tuple[str, str], ...]:
        wait_s = max(wait_s, 0.001)
        if self.retry_after == "seconds":
            return (("Retry-After", f"{wait_s:.3f}"),)
        if self.retry_after == "ms":
            return (("retry-after-ms", str(max(1, round(wait_s * 1000)))),)
        return ()

    def rate(self, since: float, until: float) -> float:
        """Requests served per second between two clock readings."""
        n = sum(1 for t in self.served_at if since <= t <= until)
        return n / max(until - since, 1e-9)
