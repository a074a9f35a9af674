"""A busy side channel still answers Pings (R-SAFE-6): no handler blocks the others.

The producer's slow handlers are made to block for as long as the test says: the
backend's metadata (asked for every Welcome, under the backend's lock in the NIXL
backends) or the agent lock (taken by a Release, a PushRegister, and a Ping that names
a request). While one of them is blocked, a Ping from a stranger must be answered; on
a side channel that runs its handlers one after another it waits behind the blocked
one. The checks are of order (the Pong came while the handler was still blocked), not
of speed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest

from kvxfer.agent import Agent
from kvxfer.core import wire
from kvxfer.io import control
from kvxfer.types import Direction, Role
from tests.faultkit import Side, Stranger

#: How long a Pong may take on a loaded host; the handler stays blocked far longer.
PONG_WAIT_MS = 5000


@pytest.fixture
def producer() -> Iterator[Side]:
    side = Side(Role.PRODUCER, Direction.PULL, seed=3, handshake_timeout_s=20.0)
    yield side
    side.close()


@pytest.fixture
def consumer() -> Iterator[Side]:
    side = Side(Role.CONSUMER, Direction.PULL, handshake_timeout_s=20.0)
    yield side
    side.close()


def _block_metadata(side: Side) -> tuple[threading.Event, threading.Event]:
    """Make the producer's Welcome block inside backend.metadata() until released."""
    entered, release = threading.Event(), threading.Event()
    real = side.backend.metadata

    def slow_metadata() -> bytes:
        entered.set()
        release.wait(30)
        return real()

    side.backend.metadata = slow_metadata  # type: ignore[method-assign]
    return entered, release


def _connect_in_background(agent: Agent, side: Side) -> threading.Thread:
    thread = threading.Thread(target=agent.connect, args=(side.host, side.port), daemon=True)
    thread.start()
    return thread


def test_a_ping_is_answered_while_a_handshake_waits_for_the_backend(
    producer: Side, consumer: Side
) -> None:
    entered, release = _block_metadata(producer)
    handshake = _connect_in_background(consumer.agent, producer)
    stranger = Stranger(producer.host, producer.port, Direction.PULL)
    try:
        assert entered.wait(10), "the handshake never reached the producer's Welcome"
        pong = stranger.request(wire.Ping(engine_id="prober"), timeout_ms=PONG_WAIT_MS)
        assert isinstance(pong, wire.Pong)
        assert pong.engine_id == producer.name and pong.role is Role.PRODUCER
        assert pong.layout is not None  # said without asking the blocked backend
        assert handshake.is_alive(), "the Pong should have come while the Welcome was blocked"
    finally:
        release.set()
        stranger.close()
    handshake.join(30)
    assert not handshake.is_alive()
    assert consumer.agent.stats().handshakes == 1  # the blocked handshake then completed


def test_two_handshakes_and_pings_proceed_beside_one_blocked_welcome(producer: Side) -> None:
    """Handshakes do not queue behind each other either: the second consumer's Welcome
    is built while the first one's is still blocked (a TP consumer's ranks arrive at
    once)."""
    entered, release = _block_metadata(producer)
    first = Side(Role.CONSUMER, Direction.PULL, handshake_timeout_s=20.0)
    second = Side(Role.CONSUMER, Direction.PULL, handshake_timeout_s=20.0)
    try:
        blocked = _connect_in_background(first.agent, producer)
        assert entered.wait(10)
        entered.clear()
        other = _connect_in_background(second.agent, producer)
        assert entered.wait(10), "the second Welcome waited for the first one"
        stranger = Stranger(producer.host, producer.port, Direction.PULL)
        try:
            pong = stranger.request(wire.Ping(engine_id="prober"), timeout_ms=PONG_WAIT_MS)
        finally:
            stranger.close()
        assert isinstance(pong, wire.Pong)
        assert blocked.is_alive() and other.is_alive()
        release.set()
        blocked.join(30)
        other.join(30)
        assert first.agent.stats().handshakes == 1 and second.agent.stats().handshakes == 1
    finally:
        release.set()
        first.close()
        second.close()


def test_a_ping_is_answered_while_the_agent_lock_is_held(producer: Side) -> None:
    """A Release waits for the agent lock (held here, as a long call could); a Ping
    that names a request is answered anyway, without the hold's state, and a plain
    Ping as usual; the Release is answered once the lock is free."""
    ticket = producer.agent.hold("req", [1, 2], 32)
    held, release = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with producer.agent._lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold_the_lock, daemon=True)
    holder.start()
    assert held.wait(10)
    releaser = Stranger(producer.host, producer.port, Direction.PULL)
    pinger = Stranger(producer.host, producer.port, Direction.PULL)
    answers: list[wire.Message] = []
    pending = threading.Thread(
        target=lambda: answers.append(
            releaser.request(
                wire.Release(request_id="req", capability=ticket.capability, reason="test"),
                timeout_ms=30000,
            )
        ),
        daemon=True,
    )
    try:
        pending.start()
        plain = pinger.request(wire.Ping(engine_id="prober"), timeout_ms=PONG_WAIT_MS)
        named = pinger.request(
            wire.Ping(engine_id="prober", request_id="req", capability=ticket.capability),
            timeout_ms=PONG_WAIT_MS,
        )
        assert isinstance(plain, wire.Pong) and isinstance(named, wire.Pong)
        assert named.hold is None  # the lock was busy: no word on the hold, not "unknown"
        assert pending.is_alive() and not answers, "the Release should wait for the lock"
        release.set()
        pending.join(30)
        assert answers and isinstance(answers[0], wire.Ack)
        after = pinger.request(
            wire.Ping(engine_id="prober", request_id="req", capability=ticket.capability),
            timeout_ms=PONG_WAIT_MS,
        )
        assert isinstance(after, wire.Pong) and after.hold is wire.HoldState.RELEASED
    finally:
        release.set()
        releaser.close()
        pinger.close()


def test_a_late_answer_is_logged_with_where_its_time_went(
    producer: Side, consumer: Side, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer that saw a late Welcome can be traced from the producer's log: the
    request's wait for a worker and its time in the handler, separately."""
    entered, release = _block_metadata(producer)
    with caplog.at_level(logging.WARNING, logger="kvxfer.io.control"):
        handshake = _connect_in_background(consumer.agent, producer)
        try:
            assert entered.wait(10), "the handshake never reached the producer's Welcome"
            time.sleep(control.SLOW_S + 0.3)  # the handler stays blocked past the mark
        finally:
            release.set()
        handshake.join(30)
    assert consumer.agent.stats().handshakes == 1
    late = [r.getMessage() for r in caplog.records if "after it came" in r.getMessage()]
    assert late, "a Welcome answered after more than SLOW_S was not logged"
    handler_s = float(late[0].split("waiting for a worker, ")[1].split("s in its handler")[0])
    assert handler_s >= control.SLOW_S
