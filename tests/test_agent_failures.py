"""Failure behaviour between real processes: dead and restarted producers, leases,
aborts, hostile side-channel input, and clean interpreter exit."""

from __future__ import annotations

import time

import pytest

from tests.agent_proc import AgentProc, ProcSpec

pytestmark = pytest.mark.proc

SEED = 5


def _wait_freed(prod: AgentProc, rid: str, timeout: float) -> float:
    t0 = time.monotonic()
    freed: list[str] = []
    while rid not in freed:
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{rid} not released after {timeout}s")
        freed += prod.call("freed")
        time.sleep(0.02)
    return time.monotonic() - t0


def test_producer_killed_mid_transfer_fails_in_bounded_time() -> None:
    # Tiny blocks and a scattered block list: ~200k descriptors keep the pull busy for
    # about half a second here, and the producer is killed a moment after it started.
    spec = dict(layers=2, kv_heads=1, head_dim=8, num_blocks=120_000, transfer_timeout_s=8.0)
    prod = AgentProc(ProcSpec(engine_id="p-kill", role="kv_producer", fill_seed=SEED, **spec))
    cons = AgentProc(ProcSpec(engine_id="d-kill", role="kv_consumer", **spec))
    try:
        remote = list(range(0, 100_000, 2))
        local = list(range(1, 100_001, 2))
        # first a small pull, so the handshake is done and the big one posts at once
        warm = prod.call("hold", "warm", [0], 16)
        cons.call("pull", warm, [1], None)
        assert cons.call("wait", "warm", 20)["ok"]
        ticket = prod.call("hold", "big", remote, len(remote) * 16)
        t0 = time.monotonic()
        cons.send("pull", ticket, local, None)  # do not wait: kill while it runs
        time.sleep(0.15)
        prod.crash()
        cons.reply(30)
        result = cons.call("wait", "big", 30)
        elapsed = time.monotonic() - t0
        if result["ok"]:
            pytest.fail("the pull reported success although the producer died under it")
        assert result["failure"] in ("peer_gone", "transport", "timeout"), result
        assert result["invalid_blocks"] == sorted(local)
        assert elapsed < 15, f"failure took {elapsed:.1f}s to surface"
    finally:
        prod.close()
        assert cons.close() == 0


def test_restarted_producer_is_rehandshaken() -> None:
    # A long lease: on a loaded host the restart below can take longer than the
    # default 30 s, and the stale ticket must fail for the restart, not its lease.
    first = AgentProc(
        ProcSpec(engine_id="p-restart", role="kv_producer", fill_seed=SEED, lease_s=600.0)
    )
    port = first.port
    cons = AgentProc(ProcSpec(engine_id="d-restart", role="kv_consumer"))
    second = None
    try:
        ticket = first.call("hold", "r1", [1, 2], 32)
        cons.call("pull", ticket, [3, 4], None)
        assert cons.call("wait", "r1", 20)["ok"]
        old_ticket = first.call("hold", "r-stale", [5], 16)
        assert first.close() == 0
        second = AgentProc(
            ProcSpec(engine_id="p-restart", role="kv_producer", fill_seed=SEED + 1, port=port)
        )
        assert second.port == port and second.incarnation != first.incarnation
        # a ticket from the earlier life: refused, never served from the stale cache
        cons.call("pull", old_ticket, [6], None)
        stale = cons.call("wait", "r-stale", 20)
        assert not stale["ok"]
        assert stale["failure"] in ("peer_gone", "handshake"), stale
        assert stale["invalid_blocks"] == [6]
        handshakes = cons.call("stats")["handshakes"]
        # the next transfer from the new incarnation succeeds, with the new bytes
        cons.call("zero")
        ticket = second.call("hold", "r2", [7, 8], 32)
        cons.call("pull", ticket, [9, 10], None)
        assert cons.call("wait", "r2", 20)["ok"]
        assert cons.call("check", [9, 10], [7, 8], SEED + 1) == 0
        assert cons.call("stats")["handshakes"] == handshakes + 1
    finally:
        if second is not None:
            assert second.close() == 0
        assert cons.close() == 0


def test_lease_expires_when_consumer_never_pulls() -> None:
    prod = AgentProc(ProcSpec(engine_id="p-lease", role="kv_producer", lease_s=0.5))
    try:
        prod.call("hold", "orphan", [1, 2, 3], 48)
        assert "orphan" in prod.call("holding")
        waited = _wait_freed(prod, "orphan", 10)
        assert 0.3 < waited < 5
        assert prod.call("holding") == []
        assert prod.call("stats")["leases_expired"] == 1
    finally:
        assert prod.close() == 0


def test_consumer_abort_releases_at_once() -> None:
    prod = AgentProc(ProcSpec(engine_id="p-abort", role="kv_producer", lease_s=60))
    cons = AgentProc(ProcSpec(engine_id="d-abort", role="kv_consumer"))
    try:
        ticket = prod.call("hold", "ab", [4, 5], 32)
        cons.call("abort", ticket)
        assert _wait_freed(prod, "ab", 5) < 2
        assert prod.call("stats")["leases_aborted"] == 1
        # an engine-side release (request aborted on prefill) is immediate too
        prod.call("hold", "ab2", [6], 16)
        assert prod.call("release", "ab2") is True
        assert "ab2" in prod.call("freed")
    finally:
        assert cons.close() == 0
        assert prod.close() == 0


def test_unreachable_producer_fails_with_address_and_hint() -> None:
    cons = AgentProc(ProcSpec(engine_id="d-unreach", role="kv_consumer", handshake_timeout_s=0.3))
    try:
        ticket = {
            "engine_id": "nobody",
            "host": "127.0.0.1",
            "port": 9,  # discard port: nothing listens
            "request_id": "u1",
            "block_ids": [[1]],
            "num_tokens": 16,
        }
        cons.call("pull", ticket, [2], None)
        result = cons.call("wait", "u1", 20)
        assert not result["ok"]
        assert result["failure"] == "handshake"
        assert "127.0.0.1:9" in result["error"]
        assert "SIDE_CHANNEL_HOST" in result["error"]
        assert result["invalid_blocks"] == [2]
    finally:
        assert cons.close() == 0


def test_wrong_engine_id_is_refused() -> None:
    prod = AgentProc(ProcSpec(engine_id="p-real", role="kv_producer"))
    cons = AgentProc(ProcSpec(engine_id="d-eid", role="kv_consumer"))
    try:
        ticket = prod.call("hold", "e1", [1], 16)
        ticket["engine_id"] = "p-expected"
        cons.call("pull", ticket, [2], None)
        result = cons.call("wait", "e1", 20)
        assert not result["ok"]
        assert "p-expected" in result["error"] and "p-real" in result["error"]
    finally:
        assert cons.close() == 0
        assert prod.close() == 0


def test_a_ticket_naming_no_possible_host_fails_at_once_by_name() -> None:
    prod = AgentProc(ProcSpec(engine_id="p-host", role="kv_producer"))
    cons = AgentProc(ProcSpec(engine_id="d-host", role="kv_consumer", transfer_timeout_s=30.0))
    try:
        ticket = prod.call("hold", "h1", [1], 16)
        ticket["host"] = "prefill..svc"  # an empty label: no resolver can take it
        t0 = time.monotonic()
        cons.call("pull", ticket, [2], None)
        result = cons.call("wait", "h1", 20)
        assert not result["ok"] and result["failure"] == "handshake", result
        assert "host='prefill..svc': not a host name" in result["error"], result
        assert result["invalid_blocks"] == [2]
        assert time.monotonic() - t0 < 10  # not the transfer's 30 s deadline
    finally:
        assert cons.close() == 0
        assert prod.close() == 0


def test_incompatible_model_and_block_size_are_refused() -> None:
    prod = AgentProc(ProcSpec(engine_id="p-compat", role="kv_producer"))
    other_model = AgentProc(ProcSpec(engine_id="d-model", role="kv_consumer", model="other/model"))
    # 24 and 16: neither divides the other (whole multiples pull unit by unit).
    other_bs = AgentProc(ProcSpec(engine_id="d-bs", role="kv_consumer", block_size=24))
    try:
        ticket = prod.call("hold", "c1", [1], 16)
        other_model.call("pull", ticket, [2], None)
        r = other_model.call("wait", "c1", 20)
        assert not r["ok"] and "compat" in r["error"].lower()
        # The ticket states the producer's block size: refused at the call, by name.
        with pytest.raises(RuntimeError, match=r"block_size.*whole multiple.*local=24 remote=16"):
            other_bs.call("pull", ticket, [2], None)
    finally:
        for p in (other_model, other_bs, prod):
            assert p.close() == 0


def test_pull_after_lease_expiry_is_refused_not_read() -> None:
    prod = AgentProc(ProcSpec(engine_id="p-late", role="kv_producer", lease_s=0.6, fill_seed=SEED))
    cons = AgentProc(ProcSpec(engine_id="d-late", role="kv_consumer"))
    try:
        ticket = prod.call("hold", "late", [1, 2], 32)
        time.sleep(0.8)
        cons.call("pull", ticket, [3, 4], None)
        result = cons.call("wait", "late", 10)
        assert not result["ok"]
        assert result["failure"] == "lease_expired"
        assert result["invalid_blocks"] == [3, 4]
        assert "lease" in result["error"]
    finally:
        assert cons.close() == 0
        assert prod.close() == 0


def test_abort_that_arrives_before_the_hold_frees_at_the_hold() -> None:
    prod = AgentProc(ProcSpec(engine_id="p-early", role="kv_producer", lease_s=60))
    cons = AgentProc(ProcSpec(engine_id="d-early", role="kv_consumer"))
    try:
        stub = {
            "engine_id": "p-early",
            "host": prod.host,
            "port": prod.port,
            "request_id": "early",
            "block_ids": [[1]],
            "num_tokens": 16,
        }
        cons.call("abort", stub)  # the router gave up before prefill finished
        time.sleep(0.5)
        prod.call("hold", "early", [1], 16)
        assert "early" in prod.call("freed")
        assert prod.call("holding") == []
    finally:
        assert cons.close() == 0
        assert prod.close() == 0
