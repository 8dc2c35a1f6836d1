"""slime.rollout.filter_hub: the dynamic-sampling filter types and built-ins."""
