"""The operations kit: the metrics an operator alerts on, the alert rules, the dashboard.

Real parts: the daemon in-process with its /metrics endpoint, the toy writer
and optimizer of examples/ as subprocesses, the built-in reviewer, and a
real Prometheus (Debian's `prometheus` package: `prometheus` and `promtool`)
started from the test on a free loopback port, scraping every second into a
tmp folder. Every panel's and every rule's expression is evaluated through
Prometheus' HTTP API, and `promtool check metrics` lints the exposition.
Without the binaries those tests are skipped with the reason; .ci/run
installs them.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from skilltrain.daemon.core import config
from skilltrain.daemon.infra.state import StateStore
from skilltrain.daemon.service.lifecycle import Daemon
from tests.daemon_helpers import (
    REPO,
    InProcessDaemon,
    Workspace,
    lay_out_workspace,
    wait_until,
)
from tests.daemon_marks import DAEMON_TEST_MARKS

pytestmark = DAEMON_TEST_MARKS

RULES = REPO / "systemd" / "prometheus" / "skilltrain-rules.yml"
RULE_TESTS = REPO / "systemd" / "prometheus" / "skilltrain-rules.test.yml"
DASHBOARD = REPO / "systemd" / "grafana" / "skilltrain-dashboard.json"
METRICS_DOC = REPO / "docs" / "metrics.md"
TOY_WRITER = REPO / "examples" / "toy_writer.py"
TOY_OPTIMIZER = REPO / "examples" / "toy_optimizer.py"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
MISSING = "not installed (Debian package `prometheus`; .ci/run installs it)"
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=f"promtool {MISSING}")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None,
                                      reason=f"prometheus or promtool {MISSING}")
# What Grafana puts in for the dashboard's variables ("All") and its rate window.
GRAFANA_VALUES = {"$__rate_interval": "1m", "$job": ".+", "$run": ".*"}
BUDGET_USD = 5.0


def toml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if match := re.fullmatch(r"(skilltrain_\w+(?:\{[^}]*\})?) (\S+)", line):
            samples[match.group(1)] = float(match.group(2))
    return samples


def loop_workspace(root: Path, *, port: int, failing: tuple[str, Path] | None = None,
                   observer: str = "auto", attempts: int = 3) -> Workspace:
    """The example work, the toy writer and optimizer, the built-in reviewer: a 1x2 loop.

    failing: (stage, file): that stage fails while the file exists.
    """
    lay_out_workspace(root)
    shutil.copytree(REPO / "data" / "example", root / "data" / "example",
                    ignore=shutil.ignore_patterns("model_draft"))
    writer = [sys.executable, str(TOY_WRITER), "{run_dir}", "{epoch}", "{step}",
              "--work", "example:6", "--steps-per-epoch", "2", "--scenes", "1,3",
              "--prev-reports", "{prev_reports_dir}"]
    optimizer = [sys.executable, str(TOY_OPTIMIZER), "{run_dir}", "{reports_dir}",
                 "{epoch}", "{step}"]
    if failing is not None:
        stage, file = failing
        (writer if stage == "writer" else optimizer).extend(["--fail-while", str(file)])
    config_path = root / "config.toml"
    config_path.write_text(f"""
[paths]
data = "data"
runs = "runs"
prompts = "prompts"

[llm]
model = "builtin/craft-metrics"
budget_usd = {BUDGET_USD}

[loss]
settle_seconds = 1

[watch]
observer = "{observer}"

[writer]
command = {toml_list(writer)}
timeout_s = 30
max_attempts = {attempts}
retry_backoff_s = 0.2

[optimizer]
command = {toml_list(optimizer)}
timeout_s = 30
max_attempts = {attempts}

[loop]
steps_per_epoch = 2
max_epochs = 1

[metrics]
listen = "127.0.0.1:{port}"

[log]
file = "skilltrain.jsonl"

[integrity]
audit_on_start = false
""", encoding="utf-8")
    return Workspace(root=root, config_path=config_path, works={"example": 6}, per_report=3)


def start_run(ws: Workspace, run: str) -> None:
    (ws.runs / run).mkdir()
    (ws.runs / run / "START").touch()


# ------------------------------------------------------------------ the rules


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_each_alert_has_a_unit_test_that_fires_and_one_that_stays_silent() -> None:
    alerts = {rule["alert"] for rule in rules()}
    assert {"SkilltrainDown", "SkilltrainRunStalled", "SkilltrainNoReport",
            "SkilltrainLLMFailureRatioHigh", "SkilltrainRunNearBudget",
            "SkilltrainWatcherPolling"} <= alerts
    fires: set[str] = set()
    silent: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text(encoding="utf-8"))["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check["exp_alerts"] else silent).add(check["alertname"])
    assert fires == alerts, "an alert no unit test sees fire"
    assert silent == alerts, "an alert no unit test sees stay silent"
    for rule in rules():
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


@needs_promtool
def test_promtool_checks_the_rules_and_runs_their_unit_tests() -> None:
    assert PROMTOOL is not None
    check = subprocess.run([PROMTOOL, "check", "rules", str(RULES)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run([PROMTOOL, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                          capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    assert "SUCCESS" in unit.stdout


# -------------------------------------------------------------- the dashboard


def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def panel_expressions() -> Iterator[tuple[str, str]]:
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


def test_the_dashboard_is_provisioning_ready_with_a_datasource_variable() -> None:
    board = dashboard()
    assert board["id"] is None and board["uid"] == "skilltrain"  # same uid on every import
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "run"):
        assert variables[name]["datasource"]["uid"] == "${datasource}"
    titles = [panel["title"] for panel in board["panels"]]
    for needed in ("Craft distance per run", "Reports and failures per minute",
                   "Tokens per minute", "Cost per hour", "LLM request time quantiles",
                   "Sets by state", "Loop phase per run"):
        assert needed in titles
    ids = [panel["id"] for panel in board["panels"]]
    assert len(set(ids)) == len(ids)
    for panel in board["panels"]:
        # No datasource of the author's Grafana: the variable, everywhere.
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert all(t["datasource"] == panel["datasource"] for t in panel["targets"])
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


# --------------------------------------------------------------- the metrics


def documented_metrics() -> set[str]:
    text = METRICS_DOC.read_text(encoding="utf-8")
    return set(re.findall(r"^\| `(skilltrain_\w+)` \|", text, flags=re.MULTILINE))


def served_metrics(registry: Any) -> set[str]:
    names = set()
    for family in registry.collect():
        if family.name.startswith("skilltrain_"):
            names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def test_docs_list_every_metric_the_daemon_serves(tmp_path: Path) -> None:
    ws = loop_workspace(tmp_path, port=free_port())
    daemon = Daemon(config.load(ws.config_path))  # built, not started: its registry
    served = served_metrics(daemon.metrics.registry)
    assert {"skilltrain_run_phase", "skilltrain_run_budget_left_usd", "skilltrain_watcher_mode",
            "skilltrain_writer_seconds", "skilltrain_optimizer_failures_total",
            "skilltrain_llm_attempts_total",
            "skilltrain_run_last_report_timestamp_seconds"} <= served
    assert served == documented_metrics()


def test_the_last_report_time_survives_a_restart(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.load()
    before = time.time()
    store.add_spend("r1", 10, 5, 0, 0.25)
    store.flush(force=True, pid=None)
    store.close()
    again = StateStore(tmp_path)
    again.load()
    spend = again.spend["r1"]
    assert spend.last_report_at is not None and before <= spend.last_report_at <= time.time()
    again.close()


@pytest.mark.parametrize(("stage", "phase", "attempts"),
                         [("writer", "writing", 2), ("optimizer", "optimizing", 1)])
def test_a_stalled_run_and_its_stage_failures_show_in_metrics(
    tmp_path: Path, stage: str, phase: str, attempts: int
) -> None:
    port = free_port()
    fails = tmp_path / f"{stage}-fails"
    fails.touch()
    ws = loop_workspace(tmp_path / "ws", port=port, failing=(stage, fails), observer="polling",
                        attempts=attempts)
    other = "optimizer" if stage == "writer" else "writer"
    with InProcessDaemon(ws):
        start_run(ws, "r1")
        wait_until(lambda: ws.events("run.stalled", run="r1"), 30, message="run.stalled")
        stalled = wait_until(lambda: (s := scrape(port))["skilltrain_runs_stalled"] == 1 and s,
                             5, message="the stall in /metrics")
        fails.unlink()
        (ws.runs / "r1" / "RETRY").touch()
        wait_until(lambda: ws.events(f"{stage}.finished", run="r1", exit_code=0), 30,
                   message=f"the {stage} after RETRY")
        resumed = wait_until(lambda: (s := scrape(port))["skilltrain_runs_stalled"] == 0 and s,
                             5, message="the RETRY in /metrics")
    assert stalled['skilltrain_run_stalled{run="r1"}'] == 1
    assert stalled[f'skilltrain_run_phase{{phase="{phase}",run="r1"}}'] == 1
    assert sum(v for k, v in stalled.items() if k.startswith("skilltrain_run_phase{")) == 1
    assert stalled[f'skilltrain_runs{{phase="{phase}"}}'] == 1
    assert stalled[f'skilltrain_{stage}_failures_total{{run="r1"}}'] == attempts
    assert stalled[f'skilltrain_{other}_failures_total{{run="r1"}}'] == 0
    assert stalled[f"skilltrain_{stage}_seconds_count"] == attempts
    assert stalled['skilltrain_run_spent_usd{run="r1"}'] == 0  # the built-in reviewer is free
    assert stalled['skilltrain_run_budget_left_usd{run="r1"}'] == BUDGET_USD
    assert stalled['skilltrain_watcher_mode{configured="polling",mode="polling"}'] == 1
    assert stalled['skilltrain_watcher_mode{configured="polling",mode="native"}'] == 0
    assert resumed['skilltrain_run_stalled{run="r1"}'] == 0
    assert resumed[f"skilltrain_{stage}_seconds_count"] >= attempts + 1


# -------------------------------------------------- against a real Prometheus


class Prometheus:
    """The real server, scraping the daemon every second; query() over its HTTP API."""

    def __init__(self, root: Path, target_port: int) -> None:
        assert PROMETHEUS is not None
        self.port = free_port()
        root.mkdir()
        cfg = root / "prometheus.yml"
        cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "skilltrain", "static_configs": [
                {"targets": [f"127.0.0.1:{target_port}"]}]}],
        }), encoding="utf-8")
        self.log = (root / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=root)

    def wait_ready(self, timeout: float) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, f"prometheus exited: {self.log_text()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready",
                                            timeout=2) as response:
                    return bool(response.status == 200)
            except OSError:
                return False

        wait_until(ready, timeout, interval=0.1,
                   message=lambda: f"prometheus ready; its log: {self.log_text()}")

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(encoding="utf-8", errors="replace")[-2000:]

    def query(self, expr: str) -> dict[str, Any]:
        url = (f"http://127.0.0.1:{self.port}/api/v1/query?"
               + urllib.parse.urlencode({"query": expr}))
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as e:  # 400: the expression does not parse
            answer = json.loads(e.read())
        assert isinstance(answer, dict)
        return answer

    def result(self, expr: str) -> list[dict[str, Any]]:
        answer = self.query(expr)
        assert answer["status"] == "success", f"{expr}: {answer.get('error')}"
        data = answer["data"]["result"]
        assert isinstance(data, list)
        return data

    def value(self, expr: str) -> float:
        (sample,) = self.result(expr)
        return float(sample["value"][1])

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def grafana(expr: str) -> str:
    for variable, value in GRAFANA_VALUES.items():
        expr = expr.replace(variable, value)
    return expr


def selectors(expr: str) -> list[str]:
    """The series selectors of an expression: each metric name with its matchers."""
    return re.findall(r"\b(?:skilltrain_\w+|process_\w+|up)\b(?:\{[^}]*\})?", expr)


@needs_prometheus
@pytest.mark.slow
def test_every_panel_and_rule_evaluates_against_a_real_prometheus(tmp_path: Path) -> None:
    port = free_port()
    ws = loop_workspace(tmp_path / "ws", port=port)
    prometheus = Prometheus(tmp_path / "prometheus", port)
    try:
        with InProcessDaemon(ws):
            start_run(ws, "r1")
            prometheus.wait_ready(30)
            wait_until(lambda: ws.events("run.finished", run="r1"), 40, message="run.finished")
            # Scraped since the run finished, and twice over the rate windows' samples.
            wait_until(lambda: prometheus.query('skilltrain_runs{phase="finished"} == 1')
                       ["data"]["result"], 15, interval=0.25, message="the finish in Prometheus")
            time.sleep(2)
            panels = {(title, expr): prometheus.query(grafana(expr))
                      for title, expr in panel_expressions()}
            alerts = {rule["alert"]: prometheus.query(rule["expr"]) for rule in rules()}
            inner = {sel: prometheus.query(f"count({sel})")
                     for rule in rules() for sel in selectors(rule["expr"])}
            reports = ws.events("loss.completed")
            checks = {
                'skilltrain_run_phase{run="r1", phase="finished"}': 1,
                "skilltrain_runs_stalled": 0,
                "skilltrain_writer_seconds_count": len(ws.events("writer.finished", run="r1")),
                "skilltrain_optimizer_seconds_count": len(ws.events("optimizer.finished")),
                'skilltrain_llm_attempts_total{outcome="ok"}': len(reports),
                'skilltrain_run_budget_left_usd{run="r1"}': BUDGET_USD,  # the reviewer is free
                'skilltrain_watcher_mode{mode="native"}': 1,
                'up{job="skilltrain"}': 1,
            }
            values = {expr: prometheus.value(expr) for expr in checks}
            reported_at = prometheus.value(
                'skilltrain_run_last_report_timestamp_seconds{run="r1"}')
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                exposition = r.read()
    finally:
        prometheus.close()

    assert PROMTOOL is not None  # the same package
    lint = subprocess.run([PROMTOOL, "check", "metrics"], input=exposition,
                          capture_output=True, timeout=30)
    assert lint.returncode == 0 and not lint.stdout.strip(), lint.stdout + lint.stderr

    for (title, expr), answer in panels.items():
        assert answer["status"] == "success", f"{title}: {expr}: {answer.get('error')}"
        assert answer["data"]["result"], f"{title}: no data for {grafana(expr)}"
    for alert, answer in alerts.items():
        # Nothing is wrong, so most are empty; each must parse and run.
        assert answer["status"] == "success", f"{alert}: {answer.get('error')}"
    for sel, answer in inner.items():
        assert answer["status"] == "success" and answer["data"]["result"], f"no data for {sel}"
    assert values == checks
    assert len(reports) >= 4  # 2 steps x 2 sets
    logged = datetime.fromisoformat(reports[-1]["timestamp"].replace("Z", "+00:00"))
    assert abs(reported_at - logged.timestamp()) < 1  # the spend is added as it is logged
