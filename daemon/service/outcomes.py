"""What a loss job came to, as a Decision: the state, one event, when to look again.

    reply written  -> loss.completed, DONE (the step may be reported; its cost.total then)
    retired report -> loss.completed with reused_from, DONE, nothing paid (pipeline.reuse)
    inputs changed -> loss.discarded, SETTLING (made anew once settled)
    set left step  -> loss.discarded, SETTLING; forgotten by its next look if still out
    bad reply      -> loss.refused / loss.contradicted, FAILED, retried after backoff
    bad input      -> loss.refused, REFUSED (until its files change)
    call failed    -> loss.failed, FAILED, retried after backoff up to [loss] max_attempts;
                      the provider's rate limit alone: loss.rate_limited, not counted
    key refused    -> (quota, billing, auth: the limiter's one llm.blocked) HELD, saying
                      why, not an attempt; looked at again when the key works (a rescan)
    shutdown       -> QUEUED (found again at the next start)

Where a set is retried: here (when: core/backoff.py's policy), returned in
the Decision that owner.py applies; revisit.py schedules the look.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...handlers import loss
from ..core import backoff, config, layout
from ..core.errors import (
    BadOutputError,
    ConfigError,
    ContradictedReportError,
    InputsChangedError,
    LLMError,
    RefusedError,
)
from ..infra import llm
from ..infra.state import SetState, StateStore
from .decision import NOTHING, Decision
from .observe import Fingerprint
from .revisit import Revisit, Why
from .steps import Steps

Emit = Callable[..., None]
# The claims figures of loss.completed, as a sidecar's "claims" keeps them.
CLAIM_FIELDS = ("status", "confirmed", "contradicted", "not_checkable", "malformed",
                "contradicted_share")
PAID = "paid_reply"  # set on an error raised after a reply was paid for: its llm.Completion


class Abandoned(Exception):
    """Raised inside a job when the daemon shuts down while the job waits to retry."""


class Outcomes:
    """Decides what each job's outcome means; counts the sets that will not complete
    by themselves."""

    def __init__(self, cfg: config.Config, state: StateStore, emit: Emit, *,
                 clock: Callable[[], float], steps: Steps) -> None:
        self.cfg = cfg
        self.state = state
        self.emit = emit
        self.clock = clock
        self.steps = steps
        self.failures = 0  # sets failed or refused (--once exit code)

    def record(self, key: layout.SetKey, fp: Fingerprint, attempts: int,
                result: loss.LossResult | None, error: BaseException | None) -> Decision:
        """What the job came to: one event now, and the Decision to apply."""
        if error is None:
            return NOTHING if result is None else self._completed(key, fp, result)
        # A reply paid for and not written (refused, contradicted, its inputs
        # changed): in the run's spend and budget all the same, and on its event.
        paid = self._spent(key.run, getattr(error, PAID, None))
        try:
            raise error
        except InputsChangedError as e:
            return self._discarded(key, e, paid)
        except ContradictedReportError as e:  # a BadOutputError: caught first
            # Whole but confidently wrong: bogus signal, retried like a failed call.
            return self.fail(key, fp, attempts, str(e), event="loss.contradicted", **e.counts,
                             **paid)
        except BadOutputError as e:
            # The reply, not the input, was bad: refused, and retried like a failure.
            return self.fail(key, fp, attempts, str(e), event="loss.refused", **paid)
        except RefusedError as e:
            self.failures += 1
            self.emit("loss.refused", level="warning", reason=str(e), **paid)
            return Decision.write(SetState.REFUSED, reason=str(e),
                                  refused_fingerprint=fp.as_json())
        except LLMError as e:
            if e.blocked:
                return self.refused_key(key, fp, attempts, e)
            if e.rate_limited:
                return self._rate_limited(key, fp, attempts, str(e), e.retry_after_s)
            return self.fail(key, fp, attempts, str(e), retry_after_s=e.retry_after_s)
        except ConfigError as e:
            return self.fail(key, fp, attempts, str(e), **paid)
        except OSError as e:
            # A full disk, a permission: the job wrote nothing (all or none).
            where = f" {e.filename}" if e.filename else ""
            return self.fail(key, fp, attempts,
                             f"cannot write the report{where}: {e.strerror or type(e).__name__}",
                             **paid)
        except Abandoned:
            return Decision.write(SetState.QUEUED, reason="abandoned at shutdown")

    def _spent(self, run: str, paid: llm.Completion | None, *,
               report: bool = False) -> dict[str, Any]:
        """A reply paid for, in the run's spend (a report, or not: refused); its
        tokens and cost for the event (Prometheus counts them from there)."""
        if paid is None:
            return {}
        self.state.add_spend(run, paid.tokens_in, paid.tokens_out, paid.tokens_cached,
                             paid.cost_usd, tokens_cache_write=paid.tokens_cache_write,
                             report=report)
        return {"tokens_in": paid.tokens_in, "tokens_out": paid.tokens_out,
                "tokens_cached": paid.tokens_cached,
                "tokens_cache_write": paid.tokens_cache_write, "cost_usd": paid.cost_usd}

    def _discarded(self, key: layout.SetKey, error: InputsChangedError,
                   paid: dict[str, Any]) -> Decision:
        """Not a report of what is on disk now: nothing written, the step not counted."""
        self.emit("loss.discarded", level="warning", reason=str(error), **paid)
        # The set settles again and is made anew; one that left its step
        # (LeftStepError) is forgotten by that look unless it is back by then
        # (an editor saving a human episode by rename empties its ranges for a moment).
        return Decision.write(SetState.SETTLING, reason=str(error), revisit=Revisit(
            key, self.clock() + self.cfg.loss.settle_s, Why.RESETTLE))

    def _completed(self, key: layout.SetKey, fp: Fingerprint,
                   result: loss.LossResult) -> Decision:
        c = result.completion
        paid = self._spent(key.run, c, report=True)
        # Logged before the set turns DONE: DONE may complete the step, and
        # step.reported must come after the step's last loss.completed.
        self.emit("loss.completed", report=str(result.report_path), **paid,
                  duration_ms=result.duration_ms, leaks_redacted=result.leaks_redacted,
                  attempts=c.attempts, craft_distance=result.sidecar.get("craft_distance"),
                  **result.claims.event_fields())
        return self._done(key, fp)

    def reused(self, key: layout.SetKey, fp: Fingerprint, retired: Path,
               sidecar: dict[str, Any]) -> Decision:
        """The set's retired report written back (pipeline.reuse): done, nothing paid
        (its line says so: no tokens, no cost), the report's own figures as written."""
        claims = sidecar.get("claims")
        claims = claims if isinstance(claims, dict) else {}
        self.emit("loss.completed", report=str(key.report_path(self.cfg.paths.runs)),
                  reused_from=str(retired), tokens_in=0, tokens_out=0,
                  tokens_cached=0, tokens_cache_write=0, cost_usd=0.0, duration_ms=0,
                  leaks_redacted=sidecar.get("leaks_redacted", 0), attempts=0,
                  craft_distance=sidecar.get("craft_distance"),
                  **{f"claims_{name}": claims.get(name) for name in CLAIM_FIELDS})
        return self._done(key, fp)

    def _done(self, key: layout.SetKey, fp: Fingerprint) -> Decision:
        self.steps.reopen(key)
        return Decision.write(SetState.DONE, reason=None, attempts=0, next_retry_at=None,
                              fingerprint=fp.as_json(), rate_limited=0)

    def fail(self, key: layout.SetKey, fp: Fingerprint, attempts: int, reason: str,
              retry_after_s: float | None = None, event: str = "loss.failed",
              **details: Any) -> Decision:
        attempts += 1
        self.failures += 1
        gave_up = attempts >= self.cfg.loss.max_attempts
        next_at = None if gave_up else self.clock() + backoff.loss_job(self.cfg).delay_s(
            attempts, retry_after_s=retry_after_s)
        self.emit(event, level="error" if event == "loss.failed" else "warning", reason=reason,
                  attempts=attempts,
                  next_retry_s=None if next_at is None else round(next_at - self.clock(), 1),
                  **details)
        return Decision.write(SetState.FAILED, reason=reason, attempts=attempts,
                              next_retry_at=next_at, fingerprint=fp.as_json(), rate_limited=0,
                              revisit=None if next_at is None else Revisit(key, next_at,
                                                                           Why.RETRY))

    def refused_key(self, key: layout.SetKey, fp: Fingerprint, attempts: int,
                    error: LLMError) -> Decision:
        """The provider refuses the key (quota, billing, auth): the set waits, saying
        why, with its attempts as they were. No event of its own (the endpoint's
        llm.blocked is the one) and no revisit: the endpoint's unblocking rescans."""
        report_exists = key.report_path(self.cfg.paths.runs).exists()
        return Decision.write(SetState.STALE if report_exists else SetState.HELD,
                              reason=str(error), attempts=attempts, next_retry_at=None,
                              rate_limited=0)

    def _rate_limited(self, key: layout.SetKey, fp: Fingerprint, attempts: int, reason: str,
                      retry_after_s: float | None) -> Decision:
        """The provider's rate limit, not the set, ended the call: tried again later,
        and not counted against [loss] max_attempts (nor the exit code); the wait
        grows with each such call in a row."""
        rec = self.state.get(key.id)
        in_a_row = (rec.rate_limited if rec else 0) + 1
        wait_s = backoff.rate_limited(self.cfg).delay_s(in_a_row, retry_after_s=retry_after_s)
        next_at = self.clock() + wait_s
        self.emit("loss.rate_limited", level="warning", reason=reason, attempts=attempts,
                  in_a_row=in_a_row, next_retry_s=round(wait_s, 1))
        return Decision.write(SetState.FAILED, reason=reason, attempts=attempts,
                              next_retry_at=next_at, fingerprint=fp.as_json(),
                              rate_limited=in_a_row, revisit=Revisit(key, next_at, Why.RETRY))
