"""What the NIXL backends share: handle bookkeeping over one NIXL-style agent.

``ucx`` and ``nixl_rbln`` differ only in how their agent is made (NIXL's UCX plugin,
or the nixl-rbln adapter) and in what they can do; the rest is this class. It keeps
the prepared descriptor lists (the local one, one per peer), the posted transfers and
their peers, and it tears all of it down in the one order NIXL survives.

Teardown order matters: NIXL/UCX processes crash at interpreter exit when a memory
registration outlives its agent or a prepared list outlives its registration.
:meth:`AgentBackend.close` releases transfers, then prepared lists, then peers, then
memory, then the agent, and is registered with ``atexit`` (through a weak reference)
so an engine that forgets to close still exits cleanly.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt

from kvxfer.backend import Backend, BackendOptions, PeerHandle, XferHandle, XferOp, XferStatus
from kvxfer.backends._nixl import (
    NixlCall,
    NixlEndpoint,
    RunsEndpoint,
    map_nixl_errors,
    nixl_error,
)
from kvxfer.core.layout import MemKind
from kvxfer.core.merging import RUNS_MIN_PAIRS, joins, posted_units
from kvxfer.core.wire import GuardTable
from kvxfer.errors import BackendError, KvxferError, PeerError, RegistrationError

if TYPE_CHECKING:
    from kvxfer.core.block_lists import ChainLists
    from kvxfer.core.descriptors import DescriptorTable, Runs
    from kvxfer.core.layout import KVLayout

__all__ = ["LANDING_WORDS", "MAX_CHAIN_LISTS", "AgentBackend", "merged_intervals"]

log = logging.getLogger("kvxfer.backends")

#: Guard-word reads that can be in flight at once (each lands in its own word).
LANDING_WORDS = 1024
_WORD = 8
#: Chain lists prepared per peer, at most (one per planner of a pull across TP sizes:
#: one per replica choice, eight at most, unless planners are evicted and rebuilt).
MAX_CHAIN_LISTS = 32


def merged_intervals(
    starts: npt.NDArray[np.uint64], ends: npt.NDArray[np.uint64]
) -> list[tuple[int, int]]:
    """Union of half-open byte intervals, as sorted disjoint ``(start, end)`` pairs.

    Regions of one tensor can interleave (K and V of a block side by side), and NIXL
    refuses overlapping registrations, so memory is registered as this union.
    """
    if len(starts) == 0:
        return []
    order = np.argsort(starts, kind="stable")
    s = starts[order].astype(np.int64)
    e = ends[order].astype(np.int64)
    reach = np.maximum.accumulate(e)
    # A new interval starts wherever it begins after everything before it ended.
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    idx = np.flatnonzero(new)
    last = np.append(idx[1:] - 1, len(s) - 1)
    return [(int(a), int(b)) for a, b in zip(s[idx], reach[last])]


def region_extents(layout: KVLayout) -> dict[tuple[MemKind, int], list[tuple[int, int]]]:
    """Per (memory kind, device): the merged byte ranges the layout's regions span."""
    groups: dict[tuple[MemKind, int], tuple[list[int], list[int]]] = {}
    for r in layout.regions:
        starts, ends = groups.setdefault((r.mem, r.device_id), ([], []))
        starts.append(r.base)
        ends.append(r.end)
    return {
        key: merged_intervals(np.array(s, dtype=np.uint64), np.array(e, dtype=np.uint64))
        for key, (s, e) in groups.items()
    }


def _mem_kind_of(table: DescriptorTable) -> MemKind:
    kinds = {r.mem for r in table.layout.regions}
    if len(kinds) != 1:
        raise RegistrationError(f"a descriptor table must hold one memory kind, got {kinds}")
    return kinds.pop()


def _descs(table: DescriptorTable) -> npt.NDArray[np.uint64]:
    return np.stack([table.addr, table.length, table.device.astype(np.uint64)], axis=1)


class _Rows:
    """What a post needs of one prepared list to cut per-request runs from its ids."""

    __slots__ = ("abuts", "addr", "device", "length", "mem", "single_device")

    def __init__(self, table: DescriptorTable) -> None:
        self.addr, self.length, self.device = table.addr, table.length, table.device
        self.mem = _mem_kind_of(table)
        self.single_device = table.single_device
        # Whether some descriptor ends where another starts that is not its neighbour in
        # the list (one region per head): only then can a post merge more than NIXL
        # does on prepared ids. Found once here, so that posts over lists without such
        # pairs (one region per layer) skip the per-post address gathers.
        order = np.argsort(self.addr, kind="stable")
        addr, length = self.addr[order], self.length[order]
        meet = addr[1:] == addr[:-1] + length[:-1]
        self.abuts = bool((meet & (order[1:] != order[:-1] + 1)).any())


class AgentBackend(Backend):
    """A :class:`~kvxfer.backend.Backend` over one NIXL-style agent.

    Subclasses make the agent and say what it can do (``name``, ``capabilities``).

    Args:
        options: The backend options (the agent is already named after them).
        agent: The endpoint (see :class:`~kvxfer.backends._nixl.NixlEndpoint`).
        description: What moves the bytes, for errors and logs ("NIXL plugin UCX").
    """

    def __init__(self, options: BackendOptions, agent: NixlEndpoint, description: str) -> None:
        self._options = options
        self._agent: NixlEndpoint | None = agent
        # Checked once: a Protocol isinstance costs ~10 µs, on every post otherwise.
        self._posts_runs = isinstance(agent, RunsEndpoint)
        self._description = description
        self._lock = threading.RLock()
        self._registrations: list[object] = []
        self._local: object | None = None
        self._peers: dict[PeerHandle, object] = {}  # peer -> its prepared descriptor list
        # The rows behind the prepared lists (local, per peer): posts whose pairs merge
        # into far fewer runs than NIXL merges on its own go as per-request run lists.
        self._local_rows: _Rows | None = None
        self._peer_rows: dict[PeerHandle, _Rows] = {}
        # Chain lists prepared per peer (prepare_lists), by id with the object itself
        # (held, so that its id is never reused while the entry lives).
        self._chain_lists: dict[PeerHandle, dict[int, tuple[ChainLists, object, object]]] = {}
        self.lists_posted = 0  # posts of chain-list rows (stats, tests)
        self.runs_posted = 0  # posts sent as per-request run lists (stats, tests)
        self._xfers: dict[XferHandle, tuple[object, PeerHandle]] = {}
        # WRITEs into a peer's memory, and removed peers whose NIXL connection stays
        # until their WRITEs in flight end on their own (see remove_peer).
        self._writes: set[XferHandle] = set()
        self._retiring: set[PeerHandle] = set()
        self._ids = itertools.count(1)
        self._registered: KVLayout | None = None
        self._metadata: bytes | None = None  # NIXL's blob for peers; None: read it again
        self._closed = False
        # Fail-closed pulls: our guard table and the landing words of our guard reads
        # (one registered host array), peers' prepared guard tables, reads in flight.
        self._words: npt.NDArray[np.uint64] | None = None
        self._guard_slots = 0
        self._landing: object | None = None
        self._landing_free: deque[int] = deque()
        # Per peer: its prepared guard list, and the row of its sink word in that list
        # (None: it announced none).
        self._peer_guards: dict[PeerHandle, tuple[object, int | None]] = {}
        self._guard_reads: dict[XferHandle, int] = {}  # handle -> landing word
        # The gather path's staging buffer (issue 55): kept alive while registered.
        self._staging: npt.NDArray[np.uint8] | None = None
        self._failed: dict[XferHandle, str] = {}  # what NIXL said of a failed transfer
        # atexit holds only a weak reference: a backend dropped early is closed by GC.
        ref = weakref.ref(self)

        def _close_at_exit() -> None:
            backend = ref()
            if backend is not None:
                backend.close()

        atexit.register(_close_at_exit)

    # -- identity -------------------------------------------------------------------
    @property
    def agent_name(self) -> str:
        return self._options.agent_name

    def _live(self) -> NixlEndpoint:
        if self._agent is None:
            raise BackendError(f"backend {self.agent_name} is closed")
        return self._agent

    def metadata(self) -> bytes:
        # Read from NIXL once per change of what is registered, then served from here:
        # every handshake asks for it (a Welcome carries it), and NIXL 1.5.1's binding
        # keeps the GIL through getLocalMD, so a call that waits inside NIXL (for the
        # agent's own lock, say, while UCX works) stops every thread of the process.
        # A producer whose decode ranks handshook at once stalled 1-6 s right after.
        with self._lock:
            agent = self._live()
            if self._metadata is None:
                with map_nixl_errors(NixlCall.START, f"{self._description}: agent metadata"):
                    self._metadata = agent.metadata()
            return self._metadata

    def _quietly(self, call: NixlCall, what: str, step: Callable[[], object], level: int) -> None:
        """A teardown step whose failure is logged, not raised: nothing is left to undo."""
        try:
            with map_nixl_errors(call, what):
                step()
        except KvxferError as exc:
            log.log(level, "%s", exc)

    # -- memory ---------------------------------------------------------------------
    def register(self, layout: KVLayout) -> KVLayout:
        with self._lock:
            agent = self._live()
            if self._registered is not None:
                raise RegistrationError("this backend already registered a layout")
            # Shards of one device are registered together; K/V of one tensor
            # interleave, and NIXL refuses overlapping ranges: register the union.
            for (kind, device), spans in region_extents(layout).items():
                what = (
                    f"{self._description} refused {len(spans)} {kind.value} "
                    f"range(s) on device {device}"
                )
                self._metadata = None
                with map_nixl_errors(NixlCall.REGISTER, what):
                    reg = agent.register(kind, device, [(s, e - s) for s, e in spans])
                self._registrations.append(reg)
            self._registered = layout
            return layout

    def prepare_local(self, table: DescriptorTable) -> None:
        with self._lock:
            agent = self._live()
            with map_nixl_errors(NixlCall.REGISTER, "could not prepare the local descriptors"):
                if self._local is not None:
                    agent.release_descs(self._local)
                    self._local = None
                self._local = agent.prep_descs(None, _mem_kind_of(table), _descs(table))
                self._local_rows = _Rows(table)

    # -- guard table (fail-closed pulls; docs/RELIABILITY.md) -------------------------
    def register_guard(self, slots: int) -> npt.NDArray[np.uint64]:
        with self._lock:
            agent = self._live()
            if self._words is not None:
                raise RegistrationError("this backend already registered a guard table")
            if slots < 1:
                raise RegistrationError(f"a guard table needs at least one slot, not {slots}")
            # One host array: the table peers read, our own landing words, then the sink
            # word peers may write (and the source of our own sink writes).
            words = np.zeros(slots + LANDING_WORDS + 1, dtype=np.uint64)
            base = int(words.ctypes.data)
            what = f"{self._description} refused the guard table ({words.nbytes} B of DRAM)"
            self._metadata = None
            with map_nixl_errors(NixlCall.REGISTER, what):
                reg = agent.register(MemKind.DRAM, 0, [(base, words.nbytes)])
            self._registrations.append(reg)
            landing = base + slots * _WORD
            descs = np.array(
                [(landing + i * _WORD, _WORD, 0) for i in range(LANDING_WORDS + 1)],
                dtype=np.uint64,
            )
            with map_nixl_errors(NixlCall.REGISTER, "preparing the guard landing words"):
                self._landing = agent.prep_descs(None, MemKind.DRAM, descs)
            self._words, self._guard_slots = words, slots
            self._landing_free = deque(range(LANDING_WORDS))
            return words[:slots]

    def register_staging(self, nbytes: int) -> int:
        with self._lock:
            agent = self._live()
            if self._staging is not None:
                raise RegistrationError("this backend already registered staging memory")
            if nbytes < 1:
                raise RegistrationError(f"staging memory needs at least one byte, not {nbytes}")
            staging = np.zeros(nbytes, dtype=np.uint8)
            base = int(staging.ctypes.data)
            what = f"{self._description} refused the staging buffer ({nbytes} B of DRAM)"
            self._metadata = None  # the peers' blob must cover the new registration
            with map_nixl_errors(NixlCall.REGISTER, what):
                reg = agent.register(MemKind.DRAM, 0, [(base, nbytes)])
            self._registrations.append(reg)
            self._staging = staging
            return base

    def guard_table(self) -> GuardTable | None:
        with self._lock:
            if self._words is None:
                return None
            base = int(self._words.ctypes.data)
            sink = base + (self._guard_slots + LANDING_WORDS) * _WORD
            return GuardTable(base=base, slots=self._guard_slots, sink=sink)

    def add_peer_guard(self, peer: PeerHandle, guard: GuardTable) -> None:
        with self._lock:
            agent = self._live()
            if peer not in self._peers:
                raise PeerError(f"unknown or removed peer {peer!r}")
            addr = guard.base + np.arange(guard.slots, dtype=np.uint64) * np.uint64(
                guard.slot_bytes
            )
            if guard.sink is not None:  # one more row: the sink word, after the slots
                addr = np.append(addr, np.uint64(guard.sink))
            descs = np.stack([addr, np.full_like(addr, _WORD), np.zeros_like(addr)], axis=1).astype(
                np.uint64
            )
            with map_nixl_errors(NixlCall.PEER, f"preparing the guard table of peer {peer}"):
                old = self._peer_guards.pop(peer, None)
                if old is not None:
                    agent.release_descs(old[0])
                sink_row = None if guard.sink is None else guard.slots
                self._peer_guards[peer] = (agent.prep_descs(peer, MemKind.DRAM, descs), sink_row)

    def post_guard_read(
        self, peer: PeerHandle, slot: int, notification: bytes = b"", *, copies: int = 1
    ) -> XferHandle:
        if copies < 1:
            raise BackendError(f"guard read copies={copies}: must be at least 1")
        with self._lock:
            agent = self._live()
            prepared = self._peer_guards.get(peer)
            if prepared is None or self._landing is None or self._words is None:
                raise PeerError(f"no guard table of peer {peer!r}")
            remote = prepared[0]
            if not self._landing_free:
                raise BackendError(f"{LANDING_WORDS} guard reads in flight already")
            word = self._landing_free.popleft()
            self._words[self._guard_slots + word] = 0
            try:
                what = f"guard read of {peer}"
                handle = self._post_word(
                    agent, peer, XferOp.READ, word, remote, slot, copies, notification, what
                )
            except BaseException:
                self._landing_free.append(word)
                raise
            self._guard_reads[handle] = word
            return handle

    def post_sink_write(self, peer: PeerHandle, *, copies: int = 1) -> XferHandle:
        if copies < 1:
            raise BackendError(f"sink write copies={copies}: must be at least 1")
        with self._lock:
            agent = self._live()
            remote, row = self._peer_guards.get(peer, (None, None))
            if remote is None or row is None or self._landing is None:
                raise PeerError(f"peer {peer!r} announced no sink word")
            # Our own sink word (the landing list's last row) into theirs.
            what = f"sink write of {peer}"
            return self._post_word(
                agent, peer, XferOp.WRITE, LANDING_WORDS, remote, row, copies, b"", what
            )

    def _post_word(
        self,
        agent: NixlEndpoint,
        peer: PeerHandle,
        op: XferOp,
        mine: int,
        remote: object,
        theirs: int,
        copies: int,
        notification: bytes,
        what: str,
    ) -> XferHandle:
        """Post ``copies`` descriptors, every one row ``mine`` of our landing list
        against row ``theirs`` of the peer's prepared guard list (under the lock)."""
        try:
            xfer = agent.post(
                op,
                self._landing,
                np.full(copies, mine, dtype=np.int64),
                remote,
                np.full(copies, theirs, dtype=np.int64),
                notification,
            )
        except KvxferError:
            raise
        except Exception as exc:
            raise nixl_error(exc, NixlCall.POST, what) from exc
        handle = XferHandle(next(self._ids))
        self._xfers[handle] = (xfer, peer)
        return handle

    def guard_word(self, handle: XferHandle) -> int:
        with self._lock:
            word = self._guard_reads.get(handle)
            if word is None or self._words is None:
                raise BackendError(f"guard read {handle!r} is unknown or released")
            return int(self._words[self._guard_slots + word])

    # -- peers ----------------------------------------------------------------------
    def add_peer(self, metadata: bytes, table: DescriptorTable) -> PeerHandle:
        with self._lock:
            agent = self._live()
            with map_nixl_errors(NixlCall.PEER, f"{self._description} rejected a peer"):
                name = PeerHandle(agent.add_remote(metadata))
            # Removed while a WRITE to it was in flight: NIXL kept the connection, and
            # it serves the peer again (it must not be cut when that WRITE ends).
            self._retiring.discard(name)
            old = self._peers.pop(name, None)
            try:
                with map_nixl_errors(NixlCall.PEER, f"preparing descriptors of peer {name}"):
                    if old is not None:
                        agent.release_descs(old)
                    self._peers[name] = agent.prep_descs(name, _mem_kind_of(table), _descs(table))
                    self._peer_rows[name] = _Rows(table)
            except KvxferError:
                self._disconnect(agent, name)
                raise
            return name

    def _disconnect(self, agent: NixlEndpoint, peer: PeerHandle) -> None:
        # The peer may be gone already: nothing to undo, so only logged.
        self._quietly(
            NixlCall.PEER,
            f"removing peer {peer}",
            partial(agent.remove_remote, peer),
            logging.DEBUG,
        )

    def remove_peer(self, peer: PeerHandle) -> None:
        with self._lock:
            prepared = self._peers.pop(peer, None)
            self._peer_rows.pop(peer, None)
            chains = self._chain_lists.pop(peer, {})
            agent = self._agent
            if prepared is None or agent is None:
                return
            writing = False
            for handle, (xfer, owner) in list(self._xfers.items()):
                if owner != peer:
                    continue
                try:
                    in_flight = agent.state(xfer) is XferStatus.PENDING
                except Exception:  # failed: nothing of it moves any more
                    in_flight = False
                if not in_flight:
                    self._release_locked(handle, xfer)
                elif handle in self._writes:
                    writing = True
                # A transfer still in flight stays known: its handle holds the
                # connection, and status()/cancel() must keep saying whether its bytes
                # can still land (R-SAFE-5) until it ends.
            guard = self._peer_guards.pop(peer, None)
            if guard is not None:
                self._quietly(
                    NixlCall.RELEASE,
                    f"releasing the guard table of peer {peer}",
                    partial(agent.release_descs, guard[0]),
                    logging.WARNING,
                )
            for _, local, remote in chains.values():
                for lists in (local, remote):
                    self._quietly(
                        NixlCall.RELEASE,
                        f"releasing chain lists of peer {peer}",
                        partial(agent.release_descs, lists),
                        logging.WARNING,
                    )
            self._quietly(
                NixlCall.RELEASE,
                f"releasing the descriptors of peer {peer}",
                partial(agent.release_descs, prepared),
                logging.WARNING,
            )
            if writing:
                # NIXL reports a removed agent's transfers over, but its UCX backend
                # closes the endpoint by flushing it: a WRITE's bytes go on and land in
                # the peer's blocks after we told it the write ended (measured: 4.5-47 M
                # elements, seconds after a cut link came back). The connection goes
                # when its last WRITE ended on its own (_release_locked); a dead link
                # ends it within the stall limit (BackendOptions.stall_limit_s).
                self._retiring.add(peer)
                log.info(
                    "%s: peer %s removed; its connection stays until its writes end",
                    self._description,
                    peer,
                )
            else:
                self._disconnect(agent, peer)

    # -- chain lists (kvxfer.core.block_lists) ---------------------------------------------
    def prepare_lists(self, peer: PeerHandle, lists: ChainLists) -> bool:
        with self._lock:
            return self._prepared_lists(peer, lists) is not None

    def _prepared_lists(
        self, peer: PeerHandle, lists: ChainLists
    ) -> tuple[ChainLists, object, object] | None:
        """``lists`` prepared with ``peer`` (now, unless they were), or None past
        :data:`MAX_CHAIN_LISTS` (under the lock)."""
        agent = self._live()
        if peer not in self._peers:
            raise PeerError(f"unknown or removed peer {peer!r}")
        held = self._chain_lists.setdefault(peer, {})
        entry = held.get(id(lists))
        if entry is not None and entry[0] is lists:
            return entry
        if len(held) >= MAX_CHAIN_LISTS:
            # Never released while the peer lives (a transfer may still use them):
            # past the cap, requests post ids as before.
            return None
        with map_nixl_errors(NixlCall.PEER, f"preparing chain lists of peer {peer}"):
            local = agent.prep_descs(None, lists.local_mem, lists.local)
            try:
                remote = agent.prep_descs(peer, lists.remote_mem, lists.remote)
            except BaseException:
                agent.release_descs(local)
                raise
        held[id(lists)] = entry = (lists, local, remote)
        return entry

    def post_lists(
        self,
        op: XferOp,
        peer: PeerHandle,
        lists: ChainLists,
        local_rows: npt.NDArray[np.int64],
        remote_rows: npt.NDArray[np.int64],
        notification: bytes = b"",
    ) -> XferHandle:
        with self._lock:
            agent = self._live()
            # Prepared again here when the peer was removed and added since (a new
            # connection to the same agent): its lists went with it.
            entry = self._prepared_lists(peer, lists)
            if entry is None:
                raise BackendError(
                    f"chain lists of peer {peer!r}: {MAX_CHAIN_LISTS} prepared already"
                )
            try:
                xfer = agent.post(op, entry[1], local_rows, entry[2], remote_rows, notification)
            except KvxferError:
                raise
            except Exception as exc:
                what = f"{self._description}: {op.value} of chain rows to {peer}"
                raise nixl_error(exc, NixlCall.POST, what) from exc
            self.lists_posted += 1
            return self._track(xfer, peer, op)

    # -- transfers ------------------------------------------------------------------
    def post(
        self,
        op: XferOp,
        peer: PeerHandle,
        local_ids: npt.NDArray[np.int64],
        remote_ids: npt.NDArray[np.int64],
        notification: bytes = b"",
    ) -> XferHandle:
        with self._lock:
            agent = self._live()
            remote = self._peers.get(peer)
            if remote is None:
                raise PeerError(f"unknown or removed peer {peer!r}")
            if self._local is None:
                raise RegistrationError("post before prepare_local")
            # The hot path maps NIXL's failures inline (see kvxfer.backends._nixl).
            try:
                runs = self._runs(agent, peer, local_ids, remote_ids)
                if runs is not None:
                    local_mem, local_runs, remote_mem, remote_runs = runs
                    xfer = cast(RunsEndpoint, agent).post_runs(
                        op, local_mem, local_runs, peer, remote_mem, remote_runs, notification
                    )
                    self.runs_posted += 1
                else:
                    xfer = agent.post(op, self._local, local_ids, remote, remote_ids, notification)
            except KvxferError:
                raise
            except Exception as exc:
                what = f"{self._description}: {op.value} to {peer}"
                raise nixl_error(exc, NixlCall.POST, what) from exc
            return self._track(xfer, peer, op)

    def post_runs(
        self,
        op: XferOp,
        peer: PeerHandle,
        runs: Runs,
        notification: bytes = b"",
    ) -> XferHandle:
        with self._lock:
            agent = self._live()
            if peer not in self._peers:
                raise PeerError(f"unknown or removed peer {peer!r}")
            if not self._posts_runs or self._local_rows is None:
                raise BackendError(f"{self._description} posts no address runs")
            remote_rows = self._peer_rows.get(peer)
            remote_mem = remote_rows.mem if remote_rows is not None else self._local_rows.mem
            local = np.stack(
                [runs.local_addr, runs.length, runs.local_device.astype(np.uint64)], axis=1
            )
            remote = np.stack(
                [runs.remote_addr, runs.length, runs.remote_device.astype(np.uint64)], axis=1
            )
            try:
                xfer = cast(RunsEndpoint, agent).post_runs(
                    op, self._local_rows.mem, local, peer, remote_mem, remote, notification
                )
            except KvxferError:
                raise
            except Exception as exc:
                what = f"{self._description}: {op.value} of address runs to {peer}"
                raise nixl_error(exc, NixlCall.POST, what) from exc
            self.runs_posted += 1
            return self._track(xfer, peer, op)

    def _track(self, xfer: object, peer: PeerHandle, op: XferOp) -> XferHandle:
        """The handle of a transfer just posted to ``peer`` (under the lock)."""
        handle = XferHandle(next(self._ids))
        self._xfers[handle] = (xfer, peer)
        if op is XferOp.WRITE:
            self._writes.add(handle)
        return handle

    def _runs(
        self,
        agent: NixlEndpoint,
        peer: PeerHandle,
        local_ids: npt.NDArray[np.int64],
        remote_ids: npt.NDArray[np.int64],
    ) -> tuple[MemKind, npt.NDArray[np.uint64], MemKind, npt.NDArray[np.uint64]] | None:
        """The request as per-request lists of address runs, when those post far fewer
        units than the prepared ids (which NIXL merges only where they are one apart:
        a block's heads, abutting in memory, lie a block list apart), else None.

        Plans list each block's abutting regions together (:mod:`kvxfer.core.merging`), so
        merging the pairs in posted order finds every run."""
        mine, theirs = self._local_rows, self._peer_rows.get(peer)
        n = len(local_ids)
        if n < RUNS_MIN_PAIRS or mine is None or theirs is None:
            return None
        if not (mine.abuts and theirs.abuts):
            return None
        if not self._posts_runs:
            return None
        la, ra = mine.addr[local_ids], theirs.addr[remote_ids]
        length = mine.length[local_ids]
        ld = None if mine.single_device is not None else mine.device[local_ids]
        rd = None if theirs.single_device is not None else theirs.device[remote_ids]
        joined = joins(la, ra, length, ld, rd)
        if not posted_units(joined, local_ids, remote_ids)[1]:
            return None
        starts = np.flatnonzero(np.concatenate(([True], ~joined)))
        total = np.concatenate((np.zeros(1, dtype=np.uint64), np.cumsum(length, dtype=np.uint64)))
        ends = np.append(starts[1:], n)
        run_len = total[ends] - total[starts]
        ldev = mine.device[local_ids[starts]].astype(np.uint64)
        rdev = theirs.device[remote_ids[starts]].astype(np.uint64)
        return (
            mine.mem,
            np.stack([la[starts], run_len, ldev], axis=1),
            theirs.mem,
            np.stack([ra[starts], run_len, rdev], axis=1),
        )

    def status(self, handle: XferHandle) -> XferStatus:
        # A poll: see drain_notifications for why a busy agent answers "not yet".
        if not self._lock.acquire(blocking=False):
            return XferStatus.PENDING
        try:
            entry = self._xfers.get(handle)
            if entry is None or self._agent is None:
                return XferStatus.FAILED
            try:
                state = self._agent.state(entry[0])
            except Exception as exc:  # a poll answers FAILED (the contract), never raises
                log.warning("transfer %d to %s: %r", handle, entry[1], exc)
                # NIXL names the cause (a remote disconnect, or a local memory or
                # protection error): kept for failure_detail, so that bad local memory
                # is not reported as a dead peer.
                self._failed[handle] = f"{self._description} to {entry[1]}: {exc}"
                return XferStatus.FAILED
            if state is XferStatus.FAILED:
                self._failed.setdefault(handle, f"{self._description} to {entry[1]}: error")
            return state
        finally:
            self._lock.release()

    def failure_detail(self, handle: XferHandle) -> str:
        with self._lock:
            return self._failed.get(handle, "")

    def _release_locked(self, handle: XferHandle, xfer: object) -> None:
        entry = self._xfers.pop(handle, None)
        self._failed.pop(handle, None)
        if handle in self._writes:
            self._writes.discard(handle)
            peer = entry[1] if entry is not None else None
            if peer in self._retiring and not any(
                owner == peer and h in self._writes for h, (_, owner) in self._xfers.items()
            ):
                # The removed peer's last WRITE ended (the agent releases a transfer's
                # handle only once it is over): its connection can go now.
                self._retiring.discard(peer)
                if self._agent is not None:
                    self._disconnect(self._agent, peer)
        word = self._guard_reads.pop(handle, None)
        if word is not None:
            self._landing_free.append(word)
        if self._agent is None:
            return
        try:
            self._agent.release_xfer(xfer)
        except Exception as exc:
            # NIXL refuses to release a request still in flight; it goes with the agent.
            # Never let that turn into a crash of the caller (a release never raises).
            log.debug("releasing transfer %d: %r", handle, exc)

    def release(self, handle: XferHandle) -> None:
        with self._lock:
            entry = self._xfers.get(handle)
            if entry is not None:
                self._release_locked(handle, entry[0])

    # -- notifications --------------------------------------------------------------
    def notify(self, peer: PeerHandle, payload: bytes) -> None:
        with self._lock:
            agent = self._live()
            if peer not in self._peers:
                raise PeerError(f"unknown or removed peer {peer!r}")
            with map_nixl_errors(NixlCall.NOTIFY, f"could not notify {peer}"):
                agent.send_notification(peer, payload)

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        # A poll, and the engine polls through it (freed(), progress(), waits). While
        # another thread is inside the agent (a post, which with UCX over CMA copies
        # every byte before it returns, or a registration pinning pages), answer
        # "nothing yet" instead of waiting that call out: the notices stay queued in
        # NIXL for the next poll. Blocking here stalled freed() for a whole push copy.
        if not self._lock.acquire(blocking=False):
            return []
        try:
            if self._agent is None:
                return []
            try:
                return self._agent.notifications()
            except KvxferError:
                raise
            except Exception as exc:  # a poll: mapped inline, like post
                raise nixl_error(exc, NixlCall.POLL, "reading notifications") from exc
        finally:
            self._lock.release()

    # -- teardown -------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            agent = self._agent
            if agent is None:
                return
            for handle, (xfer, _) in list(self._xfers.items()):
                self._release_locked(handle, xfer)
            for peer in list(self._peers):
                self.remove_peer(peer)
            landing, self._landing = self._landing, None
            if landing is not None:
                self._quietly(
                    NixlCall.RELEASE,
                    "releasing the guard landing words",
                    partial(agent.release_descs, landing),
                    logging.WARNING,
                )
            local, self._local = self._local, None
            if local is not None:
                self._quietly(
                    NixlCall.RELEASE,
                    "releasing the local descriptors",
                    partial(agent.release_descs, local),
                    logging.WARNING,
                )
            for reg in self._registrations:
                self._quietly(
                    NixlCall.REGISTER,
                    "deregistering memory",
                    partial(agent.deregister, reg),
                    logging.WARNING,
                )
            self._registrations.clear()
            agent.close()
            self._agent = None
