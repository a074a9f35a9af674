"""``nixl_rbln`` backend: NPU memory moved device-to-device through nixl-rbln (R-BE-4).

``kv_buffer_device: "rbln"``. Device memory is registered with NIXL as VRAM through the
nixl-rbln adapter (Python module ``nixl_rbln``, NIXL backend ``"RBLN"``), one range set
per device; descriptor tables come shard-expanded from the core (one descriptor per
shard of a block), so chunk_mode and swa_window_mode work unchanged here: the agent
selects descriptor ids from the core algebra and this backend posts them.

Which adapter is used, first match wins:

1. ``NixlRblnBackend(options, adapter=...)``, an
   :class:`~kvxfer.backends.rbln_adapter.RblnAdapter`;
2. ``options.extra["rbln_adapter"]``;
3. the environment variable ``KVXFER_RBLN_ADAPTER``;
4. the installed ``nixl_rbln`` module (its ``kvxfer_adapter()`` if it has one, else
   NIXL's ``"RBLN"`` plugin through :class:`~kvxfer.backends.rbln_adapter.NixlAgentAdapter`).

Values for 2 and 3: ``"nixl_rbln"`` (the default, as 4), ``"emulated"`` (the emulation
in :mod:`kvxfer.testing.rbln_emulation`, host memory standing in for the NPU), or
``"package.module:factory"`` for any callable returning an adapter.

Without nixl-rbln, device-to-device is refused with
:class:`~kvxfer.errors.MissingDependency`; host bounce calls :func:`host_transport`,
which logs ``RBLN NIXL: nixl-rbln not available`` and falls back to UCX.
"""

from __future__ import annotations

import atexit
import importlib
import itertools
import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING, ClassVar

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
from kvxfer.backends.rbln_adapter import NixlAgentAdapter, RblnAdapter, RblnAgent
from kvxfer.backends.ucx import UcxBackend, merged_intervals
from kvxfer.errors import BackendError, MissingDependency, PeerError, RegistrationError
from kvxfer.layout import MemKind

if TYPE_CHECKING:
    from kvxfer.descriptors import DescriptorTable
    from kvxfer.layout import KVLayout

__all__ = [
    "ADAPTER_ENV",
    "NOT_AVAILABLE",
    "NixlRblnBackend",
    "host_transport",
    "load_adapter",
]

log = logging.getLogger("kvxfer.backends.nixl_rbln")

#: Environment variable selecting the adapter (see the module docstring).
ADAPTER_ENV = "KVXFER_RBLN_ADAPTER"
#: The exact log line of the host-bounce fallback to UCX (operators grep for it).
NOT_AVAILABLE = "RBLN NIXL: nixl-rbln not available"


def load_adapter(selection: str | None = None) -> RblnAdapter:
    """Load the RBLN adapter named by ``selection`` (see the module docstring).

    Raises:
        MissingDependency: nixl-rbln is not importable (the real adapter was asked for).
        BackendError: an unknown selection, or a factory not returning an adapter.
    """
    choice = (selection or "nixl_rbln").strip()
    if choice == "emulated":
        from kvxfer.testing.rbln_emulation import EmulatedRblnAdapter

        return EmulatedRblnAdapter()
    if choice == "nixl_rbln":
        try:
            module = importlib.import_module("nixl_rbln")
        except ImportError as exc:
            raise MissingDependency(
                'nixl-rbln is required for kv_buffer_device "rbln" (device-to-device), but '
                f"the Python module nixl_rbln could not be imported ({exc}); install nixl-rbln "
                'with the RBLN SDK, or use kv_buffer_device "cpu" (host bounce over UCX)'
            ) from exc
        factory = getattr(module, "kvxfer_adapter", None)
        adapter = factory() if callable(factory) else NixlAgentAdapter("RBLN")
    elif ":" in choice:
        module_name, _, attr = choice.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise BackendError(f"RBLN adapter factory {choice!r} not found: {exc}") from exc
        adapter = factory()
    else:
        raise BackendError(
            f"unknown RBLN adapter {choice!r}: use 'nixl_rbln', 'emulated' or 'module:factory'"
        )
    if not isinstance(adapter, RblnAdapter):
        raise BackendError(f"RBLN adapter {choice!r} does not implement kvxfer's RblnAdapter")
    return adapter


def _selection(options: BackendOptions) -> str | None:
    return options.extra.get("rbln_adapter") or os.environ.get(ADAPTER_ENV) or None


def host_transport(options: BackendOptions, *, adapter: RblnAdapter | None = None) -> Backend:
    """The host-to-host transport for host bounce on an RBLN deployment.

    nixl-rbln's backend when an adapter is available, else UCX, after logging exactly
    ``RBLN NIXL: nixl-rbln not available``.
    """
    if adapter is None:
        try:
            adapter = load_adapter(_selection(options))
        except MissingDependency as exc:
            log.warning(NOT_AVAILABLE)
            log.debug("nixl-rbln import failure: %s", exc)
            return UcxBackend(options)
    return NixlRblnBackend(options, adapter=adapter)


def _mem_kind_of(table: DescriptorTable) -> MemKind:
    kinds = {r.mem for r in table.layout.regions}
    if len(kinds) != 1:
        raise RegistrationError(f"a descriptor table must hold one memory kind, got {kinds}")
    return kinds.pop()


def _descs(table: DescriptorTable) -> npt.NDArray[np.uint64]:
    return np.stack([table.addr, table.length, table.device.astype(np.uint64)], axis=1)


class NixlRblnBackend(Backend):
    """NIXL through the nixl-rbln adapter; device-to-device.

    Args:
        options: Common backend options; ``rails`` and ``stripe_width`` go to the adapter.
        adapter: The adapter to use instead of the selection rules of the module docstring.

    Raises:
        MissingDependency: no adapter given and nixl-rbln is not importable.
        BackendError: the adapter could not start an agent.
    """

    name: ClassVar[str] = "nixl_rbln"

    def __init__(self, options: BackendOptions, *, adapter: RblnAdapter | None = None) -> None:
        self._options = options
        self.adapter = adapter if adapter is not None else load_adapter(_selection(options))
        try:
            self._agent: RblnAgent | None = self.adapter.create_agent(
                options.agent_name,
                rails=options.rails,
                stripe_width=options.stripe_width,
                progress_thread=options.progress_thread,
            )
        except BackendError:
            raise
        except Exception as exc:  # adapters raise their own (NIXL: bare RuntimeError)
            raise BackendError(
                f"{self.adapter.description}: could not start agent {options.agent_name}: {exc}"
            ) from exc
        log.info("RBLN NIXL: agent %s on %s", options.agent_name, self.adapter.description)
        self._lock = threading.RLock()
        self._registrations: list[object] = []
        self._local: object | None = None
        self._peers: dict[PeerHandle, object] = {}
        self._xfers: dict[XferHandle, tuple[object, PeerHandle]] = {}
        self._ids = itertools.count(1)
        self._registered: KVLayout | None = None
        self._closed = False
        # atexit holds only a weak reference: a backend dropped early is closed by GC.
        ref = weakref.ref(self)

        def _close_at_exit() -> None:
            backend = ref()
            if backend is not None:
                backend.close()

        atexit.register(_close_at_exit)

    # -- identity -------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name=self.name,
            mem_kinds=frozenset({MemKind.VRAM, MemKind.DRAM}),
            device_to_device=True,
            merges_contiguous=True,
        )

    @property
    def agent_name(self) -> str:
        return self._options.agent_name

    def _live(self) -> RblnAgent:
        if self._agent is None:
            raise BackendError(f"backend {self.agent_name} is closed")
        return self._agent

    def metadata(self) -> bytes:
        with self._lock:
            return self._live().metadata()

    # -- memory ---------------------------------------------------------------------
    def register(self, layout: KVLayout) -> KVLayout:
        with self._lock:
            agent = self._live()
            if self._registered is not None:
                raise RegistrationError("this backend already registered a layout")
            by_device: dict[tuple[MemKind, int], tuple[list[int], list[int]]] = {}
            for r in layout.regions:
                starts, ends = by_device.setdefault((r.mem, r.device_id), ([], []))
                starts.append(r.base)
                ends.append(r.end)
            # Shards of one NPU share a device id and are registered together; K/V of one
            # tensor interleave, and NIXL refuses overlapping ranges: register the union.
            for (kind, device), (starts, ends) in by_device.items():
                spans = merged_intervals(
                    np.array(starts, dtype=np.uint64), np.array(ends, dtype=np.uint64)
                )
                try:
                    reg = agent.register(kind, device, [(s, e - s) for s, e in spans])
                except Exception as exc:
                    raise RegistrationError(
                        f"{self.adapter.description} refused {len(spans)} {kind.value} "
                        f"range(s) on device {device}: {exc}"
                    ) from exc
                self._registrations.append(reg)
            self._registered = layout
            return layout

    def prepare_local(self, table: DescriptorTable) -> None:
        with self._lock:
            agent = self._live()
            if self._local is not None:
                agent.release_descs(self._local)
                self._local = None
            try:
                self._local = agent.prep_descs(None, _mem_kind_of(table), _descs(table))
            except RegistrationError:
                raise
            except Exception as exc:
                raise RegistrationError(f"could not prepare the local descriptors: {exc}") from exc

    # -- peers ----------------------------------------------------------------------
    def add_peer(self, metadata: bytes, table: DescriptorTable) -> PeerHandle:
        with self._lock:
            agent = self._live()
            try:
                name = PeerHandle(agent.add_remote(metadata))
            except Exception as exc:
                raise PeerError(f"{self.adapter.description} rejected a peer: {exc}") from exc
            old = self._peers.pop(name, None)
            if old is not None:
                agent.release_descs(old)
            try:
                self._peers[name] = agent.prep_descs(name, _mem_kind_of(table), _descs(table))
            except Exception as exc:
                agent.remove_remote(name)
                raise PeerError(f"could not prepare descriptors of peer {name}: {exc}") from exc
            return name

    def remove_peer(self, peer: PeerHandle) -> None:
        with self._lock:
            prepared = self._peers.pop(peer, None)
            if prepared is None or self._agent is None:
                return
            for handle, (xfer, owner) in list(self._xfers.items()):
                if owner == peer:
                    self._release_locked(handle, xfer)
            self._agent.release_descs(prepared)
            try:
                self._agent.remove_remote(peer)
            except Exception as exc:  # the peer may be gone already; nothing to undo
                log.debug("removing RBLN peer %s: %s", peer, exc)

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
            try:
                xfer = agent.post(op, self._local, local_ids, remote, remote_ids, notification)
            except BackendError:
                raise
            except Exception as exc:
                raise BackendError(
                    f"{self.adapter.description} refused a {op.value} to {peer}: {exc}"
                ) from exc
            handle = XferHandle(next(self._ids))
            self._xfers[handle] = (xfer, peer)
            return handle

    def status(self, handle: XferHandle) -> XferStatus:
        with self._lock:
            entry = self._xfers.get(handle)
            if entry is None or self._agent is None:
                return XferStatus.FAILED
            try:
                return self._agent.state(entry[0])
            except Exception as exc:
                log.warning("transfer %d to %s: %s", handle, entry[1], exc)
                return XferStatus.FAILED

    def _release_locked(self, handle: XferHandle, xfer: object) -> None:
        self._xfers.pop(handle, None)
        if self._agent is None:
            return
        try:
            self._agent.release_xfer(xfer)
        except Exception as exc:
            # A request still in flight cannot be released; it goes with the agent.
            log.debug("releasing transfer %d: %s", handle, exc)

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
            try:
                agent.send_notification(peer, payload)
            except Exception as exc:
                raise PeerError(f"could not notify {peer}: {exc}") from exc

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        with self._lock:
            if self._agent is None:
                return []
            return self._agent.notifications()

    # -- teardown -------------------------------------------------------------------
    def close(self) -> None:
        # Transfers, then prepared lists, then peers, then memory, then the agent:
        # NIXL processes crash at exit when a handle outlives what it depends on.
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
            if self._local is not None:
                agent.release_descs(self._local)
                self._local = None
            for reg in self._registrations:
                try:
                    agent.deregister(reg)
                except Exception as exc:
                    log.warning("deregistering memory: %s", exc)
            self._registrations.clear()
            agent.close()
            self._agent = None
