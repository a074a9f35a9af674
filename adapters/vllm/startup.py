"""Start-up checks of the vLLM connectors, importable without vLLM or torch.

Everything here runs in the connector's constructor, the first connector code vLLM
runs in its engine core, so a refusal stops the server before any KV memory is
registered, with the key, value and rule (``ConfigError``), R-RAIL-2's NIC report
(``RailError``) or the missing package's install hint (``MissingDependency``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvxfer.adapters.vllm.kv_transfer_config import TransferConfig, parse_kv_transfer_config
from kvxfer.agent import PushPost
from kvxfer.errors import ConfigError

__all__ = [
    "AUTH_SECRET_ENV",
    "LEASE_KEY",
    "PUSH_POST_KEY",
    "TIMEOUT_KEY",
    "check_model_support",
    "data_plane_rails",
    "parse_vllm_config",
    "positive_seconds",
    "push_post",
    "require_nixl_rbln",
]

log = logging.getLogger("kvxfer.adapters.vllm")

#: Environment variable with the side channel's shared secret (>= 16 bytes; both
#: instances of a pair need the same). Unset: unauthenticated, with a warning.
AUTH_SECRET_ENV = "KVXFER_AUTH_SECRET"

# vLLM's KVTransferConfig fields kvxfer's parser sees (the rest is vLLM's business).
_CONFIG_FIELDS = (
    "kv_connector",
    "kv_role",
    "kv_buffer_device",
    "engine_id",
    "kv_connector_extra_config",
    "kv_connector_module_path",
    "kv_load_failure_policy",
)
# kv_connector_extra_config keys the adapter reads besides the core parser's own (the
# parser passes them through; they are checked here): upstream NIXL's lease length,
# and how long a consumer waits for a load before failing it.
LEASE_KEY = "kv_lease_duration"  # seconds a producer holds blocks (default 30, as upstream)
TIMEOUT_KEY = "transfer_timeout_s"  # seconds before a pending load fails (default 30)
PUSH_POST_KEY = "push_post"  # which thread posts a push producer's writes (PushPost)


def parse_vllm_config(vllm_config: Any) -> TransferConfig:
    """kvxfer's typed config from vLLM's; raises ConfigError(key, value, rule).

    vLLM fills ``kv_buffer_device`` with the platform's device type when the user
    leaves it out ("cpu" on the CPU platform) and ``engine_id`` with a fresh uuid.
    """
    kvt = vllm_config.kv_transfer_config
    mapping = {name: getattr(kvt, name, None) for name in _CONFIG_FIELDS}
    return parse_kv_transfer_config({k: v for k, v in mapping.items() if v is not None})


def positive_seconds(cfg: TransferConfig, key: str, default: float) -> float:
    value = cfg.extra_passthrough.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"kv_connector_extra_config.{key}", value, "must be a number > 0")
    return float(value)


def push_post(cfg: TransferConfig) -> PushPost:
    """``kv_connector_extra_config.push_post``: "auto" (default), "engine" or "writer"."""
    value = cfg.extra_passthrough.get(PUSH_POST_KEY, PushPost.AUTO.value)
    try:
        return PushPost(value)
    except ValueError:
        choices = ", ".join(repr(p.value) for p in PushPost)
        raise ConfigError(
            f"kv_connector_extra_config.{PUSH_POST_KEY}", value, f"must be one of {choices}"
        ) from None


def check_model_support(cfg: TransferConfig, kv_cache_config: Any) -> None:
    """Refuse, at start-up, what the connectors cannot move exactly.

    Raises:
        ConfigError: the cache has several KV cache groups (vLLM's hybrid manager is
            on), or ``swa_window_mode`` is set (it needs that manager).
    """
    if cfg.swa_window_mode:
        raise ConfigError(
            "kv_connector_extra_config.swa_window_mode",
            True,
            "needs vLLM's hybrid KV cache manager, which kvxfer's vLLM connectors do "
            "not support (vLLM runs them with --disable-hybrid-kv-cache-manager: "
            "sliding-window layers keep every block); remove the key",
        )
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) > 1:
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        raise ConfigError(
            "kv_cache_groups",
            len(groups),
            f"kvxfer's vLLM connectors move one KV cache group, got {len(groups)} "
            f"({kinds}): start vLLM with --disable-hybrid-kv-cache-manager",
        )


def data_plane_rails(
    cfg: TransferConfig,
    *,
    sysfs_root: str = "/sys",
    runner: Any = None,
    pyverbs: Any = True,
    numa_node: int | None = None,
) -> tuple[Any, ...]:
    """The RDMA rails this instance's data plane uses (R-RAIL-1/2).

    A host without RDMA devices runs without rails (UCX picks its own transports;
    logged). A host with RDMA devices must have a qualifying one on the accelerator's
    NUMA node, or start-up fails with R-RAIL-2's message.

    Raises:
        RailError: RDMA devices present, none qualifies (or the NUMA node is unknown).
    """
    from kvxfer.rails import accelerator_numa, discover, evaluate

    found = discover(sysfs_root=sysfs_root, runner=runner, pyverbs=pyverbs)
    if not found.ports:
        log.info(
            "kvxfer: no RDMA devices on this host; the data plane runs without rails "
            "(UCX chooses its transports)"
        )
        return ()
    numa = accelerator_numa(numa_node=numa_node, sysfs_root=sysfs_root, runner=runner)
    rails = evaluate(found, numa.node).require()
    log.info(
        "kvxfer: rails %s on numa=%d (%s)%s",
        ", ".join(r.name for r in rails),
        numa.node,
        numa.source,
        " (stripe_width 0: all of them per transfer)" if cfg.all_rails else "",
    )
    return rails


def require_nixl_rbln() -> None:
    """Device-to-device needs nixl-rbln: fail start-up now, with its install hint.

    Raises:
        MissingDependency: nixl-rbln (or the adapter ``KVXFER_RBLN_ADAPTER`` names)
            cannot be loaded.
    """
    from kvxfer.backends.nixl_rbln import ADAPTER_ENV, load_adapter

    try:
        load_adapter(os.environ.get(ADAPTER_ENV) or None)
    except ImportError as exc:
        log.error("RBLN NIXL (D2D): cannot start: %s", exc)
        raise
