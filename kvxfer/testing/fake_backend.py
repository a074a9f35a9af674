"""``fake`` backend: a real in-process data plane with fault injection (R-BE-5).

Not a mock: :class:`FakeBackend` implements the whole :class:`~kvxfer.backend.Backend`
contract on real memory. Every instance joins one process-wide *fabric* (a dict keyed by
agent name); a transfer copies bytes between the registered memory of two instances with
``ctypes.memmove``, moving exactly the descriptors it was given, after checking that every
address lies in memory its owner registered. Like NIXL without a progress thread, a
transfer advances only when its initiator polls :meth:`~FakeBackend.status`; the
notification reaches the target only after every byte landed.

Faults are set per instance through :class:`Faults` (read when a transfer is posted,
except ``gone`` and ``stall``, which act at once)::

    be.faults = Faults(fail_post=True)          # post raises BackendError
    be.faults = Faults(never_complete=True)     # status stays PENDING forever
    be.faults = Faults(fail_midway=0.5)         # half the bytes land, then FAILED
    peer.faults = Faults(gone=True)             # the peer left the fabric (process died)
    be.faults = Faults(duplicate_notifications=True, late_notifications=3)
    be.faults = Faults(reorder_notifications=True)  # each one overtakes those queued
    be.faults = Faults(stall=True)              # posted transfers wait until cleared

Notification faults apply to the notifications an instance *sends* (transfer
notifications and :meth:`~FakeBackend.notify`).

It also implements the guard-table extension of the contract that fail-closed pulls
need (docs/RELIABILITY.md, section 3; not yet part of :class:`~kvxfer.backend.Backend`):
:meth:`~FakeBackend.register_guard` registers a table of 64-bit words,
:meth:`~FakeBackend.guard_table` describes it for the handshake, and a peer reads one
word with :meth:`~FakeBackend.post_guard_read` then :meth:`~FakeBackend.guard_word`.
With the table it registers a sink word that peers write with
:meth:`~FakeBackend.post_sink_write` (a push producer's warm-up).

Capabilities are configurable so the agent's mode rules can be exercised:
``FakeBackend(options, device_to_device=False)``, or
``options.extra["device_to_device"] = "false"`` when built through the registry.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt

from kvxfer.backend import (
    Backend,
    BackendOptions,
    Capabilities,
    PeerHandle,
    XferHandle,
    XferOp,
    XferStatus,
)
from kvxfer.core.layout import MemKind
from kvxfer.core.wire import GuardTable
from kvxfer.errors import BackendError, PeerError, RegistrationError

if TYPE_CHECKING:
    from kvxfer.core.block_lists import ChainLists
    from kvxfer.core.descriptors import DescriptorTable, Runs
    from kvxfer.core.layout import KVLayout

__all__ = ["FakeBackend", "Faults", "fabric_members"]

IntArray = npt.NDArray[np.int64]
UIntArray = npt.NDArray[np.uint64]

# One fabric per process: agent name -> endpoint. One lock guards the fabric, every
# endpoint's state and every copy, so concurrent agents never observe half a transfer
# bookkeeping (bytes themselves may be read by the engine at any time, as on hardware).
_FABRIC: dict[str, FakeBackend] = {}
_LOCK = threading.RLock()


def fabric_members() -> list[str]:
    """Agent names currently present on this process's fake fabric."""
    with _LOCK:
        return sorted(name for name, be in _FABRIC.items() if not be.faults.gone)


class Faults(msgspec.Struct, kw_only=True):
    """Faults one :class:`FakeBackend` injects.

    Attributes:
        fail_post: :meth:`~FakeBackend.post` raises :class:`~kvxfer.errors.BackendError`.
        never_complete: posted transfers stay PENDING forever (no byte moves).
        fail_midway: fraction (0 ≤ f < 1) of a transfer's bytes that land, in descriptor
            order, before it turns FAILED; ``None`` = no such fault.
        gone: this endpoint left the fabric, as if its process died: peers' transfers
            to it fail, posting or notifying it raises :class:`~kvxfer.errors.PeerError`.
            Acts immediately; clearing it brings the endpoint back.
        duplicate_notifications: every notification sent is delivered twice.
        late_notifications: notifications sent become visible only after the receiver
            drained this many more times.
        drop_notifications: notifications sent are lost.
        complete_after_polls: a transfer stays PENDING for this many status polls
            before its bytes move (0: the first poll completes it).
        reorder_notifications: each notification sent goes to the head of the
            receiver's queue, overtaking those not drained yet.
        stall: transfers this endpoint initiated stay PENDING, no byte moved, while set,
            even when the peer is gone (a transport that has not noticed anything yet).
            Read at every status poll, so a test opens the gate when its schedule says:
            e.g. after the producer's engine reused the blocks being read.
        uncancellable: :meth:`~FakeBackend.cancel` of a transfer still PENDING says
            it may still move bytes (as NIXL over UCX does): the agent must keep
            polling it, and its blocks stay quarantined until it moved or failed.
    """

    fail_post: bool = False
    never_complete: bool = False
    fail_midway: float | None = None
    gone: bool = False
    duplicate_notifications: bool = False
    late_notifications: int = 0
    drop_notifications: bool = False
    complete_after_polls: int = 0
    reorder_notifications: bool = False
    stall: bool = False
    uncancellable: bool = False


class _Metadata(msgspec.Struct, frozen=True):
    agent: str
    pid: int


@dataclasses.dataclass
class _Peer:
    name: str
    table: DescriptorTable


@dataclasses.dataclass
class _Xfer:
    op: XferOp
    peer: str
    local_ids: IntArray
    remote_ids: IntArray
    notification: bytes
    faults: Faults
    polls: int = 0
    state: XferStatus = XferStatus.PENDING
    bytes_moved: int = 0
    lists: ChainLists | None = None  # rows of these chain lists, not table ids
    runs: Runs | None = None  # address runs (post_runs), not table ids
    remote: DescriptorTable | None = None  # the peer's table when it was posted


class _Rows(NamedTuple):
    """What a move reads of one side: a table's descriptors or a chain list's rows."""

    addr: UIntArray
    length: UIntArray


@dataclasses.dataclass
class _GuardRead:
    peer: str
    slot: int
    notification: bytes
    faults: Faults
    sink: bool = False  # a write of our sink word into the peer's (``slot`` unused)
    polls: int = 0
    state: XferStatus = XferStatus.PENDING
    word: int | None = None


@dataclasses.dataclass
class _Inbound:
    sender: str
    payload: bytes
    hidden_for: int  # drains left before it becomes visible


def _flag(options: BackendOptions, key: str, default: bool) -> bool:
    value = options.extra.get(key)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise BackendError(f"fake backend: extra[{key!r}]={value!r} is not a boolean")


def _intervals(layout: KVLayout) -> tuple[UIntArray, UIntArray]:
    """Sorted, merged ``[start, end)`` byte ranges covered by a layout's regions."""
    starts = np.array([r.base for r in layout.regions], dtype=np.uint64)
    ends = np.array([r.end for r in layout.regions], dtype=np.uint64)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    idx = np.flatnonzero(new)
    last = np.append(idx[1:] - 1, len(s) - 1)
    return s[idx], reach[last]


def _outside(addr: UIntArray, length: UIntArray, spans: tuple[UIntArray, UIntArray]) -> IntArray:
    """Indices of descriptors not lying entirely inside one registered span."""
    starts, ends = spans
    pos = np.searchsorted(starts, addr, side="right").astype(np.int64) - 1
    inside = pos >= 0
    safe = np.where(inside, pos, 0)
    inside &= addr + length <= ends[safe]
    return np.flatnonzero(~inside)


class FakeBackend(Backend):
    """In-process backend on a shared fabric; see the module docstring.

    Args:
        options: The common backend options (``agent_name`` must be unique in the
            process; ``extra["device_to_device"]`` / ``extra["stages_through_host"]``
            set capabilities when the keyword arguments are not given, and
            ``extra["writes_outlive_process"]`` (default false: its writes end with
            it) makes a producer announce its stall limit as a TCP transport's does).
        device_to_device: Report a device-to-device backend (default True).
        stages_through_host: Report host staging (default False); stage calls are
            recorded in :attr:`staged` either way.
        faults: Initial faults (default none).
        chain_lists: Post chain lists (:meth:`prepare_lists`) as the NIXL backends do
            (default True); False answers False, as a staging backend does.

    Attributes:
        faults: The faults in force; assign a new :class:`Faults` at any time.
        staged: ``("out" | "in", block ids per group)`` for every stage call, in order.
        lists_posted: posts of chain-list rows.
    """

    name: ClassVar[str] = "fake"

    def __init__(
        self,
        options: BackendOptions,
        *,
        device_to_device: bool | None = None,
        stages_through_host: bool | None = None,
        faults: Faults | None = None,
        chain_lists: bool = True,
    ) -> None:
        self._options = options
        self.chain_lists = chain_lists
        self.lists_posted = 0
        self._caps = Capabilities(
            name=self.name,
            mem_kinds=frozenset({MemKind.DRAM, MemKind.VRAM}),
            device_to_device=(
                _flag(options, "device_to_device", True)
                if device_to_device is None
                else device_to_device
            ),
            stages_through_host=(
                _flag(options, "stages_through_host", False)
                if stages_through_host is None
                else stages_through_host
            ),
            merges_contiguous=True,
            guard=True,
            address_runs=True,
            # Its writes end with the agent (nothing is queued in a kernel): a test
            # that needs a producer announcing its stall limit sets it.
            writes_outlive_process=_flag(options, "writes_outlive_process", False),
        )
        self.faults = faults if faults is not None else Faults()
        self.staged: list[tuple[str, tuple[IntArray, ...]]] = []
        self._layout: KVLayout | None = None
        self._spans: tuple[UIntArray, UIntArray] | None = None
        self._table: DescriptorTable | None = None
        self._peers: dict[PeerHandle, _Peer] = {}
        self._xfers: dict[XferHandle, _Xfer] = {}
        self._guard: npt.NDArray[np.uint64] | None = None
        self._staging: npt.NDArray[np.uint8] | None = None  # the gather path's (issue 55)
        self._sink = np.zeros(1, dtype=np.uint64)  # announced with the guard table
        self._peer_guards: dict[PeerHandle, GuardTable] = {}
        self._guard_reads: dict[XferHandle, _GuardRead] = {}
        self._inbox: list[_Inbound] = []
        self._ids = itertools.count(1)
        self._closed = False
        with _LOCK:
            if options.agent_name in _FABRIC:
                raise BackendError(
                    f"fake fabric: agent name {options.agent_name!r} is already in use"
                )
            _FABRIC[options.agent_name] = self

    # -- identity -------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def agent_name(self) -> str:
        return self._options.agent_name

    def metadata(self) -> bytes:
        return msgspec.msgpack.encode(_Metadata(agent=self.agent_name, pid=os.getpid()))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def transferred_bytes(self, handle: XferHandle) -> int:
        """Bytes a posted transfer has moved so far (0 once released or unknown)."""
        with _LOCK:
            xfer = self._xfers.get(handle)
            return xfer.bytes_moved if xfer is not None else 0

    # -- memory ---------------------------------------------------------------------
    def _require_open(self) -> None:
        if self._closed:
            raise BackendError(f"fake backend {self.agent_name!r} is closed")

    def register(self, layout: KVLayout) -> KVLayout:
        with _LOCK:
            self._require_open()
            if self._layout is not None:
                raise RegistrationError("this backend already registered a layout")
            self._layout, self._spans = layout, _intervals(layout)
            return layout

    def prepare_local(self, table: DescriptorTable) -> None:
        with _LOCK:
            self._require_open()
            if self._spans is None:
                raise RegistrationError("prepare_local before register")
            self._check_inside(table, self._spans, "local")
            self._table = table

    @staticmethod
    def _check_inside(
        table: DescriptorTable, spans: tuple[UIntArray, UIntArray], side: str
    ) -> None:
        bad = _outside(table.addr, table.length, spans)
        if len(bad):
            i = int(bad[0])
            raise BackendError(
                f"{side} descriptor {i} [{int(table.addr[i]):#x}, +{int(table.length[i])}) "
                f"lies outside registered memory ({len(bad)} such descriptor(s))"
            )

    # -- peers ----------------------------------------------------------------------
    def _live(self, name: str) -> FakeBackend | None:
        be = _FABRIC.get(name)
        return None if be is None or be.faults.gone or be._closed else be

    def add_peer(self, metadata: bytes, table: DescriptorTable) -> PeerHandle:
        try:
            meta = msgspec.msgpack.decode(metadata, type=_Metadata)
        except msgspec.DecodeError as exc:
            raise PeerError(f"fake fabric: unreadable peer metadata ({exc})") from exc
        with _LOCK:
            self._require_open()
            if meta.pid != os.getpid():
                raise PeerError(
                    f"fake fabric: peer {meta.agent!r} lives in process {meta.pid}; "
                    "the fake backend only connects endpoints of one process"
                )
            peer = self._live(meta.agent)
            if peer is None:
                raise PeerError(f"fake fabric: no agent named {meta.agent!r}")
            if peer._spans is None:
                raise PeerError(f"fake fabric: peer {meta.agent!r} has registered no memory")
            self._check_inside(table, peer._spans, f"peer {meta.agent!r}")
            handle = PeerHandle(meta.agent)
            self._peers[handle] = _Peer(name=meta.agent, table=table)
            return handle

    def remove_peer(self, peer: PeerHandle) -> None:
        with _LOCK:
            self._peer_guards.pop(peer, None)
            if self._peers.pop(peer, None) is None:
                return
            # As the NIXL edge does (Backend.remove_peer): a READ in flight fails, a
            # WRITE goes on until it ends on its own (its bytes may still land).
            for xfer in self._xfers.values():
                if (
                    xfer.peer == peer
                    and xfer.state is XferStatus.PENDING
                    and xfer.op is not XferOp.WRITE
                ):
                    xfer.state = XferStatus.FAILED

    # -- transfers ------------------------------------------------------------------
    def post(
        self,
        op: XferOp,
        peer: PeerHandle,
        local_ids: npt.NDArray[np.int64],
        remote_ids: npt.NDArray[np.int64],
        notification: bytes = b"",
    ) -> XferHandle:
        with _LOCK:
            self._require_open()
            if self._table is None:
                raise RegistrationError("post before prepare_local")
            known = self._known(peer)
            if not isinstance(op, XferOp):
                raise BackendError(f"not a transfer op: {op!r}")
            lids = self._ids_of(local_ids, len(self._table), "local")
            rids = self._ids_of(remote_ids, len(known.table), "remote")
            _paired(lids, rids, self._table.length, known.table.length, "descriptor")
            return self._queue(op, peer, lids, rids, notification, None)

    def prepare_lists(self, peer: PeerHandle, lists: ChainLists) -> bool:
        with _LOCK:
            self._require_open()
            if not self.chain_lists:
                return False
            self._known(peer)
            if self.faults.fail_post:
                raise BackendError("fake fabric: lists refused (injected fault)")
            return True  # the fake moves rows straight from the lists' addresses

    def post_lists(
        self,
        op: XferOp,
        peer: PeerHandle,
        lists: ChainLists,
        local_rows: npt.NDArray[np.int64],
        remote_rows: npt.NDArray[np.int64],
        notification: bytes = b"",
    ) -> XferHandle:
        with _LOCK:
            self._require_open()
            self._known(peer)
            if not self.chain_lists:
                raise BackendError("fake fabric: chain lists are off (chain_lists=False)")
            lids = self._ids_of(local_rows, len(lists.local), "local")
            rids = self._ids_of(remote_rows, len(lists.remote), "remote")
            _paired(lids, rids, lists.local[:, 1], lists.remote[:, 1], "chain row")
            handle = self._queue(op, peer, lids, rids, notification, lists)
            self.lists_posted += 1
            return handle

    def post_runs(
        self,
        op: XferOp,
        peer: PeerHandle,
        runs: Runs,
        notification: bytes = b"",
    ) -> XferHandle:
        with _LOCK:
            self._require_open()
            self._known(peer)
            if self._table is None:
                raise RegistrationError("post before prepare_local")
            # A NIC refuses addresses outside registered memory: so does the fake.
            be = self._live(peer)
            for side, addr, spans in (
                ("local", runs.local_addr, self._spans),
                ("remote", runs.remote_addr, None if be is None else be._spans),
            ):
                bad = _outside(addr, runs.length, spans) if spans is not None else addr
                if len(bad):
                    raise BackendError(
                        f"{side} address runs outside registered memory ({len(bad)} run(s))"
                    )
            ids = np.arange(len(runs), dtype=np.int64)
            handle = self._queue(op, peer, ids, ids.copy(), notification, None)
            self._xfers[handle].runs = runs
            return handle

    def _known(self, peer: PeerHandle) -> _Peer:
        """The peer's record (under the lock); PeerError unless it is added and live."""
        known = self._peers.get(peer)
        if known is None or self._live(peer) is None:
            raise PeerError(f"fake fabric: unknown, removed or gone peer {peer!r}")
        return known

    def _queue(
        self,
        op: XferOp,
        peer: PeerHandle,
        lids: IntArray,
        rids: IntArray,
        notification: bytes,
        lists: ChainLists | None,
    ) -> XferHandle:
        """A checked post's transfer, moved when polled (under the lock)."""
        if self.faults.fail_post:
            raise BackendError("fake fabric: post refused (injected fault)")
        handle = XferHandle(next(self._ids))
        self._xfers[handle] = _Xfer(
            op=op,
            peer=peer,
            local_ids=lids,
            remote_ids=rids,
            notification=bytes(notification),
            faults=msgspec.structs.replace(self.faults),
            lists=lists,
            remote=self._peers[peer].table,
        )
        return handle

    @staticmethod
    def _ids_of(ids: npt.NDArray[np.int64], size: int, side: str) -> IntArray:
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise BackendError(f"{side} descriptor ids must be a 1-d integer array")
        arr = arr.astype(np.int64, copy=True)
        if arr.size and (arr.min() < 0 or arr.max() >= size):
            bad = int(arr[(arr < 0) | (arr >= size)][0])
            raise BackendError(f"{side} descriptor id {bad} out of range [0, {size})")
        return arr

    def status(self, handle: XferHandle) -> XferStatus:
        with _LOCK:
            if handle in self._guard_reads:
                return self._guard_status(self._guard_reads[handle])
            xfer = self._xfers.get(handle)
            if xfer is None:
                return XferStatus.FAILED
            if xfer.state is not XferStatus.PENDING:
                return xfer.state
            if self.faults.stall:
                return xfer.state  # a transport that has not noticed anything yet
            peer = self._live(xfer.peer)
            known = xfer.remote
            if self._closed or peer is None or known is None or self._table is None:
                xfer.state = XferStatus.FAILED
                return xfer.state
            if xfer.faults.never_complete:
                return xfer.state
            xfer.polls += 1
            if xfer.polls <= xfer.faults.complete_after_polls:
                return xfer.state
            if xfer.runs is not None:
                local = _Rows(xfer.runs.local_addr, xfer.runs.length)
                remote = _Rows(xfer.runs.remote_addr, xfer.runs.length)
            elif xfer.lists is None:
                local = _Rows(self._table.addr, self._table.length)
                remote = _Rows(known.addr, known.length)
            else:
                rows = xfer.lists
                local = _Rows(rows.local[:, 0], rows.local[:, 1])
                remote = _Rows(rows.remote[:, 0], rows.remote[:, 1])
            state = self._move(xfer, local, remote)
            if state is XferStatus.DONE and xfer.notification:
                self._deliver(peer, xfer.notification, xfer.faults)
            return state

    def _move(self, xfer: _Xfer, local: _Rows, remote: _Rows) -> XferStatus:
        la, ra = local.addr[xfer.local_ids], remote.addr[xfer.remote_ids]
        length = local.length[xfer.local_ids]
        src, dst = (ra, la) if xfer.op is XferOp.READ else (la, ra)
        if len(length) > 1:
            # Merge runs contiguous on both sides: one memmove per run, as a NIC would.
            joins = (src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1])
            starts = np.concatenate(([0], np.flatnonzero(~joins) + 1))
            src, dst, length = src[starts], dst[starts], np.add.reduceat(length, starts)
        total = int(length.sum())
        budget = total
        if xfer.faults.fail_midway is not None:
            budget = int(total * min(max(xfer.faults.fail_midway, 0.0), 1.0))
            budget = min(budget, total - 1) if total else 0
        moved = 0
        for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist()):
            take = min(n, budget - moved)
            if take <= 0:
                break
            ctypes.memmove(d, s, take)
            moved += take
        xfer.bytes_moved = moved
        xfer.state = XferStatus.DONE if moved == total else XferStatus.FAILED
        return xfer.state

    def release(self, handle: XferHandle) -> None:
        with _LOCK:
            self._xfers.pop(handle, None)
            self._guard_reads.pop(handle, None)

    def cancel(self, handle: XferHandle) -> bool:
        """Bytes move only inside :meth:`status`, so a released transfer moves no more:
        the fake cancels for real, unless ``Faults.uncancellable`` models a transport
        that cannot (NIXL over UCX): then it is over only once it completed or failed."""
        with _LOCK:
            xfer = self._xfers.get(handle)
            # As NIXL's status(): asking drives the transfer on.
            uncancellable = xfer is not None and xfer.faults.uncancellable
            if uncancellable and self.status(handle) is XferStatus.PENDING:
                return False
        self.release(handle)
        return True

    # -- guard table (fail-closed pulls; docs/RELIABILITY.md) -------------------------
    def register_guard(self, slots: int) -> npt.NDArray[np.uint64]:
        """Register a table of ``slots`` zeroed 64-bit words; returns it, writable.

        The owner writes a hold's generation into its slot and overwrites it before it
        hands the hold's blocks back; peers read one slot with :meth:`post_guard_read`.
        """
        with _LOCK:
            self._require_open()
            if self._guard is not None:
                raise RegistrationError("this backend already registered a guard table")
            if slots < 1:
                raise RegistrationError(f"a guard table needs at least one slot, not {slots}")
            self._guard = np.zeros(slots, dtype=np.uint64)
            return self._guard

    def register_staging(self, nbytes: int) -> int:
        """Register ``nbytes`` of zeroed host staging memory; returns its address."""
        with _LOCK:
            self._require_open()
            if self._staging is not None:
                raise RegistrationError("this backend already registered staging memory")
            if nbytes < 1:
                raise RegistrationError(f"staging memory needs at least one byte, not {nbytes}")
            self._staging = np.zeros(nbytes, dtype=np.uint8)
            return int(self._staging.ctypes.data)

    def guard_table(self) -> GuardTable | None:
        """What a handshake tells peers about the guard table (None: none registered)."""
        with _LOCK:
            if self._guard is None:
                return None
            return GuardTable(
                base=int(self._guard.ctypes.data),
                slots=len(self._guard),
                sink=int(self._sink.ctypes.data),
            )

    def add_peer_guard(self, peer: PeerHandle, guard: GuardTable) -> None:
        """Prepare reads of a connected peer's guard table (from its handshake)."""
        with _LOCK:
            self._require_open()
            if peer not in self._peers:
                raise PeerError(f"fake fabric: unknown peer {peer!r}")
            self._peer_guards[peer] = guard

    def post_guard_read(
        self, peer: PeerHandle, slot: int, notification: bytes = b"", *, copies: int = 1
    ) -> XferHandle:
        """Post an 8-byte READ of ``slot`` of the peer's guard table; ``notification``
        reaches the peer after the word was read (the DONE notice of a pull). The fake
        reads the word once whatever ``copies`` says."""
        with _LOCK:
            self._require_open()
            if copies < 1:
                raise BackendError(f"guard read copies={copies}: must be at least 1")
            guard = self._peer_guards.get(peer)
            if guard is None or self._live(peer) is None:
                raise PeerError(f"fake fabric: no guard table of peer {peer!r}")
            if not 0 <= slot < guard.slots:
                raise BackendError(f"guard slot {slot} out of range [0, {guard.slots})")
            return self._post_word(peer, slot, bytes(notification), sink=False)

    def post_sink_write(self, peer: PeerHandle, *, copies: int = 1) -> XferHandle:
        """Post a WRITE of our sink word into the peer's; it lands when :meth:`status`
        is asked, once whatever ``copies`` says."""
        with _LOCK:
            self._require_open()
            if copies < 1:
                raise BackendError(f"sink write copies={copies}: must be at least 1")
            guard = self._peer_guards.get(peer)
            if guard is None or guard.sink is None or self._live(peer) is None:
                raise PeerError(f"fake fabric: peer {peer!r} announced no sink word")
            return self._post_word(peer, 0, b"", sink=True)

    def _post_word(
        self, peer: PeerHandle, slot: int, notification: bytes, *, sink: bool
    ) -> XferHandle:
        """Record a guard read of ``slot`` (or, with ``sink``, a sink write), under the
        fabric lock; it moves when :meth:`status` is asked."""
        if self.faults.fail_post:
            raise BackendError("fake fabric: post refused (injected fault)")
        handle = XferHandle(next(self._ids))
        self._guard_reads[handle] = _GuardRead(
            peer=peer,
            slot=slot,
            notification=notification,
            faults=msgspec.structs.replace(self.faults),
            sink=sink,
        )
        return handle

    def guard_word(self, handle: XferHandle) -> int:
        """The word a completed :meth:`post_guard_read` read.

        Raises:
            BackendError: the read is unknown, released or not DONE.
        """
        with _LOCK:
            read = self._guard_reads.get(handle)
            if read is None or read.word is None:
                raise BackendError(f"guard read {handle!r} has no word (unknown or not done)")
            return read.word

    def _guard_status(self, read: _GuardRead) -> XferStatus:
        if read.state is not XferStatus.PENDING or self.faults.stall:
            return read.state
        owner = self._live(read.peer)
        guard = self._peer_guards.get(PeerHandle(read.peer))
        if self._closed or owner is None or guard is None:
            read.state = XferStatus.FAILED
            return read.state
        read.polls += 1
        if read.faults.never_complete or read.polls <= read.faults.complete_after_polls:
            return read.state
        table = owner._guard
        # The address the handshake announced must be the owner's registered table.
        if table is None or guard.base != int(table.ctypes.data) or guard.slots != len(table):
            read.state = XferStatus.FAILED
            return read.state
        if read.sink:  # into the word the owner announced
            if guard.sink != int(owner._sink.ctypes.data):
                read.state = XferStatus.FAILED
                return read.state
            owner._sink[0] = self._sink[0]
            read.state = XferStatus.DONE
            return read.state
        read.word = int(table[read.slot])
        read.state = XferStatus.DONE
        if read.notification:
            self._deliver(owner, read.notification, read.faults)
        return read.state

    # -- notifications --------------------------------------------------------------
    def _deliver(self, receiver: FakeBackend, payload: bytes, faults: Faults) -> None:
        if faults.drop_notifications:
            return
        copies = 2 if faults.duplicate_notifications else 1
        for _ in range(copies):
            note = _Inbound(self.agent_name, bytes(payload), max(faults.late_notifications, 0))
            if faults.reorder_notifications:
                receiver._inbox.insert(0, note)
            else:
                receiver._inbox.append(note)

    def notify(self, peer: PeerHandle, payload: bytes) -> None:
        with _LOCK:
            self._require_open()
            receiver = self._live(peer) if peer in self._peers else None
            if receiver is None:
                raise PeerError(
                    f"fake fabric: cannot notify unknown, removed or gone peer {peer!r}"
                )
            self._deliver(receiver, payload, self.faults)

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        with _LOCK:
            if self._closed:
                return []
            ready = [(n.sender, n.payload) for n in self._inbox if n.hidden_for <= 0]
            later = [n for n in self._inbox if n.hidden_for > 0]
            for n in later:
                n.hidden_for -= 1
            self._inbox = later
            return ready

    # -- staging (recorded; the fake moves device memory directly) ------------------
    def stage_out(self, block_ids: Sequence[npt.NDArray[np.int64]]) -> None:
        with _LOCK:
            self.staged.append(("out", tuple(np.asarray(b, dtype=np.int64) for b in block_ids)))

    def stage_in(self, block_ids: Sequence[npt.NDArray[np.int64]]) -> None:
        with _LOCK:
            self.staged.append(("in", tuple(np.asarray(b, dtype=np.int64) for b in block_ids)))

    # -- teardown -------------------------------------------------------------------
    def close(self) -> None:
        with _LOCK:
            if self._closed:
                return
            self._closed = True
            for xfer in self._xfers.values():
                if xfer.state is XferStatus.PENDING:
                    xfer.state = XferStatus.FAILED
            self._xfers.clear()
            for read in self._guard_reads.values():
                if read.state is XferStatus.PENDING:
                    read.state = XferStatus.FAILED
            self._guard_reads.clear()
            self._peer_guards.clear()
            self._guard = None
            self._peers.clear()
            self._inbox.clear()
            self._table = None
            self._spans = None
            if _FABRIC.get(self.agent_name) is self:
                del _FABRIC[self.agent_name]


def _paired(
    lids: IntArray, rids: IntArray, llens: npt.NDArray[Any], rlens: npt.NDArray[Any], what: str
) -> None:
    """Local and remote ids pair by position, each pair of equal length; BackendError
    naming the first pair that does not (``what``: "descriptor" or "chain row")."""
    if len(lids) != len(rids):
        raise BackendError(
            f"{len(lids)} local but {len(rids)} remote {what}s; they pair by position"
        )
    llen, rlen = llens[lids], rlens[rids]
    if not np.array_equal(llen, rlen):
        i = int(np.flatnonzero(llen != rlen)[0])
        raise BackendError(
            f"{what} pair {i}: local length {int(llen[i])} != remote length {int(rlen[i])}"
        )
