"""A bad ``--kv-transfer-config`` stops a real ``vllm serve`` at start-up with the key,
value and rule in its log (R-VLLM-2).

The cheapest real start-up: every bad server starts at once (they overlap their
import time) and each test waits only for its own server's exit. kvxfer's checks run
in the connector's constructor, the first connector code vLLM runs in the engine
core, before any KV memory is allocated or registered; ``kv_role`` is vLLM's own
check, in the API server while it parses arguments.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .pd import kv_config
from .servers import VllmServer, free_port, start_server

pytestmark = pytest.mark.e2e

# name -> (kv-transfer-config, fragments its log must contain)
BAD: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "kv_role_missing": (
        {"kv_connector": "RblnNixlPullConnector", "kv_buffer_device": "cpu"},
        ("Please specify kv_role",),
    ),
    "buffer_device_cuda": (
        kv_config("kv_producer", buffer_device="cuda"),
        ("ConfigError: kv_buffer_device='cuda'", "set kv_buffer_device explicitly"),
    ),
    "link_down_exit_on_consumer": (
        kv_config("kv_consumer", extra={"link_down_exit_s": 30}),
        (
            "ConfigError: kv_connector_extra_config.link_down_exit_s=30",
            "only valid with kv_role 'kv_producer'",
        ),
    ),
    "stripe_width_2": (
        kv_config("kv_producer", extra={"stripe_width": 2}),
        ("ConfigError: kv_connector_extra_config.stripe_width=2", "other widths are not"),
    ),
    # R-HYB-2: a mode the model's KV cache groups cannot support (the tiny Qwen2 has
    # no sliding-window layer), refused before nixl-rbln is even looked for.
    "swa_window_mode_without_sliding_window": (
        kv_config("kv_producer", buffer_device="rbln", extra={"swa_window_mode": True}),
        (
            "ConfigError: kv_connector_extra_config.swa_window_mode=True",
            "needs a sliding-window KV cache group",
        ),
    ),
    "rbln_without_nixl_rbln": (
        kv_config("kv_producer", buffer_device="rbln"),
        ('nixl-rbln is required for kv_buffer_device "rbln"',),
    ),
}


@pytest.fixture(scope="module")
def bad_servers(tiny_model_dir: Path, e2e_log_dir: Path) -> Iterator[dict[str, VllmServer]]:
    servers = {
        name: start_server(
            f"bad-{name}",
            tiny_model_dir,
            e2e_log_dir,
            kv_transfer_config=cfg,
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
            wait=False,
        )
        for name, (cfg, _) in BAD.items()
    }
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop(grace_s=3.0)


@pytest.mark.parametrize("name", list(BAD))
def test_bad_config_stops_the_server_with_key_value_and_rule(
    name: str, bad_servers: dict[str, VllmServer]
) -> None:
    server = bad_servers[name]
    status = server.wait_exit(timeout_s=180)
    assert status != 0
    log = server.log_text()
    for fragment in BAD[name][1]:
        assert fragment in log, f"{name}: {fragment!r} not in the log:\n{log[-4000:]}"
    # Refused before any KV memory was registered with a transfer backend.
    assert "kvxfer: registered" not in log
