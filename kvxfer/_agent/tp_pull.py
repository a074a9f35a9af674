"""Pulls across tensor-parallel sizes: one request from several producer ranks.

A consumer agent with a TP identity (:attr:`AgentConfig.tp
<kvxfer.agent_config.AgentConfig.tp>`) pulling a ticket of another ``tp_size`` reads
each of its heads from the one producer rank :func:`kvxfer.core.heads.source_ranks` names:

* the ticket names producer rank 0 (``host``, ``port``, ``incarnation``); rank *p*
  serves its side channel at ``ticket.port + p`` (upstream vLLM's convention: base
  port + rank), under the same engine id, and holds the request under the same
  request id and block ids (vLLM's scheduler allocates one set of block ids for all
  ranks). ``ticket.incarnations[p]``, when given, is checked against rank *p*'s;
* each needed rank is handshaken (once, cached by the :class:`~kvxfer._agent.peers.PeerCache`
  like any peer; its ``Welcome.tp`` is compared by global head layout);
* a :class:`~kvxfer.core.tp_plan.TPPlanner` is built once per set of peers (and
  replica choice), like the descriptor tables it indexes, and cached;
* one sub-transfer per producer rank is posted with that rank's plan; each, once its
  guard word is checked, tells its rank DONE over the side channel from an io worker
  (a ``Release`` with ``done``, as a direct pull's DONE goes), naming how many
  consumer ranks read that producer rank (``Release.readers``;
  :mod:`kvxfer._agent.readers`): the rank frees its lease only once all of them sent
  theirs; :class:`~kvxfer._agent.fanout.Fanout` folds them into the one Transfer the
  engine sees.

A hybrid model's layout (Mamba2 / Gated DeltaNet state groups beside attention) is
planned by a :class:`~kvxfer.core.state_tp_plan.HybridTPPlanner` instead: each rank's
part, KV heads and state-slot sub-ranges, goes as one list of address runs.

When any rank's handshake or planning fails nothing is posted to the others; every
needed rank whose sub-transfer did not complete is told to release the request.
The replica-spreading salt is the request id's CRC-32, so a consumer rank reading a
replicated head spreads its requests over the producer ranks holding it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import zlib

from kvxfer._agent.fanout import Fanout
from kvxfer._agent.local import LocalEnd
from kvxfer._agent.peers import Peer, PeerCache, refused_pairing
from kvxfer._agent.runtime import Runtime
from kvxfer._agent.tp_producers import ProducerGroup, rank_ticket
from kvxfer._agent.workers import IoPool
from kvxfer.backend import XferOp
from kvxfer.core import blocks, wire
from kvxfer.core.block_lists import ChainLists, ChainPlan
from kvxfer.core.blocks import Pairing
from kvxfer.core.heads import (
    HeadLayout,
    TPRank,
    heads_per_region,
    source_choices,
)
from kvxfer.core.state_tp_plan import HybridTPPlanner, RunsPlan
from kvxfer.core.tp_plan import RankPlan, TPPlanner
from kvxfer.errors import (
    KvxferError,
    TransferError,
)
from kvxfer.ticket import Ticket
from kvxfer.transfer import FailureKind, PullState, Transfer, TransferState
from kvxfer.types import Direction, Role

__all__ = ["TPPuller"]

log = logging.getLogger("kvxfer.agent")

#: Planners kept per agent (one per set of peers and replica choice); the oldest goes.
_MAX_PLANNERS = 64
#: Replica choices prepared at a handshake, at most (the others are built at a pull).
_MAX_CHOICES = 8


class TPPuller:
    """A consumer's pulls from producer groups of another TP size (internal).

    Args:
        local: Identity (``config.tp``) and registered memory.
        peers: The peer cache every rank's handshake goes through.
        runtime: Posts and settles the sub-transfers.
        io: The agent's worker pool (first contacts).
        group: The producer group's ranks this rank reads, and their releases.
        lock: The agent lock.
    """

    def __init__(
        self,
        local: LocalEnd,
        peers: PeerCache,
        runtime: Runtime,
        io: IoPool,
        group: ProducerGroup,
        lock: threading.RLock,
    ) -> None:
        self._local = local
        self._peers = peers
        self._runtime = runtime
        self._io = io
        self._group = group
        self._lock = lock
        # Per set of peers and replica choice: its planner, and by producer rank the
        # chain lists the backend prepared with that rank (posted as ChainPlans).
        self._planners: dict[tuple[object, ...], tuple[_Planner, _Listed]] = {}
        # One build at a time: a pull starting while connect() builds the same planner
        # waits for it instead of building it (and preparing its lists) a second time.
        self._building = threading.Lock()

    def _tp(self) -> TPRank:
        return self._group.tp()

    def readers(self, ticket: Ticket, producer: HeadLayout, rank: int) -> int:
        """How many consumer ranks read ``ticket`` from producer rank ``rank``."""
        return self._group.readers(ticket, producer, rank)

    def pull(
        self,
        ticket: Ticket,
        pairing: Pairing,
        heads_from: tuple[HeadLayout, dict[int, int]],
    ) -> Transfer:
        """Start the pull of ``ticket`` into ``pairing.local``, checked already
        (:func:`kvxfer.core.blocks.pair`), as ``heads_from`` says
        (:meth:`ProducerGroup.sources <kvxfer._agent.tp_producers.ProducerGroup.sources>`
        of the ticket: the producer's head layout and the rank each head is read from).

        Raises:
            ConfigError: the ticket's TP size or ports cannot be used (nothing posted).
        """
        producer, sources = heads_from
        ranks = tuple(sorted(set(sources.values())))
        tickets = {p: rank_ticket(ticket, p) for p in ranks}
        runtime = self._runtime
        groups = blocks.to_wire(pairing.local)
        config = self._local.config
        aggregate = Transfer(
            ticket.request_id,
            groups,
            progress=runtime.poll_tick,
            deadline=time.monotonic() + config.transfer_timeout_s,
        )
        subs = {p: runtime.new_transfer(ticket.request_id, groups) for p in ranks}
        for p, sub in subs.items():
            sub.meta.producer_at = (tickets[p].host, tickets[p].port)  # probed while quiet
            sub.meta.pull = PullState(lease_expiry=ticket.lease_expiry or None)
        # Ranks whose guarded part read all it needed, with their reader counts: told
        # DONE once every rank's part settled (_tell_read).
        read: list[tuple[int, int]] = []
        fanout = Fanout(
            aggregate,
            subs,
            lambda failed: self._released(ticket, subs, failed),
            lambda: self._tell_read(tickets, read),
        )
        if ticket.lease_expiry and runtime.lease_over(ticket.lease_expiry):
            expired = runtime.expired_error(ticket.request_id)
            self._fail_all(fanout, FailureKind.LEASE_EXPIRED, expired)
            return aggregate
        cached = {
            p: self._peers.cached(t.host, t.port, t.engine_id, t.incarnation or None)
            for p, t in tickets.items()
        }
        self._group.release_unread(ticket, producer)
        job = _Job(ticket, tickets, producer, sources, pairing, fanout, read)
        if all(peer is not None for peer in cached.values()):
            self._start(job, {p: peer for p, peer in cached.items() if peer is not None})
        else:
            # First contact with some rank: handshakes go to a worker thread (a gone
            # peer can take the whole handshake timeout), never the engine's step.
            self._io.submit(self._connect_and_start, job)
        return aggregate

    def _released(self, ticket: Ticket, subs: dict[int, Transfer], failed: tuple[int, ...]) -> None:
        """The aggregate failed: ranks whose read did not complete free the request
        now (the others were told DONE with their bytes)."""
        # A rank that did not answer its handshake cannot be told (nor does one that
        # answered as another incarnation hold the lease); one that refused to pair
        # (layout, role) can.
        undone = tuple(
            p
            for p, s in subs.items()
            if s.state is not TransferState.DONE
            and (s.stats.failure is not FailureKind.HANDSHAKE or refused_pairing(s.error))
        )
        log.warning(
            "pull of %s across TP sizes failed on producer rank(s) %s; releasing %s",
            ticket.request_id,
            list(failed),
            list(undone),
        )
        self._group.release_all(ticket, undone)

    def _fail_all(self, fanout: Fanout, kind: FailureKind, error: KvxferError) -> None:
        for sub in fanout.subs.values():
            self._runtime.fail(sub, kind, error)

    def _connect_and_start(self, job: _Job) -> None:
        peers: dict[int, Peer] = {}
        for p, t in job.tickets.items():
            try:
                # Tried until the rank's pull deadline while its port accepts (R-SAFE-6).
                peers[p] = self._peers.get(
                    t.host,
                    t.port,
                    t.engine_id,
                    t.incarnation or None,
                    until=job.fanout.subs[p].deadline,
                )
            except KvxferError as exc:
                # The other ranks are not read: the aggregate could not be DONE, and
                # their blocks did not land either (so they stay exactly invalid).
                self._runtime.fail(job.fanout.subs[p], FailureKind.HANDSHAKE, exc)
                others = TransferError(f"producer rank {p} failed its handshake: {exc}")
                self._fail_all(job.fanout, FailureKind.ABORTED, others)
                return
        self._start(job, peers)

    def prepare(self, peer: Peer) -> None:
        """The engine connected to ``peer`` ahead of its pulls
        (:meth:`Agent.connect <kvxfer.agent.Agent.connect>`). When it is a producer
        rank of another TP size and every rank a pull from its group reads is
        connected now, the planners of those pulls (one per replica choice: one unless
        the producer replicates heads) are built here, so that the first pull does not
        pay 3-20 ms for them (issue 27). A planner that cannot be built is left to the
        first pull, which names what is wrong."""
        theirs = peer.info.tp
        mine = self._local.across_tp(theirs, Role.CONSUMER, Direction.PULL)
        if mine is None or theirs is None:
            return
        try:
            producer = mine.heads.for_tp_size(theirs.heads.tp_size)
            base = peer.port - theirs.rank  # rank p serves at base + p
            for salt, sources in source_choices(
                mine.heads, mine.rank, producer, limit=_MAX_CHOICES
            ):
                peers = {
                    p: self._peers.cached(peer.host, base + p, peer.engine_id, None)
                    for p in set(sources.values())
                }
                ready = {p: got for p, got in peers.items() if got is not None}
                if len(ready) == len(peers):
                    self._planner(producer, sources, ready, salt)
        except KvxferError as exc:
            log.debug("planner of %s's group not prepared: %s", peer, exc)

    def _planner(
        self, producer: HeadLayout, sources: dict[int, int], peers: dict[int, Peer], salt: int
    ) -> tuple[_Planner, _Listed]:
        """The planner of pulls reading ``sources`` from ``peers`` (cached: built once
        per set of peers and replica choice, which ``salt`` made), and the ranks whose
        chain lists are prepared with their peer (:mod:`kvxfer.core.block_lists`)."""
        key = (
            producer,
            tuple(sorted(sources.items())),
            tuple((p, id(peers[p]), peers[p].incarnation) for p in sorted(peers)),
        )
        with self._lock:
            cached = self._planners.get(key)
        if cached is not None:
            return cached
        with self._building:
            return self._build(key, producer, sources, peers, salt)

    def _build(
        self,
        key: tuple[object, ...],
        producer: HeadLayout,
        sources: dict[int, int],
        peers: dict[int, Peer],
        salt: int,
    ) -> tuple[_Planner, _Listed]:
        with self._lock:
            cached = self._planners.get(key)
        if cached is not None:  # built by the thread this one waited for
            return cached
        tp = self._tp()
        _, exposed = self._local.require_registered()
        if any(g.is_state for g in exposed.groups):
            # State slots are read in sub-ranges no prepared table covers: address
            # runs, planned from the layouts (no tables or chain lists to prepare).
            hybrid = HybridTPPlanner.build(
                exposed,
                {p: peer.info.layout for p, peer in peers.items()},
                options=self._local.config.plan,
                local_tp=tp,
                remote_tp_size=producer.tp_size,
                salt=salt,
            )
            return self._keep(key, hybrid, {})
        # The producer ranks' tables were cut at their handshakes to what this rank
        # posts at (kvxfer._agent.peers); ours is the whole table or its one-head section.
        narrowest = min(
            heads_per_region(peer.table.layout, producer, p) for p, peer in peers.items()
        )
        table, offset = self._local.posting_table(narrowest)
        planner = TPPlanner.build(
            table,
            {p: peer.table for p, peer in peers.items()},
            local_heads=tp.heads,
            remote_heads=producer,
            local_rank=tp.rank,
            salt=salt,
            local_offset=offset,
        )
        # Each request then posts each rank's rows of already merged runs instead of
        # cutting its runs again (issue 27). Prepared here, once per planner.
        listed = {
            p: lists
            for p in planner.ranks
            if (lists := planner.chain_lists(p)) is not None
            and self._runtime.prepare_lists(peers[p], lists)
        }
        return self._keep(key, planner, listed)

    def _keep(
        self, key: tuple[object, ...], planner: _Planner, listed: _Listed
    ) -> tuple[_Planner, _Listed]:
        with self._lock:
            if len(self._planners) >= _MAX_PLANNERS:
                self._planners.pop(next(iter(self._planners)))
            self._planners[key] = (planner, listed)
        return planner, listed

    def _start(self, job: _Job, peers: dict[int, Peer]) -> None:
        fanout = job.fanout
        if any(sub.done for sub in fanout.subs.values()):  # the agent closed meanwhile
            self._fail_all(fanout, FailureKind.ABORTED, TransferError("agent closed"))
            return
        try:
            salt = zlib.crc32(job.ticket.request_id.encode())
            planner, listed = self._planner(job.producer, job.sources, peers, salt)
            plans = _plans(planner, listed, job.pairing)
        except KvxferError as exc:
            self._fail_all(fanout, FailureKind.POST, exc)
            return
        for rp in plans:
            fanout.planned(rp.rank, blocks.to_wire(_local_blocks(rp)))
        # Made only where one goes as a notification (an unguarded rank's, on its data).
        notices = {rp.rank: functools.partial(self._done_notice, job, rp.rank) for rp in plans}
        ticket = job.ticket
        for rp in plans:
            # Fail-closed per rank (R-SAFE-1): every producer rank armed the ticket's
            # guard slot with its generation (vLLM's scheduler mints one for all
            # ranks); each sub-transfer reads its own rank's word after its data, and
            # its DONE goes only then. Checked for every rank before anything is posted.
            sub = fanout.subs[rp.rank]
            if not self._runtime.arm_guard(
                sub, peers[rp.rank], ticket.guard_slot, ticket.generation, notices[rp.rank]
            ):
                others = TransferError(f"producer rank {rp.rank}: {sub.error}")
                self._fail_all(fanout, FailureKind.ABORTED, others)
                return
            pull = sub.meta.pull
            if pull is not None and pull.guard is not None:
                # Its DONE goes over the side channel once every rank's part settled
                # (_tell_read); a failure is told by the aggregate's release
                # (_released), which counts the ranks.
                pull.release = functools.partial(
                    self._read, job.read, rp.rank, self.readers(ticket, job.producer, rp.rank)
                )
        for rp in plans:
            sub = fanout.subs[rp.rank]
            guarded = sub.meta.pull is not None and sub.meta.pull.guard is not None
            notice = b"" if guarded else notices[rp.rank]()
            work = rp.runs if isinstance(rp, RunsPlan) else rp.plan
            self._runtime.post(sub, XferOp.READ, peers[rp.rank], work, notice)

    @staticmethod
    def _read(read: list[tuple[int, int]], rank: int, readers: int, reason: str) -> None:
        """A guarded sub-transfer's end (``PullState.release``): "" is DONE, kept
        until the whole pull settled."""
        if not reason:
            read.append((rank, readers))

    def _tell_read(self, tickets: dict[int, Ticket], read: list[tuple[int, int]]) -> None:
        """Every rank's part settled: tell each rank whose part read all it needed
        (``ProducerGroup.read_all``, on io workers). Not as each part settles: the io
        worker's Python then took the GIL from the thread posting the next rank's read,
        0.4-0.6 ms of a 10 ms TP2->TP1 pull (1000 tokens, block size 128) on the
        2-core development host (issue 27). Under the agent lock: only queues."""
        for rank, readers in read:
            self._group.read_all(tickets[rank], readers)

    def _done_notice(self, job: _Job, rank: int) -> bytes:
        """Producer rank ``rank``'s DONE: it frees its lease once all its readers sent
        theirs."""
        return self._local.encode(
            wire.Notice(
                kind=wire.NoticeKind.DONE,
                request_id=job.ticket.request_id,
                engine_id=self._local.config.engine_id,
                incarnation=self._local.incarnation,
                readers=self.readers(job.ticket, job.producer, rank),
                reader=self._tp().rank,
                # Every producer rank holds the request under the capability the
                # ticket carries (minted once, e.g. by vLLM's scheduler).
                capability=job.ticket.capability,
            )
        )


#: By producer rank, the chain lists prepared with it.
_Listed = dict[int, ChainLists]
#: Plans a pull across TP sizes: by descriptor ids, or (hybrid models) as address runs.
_Planner = TPPlanner | HybridTPPlanner


@dataclasses.dataclass(frozen=True, eq=False)
class _ListedPlan:
    """One producer rank's part of a request as rows of its prepared chain lists."""

    rank: int
    plan: ChainPlan


def _plans(
    planner: _Planner, listed: _Listed, pairing: Pairing
) -> tuple[RankPlan | _ListedPlan | RunsPlan, ...]:
    """Each rank's part of ``pairing``: rows of its chain lists where they are
    prepared (a broadcast per group), else the planner's plan."""
    local, remote, tokens = pairing.local, pairing.remote, pairing.num_tokens
    if isinstance(planner, HybridTPPlanner):
        return planner.plan(local, remote, tokens)
    if len(listed) == len(planner.ranks):
        return tuple(_ListedPlan(p, listed[p].plan(local, remote, tokens)) for p in planner.ranks)
    return tuple(
        _ListedPlan(rp.rank, listed[rp.rank].plan(local, remote, tokens))
        if rp.rank in listed
        else rp
        for rp in planner.plan(local, remote, tokens)
    )


def _local_blocks(part: RankPlan | _ListedPlan | RunsPlan) -> tuple[blocks.IntArray, ...]:
    """The local blocks ``part`` writes into (the ones invalid if it fails)."""
    if isinstance(part, RunsPlan):
        return part.local_blocks
    return part.plan.local_blocks


@dataclasses.dataclass(frozen=True, eq=False)
class _Job:
    """One pull across TP sizes between the call and its posts."""

    ticket: Ticket
    tickets: dict[int, Ticket]
    producer: HeadLayout
    sources: dict[int, int]
    pairing: Pairing
    fanout: Fanout
    read: list[tuple[int, int]]  # see TPPuller.pull
