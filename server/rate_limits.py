"""Request limits per tenant and per API key: requests and tokens per minute, concurrent requests.

A chat request is admitted against its tenant's limits (stored ones, else the deployment's defaults)
and its key's (stored ones only), or answered 429 with ``Retry-After``. Requests and tokens are
counted in moving one-minute windows by the ``limits`` library: in Redis when the deployment has one,
so every gateway shares the counts; in memory otherwise. Tokens are charged when the prompt is
rendered, as prompt tokens plus the completion budget (``max_tokens`` x ``n``), as OpenAI counts
them. Concurrent requests are counted by each gateway for itself, from admission until the response
has been sent in full (``ReleaseAdmissions``). If Redis fails, requests are admitted (logged): a
limit is not worth an outage.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from limits import RateLimitItem, RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage, RedisStorage, Storage
from limits.aio.strategies import MovingWindowRateLimiter
from starlette.types import ASGIApp, Receive, Scope, Send

from server.auth import CurrentIdentity, Identity
from server.errors import ApiError
from storage.rate_limits import Limits

logger = logging.getLogger(__name__)

Subject = tuple[str, str]  # ("tenant", id) or ("key", id)


def limiter_for(redis_url: str, key_prefix: str = "") -> MovingWindowRateLimiter:
    """Counters in Redis when the deployment has one (every gateway then shares them), else in memory."""
    storage: Storage = (
        RedisStorage(redis_url, implementation="redispy", key_prefix=f"{key_prefix}tandem-limits")
        if redis_url
        else MemoryStorage()
    )
    return MovingWindowRateLimiter(storage)


@dataclass(slots=True)
class Admission:
    """One admitted request: the subjects whose limits it counts against, and its concurrency slots."""

    limiter: RequestLimiter
    scopes: list[tuple[Subject, Limits]]
    released: bool = field(default=False)

    async def charge_tokens(self, tokens: int) -> None:
        await self.limiter.charge(self, tokens)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.limiter.release(self)


class RequestLimiter:
    def __init__(self, windows: MovingWindowRateLimiter, tenant_default: Limits) -> None:
        self._windows = windows
        self._default = tenant_default
        self._in_flight: Counter[Subject] = Counter()

    @property
    def tenant_default(self) -> Limits:
        return self._default

    def in_flight(self, subject: Subject) -> int:
        return self._in_flight[subject]

    def _scopes(self, identity: Identity) -> list[tuple[Subject, Limits]]:
        if identity.admin:  # operators and the learner's own rollouts are not limited
            return []
        scopes = [(("tenant", identity.tenant_id), identity.tenant_limits or self._default)]
        if identity.api_key_id is not None and identity.key_limits is not None:
            scopes.append((("key", identity.api_key_id), identity.key_limits))
        return scopes

    async def admit(self, identity: Identity) -> Admission:
        """Count a new request, or raise a 429 naming the limit it would exceed."""
        scopes = self._scopes(identity)
        for subject, limits in scopes:
            most = limits.max_concurrent_requests
            if most is not None and self._in_flight[subject] >= most:
                raise _too_many(
                    f"This {subject[0]} has {most} requests in progress, its limit; retry when one has finished.",
                    "concurrent_requests_exceeded",
                    retry_after_s=1,
                )
        await self._take(scopes, "requests_per_minute", 1)
        for subject, _ in scopes:
            self._in_flight[subject] += 1
        return Admission(self, scopes)

    async def charge(self, admission: Admission, tokens: int) -> None:
        await self._take(admission.scopes, "tokens_per_minute", tokens)

    def release(self, admission: Admission) -> None:
        for subject, _ in admission.scopes:
            self._in_flight[subject] -= 1
            if not self._in_flight[subject]:
                del self._in_flight[subject]

    async def _take(self, scopes: list[tuple[Subject, Limits]], kind: str, cost: int) -> None:
        """Count ``cost`` in every scope's window of this kind, or in none of them (then 429)."""
        windows = [(subject, RateLimitItemPerMinute(n)) for subject, limits in scopes if (n := getattr(limits, kind))]
        if not windows:
            return
        try:
            for subject, item in windows:
                if cost > item.amount:
                    raise _too_many(
                        f"This request needs {cost} tokens but the {subject[0]}'s limit is {item.amount} per "
                        "minute; ask for fewer tokens (max_tokens, n) or a higher limit.",
                        "tokens_per_minute_exceeded",
                        retry_after_s=None,
                    )
                if not await self._windows.test(item, *subject, cost=cost):
                    raise _too_many(
                        f"This {subject[0]} is over its limit of {item.amount} {kind.replace('_', ' ')}.",
                        f"{kind}_exceeded",
                        retry_after_s=await self._seconds_until_room(item, subject),
                    )
            for subject, item in windows:
                await self._windows.hit(item, *subject, cost=cost)
        except ApiError:
            raise
        except Exception:  # the counters' store (Redis) failed: serve rather than refuse everybody
            logger.warning("rate limit counters unavailable; admitting the request", exc_info=True)

    async def _seconds_until_room(self, item: RateLimitItem, subject: Subject) -> int:
        stats = await self._windows.get_window_stats(item, *subject)
        return max(1, math.ceil(stats.reset_time - time.time()))


def _too_many(message: str, code: str, *, retry_after_s: int | None) -> ApiError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return ApiError(429, message, code=code, headers=headers)


async def _admitted(request: Request, identity: CurrentIdentity) -> Admission:
    limiter: RequestLimiter = request.app.state.limits
    admission = await limiter.admit(identity)
    request.state.admission = admission  # released by ReleaseAdmissions once the response is sent
    return admission


Admitted = Annotated[Admission, Depends(_admitted)]


class ReleaseAdmissions:
    """Releases a request's concurrency slots when its response has been sent in full, streamed or
    not, or when the client went away: the one place that sees the end of every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            admission = scope.get("state", {}).get("admission")
            if admission is not None:
                admission.release()
