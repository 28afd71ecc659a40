"""`skilltrain tail`: the JSON log as one readable line per event, and a tally.

  09:12:06 W loss.retry          r7/e01/s02 alice r01-03   attempt=1 wait=4.0s error="429"
  09:12:07   loss.completed      r7/e01/s02 alice r01-03   in=18211 out=1034 cached=0 $0.0123 41.2s
  09:12:09 E loss.failed         r7/e01/s02 bob r01-03     reason=timeout attempts=3 no retry
  09:12:10   step.reported       r7/e01/s02                sets=3 distance=0.3120 change=-0.0210
  == r7/e01/s02  done 1  running 0  queued 0  failed 1  | step in=18211 out=1034 cached=0 $0.0123

The level mark is blank for info, `W` for warning, `E` for error and above, `d`
for debug. `--follow` behaves like `tail -F`: it waits for the file, keeps
reading, and follows logrotate's rename to the new file. Event names and fields
are those of docs/events.md; the line format is tail_format's, the tally
tail_tally's. Imports the standard library only (no litellm).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TextIO

from .tail_format import WHERE_MIN_WIDTH, Record, format_event, where
from .tail_tally import STATE_OF, Tally, step_key

__all__ = ["View", "main"]

TALLY_EVERY = 20  # finished loss jobs between two tally lines, besides step.reported
_CHUNK = 1 << 20


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
        key = step_key(rec)
        if key is None:
            return
        if rec["event"] == "step.reported":
            self._print(self.tally.step_line(key))
        elif STATE_OF.get(rec["event"]) in ("done", "failed", "refused"):
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
