"""Two connected backend endpoints for the conformance suite, in one or two processes.

An :class:`Endpoint` owns one backend and the memory it registered: a small KV cache
(:class:`PatternCache`) whose bytes are a pattern of ``(seed, region, block, byte)``, so
that any byte received can be traced to the exact source byte. A :class:`Harness` pairs
a local endpoint (in the test process) with a peer endpoint, which lives in the same
process for backends whose fabric is in-process (``fake``) and otherwise in a child
process started with the ``spawn`` method and driven over a pipe
(:class:`SpawnedEndpoint`); the child keeps polling its backend for notifications while
idle, as an agent's progress thread would.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import multiprocessing.connection
import os
import time
import traceback
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
import numpy as np
import numpy.typing as npt

from kvxfer.backend import Backend, BackendOptions, Capabilities, PeerHandle, XferOp, XferStatus
from kvxfer.descriptors import DescriptorTable, PlanOptions
from kvxfer.errors import BackendError, TransferTimeout
from kvxfer.layout import Group, GroupKind, KVLayout, KVPart, MemKind, Region, SplitAxis
from kvxfer.registry import get_backend

__all__ = [
    "BackendSpec",
    "CacheShape",
    "Endpoint",
    "EndpointInfo",
    "EndpointLike",
    "Harness",
    "Moved",
    "PatternCache",
    "SpawnedEndpoint",
    "expected_after",
    "locate",
]

IntArray = npt.NDArray[np.int64]
ByteArray = npt.NDArray[np.uint8]
Groups = Sequence[Sequence[int]]

_names = itertools.count()


class BackendSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How to build the backend under test, in this process or a child.

    Attributes:
        name: The backend's registry name (``kvxfer.backends`` entry point).
        extra: ``BackendOptions.extra`` for every endpoint.
        mem: The memory kind the test cache claims (host memory either way).
        in_process: Peers live in the test process (backends with an in-process
            fabric); otherwise the peer runs in a spawned child process.
        env: Environment variables set in a child before its backend is built.
    """

    name: str
    extra: dict[str, str] = msgspec.field(default_factory=dict)
    mem: MemKind = MemKind.DRAM
    in_process: bool = False
    env: dict[str, str] = msgspec.field(default_factory=dict)

    def create(self, agent_name: str) -> Backend:
        """Build one backend instance through the registry."""
        cls = get_backend(self.name)
        return cls(BackendOptions(agent_name=agent_name, extra=dict(self.extra)))


class CacheShape(msgspec.Struct, frozen=True, kw_only=True):
    """The test cache: ``layers × {K, V} × shards`` regions of ``num_blocks`` blocks.

    Even layers keep all their regions interleaved block by block in one buffer (as a
    ``(num_blocks, 2, ...)`` vLLM cache does), odd layers one buffer per region, so both
    strided and contiguous regions are exercised. With ``window`` > 0, odd layers form a
    sliding-window group.
    """

    layers: int = 2
    num_shards: int = 2
    split_axis: SplitAxis = SplitAxis.TOKEN
    block_size: int = 16
    token_bytes: int = 32
    num_blocks: int = 24
    window: int = 4
    mem: MemKind = MemKind.DRAM

    @property
    def block_len(self) -> int:
        """Bytes of one block of one region."""
        spans = self.num_shards if self.split_axis is SplitAxis.TOKEN else 1
        return self.block_size // spans * self.token_bytes


class PatternCache:
    """Host memory shaped like a sharded paged KV cache, filled with provenance patterns."""

    def __init__(self, shape: CacheShape) -> None:
        self.shape = shape
        per_layer = 2 * shape.num_shards
        bl, nb = shape.block_len, shape.num_blocks
        self._buffers: list[ByteArray] = []
        self.views: list[ByteArray] = []
        regions: list[Region] = []
        for layer in range(shape.layers):
            if layer % 2 == 0:
                buf = np.zeros((nb, per_layer, bl), dtype=np.uint8)
                self._buffers.append(buf)
                views = [buf[:, j, :] for j in range(per_layer)]
            else:
                views = [np.zeros((nb, bl), dtype=np.uint8) for _ in range(per_layer)]
                self._buffers.extend(views)
            for j, view in enumerate(views):
                part = KVPart.K if j < shape.num_shards else KVPart.V
                regions.append(
                    Region(
                        base=int(view.ctypes.data),
                        num_blocks=nb,
                        stride=int(view.strides[0]),
                        block_len=bl,
                        mem=shape.mem,
                        layer=layer,
                        part=part,
                        shard=j % shape.num_shards,
                        group=1 if shape.window and layer % 2 else 0,
                    )
                )
                self.views.append(view)
        groups: tuple[Group, ...] = (Group(kind=GroupKind.FULL),)
        if shape.window and shape.layers > 1:
            groups += (Group(kind=GroupKind.SLIDING, window=shape.window),)
        self.layout = KVLayout(
            block_size=shape.block_size,
            regions=tuple(regions),
            split_axis=shape.split_axis,
            num_shards=shape.num_shards,
            groups=groups,
            dtype="uint8",
        )

    def pattern(self, seed: int, region: int, blocks: npt.ArrayLike) -> ByteArray:
        """Content of ``blocks`` of ``region`` under ``seed`` (one row per block)."""
        b = np.asarray(blocks, dtype=np.uint32)
        col = np.arange(self.shape.block_len, dtype=np.uint32)
        row = b * np.uint32(40503) + np.uint32((region * 7919 + seed * 104729) & 0xFFFFFFFF)
        mixed = row[:, None] * np.uint32(2246822519) + col[None, :] * np.uint32(2654435761)
        return ((mixed >> np.uint32(13)) & np.uint32(0xFF)).astype(np.uint8)

    def fill(self, seed: int) -> None:
        """Fill every block of every region with its pattern under ``seed``."""
        blocks = np.arange(self.shape.num_blocks)
        for r, view in enumerate(self.views):
            view[:] = self.pattern(seed, r, blocks)

    def expected(self, seed: int) -> ByteArray:
        """What :meth:`snapshot` returns right after ``fill(seed)``."""
        blocks = np.arange(self.shape.num_blocks)
        return np.stack([self.pattern(seed, r, blocks) for r in range(len(self.views))])

    def snapshot(self) -> ByteArray:
        """A copy of every region, shaped ``(regions, num_blocks, block_len)``."""
        return np.stack([v.copy() for v in self.views])


def locate(table: DescriptorTable, ids: IntArray) -> tuple[IntArray, IntArray, IntArray, IntArray]:
    """Region, block, offset in the block and length of each descriptor id."""
    addr = table.addr[ids].astype(np.int64)
    length = table.length[ids].astype(np.int64)
    region = np.full(len(ids), -1, dtype=np.int64)
    block = np.zeros(len(ids), dtype=np.int64)
    offset = np.zeros(len(ids), dtype=np.int64)
    for r, reg in enumerate(table.layout.regions):
        rel = addr - reg.base
        blk = rel // reg.stride
        off = rel - blk * reg.stride
        hit = (region < 0) & (rel >= 0) & (blk < reg.num_blocks) & (off + length <= reg.block_len)
        region[hit], block[hit], offset[hit] = r, blk[hit], off[hit]
    if (region < 0).any():
        raise AssertionError("a descriptor lies outside every region of its table's layout")
    return region, block, offset, length


def expected_after(
    cache: PatternCache,
    dst_seed: int,
    src_seed: int,
    dst: tuple[DescriptorTable, IntArray],
    src: tuple[DescriptorTable, IntArray],
) -> ByteArray:
    """The receiver's memory after moving descriptor pairs ``src → dst``."""
    out = cache.expected(dst_seed)
    dr, db, doff, dlen = locate(*dst)
    sr, sb, soff, slen = locate(*src)
    if not np.array_equal(dlen, slen):
        raise AssertionError("paired descriptors differ in length")
    for r, b, o, n, r2, b2, o2 in zip(dr, db, doff, dlen, sr, sb, soff):
        src_row = cache.pattern(src_seed, int(r2), [int(b2)])[0]
        out[r, b, o : o + n] = src_row[o2 : o2 + n]
    return out


class EndpointInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a peer needs to connect to an endpoint."""

    agent_name: str
    metadata: bytes
    layout: KVLayout
    capabilities: Capabilities
    pid: int


class Collected(msgspec.Struct, kw_only=True):
    """Notifications received since the last collect, and memory at the first arrival."""

    notifications: list[tuple[str, bytes]]
    snapshot: ByteArray | None = None


class EndpointLike(Protocol):
    """The operations a harness drives on an endpoint, wherever it lives."""

    def info(self) -> EndpointInfo: ...
    def configure(self, options: PlanOptions) -> None: ...
    def connect(self, peer: EndpointInfo) -> PeerHandle: ...
    def disconnect(self, peer: PeerHandle) -> None: ...
    def fill(self, seed: int) -> None: ...
    def snapshot(self) -> ByteArray: ...
    def stage_out(self, groups: Groups) -> None: ...
    def stage_in(self, groups: Groups) -> None: ...
    def arm(self, stage_in: Groups | None) -> None: ...
    def collect(self) -> Collected: ...
    def notify(self, peer: PeerHandle, payload: bytes) -> None: ...
    def close(self) -> int | None: ...


def _groups(groups: Groups) -> list[IntArray]:
    return [np.asarray(g, dtype=np.int64) for g in groups]


class Endpoint:
    """One backend with its registered :class:`PatternCache` (see the module docstring)."""

    def __init__(self, spec: BackendSpec, agent_name: str, shape: CacheShape) -> None:
        self.spec = spec
        self.cache = PatternCache(shape)
        self.backend = spec.create(agent_name)
        try:
            self.exposed = self.backend.register(self.cache.layout)
            self.options = PlanOptions()
            self.table = DescriptorTable.build(self.exposed, self.options)
            self.backend.prepare_local(self.table)
        except BaseException:
            self.backend.close()
            raise
        # Keyed by the backend's own handle, kept opaque (never converted).
        self.peer_tables: dict[PeerHandle, DescriptorTable] = {}
        self._by_name: dict[str, PeerHandle] = {}
        self._inbox: list[tuple[str, bytes]] = []
        self._armed: list[IntArray] | bool | None = False
        self._arrival: ByteArray | None = None

    def info(self) -> EndpointInfo:
        """Metadata, exposed layout and capabilities of this endpoint."""
        return EndpointInfo(
            agent_name=self.backend.agent_name,
            metadata=self.backend.metadata(),
            layout=self.exposed,
            capabilities=self.backend.capabilities,
            pid=os.getpid(),
        )

    def configure(self, options: PlanOptions) -> None:
        """Rebuild and prepare the local table for ``options`` (peers must reconnect)."""
        self.options = options
        self.table = DescriptorTable.build(self.exposed, options)
        self.backend.prepare_local(self.table)

    def connect(self, peer: EndpointInfo) -> PeerHandle:
        """Add ``peer`` with its table built for the current options; returns the handle."""
        old = self._by_name.get(peer.agent_name)
        if old is not None:
            self.disconnect(old)
        table = DescriptorTable.build(peer.layout, self.options)
        handle = self.backend.add_peer(peer.metadata, table)
        self.peer_tables[handle] = table
        self._by_name[peer.agent_name] = handle
        return handle

    def disconnect(self, peer: PeerHandle) -> None:
        """Remove a peer."""
        self.backend.remove_peer(peer)
        self.peer_tables.pop(peer, None)
        self._by_name = {k: v for k, v in self._by_name.items() if v != peer}

    def fill(self, seed: int) -> None:
        """Reset the engine memory to the pattern of ``seed``."""
        self.cache.fill(seed)

    def snapshot(self) -> ByteArray:
        """A copy of the engine memory."""
        return self.cache.snapshot()

    def stage_out(self, groups: Groups) -> None:
        """Call the backend's ``stage_out`` (producer side, before peers read)."""
        self.backend.stage_out(_groups(groups))

    def stage_in(self, groups: Groups) -> None:
        """Call the backend's ``stage_in`` (consumer side, after blocks landed)."""
        self.backend.stage_in(_groups(groups))

    def arm(self, stage_in: Groups | None) -> None:
        """At the next notification: stage ``stage_in`` blocks in (if given), snapshot."""
        self._armed = None if stage_in is None else _groups(stage_in)
        self._arrival = None

    def pump(self) -> None:
        """Drain the backend's notifications into the inbox (an agent's progress step)."""
        notifs = self.backend.drain_notifications()
        if not notifs:
            return
        self._inbox.extend(notifs)
        if self._armed is not False:
            # Snapshot in the same step that saw the notification: anything the peer
            # wrote must already be there (the backend promised bytes-before-notice).
            if isinstance(self._armed, list):
                self.backend.stage_in(self._armed)
            self._arrival = self.cache.snapshot()
            self._armed = False

    def collect(self) -> Collected:
        """Notifications since the last call, with the memory snapshot taken at arrival."""
        self.pump()
        out = Collected(notifications=self._inbox, snapshot=self._arrival)
        self._inbox, self._arrival = [], None
        return out

    def notify(self, peer: PeerHandle, payload: bytes) -> None:
        """Send a notification outside any transfer."""
        self.backend.notify(peer, payload)

    def close(self) -> None:
        """Close the backend (idempotent); nothing to wait for in this process."""
        self.backend.close()


def _serve(
    conn: multiprocessing.connection.Connection,
    spec: BackendSpec,
    agent_name: str,
    shape: CacheShape,
) -> None:
    """Child process main: host an :class:`Endpoint` and answer calls over ``conn``."""
    os.environ.update(spec.env)
    try:
        ep = Endpoint(spec, agent_name, shape)
        conn.send(("ok", ep.info()))
    except Exception:
        conn.send(("err", traceback.format_exc()))
        return
    try:
        while True:
            if not conn.poll(0.001):
                ep.pump()  # keep the transport progressing, like an agent's thread
                continue
            msg = conn.recv()
            if msg is None:
                break
            method, args = msg
            try:
                conn.send(("ok", getattr(ep, method)(*args)))
            except Exception as exc:
                conn.send(("err", f"{type(exc).__name__}: {exc}"))
    except (EOFError, BrokenPipeError):
        pass  # the parent is gone: close and exit like any process would
    finally:
        ep.close()


def _exit_without_close(spec: BackendSpec, agent_name: str, shape: CacheShape, peer: Any) -> None:
    """Child main: connect, read, then exit *without* closing (atexit must clean up)."""
    os.environ.update(spec.env)
    ep = Endpoint(spec, agent_name, shape)
    info: EndpointInfo = peer
    handle = ep.connect(info)
    table = ep.peer_tables[handle]
    ids = np.arange(min(len(ep.table), len(table), 8), dtype=np.int64)
    h = ep.backend.post(XferOp.READ, handle, ids, ids, b"")
    deadline = time.monotonic() + 20
    while ep.backend.status(h) is XferStatus.PENDING and time.monotonic() < deadline:
        pass
    # Deliberately no release and no close: interpreter exit must not crash.


class SpawnedEndpoint:
    """An :class:`Endpoint` in a ``spawn``-ed child process, driven over a pipe."""

    def __init__(self, spec: BackendSpec, agent_name: str, shape: CacheShape) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child, spec, agent_name, shape), daemon=True, name=agent_name
        )
        self.process.start()
        child.close()
        self._info: EndpointInfo | None = None
        self._closed = False

    def wait_ready(self, timeout: float = 60.0) -> EndpointInfo:
        """Wait until the child registered its memory; returns its info."""
        if self._info is None:
            info: EndpointInfo = self._receive(timeout, "start")
            self._info = info
        return self._info

    def _receive(self, timeout: float, what: str) -> Any:
        try:
            if not self._conn.poll(timeout):
                raise TransferTimeout(f"peer process {self.process.name}: no answer to {what}")
            status, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise BackendError(
                f"peer process {self.process.name} died (exit code {self.process.exitcode})"
            ) from exc
        if status != "ok":
            raise BackendError(f"peer process {self.process.name}: {what} failed: {value}")
        return value

    def call(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """Run ``Endpoint.<method>(*args)`` in the child and return its result."""
        self.wait_ready()
        try:
            self._conn.send((method, args))
        except (OSError, ValueError) as exc:
            raise BackendError(f"peer process {self.process.name} is gone") from exc
        return self._receive(timeout, method)

    def info(self) -> EndpointInfo:
        return self.wait_ready()

    def configure(self, options: PlanOptions) -> None:
        self.call("configure", options)

    def connect(self, peer: EndpointInfo) -> PeerHandle:
        handle: PeerHandle = self.call("connect", peer)
        return handle

    def disconnect(self, peer: PeerHandle) -> None:
        self.call("disconnect", peer)

    def fill(self, seed: int) -> None:
        self.call("fill", seed)

    def snapshot(self) -> ByteArray:
        snap: ByteArray = self.call("snapshot")
        return snap

    def stage_out(self, groups: Groups) -> None:
        self.call("stage_out", [list(map(int, g)) for g in groups])

    def stage_in(self, groups: Groups) -> None:
        self.call("stage_in", [list(map(int, g)) for g in groups])

    def arm(self, stage_in: Groups | None) -> None:
        self.call("arm", None if stage_in is None else [list(map(int, g)) for g in stage_in])

    def collect(self) -> Collected:
        got: Collected = self.call("collect")
        return got

    def notify(self, peer: PeerHandle, payload: bytes) -> None:
        self.call("notify", peer, payload)

    def close(self, timeout: float = 30.0) -> int | None:
        """Close the backend, let the child exit, and return its exit code."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(OSError, ValueError):
                self._conn.send(None)  # the child closes its backend and exits
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
            self._conn.close()
        return self.process.exitcode


class Moved(msgspec.Struct, kw_only=True):
    """The outcome of one transfer driven by :meth:`Harness.post_ids`."""

    status: XferStatus
    expected: ByteArray  # the receiver's memory if every byte landed
    received: ByteArray | None  # the receiver's memory after completion (+ stage-in)
    notifications: list[tuple[str, bytes]]
    at_notification: ByteArray | None  # receiver memory when the notification was seen
    slowest_status_s: float


class Harness:
    """A local endpoint connected to a peer endpoint (see the module docstring).

    Args:
        spec: The backend under test.
        shape: The test cache's shape (default :class:`CacheShape` with ``spec.mem``).
    """

    def __init__(self, spec: BackendSpec, shape: CacheShape | None = None) -> None:
        self.spec = spec
        self.shape = shape if shape is not None else CacheShape(mem=spec.mem)
        self._spawned: list[SpawnedEndpoint] = []
        self._locals: list[Endpoint] = []
        self.exit_codes: list[int | None] = []
        self.remote = self.new_remote()  # starts first: a child takes seconds to boot
        try:
            self.local = self.new_local()
            self.remote_info = self.remote.info()
            self.peer = self.local.connect(self.remote_info)
        except BaseException:
            self.close()
            raise
        self.options = PlanOptions()
        self._seeds = itertools.count(1)

    # -- endpoints --------------------------------------------------------------------
    def _name(self, role: str) -> str:
        return f"{self.spec.name}-{role}-{os.getpid()}-{next(_names)}"

    def new_local(self) -> Endpoint:
        """A fresh endpoint in this process (closed with the harness)."""
        ep = Endpoint(self.spec, self._name("local"), self.shape)
        self._locals.append(ep)
        return ep

    def new_remote(self) -> EndpointLike:
        """A fresh peer endpoint (a child process unless ``spec.in_process``)."""
        if self.spec.in_process:
            ep = Endpoint(self.spec, self._name("peer"), self.shape)
            self._locals.append(ep)
            return ep
        spawned = SpawnedEndpoint(self.spec, self._name("peer"), self.shape)
        self._spawned.append(spawned)
        return spawned

    def exit_without_close(self, timeout: float = 60.0) -> int | None:
        """Run a child that transfers from the peer and exits without closing."""
        if self.spec.in_process:
            return 0
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(
            target=_exit_without_close,
            args=(self.spec, self._name("exit"), self.shape, self.remote_info),
            daemon=True,
        )
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
            return None
        return proc.exitcode

    @property
    def caps(self) -> Capabilities:
        """Capabilities of the backend under test."""
        return self.local.backend.capabilities

    @property
    def remote_table(self) -> DescriptorTable:
        """The peer's descriptor table as the local endpoint prepared it."""
        return self.local.peer_tables[self.peer]

    def use_options(self, options: PlanOptions) -> None:
        """Rebuild both tables for ``options`` and reconnect."""
        if options == self.options:
            return
        self.local.configure(options)
        self.remote.configure(options)
        self.options = options
        self.reconnect()

    def reconnect(self) -> None:
        """Connect the local endpoint to the peer again (after a removal)."""
        self.peer = self.local.connect(self.remote_info)

    # -- transfers --------------------------------------------------------------------
    def post_ids(
        self,
        op: XferOp,
        local_ids: IntArray,
        remote_ids: IntArray,
        *,
        local_groups: Groups | None = None,
        remote_groups: Groups | None = None,
        notification: bytes = b"",
        timeout: float = 30.0,
    ) -> Moved:
        """Fill both sides with fresh patterns, post one transfer, wait and report.

        ``local_groups`` / ``remote_groups`` are the blocks per group the ids cover;
        backends staging through host memory get them staged out on the sender and in
        on the receiver, as the agent does.
        """
        ls, rs = next(self._seeds), next(self._seeds)
        self.local.fill(ls)
        self.remote.fill(rs)
        backend = self.local.backend
        stages = self.caps.stages_through_host
        if stages and (local_groups is None or remote_groups is None):
            raise AssertionError("a staging backend needs the block lists of the transfer")
        send, recv = (self.remote, self.local) if op is XferOp.READ else (self.local, self.remote)
        send_groups, recv_groups = (
            (remote_groups, local_groups) if op is XferOp.READ else (local_groups, remote_groups)
        )
        if stages and send_groups is not None:
            send.stage_out(send_groups)
        self.remote.collect()  # forget anything earlier
        if op is XferOp.WRITE:
            self.remote.arm(recv_groups if stages else None)
        lids = np.asarray(local_ids, dtype=np.int64)
        rids = np.asarray(remote_ids, dtype=np.int64)
        handle = backend.post(op, self.peer, lids, rids, notification)
        notes: list[tuple[str, bytes]] = []
        at_note: ByteArray | None = None
        slowest = 0.0
        deadline = time.monotonic() + timeout
        state = XferStatus.PENDING
        try:
            while True:
                # Look for the notification before every poll, the first included: one
                # that shows up before the transfer moved its bytes is caught here.
                got = self.remote.collect()
                if got.notifications:
                    if op is XferOp.READ and at_note is None:
                        at_note = self.local.snapshot()
                    elif got.snapshot is not None:
                        at_note = got.snapshot
                    notes.extend(got.notifications)
                waiting_note = bool(notification) and not notes
                if state is XferStatus.FAILED or (state is XferStatus.DONE and not waiting_note):
                    break
                if time.monotonic() > deadline:
                    break
                t0 = time.perf_counter()
                state = backend.status(handle)
                slowest = max(slowest, time.perf_counter() - t0)
                if state is XferStatus.PENDING:
                    time.sleep(0.0002)
        finally:
            backend.release(handle)
        if notification and state is XferStatus.DONE:
            # Give a duplicate a moment to show up, so "exactly once" is checked.
            end = time.monotonic() + 0.05
            while time.monotonic() < end:
                notes.extend(self.remote.collect().notifications)
                time.sleep(0.002)
        received: ByteArray | None = None
        if state is XferStatus.DONE:
            if op is XferOp.READ and stages and recv_groups is not None:
                recv.stage_in(recv_groups)
            if op is XferOp.WRITE and stages and not notification and recv_groups is not None:
                recv.stage_in(recv_groups)
            received = (
                recv.snapshot() if not (op is XferOp.WRITE and stages and notification) else at_note
            )
        local_pair = (self.local.table, lids)
        remote_pair = (self.remote_table, rids)
        if op is XferOp.READ:
            expected = expected_after(self.local.cache, ls, rs, local_pair, remote_pair)
        else:
            expected = expected_after(self.local.cache, rs, ls, remote_pair, local_pair)
        return Moved(
            status=state,
            expected=expected,
            received=received,
            notifications=notes,
            at_notification=at_note,
            slowest_status_s=slowest,
        )

    # -- teardown ---------------------------------------------------------------------
    def close(self) -> list[int | None]:
        """Close every endpoint; returns the exit codes of the child processes."""
        for ep in self._locals:
            ep.close()
        self._locals.clear()
        for sp in self._spawned:
            self.exit_codes.append(sp.close())
        self._spawned.clear()
        return self.exit_codes
