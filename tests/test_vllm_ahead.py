"""``connect_ahead`` (the vLLM adapter's worker side, :mod:`kvxfer.adapters.vllm.ahead`)
with in-process Agents on the fake backend: a decode rank connects to a prefill group
that comes up after it, to exactly the ranks it reads; it stops when told, and gives
up on a peer it can never connect to, saying why."""

from __future__ import annotations

import logging
import random
import time

import pytest

from kvxfer.adapters.vllm import ahead
from kvxfer.adapters.vllm.ahead import ConnectAhead
from kvxfer.adapters.vllm.kv_transfer_config import PeerAddress
from kvxfer.core.heads import HeadLayout
from kvxfer.types import Direction, Role
from tests.tp_ranks import Rank, consumers, make_rank
from tests.tp_ranks import closing as closing  # the fixture, by name

HEADS = 4


def _decode(tp: int) -> list[Rank]:
    return consumers(
        HeadLayout(num_kv_heads=HEADS, tp_size=tp), direction=Direction.PULL, timeout_s=1.0
    )


def test_a_decode_rank_connects_to_a_prefill_group_that_starts_later(
    closing: list[Rank], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ahead, "FIRST_RETRY_S", 0.05)
    (decode,) = _decode(1)
    closing.append(decode)
    base = random.randrange(20000, 60000)
    peer = PeerAddress(host="127.0.0.1", port=base, tp_size=2, engine_id="prefill")
    connecting = ConnectAhead(decode.agent, [peer])
    connecting.start()
    time.sleep(0.3)  # nobody serves there yet: it keeps trying
    assert not connecting.done(0) and decode.agent.stats().handshakes == 0
    heads = HeadLayout(num_kv_heads=HEADS, tp_size=2)
    prefill = [
        make_rank(
            "prefill",
            Role.PRODUCER,
            heads,
            r,
            base + r,
            seed=5,
            direction=Direction.PULL,
            timeout_s=1.0,
        )
        for r in range(2)
    ]
    closing += prefill
    for p in prefill:
        p.agent.serve()
    assert connecting.done(10)
    # A TP1 decode rank reads every head: both prefill ranks, one handshake each.
    assert connecting.connected == {("127.0.0.1", base): [base, base + 1]}
    assert decode.agent.stats().handshakes == 2


def test_it_stops_when_the_worker_closes(
    closing: list[Rank], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ahead, "FIRST_RETRY_S", 0.05)
    (decode,) = _decode(1)
    closing.append(decode)
    nobody = PeerAddress(host="127.0.0.1", port=random.randrange(20000, 60000))
    connecting = ConnectAhead(decode.agent, [nobody])
    connecting.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    connecting.stop()
    assert connecting.done(0) and time.monotonic() - t0 < 5
    assert connecting.connected == {}


def test_a_peer_it_can_never_connect_to_is_given_up_by_name(
    closing: list[Rank], caplog: pytest.LogCaptureFixture
) -> None:
    ranks = _decode(2)
    closing += ranks
    decode = ranks[0]
    bad = PeerAddress(host="127.0.0.1", port=30000, tp_size=3)  # cannot split 4 heads
    connecting = ConnectAhead(decode.agent, [bad])
    with caplog.at_level(logging.ERROR, logger="kvxfer.adapters.vllm"):
        connecting.start()
        assert connecting.done(5)
    assert "connect_ahead 127.0.0.1:30000 (tp_size 3): giving up: tp_size=3" in caplog.text
    assert decode.agent.stats().handshakes == 0


def test_nothing_to_connect_starts_no_thread(closing: list[Rank]) -> None:
    (decode,) = _decode(1)
    closing.append(decode)
    connecting = ConnectAhead(decode.agent, [])
    connecting.start()
    assert connecting.done(0)
    connecting.stop()
