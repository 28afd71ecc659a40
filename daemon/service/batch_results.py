"""A batch's two ends: sending its tickets, and turning each result into a Decision.

Sending: each set is prepared by the pipeline exactly as a live job is
(inputs read and checked, prompt rendered); the record is saved before the
upload. A set its preparation refuses is decided with that refusal, like a
live job.

Results: each item runs as a paid job (jobs.finish_paid: the same
except-clauses and outcomes as a live reply) with a `finish` that prepares
the set again -- equal input hashes give the same prompt -- and checks the
reply through the pipeline's finish; its Decision goes to the owner through
the outcome the owner listens on. Inputs changed since the
batch was sent: InputsChangedError, discarded and redone. An item the
provider failed: LLMError with its guarded message, retried like a failed
live call (in the next batch, or live with `[llm] batch_failed = "live"`).
An item an expired or cancelled batch never answered is sent again,
without counting an attempt. A batch the provider did not accept (its
create failed, and no batch carries its key) is an attempt of each of its
sets, kept in the state like a failed call's (the record keeps why the
create failed, so a restart counts it too): its sets are sent again after
the loss jobs' backoff, and give up at `[loss] max_attempts` (FAILED,
`batch.gave_up`) like a live call that keeps failing. Not so a batch whose
upload or create the provider refuses for the key itself (quota, billing,
auth: llm_errors.refused_key): no wait fixes that, so it blocks the endpoint
as a live call's refusal does (`refuse_key`: the limiter's one llm.blocked,
its gauge and alert, status, --once's exit), and its sets wait HELD with the
reason, their attempts as they were; the endpoint's unblocking (a probe that
passes; a restart starts unblocked) looks at them again. While it is blocked, nothing is uploaded.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ...handlers import loss
from ..core import backoff, config, dataset, layout
from ..core.errors import InputsChangedError, LLMError
from ..infra import batch_api
from ..infra.batch_api import BatchAPI, BatchAPIError, BatchStatus, ItemResult
from ..infra.state import SetState
from .batch_store import OPEN, BatchItem, BatchRecord
from .decision import NOTHING, Decision, Outcome, Ticket
from .jobs import Finish
from .key_at_provider import KeyAtProvider
from .observe import Fingerprint
from .pipeline import Pipeline, paid_for
from .revisit import Revisit, Why

Emit = Callable[..., None]
FINAL_EVENT = {"completed": "batch.completed", "expired": "batch.expired",
               "cancelled": "batch.cancelled", "failed": "batch.failed"}


def back(key: layout.SetKey, reason: str) -> Decision:
    """A set a batch gives back unsent or unanswered: queued, and looked at now."""
    return Decision.write(SetState.QUEUED, reason=reason, revisit=Revisit(key))


class Results:
    """Submits prepared sets and decides what the provider answered."""

    def __init__(self, cfg: config.Config, emit: Emit, *, api: BatchAPI, pipeline: Pipeline,
                 finish_paid: Callable[[Ticket, Finish], Outcome],
                 save: Callable[[BatchRecord], None],
                 closed: Callable[[BatchRecord], None],
                 clock: Callable[[], float] = time.time,
                 refused_key: Callable[[], LLMError | None] = lambda: None,
                 refuse_key: Callable[[str, str], None] = lambda kind, said: None,
                 taken: Callable[[], set[str]] = set) -> None:
        self.cfg = cfg
        self.runs = cfg.paths.runs
        self.emit = emit
        self.api = api
        self.pipeline = pipeline
        self.finish_paid = finish_paid
        self.save = save
        self.closed = closed
        self.clock = clock  # wall clock: submitted_at and a retry's time are kept
        # The key refused (why, or None); saying so blocks the endpoint, as live.
        self.refused_key, self.refuse_key = refused_key, refuse_key
        self.taken = taken  # the batch ids open records own (not another's to adopt)
        self._lock = threading.Lock()
        self._live: set[str] = set()  # set ids to send live once
        self.key_at_provider = KeyAtProvider(emit)  # runs told where their key now is
        self._outcomes: dict[str, tuple[Ticket, Outcome]] = {}  # a carried set's, by its id

    # ------------------------------------------------------------ live once
    def send_live(self, set_id: str) -> None:
        with self._lock:
            self._live.add(set_id)

    def take_live(self, set_id: str) -> bool:
        with self._lock:
            taken = set_id in self._live
            self._live.discard(set_id)
            return taken

    # ------------------------------------------------------------ the owner's outcomes
    def _carry(self, ticket: Ticket, outcome: Outcome) -> None:
        with self._lock:
            self._outcomes[ticket.key.id] = (ticket, outcome)

    def _ticket(self, set_id: str) -> Ticket | None:
        with self._lock:
            return carried[0] if (carried := self._outcomes.get(set_id)) else None

    def _decided(self, set_id: str, decision: Decision) -> None:
        """The set's Decision to its owner: the batch is done with it."""
        with self._lock:
            carried = self._outcomes.pop(set_id, None)
        if carried is not None:
            carried[1].set_result(decision)

    def recover(self, rec: BatchRecord,
                works: dict[str, dataset.Work]) -> list[tuple[Ticket, Outcome, str]]:
        """A record found at start: a ticket and an outcome for each set it still
        carries (the owner claims them); an item whose set or work is gone is closed."""
        found = []
        for item in rec.waiting():
            key = layout.SetKey.parse(item.set_id)
            work = works.get(key.work) if key else None
            fp = Fingerprint.from_json(item.fingerprint)
            if key is None or work is None or fp is None:
                item.outcome = "gone"
                continue
            ticket, outcome = Ticket(key, work, fp, item.attempts), Outcome()
            self._carry(ticket, outcome)
            found.append((ticket, outcome, f"in batch {rec.batch_id or rec.key}"))
        return found

    # ------------------------------------------------------------ sending
    def submit(self, step: layout.StepKey, waiting: list[tuple[Ticket, Outcome]],
               new_record: Callable[[layout.StepKey, list[BatchItem]], BatchRecord]) -> None:
        model_name = batch_api.provider_of(self.cfg.llm)[0]
        items: list[BatchItem] = []
        lines: list[str] = []
        refused = self.refused_key()
        # Request ids unique across every batch: a batch adopted by mistake (Anthropic's
        # are found by size and time alone) answers none of this one's sets.
        nonce = uuid.uuid4().hex[:16]
        for n, (ticket, outcome) in enumerate(waiting):
            self._carry(ticket, outcome)
            # Gathered before the key was refused: not uploaded, its retired report tried.
            hold = held(ticket.key, self.runs, refused, ticket.attempts) if refused else None
            if hold and not self.pipeline.has_retired(ticket.key):
                self._decided(ticket.key.id, hold)
                continue
            try:
                prepared = self.pipeline.prepare(ticket.key, ticket.work, ticket.fp.sigs)
                reused = self.pipeline.reuse(ticket, prepared)
            except Exception as e:  # refused input, a template error: as a live job says it
                self._run(ticket, _raiser(e))
                continue
            if (done := reused or hold) is not None:  # its retired report is back, or held
                self._decided(ticket.key.id, done)
                continue
            custom_id = f"{nonce}-{n:04d}"
            items.append(BatchItem(custom_id, ticket.key.id, prepared.hashes.as_dict(),
                                   ticket.fp.as_json(), ticket.attempts))
            lines.append(self.api.request_line(custom_id, prepared.messages, self.cfg.llm,
                                               model_name))
        for chunk in _chunks(items, lines, self.api.LIMITS):
            self._send(step, [items[i] for i in chunk], [lines[i] for i in chunk], new_record)

    def _send(self, step: layout.StepKey, items: list[BatchItem], lines: list[str],
              new_record: Callable[[layout.StepKey, list[BatchItem]], BatchRecord]) -> None:
        rec = new_record(step, items)
        self.save(rec)  # recorded before the provider hears of it
        metadata = {"skilltrain_key": rec.key, "skilltrain_step": rec.step}
        try:
            batch_id = self.api.submit(lines, metadata)
        except BatchAPIError as e:
            if e.sent:  # uploaded, then the create failed: the key went there all the same
                self.key_at_provider.sent(rec.run, provider=self.api.PROVIDER,
                                          retention=self.api.RETENTION, via="batch")
            if e.blocked:  # the key refused: no batch was made, the sets wait for the key
                self._refused(rec, e.blocked, str(e))
                return
            # Created or not: the next poll looks for it by its key.
            self.emit("batch.error", level="warning", run=rec.run, step=rec.step,
                      error=str(e), sets=len(items))
            rec.create_error = str(e)
            self.save(rec)  # a restart counts it as a refusal too
            return
        self._opened(rec, batch_id, recovered=False)

    def _refused(self, rec: BatchRecord, kind: str, said: str) -> None:
        """The key refused at upload or create: the endpoint blocks, the record closes
        (nothing made, nothing paid), its sets wait HELD (not an attempt)."""
        self.refuse_key(kind, said)
        why = self.refused_key() or LLMError(said, blocked=kind)
        for item in rec.items:
            item.outcome = "returned"
        self.closed(rec)
        for item in rec.items:  # each decided after the record is gone
            if (key := layout.SetKey.parse(item.set_id)) is not None:
                self._decided(item.set_id, held(key, self.runs, why, item.attempts))

    def _opened(self, rec: BatchRecord, batch_id: str, *, recovered: bool) -> None:
        with self._lock:
            outcomes = [self._outcomes.get(item.set_id) for item in rec.items]
        rec.batch_id, rec.state, rec.create_error = batch_id, OPEN, None
        rec.submitted_at = rec.submitted_at or self.clock()
        self.save(rec)
        for carried in outcomes:
            if carried is not None:
                carried[1].note(SetState.QUEUED, f"in batch {batch_id}")
        # The answer key now sits at the provider: say where, once.
        self.key_at_provider.sent(rec.run, provider=self.api.PROVIDER,
                                  retention=self.api.RETENTION, via="batch")
        epoch_step = layout.parse_step_id(rec.step) or (None, None)
        self.emit("batch.submitted", run=rec.run, epoch=epoch_step[0], step=epoch_step[1],
                  batch_id=batch_id, sets=len(rec.items), recovered=recovered)

    def resolve_submitting(self, rec: BatchRecord) -> None:
        """A record saved but no batch id: did the provider create it? Adopt or resend."""
        try:
            batch_id = self.api.find(rec.key, rec.created_at, len(rec.items),
                                     taken=self.taken())
        except BatchAPIError as e:
            self.emit("batch.error", level="warning", run=rec.run, step=rec.step, error=str(e))
            return
        if batch_id is not None:
            self._opened(rec, batch_id, recovered=True)
            return
        # Never created: nothing was paid; its sets are sent again (next batch).
        for item in rec.items:
            item.outcome = "returned"
        self.closed(rec)
        if rec.create_error is None:  # saved by a daemon killed before its create
            for item in rec.items:
                self._give_back(item.set_id, "back from a batch")
            return
        self._not_accepted(rec, rec.create_error)

    def _not_accepted(self, rec: BatchRecord, error: str) -> None:
        """The provider did not accept the batch: each set decided (not_accepted)."""
        decisions, gave_up = not_accepted(rec.items, error, self.cfg, self.clock())
        for set_id, decision in decisions:
            self._decided(set_id, decision)
        if gave_up:  # said once its sets are recorded as failed
            self.emit("batch.gave_up", level="error", run=rec.run, step=rec.step,
                      sets=gave_up, attempts=max(item.attempts + 1 for item in rec.items),
                      error=error)

    # ------------------------------------------------------------ results
    def close(self, rec: BatchRecord, status: BatchStatus) -> bool:
        """Run every unhandled item's result; False when the results could not be read."""
        try:
            lines = self.api.results(status.output_file_id) + self.api.results(status.error_file_id)
        except BatchAPIError as e:
            self.emit("batch.error", level="warning", run=rec.run, batch_id=rec.batch_id,
                      error=str(e))
            return False
        answers = {r.custom_id: r for r in lines}
        counts = {"replies": 0, "errors": 0, "unanswered": 0, "written_before": 0}
        for item in rec.waiting():
            counts[self._dispatch(rec, item, answers.get(item.custom_id), status)] += 1
        self.save(rec)
        self.emit(FINAL_EVENT[status.status],
                  level="info" if status.status == "completed" else "warning",
                  run=rec.run, step=rec.step, batch_id=rec.batch_id, sets=len(rec.items),
                  **counts, **({"error": status.errors} if status.errors else {}))
        if not rec.waiting():
            self.closed(rec)
        return True

    def _dispatch(self, rec: BatchRecord, item: BatchItem, answer: ItemResult | None,
                  status: BatchStatus) -> str:
        if item.dispatched:
            return "replies"  # its paid job runs
        ticket = self._ticket(item.set_id)
        if ticket is None:
            item.outcome = "gone"
            return "unanswered"
        key = ticket.key
        if self._written_before(rec, item, key):
            item.outcome = SetState.DONE.value  # a restart after the write: never twice
            self._decided(item.set_id, Decision.look(Revisit(key)))
            return "written_before"
        if answer is None and status.status != "failed":
            item.outcome = "returned"  # expired or cancelled before it ran: sent again
            if rec.return_live:
                self.send_live(item.set_id)
            self._give_back(item.set_id, "back from a batch")
            return "unanswered"
        if answer is not None and answer.body is not None:
            finish = self._finish_reply(rec, item, ticket, answer.body)
            kind = "replies"
        else:
            finish = self._finish_error(item, ticket, answer, status)
            kind = "errors"
        item.dispatched = True
        paid = self._run(ticket, finish)
        paid.add_done_callback(lambda done: self._ended(rec, item, done))
        return kind

    def _run(self, ticket: Ticket, finish: Finish) -> Outcome:
        """A result (or a refusal) through the paid job; its Decision goes to the owner."""
        paid = self.finish_paid(ticket, finish)
        paid.add_done_callback(lambda done: None if done.cancelled()
                               else self._decided(ticket.key.id, done.result()))
        return paid

    def _finish_reply(self, rec: BatchRecord, item: BatchItem, ticket: Ticket,
                      body: dict[str, Any]) -> Finish:
        def finish() -> loss.LossResult:
            completion, note = self.api.completion(body, self.cfg.llm.model)
            with paid_for(completion):  # its inputs changed since: discarded, paid all the same
                prepared = self._same_inputs(item, ticket)
            extra: dict[str, Any] = {"mode": "batch", "batch_id": rec.batch_id}
            if note:
                extra["cost_note"] = note
            return self.pipeline.finish(ticket.key, prepared, completion, extra)
        return finish

    def _finish_error(self, item: BatchItem, ticket: Ticket, answer: ItemResult | None,
                      status: BatchStatus) -> Finish:
        def finish() -> loss.LossResult:
            prepared = self._same_inputs(item, ticket)
            if self.cfg.llm.batch_failed == "live":
                self.send_live(item.set_id)
            if answer is None:
                raise LLMError(f"the batch failed: {status.errors or 'no reason given'}")
            raise LLMError(batch_api.describe_item_error(answer, prepared.prompt_text,
                                                         self.cfg.llm.api_base))
        return finish

    def _same_inputs(self, item: BatchItem, ticket: Ticket) -> loss.Prepared:
        """The set prepared again; its inputs must be the ones the batch was sent."""
        prepared = self.pipeline.prepare(ticket.key, ticket.work, ticket.fp.sigs)
        if prepared.hashes.as_dict() != item.inputs:
            changed = [k for k, v in prepared.hashes.as_dict().items()
                       if item.inputs.get(k) != v]
            raise InputsChangedError(f"{', '.join(changed)} of {ticket.key.id} changed since "
                                     "the batch was sent; its reply is not written")
        return prepared

    def _ended(self, rec: BatchRecord, item: BatchItem, paid: Future[Decision]) -> None:
        """A paid job handled one result: recorded in the batch's record."""
        if paid.cancelled():
            item.dispatched = False  # shutting down before it ran: the next start handles it
            return
        decision = paid.result()
        item.outcome = decision.state.value if decision.state is not None else "skipped"
        self.save(rec)
        if not rec.waiting():
            self.closed(rec)

    def _written_before(self, rec: BatchRecord, item: BatchItem, key: layout.SetKey) -> bool:
        sidecar = loss.read_sidecar(key.report_path(self.runs))
        return bool(sidecar and sidecar.get("batch_id") == rec.batch_id
                    and sidecar.get("inputs") == item.inputs)

    def _give_back(self, set_id: str, reason: str) -> None:
        key = layout.SetKey.parse(set_id)
        self._decided(set_id, back(key, reason) if key is not None else NOTHING)


def not_accepted(items: list[BatchItem], error: str, cfg: config.Config,
                 now: float) -> tuple[list[tuple[str, Decision]], int]:
    """The sets of a batch the provider did not accept: one more attempt of each
    (kept in the state, so a restart goes on counting), which waits the loss
    jobs' backoff, or gives up at [loss] max_attempts like a call that keeps
    failing. Each set's Decision, and how many gave up."""
    decisions: list[tuple[str, Decision]] = []
    gave_up = 0
    # One wait per count: the sets of a refused batch go back together (one batch).
    waits: dict[int, float] = {}
    for item in items:
        key = layout.SetKey.parse(item.set_id)
        if key is None:
            continue
        refused = item.attempts + 1
        if refused >= cfg.loss.max_attempts:
            gave_up += 1
            retry_at = None
            reason = f"gave up after {refused} batches the provider did not accept: {error}"
        else:
            if refused not in waits:
                waits[refused] = backoff.loss_job(cfg).delay_s(refused)
            retry_at = now + waits[refused]
            reason = f"the provider did not accept its batch ({error}); sent again soon"
        decisions.append((item.set_id, Decision.write(
            SetState.FAILED, reason=reason, attempts=refused, next_retry_at=retry_at,
            fingerprint=item.fingerprint,
            revisit=None if retry_at is None else Revisit(key, retry_at, Why.RETRY))))
    return decisions, gave_up


def held(key: layout.SetKey, runs: Path, why: LLMError, attempts: int) -> Decision:
    """A set the refused key holds back: HELD (STALE with a report), saying why, its
    attempts as they were; no revisit (the endpoint's unblocking rescans), as live."""
    stale = key.report_path(runs).exists()
    return Decision.write(SetState.STALE if stale else SetState.HELD, reason=str(why),
                          attempts=attempts, next_retry_at=None, rate_limited=0)


def _chunks(items: list[BatchItem], lines: list[str],
            limits: dict[str, int]) -> list[list[int]]:
    """The items split into batches within the provider's limits (requests, bytes)."""
    chunks: list[list[int]] = []
    size = 0
    for i, line in enumerate(lines):
        length = len(line.encode("utf-8")) + 1
        if not chunks or len(chunks[-1]) >= limits["requests"] \
                or size + length > limits["bytes"]:
            chunks.append([])
            size = 0
        chunks[-1].append(i)
        size += length
    return chunks


def _raiser(error: BaseException) -> Finish:
    def finish() -> loss.LossResult:
        raise error
    return finish
