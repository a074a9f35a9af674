"""Prefill and decode with different ``--block-size`` on real vLLM CPU engines (issue 54).

Three pairs:

- pull, prefill 128 → decode 64 through the default path (host bounce,
  ``kv_buffer_device: "cpu"``), with nothing but the connector name in the config;
- pull, prefill 128 → decode 32 (the CPU attention's smallest) through the direct path
  (``kv_buffer_device: "rbln"`` with the emulated nixl-rbln adapter: host memory over
  NIXL's UCX plugin);
- push, prefill 32 → decode 128 (the reverse ratio) through host bounce.

Each gives unified's greedy output for prompts shorter than a block, across block
boundaries and long: the side that posts names each block's pieces of the smaller size
in place (kvxfer.core.ratio, ratio_write) in vLLM's CPU cache (K element-major inside
each head). A negative control negates the first block that landed in decode's first
layer (tests/e2e/state_connector.py) and the output must change, so equality means
decode attended to the bytes kvxfer moved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .pd import PD_ENV, PDPair, kv_config, reference, through_pd
from .servers import VllmServer, free_port, start_server, wait_all_healthy
from .state_connector import FLIP_KV_MARK, KV_ENV
from .test_unified_baseline import PROMPTS

pytestmark = pytest.mark.e2e

# vLLM 0.32's CPU attention takes block sizes that are multiples of 32 only.
PREFILL_BLOCK = 128
MODULE = "tests.e2e.state_connector"
# A prompt no other test sends: the corrupted blocks stay in decode's prefix cache.
CONTROL = "Lantern keepers " + PROMPTS["long"]


@dataclasses.dataclass(frozen=True)
class RatioPath:
    name: str
    mode: str
    buffer_device: str
    prefill_block: int
    decode_block: int
    env: dict[str, str]


PATHS = [
    RatioPath("pull-host-bounce", "pull", "cpu", PREFILL_BLOCK, 64, {}),
    RatioPath(
        "pull-direct", "pull", "rbln", PREFILL_BLOCK, 32, {"KVXFER_RBLN_ADAPTER": "emulated"}
    ),
    RatioPath("push-host-bounce", "push", "cpu", 32, PREFILL_BLOCK, {}),
]


@pytest.fixture(scope="module", params=PATHS, ids=[p.name for p in PATHS])
def ratio_pair(
    request: pytest.FixtureRequest, tiny_model_dir: Path, e2e_log_dir: Path
) -> Iterator[PDPair]:
    path: RatioPath = request.param
    p_port, d_port = free_port(), free_port()
    # The side that posts (pull: decode, push: prefill) connects ahead to the other.
    pull = path.mode == "pull"
    ahead = {"connect_ahead": [{"host": "localhost", "port": p_port if pull else d_port}]}
    base: dict[str, Any] = {"kv_connector_module_path": MODULE, "buffer_device": path.buffer_device}
    prefill = start_server(
        f"prefill-bs{path.prefill_block}-{path.name}",
        tiny_model_dir,
        e2e_log_dir,
        block_size=path.prefill_block,
        kv_transfer_config=kv_config(
            "kv_producer", path.mode, extra=None if pull else ahead, **base
        ),
        env={**PD_ENV, **path.env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(p_port)},
        wait=False,
    )
    decode = start_server(
        f"decode-bs{path.decode_block}-{path.name}",
        tiny_model_dir,
        e2e_log_dir,
        block_size=path.decode_block,
        kv_transfer_config=kv_config(
            "kv_consumer", path.mode, extra=ahead if pull else None, **base
        ),
        env={**PD_ENV, **path.env, KV_ENV: "1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(d_port)},
        wait=False,
    )
    pair = PDPair(path.mode, prefill, decode)
    try:
        wait_all_healthy([prefill, decode])
        yield pair
    finally:
        pair.stop()


@pytest.mark.parametrize("name", list(PROMPTS))
def test_different_block_sizes_equal_unified(
    ratio_pair: PDPair, unified_server: VllmServer, name: str
) -> None:
    prompt = PROMPTS[name]
    got = through_pd(ratio_pair, prompt, prompt)
    assert got == reference(unified_server, prompt)
    log = ratio_pair.decode.log_text()
    assert "load failed" not in log.lower(), log[-3000:]


def test_block_ratio_negative_control(ratio_pair: PDPair, unified_server: VllmServer) -> None:
    got = through_pd(ratio_pair, CONTROL, CONTROL, tag=FLIP_KV_MARK)
    assert "flip-kv of slot" in ratio_pair.decode.log_text(), "the corrupting connector did not run"
    assert got != reference(unified_server, CONTROL), "decode ignored the KV kvxfer moved"
