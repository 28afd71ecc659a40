"""Batch mode's 12-set run, again and again: how many requests the provider sees.

    .venv/bin/python bench/exactly_once.py [--runs 10]

6 steps x 2 sets, written at once, `[llm] mode = "batch"`, the real
`skilltrain daemon` as a child process against the loopback Files + Batches
server (tests/batch_server.py). Each run once straight through, and once
with a SIGKILL right after the first batch is created, then a restart. The
count is the server's: request lines in the batches it created (each one is
a paid request). Exactly once is 12 requests for 12 sets, every time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from tests.batch_server import BatchPlan, BatchServer  # noqa: E402
from tests.daemon_helpers import DaemonProcess, Workspace, build_workspace  # noqa: E402

STEPS = 6
FAST = {"mode": "batch", "batch_gather_s": 0.3, "batch_poll_s": 0.1, "batch_poll_max_s": 0.3}


def workspace(root: Path, server: BatchServer) -> Workspace:
    ws = build_workspace(root, server.url, works={"alpha": 6}, settle_s=0.2,
                         retry_backoff_s=0.2)
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in FAST.items())
    text = ws.config_path.read_text(encoding="utf-8")
    ws.config_path.write_text(text.replace('model = "openai/loopback-model"\n',
                                           'model = "openai/gpt-4o-mini"\n' + extra),
                              encoding="utf-8")
    for step in range(STEPS):
        ws.write_step("r1", 0, step, success=True)
    return ws


def finished(ws: Workspace) -> bool:
    sets = [s for step in range(STEPS) for s in ws.sets_of_step("r1", 0, step)]
    return all(ws.has_report(s) for s in sets) and not list(
        ws.runs.glob("r1/loss/.batches/*.json"))


def one_run(kill: bool) -> tuple[int, int, int]:
    """(requests, batches, sets) of one 12-set run."""
    with TemporaryDirectory() as tmp, BatchServer() as server:
        server.plan = BatchPlan(latency_s=0.5)
        ws = workspace(Path(tmp), server)
        sets = 2 * STEPS
        with DaemonProcess(ws, name="first") as d:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if (kill and server.creates >= 1) or finished(ws):
                    break
                time.sleep(0.005)
            if kill:
                d.kill()
        if kill:
            with DaemonProcess(ws, name="after"):
                deadline = time.monotonic() + 120
                while not finished(ws) and time.monotonic() < deadline:
                    time.sleep(0.05)
        assert finished(ws), "the run did not finish"
        return len(server.request_lines()), server.creates, sets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    for kill in (False, True):
        counts = [one_run(kill) for _ in range(args.runs)]
        label = "SIGKILL after the first create" if kill else "straight through"
        print(f"{label:32} requests per run: {[c[0] for c in counts]} "
              f"(sets: {counts[0][2]}; batches: {[c[1] for c in counts]})")
        bad = [c for c in counts if c[0] != c[2]]
        print(f"{'':32} runs with a set sent twice: {len(bad)} of {len(counts)}")


if __name__ == "__main__":
    main()
