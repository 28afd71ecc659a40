"""Loss jobs: a bounded queue, one job per set at a time, retries, the budget.

    reconcile ──submit──> queued ──slot──> still wanted? ──> prepare ──> call ──> finish ──> DONE
                                            │ no          (pool)     (loop)   (pool)
                                            v                          │ failed: FAILED, retried
                                    look again / held                  v         after backoff
                                                 the job's end: its Revisit to revisit.py,
                                                 then steps.check (the barrier)

A job is a coroutine on the LLM loop (llm_loop.py). It re-checks its set
when it gets a slot of its endpoint's limiter (changed while queued, over
budget, shutting down) and writes nothing unless the handler wrote a whole
report; what it decided is recorded in the state and said in one event. A
call refused for the provider's rate limit is tried again later without
counting against [loss] max_attempts.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from ...handlers import loss
from ..core import config, dataset, layout
from ..core.errors import (
    BadOutputError,
    ConfigError,
    InputsChangedError,
    LLMError,
    RefusedError,
)
from ..core.notify import Heartbeat
from ..core.templates import PromptTemplates
from ..infra import llm, log
from ..infra.llm_limit import Limiters, Slot
from ..infra.llm_loop import LLMLoop
from ..infra.state import BUDGET_REASON, SetState, StateStore
from .metrics import Metrics
from .observe import Fingerprint, observe, sigs_digest
from .outcomes import Abandoned, Outcomes
from .revisit import Revisit, Revisits
from .steps import Steps

Emit = Callable[..., None]
T = TypeVar("T")
# Threads for the jobs' file work (read, render, guard, write): milliseconds a
# job, while its call takes seconds on the loop; more would only contend for the GIL.
POOL_THREADS = 4


class BatchPath(Protocol):
    """Batch mode (batch.py), as jobs sees it."""

    def carries(self, set_id: str) -> bool: ...
    def wants(self, key: layout.SetKey) -> bool: ...
    def enqueue(self, key: layout.SetKey, work: dataset.Work, fp: Fingerprint,
                attempts: int) -> None: ...


Finish = Callable[[], loss.LossResult]  # a batch's reply checked and written: loss.finish


class NotWanted(Exception):
    """A queued job that must not run now it has a slot; `revisit`: the look its set needs."""

    def __init__(self, revisit: Revisit | None = None) -> None:
        super().__init__()
        self.revisit = revisit


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
    """Runs loss jobs: each a coroutine on the LLM loop, its file work on a small pool.

    A job waits for a slot of its endpoint's limiter (llm_limit.py) before it
    reads anything, so no more jobs are prepared than can call; reading,
    rendering, the guard and the writes run on POOL_THREADS threads, the
    call itself on the loop. The daemon's thread count does not grow with
    `[loss] concurrency`.
    """

    def __init__(self, cfg: config.Config, state: StateStore, emit: Emit, *,
                 clock: Callable[[], float], stopping: threading.Event,
                 templates: PromptTemplates, metrics: Metrics,
                 steps: Steps, budget: Budget, claims: Claims, heartbeat: Heartbeat,
                 revisits: Revisits, llm_loop: LLMLoop) -> None:
        self.cfg = cfg
        self.runs = cfg.paths.runs
        self.state = state
        self.emit = emit
        self.log = log.get_logger("skilltrain.daemon")
        self.clock = clock
        self.stopping = stopping
        self.templates = templates
        self.complete = metrics.timed(llm.acomplete)
        self.steps = steps
        self.budget = budget
        self.claims = claims
        self.heartbeat = heartbeat
        self.revisits = revisits  # where a job's end hands the look its set needs next
        # One per LLM endpoint: as `[loss] concurrency` says (a number, or adaptive).
        self.limiters = Limiters(fixed=cfg.loss.fixed_concurrency,
                                 floor=cfg.loss.concurrency_min_calls,
                                 ceiling=cfg.loss.concurrency_max_calls,
                                 on_change=self._limit_event)
        metrics.watch_limiters(self.limiters)
        self.llm = llm_loop
        metrics.watch_llm_loop(llm_loop)
        self.abort = threading.Event()  # abandon jobs waiting to retry
        self.outcomes = Outcomes(cfg, state, emit, clock=clock, steps=steps)
        self.pool = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="loss")
        # On the loop's thread only: every job's task, those still waiting for a
        # slot, the shutdown signal for backoff waits.
        self._tasks: set[asyncio.Task[None]] = set()
        self._waiting: set[asyncio.Task[None]] = set()
        self._aborted: asyncio.Event | None = None
        self.in_call = 0  # jobs holding a slot (read from other threads: a plain int)
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
            key.id, lambda: self.llm.submit(self._job(key, work, fp, job_id, attempts)))
        future.add_done_callback(log.report_task_failure)

    def run_result(self, key: layout.SetKey, work: dataset.Work, fp: Fingerprint,
                   attempts: int, finish: Finish) -> Future[None]:
        """A batch's result for a set, checked and written exactly like a live
        job's reply: `finish` stands in for prepare -> call -> finish."""
        future = self.claims.start_job(key.id, lambda: self.llm.submit(
            self._job(key, work, fp, uuid.uuid4().hex[:12], attempts, finish)))
        future.add_done_callback(log.report_task_failure)
        return future

    def _limit_event(self, event: str, **fields: Any) -> None:
        """A limiter's event, logged; a limit that moved is kept for `status` too."""
        self.emit(event, **fields)
        if event == "llm.limit_changed":
            self.state.note_daemon(llm_limit=(str(fields["endpoint"]), int(fields["limit"])))

    def hold_if_over_budget(self, key: layout.SetKey) -> bool:
        """Over budget: the set is held (or its report stays stale) instead of run."""
        if not self.budget.reached(key.run):
            return False
        report_exists = key.report_path(self.runs).exists()
        self.state.update(key.id, SetState.STALE if report_exists else SetState.HELD,
                          reason=BUDGET_REASON)
        return True

    async def _in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the job pool, with this task's context (its log fields)."""
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, lambda: context.run(fn, *args))

    async def _job(self, key: layout.SetKey, work: dataset.Work, fp: Fingerprint, job_id: str,
                   attempts: int, finish: Finish | None = None) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        ended = False
        try:
            # Context for every line this job logs: on the loop and in the pool.
            with log.bound_job(job_id=job_id, **key.log_fields()):
                revisit: Revisit | None = None
                try:
                    if finish is not None:
                        revisit = await self._run_paid(key, fp, attempts, finish)
                    elif not await self._in_pool(self._to_batch, key, work, fp, attempts):
                        revisit = await self._run_loss(key, work, fp, attempts)
                except NotWanted as e:
                    revisit = e.revisit
                except Exception:
                    self.log.exception("loss.failed", reason="internal error")
                    revisit = await self._in_pool(self.outcomes.fail, key, fp, attempts,
                                                  "internal error")
                await self._in_pool(self._job_ended, key, revisit)
                ended = True
        finally:
            self._tasks.discard(task)
            if not ended:  # cancelled at shutdown: the claim goes, nothing else is started
                self.claims.end_job(key.id)

    def _job_ended(self, key: layout.SetKey, revisit: Revisit | None) -> None:
        """The one place a job's next look is handed on: the one its outcome
        needs, and one now if a look was asked for while the job ran."""
        self.revisits.ask(revisit, Revisit(key) if self.claims.end_job(key.id) else None)
        self.steps.check(key.step_key)
        self.heartbeat.beat()

    def _to_batch(self, key: layout.SetKey, work: dataset.Work, fp: Fingerprint,
                  attempts: int) -> bool:
        """A set of a run in batch mode joins its step's next batch (True: handed over)."""
        if self.batch is None or not self.batch.wants(key):
            return False
        self._check_wanted(key, fp)
        self.batch.enqueue(key, work, fp, attempts)
        return True

    async def _run_paid(self, key: layout.SetKey, fp: Fingerprint, attempts: int,
                        finish: Finish) -> Revisit | None:
        """A batch reply, paid for: no slot, no still-wanted check (finish compares
        the input hashes); the same outcomes as a live reply."""
        if self.stopping.is_set():
            return None
        result: loss.LossResult | None = None
        error: BaseException | None = None
        try:
            result = await self._in_pool(finish)
        except (InputsChangedError, BadOutputError, RefusedError, LLMError, ConfigError,
                OSError) as e:
            error = e
        return await self._in_pool(self.outcomes.record, key, fp, attempts, result, error)

    def _check_wanted(self, key: layout.SetKey, fp: Fingerprint) -> None:
        """Is a queued job still to run, now that it has a slot? Raises NotWanted if not."""
        if self.stopping.is_set():
            raise NotWanted()
        if sigs_digest(observe(key, self.runs, self.cfg.paths.data).sigs) != fp.sigs:
            raise NotWanted(Revisit(key))  # changed while queued: its settle wait starts again
        if self.hold_if_over_budget(key):
            raise NotWanted()  # queued before the budget ran out; it must not start now

    async def _run_loss(self, key: layout.SetKey, work: dataset.Work, fp: Fingerprint,
                        attempts: int) -> Revisit | None:
        settings = self.cfg.llm
        # Held from before the inputs are read until the outcome is recorded
        # (spend included), given back during backoffs.
        slot = Slot(self.limiters.for_endpoint(settings.model, settings.api_base),
                    keep_after_reply=True)
        task = asyncio.current_task()
        assert task is not None
        self._waiting.add(task)
        try:
            await slot.take()  # a job starts when its endpoint has room for its call
        finally:
            self._waiting.discard(task)
        self.in_call += 1
        try:
            result: loss.LossResult | None = None
            error: BaseException | None = None
            try:
                prepared = await self._in_pool(self._prepare, key, work, fp, attempts)

                def retry(attempt: int, wait_s: float, error: BaseException) -> None:
                    self.emit("loss.retry", level="warning", attempt=attempt,
                              wait_s=round(wait_s, 3), error=str(error))

                completion = await self.complete(prepared.messages, settings, on_retry=retry,
                                                 sleep=self._interruptible_sleep, slot=slot)
                # Checks, guard, re-read, then the atomic write: in the pool.
                result = await self._in_pool(self._finish, prepared, completion)
            except (InputsChangedError, BadOutputError, RefusedError, LLMError, ConfigError,
                    OSError, Abandoned) as e:
                error = e
            return await self._in_pool(self.outcomes.record, key, fp, attempts, result, error)
        finally:
            slot.give_back()
            self.in_call -= 1

    def _prepare(self, key: layout.SetKey, work: dataset.Work, fp: Fingerprint,
                 attempts: int) -> loss.Prepared:
        self._check_wanted(key, fp)
        self.state.update(key.id, SetState.RUNNING)
        job = loss.LossJob(work=work, scripts_dir=key.scripts_dir(self.runs),
                           report_path=key.report_path(self.runs), first=key.first,
                           last=key.last, stat_sigs=fp.sigs)
        prepared = loss.prepare(job, settings=self.cfg.llm, templates=self.templates,
                                confine_to=self.runs, answer_key=self.cfg.paths.data)
        self.emit("loss.started", prompt_chars=len(prepared.prompt),
                  prompt_tokens=prepared.prompt_tokens, attempt=attempts + 1)
        return prepared

    def _finish(self, prepared: loss.Prepared, completion: llm.Completion) -> loss.LossResult:
        integrity = self.cfg.integrity
        return loss.finish(prepared, completion, on_leak=integrity.on_leak,
                           on_contradiction=integrity.on_contradiction,
                           refuse_share=integrity.refuse_share)

    async def _interruptible_sleep(self, seconds: float) -> None:
        """A backoff wait that ends (raising Abandoned) when the daemon stops."""
        if self._aborted is None:
            self._aborted = asyncio.Event()  # made here: on the loop's thread
        if self.abort.is_set():
            raise Abandoned()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._aborted.wait(), seconds)
        if self.abort.is_set():
            raise Abandoned()

    # ------------------------------------------------------------- the end
    def wait_all(self) -> None:
        """--once: every job started (including those a job's end started) has ended."""
        while futures := self.claims.jobs():
            for future in futures:
                future.result()

    def stop_intake(self) -> None:
        """Jobs waiting to retry give up; jobs still waiting for a slot are cancelled
        (found again at the next start); running ones go on until the shutdown bound."""
        self.abort.set()

        def on_loop() -> None:
            if self._aborted is not None:
                self._aborted.set()
            for task in list(self._waiting):
                task.cancel()

        self.llm.call_soon(on_loop)

    def cancel_running(self) -> None:
        """At the shutdown bound: every job still in a call is cancelled, its request
        with it (a cancelled request writes nothing)."""
        def on_loop() -> None:
            for task in list(self._tasks):
                task.cancel()

        self.llm.call_soon(on_loop)
