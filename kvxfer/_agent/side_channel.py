"""One agent's side channel: the server that answers peers, the client that asks them.

The server answers handshakes (:class:`~kvxfer.core.handshake.Responder`, with this agent's
:class:`~kvxfer.core.wire.Welcome`) and hands every other control message to the handler the
Agent gave for its type (:class:`Answers`: a consumer's Release to the producer's
holds, a PushRegister to the push writer); it knows no part of the agent. The client
sends this agent's own control messages (Release, PushRegister, the liveness Pings)
and carries the peer cache's handshakes: every side-channel message this agent sends
goes from here.

A Ping is answered on the server thread from what this agent knows without asking its
backend or waiting long for its lock (R-SAFE-6); everything that takes those runs on
the server's worker threads (:class:`~kvxfer.io.control.SideChannelServer`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from kvxfer._agent.local import LocalEnd
from kvxfer.backend import Backend
from kvxfer.core import wire
from kvxfer.core.handshake import HoldHook, Identity, Initiator, Responder
from kvxfer.errors import KvxferError, PeerError
from kvxfer.io.control import SideChannelClient, SideChannelServer
from kvxfer.ticket import Ticket

__all__ = ["Answers", "SideChannel"]

log = logging.getLogger("kvxfer.agent")


@dataclasses.dataclass(frozen=True)
class Answers:
    """What the server does with the messages that follow a handshake.

    Attributes:
        handlers: The handler of each message type (``wire.Release``,
            ``wire.PushRegister``), called on a server worker thread; its return is
            the reply. A type without one is answered as unknown.
        hold_state: Answers a Ping that names a request, on the server thread.
        welcomed: Called when a peer's Hello is answered (its transport connection is
            wired up next, as both sides progress).
    """

    handlers: Mapping[type[Any], Callable[[Any], wire.Message]]
    hold_state: HoldHook
    welcomed: Callable[[], None] | None = None


class SideChannel:
    """The side channel of one agent (internal).

    Args:
        local: Identity and registered memory (what the handshake announces).
        backend: Its name and metadata go to peers in the handshake.
        client: Sends this agent's requests (the peer cache's handshakes use it too).
    """

    def __init__(self, local: LocalEnd, backend: Backend, client: SideChannelClient) -> None:
        self._local = local
        self._config = local.config
        self._backend = backend
        self._client = client
        self._server: SideChannelServer | None = None

    @property
    def serving(self) -> bool:
        """Whether :meth:`serve` started the server."""
        return self._server is not None

    def serve(self, answers: Answers) -> tuple[str, int]:
        """Start answering (once) with ``answers``; returns the advertised ``(host, port)``."""
        config = self._config
        if self._server is None:
            handlers = dict(answers.handlers)

            def on_message(msg: Any) -> Any:
                handler = handlers.get(type(msg))
                return None if handler is None else handler(msg)

            responder = Responder(
                engine_id=config.engine_id,
                incarnation=self._local.incarnation,
                compat_hash=self._local.compat_hash,
                enforce_compat=config.enforce_handshake_compat,
                local_info=functools.partial(self._welcome, answers.welcomed),
                identity=self._identity,
                on_message=on_message,
                auth_secret=config.auth_secret,
                max_bytes=config.max_message_bytes,
                hold_state=answers.hold_state,
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
        initiator = self._initiator(host, port)
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
        says so); with ``request_id``, the reply's :attr:`~kvxfer.core.wire.Pong.hold` says
        how the peer's hold stands."""
        initiator = self._initiator(host, port)
        frame = initiator.ping(request_id, capability)
        reply = self._client.request(
            host, port, frame, timeout_s=timeout_s, retries=0, cancel=cancel
        )
        return initiator.reply(reply)

    def release(
        self,
        ticket: Ticket,
        *,
        reason: str = "consumer aborted",
        done: bool = False,
        brief: bool = False,
        readers: int = 1,
        reader: int = 0,
    ) -> None:
        """Tell the producer of ``ticket`` to release its request (``done``: the pull
        read it all, else it gave up for ``reason``). A failure is logged, not raised:
        the lease then ends at its expiry.

        ``brief``: one short try (a pull's own DONE or failure notice): an io worker
        never spends a dead producer's handshake budget on it. ``readers``/``reader``:
        this consumer rank among those reading the request from that producer rank
        across TP sizes (kvxfer._agent.tp_pull); the producer frees once every reader released
        or read."""
        msg = wire.Release(
            request_id=ticket.request_id,
            reason=reason[:200],
            engine_id=self._config.engine_id,
            capability=ticket.capability,
            done=done,
            readers=readers,
            reader=reader,
        )
        try:
            if brief:
                self.request(ticket.host, ticket.port, msg, timeout_s=1.0, retries=1)
            else:
                self.request(ticket.host, ticket.port, msg)
        except KvxferError as exc:
            log.warning(
                "could not tell %s to release %s: %s", ticket.engine_id, ticket.request_id, exc
            )

    def _initiator(self, host: str, port: int) -> Initiator:
        """The one request (and its reply) to ``host:port``: signed, checked, bounded."""
        config = self._config
        return Initiator(
            hello=self._local.hello(None),
            compat_hash=self._local.compat_hash,
            enforce_compat=config.enforce_handshake_compat,
            auth_secret=config.auth_secret,
            address=f"{host}:{port}",
            max_bytes=config.max_message_bytes * 4,
        )

    def close(self) -> None:
        """Stop the server and cancel this agent's requests in flight (a handshake
        towards a peer that never answers ends within ~50 ms)."""
        self._client.close()
        if self._server is not None:
            self._server.close()

    def _identity(self) -> Identity | None:
        """What a Pong says: from this agent's own state, never from the backend (whose
        lock a long post or registration holds)."""
        exposed = self._local.exposed_layout
        if exposed is None:
            return None
        return Identity(role=self._config.role, direction=self._config.direction, layout=exposed)

    def _welcome(self, welcomed: Callable[[], None] | None) -> wire.Welcome | None:
        """What this agent tells a peer in the handshake (None until registered)."""
        exposed = self._local.exposed_layout
        if exposed is None:
            return None
        if welcomed is not None:
            welcomed()
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
            staging=self._local.staging,
        )
