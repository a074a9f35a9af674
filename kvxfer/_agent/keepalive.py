"""A consumer's keep-alive: renewing holds it will still read, off the engine's loop.

A request can wait in the consumer engine's queue longer than the producer's lease
(R-XFER-4). Renewals sent from the engine's step loop stop whenever one step runs long
(a long prefill beside it, a host at load 8 on 2 cores) and the hold can end although
both sides are alive. :class:`KeepAlive` renews on the agent's own timer and io
threads instead: each hold when a third of its lease is left (less ``lease_guard_s``),
until its read starts (:meth:`KeepAlive.take`, called by the agent's pull), the caller
drops it (an abort), or it lapses:

* the producer did not renew it before its known expiry passed (the hold is gone or
  the producer is unreachable; a slow answer is retried while the hold still runs), or
* ``renew_limit_s`` passed since it was added: an entry the engine forgot can pin a
  producer's blocks no longer than that.

A consumer that dies stops renewing with it, and the holds end at their expiry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence

import msgspec

from kvxfer._agent.renewals import Renewer
from kvxfer._agent.workers import IoPool
from kvxfer.agent_config import AgentStats
from kvxfer.ticket import Ticket

__all__ = ["MAX_RENEW_S", "MIN_RENEW_S", "KeepAlive", "renew_interval"]

log = logging.getLogger("kvxfer.agent")

#: Bounds of the wait before a hold's next renewal (seconds): a third of what is left
#: of its lease, less the guard, so that two renewals can go unanswered before it ends.
MIN_RENEW_S = 0.2
MAX_RENEW_S = 10.0

#: Which hold an entry renews: one per producer address and producer request.
_Key = tuple[str, str, int, str]


def renew_interval(expiry: float, now: float, guard_s: float) -> float:
    """Seconds until a hold that ends at ``expiry`` (wall clock) is renewed, at
    wall-clock ``now``: a third of the time left before the consumer's guard, within
    [:data:`MIN_RENEW_S`, :data:`MAX_RENEW_S`]."""
    return min(max((expiry - guard_s - now) / 3, MIN_RENEW_S), MAX_RENEW_S)


def _key(ticket: Ticket) -> _Key:
    return (ticket.engine_id, ticket.host, ticket.port, ticket.request_id)


class _Entry(msgspec.Struct, kw_only=True):
    ticket: Ticket
    expiry: float  # the latest expiry the producer answered (wall clock)
    since: float  # when it was added (time.monotonic())
    next_at: float  # when it is renewed next (time.monotonic())
    in_flight: bool = False


class KeepAlive:
    """Renews a consumer's holds until they are read (internal; see
    :meth:`kvxfer.agent.Agent.keep_alive`).

    Args:
        renewer: Sends the Renew messages (blocking; run on ``io``'s workers).
        io: Its timer schedules the sweeps that find holds due.
        guard_s: The consumer's ``lease_guard_s``.
        limit_s: The longest a hold is renewed after it was added.
        stats: ``renewals_lapsed``, updated under ``lock``.
        lock: The agent lock.
    """

    def __init__(
        self,
        renewer: Renewer,
        io: IoPool,
        guard_s: float,
        limit_s: float,
        stats: AgentStats,
        lock: threading.RLock,
    ) -> None:
        self._renewer = renewer
        self._io = io
        self._guard_s = guard_s
        self._limit_s = limit_s
        self._stats = stats
        self._agent_lock = lock
        # Its own lock: the agent lock is held across posts; a sweep must not wait on one.
        self._mutex = threading.Lock()
        self._entries: dict[_Key, _Entry] = {}
        self._sweep_at: float | None = None  # the armed sweep's due time (monotonic)
        self._generation = 0  # an armed sweep of an older generation does nothing

    def add(self, tickets: Sequence[Ticket]) -> int:
        """Keep renewing each ticket's hold (one already kept stays as it is); returns
        how many were added. A ticket without a ``lease_expiry``, or whose expiry has
        passed, is not added: there is nothing left to renew."""
        now_w, now_m = time.time(), time.monotonic()
        added = 0
        with self._mutex:
            for ticket in tickets:
                key = _key(ticket)
                expiry = ticket.lease_expiry
                if key in self._entries or not expiry > now_w:
                    continue
                self._entries[key] = _Entry(
                    ticket=ticket,
                    expiry=expiry,
                    since=now_m,
                    next_at=now_m + renew_interval(expiry, now_w, self._guard_s),
                )
                added += 1
            self._arm()
        return added

    def take(self, ticket: Ticket) -> Ticket:
        """Stop renewing ``ticket``'s hold: its read starts now. Returns the ticket
        with the latest expiry its producer answered (the ticket itself when that is
        not later, or when it was not kept)."""
        with self._mutex:
            entry = self._entries.pop(_key(ticket), None)
        if entry is not None and entry.expiry > ticket.lease_expiry:
            return msgspec.structs.replace(ticket, lease_expiry=entry.expiry)
        return ticket

    def drop(self, ticket: Ticket) -> bool:
        """Stop renewing ``ticket``'s hold (given up); whether it was kept."""
        with self._mutex:
            return self._entries.pop(_key(ticket), None) is not None

    def kept(self) -> int:
        """How many holds are being renewed now."""
        with self._mutex:
            return len(self._entries)

    # -- the timer's side ---------------------------------------------------------------
    def _arm(self) -> None:
        """Under the mutex: a sweep at the earliest renewal due, unless one is armed
        at or before it."""
        due = [e.next_at for e in self._entries.values() if not e.in_flight]
        if not due:
            return
        at = min(due)
        if self._sweep_at is not None and self._sweep_at <= at:
            return
        self._generation += 1
        self._sweep_at = at
        self._io.later(max(0.0, at - time.monotonic()), self._sweep, self._generation)

    def _sweep(self, generation: int) -> None:
        """On the io timer's worker: send the due renewals, one batch per producer."""
        lapsed: list[tuple[str, str]] = []
        batches: dict[tuple[str, int], list[tuple[_Key, _Entry]]] = defaultdict(list)
        with self._mutex:
            if generation != self._generation:
                return  # superseded by an earlier sweep, which armed the next
            self._sweep_at = None
            now_w, now_m = time.time(), time.monotonic()
            for key, entry in list(self._entries.items()):
                if entry.in_flight:
                    continue
                if entry.expiry - self._guard_s <= now_w:
                    lapsed.append((entry.ticket.request_id, "its lease ended unrenewed"))
                elif now_m - entry.since > self._limit_s:
                    lapsed.append((entry.ticket.request_id, "renew_limit_s passed"))
                elif entry.next_at <= now_m:
                    entry.in_flight = True
                    batches[(entry.ticket.host, entry.ticket.port)].append((key, entry))
                    continue
                else:
                    continue
                del self._entries[key]
            self._arm()
        if lapsed:
            with self._agent_lock:
                self._stats.renewals_lapsed += len(lapsed)
            for request_id, why in lapsed:
                log.warning("stopped renewing the hold of %s: %s", request_id, why)
        for batch in batches.values():
            # One io worker per producer: a producer that does not answer delays
            # only its own holds' renewals.
            if not self._io.submit(self._renew, batch):
                return  # the agent is closing

    def _renew(self, batch: list[tuple[_Key, _Entry]]) -> None:
        expiries = self._renewer.renew([entry.ticket for _, entry in batch])
        now_w, now_m = time.time(), time.monotonic()
        with self._mutex:
            for (key, entry), expiry in zip(batch, expiries, strict=True):
                entry.in_flight = False
                if self._entries.get(key) is not entry:
                    continue  # read or dropped meanwhile
                if expiry > entry.expiry:
                    entry.expiry = expiry
                # Not renewed: tried again soon while the hold still runs (a slow
                # producer is not a dead one); the sweep lapses it once it ended.
                wait = renew_interval(entry.expiry, now_w, self._guard_s) if expiry else 0.0
                entry.next_at = now_m + max(wait, MIN_RENEW_S)
            self._arm()
