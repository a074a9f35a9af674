"""One agent's side channel: the server that answers peers, the client that asks them.

The server answers handshakes (:class:`~kvxfer.handshake.Responder`, with this agent's
:class:`~kvxfer.wire.Welcome`) and the control messages that follow: a consumer's
Release frees a held request (or is remembered until its hold), a consumer's
PushRegister goes to the push writer. The client sends this agent's own control
messages (Release, PushRegister) and carries the peer cache's handshakes.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvxfer import wire
from kvxfer._leases import LeaseBook
from kvxfer._local import LocalEnd
from kvxfer._push import PushWriter
from kvxfer._readers import ReaderCount
from kvxfer.backend import Backend
from kvxfer.control import SideChannelClient, SideChannelServer
from kvxfer.errors import PeerError
from kvxfer.handshake import Initiator, Responder

__all__ = ["SideChannel"]

log = logging.getLogger("kvxfer.agent")


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
                on_message=self._on_message,
                auth_secret=config.auth_secret,
                max_bytes=config.max_message_bytes,
            )
            self._server = SideChannelServer(
                config.side_channel_host,
                config.side_channel_port,
                responder.respond,
                max_bytes=config.max_message_bytes,
                oversize_reply=responder.too_large,
            )
        return config.side_channel_host, self._server.port

    @property
    def address(self) -> tuple[str, int]:
        """The advertised address (after :meth:`serve`)."""
        if self._server is None:
            raise PeerError("the agent is not serving; call serve() first")
        return self._config.side_channel_host, self._server.port

    def request(self, host: str, port: int, msg: wire.Message) -> wire.Message:
        """Send a control message; return the (authenticated) reply or raise the rejection."""
        config = self._config
        initiator = Initiator(
            hello=self._local.hello(None),
            compat_hash=self._local.compat_hash,
            enforce_compat=config.enforce_handshake_compat,
            auth_secret=config.auth_secret,
            address=f"{host}:{port}",
            max_bytes=config.max_message_bytes * 4,
        )
        return initiator.reply(self._client.request(host, port, initiator.request(msg)))

    def close(self) -> None:
        """Stop the server (the client keeps no connection open)."""
        if self._server is not None:
            self._server.close()

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
        )

    def _on_message(self, msg: Any) -> Any:
        """Side-channel messages other than the handshake (runs on the server thread)."""
        if isinstance(msg, wire.Release):
            if not self._readers.last(msg.request_id, msg.readers, msg.reader):
                # Other consumer ranks may still read it (TP sizes differ).
                return wire.Ack(request_id=msg.request_id)
            with self._lock:
                released = self._leases.abort(msg.request_id)
                if not released:
                    self._leases.remember_early(msg.request_id)
            log.info("peer asked to release %s (%s): %s", msg.request_id, msg.reason, released)
            return wire.Ack(request_id=msg.request_id)
        if isinstance(msg, wire.PushRegister):
            return self._push.on_register(msg)
        return None
