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
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from server.engines.base import Engine, EngineError
from server.engines.local.weights import WeightLoadError
from server.errors import ApiError
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
        row = await asyncio.to_thread(self._serving_row, info.served_model_name)
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
        async with self._lock:
            before = self._engine.model_info()
            await asyncio.to_thread(self._check_version, before.served_model_name, weight_version)
            started = time.perf_counter()
            try:
                await self._engine.update_weights(model_path, weight_version)
            except (WeightLoadError, OSError) as exc:
                raise _refused(model_path, exc) from exc
            except EngineError as exc:
                if exc.status != 400:
                    raise
                raise _refused(model_path, exc) from exc
            swap_s = time.perf_counter() - started
            if self._on_swap is not None:
                self._on_swap(swap_s)
            try:
                await asyncio.to_thread(self._promote, before.served_model_name, model_path, weight_version)
            except DBAPIError as exc:
                await self._engine.update_weights(before.model_path, before.weight_version)
                raise ApiError(
                    503,
                    f"The database could not record {weight_version} as serving, so the server went back to "
                    f"{before.weight_version}; retry shortly.",
                    code="database_unavailable",
                ) from exc
            log.info("model version rolled out", extra={"weight_version": weight_version, "swap_s": swap_s})
            return {**await self.serving(), "previous_version": before.weight_version, "swap_s": swap_s}

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


def _refused(model_path: str, exc: Exception) -> ApiError:
    return ApiError(
        400,
        f"The engine refused the checkpoint {model_path} and keeps serving the current weights: {exc}",
        param="model_path",
        code="invalid_checkpoint",
    )


def _public(row: dict[str, Any]) -> dict[str, Any]:
    return {key: value.isoformat() if hasattr(value, "isoformat") else value for key, value in row.items()}
