"""Push receptions across tensor-parallel sizes: the consumer rank's side.

A consumer rank expecting a push from a producer
group of another TP size registers its receiving blocks with every producer rank
holding one of its heads (the ranks :func:`kvxfer.core.heads.source_ranks` names; rank *p*
at ``ticket.port + p``, as for a pull, :func:`kvxfer._agent.tp_producers.rank_ticket`). Each
registration names its producer rank (``PushRegister.source``, echoed in that rank's
PUSHED/FAILED notices so the receptions stay apart) and this consumer rank among the
``readers`` consumer ranks that rank writes to. One reception per producer rank, folded
by :class:`~kvxfer._agent.fanout.Fanout` into the one Transfer the engine sees: DONE once
every producer rank's final write landed; FAILED (every block invalid: each producer
rank writes a head slice of every block) otherwise, and the producer ranks whose write
did not land are told to release, which cancels what they still write.

Every registration shows the same capability (the router's token, or one this rank
minted), so a producer rank knows the consumer ranks of one request as one consumer.
The producer rank's side, what it writes into each consumer rank, is
:mod:`kvxfer._agent.tp_push_write`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvxfer._agent.fanout import Fanout
from kvxfer._agent.local import LocalEnd
from kvxfer._agent.receptions import Receptions
from kvxfer._agent.runtime import Runtime
from kvxfer._agent.tp_producers import ProducerGroup, rank_ticket
from kvxfer._agent.workers import IoPool
from kvxfer.core import blocks, wire
from kvxfer.ticket import Ticket
from kvxfer.transfer import ReceptionState, Transfer, TransferState

__all__ = ["TPReceiver"]


class TPReceiver:
    """A consumer rank's push receptions from producer groups of another TP size
    (internal).

    Args:
        local: This rank's identity and memory.
        group: The producer group's ranks, readers and releases.
        runtime: Makes and fails the receptions.
        receptions: Where the receptions await their notices.
        io: The agent's worker pool (registrations go from there).
        register: Sends one registration to one producer rank (its ticket) for one
            reception, failing the reception when it cannot be delivered.
    """

    def __init__(
        self,
        local: LocalEnd,
        group: ProducerGroup,
        runtime: Runtime,
        receptions: Receptions,
        io: IoPool,
        register: Callable[[Ticket, wire.PushRegister, Transfer], None],
    ) -> None:
        self._local = local
        self._group = group
        self._runtime = runtime
        self._receptions = receptions
        self._io = io
        self._register = register

    def expect(
        self,
        ticket: Ticket,
        local: blocks.Groups,
        tokens: int,
        capability: str,
        nbytes: int,
        address: tuple[str, int],
        agent_name: str,
    ) -> Transfer:
        """Register ``local`` with every producer rank holding one of this rank's heads;
        the returned transfer settles once all of them wrote.

        ``nbytes``: the bytes the whole blocks hold here (split among the producer ranks
        by the heads each supplies, for the stats).

        Raises:
            ConfigError: the ticket's TP size cannot split the model's heads, or a
                producer rank's port is past 65535 (nothing registered).
        """
        producer, sources = self._group.sources(ticket)
        ranks = tuple(sorted(set(sources.values())))
        tickets = {p: rank_ticket(ticket, p) for p in ranks}
        runtime = self._runtime
        config = self._local.config
        groups = blocks.to_wire(local)
        aggregate = Transfer(
            ticket.request_id,
            groups,
            progress=runtime.poll_tick,
            deadline=time.monotonic() + config.transfer_timeout_s,
        )
        subs = {p: runtime.new_transfer(ticket.request_id, groups) for p in ranks}
        Fanout(aggregate, subs, lambda failed: self._failed(ticket, subs))
        share = {p: sum(1 for r in sources.values() if r == p) for p in ranks}
        me = self._group.local_rank
        states: dict[int, ReceptionState] = {}
        for p, sub in subs.items():
            sub.meta.capability = capability
            sub.meta.reception = reception = ReceptionState(
                source=p, producer_incarnation=tickets[p].incarnation
            )
            sub.meta.producer_at = (tickets[p].host, tickets[p].port)  # probed while quiet
            sub.stats.bytes = nbytes * share[p] // max(1, len(sources))
            self._receptions.expect(sub)
            reception.writer_live = True  # from the registration on (R-SAFE-5)
            states[p] = reception
        for p, state in states.items():
            state.siblings = [other for q, other in states.items() if q != p]
        host, port = address
        for p, sub in subs.items():
            msg = wire.PushRegister(
                request_id=ticket.request_id,
                engine_id=config.engine_id,
                incarnation=self._local.incarnation,
                block_ids=groups,
                num_tokens=tokens,
                agent_name=agent_name,
                host=host,
                port=port,
                capability=capability,
                source=p,
                readers=self._group.readers(ticket, producer, p),
                reader=me,
            )
            self._io.submit(self._register, tickets[p], msg, sub)
        # Replicas of a head no consumer rank receives from: released now, not held
        # until their lease expires.
        self._group.release_unread(ticket, producer)
        return aggregate

    def _failed(self, ticket: Ticket, subs: dict[int, Transfer]) -> None:
        """The aggregate failed (under the lock): stop awaiting the other ranks, and
        tell each producer rank whose write did not land to release (it cancels its
        writes in flight, so none lands in blocks the engine recomputes)."""
        undone = []
        for p, sub in subs.items():
            self._receptions.unexpect(ticket.request_id, p)
            if sub.state is not TransferState.DONE:
                undone.append(p)
        if undone:
            self._group.release_all(ticket, tuple(undone))
