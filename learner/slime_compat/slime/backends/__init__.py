"""slime.backends: the loss helpers a custom loss imports."""
