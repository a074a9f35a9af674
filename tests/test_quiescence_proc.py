"""R-SAFE-5: a transfer is final only once no byte of it can land any more.

Two real processes on two "hosts" (network namespaces joined by a veth pair shaped to
250 Mbit/s with ``tc tbf``), NIXL over UCX's TCP transport (``UCX_TLS=tcp``, as between
two hosts without RDMA), a Qwen3-0.6B-shaped cache (28 layers × 8 KV heads × 128,
bf16), 64 blocks of 16 tokens: 112 MiB a request, ~4 s on the wire. The consumer's
engine aborts 0, 5 or 20 ms into the transfer and, the moment the transfer is final,
writes a sentinel into its blocks (as vLLM reuses them after ``finished_recving``);
1.5 s later not one element may have changed. NIXL cannot cancel a request in
flight, so before issue 25 the aborted transfer settled FAILED in milliseconds and
the rest of the request landed in the reused blocks (most of the request's elements).

(The size and the rate go together: a request must still be on the wire seconds after
the abort. 448 MiB at 1 Gbit/s did the same with four times the bytes to copy, fill
and check, ~30 CPU-seconds of a suite that shares two cores.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvxfer.tools.bench.netns import NetnsPair
from tests.agent_proc import AgentProc
from tests.two_hosts import BLOCK, qwen_spec, shaped_hosts

pytestmark = [pytest.mark.proc, pytest.mark.timeout(600)]

BLOCKS = 64  # per request: 64 x 16 tokens x 112 KiB = 112 MiB
NUM_BLOCKS = 2 * BLOCKS + 8  # room for the request and a warm-up, on either side
SENTINEL = 0x5EED
RATE = "250mbit"
DELAYS = (0.0, 0.005, 0.020)


@pytest.fixture(scope="module")
def link() -> Iterator[NetnsPair]:
    with shaped_hosts(RATE, "100ms") as pair:  # 112 MiB take ~4 s: aborts land mid-way
        yield pair


@pytest.fixture(scope="module", params=["pull", "push"])
def pair(
    request: pytest.FixtureRequest, link: NetnsPair
) -> Iterator[tuple[str, AgentProc, AgentProc]]:
    direction = request.param
    prod = AgentProc(
        qwen_spec(
            "prefill-q",
            direction,
            "kv_producer",
            link.producer_ns,
            link.producer_addr,
            num_blocks=NUM_BLOCKS,
        ),
        start_timeout=120,
    )
    try:
        cons = AgentProc(
            qwen_spec(
                "decode-q",
                direction,
                "kv_consumer",
                link.consumer_ns,
                link.consumer_addr,
                num_blocks=NUM_BLOCKS,
            ),
            start_timeout=120,
        )
    except BaseException:
        prod.close()
        raise
    try:
        _warm_up(direction, prod, cons)
        yield direction, prod, cons
    finally:
        cons.close()
        prod.close()


_rids = iter(range(1_000_000))


def _start(
    direction: str, prod: AgentProc, cons: AgentProc, blocks: int
) -> tuple[dict[str, Any], list[int], list[int]]:
    """Start one request of ``blocks`` blocks; returns its ticket and both block lists."""
    rid = f"{direction}-{next(_rids)}"
    remote = list(range(blocks))
    local = list(range(NUM_BLOCKS - blocks, NUM_BLOCKS))
    tokens = blocks * BLOCK
    if direction == "pull":
        ticket = prod.call("hold", rid, remote, tokens)
        cons.call("pull", ticket, local, tokens)
        return ticket, local, remote
    ticket = {
        "engine_id": "prefill-q",
        "host": prod.host,
        "port": prod.port,
        "request_id": rid,
        "block_ids": [[]],
        "num_tokens": tokens,
    }
    cons.call("expect_push", ticket, local, tokens)
    time.sleep(0.5)  # its registration reaches the producer (a side-channel round trip)
    prod.call("hold", rid, remote, tokens)  # the write starts now
    return ticket, local, remote


def _warm_up(direction: str, prod: AgentProc, cons: AgentProc) -> None:
    """Connect the two (handshake, UCX wire-up) with a small request, so that the
    aborts below hit a transfer that is moving bytes."""
    ticket, local, remote = _start(direction, prod, cons, 4)
    result = cons.call("wait", ticket["request_id"], 60, timeout=90)
    assert result["ok"], result
    assert cons.call("check", local, remote, 7) == 0


@pytest.mark.parametrize("delay", DELAYS, ids=lambda d: f"{int(d * 1000)}ms")
def test_no_byte_lands_after_an_aborted_transfer_is_final(
    pair: tuple[str, AgentProc, AgentProc], delay: float, record_property: Any
) -> None:
    direction, prod, cons = pair
    ticket, local, _ = _start(direction, prod, cons, BLOCKS)
    res = cons.call("abort_and_reuse", ticket, delay, local, SENTINEL, timeout=180)
    record_property("abort_to_final_s", round(res["abort_to_final_s"], 4))
    print(f"{direction} abort at {delay * 1e3:.0f} ms: final after {res['abort_to_final_s']:.3f} s")
    assert res["state"] == "failed", res  # aborted: never DONE
    assert res["abort_returned_s"] < 1.0, res  # abort() itself does not wait
    time.sleep(1.5)
    changed = cons.call("changed", local, SENTINEL)
    assert changed == 0, (
        f"{changed:,} elements of the reused blocks changed after the {direction} was final "
        f"({res['abort_to_final_s']:.3f} s after the abort)"
    )
    stats = res["stats"]
    assert stats.get("quarantined", 0) == 0 or cons.call("stats")["quarantined"] == 0
