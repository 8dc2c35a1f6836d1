"""Rolling out weights that a trainer broadcasts to the engines (SGLang's distributed weight sync).

The bytes go from the trainer's GPU straight to the engines' (NCCL, or gloo on CPU); the server
only coordinates, so it still alone decides what serves:

1. ``begin`` (``POST /admin/weights {"source": "distributed"}``): under the rollout lock, every
   healthy replica is drained and paused in retract mode (no request fails; new ones wait in the
   servers). The answer names the engines, their ranks in the group and a group name.
2. The trainer runs the protocol against the engines itself (``learner.weight_broadcast``):
   init the group, one ``update_weights_from_distributed`` per bucket with the weight version,
   destroy the group.
3. ``commit``: every replica must report the new weight version; the pool then serves it,
   replicas resume and the version row is promoted, as for a disk rollout. ``abort`` (the trainer
   failed), a replica on another version, or no word from the trainer within ``timeout_s``: every
   paused replica reloads the serving checkpoint from disk (it may hold part of the new weights)
   and resumes.

``model_path`` is the checkpoint with the same weights, exported by the trainer: the version row,
promote and rollback, and replicas that come back later load it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from server.engines.base import Engine, EngineError
from server.engines.sglang_client import SGLangClient
from server.errors import ApiError
from server.router.pool import EnginePool
from server.weights import WeightService

log = logging.getLogger(__name__)

__all__ = ["DistributedRollouts"]

LEAVE_TIMEOUT_S = 5.0


class _Aborted(Exception):
    pass


@dataclass(slots=True)
class _Session:
    id: str
    weight_version: str
    model_path: str
    timeout_s: float
    planned: asyncio.Future[dict[str, Any]] = field(default_factory=asyncio.Future)
    outcome: asyncio.Future[str | None] = field(default_factory=asyncio.Future)  # None: commit, else why not

    @property
    def group_name(self) -> str:
        return f"tandem-{self.id}"

    async def run(self, clients: list[SGLangClient]) -> None:
        """The pool's load step: publish the plan, then wait for the trainer's commit or abort."""
        ranks = await asyncio.gather(*(client.ranks() for client in clients))
        engines, offset = [], 1
        for client, count in zip(clients, ranks, strict=True):
            engines.append({"replica": client.replica, "url": client.url, "rank_offset": offset, "ranks": count})
            offset += count
        self.planned.set_result(
            {
                "session": self.id,
                "weight_version": self.weight_version,
                "group_name": self.group_name,
                "world_size": offset,
                "engines": engines,
                "timeout_s": self.timeout_s,
            }
        )
        try:
            reason = await asyncio.wait_for(asyncio.shield(self.outcome), self.timeout_s)
        except TimeoutError:
            reason = f"the trainer did not commit within {self.timeout_s:.0f} s"
        if reason is not None:
            # A trainer that died may have left the engines in the group; a live one destroys it itself.
            await asyncio.gather(*(_leave(c, self.group_name) for c in clients))
            raise _Aborted(reason)


class DistributedRollouts:
    """At most one open distributed rollout; see the module docstring."""

    def __init__(self, weights: WeightService, engine: Engine) -> None:
        self._weights = weights
        self._engine = engine
        self._open: _Session | None = None
        self._task: asyncio.Task[dict[str, Any]] | None = None

    async def begin(self, weight_version: str, model_path: str, timeout_s: float) -> dict[str, Any]:
        """Pause the replicas and say where the trainer sends the weights.

        Raises:
            ApiError: 400 when the engine is in-process (nothing to broadcast to) or the version
                belongs to another model; 409 while another distributed rollout is open.
        """
        pool = self._engine
        if not isinstance(pool, EnginePool):
            raise ApiError(
                400,
                "Distributed weight updates need engine servers (`tandem engine` or SGLang, --engine-url or "
                "--engine-config); this server runs its engine in-process.",
                param="source",
                code="unsupported_weight_source",
            )
        if self._open is not None:
            raise ApiError(
                409,
                f"Distributed rollout {self._open.id} ({self._open.weight_version}) is open; commit or abort it first.",
                code="weight_update_in_progress",
            )
        session = _Session(uuid.uuid4().hex[:16], weight_version, model_path, timeout_s)

        async def load() -> None:
            try:
                await pool.update_weights_together(model_path, weight_version, session.run)
            except _Aborted as exc:
                raise ApiError(
                    409, f"Aborted: {exc}; the replicas serve the previous weights again.", code="weight_update_aborted"
                ) from exc
            except EngineError as exc:
                raise ApiError(
                    400,
                    f"The broadcast of {weight_version} did not reach every replica ({exc}); they serve the "
                    "previous weights again.",
                    code="distributed_update_failed",
                ) from exc

        self._open = session
        self._task = task = asyncio.create_task(self._weights.roll_out_with(model_path, weight_version, load))
        task.add_done_callback(lambda done: self._closed(session, done))
        await asyncio.wait({session.planned, task}, return_when=asyncio.FIRST_COMPLETED)
        if not session.planned.done():  # refused or failed before the replicas were paused
            return await task  # raises its error; a task that ends without a plan always raised
        log.info("distributed rollout open", extra={"session": session.id, "weight_version": weight_version})
        return session.planned.result()

    async def commit(self, session_id: str) -> dict[str, Any]:
        """Wait until every replica serves the broadcast version; the rollout's result, as for disk.

        Raises:
            ApiError: 404 for a session that is not open; 400 when a replica did not end on the
                version; 409 when it was aborted meanwhile (the replicas serve the old weights).
        """
        return await asyncio.shield(self._finish(session_id, None))

    async def abort(self, session_id: str, reason: str) -> dict[str, Any]:
        """Put the replicas back on the serving weights; what serves then.

        Raises:
            ApiError: 404 for a session that is not open.
        """
        task = self._finish(session_id, reason)
        with contextlib.suppress(ApiError):  # the rollout's own error: aborted, as asked
            await asyncio.shield(task)
        return await self._weights.serving()

    async def close(self) -> None:
        """Abort an open rollout (the server is shutting down)."""
        if self._open is not None and self._task is not None:
            self._open.outcome.set_result("the server is shutting down")
            await asyncio.gather(self._task, return_exceptions=True)

    def _finish(self, session_id: str, reason: str | None) -> asyncio.Task[dict[str, Any]]:
        """Hand the trainer's word to the open rollout; its task, which ends once the replicas resumed."""
        session, task = self._open, self._task
        if session is None or task is None or session.id != session_id:
            raise ApiError(
                404,
                f"No distributed rollout {session_id} is open (it was finished, aborted or timed out).",
                code="no_such_rollout",
            )
        if not session.outcome.done():
            session.outcome.set_result(reason)
        return task

    def _closed(self, session: _Session, task: asyncio.Task[dict[str, Any]]) -> None:
        if self._open is session:
            self._open, self._task = None, None
        error = None if task.cancelled() else task.exception()
        if error is not None:
            log.warning(
                "distributed rollout ended without the new weights", extra={"session": session.id, "error": str(error)}
            )


async def _leave(client: SGLangClient, group_name: str) -> None:
    # Bounded: an engine still waiting for a broadcast that will never come answers only when the
    # group times out, and the replicas stay paused until this returns.
    with contextlib.suppress(EngineError, TimeoutError):
        await asyncio.wait_for(client.destroy_weights_update_group(group_name), LEAVE_TIMEOUT_S)
