"""Reconciliation: look at a set on disk and do the one right thing for it now.

    watchdog event (hint) ─┐
    periodic resync scan ──┤
    startup scan ──────────┼─> evaluate(set) ──> its next look, if any (revisit.py)
    a look that falls due ─┘       │ complete? settled? up to date? failed/backoff? budget?
                                   v
                         a Decision, applied by the owner (owner.py) ──> steps.check

Events are hints; the filesystem is the truth. `evaluate` is level-triggered:
it looks at the set on disk and decides from what it sees, so a lost event,
a restart or a second event for the same file changes nothing. It writes
nothing: it returns a Decision (the state, when to look again, a report to
send) and the owner, which claimed the set for the look, applies it.

The ways out of an evaluation, in order (a set claimed by another look or
on its way to a report is not evaluated: the owner looks once more after):
    the loop's writer is writing the step      WAITING, looked at once it is written
    the range is incomplete or unusable        WAITING (set.unusable once, if stuck)
    the report is up to date                   DONE
    its files are still settling               SETTLING / STALE, looked at when settled
    the same input was refused                 nothing, until the input changes
    failed: gave up, or its backoff runs       nothing / looked at when the backoff ends
    over budget                                HELD / STALE
    the provider refuses the key               HELD / STALE, looked at when it works again
    otherwise                                  send: a ticket for a transport
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...handlers import loss
from ..core import config, layout
from ..core.notify import Heartbeat
from ..core.templates import PromptTemplates
from ..infra import log
from ..infra.state import SetState, StateStore
from . import retire
from .budget import Budget
from .decision import FORGET, NOTHING, Decision, Ticket
from .discovery import Discovery
from .loop import Loop
from .observe import Fingerprint, HumanDigests, Observation, observe, report_is_current
from .owner import Evaluate, SetOwner
from .revisit import Revisit, Revisits, Why
from .settle import SettleClock, iso
from .steps import Steps

HINT_DEBOUNCE_S = 0.02  # coalesce the burst of events one file write makes
PROGRESS_EVERY_S = 1.0  # a long scan says how far it is this often
CACHED_S = 1.0  # the template's hash and a human range's stats are trusted this long

Emit = Callable[..., None]
ScanProgress = Callable[[int, int], None]  # (sets looked at, sets in the scan)


class Reconciler:
    """Scans, hints and the per-set decision; the owner applies it."""

    def __init__(self, cfg: config.Config, state: StateStore, emit: Emit, *,
                 clock: Callable[[], float], stopping: threading.Event,
                 revisits: Revisits, settle: SettleClock, discovery: Discovery,
                 owner: SetOwner, budget: Budget, steps: Steps, loop: Loop,
                 templates: PromptTemplates, heartbeat: Heartbeat,
                 scanned: Callable[[set[Path]], None],
                 refused_key: Callable[[], Exception | None] = lambda: None) -> None:
        self.cfg = cfg
        # The endpoint's key refused (quota, billing, auth: llm_limit.py): why, or None.
        self.refused_key = refused_key
        self.runs = cfg.paths.runs
        self.state = state
        self.emit = emit
        self.log = log.get_logger("skilltrain.daemon")
        self.clock = clock
        self.stopping = stopping
        self.revisits = revisits
        self.discovery = discovery
        self.owner = owner
        self.budget = budget
        self.steps = steps
        self.loop = loop
        self.templates = templates
        self.heartbeat = heartbeat
        self.scanned = scanned  # after each scan: the step folders still open (to watch)
        self.settle = settle
        self.human_digests = HumanDigests(recheck_s=CACHED_S)
        self.failures = 0  # sets that will not complete by themselves (--once exit code)
        self._template_hash: tuple[float, str] | None = None
        self._scan_guard = threading.Lock()
        self._scanning = False  # one full scan at a time; under _scan_guard
        self._scan_wanted = False  # asked for while one ran: it goes round once more
        revisits.serve(self._evaluate_job, self.scan)
        # A set the step barrier found changed (it reads afresh): looked at once
        # this reconciler's caches have caught up: its look sees what the barrier saw.
        steps.serve(lambda key: revisits.look(key, delay_s=CACHED_S + 0.05))

    # ------------------------------------------------------------------- scan
    def scan(self, progress: ScanProgress | None = None) -> None:
        """Level-triggered reconciliation: look at every set under runs/.

        One full scan at a time (the periodic resync and a rescan can fall
        due together): a scan asked for while one runs makes that one go
        round once more, so what prompted it is still seen. `progress(seen,
        total)` is called about once a second (the start-up's catch-up scan
        says how far it is); a stop ends the scan where it is.
        """
        with self._scan_guard:
            if self._scanning:
                self._scan_wanted = True
                return
            self._scanning = True
        try:
            while True:
                self._scan_tree(progress)
                with self._scan_guard:
                    if not self._scan_wanted or self.stopping.is_set():
                        break
                    self._scan_wanted = False
        finally:
            with self._scan_guard:
                self._scanning = self._scan_wanted = False

    def _scan_tree(self, progress: ScanProgress | None) -> None:
        t0 = time.monotonic()
        self._template_hash = None  # a scan reads the template afresh
        self.discovery.begin_scan()
        steps = dict(self.discovery.steps())
        total = sum(len(keys) for keys in steps.values())
        looked = 0
        said_at = time.monotonic()
        for keys in steps.values():
            for key in keys:
                self.look(key)
                looked += 1
                if self.stopping.is_set():
                    # Cut short: what was not looked at is not gone, so
                    # nothing (sets, steps, notices) is forgotten.
                    return
                if progress is not None and time.monotonic() - said_at >= PROGRESS_EVERY_S:
                    progress(looked, total)
                    said_at = time.monotonic()
                    self.heartbeat.beat()
        if progress is not None:
            progress(total, total)
        seen = {key.id for keys in steps.values() for key in keys}
        with self.state.lock:
            for set_id in set(self.state.sets) - seen:
                if not self.owner.held(set_id):
                    self.state.forget(set_id)  # its folder is gone
            for step_id in set(self.state.steps) - {step.id for step in steps}:
                # Its folder is gone: a run made again under the same name is
                # reported (and looped) afresh, not taken as reported already.
                self.state.forget_step(step_id)
        for step in sorted(steps):
            self.steps.check(step, steps[step])
        self.scanned(self._open_step_dirs(steps))
        self.discovery.end_scan()
        counts = self.state.counts()
        by_state: dict[str, Any] = {s.value: counts.get(s.value, 0) for s in SetState}
        self.state.note_daemon(scanned_at=self.clock())
        self.emit("scan.completed", sets=len(seen),
                  duration_ms=int((time.monotonic() - t0) * 1000), **by_state)
        self.heartbeat.beat()

    def _open_step_dirs(self, steps: dict[layout.StepKey, list[layout.SetKey]]) -> set[Path]:
        """Step folders with a set not yet reported: where the watcher looks."""
        with self.state.lock:
            return {step.step_dir(self.runs) for step, keys in steps.items()
                    if any((r := self.state.sets.get(k.id)) is None or r.state != SetState.DONE
                           for k in keys)}

    # ------------------------------------------------------------------ hints
    def hint(self, path: Path) -> None:
        """A filesystem event: schedule a look at whatever it touches."""
        if self.stopping.is_set():
            return
        parsed = layout.parse_runs_path(self.runs, path)
        if parsed is None:
            try:
                parts = path.relative_to(self.runs).parts
            except ValueError:
                return
            if (0 < len(parts) <= 2 and not parts[0].startswith(".")
                    and parts[-1] != layout.LOSS_DIR and path.is_dir()):
                self.revisits.scan_soon()  # a run or epoch folder appeared or moved in
            return
        step = layout.StepKey(parsed.run, parsed.epoch, parsed.step)
        for key in self.discovery.sets_of_step(step):
            if parsed.work and key.work != parsed.work:
                continue
            if parsed.episode is not None and not key.first <= parsed.episode <= key.last:
                continue
            self.revisits.look(key, delay_s=HINT_DEBOUNCE_S)

    def _evaluate_job(self, key: layout.SetKey) -> None:
        """A look that fell due (a Revisit or a hint); then the set's step barrier."""
        self.look(key, self._evaluate_member)
        self.steps.check_unless_open(key.step_key)

    def _evaluate_member(self, key: layout.SetKey) -> Decision:
        """A look asked for a while ago: the set may have left its step since (its
        ranges or works changed); then it is forgotten, never sent, and a scan
        soon lists what the steps have (a human episode saved by rename leaves
        its work's ranges for a moment). A scan's looks need no such check."""
        if self.discovery.expects(key):
            return self.evaluate(key)
        self.revisits.scan_soon()  # a burst of these makes one scan
        return FORGET

    def look(self, key: layout.SetKey, evaluate: Evaluate | None = None) -> None:
        """Have the owner evaluate the set (unless it is claimed) and apply the decision."""
        try:
            self.owner.look(key, evaluate or self.evaluate)
        except Exception:
            self.log.exception("set.error", **key.log_fields())

    # --------------------------------------------------------------- evaluate
    def evaluate(self, key: layout.SetKey) -> Decision:
        """Look at one set and decide the one right thing for it now."""
        if self.loop.writing(key.step_key):
            # Scored once the loop recorded its writer's end (it asks for a
            # scan then): a writer re-run after a crash must not leave a
            # report of the first run's episodes.
            return Decision.write(SetState.WAITING, reason="the loop's writer is running")
        obs = observe(key, self.runs, self.cfg.paths.data)
        rec = self.state.get(key.id)
        if not obs.complete:
            return self._waiting(key, obs)
        work = self.discovery.works[key.work]
        human = self.human_digests.digest(work, key.first, key.last) or ""
        fp = Fingerprint.of(obs.sigs, human, self.template_hash(), self.cfg.llm.model)
        recorded = Fingerprint.from_json(rec.fingerprint) if rec and rec.fingerprint else None
        if human and report_is_current(key, self.runs, fp, recorded):
            if rec is None or rec.state != SetState.DONE or recorded != fp:
                return Decision.write(SetState.DONE, reason=None, attempts=0,
                                      fingerprint=fp.as_json(), next_retry_at=None)
            return NOTHING

        now = self.clock()
        ready_at = self.settle.ready_at(key, obs, now)
        report_exists = key.report_path(self.runs).exists()
        if ready_at > now:
            return Decision.write(SetState.STALE if report_exists else SetState.SETTLING,
                                  reason=f"settling until {iso(ready_at)}",
                                  revisit=Revisit(key, ready_at, Why.SETTLE))
        if rec and rec.state == SetState.REFUSED and rec.refused_fingerprint == fp.as_json():
            return NOTHING  # the same input was refused already; wait for it to change
        if rec and rec.state == SetState.FAILED and rec.fingerprint == fp.as_json():
            if rec.attempts >= self.cfg.loss.max_attempts:
                return NOTHING  # gave up; stays visible as failed until its input changes
            if rec.next_retry_at and rec.next_retry_at > now:
                return Decision.look(Revisit(key, rec.next_retry_at, Why.RETRY))
        if (held := self._held(key, report_exists)) is not None:
            return held
        if report_exists:
            self._report_stale(key)
        attempts = rec.attempts if rec and rec.state == SetState.FAILED \
            and rec.fingerprint == fp.as_json() else 0
        return Decision(send=Ticket(key, work, fp, attempts))

    def _held(self, key: layout.SetKey, report_exists: bool) -> Decision | None:
        """Over budget, or the provider refuses the key: not sent (it would be
        refused too; the endpoint's unblocking rescans). Unless its retired
        report may come back, unpaid: the transport tries that first, then
        holds it as here (jobs.py, batch_results.py)."""
        if retire.has_retired(self.runs, key):
            return None
        if (held := self.budget.hold(key)) is not None:
            return held
        if (refused := self.refused_key()) is not None:
            return Decision.write(SetState.STALE if report_exists else SetState.HELD,
                                  reason=str(refused))
        return None

    def _waiting(self, key: layout.SetKey, obs: Observation) -> Decision:
        """An incomplete range: one event when it will not complete by itself."""
        problem = obs.problem or "incomplete"
        stuck = obs.unusable
        revisit = None
        if obs.zero_byte and not obs.unusable:
            # A file is created empty an instant before it is written: only
            # one still empty after the settle window is worth a line.
            quiet_until = obs.newest_mtime_ns / 1e9 + self.cfg.loss.settle_s
            stuck = quiet_until <= self.clock()
            if not stuck:
                revisit = Revisit(key, quiet_until + 0.05, Why.SETTLE)
        # Not a range still being written but something that will not do by
        # itself (a symlink out of runs/, a misspelt name): say so once.
        if stuck and self.discovery.ignore(key.scripts_dir(self.runs), problem,
                                           event="set.unusable"):
            self.failures += 1
        return Decision.write(SetState.WAITING, reason=problem, revisit=revisit)

    def _report_stale(self, key: layout.SetKey) -> None:
        after_optimizer = self.steps.optimized(key.step_key)
        self.emit("set.stale", reason="inputs changed since the report was written"
                  + ("; the optimizer already ran for this step: the step is reported "
                     "again and the optimizer re-run once the new report is written"
                     if after_optimizer else ""), after_optimizer=after_optimizer,
                  **key.log_fields())

    def template_hash(self) -> str:
        """The loss template's hash, read at most once a second (and afresh by
        each scan): a burst of evaluations reads the file once, an edit is
        seen within a second."""
        cached = self._template_hash
        if cached is None or time.monotonic() - cached[0] > CACHED_S:
            cached = (time.monotonic(), self.templates.source_hash(loss.TEMPLATE))
            self._template_hash = cached
        return cached[1]
