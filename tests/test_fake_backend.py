"""The fake backend itself: real copies on its in-process fabric, and every injected fault."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.backend import BackendOptions, PeerHandle, XferHandle, XferOp, XferStatus
from kvxfer.core.descriptors import DescriptorTable, PlanOptions, build_plan
from kvxfer.errors import BackendError, PeerError, RegistrationError
from kvxfer.registry import get_backend
from kvxfer.testing.fake_backend import FakeBackend, Faults, fabric_members
from kvxfer.testing.patterns import CacheShape, PatternCache, expected_after

_names = itertools.count()
SHAPE = CacheShape(num_blocks=8)


class Side:
    """One fake endpoint with its pattern cache, registered and prepared."""

    def __init__(self, role: str, seed: int, options: PlanOptions | None = None) -> None:
        self.name = f"{role}-{os.getpid()}-{next(_names)}"
        self.seed = seed
        self.cache = PatternCache(SHAPE)
        self.cache.fill(seed)
        self.backend = FakeBackend(BackendOptions(agent_name=self.name))
        self.backend.register(self.cache.layout)
        self.table = DescriptorTable.build(self.cache.layout, options)
        self.backend.prepare_local(self.table)

    def connect(self, other: Side) -> PeerHandle:
        return self.backend.add_peer(other.backend.metadata(), other.table)


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side, PeerHandle]]:
    consumer, producer = Side("consumer", 1), Side("producer", 2)
    peer = consumer.connect(producer)
    producer.connect(consumer)
    yield consumer, producer, peer
    consumer.backend.close()
    producer.backend.close()


def wait(backend: FakeBackend, handle: XferHandle, polls: int = 50) -> XferStatus:
    state = backend.status(handle)
    for _ in range(polls):
        if state is not XferStatus.PENDING:
            break
        state = backend.status(handle)
    return state


def read_expected(consumer: Side, producer: Side, lids: np.ndarray, rids: np.ndarray) -> np.ndarray:
    return expected_after(
        consumer.cache,
        consumer.seed,
        producer.seed,
        (consumer.table, lids),
        (producer.table, rids),
    )


def test_read_and_write_move_exactly_the_posted_descriptors(
    pair: tuple[Side, Side, PeerHandle],
) -> None:
    consumer, producer, peer = pair
    lids, rids = np.array([3, 40, 41, 7]), np.array([9, 0, 1, 60])
    h = consumer.backend.post(XferOp.READ, peer, lids, rids)
    assert wait(consumer.backend, h) is XferStatus.DONE
    assert np.array_equal(consumer.cache.snapshot(), read_expected(consumer, producer, lids, rids))
    consumer.cache.fill(consumer.seed)
    h = consumer.backend.post(XferOp.WRITE, peer, lids, rids)
    assert wait(consumer.backend, h) is XferStatus.DONE
    expected = expected_after(
        producer.cache, producer.seed, consumer.seed, (producer.table, rids), (consumer.table, lids)
    )
    assert np.array_equal(producer.cache.snapshot(), expected)


def test_removing_a_peer_fails_its_reads_in_flight_but_not_its_writes(
    pair: tuple[Side, Side, PeerHandle],
) -> None:
    """The Backend.remove_peer contract, as the NIXL edge keeps it: a WRITE in flight
    goes on and lands (over TCP its queued bytes would), a READ fails."""
    consumer, producer, peer = pair
    lids = rids = np.arange(4)
    consumer.backend.faults = Faults(complete_after_polls=1)
    read = consumer.backend.post(XferOp.READ, peer, lids, rids)
    write = consumer.backend.post(XferOp.WRITE, peer, lids, rids)
    consumer.backend.remove_peer(peer)
    assert wait(consumer.backend, read) is XferStatus.FAILED
    assert wait(consumer.backend, write) is XferStatus.DONE
    expected = expected_after(
        producer.cache, producer.seed, consumer.seed, (producer.table, rids), (consumer.table, lids)
    )
    assert np.array_equal(producer.cache.snapshot(), expected)
    with pytest.raises(PeerError):
        consumer.backend.post(XferOp.WRITE, peer, lids, rids)


def test_transfer_moves_only_when_polled_and_notifies_after(
    pair: tuple[Side, Side, PeerHandle],
) -> None:
    consumer, producer, peer = pair
    consumer.backend.faults = Faults(complete_after_polls=2)
    lids = rids = np.arange(4)
    h = consumer.backend.post(XferOp.READ, peer, lids, rids, b"done")
    untouched = consumer.cache.expected(consumer.seed)
    for _ in range(2):
        assert consumer.backend.status(h) is XferStatus.PENDING
        assert np.array_equal(consumer.cache.snapshot(), untouched)
        assert producer.backend.drain_notifications() == []
    assert consumer.backend.status(h) is XferStatus.DONE
    assert np.array_equal(consumer.cache.snapshot(), read_expected(consumer, producer, lids, rids))
    assert producer.backend.drain_notifications() == [(consumer.name, b"done")]
    assert producer.backend.drain_notifications() == []


def test_fail_post(pair: tuple[Side, Side, PeerHandle]) -> None:
    consumer, _, peer = pair
    consumer.backend.faults = Faults(fail_post=True)
    with pytest.raises(BackendError, match="injected"):
        consumer.backend.post(XferOp.READ, peer, np.arange(2), np.arange(2))
    consumer.backend.faults = Faults()
    h = consumer.backend.post(XferOp.READ, peer, np.arange(2), np.arange(2))
    assert wait(consumer.backend, h) is XferStatus.DONE


def test_ids_that_do_not_pair_are_refused_by_count(pair: tuple[Side, Side, PeerHandle]) -> None:
    consumer, _, peer = pair
    with pytest.raises(BackendError, match=r"3 local but 2 remote descriptors; they pair by"):
        consumer.backend.post(XferOp.READ, peer, np.arange(3), np.arange(2))


def test_completion_that_never_arrives(pair: tuple[Side, Side, PeerHandle]) -> None:
    consumer, producer, peer = pair
    consumer.backend.faults = Faults(never_complete=True)
    h = consumer.backend.post(XferOp.READ, peer, np.arange(8), np.arange(8), b"never")
    consumer.backend.faults = Faults()  # faults are read at post time
    assert wait(consumer.backend, h, polls=500) is XferStatus.PENDING
    assert consumer.backend.transferred_bytes(h) == 0
    assert np.array_equal(consumer.cache.snapshot(), consumer.cache.expected(consumer.seed))
    assert producer.backend.drain_notifications() == []
    consumer.backend.release(h)
    assert consumer.backend.status(h) is XferStatus.FAILED


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 0.99])
def test_fail_midway_lands_a_strict_prefix(
    pair: tuple[Side, Side, PeerHandle], fraction: float
) -> None:
    consumer, producer, peer = pair
    consumer.backend.faults = Faults(fail_midway=fraction)
    lids, rids = np.array([10, 3, 4, 5, 30]), np.array([2, 7, 8, 9, 60])
    h = consumer.backend.post(XferOp.READ, peer, lids, rids, b"x")
    assert wait(consumer.backend, h) is XferStatus.FAILED
    total = int(consumer.table.length[lids].sum())
    moved = consumer.backend.transferred_bytes(h)
    assert moved == min(int(total * fraction), total - 1)
    # Exactly the first `moved` bytes, in descriptor order, hold the producer's bytes.
    full = read_expected(consumer, producer, lids, rids)
    before = consumer.cache.expected(consumer.seed)
    got = consumer.cache.snapshot()
    changed = int(np.count_nonzero(got != before))
    assert changed <= moved
    assert np.array_equal(got[got != before], full[got != before])
    first_len = int(consumer.table.length[lids[0]])
    if moved >= first_len:
        one = read_expected(consumer, producer, lids[:1], rids[:1])
        mask = one != before
        assert np.array_equal(got[mask], one[mask])
    assert producer.backend.drain_notifications() == []


def test_peer_gone(pair: tuple[Side, Side, PeerHandle]) -> None:
    consumer, producer, peer = pair
    consumer.backend.faults = Faults(never_complete=True)
    stuck = consumer.backend.post(XferOp.READ, peer, np.arange(2), np.arange(2))
    consumer.backend.faults = Faults(complete_after_polls=100)
    pending = consumer.backend.post(XferOp.READ, peer, np.arange(2), np.arange(2))
    consumer.backend.faults = Faults()
    done = consumer.backend.post(XferOp.READ, peer, np.arange(2), np.arange(2))
    assert wait(consumer.backend, done) is XferStatus.DONE
    assert consumer.backend.status(pending) is XferStatus.PENDING
    producer.backend.faults = Faults(gone=True)
    assert producer.name not in fabric_members()
    assert consumer.backend.status(pending) is XferStatus.FAILED
    assert consumer.backend.status(stuck) is XferStatus.FAILED
    assert consumer.backend.status(done) is XferStatus.DONE
    with pytest.raises(PeerError):
        consumer.backend.post(XferOp.READ, peer, np.arange(2), np.arange(2))
    with pytest.raises(PeerError):
        consumer.backend.notify(peer, b"x")
    with pytest.raises(PeerError):
        consumer.backend.add_peer(producer.backend.metadata(), producer.table)
    producer.backend.faults = Faults()  # back on the fabric (a healed partition)
    h = consumer.backend.post(XferOp.READ, peer, np.arange(2), np.arange(2))
    assert wait(consumer.backend, h) is XferStatus.DONE


def test_done_stays_done_when_the_peer_leaves(pair: tuple[Side, Side, PeerHandle]) -> None:
    consumer, producer, peer = pair
    h = consumer.backend.post(XferOp.READ, peer, np.arange(2), np.arange(2))
    assert wait(consumer.backend, h) is XferStatus.DONE
    producer.backend.close()
    assert consumer.backend.status(h) is XferStatus.DONE
    with pytest.raises(PeerError):
        consumer.backend.post(XferOp.READ, peer, np.arange(2), np.arange(2))


def test_duplicate_notifications(pair: tuple[Side, Side, PeerHandle]) -> None:
    consumer, producer, peer = pair
    consumer.backend.faults = Faults(duplicate_notifications=True)
    h = consumer.backend.post(XferOp.WRITE, peer, np.arange(2), np.arange(2), b"dup")
    assert wait(consumer.backend, h) is XferStatus.DONE
    assert producer.backend.drain_notifications() == [(consumer.name, b"dup")] * 2
    consumer.backend.notify(peer, b"again")
    assert producer.backend.drain_notifications() == [(consumer.name, b"again")] * 2


def test_late_notifications(pair: tuple[Side, Side, PeerHandle]) -> None:
    consumer, producer, peer = pair
    consumer.backend.faults = Faults(late_notifications=3)
    h = consumer.backend.post(XferOp.READ, peer, np.arange(2), np.arange(2), b"late")
    assert wait(consumer.backend, h) is XferStatus.DONE
    for _ in range(3):
        assert producer.backend.drain_notifications() == []
    assert producer.backend.drain_notifications() == [(consumer.name, b"late")]


def test_dropped_notifications(pair: tuple[Side, Side, PeerHandle]) -> None:
    consumer, producer, peer = pair
    consumer.backend.faults = Faults(drop_notifications=True)
    h = consumer.backend.post(XferOp.READ, peer, np.arange(2), np.arange(2), b"lost")
    assert wait(consumer.backend, h) is XferStatus.DONE
    consumer.backend.notify(peer, b"lost too")
    for _ in range(5):
        assert producer.backend.drain_notifications() == []
    assert np.array_equal(
        consumer.cache.snapshot(), read_expected(consumer, producer, np.arange(2), np.arange(2))
    )


def test_reordered_notifications_overtake_queued_ones(pair: tuple[Side, Side, PeerHandle]) -> None:
    consumer, producer, peer = pair
    consumer.backend.notify(peer, b"first")
    consumer.backend.faults = Faults(reorder_notifications=True)
    consumer.backend.notify(peer, b"second")
    assert producer.backend.drain_notifications() == [
        (consumer.name, b"second"),
        (consumer.name, b"first"),
    ]


def test_stall_holds_a_posted_transfer_until_cleared(pair: tuple[Side, Side, PeerHandle]) -> None:
    consumer, producer, peer = pair
    h = consumer.backend.post(XferOp.READ, peer, np.arange(2), np.arange(2), b"n")
    consumer.backend.faults = Faults(stall=True)  # after the post: read live, at each poll
    before = consumer.cache.snapshot()
    assert wait(consumer.backend, h) is XferStatus.PENDING
    assert np.array_equal(consumer.cache.snapshot(), before)  # no byte moved
    assert producer.backend.drain_notifications() == []
    consumer.backend.faults = Faults()
    assert wait(consumer.backend, h) is XferStatus.DONE
    assert producer.backend.drain_notifications() == [(consumer.name, b"n")]


def test_guard_word_read_after_the_data_tells_a_released_hold(
    pair: tuple[Side, Side, PeerHandle],
) -> None:
    # The seqlock of fail-closed pulls (docs/RELIABILITY.md): the producer writes a
    # generation at hold and another before it gives the blocks back; the consumer
    # reads the word after its data and compares.
    consumer, producer, peer = pair
    words = producer.backend.register_guard(8)
    table = producer.backend.guard_table()
    assert table is not None and table.slots == 8 and consumer.backend.guard_table() is None
    consumer.backend.add_peer_guard(peer, table)
    words[3] = generation = 0x00_1234_5678_9ABC_DE
    data = consumer.backend.post(XferOp.READ, peer, np.arange(2), np.arange(2))
    assert wait(consumer.backend, data) is XferStatus.DONE
    guard = consumer.backend.post_guard_read(peer, 3, b"done")
    assert producer.backend.drain_notifications() == []  # not before the word is read
    assert wait(consumer.backend, guard) is XferStatus.DONE
    assert consumer.backend.guard_word(guard) == generation
    assert producer.backend.drain_notifications() == [(consumer.name, b"done")]
    consumer.backend.release(guard)
    words[3] = (2 << 56) | generation  # released: changed before the blocks go back
    again = consumer.backend.post_guard_read(peer, 3)
    assert wait(consumer.backend, again) is XferStatus.DONE
    assert consumer.backend.guard_word(again) != generation


def test_guard_reads_fail_stall_and_refuse_like_transfers(
    pair: tuple[Side, Side, PeerHandle],
) -> None:
    consumer, producer, peer = pair
    with pytest.raises(PeerError, match="no guard table"):
        consumer.backend.post_guard_read(peer, 0)
    producer.backend.register_guard(4)
    table = producer.backend.guard_table()
    assert table is not None
    with pytest.raises(RegistrationError):
        producer.backend.register_guard(4)
    consumer.backend.add_peer_guard(peer, table)
    with pytest.raises(BackendError, match="out of range"):
        consumer.backend.post_guard_read(peer, 4)
    h = consumer.backend.post_guard_read(peer, 1)
    with pytest.raises(BackendError, match="no word"):
        consumer.backend.guard_word(h)
    consumer.backend.faults = Faults(stall=True)
    assert wait(consumer.backend, h) is XferStatus.PENDING
    consumer.backend.faults = Faults()
    producer.backend.faults = Faults(gone=True)
    assert wait(consumer.backend, h) is XferStatus.FAILED
    producer.backend.faults = Faults()
    # an address the owner never registered as its guard table is not read
    consumer.backend.add_peer_guard(peer, msgspec.structs.replace(table, base=table.base + 8))
    assert wait(consumer.backend, consumer.backend.post_guard_read(peer, 0)) is XferStatus.FAILED


def test_addresses_outside_registered_memory_are_refused(
    pair: tuple[Side, Side, PeerHandle],
) -> None:
    consumer, producer, _ = pair
    stranger = PatternCache(SHAPE)  # memory nobody registered
    foreign = DescriptorTable.build(stranger.layout)
    with pytest.raises(BackendError, match="outside registered memory"):
        consumer.backend.prepare_local(foreign)
    with pytest.raises(BackendError, match="outside registered memory"):
        consumer.backend.add_peer(producer.backend.metadata(), foreign)
    shifted = msgspec.structs.replace(
        consumer.cache.layout,
        regions=tuple(
            msgspec.structs.replace(r, base=r.base + 1) for r in consumer.cache.layout.regions
        ),
    )
    with pytest.raises(BackendError, match="outside registered memory"):
        consumer.backend.prepare_local(DescriptorTable.build(shifted))


def test_invalid_ids_and_unequal_pair_lengths(pair: tuple[Side, Side, PeerHandle]) -> None:
    consumer, producer, _ = pair
    n = len(consumer.table)
    peer = PeerHandle(producer.name)
    for lids, rids in [([n], [0]), ([0], [-1]), ([0, 1], [0]), ([[0]], [[0]])]:
        with pytest.raises(BackendError):
            consumer.backend.post(XferOp.READ, peer, np.array(lids), np.array(rids))
    # A chunk table's short descriptors never pair with whole-block ones.
    chunked = DescriptorTable.build(
        producer.cache.layout, PlanOptions(chunk_mode=True, chunk_tokens=2)
    )
    peer = consumer.backend.add_peer(producer.backend.metadata(), chunked)
    with pytest.raises(BackendError, match="length"):
        consumer.backend.post(XferOp.READ, peer, np.array([0]), np.array([len(chunked) - 1]))


def test_chunk_plans_move_only_their_chunks() -> None:
    options = PlanOptions(chunk_mode=True, chunk_tokens=2, swa_window_mode=True)
    consumer, producer = Side("consumer", 5, options), Side("producer", 6, options)
    try:
        peer = consumer.connect(producer)
        plan = build_plan(consumer.table, producer.table, [[1, 2], [2]], [[4, 5], [5]], 19)
        h = consumer.backend.post(XferOp.READ, peer, plan.local_ids, plan.remote_ids)
        assert wait(consumer.backend, h) is XferStatus.DONE
        expected = read_expected(consumer, producer, plan.local_ids, plan.remote_ids)
        assert np.array_equal(consumer.cache.snapshot(), expected)
        changed = np.count_nonzero(expected != consumer.cache.expected(consumer.seed))
        assert 0 < changed <= plan.nbytes < 2 * 2 * consumer.cache.layout.block_bytes(0)
    finally:
        consumer.backend.close()
        producer.backend.close()


def test_metadata_from_another_process_is_refused(pair: tuple[Side, Side, PeerHandle]) -> None:
    consumer, producer, _ = pair
    blob = msgspec.msgpack.encode({"agent": producer.name, "pid": os.getpid() + 1})
    with pytest.raises(PeerError, match="one process"):
        consumer.backend.add_peer(blob, producer.table)
    with pytest.raises(PeerError, match="unreadable"):
        consumer.backend.add_peer(b"\xc1garbage", producer.table)


def test_capabilities_configurable_and_registry() -> None:
    assert get_backend("fake") is FakeBackend
    name = f"caps-{next(_names)}"
    be = FakeBackend(BackendOptions(agent_name=name, extra={"device_to_device": "false"}))
    try:
        assert be.capabilities.device_to_device is False
        assert be.capabilities.stages_through_host is False
    finally:
        be.close()
    be = FakeBackend(BackendOptions(agent_name=name), stages_through_host=True)
    try:
        assert be.capabilities.device_to_device is True
        assert be.capabilities.stages_through_host is True
        with pytest.raises(BackendError, match="already in use"):
            FakeBackend(BackendOptions(agent_name=name))
        be.stage_out([np.array([1, 2])])
        be.stage_in([np.array([3])])
        assert [(d, [b.tolist() for b in ids]) for d, ids in be.staged] == [
            ("out", [[1, 2]]),
            ("in", [[3]]),
        ]
    finally:
        be.close()
    with pytest.raises(BackendError, match="not a boolean"):
        FakeBackend(BackendOptions(agent_name=name, extra={"device_to_device": "maybe"}))


def test_close_leaves_the_fabric(pair: tuple[Side, Side, PeerHandle]) -> None:
    consumer, producer, peer = pair
    h = consumer.backend.post(XferOp.READ, peer, np.arange(2), np.arange(2))
    consumer.backend.close()
    consumer.backend.close()
    assert consumer.name not in fabric_members()
    assert consumer.backend.status(h) is XferStatus.FAILED
    assert consumer.backend.drain_notifications() == []
    with pytest.raises(BackendError):
        consumer.backend.post(XferOp.READ, peer, np.arange(2), np.arange(2))
    with pytest.raises(RegistrationError):
        producer.backend.register(producer.cache.layout)


@given(
    st.lists(st.tuples(st.integers(0, 63), st.integers(0, 63)), min_size=1, max_size=40),
    st.sampled_from([XferOp.READ, XferOp.WRITE]),
)
def test_any_descriptor_pairs_move_exactly(pairs: list[tuple[int, int]], op: XferOp) -> None:
    consumer, producer = Side("consumer", 11), Side("producer", 12)
    try:
        peer = consumer.connect(producer)
        lids = np.array([p[0] for p in pairs], dtype=np.int64)
        rids = np.array([p[1] for p in pairs], dtype=np.int64)
        if op is XferOp.WRITE:
            # Two writes to one remote descriptor would race; keep remote ids unique.
            _, first = np.unique(rids, return_index=True)
            lids, rids = lids[np.sort(first)], rids[np.sort(first)]
        else:
            _, first = np.unique(lids, return_index=True)
            lids, rids = lids[np.sort(first)], rids[np.sort(first)]
        h = consumer.backend.post(op, peer, lids, rids)
        assert wait(consumer.backend, h) is XferStatus.DONE
        if op is XferOp.READ:
            assert np.array_equal(
                consumer.cache.snapshot(), read_expected(consumer, producer, lids, rids)
            )
        else:
            expected = expected_after(
                producer.cache,
                producer.seed,
                consumer.seed,
                (producer.table, rids),
                (consumer.table, lids),
            )
            assert np.array_equal(producer.cache.snapshot(), expected)
    finally:
        consumer.backend.close()
        producer.backend.close()
