"""`skilltrain loss`: the seed's one-shot loss step, with its flags and messages."""
from __future__ import annotations

import argparse
import sys

from ...handlers import loss
from ..core import config, dataset
from ..core.errors import ExitCode, LLMError, RefusedError
from ..core.templates import PromptTemplates
from ..guard import leakguard_live
from ..infra import llm
from ..reviewer import craft_claims


def main(args: argparse.Namespace) -> int:
    cfg = config.load(args.config)
    overrides: dict[str, object] = {}
    if args.model is not None:
        overrides["model"] = args.model
    if args.timeout is not None:
        overrides["timeout_s"] = args.timeout
    settings = config.with_llm_overrides(cfg.llm, overrides, origin="the command line")
    llm.check_credentials(settings)  # a missing key is exit 2, not five failed attempts
    work = dataset.load_work(args.work)
    # The other works beside it in data/: a copy of one in the scripts is refused
    # unsent, a quote of one in the reply redacted, as the daemon does.
    leakguard_live.install(work.root.parent)
    job = loss.LossJob(work=work, scripts_dir=args.scripts.resolve(),
                       report_path=args.out.resolve(), first=args.first, last=args.last)
    label = f"{work.name} ep{job.first:02d}-{job.last:02d}"

    def started(chars: int, tokens: int | None) -> None:
        counted = "" if tokens is None else f", {tokens:,} tokens"
        print(f"[loss] {label}, prompt {chars:,} chars{counted}", flush=True)

    def retry(attempt: int, wait_s: float, error: BaseException) -> None:
        print(f"[loss] attempt {attempt} failed ({error}); retrying in {wait_s:.1f}s",
              file=sys.stderr, flush=True)

    try:
        result = loss.run(job, settings=settings, templates=PromptTemplates(cfg.paths.prompts),
                          on_leak=cfg.integrity.on_leak,
                          on_contradiction=cfg.integrity.on_contradiction,
                          refuse_share=cfg.integrity.refuse_share,
                          hooks=loss.LossHooks(started=started, retry=retry))
    except RefusedError as e:
        print(f"[loss] refused: {e}", file=sys.stderr)
        return ExitCode.FAILURE
    except LLMError as e:
        print(f"[loss] failed: {e}", file=sys.stderr)
        return ExitCode.FAILURE
    c = result.completion
    cost = "unknown cost" if c.cost_usd is None else f"${c.cost_usd:.4f}"
    print(f"[loss] wrote {result.report_path} ({result.report_bytes:,} bytes; "
          f"{c.tokens_in:,} tokens in, {c.tokens_out:,} out, {c.tokens_cached:,} cached, "
          f"{cost}, {result.leaks_redacted} leaks redacted)", flush=True)
    if result.claims.contradicted:
        # On stderr, like the retries: stdout's two lines are what scripts read.
        print(f"[loss] claims: {_claims(result.claims)}", file=sys.stderr, flush=True)
    return ExitCode.OK


def _claims(claims: craft_claims.ClaimCheck) -> str:
    if claims.status != "checked":
        return claims.status.replace("_", " ")
    c = claims.counts
    return (f"{c['confirmed']} confirmed, {c['contradicted']} contradicted, "
            f"{c['not_checkable']} not checkable")
