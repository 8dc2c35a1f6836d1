.PHONY: setup serve test

setup:
	bash scripts/setup.sh

serve: setup
	.venv/bin/tandem serve

test: setup
	.venv/bin/ruff check .
	.venv/bin/pytest -q
