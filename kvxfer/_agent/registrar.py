"""Registering the engine's KV memory: once per process, before any peer pairs.

:class:`Registrar` hands the layout to the backend (its exposed view is what peers
address), registers the guard table before any peer sees the metadata, builds and
prepares the descriptor table once (with the one-head section a posting side across
TP sizes may need), and keeps what the layout was built from alive until the agent
closes. A registration may be deferred until the engine's warm-up is over.
"""

from __future__ import annotations

import logging
import threading

from kvxfer._agent.guard import GuardBook
from kvxfer._agent.leases import LeaseBook
from kvxfer._agent.local import LocalEnd
from kvxfer.backend import Backend
from kvxfer.core import wire
from kvxfer.core.descriptors import DescriptorTable
from kvxfer.core.heads import place_heads
from kvxfer.core.layout import KVLayout, MemKind, take_tensors
from kvxfer.core.staging import StagingSlots
from kvxfer.core.tp_plan import HeadSection, head_section, prepared_rows
from kvxfer.errors import KvxferError, RegistrationError

__all__ = ["Registrar"]

log = logging.getLogger("kvxfer.agent")


class Registrar:
    """The registration of one agent's memory (internal).

    Args:
        local: Where the registered layout and table go (shared by the parts).
        backend: Registers the memory and the guard table, prepares the table.
        leases: Take the guard table (a producer's holds arm its words).
        lock: The agent lock.
        log_prefix: Starts its log lines (the backend's).
    """

    def __init__(
        self,
        local: LocalEnd,
        backend: Backend,
        leases: LeaseBook,
        lock: threading.RLock,
        log_prefix: str,
    ) -> None:
        self._local = local
        self._backend = backend
        self._leases = leases
        self._lock = lock
        self._log_prefix = log_prefix
        # What register(keep=...) / register_tensors() keep alive while registered.
        self._kept: object = None

    def register(self, layout: KVLayout, *, defer: bool, keep: object) -> None:
        """:meth:`Agent.register <kvxfer.agent.Agent.register>`."""
        with self._lock:
            if self._local.layout is not None or self._local.deferred is not None:
                raise RegistrationError("this agent already has a registered layout")
            sources = take_tensors(layout)  # from now on the agent's to keep
            self._kept = keep if keep is not None else sources
            if defer:
                self._local.deferred = layout
                log.info("%sdeferring registration until the engine is warmed up", self._log_prefix)
                return
            self._register_now(layout)

    def complete(self) -> None:
        """Finish a deferred registration (no-op when nothing is deferred)."""
        with self._lock:
            if self._local.deferred is not None:
                layout, self._local.deferred = self._local.deferred, None
                self._register_now(layout)

    def drop(self) -> None:
        """Deregistered (the backend closed): the engine's tensors are its own again."""
        self._kept = None

    def _register_staging(self, nbytes: int, slots: int) -> None:
        """The gather path's staging buffer (issue 55), before any peer sees our
        metadata. A backend without staging memory leaves it off: every request then
        goes direct, as with gather off, so this logs rather than fails."""
        try:
            base = self._backend.register_staging(nbytes)
        except KvxferError as e:
            log.warning("%sno staging memory, gather path off: %s", self._log_prefix, e)
            return
        local = self._local
        local.staging = wire.StagingInfo(base=base, nbytes=nbytes, slots=slots, mem=MemKind.DRAM)
        local.staging_slots = StagingSlots(nbytes, slots)

    def _register_now(self, layout: KVLayout) -> None:
        config = self._local.config
        backend = self._backend
        tp = config.tp
        if tp is not None:
            # Peers of other TP sizes match regions by global head: an engine may
            # describe its tensor's heads rank-locally (0..heads_per_rank-1).
            layout = place_heads(layout, tp.heads, tp.rank)
        exposed = backend.register(layout)
        if backend.capabilities.guard:
            # Before any peer sees our metadata (NIXL's covers the table).
            words = backend.register_guard(GuardBook.slots_for(exposed.num_blocks))
            self._leases.guard = GuardBook(words)
        gather = config.gather
        if gather.enabled:
            self._register_staging(gather.staging_bytes, gather.slots)
        table = DescriptorTable.build(exposed, config.plan)
        section = self._head_section(table)
        backend.prepare_local(prepared_rows(table, section))
        local = self._local
        local.registered(layout, exposed, table, section)
        shards = len({(r.device_id, r.shard) for r in exposed.regions})
        log.info(
            "%sregistered %d regions / %d shards, %d descriptors, %d blocks of %d tokens",
            self._log_prefix,
            len(exposed.regions),
            shards,
            len(table.addr),
            exposed.num_blocks,
            exposed.block_size,
        )
        if section is not None:
            log.info(
                "%salso prepared %d one-head descriptor(s) for peers of other TP sizes",
                self._log_prefix,
                len(section.table),
            )

    def _head_section(self, table: DescriptorTable) -> HeadSection | None:
        """The one-head descriptors this agent posts from when a peer of another TP
        size holds fewer heads per region than its own regions (kvxfer.core.tp_plan).

        Only a side that posts needs them (a pull's consumer, a push's producer): the
        other side's table is cut by its peer at the handshake, from its layout. A
        cut the table's options refuse (chunks or window granules of a head-major
        cache) leaves none, and such pairs are refused by name when they plan."""
        tp = self._local.config.tp
        if tp is None or not self._local.posts or not self._backend.capabilities.head_sections:
            return None
        try:
            return head_section(table, tp.heads, tp.rank)
        except KvxferError as exc:
            log.info("%sno one-head descriptors for other TP sizes: %s", self._log_prefix, exc)
            return None
