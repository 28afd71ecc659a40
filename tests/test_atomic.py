"""Atomic writes without root: a failed write leaves no temp file, and a crash
between the renames of a report's three files is always noticed.

The failed write is real: a child process with RLIMIT_FSIZE (and SIGXFSZ
ignored) gets EFBIG from the kernel on the file that would grow too large.
The crash is real too: the daemon runs as a child whose audit hook SIGKILLs
it just before the n-th rename into the reports folder.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from skilltrain.daemon.core import atomic
from skilltrain.daemon.core.errors import ExitCode
from tests.daemon_helpers import (
    SetId,
    Workspace,
    build_workspace,
    release_llm_clients,
    run_once_in_process,
    sha256_text,
    subprocess_env,
)
from tests.daemon_marks import THIRD_PARTY_WARNINGS
from tests.llm_server import DEFAULT_REPORT, LLMServer, Reply, Request

pytestmark = THIRD_PARTY_WARNINGS

LIMIT = 4096  # bytes a child may write to one file


def write_all_under_fsize_limit(
    folder: Path, sizes: dict[str, int]
) -> subprocess.CompletedProcess[str]:
    """atomic.write_all of files of these sizes in a child limited to LIMIT bytes a file."""
    code = textwrap.dedent(f"""
        import resource, signal, sys
        from pathlib import Path
        from skilltrain.daemon.core import atomic
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a core dump
        resource.setrlimit(resource.RLIMIT_FSIZE, ({LIMIT}, {LIMIT}))
        folder = Path({str(folder)!r})
        files = {{folder / name: "x" * size for name, size in {sizes!r}.items()}}
        try:
            atomic.write_all(files)
        except OSError as e:
            print(e.errno)
            sys.exit(1)
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30, env=subprocess_env())


@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param({"report.md": 10 * LIMIT}, id="one-file"),
        # The first file is whole and synced when the second one fails.
        pytest.param({"a_prompt.md": 100, "a.md": 10 * LIMIT, "a.json": 100}, id="second-of-three"),
        pytest.param({"a_prompt.md": 100, "a.md": 100, "a.json": 10 * LIMIT}, id="last-of-three"),
    ],
)
def test_a_write_the_kernel_refuses_leaves_no_file_and_no_temp_file(
    tmp_path: Path, sizes: dict[str, int]
) -> None:
    folder = tmp_path / "loss"
    folder.mkdir()
    (folder / "keep.md").write_text("the old report\n")
    result = write_all_under_fsize_limit(folder, sizes)
    assert result.returncode == 1, result.stderr
    assert result.stdout.strip() == "27"  # EFBIG: the kernel, not a test double, said no
    assert sorted(p.name for p in folder.iterdir()) == ["keep.md"]
    assert (folder / "keep.md").read_text() == "the old report\n"


def test_a_write_within_the_limit_succeeds_in_the_same_child(tmp_path: Path) -> None:
    """The control: the child itself can write; the failures above are the limit's."""
    result = write_all_under_fsize_limit(tmp_path, {"a_prompt.md": 100, "a.md": 200})
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.md", "a_prompt.md"]


# ------------------------------------------------- a crash while a report is replaced


class Versioned:
    """LLM responder: the report names the model episodes' version it was made from."""

    def __call__(self, request: Request) -> Reply:
        text = json.dumps(request.messages)
        version = "v1" if "VERSION-1" in text else "v0"
        return Reply.ok(f"{DEFAULT_REPORT} [made from {version}]")


def write_scripts(ws: Workspace, version: int) -> SetId:
    scripts = ws.scripts("r1", 1, 1, "alpha")
    scripts.mkdir(parents=True, exist_ok=True)
    for ep in (1, 2, 3):
        (scripts / f"ep{ep:02d}.txt").write_text(
            f"VERSION-{version}\n\nINT. QUAY - DAY\n\nOAR\nThe skiff rides low {ep}.\n")
    (scripts / "_SUCCESS").write_bytes(b"")
    return ws.sets_of_step("r1", 1, 1)[0]


def daemon_once_in_child(ws: Workspace, prelude: str) -> subprocess.CompletedProcess[str]:
    """`skilltrain daemon --once` in a child process that runs `prelude` first."""
    code = textwrap.dedent(prelude) + textwrap.dedent(f"""
        import runpy, sys
        sys.argv = ["skilltrain", "daemon", "--config", {str(ws.config_path)!r}, "--once"]
        runpy.run_module("skilltrain", run_name="__main__")
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=90, env=subprocess_env(), cwd=ws.root)


def crash_before_rename(ws: Workspace, n: int) -> None:
    """The daemon, SIGKILLed before its n-th rename into the reports folder
    (1: the first of the report's files)."""
    reports = ws.runs / "r1" / "loss" / "epoch_01" / "step_01"
    result = daemon_once_in_child(ws, f"""
        import os, signal, sys
        renames = 0
        def crash(event, args):
            global renames
            if event == "os.rename" and os.path.dirname(os.fsdecode(args[1])) == {str(reports)!r}:
                renames += 1
                if renames == {n}:
                    os.kill(os.getpid(), signal.SIGKILL)
        sys.addaudithook(crash)
    """)
    assert result.returncode == -9, (result.returncode, result.stderr[-2000:])


def versions(ws: Workspace, s: SetId) -> dict[str, str]:
    """Which inputs each of the set's three files was made from."""
    ep01 = (ws.scripts("r1", 1, 1, "alpha") / "ep01.txt").read_text()
    current = "v1" if ep01.startswith("VERSION-1") else "v0"
    old = "v0" if current == "v1" else "v1"
    sidecar_ep01 = ws.read_sidecar(s)["model_episodes"]["ep01.txt"]
    return {
        "archive": "v1" if "VERSION-1" in ws.archive(s).read_text() else "v0",
        "report": ws.report(s).read_text().strip()[-3:-1],
        "sidecar": current if sidecar_ep01 == sha256_text(ep01) else old,
    }


@pytest.fixture
def litellm_ready(litellm_frozen: None) -> Iterator[None]:
    yield
    release_llm_clients()


@pytest.mark.usefixtures("litellm_ready")
@pytest.mark.parametrize("n", [2, 3], ids=["after-the-archive", "after-the-report"])
def test_a_crash_while_replacing_a_report_with_changed_inputs_is_redone(
    tmp_path: Path, llm_server: LLMServer, n: int
) -> None:
    llm_server.default = Versioned()
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3})
    s = write_scripts(ws, 0)
    run_once_in_process(ws)
    assert versions(ws, s) == {"archive": "v0", "report": "v0", "sidecar": "v0"}

    write_scripts(ws, 1)  # new inputs: the report is replaced ...
    crash_before_rename(ws, n)  # ... and the daemon dies between two of its renames
    crashed, left = versions(ws, s), ws.temp_files()

    run_once_in_process(ws)

    # Noticed and redone: all three files are v1's, and no temp file is left.
    assert versions(ws, s) == {"archive": "v1", "report": "v1", "sidecar": "v1"}
    assert ws.read_sidecar(s)["report_sha256"] == sha256_text(ws.report(s).read_text())
    assert ws.temp_files() == []
    assert llm_server.request_count == 3
    # Because the crash left the new archive (and report) beside the old
    # sidecar: the commit marker is renamed last, so it named the old inputs.
    assert crashed == {"archive": "v1", "report": "v1" if n == 3 else "v0", "sidecar": "v0"}
    assert left, "the crash left its temp files"


def test_a_report_the_kernel_will_not_let_us_write_fails_and_leaves_nothing(
    tmp_path: Path, llm_server: LLMServer
) -> None:
    """The disk-full guarantee without root or tmpfs: the daemon itself under
    RLIMIT_FSIZE, where a 64 KiB report gets EFBIG and the small files do not."""
    llm_server.default = lambda request: Reply.ok(("The scene turns late. " * 3000)[:65536])
    ws = build_workspace(tmp_path, llm_server.url, works={"alpha": 3})
    s = write_scripts(ws, 0)
    result = daemon_once_in_child(ws, """
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (32768, 32768))
    """)
    # --once exits 1 when a set failed (cron and scripts must see it).
    assert result.returncode == ExitCode.FAILURE, result.stderr[-2000:]
    (failed,) = ws.events("loss.failed")
    assert "File too large" in failed["reason"] and failed["level"] == "error"
    assert failed["next_retry_s"] is not None  # retried later, like a full disk
    assert [p.name for p in (ws.report(s), ws.sidecar(s), ws.archive(s)) if p.exists()] == []
    assert ws.temp_files() == []
    assert ws.events("daemon.stopped")[-1]["failed"] == 1


# ------------------------------------------------- the mode a new file gets


def _default_acl(user: int, group: int, other: int) -> bytes:
    """A folder's default POSIX ACL as the kernel stores it (posix_acl_xattr):
    version 2, then (tag, permissions, id) for the owner, group and others."""
    undefined = 0xFFFFFFFF
    entries = [(0x01, user), (0x04, group), (0x20, other)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, undefined)
                                           for tag, perm in entries)


@pytest.mark.parametrize("acl", [None, (6, 4, 4)], ids=["umask", "default-acl"])
def test_a_written_file_gets_the_mode_open_would_give_it(tmp_path: Path,
                                                          acl: tuple[int, int, int] | None) -> None:
    """0666 less the umask, or what the folder's default ACL says (a team's
    shared runs/): the same as a file open() makes beside it."""
    folder = tmp_path / "loss"
    folder.mkdir()
    if acl is not None:
        try:
            os.setxattr(folder, "system.posix_acl_default", _default_acl(*acl))
        except OSError as e:
            pytest.skip(f"no POSIX ACLs on this file system ({e.strerror})")
    old = os.umask(0o077)
    try:
        atomic.write_all({folder / "a.md": "report\n"})
        with open(folder / "plain.md", "w") as f:
            f.write("control\n")
    finally:
        os.umask(old)
    made, control = (stat.S_IMODE((folder / name).stat().st_mode) for name in ("a.md", "plain.md"))
    assert made == control == (0o644 if acl else 0o600)
