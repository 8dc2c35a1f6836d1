"""Trainer side of SGLang's distributed weight sync: broadcast named tensors from rank 0 to engines.

The protocol is SGLang 0.5.23's, which `tandem engine` answers too:

1. ``init_weights_update_group`` on every engine (rank_offset: 1 + the ranks of the engines before
   it; world_size: 1 + all engine ranks) while this process joins as rank 0. The rendezvous needs
   every member at once, so the HTTP calls are in flight while we join.
2. ``begin_weight_update`` (0.5.23 refuses distributed updates outside begin/end).
3. Per bucket (at most ``bucket_bytes``, a larger tensor alone): ``update_weights_from_distributed``
   with the bucket's names, dtypes, shapes and the weight version, to every engine, while rank 0
   broadcasts the tensors in the same order. An engine answers once it received and loaded them.
4. ``end_weight_update``; ``destroy_weights_update_group`` on the engines and here.

Engines receive tensors in the dtype sent: cast before sending to what the engines serve (or to a
narrower dtype they convert from exactly, e.g. bfloat16 into a float32 engine, to halve the bytes).

Pausing generation is not done here: against the tandem server, ``roll_out_by_broadcast`` has the
server pause its replicas (retract mode, so no request fails), hand out the engines and ranks, and
resume and promote the version once the engines report it. Sent straight to an unpaused SGLang
server, each bucket waits for its running requests to drain, as a disk update does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import httpx
import torch

from learner.round_config import RoundError
from learner.server_api import ServerApi
from tandem.weight_update_group import (
    BACKENDS,
    broadcast_tensors,
    close_update_group,
    dtype_name,
    group_name_taken,
    open_update_group,
)

__all__ = [
    "BroadcastConfig",
    "BroadcastError",
    "BroadcastStats",
    "EngineTarget",
    "WeightBroadcaster",
    "broadcast_weights",
    "plan_buckets",
    "roll_out_by_broadcast",
]

NamedTensors = Sequence[tuple[str, torch.Tensor]]


class BroadcastError(RuntimeError):
    """An engine refused or failed a step; the message names the engine and says why."""


@dataclass(frozen=True, slots=True)
class EngineTarget:
    """An engine server (SGLang or `tandem engine`) and how many ranks (GPUs) it joins the group with."""

    url: str
    ranks: int = 1

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError("an engine joins with at least one rank")


@dataclass(frozen=True, slots=True)
class BroadcastConfig:
    """``backend``: nccl for GPU tensors, gloo for CPU ones. ``master_port`` 0: a free port is picked
    here (the engines connect to ``master_address``, so it must be this host as they reach it)."""

    backend: Literal["nccl", "gloo"] = "nccl"
    master_address: str = "127.0.0.1"
    master_port: int = 0
    group_name: str = "weight_update_group"
    bucket_bytes: int = 512 << 20
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}")
        if not 0 <= self.master_port < 65536:
            raise ValueError("master_port must be in [0, 65536)")
        if self.bucket_bytes < 1:
            raise ValueError("bucket_bytes must be positive")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if not self.group_name:
            raise ValueError("group_name must not be empty")


@dataclass(frozen=True, slots=True)
class BroadcastStats:
    """One ``send``: ``transfer_s`` runs from the first bucket's request to the last engine's answer."""

    weight_version: str
    tensors: int
    bytes: int
    buckets: int
    transfer_s: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else 0.0


def plan_buckets(named: NamedTensors, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most ``bucket_bytes`` (a larger tensor goes alone), order kept."""
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += nbytes
    return buckets


class WeightBroadcaster:
    """The group with a set of engines: ``connect``, any number of ``send``, ``close`` (or use ``with``)."""

    def __init__(self, engines: Sequence[EngineTarget], config: BroadcastConfig | None = None) -> None:
        if not engines:
            raise ValueError("broadcasting needs at least one engine")
        self.engines = list(engines)
        self.config = config or BroadcastConfig()
        self.world_size = 1 + sum(e.ranks for e in self.engines)
        self._http = httpx.Client(timeout=self.config.timeout_s)
        self._threads = concurrent.futures.ThreadPoolExecutor(len(self.engines) + 1, thread_name_prefix="broadcast")
        self._group: Any = None
        self._opening: concurrent.futures.Future[Any] | None = None  # our join, until close
        self._joined = False  # engines were asked to join: they must be asked to leave
        self._broken = False

    def __enter__(self) -> WeightBroadcaster:
        self.connect()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def connect(self) -> None:
        """Create the group: every engine joins over HTTP while this process joins as rank 0.

        Raises:
            BroadcastError: an engine refused to join, or the rendezvous timed out.
        """
        config = self.config
        if group_name_taken(config.group_name):
            # Checked before the engines are asked: they would wait in the rendezvous for us until
            # their timeout (an SGLang server stops serving meanwhile).
            raise BroadcastError(f"this process already has a group {config.group_name!r} open")
        port = config.master_port or _free_port()
        offsets = [1 + sum(e.ranks for e in self.engines[:i]) for i in range(len(self.engines))]
        self._joined = True
        joins = [
            self._post(
                engine,
                "/init_weights_update_group",
                {
                    "master_address": config.master_address,
                    "master_port": port,
                    "rank_offset": offset,
                    "world_size": self.world_size,
                    "group_name": config.group_name,
                    "backend": config.backend,
                },
            )
            for engine, offset in zip(self.engines, offsets, strict=True)
        ]
        self._opening = own = self._threads.submit(
            open_update_group,
            backend=config.backend,
            master_address=config.master_address,
            master_port=port,
            rank=0,
            world_size=self.world_size,
            group_name=config.group_name,
            timeout_s=config.timeout_s,
        )
        try:
            self._wait([own, *joins], "init_weights_update_group")
        except BroadcastError:
            self._broken = True  # our side may still be waiting in the rendezvous: never reuse it
            raise
        self._group = own.result()

    def send(self, named: NamedTensors, weight_version: str) -> BroadcastStats:
        """Broadcast ``named`` bucket by bucket; every engine serves ``weight_version`` afterwards.

        Raises:
            BroadcastError: an engine refused a bucket (a name, dtype or shape that does not fit its
                model: it keeps the buckets loaded before) or failed; the message says which.
        """
        if self._group is None or self._broken:
            raise BroadcastError("the group is not connected (or a failed step left it unusable)")
        names = [name for name, _ in named]
        if len(set(names)) != len(names):
            raise ValueError("a tensor name appears twice")
        tensors = [(name, tensor.detach().contiguous()) for name, tensor in named]
        buckets = plan_buckets(tensors, self.config.bucket_bytes)
        self._all("/begin_weight_update", {})
        started = time.perf_counter()
        try:
            for bucket in buckets:
                self._send_bucket(bucket, weight_version)
        except BroadcastError:
            if not self._broken:  # close SGLang's update session, or its next begin is refused
                with contextlib.suppress(BroadcastError):
                    self._all("/end_weight_update", {})
            raise
        transfer_s = time.perf_counter() - started
        self._all("/end_weight_update", {})
        return BroadcastStats(
            weight_version=weight_version,
            tensors=len(tensors),
            bytes=sum(t.numel() * t.element_size() for _, t in tensors),
            buckets=len(buckets),
            transfer_s=transfer_s,
        )

    def close(self) -> None:
        """Destroy the group on the engines and here; after a failure, without waiting for the engines."""
        try:
            if self._joined:
                self._joined = False
                body = {"group_name": self.config.group_name}
                destroys = [self._post(engine, "/destroy_weights_update_group", body) for engine in self.engines]
                if self._group is not None and not self._broken:
                    close_update_group(self._group)
                    self._wait(destroys, "destroy_weights_update_group")
                elif self._opening is not None:
                    # Leave a broken group too (once our join ends, if it still waits): torch keeps
                    # its name taken in this process until then, and the next connect needs it.
                    self._opening.add_done_callback(_abandon)
                self._group = None
        finally:
            self._http.close()
            self._threads.shutdown(wait=False, cancel_futures=True)

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], weight_version: str) -> None:
        body = {
            "names": [name for name, _ in bucket],
            "dtypes": [dtype_name(t.dtype) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": self.config.group_name,
            "weight_version": weight_version,
            "flush_cache": True,
        }
        answers = [self._post(engine, "/update_weights_from_distributed", body) for engine in self.engines]
        sent = self._threads.submit(broadcast_tensors, self._group, [t for _, t in bucket])
        try:
            self._wait([sent, *answers], "update_weights_from_distributed")
        except BroadcastError as failed:
            # An engine that refused after receiving completed the broadcast; one that refused the
            # request itself never joined it, and our send may be stuck until the group times out.
            concurrent.futures.wait([sent, *answers], timeout=1.0)
            self._broken = not sent.done() or sent.exception() is not None
            # An engine's refusal says why; our send to an engine that left fails only with a closed
            # connection, often before the refusal arrives.
            for answer in answers:
                refusal = answer.exception() if answer.done() else None
                if isinstance(refusal, BroadcastError) and refusal is not failed:
                    raise refusal from None
            raise

    def _all(self, path: str, body: dict[str, Any]) -> None:
        self._wait([self._post(engine, path, body) for engine in self.engines], path.lstrip("/"))

    def _post(self, engine: EngineTarget, path: str, body: dict[str, Any]) -> concurrent.futures.Future[None]:
        return self._threads.submit(self._call, engine, path, body)

    def _call(self, engine: EngineTarget, path: str, body: dict[str, Any]) -> None:
        try:
            response = self._http.post(engine.url.rstrip("/") + path, json=body)
        except httpx.HTTPError as exc:
            raise BroadcastError(f"{engine.url}{path}: unreachable: {exc}") from exc
        if response.status_code != 200:
            raise BroadcastError(f"{engine.url}{path} answered {response.status_code}: {_message(response)}")

    def _wait(self, futures: Sequence[concurrent.futures.Future[Any]], step: str) -> None:
        """Every future's result; the first failure is raised at once (the others may be stuck on it)."""
        done, pending = concurrent.futures.wait(
            futures, timeout=self.config.timeout_s, return_when=concurrent.futures.FIRST_EXCEPTION
        )
        for future in futures:
            error = future.exception() if future in done else None
            if isinstance(error, BroadcastError):
                raise error
            if error is not None:
                raise BroadcastError(f"{step}: {type(error).__name__}: {error}") from error
        if pending:
            raise BroadcastError(f"{step} did not finish within {self.config.timeout_s:.0f} s")


def broadcast_weights(
    engines: Sequence[EngineTarget],
    named: NamedTensors,
    weight_version: str,
    config: BroadcastConfig | None = None,
) -> BroadcastStats:
    """Connect, send once and close: the whole protocol against engines that nothing else updates."""
    with WeightBroadcaster(engines, config) as broadcaster:
        return broadcaster.send(named, weight_version)


def roll_out_by_broadcast(
    api: ServerApi,
    named: NamedTensors,
    weight_version: str,
    model_path: str,
    config: BroadcastConfig | None = None,
) -> tuple[BroadcastStats, dict[str, Any]]:
    """Roll ``named`` out through the tandem server (``POST /admin/weights {"source": "distributed"}``).

    The server pauses its replicas and answers with the engines, their ranks and a group name; this
    side runs the protocol against them; the server then checks every replica serves
    ``weight_version``, resumes and promotes it. ``model_path``: the checkpoint holding the same
    weights (exported by this trainer), which the version row, rollbacks and returning replicas load.

    Returns:
        The broadcast's stats and the server's rollout result.

    Raises:
        RoundError: the server refused or could not be reached (serving is unchanged).
        BroadcastError: the broadcast failed; the server was told and restored the serving weights.
    """
    config = config or BroadcastConfig()
    session = api.begin_distributed(weight_version, model_path)
    engines = [EngineTarget(e["url"], int(e["ranks"])) for e in session["engines"]]
    try:
        stats = broadcast_weights(engines, named, weight_version, replace(config, group_name=session["group_name"]))
    except BaseException as exc:
        with contextlib.suppress(RoundError):  # unreachable: the server gives up after its timeout anyway
            api.end_distributed(session["session"], committed=False, reason=str(exc) or type(exc).__name__)
        raise
    return stats, api.end_distributed(session["session"], committed=True)


def _abandon(opening: concurrent.futures.Future[Any]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        close_update_group(opening.result(), abort=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _message(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if data.get("message"):
            return str(data["message"])
    return response.text[:500]
