"""host_bounce and nixl_rbln (EMULATED adapter) driven by the real Agent across processes.

The conformance suite checks each backend alone; here the agent's own sequencing is
exercised on top: stage-out at hold and stage-in after landing for host bounce, and
chunk_mode descriptors on the device-to-device path (on the emulation of nixl-rbln,
host memory standing in for NPU memory).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvxfer.backends.nixl_rbln import ADAPTER_ENV
from tests.agent_proc import AgentProc, ProcSpec

pytestmark = pytest.mark.proc

SEED = 31


def _freed(prod: AgentProc, rid: str) -> bool:
    deadline = time.monotonic() + 10
    freed: list[str] = []
    while rid not in freed and time.monotonic() < deadline:
        freed += prod.call("freed")
        time.sleep(0.01)
    return rid in freed


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Spawned children inherit the environment: both agents use the emulated adapter.
    monkeypatch.setenv(ADAPTER_ENV, "emulated")
    yield


def test_host_bounce_pull_stages_out_and_in() -> None:
    prod = AgentProc(
        ProcSpec(engine_id="hb-p", role="kv_producer", backend="host_bounce", fill_seed=SEED)
    )
    cons = AgentProc(ProcSpec(engine_id="hb-d", role="kv_consumer", backend="host_bounce"))
    try:
        for rid, (remote, local, tokens) in {
            "scattered": ([3, 17, 4, 40], [9, 1, 2, 60], 4 * 16 - 5),
            "run": (list(range(20, 30)), list(range(40, 50)), 10 * 16),
        }.items():
            cons.call("zero")
            ticket = prod.call("hold", rid, remote, tokens)
            cons.call("pull", ticket, local, None)
            result = cons.call("wait", rid, 30)
            assert result["ok"], result
            assert cons.call("check", local, remote, SEED) == 0
            assert _freed(prod, rid)
    finally:
        assert cons.close() == 0
        assert prod.close() == 0


def test_host_bounce_push_stages_in_on_arrival() -> None:
    common = {"backend": "host_bounce", "direction": "push"}
    prod = AgentProc(ProcSpec(engine_id="hbp-p", role="kv_producer", fill_seed=SEED, **common))  # type: ignore[arg-type]
    cons = AgentProc(ProcSpec(engine_id="hbp-d", role="kv_consumer", **common))  # type: ignore[arg-type]
    try:
        remote, local, tokens = [8, 9, 30, 2], [33, 34, 35, 1], 4 * 16 - 1
        stub = {
            "engine_id": "hbp-p",
            "host": prod.host,
            "port": prod.port,
            "request_id": "push-1",
            "block_ids": [[]],
            "num_tokens": tokens,
        }
        cons.call("expect_push", stub, local, tokens)
        prod.call("hold", "push-1", remote, tokens)
        result = cons.call("wait", "push-1", 30)
        assert result["ok"], result
        assert cons.call("check", local, remote, SEED) == 0
        assert _freed(prod, "push-1")
    finally:
        assert cons.close() == 0
        assert prod.close() == 0


def test_nixl_rbln_emulated_chunk_mode_pull(emulated: None) -> None:
    chunks = {"backend": "nixl_rbln", "chunk_mode": True, "chunk_tokens": 4}
    prod = AgentProc(ProcSpec(engine_id="rb-p", role="kv_producer", fill_seed=SEED, **chunks))  # type: ignore[arg-type]
    cons = AgentProc(ProcSpec(engine_id="rb-d", role="kv_consumer", **chunks))  # type: ignore[arg-type]
    try:
        remote, local, tokens = [3, 17, 4, 40], [9, 1, 2, 60], 3 * 16 + 5
        ticket = prod.call("hold", "c1", remote, tokens)
        cons.call("pull", ticket, local, None)
        result = cons.call("wait", "c1", 30)
        assert result["ok"], result
        whole = len(local) * 2 * 2 * 16 * 2 * 32 * 2  # blocks×layers×KV×bs×heads×dim×2B
        assert result["bytes"] < whole  # the last block's empty chunks stayed home
        assert cons.call("check_tokens", local, remote, SEED, tokens) == 0
        assert cons.call("check", local, remote, SEED) > 0  # ...so whole blocks differ
        assert _freed(prod, "c1")
    finally:
        assert cons.close() == 0
        assert prod.close() == 0
