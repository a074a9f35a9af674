"""Prefill and decode with different ``--block-size`` on real vLLM CPU engines (issue 54):
a pull pair with prefill blocks of 128 and decode blocks of 32 (the CPU attention's
smallest) gives unified's greedy output for prompts shorter than a block, across block
boundaries and long, with nothing but the connector name; the decode reads each
128-block's 32-token pieces in place (kvxfer.core.ratio) from vLLM's CPU cache (K
element-major inside each head).

The direct path (``kv_buffer_device: "rbln"`` with the emulated nixl-rbln adapter: host
memory over NIXL's UCX plugin) posts the address runs; host bounce does not, and
refuses such a pull by name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .pd import PD_ENV, PDPair, kv_config, reference, through_pd
from .servers import VllmServer, free_port, start_server, wait_all_healthy
from .test_unified_baseline import PROMPTS

pytestmark = pytest.mark.e2e

# vLLM 0.32's CPU attention takes block sizes that are multiples of 32 only.
PREFILL_BLOCK, DECODE_BLOCK = 128, 32
EMULATED = {"KVXFER_RBLN_ADAPTER": "emulated"}


@pytest.fixture(scope="module")
def ratio_pair(tiny_model_dir: Path, e2e_log_dir: Path) -> Iterator[PDPair]:
    p_port, d_port = free_port(), free_port()
    ahead = {"connect_ahead": [{"host": "localhost", "port": p_port}]}
    prefill = start_server(
        "prefill-bs128",
        tiny_model_dir,
        e2e_log_dir,
        block_size=PREFILL_BLOCK,
        kv_transfer_config=kv_config("kv_producer", "pull", buffer_device="rbln"),
        env={**PD_ENV, **EMULATED, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(p_port)},
        wait=False,
    )
    decode = start_server(
        "decode-bs32",
        tiny_model_dir,
        e2e_log_dir,
        block_size=DECODE_BLOCK,
        kv_transfer_config=kv_config("kv_consumer", "pull", buffer_device="rbln", extra=ahead),
        env={**PD_ENV, **EMULATED, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(d_port)},
        wait=False,
    )
    pair = PDPair("pull", prefill, decode)
    try:
        wait_all_healthy([prefill, decode])
        yield pair
    finally:
        pair.stop()


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prefill_block_128_to_decode_block_32_equals_unified(
    ratio_pair: PDPair, unified_server: VllmServer, name: str
) -> None:
    prompt = PROMPTS[name]
    got = through_pd(ratio_pair, prompt, prompt)
    assert got == reference(unified_server, prompt)
    log = ratio_pair.decode.log_path.read_text(errors="replace")
    assert "load failed" not in log.lower(), log[-3000:]
