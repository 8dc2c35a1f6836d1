"""slime.backends.megatron_utils: the loss helpers a custom loss imports."""
