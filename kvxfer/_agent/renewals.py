"""A consumer's lease renewals: asking producers to keep holds it will still read.

A producer holds a request's blocks for ``lease_s``; a decode request that waits in its
engine's queue longer than that would find the hold gone (R-XFER-4). :class:`Renewer`
sends each producer (every producer rank of the request, across TP sizes) one
:class:`~kvxfer.core.wire.Renew` naming the holds, and returns each hold's new expiry,
which the caller's pull then checks instead of the ticket's. A consumer that stops
renewing (it read, gave up or died) lets the holds end at their expiry, as before.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence

from kvxfer._agent.side_channel import SideChannel
from kvxfer._agent.tp_producers import ProducerGroup, rank_ticket
from kvxfer._agent.workers import IoPool
from kvxfer.agent_config import AgentStats
from kvxfer.core import wire
from kvxfer.errors import ConfigError, KvxferError
from kvxfer.ticket import Ticket

__all__ = ["Renewer"]

log = logging.getLogger("kvxfer.agent")

#: One renewal's budget per producer: short, so a dead producer costs a worker little
#: (the next renewal, a fraction of the lease later, tries again).
RENEW_TIMEOUT_S = 2.0


class Renewer:
    """Sends a consumer's Renew messages (internal; see :meth:`kvxfer.agent.Agent.renew`).

    Args:
        side: Sends the requests.
        group: The producer ranks of a ticket read across TP sizes.
        io: Runs :meth:`renew_later`'s work.
        stats: ``renewals_sent`` / ``renewals_refused``, updated under ``lock``.
        lock: The agent lock.
    """

    def __init__(
        self,
        side: SideChannel,
        group: ProducerGroup,
        io: IoPool,
        stats: AgentStats,
        lock: threading.RLock,
    ) -> None:
        self._side = side
        self._group = group
        self._io = io
        self._stats = stats
        self._lock = lock

    def renew(self, tickets: Sequence[Ticket]) -> list[float]:
        """Ask each ticket's producer ranks to keep its hold; blocks on the network.

        Returns:
            Per ticket, the earliest new expiry among its producer ranks (wall clock),
            or 0.0 where some rank did not renew (no such hold, or no answer).
        """
        by_address: dict[tuple[str, int], list[tuple[int, wire.RenewHold]]] = defaultdict(list)
        for i, ticket in enumerate(tickets):
            try:
                ranks = self._group.ranks(ticket) if self._group.wants(ticket) else None
                targets = [rank_ticket(ticket, r) for r in ranks] if ranks else [ticket]
            except ConfigError as exc:
                log.warning("cannot renew %s: %s", ticket.request_id, exc)
                targets = []
            for t in targets:
                hold = wire.RenewHold(request_id=t.request_id, capability=t.capability)
                by_address[(t.host, t.port)].append((i, hold))
        named = {i for holds in by_address.values() for i, _ in holds}
        best = [math.inf if i in named else 0.0 for i in range(len(tickets))]
        sent = 0
        for (host, port), holds in by_address.items():
            for start in range(0, len(holds), wire.MAX_RENEW):
                part = holds[start : start + wire.MAX_RENEW]
                sent += len(part)
                expiries = self._send(host, port, tuple(h for _, h in part))
                for (i, _), expiry in zip(part, expiries, strict=True):
                    best[i] = min(best[i], expiry)
        out = [0.0 if math.isinf(e) else e for e in best]
        with self._lock:
            self._stats.renewals_sent += sent
            self._stats.renewals_refused += sum(1 for e in out if e == 0.0)
        return out

    def renew_later(self, tickets: Sequence[Ticket], done: Callable[[list[float]], None]) -> bool:
        """:meth:`renew` on an io worker, then ``done(expiries)`` there; False when
        the agent is closing (nothing is sent)."""
        batch = list(tickets)
        return self._io.submit(lambda: done(self.renew(batch)))

    def _send(self, host: str, port: int, holds: tuple[wire.RenewHold, ...]) -> list[float]:
        msg = wire.Renew(holds=holds)
        try:
            reply = self._side.request(host, port, msg, timeout_s=RENEW_TIMEOUT_S, retries=1)
        except KvxferError as exc:
            log.warning("could not renew %d hold(s) at %s:%d: %s", len(holds), host, port, exc)
            return [0.0] * len(holds)
        if not isinstance(reply, wire.Renewed) or len(reply.expiries) != len(holds):
            log.warning("%s:%d answered a Renew with %s", host, port, type(reply).__name__)
            return [0.0] * len(holds)
        return list(reply.expiries)
