"""Shared helpers for the daemon's integration tests: workspaces, real writers, waits.

Everything here is real: a workspace is a directory tree under tmp_path with
its own data/, runs/, prompts/ and config.toml; the writers below write the
way rsync, cp, mv and a slow generator do; the daemon runs in-process (a real
Daemon with its watchdog observer and APScheduler) or as a subprocess (the
real `skilltrain daemon` command; for the tests that restart it again and
again, forked from an interpreter that has imported litellm: tests/forkserver.py).
Waits poll with a deadline, never a bare sleep, so a slow machine makes a test
slower, not flaky.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tests.forkserver import ForkServer, Started
from tests.llm_server import DEFAULT_REPORT, LLMServer, Reply, Request

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
SKILLTRAIN = VENV_BIN / "skilltrain"
TEMPLATE = REPO / "prompts" / "loss.md.j2"
TEMP_PREFIX = ".skilltrain-tmp-"

T = TypeVar("T")

# Model episodes start with this line, so a request names the set it is for.
MARKER = re.compile(r"SETMARK (\S+) epoch=(\d+) step=(\d+) work=(\S+) ep=(\d+)")

_CUES = ["MARA", "JONAH", "THE WARDEN", "ISKRA", "OLD PELL", "DISPATCH"]
_PLACES = ["LIGHTHOUSE", "FERRY DECK", "SALT MARSH", "RADIO SHACK", "DRY DOCK", "CHAPEL"]
# Two disjoint vocabularies: the model's episodes share no phrase with the human
# ones, so the leak guard and the audit have nothing to find in them.
_HUMAN_WORDS = (
    "amber anchor ballast beacon bramble cinder cobalt drift ember fathom flint gale "
    "gannet harbour heron hollow inlet jetty kelp lantern ledger marrow mooring nettle"
).split()
_MODEL_WORDS = (
    "oar pewter quay rigging rust sable shingle skiff sorrel spindle tallow thistle "
    "tinder umber vellum wicker willow wren yarrow zinc basalt cormorant dune estuary"
).split()


# ------------------------------------------------------------------------ waiting


def wait_until(
    predicate: Callable[[], T | None],
    timeout: float,
    *,
    interval: float = 0.03,
    message: str | Callable[[], str] = "condition",
) -> T:
    """Poll `predicate` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout:g}s waiting for {text}")
        time.sleep(interval)


def stays(predicate: Callable[[], bool], seconds: float, *, interval: float = 0.05) -> bool:
    """True when `predicate` holds for the whole `seconds` (checked every `interval`)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not predicate():
            return False
        time.sleep(interval)
    return predicate()


# ------------------------------------------------------------------------- texts


def screenplay(seed: str, scenes: int = 3, lines_per_scene: int = 6, *, model: bool = False) -> str:
    """A small screenplay-shaped text, deterministic per seed, unique across seeds."""
    rng = random.Random(hashlib.sha256(seed.encode()).digest())
    vocabulary = _MODEL_WORDS if model else _HUMAN_WORDS
    out: list[str] = []
    for n in range(scenes):
        place = rng.choice(_PLACES)
        out.append(f"{rng.choice(['INT.', 'EXT.'])} {place} - {rng.choice(['DAY', 'NIGHT'])}")
        out.append("")
        for _ in range(lines_per_scene):
            cue = rng.choice(_CUES)
            words = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(6, 12)))
            out.append(cue)
            out.append(words.capitalize() + rng.choice([".", "?", "!"]))
            out.append("")
        out.append(("SMASH CUT." if model else "CUT TO:") if n + 1 < scenes else "FADE OUT.")
        out.append("")
    return "\n".join(out)


def model_episode(run: str, epoch: int, step: int, work: str, ep: int, version: int = 0) -> str:
    """A model episode whose first line names its set (see MARKER)."""
    head = f"SETMARK {run} epoch={epoch} step={step} work={work} ep={ep}"
    seed = f"model/{run}/{epoch}/{step}/{work}/{ep}/{version}"
    return head + "\n\n" + screenplay(seed, model=True)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------- workspace


@dataclass(frozen=True)
class SetId:
    run: str
    epoch: int
    step: int
    work: str
    first: int
    last: int

    @property
    def id(self) -> str:
        return (
            f"{self.run}/epoch_{self.epoch:02d}/step_{self.step:02d}/{self.work}/"
            f"{self.first:02d}-{self.last:02d}"
        )


@dataclass
class Workspace:
    """One test's data/, runs/, prompts/, config.toml and log file."""

    root: Path
    config_path: Path
    works: dict[str, int]  # work name -> number of human episodes
    per_report: int
    log_file: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_file = self.root / LOG_NAME

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def outside(self) -> Path:
        """A folder on the same filesystem as runs/ but outside it (for mv)."""
        path = self.root / "outside"
        path.mkdir(exist_ok=True)
        return path

    @property
    def state_file(self) -> Path:
        return self.runs / ".skilltrain" / "state.sqlite3"

    def step_dir(self, run: str, epoch: int, step: int) -> Path:
        return self.runs / run / f"epoch_{epoch:02d}" / f"step_{step:02d}"

    def scripts(self, run: str, epoch: int, step: int, work: str) -> Path:
        return self.step_dir(run, epoch, step) / work / "scripts"

    def ranges(self, work: str) -> list[tuple[int, int]]:
        total = self.works[work]
        return [
            (first, min(first + self.per_report - 1, total))
            for first in range(1, total + 1, self.per_report)
        ]

    def sets_of_step(self, run: str, epoch: int, step: int) -> list[SetId]:
        return [
            SetId(run, epoch, step, work, first, last)
            for work in sorted(self.works)
            for first, last in self.ranges(work)
        ]

    def report(self, s: SetId) -> Path:
        return (
            self.runs
            / s.run
            / "loss"
            / f"epoch_{s.epoch:02d}"
            / f"step_{s.step:02d}"
            / f"{s.work}_ep{s.first:02d}-{s.last:02d}.md"
        )

    def sidecar(self, s: SetId) -> Path:
        report = self.report(s)
        return report.with_name(report.stem + ".json")

    def archive(self, s: SetId) -> Path:
        report = self.report(s)
        return report.with_name(report.stem + "_prompt.md")

    def has_report(self, s: SetId) -> bool:
        """Report and sidecar both present (the sidecar is written last)."""
        return self.report(s).is_file() and self.sidecar(s).is_file()

    def read_sidecar(self, s: SetId) -> dict[str, Any]:
        data = json.loads(self.sidecar(s).read_text(encoding="utf-8"))
        assert isinstance(data, dict)
        return data

    def all_reports(self) -> list[Path]:
        return sorted(p for p in self.runs.glob("*/loss/*/*/*.md") if "_prompt" not in p.name)

    def temp_files(self) -> list[Path]:
        return [p for p in self.runs.rglob("*") if p.name.startswith(TEMP_PREFIX)]

    # -- writing whole steps -------------------------------------------------

    def write_step(
        self,
        run: str,
        epoch: int,
        step: int,
        works: Sequence[str] | None = None,
        *,
        success: bool = False,
        version: int = 0,
    ) -> list[SetId]:
        """Write every episode of the step's works at once (plain writes)."""
        for work in works or sorted(self.works):
            scripts = self.scripts(run, epoch, step, work)
            scripts.mkdir(parents=True, exist_ok=True)
            for ep in range(1, self.works[work] + 1):
                (scripts / f"ep{ep:02d}.txt").write_text(
                    model_episode(run, epoch, step, work, ep, version), encoding="utf-8"
                )
            if success:
                mark_success(scripts)
        return [s for s in self.sets_of_step(run, epoch, step) if works is None or s.work in works]

    # -- the JSON log ----------------------------------------------------------

    def events(self, name: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """Log lines (parsed), optionally only those with this event name and fields."""
        return read_events(self.log_file, name, **match)

    def state(self) -> dict[str, Any]:
        """The state database as the old state.json had it: read-only, like status."""
        from skilltrain.daemon.core import state_db

        data = state_db.read_only(self.state_file)
        assert data is not None, f"no {self.state_file}"
        return data


def read_events(path: Path, name: str | None = None, **match: Any) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line being written right now
        if name is not None and event.get("event") != name:
            continue
        if all(event.get(k) == v for k, v in match.items()):
            out.append(event)
    return out


LOOPBACK_MODEL = "openai/loopback-model"
LOG_NAME = "skilltrain.jsonl"


def lay_out_workspace(root: Path) -> None:
    """data/, runs/ and prompts/ with the loss template under root (tests and benches)."""
    for name in ("data", "runs", "prompts"):
        (root / name).mkdir(parents=True, exist_ok=True)
    shutil.copy(TEMPLATE, root / "prompts" / TEMPLATE.name)


def write_human_episodes(root: Path, work: str, episodes: Mapping[int, str]) -> Path:
    """data/<work>/human/epNN.txt, the answer key; returns data/<work>."""
    human = root / "data" / work / "human"
    human.mkdir(parents=True, exist_ok=True)
    for ep, text in episodes.items():
        (human / f"ep{ep:02d}.txt").write_text(text, encoding="utf-8")
    return human.parent


def human_screenplays(work: str, count: int, scenes: int = 3) -> dict[int, str]:
    """Generated human episodes 1..count of a work (seeded by work and number)."""
    return {ep: screenplay(f"human/{work}/{ep}", scenes=scenes) for ep in range(1, count + 1)}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str | Path):
        return json.dumps(str(value))
    return str(value)


def config_toml(
    llm_url: str,
    *,
    llm: Mapping[str, Any] | None = None,
    loss: Mapping[str, Any] | None = None,
    watch: Mapping[str, Any] | None = None,
    log_file: str | Path = LOG_NAME,
    sections: Mapping[str, Mapping[str, Any]] | None = None,
    extra: str = "",
) -> str:
    """A config.toml against the loopback server: paths relative to the workspace,
    then each section's keys in the order given; `extra` is appended as is."""
    doc: dict[str, Mapping[str, Any]] = {
        "paths": {"data": "data", "runs": "runs", "prompts": "prompts"},
        "llm": {"model": LOOPBACK_MODEL, "api_base": llm_url, **(llm or {})},
        "loss": loss or {},
        "watch": watch or {},
        "log": {"file": log_file, "level": "info"},
        **(sections or {}),
    }
    text = "\n".join(
        f"[{name}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in keys.items())
        for name, keys in doc.items()
        if keys
    )
    return f"{text}{extra}\n"


def build_workspace(
    root: Path,
    llm_url: str,
    *,
    works: dict[str, int] | None = None,
    per_report: int = 3,
    settle_s: float = 1.0,
    concurrency: int = 4,
    resync_s: float = 600.0,
    observer: str = "auto",
    max_attempts: int = 5,
    retry_backoff_s: float = 60.0,
    shutdown_timeout_s: float = 10.0,
    llm_timeout_s: float = 5.0,
    extra: str = "",
) -> Workspace:
    """data/<work>/human/ep01..NN.txt, prompts/loss.md.j2, runs/ and config.toml under root."""
    works = works if works is not None else {"alpha": 6}
    lay_out_workspace(root)
    for work, episodes in works.items():
        write_human_episodes(root, work, human_screenplays(work, episodes))
    config_path = root / "config.toml"
    config_path.write_text(
        config_toml(
            llm_url,
            llm={
                "timeout_s": llm_timeout_s,
                "max_retries": 1,
                "backoff_initial_s": 0.05,
                "backoff_max_s": 0.2,
            },
            loss={
                "episodes_per_report": per_report,
                "settle_s": settle_s,
                "concurrency": concurrency,
                "max_attempts": max_attempts,
                "retry_backoff_s": retry_backoff_s,
            },
            watch={"resync_s": resync_s, "observer": observer},
            sections={"daemon": {"shutdown_timeout_s": shutdown_timeout_s}},
            extra=extra,
        ),
        encoding="utf-8",
    )
    return Workspace(root=root, config_path=config_path, works=dict(works), per_report=per_report)


# ----------------------------------------------------------------------- writers


def mark_success(scripts: Path) -> None:
    """The writer's "finished now" marker."""
    (scripts / "_SUCCESS").write_bytes(b"")


def write_slowly(path: Path, text: str, *, seconds: float, chunks: int) -> None:
    """A generator streaming an episode: the file grows in `chunks` pieces over `seconds`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode("utf-8")
    size = -(-len(data) // chunks)
    pause = seconds / max(1, chunks - 1)
    with open(path, "wb") as f:
        for i in range(chunks):
            f.write(data[i * size : (i + 1) * size])
            f.flush()
            if i + 1 < chunks:
                time.sleep(pause)


def write_rsync(path: Path, text: str, *, seconds: float = 0.0, chunks: int = 1) -> Path:
    """rsync: write `.ep01.txt.XXXXXX` beside the target, then rename it over the target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = "".join(random.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef0123456789") for _ in range(6))
    temp = path.with_name(f".{path.name}.{suffix}")
    write_slowly(temp, text, seconds=seconds, chunks=chunks)
    os.rename(temp, path)
    return temp


def write_cp(path: Path, text: str, *, chunks: int = 3, keep_mtime_of: float | None = None) -> None:
    """cp over an existing file: open it in place (truncate), write in pieces.

    `keep_mtime_of`: like `cp -p` / `rsync -t`, set this (old) mtime afterwards.
    """
    data = text.encode("utf-8")
    size = -(-len(data) // chunks)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(chunks):
            os.write(fd, data[i * size : (i + 1) * size])
    finally:
        os.close(fd)
    if keep_mtime_of is not None:
        os.utime(path, (keep_mtime_of, keep_mtime_of))


def remove_tree(path: Path) -> None:
    """rm -rf, retried: a daemon writing into the tree can refill a folder mid-removal."""
    for _ in range(20):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # ENOTEMPTY: something was created while we deleted
            time.sleep(0.02)
    shutil.rmtree(path)


def move_in(src: Path, dst: Path) -> None:
    """mv from outside runs/ (same filesystem): one rename, no write under runs/."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.rename(src, dst)


WRITERS = ("plain", "slow", "rsync", "cp", "mv_file", "mv_work", "mv_step", "mv_run")


def write_step_with(
    ws: Workspace,
    run: str,
    epoch: int,
    step: int,
    style: str,
    works: Sequence[str] | None = None,
    *,
    success: bool = False,
    version: int = 0,
    slow_s: float = 0.6,
) -> list[SetId]:
    """Write a step's episodes the way one kind of real writer does.

    plain: open/write/close each file. slow: each file grows in pieces over
    `slow_s`. rsync: hidden temp file, then rename. cp: open in place, truncate,
    write in pieces. mv_file: each file written outside runs/, then renamed in.
    mv_work / mv_step / mv_run: the whole work, step or run folder built
    outside runs/ and renamed in at once (no event for the files inside).
    """
    names = list(works or sorted(ws.works))
    texts = {
        (work, ep): model_episode(run, epoch, step, work, ep, version)
        for work in names
        for ep in range(1, ws.works[work] + 1)
    }
    if style in ("mv_work", "mv_step", "mv_run"):
        _move_tree_in(ws, run, epoch, step, style, names, texts, success)
    else:
        for work in names:
            scripts = ws.scripts(run, epoch, step, work)
            scripts.mkdir(parents=True, exist_ok=True)
            for ep in range(1, ws.works[work] + 1):
                _write_one(ws, scripts / f"ep{ep:02d}.txt", texts[work, ep], style, slow_s)
            if success:
                mark_success(scripts)
    return [s for s in ws.sets_of_step(run, epoch, step) if s.work in names]


def _write_one(ws: Workspace, path: Path, text: str, style: str, slow_s: float) -> None:
    if style == "plain":
        path.write_text(text, encoding="utf-8")
    elif style == "slow":
        write_slowly(path, text, seconds=slow_s, chunks=4)
    elif style == "rsync":
        write_rsync(path, text, seconds=slow_s / 2, chunks=3)
    elif style == "cp":
        write_cp(path, text)
    elif style == "mv_file":
        src = ws.outside / f"{path.parent.parent.name}-{os.getpid()}-{time.monotonic_ns()}"
        src.write_text(text, encoding="utf-8")
        move_in(src, path)
    else:
        raise ValueError(f"unknown writer {style!r}")


def _move_tree_in(
    ws: Workspace,
    run: str,
    epoch: int,
    step: int,
    style: str,
    works: list[str],
    texts: dict[tuple[str, int], str],
    success: bool,
) -> None:
    staging = ws.outside / f"staging-{time.monotonic_ns()}"
    # Built outside runs/ with the same relative layout, then one rename.
    built = staging / run / f"epoch_{epoch:02d}" / f"step_{step:02d}"
    for work in works:
        scripts = built / work / "scripts"
        scripts.mkdir(parents=True)
        for ep in range(1, ws.works[work] + 1):
            (scripts / f"ep{ep:02d}.txt").write_text(texts[work, ep], encoding="utf-8")
        if success:
            mark_success(scripts)
    if style == "mv_work":
        for work in works:
            move_in(built / work, ws.step_dir(run, epoch, step) / work)
    elif style == "mv_step":
        move_in(built, ws.step_dir(run, epoch, step))
    else:
        move_in(staging / run, ws.runs / run)


# -------------------------------------------------------------------- LLM server


def set_of_request(request: Request) -> tuple[str, int, int, str, int, int] | None:
    """(run, epoch, step, work, first, last) of a loss request, from the episode markers."""
    text = "\n".join(
        m["content"] if isinstance(m.get("content"), str) else json.dumps(m.get("content"))
        for m in request.messages
    )
    marks = MARKER.findall(text)
    if not marks:
        return None
    eps = sorted(int(m[4]) for m in marks)
    run, epoch, step, work = marks[0][:4]
    return run, int(epoch), int(step), work, eps[0], eps[-1]


def requested_sets(server: LLMServer) -> list[str]:
    """The set id of every chat request the server received, in arrival order."""
    out = []
    for request in server.requests:
        found = set_of_request(request)
        out.append("?" if found is None else SetId(*found).id)
    return out


class ConcurrencyProbe:
    """A server responder that holds each request `hold_s` and counts how many overlap."""

    def __init__(self, hold_s: float, reply: Reply | None = None) -> None:
        self.hold_s = hold_s
        self.reply = reply or Reply.ok(DEFAULT_REPORT)
        self.in_flight = 0
        self.max_in_flight = 0
        self.total = 0
        self._lock = threading.Lock()

    def __call__(self, request: Request) -> Reply:
        with self._lock:
            self.in_flight += 1
            self.total += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            time.sleep(self.hold_s)
        finally:
            with self._lock:
                self.in_flight -= 1
        return self.reply


def warm_litellm() -> None:
    """Pay litellm's import and tokenizer load once, outside any timed wait."""
    from skilltrain.daemon.infra import llm

    llm.litellm()
    llm.count_tokens("openai/loopback-model", [{"role": "user", "content": "warm up"}])


def release_llm_clients() -> None:
    """Close the HTTP clients litellm cached for this test's (now gone) server.

    litellm keeps one SDK client per api_base for an hour; each test has its
    own server port, so without this every test leaves a client with an open
    keep-alive socket behind, reported as unclosed when the interpreter exits.
    Then collect what litellm dropped on its own (see the tests' pytestmark)
    inside the test that caused it.
    """
    import gc

    import openai

    from skilltrain.daemon.infra import llm, llm_loop

    cache = getattr(llm.litellm(), "in_memory_llm_clients_cache", None)
    clients = getattr(cache, "cache_dict", None)
    if isinstance(clients, dict):
        for key, client in list(clients.items()):
            if isinstance(client, openai.OpenAI):
                with contextlib.suppress(Exception):
                    client.close()
                cache.delete_cache(key)  # type: ignore[union-attr]
            elif isinstance(client, openai.AsyncOpenAI):
                # The daemon's calls: closed on the LLM loop their connections live on.
                with contextlib.suppress(Exception):
                    llm_loop.shared().run(client.close())
                cache.delete_cache(key)  # type: ignore[union-attr]
    gc.collect()


@contextlib.contextmanager
def litellm_warm_and_frozen() -> Iterator[None]:
    """litellm imported, and its ~million objects moved out of the collector's sight.

    Tests call gc.collect() at teardown so that what litellm drops is collected
    (and reported) inside the test that caused it; with litellm's import frozen
    that collection takes milliseconds instead of ~0.4 s.
    """
    import gc

    warm_litellm()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# ------------------------------------------------------------- daemon in-process


class InProcessDaemon:
    """A real Daemon: start(), run_forever() in a thread, stop + shutdown on exit."""

    def __init__(self, ws: Workspace, *, once: bool = False, loop: bool = True) -> None:
        from skilltrain.daemon.core import config
        from skilltrain.daemon.infra import log
        from skilltrain.daemon.service.lifecycle import Daemon

        self.ws = ws
        self.cfg = config.load(ws.config_path)
        self._log = log
        # stderr to a buffer: the JSON file is what the tests read.
        log.configure(log_file=self.cfg.log.file, level="info", stderr=io.StringIO())
        self.daemon = Daemon(self.cfg, once=once)
        self.once = once
        self.loop = loop and not once
        self._thread: threading.Thread | None = None
        self.loop_error: BaseException | None = None
        self._stopped = False

    def start(self) -> InProcessDaemon:
        try:
            self.daemon.start()
        except BaseException:
            self._log.shutdown()
            raise
        if self.loop:
            self._thread = threading.Thread(target=self._run, name="daemon-main", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.daemon.run_forever()
        except BaseException as e:  # surfaced by stop(), never lost in a thread
            self.loop_error = e

    def run_once(self) -> None:
        self.daemon.run_once()

    def stop(self, reason: str = "test") -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            self.daemon.stop_event.set()
            if self._thread is not None:
                self._thread.join(timeout=10)
                assert not self._thread.is_alive(), "run_forever did not return"
            self.daemon.shutdown(reason)
        finally:
            self._log.shutdown()
        if self.loop_error is not None:
            raise self.loop_error

    def __enter__(self) -> InProcessDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# What the `start` fixture (tests/conftest.py) gives a test: start(ws, **kwargs).
Start = Callable[..., InProcessDaemon]


def run_once_in_process(ws: Workspace) -> None:
    """`skilltrain daemon --once`, in this process: process all that is ready, return."""
    d = InProcessDaemon(ws, once=True).start()
    try:
        d.run_once()
    finally:
        d.stop("once: idle")


# ------------------------------------------------------------ daemon subprocess


def subprocess_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKILLTRAIN_")}
    env.update(
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        OPENAI_API_KEY="sk-test-loopback",
        PYTHONUNBUFFERED="1",
    )
    env.pop("NOTIFY_SOCKET", None)
    env.pop("WATCHDOG_USEC", None)
    return env


class DaemonProcess:
    """`skilltrain daemon --config ...` as a real child process; killed on exit if alive."""

    def __init__(self, ws: Workspace, *args: str, name: str = "daemon",
                 prewarmed: bool = False) -> None:
        """`prewarmed`: forked from an interpreter that has imported litellm
        (tests/forkserver.py), not exec'd: ~5 s less CPU a start, for the tests
        that start a daemon again and again."""
        self.ws = ws
        self.stdout_path = ws.root / f"{name}.stdout"
        self.stderr_path = ws.root / f"{name}.stderr"
        argv = [str(SKILLTRAIN), "daemon", "--config", str(ws.config_path), *args]
        self.proc: subprocess.Popen[bytes] | Started
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            if prewarmed:
                with open(os.devnull, "rb") as devnull:
                    self.proc = ForkServer.start(subprocess_env()).spawn(
                        argv, env=subprocess_env(), cwd=ws.root, stdin=devnull.fileno(),
                        stdout=out.fileno(), stderr=err.fileno())
            else:
                self.proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    env=subprocess_env(),
                    cwd=ws.root,
                )
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr(self) -> str:
        return self.stderr_path.read_text(encoding="utf-8", errors="replace")

    def wait_event(self, name: str, timeout: float, **match: Any) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            events = self.ws.events(name, **match)
            if events:
                return events[-1]
            if not self.alive():
                raise AssertionError(
                    f"daemon exited ({self.proc.returncode}) before {name}: {self.stderr()[-2000:]}"
                )
            return None

        return wait_until(found, timeout, message=f"event {name} {match or ''}")

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def run_cli(
    *args: str, timeout: float = 30.0, python_flags: Sequence[str] = (), cwd: Path | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run `python [flags] -m skilltrain ARGS` (in `cwd`); returns the result and its wall time."""
    argv = [sys.executable, *python_flags, "-m", "skilltrain", *args]
    t0 = time.monotonic()
    result = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(),
        stdin=subprocess.DEVNULL,
        cwd=cwd,
    )
    return result, time.monotonic() - t0
