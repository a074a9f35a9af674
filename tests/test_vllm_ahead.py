"""``connect_ahead`` (the vLLM adapter's worker side, :mod:`kvxfer.adapters.vllm.ahead`)
with in-process Agents on the fake backend: a decode rank connects to a prefill group
that comes up after it, to exactly the ranks it reads; it stops when told, and gives
up on a peer it can never connect to, saying why. A peer with ``refresh_s`` is a name
for several instances (real side channels on 127.0.0.1 and 127.0.0.2): each address
it resolves to is connected, those it gains later too, those it loses are forgotten."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

import pytest

from kvxfer.adapters.vllm import ahead
from kvxfer.adapters.vllm.ahead import ConnectAhead, resolve_addresses
from kvxfer.adapters.vllm.kv_transfer_config import PeerAddress
from kvxfer.core.heads import HeadLayout
from kvxfer.types import Direction, Role
from tests.tp_ranks import Rank, consumers, free_base_port, make_rank
from tests.tp_ranks import closing as closing  # the fixture, by name

HEADS = 4


def _decode(tp: int) -> list[Rank]:
    return consumers(
        HeadLayout(num_kv_heads=HEADS, tp_size=tp), direction=Direction.PULL, timeout_s=1.0
    )


def test_a_decode_rank_connects_to_a_prefill_group_that_starts_later(
    closing: list[Rank], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ahead, "FIRST_RETRY_S", 0.05)
    (decode,) = _decode(1)
    closing.append(decode)
    base = free_base_port(2)
    peer = PeerAddress(host="127.0.0.1", port=base, tp_size=2, engine_id="prefill")
    connecting = ConnectAhead(decode.agent, [peer])
    connecting.start()
    time.sleep(0.3)  # nobody serves there yet: it keeps trying
    assert not connecting.done(0) and decode.agent.stats().handshakes == 0
    heads = HeadLayout(num_kv_heads=HEADS, tp_size=2)
    prefill = [
        make_rank(
            "prefill",
            Role.PRODUCER,
            heads,
            r,
            base + r,
            seed=5,
            direction=Direction.PULL,
            timeout_s=1.0,
        )
        for r in range(2)
    ]
    closing += prefill
    for p in prefill:
        p.agent.serve()
    assert connecting.done(10)
    # A TP1 decode rank reads every head: both prefill ranks, one handshake each.
    assert connecting.connected == {("127.0.0.1", base): [base, base + 1]}
    assert decode.agent.stats().handshakes == 2


def test_it_stops_when_the_worker_closes(
    closing: list[Rank], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ahead, "FIRST_RETRY_S", 0.05)
    (decode,) = _decode(1)
    closing.append(decode)
    nobody = PeerAddress(host="127.0.0.1", port=free_base_port())
    connecting = ConnectAhead(decode.agent, [nobody])
    connecting.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    connecting.stop()
    assert connecting.done(0) and time.monotonic() - t0 < 5
    assert connecting.connected == {}


def test_a_peer_it_can_never_connect_to_is_given_up_by_name(
    closing: list[Rank], caplog: pytest.LogCaptureFixture
) -> None:
    ranks = _decode(2)
    closing += ranks
    decode = ranks[0]
    bad = PeerAddress(host="127.0.0.1", port=30000, tp_size=3)  # cannot split 4 heads
    connecting = ConnectAhead(decode.agent, [bad])
    with caplog.at_level(logging.ERROR, logger="kvxfer.adapters.vllm"):
        connecting.start()
        assert connecting.done(5)
    assert "connect_ahead 127.0.0.1:30000 (tp_size 3): giving up: tp_size=3" in caplog.text
    assert decode.agent.stats().handshakes == 0


def test_nothing_to_connect_starts_no_thread(closing: list[Rank]) -> None:
    (decode,) = _decode(1)
    closing.append(decode)
    connecting = ConnectAhead(decode.agent, [])
    connecting.start()
    assert connecting.done(0)
    connecting.stop()


def _prefill_tp1(port: int, host: str) -> Rank:
    rank = make_rank(
        f"prefill-{host}",
        Role.PRODUCER,
        HeadLayout(num_kv_heads=HEADS, tp_size=1),
        0,
        port,
        seed=5,
        direction=Direction.PULL,
        timeout_s=1.0,
        host=host,
    )
    rank.agent.serve()
    return rank


def _until(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_name_connects_each_instance_it_resolves_to_as_they_come_and_go(
    closing: list[Rank], caplog: pytest.LogCaptureFixture
) -> None:
    (decode,) = _decode(1)
    closing.append(decode)
    a, b = "127.0.0.1", "127.0.0.2"
    port = free_base_port(hosts=(a, b))
    closing.append(_prefill_tp1(port, a))
    pods = [a]  # what the headless Service's name resolves to now
    asked: list[tuple[str, int]] = []

    def resolve(host: str, at: int) -> list[str]:
        asked.append((host, at))
        return list(pods)

    # refresh_s below the config's 1 s floor: the thread takes any positive pace.
    service = PeerAddress(host="prefill.ns.svc", port=port, refresh_s=0.05)
    connecting = ConnectAhead(decode.agent, [service], resolve=resolve)
    with caplog.at_level(logging.INFO, logger="kvxfer.adapters.vllm"):
        connecting.start()
        assert _until(lambda: connecting.connected == {(a, port): [port]})
        assert decode.agent.stats().handshakes == 1
        # A second pod joins behind the name: connected by its address, once.
        closing.append(_prefill_tp1(port, b))
        pods.append(b)
        assert _until(lambda: connecting.connected == {(a, port): [port], (b, port): [port]})
        # Several more resolutions (waited for, not slept on: each connect's warm-up
        # holds the thread a while on a loaded host): nothing is connected twice.
        seen = len(asked)
        assert _until(lambda: len(asked) >= seen + 3)
        assert decode.agent.stats().handshakes == 2
        # The first pod leaves the name: forgotten, the other stays connected.
        pods.remove(a)
        assert _until(lambda: connecting.connected == {(b, port): [port]})
        assert not connecting.done(0)  # a name is resolved until the worker stops
    connecting.stop()
    assert connecting.done(0)
    assert set(asked) == {("prefill.ns.svc", port)} and len(asked) >= 5
    # Tickets name the pod's address: the request finds the handshake done.
    decode.agent.connect(b, port)
    assert decode.agent.stats().handshakes == 2
    assert f"prefill.ns.svc:{port} resolves to new instance(s) ['{b}']" in caplog.text
    assert f"prefill.ns.svc:{port} no longer resolves to ['{a}']" in caplog.text
    assert f"(found under prefill.ns.svc:{port})" in caplog.text


def test_a_name_that_resolves_to_nothing_yet_is_resolved_again(
    closing: list[Rank], caplog: pytest.LogCaptureFixture
) -> None:
    (decode,) = _decode(1)
    closing.append(decode)
    port = free_base_port()
    closing.append(_prefill_tp1(port, "127.0.0.1"))
    tries: list[int] = []

    def resolve(host: str, at: int) -> list[str]:
        tries.append(at)
        if len(tries) == 1:  # what getaddrinfo raises for a name IDNA cannot encode
            raise UnicodeError("label empty or too long")
        if len(tries) < 4:  # no ready pod behind the Service yet
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return ["127.0.0.1"]

    service = PeerAddress(host="prefill.ns.svc", port=port, refresh_s=0.05)
    connecting = ConnectAhead(decode.agent, [service], resolve=resolve)
    with caplog.at_level(logging.INFO, logger="kvxfer.adapters.vllm"):
        connecting.start()
        assert _until(lambda: connecting.connected == {("127.0.0.1", port): [port]})
    connecting.stop()
    said = f"connect_ahead prefill.ns.svc:{port} resolves to nothing yet"
    assert caplog.text.count(said) == 1  # once per streak, not per try


def test_the_resolver_gives_each_address_once() -> None:
    assert resolve_addresses("127.0.0.1", 5600) == ["127.0.0.1"]
    with pytest.raises(ValueError):  # what the thread counts as resolving to nothing
        resolve_addresses("bad..name", 5600)
    local = resolve_addresses("localhost", 5600)
    assert local and set(local) <= {"127.0.0.1", "::1"} and len(set(local)) == len(local)


def test_an_address_also_listed_by_itself_stays_when_the_name_loses_it(
    closing: list[Rank], caplog: pytest.LogCaptureFixture
) -> None:
    (decode,) = _decode(1)
    closing.append(decode)
    port = free_base_port()
    closing.append(_prefill_tp1(port, "127.0.0.1"))
    pods = ["127.0.0.1"]
    listed = PeerAddress(host="127.0.0.1", port=port)
    service = PeerAddress(host="prefill.ns.svc", port=port, refresh_s=0.05)
    connecting = ConnectAhead(decode.agent, [listed, service], resolve=lambda h, p: list(pods))
    with caplog.at_level(logging.INFO, logger="kvxfer.adapters.vllm"):
        connecting.start()
        assert _until(lambda: connecting.connected == {("127.0.0.1", port): [port]})
        pods.clear()  # the name no longer lists it; the static entry still does
        assert _until(lambda: "no longer resolves to ['127.0.0.1']" in caplog.text)
        time.sleep(0.2)
    connecting.stop()
    assert connecting.connected == {("127.0.0.1", port): [port]}
    assert decode.agent.stats().handshakes == 1
    assert "(found under" not in caplog.text  # connected as listed, not as found
