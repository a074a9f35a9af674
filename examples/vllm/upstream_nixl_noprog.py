"""Upstream's ``NixlConnector`` with NIXL's progress thread off (for the TTFT benchmark).

vLLM 0.32's NixlConnector builds its NIXL agent with the library's default
``enable_prog_thread=True``; on these CPU-only hosts that thread busy-polls about one
core even when idle, which takes a core from the other engine on a 2-core box and
makes any comparison with it say more about the spinning than about the transfers.
The connector exposes no key for it, so this module wraps the config factory its
worker module imported, turning that one default off, and re-exports the class
unchanged. Select it with::

    {"kv_connector": "NixlConnector",
     "kv_connector_module_path": "examples.vllm.upstream_nixl_noprog", ...}

Without the thread, UCX progresses when the connector polls its transfers and
notifications, which it does every engine step. (The other change that makes the
comparison fair, undoing the worker's pinning of itself to the last core, is done from
outside by the benchmark: ``examples/vllm/pd_ttft.py`` resets every thread's CPU
affinity once the server is up.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

__all__ = ["NixlConnector"]

_factory: Callable[..., Any] | None = getattr(base_worker, "nixl_agent_config", None)


def _without_progress_thread(*args: Any, **kwargs: Any) -> Any:
    assert _factory is not None
    kwargs.setdefault("enable_prog_thread", False)
    return _factory(*args, **kwargs)


if _factory is not None:
    setattr(base_worker, "nixl_agent_config", _without_progress_thread)  # noqa: B010
