"""`skilltrain tail`: the JSON log as one readable line per event, and a tally.

  09:12:06 W loss.retry          r7/e01/s02 alice r01-03   attempt=1 wait=4.0s error="429"
  09:12:07   loss.completed      r7/e01/s02 alice r01-03   in=18211 out=1034 cached=0 $0.0123 41.2s
  09:12:09 E loss.failed         r7/e01/s02 bob r01-03     reason=timeout attempts=3 no retry
  09:12:10   step.reported       r7/e01/s02                sets=3 distance=0.3120 change=-0.0210
  == r7/e01/s02  done 1  running 0  queued 0  failed 1  | r7  in=18211 out=1034 cached=0 $0.0123

The level mark is blank for info, `W` for warning, `E` for error and above, `d`
for debug. `--follow` behaves like `tail -F`: it waits for the file, keeps
reading, and follows logrotate's rename to the new file. Event names and fields
are those of docs/events.md. Imports the standard library only (no litellm).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any, TextIO

__all__ = ["Tally", "View", "format_event", "main"]

EVENT_WIDTH = 18  # len("optimizer.finished")
WHERE_MIN_WIDTH = 24
TALLY_EVERY = 20  # finished loss jobs between two tally lines, besides step.reported
_CHUNK = 1 << 20
_MAX_TEXT = 200  # free text (messages, reasons, exceptions) per line

# Fields shown in the location column or not at all.
_PLACED = frozenset(
    {
        "timestamp",
        "level",
        "event",
        "logger",
        "run",
        "epoch",
        "step",
        "work",
        "range",
        "job_id",
        "exception",
    }
)
_LEVEL_MARK = {"debug": "d", "info": " ", "warning": "W", "error": "E", "critical": "E"}

Record = dict[str, Any]


# ----------------------------------------------------------------------------- format


def _text(value: Any, limit: int = _MAX_TEXT) -> str:
    text = str(value)
    if not text.isprintable():
        # Escape control characters: an optimizer's output must not drive the terminal.
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kv(key: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{key}={value:g}"
    if isinstance(value, str) and value and not any(c.isspace() or c == '"' for c in value):
        return f"{key}={_text(value)}"
    if isinstance(value, str):
        return f"{key}={json.dumps(_text(value), ensure_ascii=False)}"
    if isinstance(value, list | dict):
        return f"{key}={_text(json.dumps(value, ensure_ascii=False))}"
    return f"{key}={value}"


def _secs(ms: Any) -> str:
    if not isinstance(ms, int | float):
        return "?s"
    if ms < 1000:
        return f"{int(ms)}ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def _usd(value: Any) -> str:
    return f"${value:.4f}" if isinstance(value, int | float) else "$?"


def _clock(timestamp: Any) -> str:
    # The log is UTC; the operator's terminal (like journalctl) shows local time.
    try:
        return datetime.fromisoformat(str(timestamp)).astimezone().strftime("%H:%M:%S")
    except ValueError:
        return "??:??:??"


def _two(value: Any) -> str:
    return f"{value:02d}" if isinstance(value, int) else str(value)


def where(rec: Record) -> str:
    """`run/eEE/sSS work rFF-LL`, whichever parts the record has."""
    parts = []
    if rec.get("run") is not None:
        path = str(rec["run"])
        if rec.get("epoch") is not None:
            path += f"/e{_two(rec['epoch'])}"
            if rec.get("step") is not None:
                path += f"/s{_two(rec['step'])}"
        parts.append(path)
    if rec.get("work") is not None:
        parts.append(str(rec["work"]))
    if rec.get("range") is not None:
        parts.append(f"r{rec['range']}")
    return " ".join(parts)


def _rest(rec: Record, *skip: str) -> list[str]:
    return [_kv(k, v) for k, v in rec.items() if k not in _PLACED and k not in skip]


def _tokens(rec: Record) -> str:
    return " ".join(
        f"{k}={rec[f'tokens_{k}']}"
        for k in ("in", "out", "cached", "cache_write")
        # Cache writes happen on Anthropic-style caching only: shown when there are some.
        if rec.get(f"tokens_{k}") is not None and (k != "cache_write" or rec[f"tokens_{k}"])
    )


def _f_loss_completed(rec: Record) -> list[str]:
    parts = [_tokens(rec), _usd(rec.get("cost_usd")), _secs(rec.get("duration_ms"))]
    if rec.get("leaks_redacted"):
        parts.append(f"leaks_redacted={rec['leaks_redacted']}")
    if isinstance(rec.get("attempts"), int) and rec["attempts"] > 1:
        parts.append(f"attempts={rec['attempts']}")
    return parts


def _f_loss_failed(rec: Record) -> list[str]:
    retry = rec.get("next_retry_s")
    then = "no retry" if retry is None else f"retry in {_secs(float(retry) * 1000)}"
    return [_kv("reason", rec.get("reason")), f"attempts={rec.get('attempts', '?')}", then]


def _f_loss_started(rec: Record) -> list[str]:
    return [f"prompt={rec.get('prompt_chars', '?')}ch/{rec.get('prompt_tokens', '?')}tok"]


def _f_loss_retry(rec: Record) -> list[str]:
    wait = rec.get("wait_s")
    return [
        f"attempt={rec.get('attempt', '?')}",
        f"wait={_secs(float(wait) * 1000) if isinstance(wait, int | float) else '?'}",
        _kv("error", rec.get("error", "")),
    ]


def _f_step_reported(rec: Record) -> list[str]:
    distance, change = rec.get("craft_distance"), rec.get("craft_distance_change")
    parts = [f"sets={rec.get('sets', '?')}"]
    if isinstance(distance, int | float):
        parts.append(f"distance={distance:.4f}")
        parts.append(f"change={change:+.4f}" if isinstance(change, int | float) else "change=-")
    return [*parts, _kv("reports", rec.get("reports_dir", "?"))]


def _f_optimizer_started(rec: Record) -> list[str]:
    argv = rec.get("argv")
    return ["$ " + (shlex.join(map(str, argv)) if isinstance(argv, list) else str(argv))]


def _f_optimizer_output(rec: Record) -> list[str]:
    return [f"{rec.get('stream', '?')}| {_text(rec.get('line', ''))}"]


def _f_optimizer_finished(rec: Record) -> list[str]:
    return [f"exit={rec.get('exit_code', '?')}", _secs(rec.get("duration_ms"))]


def _f_scan_completed(rec: Record) -> list[str]:
    return [*_rest(rec, "duration_ms"), _secs(rec.get("duration_ms"))]


def _f_budget_reached(rec: Record) -> list[str]:
    return [f"spent {_usd(rec.get('spent_usd'))} of {_usd(rec.get('budget_usd'))}"]


def _f_cost_total(rec: Record) -> list[str]:
    return [_tokens(rec), _usd(rec.get("cost_usd"))]


def _f_audit_leak(rec: Record) -> list[str]:
    episode = rec.get("episode")
    return [
        f"{rec.get('file', '?')}:{rec.get('line', '?')}",
        f"ep{_two(episode)}",
        f"n_words={rec.get('n_words', '?')}",
    ]


_FIELDS: dict[str, Callable[[Record], list[str]]] = {
    "loss.completed": _f_loss_completed,
    "loss.failed": _f_loss_failed,
    "loss.started": _f_loss_started,
    "loss.retry": _f_loss_retry,
    "step.reported": _f_step_reported,
    "optimizer.started": _f_optimizer_started,
    "optimizer.output": _f_optimizer_output,
    "optimizer.finished": _f_optimizer_finished,
    "scan.completed": _f_scan_completed,
    "budget.reached": _f_budget_reached,
    "cost.total": _f_cost_total,
    "audit.leak": _f_audit_leak,
}


def _exception(rec: Record) -> str:
    stacks = rec.get("exception")
    if isinstance(stacks, list) and stacks and isinstance(stacks[0], dict):
        top = stacks[0]
        return f"[{top.get('exc_type', '?')}: {_text(top.get('exc_value', ''))}]"
    if isinstance(stacks, str):  # a text traceback: its last line names the error
        return f"[{_text(stacks.strip().splitlines()[-1])}]" if stacks.strip() else ""
    return ""


def format_event(rec: Record, where_width: int = WHERE_MIN_WIDTH) -> str:
    """One readable line: `HH:MM:SS L event  run/eEE/sSS work rFF-LL  fields`."""
    name = str(rec.get("event", ""))
    fields = _FIELDS.get(name, _rest)(rec)
    loc = where(rec)
    fields = [f for f in (*fields, _exception(rec)) if f]
    mark = _LEVEL_MARK.get(str(rec.get("level", "")).lower(), "?")
    line = f"{_clock(rec.get('timestamp'))} {mark} {_text(name):<{EVENT_WIDTH}}  "
    line += f"{loc:<{where_width}}  {' '.join(fields)}"
    return line.rstrip()


# ------------------------------------------------------------------------------ tally

StepKey = tuple[str, int, int]

_STATE_OF = {
    "loss.queued": "queued",
    "loss.started": "running",
    "loss.retry": "running",
    "loss.completed": "done",
    "loss.failed": "failed",
    "loss.refused": "refused",
}
_STATES = ("done", "running", "queued", "failed", "refused")


@dataclass
class RunCost:
    tokens_in: int = 0
    tokens_out: int = 0
    tokens_cached: int = 0
    cost_usd: float = 0.0


@dataclass
class Tally:
    """Per (run, epoch, step): each set's last loss state; per run: tokens and cost."""

    sets: dict[StepKey, dict[tuple[str, str], str]] = field(default_factory=dict)
    costs: dict[str, RunCost] = field(default_factory=dict)

    def update(self, rec: Record) -> None:
        name, run = rec.get("event"), rec.get("run")
        if not isinstance(run, str):
            return
        if name == "cost.total":
            self.costs[run] = RunCost(
                _int(rec.get("tokens_in")),
                _int(rec.get("tokens_out")),
                _int(rec.get("tokens_cached")),
                _float(rec.get("cost_usd")),
            )
            return
        state = _STATE_OF.get(str(name))
        key = _step_key(rec)
        if state is None or key is None:
            return
        self.sets.setdefault(key, {})[(str(rec.get("work")), str(rec.get("range")))] = state
        if name == "loss.completed":
            cost = self.costs.setdefault(run, RunCost())
            cost.tokens_in += _int(rec.get("tokens_in"))
            cost.tokens_out += _int(rec.get("tokens_out"))
            cost.tokens_cached += _int(rec.get("tokens_cached"))
            cost.cost_usd += _float(rec.get("cost_usd"))

    def counts(self, key: StepKey) -> dict[str, int]:
        counts = dict.fromkeys(_STATES, 0)
        for state in self.sets.get(key, {}).values():
            counts[state] += 1
        return counts

    def step_line(self, key: StepKey) -> str:
        run, epoch, step = key
        counts = self.counts(key)
        shown = [f"{s} {counts[s]}" for s in _STATES if s != "refused" or counts[s]]
        line = f"== {run}/e{epoch:02d}/s{step:02d}  {'  '.join(shown)}"
        return f"{line}  | {self.run_line(run)}" if run in self.costs else line

    def run_line(self, run: str) -> str:
        cost = self.costs.get(run, RunCost())
        return (
            f"{run}  in={cost.tokens_in} out={cost.tokens_out} "
            f"cached={cost.tokens_cached} {_usd(cost.cost_usd)}"
        )

    def summary(self, run: str | None = None) -> list[str]:
        lines = [self.step_line(k) for k in sorted(self.sets) if run is None or k[0] == run]
        lines += [f"== {self.run_line(r)}" for r in sorted(self.costs) if run is None or r == run]
        return lines


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _float(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _step_key(rec: Record) -> StepKey | None:
    run, epoch, step = rec.get("run"), rec.get("epoch"), rec.get("step")
    if isinstance(run, str) and isinstance(epoch, int) and isinstance(step, int):
        return (run, epoch, step)
    return None


# ------------------------------------------------------------------------------- view


def _event_matcher(spec: str | None) -> Callable[[str], bool]:
    """`loss` or `loss.` matches every loss.* event; commas give alternatives."""
    if not spec:
        return lambda _name: True
    wanted = [s.strip() for s in spec.split(",") if s.strip()]

    def matches(name: str) -> bool:
        for w in wanted:
            prefix = w if w.endswith(".") else w + "."
            if name == w.rstrip(".") or name.startswith(prefix):
                return True
        return False

    return matches


class View:
    """Parses lines, filters, prints events and tally lines to `out`."""

    def __init__(self, out: TextIO, *, run: str | None, event: str | None) -> None:
        self.out = out
        self.run = run
        self.event_filtered = bool(event)
        self.matches = _event_matcher(event)
        self.tally = Tally()
        self.skipped = 0  # lines that are not a JSON event
        self.partial = 0  # incomplete last lines left unprinted
        self.where_width = WHERE_MIN_WIDTH
        self._finished_jobs = 0

    def feed(self, raw: bytes) -> None:
        text = raw.decode("utf-8", errors="replace").strip()
        if not text:
            return
        try:
            rec = json.loads(text)
        except ValueError:
            rec = None
        if not isinstance(rec, dict) or not isinstance(rec.get("event"), str):
            self.skipped += 1
            return
        self.handle(rec)

    def handle(self, rec: Record) -> None:
        if self.run is not None and rec.get("run") != self.run:
            return
        self.tally.update(rec)
        name = rec["event"]
        if self.matches(name):
            loc = where(rec)
            self.where_width = max(self.where_width, min(len(loc), 48))
            self._print(format_event(rec, self.where_width))
        self._maybe_tally(rec)

    def _maybe_tally(self, rec: Record) -> None:
        # With --event the operator asked for a subset: only the final summary.
        if self.event_filtered:
            return
        key = _step_key(rec)
        if key is None:
            return
        if rec["event"] == "step.reported":
            self._print(self.tally.step_line(key))
        elif _STATE_OF.get(rec["event"]) in ("done", "failed", "refused"):
            self._finished_jobs += 1
            if self._finished_jobs % TALLY_EVERY == 0:
                self._print(self.tally.step_line(key))

    def summary(self) -> None:
        lines = self.tally.summary(self.run)
        if lines:
            self._print("== summary")
            for line in lines:
                self._print(line)
        if self.skipped:
            self._print(f"== skipped {self.skipped} line(s) that are not JSON events")
        if self.partial:
            self._print(f"== {self.partial} incomplete line(s) at the end not shown")
        self.out.flush()

    def _print(self, line: str) -> None:
        self.out.write(line + "\n")


# ----------------------------------------------------------------------------- follow


class _Source:
    """Complete lines of a file that logrotate may rename or truncate (`tail -F`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: IO[bytes] | None = None
        self.inode = -1
        self.buf = b""

    def open(self) -> bool:
        try:
            self.file = open(self.path, "rb")  # kept open across calls: no `with`
        except FileNotFoundError:
            return False
        self.inode = os.fstat(self.file.fileno()).st_ino
        self.buf = b""
        return True

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def lines(self) -> Iterator[bytes]:
        """Every complete line available now; a partial last line waits in `buf`."""
        assert self.file is not None
        while chunk := self.file.read(_CHUNK):
            self.buf += chunk
            *complete, self.buf = self.buf.split(b"\n")
            yield from complete

    def replaced(self) -> bool:
        """True when the path now names another file (renamed and recreated)."""
        assert self.file is not None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False  # renamed, new one not created yet: keep the old one
        if st.st_ino != self.inode:
            return True
        if st.st_size < self.file.tell():  # copytruncate: start over
            self.file.seek(0)
            self.buf = b""
        return False


def _follow(src: _Source, view: View, stop: threading.Event, poll_s: float) -> None:
    while not stop.is_set():
        if src.file is None and not src.open():
            stop.wait(poll_s)
            continue
        got = False
        for line in src.lines():
            view.feed(line)
            got = True
        if got:
            view.out.flush()
            continue
        if src.replaced():
            # The writer moved on: finish the old file, then read the new one.
            for line in src.lines():
                view.feed(line)
            view.partial += bool(src.buf)
            src.close()
            continue
        stop.wait(poll_s)


def _read_once(src: _Source, view: View) -> None:
    for line in src.lines():
        view.feed(line)
    view.partial += bool(src.buf)  # a writer mid-line: not an event yet
    src.close()


def main(
    log_file: Path,
    *,
    follow: bool,
    run: str | None,
    event: str | None,
    out: TextIO = sys.stdout,
    stop: threading.Event | None = None,
    poll_s: float = 0.2,
    err: TextIO = sys.stderr,
) -> int:
    """Print the log readably; with `follow`, keep going until `stop` or Ctrl-C."""
    view = View(out, run=run, event=event)
    src = _Source(log_file)
    try:
        if not follow:
            if not src.open():
                err.write(f"skilltrain tail: no log file at {log_file}\n")
                return 1
            _read_once(src, view)
        else:
            if not log_file.exists():
                err.write(f"skilltrain tail: waiting for {log_file}\n")
            _follow(src, view, stop or threading.Event(), poll_s)
        view.summary()
    except KeyboardInterrupt:
        view.summary()
    except BrokenPipeError:
        # `skilltrain tail | head`: the reader left; that is not an error. Point
        # stdout at /dev/null so the interpreter's final flush does not complain.
        if out is sys.stdout:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    finally:
        src.close()
    return 0
