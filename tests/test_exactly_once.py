"""Exactly once: a set is sent once per version of its inputs, whatever looks at it meanwhile.

One claim holds a set from the look that decides it needs a report until
its outcome is recorded (daemon/service/owner.py). A look that arrives
meanwhile -- a hint, a resync, a settle look -- is remembered, not queued.
Counted from the loopback server's own log, not from our events.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.batch_server import BatchPlan, BatchServer
from tests.daemon_helpers import (
    DaemonProcess,
    Workspace,
    build_workspace,
    mark_success,
    model_episode,
    wait_until,
)
from tests.daemon_marks import DAEMON_TEST_MARKS

pytestmark = DAEMON_TEST_MARKS

BATCH = {"mode": "batch", "batch_gather_s": 0.3, "batch_poll_s": 0.1, "batch_poll_max_s": 0.3}


@pytest.fixture
def server() -> Iterator[BatchServer]:
    with BatchServer() as s:
        yield s


def batch_workspace(tmp_path: Path, server: BatchServer, *, mode: str = "batch",
                    **kwargs: Any) -> Workspace:
    ws = build_workspace(tmp_path, server.url, works={"alpha": 6, "beta": 3}, settle_s=0.2,
                         retry_backoff_s=0.2, **kwargs)
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in {**BATCH, "mode": mode}.items())
    text = ws.config_path.read_text(encoding="utf-8")
    ws.config_path.write_text(text.replace('model = "openai/loopback-model"\n',
                                           'model = "openai/gpt-4o-mini"\n' + extra),
                              encoding="utf-8")
    return ws


def requests_per_set(server: BatchServer) -> Counter[str]:
    """The sets the server was asked for, from the request bodies (work and episodes)."""
    asked: Counter[str] = Counter()
    for line in server.request_lines():
        text = json.dumps(line["body"]["messages"])
        asked[" ".join(sorted(set(_episode_marks(text))))] += 1
    return asked


def _episode_marks(text: str) -> Iterator[str]:
    # Each model episode's first line names it (tests/daemon_helpers.model_episode).
    yield from re.findall(r"SETMARK \S+ epoch=\d+ step=\d+ work=\w+ ep=\d+", text)


def test_a_look_while_a_gathered_step_waits_its_turn_sends_nothing_twice(
        tmp_path: Path, server: BatchServer, start: Any) -> None:
    """Steps 1 and 2 are taken together for sending; step 1's upload is slow; a
    resync meanwhile looks at step 2's sets, which are out of the gathering
    but not yet in a record. They must not be queued (and paid for) again."""
    ws = batch_workspace(tmp_path, server)
    first, second = threading.Event(), threading.Event()
    server.plan = BatchPlan(hold_after_upload=first)
    ws.write_step("r1", 0, 0, success=True)
    d = start(ws)
    wait_until(lambda: server.uploads == 1, 30, message="step 0's upload")
    # While the batch thread waits on step 0's upload, steps 1 and 2 are gathered.
    ws.write_step("r1", 0, 1, success=True)
    ws.write_step("r1", 0, 2, success=True)
    later = [s.id for step in (1, 2) for s in ws.sets_of_step("r1", 0, step)]

    def gathered() -> bool:
        state = d.daemon.state
        return all((r := state.get(i)) is not None and r.state.value == "queued" for i in later)

    wait_until(gathered, 30, message="steps 1 and 2 gathered")
    server.plan = BatchPlan(hold_after_upload=second)  # step 1's upload will wait
    first.set()
    wait_until(lambda: server.uploads == 2, 30, message="step 1's upload")
    d.daemon.reconcile.scan()  # a resync while step 2 waits its turn
    second.set()
    wait_until(lambda: len(ws.events("step.reported")) == 3, 60, message="three steps reported")
    wait_until(lambda: not list(ws.runs.glob("r1/loss/.batches/*.json")), 10,
               message="every batch closed")
    sets = [s for step in range(3) for s in ws.sets_of_step("r1", 0, step)]
    assert len(server.request_lines()) == len(sets), requests_per_set(server)
    assert server.creates == 3
    completed = Counter(e["range"] + e["step"].__str__() + e["work"]
                        for e in ws.events("loss.completed"))
    assert len(completed) == len(sets) and set(completed.values()) == {1}, completed


# ---------------------------------------------------------------- the stress test
ROUNDS = 4
SEED = int(os.environ.get("SKILLTRAIN_STRESS_SEED", "33"))  # more rounds by hand: other seeds


def _set_versions(body: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    """(the set, the versions of its episodes) a request was made from."""
    text = json.dumps(body["messages"])
    marks = sorted(set(re.findall(
        r"SETMARK (\S+) epoch=(\d+) step=(\d+) work=(\w+) ep=(\d+) v=(\d+)", text)))
    assert marks, "a request without the episodes' marks"
    run, epoch, step, work, first, _ = marks[0]
    return f"{run}/{epoch}/{step}/{work}/{first}", tuple(int(m[5]) for m in marks)


def _write_episodes(ws: Workspace, run: str, step: int, version: int,
                    works: list[str] | None = None) -> None:
    for work in works or sorted(ws.works):
        scripts = ws.scripts(run, 0, step, work)
        scripts.mkdir(parents=True, exist_ok=True)
        for ep in range(1, ws.works[work] + 1):
            text = model_episode(run, 0, step, work, ep, version)
            head = f"SETMARK {run} epoch=0 step={step} work={work} ep={ep}"
            (scripts / f"ep{ep:02d}.txt").write_text(
                text.replace(head, f"{head} v={version}", 1), encoding="utf-8")
        mark_success(scripts)


@pytest.mark.slow
def test_sigkills_looks_and_resyncs_never_send_a_version_of_a_set_twice(
        tmp_path: Path, server: BatchServer) -> None:
    """Two runs, one live and one in batch mode, against the same loopback server.
    Each round starts the real daemon, writes a new step in both runs, sometimes
    rewrites an earlier step (a new version of its episodes) or touches its
    `_SUCCESS` (a look), resyncs every second, and SIGKILLs the daemon at a
    random moment; a last round lets it finish. Counted from the server's log:
    every version of a set is in one batch request at most, and sent live at
    most once by each daemon (a call in flight when its daemon is killed is
    paid and lost: a new daemon cannot know it was made)."""
    rng = random.Random(SEED)
    ws = batch_workspace(tmp_path, server, mode="live", resync_s=1.0)
    live_run, batch_run = "live", "cheap"
    (ws.runs / batch_run).mkdir(parents=True)
    (ws.runs / batch_run / "run.toml").write_text('[llm]\nmode = "batch"\n', encoding="utf-8")
    server.plan = BatchPlan(latency_s=0.8)
    versions: dict[tuple[str, int], int] = {}
    for era in range(ROUNDS + 1):
        server.era = era
        with DaemonProcess(ws, prewarmed=True, name=f"daemon{era}") as d:
            d.wait_event("daemon.started", 60, pid=d.pid)
            if era == ROUNDS:
                wait_until(lambda: _all_done(ws, versions), 120,
                           message=lambda: f"every set done; {d.stderr()[-600:]}")
                break
            for run in (live_run, batch_run):
                versions[(run, era)] = 0
                _write_episodes(ws, run, era, 0)
            time.sleep(rng.uniform(0.0, 1.5))
            if era and rng.random() < 0.6:  # a new version of an earlier step
                run, step = rng.choice([k for k in versions if k[1] < era])
                versions[(run, step)] += 1
                _write_episodes(ws, run, step, versions[(run, step)])
            for run, step in versions:  # looks at every step: hints beside the resyncs
                if rng.random() < 0.5:
                    mark_success(ws.scripts(run, 0, step, "alpha"))
            time.sleep(rng.uniform(0.2, 3.0))
            d.kill()

    print(f"{server.creates} batches, {len(server.request_lines())} batch requests, "
          f"{len(server.live_log)} live requests, versions {versions}")
    batch_sent = Counter(_set_versions(line["body"]) for line in server.request_lines())
    assert batch_sent and max(batch_sent.values()) == 1, [k for k, n in batch_sent.items()
                                                          if n > 1]
    live_sent = Counter((era, *_set_versions(body)) for era, body in server.live_log)
    assert live_sent and max(live_sent.values()) == 1, [k for k, n in live_sent.items() if n > 1]
    assert all(key.startswith(f"{batch_run}/") for key, _ in batch_sent)
    assert all(key.startswith(f"{live_run}/") for _, key, _ in live_sent)
    # Every set's last version was sent, in its run's transport.
    for (run, step), version in versions.items():
        for s in ws.sets_of_step(run, 0, step):
            key = f"{run}/0/{step}/{s.work}/{s.first}"
            wanted = (key, (version,) * (s.last - s.first + 1))
            assert wanted in batch_sent or any(k[1:] == wanted for k in live_sent), wanted


def _all_done(ws: Workspace, versions: dict[tuple[str, int], int]) -> bool:
    """Every set's report is of its last version, and no batch is open."""
    if list(ws.runs.glob("*/loss/.batches/*.json")):
        return False
    if not ws.state_file.exists():
        return False
    sets = ws.state().get("sets", {})
    return all(sets.get(s.id, {}).get("state") == "done"
               for run, step in versions for s in ws.sets_of_step(run, 0, step))
