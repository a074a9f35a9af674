"""What the ``nixl_rbln`` backend needs from nixl-rbln: the adapter interface.

nixl-rbln (the Python module ``nixl_rbln`` plus the NIXL backend plugin ``"RBLN"``) is
not public. This module pins down the part of it kvxfer relies on as two protocols, so
the backend can be written, type-checked and tested today:

* :class:`RblnAdapter` creates one :class:`RblnAgent` per kvxfer backend, handing over
  the rails and ``stripe_width`` chosen by kvxfer's NIC selection;
* :class:`RblnAgent` (the generic :class:`~kvxfer.backends._nixl.NixlEndpoint`)
  registers device memory (one range set per device), prepares descriptor lists
  (shard-expanded: the core's descriptor tables already hold one descriptor per
  (shard, block)), posts transfers by index arrays, reports their state, and carries
  notifications.

Everything crossing this boundary is a kvxfer type, a number, bytes or a numpy array;
the adapter's own handles stay opaque. Adapter methods may raise anything; the backend
maps failures to :mod:`kvxfer.errors` at its edge with
:func:`~kvxfer.backends._nixl.nixl_error` (NIXL's own exception classes by meaning,
anything else by what the call was doing).

:class:`NixlAgentAdapter` implements the protocols on NIXL's Python API for any NIXL
plugin (through :func:`~kvxfer.backends._nixl.start_plugin_agent`). It is what kvxfer
uses with the real module when ``nixl_rbln`` does not bring its own adapter (a
``kvxfer_adapter()`` function), and what the emulation in
:mod:`kvxfer.testing.rbln_emulation` builds on. Which adapter a backend uses is
decided by :func:`kvxfer.backends.nixl_rbln.load_adapter`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from kvxfer.backends._nixl import NixlEndpoint, start_plugin_agent
from kvxfer.core.layout import MemKind

__all__ = ["NixlAgentAdapter", "RblnAdapter", "RblnAgent"]


RblnAgent = NixlEndpoint
"""One data-plane endpoint of the RBLN NIXL backend (one per kvxfer backend): the
generic :class:`~kvxfer.backends._nixl.NixlEndpoint` contract."""


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


class NixlAgentAdapter:
    """:class:`RblnAdapter` on NIXL's Python API with one backend plugin.

    With the real nixl-rbln this drives NIXL's ``"RBLN"`` plugin and passes the rails
    and stripe width as the plugin's init parameters ``rails`` (comma-separated) and
    ``stripe_width`` (absent when unset). That parameter naming is kvxfer's assumption
    about the unpublished plugin; a ``nixl_rbln.kvxfer_adapter()`` overrides all of it.

    Args:
        plugin: The NIXL backend plugin name.
        mem_names: NIXL memory type of each :class:`~kvxfer.core.layout.MemKind`.
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
        return start_plugin_agent(
            name,
            self.plugin,
            params=self.plugin_params(rails, stripe_width),
            progress_thread=progress_thread,
            mem_names=self.mem_names,
        )
