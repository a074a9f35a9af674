"""The consumer's side of a gathered pull (issue 55): rounds through the staging slots.

:meth:`GatherPuller.start` takes the gather path when this agent and the producer
both have staging memory, the producer announced it (``Welcome.staging``: only then
does it take the gather messages, so the protocol version stays; see
:mod:`kvxfer.core.wire`) and :func:`~kvxfer.core.gather_cost.choose_path` says GATHER
(or ``force`` does). Else the caller posts direct, as before.

Per round, on an io worker: a :class:`~kvxfer.core.wire.GatherRound` (the producer
checks the pieces against the hold and gathers them into a slot), one ``post_runs``
READ of that slot into this agent's own slot, a :class:`~kvxfer.core.wire.GatherDone`
whose answer says the slot was still lent at its generation while the hold stood (the
gathered pull's guard check: the bytes were copied while the producer held the
blocks, and no other request reused the slot since), and only then the scatter into
the local blocks. Any failure fails the transfer with all its local blocks (a round may
have written some): never a success for bytes that did not land (R-SAFE-1, R-SAFE-5).
The transfer is marked posting meanwhile, so a deadline or an abort quarantines it
until the worker stopped writing. A busy producer (no free slot) sends the request
direct.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import numpy as np

from kvxfer._agent.local import LocalEnd
from kvxfer._agent.peers import Peer
from kvxfer._agent.runtime import Runtime
from kvxfer._agent.side_channel import SideChannel
from kvxfer._agent.workers import IoPool
from kvxfer.agent_config import AgentStats
from kvxfer.backend import Backend, XferOp, XferStatus
from kvxfer.core import wire
from kvxfer.core.blocks import Pairing
from kvxfer.core.descriptors import Plan, Runs, plan_pairing
from kvxfer.core.gather_cost import XferPath, choose_path
from kvxfer.core.gather_plan import StagingPlan
from kvxfer.core.layout import MemKind
from kvxfer.core.ratio import UnitPairing
from kvxfer.core.staging import Slot
from kvxfer.errors import HandshakeRejected, KvxferError, TransferError, TransferTimeout
from kvxfer.io.host_copy import scatter_from
from kvxfer.ticket import Ticket
from kvxfer.transfer import FailureKind, Transfer

__all__ = ["GatherPuller"]

log = logging.getLogger("kvxfer.agent")


class _Busy(Exception):
    """The producer had no free slot: the request goes direct."""


class _Refused(TransferError):
    """The producer refused a round or its GatherDone."""


class _Quarantined(TransferTimeout):
    """A slot READ past its deadline that the transport could not cancel: its bytes
    may still land in our slot, so the slot is never lent again (a leak that is safe)."""


class GatherPuller:
    """A consumer's gathered pulls (internal).

    Args:
        local: This agent's staging slots, its table and the gather config.
        backend: Posts each round's one-run READ.
        runtime: Settles the transfer.
        side: Sends the rounds' messages.
        io: The worker threads the rounds run on.
        stats: The agent's counters.
        lock: The agent lock (the slots', the counters' and the transfer's bookkeeping).
    """

    def __init__(
        self,
        local: LocalEnd,
        backend: Backend,
        runtime: Runtime,
        side: SideChannel,
        io: IoPool,
        stats: AgentStats,
        lock: threading.RLock,
    ) -> None:
        self._local = local
        self._stats = stats
        self._backend = backend
        self._runtime = runtime
        self._side = side
        self._io = io
        self._lock = lock

    def start(
        self,
        transfer: Transfer,
        peer: Peer,
        ticket: Ticket,
        pairing: Pairing | UnitPairing,
        direct: Callable[[], None],
    ) -> Pairing | UnitPairing | Plan | None:
        """Start ``transfer`` on the gather path when it applies (None); else the work
        the caller posts direct (nothing was done): the request's plan where choosing
        made one (so that a request that goes direct is planned once), or ``pairing``.
        ``direct`` posts it direct later (a busy producer)."""
        plan, made = self._plan(peer, pairing)
        work = pairing if made is None else made
        slots = self._local.staging_slots
        if plan is None or slots is None:
            return work
        meta = transfer.meta
        with self._lock:
            if meta.doomed is not None or transfer.done:
                return work  # the direct post settles it as it does any doomed pull
            slot = slots.acquire()
            if slot is None:
                self._stats.gather_busy += 1
                return work  # our own slots are lent: direct (staging never grows)
            self._stats.gathered_pulls += 1
            # Busy until the rounds stop writing our blocks: a deadline or an abort
            # meanwhile quarantines the transfer instead of settling it (R-SAFE-5).
            meta.posting = True
        transfer.stats.path = XferPath.GATHER
        if not self._io.submit(self._run, transfer, peer, ticket, plan, slot, direct):
            self._stop(transfer, slot)
            transfer.stats.path = XferPath.DIRECT
            return work
        return None

    def _plan(
        self, peer: Peer, pairing: Pairing | UnitPairing
    ) -> tuple[StagingPlan | None, Plan | None]:
        """The rounds of a request that is gathered, and the request's plan where one
        was made."""
        config = self._local.config.gather
        mine, theirs = self._local.staging, peer.info.staging
        if (
            not config.enabled
            or config.force is XferPath.DIRECT
            or mine is None
            or theirs is None
            or not isinstance(pairing, Pairing)
            or not self._backend.capabilities.address_runs
            or self._backend.capabilities.stages_through_host
        ):
            return None, None
        table, exposed = self._local.require_registered()
        if any(r.mem is not MemKind.DRAM for r in (*exposed.regions, *peer.layout.regions)):
            return None, None  # the copies are memmoves by address: host memory only, for now
        try:
            made = plan_pairing(table, peer.table, pairing)
            runs = made.runs(table, peer.table)
        except KvxferError:
            return None, None  # the direct post fails it the same way, as before
        # A round fits the smaller of the two sides' slots.
        slot_bytes = min(mine.nbytes // mine.slots, theirs.nbytes // theirs.slots)
        choice = choose_path(
            runs, msgspec.structs.replace(config, staging_bytes=slot_bytes, slots=1)
        )
        plan = choice.staging
        if choice.path is not XferPath.GATHER or plan is None:
            return None, made
        # A round's message must fit a side-channel frame (a piece packs into 24
        # bytes; the rest of the frame in well under 1 KiB): else read direct.
        fits = min(
            wire.MAX_GATHER_PIECES,
            (self._local.config.max_message_bytes - 1024) // wire.GATHER_PIECE_BYTES,
        )
        if any(len(r.remote) > fits for r in plan.rounds):
            return None, made
        return plan, made

    def _stop(self, transfer: Transfer, slot: Slot | None) -> None:
        """The rounds stopped writing: give our slot back, end the posting mark."""
        with self._lock:
            if slot is not None and self._local.staging_slots is not None:
                self._local.staging_slots.release(slot)
            transfer.meta.posting = False

    def _ask(self, ticket: Ticket, transfer: Transfer, msg: wire.Message) -> wire.GatherSlot:
        left = transfer.deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"request {ticket.request_id!r}: gathered pull past its deadline")
        try:
            answer = self._side.request(ticket.host, ticket.port, msg, timeout_s=left, retries=0)
        except HandshakeRejected as exc:
            raise _Refused(f"request {ticket.request_id!r}: producer refused: {exc}") from exc
        except KvxferError as exc:
            raise TransferError(f"request {ticket.request_id!r}: gather round: {exc}") from exc
        if not isinstance(answer, wire.GatherSlot):
            raise TransferError(f"request {ticket.request_id!r}: gather round answered {answer!r}")
        return answer

    def _run(
        self,
        transfer: Transfer,
        peer: Peer,
        ticket: Ticket,
        plan: StagingPlan,
        slot: Slot,
        direct: Callable[[], None],
    ) -> None:
        mine, theirs = self._local.staging, peer.info.staging
        assert mine is not None and theirs is not None
        here = mine.base + slot.offset
        kind = FailureKind.TRANSPORT
        error: KvxferError | None = None
        held: Slot | None = slot
        posted = 0
        t0 = time.perf_counter()
        try:
            for rnd in plan.rounds:
                if transfer.meta.doomed is not None:
                    break  # failed meanwhile (deadline, abort): settled below
                pieces = rnd.remote.pack()
                got = self._ask(
                    ticket,
                    transfer,
                    wire.GatherRound(
                        request_id=ticket.request_id,
                        capability=ticket.capability,
                        engine_id=self._local.config.engine_id,
                        pieces=pieces,
                    ),
                )
                if got.busy:
                    # Also mid-request: a direct READ of the whole request rewrites
                    # every block the earlier rounds scattered into.
                    raise _Busy
                self._read(transfer, peer, here, theirs.base + got.offset, rnd.nbytes)
                posted += 1
                self._ask(
                    ticket,
                    transfer,
                    wire.GatherDone(
                        request_id=ticket.request_id,
                        capability=ticket.capability,
                        engine_id=self._local.config.engine_id,
                        slot=got.slot,
                        generation=got.generation,
                    ),
                )
                if ticket.lease_expiry and self._runtime.lease_over(ticket.lease_expiry):
                    kind = FailureKind.LEASE_EXPIRED
                    raise self._runtime.expired_error(ticket.request_id)
                scatter_from(rnd.local, here, slot.nbytes)
        except _Busy:
            with self._lock:
                self._stats.gather_busy += 1
            self._stop(transfer, held)
            transfer.stats.path = XferPath.DIRECT
            log.info("request %s: producer staging busy, reading direct", ticket.request_id)
            direct()
            return
        except TransferTimeout as exc:
            if isinstance(exc, _Quarantined):
                held = None
            kind, error = FailureKind.TIMEOUT, exc
        except _Refused as exc:
            # The producer refused (a piece outside the hold, the hold or slot gone):
            # what a fail-closed check says of blocks it no longer vouches for.
            kind, error = FailureKind.LEASE_EXPIRED, exc
        except KvxferError as exc:
            error = exc
        except Exception as exc:  # never leave the transfer posting for ever
            log.exception("gathered pull of %s", ticket.request_id)
            error = TransferError(f"request {ticket.request_id!r}: gathered pull: {exc}")
        with self._lock:
            self._stats.gather_rounds += posted
        stats = transfer.stats
        stats.descriptors = posted
        stats.transfer_s = time.perf_counter() - t0
        self._stop(transfer, held)
        if error is not None or transfer.meta.doomed is not None:
            if error is None:
                error = TransferError(f"request {ticket.request_id!r}: gathered pull stopped")
            self._runtime.fail(transfer, kind, error)
            return
        stats.bytes = plan.nbytes
        self._runtime.succeed(transfer)

    def _read(self, transfer: Transfer, peer: Peer, here: int, there: int, nbytes: int) -> None:
        """One round's READ: the producer's slot into ours, one run, waited for."""
        zero = np.zeros(1, dtype=np.int64)
        run = Runs(
            local_addr=np.array([here], dtype=np.uint64),
            remote_addr=np.array([there], dtype=np.uint64),
            length=np.array([nbytes], dtype=np.uint64),
            local_device=zero,
            remote_device=zero,
        )
        handle = self._backend.post_runs(XferOp.READ, peer.handle, run)
        while True:
            status = self._backend.status(handle)
            if status is XferStatus.DONE:
                self._backend.release(handle)
                return
            if status is not XferStatus.PENDING:
                self._backend.release(handle)
                raise TransferError(f"request {transfer.request_id!r}: slot READ {status.name}")
            if transfer.meta.doomed is not None or time.monotonic() > transfer.deadline:
                if self._backend.cancel(handle):  # released: no byte of it moves any more
                    raise TransferTimeout(f"request {transfer.request_id!r}: slot READ timed out")
                raise _Quarantined(f"request {transfer.request_id!r}: slot READ still in flight")
            time.sleep(0.0002)
