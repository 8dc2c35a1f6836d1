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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from server.engines.base import AdapterRef
from storage import AdapterView, cohorts, list_adapters

log = logging.getLogger("tandem.adapters")

Scope = tuple[str, str, str]  # (tenant id, scope kind, scope)


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    id: str
    scope_kind: str
    scope: str
    base_version_id: str | None
    ref: AdapterRef


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
    ) -> None:
        self._sessions = sessions
        self._model = model
        self._serving_version = serving_version
        self._enabled = enabled
        self._disabled = frozenset(disabled_tenants)
        self._refresh_s = refresh_s
        self._serving: dict[Scope, ServedAdapter] = {}
        self._cohort_of: dict[tuple[str, str], str] = {}  # (tenant, user) -> cohort
        self._task: asyncio.Task[None] | None = None
        # One reread at a time: a reread begun before a change must not land after one begun after it.
        self._rereading = asyncio.Lock()

    @property
    def model(self) -> str:
        """The served model: the only one whose adapters this directory serves."""
        return self._model

    def resolve(self, tenant_id: str, user: str | None) -> ServedAdapter | None:
        """The adapter for one request of ``user`` (the request's ``user`` field) in ``tenant_id``."""
        if not self._enabled or tenant_id in self._disabled or not self._serving:
            return None
        candidates: list[Scope] = []
        if user:
            candidates.append((tenant_id, "user", user))
            cohort = self._cohort_of.get((tenant_id, user))
            if cohort is not None:
                candidates.append((tenant_id, "cohort", cohort))
        candidates.append((tenant_id, "tenant", tenant_id))
        base = self._serving_version()
        for scope in candidates:
            adapter = self._serving.get(scope)
            if adapter is not None and adapter.base_version_id in (None, base):
                return adapter
        return None

    def forget_user(self, tenant_id: str, user: str) -> None:
        """Stop serving ``user``'s adapter now (their data is being deleted), before any reread."""
        self._serving.pop((tenant_id, "user", user), None)
        self._cohort_of.pop((tenant_id, user), None)

    async def refresh(self) -> None:
        """Reread the serving adapters and cohorts (raises when the database cannot answer)."""
        async with self._rereading:
            serving, cohort_of = await asyncio.to_thread(self._read)
            self._serving, self._cohort_of = serving, cohort_of

    def _read(self) -> tuple[dict[Scope, ServedAdapter], dict[tuple[str, str], str]]:
        with self._sessions() as session:
            adapters = list_adapters(session, model=self._model, status="serving", limit=1_000_000)
            members = cohorts(session)
        serving = {(a.tenant_id, a.scope_kind, a.scope): _served(a) for a in adapters}
        cohort_of = {(tenant, user): cohort for (tenant, cohort), users in members.items() for user in users}
        return serving, cohort_of

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
