"""Crash loop: `skilltrain daemon` SIGKILLed again and again while it works, then let finish.

40 finished sets (2 works x 20 steps, each with `_SUCCESS`), a loopback LLM
server answering in 0.2-0.6 s, four jobs at once. The real daemon command is
killed with SIGKILL at seeded random moments, restarted each time, and finally
left to finish. Whatever moment a kill hits (interpreter start, the start-up
scan, a state database write, a job waiting for its reply, a report being
written), the end state must be the one a daemon that never crashed leaves:
one report, sidecar and prompt archive per set, each made from the files as
they are and from an answer the server really gave; no temp file; no set
asked for twice unless a kill took the first answer away.

Each incarnation pays litellm's import (~6 s) before its first request, which
is most of this test's time; kills are therefore of two kinds: "start" kills
0.3-2.0 s after the spawn (start-up scan, jobs queued behind the import) and
"work" kills 0.3-2.0 s after the incarnation's first LLM request (jobs in
flight, reports being written).
"""

from __future__ import annotations

import bisect
import json
import random
import signal
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

from skilltrain.daemon.core import dataset, state_db
from skilltrain.daemon.core.templates import PromptTemplates
from tests.daemon_helpers import (
    TEMP_PREFIX,
    DaemonProcess,
    SetId,
    Workspace,
    build_workspace,
    set_of_request,
    sha256_text,
    wait_until,
)
from tests.llm_server import DEFAULT_REPORT, LLMServer, Reply, Request

pytestmark = [pytest.mark.slow]

MODEL = "openai/loopback-model"
STEPS = 20  # x 2 works = 40 sets
CONCURRENCY = 4
LATENCY_S = (0.2, 0.6)
KILL_DELAY_S = (0.3, 2.0)
# A start kill lands within this long of the spawn: a daemon forked from the
# fork server (prewarmed) starts in a tenth of a second, so a later one is a
# work kill too, and 40 sets ran out after five kills.
START_KILL_DELAY_S = (0.0, 0.3)
KILL_SEED = 1234
# A kill is a "work" kill at even positions while enough sets are left that even
# a 2 s kill cannot finish them (the daemon does ~8 sets/s here), else a "start"
# kill: 40 sets last about four work kills, and each kill must hit a daemon with
# work left.
KILLS = 8
MIN_SETS_FOR_WORK_KILL = 16
# The child imports litellm (~6 s, far more on a cold or busy machine) before
# its first request.
FIRST_REQUEST_TIMEOUT_S = 90.0
# No incarnation sends a request this soon after its spawn (forked from the
# fork server, its first comes 0.4 s or more after it), and a killed one's last
# request reached the server before the kill returned: a request stamped later
# than this after a spawn belongs to the newer incarnation.
SPAWN_GRACE_S = 0.1


@dataclass(frozen=True)
class Served:
    set_id: str
    at: float  # time.monotonic() of the request's arrival
    mark: str  # the unique tag in the reply's text


class MarkedReplies:
    """Server responder: every reply is ok and carries a unique mark, so a
    report names the one request whose answer it is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.served: list[Served] = []

    def __call__(self, request: Request) -> Reply:
        found = set_of_request(request)
        set_id = SetId(*found).id if found else "?"
        with self._lock:
            mark = f"reply-{len(self.served):04d}"
            self.served.append(Served(set_id, request.monotonic, mark))
        return Reply.ok(f"{DEFAULT_REPORT} [{mark}]")

    def by_set(self) -> dict[str, list[Served]]:
        with self._lock:
            served = list(self.served)
        out: dict[str, list[Served]] = defaultdict(list)
        for s in served:
            out[s.set_id].append(s)
        return out


@dataclass(frozen=True)
class Kill:
    phase: str  # "start" or "work"
    first_request_s: float | None  # spawn -> first LLM request ("work" kills)
    delay_s: float  # after the spawn ("start") or the first request ("work")
    at: float  # time.monotonic() when SIGKILL was sent
    reported_before: int  # sets with a sidecar when the kill was sent
    temp_files_after: int  # interrupted atomic writes the kill left behind
    sidecars_after: frozenset[str]  # set ids with a sidecar once the process was dead


def reported(ws: Workspace, sets: list[SetId]) -> set[str]:
    return {s.id for s in sets if ws.sidecar(s).is_file()}


def assert_state_file_whole(ws: Workspace) -> None:
    """The state database survives any kill: absent, or every row readable."""
    if ws.state_file.exists():
        assert ws.state()["version"] == state_db.SCHEMA_VERSION


def assert_outputs_consistent(ws: Workspace, sets: list[SetId]) -> None:
    """Per set at most one report, archive and sidecar; a sidecar never without its report
    and archive (it is written last); nothing else in the loss folders but the
    daemon's dot-named bookkeeping (whole JSON) and temp files of interrupted writes."""
    expected: set[Path] = set()
    for s in sets:
        expected |= {ws.report(s), ws.sidecar(s), ws.archive(s)}
        if ws.sidecar(s).exists():
            assert ws.report(s).is_file() and ws.archive(s).is_file(), s.id
    written: set[Path] = set()
    for path in (p for p in ws.runs.glob("*/loss/**/*") if p.is_file()):
        if path.name.startswith(TEMP_PREFIX):
            continue  # an interrupted atomic write; the next start removes it
        if any(part.startswith(".") for part in path.relative_to(ws.runs).parts):
            # The daemon's own bookkeeping (step markers): written atomically too.
            json.loads(path.read_text(encoding="utf-8"))
            continue
        written.add(path)
    assert written <= expected, sorted(str(p) for p in written - expected)


def assert_report_made_from_current_inputs(
    ws: Workspace, s: SetId, works: dict[str, dataset.Work], template_hash: str
) -> None:
    """Recompute every input hash the sidecar claims, from the files as they are now."""
    sidecar = ws.read_sidecar(s)
    scripts = ws.scripts(s.run, s.epoch, s.step, s.work)
    model = dataset.read_range(scripts, s.first, s.last, label="model")
    human = works[s.work].read_human(s.first, s.last)
    assert sidecar["inputs"] == {
        "human_sha256": dataset.episodes_digest(human),
        "model_sha256": dataset.episodes_digest(model),
        "template_sha256": template_hash,
        "model_id": MODEL,
    }, s.id
    report = ws.report(s).read_text(encoding="utf-8")
    assert sidecar["report_sha256"] == sha256_text(report), s.id
    assert sidecar["model_episodes"] == {
        dataset.episode_name(n): sha256_text(t) for n, t in model.items()
    }, s.id
    assert (sidecar["first"], sidecar["last"], sidecar["work"]) == (s.first, s.last, s.work)


def kill_at_random_moment(
    ws: Workspace, server: LLMServer, sets: list[SetId], n: int, phase: str, delay_s: float
) -> Kill:
    """Spawn an incarnation, SIGKILL it `delay_s` after its anchor, return what was seen."""
    requests_at_spawn = server.request_count
    proc = DaemonProcess(ws, name=f"daemon{n}", prewarmed=True)
    first_request_s = None
    try:
        anchor = proc.started_at
        if phase == "work":

            def first_request() -> bool:
                assert proc.alive(), f"incarnation {n} exited: {proc.stderr()[-2000:]}"
                return server.request_count > requests_at_spawn

            wait_until(first_request, FIRST_REQUEST_TIMEOUT_S, message=f"incarnation {n}'s call")
            anchor = time.monotonic()
            first_request_s = anchor - proc.started_at
        time.sleep(max(0.0, anchor + delay_s - time.monotonic()))
        assert proc.alive(), f"incarnation {n} exited early: {proc.stderr()[-2000:]}"
        done_before = len(reported(ws, sets))
        at = time.monotonic()
        proc.signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        proc.kill()
    return Kill(
        phase,
        first_request_s,
        delay_s,
        at,
        done_before,
        len(ws.temp_files()),
        frozenset(reported(ws, sets)),
    )


def finish(ws: Workspace, sets: list[SetId], n: int) -> float:
    """The last incarnation: wait for every report and the state to say so; SIGTERM it."""
    proc = DaemonProcess(ws, name=f"daemon{n}", prewarmed=True)
    t0 = time.monotonic()
    try:

        def all_done() -> bool:
            assert proc.alive(), f"final incarnation exited: {proc.stderr()[-2000:]}"
            if len(reported(ws, sets)) < len(sets) or not ws.state_file.is_file():
                return False
            states = ws.state()["sets"]
            return all(states.get(s.id, {}).get("state") == "done" for s in sets)

        wait_until(all_done, FIRST_REQUEST_TIMEOUT_S + 30, interval=0.1, message="every report")
        took = time.monotonic() - t0
        proc.signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr()[-2000:]
    finally:
        proc.kill()
    return took


def test_sigkill_loop_leaves_exactly_one_current_report_per_set(tmp_path: Path) -> None:
    responder = MarkedReplies()
    server = LLMServer(default=responder, latency=LATENCY_S, seed=KILL_SEED).start()
    t_start = time.monotonic()
    try:
        ws = build_workspace(
            tmp_path,
            server.url,
            works={"alpha": 3, "beta": 3},
            per_report=3,
            settle_s=0.2,
            concurrency=CONCURRENCY,
        )
        sets = [
            s for step in range(1, STEPS + 1) for s in ws.write_step("r1", 1, step, success=True)
        ]
        assert len(sets) == 40

        rng = random.Random(KILL_SEED)
        kills: list[Kill] = []
        spawns: list[float] = []
        for n in range(KILLS):
            left = len(sets) - len(reported(ws, sets))
            assert left > 0, f"the work ran out after {n} kills"
            phase = "work" if n % 2 == 0 and left >= MIN_SETS_FOR_WORK_KILL else "start"
            spawns.append(time.monotonic())
            kills.append(
                kill_at_random_moment(ws, server, sets, n, phase, rng.uniform(
                    *(KILL_DELAY_S if phase == "work" else START_KILL_DELAY_S)))
            )
            assert_state_file_whole(ws)
            assert_outputs_consistent(ws, sets)
        spawns.append(time.monotonic())
        final_s = finish(ws, sets, KILLS)
        wall = time.monotonic() - t_start
    finally:
        server.stop()

    # Every kill hit a daemon with work left, and the kills were not all in one phase.
    assert len(kills) == KILLS >= 8
    assert all(k.reported_before < len(sets) for k in kills)
    assert {k.phase for k in kills} == {"start", "work"}

    # Files: exactly one report + sidecar + archive per set, nothing half-written.
    assert_outputs_consistent(ws, sets)
    assert len(ws.all_reports()) == len(sets)
    assert ws.temp_files() == []
    assert not [p for p in tmp_path.rglob(".skilltrain-tmp-*")]
    works = dataset.discover_works(ws.data)
    template_hash = PromptTemplates(ws.root / "prompts").source_hash("loss")
    for s in sets:
        assert_report_made_from_current_inputs(ws, s, works, template_hash)

    # Requests: each report is the answer to its set's last request; a set is asked
    # again only in a later incarnation, and never once its sidecar existed.
    by_set = responder.by_set()
    assert set(by_set) == {s.id for s in sets}
    for s in sets:
        served = by_set[s.id]
        text = ws.report(s).read_text(encoding="utf-8").strip()
        assert text == f"{DEFAULT_REPORT} [{served[-1].mark}]", s.id
        # The incarnation ("life") each request came from; life n ended with kill n.
        lives = [bisect.bisect_right(spawns, r.at - SPAWN_GRACE_S) - 1 for r in served]
        assert lives == sorted(set(lives)), f"{s.id} asked twice in one life: {lives}"
        for n, k in enumerate(kills):
            if s.id in k.sidecars_after:
                assert max(lives) <= n, f"{s.id} redone after kill {n} although reported"
    # Requests each kill took away: asked in the life it ended, not reported after it.
    lost_per_kill = [
        sum(
            1
            for set_id, served in by_set.items()
            for r in served
            if bisect.bisect_right(spawns, r.at - SPAWN_GRACE_S) - 1 == n
            and set_id not in k.sidecars_after
        )
        for n, k in enumerate(kills)
    ]
    requests = server.request_count
    lost = requests - len(sets)
    assert lost == sum(lost_per_kill)
    assert all(n <= CONCURRENCY for n in lost_per_kill), lost_per_kill

    summary = {
        "sets": len(sets),
        "kills": len(kills),
        "kills_by_phase": {p: sum(k.phase == p for k in kills) for p in ("start", "work")},
        "kill_delays_s": [round(k.delay_s, 2) for k in kills],
        "reported_at_each_kill": [k.reported_before for k in kills],
        "requests": requests,
        "requests_lost_to_kills": lost,
        "lost_per_kill": lost_per_kill,
        "sets_asked_more_than_once": sum(len(v) > 1 for v in by_set.values()),
        "spawn_to_first_request_s": [
            round(k.first_request_s, 1) for k in kills if k.first_request_s is not None
        ],
        "temp_files_left_by_kills": [k.temp_files_after for k in kills],
        "temp_files_cleaned_at_restarts": sum(e["temp_files"] for e in ws.events("daemon.cleaned")),
        "final_incarnation_s": round(final_s, 1),
        "wall_s": round(wall, 1),
    }
    print("crash loop:", json.dumps(summary))
