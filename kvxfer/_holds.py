"""What a producer answers on the side channel about its holds.

A consumer's :class:`~kvxfer.wire.Release` frees a held request (or is remembered
until its hold comes), shown the hold's capability; a Ping that names a request is
told how its hold stands (:class:`~kvxfer.wire.HoldState`). The side channel
(:mod:`kvxfer._side_channel`) dispatches both here, on its threads.
"""

from __future__ import annotations

import logging
import threading

from kvxfer import wire
from kvxfer._guard import FreeReason
from kvxfer._leases import LeaseBook
from kvxfer._readers import ReaderCount

__all__ = ["HOLD_STATE_WAIT_S", "HoldDesk"]

log = logging.getLogger("kvxfer.agent")

#: The longest a Ping that names a request waits for the agent lock. Past it the Pong
#: says nothing of the hold (the pinger takes the peer for alive and asks again), so
#: that a lock held through a long call never holds up the side channel's thread.
HOLD_STATE_WAIT_S = 0.02


class HoldDesk:
    """Answers peers about this producer's holds (internal).

    Args:
        leases: The holds (freed by a consumer's Release).
        readers: Counts the consumer ranks of a request read across TP sizes (a
            Release frees it once every reader released or finished).
        lock: The agent lock.
    """

    def __init__(self, leases: LeaseBook, readers: ReaderCount, lock: threading.RLock) -> None:
        self._leases = leases
        self._readers = readers
        self._lock = lock

    def release(self, msg: wire.Release) -> wire.Message:
        """A consumer's Release (on a side-channel worker thread)."""
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

    def state(self, request_id: str, capability: str) -> tuple[wire.HoldState | None, str]:
        """How the hold of ``request_id`` stands, for a Ping showing ``capability``
        (on the side channel's server thread: never waits long for the lock)."""
        if not self._lock.acquire(timeout=HOLD_STATE_WAIT_S):
            return None, "busy"
        try:
            return self._leases.hold_state(request_id, capability)
        finally:
            self._lock.release()
