"""A producer's holds: the engine's hold() and what peers are told about them.

:meth:`HoldDesk.hold` leases a finished prompt's blocks and mints its ticket (the
capability and guard word in it, :mod:`kvxfer._agent.leases`). A consumer's
:class:`~kvxfer.core.wire.Release` frees a held request (or is remembered until its hold
comes), shown the hold's capability; a Ping that names a request is told how its hold
stands (:class:`~kvxfer.core.wire.HoldState`). The side channel (:mod:`kvxfer._agent.side_channel`)
dispatches both here, on its threads.
"""

from __future__ import annotations

import logging
import threading
import time

from kvxfer._agent.guard import FreeReason
from kvxfer._agent.leases import Lease, LeaseBook
from kvxfer._agent.local import LocalEnd
from kvxfer._agent.readers import ReaderCount
from kvxfer.core import wire
from kvxfer.ticket import Ticket

__all__ = ["HOLD_STATE_WAIT_S", "HoldDesk"]

log = logging.getLogger("kvxfer.agent")

#: The longest a Ping that names a request waits for the agent lock. Past it the Pong
#: says nothing of the hold (the pinger takes the peer for alive and asks again), so
#: that a lock held through a long call never holds up the side channel's thread.
HOLD_STATE_WAIT_S = 0.02


class HoldDesk:
    """A producer's holds, and its answers to peers about them (internal).

    Args:
        local: Identity (what a ticket names).
        leases: The holds (freed by a consumer's Release).
        readers: Counts the consumer ranks of a request read across TP sizes (a
            Release frees it once every reader released or finished).
        lock: The agent lock.
    """

    def __init__(
        self, local: LocalEnd, leases: LeaseBook, readers: ReaderCount, lock: threading.RLock
    ) -> None:
        self._local = local
        self._leases = leases
        self._readers = readers
        self._lock = lock

    def hold(
        self,
        request_id: str,
        groups: tuple[tuple[int, ...], ...],
        num_tokens: int,
        expiry: float,
        address: tuple[str, int],
        *,
        capability: str,
        guard: tuple[int, int] | None,
        pin: bool,
    ) -> tuple[Lease, Ticket] | Ticket:
        """Under the lock: the engine's :meth:`Agent.hold <kvxfer.agent.Agent.hold>` of
        checked blocks. Returns the ready lease and its ticket; the ticket alone when
        the consumer finished (or gave up) before the engine got here: the hold is
        freed at once, its guard word overwritten (a pull of it fails closed)."""
        leases = self._leases
        lease = leases.lease(request_id, groups, num_tokens, expiry)
        lease.blocks, lease.num_tokens, lease.expiry = groups, num_tokens, expiry
        lease.duration = max(expiry - time.time(), 0.0)  # what a renewal extends by
        leases.arm(lease, capability, guard, pin=pin)  # its token and guard word
        ticket = self._ticket(lease, address, guard)
        if leases.take_early(request_id):
            leases.free(request_id, FreeReason.RELEASED)
            return ticket
        return lease, ticket

    def _ticket(
        self, lease: Lease, address: tuple[str, int], asked: tuple[int, int] | None
    ) -> Ticket:
        # A caller's guard that could not be armed stays in its ticket (the vLLM
        # scheduler's did already): the word there differs, so its pulls fail closed.
        slot, generation = lease.guard or asked or (-1, 0)
        config = self._local.config
        host, port = address
        return Ticket(
            engine_id=config.engine_id,
            host=host,
            port=port,
            request_id=lease.request_id,
            block_ids=lease.blocks,
            num_tokens=lease.num_tokens,
            incarnation=self._local.incarnation,
            lease_expiry=lease.expiry,
            tp_size=config.tp.heads.tp_size if config.tp is not None else 1,
            capability=lease.capability,
            guard_slot=slot,
            generation=generation,
            # A plain attribute, set at registration (a hold comes after it).
            block_size=rules.block_size if (rules := self._local.rules) is not None else 0,
        )

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

    def renew(self, msg: wire.Renew) -> wire.Message:
        """A consumer's Renew (on a side-channel worker thread): each named hold this
        producer has for that capability runs its lease's length from now, at least
        (the ``lease_s`` its hold() was given)."""
        now, default = time.time(), self._local.config.lease_s
        with self._lock:
            expiries = tuple(
                self._leases.renew(h.request_id, h.capability, now, default) for h in msg.holds
            )
        log.debug(
            "peer %s renewed %d of %d hold(s)",
            msg.engine_id,
            sum(map(bool, expiries)),
            len(expiries),
        )
        return wire.Renewed(expiries=expiries)

    def state(self, request_id: str, capability: str) -> tuple[wire.HoldState | None, str]:
        """How the hold of ``request_id`` stands, for a Ping showing ``capability``
        (on the side channel's server thread: never waits long for the lock)."""
        if not self._lock.acquire(timeout=HOLD_STATE_WAIT_S):
            return None, "busy"
        try:
            return self._leases.hold_state(request_id, capability)
        finally:
            self._lock.release()
