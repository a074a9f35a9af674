"""``ucx`` backend: NIXL's UCX transport on registered memory (R-BE-2).

Descriptor tables are prepared once (the local one at registration, a peer's once per
peer incarnation); each request then posts only two index arrays. NIXL merges
descriptors contiguous on both sides while building the request, which is what makes
paged KV with contiguous block runs fast.

Teardown order matters: NIXL/UCX processes crash at interpreter exit when a memory
registration outlives its agent or a prepared list outlives its registration. ``close``
releases transfers, then prepared lists, then peers, then memory, then the agent, and
is registered with ``atexit`` so an engine that forgets to close still exits cleanly.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

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
from kvxfer.errors import BackendError, PeerError, RegistrationError, missing_dependency
from kvxfer.layout import MemKind

if TYPE_CHECKING:
    from kvxfer.descriptors import DescriptorTable
    from kvxfer.layout import KVLayout

__all__ = ["UcxBackend", "import_nixl", "merged_intervals"]

log = logging.getLogger("kvxfer.backends.ucx")

_NIXL_MEM = {MemKind.DRAM: "DRAM", MemKind.VRAM: "VRAM"}
_NIXL_OP = {XferOp.READ: "READ", XferOp.WRITE: "WRITE"}


def import_nixl() -> Any:
    """Import NIXL's Python API or raise the install hint."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise missing_dependency("nixl", "nixl", exc) from exc
    return nixl_agent, nixl_agent_config


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


def _region_extents(layout: KVLayout) -> dict[tuple[MemKind, int], list[tuple[int, int]]]:
    """Per (memory kind, device): the merged byte ranges the layout's regions span."""
    groups: dict[tuple[MemKind, int], tuple[list[int], list[int]]] = {}
    for r in layout.regions:
        starts, ends = groups.setdefault((r.mem, r.device_id), ([], []))
        starts.append(r.base)
        ends.append(r.base + (r.num_blocks - 1) * r.stride + r.block_len)
    return {
        key: merged_intervals(np.array(s, dtype=np.uint64), np.array(e, dtype=np.uint64))
        for key, (s, e) in groups.items()
    }


def _mem_kind_of(table: DescriptorTable) -> MemKind:
    kinds = {r.mem for r in table.layout.regions}
    if len(kinds) != 1:
        raise RegistrationError(f"a descriptor table must hold one memory kind, got {kinds}")
    return kinds.pop()


class UcxBackend(Backend):
    """NIXL agent with the UCX plugin (host DRAM; device memory where UCX supports it)."""

    name: ClassVar[str] = "ucx"
    _plugin: ClassVar[str] = "UCX"

    def __init__(self, options: BackendOptions) -> None:
        nixl_agent, nixl_agent_config = import_nixl()
        self._options = options
        if options.rails:
            # UCX reads its device list at context creation: pin the data plane to the
            # selected rails (and stripe or not, R-RAIL-3) before the agent exists.
            from kvxfer.rails import ucx_environment

            os.environ.update(ucx_environment(options.rails, options.stripe_width))
        # NIXL's listener thread is not used (metadata travels in our handshake), and
        # its progress thread spins a core while idle; the agent polls instead.
        conf = nixl_agent_config(
            enable_prog_thread=options.progress_thread,
            enable_listen_thread=False,
            backends=[self._plugin],
        )
        try:
            self._nixl = nixl_agent(options.agent_name, conf)
        except Exception as exc:  # NIXL raises bare RuntimeError/nixlBind errors
            raise BackendError(f"could not start a NIXL agent with {self._plugin}: {exc}") from exc
        if self._plugin not in self._nixl.backends:
            raise BackendError(
                f"NIXL has no {self._plugin} plugin here (plugins: {self._nixl.plugin_list})"
            )
        self._lock = threading.RLock()
        self._reg_descs: list[Any] = []
        self._local_dlist: Any = None
        self._peers: dict[PeerHandle, Any] = {}  # peer -> prepared remote dlist
        self._xfers: dict[XferHandle, tuple[Any, PeerHandle]] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._registered: KVLayout | None = None
        # atexit holds only a weak reference: an agent dropped early is closed by GC.
        ref = weakref.ref(self)

        def _close_at_exit() -> None:
            backend = ref()
            if backend is not None:
                backend.close()

        atexit.register(_close_at_exit)

    # -- identity ---------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name=self.name,
            mem_kinds=frozenset({MemKind.DRAM, MemKind.VRAM}),
            device_to_device=False,
            merges_contiguous=True,
        )

    @property
    def agent_name(self) -> str:
        return self._options.agent_name

    def metadata(self) -> bytes:
        with self._lock:
            blob: bytes = self._nixl.get_agent_metadata()
            return blob

    # -- memory -----------------------------------------------------------------
    def register(self, layout: KVLayout) -> KVLayout:
        with self._lock:
            if self._registered is not None:
                raise RegistrationError("this backend already registered a layout")
            for (kind, device), spans in _region_extents(layout).items():
                descs = [(start, end - start, device, "") for start, end in spans]
                try:
                    reg = self._nixl.register_memory(descs, _NIXL_MEM[kind], [self._plugin])
                except Exception as exc:
                    raise RegistrationError(
                        f"{self._plugin} refused to register {len(descs)} {kind.value} range(s) "
                        f"on device {device}: {exc}"
                    ) from exc
                self._reg_descs.append(reg)
            self._registered = layout
            return layout

    def _dlist(self, agent: str, table: DescriptorTable) -> Any:
        rows = np.stack([table.addr, table.length, table.device.astype(np.uint64)], axis=1)
        return self._nixl.prep_xfer_dlist(
            agent, np.ascontiguousarray(rows, dtype=np.uint64), _NIXL_MEM[_mem_kind_of(table)]
        )

    def prepare_local(self, table: DescriptorTable) -> None:
        with self._lock:
            if self._local_dlist is not None:
                self._local_dlist.release()
            try:
                self._local_dlist = self._dlist("NIXL_INIT_AGENT", table)
            except Exception as exc:
                raise RegistrationError(f"could not prepare the local descriptors: {exc}") from exc

    # -- peers ------------------------------------------------------------------
    def add_peer(self, metadata: bytes, table: DescriptorTable) -> PeerHandle:
        with self._lock:
            try:
                raw = self._nixl.add_remote_agent(metadata)
                name = PeerHandle(raw.decode() if isinstance(raw, bytes) else str(raw))
            except Exception as exc:
                raise PeerError(f"NIXL rejected the peer's metadata: {exc}") from exc
            old = self._peers.pop(name, None)
            if old is not None:
                old.release()
            try:
                self._peers[name] = self._dlist(name, table)
            except Exception as exc:
                self._nixl.remove_remote_agent(name)
                raise PeerError(f"could not prepare descriptors of peer {name}: {exc}") from exc
            return name

    def remove_peer(self, peer: PeerHandle) -> None:
        with self._lock:
            dlist = self._peers.pop(peer, None)
            if dlist is None:
                return
            for handle, (xfer, owner) in list(self._xfers.items()):
                if owner == peer:
                    self._release_locked(handle, xfer)
            dlist.release()
            try:
                self._nixl.remove_remote_agent(peer)
            except Exception as exc:  # the peer may already be gone; nothing to undo
                log.debug("removing NIXL peer %s: %s", peer, exc)

    # -- transfers ----------------------------------------------------------------
    def post(
        self,
        op: XferOp,
        peer: PeerHandle,
        local_ids: npt.NDArray[np.int64],
        remote_ids: npt.NDArray[np.int64],
        notification: bytes = b"",
    ) -> XferHandle:
        with self._lock:
            remote = self._peers.get(peer)
            if remote is None:
                raise PeerError(f"unknown or removed peer {peer!r}")
            if self._local_dlist is None:
                raise RegistrationError("post before prepare_local")
            try:
                xfer = self._nixl.make_prepped_xfer(
                    _NIXL_OP[op],
                    self._local_dlist,
                    np.ascontiguousarray(local_ids, dtype=np.int32),
                    remote,
                    np.ascontiguousarray(remote_ids, dtype=np.int32),
                    notification,
                )
                state = self._nixl.transfer(xfer)
            except Exception as exc:
                if "DISCONNECT" in str(exc):
                    raise PeerError(f"peer {peer} disconnected during a {op.value}: {exc}") from exc
                raise BackendError(f"{self._plugin} refused a {op.value} to {peer}: {exc}") from exc
            if state == "ERR":
                xfer.release()
                raise BackendError(f"{self._plugin} failed to post a {op.value} to {peer}")
            handle = XferHandle(next(self._ids))
            self._xfers[handle] = (xfer, peer)
            return handle

    def status(self, handle: XferHandle) -> XferStatus:
        with self._lock:
            entry = self._xfers.get(handle)
            if entry is None:
                return XferStatus.FAILED
            try:
                state = self._nixl.check_xfer_state(entry[0])
            except Exception as exc:
                log.warning("transfer %d to %s: %s", handle, entry[1], exc)
                return XferStatus.FAILED
            if state == "DONE":
                return XferStatus.DONE
            if state == "PROC":
                return XferStatus.PENDING
            return XferStatus.FAILED

    def _release_locked(self, handle: XferHandle, xfer: Any) -> None:
        self._xfers.pop(handle, None)
        try:
            xfer.release()
        except Exception as exc:
            # NIXL refuses to release a request still in flight; it is released with
            # the agent. Never let that turn into a crash of the caller.
            log.debug("releasing transfer %d: %s", handle, exc)

    def release(self, handle: XferHandle) -> None:
        with self._lock:
            entry = self._xfers.get(handle)
            if entry is not None:
                self._release_locked(handle, entry[0])

    # -- notifications ------------------------------------------------------------
    def notify(self, peer: PeerHandle, payload: bytes) -> None:
        with self._lock:
            if peer not in self._peers:
                raise PeerError(f"unknown or removed peer {peer!r}")
            try:
                self._nixl.send_notif(peer, payload)
            except Exception as exc:
                raise PeerError(f"could not notify {peer}: {exc}") from exc

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        with self._lock:
            if self._closed:
                return []
            notifs: dict[str, list[bytes]] = self._nixl.get_new_notifs()
        return [(name, msg) for name, msgs in notifs.items() for msg in msgs]

    # -- teardown -----------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for handle, (xfer, _) in list(self._xfers.items()):
                self._release_locked(handle, xfer)
            for peer in list(self._peers):
                self.remove_peer(peer)
            if self._local_dlist is not None:
                self._local_dlist.release()
                self._local_dlist = None
            for reg in self._reg_descs:
                try:
                    self._nixl.deregister_memory(reg)
                except Exception as exc:
                    log.warning("deregistering memory: %s", exc)
            self._reg_descs.clear()
            self._nixl = None
