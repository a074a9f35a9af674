"""kvxfer's vLLM adapter: KV connectors for vLLM's ``KVConnectorBase_V1``.

Import it as ``kvxfer.adapters.vllm`` (never as the top-level ``adapters`` folder).
Two rooms that share no code: the connector (``connector``, ``scheduler``, ``worker``,
``params``, ``startup``, ``stats``, ``plugin``) and ``kvxfer proxy``
(:mod:`kvxfer.adapters.vllm.proxy`). See docs/VLLM_ADAPTER_NOTES.md.
The connector classes load lazily: importing this package (as vLLM's plugin loader
does in every process, including the API server) pulls in neither vLLM nor torch.

Two ways to select a connector::

    # through the vllm.general_plugins entry point (kvxfer installed):
    --kv-transfer-config '{"kv_connector": "RblnNixlPullConnector", ...}'

    # without the plugin (e.g. VLLM_PLUGINS set to something else):
    --kv-transfer-config '{"kv_connector": "RblnNixlPullConnector",
                           "kv_connector_module_path": "kvxfer.adapters.vllm", ...}'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvxfer.adapters.vllm.plugin import CONNECTOR_MODULE, CONNECTOR_NAMES

__all__ = [
    "CONNECTOR_MODULE",
    "CONNECTOR_NAMES",
    "RblnNixlConnector",
    "RblnNixlPullConnector",
    "RblnNixlPushConnector",
]


def __getattr__(name: str) -> Any:
    if name in CONNECTOR_NAMES:
        value = getattr(importlib.import_module(CONNECTOR_MODULE), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover - names for type checkers
    from kvxfer.adapters.vllm.connector import (
        RblnNixlConnector,
        RblnNixlPullConnector,
        RblnNixlPushConnector,
    )
