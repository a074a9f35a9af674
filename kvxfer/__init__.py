"""kvxfer: move a prompt's KV cache from a prefill instance into a decode instance.

``import kvxfer`` is light: it loads the pure core lazily and never imports nixl,
torch, zmq, pyverbs or vllm. Those load where they are used.

The embedding API in one glance::

    from kvxfer import Agent, AgentConfig, Direction, Fingerprint, Role

    fingerprint = Fingerprint(model="org/model", dtype="bfloat16", kv_cache_dtype="bfloat16",
                              attention_backend="my-engine", direction=Direction.PULL)
    config = AgentConfig(engine_id="prefill-0", fingerprint=fingerprint, role=Role.PRODUCER,
                         direction=fingerprint.direction,  # must equal it
                         side_channel_host="10.0.0.12")  # routable: it goes into tickets
    with Agent(config) as agent:
        # per layer (2, num_blocks, block_size, kv_heads, head_dim); kept alive until close
        agent.register_tensors(kv_caches, block_size=16)
        agent.serve()
        ticket = agent.hold("req-1", block_ids, num_tokens)   # to the router
        ...

docs/EMBEDDING.md has the lifecycle, threads, memory rules and every config field.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvxfer._version import PROTOCOL_VERSION as PROTOCOL_VERSION
from kvxfer._version import __version__ as __version__
from kvxfer.errors import *
from kvxfer.errors import __all__ as _errors_all

# Public name -> module that defines it; imported on first attribute access so that
# `import kvxfer` stays cheap (numpy and msgspec load only when needed).
_LAZY: dict[str, str] = {
    # layout
    "KVLayout": "kvxfer.core.layout",
    "Region": "kvxfer.core.layout",
    "Group": "kvxfer.core.layout",
    "GroupKind": "kvxfer.core.layout",
    "SplitAxis": "kvxfer.core.layout",
    "MemKind": "kvxfer.core.layout",
    "KVPart": "kvxfer.core.layout",
    # descriptors
    "DescriptorTable": "kvxfer.core.descriptors",
    "Plan": "kvxfer.core.descriptors",
    "PlanOptions": "kvxfer.core.descriptors",
    "build_plan": "kvxfer.core.descriptors",
    "chunk_size": "kvxfer.core.descriptors",
    # compat
    "Fingerprint": "kvxfer.core.compat",
    "check_layout": "kvxfer.core.compat",
    # engine-neutral vocabulary
    "Role": "kvxfer.types",
    "Direction": "kvxfer.types",
    # runtime
    "Agent": "kvxfer.agent",
    "AgentConfig": "kvxfer.agent",
    "PushPost": "kvxfer.agent",
    "Ticket": "kvxfer.agent",
    "Transfer": "kvxfer.transfer",
    "TransferState": "kvxfer.transfer",
    "TransferStats": "kvxfer.transfer",
}

__all__ = [
    "PROTOCOL_VERSION",
    "__version__",
    *_errors_all,
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvxfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover - names for type checkers and IDEs
    # "X as X": an explicit re-export, so `from kvxfer import Agent` passes
    # mypy --strict (no_implicit_reexport) in the user's code.
    from kvxfer.agent import Agent as Agent
    from kvxfer.agent import AgentConfig as AgentConfig
    from kvxfer.agent import PushPost as PushPost
    from kvxfer.agent import Ticket as Ticket
    from kvxfer.core.compat import Fingerprint as Fingerprint
    from kvxfer.core.compat import check_layout as check_layout
    from kvxfer.core.descriptors import DescriptorTable as DescriptorTable
    from kvxfer.core.descriptors import Plan as Plan
    from kvxfer.core.descriptors import PlanOptions as PlanOptions
    from kvxfer.core.descriptors import build_plan as build_plan
    from kvxfer.core.descriptors import chunk_size as chunk_size
    from kvxfer.core.layout import Group as Group
    from kvxfer.core.layout import GroupKind as GroupKind
    from kvxfer.core.layout import KVLayout as KVLayout
    from kvxfer.core.layout import KVPart as KVPart
    from kvxfer.core.layout import MemKind as MemKind
    from kvxfer.core.layout import Region as Region
    from kvxfer.core.layout import SplitAxis as SplitAxis
    from kvxfer.transfer import Transfer as Transfer
    from kvxfer.transfer import TransferState as TransferState
    from kvxfer.transfer import TransferStats as TransferStats
    from kvxfer.types import Direction as Direction
    from kvxfer.types import Role as Role
