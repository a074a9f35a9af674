"""Lease renewal (issue 54): a consumer that still means to read keeps the producer's
hold alive past ``lease_s``; one that stops renewing lets it expire as before.

In-process Agents on the fake backend, real side-channel sockets between them.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from kvxfer._agent.keepalive import MAX_RENEW_S, MIN_RENEW_S, renew_interval
from kvxfer.adapters.vllm.scheduler import SchedulerSide
from kvxfer.agent import Agent, AgentConfig
from kvxfer.backend import BackendOptions
from kvxfer.core.compat import Fingerprint
from kvxfer.errors import ConfigError, TransferError
from kvxfer.testing.fake_backend import FakeBackend
from kvxfer.testing.kvcache import HostKVCache, ModelShape
from kvxfer.transfer import TransferState
from kvxfer.types import Direction, Role

SHAPE = ModelShape(name="renew", layers=2, kv_heads=1, head_dim=8)
NUM_BLOCKS = 8
SEED = 11
LEASE_S = 0.8
FINGERPRINT = Fingerprint(
    model="m",
    dtype="bfloat16",
    kv_cache_dtype="bfloat16",
    attention_backend="t",
    direction=Direction.PULL,
)
_names = itertools.count()


def _agent(role: Role, cache: HostKVCache, **config: Any) -> Agent:
    agent = Agent(
        AgentConfig(
            engine_id=f"renew-{role.value}",
            fingerprint=FINGERPRINT,
            role=role,
            direction=Direction.PULL,
            transfer_timeout_s=5.0,
            lease_s=LEASE_S,
            lease_guard_s=0.1,
            **config,
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


# --- the vLLM scheduler side: which waiting requests renew, and when they stop ------


def _ticket_params(expiry: float) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-0",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_request_id": "cmpl-x-0-abcdef12",
        "remote_block_ids": [[1, 2]],
        "remote_num_tokens": 32,
        "lease_expiry": expiry,
        "tp_size": 1,
    }


@dataclasses.dataclass
class _Request:
    request_id: str
    kv_transfer_params: dict[str, Any] | None
    num_prompt_tokens: int = 32
    num_computed_tokens: int = 0
    status: str = "WAITING"


def _scheduler(role: Role = Role.CONSUMER, direction: Direction = Direction.PULL) -> SchedulerSide:
    return SchedulerSide(engine_id="d-0", role=role, direction=direction, block_size=16)


def test_a_waiting_pull_request_starts_one_keep_alive_and_none_once_scheduled() -> None:
    s = _scheduler()
    req = _Request("d-1", _ticket_params(time.time() + 3))
    s.on_new_request(req)
    (renewal,) = s.build_step_plan().renewals  # the next step starts its keep-alive
    assert renewal.request_id == "d-1" and renewal.transfer_id == "cmpl-x-0-abcdef12"
    assert renewal.remote_params["remote_host"] == "127.0.0.1"
    assert s.build_step_plan().renewals == []  # once: the Agent renews from then on
    # Scheduled in the step it arrived: its load starts at once, nothing to keep alive.
    now = _Request("d-9", _ticket_params(time.time() + 3))
    s.on_new_request(now)
    s.update_state_after_alloc(now, [[5, 6]], 32, 0)
    plan = s.build_step_plan()
    assert plan.renewals == [] and len(plan.loads) == 1


def test_keep_alives_start_only_where_they_mean_something() -> None:
    s = _scheduler()
    aborted = _Request("d-2", _ticket_params(time.time() + 0.6))
    s.on_new_request(aborted)
    s.request_finished(aborted, [[]])
    plan = s.build_step_plan()
    assert plan.renewals == [] and [r.request_id for r in plan.releases] == ["d-2"]
    for req, side in (
        (_Request("d-3", _ticket_params(time.time() - 1)), s),  # already over
        (_Request("d-4", {**_ticket_params(0), "lease_expiry": None}), s),  # no expiry
        (_Request("d-5", None), s),  # a plain request
        (_Request("d-6", _ticket_params(time.time() + 0.6)), _scheduler(Role.PRODUCER)),
        (_Request("d-7", _ticket_params(time.time() + 0.6)), _scheduler(direction=Direction.PUSH)),
    ):
        side.on_new_request(req)
        assert side.build_step_plan().renewals == [], req.request_id


# --- the Agent's keep-alive: renewals on the agent's own timer, no caller loop --------


def test_renew_interval_is_a_third_of_what_is_left_before_the_guard_within_bounds() -> None:
    assert renew_interval(100.0, 70.0, 0.0) == pytest.approx(10.0)
    assert renew_interval(100.0, 94.0, 0.5) == pytest.approx(5.5 / 3)
    assert renew_interval(100.0, 99.9, 0.5) == MIN_RENEW_S  # past the guard: soon
    assert renew_interval(10_000.0, 0.0, 0.5) == MAX_RENEW_S
    prev = 0.0
    for left in (0.1, 0.7, 1.0, 3.0, 9.0, 29.0, 31.0, 90.0):
        got = renew_interval(left, 0.0, 0.1)
        assert MIN_RENEW_S <= got <= MAX_RENEW_S and got >= prev
        prev = got


def test_a_kept_hold_outlives_three_leases_with_no_caller_loop_and_reads_exactly(
    pair: tuple[Agent, Agent, HostKVCache],
) -> None:
    producer, consumer, cache = pair
    ticket = producer.hold("kept", [1, 2], 32)
    assert consumer.keep_alive([ticket]) == 1
    assert consumer.keep_alive([ticket]) == 0  # kept already
    time.sleep(3 * LEASE_S)  # nothing here renews: the agent's timer does
    assert producer.holding() == ["kept"]
    sent = consumer.stats().renewals_sent
    assert sent >= 3 and producer.stats().leases_renewed >= 3
    # The ticket's own expiry is long past; the pull takes the renewed one.
    t = consumer.pull(ticket, [3, 4])
    t.wait(5)
    assert t.state is TransferState.DONE, t.error
    assert cache.mismatches([3, 4], [1, 2], SEED) == 0
    time.sleep(LEASE_S)
    stats = consumer.stats()
    assert stats.renewals_sent == sent  # the pull ended the keep-alive
    assert stats.renewals_refused == 0 and stats.renewals_lapsed == 0


def test_a_stopped_keep_alive_lets_the_hold_expire_and_its_pull_fails_closed(
    pair: tuple[Agent, Agent, HostKVCache],
) -> None:
    producer, consumer, _ = pair
    ticket = producer.hold("stopped", [1], 16)
    consumer.keep_alive([ticket])
    time.sleep(LEASE_S)
    assert consumer.stop_keep_alive(ticket) and not consumer.stop_keep_alive(ticket)
    deadline = time.monotonic() + 10 * LEASE_S
    while "stopped" not in producer.freed():
        assert time.monotonic() < deadline, "the hold outlived its keep-alive"
        time.sleep(0.02)
    t = consumer.pull(ticket, [3])
    with pytest.raises(TransferError, match="lease on stopped ran out"):
        t.wait(5)
    # An abort ends a keep-alive too, and an expired or expiry-less ticket adds none.
    other = producer.hold("aborted", [2], 16)
    consumer.keep_alive([other])
    consumer.abort(other, wait=True)
    assert not consumer.stop_keep_alive(other)
    past = msgspec.structs.replace(other, request_id="past", lease_expiry=time.time() - 1)
    unset = msgspec.structs.replace(other, request_id="unset", lease_expiry=0.0)
    assert consumer.keep_alive([past, unset]) == 0


def test_a_keep_alive_lapses_when_its_producer_is_gone_or_its_limit_passes(
    pair: tuple[Agent, Agent, HostKVCache],
) -> None:
    producer, consumer, _ = pair
    ticket = producer.hold("orphan", [1], 16)
    consumer.keep_alive([ticket])
    producer.close()  # no answers from now on: tried until the lease ends, then dropped
    deadline = time.monotonic() + 10 * LEASE_S + 10
    while consumer.stats().renewals_lapsed < 1:
        assert time.monotonic() < deadline, "a keep-alive of a dead producer never lapsed"
        time.sleep(0.05)
    assert not consumer.stop_keep_alive(ticket)
    assert consumer.stats().renewals_refused >= 1


def test_renew_limit_s_bounds_how_long_a_forgotten_hold_is_renewed() -> None:
    producer = _agent(Role.PRODUCER, HostKVCache(SHAPE, 16, NUM_BLOCKS, fill_seed=SEED))
    consumer = _agent(Role.CONSUMER, HostKVCache(SHAPE, 16, NUM_BLOCKS), renew_limit_s=LEASE_S)
    try:
        producer.serve()
        ticket = producer.hold("forgotten", [1], 16)
        consumer.keep_alive([ticket])
        deadline = time.monotonic() + 10 * LEASE_S
        while "forgotten" not in producer.freed():
            assert time.monotonic() < deadline, "renew_limit_s did not end the renewals"
            time.sleep(0.02)
        stats = consumer.stats()
        assert stats.renewals_lapsed == 1 and stats.renewals_sent >= 1
        assert producer.stats().leases_expired == 1
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_renew_limit_s_must_be_a_positive_number_of_seconds(value: float) -> None:
    with pytest.raises(
        ConfigError, match=r"^renew_limit_s=.*: must be a positive number of seconds$"
    ):
        AgentConfig(
            engine_id="e",
            fingerprint=FINGERPRINT,
            renew_limit_s=value,
        )
