"""Pull and push between two real processes over real NIXL (UCX), bytes compared exactly."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.agent_proc import AgentProc, ProcSpec

pytestmark = pytest.mark.proc

SEED = 77
NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def pull_pair() -> Iterator[tuple[AgentProc, AgentProc]]:
    prod = AgentProc(
        ProcSpec(engine_id="prefill-a", role="kv_producer", num_blocks=NUM_BLOCKS, fill_seed=SEED)
    )
    cons = AgentProc(ProcSpec(engine_id="decode-a", role="kv_consumer", num_blocks=NUM_BLOCKS))
    yield prod, cons
    assert cons.close() == 0, "consumer did not exit cleanly"
    assert prod.close() == 0, "producer did not exit cleanly"


CASES = {
    "one block, partial": ([5], [9], 3),
    "contiguous run": (list(range(10, 30)), list(range(40, 60)), 20 * 16),
    "partial last block": (list(range(0, 7)), list(range(60, 67)), 6 * 16 + 1),
    "scattered": ([3, 17, 4, 88, 41, 2], [90, 1, 33, 34, 35, 70], 6 * 16),
    "reversed": (list(range(50, 40, -1)), list(range(20, 30)), 10 * 16 - 5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pull_moves_exact_bytes(pull_pair: tuple[AgentProc, AgentProc], case: str) -> None:
    prod, cons = pull_pair
    remote, local, tokens = CASES[case]
    rid = f"pull-{case}"
    cons.call("zero")
    ticket = prod.call("hold", rid, remote, tokens)
    assert ticket["host"] == prod.host and ticket["port"] == prod.port
    cons.call("pull", ticket, local, None)
    result = cons.call("wait", rid, 30)
    assert result["ok"], result
    assert (
        result["bytes"] == len(local) * 2 * 2 * 16 * 2 * 32 * 2
    )  # blocks×layers×KV×bs×heads×dim×2B
    assert cons.call("check", local, remote, SEED) == 0
    # the completion notice releases the producer's lease
    deadline = time.monotonic() + 10
    freed: list[str] = []
    while rid not in freed and time.monotonic() < deadline:
        freed += prod.call("freed")
        time.sleep(0.01)
    assert rid in freed
    assert rid not in prod.call("holding")


def test_one_handshake_per_peer(pull_pair: tuple[AgentProc, AgentProc]) -> None:
    prod, cons = pull_pair
    before = cons.call("stats")["handshakes"]
    for i in range(3):
        rid = f"hs-{i}"
        ticket = prod.call("hold", rid, [i], 16)
        cons.call("pull", ticket, [i + 1], None)
        assert cons.call("wait", rid, 30)["ok"]
    assert cons.call("stats")["handshakes"] == before  # cached from earlier pulls (or one)


def test_mismatched_block_counts_fail_cleanly(pull_pair: tuple[AgentProc, AgentProc]) -> None:
    prod, cons = pull_pair
    ticket = prod.call("hold", "bad-len", [1, 2, 3], 48)
    # Refused at the call, before anything is posted (48 tokens fill 3 blocks)
    with pytest.raises(RuntimeError, match=r"PlanError: local block_ids \(group 0\): 2 block"):
        cons.call("pull", ticket, [4, 5], None)
    # the consumer tells the producer to release at once (no lease expiry wait)
    deadline = time.monotonic() + 10
    while "bad-len" in prod.call("holding") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "bad-len" not in prod.call("holding")


#: NIXL's UCX list writes on, and UCX saying which protocol each put took.
LIST_WRITES = (("NIXL_UCX_SGL_ENABLE", "1"), ("UCX_PROTO_INFO", "y"))


@pytest.mark.parametrize(
    ("secret", "env"),
    [(None, ()), ("push-test-secret-0123456789", ()), (None, LIST_WRITES)],
    ids=["open", "signed", "list_writes"],
)
def test_push_writes_exact_bytes(
    secret: str | None, env: tuple[tuple[str, str], ...], capfd: pytest.CaptureFixture[str]
) -> None:
    # signed: the PUSHED notice, encoded when the registration arrived, must verify.
    # list_writes: the producer's writes go out as one UCX list each (scattered blocks,
    # so a list of many elements); the same bytes must land.
    prod = AgentProc(
        ProcSpec(
            engine_id="prefill-p",
            role="kv_producer",
            direction="push",
            num_blocks=NUM_BLOCKS,
            fill_seed=SEED,
            auth_secret=secret,
            env=env,
        )
    )
    cons = AgentProc(
        ProcSpec(
            engine_id="decode-p",
            role="kv_consumer",
            direction="push",
            num_blocks=NUM_BLOCKS,
            auth_secret=secret,
        )
    )
    try:
        remote, local, tokens = list(range(8, 20)), list(range(30, 42)), 12 * 16 - 3
        if env:  # no two blocks abut on both sides: one element per block and region
            remote, local = list(range(8, 32, 2)), list(range(41, 29, -1))
        stub = {
            "engine_id": "prefill-p",
            "host": prod.host,
            "port": prod.port,
            "request_id": "push-1",
            "block_ids": [[]],
            "num_tokens": tokens,
        }
        # decode registers first (as a push proxy does), then prefill finishes
        cons.call("expect_push", stub, local, tokens)
        prod.call("hold", "push-1", remote, tokens)
        result = cons.call("wait", "push-1", 30)
        assert result["ok"], result
        assert cons.call("check", local, remote, SEED) == 0
        deadline = time.monotonic() + 10
        freed: list[str] = []
        while "push-1" not in freed and time.monotonic() < deadline:
            freed += prod.call("freed")
            time.sleep(0.01)
        assert "push-1" in freed

        # prefill finishing before decode registers works as well
        cons.call("zero")
        prod.call("hold", "push-2", remote, tokens)
        stub2 = dict(stub, request_id="push-2")
        cons.call("expect_push", stub2, local, tokens)
        assert cons.call("wait", "push-2", 30)["ok"]
        assert cons.call("check", local, remote, SEED) == 0
    finally:
        assert cons.close() == 0
        assert prod.close() == 0
    if env:
        said = capfd.readouterr()
        puts = [line for line in (said.out + said.err).splitlines() if "ucp_put" in line]
        assert any("from sgl" in line for line in puts), puts[-10:]
