"""The daemon's threads on one CPU (`[daemon] cpu`).

They take turns on the GIL anyway: the LLM loop, the job pool, litellm's
executor, the scans. On one core, handing the GIL over is a plain context
switch; across two, every blocking call of one thread wakes the other on the
other core (a futex, an interrupt, a cold cache) and then waits for it in
turn. bench/RESULTS.md (issue 36, `llm_bench.py cpu`): 16.6 -> 11.2 ms of CPU
a loss job in steps of 2 sets, 13.2 -> 11.8 in steps of 64, and the run's
wall shorter, not longer.

Linux gives each thread its own CPU mask and a new thread the mask of the
thread that made it: pinning every thread there is when the daemon starts
pins all that come later. A child process (the optimizer, the writer) must
not inherit it: `unpinned()` lifts the mask of the spawning thread around
the spawn.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Literal

from ..core.errors import ConfigError

Choice = Literal["one", "any"] | int

_whole: set[int] | None = None  # the process's CPUs before pinning: a child's


def check(choice: Choice) -> None:
    """A CPU named by number must be one this process may run on (exit 2 if not)."""
    if isinstance(choice, int) and _can_pin() and choice not in os.sched_getaffinity(0):
        allowed = ", ".join(str(c) for c in sorted(os.sched_getaffinity(0)))
        raise ConfigError(f"[daemon] cpu = {choice}: not a CPU this process may run on "
                          f"({allowed})")


def pin(choice: Choice) -> int | None:
    """Every thread of the process on one CPU, and so every thread made after:
    `choice` a number, or "one" (the CPU the process runs on now: the kernel
    put it where there was room). None when not pinned: "any", or a single CPU
    to run on anyway."""
    global _whole
    if choice == "any" or not _can_pin():
        return None
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        return None
    check(choice)
    cpu = choice if isinstance(choice, int) else _running_on(allowed)
    _whole = set(allowed)
    for tid in _threads():
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            os.sched_setaffinity(tid, {cpu})
    return cpu


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """The calling thread on all the process's CPUs for the block: a child
    process started in it inherits them, not the daemon's one CPU. A mask the
    kernel no longer takes (a cpuset changed since) is skipped: a child on the
    daemon's CPU is slower, a child not started is a failed step."""
    if _whole is None:
        yield
        return
    mine = os.sched_getaffinity(0)  # 0: the calling thread, on Linux
    try:
        os.sched_setaffinity(0, _whole)
    except OSError:
        mine = set()
    try:
        yield
    finally:
        if mine:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, mine)


def _can_pin() -> bool:
    return hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")


def _threads() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def _running_on(allowed: set[int]) -> int:
    """The CPU this thread last ran on (/proc: field 39 of its stat), if allowed."""
    try:
        with open("/proc/thread-self/stat", encoding="ascii") as f:
            raw = f.read()
        cpu = int(raw[raw.rindex(")") + 2:].split()[36])
    except (OSError, ValueError, IndexError):
        return min(allowed)
    return cpu if cpu in allowed else min(allowed)
