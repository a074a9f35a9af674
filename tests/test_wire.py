"""kvxfer.core.wire: framing, two-phase decode, bounds, evolution, auth, and fuzzing (R-HS-1/5)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer._version import PROTOCOL_VERSION
from kvxfer.core import wire
from kvxfer.core.descriptors import PlanOptions
from kvxfer.core.layout import KVLayout, Region
from kvxfer.errors import (
    AuthError,
    CompatError,
    HandshakeRejected,
    ProtocolVersionError,
    WireError,
)
from kvxfer.testing import strategies as kst
from kvxfer.types import Direction, Role

HASH = "c" * 64
KEY = b"k" * 32
LAYOUT = KVLayout(
    block_size=16, regions=(Region(base=4096, num_blocks=4, stride=2048, block_len=2048),)
)


def raw_frame(body: Any, *, version: int = PROTOCOL_VERSION, magic: bytes = wire.MAGIC) -> bytes:
    """A frame around an arbitrary (possibly hostile) body object."""
    raw = msgspec.Raw(msgspec.msgpack.encode(body))
    return msgspec.msgpack.encode([magic, version, HASH, raw, None])


# -- strategies -------------------------------------------------------------------------

names = st.text(min_size=1, max_size=24)
short = st.text(max_size=24)
incarnations = st.integers(0, 2**63 - 1)
counts = st.integers(0, 2**63 - 1)
roles = st.sampled_from(Role)
directions = st.sampled_from(Direction)
rails = st.lists(short, max_size=4).map(tuple)
block_ids = st.lists(st.lists(counts, max_size=6).map(tuple), max_size=3).map(tuple)
capabilities = st.just("") | st.builds(wire.new_capability)
guards = st.none() | st.builds(
    wire.GuardTable,
    base=counts,
    slots=st.integers(1, 1 << 20),
    slot_bytes=st.integers(8, 64),
    sink=st.none() | counts,
)
small_layouts = kst.layouts(max_layers=2)
options = st.builds(PlanOptions, swa_window_mode=st.booleans(), coalesce=st.booleans()) | st.builds(
    PlanOptions, chunk_mode=st.just(True), chunk_tokens=st.integers(1, 4096)
)

messages: st.SearchStrategy[wire.Message] = st.one_of(
    st.builds(
        wire.Hello,
        engine_id=names,
        expected_engine_id=st.none() | names,
        incarnation=incarnations,
        role=roles,
        direction=directions,
        layout=small_layouts,
        rails=rails,
    ),
    st.builds(
        wire.Welcome,
        engine_id=names,
        incarnation=incarnations,
        role=roles,
        direction=directions,
        layout=small_layouts,
        agent_name=short,
        agent_metadata=st.binary(max_size=64),
        rails=rails,
        options=options,
        lease_s=st.floats(0, 1e6),
        guard=guards,
    ),
    st.builds(wire.Reject, code=st.sampled_from(wire.RejectCode), reason=short),
    st.builds(
        wire.PushRegister,
        request_id=names,
        engine_id=names,
        incarnation=incarnations,
        block_ids=block_ids,
        num_tokens=counts,
        agent_name=short,
        host=short,
        port=st.integers(0, 65535),
        capability=capabilities,
    ),
    st.builds(
        wire.Release, request_id=names, reason=short, engine_id=short, capability=capabilities
    ),
    st.builds(wire.Ack, request_id=short, notice=st.binary(max_size=64)),
    st.builds(wire.Ping, engine_id=short, request_id=short, capability=capabilities),
    st.builds(
        wire.Pong,
        engine_id=names,
        incarnation=incarnations,
        role=st.none() | roles,
        direction=st.none() | directions,
        protocol_version=st.integers(0, 100),
        compat_hash=st.text(max_size=64),
        layout_summary=short,
        layout=st.none() | small_layouts,
        hold=st.none() | st.sampled_from(wire.HoldState),
        hold_reason=short,
    ),
    st.builds(
        wire.Notice,
        kind=st.sampled_from(wire.NoticeKind),
        request_id=names,
        engine_id=names,
        incarnation=incarnations,
        reason=short,
        block_ids=block_ids,
        final=st.booleans(),
        capability=capabilities,
    ),
)


# -- round trips --------------------------------------------------------------------------


@given(messages, st.text(max_size=64))
def test_every_message_round_trips(message: wire.Message, compat_hash: str) -> None:
    frame = wire.decode(wire.encode(message, compat_hash))
    assert frame.message == message
    assert type(frame.message) is type(message)
    assert (frame.version, frame.compat_hash, frame.auth) == (PROTOCOL_VERSION, compat_hash, None)


def test_bytearray_and_memoryview_decode() -> None:
    data = wire.encode(wire.Ping(engine_id="x"), HASH)
    assert wire.decode(bytearray(data)).message == wire.Ping(engine_id="x")
    assert wire.decode(memoryview(data)).message == wire.Ping(engine_id="x")


def test_the_tag_names_the_type() -> None:
    body = msgspec.msgpack.decode(msgspec.msgpack.encode(wire.Ack(request_id="r")))
    assert body == {"type": "ack", "request_id": "r", "notice": b"", "stall_limit_s": 0.0}


def test_an_ack_without_a_stall_limit_reads_as_none_and_a_negative_one_is_refused() -> None:
    # An older producer's reply to a registration has no stall_limit_s: 0, "none".
    old = msgspec.msgpack.encode({"type": "ack", "request_id": "r", "notice": b""})
    assert msgspec.msgpack.decode(old, type=wire.Ack).stall_limit_s == 0.0
    bad = msgspec.msgpack.encode({"type": "ack", "stall_limit_s": -1.0})
    with pytest.raises(msgspec.ValidationError, match="stall_limit_s"):
        msgspec.msgpack.decode(bad, type=wire.Ack)


# -- two-phase decode, version, magic -------------------------------------------------


def test_version_mismatch_names_both_versions() -> None:
    # A future version may change everything after (magic, version); phase 1 still reads it.
    data = msgspec.msgpack.encode([wire.MAGIC, PROTOCOL_VERSION + 1, {"new": "envelope"}])
    with pytest.raises(ProtocolVersionError) as info:
        wire.decode(data)
    message = str(info.value)
    assert f"version {PROTOCOL_VERSION + 1}" in message
    assert f"version {PROTOCOL_VERSION}" in message


def test_bad_magic_is_not_a_version_error() -> None:
    with pytest.raises(WireError) as info:
        wire.decode(raw_frame({"type": "ping"}, magic=b"ZMQ!", version=99))
    assert not isinstance(info.value, ProtocolVersionError)
    assert "magic" in str(info.value)


def test_newer_peer_extra_fields_and_envelope_elements_are_ignored() -> None:
    # Append-only evolution: a newer build adds defaulted fields and envelope elements.
    body = msgspec.Raw(msgspec.msgpack.encode({"type": "ack", "request_id": "r", "new": [1]}))
    data = msgspec.msgpack.encode([wire.MAGIC, PROTOCOL_VERSION, HASH, body, None, "future"])
    assert wire.decode(data).message == wire.Ack(request_id="r")


def test_older_peer_missing_defaulted_fields_decode() -> None:
    frame = wire.decode(raw_frame({"type": "release", "request_id": "r"}))
    assert frame.message == wire.Release(request_id="r", reason="", engine_id="", capability="")
    ping = wire.decode(raw_frame({"type": "ping", "engine_id": "x"})).message
    assert ping == wire.Ping(engine_id="x", request_id="", capability="")


# -- capabilities (issue 16) ---------------------------------------------------------------


def test_capabilities_are_fresh_hex_of_fixed_size() -> None:
    made = {wire.new_capability() for _ in range(64)}
    assert len(made) == 64
    assert all(len(c) == 2 * wire.CAPABILITY_BYTES and int(c, 16) >= 0 for c in made)


def test_capability_matches_only_the_same_nonempty_token() -> None:
    cap = wire.new_capability()
    assert wire.capability_matches(cap, cap)
    assert not wire.capability_matches(cap, "")
    assert not wire.capability_matches(cap, wire.new_capability())
    assert not wire.capability_matches("", "")  # no token proves nothing


@pytest.mark.parametrize(
    "capability",
    ["A" * 32, "zz", "0" * (4 * wire.CAPABILITY_BYTES + 1), "ab cd"],
    ids=["upper", "not-hex", "too-long", "space"],
)
@pytest.mark.parametrize("tag", ["release", "ping", "notice", "push_register"])
def test_hostile_capabilities_are_wire_errors(capability: str, tag: str) -> None:
    bodies: dict[str, dict[str, Any]] = {
        "release": {"request_id": "r"},
        "ping": {},
        "notice": {"kind": "done", "request_id": "r", "engine_id": "e", "incarnation": 1},
        "push_register": {
            "request_id": "r",
            "engine_id": "e",
            "incarnation": 1,
            "block_ids": [[1]],
            "num_tokens": 16,
        },
    }
    with pytest.raises(WireError, match="capability"):
        wire.decode(raw_frame({"type": tag, **bodies[tag], "capability": capability}))


def test_a_pong_answers_about_one_hold() -> None:
    pong = wire.Pong(
        engine_id="p",
        incarnation=7,
        protocol_version=PROTOCOL_VERSION,
        compat_hash=HASH,
        hold=wire.HoldState.RELEASED,
        hold_reason="released: done",
    )
    message = wire.decode(wire.encode(pong, HASH)).message
    assert isinstance(message, wire.Pong)
    assert message.hold is wire.HoldState.RELEASED and message.hold_reason == "released: done"


def test_guard_table_bounds() -> None:
    for bad in (
        {"base": 0, "slots": 0},
        {"base": -1, "slots": 1},
        {"base": 0, "slots": 1 << 21},
        {"base": 0, "slots": 1, "sink": -8},
    ):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, wire.GuardTable)


# -- bounds and hostile values ----------------------------------------------------------


def test_oversize_is_rejected_before_parsing() -> None:
    # Garbage that would fail to parse: the size error proves nothing was parsed.
    with pytest.raises(WireError, match="exceeds the 1024-byte limit"):
        wire.decode(b"\xc1" * 1025, max_bytes=1024)
    ok = wire.encode(wire.Ping(), HASH)
    assert wire.decode(ok, max_bytes=len(ok)).message == wire.Ping()
    with pytest.raises(WireError, match="exceeds"):
        wire.decode(ok, max_bytes=len(ok) - 1)


@pytest.mark.parametrize("data", [None, "text", 12, ["list"]])
def test_non_bytes_rejected(data: Any) -> None:
    with pytest.raises(WireError):
        wire.decode(data)


@pytest.mark.parametrize(
    "body",
    [
        {"type": "warp", "engine_id": "x"},  # unknown tag
        {"engine_id": "x"},  # no tag
        {"type": "release", "request_id": ""},  # empty id
        {"type": "release", "request_id": "r" * 2000},  # too long
        {"type": "reject", "code": "nope"},  # unknown enum value
        {"type": "ack", "request_id": 5},  # wrong type
        {"type": "notice", "kind": "done", "request_id": "r", "engine_id": "e", "incarnation": -1},
        {
            "type": "push_register",
            "request_id": "r",
            "engine_id": "e",
            "incarnation": 1,
            "block_ids": [[1, -2]],  # negative block id
            "num_tokens": 3,
        },
        {
            "type": "push_register",
            "request_id": "r",
            "engine_id": "e",
            "incarnation": 1,
            "block_ids": [[1]],
            "num_tokens": 3,
            "port": 70000,
        },
        {"type": "welcome", "lease_s": float("nan")},
        ["type", "ping"],
        None,
    ],
)
def test_hostile_bodies_raise_wire_error(body: Any) -> None:
    with pytest.raises(WireError):
        wire.decode(raw_frame(body))


def test_invalid_layout_inside_a_hello_is_a_wire_error() -> None:
    # KVLayout validates in __post_init__; on the wire that must surface as WireError.
    hello = msgspec.to_builtins(
        wire.Hello(
            engine_id="e",
            incarnation=1,
            role=Role.CONSUMER,
            direction=Direction.PULL,
            layout=LAYOUT,
        )
    )
    hello["layout"]["regions"][0]["stride"] = 1  # below block_len
    with pytest.raises(WireError, match="stride"):
        wire.decode(raw_frame(hello))
    hello["layout"]["regions"] = []
    with pytest.raises(WireError):
        wire.decode(raw_frame(hello))


def test_deep_nesting_is_a_wire_error() -> None:
    with pytest.raises(WireError):
        wire.decode(b"\x91" * 100_000 + b"\x00")
    envelope = msgspec.msgpack.encode([wire.MAGIC, PROTOCOL_VERSION, HASH])
    with pytest.raises(WireError):
        wire.decode(b"\x94" + envelope[1:] + b"\x91" * 100_000 + b"\x00")


# -- fuzzing: nothing but WireError ever escapes ------------------------------------------


def decode_or_wire_error(data: bytes) -> wire.Frame | None:
    try:
        frame = wire.decode(data)
    except WireError:
        return None
    # Whatever decodes is a well-formed message that encodes again.
    assert isinstance(frame.message, wire.WireMessage)
    wire.encode(frame.message, frame.compat_hash)
    return frame


@given(st.binary(max_size=512))
def test_random_bytes(data: bytes) -> None:
    decode_or_wire_error(data)


@given(st.binary(max_size=256))
def test_random_bytes_behind_a_valid_head(tail: bytes) -> None:
    head = msgspec.msgpack.encode([wire.MAGIC, PROTOCOL_VERSION])
    decode_or_wire_error(b"\x95" + head[1:] + tail)


@given(messages, st.data())
def test_mutated_frames(message: wire.Message, data: st.DataObject) -> None:
    frame = bytearray(wire.encode(message, HASH, auth_key=data.draw(st.sampled_from([None, KEY]))))
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "set", "delete", "insert"]))
        at = data.draw(st.integers(0, max(len(frame) - 1, 0)))
        if op == "flip" and frame:
            frame[at] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set" and frame:
            frame[at] = data.draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xDC, 0xDF, 0xFF]))
        elif op == "delete":
            del frame[at : at + data.draw(st.integers(1, 16))]
        else:
            frame[at:at] = data.draw(st.binary(min_size=1, max_size=16))
    decode_or_wire_error(bytes(frame))


@given(messages, st.data())
def test_every_truncation_is_a_wire_error(message: wire.Message, data: st.DataObject) -> None:
    frame = wire.encode(message, HASH)
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(WireError):
        wire.decode(frame[:cut])


# -- authentication ---------------------------------------------------------------------


def test_signed_frame_verifies() -> None:
    data = wire.encode(wire.Ping(engine_id="x"), HASH, auth_key=KEY, now=1000.0)
    frame = wire.decode(data)
    assert frame.auth is not None and len(frame.auth.nonce) == wire.NONCE_BYTES
    wire.verify(frame, KEY, now=1000.5)
    assert wire.request_nonce(data) == frame.auth.nonce


def test_unsigned_frame_fails_verification() -> None:
    with pytest.raises(AuthError, match="not authenticated"):
        wire.verify(wire.decode(wire.encode(wire.Ping(), HASH)), KEY, now=0.0)


def test_wrong_key_fails() -> None:
    frame = wire.decode(wire.encode(wire.Ping(), HASH, auth_key=KEY, now=5.0))
    with pytest.raises(AuthError, match="MAC"):
        wire.verify(frame, b"z" * 32, now=5.0)


def test_stale_frame_fails() -> None:
    frame = wire.decode(wire.encode(wire.Ping(), HASH, auth_key=KEY, now=5.0))
    wire.verify(frame, KEY, now=34.0, max_skew_s=30)
    with pytest.raises(AuthError, match="clocks"):
        wire.verify(frame, KEY, now=36.0, max_skew_s=30)


def test_tampering_with_any_covered_part_fails() -> None:
    data = wire.encode(wire.Release(request_id="r1"), HASH, auth_key=KEY, now=5.0)
    good = wire.decode(data)
    assert good.auth is not None
    forged_body = msgspec.msgpack.encode(wire.Release(request_id="r2"))
    tampered = [
        msgspec.structs.replace(good, body=forged_body),
        msgspec.structs.replace(good, compat_hash="d" * 64),
        msgspec.structs.replace(good, auth=msgspec.structs.replace(good.auth, ts_ms=6000)),
        msgspec.structs.replace(good, auth=msgspec.structs.replace(good.auth, nonce=b"n" * 16)),
    ]
    for frame in tampered:
        with pytest.raises(AuthError):
            wire.verify(frame, KEY, now=5.0)


def test_reply_binding() -> None:
    request = wire.encode(wire.Ping(), HASH, auth_key=KEY)
    nonce = wire.request_nonce(request)
    reply = wire.decode(wire.encode(wire.Ack(), HASH, auth_key=KEY, reply_to=nonce))
    wire.verify(reply, KEY, now=reply.auth.ts_ms / 1000 if reply.auth else 0, reply_to=nonce)
    with pytest.raises(AuthError, match="does not answer"):
        wire.verify(
            reply, KEY, now=reply.auth.ts_ms / 1000 if reply.auth else 0, reply_to=b"o" * 16
        )


# -- notices and acks -------------------------------------------------------------------


def test_notice_helpers() -> None:
    notice = wire.Notice(
        kind=wire.NoticeKind.PUSHED,
        request_id="r",
        engine_id="p",
        incarnation=3,
        block_ids=((1, 2),),
        final=False,
    )
    assert wire.decode_notice(wire.encode_notice(notice)) == notice
    signed = wire.encode_notice(notice, HASH, auth_key=KEY)
    assert wire.decode_notice(signed, auth_key=KEY) == notice
    with pytest.raises(AuthError):
        wire.decode_notice(wire.encode_notice(notice), auth_key=KEY)
    with pytest.raises(WireError, match="expected a notice, got ping"):
        wire.decode_notice(wire.encode(wire.Ping(), HASH))


def test_expect_ack() -> None:
    assert wire.expect_ack(wire.encode(wire.Ack(request_id="r"), HASH), HASH) == wire.Ack(
        request_id="r"
    )
    reject = wire.encode(wire.Reject(code=wire.RejectCode.UNKNOWN_REQUEST, reason="gone"), HASH)
    with pytest.raises(HandshakeRejected) as info:
        wire.expect_ack(reject, HASH)
    assert (info.value.code, info.value.reason) == ("unknown_request", "gone")
    with pytest.raises(WireError, match="expected an ack"):
        wire.expect_ack(wire.encode(wire.Ping(), HASH), HASH)
    with pytest.raises(CompatError):
        wire.expect_ack(wire.encode(wire.Ack(), "other"), HASH)
    wire.expect_ack(wire.encode(wire.Ack(), "other"), None)  # enforce_handshake_compat off


def test_expect_ack_with_auth_checks_the_binding() -> None:
    request = wire.encode(wire.Release(request_id="r"), HASH, auth_key=KEY)
    answer = wire.encode(wire.Ack(), HASH, auth_key=KEY, reply_to=wire.request_nonce(request))
    wire.expect_ack(answer, HASH, auth_key=KEY, request=request)
    other = wire.encode(wire.Release(request_id="r"), HASH, auth_key=KEY)
    with pytest.raises(AuthError):
        wire.expect_ack(answer, HASH, auth_key=KEY, request=other)
    with pytest.raises(AuthError):
        wire.expect_ack(wire.encode(wire.Ack(), HASH), HASH, auth_key=KEY)
