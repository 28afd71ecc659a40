"""The leak guard's cost per report in the loss step, before and after issue 34.

    .venv/bin/python bench/guard_cost_bench.py

Times, in one process, the guard work one loss job does on data/example
(the human script as key, the model draft as the model's episodes, the
template of prompts/ rendered as the loss step renders it) and a craft
report in Markdown (tests/corpus/reports.md, with `code`, **bold** and a
`## Claims` list, so the markup reading runs):

- before: the report's guard (loss._guard) and the archive's check
  (loss._archive_leaks);
- after, added: the writer's checks of the final report, the sidecar JSON
  and the archive (sealed_write), which exist only from issue 34.

Run it against an older checkout to compare (PYTHONPATH to a folder holding
`skilltrain -> <checkout>`); parts the checkout lacks are skipped.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from skilltrain.daemon.core import dataset
from skilltrain.daemon.core.templates import PromptTemplates
from skilltrain.daemon.guard import leakguard
from skilltrain.daemon.reviewer import craft_prompt
from skilltrain.handlers import loss

ROOT = Path(__file__).resolve().parent.parent
RUNS = 2000


def _inputs() -> dict[str, object]:
    work = dataset.load_work(ROOT / "data" / "example")
    human = work.read_all_human()
    model = {n: (ROOT / "data" / "example" / "model_draft" / dataset.episode_name(n))
             .read_text(encoding="utf-8") for n in (1, 2, 3)}
    index = leakguard.index_for("example", human)
    report = (ROOT / "tests" / "corpus" / "reports.md").read_text(encoding="utf-8")
    report = report.replace("Dialogue share", "`dialogue_share`").replace(
        "Scene length", "**Scene length**")
    report += ("\n## Claims\n\n- `dialogue_share`: higher\n- **scene_words_mean**: higher\n"
               "- speech_words_mean: higher\n- parenthetical_share: similar\n")
    template = PromptTemplates(ROOT / "prompts").load("loss")
    block = craft_prompt.format_episodes("Model", model)
    slot = "[model-scripts-0123456789abcdef]"
    stats = dict.fromkeys(("human_facts", "model_facts"), "| a | b |")
    fields = dict(work="example", title="t", episode_range="1-3", model_scripts=block,
                  human_stats={}, model_stats={}, **stats)
    archive = template.render(human_scripts="[omitted]", **fields)
    skeleton = template.render(human_scripts="[omitted]", **{**fields, "model_scripts": slot})
    sidecar = _sidecar()
    return dict(index=index, model=model, report=report, archive=archive,
                skeleton=skeleton, slot=slot, block=block, sidecar=sidecar)


def _sidecar() -> str:
    """A sidecar of the loss step's shape: its digests, stamps, the craft
    distance's parts and a verdict for each statistic (one of data/example's
    written by `make example`, its numbers made up)."""
    import hashlib

    names = ["scene_words_mean", "dialogue_share", "speech_words_mean", "scenes_per_episode",
             "words_per_episode", "scene_words_cv", "parentheticals_per_100_speeches",
             "question_share", "action_block_words_mean", "speaking_characters",
             "top_speaker_share", "longest_speech_words", "exclamations_per_1k_words",
             "transitions_per_episode"]

    def digest(seed: str) -> str:
        return hashlib.sha256(seed.encode()).hexdigest()

    return json.dumps({
        "schema": 1, "work": "example", "range": "01-03", "first": 1, "last": 3,
        "model": "openai/gpt-4o-mini",
        "inputs": {"human_sha256": digest("h"), "model_sha256": digest("m"),
                   "template_sha256": digest("t"), "model_id": "openai/gpt-4o-mini"},
        "model_episodes": {f"ep{n:02d}.txt": digest(str(n)) for n in (1, 2, 3)},
        "model_stat_sigs": digest("s")[:24], "report_sha256": digest("r"),
        "finish_reason": "stop", "tokens_in": 6669, "tokens_out": 762, "tokens_cached": 0,
        "tokens_cache_write": 0, "cost_usd": 0.001457, "attempts": 1, "leaks_redacted": 0,
        "craft_distance": 0.435851, "craft_distance_version": 1,
        "craft_distance_parts": {name: round(0.01 * k, 6) for k, name in enumerate(names)},
        "claims": {"status": "checked", "confirmed": 14, "contradicted": 0,
                   "not_checkable": 0, "malformed": 0, "contradicted_share": 0.0,
                   "on_contradiction": "annotate",
                   "tolerance": {"direction": 0.05, "similar": 0.15},
                   "verdicts": [{"statistic": name, "claimed": "higher", "verdict": "confirmed",
                                 "human": 88.157895 + k, "model": 237.375 - k,
                                 "measured": "higher", "log_ratio": 0.924328}
                                for k, name in enumerate(names)],
                   "malformed_lines": []},
        "prompt_chars": 27140, "prompt_tokens": None, "duration_ms": 4120,
        "started_at": "2026-12-07T16:39:57.962831+00:00",
        "finished_at": "2026-12-07T16:40:02.083402+00:00"}, indent=2) + "\n"


def _median_us(fn: object, runs: int = RUNS) -> float:
    """The lowest of five medians of runs/5 calls: the machine may be shared,
    and another process's burst only ever adds time."""
    medians = []
    for _ in range(5):
        times = []
        for _ in range(runs // 5):
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    return min(medians) * 1e6


def main() -> int:
    x = _inputs()
    index, model, report = x["index"], x["model"], x["report"]
    allow = "\n".join(model.values())  # type: ignore[attr-defined]
    job = type("Job", (), {"work": type("W", (), {"name": "example"}), "range_label": "01-03"})
    try:
        from skilltrain.daemon.guard import sealed_write
    except ImportError:  # before issue 34: the report's guard, the archive's check
        parts = {
            "report guard (loss._guard)": lambda: loss._guard(report, job, index, model,
                                                               "redact"),
            "archive check (loss._archive_leaks)": lambda: loss._archive_leaks(  # type: ignore
                x["archive"], x["skeleton"], x["slot"], x["block"], index),
        }
    else:  # issue 34: what loss.finish does, a new seal per job
        archive = sealed_write.Archive(x["archive"], x["skeleton"], x["slot"], x["block"])

        def job_guard(upto: int) -> None:
            seal = sealed_write.Seal(index, allow_text=allow)
            steps = [lambda: loss._guard(report, job, seal, "redact"),
                     lambda: seal.archive_leaks(archive),
                     lambda: seal.leaks(report + "\n"),
                     lambda: seal.leaks(x["sidecar"]),
                     lambda: seal.archive_leaks(archive)]
            for step in steps[:upto]:
                step()

        parts = {"report guard (loss._guard)": lambda: job_guard(1),
                 "+ archive check": lambda: job_guard(2),
                 "+ writer: final report, sidecar, archive": lambda: job_guard(5)}
    results = {}
    for name, fn in parts.items():
        fn()  # warm the caches (index, allowed shingles) as a daemon's are
        results[name] = _median_us(fn)
    if "+ archive check" in results:  # cumulative: shown per part
        cumulative = list(results.values())
        results = {name: us - (cumulative[k - 1] if k else 0)
                   for k, (name, us) in enumerate(results.items())}
    for name, us in results.items():
        print(f"{name:45s} {us:8.1f} us")
    print(f"{'guard cost per report':45s} {sum(results.values()):8.1f} us  "
          f"({len(str(report).split())}-word report, {len(str(x['archive'])):,}-char archive)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
