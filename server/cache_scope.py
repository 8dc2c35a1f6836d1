"""Which requests may share an engine's cached prompt prefixes: one tenant's (and, with per-user
adapters, one adapter's), never two tenants'.

An engine reuses the KV of a cached prefix and reports how many prompt tokens it reused
(``usage.prompt_tokens_details.cached_tokens``; the answer is faster too). Shared across tenants,
that count tells one tenant, token by token, what another tenant's prompt said. So everything that
keys a cache or a route on an engine is namespaced by a per-tenant salt: the session key (replica
affinity and the local engine's per-session cache) starts with it, and the salt itself goes to the
engine as SGLang's ``cache_salt``, which partitions its radix cache. Within a tenant the cache stays
shared, so a common system prompt is prefilled once for all of that tenant's users.
"""

from __future__ import annotations

import hashlib


def cache_salt(tenant_id: str, adapter: str | None = None) -> str:
    """The prefix-cache namespace of a tenant (and adapter): opaque, so engine logs do not name tenants."""
    material = f"tandem-prefix-cache\x00{tenant_id}\x00{adapter or ''}"
    return hashlib.sha256(material.encode()).hexdigest()[:32]


def engine_session_key(salt: str, session_key: str | None) -> str | None:
    """The session key an engine sees: the client's key inside its tenant's namespace."""
    return f"{salt}:{session_key}" if session_key else None
