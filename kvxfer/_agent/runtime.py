"""The Agent's transfer runtime: posting, and the round of progress that settles.

:class:`Runtime` plans and posts a transfer (:meth:`Runtime.post`) and runs the round
of progress (:meth:`Runtime.tick`: drained notices, handle statuses, deadlines,
liveness probes, lease expiry) that the progress thread (:mod:`kvxfer._agent.progress`) and
any polling thread share. Settling, with its quarantine (R-SAFE-5), is
:mod:`kvxfer._agent.settle`; a guarded pull's guard-word reads (R-SAFE-1) are
:mod:`kvxfer._agent.guard_read`. The notices it drains free leases (:mod:`kvxfer._agent.leases`)
and complete push receptions (:mod:`kvxfer._agent.receptions`). The
:class:`~kvxfer.agent.Agent` owns one; its parts post and settle through it.

Locking: one re-entrant agent lock guards the bookkeeping (transfers, leases, freed
ids, counters). It is never held across a backend call that can move bytes (a post,
a stage-in): with UCX over CMA a post copies every byte before it returns.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

from kvxfer._agent.guard_read import GuardReads, expired_error
from kvxfer._agent.leases import LeaseBook
from kvxfer._agent.liveness import Liveness, Ping
from kvxfer._agent.local import LocalEnd
from kvxfer._agent.notices import Notices
from kvxfer._agent.peers import Peer, PeerCache
from kvxfer._agent.progress import ProgressLoop
from kvxfer._agent.readers import ReaderCount
from kvxfer._agent.receptions import Receptions
from kvxfer._agent.settle import Settler
from kvxfer._agent.workers import IoPool
from kvxfer.agent_config import AgentStats
from kvxfer.backend import Backend, XferOp, XferStatus
from kvxfer.core import wire
from kvxfer.core.block_lists import ChainLists, ChainPlan
from kvxfer.core.blocks import Pairing
from kvxfer.core.descriptors import Plan, Runs, plan_pairing
from kvxfer.core.ratio import UnitPairing, unit_runs
from kvxfer.errors import KvxferError, PeerError, PlanError, TransferError, TransferTimeout
from kvxfer.transfer import FailureKind, FailureStage, Transfer
from kvxfer.types import Direction

__all__ = ["ProbeVerdicts", "Runtime"]

log = logging.getLogger("kvxfer.agent")

# How often Runtime.warm_up polls its guard read (it waits on the caller's thread).
_WARM_POLL_S = 0.0002


class ProbeVerdicts:
    """What the liveness probes (:mod:`kvxfer._agent.liveness`) settle transfers through.

    A probe fails a transfer only on an answer or on evidence of death (a producer
    that says its hold ended or failed, a refused port, another incarnation), so
    for a push reception that failure is also proof that its producer writes no
    more: it settles at once instead of waiting in quarantine (R-SAFE-5).
    """

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def fail(
        self,
        transfer: Transfer,
        kind: FailureKind,
        error: BaseException,
        stage: FailureStage | None = None,
    ) -> None:
        self._runtime.fail(transfer, kind, error, stage, quiet=True)

    def pushed(self, transfer: Transfer) -> None:
        self._runtime.pushed(transfer)


class Runtime:
    """Transfers in flight and the rounds of progress that drive them (internal).

    Args:
        local: Identity, registered memory and message signing.
        backend: The transport.
        peers: The peer cache (a peer whose transfer failed is marked suspect).
        leases: The producer's leases (freed by notices, expired by ticks).
        receptions: The consumer's push receptions (completed by notices).
        stats: The agent's counters.
        lock: The agent lock (guards the bookkeeping, never held across a post).
        readers: Counts the consumer ranks of a request read across TP sizes (the
            lease is freed at the last one's DONE or ABORT).
        ping: Sends the liveness probes' Pings (the side channel's); None: quiet
            transfers are not probed.
        io: Runs the probes off the progress thread, and a guarded pull's re-reads
            after their delay.
    """

    def __init__(
        self,
        local: LocalEnd,
        backend: Backend,
        peers: PeerCache,
        leases: LeaseBook,
        receptions: Receptions,
        stats: AgentStats,
        lock: threading.RLock,
        readers: ReaderCount | None = None,
        *,
        io: IoPool,
        ping: Ping | None = None,
    ) -> None:
        self._local = local
        self._config = local.config
        self._backend = backend
        self._peers = peers
        self._leases = leases
        self._stats = stats
        self._lock = lock
        self._tick_hooks: list[Callable[[], None]] = []
        self._settler = Settler(backend, peers, receptions, stats, lock)
        self._guards = GuardReads(backend, self._settler, stats, lock, self.lease_over, io.later)
        self._loop = ProgressLoop(
            self._config, self._tick, self._settler.transfers, leases, lambda: self.closed
        )
        self._liveness: Liveness | None = None  # probes quiet transfers
        self._grown = False  # a warm-up of warm_up_descriptors was posted (see warm_up)
        if ping is not None:
            self._liveness = Liveness(ping, io.submit, ProbeVerdicts(self), self._count_probe)
        # A producer's FAILED notice says its writes ended: quiet (R-SAFE-5).
        quiet_fail = functools.partial(self._settler.fail, quiet=True)
        readers = ReaderCount() if readers is None else readers
        self._notices = Notices(local, leases, receptions, stats, quiet_fail, readers)

    def _count_probe(self) -> None:
        self._stats.liveness_probes += 1

    def _tick(self) -> None:
        # Looked up on each round (not bound once): a test may wrap the tick.
        self.tick()

    def add_tick_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` at the end of every tick that finds leases (the push writer's
        resumption of leases whose consumer registered after their hold)."""
        self._tick_hooks.append(hook)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._settler.closed

    # -- posting --------------------------------------------------------------------
    def lease_over(self, expiry: float) -> bool:
        """Whether a producer's lease ending at ``expiry`` (wall clock) may be over."""
        # One-sided reads cannot be refused by the producer, so the consumer enforces the
        # lease itself, with a guard for clock skew between the two hosts.
        return time.time() > expiry - self._config.lease_guard_s

    @staticmethod
    def expired_error(request_id: str) -> TransferError:
        """The error of a pull whose lease ran out before its blocks were read."""
        return expired_error(request_id)

    def new_transfer(self, request_id: str, groups: tuple[tuple[int, ...], ...]) -> Transfer:
        """A pending transfer of ``groups`` (local block ids), tracked until it settles."""
        now = time.monotonic()
        t = Transfer(
            request_id,
            groups,
            progress=self.poll_tick,
            deadline=now + self._config.transfer_timeout_s,
        )
        t.meta.last_progress = now
        with self._lock:
            self._settler.transfers[id(t)] = t
        if not self._loop.started:
            self._loop.start()
        return t

    def post(
        self,
        transfer: Transfer,
        op: XferOp,
        peer: Peer,
        work: Pairing | UnitPairing | Plan | ChainPlan | Runs,
        notification: bytes | Callable[[int], bytes],
    ) -> None:
        """Plan and post one transfer. Called without the agent lock: with UCX over CMA
        (and the host bounce's staging copies) a post moves bytes before it returns, and
        the lock held that long would stall the engine's hold(), pull() and freed().

        ``work`` is the request's checked block ids (:func:`kvxfer.core.blocks.pair`),
        planned here against ``peer``'s table, or a plan made already (one producer
        rank's part of a request across TP sizes, :mod:`kvxfer._agent.tp_pull`): its ids
        index the local and ``peer`` tables, or, for a :class:`ChainPlan`, the rows of
        chain lists prepared with ``peer`` (:meth:`prepare_lists`), or a pairing of two
        block sizes (:class:`~kvxfer.core.ratio.UnitPairing`), posted as address runs,
        or address runs made already (a hybrid model's part across TP sizes)."""
        table, exposed = self._local.require_registered()
        meta = transfer.meta
        with self._lock:
            # Checked and marked together: a transfer failed before this point (an
            # expired lease, an abort) never posts, and one failed after it stays
            # quarantined until its post returned and its handle says it ended.
            # (Every failure is doomed first; nothing is DONE before its post.)
            refused = meta.doomed is not None
            # Nothing to poll until the post returns: the progress thread keeps its
            # slower pace meanwhile (with UCX over CMA that is the whole copy; see _run).
            meta.posting = not refused
        if refused:
            self._settler.finish(transfer)
            return
        t0 = time.perf_counter()
        try:
            plan: Plan | ChainPlan | Runs
            if isinstance(work, UnitPairing):
                # Another block size on the peer: address runs unit by unit
                # (kvxfer.core.ratio), posted as per-request lists.
                if not self._backend.capabilities.address_runs:
                    raise PlanError(
                        f"blocks of {work.local_block_size} tokens here and "
                        f"{work.remote_block_size} at the peer need a backend that posts "
                        f"address runs; {self._backend.capabilities.name} does not"
                    )
                plan = unit_runs(exposed, peer.info.layout, work)
            elif isinstance(work, Runs):
                # A hybrid model's part across TP sizes (kvxfer.core.state_tp_plan).
                if not self._backend.capabilities.address_runs:
                    raise PlanError(
                        "state slots across TP sizes are read as address runs; "
                        f"{self._backend.capabilities.name} posts none: pair equal TP sizes"
                    )
                plan = work
            elif isinstance(work, Plan | ChainPlan):
                plan = work
            else:
                plan = plan_pairing(table, peer.table, work)
        except KvxferError as exc:
            meta.posting = False
            self.fail(transfer, FailureKind.POST, exc)
            return
        t1 = time.perf_counter()
        if meta.pull is not None:
            again: Pairing | UnitPairing | Plan | ChainPlan | Runs = (
                work if isinstance(plan, Runs) else plan
            )
            meta.pull.repost = functools.partial(self.post, transfer, op, peer, again, notification)
        transfer.stats.plan_s = t1 - t0
        transfer.stats.bytes = plan.nbytes
        transfer.stats.descriptors = len(plan) if isinstance(plan, Runs) else plan.num_descriptors
        notif = notification(plan.nbytes) if callable(notification) else notification
        try:
            if isinstance(plan, Runs):
                handle = self._backend.post_runs(op, peer.handle, plan, notif)
            elif isinstance(plan, ChainPlan):
                handle = self._backend.post_lists(
                    op, peer.handle, plan.lists, plan.local_ids, plan.remote_ids, notif
                )
            else:
                handle = self._backend.post_engine(
                    op, peer.handle, plan.local_ids, plan.remote_ids, notif
                )
        except KvxferError as exc:
            meta.posting = False
            self._peers.mark_suspect(peer)
            kind = FailureKind.PEER_GONE if isinstance(exc, PeerError) else FailureKind.POST
            self.fail(transfer, kind, exc, FailureStage.POST)
            return
        transfer.stats.post_s = time.perf_counter() - t1
        with self._lock:
            if transfer.done:  # settled meanwhile (the agent closed)
                meta.posting = False
                self._backend.release(handle)
                return
            meta.peer = peer
            meta.handle = handle
            meta.posting = False
            meta.last_progress = time.monotonic()
            doomed = meta.doomed is not None
        if doomed:
            # Failed while this post ran (an abort, the deadline): its bytes may still
            # move, so the handle is what says when the blocks are free again.
            self._settler.finish(transfer)
            return
        if self._backend.status(handle) is XferStatus.DONE:
            # Moved inside post (UCX over CMA copies synchronously): settle now rather
            # than hand the completion to the progress thread (a GIL hand-off per pull).
            self._guards.landed(transfer)
            return
        self._loop.in_flight()  # wakes the progress thread from a longer nap

    def prepare_lists(self, peer: Peer, lists: ChainLists) -> bool:
        """Prepare chain lists with ``peer`` for :class:`ChainPlan` posts; False where
        the backend cannot (the caller plans ids then). A refusal of the transport is
        logged, not raised: posting ids still works."""
        try:
            prepared = self._backend.prepare_lists(peer.handle, lists)
        except KvxferError as exc:
            log.info("chain lists not prepared with %r: %s", peer, exc)
            return False
        if prepared:
            # Once per planner and peer: how an operator sees that requests post merged
            # rows (issue 27), not per-head descriptors.
            log.info(
                "chain lists prepared with %r: %d chain(s), %d local and %d remote rows",
                peer,
                lists.chains,
                len(lists.local),
                len(lists.remote),
            )
        return prepared

    def arm_guard(
        self,
        t: Transfer,
        peer: Peer,
        slot: int,
        generation: int,
        done_notice: Callable[[], bytes],
    ) -> bool:
        """Before a pull's post: make it fail-closed when both ends can
        (:meth:`GuardReads.arm <kvxfer._agent.guard_read.GuardReads.arm>`). Returns False
        when ``t`` failed."""
        return self._guards.arm(t, peer, slot, generation, done_notice)

    # -- settling (kvxfer._agent.settle) --------------------------------------------------
    def fail(
        self,
        transfer: Transfer,
        kind: FailureKind,
        error: BaseException,
        stage: FailureStage | None = None,
        *,
        quiet: bool = False,
    ) -> None:
        """Fail ``transfer`` (:meth:`Settler.fail <kvxfer._agent.settle.Settler.fail>`): never
        DONE from now on, FAILED once no byte of it can land (R-SAFE-5)."""
        self._settler.fail(transfer, kind, error, stage, quiet=quiet)

    def succeed(self, transfer: Transfer) -> None:
        """Settle ``transfer`` as DONE (once; a push reception copies in first)."""
        self._settler.succeed(transfer)

    def pushed(self, t: Transfer) -> None:
        """A push reception's producer confirmed every write landed (its notice was
        lost): settle it as the notice would have."""
        self._settler.pushed(t)

    def abort_request(self, request_id: str) -> None:
        """The engine aborted ``request_id``: its own pulls and push receptions of it
        fail now and never become DONE (R-SAFE-2)."""
        self._settler.abort_request(request_id)

    def capability_of(self, request_id: str) -> str:
        """The capability one of our transfers of ``request_id`` carries ("" if none)."""
        return self._settler.capability_of(request_id)

    def close(self) -> bool:
        """Fail every transfer in flight and stop the progress thread.

        Returns:
            False if it was closed already (idempotent).
        """
        if not self._settler.close():
            return False
        self._loop.stop()
        return True

    # -- progress (kvxfer._agent.progress) ------------------------------------------------
    def ensure_thread(self) -> None:
        """Start the progress thread (once, unless closed)."""
        self._loop.start()

    def wake(self) -> None:
        """Run a round of progress soon, from any sleep."""
        self._loop.wake()

    def nudge(self) -> None:
        """Wake the progress thread only from its long idle sleep."""
        self._loop.nudge()

    def wiring_up(self) -> None:
        """A handshake just connected a peer (either side): progress at a fast pace
        for a while, so that its transport connection is wired up before the first
        transfer needs it (:meth:`ProgressLoop.wiring_up`)."""
        self._loop.start()
        self._loop.wiring_up()

    def warm_up(self, peer: Peer) -> None:
        """Use ``peer``'s new connection once before any request does, when this agent
        posts to it (:meth:`Agent.connect <kvxfer.agent.Agent.connect>`): one transfer
        of the operation its requests will post (waited for, within the handshake
        timeout) and one :attr:`~kvxfer.core.wire.NoticeKind.WARM` notice, which the
        peer ignores. A puller reads the peer's guard word; a push producer writes the
        peer's sink word (:attr:`~kvxfer.core.wire.GuardTable.sink`; a read of its guard
        word from a peer that announces none). UCX finishes wiring an endpoint up and
        picks each operation's protocol on first use: the first pull across TP sizes
        after a connect paid 0.4-1.1 ms more for its guard read and ~1.8 ms more for its
        first notice than later ones (issue 27). The agent's first warm-up posts its
        transfer as :attr:`~kvxfer.agent.AgentConfig.warm_up_descriptors` descriptors:
        the first post of many descriptors grows the process's heap (2,700-3,100 page
        faults for a TP pull of 14,000-28,000 units, against 0-350 later) and the
        transport's pools, and it paid up to 34 ms (up to 1.74x a steady pull) for that
        on the 2-core development host; a first push from two writers, warmed by a
        read, still took a median 1.16-1.37x its steady time, against 1.09x warmed by
        a write. Both stay grown, so later peers get one descriptor. Once per peer; a
        failure is only logged (the first request then pays the set-up, and fails
        closed if the peer is gone)."""
        if peer.warmed or not self._local.posts:
            return
        peer.warmed = True
        config = self._config
        notice = self._local.encode(
            wire.Notice(
                kind=wire.NoticeKind.WARM,
                request_id="warm-up",
                engine_id=config.engine_id,
                incarnation=self._local.incarnation,
            )
        )
        backend = self._backend
        until = time.monotonic() + self._config.handshake_timeout_s
        try:
            guard = peer.info.guard
            if backend.capabilities.guard and guard is not None:
                copies = 1 if self._grown else config.warm_up_descriptors
                if config.direction is Direction.PUSH and guard.sink is not None:
                    handle = backend.post_sink_write(peer.handle, copies=copies)
                else:
                    handle = backend.post_guard_read(peer.handle, 0, copies=copies)
                # Grown by the post (two racing first warm-ups: two large posts).
                self._grown = True
                while backend.status(handle) is XferStatus.PENDING:
                    if time.monotonic() > until:
                        # Not released: its landing word must not be reused while the
                        # read can still land in it. One word of many, kept until close.
                        log.info("warming %r up: its warm-up transfer still pending", peer)
                        break
                    time.sleep(_WARM_POLL_S)
                else:
                    backend.release(handle)
            backend.notify(peer.handle, notice)
        except KvxferError as exc:
            log.info("warming %r up: %s", peer, exc)

    def poll_tick(self) -> None:
        """What a :meth:`Transfer.poll` drives: a round of progress, unless any thread
        ran one within half the progress interval."""
        self._loop.poll()

    def tick(self) -> None:
        """One round of progress, from any thread. The agent lock covers bookkeeping
        only: backend calls (which wait for the backend's own lock while another thread
        posts) and staging copies run outside it, so a long post never stalls the
        engine's calls."""
        if self.closed:
            return
        self._loop.ticking()
        notes = self._backend.drain_notifications()
        with self._lock:
            complete = self._notices.handle(notes) if notes else []
            polled = [(t, t.meta.handle) for t in self._settler.transfers.values()]
        for t in complete:
            self._settler.succeed(t)
        now = time.monotonic()
        for t, handle in polled:
            if t.done:
                continue
            if t.meta.doomed is not None:
                self._settler.finish(t)  # quarantined: ask whether its bytes ended
                continue
            pull = t.meta.pull
            if handle is not None:
                state = self._backend.status(handle)
                if t.done or t.meta.handle != handle:
                    # Settled meanwhile by another thread (a waiter, the poster), which
                    # released the handle: a FAILED for that handle says nothing.
                    continue
                if state is XferStatus.DONE:
                    if pull is not None and pull.guarding:
                        self._guards.guard_read(t, handle)
                    else:
                        self._guards.landed(t)
                    continue
                if state is XferStatus.FAILED:
                    peer = t.meta.peer
                    if peer is not None:
                        self._peers.mark_suspect(peer)
                    guarding = pull is not None and pull.guarding
                    what = "the guard word's read" if guarding else "the transfer"
                    self._settler.fail(
                        t,
                        FailureKind.TRANSPORT,
                        TransferError(
                            f"the transport reported an error in {what}: "
                            f"{self._backend.failure_detail(handle)}"
                        ),
                    )
                    continue
            if now > t.deadline:
                if pull is not None and pull.awaiting_hold:
                    self._settler.fail(
                        t,
                        FailureKind.LEASE_EXPIRED,
                        TransferError(
                            f"the producer did not hold {t.request_id} within "
                            f"{self._config.transfer_timeout_s:g}s of the pull"
                        ),
                        FailureStage.LEASE,
                    )
                    continue
                self._settler.fail(
                    t,
                    FailureKind.TIMEOUT,
                    TransferTimeout(
                        f"transfer {t.request_id} not complete after "
                        f"{self._config.transfer_timeout_s:g}s"
                    ),
                )
        if self._liveness is not None and polled:
            self._liveness.check(now, [t for t, _ in polled])
        if self._leases:
            with self._lock:
                self._leases.expire(now)
                for hook in self._tick_hooks:
                    hook()
