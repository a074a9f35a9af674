"""A pull across TP sizes between real processes over real NIXL (UCX): producer TP2
(two processes, rank p serving at base port + p) → decode TP1, every (layer, K/V,
head, token) compared; then one producer rank killed mid-life fails the next pull
cleanly with exact invalid blocks (issue 18)."""

from __future__ import annotations

import time

import msgspec
import pytest

from kvxfer.core import wire
from tests.agent_proc import AgentProc, ProcSpec
from tests.tp_ranks import free_base_port

pytestmark = pytest.mark.proc

SEED = 5
KV_HEADS = 2


def _producers(size: int) -> list[AgentProc]:
    for _ in range(10):
        base = free_base_port(size)
        procs: list[AgentProc] = []
        try:
            for r in range(size):
                spec = ProcSpec(
                    engine_id="prefill-tp",
                    role="kv_producer",
                    fill_seed=SEED,
                    kv_heads=KV_HEADS,
                    tp_size=size,
                    tp_rank=r,
                    port=base + r,
                )
                procs.append(AgentProc(spec))
            return procs
        except (RuntimeError, TimeoutError, EOFError):  # a port was taken: another base
            for p in procs:
                p.close()
    raise RuntimeError("no free consecutive ports")


def test_pull_tp2_to_tp1_over_ucx_and_a_killed_rank() -> None:
    producers = _producers(2)
    consumer = AgentProc(
        ProcSpec(engine_id="decode-tp", role="kv_consumer", kv_heads=KV_HEADS, tp_size=1)
    )
    try:
        remote, local, tokens = [4, 9, 2], [11, 3, 7], 2 * 16 + 5
        # One capability and guard word per request, on every rank (as vLLM's scheduler).
        cap, guard = wire.new_capability(), [0, 0x5EED]
        tickets = [p.call("hold", "tp-1", remote, tokens, cap, guard) for p in producers]
        assert [t["tp_size"] for t in tickets] == [2, 2]
        ticket = dict(tickets[0], incarnations=[t["incarnation"] for t in tickets])
        consumer.call("pull", ticket, local, None)
        result = consumer.call("wait", "tp-1", 30)
        assert result["ok"], result
        # blocks x layers x K/V x heads x tokens x head_dim x 2 bytes
        assert result["bytes"] == 3 * 2 * 2 * KV_HEADS * 16 * 32 * 2
        assert consumer.call("check", local, remote, SEED) == 0
        for p in producers:  # each rank got its own DONE notice
            deadline = time.monotonic() + 10
            freed: list[str] = []
            while "tp-1" not in freed and time.monotonic() < deadline:
                freed += p.call("freed")
                time.sleep(0.01)
            assert "tp-1" in freed

        cap, guard = wire.new_capability(), [1, 0xBEEF]
        tickets = [p.call("hold", "tp-2", [5], 16, cap, guard) for p in producers]
        ticket = dict(tickets[0], incarnations=[t["incarnation"] for t in tickets])
        producers[1].crash()
        consumer.call("pull", msgspec.to_builtins(ticket), [6], None)
        result = consumer.call("wait", "tp-2", 30)
        assert not result["ok"]
        assert result["invalid_blocks"] == [6]
        assert "producer rank(s) [1] of [0, 1]" in result["error"]
        assert result["waited_s"] < 25
    finally:
        assert consumer.close() == 0
        for p in producers:
            p.close()
