"""An EMULATION of the nixl-rbln adapter: host memory stands in for RBLN NPU memory.

nixl-rbln is not public and this project has no NPU, so the ``nixl_rbln`` backend is
tested against this emulated adapter. It implements kvxfer's
:class:`~kvxfer.backends.rbln_adapter.RblnAdapter` protocol on *real* NIXL: a NIXL agent
with the UCX plugin between real processes, where memory the layout calls device memory
(``MemKind.VRAM``) is host memory registered with NIXL as DRAM (NIXL's UCX rejects
non-CUDA memory registered as VRAM). Nothing here touches an NPU; the emulation proves
the backend's registration, shard-expanded descriptor lists, index posting,
notifications and teardown, not the RBLN plugin.

Select the emulation with any of::

    NixlRblnBackend(options, adapter=EmulatedRblnAdapter())
    BackendOptions(..., extra={"rbln_adapter": "emulated"})
    KVXFER_RBLN_ADAPTER=emulated        # environment, e.g. for whole processes

``emulated`` is this class's name in the ``kvxfer.rbln_adapters`` entry-point group
(kvxfer's ``pyproject.toml``): production code finds it there by name and never imports
this module.

Every log line it writes starts with ``RBLN emulation:``.
"""

from __future__ import annotations

import logging

from kvxfer.backends.rbln_adapter import NixlAgentAdapter, RblnAgent
from kvxfer.core.layout import MemKind

__all__ = ["EmulatedRblnAdapter"]

log = logging.getLogger("kvxfer.testing.rbln_emulation")


class EmulatedRblnAdapter(NixlAgentAdapter):
    """EMULATED nixl-rbln adapter: NIXL's UCX plugin on host memory posing as NPU memory.

    The rails and stripe width kvxfer hands over are recorded (:attr:`last_rails`,
    :attr:`last_stripe_width`) and logged, not applied: the emulation has no RDMA rails,
    and pinning UCX to device names that do not exist here would break it.
    """

    def __init__(self) -> None:
        super().__init__(
            "UCX",
            mem_names={MemKind.DRAM: "DRAM", MemKind.VRAM: "DRAM"},
            description="RBLN emulation (host memory over NIXL UCX, no NPU)",
            emulated=True,
        )
        self.last_rails: tuple[str, ...] | None = None
        self.last_stripe_width: int | None = None

    def plugin_params(self, rails: tuple[str, ...], stripe_width: int | None) -> dict[str, str]:
        """The emulation passes nothing to UCX (see the class docstring)."""
        return {}

    def create_agent(
        self,
        name: str,
        *,
        rails: tuple[str, ...],
        stripe_width: int | None,
        progress_thread: bool,
    ) -> RblnAgent:
        """Start an emulated agent, recording the rails and stripe width it was given."""
        self.last_rails, self.last_stripe_width = rails, stripe_width
        log.info(
            "RBLN emulation: agent %s on host memory over NIXL UCX (rails=%s, stripe_width=%s "
            "recorded, not applied)",
            name,
            ",".join(rails) or "default",
            stripe_width,
        )
        return super().create_agent(
            name, rails=rails, stripe_width=stripe_width, progress_thread=progress_thread
        )
