"""One rank of ``test_context_parallel``'s runs, started by ``learner.child_process.run_child``.

Loads the policy (and the KL reference) into the request's layout, scores the samples
(``response_log_probs``), accumulates one step's gradients, reads them, steps Adam, and on global
rank 0 saves the loss parts, log-probs, gradients (HF names), gradient norm and updated weights with
``torch.save``. Layouts without tensor or pipeline parallel only: every rank then holds whole,
reduced gradients.
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

from learner.algorithms import PolicyLossConfig
from learner.child_process import write_outcome
from learner.megatron.backend import MegatronPolicy, OptimizerSettings
from learner.megatron.hf_convert import to_hf
from learner.megatron.runtime import parallel
from learner.megatron_config import MegatronConfig
from learner.trainers import TrainConfig
from tests.learner.trainers.conftest import random_samples


def run(request: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    layout = MegatronConfig.from_dict(request["layout"])
    if layout.tensor_parallel * layout.pipeline_parallel != 1:
        raise ValueError("this runner reads whole gradients: no tensor or pipeline parallel")
    config = TrainConfig(
        backend="megatron",
        loss=PolicyLossConfig(**request["loss"]),
        clip_grad=None,
        max_tokens_per_micro_batch=request["max_tokens"],
        megatron=layout,
    )
    samples = random_samples(request["samples"], seed=request["seed"], with_log_probs=True, vocab=request["vocab"])
    with parallel(layout):
        policy = MegatronPolicy(Path(request["policy"]), layout, optimizer=OptimizerSettings(1e-3, clip_grad=None))
        ref = MegatronPolicy(Path(request["reference"]), layout) if config.loss.kl_loss_coef else None
        log_probs = policy.response_log_probs(samples, config)
        totals = policy.accumulate_gradients(samples, config, ref=ref)
        state = policy.model.state_dict()
        grads = {name: torch.zeros_like(t) for name, t in state.items() if not name.endswith("_extra_state")}
        grads |= {name: p.main_grad.detach().clone() for name, p in policy.model.named_parameters()}
        grad_norm = policy.apply_gradients()
        weights = policy.hf_state()
        # every replica scored its own samples: rank 0 collects them
        parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(log_probs, parts, dst=0)
        if dist.get_rank() != 0:
            return
    assert parts is not None
    merged = [next((p[i] for p in parts if p[i] is not None), None) for i in range(len(samples))]
    result = {
        "totals": totals,
        "log_probs": merged,
        "grads": to_hf(grads, policy.hf),
        "grad_norm": grad_norm,
        "weights": weights,
    }
    torch.save(result, request["out"])


def main(argv: list[str]) -> int:
    request_path = Path(argv[1])
    try:
        run(json.loads(request_path.read_text()))
    except Exception as exc:
        if int(os.environ.get("RANK", "0")) != 0:
            raise
        write_outcome(request_path, {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})
        return 0
    if int(os.environ.get("RANK", "0")) == 0:
        write_outcome(request_path, {"ok": True})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
