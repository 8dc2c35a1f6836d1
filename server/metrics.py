"""The gateway's Prometheus metrics: what it counts as requests pass, and GET /metrics.

Counted as they happen (since the process started): HTTP requests and their latency per route,
chat completions, prompt/completion/cached tokens and time to first token per replica (from the
fields a handler leaves for the request log), weight swaps and their duration. Read when scraped: each replica's health and in-flight requests,
and the training rounds in the database (so every gateway reports the same rounds).

Each app has its own ``CollectorRegistry`` (never prometheus_client's global one: several apps share
a test process, and a family registered twice is an error there). The text is prometheus_client's.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter as Tally
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.engine_status import ReplicaState, replica_states
from server.engines.base import Engine
from storage.round_stats import RoundTiming, round_timings

# The 0.0.4 text format that generate_latest writes; CONTENT_TYPE_LATEST now names 1.0.0, which
# scrapers already configured for this endpoint did not negotiate.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# No ``_created`` series next to every counter and histogram: the exposition stays as it was.
disable_created_metrics()

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SWAP_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ROUND_BUCKETS_S = (10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)
UNMATCHED = "unmatched"  # requests no route answered: one label, so odd paths cannot blow up the series


class ScrapeState(Collector):
    """The families read when scraped: replica gauges and the database's rounds.

    Reading them awaits the engine and blocks on the database, which a collector's ``collect`` cannot
    do, so ``scrape`` reads them first and hands them over here right before rendering.
    """

    def __init__(self) -> None:
        self.replicas: list[ReplicaState] | None = None  # None: not scraped yet, nothing to report
        self.rounds: list[RoundTiming] | None = None  # None: the database could not be read

    def collect(self) -> Iterator[Metric]:
        if self.replicas is None:
            return
        for name, help_text, value in (
            ("tandem_engine_healthy", "1 when the replica answers its health probes.", lambda r: int(r.healthy)),
            ("tandem_engine_drained", "1 when an operator took the replica out of rotation.", lambda r: int(r.drained)),
            (
                "tandem_engine_in_flight",
                "Requests queued or running on the replica (its queue depth).",
                lambda r: r.in_flight,
            ),
        ):
            family = GaugeMetricFamily(name, help_text, labels=["replica"])
            for replica in self.replicas:
                family.add_metric([replica.name], value(replica))
            yield family
        yield GaugeMetricFamily(
            "tandem_database_up", "Whether the last scrape could read the database.", value=int(self.rounds is not None)
        )
        if self.rounds is not None:
            yield from _round_families(self.rounds)


def _round_families(rounds: list[RoundTiming]) -> Iterator[Metric]:
    counts = GaugeMetricFamily(
        "tandem_rounds", "Training rounds recorded in the database, by model and status.", labels=["model", "status"]
    )
    for (model, status), count in sorted(Tally((r.model, r.status) for r in rounds).items()):
        counts.add_metric([model, status], count)
    yield counts
    # A histogram of no registry, filled from the rows of this scrape: its buckets are prometheus_client's.
    durations = Histogram(
        "tandem_round_duration_seconds",
        "Wall time of finished training rounds, by model and status.",
        ["model", "status"],
        buckets=ROUND_BUCKETS_S,
        registry=None,
    )
    for r in rounds:
        if r.duration_s is not None:
            durations.labels(model=r.model, status=r.status).observe(r.duration_s)
    yield from durations.collect()


def _counter_value(counter: Counter, **labels: str) -> float:
    """A counter's value for ``labels``, 0 before any; read through ``collect`` (no series is created)."""
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels == labels:
                return sample.value
    return 0.0


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "tandem_http_requests",
            "HTTP requests answered, by route, method and status.",
            ["route", "method", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "tandem_http_request_duration_seconds",
            "Time from request to the last byte of the answer, by route and method.",
            ["route", "method"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        by_replica = ["replica"]
        self.completions = Counter(
            "tandem_completions", "Chat completions the engines answered, by replica.", by_replica, registry=registry
        )
        self.prompt_tokens = Counter(
            "tandem_prompt_tokens", "Prompt tokens sent to the engines, by replica.", by_replica, registry=registry
        )
        self.completion_tokens = Counter(
            "tandem_completion_tokens", "Tokens the engines generated, by replica.", by_replica, registry=registry
        )
        self.cached_tokens = Counter(
            "tandem_cached_tokens",
            "Prompt tokens the engines found in their prefix cache, by replica.",
            by_replica,
            registry=registry,
        )
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds",
            "Time from request to the first generated token of chat completions, by replica.",
            by_replica,
            buckets=TTFT_BUCKETS_S,
            registry=registry,
        )
        self.swaps = Counter(
            "tandem_weight_swaps", "Weight rollouts over all replicas that succeeded.", registry=registry
        )
        self.swap_duration = Histogram(
            "tandem_weight_swap_duration_seconds",
            "Time to load new weights into every replica.",
            buckets=SWAP_BUCKETS_S,
            registry=registry,
        )
        self.state = ScrapeState()
        registry.register(self.state)

    def observe_tokens(self, fields: dict[str, Any]) -> None:
        """Token counts a chat handler left in the request's log fields (see ChatService._record)."""
        if "completion_tokens" not in fields:
            return
        replica = str(fields.get("replica") or "unknown")
        self.completions.labels(replica=replica).inc()
        self.prompt_tokens.labels(replica=replica).inc(fields.get("prompt_tokens", 0))
        self.completion_tokens.labels(replica=replica).inc(fields["completion_tokens"])
        self.cached_tokens.labels(replica=replica).inc(fields.get("cached_tokens", 0))
        if fields.get("ttft_ms") is not None:  # None: no token came (cancelled or failed before one)
            self.ttft.labels(replica=replica).observe(fields["ttft_ms"] / 1000)

    def observe_swap(self, seconds: float) -> None:
        self.swaps.inc()
        self.swap_duration.observe(seconds)

    def cache_hit_ratio(self, replica: str) -> float | None:
        """Cached over prompt tokens of what this gateway sent ``replica``; None before any request."""
        prompt = _counter_value(self.prompt_tokens, replica=replica)
        return _counter_value(self.cached_tokens, replica=replica) / prompt if prompt else None


class MetricsMiddleware:
    """Counts every HTTP request and its latency. Pure ASGI, like the request log, to stay cheap."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            # The router put the matched route in the scope: its template keeps the label set small.
            route = getattr(scope.get("route"), "path", UNMATCHED)
            method = scope["method"]
            self.metrics.requests.labels(route=route, method=method, status=str(status)).inc()
            self.metrics.latency.labels(route=route, method=method).observe(time.perf_counter() - started)
            self.metrics.observe_tokens(scope.get("state", {}).get("log_fields", {}))


def _read_rounds(sessions: sessionmaker[Session]) -> list[RoundTiming] | None:
    try:
        with sessions() as session:
            return round_timings(session)
    except DBAPIError:  # the database is away: report what is live rather than fail the scrape
        return None


async def scrape(metrics: GatewayMetrics, engine: Engine, sessions: sessionmaker[Session]) -> bytes:
    """The exposition text for GET /metrics."""
    replicas = await replica_states(engine)
    rounds = await asyncio.to_thread(_read_rounds, sessions)
    # No await from here to the text: a concurrent scrape cannot swap the state under this one.
    metrics.state.replicas, metrics.state.rounds = replicas, rounds
    return generate_latest(metrics.registry)
