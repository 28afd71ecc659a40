"""How an LLM call is tried again: the error that asks for it, and the attempts
after the first by the retry policy (core/backoff.py), run by tenacity.

The first attempt is made without tenacity: most calls succeed at once, and
building its retry state cost ~25 us of CPU a call (bench/RESULTS.md, issue
36). After a failure tenacity takes over with that failure as its first
attempt, so its numbering, waits and stop are those of one run.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import tenacity

from ..core.backoff import Backoff

RetryHook = Callable[[int, float, BaseException], None]
AsyncSleep = Callable[[float], Awaitable[None]]


class RetryableError(Exception):
    """A transient failure: worth another attempt after a wait.

    `rate_limited`: the provider said slow down (a 429, or a 503 with
    Retry-After); `headers`: what it sent (for the limiter).
    """

    def __init__(self, message: str, retry_after_s: float | None = None, *,
                 rate_limited: bool = False, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.rate_limited = rate_limited
        self.headers = headers or {}


async def retried(attempt: Callable[[], Awaitable[Any]], first: RetryableError,
                  policy: Backoff, max_retries: int, on_retry: RetryHook | None,
                  sleep: AsyncSleep | None) -> Any:
    """`attempt()` again after a first attempt that raised `first`, up to
    `max_retries` more times, waiting as `policy` says between them;
    `on_retry(attempt number, wait, error)` before each wait. Raises the last
    RetryableError when they are used up."""
    made = [first]

    async def again() -> Any:
        if made:  # tenacity's first attempt: the one already made
            raise made.pop()
        return await attempt()

    def wait(state: tenacity.RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        retry_after_s = exc.retry_after_s if isinstance(exc, RetryableError) else None
        return policy.delay_s(state.attempt_number, retry_after_s=retry_after_s)

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None and state.next_action:
            error = state.outcome.exception()
            assert error is not None
            on_retry(state.attempt_number, state.next_action.sleep, error)

    return await tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception_type(RetryableError),
        stop=tenacity.stop_after_attempt(max_retries + 1),
        wait=wait,
        sleep=sleep or asyncio.sleep,
        before_sleep=before_sleep,
        reraise=True,
    )(again)
