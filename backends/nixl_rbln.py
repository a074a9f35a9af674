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

Values for 2 and 3: ``"nixl_rbln"`` (the default, as 4), ``"package.module:factory"``
for any callable returning an adapter, or the name of an entry point in the
``kvxfer.rbln_adapters`` group (a factory as well). kvxfer declares one there:
``emulated``, the emulation in :mod:`kvxfer.testing.rbln_emulation` (host memory
standing in for the NPU); this module never imports it.

Without nixl-rbln, device-to-device is refused with
:class:`~kvxfer.errors.MissingDependency` (its ``name`` is ``"nixl_rbln"``); host bounce
then falls back to UCX (see :mod:`kvxfer.backends.host_bounce`).
"""

from __future__ import annotations

import importlib
import logging
import os
from importlib.metadata import entry_points
from typing import ClassVar

from kvxfer.backend import BackendOptions, Capabilities
from kvxfer.backends._agent_backend import AgentBackend
from kvxfer.backends._nixl import NixlCall, map_nixl_errors, stall_limit
from kvxfer.backends.rbln_adapter import NixlAgentAdapter, RblnAdapter
from kvxfer.core.layout import MemKind
from kvxfer.errors import BackendError, MissingDependency

__all__ = ["ADAPTER_ENV", "ADAPTER_GROUP", "NixlRblnBackend", "load_adapter"]

log = logging.getLogger("kvxfer.backends.nixl_rbln")

#: Environment variable selecting the adapter (see the module docstring).
ADAPTER_ENV = "KVXFER_RBLN_ADAPTER"
#: Entry-point group of named adapter factories (``emulated`` is kvxfer's own).
ADAPTER_GROUP = "kvxfer.rbln_adapters"


def _factory(choice: str) -> object:
    """The adapter factory a ``module:factory`` path or an entry-point name stands for."""
    if ":" in choice:
        module_name, _, attr = choice.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise BackendError(f"RBLN adapter factory {choice!r} not found: {exc}") from exc
    named = {ep.name: ep for ep in entry_points(group=ADAPTER_GROUP)}
    if choice not in named:
        # kvxfer declares "emulated" itself: none at all means stale package metadata.
        known = ", ".join(sorted(named)) or "none installed; reinstall kvxfer (pip install -e .)"
        raise BackendError(
            f"unknown RBLN adapter {choice!r}: use 'nixl_rbln', 'module:factory' or a name "
            f"from the {ADAPTER_GROUP} entry points ({known})"
        )
    try:
        return named[choice].load()
    except (ImportError, AttributeError) as exc:
        raise BackendError(
            f"RBLN adapter {choice!r} ({named[choice].value}) not found: {exc}"
        ) from exc


def load_adapter(selection: str | None = None) -> RblnAdapter:
    """Load the RBLN adapter named by ``selection`` (see the module docstring).

    Raises:
        MissingDependency: nixl-rbln is not importable (the real adapter was asked for);
            its ``name`` is ``"nixl_rbln"``.
        BackendError: an unknown selection, or a factory not returning an adapter.
    """
    choice = (selection or "nixl_rbln").strip()
    if choice == "nixl_rbln":
        try:
            module = importlib.import_module("nixl_rbln")
        except ImportError as exc:
            raise MissingDependency(
                'nixl-rbln is required for kv_buffer_device "rbln" (device-to-device), but '
                f"the Python module nixl_rbln could not be imported ({exc}); install nixl-rbln "
                'with the RBLN SDK, or use kv_buffer_device "cpu" (host bounce over UCX)',
                name="nixl_rbln",
            ) from exc
        factory = getattr(module, "kvxfer_adapter", None)
        adapter = factory() if callable(factory) else NixlAgentAdapter("RBLN")
    else:
        factory = _factory(choice)
        if not callable(factory):
            raise BackendError(f"RBLN adapter {choice!r} is not callable")
        adapter = factory()
    if not isinstance(adapter, RblnAdapter):
        raise BackendError(f"RBLN adapter {choice!r} does not implement kvxfer's RblnAdapter")
    return adapter


def _selection(options: BackendOptions) -> str | None:
    return options.extra.get("rbln_adapter") or os.environ.get(ADAPTER_ENV) or None


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
        what = f"{self.adapter.description}: could not start agent {options.agent_name}"
        with map_nixl_errors(NixlCall.START, what), stall_limit(options.stall_limit_s):
            agent = self.adapter.create_agent(
                options.agent_name,
                rails=options.rails,
                stripe_width=options.stripe_width,
                progress_thread=options.progress_thread,
            )
        log.info("RBLN NIXL: agent %s on %s", options.agent_name, self.adapter.description)
        super().__init__(options, agent, self.adapter.description)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name=self.name,
            mem_kinds=frozenset({MemKind.VRAM, MemKind.DRAM}),
            device_to_device=True,
            merges_contiguous=True,
            guard=True,
            address_runs=self._posts_runs,
            log_prefix="RBLN NIXL (D2D): ",
        )
