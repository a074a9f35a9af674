"""What the ``nixl_rbln`` backend needs from nixl-rbln: the adapter interface.

nixl-rbln (the Python module ``nixl_rbln`` plus the NIXL backend plugin ``"RBLN"``) is
not public. This module pins down the part of it kvxfer relies on as two protocols, so
the backend can be written, type-checked and tested today:

* :class:`RblnAdapter` creates one :class:`RblnAgent` per kvxfer backend, handing over
  the rails and ``stripe_width`` chosen by kvxfer's NIC selection;
* :class:`RblnAgent` registers device memory (one range set per device), prepares
  descriptor lists (shard-expanded: the core's descriptor tables already hold one
  descriptor per (shard, block)), posts transfers by index arrays, reports their state,
  and carries notifications.

Everything crossing this boundary is a kvxfer type, a number, bytes or a numpy array;
the adapter's own handles stay opaque. Adapter methods may raise anything; the backend
maps failures to :mod:`kvxfer.errors` at its edge.

:class:`NixlAgentAdapter` implements the protocols on NIXL's Python API for any NIXL
plugin. It is what kvxfer uses with the real module when ``nixl_rbln`` does not bring
its own adapter (a ``kvxfer_adapter()`` function), and what the emulation in
:mod:`kvxfer.testing.rbln_emulation` builds on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvxfer.backend import XferOp, XferStatus
from kvxfer.errors import BackendError
from kvxfer.layout import MemKind

__all__ = ["NixlAgentAdapter", "NixlPluginAgent", "RblnAdapter", "RblnAgent"]

log = logging.getLogger("kvxfer.backends.rbln_adapter")


@runtime_checkable
class RblnAgent(Protocol):
    """One data-plane endpoint of the RBLN NIXL backend (one per kvxfer backend)."""

    @property
    def name(self) -> str:
        """The agent's name, as peers see it in notifications."""

    def metadata(self) -> bytes:
        """Connection blob a peer passes to :meth:`add_remote`."""

    def register(self, mem: MemKind, device: int, spans: Sequence[tuple[int, int]]) -> object:
        """Register ``(start, length)`` byte ranges of one device; returns a handle."""

    def deregister(self, registration: object) -> None:
        """Undo one :meth:`register`."""

    def prep_descs(self, agent: str | None, mem: MemKind, descs: npt.NDArray[np.uint64]) -> object:
        """Prepare an ``N×3`` ``(addr, length, device)`` list; ``agent`` None is local."""

    def release_descs(self, prepared: object) -> None:
        """Release a prepared list."""

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name."""

    def remove_remote(self, agent: str) -> None:
        """Forget a peer and disconnect from it."""

    def post(
        self,
        op: XferOp,
        local: object,
        local_ids: npt.NDArray[np.int64],
        remote: object,
        remote_ids: npt.NDArray[np.int64],
        notification: bytes,
    ) -> object:
        """Create and start one transfer of paired prepared descriptors; returns a handle."""

    def state(self, xfer: object) -> XferStatus:
        """Non-blocking state of a transfer (drives progress)."""

    def release_xfer(self, xfer: object) -> None:
        """Release a transfer handle."""

    def send_notification(self, agent: str, payload: bytes) -> None:
        """Send a message to a peer outside any transfer."""

    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, as ``(agent name, payload)``."""

    def close(self) -> None:
        """Release the agent itself (everything else was released before)."""


@runtime_checkable
class RblnAdapter(Protocol):
    """Factory of :class:`RblnAgent` objects; what ``nixl_rbln.kvxfer_adapter()`` returns."""

    @property
    def description(self) -> str:
        """One line for logs, e.g. ``"nixl-rbln 1.2 (NIXL plugin RBLN)"``."""

    @property
    def emulated(self) -> bool:
        """True for a stand-in that moves host memory instead of NPU memory."""

    def create_agent(
        self,
        name: str,
        *,
        rails: tuple[str, ...],
        stripe_width: int | None,
        progress_thread: bool,
    ) -> RblnAgent:
        """Start an agent named ``name`` on ``rails`` (empty: the plugin's default).

        ``stripe_width`` None means one rail per transfer, 0 every rail both peers share
        (R-RAIL-3).
        """


_OPS = {XferOp.READ: "READ", XferOp.WRITE: "WRITE"}


class NixlPluginAgent:
    """:class:`RblnAgent` over a ``nixl._api.nixl_agent`` with one plugin (the ``ucx``
    backend drives NIXL's UCX plugin through it too)."""

    def __init__(self, agent: Any, plugin: str, mem_names: Mapping[MemKind, str]) -> None:
        self._agent = agent
        self._plugin = plugin
        self._mem = mem_names

    @property
    def name(self) -> str:
        return str(self._agent.name)

    def metadata(self) -> bytes:
        blob: bytes = self._agent.get_agent_metadata()
        return blob

    def register(self, mem: MemKind, device: int, spans: Sequence[tuple[int, int]]) -> object:
        descs = [(start, length, device, "") for start, length in spans]
        return self._agent.register_memory(descs, self._mem[mem], [self._plugin])

    def deregister(self, registration: object) -> None:
        self._agent.deregister_memory(registration, [self._plugin])

    def prep_descs(self, agent: str | None, mem: MemKind, descs: npt.NDArray[np.uint64]) -> object:
        return self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT" if agent is None else agent,
            np.ascontiguousarray(descs, dtype=np.uint64),
            self._mem[mem],
            [self._plugin],
        )

    def release_descs(self, prepared: object) -> None:
        prepared.release()  # type: ignore[attr-defined]

    def add_remote(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        # NIXL's binding returns the name as bytes; notifications key it as str.
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, agent: str) -> None:
        self._agent.remove_remote_agent(agent)

    def post(
        self,
        op: XferOp,
        local: object,
        local_ids: npt.NDArray[np.int64],
        remote: object,
        remote_ids: npt.NDArray[np.int64],
        notification: bytes,
    ) -> object:
        xfer = self._agent.make_prepped_xfer(
            _OPS[op],
            local,
            np.ascontiguousarray(local_ids, dtype=np.int32),
            remote,
            np.ascontiguousarray(remote_ids, dtype=np.int32),
            notification,
            [self._plugin],
        )
        if self._agent.transfer(xfer) == "ERR":
            xfer.release()
            raise BackendError(f"NIXL {self._plugin} failed to post a {op.value}")
        return xfer

    def state(self, xfer: object) -> XferStatus:
        state = self._agent.check_xfer_state(xfer)
        if state == "DONE":
            return XferStatus.DONE
        if state == "PROC":
            return XferStatus.PENDING
        return XferStatus.FAILED

    def release_xfer(self, xfer: object) -> None:
        xfer.release()  # type: ignore[attr-defined]

    def send_notification(self, agent: str, payload: bytes) -> None:
        self._agent.send_notif(agent, payload)

    def notifications(self) -> list[tuple[str, bytes]]:
        notifs: dict[Any, list[bytes]] = self._agent.get_new_notifs()
        return [
            (name.decode() if isinstance(name, bytes) else str(name), msg)
            for name, msgs in notifs.items()
            for msg in msgs
        ]

    def close(self) -> None:
        self._agent = None


class NixlAgentAdapter:
    """:class:`RblnAdapter` on NIXL's Python API with one backend plugin.

    With the real nixl-rbln this drives NIXL's ``"RBLN"`` plugin and passes the rails
    and stripe width as the plugin's init parameters ``rails`` (comma-separated) and
    ``stripe_width`` (absent when unset). That parameter naming is kvxfer's assumption
    about the unpublished plugin; a ``nixl_rbln.kvxfer_adapter()`` overrides all of it.

    Args:
        plugin: The NIXL backend plugin name.
        mem_names: NIXL memory type of each :class:`~kvxfer.layout.MemKind`.
        description: Line for logs.
        emulated: Whether this adapter stands in for the NPU (see the protocol).
    """

    def __init__(
        self,
        plugin: str = "RBLN",
        *,
        mem_names: Mapping[MemKind, str] | None = None,
        description: str | None = None,
        emulated: bool = False,
    ) -> None:
        self.plugin = plugin
        self.mem_names = dict(mem_names or {MemKind.DRAM: "DRAM", MemKind.VRAM: "VRAM"})
        self._description = description or f"NIXL plugin {plugin}"
        self._emulated = emulated

    @property
    def description(self) -> str:
        return self._description

    @property
    def emulated(self) -> bool:
        return self._emulated

    def plugin_params(self, rails: tuple[str, ...], stripe_width: int | None) -> dict[str, str]:
        """Init parameters handed to the plugin."""
        params = {"rails": ",".join(rails)} if rails else {}
        if stripe_width is not None:
            params["stripe_width"] = str(stripe_width)
        return params

    def create_agent(
        self,
        name: str,
        *,
        rails: tuple[str, ...],
        stripe_width: int | None,
        progress_thread: bool,
    ) -> RblnAgent:
        from kvxfer.backends.ucx import import_nixl

        nixl_agent, nixl_agent_config = import_nixl()
        # No listener thread: metadata travels in kvxfer's handshake.
        conf = nixl_agent_config(
            enable_prog_thread=progress_thread, enable_listen_thread=False, backends=[]
        )
        agent = nixl_agent(name, conf)
        if self.plugin not in agent.plugin_list:
            raise BackendError(
                f"NIXL has no {self.plugin} plugin here (plugins: {agent.plugin_list})"
            )
        agent.create_backend(self.plugin, self.plugin_params(rails, stripe_width))
        return NixlPluginAgent(agent, self.plugin, self.mem_names)
