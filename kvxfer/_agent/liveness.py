"""Liveness probes of quiet transfers (R-SAFE-4, R-SAFE-6): a dead peer within about a
second, a slow one never taken for dead.

A transport may take its own timeouts to notice a dead peer (a READ that never
completes), and a push's PUSHED or FAILED notice may be lost on the way. Neither should
be seen only at ``transfer_timeout_s``. A transfer that made no progress for
:data:`QUIET_S` is probed over the side channel, from the io workers.

Death needs evidence (R-SAFE-6): the peer's side-channel port refuses a connection, or
a connection to it is reset (a process that died: the kernel closes its ports), or the
peer answers as another incarnation (it restarted). A peer that accepts connections but
answers late, or a connect that merely times out (a loaded host; a frozen process whose
accept queue filled up, as this module's own probes fill it: 100 connections with zmq's
default backlog), is alive as far as a probe can tell: its transfer waits, bounded by
``transfer_timeout_s``.

- a pull's producer is pinged while a watch connection to its port stays open: no
  answer is not death, but the watch connection breaking (the process died while
  frozen or busy) ends the wait at once and a fresh connect then says;
  a pull whose handshake or post has not returned is probed by a connect only;
- a push reception asks the producer how its hold stands (``Ping(request_id,
  capability)`` → ``Pong.hold``): ``pushed`` settles it DONE (every write landed, the
  notice was lost), ``failed``/``released``/``unknown`` fail it with that reason,
  ``held``/``writing`` (or no word: the producer was busy) mean alive: asked again
  after another quiet period.

A producer with no route ("Network/host unreachable": a link down) is neither dead nor
done writing: its WRITE stays in flight in its kernel's TCP retransmissions and lands
when the route returns, whatever the consumer's keepalive did meanwhile (measured:
tens of MiB into reused blocks 4-8 s after a 13 s outage). Its reception is failed at
its deadline and stays quarantined until the producer, reachable again, says its write
ended (R-SAFE-5); only the consumer's own transport handle (a pull's READ) ends with
its connection.

A producer that *died* is proven gone at once (its port refuses), but its kernel still
holds what the WRITE had queued in the orphaned socket, and sends it on: over a live
link right away (measured on a 200 Mbit/s link: 876,739 elements landed after the
reception settled 0.11 s after the kill), after an outage at its next retransmission
(453,929-571,940 elements). The consumer's end of that connection does not stop them:
it has nothing to send, so neither keepalive nor a user timeout ends it. The orphaned
socket keeps the producer's stall limit (TCP's user timeout, which the producer
announced in its answer to the registration, :attr:`~kvxfer.core.wire.Ack.stall_limit_s`):
stalled that long, the kernel ends it, and a live link drains its few MiB long before.
So a reception whose producer is found gone, or answers as a new process (another
incarnation than its ticket's), stays quarantined for that limit plus
:data:`STALL_MARGIN_S` (``writer_until``). A producer that announced none (an older
one) is not waited for.
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from collections.abc import Callable
from functools import partial
from typing import Protocol

from kvxfer.core import wire
from kvxfer.errors import KvxferError, PeerError, TransferError
from kvxfer.io.control import dead, probe_port
from kvxfer.transfer import FailureKind, FailureStage, Transfer

__all__ = ["PING_TIMEOUT_S", "QUIET_S", "STALL_MARGIN_S", "Liveness"]

log = logging.getLogger("kvxfer.agent")

#: A transfer without progress this long gets a probe.
QUIET_S = 0.4
_NO_ROUTE = frozenset({errno.ENETUNREACH, errno.EHOSTUNREACH})

#: How long the Ping waits for its answer once the port accepted (the process lives,
#: but it may be frozen or starved of CPU on a loaded host).
PING_TIMEOUT_S = 1.0

#: Past the producer's stall limit, until its kernel surely ended the orphaned
#: connection: it checks the user timeout when a retransmission timer fires, which it
#: shortens to the time left (seconds of slack for timers and clocks).
STALL_MARGIN_S = 3.0


def _broken(watch: socket.socket) -> bool:
    """Whether the peer closed or reset the watch connection (what it sent is read
    and dropped: a zmq listener greets every connection)."""
    try:
        return watch.recv(4096, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


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


class Ping(Protocol):
    """Sends a Ping ``(host, port, request_id, capability, timeout_s)``, given up when
    ``cancel()`` says so, and returns the reply (raises a KvxferError when none came)."""

    def __call__(
        self,
        host: str,
        port: int,
        request_id: str,
        capability: str,
        timeout_s: float,
        cancel: Callable[[], bool] | None = None,
    ) -> wire.Message: ...


class Liveness:
    """Probes quiet transfers (internal).

    Args:
        ping: Sends a Ping (see :class:`Ping`).
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
            reception = meta.reception
            if reception is not None and reception.push_from is not None:
                if meta.posting:
                    continue
                host, port = reception.push_from
                job = (self._probe_push, t, host, port)
            elif meta.write is None and (meta.peer is not None or meta.producer_at is not None):
                # A pull, also one still in its first-contact handshake or in a post
                # that does not return (UCX connecting to a producer that died meanwhile
                # can take its own ~10 s), or a push reception whose registration has
                # not returned: its producer's side channel says.
                peer = meta.peer
                if peer is not None:
                    job = (self._probe_pull, t, peer.host, peer.port)
                else:
                    # Its handshake or post has not returned: only a port that refuses
                    # says the producer is gone (it may not answer a Ping yet).
                    assert meta.producer_at is not None
                    job = (self._probe_port, t, *meta.producer_at)
            else:
                continue  # a producer's push write
            meta.probing = True
            self._count()
            if not self._submit(*job):
                meta.probing = False

    def _ask(self, t: Transfer, host: str, port: int, request_id: str) -> wire.Message | None:
        """The peer's answer to a Ping; None when it is gone (``t`` failed) or gave no
        answer in time (``t`` stays, its deadline still bounds it)."""
        watch = probe_port(host, port)
        if isinstance(watch, OSError):
            self._verdict(t, host, port, watch)
            return None
        self._routed(t, host, port)
        with watch:
            try:
                return self._ping(
                    host,
                    port,
                    request_id,
                    t.meta.capability,
                    PING_TIMEOUT_S,
                    cancel=partial(_broken, watch),
                )
            except KvxferError as exc:
                log.debug("liveness probe of %s:%d unanswered: %s", host, port, exc)
            if not _broken(watch):
                # Still open: a dead process's connections are reset by its kernel, so
                # it lives and is only slow (and no further connect fills its queue).
                self._alive(t)
                return None
        # The watch connection broke: a fresh connect says whether the process is gone
        # (a dead one's port refuses) or only closed it.
        again = probe_port(host, port)
        if isinstance(again, OSError):
            self._verdict(t, host, port, again)
        else:
            again.close()
            self._alive(t)
        return None

    def _verdict(self, t: Transfer, host: str, port: int, exc: OSError) -> None:
        """A connect to the peer's port failed with ``exc``: gone on evidence, else
        (a timeout: a loaded host, a frozen peer's full accept queue) alive."""
        if not dead(exc):
            if self._unrouted(t, exc):
                pass  # said when the route went; probed on, quietly, until it returns
            elif t.doomed:
                log.info(
                    "liveness probe of %s:%d: no connection (%s); %s stays quarantined "
                    "until %s (R-SAFE-5)",
                    host,
                    port,
                    exc,
                    t.request_id,
                    "its producer says its write ended"
                    if t.meta.reception is not None
                    else "its transport handle ends",
                )
            else:
                log.info(
                    "liveness probe of %s:%d: no connection (%s); not evidence of death, "
                    "%s waits (its deadline bounds it)",
                    host,
                    port,
                    exc,
                    t.request_id,
                )
            self._alive(t)
            return
        self._orphaned(t, host, port)
        self._settler.fail(
            t,
            FailureKind.PEER_GONE,
            PeerError(
                f"peer {host}:{port} gone: its side channel refused or reset a liveness "
                f"probe after {QUIET_S:g}s without progress ({exc})"
            ),
            FailureStage.TRANSFER,
        )

    def _orphaned(self, t: Transfer, host: str, port: int) -> None:
        """``t``'s producer is gone, and its kernel may still send what its WRITE had
        queued: ``t`` waits until the kernel surely ended that orphaned socket (see the
        module's doc)."""
        reception = t.meta.reception
        if reception is None or not reception.producer_stall_s or reception.writer_until:
            return  # not a push reception, no limit announced, or said already
        wait = reception.producer_stall_s + STALL_MARGIN_S
        reception.writer_until = time.monotonic() + wait
        log.info(
            "%s: its producer %s:%d is gone; its blocks stay quarantined %.1f s more, "
            "until no byte its kernel kept can land (R-SAFE-5)",
            t.request_id,
            host,
            port,
            wait,
        )

    @staticmethod
    def _unrouted(t: Transfer, exc: OSError) -> bool:
        """Whether a push reception's producer had no route already at the previous
        probe (said once, not at every probe of a long outage); notes when it went.
        No route proves nothing about the producer's write (see the module's doc)."""
        reception = t.meta.reception
        if reception is None or exc.errno not in _NO_ROUTE:
            return False
        if reception.unreachable_since:
            return True
        reception.unreachable_since = time.monotonic()
        return False

    @staticmethod
    def _routed(t: Transfer, host: str, port: int) -> None:
        """The producer's port accepted: say how long its route was gone, if it was."""
        reception = t.meta.reception
        if reception is None or not reception.unreachable_since:
            return
        gone_s = time.monotonic() - reception.unreachable_since
        reception.unreachable_since = 0.0
        log.info(
            "liveness probe of %s:%d: a route again after %.1f s; asking how %s's write stands",
            host,
            port,
            gone_s,
            t.request_id,
        )

    def _alive(self, t: Transfer) -> None:
        t.meta.last_progress = time.monotonic()
        t.meta.probing = False

    def _probe_port(self, t: Transfer, host: str, port: int) -> None:
        conn = probe_port(host, port)
        if isinstance(conn, OSError):
            self._verdict(t, host, port, conn)
        else:
            conn.close()
            self._alive(t)

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
            known = t.meta.reception.producer_incarnation if t.meta.reception else 0
            if hold is wire.HoldState.UNKNOWN and known and reply.incarnation != known:
                self._orphaned(t, host, port)  # restarted: the old process died
            reason = reply.hold_reason or hold.value
            self._settler.fail(
                t,
                FailureKind.PEER_GONE,
                TransferError(f"the producer's hold of {t.request_id} is {hold.value}: {reason}"),
                FailureStage.NOTICE,
            )
        else:
            self._alive(t)
