"""The device-to-device path (``kv_buffer_device: "rbln"``) on a real vLLM engine, with
the EMULATED nixl-rbln adapter (``KVXFER_RBLN_ADAPTER=emulated``: host memory over
NIXL's UCX plugin stands in for NPU memory; no NPU here). It proves the adapter's
D2D wiring — registration deferred until the engine's first step, the R-VLLM-4 lines
an operator greps for — not the RBLN plugin."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .pd import PD_ENV, PDPair, kv_config, reference, through_pd
from .servers import VllmServer, free_port, start_server, wait_all_healthy
from .test_unified_baseline import PROMPTS

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def d2d_pair(tiny_model_dir: Path, e2e_log_dir: Path) -> Iterator[PDPair]:
    servers = [
        start_server(
            f"{role}-d2d-emulated",
            tiny_model_dir,
            e2e_log_dir,
            kv_transfer_config=kv_config(kv_role, "pull", buffer_device="rbln"),
            env={
                **PD_ENV,
                "KVXFER_RBLN_ADAPTER": "emulated",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            },
            wait=False,
        )
        for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer"))
    ]
    wait_all_healthy(servers)
    pair = PDPair("pull", servers[0], servers[1])
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
