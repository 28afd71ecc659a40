"""Prometheus metrics: the daemon's events as counters, gauges and a histogram.

`[metrics] listen = "127.0.0.1:9464"` serves them at /metrics in the
Prometheus text format (prometheus-client's own server, in a thread). The
numbers are derived from the same events the log gets (`observe`), plus the
set states read at scrape time, so a metric never says something the log
does not. Label values are run names, set states and token kinds, never file
contents. docs/metrics.md lists them with a scrape config.

Each Metrics object has its own registry, so two daemons in one process (the
tests) do not share counters.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .config import split_listen
from .errors import ConfigError

PREFIX = "skilltrain"
TOKEN_KINDS = {"in": "tokens_in", "out": "tokens_out", "cached": "tokens_cached",
               "cache_write": "tokens_cache_write"}
# One loss completion takes seconds to minutes; retries and their waits included.
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, float("inf"))

F = TypeVar("F", bound=Callable[..., Any])


class _SetStates(Collector):
    """skilltrain_sets{state} and skilltrain_jobs_running, read when scraped."""

    def __init__(self, counts: Callable[[], Mapping[str, int]], states: Iterable[str]) -> None:
        self.counts = counts
        self.states = list(states)

    def collect(self) -> Iterator[Metric]:
        counts = self.counts()
        sets = GaugeMetricFamily(f"{PREFIX}_sets", "Sets by state", labels=["state"])
        for state in self.states:
            sets.add_metric([state], counts.get(state, 0))
        yield sets
        yield GaugeMetricFamily(f"{PREFIX}_jobs_running", "Loss jobs in an LLM call now",
                                value=counts.get("running", 0))


class _Limiters(Collector):
    """Per LLM endpoint (a short `model@host:port` label, one per configured
    endpoint): the concurrency limit, the calls in flight, rate-limited replies."""

    def __init__(self, limiters: Any) -> None:
        self.limiters = limiters  # llm_limit.Limiters (not imported: metrics stays low)

    def collect(self) -> Iterator[Metric]:
        limit = GaugeMetricFamily(f"{PREFIX}_llm_concurrency_limit",
                                  "Calls the endpoint may have in flight now", labels=["endpoint"])
        in_flight = GaugeMetricFamily(f"{PREFIX}_llm_calls_in_flight",
                                      "Calls holding a slot of the endpoint now",
                                      labels=["endpoint"])
        limited = CounterMetricFamily(f"{PREFIX}_llm_rate_limited_responses",
                                      "Replies refused for the provider's rate limit "
                                      "(429, or 503 with Retry-After)", labels=["endpoint"])
        calls = CounterMetricFamily(f"{PREFIX}_llm_calls", "Call attempts that reached the "
                                    "endpoint or failed on the way", labels=["endpoint"])
        for limiter in self.limiters.all():
            limit.add_metric([limiter.endpoint], limiter.limit)
            in_flight.add_metric([limiter.endpoint], limiter.in_flight)
            limited.add_metric([limiter.endpoint], limiter.usage.rate_limited)
            calls.add_metric([limiter.endpoint], limiter.usage.calls)
        yield from (limit, in_flight, limited, calls)


class Metrics:
    """The daemon's metrics; `serve()` starts the endpoint, `close()` stops it."""

    def __init__(self, counts: Callable[[], Mapping[str, int]], states: Iterable[str]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.reports = Counter(f"{PREFIX}_reports", "Loss reports written", registry=r)
        self.set_failures = Counter(f"{PREFIX}_set_failures",
                                    "Loss jobs that failed or were refused",
                                    ["kind"], registry=r)
        self.tokens = Counter(f"{PREFIX}_llm_tokens", "LLM tokens of written reports",
                              ["kind"], registry=r)
        self.cost = Counter(f"{PREFIX}_cost_usd", "Spend in US dollars (priced calls only)",
                            registry=r)
        self.request_seconds = Histogram(f"{PREFIX}_llm_request_seconds",
                                         "Wall time of one loss completion, retries included",
                                         buckets=REQUEST_BUCKETS, registry=r)
        self.craft_distance = Gauge(f"{PREFIX}_craft_distance",
                                    "Mean craft distance of the run's last reported step",
                                    ["run"], registry=r)
        self.steps_reported = Counter(f"{PREFIX}_steps_reported", "Steps fully reported",
                                      ["run"], registry=r)
        self.startup_scan = Gauge(f"{PREFIX}_startup_scan_sets",
                                  "The start-up scan: sets looked at, and in the tree",
                                  ["of"], registry=r)
        self.startup_catching_up = Gauge(f"{PREFIX}_startup_catching_up",
                                         "1 while the start-up scan runs (ready, not caught up)",
                                         registry=r)
        for kind in ("failed", "refused"):
            self.set_failures.labels(kind)  # present at 0 from the first scrape
        for kind in TOKEN_KINDS:
            self.tokens.labels(kind)
        r.register(_SetStates(counts, states))
        ProcessCollector(registry=r)
        self._server: Any = None
        self._thread: Any = None

    # ------------------------------------------------------------- events in
    def observe(self, event: str, fields: Mapping[str, Any]) -> None:
        """Count one daemon event (the name and fields it is logged with)."""
        if event == "loss.completed":
            self.reports.inc()
            for kind, name in TOKEN_KINDS.items():
                self.tokens.labels(kind).inc(_number(fields.get(name)))
            self.cost.inc(_number(fields.get("cost_usd")))
        elif event in ("loss.failed", "loss.refused"):
            self.set_failures.labels(event.split(".")[1]).inc()
        elif event == "step.reported" and isinstance(fields.get("run"), str):
            run = fields["run"]
            self.steps_reported.labels(run).inc()
            distance = fields.get("craft_distance")
            if isinstance(distance, int | float):
                self.craft_distance.labels(run).set(distance)

    def watch_limiters(self, limiters: Any) -> None:
        """Export the LLM endpoints' limiters (llm_limit.Limiters), read at scrape time."""
        self.registry.register(_Limiters(limiters))

    def catching_up(self, looked: int, total: int) -> None:
        """The start-up scan's progress."""
        self.startup_catching_up.set(1)
        self.startup_scan.labels("looked").set(looked)
        self.startup_scan.labels("total").set(total)

    def caught_up(self) -> None:
        self.startup_catching_up.set(0)

    def timed(self, fn: F) -> F:
        """`fn` (the LLM completion, a coroutine function), observed in
        skilltrain_llm_request_seconds."""
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                return await fn(*args, **kwargs)
            finally:
                self.request_seconds.observe(time.monotonic() - t0)

        return wrapper  # type: ignore[return-value]

    # ------------------------------------------------------------- endpoint
    def serve(self, listen: str) -> None:
        """Serve /metrics on `listen` ("host:port"); a bind failure is a config error."""
        from prometheus_client import start_http_server

        host, port = split_listen(listen)
        try:
            self._server, self._thread = start_http_server(port, addr=host,
                                                           registry=self.registry)
        except OSError as e:
            raise ConfigError(f"[metrics] listen = {listen!r}: cannot listen there: "
                              f"{e.strerror or e}") from None

    @property
    def port(self) -> int | None:
        """The port actually bound (useful with port 0), or None when not serving."""
        return int(self._server.server_address[1]) if self._server is not None else None

    def close(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.shutdown()
                self._server.server_close()
            self._server = None


def _number(value: Any) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    return float(value) if ok else 0.0
