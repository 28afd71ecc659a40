"""When a complete episode range has finished being written.

A range is scored only after its files have been quiet for `[loss]
settle_s`: by their mtimes, and by what this daemon saw change (a
writer whose clock runs ahead, or a copy tool that keeps old mtimes, would
fool the mtimes alone). `_SUCCESS`, newer than every episode, says "finished"
at once.
"""
from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..core import layout
from .observe import Observation

CLOCK_SKEW_TOLERANCE_S = 2.0  # mtimes this far ahead of our clock are normal jitter

# (path, reason, event) -> logged now: a path named once (discovery.ignore)
Notice = Callable[[Path, str, str], bool]


class SettleClock:
    """Per set: the signatures last seen and when they last changed."""

    def __init__(self, settle_s: float, runs: Path, notice: Notice) -> None:
        self.settle_s = settle_s
        self.runs = runs
        self.notice = notice
        self._last_sigs: dict[str, tuple[Any, float]] = {}  # set id -> (sigs, when changed)

    def ready_at(self, key: layout.SetKey, obs: Observation, now: float) -> float:
        """The wall-clock time the range counts as finished (<= now: it is)."""
        return max(self._mtime_ready_at(key, obs, now), self._changed_at(key, obs, now))

    def forget(self, key: layout.SetKey) -> None:
        """Its inputs changed under a job: the settle wait starts again from now."""
        self._last_sigs.pop(key.id, None)

    def _mtime_ready_at(self, key: layout.SetKey, obs: Observation, now: float) -> float:
        """When the episodes' mtimes say the range is finished; a writer's clock
        ahead of ours (NFS, a remote copy) is capped, and said once."""
        ready_at = obs.ready_at(self.settle_s)
        ahead_s = obs.newest_mtime_ns / 1e9 - now
        if obs.success_marker or ahead_s <= CLOCK_SKEW_TOLERANCE_S:
            return ready_at
        self.notice(key.scripts_dir(self.runs),
                    f"newest episode mtime {iso(obs.newest_mtime_ns / 1e9)} is in the "
                    "future: the writer's clock is ahead of ours; settling from when the "
                    "files last changed instead",
                    "set.clock_skew")
        return 0.0  # _changed_at's settle window from our own clock applies

    def _changed_at(self, key: layout.SetKey, obs: Observation, now: float) -> float:
        """A set whose files changed since we last looked waits settle_s from now.

        mtimes alone would do on a local disk; this guards against a writer
        whose clock (NFS) or copy tool (`cp -p`, rsync -t) sets old mtimes.
        The first sighting counts as a change: a slow writer appending to a
        file with an old mtime is not finished just because we looked late
        (unless _SUCCESS, newer than every episode, says it is).
        """
        previous = self._last_sigs.get(key.id)
        if previous is None:
            self._last_sigs[key.id] = (obs.sigs, now)
            if obs.success_marker:
                return 0.0
            return now + self.settle_s
        sigs, changed = previous
        if sigs != obs.sigs:
            self._last_sigs[key.id] = (obs.sigs, now)
            return now + self.settle_s if not obs.success_marker else 0.0
        return changed + self.settle_s if changed and not obs.success_marker else 0.0


def at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def iso(ts: float) -> str:
    return at(ts).isoformat(timespec="seconds")
