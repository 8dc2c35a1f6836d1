"""Policy loss, KL estimators, entropy, TIS and reductions against hand-computed values and properties."""

from __future__ import annotations

import math
from typing import Any, get_args

import pytest
import torch

from learner.algorithms import (
    PolicyLossConfig,
    Reduction,
    compute_approx_kl,
    compute_policy_loss,
    compute_tis_weights,
    entropy_from_logits,
    policy_loss_function,
    reduce_masked,
    sample_mean,
    token_mean,
)
from learner.sample import Sample
from learner.trainers.step_loss import compute_advantages
from learner.trainers.train_config import TrainConfig

LN = math.log


# --- PPO clip ---------------------------------------------------------------------------------------


def test_policy_loss_hand_computed_asymmetric_clip() -> None:
    # eps_clip 0.2, eps_clip_high 0.28: ratios are clipped to [0.8, 1.28]
    ratio = torch.tensor([1.5, 1.25, 0.5, 0.5, 1.5])
    advantages = torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0])
    old = torch.full((5,), -1.0)
    log_probs = (old + ratio.log()).requires_grad_()
    result = compute_policy_loss(log_probs, old, advantages, eps_clip=0.2, eps_clip_high=0.28)
    #   ratio  A   -ratio*A   -clip(ratio)*A   max    clipped
    #   1.5    1   -1.5       -1.28            -1.28  yes  (upside capped)
    #   1.25   1   -1.25      -1.25            -1.25  no   (inside 1 + 0.28; symmetric 0.2 would clip)
    #   0.5    1   -0.5       -0.8             -0.5   no   (lower clip only binds when A < 0)
    #   0.5   -2    1.0        1.6              1.6   yes
    #   1.5   -2    3.0        2.56             3.0   no
    torch.testing.assert_close(result.loss, torch.tensor([-1.28, -1.25, -0.5, 1.6, 3.0]))
    torch.testing.assert_close(result.clipfrac, torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0]))
    torch.testing.assert_close(result.approx_kl, -ratio.log())  # old - new
    # d/dlogp of -ratio*A is -ratio*A where unclipped, 0 where clipped
    result.loss.sum().backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([0.0, -1.25, -0.5, 0.0, 3.0]))

    symmetric = compute_policy_loss(log_probs, old, advantages, eps_clip=0.2)
    torch.testing.assert_close(symmetric.loss[:2], torch.tensor([-1.2, -1.2]))
    torch.testing.assert_close(symmetric.clipfrac[:2], torch.tensor([1.0, 1.0]))


@pytest.mark.parametrize(
    ("ratio", "advantage", "clipped"),
    [
        (1.28 - 1e-4, 1.0, False),  # just inside 1 + eps_clip_high
        (1.28 + 1e-4, 1.0, True),  # just outside
        (0.8 + 1e-4, -1.0, False),  # just inside 1 - eps_clip
        (0.8 - 1e-4, -1.0, True),  # just outside
    ],
)
def test_clip_boundaries_at_one_minus_eps_and_one_plus_eps_high(ratio: float, advantage: float, clipped: bool) -> None:
    old = torch.tensor([-2.0])
    log_probs = (old + LN(ratio)).requires_grad_()
    result = compute_policy_loss(log_probs, old, torch.tensor([advantage]), eps_clip=0.2, eps_clip_high=0.28)
    result.loss.sum().backward()
    assert float(result.clipfrac) == float(clipped)
    bound = 1.28 if advantage > 0 else 0.8
    assert float(result.loss.detach()) == pytest.approx(-(bound if clipped else ratio) * advantage, abs=1e-5)
    # a clipped token passes no gradient; an unclipped one passes -ratio * A
    assert log_probs.grad is not None
    assert float(log_probs.grad) == pytest.approx(0.0 if clipped else -ratio * advantage, abs=1e-5)


def test_dual_clip_caps_negative_advantage_loss() -> None:
    # ratio 4, A = -1: max(4, 1.28) = 4, dual clip with c = 3 takes min(4, 3) = 3;
    # ratio 1.5, A = -2 stays 3.0 (min(3.0, 6.0)); positive advantages are untouched
    old = torch.zeros(3)
    log_probs = torch.tensor([LN(4.0), LN(1.5), LN(1.5)])
    advantages = torch.tensor([-1.0, -2.0, 1.0])
    result = compute_policy_loss(log_probs, old, advantages, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0)
    torch.testing.assert_close(result.loss, torch.tensor([3.0, 3.0, -1.28]))
    with pytest.raises(ValueError, match="eps_clip_c"):
        compute_policy_loss(log_probs, old, advantages, eps_clip_c=1.0)


def test_on_policy_ratio_is_one_with_the_plain_gradient() -> None:
    log_probs = torch.tensor([-0.3, -2.0], requires_grad=True)
    advantages = torch.tensor([0.5, -1.5])
    result = compute_policy_loss(log_probs, log_probs, advantages)  # old detached inside
    torch.testing.assert_close(result.loss, torch.tensor([-0.5, 1.5]))
    result.loss.sum().backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([-0.5, 1.5]))


# --- KL estimators ----------------------------------------------------------------------------------


def test_kl_estimators_hand_computed() -> None:
    log_probs = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    # d = logp - logp_ref = 0.5, -1.0
    torch.testing.assert_close(compute_approx_kl(log_probs, ref, "k1"), torch.tensor([0.5, -1.0]))
    # d^2 / 2 = 0.125, 0.5
    torch.testing.assert_close(compute_approx_kl(log_probs, ref, "k2"), torch.tensor([0.125, 0.5]))
    # exp(-d) - 1 + d: exp(-0.5) - 0.5 = 0.6065307 - 0.5 = 0.1065307; exp(1) - 2 = 0.7182818
    k3 = torch.tensor([0.1065307, 0.7182818])
    torch.testing.assert_close(compute_approx_kl(log_probs, ref, "k3"), k3)
    torch.testing.assert_close(compute_approx_kl(log_probs, ref, "low_var_kl"), k3)
    # unbiased KL: times the importance ratio
    ratio = torch.tensor([2.0, 0.5])
    torch.testing.assert_close(compute_approx_kl(log_probs, ref, "k3", ratio), k3 * ratio)
    with pytest.raises(ValueError, match="kl_loss_type"):
        compute_approx_kl(log_probs, ref, "k4")  # type: ignore[arg-type]


def test_low_var_kl_is_clamped_and_k3_is_not() -> None:
    log_probs = torch.tensor([0.0, 0.0])
    ref = torch.tensor([20.0, -20.0])
    # d = -20: exp(20) - 21 = 4.85e8 -> 10; d = 20: exp(-20) - 1 + 20 = 19.000000002 -> 10
    torch.testing.assert_close(compute_approx_kl(log_probs, ref, "low_var_kl"), torch.tensor([10.0, 10.0]))
    k3 = compute_approx_kl(log_probs, ref, "k3")
    assert float(k3[0]) == pytest.approx(math.exp(20) - 21, rel=1e-5)
    assert float(k3[1]) == pytest.approx(19.0, rel=1e-6)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_is_zero_when_distributions_match(kl_type: str) -> None:
    log_probs = torch.log_softmax(torch.randn(4, 7, generator=torch.Generator().manual_seed(1)), dim=-1)
    assert torch.equal(compute_approx_kl(log_probs, log_probs.clone(), kl_type), torch.zeros(4, 7))  # type: ignore[arg-type]


def test_k3_is_never_negative() -> None:
    generator = torch.Generator().manual_seed(2)
    log_probs = -torch.rand(10_000, generator=generator) * 8
    ref = -torch.rand(10_000, generator=generator) * 8
    assert (compute_approx_kl(log_probs, ref, "k3") >= 0).all()
    assert (compute_approx_kl(log_probs, ref, "low_var_kl") >= 0).all()


def test_kl_of_bf16_inputs_is_computed_in_float32() -> None:
    kl = compute_approx_kl(torch.tensor([-1.0], dtype=torch.bfloat16), torch.tensor([-1.5], dtype=torch.bfloat16))
    assert kl.dtype == torch.float32


# --- entropy ------------------------------------------------------------------------------------------


def test_entropy_hand_computed() -> None:
    logits = torch.tensor(
        [
            [0.0, 0.0, -math.inf],  # two equal tokens, one filtered out: ln 2 = 0.693147
            [0.0, LN(3.0), -math.inf],  # p = 0.25, 0.75: 0.25 ln 4 + 0.75 ln(4/3) = 0.346574 + 0.215762
            [5.0, 5.0, 5.0],  # uniform over 3: ln 3 = 1.098612
            [100.0, 0.0, 0.0],  # (almost) certain: 0
        ]
    )
    expected = torch.tensor([0.693147, 0.562335, 1.098612, 0.0])
    torch.testing.assert_close(entropy_from_logits(logits), expected)
    assert entropy_from_logits(torch.zeros(2, 5, 4)).shape == (2, 5)


# --- truncated importance sampling -------------------------------------------------------------------


def test_tis_weights_hand_computed_and_capped() -> None:
    train = torch.full((3,), -1.0)
    rollout = torch.tensor([-1.0 - LN(3.0), -1.0, -1.0 + LN(4.0)])
    # ratio exp(train - rollout) = 3, 1, 0.25
    result = compute_tis_weights(train, rollout, tis_clip=2.0)
    torch.testing.assert_close(result.ratio, torch.tensor([3.0, 1.0, 0.25]))
    torch.testing.assert_close(result.weights, torch.tensor([2.0, 1.0, 0.25]))  # capped at tis_clip
    torch.testing.assert_close(result.clipfrac, torch.tensor([1.0, 0.0, 0.0]))
    low = compute_tis_weights(train, rollout, tis_clip=2.0, tis_clip_low=0.5)
    torch.testing.assert_close(low.weights, torch.tensor([2.0, 1.0, 0.5]))
    torch.testing.assert_close(low.clipfrac, torch.tensor([1.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="tis_clip"):
        compute_tis_weights(train, rollout, tis_clip=0.5, tis_clip_low=1.0)


def test_tis_weights_never_exceed_the_cap_and_carry_no_gradient() -> None:
    generator = torch.Generator().manual_seed(3)
    train = (-torch.rand(1000, generator=generator) * 10).requires_grad_()
    rollout = -torch.rand(1000, generator=generator) * 10
    result = compute_tis_weights(train, rollout, tis_clip=1.5, tis_clip_low=0.1)
    assert float(result.weights.max()) <= 1.5
    assert float(result.weights.min()) >= 0.1
    assert not result.weights.requires_grad


# --- reductions ---------------------------------------------------------------------------------------

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 1e6, math.nan]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_sample_and_token_means_hand_computed() -> None:
    # sample mean: ((1 + 2 + 3) / 3 + 4 / 1) / 2 = (2 + 4) / 2 = 3; token mean: (1 + 2 + 3 + 4) / 4 = 2.5
    assert float(sample_mean(VALUES, MASK)) == pytest.approx(3.0)
    assert float(token_mean(VALUES, MASK)) == pytest.approx(2.5)
    assert float(reduce_masked(VALUES, MASK)) == pytest.approx(3.0)  # sample_mean is the default
    assert float(reduce_masked(VALUES, MASK, "token_mean")) == pytest.approx(2.5)
    # a step's totals given explicitly: (2 + 4) / 4 samples, 10 / 8 tokens
    assert float(sample_mean(VALUES, MASK, num_samples=4)) == pytest.approx(1.5)
    assert float(token_mean(VALUES, MASK, num_tokens=8)) == pytest.approx(1.25)
    with pytest.raises(ValueError, match="reduction"):
        reduce_masked(VALUES, MASK, "mean")  # type: ignore[arg-type]


def test_fully_masked_sample_adds_zero_but_counts() -> None:
    values = torch.tensor([[2.0, 4.0], [7.0, 7.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    assert float(sample_mean(values, mask)) == pytest.approx(1.5)  # (3 + 0) / 2
    assert float(token_mean(values, mask)) == pytest.approx(3.0)
    assert float(token_mean(values, torch.zeros(2, 2))) == 0.0
    # A step whose every trained token was masked (all samples removed): the denominator is clamped to 1.
    assert float(token_mean(values, torch.zeros(2, 2), num_tokens=0)) == 0.0
    assert float(sample_mean(values, torch.zeros(2, 2), num_samples=0)) == 0.0


@pytest.mark.parametrize("reduction", get_args(Reduction))
def test_micro_batches_add_up_to_the_whole_step(reduction: Reduction) -> None:
    generator = torch.Generator().manual_seed(4)
    values = torch.randn(6, 5, generator=generator)
    mask = (torch.rand(6, 5, generator=generator) > 0.3).long()
    mask[:, 0] = 1
    whole = reduce_masked(values, mask, reduction)
    # each micro-batch divides by the step's totals: 6 samples, sum(mask) tokens
    parts = [
        reduce_masked(values[s], mask[s], reduction, num_samples=6, num_tokens=int(mask.sum()))
        for s in (slice(0, 2), slice(2, 6))
    ]
    torch.testing.assert_close(parts[0] + parts[1], whole)
    assert float(parts[0]) != pytest.approx(float(reduce_masked(values[:2], mask[:2], reduction)))


# --- the whole objective ------------------------------------------------------------------------------

# Two samples of two tokens; the second sample's second token is padding (mask 0).
LOG_PROBS = [[-1.0, -2.0], [-0.5, 0.0]]
ADVANTAGES = torch.tensor([[1.0, 1.0], [-0.5, 0.0]])
LOSS_MASK = torch.tensor([[1, 1], [1, 0]])
REF = torch.tensor([[-1.5, -2.0], [-0.5, 0.0]])  # k1 = logp - ref = 0.5, 0 | 0
ENTROPY = [[0.5, 0.7], [0.9, 9.0]]


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(LOG_PROBS, requires_grad=True), torch.tensor(ENTROPY, requires_grad=True)


def test_policy_loss_function_hand_computed() -> None:
    config = PolicyLossConfig(kl_loss_coef=0.1, entropy_coef=0.01)
    log_probs, entropy = _inputs()
    result = policy_loss_function(config, log_probs, ADVANTAGES, LOSS_MASK, ref_log_probs=REF, entropy=entropy)
    # on-policy: ratio 1, pg = -A = -1, -1 | 0.5;          sample mean ((-1 - 1) / 2 + 0.5) / 2 = -0.25
    # entropy 0.5, 0.7 | 0.9;                             sample mean (0.6 + 0.9) / 2 = 0.75
    # k1 0.5, 0 | 0;                                      sample mean (0.25 + 0) / 2 = 0.125
    # loss = -0.25 + 0.1 * 0.125 - 0.01 * 0.75 = -0.245
    assert float(result.pg_loss) == pytest.approx(-0.25)
    assert float(result.entropy_loss) == pytest.approx(0.75)  # type: ignore[arg-type]
    assert float(result.kl_loss) == pytest.approx(0.125)  # type: ignore[arg-type]
    assert result.loss.item() == pytest.approx(-0.245)
    assert float(result.pg_clipfrac) == 0.0
    assert float(result.ppo_kl) == 0.0
    assert result.tis is None
    result.loss.backward()
    # d loss / d logp[i, t] = (-A + 0.1 * d k1/d logp) / (samples 2 * tokens of i), d k1/d logp = 1:
    #   [0, 0] and [0, 1]: (-1 + 0.1) / 4 = -0.225; [1, 0]: (0.5 + 0.1) / 2 = 0.3; padding: 0
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.225, -0.225], [0.3, 0.0]]))
    # d loss / d H[i, t] = -0.01 / (2 * tokens of i)
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.0025, -0.0025], [-0.005, 0.0]]))


def test_policy_loss_function_token_mean() -> None:
    config = PolicyLossConfig(kl_loss_coef=0.1, entropy_coef=0.01, reduction="token_mean")
    log_probs, entropy = _inputs()
    result = policy_loss_function(config, log_probs, ADVANTAGES, LOSS_MASK, ref_log_probs=REF, entropy=entropy)
    # pg (-1 - 1 + 0.5) / 3 = -0.5; entropy (0.5 + 0.7 + 0.9) / 3 = 0.7; k1 0.5 / 3
    assert result.loss.item() == pytest.approx(-0.5 + 0.1 * 0.5 / 3 - 0.01 * 0.7)


def test_policy_loss_function_applies_tis_to_the_pg_term_only() -> None:
    config = PolicyLossConfig(kl_loss_coef=0.1, entropy_coef=0.01, use_tis=True, tis_clip=2.0)
    log_probs, entropy = _inputs()
    # behaviour log-probs such that exp(logp - logp_rollout) = 3, 1 | 0.5 -> weights 2 (capped), 1 | 0.5
    rollout = torch.tensor(LOG_PROBS) - torch.tensor([[LN(3.0), 0.0], [LN(0.5), 0.0]])
    result = policy_loss_function(
        config, log_probs, ADVANTAGES, LOSS_MASK, ref_log_probs=REF, entropy=entropy, rollout_log_probs=rollout
    )
    # pg * w = -2, -1 | 0.25: sample mean (-1.5 + 0.25) / 2 = -0.625; loss = -0.625 + 0.0125 - 0.0075 = -0.62
    assert float(result.pg_loss) == pytest.approx(-0.625)
    assert result.loss.item() == pytest.approx(-0.62)
    # tis metric: mean ratio ((3 + 1) / 2 + 0.5) / 2 = 1.25; clipped ((1 + 0) / 2 + 0) / 2 = 0.25
    assert float(result.tis) == pytest.approx(1.25)  # type: ignore[arg-type]
    assert float(result.tis_clipfrac) == pytest.approx(0.25)  # type: ignore[arg-type]
    # tis_abs, slime's |ratio - 1|: ((2 + 0) / 2 + 0.5) / 2 = 0.75; ois, exp(logp - logp_old) = 1 on-policy
    assert float(result.tis_abs) == pytest.approx(0.75)  # type: ignore[arg-type]
    assert float(result.ois) == pytest.approx(1.0)  # type: ignore[arg-type]
    # |logp - logp_rollout| = ln 3, 0 | ln 2: ((ln 3) / 2 + ln 2) / 2
    assert float(result.train_rollout_logprob_abs_diff) == pytest.approx((LN(3) / 2 + LN(2)) / 2)  # type: ignore[arg-type]
    result.loss.backward()
    # the weights scale the pg gradient only and are constants:
    #   [0, 0]: (-1 * 2 + 0.1) / 4 = -0.475; [0, 1]: (-1 * 1 + 0.1) / 4 = -0.225; [1, 0]: (0.5 * 0.5 + 0.1) / 2 = 0.175
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.475, -0.225], [0.175, 0.0]]))
    assert set(result.metrics()) == {
        "loss",
        "pg_loss",
        "pg_clipfrac",
        "ppo_kl",
        "entropy_loss",
        "kl_loss",
        "tis",
        "tis_clipfrac",
        "tis_abs",
        "ois",
        "train_rollout_logprob_abs_diff",
    }


def test_tis_weights_use_the_trainers_old_log_probs_not_the_current_ones() -> None:
    config = PolicyLossConfig(eps_clip=10.0, use_tis=True, tis_clip=2.0)  # clip wide open: pg = -ratio * A
    log_probs = torch.tensor([[-1.0]], requires_grad=True)
    old = torch.tensor([[-1.0 - LN(2.0)]])  # ratio exp(logp - old) = 2
    rollout = torch.tensor([[-1.0 - LN(2.0) + LN(4.0)]])  # exp(old - rollout) = 0.25; exp(logp - rollout) = 0.5
    result = policy_loss_function(
        config, log_probs, torch.tensor([[1.0]]), torch.tensor([[1]]), old_log_probs=old, rollout_log_probs=rollout
    )
    # pg = -2 * 1, times w = 0.25 -> -0.5 (with the current log-probs w would be 0.5 and pg -1)
    assert result.loss.item() == pytest.approx(-0.5)
    assert float(result.tis) == pytest.approx(0.25)  # type: ignore[arg-type]
    assert float(result.tis_abs) == pytest.approx(0.75)  # type: ignore[arg-type]
    assert float(result.ppo_kl) == pytest.approx(-LN(2.0))  # old - new
    assert float(result.ois) == pytest.approx(2.0)  # type: ignore[arg-type]  # exp(logp - logp_old)


def test_packed_row_reduces_like_padded_rows() -> None:
    # the padded batch above as one packed row: sample 0 = tokens 0-1, sample 1 = token 2 (+ a prompt token 3)
    cu_seqlens = torch.tensor([0, 2, 4])
    packed_values = torch.tensor([1.0, 2.0, 4.0, 1e6])
    packed_mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # sample mean ((1 + 2) / 2 + 4) / 2 = 2.75, token mean 7 / 3
    assert float(sample_mean(packed_values, packed_mask, cu_seqlens=cu_seqlens)) == pytest.approx(2.75)
    assert float(reduce_masked(packed_values, packed_mask, "token_mean")) == pytest.approx(7 / 3)
    with pytest.raises(ValueError, match="packed"):
        sample_mean(packed_values[:3], packed_mask[:3], cu_seqlens=cu_seqlens)

    config = PolicyLossConfig(kl_loss_coef=0.1, entropy_coef=0.01, use_tis=True)
    rollout = torch.tensor(LOG_PROBS) - torch.tensor([[LN(3.0), 0.0], [LN(0.5), 0.0]])
    padded = policy_loss_function(
        config,
        torch.tensor(LOG_PROBS),
        ADVANTAGES,
        LOSS_MASK,
        ref_log_probs=REF,
        entropy=torch.tensor(ENTROPY),
        rollout_log_probs=rollout,
    )
    packed = policy_loss_function(
        config,
        torch.tensor(LOG_PROBS).flatten(),
        ADVANTAGES.flatten(),
        LOSS_MASK.flatten(),
        ref_log_probs=REF.flatten(),
        entropy=torch.tensor(ENTROPY).flatten(),
        rollout_log_probs=rollout.flatten(),
        cu_seqlens=torch.tensor([0, 2, 4]),
    )
    assert packed.metrics() == pytest.approx(padded.metrics())
    assert packed.loss.item() == pytest.approx(-0.62)


def test_masked_tokens_contribute_nothing() -> None:
    config = PolicyLossConfig(kl_loss_coef=0.1, entropy_coef=0.01, kl_loss_type="low_var_kl", use_tis=True)
    base = policy_loss_function(
        config,
        torch.tensor(LOG_PROBS),
        ADVANTAGES,
        LOSS_MASK,
        ref_log_probs=REF,
        entropy=torch.tensor(ENTROPY),
        rollout_log_probs=torch.tensor(LOG_PROBS),
    )
    # change every input at the padding position [1, 1] to something wild (but finite)
    log_probs = torch.tensor([[-1.0, -2.0], [-0.5, 30.0]], requires_grad=True)
    advantages = ADVANTAGES.clone()
    advantages[1, 1] = 1e4
    ref = REF.clone()
    ref[1, 1] = -50.0
    entropy = torch.tensor([[0.5, 0.7], [0.9, 1e5]], requires_grad=True)
    rollout = torch.tensor([[-1.0, -2.0], [-0.5, -40.0]])
    wild = policy_loss_function(
        config, log_probs, advantages, LOSS_MASK, ref_log_probs=ref, entropy=entropy, rollout_log_probs=rollout
    )
    assert wild.metrics() == pytest.approx(base.metrics())
    wild.loss.backward()
    assert float(log_probs.grad[1, 1]) == 0.0  # type: ignore[index]
    assert float(entropy.grad[1, 1]) == 0.0  # type: ignore[index]


def test_policy_loss_function_refuses_missing_inputs() -> None:
    log_probs = torch.tensor(LOG_PROBS)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        policy_loss_function(PolicyLossConfig(use_tis=True), log_probs, ADVANTAGES, LOSS_MASK)
    with pytest.raises(ValueError, match="ref_log_probs"):
        policy_loss_function(PolicyLossConfig(kl_loss_coef=0.1), log_probs, ADVANTAGES, LOSS_MASK)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss_function(PolicyLossConfig(entropy_coef=0.1), log_probs, ADVANTAGES, LOSS_MASK)


def test_config_reports_every_error_at_once() -> None:
    bad: dict[str, Any] = {
        "eps_clip": -0.1,
        "eps_clip_c": 0.5,
        "kl_loss_type": "k9",
        "tis_clip": 0.5,
        "tis_clip_low": 1.0,
        "reduction": "x",
    }
    with pytest.raises(ValueError) as error:
        PolicyLossConfig(**bad)
    message = str(error.value)
    for part in ("eps_clip and", "eps_clip_c", "kl_loss_type", "tis_clip_low", "reduction"):
        assert part in message
    assert PolicyLossConfig().reduction == "sample_mean"


# --- GSPO and CISPO -------------------------------------------------------------------------------------

# exp(logp - logp_old) per token: 2, 1 | 0.5 (and padding).
OLD_LOG_PROBS = torch.tensor(LOG_PROBS) - torch.tensor([[LN(2.0), 0.0], [LN(0.5), 0.0]])


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_gspo_clips_the_sequence_ratio_hand_computed(layout: str) -> None:
    """slime's compute_gspo_kl: each token's ppo_kl is its sample's masked mean, so every token of a
    sample shares the ratio exp(mean(logp - logp_old)): sqrt(2) for sample 0, 0.5 for sample 1."""

    def run(eps_clip: float) -> tuple[Any, torch.Tensor]:
        log_probs = torch.tensor(LOG_PROBS, requires_grad=True)
        args: tuple[torch.Tensor, ...] = (log_probs, ADVANTAGES, LOSS_MASK)
        kwargs: dict[str, Any] = {"old_log_probs": OLD_LOG_PROBS, "surrogate": "gspo"}
        if layout == "packed":
            args = tuple(t.reshape(-1) for t in args)
            kwargs |= {"old_log_probs": OLD_LOG_PROBS.reshape(-1), "cu_seqlens": torch.tensor([0, 2, 4])}
        result = policy_loss_function(PolicyLossConfig(eps_clip=eps_clip), *args, **kwargs)
        result.loss.backward()
        assert log_probs.grad is not None
        return result, log_probs.grad

    # eps 0.2: sample 0 takes the clipped -1.2 * 1 on both tokens; sample 1 max(0.25, 0.4) = 0.4.
    clipped, grad = run(0.2)
    assert float(clipped.pg_loss) == pytest.approx((-1.2 + 0.4) / 2)
    assert float(clipped.pg_clipfrac) == pytest.approx(1.0)
    assert float(clipped.ppo_kl) == pytest.approx((-LN(2) / 2 + LN(2)) / 2)  # the sequences' ppo_kl
    assert torch.count_nonzero(grad) == 0  # clipped: no gradient
    # Clip wide open: pg = -r * A; d/dlogp_t = -A * r / n_tokens / n_samples, shared by a sample's tokens.
    opened, grad = run(10.0)
    assert float(opened.pg_loss) == pytest.approx((-math.sqrt(2) + 0.25) / 2)
    expected = torch.tensor([[-math.sqrt(2) / 4, -math.sqrt(2) / 4], [0.125, 0.0]])
    torch.testing.assert_close(grad.reshape(2, 2), expected)


def test_cispo_weights_log_probs_by_a_clipped_constant_ratio_hand_computed() -> None:
    """MiniMax-M1's -sg(clip(ratio)) * A * logp: a clipped token keeps its gradient, scaled by the clip."""
    log_probs = torch.tensor(LOG_PROBS, requires_grad=True)
    result = policy_loss_function(
        PolicyLossConfig(eps_clip=0.2), log_probs, ADVANTAGES, LOSS_MASK, old_log_probs=OLD_LOG_PROBS, surrogate="cispo"
    )
    # weights clamp(2, 1 | 0.5) = 1.2, 1 | 0.8; pg = -w * A * logp = 1.2, 2 | -0.2
    assert float(result.pg_loss) == pytest.approx(((1.2 + 2.0) / 2 - 0.2) / 2)
    assert float(result.pg_clipfrac) == pytest.approx((0.5 + 1.0) / 2)
    result.loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.3, -0.25], [0.2, 0.0]]))
    with pytest.raises(ValueError, match="surrogate"):
        policy_loss_function(PolicyLossConfig(), log_probs, ADVANTAGES, LOSS_MASK, surrogate="dpo")  # type: ignore[arg-type]


@pytest.mark.parametrize("estimator", ["gspo", "cispo"])
def test_gspo_and_cispo_take_grpo_advantages_and_their_own_surrogate(estimator: str) -> None:
    config = TrainConfig(advantage_estimator=estimator)  # type: ignore[arg-type]
    assert config.surrogate == estimator and TrainConfig().surrogate == "ppo"
    samples = [Sample(prompt_token_ids=[1], response_token_ids=[2], group_index=0, reward=r) for r in (1.0, 0.0, 0.5)]
    grpo = compute_advantages(samples, TrainConfig())
    torch.testing.assert_close(compute_advantages(samples, config), grpo)


# --- supervised (SFT) samples ---------------------------------------------------------------------------


def test_supervised_tokens_take_the_sft_term_not_the_policy_gradient() -> None:
    """Sample 1 is supervised (a corrected answer): -logp, weighted by sft_coef, instead of pg."""
    log_probs = torch.tensor(LOG_PROBS, requires_grad=True)
    supervised = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    config = PolicyLossConfig(sft_coef=2.0)
    result = policy_loss_function(config, log_probs, ADVANTAGES, LOSS_MASK, supervised=supervised)
    # pg: sample 0 only, on-policy -A = -1, -1 -> (-1 + 0) / 2; sft: -logp = 0.5 on sample 1 -> (0 + 0.5) / 2
    assert float(result.pg_loss) == pytest.approx(-0.5)
    assert float(result.sft_loss) == pytest.approx(0.25)  # type: ignore[arg-type]
    assert result.loss.item() == pytest.approx(-0.5 + 2.0 * 0.25)
    result.loss.backward()
    # pg: -A / 2 tokens / 2 samples; sft: -sft_coef / 1 token / 2 samples; padding: 0
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.25, -0.25], [-1.0, 0.0]]))
    assert policy_loss_function(config, log_probs, ADVANTAGES, LOSS_MASK).sft_loss is None
    with pytest.raises(ValueError, match="sft_coef"):
        PolicyLossConfig(sft_coef=-1.0)


def test_icepop_drops_tokens_outside_the_range_instead_of_clamping() -> None:
    """slime's icepop_function: w = ratio inside [tis_clip_low, tis_clip], else 0."""
    config = PolicyLossConfig(use_tis=True, tis_clip=2.0, tis_mode="icepop")
    log_probs = torch.tensor(LOG_PROBS, requires_grad=True)
    # exp(logp - logp_rollout) = 3, 1 | 0.5 -> weights 0 (dropped), 1 | 0.5
    rollout = torch.tensor(LOG_PROBS) - torch.tensor([[LN(3.0), 0.0], [LN(0.5), 0.0]])
    result = policy_loss_function(config, log_probs, ADVANTAGES, LOSS_MASK, rollout_log_probs=rollout)
    # pg * w = 0, -1 | 0.25: sample mean (-0.5 + 0.25) / 2
    assert float(result.pg_loss) == pytest.approx(-0.125)
    assert float(result.tis_clipfrac) == pytest.approx(0.25)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tis_mode"):
        PolicyLossConfig(tis_mode="clip")  # type: ignore[arg-type]
