"""Rolling out model versions: the engine swaps weights, then the version row is promoted.

The server is the single owner of serving state: learners export a checkpoint, record a candidate
version and ask here (``POST /admin/weights``); only this service talks to the engine to change
weights. A checkpoint the engine refuses leaves it serving the old weights and the database as it
was. When the engine took the new weights but the promotion cannot be written, the engine is put
back on the old ones, so the database and the engine never disagree about what serves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from server.database_errors import database_call, database_error
from server.engines.base import Engine, EngineError, ModelInfo
from server.engines.local.weights import WeightLoadError
from server.errors import ApiError
from server.router.pool import EnginePool
from server.weight_delta import DeltaError, OutOfOrderDelta, WeightDelta, materialise
from storage.learning_errors import NotFoundError
from storage.model_versions import get_version, record_model_version, serving_version, set_version_status

log = logging.getLogger(__name__)

__all__ = ["WeightService"]


class WeightService:
    """What serves now, and rolling out another version (one rollout at a time)."""

    def __init__(
        self, engine: Engine, sessions: sessionmaker[Session], on_swap: Callable[[float], None] | None = None
    ) -> None:
        """``on_swap``: called with the seconds each successful swap took (the /metrics histogram)."""
        self._engine = engine
        self._sessions = sessions
        self._on_swap = on_swap
        self._lock = asyncio.Lock()

    async def serving(self) -> dict[str, Any]:
        """The engine's model and weight version, with its version row when one is recorded."""
        info = self._engine.model_info()
        row = await database_call(self._serving_row, info.served_model_name)
        return {
            "model": info.served_model_name,
            "weight_version": info.weight_version,
            "model_path": info.model_path,
            "version": row if row is not None and row["id"] == info.weight_version else None,
        }

    async def roll_out(self, model_path: str, weight_version: str) -> dict[str, Any]:
        """Load ``model_path`` as ``weight_version`` on every replica, then promote its version row.

        Raises:
            ApiError: 400 when the checkpoint is refused or the version belongs to another model
                (serving unchanged); 503 when the database cannot record the promotion (the engine
                is rolled back to the old weights).
        """
        return await self.roll_out_with(
            model_path, weight_version, partial(self._engine.update_weights, model_path, weight_version)
        )

    async def roll_out_with(
        self, model_path: str, weight_version: str, load: Callable[[], Awaitable[None]]
    ) -> dict[str, Any]:
        """``roll_out`` with the engine's change made by ``load`` (``server.distributed_rollout``: a
        trainer's broadcast); ``model_path`` holds the same weights for the version row and rollbacks."""
        async with self._lock:
            before = self._engine.model_info()
            await database_call(self._check_version, before.served_model_name, weight_version)
            return await self._swap(before, model_path, weight_version, load, _Refusal(model_path, "model_path"))

    async def roll_out_delta(
        self, delta_path: str, weight_version: str | None = None, model_path: str | None = None
    ) -> dict[str, Any]:
        """Apply the byte-level delta at ``delta_path`` (``server.weight_delta``) to the serving version.

        The whole checkpoint it leads to comes first: ``model_path`` when the caller has it (the
        learner's own export), else materialised next to the delta (``<delta>.full``); either way every
        tensor is checked against the delta's checksums before any engine is touched. SGLang replicas
        (no delta API) load it from disk, and the version row and any later rollback name it. Replicas
        that apply deltas (the local engine, `tandem engine`) get the delta and check it against their
        live weights.

        Raises:
            ApiError: 409 when the delta's base is not the serving version (out of order); 400 for
                an unreadable or corrupt delta, or one the engine refuses (serving unchanged); 503
                as for ``roll_out``.
        """
        async with self._lock:
            refusal = _Refusal(delta_path, "delta_path")
            before = self._engine.model_info()
            try:
                delta = await asyncio.to_thread(WeightDelta.open, Path(delta_path))
                version = weight_version or delta.target_version
                if version != delta.target_version:
                    raise DeltaError(f"it leads to {delta.target_version!r}, not {version!r}")
                delta.check_base(before.weight_version)
                await database_call(self._check_version, before.served_model_name, version)
                full = Path(model_path) if model_path else Path(delta_path).with_name(Path(delta_path).name + ".full")
                model_path = str(await asyncio.to_thread(materialise, delta, Path(before.model_path), full))
            except (DeltaError, OSError) as exc:
                raise refusal.error(exc) from exc
            load = partial(self._engine.update_weights_from_delta, delta, model_path, version)
            return await self._swap(before, model_path, version, load, refusal)

    async def _swap(
        self,
        before: ModelInfo,
        model_path: str,
        weight_version: str,
        load: Callable[[], Awaitable[None]],
        refusal: _Refusal,
    ) -> dict[str, Any]:
        """Run ``load`` (the engine changes weights), then promote; see ``roll_out``."""
        started = time.perf_counter()
        try:
            await load()
        except (WeightLoadError, DeltaError, OSError) as exc:
            raise refusal.error(exc) from exc
        except EngineError as exc:
            if exc.status != 400:
                raise
            raise refusal.error(exc) from exc
        swap_s = time.perf_counter() - started
        if self._on_swap is not None:
            self._on_swap(swap_s)
        try:
            await asyncio.to_thread(self._promote, before.served_model_name, model_path, weight_version)
        except DBAPIError as exc:
            await self._engine.update_weights(before.model_path, before.weight_version)
            message = (
                f"The database could not record {weight_version} as serving, so the server went back to "
                f"{before.weight_version}; retry shortly."
            )
            raise database_error(exc, message) from exc
        log.info("model version rolled out", extra={"weight_version": weight_version, "swap_s": swap_s})
        return {**await self.serving(), "previous_version": before.weight_version, "swap_s": swap_s}

    # ---- a base canary: the candidate on part of the pool ----

    def split_version(self) -> str | None:
        """The base candidate some of the engine's replicas serve (a base canary); None: not split."""
        split = self._engine.canary if isinstance(self._engine, EnginePool) else None
        return split.weight_version if split is not None else None

    async def start_split(self, model_path: str, weight_version: str, share: float) -> int:
        """Load ``weight_version`` onto ``share`` of the pool's replicas (at least one, never all);
        how many. A split already running is rolled back first.

        Raises:
            ApiError: 409 ``canary_unsupported`` for an engine that is not a pool of two or more
                replicas in rotation; 400 when the checkpoint is refused (serving unchanged).
        """
        async with self._lock:
            pool = self._pool()
            replicas = max(1, round(share * len(pool.replicas)))
            try:
                return len((await pool.start_canary(model_path, weight_version, replicas)).replicas)
            except (EngineError, OSError) as exc:
                if isinstance(exc, EngineError) and exc.status == 409:
                    raise ApiError(409, f"Cannot start a base canary: {exc}.", code="canary_unsupported") from exc
                raise _Refusal(model_path, "model_path").error(exc) from exc

    async def end_split(self, promote: bool) -> dict[str, Any] | None:
        """Promoted: the candidate onto the rest of the pool and its version row ``serving`` (as a
        rollout: ``roll_out``'s answer). Rolled back: the pool's weights back onto its replicas.

        Raises:
            ApiError: 409 ``canary_state`` when the pool is not split; as ``roll_out`` on promotion.
        """
        async with self._lock:
            pool = self._pool()
            split = pool.canary
            if split is None:
                raise ApiError(409, "No base canary splits the engine pool.", code="canary_state")
            if not promote:
                await pool.end_canary(False)
                return None
            before = self._engine.model_info()

            async def load() -> None:
                await pool.end_canary(True)

            return await self._swap(
                before, split.model_path, split.weight_version, load, _Refusal(split.model_path, "model_path")
            )

    def check_splittable(self) -> None:
        """Raise ApiError 409 ``canary_unsupported`` unless a base canary could start now."""
        healthy = sum(r.healthy for r in self._pool().replicas.values())
        if healthy < 2:
            raise ApiError(
                409,
                f"A base canary needs two or more engine replicas in rotation, and {healthy} is.",
                code="canary_unsupported",
            )

    def _pool(self) -> EnginePool:
        if not isinstance(self._engine, EnginePool):
            raise ApiError(
                409,
                "A base canary needs an engine pool of two or more replicas (TANDEM_ENGINE=sglang with several "
                "TANDEM_ENGINE_URLS); this server has one engine: roll the version out instead.",
                code="canary_unsupported",
            )
        return self._engine

    def _serving_row(self, model: str) -> dict[str, Any] | None:
        with self._sessions() as session:
            row = serving_version(session, model=model)
        return None if row is None else _public(asdict(row))

    def _check_version(self, model: str, version_id: str) -> None:
        with self._sessions() as session:
            try:
                row = get_version(session, version_id=version_id)
            except NotFoundError:
                return
        if row.model != model:
            raise ApiError(
                400,
                f"Model version {version_id} belongs to {row.model}, but this server serves {model}.",
                param="weight_version",
                code="wrong_model",
            )

    def _promote(self, model: str, model_path: str, version_id: str) -> None:
        with self._sessions.begin() as session:
            try:
                get_version(session, version_id=version_id)
            except NotFoundError:  # rolled out by hand, not by a learner: record it now
                record_model_version(session, version_id=version_id, model=model, checkpoint_path=model_path)
            set_version_status(session, version_id=version_id, status="serving")


@dataclass(frozen=True, slots=True)
class _Refusal:
    """How a refused weight source is reported: which request field named it."""

    path: str
    param: str

    def error(self, exc: Exception) -> ApiError:
        if isinstance(exc, OutOfOrderDelta):
            return ApiError(409, f"{exc}; serving is unchanged.", param=self.param, code="out_of_order_delta")
        what, code = ("checkpoint", "invalid_checkpoint") if self.param == "model_path" else ("delta", "invalid_delta")
        return ApiError(
            400,
            f"The {what} {self.path} was refused and the server keeps serving the current weights: {exc}",
            param=self.param,
            code=code,
        )


def _public(row: dict[str, Any]) -> dict[str, Any]:
    return {key: value.isoformat() if hasattr(value, "isoformat") else value for key, value in row.items()}
