"""A push reception whose producer is found gone waits for the producer's orphaned
socket to end (R-SAFE-5, ``kvxfer._agent.liveness``).

The probes' connects are replaced here by scripted outcomes: "no route" while a link
is down, "refused" once the producer died. Between two real hosts the same cases are
``tests/test_link_down_proc.py -k "killed or died"``. The last test runs two agents on
the fake fabric: whether the producer's transport lets its writes outlive it decides
whether there is anything to wait for.
"""

from __future__ import annotations

import errno
import socket
import time
from typing import Any

import pytest

from kvxfer._agent import liveness
from kvxfer._version import PROTOCOL_VERSION
from kvxfer.core import wire
from kvxfer.transfer import FailureKind, ReceptionState, Transfer, TransferState
from kvxfer.types import Direction, Role
from tests.faultkit import (
    BLOCK,
    PRODUCER_SEED,
    Side,
    push_registered,
    record_posts,
    stub,
    until,
)


class _Settler:
    def __init__(self) -> None:
        self.failed: list[tuple[Transfer, FailureKind]] = []

    def fail(self, transfer: Transfer, kind: FailureKind, *_: Any) -> None:
        self.failed.append((transfer, kind))

    def pushed(self, transfer: Transfer) -> None:
        raise AssertionError("nothing was pushed")


def _reception(producer_stall_s: float) -> Transfer:
    t = Transfer("req", ((1, 2),), progress=lambda: None, deadline=time.monotonic() + 60)
    t.meta.reception = ReceptionState(
        push_from=("10.0.0.1", 5600),
        writer_live=True,
        producer_stall_s=producer_stall_s,
        producer_incarnation=1,
    )
    return t


def _probe(
    monkeypatch: pytest.MonkeyPatch, t: Transfer, outcome: OSError, reply: wire.Message | None
) -> _Settler:
    """One probe of ``t`` whose connect ends in ``outcome`` (or connects, when the
    producer answers ``reply``)."""
    settler = _Settler()
    monkeypatch.setattr(liveness, "probe_port", lambda host, port: outcome)

    def ping(*_: Any, **__: Any) -> wire.Message:
        assert reply is not None
        return reply

    probes = liveness.Liveness(ping, lambda fn, *a: fn(*a) or True, settler, lambda: None)
    t.meta.last_progress = 0.0
    t.meta.probing = False
    probes.check(time.monotonic(), [t])
    return settler


@pytest.mark.parametrize("outage", [False, True], ids=["link-up", "after-an-outage"])
def test_a_producer_found_gone_is_waited_for_until_its_orphaned_socket_surely_ended(
    monkeypatch: pytest.MonkeyPatch, outage: bool
) -> None:
    t = _reception(producer_stall_s=12.0)
    if outage:
        unreachable = OSError(errno.ENETUNREACH, "Network is unreachable")
        assert not _probe(monkeypatch, t, unreachable, None).failed  # alive, for all we know
    before = time.monotonic()
    settler = _probe(monkeypatch, t, ConnectionRefusedError(errno.ECONNREFUSED, "refused"), None)
    after = time.monotonic()
    assert [kind for _, kind in settler.failed] == [FailureKind.PEER_GONE]
    # Gone, yet its kernel may still send what the WRITE had queued, until its
    # orphaned socket ended: the producer's stall limit, and the margin.
    reception = t.meta.reception
    assert reception is not None
    wait = 12.0 + liveness.STALL_MARGIN_S
    assert before + wait <= reception.writer_until <= after + wait
    _probe(monkeypatch, t, ConnectionRefusedError(errno.ECONNREFUSED, "refused"), None)
    assert reception.writer_until <= after + wait  # probed on while it waits: not pushed back
    reception.writer_live = False  # what the settler's quiet fail does
    assert t.meta.writer_live  # so the settler keeps it quarantined
    reception.writer_until = time.monotonic() - 0.001
    assert not t.meta.writer_live  # and lets it settle once that passed


def test_no_wait_for_a_producer_that_announced_no_stall_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An older producer announces none: nothing bounds the wait, so none is made."""
    t = _reception(producer_stall_s=0.0)
    settler = _probe(monkeypatch, t, ConnectionRefusedError(errno.ECONNREFUSED, "refused"), None)
    assert [kind for _, kind in settler.failed] == [FailureKind.PEER_GONE]
    reception = t.meta.reception
    assert reception is not None and reception.writer_until == 0.0


@pytest.mark.parametrize(
    ("incarnation", "waits"), [(2, True), (1, False)], ids=["restarted", "same"]
)
def test_a_restarted_producer_is_waited_for_like_a_dead_one(
    monkeypatch: pytest.MonkeyPatch, incarnation: int, waits: bool
) -> None:
    """The producer answers that it does not know the hold. As a new process (another
    incarnation than the ticket's) the old one died, and its socket may still
    deliver; the same process does not know it any more because the hold ended."""
    t = _reception(producer_stall_s=12.0)
    _probe(monkeypatch, t, OSError(errno.EHOSTUNREACH, "No route to host"), None)
    conn = socket.socket()
    pong = wire.Pong(
        engine_id="prefill",
        incarnation=incarnation,
        protocol_version=PROTOCOL_VERSION,
        compat_hash="0" * 64,
        hold=wire.HoldState.UNKNOWN,
    )
    try:
        settler = _probe(monkeypatch, t, conn, pong)  # type: ignore[arg-type]
    finally:
        conn.close()
    assert [kind for _, kind in settler.failed] == [FailureKind.PEER_GONE]
    reception = t.meta.reception
    assert reception is not None
    assert (reception.writer_until > time.monotonic()) is waits


@pytest.mark.parametrize("outlive", [False, True], ids=["ends-with-process", "tcp-like"])
def test_a_dead_producer_is_waited_for_only_where_its_writes_outlive_it(outlive: bool) -> None:
    """Two agents on the fake fabric: the producer dies with its WRITE in flight and
    its FAILED notice lost, so the consumer's probe finds it gone. Its writes end
    with its process there, so it announced no stall limit and its reception settles
    at once; a transport whose writes outlive the process (TCP) holds it quarantined
    for the limit and the margin (CI run of 03534c4: the fake fabric's producer had
    announced its limit, and a reception waited 4 s past its deadline)."""
    producer = Side(
        Role.PRODUCER,
        Direction.PUSH,
        seed=PRODUCER_SEED,
        backend_extra={"writes_outlive_process": str(outlive)},
        transfer_timeout_s=5.0,
    )
    consumer = Side(Role.CONSUMER, Direction.PUSH, transfer_timeout_s=1.0)
    posted = record_posts(producer.backend)
    try:
        t = consumer.agent.expect_push(stub(producer, "req"), [5, 6], num_tokens=2 * BLOCK)
        push_registered(producer, "req")
        producer.faults(stall=True)
        producer.agent.hold("req", [1, 2], 2 * BLOCK)
        assert until(lambda: bool(posted), 5.0) is not None, "the producer never posted"
        producer.backend.notify = lambda *_: None  # type: ignore[method-assign]
        producer.close()
        t0 = time.monotonic()
        reception = t.meta.reception
        assert reception is not None
        if outlive:
            # A probe finds it gone (QUIET_S), and the reception waits 5 + 3 s from then.
            assert until(lambda: reception.writer_until > 0, 5.0) is not None
            assert t.poll() is TransferState.PENDING and t.doomed
            assert t.meta.quarantined
        else:
            # Settled at the probe, not 8 s later: 6 s tells the two apart on any host.
            until(lambda: t.poll() is not TransferState.PENDING, 6.0)
            assert t.state is TransferState.FAILED and t.invalid_blocks == (5, 6)
            assert time.monotonic() - t0 < 6.0
            assert reception.writer_until == 0.0
    finally:
        consumer.close()
        producer.close()
