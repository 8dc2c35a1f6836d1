"""RL math shared by the torch and Megatron trainers: advantages, policy losses, KL, entropy, TIS.

Pure functions of torch tensors, no state. Formulas and names follow slime (``slime/utils/ppo_utils.py``,
``slime/backends/megatron_utils/loss.py``) so slime users find what they know.
"""

from learner.algorithms.advantages import (
    broadcast_to_tokens,
    feedback_advantages,
    group_mean_std,
    grpo_advantages,
    masked_whiten,
    reinforce_plus_plus_baseline_advantages,
    segment_ids,
)
from learner.algorithms.chunked_log_probs import target_log_probs
from learner.algorithms.losses import (
    KLType,
    LossResult,
    PolicyLossConfig,
    PolicyLossResult,
    Reduction,
    Surrogate,
    TISFunction,
    TISMode,
    TISResult,
    compute_approx_kl,
    compute_cispo_loss,
    compute_gspo_loss,
    compute_policy_loss,
    compute_tis_weights,
    compute_value_loss,
    entropy_from_logits,
    policy_loss_function,
    reduce_masked,
    sample_mean,
    token_mean,
)

__all__ = [
    "KLType",
    "LossResult",
    "PolicyLossConfig",
    "PolicyLossResult",
    "Reduction",
    "Surrogate",
    "TISFunction",
    "TISMode",
    "TISResult",
    "broadcast_to_tokens",
    "compute_approx_kl",
    "compute_cispo_loss",
    "compute_gspo_loss",
    "compute_policy_loss",
    "compute_tis_weights",
    "compute_value_loss",
    "entropy_from_logits",
    "feedback_advantages",
    "group_mean_std",
    "grpo_advantages",
    "masked_whiten",
    "policy_loss_function",
    "reduce_masked",
    "reinforce_plus_plus_baseline_advantages",
    "sample_mean",
    "segment_ids",
    "target_log_probs",
    "token_mean",
]
