"""The error hierarchy and the process exit codes.

Expected failures (a refused range, a bad config, a second instance) are
subclasses of SkilltrainError and are logged as one clear line without a
traceback. Anything else is a bug and is logged with its traceback.
"""
from __future__ import annotations

import enum
from typing import Any


class ExitCode(enum.IntEnum):
    """Process exit codes; systemd's RestartPreventExitStatus= names CONFIG."""

    OK = 0
    FAILURE = 1  # a job or command failed (one-shot loss, audit found a leak)
    CONFIG = 2  # bad config.toml, template or command line: restarting cannot help
    ALREADY_RUNNING = 3  # another daemon holds the lock on this runs/ root
    WATCHER_DIED = 4  # the filesystem observer died: let the supervisor restart us


class SkilltrainError(Exception):
    """Root of every error this package raises on purpose."""

    exit_code: ExitCode = ExitCode.FAILURE
    logged: bool = False  # already in the log as daemon.failed: the CLI adds no line


class ConfigError(SkilltrainError):
    """Raised when config.toml, an environment override or a template is invalid."""

    exit_code = ExitCode.CONFIG


class RefusedError(SkilltrainError):
    """Raised when a loss job must not run or must not write: missing, empty,
    half-written or oversized input, or an empty, truncated or leaking report.

    The message is safe to log: it names files and numbers, never human text.
    """


class BadOutputError(RefusedError):
    """Raised when the model's reply must not become a report: empty, or cut
    off (finish_reason=length). Nothing is written; unlike bad input, the set
    is retried, since the next reply may be whole."""


class ContradictedReportError(BadOutputError):
    """Raised in refuse mode when more than the configured share of a report's
    checked claims are contradicted by the measurements (craft_claims): a
    confidently wrong report is bogus signal. Nothing is written; the set is
    retried like a failed call. `counts`: the claims' event fields."""

    def __init__(self, message: str, counts: dict[str, Any]) -> None:
        super().__init__(message)
        self.counts = counts


class InputsChangedError(RefusedError):
    """Raised when an input episode changed or vanished while its report was
    being made: the report would describe files that no longer exist, so it
    is not written, and the set waits to settle and is made again."""


class LeftStepError(InputsChangedError):
    """Raised when a set is no longer one its step has (work.toml's ranges,
    `episodes_per_report` or run.toml's works changed while its report was
    being made): its step's optimizer must not read the report, so it is not
    written; the set settles again, and its next look forgets it if it is
    still not one."""


class LLMError(SkilltrainError):
    """Raised when the LLM call failed for good (retries exhausted or not retryable).

    `retry_after_s`: what the server last asked for (Retry-After), so a later
    retry of the whole set does not come sooner. `rate_limited`: the last
    attempt was refused for the provider's rate limit (not the set's fault:
    it does not count against [loss] max_attempts). `blocked`: the provider
    refuses the key itself ("quota", "billing", "authentication"): no wait
    fixes it, the endpoint takes no new call until it works again (llm_limit.py).
    """

    def __init__(self, message: str, retry_after_s: float | None = None, *,
                 rate_limited: bool = False, blocked: str | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.rate_limited = rate_limited
        self.blocked = blocked


class AlreadyRunningError(SkilltrainError):
    """Raised when another daemon already holds the lock on the runs/ root."""

    exit_code = ExitCode.ALREADY_RUNNING
