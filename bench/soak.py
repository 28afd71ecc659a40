"""Soak: thousands of sets arriving over minutes, against a loopback LLM with random latency.

    .venv/bin/python bench/soak.py                           # 2,000 sets over ~5 minutes
    .venv/bin/python bench/soak.py --sets 200 --minutes 0.5  # quick mode, about a minute

A real `skilltrain daemon` subprocess (native inotify observer, `concurrency = 16`)
watches a temporary runs/. A writer thread in this process finishes one step
at a time (every work of the step, back to back) at an even pace over
`--minutes`: most works end with `_SUCCESS`, some are written rsync-style
(hidden temp file renamed into place), some have no marker and must wait
`settle_s`. The loopback OpenAI-compatible server (tests/llm_server.py,
in this process, 127.0.0.1 only) answers each request after a random
`--latency-min`..`--latency-max` seconds. Then a second phase rewrites
`--churn` (half) of the reported sets at the same pace: each must be redone
exactly once, with no new set, which tells memory kept per set (state, fine)
from memory kept per job (a leak).

Observed from outside only: the report files, the server's request log, the
daemon's JSON log, and /proc/<pid>/{status,fd,stat} sampled every second.
Checked: every set has exactly one report and one LLM request (so requests ==
sets, plus one per rewritten set), no failure, refusal or internal error, at
most `concurrency` jobs at once, open fds and threads back to where they were,
RSS not creeping: the second half of the new sets may not add more than the
first half did (plus 20 MB), and redoing known sets may add at most 5 MB plus
5 MB per 1,000 jobs.

Exit status: 0 when every check passes, 1 when one fails, 2 when the soak
itself could not run (the daemon died, the sets never all arrived).
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
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests/: the loopback server and the episode generators

from tests.daemon_helpers import (  # noqa: E402
    LOG_NAME,
    SKILLTRAIN,
    SetId,
    config_toml,
    human_screenplays,
    lay_out_workspace,
    model_episode,
    requested_sets,
    sha256_text,
    subprocess_env,
    write_human_episodes,
)
from tests.llm_server import LLMServer  # noqa: E402

WORKS = [f"w{i}" for i in range(10)]
EPISODES = 3  # per work; episodes_per_report = 3, so one set per work and step
STEPS_PER_EPOCH = 10
RUNS = 4
CLK_TCK = os.sysconf("SC_CLK_TCK")


class SoakError(Exception):
    """The soak could not run to the end (exit 2)."""


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ------------------------------------------------------------------ workspace


@dataclass
class Soak:
    root: Path
    sets: int
    minutes: float
    concurrency: int
    settle_s: float
    resync_s: float
    seed: int
    churn: float = 0.0  # fraction of the sets rewritten after the first pass
    written: dict[str, float] = field(default_factory=dict)  # set id -> wall time written
    rewritten: dict[str, str] = field(default_factory=dict)  # set id -> sha256 of new ep01
    style: dict[str, str] = field(default_factory=dict)  # set id -> how it was written
    styles: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def log_file(self) -> Path:
        return self.root / LOG_NAME

    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    def prepare(self, api_base: str) -> None:
        lay_out_workspace(self.root)
        for work in WORKS:
            write_human_episodes(self.root, work, human_screenplays(work, EPISODES, scenes=4))
        text = config_toml(
            api_base,
            llm={"timeout_s": 30, "max_retries": 2, "backoff_initial_s": 0.2, "backoff_max_s": 2.0},
            loss={
                "episodes_per_report": EPISODES,
                "settle_s": self.settle_s,
                "concurrency": self.concurrency,
            },
            watch={"resync_s": self.resync_s, "observer": "auto"},
            log_file=self.log_file,
        )
        self.config.write_text(text, encoding="utf-8")

    def all_sets(self) -> list[SetId]:
        out = []
        for k in range(math.ceil(self.sets / len(WORKS))):
            run, epoch, step = step_of(k)
            out += [SetId(run, epoch, step, work, 1, EPISODES) for work in WORKS]
        return out[: self.sets]

    def report(self, s: SetId) -> Path:
        folder = self.runs / s.run / "loss" / f"epoch_{s.epoch:02d}" / f"step_{s.step:02d}"
        return folder / f"{s.work}_ep{s.first:02d}-{s.last:02d}.md"

    def done(self, s: SetId) -> bool:
        report = self.report(s)
        return report.is_file() and report.with_suffix(".json").is_file()

    def write_set(self, s: SetId) -> None:
        """One set, the way one of three kinds of writer finishes it."""
        rng = self.rng
        scripts = self.runs / s.run / f"epoch_{s.epoch:02d}" / f"step_{s.step:02d}" / s.work
        scripts = scripts / "scripts"
        scripts.mkdir(parents=True, exist_ok=True)
        style = rng.choices(["success", "rsync", "settle"], weights=[6, 2, 2])[0]
        self.styles[style] += 1
        self.style[s.id] = style
        for ep in range(1, EPISODES + 1):
            text = model_episode(s.run, s.epoch, s.step, s.work, ep)
            target = scripts / f"ep{ep:02d}.txt"
            if style == "rsync":
                temp = scripts / f".ep{ep:02d}.txt.{rng.randrange(16**6):06x}"
                temp.write_text(text, encoding="utf-8")
                os.rename(temp, target)
            else:
                target.write_text(text, encoding="utf-8")
        if style != "settle":
            (scripts / "_SUCCESS").touch()
        self.written[s.id] = time.time()

    def rewrite(self, s: SetId) -> None:
        """New text for every episode of a reported set, then _SUCCESS: it must be redone."""
        scripts = self.runs / s.run / f"epoch_{s.epoch:02d}" / f"step_{s.step:02d}" / s.work
        scripts = scripts / "scripts"
        for ep in range(1, EPISODES + 1):
            text = model_episode(s.run, s.epoch, s.step, s.work, ep, version=1)
            (scripts / f"ep{ep:02d}.txt").write_text(text, encoding="utf-8")
            if ep == 1:
                self.rewritten[s.id] = sha256_text(text)
        (scripts / "_SUCCESS").touch()

    def redone(self, s: SetId) -> bool:
        sidecar = self.report(s).with_suffix(".json")
        try:
            data = json.loads(sidecar.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return bool(data.get("model_episodes", {}).get("ep01.txt") == self.rewritten.get(s.id))


def step_of(k: int) -> tuple[str, int, int]:
    """The k-th step written: runs take turns, each counting epochs and steps up."""
    run, n = f"run{k % RUNS}", k // RUNS
    return run, n // STEPS_PER_EPOCH + 1, n % STEPS_PER_EPOCH + 1


# ------------------------------------------------------------------ the daemon


@dataclass
class Sample:
    t: float  # seconds since the soak started
    done: int
    rss_kb: int
    hwm_kb: int
    fds: int
    threads: int


def proc_status(pid: int) -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "Threads"):
                out[key] = int(value.split()[0])
    return out


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def cpu_seconds(pid: int) -> float:
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Daemon:
    def __init__(self, soak: Soak) -> None:
        self.soak = soak
        self.stderr = soak.root / "daemon.stderr"
        with open(self.stderr, "wb") as err:
            self.proc = subprocess.Popen(
                [str(SKILLTRAIN), "daemon", "--config", str(soak.config)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=subprocess_env(),
                cwd=soak.root,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            tail = self.stderr.read_text(errors="replace")[-2000:]
            raise SoakError(f"the daemon exited with {self.proc.returncode}:\n{tail}")

    def sample(self, t0: float, done: int) -> Sample:
        status = proc_status(self.pid)
        return Sample(
            t=time.monotonic() - t0,
            done=done,
            rss_kb=status.get("VmRSS", 0),
            hwm_kb=status.get("VmHWM", 0),
            fds=open_fds(self.pid),
            threads=status.get("Threads", 0),
        )

    def stop(self, timeout_s: float = 60) -> tuple[int, float]:
        t0 = time.monotonic()
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(timeout=10)
        return code, time.monotonic() - t0


def read_log(path: Path) -> list[dict[str, Any]]:
    events = []
    with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8") as f:
        for line in f:
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return events


def wait_for(predicate: Any, timeout_s: float, what: str, daemon: Daemon) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        daemon.check_alive()
        if time.monotonic() > deadline:
            raise SoakError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)


# ------------------------------------------------------------------ the run


@dataclass
class Outcome:
    soak: Soak
    sets: list[SetId]
    samples: list[Sample]
    warm: Sample
    first_pass: Sample  # every set reported once, idle
    end: Sample  # after the churn, idle
    churned: list[SetId]
    requests: list[str]
    events: list[dict[str, Any]]
    write_s: float
    drain_s: float
    cpu_s: float
    stop_code: int
    stop_s: float


def run_soak(soak: Soak, latency: tuple[float, float]) -> Outcome:
    server = LLMServer(latency=latency, seed=soak.seed).start()
    try:
        soak.prepare(server.url)
        sets = soak.all_sets()
        say(
            f"{len(sets)} sets over {soak.minutes:g} min, concurrency {soak.concurrency}, "
            f"latency {latency[0]:g}-{latency[1]:g} s, workspace {soak.root}"
        )
        daemon = Daemon(soak)
        try:
            return drive(soak, sets, daemon, server)
        finally:
            if daemon.alive():
                daemon.stop()
    finally:
        server.stop()


def drive(soak: Soak, sets: list[SetId], daemon: Daemon, server: LLMServer) -> Outcome:
    wait_for(
        lambda: any(e.get("event") == "daemon.ready" for e in read_log(soak.log_file)),
        60,
        "daemon.ready",
        daemon,
    )
    t0 = time.monotonic()
    samples: list[Sample] = [daemon.sample(t0, 0)]
    churned = sets[: int(len(sets) * soak.churn)]
    progress = Progress(soak, sets, churned)
    stop_sampling = threading.Event()

    def sampler() -> None:
        while not stop_sampling.wait(1.0):
            if daemon.alive():
                samples.append(daemon.sample(t0, progress.jobs()))

    sampling = threading.Thread(target=sampler, name="sampler", daemon=True)
    sampling.start()
    try:
        write_s = pace(sets, soak.minutes, daemon, soak.write_set)
        say(f"all {len(sets)} sets written in {write_s:.1f} s; waiting for the last reports")
        wait_for(progress.first_done, 120 + soak.settle_s, "every report", daemon)
        drain_s = time.monotonic() - t0 - write_s
        first_pass = idle_sample(daemon, t0, progress)
        if churned:
            say(f"rewriting {len(churned)} reported sets: each must be redone once")
            pace(churned, soak.minutes * soak.churn, daemon, soak.rewrite)
            wait_for(progress.churn_done, 120, "every rewritten set's new report", daemon)
        end = idle_sample(daemon, t0, progress)
        cpu_s = cpu_seconds(daemon.pid)
    finally:
        stop_sampling.set()
        sampling.join()
    samples += [first_pass, end]
    samples.sort(key=lambda x: x.t)
    code, stop_s = daemon.stop()
    warm = next((x for x in samples if x.done >= max(1, len(sets) // 20)), samples[0])
    return Outcome(
        soak,
        sets,
        samples,
        warm,
        first_pass,
        end,
        churned,
        requested_sets(server),
        read_log(soak.log_file),
        write_s,
        drain_s,
        cpu_s,
        code,
        stop_s,
    )


class Progress:
    """Reports seen so far (first pass) and redone (churn); reports, once seen, stay."""

    def __init__(self, soak: Soak, sets: list[SetId], churned: list[SetId]) -> None:
        self.soak, self.sets, self.churned = soak, sets, churned
        self.done: set[str] = set()
        self.redone: set[str] = set()

    def first_done(self) -> bool:
        for s in self.sets:
            if s.id not in self.done and s.id in self.soak.written and self.soak.done(s):
                self.done.add(s.id)
        return len(self.done) == len(self.sets)

    def churn_done(self) -> bool:
        for s in self.churned:
            if s.id not in self.redone and s.id in self.soak.rewritten and self.soak.redone(s):
                self.redone.add(s.id)
        return len(self.redone) == len(self.churned)

    def jobs(self) -> int:
        self.first_done()
        if self.soak.rewritten:
            self.churn_done()
        return len(self.done) + len(self.redone)


def idle_sample(daemon: Daemon, t0: float, progress: Progress) -> Sample:
    """After a few idle seconds (state flush, step bookkeeping), the daemon's figures."""
    time.sleep(3.0)
    daemon.check_alive()
    return daemon.sample(t0, progress.jobs())


def pace(sets: list[SetId], minutes: float, daemon: Daemon, write: Any) -> float:
    """Call write(set) for one step's sets at a time, the steps evenly spaced over minutes."""
    t0 = time.monotonic()
    steps: dict[tuple[str, int, int], list[SetId]] = {}
    for s in sets:
        steps.setdefault((s.run, s.epoch, s.step), []).append(s)
    interval = minutes * 60 / max(1, len(steps))
    last_report, written = time.monotonic(), 0
    for i, group in enumerate(steps.values()):
        due = t0 + i * interval
        while (wait := due - time.monotonic()) > 0:
            time.sleep(min(wait, 0.5))
        daemon.check_alive()
        for s in group:
            write(s)
        written += len(group)
        if time.monotonic() - last_report > 30:
            last_report = time.monotonic()
            say(f"{written}/{len(sets)} sets written")
    return time.monotonic() - t0


# ------------------------------------------------------------------ figures


@dataclass
class Row:
    figure: str
    measured: str
    target: str = ""
    ok: bool | None = None

    @property
    def verdict(self) -> str:
        return "info" if self.ok is None else ("PASS" if self.ok else "FAIL")


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def event_time(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def max_in_flight(events: list[dict[str, Any]]) -> int:
    """Most loss jobs between loss.started and their end at one moment, from the log."""
    edges = []
    for e in events:
        if e.get("event") == "loss.started":
            edges.append((event_time(e), 1))
        elif e.get("event") in ("loss.completed", "loss.failed", "loss.refused"):
            edges.append((event_time(e), -1))
    level = peak = 0
    for _, delta in sorted(edges, key=lambda x: (x[0], x[1])):
        level += delta
        peak = max(peak, level)
    return peak


def latencies(out: Outcome) -> dict[str, list[float]]:
    """Seconds from the set's last write to its loss.completed, by writer style.

    Sets written before the first report are left out: they wait for the
    daemon's one-time litellm import (about 5 s), which is not pickup latency.
    """
    completed: dict[str, float] = {}
    for e in out.events:
        if e.get("event") == "loss.completed":
            set_id = (
                f"{e['run']}/epoch_{e['epoch']:02d}/step_{e['step']:02d}/{e['work']}/{e['range']}"
            )
            completed.setdefault(set_id, event_time(e))
    by: dict[str, list[float]] = {"_SUCCESS": [], "settle": []}
    first = min(completed.values(), default=0.0)
    for set_id, written in out.soak.written.items():
        if set_id in completed and written > first:
            kind = "settle" if out.soak.style[set_id] == "settle" else "_SUCCESS"
            by[kind].append(completed[set_id] - written)
    return by


def mb(kb: int) -> str:
    return f"{kb / 1024:.1f} MB"


def figures(out: Outcome, concurrency: int) -> list[Row]:
    return correctness_rows(out, concurrency) + timing_rows(out) + resource_rows(out)


def correctness_rows(out: Outcome, concurrency: int) -> list[Row]:
    n, c = len(out.sets), len(out.churned)
    reports = sum(1 for s in out.sets if out.soak.done(s))
    redone = sum(1 for s in out.churned if out.soak.redone(s))
    expected = Counter({s.id: 1 for s in out.sets}) + Counter(s.id for s in out.churned)
    wrong = sum(
        1 for k in expected.keys() | set(out.requests) if Counter(out.requests)[k] != expected[k]
    )
    names = Counter(e.get("event") for e in out.events)
    bad = names["loss.failed"] + names["loss.refused"] + names["set.error"]
    bad += sum(1 for e in out.events if "exception" in e)
    in_flight = max_in_flight(out.events)
    steps = n // len(WORKS)
    return [
        Row(
            "sets written / reported",
            f"{len(out.soak.written)} / {reports}",
            f"{n} / {n}",
            reports == n == len(out.soak.written),
        ),
        Row("sets rewritten / redone", f"{c} / {redone}", f"{c} / {c}", redone == c),
        Row(
            "LLM requests (= sets + rewritten)",
            str(len(out.requests)),
            str(n + c),
            len(out.requests) == n + c,
        ),
        Row("sets with a wrong request count", str(wrong), "0", wrong == 0),
        Row("failed / refused / internal errors", str(bad), "0", bad == 0),
        Row("max jobs in flight", str(in_flight), f"<= {concurrency}", in_flight <= concurrency),
        Row(
            "step.reported",
            str(names["step.reported"]),
            str(steps),
            names["step.reported"] == steps,
        ),
        Row("set.stale (rewritten sets)", str(names["set.stale"]), str(c), names["set.stale"] == c),
        Row(
            "SIGTERM -> exit (code)",
            f"{out.stop_s:.2f} s ({out.stop_code})",
            "code 0",
            out.stop_code == 0,
        ),
    ]


def timing_rows(out: Outcome) -> list[Row]:
    lat = latencies(out)
    names = Counter(e.get("event") for e in out.events)
    n = len(out.sets)
    return [
        Row("writing took / drain after", f"{out.write_s:.1f} s / {out.drain_s:.1f} s"),
        Row("writer styles", ", ".join(f"{k} {v}" for k, v in sorted(out.soak.styles.items()))),
        Row(
            "_SUCCESS write -> report p50 / p99",
            f"{percentile(lat['_SUCCESS'], 50):.2f} s / {percentile(lat['_SUCCESS'], 99):.2f} s",
        ),
        Row(
            "settle write -> report p50 / p99",
            f"{percentile(lat['settle'], 50):.2f} s / {percentile(lat['settle'], 99):.2f} s",
            f">= settle {out.soak.settle_s:g} s",
            percentile(lat["settle"], 1) >= out.soak.settle_s if lat["settle"] else None,
        ),
        Row("scans (start, new runs, resync)", str(names["scan.completed"])),
        Row(
            "daemon CPU total / per job",
            f"{out.cpu_s:.1f} s / {1000 * out.cpu_s / (n + len(out.churned)):.1f} ms",
        ),
    ]


def resource_rows(out: Outcome) -> list[Row]:
    n, start = len(out.sets), out.samples[0]
    first = [x for x in out.samples if x.t <= out.first_pass.t]
    quarter = next((x for x in first if x.done >= n // 4), out.warm)
    half = next((x for x in first if x.done >= n // 2), out.first_pass)
    first_half = half.rss_kb - quarter.rss_kb
    second_half = out.first_pass.rss_kb - half.rss_kb
    churn = out.end.rss_kb - out.first_pass.rss_kb
    # Allocator arenas move by a few MB whatever happens: a floor, then a slope.
    allowed = 5 * 1024 + 5 * 1024 * len(out.churned) / 1000
    return [
        Row(
            "RSS start / warm / first pass / end",
            f"{mb(start.rss_kb)} / {mb(out.warm.rss_kb)} / {mb(out.first_pass.rss_kb)} / "
            f"{mb(out.end.rss_kb)}",
        ),
        Row("RSS peak (VmHWM)", mb(max(x.hwm_kb for x in out.samples))),
        Row(
            "RSS growth, new sets 25%->50% / 50%->100%",
            f"{first_half / 1024:+.1f} MB / {second_half / 1024:+.1f} MB",
            "2nd half <= 1st half + 20 MB",
            second_half <= max(first_half, 0) + 20 * 1024,
        ),
        Row(
            "RSS growth, redoing known sets",
            f"{churn / 1024:+.1f} MB for {len(out.churned)} jobs",
            f"<= {allowed / 1024:.1f} MB (5 MB + 5 MB per 1000 jobs)",
            churn <= allowed if out.churned else None,
        ),
        Row(
            "open fds start / warm / end",
            f"{start.fds} / {out.warm.fds} / {out.end.fds}",
            "end <= warm + 2",
            out.end.fds <= out.warm.fds + 2,
        ),
        Row(
            "threads warm / end",
            f"{out.warm.threads} / {out.end.threads}",
            "end <= warm",
            out.end.threads <= out.warm.threads,
        ),
    ]


def print_table(title: str, rows: list[Row]) -> None:
    cols = [("figure", "measured", "target", "result")] + [
        (r.figure, r.measured, r.target, r.verdict) for r in rows
    ]
    widths = [max(len(c[i]) for c in cols) for i in range(4)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(f"\n== {title} ==")
    print(line.format(*cols[0]))
    print(line.format(*("-" * w for w in widths)))
    for c in cols[1:]:
        print(line.format(*c))
    sys.stdout.flush()


def print_samples(samples: list[Sample], every_s: float) -> None:
    print("\n   t(s)   jobs    RSS(MB)  HWM(MB)  fds  threads")
    next_t = 0.0
    for s in samples:
        if s.t >= next_t or s is samples[-1]:
            print(
                f"  {s.t:6.0f} {s.done:6d} {s.rss_kb / 1024:9.1f} {s.hwm_kb / 1024:8.1f} "
                f"{s.fds:4d} {s.threads:8d}"
            )
            next_t = s.t + every_s


# ------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sets", type=int, default=2000, help="sets to write (default 2000)")
    p.add_argument("--minutes", type=float, default=5.0, help="spread over this long (5)")
    p.add_argument("--concurrency", type=int, default=16, help="[loss] concurrency (16)")
    p.add_argument("--latency-min", type=float, default=0.05, metavar="S")
    p.add_argument("--latency-max", type=float, default=0.5, metavar="S")
    p.add_argument("--settle", type=float, default=2.0, help="[loss] settle_s (2)")
    p.add_argument("--resync", type=float, default=60.0, help="resync_seconds (60)")
    p.add_argument(
        "--churn",
        type=float,
        default=0.5,
        help="then rewrite this fraction of the reported sets (0.5)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the workspace afterwards")
    p.add_argument("--dir", type=Path, default=None, help="parent folder of the workspace")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.sets < 1 or args.minutes <= 0 or not 0 <= args.latency_min <= args.latency_max:
        build_parser().error("need --sets >= 1, --minutes > 0, 0 <= latency-min <= latency-max")
    if not 0 <= args.churn <= 1:
        build_parser().error("need 0 <= --churn <= 1")
    root = Path(tempfile.mkdtemp(prefix="skilltrain-soak-", dir=args.dir))
    soak = Soak(
        root,
        args.sets,
        args.minutes,
        args.concurrency,
        args.settle,
        args.resync,
        args.seed,
        churn=args.churn,
    )
    try:
        out = run_soak(soak, (args.latency_min, args.latency_max))
        rows = figures(out, args.concurrency)  # reads the reports: before the cleanup
    except SoakError as e:
        print(f"soak could not run: {e}", file=sys.stderr)
        return 2
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print_samples(out.samples, every_s=max(5.0, args.minutes * 60 / 20))
    print_table(
        f"soak: {args.sets} sets over {args.minutes:g} min "
        f"(load {' '.join(Path('/proc/loadavg').read_text().split()[:3])})",
        rows,
    )
    return 0 if all(r.ok is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
