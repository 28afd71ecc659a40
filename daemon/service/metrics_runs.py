"""The gauges an operator alerts on, read when Prometheus scrapes.

Per looped run: its phase (one series per phase, 1 for the current one),
stalled, paused, epoch and step, all from the run's record (loop.json, what
`skilltrain status` shows). Per run with spend: dollars spent, and with
`[llm] budget_usd` the budget and what is left of it; the time of its last
report. The spend and the last report come from the state, which survives a
restart: a daemon in a crash loop still shows when a run last reported.
Besides: runs per phase and stalled runs in total, and the watcher's mode.

Read, not pushed: a value is never stale, and a record the user edits or a
RETRY the loop acts on shows at the next scrape. A scrape reads one small
JSON file per run; series are per run at most.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..core import config
from ..infra.state import StateStore
from . import run_record
from .metrics import PREFIX, Metrics

PHASES = tuple(phase.value for phase in run_record.Phase)
OBSERVER_KINDS = ("native", "polling")


@dataclass(frozen=True)
class RunSpending:
    """What the state knows of one run's money and reports."""

    spent_usd: float
    last_report_at: float | None


class RunGauges(Collector):
    """skilltrain_run_* and skilltrain_runs*: the looped runs and every run's spend."""

    def __init__(self, records: Callable[[], Sequence[Mapping[str, Any]]],
                 spending: Callable[[], Mapping[str, RunSpending]],
                 budget_usd: float | None) -> None:
        self.records = records  # run_record.status_rows: one dict per looped run
        self.spending = spending
        self.budget_usd = budget_usd

    def collect(self) -> Iterator[Metric]:
        rows = sorted(self.records(), key=lambda row: str(row["run"]))
        yield from self._loop(rows)
        yield from self._money(rows)

    def _loop(self, rows: Sequence[Mapping[str, Any]]) -> Iterator[Metric]:
        runs = GaugeMetricFamily(f"{PREFIX}_runs", "Looped runs by phase", labels=["phase"])
        for name in PHASES:
            runs.add_metric([name], sum(1 for row in rows if row["phase"] == name))
        yield runs
        yield GaugeMetricFamily(f"{PREFIX}_runs_stalled",
                                "Looped runs stalled (waiting for RETRY or a restart)",
                                value=sum(1 for row in rows if _stalled(row)))
        phase = GaugeMetricFamily(f"{PREFIX}_run_phase",
                                  "1 for the looped run's current phase, 0 for the others",
                                  labels=["run", "phase"])
        stalled = GaugeMetricFamily(f"{PREFIX}_run_stalled",
                                    "1 while the looped run is stalled", labels=["run"])
        paused = GaugeMetricFamily(f"{PREFIX}_run_paused",
                                   "1 while runs/<run>/PAUSE exists", labels=["run"])
        epoch = GaugeMetricFamily(f"{PREFIX}_run_epoch", "The looped run's epoch",
                                  labels=["run"])
        step = GaugeMetricFamily(f"{PREFIX}_run_step", "The looped run's step in its epoch",
                                 labels=["run"])
        for row in rows:
            run = str(row["run"])
            for name in PHASES:
                phase.add_metric([run, name], 1 if row["phase"] == name else 0)
            stalled.add_metric([run], 1 if _stalled(row) else 0)
            paused.add_metric([run], 1 if row.get("paused") else 0)
            epoch.add_metric([run], row["epoch"])
            step.add_metric([run], row["step"])
        yield from (phase, stalled, paused, epoch, step)

    def _money(self, rows: Sequence[Mapping[str, Any]]) -> Iterator[Metric]:
        spending = self.spending()
        # A looped run that has not paid for a report yet has spent 0 of its budget.
        runs = sorted(set(spending) | {str(row["run"]) for row in rows})
        spent = GaugeMetricFamily(f"{PREFIX}_run_spent_usd",
                                  "US dollars the run's priced reports cost (all daemons)",
                                  labels=["run"])
        last = GaugeMetricFamily(f"{PREFIX}_run_last_report_timestamp_seconds",
                                 "Unix time of the run's last report", labels=["run"])
        budget = GaugeMetricFamily(f"{PREFIX}_run_budget_usd",
                                   "[llm] budget_usd, the run's limit", labels=["run"])
        left = GaugeMetricFamily(f"{PREFIX}_run_budget_left_usd",
                                 "US dollars left of the run's budget (0 when reached)",
                                 labels=["run"])
        for run in runs:
            known = spending.get(run)
            cost = known.spent_usd if known is not None else 0.0
            spent.add_metric([run], cost)
            if known is not None and known.last_report_at is not None:
                last.add_metric([run], known.last_report_at)
            if self.budget_usd is not None:
                budget.add_metric([run], self.budget_usd)
                left.add_metric([run], max(0.0, self.budget_usd - cost))
        yield from (spent, last)
        if self.budget_usd is not None:  # no budget: no series, not an infinite one
            yield from (budget, left)


def install(metrics: Metrics, cfg: config.Config, state: StateStore,
            watcher_kind: Callable[[], str]) -> None:
    """The daemon's gauges: its runs' records, its state's spend, `[llm] budget_usd`,
    its watcher (`watcher_kind`: the observer running now)."""
    def spending() -> dict[str, RunSpending]:
        with state.lock:
            return {run: RunSpending(spend.cost_usd, spend.last_report_at)
                    for run, spend in state.spend.items()}

    runs = cfg.paths.runs
    metrics.register(RunGauges(lambda: run_record.status_rows(runs), spending,
                               cfg.llm.budget_usd))
    metrics.register(WatcherGauge(watcher_kind, cfg.watch.observer))


# Item states always exported (at 0 too), so a dashboard's series exist from the start.
BATCH_ITEM_STATES = ("gathering", "waiting", "handling")


class BatchGauges(Collector):
    """skilltrain_batches_open and skilltrain_batch_items{state} (daemon/service/batch.py)."""

    def __init__(self, snapshot: Callable[[], tuple[int, dict[str, int]]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        open_batches, items = self.snapshot()
        yield GaugeMetricFamily(f"{PREFIX}_batches_open",
                                "provider batches submitted and not yet closed",
                                value=open_batches)
        gauge = GaugeMetricFamily(f"{PREFIX}_batch_items",
                                  "sets in batch mode: gathering, waiting (in an open "
                                  "batch), handling (result on a worker), or the state "
                                  "a handled result left the set in", labels=["state"])
        for state in sorted(set(BATCH_ITEM_STATES) | set(items)):
            gauge.add_metric([state], items.get(state, 0))
        yield gauge


class WatcherGauge(Collector):
    """skilltrain_watcher_mode{mode, configured}: native or polling, and what was asked."""

    def __init__(self, kind: Callable[[], str], configured: str) -> None:
        self.kind = kind  # "" before the watcher started
        self.configured = configured

    def collect(self) -> Iterator[Metric]:
        now = self.kind()
        mode = GaugeMetricFamily(f"{PREFIX}_watcher_mode",
                                 "1 for the observer the watcher runs now ([watch] observer "
                                 "as `configured`)", labels=["mode", "configured"])
        for kind in OBSERVER_KINDS:
            mode.add_metric([kind, self.configured], 1 if now == kind else 0)
        yield mode


def _stalled(row: Mapping[str, Any]) -> bool:
    return bool(row.get("stalled")) and row["phase"] != "finished"
