"""``ucx`` backend: NIXL's UCX transport on registered memory (R-BE-2).

Descriptor tables are prepared once (the local one at registration, a peer's once per
peer incarnation); each request then posts only two index arrays. NIXL merges
descriptors contiguous on both sides while building the request, which is what makes
paged KV with contiguous block runs fast. The handle bookkeeping and the teardown
order are :class:`~kvxfer.backends._agent_backend.AgentBackend`'s, shared with
``nixl_rbln``; the NIXL agent with the UCX plugin comes from
:func:`~kvxfer.backends._nixl.start_plugin_agent`.
"""

from __future__ import annotations

import os
from typing import ClassVar

from kvxfer.backend import BackendOptions, Capabilities
from kvxfer.backends._agent_backend import AgentBackend, merged_intervals
from kvxfer.backends._nixl import import_nixl, stall_limit, start_plugin_agent
from kvxfer.core.layout import MemKind

__all__ = ["UcxBackend", "import_nixl", "merged_intervals"]

_NIXL_MEM = {MemKind.DRAM: "DRAM", MemKind.VRAM: "VRAM"}


class UcxBackend(AgentBackend):
    """NIXL agent with the UCX plugin (host DRAM; device memory where UCX supports it)."""

    name: ClassVar[str] = "ucx"
    _plugin: ClassVar[str] = "UCX"

    def __init__(self, options: BackendOptions) -> None:
        import_nixl()  # the install hint before anything else
        if options.rails:
            # UCX reads its device list at context creation: pin the data plane to the
            # selected rails (and stripe or not, R-RAIL-3) before the agent exists.
            from kvxfer.io.rails import ucx_environment

            os.environ.update(ucx_environment(options.rails, options.stripe_width))
        # NIXL's progress thread spins a core while idle; the agent polls instead.
        with stall_limit(options.stall_limit_s):
            agent = start_plugin_agent(
                options.agent_name,
                self._plugin,
                params={},
                progress_thread=options.progress_thread,
                mem_names=_NIXL_MEM,
            )
        super().__init__(options, agent, f"NIXL plugin {self._plugin}")

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name=self.name,
            mem_kinds=frozenset({MemKind.DRAM, MemKind.VRAM}),
            device_to_device=False,
            merges_contiguous=True,
            guard=True,
            address_runs=self._posts_runs,
        )
