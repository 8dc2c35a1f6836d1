"""Bearer API keys per tenant, cached in memory so that serving does not wait on the database.

A verified key is trusted for ``key_ttl_s``; after that the next request revalidates it in the
background and is served meanwhile (stale-while-revalidate), so a slow or absent database costs a
known key nothing. A key the database has not confirmed for ``key_stale_s`` must be checked again
before it serves: that is how long a revoked key can outlive a database outage. When the database
answers, a revocation takes effect within ``key_ttl_s`` (at once on the gateway that revoked it).

Lookups run on their own small thread pool with a deadline, so a hung database neither holds a
request for long nor takes the threads that tokenise prompts. Unknown keys are remembered for
``key_ttl_s`` in a bounded cache of their own (guessing cannot evict the known keys), and each
client address may fail authentication only so often per minute.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Annotated, TypeVar

from cachetools import TTLCache
from fastapi import Depends, Request
from limits import RateLimitItemPerMinute
from limits.aio.strategies import MovingWindowRateLimiter
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from server.database_errors import driver_message
from server.errors import ApiError
from storage.api_keys import count_active_api_keys, lookup_api_key
from storage.rate_limits import Limits, limits_of_key
from storage.tenants import DEFAULT_TENANT_ID, server_tools_of

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_KNOWN_KEYS = 100_000
MAX_UNKNOWN_KEYS = 10_000
LOOKUP_THREADS = 4
DATABASE_DOWN = "The database is unavailable, so the API key cannot be checked; retry shortly."


@dataclass(frozen=True, slots=True)
class AuthPolicy:
    key_ttl_s: float = 30.0
    key_stale_s: float = 900.0
    lookup_timeout_s: float = 2.0
    failures_per_minute: int = 30
    keyless_ttl_s: float = 5.0


@dataclass(frozen=True, slots=True)
class Identity:
    tenant_id: str
    api_key_id: str | None = None
    admin: bool = False
    # Stored request limits (server/rate_limits.py); None: the deployment's default (tenant) or none (key).
    tenant_limits: Limits | None = None
    key_limits: Limits | None = None
    server_tools: frozenset[str] = frozenset()  # the gateway tools enabled for the tenant (server/server_tools.py)
    keyless: bool = False  # the keyless quick start: no tenant key exists, so none is asked for


KEYLESS = Identity(DEFAULT_TENANT_ID, keyless=True)
ADMIN = Identity(DEFAULT_TENANT_ID, admin=True)


@dataclass(frozen=True, slots=True)
class _Verified:
    identity: Identity | None  # None: the database said there is no such active key
    checked_at: float


class _DatabaseUnanswered(Exception):
    """The database failed or did not answer within the lookup deadline."""


class Authenticator:
    """Resolves ``Authorization: Bearer`` keys; see the module docstring for the caching rules."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        *,
        admin_key: str | None,
        loopback: bool,
        internal_key: str | None = None,
        policy: AuthPolicy = AuthPolicy(),
        failure_limiter: MovingWindowRateLimiter,
    ) -> None:
        self._sessions = session_factory
        self._admin_digest = hashlib.sha256(admin_key.encode()).digest() if admin_key else None
        # `tandem serve`'s own learner child, when no admin key is configured: admin, yet it leaves the
        # keyless quick start keyless.
        self._internal_digest = hashlib.sha256(internal_key.encode()).digest() if internal_key else None
        self._loopback = loopback
        self._policy = policy
        self._known: TTLCache[bytes, _Verified] = TTLCache(MAX_KNOWN_KEYS, ttl=policy.key_stale_s)
        self._unknown: TTLCache[bytes, _Verified] = TTLCache(MAX_UNKNOWN_KEYS, ttl=policy.key_ttl_s)
        self._keyless: _Verified | None = None
        self._rechecked_at = 0.0  # entries checked before this are due for a recheck (recheck_all)
        self._refreshing: dict[bytes | None, asyncio.Task[None]] = {}
        self._failures = failure_limiter
        self._failure_limit = RateLimitItemPerMinute(policy.failures_per_minute)
        self._executor = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="auth-lookup")

    def close(self) -> None:
        for task in self._refreshing.values():
            task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- the database, behind a deadline ----

    def _lookup(self, plaintext: str) -> Identity | None:
        with self._sessions() as session:
            found = lookup_api_key(session, plaintext)
            if found is None:
                return None
            tenant_limits, key_limits = limits_of_key(session, found.tenant_id, found.key_id)
            tools = server_tools_of(session, found.tenant_id)
        return Identity(
            found.tenant_id, found.key_id, tenant_limits=tenant_limits, key_limits=key_limits, server_tools=tools
        )

    async def _ask(self, query: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(
                loop.run_in_executor(self._executor, query), timeout=self._policy.lookup_timeout_s
            )
        except TimeoutError as exc:
            raise _DatabaseUnanswered(f"no answer within {self._policy.lookup_timeout_s} s") from exc
        except DBAPIError as exc:
            raise _DatabaseUnanswered(driver_message(exc)) from exc

    def _revalidate(self, slot: bytes | None, query: Callable[[], _Verified]) -> None:
        """Refresh a stale entry in the background (one refresh per entry at a time)."""
        if slot in self._refreshing:
            return

        async def refresh() -> None:
            try:
                self._store(slot, await self._ask(query))
            except _DatabaseUnanswered as exc:
                logger.warning("could not revalidate an API key; serving the cached answer", extra={"error": str(exc)})
            finally:
                self._refreshing.pop(slot, None)

        self._refreshing[slot] = asyncio.create_task(refresh())

    def _store(self, slot: bytes | None, verified: _Verified) -> None:
        if slot is None:
            self._keyless = verified
        elif verified.identity is None:
            self._known.pop(slot, None)
            self._unknown[slot] = verified
        else:
            self._unknown.pop(slot, None)
            self._known[slot] = verified

    # ---- keyless quick start ----

    def _keyless_query(self) -> _Verified:
        with self._sessions() as session:
            if count_active_api_keys(session) > 0:
                return _Verified(None, time.monotonic())
            tools = server_tools_of(session, DEFAULT_TENANT_ID)
        return _Verified(replace(KEYLESS, server_tools=tools), time.monotonic())

    async def _keyless_identity(self) -> Identity | None:
        # Keyless use is only for a loopback server with no tenant keys at all (an admin key may be
        # set: it guards the admin API only); recheck now and then so that creating the first key
        # switches it off without a restart.
        if not self._loopback:
            return None
        known = self._keyless
        if known is None:
            try:
                known = await self._ask(self._keyless_query)
            except _DatabaseUnanswered as exc:
                raise _unavailable(exc) from exc
            self._keyless = known
        elif time.monotonic() - known.checked_at > self._policy.keyless_ttl_s:
            self._revalidate(None, self._keyless_query)
        return known.identity

    # ---- keys ----

    def forget(self, key_hash: str | None = None) -> None:
        """Drop what is cached about a key (its stored SHA-256 hex) and about keyless use, so a key
        revoked or created through this gateway takes effect at once (other gateways: within key_ttl_s)."""
        if key_hash is not None:
            digest = bytes.fromhex(key_hash)
            self._known.pop(digest, None)
            self._unknown.pop(digest, None)
        self._keyless = None

    def recheck_all(self) -> None:
        """Revalidate every known key on its next request, serving it meanwhile (limits changed, say)."""
        self._rechecked_at = time.monotonic()

    async def identify(self, authorization: str | None, client: str = "") -> Identity:
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        bearer = scheme.lower() == "bearer" and bool(key)
        digest = hashlib.sha256(key.encode()).digest()
        for admin_digest in (self._internal_digest, self._admin_digest):
            if bearer and admin_digest is not None and hmac.compare_digest(digest, admin_digest):
                return ADMIN
        if (keyless := await self._keyless_identity()) is not None:
            return keyless
        if not bearer:
            raise ApiError(
                401,
                "You didn't provide an API key. Pass it in the header 'Authorization: Bearer <key>'.",
                code="missing_api_key",
            )
        identity = await self._key_identity(digest, key, client)
        if identity is None:
            await self._failures.hit(self._failure_limit, "auth-failure", client)
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return identity

    async def _key_identity(self, digest: bytes, key: str, client: str) -> Identity | None:
        def query() -> _Verified:
            return _Verified(self._lookup(key), time.monotonic())

        known = self._known.get(digest)
        if known is not None and known.checked_at < self._rechecked_at:
            # Changed through this gateway (limits, say): take the change now if the database answers.
            try:
                verified = await self._ask(query)
            except _DatabaseUnanswered:
                return known.identity
            self._store(digest, verified)
            return verified.identity
        if known is not None:
            if known.checked_at < time.monotonic() - self._policy.key_ttl_s:
                self._revalidate(digest, query)
            return known.identity
        if digest in self._unknown:
            return None
        if not await self._failures.test(self._failure_limit, "auth-failure", client):
            raise ApiError(
                429,
                "Too many failed authentications from this address; wait a minute.",
                code="too_many_failed_authentications",
                headers={"Retry-After": "60"},
            )
        try:
            verified = await self._ask(query)
        except _DatabaseUnanswered as exc:
            raise _unavailable(exc) from exc
        self._store(digest, verified)
        return verified.identity


def _unavailable(cause: Exception) -> ApiError:
    logger.warning("API key lookup failed", extra={"error": str(cause)})
    return ApiError(503, DATABASE_DOWN, code="database_unavailable", headers={"Retry-After": "2"})


async def current_identity(request: Request) -> Identity:
    authenticator: Authenticator = request.app.state.auth
    client = request.client.host if request.client else ""
    return await authenticator.identify(request.headers.get("authorization"), client)


CurrentIdentity = Annotated[Identity, Depends(current_identity)]
