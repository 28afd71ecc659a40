"""A step's reports folder holds the reports of the sets it has now, and no others.

The optimizer is given the folder. A set the step no longer has (its human
episode deleted, the ranges changed) left its report there, and the
optimizer read it when the step was reported again (a reviewer's repro).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from skilltrain.daemon.service.metrics import Metrics
from tests.daemon_helpers import InProcessDaemon, build_workspace, run_once_in_process, wait_until
from tests.llm_server import LLMServer, Reply

RECORDER = Path(__file__).resolve().parent / "optimizer_recorder.py"


def _reported_step(tmp_path: Path, llm_server: LLMServer) -> tuple[Any, Path, Path]:
    """A workspace whose step r1 0 0 (alpha, 6 episodes: 01-03 and 04-06) is
    reported, the optimizer recording the folders it is given; and its
    reports folder and that record."""
    record = tmp_path / "optimizer.jsonl"
    optimizer = (f'[optimizer]\ncommand = ["{sys.executable}", "{RECORDER}", "{record}", "0", '
                 '"-", "{reports_dir}"]\n')
    ws = build_workspace(tmp_path / "ws", llm_server.url, works={"alpha": 6},
                         extra="[integrity]\naudit_on_start = false\n" + optimizer)
    ws.write_step("r1", 0, 0, success=True)
    run_once_in_process(ws)
    return ws, ws.runs / "r1" / "loss" / "epoch_00" / "step_00", record


def test_a_report_of_a_set_the_step_no_longer_has_is_moved_out_before_the_optimizer(
        tmp_path: Path, llm_server: LLMServer) -> None:
    ws, reports, record = _reported_step(tmp_path, llm_server)
    assert (reports / "alpha_ep04-06.md").exists()

    (ws.data / "alpha" / "human" / "ep06.txt").unlink()  # the range is 04-05 now
    run_once_in_process(ws)

    runs = [json.loads(line)["dirs"][str(reports)] for line in record.read_text().splitlines()]
    assert len(runs) == 2
    assert "alpha_ep04-06.md" in runs[0]
    assert [n for n in runs[1] if n.endswith(".md") and not n.endswith("_prompt.md")] == [
        "alpha_ep01-03.md", "alpha_ep04-05.md"]
    retired = ws.runs / ".skilltrain" / "retired" / "r1" / "epoch_00" / "step_00"
    assert sorted(p.name for p in retired.iterdir()) == [
        "alpha_ep04-06.json", "alpha_ep04-06.md", "alpha_ep04-06_prompt.md"]
    (line,) = ws.events("step.retired")
    assert line["sets"] == ["alpha_ep04-06"] and line["files"] == 3


def test_a_set_that_comes_back_unchanged_gets_its_retired_report_back_unpaid(
        tmp_path: Path, llm_server: LLMServer) -> None:
    # A human episode gone for a while (a sync that deletes and rewrites
    # data/): the set's report was retired; when the set comes back with the
    # very inputs of that report, the report comes back, no call is made, and
    # the optimizer learns from it again. Changed inputs are paid for afresh.
    ws, reports, record = _reported_step(tmp_path, llm_server)
    names = ["alpha_ep04-06.json", "alpha_ep04-06.md", "alpha_ep04-06_prompt.md"]
    first = {name: (reports / name).read_bytes() for name in names}
    episode = ws.data / "alpha" / "human" / "ep06.txt"
    kept = episode.read_bytes()
    episode.unlink()
    run_once_in_process(ws)
    retired = ws.runs / ".skilltrain" / "retired" / "r1" / "epoch_00" / "step_00"
    assert sorted(p.name for p in retired.iterdir()) == names
    calls = len(llm_server.requests)

    episode.write_bytes(kept)  # back as it was
    run_once_in_process(ws)

    assert len(llm_server.requests) == calls  # nothing sent for it
    assert {name: (reports / name).read_bytes() for name in names} == first
    # Back in its folder (the archive rendered anew, the same bytes); the range
    # it replaced (04-05) is the one retired now.
    assert sorted(p.name for p in retired.iterdir()) == sorted(
        [n.replace("04-06", "04-05") for n in names] + ["alpha_ep04-06_prompt.md"])
    (back,) = [e for e in ws.events("loss.completed") if e.get("reused_from")]
    assert back["range"] == "04-06" and back["reused_from"] == str(retired / "alpha_ep04-06.md")
    assert back["cost_usd"] == 0 and back["tokens_in"] == 0  # nothing paid
    assert back["claims_status"] == json.loads(first["alpha_ep04-06.json"])["claims"]["status"]
    # Counted as written back, not as a new report: its claims were counted when it was made.
    metrics = Metrics(lambda: {}, ["done"])
    metrics.observe("loss.completed", back)
    scraped = generate_latest(metrics.registry).decode()
    assert "skilltrain_reports_reused_total 1.0" in scraped
    assert "skilltrain_reports_total 0.0" in scraped
    assert all(line.endswith(" 0.0") for line in scraped.splitlines()
               if line.startswith(("skilltrain_claims_total", "skilltrain_cost_usd_total")))
    runs = [json.loads(line)["dirs"][str(reports)] for line in record.read_text().splitlines()]
    assert "alpha_ep04-06.md" in runs[-1] and "alpha_ep04-05.md" not in runs[-1]

    # Gone again, and back with one model episode changed: paid for afresh.
    episode.unlink()
    run_once_in_process(ws)
    scripts = ws.runs / "r1" / "epoch_00" / "step_00" / "alpha" / "scripts"
    (scripts / "ep05.txt").write_text((scripts / "ep05.txt").read_text() + "\nMore.\n")
    episode.write_bytes(kept)
    calls = len(llm_server.requests)
    time.sleep(0.05)
    run_once_in_process(ws)
    assert len(llm_server.requests) > calls
    assert (retired / "alpha_ep04-06.md").exists()  # its inputs differ: left where it is
    assert (reports / "alpha_ep04-06.md").read_bytes() != first["alpha_ep04-06.md"] or \
        (reports / "alpha_ep04-06.json").read_bytes() != first["alpha_ep04-06.json"]


def test_a_set_held_by_the_budget_still_gets_its_retired_report_back(
        tmp_path: Path, llm_server: LLMServer) -> None:
    # Over budget, a set is held unsent; but its retired report costs nothing
    # to give back, so it comes back all the same, and the step completes.
    ws = build_workspace(tmp_path / "ws", llm_server.url, works={"alpha": 6},
                         extra="[integrity]\naudit_on_start = false\n")
    priced = ws.config_path.read_text().replace('model = "openai/loopback-model"',
                                                'model = "openai/gpt-4o-mini"')
    ws.config_path.write_text(priced)
    ws.write_step("r1", 0, 0, success=True)
    run_once_in_process(ws)  # both sets paid for
    reports = ws.runs / "r1" / "loss" / "epoch_00" / "step_00"
    episode = ws.data / "alpha" / "human" / "ep06.txt"
    kept = episode.read_bytes()
    episode.unlink()
    run_once_in_process(ws)  # 04-05 paid for, the step reported, 04-06's report retired
    assert not (reports / "alpha_ep04-06.md").exists()
    ws.config_path.write_text(priced.replace("[loss]", "budget_usd = 0.000001\n\n[loss]"))
    calls = len(llm_server.requests)
    episode.write_bytes(kept)
    run_once_in_process(ws)
    assert len(llm_server.requests) == calls
    (back,) = [e for e in ws.events("loss.completed") if e.get("reused_from")]
    assert back["range"] == "04-06" and (reports / "alpha_ep04-06.md").exists()
    assert ws.events("step.reported")[-1]["sets"] == 2
    # The budget still holds a set that has no retired report.
    (ws.scripts("r1", 0, 0, "alpha") / "ep01.txt").write_text("INT. NEW - DAY\n\nNew.\n")
    time.sleep(0.05)
    run_once_in_process(ws)
    assert len(llm_server.requests) == calls and ws.events("budget.reached")


def test_a_set_held_by_a_refused_key_still_gets_its_retired_report_back(
        tmp_path: Path, llm_server: LLMServer) -> None:
    # The provider refuses the key (insufficient_quota): the endpoint is
    # blocked and new sets are held; a set whose retired report comes back
    # needs no call, so it is written back while the key is still refused.
    record = tmp_path / "optimizer.jsonl"
    ws = build_workspace(
        tmp_path / "ws", llm_server.url, works={"alpha": 6}, settle_s=0.0, resync_s=0.3,
        extra=("[integrity]\naudit_on_start = false\n[optimizer]\ncommand = "
               f'["{sys.executable}", "{RECORDER}", "{record}", "0", "-", "{{reports_dir}}"]\n'))
    ws.write_step("r1", 0, 0, success=True)
    run_once_in_process(ws)
    episode = ws.data / "alpha" / "human" / "ep06.txt"
    kept = episode.read_bytes()
    episode.unlink()
    run_once_in_process(ws)  # 04-05 paid for, 04-06's report retired
    llm_server.default = lambda request: Reply.status(429, body={"error": {
        "message": "You exceeded your current quota.", "type": "insufficient_quota",
        "code": "insufficient_quota"}})
    ws.write_step("r1", 0, 1, success=True)  # its sets (01-03, 04-05) are refused
    reports = ws.runs / "r1" / "loss" / "epoch_00" / "step_00"
    with InProcessDaemon(ws):
        wait_until(lambda: ws.events("llm.blocked"), 15, message="the key refused")
        wait_until(lambda: any(e["held"] == 2 for e in ws.events("scan.completed")), 15,
                   message="step 1's sets held")
        calls = len(llm_server.requests)
        reported = len(ws.events("step.reported", step=0, sets=2))  # runs 1 and 2 did
        episode.write_bytes(kept)  # 04-06 is a set again: the next resync finds it
        (back,) = wait_until(lambda: [e for e in ws.events("loss.completed")
                                      if e.get("reused_from")], 15, message="04-06 back")
        assert (back["step"], back["range"]) == (0, "04-06")
        assert (reports / "alpha_ep04-06.md").exists()
        # Step 1's sets, 04-06 among them now, are held still: nothing was sent.
        wait_until(lambda: len(ws.events("step.reported", step=0, sets=2)) > reported, 15,
                   message="step 0 reported again with 04-06 back")
        assert len(llm_server.requests) == calls
        assert not [e for e in ws.events("loss.completed") if e["step"] == 1]


def test_a_set_back_with_refused_inputs_is_refused_before_its_retired_report_is_looked_at(
        tmp_path: Path, llm_server: LLMServer) -> None:
    # The retired report is tried first, from the inputs read as a job reads
    # them: inputs the job would refuse are refused there, said as such.
    ws, reports, _ = _reported_step(tmp_path, llm_server)
    episode = ws.data / "alpha" / "human" / "ep06.txt"
    kept = episode.read_bytes()
    episode.unlink()
    run_once_in_process(ws)  # 04-06 retired
    episode.write_bytes(kept)
    copied = (ws.data / "alpha" / "human" / "ep05.txt").read_text(encoding="utf-8")
    (ws.scripts("r1", 0, 0, "alpha") / "ep05.txt").write_text(copied, encoding="utf-8")
    time.sleep(0.05)
    calls = len(llm_server.requests)
    run_once_in_process(ws)
    assert len(llm_server.requests) == calls
    (refused,) = ws.events("loss.refused", range="04-06")
    assert "ep05" in refused["reason"]
    assert not [e for e in ws.events("loss.failed") if e.get("reason") == "internal error"]


def _a_step_with_one_set(tmp_path: Path) -> tuple[Path, Any, Path, Any]:
    """runs/, step r1 0 0, its reports folder, and its one set (alpha 01-03), reported."""
    from skilltrain.daemon.core import layout

    runs = tmp_path / "runs"
    step = layout.StepKey("r1", 0, 0)
    kept = layout.SetKey("r1", 0, 0, "alpha", 1, 3)
    _loss_files(step.reports_dir(runs), "alpha_ep01-03", "kept")
    return runs, step, step.reports_dir(runs), kept


def _folders(runs: Path, kept: Any, emit: Any) -> Any:
    """The daemon's gate over a step whose one set is `kept` (retire.StepFolders)."""
    from skilltrain.daemon.service import retire

    return retire.StepFolders(runs, emit, expects=lambda key: key == kept,
                              sets_of_step=lambda step: [kept])


def _loss_files(reports: Path, name: str, text: str) -> None:
    reports.mkdir(parents=True, exist_ok=True)
    for suffix in (".md", ".json", "_prompt.md"):
        (reports / f"{name}{suffix}").write_text(text, encoding="utf-8")


def test_two_looks_at_once_retire_each_file_once_and_a_second_retirement_keeps_the_first(
        tmp_path: Path) -> None:
    import threading

    from skilltrain.daemon.service import retire

    runs, step, reports, kept = _a_step_with_one_set(tmp_path)
    _loss_files(reports, "alpha_ep04-06", "first")
    for first in range(7, 67, 3):  # many strays: the lookers overlap while moving them
        _loss_files(reports, f"alpha_ep{first:02d}-{first + 2:02d}", "stray")
    events: list[dict[str, object]] = []
    results: list[bool] = []
    folders = _folders(runs, kept, lambda event, **f: events.append({"event": event, **f}))
    lookers = [threading.Thread(target=lambda: results.append(bool(folders.retire(
        step, [kept])))) for _ in range(16)]
    for t in lookers:
        t.start()
    for t in lookers:
        t.join()
    assert results == [True] * 16
    assert [e["event"] for e in events] == ["step.retired"]  # no step.retire_failed
    assert sorted(p.name for p in reports.iterdir()) == [
        "alpha_ep01-03.json", "alpha_ep01-03.md", "alpha_ep01-03_prompt.md"]

    _loss_files(reports, "alpha_ep04-06", "second")  # the set came back, and went again
    assert _folders(runs, kept, lambda event, **f: None).retire(step, [kept])
    retired = retire.retired_dir(runs, step)
    assert (retired / "alpha_ep04-06.md").read_text() == "first"
    assert (retired / "alpha_ep04-06.md.2").read_text() == "second"


def test_a_report_whose_set_left_its_step_during_the_call_never_lands(tmp_path: Path) -> None:
    """run.toml drops a work while its set's call is in flight, and the step is
    reported and optimized without it meanwhile. The reply that comes back
    afterwards must not land in the folder the optimizer was given (nor
    reopen the step for a second run): it is discarded and the set forgotten.
    Before, it was written, reopened the step, and was retired a moment later."""
    import threading

    from tests.daemon_helpers import InProcessDaemon, wait_until
    from tests.llm_server import Request, default_responder

    in_call, release = threading.Event(), threading.Event()

    def answer(request: Request) -> Reply:
        if "beta" in json.dumps(request.messages):
            in_call.set()
            release.wait(30)
        return default_responder(request)

    record = tmp_path / "optimizer.jsonl"
    optimizer = (f'[optimizer]\ncommand = ["{sys.executable}", "{RECORDER}", "{record}", "0", '
                 '"-", "{reports_dir}"]\n')
    with LLMServer(default=answer) as server:
        ws = build_workspace(tmp_path / "ws", server.url, works={"alpha": 6, "beta": 3},
                             settle_s=0.0, llm_timeout_s=30.0,
                             extra="[integrity]\naudit_on_start = false\n" + optimizer)
        ws.write_step("r1", 0, 0, success=True)
        with InProcessDaemon(ws) as d:
            assert in_call.wait(30), "beta's call never came"
            wait_until(lambda: len(ws.events("loss.completed")) == 2, 30,
                       message="alpha's two reports")
            (ws.runs / "r1" / "run.toml").write_text('works = ["alpha"]\n', encoding="utf-8")
            d.daemon.reconcile.scan()  # the step now has alpha's sets alone: reported
            wait_until(lambda: record.exists() and ws.events("optimizer.finished"), 30,
                       message="the optimizer's run")
            release.set()
            wait_until(lambda: ws.events("loss.discarded") or len(ws.events(
                "loss.completed")) > 2, 30, message="beta's outcome")
            wait_until(lambda: not any("beta" in k for k in ws.state()["sets"])
                       or ws.events("step.retired"), 10, message="beta's state")
    reports = ws.runs / "r1" / "loss" / "epoch_00" / "step_00"
    names = [json.loads(line)["dirs"][str(reports)] for line in record.read_text().splitlines()]
    assert len(names) == 1 and not [n for n in names[0] if n.startswith("beta")]
    assert not any(p.name.startswith("beta") for p in ws.runs.rglob("*") if p.is_file())
    (discarded,) = ws.events("loss.discarded")
    assert "no longer a set of r1" in discarded["reason"]
    assert not ws.events("step.retired")


def test_a_retry_of_a_set_that_left_its_step_is_not_sent(tmp_path: Path) -> None:
    """A set's retry was scheduled, then run.toml dropped its work: the look that
    falls due forgets the set instead of paying for a report of it."""
    from tests.daemon_helpers import InProcessDaemon, wait_until
    from tests.llm_server import Reply, Request, default_responder

    beta_calls: list[float] = []

    def answer(request: Request) -> Reply:
        if "beta" in json.dumps(request.messages):
            beta_calls.append(time.monotonic())
            return Reply.status(400)  # not retried within the job: one call an attempt
        return default_responder(request)

    with LLMServer(default=answer) as server:
        ws = build_workspace(tmp_path / "ws", server.url, works={"alpha": 3, "beta": 3},
                             settle_s=0.0, retry_backoff_s=1.0,
                             extra="[integrity]\naudit_on_start = false\n")
        ws.write_step("r1", 0, 0, success=True)
        with InProcessDaemon(ws):
            wait_until(lambda: ws.events("loss.failed", work="beta"), 30,
                       message="beta's failed attempt")
            (ws.runs / "r1" / "run.toml").write_text('works = ["alpha"]\n', encoding="utf-8")
            time.sleep(4.0)  # the retry (backoff 1 s, +- jitter) falls due meanwhile
            calls = len(beta_calls)
            state = ws.state()["sets"]
    assert calls == 1, f"beta was sent {calls} times"
    assert not any("beta" in k for k in state)


def test_a_link_or_a_hand_made_name_of_a_set_leaves_the_folder(tmp_path: Path) -> None:
    """x_ep001-003.md parses as set 01-03, and a link named like a loss file was
    skipped: both stayed in the folder the optimizer reads. The name is moved
    out; every link is removed (it may point at an answer key), not kept."""
    import os

    from skilltrain.daemon.service import retire

    runs, step, reports, kept = _a_step_with_one_set(tmp_path)
    _loss_files(reports, "alpha_ep001-003", "hand-made")
    key = tmp_path / "data" / "alpha" / "human" / "ep04.txt"
    key.parent.mkdir(parents=True)
    key.write_text("the answer key\n", encoding="utf-8")
    os.symlink(key, reports / "alpha_ep04-06.md")
    os.symlink(key, reports / "notes.md")  # not a loss file's name
    os.symlink(key.parent, reports / "alpha")  # a folder
    (reports / "alpha_ep01-03_prompt.md").unlink()
    os.symlink(key, reports / "alpha_ep01-03_prompt.md")  # a wanted set's name, as a link
    events: list[dict[str, object]] = []

    assert _folders(runs, kept, lambda event, **f: events.append({"event": event, **f})
                    ).retire(step, [kept])

    assert sorted(p.name for p in reports.iterdir()) == [
        "alpha_ep01-03.json", "alpha_ep01-03.md"]
    retired = retire.retired_dir(runs, step)
    assert sorted(p.name for p in retired.iterdir()) == [
        "alpha_ep001-003.json", "alpha_ep001-003.md", "alpha_ep001-003_prompt.md"]
    assert not [p for p in retired.iterdir() if p.is_symlink()]
    (line,) = events
    assert line["files"] == 3 and line["links_removed"] == 4
    assert key.exists()  # the link went, not what it points at


def test_a_set_of_a_work_added_since_data_was_read_is_still_expected(tmp_path: Path) -> None:
    # Discovery reads data/ at scans: a set of a newer work must not be taken
    # for one its step no longer has (forgotten, its report discarded).
    from skilltrain.daemon.core import config, layout
    from skilltrain.daemon.infra.state import StateStore
    from skilltrain.daemon.service.discovery import Discovery
    from tests.daemon_helpers import human_screenplays, write_human_episodes

    ws = build_workspace(tmp_path, "http://127.0.0.1:9", works={"alpha": 3})
    cfg = config.load(ws.config_path)
    discovery = Discovery(cfg, StateStore(cfg.paths.runs), lambda *a, **k: None)
    discovery.load_works()
    write_human_episodes(tmp_path, "beta", human_screenplays("beta", 3))

    assert discovery.expects(layout.SetKey("r1", 0, 0, "beta", 1, 3))
    assert not discovery.expects(layout.SetKey("r1", 0, 0, "beta", 1, 2))
    assert not discovery.expects(layout.SetKey("r1", 0, 0, "gamma", 1, 3))


def test_a_run_toml_being_written_keeps_the_works_it_named(tmp_path: Path) -> None:
    # An editor truncates run.toml before writing it: read empty (or half
    # written), it meant "every work" for a moment, and a set the run had left
    # could land its report in the folder its optimizer reads (a review's repro).
    import os

    from skilltrain.daemon.core import config, layout
    from skilltrain.daemon.infra.state import StateStore
    from skilltrain.daemon.service.discovery import Discovery

    ws = build_workspace(tmp_path, "http://127.0.0.1:9", works={"alpha": 3, "beta": 3})
    cfg = config.load(ws.config_path)
    discovery = Discovery(cfg, StateStore(cfg.paths.runs), lambda *a, **k: None)
    discovery.load_works()
    run_toml = ws.runs / "r1" / "run.toml"
    run_toml.parent.mkdir(parents=True)
    beta = layout.SetKey("r1", 0, 0, "beta", 1, 3)

    def write(text: str) -> None:
        run_toml.write_text(text, encoding="utf-8")
        os.utime(run_toml, ns=(time.time_ns(), time.time_ns() + len(text)))  # a new mtime

    write('works = ["alpha"]\n')
    assert not discovery.expects(beta)
    for being_written in ("", 'works = ["al'):
        write(being_written)
        assert not discovery.expects(beta), being_written
        assert "keeping its last readable settings" in discovery.run_settings("r1").problems[0]
    write('works = ["alpha", "beta"]\n')
    assert discovery.expects(beta)
    write('works = ["alpha"]\n')
    run_toml.unlink()  # no file: every work
    assert discovery.expects(beta)


def test_a_set_that_left_its_step_and_failed_for_good_does_not_hold_the_step(
        tmp_path: Path) -> None:
    """run.toml drops beta while its call is in flight: the scan cannot forget
    its record (claimed), and the call then fails for good (no look to come).
    Its FAILED record kept the step's count of open sets above 0, so the step
    whose every set is done waited for the next full scan (a review's repro)."""
    import threading

    from tests.daemon_helpers import InProcessDaemon, wait_until
    from tests.llm_server import Reply, Request, default_responder

    beta_in, alpha_in = threading.Event(), threading.Event()
    release_beta, release_alpha = threading.Event(), threading.Event()

    def answer(request: Request) -> Reply:
        if "beta" in json.dumps(request.messages):
            beta_in.set()
            release_beta.wait(30)
            return Reply.status(400)
        alpha_in.set()
        release_alpha.wait(30)
        return default_responder(request)

    with LLMServer(default=answer) as server:
        ws = build_workspace(tmp_path / "ws", server.url, works={"alpha": 3, "beta": 3},
                             settle_s=0.0, max_attempts=1, llm_timeout_s=30.0,
                             extra="[integrity]\naudit_on_start = false\n")
        ws.write_step("r1", 0, 0, success=True)
        with InProcessDaemon(ws) as d:
            assert beta_in.wait(30) and alpha_in.wait(30)
            (ws.runs / "r1" / "run.toml").write_text('works = ["alpha"]\n', encoding="utf-8")
            d.daemon.reconcile.scan()  # beta is claimed: its record stays
            time.sleep(2.0)  # the watcher's own rescans, while beta is claimed
            scans = len(ws.events("scan.completed"))
            release_beta.set()
            wait_until(lambda: ws.events("loss.failed"), 30, message="beta failed for good")
            release_alpha.set()
            wait_until(lambda: ws.events("step.reported"), 10,
                       message="the step reported at alpha's end, not at the next scan")
            assert len(ws.events("scan.completed")) == scans  # no scan did it
            assert not any("beta" in k for k in d.daemon.state.sets)


def test_a_retired_copy_is_found_by_its_hashes_whatever_its_copy_numbers(tmp_path: Path) -> None:
    # A review's cases: a copy taken back leaves a gap in the numbers, each of a
    # set's three files is numbered on its own (a crash, a name already taken),
    # and a file of ours' name may hold anything. The report is found by the
    # hash its sidecar names, the sidecar by the inputs it names.
    import hashlib

    from skilltrain.daemon.core import layout
    from skilltrain.daemon.service import retire

    runs = tmp_path / "runs"
    key = layout.SetKey("r1", 0, 0, "alpha", 4, 6)
    folder = retire.retired_dir(runs, key.step_key)
    folder.mkdir(parents=True)
    report_path = key.report_path(runs)

    def retired(inputs: str, report_slot: str, sidecar_slot: str) -> None:
        text = f"A report of {inputs}.\n"
        (folder / f"alpha_ep04-06.md{report_slot}").write_text(text)
        (folder / f"alpha_ep04-06.json{sidecar_slot}").write_text(json.dumps(
            {"inputs": {"model_sha256": inputs},
             "report_sha256": hashlib.sha256(text.encode()).hexdigest()}))

    retired("A", "", "")
    retired("C", ".3", ".3")  # .2 was taken back: a gap
    retired("D", ".4", ".5")  # out of step
    (folder / "alpha_ep04-06.json.6").write_text("[" * 100_000 + "]" * 100_000)  # not ours
    (folder / "alpha_ep04-06.json.7").symlink_to(folder / "alpha_ep04-06.json")

    def found(inputs: str) -> list[tuple[list[str], str]]:
        return [([p.name for p in paths], text) for paths, text, *_ in retire.retired_copies(
            runs, key, report_path, {"model_sha256": inputs})]

    assert found("A") == [(["alpha_ep04-06.md", "alpha_ep04-06.json"], "A report of A.\n")]
    assert found("C") == [(["alpha_ep04-06.md.3", "alpha_ep04-06.json.3"], "A report of C.\n")]
    assert found("D") == [(["alpha_ep04-06.md.4", "alpha_ep04-06.json.5"], "A report of D.\n")]
    assert found("B") == []
