"""Side-channel messages, their framing and their authentication.

Every message is a frozen msgspec Struct in one tagged union (``type`` field), sent as
MessagePack inside an envelope::

    [magic, version, compat_hash, body, auth]

``magic`` and ``version`` are the envelope's first two elements in every protocol
version, forever: :func:`decode` reads them first (phase 1) so a peer speaking another
version gets a :class:`~kvxfer.errors.ProtocolVersionError` naming both versions, not
a schema error. Phase 2 decodes the body with one typed decoder built at import.

Evolution is append-only: a new field gets a default and older peers ignore it (unknown
fields are skipped, extra envelope elements too). A new message type, a new enum member
or a changed field type needs a ``PROTOCOL_VERSION`` bump, since an older decoder
rejects them, with one exception: a message type sent only to a peer whose handshake
announced, in an append-only field, that it takes it. No older decoder ever sees one,
so the version stays. The gather path's :class:`GatherRound` and :class:`GatherDone`
(and their answer :class:`GatherSlot`) are of that kind: a consumer sends them only to a
producer whose :attr:`Welcome.staging` is set, which a build without them never sets.

Authentication (optional, shared secret): ``auth`` holds a 16-byte nonce, a millisecond
timestamp, ``reply_to`` (the nonce of the request a reply answers) and an HMAC-SHA256
over all of them plus the version, the compat hash and the body's *exact bytes* as sent.
Hashing the received bytes, rather than a re-encoding, keeps the MAC valid when a newer
peer adds fields this build drops. :func:`verify` checks MAC, clock skew and binding;
replay of a still-fresh frame is refused by the responder's nonce cache
(:mod:`kvxfer.core.handshake`).

Capabilities (issue 16, R-SAFE-3): whatever frees or redirects a producer's hold
(:class:`Release`, a DONE/ABORT :class:`Notice`, a :class:`PushRegister` for a request
already registered) carries the hold's ``capability``, an unguessable token
(:func:`new_capability`) that travels with the ticket through the router and never
over the side channel in the other direction. Compare tokens with
:func:`capability_matches` (constant time). An empty capability is what a peer of an
earlier build sends; whether it is still accepted is the receiver's policy.
:class:`Ping` can also ask about one request (``request_id``): the :class:`Pong` then
says how the responder's hold of it stands (:class:`HoldState`), so a consumer whose
PUSHED notice was lost, or whose transfer went quiet, asks instead of waiting out its
timeout. See docs/RELIABILITY.md.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import secrets
import time
from typing import Annotated, Any, Final, TypeAlias

import msgspec
from msgspec import Meta

from kvxfer._version import PROTOCOL_VERSION
from kvxfer.core.descriptors import PlanOptions
from kvxfer.core.heads import TPRank
from kvxfer.core.layout import KVLayout, MemKind
from kvxfer.errors import (
    AuthError,
    CompatError,
    HandshakeRejected,
    ProtocolVersionError,
    WireError,
)
from kvxfer.types import MAX_ENGINE_ID_LEN, Direction, Role

__all__ = [
    "CAPABILITY_BYTES",
    "DEFAULT_MAX_BYTES",
    "MAGIC",
    "NONCE_BYTES",
    "Ack",
    "Auth",
    "Frame",
    "GatherDone",
    "GatherRound",
    "GatherSlot",
    "GuardTable",
    "Hello",
    "HoldState",
    "Message",
    "Notice",
    "NoticeKind",
    "Ping",
    "Pong",
    "PushRegister",
    "Reject",
    "RejectCode",
    "Release",
    "Renew",
    "RenewHold",
    "Renewed",
    "StagingInfo",
    "Welcome",
    "WireMessage",
    "capability_matches",
    "decode",
    "decode_notice",
    "encode",
    "encode_notice",
    "expect_ack",
    "new_capability",
    "request_nonce",
    "verify",
]

MAGIC: Final = b"KVXF"
#: Largest frame :func:`decode` parses; bigger input is refused before parsing.
DEFAULT_MAX_BYTES: Final = 16 * 1024 * 1024
NONCE_BYTES: Final = 16
#: Random bytes of a capability (it goes as twice as many lowercase hex digits).
CAPABILITY_BYTES: Final = 16
# Notices ride the data plane and may sit in a queue; be lenient with their age.
_NOTICE_SKEW_S: Final = 300.0
_MAX_INT64: Final = 2**63 - 1

# Bounds live in the types so hostile input fails inside msgspec, before our code runs.
EngineId = Annotated[str, Meta(min_length=1, max_length=MAX_ENGINE_ID_LEN)]
RequestId = Annotated[str, Meta(min_length=1, max_length=1024)]
Name = Annotated[str, Meta(max_length=256)]
Text = Annotated[str, Meta(max_length=4096)]
#: A process's life: a fresh random number at every start (``secrets.randbits(63)``).
Incarnation = Annotated[int, Meta(ge=0, le=_MAX_INT64)]
Count = Annotated[int, Meta(ge=0, le=_MAX_INT64)]
Seconds = Annotated[float, Meta(ge=0, le=1e9)]
#: A wall-clock time (``time.time()``), 0.0 for "none".
WallTime = Annotated[float, Meta(ge=0, le=1e11)]
CompatHash = Annotated[str, Meta(max_length=128)]
Rails = Annotated[tuple[Name, ...], Meta(max_length=256)]
#: Block ids per KV-cache group (one tuple per group).
BlockIds = Annotated[tuple[tuple[Count, ...], ...], Meta(max_length=64)]
#: A hold's capability as lowercase hex ("" from a peer of an earlier build). Bounded
#: here so that a table keyed by it cannot be grown by long tokens.
Capability = Annotated[str, Meta(max_length=4 * CAPABILITY_BYTES, pattern="^[0-9a-f]*$")]


class RejectCode(enum.Enum):
    """Why a responder refused a frame."""

    MALFORMED = "malformed"  # undecodable, or a message type a listener never takes
    VERSION = "version"  # another protocol version
    COMPAT = "compat"  # compatibility hashes differ
    ENGINE_ID = "engine_id"  # the hello expected another engine
    ROLE = "role"  # roles or directions that cannot pair
    LAYOUT = "layout"  # KV layouts differ
    AUTH = "auth"  # missing, wrong, stale or replayed authentication
    TOO_LARGE = "too_large"  # frame above the size bound
    NOT_READY = "not_ready"  # memory not registered yet; retry later
    UNKNOWN_REQUEST = "unknown_request"  # no lease / request of that id
    INVALID = "invalid"  # understood but refused (e.g. block counts do not match)
    INTERNAL = "internal"  # the responder failed; see its log


class NoticeKind(enum.Enum):
    """What a backend notification says about a request."""

    DONE = "done"  # consumer → producer: pulled; free the blocks
    ABORT = "abort"  # consumer → producer: will not pull; free the blocks
    PUSHED = "pushed"  # producer → consumer: these writes have landed
    FAILED = "failed"  # producer → consumer: the push failed; recompute
    WARM = "warm"  # the posting side → its peer: a connection's first notice; ignored


class HoldState(enum.Enum):
    """How a producer's hold of one request stands, as a :class:`Pong` reports it."""

    UNKNOWN = "unknown"  # no hold of that id, or the capability does not match
    HELD = "held"  # held: blocks untouched, no write in flight
    WRITING = "writing"  # push: a write is posted and has not completed
    PUSHED = "pushed"  # push: every write completed (the final PUSHED notice went out)
    FAILED = "failed"  # push: a write failed (the FAILED notice went out)
    RELEASED = "released"  # freed (done, released, aborted, expired): see hold_reason


class GuardTable(msgspec.Struct, frozen=True, kw_only=True):
    """A producer's guard table: one 64-bit generation word per slot, in memory its
    backend registered, that consumers read after their data (R-SAFE-1).

    The producer writes a fresh generation into a hold's slot at hold, and overwrites it
    before it hands the blocks back to its engine; a ticket names the slot and the
    generation, and a pull whose read-back word differs ends FAILED (seqlock style).
    """

    base: Count  # address of slot 0, as the backend's metadata addresses it
    slots: Annotated[int, Meta(ge=1, le=1 << 20)]
    slot_bytes: Annotated[int, Meta(ge=8, le=64)] = 8
    #: Address of one more registered word that any peer may WRITE and nobody reads: a
    #: push producer's warm-up writes there (issue 27). None from a backend without one
    #: or from a peer that predates it (the producer then warms up with a read).
    sink: Count | None = None


class WireMessage(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every side-channel message; the ``type`` tag picks the subclass."""


class Hello(WireMessage, frozen=True, kw_only=True, tag="hello"):
    """Initiator → responder: who I am, whom I expect, what my KV looks like."""

    engine_id: EngineId
    expected_engine_id: EngineId | None = None
    incarnation: Incarnation
    role: Role
    direction: Direction
    layout: KVLayout
    rails: Rails = ()
    #: Where the sender sits in its TP group (None: an earlier build, or no TP
    #: mapping wanted; layouts are then compared region by region).
    tp: TPRank | None = None


class StagingInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A producer's staging buffer for the gather path (issue 55): ``nbytes`` of
    registered memory at ``base`` (as the backend's metadata addresses it), cut into
    ``slots`` equal slots. Announced in :class:`Welcome`, outside the ``KVLayout``, so
    layouts compare as they did before; an older peer skips the field."""

    base: Count
    nbytes: Annotated[int, Meta(ge=1, le=_MAX_INT64)]
    slots: Annotated[int, Meta(ge=1, le=1 << 16)] = 1
    mem: MemKind = MemKind.DRAM


class Welcome(WireMessage, frozen=True, kw_only=True, tag="welcome"):
    """Responder → initiator: the handshake is accepted; how to reach my memory."""

    engine_id: EngineId
    incarnation: Incarnation
    role: Role
    direction: Direction
    layout: KVLayout
    agent_name: Name
    agent_metadata: Annotated[bytes, Meta(max_length=DEFAULT_MAX_BYTES)]
    rails: Rails = ()
    options: PlanOptions = msgspec.field(default_factory=PlanOptions)
    lease_s: Seconds = 30.0
    #: Fail-closed pulls: where this producer's hold generations live (None: a
    #: producer of an earlier build, or a backend that cannot expose one).
    guard: GuardTable | None = None
    #: Where the responder sits in its TP group (see Hello.tp).
    tp: TPRank | None = None
    #: The gather path's staging buffer (None: no staging, or an earlier build).
    staging: StagingInfo | None = None


class Reject(WireMessage, frozen=True, kw_only=True, tag="reject"):
    """Responder → initiator: refused, with a code a program checks and a reason to log."""

    code: RejectCode
    reason: Text = ""


class PushRegister(WireMessage, frozen=True, kw_only=True, tag="push_register"):
    """Consumer → producer (push): write request ``request_id``'s KV into these blocks.

    ``host``/``port`` are the consumer's side-channel address, so a producer that has not
    handshaken with it yet can (in push the producer initiates the handshake).

    ``capability`` binds the request to this consumer: the first registration of a
    request id binds its token (or the router minted one for both sides, and the
    producer's hold requires it); a later registration of the same id is accepted only
    with the same token, so a stranger cannot redirect the request's KV. The producer
    echoes it in its PUSHED/FAILED notices.
    """

    request_id: RequestId
    engine_id: EngineId
    incarnation: Incarnation
    block_ids: BlockIds
    num_tokens: Count
    agent_name: Name = ""
    host: Name = ""
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    capability: Capability = ""
    #: Across TP sizes: the producer rank this registration is for (echoed in its
    #: notices, so the consumer tells apart the writes of several producer ranks),
    #: and this consumer rank among the ``readers`` consumer ranks that receive from
    #: that producer rank (it frees its hold once it wrote to all of them).
    source: Count = 0
    readers: Count = 1
    reader: Count = 0


class Release(WireMessage, frozen=True, kw_only=True, tag="release"):
    """Consumer → producer: free request ``request_id``'s blocks now.

    ``capability``: the hold's token from the ticket; a producer frees a live hold only
    when it matches (a stranger's Release frees nothing). ``done``: the consumer pulled
    the blocks and checked their guard word (the DONE of a fail-closed pull, sent here
    rather than as a backend notification, which on UCX would make the consumer's next
    read on that endpoint wait for the producer's progress); an earlier build reads
    it as a plain Release.
    """

    request_id: RequestId
    reason: Text = ""
    engine_id: Name = ""
    capability: Capability = ""
    #: Across TP sizes: how many consumer ranks read this request from the receiver
    #: (it frees the request once it heard from all), and which one this is.
    readers: Count = 1
    reader: Count = 0
    done: bool = False


#: Holds one Renew may name (a consumer with more sends several).
MAX_RENEW: Final = 256


class RenewHold(msgspec.Struct, frozen=True, array_like=True):
    """One hold a :class:`Renew` asks to keep: its request id and capability."""

    request_id: RequestId
    capability: Capability = ""


class Renew(WireMessage, frozen=True, kw_only=True, tag="renew"):
    """Consumer → producer: these requests are still queued for a read; keep holding.

    A producer extends each hold it has, and whose capability matches, to ``lease_s``
    from now (never shortens one) and answers :class:`Renewed`. A consumer that stops
    renewing (it died, or read) lets the hold end at its expiry as before.
    """

    holds: Annotated[tuple[RenewHold, ...], Meta(max_length=MAX_RENEW)]
    engine_id: Name = ""


class Renewed(WireMessage, frozen=True, kw_only=True, tag="renewed"):
    """Producer → consumer: the answer to a :class:`Renew`, one entry per hold named.

    ``expiries[i]``: the wall-clock end of hold *i*'s lease now, or 0.0 when the
    producer has no such hold for that capability (freed, expired, never held).
    """

    expiries: Annotated[tuple[WallTime, ...], Meta(max_length=MAX_RENEW)] = ()


class Ack(WireMessage, frozen=True, kw_only=True, tag="ack"):
    """Responder → initiator: a non-handshake message was accepted."""

    request_id: Annotated[str, Meta(max_length=1024)] = ""
    #: Reply to a :class:`PushRegister` only: the final PUSHED notice the producer will
    #: send once every registered block is written, exactly as it will go on the wire
    #: (empty when it cannot say in advance). The consumer checks it once, here, and
    #: then knows it by its bytes: no decoding or MAC check on the transfer's path.
    notice: Annotated[bytes, Meta(max_length=DEFAULT_MAX_BYTES)] = b""
    #: Reply to a :class:`PushRegister` only: the producer's stall limit, how long its
    #: connections may hold unacknowledged bytes before its kernel ends them (its
    #: ``transfer_timeout_s``), also once its process died; 0 when it has none or its
    #: transport's writes end with its process (``Capabilities.writes_outlive_process``). A
    #: consumer that finds the producer gone waits this long (and a margin) before it
    #: reuses the blocks (kvxfer._agent.liveness).
    stall_limit_s: Annotated[float, Meta(ge=0)] = 0.0


class Ping(WireMessage, frozen=True, kw_only=True, tag="ping"):
    """Anyone → responder: who are you? (answered whatever the compat hash).

    Also the liveness probe of a transfer or handshake gone quiet (a Pong with the
    expected incarnation says the peer lives), and, with ``request_id``, the question
    "how does your hold of this request stand?" (answered in :attr:`Pong.hold`; the
    ``capability`` must match the hold's, or the answer is UNKNOWN).
    """

    engine_id: Name = ""
    request_id: Annotated[str, Meta(max_length=1024)] = ""
    capability: Capability = ""


class Pong(WireMessage, frozen=True, kw_only=True, tag="pong"):
    """Responder → pinger: identity, protocol, hash and layout, for probes and health.

    ``role``, ``direction`` and ``layout`` are None until the responder's memory is
    registered.
    """

    engine_id: EngineId
    incarnation: Incarnation
    role: Role | None = None
    direction: Direction | None = None
    protocol_version: int
    compat_hash: CompatHash
    layout_summary: Text = ""
    layout: KVLayout | None = None
    software_version: Name = ""
    #: The answer to a Ping that named a request (None: not asked, or a responder of
    #: an earlier build, which does not know the question).
    hold: HoldState | None = None
    hold_reason: Text = ""


class Notice(WireMessage, frozen=True, kw_only=True, tag="notice"):
    """A backend notification payload about one request.

    ``block_ids`` (per group, the receiver's block ids) say which writes a PUSHED notice
    covers; ``final`` is False on the partial notices of a streamed push, so the
    consumer settles only after the final notice and when no block is missing.
    """

    kind: NoticeKind
    request_id: RequestId
    engine_id: EngineId
    incarnation: Incarnation
    reason: Text = ""
    block_ids: BlockIds = ()
    final: bool = True
    #: DONE/ABORT: the hold's token (from the ticket); PUSHED/FAILED: the consumer's
    #: registration token, echoed. A receiver that requires one ignores a notice
    #: without the right token.
    capability: Capability = ""
    #: DONE/ABORT across TP sizes: how many consumer ranks read this request from the
    #: receiver (it frees the lease once it heard from all), and which one this is.
    readers: Count = 1
    reader: Count = 0
    #: PUSHED/FAILED across TP sizes: the registration's ``source`` (the producer rank
    #: that wrote), echoed.
    source: Count = 0


#: Pieces one gather round may name (a round of more pieces is cut by the consumer).
MAX_GATHER_PIECES: Final = 1 << 16
#: Bytes of one piece in :attr:`GatherRound.pieces` (three uint64).
GATHER_PIECE_BYTES: Final = 24


class GatherRound(WireMessage, frozen=True, kw_only=True, tag="gather_round"):
    """Consumer → producer (gather path, issue 55): gather these pieces of request
    ``request_id``'s hold into a staging slot. Sent only to a producer whose
    :attr:`Welcome.staging` is set (see the module docstring on evolution).

    ``capability``: the hold's token from the ticket; the producer gathers only pieces
    that lie wholly inside that hold's blocks (R-SAFE-3) and answers
    :class:`GatherSlot` (``busy`` when no slot is free: the consumer reads direct) or
    a :class:`Reject`.
    """

    request_id: RequestId
    capability: Capability = ""
    engine_id: Name = ""
    #: Per piece three little-endian uint64: the producer's address (as its metadata
    #: addresses it), the byte offset in the slot, the length (at least 1). Packed, not
    #: a list of structs: a scattered round names tens of thousands of pieces, which
    #: as structs cost milliseconds to build and decode on both ends.
    pieces: Annotated[bytes, Meta(max_length=MAX_GATHER_PIECES * GATHER_PIECE_BYTES)]


class GatherSlot(WireMessage, frozen=True, kw_only=True, tag="gather_slot"):
    """Producer → consumer: the answer to a :class:`GatherRound` (the round lies in
    staging slot ``slot`` at byte ``offset`` of the staging buffer, lent at
    ``generation``) or to a :class:`GatherDone` (that slot was still lent at that
    generation and the hold still stood: the bytes read are the hold's). ``busy``:
    every slot is lent; nothing was gathered."""

    request_id: RequestId
    slot: Count = 0
    offset: Count = 0
    generation: Count = 0
    busy: bool = False


class GatherDone(WireMessage, frozen=True, kw_only=True, tag="gather_done"):
    """Consumer → producer: the round in ``slot`` at ``generation`` was read (or is
    given up: ``failed``); release the slot. Answered :class:`GatherSlot` when the slot
    was still lent at that generation and the hold still stands, else :class:`Reject`:
    the consumer then scatters nothing."""

    request_id: RequestId
    capability: Capability = ""
    engine_id: Name = ""
    slot: Count
    generation: Count
    failed: bool = False


Message: TypeAlias = (
    Hello
    | Welcome
    | Reject
    | PushRegister
    | Release
    | Renew
    | Renewed
    | Ack
    | Ping
    | Pong
    | Notice
    | GatherRound
    | GatherSlot
    | GatherDone
)


class Auth(msgspec.Struct, frozen=True, array_like=True):
    """The authentication block of an envelope (see the module docstring)."""

    nonce: Annotated[bytes, Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
    ts_ms: Annotated[int, Meta(ge=0, le=_MAX_INT64)]
    mac: Annotated[bytes, Meta(min_length=32, max_length=32)]
    reply_to: Annotated[bytes, Meta(max_length=NONCE_BYTES)] = b""


class Frame(msgspec.Struct, frozen=True, kw_only=True):
    """A decoded frame.

    Attributes:
        version: The sender's protocol version (equal to ours once decoded).
        compat_hash: The sender's compatibility hash.
        message: The decoded message.
        auth: The authentication block, None when the sender had no secret.
        body: The body's bytes exactly as received (what the MAC covers).
    """

    version: int
    compat_hash: str
    message: Message
    auth: Auth | None = None
    body: bytes = b""


class _Head(msgspec.Struct, frozen=True, array_like=True):
    # Phase 1: the two elements every protocol version keeps in place.
    magic: bytes
    version: int


class _Envelope(msgspec.Struct, frozen=True, array_like=True):
    magic: bytes
    version: int
    compat_hash: CompatHash
    body: msgspec.Raw
    auth: Auth | None = None


_encoder = msgspec.msgpack.Encoder()
_head_decoder = msgspec.msgpack.Decoder(_Head)
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_body_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def encode(
    message: Message,
    compat_hash: str,
    *,
    auth_key: bytes | None = None,
    reply_to: bytes = b"",
    now: float | None = None,
) -> bytes:
    """Frame a message.

    Args:
        message: Any message of the union.
        compat_hash: The sender's compatibility hash (``Fingerprint.digest()``).
        auth_key: Shared secret; when given, the frame carries an :class:`Auth` block.
        reply_to: The nonce of the request this frame answers (replies only).
        now: Timestamp in seconds for the auth block; defaults to ``time.time()``.

    Returns:
        The frame's bytes.
    """
    body = _encoder.encode(message)
    auth = None
    if auth_key is not None:
        nonce = os.urandom(NONCE_BYTES)
        ts_ms = int((time.time() if now is None else now) * 1000)
        mac = _mac(auth_key, compat_hash, body, nonce, ts_ms, reply_to)
        auth = Auth(nonce=nonce, ts_ms=ts_ms, mac=mac, reply_to=reply_to)
    return _encoder.encode(_Envelope(MAGIC, PROTOCOL_VERSION, compat_hash, msgspec.Raw(body), auth))


def decode(data: Any, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Frame:
    """Decode a frame from untrusted bytes.

    Args:
        data: The received bytes (``bytes``, ``bytearray`` or ``memoryview``).
        max_bytes: Larger input is refused before any parsing.

    Returns:
        The decoded frame.

    Raises:
        ProtocolVersionError: A kvxfer frame of another protocol version.
        WireError: Anything else wrong with the input; no other exception escapes.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"frame must be bytes, not {type(data).__name__}")
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > max_bytes:
        raise WireError(f"frame of {size} bytes exceeds the {max_bytes}-byte limit")
    try:
        head = _head_decoder.decode(data)
    except Exception as exc:  # msgspec errors, or a non-contiguous memoryview
        raise WireError(f"not a kvxfer frame: {_brief(exc)}") from exc
    if head.magic != MAGIC:
        raise WireError("not a kvxfer frame: bad magic")
    if head.version != PROTOCOL_VERSION:
        raise ProtocolVersionError(
            f"peer speaks kvxfer protocol version {head.version}, this build speaks "
            f"version {PROTOCOL_VERSION}: run the same kvxfer protocol on both instances"
        )
    try:
        envelope = _envelope_decoder.decode(data)
        body = bytes(envelope.body)
        message = _body_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise WireError(f"invalid message: {_brief(exc)}") from exc
    except Exception as exc:
        # The trust boundary: whatever a nested struct's validation throws on hostile
        # input (msgspec only wraps ValueError/TypeError) must surface as a WireError.
        raise WireError(f"malformed frame: {_brief(exc)}") from exc
    return Frame(
        version=envelope.version,
        compat_hash=envelope.compat_hash,
        message=message,
        auth=envelope.auth,
        body=body,
    )


def verify(
    frame: Frame,
    key: bytes,
    *,
    now: float,
    max_skew_s: float = 30.0,
    reply_to: bytes | None = None,
) -> None:
    """Check a frame's authentication block.

    Args:
        frame: A frame from :func:`decode`.
        key: The shared secret.
        now: Current time in seconds (``time.time()``).
        max_skew_s: Largest accepted distance between the frame's timestamp and ``now``.
        reply_to: For replies, the nonce of the request sent; the frame must answer it.

    Raises:
        AuthError: No auth block, wrong MAC, stale timestamp or wrong binding.
    """
    auth = frame.auth
    if auth is None:
        raise AuthError("frame is not authenticated but this side channel requires it")
    expected = _mac(key, frame.compat_hash, frame.body, auth.nonce, auth.ts_ms, auth.reply_to)
    if not hmac.compare_digest(expected, auth.mac):
        raise AuthError("bad MAC: the peer uses another shared secret")
    skew = abs(now - auth.ts_ms / 1000)
    if skew > max_skew_s:
        raise AuthError(
            f"timestamp {skew:.1f}s away from ours (limit {max_skew_s:g}s); sync clocks"
        )
    if reply_to is not None and not hmac.compare_digest(auth.reply_to, reply_to):
        raise AuthError("reply does not answer our request (replayed or crossed)")


def encode_notice(notice: Notice, compat_hash: str = "", *, auth_key: bytes | None = None) -> bytes:
    """Frame a :class:`Notice` for a backend notification (see :func:`encode`)."""
    return encode(notice, compat_hash, auth_key=auth_key)


def decode_notice(
    data: Any, *, max_bytes: int = DEFAULT_MAX_BYTES, auth_key: bytes | None = None
) -> Notice:
    """Decode a backend notification payload that must be a :class:`Notice`.

    Raises:
        WireError: Malformed, or another message type.
        AuthError: ``auth_key`` given and the notice is not authenticated by it.
    """
    frame = decode(data, max_bytes=max_bytes)
    if not isinstance(frame.message, Notice):
        raise WireError(f"expected a notice, got {_tag(frame.message)}")
    if auth_key is not None:
        verify(frame, auth_key, now=time.time(), max_skew_s=_NOTICE_SKEW_S)
    return frame.message


def expect_ack(
    data: Any,
    compat_hash: str | None = None,
    *,
    auth_key: bytes | None = None,
    request: bytes | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Ack:
    """Decode the reply to a non-handshake request (``PushRegister``, ``Release``).

    Args:
        data: The reply's bytes.
        compat_hash: When given, the reply must carry it; pass None when
            ``enforce_handshake_compat`` is off.
        auth_key: Shared secret; the reply must be authenticated by it.
        request: The request frame that was sent; with ``auth_key`` the reply must
            answer that very request.
        max_bytes: Size bound of the reply.

    Raises:
        HandshakeRejected: The peer answered with a :class:`Reject`.
        CompatError: The reply carries another compatibility hash.
        AuthError: Authentication missing or wrong.
        WireError: Malformed, or neither ``Ack`` nor ``Reject``.
    """
    frame = decode(data, max_bytes=max_bytes)
    message = frame.message
    if isinstance(message, Reject):
        raise HandshakeRejected(message.code.value, message.reason)
    if not isinstance(message, Ack):
        raise WireError(f"expected an ack, got {_tag(message)}")
    if auth_key is not None:
        reply_to = None if request is None else request_nonce(request)
        verify(frame, auth_key, now=time.time(), reply_to=reply_to)
    if compat_hash is not None and frame.compat_hash != compat_hash:
        raise CompatError(f"peer's compatibility hash {frame.compat_hash} != ours {compat_hash}")
    return message


def request_nonce(data: bytes) -> bytes:
    """Return the auth nonce of a frame this process encoded (b"" when unsigned)."""
    try:
        auth = _envelope_decoder.decode(data).auth
    except msgspec.DecodeError as exc:
        raise WireError(f"not a kvxfer frame: {_brief(exc)}") from exc
    return b"" if auth is None else auth.nonce


def new_capability() -> str:
    """A fresh capability: :data:`CAPABILITY_BYTES` random bytes as lowercase hex."""
    return secrets.token_hex(CAPABILITY_BYTES)


def capability_matches(expected: str, given: str) -> bool:
    """Whether ``given`` is the capability ``expected`` (constant time; an empty
    ``expected`` matches nothing: a missing token never proves anything)."""
    return bool(expected) and hmac.compare_digest(expected.encode(), given.encode())


def _tag(message: WireMessage) -> str:
    return str(type(message).__struct_config__.tag)


def _mac(
    key: bytes, compat_hash: str, body: bytes, nonce: bytes, ts_ms: int, reply_to: bytes
) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    parts = (
        b"kvxfer-auth-v1",
        PROTOCOL_VERSION.to_bytes(4, "big"),
        compat_hash.encode(),
        body,
        nonce,
        ts_ms.to_bytes(8, "big"),
        reply_to,
    )
    for part in parts:
        # Length-prefixed so that no two different tuples hash the same byte string.
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.digest()


def _brief(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
