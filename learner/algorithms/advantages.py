"""Per-sample advantages: GRPO, REINFORCE++-baseline and reward minus a baseline (feedback only).

Every estimator returns one scalar per sample (shape ``[N]``); ``broadcast_to_tokens`` spreads it over
the response tokens under the loss mask, which is what slime's ``get_grpo_returns`` does. The group
statistics follow slime's ``RolloutManager._post_process_rewards`` (``slime/ray/rollout.py``) and the
whitening follows ``distributed_masked_whiten`` (``slime/utils/distributed_utils.py``).

Groups are named by ``group_index`` (one integer per sample, any values, any order), not by a fixed
``n_samples_per_prompt``: a tandem group is the n rollouts plus the logged rated answer, and groups
built from feedback differ in size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.to_device import to_device

GRPO_STD_EPSILON = 1e-6  # slime: rewards / (std + 1e-6)
WHITEN_EPSILON = 1e-8  # slime: (x - mean) * rsqrt(var + 1e-8)


def _float_rewards(rewards: Tensor) -> Tensor:
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D (one per sample), got shape {tuple(rewards.shape)}")
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite; a NaN or inf reward would poison its whole group")
    return rewards


def group_mean_std(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor]:
    """Each sample's group mean and unbiased group std (n - 1 in the denominator, as ``torch.std``).

    A group of one sample has std 0 (``torch.std`` would give NaN), which is where slime turns std
    normalisation off (``n_samples_per_prompt == 1``).
    """
    rewards = _float_rewards(rewards)
    if group_index.shape != rewards.shape:
        raise ValueError(f"group_index shape {tuple(group_index.shape)} != rewards shape {tuple(rewards.shape)}")
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    counts = counts.to(rewards.dtype)
    sums = torch.zeros_like(counts).index_add_(0, inverse, rewards)
    mean = (sums / counts)[inverse]
    squares = torch.zeros_like(counts).index_add_(0, inverse, (rewards - mean) ** 2)
    var = torch.where(counts > 1, squares / (counts - 1).clamp_min(1), torch.zeros_like(counts))
    return mean, var.sqrt()[inverse]


def grpo_advantages(
    rewards: Tensor,
    group_index: Tensor,
    *,
    std_normalization: bool = True,
    epsilon: float = GRPO_STD_EPSILON,
) -> Tensor:
    """GRPO: ``A_i = (r_i - mean_g) / (std_g + epsilon)``, or ``r_i - mean_g`` without std normalisation.

    ``std_g`` is the unbiased std of sample i's group g (slime's ``--disable-grpo-std-normalization``
    is ``std_normalization=False``, Dr. GRPO). A group whose rewards are all equal, or that has one
    sample, gets advantage 0 everywhere.
    """
    mean, std = group_mean_std(rewards, group_index)
    centred = _float_rewards(rewards) - mean
    return centred / (std + epsilon) if std_normalization else centred


def masked_whiten(
    values: Tensor,
    mask: Tensor,
    *,
    shift_mean: bool = True,
    epsilon: float = WHITEN_EPSILON,
) -> Tensor:
    """``(x - mean) * rsqrt(var + epsilon)`` with mean and var taken over the masked entries.

    ``var`` has Bessel's correction ``m / (m - 1)`` with ``m = sum(mask)`` when ``m >= 2``. ``mask`` may
    hold weights: a sample weighted by its token count whitens exactly as its advantage repeated
    over those tokens would. ``shift_mean=False`` adds the mean back (scale only).
    """
    if values.shape != mask.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != values shape {tuple(values.shape)}")
    mask = mask.to(values.dtype)
    total = mask.sum()
    if float(total) == 0:
        raise ValueError("cannot whiten: the mask selects nothing")
    mean = (values * mask).sum() / total
    var = (values**2 * mask).sum() / total - mean**2
    if float(total) >= 2:
        var = var * total / (total - 1)
    whitened = (values - mean) * torch.rsqrt(var.clamp_min(0) + epsilon)
    return whitened if shift_mean else whitened + mean


def reinforce_plus_plus_baseline_advantages(
    rewards: Tensor,
    group_index: Tensor,
    *,
    token_counts: Tensor | None = None,
    epsilon: float = WHITEN_EPSILON,
) -> Tensor:
    """REINFORCE++-baseline: ``A_i = whiten(r_i - mean_g)`` over the whole batch.

    The group mean is the baseline; whitening uses every sample of the batch, weighted by
    ``token_counts`` (each sample's loss-mask sum) so the result equals slime's token-level whitening
    of the broadcast advantages. Without ``token_counts`` every sample weighs the same.
    """
    mean, _ = group_mean_std(rewards, group_index)
    centred = _float_rewards(rewards) - mean
    weights = torch.ones_like(centred) if token_counts is None else token_counts.to(centred.dtype)
    return masked_whiten(centred, weights, epsilon=epsilon)


def feedback_advantages(rewards: Tensor, baselines: Tensor | float) -> Tensor:
    """Feedback only: ``A_i = r_i - b_i``.

    ``b_i`` is whatever baseline the caller keeps (a running mean of that user's ratings, or of
    everyone's): one value per sample or one for all. For logged answers rated alone, where a group
    of one would make the GRPO advantage 0.
    """
    rewards = _float_rewards(rewards)
    baselines = torch.as_tensor(baselines, dtype=rewards.dtype, device=rewards.device)
    if baselines.ndim not in (0, 1) or (baselines.ndim == 1 and baselines.shape != rewards.shape):
        raise ValueError(f"baselines must be a scalar or match rewards {tuple(rewards.shape)}")
    return rewards - baselines


def segment_ids(cu_seqlens: Tensor, device: torch.device | None = None) -> Tensor:
    """For a packed row with sample offsets ``cu_seqlens`` ``[n + 1]``, the sample of each token: ``[T]``,
    on ``device`` (default: ``cu_seqlens``'s).

    Offsets kept on the host cost the device nothing: the ids are built there and copied without
    blocking. Offsets on a GPU make the host wait for it (the row's length must be read back).
    """
    # Token t's sample is the number of sample starts after the first at or before t: a running sum
    # of start marks. (repeat_interleave forks the host's thread pool for each call: 5 to 7 ms per
    # call on a busy 16-core host, where this takes microseconds.)
    starts = cu_seqlens[1:-1].long()
    marks = torch.zeros(int(cu_seqlens[-1]) + 1, dtype=torch.long, device=cu_seqlens.device)
    marks.index_add_(0, starts, torch.ones_like(starts))
    ids = marks[:-1].cumsum(0)
    return ids if device is None else to_device(ids, device)


def broadcast_to_tokens(advantages: Tensor, loss_mask: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
    """Per-token advantages ``A[i, t] = A_i * mask[i, t]`` from ``[N]`` advantages.

    ``loss_mask`` is ``[N, T]`` (padded, a row per sample), or one packed ``[T]`` row with the sample
    offsets ``cu_seqlens`` ``[N + 1]`` (``learner.batching``'s layout).
    """
    if cu_seqlens is None:
        if advantages.ndim != 1 or loss_mask.ndim != 2 or loss_mask.shape[0] != advantages.shape[0]:
            raise ValueError(
                f"need advantages [N] and loss_mask [N, T], got {tuple(advantages.shape)} and {tuple(loss_mask.shape)}"
            )
        return advantages[:, None] * loss_mask.to(advantages.dtype)
    if advantages.shape != (cu_seqlens.numel() - 1,) or loss_mask.shape != (int(cu_seqlens[-1]),):
        raise ValueError(
            f"need advantages [N], cu_seqlens [N + 1] and loss_mask [cu_seqlens[-1]], got {tuple(advantages.shape)}, "
            f"{tuple(cu_seqlens.shape)} and {tuple(loss_mask.shape)}"
        )
    return advantages[segment_ids(cu_seqlens, advantages.device)] * loss_mask.to(advantages.dtype)
