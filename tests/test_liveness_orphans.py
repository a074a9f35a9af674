"""A push reception whose producer is proven gone after it was out of reach waits for
the producer's orphaned socket to end (R-SAFE-5, ``kvxfer._agent.liveness``).

The probes' connects are replaced here by scripted outcomes: "no route" while the link
is down, then "refused" (the producer died meanwhile). Between two real hosts the same
case is ``tests/test_link_down_proc.py -k died``.
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
from kvxfer.transfer import FailureKind, ReceptionState, Transfer


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
        push_from=("10.0.0.1", 5600), writer_live=True, producer_stall_s=producer_stall_s
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


def test_a_producer_gone_after_an_outage_is_waited_for_until_its_socket_surely_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = _reception(producer_stall_s=12.0)
    unreachable = OSError(errno.ENETUNREACH, "Network is unreachable")
    before = time.monotonic()
    assert not _probe(monkeypatch, t, unreachable, None).failed  # alive, as far as we know
    reception = t.meta.reception
    assert reception is not None
    silent_at = reception.silent_at
    assert before <= silent_at <= time.monotonic()
    _probe(monkeypatch, t, unreachable, None)
    assert reception.silent_at == silent_at  # the first probe that found it out of reach
    settler = _probe(monkeypatch, t, ConnectionRefusedError(errno.ECONNREFUSED, "refused"), None)
    assert [kind for _, kind in settler.failed] == [FailureKind.PEER_GONE]
    # Gone, yet its writer may still land bytes until its orphaned socket ended: the
    # producer's stall limit past the outage's start, and the margin.
    assert reception.writer_until == pytest.approx(silent_at + 12.0 + liveness.STALL_MARGIN_S)
    reception.writer_live = False  # what the settler's quiet fail does
    assert t.meta.writer_live  # so the settler keeps it quarantined
    reception.writer_until = time.monotonic() - 0.001
    assert not t.meta.writer_live  # and lets it settle once that passed


@pytest.mark.parametrize(
    ("outage", "producer_stall_s"),
    [(False, 12.0), (True, 0.0)],
    ids=["never-out-of-reach", "no-stall-limit-announced"],
)
def test_no_wait_without_an_outage_or_a_limit(
    monkeypatch: pytest.MonkeyPatch, outage: bool, producer_stall_s: float
) -> None:
    """A producer found gone without an outage before is settled at once (its kernel
    delivered what it had while the link was up); one that announced no stall limit
    (an older producer) too, as nothing bounds the wait."""
    t = _reception(producer_stall_s)
    if outage:
        _probe(monkeypatch, t, TimeoutError("timed out"), None)
    settler = _probe(monkeypatch, t, ConnectionRefusedError(errno.ECONNREFUSED, "refused"), None)
    assert [kind for _, kind in settler.failed] == [FailureKind.PEER_GONE]
    reception = t.meta.reception
    assert reception is not None and reception.writer_until == 0.0


def test_a_restarted_producer_is_waited_for_like_a_dead_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After an outage the producer answers, as a new process: the hold is UNKNOWN to
    it, and the old process's socket may still deliver."""
    t = _reception(producer_stall_s=12.0)
    _probe(monkeypatch, t, OSError(errno.EHOSTUNREACH, "No route to host"), None)
    conn = socket.socket()
    pong = wire.Pong(
        engine_id="prefill",
        incarnation=2,
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
    assert reception is not None and reception.writer_until > time.monotonic()
