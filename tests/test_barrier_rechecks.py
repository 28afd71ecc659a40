"""The step barrier (daemon/service/steps.py) does not take the state's DONE
for the disk's word: before a step is reported or its optimizer runs, each
set's report is checked against its inputs as they are now. A set changed
since its report (an episode rewritten, even same size with its mtime put
back; its report gone; the template edited) holds the step back and is
handed back to be looked at; the optimizer never learns from a stale report.
A ctime moved with the text unchanged holds nothing back, and a step whose
sets are unchanged costs stat calls, not reads.

Driven directly, as tests/test_steps.py does: a set is changed on disk after
it is DONE, then the barrier is asked; no timers are raced.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.core import config, dataset, layout
from skilltrain.daemon.core.notify import Heartbeat
from skilltrain.daemon.core.templates import PromptTemplates
from skilltrain.daemon.service import observe
from skilltrain.daemon.service.budget import Budget
from skilltrain.daemon.service.owner import SetOwner
from skilltrain.daemon.service.reconcile import CACHED_S, Reconciler
from skilltrain.daemon.service.settle import SettleClock
from skilltrain.handlers import loss
from tests.test_reconcile import FakeLoop, RecordingRevisits, RecordingTransport
from tests.test_steps import STEP, Bench, fingerprint_now


@pytest.fixture
def bench(tmp_path: Path) -> Bench:
    return Bench(tmp_path)


class Looks:
    """What the barrier hands back to be looked at."""

    def __init__(self, bench: Bench) -> None:
        self.keys: list[layout.SetKey] = []
        bench.steps.serve(self.keys.append)


def scripts(bench: Bench, key: layout.SetKey) -> Path:
    return key.scripts_dir(bench.cfg.paths.runs)


def not_reported(bench: Bench) -> bool:
    return (bench.said("step.reported") == [] and bench.calls() == []
            and not STEP.marker(bench.cfg.paths.runs).exists())


def test_a_set_whose_episode_changed_after_done_holds_the_step_back(bench: Bench) -> None:
    looks = Looks(bench)
    first, second = bench.sets
    bench.done()
    episode = scripts(bench, second) / f"ep{second.first:02d}.txt"
    episode.write_text(episode.read_text() + "\nA new closing line.\n")  # its hint not yet seen
    bench.check()
    assert not_reported(bench) and looks.keys == [second]
    bench.done(second)  # looked at, redone: its new report
    bench.check()
    assert len(bench.said("step.reported")) == 1 and bench.calls() == ["r1 01 01"]


def test_a_same_size_rewrite_with_its_mtime_put_back_holds_the_step_back(bench: Bench) -> None:
    looks = Looks(bench)
    bench.done()
    episode = scripts(bench, bench.sets[0]) / "ep02.txt"
    before = episode.stat()
    with open(episode, "r+b") as f:
        f.write(episode.read_bytes().swapcase())
    os.utime(episode, ns=(before.st_atime_ns, before.st_mtime_ns))
    bench.check()
    assert not_reported(bench) and looks.keys == [bench.sets[0]]


def test_a_report_gone_since_holds_the_step_back(bench: Bench) -> None:
    looks = Looks(bench)
    bench.done()
    bench.sets[1].report_path(bench.cfg.paths.runs).unlink()
    bench.check()
    assert not_reported(bench) and looks.keys == [bench.sets[1]]


def test_a_template_edited_since_holds_the_step_back_and_every_set_is_looked_at(
        bench: Bench) -> None:
    looks = Looks(bench)
    bench.done()
    template = PromptTemplates(bench.cfg.paths.prompts).path(loss.TEMPLATE)
    template.write_text(template.read_text() + "\nBe brief.\n")
    bench.check()
    assert not_reported(bench) and looks.keys == bench.sets


def test_an_unreadable_template_reports_nothing_and_asks_no_look(bench: Bench) -> None:
    looks = Looks(bench)
    bench.done()
    PromptTemplates(bench.cfg.paths.prompts).path(loss.TEMPLATE).unlink()
    bench.check()  # each look would only fail again: the scan's set.error says why
    assert not_reported(bench) and looks.keys == []


def test_an_optimizer_retry_waits_for_a_set_changed_since(bench: Bench) -> None:
    looks = Looks(bench)
    bench.exit_code(1)
    bench.done()
    bench.check()
    assert len(bench.calls()) == 1  # attempt 1 failed; attempt 2 after the backoff
    episode = scripts(bench, bench.sets[1]) / f"ep{bench.sets[1].last:02d}.txt"
    episode.write_text(episode.read_text() + "\nChanged.\n")
    bench.now += 10 * 50.0
    bench.exit_code(0)
    bench.check()
    assert len(bench.calls()) == 1 and looks.keys == [bench.sets[1]]
    bench.done(bench.sets[1])
    bench.check()
    assert len(bench.calls()) == 2 and bench.marker()["optimizer_done"]


def full_sidecar(bench: Bench, key: layout.SetKey) -> None:
    """The sidecar a report is written with: its inputs' content hashes."""
    fp = fingerprint_now(bench.cfg, key)
    folder = scripts(bench, key)
    model = dataset.files_digest({n: f"{folder}/{dataset.episode_name(n)}"
                                  for n in range(key.first, key.last + 1)})
    sidecar = {"inputs": {"human_sha256": fp.human, "model_sha256": model,
                          "template_sha256": fp.template, "model_id": fp.model_id},
               "model_stat_sigs": fp.sigs}
    key.report_path(bench.cfg.paths.runs).with_suffix(".json").write_text(json.dumps(sidecar))


def test_a_ctime_moved_with_the_text_unchanged_holds_nothing_back(bench: Bench) -> None:
    looks = Looks(bench)
    bench.done()
    for key in bench.sets:
        full_sidecar(bench, key)
    episode = scripts(bench, bench.sets[0]) / "ep01.txt"
    before = episode.stat().st_ctime_ns
    episode.chmod(0o600)
    os.link(episode, bench.tmp_path / "ep01-backup.txt")
    assert episode.stat().st_ctime_ns != before
    bench.check()
    assert len(bench.said("step.reported")) == 1 and looks.keys == []


def test_unchanged_sets_cost_stat_calls_not_reads(
        bench: Bench, monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[Any] = []

    def counted(*args: Any) -> None:
        read.append(args)
        raise AssertionError("read while nothing changed")

    monkeypatch.setattr(observe.loss, "read_sidecar", counted)
    monkeypatch.setattr(observe.dataset, "files_digest", counted)
    bench.done()
    bench.check()
    assert len(bench.said("step.reported")) == 1 and read == []


class LookingRevisits(RecordingRevisits):
    def __init__(self) -> None:
        super().__init__()
        self.looked: list[tuple[layout.SetKey, float]] = []

    def look(self, key: layout.SetKey, *, delay_s: float = 0.0) -> None:
        self.looked.append((key, delay_s))


def test_the_reconciler_serves_the_barriers_looks_through_the_revisits(bench: Bench) -> None:
    """The way back in the daemon: a Revisit, as for a hint, so the owner
    decides what follows; after the reconciler's own caches have caught up."""
    cfg: config.Config = bench.cfg
    revisits = LookingRevisits()
    discovery = bench.steps.discovery
    owner = SetOwner(bench.state, bench.emit, revisits=revisits,  # type: ignore[arg-type]
                     steps=bench.steps, heartbeat=Heartbeat(),
                     live=RecordingTransport(), batch=None)
    Reconciler(cfg, bench.state, bench.emit, clock=lambda: bench.now,
               stopping=threading.Event(), revisits=revisits,  # type: ignore[arg-type]
               settle=SettleClock(cfg.loss.settle_s, cfg.paths.runs, discovery.ignore),
               discovery=discovery, owner=owner,
               budget=Budget(cfg.llm.budget_usd, bench.state, bench.emit, runs=cfg.paths.runs),
               steps=bench.steps, loop=FakeLoop(),  # type: ignore[arg-type]
               templates=PromptTemplates(cfg.paths.prompts), heartbeat=Heartbeat(),
               scanned=lambda dirs: None)
    bench.done()
    bench.sets[0].report_path(cfg.paths.runs).unlink()
    bench.check()
    assert not_reported(bench)
    assert revisits.looked == [(bench.sets[0], pytest.approx(CACHED_S + 0.05))]
