"""R-SAFE-5 and R-SAFE-6 when the link between two hosts goes down mid-transfer.

Two real processes on two "hosts" (network namespaces joined by a veth pair shaped to
200 Mbit/s with ``tc tbf``), NIXL over UCX's TCP transport, a Qwen3-0.6B-shaped cache,
64 blocks of 16 tokens (112 MiB, ~5 s on the wire). About a second into the transfer
decode's end of the veth goes down, and comes back up 3 s later, or 13 s later (longer
than UCX's TCP keepalive window, which kvxfer sets to ~5 s). The consumer's engine
waits for the transfer to be final and at once writes a sentinel into its blocks (as
vLLM reuses them after ``finished_recving``); 3 s after the link is back, and after it
was final, not one element may have changed: a transfer is final only when no byte of
it can land.

An unreachable peer is not a dead one: while the link is down the side channel's
connect fails with "Network is unreachable", the producer runs on and its write is
still in flight, and TCP delivers the rest of it when the link returns. That holds
after the consumer's keepalive fired too: the producer's connection has unacknowledged
bytes, so keepalive never ends it, and they land 4-8 s after a 13 s outage. A push
whose deadline passes while the link is down therefore fails (the engine may end the
request) but stays quarantined until the producer, reachable again, says its write
ended; a pull ends with its own READ's handle (its peer removed at its deadline).

A producer whose own deadline passes during the outage does not remove the consumer
to end its WRITE: NIXL would call the WRITE over while UCX flushed its bytes on, and
they landed in the reused blocks after the consumer was told (measured: 4.5 M elements
with the producer's deadline 6 s in a 13 s outage). Its connection ends instead once
no byte was acknowledged for the producer's ``transfer_timeout_s`` (TCP's user
timeout), and the WRITE with it, while the link is still down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from kvxfer.tools.bench.netns import NetnsPair
from tests.agent_proc import AgentProc
from tests.two_hosts import BLOCK, qwen_spec, shaped_hosts

pytestmark = [pytest.mark.netns, pytest.mark.proc, pytest.mark.timeout(300)]

BLOCKS = 64  # 64 x 16 tokens x 112 KiB = 112 MiB a request
NUM_BLOCKS = 2 * BLOCKS + 8
SENTINEL = 0x5EED
RATE = "200mbit"


class LateBytes(AssertionError):
    """Bytes of a transfer landed after it was final."""


@pytest.fixture(scope="module")
def link() -> Iterator[NetnsPair]:
    with shaped_hosts(RATE, "2s") as pair:
        yield pair


def _set_link(pair: NetnsPair, up: bool) -> None:
    subprocess.run(
        ["ip", "-n", pair.consumer_ns, "link", "set", pair.consumer_dev, "up" if up else "down"],
        check=True,
        capture_output=True,
    )


_rids = iter(range(1_000_000))


def _start(direction: str, prod: AgentProc, cons: AgentProc, blocks: int) -> tuple[str, list[int]]:
    rid = f"{direction}-{next(_rids)}"
    remote = list(range(blocks))
    local = list(range(NUM_BLOCKS - blocks, NUM_BLOCKS))
    tokens = blocks * BLOCK
    if direction == "pull":
        ticket = prod.call("hold", rid, remote, tokens)
        cons.call("pull", ticket, local, tokens)
        return rid, local
    ticket = {
        "engine_id": "prefill-ld",
        "host": prod.host,
        "port": prod.port,
        "request_id": rid,
        "block_ids": [[]],
        "num_tokens": tokens,
    }
    cons.call("expect_push", ticket, local, tokens)
    time.sleep(0.5)  # its registration reaches the producer
    prod.call("hold", rid, remote, tokens)  # the write starts now
    return rid, local


def _pair(
    link: NetnsPair, direction: str, producer_s: float, consumer_s: float
) -> tuple[AgentProc, AgentProc]:
    """A producer and a consumer on the two hosts, with these ``transfer_timeout_s``."""

    def start(name: str, role: str, ns: str, addr: str, timeout_s: float) -> AgentProc:
        spec = qwen_spec(name, direction, role, ns, addr, num_blocks=NUM_BLOCKS)
        spec = msgspec.structs.replace(spec, transfer_timeout_s=timeout_s)
        return AgentProc(spec, start_timeout=120)

    prod = start("prefill-ld", "kv_producer", link.producer_ns, link.producer_addr, producer_s)
    try:
        cons = start("decode-ld", "kv_consumer", link.consumer_ns, link.consumer_addr, consumer_s)
    except BaseException:
        prod.close()
        raise
    return prod, cons


@pytest.mark.parametrize(
    ("direction", "down_s", "deadline_s", "producer_deadline_s"),
    [
        ("pull", 3.0, 60.0, 60.0),
        ("push", 3.0, 60.0, 60.0),
        # Down past the keepalive window and past the consumer's deadline. A pull
        # fails at its deadline, final at once: the peer removed, NIXL ends the READ,
        # whose bytes would come in through the connection that went. A push fails
        # while the link is down, and is final only once the producer, reachable
        # again, says its WRITE ended: here TCP resumes it when the link is back.
        ("pull", 13.0, 3.0, 60.0),
        ("push", 13.0, 8.0, 60.0),
        # The producer's deadline passes during the outage too. Its WRITE is not cut
        # by removing the consumer (NIXL would call it over while UCX flushed its
        # bytes on): the connection ends once it stalled for the producer's
        # transfer_timeout_s (TCP_USER_TIMEOUT), while the link is still down.
        pytest.param("push", 13.0, 8.0, 6.0, marks=pytest.mark.e2e_half),
    ],
    ids=["pull", "push", "pull-long-outage", "push-long-outage", "push-cut-by-producer"],
)
def test_no_byte_lands_after_a_transfer_cut_by_a_dead_link_is_final(
    direction: str,
    down_s: float,
    deadline_s: float,
    producer_deadline_s: float,
    link: NetnsPair,
    record_property: Any,
) -> None:
    prod, cons = _pair(link, direction, producer_deadline_s, deadline_s)
    try:
        # Handshake and UCX wire-up first, with a small request.
        rid, local = _start(direction, prod, cons, 4)
        assert cons.call("wait", rid, 60, timeout=90)["ok"]
        rid, local = _start(direction, prod, cons, BLOCKS)
        time.sleep(1.0)  # ~1/5 of the transfer is over
        _set_link(link, False)
        try:
            cons.send("final_and_reuse", rid, local, SENTINEL, 120.0)
            time.sleep(down_s)
            # The producer's WRITE ended on its own while the link was down once it
            # stalled for the producer's deadline (else it waits for TCP to resume).
            ended = prod.call("stats")["transfers_failed"]
        finally:
            _set_link(link, True)
        res = cons.reply(timeout=150)
        for _ in range(3):  # whatever was still in flight lands now
            time.sleep(1.0)
            changed = cons.call("changed", local, SENTINEL)
            if changed:
                break
        record_property("final_s", round(res["final_s"], 3))
        print(f"{direction}: final ({res['state']}, {res['failure']}) after {res['final_s']:.2f} s")
        assert res["state"] in ("done", "failed"), res
        if changed:
            raise LateBytes(
                f"{changed:,} elements of the reused blocks changed after the {direction} was "
                f"final ({res['state']}, {res['failure']}, {res['final_s']:.2f} s after the "
                "link went down)"
            )
        if producer_deadline_s + 4.0 < down_s:
            assert ended == 1, f"the producer's WRITE had not ended {down_s} s into the outage"
        if deadline_s < down_s and direction == "pull":
            assert res["failure"] == "timeout" and res["final_s"] < down_s, res
        elif deadline_s < down_s:
            # Failed at its deadline, or done (the WRITE completed once the link was
            # back, its notice last), and final only once the producer could say the
            # WRITE ended: after the link came back (before, the bytes still in flight
            # landed in the reused blocks seconds later).
            assert res["state"] == "done" or res["failure"] == "timeout", res
            assert res["final_s"] > down_s, res
    finally:
        cons.close()
        prod.close()


@pytest.mark.e2e_half
@pytest.mark.parametrize(
    ("down_s", "producer_s"),
    [(0.0, 5.0), (10.0, 12.0)],
    ids=["killed", "died-in-an-outage"],
)
def test_no_byte_of_a_producer_killed_mid_push_lands_after_the_push_is_final(
    down_s: float, producer_s: float, link: NetnsPair, record_property: Any
) -> None:
    """The producer is killed 1 s into its WRITE (link up), or 3 s into a 10 s outage.
    Its kernel keeps what the WRITE had queued in the orphaned socket and sends it on:
    at once, or at its first retransmission once the link is back. The consumer proves
    the producer gone (its port refuses) but stays quarantined until that socket surely
    ended: the producer's stall limit (its ``transfer_timeout_s``, announced at the
    registration) and a margin. Before, it settled at once, and 876,739 (killed) and
    453,929-571,940 (died in an outage) elements landed in the reused blocks."""
    prod, cons = _pair(link, "push", producer_s, 8.0)
    try:
        rid, local = _start("push", prod, cons, 4)
        assert cons.call("wait", rid, 60, timeout=90)["ok"]
        rid, local = _start("push", prod, cons, BLOCKS)
        time.sleep(1.0)  # ~1/5 of the transfer is over
        if down_s:
            _set_link(link, False)
        try:
            cons.send("final_and_reuse", rid, local, SENTINEL, 120.0)
            time.sleep(3.0 if down_s else 0.0)
            os.kill(prod.proc.pid, signal.SIGKILL)
            killed_at = 3.0 if down_s else 0.0
            time.sleep(max(0.0, down_s - 3.0))
        finally:
            _set_link(link, True)
        res = cons.reply(timeout=150)
        changed = 0
        for _ in range(3):  # the orphaned socket's next retransmission, if any is left
            time.sleep(1.0)
            changed = cons.call("changed", local, SENTINEL)
            if changed:
                break
        record_property("final_s", round(res["final_s"], 3))
        print(
            f"push, producer killed: final ({res['state']}, {res['failure']}) "
            f"after {res['final_s']:.2f} s"
        )
        assert res["state"] == "failed", res
        if changed:
            raise LateBytes(
                f"{changed:,} elements of the reused blocks changed after the push was final "
                f"({res['failure']}, {res['final_s']:.2f} s after the producer was killed)"
            )
        # Not before the orphaned socket surely ended: the producer found gone (at the
        # kill, or once the link is back) plus its stall limit.
        assert res["final_s"] > max(killed_at, down_s) + producer_s, res
    finally:
        cons.close()
        prod.close()
