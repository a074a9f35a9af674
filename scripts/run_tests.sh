#!/usr/bin/env bash
# The whole test suite, as CI runs it: ruff, mypy --strict, then pytest (unit,
# property, multi-process, network-namespace and real-vLLM end-to-end tests).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVXFER_VENV:-.venv}
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
echo "== ruff" && "$VENV/bin/ruff" check kvxfer backends adapters tests examples
echo "== mypy --strict" && "$VENV/bin/mypy"
echo "== pytest" && "$VENV/bin/python" -m pytest -p no:cacheprovider "$@"
