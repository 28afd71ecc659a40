"""A batch's two ends: sending its sets, and handing each result back to jobs.

Sending: each set is prepared exactly as a live job would be (inputs read
and checked, prompt rendered); the record is saved before the upload. A
set its preparation refuses goes to jobs with that refusal, like a live job.

Results: each item goes to jobs (a worker, the set claimed, the same
except-clauses, retries and barrier as a live job) with a `finish` that
prepares the set again -- equal input hashes give the same prompt -- and
checks the reply through handlers/loss.finish. Inputs changed since the
batch was sent: InputsChangedError, discarded and redone. An item the
provider failed: LLMError with its guarded message, retried like a failed
live call (in the next batch, or live with `[llm] batch_failed = "live"`).
An item an expired or cancelled batch never answered is sent again,
without counting an attempt. A batch the provider did not accept (its
create failed, and no batch carries its key) sends its sets again after the
loss jobs' backoff, growing with each refusal in a row; after `[loss]
max_attempts` of them its sets give up (FAILED, `batch.gave_up`) like a
live call that keeps failing.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ...handlers import loss
from ..core import backoff, config, dataset, layout
from ..core.errors import InputsChangedError, LLMError
from ..core.templates import PromptTemplates
from ..infra import batch_api
from ..infra.batch_api import BatchAPI, BatchAPIError, BatchStatus, ItemResult
from ..infra.state import SetState, StateStore
from .batch_store import OPEN, BatchItem, BatchRecord
from .observe import Fingerprint
from .revisit import Revisit, Revisits, Why

if TYPE_CHECKING:
    from .batch import Waiting

Emit = Callable[..., None]
FINAL_EVENT = {"completed": "batch.completed", "expired": "batch.expired",
               "cancelled": "batch.cancelled", "failed": "batch.failed"}


class Results:
    """Submits prepared sets and dispatches what the provider answered."""

    def __init__(self, cfg: config.Config, state: StateStore, emit: Emit, *, api: BatchAPI,
                 templates: PromptTemplates, works: Callable[[], dict[str, dataset.Work]],
                 run_result: Callable[..., Future[None]],
                 revisits: Revisits,
                 save: Callable[[BatchRecord], None],
                 closed: Callable[[BatchRecord], None]) -> None:
        self.cfg = cfg
        self.runs = cfg.paths.runs
        self.state = state
        self.emit = emit
        self.api = api
        self.templates = templates
        self.works = works
        self.run_result = run_result
        self.revisits = revisits
        self.save = save
        self.closed = closed
        self._lock = threading.Lock()
        self._live: set[str] = set()  # set ids to send live once
        self._create_errors: dict[str, str] = {}  # record key -> why its create failed
        self._refused: dict[str, int] = {}  # step id -> batches not accepted in a row

    # ------------------------------------------------------------ live once
    def send_live(self, set_id: str) -> None:
        with self._lock:
            self._live.add(set_id)

    def take_live(self, set_id: str) -> bool:
        with self._lock:
            if set_id in self._live:
                self._live.discard(set_id)
                return True
            return False

    # ------------------------------------------------------------ sending
    def _prepare(self, key: layout.SetKey, work: dataset.Work, sigs: str | None) -> loss.Prepared:
        job = loss.LossJob(work=work, scripts_dir=key.scripts_dir(self.runs),
                           report_path=key.report_path(self.runs), first=key.first,
                           last=key.last, stat_sigs=sigs)
        return loss.prepare(job, settings=self.cfg.llm, templates=self.templates,
                            confine_to=self.runs, answer_key=self.cfg.paths.data)

    def submit(self, step: layout.StepKey, waiting: list[Waiting],
               new_record: Callable[[layout.StepKey, list[BatchItem]], BatchRecord]) -> None:
        model_name = batch_api.provider_of(self.cfg.llm)[0]
        items: list[BatchItem] = []
        lines: list[str] = []
        for n, w in enumerate(waiting):
            try:
                prepared = self._prepare(w.key, w.work, w.fp.sigs)
            except Exception as e:  # refused input, a template error: as a live job says it
                self.run_result(w.key, w.work, w.fp, w.attempts, _raiser(e))
                continue
            custom_id = f"s{n:04d}"
            items.append(BatchItem(custom_id, w.key.id, prepared.hashes.as_dict(),
                                   w.fp.as_json(), w.attempts))
            lines.append(batch_api.request_line(custom_id, prepared.messages, self.cfg.llm,
                                                model_name))
        if not items:
            return
        rec = new_record(step, items)
        self.save(rec)  # recorded before the provider hears of it
        metadata = {"skilltrain_key": rec.key, "skilltrain_step": rec.step}
        try:
            batch_id = self.api.submit(lines, metadata)
        except BatchAPIError as e:
            # Created or not: the next poll looks for it by its key.
            self.emit("batch.error", level="warning", run=rec.run, step=rec.step,
                      error=str(e), sets=len(items))
            with self._lock:
                self._create_errors[rec.key] = str(e)
            return
        self._opened(rec, batch_id, recovered=False)

    def _opened(self, rec: BatchRecord, batch_id: str, *, recovered: bool) -> None:
        with self._lock:
            self._create_errors.pop(rec.key, None)
            self._refused.pop(rec.step, None)
        rec.batch_id, rec.state = batch_id, OPEN
        rec.submitted_at = rec.submitted_at or time.time()
        self.save(rec)
        for item in rec.items:
            self.state.update(item.set_id, SetState.QUEUED, reason=f"in batch {batch_id}")
        epoch_step = layout.parse_step_id(rec.step) or (None, None)
        self.emit("batch.submitted", run=rec.run, epoch=epoch_step[0], step=epoch_step[1],
                  batch_id=batch_id, sets=len(rec.items), recovered=recovered)

    def resolve_submitting(self, rec: BatchRecord) -> None:
        """A record saved but no batch id: did the provider create it? Adopt or resend."""
        try:
            batch_id = self.api.find(rec.key)
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
        with self._lock:
            error = self._create_errors.pop(rec.key, None)
        if error is None:  # saved by a daemon killed before its create: not a refusal
            for item in rec.items:
                self._again(item.set_id)
            return
        with self._lock:
            refused = self._refused[rec.step] = self._refused.get(rec.step, 0) + 1
        self._not_accepted(rec, refused, error)

    def _not_accepted(self, rec: BatchRecord, refused: int, error: str) -> None:
        """The provider did not accept the step's batch `refused` times in a row:
        its sets wait the loss jobs' backoff, or give up at [loss] max_attempts."""
        gave_up = refused >= self.cfg.loss.max_attempts
        if gave_up:
            with self._lock:
                self._refused.pop(rec.step, None)  # sets made anew start a fresh count
        retry_at = None if gave_up else time.time() + backoff.loss_job(self.cfg).delay_s(refused)
        for item in rec.items:
            key = set_key(item.set_id)
            if key is None:
                continue
            if gave_up:
                reason = f"gave up after {refused} batches the provider did not accept: {error}"
            else:
                reason = f"the provider did not accept its batch ({error}); sent again soon"
            self.state.update(item.set_id, SetState.FAILED, reason=reason,
                              attempts=self.cfg.loss.max_attempts if gave_up else item.attempts,
                              next_retry_at=retry_at, fingerprint=item.fingerprint)
            if retry_at is not None:
                self.revisits.ask(Revisit(key, retry_at, Why.RETRY))
        if gave_up:  # said once its sets are recorded as failed
            self.emit("batch.gave_up", level="error", run=rec.run, step=rec.step,
                      sets=len(rec.items), attempts=refused, error=error)

    # ------------------------------------------------------------ results
    def close(self, rec: BatchRecord, status: BatchStatus) -> bool:
        """Hand every unhandled item to jobs; False when the results could not be read."""
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
        key = set_key(item.set_id)
        work = self.works().get(key.work) if key else None
        fp = Fingerprint.from_json(item.fingerprint)
        if key is None or work is None or fp is None:
            item.outcome = "gone"
            return "unanswered"
        if self._written_before(rec, item, key):
            item.outcome = SetState.DONE.value  # a restart after the write: never twice
            return "written_before"
        if answer is None and status.status != "failed":
            item.outcome = "returned"  # expired or cancelled before it ran: sent again
            if rec.return_live:
                self.send_live(item.set_id)
            self._again(item.set_id)
            return "unanswered"
        ran = threading.Event()
        if answer is not None and answer.body is not None:
            finish = self._finish_reply(rec, item, key, work, answer.body, ran)
            kind = "replies"
        else:
            finish = self._finish_error(item, key, work, answer, status, ran)
            kind = "errors"
        item.dispatched = True
        future = self.run_result(key, work, fp, item.attempts, finish)
        future.add_done_callback(lambda _: self._ended(rec, item, key, ran))
        return kind

    def _finish_reply(self, rec: BatchRecord, item: BatchItem, key: layout.SetKey,
                      work: dataset.Work, body: dict[str, Any],
                      ran: threading.Event) -> Callable[[], loss.LossResult]:
        def finish() -> loss.LossResult:
            ran.set()
            prepared = self._same_inputs(item, key, work)
            completion, note = batch_api.completion(body, self.cfg.llm.model)
            extra: dict[str, Any] = {"mode": "batch", "batch_id": rec.batch_id}
            if note:
                extra["cost_note"] = note
            integrity = self.cfg.integrity
            return loss.finish(prepared, completion, on_leak=integrity.on_leak,
                               on_contradiction=integrity.on_contradiction,
                               refuse_share=integrity.refuse_share, sidecar_extra=extra)
        return finish

    def _finish_error(self, item: BatchItem, key: layout.SetKey, work: dataset.Work,
                      answer: ItemResult | None, status: BatchStatus,
                      ran: threading.Event) -> Callable[[], loss.LossResult]:
        def finish() -> loss.LossResult:
            ran.set()
            prepared = self._same_inputs(item, key, work)
            if self.cfg.llm.batch_failed == "live":
                self.send_live(item.set_id)
            if answer is None:
                raise LLMError(f"the batch failed: {status.errors or 'no reason given'}")
            raise LLMError(batch_api.describe_item_error(answer, prepared.prompt_text,
                                                         self.cfg.llm.api_base))
        return finish

    def _same_inputs(self, item: BatchItem, key: layout.SetKey,
                     work: dataset.Work) -> loss.Prepared:
        """The set prepared again; its inputs must be the ones the batch was sent."""
        fp = Fingerprint.from_json(item.fingerprint)
        prepared = self._prepare(key, work, fp.sigs if fp else None)
        if prepared.hashes.as_dict() != item.inputs:
            changed = [k for k, v in prepared.hashes.as_dict().items()
                       if item.inputs.get(k) != v]
            raise InputsChangedError(f"{', '.join(changed)} of {key.id} changed since the "
                                     "batch was sent; its reply is not written")
        return prepared

    def _ended(self, rec: BatchRecord, item: BatchItem, key: layout.SetKey,
               ran: threading.Event) -> None:
        """A worker handled (or skipped) one result: recorded, and the set looked at."""
        rec_state = self.state.get(item.set_id)
        if not ran.is_set() and rec_state is not None and rec_state.state == SetState.QUEUED:
            item.dispatched = False  # shutting down before it ran: the next start handles it
            return
        item.outcome = rec_state.state.value if rec_state and ran.is_set() else "skipped"
        self.save(rec)
        if not rec.waiting():
            self.closed(rec)
        if item.outcome != SetState.DONE.value:
            self.revisits.look(key)

    def _written_before(self, rec: BatchRecord, item: BatchItem, key: layout.SetKey) -> bool:
        sidecar = loss.read_sidecar(key.report_path(self.runs))
        return bool(sidecar and sidecar.get("batch_id") == rec.batch_id
                    and sidecar.get("inputs") == item.inputs)

    def _again(self, set_id: str) -> None:
        key = set_key(set_id)
        if key is not None:
            self.state.update(set_id, SetState.QUEUED, reason="back from a batch")
            self.revisits.look(key)


def set_key(set_id: str) -> layout.SetKey | None:
    """The SetKey of an id `run/epoch_EE/step_SS/work/FF-LL`."""
    parts = set_id.split("/")
    if len(parts) != 5:
        return None
    step = layout.parse_step_id("/".join(parts[:3]))
    first, _, last = parts[4].partition("-")
    if step is None or not (first.isdigit() and last.isdigit()):
        return None
    return layout.SetKey(parts[0], step[0], step[1], parts[3], int(first), int(last))


def _raiser(error: BaseException) -> Callable[[], loss.LossResult]:
    def finish() -> loss.LossResult:
        raise error
    return finish
