"""A producer's leases: the blocks it holds for consumers, and when they are freed.

A :class:`Lease` keeps a request's blocks untouched until its consumer says it is done
(a DONE or ABORT notice, a Release message), the engine releases it, or it expires
(R-XFER-4); then the request id joins the ids :meth:`kvxfer.agent.Agent.freed`
hands back. A settlement can arrive before the engine's ``hold()`` of that request:
it is remembered for a while, so that the hold frees at once.

:meth:`LeaseBook.free` is the one way a request reaches ``freed()``: it overwrites the
hold's guard word first (:mod:`kvxfer._agent.guard`), so a consumer's pull that read blocks
the engine may already reuse fails closed. Whatever frees or asks about a hold from the
network must show its capability (:meth:`LeaseBook.authorized`); every table the network
can grow here is capped (R-SAFE-3).

Every method runs under the agent lock (its callers hold it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from kvxfer._agent.guard import FreeReason, GuardBook
from kvxfer.agent_config import AgentStats
from kvxfer.core import wire
from kvxfer.transfer import Transfer, TransferState

if TYPE_CHECKING:
    from kvxfer._agent.peers import Peer

__all__ = [
    "EARLY_KEEP_S",
    "MAX_EARLY",
    "MAX_OUTCOMES",
    "MAX_PENDING",
    "MAX_RIVALS",
    "Lease",
    "LeaseBook",
    "Target",
]

log = logging.getLogger("kvxfer.agent")

# How long a settlement that arrived before its hold() is remembered, and how many
# (oldest evicted first): anyone on the side channel can send them.
EARLY_KEEP_S = 10.0
MAX_EARLY = 1024
# Push registrations waiting for their hold() (more are refused NOT_READY).
MAX_PENDING = 512
# Registrations of one request that wait, beside the first, for a hold() that names
# its consumer by capability (more are refused).
MAX_RIVALS = 4
# Ended holds whose outcome a probing consumer may still ask about (oldest evicted).
MAX_OUTCOMES = 1024


class Target(msgspec.Struct, kw_only=True):
    """Push: one consumer rank's registration of a held request, and its writes."""

    register: wire.PushRegister
    final_notice: tuple[float, bytes] | None = None  # encoded at registration
    pushed_blocks: int = 0  # push_stream: leading blocks already written
    parts_posted: int = 0
    final_posted: bool = False
    peer: Peer | None = None  # the consumer rank once a write was posted (told on failure)


class Lease(msgspec.Struct, kw_only=True):
    """A producer's hold on a request's blocks (R-XFER-4)."""

    request_id: str
    blocks: tuple[tuple[int, ...], ...]
    num_tokens: int
    expiry: float
    # push: where to write, by consumer rank (``PushRegister.reader``; one, rank 0,
    # unless the consumer's TP size differs), once each registered its blocks
    targets: dict[int, Target] = msgspec.field(default_factory=dict)
    readers: int = 1  # push: consumer ranks to write to before the hold ends
    ready: bool = False  # prefill finished (hold() called), for push
    duration: float = 0.0  # the lease's length at hold(): what a Renew extends it by
    writes: list[Transfer] = msgspec.field(default_factory=list)
    capability: str = ""  # the hold's token (in its ticket)
    # push: the hold's capability came from the caller (the router minted it and gave it
    # to the consumer too), so only a registration showing it may receive the KV.
    pinned: bool = False
    # push, before hold(): registrations of this id beside ``targets`` from another
    # consumer, each with its encoded final notice; hold() keeps those showing its
    # capability.
    rivals: list[tuple[wire.PushRegister, tuple[float, bytes]]] = msgspec.field(
        default_factory=list
    )
    guard: tuple[int, int] | None = None  # guard slot and generation (pull)

    @property
    def consumer(self) -> wire.PushRegister | None:
        """Push: the first registration bound (every consumer rank shows its token)."""
        return next((t.register for t in self.targets.values()), None)

    @property
    def all_written(self) -> bool:
        """Push: every consumer rank registered and got its final write posted."""
        return len(self.targets) >= self.readers and all(
            t.final_posted for t in self.targets.values()
        )


class LeaseBook:
    """The leases held, the request ids freed since the engine last asked, and the
    settlements that came before their hold (internal; callers hold the agent lock).

    Args:
        stats: The agent's counters.
        on_free: Called with a lease and its reason as it is freed, before its id
            reaches ``freed()`` (the push writer cancels its writes there).

    Attributes:
        held: Leases by request id.
        guard: The guard table (None until registered, or when the backend has none).
    """

    def __init__(
        self, stats: AgentStats, on_free: Callable[[Lease, FreeReason], None] | None = None
    ) -> None:
        self.held: dict[str, Lease] = {}
        self.guard: GuardBook | None = None
        self.on_free = on_free
        #: Called (no arguments) each time a request id reaches ``freed()``.
        self.freed_callbacks: list[Callable[[], None]] = []
        self._stats = stats
        self._freed: list[str] = []
        self._early: dict[str, float] = {}  # request id -> monotonic arrival
        self._pending: set[str] = set()  # push registrations without their hold yet
        # request id -> (state, reason, capabilities that may ask)
        self._outcomes: dict[str, tuple[wire.HoldState, str, tuple[str, ...]]] = {}
        #: Freed push leases with writes still in flight (NIXL cannot cancel them): a
        #: probe hears WRITING until the last one ended, then the consumers are told
        #: (kvxfer._agent.push_write), so no consumer reuses blocks a late write lands in.
        self.draining: dict[str, tuple[Lease, str]] = {}

    def __bool__(self) -> bool:
        """True while anything is held or remembered (a tick has work)."""
        return bool(self.held or self._early)

    def lease(
        self, request_id: str, blocks: tuple[tuple[int, ...], ...], num_tokens: int, expiry: float
    ) -> Lease:
        """The request's lease, made now if it has none (its fields are the caller's)."""
        lease = self.held.get(request_id)
        if lease is None:
            lease = Lease(
                request_id=request_id, blocks=blocks, num_tokens=num_tokens, expiry=expiry
            )
            self.held[request_id] = lease
        return lease

    def arm(
        self,
        lease: Lease,
        capability: str = "",
        guard: tuple[int, int] | None = None,
        *,
        pin: bool = True,
    ) -> None:
        """The engine's hold(): the lease is ready; its capability and guard word are
        minted here, or given by the caller (a re-hold keeps both).

        A given guard slot that is out of range or armed already is logged, not
        armed: the word there is not the ticket's generation, so its pulls fail closed.
        """
        lease.ready = True
        self._pending.discard(lease.request_id)
        if not lease.capability:
            lease.capability = capability or wire.new_capability()
            lease.pinned = bool(capability) and pin
        self._bind_target(lease)
        if lease.guard is None and self.guard is not None:
            if guard is None:
                lease.guard = self.guard.arm()
            else:
                lease.guard = self.guard.arm_at(*guard)
                if lease.guard is None:
                    log.error(
                        "hold of %s: guard slot %d is out of range or taken; its pulls "
                        "will fail closed",
                        lease.request_id,
                        guard[0],
                    )

    def _bind_target(self, lease: Lease) -> None:
        """Push: with a pinned capability, keep the registrations that show it (a
        stranger's that came first is dropped; none: wait for the consumer's)."""
        rivals, lease.rivals = lease.rivals, []
        if not lease.pinned or not lease.targets:
            return
        strangers = [
            r
            for r, t in lease.targets.items()
            if not wire.capability_matches(lease.capability, t.register.capability)
        ]
        if not strangers:
            return
        self._stats.capability_rejects += 1
        log.warning(
            "hold of %s: dropped a push registration without its capability", lease.request_id
        )
        for r in strangers:
            del lease.targets[r]
        for msg, notice in rivals:
            if msg.reader not in lease.targets and wire.capability_matches(
                lease.capability, msg.capability
            ):
                lease.targets[msg.reader] = Target(register=msg, final_notice=notice)
                lease.readers = msg.readers

    def registration_room(self, request_id: str) -> bool:
        """Whether a push registration of ``request_id`` may make a lease (capped)."""
        return request_id in self.held or len(self._pending) < MAX_PENDING

    def registered(self, request_id: str) -> None:
        """A push registration made a lease that waits for its hold()."""
        if not self.held[request_id].ready:
            self._pending.add(request_id)

    def renew(self, request_id: str, capability: str, now: float, default_s: float) -> float:
        """Extend a held request's lease to its length (``Lease.duration``, else
        ``default_s``) from ``now`` (wall clock), never shortening it.

        Returns:
            The lease's expiry now, or 0.0 when nothing of that id is held for
            ``capability`` (a wrong capability is counted as a reject).
        """
        lease = self.held.get(request_id)
        if lease is None:
            return 0.0
        if not self.authorized(lease, capability):
            self.reject()
            return 0.0
        lease.expiry = max(lease.expiry, now + (lease.duration or default_s))
        self._stats.leases_renewed += 1
        return lease.expiry

    def reject(self) -> None:
        """Count a message refused for a wrong capability."""
        self._stats.capability_rejects += 1

    @staticmethod
    def authorized(lease: Lease, capability: str) -> bool:
        """Whether ``capability`` is the hold's token or its consumer's registration."""
        if wire.capability_matches(lease.capability, capability):
            return True
        return any(
            wire.capability_matches(t.register.capability, capability)
            for t in lease.targets.values()
        )

    def free(
        self,
        request_id: str,
        reason: FreeReason,
        outcome: wire.HoldState = wire.HoldState.RELEASED,
    ) -> bool:
        """THE way a hold ends: overwrite its guard word, then hand its blocks back.

        Returns:
            False when nothing of that id was held.
        """
        lease = self.held.pop(request_id, None)
        if lease is None:
            return False
        self._pending.discard(request_id)
        if lease.guard is not None and self.guard is not None:
            self.guard.retire(*lease.guard, reason)
        if self.on_free is not None:
            self.on_free(lease, reason)
        tokens = (lease.capability, *{t.register.capability for t in lease.targets.values()})
        self._outcomes[request_id] = (outcome, reason.text, tokens)
        if len(self._outcomes) > MAX_OUTCOMES:
            del self._outcomes[next(iter(self._outcomes))]
        stats = self._stats
        if reason is FreeReason.EXPIRED:
            stats.leases_expired += 1
        elif reason is FreeReason.ABORTED:
            stats.leases_aborted += 1
        else:
            stats.leases_released += 1
        self._freed.append(request_id)
        for fn in self.freed_callbacks:
            try:
                fn()
            except Exception:  # the engine's: it must not undo the free half-way
                log.exception("a freed callback raised (request %s)", request_id)
        return True

    def hold_state(self, request_id: str, capability: str) -> tuple[wire.HoldState, str]:
        """How the hold of ``request_id`` stands, for a peer that shows its capability
        (UNKNOWN otherwise)."""
        lease = self.held.get(request_id)
        if lease is None and request_id in self.draining:
            lease = self.draining[request_id][0]
            tokens = (lease.capability, *(t.register.capability for t in lease.targets.values()))
            if any(wire.capability_matches(t, capability) for t in tokens if t):
                return wire.HoldState.WRITING, "freed; a write is still ending"
            lease = None
        if lease is not None:
            if not self.authorized(lease, capability):
                return wire.HoldState.UNKNOWN, "no hold of that request for this capability"
            if any(w.state is TransferState.PENDING for w in lease.writes):
                return wire.HoldState.WRITING, ""
            return wire.HoldState.HELD, ""
        ended = self._outcomes.get(request_id)
        if ended is not None and any(wire.capability_matches(t, capability) for t in ended[2]):
            return ended[0], ended[1]
        return wire.HoldState.UNKNOWN, "no hold of that request"

    def ended_unwritten(self, request_id: str) -> str | None:
        """Why the hold of ``request_id`` ended without every write landing (released,
        aborted, expired, failed), while nothing of that id is held; None otherwise
        (held, ended PUSHED, or not remembered: :data:`MAX_OUTCOMES`)."""
        if request_id in self.held:
            return None
        ended = self._outcomes.get(request_id)
        if ended is None or ended[0] not in (wire.HoldState.RELEASED, wire.HoldState.FAILED):
            return None
        return ended[1]

    def ended_pushed(self, request_id: str, capability: str) -> bool:
        """Whether the hold of ``request_id`` ended with every write landed (PUSHED) for
        a consumer that shows ``capability``, while nothing of that id is held: a
        registration from it now is a retry whose first answer was lost."""
        if request_id in self.held:
            return False
        ended = self._outcomes.get(request_id)
        if ended is None or ended[0] is not wire.HoldState.PUSHED:
            return False
        return any(wire.capability_matches(t, capability) for t in ended[2] if t)

    def settled(self, request_id: str, *, remember: bool) -> None:
        """Its consumer settled the request (a DONE notice whose capability was
        checked): free the lease; with none held yet, ``remember`` keeps the
        settlement for its hold."""
        if not self.free(request_id, FreeReason.DONE) and remember:
            self.remember_early(request_id)

    def remember_early(self, request_id: str) -> None:
        """A settlement for a request not held yet (its hold() frees at once). Capped:
        the oldest is forgotten first (its hold then serves a pull that fails closed
        or a lease that expires; never a wrong DONE)."""
        self._early.pop(request_id, None)
        self._early[request_id] = time.monotonic()
        while len(self._early) > MAX_EARLY:
            del self._early[next(iter(self._early))]

    def take_early(self, request_id: str) -> bool:
        """Whether the request was settled before its hold (the caller frees it)."""
        return self._early.pop(request_id, None) is not None

    def drain_freed(self) -> list[str]:
        """The request ids freed since the last call."""
        out, self._freed = self._freed, []
        return out

    def expire(self, now: float) -> None:
        """Forget old early settlements and free the leases past their expiry (``now``:
        monotonic; the leases' expiry is wall clock, as the tickets carry it)."""
        now_wall = time.time()
        if self._early:
            horizon = now - EARLY_KEEP_S
            for rid in [r for r, t in self._early.items() if t < horizon]:
                del self._early[rid]
        for rid, lease in list(self.held.items()):
            # A write in flight keeps its lease until it ends (its own deadline bounds
            # it): freed blocks would be reused while it reads them. A write still
            # handshaking with its consumer moves no byte yet; it does not hold the
            # lease past its expiry (a consumer gone mid-handshake would keep it for
            # every handshake try), and freeing fails it before it posts.
            writing = any(w.state is TransferState.PENDING and w.meta.moving for w in lease.writes)
            if lease.expiry < now_wall and not writing:
                self.free(rid, FreeReason.EXPIRED)
                log.warning("lease of request %s expired; blocks released", rid)
