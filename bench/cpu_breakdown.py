"""Where a loss job's CPU goes inside the daemon (issue 36: "say where the rest goes").

    .venv/bin/python bench/cpu_breakdown.py [--sets 1024] [--step-sets 2]
                                            [--base /mnt/skilltrain-bench]

`skilltrain daemon --once` over N finished sets against tests/llm_server.py
(0.5 s, concurrency 128), as `llm_bench.py cpu` runs it, with the CPU probe
(bench/cpu_probe/sitecustomize.py) loaded: each thread's CPU and each named
piece's (inclusive, the calling thread's own CPU) from the first request to
the end, per job; beside it the whole process's, and a bare acompletion loop
of the same calls in the same run. The probe costs a few microseconds a job.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import daemon_bench as db  # bench/ is on sys.path when this file runs
import llm_bench

from tests.llm_server import LLMServer  # noqa: E402

PROBE = Path(__file__).resolve().parent / "cpu_probe"
SERVICE = "skilltrain.daemon.service"
# (label, function): the pieces of a job, in the order a job meets them.
PIECES = [
    ("scan: look at a set, queue it (loss.queued)", f"{SERVICE}.owner:SetOwner.look"),
    ("pool: re-check, read, render (loss.started)", f"{SERVICE}.jobs:Jobs._prepare"),
    ("  of it the handler's prepare", f"{SERVICE}.pipeline:Pipeline.prepare"),
    ("pool: check, guard, write, decide", f"{SERVICE}.jobs:Jobs._finish_and_decide"),
    ("  of it the handler's finish", f"{SERVICE}.pipeline:Pipeline.finish"),
    ("  of it the decision (loss.completed)", f"{SERVICE}.pipeline:Pipeline.decide"),
    ("owner: a job's end, the step barrier", f"{SERVICE}.owner:SetOwner._ended"),
    ("  of it a step's end (marker, curve, step.reported)", f"{SERVICE}.steps:Steps._report"),
    ("every log line (any thread)", "structlog.stdlib:BoundLogger.info"),
]


def probe_run(sets: int, per_step: int, base: Path | None,
              pieces: list[tuple[str, str]]) -> dict[str, Any]:
    server = LLMServer(latency=(llm_bench.LATENCY_S, llm_bench.LATENCY_S)).start()
    try:
        with db.workspace("cpuprobe", base=base) as ws:
            db.throughput_workspace(ws, sets, server.url, concurrency=128, per_step=per_step)
            llm_bench.write_config(ws, server.url, llm_bench.UNKNOWN, 128)
            out = ws.root / "probe.jsonl"
            env = {"PYTHONPATH": str(PROBE), "CPU_PROBE_OUT": str(out),
                   "CPU_PROBE_FUNCS": ",".join(spec for _, spec in pieces)}
            daemon = db.DaemonProc(ws, once=True, extra_env=env).start()
            code = daemon.wait(600)
            done = len(daemon.find("loss.completed"))
            if code != 0 or done < sets:
                raise db.BenchError(f"daemon --once exit {code}, {done} of {sets} done")
            first = server.requests[0].wall
            messages = server.requests[0].messages
            lines = [json.loads(line) for line in out.read_text().splitlines()]
    finally:
        server.stop()
    # The probe's last sample before the first request (its first, if none was).
    before = max((s for s in lines if s["wall"] <= first), key=lambda s: s["wall"],
                 default=lines[0])
    return {"before": before, "after": lines[-1], "jobs": done, "messages": messages}


def _thread_group(name: str) -> str:
    """Pool threads summed: loss_0 and loss_1 are "loss_*"."""
    return re.sub(r"_\d+$", "_*", name)


def rows_of(run: dict[str, Any], bare_ms: float,
            pieces: list[tuple[str, str]]) -> list[db.Row]:
    jobs, before, after = run["jobs"], run["before"], run["after"]
    per_job = 1000 / jobs
    threads: dict[str, float] = {}
    for name, cpu in after["threads"].items():
        group = _thread_group(name)
        threads[group] = threads.get(group, 0.0) + cpu - before["threads"].get(name, 0.0)
    process_ms = (after["process"] - before["process"]) * per_job
    rows = [db.Row("whole process, first request to the end", f"{process_ms:.2f} ms"),
            db.Row("bare acompletion loop, same calls (whole process)", f"{bare_ms:.2f} ms"),
            db.Row("  ratio", f"{process_ms / bare_ms:.2f}x")]
    rows += [db.Row(f"thread {name}", f"{cpu * per_job:.2f} ms")
             for name, cpu in sorted(threads.items(), key=lambda t: -t[1]) if cpu * per_job >= 0.01]
    totals, earlier = after["totals"], before["totals"]
    for label, spec in pieces:
        calls, cpu = (a - b for a, b in zip(totals.get(spec, [0, 0.0]),
                                           earlier.get(spec, [0, 0.0]), strict=True))
        rows.append(db.Row(label, f"{cpu * per_job:.2f} ms ({calls / jobs:.1f} calls)"))
    collected = sum(v[1] - earlier.get(k, [0, 0.0])[1] for k, v in totals.items()
                    if k.startswith("gc:"))
    rows.append(db.Row("the cyclic collector (any thread)", f"{collected * per_job:.2f} ms"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", type=int, default=1024)
    parser.add_argument("--step-sets", type=int, default=2, help="sets per step")
    parser.add_argument("--base", type=Path, default=None,
                        help="make the workspace under this folder (bench/scratch_fs.sh)")
    parser.add_argument("--piece", action="append", default=[], metavar="module:Qual",
                        help="one more function to time (repeatable), beside the usual pieces")
    args = parser.parse_args(argv)
    pieces = PIECES + [(f"  {spec}", spec) for spec in args.piece]
    db.say(f"cpu breakdown: {args.sets} sets in steps of {args.step_sets}, load {db.loadavg()}")
    run = probe_run(args.sets, args.step_sets, args.base, pieces)
    bare = llm_bench.bare_run(run["messages"], run["jobs"], 128, llm_bench.UNKNOWN)
    db.print_table(f"CPU a job, per thread and per piece ({run['jobs']} jobs, "
                   f"steps of {args.step_sets})", rows_of(run, bare["cpu_ms"], pieces))
    return 0


if __name__ == "__main__":
    sys.exit(main())
