"""Issue 36's benches: the daemon at a provider's limit, and a key out of credit.

    .venv/bin/python bench/llm_bench.py limits [--sets 600] [--rate 40] [--latency 1.0]
                                               [--mode on|off|halved|quota|all]

A real `skilltrain daemon` (default config: adaptive concurrency; only
settle_s = 0 and the start-up audit off) works through N finished sets
against tests/limited_llm_server.py: R requests/s per key, one second's
burst, each reply after `latency` seconds, 429 with Retry-After when over.

on      the server states its limit in every reply (x-ratelimit-limit-/
        remaining-/reset-requests);
off     it states nothing (the daemon's AIMD alone);
halved  headers on, and R halves (stated and real limit alike) once half
        the sets are served;
quota   headers on; after a third of the sets every reply is OpenAI's
        429 insufficient_quota. Measured: from that first refusal to the
        alert's condition (skilltrain_llm_endpoint_blocked = 1 scraped from
        the daemon's /metrics) and to `skilltrain status` saying BLOCKED.

Printed for on/off/halved: the rate served in the middle 60 % of the
requests (by the server's clock) as a share of R (halved: before and after
the cut, each against the R then in force), 429s as a share of requests,
`llm.*` log lines as a share of requests, failed sets. Targets (issue 36):
>= 95 % of R with headers, >= 90 % without, 429s <= 2 %, llm.* lines <= 2 %,
no failed set.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
import urllib.request
from typing import Any

import daemon_bench as db  # bench/ is on sys.path when this file runs

from tests.daemon_helpers import config_toml  # noqa: E402
from tests.limited_llm_server import RateLimits  # noqa: E402
from tests.llm_server import LLMServer, Reply, Request  # noqa: E402

MODES = ("on", "off", "halved", "quota")
QUOTA = Reply.status(429, body={"error": {
    "message": "You exceeded your current quota, please check your plan and billing details.",
    "type": "insufficient_quota", "code": "insufficient_quota"}})
BLOCKED_GAUGE = "skilltrain_llm_endpoint_blocked{"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(ws: db.Workspace, api_base: str, metrics_port: int | None = None) -> None:
    """The default config but for what a bench needs: no settle wait, no start-up audit."""
    sections: dict[str, dict[str, Any]] = {"integrity": {"audit_on_start": False}}
    if metrics_port is not None:
        sections["metrics"] = {"listen": f"127.0.0.1:{metrics_port}"}
    ws.config.write_text(config_toml(api_base, loss={"settle_s": 0}, log_file=ws.log_file,
                                     sections=sections), encoding="utf-8")


def middle_rate(times: list[float]) -> float:
    """Requests per second over the middle 60 % of these (sorted) times."""
    if len(times) < 10:
        return 0.0
    lo, hi = int(len(times) * 0.2), int(len(times) * 0.8)
    return (hi - lo) / max(times[hi] - times[lo], 1e-9)


def rate_run(sets: int, rate: float, latency: float, mode: str) -> dict[str, Any]:
    limits = RateLimits(requests_per_s=rate, stated=mode != "off")
    server = LLMServer(default=limits, latency=(latency, latency), seed=1).start()
    halved_at: list[float] = []
    try:
        with db.workspace(f"limits-{mode}") as ws:
            total = len(db.throughput_workspace(ws, sets, server.url))
            write_config(ws, server.url)
            daemon = db.DaemonProc(ws).start()
            try:
                daemon.wait_event("daemon.ready", timeout_s=180)
                if mode == "halved":
                    def halve() -> None:
                        db.wait_until(lambda: limits.served >= total // 2, 900, "half served",
                                      poll_s=0.01)
                        halved_at.append(limits.clock())
                        limits.set_rate(rate / 2)
                    threading.Thread(target=halve, daemon=True).start()
                db.wait_until(lambda: len(daemon.find("loss.completed")) >= total, 900,
                              "every loss.completed", poll_s=0.1)
                events = daemon.events()
            finally:
                daemon.stop()
    finally:
        server.stop()
    served = sorted(limits.served_at)
    requests = limits.served + limits.limited
    llm_lines = [e for e in events if str(e.get("event", "")).startswith("llm.")]
    out: dict[str, Any] = {
        "sets": total, "requests": requests, "limited": limits.limited,
        "limited_share": limits.limited / max(requests, 1),
        "llm_lines": len(llm_lines), "llm_share": len(llm_lines) / max(requests, 1),
        "llm_kinds": sorted({str(e["event"]) for e in llm_lines}),
        "failed": sum(1 for e in events if e.get("event") == "loss.failed"),
        "rate": middle_rate(served), "wall": served[-1] - served[0] if served else 0.0,
    }
    if halved_at:
        out["rate_before"] = middle_rate([t for t in served if t < halved_at[0]])
        out["rate_after"] = middle_rate([t for t in served if t >= halved_at[0]])
    return out


def quota_run(sets: int, rate: float, latency: float) -> dict[str, Any]:
    limits = RateLimits(requests_per_s=rate)
    first_refusal: list[float] = []
    lock = threading.Lock()
    cutoff = max(1, sets // 3)

    def answer(request: Request) -> Reply:
        with lock:
            if limits.served < cutoff:
                return limits(request)
            if not first_refusal:
                first_refusal.append(time.monotonic())
        return QUOTA

    server = LLMServer(default=answer, latency=(latency, latency), seed=1).start()
    port = free_port()
    try:
        with db.workspace("limits-quota") as ws:
            db.throughput_workspace(ws, sets, server.url)
            write_config(ws, server.url, metrics_port=port)
            daemon = db.DaemonProc(ws).start()
            try:
                daemon.wait_event("daemon.ready", timeout_s=180)
                db.wait_until(lambda: bool(first_refusal), 900, "the first refusal", poll_s=0.01)
                gauge_s = status_s = None
                deadline = time.monotonic() + 600
                while (gauge_s is None or status_s is None) and time.monotonic() < deadline:
                    if gauge_s is None and gauge_blocked(port):
                        gauge_s = time.monotonic() - first_refusal[0]
                    if status_s is None and status_blocked(ws):
                        status_s = time.monotonic() - first_refusal[0]
                    time.sleep(0.05)
                blocked = daemon.find("llm.blocked")
                held = sum(1 for e in daemon.events() if e.get("event") == "loss.failed")
            finally:
                code = daemon.stop()
    finally:
        server.stop()
    return {"gauge_s": gauge_s, "status_s": status_s, "blocked_lines": len(blocked),
            "failed": held, "exit": code, "served": limits.served}


def gauge_blocked(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return False
    return any(line.startswith(BLOCKED_GAUGE) and line.rstrip().endswith(" 1.0")
               for line in text.splitlines())


def status_blocked(ws: db.Workspace) -> bool:
    out = subprocess.run([db.SKILLTRAIN, "status", "--config", str(ws.config)],
                         capture_output=True, text=True, env=db.child_env(), cwd=ws.root,
                         timeout=60)
    return "BLOCKED" in out.stdout


def seconds(s: float | None) -> str:
    return "never" if s is None else f"{s:.2f} s"


def pct(x: float) -> str:
    return f"{x:.1%}"


def bench_limits(sets: int, rate: float, latency: float, modes: list[str]) -> list[db.Row]:
    db.say(f"limits: {sets} sets, R = {rate:g} requests/s, latency {latency:g} s, "
           f"modes {', '.join(modes)}, load {db.loadavg()}")
    rows: list[db.Row] = []
    for mode in modes:
        if mode == "quota":
            q = quota_run(sets, rate, latency)
            rows += [
                db.Row("quota: first insufficient_quota 429 -> gauge blocked = 1 (alert)",
                       seconds(q["gauge_s"])),
                db.Row("  -> `skilltrain status` says BLOCKED", seconds(q["status_s"])),
                db.Row("  llm.blocked lines / loss.failed / requests served before",
                       f"{q['blocked_lines']} / {q['failed']} / {q['served']}", "1 / 0",
                       q["blocked_lines"] == 1 and q["failed"] == 0),
            ]
            continue
        r = rate_run(sets, rate, latency, mode)
        target = 0.90 if mode == "off" else 0.95
        name = {"on": "headers on", "off": "headers off", "halved": "R halved mid-run"}[mode]
        if mode == "halved":
            before, after = r.get("rate_before", 0.0) / rate, r.get("rate_after", 0.0) / (rate / 2)
            rows.append(db.Row(f"{name}: middle-60% rate before / after, share of R then",
                               f"{pct(before)} / {pct(after)} (wall {r['wall']:.1f} s)",
                               f">= {target:.0%}", min(before, after) >= target))
        else:
            rows.append(db.Row(f"{name}: middle-60% rate, share of R (wall {r['wall']:.1f} s)",
                               f"{r['rate']:.1f}/s = {pct(r['rate'] / rate)}",
                               f">= {target:.0%}", r["rate"] / rate >= target))
        rows += [
            db.Row("  429s, share of requests", f"{r['limited']} of {r['requests']} = "
                   f"{pct(r['limited_share'])}", "<= 2%", r["limited_share"] <= 0.02),
            db.Row("  llm.* log lines, share of requests",
                   f"{r['llm_lines']} = {pct(r['llm_share'])} ({', '.join(r['llm_kinds'])})",
                   "<= 2%", r["llm_share"] <= 0.02),
            db.Row("  failed sets", f"{r['failed']} of {r['sets']}", "0", r["failed"] == 0),
        ]
    return rows
