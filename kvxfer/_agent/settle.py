"""Settling transfers: DONE once, FAILED once no byte of it can land (R-SAFE-5).

:class:`Settler` keeps the transfers in flight and moves each to its one final state
(:func:`kvxfer.transfer.settle`). A failure first *dooms* a transfer (it can never be
DONE from then on, and a pull's producer is told to release at once, R-SAFE-4); it
settles FAILED only when its handle ended and, for a push reception, its producer
said its writes ended or is proven gone. Meanwhile its blocks are quarantined and
counted (``AgentStats.quarantined``, ``quarantines``). A guarded pull's DONE notice
goes to its producer only when it settles DONE.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from kvxfer._agent.peers import PeerCache
from kvxfer._agent.receptions import Receptions
from kvxfer.agent_config import AgentStats
from kvxfer.backend import Backend
from kvxfer.core import blocks
from kvxfer.errors import BackendError, KvxferError, TransferError, TransferTimeout
from kvxfer.transfer import FailureKind, FailureStage, Transfer, TransferState, settle

__all__ = ["Settler"]

log = logging.getLogger("kvxfer.agent")

#: Failures after which a transfer's peer is handshaken anew before its next use.
_SUSPECT_KINDS = frozenset({FailureKind.PEER_GONE, FailureKind.TRANSPORT, FailureKind.TIMEOUT})


class Settler:
    """The transfers in flight and their settling (internal).

    Args:
        backend: Releases and cancels handles, stages a push reception in.
        peers: A peer whose transfer failed in transport is marked suspect.
        receptions: Forgets a push reception once it settled.
        stats: The agent's counters.
        lock: The agent lock (guards the bookkeeping, never held across a copy).

    Attributes:
        transfers: The transfers in flight, by id.
        closed: The agent closed: nothing is told to peers any more.
    """

    def __init__(
        self,
        backend: Backend,
        peers: PeerCache,
        receptions: Receptions,
        stats: AgentStats,
        lock: threading.RLock,
    ) -> None:
        self._backend = backend
        self._stages = backend.capabilities.stages_through_host
        self._peers = peers
        self._receptions = receptions
        self._stats = stats
        self._lock = lock
        self.transfers: dict[int, Transfer] = {}
        self.closed = False

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
            if quiet and meta.reception is not None:
                meta.reception.writer_live = False
            if meta.doomed is None:
                where = FailureStage.of(kind) if stage is None else stage
                err = error if isinstance(error, KvxferError) else BackendError(str(error))
                if kind is FailureKind.TIMEOUT and not isinstance(err, TransferTimeout):
                    err = TransferTimeout(str(err))
                meta.doomed = (kind, err, where)
                meta.doomed_at = time.monotonic()
                if meta.pull is not None:
                    release, meta.pull.release = meta.pull.release, None
                why = f"{where.value}: {err}"
                if kind in _SUSPECT_KINDS:
                    # Its connection may be dead for good: the next use handshakes
                    # and connects anew (kvxfer._agent.peers).
                    for peer in meta.peers():
                        self._peers.mark_suspect(peer)
        if release is not None and not self.closed:
            release(why)
        self.finish(transfer)

    def finish(self, transfer: Transfer) -> None:
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
            elif meta.doomed[0] in _SUSPECT_KINDS and meta.write is None:
                # A READ in flight after a timeout or a transport failure: its
                # connection is likely dead. Removing the peer now makes the transport
                # end it (its bytes come through our own connection, which goes); at
                # the next use it would wait for a request that may not come. A WRITE
                # is left to end on its own (Backend.remove_peer): removed, NIXL calls
                # it over while its bytes go on, and they land when a cut link returns.
                # The transport ends it once its connection stalled for the backend's
                # stall_limit_s (the agent's transfer_timeout_s).
                busy = True
                for peer in meta.peers():
                    self._peers.drop_suspect(peer)
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
        self.settle_failed(transfer)

    def settle_failed(self, transfer: Transfer) -> None:
        """Settle a doomed transfer FAILED now (counted, its handle released)."""
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
            self.transfers.pop(id(transfer), None)
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

    def capability_of(self, request_id: str) -> str:
        """The capability one of our transfers of ``request_id`` carries ("" if none)."""
        with self._lock:
            for t in self.transfers.values():
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
            if t.meta.reception is not None:
                t.meta.reception.stage_in = True
        self.succeed(t)

    def abort_request(self, request_id: str) -> None:
        """The engine aborted ``request_id``: its own pulls and push receptions of it
        fail now, all blocks invalid, and never become DONE (R-SAFE-2); their handles
        are released, so a transport that can cancel moves no further byte."""
        with self._lock:
            mine = [
                t
                for t in self.transfers.values()
                if t.request_id == request_id and t.meta.write is None
            ]
            for t in mine:
                # A push reception stays expected: its producer's PUSHED or FAILED
                # notice is what says its writes ended (R-SAFE-5).
                if t.meta.pull is not None:
                    t.meta.pull.release = None  # the abort itself tells the producer
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
            reception = meta.reception
            if reception is not None:
                reception.writer_live = False
            # Across TP sizes a copy in moves every producer rank's heads: one reception
            # copies, the first to settle once all of them are complete (every rank's
            # bytes landed); the others settle without (Fanout settles the request after
            # the one that copies).
            copy_in = (
                self._stages
                and reception is not None
                and reception.stage_in
                and all(s.stage_in and not s.copies_in for s in reception.siblings)
                and meta.doomed is None
            )
            if copy_in:
                assert reception is not None
                reception.copies_in = True
            # The copy from the staging buffers writes the engine's blocks: busy until
            # it returns, so that an abort meanwhile quarantines instead of settling
            # FAILED under a copy still running (R-SAFE-5).
            meta.posting = meta.posting or copy_in
        if copy_in:
            try:
                self._backend.stage_in(
                    [np.asarray(g, dtype=np.int64) for g in transfer.local_blocks]
                )
            finally:
                with self._lock:
                    meta.posting = False
        if meta.doomed is not None:  # failed meanwhile (an abort, the deadline, a close)
            self.finish(transfer)
            return
        if settle(transfer, TransferState.DONE):
            handle, meta.handle = meta.handle, None
            if handle is not None:
                self._backend.release(handle)
            if (
                meta.pull is not None
                and meta.pull.done_notice is not None
                and meta.peer is not None
            ):
                # A guarded pull's DONE goes only now, after its guard word was read (the
                # producer frees on it, which changes the word), and off the data
                # endpoint: see _send_done.
                self._send_done(transfer)
            with self._lock:
                self.transfers.pop(id(transfer), None)
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
        worker (``meta.pull.release`` with ``done=True``): a backend notification would,
        on UCX, make this endpoint's next read complete only after the producer's
        worker progressed (~1 ms, docs/EMBEDDING.md), and the data path of a pull
        never waits for the producer. Measured (``python -m kvxfer.tools.latency``, 1-16
        blocks): 195-432 µs pull->done this way, 600-1584 µs with the notice sent as a
        notification after the guard read. Without a release callback (never for an
        Agent's pull) the notice goes as a notification."""
        meta = t.meta
        pull = meta.pull
        assert pull is not None and pull.done_notice is not None
        if pull.release is None:
            assert meta.peer is not None
            try:
                self._backend.notify(meta.peer.handle, pull.done_notice())
            except KvxferError as exc:
                self._stats.notices_failed += 1
                log.info("could not send the DONE notice of %s: %s", t.request_id, exc)
            return
        release, pull.release = pull.release, None
        release("")  # "" : done

    def close(self) -> bool:
        """Fail every transfer in flight, quarantined or not (closing ends them all).

        Returns:
            False if it was closed already (idempotent).
        """
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            for t in list(self.transfers.values()):
                # Closing ends every transfer now, quarantined or not: the backend
                # releases every handle next and the engine stops using the blocks.
                t.meta.posting = False
                if t.meta.reception is not None:
                    t.meta.reception.writer_live = False
                    t.meta.reception.writer_until = 0.0
                self.fail(
                    t, FailureKind.ABORTED, TransferError("agent closed"), FailureStage.TRANSFER
                )
                if not t.done:
                    self.settle_failed(t)
        return True
