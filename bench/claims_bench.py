"""Benchmark the claims check of a loss report (issue 25), and hold the
built-in reviewer to it.

    .venv/bin/python bench/claims_bench.py [--reports N]

Prints:
- the CPU of reading and checking one report's claims (craft_claims.check_report
  on a 1,600-word report with a 14-line claims list, the measurements given),
  median and p99 over 2,000 runs, beside what the loss job spends anyway: the
  measuring of both sides it reuses, and one whole loss job's CPU
  (handlers/loss.run with `builtin/craft-metrics`, no network) on the same range;
- on N (default 200) reports of the built-in reviewer over different pairs
  (ranges of data/example's human script against its model draft, randomly
  cut, shuffled and padded drafts, and the tests/corpus screenplays against
  each other), how many of its claims are confirmed, contradicted, not
  checkable. The target is 0 contradicted.
Seeded; about 10 s on 2 cores.
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from skilltrain.daemon.core import dataset
from skilltrain.daemon.core.config import LLMConfig  # noqa: E402
from skilltrain.daemon.core.templates import PromptTemplates  # noqa: E402
from skilltrain.daemon.reviewer import craft_claims, craft_distance, craft_report  # noqa: E402
from skilltrain.handlers import loss  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "data" / "example"
CORPUS = ROOT / "tests" / "corpus"
SEED = 25

PROSE = ("The model's scenes open early and close late; the human version enters on the turn "
         "and leaves on a question. Dialogue states what the subtext should carry. ") * 60


def _episodes(folder: Path) -> dict[int, str]:
    return {n: (folder / dataset.episode_name(n)).read_text("utf-8")
            for n in range(1, 7) if (folder / dataset.episode_name(n)).exists()}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms"


def bench_check(human: dict[int, str], model: dict[int, str]) -> float:
    hs, ms = craft_distance.measure_pair(human, model)
    claims = craft_claims.grounded_claims(hs, ms)
    report = f"{PROSE}\n\n{craft_claims.section(claims)}\n"
    times = []
    for _ in range(2000):
        t0 = time.process_time_ns()
        check = craft_claims.check_report(report, hs, ms)
        times.append((time.process_time_ns() - t0) / 1e9)
    assert check.counts["confirmed"] == len(claims)
    measure = []
    for _ in range(50):
        t0 = time.process_time_ns()
        craft_distance.measure_pair(human, model)  # no digest: measured both sides
        measure.append((time.process_time_ns() - t0) / 1e9)
    med, p99 = statistics.median(times), sorted(times)[int(len(times) * 0.99)]
    words = len(report.split())
    print(f"claims check of one report ({words:,} words, {len(claims)} claims): median "
          f"{_ms(med)}, p99 {_ms(p99)} CPU")
    print(f"  measuring both sides (done once per job anyway, reused): median "
          f"{_ms(statistics.median(measure))} = {statistics.median(measure) / med:.0f}x the check")
    return med


def bench_job(check_s: float) -> None:
    """One whole loss job's CPU with the built-in reviewer (litellm in-process, no network)."""
    with tempfile.TemporaryDirectory() as tmp:
        scripts = Path(tmp) / "runs" / "r1" / "epoch_00" / "step_00" / "example" / "scripts"
        scripts.mkdir(parents=True)
        for n in (1, 2, 3):
            (scripts / dataset.episode_name(n)).write_text(
                (EXAMPLE / "model_draft" / dataset.episode_name(n)).read_text("utf-8"))
        settings = LLMConfig(model="builtin/craft-metrics")
        templates = PromptTemplates(ROOT / "prompts")
        cpu = []
        for k in range(12):
            job = loss.LossJob(work=dataset.load_work(EXAMPLE), scripts_dir=scripts,
                               report_path=Path(tmp) / "out" / f"r{k}.md", first=1, last=3)
            t0 = time.process_time()
            result = loss.run(job, settings=settings, templates=templates)
            cpu.append(time.process_time() - t0)
        assert result.claims.counts["contradicted"] == 0
    job_s = statistics.median(cpu[2:])  # the first ones pay litellm's lazy imports
    print(f"one loss job (example ep01-03, builtin/craft-metrics, write included): median "
          f"{_ms(job_s)} CPU; the claims check is {100 * check_s / job_s:.2f}% of it")


def _variant(rng: random.Random, text: str) -> str:
    """A draft cut, shuffled or padded at random: other proportions, same format."""
    blocks = text.split("\n\n")
    kind = rng.choice(["cut", "shuffle", "pad", "talky", "as is"])
    if kind == "cut":
        blocks = [b for b in blocks if rng.random() > 0.4] or blocks[:1]
    elif kind == "shuffle":
        rng.shuffle(blocks)
    elif kind == "pad":
        blocks = [b for b in blocks for _ in range(rng.choice([1, 1, 2]))]
    elif kind == "talky":
        blocks += [f"{rng.choice(['MARTA', 'DEV', 'TOBIAS'])}\n" + " ".join(
            rng.choice(["no", "what", "why", "stop", "listen", "now!", "where?"])
            for _ in range(rng.randint(2, 30))) for _ in range(rng.randint(1, 20))]
    return "\n\n".join(blocks)


def bench_reports(count: int) -> int:
    rng = random.Random(SEED)
    human, draft = _episodes(EXAMPLE / "human"), _episodes(EXAMPLE / "model_draft")
    beauty = _episodes(CORPUS / "american_beauty")
    brick = (CORPUS / "brick_and_steel.txt").read_text("utf-8")
    verdicts: Counter[str] = Counter()
    reports = 0
    while reports < count:
        first = rng.randint(1, 6)
        last = rng.randint(first, min(6, first + 2))
        numbers = range(first, last + 1)
        source = rng.choice(["example", "example", "beauty vs brick", "beauty vs example"])
        if source == "example":
            h = {n: human[n] for n in numbers}
            m = {n: _variant(rng, draft[n]) for n in numbers}
        elif source == "beauty vs brick":
            h = {n: beauty[n] for n in numbers}
            m = {n: _variant(rng, brick) for n in numbers}
        else:
            h = {n: beauty[n] for n in numbers}
            m = {n: _variant(rng, draft[n]) for n in numbers}
        try:
            report = craft_report.build_report(h, m)
        except craft_report.CraftMetricsError:
            continue  # a pair the reviewer refuses (a shared 6-word run): no report
        check = craft_claims.check_report(report, *craft_distance.measure_pair(h, m))
        assert check.status == "checked" and not check.malformed
        verdicts.update(v.verdict for v in check.verdicts)
        reports += 1
    print(f"{reports} built-in reports: {sum(verdicts.values()):,} claims, "
          f"{verdicts['confirmed']:,} confirmed, {verdicts['contradicted']} contradicted, "
          f"{verdicts['not_checkable']} not checkable")
    return verdicts["contradicted"]


def main() -> int:
    count = int(sys.argv[sys.argv.index("--reports") + 1]) if "--reports" in sys.argv else 200
    human, draft = _episodes(EXAMPLE / "human"), _episodes(EXAMPLE / "model_draft")
    first3 = {n: human[n] for n in (1, 2, 3)}
    check_s = bench_check(first3, {n: draft[n] for n in (1, 2, 3)})
    bench_job(check_s)
    contradicted = bench_reports(count)
    print(f"targets: check < 1 ms: {'met' if check_s < 0.001 else 'NOT met'}; "
          f"0 contradicted: {'met' if contradicted == 0 else 'NOT met'}")
    return 0 if contradicted == 0 and check_s < 0.001 else 1


if __name__ == "__main__":
    raise SystemExit(main())
