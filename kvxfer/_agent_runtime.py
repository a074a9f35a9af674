"""The Agent's transfer runtime: posting, settling and the progress loop.

:class:`AgentRuntime` is the part of :class:`~kvxfer.agent.Agent` that moves a posted
transfer to DONE or FAILED: plan and post (:meth:`~AgentRuntime._post`), completion
polling and notices (:meth:`~AgentRuntime._tick`, run by the progress thread and by
any thread that polls), lease expiry, and settling with its bookkeeping. The Agent
adds the public API on top; :mod:`kvxfer._agent_push` adds the push writer.

Locking: one re-entrant agent lock guards the bookkeeping (transfers, leases, freed
ids, counters). It is never held across a backend call that can move bytes (a post,
a stage-in): with UCX over CMA a post copies every byte before it returns.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvxfer import wire
from kvxfer._agent_types import AgentConfig, AgentStats, Lease, describe_blocks, id_arrays
from kvxfer.backend import Backend, XferOp, XferStatus
from kvxfer.descriptors import DescriptorTable, build_plan
from kvxfer.errors import (
    BackendError,
    KvxferError,
    PeerError,
    RegistrationError,
    TransferError,
    TransferTimeout,
)
from kvxfer.layout import KVLayout
from kvxfer.transfer import FailureKind, Transfer, TransferState
from kvxfer.types import Direction, Role

if TYPE_CHECKING:
    from kvxfer._peers import Peer, PeerCache

__all__ = ["AgentRuntime"]

log = logging.getLogger("kvxfer.agent")

# How long a settlement that arrived before its hold() is remembered.
EARLY_KEEP_S = 120.0
# Progress interval while leases are held and nothing is in flight (see _run).
LEASE_TICK_S = 0.001
# The progress thread's pace while a thread waits on every in-flight transfer (the
# waiters poll them every 0.2 ms): a backstop for a waiter that gives up.
WAITED_TICK_S = 0.005
# The progress thread's sleep when nothing is in flight (an idle agent costs nothing).
IDLE_NAP_S = 0.05


class AgentRuntime(abc.ABC):
    """Transfer machinery shared by the Agent's API and its push writer (internal).

    The attributes are set by :meth:`kvxfer.agent.Agent.__init__`.
    """

    config: AgentConfig
    backend: Backend
    incarnation: int
    compat_hash: str
    exposed_layout: KVLayout | None
    table: DescriptorTable | None
    stats_counters: AgentStats
    _auth_key: bytes | None
    _stages: bool
    _lock: threading.RLock
    _peers: PeerCache
    _leases: dict[str, Lease]
    _freed: list[str]
    _transfers: dict[int, Transfer]
    _expected_push: dict[str, Transfer]
    _final_notices: dict[bytes, tuple[wire.Notice, float]]  # notice, known until
    _early: dict[str, float]
    _closed: bool
    _wake: threading.Event
    _idle_nap: bool
    _nap_s: float  # the progress thread's current sleep between rounds
    _thread: threading.Thread | None
    _deferred: KVLayout | None
    _last_tick: float

    # -- hooks of the push writer (kvxfer._agent_push) ----------------------------------
    @abc.abstractmethod
    def _start_push(self, lease: Lease) -> None:
        """Write what is left of a ready lease to its registered consumer."""

    @abc.abstractmethod
    def _settle_lease_write(self, transfer: Transfer, ok: bool) -> None:
        """A push write finished (under the lock): free its lease when due."""

    # -- posting and settling -----------------------------------------------------------
    def _require_registered(self) -> tuple[DescriptorTable, KVLayout]:
        if self.table is None or self.exposed_layout is None:
            state = "deferred" if self._deferred is not None else "missing"
            raise RegistrationError(f"KV memory registration is {state}; register() first")
        return self.table, self.exposed_layout

    def _encode(self, msg: wire.Message) -> bytes:
        return wire.encode(msg, self.compat_hash, auth_key=self._auth_key)

    def _lease_over(self, expiry: float) -> bool:
        # One-sided reads cannot be refused by the producer, so the consumer enforces the
        # lease itself, with a guard for clock skew between the two hosts.
        return time.time() > expiry - self.config.lease_guard_s

    @staticmethod
    def _expired_error(request_id: str) -> TransferError:
        return TransferError(
            f"the producer's lease on {request_id} ran out before its blocks were read; "
            "they may have been reused (raise lease_s, or pull sooner)"
        )

    def _new_transfer(self, request_id: str, groups: tuple[tuple[int, ...], ...]) -> Transfer:
        t = Transfer(
            request_id,
            groups,
            progress=self._poll_tick,
            deadline=time.monotonic() + self.config.transfer_timeout_s,
        )
        with self._lock:
            self._transfers[id(t)] = t
        if self._thread is None:
            self._ensure_thread()
        return t

    def _post(
        self,
        transfer: Transfer,
        op: XferOp,
        peer: Peer,
        local: tuple[tuple[int, ...], ...],
        remote: tuple[tuple[int, ...], ...],
        num_tokens: int,
        notification: bytes | Callable[[int], bytes],
    ) -> None:
        """Plan and post one transfer. Called without the agent lock: with UCX over CMA
        (and the host bounce's staging copies) a post moves bytes before it returns, and
        the lock held that long would stall the engine's hold(), pull() and freed()."""
        table, _ = self._require_registered()
        # Nothing to poll until the post returns: the progress thread keeps its slower
        # pace meanwhile (with UCX over CMA that is the whole copy; see _run).
        transfer.meta["posting"] = True
        t0 = time.perf_counter()
        try:
            plan = build_plan(table, peer.table, id_arrays(local), id_arrays(remote), num_tokens)
        except KvxferError as exc:
            self._fail(transfer, FailureKind.POST, exc)
            return
        t1 = time.perf_counter()
        transfer.stats.plan_s = t1 - t0
        transfer.stats.bytes = plan.nbytes
        transfer.stats.descriptors = plan.num_descriptors
        notif = notification(plan.nbytes) if callable(notification) else notification
        try:
            handle = self.backend.post_engine(
                op, peer.handle, plan.local_ids, plan.remote_ids, notif
            )
        except KvxferError as exc:
            self._peers.mark_suspect(peer)
            kind = FailureKind.PEER_GONE if isinstance(exc, PeerError) else FailureKind.POST
            self._fail(transfer, kind, exc)
            return
        transfer.stats.post_s = time.perf_counter() - t1
        with self._lock:
            if transfer.done:  # failed meanwhile (agent closed, deadline passed)
                self.backend.release(handle)
                return
            transfer.meta["peer"] = peer
            transfer.meta["handle"] = handle
            del transfer.meta["posting"]
        if self.backend.status(handle) is XferStatus.DONE:
            # Moved inside post (UCX over CMA copies synchronously): settle now rather
            # than hand the completion to the progress thread (a GIL hand-off per pull).
            self._landed(transfer)
            return
        if self._nap_s > self.config.progress_interval_s:
            self._wake.set()  # in flight now, and the progress thread naps longer

    def _fail(self, transfer: Transfer, kind: FailureKind, error: BaseException) -> None:
        transfer.stats.failure = kind
        err = error if isinstance(error, KvxferError) else BackendError(str(error))
        if kind is FailureKind.TIMEOUT and not isinstance(err, TransferTimeout):
            err = TransferTimeout(str(err))
        if transfer._settle(TransferState.FAILED, err):
            handle = transfer.meta.pop("handle", None)
            if handle is not None:
                self.backend.release(handle)
            with self._lock:
                self._transfers.pop(id(transfer), None)
                self._final_notices.pop(transfer.meta.pop("notice_bytes", b""), None)
                self.stats_counters.transfers_failed += 1
                self.stats_counters.failures[kind.value] = (
                    self.stats_counters.failures.get(kind.value, 0) + 1
                )
                self._settle_lease_write(transfer, ok=False)
            log.warning(
                "transfer %s failed (%s): %s; %s",
                transfer.request_id,
                kind.value,
                err,
                describe_blocks(transfer.invalid_blocks),
            )

    def _landed(self, t: Transfer) -> None:
        """The backend reports every byte of ``t`` moved: settle it."""
        expiry = t.meta.get("lease_expiry")
        if expiry is not None and self._lease_over(expiry):
            # Landed after the producer was free to reuse the blocks:
            # the bytes may be another request's, so they are not valid.
            self._fail(t, FailureKind.LEASE_EXPIRED, self._expired_error(t.request_id))
        else:
            self._succeed(t)

    def _succeed(self, transfer: Transfer) -> None:
        if self._stages and transfer.meta.get("stage_in"):
            self.backend.stage_in([np.asarray(g, dtype=np.int64) for g in transfer.local_blocks])
        if transfer._settle(TransferState.DONE):
            handle = transfer.meta.pop("handle", None)
            if handle is not None:
                self.backend.release(handle)
            with self._lock:
                self._transfers.pop(id(transfer), None)
                if "notice_bytes" in transfer.meta:  # settled by another notice
                    self._final_notices.pop(transfer.meta.pop("notice_bytes"), None)
                c = self.stats_counters
                c.transfers_done += 1
                c.bytes_moved += transfer.stats.bytes
                c.descriptors_posted += transfer.stats.descriptors
                c.transfer_s_total += transfer.stats.transfer_s
                c.post_s_total += transfer.stats.post_s
                self._settle_lease_write(transfer, ok=True)

    # -- progress ----------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._run, name="kvxfer-progress", daemon=True
                )
                self._thread.start()

    def _nudge(self) -> None:
        """Wake the progress thread only from its long idle sleep: waking it costs a GIL
        hand-off (a few hundred µs on a busy host) on every hold and pull, and from the
        short sleeps it comes back within a millisecond anyway."""
        if self._idle_nap:
            self._wake.set()

    def _run(self) -> None:
        # Sleeps between ticks: short while anything is in flight, long when idle, so
        # an idle agent costs nothing (NIXL's own progress thread would spin a core).
        interval, woken = 0.0, True
        while not self._closed:
            # Skip a round that was not asked for when another thread (a waiter in
            # Transfer.wait, the engine's freed()) ticked within it: it would add only
            # lock and GIL traffic, which on a small host delays that very thread.
            if woken or time.monotonic() - self._last_tick >= interval:
                try:
                    self._tick()
                except Exception:  # never let the progress thread die silently
                    log.exception("kvxfer progress thread")
            self._idle_nap = True  # before reading the state: see _nudge
            live = [t for t in list(self._transfers.values()) if not t.meta.get("posting")]
            if live and any(not t.waited_on for t in live):
                # In flight, or awaiting a push's notices. Transfers still inside their
                # post are left out: polling them is of no use, and on a small host it
                # takes CPU from the very copy the post is doing.
                interval = self.config.progress_interval_s
            elif live:
                # Every one has a thread in wait() polling it at the fast pace already;
                # a second poller would double the wakeups, and on a small host those
                # take CPU from the copy being waited for. This one stays a backstop.
                interval = max(self.config.progress_interval_s, WAITED_TICK_S)
            elif self._leases and self.config.direction is Direction.PULL:
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

    def _poll_tick(self) -> None:
        """What a :meth:`Transfer.poll` drives: a round of progress, unless any thread
        ran one within half the progress interval. An engine polls each of its
        transfers once a step (the vLLM adapter does); one round serves them all,
        instead of one round of notices, statuses and deadlines per transfer. (Half:
        a waiter polling at the interval itself must never see its round skipped.)"""
        if time.monotonic() - self._last_tick >= 0.5 * self.config.progress_interval_s:
            self._tick()

    def _tick(self) -> None:
        """One round of progress, from any thread. The agent lock covers bookkeeping
        only: backend calls (which wait for the backend's own lock while another thread
        posts) and staging copies run outside it, so a long post never stalls the
        engine's calls."""
        if self._closed:
            return
        self._last_tick = time.monotonic()
        notes = self.backend.drain_notifications()
        with self._lock:
            complete = self._handle_notifications(notes) if notes else []
            polled = [(t, t.meta.get("handle")) for t in self._transfers.values()]
        for t in complete:
            self._succeed(t)
        now = time.monotonic()
        for t, handle in polled:
            if t.done:
                continue
            if handle is not None:
                state = self.backend.status(handle)
                if t.done:
                    # Settled meanwhile by another thread (a waiter, the poster), which
                    # released the handle: a FAILED for that handle says nothing.
                    continue
                if state is XferStatus.DONE:
                    self._landed(t)
                    continue
                if state is XferStatus.FAILED:
                    peer = t.meta.get("peer")
                    if peer is not None:
                        self._peers.mark_suspect(peer)
                    self._fail(
                        t, FailureKind.TRANSPORT, TransferError("the transport reported an error")
                    )
                    continue
            if now > t.deadline:
                self._fail(
                    t,
                    FailureKind.TIMEOUT,
                    TransferTimeout(
                        f"transfer {t.request_id} not complete after "
                        f"{self.config.transfer_timeout_s:g}s"
                    ),
                )
        if self._early or self._leases:
            self._tick_leases(now)

    def _tick_leases(self, now: float) -> None:
        now_wall = time.time()
        with self._lock:
            if self._early:
                horizon = now - EARLY_KEEP_S
                for rid in [r for r, t in self._early.items() if t < horizon]:
                    del self._early[rid]
            for rid, lease in list(self._leases.items()):
                writing = any(w.state is TransferState.PENDING for w in lease.writes)
                if lease.expiry < now_wall and not writing:
                    del self._leases[rid]
                    self.stats_counters.leases_expired += 1
                    self._freed.append(rid)
                    log.warning("lease of request %s expired; blocks released", rid)
                elif lease.target is not None and lease.ready and not lease.final_posted:
                    self._start_push(lease)

    # -- notices ------------------------------------------------------------------------
    def _handle_notifications(self, notes: list[tuple[str, bytes]]) -> list[Transfer]:
        """Act on drained notices (under the lock); returns the push receptions that are
        now complete, for the caller to settle outside the lock (stage-in copies)."""
        complete: list[Transfer] = []
        for sender, payload in notes:
            # A final PUSHED notice its producer announced (already checked when the
            # registration's reply brought it): known by its exact bytes while fresh;
            # a late one is decoded and verified below like any other (clock skew).
            known = self._final_notices.pop(payload, None) if self._final_notices else None
            if known is not None and time.monotonic() < known[1]:
                t = self._on_pushed(known[0])
                if t is not None:
                    complete.append(t)
                continue
            try:
                # With a shared secret a notice must be signed by it: a DONE frees held
                # blocks and a PUSHED settles a transfer, so neither may be forged.
                notice = wire.decode_notice(
                    payload, max_bytes=self.config.max_message_bytes, auth_key=self._auth_key
                )
            except KvxferError as exc:
                log.warning("ignored a notification from %s: %s", sender, exc)
                continue
            if notice.kind in (wire.NoticeKind.DONE, wire.NoticeKind.ABORT, wire.NoticeKind.FAILED):
                lease = self._leases.pop(notice.request_id, None)
                if lease is not None:
                    self.stats_counters.leases_released += 1
                    self._freed.append(notice.request_id)
                elif (
                    notice.kind is not wire.NoticeKind.FAILED
                    and self.config.role is not Role.CONSUMER
                ):
                    self._early[notice.request_id] = time.monotonic()
                expected = self._expected_push.pop(notice.request_id, None)
                if expected is not None and notice.kind is wire.NoticeKind.FAILED:
                    self._fail(
                        expected,
                        FailureKind.PEER_GONE,
                        TransferError(f"producer {notice.engine_id} reported a failed write"),
                    )
            elif notice.kind is wire.NoticeKind.PUSHED:
                t = self._on_pushed(notice)
                if t is not None:
                    complete.append(t)
        return complete

    def _on_pushed(self, notice: wire.Notice) -> Transfer | None:
        """Record one PUSHED notice; returns the transfer once every write landed."""
        t = self._expected_push.get(notice.request_id)
        if t is None:
            log.warning("write notice for unknown request %s", notice.request_id)
            return None
        if notice.final and "covered" not in t.meta and notice.block_ids == t.local_blocks:
            # the usual push: one final write of every expected block
            self._expected_push.pop(notice.request_id, None)
            t.meta["stage_in"] = True
            return t
        # Settle only when the final notice arrived and the writes announced so far
        # cover every expected block of every group: no gaps (R-XFER-2).
        covered: list[set[int]] = t.meta.setdefault("covered", [set() for _ in t.local_blocks])
        for group, blocks in zip(covered, notice.block_ids):
            group.update(blocks)
        if notice.final:
            t.meta["final"] = True
        complete = all(set(want) <= got for want, got in zip(t.local_blocks, covered))
        if t.meta.get("final") and complete:
            # every write of the request has landed: no gaps (R-XFER-2)
            self._expected_push.pop(notice.request_id, None)
            t.meta["stage_in"] = True
            return t
        return None
