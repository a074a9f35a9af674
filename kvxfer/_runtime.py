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

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from kvxfer import blocks, wire
from kvxfer._leases import LeaseBook
from kvxfer._local import LocalEnd
from kvxfer._peers import Peer, PeerCache
from kvxfer._receptions import Receptions
from kvxfer.agent_config import AgentStats
from kvxfer.backend import Backend, XferOp, XferStatus
from kvxfer.descriptors import build_plan
from kvxfer.errors import BackendError, KvxferError, PeerError, TransferError, TransferTimeout
from kvxfer.transfer import FailureKind, Transfer, TransferState, settle
from kvxfer.types import Direction, Role

__all__ = ["IDLE_NAP_S", "LEASE_TICK_S", "RECEPTION_TICK_S", "WAITED_TICK_S", "Runtime"]

log = logging.getLogger("kvxfer.agent")

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
    ) -> None:
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
        t = Transfer(
            request_id,
            groups,
            progress=self.poll_tick,
            deadline=time.monotonic() + self._config.transfer_timeout_s,
        )
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
    ) -> None:
        """Plan and post one transfer. Called without the agent lock: with UCX over CMA
        (and the host bounce's staging copies) a post moves bytes before it returns, and
        the lock held that long would stall the engine's hold(), pull() and freed()."""
        table, _ = self._local.require_registered()
        meta = transfer.meta
        # Nothing to poll until the post returns: the progress thread keeps its slower
        # pace meanwhile (with UCX over CMA that is the whole copy; see _run).
        meta.posting = True
        t0 = time.perf_counter()
        try:
            plan = build_plan(table, peer.table, local, remote, num_tokens)
        except KvxferError as exc:
            self.fail(transfer, FailureKind.POST, exc)
            return
        t1 = time.perf_counter()
        transfer.stats.plan_s = t1 - t0
        transfer.stats.bytes = plan.nbytes
        transfer.stats.descriptors = plan.num_descriptors
        notif = notification(plan.nbytes) if callable(notification) else notification
        try:
            handle = self._backend.post_engine(
                op, peer.handle, plan.local_ids, plan.remote_ids, notif
            )
        except KvxferError as exc:
            self._peers.mark_suspect(peer)
            kind = FailureKind.PEER_GONE if isinstance(exc, PeerError) else FailureKind.POST
            self.fail(transfer, kind, exc)
            return
        transfer.stats.post_s = time.perf_counter() - t1
        with self._lock:
            if transfer.done:  # failed meanwhile (agent closed, deadline passed)
                self._backend.release(handle)
                return
            meta.peer = peer
            meta.handle = handle
            meta.posting = False
        if self._backend.status(handle) is XferStatus.DONE:
            # Moved inside post (UCX over CMA copies synchronously): settle now rather
            # than hand the completion to the progress thread (a GIL hand-off per pull).
            self.landed(transfer)
            return
        if self._nap_s > self._config.progress_interval_s:
            self._wake.set()  # in flight now, and the progress thread naps longer

    def fail(self, transfer: Transfer, kind: FailureKind, error: BaseException) -> None:
        """Settle ``transfer`` as FAILED (once), release its handle, count it."""
        transfer.stats.failure = kind
        err = error if isinstance(error, KvxferError) else BackendError(str(error))
        if kind is FailureKind.TIMEOUT and not isinstance(err, TransferTimeout):
            err = TransferTimeout(str(err))
        if settle(transfer, TransferState.FAILED, err):
            meta = transfer.meta
            handle, meta.handle = meta.handle, None
            if handle is not None:
                self._backend.release(handle)
            with self._lock:
                self._transfers.pop(id(transfer), None)
                self._receptions.forget(transfer)
                self._stats.transfers_failed += 1
                self._stats.failures[kind.value] = self._stats.failures.get(kind.value, 0) + 1
                if meta.on_settled is not None:
                    meta.on_settled(transfer, False)
            log.warning(
                "transfer %s failed (%s): %s; %s",
                transfer.request_id,
                kind.value,
                err,
                blocks.describe(transfer.invalid_blocks),
            )

    def landed(self, t: Transfer) -> None:
        """The backend reports every byte of ``t`` moved: settle it."""
        expiry = t.meta.lease_expiry
        if expiry is not None and self.lease_over(expiry):
            # Landed after the producer was free to reuse the blocks:
            # the bytes may be another request's, so they are not valid.
            self.fail(t, FailureKind.LEASE_EXPIRED, self.expired_error(t.request_id))
        else:
            self.succeed(t)

    def succeed(self, transfer: Transfer) -> None:
        """Settle ``transfer`` as DONE (once; a push reception copies in first)."""
        meta = transfer.meta
        if self._stages and meta.stage_in:
            self._backend.stage_in([np.asarray(g, dtype=np.int64) for g in transfer.local_blocks])
        if settle(transfer, TransferState.DONE):
            handle, meta.handle = meta.handle, None
            if handle is not None:
                self._backend.release(handle)
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
                self.fail(t, FailureKind.ABORTED, TransferError("agent closed"))
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
            complete = self._handle_notifications(notes) if notes else []
            polled = [(t, t.meta.handle) for t in self._transfers.values()]
        for t in complete:
            self.succeed(t)
        now = time.monotonic()
        for t, handle in polled:
            if t.done:
                continue
            if handle is not None:
                state = self._backend.status(handle)
                if t.done:
                    # Settled meanwhile by another thread (a waiter, the poster), which
                    # released the handle: a FAILED for that handle says nothing.
                    continue
                if state is XferStatus.DONE:
                    self.landed(t)
                    continue
                if state is XferStatus.FAILED:
                    peer = t.meta.peer
                    if peer is not None:
                        self._peers.mark_suspect(peer)
                    self.fail(
                        t, FailureKind.TRANSPORT, TransferError("the transport reported an error")
                    )
                    continue
            if now > t.deadline:
                self.fail(
                    t,
                    FailureKind.TIMEOUT,
                    TransferTimeout(
                        f"transfer {t.request_id} not complete after "
                        f"{self._config.transfer_timeout_s:g}s"
                    ),
                )
        if self._leases:
            with self._lock:
                self._leases.expire(now)
                for hook in self._tick_hooks:
                    hook()

    # -- notices ------------------------------------------------------------------------
    def _handle_notifications(self, notes: list[tuple[str, bytes]]) -> list[Transfer]:
        """Act on drained notices (under the lock); returns the push receptions that are
        now complete, for the caller to settle outside the lock (stage-in copies)."""
        complete: list[Transfer] = []
        receptions = self._receptions
        for sender, payload in notes:
            # A final PUSHED notice its producer announced (already checked when the
            # registration's reply brought it): known by its exact bytes while fresh.
            known = receptions.announced(payload)
            if known is not None:
                t = receptions.pushed(known)
                if t is not None:
                    complete.append(t)
                continue
            try:
                # With a shared secret a notice must be signed by it: a DONE frees held
                # blocks and a PUSHED settles a transfer, so neither may be forged.
                notice = wire.decode_notice(
                    payload,
                    max_bytes=self._config.max_message_bytes,
                    auth_key=self._local.auth_key,
                )
            except KvxferError as exc:
                log.warning("ignored a notification from %s: %s", sender, exc)
                continue
            if notice.kind in (wire.NoticeKind.DONE, wire.NoticeKind.ABORT, wire.NoticeKind.FAILED):
                self._leases.settled(
                    notice.request_id,
                    remember=notice.kind is not wire.NoticeKind.FAILED
                    and self._config.role is not Role.CONSUMER,
                )
                expected = receptions.expected.pop(notice.request_id, None)
                if expected is not None and notice.kind is wire.NoticeKind.FAILED:
                    self.fail(
                        expected,
                        FailureKind.PEER_GONE,
                        TransferError(f"producer {notice.engine_id} reported a failed write"),
                    )
            elif notice.kind is wire.NoticeKind.PUSHED:
                t = receptions.pushed(notice)
                if t is not None:
                    complete.append(t)
        return complete
