"""The Agent's transfer runtime: posting, settling and the progress loop.

:class:`Runtime` moves a posted transfer to DONE or FAILED: plan and post
(:meth:`Runtime.post`), completion polling and notices (:meth:`Runtime.tick`, run by
the progress thread and by any thread that polls), lease expiry, and settling with its
bookkeeping; the notices it drains free leases (:mod:`kvxfer._leases`) and complete
push receptions (:mod:`kvxfer._receptions`). The :class:`~kvxfer.agent.Agent` owns
one; the push writer (:mod:`kvxfer._push`) posts its writes through it.

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

import numpy as np

from kvxfer import blocks
from kvxfer._guard import not_held_yet, verdict
from kvxfer._io import IoPool
from kvxfer._leases import LeaseBook
from kvxfer._liveness import Liveness, Ping
from kvxfer._local import LocalEnd
from kvxfer._notices import Notices
from kvxfer._peers import Peer, PeerCache
from kvxfer._readers import ReaderCount
from kvxfer._receptions import Receptions
from kvxfer.agent_config import AgentStats
from kvxfer.backend import Backend, XferOp, XferStatus
from kvxfer.descriptors import Plan, build_plan
from kvxfer.errors import BackendError, KvxferError, PeerError, TransferError, TransferTimeout
from kvxfer.transfer import FailureKind, FailureStage, Transfer, TransferState, settle
from kvxfer.types import Direction

__all__ = [
    "IDLE_NAP_S",
    "LEASE_TICK_S",
    "RECEPTION_TICK_S",
    "REREAD_DELAYS_S",
    "WAITED_TICK_S",
    "ProbeVerdicts",
    "Runtime",
]

log = logging.getLogger("kvxfer.agent")

#: Waits before reading a guarded pull's guard word again while its hold has not come
#: (see Runtime._read_again); the last one repeats until the deadline or the lease.
REREAD_DELAYS_S = (0.005, 0.01, 0.02, 0.04, 0.08, 0.1)

# Progress interval while leases are held and nothing is in flight (see _run).
LEASE_TICK_S = 0.001
# The progress thread's pace while a thread waits on every in-flight transfer (the
# waiters poll them every 0.2 ms): a backstop for a waiter that gives up.
WAITED_TICK_S = 0.005
# The progress thread's pace while the only transfers in flight are push receptions
# (awaiting the producer's notice, no handle to poll). They wait as long as the remote
# prefill runs; at the in-flight pace (0.2 ms) a waiting decode instance burned 0.4 of
# a core draining notices and waking up, which on a small host slowed that very
# prefill by 10-15%. A reception is settled at most this much after its notice came
# (and an engine polling it each step sees it sooner).
RECEPTION_TICK_S = 0.005
# The progress thread's sleep when nothing is in flight (an idle agent costs nothing).
IDLE_NAP_S = 0.05


#: Failures after which a transfer's peer is handshaken anew before its next use.
_SUSPECT_KINDS = frozenset({FailureKind.PEER_GONE, FailureKind.TRANSPORT, FailureKind.TIMEOUT})


class ProbeVerdicts:
    """What the liveness probes (:mod:`kvxfer._liveness`) settle transfers through.

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
    """Transfers in flight and the thread that drives them (internal).

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
        io: Runs the probes off the progress thread (required with ``ping``).
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
        ping: Ping | None = None,
        io: IoPool | None = None,
    ) -> None:
        self._readers = ReaderCount() if readers is None else readers
        self._local = local
        self._config = local.config
        self._backend = backend
        self._stages = backend.capabilities.stages_through_host
        self._peers = peers
        self._leases = leases
        self._receptions = receptions
        self._stats = stats
        self._lock = lock
        self._transfers: dict[int, Transfer] = {}
        self._tick_hooks: list[Callable[[], None]] = []
        self.closed = False
        self._wake = threading.Event()
        self._idle_nap = True  # the progress thread sleeps its long idle interval
        self._nap_s = IDLE_NAP_S  # the progress thread's current sleep between rounds
        self._thread: threading.Thread | None = None
        self._last_tick = 0.0  # monotonic time of the latest tick, by any thread
        self._liveness: Liveness | None = None  # probes quiet transfers
        if ping is not None:
            assert io is not None, "probes run on io workers"
            self._liveness = Liveness(ping, io.submit, ProbeVerdicts(self), self._count_probe)
        # A producer's FAILED notice says its writes ended: quiet (R-SAFE-5).
        quiet_fail = functools.partial(self.fail, quiet=True)
        self._notices = Notices(local, leases, receptions, stats, quiet_fail, self._readers)

    def _count_probe(self) -> None:
        self._stats.liveness_probes += 1

    def add_tick_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` at the end of every tick that finds leases (the push writer's
        resumption of leases whose consumer registered after their hold)."""
        self._tick_hooks.append(hook)

    # -- posting and settling -----------------------------------------------------------
    def lease_over(self, expiry: float) -> bool:
        """Whether a producer's lease ending at ``expiry`` (wall clock) may be over."""
        # One-sided reads cannot be refused by the producer, so the consumer enforces the
        # lease itself, with a guard for clock skew between the two hosts.
        return time.time() > expiry - self._config.lease_guard_s

    @staticmethod
    def expired_error(request_id: str) -> TransferError:
        """The error of a pull whose lease ran out before its blocks were read."""
        return TransferError(
            f"the producer's lease on {request_id} ran out before its blocks were read; "
            "they may have been reused (raise lease_s, or pull sooner)"
        )

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
            self._transfers[id(t)] = t
        if self._thread is None:
            self.ensure_thread()
        return t

    def post(
        self,
        transfer: Transfer,
        op: XferOp,
        peer: Peer,
        local: blocks.Groups,
        remote: blocks.Groups,
        num_tokens: int,
        notification: bytes | Callable[[int], bytes],
        *,
        plan: Plan | None = None,
    ) -> None:
        """Plan and post one transfer. Called without the agent lock: with UCX over CMA
        (and the host bounce's staging copies) a post moves bytes before it returns, and
        the lock held that long would stall the engine's hold(), pull() and freed().

        ``plan`` is a plan made already (one producer rank's part of a request across
        TP sizes, :mod:`kvxfer._tp`): its ids index the local and ``peer`` tables."""
        table, _ = self._local.require_registered()
        meta = transfer.meta
        # Nothing to poll until the post returns: the progress thread keeps its slower
        # pace meanwhile (with UCX over CMA that is the whole copy; see _run).
        meta.posting = True
        t0 = time.perf_counter()
        try:
            if plan is None:
                plan = build_plan(table, peer.table, local, remote, num_tokens)
        except KvxferError as exc:
            meta.posting = False
            self.fail(transfer, FailureKind.POST, exc)
            return
        t1 = time.perf_counter()
        if op is XferOp.READ:
            meta.repost = functools.partial(
                self.post, transfer, op, peer, local, remote, num_tokens, notification, plan=plan
            )
        transfer.stats.plan_s = t1 - t0
        transfer.stats.bytes = plan.nbytes
        transfer.stats.descriptors = plan.num_descriptors
        notif = notification(plan.nbytes) if callable(notification) else notification
        try:
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
            self._finish(transfer)
            return
        if self._backend.status(handle) is XferStatus.DONE:
            # Moved inside post (UCX over CMA copies synchronously): settle now rather
            # than hand the completion to the progress thread (a GIL hand-off per pull).
            self.landed(transfer)
            return
        if self._nap_s > self._config.progress_interval_s:
            self._wake.set()  # in flight now, and the progress thread naps longer

    def fail(
        self,
        transfer: Transfer,
        kind: FailureKind,
        error: BaseException,
        stage: FailureStage | None = None,
        *,
        quiet: bool = False,
    ) -> None:
        """Fail ``transfer``: it can never become DONE from now on, a pull's producer is
        told to release its blocks now (R-SAFE-4), and it settles FAILED (counted, its
        handle released) once no byte of it can land any more (R-SAFE-5):

        - a transfer with a handle in flight keeps it until the transport says it ended
          (:meth:`Backend.cancel <kvxfer.backend.Backend.cancel>`); NIXL cannot cancel
          a request in flight, and its bytes would land in blocks the engine reused;
        - a push reception waits until its producer said that its writes ended (a
          PUSHED or FAILED notice, a probe's answer) or is proven gone: ``quiet`` says
          the caller has that evidence.

        Meanwhile it is *doomed* (:attr:`Transfer.doomed`) and its blocks quarantined.
        Failing a doomed transfer again only re-checks (and applies ``quiet``).

        ``stage``: where it failed (default: the stage ``kind`` belongs to)."""
        meta = transfer.meta
        release: Callable[[str], None] | None = None
        with self._lock:
            if transfer.done:
                return
            if quiet:
                meta.writer_live = False
            if meta.doomed is None:
                where = FailureStage.of(kind) if stage is None else stage
                err = error if isinstance(error, KvxferError) else BackendError(str(error))
                if kind is FailureKind.TIMEOUT and not isinstance(err, TransferTimeout):
                    err = TransferTimeout(str(err))
                meta.doomed = (kind, err, where)
                meta.doomed_at = time.monotonic()
                release, meta.release = meta.release, None
                why = f"{where.value}: {err}"
                if kind in _SUSPECT_KINDS:
                    # Its connection may be dead for good: the next use handshakes
                    # and connects anew (kvxfer._peers).
                    for peer in (meta.peer, meta.push_peer):
                        if peer is not None:
                            self._peers.mark_suspect(peer)
        if release is not None and not self.closed:
            release(why)
        self._finish(transfer)

    def _finish(self, transfer: Transfer) -> None:
        """Settle a doomed transfer FAILED if no byte of it can land any more; else
        keep it quarantined (the progress thread asks again each tick)."""
        meta = transfer.meta
        with self._lock:
            if transfer.done or meta.doomed is None:
                return
            busy = meta.posting or meta.writer_live
            handle = meta.handle
        if not busy and handle is not None:
            if self._backend.cancel(handle):
                with self._lock:
                    if meta.handle is handle:
                        meta.handle = None
            else:
                busy = True
        if busy and not self.closed:
            with self._lock:
                if not meta.quarantined and not transfer.done:
                    meta.quarantined = True
                    self._stats.quarantined += 1
                    self._stats.quarantines += 1
                    log.info(
                        "%s: failed; its blocks stay quarantined until no byte of it can land (%s)",
                        transfer,
                        "its producer may still write" if meta.writer_live else "in flight",
                    )
            return
        self._settle_failed(transfer)

    def _settle_failed(self, transfer: Transfer) -> None:
        meta = transfer.meta
        assert meta.doomed is not None
        kind, err, stage = meta.doomed
        transfer.stats.failure = kind
        transfer.stats.stage = stage
        if not settle(transfer, TransferState.FAILED, err):
            return
        handle, meta.handle = meta.handle, None
        if handle is not None:  # the agent closed with it in flight: abandoned
            self._backend.release(handle)
        with self._lock:
            self._transfers.pop(id(transfer), None)
            self._receptions.forget(transfer)
            self._receptions.drop(transfer)
            c = self._stats
            c.transfers_failed += 1
            c.failures[kind.value] = c.failures.get(kind.value, 0) + 1
            c.failures_by_stage[stage.value] = c.failures_by_stage.get(stage.value, 0) + 1
            if meta.quarantined:
                meta.quarantined = False
                c.quarantined -= 1
                held = time.monotonic() - meta.doomed_at
                c.quarantine_s_total += held
                c.quarantine_s_max = max(c.quarantine_s_max, held)
            if meta.on_settled is not None:
                meta.on_settled(transfer, False)
        log.warning(
            "transfer %s failed at %s (%s): %s; %s",
            transfer.request_id,
            stage.value,
            kind.value,
            err,
            blocks.describe(transfer.invalid_blocks),
        )

    def landed(self, t: Transfer) -> None:
        """The backend reports every byte of ``t`` moved: check, then settle it."""
        meta = t.meta
        expiry = meta.lease_expiry
        if expiry is not None and self.lease_over(expiry):
            # Landed after the producer was free to reuse the blocks:
            # the bytes may be another request's, so they are not valid.
            self.fail(t, FailureKind.LEASE_EXPIRED, self.expired_error(t.request_id))
        elif meta.guard is not None:
            self._read_guard(t)
        else:
            self.succeed(t)

    def _read_guard(self, t: Transfer) -> None:
        """Read the hold's guard word back: after the data landed (R-SAFE-1), or alone
        while the hold has not come yet (``meta.awaiting_hold``, no data handle)."""
        meta = t.meta
        assert meta.guard is not None and meta.peer is not None
        with self._lock:
            if t.done or meta.doomed is not None or meta.guarding:
                return  # another thread saw the data land first, or it failed
            meta.guarding = True
            data, meta.handle = meta.handle, None
        if data is not None:
            self._backend.release(data)  # DONE: nothing of it moves any more
        t0 = time.perf_counter()
        try:
            handle = self._backend.post_guard_read(meta.peer.handle, meta.guard[0])
        except KvxferError as exc:
            self.fail(t, FailureKind.TRANSPORT, exc, FailureStage.LEASE)
            return
        with self._lock:
            settled = t.done
            if not settled:
                meta.handle = handle
            self._stats.guard_reads += 1
            failed = settled or meta.doomed is not None
        if settled:  # closed meanwhile: nothing polls this read any more
            self._backend.release(handle)
            return
        if failed:  # the 8-byte read lands in our own landing word: ended when it ends
            self._finish(t)
            return
        state = self._backend.status(handle)
        self._stats.guard_s_total += time.perf_counter() - t0
        if state is XferStatus.DONE:
            self._guard_read(t, handle)

    def _guard_read(self, t: Transfer, handle: object) -> None:
        """The guard word arrived: DONE if it still is the ticket's generation (or, while
        awaiting the hold, read the data again now that it came)."""
        meta = t.meta
        assert meta.guard is not None
        try:
            word = self._backend.guard_word(handle)  # type: ignore[arg-type]
        except KvxferError as exc:
            self.fail(t, FailureKind.TRANSPORT, exc, FailureStage.LEASE)
            return
        why = verdict(word, meta.guard[1])
        if why is None and not meta.awaiting_hold:
            self.succeed(t)
            return
        if self._read_again(t, handle, word):
            return
        with self._lock:
            self._stats.guard_failures += 1
        self.fail(
            t,
            FailureKind.LEASE_EXPIRED,
            TransferError(
                f"the producer no longer held the blocks of {t.request_id} when they were "
                f"read ({why or 'lease over'}): they may be another request's; recompute"
            ),
            FailureStage.LEASE,
        )

    def _read_again(self, t: Transfer, handle: object, word: int) -> bool:
        """A ticket minted before its hold (the vLLM scheduler hands tickets out a step
        before the worker's hold runs; under load that step comes seconds later) finds
        the slot's word not the ticket's yet: the word alone is read again, with
        growing waits up to ``REREAD_DELAYS_S[-1]``, until the hold came; then data and
        word are read again. The wait is bounded by the transfer's deadline and the
        ticket's lease, not by a count. A slot that holds another live hold's
        generation is really another hold's: that fails at once (returns False), and
        so does a word saying this very hold was freed."""
        meta = t.meta
        assert meta.guard is not None
        came = word == meta.guard[1]
        if not came and not not_held_yet(word, meta.guard[1]):
            return False
        with self._lock:
            if t.done or meta.doomed is not None:
                return False
            if not meta.guarding or meta.handle is not handle:
                return True  # another thread took this word and acts on it
            expiry = meta.lease_expiry
            if meta.repost is None or (expiry is not None and self.lease_over(expiry)):
                return False
            meta.guarding = False
            meta.handle = None
            if came:
                meta.awaiting_hold = False
                delay, then = 0.0, self._repost
            else:
                if not meta.awaiting_hold:
                    self._stats.guard_rereads += 1
                meta.awaiting_hold = True
                delay = REREAD_DELAYS_S[min(meta.reposts, len(REREAD_DELAYS_S) - 1)]
                then = self._poll_word
            meta.reposts += 1
        self._backend.release(handle)  # type: ignore[arg-type]
        if came:
            log.debug("%s: its hold came; reading data and word again", t)
        else:
            log.debug("%s: not held yet; its guard word again in %.0f ms", t, delay * 1e3)
        timer = threading.Timer(delay, then, (t,))
        timer.daemon = True
        timer.start()
        return True

    def _poll_word(self, t: Transfer) -> None:
        if not t.done and t.meta.doomed is None and not self.closed:
            t.meta.last_progress = time.monotonic()
            self._read_guard(t)

    def _repost(self, t: Transfer) -> None:
        repost = t.meta.repost
        if repost is not None and not t.done and t.meta.doomed is None and not self.closed:
            repost()

    def arm_guard(
        self, t: Transfer, peer: Peer, slot: int, generation: int, done_notice: bytes
    ) -> bool:
        """Before a pull's post: make it fail-closed when both ends can (its DONE
        notice then waits for the guard word). A ticket without a generation from a
        producer that guards its holds is refused (a router dropped the kvxfer keys,
        or someone forged the ticket); a producer or backend without a guard table is
        pulled unguarded and counted. Returns False when ``t`` failed."""
        guard = peer.info.guard
        if guard is None or not self._backend.capabilities.guard:
            with self._lock:
                self._stats.unguarded_pulls += 1
            return True
        if not generation or not 0 <= slot < guard.slots:
            self.fail(
                t,
                FailureKind.LEASE_EXPIRED,
                TransferError(
                    f"ticket of {t.request_id} carries no guard word (kvxfer_generation, "
                    f"kvxfer_guard_slot={slot}) although producer {peer.engine_id} guards its "
                    "holds: refused, the blocks' validity could not be checked"
                ),
                FailureStage.LEASE,
            )
            return False
        t.meta.guard = (slot, generation)
        t.meta.done_notice = done_notice
        return True

    def capability_of(self, request_id: str) -> str:
        """The capability one of our transfers of ``request_id`` carries ("" if none)."""
        with self._lock:
            for t in self._transfers.values():
                if t.request_id == request_id and t.meta.capability:
                    return t.meta.capability
        return ""

    def pushed(self, t: Transfer) -> None:
        """A push reception's producer confirmed every write landed (its notice was
        lost): settle it as the notice would have."""
        with self._lock:
            self._receptions.drop(t)  # only this reception (never another one's entry)
            if t.done:
                return
            t.meta.stage_in = True
        self.succeed(t)

    def abort_request(self, request_id: str) -> None:
        """The engine aborted ``request_id``: its own pulls and push receptions of it
        fail now, all blocks invalid, and never become DONE (R-SAFE-2); their handles
        are released, so a transport that can cancel moves no further byte."""
        with self._lock:
            mine = [
                t
                for t in self._transfers.values()
                if t.request_id == request_id and t.meta.lease is None
            ]
            for t in mine:
                # A push reception stays expected: its producer's PUSHED or FAILED
                # notice is what says its writes ended (R-SAFE-5).
                t.meta.release = None  # the abort itself tells the producer
        for t in mine:
            self.fail(
                t,
                FailureKind.ABORTED,
                TransferError(f"request {request_id} aborted by its engine"),
                FailureStage.TRANSFER,
            )

    def succeed(self, transfer: Transfer) -> None:
        """Settle ``transfer`` as DONE (once; a push reception copies in first)."""
        meta = transfer.meta
        with self._lock:
            # What brings a transfer here says its bytes ended (its handle DONE, its
            # producer's final PUSHED): no write of it can land any more, even if it
            # fails meanwhile (an abort racing the stage-in below).
            meta.writer_live = False
        if meta.doomed is not None:
            # It failed meanwhile (an abort, the deadline) and never becomes DONE.
            self._finish(transfer)
            return
        if self._stages and meta.stage_in:
            self._backend.stage_in([np.asarray(g, dtype=np.int64) for g in transfer.local_blocks])
        if meta.doomed is not None:  # failed during the stage-in
            self._finish(transfer)
            return
        if settle(transfer, TransferState.DONE):
            handle, meta.handle = meta.handle, None
            if handle is not None:
                self._backend.release(handle)
            if meta.done_notice and meta.peer is not None:
                # A guarded pull's DONE goes only now, after its guard word was read (the
                # producer frees on it, which changes the word), and off the data
                # endpoint: see _send_done.
                self._send_done(transfer)
            with self._lock:
                self._transfers.pop(id(transfer), None)
                self._receptions.forget(transfer)  # settled by another notice
                c = self._stats
                c.transfers_done += 1
                c.bytes_moved += transfer.stats.bytes
                c.descriptors_posted += transfer.stats.descriptors
                c.transfer_s_total += transfer.stats.transfer_s
                c.post_s_total += transfer.stats.post_s
                if meta.on_settled is not None:
                    meta.on_settled(transfer, True)

    def _send_done(self, t: Transfer) -> None:
        """Tell a guarded pull's producer it is done. Over the side channel, from an io
        worker (``meta.release`` with ``done=True``): a backend notification would,
        on UCX, make this endpoint's next read complete only after the producer's
        worker progressed (~1 ms, docs/EMBEDDING.md), and the data path of a pull
        never waits for the producer. Measured (``python -m kvxfer.tools.latency``, 1-16
        blocks): 195-432 µs pull->done this way, 600-1584 µs with the notice sent as a
        notification after the guard read. Without a release callback (never for an
        Agent's pull) the notice goes as a notification."""
        meta = t.meta
        if meta.release is None:
            assert meta.peer is not None
            try:
                self._backend.notify(meta.peer.handle, meta.done_notice)
            except KvxferError as exc:
                self._stats.notices_failed += 1
                log.info("could not send the DONE notice of %s: %s", t.request_id, exc)
            return
        release, meta.release = meta.release, None
        release("")  # "" : done

    def close(self) -> bool:
        """Fail every transfer in flight and stop the progress thread.

        Returns:
            False if it was closed already (idempotent).
        """
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            for t in list(self._transfers.values()):
                # Closing ends every transfer now, quarantined or not: the backend
                # releases every handle next and the engine stops using the blocks.
                t.meta.writer_live = t.meta.posting = False
                self.fail(
                    t, FailureKind.ABORTED, TransferError("agent closed"), FailureStage.TRANSFER
                )
                if not t.done:
                    self._settle_failed(t)
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        return True

    # -- progress -----------------------------------------------------------------------
    def ensure_thread(self) -> None:
        """Start the progress thread (once, unless closed)."""
        with self._lock:
            if self._thread is None and not self.closed:
                self._thread = threading.Thread(
                    target=self._run, name="kvxfer-progress", daemon=True
                )
                self._thread.start()

    def wake(self) -> None:
        """Run a round of progress soon, from any sleep."""
        self._wake.set()

    def nudge(self) -> None:
        """Wake the progress thread only from its long idle sleep: waking it costs a GIL
        hand-off (a few hundred µs on a busy host) on every hold and pull, and from the
        short sleeps it comes back within a millisecond anyway."""
        if self._idle_nap:
            self._wake.set()

    def _run(self) -> None:
        # Sleeps between ticks: short while anything is in flight, long when idle, so
        # an idle agent costs nothing (NIXL's own progress thread would spin a core).
        interval, woken = 0.0, True
        config = self._config
        while not self.closed:
            # Skip a round that was not asked for when another thread (a waiter in
            # Transfer.wait, the engine's freed()) ticked within it: it would add only
            # lock and GIL traffic, which on a small host delays that very thread.
            if woken or time.monotonic() - self._last_tick >= interval:
                try:
                    self.tick()
                except Exception:  # never let the progress thread die silently
                    log.exception("kvxfer progress thread")
            self._idle_nap = True  # before reading the state: see nudge
            live = [t for t in list(self._transfers.values()) if not t.meta.posting]
            unwaited = [t for t in live if not t.waited_on]
            if any(t.meta.handle is not None for t in unwaited):
                # In flight. Transfers still inside their post are left out: polling
                # them is of no use, and on a small host it takes CPU from the very
                # copy the post is doing.
                interval = config.progress_interval_s
            elif unwaited:
                # Only push receptions, awaiting their producers' notices.
                interval = max(config.progress_interval_s, RECEPTION_TICK_S)
            elif live:
                # Every one has a thread in wait() polling it at the fast pace already;
                # a second poller would double the wakeups, and on a small host those
                # take CPU from the copy being waited for. This one stays a backstop.
                interval = max(config.progress_interval_s, WAITED_TICK_S)
            elif self._leases.held and config.direction is Direction.PULL:
                # Held blocks may be being read: NIXL completes a consumer's READ only
                # after this side's worker progressed, so the 50 ms idle sleep used to
                # add up to 50 ms to a pull. A tick costs a few µs. (A push producer's
                # leases wait for its own writes, which are transfers, above.)
                interval = LEASE_TICK_S
            else:
                interval = IDLE_NAP_S
            self._idle_nap = interval == IDLE_NAP_S
            self._nap_s = interval
            woken = self._wake.wait(interval)
            self._wake.clear()

    def poll_tick(self) -> None:
        """What a :meth:`Transfer.poll` drives: a round of progress, unless any thread
        ran one within half the progress interval. An engine polls each of its
        transfers once a step (the vLLM adapter does); one round serves them all,
        instead of one round of notices, statuses and deadlines per transfer. (Half:
        a waiter polling at the interval itself must never see its round skipped.)"""
        if time.monotonic() - self._last_tick >= 0.5 * self._config.progress_interval_s:
            self.tick()

    def tick(self) -> None:
        """One round of progress, from any thread. The agent lock covers bookkeeping
        only: backend calls (which wait for the backend's own lock while another thread
        posts) and staging copies run outside it, so a long post never stalls the
        engine's calls."""
        if self.closed:
            return
        self._last_tick = time.monotonic()
        notes = self._backend.drain_notifications()
        with self._lock:
            complete = self._notices.handle(notes) if notes else []
            polled = [(t, t.meta.handle) for t in self._transfers.values()]
        for t in complete:
            self.succeed(t)
        now = time.monotonic()
        for t, handle in polled:
            if t.done:
                continue
            if t.meta.doomed is not None:
                self._finish(t)  # quarantined: ask whether its bytes ended
                continue
            if handle is not None:
                state = self._backend.status(handle)
                if t.done or t.meta.handle != handle:
                    # Settled meanwhile by another thread (a waiter, the poster), which
                    # released the handle: a FAILED for that handle says nothing.
                    continue
                if state is XferStatus.DONE:
                    if t.meta.guarding:
                        self._guard_read(t, handle)
                    else:
                        self.landed(t)
                    continue
                if state is XferStatus.FAILED:
                    peer = t.meta.peer
                    if peer is not None:
                        self._peers.mark_suspect(peer)
                    what = "the guard word's read" if t.meta.guarding else "the transfer"
                    self.fail(
                        t,
                        FailureKind.TRANSPORT,
                        TransferError(
                            f"the transport reported an error in {what}: "
                            f"{self._backend.failure_detail(handle)}"
                        ),
                    )
                    continue
            if now > t.deadline:
                if t.meta.awaiting_hold:
                    self.fail(
                        t,
                        FailureKind.LEASE_EXPIRED,
                        TransferError(
                            f"the producer did not hold {t.request_id} within "
                            f"{self._config.transfer_timeout_s:g}s of the pull"
                        ),
                        FailureStage.LEASE,
                    )
                    continue
                self.fail(
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
