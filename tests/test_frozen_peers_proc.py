"""Frozen, not dead (R-SAFE-6), between real processes over UCX.

A peer process is stopped (SIGSTOP) for 3 s, well under ``transfer_timeout_s`` (10 s),
at the moments a transfer depends on it; each transfer must end DONE with the
producer's bytes. Then a stopped producer is killed: the consumer's transfer must be
FAILED within 1.5 s (a death is still seen at once).

The data plane is UCX over TCP (``UCX_TLS=tcp``, as between two hosts without RDMA):
over shared memory a consumer reads a stopped producer's memory by itself, and the
freeze would be invisible.

How the failure on a loaded host came about (issue 25): a stopped or starved process
does not accept connections, and its listener's queue (zmq's default backlog: 100)
fills with the liveness probes' own connections, three per probe, in about 25 s; the
next connect times out, which the consumer took for a death. The tests below fill the
queue at once, the way those probes did, instead of waiting 25 s.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.agent_proc import AgentProc, ProcSpec

pytestmark = pytest.mark.proc

SEED = 29
FREEZE_S = 3.0
TIMEOUT_S = 10.0


def _pair(direction: str, **consumer: object) -> tuple[AgentProc, AgentProc]:
    prod = AgentProc(
        ProcSpec(
            engine_id=f"frozen-p-{direction}",
            role="kv_producer",
            direction=direction,
            fill_seed=SEED,
            transfer_timeout_s=TIMEOUT_S,
            ucx_tls="tcp",
        )
    )
    try:
        cons = AgentProc(
            ProcSpec(
                engine_id=f"frozen-d-{direction}",
                role="kv_consumer",
                direction=direction,
                transfer_timeout_s=TIMEOUT_S,
                ucx_tls="tcp",
                **consumer,  # type: ignore[arg-type]
            )
        )
    except BaseException:
        prod.close()
        raise
    return prod, cons


@pytest.fixture
def pull_pair() -> Iterator[tuple[AgentProc, AgentProc]]:
    prod, cons = _pair("pull")
    yield prod, cons
    _thaw(prod)
    cons.close()
    prod.close()


def _freeze(proc: AgentProc, seconds: float) -> threading.Timer:
    """Stop ``proc`` now; it continues after ``seconds`` (on a timer thread)."""
    os.kill(proc.proc.pid, signal.SIGSTOP)
    timer = threading.Timer(seconds, _thaw, (proc,))
    timer.daemon = True
    timer.start()
    return timer


def _thaw(proc: AgentProc) -> None:
    if proc.proc.is_alive():
        os.kill(proc.proc.pid, signal.SIGCONT)


def _fill_accept_queue(host: str, port: int) -> int:
    """Connect to a stopped peer until its listener's queue is full (a connect times
    out), closing each connection as a probe does; returns how many were queued."""
    for n in range(4096):
        try:
            socket.create_connection((host, port), timeout=0.3).close()
        except TimeoutError:
            return n
    raise AssertionError("the listener's queue never filled: is the peer stopped?")


def _warm(prod: AgentProc, cons: AgentProc) -> dict[str, Any]:
    """A first pull, so that the next one finds the producer handshaken; its ticket."""
    ticket: dict[str, Any] = prod.call("hold", "warm", [1], 16)
    cons.call("pull", ticket, [2], None)
    assert cons.call("wait", "warm", 20)["ok"]
    return ticket


def test_a_producer_frozen_at_first_contact_longer_than_the_handshake_tries() -> None:
    """The consumer's Hello tries (2 x 1 s) all go unanswered while the producer is
    stopped; its port accepts, so the handshake goes on until the pull's deadline."""
    prod, cons = _pair("pull", handshake_timeout_s=1.0)
    try:
        ticket = prod.call("hold", "first", [3, 4, 5], 48)
        timer = _freeze(prod, FREEZE_S)
        cons.call("pull", ticket, [6, 7, 8], None)
        result = cons.call("wait", "first", 30)
        timer.join()
        assert result["ok"], result
        assert cons.call("check", [6, 7, 8], [3, 4, 5], SEED) == 0
    finally:
        _thaw(prod)
        cons.close()
        prod.close()


def test_a_producer_frozen_during_a_pull_with_a_full_accept_queue(
    pull_pair: tuple[AgentProc, AgentProc],
) -> None:
    """The READ waits for the stopped producer; every probe's connect times out (the
    queue is full), which is no evidence of death: DONE once it continues."""
    prod, cons = pull_pair
    _warm(prod, cons)
    ticket = prod.call("hold", "in-flight", [9, 10, 11], 48)
    os.kill(prod.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    assert _fill_accept_queue(prod.host, prod.port) > 0
    cons.call("pull", ticket, [12, 13, 14], None)
    time.sleep(max(0.0, FREEZE_S - (time.monotonic() - t0)))
    assert cons.call("state", "in-flight") == "pending", "a frozen producer was taken for dead"
    _thaw(prod)
    result = cons.call("wait", "in-flight", 20)
    assert result["ok"], result
    assert cons.call("check", [12, 13, 14], [9, 10, 11], SEED) == 0
    assert cons.call("stats")["liveness_probes"] >= 2  # probed while frozen


def test_a_producer_frozen_while_a_pull_waits_for_its_hold(
    pull_pair: tuple[AgentProc, AgentProc],
) -> None:
    """A ticket handed out before its hold (the vLLM scheduler's) is pulled: the
    consumer re-reads the guard word until the hold comes. The producer freezes during
    those re-reads, its accept queue full; once it continues and holds, DONE."""
    prod, cons = pull_pair
    warm = _warm(prod, cons)
    cap, slot, generation = "ee" * 16, 40, 0xFEED
    ticket = dict(
        warm,
        request_id="late",
        block_ids=[[19, 20]],
        num_tokens=32,
        capability=cap,
        guard_slot=slot,
        generation=generation,
    )
    cons.call("pull", ticket, [21, 22], None)
    deadline = time.monotonic() + 10
    while cons.call("stats")["guard_rereads"] < 1:  # re-reading the word
        assert time.monotonic() < deadline, "the pull never waited for its hold"
        time.sleep(0.01)
    os.kill(prod.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    _fill_accept_queue(prod.host, prod.port)
    time.sleep(max(0.0, FREEZE_S - (time.monotonic() - t0)))
    assert cons.call("state", "late") == "pending", "a frozen producer was taken for dead"
    _thaw(prod)
    prod.call("hold", "late", [19, 20], 32, cap, [slot, generation])
    result = cons.call("wait", "late", 20)
    assert result["ok"], result
    assert cons.call("check", [21, 22], [19, 20], SEED) == 0


def test_a_frozen_producer_killed_fails_the_pull_within_a_second_and_a_half(
    pull_pair: tuple[AgentProc, AgentProc],
) -> None:
    prod, cons = pull_pair
    _warm(prod, cons)
    ticket = prod.call("hold", "killed", [15, 16], 32)
    os.kill(prod.proc.pid, signal.SIGSTOP)
    _fill_accept_queue(prod.host, prod.port)
    cons.call("pull", ticket, [17, 18], None)
    time.sleep(FREEZE_S)  # probes unanswered, connects timing out: frozen, not dead
    assert cons.call("state", "killed") == "pending", "a frozen producer was taken for dead"
    prod.proc.kill()
    prod.proc.join(10)
    result = cons.call("wait", "killed", 10)
    assert not result["ok"] and result["invalid_blocks"] == [17, 18], result
    assert result["waited_s"] < 1.5, result


def test_a_consumer_frozen_during_a_push_receives_every_byte() -> None:
    prod, cons = _pair("push")
    try:
        remote, local, tokens = [20, 21, 22], [23, 24, 25], 48
        stub = {
            "engine_id": "frozen-p-push",
            "host": prod.host,
            "port": prod.port,
            "request_id": "pushed",
            "block_ids": [[]],
            "num_tokens": tokens,
        }
        cons.call("expect_push", stub, local, tokens)
        deadline = time.monotonic() + 10
        while "pushed" not in prod.call("holding"):  # registered
            assert time.monotonic() < deadline, "the consumer never registered"
            time.sleep(0.01)
        timer = _freeze(cons, FREEZE_S)
        prod.call("hold", "pushed", remote, tokens)  # the writes start now
        timer.join()
        result = cons.call("wait", "pushed", 20)
        assert result["ok"], result
        assert cons.call("check", local, remote, SEED) == 0
    finally:
        _thaw(cons)
        cons.close()
        prod.close()
