"""Pushes between different block sizes (issue 54, kvxfer.core.ratio_write): the
producer writes every token of the request into the consumer's block at its position,
from its own block at the same position, nothing past the last unit, in one write at
the hold or streamed as prefill closes blocks; a backend that posts no address runs
fails the push by name."""

from __future__ import annotations

import itertools
import time

import msgspec
import numpy as np
import pytest

from kvxfer.agent import Agent, AgentConfig
from kvxfer.backend import Backend, BackendOptions, Capabilities
from kvxfer.backends.host_bounce import HostBounceBackend
from kvxfer.core.compat import Fingerprint
from kvxfer.core.descriptors import PlanOptions
from kvxfer.core.ratio_write import pair_write
from kvxfer.errors import LayoutMismatch, PlanError, TransferError
from kvxfer.testing.fake_backend import FakeBackend
from kvxfer.testing.kvcache import HostKVCache, ModelShape
from kvxfer.ticket import Ticket
from kvxfer.transfer import Transfer, TransferState
from kvxfer.types import Direction, Role

SHAPE = ModelShape(name="sm", layers=2, kv_heads=2, head_dim=8)
FP = Fingerprint(
    model="m",
    dtype="bfloat16",
    kv_cache_dtype="bfloat16",
    attention_backend="t",
    direction=Direction.PUSH,
)
_names = itertools.count()
PRODUCER_BLOCKS, CONSUMER_BLOCKS = 40, 64
RATIOS = [(128, 16), (128, 64), (16, 128), (32, 64)]


class _NoRuns(FakeBackend):
    """A fabric whose backend says it posts no address runs."""

    @property
    def capabilities(self) -> Capabilities:
        return msgspec.structs.replace(super().capabilities, address_runs=False)


def _agent(
    role: Role,
    bs: int,
    nb: int,
    seed: int | None,
    kind: str = "fake",
    **config: bool,
) -> tuple[Agent, HostKVCache]:
    name = f"push-ratio-{next(_names)}"
    options = BackendOptions(agent_name=name)
    backend: Backend = _NoRuns(options) if kind == "no_runs" else FakeBackend(options)
    if kind == "host_bounce":
        # Staging buffers moved by the fake fabric, copied to and from the cache.
        backend = HostBounceBackend(options, transport=backend)
    agent = Agent(
        AgentConfig(
            engine_id=name,
            fingerprint=FP,
            role=role,
            direction=Direction.PUSH,
            **config,  # type: ignore[arg-type]
        ),
        backend=backend,
    )
    cache = HostKVCache(SHAPE, bs, nb, fill_seed=seed)
    agent.register(cache.layout())
    agent.serve()
    return agent, cache


def _expect(
    producer: Agent, consumer: Agent, rid: str, cb: list[int], n: int, cached: int = 0
) -> Transfer:
    """Register ``cb`` with the producer and wait until the registration is there (so
    the hold writes at once, as after a push proxy's registration)."""
    host, port = producer.address
    ticket = Ticket.for_push(producer.config.engine_id, host, port, rid, n)
    transfer = consumer.expect_push(ticket, cb, num_tokens=n, cached_blocks=cached)
    deadline = time.monotonic() + 10
    while rid not in producer.holding():
        assert time.monotonic() < deadline, "the registration did not arrive"
        assert not transfer.done, transfer.error
        time.sleep(0.002)
    return transfer


def _check(
    pc: HostKVCache,
    cc: HostKVCache,
    pb: list[int],
    cb: list[int],
    n: int,
    *,
    first: int = 0,
    upto: int | None = None,
) -> None:
    """Consumer tokens ``first..upto`` (default: all ``n``) equal the producer's at the
    same position; nothing past the last unit of ``n`` and no block outside ``cb``
    written. ``cb`` holds the consumer blocks of tokens from ``first`` on."""
    pbs, cbs = pc.block_size, cc.block_size
    words = SHAPE.token_bytes() // 2
    unit = min(pbs, cbs)
    end = -(-n // unit) * unit  # tokens of the units written
    skip = first // cbs  # the consumer's leading prefix hits, not registered
    tokens = np.arange(first, n if upto is None else upto)
    for r in range(len(pc.regions)):
        pv = pc.regions[r].reshape(PRODUCER_BLOCKS, pbs, words)
        cv = cc.regions[r].reshape(CONSUMER_BLOCKS, cbs, words)
        got = cv[np.array(cb)[tokens // cbs - skip], tokens % cbs]
        want = pv[np.array(pb)[tokens // pbs], tokens % pbs]
        assert (got == want).all(), f"region {r}"
        last = -(-n // cbs) - 1  # the consumer's last block, by position
        assert not cv[cb[last - skip], end - last * cbs :].any(), "written past the last unit"
        untouched = np.setdiff1d(np.arange(CONSUMER_BLOCKS), cb)
        assert not cv[untouched].any(), "a block outside the request was written"


def _freed(producer: Agent, rid: str) -> None:
    deadline = time.monotonic() + 10
    while rid not in producer.freed():
        assert time.monotonic() < deadline, f"{rid} was not freed"
        time.sleep(0.005)


@pytest.mark.parametrize("kind", ["fake", "host_bounce"])
@pytest.mark.parametrize(("pbs", "cbs"), RATIOS)
@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 128, 129, 300])
def test_a_push_between_block_sizes_writes_every_token_to_its_position(
    pbs: int, cbs: int, num_tokens: int, kind: str
) -> None:
    producer, pc = _agent(Role.PRODUCER, pbs, PRODUCER_BLOCKS, 1, kind)
    consumer, cc = _agent(Role.CONSUMER, cbs, CONSUMER_BLOCKS, None, kind)
    try:
        pn, cn = -(-num_tokens // pbs), -(-num_tokens // cbs)
        pb = list(range(3, 3 + pn))[::-1]  # scattered, descending
        cb = list(range(5, 5 + cn))
        transfer = _expect(producer, consumer, "q", cb, num_tokens)
        producer.hold("q", pb, num_tokens)
        transfer.wait(20)
        assert transfer.state is TransferState.DONE
        _check(pc, cc, pb, cb, num_tokens)
        _freed(producer, "q")
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize(("pbs", "cbs"), RATIOS)
def test_a_registration_after_the_hold_is_written_by_the_writer(pbs: int, cbs: int) -> None:
    producer, pc = _agent(Role.PRODUCER, pbs, PRODUCER_BLOCKS, 2)
    consumer, cc = _agent(Role.CONSUMER, cbs, CONSUMER_BLOCKS, None)
    try:
        n = 200
        pb, cb = list(range(9, 9 + -(-n // pbs))), list(range(30, 30 + -(-n // cbs)))[::-1]
        producer.hold("late", pb, n)
        host, port = producer.address
        ticket = Ticket.for_push(producer.config.engine_id, host, port, "late", n)
        transfer = consumer.expect_push(ticket, cb, num_tokens=n)
        transfer.wait(20)
        assert transfer.state is TransferState.DONE
        _check(pc, cc, pb, cb, n)
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize(("pbs", "cbs"), RATIOS)
@pytest.mark.parametrize("num_tokens", [129, 256, 300])
def test_a_streamed_push_writes_closed_blocks_early_and_exactly(
    pbs: int, cbs: int, num_tokens: int
) -> None:
    # push_stream: each step's closed producer blocks go at once (a consumer block
    # larger than the producer's gets its pieces over several writes), the rest at
    # the hold; the consumer settles once the final notice came and all its blocks
    # were named.
    producer, pc = _agent(Role.PRODUCER, pbs, PRODUCER_BLOCKS, 3, push_stream=True)
    consumer, cc = _agent(Role.CONSUMER, cbs, CONSUMER_BLOCKS, None)
    try:
        pn, cn = -(-num_tokens // pbs), -(-num_tokens // cbs)
        pb, cb = list(range(3, 3 + pn))[::-1], list(range(5, 5 + cn))
        transfer = _expect(producer, consumer, "s", cb, num_tokens)
        streamed = 0
        # Prefill steps of 48 tokens, and steps ending on each producer block boundary.
        for end in sorted({*range(48, num_tokens, 48), *range(pbs, num_tokens, pbs)}):
            closed = end // pbs
            if closed == 0:
                continue
            producer.stream("s", pb[:closed], end)
            streamed = closed * pbs
            # Written before the hold: the closed blocks' tokens are there already.
            deadline = time.monotonic() + 10
            while True:
                try:
                    _check(pc, cc, pb, cb, num_tokens, upto=min(streamed, num_tokens))
                    break
                except AssertionError:
                    assert time.monotonic() < deadline, "a streamed write did not land"
                    time.sleep(0.005)
            assert not transfer.done, "settled before the final write"
        assert streamed, "nothing streamed: the case tests nothing early"
        producer.hold("s", pb, num_tokens)
        transfer.wait(20)
        assert transfer.state is TransferState.DONE
        _check(pc, cc, pb, cb, num_tokens)
        assert producer.stats().transfers_done >= 2  # a streamed write and the hold's
        _freed(producer, "s")
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize("kind", ["fake", "host_bounce"])
@pytest.mark.parametrize(("pbs", "cbs", "cached"), [(128, 16, 3), (128, 16, 8), (16, 64, 2)])
def test_a_prefix_hit_is_not_written(pbs: int, cbs: int, cached: int, kind: str) -> None:
    # The consumer holds its first `cached` blocks already and registers the rest: the
    # writes start at the token after them, wherever that falls in a producer block.
    producer, pc = _agent(Role.PRODUCER, pbs, PRODUCER_BLOCKS, 4, kind)
    consumer, cc = _agent(Role.CONSUMER, cbs, CONSUMER_BLOCKS, None, kind)
    try:
        n = 300
        pb = list(range(3, 3 + -(-n // pbs)))[::-1]
        cb = list(range(5, 5 + -(-n // cbs) - cached))
        transfer = _expect(producer, consumer, "hit", cb, n, cached)
        producer.hold("hit", pb, n)
        transfer.wait(20)
        assert transfer.state is TransferState.DONE
        _check(pc, cc, pb, cb, n, first=cached * cbs)
    finally:
        consumer.close()
        producer.close()


def test_a_backend_that_posts_no_address_runs_fails_the_push_by_name() -> None:
    producer, _ = _agent(Role.PRODUCER, 128, PRODUCER_BLOCKS, 1, "no_runs")
    consumer, cc = _agent(Role.CONSUMER, 16, CONSUMER_BLOCKS, None)
    try:
        transfer = _expect(producer, consumer, "nr", list(range(5, 18)), 200)
        producer.hold("nr", [3, 4], 200)
        deadline = time.monotonic() + 20
        while not transfer.done and time.monotonic() < deadline:
            time.sleep(0.005)
        assert transfer.state is TransferState.FAILED
        # The consumer hears the producer's reason: the backend, by name.
        assert "blocks of 128 tokens here and 16 at the peer need a backend that posts" in str(
            transfer.error
        )
        assert "does not" in str(transfer.error)
        _freed(producer, "nr")
        assert not any(r.any() for r in cc.regions)
    finally:
        consumer.close()
        producer.close()


def test_pair_write_cuts_windows_at_the_consumers_last_token() -> None:
    # Producer 16 into consumer 64, 100 tokens, streamed: the first write (tokens
    # 0..48) fills three pieces of consumer block 7; the hold's write the rest, up to
    # the last 16-token unit (tokens 96..100: consumer block 8's piece 2).
    producer = (np.array([20, 21, 22, 23, 24, 25, 26], dtype=np.int64),)
    consumer = (np.array([7, 8], dtype=np.int64),)
    common = {"consumer_tokens": 100, "producer_block_size": 16, "consumer_block_size": 64}
    early = pair_write(
        (producer[0][:3],), consumer, producer_tokens=48, start=0, stop=48, final=False, **common
    )
    (u,) = early.units
    assert u.local_block.tolist() == [20, 21, 22]
    assert (u.remote_block.tolist(), u.remote_piece.tolist()) == ([7, 7, 7], [0, 1, 2])
    rest = pair_write(
        producer, consumer, producer_tokens=100, start=48, stop=100, final=True, **common
    )
    (u,) = rest.units
    assert u.local_block.tolist() == [23, 24, 25, 26]
    assert (u.remote_block.tolist(), u.remote_piece.tolist()) == ([7, 8, 8, 8], [3, 0, 1, 2])
    with pytest.raises(PlanError, match="registered 100 tokens, the producer holds 90"):
        pair_write(producer, consumer, producer_tokens=90, start=0, stop=90, final=True, **common)
    with pytest.raises(LayoutMismatch, match=r"whole multiple.*local=48 remote=32"):
        pair_write(
            producer,
            consumer,
            producer_tokens=100,
            consumer_tokens=100,
            producer_block_size=48,
            consumer_block_size=32,
            start=0,
            stop=100,
            final=True,
        )


def test_chunk_mode_between_block_sizes_fails_the_push_by_name() -> None:
    # chunk_mode cuts the blocks of one size; a write between sizes moves whole units.
    name = f"push-ratio-{next(_names)}"
    producer = Agent(
        AgentConfig(
            engine_id=name,
            fingerprint=FP,
            role=Role.PRODUCER,
            direction=Direction.PUSH,
            plan=PlanOptions(chunk_mode=True, chunk_tokens=32, prefill_step_tokens=32),
        ),
        backend=FakeBackend(BackendOptions(agent_name=name)),
    )
    producer.register(HostKVCache(SHAPE, 128, PRODUCER_BLOCKS, fill_seed=1).layout())
    producer.serve()
    consumer, cc = _agent(Role.CONSUMER, 16, CONSUMER_BLOCKS, None)
    try:
        transfer = _expect(producer, consumer, "chunk", list(range(5, 18)), 200)
        producer.hold("chunk", [3, 4], 200)
        with pytest.raises(TransferError, match="chunk_mode and swa_window_mode cut blocks of one"):
            transfer.wait(20)
        assert not any(r.any() for r in cc.regions)
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize(
    ("pbs", "cbs", "cached"), [(128, 16, 3), (16, 64, 1), (32, 64, 2), (16, 16, 2), (32, 32, 1)]
)
def test_a_streamed_push_after_a_prefix_hit_writes_by_position(
    pbs: int, cbs: int, cached: int
) -> None:
    # Streamed writes are placed by token position, so a consumer that registered only
    # the blocks after its prefix hit gets each token where it belongs (equal block
    # sizes too: there a write mid-stream once went to the consumer's first registered
    # block for the producer's first block).
    producer, pc = _agent(Role.PRODUCER, pbs, PRODUCER_BLOCKS, 6, push_stream=True)
    consumer, cc = _agent(Role.CONSUMER, cbs, CONSUMER_BLOCKS, None)
    try:
        n = 300
        pb = list(range(3, 3 + -(-n // pbs)))
        cb = list(range(5, 5 + -(-n // cbs) - cached))
        transfer = _expect(producer, consumer, "sh", cb, n, cached)
        for end in range(48, n, 48):
            if end // pbs:
                producer.stream("sh", pb[: end // pbs], end)
        producer.hold("sh", pb, n)
        transfer.wait(20)
        assert transfer.state is TransferState.DONE
        _check(pc, cc, pb, cb, n, first=cached * cbs)
    finally:
        consumer.close()
        producer.close()
