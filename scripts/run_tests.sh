#!/usr/bin/env bash
# The whole test suite, as CI runs it: ruff, mypy --strict, import-linter, then pytest (unit,
# property, multi-process, network-namespace and real-vLLM end-to-end tests).
#
# mypy (over a minute of one core from a fresh clone: it reads torch's and vLLM's sources)
# and import-linter run next to pytest instead of before it; pytest's tests leave a core
# idle most of the time on two cores. Their output is printed once pytest ends, and the
# run fails if any of them failed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVXFER_VENV:-.venv}
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
echo "== ruff" && "$VENV/bin/ruff" check kvxfer backends adapters tests examples

static_log=$(mktemp)
trap 'rm -f "$static_log"' EXIT
(
  echo "== mypy --strict" && "$VENV/bin/mypy"
  # The layering contracts in pyproject.toml ([tool.importlinter]); this checkout's kvxfer.
  echo "== lint-imports" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/lint-imports" --no-cache
) >"$static_log" 2>&1 &
static_pid=$!

echo "== pytest (mypy and lint-imports run alongside; their output follows)"
pytest_rc=0
"$VENV/bin/python" -m pytest -p no:cacheprovider --durations=25 "$@" || pytest_rc=$?
static_rc=0
wait "$static_pid" || static_rc=$?
cat "$static_log"
if [ "$static_rc" -ne 0 ]; then
  echo "== mypy or lint-imports failed (exit $static_rc)" >&2
fi
if [ "$pytest_rc" -ne 0 ]; then
  exit "$pytest_rc"
fi
exit "$static_rc"
