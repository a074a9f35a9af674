"""One agent's side channel: the server that answers peers, the client that asks them.

The server answers handshakes (:class:`~kvxfer.handshake.Responder`, with this agent's
:class:`~kvxfer.wire.Welcome`) and the control messages that follow: a consumer's
Release frees a held request (or is remembered until its hold), a consumer's
PushRegister goes to the push writer. The client sends this agent's own control
messages (Release, PushRegister) and carries the peer cache's handshakes.

A Ping is answered on the server thread from what this agent knows without asking its
backend or waiting long for its lock (R-SAFE-6); everything that takes those runs on
the server's worker threads (:class:`~kvxfer.control.SideChannelServer`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kvxfer import wire
from kvxfer._guard import FreeReason
from kvxfer._leases import LeaseBook
from kvxfer._local import LocalEnd
from kvxfer._push import PushWriter
from kvxfer._readers import ReaderCount
from kvxfer.backend import Backend
from kvxfer.control import SideChannelClient, SideChannelServer
from kvxfer.errors import PeerError
from kvxfer.handshake import Identity, Initiator, Responder

__all__ = ["HOLD_STATE_WAIT_S", "SideChannel"]

log = logging.getLogger("kvxfer.agent")

#: The longest a Ping that names a request waits for the agent lock. Past it the Pong
#: says nothing of the hold (the pinger takes the peer for alive and asks again), so
#: that a lock held through a long call never holds up the side channel's thread.
HOLD_STATE_WAIT_S = 0.02


class SideChannel:
    """The side channel of one agent (internal).

    Args:
        local: Identity and registered memory (what the handshake announces).
        backend: Its name and metadata go to peers in the handshake.
        leases: Freed by a consumer's Release.
        push: Takes a consumer's PushRegister.
        client: Sends this agent's requests (the peer cache's handshakes use it too).
        lock: The agent lock.
        readers: Counts the consumer ranks of a request read across TP sizes (a
            Release frees it once every reader released or finished).
    """

    def __init__(
        self,
        local: LocalEnd,
        backend: Backend,
        leases: LeaseBook,
        push: PushWriter,
        client: SideChannelClient,
        lock: threading.RLock,
        readers: ReaderCount | None = None,
    ) -> None:
        self._readers = ReaderCount() if readers is None else readers
        self._local = local
        self._config = local.config
        self._backend = backend
        self._leases = leases
        self._push = push
        self._lock = lock
        self._client = client
        self._server: SideChannelServer | None = None

    @property
    def serving(self) -> bool:
        """Whether :meth:`serve` started the server."""
        return self._server is not None

    def serve(self) -> tuple[str, int]:
        """Start answering (once); returns the advertised ``(host, port)``."""
        config = self._config
        if self._server is None:
            responder = Responder(
                engine_id=config.engine_id,
                incarnation=self._local.incarnation,
                compat_hash=self._local.compat_hash,
                enforce_compat=config.enforce_handshake_compat,
                local_info=self._welcome,
                identity=self._identity,
                on_message=self._on_message,
                auth_secret=config.auth_secret,
                max_bytes=config.max_message_bytes,
                hold_state=self._hold_state,
            )
            self._server = SideChannelServer(
                config.side_channel_host,
                config.side_channel_port,
                responder.answer,
                max_bytes=config.max_message_bytes,
                oversize_reply=responder.too_large,
                busy_reply=responder.busy,
            )
        return config.side_channel_host, self._server.port

    @property
    def address(self) -> tuple[str, int]:
        """The advertised address (after :meth:`serve`)."""
        if self._server is None:
            raise PeerError("the agent is not serving; call serve() first")
        return self._config.side_channel_host, self._server.port

    def request(
        self,
        host: str,
        port: int,
        msg: wire.Message,
        *,
        timeout_s: float | None = None,
        retries: int | None = None,
    ) -> wire.Message:
        """Send a control message; return the (authenticated) reply or raise the rejection.
        ``timeout_s``/``retries``: this request's budget (default: the handshake's)."""
        config = self._config
        initiator = Initiator(
            hello=self._local.hello(None),
            compat_hash=self._local.compat_hash,
            enforce_compat=config.enforce_handshake_compat,
            auth_secret=config.auth_secret,
            address=f"{host}:{port}",
            max_bytes=config.max_message_bytes * 4,
        )
        frame = initiator.request(msg)
        reply = self._client.request(host, port, frame, timeout_s=timeout_s, retries=retries)
        return initiator.reply(reply)

    def ping(
        self,
        host: str,
        port: int,
        request_id: str,
        capability: str,
        timeout_s: float,
        cancel: Callable[[], bool] | None = None,
    ) -> wire.Message:
        """One liveness probe (one try of ``timeout_s``, given up early when ``cancel()``
        says so); with ``request_id``, the reply's :attr:`~kvxfer.wire.Pong.hold` says
        how the peer's hold stands."""
        config = self._config
        initiator = Initiator(
            hello=self._local.hello(None),
            compat_hash=self._local.compat_hash,
            enforce_compat=config.enforce_handshake_compat,
            auth_secret=config.auth_secret,
            address=f"{host}:{port}",
            max_bytes=config.max_message_bytes * 4,
        )
        frame = initiator.ping(request_id, capability)
        reply = self._client.request(
            host, port, frame, timeout_s=timeout_s, retries=0, cancel=cancel
        )
        return initiator.reply(reply)

    def close(self) -> None:
        """Stop the server and cancel this agent's requests in flight (a handshake
        towards a peer that never answers ends within ~50 ms)."""
        self._client.close()
        if self._server is not None:
            self._server.close()

    def _hold_state(self, request_id: str, capability: str) -> tuple[wire.HoldState | None, str]:
        if not self._lock.acquire(timeout=HOLD_STATE_WAIT_S):
            return None, "busy"
        try:
            return self._leases.hold_state(request_id, capability)
        finally:
            self._lock.release()

    def _identity(self) -> Identity | None:
        """What a Pong says: from this agent's own state, never from the backend (whose
        lock a long post or registration holds)."""
        exposed = self._local.exposed_layout
        if exposed is None:
            return None
        return Identity(role=self._config.role, direction=self._config.direction, layout=exposed)

    def _welcome(self) -> wire.Welcome | None:
        """What this agent tells a peer in the handshake (None until registered)."""
        exposed = self._local.exposed_layout
        if exposed is None:
            return None
        config = self._config
        return wire.Welcome(
            engine_id=config.engine_id,
            incarnation=self._local.incarnation,
            layout=exposed,
            agent_name=self._backend.agent_name,
            agent_metadata=self._backend.metadata(),
            rails=config.rails,
            options=config.plan,
            lease_s=config.lease_s,
            role=config.role,
            direction=config.direction,
            tp=config.tp,
            guard=self._backend.guard_table(),
        )

    def _on_message(self, msg: Any) -> Any:
        """Side-channel messages other than the handshake (on a server worker thread)."""
        if isinstance(msg, wire.Release):
            leases = self._leases
            with self._lock:
                lease = leases.held.get(msg.request_id)
                if lease is not None and not leases.authorized(lease, msg.capability):
                    leases.reject()
                    log.warning("refused a Release of %s: wrong capability", msg.request_id)
                    return wire.Reject(
                        code=wire.RejectCode.INVALID,
                        reason=f"no hold of {msg.request_id} for this capability",
                    )
                if not self._readers.last(msg.request_id, msg.readers, msg.reader):
                    # Other consumer ranks may still read it (TP sizes differ).
                    return wire.Ack(request_id=msg.request_id)
                if lease is None or not lease.ready:
                    # Not held yet (a push registration may wait for the hold): the hold
                    # that comes frees at once and writes nothing.
                    leases.remember_early(msg.request_id)  # capped; see LeaseBook
                if lease is not None:
                    why = FreeReason.DONE if msg.done else FreeReason.ABORTED
                    leases.free(msg.request_id, why)
            log.debug("peer asked to release %s (%s)", msg.request_id, msg.reason)
            return wire.Ack(request_id=msg.request_id)
        if isinstance(msg, wire.PushRegister):
            return self._push.on_register(msg)
        return None
