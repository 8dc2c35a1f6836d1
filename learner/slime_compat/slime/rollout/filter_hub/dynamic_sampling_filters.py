"""``slime.rollout.filter_hub.dynamic_sampling_filters``: the built-in filters, tandem's (``learner.batching``)."""

from learner.batching import check_reward_nonzero_std, check_reward_nonzero_std_with_fallback

__all__ = ["check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"]
