"""Pulls across tensor-parallel sizes between in-process Agents on the fake backend
(issue 18): several producer ranks, consumer ranks of another TP size, every
(layer, K/V, head, token) checked byte for byte; one producer rank failing gives one
FAILED transfer with exactly the invalid blocks, and nothing hangs."""

from __future__ import annotations

import itertools
import random
import threading
import time
import zlib
from typing import Any

import msgspec
import pytest

from kvxfer._agent.guard import GuardBook
from kvxfer._agent.readers import ReaderCount
from kvxfer.adapters.vllm.params import remote_ticket, ticket_params
from kvxfer.agent import Ticket
from kvxfer.core import wire
from kvxfer.core.heads import HeadLayout, needed_ranks
from kvxfer.errors import ConfigError, KvxferError, TransferError
from kvxfer.testing.fake_backend import Faults
from kvxfer.transfer import TransferState
from kvxfer.types import Direction
from tests.tp_ranks import NUM_BLOCKS, Rank, consumers, count_planner_builds, producers
from tests.tp_ranks import closing as closing  # the fixture, by name

SEED = 21
# Guard slots, in turn (each test's agents are new; none holds 76 requests at once).
_slots = (i % GuardBook.slots_for(NUM_BLOCKS) for i in itertools.count())


def _producers(heads: HeadLayout) -> list[Rank]:
    return producers(heads, seed=SEED, direction=Direction.PULL, timeout_s=2.0)


def _consumers(heads: HeadLayout) -> list[Rank]:
    return consumers(heads, direction=Direction.PULL, timeout_s=2.0)


def _hold(producers: list[Rank], rid: str, block_ids: list[int], tokens: int) -> Ticket:
    """Every producer rank holds the request; the router gets rank 0's ticket with
    every rank's incarnation."""
    # One capability and one guard word (slot, generation) for the request on every
    # rank, as vLLM's scheduler mints them.
    cap, guard = wire.new_capability(), (next(_slots), random.randrange(1, 2**56))
    tickets = [p.agent.hold(rid, block_ids, tokens, capability=cap, guard=guard) for p in producers]
    return msgspec.structs.replace(tickets[0], incarnations=tuple(t.incarnation for t in tickets))


PAIRS = [(4, 1, 2), (4, 2, 1), (4, 4, 2), (4, 2, 4), (2, 1, 4), (2, 4, 1), (1, 2, 1)]
#: Pairs where a decode rank reads two heads or more from one producer rank, which
#: abut on both sides: each rank's part posts rows of chain lists (core.block_lists).
CHAINED = {(4, 1, 2), (4, 2, 1)}


@pytest.mark.parametrize("lists", [True, False], ids=["chain-lists", "ids"])
@pytest.mark.parametrize(("kv_heads", "p_tp", "d_tp"), PAIRS)
def test_pull_across_tp_sizes_moves_every_head_exactly(
    closing: list[Rank], kv_heads: int, p_tp: int, d_tp: int, lists: bool
) -> None:
    p_heads = HeadLayout(num_kv_heads=kv_heads, tp_size=p_tp)
    d_heads = HeadLayout(num_kv_heads=kv_heads, tp_size=d_tp)
    producers, consumers = _producers(p_heads), _consumers(d_heads)
    closing += producers + consumers
    for c in consumers:
        c.backend.chain_lists = lists
    remote, local, tokens = [3, 7, 1, 9], [10, 2, 5, 4], 3 * 4 + 2
    ticket = _hold(producers, "req-a", remote, tokens)
    assert ticket.tp_size == p_tp
    transfers = [c.agent.pull(ticket, local) for c in consumers]
    for t in transfers:
        t.wait(5)
        assert t.state is TransferState.DONE
    for c in consumers:
        assert c.cache.mismatches(local, remote, SEED) == []
        assert (c.backend.lists_posted > 0) == (lists and (kv_heads, p_tp, d_tp) in CHAINED)
        # untouched blocks stay empty
        assert not any(buf[[0, 6, 11]].any() for buf in c.cache.buffers.values())
    salt = zlib.crc32(b"req-a")
    for c in consumers:
        rank = c.agent.config.tp.rank  # type: ignore[union-attr]
        assert c.agent.stats().handshakes == len(needed_ranks(d_heads, rank, p_heads, salt=salt))
    # Every producer rank frees the request: those read on their DONE notice, replicas
    # nobody reads on a release from the consumer at once (not at lease expiry).
    deadline = time.monotonic() + 5
    freed: dict[int, list[str]] = {p: [] for p in range(p_tp)}
    while time.monotonic() < deadline:
        for p in range(p_tp):
            freed[p] += producers[p].agent.freed()
        if all("req-a" in f for f in freed.values()):
            break
        time.sleep(0.01)
    assert all("req-a" in f for f in freed.values()), freed


def test_a_second_request_reuses_handshakes_and_planner(closing: list[Rank]) -> None:
    p_heads, d_heads = HeadLayout(num_kv_heads=4, tp_size=2), HeadLayout(num_kv_heads=4, tp_size=1)
    producers, (consumer,) = _producers(p_heads), _consumers(d_heads)
    closing += [*producers, consumer]
    for i in range(3):
        rid = f"again-{i}"
        remote, local = [i, i + 4], [i + 6, i + 2]
        ticket = _hold(producers, rid, remote, 8)
        consumer.agent.pull(ticket, local).wait(5)
        assert consumer.cache.mismatches(local, remote, SEED) == []
    assert consumer.agent.stats().handshakes == 2
    stats = consumer.agent.stats()
    assert stats.transfers_done == 6  # one sub-transfer per producer rank per request


@pytest.mark.parametrize(("kv_heads", "p_tp", "choices"), [(4, 2, 1), (2, 4, 2)])
def test_connecting_to_the_ranks_ahead_builds_the_planners_before_the_first_pull(
    closing: list[Rank], monkeypatch: pytest.MonkeyPatch, kv_heads: int, p_tp: int, choices: int
) -> None:
    """An engine that connects to a producer group's ranks ahead of its first pull
    (``Agent.connect``) finds the planner built (issue 27: 3-20 ms of the first pull).
    With replicated heads (2 heads over 4 ranks) each replica choice has its planner;
    the requests' salts pick both here."""
    builds = count_planner_builds(monkeypatch)
    p_heads, d_heads = (
        HeadLayout(num_kv_heads=kv_heads, tp_size=p_tp),
        HeadLayout(num_kv_heads=kv_heads, tp_size=1),
    )
    producers, (consumer,) = _producers(p_heads), _consumers(d_heads)
    closing += [*producers, consumer]
    consumer.agent.connect(*producers[0].agent.address, producers[0].agent.config.engine_id)
    assert not builds  # rank 0 alone serves no pull
    for p in producers[1:]:
        consumer.agent.connect(*p.agent.address, p.agent.config.engine_id)
    assert len(builds) == choices, builds
    by_parity = {zlib.crc32(f"ahead-{i}".encode()) % 2: f"ahead-{i}" for i in range(16)}
    assert len(by_parity) == 2  # a request for each replica choice
    for i, rid in enumerate(sorted(by_parity.values())):
        remote, local = [i, i + 4], [i + 6, i + 2]
        t = consumer.agent.pull(_hold(producers, rid, remote, 8), local)
        t.wait(5)
        assert t.state is TransferState.DONE, t.error
        assert consumer.cache.mismatches(local, remote, SEED) == []
    assert len(builds) == choices, "a pull built a planner the connect had prepared"


def test_a_pull_racing_the_connect_that_builds_its_planner_waits_for_that_build(
    closing: list[Rank], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull that starts while ``Agent.connect`` builds the same planner (an engine's
    first request right at start-up, under vLLM) uses the connect's planner and chain
    lists instead of building and preparing them a second time."""
    builds = count_planner_builds(monkeypatch, delay_s=0.3)  # a window for the pull
    p_heads, d_heads = HeadLayout(num_kv_heads=2, tp_size=2), HeadLayout(num_kv_heads=2, tp_size=1)
    producers, (consumer,) = _producers(p_heads), _consumers(d_heads)
    closing += [*producers, consumer]
    consumer.agent.connect(*producers[0].agent.address, producers[0].agent.config.engine_id)
    last = producers[1].agent
    connecting = threading.Thread(
        target=consumer.agent.connect, args=(*last.address, last.config.engine_id)
    )
    connecting.start()
    try:
        time.sleep(0.1)
        remote, local = [1, 5], [7, 3]
        t = consumer.agent.pull(_hold(producers, "raced", remote, 8), local)
        t.wait(5)
    finally:
        connecting.join(5)
    assert t.state is TransferState.DONE, t.error
    assert consumer.cache.mismatches(local, remote, SEED) == []
    assert len(builds) == 1, builds


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (4, 2), (2, 2)])
def test_connect_group_connects_each_rank_a_decode_rank_reads_and_no_other(
    closing: list[Rank], p_tp: int, d_tp: int
) -> None:
    """``Agent.connect_group`` with the producer group's rank 0 address and TP size
    handshakes with exactly the producer ranks holding the decode rank's heads (rank
    with rank between equal sizes), and the first pull finds them all connected."""
    p_heads = HeadLayout(num_kv_heads=4, tp_size=p_tp)
    d_heads = HeadLayout(num_kv_heads=4, tp_size=d_tp)
    producers, consumers = _producers(p_heads), _consumers(d_heads)
    closing += producers + consumers
    host, port = producers[0].agent.address
    for c in consumers:
        peers = c.agent.connect_group(host, port, p_tp, "prefill")
        want = needed_ranks(d_heads, c.rank, p_heads) if p_tp != d_tp else (c.rank,)
        assert [peer.port - port for peer in peers] == list(want)
        assert c.agent.stats().handshakes == len(want)
    cap, guard = wire.new_capability(), (next(_slots), random.randrange(1, 2**56))
    held = [p.agent.hold("grouped", [1, 2], 8, capability=cap, guard=guard) for p in producers]
    incarnations = tuple(t.incarnation for t in held)
    for c in consumers:
        # Across TP sizes every rank gets rank 0's ticket; between equal ones its own.
        own = held[c.rank] if p_tp == d_tp else held[0]
        ticket = msgspec.structs.replace(own, incarnations=incarnations)
        t = c.agent.pull(ticket, [5, 6])
        t.wait(5)
        assert t.state is TransferState.DONE, t.error
        assert c.cache.mismatches([5, 6], [1, 2], SEED) == []
    assert all(
        c.agent.stats().handshakes == len(c.agent.connect_group(host, port, p_tp))
        for c in consumers
    )


def test_connect_group_refuses_what_it_cannot_connect_by_name(closing: list[Rank]) -> None:
    producers = _producers(HeadLayout(num_kv_heads=4, tp_size=2))
    (consumer,) = _consumers(HeadLayout(num_kv_heads=4, tp_size=1))
    closing += [*producers, consumer]
    host, port = producers[0].agent.address
    with pytest.raises(ConfigError, match=r"^tp_size=3: must divide num_kv_heads"):
        consumer.agent.connect_group(host, port, 3)
    with pytest.raises(ConfigError, match=r"^tp_size=0: must be a positive int"):
        consumer.agent.connect_group(host, port, 0)
    with pytest.raises(ConfigError, match=r"^port=65535: rank 1 would serve at 65536"):
        consumer.agent.connect_group(host, 65535, 2)
    with pytest.raises(ConfigError, match=r"^role='kv_producer': a pull kv_producer never posts"):
        producers[0].agent.connect_group(host, port + 1, 1)
    assert consumer.agent.stats().handshakes == 0


def test_connecting_ahead_uses_each_connection_once_before_the_first_pull(
    closing: list[Rank], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Agent.connect`` uses each producer rank's new connection once, ahead of any
    request: one read of its guard word and one WARM notice, which the producer ignores
    (issue 27: the first pull across TP sizes paid 0.4-1.1 ms for its first guard read
    and ~1.8 ms for its first notice). The agent's first read is posted as
    ``warm_up_descriptors`` descriptors (its first large post grew the heap inside the
    first pull). Connecting again does neither; a pull is DONE."""
    p_heads, d_heads = HeadLayout(num_kv_heads=4, tp_size=2), HeadLayout(num_kv_heads=4, tp_size=1)
    producers, (consumer,) = _producers(p_heads), _consumers(d_heads)
    closing += [*producers, consumer]
    backend = consumer.backend
    reads: list[tuple[int, int]] = []
    notices: list[bytes] = []
    real_read, real_notify = backend.post_guard_read, backend.notify

    def read(peer: Any, slot: int, notification: bytes = b"", *, copies: int = 1) -> Any:
        reads.append((slot, copies))
        return real_read(peer, slot, notification, copies=copies)

    def notify(peer: Any, payload: bytes) -> None:
        notices.append(payload)
        real_notify(peer, payload)

    monkeypatch.setattr(backend, "post_guard_read", read)
    monkeypatch.setattr(backend, "notify", notify)
    for _ in range(2):
        for p in producers:
            consumer.agent.connect(*p.agent.address, p.agent.config.engine_id)
    # Once per rank, however often it connects; the agent's first read as many
    # descriptors as a large request (the heap and pools grow there), the next as one.
    assert reads == [(0, consumer.agent.config.warm_up_descriptors), (0, 1)]
    assert len(notices) == 2 and all(b"warm" in n for n in notices), notices
    remote, local = [1, 2], [3, 4]
    t = consumer.agent.pull(_hold(producers, "after-warm", remote, 8), local)
    t.wait(5)
    assert t.state is TransferState.DONE, t.error
    assert consumer.cache.mismatches(local, remote, SEED) == []
    # The WARM notices were drained (the DONEs after them were) and not taken for bad.
    assert [p.agent.stats().notices_failed for p in producers] == [0, 0]


def test_a_pull_across_tp_sizes_tells_each_rank_done_over_the_side_channel(
    closing: list[Rank], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each producer rank hears a pull's DONE over the side channel from an io worker,
    as a direct pull's producer does: never as a notification on the data endpoint (on
    UCX the next read there would complete only once that rank's worker progressed),
    nor sent on the engine's thread. Every rank frees the request."""
    p_heads, d_heads = HeadLayout(num_kv_heads=4, tp_size=2), HeadLayout(num_kv_heads=4, tp_size=1)
    producers, (consumer,) = _producers(p_heads), _consumers(d_heads)
    closing += [*producers, consumer]
    notices: list[bytes] = []
    real_notify = consumer.backend.notify

    def notify(peer: Any, payload: bytes) -> None:
        notices.append(payload)
        real_notify(peer, payload)

    monkeypatch.setattr(consumer.backend, "notify", notify)
    remote, local = [1, 2], [3, 4]
    t = consumer.agent.pull(_hold(producers, "req-sc", remote, 8), local)
    t.wait(5)
    assert t.state is TransferState.DONE, t.error
    assert consumer.cache.mismatches(local, remote, SEED) == []
    deadline = time.monotonic() + 5
    while any("req-sc" in p.agent.holding() for p in producers):
        assert time.monotonic() < deadline, "a producer rank never freed the request"
        time.sleep(0.01)
    assert notices == []


def test_a_pull_across_tp_sizes_tells_no_rank_done_while_another_rank_posts(
    closing: list[Rank], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks' DONEs go once every rank's part settled, not as each part does: an
    io worker telling the first rank while the engine's thread posts the next rank's
    read took the GIL from that post (0.4-0.6 ms of a 10 ms pull, issue 27). While
    the second rank's read is posted (held here for up to a second), the first rank,
    whose part is already DONE, still holds the request; afterwards both free it."""
    p_heads, d_heads = HeadLayout(num_kv_heads=4, tp_size=2), HeadLayout(num_kv_heads=4, tp_size=1)
    producers, (consumer,) = _producers(p_heads), _consumers(d_heads)
    closing += [*producers, consumer]
    for p in producers:
        consumer.agent.connect(*p.agent.address, p.agent.config.engine_id)
    posts: list[Any] = []
    held_during: list[list[bool]] = []

    def holding() -> list[bool]:
        return ["req-late" in p.agent.holding() for p in producers]

    def held(real: Any) -> Any:
        def post(*args: Any, **kwargs: Any) -> Any:
            if posts:  # the second rank's read: a DONE told early has a second to arrive
                deadline = time.monotonic() + 1.0
                while time.monotonic() < deadline and all(holding()):
                    time.sleep(0.01)
                held_during.append(holding())
            posts.append(args[0])
            return real(*args, **kwargs)

        return post

    # Rows of chain lists (kvxfer.core.block_lists) where the ranks' heads chain, ids else.
    for name in ("post_engine", "post_lists"):
        monkeypatch.setattr(consumer.backend, name, held(getattr(consumer.backend, name)))
    remote, local = [1, 2], [3, 4]
    t = consumer.agent.pull(_hold(producers, "req-late", remote, 8), local)
    t.wait(5)
    assert t.state is TransferState.DONE, t.error
    assert len(posts) == 2 and held_during == [[True, True]], (posts, held_during)
    deadline = time.monotonic() + 5
    while any("req-late" in p.agent.holding() for p in producers):
        assert time.monotonic() < deadline, "a producer rank never freed the request"
        time.sleep(0.01)


def test_a_pull_across_tp_sizes_of_blocks_a_rank_freed_fails_closed(
    closing: list[Rank],
) -> None:
    """R-SAFE-1 per producer rank: a second pull of a ticket whose ranks freed (and
    whose engines reused) the blocks reads each rank's guard word after its data and
    fails with every block invalid, never DONE over another request's bytes."""
    p_heads, d_heads = HeadLayout(num_kv_heads=4, tp_size=2), HeadLayout(num_kv_heads=4, tp_size=1)
    producers, (consumer,) = _producers(p_heads), _consumers(d_heads)
    closing += [*producers, consumer]
    remote = [1, 2]
    ticket = _hold(producers, "req-g", remote, 8)
    consumer.agent.pull(ticket, [3, 4]).wait(5)
    assert consumer.cache.mismatches([3, 4], remote, SEED) == []
    reads = consumer.agent.stats().guard_reads
    assert reads == 2  # one guard word per producer rank
    deadline = time.monotonic() + 5
    freed: dict[int, list[str]] = {0: [], 1: []}
    while not all("req-g" in f for f in freed.values()) and time.monotonic() < deadline:
        for p in (0, 1):
            freed[p] += producers[p].agent.freed()
        time.sleep(0.01)
    assert all("req-g" in f for f in freed.values()), freed
    for p in producers:  # each engine reuses the blocks for another request
        for buf in p.cache.buffers.values():
            buf[remote] = 0xEE
    again = consumer.agent.pull(ticket, [5, 6])
    with pytest.raises(TransferError):
        again.wait(5)
    assert again.state is TransferState.FAILED and again.invalid_blocks == (5, 6)
    assert consumer.agent.stats().guard_failures >= 1


def test_one_producer_rank_failing_fails_the_pull_with_exact_blocks(
    closing: list[Rank],
) -> None:
    p_heads, d_heads = HeadLayout(num_kv_heads=4, tp_size=2), HeadLayout(num_kv_heads=4, tp_size=1)
    producers, (consumer,) = _producers(p_heads), _consumers(d_heads)
    closing += [*producers, consumer]
    # Handshake first, so the failure is in the data plane (mid-request).
    warm = _hold(producers, "warm", [0], 4)
    consumer.agent.pull(warm, [0]).wait(5)
    producers[1].backend.faults = Faults(gone=True)  # rank 1's process died
    remote, local = [3, 4, 5], [7, 8, 9]
    ticket = _hold(producers, "req-f", remote, 12)
    t0 = time.monotonic()
    transfer = consumer.agent.pull(ticket, local)
    with pytest.raises(TransferError) as info:
        transfer.wait(10)
    assert time.monotonic() - t0 < 5  # nothing hangs
    assert transfer.state is TransferState.FAILED
    assert transfer.invalid_blocks == (7, 8, 9)
    assert info.value.invalid_blocks == (7, 8, 9)
    assert "producer rank(s) [1] of [0, 1]" in str(info.value)
    # Rank 0's heads landed, byte for byte; rank 1's did not.
    bad = consumer.cache.mismatches(local, remote, SEED)
    assert bad and {head for _, _, head, _, _ in bad} == {2, 3}
    # Rank 0 got its DONE (its read completed) and frees the request.
    deadline = time.monotonic() + 5
    freed: list[str] = []
    while "req-f" not in freed and time.monotonic() < deadline:
        freed += producers[0].agent.freed()
        time.sleep(0.01)
    assert "req-f" in freed


def test_a_rank_that_does_not_answer_fails_the_pull_and_releases_the_others(
    closing: list[Rank],
) -> None:
    p_heads, d_heads = HeadLayout(num_kv_heads=4, tp_size=2), HeadLayout(num_kv_heads=4, tp_size=1)
    producers, (consumer,) = _producers(p_heads), _consumers(d_heads)
    closing += [*producers, consumer]
    ticket = _hold(producers, "req-h", [1, 2], 8)
    producers[1].agent.close()  # rank 1 is gone before the first contact
    transfer = consumer.agent.pull(ticket, [3, 4])
    with pytest.raises(TransferError):
        transfer.wait(30)
    assert transfer.invalid_blocks == (3, 4)
    # Rank 0 was not read and is told to release at once.
    deadline = time.monotonic() + 10
    while "req-h" in producers[0].agent.holding() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "req-h" not in producers[0].agent.holding()


def test_a_ticket_tp_size_the_heads_do_not_allow_is_refused_by_name(
    closing: list[Rank],
) -> None:
    (consumer,) = _consumers(HeadLayout(num_kv_heads=4, tp_size=1))
    closing.append(consumer)
    ticket = Ticket(
        engine_id="prefill",
        host="127.0.0.1",
        port=1,
        request_id="r",
        block_ids=((1,),),
        num_tokens=4,
        tp_size=3,
    )
    with pytest.raises(ConfigError, match=r"ticket.tp_size=3"):
        consumer.agent.pull(ticket, [2])


def test_a_wrong_incarnation_of_another_rank_fails_the_pull(closing: list[Rank]) -> None:
    p_heads, d_heads = HeadLayout(num_kv_heads=4, tp_size=2), HeadLayout(num_kv_heads=4, tp_size=1)
    producers, (consumer,) = _producers(p_heads), _consumers(d_heads)
    closing += [*producers, consumer]
    ticket = _hold(producers, "req-i", [1], 4)
    stale = msgspec.structs.replace(ticket, incarnations=(ticket.incarnations[0], 12345))
    transfer = consumer.agent.pull(stale, [2])
    with pytest.raises(TransferError, match="restarted"):
        transfer.wait(10)
    assert transfer.invalid_blocks == (2,)


def test_a_producer_rank_read_by_two_decode_ranks_frees_after_both(
    closing: list[Rank],
) -> None:
    p_heads, d_heads = HeadLayout(num_kv_heads=4, tp_size=1), HeadLayout(num_kv_heads=4, tp_size=2)
    (producer,), consumers = _producers(p_heads), _consumers(d_heads)
    closing += [producer, *consumers]
    ticket = _hold([producer], "req-two", [2, 3], 8)
    consumers[0].agent.pull(ticket, [4, 5]).wait(5)
    time.sleep(0.05)  # its DONE has arrived and been handled
    assert producer.agent.freed() == []
    assert "req-two" in producer.agent.holding()  # decode rank 1 has not read yet
    consumers[1].agent.pull(ticket, [6, 7]).wait(5)
    deadline = time.monotonic() + 5
    freed: list[str] = []
    while "req-two" not in freed and time.monotonic() < deadline:
        freed += producer.agent.freed()
        time.sleep(0.01)
    assert freed == ["req-two"]
    for c, local in zip(consumers, ([4, 5], [6, 7]), strict=True):
        assert c.cache.mismatches(local, [2, 3], SEED) == []


def test_a_release_from_one_reader_and_a_done_from_the_other_free_once(
    closing: list[Rank],
) -> None:
    p_heads, d_heads = HeadLayout(num_kv_heads=4, tp_size=1), HeadLayout(num_kv_heads=4, tp_size=2)
    (producer,), consumers = _producers(p_heads), _consumers(d_heads)
    closing += [producer, *consumers]
    ticket = _hold([producer], "req-rel", [2], 4)
    # Decode rank 0's pull is refused at the call (a wrong block count): it releases.
    with pytest.raises(KvxferError):
        consumers[0].agent.pull(ticket, [4, 5])
    time.sleep(0.2)
    assert "req-rel" in producer.agent.holding()  # rank 1 may still read
    consumers[1].agent.pull(ticket, [6]).wait(5)
    deadline = time.monotonic() + 5
    while "req-rel" in producer.agent.holding() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "req-rel" not in producer.agent.holding()


def test_reader_count_counts_distinct_readers_once() -> None:
    count = ReaderCount()
    assert count.last("a", 1, 0)
    assert not count.last("b", 3, 0)
    assert not count.last("b", 3, 0)  # a duplicate counts once
    assert not count.last("b", 3, 2)
    assert count.last("b", 3, 1)
    assert not count.last("b", 3, 1)  # a new round for a reused id starts over


def test_every_ranks_incarnation_survives_kv_transfer_params() -> None:
    ticket = Ticket(
        engine_id="prefill",
        host="h",
        port=7000,
        request_id="r",
        block_ids=((1, 2),),
        num_tokens=8,
        incarnation=5,
        tp_size=2,
        incarnations=(5, 9),
    )
    # the vLLM adapter's params.py is the one place tickets become kv_transfer_params
    params = ticket_params(ticket, direction=Direction.PULL, incarnations=ticket.incarnations)
    assert params["remote_incarnations"] == ["0000000000000005", "0000000000000009"]
    rank1 = remote_ticket(params, tp_rank=1, transfer_id="r", local_blocks=((3, 4),))
    assert (rank1.port, rank1.incarnation) == (7001, 9)


def test_reader_counts_are_bounded_and_ignore_impossible_reports() -> None:
    counts = ReaderCount(max_requests=8)
    assert not counts.last("x", 2, -1)  # not a consumer rank
    assert not counts.last("x", 10**6, 0)  # more readers than any TP size
    for i in range(100):  # a flood of partial counts keeps at most max_requests
        assert not counts.last(f"r{i}", 2, 0)
    assert len(counts) == 8
    assert counts.last("r99", 2, 1)  # the newest still completes
    assert not counts.last("r0", 2, 1)  # the oldest was dropped: it never frees early


def test_a_kept_hold_across_tp_sizes_is_renewed_on_every_producer_rank(
    closing: list[Rank],
) -> None:
    # Prefill TP2 holds for 1.5 s; a TP1 decode keeps the request waiting 2.5 leases,
    # calling nothing, then reads both ranks' heads exactly.
    lease = 1.5
    p_heads, d_heads = HeadLayout(num_kv_heads=2, tp_size=2), HeadLayout(num_kv_heads=2, tp_size=1)
    producers, consumers = _producers(p_heads), _consumers(d_heads)
    closing += producers + consumers
    cap, guard = wire.new_capability(), (next(_slots), random.randrange(1, 2**56))
    tickets = [
        p.agent.hold("kept", [3, 7], 8, capability=cap, guard=guard, lease_s=lease)
        for p in producers
    ]
    ticket = msgspec.structs.replace(tickets[0], incarnations=tuple(t.incarnation for t in tickets))
    (consumer,) = consumers
    assert consumer.agent.keep_alive([ticket]) == 1
    time.sleep(2.5 * lease)
    assert all(p.agent.holding() == ["kept"] for p in producers)
    assert all(p.agent.stats().leases_renewed >= 2 for p in producers)
    t = consumer.agent.pull(ticket, [10, 2])
    t.wait(5)
    assert t.state is TransferState.DONE, t.error
    assert consumer.cache.mismatches([10, 2], [3, 7], SEED) == []
    stats = consumer.agent.stats()
    assert stats.renewals_refused == 0 and stats.renewals_lapsed == 0
