#!/usr/bin/env bash
# The GPU measurements docs/PERFORMANCE.md still lacks, as one run on a lent GPU host
# ("GPU memory through UCX"): what UCX list writes (NIXL_UCX_SGL_ENABLE) do to pushes
# of scattered blocks and across TP sizes, TP figures at block sizes 16 and 128, and
# whether the producer's poll pace is the sub-millisecond push's gap.
# Every case is verified byte for byte by the bench; each step has its own time limit,
# so a stuck step costs only its own.
#
# Run from the repository root. On a host without the registry, download the wheels
# beforehand into .whl/ (docs/PERFORMANCE.md, "Running it"); the script installs them
# into /tmp/site and runs kvxfer from this tree (torch must be installed already, and
# kvxfer.egg-info present: the backends are found through its entry points). Results:
# one JSON-lines file per step in $OUT (default /tmp/gpu_check), its table beside it
# (.txt), and its stderr (.err).
#
#   DEVICE=cuda (default) | cuda:N | cpu     where the caches live (cpu: try it here)
#   TOKENS=4000    prompt length        STEP_S=150    seconds per step
#   STEPS="direct poll tp"              which groups of steps to run (in this order)
#   WHEELS=.whl    wheels to install first (when any are there; "" for none)
set -u
OUT=${OUT:-/tmp/gpu_check}
DEVICE=${DEVICE:-cuda}
TOKENS=${TOKENS:-4000}
STEP_S=${STEP_S:-150}
STEPS=${STEPS:-direct poll tp}
PY=${PY:-python3}
WHEELS=${WHEELS-.whl}
mkdir -p "$OUT"

if [ -n "$WHEELS" ] && compgen -G "$WHEELS/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

step() {  # step NAME ARGS...: one bench run, its JSON lines to $OUT/NAME.jsonl
    local name=$1 start rc
    shift
    start=$(date +%s)
    timeout "$STEP_S" "$PY" -m kvxfer.cli bench "$@" --json > "$OUT/$name.jsonl" 2> "$OUT/$name.err"
    rc=$?
    echo "$name: exit $rc after $(($(date +%s) - start)) s"
    if [ -s "$OUT/$name.jsonl" ]; then
        "$PY" -m kvxfer.cli bench --from-json "$OUT/$name.jsonl" > "$OUT/$name.txt" 2>&1
    fi
}

has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }

# Quick steps first (the TP steps start fresh processes for every case).
for sgl in 0 1; do
    has direct && NIXL_UCX_SGL_ENABLE=$sgl step "direct-sgl$sgl" --device "$DEVICE" \
        --models qwen3-0.6b --block-sizes 16,128 --tokens "$TOKENS" \
        --patterns contiguous,scattered --directions pull,push --no-planning --reps 5 --max-reps 9
done
# The push's sub-millisecond gap (0.68x raw NIXL at bs128 contiguous): is it how often
# the producer polls its write? NIXL sends the write's notice only when a poll finds it
# done; raw NIXL busy-polls. The same cases at kvxfer's default pace and at 20 us.
for us in 200 20; do
    has poll && NIXL_UCX_SGL_ENABLE=0 step "poll-${us}us" --device "$DEVICE" \
        --models qwen3-0.6b --block-sizes 128 --tokens "$TOKENS" --patterns contiguous \
        --directions pull,push --no-planning --reps 25 --max-reps 25 --progress-interval-us "$us"
done
for sgl in 0 1; do
    has tp && NIXL_UCX_SGL_ENABLE=$sgl step "tp-sgl$sgl" --tp 1:2,2:1 --device "$DEVICE" \
        --block-sizes 16,128 --tokens "$TOKENS" --firsts 1 --reps 5 --max-reps 9
done
grep -h "kvxfer bench\|ucx \|TP.->TP" "$OUT"/*.txt 2> /dev/null
