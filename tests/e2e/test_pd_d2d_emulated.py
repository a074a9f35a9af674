"""The device-to-device path (``kv_buffer_device: "rbln"``) on a real vLLM engine, with
the EMULATED nixl-rbln adapter (``KVXFER_RBLN_ADAPTER=emulated``: host memory over
NIXL's UCX plugin stands in for NPU memory; no NPU here). It proves the adapter's
D2D wiring — registration deferred until the engine's first step, the R-VLLM-4 lines
an operator greps for, push_stream writing blocks during a chunked prefill — not the
RBLN plugin."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .pd import PD_ENV, PDPair, decode, kv_config, prefill, reference, through_pd
from .servers import VllmServer, free_port, start_server, wait_all_healthy
from .test_unified_baseline import PROMPTS

pytestmark = pytest.mark.e2e


def _emulated_pair(
    mode: str, model_dir: Path, log_dir: Path, extra: dict[str, Any], args: tuple[str, ...]
) -> PDPair:
    servers = [
        start_server(
            f"{role}-d2d-emulated-{mode}",
            model_dir,
            log_dir,
            kv_transfer_config=kv_config(kv_role, mode, buffer_device="rbln", extra=extra),
            env={
                **PD_ENV,
                "KVXFER_RBLN_ADAPTER": "emulated",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            },
            extra_args=args,
            wait=False,
        )
        for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer"))
    ]
    wait_all_healthy(servers)
    return PDPair(mode, servers[0], servers[1])


@pytest.fixture(scope="module")
def d2d_pair(tiny_model_dir: Path, e2e_log_dir: Path) -> Iterator[PDPair]:
    pair = _emulated_pair("pull", tiny_model_dir, e2e_log_dir, {}, ())
    try:
        yield pair
    finally:
        pair.stop()


@pytest.fixture(scope="module")
def d2d_stream_pair(tiny_model_dir: Path, e2e_log_dir: Path) -> Iterator[PDPair]:
    """Push with push_stream; prefill runs in 64-token steps (chunked prefill)."""
    pair = _emulated_pair(
        "push",
        tiny_model_dir,
        e2e_log_dir,
        {"push_stream": True},
        ("--max-num-batched-tokens", "64"),
    )
    try:
        yield pair
    finally:
        pair.stop()


def test_d2d_defers_registration_to_the_first_step_and_matches_unified(
    d2d_pair: PDPair, unified_server: VllmServer
) -> None:
    p, d = d2d_pair.prefill, d2d_pair.decode
    for server in (p, d):
        log = server.log_text()
        assert "RBLN NIXL (D2D): deferring registration" in log
        assert "RBLN NIXL (D2D): registered" not in log  # healthy, yet no step ran
        assert "RBLN NIXL: nixl-rbln not available" not in log
    for name in ("sub_block", "multi_block_partial"):
        prompt = PROMPTS[name]
        assert through_pd(d2d_pair, prompt, prompt) == reference(unified_server, prompt)
    assert "RBLN NIXL (D2D): registered" in p.log_text()
    assert "RBLN NIXL (D2D): registered" in d.log_text()
    assert "RBLN NIXL (D2D): got" in d.log_text()  # ... remote descriptor(s) for engine
    assert "remote descriptor(s) for engine" in d.log_text()


def test_push_stream_writes_blocks_during_chunked_prefill(
    d2d_stream_pair: PDPair, unified_server: VllmServer
) -> None:
    """Decode registers first (concurrent dispatch, one request id); the producer then
    writes the blocks each 64-token prefill step closes, and the rest with the hold:
    several writes for one request, output equal to the unified instance's."""
    p, d = d2d_stream_pair.prefill, d2d_stream_pair.decode
    first = prefill(p, "who is the producer")
    decode(d, "who is the producer", first, max_tokens=1)
    address = {k: first[k] for k in ("remote_engine_id", "remote_host", "remote_port")}
    prompt = PROMPTS["long"]  # > 4 blocks: at least 3 prefill steps of 64 tokens
    writes0 = p.metric("vllm:kvxfer_push_writes_total")
    rid = f"e2e-stream-{uuid.uuid4().hex[:8]}"
    result: dict[str, Any] = {}

    def run_decode() -> None:
        try:
            params = {"do_remote_prefill": True, "transfer_mode": "push", **address}
            result["tokens"] = decode(d, prompt, params, request_id=rid)
        except BaseException as exc:  # reported below
            result["error"] = exc

    thread = threading.Thread(target=run_decode)
    thread.start()
    thread.join(timeout=1.0)  # decode registers before prefill starts
    prefill(p, prompt, rid)
    thread.join(timeout=60)
    assert "error" not in result, result.get("error")
    assert result["tokens"] == reference(unified_server, prompt)
    deadline = time.monotonic() + 10  # Prometheus sees the stats at the next step
    while p.metric("vllm:kvxfer_push_writes_total") - writes0 < 3:
        assert time.monotonic() < deadline, "push_stream wrote the prompt in fewer than 3 parts"
        time.sleep(0.25)
