"""DRAFT — kvxfer's KV connectors for vLLM 0.32 (``KVConnectorBase_V1``).

Status: a draft written before the kvxfer Agent existed, against the Agent API in
docs/DESIGN.md and the facts in docs/VLLM_ADAPTER_NOTES.md. It imports and
type-checks; it has NOT been run end to end and is not claimed to work. The lead
finishes it once the Agent lands.

Layout of the adapter:

* this module: the thin facade vLLM instantiates (one instance per role: SCHEDULER
  in the engine core, WORKER in each worker process; with vLLM's uni-process
  executor both live in the engine-core process, as two separate objects);
* :mod:`~kvxfer.adapters.vllm.scheduler`: per-request state and ticket params, no
  vLLM imports;
* :mod:`~kvxfer.adapters.vllm.worker`: KV tensors -> layout -> Agent calls.

Connectors: :class:`RblnNixlPullConnector` (consumer READs), :class:`RblnNixlPushConnector`
(experimental; producer WRITEs) and :class:`RblnNixlConnector` (the pull connector
under its historical name). Hybrid (sliding-window) models: not supported by this
draft; the classes do not subclass vLLM's ``SupportsHMA``, so vLLM turns its hybrid
KV cache manager off for them (all layers share one block table; sliding-window
layers then keep every block), and refuses to start when the user forces it on with
``--no-disable-hybrid-kv-cache-manager``.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvxfer.adapters.vllm.plugin import attach_to_vllm_logging
from kvxfer.adapters.vllm.scheduler import SchedulerSide, StepPlan
from kvxfer.adapters.vllm.worker import WorkerSide
from kvxfer.config import BufferDevice, Direction, TransferConfig, parse_kv_transfer_config
from kvxfer.layout import KVLayout

__all__ = [
    "KvxferConnectorMetadata",
    "KvxferConnectorStats",
    "KvxferHandshakeMetadata",
    "RblnNixlConnector",
    "RblnNixlPullConnector",
    "RblnNixlPushConnector",
]

log = logging.getLogger("kvxfer.adapters.vllm")
attach_to_vllm_logging()  # also when loaded by kv_connector_module_path, without the plugin

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


@dataclasses.dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> worker, once per step (pickled across processes by vLLM)."""

    plan: StepPlan


@dataclasses.dataclass
class KvxferHandshakeMetadata(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """Worker -> scheduler, once after registration: where peers reach the agent."""

    host: str
    port: int
    incarnation: int


@dataclasses.dataclass
class KvxferConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Per-interval transfer counters; vLLM aggregates them over ranks and steps,
    then logs ``reduce()`` as "KV Transfer metrics: ..." on the API server."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvxferConnectorStats:
        for key, value in (other.data or {}).items():
            if isinstance(value, list):
                self.data.setdefault(key, []).extend(value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        times = [float(t) for t in self.data.get("transfer_s", [])]
        out: dict[str, int | float] = {
            "num_transfers": int(self.data.get("num_transfers", 0)),
            "num_failed": int(self.data.get("num_failed", 0)),
            "MiB": round(float(self.data.get("bytes", 0)) / 2**20, 3),
        }
        if times:
            out["avg_transfer_ms"] = round(1e3 * statistics.fmean(times), 3)
            out["p50_transfer_ms"] = round(1e3 * statistics.median(times), 3)
            out["max_transfer_ms"] = round(1e3 * max(times), 3)
        return out

    def is_empty(self) -> bool:
        return not self.data.get("num_transfers")


def parse_vllm_config(vllm_config: Any) -> TransferConfig:
    """kvxfer's typed config from vLLM's; raises ConfigError(key, value, rule).

    vLLM fills ``kv_buffer_device`` with the platform's device type when the user
    leaves it out ("cpu" on the CPU platform) and ``engine_id`` with a fresh uuid.
    """
    kvt = vllm_config.kv_transfer_config
    mapping = {name: getattr(kvt, name, None) for name in _CONFIG_FIELDS}
    return parse_kv_transfer_config({k: v for k, v in mapping.items() if v is not None})


class _RblnNixlBase(KVConnectorBase_V1):  # type: ignore[misc]
    """The facade shared by the pull and push connectors."""

    direction: ClassVar[Direction] = Direction.PULL
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = parse_vllm_config(vllm_config)
        if self.cfg.direction is not self.direction:
            # e.g. kv_connector names the push class but module path resolved pull
            log.warning(
                "kvxfer: kv_connector %s implies %s but %s was loaded",
                self.cfg.connector,
                self.cfg.direction.value,
                type(self).__name__,
            )
        self.engine_id: str = str(vllm_config.kv_transfer_config.engine_id)
        self.block_size: int = int(vllm_config.cache_config.block_size)
        extra = self.cfg.extra_passthrough
        lease_s = float(extra.get("kv_lease_duration", 30))
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(
                engine_id=self.engine_id,
                role=self.cfg.role,
                direction=self.direction,
                block_size=self.block_size,
                lease_s=lease_s,
                tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
            )
        else:
            self._worker = WorkerSide(
                self.cfg,
                agent_factory=self._make_agent,
                defer_registration=self.cfg.device_to_device,
            )
        self._lease_s = lease_s

    # -- agent construction (worker process) -------------------------------------------
    def _make_agent(self, layout: KVLayout) -> Any:
        from vllm import envs
        from vllm.platforms import current_platform

        from kvxfer.agent import Agent, AgentConfig
        from kvxfer.compat import Fingerprint

        vc = self._vllm_config
        mc, cc = vc.model_config, vc.cache_config
        dtype = str(mc.dtype).removeprefix("torch.")
        kv_dtype = dtype if cc.cache_dtype in (None, "auto") else str(cc.cache_dtype)
        spec = vc.speculative_config
        draft = ""
        if spec is not None and getattr(spec, "draft_model_config", None) is not None:
            draft = str(spec.draft_model_config.model)
        fingerprint = Fingerprint(
            model=str(mc.model),
            revision=str(mc.revision or ""),
            dtype=dtype,
            kv_cache_dtype=kv_dtype,
            # TODO: the resolved attention backend name (the worker's attn groups).
            attention_backend=f"{current_platform.device_type}:{layout.kv_layout}",
            direction=self.direction,
            draft_model=draft,
        )
        # Host bounce ("cpu"): on vLLM's CPU platform the KV cache is host memory,
        # which host_bounce reaches by address; on an accelerator it needs a block
        # copy op (TODO: hand the Agent backends.host_bounce.torch_copy_op(tensors) or
        # the engine's op from set_host_xfer_buffer_ops; vLLM's own op is unusable on
        # the CPU platform, see docs/VLLM_ADAPTER_NOTES.md section 7).
        backend = "nixl_rbln" if self.cfg.buffer_device is BufferDevice.RBLN else "host_bounce"
        tp_rank = _tp_rank()
        dp_index = int(getattr(vc.parallel_config, "data_parallel_index", 0) or 0)
        tp_size = int(vc.parallel_config.tensor_parallel_size)
        port = int(envs.VLLM_NIXL_SIDE_CHANNEL_PORT) + dp_index * tp_size + tp_rank
        config = AgentConfig(
            engine_id=self.engine_id,
            fingerprint=fingerprint,
            role=self.cfg.role,
            direction=self.direction,
            backend=backend,
            side_channel_host=str(envs.VLLM_NIXL_SIDE_CHANNEL_HOST),
            side_channel_port=port,
            plan=self.cfg.plan_options(int(vc.scheduler_config.max_num_batched_tokens)),
            push_stream=self.cfg.push_stream,
            enforce_handshake_compat=self.cfg.enforce_handshake_compat,
            lease_s=self._lease_s,
            stripe_width=self.cfg.stripe_width,
        )
        try:
            return Agent(config)
        except ImportError as exc:
            if backend == "nixl_rbln":
                log.error("RBLN NIXL: nixl-rbln not available (%s)", exc)
            raise

    # ==================================================================================
    # Worker side
    # ==================================================================================
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(
            kv_caches,
            block_size=self.block_size,
            num_blocks=int(self._kv_cache_config.num_blocks),
            kv_layout=str(self._kv_cache_config.kv_cache_layout or "LBHNC"),
        )

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        if self._worker is not None:
            self._worker.set_copy_op(copy_operation)

    def get_handshake_metadata(self) -> KvxferHandshakeMetadata | None:
        if self._worker is None:
            return None
        info = self._worker.handshake_info()
        return None if info is None else KvxferHandshakeMetadata(**info)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferConnectorMetadata)
        self._worker.start_step(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # whole-request transfers between steps, never layer by layer

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # pull: the consumer reads; push: the Agent writes on hold()

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving, failed = self._worker.transfer_results()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self._worker is None else self._worker.block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KvxferConnectorStats | None:
        if self._worker is None:
            return None
        data = self._worker.interval_stats()
        return None if data is None else KvxferConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KvxferConnectorStats | None:
        return KvxferConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # ==================================================================================
    # Scheduler side
    # ==================================================================================
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self._sched is None or not metadata:
            return
        rank0 = metadata.get(0) or next(iter(metadata.values()))
        if isinstance(rank0, KvxferHandshakeMetadata):
            self._sched.set_endpoint(rank0.host, rank0.port, rank0.incarnation)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._sched is not None
        unhashed = blocks.get_unhashed_block_ids_all_groups() if num_external_tokens > 0 else []
        # Leading blocks that are local prefix-cache hits carry a hash; the load skips
        # them on the remote side too.
        first_group = blocks.blocks[0] if blocks.blocks else ()
        hits = sum(1 for b in first_group if b.block_hash is not None and not b.is_null)
        self._sched.update_state_after_alloc(
            request, unhashed, num_external_tokens, hits * self.block_size
        )

    def build_connector_meta(self, scheduler_output: Any) -> KvxferConnectorMetadata:
        assert self._sched is not None
        return KvxferConnectorMetadata(plan=self._sched.build_step_plan())

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._sched is not None
        self._sched.update_connector_output(
            connector_output.finished_sending,
            connector_output.finished_recving,
            getattr(connector_output, "failed_recving", None),
        )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, [block_ids])

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_push_work()


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


class RblnNixlPullConnector(_RblnNixlBase):
    """Pull: the decode instance READs the prompt's KV from the prefill instance."""

    direction: ClassVar[Direction] = Direction.PULL


class RblnNixlPushConnector(_RblnNixlBase):
    """Push (experimental): the prefill instance WRITEs into blocks decode registered."""

    direction: ClassVar[Direction] = Direction.PUSH


class RblnNixlConnector(RblnNixlPullConnector):
    """The pull connector under the name existing deployments use."""
