"""The producer's calls, as the engine makes them: hold, stream, release, freed.

:meth:`Producer.hold` checks a finished prompt's blocks, leases them
(:class:`~kvxfer._agent.holds.HoldDesk`), and on a push producer starts the writes to
every consumer rank that registered already (:class:`~kvxfer._agent.push_write.PushWriter`).
It is the counterpart of the consumer's :class:`~kvxfer._agent.pull.Puller`: the Agent
hands each producer call here and keeps only the public API's documentation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvxfer._agent.guard import FreeReason
from kvxfer._agent.holds import HoldDesk
from kvxfer._agent.leases import LeaseBook
from kvxfer._agent.local import LocalEnd
from kvxfer._agent.push_write import PushWriter, Write
from kvxfer._agent.runtime import Runtime
from kvxfer._agent.side_channel import SideChannel
from kvxfer.backend import Backend
from kvxfer.core import blocks
from kvxfer.core.blocks import BlockIds
from kvxfer.errors import ConfigError
from kvxfer.ticket import Ticket
from kvxfer.types import Direction

__all__ = ["Producer"]


class Producer:
    """A producer's engine-facing calls (internal; documented on :class:`~kvxfer.agent.Agent`).

    Args:
        local: Identity, registered memory and the block-id rules.
        backend: The transport (a host-bounce backend stages blocks out here).
        holds: Leases the blocks and mints the tickets.
        push: Writes a push producer's held blocks.
        leases: The holds, freed and drained here.
        runtime: The progress loop (nudged by a pull's hold, ticked by ``freed``).
        side: The side channel, whose address a ticket names.
        lock: The agent lock.
    """

    def __init__(
        self,
        local: LocalEnd,
        backend: Backend,
        holds: HoldDesk,
        push: PushWriter,
        leases: LeaseBook,
        runtime: Runtime,
        side: SideChannel,
        lock: threading.RLock,
    ) -> None:
        self._local = local
        self._config = local.config
        self._backend = backend
        # stage_out / stage_in do something only on a backend that stages through host memory.
        self._stages = backend.capabilities.stages_through_host
        self._holds = holds
        self._push = push
        self._leases = leases
        self._runtime = runtime
        self._side = side
        self._lock = lock

    def stage_out(self, block_ids: BlockIds) -> None:
        """Copy the blocks to the staging buffers (a no-op on a direct backend)."""
        local = self._local.block_groups(block_ids)
        if self._stages:
            self._backend.stage_out(list(local))

    def hold(
        self,
        request_id: str,
        block_ids: BlockIds,
        num_tokens: int,
        *,
        lease_s: float | None,
        staged: bool,
        capability: str,
        guard: tuple[int, int] | None,
        pin: bool,
    ) -> Ticket:
        """Hold the blocks, return the ticket; a push's writes start here."""
        local = self._local.block_groups(block_ids)
        self._local.check_counts(local, num_tokens, 0)
        groups = blocks.to_wire(local)
        expiry = time.time() + (self._config.lease_s if lease_s is None else lease_s)
        address = self._side.address if self._side.serving else ("", 0)
        pulled = self._config.direction is Direction.PULL
        if self._stages and pulled and not staged:
            # host bounce: the consumer reads the staging buffers, so fill them first
            # (a push stages each slice as it writes it: Backend.post_engine).
            self._backend.stage_out(list(local))
        writes: list[Write] = []
        with self._lock:
            held = self._holds.hold(
                request_id,
                groups,
                num_tokens,
                expiry,
                address,
                capability=capability,
                guard=guard,
                pin=pin,
            )
            if isinstance(held, Ticket):
                return held  # freed at once: its consumer was done before
            lease, ticket = held
            if not pulled and lease.targets:
                writes = self._push.start(lease)
        self._push.post_inline(writes)  # outside the lock: a post may copy every byte
        if pulled:
            # The lease wants the progress thread's faster pace (see Runtime._run); a
            # push has nothing to poll until its writer posted, which wakes the thread.
            self._runtime.nudge()
        return ticket

    def stream(self, request_id: str, block_ids: BlockIds, num_tokens: int) -> None:
        """push_stream: write the blocks closed so far."""
        if not self._config.push_stream:
            raise ConfigError("push_stream", False, "stream() needs push_stream enabled")
        groups = blocks.to_wire(self._local.block_groups(block_ids))
        self._push.stream(request_id, groups, num_tokens)

    def release(self, request_id: str) -> bool:
        """Free a request's hold at once; False when it held nothing."""
        with self._lock:
            return self._leases.free(request_id, FreeReason.RELEASED)

    def freed(self) -> list[str]:
        """The request ids freed since the last call (after a tick)."""
        self._runtime.tick()
        with self._lock:
            return self._leases.drain_freed()

    def add_freed_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` each time a request id reaches :meth:`freed` (under the lock)."""
        with self._lock:
            self._leases.freed_callbacks.append(fn)

    def holding(self) -> list[str]:
        """The request ids held now."""
        with self._lock:
            return list(self._leases.held)
