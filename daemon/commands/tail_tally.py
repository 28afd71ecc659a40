"""`skilltrain tail`'s tally: per (run, epoch, step), the last loss state of
each set and what that step's reports cost; per run, what the run cost.
Printed as `==` lines, each cost once where it belongs:

  == r7/e01/s02  done 1  running 0  queued 0  failed 1  | step in=18211 out=1034 cached=0 $0.0123
  == r7  in=18211 out=1034 cached=0 $0.0123

(A step line once carried its run's totals, so every step read as if it had
cost the whole run.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..infra.state import RunSpend
from .tail_format import Record, tokens_text, usd

StepKey = tuple[str, int, int]

STATE_OF = {
    "loss.queued": "queued",
    "loss.started": "running",
    "loss.retry": "running",
    "loss.completed": "done",
    "loss.failed": "failed",
    "loss.rate_limited": "queued",  # tried again later, not a failure of the set
    "loss.refused": "refused",
}
_STATES = ("done", "running", "queued", "failed", "refused")


_TOKENS = ("tokens_in", "tokens_out", "tokens_cached", "tokens_cache_write")


def _spend_of(rec: Record) -> RunSpend:
    """A `cost.total` event as the run's spend (the state's own record of it)."""
    spend = RunSpend(cost_usd=_float(rec.get("cost_usd")))
    _add(spend, rec, cost=False)
    return spend


def _add(spend: RunSpend, rec: Record, *, cost: bool = True) -> None:
    """A report's tokens and dollars added to a run's or a step's spend."""
    for name in _TOKENS:
        setattr(spend, name, getattr(spend, name) + _int(rec.get(name)))
    if cost:
        spend.cost_usd += _float(rec.get("cost_usd"))


def _cost_text(spend: RunSpend) -> str:
    return f"{tokens_text(asdict(spend))} {usd(spend.cost_usd)}"


@dataclass
class Tally:
    """Per (run, epoch, step): each set's last loss state and the step's cost;
    per run: tokens and cost (a `cost.total` event, the daemon's own count,
    replaces what the log's reports add up to)."""

    sets: dict[StepKey, dict[tuple[str, str], str]] = field(default_factory=dict)
    costs: dict[str, RunSpend] = field(default_factory=dict)
    step_costs: dict[StepKey, RunSpend] = field(default_factory=dict)

    def update(self, rec: Record) -> None:
        name, run = rec.get("event"), rec.get("run")
        if not isinstance(run, str):
            return
        if name == "cost.total":
            self.costs[run] = _spend_of(rec)
            return
        state = STATE_OF.get(str(name))
        key = step_key(rec)
        if state is None or key is None:
            return
        self.sets.setdefault(key, {})[(str(rec.get("work")), str(rec.get("range")))] = state
        if name == "loss.completed":
            _add(self.costs.setdefault(run, RunSpend()), rec)
            _add(self.step_costs.setdefault(key, RunSpend()), rec)

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
        cost = self.step_costs.get(key)
        return f"{line}  | step {_cost_text(cost)}" if cost is not None else line

    def run_line(self, run: str) -> str:
        return f"{run}  {_cost_text(self.costs.get(run, RunSpend()))}"

    def summary(self, run: str | None = None) -> list[str]:
        lines = [self.step_line(k) for k in sorted(self.sets) if run is None or k[0] == run]
        lines += [f"== {self.run_line(r)}" for r in sorted(self.costs) if run is None or r == run]
        return lines


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _float(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def step_key(rec: Record) -> StepKey | None:
    run, epoch, step = rec.get("run"), rec.get("epoch"), rec.get("step")
    if isinstance(run, str) and isinstance(epoch, int) and isinstance(step, int):
        return (run, epoch, step)
    return None
