"""``host_bounce`` backend: device blocks bounce through registered host memory (R-BE-3).

``kv_buffer_device: "cpu"``. :meth:`HostBounceBackend.register` allocates one host
staging region per engine region, with the engine's block geometry (``num_blocks``
blocks of ``block_len`` bytes, contiguous), registers the *staging* memory with an
inner transport and returns the staging layout: that is what peers address.

The copies: a pull's producer calls :meth:`~HostBounceBackend.stage_out` when it holds
the blocks (engine → staging, peers read staging); a push's consumer calls
:meth:`~HostBounceBackend.stage_in` once the writes landed (staging → engine). Both
spread the regions over a few copy threads. The initiator's own copy is part of
:meth:`~HostBounceBackend.post_engine`, which cuts the request into slices and overlaps
each slice's copy with the transfer of its neighbours (see
:mod:`kvxfer.backends._bounce`): a READ is DONE only once its bytes are in the
engine's blocks, a WRITE stages its blocks out itself. :meth:`post` stays the plain
staging-to-staging transfer of the inner transport.

The inner transport is, by default, :func:`default_transport`: the ``nixl_rbln``
backend when nixl-rbln is importable (or an adapter is configured, see
:mod:`kvxfer.backends.nixl_rbln`), otherwise ``ucx`` after the warning
``RBLN NIXL: nixl-rbln not available``; both are looked up in the backend registry, so
this module imports no RBLN code. ``options.extra["transport"] = "ucx"`` pins UCX
without trying nixl-rbln; a constructed backend can be passed as ``transport=``.

Engine memory is reached through its address when it is host memory. Device memory
needs a copy op (the engine's own block copy, as vLLM passes one to its connectors):
see :data:`CopyOp` and :func:`torch_copy_op`. Host bounce registers one full buffer per
region, so chunk_mode, swa_window_mode and push_stream are not available with it
(``device_to_device`` is False; the agent and the config parser reject them).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

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
from kvxfer.backends._bounce import Copier, CopyDirection, CopyTask, Pipelined, slice_ids
from kvxfer.core.descriptors import Runs
from kvxfer.core.layout import MemKind
from kvxfer.errors import (
    BackendError,
    ConfigError,
    MissingDependency,
    PlanError,
    RegistrationError,
    missing_dependency,
)
from kvxfer.registry import get_backend

if TYPE_CHECKING:
    from kvxfer.core.descriptors import DescriptorTable
    from kvxfer.core.layout import KVLayout, Region
    from kvxfer.core.wire import GuardTable

__all__ = [
    "NOT_AVAILABLE",
    "CopyDirection",
    "CopyOp",
    "HostBounceBackend",
    "default_transport",
    "host_block_view",
    "torch_copy_op",
]

log = logging.getLogger("kvxfer.backends.host_bounce")

#: The exact log line of the fallback to UCX without nixl-rbln (operators grep for it).
NOT_AVAILABLE = "RBLN NIXL: nixl-rbln not available"

IntArray = npt.NDArray[np.int64]
ByteArray = npt.NDArray[np.uint8]


CopyOp = Callable[[CopyDirection, int, IntArray, ByteArray], None]
"""``op(direction, region, block_ids, staging)`` copies ``block_ids`` of engine region
``region`` out to, or in from, ``staging`` — that region's staging buffer as a
``(num_blocks, block_len)`` uint8 array; block *b* of the engine pairs with row *b*."""


#: Below this many bytes per run of consecutive blocks on average, staging copies use
#: one fancy-indexed gather + scatter instead of a slice copy per run.
_RUN_BYTES = 16 << 10


def _runs(blocks: IntArray) -> list[tuple[int, int]]:
    """``[start, stop)`` runs of consecutive ids among the (sorted, unique) blocks.

    Engine block *b* pairs with staging row *b*, so order does not matter.
    """
    if not blocks.size:
        return []
    ids = np.unique(blocks)
    cut = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = ids[np.concatenate(([0], cut))]
    stops = ids[np.append(cut - 1, len(ids) - 1)] + 1
    return list(zip(starts.tolist(), stops.tolist()))


def _touched(region: IntArray, first: IntArray, last: IntArray) -> list[CopyTask]:
    """One copy task per region: the blocks ``first[i] ..= last[i]`` of its runs."""
    counts = last - first + 1
    starts = np.repeat(first, counts)
    steps = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts
    )
    blocks, owner = starts + steps, np.repeat(region, counts)
    return [(int(r), np.unique(blocks[owner == r])) for r in np.unique(region).tolist()]


def _take(runs: Runs, sel: IntArray) -> Runs:
    """The runs at positions ``sel``, in that order."""
    return Runs(
        local_addr=runs.local_addr[sel],
        remote_addr=runs.remote_addr[sel],
        length=runs.length[sel],
        local_device=runs.local_device[sel],
        remote_device=runs.remote_device[sel],
    )


def host_block_view(region: Region) -> ByteArray:
    """A writable ``(num_blocks, block_len)`` uint8 view of a host region, by address."""
    size = (region.num_blocks - 1) * region.stride + region.block_len
    flat = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(region.base))
    return np.lib.stride_tricks.as_strided(
        flat, shape=(region.num_blocks, region.block_len), strides=(region.stride, 1)
    )


def torch_copy_op(tensors: Sequence[Any]) -> CopyOp:
    """A :data:`CopyOp` over the tensors a layout was built from (``KVLayout.from_tensors``).

    ``tensors[i]`` is region *i* (dim 0 = blocks, each block contiguous), on any device.

    Raises:
        MissingDependency: torch is not installed.
    """
    try:
        import torch
    except ImportError as exc:
        raise missing_dependency("torch", "torch", exc) from exc
    # Byte views of each region, one row per block; no copies.
    rows = [t.reshape(t.shape[0], -1).view(torch.uint8) for t in tensors]

    def copy(
        direction: CopyDirection, region: int, block_ids: IntArray, staging: ByteArray
    ) -> None:
        engine = rows[region]
        idx = torch.from_numpy(np.ascontiguousarray(block_ids, dtype=np.int64))
        host = torch.from_numpy(staging)
        if direction is CopyDirection.OUT:
            host.index_copy_(0, idx, engine.index_select(0, idx.to(engine.device)).cpu())
        else:
            engine.index_copy_(
                0, idx.to(engine.device), host.index_select(0, idx).to(engine.device)
            )

    return copy


def default_transport(options: BackendOptions) -> Backend:
    """The host-to-host transport host bounce uses unless given one (see the module
    docstring); backends are looked up by name in :mod:`kvxfer.registry`."""
    choice = options.extra.get("transport", "auto")
    if choice == "ucx":
        return get_backend("ucx")(options)
    if choice != "auto":
        raise BackendError(f"host_bounce: extra['transport']={choice!r}: use 'auto' or 'ucx'")
    try:
        return get_backend("nixl_rbln")(options)
    except MissingDependency as exc:
        if exc.name != "nixl_rbln":  # NIXL itself is missing: UCX could not run either
            raise
        log.warning(NOT_AVAILABLE)
        log.debug("nixl-rbln import failure: %s", exc)
    return get_backend("ucx")(options)


def _int_option(options: BackendOptions, key: str, default: int, low: int) -> int:
    raw = options.extra.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if value < low:
        raise ConfigError(f"backend_extra.{key}", raw, f"must be an integer >= {low}")
    return value


class HostBounceBackend(Backend):
    """Host staging buffers moved by an inner transport; see the module docstring.

    Args:
        options: Common backend options (also given to the default transport).
            ``extra["copy_threads"]``: threads for staging copies (default: the CPU
            count, at most 4); ``extra["pipeline_slices"]``: slices an engine-to-engine
            transfer is cut into so that copies overlap the transfer (default 8; 1
            copies and moves one after the other).
        transport: The host-to-host backend to use (default: see the module docstring).
            It is owned, and closed, by this backend.
        copy_op: The engine's block copy; default: numpy index copies through the
            regions' addresses (host memory only).
    """

    name: ClassVar[str] = "host_bounce"

    def __init__(
        self,
        options: BackendOptions,
        *,
        transport: Backend | None = None,
        copy_op: CopyOp | None = None,
    ) -> None:
        self._options = options
        try:
            threads = _int_option(options, "copy_threads", min(os.cpu_count() or 1, 4), 1)
            self._slices = _int_option(options, "pipeline_slices", 8, 1)
        except ConfigError:
            if transport is not None:
                transport.close()  # it was handed over to this backend
            raise
        self._transport = transport if transport is not None else default_transport(options)
        self._copy_op = copy_op
        self._lock = threading.Lock()
        self._engine: KVLayout | None = None
        self._staging_mem: ByteArray | None = None
        self._staging: list[ByteArray] = []
        self._copy_in_locks: list[threading.Lock] = []  # one per staging region
        self._engine_views: list[ByteArray] | None = None
        # Regions past the layout's: slices (region, lo, hi) of its blocks' bytes.
        self._pieces: list[tuple[int, int, int]] = []
        self._copier = Copier(self._copy_region, threads)
        self._jobs: dict[XferHandle, Pipelined] = {}
        self._job_ids = itertools.count(-1, -1)  # the transport's handles are positive
        self._closed = False

    # -- identity -------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name=self.name,
            mem_kinds=frozenset({MemKind.DRAM, MemKind.VRAM}),
            device_to_device=False,
            stages_through_host=True,
            merges_contiguous=self._transport.capabilities.merges_contiguous,
            guard=self._transport.capabilities.guard,
            # A piece of a block is a slice of its staging copy; the engine's copy op
            # copies whole regions.
            head_sections=self._copy_op is None,
            # Runs land in staging; the blocks they touch are copied whole.
            address_runs=self._transport.capabilities.address_runs,
        )

    @property
    def agent_name(self) -> str:
        return self._options.agent_name

    @property
    def transport(self) -> Backend:
        """The inner host-to-host backend."""
        return self._transport

    def metadata(self) -> bytes:
        return self._transport.metadata()

    # -- memory ---------------------------------------------------------------------
    def register(self, layout: KVLayout) -> KVLayout:
        with self._lock:
            if self._closed:
                raise RegistrationError("host_bounce backend is closed")
            if self._engine is not None:
                raise RegistrationError("this backend already registered a layout")
            views = None
            if self._copy_op is None:
                device = [i for i, r in enumerate(layout.regions) if r.mem is not MemKind.DRAM]
                if device:
                    raise RegistrationError(
                        f"host bounce of device memory (region {device[0]}) needs the engine's "
                        "block copy op: HostBounceBackend(options, copy_op=...)"
                    )
                views = [host_block_view(r) for r in layout.regions]
            sizes = [r.num_blocks * r.block_len for r in layout.regions]
            # One allocation for every staging region: one registered range for the NIC.
            # Written once here so its pages exist: otherwise the first transfer pays a
            # page fault per 4 KiB (about a second per GB on the bench machines).
            mem = np.empty(sum(sizes), dtype=np.uint8)
            mem.fill(0)
            offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
            staging = [
                mem[off : off + size].reshape(r.num_blocks, r.block_len)
                for off, size, r in zip(offsets, sizes, layout.regions)
            ]
            base = int(mem.ctypes.data)
            exposed = msgspec.structs.replace(
                layout,
                regions=tuple(
                    msgspec.structs.replace(
                        r, base=base + off, stride=r.block_len, mem=MemKind.DRAM, device_id=0
                    )
                    for off, r in zip(offsets, layout.regions)
                ),
            )
            self._transport.register(exposed)
            self._engine, self._staging_mem, self._staging = layout, mem, staging
            self._copy_in_locks = [threading.Lock() for _ in staging]
            self._engine_views = views
            return exposed

    def prepare_local(self, table: DescriptorTable) -> None:
        with self._lock:
            staged = self._engine is not None and self._engine_views is not None
            if staged and self._staging_mem is not None:
                self._pieces = self._head_pieces(table)
            elif len(table) > len(table.layout.regions) * table.layout.num_blocks:
                raise RegistrationError(
                    "host bounce through the engine's copy op stages whole regions: "
                    "a local table with a head section is not supported there"
                )
        self._transport.prepare_local(table)

    def _head_pieces(self, table: DescriptorTable) -> list[tuple[int, int, int]]:
        """The rows past the whole-block table (a one-head section of each region,
        :func:`kvxfer.core.tp_plan.prepared_rows`) as pieces ``(region, lo, hi)``: bytes
        ``[lo, hi)`` of every block of a staging region, ``num_blocks`` rows each.
        Staging copies a piece's bytes only: two producer ranks' reads into one
        block land, and are copied in, side by side."""
        assert self._engine is not None
        nb, nregions = self._engine.num_blocks, len(self._engine.regions)
        extra = len(table) - nb * nregions
        if extra <= 0:
            return []
        if extra % nb:
            raise RegistrationError(
                f"host bounce: {extra} descriptors past the whole-block table are not "
                f"whole blocks of {nb}"
            )
        bases = np.array([int(v.ctypes.data) for v in self._staging], dtype=np.uint64)
        lens = np.array([v.shape[1] for v in self._staging], dtype=np.uint64)
        rows = np.arange(nb * nregions, len(table)).reshape(-1, nb)
        pieces = []
        block = np.arange(nb, dtype=np.uint64)
        for r in rows:
            addr, length = table.addr[r], table.length[r]
            i = int(np.searchsorted(bases, addr[0], side="right")) - 1
            lo = int(addr[0] - bases[i]) if i >= 0 else -1
            if (
                i < 0
                or lo + int(length[0]) > int(lens[i])
                or not np.array_equal(addr, bases[i] + block * lens[i] + np.uint64(lo))
                or not (length == length[0]).all()
            ):
                raise RegistrationError(
                    f"host bounce: descriptor {int(r[0])} past the whole-block table is "
                    "not a slice of every block of one staging region"
                )
            pieces.append((i, lo, lo + int(length[0])))
        return pieces

    # -- staging --------------------------------------------------------------------
    def _tasks(
        self, direction: CopyDirection, block_ids: Sequence[npt.NDArray[np.int64]]
    ) -> list[CopyTask]:
        """Check one id array per group and return one copy task per touched region."""
        with self._lock:
            if self._engine is None or self._closed:
                raise RegistrationError(f"stage {direction.value} before register or after close")
            layout = self._engine
        if len(block_ids) != len(layout.groups):
            raise PlanError(
                f"stage {direction.value}: {len(block_ids)} block list(s) for "
                f"{len(layout.groups)} group(s)"
            )
        ids = [np.asarray(b, dtype=np.int64) for b in block_ids]
        for g, b in enumerate(ids):
            if b.ndim != 1 or (b.size and (b.min() < 0 or b.max() >= layout.num_blocks)):
                raise PlanError(
                    f"stage {direction.value}: group {g} block ids out of range "
                    f"[0, {layout.num_blocks})"
                )
        ids = [np.unique(b) for b in ids]  # sorted: runs of consecutive blocks copy as one
        return [(i, ids[r.group]) for i, r in enumerate(layout.regions) if ids[r.group].size]

    def _copy_region(self, direction: CopyDirection, task: CopyTask) -> None:
        """Copy one region's blocks (sorted, unique) between the engine and staging."""
        i, blocks = task
        lo, hi = 0, None
        n = len(self._staging)
        if i >= n and i - n < len(self._pieces):
            i, lo, hi = self._pieces[i - n]  # one head's bytes of each block
        staging = self._staging[i] if i < n else None
        if staging is None or self._engine is None:
            raise RegistrationError(f"stage {direction.value} after close")
        if direction is CopyDirection.OUT:
            self._copy_rows(direction, i, blocks, staging, lo, hi)
            return
        # One copy in at a time per staging region. A request pushed from several
        # producer ranks (TP sizes differ) settles one reception per rank, each copying
        # the whole blocks in once its own rank's bytes landed: a copy that read the rows
        # before another rank's head landed must not write them after that rank's
        # copy-in. One at a time, a copy either ends before that copy-in (which then
        # overwrites it) or reads after that rank's bytes landed.
        with self._copy_in_locks[i]:
            self._copy_rows(direction, i, blocks, staging, lo, hi)

    def _copy_rows(
        self,
        direction: CopyDirection,
        i: int,
        blocks: IntArray,
        staging: ByteArray,
        lo: int,
        hi: int | None,
    ) -> None:
        """Copy bytes ``[lo, hi)`` of ``blocks`` between engine region ``i`` and its
        staging rows."""
        if self._copy_op is not None:
            if hi is not None:
                raise PlanError("host bounce through a copy op stages whole regions only")
            self._copy_op(direction, i, blocks, staging)
            return
        assert self._engine_views is not None
        engine = self._engine_views[i][:, lo:hi]
        staging = staging[:, lo:hi]
        src, dst = (engine, staging) if direction is CopyDirection.OUT else (staging, engine)
        spans = _runs(blocks)
        if len(spans) * _RUN_BYTES <= len(blocks) * staging.shape[1]:
            # Runs of consecutive blocks: one memcpy each, no temporary.
            for a, z in spans:
                dst[a:z] = src[a:z]
        else:  # short runs: one gather + scatter beats a Python loop
            dst[blocks] = src[blocks]

    def stage_out(self, block_ids: Sequence[npt.NDArray[np.int64]]) -> None:
        """Copy engine blocks (one id array per group) into staging for peers to read."""
        self._copier.run(CopyDirection.OUT, self._tasks(CopyDirection.OUT, block_ids))

    def stage_in(self, block_ids: Sequence[npt.NDArray[np.int64]]) -> None:
        """Copy landed staging blocks (one id array per group) into the engine's blocks.

        Calls may overlap (one per producer rank of a request, from any thread): their
        copies of one region go one at a time, so the last one to copy a block holds
        the bytes landed before it began, never bytes an earlier copy read."""
        self._copier.run(CopyDirection.IN, self._tasks(CopyDirection.IN, block_ids))

    def post_engine(
        self,
        op: XferOp,
        peer: PeerHandle,
        local_ids: npt.NDArray[np.int64],
        remote_ids: npt.NDArray[np.int64],
        notification: bytes = b"",
    ) -> XferHandle:
        """Move engine blocks, the local staging copy overlapped with the transfer.

        READ: DONE once every slice landed *and* was copied into the engine's blocks.
        WRITE: the local blocks are staged out here (no :meth:`stage_out` needed),
        slice by slice ahead of the slice's write. The notification goes once every
        slice moved.
        """
        with self._lock:
            if self._engine is None or self._closed:
                raise RegistrationError(f"{op.value} before register or after close")
            layout = self._engine
        nb, nregions = layout.num_blocks, len(layout.regions)
        local_ids = np.asarray(local_ids, dtype=np.int64)
        remote_ids = np.asarray(remote_ids, dtype=np.int64)
        if len(local_ids) != len(remote_ids):
            raise PlanError(
                f"{op.value}: {len(local_ids)} local but {len(remote_ids)} remote descriptor ids"
            )
        nregions += len(self._pieces)  # a head section's pieces count as regions here
        if len(local_ids) and (local_ids.min() < 0 or local_ids.max() >= nb * nregions):
            # Staging holds whole blocks (or their head pieces): any other is not ours.
            raise PlanError(f"{op.value}: local descriptor ids outside the whole-block section")
        region = local_ids // nb
        if len(region) > 1 and (region[1:] < region[:-1]).any():
            # Plans post a block's abutting regions together (kvxfer.core.merging); staging
            # copies and slices go region by region, and staging regions never abut,
            # so the transport loses no merge in region order.
            order = np.argsort(region, kind="stable")
            local_ids, remote_ids = local_ids[order], remote_ids[order]
        cuts = slice_ids(local_ids, nb, self._slices)
        tasks = []
        for a, z in cuts:
            ids = local_ids[a:z]
            regions, first = np.unique(ids // nb, return_index=True)
            bounds = [*first.tolist(), len(ids)]
            tasks.append(
                [
                    (int(r), np.unique(ids[lo:hi] % nb))
                    for r, lo, hi in zip(regions.tolist(), bounds, bounds[1:])
                ]
            )
        transport = self._transport
        return self._start(
            Pipelined(op, peer, notification, tasks),
            [
                functools.partial(transport.post, op, peer, local_ids[a:z], remote_ids[a:z])
                for a, z in cuts
            ],
        )

    def post_runs(
        self,
        op: XferOp,
        peer: PeerHandle,
        runs: Runs,
        notification: bytes = b"",
    ) -> XferHandle:
        """Move address runs between staging buffers (a pull between different block
        sizes, :mod:`kvxfer.core.ratio`), with the engine's copy of every block a run
        touches, as :meth:`post_engine`.

        The runs address this backend's staging (the layout :meth:`register` exposed)
        and the peer's. READ: DONE once every run landed and each touched block was
        copied into the engine. A block only partly written by the runs is copied
        whole: its other bytes are the staging row's, past the request's last token
        (a larger block's uncovered tail), which the engine never reads before it
        writes them. WRITE: the touched blocks are staged out before their runs move.
        """
        with self._lock:
            if self._engine is None or self._closed:
                raise RegistrationError(f"{op.value} before register or after close")
            layout = self._engine
        if not self._transport.capabilities.address_runs:
            raise BackendError(
                f"host_bounce: its transport {self._transport.capabilities.name} posts no "
                "address runs"
            )
        nb = layout.num_blocks
        region, first, last = self._run_blocks(runs)
        # Region by region (as post_engine): each slice's copy is one task per region.
        order = np.lexsort((first, region))
        region, first, last = region[order], first[order], last[order]
        cuts = slice_ids(region * nb + first, nb, self._slices)
        tasks = [_touched(region[a:z], first[a:z], last[a:z]) for a, z in cuts]
        transport = self._transport
        return self._start(
            Pipelined(op, peer, notification, tasks),
            [
                functools.partial(transport.post_runs, op, peer, _take(runs, order[a:z]))
                for a, z in cuts
            ],
        )

    def _run_blocks(self, runs: Runs) -> tuple[IntArray, IntArray, IntArray]:
        """For each run: its staging region and the first and last block it touches.

        Raises:
            PlanError: a run is not inside one staging region.
        """
        bases = np.array([int(v.ctypes.data) for v in self._staging], dtype=np.uint64)
        rows = np.array([v.shape[1] for v in self._staging], dtype=np.uint64)
        ends = bases + rows * np.array([v.shape[0] for v in self._staging], dtype=np.uint64)
        addr = np.asarray(runs.local_addr, dtype=np.uint64)
        length = np.asarray(runs.length, dtype=np.uint64)
        # Staging buffers are separate allocations, in no address order.
        by_addr = np.argsort(bases, kind="stable")
        pos = np.searchsorted(bases[by_addr], addr, side="right").astype(np.int64) - 1
        inside = pos >= 0
        at = by_addr[np.maximum(pos, 0)]
        region = at.astype(np.int64)
        inside &= (length > 0) & (addr + length <= ends[at])
        if not inside.all():
            bad = int(np.flatnonzero(~inside)[0])
            raise PlanError(
                f"host bounce: address run {bad} (0x{int(addr[bad]):x}, {int(length[bad])} "
                "bytes) is not inside one staging region"
            )
        first = ((addr - bases[at]) // rows[at]).astype(np.int64)
        last = ((addr + length - 1 - bases[at]) // rows[at]).astype(np.int64)
        return region, first, last

    def _start(self, job: Pipelined, posts: Sequence[Callable[[], XferHandle]]) -> XferHandle:
        job.post(self._transport, self._copier, posts)
        handle = XferHandle(next(self._job_ids))
        with self._lock:
            self._jobs[handle] = job
        return handle

    # -- delegated ------------------------------------------------------------------
    def add_peer(self, metadata: bytes, table: DescriptorTable) -> PeerHandle:
        return self._transport.add_peer(metadata, table)

    def remove_peer(self, peer: PeerHandle) -> None:
        self._transport.remove_peer(peer)

    def post(
        self,
        op: XferOp,
        peer: PeerHandle,
        local_ids: npt.NDArray[np.int64],
        remote_ids: npt.NDArray[np.int64],
        notification: bytes = b"",
    ) -> XferHandle:
        return self._transport.post(op, peer, local_ids, remote_ids, notification)

    def status(self, handle: XferHandle) -> XferStatus:
        job = self._jobs.get(handle)
        if job is None:
            return self._transport.status(handle)
        return job.status(self._transport, self._copier)

    def release(self, handle: XferHandle) -> None:
        with self._lock:
            job = self._jobs.pop(handle, None)
        if job is None:
            self._transport.release(handle)
        else:
            job.release(self._transport)

    def cancel(self, handle: XferHandle) -> bool:
        """Over once every slice's transfer and staging copy ended (a slice that failed
        does not stop the copies of the others)."""
        job = self._jobs.get(handle)
        if job is None:
            return self._transport.cancel(handle)
        if not job.quiet(self._transport):
            return False
        self.release(handle)
        return True

    def notify(self, peer: PeerHandle, payload: bytes) -> None:
        self._transport.notify(peer, payload)

    # The guard table lives in the transport's host memory, read like the staging
    # buffers: a producer overwrites a hold's word before its engine (and any later
    # stage_out) may touch the blocks again.
    def register_guard(self, slots: int) -> npt.NDArray[np.uint64]:
        return self._transport.register_guard(slots)

    def guard_table(self) -> GuardTable | None:
        return self._transport.guard_table()

    def register_staging(self, nbytes: int) -> int:
        # Host memory of the transport, as the guard table: peers READ it directly.
        return self._transport.register_staging(nbytes)

    def add_peer_guard(self, peer: PeerHandle, guard: GuardTable) -> None:
        self._transport.add_peer_guard(peer, guard)

    def post_guard_read(
        self, peer: PeerHandle, slot: int, notification: bytes = b"", *, copies: int = 1
    ) -> XferHandle:
        return self._transport.post_guard_read(peer, slot, notification, copies=copies)

    def guard_word(self, handle: XferHandle) -> int:
        return self._transport.guard_word(handle)

    def post_sink_write(self, peer: PeerHandle, *, copies: int = 1) -> XferHandle:
        return self._transport.post_sink_write(peer, copies=copies)

    def failure_detail(self, handle: XferHandle) -> str:
        return self._transport.failure_detail(handle)

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        return self._transport.drain_notifications()

    # -- teardown -------------------------------------------------------------------
    def close(self) -> None:
        # The transport deregisters the staging memory first; only then may it be freed.
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._copier.close()  # no copy may touch staging once it is deregistered
        self._transport.close()
        with self._lock:
            self._engine_views = None
            self._staging = []
            self._staging_mem = None
