"""When to try again: one backoff policy for every stage that retries.

    wait after the n-th failure in a row = base_s * factor^(n-1), at most cap_s,
        spread by +-jitter (or anywhere in [0, wait]: full jitter),
        and never shorter than a server's Retry-After (itself at most retry_after_max_s)

Each stage keeps its own numbers in config; their shapes are all here:

    stage               base_s                       factor  jitter  cap (Retry-After cap)
    an LLM call         [llm] backoff_initial_s      2       full    [llm] backoff_max_s (same)
    a loss job          [loss] retry_backoff_s       2       +-20 %  - ([llm] backoff_max_s)
    a rate-limited job  [loss] retry_backoff_s       2       +-20 %  the larger of the two
                                                                     ([llm] backoff_max_s)
    the writer          [writer] retry_backoff_s     2       none    -
    the optimizer       [optimizer] retry_backoff_s  1       none    -

A rate-limited job is not a failure of its set (no attempt is used); its
wait doubles with each rate-limited call in a row, up to the larger of [loss]
retry_backoff_s and [llm] backoff_max_s, so a provider that keeps refusing is
asked less and less often. The optimizer's key falls back to [loss]
retry_backoff_s when unset.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from .config import Config, LLMConfig

Uniform = Callable[[float, float], float]


@dataclass(frozen=True)
class Backoff:
    """A retry wait, from how many failures in a row came before it."""

    base_s: float
    factor: float = 2.0
    jitter: float = 0.0  # +-share of the wait: retries of a burst do not fall due together
    full_jitter: bool = False  # anywhere in [0, wait]: spreads a burst of 429s apart
    cap_s: float | None = None  # the wait itself never grows past this
    retry_after_max_s: float | None = None  # nor does a server's Retry-After

    def delay_s(self, failures: int, *, retry_after_s: float | None = None,
                uniform: Uniform = random.uniform) -> float:
        """The wait after the `failures`-th failure in a row (1: the first)."""
        wait = self.base_s * self.factor ** max(failures - 1, 0)
        if self.cap_s is not None:
            wait = min(wait, self.cap_s)
        if self.full_jitter:
            wait = uniform(0, wait)
        elif self.jitter:
            wait *= uniform(1 - self.jitter, 1 + self.jitter)
            if self.cap_s is not None:
                wait = min(wait, self.cap_s)  # "at most cap_s" holds after the spread too
        if retry_after_s is not None:
            # The server's last word on when to come back wins when it is later.
            if self.retry_after_max_s is not None:
                retry_after_s = min(retry_after_s, self.retry_after_max_s)
            wait = max(wait, retry_after_s)
        return wait


LOSS_JITTER = 0.2


def llm_call(settings: LLMConfig) -> Backoff:
    """Between the attempts of one LLM call (inside a job, holding no slot)."""
    return Backoff(settings.backoff_initial_s, full_jitter=True, cap_s=settings.backoff_max_s,
                   retry_after_max_s=settings.backoff_max_s)


def loss_job(cfg: Config) -> Backoff:
    """Before a failed loss job's set is tried again."""
    return Backoff(cfg.loss.retry_backoff_s, jitter=LOSS_JITTER,
                   retry_after_max_s=cfg.llm.backoff_max_s)


def rate_limited(cfg: Config) -> Backoff:
    """Before a set whose call the provider's rate limit refused is tried again."""
    return Backoff(cfg.loss.retry_backoff_s, jitter=LOSS_JITTER,
                   cap_s=max(cfg.loss.retry_backoff_s, cfg.llm.backoff_max_s),
                   retry_after_max_s=cfg.llm.backoff_max_s)


def writer(cfg: Config) -> Backoff:
    """Before a failed writer runs again."""
    return Backoff(cfg.writer.retry_backoff_s)


def optimizer(cfg: Config) -> Backoff:
    """Before a failed optimizer runs again."""
    own = cfg.optimizer.retry_backoff_s
    return Backoff(cfg.loss.retry_backoff_s if own is None else own, factor=1.0)
