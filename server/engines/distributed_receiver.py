"""Engine side of SGLang's distributed weight sync, for `tandem engine` (``tandem.weight_update_group``).

The requests are SGLang 0.5.23's: ``init_weights_update_group`` joins the trainer's group with rank
``rank_offset`` (this process is one tensor-parallel rank), ``update_weights_from_distributed``
receives one bucket broadcast from rank 0, ``destroy_weights_update_group`` leaves.

A bucket whose request parses is always received in full, even when its tensors then turn out not
to fit the model: the trainer is already broadcasting it, and a rank that stopped listening would
leave the trainer (and every other engine) blocked in the collective until the group times out.
The fit is checked after the receive, before anything is copied into the weights.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from server.engines.local.weights import WeightLoadError
from tandem.weight_update_group import (
    BACKENDS,
    broadcast_tensors,
    close_update_group,
    dtype_from_name,
    open_update_group,
)

__all__ = ["BucketRequest", "DistributedUpdateError", "GroupRequest", "UpdateGroups"]

DEFAULT_GROUP = "weight_update_group"


class DistributedUpdateError(WeightLoadError):
    """A request that cannot be served: bad fields, an unknown group, a failed rendezvous or receive."""


@dataclass(frozen=True, slots=True)
class GroupRequest:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str

    @classmethod
    def parse(cls, body: dict[str, Any]) -> GroupRequest:
        address = body.get("master_address")
        if not isinstance(address, str) or not address:
            raise DistributedUpdateError("master_address required (a string)")
        port, offset, world = (_int(body, key) for key in ("master_port", "rank_offset", "world_size"))
        if not 0 < port < 65536:
            raise DistributedUpdateError("master_port must be in (0, 65536)")
        if not 0 < offset < world:
            raise DistributedUpdateError(
                f"rank_offset must be in [1, world_size) (rank 0 is the trainer), not {offset}"
            )
        backend = body.get("backend", "nccl")
        if backend not in BACKENDS:
            raise DistributedUpdateError(f"backend must be one of {', '.join(BACKENDS)}")
        return cls(address, port, offset, world, _group_name(body), backend)


@dataclass(frozen=True, slots=True)
class BucketRequest:
    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str

    @classmethod
    def parse(cls, body: dict[str, Any]) -> BucketRequest:
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise DistributedUpdateError("names, dtypes and shapes required (lists)")
        if not len(names) == len(dtypes) == len(shapes):
            raise DistributedUpdateError("names, dtypes and shapes must have the same length")
        if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
            raise DistributedUpdateError("names must be distinct non-empty strings")
        if body.get("load_format") is not None:
            raise DistributedUpdateError("load_format is not supported here: send plain tensors (leave it out)")
        try:
            parsed_dtypes = tuple(dtype_from_name(d) for d in dtypes)
        except ValueError as exc:
            raise DistributedUpdateError(f"dtypes: {exc}") from exc
        if not all(
            isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s)
            for s in shapes
        ):
            raise DistributedUpdateError("shapes must be lists of non-negative integers")
        return cls(tuple(names), parsed_dtypes, tuple(tuple(s) for s in shapes), _group_name(body))


@dataclass(slots=True)
class _Member:
    group: dist.ProcessGroup
    backend: str
    lock: asyncio.Lock  # one bucket at a time: both sides must broadcast in the same order


class UpdateGroups:
    """The weight-update groups this engine process has joined, by name.

    ``device``: where the model lives; NCCL receives there, gloo into CPU memory.
    """

    def __init__(self, device: torch.device, timeout_s: float = 600.0) -> None:
        self._device = device
        self._timeout_s = timeout_s
        self._members: dict[str, _Member] = {}

    async def join(self, request: GroupRequest) -> None:
        """Returns once every rank has joined (the trainer joins as rank 0 meanwhile)."""
        if request.group_name in self._members:
            raise DistributedUpdateError(f"already in group {request.group_name!r}; destroy it first")
        if request.backend == "nccl" and self._device.type != "cuda":
            raise DistributedUpdateError(f"backend nccl needs an engine on a GPU; this one serves on {self._device}")
        try:
            group = await asyncio.to_thread(
                open_update_group,
                backend=request.backend,
                master_address=request.master_address,
                master_port=request.master_port,
                rank=request.rank_offset,
                world_size=request.world_size,
                group_name=request.group_name,
                timeout_s=self._timeout_s,
            )
        except (RuntimeError, ValueError) as exc:  # DistStoreError and the backends' errors are RuntimeErrors
            raise DistributedUpdateError(f"could not join group {request.group_name!r}: {exc}") from exc
        self._members[request.group_name] = _Member(group, request.backend, asyncio.Lock())

    async def receive(self, request: BucketRequest) -> dict[str, torch.Tensor]:
        """The bucket's tensors as rank 0 broadcast them, by name."""
        member = self._members.get(request.group_name)
        if member is None:
            raise DistributedUpdateError(f"no group {request.group_name!r}: call init_weights_update_group first")
        device = self._device if member.backend == "nccl" else torch.device("cpu")
        pairs = zip(request.dtypes, request.shapes, strict=True)
        async with member.lock:
            try:
                tensors = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in pairs]
                await asyncio.to_thread(broadcast_tensors, member.group, tensors)
            except RuntimeError as exc:  # out of memory, a peer gone, the group's timeout
                raise DistributedUpdateError(f"receiving the bucket failed: {exc}") from exc
        return dict(zip(request.names, tensors, strict=True))

    async def leave(self, group_name: str) -> None:
        member = self._members.pop(group_name, None)
        if member is None:
            raise DistributedUpdateError(f"no group {group_name!r} to destroy")
        async with member.lock:  # not in the middle of a bucket
            await asyncio.to_thread(close_update_group, member.group)


def _int(body: dict[str, Any], key: str) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise DistributedUpdateError(f"{key} required (an integer)")
    return value


def _group_name(body: dict[str, Any]) -> str:
    name = body.get("group_name", DEFAULT_GROUP)
    if not isinstance(name, str) or not name:
        raise DistributedUpdateError("group_name must be a non-empty string")
    return name
