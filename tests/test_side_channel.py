"""A serving Agent's side channel under hostile input: every bad frame gets a clear
rejection, and the listener keeps answering the next good peer."""

from __future__ import annotations

import os
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvxfer._version import PROTOCOL_VERSION
from kvxfer.agent import Agent, AgentConfig
from kvxfer.core import wire
from kvxfer.core.compat import Fingerprint
from kvxfer.errors import CompatError, HandshakeRejected, LayoutMismatch, PeerError
from kvxfer.testing.kvcache import HostKVCache, ModelShape
from kvxfer.types import Direction, Role

SHAPE = ModelShape(name="t", layers=2, kv_heads=2, head_dim=32)
FP = Fingerprint(
    model="m",
    dtype="bfloat16",
    kv_cache_dtype="bfloat16",
    attention_backend="t",
    direction=Direction.PULL,
)


def _agent(engine_id: str, role: Role, cache: HostKVCache, **kw: object) -> Agent:
    cfg = AgentConfig(engine_id=engine_id, fingerprint=FP, role=role, **kw)  # type: ignore[arg-type]
    agent = Agent(cfg)
    agent.register(cache.layout())
    return agent


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Agent, HostKVCache]]:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    cache = HostKVCache(SHAPE, 16, 32, fill_seed=3)
    agent = _agent("prefill-h", Role.PRODUCER, cache, max_message_bytes=64 * 1024)
    agent.serve()
    yield agent, cache
    agent.close()


def _raw(port: int, payload: bytes, timeout_ms: int = 3000) -> bytes:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(payload)
        return bytes(sock.recv())
    finally:
        sock.close(0)


def _reject(reply: bytes) -> wire.Reject:
    msg = wire.decode(reply).message
    assert isinstance(msg, wire.Reject), msg
    return msg


def _good_handshake(server: tuple[Agent, HostKVCache]) -> None:
    agent, _ = server
    cache = HostKVCache(SHAPE, 16, 32)
    with _agent("decode-good", Role.CONSUMER, cache) as consumer:
        peer = consumer.connect("127.0.0.1", agent.address[1], "prefill-h")
        assert peer.engine_id == "prefill-h"
        assert peer.incarnation == agent.incarnation


def _hello(
    layout: object, engine: str = "decode-x", expected: str | None = "prefill-h"
) -> wire.Hello:
    return wire.Hello(
        engine_id=engine,
        expected_engine_id=expected,
        incarnation=1,
        role=Role.CONSUMER,
        direction=Direction.PULL,
        layout=layout,  # type: ignore[arg-type]
    )


def test_garbage_truncated_oversized_and_wrong_version(server: tuple[Agent, HostKVCache]) -> None:
    agent, cache = server
    port = agent.address[1]
    assert _reject(_raw(port, b"\x00garbage\xff" * 7)).code is wire.RejectCode.MALFORMED
    good = wire.encode(_hello(cache.layout()), agent.compat_hash)
    assert _reject(_raw(port, good[: len(good) // 2])).code is wire.RejectCode.MALFORMED
    assert _reject(_raw(port, b"x" * (100 * 1024))).code is wire.RejectCode.TOO_LARGE
    other_version = msgspec.msgpack.encode([wire.MAGIC, PROTOCOL_VERSION + 1, "h", b"", None])
    rej = _reject(_raw(port, other_version))
    assert rej.code is wire.RejectCode.VERSION
    assert str(PROTOCOL_VERSION + 1) in rej.reason
    _good_handshake(server)


def test_wrong_hash_engine_id_block_size_and_layout(server: tuple[Agent, HostKVCache]) -> None:
    agent, cache = server
    port = agent.address[1]
    hello = wire.encode(_hello(cache.layout()), "f" * 64)
    assert _reject(_raw(port, hello)).code is wire.RejectCode.COMPAT
    wrong_engine = wire.encode(_hello(cache.layout(), expected="prefill-other"), agent.compat_hash)
    rej = _reject(_raw(port, wrong_engine))
    assert rej.code is wire.RejectCode.ENGINE_ID and "prefill-other" in rej.reason
    bs24 = HostKVCache(SHAPE, 24, 8).layout()  # neither 24 nor 16 divides the other
    rej = _reject(_raw(port, wire.encode(_hello(bs24), agent.compat_hash)))
    assert rej.code is wire.RejectCode.LAYOUT and "block_size" in rej.reason
    fewer_layers = HostKVCache(ModelShape(name="t", layers=1, kv_heads=2, head_dim=32), 16, 8)
    rej = _reject(_raw(port, wire.encode(_hello(fewer_layers.layout()), agent.compat_hash)))
    assert rej.code is wire.RejectCode.LAYOUT
    _good_handshake(server)


def test_initiator_side_errors_are_specific(server: tuple[Agent, HostKVCache]) -> None:
    agent, _ = server
    port = agent.address[1]
    other_fp = msgspec.structs.replace(FP, model="other")
    cache = HostKVCache(SHAPE, 16, 32)
    with Agent(AgentConfig(engine_id="d1", fingerprint=other_fp, role=Role.CONSUMER)) as a:
        a.register(cache.layout())
        with pytest.raises((CompatError, HandshakeRejected)) as info:
            a.connect("127.0.0.1", port, "prefill-h")
        assert "compat" in str(info.value).lower()
    with _agent("d2", Role.CONSUMER, cache) as a:
        with pytest.raises((PeerError, HandshakeRejected)) as info2:
            a.connect("127.0.0.1", port, "prefill-someone-else")
        assert "prefill-someone-else" in str(info2.value)
    other_shape = HostKVCache(ModelShape(name="t", layers=2, kv_heads=4, head_dim=32), 16, 8)
    with (
        _agent("d3", Role.CONSUMER, other_shape) as a,
        pytest.raises((LayoutMismatch, HandshakeRejected)) as info3,
    ):
        a.connect("127.0.0.1", port, "prefill-h")
    # in the engine's terms, not in bytes
    assert "num_kv_heads" in str(info3.value) and "4" in str(info3.value), info3.value
    _good_handshake(server)


def test_enforce_handshake_compat_false_skips_only_the_hash(
    server: tuple[Agent, HostKVCache],
) -> None:
    agent, _ = server
    port = agent.address[1]
    other_fp = msgspec.structs.replace(FP, model="other")
    cache = HostKVCache(SHAPE, 16, 32)
    lax = AgentConfig(
        engine_id="d-lax", fingerprint=other_fp, role=Role.CONSUMER, enforce_handshake_compat=False
    )
    with Agent(lax) as a:
        a.register(cache.layout())
        # the responder still enforces its own hash: the initiator alone cannot skip it
        with pytest.raises(HandshakeRejected):
            a.connect("127.0.0.1", port, "prefill-h")
