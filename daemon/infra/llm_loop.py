"""The one asyncio event loop every LLM call runs on, in its own thread.

A call waiting for a provider holds no thread: hundreds of calls in flight
are hundreds of coroutines on this loop. Blocking work the loop must not do
(litellm's synchronous request building, the built-in reviewer's measuring)
goes to the loop's default executor, a pool of DEFAULT_EXECUTOR_THREADS
threads: the thread count does not grow with the number of calls.

One loop for the whole process, started on first use: litellm caches its
async HTTP clients per event loop, so a loop per call (asyncio.run) would
build a client per call and leave their sockets to the garbage collector.

Threads: the loop itself (1), its default executor (up to 2), litellm's
logging executor (bounded by LOGGING_EXECUTOR_MAX_THREADS, set in llm.py).

Every call depends on this one thread: a callback that blocks it (a
synchronous library call by mistake) or its death stops every job while the
rest of the daemon looks fine. The daemon's health tick `probe()`s it: how
late the loop answers is its lag (a metric), and a probe unanswered for
long makes the daemon unhealthy, so systemd's watchdog restarts it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
DEFAULT_EXECUTOR_THREADS = 2  # litellm's sync request building is GIL-bound


class LLMLoop:
    """An event loop running forever in a daemon thread; submit coroutines to it."""

    def __init__(self, name: str = "llm-loop") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._probe_lock = threading.Lock()
        self._probe_sent: float | None = None  # monotonic time of the unanswered probe
        self.lag_s = 0.0  # how late the loop answered its last probe

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (started on first use)."""
        with self._lock:
            if self._loop is None or self._thread is None or not self._thread.is_alive():
                self._start()
            assert self._loop is not None
            return self._loop

    def _start(self) -> None:
        loop = asyncio.new_event_loop()
        loop.set_default_executor(ThreadPoolExecutor(DEFAULT_EXECUTOR_THREADS,
                                                     thread_name_prefix="llm-sync"))
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(started.set)
            loop.run_forever()

        thread = threading.Thread(target=run, name=self.name, daemon=True)
        thread.start()
        started.wait()
        self._loop, self._thread = loop, thread

    def in_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coro` on the loop; the future is its outcome (cancel it to cancel the task).

        The task runs in a copy of the caller's context (structlog's bound
        fields follow the job onto the loop).
        """
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for its result (from any other thread)."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError("LLMLoop.run() called from the loop's own thread")
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # KeyboardInterrupt in the caller: the request goes too
            raise

    def call_soon(self, fn: Any, *args: Any) -> None:
        """Run `fn(*args)` on the loop's thread (thread-safe)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def probe(self) -> None:
        """Ask the loop to answer (one probe at a time); never starts it."""
        with self._probe_lock:
            loop = self._loop
            if loop is None or self._probe_sent is not None:
                return
            self._probe_sent = time.monotonic()
        try:
            loop.call_soon_threadsafe(self._answer)
        except RuntimeError:
            pass  # closed: it never answers, and unanswered_s() says so

    def _answer(self) -> None:
        with self._probe_lock:
            if self._probe_sent is not None:
                self.lag_s = time.monotonic() - self._probe_sent
            self._probe_sent = None

    def unanswered_s(self) -> float:
        """How long the outstanding probe has waited (0: none outstanding)."""
        with self._probe_lock:
            sent = self._probe_sent
        return 0.0 if sent is None else time.monotonic() - sent

    def threads(self) -> int:
        """The loop's thread and its executor's threads now alive."""
        executor = getattr(self._loop, "_default_executor", None)
        workers = len(getattr(executor, "_threads", ()) or ())
        return (1 if self._thread is not None and self._thread.is_alive() else 0) + workers


_shared = LLMLoop()


def shared() -> LLMLoop:
    """The process's LLM loop."""
    return _shared
