"""A buffer filter, a dynamic filter and a custom loss, written as slime's are."""

import torch
from slime.backends.megatron_utils.loss import get_log_probs_and_entropy
from slime.rollout.filter_hub.base_types import DynamicFilterOutput

SEEN = {"buffer": [], "filter": 0}


def pop_first(args, rollout_id, buffer, num_samples):
    SEEN["buffer"].append((rollout_id, len(buffer), num_samples))
    num_to_pop = min(len(buffer), num_samples)
    samples = buffer[:num_to_pop]
    del buffer[:num_to_pop]
    return samples


def keep_varied(args, samples, **kwargs):
    SEEN["filter"] += 1
    rewards = torch.tensor([s.get_reward_value(args) for s in samples], dtype=torch.float64)
    keep = bool(rewards.std() > 1e-6)
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0].item(), 1)}")


def reinforce_loss(args, batch, logits, sum_of_sample_mean):
    """Plain REINFORCE on the response tokens, as a slime custom loss computes it."""
    _, log_probs_and_entropy = get_log_probs_and_entropy(
        logits,
        args=args,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"],
        with_entropy=True,
    )
    log_probs = torch.cat(log_probs_and_entropy["log_probs"], dim=0)
    advantages = torch.cat(batch["advantages"], dim=0)
    loss = -sum_of_sample_mean(log_probs * advantages)
    entropy = sum_of_sample_mean(torch.cat(log_probs_and_entropy["entropy"], dim=0))
    return loss, {"reinforce_loss": loss.clone().detach(), "reinforce_entropy": entropy.detach()}
