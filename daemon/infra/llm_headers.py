"""What a provider says of its rate limit in its headers, in one shape.

OpenAI's x-ratelimit-limit-/remaining-/reset-requests and -tokens,
Anthropic's anthropic-ratelimit-*, and litellm's `llm_provider-` copies of
them; how long a window takes to refill a few units; the stated limits as
a run of replies says them (StatedLimits).
"""
from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime

HOLD_WITHOUT_RESET_S = 1.0  # nearly spent, no reset header: pause this long
GONE_AFTER = 10  # ok replies in a row without rate-limit headers: the provider stopped stating
# them (not 1: replies to calls sent before a change may still come back with them)


def refill_s(reset_s: float | None, limit: int | None, left: int, short: float) -> float:
    """How long until `short` more units are free. Providers refill their window
    continuously (x-ratelimit-reset-* is when it is full again): the wait for
    a few units is that share of the reset time, not all of it."""
    if reset_s is None:
        return HOLD_WITHOUT_RESET_S
    if limit is None or limit <= left:
        return reset_s
    return min(reset_s, reset_s * short / (limit - left))


# ------------------------------------------------------------------ headers
@dataclass(frozen=True)
class RateWindow:
    requests_limit: int | None = None
    requests_left: int | None = None
    requests_reset_s: float | None = None
    tokens_limit: int | None = None
    tokens_left: int | None = None
    tokens_reset_s: float | None = None
    # How far off requests_reset_s may be: an RFC 3339 time in whole seconds
    # (Anthropic's), read against the reply's Date (whole seconds too), is
    # off by up to two seconds; a duration (`25ms`) by nothing that matters.
    requests_reset_error_s: float = 0.0


_PREFIX = "llm_provider-"  # litellm repeats every provider header with this prefix


def read_rate_headers(headers: Mapping[str, str]) -> RateWindow:
    """OpenAI's x-ratelimit-* and Anthropic's anthropic-ratelimit-* in one shape."""
    h: dict[str, str] = {}
    for key, value in headers.items():
        name = str(key).lower()
        h.setdefault(name.removeprefix(_PREFIX), str(value))

    def first(*names: str) -> str | None:
        return next((h[n] for n in names if n in h), None)

    requests_reset = first("x-ratelimit-reset-requests", "anthropic-ratelimit-requests-reset")
    # A reset given as a time of day is read against the provider's own clock
    # (its Date header) when it gives one: ours may be off by more than the window.
    now = _http_date(h.get("date"))
    return RateWindow(
        requests_limit=_int(first("x-ratelimit-limit-requests",
                                  "anthropic-ratelimit-requests-limit")),
        tokens_limit=_int(first("x-ratelimit-limit-tokens", "anthropic-ratelimit-tokens-limit",
                                "anthropic-ratelimit-input-tokens-limit")),
        requests_left=_int(first("x-ratelimit-remaining-requests",
                                 "anthropic-ratelimit-requests-remaining")),
        requests_reset_s=parse_reset(requests_reset, now),
        requests_reset_error_s=reset_error_s(requests_reset),
        tokens_left=_int(first("x-ratelimit-remaining-tokens",
                               "anthropic-ratelimit-tokens-remaining",
                               "anthropic-ratelimit-input-tokens-remaining")),
        tokens_reset_s=parse_reset(first("x-ratelimit-reset-tokens",
                                         "anthropic-ratelimit-tokens-reset",
                                         "anthropic-ratelimit-input-tokens-reset"), now),
    )


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(float(value))
    except ValueError:
        return None


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")


_WHOLE_SECOND_TIME = re.compile(r"\d{4}-\d\d-\d\d[Tt ]\d\d:\d\d:\d\d([Zz]|[+-]\d\d:?\d\d)?$")


def reset_error_s(value: str | None) -> float:
    """How coarse a reset value is: a time of day in whole seconds, less the
    reply's Date (whole seconds, or our own clock), is off by up to 2 s; a
    duration by nothing that matters."""
    if not value or not _WHOLE_SECOND_TIME.match(value.strip()):
        return 0.0
    return 2.0


def _http_date(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def parse_reset(value: str | None, now: float | None = None) -> float | None:
    """Seconds until a window resets: `0.2s`, `6m0s`, `1h2m3.5s`, `20ms`, `12` (seconds),
    or an RFC 3339 time (Anthropic). None when unreadable."""
    if not value:
        return None
    text = value.strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if parts and "".join(n + u for n, u in parts) == text:
        scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
        return sum(float(n) * scale[u] for n, u in parts)
    try:
        at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if at.tzinfo is None:
        return None
    return max(0.0, at.timestamp() - (time.time() if now is None else now))


class StatedLimits:
    """The provider's stated limits (requests, tokens) as its replies say them.

    A new figure counts once two replies in a row say it: a straggler (a reply
    to a call sent before the change) must not flap it back. The figures are
    gone after GONE_AFTER replies in a row without them (AIMD alone again).
    """

    def __init__(self) -> None:
        self.limits: tuple[int | None, int | None] = (None, None)
        self._unstated = 0  # replies in a row without a stated limit
        self._candidate: tuple[tuple[int | None, int | None], int] = ((None, None), 0)

    def read(self, requests: int | None, tokens: int | None) -> tuple[
            tuple[int | None, int | None], tuple[int | None, int | None]] | None:
        """One reply's figures: (old, new) when the stated limits change, else None."""
        stated = (requests, tokens)
        old = self.limits
        if stated == (None, None):
            self._unstated += 1
            if old == (None, None) or self._unstated < GONE_AFTER:
                return None
        else:
            self._unstated = 0
            seen = self._candidate[1] + 1 if stated == self._candidate[0] else 1
            self._candidate = (stated, 0 if stated == old else seen)
            if stated == old or (seen < 2 and old != (None, None)):
                return None
        self.limits = stated
        return old, stated
