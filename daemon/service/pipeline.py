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
import json
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
from ..infra import llm
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
        """The set's retired report, if it was made from exactly these inputs (a set
        that left its step and came back unchanged): written back through the
        seal, under the landing gate, as a report is, and the set done, unpaid.
        None: there is none (the set is reported afresh)."""
        key, job = ticket.key, prepared.job
        if not retire.retired_dir(self.runs, key.step_key).is_dir():
            return None  # the step never retired a report: one stat, no gate
        targets = (job.archive_path, job.report_path, job.sidecar_path)
        with self.folders.landing(key):
            found = retire.retired_copy(self.runs, key, targets, prepared.hashes.as_dict())
            if found is None:
                return None
            retired, texts = found
            try:
                sealed_write.write_all(texts, loss.seal_of(prepared))
            except sealed_write.SealRefused as e:  # a key added since holds its text
                self.outcomes.emit("loss.reuse_refused", level="warning", reason=str(e))
                return None
        for path in retired:  # back in its folder: the copy would only be found again
            with contextlib.suppress(OSError):
                path.unlink()
        sidecar = json.loads(texts[job.sidecar_path])  # parsed once already: a dict
        return self.outcomes.reused(key, ticket.fp, retired[-1], sidecar)

    def decide(self, ticket: Ticket, result: loss.LossResult | None,
               error: BaseException | None) -> Decision:
        return self.outcomes.record(ticket.key, ticket.fp, ticket.attempts, result, error)

    def internal_error(self, ticket: Ticket) -> Decision:
        return self.outcomes.fail(ticket.key, ticket.fp, ticket.attempts, "internal error")
