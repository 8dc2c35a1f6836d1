"""Environment and flags for an SGLang 0.5.23 server process that runs on the CPU.

Found by running the real server on a CPU-only machine (shared/reference/engines-on-cpu.md §3):

* ``SGLANG_USE_CPU_ENGINE=1``: without it SGLang's CPU check is false even with ``--device cpu``
  and the RoPE layer reaches for vLLM's CUDA ops.
* The stand-in ``sgl_kernel`` (next to this file) first on ``PYTHONPATH``: PyPI's sglang-kernel
  only has CUDA builds, and importing it fails without a GPU driver.
* ``HF_HUB_OFFLINE=1``: models are local folders; never wait on a model hub.
* ``--attention-backend torch_native`` and ``--disable-cuda-graph``: the only attention path
  that needs no native kernel; graphs are a CUDA feature.
* ``--max-total-tokens``: otherwise ``--mem-fraction-static`` of the machine's RAM becomes KV
  cache (6 GB on a 24 GB box for a model of a few MB).
* ``--sleep-on-idle``: an idle scheduler otherwise busy-polls its sockets and keeps one core at
  100 %; with it the scheduler blocks in ``zmq.Poller.poll`` until work arrives (measured on
  2 cores: 93-101 % -> 2 % idle CPU; a 1-token request took 13 ms at best with it, 15 ms without).
* ``--enable-priority-scheduling --default-priority-value 0``: requests that name no priority
  (user traffic) run at 0, and the learner's rollouts (``priority`` -1) wait behind them in the
  queue; a difference of 1 is under the preemption threshold (10), so running rollouts stay.

The dtype is left to the caller: ``--dtype float32`` makes greedy output match a float32
transformers reference bit for bit on a tiny random model, whose near-uniform logits bf16 can tie.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from server.engines.sglang_cpu import SHIM_DIR

__all__ = ["CPU_ENVIRONMENT", "CPU_SERVER_ARGS", "SHIM_DIR", "cpu_environment"]

CPU_SERVER_ARGS: tuple[str, ...] = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-cuda-graph",
    "--max-total-tokens",
    "65536",
    "--mem-fraction-static",
    "0.3",
    "--sleep-on-idle",
    "--enable-priority-scheduling",
    "--default-priority-value",
    "0",
)
"""Flags for ``python -m sglang.launch_server`` on the CPU, after the model and address flags."""

CPU_ENVIRONMENT: Mapping[str, str] = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "HF_HUB_OFFLINE": "1",
}
"""Variables set for every CPU server (besides PYTHONPATH, which ``cpu_environment`` extends)."""


def cpu_environment(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` (e.g. ``os.environ``) with what an SGLang server on the CPU needs.

    The stand-in ``sgl_kernel`` folder goes first on ``PYTHONPATH``, ahead of whatever ``base``
    had there, so it shadows the installed CUDA-only package.
    """
    env = {**base, **CPU_ENVIRONMENT}
    rest = [entry for entry in base.get("PYTHONPATH", "").split(os.pathsep) if entry and entry != str(SHIM_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR), *rest])
    return env
