"""Which LoRA adapter serves whom: the most specific serving adapter of a request's user, else
their cohort's, else their tenant's, else none (the base alone).

The gateway keeps the answer in memory, so serving never waits on the database for it (nor stops
when the database does): it is read at start-up, again after every change this gateway makes
through the admin API (promotion, rollback, reset, cohorts, a user's deletion), and every
``refresh_s`` for changes made through another gateway. A swap is a new entry: requests already
running keep the adapter they started with, the next request gets the new one.

An adapter serves only over the base it was trained on (``base_version_id``, the weight version the
server reported; None: any base, for adapters an operator registered): when the base changes, the
scopes fall back to the base alone until a personal round trains them again, continuing from their
stored adapter weights (docs/adapters.md).

A scope with a running canary splits its traffic: a sticky share of its sessions (by the session
key, else the user; a request with neither is split at random) gets the candidate, the rest what
served before; both sides are labelled with the canary, so their ratings can be compared.

A running base canary (a candidate model version on some replicas of the engine pool) splits every
request the same way, and takes precedence over adapter canaries: its canary side is served the base
candidate with the adapters trained over it (what promotion would serve), its control side the pool's
weights with theirs. It routes only while the engine holds that split (``split_version``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from server.engines.base import AdapterRef
from storage import AdapterView, cohorts, get_adapter, list_adapters
from storage.canaries import list_canaries

log = logging.getLogger("tandem.adapters")

Scope = tuple[str, str, str]  # (tenant id, scope kind, scope)


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    id: str
    scope_kind: str
    scope: str
    base_version_id: str | None
    ref: AdapterRef


@dataclass(frozen=True, slots=True)
class RunningCanary:
    id: str
    share: float
    candidate: ServedAdapter | None = None  # an adapter canary's candidate
    weight_version: str | None = None  # a base canary's candidate version

    def takes(self, sticky_key: str | None) -> bool:
        """Whether this request falls in the canary's share (the same answer for a key every time)."""
        if sticky_key is None:
            return random.random() < self.share
        digest = hashlib.blake2b(f"{self.id}\0{sticky_key}".encode(), digest_size=8).digest()
        return int.from_bytes(digest) / 2**64 < self.share


@dataclass(frozen=True, slots=True)
class Route:
    """What serves one request: an adapter (None: the base alone) and, inside a canary's split, which side."""

    adapter: ServedAdapter | None = None
    canary_id: str | None = None
    arm: Literal["canary", "control"] | None = None
    weight_version: str | None = None  # the base weights to answer with (None: what serves)


BASE_ALONE = Route()


def _served(adapter: AdapterView) -> ServedAdapter:
    scope = f"{adapter.tenant_id}/{adapter.scope_kind}/{adapter.scope}"
    ref = AdapterRef(adapter.id, adapter.checkpoint_path, scope)
    return ServedAdapter(adapter.id, adapter.scope_kind, adapter.scope, adapter.base_version_id, ref)


class AdapterDirectory:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        model: str,
        serving_version: Callable[[], str],
        *,
        enabled: bool = True,
        disabled_tenants: Iterable[str] = (),
        refresh_s: float = 5.0,
        split_version: Callable[[], str | None] = lambda: None,
    ) -> None:
        """``split_version``: the base candidate a split engine pool serves on some replicas (None: not split)."""
        self._sessions = sessions
        self._model = model
        self._serving_version = serving_version
        self._split_version = split_version
        self._base_canary: RunningCanary | None = None
        self._enabled = enabled
        self._disabled = frozenset(disabled_tenants)
        self._refresh_s = refresh_s
        self._serving: dict[Scope, ServedAdapter] = {}
        self._cohort_of: dict[tuple[str, str], str] = {}  # (tenant, user) -> cohort
        self._canaries: dict[Scope, RunningCanary] = {}
        self._task: asyncio.Task[None] | None = None
        # One reread at a time: a reread begun before a change must not land after one begun after it.
        self._rereading = asyncio.Lock()

    @property
    def model(self) -> str:
        """The served model: the only one whose adapters this directory serves."""
        return self._model

    def resolve(self, tenant_id: str, user: str | None, sticky_key: str | None = None) -> Route:
        """What serves one request of ``user`` (the request's ``user`` field) in ``tenant_id``;
        ``sticky_key`` (the session, else the user) keeps a session on one side of a canary."""
        base_canary = self._base_canary
        split_version = self._split_version()
        if base_canary is not None and split_version is not None and base_canary.weight_version == split_version:
            if base_canary.takes(sticky_key):
                adapter = self._adapter(tenant_id, user, split_version)
                return Route(adapter, base_canary.id, "canary", split_version)
            return Route(self._adapter(tenant_id, user, self._serving_version()), base_canary.id, "control")
        if not self._serves(tenant_id) or not (self._serving or self._canaries):
            return BASE_ALONE
        base = self._serving_version()
        split: RunningCanary | None = None
        for scope in self._scopes(tenant_id, user):
            canary = self._canaries.get(scope)
            candidate = canary.candidate if canary is not None and split is None else None
            if canary is not None and candidate is not None and candidate.base_version_id in (None, base):
                if canary.takes(sticky_key):
                    return Route(candidate, canary.id, "canary")
                split = canary  # the control: what would serve without the canary
            adapter = self._serving.get(scope)
            if adapter is not None and adapter.base_version_id in (None, base):
                return Route(adapter, *_control(split))
        return Route(None, *_control(split))

    def _serves(self, tenant_id: str) -> bool:
        return self._enabled and tenant_id not in self._disabled

    def _scopes(self, tenant_id: str, user: str | None) -> list[Scope]:
        """The scopes a request may be served by, most specific first."""
        scopes: list[Scope] = []
        if user:
            scopes.append((tenant_id, "user", user))
            cohort = self._cohort_of.get((tenant_id, user))
            if cohort is not None:
                scopes.append((tenant_id, "cohort", cohort))
        scopes.append((tenant_id, "tenant", tenant_id))
        return scopes

    def _adapter(self, tenant_id: str, user: str | None, base: str) -> ServedAdapter | None:
        """The most specific serving adapter trained over ``base`` (no adapter canaries)."""
        if not self._serves(tenant_id):
            return None
        for scope in self._scopes(tenant_id, user):
            adapter = self._serving.get(scope)
            if adapter is not None and adapter.base_version_id in (None, base):
                return adapter
        return None

    def forget_user(self, tenant_id: str, user: str) -> None:
        """Stop serving ``user``'s adapter now (their data is being deleted), before any reread."""
        self._serving.pop((tenant_id, "user", user), None)
        self._canaries.pop((tenant_id, "user", user), None)
        self._cohort_of.pop((tenant_id, user), None)

    async def refresh(self) -> None:
        """Reread the serving adapters and cohorts (raises when the database cannot answer)."""
        async with self._rereading:
            read = await asyncio.to_thread(self._read)
            self._serving, self._cohort_of, self._canaries, self._base_canary = read

    def _read(
        self,
    ) -> tuple[
        dict[Scope, ServedAdapter], dict[tuple[str, str], str], dict[Scope, RunningCanary], RunningCanary | None
    ]:
        canaries: dict[Scope, RunningCanary] = {}
        base_canary: RunningCanary | None = None
        with self._sessions() as session:
            adapters = list_adapters(session, model=self._model, status="serving", limit=1_000_000)
            members = cohorts(session)
            for c in list_canaries(session, model=self._model, status="running", limit=1_000_000):
                if c.tenant_id is None:  # the base's
                    base_canary = RunningCanary(c.id, c.share, weight_version=c.candidate_id)
                else:
                    candidate = _served(get_adapter(session, adapter_id=c.candidate_id))
                    canaries[(c.tenant_id, c.scope_kind, c.scope)] = RunningCanary(c.id, c.share, candidate)
        serving = {(a.tenant_id, a.scope_kind, a.scope): _served(a) for a in adapters}
        cohort_of = {(tenant, user): cohort for (tenant, cohort), users in members.items() for user in users}
        return serving, cohort_of, canaries, base_canary

    async def start(self) -> None:
        """Read once (a database that is down leaves the base serving everyone) and keep rereading."""
        await self._refresh_logged()
        self._task = asyncio.create_task(self._keep_fresh())

    async def _keep_fresh(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            await self._refresh_logged()

    async def _refresh_logged(self) -> None:
        try:
            await self.refresh()
        except SQLAlchemyError as exc:  # serving goes on with what it knew
            log.warning("could not reread the serving adapters: %s", str(exc).splitlines()[0])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def _control(split: RunningCanary | None) -> tuple[str | None, Literal["control"] | None]:
    return (split.id, "control") if split is not None else (None, None)
