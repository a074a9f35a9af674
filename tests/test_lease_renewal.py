"""Lease renewal (issue 54): a consumer that still means to read keeps the producer's
hold alive past ``lease_s``; one that stops renewing lets it expire as before.

In-process Agents on the fake backend, real side-channel sockets between them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import msgspec
import pytest

from kvxfer.agent import Agent, AgentConfig
from kvxfer.backend import BackendOptions
from kvxfer.core.compat import Fingerprint
from kvxfer.errors import TransferError
from kvxfer.testing.fake_backend import FakeBackend
from kvxfer.testing.kvcache import HostKVCache, ModelShape
from kvxfer.transfer import TransferState
from kvxfer.types import Direction, Role

SHAPE = ModelShape(name="renew", layers=2, kv_heads=1, head_dim=8)
NUM_BLOCKS = 8
SEED = 11
LEASE_S = 0.8
_names = itertools.count()


def _agent(role: Role, cache: HostKVCache) -> Agent:
    agent = Agent(
        AgentConfig(
            engine_id=f"renew-{role.value}",
            fingerprint=Fingerprint(
                model="m",
                dtype="bfloat16",
                kv_cache_dtype="bfloat16",
                attention_backend="t",
                direction=Direction.PULL,
            ),
            role=role,
            direction=Direction.PULL,
            transfer_timeout_s=5.0,
            lease_s=LEASE_S,
            lease_guard_s=0.1,
        ),
        backend=FakeBackend(BackendOptions(agent_name=f"renew-{next(_names)}")),
    )
    agent.register(cache.layout(), keep=cache)
    return agent


@pytest.fixture
def pair() -> Iterator[tuple[Agent, Agent, HostKVCache]]:
    producer = _agent(Role.PRODUCER, HostKVCache(SHAPE, 16, NUM_BLOCKS, fill_seed=SEED))
    cache = HostKVCache(SHAPE, 16, NUM_BLOCKS)
    consumer = _agent(Role.CONSUMER, cache)
    producer.serve()
    yield producer, consumer, cache
    consumer.close()
    producer.close()


def test_a_renewed_hold_outlives_its_lease_and_is_read_exactly(
    pair: tuple[Agent, Agent, HostKVCache],
) -> None:
    producer, consumer, cache = pair
    ticket = producer.hold("queued", [1, 2], 32)
    expiry = ticket.lease_expiry
    end = time.monotonic() + 3 * LEASE_S  # queued for three leases
    while time.monotonic() < end:
        (renewed,) = consumer.renew([ticket])
        assert renewed >= expiry > 0  # never shortened
        expiry = renewed
        time.sleep(LEASE_S / 4)
    assert producer.holding() == ["queued"]
    # The ticket's own expiry is long past: the pull checks the renewed one.
    stale = consumer.pull(ticket, [3, 4])
    with pytest.raises(TransferError, match="lease on queued ran out"):
        stale.wait(5)
    assert stale.state is TransferState.FAILED and stale.invalid_blocks == (3, 4)
    ticket = producer.hold("queued-2", [1, 2], 32)
    time.sleep(LEASE_S * 0.6)
    (renewed,) = consumer.renew([ticket])
    time.sleep(LEASE_S * 0.6)  # past the first lease, inside the renewed one
    t = consumer.pull(msgspec.structs.replace(ticket, lease_expiry=renewed), [3, 4])
    t.wait(5)
    assert t.state is TransferState.DONE, t.error
    assert cache.mismatches([3, 4], [1, 2], SEED) == 0
    assert producer.stats().leases_renewed >= 5
    stats = consumer.stats()
    assert stats.renewals_sent >= 5 and stats.renewals_refused == 0


def test_a_hold_nobody_renews_expires_and_a_late_renewal_is_refused(
    pair: tuple[Agent, Agent, HostKVCache],
) -> None:
    producer, consumer, _ = pair
    ticket = producer.hold("idle", [1], 16)
    deadline = time.monotonic() + 10 * LEASE_S
    while "idle" not in producer.freed():
        assert time.monotonic() < deadline, "the hold never expired"
        time.sleep(0.02)
    assert producer.stats().leases_expired == 1
    assert consumer.renew([ticket]) == [0.0]
    assert consumer.stats().renewals_refused == 1


def test_a_renewal_without_the_holds_capability_extends_nothing(
    pair: tuple[Agent, Agent, HostKVCache],
) -> None:
    producer, consumer, _ = pair
    ticket = producer.hold("mine", [1], 16)
    forged = msgspec.structs.replace(ticket, capability="0" * len(ticket.capability))
    assert consumer.renew([forged]) == [0.0]
    assert producer.stats().capability_rejects == 1
    assert producer.stats().leases_renewed == 0
    # Several holds in one Renew, one of them unknown: each answered on its own.
    other = producer.hold("other", [2], 16)
    gone = msgspec.structs.replace(other, request_id="never-held")
    got = consumer.renew([ticket, gone, other])
    assert got[0] > 0 and got[1] == 0.0 and got[2] > 0


def test_renew_later_answers_on_a_worker_and_a_dead_producer_gives_zero(
    pair: tuple[Agent, Agent, HostKVCache],
) -> None:
    producer, consumer, _ = pair
    ticket = producer.hold("bg", [1], 16)
    done: list[list[float]] = []
    assert consumer.renew_later([ticket], done.append)
    deadline = time.monotonic() + 5
    while not done:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert done[0][0] > ticket.lease_expiry - 1e-6
    producer.close()  # its side channel stops: nothing renews, nothing hangs
    start = time.monotonic()
    assert consumer.renew([ticket]) == [0.0]
    assert time.monotonic() - start < 10
