"""`[llm] budget_usd` per run: once a run's spend reaches it, its sets are held."""
from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from ..core import layout
from ..infra.state import BUDGET_REASON, SetState, StateStore
from .decision import Decision

Emit = Callable[..., None]


class Budget:
    """Reached once a run's spend is at or over `limit_usd`; said once per run."""

    def __init__(self, limit_usd: float | None, state: StateStore, emit: Emit, *,
                 runs: Path) -> None:
        self.limit_usd = limit_usd
        self.state = state
        self.emit = emit
        self.runs = runs
        self._lock = threading.Lock()
        self._said: set[str] = set()  # runs whose budget.reached is logged

    def reached(self, run: str) -> bool:
        if self.limit_usd is None:
            return False
        spent = self.state.spend.get(run)
        if spent is None or spent.cost_usd < self.limit_usd:
            return False
        with self._lock:  # evaluations run in parallel: one line per run
            first = run not in self._said
            self._said.add(run)
        if first:
            self.emit("budget.reached", level="warning", run=run,
                      spent_usd=round(spent.cost_usd, 6), budget_usd=self.limit_usd)
        return True

    def hold(self, key: layout.SetKey) -> Decision | None:
        """Over budget: the set is held (or its report stays stale) instead of sent."""
        if not self.reached(key.run):
            return None
        report_exists = key.report_path(self.runs).exists()
        return Decision.write(SetState.STALE if report_exists else SetState.HELD,
                              reason=BUDGET_REASON)
