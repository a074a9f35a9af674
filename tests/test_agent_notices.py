"""Backend notifications are side effects (DONE frees held blocks, PUSHED settles a
transfer): with a shared secret only notices signed by it count."""

from __future__ import annotations

import itertools
import logging
import time

import msgspec
import numpy as np
import pytest

from kvxfer import wire
from kvxfer.agent import Agent, AgentConfig
from kvxfer.backend import BackendOptions
from kvxfer.compat import Fingerprint
from kvxfer.config import Direction, Role
from kvxfer.descriptors import DescriptorTable
from kvxfer.testing.fake_backend import FakeBackend
from kvxfer.testing.kvcache import HostKVCache, ModelShape

SHAPE = ModelShape(name="sm", layers=1, kv_heads=1, head_dim=8)
FP = Fingerprint(
    model="m",
    dtype="bfloat16",
    kv_cache_dtype="auto",
    attention_backend="t",
    direction=Direction.PULL,
)
SECRET = "notice-test-secret-0123456789"
_names = itertools.count()


def _producer(secret: str | None) -> tuple[Agent, FakeBackend, HostKVCache]:
    cache = HostKVCache(SHAPE, 16, 8, fill_seed=3)
    backend = FakeBackend(BackendOptions(agent_name=f"p-{next(_names)}"))
    agent = Agent(
        AgentConfig(engine_id="prefill-n", fingerprint=FP, role=Role.PRODUCER, auth_secret=secret),
        backend=backend,
    )
    agent.register(cache.layout())
    return agent, backend, cache


def _intruder(producer: FakeBackend, cache: HostKVCache) -> tuple[FakeBackend, object]:
    """Another endpoint of the fabric that can notify the producer."""
    be = FakeBackend(BackendOptions(agent_name=f"x-{next(_names)}"))
    be.register(cache.layout())
    peer = be.add_peer(producer.metadata(), DescriptorTable.build(cache.layout()))
    return be, peer


def _done(request_id: str, key: bytes | None) -> bytes:
    notice = wire.Notice(
        kind=wire.NoticeKind.DONE, request_id=request_id, engine_id="decode-x", incarnation=1
    )
    return wire.encode(notice, FP.digest(), auth_key=key)


@pytest.mark.parametrize(
    ("secret", "signed_with", "frees"),
    [
        (SECRET, None, False),  # unsigned: refused
        (SECRET, b"another-secret-0123456789", False),  # signed by someone else
        (SECRET, SECRET.encode(), True),
        (None, None, True),  # no secret configured: nothing to check
    ],
    ids=["unsigned", "wrong-key", "signed", "open"],
)
def test_only_notices_signed_with_the_secret_free_blocks(
    secret: str | None, signed_with: bytes | None, frees: bool, caplog: pytest.LogCaptureFixture
) -> None:
    agent, backend, cache = _producer(secret)
    intruder, peer = _intruder(backend, cache)
    try:
        agent.hold("req-1", np.array([1, 2]), 20)
        with caplog.at_level(logging.WARNING, logger="kvxfer.agent"):
            intruder.notify(peer, _done("req-1", signed_with))  # type: ignore[arg-type]
            deadline = time.monotonic() + 1.0
            freed: list[str] = []
            while time.monotonic() < deadline and not freed:
                freed += agent.freed()
                time.sleep(0.01)
        assert (freed == ["req-1"]) is frees
        assert ("req-1" in agent.holding()) is not frees
        if not frees:
            assert any("ignored a notification" in m for m in caplog.messages)
    finally:
        intruder.close()
        agent.close()


def test_malformed_notifications_are_ignored(caplog: pytest.LogCaptureFixture) -> None:
    agent, backend, cache = _producer(None)
    intruder, peer = _intruder(backend, cache)
    try:
        agent.hold("req-2", np.array([3]), 5)
        ack = msgspec.msgpack.encode({"not": "a frame"})
        with caplog.at_level(logging.WARNING, logger="kvxfer.agent"):
            intruder.notify(peer, ack)  # type: ignore[arg-type]
            intruder.notify(peer, wire.encode(wire.Ack(), FP.digest()))  # type: ignore[arg-type]
            time.sleep(0.1)
            assert agent.freed() == []
        assert agent.holding() == ["req-2"]
        assert sum("ignored a notification" in m for m in caplog.messages) == 2
    finally:
        intruder.close()
        agent.close()
