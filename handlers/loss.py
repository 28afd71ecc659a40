"""The loss: put the model's screenplay next to the human original and write
up how they differ in craft.

Both were made from the same story, so plot is not the subject. This is the
one place where the answer key is opened. The report that comes out is the
training signal -- a paragraph of prose instead of a number, but playing the
same role -- and the only thing the optimizer is allowed to learn from. So
every refusal below exists because a wrong report is worse than none.

Nothing is written until everything succeeded: the prompt archive, the
report and the sidecar are written together, atomically, at the end.
"""
from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..daemon.core import dataset
from ..daemon.core.config import LLMConfig
from ..daemon.core.errors import (
    BadOutputError,
    ContradictedReportError,
    InputsChangedError,
    RefusedError,
)
from ..daemon.core.templates import PromptTemplates
from ..daemon.guard import job_keys, leakguard, sealed_write
from ..daemon.infra import llm
from ..daemon.reviewer import craft_claims, craft_distance, craft_measuring, craft_prompt

TEMPLATE = "loss"
SIDECAR_SCHEMA = 1
# English runs at about 4 bytes a token; no tokenizer averages 16. A range
# larger than window * 16 bytes cannot fit, and is refused from its size
# alone, before a 50 MB file is read into memory.
MAX_BYTES_PER_TOKEN = 16
# When litellm does not know the model's window: no range over 8 MB (about
# 2 million tokens, beyond any model's window today).
UNKNOWN_WINDOW_MAX_BYTES = 8_000_000
# Tokens kept free for the report when the model's window is checked.
OUTPUT_RESERVE_TOKENS = 4_096
# The chat format's own tokens around each message (role, separators; litellm
# counts 3-4), above the bytes of its text.
MESSAGE_OVERHEAD_TOKENS = 8

CompleteFn = Callable[..., llm.Completion]


@dataclass(frozen=True)
class LossJob:
    """What one report compares: a work's range against a folder of scripts."""

    work: dataset.Work
    scripts_dir: Path
    report_path: Path
    first: int
    last: int
    # The daemon's stat signature of the episodes when it queued the job
    # (observe.sigs_digest): kept in the sidecar, it lets a start that lost its
    # state tell "unchanged since the report" without hashing every episode.
    stat_sigs: str | None = None

    @property
    def range_label(self) -> str:
        return dataset.format_range(self.first, self.last)

    @property
    def archive_path(self) -> Path:
        return self.report_path.with_name(f"{self.report_path.stem}_prompt.md")

    @property
    def sidecar_path(self) -> Path:
        return sidecar_path(self.report_path)


def sidecar_path(report_path: Path) -> Path:
    return report_path.with_name(f"{report_path.stem}.json")


@dataclass(frozen=True)
class InputHashes:
    """What a report was made from; equal hashes mean the report is up to date."""

    human: str
    model: str
    template: str
    model_id: str

    def as_dict(self) -> dict[str, str]:
        return {"human_sha256": self.human, "model_sha256": self.model,
                "template_sha256": self.template, "model_id": self.model_id}


@dataclass(frozen=True)
class LossResult:
    report_path: Path
    report_bytes: int
    hashes: InputHashes
    completion: llm.Completion
    prompt_chars: int
    prompt_tokens: int | None  # None: not counted, the prompt fits by its bytes alone
    leaks_redacted: int
    duration_ms: int
    claims: craft_claims.ClaimCheck
    sidecar: dict[str, Any] = field(repr=False)


@dataclass(frozen=True)
class LossHooks:
    """Where the handler reports progress; the CLI prints, the daemon logs events."""

    started: Callable[[int, int | None], None] = lambda chars, tokens: None
    retry: llm.RetryHook | None = None


@dataclass(frozen=True)
class Prepared:
    """A loss job up to the LLM call: the inputs read, the prompt rendered.

    What `finish` needs to check a reply, however it came (a live call or a
    provider batch): a batch result is checked by preparing the job again
    (equal hashes: the same prompt) and finishing it with the stored reply.
    """

    job: LossJob
    settings: LLMConfig
    hashes: InputHashes
    messages: list[llm.Message] = field(repr=False)
    prompt: str = field(repr=False)
    archive: str = field(repr=False)
    skeleton: str = field(repr=False)
    slot: str
    model_block: str = field(repr=False)
    model: dict[int, str] = field(repr=False)
    human_stats: craft_measuring.ScreenplayStats = field(repr=False)
    model_stats: craft_measuring.ScreenplayStats = field(repr=False)
    key_index: leakguard.HumanIndex = field(repr=False)
    other_keys: tuple[leakguard.HumanIndex, ...] = field(repr=False)  # every other work's
    template_path: Path
    prompt_tokens: int | None
    max_bytes: int  # the bound the inputs were read under: the check after the call keeps it
    started_at: datetime
    t0: float

    @property
    def prompt_text(self) -> str:
        """Every message's text, for the echo check of a provider's error message."""
        return "\n".join(llm.message_texts(self.messages))


def run(job: LossJob, *, settings: LLMConfig, templates: PromptTemplates,
        on_leak: str = "redact", on_contradiction: str = "annotate",
        refuse_share: float = craft_claims.REFUSE_SHARE, confine_to: Path | None = None,
        answer_key: Path | None = None, hooks: LossHooks | None = None,
        complete: CompleteFn = llm.complete,
        sleep: Callable[[float], None] | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC)) -> LossResult:
    """Write the difference report for episodes job.first..job.last:
    prepare, one live completion, finish.

    `on_contradiction`: what a report whose claims the measurements
    contradict becomes (craft_claims): "annotate" (the measured facts
    appended), "refuse" (more than `refuse_share` of its checked claims
    contradicted: ContradictedReportError, nothing written; else annotated) or "ignore"
    (recorded in the sidecar only).

    Raises RefusedError (bad input or output: nothing written), LLMError
    (the call failed for good: nothing written) or ConfigError (template).
    `answer_key` (default: the work's human/ folder): no model episode may
    be read from inside it, through any link. The daemon runs the same
    three steps apart (prepare and finish in its pool, the call on the LLM
    loop): see daemon/jobs.py.
    """
    hooks = hooks or LossHooks()
    prepared = prepare(job, settings=settings, templates=templates, confine_to=confine_to,
                       answer_key=answer_key, now=now)
    hooks.started(len(prepared.prompt), prepared.prompt_tokens)
    completion = complete(prepared.messages, settings, on_retry=hooks.retry, sleep=sleep)
    return finish(prepared, completion, on_leak=on_leak, on_contradiction=on_contradiction,
                  refuse_share=refuse_share, now=now)


def prepare(job: LossJob, *, settings: LLMConfig, templates: PromptTemplates,
            confine_to: Path | None = None, answer_key: Path | None = None,
            now: Callable[[], datetime] = lambda: datetime.now(UTC)) -> Prepared:
    """Read and check the inputs, render the prompt: everything before the call.

    Raises RefusedError (bad input), ConfigError (template).
    """
    started_at, t0 = now(), time.monotonic()
    window = llm.max_input_tokens(settings.model)
    # A model litellm knows no window for (a local server's) still gets a bound.
    max_bytes = window * MAX_BYTES_PER_TOKEN if window else UNKNOWN_WINDOW_MAX_BYTES

    key_dir = answer_key or job.work.human_dir

    human = job.work.read_human(job.first, job.last, max_bytes=max_bytes)
    model = dataset.read_range(job.scripts_dir, job.first, job.last, label="model",
                               confine_to=confine_to, answer_key=key_dir, max_bytes=max_bytes)
    # Read once per job: for the copy check now and the leak index after the call.
    human_files = job.work.read_human_files()
    job_keys.refuse_copies(job.scripts_dir, model, human_files)
    # The whole work, not the range: a report on ep01-03 must not quote ep06 either;
    # every file of a number (ep01.txt, ep001.txt), and the range as it was read.
    key_index = leakguard.index_for(job.work.name, job_keys.whole_key(human_files, human))
    # Before the call: an error about it may echo this key into the log.
    leakguard.keep_current(key_index)
    other_keys = job_keys.other_works(key_index)
    job_keys.refuse_near_copies(job.scripts_dir, model, (key_index, *other_keys))
    template = templates.load(TEMPLATE)  # read once: the hash is of what we render
    hashes = InputHashes(
        human=dataset.episodes_digest(human),
        model=dataset.episodes_digest(model),
        template=template.source_hash,
        model_id=settings.model,
    )
    human_block = craft_prompt.format_episodes("Human", human)
    model_block = craft_prompt.format_episodes("Model", model)
    # Measured once: the facts in the prompt, the claims check and the craft distance.
    human_stats, model_stats = craft_distance.measure_pair(human, model,
                                                           human_digest=hashes.human)
    fields = dict(work=job.work.name, title=job.work.title,
                  episode_range=f"{job.first}-{job.last}", model_scripts=model_block,
                  **_facts(human_stats, model_stats))
    slot = f"[model-scripts-{secrets.token_hex(8)}]"  # where the archive's model block goes
    prompt = template.render(human_scripts=human_block, **fields)
    placeholder = _placeholder(human, human_stats.words, hashes.human)
    archive = template.render(human_scripts=placeholder, **fields)
    skeleton = template.render(human_scripts=placeholder, **{**fields, "model_scripts": slot})
    messages = build_messages(prompt, model_block, settings.model)
    prompt_tokens = _check_window(messages, settings.model, window, job)
    return Prepared(job=job, settings=settings, hashes=hashes, messages=messages,
                    prompt=prompt, archive=archive, skeleton=skeleton, slot=slot,
                    model_block=model_block, model=model, human_stats=human_stats,
                    model_stats=model_stats, key_index=key_index, other_keys=other_keys,
                    template_path=template.path, prompt_tokens=prompt_tokens,
                    max_bytes=max_bytes, started_at=started_at, t0=t0)


def finish(prepared: Prepared, completion: llm.Completion, *, on_leak: str = "redact",
           on_contradiction: str = "annotate",
           refuse_share: float = craft_claims.REFUSE_SHARE,
           sidecar_extra: dict[str, Any] | None = None,
           now: Callable[[], datetime] = lambda: datetime.now(UTC)) -> LossResult:
    """Check a reply and write report + archive + sidecar, all or nothing.

    Every reply passes here, whatever path it came by: finish reason, empty
    or non-prose text, the leak guard, the claims check, the inputs read
    again. `sidecar_extra`: more sidecar fields (a batch's mode and id).
    Raises BadOutputError, RefusedError, ContradictedReportError,
    InputsChangedError; nothing is written then.
    """
    job, hashes, model = prepared.job, prepared.hashes, prepared.model
    report = completion.text.strip()
    if not dataset.has_words(report):  # "", whitespace, or only invisible characters
        raise BadOutputError(f"the model returned an empty report for {job.work.name} "
                             f"ep{job.range_label} (no letter or digit)")
    if problem := dataset.control_characters(report) or dataset.not_unicode(report):
        raise BadOutputError(f"the report for {job.work.name} ep{job.range_label} is not "
                             f"prose: {problem}")
    if completion.finish_reason is None:  # a batch result that does not say it ended
        raise BadOutputError(f"the report for {job.work.name} ep{job.range_label} does not "
                             "say it is complete (no finish_reason)")
    if completion.finish_reason not in ("stop", "end_turn"):
        raise BadOutputError(f"the report for {job.work.name} ep{job.range_label} was cut off "
                           f"(finish_reason={completion.finish_reason}, "
                           f"{completion.tokens_out:,} tokens out)")

    # One seal for the job: what its guard found clean the writer need not read again.
    seal = seal_of(prepared)
    report, leaks = _guard(report, job, seal, on_leak)
    claims = craft_claims.check_report(report, prepared.human_stats, prepared.model_stats)
    if on_contradiction == "refuse" and claims.too_contradicted(refuse_share):
        raise _contradicted(job, claims, refuse_share)
    if on_contradiction != "ignore" and claims.contradicted:
        # The optimizer reads the correction with the claim, never the claim alone.
        report = f"{report}\n\n{craft_claims.annotation(claims.contradicted)}"
    archive = sealed_write.Archive(prepared.archive, prepared.skeleton, prepared.slot,
                                   prepared.model_block)
    if seal.archive_leaks(archive):
        # The template puts answer-key text into the archive by some other
        # route than human_scripts; writing it would break rule 1.
        raise RefusedError(f"template {prepared.template_path} renders human screenplay "
                           "text outside human_scripts; the prompt archive is not written")
    report_text = report + "\n"
    duration_ms = int((time.monotonic() - prepared.t0) * 1000)
    sidecar = {
        "schema": SIDECAR_SCHEMA,
        "work": job.work.name,
        "range": job.range_label,
        "first": job.first,
        "last": job.last,
        "model": prepared.settings.model,
        "inputs": hashes.as_dict(),
        "model_episodes": {dataset.episode_name(n): dataset.sha256_text(t)
                           for n, t in model.items()},
        **({"model_stat_sigs": job.stat_sigs} if job.stat_sigs else {}),
        "report_sha256": dataset.sha256_text(report_text),
        "finish_reason": completion.finish_reason,
        "tokens_in": completion.tokens_in,
        "tokens_out": completion.tokens_out,
        "tokens_cached": completion.tokens_cached,
        "tokens_cache_write": completion.tokens_cache_write,
        "cost_usd": completion.cost_usd,
        "attempts": completion.attempts,
        **({"service_tier": completion.service_tier} if completion.service_tier else {}),
        "leaks_redacted": leaks,
        # A progress indicator beside the report, never part of the training signal.
        **craft_distance.between(prepared.human_stats, prepared.model_stats).sidecar_fields(),
        **claims.sidecar_fields(on_contradiction),
        "prompt_chars": len(prepared.prompt),
        "prompt_tokens": prepared.prompt_tokens,
        "duration_ms": duration_ms,
        "started_at": prepared.started_at.isoformat(),
        "finished_at": now().isoformat(),
        **(sidecar_extra or {}),
    }
    check_unchanged(prepared)
    # All three or none (a full disk must not leave an archive without its
    # report). The sidecar is renamed last: its presence and hashes mark the
    # report up to date, so a crash between the renames leaves a set redone.
    # The guard reads each file's final text here, after every transform above.
    sealed_write.write_all({job.archive_path: archive, job.report_path: report_text,
                            job.sidecar_path: json.dumps(sidecar, indent=2) + "\n"}, seal)
    return LossResult(report_path=job.report_path, report_bytes=len(report_text.encode()),
                      hashes=hashes, completion=completion, prompt_chars=len(prepared.prompt),
                      prompt_tokens=prepared.prompt_tokens, leaks_redacted=leaks,
                      duration_ms=duration_ms, claims=claims, sidecar=sidecar)


def seal_of(prepared: Prepared) -> sealed_write.Seal:
    """The seal a job's files are written under: its work's key, every other
    work's, and the model's episodes (a report may quote them)."""
    return sealed_write.Seal(prepared.key_index, allow_text="\n".join(prepared.model.values()),
                             others=prepared.other_keys)


def _contradicted(job: LossJob, claims: craft_claims.ClaimCheck,
                  share: float) -> ContradictedReportError:
    """Why a report is refused as confidently wrong: counts and statistic names only."""
    c = claims.counts
    wrong = ", ".join(v.statistic for v in claims.contradicted)
    checked = c["contradicted"] + c["confirmed"]
    counted = (f"{c['contradicted']} of {checked} checked" if checked
               else "none could be checked")
    return ContradictedReportError(
        f"the report for {job.work.name} ep{job.range_label} makes claims the measurements "
        f"contradict or cannot check: {counted}, more than {share:.0%} ({wrong}); not written",
        claims.event_fields())


def _check_window(messages: list[llm.Message], model: str, window: int | None,
                  job: LossJob) -> int | None:
    """Refuse a prompt the model's window cannot hold; its exact token count, if taken.

    Counting is exact and costs ~2 ms (8 ms for 170,000 characters), so it is
    done only when the prompt could be too long: a byte-level tokenizer never
    makes more tokens than the text has UTF-8 bytes, so a prompt whose bytes
    plus the output reserve fit the window fits it. None: not counted.
    """
    if window is None:
        return None
    size = sum(len(text.encode("utf-8")) for text in llm.message_texts(messages))
    if size + MESSAGE_OVERHEAD_TOKENS * len(messages) + OUTPUT_RESERVE_TOKENS <= window:
        return None
    tokens = llm.count_tokens(model, messages)
    if tokens + OUTPUT_RESERVE_TOKENS > window:
        raise RefusedError(
            f"prompt for {job.work.name} ep{job.range_label} is {tokens:,} tokens; "
            f"{model} accepts {window:,} input tokens "
            f"(with {OUTPUT_RESERVE_TOKENS:,} kept for the report)")
    return tokens


def check_template(templates: PromptTemplates) -> None:
    """Render the template once with placeholder values for every documented
    variable: a syntax error or a misspelt variable stops start-up (exit 2)
    instead of failing every job."""
    placeholder = "[placeholder]"
    stats = dict.fromkeys(craft_claims.STATISTICS, 0.0)
    templates.load(TEMPLATE).render(
        work=placeholder, title=placeholder, episode_range="1-3",
        human_scripts=placeholder, model_scripts=placeholder,
        human_facts=placeholder, model_facts=placeholder,
        human_stats=stats, model_stats=stats)


def _facts(human: craft_measuring.ScreenplayStats,
           model: craft_measuring.ScreenplayStats) -> dict[str, Any]:
    """The template's measured statistics: tables to show, values to lay out."""
    return {"human_facts": craft_claims.facts_table(human),
            "model_facts": craft_claims.facts_table(model),
            "human_stats": craft_claims.stats_values(human),
            "model_stats": craft_claims.stats_values(model)}



def build_messages(prompt: str, model_block: str, model: str) -> list[llm.Message]:
    """One user message; for providers with prompt caching, split so the stable
    prefix (instructions + human screenplay) is marked cacheable."""
    cut = prompt.find(model_block)
    if cut <= 0 or not llm.wants_cache_markers(model):
        return [{"role": "user", "content": prompt}]
    return [{"role": "user", "content": [
        {"type": "text", "text": prompt[:cut], "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": prompt[cut:]},
    ]}]


def _placeholder(human: dict[int, str], words: int, digest: str) -> str:
    """What the archive shows instead of the answer key: what was removed, not what it
    said. `words` and `digest`: as measured and hashed already (the human side's
    stats are kept per digest, so this costs no pass over the text)."""
    numbers = sorted(human)
    return (f"[human screenplay omitted from this archive: episodes "
            f"{numbers[0]:02d}-{numbers[-1]:02d}, {len(numbers)} files, {words:,} words, "
            f"sha256 {digest[:16]}. The answer key never enters runs/.]")


def _guard(report: str, job: LossJob, seal: sealed_write.Seal,
           on_leak: str) -> tuple[str, int]:
    """Redact or refuse verbatim answer-key passages in the report."""
    leaks = seal.find(report)
    if not leaks:
        return report, 0
    if on_leak == "refuse":
        raise RefusedError(f"the report for {job.work.name} ep{job.range_label} quotes the "
                           f"human screenplay verbatim in {len(leaks)} place(s)")
    return leakguard.redact(report, leaks), len(leaks)


def check_unchanged(prepared: Prepared) -> None:
    """Read the inputs again just before writing: a report made from files that
    changed or vanished during the call is not written (it would describe
    neither version).

    Their bytes are hashed, not decoded or checked again: bytes with the
    digest the prompt was made from are the very bytes prepare read and
    checked, and any other bytes are a change, whatever they hold (a link to
    the key, a FIFO, a file grown past the bound). Read from the disk, never
    from a stat or the key's cache: a write through a shared mmap moves no
    time. Nothing read here leaves the process. (Decoding and checking them
    again cost a job 0.41 ms of CPU, the bytes' digests 0.19: bench/RESULTS.md.)
    """
    job, hashes = prepared.job, prepared.hashes
    numbers = range(job.first, job.last + 1)
    model = {n: f"{job.scripts_dir}/{dataset.episode_name(n)}" for n in numbers}
    human = {n: f"{job.work.human_dir}/{dataset.episode_name(n)}" for n in numbers}
    # Both read, whichever changed: a changed key drops its kept text even
    # when the model's episodes changed too (the next job reads the disk).
    changed = [(side, where) for side, where, paths, digest in (
        ("model", f"in {job.scripts_dir}", model, hashes.model),
        ("human", f"of {job.work.name}", human, hashes.human))
        if dataset.files_digest(paths, prepared.max_bytes) != digest]
    if any(side == "human" for side, _ in changed):
        dataset.forget_kept(human.values())
    if changed:
        side, where = changed[0]
        raise InputsChangedError(f"{side} episodes {job.range_label} {where} changed during "
                                 "the call (rewritten, replaced or gone); report not written")


def read_sidecar(report_path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(sidecar_path(report_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None

