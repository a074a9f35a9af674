"""Pushes across tensor-parallel sizes: each producer rank writes the heads that each
consumer rank holds.

Consumer side (:class:`TPReceiver`): a consumer rank expecting a push from a producer
group of another TP size registers its receiving blocks with every producer rank
holding one of its heads (the ranks :func:`kvxfer.heads.source_ranks` names; rank *p*
at ``ticket.port + p``, as for a pull, :func:`kvxfer._tp.rank_ticket`). Each
registration names its producer rank (``PushRegister.source``, echoed in that rank's
PUSHED/FAILED notices so the receptions stay apart) and this consumer rank among the
``readers`` consumer ranks that rank writes to. One reception per producer rank, folded
by :class:`~kvxfer._fanout.Fanout` into the one Transfer the engine sees: DONE once
every producer rank's final write landed; FAILED (every block invalid: each producer
rank writes a head slice of every block) otherwise, and the producer ranks whose write
did not land are told to release, which cancels what they still write.

Every registration shows the same capability (the router's token, or one this rank
minted), so a producer rank knows the consumer ranks of one request as one consumer.

Producer side (:class:`WritePlanner`): once a write's consumer is handshaken, its
``Welcome.tp`` says which heads it holds; a consumer of another TP size gets only
those heads this rank holds, planned by the consumer's own
:class:`~kvxfer.tp_plan.TPPlanner` restricted to this rank (``only``) with the sides
swapped for a WRITE. The producer's lease ends once all ``readers`` consumer ranks got
their writes (:attr:`kvxfer._leases.Lease.all_written`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import zlib
from collections.abc import Callable

import numpy as np

from kvxfer import blocks, wire
from kvxfer._fanout import Fanout
from kvxfer._io import IoPool
from kvxfer._local import LocalEnd
from kvxfer._peers import Peer
from kvxfer._receptions import Receptions
from kvxfer._runtime import Runtime
from kvxfer._tp import TPPuller, rank_ticket
from kvxfer.descriptors import Plan
from kvxfer.errors import ConfigError
from kvxfer.heads import heads_per_region, source_ranks
from kvxfer.ticket import Ticket
from kvxfer.tp_plan import TPPlanner
from kvxfer.transfer import Transfer, TransferState

__all__ = ["TPReceiver", "WritePlanner"]

#: Write planners kept per agent (one per consumer rank and replica choice).
_MAX_PLANNERS = 64


class WritePlanner:
    """A producer rank's plans of writes into consumer ranks of another TP size
    (internal).

    Args:
        local: This rank's identity (``config.tp``) and registered memory.
        lock: The agent lock (guards the planner cache).
    """

    def __init__(self, local: LocalEnd, lock: threading.RLock) -> None:
        self._local = local
        self._lock = lock
        self._planners: dict[tuple[object, ...], TPPlanner] = {}

    def plan(
        self,
        peer: Peer,
        target: wire.PushRegister,
        local: tuple[tuple[int, ...], ...],
        remote: tuple[tuple[int, ...], ...],
        tokens: int,
    ) -> Plan | None:
        """The plan of one write of ``local`` into the consumer's ``remote`` blocks when
        the consumer's TP size differs from ours; None when it does not (whole blocks,
        the ordinary plan).

        Raises:
            ConfigError: the registration is for another producer rank, or asks for a
                rank-split write this pair cannot make (no TP identity on one side).
            LayoutMismatch, PlanError: the heads cannot be exchanged.
        """
        mine = self._local.config.tp
        theirs = peer.info.tp
        if mine is None or theirs is None or mine.heads.tp_size == theirs.heads.tp_size:
            if target.readers > 1 or target.source:
                raise ConfigError(
                    "PushRegister.source",
                    target.source,
                    "a registration across TP sizes needs both sides' TP identity "
                    "(AgentConfig.tp) and different TP sizes",
                )
            return None
        if target.source != mine.rank:
            raise ConfigError(
                "PushRegister.source", target.source, f"this is producer rank {mine.rank}"
            )
        salt = zlib.crc32(target.request_id.encode())
        sources = source_ranks(theirs.heads, theirs.rank, mine.heads, salt=salt)
        key = (id(peer), peer.incarnation, tuple(sorted(sources.items())))
        with self._lock:
            planner = self._planners.get(key)
        if planner is None:
            # The consumer's table was cut at its handshake to what this rank posts
            # at (kvxfer._peers); ours is the whole table or its one-head section.
            cut = heads_per_region(peer.table.layout, theirs.heads, theirs.rank)
            table, offset = self._local.posting_table(cut)
            planner = TPPlanner.build(
                peer.table,
                {mine.rank: table},
                local_heads=theirs.heads,
                remote_heads=mine.heads,
                local_rank=theirs.rank,
                salt=salt,
                only=(mine.rank,),
                remote_offset=offset,
            )
            with self._lock:
                if len(self._planners) >= _MAX_PLANNERS:
                    self._planners.pop(next(iter(self._planners)))
                self._planners[key] = planner
        # Planned as the consumer rank would read from us; a WRITE swaps the sides.
        (part,) = planner.plan(blocks.from_wire(remote), blocks.from_wire(local), tokens)
        read = part.plan
        return dataclasses.replace(
            read,
            local_ids=read.remote_ids,
            remote_ids=read.local_ids,
            local_blocks=tuple(np.asarray(g, dtype=np.int64) for g in local),
        )


class TPReceiver:
    """A consumer rank's push receptions from producer groups of another TP size
    (internal).

    Args:
        local: This rank's identity and memory.
        tp: The pull side's view of the producer group (its ranks, readers, releases).
        runtime: Makes and fails the receptions.
        receptions: Where the receptions await their notices.
        io: The agent's worker pool (registrations go from there).
        register: Sends one registration to one producer rank (its ticket) for one
            reception, failing the reception when it cannot be delivered.
    """

    def __init__(
        self,
        local: LocalEnd,
        tp: TPPuller,
        runtime: Runtime,
        receptions: Receptions,
        io: Callable[[], IoPool],
        register: Callable[[Ticket, wire.PushRegister, Transfer], None],
    ) -> None:
        self._local = local
        self._tp = tp
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
        producer, sources = self._tp.sources(ticket)
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
        me = self._tp.local_rank
        for p, sub in subs.items():
            sub.meta.capability = capability
            sub.meta.push_source = p
            sub.meta.producer_at = (tickets[p].host, tickets[p].port)  # probed while quiet
            sub.stats.bytes = nbytes * share[p] // max(1, len(sources))
            self._receptions.expect(sub)
            sub.meta.writer_live = True  # from the registration on (R-SAFE-5)
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
                readers=self._tp.readers(ticket, producer, p),
                reader=me,
            )
            self._io().submit(self._register, tickets[p], msg, sub)
        # Replicas of a head no consumer rank receives from: released now, not held
        # until their lease expires.
        self._tp.release_unread(ticket, producer)
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
            self._tp.release_all(ticket, tuple(undone))
