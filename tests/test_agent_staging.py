"""The gather path's staging memory on a real agent (issue 55): an agent whose config
turns the gather path on registers a bounded staging buffer through its backend and
announces it in the handshake's Welcome (outside the layout); off, or on a backend
without staging memory, the Welcome says none and the agent still serves."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvxfer.backend import BackendOptions, XferOp, XferStatus
from kvxfer.backends.ucx import UcxBackend
from kvxfer.core import wire
from kvxfer.core.descriptors import DescriptorTable, Runs
from kvxfer.core.gather_cost import GatherConfig
from kvxfer.core.layout import MemKind
from kvxfer.errors import BackendError, RegistrationError
from kvxfer.testing.fake_backend import FakeBackend
from kvxfer.testing.kvcache import HostKVCache
from kvxfer.types import Direction, Role
from tests.faultkit import BLOCK, NUM_BLOCKS, SHAPE, Side, Stranger

GATHER = GatherConfig(staging_bytes=1 << 16, slots=2)


def _welcome(side: Side, consumer: Side) -> wire.Welcome:
    layout = consumer.cache.layout()
    hello = wire.Hello(
        engine_id="staging-probe",
        incarnation=1,
        role=Role.CONSUMER,
        direction=Direction.PULL,
        layout=layout,
    )
    stranger = Stranger(side.host, side.port, Direction.PULL)
    try:
        reply = stranger.request(hello)
    finally:
        stranger.close()
    assert isinstance(reply, wire.Welcome), reply
    return reply


@pytest.fixture
def consumer() -> Iterator[Side]:
    side = Side(Role.CONSUMER, Direction.PULL)
    yield side
    side.close()


def test_staging_is_registered_and_announced(consumer: Side) -> None:
    producer = Side(Role.PRODUCER, Direction.PULL, seed=1, gather=GATHER)
    try:
        staging = _welcome(producer, consumer).staging
        assert staging is not None
        assert (staging.nbytes, staging.slots, staging.mem) == (1 << 16, 2, MemKind.DRAM)
        assert staging.base != 0
        # The layout peers compare is the one without staging (compatibility unchanged).
        plain = Side(Role.PRODUCER, Direction.PULL, seed=1)
        try:
            welcome = _welcome(plain, consumer)
            assert welcome.staging is None
            assert welcome.layout.num_blocks == _welcome(producer, consumer).layout.num_blocks
        finally:
            plain.close()
    finally:
        producer.close()


def test_a_backend_without_staging_leaves_the_gather_path_off(
    consumer: Side, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(self: FakeBackend, nbytes: int) -> int:
        raise BackendError("no staging here")

    monkeypatch.setattr(FakeBackend, "register_staging", refuse)
    producer = Side(Role.PRODUCER, Direction.PULL, seed=1, gather=GATHER)
    try:
        assert _welcome(producer, consumer).staging is None
    finally:
        producer.close()


def test_ucx_registers_staging_once_and_peers_still_connect() -> None:
    """The NIXL backend registers staging beside the cache; the metadata it sends
    afterwards covers it, and a peer adds it as before."""
    cache = HostKVCache(SHAPE, BLOCK, NUM_BLOCKS)
    holder = UcxBackend(BackendOptions(agent_name="staging-holder"))
    reader = UcxBackend(BackendOptions(agent_name="staging-reader"))
    try:
        layout = cache.layout()
        holder.register(layout)
        reader.register(layout)
        base = holder.register_staging(1 << 16)
        assert base != 0
        with pytest.raises(RegistrationError, match="already"):
            holder.register_staging(1 << 16)
        peer = reader.add_peer(holder.metadata(), DescriptorTable.build(layout))
        assert peer is not None
    finally:
        reader.close()
        holder.close()


def test_ucx_reads_a_peers_staging_slot_in_one_run() -> None:
    """The gather path's transport step: one READ run from the producer's staging slot
    into the consumer's (``post_runs``, one descriptor), byte-exact."""
    cache = HostKVCache(SHAPE, BLOCK, NUM_BLOCKS)
    holder = UcxBackend(BackendOptions(agent_name="slot-holder", progress_thread=True))
    reader = UcxBackend(BackendOptions(agent_name="slot-reader"))
    try:
        layout = cache.layout()
        holder.register(layout)
        reader.register(layout)
        theirs, mine = holder.register_staging(1 << 16), reader.register_staging(1 << 16)
        data = np.random.default_rng(4).integers(0, 255, 1 << 15, dtype=np.uint8).tobytes()
        ctypes.memmove(theirs + (1 << 15), data, len(data))  # the producer's slot 1
        table = DescriptorTable.build(layout)
        reader.prepare_local(table)
        holder.prepare_local(table)
        peer = reader.add_peer(holder.metadata(), table)
        zero = np.zeros(1, dtype=np.int64)
        run = Runs(
            local_addr=np.array([mine], dtype=np.uint64),
            remote_addr=np.array([theirs + (1 << 15)], dtype=np.uint64),
            length=np.array([len(data)], dtype=np.uint64),
            local_device=zero,
            remote_device=zero,
        )
        handle = reader.post_runs(XferOp.READ, peer, run)
        deadline = time.monotonic() + 10
        while reader.status(handle) is XferStatus.PENDING and time.monotonic() < deadline:
            time.sleep(0.001)
        assert reader.status(handle) is XferStatus.DONE
        reader.release(handle)
        assert ctypes.string_at(mine, len(data)) == data
    finally:
        reader.close()
        holder.close()
