"""Progress benchmarks (issue 15): what the craft distance costs a loss job, and
how fast `skilltrain progress` reads a long run.

    .venv/bin/python bench/progress_bench.py distance [--jobs 40]
    .venv/bin/python bench/progress_bench.py progress [--steps 500 --sets 4]
    .venv/bin/python bench/progress_bench.py all

distance: the shipped example (human episodes against the model draft, ranges
of 3) and a 5x longer range. A real loss job (loss.run: read, render, count
tokens, litellm over HTTP to tests/llm_server.py on 127.0.0.1, leak guard,
three atomic files) is timed next to the distance alone, with the loopback
answering after 0.45-0.55 s (daemon_bench's throughput setting) and at once,
cold (human side measured) and warm (human side cached by digest, as in the
daemon, where every step of every run compares with the same human range).
Target: the distance under 1 % of a loopback job.

progress: a run of --steps reported steps (step markers, --sets reports and
sidecars each) is written to a temporary folder; `skilltrain progress RUN
--json`, the table with the terminal chart, and `--plot curve.svg` are run as
real subprocesses, next to `python -c pass` with the same interpreter (the
floor any command pays). Target: under 1 s for 500 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.llm_server: stdlib only, lives outside the package
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("OPENAI_API_KEY", "sk-bench-loopback")

from skilltrain.daemon.core import dataset  # noqa: E402
from skilltrain.daemon.core.config import LLMConfig  # noqa: E402
from skilltrain.daemon.core.templates import PromptTemplates  # noqa: E402
from skilltrain.daemon.reviewer import craft_distance  # noqa: E402
from skilltrain.handlers import loss  # noqa: E402
from tests.llm_server import LLMServer  # noqa: E402

EXAMPLE = REPO / "data" / "example"
LOOPBACK_LATENCY = (0.45, 0.55)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def _median_time(fn: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_distance(jobs: int) -> bool:
    work = dataset.load_work(EXAMPLE)
    human = work.read_human(1, 3)
    model = dataset.read_range(EXAMPLE / "model_draft", 1, 3, label="model")
    digest = dataset.episodes_digest(human)
    big_h = {n: "\n\n".join([t] * 5) for n, t in human.items()}
    big_m = {n: "\n\n".join([t] * 5) for n, t in model.items()}
    chars = sum(map(len, human.values())) + sum(map(len, model.values()))

    cold = _median_time(lambda: craft_distance.of_episodes(human, model), 50)
    warm = _median_time(lambda: craft_distance.of_episodes(human, model, human_digest=digest), 50)
    big_cold = _median_time(lambda: craft_distance.of_episodes(big_h, big_m), 10)
    big_warm = _median_time(
        lambda: craft_distance.of_episodes(big_h, big_m, human_digest="big"), 10)

    def jobs_against(latency: tuple[float, float] | None, n: int) -> tuple[float, float]:
        """Median wall time and median CPU time (this thread) of n loss jobs."""
        with tempfile.TemporaryDirectory() as tmp, LLMServer(latency=latency) as server:
            settings = LLMConfig(model="openai/loopback-model", api_base=server.url)
            templates = PromptTemplates(REPO / "prompts")
            scripts = Path(tmp) / "scripts"
            scripts.mkdir()
            for number, text in model.items():
                (scripts / dataset.episode_name(number)).write_text(text, encoding="utf-8")

            def one_job(i: int) -> None:
                job = loss.LossJob(work=work, scripts_dir=scripts, first=1, last=3,
                                   report_path=Path(tmp) / "out" / f"r{i}.md")
                loss.run(job, settings=settings, templates=templates)

            one_job(-1)  # litellm import, tokenizer, HTTP client: not part of a job
            walls, cpus = [], []
            for i in range(n):
                t0, c0 = time.perf_counter(), time.thread_time()
                one_job(i)
                walls.append(time.perf_counter() - t0)
                cpus.append(time.thread_time() - c0)
        return statistics.median(walls), statistics.median(cpus)

    warm_cpu = statistics.median(
        _cpu(lambda: craft_distance.of_episodes(human, model, human_digest=digest))
        for _ in range(50))
    instant, job_cpu = jobs_against(None, jobs)
    slow, _ = jobs_against(LOOPBACK_LATENCY, max(5, jobs // 4))

    print(f"distance, example range (3 episodes, {chars:,} characters both sides)")
    print(f"  cold (human side measured too): {_ms(cold)}")
    print(f"  warm (human side cached):       {_ms(warm)} wall, {_ms(warm_cpu)} CPU")
    print(f"  5x longer range: cold {_ms(big_cold)}, warm {_ms(big_warm)}")
    print("loss job on the same range (distance included), median:")
    print(f"  loopback answering at {LOOPBACK_LATENCY[0]}-{LOOPBACK_LATENCY[1]} s "
          f"(as daemon_bench throughput): {_ms(slow)} -> distance {warm / slow:.2%}")
    print(f"  loopback answering at once: {_ms(instant)} -> distance {warm / instant:.2%}")
    print(f"  CPU of the job's thread:    {_ms(job_cpu)} -> distance {warm_cpu / job_cpu:.1%}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"  peak RSS of this process (litellm loaded): {peak} MiB")
    ok = warm / slow < 0.01
    print(f"  target < 1 % of a loopback job (warm, the daemon's case): "
          f"{'met' if ok else 'MISSED'}")
    return ok


def _cpu(fn: Callable[[], object]) -> float:
    c0 = time.thread_time()
    fn()
    return time.thread_time() - c0


def _write_run(runs: Path, run: str, steps: int, sets: int) -> None:
    markers = runs / run / "loss" / ".steps"
    markers.mkdir(parents=True)
    for i in range(steps):
        epoch, step = divmod(i, 10)
        reports = runs / run / "loss" / f"epoch_{epoch:02d}" / f"step_{step:02d}"
        reports.mkdir(parents=True)
        (markers / f"epoch_{epoch:02d}-step_{step:02d}.json").write_text(json.dumps(
            {"reported_at": 1.7e9 + i, "optimizer_attempts": 1, "optimizer_exit_code": 0,
             "optimizer_done": True, "optimizer_next_at": None}))
        for s in range(sets):
            stem = f"work{s}_ep01-03"
            (reports / f"{stem}.md").write_text("report\n" * 50)
            (reports / f"{stem}_prompt.md").write_text("prompt\n" * 500)
            distance = 0.5 * 0.995 ** i + 0.01 * (s % 3)
            parts = {f"stat{k}": distance / 13 for k in range(13)}
            (reports / f"{stem}.json").write_text(json.dumps({
                "schema": 1, "work": f"work{s}", "range": "01-03", "tokens_in": 18000,
                "tokens_out": 1000, "tokens_cached": 12000, "tokens_cache_write": 0,
                "cost_usd": 0.012, "craft_distance": distance, "craft_distance_version": 1,
                "craft_distance_parts": parts, "inputs": {"human_sha256": "0" * 64},
            }, indent=2))


def _run(argv: list[str]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    took = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{argv}: exit {done.returncode}: {done.stderr[-500:]}")
    return took


def bench_progress(steps: int, sets: int) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _write_run(root / "runs", "r1", steps, sets)
        config = root / "config.toml"
        config.write_text('[paths]\nruns = "runs"\ndata = "data"\n')
        cli = [sys.executable, "-m", "skilltrain"]
        rounds = 5
        floor = statistics.median(_run([sys.executable, "-c", "pass"]) for _ in range(rounds))
        as_json = statistics.median(
            _run([*cli, "progress", "r1", "--json", "--config", str(config)])
            for _ in range(rounds))
        table = statistics.median(
            _run([*cli, "progress", "r1", "--config", str(config)]) for _ in range(rounds))
        plot = statistics.median(
            _run([*cli, "progress", "r1", "--plot", str(root / "c.svg"), "--config",
                  str(config)]) for _ in range(3))
        png = _run([*cli, "progress", "r1", "--plot", str(root / "c.png"), "--config",
                    str(config)])
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
    print(f"progress on a run of {steps} reported steps x {sets} sets "
          f"({steps * sets:,} sidecars), median of {rounds}")
    print(f"  python -c pass:             {_ms(floor)}")
    print(f"  progress --json:            {_ms(as_json)} ({as_json / floor:.1f}x the floor)")
    print(f"  progress (table + chart):   {_ms(table)} ({table / floor:.1f}x)")
    print(f"  progress --plot curve.svg:  {_ms(plot)} (matplotlib import included)")
    print(f"  progress --plot curve.png:  {_ms(png)}")
    print(f"  peak RSS of a child: {peak} MiB")
    ok = max(as_json, table) < 1.0
    print(f"  target < 1 s (json and table): {'met' if ok else 'MISSED'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["distance", "progress", "all"])
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--sets", type=int, default=4)
    args = parser.parse_args()
    ok = True
    # progress first: its children's peak RSS must not include a parent that
    # already loaded litellm (a forked child starts with the parent's pages).
    if args.what in ("progress", "all"):
        ok &= bench_progress(args.steps, args.sets)
    if args.what in ("distance", "all"):
        ok &= bench_distance(args.jobs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
