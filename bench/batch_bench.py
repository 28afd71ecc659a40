"""Batch mode against live, one step of 12 sets, same loopback prices, per provider.

    .venv/bin/python bench/batch_bench.py [--provider openai|anthropic] [--open-s 20] [--poll-s 2]

Every mode runs the real `skilltrain daemon` as a child process against the
loopback server of the tests (tests/batch_server.py: chat completions for live
and flex, /v1/files + /v1/batches for batch; tests/anthropic_batch_server.py),
with a model id whose live, batch and (OpenAI) flex prices are in litellm's
cost map. Printed side by side: the reported cost (sum of the sidecars), batch
and flex as a share of live; the time from the sets being ready to the step's
`step.reported` (live, flex) or from the batch's completion on the server
(batch); the daemon's CPU and the provider polls while the batch is open on
the server (the daemon should idle between polls). The loopback answers flex
as fast as live: the wall times say what the daemon adds, not flex's own pace.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from tests.anthropic_batch_server import AnthropicBatchServer, AnthropicPlan  # noqa: E402
from tests.batch_server import BatchPlan, BatchServer  # noqa: E402
from tests.daemon_helpers import DaemonProcess, Workspace, build_workspace  # noqa: E402

# A priced model id of each provider (live and batch prices in litellm's cost map).
MODELS = {"openai": "openai/gpt-5-mini", "anthropic": "anthropic/claude-sonnet-4-6"}
MODEL = MODELS["openai"]
WORKS = {"alpha": 12, "beta": 12, "gamma": 12}  # 3 episodes a report: 12 sets in the step


def workspace(root: Path, server: BatchServer, mode: str, poll_s: float,
              tier: str | None = None) -> Workspace:
    ws = build_workspace(root, server.url, works=WORKS, settle_s=0.2)
    text = ws.config_path.read_text(encoding="utf-8")
    extra = (f'mode = "{mode}"\nbatch_gather_s = 1.0\nbatch_poll_s = {poll_s}\n'
             f"batch_poll_max_s = {poll_s * 4}\n"
             + (f'service_tier = "{tier}"\n' if tier else ""))
    text = text.replace('model = "openai/loopback-model"\n', f'model = "{MODEL}"\n{extra}')
    ws.config_path.write_text(text, encoding="utf-8")
    ws.write_step("r1", 0, 0, success=True)
    return ws


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wall(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def cost(ws: Workspace) -> float:
    sidecars = [json.loads(p.read_text()) for p in ws.runs.glob("r1/loss/*/*/*.json")]
    assert len(sidecars) == 12, len(sidecars)
    return sum(s["cost_usd"] or 0.0 for s in sidecars)


def server_for(provider: str, open_s: float) -> Any:
    if provider == "anthropic":
        server: Any = AnthropicBatchServer()
        server.plan = AnthropicPlan(latency_s=open_s)
    else:
        server = BatchServer()
        server.plan = BatchPlan(latency_s=open_s)
    return server


def done_at(server: Any, open_s: float) -> float:
    """Wall time the server's one batch is done (open_s after its create)."""
    if isinstance(server, AnthropicBatchServer):
        (created,) = server.batches.values()
        return created.created_at + open_s  # its wall clock
    (created,) = server.batch_list()  # its monotonic clock
    return time.time() - (time.monotonic() - (created.created_at + open_s))


def live(root: Path, poll_s: float, provider: str, tier: str | None = None) -> dict[str, float]:
    """Live calls (`tier` "flex": OpenAI's flex tier): the step's cost, and the
    wall time from its last set ready to step.reported."""
    with server_for(provider, 0.0) as server:
        ws = workspace(root, server, "live", poll_s, tier)
        with DaemonProcess(ws, "--once") as d:
            assert d.wait(300) == 0, d.stderr()[-2000:]
            ready = max(wall(e) for e in ws.events("loss.queued"))
            (reported,) = ws.events("step.reported")
        assert server.live_requests == 12
        return {"cost": cost(ws), "latency_s": wall(reported) - ready}


def batch(root: Path, open_s: float, poll_s: float, provider: str) -> dict[str, float]:
    with server_for(provider, open_s) as server:
        ws = workspace(root, server, "batch", poll_s)
        with DaemonProcess(ws) as d:
            d.wait_event("batch.submitted", 300)
            done_wall = done_at(server, open_s)
            time.sleep(1.0)  # the submit's own work done
            cpu0, polls0, t0 = cpu_s(d.pid), server.polls, time.monotonic()
            while time.monotonic() - t0 < open_s - 2.0:
                time.sleep(0.2)
            window = time.monotonic() - t0
            cpu, polls = cpu_s(d.pid) - cpu0, server.polls - polls0
            reported = d.wait_event("step.reported", 300)
            latency = wall(reported) - done_wall
        assert server.creates == 1 and len(server.billed) == 12
        return {"cost": cost(ws), "cpu_pct": 100 * cpu / window, "window_s": window,
                "polls": polls, "latency_s": latency}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--open-s", type=float, default=20.0, help="the batch stays open this long")
    parser.add_argument("--poll-s", type=float, default=2.0, help="[llm] batch_poll_s (max 4x)")
    parser.add_argument("--provider", choices=sorted(MODELS), default="openai")
    args = parser.parse_args()
    global MODEL
    MODEL = MODELS[args.provider]
    with TemporaryDirectory() as a, TemporaryDirectory() as b, TemporaryDirectory() as c:
        plain = live(Path(a), args.poll_s, args.provider)
        got = batch(Path(b), args.open_s, args.poll_s, args.provider)
        # Flex is OpenAI's alone (Anthropic has no such tier).
        flex = live(Path(c), args.poll_s, args.provider, "flex") \
            if args.provider == "openai" else None
    dash = f"{'-':>12}"

    def share(x: dict[str, float] | None) -> str:
        return f"{x['cost'] / plain['cost']:>12.3f}" if x else dash

    print(f"12 sets, {MODEL} prices, loopback; batch open {args.open_s:g} s, "
          f"batch_poll_s {args.poll_s:g} (max {args.poll_s * 4:g})")
    print(f"{'figure':<58} {'live':>12} {'batch':>12} {'flex':>12}")
    print(f"{'reported cost of the step, USD':<58} {plain['cost']:>12.6f} "
          f"{got['cost']:>12.6f} " + (f"{flex['cost']:>12.6f}" if flex else dash))
    print(f"{'cost / live (target 0.5)':<58} {'':>12} {share(got)} {share(flex)}")
    print(f"{'last set ready -> step.reported, s (live, flex)':<58} "
          f"{plain['latency_s']:>12.2f} {'':>12} " + (f"{flex['latency_s']:>12.2f}"
                                                        if flex else dash))
    print(f"{'batch completed on the server -> step.reported, s':<58} {'':>12} "
          f"{got['latency_s']:>12.2f}")
    print(f"{'daemon CPU while the batch is open, % of a core (< 0.5)':<58} {'':>12} "
          f"{got['cpu_pct']:>12.3f}")
    print(f"{'provider polls in that window of ' + format(got['window_s'], '.0f') + ' s':<58} "
          f"{'':>12} {got['polls']:>12.0f}")


if __name__ == "__main__":
    main()
