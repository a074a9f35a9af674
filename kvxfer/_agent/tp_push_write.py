"""Pushes across tensor-parallel sizes: the producer rank's side.

Once a write's consumer is handshaken, its ``Welcome.tp`` says which heads it holds; a
consumer of another TP size gets only those heads this rank holds, planned by the
consumer's own :class:`~kvxfer.core.tp_plan.TPPlanner` restricted to this rank (``only``)
with the sides swapped for a WRITE. The producer's lease ends once all ``readers``
consumer ranks got their writes (:attr:`kvxfer._agent.leases.Lease.all_written`). The
consumer rank's side (its registrations with each producer rank) is
:mod:`kvxfer._agent.tp_push_receive`; the two share no code, only the wire messages.

A hybrid model's writes (Mamba2 / Gated DeltaNet state groups beside attention) are
planned by the consumer rank's :class:`~kvxfer.core.state_tp_plan.HybridTPPlanner`
restricted to this rank, from the consumer's announced state split
(``Welcome.tp.state``), and posted as address runs with the sides swapped: each
consumer rank gets its KV heads and its units of every state slot (conv
sub-projections, SSM heads) that this rank holds.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import zlib
from collections.abc import Callable

import numpy as np

from kvxfer._agent.local import LocalEnd
from kvxfer._agent.peers import Peer
from kvxfer.core import blocks, wire
from kvxfer.core.block_lists import ChainLists, ChainPlan
from kvxfer.core.descriptors import Plan, Runs
from kvxfer.core.heads import TPRank, heads_per_region, source_choices, source_ranks
from kvxfer.core.state_tp_plan import HybridTPPlanner
from kvxfer.core.tp_plan import TPPlanner
from kvxfer.errors import ConfigError, KvxferError
from kvxfer.types import Direction, Role

__all__ = ["WritePlanner"]

log = logging.getLogger("kvxfer.agent")

#: Write planners kept per agent (one per consumer rank and replica choice).
_MAX_PLANNERS = 64


class WritePlanner:
    """A producer rank's plans of writes into consumer ranks of another TP size
    (internal).

    Args:
        local: This rank's identity (``config.tp``) and registered memory.
        lock: The agent lock (guards the planner cache).
        prepare_lists: Prepares chain lists with a consumer
            (:meth:`Runtime.prepare_lists <kvxfer._agent.runtime.Runtime.prepare_lists>`);
            False where the backend posts ids.
    """

    def __init__(
        self,
        local: LocalEnd,
        lock: threading.RLock,
        prepare_lists: Callable[[Peer, ChainLists], bool],
    ) -> None:
        self._local = local
        self._lock = lock
        self._prepare_lists = prepare_lists
        # Per consumer, incarnation and replica choice: the planner, and this rank's
        # chain lists into that consumer where the backend prepared them.
        self._planners: dict[tuple[object, ...], tuple[TPPlanner, ChainLists | None]] = {}
        self._hybrid: dict[tuple[object, ...], HybridTPPlanner] = {}
        # One build at a time: a write starting while connect() builds the same planner
        # waits for it instead of building it (and preparing its lists) a second time.
        self._building = threading.Lock()

    def prepare(self, peer: Peer) -> None:
        """The engine connected to ``peer`` ahead of its pushes (:meth:`Agent.connect
        <kvxfer.agent.Agent.connect>`): when it is a consumer rank of another TP size,
        build the planners of this rank's writes into it now (one per replica choice:
        one unless this group replicates heads), so that the first push does not pay
        3-10 ms for them (issue 27). One that cannot be built is left to the first
        write, which names what is wrong."""
        theirs = peer.info.tp
        mine = self._local.across_tp(theirs, Role.PRODUCER, Direction.PUSH)
        if mine is None or theirs is None:
            return
        try:
            for salt, sources in source_choices(theirs.heads, theirs.rank, mine.heads):
                if mine.rank in sources.values():
                    self._planner(peer, theirs, mine, sources, salt)
        except KvxferError as exc:
            log.debug("write planner into %s not prepared: %s", peer, exc)

    def _planner(
        self, peer: Peer, theirs: TPRank, mine: TPRank, sources: dict[int, int], salt: int
    ) -> tuple[TPPlanner, ChainLists | None]:
        """The planner of this rank's writes of ``sources`` into ``peer`` (cached per
        consumer, its incarnation and the replica choice ``salt`` made), and this
        rank's chain lists into it when prepared (:mod:`kvxfer.core.block_lists`)."""
        key = (id(peer), peer.incarnation, tuple(sorted(sources.items())))
        with self._lock:
            cached = self._planners.get(key)
        if cached is not None:
            return cached
        with self._building:
            return self._build(key, peer, theirs, mine, sources, salt)

    def _build(
        self,
        key: tuple[object, ...],
        peer: Peer,
        theirs: TPRank,
        mine: TPRank,
        sources: dict[int, int],
        salt: int,
    ) -> tuple[TPPlanner, ChainLists | None]:
        with self._lock:
            cached = self._planners.get(key)
        if cached is not None:  # built by the thread this one waited for
            return cached
        # The consumer's table was cut at its handshake to what this rank posts
        # at (kvxfer._agent.peers); ours is the whole table or its one-head section.
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
        lists = planner.chain_lists(mine.rank, write=True)
        if lists is not None and not self._prepare_lists(peer, lists):
            lists = None
        with self._lock:
            if len(self._planners) >= _MAX_PLANNERS:
                self._planners.pop(next(iter(self._planners)))
            self._planners[key] = (planner, lists)
        return planner, lists

    def plan(
        self,
        peer: Peer,
        target: wire.PushRegister,
        local: tuple[tuple[int, ...], ...],
        remote: tuple[tuple[int, ...], ...],
        tokens: int,
    ) -> Plan | ChainPlan | Runs | None:
        """The plan of one write of ``local`` into the consumer's ``remote`` blocks when
        the consumer's TP size differs from ours (rows of this rank's chain lists where
        prepared; address runs for a hybrid model's state groups); None when it does
        not (whole blocks, the ordinary plan).

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
        _, exposed = self._local.require_registered()
        if any(g.is_state for g in exposed.groups):
            return self._hybrid_runs(peer, theirs, mine, salt, local, remote, tokens)
        sources = source_ranks(theirs.heads, theirs.rank, mine.heads, salt=salt)
        planner, lists = self._planner(peer, theirs, mine, sources, salt)
        if lists is not None:
            return lists.plan(blocks.from_wire(local), blocks.from_wire(remote), tokens)
        # Planned as the consumer rank would read from us; a WRITE swaps the sides.
        (part,) = planner.plan(blocks.from_wire(remote), blocks.from_wire(local), tokens)
        read = part.plan
        return dataclasses.replace(
            read,
            local_ids=read.remote_ids,
            remote_ids=read.local_ids,
            local_blocks=tuple(np.asarray(g, dtype=np.int64) for g in local),
        )

    def _hybrid_runs(
        self,
        peer: Peer,
        theirs: TPRank,
        mine: TPRank,
        salt: int,
        local: tuple[tuple[int, ...], ...],
        remote: tuple[tuple[int, ...], ...],
        tokens: int,
    ) -> Runs:
        """This rank's writes of a hybrid model into consumer rank ``theirs``: its KV
        heads and state units there that this rank holds, as address runs (empty
        where that consumer rank takes nothing from this rank).

        Raises:
            ConfigError: the consumer announced no state split, or the pair's state
                units and KV heads come from different producer ranks.
            LayoutMismatch, LayoutError: the layouts cannot exchange heads or state.
        """
        _, exposed = self._local.require_registered()
        # The salt picks among replicas only; where this side holds no head or state
        # unit twice, every request gets the same pieces and one planner serves them
        # all. Where it matters it stays in the key: every producer rank must choose
        # a replicated unit's writer alike for each request, or a unit would be
        # written by none (a planner cached from another request's salt could differ
        # from the other ranks').
        if not _replicates(theirs, mine):
            salt = 0
        key = (id(peer), peer.incarnation, salt)
        with self._lock:
            planner = self._hybrid.get(key)
        if planner is None:
            # Planned as consumer rank ``theirs`` would read from this rank.
            planner = HybridTPPlanner.build(
                peer.info.layout,
                {mine.rank: exposed},
                options=self._local.config.plan,
                local_tp=theirs,
                remote_tp_size=mine.heads.tp_size,
                salt=salt,
                only=mine.rank,
            )
            with self._lock:
                if len(self._hybrid) >= _MAX_PLANNERS:
                    self._hybrid.pop(next(iter(self._hybrid)))
                self._hybrid[key] = planner
        parts = planner.plan(blocks.from_wire(remote), blocks.from_wire(local), tokens)
        empty = np.zeros(0, dtype=np.uint64)
        zero = np.zeros(0, dtype=np.int64)
        if not parts:
            return Runs(empty, empty, empty, zero, zero)
        (part,) = parts
        read = part.runs
        # A WRITE swaps the sides of the consumer's read.
        return Runs(
            local_addr=read.remote_addr,
            remote_addr=read.local_addr,
            length=read.length,
            local_device=read.remote_device,
            remote_device=read.local_device,
        )


def _replicates(theirs: TPRank, mine: TPRank) -> bool:
    """Whether producer ranks of ``mine``'s TP size hold a KV head or a state unit of
    ``theirs``'s split more than once (only then does the salt change who writes it)."""
    size = mine.heads.tp_size
    split = theirs.state
    units = [s.units for s in (*split.conv, *split.ssm)] if split is not None else []
    return mine.heads.num_kv_heads < size or any(u < size for u in units)
