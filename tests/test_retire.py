"""A step's reports folder holds the reports of the sets it has now, and no others.

The optimizer is given the folder. A set the step no longer has (its human
episode deleted, the ranges changed) left its report there, and the
optimizer read it when the step was reported again (a reviewer's repro).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.daemon_helpers import build_workspace, run_once_in_process
from tests.llm_server import LLMServer

RECORDER = Path(__file__).resolve().parent / "optimizer_recorder.py"


def test_a_report_of_a_set_the_step_no_longer_has_is_moved_out_before_the_optimizer(
        tmp_path: Path, llm_server: LLMServer) -> None:
    record = tmp_path / "optimizer.jsonl"
    optimizer = (f'[optimizer]\ncommand = ["{sys.executable}", "{RECORDER}", "{record}", "0", '
                 '"-", "{reports_dir}"]\n')
    ws = build_workspace(tmp_path / "ws", llm_server.url, works={"alpha": 6},
                         extra="[integrity]\naudit_on_start = false\n" + optimizer)
    ws.write_step("r1", 0, 0, success=True)
    run_once_in_process(ws)
    reports = ws.runs / "r1" / "loss" / "epoch_00" / "step_00"
    assert (reports / "alpha_ep04-06.md").exists()

    (ws.data / "alpha" / "human" / "ep06.txt").unlink()  # the range is 04-05 now
    run_once_in_process(ws)

    runs = [json.loads(line)["dirs"][str(reports)] for line in record.read_text().splitlines()]
    assert len(runs) == 2
    assert "alpha_ep04-06.md" in runs[0]
    assert [n for n in runs[1] if n.endswith(".md") and not n.endswith("_prompt.md")] == [
        "alpha_ep01-03.md", "alpha_ep04-05.md"]
    retired = ws.runs / "r1" / "loss" / ".retired" / "epoch_00" / "step_00"
    assert sorted(p.name for p in retired.iterdir()) == [
        "alpha_ep04-06.json", "alpha_ep04-06.md", "alpha_ep04-06_prompt.md"]
    (line,) = ws.events("step.retired")
    assert line["sets"] == ["alpha_ep04-06"] and line["files"] == 3


def _loss_files(reports: Path, name: str, text: str) -> None:
    reports.mkdir(parents=True, exist_ok=True)
    for suffix in (".md", ".json", "_prompt.md"):
        (reports / f"{name}{suffix}").write_text(text, encoding="utf-8")


def test_two_looks_at_once_retire_each_file_once_and_a_second_retirement_keeps_the_first(
        tmp_path: Path) -> None:
    import threading

    from skilltrain.daemon.core import layout
    from skilltrain.daemon.service import retire

    runs = tmp_path / "runs"
    step = layout.StepKey("r1", 0, 0)
    reports = step.reports_dir(runs)
    kept = layout.SetKey("r1", 0, 0, "alpha", 1, 3)
    _loss_files(reports, "alpha_ep01-03", "kept")
    _loss_files(reports, "alpha_ep04-06", "first")
    for first in range(7, 67, 3):  # many strays: the lookers overlap while moving them
        _loss_files(reports, f"alpha_ep{first:02d}-{first + 2:02d}", "stray")
    events: list[dict[str, object]] = []
    results: list[bool] = []
    lookers = [threading.Thread(target=lambda: results.append(retire.retire_strays(
        runs, step, [kept], lambda event, **f: events.append({"event": event, **f}))))
        for _ in range(16)]
    for t in lookers:
        t.start()
    for t in lookers:
        t.join()
    assert results == [True] * 16
    assert [e["event"] for e in events] == ["step.retired"]  # no step.retire_failed
    assert sorted(p.name for p in reports.iterdir()) == [
        "alpha_ep01-03.json", "alpha_ep01-03.md", "alpha_ep01-03_prompt.md"]

    _loss_files(reports, "alpha_ep04-06", "second")  # the set came back, and went again
    assert retire.retire_strays(runs, step, [kept], lambda event, **f: None)
    retired = retire.retired_dir(runs, step)
    assert (retired / "alpha_ep04-06.md").read_text() == "first"
    assert (retired / "alpha_ep04-06.md.2").read_text() == "second"
