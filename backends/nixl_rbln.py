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

import importlib
import logging
import os
from typing import ClassVar

from kvxfer.backend import Backend, BackendOptions, Capabilities
from kvxfer.backends._agent_backend import AgentBackend
from kvxfer.backends.rbln_adapter import NixlAgentAdapter, RblnAdapter
from kvxfer.backends.ucx import UcxBackend
from kvxfer.errors import BackendError, MissingDependency
from kvxfer.layout import MemKind

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


class NixlRblnBackend(AgentBackend):
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
        self.adapter = adapter if adapter is not None else load_adapter(_selection(options))
        try:
            agent = self.adapter.create_agent(
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
        super().__init__(options, agent, self.adapter.description)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name=self.name,
            mem_kinds=frozenset({MemKind.VRAM, MemKind.DRAM}),
            device_to_device=True,
            merges_contiguous=True,
        )
