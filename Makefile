# The two quick-start commands: `make demo` and `make test`. Both create .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: env demo test lint typecheck unit e2e bench clean

env:
	@bash scripts/setup_env.sh

demo: env
	$(VENV)/bin/kvxfer demo

lint: env
	$(VENV)/bin/ruff check kvxfer backends adapters tests examples
	$(VENV)/bin/ruff format --check kvxfer backends adapters tests examples
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports --no-cache

typecheck: env
	$(VENV)/bin/mypy

# The whole suite: lint, strict typing, unit + property + process + end-to-end tests.
test: env
	bash scripts/run_tests.sh

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
