"""What a part decided for a set, as a value: only the owner (owner.py) applies it.

    evaluate(key) ───────────┐
    a job's outcome ─────────┼─> Decision(state to write, its fields,
    a transport's give-back ─┘             when to look again, a report to send)

A `Ticket` is a set sent for a report: what it is made from and how many
failed attempts came before. It travels through a transport (a live call,
an item of a provider batch) and comes back as the Decision its outcome is.
"""
from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..core import dataset, layout
from ..infra.state import SetState
from .observe import Fingerprint
from .revisit import Revisit


@dataclass(frozen=True)
class Ticket:
    """A set on its way to a report."""

    key: layout.SetKey
    work: dataset.Work
    fp: Fingerprint
    attempts: int  # failed attempts before this one
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


@dataclass(frozen=True)
class Decision:
    """The state to write (None: as it is) with its fields; a look; a report to
    send; or `forget`: the set is no longer one its step has (no state kept)."""

    state: SetState | None = None
    changes: Mapping[str, Any] = field(default_factory=dict)
    revisit: Revisit | None = None
    send: Ticket | None = None
    forget: bool = False

    @classmethod
    def write(cls, state: SetState, *, revisit: Revisit | None = None,
              **changes: Any) -> Decision:
        return cls(state, changes, revisit)

    @classmethod
    def look(cls, revisit: Revisit | None) -> Decision:
        return cls(revisit=revisit)


NOTHING = Decision()
FORGET = Decision(forget=True)


class Outcome(Future[Decision]):
    """A ticket's outcome to come (a Decision), and its progress meanwhile.

    A transport makes one per ticket it is given (or finds again at a
    restart), notes what happens to the set on it (started, in batch X) and
    sets its result once the outcome is known; the owner listens to both.
    """

    def __init__(self) -> None:
        super().__init__()
        self._guard = threading.Lock()
        self._progress: Progress | None = None
        self._last: tuple[SetState, str | None] | None = None  # noted before a listener

    def listen(self, progress: Progress, done: Callable[[Outcome], None]) -> None:
        with self._guard:
            self._progress, last = progress, self._last
        if last is not None:  # the transport was quicker than the owner: said now
            progress(*last)
        self.add_done_callback(done)  # type: ignore[arg-type]

    def note(self, state: SetState, reason: str | None = None) -> None:
        with self._guard:
            progress, self._last = self._progress, (state, reason)
        if progress is not None:
            progress(state, reason)


Progress = Callable[[SetState, "str | None"], None]
