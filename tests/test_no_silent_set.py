"""No silent set, no link to the answer key, no binary "screenplay".

One tree holds a good work next to one defect per work, plus defects in the
folders above the works (a misnumbered epoch, run and work folders that are
symlinks out of runs/). One real `--once` pass (watchdog off, APScheduler,
litellm over HTTP to the loopback server) goes over it. Every defect must give
exactly one warning naming the file or link, show its reason in
`skilltrain status`, send nothing to the LLM, write nothing, and keep the
step from being reported (so the optimizer never sees it).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.commands import status, status_render
from tests.daemon_helpers import (
    InProcessDaemon,
    SetId,
    Workspace,
    build_workspace,
    litellm_warm_and_frozen,
    mark_success,
    model_episode,
    release_llm_clients,
    run_once_in_process,
)
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.llm_server import LLMServer

pytestmark = DAEMON_TEST_MARKS

NO_AUDIT = "[integrity]\naudit_on_start = false\n"
R = "r1"  # every defect lives in r1/epoch_01/step_01: that step may never be reported
GOOD_RUN = "g1"
OLD = time.time() - 3600  # an mtime well past any settle window

# work -> (event, words every one of its lines must hold)
UNUSABLE = {
    "zero": "ep02.txt is empty (0 bytes)",
    "dangle": "is a dangling symlink",
    "loop": "is a symlink loop",
    "misnamed": "ep01.txt missing; found ep1.txt",
    "upper": "ep01.txt missing; found EP01.TXT",
    "scriptsfile": "is a file, not a folder",
    "succmiss": "ep02.txt missing, but _SUCCESS says the writer finished",
    "keylink": "leads into the answer key",
    "eplink": "leads into the answer key",
    "worklink": "is a symlink out of runs/",
}
REFUSED = {
    "nul": "4,096 control character(s), the first U+0000",
    "nul64": "64 control character(s), the first U+0000",
    "esc": "the first U+001B",
    "hardlink": "has the content of human ep02.txt",
    "copy": "has the content of human ep02.txt",
}
WORKS = {"good": 3, "future": 3, **{w: 3 for w in UNUSABLE}, **{w: 3 for w in REFUSED}}


@dataclass
class Tree:
    ws: Workspace
    events: list[dict[str, Any]]
    requests: list[str]
    status: dict[str, Any]
    failures: int


def write_model(ws: Workspace, work: str, eps: list[int], run: str = R) -> Path:
    scripts = ws.scripts(run, 1, 1, work)
    scripts.mkdir(parents=True, exist_ok=True)
    for ep in eps:
        (scripts / f"ep{ep:02d}.txt").write_text(
            model_episode(run, 1, 1, work, ep), encoding="utf-8"
        )
    return scripts


def build_tree(ws: Workspace) -> None:
    human = {w: ws.data / w / "human" for w in WORKS}
    write_model(ws, "good", [1, 2, 3], run=GOOD_RUN)
    (ws.runs / GOOD_RUN / "run.toml").write_text('works = ["good"]\n')
    write_model(ws, "zero", [1, 2, 3], run=GOOD_RUN)  # a work g1's run.toml does not list
    for work in WORKS:
        if work not in ("scriptsfile", "keylink", "worklink"):
            write_model(ws, work, [1, 3])
    scripts = {w: ws.scripts(R, 1, 1, w) for w in WORKS}
    write_model(ws, "good", [2])
    write_model(ws, "future", [2])
    for path in scripts["future"].iterdir():  # a writer whose clock says 2100
        os.utime(path, (4102444800, 4102444800))
    mark_success(scripts["future"])

    (scripts["zero"] / "ep02.txt").write_bytes(b"")
    os.utime(scripts["zero"] / "ep02.txt", (OLD, OLD))
    (scripts["dangle"] / "ep02.txt").symlink_to(ws.runs / "gone.txt")
    (scripts["loop"] / "ep02.txt").symlink_to("ep02.txt")
    (scripts["misnamed"] / "ep01.txt").rename(scripts["misnamed"] / "ep1.txt")
    write_model(ws, "misnamed", [2])
    (scripts["upper"] / "ep01.txt").rename(scripts["upper"] / "EP01.TXT")
    write_model(ws, "upper", [2])
    scripts["scriptsfile"].parent.mkdir(parents=True)
    scripts["scriptsfile"].write_text("not a folder\n")
    mark_success(scripts["succmiss"])
    scripts["keylink"].parent.mkdir(parents=True)
    scripts["keylink"].symlink_to(human["keylink"])
    (scripts["eplink"] / "ep02.txt").symlink_to(human["eplink"] / "ep02.txt")
    elsewhere = ws.outside / "worklink"
    shutil.copytree(write_model(ws, "good", [1, 2, 3], run="tmp"), elsewhere / "scripts")
    shutil.rmtree(ws.runs / "tmp")
    scripts["worklink"].parent.symlink_to(elsewhere)

    text = model_episode(R, 1, 1, "nul64", 2)
    (scripts["nul"] / "ep02.txt").write_bytes(b"\0" * 4096)
    (scripts["nul64"] / "ep02.txt").write_text(text[:40] + "\0" * 64 + text[40:])
    (scripts["esc"] / "ep02.txt").write_text("\x1b[31m" + model_episode(R, 1, 1, "esc", 2))
    os.link(human["hardlink"] / "ep02.txt", scripts["hardlink"] / "ep02.txt")
    shutil.copy(human["copy"] / "ep02.txt", scripts["copy"] / "ep02.txt")

    # The step's first and last sets are good ones: a barrier that looked at
    # one set, or at either end, would report the step.
    listed = ["good", *UNUSABLE, *REFUSED, "future"]
    assert set(listed) == set(WORKS)
    (ws.runs / R / "run.toml").write_text(f"works = {json.dumps(listed)}\n", encoding="utf-8")

    # Folders above the works: a misnumbered epoch (next to the real one) and
    # a run folder that is a symlink out of runs/.
    write_model(ws, "good", [1, 2, 3], run="tmp")
    os.rename(ws.runs / "tmp" / "epoch_01", ws.runs / R / "epoch_1")
    (ws.runs / "tmp").rmdir()
    # The linked run holds a good, finished set of its own, whose episodes
    # name it (SETMARK linkedrun): followed, it would be sent and reported.
    linked = ws.outside / "linked-run"
    linked_scripts = linked / ws.scripts("linkedrun", 1, 1, "good").relative_to(
        ws.runs / "linkedrun")
    linked_scripts.mkdir(parents=True)
    for ep in (1, 2, 3):
        (linked_scripts / f"ep{ep:02d}.txt").write_text(
            model_episode("linkedrun", 1, 1, "good", ep), encoding="utf-8")
    mark_success(linked_scripts)
    (linked / "run.toml").write_text('works = ["good"]\n')
    (ws.runs / "linkedrun").symlink_to(linked)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tree]:
    with litellm_warm_and_frozen(), LLMServer() as server:
        ws = build_workspace(
            tmp_path_factory.mktemp("silent"),
            server.url,
            works=WORKS,
            settle_s=0.3,
            extra=NO_AUDIT,
        )
        build_tree(ws)
        d = InProcessDaemon(ws, once=True).start()
        try:
            d.run_once()
            failures = d.daemon.failures
        finally:
            d.stop("once: idle")
        release_llm_clients()
        yield Tree(
            ws,
            ws.events(),
            [r.body and json.dumps(r.body) or "" for r in server.requests],
            status.collect(ws.runs),
            failures,
        )


def events_about(tree: Tree, name: str, needle: str) -> list[dict[str, Any]]:
    return [e for e in tree.events if e["event"] == name and needle in json.dumps(e)]


def written_for(tree: Tree, work: str) -> list[Path]:
    """Reports, prompt archives and sidecars of a work, anywhere under runs/."""
    return sorted(tree.ws.runs.glob(f"*/loss/*/*/{work}_*"))


def set_status(tree: Tree, work: str) -> dict[str, Any]:
    (row,) = [s for s in tree.status["sets"] if s["set"] == SetId(R, 1, 1, work, 1, 3).id]
    return dict(row)


@pytest.mark.parametrize("work", list(UNUSABLE))
def test_a_set_that_cannot_complete_says_why_once_and_in_status(tree: Tree, work: str) -> None:
    words = UNUSABLE[work]
    lines = [e for e in events_about(tree, "set.unusable", f"/{work}/") if words in e["reason"]]
    assert len(lines) == 1, [e for e in tree.events if work in json.dumps(e)]
    assert lines[0]["level"] == "warning"
    row = set_status(tree, work)
    assert row["state"] == "waiting" and words in row["reason"], row
    assert not any(f"work={work} " in body for body in tree.requests)
    assert written_for(tree, work) == []


def test_the_event_names_the_link_not_only_the_file_behind_it(tree: Tree) -> None:
    (work,) = events_about(tree, "set.unusable", "/worklink")
    assert work["reason"].startswith(f"{tree.ws.scripts(R, 1, 1, 'worklink').parent} is a symlink")
    (key,) = events_about(tree, "set.unusable", "/keylink/")
    assert key["reason"].startswith(f"{tree.ws.scripts(R, 1, 1, 'keylink')} leads into")


@pytest.mark.parametrize("work", list(REFUSED))
def test_binary_content_and_copies_of_the_answer_key_are_refused_unsent(
    tree: Tree, work: str
) -> None:
    lines = events_about(tree, "loss.refused", f'"work": "{work}"')
    assert len(lines) == 1, lines
    assert REFUSED[work] in lines[0]["reason"] and "ep02.txt" in lines[0]["reason"]
    assert set_status(tree, work)["state"] == "refused"
    assert not any(f"work={work} " in body for body in tree.requests)
    assert written_for(tree, work) == []


def test_the_step_holding_them_is_not_reported(tree: Tree) -> None:
    # The step's sets in its run.toml's order: done at both ends, the bad ones between.
    assert set_status(tree, "good")["state"] == set_status(tree, "future")["state"] == "done"
    reported = [e["run"] for e in tree.events if e["event"] == "step.reported"]
    assert reported == [GOOD_RUN], reported
    assert tree.failures > 0  # --once exits 1


def test_misnumbered_epoch_folder_is_named_with_the_expected_name(tree: Tree) -> None:
    (line,) = events_about(tree, "set.ignored", "epoch_1")
    assert line["path"] == str(tree.ws.runs / R / "epoch_1")
    assert "expected epoch_01" in line["reason"]


def test_run_folder_symlinked_out_of_runs_is_named(tree: Tree) -> None:
    (line,) = events_about(tree, "set.unusable", "linkedrun")
    assert line["path"] == str(tree.ws.runs / "linkedrun")
    assert "symlink out of runs/" in line["reason"]
    # Its finished set is never sent, scored or reported.
    assert tree.requests and not any("SETMARK linkedrun " in body for body in tree.requests)
    about_it = [e for e in tree.events if e.get("run") == "linkedrun"
                or "linkedrun/" in json.dumps(e)]
    assert about_it == [], about_it
    assert not [s for s in tree.status["sets"] if s["set"].startswith("linkedrun/")]
    assert not (tree.ws.outside / "linked-run" / "loss").exists()


def test_folders_that_hold_no_visible_set_show_in_status(tree: Tree) -> None:
    notices = {n["path"]: n for n in tree.status["notices"]}
    assert "expected epoch_01" in notices[str(tree.ws.runs / R / "epoch_1")]["reason"]
    assert notices[str(tree.ws.runs / "linkedrun")]["event"] == "set.unusable"
    out = io.StringIO()
    status_render.render(tree.status, out)
    lines = out.getvalue().splitlines()
    # Each one a line of "needs attention", with its reason.
    for path, why in ((tree.ws.runs / R / "epoch_1", "expected epoch_01"),
                      (tree.ws.runs / "linkedrun", "symlink out of runs/")):
        assert [ln for ln in lines if f"unusable  {path}" in ln and why in ln], lines


def test_a_work_folder_the_run_does_not_list_is_named(tree: Tree) -> None:
    (line,) = events_about(tree, "set.ignored", f"{GOOD_RUN}/epoch_01/step_01/zero")
    assert "not listed in g1/run.toml" in line["reason"]


def test_future_mtimes_are_capped_and_said_once(tree: Tree) -> None:
    (line,) = events_about(tree, "set.clock_skew", "/future/")
    assert "2100-01-01" in line["reason"] and line["level"] == "warning"
    assert set_status(tree, "future")["state"] == "done"


def test_good_set_beside_them_is_reported(tree: Tree) -> None:
    good = SetId(GOOD_RUN, 1, 1, "good", 1, 3)
    assert tree.ws.has_report(good)
    assert sum("work=good " in body for body in tree.requests) == 2  # g1 and r1's good


# ------------------------------------------------------- state.json (before the database)


@pytest.mark.parametrize(
    "content",
    ['{"version": 1, "sets": [1, 2]}', '{"version": 1, "steps": "x"}', "[]", "{not json"],
    ids=["sets-list", "steps-str", "array", "bad-json"],
)
def test_state_file_of_the_wrong_shape_is_kept_logged_once_and_rebuilt(
    tmp_path: Path, llm_server: LLMServer, content: str
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, extra=NO_AUDIT)
    ws.write_step(R, 1, 1, success=True)
    legacy = ws.runs / ".skilltrain" / "state.json"  # as a daemon before the database left it
    legacy.parent.mkdir(parents=True)
    legacy.write_text(content, encoding="utf-8")
    # status says so too, and writes nothing (no copy: that is the daemon's)
    assert "not a state file" in status.collect(ws.runs)["daemon"]["state_unreadable"]
    assert list(legacy.parent.iterdir()) == [legacy]

    with litellm_warm_and_frozen():
        run_once_in_process(ws)
    release_llm_clients()

    (line,) = ws.events("state.unreadable")
    assert line["level"] == "error" and "rebuilt from runs/" in line["reason"]
    kept = list(legacy.parent.glob("state.json.bad-*"))
    assert [p.read_text(encoding="utf-8") for p in kept] == [content]
    assert ws.state()["sets"][SetId(R, 1, 1, "alpha", 1, 3).id]["state"] == "done"
    assert len(ws.events("step.reported")) == 1
