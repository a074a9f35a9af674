#!/usr/bin/env bash
# A prefill/decode pair and the kvxfer proxy on one host.
#
#   MODEL=/path/to/model examples/vllm/pd_one_host.sh [pull|push] [extra vllm args...]
#
# Ports (override with the variables): prefill HTTP 8100, side channel 5600; decode HTTP
# 8200, side channel 5700 (two instances on one host need distinct side-channel ports);
# proxy 8000. Then:
#
#   curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
#        -d '{"model": "'"$MODEL"'", "prompt": "Hello", "max_tokens": 32}'
#
# On vLLM's CPU platform add e.g. `--dtype bfloat16 --block-size 32` (the same on both)
# and set VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1. Ctrl-C stops all three.
set -euo pipefail
MODE=${1:-pull}
shift || true
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python}
KVXFER=${KVXFER:-kvxfer}
PREFILL_PORT=${PREFILL_PORT:-8100} PREFILL_SIDE_PORT=${PREFILL_SIDE_PORT:-5600}
DECODE_PORT=${DECODE_PORT:-8200} DECODE_SIDE_PORT=${DECODE_SIDE_PORT:-5700}
PROXY_PORT=${PROXY_PORT:-8000}
export PYTHON

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait; }
trap cleanup EXIT INT TERM

"$HERE/serve_instance.sh" prefill "$MODE" "$PREFILL_PORT" "$PREFILL_SIDE_PORT" "$@" \
    > prefill.log 2>&1 &
pids+=($!)
"$HERE/serve_instance.sh" decode "$MODE" "$DECODE_PORT" "$DECODE_SIDE_PORT" "$@" \
    > decode.log 2>&1 &
pids+=($!)

for port in "$PREFILL_PORT" "$DECODE_PORT"; do
    until curl -sf "localhost:$port/health" > /dev/null; do
        for pid in "${pids[@]}"; do
            kill -0 "$pid" 2>/dev/null || { echo "an instance exited; see prefill.log / decode.log" >&2; exit 1; }
        done
        sleep 1
    done
done
echo "prefill :$PREFILL_PORT and decode :$DECODE_PORT are up ($MODE); proxy on :$PROXY_PORT" >&2

"$KVXFER" proxy --mode "$MODE" --port "$PROXY_PORT" \
    --prefill "http://127.0.0.1:$PREFILL_PORT" --decode "http://127.0.0.1:$DECODE_PORT" \
    --upstream-keepalive 90 &
pids+=($!)
wait "${pids[-1]}"
