"""``slime.rollout.filter_hub.base_types``: the dynamic filter's result, tandem's (``learner.batching``)."""

from learner.batching import DynamicFilterOutput

__all__ = ["DynamicFilterOutput"]
