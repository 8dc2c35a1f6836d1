"""slime's import paths for plugins, backed by tandem's learner (see ../README.md)."""
