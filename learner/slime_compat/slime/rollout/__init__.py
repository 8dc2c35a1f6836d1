"""slime.rollout: base_types, sglang_rollout, filter_hub and rm_hub, as plugins import them."""
