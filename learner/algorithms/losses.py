"""Policy-gradient losses: PPO clip, KL estimators, entropy, truncated importance sampling, reduction.

Per-token functions take and return tensors of any shape. The reductions and
``policy_loss_function`` take per-token tensors and a loss mask either padded, ``[B, T]`` with a row
per sample, or packed, one ``[T]`` row whose samples ``cu_seqlens`` ``[B + 1]`` delimits (the layout of
``learner.batching``); offsets kept on the host spare the device a sync per reduction. Formulas follow slime: ``compute_policy_loss`` and ``compute_approx_kl``
(``slime/utils/ppo_utils.py``), ``vanilla_tis_function``, ``policy_loss_function`` and
``get_sum_of_sample_mean`` (``slime/backends/megatron_utils/loss.py`` and ``cp_utils.py``).

Padding positions are left out of every value, but their log-probs must still be finite (use 0): a
non-finite value there makes its local gradient NaN even though the mask leaves its value out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from learner.algorithms.advantages import segment_ids

KLType = Literal["k1", "k2", "k3", "low_var_kl"]
Reduction = Literal["sample_mean", "token_mean"]
# The policy-gradient term: PPO's clipped surrogate per token, GSPO's on the sequence-level ratio,
# CISPO's clipped importance weight times log-prob (slime picks it with --advantage-estimator).
Surrogate = Literal["ppo", "gspo", "cispo"]
# How TIS treats a token whose ratio is outside [tis_clip_low, tis_clip]: clamp it (slime's
# vanilla_tis_function) or drop it (icepop_function).
TISMode = Literal["truncate", "icepop"]
# A custom TIS function on one micro-batch's per-token values: (pg_loss, logp_train, logp_rollout,
# pg_mask) -> (pg_loss, pg_mask, per-token metrics) (``learner.trainers.step_loss`` adapts slime's).
TISFunction = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor, dict[str, Tensor]]]
LOW_VAR_KL_CLAMP = 10.0  # slime clamps low_var_kl to [-10, 10]


def _as_float(x: Tensor) -> Tensor:
    # bf16/fp16 log-probs lose the small differences the ratios are made of.
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


@dataclass(frozen=True, slots=True)
class PolicyLossResult:
    """Per-token PPO values, unreduced."""

    loss: Tensor  # max(-ratio * A, -clip(ratio) * A), dual-clipped for A < 0 when eps_clip_c is set
    clipfrac: Tensor  # 1.0 where the clipped branch won
    approx_kl: Tensor  # old - new log-prob, slime's ppo_kl


def compute_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> PolicyLossResult:
    """PPO clipped surrogate, asymmetric (DAPO's clip-higher).

    ``ratio = exp(logp - logp_old)``; ``loss = max(-ratio * A, -clip(ratio, 1 - eps_clip, 1 + eps_clip_high) * A)``;
    ``clipfrac = [clipped term > unclipped term]``. With ``eps_clip_c > 1`` (dual clip), tokens with
    ``A < 0`` take ``min(loss, -eps_clip_c * A)``. ``eps_clip_high`` defaults to ``eps_clip``.
    ``old_log_probs`` and ``advantages`` are treated as constants (detached), so passing the
    current log-probs as ``old_log_probs`` gives the on-policy gradient ``-A * grad logp``.
    """
    approx_kl = _as_float(old_log_probs).detach() - _as_float(log_probs)
    return _clipped_surrogate(approx_kl, advantages, eps_clip, eps_clip_high, eps_clip_c)


def compute_gspo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
    *,
    cu_seqlens: Tensor | None = None,
) -> PolicyLossResult:
    """GSPO: ``compute_policy_loss`` with each token's ``ppo_kl`` replaced by its sample's masked mean
    (a sequence-level ratio ``exp(mean_t(logp - logp_old))``, with gradient), as slime's
    ``compute_gspo_kl``. Samples are the rows of ``[B, T]`` tensors or the ``cu_seqlens`` segments."""
    token_kl = _as_float(old_log_probs).detach() - _as_float(log_probs)
    sums, counts = _per_sample_sums(token_kl, loss_mask, cu_seqlens)
    per_sample = sums / counts.clamp_min(1)
    if cu_seqlens is None:
        sequence_kl = per_sample[:, None].expand_as(token_kl)
    else:
        sequence_kl = per_sample[segment_ids(cu_seqlens, token_kl.device)]
    return _clipped_surrogate(sequence_kl, advantages, eps_clip, eps_clip_high, eps_clip_c)


def compute_cispo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
) -> PolicyLossResult:
    """CISPO (MiniMax-M1): ``-sg(clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * logp``, slime's
    ``compute_cispo_loss``. The clipped weight is a constant, so a clipped token still has gradient
    (through ``logp``); ``clipfrac`` marks where the clamp changed the ratio."""
    eps_clip_high = eps_clip if eps_clip_high is None else eps_clip_high
    log_probs = _as_float(log_probs)
    approx_kl = _as_float(old_log_probs).detach() - log_probs
    ratio = torch.exp(-approx_kl)
    weight = ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    loss = -weight.detach() * _as_float(advantages).detach() * log_probs
    return PolicyLossResult(loss=loss, clipfrac=(weight != ratio).to(loss.dtype), approx_kl=approx_kl)


def _clipped_surrogate(
    approx_kl: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float | None, eps_clip_c: float | None
) -> PolicyLossResult:
    """slime's ``compute_policy_loss`` from ``ppo_kl = logp_old - logp`` (per token or per sequence)."""
    eps_clip_high = eps_clip if eps_clip_high is None else eps_clip_high
    if eps_clip_c is not None and eps_clip_c <= 1.0:
        raise ValueError(f"eps_clip_c must be > 1 for dual-clip PPO, got {eps_clip_c}")
    advantages = _as_float(advantages).detach()
    ratio = torch.exp(-approx_kl)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).to(loss.dtype)
    if eps_clip_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -eps_clip_c * advantages), loss)
    return PolicyLossResult(loss=loss, clipfrac=clipfrac, approx_kl=approx_kl)


def compute_approx_kl(
    log_probs: Tensor,
    log_probs_base: Tensor,
    kl_loss_type: KLType = "k1",
    importance_ratio: Tensor | None = None,
) -> Tensor:
    """Per-token estimate of KL(policy || base) from sampled tokens (Schulman's k1/k2/k3).

    With ``d = logp - logp_base``: ``k1 = d``; ``k2 = d^2 / 2``; ``k3 = low_var_kl = exp(-d) - 1 + d``
    (never negative), ``low_var_kl`` then clamped to [-10, 10]. ``importance_ratio`` (slime's
    ``--use-unbiased-kl``: ``exp(logp - logp_old)``) multiplies the estimate before the clamp.
    """
    d = _as_float(log_probs) - _as_float(log_probs_base)
    if kl_loss_type == "k1":
        kl = d
    elif kl_loss_type == "k2":
        kl = d**2 / 2
    elif kl_loss_type in ("k3", "low_var_kl"):
        kl = torch.exp(-d) - 1 + d
    else:
        raise ValueError(f"unknown kl_loss_type {kl_loss_type!r}; expected one of {get_args(KLType)}")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_loss_type == "low_var_kl":
        kl = kl.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    return kl


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last dimension: ``H = -sum_v p_v log p_v``, ``[..., V] -> [...]``.

    Logits of -inf (tokens filtered out by top-k/top-p) count as probability 0.
    """
    return entropy_from_log_probs(torch.log_softmax(_as_float(logits), dim=-1))


def entropy_from_log_probs(log_p: Tensor) -> Tensor:
    """``-sum_v p_v log p_v`` over the last dimension of normalised log-probs; a ``p_v`` of 0 adds 0, not nan."""
    p = log_p.exp()
    return -(p * log_p.masked_fill(p == 0, 0.0)).sum(dim=-1)


@dataclass(frozen=True, slots=True)
class TISResult:
    """Truncated importance sampling, per token."""

    weights: Tensor  # clamp(ratio, tis_clip_low, tis_clip) (icepop: ratio inside the range, else 0), no gradient
    ratio: Tensor  # exp(logp_train - logp_rollout), slime's "tis" metric
    clipfrac: Tensor  # 1.0 where the clamp (or the drop) changed the ratio
    abs: Tensor  # |ratio - 1|, slime's "tis_abs": how far the engine and the trainer disagree


def compute_tis_weights(
    train_log_probs: Tensor,
    rollout_log_probs: Tensor,
    tis_clip: float = 2.0,
    tis_clip_low: float = 0.0,
    mode: TISMode = "truncate",
) -> TISResult:
    """``w = clamp(exp(logp_train - logp_rollout), tis_clip_low, tis_clip)`` (slime's ``--use-tis``);
    ``mode="icepop"``: ``w = ratio`` inside the range and 0 outside (slime's ``icepop_function``).

    ``logp_rollout`` is the behaviour policy's log-prob logged at serving time, ``logp_train`` the
    trainer's log-prob of the same token before this step's update. Corrects for the serving engine
    and the trainer disagreeing (other kernels, precision, or a weight version behind).
    """
    if tis_clip < tis_clip_low:
        raise ValueError(f"tis_clip ({tis_clip}) must be >= tis_clip_low ({tis_clip_low})")
    ratio = torch.exp(_as_float(train_log_probs).detach() - _as_float(rollout_log_probs).detach())
    if mode == "icepop":
        weights = torch.where((ratio >= tis_clip_low) & (ratio <= tis_clip), ratio, torch.zeros_like(ratio))
    else:
        weights = ratio.clamp(tis_clip_low, tis_clip)
    return TISResult(weights=weights, ratio=ratio, clipfrac=(weights != ratio).to(ratio.dtype), abs=(ratio - 1).abs())


def _masked(values: Tensor, loss_mask: Tensor) -> Tensor:
    # where, not multiply: a masked NaN/inf would survive `x * 0`.
    return torch.where(loss_mask.bool(), values, torch.zeros_like(values))


def _per_sample_sums(values: Tensor, loss_mask: Tensor, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(sum_t x m, sum_t m)`` per sample, from ``[B, T]`` rows or one packed ``[T]`` row."""
    masked, mask = _masked(values, loss_mask), loss_mask.to(values.dtype)
    if cu_seqlens is None:
        if values.ndim != 2 or values.shape != loss_mask.shape:
            raise ValueError(
                f"need values and loss_mask of one [B, T] shape (or a packed [T] row with cu_seqlens), "
                f"got {tuple(values.shape)} and {tuple(loss_mask.shape)}"
            )
        return masked.sum(dim=1), mask.sum(dim=1)
    if values.ndim != 1 or values.shape != loss_mask.shape or values.shape[0] != int(cu_seqlens[-1]):
        raise ValueError(
            f"a packed row needs values and loss_mask of shape [cu_seqlens[-1]] = [{int(cu_seqlens[-1])}], "
            f"got {tuple(values.shape)} and {tuple(loss_mask.shape)}"
        )
    ids, n = segment_ids(cu_seqlens, values.device), cu_seqlens.numel() - 1
    zeros = values.new_zeros(n)
    return zeros.index_add(0, ids, masked), zeros.index_add(0, ids, mask)


def sample_mean(
    values: Tensor,
    loss_mask: Tensor,
    num_samples: int | None = None,
    *,
    cu_seqlens: Tensor | None = None,
    denominators: Tensor | None = None,
) -> Tensor:
    """``sum_i (sum_t x[i, t] m[i, t] / max(sum_t m[i, t], 1)) / num_samples`` (``num_samples`` defaults to B).

    Every sample weighs the same whatever its length. Samples are the rows of ``[B, T]`` tensors, or
    the segments ``cu_seqlens`` marks in one packed ``[T]`` row. Pass the step's total sample count as
    ``num_samples`` when a step is split into micro-batches: their results then add up to the whole
    step's value. A fully masked sample adds 0 and still counts in B, as in slime. ``denominators``
    ``[B]`` replace the per-sample mask sums: slime's ``rollout_mask_sums``, where samples of one
    rollout (a shared ``rollout_id``) share their rollout's token count, so they add up to one mean.
    """
    sums, counts = _per_sample_sums(values, loss_mask, cu_seqlens)
    counts = counts if denominators is None else denominators.to(sums.dtype)
    return (sums / counts.clamp_min(1)).sum() / max(sums.shape[0] if num_samples is None else num_samples, 1)


def token_mean(values: Tensor, loss_mask: Tensor, num_tokens: int | None = None) -> Tensor:
    """``sum_{i,t} x[i, t] m[i, t] / num_tokens`` (defaults to ``max(sum m, 1)``): every token weighs the same.

    slime's ``--calculate-per-token-loss``; longer answers weigh more. Any layout (padded or packed).
    Pass the step's total token count as ``num_tokens`` when a step is split into micro-batches.
    """
    if values.shape != loss_mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and loss_mask {tuple(loss_mask.shape)} differ in shape")
    denominator = float(loss_mask.sum()) if num_tokens is None else num_tokens
    return _masked(values, loss_mask).sum() / max(denominator, 1)


def reduce_masked(
    values: Tensor,
    loss_mask: Tensor,
    reduction: Reduction = "sample_mean",
    *,
    num_samples: int | None = None,
    num_tokens: int | None = None,
    cu_seqlens: Tensor | None = None,
    denominators: Tensor | None = None,
) -> Tensor:
    """``sample_mean`` (the default, as slime's; ``denominators`` go to it) or ``token_mean`` of
    ``values`` under ``loss_mask``."""
    if reduction == "sample_mean":
        return sample_mean(values, loss_mask, num_samples, cu_seqlens=cu_seqlens, denominators=denominators)
    if reduction == "token_mean":
        return token_mean(values, loss_mask, num_tokens)
    raise ValueError(f"unknown reduction {reduction!r}; expected one of {get_args(Reduction)}")


@dataclass(frozen=True, slots=True)
class PolicyLossConfig:
    """The knobs of ``policy_loss_function``, named as slime's flags (``--eps-clip`` -> ``eps_clip``)."""

    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # None: eps_clip
    eps_clip_c: float | None = None  # dual clip, > 1
    kl_loss_coef: float = 0.0
    kl_loss_type: KLType = "k1"
    use_unbiased_kl: bool = False
    entropy_coef: float = 0.0
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    tis_mode: TISMode = "truncate"
    reduction: Reduction = "sample_mean"  # "token_mean" is slime's --calculate-per-token-loss
    sft_coef: float = 1.0  # weight of the SFT term (-logp) on supervised samples, e.g. corrected answers

    def __post_init__(self) -> None:
        errors = []
        if self.sft_coef < 0:
            errors.append(f"sft_coef must be >= 0, got {self.sft_coef}")
        if self.eps_clip < 0 or (self.eps_clip_high is not None and self.eps_clip_high < 0):
            errors.append("eps_clip and eps_clip_high must be >= 0")
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            errors.append(f"eps_clip_c must be > 1 (dual-clip PPO), got {self.eps_clip_c}")
        if self.kl_loss_type not in get_args(KLType):
            errors.append(f"kl_loss_type must be one of {get_args(KLType)}, got {self.kl_loss_type!r}")
        if self.tis_clip < self.tis_clip_low or self.tis_clip_low < 0:
            errors.append(f"need 0 <= tis_clip_low <= tis_clip, got {self.tis_clip_low} and {self.tis_clip}")
        if self.tis_mode not in get_args(TISMode):
            errors.append(f"tis_mode must be one of {get_args(TISMode)}, got {self.tis_mode!r}")
        if self.reduction not in get_args(Reduction):
            errors.append(f"reduction must be one of {get_args(Reduction)}, got {self.reduction!r}")
        if errors:
            raise ValueError("invalid policy loss config: " + "; ".join(errors))


@dataclass(frozen=True, slots=True)
class LossResult:
    """The scalar loss to back-propagate and its reduced parts (slime's ``train/`` metric names)."""

    loss: Tensor
    pg_loss: Tensor
    pg_clipfrac: Tensor
    ppo_kl: Tensor
    entropy_loss: Tensor | None = None  # None when no entropy was given
    kl_loss: Tensor | None = None  # None when no reference log-probs were given
    tis: Tensor | None = None  # mean importance ratio, with use_tis
    tis_clipfrac: Tensor | None = None
    tis_abs: Tensor | None = None  # mean |ratio - 1|, with use_tis
    sft_loss: Tensor | None = None  # mean -logp of the supervised samples' tokens, when there are any
    ois: Tensor | None = None  # mean exp(logp - logp_old), the on-policy importance ratio, with use_tis
    train_rollout_logprob_abs_diff: Tensor | None = None  # with rollout log-probs
    tis_metrics: dict[str, Tensor] = dataclasses.field(default_factory=dict)  # a custom TIS function's, reduced

    def parts(self) -> dict[str, Tensor]:
        """The values that are set, detached, keyed by slime's metric names (still on the device)."""
        values = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "tis_metrics")
        named = {name: value.detach() for name, value in values if value is not None}
        return named | {name: value.detach() for name, value in self.tis_metrics.items()}

    def metrics(self) -> dict[str, float]:
        """``parts`` as floats (one device sync)."""
        parts = self.parts()
        return dict(zip(parts, torch.stack(list(parts.values())).tolist(), strict=True))


def compute_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, value_clip: float) -> tuple[Tensor, Tensor]:
    """slime's clipped value loss per token, ``max((V_clip - R)^2, (V - R)^2)`` with
    ``V_clip = V_old + clip(V - V_old, -value_clip, value_clip)``, and where the clip was hit."""
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    loss = torch.maximum((clipped - returns) ** 2, (values - returns) ** 2)
    return loss, ((values - old_values).abs() > value_clip).float()


def policy_loss_function(
    config: PolicyLossConfig,
    log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    old_log_probs: Tensor | None = None,
    ref_log_probs: Tensor | None = None,
    rollout_log_probs: Tensor | None = None,
    entropy: Tensor | None = None,
    num_samples: int | None = None,
    num_tokens: int | None = None,
    cu_seqlens: Tensor | None = None,
    surrogate: Surrogate = "ppo",
    supervised: Tensor | None = None,
    tis_function: TISFunction | None = None,
    denominators: Tensor | None = None,
    pg_reduce: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> LossResult:
    """``loss = R(pg * w) + sft_coef * R(-logp on supervised tokens) + kl_loss_coef * R(KL(logp, logp_ref))
    - entropy_coef * R(H)``.

    ``R`` is ``config.reduction`` over ``loss_mask``; ``pg`` is ``compute_policy_loss`` per token; ``w``
    are the TIS weights (``use_tis``) of the trainer's pre-update log-probs against
    ``rollout_log_probs``, else 1. All tensors are per token, ``[B, T]`` or one packed ``[T]`` row with
    ``cu_seqlens``; ``advantages`` already broadcast (``broadcast_to_tokens``). ``old_log_probs=None``
    means on-policy (``logp`` detached), as slime does when it has not recomputed them.
    ``num_samples``/``num_tokens``: the step's totals when it is split into micro-batches (``sample_mean``).
    ``surrogate``: ``pg`` from ``compute_policy_loss`` (ppo), ``compute_gspo_loss`` or ``compute_cispo_loss``.
    ``supervised``: 1 on tokens trained by likelihood (slime's ``sft_loss``) instead of the policy
    gradient: ``pg`` and its metrics leave them out, the KL and entropy terms keep them.
    ``tis_function``: replaces the built-in TIS (with ``use_tis``); it may reweight ``pg`` and drop
    tokens from it, and its per-token metrics are reduced like the others.
    """
    if surrogate not in get_args(Surrogate):
        raise ValueError(f"surrogate must be one of {get_args(Surrogate)}, got {surrogate!r}")
    if config.use_tis and rollout_log_probs is None:
        raise ValueError("use_tis needs rollout_log_probs (the behaviour log-probs logged at serving time)")
    if config.kl_loss_coef != 0 and ref_log_probs is None:
        raise ValueError("kl_loss_coef != 0 needs ref_log_probs")
    if config.entropy_coef != 0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs entropy")

    def reduce(values: Tensor, mask: Tensor = loss_mask) -> Tensor:
        return reduce_masked(
            values,
            mask,
            config.reduction,
            num_samples=num_samples,
            num_tokens=num_tokens,
            cu_seqlens=cu_seqlens,
            denominators=denominators,
        )

    pg_mask = loss_mask if supervised is None else loss_mask * (1 - supervised.to(loss_mask.dtype))

    old = log_probs.detach() if old_log_probs is None else old_log_probs
    if surrogate == "gspo":
        pg = compute_gspo_loss(
            log_probs,
            old,
            advantages,
            pg_mask,
            config.eps_clip,
            config.eps_clip_high,
            config.eps_clip_c,
            cu_seqlens=cu_seqlens,
        )
    elif surrogate == "cispo":
        pg = compute_cispo_loss(log_probs, old, advantages, config.eps_clip, config.eps_clip_high)
    else:
        pg = compute_policy_loss(log_probs, old, advantages, config.eps_clip, config.eps_clip_high, config.eps_clip_c)
    pg_values, tis, tis_metrics = pg.loss, None, {}
    if config.use_tis and rollout_log_probs is not None and tis_function is not None:
        pg_values, pg_mask, per_token = tis_function(pg_values, _as_float(old).detach(), rollout_log_probs, pg_mask)
        tis_metrics = {name: reduce(value.detach(), pg_mask) for name, value in per_token.items()}
    elif config.use_tis and rollout_log_probs is not None:
        tis = compute_tis_weights(old, rollout_log_probs, config.tis_clip, config.tis_clip_low, config.tis_mode)
        pg_values = pg_values * tis.weights
    pg_loss = reduce(pg_values, pg_mask) if pg_reduce is None else pg_reduce(pg_values, pg_mask)
    loss = pg_loss

    sft_loss = None
    if supervised is not None:
        sft_loss = reduce(-_as_float(log_probs), loss_mask * supervised.to(loss_mask.dtype))
        loss = loss + config.sft_coef * sft_loss

    entropy_loss = None
    if entropy is not None:
        entropy_loss = reduce(_as_float(entropy))
        loss = loss - config.entropy_coef * entropy_loss

    kl_loss = None
    if ref_log_probs is not None:
        ratio = torch.exp(-pg.approx_kl) if config.use_unbiased_kl else None
        kl_loss = reduce(compute_approx_kl(log_probs, ref_log_probs, config.kl_loss_type, ratio))
        loss = loss + config.kl_loss_coef * kl_loss

    abs_diff = None
    if rollout_log_probs is not None:
        abs_diff = reduce((_as_float(old) - _as_float(rollout_log_probs)).abs().detach(), pg_mask)

    return LossResult(
        loss=loss,
        pg_loss=pg_loss.detach(),
        pg_clipfrac=reduce(pg.clipfrac, pg_mask).detach(),
        ppo_kl=reduce(pg.approx_kl, pg_mask).detach(),
        entropy_loss=None if entropy_loss is None else entropy_loss.detach(),
        kl_loss=None if kl_loss is None else kl_loss.detach(),
        tis=None if tis is None else reduce(tis.ratio, pg_mask),
        tis_clipfrac=None if tis is None else reduce(tis.clipfrac, pg_mask),
        tis_abs=None if tis is None else reduce(tis.abs, pg_mask),
        ois=None if tis is None else reduce(torch.exp(-pg.approx_kl).detach(), pg_mask),
        sft_loss=None if sft_loss is None else sft_loss.detach(),
        tis_metrics=tis_metrics,
        train_rollout_logprob_abs_diff=abs_diff,
    )
