"""Watcher faults: inotify runs out of watches, and a tree grows faster than watches are added.

PITFALLS: past the inotify watch limit a recursive watch starts without an
error and silently drops events in the folders it could not watch; only a
failure on the root raises ENOSPC. In "auto" mode the daemon compares the
kernel's count of its watches (/proc/self/fdinfo) with the folders under
runs/ and falls back to polling. These tests make the limit real: the daemon
runs in its own user namespace (`unshare --user --map-root-user`) whose
`/proc/sys/user/max_inotify_watches` is set below the folder count, so only
that process is limited and nothing else on the machine notices. Without
user namespaces, as root, the global fs.inotify.max_user_watches is lowered
for the daemon's start-up and always restored; otherwise the tests skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_helpers import (
    SKILLTRAIN,
    InProcessDaemon,
    SetId,
    Workspace,
    build_workspace,
    release_llm_clients,
    requested_sets,
    subprocess_env,
    wait_until,
)
from tests.daemon_marks import THIRD_PARTY_WARNINGS
from tests.llm_server import LLMServer

pytestmark = THIRD_PARTY_WARNINGS

NO_AUDIT = "[integrity]\naudit_on_start = false\n"
GLOBAL_SYSCTL = Path("/proc/sys/fs/inotify/max_user_watches")


# ------------------------------------------------------------- limiting watches


def userns_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "sh",
            "-c",
            "echo 5 > /proc/sys/user/max_inotify_watches && cat /proc/sys/user/max_inotify_watches",
        ],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return probe.returncode == 0 and probe.stdout.strip() == "5"


def inotify_watches(pid: int | str) -> int:
    """Inotify watches held by a process (0 when it has no inotify instance)."""
    total = 0
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:inotify":
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii") as f:
                    total += sum(1 for line in f if line.startswith("inotify wd:"))
    return total


def root_watches_in_use() -> int:
    """Watches every process of this user holds now (what the global limit counts)."""
    uid, total = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    total += inotify_watches(pid)
    return total


@contextlib.contextmanager
def global_watch_limit(extra: int) -> Iterator[None]:
    """Lower fs.inotify.max_user_watches to (in use now + extra); always restored."""
    if os.geteuid() != 0 or not os.access(GLOBAL_SYSCTL, os.W_OK):
        pytest.skip("no user namespaces and fs.inotify.max_user_watches is not writable")
    original = GLOBAL_SYSCTL.read_text().strip()
    try:
        GLOBAL_SYSCTL.write_text(str(root_watches_in_use() + extra))
    except OSError as e:
        pytest.skip(f"cannot lower {GLOBAL_SYSCTL}: {e}")
    try:
        yield
    finally:
        GLOBAL_SYSCTL.write_text(original)


class LimitedDaemon:
    """`skilltrain daemon` with at most `limit` inotify watches of its own."""

    def __init__(self, ws: Workspace, limit: int) -> None:
        self.ws = ws
        self.stderr_path = ws.root / "daemon.stderr"
        argv = [str(SKILLTRAIN), "daemon", "--config", str(ws.config_path)]
        self.namespaced = userns_available()
        if self.namespaced:
            script = f'echo {limit} > /proc/sys/user/max_inotify_watches && exec "$0" "$@"'
            argv = ["unshare", "--user", "--map-root-user", "sh", "-c", script, *argv]
            self.proc = self._spawn(argv)
        else:
            with global_watch_limit(limit):
                self.proc = self._spawn(argv)
                # The limit counts when a watch is added: hold it until start-up added them.
                self.wait_event("daemon.ready", 30)

    def _spawn(self, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(self.stderr_path, "wb") as err:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=subprocess_env(),
                cwd=self.ws.root,
            )

    @property
    def pid(self) -> int:
        """The daemon's own pid (unshare and sh exec into it: the same process)."""
        return self.proc.pid

    def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            events = self.ws.events(name)
            if events:
                return events[0]
            if self.proc.poll() is not None:
                stderr = self.stderr_path.read_text(errors="replace")[-1500:]
                raise AssertionError(f"daemon exited {self.proc.returncode}: {stderr}")
            return None

        return wait_until(found, timeout, message=f"event {name}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=5)


# ------------------------------------------------------------- watch limit


@dataclass
class FallbackRun:
    limit: int
    folders_at_start: int
    sets: list[SetId]
    requests: list[str]
    fallback: dict[str, Any]
    ready: dict[str, Any]
    watches_after_fallback: int
    exit_code: int
    events: list[dict[str, Any]]
    seconds_to_fallback: float


def write_sets(ws: Workspace, runs: range, epoch: int, steps: range) -> list[SetId]:
    sets: list[SetId] = []
    for r in runs:
        for step in steps:
            sets += ws.write_step(f"r{r}", epoch, step, success=True)
    return sets


@pytest.fixture(scope="module", params=[0, 12], ids=["no-watch-at-all", "12-watches"])
def fallback_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FallbackRun]:
    """A daemon whose inotify watch limit is below the folder count of runs/."""
    from skilltrain.daemon.service.watcher import count_folders

    limit = int(request.param)
    server = LLMServer().start()
    try:
        ws = build_workspace(
            tmp_path_factory.mktemp(f"limit{limit}"),
            server.url,
            works={"a": 3, "b": 3},
            settle_s=0.3,
            resync_s=1.0,  # the coverage check runs after each scan
            observer="auto",
            extra=NO_AUDIT,
        )
        before = write_sets(ws, range(3), 1, range(1, 4))
        folders = count_folders(ws.runs)
        assert folders > limit + 20
        t0 = time.monotonic()
        daemon = LimitedDaemon(ws, limit)
        try:
            ready = daemon.wait_event("daemon.ready", 30)
            fallback = daemon.wait_event("watch.fallback", 30)
            took = time.monotonic() - t0
            # New folders after the swap, in a new run and deep in old ones:
            # only the poller (or a scan) can see them now.
            after = write_sets(ws, range(3, 5), 2, range(1, 3))
            after += write_sets(ws, range(0, 1), 1, range(7, 9))
            sets = before + after
            wait_until(
                lambda: all(ws.has_report(s) for s in sets),
                40,
                message=lambda: f"{sum(ws.has_report(s) for s in sets)}/{len(sets)} reports",
            )
            watches = inotify_watches(daemon.pid)
        finally:
            code = daemon.stop()
        yield FallbackRun(
            limit=limit,
            folders_at_start=folders,
            sets=sets,
            requests=requested_sets(server),
            fallback=fallback,
            ready=ready,
            watches_after_fallback=watches,
            exit_code=code,
            events=ws.events(),
            seconds_to_fallback=took,
        )
    finally:
        server.stop()


@pytest.mark.slow  # a daemon subprocess per limit, each paying litellm's import
def test_watch_limit_falls_back_to_polling_and_every_set_is_processed(
    fallback_run: FallbackRun,
) -> None:
    run = fallback_run
    print(
        f"limit {run.limit}: {run.folders_at_start} folders, fallback after "
        f"{run.seconds_to_fallback:.1f}s ({run.fallback['reason']}), "
        f"{len(run.sets)} sets, {len(run.requests)} requests"
    )
    assert run.fallback["observer"] == "polling"
    assert run.fallback["sysctl"] == "fs.inotify.max_user_watches"
    if run.limit == 0:
        # Not even runs/ itself could be watched: the native observer never started.
        assert "inotify watch limit reached" in run.fallback["reason"]
        assert run.ready["observer"] == "polling"
    else:
        # runs/ was watched, then a folder the watcher asked for was refused, or
        # (below an open step, where watchdog adds them) silently not watched:
        # the coverage check saw it.
        reason = run.fallback["reason"]
        assert "inotify watch limit reached" in reason or f"{run.limit} watches for " in reason
    assert len([e for e in run.events if e["event"] == "watch.fallback"]) == 1
    assert Counter(run.requests) == {s.id: 1 for s in run.sets}
    assert run.watches_after_fallback == 0, "the native observer's watches were not released"
    assert run.exit_code == 0
    assert not [e for e in run.events if e["event"] in ("set.error", "watch.died")]


@pytest.mark.slow
def test_watch_fallback_is_logged_as_a_warning(fallback_run: FallbackRun) -> None:
    assert fallback_run.fallback["level"] == "warning"


# ------------------------------------------------------------- a tree growing fast

WRITER = r"""
import os, sys
root, runs, epochs, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
body = sys.argv[5]
for step in range(1, steps + 1):
    for r in range(runs):
        for e in range(1, epochs + 1):
            for work in ("a", "b"):
                run = f"r{r}"
                scripts = f"{root}/{run}/epoch_{e:02d}/step_{step:02d}/{work}/scripts"
                os.makedirs(scripts)
                for ep in (1, 2):
                    head = f"SETMARK {run} epoch={e} step={step} work={work} ep={ep}"
                    with open(f"{scripts}/ep{ep:02d}.txt", "w") as f:
                        f.write(head + "\n\n" + body)
                open(f"{scripts}/_SUCCESS", "w").close()
"""


def settled_scan_count(ws: Workspace, quiet_s: float = 0.8, timeout: float = 5.0) -> int:
    """The number of scans once none has completed for `quiet_s`."""
    deadline = time.monotonic() + timeout
    count, since = len(ws.events("scan.completed")), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.05)
        now = len(ws.events("scan.completed"))
        if now != count:
            count, since = now, time.monotonic()
    return count


@pytest.mark.slow
def test_tree_created_faster_than_watches_are_added_is_fully_processed(
    tmp_path: Path, llm_server: LLMServer, litellm_frozen: None
) -> None:
    """A writer process builds step/work/scripts/ folders and their files in a tight loop.

    runs/<run>/epoch_EE/ and runs/<run>/loss/ exist before the daemon starts, so
    every new folder is three or more levels down: none triggers a rescan, and
    the periodic resync is 10 minutes away (scans besides the start-up ones are
    counted and printed: 0 when this was written, so events alone did it). Each
    file lands in a folder the watcher may not watch yet; every set must still
    be found, exactly once.
    """
    runs, epochs, steps = 4, 2, 12
    ws = build_workspace(
        tmp_path,
        llm_server.url,
        works={"a": 2, "b": 2},
        per_report=2,
        settle_s=0.2,
        resync_s=600,
        concurrency=8,
        observer="native",
        extra=NO_AUDIT,
    )
    for r in range(runs):
        for e in range(1, epochs + 1):
            (ws.runs / f"r{r}" / f"epoch_{e:02d}").mkdir(parents=True)
        # The daemon's own reports folder too: its creation would trigger a rescan.
        (ws.runs / f"r{r}" / "loss").mkdir()
    sets = [
        SetId(f"r{r}", e, step, work, 1, 2)
        for step in range(1, steps + 1)
        for r in range(runs)
        for e in range(1, epochs + 1)
        for work in ("a", "b")
    ]
    body = "INT. QUAY - NIGHT\n\nMARA\nThe skiff slips its rigging at the wicker quay.\n"
    d = InProcessDaemon(ws).start()
    try:
        # Start-up may add a catch-up scan; the tree must grow after it.
        scans_at_start = settled_scan_count(ws)
        t0 = time.monotonic()
        subprocess.run(
            [sys.executable, "-c", WRITER, str(ws.runs), str(runs), str(epochs), str(steps), body],
            check=True,
            timeout=60,
        )
        wrote = time.monotonic() - t0
        wait_until(
            lambda: all(ws.has_report(s) for s in sets),
            60,
            message=lambda: f"{sum(ws.has_report(s) for s in sets)}/{len(sets)} reports",
        )
        took = time.monotonic() - t0
        assert d.daemon.watcher.alive() and d.daemon.watcher.kind == "native"
        scans = len(ws.events("scan.completed")) - scans_at_start
    finally:
        d.stop()
        release_llm_clients()
    folders = len(sets) * 2 + runs * steps * epochs  # work + scripts per set, step folders
    print(
        f"fast tree: {folders} folders and {len(sets) * 3} files written in {wrote:.2f}s; "
        f"all {len(sets)} sets reported after {took:.2f}s; {scans} scans besides the first"
    )
    assert Counter(requested_sets(llm_server)) == {s.id: 1 for s in sets}
    problems = [
        e
        for e in ws.events()
        if e.get("event") in ("set.error", "watch.handler_error", "watch.died") or "exception" in e
    ]
    assert not problems, problems


@pytest.mark.parametrize("mode", ["native", "polling"])
def test_a_hint_that_raises_is_a_warning_and_a_rescan_not_a_dead_watcher(
    tmp_path: Path, mode: str
) -> None:
    """A handler exception would kill watchdog's dispatch thread, and its event
    is lost: the watcher says so at warning and asks for a full scan."""
    from skilltrain.daemon.service.watcher import Watcher

    reports: list[tuple[str, dict[str, Any]]] = []
    rescans: list[float] = []
    hints: list[Path] = []

    def hint(path: Path) -> None:
        hints.append(path)
        if len(hints) == 1:
            raise RuntimeError("a bug in the daemon's hint")

    watcher = Watcher(tmp_path, mode, hint, lambda event, **kw: reports.append((event, kw)),
                      polling_interval_s=0.1, rescan=lambda: rescans.append(time.monotonic()))
    watcher.start()
    try:
        (tmp_path / "ep01.txt").write_text("first\n")
        wait_until(lambda: rescans, 5, message="a rescan")
        (tmp_path / "ep02.txt").write_text("second\n")
        wait_until(lambda: any(p.name == "ep02.txt" for p in hints), 5, message="the next hint")
        assert watcher.alive()
    finally:
        watcher.stop()
    errors = [kw for event, kw in reports if event == "watch.handler_error"]
    assert errors[0] == {"level": "warning", "error": "RuntimeError",
                         "path": str(tmp_path / "ep01.txt")}
    assert len(errors) == 1 and len(rescans) == 1


def test_watchdogs_double_watch_warning_never_kills_a_later_watcher(tmp_path: Path) -> None:
    """watchdog warns when it adds a new folder's watch twice (a RuntimeWarning,
    raised in its emitter thread). The daemon ignores it, but a filter set once
    at import is gone after any warnings.catch_warnings() (pytest's, around
    each test): under -W error the warning then killed a later daemon's emitter
    thread, and its events with it (a flake of test_retire). Each start says it
    again."""
    import warnings

    from skilltrain.daemon.service.watcher import Watcher

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as pytest's -W error, set after the import
        watcher = Watcher(tmp_path, "native", lambda path: None, lambda event, **kw: None,
                          rescan=lambda: None)
        watcher.start()
        try:
            warnings.warn("Callback with id '1' already exists for watch <w>. "
                          "It will be Overwritten.", RuntimeWarning, stacklevel=1)
        finally:
            watcher.stop()
