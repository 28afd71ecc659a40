"""`skilltrain status` on a generated state of many runs and steps.

The state is written by the daemon's own store (StateStore.update/flush), the
run records by the loop's (run_record.write), the lock by the daemon's lock:
status reads them as it reads a real daemon's. Each test runs the real
command line and checks the text a person reads against `--json` and
against what the generator put there.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.commands.status import ATTENTION_SHOWN
from skilltrain.daemon.core import layout
from skilltrain.daemon.core.lock import RunsLock
from skilltrain.daemon.infra.state import BUDGET_REASON, SetState, StateStore
from skilltrain.daemon.service import run_record

from .daemon_helpers import run_cli

RUNS, STEPS, WORKS = 12, 40, 5  # 2,400 sets, 480 steps
BUDGET_USD = 5.0
ATTENTION_LINE = re.compile(r"^  (failed|refused|unusable|stalled|held)\s+(\S+)\s")


@dataclass
class Tree:
    root: Path
    config: Path
    runs: Path
    attention: dict[str, str] = field(default_factory=dict)  # id -> kind
    sets: dict[str, dict[str, int]] = field(default_factory=dict)  # run -> state -> n
    steps: dict[str, list[str]] = field(default_factory=dict)  # run -> step ids
    spend: dict[str, float] = field(default_factory=dict)
    running_for_hours: list[str] = field(default_factory=list)  # stalled while a daemon runs

    def run_of(self, subject: str) -> str:
        prefix = f"{self.runs}/"
        return (subject[len(prefix):] if subject.startswith(prefix) else subject).split("/")[0]

    def status(self, *args: str) -> str:
        result, _ = run_cli("status", *args, "--config", str(self.config))
        assert result.returncode == 0, result.stderr
        return result.stdout

    def json(self, *args: str) -> dict[str, Any]:
        data = json.loads(self.status("--json", *args))
        assert isinstance(data, dict)
        return data


def set_id(run: str, k: int, w: int) -> str:
    return f"{run}/epoch_{k // 10:02d}/step_{k % 10:02d}/w{w}/01-03"


def generate(root: Path, problems: int) -> Tree:
    """RUNS x STEPS x WORKS sets, all reported, then `problems` of each kind spread over runs."""
    runs, data = root / "runs", root / "data"
    data.mkdir(parents=True)
    config = root / "config.toml"
    config.write_text(f'[paths]\ndata = "{data}"\nruns = "{runs}"\n'
                      f"[llm]\nbudget_usd = {BUDGET_USD}\n[loss]\nmax_attempts = 5\n"
                      "[optimizer]\nmax_attempts = 3\n", encoding="utf-8")
    tree = Tree(root, config, runs)
    store = StateStore(runs)
    store.load()
    names = [f"run{r:02d}" for r in range(RUNS)]
    for run in names:
        (runs / run).mkdir(parents=True)
        tree.steps[run] = [f"{run}/epoch_{k // 10:02d}/step_{k % 10:02d}" for k in range(STEPS)]
        for k in range(STEPS):
            for w in range(WORKS):
                store.update(set_id(run, k, w), SetState.DONE, reason=None)
            rec = store.step(tree.steps[run][k])
            rec.reported_at, rec.optimizer_done, rec.optimizer_exit_code = time.time(), True, 0
        cost = 0.25 * (1 + names.index(run))
        store.add_spend(run, 1000, 100, 0, cost)
        tree.spend[run] = cost

    def change(sid: str, state: SetState, kind: str | None, **fields: Any) -> None:
        store.update(sid, state, **{"reason": None, **fields})
        if kind:
            tree.attention[sid] = kind

    now = time.time()
    for n in range(problems):
        run = names[n % RUNS]
        k = 1 + n // RUNS * 4
        change(set_id(run, k, 0), SetState.FAILED, "failed", attempts=5,
               reason="InternalServerError (HTTP 500)")
        change(set_id(run, k, 1), SetState.FAILED, "failed", attempts=1,
               next_retry_at=now + 300, reason="Timeout")
        change(set_id(run, k, 2), SetState.REFUSED, "refused", reason="ep02.txt is empty")
        change(set_id(run, k + 1, 0), SetState.WAITING, "unusable",
               reason="ep02.txt missing, but _SUCCESS says the writer finished")
        store.notice(f"{runs}/{set_id(run, k + 1, 0).rsplit('/', 1)[0]}/scripts",
                     "set.unusable", "ep02.txt missing, but _SUCCESS says the writer finished")
        change(set_id(run, k + 2, 0), SetState.HELD, "held", reason="budget reached")
        change(set_id(run, k + 2, 1), SetState.RUNNING, None)
        store.sets[set_id(run, k + 2, 1)].updated_at = now - 7200  # past any job's bound
        tree.running_for_hours.append(set_id(run, k + 2, 1))
        # Not problems: the writer still writing, a backlog being worked through.
        change(set_id(run, k + 3, 0), SetState.WAITING, None, reason="ep03.txt missing")
        change(set_id(run, k + 3, 1), SetState.QUEUED, None)
        # A report whose inputs changed, its redo held back by the budget: held, not backlog.
        change(set_id(run, k + 3, 2), SetState.STALE, "held", reason=BUDGET_REASON)
    # Steps and runs that need someone, and a folder the daemon cannot use.
    failing = store.step(tree.steps[names[1]][5])
    failing.optimizer_done, failing.optimizer_attempts, failing.optimizer_exit_code = False, 1, 2
    tree.attention[tree.steps[names[1]][5]] = "failed"
    given_up = store.step(tree.steps[names[2]][6])
    given_up.optimizer_done, given_up.optimizer_attempts, given_up.optimizer_exit_code = \
        False, 3, 1
    tree.attention[tree.steps[names[2]][6]] = "stalled"
    epoch_1 = f"{runs}/{names[3]}/epoch_1"
    store.notice(epoch_1, "set.ignored", "expected epoch_01 (zero-padded); not read")
    tree.attention[epoch_1] = "unusable"
    run_record.write(runs, names[4], run_record.RunRecord(
        epoch=3, step=9, phase=run_record.Phase.WRITING,
        stalled="the writer failed 3 times: exit 1"))
    tree.attention[names[4]] = "stalled"
    run_record.write(runs, names[5], run_record.RunRecord(epoch=3, step=9,
                                                          phase=run_record.Phase.SCORING))
    (runs / names[5] / run_record.PAUSE).touch()
    tree.attention[names[5]] = "held"
    store.flush(force=True)
    store.close()
    for sid, rec in StateStore.read_snapshot(runs)[0].sets.items():
        counts = tree.sets.setdefault(sid.split("/", 1)[0], {})
        counts[rec.state.value] = counts.get(rec.state.value, 0) + 1
    return tree


@pytest.fixture
def many(tmp_path: Path) -> Tree:
    return generate(tmp_path, problems=24)  # 6 per problem x 24 + 5 others: far over the cap


@pytest.fixture
def few(tmp_path: Path) -> Tree:
    return generate(tmp_path, problems=2)  # 17 things that need someone: under the cap


def attention_named(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for line in text.splitlines()
            if (m := ATTENTION_LINE.match(line))]


def run_lines(text: str) -> dict[str, list[str]]:
    """Each run line's columns (split on two or more spaces)."""
    return {cols[0]: cols for line in text.splitlines()
            if re.match(r"run\d\d ", line) and (cols := re.split(r"\s{2,}", line.strip()))}


def test_default_view_is_short_and_caps_what_needs_attention_with_a_count(many: Tree) -> None:
    text = many.status()
    lines = text.splitlines()
    # daemon + instance + header + a line per run + blank + title + the cap + the "more" line
    assert len(lines) <= 1 + 1 + 1 + RUNS + 2 + ATTENTION_SHOWN + 1, text
    named = attention_named(text)
    assert len(named) == ATTENTION_SHOWN
    assert all(many.attention[name] == kind for kind, name in named)
    total = len(many.attention)
    assert f"needs attention ({total:,}):" in text
    more = re.search(r"\.\.\. and ([\d,]+) more \(([^)]*)\)", text)
    assert more is not None, text
    assert int(more.group(1).replace(",", "")) == total - ATTENTION_SHOWN
    left = {k: int(n.replace(",", "")) for n, k in
            (part.split() for part in more.group(2).split(", "))}
    shown = {kind: sum(1 for k, _ in named if k == kind) for kind in left}
    for kind, n in left.items():
        assert n == sum(1 for k in many.attention.values() if k == kind) - shown[kind], kind
    # Runs, steps and stalls first: they hold up whole runs.
    assert [name for _, name in named[:3]] == ["run04", "run05", "run01/epoch_00/step_05"]


def test_under_the_cap_every_thing_that_needs_attention_is_named(few: Tree) -> None:
    text = few.status()
    assert sorted(name for _, name in attention_named(text)) == sorted(few.attention)
    assert dict((name, kind) for kind, name in attention_named(text)) == few.attention
    assert "more" not in text
    # The writer's business is not a problem: waiting and queued sets are not listed.
    assert "ep03.txt missing" not in text


def test_all_names_everything_and_every_step(many: Tree) -> None:
    text = many.status("--all")
    assert dict((name, kind) for kind, name in attention_named(text)) == many.attention
    assert "more" not in text
    for steps in many.steps.values():
        for step in steps:
            assert re.search(rf"^{re.escape(step)}\s", text, re.MULTILINE), step


def test_the_numbers_agree_with_json_and_with_the_state(many: Tree) -> None:
    text, data = many.status(), many.json()
    assert data["attention_total"] == len(many.attention) == len(data["attention"])
    assert {row["id"]: row["kind"] for row in data["attention"]} == many.attention
    shown = run_lines(text)
    assert sorted(shown) == sorted(many.sets) == [row["run"] for row in data["runs"]]
    for row in data["runs"]:
        counts = many.sets[row["run"]]
        assert (row["done"], row["sets"]) == (counts.get("done", 0), sum(counts.values()))
        assert row["failed"] == counts.get("failed", 0) + (row["run"] == "run01")
        assert row["refused"] == counts.get("refused", 0)
        kinds = [k for i, k in many.attention.items() if many.run_of(i) == row["run"]]
        assert row["stuck"] == sum(k in ("unusable", "stalled", "held") for k in kinds)
        assert row["spend"]["cost_usd"] == pytest.approx(many.spend[row["run"]])
        cols = shown[row["run"]]
        assert cols[3] == f"{row['done']:,}/{row['sets']:,}"
        assert cols[4:7] == [str(row["failed"]), str(row["refused"]), str(row["stuck"])]
        assert cols[7].startswith(f"${row['spend']['cost_usd']:.4f} of ${BUDGET_USD:g}")
    # The run records' phase and position, not the newest step with sets.
    assert shown["run04"][1:3] == ["writing (stalled: the writer failed 3 times: exit 1)",
                                   "e03/s09"]
    assert shown["run05"][1] == "scoring (PAUSE)"
    # The totals are the daemon's own counts of the same state.
    store = StateStore(many.runs)
    store.load()
    assert data["totals"] == dict(store.counts())
    assert len(data["sets"]) == sum(store.counts().values())
    store.close()


def test_one_run_shows_its_steps_and_only_its_problems(many: Tree) -> None:
    text = many.status("run01")
    assert list(run_lines(text)) == ["run01"]
    assert f"steps of run01 ({STEPS}):" in text
    for step in many.steps["run01"]:
        assert re.search(rf"^{re.escape(step)}\s", text, re.MULTILINE), step
    assert "optimizer" in text and "failed x1 (exit 2)" in text
    mine = {i: k for i, k in many.attention.items() if many.run_of(i) == "run01"}
    assert dict((name, kind) for kind, name in attention_named(text)) == mine
    data = many.json("run01")
    assert {row["run"] for row in data["runs"]} == {"run01"}
    assert {s["set"].split("/", 1)[0] for s in data["sets"]} == {"run01"}
    result, _ = run_cli("status", "nope", "--config", str(many.config))
    assert result.returncode == 1 and "no run 'nope'" in result.stderr


def daemon_meta(tree: Tree, **times: float) -> None:
    """What a daemon records at its start and at the end of each scan."""
    store = StateStore(tree.runs)
    store.load()
    store.note_daemon(**times)
    store.flush(pid=os.getpid())
    store.close()


def test_the_daemon_line_says_running_since_and_catching_up(few: Tree) -> None:
    stopped = few.status().splitlines()[0]
    assert "daemon not running" in stopped and "state last written" in stopped
    lock = RunsLock(few.runs / layout.STATE_DIR)
    lock.acquire()
    try:
        started = time.time()
        daemon_meta(few, started_at=started)  # started, its first scan not ended yet
        scanning = few.status().splitlines()[0]
        daemon_meta(few, started_at=started, scanned_at=started + 1)
        text = few.status()
        data = few.json()
    finally:
        lock.release()
    assert "first scan not finished" in scanning
    line = text.splitlines()[0]
    queued, running = data["totals"]["queued"], data["totals"]["running"]
    assert f"daemon running (pid {os.getpid()}) since " in line
    assert f"catching up: {queued:,} queued, {running:,} running" in line
    assert data["daemon"]["activity"] == "catching up"
    assert data["totals"]["stale"] == 2 and data["daemon"]["backlog"]["stale"] == 0
    assert "stale" not in line
    # Only while a daemon runs is a set `running` for two hours stalled.
    stalled = [r["id"] for r in data["attention"] if r["kind"] == "stalled" and r["what"] == "set"]
    assert stalled == sorted(few.running_for_hours) and len(stalled) == 2
    assert data["attention_total"] == len(few.attention) + 2
    assert all(f"stalled   {sid}" in text for sid in stalled)


def test_the_llm_limits_and_open_batches_are_shown(few: Tree) -> None:
    from skilltrain.daemon.service import batch_store

    store = StateStore(few.runs)
    store.load()
    # What jobs records when an endpoint's limiter changes (llm_endpoints.describe).
    store.note_daemon(llm_endpoint=("gpt-4o-mini@127.0.0.1:9", {"mode": "adaptive",
                                                                "limit": 12}))
    store.note_daemon(llm_endpoint=("gpt-4o-mini@127.0.0.1:9", {"mode": "stated", "limit": 6,
                                                                "requests_limit": 2400,
                                                                "paced_per_s": 39.2}))
    store.flush(pid=os.getpid())
    store.close()
    run = "run00"
    rec = batch_store.BatchRecord(key="k1", run=run, step=f"{run}/epoch_00/step_00",
                                  model="openai/gpt-4o-mini", state=batch_store.OPEN,
                                  batch_id="batch_abc", submitted_at=time.time() - 120)
    rec.items = [batch_store.BatchItem(custom_id=f"c{i}", set_id=f"s{i}", inputs={},
                                       fingerprint={}, outcome="done" if i == 0 else None)
                 for i in range(3)]
    batch_store.save(few.runs, rec)
    text, data = few.status(), few.json()
    assert data["daemon"]["llm_limits"] == {"gpt-4o-mini@127.0.0.1:9": 6}
    assert "gpt-4o-mini@127.0.0.1:9: pacing on the provider's stated limit (2,400 requests), " \
        "calls started 39.2/s, 6 calls at once" in text
    (batch,) = data["batches"]
    assert (batch["batch_id"], batch["sets"], batch["done"]) == ("batch_abc", 3, 1)
    assert "open batches (1):" in text and "batch_abc" in text
