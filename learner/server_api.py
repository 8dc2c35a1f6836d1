"""The gateway's admin weights API: the only way a round changes what serves."""

from __future__ import annotations

from typing import Any

import httpx

from learner.round_config import RoundError

__all__ = ["ServerApi"]


class ServerApi:
    """``GET /admin/weights`` (what serves) and ``POST /admin/weights`` (roll a version out)."""

    def __init__(self, url: str, admin_key: str, timeout_s: float) -> None:
        self._url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {admin_key}"}
        self._timeout = timeout_s

    def serving(self) -> dict[str, Any]:
        """``{"model", "model_path", "version": {... "checkpoint_path"} | None}``."""
        return self._call("GET", None)

    def roll_out(self, model_path: str, weight_version: str) -> dict[str, Any]:
        """Returns once every replica serves ``weight_version``.

        Raises:
            RoundError: the server refused the checkpoint or could not be reached.
        """
        return self._call("POST", {"model_path": model_path, "weight_version": weight_version})

    def roll_out_delta(self, delta_path: str, weight_version: str, model_path: str | None = None) -> dict[str, Any]:
        """Like ``roll_out``, from a byte-level delta against the serving version (``server.weight_delta``);
        ``model_path``: the whole checkpoint it leads to, when this side exported it.

        Raises:
            RoundError: the server refused the delta (out of order, corrupt) or could not be reached.
        """
        body = {"source": "delta", "delta_path": delta_path, "weight_version": weight_version, "model_path": model_path}
        return self._call("POST", body)

    def begin_distributed(self, weight_version: str, model_path: str) -> dict[str, Any]:
        """Open a rollout the caller broadcasts (``learner.weight_broadcast.roll_out_by_broadcast``): the
        server pauses its replicas and answers ``{"session", "group_name", "world_size", "engines"}``.

        Raises:
            RoundError: refused (an in-process engine, another rollout open) or unreachable.
        """
        body = {"source": "distributed", "weight_version": weight_version, "model_path": model_path}
        return self._call("POST", body)

    def end_distributed(self, session: str, *, committed: bool, reason: str | None = None) -> dict[str, Any]:
        """Commit (every replica must serve the broadcast version) or abort (they reload the old one).

        Raises:
            RoundError: the commit was refused (the replicas serve the old weights) or unreachable.
        """
        path = f"/admin/weights/distributed/{session}/{'commit' if committed else 'abort'}"
        return self._call("POST", None if committed or not reason else {"reason": reason[:2000]}, path)

    def promote_adapter(self, adapter_id: str, reason: str | None = None) -> dict[str, Any]:
        """Serve the candidate adapter ``adapter_id`` for its scope from the next request on.

        Raises:
            RoundError: refused (not a candidate, unknown) or unreachable.
        """
        return self._call("POST", {"reason": reason} if reason else {}, f"/admin/adapters/{adapter_id}/promote")

    def start_base_canary(self, version_id: str, share: float, reason: str | None = None) -> dict[str, Any]:
        """Serve a candidate base version to ``share`` of every session, from part of the engine pool,
        until live ratings decide it. Raises RoundError as ``start_canary``."""
        return self._start_canary(f"/admin/models/{version_id}/canary", share, reason)

    def start_canary(self, adapter_id: str, share: float, reason: str | None = None) -> dict[str, Any]:
        """Serve the candidate adapter to ``share`` of its scope's sessions until live ratings decide it.

        Raises:
            RoundError: refused (not a candidate, unknown, no engine pool to split) or unreachable.
        """
        return self._start_canary(f"/admin/adapters/{adapter_id}/canary", share, reason)

    def _start_canary(self, path: str, share: float, reason: str | None) -> dict[str, Any]:
        return self._call("POST", {"share": share} | ({"reason": reason} if reason else {}), path, ok=201)

    def _call(
        self, method: str, body: dict[str, Any] | None, path: str = "/admin/weights", ok: int = 200
    ) -> dict[str, Any]:
        try:
            response = httpx.request(method, self._url + path, json=body, headers=self._headers, timeout=self._timeout)
        except httpx.HTTPError as exc:
            raise RoundError(f"cannot reach the server at {self._url}: {exc}") from exc
        if response.status_code != ok:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:500]
            raise RoundError(f"{method} {path} answered {response.status_code}: {message}")
        return response.json()
