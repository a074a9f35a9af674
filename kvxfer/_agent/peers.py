"""Handshaken peers, cached one per side-channel address (R-HS-4).

Concurrent requests to the same peer share one handshake: the first caller performs
it under the address's lock, the others wait for its result. A cached peer is reused
only while it is the same incarnation: a ticket naming another incarnation, or a
transfer that failed against the peer, forces a fresh handshake, so a restarted
producer is never served from a stale cache. A transfer's handshake keeps trying while
the peer's port accepts connections, until the transfer's deadline (R-SAFE-6: a peer
that answers late is slow, not dead); a port that refuses ends it at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvxfer._agent.local import LocalEnd
from kvxfer.agent_config import AgentStats
from kvxfer.backend import Backend, PeerHandle
from kvxfer.core.descriptors import DescriptorTable
from kvxfer.core.handshake import Initiator, PeerInfo
from kvxfer.core.heads import heads_per_region, pairing_heads, split_heads
from kvxfer.core.layout import KVLayout
from kvxfer.errors import (
    HandshakeRejected,
    HandshakeTimeout,
    KvxferError,
    LayoutError,
    PeerError,
    TransferError,
)
from kvxfer.io.control import SIDE_CHANNEL_HINT, SideChannelClient, dead, probe_port
from kvxfer.io.rails import rails_for_transfer, shared_rails
from kvxfer.transfer import PeerRef

__all__ = ["Peer", "PeerCache", "refused_pairing"]

log = logging.getLogger("kvxfer.agent")


class Peer:
    """A handshaken remote instance.

    Attributes:
        host, port: Its side-channel address.
        engine_id, incarnation: Who it is (a restart changes the incarnation).
        layout: The layout its memory is addressed by; ``table`` its descriptor table.
        handle: The backend's name for the connection.
    """

    def __init__(
        self, host: str, port: int, info: PeerInfo, table: DescriptorTable, handle: PeerHandle
    ) -> None:
        self.host = host
        self.port = port
        self.info = info
        self.engine_id = info.engine_id
        self.incarnation = info.incarnation
        self.layout: KVLayout = info.layout
        self.table = table
        self.handle = handle
        self.suspect = False
        self.rails: tuple[str, ...] = ()
        self.warmed = False  # its connection was used once ahead of any request

    def __repr__(self) -> str:
        return f"<Peer {self.engine_id}@{self.host}:{self.port} inc={self.incarnation:016x}>"


class PeerCache:
    """Peers by side-channel address, with one handshake per peer incarnation.

    Args:
        local: This agent's identity and registered memory (the handshake's hello).
        backend: Where a handshaken peer's descriptors are added (and removed).
        client: The side channel the handshakes go over.
        stats: Counts the handshakes.
        log_prefix: Starts the log line of a peer's first handshake.
    """

    def __init__(
        self,
        local: LocalEnd,
        backend: Backend,
        client: SideChannelClient,
        stats: AgentStats,
        log_prefix: str,
        connected: Callable[[], None] | None = None,
    ) -> None:
        self._local = local
        self._connected = connected
        self._backend = backend
        self._client = client
        self._stats = stats
        self._log_prefix = log_prefix
        self._lock = threading.Lock()
        self._addr_locks: dict[tuple[str, int], threading.Lock] = {}
        self._peers: dict[tuple[str, int], Peer] = {}
        self._announced: set[str] = set()

    def get(
        self,
        host: str,
        port: int,
        expected_engine_id: str | None,
        incarnation: int | None,
        *,
        until: float | None = None,
        cancel: Callable[[], bool] | None = None,
    ) -> Peer:
        """The peer at ``host:port``, handshaking if not cached or stale.

        ``until`` (a ``time.monotonic()`` deadline, a transfer's): a handshake whose
        tries all went unanswered starts over while the port still accepts, until then.
        ``cancel``: asked while a handshake waits for its answer; True gives it up
        with a HandshakeError (the transfer it was for failed meanwhile).

        Raises:
            HandshakeError, CompatError, LayoutMismatch, PeerError: the handshake failed.
        """
        key = (host, int(port))
        with self._lock:
            addr_lock = self._addr_locks.setdefault(key, threading.Lock())
        with addr_lock:
            peer = self._peers.get(key)
            if peer is not None and self._fresh(peer, expected_engine_id, incarnation):
                return peer
            if peer is not None and peer.suspect:
                # A transfer to it failed: its transport connection may be dead for
                # good (NIXL keeps a disconnected agent disconnected), so the handshake
                # below connects anew instead of reusing it.
                with self._lock:
                    self._peers.pop(key, None)
                try:
                    self._backend.remove_peer(peer.handle)
                except KvxferError as exc:
                    log.debug("removing suspect %r: %s", peer, exc)
            new = self._handshake(host, int(port), expected_engine_id, until, cancel)
            if incarnation is not None and new.incarnation != incarnation:
                # The ticket was issued by an earlier life of this producer: its blocks
                # are gone with it. Keep the new peer cached for later tickets.
                self._install(key, new)
                raise PeerError(
                    f"producer {new.engine_id} at {host}:{port} restarted (incarnation "
                    f"{incarnation:016x} -> {new.incarnation:016x}); the ticket's blocks are gone"
                )
            self._install(key, new)
            return new

    def cached(
        self, host: str, port: int, expected_engine_id: str | None, incarnation: int | None
    ) -> Peer | None:
        """The cached peer at ``host:port`` if usable as is (never handshakes)."""
        with self._lock:
            peer = self._peers.get((host, int(port)))
        if peer is not None and self._fresh(peer, expected_engine_id, incarnation):
            return peer
        return None

    @staticmethod
    def _fresh(peer: Peer, expected: str | None, incarnation: int | None) -> bool:
        if peer.suspect:
            return False
        if expected is not None and peer.engine_id != expected:
            return False
        return incarnation is None or peer.incarnation == incarnation

    def _install(self, key: tuple[str, int], peer: Peer) -> None:
        old = self._peers.get(key)
        self._peers[key] = peer
        if old is not None and old.handle != peer.handle:
            self._backend.remove_peer(old.handle)

    def _handshake(
        self,
        host: str,
        port: int,
        expected: str | None,
        until: float | None,
        cancel: Callable[[], bool] | None,
    ) -> Peer:
        local, config = self._local, self._local.config
        initiator = Initiator(
            hello=local.hello(expected),
            compat_hash=local.compat_hash,
            expected_engine_id=expected,
            enforce_compat=config.enforce_handshake_compat,
            local_layout=local.exposed_layout,
            auth_secret=config.auth_secret,
            address=f"{host}:{port}",
            max_bytes=config.max_message_bytes * 4,
        )
        self._reachable(host, port)
        while True:
            try:
                reply = self._client.request(host, port, initiator.hello(), cancel=cancel)
                break
            except HandshakeTimeout:
                if until is None or time.monotonic() >= until:
                    raise
                # Unanswered, not refused: the peer may be frozen or starved of CPU.
                self._reachable(host, port)
                log.info(
                    "%shandshake with %s:%d unanswered; its port accepts: trying again "
                    "(for %.1fs more at most)",
                    self._log_prefix,
                    host,
                    port,
                    until - time.monotonic(),
                )
        info = initiator.receive(reply)
        rails = self._rails(info, f"{host}:{port}")
        table = self._peer_table(info)
        handle = self._backend.add_peer(info.agent_metadata, table)
        if info.guard is not None and self._backend.capabilities.guard:
            try:
                self._backend.add_peer_guard(handle, info.guard)
            except KvxferError:
                self._backend.remove_peer(handle)
                raise
        self._stats.handshakes += 1
        if info.engine_id not in self._announced:
            self._announced.add(info.engine_id)
            log.info(
                "%sgot %d remote descriptor(s) for engine %s at %s:%d (%s)",
                self._log_prefix,
                len(table.addr),
                info.engine_id,
                host,
                port,
                info.layout.summary(),
            )
        peer = Peer(host, port, info, table, handle)
        peer.rails = rails
        if self._connected is not None:
            self._connected()  # the new endpoint is wired up as both sides progress
        return peer

    def _peer_table(self, info: PeerInfo) -> DescriptorTable:
        """The peer's descriptor table, derived from its layout. A peer of another TP
        size holding more heads per region than this agent posts at is cut to that
        (kvxfer.core.heads.pairing_heads): the same memory in narrower descriptors, so a
        producer of any TP size needs no per-head setting of its own. A cut that
        cannot be made (a token-major cache) leaves the table whole, and planning
        names why it cannot pair."""
        config, layout = self._local.config, info.layout
        mine, theirs, own = config.tp, info.tp, self._local.exposed_layout
        if mine is None or theirs is None or own is None or not self._local.posts:
            # A side that never posts (a push's consumer registering) plans nothing.
            return DescriptorTable.build(layout, config.plan)
        if mine.heads.tp_size == theirs.heads.tp_size:
            return DescriptorTable.build(layout, config.plan)
        try:
            have = heads_per_region(layout, theirs.heads, theirs.rank)
            per = pairing_heads(heads_per_region(own, mine.heads, mine.rank), have)
            if per < have:
                cut = split_heads(layout, theirs.heads, theirs.rank, per)
                return DescriptorTable.build(cut, config.plan)
        except KvxferError as exc:
            log.debug("%s: its table stays whole (%s)", info.engine_id, exc)
        return DescriptorTable.build(layout, config.plan)

    @staticmethod
    def _reachable(host: str, port: int) -> None:
        """Raise PeerError when the port refuses (or resets) a connection: nobody
        listens there, so a first contact to a dead peer fails at once, not after every
        handshake try (R-SAFE-4). A connect that times out proves nothing (R-SAFE-6):
        the handshake's tries say."""
        conn = probe_port(host, port)
        if not isinstance(conn, OSError):
            conn.close()
            return
        if dead(conn):
            raise PeerError(
                f"side channel {host}:{port} does not accept connections ({conn}): "
                f"the peer is not running or not reachable; {SIDE_CHANNEL_HINT}"
            ) from conn
        log.info("side channel %s:%d: no connection yet (%s)", host, port, conn)

    def _rails(self, info: PeerInfo, address: str) -> tuple[str, ...]:
        """The rails a transfer to this peer uses (R-RAIL-3); () when either side has none."""
        local = self._local.config.rails
        if not local or not info.rails:
            return ()
        shared = shared_rails(local, info.rails)
        if not shared:
            raise PeerError(
                f"peer {info.engine_id} at {address} shares no rail with us "
                f"(local {list(local)}, remote {list(info.rails)}); "
                "both need a NIC on the same fabric"
            )
        return tuple(rails_for_transfer(shared, self._local.config.stripe_width))

    def mark_suspect(self, peer: PeerRef) -> None:
        """Re-handshake before the next use (a transfer against it failed)."""
        peer.suspect = True

    def drop_suspect(self, peer: PeerRef) -> None:
        """Forget a suspect peer now and remove it from the backend, rather than at its
        next use: the transport then ends what is still in flight on its connection
        (NIXL fails the transfers of a removed agent), so a transfer stuck on a dead
        connection does not wait for the next request to that peer. Idempotent."""
        if not peer.suspect:
            return
        key = (peer.host, int(peer.port))
        with self._lock:
            if self._peers.get(key) is not peer:
                return  # dropped already, or replaced by a new handshake
            self._peers.pop(key, None)
        try:
            self._backend.remove_peer(peer.handle)
        except KvxferError as exc:
            log.debug("removing suspect %r: %s", peer, exc)

    def close(self) -> None:
        """Forget every peer and remove it from the backend."""
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            try:
                self._backend.remove_peer(peer.handle)
            except KvxferError as exc:
                log.debug("removing %r: %s", peer, exc)


def refused_pairing(error: BaseException | None) -> bool:
    """True when the producer answered the handshake and refused to pair with us
    (layout, role): it can be told to release what it holds. ``error`` is the
    handshake's, or a failed transfer's whose cause it is."""
    cause = error.__cause__ if isinstance(error, TransferError) and error.__cause__ else error
    if isinstance(cause, LayoutError):
        return True
    return isinstance(cause, HandshakeRejected) and cause.code in ("layout", "role")
