"""The live transport: each ticket a coroutine on the LLM loop, its call within the limit.

    owner ──send(ticket)──> waits for a slot ──> still wanted? ──> prepare ──> call ──> finish
                                                   │ no           (pool)     (loop)   (pool)
                                                   v                                   v
                                        the Decision it needs       decide (outcomes.py)
                                                   └───────────> Outcome ──> owner applies it

A job is a coroutine on the LLM loop (llm_loop.py). It re-checks its set
when it gets a slot of its endpoint's limiter (changed while queued, over
budget, shutting down) and writes nothing unless the handler wrote a whole
report; what it came to is a Decision (outcomes.py) that the owner applies
(owner.py). A provider batch's reply runs the same way without the call
(`finish_paid`). A call refused for the provider's rate limit is tried again
later without counting against [loss] max_attempts.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from ...handlers import loss
from ..core import config
from ..core.errors import LLMError
from ..infra import llm, llm_flex, log
from ..infra.llm_endpoints import Limiters, Slot, describe
from ..infra.llm_loop import LLMLoop
from ..infra.state import SetState, StateStore
from .budget import Budget
from .decision import NOTHING, Decision, Outcome, Ticket
from .key_at_provider import KeyAtProvider
from .metrics import Metrics
from .observe import observe, sigs_digest
from .outcomes import Abandoned
from .pipeline import EXPECTED, Pipeline
from .revisit import Revisit

Emit = Callable[..., None]
T = TypeVar("T")
# Threads for the jobs' file work (read, render, guard, write): milliseconds a
# job, while its call takes seconds on the loop. Two: one computes while the
# other waits on an fsync. Four cost a third more CPU a job (bench/llm_bench.py
# cpu: 24.7 against 18.1 ms): every syscall of a thread that contends for the
# GIL becomes futex calls (2,000 a job with four).
POOL_THREADS = 2

Finish = Callable[[], loss.LossResult]  # a batch's reply checked and written: pipeline.finish


class NotWanted(Exception):
    """A queued job that must not run now it has a slot; `decision`: what its set needs."""

    def __init__(self, decision: Decision = NOTHING) -> None:
        super().__init__()
        self.decision = decision


class Jobs:
    """The live transport: each ticket a coroutine on the LLM loop, file work on a pool.

    A job waits for a slot of its endpoint's limiter (llm_limit.py) before it
    reads anything, so no more jobs are prepared than can call; reading,
    rendering, the guard and the writes run on POOL_THREADS threads, the
    call itself on the loop. The daemon's thread count does not grow with
    `[loss] concurrency`.
    """

    QUEUED_REASON: str | None = None

    def __init__(self, cfg: config.Config, state: StateStore, emit: Emit, *,
                 stopping: threading.Event, metrics: Metrics, pipeline: Pipeline,
                 budget: Budget, llm_loop: LLMLoop,
                 on_unblocked: Callable[[], None] | None = None,
                 llm_settings: Callable[[str], config.LLMConfig] | None = None) -> None:
        self.cfg = cfg
        self.runs = cfg.paths.runs
        self.state = state
        self.emit = emit
        self.log = log.get_logger("skilltrain.daemon")
        self.stopping = stopping
        self.complete = metrics.timed(llm.acomplete)
        self.pipeline = pipeline
        self.budget = budget
        # One per LLM endpoint: as `[loss] concurrency` says (a number, or adaptive).
        self.limiters = Limiters(fixed=cfg.loss.fixed_concurrency,
                                 floor=cfg.loss.concurrency_min_calls,
                                 ceiling=cfg.loss.concurrency_max_calls,
                                 on_change=self._limit_event, probe=self._probe,
                                 probe_s=cfg.llm.probe_refused_key_s)
        metrics.watch_limiters(self.limiters)
        # A run's [llm] (its run.toml's service_tier): Discovery.llm_settings.
        self.llm_settings = llm_settings or (lambda run: cfg.llm)
        self.flex = llm_flex.FlexWatch(on_change=self.emit)  # flex's "resource unavailable"
        metrics.watch_flex(self.flex)
        self.key_at_provider = KeyAtProvider(emit)
        self.llm = llm_loop
        metrics.watch_llm_loop(llm_loop)
        self.abort = threading.Event()  # abandon jobs waiting to retry
        self.pool = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="loss")
        self._lock = threading.Lock()
        self._futures: dict[str, Future[None]] = {}  # job id -> its coroutine, until it ends
        # On the loop's thread only: every job's task, those still waiting for a
        # slot, the shutdown signal for backoff waits.
        self._tasks: set[asyncio.Task[None]] = set()
        self._waiting: set[asyncio.Task[None]] = set()
        self._aborted: asyncio.Event | None = None
        self.in_call = 0  # jobs holding a slot (read from other threads: a plain int)
        # A key the provider refused works again: the sets that waited are looked at.
        self.on_unblocked = on_unblocked

    def send(self, ticket: Ticket) -> Outcome:
        """A live call for the set: prepare -> call -> finish -> decide."""
        return self._start(ticket, None)

    def finish_paid(self, ticket: Ticket, finish: Finish) -> Outcome:
        """A provider batch's reply for a set, checked and written exactly like a live
        job's: `finish` stands in for prepare -> call -> finish. Cancelled (not
        decided) if the daemon stops before it runs."""
        return self._start(ticket, finish)

    def _start(self, ticket: Ticket, finish: Finish | None) -> Outcome:
        outcome = Outcome()
        with self._lock:  # registered before the job's own end can remove it
            future = self._futures[ticket.job_id] = self.llm.submit(
                self._job(ticket, outcome, finish))
        future.add_done_callback(log.report_task_failure)
        return outcome

    def futures(self) -> list[Future[None]]:
        """Every job not ended: queued, calling, or finishing."""
        with self._lock:
            return list(self._futures.values())

    def _limit_event(self, event: str, **fields: Any) -> None:
        """A limiter's event, logged; what the limiter does now is kept for `status`
        too (its events are its changes of state: no write per call)."""
        self.emit(event, **fields)
        limiter = self.limiters.named(str(fields.get("endpoint")))
        if limiter is not None:
            self.state.note_daemon(llm_endpoint=(limiter.endpoint, describe(limiter)))
        if event == "llm.unblocked" and self.on_unblocked is not None:
            self.on_unblocked()

    def warm_up(self) -> None:
        """litellm imported and the tokenizer loaded; a flex model with no flex price said."""
        llm.warm_up(self.cfg.llm.model)
        self.flex.check_price(self.cfg.llm)

    def refused_key(self) -> LLMError | None:
        """The configured endpoint's key is refused (quota, billing, auth): why."""
        return self.limiters.refusal(self.cfg.llm.model, self.cfg.llm.api_base)

    def refuse_key(self, kind: str, said: str) -> None:
        """A provider batch call was refused for the key (batch_results.py): the
        endpoint blocks as for a live call (one llm.blocked, the probe). From the
        batch thread: done on the loop, and waited for, so the next look holds."""
        limiter = self.limiters.for_endpoint(self.cfg.llm.model, self.cfg.llm.api_base)

        async def block() -> None:
            limiter.block(kind, said)

        self.llm.run(block())

    def look_again(self) -> None:
        """SIGHUP (`systemctl reload`): the operator fixed something. Every blocked
        endpoint is probed now, not in up to probe_refused_key_s (credit topped
        up), and every set is looked at (the unblocking's rescan)."""
        async def probe() -> int:
            return sum(limiter.prober.now() for limiter in self.limiters.blocked())

        self.emit("daemon.reload", blocked_probed=self.llm.run(probe()))
        if self.on_unblocked is not None:
            self.on_unblocked()

    def _probe(self, model: str, api_base: str | None) -> Callable[[], Awaitable[str]]:
        """A blocked endpoint's probe: one small real call with the configured key."""
        settings = self.cfg.llm.model_copy(update={"model": model, "api_base": api_base})
        return lambda: llm.probe(settings)

    async def _in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the job pool, with this task's context (its log fields)."""
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, lambda: context.run(fn, *args))

    async def _job(self, ticket: Ticket, outcome: Outcome, finish: Finish | None) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        key = ticket.key
        try:
            # Context for every line this job logs: on the loop and in the pool.
            with log.bound_job(job_id=ticket.job_id, **key.log_fields()):
                if finish is not None and self.stopping.is_set():
                    return  # a paid reply not handled yet: the next start handles it
                try:
                    if finish is not None:
                        await self._settle(outcome, self._finish_and_decide, ticket, finish)
                    else:
                        await self._run_loss(ticket, outcome)
                except NotWanted as e:
                    wanted = e.decision
                    await self._settle(outcome, lambda: wanted)
                except Exception:
                    self.log.exception("loss.failed", reason="internal error")
                    await self._settle(outcome, self.pipeline.internal_error, ticket)
        finally:
            self._tasks.discard(task)
            with self._lock:
                self._futures.pop(ticket.job_id, None)
            if not outcome.done():  # cancelled at shutdown: the claim goes, nothing else
                outcome.cancel()

    async def _settle(self, outcome: Outcome, decide: Callable[..., Decision],
                      *args: Any) -> None:
        """The job's Decision, made and applied by the owner (outcome.set_result) in
        one turn of the pool: the owner's writes and the step's barrier stay off
        the loop, and a job costs one hand-off fewer between the threads."""
        def decide_and_apply() -> None:
            outcome.set_result(decide(*args))

        await self._in_pool(decide_and_apply)

    def _finish_and_decide(self, ticket: Ticket, finish: Finish) -> Decision:
        """A reply checked and written, then its outcome decided."""
        result: loss.LossResult | None = None
        error: BaseException | None = None
        try:
            result = finish()
        except EXPECTED as e:
            error = e
        return self.pipeline.decide(ticket, result, error)

    def _check_wanted(self, ticket: Ticket) -> None:
        """Is a queued job still to run, now that it has a slot? Raises NotWanted if not."""
        self._check_current(ticket)
        if (held := self.budget.hold(ticket.key)) is not None:
            raise NotWanted(held)  # queued before the budget ran out; it must not start now

    def _check_current(self, ticket: Ticket) -> None:
        """Raises NotWanted if the daemon stops or the set changed while queued."""
        key = ticket.key
        if self.stopping.is_set():
            raise NotWanted()
        if sigs_digest(observe(key, self.runs, self.cfg.paths.data).sigs) != ticket.fp.sigs:
            # Changed while queued: its settle wait starts again.
            raise NotWanted(Decision.look(Revisit(key)))

    def _reuse(self, ticket: Ticket) -> None:
        """Raises NotWanted(done) if the set's retired report came back (pipeline.reuse)."""
        self._check_current(ticket)
        prepared = self.pipeline.prepare(ticket.key, ticket.work, ticket.fp.sigs)
        if (reused := self.pipeline.reuse(ticket, prepared)) is not None:
            raise NotWanted(reused)  # no call to make

    async def _run_loss(self, ticket: Ticket, outcome: Outcome) -> None:
        settings = self.cfg.llm
        if self.pipeline.has_retired(ticket.key):
            # Its retired report may come back unpaid: before anything that holds
            # the call back (the endpoint's room, a refused key, the budget).
            try:
                await self._in_pool(self._reuse, ticket)
            except EXPECTED as e:  # its inputs refused, as the job would have them
                return await self._settle(outcome, self.pipeline.decide, ticket, None, e)
        # Held from before the inputs are read until the outcome is decided
        # (spend included), given back during backoffs.
        slot = Slot(self.limiters.for_endpoint(settings.model, settings.api_base),
                    keep_after_reply=True)
        task = asyncio.current_task()
        assert task is not None
        self._waiting.add(task)
        try:
            await slot.take()  # a job starts when its endpoint has room for its call
        except LLMError as e:  # the provider refuses the key: the set waits, unsent
            return await self._settle(outcome, self.pipeline.decide, ticket, None, e)
        finally:
            self._waiting.discard(task)
        self.in_call += 1
        try:
            try:
                prepared, settings = await self._in_pool(self._prepare, ticket, outcome)

                def retry(attempt: int, wait_s: float, error: BaseException) -> None:
                    self.emit("loss.retry", level="warning", attempt=attempt,
                              wait_s=round(wait_s, 3), error=str(error))

                completion = await llm_flex.complete(
                    self.complete, prepared.messages, settings, watch=self.flex,
                    on_retry=retry, sleep=self._interruptible_sleep, slot=slot)
            except EXPECTED as e:
                return await self._settle(outcome, self.pipeline.decide, ticket, None, e)
            # Checks, guard, re-read, then the atomic write: in the pool.
            await self._settle(outcome, self._finish_and_decide, ticket,
                               lambda: self.pipeline.finish(ticket.key, prepared, completion))
        finally:
            slot.give_back()
            self.in_call -= 1

    def _prepare(self, ticket: Ticket, outcome: Outcome
                 ) -> tuple[loss.Prepared, config.LLMConfig]:
        """The set's prompt, and the [llm] its run calls with."""
        self._check_wanted(ticket)
        outcome.note(SetState.RUNNING)
        prepared = self.pipeline.prepare(ticket.key, ticket.work, ticket.fp.sigs)
        settings = self.llm_settings(ticket.key.run)
        self.emit("loss.started", prompt_chars=len(prepared.prompt),
                  prompt_tokens=prepared.prompt_tokens, attempt=ticket.attempts + 1)
        if settings.flex:  # the prompt (the answer key) goes by flex: said once per run
            self.flex.check_price(settings)
            self.key_at_provider.sent(ticket.key.run, provider=llm_flex.provider(settings.model),
                                      retention=llm_flex.FLEX_RETENTION, via="flex")
        return prepared, settings

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
        while futures := self.futures():
            for future in futures:
                with contextlib.suppress(Exception):
                    future.result()

    def stop_intake(self) -> None:
        """Jobs waiting to retry give up; jobs still waiting for a slot are cancelled
        (found again at the next start); running ones go on until the shutdown bound."""
        self.abort.set()

        def on_loop() -> None:
            for limiter in self.limiters.all():
                limiter.close()  # no probe of a refused key after this
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
