"""A bad ``--kv-transfer-config`` stops a real ``vllm serve`` at start-up with the key,
value and rule in its log (R-VLLM-2).

Each test waits for its own server's exit; the next test's server starts meanwhile
(two start-ups at a time, see ``_Staggered``). kvxfer's checks run
in the connector's constructor, the first connector code vLLM runs in the engine
core, before any KV memory is allocated or registered; ``kv_role`` is vLLM's own
check, in the API server while it parses arguments.

One server per way a start-up can be refused, not per rule: vLLM's own check; a
rule of the connector's configuration (every such rule is the same parse in the same
constructor, each tested in-process with its message in
``tests/test_kv_transfer_config.py``); a rule that needs the model's KV cache groups
from vLLM (``check_model_support``); a backend that cannot load. A start-up costs
~20 CPU-seconds here, and the suite shares two cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .pd import kv_config
from .servers import VllmServer, free_port, start_server

# Its servers start from the tiny model alone (no shared engine): see own_servers.
pytestmark = [pytest.mark.e2e, pytest.mark.own_servers]

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


class _Staggered:
    """The bad servers, started in test order with at most ``ahead`` starting at once:
    the current test's and the next one's. Six vLLM start-ups at once (two processes
    each, ~30 s of CPU apiece) left each of them a third of a core on these 2 cores,
    and on a loaded host some outlasted their timeout; two at a time keeps each one's
    start-up near its own cost while the next one overlaps it."""

    def __init__(self, tiny_model_dir: Path, log_dir: Path, ahead: int = 2) -> None:
        self._model, self._logs, self._ahead = tiny_model_dir, log_dir, ahead
        self._names = list(BAD)
        self.servers: dict[str, VllmServer] = {}

    def _start(self, name: str) -> None:
        if name not in self.servers:
            self.servers[name] = start_server(
                f"bad-{name}",
                self._model,
                self._logs,
                kv_transfer_config=BAD[name][0],
                env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
                wait=False,
            )

    def get(self, name: str) -> VllmServer:
        i = self._names.index(name)
        for ahead in self._names[i : i + self._ahead]:
            self._start(ahead)
        return self.servers[name]


@pytest.fixture(scope="module")
def bad_servers(tiny_model_dir: Path, e2e_log_dir: Path) -> Iterator[_Staggered]:
    pool = _Staggered(tiny_model_dir, e2e_log_dir)
    try:
        yield pool
    finally:
        for server in pool.servers.values():
            server.stop(grace_s=3.0)


@pytest.mark.parametrize("name", list(BAD))
def test_bad_config_stops_the_server_with_key_value_and_rule(
    name: str, bad_servers: _Staggered
) -> None:
    server = bad_servers.get(name)
    # Generous: a start-up's own cost is ~30-60 s here; the bound only catches a hang.
    status = server.wait_exit(timeout_s=420)
    assert status != 0
    log = server.log_text()
    for fragment in BAD[name][1]:
        assert fragment in log, f"{name}: {fragment!r} not in the log:\n{log[-4000:]}"
    # Refused before any KV memory was registered with a transfer backend.
    assert "kvxfer: registered" not in log
