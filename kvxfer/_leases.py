"""A producer's leases: the blocks it holds for consumers, and when they are freed.

A :class:`Lease` keeps a request's blocks untouched until its consumer says it is done
(a DONE or ABORT notice, a Release message), the engine releases it, or it expires
(R-XFER-4); then the request id joins the ids :meth:`kvxfer.agent.Agent.freed`
hands back. A settlement can arrive before the engine's ``hold()`` of that request:
it is remembered for a while, so that the hold frees at once.

Every method runs under the agent lock (its callers hold it).
"""

from __future__ import annotations

import logging
import time

import msgspec

from kvxfer import wire
from kvxfer.agent_config import AgentStats
from kvxfer.transfer import Transfer, TransferState

__all__ = ["EARLY_KEEP_S", "Lease", "LeaseBook"]

log = logging.getLogger("kvxfer.agent")

# How long a settlement that arrived before its hold() is remembered.
EARLY_KEEP_S = 120.0


class Lease(msgspec.Struct, kw_only=True):
    """A producer's hold on a request's blocks (R-XFER-4)."""

    request_id: str
    blocks: tuple[tuple[int, ...], ...]
    num_tokens: int
    expiry: float
    # push: where to write, once the consumer registered its blocks
    target: wire.PushRegister | None = None
    ready: bool = False  # prefill finished (hold() called), for push
    pushed_blocks: int = 0  # push_stream: leading blocks already written
    parts_posted: int = 0
    final_posted: bool = False
    writes: list[Transfer] = msgspec.field(default_factory=list)
    final_notice: tuple[float, bytes] | None = None  # push: encoded at registration


class LeaseBook:
    """The leases held, the request ids freed since the engine last asked, and the
    settlements that came before their hold (internal; callers hold the agent lock).

    Attributes:
        held: Leases by request id.
    """

    def __init__(self, stats: AgentStats) -> None:
        self.held: dict[str, Lease] = {}
        self._stats = stats
        self._freed: list[str] = []
        self._early: dict[str, float] = {}  # request id -> monotonic arrival

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

    def free(self, request_id: str) -> None:
        """Drop the lease and hand its blocks back to the engine (a push write failed)."""
        del self.held[request_id]
        self._freed.append(request_id)

    def released(self, request_id: str) -> None:
        """The lease served its consumer: free it, counted as released."""
        self.free(request_id)
        self._stats.leases_released += 1

    def abort(self, request_id: str) -> bool:
        """Free a request's lease at once (the engine or its consumer gave up)."""
        if self.held.pop(request_id, None) is None:
            return False
        self._stats.leases_aborted += 1
        self._freed.append(request_id)
        return True

    def settled(self, request_id: str, *, remember: bool) -> None:
        """Its consumer settled the request (DONE, ABORT or FAILED notice): free the
        lease; with none held yet, ``remember`` keeps the settlement for its hold."""
        if self.held.pop(request_id, None) is not None:
            self._stats.leases_released += 1
            self._freed.append(request_id)
        elif remember:
            self.remember_early(request_id)

    def remember_early(self, request_id: str) -> None:
        """A settlement for a request not held yet (its hold() frees at once)."""
        self._early[request_id] = time.monotonic()

    def take_early(self, request_id: str) -> bool:
        """Whether the request was settled before its hold; if so it is freed now."""
        if self._early.pop(request_id, None) is None:
            return False
        self._stats.leases_released += 1
        self._freed.append(request_id)
        return True

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
            writing = any(w.state is TransferState.PENDING for w in lease.writes)
            if lease.expiry < now_wall and not writing:
                del self.held[rid]
                self._stats.leases_expired += 1
                self._freed.append(rid)
                log.warning("lease of request %s expired; blocks released", rid)
