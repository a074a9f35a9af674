"""Liveness probes of quiet transfers (R-SAFE-4): a dead peer within about a second.

A transport may take its own timeouts to notice a dead peer (a READ that never
completes), and a push's PUSHED or FAILED notice may be lost on the way. Neither should
be seen only at ``transfer_timeout_s``. A transfer that made no progress for
:data:`QUIET_S` is probed over the side channel, from the io workers:

- a pull's producer is pinged; no answer within :data:`PROBE_TIMEOUT_S` (or a refused
  connection), or another incarnation, fails the pull (the peer is gone); a pull whose
  handshake or post has not returned yet fails only on a refused connection;
- a push reception asks the producer how its hold stands (``Ping(request_id,
  capability)`` → ``Pong.hold``): ``pushed`` settles it DONE (every write landed, the
  notice was lost), ``failed``/``released``/``unknown`` fail it with that reason,
  ``held``/``writing`` mean alive and slow: asked again after another quiet period.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Protocol

from kvxfer import wire
from kvxfer.errors import KvxferError, PeerError, TransferError
from kvxfer.transfer import FailureKind, FailureStage, Transfer

__all__ = ["PING_TIMEOUT_S", "PROBE_TIMEOUT_S", "QUIET_S", "Liveness"]

log = logging.getLogger("kvxfer.agent")

#: A transfer without progress this long gets a probe.
QUIET_S = 0.4
#: How long a probe's TCP connect may take (refused at once when nobody listens).
PROBE_TIMEOUT_S = 0.5
#: How long the Ping waits for its answer once the port accepted (the process lives,
#: but its side-channel thread may be slow on a loaded host).
PING_TIMEOUT_S = 1.0


class _Settler(Protocol):
    """What the probes settle transfers through (the agent's runtime)."""

    def fail(
        self,
        transfer: Transfer,
        kind: FailureKind,
        error: BaseException,
        stage: FailureStage | None = None,
    ) -> None: ...

    def pushed(self, transfer: Transfer) -> None: ...


Ping = Callable[[str, int, str, str, float], wire.Message]


class Liveness:
    """Probes quiet transfers (internal).

    Args:
        ping: Sends a Ping ``(host, port, request_id, capability, timeout_s)`` and
            returns the reply (raises a KvxferError when none came).
        submit: Runs a call on an io worker.
        settler: Fails or completes the probed transfers.
        count: Counts one probe sent.
    """

    def __init__(
        self,
        ping: Ping,
        submit: Callable[..., bool],
        settler: _Settler,
        count: Callable[[], None],
    ) -> None:
        self._ping = ping
        self._submit = submit
        self._settler = settler
        self._count = count

    def check(self, now: float, transfers: list[Transfer]) -> None:
        """Probe the transfers in ``transfers`` quiet since :data:`QUIET_S`."""
        for t in transfers:
            meta = t.meta
            if t.done or meta.probing or now - meta.last_progress < QUIET_S:
                continue
            if meta.push_from is not None:
                if meta.posting:
                    continue
                host, port = meta.push_from
                job = (self._probe_push, t, host, port)
            elif meta.lease is None and (meta.peer is not None or meta.producer_at is not None):
                # A pull, also one still in its first-contact handshake or in a post
                # that does not return (UCX connecting to a producer that died meanwhile
                # can take its own ~10 s), or a push reception whose registration has
                # not returned: its producer's side channel says.
                peer = meta.peer
                if peer is not None:
                    job = (self._probe_pull, t, peer.host, peer.port)
                else:
                    # Its handshake or post has not returned: only a port that refuses
                    # says the producer is gone (a slow one may not answer a Ping yet).
                    assert meta.producer_at is not None
                    job = (self._probe_port, t, *meta.producer_at)
            else:
                continue  # a producer's push write
            meta.probing = True
            self._count()
            if not self._submit(*job):
                meta.probing = False

    @staticmethod
    def _refused(host: str, port: int) -> OSError | None:
        """A TCP connect: a peer whose port refuses is gone (faster than a timeout)."""
        try:
            with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
                return None
        except OSError as exc:
            return exc

    def _ask(self, t: Transfer, host: str, port: int, request_id: str) -> wire.Message | None:
        """The peer's answer to a Ping; None when it is gone (``t`` failed) or alive
        but too busy to answer in time (``t`` stays, its deadline still bounds it)."""
        refused = self._refused(host, port)
        try:
            if refused is not None:
                raise PeerError(f"{host}:{port} refused the connection ({refused})")
            return self._ping(host, port, request_id, t.meta.capability, PING_TIMEOUT_S)
        except KvxferError as exc:
            if refused is None and self._refused(host, port) is None:
                # The port still accepts: the process lives (a dead one's port refuses,
                # a dead host's connect times out). A producer starved of CPU (seen
                # with vLLM on an overloaded host) can miss a Ping's deadline; failing
                # its transfer then would be a false alarm. Asked again after QUIET_S.
                log.debug("liveness probe of %s:%d unanswered, port open: %s", host, port, exc)
                self._alive(t)
                return None
            self._settler.fail(
                t,
                FailureKind.PEER_GONE,
                PeerError(
                    f"peer {host}:{port} gone: no answer to a liveness probe after "
                    f"{QUIET_S:g}s without progress ({exc})"
                ),
                FailureStage.TRANSFER,
            )
            return None

    def _alive(self, t: Transfer) -> None:
        t.meta.last_progress = time.monotonic()
        t.meta.probing = False

    def _probe_port(self, t: Transfer, host: str, port: int) -> None:
        refused = self._refused(host, port)
        if refused is None:
            self._alive(t)
            return
        self._settler.fail(
            t,
            FailureKind.PEER_GONE,
            PeerError(
                f"peer {host}:{port} gone: its side channel refused a liveness probe after "
                f"{QUIET_S:g}s without progress ({refused})"
            ),
            FailureStage.TRANSFER,
        )

    def _probe_pull(self, t: Transfer, host: str, port: int) -> None:
        reply = self._ask(t, host, port, "")
        if reply is None:
            return
        peer = t.meta.peer
        if (
            isinstance(reply, wire.Pong)
            and peer is not None
            and (reply.incarnation != peer.incarnation)
        ):
            self._settler.fail(
                t,
                FailureKind.PEER_GONE,
                PeerError(f"peer {host}:{port} restarted during the transfer: its blocks are gone"),
                FailureStage.TRANSFER,
            )
            return
        self._alive(t)

    def _probe_push(self, t: Transfer, host: str, port: int) -> None:
        reply = self._ask(t, host, port, t.request_id)
        if reply is None:
            return
        hold = reply.hold if isinstance(reply, wire.Pong) else None
        if hold is wire.HoldState.PUSHED:
            log.info("push of %s: notice lost; the producer says every write landed", t.request_id)
            self._settler.pushed(t)
        elif hold in (wire.HoldState.FAILED, wire.HoldState.RELEASED, wire.HoldState.UNKNOWN):
            assert isinstance(reply, wire.Pong)
            reason = reply.hold_reason or hold.value
            self._settler.fail(
                t,
                FailureKind.PEER_GONE,
                TransferError(f"the producer's hold of {t.request_id} is {hold.value}: {reason}"),
                FailureStage.NOTICE,
            )
        else:
            self._alive(t)
