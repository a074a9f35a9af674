"""The side-channel handshake as a sans-I/O state machine.

Nothing here touches a socket: the side channel (:mod:`kvxfer.io.control`) feeds bytes in
and sends the bytes that come out, so the whole protocol is testable without a network.

* :class:`Responder` answers every frame a listener receives. ``respond`` never raises:
  hostile or malformed input becomes a :class:`~kvxfer.core.wire.Reject` plus a
  (rate-limited) log line on ``kvxfer.core.handshake``, and the listener keeps serving.
* :class:`Initiator` builds a hello and turns the reply into a :class:`PeerInfo`, or
  into the most specific error.

Both sides check, in this order: protocol version, authentication (with a shared
secret), compatibility hash (unless ``enforce_handshake_compat`` is false, which is
logged), expected engine id, role and direction, KV layout.

Authentication: with a shared secret (at least 16 bytes) every frame carries a nonce,
a timestamp and an HMAC-SHA256 over its exact bytes (:mod:`kvxfer.core.wire`). The
responder refuses unsigned, wrongly signed, stale (more than ``max_skew_s`` away) and
replayed frames with code AUTH, and signs its replies bound to the request's nonce;
the initiator checks that binding, so an impostor without the secret can neither
connect nor answer. Rejections are accepted unsigned (a forged one only denies
service, which a man in the middle can do anyway).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Final

import msgspec

from kvxfer._version import PROTOCOL_VERSION, __version__
from kvxfer.core import wire
from kvxfer.core.compat import check_pair
from kvxfer.core.descriptors import PlanOptions
from kvxfer.core.heads import TPRank
from kvxfer.core.layout import KVLayout
from kvxfer.core.wire import Message, RejectCode
from kvxfer.errors import (
    AuthError,
    CompatError,
    HandshakeError,
    HandshakeRejected,
    KvxferError,
    LayoutError,
    LayoutMismatch,
    LeaseError,
    PeerError,
    ProtocolVersionError,
    WireError,
)
from kvxfer.types import Direction, Role

__all__ = [
    "MIN_SECRET_BYTES",
    "Identity",
    "Initiator",
    "PeerInfo",
    "Responder",
    "roles_pair",
]

log = logging.getLogger("kvxfer.core.handshake")

MIN_SECRET_BYTES: Final = 16
_REPLAY_CACHE: Final = 65536
# Unauthenticated side channels already warned about in this process: the warning is
# a deployment fact, said once, not once per agent (an engine may build many).
_UNAUTHENTICATED_WARNED: list[bool] = []
_PENDING: Final = 64

#: Handles a non-handshake message (PushRegister, Release); returns the reply, or None
#: when it does not take that message. LeaseError becomes UNKNOWN_REQUEST, another
#: KvxferError INVALID, anything else INTERNAL.
MessageHook = Callable[[Message], Message | None]
#: Answers a :class:`~kvxfer.core.wire.Ping` that names a request: ``(request_id,
#: capability) -> (state, reason)``. UNKNOWN when the capability does not match; None
#: when it cannot say at once (the pinger asks again later).
HoldHook = Callable[[str, str], tuple[wire.HoldState | None, str]]


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """What a :class:`~kvxfer.core.wire.Pong` says of its responder besides the constants:
    known without asking the transport, so a Ping never waits for it."""

    role: Role
    direction: Direction
    layout: KVLayout


class PeerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A peer as the handshake found it (the accepted :class:`~kvxfer.core.wire.Welcome`)."""

    engine_id: str
    incarnation: int
    role: Role
    direction: Direction
    layout: KVLayout
    agent_name: str
    agent_metadata: bytes
    rails: tuple[str, ...]
    options: PlanOptions
    lease_s: float
    compat_hash: str
    address: str = ""
    guard: wire.GuardTable | None = None
    tp: TPRank | None = None
    #: The gather path's staging buffer it announced (None: none, or an earlier build).
    staging: wire.StagingInfo | None = None


def roles_pair(initiator: Role, responder: Role, direction: Direction) -> bool:
    """Whether an initiator may handshake a responder for this direction.

    The initiator is the side that moves bytes: in pull the consumer READs from a
    producer, in push the producer WRITEs into a consumer. ``kv_both`` is either.
    """
    mover, holder = (
        (Role.CONSUMER, Role.PRODUCER)
        if direction is Direction.PULL
        else (Role.PRODUCER, Role.CONSUMER)
    )
    return initiator in (mover, Role.BOTH) and responder in (holder, Role.BOTH)


def _secret(value: str | bytes | None) -> bytes | None:
    if value is None:
        return None
    key = value.encode() if isinstance(value, str) else bytes(value)
    if len(key) < MIN_SECRET_BYTES:
        raise AuthError(f"the side-channel secret must be at least {MIN_SECRET_BYTES} bytes")
    return key


class _Refusal(Exception):
    """Internal: stop handling a frame and answer with this rejection."""

    def __init__(self, code: RejectCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class _Limiter:
    """At most ``burst`` log lines per ``window_s``, then one line saying how many were dropped."""

    def __init__(self, clock: Callable[[], float], burst: int = 20, window_s: float = 60.0) -> None:
        self._clock, self._burst, self._window = clock, burst, window_s
        self._start, self._count, self._dropped = -float("inf"), 0, 0

    def warning(self, fmt: str, *args: object) -> None:
        now = self._clock()
        if now - self._start >= self._window:
            if self._dropped:
                log.warning("side channel: %d more rejections not logged", self._dropped)
            self._start, self._count, self._dropped = now, 0, 0
        self._count += 1
        if self._count <= self._burst:
            log.warning(fmt, *args)
        else:
            self._dropped += 1


class Responder:
    """Answers side-channel frames (sans-I/O).

    Args:
        engine_id: This instance's engine id.
        incarnation: This process's incarnation (new at every start).
        compat_hash: This instance's ``Fingerprint.digest()``.
        local_info: Returns the :class:`~kvxfer.core.wire.Welcome` to send (layout, agent
            metadata, rails, plan options, lease), or None until memory is registered
            (peers then get NOT_READY and retry). Called for every hello, so agent
            metadata may change after a deferred registration; it may block (it asks the
            transport), so :meth:`answer` calls it off the server thread.
        identity: What a Pong says (role, direction, layout), cheap and never blocking;
            None asks ``local_info`` (then a Ping waits as long as a Welcome does).
        enforce_compat: False skips the compatibility hash check (logged once).
        on_message: Handles PushRegister/Release (see :data:`MessageHook`).
        hold_state: Answers a Ping that names a request (see :data:`HoldHook`); None
            leaves :attr:`~kvxfer.core.wire.Pong.hold` unset.
        auth_secret: Shared secret (at least 16 bytes); None leaves the side channel
            unauthenticated (warned once per process).
        max_bytes: Largest frame parsed; bigger ones get TOO_LARGE.
        max_skew_s: Largest accepted clock distance of authenticated frames.
        clock: Time source in seconds (tests inject one).

    Raises:
        AuthError: The secret is shorter than 16 bytes.
    """

    def __init__(
        self,
        *,
        engine_id: str,
        incarnation: int,
        compat_hash: str,
        local_info: Callable[[], wire.Welcome | None],
        identity: Callable[[], Identity | None] | None = None,
        enforce_compat: bool = True,
        on_message: MessageHook | None = None,
        hold_state: HoldHook | None = None,
        auth_secret: str | bytes | None = None,
        max_bytes: int = wire.DEFAULT_MAX_BYTES,
        max_skew_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine_id = engine_id
        self._hold_state = hold_state
        self.incarnation = incarnation
        self.compat_hash = compat_hash
        self.enforce_compat = enforce_compat
        self.max_bytes = max_bytes
        self.max_skew_s = max_skew_s
        self._local_info = local_info
        self._identity = identity
        self._on_message = on_message
        self._key = _secret(auth_secret)
        self._clock = clock
        self._limiter = _Limiter(clock)
        self._seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._compat_skips: set[tuple[str, str]] = set()
        #: Frames answered with a Welcome / Pong / hook reply, and rejections by code.
        self.accepted = 0
        self.rejected: collections.Counter[RejectCode] = collections.Counter()
        # Deferred work finishes on several threads: the counters and the log limiter.
        self._count_lock = threading.Lock()
        # Precomputed so that even a failing encoder leaves us something to answer.
        self._fallback = wire.encode(
            wire.Reject(code=RejectCode.INTERNAL, reason="internal error"), compat_hash
        )
        if self._key is None and not _UNAUTHENTICATED_WARNED:
            _UNAUTHENTICATED_WARNED.append(True)
            log.warning(
                "side channel of %s is unauthenticated (no shared secret; set auth_secret "
                "on every instance); said once per process",
                engine_id,
            )
        if not enforce_compat:
            log.warning(
                "enforce_handshake_compat is false: %s skips the compatibility hash check "
                "(the KV layout is still checked)",
                engine_id,
            )

    def respond(self, data: bytes) -> bytes:
        """Answer one received frame, all of it on this thread; never raises."""
        answer = self.answer(data)
        return answer if isinstance(answer, bytes) else answer()

    def answer(self, data: bytes) -> bytes | Callable[[], bytes]:
        """Answer one received frame, or return the slow rest of the answer; never raises.

        Decoding, authentication, the compatibility check, a Ping and every rejection
        of those are answered here at once (a Ping within milliseconds whatever else
        runs, R-SAFE-6). A Hello (its Welcome asks the transport for its metadata) and a
        PushRegister, Release or Renew (they take the agent's lock) come back as a callable
        that computes the reply, never raising, for the caller to run on another thread.
        """
        reply_to = b""
        try:
            if isinstance(data, bytes | bytearray | memoryview):
                size = data.nbytes if isinstance(data, memoryview) else len(data)
                if size > self.max_bytes:
                    return self.too_large(size)
            frame = wire.decode(data, max_bytes=self.max_bytes)
            if frame.auth is not None:
                reply_to = frame.auth.nonce
            self._authenticate(frame)
            message = frame.message
            if isinstance(message, wire.Ping):
                return self._accept(self._pong(message), reply_to)
            if isinstance(message, wire.Hello):
                self._check_compat(frame, message.engine_id)
                return partial(self._finish, partial(self._hello, message), reply_to)
            if isinstance(
                message,
                wire.PushRegister | wire.Release | wire.Renew | wire.GatherRound | wire.GatherDone,
            ):
                self._check_compat(frame, message.engine_id)
                return partial(self._finish, partial(self._hook, message), reply_to)
            raise _Refusal(
                RejectCode.MALFORMED, f"a listener does not take {type(message).__name__}"
            )
        except Exception as exc:
            return self._failed(exc, reply_to)

    def busy(self) -> bytes:
        """The reply to a request its server has no room to queue (retry later)."""
        return self._refuse(RejectCode.NOT_READY, "the side channel is busy; retry", b"")

    def _finish(self, work: Callable[[], Message], reply_to: bytes) -> bytes:
        try:
            return self._accept(work(), reply_to)
        except Exception as exc:
            return self._failed(exc, reply_to)

    def _accept(self, reply: Message, reply_to: bytes) -> bytes:
        if isinstance(reply, wire.Reject):  # the hook refused
            with self._count_lock:
                self.rejected[reply.code] += 1
        else:
            with self._count_lock:
                self.accepted += 1
        return self._encode(reply, reply_to)

    def _failed(self, exc: Exception, reply_to: bytes) -> bytes:
        """The rejection ``exc`` calls for (never raises)."""
        try:
            if isinstance(exc, ProtocolVersionError):
                return self._refuse(RejectCode.VERSION, str(exc), reply_to)
            if isinstance(exc, WireError):
                return self._refuse(RejectCode.MALFORMED, str(exc), reply_to)
            if isinstance(exc, _Refusal):
                return self._refuse(exc.code, exc.reason, reply_to)
            # The listener must outlive any bug reachable from input.
            log.error("side channel: internal error while answering a frame", exc_info=exc)
            return self._refuse(RejectCode.INTERNAL, "internal error; see the responder's log", b"")
        except Exception:
            return self._fallback

    def too_large(self, size: int) -> bytes:
        """The reply to a frame of ``size`` bytes above the limit (never parsed)."""
        return self._refuse(
            RejectCode.TOO_LARGE,
            f"frame of {size} bytes exceeds the {self.max_bytes}-byte limit",
            b"",
        )

    # -- dispatch --------------------------------------------------------------------
    def _authenticate(self, frame: wire.Frame) -> None:
        if self._key is None:
            return
        now = self._clock()
        try:
            wire.verify(frame, self._key, now=now, max_skew_s=self.max_skew_s)
        except AuthError as exc:
            raise _Refusal(RejectCode.AUTH, str(exc)) from exc
        assert frame.auth is not None  # verify() refuses unsigned frames
        while self._seen and next(iter(self._seen.values())) < now:
            self._seen.popitem(last=False)
        if frame.auth.nonce in self._seen:
            raise _Refusal(RejectCode.AUTH, "replayed frame")
        if len(self._seen) >= _REPLAY_CACHE:
            self._seen.popitem(last=False)
        # Kept until the frame could no longer pass the skew check.
        self._seen[frame.auth.nonce] = frame.auth.ts_ms / 1000 + self.max_skew_s

    def _check_compat(self, frame: wire.Frame, peer: str) -> None:
        if frame.compat_hash == self.compat_hash:
            return
        if self.enforce_compat:
            raise _Refusal(
                RejectCode.COMPAT,
                f"compatibility hash {frame.compat_hash} != ours {self.compat_hash}: model, "
                "revision, dtype, KV cache dtype, attention backend, protocol version, "
                "direction or draft model differ",
            )
        key = (peer, frame.compat_hash)
        if key not in self._compat_skips and len(self._compat_skips) < 1024:
            self._compat_skips.add(key)
            log.warning(
                "compatibility hash of %s differs (%s != %s); accepted because "
                "enforce_handshake_compat is false",
                peer,
                frame.compat_hash,
                self.compat_hash,
            )

    def _hello(self, hello: wire.Hello) -> wire.Welcome:
        expected = hello.expected_engine_id
        if expected is not None and expected != self.engine_id:
            raise _Refusal(
                RejectCode.ENGINE_ID,
                f"this is engine {self.engine_id!r}, not {expected!r}: check the remote "
                "engine id and the side-channel address the router passed",
            )
        welcome = self._local_info()
        if welcome is None:
            raise _Refusal(RejectCode.NOT_READY, "KV memory is not registered yet; retry")
        if hello.direction is not welcome.direction:
            raise _Refusal(
                RejectCode.ROLE,
                f"peer is a {hello.direction.value} instance, this is {welcome.direction.value}: "
                "pull and push instances never pair",
            )
        if not roles_pair(hello.role, welcome.role, welcome.direction):
            raise _Refusal(
                RejectCode.ROLE,
                f"a {hello.role.value} cannot {welcome.direction.value} from/to a "
                f"{welcome.role.value}",
            )
        try:
            check_pair(
                welcome.layout,
                hello.layout,
                local_tp=welcome.tp,
                remote_tp=hello.tp,
            )
        except LayoutMismatch as exc:
            raise _Refusal(
                RejectCode.LAYOUT,
                f"KV layout differs at {exc.field}: ours {exc.local!r}, yours {exc.remote!r}",
            ) from exc
        except LayoutError as exc:
            raise _Refusal(RejectCode.LAYOUT, str(exc)) from exc
        return welcome

    def _pong(self, ping: wire.Ping) -> wire.Pong:
        welcome: Identity | wire.Welcome | None = (
            self._local_info() if self._identity is None else self._identity()
        )
        hold: wire.HoldState | None = None
        reason = ""
        if ping.request_id and self._hold_state is not None:
            hold, reason = self._hold_state(ping.request_id, ping.capability)
        return wire.Pong(
            hold=hold,
            hold_reason=reason[:4096],
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            role=None if welcome is None else welcome.role,
            direction=None if welcome is None else welcome.direction,
            protocol_version=PROTOCOL_VERSION,
            compat_hash=self.compat_hash,
            layout_summary="" if welcome is None else welcome.layout.summary(),
            layout=None if welcome is None else welcome.layout,
            software_version=__version__,
        )

    def _hook(self, message: Message) -> Message:
        if self._on_message is None:
            raise _Refusal(
                RejectCode.MALFORMED, f"this listener does not take {type(message).__name__}"
            )
        try:
            reply = self._on_message(message)
        except LeaseError as exc:
            raise _Refusal(RejectCode.UNKNOWN_REQUEST, str(exc)) from exc
        except KvxferError as exc:
            raise _Refusal(RejectCode.INVALID, str(exc)) from exc
        if reply is None:
            raise _Refusal(
                RejectCode.MALFORMED, f"this listener does not take {type(message).__name__}"
            )
        return reply

    # -- replies ---------------------------------------------------------------------
    def _encode(self, reply: Message, reply_to: bytes) -> bytes:
        return wire.encode(
            reply, self.compat_hash, auth_key=self._key, reply_to=reply_to, now=self._clock()
        )

    def _refuse(self, code: RejectCode, reason: str, reply_to: bytes) -> bytes:
        with self._count_lock:
            self.rejected[code] += 1
            self._limiter.warning("side channel: rejected a frame (%s): %s", code.value, reason)
        # Bounded like the schema, so a peer's decoder never refuses our explanation.
        return self._encode(wire.Reject(code=code, reason=reason[:4000]), reply_to)


class Initiator:
    """Starts handshakes with one peer (sans-I/O): ``hello()`` out, ``receive()`` in.

    Not thread-safe; one per handshake attempt (or per peer, guarded by its caller).

    Args:
        hello: This instance's :class:`~kvxfer.core.wire.Hello`.
        compat_hash: This instance's ``Fingerprint.digest()``.
        expected_engine_id: The engine the peer must be; defaults to the hello's
            ``expected_engine_id`` (None accepts any).
        local_layout: The layout the peer's must match; defaults to the hello's.
        enforce_compat: False accepts another compatibility hash (logged).
        auth_secret: Shared secret (at least 16 bytes); replies must be signed with it.
        address: ``host:port`` of the peer, for error messages.
        max_bytes: Largest reply parsed.
        max_skew_s: Largest accepted clock distance of authenticated replies.
        clock: Time source in seconds.

    Raises:
        AuthError: The secret is shorter than 16 bytes.
    """

    def __init__(
        self,
        *,
        hello: wire.Hello,
        compat_hash: str,
        expected_engine_id: str | None = None,
        local_layout: KVLayout | None = None,
        enforce_compat: bool = True,
        auth_secret: str | bytes | None = None,
        address: str = "",
        max_bytes: int = wire.DEFAULT_MAX_BYTES,
        max_skew_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._hello = hello
        self.compat_hash = compat_hash
        self.expected_engine_id = (
            hello.expected_engine_id if expected_engine_id is None else expected_engine_id
        )
        self.local_layout = hello.layout if local_layout is None else local_layout
        self.enforce_compat = enforce_compat
        self.address = address or "<unknown address>"
        self.max_bytes = max_bytes
        self.max_skew_s = max_skew_s
        self._key = _secret(auth_secret)
        self._clock = clock
        self._pending: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._sent = False

    def hello(self) -> bytes:
        """The hello frame; call again for each retry (a fresh nonce each time)."""
        return self.request(self._hello)

    def ping(self, request_id: str = "", capability: str = "") -> bytes:
        """A ping frame; :meth:`reply` turns the answer into a :class:`~kvxfer.core.wire.Pong`.

        With ``request_id`` (and that hold's ``capability``) the pong also says how the
        responder's hold of the request stands (:attr:`~kvxfer.core.wire.Pong.hold`).
        """
        return self.request(
            wire.Ping(engine_id=self._hello.engine_id, request_id=request_id, capability=capability)
        )

    def request(self, message: Message) -> bytes:
        """Frame any request to this peer, signed when a secret is set."""
        data = wire.encode(message, self.compat_hash, auth_key=self._key, now=self._clock())
        self._sent = True
        if self._key is not None:
            self._pending[wire.request_nonce(data)] = None
            while len(self._pending) > _PENDING:
                self._pending.popitem(last=False)
        return data

    def reply(self, data: bytes) -> Message:
        """Decode and authenticate the reply to one of this initiator's requests.

        Raises:
            HandshakeRejected: The peer answered with a rejection (``code`` says why).
            ProtocolVersionError: The peer speaks another protocol version.
            AuthError: The reply is not signed by the secret, or answers no request of ours.
            WireError: The reply is malformed.
            HandshakeError: Called before any request was made.
        """
        return self._checked(data).message

    def _checked(self, data: bytes) -> wire.Frame:
        if not self._sent:
            raise HandshakeError("a reply before any request: call hello() first")
        try:
            frame = wire.decode(data, max_bytes=self.max_bytes)
        except ProtocolVersionError as exc:
            raise ProtocolVersionError(f"peer at {self.address}: {exc}") from exc
        except WireError as exc:
            raise WireError(f"peer at {self.address} sent a bad reply: {exc}") from exc
        message = frame.message
        if isinstance(message, wire.Reject):
            raise HandshakeRejected(message.code.value, f"peer at {self.address}: {message.reason}")
        if self._key is not None:
            try:
                wire.verify(frame, self._key, now=self._clock(), max_skew_s=self.max_skew_s)
            except AuthError as exc:
                raise AuthError(f"peer at {self.address}: {exc}") from exc
            assert frame.auth is not None  # verify() refuses unsigned frames
            if frame.auth.reply_to not in self._pending:
                raise AuthError(f"peer at {self.address}: the reply answers no request of ours")
            del self._pending[frame.auth.reply_to]
        return frame

    def receive(self, data: bytes) -> PeerInfo:
        """Check the reply to :meth:`hello` and describe the accepted peer.

        Raises:
            HandshakeRejected: The peer refused (``code``: compat, layout, engine_id, ...).
            ProtocolVersionError: The peer speaks another protocol version.
            AuthError: Authentication failed.
            CompatError: The peer's compatibility hash differs from ours.
            PeerError: The peer is not the engine we expected, or cannot pair with us.
            LayoutMismatch: The peer's KV layout differs from ours.
            WireError: The reply is malformed or not a welcome.
        """
        frame = self._checked(data)
        message = frame.message
        if not isinstance(message, wire.Welcome):
            raise WireError(
                f"peer at {self.address} answered a hello with {type(message).__name__}"
            )
        compat_hash = frame.compat_hash
        if compat_hash != self.compat_hash:
            if self.enforce_compat:
                raise CompatError(
                    f"peer {message.engine_id} at {self.address} has compatibility hash "
                    f"{compat_hash}, ours is {self.compat_hash}"
                )
            log.warning(
                "compatibility hash of %s at %s differs; accepted because "
                "enforce_handshake_compat is false",
                message.engine_id,
                self.address,
            )
        expected = self.expected_engine_id
        if expected is not None and message.engine_id != expected:
            raise PeerError(
                f"expected engine id {expected}, peer at {self.address} is {message.engine_id}"
            )
        mine = self._hello
        if message.direction is not mine.direction or not roles_pair(
            mine.role, message.role, mine.direction
        ):
            raise PeerError(
                f"peer {message.engine_id} at {self.address} is a {message.direction.value} "
                f"{message.role.value}; a {mine.direction.value} {mine.role.value} cannot "
                "pair with it"
            )
        check_pair(
            self.local_layout,
            message.layout,
            local_tp=mine.tp,
            remote_tp=message.tp,
        )
        return PeerInfo(
            engine_id=message.engine_id,
            incarnation=message.incarnation,
            role=message.role,
            direction=message.direction,
            layout=message.layout,
            agent_name=message.agent_name,
            agent_metadata=message.agent_metadata,
            rails=message.rails,
            options=message.options,
            lease_s=message.lease_s,
            compat_hash=compat_hash,
            address=self.address,
            guard=message.guard,
            tp=message.tp,
            staging=message.staging,
        )
