"""One rank of a ``benchmarks.parallel_train`` layout, started by ``learner.child_process``.

Loads the checkpoint into the layout, scores the batch (every response token's log-prob, gathered
on global rank 0), takes the first optimizer step, then times the rest. Rank 0 writes the outcome
(or the error it met); another rank's error ends it with a traceback, which the launcher reports.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.random_model import SHAPES
from benchmarks.train_throughput import make_samples, timed_steps
from learner.child_process import write_outcome
from learner.megatron.backend import MegatronPolicy, OptimizerSettings
from learner.megatron.runtime import parallel
from learner.megatron_config import MegatronConfig
from learner.trainers.train_config import TrainConfig


def gather_log_probs(per_sample: list[torch.Tensor | None]) -> list[float]:
    """Every response token's log-prob on global rank 0, in sample order (each rank scored some)."""
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(per_sample, parts, dst=0)
    if parts is None:
        return []
    merged = [next((p[i] for p in parts if p[i] is not None), None) for i in range(len(per_sample))]
    if any(m is None for m in merged):
        raise RuntimeError("no rank scored some samples")
    return torch.cat([m for m in merged if m is not None]).tolist()


def run(request: dict[str, Any]) -> dict[str, Any] | None:
    """This rank's part; the results on global rank 0, None elsewhere."""
    if request["threads"]:
        torch.set_num_threads(request["threads"])
    config = MegatronConfig.from_dict(request["layout"])
    samples = make_samples(request["batch"], request["seq"], SHAPES[request["shape"]]["vocab_size"])
    cap = request["micro_batch_tokens"] or request["seq"]
    train_config = TrainConfig(backend="megatron", max_tokens_per_micro_batch=cap)
    with parallel(config):
        policy = MegatronPolicy(Path(request["folder"]), config, optimizer=OptimizerSettings(learning_rate=1e-6))
        log_probs = gather_log_probs(policy.response_log_probs(samples, train_config))
        first = policy.train_step(samples, train_config)
        warmup = max(request["warmup"] - 1, 0)  # the first step was one
        timed = timed_steps(
            lambda: policy.train_step(samples, train_config), warmup, request["steps"], request["device"]
        )
        if dist.get_rank() != 0:
            return None
    peak = torch.cuda.max_memory_allocated() / 2**30 if request["device"] == "cuda" else None
    return {
        "loss": first["loss"],
        "grad_norm": first["grad_norm"],
        "nll": -sum(log_probs) / len(log_probs),
        "log_probs": log_probs,
        "s_per_step": timed["s_per_step"],
        "rank0_peak_memory_gib": peak,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: python -m benchmarks.parallel_rank REQUEST.json\n")
        return 2
    request_path = Path(argv[1])
    try:
        result = run(json.loads(request_path.read_text()))
    except Exception as exc:
        if int(os.environ.get("RANK", "0")) != 0:
            raise
        result = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    if result is not None:
        write_outcome(request_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
