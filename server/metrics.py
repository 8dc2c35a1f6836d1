"""The gateway's Prometheus metrics: what it counts as requests pass, and GET /metrics.

Counted as they happen (since the process started): HTTP requests and their latency per route,
chat completions, prompt/completion/cached tokens and time to first token per replica (from the
fields a handler leaves for the request log), weight swaps and their duration. Read when scraped: each replica's health and in-flight requests,
and the training rounds in the database (so every gateway reports the same rounds).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.engine_status import replica_states
from server.engines.base import Engine
from server.prometheus import Counter, Histogram, Labels, gauge, render
from storage.round_stats import RoundTiming, round_timings

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SWAP_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ROUND_BUCKETS_S = (10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)
UNMATCHED = "unmatched"  # requests no route answered: one label, so odd paths cannot blow up the series


class GatewayMetrics:
    def __init__(self) -> None:
        self.requests = Counter("tandem_http_requests", "HTTP requests answered, by route, method and status.")
        self.latency = Histogram(
            "tandem_http_request_duration_seconds",
            "Time from request to the last byte of the answer, by route and method.",
            LATENCY_BUCKETS_S,
        )
        self.completions = Counter("tandem_completions", "Chat completions the engines answered, by replica.")
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens sent to the engines, by replica.")
        self.completion_tokens = Counter("tandem_completion_tokens", "Tokens the engines generated, by replica.")
        self.cached_tokens = Counter(
            "tandem_cached_tokens", "Prompt tokens the engines found in their prefix cache, by replica."
        )
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds",
            "Time from request to the first generated token of chat completions, by replica.",
            TTFT_BUCKETS_S,
        )
        self.swaps = Counter("tandem_weight_swaps", "Weight rollouts over all replicas that succeeded.")
        self.swap_duration = Histogram(
            "tandem_weight_swap_duration_seconds", "Time to load new weights into every replica.", SWAP_BUCKETS_S
        )

    def observe_tokens(self, fields: dict[str, Any]) -> None:
        """Token counts a chat handler left in the request's log fields (see ChatService._record)."""
        if "completion_tokens" not in fields:
            return
        replica = str(fields.get("replica") or "unknown")
        self.completions.inc(replica=replica)
        self.prompt_tokens.inc(fields.get("prompt_tokens", 0), replica=replica)
        self.completion_tokens.inc(fields["completion_tokens"], replica=replica)
        self.cached_tokens.inc(fields.get("cached_tokens", 0), replica=replica)
        if fields.get("ttft_ms") is not None:  # None: no token came (cancelled or failed before one)
            self.ttft.observe(fields["ttft_ms"] / 1000, replica=replica)

    def observe_swap(self, seconds: float) -> None:
        self.swaps.inc()
        self.swap_duration.observe(seconds)

    def cache_hit_ratio(self, replica: str) -> float | None:
        """Cached over prompt tokens of what this gateway sent ``replica``; None before any request."""
        prompt = self.prompt_tokens.get(replica=replica)
        return self.cached_tokens.get(replica=replica) / prompt if prompt else None


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
            self.metrics.requests.inc(route=route, method=method, status=str(status))
            self.metrics.latency.observe(time.perf_counter() - started, route=route, method=method)
            self.metrics.observe_tokens(scope.get("state", {}).get("log_fields", {}))


def _read_rounds(sessions: sessionmaker[Session]) -> list[RoundTiming] | None:
    try:
        with sessions() as session:
            return round_timings(session)
    except DBAPIError:  # the database is away: report what is live rather than fail the scrape
        return None


def _round_lines(rounds: list[RoundTiming] | None) -> list[str]:
    if rounds is None:
        return gauge("tandem_database_up", "Whether the last scrape could read the database.", [((), 0)])
    counts: dict[Labels, float] = {}
    durations = Histogram(
        "tandem_round_duration_seconds", "Wall time of finished training rounds, by model and status.", ROUND_BUCKETS_S
    )
    for r in rounds:
        key = (("model", r.model), ("status", r.status))
        counts[key] = counts.get(key, 0) + 1
        if r.duration_s is not None:
            durations.observe(r.duration_s, model=r.model, status=r.status)
    return [
        *gauge("tandem_database_up", "Whether the last scrape could read the database.", [((), 1)]),
        *gauge("tandem_rounds", "Training rounds recorded in the database, by model and status.", counts.items()),
        *durations.render(),
    ]


async def scrape(metrics: GatewayMetrics, engine: Engine, sessions: sessionmaker[Session]) -> bytes:
    """The exposition text for GET /metrics."""
    replicas = await replica_states(engine)
    rounds = await asyncio.to_thread(_read_rounds, sessions)
    return render(
        metrics.requests.render(),
        metrics.latency.render(),
        metrics.completions.render(),
        metrics.prompt_tokens.render(),
        metrics.completion_tokens.render(),
        metrics.cached_tokens.render(),
        metrics.ttft.render(),
        metrics.swaps.render(),
        metrics.swap_duration.render(),
        gauge(
            "tandem_engine_healthy",
            "1 when the replica answers its health probes.",
            [((("replica", r.name),), int(r.healthy)) for r in replicas],
        ),
        gauge(
            "tandem_engine_drained",
            "1 when an operator took the replica out of rotation.",
            [((("replica", r.name),), int(r.drained)) for r in replicas],
        ),
        gauge(
            "tandem_engine_in_flight",
            "Requests queued or running on the replica (its queue depth).",
            [((("replica", r.name),), r.in_flight) for r in replicas],
        ),
        _round_lines(rounds),
    )
