"""Block ids at the Agent's door: checked against the registered layout at the call
(kvxfer.core.blocks), so bad ids fail before anything is posted; Agent.stage_out forwards
to a staging backend only."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvxfer.agent import Agent, AgentConfig
from kvxfer.backend import BackendOptions
from kvxfer.core.compat import Fingerprint
from kvxfer.errors import PlanError, RegistrationError
from kvxfer.testing.fake_backend import FakeBackend
from kvxfer.testing.kvcache import HostKVCache, ModelShape
from kvxfer.types import Direction, Role

SHAPE = ModelShape(name="sm", layers=1, kv_heads=1, head_dim=8)
FP = Fingerprint(
    model="m",
    dtype="bfloat16",
    kv_cache_dtype="bfloat16",
    attention_backend="t",
    direction=Direction.PULL,
)
NUM_BLOCKS = 8
_names = itertools.count()


def _agent(role: Role, *, stages: bool = False, register: bool = True) -> Agent:
    backend = FakeBackend(
        BackendOptions(agent_name=f"blocks-{next(_names)}"), stages_through_host=stages
    )
    agent = Agent(
        AgentConfig(engine_id=f"e-{role.value}", fingerprint=FP, role=role), backend=backend
    )
    if register:
        agent.register(HostKVCache(SHAPE, 16, NUM_BLOCKS).layout())
    return agent


@pytest.fixture
def producer() -> Iterator[Agent]:
    agent = _agent(Role.PRODUCER)
    yield agent
    agent.close()


@pytest.mark.parametrize(
    ("ids", "rule"),
    [
        ([1, NUM_BLOCKS], "out of range"),
        ([-1], "out of range"),
        ([2, 2], "repeated"),
        ([1.0], "must be an integer"),
        ([True], "must be an integer"),
    ],
)
def test_hold_pull_and_expect_push_refuse_bad_ids_at_the_call(
    producer: Agent, ids: list[object], rule: str
) -> None:
    with pytest.raises(PlanError, match=rule):
        producer.hold("bad", ids, 32)  # type: ignore[arg-type]
    assert producer.holding() == []  # nothing was held
    producer.serve()
    good = list(range(len(ids)))
    ticket = producer.hold("r", good, 16 * len(good))
    consumer = _agent(Role.CONSUMER)
    consumer.serve()
    try:
        with pytest.raises(PlanError, match=rule):
            consumer.pull(ticket, ids)  # type: ignore[arg-type]
        with pytest.raises(PlanError, match=rule):
            consumer.expect_push(ticket, ids)  # type: ignore[arg-type]
        assert consumer.stats().transfers_failed == 0  # refused, not posted and failed
        # Nothing will be read: the producer was told to free the blocks at once.
        freed: list[str] = []
        deadline = time.monotonic() + 10
        while "r" not in freed and time.monotonic() < deadline:
            freed += producer.freed()
            time.sleep(0.01)
        assert freed == ["r"]
    finally:
        consumer.close()


def test_a_flat_list_serves_every_group_and_a_ticket_carries_plain_ints(producer: Agent) -> None:
    ticket = producer.hold("ok", np.array([3, 1], dtype=np.int32), 20)
    assert ticket.block_ids == ((3, 1),)
    assert all(type(b) is int for b in ticket.block_ids[0])


def test_block_ids_before_registration_are_a_registration_error() -> None:
    agent = _agent(Role.PRODUCER, register=False)
    try:
        with pytest.raises(RegistrationError):
            agent.hold("early", [1], 16)
        with pytest.raises(RegistrationError):
            agent.stage_out([1])
    finally:
        agent.close()


@pytest.mark.parametrize("stages", [True, False])
def test_stage_out_forwards_only_to_a_staging_backend(stages: bool) -> None:
    agent = _agent(Role.PRODUCER, stages=stages)
    backend = agent.backend
    assert isinstance(backend, FakeBackend)
    try:
        agent.stage_out([4, 2])
        if stages:
            assert [(kind, [g.tolist() for g in ids]) for kind, ids in backend.staged] == [
                ("out", [[4, 2]])
            ]
        else:
            assert backend.staged == []
        with pytest.raises(PlanError, match="out of range"):
            agent.stage_out([NUM_BLOCKS])
    finally:
        agent.close()
