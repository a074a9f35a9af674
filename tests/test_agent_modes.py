"""chunk_mode, swa_window_mode and push_stream between two real processes.

These modes need a device-to-device backend: ``nixl_rbln`` on its EMULATED adapter
(host memory registered through real NIXL stands in for the NPU). Each test checks, per
region, per block, per token, exactly which bytes landed — the moved set must be what
the descriptor algebra says, no more and no less.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.agent_proc import AgentProc, ProcSpec

pytestmark = pytest.mark.proc

SEED = 11
BS = 16


def _pair(direction: str = "pull", **kw: object) -> tuple[AgentProc, AgentProc]:
    common = dict(backend="nixl_rbln", rbln_emulated=True, direction=direction, num_blocks=32, **kw)
    prod = AgentProc(
        ProcSpec(engine_id=f"p-{direction}", role="kv_producer", fill_seed=SEED, **common)
    )  # type: ignore[arg-type]
    cons = AgentProc(ProcSpec(engine_id=f"d-{direction}", role="kv_consumer", **common))  # type: ignore[arg-type]
    return prod, cons


@pytest.fixture(scope="module")
def chunk_pair() -> Iterator[tuple[AgentProc, AgentProc]]:
    # one prefill step = 4 tokens -> chunk size 4 (the smallest divisor of 16 >= 4)
    prod, cons = _pair(chunk_mode=True, prefill_step_tokens=4)
    yield prod, cons
    assert cons.close() == 0 and prod.close() == 0


def test_chunk_mode_sends_only_the_chunks_holding_tokens(
    chunk_pair: tuple[AgentProc, AgentProc],
) -> None:
    prod, cons = chunk_pair
    remote, local = [3, 4, 5, 6], [10, 11, 12, 13]
    tokens = 3 * BS + 5  # last block holds tokens 0..4: chunks [0,4) and [4,8) go
    cons.call("zero")
    ticket = prod.call("hold", "c1", remote, tokens)
    cons.call("pull", ticket, local, None)
    result = cons.call("wait", "c1", 30)
    assert result["ok"], result
    token_bytes = 2 * 32 * 2  # kv_heads × head_dim × bf16
    regions = 2 * 2
    assert result["bytes"] == (3 * BS + 8) * token_bytes * regions
    landed = cons.call("token_map", local, remote, SEED)
    for region in landed:
        for b, block in enumerate(region):
            want = BS if b < 3 else 8
            assert block == [True] * want + [False] * (BS - want), (b, block)


def test_chunk_mode_full_last_block_goes_whole(chunk_pair: tuple[AgentProc, AgentProc]) -> None:
    prod, cons = chunk_pair
    remote, local = [7, 8], [20, 21]
    cons.call("zero")
    ticket = prod.call("hold", "c2", remote, 2 * BS)
    cons.call("pull", ticket, local, None)
    assert cons.call("wait", "c2", 30)["ok"]
    assert cons.call("check", local, remote, SEED) == 0


def test_swa_window_mode_sends_only_the_window() -> None:
    # odd layers use sliding-window attention with an 8-token window: granules of 8
    prod, cons = _pair(swa_window_mode=True, sliding_window=8)
    try:
        remote, local = [1, 2, 3, 4], [9, 10, 11, 12]
        tokens = 3 * BS + 6  # window = tokens 46..53: block 2's 2nd granule, block 3's 1st
        ticket = prod.call("hold", "w1", [remote, remote], tokens)
        cons.call("pull", ticket, [local, local], None)
        result = cons.call("wait", "w1", 30)
        assert result["ok"], result
        landed = cons.call("token_map", local, remote, SEED)
        for index, region in enumerate(landed):
            layer = index // 2
            if layer % 2 == 0:  # full attention: every block whole, partial last too
                assert all(all(block) for block in region), (index, region)
            else:
                assert not any(region[0]) and not any(region[1])
                assert region[2] == [False] * 8 + [True] * 8
                assert region[3] == [True] * 8 + [False] * 8
    finally:
        assert cons.close() == 0 and prod.close() == 0


def test_push_stream_writes_closed_blocks_early_and_the_rest_at_the_end() -> None:
    prod, cons = _pair(direction="push", push_stream=True)
    try:
        remote, local = [2, 3, 4, 5, 6], [15, 16, 17, 18, 19]
        tokens = 4 * BS + 7
        stub = {
            "engine_id": "p-push",
            "host": prod.host,
            "port": prod.port,
            "request_id": "s1",
            "block_ids": [[]],
            "num_tokens": tokens,
        }
        cons.call("expect_push", stub, local, tokens)

        def streamed(early: list[list[list[bool]]]) -> bool:
            return all(all(region[0]) and all(region[1]) for region in early)

        # Prefill closes two blocks. A stream before the registration reaches the
        # producer writes nothing (there is no consumer yet), so the engine's next
        # step streams again (an engine streams at every prefill step); only the
        # deadline bounds the wait.
        deadline = time.monotonic() + 30.0
        while True:
            prod.call("stream", "s1", remote[:2], 2 * BS)
            early = cons.call("token_map", local, remote, SEED)
            if streamed(early) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert streamed(early), "streamed blocks missing 30 s after the first stream"
        assert not any(any(region[4]) for region in early), "tail written before prefill ended"
        prod.call("hold", "s1", remote, tokens)
        result = cons.call("wait", "s1", 30)
        assert result["ok"], result
        assert cons.call("check", local[:4], remote[:4], SEED) == 0
        tail = cons.call("token_map", local[4:], remote[4:], SEED)
        assert all(region[0][:7] == [True] * 7 for region in tail)
    finally:
        assert cons.close() == 0 and prod.close() == 0


def test_token_sharded_blocks_with_chunk_mode() -> None:
    # every block is cut by TOKEN into 2 shards (one region each, 8 tokens apiece):
    # one block spans one descriptor per shard, and chunks are cut inside each shard
    prod, cons = _pair(shards=2, chunk_mode=True, prefill_step_tokens=4)
    try:
        remote, local = [5, 6, 7], [1, 2, 3]
        tokens = 2 * BS + 5  # last block: shard 0 holds tokens 0..7 -> chunks [0,4) [4,8)
        ticket = prod.call("hold", "sh1", remote, tokens)
        cons.call("pull", ticket, local, None)
        result = cons.call("wait", "sh1", 30)
        assert result["ok"], result
        landed = cons.call("token_map", local, remote, SEED)
        assert len(landed) == 2 * 2 * 2  # layers × K/V × shards
        for index, region in enumerate(landed):
            shard = index % 2
            assert all(region[0]) and all(region[1])
            assert region[2] == ([True] * 8 if shard == 0 else [False] * 8), (index, region[2])
        token_bytes = 2 * 32 * 2
        assert result["bytes"] == (2 * BS + 8) * token_bytes * 2 * 2
    finally:
        assert cons.close() == 0 and prod.close() == 0
