"""Asking, every few minutes, whether a refused API key works again.

An endpoint whose key the provider refused (insufficient_quota, billing,
401/403) is blocked by its limiter; while it is, one small real call (the
`probe`, llm.probe) goes out every `probe_s` seconds. "ok", or a 429 (the key
itself is taken: only the rate is spent), unblocks it; anything else waits
for the next probe. Runs on the LLM loop's thread, like its limiter.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Probe = Callable[[], Awaitable[str]]  # llm.probe: "ok", "blocked", "rate_limited", "error"
PROBE_S = 180.0  # a blocked endpoint: one small call this often


class Prober:
    """The probes of one blocked endpoint; `works` is called when one passes."""

    def __init__(self, probe: Probe | None, probe_s: float, *, clock: Callable[[], float],
                 works: Callable[[], None], said: Callable[[str, int], None]) -> None:
        self.probe, self.probe_s = probe, probe_s
        self.clock = clock
        self.works = works  # the key works again: unblock
        self.said = said  # a probe failed: (what it said, probes so far), for a debug line
        self.count = 0  # probes since the endpoint was blocked
        self.due = 0.0  # clock: when the next probe starts
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """The endpoint was just blocked: the first probe in probe_s."""
        self.count = 0
        self._schedule()

    def now(self) -> bool:
        """Probe at once (the operator says the key is fixed: SIGHUP), unless one is
        under way; its failure schedules the next one probe_s later. True if started."""
        if self._task is not None or self.probe is None:
            return False
        if self._timer is not None:
            self._timer.cancel()
        self._start()
        return True

    def _schedule(self) -> None:
        self.due = self.clock() + self.probe_s
        if self.probe is not None:
            self._timer = asyncio.get_running_loop().call_later(self.probe_s, self._start)

    def _start(self) -> None:
        self._timer = None
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        assert self.probe is not None
        try:
            self.count += 1
            said = await self.probe()
        finally:
            self._task = None
        if said in ("ok", "rate_limited"):  # a rate limit: the key itself is taken
            self.works()
        else:
            self._schedule()
            self.said(said, self.count)

    def stop(self) -> None:
        """Unblocked, or shutting down: no probe left scheduled or running."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:  # never the probe's own task: it clears this first
            self._task.cancel()
