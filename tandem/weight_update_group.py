"""The weight-update process group of SGLang's distributed weight sync, shared by trainer and engine.

The trainer is rank 0 and hosts the rendezvous store at ``tcp://master_address:master_port``; each
engine joins with its own rank (its ``rank_offset`` plus its tensor-parallel rank). Both sides may
already belong to another default process group (Megatron's, SGLang's tensor-parallel one) or to
none, so this group has its own rendezvous and is built with torch's group constructor, the way
SGLang, slime and OpenRLHF build theirs: store prefixed with the group name, the same keys as
SGLang's, so a tandem trainer can feed a real SGLang server (tests/sglang/test_distributed.py) and a
slime-style trainer a `tandem engine`.

Weights then travel as plain broadcasts from rank 0, tensor by tensor in the order both sides agreed
on over HTTP (names, dtypes, shapes).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    GroupName,
    PrefixStore,
    _abort_process_group,
    _new_process_group_helper,
    _world,
    rendezvous,
)

__all__ = [
    "BACKENDS",
    "broadcast_tensors",
    "close_update_group",
    "dtype_from_name",
    "dtype_name",
    "group_name_taken",
    "open_update_group",
]

BACKENDS = ("nccl", "gloo")


def open_update_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float,
) -> dist.ProcessGroup:
    """Join the group; returns once every rank has joined the rendezvous (or raises after ``timeout_s``).

    Raises:
        ValueError: an unknown backend or a rank outside the world.
        RuntimeError / DistStoreError: the rendezvous failed or timed out.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    if backend == "nccl":
        # NVLink SHARP (multicast) buffers cost GPU memory per communicator and are not needed for a
        # one-to-few broadcast; read by NCCL when its first communicator is created in this process.
        os.environ["NCCL_NVLS_ENABLE"] = "0"
    timeout = timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    # No device_id: NCCL then creates its communicator lazily at the first broadcast, as SGLang's does.
    # An eager one here would wait for peers that only create theirs when the first bucket arrives.
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=GroupName(group_name),
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {r: r for r in range(world_size)}  # ranks of this group are its own
    return group


def broadcast_tensors(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor]) -> None:
    """Broadcast ``tensors`` from rank 0 of ``group``, in order: rank 0 sends them, every other rank
    receives into them (same dtypes and shapes). All are issued before any is waited on."""
    works = [dist.broadcast(t, group=group, group_src=0, async_op=True) for t in tensors]
    for work in works:
        if work is not None:
            work.wait()


def close_update_group(group: dist.ProcessGroup, *, abort: bool = False) -> None:
    """Leave the group, which frees its name in this process.

    ``abort``: a broadcast may still be stuck on the group (a peer never joined it). NCCL's destroy
    would wait for that kernel, so its communicators are aborted instead; gloo's destroy returns at
    once either way (the stuck send fails at the group's timeout).
    """
    if abort and dist.get_backend(group) == "nccl":
        _abort_process_group(group)
    else:
        dist.destroy_process_group(group)


def group_name_taken(group_name: str) -> bool:
    """A group of that name is open in this process: opening another one under it would fail."""
    return group_name in _world.pg_names.values()


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang's requests use: ``bfloat16``, not ``torch.bfloat16``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: object) -> torch.dtype:
    """Raises ValueError for anything that is not the name of a torch dtype."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype
