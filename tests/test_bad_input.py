"""Bad input, end to end: every malformed thing under runs/, data/ or prompts/.

Each case must give one clear line (loss.refused, set.ignored, daemon.failed,
loss.failed, or a waiting state whose reason names the file), write nothing
for the bad set, never send it to the LLM, and leave the daemon processing
the good sets around it. The daemon is real (watchdog, APScheduler, litellm
over HTTP to the loopback server); the trees are real files under tmp_path;
the disk-full cases use a real 200 KiB tmpfs as runs/ (root only, else skipped;
tests/test_atomic.py covers what a failed write leaves without root).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.core.errors import ExitCode
from tests.daemon_helpers import (
    TEMPLATE,
    DaemonProcess,
    InProcessDaemon,
    SetId,
    Start,
    Workspace,
    build_workspace,
    mark_success,
    model_episode,
    release_llm_clients,
    remove_tree,
    run_cli,
    run_once_in_process,
    sha256_text,
    stays,
    wait_until,
)
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.llm_server import DEFAULT_REPORT, LLMServer, Reply

pytestmark = DAEMON_TEST_MARKS

NO_AUDIT = "[integrity]\naudit_on_start = false\n"


# tests.daemon_helpers.MARKER with names that may hold spaces.
MARKER = re.compile(r"SETMARK (.+?) epoch=(\d+) step=(\d+) work=(.+?) ep=(\d+)$", re.M)


def requested_sets(server: LLMServer) -> list[str]:
    """The set id of every request the server received, from the episodes' marker lines."""
    out = []
    for request in server.requests:
        text = "\n".join(str(m.get("content")) for m in request.messages)
        marks = MARKER.findall(text)
        if not marks:
            out.append("?")
            continue
        eps = sorted(int(m[4]) for m in marks)
        run, epoch, step, work = marks[0][:4]
        out.append(SetId(run, int(epoch), int(step), work, eps[0], eps[-1]).id)
    return out


def scans(ws: Workspace) -> int:
    return len(ws.events("scan.completed"))


def set_events(events: list[dict[str, Any]], name: str, s: SetId) -> list[dict[str, Any]]:
    rng = f"{s.first:02d}-{s.last:02d}"
    return [
        e
        for e in events
        if e.get("event") == name
        and (e.get("run"), e.get("epoch"), e.get("step"), e.get("work"), e.get("range"))
        == (s.run, s.epoch, s.step, s.work, rng)
    ]


def nothing_written(ws: Workspace, s: SetId) -> bool:
    return not (ws.report(s).exists() or ws.sidecar(s).exists() or ws.archive(s).exists())


def no_internal_errors(events: list[dict[str, Any]]) -> None:
    bad = [
        e
        for e in events
        if e.get("event") in ("set.error", "watch.handler_error", "daemon.failed")
        or "exception" in e
    ]
    assert not bad, bad


def human_lines(ws: Workspace) -> set[str]:
    """Every substantial line of the answer key (rule 1: none may appear under runs/ or in logs)."""
    lines: set[str] = set()
    for path in ws.data.glob("*/human/*.txt"):
        if path.is_file():
            text = path.read_bytes().decode("utf-8", errors="replace")
            lines |= {line.strip() for line in text.splitlines() if len(line.strip()) >= 30}
    return lines


def write_model(ws: Workspace, run: str, work: str, eps: list[int], step: int = 1) -> Path:
    scripts = ws.scripts(run, 1, step, work)
    scripts.mkdir(parents=True, exist_ok=True)
    for ep in eps:
        (scripts / f"ep{ep:02d}.txt").write_text(
            model_episode(run, 1, step, work, ep), encoding="utf-8"
        )
    return scripts


# ------------------------------------------------------------- the bad tree
#
# One step holding a good work next to one defect per work, processed by one
# live daemon through several resync scans. The tests below each check one
# defect's outcome in it.

WORKS = {
    "good": 3,
    "hmiss": 3,  # work.toml asks for 4-6; the human has only 1-3
    "hempty": 3,
    "hblank": 3,
    "hutf8": 3,
    "hdir": 3,
    "mempty": 3,
    "mblank": 3,
    "mutf8": 3,
    "mgap": 3,
    "hgap": 5,  # human ep03 removed: chunks (1, 4) and (5, 5)
    "many": 5,  # the writer also drops an ep100.txt
    "mlink": 3,
    "mdir": 3,
    "two words": 3,
    "wörk ü": 3,
}
R = "r1"
UNICODE_RUN = "run ü 1"

DONE = [
    SetId(R, 1, 1, "good", 1, 3),
    SetId(R, 1, 1, "hmiss", 1, 3),
    SetId(R, 1, 1, "hgap", 5, 5),
    SetId(R, 1, 1, "many", 1, 3),
    SetId(R, 1, 1, "many", 4, 5),
    SetId(R, 1, 1, "two words", 1, 3),
    SetId(R, 1, 1, "wörk ü", 1, 3),
    SetId(UNICODE_RUN, 1, 1, "good", 1, 3),
    SetId(UNICODE_RUN, 1, 1, "wörk ü", 1, 3),
]
REFUSED = {
    SetId(R, 1, 1, "hmiss", 4, 6): "no human episodes 4-6",
    SetId(R, 1, 1, "hempty", 1, 3): "ep02.txt is empty (0 bytes)",
    SetId(R, 1, 1, "hblank", 1, 3): "ep01.txt is empty (no letter or digit",
    SetId(R, 1, 1, "hutf8", 1, 3): "ep03.txt is not valid UTF-8 (byte 4)",
    SetId(R, 1, 1, "hdir", 1, 3): "ep02.txt is not a regular file",
    SetId(R, 1, 1, "mblank", 1, 3): "ep01.txt is empty (no letter or digit",
    SetId(R, 1, 1, "mutf8", 1, 3): "ep02.txt is not valid UTF-8 (byte 5)",
}
WAITING = {
    SetId(R, 1, 1, "mempty", 1, 3): "ep02.txt is empty",
    SetId(R, 1, 1, "mgap", 1, 3): "ep02.txt missing",
    SetId(R, 1, 1, "mlink", 1, 3): "ep02.txt is a symlink out of runs/; not followed",
    SetId(R, 1, 1, "mdir", 1, 3): "ep02.txt is not a regular file",
    SetId(R, 1, 1, "hgap", 1, 4): "ep03.txt missing",
}
SECRET = "OUTSIDE-RUNS secret line that must never be read into a prompt or a log"


@dataclass
class TreeResult:
    ws: Workspace
    events: list[dict[str, Any]]
    requests: list[str]  # set ids, in arrival order
    request_bodies: list[str]
    state: dict[str, Any]
    scans: int
    loop_ok: bool


def build_bad_tree(ws: Workspace) -> None:
    data, human = ws.data, (lambda w: ws.data / w / "human")
    (data / "hmiss" / "work.toml").write_text("ranges = [[1, 3], [4, 6]]\n")
    (human("hempty") / "ep02.txt").write_bytes(b"")
    (human("hblank") / "ep01.txt").write_text("  \n\t\n   \n")
    (human("hutf8") / "ep03.txt").write_bytes(b"INT.\xff\xfe HARBOUR - NIGHT\n")
    (human("hdir") / "ep02.txt").unlink()
    (human("hdir") / "ep02.txt").mkdir()
    (human("hgap") / "ep03.txt").unlink()

    for work in ("good", "hmiss", "hempty", "hblank", "hutf8", "hdir", "two words", "wörk ü"):
        write_model(ws, R, work, list(range(1, 4)))
    write_model(ws, R, "hmiss", [4, 5, 6])
    scripts = write_model(ws, R, "mempty", [1, 3])
    (scripts / "ep02.txt").write_bytes(b"")
    scripts = write_model(ws, R, "mblank", [2, 3])
    (scripts / "ep01.txt").write_text("\n   \n")
    scripts = write_model(ws, R, "mutf8", [1, 3])
    (scripts / "ep02.txt").write_bytes(b"INT. \xff\xfe DOCK - DAY\nMARA\nHello.\n")
    write_model(ws, R, "mgap", [1, 3])
    write_model(ws, R, "hgap", [1, 2, 4, 5])  # mirrors the human numbering: no ep03
    scripts = write_model(ws, R, "many", [1, 2, 3, 4, 5])
    (scripts / "ep100.txt").write_text(model_episode(R, 1, 1, "many", 100))
    secret = ws.outside / "secret.txt"
    secret.write_text(SECRET + "\n")
    scripts = write_model(ws, R, "mlink", [1, 3])
    (scripts / "ep02.txt").symlink_to(secret)
    scripts = write_model(ws, R, "mdir", [1, 3])
    (scripts / "ep02.txt").mkdir()
    ghost = write_model(ws, R, "ghost", [1, 2, 3])  # no data/ghost: unknown work
    assert ghost.is_dir()
    # A run with a unicode name and a space, limited to two works by its run.toml.
    (ws.runs / UNICODE_RUN).mkdir()
    (ws.runs / UNICODE_RUN / "run.toml").write_text('works = ["good", "wörk ü"]\n')
    write_model(ws, UNICODE_RUN, "good", [1, 2, 3])
    write_model(ws, UNICODE_RUN, "wörk ü", [1, 2, 3])


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TreeResult]:
    server = LLMServer().start()
    try:
        root = tmp_path_factory.mktemp("badtree")
        ws = build_workspace(
            root, server.url, works=WORKS, settle_s=0.2, resync_s=1.0, concurrency=4
        )
        build_bad_tree(ws)
        d = InProcessDaemon(ws).start()
        try:
            wait_until(
                lambda: (
                    all(ws.has_report(s) for s in DONE)
                    and len(ws.events("loss.refused")) >= len(REFUSED)
                ),
                30,
                message=lambda: (
                    f"reports {[s.id for s in DONE if not ws.has_report(s)]} "
                    f"refusals {len(ws.events('loss.refused'))}"
                ),
            )
            settled = scans(ws)
            wait_until(lambda: scans(ws) >= settled + 3, 15, message="three more scans")
            loop_ok = d._thread is not None and d._thread.is_alive()
        finally:
            d.stop()
        yield TreeResult(
            ws=ws,
            events=ws.events(),
            requests=requested_sets(server),
            request_bodies=[json.dumps(r.body) for r in server.requests],
            state=ws.state(),
            scans=scans(ws),
            loop_ok=loop_ok,
        )
    finally:
        server.stop()
        release_llm_clients()


def test_good_sets_next_to_bad_ones_are_each_reported_exactly_once(tree: TreeResult) -> None:
    assert tree.loop_ok, "the daemon's main loop died"
    assert Counter(tree.requests) == {s.id: 1 for s in DONE}, tree.requests
    for s in DONE:
        sidecar = tree.ws.read_sidecar(s)
        assert tree.ws.report(s).read_text(encoding="utf-8").strip() == DEFAULT_REPORT
        assert sidecar["first"] == s.first and sidecar["last"] == s.last
    no_internal_errors(tree.events)
    assert tree.ws.temp_files() == []


@pytest.mark.parametrize("s", list(REFUSED), ids=lambda s: f"{s.work}-{s.first}-{s.last}")
def test_bad_episode_is_refused_once_with_one_line_and_nothing_written(
    tree: TreeResult, s: SetId
) -> None:
    refusals = set_events(tree.events, "loss.refused", s)
    assert len(refusals) == 1, f"{len(refusals)} refusals over {tree.scans} scans"
    reason = refusals[0]["reason"]
    assert REFUSED[s] in reason and "\n" not in reason, reason
    assert refusals[0]["level"] == "warning"
    assert tree.state["sets"][s.id]["state"] == "refused"
    assert s.id not in tree.requests
    assert nothing_written(tree.ws, s)


@pytest.mark.parametrize("s", list(WAITING), ids=lambda s: f"{s.work}-{s.first}-{s.last}")
def test_incomplete_or_unusable_range_waits_without_an_llm_call(tree: TreeResult, s: SetId) -> None:
    record = tree.state["sets"][s.id]
    assert record["state"] == "waiting"
    assert WAITING[s] in (record["reason"] or ""), record
    assert s.id not in tree.requests
    assert not set_events(tree.events, "loss.queued", s)
    assert nothing_written(tree.ws, s)


@pytest.mark.parametrize("work", ["mlink", "mdir"])
def test_unusable_model_episode_is_reported_in_the_log(tree: TreeResult, work: str) -> None:
    lines = [
        e
        for e in tree.events
        if e.get("level") in ("warning", "error")
        and work in json.dumps(e, ensure_ascii=False)
        and "ep02.txt" in json.dumps(e, ensure_ascii=False)
    ]
    assert len(lines) == 1, "expected one warning line naming the file"


def test_gap_in_the_human_numbering_is_reported(tree: TreeResult) -> None:
    """The answer key's own hole, said once at start about data/hgap/human: not
    any line that happens to hold "hgap" and "03" (a waiting set's would)."""
    human = str(tree.ws.data / "hgap" / "human")
    lines = [e for e in tree.events if e.get("path") == human]
    assert [(e["event"], e["level"], e["reason"]) for e in lines] == [
        ("work.range_incomplete", "warning",
         "range 01-04 can never be reported: human ep03.txt missing")
    ], lines


def test_episode_outside_every_range_is_ignored(tree: TreeResult) -> None:
    """ep100.txt in a 5-episode work: in no range, never sent, no set for it."""
    assert all("ep=100" not in body for body in tree.request_bodies)
    assert not [k for k in tree.state["sets"] if "/many/" in k and "100" in k.split("/")[-1]]
    many = [s for s in DONE if s.work == "many"]
    for s in many:
        assert "ep100.txt" not in tree.ws.read_sidecar(s)["model_episodes"]


def test_symlink_out_of_runs_is_not_followed(tree: TreeResult) -> None:
    assert all(SECRET not in body for body in tree.request_bodies)
    assert SECRET not in tree.ws.log_file.read_text(encoding="utf-8")
    assert SECRET.encode() not in tree.ws.state_file.read_bytes()


def test_episode_being_written_is_not_reported_as_unusable(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, settle_s=0.5, extra=NO_AUDIT)
    start(ws)
    scripts = ws.scripts(R, 1, 1, "alpha")
    scripts.mkdir(parents=True)
    for ep in (1, 2, 3):
        # A generator opens its output file, then waits for its model's first tokens.
        with open(scripts / f"ep{ep:02d}.txt", "w", encoding="utf-8") as f:
            time.sleep(0.3)
            f.write(model_episode(R, 1, 1, "alpha", ep))
    s = SetId(R, 1, 1, "alpha", 1, 3)
    wait_until(lambda: set_events(ws.events(), "loss.completed", s), 15, message="the report")
    warnings = [e for e in ws.events() if e.get("level") in ("warning", "error")]
    assert warnings == [], warnings


def test_unknown_work_folder_is_ignored_once(tree: TreeResult) -> None:
    ghost = tree.ws.step_dir(R, 1, 1) / "ghost"
    lines = [e for e in tree.events if e.get("event") == "set.ignored"]
    assert [e["path"] for e in lines] == [str(ghost)], lines
    assert "unknown work" in lines[0]["reason"]
    assert tree.scans >= 4  # ... over several scans
    assert not [k for k in tree.state["sets"] if "/ghost/" in k]


def test_unicode_and_space_names_are_processed(tree: TreeResult) -> None:
    for s in DONE:
        if " " in s.run + s.work or "ü" in s.run + s.work:
            done = set_events(tree.events, "loss.completed", s)
            assert len(done) == 1
            assert done[0]["report"] == str(tree.ws.report(s))
    # The log stays valid UTF-8 JSON, names included verbatim.
    text = tree.ws.log_file.read_text(encoding="utf-8")
    assert "wörk ü" in text and UNICODE_RUN in text


def test_no_answer_key_text_anywhere_the_daemon_writes(tree: TreeResult) -> None:
    """Rule 1, over every refusal above: reasons name files and numbers, never text."""
    secrets = human_lines(tree.ws)
    assert secrets
    written = [tree.ws.log_file, *(p for p in tree.ws.runs.rglob("*") if p.is_file())]
    for path in written:
        if "/scripts/" in str(path):
            continue  # the writer's own files
        text = path.read_bytes().decode("utf-8", errors="replace")
        leaked = [line for line in secrets if line in text]
        assert not leaked, f"{path}: {leaked[:2]}"


# ------------------------------------------------------------- odd names


def test_run_folder_with_a_non_utf8_name_is_logged(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, settle_s=0.2, extra=NO_AUDIT)
    run = os.fsdecode(b"r\xff")  # what Python makes of the byte name b"r\xff"
    scripts = ws.scripts(run, 1, 1, "alpha")
    scripts.mkdir(parents=True)
    for ep in (1, 2, 3):
        (scripts / f"ep{ep:02d}.txt").write_text(model_episode("rX", 1, 1, "alpha", ep))
    mark_success(scripts)
    d = start(ws)
    s = SetId(run, 1, 1, "alpha", 1, 3)
    wait_until(lambda: ws.has_report(s), 15, message="the report")
    d.stop()  # drained: every line of the job is written (or lost) by now
    (done,) = ws.events("loss.completed")
    # The name itself, as the byte 0xff that it holds, not a "?" or a lost field:
    # the line is UTF-8 and says the byte as an escape that reads back as the name.
    assert done["run"] == run and done["report"] == str(ws.report(s))
    (raw,) = [ln for ln in ws.log_file.read_bytes().splitlines() if b'"loss.completed"' in ln]
    assert b'"run": "r\\udcff"' in raw, raw
    assert all(e["run"] == run for e in ws.events() if "run" in e)


# ------------------------------------------------------------- a 50 MB episode


def proc_self(key: str, path: str = "/proc/self/status") -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    raise KeyError(key)


def write_big_episode(path: Path, size: int) -> int:
    """About `size` bytes of screenplay-like text; returns the exact size."""
    line = "MARA\nThe tide comes over the quay and the lantern gutters in the wind.\n\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(line * (size // len(line)))
    return path.stat().st_size


def test_50mb_episode_is_refused_from_its_size_without_being_read(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    """A model with a known window (gpt-4o-mini: 128,000 tokens, so 2,048,000 bytes)."""
    from skilltrain.daemon.infra import llm

    model = "openai/gpt-4o-mini"
    ws = build_workspace(
        tmp_path, llm_server.url, works={"good": 3, "big": 3}, settle_s=0, extra=NO_AUDIT
    )
    ws.config_path.write_text(
        ws.config_path.read_text().replace('"openai/loopback-model"', f'"{model}"')
    )
    good, big = SetId(R, 1, 1, "good", 1, 3), SetId(R, 1, 1, "big", 1, 3)
    ws.write_step(R, 1, 1)
    size = write_big_episode(ws.scripts(R, 1, 1, "big") / "ep02.txt", 50_000_000)
    # This model's tokenizer and info, loaded outside the measurement.
    llm.count_tokens(model, [{"role": "user", "content": "warm up"}])
    llm.max_input_tokens(model)
    can_reset_peak = os.access("/proc/self/clear_refs", os.W_OK)
    if can_reset_peak:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    rss0, read0 = proc_self("VmRSS:"), proc_self("rchar:", "/proc/self/io")

    run_once_in_process(ws)

    peak_kb = proc_self("VmHWM:") - rss0
    read_mb = (proc_self("rchar:", "/proc/self/io") - read0) / 1e6
    print(f"50 MB episode: peak RSS +{peak_kb / 1024:.1f} MB, read {read_mb:.1f} MB")
    refused = set_events(ws.events(), "loss.refused", big)
    assert len(refused) == 1
    reason = refused[0]["reason"]
    assert "over the 2,048,000-byte limit" in reason, reason
    assert f"(largest: ep02.txt, {size:,} bytes)" in reason, reason
    assert requested_sets(llm_server) == [good.id]
    assert ws.has_report(good) and nothing_written(ws, big)
    assert read_mb < 20, "the daemon read the 50 MB file"
    if can_reset_peak:
        assert peak_kb < 25 * 1024, f"peak RSS grew {peak_kb} kB"
    release_llm_clients()


@pytest.mark.slow
def test_50mb_episode_is_refused_when_the_model_window_is_unknown(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    ws = build_workspace(
        tmp_path, llm_server.url, works={"good": 3, "big": 3}, settle_s=60, extra=NO_AUDIT
    )
    ws.write_step(R, 1, 1, ["good"], success=True)
    big = SetId(R, 1, 1, "big", 1, 3)
    with DaemonProcess(ws, name="big") as daemon:
        daemon.wait_event("loss.completed", 60)  # litellm imported, tokenizer loaded
        base_kb = proc_self("VmRSS:", f"/proc/{daemon.pid}/status")
        scripts = write_model(ws, R, "big", [1, 3])
        write_big_episode(scripts / "ep02.txt", 50_000_000)
        mark_success(scripts)

        def outcome() -> str | None:
            if set_events(ws.events(), "loss.refused", big):
                return "refused"
            rss = proc_self("VmRSS:", f"/proc/{daemon.pid}/status")
            if rss - base_kb > 40 * 1024:
                return f"read into memory (RSS +{(rss - base_kb) // 1024} MB)"
            return None

        result = wait_until(outcome, 30, interval=0.01, message="a refusal or a read")
    assert result == "refused"


# ------------------------------------------------------------- config and template


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[loss]\nconcurency = 4\n", "unknown key [loss] concurency (did you mean 'concurrency'?)"),
        (
            '[watch]\nobsever = "polling"\n',
            "unknown key [watch] obsever (did you mean 'observer'?)",
        ),
        ('[lgo]\nlevel = "info"\n', "unknown key lgo (did you mean 'log'?)"),
        ("[llm]\ntimout = 5\n", "unknown key [llm] timout (did you mean 'timeout_s'?)"),
    ],
    ids=["loss", "watch", "section", "llm"],
)
def test_config_with_a_typo_exits_2_with_one_line_naming_the_key(
    tmp_path: Path, toml: str, expected: str
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[paths]\nruns = "runs"\n{toml}', encoding="utf-8")
    result = run_cli("daemon", "--config", str(config), cwd=tmp_path)[0]
    assert result.returncode == ExitCode.CONFIG == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0] and str(config) in lines[0], lines[0]
    assert not (tmp_path / "runs").exists(), "nothing may happen before the config is valid"


BROKEN_SYNTAX = "Line one.\nLine two.\n{{ work | }}\n{{ human_scripts }}\n{{ model_scripts }}\n"
BROKEN_NAME = "Line one.\n{{ no_such_variable }}\n{{ human_scripts }}\n{{ model_scripts }}\n"


def test_template_syntax_error_at_start_exits_2_naming_the_line(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, extra=NO_AUDIT)
    template = ws.root / "prompts" / "loss.md.j2"
    template.write_text(BROKEN_SYNTAX, encoding="utf-8")
    ws.write_step(R, 1, 1, success=True)
    result = run_cli("daemon", "--config", str(ws.config_path), cwd=tmp_path)[0]
    assert result.returncode == ExitCode.CONFIG == 2, result.stderr
    # stderr is the journal here (not a terminal): the error is one JSON event
    # among the others, not a plain line in the middle of them.
    lines = result.stderr.splitlines()
    assert all(line.startswith("{") for line in lines), result.stderr
    (on_stderr,) = [e for e in map(json.loads, lines) if e["event"] == "daemon.failed"]
    assert on_stderr["reason"].startswith(f"template {template}, line 3:"), on_stderr
    failed = ws.events("daemon.failed")
    assert len(failed) == 1 and failed[0]["exit_code"] == 2
    assert "line 3" in failed[0]["reason"]
    assert llm_server.request_count == 0 and ws.all_reports() == []


def replace_atomically(path: Path, text: str) -> None:
    """As an editor saves: a new file renamed over the old (a reader never sees half)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def test_template_broken_while_running_fails_jobs_naming_the_line_then_recovers(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(
        tmp_path,
        llm_server.url,
        works={"alpha": 3},
        resync_s=1.0,
        max_attempts=2,
        retry_backoff_s=0.2,
        extra=NO_AUDIT,
    )
    template = ws.root / "prompts" / "loss.md.j2"
    original = TEMPLATE.read_text(encoding="utf-8")
    a = ws.write_step(R, 1, 1, success=True)[0]
    d = start(ws)
    wait_until(lambda: ws.has_report(a), 15, message="the first report")
    a_report = ws.report(a).read_bytes()

    # 1. A syntax error.
    replace_atomically(template, BROKEN_SYNTAX)
    b = ws.write_step(R, 1, 2, success=True)[0]
    wait_until(lambda: set_events(ws.events(), "loss.failed", b), 10, message="loss.failed for b")
    reason = set_events(ws.events(), "loss.failed", b)[0]["reason"]
    assert f"template {template}, line 3:" in reason and "\n" not in reason, reason

    # 2. A variable that does not exist: a render error, named with its line.
    replace_atomically(template, BROKEN_NAME)
    c = ws.write_step(R, 1, 3, success=True)[0]
    wait_until(lambda: set_events(ws.events(), "loss.failed", c), 10, message="loss.failed for c")
    reason = set_events(ws.events(), "loss.failed", c)[0]["reason"]
    assert "line 2" in reason and "'no_such_variable' is undefined" in reason, reason
    assert d.daemon.watcher.alive() and not d.daemon.stop_event.is_set()
    assert d._thread is not None and d._thread.is_alive()
    for s in (b, c):
        assert nothing_written(ws, s)
    assert ws.report(a).read_bytes() == a_report, "a failed redo must not touch the old report"

    # 3. Fixed: the failed sets are redone by the next scans, a's report is current again.
    replace_atomically(template, original)
    wait_until(lambda: ws.has_report(b) and ws.has_report(c), 15, message="b and c reported")
    first = scans(ws)
    wait_until(lambda: scans(ws) >= first + 2, 10, message="two more scans")
    assert Counter(requested_sets(llm_server)) == {a.id: 1, b.id: 1, c.id: 1}
    assert ws.report(a).read_bytes() == a_report
    template_hash = sha256_text(original)
    for s in (a, b, c):
        assert ws.read_sidecar(s)["inputs"]["template_sha256"] == template_hash
    records = [d.daemon.state.get(s.id) for s in (a, b, c)]
    assert [r.state if r else None for r in records] == ["done"] * 3
    d.stop()  # drained: no write of the daemon's is in progress now
    assert ws.temp_files() == []


# ------------------------------------------------------------- runs/ deleted


@pytest.mark.parametrize("log_inside", [False, True], ids=["log-outside", "log-inside-runs"])
def test_runs_deleted_during_a_job_and_recreated_is_survived(
    tmp_path: Path, llm_server: LLMServer, start: Start, log_inside: bool
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, extra=NO_AUDIT)
    if log_inside:
        text = ws.config_path.read_text().replace(
            'file = "skilltrain.jsonl"', 'file = "runs/skilltrain.jsonl"'
        )
        ws.config_path.write_text(text)
        ws.log_file = ws.runs / "skilltrain.jsonl"
    llm_server.script(Reply.delay(1.0, Reply.ok(DEFAULT_REPORT)))  # in flight during rm -rf
    a = ws.write_step(R, 1, 1, success=True)[0]
    d = start(ws)
    wait_until(lambda: llm_server.request_count == 1, 15, message="a's request")
    old_log = ws.log_file.read_text(encoding="utf-8") if log_inside else ""
    remove_tree(ws.runs)
    if not log_inside:
        wait_until(lambda: ws.events("watch.root_missing"), 10, message="watch.root_missing")
        assert stays(lambda: not d.daemon.stop_event.is_set(), 1.2)  # waits, does not die
    ws.runs.mkdir(exist_ok=True)  # inside: the log handler may have recreated it already
    wait_until(lambda: ws.events("watch.restarted"), 10, message="watch.restarted")
    b = ws.write_step(R, 1, 2, success=True)[0]
    # The report is written before its loss.completed line: wait for the line.
    wait_until(
        lambda: set_events(ws.events(), "loss.completed", b), 15, message="b's loss.completed"
    )

    assert d._thread is not None and d._thread.is_alive() and d.loop_error is None
    assert d.daemon.watcher.alive() and not d.daemon.stop_event.is_set()
    events = ws.events()
    no_internal_errors(events)
    assert set_events(events, "loss.started", a) or "loss.started" in old_log
    lock = ws.runs / ".skilltrain" / "daemon.lock"
    assert lock.read_text().strip() == str(os.getpid())
    assert ws.report(b).read_text(encoding="utf-8").strip() == DEFAULT_REPORT
    d.stop()  # drained: no write of the daemon's is in progress now
    assert ws.temp_files() == []


# ------------------------------------------------------------- disk full


@contextlib.contextmanager
def tmpfs_runs(ws: Workspace, size: str = "200k") -> Iterator[Path]:
    """Mount a small tmpfs over ws.runs (root only); skip the test when that is impossible."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(ws.runs)],
        capture_output=True,
        text=True,
        timeout=10,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.strip()}")
    try:
        yield ws.runs
    finally:
        subprocess.run(["umount", "-l", str(ws.runs)], capture_output=True, timeout=10)


def fill(directory: Path, leave_pages: int = 0) -> Path:
    """Fill the filesystem of `directory`, then free `leave_pages` pages of 4 KiB."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    written = 0
    try:
        while True:
            written += os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    if leave_pages:
        os.truncate(filler, max(0, written - leave_pages * 4096))
    return filler


def disk_full_workspace(root: Path, url: str, retry_backoff_s: float = 1.0) -> Workspace:
    """Retries at least ~0.8 s apart: right after a loss.failed line no attempt is writing."""
    return build_workspace(
        root,
        url,
        works={"alpha": 3},
        settle_s=60,  # only _SUCCESS makes the set ready: the test decides when
        max_attempts=20,
        retry_backoff_s=retry_backoff_s,
        extra=NO_AUDIT,
    )


@dataclass
class DiskFullResult:
    ws: Workspace
    s: SetId
    failed: list[dict[str, Any]]
    written_while_full: list[str]
    requests: int


@pytest.fixture(scope="module")
def disk_full(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DiskFullResult]:
    """runs/ on a full 200 KiB tmpfs when a report is due; space is freed after a failure.

    The daemon runs with its main loop, which writes runs/.skilltrain/state.sqlite3
    and must survive ENOSPC (state.write_failed) while the report is retried.
    """
    server = LLMServer().start()
    ws = disk_full_workspace(tmp_path_factory.mktemp("diskfull"), server.url)
    try:
        with tmpfs_runs(ws):
            s = ws.write_step(R, 1, 1)[0]
            d = InProcessDaemon(ws).start()
            try:
                filler = fill(ws.runs)
                mark_success(ws.scripts(R, 1, 1, "alpha"))  # an empty file needs no page
                wait_until(lambda: len(ws.events("loss.failed")) >= 2, 15, message="two failures")
                written = sorted(
                    str(p.relative_to(ws.runs))
                    for p in ws.runs.rglob("*")
                    if p.is_file() and "/scripts/" not in str(p)
                )
                filler.unlink()
                wait_until(lambda: ws.has_report(s), 15, message="the report once space is free")
            finally:
                d.stop()
            yield DiskFullResult(ws, s, ws.events("loss.failed"), written, server.request_count)
    finally:
        server.stop()
        release_llm_clients()


def test_disk_full_while_writing_a_report_writes_nothing_then_succeeds(
    disk_full: DiskFullResult,
) -> None:
    ws, s = disk_full.ws, disk_full.s
    assert disk_full.failed and all(e["level"] == "error" for e in disk_full.failed)
    # While the disk was full: no report, no sidecar, no archive, no temp file.
    own = {".skilltrain/daemon.lock", ".skilltrain/state.sqlite3", ".skilltrain/state.sqlite3-wal",
           ".skilltrain/state.sqlite3-shm", "filler"}
    assert set(disk_full.written_while_full) <= own, disk_full.written_while_full
    # Afterwards: one complete, current report.
    sidecar = ws.read_sidecar(s)
    scripts = ws.scripts(s.run, s.epoch, s.step, s.work)
    for ep in (1, 2, 3):
        text = (scripts / f"ep{ep:02d}.txt").read_text(encoding="utf-8")
        assert sidecar["model_episodes"][f"ep{ep:02d}.txt"] == sha256_text(text)
    assert sidecar["report_sha256"] == sha256_text(ws.report(s).read_text(encoding="utf-8"))
    assert ws.archive(s).is_file()
    assert ws.temp_files() == []
    print(f"disk full: {len(disk_full.failed)} loss.failed lines, {disk_full.requests} requests")


def test_disk_full_failure_line_names_the_cause_once_per_attempt(
    disk_full: DiskFullResult,
) -> None:
    attempts = [e for e in disk_full.failed if "attempts" in e]
    assert len(disk_full.failed) == len(attempts), "one loss.failed line per attempt"
    assert all("No space left on device" in e["reason"] for e in disk_full.failed)


def test_disk_full_does_not_stop_the_daemon(tmp_path: Path, llm_server: LLMServer) -> None:
    ws = disk_full_workspace(tmp_path, llm_server.url)
    with tmpfs_runs(ws):
        ws.write_step(R, 1, 1)
        d = InProcessDaemon(ws).start()
        filler = fill(ws.runs)
        try:
            mark_success(ws.scripts(R, 1, 1, "alpha"))  # state changes: a flush is due
            wait_until(lambda: ws.events("loss.failed"), 15, message="a failure")
            alive = stays(lambda: d._thread is not None and d._thread.is_alive(), 2.5)
            assert alive, f"main loop died: {d.loop_error!r}"
            d.stop()  # while the disk is still full
            assert ws.events("daemon.stopped")
        finally:
            with contextlib.suppress(BaseException):
                d.stop()
            filler.unlink()


def test_disk_full_between_archive_and_report_leaves_nothing_of_the_set(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    # A 64 KiB report cannot fit in 8 free pages; the ~10 KiB archive can.
    llm_server.default = lambda request: Reply.ok(("The scene turns late. " * 3000)[:65536])
    ws = disk_full_workspace(tmp_path, llm_server.url, retry_backoff_s=60)  # one attempt
    with tmpfs_runs(ws):
        s = ws.write_step(R, 1, 1)[0]
        d = InProcessDaemon(ws).start()
        filler = fill(ws.runs, leave_pages=8)
        try:
            mark_success(ws.scripts(R, 1, 1, "alpha"))
            wait_until(lambda: ws.events("loss.failed"), 15, message="a failure")
            left = {p.name for p in (ws.report(s), ws.sidecar(s), ws.archive(s)) if p.exists()}
            temps = ws.temp_files()
        finally:
            filler.unlink()  # room for shutdown's state write
            d.stop()
    assert temps == []
    assert left == set(), f"left behind by the failed write: {left}"
