"""Loss jobs: a bounded queue, one job per set at a time, retries, the budget.

    reconcile ──submit──> queued ──worker──> still wanted? ──> loss.run ──> DONE
                                                 │ no            │ failed: FAILED, retried
                                                 v               v         after backoff
                                         look again / held     steps.check (the barrier)

A job re-checks its set when it gets a worker (changed while queued, over
budget, shutting down) and writes nothing unless the handler wrote a whole
report; what it decided is recorded in the state and said in one event.
"""
from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from ...handlers import loss
from ..core import config, dataset, layout
from ..core.errors import (
    BadOutputError,
    ConfigError,
    ContradictedReportError,
    InputsChangedError,
    LLMError,
    RefusedError,
)
from ..core.notify import Heartbeat
from ..core.templates import PromptTemplates
from ..infra import log
from ..infra.state import BUDGET_REASON, SetState, StateStore
from .observe import Fingerprint, observe, sigs_digest
from .steps import Steps

Emit = Callable[..., None]


class BatchPath(Protocol):
    """Batch mode (daemon/service/batch.py), as jobs sees it."""

    def carries(self, set_id: str) -> bool: ...
    def wants(self, key: layout.SetKey) -> bool: ...
    def enqueue(self, key: layout.SetKey, work: dataset.Work, fp: Fingerprint,
                attempts: int) -> None: ...


class Abandoned(Exception):
    """Raised inside a job when the daemon shuts down while the job waits to retry."""


class Budget:
    """`[llm] budget_usd` per run: reached once a run's spend is at or over it."""

    def __init__(self, limit_usd: float | None, state: StateStore, emit: Emit) -> None:
        self.limit_usd = limit_usd
        self.state = state
        self.emit = emit
        self._lock = threading.Lock()
        self._said: set[str] = set()  # runs whose budget.reached is logged

    def reached(self, run: str) -> bool:
        if self.limit_usd is None:
            return False
        spent = self.state.spend.get(run)
        if spent is None or spent.cost_usd < self.limit_usd:
            return False
        with self._lock:  # evaluations run in parallel: one line per run
            first = run not in self._said
            self._said.add(run)
        if first:
            self.emit("budget.reached", level="warning", run=run,
                      spent_usd=round(spent.cost_usd, 6), budget_usd=self.limit_usd)
        return True


class Claims:
    """One look or one job per set at a time.

    A look asked for while the set is being looked at or worked on is
    remembered and made when that ends: never two jobs for one set, never
    a change missed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, Future[None]] = {}  # set id -> queued or running job
        self._looking: set[str] = set()  # set ids being evaluated
        self._again: set[str] = set()  # asked for meanwhile

    def claim_look(self, set_id: str) -> bool:
        """Claim a set for a look; False (and remembered) if it is busy."""
        with self._lock:
            if set_id in self._jobs or set_id in self._looking:
                self._again.add(set_id)
                return False
            self._looking.add(set_id)
            return True

    def end_look(self, set_id: str) -> bool:
        """The look ended; True when another was asked for meanwhile (and no job runs)."""
        with self._lock:
            self._looking.discard(set_id)
            again = set_id in self._again and set_id not in self._jobs
            if again:
                self._again.discard(set_id)
            return again

    def start_job(self, set_id: str, submit: Callable[[], Future[None]]) -> Future[None]:
        with self._lock:  # registered before the job's own end can look for it
            future = self._jobs[set_id] = submit()
            return future

    def end_job(self, set_id: str) -> bool:
        """The job ended; True when a look was asked for meanwhile."""
        with self._lock:
            self._jobs.pop(set_id, None)
            again = set_id in self._again
            self._again.discard(set_id)
            return again

    def has_job(self, set_id: str) -> bool:
        with self._lock:
            return set_id in self._jobs

    def jobs(self) -> list[Future[None]]:
        with self._lock:
            return list(self._jobs.values())


class Jobs:
    """Runs loss jobs on a bounded pool; failed ones are retried with backoff."""

    def __init__(self, cfg: config.Config, state: StateStore, emit: Emit, *,
                 clock: Callable[[], float], stopping: threading.Event,
                 templates: PromptTemplates, complete: Callable[..., Any], steps: Steps,
                 budget: Budget, claims: Claims, heartbeat: Heartbeat,
                 look_again: Callable[[layout.SetKey, float | None], None],
                 settle_again: Callable[[layout.SetKey], None]) -> None:
        self.cfg = cfg
        self.runs = cfg.paths.runs
        self.state = state
        self.emit = emit
        self.log = log.get_logger("skilltrain.daemon")
        self.clock = clock
        self.stopping = stopping
        self.templates = templates
        self.complete = complete
        self.steps = steps
        self.budget = budget
        self.claims = claims
        self.heartbeat = heartbeat
        self.look_again = look_again  # (set, when or None for now): reconcile evaluates it
        self.settle_again = settle_again  # inputs changed under a job: settle from now
        self.abort = threading.Event()  # abandon jobs waiting to retry
        self.failures = 0  # sets failed or refused (--once exit code)
        self.pool = ThreadPoolExecutor(cfg.loss.concurrency, thread_name_prefix="loss")
        self.batch: BatchPath | None = None  # set by the daemon: runs in batch mode

    def submit(self, key: layout.SetKey, work: dataset.Work, fp: Fingerprint,
               attempts: int) -> None:
        if self.batch is not None and self.batch.carries(key.id):
            return  # gathered or in a provider batch: its result comes from there
        job_id = uuid.uuid4().hex[:12]
        self.state.update(key.id, SetState.QUEUED, reason=None, fingerprint=fp.as_json(),
                          attempts=attempts)
        self.emit("set.ready", **key.log_fields())
        self.emit("loss.queued", job_id=job_id, **key.log_fields())
        future = self.claims.start_job(
            key.id, lambda: self.pool.submit(self._run_job, key, work, fp, job_id, attempts))
        future.add_done_callback(log.report_task_failure)

    def run_result(self, key: layout.SetKey, work: dataset.Work, fp: Fingerprint,
                   attempts: int, finish: Callable[[], loss.LossResult]) -> Future[None]:
        """A batch's result for a set, checked and written on a worker exactly like
        a live job's reply: `finish` stands in for prepare -> complete -> finish."""
        job_id = uuid.uuid4().hex[:12]
        future = self.claims.start_job(key.id, lambda: self.pool.submit(
            self._run_job, key, work, fp, job_id, attempts, finish))
        future.add_done_callback(log.report_task_failure)
        return future

    def hold_if_over_budget(self, key: layout.SetKey) -> bool:
        """Over budget: the set is held (or its report stays stale) instead of run."""
        if not self.budget.reached(key.run):
            return False
        report_exists = key.report_path(self.runs).exists()
        self.state.update(key.id, SetState.STALE if report_exists else SetState.HELD,
                          reason=BUDGET_REASON)
        return True

    def _run_job(self, key: layout.SetKey, work: dataset.Work, fp: Fingerprint, job_id: str,
                 attempts: int, finish: Callable[[], loss.LossResult] | None = None) -> None:
        try:
            # Context for every line this job logs, in this worker thread.
            with log.bound_job(job_id=job_id, **key.log_fields()):
                try:
                    self._run_loss(key, work, fp, attempts, finish)
                except Exception:
                    self.log.exception("loss.failed", reason="internal error")
                    self._fail(key, fp, attempts, "internal error")
        finally:
            if self.claims.end_job(key.id):
                self.look_again(key, None)
            self.steps.check(key.step_key)
            self.heartbeat.beat()

    def _still_wanted(self, key: layout.SetKey, fp: Fingerprint, paid: bool = False) -> bool:
        """Is a queued job still to run, now that it has a worker?"""
        if self.stopping.is_set():
            return False
        if paid:
            return True  # a batch reply, paid for: its own check compares the input hashes
        if sigs_digest(observe(key, self.runs, self.cfg.paths.data).sigs) != fp.sigs:
            # Changed while queued: the settle wait starts again.
            self.look_again(key, None)
            return False
        # Queued before the budget ran out; it must not start now.
        return not self.hold_if_over_budget(key)

    def _run_loss(self, key: layout.SetKey, work: dataset.Work, fp: Fingerprint,
                  attempts: int, finish: Callable[[], loss.LossResult] | None = None) -> None:
        if not self._still_wanted(key, fp, paid=finish is not None):
            return
        if finish is None and self.batch is not None and self.batch.wants(key):
            self.batch.enqueue(key, work, fp, attempts)  # its run is in batch mode
            return
        self.state.update(key.id, SetState.RUNNING)
        job = loss.LossJob(work=work, scripts_dir=key.scripts_dir(self.runs),
                           report_path=key.report_path(self.runs), first=key.first,
                           last=key.last, stat_sigs=fp.sigs)

        def started(chars: int, tokens: int | None) -> None:
            self.emit("loss.started", prompt_chars=chars, prompt_tokens=tokens,
                      attempt=attempts + 1)

        def retry(attempt: int, wait_s: float, error: BaseException) -> None:
            self.emit("loss.retry", level="warning", attempt=attempt, wait_s=round(wait_s, 3),
                      error=str(error))

        try:
            # A batch result brings its own finish; a live job prepares, calls, finishes.
            result = finish() if finish is not None else self._live(job, started, retry)
        except InputsChangedError as e:
            # Not a report of what is on disk now: nothing written, the step
            # not counted; the set settles again and is made anew.
            self.emit("loss.discarded", level="warning", reason=str(e))
            self.state.update(key.id, SetState.SETTLING, reason=str(e))
            self.settle_again(key)
            return
        except ContradictedReportError as e:
            # Whole but confidently wrong: bogus signal, retried like a failed call.
            self._fail(key, fp, attempts, str(e), event="loss.contradicted", **e.counts)
            return
        except BadOutputError as e:
            # The reply, not the input, was bad: refused, and retried like a failure.
            self._fail(key, fp, attempts, str(e), event="loss.refused")
            return
        except RefusedError as e:
            self.failures += 1
            self.emit("loss.refused", level="warning", reason=str(e))
            self.state.update(key.id, SetState.REFUSED, reason=str(e),
                              refused_fingerprint=fp.as_json())
            return
        except (LLMError, ConfigError) as e:
            retry_after_s = e.retry_after_s if isinstance(e, LLMError) else None
            self._fail(key, fp, attempts, str(e), retry_after_s=retry_after_s)
            return
        except OSError as e:
            # A full disk, a permission: the job wrote nothing (all or none).
            where = f" {e.filename}" if e.filename else ""
            self._fail(key, fp, attempts,
                       f"cannot write the report{where}: {e.strerror or type(e).__name__}")
            return
        except Abandoned:
            self.state.update(key.id, SetState.QUEUED, reason="abandoned at shutdown")
            return
        self._completed(key, fp, result)

    def _live(self, job: loss.LossJob, started: Callable[[int, int | None], None],
              retry: Callable[[int, float, BaseException], None]) -> loss.LossResult:
        return loss.run(job, settings=self.cfg.llm, templates=self.templates,
                        on_leak=self.cfg.integrity.on_leak,
                        on_contradiction=self.cfg.integrity.on_contradiction,
                        refuse_share=self.cfg.integrity.refuse_share, confine_to=self.runs,
                        answer_key=self.cfg.paths.data,
                        hooks=loss.LossHooks(started=started, retry=retry),
                        complete=self.complete, sleep=self._interruptible_sleep)

    def _completed(self, key: layout.SetKey, fp: Fingerprint, result: loss.LossResult) -> None:
        c = result.completion
        spend = self.state.add_spend(key.run, c.tokens_in, c.tokens_out, c.tokens_cached,
                                     c.cost_usd, tokens_cache_write=c.tokens_cache_write)
        # Logged before the set turns DONE: DONE may complete the step, and
        # step.reported must come after the step's last loss.completed.
        self.emit("loss.completed", report=str(result.report_path), tokens_in=c.tokens_in,
                  tokens_out=c.tokens_out, tokens_cached=c.tokens_cached, cost_usd=c.cost_usd,
                  duration_ms=result.duration_ms, leaks_redacted=result.leaks_redacted,
                  attempts=c.attempts, tokens_cache_write=c.tokens_cache_write,
                  craft_distance=result.sidecar.get("craft_distance"),
                  **result.claims.event_fields())
        self.emit("cost.total", tokens_in=spend.tokens_in, tokens_out=spend.tokens_out,
                  cost_usd=round(spend.cost_usd, 6), tokens_cached=spend.tokens_cached,
                  tokens_cache_write=spend.tokens_cache_write)
        self.steps.reopen(key)
        self.state.update(key.id, SetState.DONE, reason=None, attempts=0, next_retry_at=None,
                          fingerprint=fp.as_json())

    def _fail(self, key: layout.SetKey, fp: Fingerprint, attempts: int, reason: str,
              retry_after_s: float | None = None, event: str = "loss.failed",
              **details: Any) -> None:
        attempts += 1
        self.failures += 1
        gave_up = attempts >= self.cfg.loss.max_attempts
        next_at = None if gave_up else self._next_retry(attempts - 1)
        if next_at is not None and retry_after_s is not None:
            # The server's last word on when to come back, capped like in llm.complete.
            next_at = max(next_at, self.clock() + min(retry_after_s, self.cfg.llm.backoff_max_s))
        self.emit(event, level="error" if event == "loss.failed" else "warning", reason=reason,
                  attempts=attempts,
                  next_retry_s=None if next_at is None else round(next_at - self.clock(), 1),
                  **details)
        self.state.update(key.id, SetState.FAILED, reason=reason, attempts=attempts,
                          next_retry_at=next_at, fingerprint=fp.as_json())
        if next_at is not None:
            self.look_again(key, next_at)

    def _next_retry(self, failures_before: int) -> float:
        base = self.cfg.loss.retry_backoff_s * 2 ** failures_before
        return self.clock() + base * random.uniform(0.8, 1.2)

    def _interruptible_sleep(self, seconds: float) -> None:
        if self.abort.wait(seconds):
            raise Abandoned()

    # ------------------------------------------------------------- the end
    def wait_all(self) -> None:
        """--once: every job started (including those a job's end started) has ended."""
        while futures := self.claims.jobs():
            for future in futures:
                future.result()

    def stop_intake(self) -> None:
        """Jobs waiting to retry give up; jobs not started are cancelled (found
        again at the next start); running ones go on until the shutdown bound."""
        self.abort.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
