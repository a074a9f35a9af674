"""The producer's side of a gathered pull (issue 55): a round's pieces into a slot.

A consumer whose pull takes the gather path sends, per round, a
:class:`~kvxfer.core.wire.GatherRound`: the hold's capability and the round's pieces
(producer address, slot offset, length). :class:`GatherDesk` checks that the hold stands
and that every piece lies wholly inside that hold's blocks (R-SAFE-3: a ticket reads
only its own blocks), lends a staging slot (none free: ``busy``, and the consumer reads
direct), gathers into it and answers the slot and its generation. The slot comes back
at the consumer's :class:`~kvxfer.core.wire.GatherDone`, whose answer also says whether
the slot was still lent at that generation while the hold stood (the consumer scatters
only then), or when the hold ends (a tick sweeps the slots of holds gone): no slot
outlives its hold, so a consumer that died mid-round leaks nothing.

The copy runs outside the agent lock, so a round of many megabytes never stalls the
producer's holds, frees and progress. That is safe because the slot stays the round's
until its copy ends (a hold that ends meanwhile leaves its slot to be released then,
and the round is answered with a refusal), and a consumer scatters a slot only after a
GatherDone finds the hold still standing: bytes copied from blocks the engine got back
are never scattered.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from kvxfer._agent.leases import LeaseBook
from kvxfer._agent.local import LocalEnd
from kvxfer.agent_config import AgentStats
from kvxfer.core import wire
from kvxfer.core.descriptors import build_plan
from kvxfer.core.gather_plan import Copies
from kvxfer.core.layout import MemKind
from kvxfer.core.staging import Slot, extents, first_outside
from kvxfer.errors import LeaseError, PlanError
from kvxfer.io.host_copy import gather_into

__all__ = ["GatherDesk"]

log = logging.getLogger("kvxfer.agent")

UIntArray = np.ndarray


class GatherDesk:
    """A producer's staging slots lent to gathered pulls (internal).

    Args:
        local: The staging buffer and its slots, the cache's descriptor table.
        leases: The holds whose blocks a round may gather.
        stats: The agent's counters.
        lock: The agent lock (the lease book's and the slots' bookkeeping).
        bounces: The backend stages blocks through host buffers (host bounce): its
            rounds are refused, and its consumers read direct.
    """

    def __init__(
        self,
        local: LocalEnd,
        leases: LeaseBook,
        stats: AgentStats,
        lock: threading.RLock,
        *,
        bounces: bool = False,
    ) -> None:
        self._local = local
        self._bounces = bounces
        self._stats = stats
        self._leases = leases
        self._lock = lock
        self._lent: dict[str, list[Slot]] = {}  # request id -> its slots lent now
        self._copying: set[int] = set()  # slots being gathered into now (by index)
        self._orphaned: set[int] = set()  # of those, the ones whose hold ended meanwhile
        # request id -> (capability, the hold's extents): built once per hold.
        self._extents: dict[str, tuple[str, UIntArray, UIntArray]] = {}

    def _hold_extents(self, request_id: str, capability: str) -> tuple[UIntArray, UIntArray]:
        """The byte ranges of ``request_id``'s hold (under the lock).

        Raises:
            LeaseError: no such hold, or the capability is not its token.
        """
        lease = self._leases.held.get(request_id)
        if lease is None or not LeaseBook.authorized(lease, capability):
            self._stats.gather_refused += 1
            if lease is not None:
                self._leases.reject()
            raise LeaseError(f"no hold of {request_id!r} for that capability")
        cached = self._extents.get(request_id)
        if cached is not None and cached[0] == capability:
            return cached[1], cached[2]
        table, _ = self._local.require_registered()
        groups = [list(g) for g in lease.blocks]
        plan = build_plan(table, table, groups, groups, lease.num_tokens)
        runs = plan.runs(table, table)
        starts, ends = extents(runs.remote_addr, runs.length)
        self._extents[request_id] = (capability, starts, ends)
        return starts, ends

    def on_round(self, msg: wire.GatherRound) -> wire.Message:
        """Gather one round into a lent slot (a server worker thread)."""
        staging, slots = self._local.staging, self._local.staging_slots
        if staging is None or slots is None:
            return wire.Reject(code=wire.RejectCode.INVALID, reason="no staging memory here")
        _, exposed = self._local.require_registered()
        if self._bounces or any(r.mem is not MemKind.DRAM for r in exposed.regions):
            # The copies are memmoves by address: device memory (or a host bounce's
            # buffers, which stage_out fills only for direct reads) is not theirs.
            return wire.Reject(
                code=wire.RejectCode.INVALID, reason="gathered rounds read host memory only"
            )
        try:
            copies = Copies.unpack(msg.pieces)
        except PlanError as exc:
            return wire.Reject(code=wire.RejectCode.INVALID, reason=str(exc))
        with self._lock:
            starts, ends = self._hold_extents(msg.request_id, msg.capability)
            bad = first_outside(copies.addr, copies.length, starts, ends)
            if bad is not None:
                self._stats.gather_refused += 1
                return wire.Reject(
                    code=wire.RejectCode.INVALID,
                    reason=f"gather piece {bad} of {msg.request_id!r} lies outside its hold",
                )
            slot = slots.acquire()
            if slot is None:
                return wire.GatherSlot(request_id=msg.request_id, busy=True)
            self._lent.setdefault(msg.request_id, []).append(slot)
            self._copying.add(slot.index)
        failure: Exception | None = None
        try:
            gather_into(copies, staging.base + slot.offset, slot.nbytes)
        except Exception as exc:
            failure = exc
        with self._lock:
            self._copying.discard(slot.index)
            ended = slot.index in self._orphaned
            if ended:
                self._orphaned.discard(slot.index)
                slots.release(slot)
            elif failure is not None:
                self._give_back(msg.request_id, slot)
            else:
                self._stats.gather_served += 1
        if failure is not None:
            raise failure
        if ended:
            return wire.Reject(
                code=wire.RejectCode.UNKNOWN_REQUEST,
                reason=f"the hold of {msg.request_id!r} ended while its round was gathered",
            )
        return wire.GatherSlot(
            request_id=msg.request_id,
            slot=slot.index,
            offset=slot.offset,
            generation=slot.generation,
        )

    def on_done(self, msg: wire.GatherDone) -> wire.Message:
        """Take a slot back; confirm it was still the consumer's and the hold stood."""
        with self._lock:
            mine = [
                s
                for s in self._lent.get(msg.request_id, ())
                if s.index == msg.slot and s.generation == msg.generation
            ]
            lease = self._leases.held.get(msg.request_id)
            held = lease is not None and LeaseBook.authorized(lease, msg.capability)
            if mine and held:
                self._give_back(msg.request_id, mine[0])
                return wire.GatherSlot(
                    request_id=msg.request_id, slot=msg.slot, generation=msg.generation
                )
        # Not lent at that generation (released with its hold, or a stranger's): a
        # GatherDone frees nothing it does not hold, and the consumer scatters nothing.
        return wire.Reject(
            code=wire.RejectCode.UNKNOWN_REQUEST,
            reason=f"slot {msg.slot} of {msg.request_id!r} is no longer lent to it",
        )

    def _give_back(self, request_id: str, slot: Slot) -> None:
        """Release ``slot`` (under the lock); one still being gathered into is released
        when its copy ends, so no other round can copy into it meanwhile."""
        slots = self._local.staging_slots
        lent = self._lent.get(request_id, [])
        if slot in lent:
            lent.remove(slot)
        if not lent:
            self._lent.pop(request_id, None)
        if slot.index in self._copying:
            self._orphaned.add(slot.index)
        elif slots is not None:
            slots.release(slot)

    def forget(self, request_id: str) -> None:
        """A hold ends (the lease book's ``on_free``, under the lock): its slots come
        back and its extents go, so no slot outlives its hold."""
        with self._lock:
            for slot in list(self._lent.get(request_id, ())):
                log.info("hold %s ended with staging slot %d lent", request_id, slot.index)
                self._give_back(request_id, slot)
            self._extents.pop(request_id, None)

    @property
    def lent(self) -> int:
        """How many slots are lent now (tests, stats)."""
        with self._lock:
            return sum(len(v) for v in self._lent.values())
