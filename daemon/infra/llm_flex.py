"""OpenAI's flex processing (`[llm] service_tier = "flex"`): half price, slower, not always there.

A flex call is a live call at another price: the same request with
`service_tier: "flex"`, which litellm 1.110.2 sends on to OpenAI as it is
and prices at the model's `*_flex` keys (its response_cost follows the tier
asked for, or the tier the reply says served it). Its replies are slower:
`[llm] timeout_s` defaults to 900 s under flex (config.py).

When flex lacks capacity OpenAI answers "429 Resource Unavailable" and does
not charge (developers.openai.com/api/docs/guides/flex-processing, "Resource
unavailable errors"; clients test the error's `code == "resource_unavailable"`).
That is not a rate limit: it does not cut the endpoint's limiter (the slot
goes back as FLEX_OUTCOME, which moves no limit), it is not an attempt of
the retry policy nor of the set, and it is not retried at once. The call
waits `[llm] flex_unavailable_wait_s`, then goes at the standard tier
(`flex_fallback = "standard"`, OpenAI's second strategy: without
service_tier, at the standard price) or asks flex again (`"wait"`).

Quiet, as the limiter: one `llm.flex_unavailable` line when flex becomes
unavailable (saying what is done about it), one `llm.flex_available` with
counts when a flex call is served again; each refusal is counted for
Prometheus (skilltrain_llm_flex_unavailable_total), never logged.

The calls and their counts run on the LLM loop's thread (llm_loop.py): no locks.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ..core.config import LLMConfig
from ..core.errors import LLMError

OnChange = Callable[..., None]  # (event name, **fields)
AsyncSleep = Callable[[float], Awaitable[None]]
# How a flex refusal gives its slot back: no outcome llm_limit acts on (not
# "rate_limited": the endpoint's limit stays; not "error": growth goes on).
FLEX_OUTCOME = "flex_unavailable"
# Flex is OpenAI's live API at another tier: the prompt is kept as a live one is.
FLEX_RETENTION = ("as OpenAI's live API keeps it: abuse-monitoring logs up to 30 days "
                  "unless zero data retention is approved")
# Providers whose API takes service_tier = "flex" and litellm 1.110.2 was seen to
# pass it on to (Azure OpenAI has a flex preview too: not checked, so not offered).
FLEX_PROVIDERS = frozenset({"openai"})


class FlexUnavailable(LLMError):
    """Raised when flex has no capacity for the call now (a 429 that is no rate limit)."""


def provider(model: str) -> str:
    """The provider a model id names (`openai/o3` -> openai; a bare id is OpenAI's)."""
    return model.split("/", 1)[0] if "/" in model else "openai"


def check(settings: LLMConfig) -> str | None:
    """Why `settings` cannot ask for flex, or None (no litellm import: preflight)."""
    if not settings.flex or provider(settings.model) in FLEX_PROVIDERS:
        return None
    return (f"[llm] service_tier = \"flex\" is OpenAI's flex processing; "
            f"{settings.model!r} is not an OpenAI model")


def flex_price_missing(model: str) -> bool:
    """Does litellm know the model's standard price but no flex one? Its cost
    would then be the standard price for a flex call (an unknown model's cost
    is unknown at any tier: None, not a wrong number)."""
    from . import llm

    try:
        info = llm.litellm().get_model_info(model)
    except Exception:
        return False
    return bool(info.get("input_cost_per_token")) and not info.get("input_cost_per_token_flex")


class FlexWatch:
    """Flex's availability as the calls see it: events on a change, counts always."""

    def __init__(self, on_change: OnChange | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.on_change = on_change or (lambda event, **fields: None)
        self.clock = clock
        self.unavailable_since: float | None = None
        # Totals (Prometheus) and those since flex became unavailable (the log).
        self.totals = {"refused": 0, "fell_back": 0, "waited": 0}
        self._episode = dict(self.totals)
        self._price_checked: set[str] = set()
        self._price_lock = threading.Lock()  # check_price: from the job pool and the warm-up

    def check_price(self, settings: LLMConfig) -> None:
        """A flex model litellm has no flex price for: said once (its cost is the standard one)."""
        with self._price_lock:
            if not settings.flex or settings.model in self._price_checked:
                return
            self._price_checked.add(settings.model)
        if flex_price_missing(settings.model):
            self.on_change("llm.flex_unpriced", level="warning", model=settings.model,
                           reason="litellm has no flex price for this model: its flex calls "
                                  "are counted at the standard price")

    def refused(self, settings: LLMConfig) -> None:
        self._count("refused")
        if self.unavailable_since is not None:
            return
        self.unavailable_since = self.clock()
        wait = f"{settings.flex_unavailable_wait_s:g} s"
        action = (f"falling back to the standard tier after {wait}"
                  if settings.flex_fallback == "standard"
                  else f"waiting {wait} and asking flex again")
        self.on_change("llm.flex_unavailable", level="warning", model=settings.model,
                       action=action, fallback=settings.flex_fallback,
                       wait_s=settings.flex_unavailable_wait_s)

    def retried(self, settings: LLMConfig) -> None:
        self._count("fell_back" if settings.flex_fallback == "standard" else "waited")

    def served(self, settings: LLMConfig) -> None:
        """A flex call was answered: flex is available (again)."""
        if self.unavailable_since is None:
            return
        seconds = self.clock() - self.unavailable_since
        self.unavailable_since = None
        episode, self._episode = self._episode, {k: 0 for k in self.totals}
        self.on_change("llm.flex_available", model=settings.model,
                       refused=episode["refused"], fell_back=episode["fell_back"],
                       waited=episode["waited"], unavailable_s=round(seconds, 3))

    def _count(self, what: str) -> None:
        self.totals[what] += 1
        self._episode[what] += 1


Call = Callable[..., Awaitable[Any]]  # llm.acomplete


async def complete(call: Call, messages: Sequence[Any], settings: LLMConfig, *,
                   watch: FlexWatch | None = None, sleep: AsyncSleep | None = None,
                   **kwargs: Any) -> Any:
    """`call(messages, settings, sleep=sleep, **kwargs)` with flex's policy on
    "resource unavailable": wait, then the standard tier or flex again. `sleep`
    also waits the flex wait (the daemon's ends early, raising, on shutdown)."""
    watch = watch or FlexWatch()
    wait = sleep or asyncio.sleep
    asked = settings.flex
    while True:
        try:
            done = await call(messages, settings, sleep=sleep, **kwargs)
        except FlexUnavailable:
            watch.refused(settings)
            await wait(settings.flex_unavailable_wait_s)
            watch.retried(settings)
            if settings.flex_fallback == "standard":
                settings = settings.with_tier(None)  # this call only; the next asks flex
            continue
        if settings.flex:
            watch.served(settings)
        if not asked:
            return done
        # The sidecar says which tier served (and so was paid for).
        tier = "flex" if settings.flex else "standard"
        return type(done)(**{**vars(done), "service_tier": tier})  # a frozen llm.Completion
