.PHONY: setup sglang-env serve test

setup:
	bash scripts/setup.sh

# Real SGLang for tests/sglang, in its own cached venv (first run ~10 min; then a no-op).
sglang-env:
	bash scripts/setup_sglang.sh

serve: setup
	.venv/bin/tandem serve

test: setup sglang-env
	.venv/bin/ruff check .
	.venv/bin/lint-imports
	.venv/bin/pytest -q
