"""LLM path benchmarks: CPU per loss job against a bare litellm.acompletion loop,
threads, and adaptive vs fixed concurrency against a rate-limited provider.

    .venv/bin/python bench/llm_bench.py cpu [--sets 256] [--concurrency 128]
                                            [--thread-sets 1024] [--repeat 3]
    .venv/bin/python bench/llm_bench.py limits [--sets 600] [--rate 40] [--latency 1.0]
                                               [--mode on|off|halved|quota|all]
    .venv/bin/python bench/llm_bench.py compare [--sets 200] [--rate 20]
    .venv/bin/python bench/llm_bench.py all

cpu: `skilltrain daemon --once` (a real subprocess, fixed `[loss]
concurrency` C) works through N finished sets against tests/llm_server.py
answering in 0.5 s; CPU per job = (an N-set run's CPU - an N/4-set run's) /
(the jobs between them), each counted once the daemon is built (litellm's
import left out, its noise with it). --repeat K: each figure K times, the
daemon and the bare loop in turn, the least of each kept (noise only adds),
and the median of the K ratios.
Beside it, in the same run, a subprocess doing nothing but N
`litellm.acompletion` calls on one event loop at concurrency C, same server,
same messages (the daemon's first prompt), its CPU over the calls per call.
Both for a priced model id (openai/gpt-4o-mini) and one litellm does not
know. Threads: the daemon's peak (/proc/<pid>/status, sampled every 20 ms),
also at concurrency 1024.

limits: issue 36's benches (bench/limits_bench.py): the daemon with its
default config at R requests/s and 1 s latency, headers on, off, R halved
mid-run, and a key out of credit (time to the alert and to `status`).

compare: the daemon against tests/limited_llm_server.py (R requests/s per
key, 429 with Retry-After), `[loss] concurrency` = "adaptive", 4 and 128.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import daemon_bench as db  # bench/ is on sys.path when this file runs
import limits_bench

from tests.daemon_helpers import config_toml  # noqa: E402
from tests.limited_llm_server import RateLimits  # noqa: E402
from tests.llm_server import LLMServer  # noqa: E402

LATENCY_S = 0.5
PRICED = "openai/gpt-4o-mini"
UNKNOWN = "openai/loopback-model"

BARE_LOOP = r"""
import asyncio, json, os, sys, time
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
import litellm
litellm.suppress_debug_info = True
model, api_base, path = sys.argv[1], sys.argv[2], sys.argv[5]
n, c = int(sys.argv[3]), int(sys.argv[4])
messages = json.load(open(path))

async def main():
    sem = asyncio.Semaphore(c)
    async def one():
        async with sem:
            r = await litellm.acompletion(model=model, messages=messages, api_base=api_base,
                                          api_key="no-key-needed", timeout=60,
                                          max_retries=0, num_retries=0)
            assert r.choices[0].message.content
    await one()  # warm: the client is built, the tokenizer loaded
    t0, w0 = os.times(), time.monotonic()
    await asyncio.gather(*(one() for _ in range(n)))
    t1, w1 = os.times(), time.monotonic()
    print(json.dumps({"user": t1.user - t0.user, "sys": t1.system - t0.system, "wall": w1 - w0}))

asyncio.run(main())
"""


class ThreadSampler:
    """Peak thread count of a process (Threads: in /proc/<pid>/status), and its
    CPU seconds over time (to read the CPU of a span of a --once run)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self.cpu: list[tuple[float, float]] = []  # (wall clock, CPU seconds so far)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.peak = max(self.peak, db.proc_status_kb(self.pid, "Threads"))
                raw = Path(f"/proc/{self.pid}/stat").read_text()
                fields = raw[raw.rindex(")") + 2:].split()
                self.cpu.append((time.time(), (int(fields[11]) + int(fields[12])) / db.CLK_TCK))
            except (OSError, ValueError):
                return

    def cpu_at(self, when: float) -> float:
        """CPU seconds at the last sample no later than `when`."""
        return max((c for t, c in self.cpu if t <= when), default=0.0)

    def cpu_after(self, when: float) -> float:
        """CPU seconds at the first sample at or after `when` (the last one if none)."""
        return next((c for t, c in self.cpu if t >= when), self.cpu[-1][1] if self.cpu else 0.0)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def write_config(ws: db.Workspace, api_base: str, model: str, concurrency: int | str,
                 **loss: Any) -> None:
    text = config_toml(api_base, llm={"timeout_s": 60},
                       loss={"settle_s": 0, "concurrency": concurrency, **loss},
                       log_file=ws.log_file, sections={"integrity": {"audit_on_start": False}})
    ws.config.write_text(text.replace(f'"{db.MODEL}"', f'"{model}"'), encoding="utf-8")


def filesystem_of(path: Path) -> str:
    """The mount holding `path`, as /proc/mounts has it: "ext4 on /dev/vda (rw,...)"."""
    best = ("?", "?", "?", "")
    real = str(path.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        device, mount, kind, options = line.split()[:4]
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > len(best[3]):
            best = (kind, device, options, mount)
    return f"{best[0]} on {best[1]} ({best[2]})"


def daemon_run(sets: int, concurrency: int, model: str,
               per_step: int = db.SETS_PER_STEP, base: Path | None = None) -> dict[str, Any]:
    """`daemon --once` over `sets` sets, `per_step` a step: the whole process's CPU
    (rusage of the child), its wall from the first request to the last
    loss.completed, threads."""
    server = LLMServer(latency=(LATENCY_S, LATENCY_S)).start()
    try:
        with db.workspace("llmcpu", base=base) as ws:
            total = len(db.throughput_workspace(ws, sets, server.url, concurrency=concurrency,
                                                per_step=per_step))
            write_config(ws, server.url, model, concurrency)
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            daemon = db.DaemonProc(ws, once=True).start()
            threads = ThreadSampler(daemon.pid)
            code = daemon.wait(600)
            peak_threads = threads.stop()
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            done = daemon.find("loss.completed")
            total = max(total, len(done))  # a step's every set is on disk, used or not
            if code != 0 or len(done) != total:
                raise db.BenchError(f"daemon --once exit {code}, {len(done)} of {total} done")
            first = server.requests[0].wall
            last = max(db.event_time(e) for e in done)
            started = db.event_time(daemon.find("daemon.started")[0])
            messages = server.requests[0].messages
    finally:
        server.stop()
    sys_s = after.ru_stime - before.ru_stime
    cpu_s = (after.ru_utime - before.ru_utime) + sys_s
    span_s = threads.cpu_after(last) - threads.cpu_at(first)
    return {"cpu_s": cpu_s, "sys_s": sys_s, "span_ms": span_s * 1000 / total, "wall": last - first,
            "built_s": threads.cpu_at(started), "threads": peak_threads,
            "rss_mb": daemon.peak_rss_mb, "messages": messages, "jobs": total}


def per_job(sets: int, concurrency: int, model: str,
            per_step: int = db.SETS_PER_STEP, base: Path | None = None) -> dict[str, Any]:
    """CPU per job: (the N-set run - an N/4-set run) / (the jobs between them),
    each run's CPU counted once the daemon is built (from the last sample
    before `daemon.started`). What every run pays once cancels out: litellm's
    first call (0.2-0.3 s: its lazy imports, the client), the freeze, the stop.
    Issue 22 subtracted a one-step run's whole CPU instead: litellm's import
    alone varied 3.5-5.0 s of CPU between runs on this VM, ~3 ms a job of
    noise at 512 jobs, either way."""
    few = daemon_run(max(1, sets // 4), concurrency, model, per_step, base)
    many = daemon_run(sets, concurrency, model, per_step, base)
    jobs = many["jobs"] - few["jobs"]
    return {**many,
            "cpu_ms": ((many["cpu_s"] - many["built_s"]) - (few["cpu_s"] - few["built_s"]))
            * 1000 / jobs,
            "sys_ms": (many["sys_s"] - few["sys_s"]) * 1000 / jobs}


def bare_run(messages: list[dict[str, Any]], sets: int, concurrency: int,
             model: str) -> dict[str, Any]:
    server = LLMServer(latency=(LATENCY_S, LATENCY_S)).start()
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(messages, f)
        out = subprocess.run([sys.executable, "-c", BARE_LOOP, model, server.url, str(sets),
                              str(concurrency), f.name], capture_output=True, text=True,
                             timeout=600, check=True)
        Path(f.name).unlink()
    finally:
        server.stop()
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return {"cpu_ms": (got["user"] + got["sys"]) * 1000 / sets, "wall": got["wall"]}


def bench_cpu(sets: int, concurrency: int, thread_sets: int,
              step_sizes: list[int], base: Path | None = None,
              repeat: int = 1) -> list[db.Row]:
    where = base or Path(tempfile.gettempdir())
    db.say(f"cpu: {sets} sets, concurrency {concurrency}, loopback {LATENCY_S} s, "
           f"steps of {step_sizes} sets, load {db.loadavg()}")
    db.say(f"workspaces under {where}: {filesystem_of(where)}")
    rows: list[db.Row] = []
    for model, per_step in [(m, n) for n in step_sizes for m in (PRICED, UNKNOWN)]:
        # Each measured `repeat` times, the daemon and the bare loop in turn; the
        # least of each is kept (a VM's noise only ever adds CPU).
        daemons, bares = [], []
        for _ in range(repeat):
            daemons.append(per_job(sets, concurrency, model, per_step, base))
            bares.append(bare_run(daemons[-1]["messages"], daemons[-1]["jobs"], concurrency,
                                  model))
        d = min(daemons, key=lambda r: r["cpu_ms"])
        b = min(bares, key=lambda r: r["cpu_ms"])
        ratio = d["cpu_ms"] / b["cpu_ms"]
        ratios = [x["cpu_ms"] / y["cpu_ms"] for x, y in zip(daemons, bares, strict=True)]
        spread = ", ".join(f"{x['cpu_ms']:.1f}/{y['cpu_ms']:.1f}" for x, y in
                           zip(daemons, bares, strict=True))
        limit = max(math.ceil(d["jobs"] / concurrency) * LATENCY_S, b["wall"])
        rows += [
            db.Row(f"CPU per loss job ({d['jobs']} jobs, steps of {per_step}, {model}), "
                   "whole process once built",
                   f"{d['cpu_ms']:.1f} ms ({d['sys_ms']:.1f} ms sys)"),
            db.Row("  of it from first request to last report (calls in flight)",
                   f"{d['span_ms']:.1f} ms"),
            db.Row("  bare acompletion loop, same calls", f"{b['cpu_ms']:.1f} ms"),
            db.Row("  daemon whole / bare", f"{ratio:.2f}x", "<= 2x", ratio <= 2),
            *([db.Row(f"  each of {repeat} runs, daemon/bare ms", spread),
               db.Row("  median of the runs' ratios", f"{statistics.median(ratios):.2f}x")]
              if repeat > 1 else []),
            db.Row("  daemon in-flight span / bare", f"{d['span_ms'] / b['cpu_ms']:.2f}x"),
            db.Row("  wall: daemon / max(latency limit, bare wall)",
                   f"{d['wall']:.2f} / {limit:.2f} s = {d['wall'] / limit:.2f}x", "<= 1.3x",
                   d["wall"] / limit <= 1.3),
            db.Row(f"  daemon peak threads (concurrency {concurrency})", str(d["threads"]),
                   "<= 16", d["threads"] <= 16),
            db.Row("  daemon peak RSS (VmHWM)", f"{d['rss_mb']:.0f} MB"),
        ]
    if thread_sets:
        d = per_job(thread_sets, 1024, UNKNOWN, base=base)
        rows.append(db.Row(f"daemon peak threads (concurrency 1024, {d['jobs']} jobs)",
                           str(d["threads"]), "<= 16", d["threads"] <= 16))
        rows.append(db.Row("  CPU per job / peak RSS",
                           f"{d['cpu_ms']:.1f} ms / {d['rss_mb']:.0f} MB"))
    return rows


def limits_run(sets: int, rate: float, concurrency: int | str, retry_after: str,
               halve_at_s: float | None = None) -> dict[str, Any]:
    limits = RateLimits(requests_per_s=rate, retry_after=retry_after)
    server = LLMServer(default=limits, latency=(0.2, 0.4), seed=1).start()
    try:
        with db.workspace("llmlimits") as ws:
            total = len(db.throughput_workspace(ws, sets, server.url))
            write_config(ws, server.url, UNKNOWN, concurrency, retry_backoff_s=5)
            daemon = db.DaemonProc(ws).start()
            try:
                daemon.wait_event("daemon.ready", timeout_s=120)
                db.wait_until(lambda: server.request_count > 0, 60, "the first request")
                t0 = limits.clock()
                if halve_at_s is not None:
                    threading.Timer(halve_at_s, limits.set_rate, [rate / 2]).start()
                db.wait_until(lambda: len(daemon.find("loss.completed")) >= total, 300,
                              "every loss.completed", poll_s=0.05)
                t1 = limits.clock()
                failed = len(daemon.find("loss.failed"))
                deferred = len(daemon.find("loss.rate_limited"))
                moves = len(daemon.find("llm.limit_changed"))
                # Quiet by default: the limiter's lines in the log, against the requests.
                llm_lines = sum(1 for e in daemon.events()
                                if str(e.get("event", "")).startswith("llm."))
                cost_lines = len(daemon.find("cost.total"))
            finally:
                daemon.stop()
    finally:
        server.stop()
    requests = limits.served + limits.limited
    return {"rps": limits.served / (t1 - t0), "wall": t1 - t0, "limited": limits.limited,
            "share": limits.limited / max(requests, 1), "failed": failed,
            "deferred": deferred, "moves": moves, "llm_lines": llm_lines,
            "llm_share": llm_lines / max(requests, 1), "cost_lines": cost_lines}


def bench_limits(sets: int, rate: float) -> list[db.Row]:
    db.say(f"limits: {sets} sets against R = {rate:g} requests/s, load {db.loadavg()}")
    rows: list[db.Row] = []
    runs: list[tuple[str, int | str, str, float | None]] = [
        ("adaptive", "adaptive", "seconds", None),
        ("adaptive, no Retry-After", "adaptive", "none", None),
        ("adaptive, R halved after 4 s", "adaptive", "seconds", 4.0),
        ("fixed 4", 4, "seconds", None),
        ("fixed 128", 128, "seconds", None),
    ]
    for name, concurrency, form, halve in runs:
        r = limits_run(sets, rate, concurrency, form, halve)
        target = rate / 2 if halve else rate
        adaptive = concurrency == "adaptive"
        rows += [
            db.Row(f"{name}: requests/s served (wall {r['wall']:.1f} s)",
                   f"{r['rps']:.1f} ({r['rps'] / target:.0%} of R)",
                   ">= 90% of R" if adaptive and not halve else "",
                   r["rps"] >= 0.9 * target if adaptive and not halve else None),
            db.Row("  429s (share of requests)", f"{r['limited']} ({r['share']:.1%})",
                   "<= 5%" if adaptive else "", r["share"] <= 0.05 if adaptive else None),
            db.Row("  sets failed / retried later for rate limits / limit moves",
                   f"{r['failed']} / {r['deferred']} / {r['moves']}",
                   "0 failed" if adaptive else "", r["failed"] == 0 if adaptive else None),
            db.Row("  llm.* log lines (share of requests) / cost.total lines",
                   f"{r['llm_lines']} ({r['llm_share']:.1%}) / {r['cost_lines']}",
                   "<= 2%", r["llm_share"] <= 0.02),
        ]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=("cpu", "limits", "compare", "all"))
    parser.add_argument("--sets", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--thread-sets", type=int, default=1024,
                        help="sets for the thread count at concurrency 1024 (0: skip)")
    parser.add_argument("--step-sets", default="2,64",
                        help="cpu: sets per step, comma-separated (each a run of its own)")
    parser.add_argument("--base", type=Path, default=None,
                        help="cpu: make the workspaces under this folder (default: the "
                             "temp dir); a file system of its own keeps earlier runs' "
                             "deleted inodes out of the figure (bench/RESULTS.md, issue 36)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="cpu: measure each figure this many times, keep the least")
    parser.add_argument("--rate", type=float, default=None,
                        help="R requests/s (limits: 40, compare: 20)")
    parser.add_argument("--latency", type=float, default=1.0, help="limits: seconds per reply")
    parser.add_argument("--mode", choices=(*limits_bench.MODES, "all"), default="all",
                        help="limits: which run (default: all four)")
    args = parser.parse_args(argv)
    if args.which in ("cpu", "all"):
        steps = [int(n) for n in args.step_sets.split(",")]
        db.print_table("LLM path: CPU per job vs a bare acompletion loop",
                       bench_cpu(args.sets or 512, args.concurrency, args.thread_sets, steps,
                                 args.base, args.repeat))
    if args.which in ("limits", "all"):
        modes = list(limits_bench.MODES) if args.mode == "all" else [args.mode]
        rows = limits_bench.bench_limits(args.sets or 600, args.rate or 40.0, args.latency,
                                         modes)
        db.print_table("At the provider's limit (issue 36), default config", rows)
        if any(r.ok is False for r in rows):
            return 1
    if args.which in ("compare", "all"):
        db.print_table("Adaptive vs fixed concurrency against a rate-limited loopback",
                       bench_limits(args.sets or 200, args.rate or 20.0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
