"""``kvxfer proxy``: a prefill/decode (P/D) proxy in front of vLLM instances.

Clients talk OpenAI (``/v1/completions``, ``/v1/chat/completions``); the proxy runs
each request through a prefill instance and a decode instance (pull or push mode),
or straight through a decode instance when P/D would not pay (short prompts).
Several instances of each kind are health-checked and load-balanced: prefill by
outstanding prompt tokens with prefix affinity, decode by active requests. Per-stage
latencies are exported at ``/metrics`` (Prometheus) and ``/stats`` (JSON). See
docs/PROXY.md.

Usage::

    kvxfer proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

From Python: :func:`start_proxy` runs one on a background thread and returns
``(url, stop)``; :class:`Proxy` is the asyncio form (``async with Proxy(cfg) as p``).

Why a subpackage of the vLLM adapter: the proxy shares no code with the connector (no
import either way) but speaks only vLLM's dialect — its OpenAI server, its
``/health``, and the ``kv_transfer_params`` the connectors put into responses — so it
belongs with the adapter, in a room of its own. Modules:

* :mod:`~.options`: :class:`ProxyConfig`, each option declared once (flag, help, rule);
* :mod:`~.routing`: pure policies (which route, which instance, prefix affinity);
* :mod:`~.messages`: P/D request parameters, error bodies, the SSE token counter (pure);
* :mod:`~.dispatch`: one client request through prefill and decode over HTTP;
* :mod:`~.metrics`: the proxy's Prometheus series and ``/stats``;
* :mod:`~.server`: the aiohttp server, :func:`start_proxy` and :func:`main`.
"""

from __future__ import annotations

from kvxfer.adapters.vllm.proxy.options import ProxyConfig, build_parser, config_from_args
from kvxfer.adapters.vllm.proxy.server import Proxy, main, start_proxy

__all__ = ["Proxy", "ProxyConfig", "build_parser", "config_from_args", "main", "start_proxy"]
