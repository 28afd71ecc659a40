"""A set's way to a report, whichever transport carries its request.

    prepare (inputs read and checked, prompt rendered)
      -> reuse (its retired report, if made from these very inputs: no call)
      -> send (a live call: jobs.py; an item of a provider batch: batch.py)
      -> finish (the reply checked, guarded, written: handlers/loss.finish)
      -> decide (outcomes.py: the Decision the owner applies)

Both transports call these and nothing else of handlers/loss: a batch's
reply is checked, written and retried exactly like a live one.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ...handlers import loss
from ..core import config, dataset, layout
from ..core.errors import (
    BadOutputError,
    ConfigError,
    InputsChangedError,
    LLMError,
    RefusedError,
)
from ..core.templates import PromptTemplates
from ..guard import sealed_write
from ..infra import llm, log
from . import retire
from .decision import Decision, Ticket
from .outcomes import PAID, Abandoned, Outcomes

# What a set's way to a report may end in, short of a bug: each has its outcome.
EXPECTED = (InputsChangedError, BadOutputError, RefusedError, LLMError, ConfigError, OSError,
            Abandoned)


@contextlib.contextmanager
def paid_for(completion: llm.Completion) -> Iterator[None]:
    """What goes wrong in here came after `completion` was paid for: the error
    carries it, and Outcomes counts it in the run's spend, written or not."""
    try:
        yield
    except EXPECTED as e:
        setattr(e, PAID, completion)
        raise


class Pipeline:
    """prepare, finish and decide: the steps every transport shares."""

    def __init__(self, cfg: config.Config, templates: PromptTemplates,
                 outcomes: Outcomes, folders: retire.StepFolders) -> None:
        self.cfg = cfg
        self.runs = cfg.paths.runs
        self.templates = templates
        self.outcomes = outcomes
        self.folders = folders  # where a report may land, and when

    def prepare(self, key: layout.SetKey, work: dataset.Work,
                stat_sigs: str | None) -> loss.Prepared:
        job = loss.LossJob(work=work, scripts_dir=key.scripts_dir(self.runs),
                           report_path=key.report_path(self.runs), first=key.first,
                           last=key.last, stat_sigs=stat_sigs)
        return loss.prepare(job, settings=self.cfg.llm, templates=self.templates,
                            confine_to=self.runs, answer_key=self.cfg.paths.data)

    def finish(self, key: layout.SetKey, prepared: loss.Prepared, completion: llm.Completion,
               sidecar_extra: dict[str, Any] | None = None) -> loss.LossResult:
        """The reply checked and written, if the set is still one its step has
        (LeftStepError if not: its step's optimizer may be reading the folder)."""
        integrity = self.cfg.integrity
        with paid_for(completion), self.folders.landing(key):
            return loss.finish(prepared, completion, on_leak=integrity.on_leak,
                               on_contradiction=integrity.on_contradiction,
                               refuse_share=integrity.refuse_share,
                               sidecar_extra=sidecar_extra)

    def reuse(self, ticket: Ticket, prepared: loss.Prepared) -> Decision | None:
        """The set's retired report, if it was made from exactly these inputs under
        this [integrity] (a set that left its step and came back unchanged):
        written back with its sidecar and an archive rendered anew, through the
        seal, under the landing gate, as a report is, and the set done, unpaid.
        None: there is none (the set is reported afresh)."""
        key, job = ticket.key, prepared.job
        if not retire.has_retired(self.runs, key):
            return None  # the step never retired this set's report: no gate
        with log.bound_job(job_id=ticket.job_id, **key.log_fields()), \
                self.folders.landing(key):
            for retired, report, sidecar, data in retire.retired_copies(
                    self.runs, key, job.report_path, prepared.hashes.as_dict()):
                if not self._same_integrity(data):
                    continue
                loss.check_unchanged(prepared)  # the disk's
                archive = sealed_write.Archive(prepared.archive, prepared.skeleton,
                                               prepared.slot, prepared.model_block)
                try:
                    sealed_write.write_all({job.archive_path: archive, job.report_path: report,
                                            job.sidecar_path: sidecar}, loss.seal_of(prepared))
                except sealed_write.SealRefused as e:  # read by a stricter guard, or keys since
                    self.outcomes.emit("loss.reuse_refused", level="warning", reason=str(e),
                                       retired=str(retired[0]))
                    continue
                for path in retired:  # back in its folder: the copy would only be found again
                    with contextlib.suppress(OSError):
                        path.unlink()
                return self.outcomes.reused(key, ticket.fp, retired[0], data)
        return None

    def has_retired(self, key: layout.SetKey) -> bool:
        """May `reuse` give this set's report back? (A stat, or a listing.)"""
        return retire.has_retired(self.runs, key)

    def _same_integrity(self, sidecar: dict[str, Any]) -> bool:
        """Was the report written as [integrity] would write it now? A report with
        quotes redacted is not one `on_leak = "refuse"` writes, nor claims annotated
        under another `on_contradiction`."""
        integrity = self.cfg.integrity
        claims = sidecar.get("claims")
        mode = claims.get("on_contradiction") if isinstance(claims, dict) else None
        return mode == integrity.on_contradiction and not (
            integrity.on_leak == "refuse" and sidecar.get("leaks_redacted"))

    def decide(self, ticket: Ticket, result: loss.LossResult | None,
               error: BaseException | None) -> Decision:
        return self.outcomes.record(ticket.key, ticket.fp, ticket.attempts, result, error)

    def internal_error(self, ticket: Ticket) -> Decision:
        return self.outcomes.fail(ticket.key, ticket.fp, ticket.attempts, "internal error")
