"""Per-token advantages: REINFORCE++, KL in the reward, on-policy distillation (slime's formulas).

Every tensor is one sample's response tokens (a list, one per sample); ``scores`` are the per-sample
scalars the round produced (a group-normalised reward, or reward minus a baseline). slime's
``compute_advantages_and_returns`` (``slime/backends/megatron_utils/loss.py``) and
``slime/utils/ppo_utils.py``:

- ``grpo``, ``gspo``, ``cispo``: ``A_t = s`` (the KL term is not used, as ``get_grpo_returns``).
- ``reinforce_plus_plus_baseline``: ``A_t = s - kl_coef * KL_t``.
- ``reinforce_plus_plus``: rewards ``r_t = -kl_coef * KL_t * m_t`` plus ``s`` at the last trained
  token, and ``A_t = G_t = sum_{u >= t} gamma^(u - t) r_u`` (discounted returns).
- ``ppo``: rewards ``r_t = -kl_coef * KL_t`` plus ``s`` at the last token, and GAE over the critic's
  values: ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lambd * A_{t+1}``
  (``V`` past the end is 0), returns ``A_t + V_t`` (``vanilla_gae`` in ``ppo_utils.py``).
- on-policy distillation (any estimator): ``A_t -= opd_kl_coef * (logp_t - logp_teacher_t)``, the
  reverse KL to the teacher on the sampled token.
- ``normalize_advantages``: whitened over every trained token of the batch (``masked_whiten``).

``KL_t`` is ``compute_approx_kl(logp_old, logp_ref, kl_loss_type)`` on the policy before the update.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from learner.algorithms.advantages import masked_whiten

__all__ = [
    "discounted_returns",
    "gae",
    "opd_penalty",
    "ppo_token_rewards",
    "reinforce_plus_plus_returns",
    "shaped_advantages",
    "whiten_tokens",
]


def discounted_returns(rewards: Tensor, gamma: float) -> Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` over one sample's tokens."""
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(())
    for t in range(rewards.shape[0] - 1, -1, -1):
        running = rewards[t] + gamma * running
        returns[t] = running
    return returns


def reinforce_plus_plus_returns(
    scores: Sequence[float], kl: Sequence[Tensor], masks: Sequence[Tensor], *, kl_coef: float, gamma: float
) -> list[Tensor]:
    """REINFORCE++'s per-token returns (no baseline); a sample with no trained token gets zeros.

    Raises:
        ValueError: lists of different lengths, or a mask and KL of different shapes.
    """
    if not len(scores) == len(kl) == len(masks):
        raise ValueError(f"{len(scores)} scores, {len(kl)} KL tensors and {len(masks)} masks")
    returns = []
    for score, kl_i, mask in zip(scores, kl, masks, strict=True):
        if kl_i.shape != mask.shape:
            raise ValueError(f"KL {tuple(kl_i.shape)} and mask {tuple(mask.shape)} differ in shape")
        rewards = -kl_coef * kl_i.float() * mask.float()
        trained = mask.nonzero()
        if trained.numel() == 0:
            returns.append(torch.zeros_like(rewards))
            continue
        rewards[int(trained[-1])] += score
        returns.append(discounted_returns(rewards, gamma))
    return returns


def ppo_token_rewards(scores: Sequence[float], kl: Sequence[Tensor], *, kl_coef: float) -> list[Tensor]:
    """PPO's per-token rewards: ``-kl_coef * KL_t``, plus the sample's score on its last token (slime's)."""
    rewards = []
    for score, kl_i in zip(scores, kl, strict=True):
        r = -kl_coef * kl_i.float()
        if r.numel():
            r[-1] += score
        rewards.append(r)
    return rewards


def gae(
    rewards: Sequence[Tensor], values: Sequence[Tensor], *, gamma: float, lambd: float
) -> tuple[list[Tensor], list[Tensor]]:
    """Generalised advantage estimation per sample: ``(advantages, returns)``, returns = advantages + values.

    Raises:
        ValueError: a sample whose rewards and values differ in length.
    """
    advantages, returns = [], []
    for r, v in zip(rewards, values, strict=True):
        if r.shape != v.shape:
            raise ValueError(f"rewards {tuple(r.shape)} and values {tuple(v.shape)} differ in shape")
        v = v.float()
        a = torch.zeros_like(v)
        running = v.new_zeros(())
        for t in range(v.shape[0] - 1, -1, -1):
            next_value = v[t + 1] if t + 1 < v.shape[0] else v.new_zeros(())
            running = r[t] + gamma * next_value - v[t] + gamma * lambd * running
            a[t] = running
        advantages.append(a)
        returns.append(a + v)
    return advantages, returns


def shaped_advantages(
    estimator: str,
    scores: Sequence[float],
    kl: Sequence[Tensor],
    masks: Sequence[Tensor],
    *,
    kl_coef: float,
    gamma: float,
) -> list[Tensor]:
    """Each sample's per-token advantages for ``estimator`` before distillation and whitening."""
    if estimator == "reinforce_plus_plus":
        return reinforce_plus_plus_returns(scores, kl, masks, kl_coef=kl_coef, gamma=gamma)
    if estimator == "reinforce_plus_plus_baseline":
        return [score - kl_coef * kl_i.float() for score, kl_i in zip(scores, kl, strict=True)]
    return [torch.full_like(kl_i, float(score), dtype=torch.float32) for score, kl_i in zip(scores, kl, strict=True)]


def opd_penalty(
    advantages: Sequence[Tensor], student: Sequence[Tensor], teacher: Sequence[Tensor], coef: float
) -> tuple[list[Tensor], list[Tensor]]:
    """On-policy distillation: ``(advantages - coef * reverse_kl, reverse_kl)``, ``reverse_kl = logp - logp_teacher``."""
    reverse = [s.float() - t.float() for s, t in zip(student, teacher, strict=True)]
    return [a - coef * r for a, r in zip(advantages, reverse, strict=True)], reverse


def whiten_tokens(advantages: Sequence[Tensor], masks: Sequence[Tensor]) -> list[Tensor]:
    """slime's ``--normalize-advantages`` on per-token advantages: whitened over every trained token."""
    flat, mask = torch.cat(list(advantages)), torch.cat(list(masks)).float()
    if mask.sum() == 0:
        return list(advantages)
    return list(masked_whiten(flat, mask).split([a.shape[0] for a in advantages]))
