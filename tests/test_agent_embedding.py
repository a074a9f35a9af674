"""The embedding API as an engine author meets it (issue 21): registered tensors are
kept alive, one direction, block counts checked at the call against num_tokens and the
ticket, push registration without stubs or an explicit serve(), and a failed handshake
that frees the producer's lease at once. In-process Agents on the fake backend."""

from __future__ import annotations

import gc
import itertools
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from kvxfer import Ticket
from kvxfer.agent import Agent, AgentConfig
from kvxfer.backend import BackendOptions
from kvxfer.core.compat import Fingerprint
from kvxfer.errors import ConfigError, PlanError, TransferError
from kvxfer.testing.fake_backend import FakeBackend
from kvxfer.testing.kvcache import HostKVCache, ModelShape
from kvxfer.transfer import FailureKind, TransferState
from kvxfer.types import Direction, Role

SHAPE = ModelShape(name="emb", layers=2, kv_heads=1, head_dim=8)
NUM_BLOCKS = 16
SEED = 5
_names = itertools.count()


def _fp(direction: Direction) -> Fingerprint:
    return Fingerprint(
        model="m",
        dtype="bfloat16",
        kv_cache_dtype="bfloat16",
        attention_backend="t",
        direction=direction,
    )


def _agent(
    role: Role,
    cache: HostKVCache | None,
    direction: Direction = Direction.PULL,
) -> Agent:
    backend = FakeBackend(BackendOptions(agent_name=f"emb-{next(_names)}"))
    agent = Agent(
        AgentConfig(
            engine_id=f"e-{role.value}",
            fingerprint=_fp(direction),
            role=role,
            direction=direction,
            transfer_timeout_s=5.0,
        ),
        backend=backend,
    )
    if cache is not None:
        agent.register(cache.layout(), keep=cache)
    return agent


def _wait_freed(producer: Agent, request_id: str, within_s: float = 5.0) -> float:
    """Seconds until ``request_id`` shows up in ``freed()`` (fails after ``within_s``)."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        if request_id in producer.freed():
            return time.monotonic() - start
        time.sleep(0.01)
    pytest.fail(f"{request_id} was not freed within {within_s} s")


@pytest.fixture
def pull_pair() -> Iterator[tuple[Agent, HostKVCache, Agent, HostKVCache]]:
    prod_cache = HostKVCache(SHAPE, 16, NUM_BLOCKS, fill_seed=SEED)
    cons_cache = HostKVCache(SHAPE, 16, NUM_BLOCKS)
    producer = _agent(Role.PRODUCER, prod_cache)
    consumer = _agent(Role.CONSUMER, cons_cache)
    producer.serve()
    yield producer, prod_cache, consumer, cons_cache
    consumer.close()
    producer.close()


# -- 1. ownership ------------------------------------------------------------------------


def test_register_tensors_keeps_the_tensors_alive_until_close() -> None:
    torch = pytest.importorskip("torch")
    pools = [torch.zeros(2, NUM_BLOCKS, 16, 2, 8) for _ in range(2)]
    refs = [weakref.ref(p) for p in pools]
    agent = _agent(Role.PRODUCER, None)
    layout = agent.register_tensors(pools, block_size=16)
    assert layout.num_regions == 4 and layout.num_kv_heads == 2 and layout.head_dim == 8
    assert agent.layout == layout
    del pools  # the engine drops its references: the agent's keep the memory alive
    gc.collect()
    assert all(r() is not None for r in refs)
    agent.close()
    gc.collect()
    assert all(r() is None for r in refs)  # deregistered: the tensors are collectable


def test_a_layout_built_from_tensors_keeps_them_registered_without_keep() -> None:
    """``register(KVLayout.from_kv_caches(...))`` with no ``keep=``: the documented
    constructor's tensors stay alive while registered (issue 28: they were collected
    while NIXL still held their addresses)."""
    torch = pytest.importorskip("torch")
    from kvxfer.core.layout import KVLayout, tensors_of

    pools = [torch.zeros(2, NUM_BLOCKS, 16, 2, 8) for _ in range(2)]
    refs = [weakref.ref(p) for p in pools]
    agent = _agent(Role.PRODUCER, None)
    agent.register(KVLayout.from_kv_caches(pools, block_size=16))  # no keep=
    del pools
    gc.collect()
    assert all(r() is not None for r in refs)  # the agent holds them through the layout
    assert agent.layout is not None and tensors_of(agent.layout) is None  # taken
    agent.close()
    gc.collect()
    assert all(r() is None for r in refs)


def test_register_keep_holds_any_object_until_close() -> None:
    class Pool:
        pass

    pool = Pool()
    ref = weakref.ref(pool)
    agent = _agent(Role.PRODUCER, None)
    agent.register(HostKVCache(SHAPE, 16, NUM_BLOCKS).layout(), keep=pool)
    del pool
    gc.collect()
    assert ref() is not None
    agent.close()
    gc.collect()
    assert ref() is None


# -- 2. one direction --------------------------------------------------------------------


def test_a_direction_contradiction_is_refused_at_construction_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"direction='pull'.*fingerprint\.direction \(push\)"):
        AgentConfig(engine_id="e", fingerprint=_fp(Direction.PUSH))  # direction left at PULL
    with pytest.raises(ConfigError, match=r"direction='push'.*fingerprint\.direction \(pull\)"):
        AgentConfig(engine_id="e", fingerprint=_fp(Direction.PULL), direction=Direction.PUSH)
    config = AgentConfig(engine_id="e", fingerprint=_fp(Direction.PUSH), direction=Direction.PUSH)
    assert config.direction is config.fingerprint.direction is Direction.PUSH


def test_expect_push_with_a_for_push_ticket_serves_on_first_use() -> None:
    prod_cache = HostKVCache(SHAPE, 16, NUM_BLOCKS, fill_seed=SEED)
    cons_cache = HostKVCache(SHAPE, 16, NUM_BLOCKS)
    producer = _agent(Role.PRODUCER, prod_cache, Direction.PUSH)
    consumer = _agent(Role.CONSUMER, cons_cache, Direction.PUSH)
    try:
        host, port = producer.serve()
        ticket = Ticket.for_push(producer.config.engine_id, host, port, "p1", 40)
        assert ticket.block_ids == () and ticket.num_tokens == 40
        transfer = consumer.expect_push(ticket, [7, 8, 9])  # no serve() before: it serves
        assert consumer.address[1] > 0
        producer.hold("p1", [1, 2, 3], 40)
        transfer.wait(10)
        assert transfer.state is TransferState.DONE, transfer.error
        assert cons_cache.mismatches([7, 8, 9], [1, 2, 3], SEED) == 0
    finally:
        consumer.close()
        producer.close()


def test_expect_push_refuses_a_wrong_count_before_registering_anything() -> None:
    consumer = _agent(Role.CONSUMER, HostKVCache(SHAPE, 16, NUM_BLOCKS), Direction.PUSH)
    try:
        ticket = Ticket.for_push("e-producer", "127.0.0.1", 1, "p2", 40)
        with pytest.raises(PlanError, match="exactly 3 must be listed"):
            consumer.expect_push(ticket, [7, 8, 9, 10])
        with pytest.raises(PlanError, match=r"cached_blocks=4: more than the 3 block"):
            consumer.expect_push(ticket, [], cached_blocks=4)
        stats = consumer.stats()
        assert stats.transfers_failed == 0 and not consumer.holding()
    finally:
        consumer.close()


# -- 3. validation at the call -----------------------------------------------------------


def test_hold_checks_the_block_count_against_num_tokens(
    pull_pair: tuple[Agent, HostKVCache, Agent, HostKVCache],
) -> None:
    producer, _, _, _ = pull_pair
    # 100 tokens of 16-token blocks fill 7: 3 blocks means num_tokens is wrong
    with pytest.raises(PlanError, match=r"3 block\(s\) given; num_tokens=100 fills 7"):
        producer.hold("short", [1, 2, 3], 100)
    with pytest.raises(PlanError, match=r"4 block\(s\) given; num_tokens=48 fills 3"):
        producer.hold("long", [1, 2, 3, 4], 48)  # an extra decode block
    with pytest.raises(PlanError, match="num_tokens=-1"):
        producer.hold("neg", [], -1)
    assert producer.holding() == []
    assert producer.hold("ok", list(range(7)), 100).block_ids == (tuple(range(7)),)


def test_a_freed_callback_runs_each_time_a_hold_ends_whoever_ends_it(
    pull_pair: tuple[Agent, HostKVCache, Agent, HostKVCache],
) -> None:
    """An engine with held blocks and nothing to compute sleeps on an event this sets
    (the vLLM worker's idle step) instead of polling freed(): it runs once per hold
    ended (read, released by the engine, released by its consumer, expired). One that
    raises is logged and stops neither the free nor the callbacks after it."""
    producer, _, consumer, _ = pull_pair
    calls: list[float] = []
    producer.add_freed_callback(lambda: [][0])
    producer.add_freed_callback(lambda: calls.append(time.monotonic()))
    t = consumer.pull(producer.hold("read", [1, 2], 32), [4, 5])
    t.wait(5)
    _wait_freed(producer, "read")
    assert len(calls) == 1
    producer.hold("mine", [3], 16)
    assert producer.release("mine")
    assert len(calls) == 2
    consumer.abort(producer.hold("theirs", [6], 16), wait=True)
    _wait_freed(producer, "theirs")
    assert len(calls) == 3
    producer.hold("late", [7], 16, lease_s=0.2)
    _wait_freed(producer, "late")
    assert len(calls) == 4
    assert producer.holding() == []


def test_pull_refuses_counts_before_posting_and_frees_the_producer(
    pull_pair: tuple[Agent, HostKVCache, Agent, HostKVCache],
) -> None:
    producer, _, consumer, _ = pull_pair
    ticket = producer.hold("r1", [1, 2, 3], 48)
    # a consumer that reserved one extra decode block: refused here, not at wait()
    with pytest.raises(PlanError, match=r"local block_ids \(group 0\): 4 block"):
        consumer.pull(ticket, [4, 5, 6, 7])
    assert consumer.stats().transfers_failed == 0  # nothing was posted
    _wait_freed(producer, "r1")  # and the producer was told to release at once

    ticket = producer.hold("r2", [1, 2, 3], 48)
    with pytest.raises(PlanError, match="more than the ticket's 48 tokens"):
        consumer.pull(ticket, [4, 5, 6, 7], num_tokens=64)
    _wait_freed(producer, "r2")


def test_pull_of_a_prefix_cache_suffix_reads_the_matching_blocks(
    pull_pair: tuple[Agent, HostKVCache, Agent, HostKVCache],
) -> None:
    producer, _, consumer, cons_cache = pull_pair
    ticket = producer.hold("s1", [1, 2, 3, 4, 5], 70)  # 70 tokens: 5 blocks
    # the first 2 blocks are a local prefix hit: 3 local blocks take remote 3, 4, 5
    with pytest.raises(PlanError, match="exactly 3 must be listed"):
        consumer.pull(ticket, [9, 10], cached_blocks=2)  # and the producer is told
    _wait_freed(producer, "s1")
    ticket = producer.hold("s2", [1, 2, 3, 4, 5], 70)
    transfer = consumer.pull(ticket, [9, 10, 11], cached_blocks=2)
    transfer.wait(10)
    assert transfer.state is TransferState.DONE, transfer.error
    assert cons_cache.mismatches([9, 10, 11], [3, 4, 5], SEED) == 0
    assert cons_cache.mismatches([9], [1], SEED) > 0  # not the leading blocks
    # a ticket already cut to the suffix (what the vLLM adapter builds) pairs the same
    ticket = producer.hold("s3", [1, 2, 3, 4, 5], 70)
    # (the rest of the ticket, its capability and guard word included, stays as held)
    cut = msgspec.structs.replace(ticket, block_ids=((3, 4, 5),))
    cons_cache.regions[0][:] = 0
    transfer = consumer.pull(cut, [12, 13, 14], cached_blocks=2)
    transfer.wait(10)
    assert transfer.state is TransferState.DONE, transfer.error
    assert cons_cache.mismatches([12, 13, 14], [3, 4, 5], SEED) == 0


def test_pull_refuses_positions_the_ticket_does_not_hold(
    pull_pair: tuple[Agent, HostKVCache, Agent, HostKVCache],
) -> None:
    producer, _, consumer, _ = pull_pair
    ticket = producer.hold("t1", [1, 2, 3], 48)
    cut = msgspec.structs.replace(ticket, block_ids=((3,),))  # the last block of 48 tokens
    with pytest.raises(
        PlanError, match=r"holds blocks 2\.\.2 of its 48 tokens.*need blocks 1\.\.2"
    ):
        consumer.pull(cut, [4, 5], cached_blocks=1)
    _wait_freed(producer, "t1")


# -- 4. a failed handshake frees the producer's lease at once ----------------------------


def test_a_layout_mismatch_at_the_handshake_releases_the_producers_lease() -> None:
    producer = _agent(Role.PRODUCER, HostKVCache(SHAPE, 16, NUM_BLOCKS, fill_seed=SEED))
    other = ModelShape(name="emb", layers=2, kv_heads=2, head_dim=8)  # twice the heads
    consumer = _agent(Role.CONSUMER, HostKVCache(other, 16, NUM_BLOCKS))
    try:
        producer.serve()
        ticket = producer.hold("h1", [1, 2], 32)
        transfer = consumer.pull(ticket, [3, 4])
        with pytest.raises(TransferError, match="num_kv_heads"):
            transfer.wait(10)
        assert transfer.stats.failure is FailureKind.HANDSHAKE
        assert "num_kv_heads" in str(transfer.error)
        # freed well before the 30 s lease: the consumer sent a Release
        assert _wait_freed(producer, "h1") < 5
        assert producer.stats().leases_expired == 0
    finally:
        consumer.close()
        producer.close()


# -- 5. noise ------------------------------------------------------------------------------


@pytest.mark.parametrize("level", [None, "INFO"], ids=["default", "user-asked-info"])
def test_nixl_info_logs_are_quiet_unless_asked_for(level: str | None) -> None:
    pytest.importorskip("nixl")
    env = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
    if level is not None:
        env["NIXL_LOG_LEVEL"] = level
    code = (
        "from kvxfer import Agent, AgentConfig, Fingerprint, Direction\n"
        "fp = Fingerprint(model='m', dtype='float32', kv_cache_dtype='float32',\n"
        "                 attention_backend='t', direction=Direction.PULL)\n"
        "Agent(AgentConfig(engine_id='quiet', fingerprint=fp)).close()\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    said = run.stdout + run.stderr
    assert ("NIXL INFO" in said) is (level == "INFO"), said


def test_block_ids_are_numpy_friendly_in_counts(
    pull_pair: tuple[Agent, HostKVCache, Agent, HostKVCache],
) -> None:
    producer, _, consumer, cons_cache = pull_pair
    ticket = producer.hold("np", np.array([6, 7], dtype=np.int32), 17)
    transfer = consumer.pull(ticket, np.array([1, 2], dtype=np.int64))
    transfer.wait(10)
    assert transfer.state is TransferState.DONE, transfer.error
    assert cons_cache.mismatches([1, 2], [6, 7], SEED) == 0
