"""Prometheus metrics: the daemon's events as counters, gauges and a histogram.

`[metrics] listen = "127.0.0.1:9464"` serves them at /metrics in the
Prometheus text format (prometheus-client's own server, in a thread). The
numbers are derived from the same events the log gets (`observe`), plus the
set states read at scrape time, so a metric never says something the log
does not. Label values are run names, set states, phases and token kinds,
never file contents or set names: a series per run at most, so a week of
training with thousands of sets stays a few hundred series. The per-run
gauges (loop phase, spend, budget, last report) are read at scrape time from
the run records and the state (daemon/service/metrics_runs.py). docs/metrics.md lists
them all with a scrape config; systemd/prometheus/ has the alert rules and
systemd/grafana/ the dashboard built on them.

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

from ..core.config import split_listen
from ..core.errors import ConfigError, LLMError
from ..infra.llm_flex import FlexUnavailable

PREFIX = "skilltrain"
TOKEN_KINDS = {"in": "tokens_in", "out": "tokens_out", "cached": "tokens_cached",
               "cache_write": "tokens_cache_write"}
# Events of a reply paid for (they carry its tokens and cost): written, or not.
PAID_EVENTS = frozenset({"loss.completed", "loss.refused", "loss.contradicted",
                         "loss.discarded"})
# One loss completion takes seconds to minutes; retries and their waits included.
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, float("inf"))
# A writer or an optimizer run: a toy's second to a fine-tuning's hours.
STAGE_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400,
                 float("inf"))
STAGES = ("writer", "optimizer")

CLAIM_VERDICTS = ("confirmed", "contradicted", "not_checkable")

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
        self.limiters = limiters  # llm_endpoints.Limiters (not imported: metrics stays low)

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
        blocked = GaugeMetricFamily(f"{PREFIX}_llm_endpoint_blocked",
                                    "1 while the provider refuses the endpoint's key (quota, "
                                    "billing, authentication): no call goes out",
                                    labels=["endpoint", "kind"])
        holds = CounterMetricFamily(f"{PREFIX}_llm_holds", "Times no new call of the endpoint "
                                    "could start for a while (Retry-After, the provider's "
                                    "rate-limit headers)", labels=["endpoint"])
        held = CounterMetricFamily(f"{PREFIX}_llm_held_seconds", "Seconds no new call of the "
                                   "endpoint could start", labels=["endpoint"])
        for limiter in self.limiters.all():
            holds.add_metric([limiter.endpoint], limiter.usage.holds)
            held.add_metric([limiter.endpoint], limiter.usage.held_s)
            refused = limiter.blocked
            blocked.add_metric([limiter.endpoint, refused[0] if refused else ""],
                               1 if refused else 0)
            limit.add_metric([limiter.endpoint], limiter.limit)
            in_flight.add_metric([limiter.endpoint], limiter.in_flight)
            limited.add_metric([limiter.endpoint], limiter.usage.rate_limited)
            calls.add_metric([limiter.endpoint], limiter.usage.calls)
        yield from (limit, in_flight, limited, calls, blocked, holds, held)


class _Flex(Collector):
    """Flex calls refused for "resource unavailable", and the calls sent again after
    the wait: at the standard tier (fell_back) or at flex (waited)."""

    def __init__(self, flex: Any) -> None:
        self.flex = flex  # llm_flex.FlexWatch

    def collect(self) -> Iterator[Metric]:
        counts = CounterMetricFamily(f"{PREFIX}_llm_flex_unavailable",
                                     "Flex calls refused for \"resource unavailable\" (refused), "
                                     "and those sent again after the wait, at the standard "
                                     "tier (fell_back) or at flex (waited)", labels=["what"])
        for what, n in self.flex.totals.items():
            counts.add_metric([what], n)
        yield counts


class Metrics:
    """The daemon's metrics; `serve()` starts the endpoint, `close()` stops it."""

    def __init__(self, counts: Callable[[], Mapping[str, int]], states: Iterable[str]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.reports = Counter(f"{PREFIX}_reports", "Loss reports written", registry=r)
        self.reports_reused = Counter(f"{PREFIX}_reports_reused",
                                      "Retired loss reports written back unpaid", registry=r)
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
        self.contradicted_share = Gauge(
            f"{PREFIX}_claims_contradicted_share", "Share of the checked claims of the run's "
            "last reported step that the measurements contradict", ["run"], registry=r)
        self.claims = Counter(f"{PREFIX}_claims", "Report claims checked against the "
                              "measurements, by verdict", ["verdict"], registry=r)
        self.unchecked = Counter(f"{PREFIX}_reports_claims_unchecked", "Reports whose claims "
                                 "could not be checked: no list, or a list with no readable "
                                 "claim", ["status"], registry=r)
        for verdict in CLAIM_VERDICTS:
            self.claims.labels(verdict)
        for status in ("not_checked", "malformed"):
            self.unchecked.labels(status)
        # One per attempt at the provider: a retried error, the error a call
        # gave up on, the reply it returned (good or not: a bad reply is a
        # refused set). The failure-ratio alert divides these.
        self.llm_attempts = Counter(f"{PREFIX}_llm_attempts",
                                    "LLM call attempts by outcome (ok, error)",
                                    ["outcome"], registry=r)
        self.stage_seconds = {stage: Histogram(f"{PREFIX}_{stage}_seconds",
                                               f"Wall time of one {stage} run (failed ones too)",
                                               buckets=STAGE_BUCKETS, registry=r)
                              for stage in STAGES}
        self.stage_failures = {stage: Counter(f"{PREFIX}_{stage}_failures",
                                              f"{stage.capitalize()} runs that failed",
                                              ["run"], registry=r)
                               for stage in STAGES}
        for kind in ("failed", "refused", "contradicted"):
            self.set_failures.labels(kind)  # present at 0 from the first scrape
        for kind in TOKEN_KINDS:
            self.tokens.labels(kind)
        for outcome in ("ok", "error"):
            self.llm_attempts.labels(outcome)
        r.register(_SetStates(counts, states))
        ProcessCollector(registry=r)
        self._server: Any = None
        self._thread: Any = None

    # ------------------------------------------------------------- events in
    def observe(self, event: str, fields: Mapping[str, Any]) -> None:
        """Count one daemon event (the name and fields it is logged with)."""
        run = fields.get("run")
        if event in ("writer.started", "step.reported") and isinstance(run, str):
            for failures in self.stage_failures.values():
                failures.labels(run)  # at 0 from the run's first stage: increase() sees the 1st
        if event in PAID_EVENTS:
            self._count_reply(event, fields)
        if event in ("loss.failed", "loss.refused", "loss.contradicted"):
            self.set_failures.labels(event.split(".")[1]).inc()
        elif event == "loss.retry":
            self.llm_attempts.labels("error").inc()
        elif event in ("writer.finished", "optimizer.finished"):
            stage = event.split(".")[0]
            self.stage_seconds[stage].observe(_number(fields.get("duration_ms")) / 1000)
        elif event in ("writer.failed", "optimizer.failed") and isinstance(run, str):
            self.stage_failures[event.split(".")[0]].labels(run).inc()
        elif event == "step.reported" and isinstance(run, str):
            self._count_step(run, fields)

    def _count_reply(self, event: str, fields: Mapping[str, Any]) -> None:
        """A reply paid for, kept or not: its tokens and cost; a report's claims."""
        if event == "loss.completed" and "reused_from" in fields:
            # A report made, paid and counted before (retire.py): neither its
            # tokens nor its claims are new.
            self.reports_reused.inc()
            return
        if event == "loss.completed":
            self.reports.inc()
        if "tokens_in" in fields:
            for kind, name in TOKEN_KINDS.items():
                self.tokens.labels(kind).inc(_number(fields.get(name)))
            self.cost.inc(_number(fields.get("cost_usd")))
        if event in ("loss.completed", "loss.contradicted"):
            self._count_claims(fields)

    def _count_step(self, run: str, fields: Mapping[str, Any]) -> None:
        self.steps_reported.labels(run).inc()
        distance = fields.get("craft_distance")
        if isinstance(distance, int | float):
            self.craft_distance.labels(run).set(distance)
        share = fields.get("claims_contradicted_share")
        if isinstance(share, int | float):
            self.contradicted_share.labels(run).set(share)

    def _count_claims(self, fields: Mapping[str, Any]) -> None:
        for verdict in CLAIM_VERDICTS:
            self.claims.labels(verdict).inc(_number(fields.get(f"claims_{verdict}")))
        status = fields.get("claims_status")
        if status in ("not_checked", "malformed"):
            self.unchecked.labels(status).inc()

    def watch_limiters(self, limiters: Any) -> None:
        """Export the LLM endpoints' limiters (llm_endpoints.Limiters), read at scrape time."""
        self.registry.register(_Limiters(limiters))

    def watch_flex(self, flex: Any) -> None:
        """Flex's "resource unavailable" refusals and what each led to (llm_flex.FlexWatch)."""
        self.registry.register(_Flex(flex))

    def watch_llm_loop(self, loop: Any) -> None:
        """The LLM event loop's lag (llm_loop.LLMLoop), read at scrape time: how late
        it answered the last health probe, or how long the outstanding one has waited."""
        Gauge(f"{PREFIX}_llm_loop_lag_seconds", "How late the LLM event loop runs a "
              "callback (a blocked or dead loop: growing)", registry=self.registry
              ).set_function(lambda: max(loop.lag_s, loop.unanswered_s()))

    def catching_up(self, looked: int, total: int) -> None:
        """The start-up scan's progress."""
        self.startup_catching_up.set(1)
        self.startup_scan.labels("looked").set(looked)
        self.startup_scan.labels("total").set(total)

    def caught_up(self) -> None:
        self.startup_catching_up.set(0)

    def register(self, collector: Collector) -> None:
        """A collector read at scrape time (the per-run gauges, the watcher's mode)."""
        self.registry.register(collector)

    def timed(self, fn: F) -> F:
        """`fn` (the LLM completion, a coroutine function), observed in
        skilltrain_llm_request_seconds; its last attempt counted in
        skilltrain_llm_attempts_total (the retried ones are counted from `loss.retry`)."""
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                result = await fn(*args, **kwargs)
            except FlexUnavailable:
                raise  # no capacity, not an error: skilltrain_llm_flex_unavailable_total
            except LLMError:
                self.llm_attempts.labels("error").inc()
                raise  # anything else (a shutdown's abandon) is not the provider's doing
            finally:
                self.request_seconds.observe(time.monotonic() - t0)
            self.llm_attempts.labels("ok").inc()
            return result

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
