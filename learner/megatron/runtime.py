"""Process groups for the Megatron backend: one process per device, torchrun's environment or a lone one.

``parallel(config, seed=...)`` sets up ``torch.distributed`` (NCCL on GPUs, gloo on the CPU), megatron's
tensor/pipeline/context/expert groups and its RNG, and tears megatron's groups down on exit. A
process not started by torchrun is a world of one on a free local port. The process group itself
stays for the life of the process (tearing gloo down and up again is slow and racy), so later
``parallel`` blocks reuse it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from learner.megatron.config import MegatronConfig
from learner.megatron.cpu_compat import apply_cpu_patches, define_missing_te_gemm, on_cpu

__all__ = ["parallel", "world_rank"]


def _init_process_group() -> None:
    if dist.is_initialized():
        return
    backend = "gloo" if on_cpu() else "nccl"
    if not on_cpu():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "WORLD_SIZE" in os.environ:  # started by torchrun (or another launcher setting the env://)
        dist.init_process_group(backend)
    else:  # a world of one: an in-memory store, no port to race for (nor to leak to child processes)
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
    define_missing_te_gemm()
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
