"""Structured events, the step barrier, the optimizer trigger and cost accounting.

Real parts throughout: a workspace under tmp_path, the daemon in-process
(`Daemon(cfg, once=True)`, or `run_forever` in a thread for the watcher) or as
a `skilltrain daemon --once` subprocess, the real scheduler and watcher, and
litellm talking HTTP to the loopback server. Events are read back from the
JSON log file the daemon writes and checked against the catalogue in
docs/events.md, which is parsed here so that catalogue and code cannot drift
apart silently.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from skilltrain.daemon.commands import status
from skilltrain.daemon.core import config
from skilltrain.daemon.core.errors import ConfigError
from skilltrain.daemon.core.layout import StepKey
from skilltrain.daemon.infra import llm
from skilltrain.daemon.infra import log as slog
from skilltrain.daemon.service import lifecycle as service
from tests.llm_server import LLMServer, Reply, Request

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "data" / "example"
RECORDER = Path(__file__).resolve().parent / "optimizer_recorder.py"
SKILLTRAIN = Path(sys.executable).parent / "skilltrain"
CONTEXT_FIELDS = ("run", "epoch", "step", "work", "range", "job_id")
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
PRICED_MODEL = "openai/loopback-priced"  # registered with a price by the budget tests
WAIT_S = 15.0  # the bound of every wait for the daemon's threads

Line = dict[str, Any]

pytestmark = [
    # litellm's client cache can build two clients for one key when two jobs start at
    # the same moment, and drops one unclosed: its idle keep-alive socket to the
    # loopback server is reported when collected. litellm's, not the daemon's.
    pytest.mark.filterwarnings(
        r"ignore:Exception ignored in. <socket\.socket fd=\d+, family=2:"
        "pytest.PytestUnraisableExceptionWarning"
    ),
    # litellm imports its github_copilot module lazily on the first completion, and
    # pydantic warns about ReadOnly TypedDict items in it. Under filterwarnings=error
    # that warning aborts the import inside the daemon's worker thread, and every
    # later job in the session fails with "loss.failed: internal error".
    pytest.mark.filterwarnings("ignore:Items? .* on TypedDict class .* `ReadOnly`:UserWarning"),
    # watchdog's inotify thread warns when a new folder's watch is added twice (the
    # recursive add races the folder's own event); as an error it kills that thread.
    pytest.mark.filterwarnings(
        "ignore:Callback with id .* already exists for watch:RuntimeWarning"
    ),
]


# ----------------------------------------------------------------------- the catalogue


@dataclass(frozen=True)
class Documented:
    """One row of the catalogue in docs/events.md."""

    level: str
    alt_level: str | None  # "info (error when `exit_code` ≠ 0)" -> "error"
    alt_when: str | None  # ... and the field that decides: "exit_code"
    fields: frozenset[str]


def load_catalogue() -> dict[str, Documented]:
    text = (REPO / "docs" / "events.md").read_text(encoding="utf-8")
    section = text.split("## Catalogue", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, Documented] = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        name, level_text, _when, fields_text = cells
        alt = re.search(r"\((\w+) when `(\w+)` ≠ 0\)", level_text)
        names = set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", fields_text)))
        if "context fields" in fields_text:
            names |= set(CONTEXT_FIELDS)
        rows[name.strip("`")] = Documented(
            level=level_text.split()[0],
            alt_level=alt.group(1) if alt else None,
            alt_when=alt.group(2) if alt else None,
            fields=frozenset(names),
        )
    return rows


CATALOGUE = load_catalogue()


def catalogue_problems(lines: list[Line]) -> list[str]:
    """Every way the daemon's lines differ from the catalogue (names, levels, fields)."""
    problems = []
    for line in lines:
        if not str(line.get("logger", "")).startswith("skilltrain"):
            continue  # third-party lines use their message as event
        name = line["event"]
        doc = CATALOGUE.get(name)
        if doc is None:
            problems.append(f"{name}: not in the catalogue")
            continue
        expected = {doc.level}
        if doc.alt_level and doc.alt_when:
            expected = {doc.alt_level if line.get(doc.alt_when) != 0 else doc.level}
        if line["level"] not in expected:
            problems.append(f"{name}: level {line['level']}, documented {sorted(expected)}")
        for missing in sorted(doc.fields - set(line)):
            problems.append(f"{name}: no field {missing!r}")
    return problems


def test_the_catalogue_parses_into_every_documented_event() -> None:
    # The parser is the reference the other tests check against: it must see the table.
    assert len(CATALOGUE) >= 25
    assert CATALOGUE["loss.completed"].fields >= {
        "report",
        "tokens_in",
        "cost_usd",
        *CONTEXT_FIELDS,
    }
    assert CATALOGUE["optimizer.output"].fields == {"run", "epoch", "step", "stream", "line"}
    assert CATALOGUE["daemon.stopped"].alt_level == "error"
    assert CATALOGUE["budget.reached"].level == "warning"


# --------------------------------------------------------------------------- workspace


def human_text(work: str, n: int) -> str:
    return (
        "\n".join(
            f"{work.upper()} HUMAN {n} line {i}: Odile folds the {i}th letter into a paper crane "
            f"and sets it on the sill of the lighthouse kitchen {work} {n}."
            for i in range(1, 6)
        )
        + "\n"
    )


def model_text(work: str, n: int, variant: str = "") -> str:
    return (
        "\n".join(
            f"{work} model {n}{variant} beat {i}: the keeper talks about the weather again."
            for i in range(1, 4)
        )
        + "\n"
    )


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)  # strings and lists of strings are valid TOML this way


@dataclass
class Workspace:
    """A project under tmp_path: data/, prompts/, runs/, config.toml, a log outside runs/."""

    root: Path
    server: LLMServer
    model: str
    stderr: io.StringIO = field(default_factory=io.StringIO)
    cfg: config.Config | None = None
    _seen: int = 0

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def log_file(self) -> Path:
        return self.root / "logs" / "skilltrain.jsonl"

    @property
    def config_path(self) -> Path:
        return self.root / "config.toml"

    @property
    def record(self) -> Path:
        """Where the recorder optimizer appends its calls (outside runs/)."""
        return self.root / "optimizer_calls.jsonl"

    def add_work(self, name: str, episodes: int) -> None:
        human = self.root / "data" / name / "human"
        human.mkdir(parents=True)
        for n in range(1, episodes + 1):
            (human / f"ep{n:02d}.txt").write_text(human_text(name, n), encoding="utf-8")

    def write_config(self, **sections: dict[str, object]) -> None:
        settings: dict[str, dict[str, object]] = {
            "paths": {"data": "data", "runs": "runs", "prompts": "prompts"},
            "llm": {
                "model": self.model,
                "api_base": self.server.url,
                "timeout_s": 10,
                "max_retries": 0,
                "backoff_initial_s": 0.01,
            },
            "loss": {"settle_s": 0, "concurrency": 2, "retry_backoff_s": 0},
            "watch": {"resync_s": 300},
            "optimizer": {"command": [], "timeout_s": 20, "max_attempts": 3},
            "log": {"file": str(self.log_file), "level": "info"},
        }
        for name, values in sections.items():
            settings.setdefault(name, {}).update(values)
        self.config_path.write_text(
            "".join(
                f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in body.items())
                for name, body in settings.items()
            ),
            encoding="utf-8",
        )

    def recorder_command(self, exit_code: int = 0, gate: str = "-") -> list[str]:
        return [
            sys.executable,
            str(RECORDER),
            str(self.record),
            str(exit_code),
            gate,
            "{run}",
            "{epoch}",
            "{step}",
            "{reports_dir}",
            "{run_dir}",
        ]

    def load(self) -> config.Config:
        """Load config.toml and route the log to the file (and a StringIO for stderr)."""
        self.cfg = config.load(self.config_path)
        assert self.cfg.log.file is not None
        slog.configure(log_file=self.cfg.log.file, level=self.cfg.log.level, stderr=self.stderr)
        return self.cfg

    def scripts(
        self,
        run: str,
        epoch: int,
        step: int,
        work: str,
        numbers: range,
        *,
        variant: str = "",
        success: bool = True,
    ) -> Path:
        folder = self.runs / run / f"epoch_{epoch:02d}" / f"step_{step:02d}" / work / "scripts"
        folder.mkdir(parents=True, exist_ok=True)
        for n in numbers:
            (folder / f"ep{n:02d}.txt").write_text(model_text(work, n, variant), encoding="utf-8")
        if success:
            (folder / "_SUCCESS").touch()
        return folder

    def lines(self, path: Path | None = None) -> list[Line]:
        path = path or self.log_file
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x]

    def new_lines(self) -> list[Line]:
        """Lines logged since the last call."""
        lines = self.lines()
        fresh, self._seen = lines[self._seen :], len(lines)
        return fresh

    def calls(self) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        return [json.loads(x) for x in self.record.read_text(encoding="utf-8").splitlines()]


def make_workspace(root: Path, server: LLMServer, model: str) -> Workspace:
    """Work "a" (3 human episodes), the repository's prompts, a config for `server`."""
    root.mkdir(parents=True)
    shutil.copytree(REPO / "prompts", root / "prompts")
    workspace = Workspace(root=root, server=server, model=model)
    workspace.add_work("a", 3)
    workspace.write_config()
    return workspace


SECRET_KEY = "sk-live-SECRET123456789abcdef"


@dataclass
class BackgroundDaemon:
    """A `skilltrain daemon --once` subprocess and the workspace it works on."""

    ws: Workspace
    proc: subprocess.Popen[str]
    _output: tuple[str, str] | None = None

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) once it has exited."""
        if self._output is None:
            self._output = self.proc.communicate(timeout=60)
        return self._output


@pytest.fixture(scope="module")
def auth_error_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundDaemon]:
    """The daemon with a live-looking API key, against a server that answers 401 and
    echoes the key in its error body.

    Started with the module so that its litellm import (~5 s) overlaps the one in
    this process; test_no_api_key_in_the_log_on_an_auth_error checks what it wrote.
    """
    server = LLMServer().start()
    ws = make_workspace(
        tmp_path_factory.mktemp("auth") / "project", server, "openai/loopback-model"
    )
    ws.scripts("r1", 1, 1, "a", range(1, 4))
    message = (
        f"Incorrect API key provided: {SECRET_KEY}. You can find your API key at "
        f"https://platform.example/account/api-keys (key={SECRET_KEY})"
    )
    error = {"message": message, "type": "invalid_request_error", "code": "invalid_api_key"}
    server.script(Reply.status(401, body={"error": error}))
    env = {**os.environ, "OPENAI_API_KEY": SECRET_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    proc = subprocess.Popen(
        [str(SKILLTRAIN), "daemon", "--once", "--config", str(ws.config_path)],
        cwd=ws.root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    background = BackgroundDaemon(ws, proc)
    try:
        yield background
    finally:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            background.output()
        server.stop()


@pytest.fixture(scope="module", autouse=True)
def _litellm_imported_and_frozen(auth_error_daemon: BackgroundDaemon) -> Iterator[None]:
    # Pay the ~5 s import and the lazy first-call imports once, outside the tests' waits.
    with LLMServer() as server:
        settings = config.LLMConfig(model="openai/loopback-model", api_base=server.url)
        llm.complete([{"role": "user", "content": "warm up"}], settings)
    gc.collect()
    # litellm's object graph makes every full collection cost ~0.5 s; frozen, the
    # per-test collection below only walks what the test allocated.
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture
def ws(tmp_path: Path, llm_server: LLMServer, llm_model: str) -> Iterator[Workspace]:
    workspace = make_workspace(tmp_path / "project", llm_server, llm_model)
    yield workspace
    slog.shutdown()
    logging.getLogger().setLevel(logging.WARNING)
    gc.collect()  # see pytestmark: collect a dropped litellm client inside this test


@contextlib.contextmanager
def daemon_once(cfg: config.Config) -> Iterator[service.Daemon]:
    """A started `--once` daemon; the block may scan again; shut down on exit."""
    d = service.Daemon(cfg, once=True)
    d.start()
    try:
        d.run_once()
        yield d
        d.run_once()
    finally:
        d.shutdown("test")


def run_once(ws: Workspace) -> list[Line]:
    """One `daemon --once` pass over the tree; returns the lines it logged."""
    ws.new_lines()
    with daemon_once(ws.cfg or ws.load()):
        pass
    return ws.new_lines()


@contextlib.contextmanager
def daemon_forever(cfg: config.Config) -> Iterator[service.Daemon]:
    """The long-running daemon (watcher, scheduler, main loop in a thread)."""
    d = service.Daemon(cfg)
    d.start()
    loop = threading.Thread(target=d.run_forever, name="run-forever", daemon=True)
    loop.start()
    try:
        yield d
    finally:
        d.stop_event.set()
        loop.join(timeout=WAIT_S)
        d.shutdown("test")


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


def named(lines: list[Line], event: str, **match: object) -> list[Line]:
    return [
        x for x in lines if x["event"] == event and all(x.get(k) == v for k, v in match.items())
    ]


def events(lines: list[Line]) -> list[str]:
    return [x["event"] for x in lines if str(x.get("logger", "")).startswith("skilltrain")]


def status_of(ws: Workspace) -> dict[str, Any]:
    """What `skilltrain status --json` prints, in-process."""
    return status.collect(ws.runs)


def status_json(ws: Workspace) -> dict[str, Any]:
    done = subprocess.run(
        [str(SKILLTRAIN), "status", "--json", "--config", str(ws.config_path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    data: dict[str, Any] = json.loads(done.stdout)
    return data


# ------------------------------------------------------------------- end-to-end events


def test_a_run_logs_the_documented_events_in_order(ws: Workspace) -> None:
    ws.add_work("b", 6)  # two ranges: 01-03 and 04-06
    ws.write_config(loss={"concurrency": 2})
    ws.scripts("r7", 1, 2, "a", range(1, 4))
    ws.scripts("r7", 1, 2, "b", range(1, 7))
    ws.server.script(
        *[
            Reply.ok(
                "A report on scene length and subtext.",
                prompt_tokens=1234,
                completion_tokens=56,
                cached_tokens=7,
            )
        ]
        * 3
    )
    before = datetime.now(UTC)

    lines = run_once(ws)

    after = datetime.now(UTC)
    names = events(lines)
    assert names[0] == "daemon.started"
    assert names[-1] == "daemon.stopped"
    # Between stopping and stopped only the runs' final cost totals.
    assert set(names[names.index("daemon.stopping") + 1 : -1]) <= {"cost.total"}
    assert names.count("step.reported") == 1
    assert names.count("loss.completed") == 3
    assert names.index("scan.completed") < names.index("daemon.ready")
    # After every loss.started (and loss.completed: its own test below).
    assert (
        max(i for i, n in enumerate(names) if n == "loss.started")
        < names.index("step.reported")
        < names.index("daemon.stopping")
    )

    # Each job: loss.queued -> loss.started -> loss.completed, same context
    # (set.ready is a debug line: it would say what loss.queued says).
    assert not named(lines, "set.ready")
    sets = {(x["work"], x["range"]) for x in named(lines, "loss.queued")}
    assert sets == {("a", "01-03"), ("b", "01-03"), ("b", "04-06")}
    for work, span in sets:
        mine = [x for x in lines if x.get("work") == work and x.get("range") == span]
        assert [x["event"] for x in mine if x["event"].startswith(("set.", "loss."))] == [
            "loss.queued",
            "loss.started",
            "loss.completed",
        ]
        job_ids = {x["job_id"] for x in mine if x["event"].startswith("loss.")}
        assert len(job_ids) == 1 and job_ids != {""}
        for x in mine:
            if x["event"].startswith("loss."):
                assert {k: x[k] for k in ("run", "epoch", "step")} == {
                    "run": "r7",
                    "epoch": 1,
                    "step": 2,
                }
                assert set(CONTEXT_FIELDS) <= set(x), x
        done = named(mine, "loss.completed")[0]
        report = ws.runs / "r7" / "loss" / "epoch_01" / "step_02" / f"{work}_ep{span}.md"
        assert Path(done["report"]) == report and report.is_file()
        assert (done["tokens_in"], done["tokens_out"], done["tokens_cached"]) == (1234, 56, 7)
        assert isinstance(done["duration_ms"], int) and done["duration_ms"] >= 0
        assert "cost_usd" in done
        started = named(mine, "loss.started")[0]
        # Not counted: litellm knows no window for the loopback model.
        assert started["prompt_chars"] > 0 and started["prompt_tokens"] is None

    reported = named(lines, "step.reported")[0]
    assert {k: reported[k] for k in ("run", "epoch", "step", "sets")} == {
        "run": "r7",
        "epoch": 1,
        "step": 2,
        "sets": 3,
    }
    assert Path(reported["reports_dir"]) == ws.runs / "r7" / "loss" / "epoch_01" / "step_02"
    stopped = named(lines, "daemon.stopped")[0]
    assert (stopped["exit_code"], stopped["done"], stopped["failed"], stopped["abandoned"]) == (
        0,
        3,
        0,
        0,
    )
    started = named(lines, "daemon.started")[0]
    assert started["pid"] == os.getpid() and Path(started["config"]) == ws.config_path

    for x in lines:
        assert TIMESTAMP.fullmatch(x["timestamp"]), x["timestamp"]
        stamp = datetime.fromisoformat(x["timestamp"])
        assert stamp.utcoffset() == timedelta(0)
        assert before - timedelta(seconds=1) <= stamp <= after + timedelta(seconds=1)
        assert x["level"] in ("debug", "info", "warning", "error", "critical")
    # Names, levels and fields as catalogued.
    assert catalogue_problems(lines) == []
    # stderr (not a terminal) carries the same JSON lines. Not always in the same
    # order: two threads logging at once can pass the two handlers in turn.
    assert sorted(json.loads(x)["event"] for x in ws.stderr.getvalue().splitlines()) == sorted(
        x["event"] for x in lines
    )


def test_scan_completed_has_the_documented_counts(ws: Workspace) -> None:
    ws.scripts("r1", 1, 1, "a", range(1, 4))
    lines = run_once(ws)
    scan = named(lines, "scan.completed")[0]
    assert scan["sets"] == 1
    # One count per set state: the startup scan found the set ready and queued it.
    assert scan["queued"] + scan["running"] + scan["done"] == 1
    assert scan["waiting"] == scan["settling"] == scan["failed"] == scan["refused"] == 0


def test_loss_completed_cost_is_null_when_unknown(ws: Workspace) -> None:
    # litellm cannot price the loopback model: unknown is logged as null, never as 0.0.
    ws.scripts("r1", 1, 1, "a", range(1, 4))
    done = named(run_once(ws), "loss.completed")
    assert len(done) == 1
    assert "cost_usd" in done[0] and done[0]["cost_usd"] is None


def test_daemon_started_names_the_observer_in_use(ws: Workspace) -> None:
    ws.write_config(watch={"observer": "auto"})
    ws.load()
    with daemon_forever(ws.cfg or ws.load()):
        pass
    started = named(ws.lines(), "daemon.started")[0]
    assert started["observer"] == "auto"  # as configured
    ready = named(ws.lines(), "daemon.ready")[0]
    assert ready["observer"] in ("native", "polling")  # the one in use


def test_cost_total_is_logged_at_stop(ws: Workspace) -> None:
    ws.scripts("r1", 1, 1, "a", range(1, 4))
    ws.server.script(Reply.ok("A report.", prompt_tokens=100, completion_tokens=10))
    run_once(ws)
    # A restart with nothing to do: the run's totals still come at stop.
    lines = run_once(ws)
    totals = named(lines, "cost.total", run="r1")
    assert totals and (totals[-1]["tokens_in"], totals[-1]["tokens_out"]) == (100, 10)
    names = events(lines)
    assert names.index("daemon.stopping") < len(names) - 1 - names[::-1].index("cost.total")


# ------------------------------------------------------------------------- step barrier


def test_step_reported_once_across_a_restart(ws: Workspace) -> None:
    ws.write_config(optimizer={"command": ws.recorder_command()})
    ws.scripts("r1", 1, 1, "a", range(1, 4))

    first = run_once(ws)
    second = run_once(ws)

    assert len(named(first, "step.reported", run="r1", epoch=1, step=1)) == 1
    assert len(named(first, "optimizer.started")) == 1
    for name in ("step.reported", "loss.queued", "loss.started", "optimizer.started"):
        assert named(second, name) == [], name
    assert named(second, "daemon.started") and named(second, "daemon.stopped")
    assert len(ws.calls()) == 1
    assert ws.server.request_count == 1


class HoldFirstLossCompleted(logging.Handler):
    """First on the root logger: holds the first loss.completed line (up to 3 s) until
    `released` is set, before any other handler has written it."""

    def __init__(self, released: threading.Event) -> None:
        super().__init__()
        self.released = released
        self.held = False
        self._once = threading.Lock()

    def handle(self, record: logging.LogRecord) -> bool:
        # No handler lock: the other job's lines must pass while one line is held.
        msg = record.msg
        if isinstance(msg, dict) and msg.get("event") == "loss.completed":
            with self._once:
                hold, self.held = not self.held, True
            if hold:
                self.released.wait(3.0)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        pass


class SetOnStepReported(logging.Handler):
    """Last on the root logger: sets `released` once step.reported has been written."""

    def __init__(self, released: threading.Event) -> None:
        super().__init__()
        self.released = released

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and record.msg.get("event") == "step.reported":
            self.released.set()


def test_step_reported_comes_after_the_last_loss_completed(ws: Workspace) -> None:
    ws.add_work("b", 6)  # one step, two sets, two workers
    ws.write_config(loss={"concurrency": 2})
    ws.scripts("r1", 1, 1, "b", range(1, 7))
    (ws.runs / "r1" / "run.toml").write_text('works = ["b"]\n', encoding="utf-8")
    ws.load()
    # The interleaving seen in the wild, made certain: one job's loss.completed line is
    # slow to be written while the other job finishes.
    released = threading.Event()
    root = logging.getLogger()
    hold, signal = HoldFirstLossCompleted(released), SetOnStepReported(released)
    root.handlers.insert(0, hold)
    root.addHandler(signal)
    try:
        lines = run_once(ws)
    finally:
        root.removeHandler(hold)
        root.removeHandler(signal)
    assert hold.held
    names = events(lines)
    assert names.count("loss.completed") == 2 and names.count("step.reported") == 1
    assert max(i for i, n in enumerate(names) if n == "loss.completed") < names.index(
        "step.reported"
    )


def test_expected_works_are_all_of_data_unless_run_toml_lists_them(ws: Workspace) -> None:
    ws.add_work("b", 3)
    for run in ("all works", "only a"):
        ws.scripts(run, 1, 1, "a", range(1, 4))  # work b's scripts are not there
    (ws.runs / "only a" / "run.toml").write_text('works = ["a"]\n', encoding="utf-8")
    ws.load()

    with daemon_once(ws.cfg or ws.load()) as d:
        lines = ws.new_lines()
        reported = named(lines, "step.reported")
        assert [(x["run"], x["sets"]) for x in reported] == [("only a", 1)]
        assert len(named(lines, "loss.completed")) == 2  # work a in both runs
        # The barrier holds for "all works" until b's episodes come.
        ws.scripts("all works", 1, 1, "b", range(1, 4))
        d.reconcile.scan()
        d.run_once()

    reported = named(ws.new_lines(), "step.reported")
    assert [(x["run"], x["sets"]) for x in reported] == [("all works", 2)]


# ---------------------------------------------------------------------------- optimizer


def test_optimizer_gets_literal_argv_and_its_output_is_logged(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = "run; touch PWNED $(id) 'x' \"y\" `id` | cat & > out"
    monkeypatch.chdir(ws.root)  # where a shell's `touch PWNED` would land
    ws.add_work("b", 3)
    # The default concurrency: the two sets' jobs may finish together, and the
    # optimizer must still run once.
    ws.write_config(optimizer={"command": ws.recorder_command()})
    ws.scripts(run, 2, 3, "a", range(1, 4))
    ws.scripts(run, 2, 3, "b", range(1, 4))

    lines = run_once(ws)

    reports_dir = ws.runs / run / "loss" / "epoch_02" / "step_03"
    values = [run, "02", "03", str(reports_dir), str(ws.runs / run)]
    (call,) = ws.calls()
    assert call["argv"] == [str(ws.record), "0", "-", *values]
    # The barrier: both reports (with archives and sidecars) existed when it ran.
    assert call["dirs"][str(reports_dir)] == sorted(
        f"{w}_ep01-03{suffix}" for w in "ab" for suffix in (".json", ".md", "_prompt.md")
    )
    assert not any(p.name in ("PWNED", "out") for p in ws.root.parent.rglob("*"))
    assert not (REPO / "PWNED").exists()

    (started,) = named(lines, "optimizer.started")
    assert started["argv"] == [sys.executable, str(RECORDER), str(ws.record), "0", "-", *values]
    assert (started["run"], started["epoch"], started["step"]) == (run, 2, 3)
    output = {(x["stream"], x["line"]) for x in named(lines, "optimizer.output")}
    assert output == {
        ("stdout", "recorder: optimizing 5 values"),
        ("stdout", "recorder: second stdout line"),
        ("stderr", "recorder: a warning on stderr"),
    }
    (finished,) = named(lines, "optimizer.finished")
    assert finished["exit_code"] == 0 and finished["level"] == "info"
    assert isinstance(finished["duration_ms"], int) and finished["duration_ms"] >= 0
    assert named(lines, "optimizer.failed") == []
    names = events(lines)
    assert (
        names.index("step.reported")
        < names.index("optimizer.started")
        < names.index("optimizer.finished")
        < names.index("daemon.stopping")
    )
    assert status_of(ws)["steps"][0]["optimizer"] == "done"


class CheckStepWhileLogging(logging.Handler):
    """Runs a second `check_step` for the step while the first logs step.reported.

    That is the interleaving of two jobs of one step finishing together (or a job
    and the resync scan): the second barrier check lands after the first has
    decided to run the optimizer and before it has submitted it.
    """

    def __init__(self, daemon: service.Daemon) -> None:
        super().__init__()
        self.daemon = daemon
        self.fired = False

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if self.fired or not (isinstance(msg, dict) and msg.get("event") == "step.reported"):
            return
        self.fired = True
        self.daemon.steps.check(StepKey(msg["run"], msg["epoch"], msg["step"]))


def test_optimizer_runs_once_when_two_barrier_checks_race(ws: Workspace) -> None:
    ws.write_config(optimizer={"command": ws.recorder_command()})
    ws.scripts("r1", 1, 1, "a", range(1, 4))
    d = service.Daemon(ws.load(), once=True)
    racer = CheckStepWhileLogging(d)
    logging.getLogger().addHandler(racer)
    try:
        d.start()
        d.run_once()
    finally:
        logging.getLogger().removeHandler(racer)
        d.shutdown("test")
    assert racer.fired
    assert len(named(ws.lines(), "step.reported")) == 1
    assert len(named(ws.lines(), "optimizer.started")) == 1
    assert len(ws.calls()) == 1


def test_optimizer_output_lines_carry_run_epoch_step(ws: Workspace) -> None:
    ws.write_config(optimizer={"command": ws.recorder_command()})
    ws.scripts("r1", 1, 1, "a", range(1, 4))
    output = named(run_once(ws), "optimizer.output")
    assert len(output) == 3
    for line in output:
        assert (line.get("run"), line.get("epoch"), line.get("step")) == ("r1", 1, 1)


def test_optimizer_finished_is_an_error_when_it_exits_non_zero(ws: Workspace) -> None:
    ws.write_config(optimizer={"command": ws.recorder_command(exit_code=3), "max_attempts": 1})
    ws.scripts("r1", 1, 1, "a", range(1, 4))
    (finished,) = named(run_once(ws), "optimizer.finished")
    assert finished["exit_code"] == 3
    assert finished["level"] == "error"


def test_failing_optimizer_is_retried_per_scan_up_to_max_attempts_and_blocks_nothing(
    ws: Workspace,
) -> None:
    gate = ws.root / "gate"
    # The optimizer's own backoff: the loss step's (an hour here) is not its.
    ws.write_config(
        optimizer={"command": ws.recorder_command(exit_code=3, gate=str(gate)), "max_attempts": 3,
                   "retry_backoff_s": 0},
        loss={"retry_backoff_s": 3600},
    )
    ws.scripts("r1", 1, 1, "a", range(1, 4))
    ws.load()
    d = service.Daemon(ws.cfg or ws.load(), once=True)
    d.start()
    try:
        # r1's optimizer runs and hangs on the gate; r2's loss job must not wait for it.
        wait_for("r1's optimizer to start", lambda: len(ws.calls()) == 1)
        ws.scripts("r2", 1, 1, "a", range(1, 4))
        d.reconcile.scan()
        wait_for("r2's report", lambda: bool(named(ws.lines(), "loss.completed", run="r2")))
        assert named(ws.lines(), "optimizer.finished") == []
        gate.touch()
        d.run_once()
        for _ in range(3):  # attempts 2 and 3, then nothing more
            d.reconcile.scan()
            d.run_once()
    finally:
        gate.touch()
        d.shutdown("test")

    lines = ws.lines()
    for run in ("r1", "r2"):
        assert len(named(lines, "optimizer.started", run=run)) == 3
        failed = named(lines, "optimizer.failed", run=run)
        assert [x["attempt"] for x in failed] == [1, 2, 3]
        assert all(x["level"] == "error" and "exit code 3" in x["reason"] for x in failed)
        assert [x["exit_code"] for x in named(lines, "optimizer.finished", run=run)] == [3] * 3
        assert len(named(lines, "step.reported", run=run)) == 1
    assert len(ws.calls()) == 6
    steps = {s["step"]: s for s in status_of(ws)["steps"]}
    assert steps["r1/epoch_01/step_01"]["optimizer"] == "failed x3 (exit 3)"


def test_optimizer_timeout_kills_it_and_a_missing_program_stops_the_start(ws: Workspace) -> None:
    ws.write_config(
        optimizer={
            "command": ws.recorder_command(gate=str(ws.root / "never")),
            "timeout_s": 1.5,  # room for the interpreter to start and record its pid
            "max_attempts": 1,
        }
    )
    ws.scripts("r1", 1, 1, "a", range(1, 4))
    lines = run_once(ws)
    (failed,) = named(lines, "optimizer.failed")
    assert "timed out" in failed["reason"] and failed["attempt"] == 1
    (call,) = ws.calls()
    with pytest.raises(ProcessLookupError):
        os.kill(call["pid"], 0)  # killed and reaped, not left running

    ws.write_config(
        optimizer={"command": [str(ws.root / "no-such-optimizer"), "{run}"], "max_attempts": 1}
    )
    ws.scripts("r2", 1, 1, "a", range(1, 4))
    with pytest.raises(ConfigError, match="no-such-optimizer"):  # exit 2, before any step
        service.Daemon(ws.load(), once=True).start()
    # One that goes missing once started: tests/test_steps.py.


def test_empty_command_reports_the_step_and_starts_no_optimizer(ws: Workspace) -> None:
    ws.scripts("r1", 1, 1, "a", range(1, 4))
    lines = run_once(ws)
    assert len(named(lines, "step.reported", run="r1")) == 1
    assert [n for n in events(lines) if n.startswith("optimizer.")] == []
    assert status_of(ws)["steps"][0]["optimizer"] == "event only"


def test_report_redone_after_the_optimizer_ran_reports_the_step_again_and_reruns_it(
    ws: Workspace,
) -> None:
    ws.write_config(optimizer={"command": ws.recorder_command()})
    scripts = ws.scripts("r1", 1, 1, "a", range(1, 4))
    ws.load()
    with daemon_once(ws.cfg or ws.load()) as d:
        assert len(named(ws.new_lines(), "optimizer.finished", exit_code=0)) == 1
        (scripts / "ep02.txt").write_text(model_text("a", 2, "rewritten"), encoding="utf-8")
        (scripts / "_SUCCESS").touch()  # the writer marks the rewrite finished
        d.reconcile.scan()
        d.run_once()
    lines = ws.new_lines()

    (stale,) = named(lines, "set.stale")
    assert (stale["run"], stale["work"], stale["range"]) == ("r1", "a", "01-03")
    assert "optimizer" in stale["reason"] and "re-run" in stale["reason"]
    assert len(named(lines, "loss.completed")) == 1  # the report was redone
    # The optimizer learnt from the report that was just replaced: the step
    # is reported again, saying why, and the optimizer runs on the new one.
    (again,) = named(lines, "step.reported")
    assert again["again"] is True and "r1/epoch_01/step_01/a/01-03" in again["reason"]
    assert len(named(lines, "optimizer.started")) == 1
    assert len(ws.calls()) == 2


def test_set_stale_level_matches_the_catalogue(ws: Workspace) -> None:
    ws.write_config(optimizer={"command": ws.recorder_command()})
    scripts = ws.scripts("r1", 1, 1, "a", range(1, 4))
    run_once(ws)
    (scripts / "ep02.txt").write_text(model_text("a", 2, "rewritten"), encoding="utf-8")
    (scripts / "_SUCCESS").touch()  # the writer marks the rewrite finished
    lines = run_once(ws)
    assert named(lines, "set.stale")
    assert catalogue_problems(named(lines, "set.stale")) == []


# ---------------------------------------------------------------------------- log file


def test_log_lines_follow_a_renamed_log_file(ws: Workspace) -> None:
    ws.write_config(loss={"settle_s": 30})  # _SUCCESS makes them ready at once
    ws.load()
    rotated = ws.log_file.with_name("skilltrain.jsonl.1")
    with daemon_forever(ws.cfg or ws.load()):
        ws.scripts("r1", 1, 1, "a", range(1, 4))
        wait_for("step 1 reported", lambda: bool(named(ws.lines(), "step.reported", step=1)))
        ws.log_file.rename(rotated)  # what logrotate does
        ws.scripts("r1", 1, 2, "a", range(1, 4))
        wait_for("step 2 reported", lambda: bool(named(ws.lines(), "step.reported", step=2)))

    old, new = ws.lines(rotated), ws.lines()
    assert named(old, "step.reported", step=1) and not named(old, "step.reported", step=2)
    assert named(new, "loss.completed", step=2) and named(new, "daemon.stopped")
    assert not named(new, "daemon.started") and not named(new, "step.reported", step=1)


def test_no_human_text_in_the_log_state_sidecars_or_archives(ws: Workspace) -> None:
    shutil.copytree(EXAMPLE, ws.root / "data" / "example")
    human = [
        line.strip()
        for f in sorted((EXAMPLE / "human").glob("ep*.txt"))
        for line in f.read_text(encoding="utf-8").splitlines()
    ]
    model = "\n".join(
        f.read_text(encoding="utf-8") for f in sorted((EXAMPLE / "model_draft").glob("ep*.txt"))
    )
    # Scene headings the model draft shares may appear (in the archive, as model text).
    secret = sorted({line for line in human if len(line) > 20 and line not in model})
    assert len(secret) > 200
    run = "r1"
    scripts = ws.runs / run / "epoch_01" / "step_01" / "example" / "scripts"
    shutil.copytree(EXAMPLE / "model_draft", scripts)
    (scripts / "_SUCCESS").touch()
    (ws.runs / run / "run.toml").write_text('works = ["example"]\n', encoding="utf-8")
    # The reviewer quotes the answer key at length, as LLMs do: from the prompt it got.
    # Each quote must be redacted before the report is written.

    def quoting(request: Request) -> Reply:
        prompt = "\n".join(str(m.get("content")) for m in request.messages)
        quote = next(line for line in secret if len(line) > 100 and line in prompt)
        return Reply.ok(f"The original opens on an image.\n\n> {quote}\n\nThe model tells.")

    ws.server.default = quoting

    lines = run_once(ws)

    assert len(named(lines, "loss.completed")) == 2
    assert all(x["leaks_redacted"] >= 1 for x in named(lines, "loss.completed"))
    reports_dir = ws.runs / run / "loss" / "epoch_01" / "step_01"
    written = [
        ws.log_file,
        ws.runs / ".skilltrain" / "state.sqlite3",
        *sorted(reports_dir.glob("*.json")),
        *sorted(reports_dir.glob("*_prompt.md")),
        *sorted(reports_dir.glob("*.md")),
    ]
    assert len(written) == 2 + 2 + 2 + 4
    for path in written:
        text = path.read_bytes().decode("utf-8", "replace")  # the state database is binary
        found = [line for line in secret if line in text]
        assert found == [], f"{path.name} holds human text: {found[0][:40]!r}..."
    assert ws.stderr.getvalue() and not any(line in ws.stderr.getvalue() for line in secret)


def test_no_api_key_in_the_log_on_an_auth_error(auth_error_daemon: BackgroundDaemon) -> None:
    ws = auth_error_daemon.ws
    stdout, stderr = auth_error_daemon.output()

    # --once exits 1 when the provider refuses the key (a 401: the endpoint is blocked).
    assert auth_error_daemon.proc.returncode == 1, stderr[-2000:]
    (request,) = ws.server.requests
    assert request.headers["authorization"] == f"Bearer {SECRET_KEY}"  # really in play
    lines = ws.lines()
    (failed,) = named(lines, "llm.blocked")
    assert "401" in failed["reason"] and "Incorrect API key provided" in failed["reason"]
    assert set(CONTEXT_FIELDS) <= set(failed) and failed["level"] == "error"
    for where, text in (
        ("log file", ws.log_file.read_text(encoding="utf-8")),
        ("stderr", stderr),
        ("stdout", stdout),
    ):
        assert "SECRET123456789" not in text, where
    assert [json.loads(x)["event"] for x in stderr.splitlines() if x.startswith("{")] == [
        x["event"] for x in lines
    ]


# ------------------------------------------------------------------------------- budget


@pytest.fixture
def priced_model(ws: Workspace) -> Iterator[str]:
    """A loopback model litellm can price: $0.001 per token in, $0.002 out."""
    lm = llm.litellm()
    lm.register_model(
        {
            PRICED_MODEL: {
                "input_cost_per_token": 0.001,
                "output_cost_per_token": 0.002,
                "litellm_provider": "openai",
                "mode": "chat",
                "max_input_tokens": 100_000,
            }
        }
    )
    ws.model = PRICED_MODEL
    yield PRICED_MODEL
    lm.model_cost.pop(PRICED_MODEL, None)


def priced_reply(delay_s: float = 0.0) -> Reply:
    # 400 * 0.001 + 100 * 0.002 = $0.60 per report
    return Reply.delay(delay_s, Reply.ok("A report.", prompt_tokens=400, completion_tokens=100))


def test_budget_stops_new_jobs_lets_running_ones_finish_and_status_shows_spend(
    ws: Workspace, priced_model: str
) -> None:
    ws.add_work("b", 6)  # two ranges per step
    ws.write_config(llm={"budget_usd": 0.5}, loss={"concurrency": 2})
    ws.server.default = lambda request: priced_reply(delay_s=0.3)
    ws.scripts("r1", 1, 1, "b", range(1, 7))
    (ws.runs / "r1" / "run.toml").write_text('works = ["b"]\n', encoding="utf-8")
    (ws.runs / "r2").mkdir(parents=True)
    (ws.runs / "r2" / "run.toml").write_text('works = ["b"]\n', encoding="utf-8")
    ws.load()

    with daemon_once(ws.cfg or ws.load()) as d:
        first = ws.new_lines()
        # Both jobs were running when the first one crossed the budget: both finish.
        names = events(first)
        assert names.count("loss.started") == 2
        assert max(i for i, n in enumerate(names) if n == "loss.started") < names.index(
            "loss.completed"
        )
        assert [x["cost_usd"] for x in named(first, "loss.completed")] == [pytest.approx(0.6)] * 2
        assert len(list((ws.runs / "r1" / "loss").rglob("*.md"))) == 4  # 2 reports, 2 archives
        # Over budget: r1's next step gets no job; r2 has its own budget.
        ws.scripts("r1", 1, 2, "b", range(1, 7))
        ws.scripts("r2", 1, 1, "b", range(1, 7))
        d.reconcile.scan()
        d.run_once()
        d.reconcile.scan()
        d.run_once()
    lines = ws.new_lines()

    (reached,) = named(first + lines, "budget.reached")
    assert reached["run"] == "r1" and reached["level"] == "warning"
    assert reached["spent_usd"] == pytest.approx(1.2) and reached["budget_usd"] == 0.5
    assert named(lines, "loss.queued", run="r1") == []
    assert len(named(lines, "loss.completed", run="r2")) == 2
    assert ws.server.request_count == 4
    totals = named(first + lines, "cost.total", run="r1")
    assert totals[-1]["cost_usd"] == pytest.approx(1.2) and totals[-1]["tokens_in"] == 800

    shown = status_json(ws)
    spend = shown["spend"]["r1"]
    assert spend["cost_usd"] == pytest.approx(1.2)
    assert (spend["tokens_in"], spend["tokens_out"], spend["reports"]) == (800, 200, 2)
    assert shown["spend"]["r2"]["cost_usd"] == pytest.approx(1.2)
    held = [s for s in shown["sets"] if s["set"].startswith("r1/epoch_01/step_02/")]
    assert len(held) == 2 and all(s["reason"] == "budget reached" for s in held)


def test_budget_stops_queued_jobs_from_starting(ws: Workspace, priced_model: str) -> None:
    ws.add_work("b", 6)
    ws.write_config(llm={"budget_usd": 0.5}, loss={"concurrency": 1})
    ws.server.default = lambda request: priced_reply()
    ws.scripts("r1", 1, 1, "b", range(1, 7))
    (ws.runs / "r1" / "run.toml").write_text('works = ["b"]\n', encoding="utf-8")

    lines = run_once(ws)

    assert len(named(lines, "loss.queued")) == 2  # both were ready in the startup scan
    assert ws.server.request_count == 1  # the second must not spend past the budget
    assert len(named(lines, "budget.reached", run="r1")) == 1
