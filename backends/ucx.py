"""``ucx`` backend: NIXL's UCX transport on registered memory (R-BE-2).

Descriptor tables are prepared once (the local one at registration, a peer's once per
peer incarnation); each request then posts only two index arrays. NIXL merges
descriptors contiguous on both sides while building the request, which is what makes
paged KV with contiguous block runs fast. The handle bookkeeping and the teardown
order are :class:`~kvxfer.backends._agent_backend.AgentBackend`'s, shared with
``nixl_rbln``; this module makes the NIXL agent with the UCX plugin.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from kvxfer.backend import BackendOptions, Capabilities
from kvxfer.backends._agent_backend import AgentBackend, merged_intervals
from kvxfer.backends.rbln_adapter import NixlPluginAgent
from kvxfer.errors import BackendError, missing_dependency
from kvxfer.layout import MemKind

__all__ = ["UcxBackend", "import_nixl", "merged_intervals"]

_NIXL_MEM = {MemKind.DRAM: "DRAM", MemKind.VRAM: "VRAM"}


def import_nixl() -> Any:
    """Import NIXL's Python API or raise the install hint."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise missing_dependency("nixl", "nixl", exc) from exc
    return nixl_agent, nixl_agent_config


class UcxBackend(AgentBackend):
    """NIXL agent with the UCX plugin (host DRAM; device memory where UCX supports it)."""

    name: ClassVar[str] = "ucx"
    _plugin: ClassVar[str] = "UCX"

    def __init__(self, options: BackendOptions) -> None:
        nixl_agent, nixl_agent_config = import_nixl()
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
            agent: Any = nixl_agent(options.agent_name, conf)
        except Exception as exc:  # NIXL raises bare RuntimeError/nixlBind errors
            raise BackendError(f"could not start a NIXL agent with {self._plugin}: {exc}") from exc
        if self._plugin not in agent.backends:
            raise BackendError(
                f"NIXL has no {self._plugin} plugin here (plugins: {agent.plugin_list})"
            )
        super().__init__(
            options, NixlPluginAgent(agent, self._plugin, _NIXL_MEM), f"NIXL plugin {self._plugin}"
        )

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name=self.name,
            mem_kinds=frozenset({MemKind.DRAM, MemKind.VRAM}),
            device_to_device=False,
            merges_contiguous=True,
        )
