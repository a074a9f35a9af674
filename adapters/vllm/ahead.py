"""Connecting ahead (``kv_connector_extra_config.connect_ahead``): a worker rank that
posts (a pull's consumer, a push's producer) handshakes with the configured peer
instances at start-up, so that the first request finds its connections made, the
endpoint wired up and, across TP sizes, its planners built
(:meth:`kvxfer.agent.Agent.connect_group`).

It runs on one daemon thread: vLLM's start-up never waits for it, and a peer that is
not up yet (instances start in any order) is tried again, with a growing pause, until
it answers or the worker closes. A request that comes first handshakes itself, as
without the option; the two share the handshake (the Agent caches peers by address).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from kvxfer.adapters.vllm.kv_transfer_config import PeerAddress
from kvxfer.agent import Agent
from kvxfer.errors import ConfigError, KvxferError

__all__ = ["ConnectAhead"]

log = logging.getLogger("kvxfer.adapters.vllm")

#: The first pause before trying an unanswered peer again, and the longest.
FIRST_RETRY_S = 0.5
MAX_RETRY_S = 5.0


class ConnectAhead:
    """Connects ``agent`` to each of ``peers`` in the background (see the module doc).

    Args:
        agent: The worker rank's registered, serving Agent.
        peers: The instances to connect to (``TransferConfig.connect_ahead``).
    """

    def __init__(self, agent: Agent, peers: Sequence[PeerAddress]) -> None:
        self._agent = agent
        self._peers = tuple(peers)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
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
        """Wait up to ``timeout_s`` for every peer to be connected (or given up)."""
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            for peer in self._peers:
                self._connect(peer)
                if self._stop.is_set():
                    return
        except Exception:  # never let the thread die silently
            log.exception("kvxfer: connect_ahead stopped")

    def _connect(self, peer: PeerAddress) -> None:
        pause, t0, said = FIRST_RETRY_S, time.monotonic(), False
        where = f"{peer.host}:{peer.port} (tp_size {peer.tp_size})"
        while not self._stop.is_set():
            try:
                got = self._agent.connect_group(peer.host, peer.port, peer.tp_size, peer.engine_id)
            except ConfigError as exc:
                # Retrying cannot fix it (a TP size that does not split the heads, ...).
                log.error("kvxfer: connect_ahead %s: giving up: %s", where, exc)
                return
            except KvxferError as exc:
                if not said:  # once: the peer may simply not be up yet
                    log.info("kvxfer: connect_ahead %s: no answer yet (%s); retrying", where, exc)
                    said = True
                self._stop.wait(pause)
                pause = min(2 * pause, MAX_RETRY_S)
                continue
            self.connected[(peer.host, peer.port)] = [p.port for p in got]
            log.info(
                "kvxfer: connected ahead to %s, ranks at ports %s, after %.2f s",
                where,
                [p.port for p in got],
                time.monotonic() - t0,
            )
            return
