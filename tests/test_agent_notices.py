"""Backend notifications are side effects (DONE frees held blocks, PUSHED settles a
transfer): with a shared secret only notices signed by it count."""

from __future__ import annotations

import itertools
import logging
import time

import msgspec
import numpy as np
import pytest

from kvxfer.agent import Agent, AgentConfig
from kvxfer.backend import BackendOptions
from kvxfer.core import wire
from kvxfer.core.compat import Fingerprint
from kvxfer.core.descriptors import DescriptorTable
from kvxfer.errors import TransferError
from kvxfer.testing.fake_backend import FakeBackend
from kvxfer.testing.kvcache import HostKVCache, ModelShape
from kvxfer.transfer import FailureKind, ReceptionState, Transfer, TransferState
from kvxfer.types import Direction, Role
from tests.test_agent_concurrency import _stub

SHAPE = ModelShape(name="sm", layers=1, kv_heads=1, head_dim=8)
FP = Fingerprint(
    model="m",
    dtype="bfloat16",
    kv_cache_dtype="bfloat16",
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


def _done(request_id: str, key: bytes | None, capability: str = "") -> bytes:
    notice = wire.Notice(
        kind=wire.NoticeKind.DONE,
        request_id=request_id,
        engine_id="decode-x",
        incarnation=1,
        capability=capability,  # the hold's token: without it nothing is freed (issue 16)
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
        ticket = agent.hold("req-1", np.array([1, 2]), 20)
        with caplog.at_level(logging.WARNING, logger="kvxfer.agent"):
            done = _done("req-1", signed_with, ticket.capability)
            intruder.notify(peer, done)  # type: ignore[arg-type]
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


# -- the final PUSHED notice, announced in the registration's reply -------------------
PUSH_FP = msgspec.structs.replace(FP, direction=Direction.PUSH)


def _push_agent(
    role: Role,
    secret: str | None,
    cache: HostKVCache,
    extra: dict[str, str] | None = None,
    **kw: float,
) -> Agent:
    name = f"{role.value}-{next(_names)}"
    agent = Agent(
        AgentConfig(
            engine_id=name,
            fingerprint=PUSH_FP,
            role=role,
            direction=Direction.PUSH,
            auth_secret=secret,
            **kw,  # type: ignore[arg-type]
        ),
        backend=FakeBackend(BackendOptions(agent_name=name, extra=extra or {})),
    )
    agent.register(cache.layout())
    agent.serve()
    return agent


def _register(prod: Agent, cons: Agent, rid: str, dst: list[int], tokens: int) -> Transfer:
    transfer = cons.expect_push(_stub(prod, rid), dst, num_tokens=tokens)
    deadline = time.monotonic() + 10
    while rid not in prod.holding() or transfer.meta.reception.notice_bytes is None:
        assert time.monotonic() < deadline, "no registration reply announcing the notice"
        assert not transfer.done, transfer.error
        time.sleep(0.002)
    return transfer


@pytest.mark.parametrize(
    ("secret", "stale"),
    [(None, False), (SECRET, False), (SECRET, True)],
    ids=["open", "signed", "signed-stale"],
)
def test_the_announced_final_notice_settles_a_push_without_decoding(
    secret: str | None, stale: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The producer's registration reply carries the final notice's exact bytes; the
    # consumer checks them there, once, so the notice that ends the write is known by
    # its bytes and settles the transfer without a decode (or a MAC check) on the path.
    # Past the time a producer sends announced bytes (stale) they are decoded and
    # checked on arrival like any other notice.
    prod_cache = HostKVCache(SHAPE, 16, 8, fill_seed=5)
    cons_cache = HostKVCache(SHAPE, 16, 8)
    prod = _push_agent(Role.PRODUCER, secret, prod_cache)
    cons = _push_agent(Role.CONSUMER, secret, cons_cache)
    decoded: list[bytes] = []
    real_decode = wire.decode_notice

    def counting(data: bytes, **kw: object) -> wire.Notice:
        decoded.append(bytes(data))
        return real_decode(data, **kw)  # type: ignore[arg-type]

    try:
        src, dst, tokens = [1, 2, 3], [5, 6, 7], 3 * 16 - 4
        transfer = _register(prod, cons, "announced", dst, tokens)
        announced = transfer.meta.reception.notice_bytes
        assert announced is not None
        receptions = cons._receptions
        if stale:
            with cons._lock:
                receptions.final_notices[announced] = (receptions.final_notices[announced][0], 0.0)
        monkeypatch.setattr(wire, "decode_notice", counting)
        prod.hold("announced", src, tokens)
        transfer.wait(10)
        assert transfer.state is TransferState.DONE
        assert cons_cache.mismatches(dst, src, 5) == 0
        assert decoded == ([announced] if stale else [])  # else: known by its bytes
        assert receptions.final_notices == {}
    finally:
        cons.close()
        prod.close()


@pytest.mark.parametrize("outlive", [True, False], ids=["tcp-like", "ends-with-process"])
def test_the_registration_reply_announces_the_producers_stall_limit(outlive: bool) -> None:
    # How long the producer's kernel may go on sending a WRITE of a producer that died
    # (its connections' user timeout, its transfer_timeout_s): the consumer waits that
    # long after an outage before it settles a reception whose producer it finds gone
    # (kvxfer._agent.liveness). A transport whose writes end with the process (the
    # fake fabric's default) announces none: nothing is waited for.
    prod = _push_agent(
        Role.PRODUCER,
        None,
        HostKVCache(SHAPE, 16, 8, fill_seed=5),
        extra={"writes_outlive_process": str(outlive)},
        transfer_timeout_s=7.5,
    )
    cons = _push_agent(Role.CONSUMER, None, HostKVCache(SHAPE, 16, 8), transfer_timeout_s=3.0)
    try:
        transfer = _register(prod, cons, "req-stall", [4, 5], 32)
        assert transfer.meta.reception is not None
        assert transfer.meta.reception.producer_stall_s == (7.5 if outlive else 0.0)
    finally:
        cons.close()
        prod.close()


def test_an_announced_notice_that_does_not_qualify_is_not_learned() -> None:
    # Only the one notice that settles the transfer alone is learned: final, PUSHED,
    # this request, every expected block, and (with a secret) signed by it. Anything
    # else leaves the real notice to be decoded and checked when it arrives.
    cache = HostKVCache(SHAPE, 16, 8)  # referenced: the agent registers its memory
    cons = _push_agent(Role.CONSUMER, SECRET, cache)
    key = SECRET.encode()

    def notice(key: bytes | None = key, **kw: object) -> bytes:
        fields: dict[str, object] = dict(
            kind=wire.NoticeKind.PUSHED,
            request_id="q",
            engine_id="prefill-x",
            incarnation=1,
            block_ids=((5, 6),),
        )
        fields.update(kw)
        return wire.encode(wire.Notice(**fields), PUSH_FP.digest(), auth_key=key)  # type: ignore[arg-type]

    try:
        runtime, receptions = cons._runtime, cons._receptions
        transfer = runtime.new_transfer("q", ((5, 6),))  # expected, not yet registered
        transfer.meta.reception = ReceptionState()
        receptions.expect(transfer)
        for bad in (
            notice(key=b"another-secret-0123456789"),
            notice(key=None),
            notice(request_id="other"),
            notice(final=False),
            notice(block_ids=((5,),)),
            notice(kind=wire.NoticeKind.DONE),
            b"\x00 not a frame",
        ):
            receptions.learn_final_notice(transfer, bad)
            assert receptions.final_notices == {}, bad
        good = notice()
        receptions.learn_final_notice(transfer, good)
        assert list(receptions.final_notices) == [good]
        # Once the transfer is settled another way (here: failed), the entry goes too.
        runtime.fail(transfer, FailureKind.ABORTED, TransferError("gone"))
        assert receptions.final_notices == {}
    finally:
        cons.close()
