"""The optimizer trigger: run the user's command once per fully reported step.

No shell: the command is an argv list from config.toml, and the values put
into its placeholders (run names, folders) are single arguments however
many spaces, quotes or semicolons they hold. Its output is relayed to the
log line by line, so `journalctl -f` shows what the optimizer says.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from ..daemon.core.errors import ConfigError
from ..daemon.guard import leakguard
from ..daemon.infra import cpu

PLACEHOLDERS = ("run", "epoch", "step", "reports_dir", "run_dir")
Emit = Callable[..., None]  # emit(event_name, **fields)


@dataclass(frozen=True)
class OptimizerResult:
    exit_code: int | None  # None: timed out and killed, or could not start
    duration_ms: int
    reason: str | None = None
    # handlers/detached.py: the daemon stopped while the job runs elsewhere (not a failure)
    detached: bool = False
    reattached: bool = False  # the job was submitted by an earlier daemon process


def render_argv(command: Sequence[str], values: Mapping[str, str], *,
                section: str = "optimizer") -> list[str]:
    """Fill the placeholders; an unknown one is a config error, found at start-up."""
    try:
        return [part.format_map(values) for part in command]
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"[{section}] command = {list(command)!r}: bad placeholder {e}; "
                          f"allowed: {', '.join('{' + p + '}' for p in values)}") from None


def check_command(command: Sequence[str], placeholders: Sequence[str] = PLACEHOLDERS, *,
                  section: str = "optimizer") -> None:
    """At start-up: an unknown placeholder, an argument no program can be given,
    or a program that is not there to run."""
    for part in command:
        if "\0" in part:
            # exec takes C strings: Popen would fail at every step, not at start.
            raise ConfigError(f"[{section}] command = {list(command)!r}: argument {part!r} "
                              "holds a NUL character, which no program can receive")
    render_argv(command, {name: name for name in placeholders}, section=section)
    _check_program(command, section)


def _check_program(command: Sequence[str], section: str) -> None:
    """The program, found as exec will look for it (PATH, or a path from the
    daemon's working folder) and executable: else every step fails its
    attempts and the run stalls, days into a training, for a typo. A program
    named by a placeholder ({run_dir}/train.sh) is found only when it runs."""
    if not command or "{" in command[0]:
        return
    program = command[0]
    if shutil.which(program) is not None:
        return
    where = ("no such file, or not executable" if os.sep in program
             else f"not found on PATH ({os.environ.get('PATH', os.defpath)})")
    raise ConfigError(f"[{section}] command = {list(command)!r}: program {program!r}: {where}")


def run(argv: Sequence[str], *, timeout_s: float, emit: Emit, cwd: str | None = None,
        cancel: threading.Event | None = None,
        output_event: str = "optimizer.output",
        extra_env: Mapping[str, str] | None = None) -> OptimizerResult:
    """Run the command to completion, its timeout, or `cancel` (the daemon stopping).

    It runs in a session of its own, so a timeout or a cancel kills its
    whole process group, children included.
    """
    t0 = time.monotonic()
    try:
        with cpu.unpinned():  # the daemon's threads share one CPU; its children do not
            proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                                    text=True, errors="replace", start_new_session=True,
                                    env={**child_environment(), **(extra_env or {})})
    except OSError as e:
        return OptimizerResult(None, _ms(t0), f"cannot start {argv[0]!r}: {e.strerror}")
    assert proc.stdout is not None and proc.stderr is not None
    lines = leakguard.LineStream()  # both streams: a passage may alternate between them
    relays = [threading.Thread(target=_relay, args=(stream, name, emit, output_event, lines),
                               daemon=True)
              for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for relay in relays:
        relay.start()
    cancel = cancel or threading.Event()
    deadline = time.monotonic() + timeout_s
    code: int | None = None
    reason: str | None = None
    while code is None:
        try:
            code = proc.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if cancel.is_set():
                reason = "killed: the daemon is stopping"
            elif time.monotonic() >= deadline:
                reason = f"timed out after {timeout_s:g}s and was killed"
            if reason is not None:
                _kill_group(proc)
                break
    if reason is None and code != 0:
        reason = f"exit code {code}"
    for relay in relays:
        relay.join(timeout=5)
    return OptimizerResult(code, _ms(t0), reason)


# systemd's notify socket and watchdog belong to the daemon: a child that
# inherits them could send READY=1 or WATCHDOG=1 (or STOPPING=1) in its name.
SERVICE_MANAGER_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_PID", "WATCHDOG_USEC")


def child_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in SERVICE_MANAGER_VARIABLES}


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _relay(stream: IO[str], name: str, emit: Emit, event: str,
           lines: leakguard.LineStream) -> None:
    with stream:
        for line in stream:
            emit(event, stream=name, line=lines.guard(line.rstrip("\n"), name))


def _ms(t0: float) -> int:
    return int((time.monotonic() - t0) * 1000)
