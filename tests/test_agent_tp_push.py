"""Pushes across tensor-parallel sizes between in-process Agents on the fake backend
(issue 18): every producer rank writes the heads each consumer rank holds, every
(layer, K/V, head, token) checked byte for byte; a producer rank frees its hold only
once it wrote to every consumer rank; one rank failing fails the consumer's transfer
with every block invalid, and nothing hangs."""

from __future__ import annotations

import threading
import time
import zlib

import msgspec
import pytest

from kvxfer.agent import Ticket
from kvxfer.core import wire
from kvxfer.core.heads import HeadLayout, reader_ranks
from kvxfer.errors import ConfigError, TransferError
from kvxfer.testing.fake_backend import Faults
from kvxfer.transfer import Transfer, TransferState
from kvxfer.types import Direction, Role
from tests.tp_ranks import Rank, consumers, count_planner_builds, make_rank, producers
from tests.tp_ranks import closing as closing  # the fixture, by name

SEED = 33


def _producers(heads: HeadLayout, stream: bool = False) -> list[Rank]:
    return _producers_with(heads, 3.0, stream)


def _producers_with(heads: HeadLayout, timeout_s: float, stream: bool = False) -> list[Rank]:
    return producers(heads, seed=SEED, direction=Direction.PUSH, timeout_s=timeout_s, stream=stream)


def _consumers(heads: HeadLayout) -> list[Rank]:
    return consumers(heads, direction=Direction.PUSH, timeout_s=3.0)


def _consumers_serving(heads: HeadLayout) -> list[Rank]:
    """Consumer ranks serving at consecutive ports (rank c at base + c), as a decode
    instance's ranks do."""
    return producers(
        heads,
        seed=None,
        direction=Direction.PUSH,
        timeout_s=3.0,
        engine_id="decode",
        role=Role.CONSUMER,
    )


def _ticket(producers: list[Rank], rid: str, tokens: int, cap: str) -> Ticket:
    host, port = producers[0].agent.address
    return Ticket.for_push(
        "prefill", host, port, rid, tokens, capability=cap, tp_size=len(producers)
    )


def _freed(producers: list[Rank], rid: str, timeout: float = 5.0) -> dict[int, bool]:
    """Whether each producer rank handed ``rid`` back to its engine."""
    got = {p.rank: False for p in producers}
    deadline = time.monotonic() + timeout
    while not all(got.values()) and time.monotonic() < deadline:
        for p in producers:
            got[p.rank] |= rid in p.agent.freed()
        time.sleep(0.01)
    return got


def _tp2_to_tp1_warm(
    closing: list[Rank], producer_timeout_s: float = 3.0
) -> tuple[list[Rank], Rank]:
    """Two producer ranks and one consumer rank (4 KV heads), both producer ranks
    handshaken by a first push: what fails next fails in the data plane."""
    p_heads, d_heads = HeadLayout(num_kv_heads=4, tp_size=2), HeadLayout(num_kv_heads=4, tp_size=1)
    producers = _producers_with(p_heads, producer_timeout_s)
    (consumer,) = _consumers(d_heads)
    closing += [*producers, consumer]
    cap = wire.new_capability()
    t = consumer.agent.expect_push(_ticket(producers, "warm", 4, cap), [0])
    for p in producers:
        p.agent.hold("warm", [0], 4, capability=cap)
    t.wait(5)
    return producers, consumer


PAIRS = [(4, 1, 2), (4, 2, 1), (4, 2, 4), (4, 4, 2), (2, 1, 2), (2, 2, 1), (1, 2, 1)]
#: Pairs where a producer rank writes two heads or more into one consumer rank, which
#: abut on both sides: its writes post rows of chain lists (core.block_lists).
CHAINED = {(4, 1, 2), (4, 2, 1)}


@pytest.mark.parametrize("lists", [True, False], ids=["chain-lists", "ids"])
@pytest.mark.parametrize("register_first", [True, False], ids=["register-first", "hold-first"])
@pytest.mark.parametrize(("kv_heads", "p_tp", "d_tp"), PAIRS)
def test_push_across_tp_sizes_writes_every_head_exactly(
    closing: list[Rank], kv_heads: int, p_tp: int, d_tp: int, register_first: bool, lists: bool
) -> None:
    p_heads = HeadLayout(num_kv_heads=kv_heads, tp_size=p_tp)
    d_heads = HeadLayout(num_kv_heads=kv_heads, tp_size=d_tp)
    producers, consumers = _producers(p_heads), _consumers(d_heads)
    closing += producers + consumers
    for p in producers:
        p.backend.chain_lists = lists
    remote, local, tokens = [3, 7, 1, 9], [10, 2, 5, 4], 3 * 4 + 2
    cap = wire.new_capability()  # the router's token, given to every rank of both sides
    ticket = _ticket(producers, "req-p", tokens, cap)
    transfers: list[Transfer] = []
    if register_first:  # the usual push: decode registers while prefill runs
        transfers = [c.agent.expect_push(ticket, local) for c in consumers]
        time.sleep(0.1)
    for p in producers:
        p.agent.hold("req-p", remote, tokens, capability=cap)
    if not register_first:
        transfers = [c.agent.expect_push(ticket, local) for c in consumers]
    for t in transfers:
        t.wait(5)
        assert t.state is TransferState.DONE
    for c in consumers:
        assert c.cache.mismatches(local, remote, SEED) == []
        assert not any(buf[[0, 6, 11]].any() for buf in c.cache.buffers.values())
    chained = lists and (kv_heads, p_tp, d_tp) in CHAINED
    assert all((p.backend.lists_posted > 0) == chained for p in producers)
    assert all(_freed(producers, "req-p").values())
    # Each consumer rank's transfer counts the bytes of its own heads once.
    whole = sum(t.stats.bytes for t in transfers)
    assert whole > 0
    assert len({t.stats.bytes for t in transfers}) == 1


@pytest.mark.parametrize(("kv_heads", "p_tp", "d_tp", "planners"), [(4, 1, 2, 2), (2, 4, 1, 4)])
def test_connecting_to_the_consumer_ranks_ahead_builds_the_write_planners(
    closing: list[Rank],
    monkeypatch: pytest.MonkeyPatch,
    kv_heads: int,
    p_tp: int,
    d_tp: int,
    planners: int,
) -> None:
    """A producer rank that connects to the consumer ranks ahead of its first push
    (``Agent.connect``) finds the planners of its writes built (issue 27: 3-10 ms of
    the first push): one per consumer rank it writes into. With replicated heads (2
    heads over 4 prefill ranks) each prefill rank serves one of the two replica
    choices; the requests' salts pick both here."""
    builds = count_planner_builds(monkeypatch)
    p_heads = HeadLayout(num_kv_heads=kv_heads, tp_size=p_tp)
    d_heads = HeadLayout(num_kv_heads=kv_heads, tp_size=d_tp)
    producers, consumers = _producers(p_heads), _consumers(d_heads)
    closing += producers + consumers
    for c in consumers:
        c.agent.serve()
    for p in producers:
        for c in consumers:
            p.agent.connect(*c.agent.address, c.agent.config.engine_id)
    assert len(builds) == planners, builds
    by_parity = {zlib.crc32(f"ahead-{i}".encode()) % 2: f"ahead-{i}" for i in range(16)}
    assert len(by_parity) == 2  # a request for each replica choice
    for i, rid in enumerate(sorted(by_parity.values())):
        remote, local = [i, i + 4], [i + 6, i + 2]
        cap = wire.new_capability()
        ticket = _ticket(producers, rid, 8, cap)
        transfers = [c.agent.expect_push(ticket, local) for c in consumers]
        for p in producers:
            p.agent.hold(rid, remote, 8, capability=cap)
        for t in transfers:
            t.wait(5)
            assert t.state is TransferState.DONE, t.error
        for c in consumers:
            assert c.cache.mismatches(local, remote, SEED) == []
    assert len(builds) == planners, "a push built a planner the connect had prepared"


def test_a_push_racing_the_connect_that_builds_its_planner_waits_for_that_build(
    closing: list[Rank], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that starts while ``Agent.connect`` builds the same write planner uses
    the connect's planner and chain lists instead of building them a second time: one
    build per prefill rank (rank 1 never connected ahead and builds at its write)."""
    builds = count_planner_builds(monkeypatch, delay_s=0.3)  # a window for the write
    p_heads, d_heads = HeadLayout(num_kv_heads=2, tp_size=2), HeadLayout(num_kv_heads=2, tp_size=1)
    producers, (consumer,) = _producers(p_heads), _consumers(d_heads)
    closing += [*producers, consumer]
    consumer.agent.serve()
    connecting = threading.Thread(
        target=producers[0].agent.connect,
        args=(*consumer.agent.address, consumer.agent.config.engine_id),
    )
    connecting.start()
    try:
        time.sleep(0.1)
        remote, local, cap = [1, 5], [7, 3], wire.new_capability()
        t = consumer.agent.expect_push(_ticket(producers, "raced", 8, cap), local)
        for p in producers:
            p.agent.hold("raced", remote, 8, capability=cap)
        t.wait(5)
    finally:
        connecting.join(5)
    assert t.state is TransferState.DONE, t.error
    assert consumer.cache.mismatches(local, remote, SEED) == []
    assert len(builds) == 2, builds


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 4)])
def test_connect_group_connects_each_consumer_rank_a_producer_rank_writes_into(
    closing: list[Rank], p_tp: int, d_tp: int
) -> None:
    """A push's producer rank given the decode group's rank 0 address and TP size
    handshakes with exactly the consumer ranks holding its heads; the push that
    follows needs no other handshake."""
    p_heads = HeadLayout(num_kv_heads=4, tp_size=p_tp)
    d_heads = HeadLayout(num_kv_heads=4, tp_size=d_tp)
    producers, consumers = _producers(p_heads), _consumers_serving(d_heads)
    closing += producers + consumers
    host, port = consumers[0].agent.address
    for p in producers:
        peers = p.agent.connect_group(host, port, d_tp, "decode")
        assert [peer.port - port for peer in peers] == list(reader_ranks(p_heads, p.rank, d_heads))
    before = [p.agent.stats().handshakes for p in producers]
    cap = wire.new_capability()
    ticket = _ticket(producers, "grouped", 8, cap)
    transfers = [c.agent.expect_push(ticket, [5, 6]) for c in consumers]
    for p in producers:
        p.agent.hold("grouped", [1, 2], 8, capability=cap)
    for t in transfers:
        t.wait(5)
        assert t.state is TransferState.DONE, t.error
    for c in consumers:
        assert c.cache.mismatches([5, 6], [1, 2], SEED) == []
    assert [p.agent.stats().handshakes for p in producers] == before


def test_a_producer_rank_frees_only_once_it_wrote_to_every_consumer_rank(
    closing: list[Rank],
) -> None:
    p_heads, d_heads = HeadLayout(num_kv_heads=4, tp_size=1), HeadLayout(num_kv_heads=4, tp_size=2)
    (producer,), consumers = _producers(p_heads), _consumers(d_heads)
    closing += [producer, *consumers]
    cap = wire.new_capability()
    ticket = _ticket([producer], "req-two", 8, cap)
    producer.agent.hold("req-two", [2, 3], 8, capability=cap)
    consumers[0].agent.expect_push(ticket, [4, 5]).wait(5)
    time.sleep(0.1)
    assert producer.agent.freed() == []
    assert "req-two" in producer.agent.holding()  # decode rank 1 did not register yet
    consumers[1].agent.expect_push(ticket, [6, 7]).wait(5)
    assert _freed([producer], "req-two") == {0: True}
    for c, blocks in zip(consumers, ([4, 5], [6, 7]), strict=True):
        assert c.cache.mismatches(blocks, [2, 3], SEED) == []


def test_one_producer_rank_failing_fails_the_push_with_every_block_invalid(
    closing: list[Rank],
) -> None:
    producers, consumer = _tp2_to_tp1_warm(closing)
    producers[1].backend.faults = Faults(fail_post=True)  # rank 1's write fails
    cap = wire.new_capability()
    ticket = _ticket(producers, "req-f", 12, cap)
    t0 = time.monotonic()
    transfer = consumer.agent.expect_push(ticket, [7, 8, 9])
    for p in producers:
        p.agent.hold("req-f", [3, 4, 5], 12, capability=cap)
    with pytest.raises(TransferError) as info:
        transfer.wait(10)
    assert time.monotonic() - t0 < 5  # nothing hangs
    assert transfer.state is TransferState.FAILED
    # Each producer rank writes a head slice of every block: all are invalid.
    assert transfer.invalid_blocks == (7, 8, 9)
    assert "producer rank(s) [1] of [0, 1]" in str(info.value)
    bad = consumer.cache.mismatches([7, 8, 9], [3, 4, 5], SEED)
    assert bad and {head for _, _, head, _, _ in bad} == {2, 3}
    assert _freed(producers[:1], "req-f") == {0: True}


def test_a_push_across_tp_sizes_is_doomed_once_one_rank_is_and_final_once_all_are(
    closing: list[Rank],
) -> None:
    """R-SAFE-5 across TP sizes: one producer rank's WRITE in flight past the deadline
    (stalled, uncancellable as over UCX) dooms the one Transfer the engine sees at
    once, so the engine can fail the request (Transfer.doomed, doomed_error), but it
    is final only once that WRITE ended: its blocks are quarantined until then."""
    # The producer ranks' own deadline is longer: only the consumer's is under test
    # (theirs would fail the hold, and tell the consumer once the WRITE ended).
    producers, consumer = _tp2_to_tp1_warm(closing, producer_timeout_s=30.0)
    producers[1].backend.faults = Faults(stall=True, uncancellable=True)
    cap = wire.new_capability()
    transfer = consumer.agent.expect_push(_ticket(producers, "req-d", 12, cap), [7, 8, 9])
    for p in producers:
        p.agent.hold("req-d", [3, 4, 5], 12, capability=cap)
    t0 = time.monotonic()
    while not transfer.doomed:
        assert time.monotonic() - t0 < 8, "not doomed after the deadline"
        transfer.poll()
        time.sleep(0.01)
    assert transfer.state is TransferState.PENDING and transfer.doomed_error is not None
    time.sleep(0.3)
    assert transfer.poll() is TransferState.PENDING  # rank 1's WRITE may still land
    assert consumer.agent.stats().quarantined == 1
    producers[1].backend.faults = Faults()  # the WRITE ends; rank 1 says so
    with pytest.raises(TransferError):
        transfer.wait(10)
    assert transfer.invalid_blocks == (7, 8, 9) and not transfer.doomed
    assert transfer.doomed_error is None
    assert consumer.agent.stats().quarantined == 0


def test_a_consumer_rank_aborting_releases_every_producer_rank_it_registered_with(
    closing: list[Rank],
) -> None:
    p_heads, d_heads = HeadLayout(num_kv_heads=4, tp_size=2), HeadLayout(num_kv_heads=4, tp_size=1)
    producers, (consumer,) = _producers(p_heads), _consumers(d_heads)
    closing += [*producers, consumer]
    cap = wire.new_capability()
    ticket = _ticket(producers, "req-a", 8, cap)
    for p in producers:
        p.agent.hold("req-a", [1, 2], 8, capability=cap)
    producers[0].backend.faults = Faults(never_complete=True)  # rank 0's write never lands
    transfer = consumer.agent.expect_push(ticket, [5, 6])
    time.sleep(0.3)
    consumer.agent.abort(ticket)
    with pytest.raises(TransferError):
        transfer.wait(5)
    assert transfer.state is TransferState.FAILED and transfer.invalid_blocks == (5, 6)
    # Both producer ranks drop the request at once (not at lease expiry), cancelling
    # rank 0's write in flight.
    deadline = time.monotonic() + 5
    while any("req-a" in p.agent.holding() for p in producers) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any("req-a" in p.agent.holding() for p in producers)


def test_a_push_across_tp_sizes_without_a_shared_capability_is_refused_by_name(
    closing: list[Rank],
) -> None:
    (consumer,) = _consumers(HeadLayout(num_kv_heads=4, tp_size=1))
    closing.append(consumer)
    ticket = Ticket.for_push("prefill", "127.0.0.1", 1, "r", 4, tp_size=2)
    with pytest.raises(ConfigError, match=r"ticket.capability='': a push across TP sizes"):
        consumer.agent.expect_push(ticket, [1])
    bad = msgspec.structs.replace(ticket, capability=wire.new_capability(), tp_size=3)
    with pytest.raises(ConfigError, match=r"ticket.tp_size=3"):
        consumer.agent.expect_push(bad, [1])


def test_a_stranger_registering_for_a_rank_gets_nothing_when_the_hold_is_pinned(
    closing: list[Rank],
) -> None:
    p_heads, d_heads = HeadLayout(num_kv_heads=4, tp_size=1), HeadLayout(num_kv_heads=4, tp_size=2)
    (producer,), consumers = _producers(p_heads), _consumers(d_heads)
    stranger = make_rank(
        "decode", Role.CONSUMER, d_heads, 1, 0, seed=None, direction=Direction.PUSH, timeout_s=3.0
    )
    closing += [producer, *consumers, stranger]
    cap = wire.new_capability()
    good = _ticket([producer], "req-s", 8, cap)
    forged = msgspec.structs.replace(good, capability=wire.new_capability())
    sneaky = stranger.agent.expect_push(forged, [8, 9])  # comes first, wrong token
    time.sleep(0.1)
    producer.agent.hold("req-s", [2, 3], 8, capability=cap)
    mine = [c.agent.expect_push(good, [4, 5]) for c in consumers]
    for t in mine:
        t.wait(5)
    for c in consumers:
        assert c.cache.mismatches([4, 5], [2, 3], SEED) == []
    with pytest.raises(TransferError):
        sneaky.wait(5)
    assert not any(buf[[8, 9]].any() for buf in stranger.cache.buffers.values())


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)])
def test_push_stream_across_tp_sizes_writes_closed_blocks_early_and_the_rest_at_the_hold(
    closing: list[Rank], p_tp: int, d_tp: int
) -> None:
    p_heads, d_heads = (
        HeadLayout(num_kv_heads=4, tp_size=p_tp),
        HeadLayout(num_kv_heads=4, tp_size=d_tp),
    )
    producers, consumers = _producers(p_heads, stream=True), _consumers(d_heads)
    closing += producers + consumers
    remote, local, tokens = [3, 7, 1], [10, 2, 5], 2 * 4 + 3
    cap = wire.new_capability()
    ticket = _ticket(producers, "req-st", tokens, cap)
    transfers = [c.agent.expect_push(ticket, local) for c in consumers]
    # Prefill closes two blocks and streams them at each step, as an engine does: each
    # call writes them to the consumer ranks registered since (registrations go from
    # worker threads, so a loaded host may take a while; a fixed 0.2 s was not enough).
    deadline = time.monotonic() + 10
    while not all(c.cache.mismatches(local[:2], remote[:2], SEED) == [] for c in consumers):
        assert time.monotonic() < deadline, "the streamed blocks never landed"
        for p in producers:
            p.agent.stream("req-st", remote, 2 * 4)
        time.sleep(0.05)
    for c in consumers:  # the streamed blocks landed before the hold, the last did not
        assert not any(buf[[local[2]]].any() for buf in c.cache.buffers.values())
    assert not any(t.done for t in transfers)
    for p in producers:
        p.agent.hold("req-st", remote, tokens, capability=cap)
    for t in transfers:
        t.wait(5)
    for c in consumers:
        assert c.cache.mismatches(local, remote, SEED) == []
    assert all(_freed(producers, "req-st").values())
