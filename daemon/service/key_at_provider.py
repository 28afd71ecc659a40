"""Where a run's answer key went: said once per run and way (a batch, flex) per daemon life.

A loss prompt holds the human screenplay. A live call's prompt is kept as the
provider's live API keeps it (README); a batch's, or a flex call's, is kept
as docs/batch-providers.md says. The first time a run's prompts take such a
way, one `batch.key_at_provider` line names the provider and what it keeps.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

Emit = Callable[..., None]
EVENT = "batch.key_at_provider"


class KeyAtProvider:
    def __init__(self, emit: Emit) -> None:
        self.emit = emit
        self._lock = threading.Lock()
        self._said: set[tuple[str, str]] = set()  # (run, via) already said

    def sent(self, run: str, *, provider: str, retention: str, via: str) -> None:
        """The run's prompts (so its answer key) went to `provider` by `via`."""
        with self._lock:
            if (run, via) in self._said:
                return
            self._said.add((run, via))
        self.emit(EVENT, run=run, provider=provider, retention=retention, via=via)
