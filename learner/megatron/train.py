"""A ``TrainingRequest`` run on the Megatron backend, inside the training child (``learner.training.child``).

The same contract as the torch backend's run: load the base checkpoint, optionally the KL reference,
take ``num_steps`` optimizer steps over the request's samples (PPO's old log-probs computed once
before the first when there are several), and export a HF checkpoint in the base's dtype. The actor
uses ``megatron.for_role("actor")``, the reference ``for_role("reference")``. With several devices
every rank runs this; global rank 0 gathers the weights and exports.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from learner.megatron.backend import MegatronPolicy, OptimizerSettings
from learner.megatron.cpu_compat import on_cpu
from learner.megatron.runtime import parallel, world_rank
from learner.trainers.checkpoint import ExportResult, checkpoint_dtype, export_state_dict
from learner.training_request import TrainingRequest

__all__ = ["train_megatron"]


def train_megatron(request: TrainingRequest, metrics: list[dict[str, float]]) -> ExportResult | None:
    """Train as ``request`` says and export; appends one metrics dict per optimizer step to ``metrics``.

    Returns:
        The export on global rank 0; None on the other ranks.

    Raises:
        TrainingDiverged: a non-finite loss, gradient norm or weight (on every rank alike).
        ValueError: a layout that does not fit the model or this process (``MegatronConfig``), or
            periodic evaluation, which scores a transformers model and is not run on this backend.
    """
    if request.eval_every:
        raise ValueError("periodic evaluation (eval_every) runs on the torch backend only")
    actor = request.config.megatron.for_role("actor")
    with parallel(actor, seed=request.seed):
        world = dist.get_world_size()
        if request.num_threads is None and on_cpu() and world > 1:
            # The ranks share this machine's cores: torch's default (all of them per rank) oversubscribes.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        settings = OptimizerSettings(request.learning_rate, request.weight_decay, request.config.clip_grad)
        policy = MegatronPolicy(request.base_model_dir, actor, optimizer=settings)
        ref = None
        if request.config.loss.kl_loss_coef != 0:
            reference = request.config.megatron.for_role("reference")
            ref = MegatronPolicy(request.reference_model_dir or request.base_model_dir, reference)
        samples = list(request.samples)
        advantages = None if request.advantages is None else torch.tensor(request.advantages, dtype=torch.float32)
        old_log_probs = None
        if request.num_steps > 1 and not request.config.use_rollout_logprobs:
            # PPO's ratio is against the policy before this rollout's first step, for every step.
            old_log_probs = policy.response_log_probs(samples, request.config)
        for _ in range(request.num_steps):
            metrics.append(
                policy.train_step(samples, request.config, ref=ref, old_log_probs=old_log_probs, advantages=advantages)
            )
        state = policy.hf_state()
    if world_rank() != 0:
        return None
    if state is None:
        raise RuntimeError("global rank 0 gathered no weights to export")
    dtype = checkpoint_dtype(request.base_model_dir)
    return export_state_dict(state, request.base_model_dir, request.out_dir, dtype=dtype)
