"""Daemon benchmarks: throughput, pickup latency, scale. Each prints ratios against
the alternative measured in the same run, plus the daemon's peak memory.

    .venv/bin/python bench/daemon_bench.py throughput [--sets 50] [--shell-sets 10]
    .venv/bin/python bench/daemon_bench.py perjob [--sets 1024] [--perjob-model M]
    .venv/bin/python bench/daemon_bench.py latency [--sets 100] [--polling-sets 20]
    .venv/bin/python bench/daemon_bench.py scale [--idle-seconds 60] [--tree DIR [--warm-only]]
    .venv/bin/python bench/daemon_bench.py all

Everything runs on 127.0.0.1 against tests/llm_server.py (in this process), in
temporary workspaces that are deleted afterwards. The daemon runs as a real
subprocess (`skilltrain daemon --config ...`) and is observed from outside only:
its JSON log, /proc/<pid>/{status,stat}, the server's request log, the files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests/: the loopback server and the workspace builders

from skilltrain.daemon.core import dataset  # noqa: E402
from skilltrain.daemon.core.config import IntegrityConfig  # noqa: E402
from skilltrain.daemon.core.templates import PromptTemplates  # noqa: E402
from skilltrain.daemon.service.observe import FileSig, sigs_digest  # noqa: E402
from tests.daemon_helpers import (  # noqa: E402
    LOG_NAME,
    LOOPBACK_MODEL,
    config_toml,
    lay_out_workspace,
    write_human_episodes,
)
from tests.llm_server import LLMServer  # noqa: E402

BIN = REPO / ".venv" / "bin"
SKILLTRAIN = str(BIN / "skilltrain") if (BIN / "skilltrain").exists() else "skilltrain"
MODEL = LOOPBACK_MODEL
EXAMPLE = REPO / "data" / "example"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------- results


@dataclass
class Row:
    figure: str
    measured: str
    target: str = ""
    ok: bool | None = None  # None: informational

    @property
    def verdict(self) -> str:
        return "info" if self.ok is None else ("PASS" if self.ok else "FAIL")


def print_table(title: str, rows: list[Row]) -> None:
    widths = [
        max(len(h), *(len(c) for c in col))
        for h, col in zip(
            ("figure", "measured", "target", "result"),
            zip(*((r.figure, r.measured, r.target, r.verdict) for r in rows), strict=True),
            strict=True,
        )
    ]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(f"\n== {title} ==")
    print(line.format("figure", "measured", "target", "result"))
    print(line.format(*("-" * w for w in widths)))
    for r in rows:
        print(line.format(r.figure, r.measured, r.target, r.verdict))
    sys.stdout.flush()


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile: p99 of 100 samples is the 99th smallest."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def loadavg() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "?"


# -------------------------------------------------------------------------- workspace


@dataclass
class Workspace:
    """data/ + prompts/ + runs/ + config.toml under a temporary folder."""

    root: Path
    config: Path = field(init=False)

    def __post_init__(self) -> None:
        self.config = self.root / "config.toml"
        lay_out_workspace(self.root)

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log_file(self) -> Path:
        return self.root / LOG_NAME

    def add_work(
        self, name: str, human: dict[int, str], ranges: list[tuple[int, int]] | None = None
    ) -> Path:
        work = write_human_episodes(self.root, name, human)
        if ranges is not None:
            pairs = ", ".join(f"[{a}, {b}]" for a, b in ranges)
            (work / "work.toml").write_text(f"ranges = [{pairs}]\n")
        return work

    def write_config(
        self,
        *,
        api_base: str,
        observer: str = "auto",
        concurrency: int = 4,
        settle_s: float = 60,
        resync_s: float = 300,
        episodes_per_report: int = 3,
        audit: bool | None = None,
    ) -> Path:
        sections: dict[str, dict[str, Any]] = {}
        if audit is not None and "audit_on_start" in IntegrityConfig.model_fields:
            sections["integrity"] = {"audit_on_start": audit}
        text = config_toml(
            api_base,
            llm={"timeout_s": 60},
            loss={
                "episodes_per_report": episodes_per_report,
                "settle_s": settle_s,
                "concurrency": concurrency,
            },
            watch={"resync_s": resync_s, "observer": observer},
            log_file=self.log_file,
            sections=sections,
        )
        self.config.write_text(text, encoding="utf-8")
        return self.config


@contextlib.contextmanager
def workspace(prefix: str, base: Path | None = None) -> Iterator[Workspace]:
    root = Path(tempfile.mkdtemp(prefix=f"skilltrain-bench-{prefix}-", dir=base))
    try:
        yield Workspace(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def example_episodes(kind: str) -> dict[int, str]:
    """The example work's episodes: "human" (answer key) or "model_draft"."""
    folder = EXAMPLE / kind
    return {
        n: (folder / dataset.episode_name(n)).read_text(encoding="utf-8")
        for n in range(1, 7)
        if (folder / dataset.episode_name(n)).exists()
    }


def scripts_dir(runs: Path, run: str, epoch: int, step: int, work: str) -> Path:
    return runs / run / f"epoch_{epoch:02d}" / f"step_{step:02d}" / work / "scripts"


def report_path(
    runs: Path, run: str, epoch: int, step: int, work: str, first: int, last: int
) -> Path:
    return (
        runs
        / run
        / "loss"
        / f"epoch_{epoch:02d}"
        / f"step_{step:02d}"
        / f"{work}_ep{dataset.format_range(first, last)}.md"
    )


def write_scripts(folder: Path, episodes: dict[int, str], success: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for n, text in episodes.items():
        (folder / dataset.episode_name(n)).write_text(text, encoding="utf-8")
    if success:
        (folder / "_SUCCESS").touch()


def child_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SKILLTRAIN_", "NOTIFY_SOCKET", "WATCHDOG_"))
    }
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", OPENAI_API_KEY="sk-bench", **extra)
    return env


# ----------------------------------------------------------------------------- daemon


class DaemonProc:
    """A `skilltrain daemon` subprocess, watched through its log and /proc."""

    def __init__(self, ws: Workspace, *, once: bool = False,
                 extra_env: dict[str, str] | None = None) -> None:
        self.ws = ws
        self.once = once
        self.extra_env = extra_env or {}  # bench/cpu_breakdown.py: the CPU probe
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0  # monotonic, just before Popen
        self.peak_rss_kb = 0
        self._offset = 0
        self._events: list[dict[str, Any]] = []
        self._sampler: threading.Thread | None = None
        self._stderr = ws.root / "daemon.stderr"
        self._stderr_offset = 0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> DaemonProc:
        self._offset = self.ws.log_file.stat().st_size if self.ws.log_file.exists() else 0
        self._events = []
        self._stderr_offset = self._stderr.stat().st_size if self._stderr.exists() else 0
        argv = [SKILLTRAIN, "daemon", "--config", str(self.ws.config)]
        if self.once:
            argv.append("--once")
        with open(self._stderr, "ab") as err:
            self.started_at = time.monotonic()
            self.proc = subprocess.Popen(
                argv,
                env=child_env(**self.extra_env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                cwd=self.ws.root,
            )
        self._sampler = threading.Thread(target=self._sample_rss, daemon=True)
        self._sampler.start()
        return self

    def _sample_rss(self) -> None:
        # VmHWM is the kernel's own high-water mark, so sampling only has to
        # catch the process alive once after its peak.
        while self.proc is not None and self.proc.poll() is None:
            self.peak_rss_kb = max(self.peak_rss_kb, proc_status_kb(self.pid, "VmHWM"))
            time.sleep(0.05)

    def events(self) -> list[dict[str, Any]]:
        """Every log event of this daemon run so far, in order."""
        if not self.ws.log_file.exists():
            return self._events
        with open(self.ws.log_file, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            with contextlib.suppress(ValueError):
                self._events.append(json.loads(line))
        self._offset += end
        return self._events

    def find(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events() if e.get("event") == name]

    def wait_event(self, name: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.find(name)
            if found:
                return found[0]
            self._check_alive(name)
            if time.monotonic() > deadline:
                raise BenchError(f"no {name} event within {timeout_s:.0f} s")
            time.sleep(0.005)

    def _check_alive(self, waiting_for: str) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            tail = self._stderr.read_text(errors="replace")[-2000:]
            raise BenchError(
                f"daemon exited with {self.proc.returncode} while waiting for "
                f"{waiting_for}; stderr tail:\n{tail}"
            )

    def stderr_since_start(self) -> str:
        with open(self._stderr, "rb") as f:
            f.seek(self._stderr_offset)
            return f.read().decode(errors="replace")

    def cpu_seconds(self) -> float:
        """utime + stime of every thread so far (/proc/<pid>/stat fields 14, 15)."""
        return sum(self.cpu_split())

    def cpu_split(self) -> tuple[float, float]:
        """(utime, stime) of every thread so far: user and kernel CPU apart."""
        raw = Path(f"/proc/{self.pid}/stat").read_text()
        fields = raw[raw.rindex(")") + 2 :].split()
        return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout=timeout_s)
        if self._sampler is not None:
            self._sampler.join()
        return code

    def stop(self, timeout_s: float = 60) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.wait(10)

    @property
    def peak_rss_mb(self) -> float:
        return self.peak_rss_kb / 1024


class BenchError(Exception):
    pass


def proc_status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def event_time(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def wait_until(
    predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.001
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


# ------------------------------------------------------------------------- throughput

SETS_PER_STEP = 10  # 5 works x 2 ranges of 3 episodes (the example work has 6)


def throughput_workspace(
    ws: Workspace, sets: int, server_url: str, concurrency: int = 8,
    per_step: int = SETS_PER_STEP,
) -> list[dict[str, Any]]:
    """`sets` finished sets (with _SUCCESS), `per_step` (even) per step, two ranges
    of each work; returns their descriptions."""
    human, model = example_episodes("human"), example_episodes("model_draft")
    works = [f"w{i}" for i in range(max(1, per_step // 2))]
    for name in works:
        ws.add_work(name, human)
    ws.write_config(api_base=server_url, concurrency=concurrency, settle_s=0)
    todo = []
    for step in range(math.ceil(sets / (2 * len(works)))):
        for name in works:
            write_scripts(scripts_dir(ws.runs, "bench", 0, step, name), model, success=True)
            for first, last in ((1, 3), (4, 6)):
                todo.append({"step": step, "work": name, "first": first, "last": last})
    return todo[:sets]


def shell_loop(ws: Workspace, todo: list[dict[str, Any]], server_url: str) -> Path:
    """The alternative: one `skilltrain loss` process per set, as a cron job would."""
    out = ws.root / "shell_out"
    cfg = ws.root / "shell.toml"
    cfg.write_text('[paths]\nprompts = "prompts"\n', encoding="utf-8")
    lines = ["#!/bin/bash", "set -e"]
    for t in todo:
        scripts = scripts_dir(ws.runs, "bench", 0, t["step"], t["work"])
        report = out / f"step_{t['step']:02d}_{t['work']}_ep{t['first']:02d}-{t['last']:02d}.md"
        lines.append(
            f"{SKILLTRAIN} loss --config {cfg} --work {ws.data / t['work']} "
            f"--first {t['first']} --last {t['last']} --scripts {scripts} "
            f"--out {report} --model {MODEL} >/dev/null"
        )
    script = ws.root / "shell_loop.sh"
    script.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return script


def bench_throughput(sets: int, shell_sets: int, latency: tuple[float, float]) -> list[Row]:
    say(f"throughput: {sets} sets, loopback latency {latency[0]}-{latency[1]} s, load {loadavg()}")
    server = LLMServer(latency=latency).start()
    try:
        with workspace("throughput") as ws:
            todo = throughput_workspace(ws, sets, server.url)
            daemon = DaemonProc(ws, once=True).start()
            code = daemon.wait(timeout_s=600)
            daemon_s = time.monotonic() - daemon.started_at
            written = len(list(ws.runs.glob("bench/loss/epoch_00/step_*/*.json")))
            daemon_requests = server.request_count
            say(
                f"daemon --once: exit {code}, {written} reports, {daemon_requests} requests, "
                f"{daemon_s:.2f} s, peak RSS {daemon.peak_rss_mb:.0f} MB"
            )
            if code != 0 or written != sets:
                raise BenchError(f"daemon --once wrote {written}/{sets} reports (exit {code})")

            n = min(shell_sets, sets)
            script = shell_loop(ws, todo[:n], server.url)
            say(f"shell loop: {n} x `skilltrain loss` ...")
            t0 = time.monotonic()
            subprocess.run(
                ["bash", str(script)],
                check=True,
                cwd=ws.root,
                env=child_env(SKILLTRAIN_LLM_API_BASE=server.url),
            )
            shell_s = time.monotonic() - t0
            shell_rss_mb = _children_maxrss_mb()
            shell_written = len(list((ws.root / "shell_out").glob("*.json")))
            if shell_written != n:
                raise BenchError(f"shell loop wrote {shell_written}/{n} reports")
    finally:
        server.stop()
    per_set = shell_s / n
    shell_full = per_set * sets
    label = f"{sets} sets" + ("" if n == sets else f", EXTRAPOLATED from {n}")
    ratio = shell_full / daemon_s
    say(f"shell loop: {shell_s:.2f} s for {n} sets ({per_set:.2f} s/set)")
    return [
        Row(f"daemon --once wall ({sets} sets, concurrency 8)", f"{daemon_s:.2f} s"),
        Row("daemon throughput", f"{sets / daemon_s:.2f} sets/s"),
        Row(f"shell loop wall ({n} sets measured)", f"{shell_s:.2f} s ({per_set:.2f} s/set)"),
        Row(f"shell loop wall ({label})", f"{shell_full:.1f} s"),
        Row("shell loop throughput", f"{1 / per_set:.3f} sets/s"),
        Row("speed-up daemon vs shell loop", f"{ratio:.1f}x", ">= 20x", ratio >= 20),
        Row("daemon peak RSS (VmHWM)", f"{daemon.peak_rss_mb:.0f} MB"),
        Row("one `skilltrain loss` peak RSS", f"{shell_rss_mb:.0f} MB"),
    ]


PERJOB_LATENCY_S = 0.5
PERJOB_CONCURRENCY = 128
# A priced model with a known window, as in production, served by the
# loopback. An unmapped one (the tests' openai/loopback-model) also costs
# litellm a formatted traceback per reply when it fails to price it.
PERJOB_MODEL = "openai/gpt-4o-mini"


def bench_perjob(sets: int, model: str) -> list[Row]:
    """CPU per loss job, and the wall time at concurrency 128 against a 0.5 s server.

    The sets are on disk before the daemon starts. The latency limit is the
    wall time of a daemon that costs nothing: ceil(jobs / 128) rounds of
    0.5 s, from the server's first request to the last loss.completed. CPU is
    the daemon's over the same span, per job.
    """
    latency = PERJOB_LATENCY_S
    say(f"per job: {sets} sets, concurrency {PERJOB_CONCURRENCY}, loopback {latency} s, "
        f"model {model}, load {loadavg()}")
    server = LLMServer(latency=(latency, latency)).start()
    try:
        with workspace("perjob") as ws:
            todo = throughput_workspace(ws, sets, server.url, concurrency=PERJOB_CONCURRENCY)
            # No start-up audit: it reads every report as it is written, a
            # one-off cost of a start, not of a job.
            ws.write_config(api_base=server.url, concurrency=PERJOB_CONCURRENCY, settle_s=0,
                            audit=False)
            text = ws.config.read_text(encoding="utf-8")
            ws.config.write_text(text.replace(f'"{MODEL}"', f'"{model}"'), encoding="utf-8")
            total = len(todo)
            daemon = DaemonProc(ws).start()
            try:
                daemon.wait_event("daemon.ready", timeout_s=120)
                wait_until(lambda: server.request_count > 0, 60, "the first request")
                user0, sys0 = daemon.cpu_split()
                first = server.requests[0].wall
                wait_until(lambda: len(daemon.find("loss.completed")) >= total, 300,
                           "every loss.completed", poll_s=0.02)
                user1, sys1 = daemon.cpu_split()
                last = max(event_time(e) for e in daemon.find("loss.completed"))
            finally:
                daemon.stop()
    finally:
        server.stop()
    wall = last - first
    rounds = math.ceil(total / PERJOB_CONCURRENCY)
    limit = rounds * latency
    user_ms, sys_ms = (user1 - user0) * 1000 / total, (sys1 - sys0) * 1000 / total
    cpu_ms = user_ms + sys_ms
    ratio = wall / limit
    return [
        Row(f"CPU per loss job ({total} jobs, {model})", f"{cpu_ms:.1f} ms", "< 8 ms",
            cpu_ms < 8),
        Row("  of which user / kernel", f"{user_ms:.1f} / {sys_ms:.1f} ms"),
        Row(f"wall, first request -> last loss.completed (concurrency {PERJOB_CONCURRENCY})",
            f"{wall:.2f} s"),
        Row(f"latency limit: {rounds} rounds of {latency} s", f"{limit:.2f} s"),
        Row("wall / latency limit", f"{ratio:.2f}x", "<= 1.15x", ratio <= 1.15),
        Row("daemon peak RSS (VmHWM)", f"{daemon.peak_rss_mb:.0f} MB"),
    ]


def _children_maxrss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


# ---------------------------------------------------------------------------- latency

POLL_INTERVAL_S = 1.0  # skilltrain.daemon.service.watcher's polling interval


@dataclass
class Pickup:
    latency_s: float  # _SUCCESS created -> request at the server
    detect_s: float | None  # _SUCCESS created -> loss.queued logged


def latency_run(
    observer: str, sets: int, pause_s: float, jitter_s: float = 0.0
) -> tuple[list[Pickup], float]:
    """Start a daemon, feed it a warm-up set + `sets` one by one; returns pickups, peak RSS."""
    server = LLMServer().start()
    try:
        with workspace(f"latency-{observer}") as ws:
            human = example_episodes("human")
            ws.add_work("w0", {n: human[n] for n in (1, 2, 3)}, ranges=[(1, 3)])
            ws.write_config(api_base=server.url, observer=observer, settle_s=60, resync_s=3600)
            daemon = DaemonProc(ws).start()
            try:
                daemon.wait_event("daemon.ready", timeout_s=60)
                pickups = [
                    _one_pickup(ws, daemon, server, i, (pause_s, jitter_s), warm_up=i == 0)
                    for i in range(sets + 1)
                ]
            finally:
                daemon.stop()
            return pickups, daemon.peak_rss_mb
    finally:
        server.stop()


def _one_pickup(
    ws: Workspace,
    daemon: DaemonProc,
    server: LLMServer,
    i: int,
    pause: tuple[float, float],
    warm_up: bool,
) -> Pickup:
    model = example_episodes("model_draft")
    epoch, step = divmod(i, 100)
    folder = scripts_dir(ws.runs, "bench", epoch, step, "w0")
    # Episodes first, as the writer finishes them; settle_s=60 keeps the
    # daemon waiting, so only _SUCCESS can make the set ready.
    write_scripts(folder, {n: model[n] for n in (1, 2, 3)}, success=False)
    # A random extra wait: a polling observer must not be phase-locked to our loop.
    time.sleep(pause[0] + random.uniform(0, pause[1]))
    before = server.request_count
    t0 = time.time()
    (folder / "_SUCCESS").touch()
    wait_until(
        lambda: server.request_count > before, 120 if warm_up else 30, f"the request of set {i}"
    )
    request = server.requests[before]
    sidecar = report_path(ws.runs, "bench", epoch, step, "w0", 1, 3).with_suffix(".json")
    wait_until(sidecar.exists, 30, f"the report of set {i}", poll_s=0.005)
    queued = [
        e for e in daemon.find("loss.queued") if e.get("epoch") == epoch and e.get("step") == step
    ]
    detect = event_time(queued[-1]) - t0 if queued else None
    return Pickup(request.wall - t0, detect)


def bench_latency(sets: int, polling_sets: int, pause_s: float) -> list[Row]:
    say(f"latency: native observer, {sets} sets (+1 warm-up), load {loadavg()}")
    (warm_up, *native), native_rss = latency_run("native", sets, pause_s)
    say(f"latency: polling observer, {polling_sets} sets (+1 warm-up), load {loadavg()}")
    (_, *polling), _ = latency_run("polling", polling_sets, pause_s, jitter_s=POLL_INTERVAL_S)
    nat = [p.latency_s * 1000 for p in native]
    pol = [p.latency_s * 1000 for p in polling]
    detect = [p.detect_s * 1000 for p in native if p.detect_s is not None]
    prepare = [(p.latency_s - p.detect_s) * 1000 for p in native if p.detect_s is not None]
    p99 = percentile(nat, 99)
    return [
        Row(f"native: pickup p50 ({len(nat)} sets)", f"{percentile(nat, 50):.1f} ms"),
        Row(f"native: pickup p99 ({len(nat)} sets)", f"{p99:.1f} ms", "< 100 ms", p99 < 100),
        Row("native: pickup max / mean", f"{max(nat):.1f} / {statistics.mean(nat):.1f} ms"),
        Row(
            "native: _SUCCESS -> loss.queued p50 / p99",
            f"{percentile(detect, 50):.1f} / {percentile(detect, 99):.1f} ms",
        ),
        Row(
            "native: loss.queued -> request p50 / p99",
            f"{percentile(prepare, 50):.1f} / {percentile(prepare, 99):.1f} ms",
        ),
        Row(f"polling: pickup p50 ({len(pol)} sets)", f"{percentile(pol, 50):.1f} ms"),
        Row(f"polling: pickup p99 ({len(pol)} sets)", f"{percentile(pol, 99):.1f} ms"),
        Row("polling p50 / native p50", f"{percentile(pol, 50) / percentile(nat, 50):.1f}x slower"),
        Row(
            "native: warm-up set right after daemon.ready (excluded)",
            f"{warm_up.latency_s * 1000:.0f} ms",
        ),
        Row("daemon peak RSS (native run)", f"{native_rss:.0f} MB"),
    ]


# ------------------------------------------------------------------------------ scale


@dataclass
class ScaleShape:
    runs: int = 10
    epochs: int = 10
    steps: int = 20
    works: int = 10
    episodes: int = 5  # one report per work and step: ranges = [[1, 5]]
    episode_bytes: int = 2000
    # Sidecars as the handler writes them since issue 21 (with the episodes'
    # stat signature); False: as older daemons wrote them (content hashes only).
    stat_sigs: bool = True

    @property
    def sets(self) -> int:
        return self.runs * self.epochs * self.steps * self.works


def generate_scale_tree(ws: Workspace, shape: ScaleShape) -> dict[str, int]:
    """An already reported tree: episodes, _SUCCESS, report + valid sidecar per set."""
    body = "INT. ROOM - DAY\n\nA line of action that goes on for a while. " * 200
    body = body[: shape.episode_bytes]
    works = [f"w{i:02d}" for i in range(shape.works)]
    human_digest = {}
    for name in works:
        human = {n: f"EPISODE {n} of {name}\n{body}" for n in range(1, shape.episodes + 1)}
        ws.add_work(name, human, ranges=[(1, shape.episodes)])
        human_digest[name] = dataset.episodes_digest(human)
    template_sha = PromptTemplates(ws.root / "prompts").source_hash("loss")
    files = dirs = 0
    for r in range(shape.runs):
        for e in range(shape.epochs):
            for s in range(shape.steps):
                loss_dir = report_path(ws.runs, f"r{r:02d}", e, s, "x", 1, 1).parent
                loss_dir.mkdir(parents=True)
                dirs += 1
                for name in works:
                    f, d = _scale_set(
                        ws, f"r{r:02d}", e, s, name, shape, body, human_digest[name], template_sha
                    )
                    files, dirs = files + f, dirs + d
    return {"files": files, "dirs": dirs}


def _scale_set(
    ws: Workspace,
    run: str,
    epoch: int,
    step: int,
    work: str,
    shape: ScaleShape,
    body: str,
    human_sha: str,
    template_sha: str,
) -> tuple[int, int]:
    folder = scripts_dir(ws.runs, run, epoch, step, work)
    os.makedirs(folder)
    model = {n: f"{run} {epoch} {step} {work} ep{n}\n{body}" for n in range(1, shape.episodes + 1)}
    for n, text in model.items():
        with open(folder / dataset.episode_name(n), "w", encoding="utf-8") as f:
            f.write(text)
    open(folder / "_SUCCESS", "w").close()
    report = report_path(ws.runs, run, epoch, step, work, 1, shape.episodes)
    text = f"A report for {work}.\n"
    with open(report, "w", encoding="utf-8") as f:
        f.write(text)
    # The sidecar as the loss handler writes it; the daemon checks `inputs`.
    sidecar = {
        "schema": 1,
        "work": work,
        "range": dataset.format_range(1, shape.episodes),
        "first": 1,
        "last": shape.episodes,
        "model": MODEL,
        "inputs": {
            "human_sha256": human_sha,
            "model_sha256": dataset.episodes_digest(model),
            "template_sha256": template_sha,
            "model_id": MODEL,
        },
        "model_episodes": {
            dataset.episode_name(n): dataset.sha256_text(t) for n, t in model.items()
        },
        "report_sha256": dataset.sha256_text(text),
        "finish_reason": "stop",
    }
    if shape.stat_sigs:
        sidecar["model_stat_sigs"] = sigs_digest(tuple(
            (n, FileSig.of(os.lstat(folder / dataset.episode_name(n)))) for n in model))
    with open(report.with_suffix(".json"), "w", encoding="utf-8") as f:
        json.dump(sidecar, f, indent=2)
    return shape.episodes + 3, 3  # files: episodes, _SUCCESS, report, sidecar


def time_find(runs: Path, repeat: int = 3) -> tuple[float, int]:
    """Best of `repeat` wall times of `find runs -name 'ep*.txt'` (warm cache, like the daemon)."""
    best, count = math.inf, 0
    for _ in range(repeat):
        t0 = time.monotonic()
        out = subprocess.run(
            ["find", str(runs), "-name", "ep*.txt"], check=True, stdout=subprocess.PIPE
        ).stdout
        best = min(best, time.monotonic() - t0)
        count = out.count(b"\n")
    return best, count


@dataclass
class ScaleOptions:
    shape: ScaleShape
    idle_s: float = 60
    audit: bool = False  # the daemon's leak audit of runs/ at start (minutes on this tree)
    base_dir: Path | None = None  # where the tree goes; None: /dev/shm when there is one
    quiet_limit_s: float = 20
    tree: Path | None = None  # keep the tree here and reuse it on the next run
    warm_only: bool = False  # a kept tree with its state: no cold start, the warm one only


@dataclass
class StartUp:
    scan_ms: int
    to_ready_s: float  # Popen -> daemon.ready seen in the log
    in_process_s: float  # daemon.started -> daemon.ready, from log timestamps
    sets: int
    done: int
    queued: int = 0
    peak_rss_mb: float = 0.0
    overflows: int = 0  # watchdog's "Inotify queue overflowed" warnings
    idle_cpu_pct: float | None = None
    quiet_after_s: float = 0.0
    audit_ms: int | None = None
    requests: int = 0  # LLM requests before the probe
    probe_ms: float | None = None  # pickup of one new set on the big tree
    probe_queued_ms: float | None = None  # its _SUCCESS -> loss.queued
    to_caught_up_s: float = 0.0  # Popen -> daemon.caught_up (the start-up scan's end)


def scale_start(ws: Workspace, opts: ScaleOptions, server: LLMServer | None = None) -> StartUp:
    """Start the daemon on the tree; with `server`, also idle CPU and one pickup."""
    daemon = DaemonProc(ws).start()
    try:
        ready = daemon.wait_event("daemon.ready", timeout_s=900)
        to_ready = time.monotonic() - daemon.started_at
        # READY comes before the start-up scan (issue 21); caught up after it.
        caught_up = daemon.wait_event("daemon.caught_up", timeout_s=900)
        scan = daemon.find("scan.completed")[0]
        started = daemon.find("daemon.started")[0]
        result = StartUp(
            scan_ms=int(scan["duration_ms"]),
            to_ready_s=to_ready,
            in_process_s=event_time(ready) - event_time(started),
            sets=int(scan["sets"]),
            done=int(scan.get("done", 0)),
            to_caught_up_s=event_time(caught_up) - event_time(started) + (
                to_ready - (event_time(ready) - event_time(started))),
        )
        state_file = ws.runs / ".skilltrain" / "state.sqlite3"
        wait_until(state_file.exists, 60, "the state database", poll_s=0.05)
        if server is None:
            result.queued = len(daemon.find("loss.queued"))
        else:
            _steady_state(ws, daemon, opts, result, server)
    finally:
        daemon.stop()
    result.peak_rss_mb = daemon.peak_rss_mb
    result.overflows = daemon.stderr_since_start().count("queue overflowed")
    return result


def _steady_state(
    ws: Workspace, daemon: DaemonProc, opts: ScaleOptions, result: StartUp, server: LLMServer
) -> None:
    if opts.audit:
        say("waiting for the start-up audit of runs/ ...")
        result.audit_ms = int(daemon.wait_event("audit.completed", 1800)["duration_ms"])
    result.quiet_after_s = _wait_quiet(daemon, opts.quiet_limit_s)
    say(f"idle window: {opts.idle_s:.0f} s")
    cpu0, t0 = daemon.cpu_seconds(), time.monotonic()
    time.sleep(opts.idle_s)
    cpu1, t1 = daemon.cpu_seconds(), time.monotonic()
    result.idle_cpu_pct = 100 * (cpu1 - cpu0) / (t1 - t0)
    result.queued = len(daemon.find("loss.queued"))
    result.requests = server.request_count
    if result.requests:
        return  # the zero-request check fails; a probe would only blur it
    # One new set on the big tree: is a finished set still picked up at once?
    shape = opts.shape
    folder = scripts_dir(ws.runs, "r00", 0, shape.steps, "w00")
    write_scripts(folder, {n: f"probe ep{n}\n" * 50 for n in range(1, shape.episodes + 1)}, False)
    time.sleep(0.25)
    t_success = time.time()
    (folder / "_SUCCESS").touch()
    with contextlib.suppress(BenchError):
        wait_until(lambda: server.request_count > 0, PROBE_TIMEOUT_S, "the probe set")
        result.probe_ms = (server.requests[0].wall - t_success) * 1000
        queued = daemon.find("loss.queued")
        if queued:
            result.probe_queued_ms = (event_time(queued[-1]) - t_success) * 1000


PROBE_TIMEOUT_S = 30.0


def _wait_quiet(daemon: DaemonProc, limit_s: float) -> float:
    """Wait for start-up work (litellm's background import, the state flush) to end.

    Quiet = a one-second sample under 5 % of a core. Returns the time waited.
    """
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        c0 = daemon.cpu_seconds()
        time.sleep(1.0)
        if daemon.cpu_seconds() - c0 < 0.05:
            break
    return time.monotonic() - t0


def scale_base_dir(opts: ScaleOptions) -> Path | None:
    if opts.base_dir is not None:
        return opts.base_dir
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else None


TREE_DONE = "tree-complete"  # in a kept tree's folder: generation finished


@contextlib.contextmanager
def scale_workspace(opts: ScaleOptions, base: Path | None) -> Iterator[Workspace]:
    """A temporary workspace, or the kept one (`--tree DIR`): built once, reused after."""
    if opts.tree is None:
        with workspace("scale", base) as ws:
            yield ws
        return
    opts.tree.mkdir(parents=True, exist_ok=True)
    yield Workspace(opts.tree)


def _forget_probe(ws: Workspace, shape: ScaleShape, keep_state: bool = False) -> None:
    """A kept tree: the last run's probe set and (unless kept) the state go, the
    reported history stays."""
    shutil.rmtree(scripts_dir(ws.runs, "r00", 0, shape.steps, "w00").parent.parent,
                  ignore_errors=True)
    shutil.rmtree(ws.runs / "r00" / "loss" / "epoch_00" / f"step_{shape.steps:02d}",
                  ignore_errors=True)
    if keep_state:
        return
    state = ws.runs / ".skilltrain"
    for name in ("state.json", "state.sqlite3"):
        (state / name).unlink(missing_ok=True)


def bench_scale(opts: ScaleOptions) -> list[Row]:
    shape = opts.shape
    base = scale_base_dir(opts)
    say(
        f"scale: {shape.sets:,} sets, {shape.sets * shape.episodes:,} episode files "
        f"under {opts.tree or base or tempfile.gettempdir()}, load {loadavg()}"
    )
    server = LLMServer().start()
    try:
        with scale_workspace(opts, base) as ws:
            ws.write_config(api_base=server.url, settle_s=60, resync_s=300, audit=opts.audit)
            t0 = time.monotonic()
            done = ws.root / TREE_DONE
            warm_only = opts.warm_only and done.exists()
            if done.exists():
                say(f"reusing the tree in {ws.root} ({done.read_text().strip()})")
                ws.log_file.unlink(missing_ok=True)
                _forget_probe(ws, shape, keep_state=warm_only)
            else:
                made = generate_scale_tree(ws, shape)
                done.write_text(f"{made['files']:,} files in {made['dirs']:,} folders\n")
                say(f"generated {made['files']:,} files in {made['dirs']:,} folders in "
                    f"{time.monotonic() - t0:.1f} s")
            gen_s = time.monotonic() - t0
            find_s, found = time_find(ws.runs)
            say(f"find: {found:,} episode files in {find_s * 1000:.0f} ms")
            cold = None
            if not warm_only:
                cold = scale_start(ws, opts)
                say(f"cold start: scan {cold.scan_ms} ms, ready after {cold.to_ready_s:.2f} s")
            # Again, right before the warm start: the cold start's writes (a
            # marker and three files per report) change what the page cache holds.
            warm_find_s, _ = time_find(ws.runs)
            say(f"find again: {warm_find_s * 1000:.0f} ms")
            warm = scale_start(ws, opts, server)
            say(f"warm start: scan {warm.scan_ms} ms, ready after {warm.to_ready_s:.2f} s")
            t0 = time.monotonic()
    finally:
        server.stop()
    say(f"deleted the tree in {time.monotonic() - t0:.1f} s")
    return _scale_rows(shape, gen_s, find_s, warm_find_s, cold, warm)


def _scale_rows(
    shape: ScaleShape, gen_s: float, find_s: float, warm_find_s: float, cold: StartUp | None,
    warm: StartUp
) -> list[Row]:
    rows = [
        Row("tree generation (bench, not daemon)", f"{gen_s:.1f} s"),
        Row("`find runs -name 'ep*.txt'`", f"{find_s * 1000:.0f} ms"),
        Row("`find` again, right before the warm start", f"{warm_find_s * 1000:.0f} ms"),
    ]
    if cold is not None:
        rows += _start_rows("cold", cold, shape, find_s * 1000)
    rows += _start_rows("warm", warm, shape, warm_find_s * 1000)
    rows += _steady_rows(cold, warm)
    return rows


def _start_rows(name: str, s: StartUp, shape: ScaleShape, find_ms: float) -> list[Row]:
    ratio = s.scan_ms / find_ms
    return [
        Row(
            f"{name}: sets seen / done",
            f"{s.sets:,} / {s.done:,}",
            f"{shape.sets:,}",
            s.sets == s.done == shape.sets,
        ),
        Row(
            f"{name}: scan.completed duration",
            f"{s.scan_ms:,} ms ({ratio:.1f}x find)",
            "<= 3x find",
            ratio <= 3,
        ),
        Row(f"{name}: daemon.started -> ready", f"{s.in_process_s:.2f} s"),
        Row(
            f"{name}: spawn -> daemon.ready (READY=1)",
            f"{s.to_ready_s:.2f} s ({s.to_ready_s * 1000 / find_ms:.1f}x find)",
            "<= 2x find" if name == "warm" else "",
            s.to_ready_s * 1000 <= 2 * find_ms if name == "warm" else None,
        ),
        Row(
            f"{name}: spawn -> daemon.caught_up (scan done)",
            f"{s.to_caught_up_s:.2f} s ({s.to_caught_up_s * 1000 / find_ms:.1f}x find)",
        ),
        Row(f"{name}: peak RSS (VmHWM)", f"{s.peak_rss_mb:.0f} MB"),
        Row(f"{name}: inotify queue overflows logged", f"{s.overflows}", "0", s.overflows == 0),
    ]


def _steady_rows(cold: StartUp | None, warm: StartUp) -> list[Row]:
    assert warm.idle_cpu_pct is not None
    rows = []
    if warm.audit_ms is not None:
        rows.append(Row("warm: start-up audit of runs/ (audit.completed)", f"{warm.audit_ms:,} ms"))
    probe = f"not within {PROBE_TIMEOUT_S:.0f} s"
    if warm.probe_ms is not None:
        probe = f"{warm.probe_ms:.0f} ms"
    if warm.probe_queued_ms is not None:
        probe += f" (queued after {warm.probe_queued_ms:.0f} ms; first job of this daemon)"
    queued = (cold.queued if cold else 0) + warm.queued
    rows += [
        Row(
            f"warm: CPU while idle (after {warm.quiet_after_s:.0f} s of start-up work)",
            f"{warm.idle_cpu_pct:.2f} % of a core",
            "< 1 %",
            warm.idle_cpu_pct < 1,
        ),
        Row(
            "LLM requests / loss.queued on the reported tree",
            f"{warm.requests} / {queued}",
            "0 / 0",
            warm.requests == 0 and queued == 0,
        ),
        Row(
            "warm: pickup of one new set on this tree",
            probe,
            "< 1 s",
            warm.probe_ms is not None and warm.probe_ms < 1000,
        ),
    ]
    return rows


# ------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "which", choices=("throughput", "perjob", "latency", "scale", "all")
    )
    g = parser.add_argument_group("throughput")
    g.add_argument(
        "--sets",
        type=int,
        default=None,
        help="sets for throughput (default 50) and latency (default 100)",
    )
    g.add_argument(
        "--shell-sets",
        type=int,
        default=10,
        help="sets the shell loop really runs; the rest is extrapolated (default 10)",
    )
    g.add_argument(
        "--server-latency",
        type=float,
        nargs=2,
        default=(0.45, 0.55),
        metavar=("MIN", "MAX"),
        help="loopback reply latency (default 0.45 0.55)",
    )
    g.add_argument(
        "--perjob-model",
        default=PERJOB_MODEL,
        help=f"model id the per-job run asks the loopback for (default {PERJOB_MODEL})",
    )
    g = parser.add_argument_group("latency")
    g.add_argument("--polling-sets", type=int, default=20)
    g.add_argument(
        "--pause",
        type=float,
        default=0.25,
        help="seconds between the episodes and _SUCCESS (default 0.25)",
    )
    g = parser.add_argument_group("scale")
    g.add_argument("--idle-seconds", type=float, default=60)
    g.add_argument(
        "--audit",
        action="store_true",
        help="keep the daemon's start-up leak audit on (minutes on 20,000 sets; off by default)",
    )
    g.add_argument(
        "--scale-dir",
        type=Path,
        default=None,
        help="parent folder of the scale tree (default /dev/shm when present: creating and "
        "deleting 220,000 entries on a disk mounted with `discard` takes minutes)",
    )
    g.add_argument(
        "--quiet-limit",
        type=float,
        default=20,
        metavar="S",
        help="wait at most S seconds for start-up work before the idle window",
    )
    g.add_argument(
        "--tree",
        type=Path,
        default=None,
        metavar="DIR",
        help="build the scale tree in DIR once and reuse it on later runs (kept)",
    )
    g.add_argument(
        "--warm-only",
        action="store_true",
        help="with --tree: keep the kept tree's state and measure only the warm start",
    )
    g.add_argument("--runs", type=int, default=10)
    g.add_argument("--epochs", type=int, default=10)
    g.add_argument("--steps", type=int, default=20)
    g.add_argument("--works", type=int, default=10)
    g.add_argument("--episode-bytes", type=int, default=2000)
    g.add_argument(
        "--old-sidecars",
        action="store_true",
        help="sidecars without the episodes' stat signature (as written before issue 21): "
        "a cold start then hashes every episode",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(
        f"skilltrain daemon bench: {os.cpu_count()} cores, load {loadavg()}, "
        f"python {sys.version.split()[0]}",
        flush=True,
    )
    results: list[tuple[str, list[Row]]] = []
    t0 = time.monotonic()
    try:
        if args.which in ("throughput", "all"):
            rows = bench_throughput(args.sets or 50, args.shell_sets, tuple(args.server_latency))
            results.append(("throughput", rows))
            print_table("throughput", rows)
        if args.which in ("perjob", "all"):
            rows = bench_perjob(args.sets or 1024, args.perjob_model)
            results.append(("per job", rows))
            print_table("per job", rows)
        if args.which in ("latency", "all"):
            rows = bench_latency(args.sets or 100, args.polling_sets, args.pause)
            results.append(("pickup latency", rows))
            print_table("pickup latency", rows)
        if args.which in ("scale", "all"):
            shape = ScaleShape(
                args.runs, args.epochs, args.steps, args.works, episode_bytes=args.episode_bytes,
                stat_sigs=not args.old_sidecars,
            )
            opts = ScaleOptions(
                shape, args.idle_seconds, args.audit, args.scale_dir, args.quiet_limit, args.tree,
                args.warm_only,
            )
            rows = bench_scale(opts)
            results.append(("scale", rows))
            print_table("scale", rows)
    except BenchError as e:
        print(f"bench failed: {e}", file=sys.stderr)
        return 2
    if len(results) > 1:
        print_table(
            "all",
            [
                Row(f"{name}: {r.figure}", r.measured, r.target, r.ok)
                for name, rows in results
                for r in rows
                if r.ok is not None
            ],
        )
    failed = [r for _, rows in results for r in rows if r.ok is False]
    print(
        f"\ntotal {time.monotonic() - t0:.0f} s, load {loadavg()}; "
        f"{'all targets met' if not failed else f'{len(failed)} target(s) missed'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
