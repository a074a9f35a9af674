"""Connecting ahead (``kv_connector_extra_config.connect_ahead``): a worker rank that
posts (a pull's consumer, a push's producer) handshakes with the configured peer
instances at start-up, so that the first request finds its connections made, the
endpoint wired up and, across TP sizes, its planners built
(:meth:`kvxfer.agent.Agent.connect_group`).

It runs on one daemon thread: vLLM's start-up never waits for it, and a peer that is
not up yet (instances start in any order) is tried again, with a growing pause, until
it answers or the worker closes. A request that comes first handshakes itself, as
without the option; the two share the handshake (the Agent caches peers by address).

A peer with ``refresh_s`` names a set of instances rather than one: a Kubernetes
headless Service, say, whose name resolves to the address of every ready pod behind
it. Each address is one instance, connected by that address (what its tickets carry
when it advertises its pod IP), and the name is resolved again every ``refresh_s``
seconds: a prefill pod that joins later is connected before a router sends it the
first request. Addresses that leave the name are forgotten (a pod that comes back
under one is connected again).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

import msgspec

from kvxfer.adapters.vllm.kv_transfer_config import PeerAddress
from kvxfer.agent import Agent
from kvxfer.errors import ConfigError, KvxferError

__all__ = ["ConnectAhead", "Resolve", "resolve_addresses"]

log = logging.getLogger("kvxfer.adapters.vllm")

#: The first pause before trying an unanswered peer again, and the longest.
FIRST_RETRY_S = 0.5
MAX_RETRY_S = 5.0

#: ``resolve(host, port)``: the addresses ``host`` names now (OSError or ValueError:
#: none).
Resolve = Callable[[str, int], list[str]]


def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to for a TCP connection, in the resolver's
    order, each once.

    Raises:
        OSError: the name does not resolve (``socket.gaierror``).
        ValueError: a name IDNA cannot encode (``UnicodeError``, e.g. an empty label).
    """
    out: list[str] = []
    for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        addr = str(sockaddr[0])
        if addr not in out:
            out.append(addr)
    return out


@dataclasses.dataclass
class _Target:
    """One instance to connect to, and when to try it next."""

    peer: PeerAddress  # host: the name as configured, or one address the name gave
    origin: str = ""  # "name:port" of the refreshed peer it was found under
    t0: float = dataclasses.field(default_factory=time.monotonic)
    due: float = 0.0
    pause: float = 0.0
    said: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return self.peer.host, self.peer.port

    @property
    def where(self) -> str:
        return f"{self.peer.host}:{self.peer.port} (tp_size {self.peer.tp_size})"


@dataclasses.dataclass
class _Name:
    """A peer whose name is resolved every ``refresh_s``."""

    peer: PeerAddress
    due: float = 0.0
    found: tuple[str, ...] = ()  # the addresses it gave last
    said: bool = False  # its failure to resolve was logged (once per streak)


class ConnectAhead:
    """Connects ``agent`` to each of ``peers`` in the background (see the module doc).

    Args:
        agent: The worker rank's registered, serving Agent.
        peers: The instances to connect to (``TransferConfig.connect_ahead``).
        resolve: Names to addresses, for peers with ``refresh_s`` (tests give their own).
    """

    def __init__(
        self,
        agent: Agent,
        peers: Sequence[PeerAddress],
        *,
        resolve: Resolve = resolve_addresses,
    ) -> None:
        self._agent = agent
        self._peers = tuple(peers)
        self._resolve = resolve
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._targets: dict[tuple[str, int], _Target] = {}
        self._names = [_Name(p) for p in self._peers if p.refresh_s > 0]
        #: Peer addresses connected so far, with their ranks' ports (for logs and tests).
        self.connected: dict[tuple[str, int], list[int]] = {}

    def start(self) -> None:
        """Start the thread (once; nothing to do without peers)."""
        if self._thread is not None or not self._peers:
            return
        self._thread = threading.Thread(target=self._run, name="kvxfer-connect-ahead", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop trying; wait up to ``timeout_s`` for a handshake in progress."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def done(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every peer to be connected (or given up). With
        a peer of ``refresh_s`` it never is: the thread resolves until stopped."""
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            for peer in self._peers:
                if peer.refresh_s <= 0:
                    self._add(_Target(peer))
            while not self._stop.is_set():
                now = time.monotonic()
                for name in self._names:
                    if name.due <= now:
                        self._refresh(name)
                for target in list(self._targets.values()):
                    if self._stop.is_set():
                        return
                    if target.key not in self.connected and target.due <= time.monotonic():
                        self._try(target)
                pending = [t.due for t in self._targets.values() if t.key not in self.connected]
                dues = pending + [n.due for n in self._names]
                if not dues:
                    return  # every configured instance connected or given up
                self._stop.wait(max(0.0, min(dues) - time.monotonic()))
        except Exception:  # never let the thread die silently
            log.exception("kvxfer: connect_ahead stopped")

    def _add(self, target: _Target) -> None:
        target.pause = FIRST_RETRY_S
        self._targets[target.key] = target

    def _refresh(self, name: _Name) -> None:
        """Resolve ``name`` again: connect the addresses it gained, forget those it lost."""
        peer = name.peer
        name.due = time.monotonic() + peer.refresh_s
        try:
            found = tuple(self._resolve(peer.host, peer.port))
        except (OSError, ValueError) as exc:  # ValueError: a name IDNA cannot encode
            if not name.said:  # once per streak: the Service may have no ready pod yet
                log.info(
                    "kvxfer: connect_ahead %s:%d resolves to nothing yet (%s); again every %.0f s",
                    peer.host,
                    peer.port,
                    exc,
                    peer.refresh_s,
                )
                name.said = True
            found = ()
        else:
            name.said = False
        origin = f"{peer.host}:{peer.port}"
        gone = [a for a in name.found if a not in found]
        new = [a for a in found if a not in name.found]
        for addr in gone:
            key = (addr, peer.port)
            target = self._targets.get(key)
            if target is not None and target.origin == origin:
                del self._targets[key]
                self.connected.pop(key, None)
        if gone:
            log.info("kvxfer: connect_ahead %s no longer resolves to %s", origin, gone)
        if new:
            log.info("kvxfer: connect_ahead %s resolves to new instance(s) %s", origin, new)
        for addr in new:
            if (addr, peer.port) not in self._targets:  # also listed by address
                at = msgspec.structs.replace(peer, host=addr, refresh_s=0.0)
                self._add(_Target(at, origin=origin))
        name.found = found

    def _try(self, target: _Target) -> None:
        """One connection attempt (each rank of the instance this rank transfers with)."""
        peer = target.peer
        try:
            got = self._agent.connect_group(peer.host, peer.port, peer.tp_size, peer.engine_id)
        except ConfigError as exc:
            # Retrying cannot fix it (a TP size that does not split the heads, ...).
            log.error("kvxfer: connect_ahead %s: giving up: %s", target.where, exc)
            del self._targets[target.key]
            return
        except KvxferError as exc:
            if not target.said:  # once: the peer may simply not be up yet
                log.info(
                    "kvxfer: connect_ahead %s: no answer yet (%s); retrying", target.where, exc
                )
                target.said = True
            target.due = time.monotonic() + target.pause
            target.pause = min(2 * target.pause, MAX_RETRY_S)
            return
        self.connected[target.key] = [p.port for p in got]
        log.info(
            "kvxfer: connected ahead to %s, ranks at ports %s, after %.2f s%s",
            target.where,
            [p.port for p in got],
            time.monotonic() - target.t0,
            f" (found under {target.origin})" if target.origin else "",
        )
