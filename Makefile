# The two quick-start commands: `make demo` and `make test`. Both create .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: env demo test check lint typecheck unit e2e bench clean properties mutation

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

# The inner loop (docs/TESTING.md): lint, format, layering, strict typing, then the tests
# that run inside pytest's own process (unit, and the properties at the `dev` budget).
# Tests marked e2e (vLLM), netns or proc (child processes) are left to `make test`.
CHECK_TESTS := -m "not e2e and not netns and not proc"
check: lint typecheck
	$(PY) -m pytest -p no:cacheprovider -q $(CHECK_TESTS) tests

# The descriptor properties with 10x the CI example budget (docs/TESTING.md).
PROPERTY_TESTS := tests/test_descriptor_properties.py tests/test_descriptor_errors.py \
	tests/test_blocks.py tests/test_blocks_properties.py
properties: env
	HYPOTHESIS_PROFILE=properties $(PY) -m pytest -p no:cacheprovider -q $(PROPERTY_TESTS)

# Mutation testing of descriptors, _selection, merging, block_lists, blocks, layout, compat
# and wire with mutmut: long (tens of minutes), so not part of `make test`. Score and
# survivors: docs/TESTING.md.
mutation: env
	KVXFER_VENV=$(VENV) bash scripts/mutation.sh

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache mutants
