"""The TP vocabulary of the handshake, the ticket and the compatibility check (R-TP-4).

Two ranks that say where they sit in their TP groups (``Hello.tp`` / ``Welcome.tp``)
are compared by global head layout; without that, region by region as before.
"""

from __future__ import annotations

import re

import msgspec
import pytest

from kvxfer.adapters.vllm.params import remote_ticket, ticket_params
from kvxfer.core import wire
from kvxfer.core.compat import check_pair
from kvxfer.core.heads import HeadLayout, TPRank, needed_ranks
from kvxfer.core.layout import KVLayout
from kvxfer.errors import ConfigError, HandshakeRejected, LayoutMismatch
from kvxfer.testing import tp_strategies as tps
from kvxfer.types import Direction
from tests.test_handshake import Producer, hello, initiator, responder

MODEL = tps.TPModel(num_kv_heads=4, layers=2, head_bytes=4, block_size=4)
P = HeadLayout(num_kv_heads=4, tp_size=1)
C = HeadLayout(num_kv_heads=4, tp_size=2)


def layout(heads: HeadLayout, rank: int, *, model: tps.TPModel = MODEL, seed: int = 0) -> KVLayout:
    return tps.rank_layout(model, heads, rank, per_head=True, num_blocks=8, seed=seed)


def producer_tp1() -> Producer:
    producer = Producer()
    producer.welcome = msgspec.structs.replace(
        producer.welcome, layout=layout(P, 0, seed=9), tp=TPRank(heads=P, rank=0)
    )
    return producer


def test_ranks_of_different_tp_sizes_pair_by_head_layout() -> None:
    producer = producer_tp1()
    r = responder(producer)
    i = initiator(hello(layout=layout(C, 1), tp=TPRank(heads=C, rank=1)))
    info = i.receive(r.respond(i.hello()))
    assert info.tp == TPRank(heads=P, rank=0)
    assert info.layout == producer.welcome.layout


def test_without_tp_the_layouts_are_compared_region_by_region() -> None:
    r = responder(producer_tp1())
    i = initiator(hello(layout=layout(C, 1)))
    with pytest.raises(HandshakeRejected) as info:
        i.receive(r.respond(i.hello()))
    assert info.value.code == "layout" and "num_regions" in info.value.reason


def test_other_model_heads_are_refused_in_engine_terms() -> None:
    r = responder(producer_tp1())
    eight = HeadLayout(num_kv_heads=8, tp_size=2)
    mine = tps.rank_layout(
        tps.TPModel(num_kv_heads=8, layers=2, head_bytes=4, block_size=4),
        eight,
        1,
        per_head=True,
        num_blocks=8,
    )
    i = initiator(hello(layout=mine, tp=TPRank(heads=eight, rank=1)))
    with pytest.raises(HandshakeRejected) as info:
        i.receive(r.respond(i.hello()))
    assert info.value.code == "layout"
    assert "num_kv_heads (model, all ranks): ours 4, yours 8" in info.value.reason


def test_a_layout_whose_heads_are_not_its_ranks_is_refused_naming_the_region() -> None:
    r = responder(producer_tp1())
    # Rank 1 described with its tensor's head indices (0, 1), not the global 2, 3.
    i = initiator(hello(layout=layout(C, 0), tp=TPRank(heads=C, rank=1)))
    with pytest.raises(HandshakeRejected) as info:
        i.receive(r.respond(i.hello()))
    assert info.value.code == "layout"
    assert re.search(r"regions\[\d+\]\.head=0: rank 1 of num_kv_heads=4", info.value.reason)


def test_check_pair_names_the_field_both_ways() -> None:
    with pytest.raises(LayoutMismatch, match="num_regions"):
        check_pair(layout(C, 1), layout(P, 0), local_tp=TPRank(heads=C, rank=1), remote_tp=None)
    check_pair(
        layout(C, 1), layout(P, 0), local_tp=TPRank(heads=C, rank=1), remote_tp=TPRank(heads=P)
    )
    wide = tps.rank_layout(
        tps.TPModel(num_kv_heads=4, layers=2, head_bytes=8, block_size=4),
        P,
        0,
        per_head=True,
        num_blocks=8,
    )
    with pytest.raises(LayoutMismatch, match="bytes per head per block") as info:
        check_pair(
            layout(C, 1),
            wide,
            local_tp=TPRank(heads=C, rank=1),
            remote_tp=TPRank(heads=P, rank=0),
        )
    assert (info.value.local, info.value.remote) == (16, 32)


def test_tp_travels_on_the_wire_and_an_older_peer_sends_none() -> None:
    message = hello(layout=layout(C, 1), tp=TPRank(heads=C, rank=1))
    for codec in (msgspec.json, msgspec.msgpack):
        assert codec.decode(codec.encode(message), type=wire.Hello) == message
    old = msgspec.json.encode(hello()).replace(b',"tp":null', b"")
    assert b'"tp"' not in old
    assert msgspec.json.decode(old, type=wire.Hello).tp is None
    bad = msgspec.json.encode(message).replace(b'"rank":1', b'"rank":2')
    with pytest.raises(
        msgspec.ValidationError, match=r"tp_rank=2: must be an int in \[0, tp_size=2\)"
    ):
        msgspec.json.decode(bad, type=wire.Hello)
    with pytest.raises(ConfigError, match=r"^tp_rank=-1"):
        TPRank(heads=C, rank=-1)


def test_the_ticket_tp_size_names_the_producer_ranks_to_handshake() -> None:
    params = {
        "remote_engine_id": "prefill",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "remote_block_ids": [1, 2],
        "remote_num_tokens": 8,
        "tp_size": 2,
    }
    ticket = remote_ticket(params, tp_rank=0, transfer_id="r", local_blocks=((7, 8),))
    assert ticket.tp_size == 2
    assert ticket_params(ticket, direction=Direction.PULL)["tp_size"] == 2
    mine = HeadLayout(num_kv_heads=4, tp_size=1)
    producer = mine.for_tp_size(ticket.tp_size)
    # A TP1 consumer reads heads 0-1 from producer rank 0 (port 5600), 2-3 from rank 1.
    assert needed_ranks(mine, 0, producer) == (0, 1)
    with pytest.raises(ConfigError, match=r"^tp_size=3: must divide num_kv_heads \(4"):
        mine.for_tp_size(3)
