"""``slime.backends.megatron_utils.loss``: the log-prob helper a custom loss calls, and slime's SFT loss.

``get_log_probs_and_entropy`` takes slime's ``[1, T, V]`` logits of a packed row and gives each
sample's response log-probs (and entropy), the logits divided by the rollout temperature first. slime
divides by one ``args.rollout_temperature``; tandem's samples each carry theirs (a rated answer was
sampled at its request's temperature), so ``args.sample_temperatures`` (set by tandem per micro-batch)
wins where present.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["get_log_probs_and_entropy", "sft_loss_function"]


def get_log_probs_and_entropy(
    logits: Tensor,
    *,
    args: Any,
    unconcat_tokens: list[Tensor],
    total_lengths: list[int],
    response_lengths: list[int],
    with_entropy: bool = False,
    non_loss_data: bool = True,
    **_: Any,
) -> tuple[Tensor, dict[str, list[Tensor]]]:
    if logits.dim() != 3 or logits.size(0) != 1:
        raise ValueError(f"logits must be [1, T, V], got {tuple(logits.shape)}")
    rows = logits.squeeze(0)
    temperatures = getattr(args, "sample_temperatures", None) or [args.rollout_temperature] * len(total_lengths)
    log_probs: list[Tensor] = []
    entropy: list[Tensor] = []
    start = 0
    for tokens, total, response, temperature in zip(
        unconcat_tokens, total_lengths, response_lengths, temperatures, strict=True
    ):
        # the logits at position t score token t + 1: a response's come from the row before each token
        scores = rows[start + total - response - 1 : start + total - 1].float() / temperature
        dist = torch.log_softmax(scores, dim=-1)
        targets = tokens[total - response :].to(dist.device).long()
        log_probs.append(dist.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
        if with_entropy:
            entropy.append(-(dist.exp() * dist).sum(-1))
        start += total
    result = {"log_probs": log_probs}
    if with_entropy:
        result["entropy"] = entropy
    return torch.empty((0,), device=logits.device), result


def sft_loss_function(
    args: Any, batch: dict[str, Any], logits: Tensor, sum_of_sample_mean: Callable[[Tensor], Tensor]
) -> tuple[Tensor, dict[str, Tensor]]:
    """slime's SFT loss: the responses' negative log-likelihood."""
    _, scores = get_log_probs_and_entropy(
        logits,
        args=args,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"],
    )
    loss = -sum_of_sample_mean(torch.cat(scores["log_probs"]))
    return loss, {"loss": loss.detach()}
