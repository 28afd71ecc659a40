"""The CPU probe: loaded by `skilltrain daemon` when bench/cpu_breakdown.py puts
this folder on PYTHONPATH (Python imports `sitecustomize` at start-up); nothing
else loads it.

It wraps the functions CPU_PROBE_FUNCS names ("module:Class.method,...") so
each call adds its thread's CPU (time.thread_time: on-CPU time of the calling
thread, its syscalls included, waits for a lock or the GIL not) to a total,
inclusive of what it calls; counts the collector's CPU (gc.callbacks); and
appends, every 0.25 s, one JSON line to CPU_PROBE_OUT: the totals and every
live thread's CPU by name (/proc/self/task/<id>/stat). Why not a sampling
profiler: py-spy's --gil mode on Python 3.11 counted threads waiting in
Condition.wait as holding the GIL, and its default mode counts a thread in an
fsync as busy (bench/RESULTS.md, issue 36, eleventh pass).
"""
from __future__ import annotations

import functools
import gc
import importlib
import json
import os
import threading
import time
from typing import Any

_OUT = os.environ.get("CPU_PROBE_OUT")
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_totals: dict[str, list[float]] = {}  # label -> [calls, CPU seconds]
# Reentrant: a collection may start while this thread holds it (an allocation
# inside `with _lock`), and its callback adds to the totals on the same thread.
_lock = threading.RLock()


def _add(label: str, seconds: float) -> None:
    with _lock:
        entry = _totals.setdefault(label, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds


def _wrap(spec: str) -> None:
    module_name, _, attr = spec.partition(":")
    owner: Any = importlib.import_module(module_name)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            _add(spec, time.thread_time() - start)

    setattr(owner, name, timed)


_collection_started = threading.local()  # a collection runs in the thread that triggered it


def _on_collection(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _collection_started.cpu = time.thread_time()
    elif hasattr(_collection_started, "cpu"):
        _add(f"gc:generation {info['generation']}",
             time.thread_time() - _collection_started.cpu)


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread, by name (threads of one pool: one entry each)."""
    out: dict[str, float] = {}
    for thread in threading.enumerate():
        try:
            with open(f"/proc/self/task/{thread.native_id}/stat") as stat:
                raw = stat.read()
        except (OSError, TypeError):
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        out[thread.name] = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return out


def _write_forever() -> None:
    assert _OUT is not None
    while True:
        time.sleep(0.25)
        with _lock:
            totals = {label: list(entry) for label, entry in _totals.items()}
        line = {"wall": time.time(), "process": sum(os.times()[:2]), "threads": _thread_cpu(),
                "totals": totals}
        with open(_OUT, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


if _OUT:
    for _spec in filter(None, os.environ.get("CPU_PROBE_FUNCS", "").split(",")):
        _wrap(_spec)
    gc.callbacks.append(_on_collection)
    threading.Thread(target=_write_forever, name="cpu-probe", daemon=True).start()
