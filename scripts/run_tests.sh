#!/usr/bin/env bash
# The whole test suite, as CI runs it: ruff, mypy --strict, import-linter, then pytest (unit,
# property, multi-process, network-namespace and real-vLLM end-to-end tests).
#
# mypy (over a minute of one core from a fresh clone: it reads torch's and vLLM's sources)
# and import-linter run next to pytest instead of before it, at the lowest priority
# (nice 19): they take the CPU the tests leave idle and never slow the e2e half, the
# suite's longest path. Their output is printed once pytest ends, and the run fails if
# any of them failed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVXFER_VENV:-.venv}
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
echo "== ruff" && "$VENV/bin/ruff" check kvxfer backends adapters tests examples

static_log=$(mktemp)
trap 'rm -f "$static_log"' EXIT
static_checks() {
  (
    echo "== mypy --strict" && nice -n 19 "$VENV/bin/mypy"
    # The layering contracts in pyproject.toml ([tool.importlinter]); this checkout's kvxfer.
    echo "== lint-imports" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" nice -n 19 "$VENV/bin/lint-imports" --no-cache
  ) >"$static_log" 2>&1 &
  static_pid=$!
}

PYTEST=("$VENV/bin/python" -m pytest -p no:cacheprovider --durations=25)
pytest_rc=0
static_checks
if [ "$#" -gt 0 ] || [ "${KVXFER_TEST_SPLIT:-1}" = "0" ]; then
  echo "== pytest (mypy and lint-imports run alongside; their output follows)"
  "${PYTEST[@]}" "$@" || pytest_rc=$?
else
  # Two pytest processes side by side (KVXFER_TEST_SPLIT=0: one). The end-to-end tests
  # spend much of their time waiting on engines and sockets, so one half is the e2e
  # tests that share the session's vLLM engines (tests/e2e/conftest.py), in the
  # background, with tests that mostly wait on the wire (marker e2e_half); the other is
  # every other test, with the e2e tests that start only servers of their own (marker
  # own_servers). Both markers are there to even the halves. Each prints its own
  # report, the background half's after the other's; the run fails if either failed.
  # On two cores this takes about the longer half instead of the sum (docs/TESTING.md).
  e2e_log=$(mktemp)
  trap '{ [ -z "${e2e_pid:-}" ] || kill "$e2e_pid" 2>/dev/null || true; }; rm -f "$static_log" "$e2e_log"' EXIT
  e2e_half="(e2e and not own_servers) or e2e_half"
  echo "== pytest -m '$e2e_half', in the background (its report follows the other half's)"
  # Each half picks its servers' and side channels' ports from its own part of the range
  # below the kernel's ephemeral ports (tests/ports.py), so the two never pick the same.
  KVXFER_TEST_PORTS=20000-26383 "${PYTEST[@]}" -m "$e2e_half" >"$e2e_log" 2>&1 &
  e2e_pid=$!
  echo "== pytest -m 'not ($e2e_half)' (mypy and lint-imports run alongside; their output follows)"
  KVXFER_TEST_PORTS=26384-32767 "${PYTEST[@]}" -m "not ($e2e_half)" || pytest_rc=$?
  e2e_rc=0
  wait "$e2e_pid" || e2e_rc=$?
  echo "== pytest -m '$e2e_half'"
  cat "$e2e_log"
  if [ "$pytest_rc" -eq 0 ]; then pytest_rc=$e2e_rc; fi
fi
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
