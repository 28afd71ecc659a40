"""What needs someone, for `skilltrain status`: blocked, failed, refused, unusable,
stalled, held.

    blocked   an LLM endpoint whose API key the provider refuses (quota,
              billing, auth): no call goes out until a probe finds it
              working (or a restart with a new key); its sets wait, held

    failed    a set whose loss job failed (retried with backoff until [loss]
              max_attempts, then left), a step whose optimizer failed and will
              be retried
    refused   a set whose input was refused (redone when the input changes)
    unusable  a set that will not complete by itself (set.unusable: a link out
              of runs/, a misspelt episode, ...), a folder the daemon cannot
              use (epoch_1, a linked run folder, a bad run.toml)
    stalled   a looped run waiting for runs/RUN/RETRY, a step whose optimizer
              used up its attempts, a set `running` longer than a job can last
    held      a set held back by [llm] budget_usd or a key the provider refuses
              (quota, billing, auth) (a stale one too: its redo is
              held), a looped run paused by PAUSE

Counts are exact and come from aggregates; rows are fetched only up to the
limit the caller shows, so a budget that holds 50,000 sets costs one count
and twenty rows.
"""
from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import config, layout, state_queries
from ..infra.state import BUDGET_REASON

KINDS = ("blocked", "failed", "refused", "unusable", "stalled", "held")
STUCK_KINDS = ("unusable", "stalled", "held")  # a run line's "stuck": will not move by itself
_SET_KINDS = {"failed": "failed", "refused": "refused", "held": "held"}  # kind -> set state
_SEEKS_BEFORE_A_SCAN = 500  # steps to read one by one; past that, one scan of the table


@dataclass(frozen=True)
class Policy:
    """What the config says about when a set or a run needs someone."""

    budget_usd: float | None = None
    loss_max_attempts: int = 5
    optimizer_max_attempts: int = 3
    # A set `running` longer than its job could possibly take (every attempt
    # timing out, every backoff at its longest) is stuck, not slow.
    job_bound_s: float = 3600.0

    @classmethod
    def of(cls, cfg: config.Config) -> Policy:
        llm = cfg.llm
        return cls(budget_usd=llm.budget_usd, loss_max_attempts=cfg.loss.max_attempts,
                   optimizer_max_attempts=cfg.optimizer.max_attempts,
                   job_bound_s=(llm.timeout_s * (llm.max_retries + 1)
                                + llm.backoff_max_s * llm.max_retries + 60.0))


@dataclass
class Found:
    rows: list[dict[str, Any]] = field(default_factory=list)
    total: int = 0
    per_run: dict[str, dict[str, int]] = field(default_factory=dict)
    per_kind: dict[str, int] = field(default_factory=dict)
    runs_prefix: str = ""

    def count(self, run: str | None, kind: str, n: int = 1) -> None:
        self.total += n
        self.per_kind[kind] = self.per_kind.get(kind, 0) + n
        if run is not None:
            kinds = self.per_run.setdefault(run, {})
            kinds[kind] = kinds.get(kind, 0) + n

    def run_of_path(self, path: str) -> str | None:
        """The run a notice's path is in; None for a path outside runs/ (data/)."""
        if not path.startswith(self.runs_prefix):
            return None
        return path[len(self.runs_prefix):].split("/", 1)[0] or None


class Finder:
    def __init__(self, conn: sqlite3.Connection, runs: Path, policy: Policy, now: float,
                 daemon_running: bool) -> None:
        self.conn = conn
        self.policy = policy
        self.now = now
        self.daemon_running = daemon_running
        self.found = Found(runs_prefix=f"{runs}/")

    def find(self, steps: list[state_queries.StepCounts], step_records: Mapping[str, Any],
             notices: Mapping[str, Any], loop: list[dict[str, Any]], only_run: str | None,
             limit: int | None, held_stale: Mapping[str, int],
             endpoints: Mapping[str, Any] | None = None) -> Found:
        """Every thing that needs someone, counted; rows up to `limit`, most urgent first."""
        self.limit = limit
        self._endpoints(endpoints or {})
        self._runs(loop)
        self._optimizers(step_records, only_run)
        for kind in ("failed", "refused"):
            self._sets(kind, steps, only_run)
        self._unusable(notices, only_run)
        self._running_too_long(only_run)
        self._sets("held", steps, only_run)
        self._held_stale(held_stale, only_run)
        return self.found

    # ---------------------------------------------------------------- sources
    def _room(self) -> int | None:
        return None if self.limit is None else max(0, self.limit - len(self.found.rows))

    def _add(self, row: dict[str, Any]) -> None:
        self.found.count(row["run"], row["kind"])
        room = self._room()
        if room is None or room > 0:
            self.found.rows.append(row)

    def _endpoints(self, endpoints: Mapping[str, Any]) -> None:
        """A refused key stops every call: first, whatever run asked."""
        for name, e in sorted(endpoints.items()):
            if isinstance(e, dict) and e.get("mode") == "blocked":
                due = e.get("next_probe_at")
                probe = f"; next probe in {max(0, int(due - self.now))}s" \
                    if isinstance(due, int | float) and self.daemon_running else ""
                self._add(_row("blocked", "endpoint", name, None,
                               f"the provider refuses the API key ({e.get('kind')}): "
                               f"{e.get('reason') or ''}{probe}; top up or fix the key "
                               "(the daemon probes and goes on by itself)",
                               since=e.get("since")))

    def _runs(self, loop: list[dict[str, Any]]) -> None:
        for row in loop:
            run = row["run"]
            if row["stalled"] and row["phase"] != "finished":
                self._add(_row("stalled", "run", run, run, f"{row['stalled']}; "
                               f"touch runs/{run}/RETRY (or restart the daemon) to go on",
                               updated_at=row["updated_at"]))
            if row["paused"] and row["phase"] != "finished":
                self._add(_row("held", "run", run, run,
                               f"paused: runs/{run}/PAUSE exists (remove it to go on)"))

    def _optimizers(self, step_records: Mapping[str, Any], only_run: str | None) -> None:
        for step_id, rec in step_records.items():
            run = layout.run_of(step_id)
            if only_run not in (None, run) or not isinstance(rec, dict):
                continue
            attempts = rec.get("optimizer_attempts") or 0
            if not rec.get("reported_at") or rec.get("optimizer_done") or not attempts:
                continue
            exit_code = rec.get("optimizer_exit_code")
            if attempts >= self.policy.optimizer_max_attempts:
                self._add(_row("stalled", "step", step_id, run,
                               f"the optimizer failed {attempts} times (last exit {exit_code}); "
                               f"touch runs/{run}/RETRY to run it again"))
            else:
                self._add(_row("failed", "step", step_id, run,
                               f"the optimizer failed {attempts} time(s) (last exit "
                               f"{exit_code}); retried"))

    def _sets(self, kind: str, steps: list[state_queries.StepCounts],
              only_run: str | None) -> None:
        """The sets in one state: counted from the aggregates, rows read from the
        steps that have some (an index seek each) rather than by a scan of all."""
        state = _SET_KINDS[kind]
        having = [s for s in steps if s.counts.get(state)]
        for s in having:
            self.found.count(s.run, kind, s.counts[state])
        room = self._room()
        if room == 0 or not having:
            return
        if room is None and len(having) > _SEEKS_BEFORE_A_SCAN:
            recs = state_queries.sets_in_states(self.conn, [state], prefix=only_run)
        else:
            recs = []
            for s in having:
                recs += state_queries.sets_in_states(self.conn, [state], prefix=s.step,
                                                     limit=None if room is None
                                                     else room - len(recs))
                if room is not None and len(recs) >= room:
                    break
        self.found.rows += [self._set_row(kind, rec) for rec in recs]

    def _held_stale(self, per_step: Mapping[str, int], only_run: str | None) -> None:
        """Sets whose report is stale and whose redo the budget holds back."""
        for step, n in per_step.items():
            run = layout.run_of(step)
            self.found.count(run, "held", n)
            self.found.per_run[run]["held_stale"] = \
                self.found.per_run[run].get("held_stale", 0) + n
        room = self._room()
        if room != 0 and per_step:
            recs = state_queries.stale_held_sets(self.conn, BUDGET_REASON, prefix=only_run,
                                                 limit=room)
            self.found.rows += [self._set_row("held", rec) for rec in recs]

    def _set_row(self, kind: str, rec: dict[str, Any]) -> dict[str, Any]:
        reason = rec["reason"] or ""
        if kind == "failed":
            if rec["attempts"] >= self.policy.loss_max_attempts:
                reason = f"gave up after {rec['attempts']} attempts: {reason}"
            elif rec["next_retry_at"]:
                reason = f"attempt {rec['attempts']}, retried in " \
                         f"{max(0, rec['next_retry_at'] - self.now):.0f}s: {reason}"
        return _row(kind, "set", rec["set"], layout.run_of(rec["set"]), reason,
                    state=rec["state"], attempts=rec["attempts"],
                    next_retry_at=rec["next_retry_at"], updated_at=rec["updated_at"])

    def _unusable(self, notices: Mapping[str, Any], only_run: str | None) -> None:
        for path, notice in notices.items():
            run = self.found.run_of_path(path)
            if only_run not in (None, run) or not isinstance(notice, dict):
                continue
            reason = str(notice.get("reason", ""))
            rel = path[len(self.found.runs_prefix):] if run is not None else None
            if rel is not None and rel.endswith(f"/{layout.SCRIPTS}"):
                work_prefix = rel[:-len(layout.SCRIPTS) - 1]
                waiting = state_queries.sets_in_states(self.conn, ["waiting"],
                                                       prefix=work_prefix)
                if not waiting and state_queries.sets_under(self.conn, work_prefix):
                    continue  # its sets moved on; the next scan drops the notice
                for rec in waiting:
                    self._add(_row("unusable", "set", rec["set"], run,
                                   rec["reason"] or reason, state="waiting",
                                   updated_at=rec["updated_at"]))
                if waiting:
                    continue
            self._add(_row("unusable", "path", path, run, reason,
                           event=notice.get("event")))

    def _running_too_long(self, only_run: str | None) -> None:
        if not self.daemon_running:
            return  # a stopped daemon's running sets run again at its next start
        for rec in state_queries.running_since(self.conn, self.now - self.policy.job_bound_s):
            run = layout.run_of(rec["set"])
            if only_run in (None, run):
                self._add(_row("stalled", "set", rec["set"], run,
                               f"running since {self.now - (rec['updated_at'] or 0):.0f}s, "
                               "longer than a job can take", state="running",
                               updated_at=rec["updated_at"]))


def _row(kind: str, what: str, subject: str, run: str | None, reason: str,
         **more: Any) -> dict[str, Any]:
    return {"kind": kind, "what": what, "id": subject, "run": run, "reason": reason, **more}
