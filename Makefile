.PHONY: setup setup-dev sglang-env serve test

# What serving needs (no test tools, no browser).
setup:
	bash scripts/setup.sh

# Serving plus pytest, ruff, mypy, import-linter, playwright and Debian's Chromium.
setup-dev:
	bash scripts/setup.sh dev

# Real SGLang for tests/sglang, in its own cached venv (first run ~10 min; then a no-op).
sglang-env:
	bash scripts/setup_sglang.sh

serve: setup
	.venv/bin/tandem serve

test: setup-dev sglang-env
	.venv/bin/ruff check .
	.venv/bin/lint-imports
	.venv/bin/mypy server storage admin learner tandem migrations
	.venv/bin/pytest -q
