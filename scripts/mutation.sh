#!/usr/bin/env bash
# Mutation testing of the pure descriptor core with mutmut (make mutation; docs/TESTING.md).
# Mutates the modules listed under [tool.mutmut] in pyproject.toml, runs the tests listed
# there against each mutant with the small `mutation` hypothesis profile, one module at a
# time, and prints the score per module. Slow (tens of minutes on two cores): not in
# `make test`. Usage: scripts/mutation.sh [module ...]   (default: all eighteen modules)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVXFER_VENV:-.venv}
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-mutation}
unset PYTHONPATH  # mutmut puts its mutated copy (mutants/) first on sys.path
JOBS=${MUTATION_JOBS:-$(nproc)}
modules=("$@")
if [ ${#modules[@]} -eq 0 ]; then
    modules=(descriptors _selection merging block_lists blocks layout compat ratio wire heads tp_plan
        ratio_write state_split state_plan state_tp_plan gather_plan gather_cost staging)
fi
for m in "${modules[@]}"; do
    echo "== mutmut: kvxfer.core.$m"
    "$VENV/bin/mutmut" run --max-children "$JOBS" "kvxfer.core.$m.*" >/dev/null
done
"$VENV/bin/mutmut" results --all true | "$VENV/bin/python" scripts/mutation_score.py
