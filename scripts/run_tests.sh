#!/usr/bin/env bash
# The whole test suite, as CI runs it: ruff, mypy --strict, import-linter, then pytest (unit,
# property, multi-process, network-namespace and real-vLLM end-to-end tests).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVXFER_VENV:-.venv}
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
echo "== ruff" && "$VENV/bin/ruff" check kvxfer backends adapters tests examples
echo "== mypy --strict" && "$VENV/bin/mypy"
# The layering contracts in pyproject.toml ([tool.importlinter]); this checkout's kvxfer.
echo "== lint-imports" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/lint-imports" --no-cache
echo "== pytest" && "$VENV/bin/python" -m pytest -p no:cacheprovider --durations=25 "$@"
