"""The one owner of every set's life: who looks at it, what its state is, when it is sent.

    a look (scan, hint, a revisit due) ──> SetOwner.look(key, evaluate)
        claimed? ── yes ──> remembered (dirty): looked at once more when the claim ends
          │ no: claim it
          v
        evaluate(key) -> Decision ──> applied here: the state, the next look
          │ send a report
          v
        transport.send(ticket) -> Outcome     (jobs.py: a live call; batch.py: a batch item)
          │ its progress (started, in batch X) and, at the end, its Decision
          v
        applied here ──> the claim ends ──> a look asked for meanwhile, now
                                      └──> the step barrier (steps.check)

Anchor: controller-runtime's workqueue. A set is free or claimed, never
both; a look that finds it claimed only marks it dirty. The claim lasts from
the look that decides the set needs a report until that report's outcome is
recorded, across every wait of its transport (a gathering, an upload, a
provider batch, a restart: `adopt`), so nothing in between can send it twice.

Only this module writes a set's state (tests/test_structure.py holds it):
evaluation, a job's outcome and the transports return Decisions (decision.py).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from ..core import layout
from ..core.notify import Heartbeat
from ..infra import log
from ..infra.state import SetState, StateStore
from .decision import FORGET, NOTHING, Decision, Outcome, Ticket
from .revisit import Revisit, Revisits
from .steps import Steps

Emit = Callable[..., None]
Evaluate = Callable[[layout.SetKey], Decision]


class Transport(Protocol):
    """How a ticket reaches the provider: a live call, or an item of a batch."""

    QUEUED_REASON: str | None  # the set's reason while it waits in this transport

    def send(self, ticket: Ticket) -> Outcome: ...


class BatchTransport(Transport, Protocol):
    def wants(self, key: layout.SetKey) -> bool: ...


class SetOwner:
    """Claims sets, applies every Decision about them, hands tickets to a transport."""

    def __init__(self, state: StateStore, emit: Emit, *, revisits: Revisits, steps: Steps,
                 heartbeat: Heartbeat, live: Transport, batch: BatchTransport | None) -> None:
        self.state = state
        self.emit = emit
        self.log = log.get_logger("skilltrain.daemon")
        self.revisits = revisits
        self.steps = steps
        self.heartbeat = heartbeat
        self.live = live
        self.batch = batch
        self._lock = threading.Lock()
        self._claimed: set[str] = set()  # looked at now, or on its way to a report
        self._dirty: set[str] = set()  # claimed sets a look was asked for meanwhile

    # ------------------------------------------------------------- claims
    def held(self, set_id: str) -> bool:
        with self._lock:
            return set_id in self._claimed

    def claimed(self) -> int:
        with self._lock:
            return len(self._claimed)

    def _claim(self, set_id: str) -> bool:
        with self._lock:
            if set_id in self._claimed:
                self._dirty.add(set_id)
                return False
            self._claimed.add(set_id)
            return True

    def _release(self, set_id: str) -> bool:
        """The claim ends; True when a look was asked for meanwhile."""
        with self._lock:
            self._claimed.discard(set_id)
            dirty = set_id in self._dirty
            self._dirty.discard(set_id)
            return dirty

    # ------------------------------------------------------------- looks
    def look(self, key: layout.SetKey, evaluate: Evaluate) -> None:
        """Evaluate a set unless it is claimed, and apply what it decided."""
        if not self._claim(key.id):
            return  # remembered: looked at again when the claim ends
        try:
            decision = evaluate(key)
        except BaseException:
            self._end(key, NOTHING)
            raise
        if decision.send is None:
            self._end(key, decision)
            return
        self._write(key, decision)
        try:
            self._send(decision.send)
        except BaseException:
            self._end(key, NOTHING)  # not sent: the claim must not outlive it
            raise

    def adopt(self, found: Iterable[tuple[Ticket, Outcome, str]]) -> None:
        """A restart: sets a transport still carries (a provider batch) are claimed
        before the first look, so no look sends them again."""
        for ticket, outcome, reason in found:
            if self._claim(ticket.key.id):
                self.state.update(ticket.key.id, SetState.QUEUED, reason=reason)
                self._listen(ticket, outcome)

    # ------------------------------------------------------------- sending
    def _send(self, ticket: Ticket) -> None:
        key = ticket.key
        transport = self.batch if self.batch is not None and self.batch.wants(key) \
            else self.live
        self.state.update(key.id, SetState.QUEUED, reason=transport.QUEUED_REASON,
                          fingerprint=ticket.fp.as_json(), attempts=ticket.attempts)
        # Debug: it always comes with loss.queued, same instant, same set; one
        # line a set at info (100,000 sets at start-up: 100,000 lines, not 200,000).
        self.emit("set.ready", level="debug", **key.log_fields())
        self.emit("loss.queued", job_id=ticket.job_id, **key.log_fields())
        self._listen(ticket, transport.send(ticket))

    def _listen(self, ticket: Ticket, outcome: Outcome) -> None:
        key = ticket.key

        def progress(state: SetState, reason: str | None) -> None:
            if reason is None:
                self.state.update(key.id, state)
            else:
                self.state.update(key.id, state, reason=reason)

        outcome.listen(progress, lambda done: self._ended(key, done))

    def _ended(self, key: layout.SetKey, outcome: Outcome) -> None:
        """The transport is done with the set: its outcome applied, the claim ended."""
        if outcome.cancelled():  # shutting down: found again at the next start
            self._release(key.id)
            return
        try:
            decision = outcome.result()
        except Exception:
            self.log.exception("set.error", **key.log_fields())
            decision = NOTHING
        try:
            self._end(key, self._kept(key, decision))
            self.steps.check_unless_open(key.step_key)
        except Exception:
            self.log.exception("set.error", **key.log_fields())
        self.heartbeat.beat()

    def _kept(self, key: layout.SetKey, decision: Decision) -> Decision:
        """A set left to wait with no look to come (failed for good, refused,
        held) that its step no longer has is forgotten: the scan that would
        have forgotten it ran while it was claimed, and its record would hold
        the step's barrier until the next one. Not asked of a DONE set."""
        if decision.state in (None, SetState.DONE) or decision.revisit is not None:
            return decision
        return decision if self.steps.folders.expects(key) else FORGET

    # ------------------------------------------------------------- applying
    def _end(self, key: layout.SetKey, decision: Decision) -> None:
        self._write(key, decision)
        again = self._release(key.id)
        self.revisits.ask(decision.revisit, Revisit(key) if again else None)

    def _write(self, key: layout.SetKey, decision: Decision) -> None:
        if decision.forget:
            self.state.forget(key.id)
        elif decision.state is not None:
            self.state.update(key.id, decision.state, **decision.changes)
