"""Issue 16's fault cases between real processes over UCX (the fake-backend suite,
tests/test_faults.py, has every case; these are the ones a real transport can play
deterministically). One producer/consumer pair serves the module: each process takes
seconds to start."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvxfer.core import wire
from kvxfer.core.compat import Fingerprint
from kvxfer.types import Direction
from tests.agent_proc import AgentProc, ProcSpec
from tests.faultkit import REASONS, Stranger

pytestmark = pytest.mark.proc

SEED = 17


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[AgentProc, AgentProc]]:
    prod = AgentProc(ProcSpec(engine_id="p-faults", role="kv_producer", fill_seed=SEED, lease_s=60))
    try:
        cons = AgentProc(ProcSpec(engine_id="d-faults", role="kv_consumer"))
    except BaseException:
        prod.close()
        raise
    yield prod, cons
    assert cons.close() == 0
    assert prod.close() == 0


def _freed_and_reused(prod: AgentProc, rid: str, blocks: list[int], timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while rid not in prod.call("freed"):
        assert time.monotonic() < deadline, f"{rid} not freed within {timeout}s"
        time.sleep(0.01)
    prod.call("reuse", blocks)


def _fails_closed(result: dict[str, object], local: list[int]) -> None:
    assert not result["ok"], "the pull reported success for blocks the producer had reused"
    assert result["invalid_blocks"] == local
    assert any(word in str(result["error"]).lower() for word in REASONS), result


def test_ucx_a_clean_pull_lands_and_frees(pair: tuple[AgentProc, AgentProc]) -> None:
    prod, cons = pair
    ticket = prod.call("hold", "clean", [1, 2], 32)
    cons.call("pull", ticket, [3, 4], None)
    assert cons.call("wait", "clean", 20)["ok"]
    assert cons.call("check", [3, 4], [1, 2], SEED) == 0
    _freed_and_reused(prod, "clean", [1, 2])


def test_ucx_a_second_pull_of_a_ticket_fails_closed(pair: tuple[AgentProc, AgentProc]) -> None:
    prod, cons = pair
    ticket = prod.call("hold", "twice", [5, 6], 32)
    cons.call("pull", ticket, [7, 8], None)
    assert cons.call("wait", "twice", 20)["ok"]
    _freed_and_reused(prod, "twice", [5, 6])
    cons.call("pull", ticket, [9, 10], None)
    _fails_closed(cons.call("wait", "twice", 20), [9, 10])


def test_ucx_a_pull_of_an_aborted_ticket_fails_closed(pair: tuple[AgentProc, AgentProc]) -> None:
    prod, cons = pair
    ticket = prod.call("hold", "aborted", [11, 12], 32)
    cons.call("abort", ticket)
    _freed_and_reused(prod, "aborted", [11, 12])
    cons.call("pull", ticket, [13, 14], None)
    _fails_closed(cons.call("wait", "aborted", 20), [13, 14])


def test_ucx_a_strangers_release_does_not_free_a_live_lease(
    pair: tuple[AgentProc, AgentProc],
) -> None:
    prod, cons = pair
    ticket = prod.call("hold", "victim", [15, 16], 32)
    fp = Fingerprint(
        model="test/model",
        dtype="bfloat16",
        kv_cache_dtype="bfloat16",
        attention_backend="test",
        direction=Direction.PULL,
    )
    stranger = Stranger(prod.host, prod.port, Direction.PULL, compat_hash=fp.digest())
    try:
        reply = stranger.request(wire.Release(request_id="victim", reason="anyone"))
    finally:
        stranger.close()
    assert isinstance(reply, wire.Ack | wire.Reject)  # the listener answered
    time.sleep(0.1)
    assert "victim" not in prod.call("freed") and "victim" in prod.call("holding")
    cons.call("pull", ticket, [17, 18], None)
    assert cons.call("wait", "victim", 20)["ok"]
    assert cons.call("check", [17, 18], [15, 16], SEED) == 0
