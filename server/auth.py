"""Bearer API keys per tenant, cached in memory so the hot path does not query the database."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from server.errors import ApiError
from storage.api_keys import count_active_api_keys, lookup_api_key
from storage.tenants import DEFAULT_TENANT_ID

KEY_TTL_S = 30.0
KEYLESS_TTL_S = 5.0
MAX_CACHED_KEYS = 10_000
DATABASE_DOWN = "The database is unavailable, so the API key cannot be checked; retry shortly."


@dataclass(frozen=True, slots=True)
class Identity:
    tenant_id: str
    api_key_id: str | None = None
    admin: bool = False


KEYLESS = Identity(DEFAULT_TENANT_ID)
ADMIN = Identity(DEFAULT_TENANT_ID, admin=True)


class Authenticator:
    """Resolves ``Authorization: Bearer`` keys; unknown keys are cached too, so guessing is cheap."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        *,
        admin_key: str | None,
        loopback: bool,
        internal_key: str | None = None,
    ) -> None:
        self._sessions = session_factory
        self._admin_digest = hashlib.sha256(admin_key.encode()).digest() if admin_key else None
        # `tandem serve`'s own learner child, when no admin key is configured: admin, yet it leaves the
        # keyless quick start keyless (an admin key would switch that off).
        self._internal_digest = hashlib.sha256(internal_key.encode()).digest() if internal_key else None
        self._loopback = loopback
        self._keys: dict[bytes, tuple[Identity | None, float]] = {}
        self._keyless: tuple[bool, float] = (False, 0.0)

    def _count_keys(self) -> int:
        with self._sessions() as session:
            return count_active_api_keys(session)

    def _lookup(self, plaintext: str) -> Identity | None:
        with self._sessions() as session:
            found = lookup_api_key(session, plaintext)
        return Identity(found.tenant_id, api_key_id=found.key_id) if found else None

    async def _is_keyless(self, now: float) -> bool:
        # Keyless use is only for a loopback quick start with no keys at all; recheck now and then
        # so that creating the first key switches it off without a restart.
        if not self._loopback or self._admin_digest is not None:
            return False
        keyless, expires = self._keyless
        if now < expires:
            return keyless
        try:
            keyless = await asyncio.to_thread(self._count_keys) == 0
        except DBAPIError as exc:
            raise ApiError(503, DATABASE_DOWN, code="database_unavailable") from exc
        self._keyless = (keyless, now + KEYLESS_TTL_S)
        return keyless

    def _is_internal(self, authorization: str | None) -> bool:
        if self._internal_digest is None:
            return False
        scheme, _, key = (authorization or "").partition(" ")
        digest = hashlib.sha256(key.strip().encode()).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(digest, self._internal_digest)

    def forget(self, key_hash: str | None = None) -> None:
        """Drop what is cached about a key (its stored SHA-256 hex) and about keyless use, so a key
        revoked or created through this gateway takes effect at once (other gateways: within KEY_TTL_S)."""
        if key_hash is not None:
            self._keys.pop(bytes.fromhex(key_hash), None)
        self._keyless = (False, 0.0)

    async def identify(self, authorization: str | None) -> Identity:
        now = time.monotonic()
        if self._is_internal(authorization):
            return ADMIN
        if await self._is_keyless(now):
            return KEYLESS
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise ApiError(
                401,
                "You didn't provide an API key. Pass it in the header 'Authorization: Bearer <key>'.",
                code="missing_api_key",
            )
        digest = hashlib.sha256(key.encode()).digest()
        if self._admin_digest is not None and hmac.compare_digest(digest, self._admin_digest):
            return ADMIN
        cached = self._keys.get(digest)
        if cached is not None and now < cached[1]:
            identity = cached[0]
        else:
            try:
                identity = await asyncio.to_thread(self._lookup, key)
            except DBAPIError as exc:
                raise ApiError(503, DATABASE_DOWN, code="database_unavailable") from exc
            if len(self._keys) >= MAX_CACHED_KEYS:
                self._keys.clear()
            self._keys[digest] = (identity, now + KEY_TTL_S)
        if identity is None:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return identity


async def current_identity(request: Request) -> Identity:
    authenticator: Authenticator = request.app.state.auth
    return await authenticator.identify(request.headers.get("authorization"))


CurrentIdentity = Annotated[Identity, Depends(current_identity)]
