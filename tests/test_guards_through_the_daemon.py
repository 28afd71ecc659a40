"""Guards a mutation run found unguarded, each through the real daemon.

Each test here failed when its guard was broken on purpose (the break each
one catches is in its own comments): `[integrity] on_leak = "refuse"`, the
prompt archive's leak check, the start-up audit and its cache, the two settle
guards ("changed since we last looked" and "changed while queued") and a set
held back by the budget.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_helpers import (
    InProcessDaemon,
    SetId,
    Workspace,
    build_workspace,
    model_episode,
    set_of_request,
    sha256_text,
    stays,
    wait_until,
    write_cp,
)
from tests.daemon_marks import DAEMON_TEST_MARKS
from tests.llm_server import DEFAULT_REPORT, LLMServer, Reply, Request

pytestmark = DAEMON_TEST_MARKS

Start = Callable[..., InProcessDaemon]


OLD = time.time() - 3600  # an mtime long settled
TOLERANCE_S = 0.05


def human_passage(ws: Workspace, work: str = "alpha", ep: int = 1) -> str:
    """A whole scene of the answer key: what a quoting LLM would copy."""
    text = (ws.data / work / "human" / f"ep{ep:02d}.txt").read_text(encoding="utf-8")
    return "\n".join(text.splitlines()[:14])


def written(ws: Workspace, s: SetId) -> list[str]:
    return [p.name for p in (ws.report(s), ws.sidecar(s), ws.archive(s)) if p.exists()]


# ------------------------------------------------------------------- rule 1


@pytest.mark.parametrize("on_leak", ["redact", "refuse"])
def test_a_report_quoting_the_answer_key_is_redacted_or_refused_as_configured(
    tmp_path: Path, llm_server: LLMServer, start: Start, on_leak: str
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3},
                         extra=f'\n[integrity]\non_leak = "{on_leak}"\n')
    quote = human_passage(ws)
    llm_server.default = lambda request: Reply.ok(f"{DEFAULT_REPORT}\n\nThe human wrote:\n{quote}")
    (s,) = ws.write_step("r1", 1, 1, success=True)
    start(ws)
    if on_leak == "refuse":
        (refused,) = wait_until(lambda: ws.events("loss.refused"), 20, message="loss.refused")
        assert "quotes the human screenplay verbatim" in refused["reason"]
        assert stays(lambda: written(ws, s) == [], 0.3)
    else:
        wait_until(lambda: ws.has_report(s), 20, message="the redacted report")
        report = ws.report(s).read_text(encoding="utf-8")
        assert "[verbatim answer-key passage removed]" in report
        assert max(quote.splitlines(), key=len) not in report
        assert ws.read_sidecar(s)["leaks_redacted"] >= 1
        assert not ws.events("loss.refused")
    assert llm_server.request_count == 1


def test_a_template_that_pastes_answer_key_text_writes_no_prompt_archive(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3})
    template = ws.root / "prompts" / "loss.md.j2"
    # Someone pasted a scene of the answer key into the template as an example.
    pasted = human_passage(ws)
    template.write_text(template.read_text() + "\nFor example:\n" + pasted + "\n")
    (s,) = ws.write_step("r1", 1, 1, success=True)
    start(ws)
    (refused,) = wait_until(lambda: ws.events("loss.refused"), 20, message="loss.refused")
    assert "outside human_scripts" in refused["reason"]
    assert stays(lambda: written(ws, s) == [], 0.3)
    line = max(pasted.splitlines(), key=len)
    # Bytes: the state database is binary.
    assert not [p for p in ws.runs.rglob("*") if p.is_file() and line.encode() in p.read_bytes()]


def test_startup_audit_reports_leaks_and_unreadable_files_and_caches_only_clean_ones(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3})
    notes = ws.runs / "r1" / "notes"
    notes.mkdir(parents=True)
    (notes / "clean.txt").write_text("Nothing of the answer key here.\n")
    (notes / "leak.txt").write_text("copied from the key:\n" + human_passage(ws) + "\n")
    # A damaged gzip: unreadable to root as well as to anyone else.
    (notes / "damaged.txt.gz").write_bytes(b"\x1f\x8b\x08\x00" + b"\xff" * 64)

    def audit_of(n: int) -> dict[str, Any]:
        events = wait_until(lambda: len(ws.events("audit.completed")) >= n and
                            ws.events("audit.completed"), 20, message=f"audit {n}")
        return events[n - 1]

    d = start(ws)
    first = audit_of(1)
    d.stop()
    start(ws)
    second = audit_of(2)

    leak_lines = [e for e in ws.events("audit.leak") if e["file"].endswith("leak.txt")]
    assert len(leak_lines) == 2  # found at both starts: a leaking file is never cached
    assert (first["leaks"], first["errors"], first["skipped"]) == (1, 1, 0)
    assert first["level"] == "warning"
    # The second audit skips the clean file it cached, and reads the damaged one again.
    assert (second["leaks"], second["errors"]) == (1, 1)
    assert second["skipped"] >= 1


# ---------------------------------------------------------------- settle guards


def write_old(path: Path, text: str) -> None:
    """A file as `cp -p` leaves it: new content, an mtime from long ago."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    os.utime(path, (OLD, OLD))


def arrivals(server: LLMServer, s: SetId) -> list[float]:
    return [r.monotonic for r in server.requests
            if (found := set_of_request(r)) and SetId(*found) == s]


def test_a_change_with_an_old_mtime_restarts_the_settle_wait_from_when_it_was_seen(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    settle = 1.0
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3}, settle_s=settle)
    (s,) = ws.sets_of_step("r1", 1, 1)
    scripts = ws.scripts("r1", 1, 1, "alpha")
    for ep in (1, 2):
        write_old(scripts / f"ep{ep:02d}.txt", model_episode("r1", 1, 1, "alpha", ep))
    d = start(ws)
    (scripts / "ep03.txt").write_text(model_episode("r1", 1, 1, "alpha", 3))
    wait_until(lambda: (rec := d.daemon.state.get(s.id)) and rec.state == "settling", 5,
               message="the set settling")
    time.sleep(0.5)
    # cp -p / rsync -t: ep02 changes, and its mtime says it did so an hour ago.
    changed = time.monotonic()
    write_cp(scripts / "ep02.txt", model_episode("r1", 1, 1, "alpha", 2, version=1),
             keep_mtime_of=OLD)
    wait_until(lambda: ws.has_report(s), 10, message="the report")
    (asked,) = arrivals(llm_server, s)
    assert asked - changed >= settle - TOLERANCE_S, f"asked {asked - changed:.2f}s after"


class HoldFirst:
    """Responder: the first set to ask is answered only once `release` is set."""

    def __init__(self) -> None:
        self.first: SetId | None = None
        self.arrived = threading.Event()
        self.release = threading.Event()

    def __call__(self, request: Request) -> Reply:
        found = set_of_request(request)
        if self.first is None and found:
            self.first = SetId(*found)
            self.arrived.set()
            self.release.wait(10)
        return Reply.ok(DEFAULT_REPORT)


def test_a_set_changed_while_its_job_was_queued_settles_again_before_it_runs(
    tmp_path: Path, llm_server: LLMServer, start: Start
) -> None:
    settle = 1.0
    hold = HoldFirst()
    llm_server.default = hold
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 6}, settle_s=settle,
                         concurrency=1)
    sets = ws.sets_of_step("r1", 1, 1)
    scripts = ws.scripts("r1", 1, 1, "alpha")
    for ep in range(1, 7):
        write_old(scripts / f"ep{ep:02d}.txt", model_episode("r1", 1, 1, "alpha", ep))
    start(ws)  # both sets are ready at once: one runs, the other is queued behind it
    assert hold.arrived.wait(20), "no request"
    queued = next(s for s in sets if s != hold.first)
    changed = time.monotonic()
    (scripts / f"ep{queued.first:02d}.txt").write_text(
        model_episode("r1", 1, 1, "alpha", queued.first, version=1))
    time.sleep(0.1)  # the event is in; the job is still queued
    hold.release.set()
    wait_until(lambda: all(ws.has_report(x) for x in sets), 10, message="both reports")
    (asked,) = arrivals(llm_server, queued)
    assert asked - changed >= settle - TOLERANCE_S, f"asked {asked - changed:.2f}s after"
    name = f"ep{queued.first:02d}.txt"
    assert ws.read_sidecar(queued)["model_episodes"][name] == sha256_text(
        (scripts / name).read_text(encoding="utf-8"))
