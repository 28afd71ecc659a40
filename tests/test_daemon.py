"""The daemon end to end, in-process: real trees, real watcher, real scheduler, real LLM calls.

Each test builds its own workspace under tmp_path (data/, prompts/, runs/,
config.toml), starts a real `Daemon` (watchdog observer, APScheduler, the
loss handler, litellm over HTTP to the loopback server) and drives it the way
writers do: slow streams, rsync renames, cp overwrites, mv from outside,
`_SUCCESS`. Assertions read what an operator would: files under runs/, the
JSON log, the state file, and what the LLM server received.

Invariant checked everywhere: one LLM request per set per distinct input,
and a report is always made from the final content of its episodes.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from watchdog.observers.api import BaseObserver

from skilltrain.daemon.commands import status
from skilltrain.daemon.core.errors import ExitCode
from tests.daemon_helpers import (
    WRITERS,
    ConcurrencyProbe,
    SetId,
    Start,
    Workspace,
    build_workspace,
    mark_success,
    model_episode,
    remove_tree,
    requested_sets,
    run_once_in_process,
    sha256_text,
    stays,
    wait_until,
    write_cp,
    write_slowly,
    write_step_with,
)
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.llm_server import DEFAULT_REPORT, LLMServer, Reply, Request

pytestmark = DAEMON_TEST_MARKS


def all_reported(ws: Workspace, sets: list[SetId]) -> bool:
    return all(ws.has_report(s) for s in sets)


def assert_reports_match_final_content(ws: Workspace, sets: list[SetId]) -> None:
    """Each report's sidecar names the hash of each episode as it is on disk now."""
    for s in sets:
        sidecar = ws.read_sidecar(s)
        scripts = ws.scripts(s.run, s.epoch, s.step, s.work)
        for ep in range(s.first, s.last + 1):
            name = f"ep{ep:02d}.txt"
            on_disk = sha256_text((scripts / name).read_text(encoding="utf-8"))
            assert sidecar["model_episodes"][name] == on_disk, f"{s.id} {name}: stale content"
        assert ws.report(s).read_text(encoding="utf-8").strip() == DEFAULT_REPORT


def set_events(ws: Workspace, name: str, s: SetId) -> list[dict[str, Any]]:
    return ws.events(
        name,
        run=s.run,
        epoch=s.epoch,
        step=s.step,
        work=s.work,
        range=f"{s.first:02d}-{s.last:02d}",
    )


def scans(ws: Workspace) -> int:
    return len(ws.events("scan.completed"))


def no_errors(ws: Workspace) -> None:
    """No internal error and no traceback anywhere in the log."""
    bad = [
        e
        for e in ws.events()
        if e.get("event") in ("set.error", "watch.handler_error", "daemon.failed")
        or "exception" in e
    ]
    assert not bad, bad


# ------------------------------------------------------------------ completeness


def test_incomplete_range_waits_and_never_calls_the_llm(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 6, "beta": 3}, resync_s=1.0)
    scripts = ws.scripts("r1", 1, 1, "alpha")
    scripts.mkdir(parents=True)
    for ep in (1, 3, 4, 5, 6):  # ep02 never arrives
        (scripts / f"ep{ep:02d}.txt").write_text(model_episode("r1", 1, 1, "alpha", ep))
    beta = ws.scripts("r1", 1, 1, "beta")
    beta.mkdir(parents=True)
    (beta / "ep01.txt").write_text(model_episode("r1", 1, 1, "beta", 1))
    (beta / "ep02.txt").write_bytes(b"")  # created, never written
    (beta / "ep03.txt").write_text(model_episode("r1", 1, 1, "beta", 3))
    mark_success(scripts)  # "finished" says the writer, but the range has a hole
    mark_success(beta)
    waiting_alpha = SetId("r1", 1, 1, "alpha", 1, 3)
    waiting_beta = SetId("r1", 1, 1, "beta", 1, 3)
    ready = SetId("r1", 1, 1, "alpha", 4, 6)

    d = start(ws)
    wait_until(lambda: ws.has_report(ready), 20, message="the complete range's report")
    first = scans(ws)
    wait_until(lambda: scans(ws) >= first + 1, 10, message="a resync scan")

    assert requested_sets(llm_server) == [ready.id]
    assert not ws.has_report(waiting_alpha) and not ws.has_report(waiting_beta)
    d.daemon.state.flush(force=True)
    sets = {row["set"]: row for row in status.collect(ws.runs)["sets"]}
    assert sets[waiting_alpha.id]["state"] == "waiting"
    assert "ep02.txt missing" in sets[waiting_alpha.id]["reason"]
    assert sets[waiting_beta.id]["state"] == "waiting"
    assert "ep02.txt is empty" in sets[waiting_beta.id]["reason"]
    assert sets[ready.id]["state"] == "done"
    assert ws.events("step.reported") == []  # the step is not finished
    no_errors(ws)


# ----------------------------------------------------------------------- writers


def test_slow_writer_is_not_picked_up_before_it_finishes(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, settle_s=1.0)
    start(ws)
    scripts = ws.scripts("r1", 1, 1, "alpha")
    scripts.mkdir(parents=True)
    for ep in (1, 2):
        (scripts / f"ep{ep:02d}.txt").write_text(model_episode("r1", 1, 1, "alpha", ep))
    final = model_episode("r1", 1, 1, "alpha", 3) * 3
    # 7 pieces over 2.4 s: a pause of 0.4 s, well inside settle_seconds = 1.
    write_slowly(scripts / "ep03.txt", final, seconds=2.4, chunks=7)
    last_write = (scripts / "ep03.txt").stat().st_mtime
    s = SetId("r1", 1, 1, "alpha", 1, 3)

    wait_until(lambda: ws.has_report(s), 15, message="the report")
    assert llm_server.request_count == 1
    request = llm_server.requests[0]
    assert request.wall >= last_write + 0.99, "picked up before the file settled"
    assert ws.read_sidecar(s)["model_episodes"]["ep03.txt"] == sha256_text(final)
    assert_reports_match_final_content(ws, [s])
    assert stays(lambda: llm_server.request_count == 1, 0.5)


def test_every_kind_of_writer_gets_one_report_from_its_final_content(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    """slow stream, plain, rsync temp+rename, cp in place, mv of a file, a work,
    a step and a whole run folder from outside runs/; all at once."""
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3, "beta": 3}, settle_s=0.7)
    start(ws)
    expected: dict[str, list[SetId]] = {}

    def write(i: int, style: str) -> None:
        run = "moved" if style == "mv_run" else "w"
        # slow: 4 pieces 0.1 s apart per file; rsync: 3 pieces of the temp file.
        expected[style] = write_step_with(ws, run, 1, i + 1, style, slow_s=0.3)

    threads = [threading.Thread(target=write, args=(i, style)) for i, style in enumerate(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    sets = [s for style in WRITERS for s in expected[style]]
    assert len(sets) == 2 * len(WRITERS)

    wait_until(
        lambda: all_reported(ws, sets),
        20,
        message=lambda: (
            "reports for "
            + ", ".join(f"{st}" for st in WRITERS if not all_reported(ws, expected[st]))
        ),
    )
    assert stays(lambda: llm_server.request_count == len(sets), 0.5)
    assert Counter(requested_sets(llm_server)) == Counter(s.id for s in sets)
    assert_reports_match_final_content(ws, sets)
    # No temp or stray name ever became a set, and nothing was ignored.
    assert ws.events("set.ignored") == []
    assert ws.temp_files() == []
    assert ws.events("watch.fallback") == []
    no_errors(ws)


def test_success_marker_is_picked_up_at_once_without_waiting_to_settle(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, settle_s=30.0)
    d = start(ws)
    sets = write_step_with(ws, "r1", 1, 1, "plain")
    # Without the marker, settle_seconds = 30 holds the set back.
    assert stays(lambda: llm_server.request_count == 0, 1.0)
    assert d.daemon.state.get(sets[0].id).state == "settling"

    t0 = time.monotonic()
    mark_success(ws.scripts("r1", 1, 1, "alpha"))
    wait_until(lambda: llm_server.request_count >= 1, 5, message="the LLM request")
    pickup = llm_server.requests[0].monotonic - t0
    wait_until(lambda: all_reported(ws, sets), 5, message="the report")
    done = time.monotonic() - t0
    print(f"_SUCCESS pickup latency: request after {pickup:.3f}s, report after {done:.3f}s")
    assert pickup < 3.0
    assert llm_server.request_count == 1
    wait_until(lambda: ws.events("step.reported"), 5, message="step.reported")
    assert stays(lambda: len(ws.events("step.reported")) == 1, 0.2)


# ------------------------------------------------------------------------- scale


def test_three_runs_in_parallel_each_set_reported_exactly_once(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    """3 runs x 2 epochs x 2 steps x 2 works, written concurrently with _SUCCESS."""
    ws = build_workspace(
        tmp_path, llm_server.url, works={"alpha": 6, "beta": 3}, settle_s=30.0, concurrency=4
    )
    start(ws)
    steps = [(run, e, st) for run in ("r1", "r2", "r3") for e in (1, 2) for st in (1, 2)]
    styles = ["plain", "rsync", "cp", "slow", "mv_file", "mv_work"]
    written: dict[tuple[str, int, int], list[SetId]] = {}

    def write(i: int, key: tuple[str, int, int]) -> None:
        written[key] = write_step_with(ws, *key, styles[i % len(styles)], success=True, slow_s=0.3)

    t0 = time.monotonic()
    threads = [threading.Thread(target=write, args=(i, k)) for i, k in enumerate(steps)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    sets = [s for key in steps for s in written[key]]
    assert len(sets) == 12 * 3

    wait_until(lambda: all_reported(ws, sets), 40, message="every report")
    elapsed = time.monotonic() - t0
    wait_until(lambda: len(ws.events("step.reported")) == len(steps), 5, message="step.reported")
    print(f"{len(sets)} sets reported {elapsed:.2f}s after the writers started")
    assert stays(lambda: llm_server.request_count == len(sets), 0.5)
    assert Counter(requested_sets(llm_server)) == Counter(s.id for s in sets)
    reported = Counter((e["run"], e["epoch"], e["step"]) for e in ws.events("step.reported"))
    assert reported == Counter(steps)
    assert {e["sets"] for e in ws.events("step.reported")} == {3}
    assert len(ws.events("loss.completed")) == len(sets)
    assert_reports_match_final_content(ws, sets)
    assert ws.temp_files() == []
    assert ws.events("watch.fallback") == []
    no_errors(ws)


def test_concurrency_bound_is_never_exceeded(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 6}, concurrency=2)
    probe = ConcurrencyProbe(hold_s=0.5)
    llm_server.default = probe
    sets = [s for st in (1, 2, 3) for s in ws.write_step("r1", 1, st, success=True)]
    assert len(sets) == 6

    t0 = time.monotonic()
    start(ws)
    wait_until(lambda: all_reported(ws, sets), 20, message="six reports")
    elapsed = time.monotonic() - t0
    print(f"6 sets x 0.5 s at concurrency 2: {elapsed:.2f}s, max in flight {probe.max_in_flight}")
    assert probe.total == 6
    assert probe.max_in_flight == 2  # bounded, and the bound is used
    # The same from the server's clock: no request started while two were open.
    starts = sorted(r.monotonic for r in llm_server.requests)
    assert all(b - a >= 0.45 for a, b in zip(starts, starts[2:], strict=False))


# ---------------------------------------------------------------------- rewrites


def test_rewritten_episode_is_redone_exactly_once(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 6}, settle_s=0.5)
    sets = ws.write_step("r1", 1, 1)
    first, second = sets
    start(ws)
    wait_until(lambda: all_reported(ws, sets), 20, message="the first reports")
    assert stays(lambda: llm_server.request_count == 2, 0.3)
    untouched_mtime = ws.report(second).stat().st_mtime_ns
    old_sidecar = ws.read_sidecar(first)

    # cp over ep02 in place, in three pieces.
    path = ws.scripts("r1", 1, 1, "alpha") / "ep02.txt"
    write_cp(path, model_episode("r1", 1, 1, "alpha", 2, version=1))
    wait_until(
        lambda: ws.read_sidecar(first)["inputs"] != old_sidecar["inputs"],
        10,
        message="the redone report",
    )
    assert stays(lambda: llm_server.request_count == 3, 0.7)
    assert requested_sets(llm_server)[-1] == first.id
    assert len(set_events(ws, "set.stale", first)) == 1
    assert set_events(ws, "set.stale", second) == []
    assert ws.report(second).stat().st_mtime_ns == untouched_mtime
    assert_reports_match_final_content(ws, sets)
    # The optimizer may have learnt from the replaced report: reported again.
    first_report, again = ws.events("step.reported")
    assert "again" not in first_report and again["again"] is True


def test_copy_that_keeps_an_old_mtime_is_still_redone_once(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    """`cp -p` / `rsync -t`: new content, mtime from the past. Still a change."""
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, settle_s=0.5)
    sets = ws.write_step("r1", 1, 1)
    start(ws)
    wait_until(lambda: all_reported(ws, sets), 20, message="the first report")
    path = ws.scripts("r1", 1, 1, "alpha") / "ep03.txt"
    write_cp(
        path, model_episode("r1", 1, 1, "alpha", 3, version=7), keep_mtime_of=time.time() - 3600
    )
    wait_until(lambda: llm_server.request_count == 2, 10, message="the redo")
    assert stays(lambda: llm_server.request_count == 2, 0.7)
    wait_until(lambda: all_reported(ws, sets), 5, message="the report")
    assert_reports_match_final_content(ws, sets)


def test_success_marker_older_than_a_rewrite_does_not_skip_the_settle_wait(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    """A writer re-runs a step and streams ep02 anew; the old _SUCCESS is still there."""
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, settle_s=0.6)
    sets = ws.write_step("r1", 1, 1, success=True)
    start(ws)
    wait_until(lambda: all_reported(ws, sets), 20, message="the first report")
    final = model_episode("r1", 1, 1, "alpha", 2, version=5) * 2
    # 6 pieces over 0.75 s (0.15 s apart, inside settle_seconds = 0.6).
    write_slowly(ws.scripts("r1", 1, 1, "alpha") / "ep02.txt", final, seconds=0.75, chunks=6)
    wait_until(
        lambda: ws.read_sidecar(sets[0])["model_episodes"]["ep02.txt"] == sha256_text(final),
        10,
        message="the report of the final text",
    )
    assert stays(lambda: llm_server.request_count == 2, 0.8), (
        f"{llm_server.request_count - 1} reports for one rewrite, "
        "all but the last of a half-written ep02.txt"
    )


def test_touch_without_a_change_is_not_redone(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, settle_s=0.5)
    sets = ws.write_step("r1", 1, 1)
    d = start(ws)
    # The report is on disk a moment before the state says done: wait for what is asserted.
    before = wait_until(
        lambda: (rec := d.daemon.state.get(sets[0].id)) is not None and rec.state == "done"
        and all_reported(ws, sets) and rec,
        20,
        message="the first report, recorded done",
    )
    recorded = before.fingerprint
    os.utime(ws.scripts("r1", 1, 1, "alpha") / "ep01.txt", (time.time() + 5, time.time() + 5))
    # The daemon looked (its recorded stat fingerprint moved on) and found it up to date.
    wait_until(
        lambda: (
            (rec := d.daemon.state.get(sets[0].id)) is not None
            and rec.state == "done"
            and rec.fingerprint != recorded
        ),
        5,
        message="the touched file's new signature recorded",
    )
    assert stays(lambda: llm_server.request_count == 1, 0.7)
    assert ws.events("set.stale") == []


# ----------------------------------------------------------------------- restart


@pytest.mark.parametrize("state_kept", [True, False], ids=["state-kept", "state-lost"])
def test_restart_on_a_fully_reported_tree_makes_no_request(
    tmp_path: Path, llm_server: LLMServer, start: Start, state_kept: bool
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 6, "beta": 3})
    sets = [s for st in (1, 2) for s in ws.write_step("r1", 1, st, success=True)]
    run_once_in_process(ws)
    assert all_reported(ws, sets) and llm_server.request_count == len(sets)
    if not state_kept:
        ws.state_file.unlink()  # e.g. runs/ restored from a backup without .skilltrain/
    before = llm_server.request_count
    log_lines = len(ws.events())

    d = start(ws)  # its startup scan has evaluated every set when start() returns
    assert stays(lambda: llm_server.request_count == before, 0.5)
    new = ws.events()[log_lines:]
    assert [e["event"] for e in new if e["event"].startswith("loss.")] == []
    assert all(d.daemon.state.get(s.id).state == "done" for s in sets)
    # Not again, even with state.json gone: the step marker next to the reports says so.
    assert [e for e in new if e["event"] == "step.reported"] == []


def test_restart_on_a_half_processed_tree_requests_only_the_missing(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 6, "beta": 3})
    sets = [s for st in (1, 2) for s in ws.write_step("r1", 1, st, success=True)]
    run_once_in_process(ws)
    assert llm_server.request_count == len(sets) == 6
    no_report, no_sidecar = sets[0], sets[4]
    ws.report(no_report).unlink()
    ws.sidecar(no_sidecar).unlink()  # a report without its sidecar is not trusted
    llm_server.clear()

    start(ws)
    wait_until(lambda: all_reported(ws, sets), 20, message="the missing reports")
    assert stays(lambda: llm_server.request_count == 2, 0.5)
    assert sorted(requested_sets(llm_server)) == sorted([no_report.id, no_sidecar.id])
    assert_reports_match_final_content(ws, sets)


# -------------------------------------------------------------------- lost events


@pytest.mark.parametrize("observer", ["auto", "polling"])
def test_files_written_before_start_are_found_by_the_startup_scan(
    tmp_path: Path, llm_server: LLMServer, start: Start, observer: str
) -> None:
    ws = build_workspace(
        tmp_path, llm_server.url, works={"alpha": 3}, settle_s=0.5, observer=observer
    )
    before = ws.write_step("r1", 1, 1)
    d = start(ws)
    assert ws.events("daemon.ready")[-1]["observer"] == (
        "polling" if observer == "polling" else "native"
    )
    wait_until(lambda: all_reported(ws, before), 20, message="the report of the old files")
    # The live watcher (inotify or polling) sees new files; resync_seconds is 600.
    t0 = time.monotonic()
    after = write_step_with(ws, "r1", 1, 2, "rsync", slow_s=0.2)
    wait_until(lambda: all_reported(ws, after), 10, message="the report of the new files")
    print(f"{observer}: new files reported after {time.monotonic() - t0:.2f}s")
    assert stays(lambda: llm_server.request_count == 2, 0.3)
    assert d.daemon.watcher.kind == ("polling" if observer == "polling" else "native")


def test_periodic_resync_catches_what_no_watcher_reported(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, settle_s=0.5, resync_s=1.0)
    # No main loop: it would (rightly) stop a daemon whose watcher died.
    d = start(ws, loop=False)
    d.daemon.watcher.stop()  # every event from now on is lost
    t0 = time.monotonic()
    sets = ws.write_step("r1", 1, 1)
    wait_until(lambda: all_reported(ws, sets), 10, message="the report via resync")
    print(f"resync pickup without a watcher: {time.monotonic() - t0:.2f}s")
    assert scans(ws) >= 2
    assert llm_server.request_count == 1


def test_watcher_death_stops_the_daemon_with_its_exit_code(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3})
    d = start(ws)
    assert d.daemon.healthy()
    (observer,) = [t for t in threading.enumerate() if isinstance(t, BaseObserver)]
    observer.stop()  # the observer thread ends under the daemon's feet
    observer.join(timeout=5)
    assert not d.daemon.healthy()  # the systemd watchdog is no longer fed
    assert "the filesystem watcher is not running" in d.daemon.health_problems()
    wait_until(d.daemon.stop_event.is_set, 5, message="the daemon to notice")
    assert d.daemon.exit_code == ExitCode.WATCHER_DIED
    assert ws.events("watch.died")


# ------------------------------------------------------------------------ strays


def test_stray_files_and_folders_are_ignored_and_the_daemon_keeps_going(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, settle_s=0.5, resync_s=1.0)
    good = ws.write_step("r1", 1, 1)
    scripts = ws.scripts("r1", 1, 1, "alpha")
    for name in (
        ".ep01.txt.Xa91Qz",
        ".ep02.txt.swp",
        "ep03.txt~",
        "ep04.txt.tmp",
        "ep1.txt",
        "notes.txt",
        "ep04.txt",
        "_SUCCESS.tmp",
    ):
        (scripts / name).write_text("stray " + name)
    one_digit = ws.scripts("r1", 1, 2, "alpha")
    one_digit.mkdir(parents=True)
    for ep in (1, 2, 3):
        (one_digit / f"ep{ep}.txt").write_text(model_episode("r1", 1, 2, "alpha", ep))
    # The answer key, linked into runs/: never followed out of runs/.
    linked = ws.scripts("r1", 1, 3, "alpha")
    linked.mkdir(parents=True)
    for ep in (1, 2, 3):
        (linked / f"ep{ep:02d}.txt").symlink_to(ws.data / "alpha" / "human" / f"ep{ep:02d}.txt")
    strays = {
        ws.step_dir("r1", 1, 1) / "zeta": "unknown work",
        ws.runs / "r1" / "epochX": "not an epoch_NN folder",
        ws.runs / "r1" / "epoch_01" / "stepY": "not a step_NN folder",
    }
    for folder in strays:
        target = folder if folder.name == "zeta" else folder / "step_01" / "alpha"
        if folder.name == "stepY":
            target = folder / "alpha"
        (target / "scripts").mkdir(parents=True)
        for ep in (1, 2, 3):
            (target / "scripts" / f"ep{ep:02d}.txt").write_text("stray episode")
    (ws.runs / "README.txt").write_text("not a run")
    (ws.runs / "r1" / "notes.txt").write_text("not an epoch")

    d = start(ws)
    wait_until(lambda: all_reported(ws, good), 20, message="the one good report")
    first = scans(ws)
    wait_until(lambda: scans(ws) >= first + 1, 10, message="another scan")

    assert requested_sets(llm_server) == [good[0].id]
    ignored = Counter(e["path"] for e in ws.events("set.ignored"))
    assert set(ignored) == {str(p) for p in strays}, ignored
    assert set(ignored.values()) == {1}, "set.ignored must be logged once, not per scan"
    for e in ws.events("set.ignored"):
        assert strays[Path(e["path"])] in e["reason"]
    reasons = {set_id: rec.reason or "" for set_id, rec in d.daemon.state.sets.items()}
    assert "ep01.txt missing" in reasons["r1/epoch_01/step_02/alpha/01-03"]
    # The links lead to the answer key itself: refused as such, naming the link.
    assert "leads into the answer key" in reasons["r1/epoch_01/step_03/alpha/01-03"]

    # Still alive and working.
    later = ws.write_step("r1", 2, 1)
    wait_until(lambda: all_reported(ws, later), 10, message="a later report")
    assert d.daemon.watcher.alive() and not d.daemon.stop_event.is_set()
    assert llm_server.request_count == 2
    no_errors(ws)


# ---------------------------------------------------------------------- failures


def test_failing_set_is_retried_with_backoff_up_to_max_attempts(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(
        tmp_path,
        llm_server.url,
        works={"alpha": 3, "beta": 3},
        max_attempts=3,
        retry_backoff_s=0.3,
        resync_s=1.0,
    )
    failing = {"on": True}

    def beta_fails(request: Request) -> Reply:
        text = str(request.body)
        if failing["on"] and "work=beta" in text:
            return Reply.status(500)
        return Reply.ok(DEFAULT_REPORT)

    llm_server.default = beta_fails
    alpha, beta = ws.write_step("r1", 1, 1, success=True)
    d = start(ws)
    wait_until(lambda: ws.has_report(alpha), 20, message="the healthy work's report")
    wait_until(lambda: len(set_events(ws, "loss.failed", beta)) == 3, 15, message="3 failures")
    wait_until(lambda: (r := d.daemon.state.get(beta.id)) is not None and r.attempts == 3, 5)
    first = scans(ws)
    wait_until(lambda: scans(ws) >= first + 1, 10, message="a scan after giving up")

    # max_retries = 1: two HTTP requests per attempt, three attempts, then no more.
    beta_requests = [r for r in llm_server.requests if "work=beta" in str(r.body)]
    assert len(beta_requests) == 6
    assert requested_sets(llm_server).count(alpha.id) == 1
    failures = set_events(ws, "loss.failed", beta)
    assert [f["attempts"] for f in failures] == [1, 2, 3]
    assert failures[-1]["next_retry_s"] is None
    # Backoff doubles: the wait from a failure to the next attempt is 0.3 s, then 0.6 s
    # (x0.8..1.2 jitter).
    failed_at = [datetime.fromisoformat(f["timestamp"]).timestamp() for f in failures]
    waits = [beta_requests[2].wall - failed_at[0], beta_requests[4].wall - failed_at[1]]
    print(f"retry waits: {[round(w, 3) for w in waits]}")
    assert waits[0] >= 0.23 and waits[1] >= 0.47

    d.daemon.state.flush(force=True)
    rows = {row["set"]: row for row in status.collect(ws.runs)["sets"]}
    assert rows[beta.id]["state"] == "failed" and rows[beta.id]["attempts"] == 3
    assert "500" in rows[beta.id]["reason"]
    raw = ws.state()["sets"][beta.id]
    assert raw["state"] == "failed" and "500" in raw["reason"]
    assert not ws.has_report(beta)
    assert ws.events("step.reported") == []

    # A new input is a new chance: the failed set is tried afresh.
    failing["on"] = False
    write_cp(ws.scripts("r1", 1, 1, "beta") / "ep02.txt", model_episode("r1", 1, 1, "beta", 2, 1))
    wait_until(lambda: ws.has_report(beta), 10, message="the retried report")
    wait_until(lambda: len(ws.events("step.reported")) == 1, 5, message="step.reported")
    assert_reports_match_final_content(ws, [alpha, beta])


# ------------------------------------------------------------------ sets, refusals


def test_sets_follow_work_toml_ranges_and_chunking(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    """alpha: 7 episodes in chunks of 3 (the last one short); beta: work.toml ranges."""
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 7, "beta": 6})
    (ws.data / "beta" / "work.toml").write_text('title = "Beta"\nranges = [[1, 2], [3, 5]]\n')
    ws.write_step("r1", 1, 1, success=True)
    expected = [
        SetId("r1", 1, 1, "alpha", 1, 3),
        SetId("r1", 1, 1, "alpha", 4, 6),
        SetId("r1", 1, 1, "alpha", 7, 7),
        SetId("r1", 1, 1, "beta", 1, 2),
        SetId("r1", 1, 1, "beta", 3, 5),
    ]
    start(ws)
    wait_until(lambda: all_reported(ws, expected), 20, message="five reports")
    wait_until(lambda: ws.events("step.reported"), 5, message="step.reported")
    assert stays(lambda: llm_server.request_count == 5, 0.5)
    assert sorted(requested_sets(llm_server)) == sorted(s.id for s in expected)
    assert len(ws.all_reports()) == 5  # beta's ep06 is in no range: no report for it
    assert ws.events("step.reported")[0]["sets"] == 5


def test_refused_sets_write_nothing_and_wait_for_new_input(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    """A human range with a hole (bad input) and a report cut off at the token limit (a bad
    reply): both refused, nothing written. The bad input is not retried by later scans;
    the bad reply is, after the set-level backoff, like any failed call."""
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3, "gamma": 3}, resync_s=1.0,
                         retry_backoff_s=0.5)
    (ws.data / "gamma" / "work.toml").write_text("ranges = [[1, 2], [3, 4]]\n")  # no human ep04
    alpha = SetId("r1", 1, 1, "alpha", 1, 3)
    gamma_ok, gamma_hole = SetId("r1", 1, 1, "gamma", 1, 2), SetId("r1", 1, 1, "gamma", 3, 4)
    ws.write_step("r1", 1, 1, ["alpha"], success=True)
    gamma = ws.scripts("r1", 1, 1, "gamma")
    gamma.mkdir(parents=True)
    for ep in (1, 2, 3, 4):
        (gamma / f"ep{ep:02d}.txt").write_text(model_episode("r1", 1, 1, "gamma", ep))
    mark_success(gamma)
    alpha_calls: list[Request] = []

    def cut_alpha_once(request: Request) -> Reply:
        if "work=alpha" in str(request.body):
            alpha_calls.append(request)
            if len(alpha_calls) == 1:
                return Reply.truncated()
        return Reply.ok(DEFAULT_REPORT)

    llm_server.default = cut_alpha_once

    d = start(ws)
    wait_until(lambda: ws.has_report(gamma_ok), 20, message="gamma 01-02's report")
    wait_until(lambda: len(ws.events("loss.refused")) == 2, 10, message="two refusals")
    assert "cut off" in set_events(ws, "loss.refused", alpha)[0]["reason"]
    assert "human" in set_events(ws, "loss.refused", gamma_hole)[0]["reason"]
    # The cut-off reply wrote nothing; the retry after the backoff writes the report.
    wait_until(lambda: ws.has_report(alpha), 10, message="alpha's report after the retry")
    assert len(alpha_calls) == 2
    assert len(set_events(ws, "loss.refused", alpha)) == 1  # one line for the bad reply
    assert set_events(ws, "loss.refused", alpha)[0]["next_retry_s"] is not None
    assert set_events(ws, "loss.failed", alpha) == []
    wait_until(lambda: (r := d.daemon.state.get(gamma_hole.id)) is not None
               and r.state == "refused", 5)
    first = scans(ws)
    wait_until(lambda: scans(ws) >= first + 1, 10, message="another scan")

    # The bad input was asked for never, before or after later scans.
    assert sorted(requested_sets(llm_server)) == sorted([alpha.id, alpha.id, gamma_ok.id])
    assert len(set_events(ws, "loss.refused", gamma_hole)) == 1
    assert not ws.report(gamma_hole).exists() and not ws.sidecar(gamma_hole).exists()
    assert not ws.archive(gamma_hole).exists()
    assert d.daemon.state.get(gamma_hole.id).state == "refused"
    assert ws.temp_files() == []
    assert_reports_match_final_content(ws, [alpha, gamma_ok])
    assert llm_server.request_count == 3


def test_template_edit_makes_every_report_stale_exactly_once(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 6}, resync_s=1.0)
    sets = ws.write_step("r1", 1, 1, success=True)
    start(ws)
    wait_until(lambda: all_reported(ws, sets), 20, message="the first reports")
    old = {ws.read_sidecar(s)["inputs"]["template_sha256"] for s in sets}
    template = ws.root / "prompts" / "loss.md.j2"
    template.write_text(template.read_text() + "\nKeep the report under 300 words.\n")
    wait_until(
        lambda: all(ws.read_sidecar(s)["inputs"]["template_sha256"] not in old for s in sets),
        10,
        message="both reports redone with the new template",
    )
    first = scans(ws)
    wait_until(lambda: scans(ws) >= first + 1, 10, message="another scan")
    assert llm_server.request_count == 4
    assert Counter(e["range"] for e in ws.events("set.stale")) == {"01-03": 1, "04-06": 1}
    assert all("300 words" in str(r.body) for r in llm_server.requests[2:])


def test_episode_rewritten_while_its_job_runs_is_redone_from_the_final_text(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, settle_s=0.5)
    llm_server.latency = (0.7, 0.7)
    s = ws.write_step("r1", 1, 1)[0]
    start(ws)
    wait_until(lambda: llm_server.request_count == 1, 20, message="the first request")
    final = model_episode("r1", 1, 1, "alpha", 2, version=3)
    write_cp(ws.scripts("r1", 1, 1, "alpha") / "ep02.txt", final)
    wait_until(lambda: llm_server.request_count == 2, 10, message="the redo")
    wait_until(
        lambda: (
            ws.has_report(s)
            and ws.read_sidecar(s)["model_episodes"]["ep02.txt"] == sha256_text(final)
        ),
        10,
        message="the report of the final text",
    )
    assert stays(lambda: llm_server.request_count == 2, 0.6)
    assert_reports_match_final_content(ws, [s])


# ----------------------------------------------------------------------- optimizer


def test_optimizer_runs_once_per_reported_step_and_retries_failures(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    out = tmp_path / "optimizer.log"
    # exits 1 for step 02: retried up to [optimizer] max_attempts = 2, then left alone.
    script = f'echo "$1 $2 $3 $4" >> {out}; [ "$3" != 02 ]'
    extra = (
        "\n[optimizer]\n"
        f"command = ['sh', '-c', '{script}', 'sh', '{{run}}', '{{epoch}}', '{{step}}', "
        "'{reports_dir}']\n"
        "max_attempts = 2\n"
    )
    ws = build_workspace(
        tmp_path,
        llm_server.url,
        works={"alpha": 3},
        resync_s=1.0,
        retry_backoff_s=0.2,
        extra=extra,
    )
    for step in (1, 2):
        ws.write_step("r1", 1, step, success=True)
    d = start(ws)
    wait_until(lambda: len(ws.events("optimizer.failed")) == 2, 15, message="two failures")
    first = scans(ws)
    wait_until(lambda: scans(ws) >= first + 1, 10, message="another scan")
    lines = out.read_text().splitlines()
    reports_01 = ws.runs / "r1" / "loss" / "epoch_01" / "step_01"
    reports_02 = reports_01.with_name("step_02")
    assert sorted(lines) == sorted(
        [f"r1 01 01 {reports_01}", f"r1 01 02 {reports_02}", f"r1 01 02 {reports_02}"]
    )
    assert [e["will_retry"] for e in ws.events("optimizer.failed")] == [True, False]
    assert len(ws.events("step.reported")) == 2
    d.daemon.state.flush(force=True)
    steps = {row["step"]: row["optimizer"] for row in status.collect(ws.runs)["steps"]}
    assert steps == {"r1/epoch_01/step_01": "done", "r1/epoch_01/step_02": "failed x2 (exit 1)"}

    # A restart remembers: no step is reported or optimized again.
    d.stop()
    restarted = start(ws)
    assert stays(lambda: len(out.read_text().splitlines()) == 3, 0.6)
    assert len(ws.events("step.reported")) == 2
    assert not restarted.daemon.stop_event.is_set()


def budget_workspace(tmp_path: Path, llm_server: LLMServer) -> Workspace:
    """gpt-4o-mini's price (litellm's offline map) over the loopback server; one report
    of ~2,400 prompt tokens costs ~$0.0004, four times the budget."""
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 6}, concurrency=1)
    text = ws.config_path.read_text()
    text = text.replace('model = "openai/loopback-model"', 'model = "openai/gpt-4o-mini"')
    ws.config_path.write_text(text.replace("[loss]", "budget_usd = 0.0001\n\n[loss]"))
    return ws


def test_budget_reached_stops_later_sets_of_the_run(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = budget_workspace(tmp_path, llm_server)
    first = ws.write_step("r1", 1, 1, success=True)[0:1]
    # Only 01-03 is complete: 04-06 has no episodes yet.
    for ep in (4, 5, 6):
        (ws.scripts("r1", 1, 1, "alpha") / f"ep{ep:02d}.txt").unlink()
    d = start(ws)
    wait_until(lambda: all_reported(ws, first), 20, message="the first report")
    # The report is on disk a moment before its events are logged.
    spent = wait_until(lambda: ws.events("loss.completed"), 5, message="loss.completed")
    assert spent[-1]["cost_usd"] > 0.0001
    later = ws.write_step("r1", 1, 2, success=True)
    wait_until(lambda: ws.events("budget.reached"), 5, message="budget.reached")
    assert stays(lambda: llm_server.request_count == 1, 0.8)
    assert len(ws.events("budget.reached")) == 1
    assert not any(ws.has_report(s) for s in later)
    # Held back, not still being written (each set is recorded held when it is looked at).
    wait_until(
        lambda: all((r := d.daemon.state.get(s.id)) is not None and r.state == "held"
                    and r.reason == "budget reached" for s in later),
        5,
        message="every later set held for the budget",
    )


def test_budget_also_holds_back_jobs_queued_before_it_was_reached(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = budget_workspace(tmp_path, llm_server)
    sets = [s for step in (1, 2) for s in ws.write_step("r1", 1, step, success=True)]
    start(ws)  # the startup scan queues all four sets; concurrency 1 runs one at a time
    spent = wait_until(lambda: ws.events("loss.completed"), 20, message="the first report's cost")
    assert spent[0]["cost_usd"] > 0.0001
    assert stays(lambda: llm_server.request_count == 1, 1.0), (
        f"{llm_server.request_count} LLM requests after the first report spent 4x the budget"
    )
    assert sum(ws.has_report(s) for s in sets) == 1
    wait_until(lambda: ws.events("budget.reached"), 5, message="budget.reached")
    assert stays(lambda: len(ws.events("budget.reached")) == 1, 0.3)


# ----------------------------------------------------------------- runs/ removed


def test_runs_folder_deleted_and_recreated_is_watched_again(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, settle_s=0.3)
    sets = ws.write_step("r1", 1, 1, success=True)
    d = start(ws)
    wait_until(lambda: all_reported(ws, sets), 20, message="the first report")
    # Nothing left to write (step marker, audit cache): a write in flight
    # would recreate runs/ under the test's feet.
    wait_until(lambda: ws.events("step.reported") and ws.events("audit.completed"), 10,
               message="the daemon idle")
    remove_tree(ws.runs)
    wait_until(lambda: ws.events("watch.root_missing"), 10, message="watch.root_missing")
    # Waiting is what it should do: with WatchdogSec, unhealthy here gets it killed.
    assert stays(d.daemon.healthy, 1.5), d.daemon.health_problems()
    ws.runs.mkdir()
    wait_until(lambda: ws.events("watch.restarted"), 10, message="watch.restarted")
    again = ws.write_step("r1", 1, 1, success=True)
    wait_until(lambda: all_reported(ws, again), 10, message="the report in the new runs/")
    assert llm_server.request_count == 2
    assert not d.daemon.stop_event.is_set() and d.daemon.exit_code == ExitCode.OK
    lock = ws.runs / ".skilltrain" / "daemon.lock"
    assert lock.read_text().strip() == str(os.getpid())


def test_a_paid_reply_that_is_refused_counts_in_the_spend_and_the_budget(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    # Only written reports were counted: a run whose replies came back cut off
    # (or contradicted, or leaking) paid for each and every retry of them while
    # its spend, its budget and skilltrain_cost_usd stayed at zero.
    llm_server.default = lambda request: Reply.truncated()
    ws = budget_workspace(tmp_path, llm_server)
    ws.write_step("r1", 1, 1, success=True)
    for ep in (4, 5, 6):  # one set: 01-03
        (ws.scripts("r1", 1, 1, "alpha") / f"ep{ep:02d}.txt").unlink()
    start(ws)
    (refused,) = wait_until(lambda: ws.events("loss.refused"), 20, message="loss.refused")
    assert refused["cost_usd"] > 0.0001 and refused["tokens_in"] > 1000
    later = ws.write_step("r1", 1, 2, success=True)
    wait_until(lambda: ws.events("budget.reached"), 10, message="budget.reached")
    assert stays(lambda: llm_server.request_count == 1, 0.8)
    assert not any(ws.has_report(s) for s in later)
    spend = wait_until(lambda: ws.state()["spend"].get("r1"), 5, message="the run's spend")
    assert spend["cost_usd"] == refused["cost_usd"] and spend["reports"] == 0
