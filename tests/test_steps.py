"""The step barrier and the optimizer stage on their own (daemon/service/steps.py):
a step reported once when every expected set is done, its optimizer run,
retried after its backoff and stalled when its attempts are used up, a
replaced report reopening the step, and the marker that outlives a lost
state. Real files, a real state store and discovery, a real subprocess
optimizer; a clock the test sets; no daemon."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.core import config, dataset, layout
from skilltrain.daemon.core.templates import PromptTemplates
from skilltrain.daemon.infra.state import SetState, StateStore
from skilltrain.daemon.service.discovery import Discovery
from skilltrain.daemon.service.observe import Fingerprint, HumanDigests, observe
from skilltrain.daemon.service.steps import Steps
from skilltrain.handlers import loss
from tests.daemon_helpers import build_workspace, wait_until

STEP = layout.StepKey("r1", 1, 1)
BACKOFF_S = 50.0
# Appends its argv to calls.txt; exits with the number in exit_code.txt.
OPTIMIZER = ("import pathlib, sys; d = pathlib.Path(sys.argv[1]); "
             "d.joinpath('calls.txt').open('a').write(' '.join(sys.argv[2:]) + '\\n'); "
             "sys.exit(int(d.joinpath('exit_code.txt').read_text()))")


class Bench:
    def __init__(self, tmp_path: Path, *, command: list[str] | None = None) -> None:
        ws = build_workspace(tmp_path, "http://127.0.0.1:9/v1", works={"alpha": 6})
        cfg = config.load(ws.config_path)
        if command is None:
            command = [sys.executable, "-c", OPTIMIZER, str(tmp_path), "{run}", "{epoch}", "{step}"]
        optimizer = {"max_attempts": 2, "retry_backoff_s": BACKOFF_S, "command": command}
        self.cfg = cfg.model_copy(update={"optimizer": config.OptimizerConfig(**optimizer)})
        self.tmp_path = tmp_path
        self.exit_code(0)
        self.sets = [layout.SetKey(s.run, s.epoch, s.step, s.work, s.first, s.last)
                     for s in ws.write_step("r1", 1, 1)]
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.now = 1_000_000.0
        self.marker_changed = threading.Event()
        self.state, self.steps = self.start()

    def start(self) -> tuple[StateStore, Steps]:
        """A process's steps stage, over whatever state file there is."""
        state = StateStore(self.cfg.paths.runs, self.cfg.paths.state)
        state.load()
        discovery = Discovery(self.cfg, state, self.emit)
        discovery.load_works()
        return state, Steps(self.cfg, state, self.emit, clock=lambda: self.now,
                            discovery=discovery, marker_changed=self.marker_changed)

    def emit(self, event: str, level: str = "info", **fields: Any) -> None:
        self.events.append((event, {"level": level, **fields}))

    def said(self, name: str) -> list[dict[str, Any]]:
        return [fields for event, fields in self.events if event == name]

    def exit_code(self, code: int) -> None:
        (self.tmp_path / "exit_code.txt").write_text(str(code))

    def calls(self) -> list[str]:
        path = self.tmp_path / "calls.txt"
        return path.read_text().splitlines() if path.exists() else []

    def done(self, *keys: layout.SetKey) -> None:
        """Reported, as the daemon leaves a set: its report on disk, its fingerprint kept."""
        for key in keys or self.sets:
            report = key.report_path(self.cfg.paths.runs)
            report.parent.mkdir(parents=True, exist_ok=True)
            report.write_text("A craft report.\n", encoding="utf-8")
            report.with_suffix(".json").write_text("{}\n", encoding="utf-8")
            self.state.update(key.id, SetState.DONE,
                              fingerprint=fingerprint_now(self.cfg, key).as_json())

    def check(self) -> None:
        self.steps.check(STEP)
        self.steps.wait_optimizers()

    def marker(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(STEP.marker(self.cfg.paths.runs).read_text())
        return data


def fingerprint_now(cfg: config.Config, key: layout.SetKey) -> Fingerprint:
    """The set's inputs as they are on disk now, as the reconciler fingerprints them."""
    work = dataset.load_work(cfg.paths.data / key.work)
    human = HumanDigests().digest(work, key.first, key.last)
    assert human is not None
    return Fingerprint.of(observe(key, cfg.paths.runs, cfg.paths.data).sigs, human,
                          PromptTemplates(cfg.paths.prompts).source_hash(loss.TEMPLATE),
                          cfg.llm.model)


@pytest.fixture
def bench(tmp_path: Path) -> Bench:
    return Bench(tmp_path)


def test_a_step_is_reported_once_when_every_expected_set_is_done(bench: Bench) -> None:
    assert len(bench.sets) == 2
    bench.done(bench.sets[0])
    bench.check()
    assert bench.said("step.reported") == [] and bench.calls() == []
    bench.done()
    bench.check()
    bench.check()
    (reported,) = bench.said("step.reported")
    assert reported["sets"] == 2 and "again" not in reported
    assert bench.calls() == ["r1 01 01"]  # the optimizer ran once, two-digit placeholders
    assert bench.marker()["optimizer_done"] and bench.marker()["reported_at"] == bench.now
    assert bench.marker_changed.is_set()  # the loop looks at once


def test_a_failed_optimizer_is_retried_after_its_backoff_then_stalls(bench: Bench) -> None:
    bench.exit_code(3)
    bench.done()
    bench.check()
    assert len(bench.calls()) == 1 and bench.marker()["optimizer_exit_code"] == 3
    assert bench.marker()["optimizer_next_at"] == bench.now + BACKOFF_S
    assert bench.steps.optimizer_exhausted(STEP) is None  # one attempt of two used
    bench.now += BACKOFF_S - 1
    bench.check()
    assert len(bench.calls()) == 1  # its backoff runs
    bench.now += 1
    bench.check()
    assert len(bench.calls()) == 2
    assert bench.steps.optimizer_exhausted(STEP) == 2  # the loop stalls the run
    bench.now += 10 * BACKOFF_S
    bench.check()
    assert len(bench.calls()) == 2  # no third attempt by itself
    [failed, last] = bench.said("optimizer.failed")
    assert failed["will_retry"] and not last["will_retry"]


def test_the_users_retry_gives_fresh_attempts_and_runs_now(bench: Bench) -> None:
    bench.exit_code(1)
    bench.done()
    bench.check()
    bench.now += BACKOFF_S
    bench.check()
    assert bench.steps.optimizer_exhausted(STEP) == 2
    bench.exit_code(0)
    bench.steps.retry_optimizer(STEP)
    bench.steps.wait_optimizers()
    assert len(bench.calls()) == 3 and bench.marker()["optimizer_done"]
    assert bench.steps.optimizer_exhausted(STEP) is None


def test_a_replaced_report_reopens_the_step_and_the_optimizer_learns_again(
    bench: Bench,
) -> None:
    bench.done()
    bench.check()
    bench.steps.reopen(bench.sets[1])  # a new report of a set of a reported step
    assert bench.marker()["generation"] == 1 and not bench.marker()["optimizer_done"]
    bench.check()
    [first, again] = bench.said("step.reported")
    assert again["again"] and bench.sets[1].id in again["reason"]
    assert len(bench.calls()) == 2 and bench.marker()["optimizer_done"]


def test_the_marker_keeps_a_lost_state_from_reporting_the_step_twice(bench: Bench) -> None:
    bench.done()
    bench.check()
    bench.state.close()
    bench.cfg.paths.state.unlink()  # the state is a cache of the markers
    bench.state, bench.steps = bench.start()
    bench.done()
    bench.check()
    assert len(bench.said("step.reported")) == 1 and len(bench.calls()) == 1


def test_without_an_optimizer_command_a_reported_step_is_optimized(tmp_path: Path) -> None:
    bench = Bench(tmp_path, command=[])
    bench.done()
    bench.check()
    assert len(bench.said("step.reported")) == 1 and bench.said("optimizer.started") == []
    assert bench.marker()["optimizer_done"] and bench.steps.optimizer_exhausted(STEP) is None


def test_a_state_that_lags_the_marker_does_not_run_the_optimizer_again(bench: Bench) -> None:
    bench.exit_code(1)
    bench.done()
    bench.check()  # attempt 1 failed
    bench.state.flush(force=True)
    db = bench.cfg.paths.state
    files = [db, Path(f"{db}-wal"), Path(f"{db}-shm")]
    lagging = {f: f.read_bytes() for f in files if f.exists()}  # the flush before a SIGKILL
    bench.exit_code(0)
    bench.now += BACKOFF_S
    bench.check()  # attempt 2 done: in the marker at once, in the state at the next flush
    assert bench.marker()["optimizer_done"] and len(bench.calls()) == 2
    bench.state.close()
    for f in files:
        f.unlink(missing_ok=True)
    for f, data in lagging.items():
        f.write_bytes(data)
    bench.state, bench.steps = bench.start()
    assert bench.state.steps[STEP.id].optimizer_attempts == 1  # it lags
    bench.check()
    assert len(bench.calls()) == 2 and bench.steps.optimized(STEP)


def test_an_optimizer_program_gone_since_the_start_is_a_failed_attempt(tmp_path: Path) -> None:
    bench = Bench(tmp_path, command=[str(tmp_path / "optimize.sh"), "{run}"])  # deleted
    bench.done()
    bench.check()
    (failed,) = bench.said("optimizer.failed")
    assert "cannot start" in failed["reason"] and failed["will_retry"]
    assert bench.marker()["optimizer_exit_code"] is None and not bench.marker()["optimizer_done"]


# Like OPTIMIZER, but holds on until the file `release` exists: a run in flight.
HELD_OPTIMIZER = "\n".join([
    "import pathlib, sys, time",
    "d = pathlib.Path(sys.argv[1])",
    "d.joinpath('calls.txt').open('a').write(' '.join(sys.argv[2:]) + '\\n')",
    "while not d.joinpath('release').exists():",
    "    time.sleep(0.01)",
    "sys.exit(int(d.joinpath('exit_code.txt').read_text()))",
])


def test_a_claimed_optimizer_run_is_neither_started_again_nor_counted_failed_while_it_runs(
        tmp_path: Path) -> None:
    """The pending claim, held directly: while a step's optimizer runs, more
    barrier checks start no second run, and its last attempt running is not
    an exhausted step (the loop would stall a run whose optimizer may succeed)."""
    release = tmp_path / "release"
    bench = Bench(tmp_path, command=[sys.executable, "-c", HELD_OPTIMIZER, str(tmp_path),
                                     "{run}", "{epoch}", "{step}"])
    try:
        bench.exit_code(3)
        bench.done()
        bench.steps.check(STEP)  # attempt 1 of 2, claimed
        wait_until(lambda: bench.calls() == ["r1 01 01"], 10, message="attempt 1 running")
        for _ in range(3):  # the barrier looks again, as every job finishing makes it
            bench.steps.check(STEP)
        assert bench.steps.optimizer_exhausted(STEP) is None
        release.touch()
        bench.steps.wait_optimizers()
        assert len(bench.calls()) == 1 and len(bench.said("optimizer.started")) == 1
        assert bench.steps.optimizer_exhausted(STEP) is None  # one attempt of two used

        release.unlink()
        bench.now += BACKOFF_S
        bench.steps.check(STEP)  # attempt 2 of 2: the last, claimed
        wait_until(lambda: len(bench.calls()) == 2, 10, message="attempt 2 running")
        assert bench.steps.optimizer_exhausted(STEP) is None  # used up, but still running
        release.touch()
        bench.steps.wait_optimizers()
        assert bench.steps.optimizer_exhausted(STEP) == 2
        assert len(bench.calls()) == 2 and len(bench.said("optimizer.started")) == 2
    finally:
        release.touch()  # a failed assertion leaves no optimizer waiting
        bench.steps.wait_optimizers()
