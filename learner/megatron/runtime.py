"""Process groups for the Megatron backend: one process per device.

``parallel(config, seed=...)`` sets up ``torch.distributed`` (NCCL on GPUs, gloo on the CPU), megatron's
tensor/pipeline/context/expert groups and its RNG, and tears megatron's groups down on exit. The
world is joined one of three ways:

* ranks started by ``learner.child_process`` (``RENDEZVOUS_ENV`` set): rank 0 serves the store on a
  port the system picks and publishes it in that file; the other ranks read it and connect;
* ranks started by torchrun (``WORLD_SIZE`` set, no rendezvous file): ``env://``;
* any other process: a world of one on an in-memory store (no port to race for, nor to leak to
  child processes).

The process group itself stays for the life of the process (tearing gloo down and up again is slow
and racy), so later ``parallel`` blocks reuse it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from learner.child_process import RENDEZVOUS_ENV
from learner.megatron.cpu_compat import apply_cpu_patches, on_cpu, patch_missing_te
from learner.megatron_config import MegatronConfig

__all__ = ["parallel", "world_rank"]


# How long a rank waits for the others to reach the store (they import megatron first) and for any
# collective; a stuck world is ended sooner by its launcher's timeout.
_STORE_TIMEOUT = datetime.timedelta(minutes=10)


def _rendezvous_store(path: Path, rank: int, world: int) -> dist.TCPStore:
    """Rank 0 serves a store on a free port and publishes the port in ``path``; the others connect."""
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=_STORE_TIMEOUT, wait_for_workers=False)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(str(store.port))
        os.replace(partial, path)  # whole or absent: a reader never sees half a number
        return store
    deadline = time.monotonic() + _STORE_TIMEOUT.total_seconds()
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not publish its store in {path} within {_STORE_TIMEOUT}")
        time.sleep(0.05)
    return dist.TCPStore("127.0.0.1", int(path.read_text()), world, is_master=False, timeout=_STORE_TIMEOUT)


def _init_process_group() -> None:
    if dist.is_initialized():
        return
    backend = "gloo" if on_cpu() else "nccl"
    if not on_cpu():
        # NVLink multicast (NVLS) can take a shared host's GPUs out of service: off unless asked for.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if RENDEZVOUS_ENV in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = _rendezvous_store(Path(os.environ[RENDEZVOUS_ENV]), rank, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=_STORE_TIMEOUT)
    elif "WORLD_SIZE" in os.environ:  # torchrun (or another launcher setting up env://)
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def world_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextlib.contextmanager
def parallel(config: MegatronConfig, *, seed: int = 0) -> Iterator[None]:
    """Megatron's parallel groups for ``config`` in this process, seeded; destroyed on exit.

    Raises:
        ValueError: the world size differs from ``config.devices``, or the config offloads optimizer
            state to the CPU in a process without a GPU.
    """
    if config.optimizer_cpu_offload and on_cpu():
        raise ValueError("optimizer_cpu_offload moves optimizer state off the GPU; this process has no GPU")
    apply_cpu_patches()
    patch_missing_te()
    _init_process_group()
    world = dist.get_world_size()
    if world != config.devices:
        raise ValueError(f"the megatron config expects devices={config.devices} processes, this world has {world}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_parallel,
        pipeline_model_parallel_size=config.pipeline_parallel,
        context_parallel_size=config.context_parallel,
        expert_model_parallel_size=config.expert_parallel,
    )
    try:
        # On the CPU megatron's CUDA RNG tracker cannot fork states; the inference tracker makes its
        # forks no-ops and dropout draw from torch's default generator (seeded below).
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=on_cpu(), force_reset_rng=True)
        torch.manual_seed(seed)
        yield
    finally:
        parallel_state.destroy_model_parallel()
