"""kvxfer.core.handshake: the sans-I/O handshake (R-HS-1/3/5/6, R-COMPAT-3/4)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvxfer._version import PROTOCOL_VERSION
from kvxfer.core import wire
from kvxfer.core.descriptors import PlanOptions
from kvxfer.core.handshake import Initiator, PeerInfo, Responder, roles_pair
from kvxfer.core.layout import KVLayout, Region
from kvxfer.core.wire import RejectCode
from kvxfer.errors import (
    AuthError,
    CompatError,
    HandshakeError,
    HandshakeRejected,
    LayoutMismatch,
    LeaseError,
    PeerError,
    PlanError,
    ProtocolVersionError,
    WireError,
)
from kvxfer.types import Direction, Role

HASH = "a" * 64
SECRET = "correct horse battery staple"


def make_layout(block_size: int = 16, base: int = 1 << 20, block_len: int = 4096) -> KVLayout:
    return KVLayout(
        block_size=block_size,
        regions=(Region(base=base, num_blocks=8, stride=4096, block_len=block_len),),
    )


class Clock:
    """A settable time source shared by both sides."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Producer:
    """What an agent gives its Responder: a Welcome once memory is registered."""

    def __init__(self, role: Role = Role.PRODUCER, direction: Direction = Direction.PULL) -> None:
        self.ready = True
        self.fail = False
        self.welcome = wire.Welcome(
            engine_id="prefill-0",
            incarnation=7,
            role=role,
            direction=direction,
            layout=make_layout(base=1 << 30),
            agent_name="prefill-0#7",
            agent_metadata=b"\x00nixl-metadata\xff",
            rails=("mlx5_0", "mlx5_1"),
            options=PlanOptions(chunk_mode=True, chunk_tokens=512),
            lease_s=12.5,
        )

    def __call__(self) -> wire.Welcome | None:
        if self.fail:
            raise RuntimeError("backend exploded")
        return self.welcome if self.ready else None


def responder(producer: Producer | None = None, **kwargs: Any) -> Responder:
    options: dict[str, Any] = {
        "engine_id": "prefill-0",
        "incarnation": 7,
        "compat_hash": HASH,
        "local_info": producer or Producer(),
    }
    options.update(kwargs)
    return Responder(**options)


def hello(**overrides: Any) -> wire.Hello:
    fields: dict[str, Any] = {
        "engine_id": "decode-0",
        "expected_engine_id": "prefill-0",
        "incarnation": 3,
        "role": Role.CONSUMER,
        "direction": Direction.PULL,
        "layout": make_layout(),
    }
    fields.update(overrides)
    return wire.Hello(**fields)


def initiator(message: wire.Hello | None = None, **kwargs: Any) -> Initiator:
    options: dict[str, Any] = {
        "hello": message or hello(),
        "compat_hash": HASH,
        "address": "10.0.0.1:5600",
    }
    options.update(kwargs)
    return Initiator(**options)


def reply_of(data: bytes) -> wire.Message:
    return wire.decode(data).message


def rejection(data: bytes) -> wire.Reject:
    message = reply_of(data)
    assert isinstance(message, wire.Reject), message
    return message


# -- the happy path -------------------------------------------------------------------


def test_handshake_returns_the_peer() -> None:
    producer = Producer()
    r, i = responder(producer), initiator()
    info = i.receive(r.respond(i.hello()))
    w = producer.welcome
    assert info == PeerInfo(
        engine_id="prefill-0",
        incarnation=7,
        role=Role.PRODUCER,
        direction=Direction.PULL,
        layout=w.layout,
        agent_name=w.agent_name,
        agent_metadata=w.agent_metadata,
        rails=w.rails,
        options=w.options,
        lease_s=12.5,
        compat_hash=HASH,
        address="10.0.0.1:5600",
    )
    assert r.accepted == 1 and not r.rejected


def test_layouts_at_other_addresses_pair() -> None:
    r = responder()
    i = initiator(hello(layout=make_layout(base=1 << 40)))
    assert i.receive(r.respond(i.hello())).engine_id == "prefill-0"


def test_metadata_is_read_for_every_hello() -> None:
    # Deferred registration changes the agent metadata after the listener started.
    producer = Producer()
    r = responder(producer)
    producer.welcome = msgspec.structs.replace(producer.welcome, agent_metadata=b"v2")
    i = initiator()
    assert i.receive(r.respond(i.hello())).agent_metadata == b"v2"


# -- each check, in order -------------------------------------------------------------


def test_compat_mismatch_rejected_with_both_hashes() -> None:
    r, i = responder(), initiator(compat_hash="b" * 64)
    with pytest.raises(HandshakeRejected) as info:
        i.receive(r.respond(i.hello()))
    assert info.value.code == "compat"
    assert HASH in info.value.reason and "b" * 64 in info.value.reason
    assert "10.0.0.1:5600" in str(info.value)
    assert r.rejected[RejectCode.COMPAT] == 1


def test_compat_check_skipped_when_not_enforced(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvxfer.core.handshake"):
        r = responder(enforce_compat=False)
        assert "skips the compatibility hash check" in caplog.text
        i = initiator(compat_hash="b" * 64, enforce_compat=False)
        for _ in range(3):
            assert i.receive(r.respond(i.hello())).compat_hash == HASH
    assert caplog.text.count("accepted because enforce_handshake_compat is false") == 4  # 1 + 3


def test_initiator_checks_the_hash_too() -> None:
    # A responder that does not enforce still answers; an enforcing initiator refuses.
    r, i = responder(enforce_compat=False), initiator(compat_hash="b" * 64)
    with pytest.raises(CompatError, match=re.escape("prefill-0 at 10.0.0.1:5600")):
        i.receive(r.respond(i.hello()))


def test_wrong_expected_engine_id_rejected() -> None:
    r, i = responder(), initiator(hello(expected_engine_id="prefill-9"))
    with pytest.raises(HandshakeRejected) as info:
        i.receive(r.respond(i.hello()))
    assert info.value.code == "engine_id" and "prefill-9" in info.value.reason


def test_initiator_names_expected_and_actual_engine() -> None:
    r = responder()
    i = initiator(hello(expected_engine_id=None), expected_engine_id="prefill-9")
    with pytest.raises(PeerError) as info:
        i.receive(r.respond(i.hello()))
    assert str(info.value) == "expected engine id prefill-9, peer at 10.0.0.1:5600 is prefill-0"


def test_any_engine_accepted_without_expectation() -> None:
    r, i = responder(), initiator(hello(expected_engine_id=None))
    assert i.receive(r.respond(i.hello())).engine_id == "prefill-0"


def test_block_size_mismatch_rejected() -> None:
    # 24 and 16: neither divides the other (whole multiples pull unit by unit,
    # tests/test_block_ratio.py).
    r, i = responder(), initiator(hello(layout=make_layout(block_size=24, block_len=3072)))
    with pytest.raises(HandshakeRejected) as info:
        i.receive(r.respond(i.hello()))
    assert info.value.code == "layout" and "block_size" in info.value.reason


def test_layout_checked_even_when_compat_is_not() -> None:
    r = responder(enforce_compat=False)
    i = initiator(hello(layout=make_layout(block_size=32)), compat_hash="b" * 64)
    with pytest.raises(HandshakeRejected, match="layout"):
        i.receive(r.respond(i.hello()))


def test_initiator_checks_the_layout_too() -> None:
    # Against a responder that let another layout through (another implementation).
    producer = Producer()
    producer.welcome = msgspec.structs.replace(
        producer.welcome, layout=make_layout(block_size=24, block_len=3072)
    )
    i = initiator()
    i.hello()
    welcome = wire.encode(producer.welcome, HASH)
    with pytest.raises(LayoutMismatch) as info:
        i.receive(welcome)
    assert info.value.field.startswith("block_size (one block size must be a whole multiple")


@pytest.mark.parametrize(
    ("mine", "theirs", "direction"),
    [
        (Role.CONSUMER, Role.CONSUMER, Direction.PULL),
        (Role.PRODUCER, Role.PRODUCER, Direction.PULL),
        (Role.CONSUMER, Role.PRODUCER, Direction.PUSH),
    ],
)
def test_roles_that_cannot_pair_rejected(mine: Role, theirs: Role, direction: Direction) -> None:
    r = responder(Producer(role=theirs, direction=direction))
    i = initiator(hello(role=mine, direction=direction))
    with pytest.raises(HandshakeRejected) as info:
        i.receive(r.respond(i.hello()))
    assert info.value.code == "role"


def test_pull_and_push_never_pair_even_without_compat() -> None:
    r = responder(Producer(direction=Direction.PUSH, role=Role.BOTH), enforce_compat=False)
    i = initiator(hello(direction=Direction.PULL))
    with pytest.raises(HandshakeRejected, match="never pair"):
        i.receive(r.respond(i.hello()))


def test_roles_pair_table() -> None:
    pull, push = Direction.PULL, Direction.PUSH
    assert roles_pair(Role.CONSUMER, Role.PRODUCER, pull)
    assert roles_pair(Role.PRODUCER, Role.CONSUMER, push)
    assert all(roles_pair(Role.BOTH, Role.BOTH, d) for d in (pull, push))
    assert not roles_pair(Role.PRODUCER, Role.PRODUCER, pull)
    assert not roles_pair(Role.CONSUMER, Role.BOTH, push)


def test_initiator_refuses_a_welcome_that_cannot_pair() -> None:
    producer = Producer(role=Role.CONSUMER)
    i = initiator()
    i.hello()
    with pytest.raises(PeerError, match="cannot pair"):
        i.receive(wire.encode(producer.welcome, HASH))


def test_protocol_version_mismatch_both_ways() -> None:
    r = responder()
    body = msgspec.Raw(msgspec.msgpack.encode(hello()))
    future = msgspec.msgpack.encode([wire.MAGIC, PROTOCOL_VERSION + 1, HASH, body, None])
    assert rejection(r.respond(future)).code is RejectCode.VERSION
    i = initiator()
    i.hello()
    with pytest.raises(ProtocolVersionError) as info:
        i.receive(future)
    assert "10.0.0.1:5600" in str(info.value) and f"version {PROTOCOL_VERSION + 1}" in str(
        info.value
    )


# -- readiness, failures, other messages -----------------------------------------------


def test_not_registered_yet_is_retryable() -> None:
    producer = Producer()
    producer.ready = False
    r, i = responder(producer), initiator()
    with pytest.raises(HandshakeRejected) as info:
        i.receive(r.respond(i.hello()))
    assert info.value.code == "not_ready"
    producer.ready = True
    assert i.receive(r.respond(i.hello())).engine_id == "prefill-0"


def test_a_failing_provider_is_internal_and_the_listener_survives(
    caplog: pytest.LogCaptureFixture,
) -> None:
    producer = Producer()
    producer.fail = True
    r, i = responder(producer), initiator()
    with caplog.at_level(logging.ERROR, logger="kvxfer.core.handshake"):
        assert rejection(r.respond(i.hello())).code is RejectCode.INTERNAL
    assert "backend exploded" in caplog.text
    producer.fail = False
    assert i.receive(r.respond(i.hello())).engine_id == "prefill-0"


def test_ping_is_answered_whatever_the_hash() -> None:
    producer = Producer()
    r, i = responder(producer), initiator(compat_hash="z")
    pong = i.reply(r.respond(i.ping()))
    assert isinstance(pong, wire.Pong)
    assert (pong.engine_id, pong.compat_hash, pong.protocol_version) == (
        "prefill-0",
        HASH,
        PROTOCOL_VERSION,
    )
    assert pong.layout == producer.welcome.layout and pong.layout_summary.startswith(
        "block_size=16"
    )
    producer.ready = False
    pong = i.reply(r.respond(i.ping()))
    assert isinstance(pong, wire.Pong) and pong.role is None and pong.layout is None


def test_a_ping_naming_a_request_is_answered_by_the_hold_hook() -> None:
    cap = wire.new_capability()
    asked: list[tuple[str, str]] = []

    def hold_state(request_id: str, capability: str) -> tuple[wire.HoldState, str]:
        asked.append((request_id, capability))
        if wire.capability_matches(cap, capability):
            return wire.HoldState.PUSHED, "every write completed"
        return wire.HoldState.UNKNOWN, ""

    r, i = responder(hold_state=hold_state), initiator()
    pong = i.reply(r.respond(i.ping("req-1", cap)))
    assert isinstance(pong, wire.Pong)
    assert (pong.hold, pong.hold_reason) == (wire.HoldState.PUSHED, "every write completed")
    stranger = i.reply(r.respond(i.ping("req-1", wire.new_capability())))
    assert isinstance(stranger, wire.Pong) and stranger.hold is wire.HoldState.UNKNOWN
    plain = i.reply(r.respond(i.ping()))  # a liveness probe: the hook is not asked
    assert isinstance(plain, wire.Pong) and plain.hold is None
    assert [a[0] for a in asked] == ["req-1", "req-1"]
    # a responder without the hook (or of an earlier build) leaves the answer unset
    pong = i.reply(responder().respond(i.ping("req-1", cap)))
    assert isinstance(pong, wire.Pong) and pong.hold is None


def test_messages_a_listener_never_takes() -> None:
    r = responder()
    for message in (Producer().welcome, wire.Ack(), wire.Reject(code=RejectCode.AUTH)):
        assert rejection(r.respond(wire.encode(message, HASH))).code is RejectCode.MALFORMED


def push_register(**overrides: Any) -> wire.PushRegister:
    fields: dict[str, Any] = {
        "request_id": "req-1",
        "engine_id": "decode-0",
        "incarnation": 3,
        "block_ids": ((4, 5, 6),),
        "num_tokens": 40,
    }
    fields.update(overrides)
    return wire.PushRegister(**fields)


def test_hook_handles_push_register_and_release() -> None:
    seen: list[wire.Message] = []

    def hook(message: wire.Message) -> wire.Message | None:
        seen.append(message)
        if isinstance(message, wire.Release) and message.request_id == "missing":
            raise LeaseError("no lease for missing")
        if isinstance(message, wire.Release) and message.request_id == "bad":
            raise PlanError("block counts differ")
        if isinstance(message, wire.Release) and message.request_id == "bug":
            raise ZeroDivisionError
        if isinstance(message, wire.Release) and message.request_id == "ignored":
            return None
        return wire.Ack(request_id=getattr(message, "request_id", ""))

    r = responder(on_message=hook)
    assert reply_of(r.respond(wire.encode(push_register(), HASH))) == wire.Ack(request_id="req-1")
    assert seen == [push_register()]
    codes = {
        rid: rejection(r.respond(wire.encode(wire.Release(request_id=rid), HASH))).code
        for rid in ("missing", "bad", "bug", "ignored")
    }
    assert codes == {
        "missing": RejectCode.UNKNOWN_REQUEST,
        "bad": RejectCode.INVALID,
        "bug": RejectCode.INTERNAL,
        "ignored": RejectCode.MALFORMED,
    }
    # The hook only sees compatible peers.
    other = wire.encode(wire.Release(request_id="r"), "other")
    assert rejection(r.respond(other)).code is RejectCode.COMPAT
    assert len(seen) == 5
    # A Reject the hook returns counts as a rejection too.
    refuse = responder(on_message=lambda m: wire.Reject(code=RejectCode.INVALID, reason="no"))
    assert rejection(refuse.respond(wire.encode(push_register(), HASH))).reason == "no"
    assert refuse.accepted == 0 and refuse.rejected == {RejectCode.INVALID: 1}
    assert r.accepted == 1 and sum(r.rejected.values()) == 5


def test_without_a_hook_push_register_is_refused() -> None:
    assert (
        rejection(responder().respond(wire.encode(push_register(), HASH))).code
        is RejectCode.MALFORMED
    )


def test_too_large() -> None:
    r = responder(max_bytes=256)
    big = wire.encode(hello(rails=("x" * 100,) * 5), HASH)
    reject = rejection(r.respond(big))
    assert reject.code is RejectCode.TOO_LARGE and "256-byte limit" in reject.reason
    assert rejection(r.too_large(10_000)).code is RejectCode.TOO_LARGE


def test_non_bytes_input_is_malformed() -> None:
    r = responder()
    for data in (None, "text", 42, memoryview(b"x" * 10)):
        assert rejection(r.respond(data)).code is RejectCode.MALFORMED  # type: ignore[arg-type]
    big = memoryview(wire.encode(hello(), HASH))
    assert rejection(responder(max_bytes=8).respond(big)).code is RejectCode.TOO_LARGE  # type: ignore[arg-type]


def test_reply_before_hello_is_an_error() -> None:
    with pytest.raises(HandshakeError):
        initiator().receive(b"")


def test_garbage_reply_is_a_wire_error() -> None:
    i = initiator()
    i.hello()
    with pytest.raises(WireError, match=re.escape("10.0.0.1:5600")):
        i.receive(b"\x00garbage")
    with pytest.raises(WireError, match="answered a hello with Ack"):
        i.receive(wire.encode(wire.Ack(), HASH))


# -- logging ---------------------------------------------------------------------------


def test_hostile_input_gets_a_log_line_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    r = responder(clock=clock)
    with caplog.at_level(logging.WARNING, logger="kvxfer.core.handshake"):
        for n in range(50):
            assert rejection(r.respond(b"junk%d" % n)).code is RejectCode.MALFORMED
        lines = [rec for rec in caplog.records if "rejected a frame" in rec.getMessage()]
        assert len(lines) == 20  # a burst, then silence
        clock.now += 61
        r.respond(b"junk")
    assert "30 more rejections not logged" in caplog.text
    assert r.rejected[RejectCode.MALFORMED] == 51


def test_unauthenticated_side_channel_is_warned_once_per_process() -> None:
    # A fresh process: the warning is once per process, whatever earlier tests did here.
    code = (
        "import logging, sys; logging.basicConfig(stream=sys.stdout, level=logging.WARNING)\n"
        "from tests.test_handshake import SECRET, initiator, responder\n"
        "for _ in range(3):\n"
        "    r = responder(); i = initiator(); i.receive(r.respond(i.hello()))\n"
        "responder(auth_secret=SECRET)\n"
    )
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("unauthenticated") == 1, run.stdout


# -- authentication (R-HS-6) -----------------------------------------------------------


def test_authenticated_handshake() -> None:
    clock = Clock()
    r = responder(auth_secret=SECRET, clock=clock)
    i = initiator(auth_secret=SECRET, clock=clock)
    assert i.receive(r.respond(i.hello())).engine_id == "prefill-0"
    assert isinstance(i.reply(r.respond(i.ping())), wire.Pong)


@pytest.mark.parametrize("secret", [None, "another secret of enough length"])
def test_wrong_or_missing_secret_is_refused(secret: str | None) -> None:
    r = responder(auth_secret=SECRET)
    i = initiator(auth_secret=secret)
    with pytest.raises(HandshakeRejected) as info:
        i.receive(r.respond(i.hello()))
    assert info.value.code == "auth"


def test_replayed_and_stale_hellos_are_refused() -> None:
    clock = Clock()
    r = responder(auth_secret=SECRET, clock=clock)
    i = initiator(auth_secret=SECRET, clock=clock)
    frame = i.hello()
    assert isinstance(reply_of(r.respond(frame)), wire.Welcome)
    assert "replayed" in rejection(r.respond(frame)).reason
    clock.now += 31
    assert "sync clocks" in rejection(r.respond(frame)).reason
    assert isinstance(reply_of(r.respond(i.hello())), wire.Welcome)


def test_initiator_authenticates_the_responder() -> None:
    clock = Clock()
    i = initiator(auth_secret=SECRET, clock=clock)
    impostor = responder(auth_secret="an impostor's different secret", clock=clock)
    with pytest.raises(HandshakeRejected, match="auth"):
        # The impostor cannot check our hello; it refuses (unsigned refusals pass).
        i.receive(impostor.respond(i.hello()))
    i.hello()
    with pytest.raises(AuthError, match=re.escape("10.0.0.1:5600")):
        i.receive(wire.encode(Producer().welcome, HASH))  # unsigned welcome
    forged = wire.encode(Producer().welcome, HASH, auth_key=b"x" * 32, now=clock.now)
    with pytest.raises(AuthError, match="MAC"):
        i.receive(forged)


def test_a_reply_must_answer_our_request() -> None:
    clock = Clock()
    r = responder(auth_secret=SECRET, clock=clock)
    alice = initiator(auth_secret=SECRET, clock=clock)
    bob = initiator(auth_secret=SECRET, clock=clock)
    bob.hello()
    answer_to_alice = r.respond(alice.hello())
    with pytest.raises(AuthError, match="answers no request of ours"):
        bob.receive(answer_to_alice)
    alice.receive(answer_to_alice)
    with pytest.raises(AuthError):
        alice.receive(answer_to_alice)  # a reply is good once


def test_short_secret_refused() -> None:
    with pytest.raises(AuthError, match="16 bytes"):
        responder(auth_secret="short")
    with pytest.raises(AuthError, match="16 bytes"):
        initiator(auth_secret=b"short")


# -- the lifecycle as a state machine --------------------------------------------------


class HandshakeLifecycle(RuleBasedStateMachine):
    """Good, bad and hostile peers interleaved against one responder.

    The responder must never raise, must answer every frame with a decodable reply,
    must keep accepting good peers, and its counters must add up.
    """

    @initialize(secret=st.booleans(), enforce=st.booleans())
    def start(self, secret: bool, enforce: bool) -> None:
        self.clock = Clock()
        self.producer = Producer()
        self.secret = SECRET if secret else None
        self.enforce = enforce
        self.responder = responder(
            self.producer, auth_secret=self.secret, enforce_compat=enforce, clock=self.clock
        )
        self.answered = 0
        self.old_hello: bytes | None = None

    def respond(self, data: bytes) -> wire.Message:
        reply = self.responder.respond(data)
        self.answered += 1
        return wire.decode(reply).message

    def initiator(self, message: wire.Hello | None = None, **kwargs: Any) -> Initiator:
        kwargs.setdefault("auth_secret", self.secret)
        return initiator(message, clock=self.clock, **kwargs)

    @rule()
    def good_peer(self) -> None:
        i = self.initiator()
        frame = i.hello()
        reply = self.responder.respond(frame)
        self.answered += 1
        if self.producer.ready:
            assert i.receive(reply).engine_id == "prefill-0"
            self.old_hello = frame
        else:
            with pytest.raises(HandshakeRejected, match="not_ready"):
                i.receive(reply)

    @rule(other_hash=st.sampled_from(["b" * 64, "", "x"]))
    def incompatible_peer(self, other_hash: str) -> None:
        i = self.initiator(compat_hash=other_hash, enforce_compat=self.enforce)
        reply = self.responder.respond(i.hello())
        self.answered += 1
        if self.enforce:
            with pytest.raises(HandshakeRejected, match="compat"):
                i.receive(reply)
        elif self.producer.ready:
            assert i.receive(reply).compat_hash == HASH

    @rule(expected=st.sampled_from(["prefill-1", "decode-0"]))
    def wrong_engine(self, expected: str) -> None:
        i = self.initiator(hello(expected_engine_id=expected))
        with pytest.raises(HandshakeRejected, match="engine_id"):
            i.receive(self.responder.respond(i.hello()))
        self.answered += 1

    @rule(block_size=st.sampled_from([1, 8, 32, 1024]))
    def wrong_layout(self, block_size: int) -> None:
        i = self.initiator(hello(layout=make_layout(block_size=block_size)))
        reply = self.responder.respond(i.hello())
        self.answered += 1
        with pytest.raises(HandshakeRejected, match=r"layout|not_ready"):
            i.receive(reply)

    @rule(data=st.binary(max_size=300))
    def garbage(self, data: bytes) -> None:
        assert isinstance(self.respond(data), wire.Reject)

    @rule(data=st.data())
    def mutated_hello(self, data: st.DataObject) -> None:
        frame = bytearray(self.initiator().hello())
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, len(frame) - 1))
            frame[at] = data.draw(st.integers(0, 255))
        assert isinstance(self.respond(bytes(frame)), wire.Welcome | wire.Reject)

    @rule()
    def oversize(self) -> None:
        reply = self.respond(b"\x00" * (self.responder.max_bytes + 1))
        assert isinstance(reply, wire.Reject) and reply.code is RejectCode.TOO_LARGE

    @rule()
    def ping(self) -> None:
        i = self.initiator(compat_hash="whatever")
        reply = self.responder.respond(i.ping())
        self.answered += 1
        assert isinstance(i.reply(reply), wire.Pong)

    @precondition(lambda self: self.old_hello is not None)
    @rule()
    def replay(self) -> None:
        assert self.old_hello is not None
        reply = self.respond(self.old_hello)
        if self.secret is not None:
            assert isinstance(reply, wire.Reject) and reply.code is RejectCode.AUTH
        else:
            assert isinstance(reply, wire.Welcome | wire.Reject)

    @rule()
    def toggle_registration(self) -> None:
        self.producer.ready = not self.producer.ready

    @rule(seconds=st.sampled_from([0.5, 10.0, 45.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds

    @invariant()
    def counters_add_up(self) -> None:
        r = self.responder
        assert r.accepted + sum(r.rejected.values()) == self.answered

    @invariant()
    def still_serves_good_peers(self) -> None:
        if self.producer.ready:
            i = self.initiator()
            assert i.receive(self.responder.respond(i.hello())).engine_id == "prefill-0"
            self.answered += 1


# Inherits the loaded profile (derandomized under ci); fewer, longer runs than a
# plain property test since each example is a whole sequence of steps.
HandshakeLifecycle.TestCase.settings = settings(max_examples=200, stateful_step_count=40)
TestHandshakeLifecycle = HandshakeLifecycle.TestCase
