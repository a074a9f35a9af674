"""kvxfer's KV connectors for vLLM 0.32 (``KVConnectorBase_V1``).

Layout of the adapter:

* this module: the thin facade vLLM instantiates (one instance per role: SCHEDULER
  in the engine core, WORKER in each worker process; with vLLM's uni-process
  executor both live in the engine-core process, as two separate objects), start-up
  checks (config, model support, rails) and stats/metrics;
* :mod:`~kvxfer.adapters.vllm.scheduler`: per-request state and ticket params, no
  vLLM imports;
* :mod:`~kvxfer.adapters.vllm.worker`: KV tensors -> layout -> Agent calls.

Connectors: :class:`RblnNixlPullConnector` (the consumer READs),
:class:`RblnNixlPushConnector` (experimental; the producer WRITEs) and
:class:`RblnNixlConnector` (the pull connector under its historical name).

Hybrid KV cache manager (sliding-window and SSM models): not supported. The classes
do not subclass vLLM's ``SupportsHMA``, so vLLM turns its hybrid KV cache manager off
for them (``--disable-hybrid-kv-cache-manager`` is implied: every layer shares one
block table, sliding-window layers keep all their blocks, output stays exact); vLLM
refuses to start when the user forces it on with
``--no-disable-hybrid-kv-cache-manager``, and so does kvxfer when a cache still has
several KV groups or ``swa_window_mode`` is asked for.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import statistics
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvxfer.adapters.vllm.plugin import attach_to_vllm_logging
from kvxfer.adapters.vllm.scheduler import SchedulerSide
from kvxfer.adapters.vllm.scheduler import StepPlan as StepPlan
from kvxfer.adapters.vllm.startup import (
    AUTH_SECRET_ENV,
    LEASE_KEY,
    TIMEOUT_KEY,
    check_model_support,
    data_plane_rails,
    parse_vllm_config,
    positive_seconds,
    push_post,
    require_nixl_rbln,
)
from kvxfer.adapters.vllm.worker import WorkerSide
from kvxfer.errors import ConfigError
from kvxfer.layout import KVLayout, MemKind
from kvxfer.types import Direction

__all__ = [
    "KvxferConnectorMetadata",
    "KvxferConnectorStats",
    "KvxferHandshakeMetadata",
    "KvxferPromMetrics",
    "RblnNixlConnector",
    "RblnNixlPullConnector",
    "RblnNixlPushConnector",
]

log = logging.getLogger("kvxfer.adapters.vllm")
attach_to_vllm_logging()  # also when loaded by kv_connector_module_path, without the plugin


@dataclasses.dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> worker, once per step (pickled across processes by vLLM)."""

    plan: StepPlan


@dataclasses.dataclass
class KvxferHandshakeMetadata(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """Worker -> scheduler, once after registration: where peers reach one rank."""

    host: str
    port: int
    incarnation: int
    tp_rank: int = 0


@dataclasses.dataclass
class KvxferConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Per-interval transfer counters (see ``worker._Interval`` for the keys).

    vLLM aggregates them over ranks and steps (numbers add, lists concatenate), logs
    ``reduce()`` as "KV Transfer metrics: ..." on the API server and feeds
    :class:`KvxferPromMetrics`.
    """

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvxferConnectorStats:
        for key, value in (other.data or {}).items():
            if isinstance(value, list):
                self.data[key] = [*self.data.get(key, []), *value]
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        times = [float(t) for t in d.get("transfer_s", [])]
        out: dict[str, int | float] = {
            "num_transfers": int(d.get("num_transfers", 0)),
            "num_failed": int(d.get("num_failed", 0)),
            "MiB": round(float(d.get("bytes", 0)) / 2**20, 3),
        }
        if times:
            out["avg_transfer_ms"] = round(1e3 * statistics.fmean(times), 3)
            out["p50_transfer_ms"] = round(1e3 * statistics.median(times), 3)
            out["max_transfer_ms"] = round(1e3 * max(times), 3)
            seconds = sum(times)
            if seconds > 0:
                out["avg_MiB_per_s"] = round(float(d.get("bytes", 0)) / 2**20 / seconds, 1)
        for key in sorted(d):
            if key.startswith(("failed_", "num_leases_", "num_handshakes", "num_push_")):
                out[key] = int(d[key])
        return out

    def is_empty(self) -> bool:
        return not any(
            v for k, v in self.data.items() if k.startswith("num_") or k.startswith("failed_")
        )


class KvxferPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """kvxfer's Prometheus series, labelled like vLLM's own (model, engine).

    ``vllm:kvxfer_transfers`` / ``vllm:kvxfer_failed_transfers`` (counters, consumer
    loads), ``vllm:kvxfer_bytes`` (counter), ``vllm:kvxfer_transfer_time_seconds``
    (histogram per request) and, on producers, ``vllm:kvxfer_leases_released`` /
    ``vllm:kvxfer_leases_expired`` / ``vllm:kvxfer_leases_aborted`` (and
    ``vllm:kvxfer_push_writes`` in push mode).
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            return {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}

        counter: Any = self._counter_cls
        histogram: Any = self._histogram_cls
        self.transfers = per_engine(
            counter(
                name="vllm:kvxfer_transfers",
                documentation="KV loads settled by kvxfer (done or failed).",
                labelnames=labelnames,
            )
        )
        self.failed = per_engine(
            counter(
                name="vllm:kvxfer_failed_transfers",
                documentation="KV loads kvxfer reported as failed to vLLM.",
                labelnames=labelnames,
            )
        )
        self.bytes = per_engine(
            counter(
                name="vllm:kvxfer_bytes",
                documentation="KV bytes moved by completed kvxfer loads.",
                labelnames=labelnames,
            )
        )
        self.leases_released = per_engine(
            counter(
                name="vllm:kvxfer_leases_released",
                documentation="Producer: held requests freed by their consumer.",
                labelnames=labelnames,
            )
        )
        self.leases_expired = per_engine(
            counter(
                name="vllm:kvxfer_leases_expired",
                documentation="Producer: held requests freed by lease expiry.",
                labelnames=labelnames,
            )
        )
        self.leases_aborted = per_engine(
            counter(
                name="vllm:kvxfer_leases_aborted",
                documentation="Producer: held requests freed because the consumer gave "
                "them up before transferring (request aborted, local prefix hit).",
                labelnames=labelnames,
            )
        )
        self.push_writes = per_engine(
            counter(
                name="vllm:kvxfer_push_writes",
                documentation="Push producer: KV WRITEs completed (push_stream: several "
                "per request).",
                labelnames=labelnames,
            )
        )
        self.transfer_time = per_engine(
            histogram(
                name="vllm:kvxfer_transfer_time_seconds",
                documentation="Per-request KV transfer time (handshake included).",
                buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5],
                labelnames=labelnames,
            )
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        for metric, key in (
            (self.transfers, "num_transfers"),
            (self.failed, "num_failed"),
            (self.bytes, "bytes"),
            (self.leases_released, "num_leases_released"),
            (self.leases_expired, "num_leases_expired"),
            (self.leases_aborted, "num_leases_aborted"),
            (self.push_writes, "num_push_writes"),
        ):
            value = d.get(key, 0)
            if value:
                metric[engine_idx].inc(value)
        for seconds in d.get("transfer_s", []):
            self.transfer_time[engine_idx].observe(float(seconds))


def _attention_backend(vllm_config: Any, fallback: str) -> str:
    """The resolved attention backend's name (part of the compatibility hash)."""
    context = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    names = set()
    for layer in context.values():
        backend = getattr(layer, "attn_backend", None)
        if backend is not None and hasattr(backend, "get_name"):
            names.add(str(backend.get_name()))
    return ",".join(sorted(names)) or fallback


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


class _RblnNixlBase(KVConnectorBase_V1):  # type: ignore[misc]
    """The facade shared by the pull and push connectors."""

    direction: ClassVar[Direction] = Direction.PULL
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # Every start-up refusal is raised here, before any memory is registered:
        # the engine core dies with the message (key, value, rule) in its log.
        self.cfg = parse_vllm_config(vllm_config)
        if self.cfg.direction is not self.direction:
            raise ConfigError(
                "kv_connector",
                self.cfg.connector,
                f"names a {self.cfg.direction.value} connector but vLLM loaded "
                f"{type(self).__name__} ({self.direction.value})",
            )
        check_model_support(self.cfg, kv_cache_config)
        self.engine_id: str = str(vllm_config.kv_transfer_config.engine_id)
        self.block_size: int = int(vllm_config.cache_config.block_size)
        self._lease_s = positive_seconds(self.cfg, LEASE_KEY, 30.0)
        self._transfer_timeout_s = positive_seconds(self.cfg, TIMEOUT_KEY, 30.0)
        self._push_post = push_post(self.cfg)
        self._tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._kv_cache_manager: Any = None
        self._linkmon: Any = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(
                engine_id=self.engine_id,
                role=self.cfg.role,
                direction=self.direction,
                block_size=self.block_size,
                lease_s=self._lease_s,
                tp_size=self._tp_size,
                stage_early=not self.cfg.device_to_device,
                push_stream=self.cfg.push_stream,
            )
        else:
            self._tp_rank = _tp_rank()
            if self.cfg.device_to_device:
                require_nixl_rbln()
            self._rails = tuple(data_plane_rails(self.cfg))
            self._worker = WorkerSide(
                self.cfg,
                agent_factory=self._make_agent,
                tp_rank=self._tp_rank,
                tp_size=self._tp_size,
                defer_registration=self.cfg.device_to_device,
            )
            self._start_link_monitor()

    # -- worker process: rails, link monitor, agent -------------------------------------
    def _start_link_monitor(self) -> None:
        if not self._rails or self.cfg.link_down_exit_s <= 0:
            return
        from kvxfer.linkmon import LinkMonitor, sysfs_link_probe

        self._linkmon = LinkMonitor(sysfs_link_probe(self._rails), self.cfg.link_down_exit_s)
        self._linkmon.start()

    def _make_agent(self, layout: KVLayout) -> Any:
        from vllm import envs
        from vllm.platforms import current_platform

        from kvxfer.agent import Agent, AgentConfig
        from kvxfer.backend import BackendOptions
        from kvxfer.compat import Fingerprint

        vc = self._vllm_config
        mc, cc = vc.model_config, vc.cache_config
        dtype = str(mc.dtype).removeprefix("torch.")
        kv_dtype = dtype if cc.cache_dtype in (None, "auto") else str(cc.cache_dtype)
        spec = vc.speculative_config
        draft = ""
        if spec is not None and getattr(spec, "draft_model_config", None) is not None:
            draft = str(spec.draft_model_config.model)
        served = mc.served_model_name
        model = str(served[0] if isinstance(served, list | tuple) else (served or mc.model))
        fingerprint = Fingerprint(
            model=model,
            revision=str(mc.revision or ""),
            dtype=dtype,
            kv_cache_dtype=kv_dtype,
            attention_backend=_attention_backend(
                vc, f"{current_platform.device_type}:{layout.kv_layout}"
            ),
            direction=self.direction,
            draft_model=draft,
        )
        dp_index = int(getattr(vc.parallel_config, "data_parallel_index", 0) or 0)
        port = int(envs.VLLM_NIXL_SIDE_CHANNEL_PORT) + dp_index * self._tp_size + self._tp_rank
        rails = tuple(r.name for r in self._rails)
        backend_name = "nixl_rbln" if self.cfg.device_to_device else "host_bounce"
        config = AgentConfig(
            engine_id=self.engine_id,
            fingerprint=fingerprint,
            role=self.cfg.role,
            direction=self.direction,
            backend=backend_name,
            side_channel_host=str(envs.VLLM_NIXL_SIDE_CHANNEL_HOST),
            side_channel_port=port,
            plan=self.cfg.plan_options(int(vc.scheduler_config.max_num_batched_tokens)),
            push_stream=self.cfg.push_stream,
            enforce_handshake_compat=self.cfg.enforce_handshake_compat,
            lease_s=self._lease_s,
            transfer_timeout_s=self._transfer_timeout_s,
            auth_secret=os.environ.get(AUTH_SECRET_ENV) or None,
            rails=rails,
            stripe_width=self.cfg.stripe_width,
            push_post=self._push_post,
        )
        backend = None
        if backend_name == "host_bounce" and any(r.mem is not MemKind.DRAM for r in layout.regions):
            # KV cache in device memory: stage with torch copies over the same tensors.
            from kvxfer.backends.host_bounce import HostBounceBackend, torch_copy_op

            assert self._worker is not None
            backend = HostBounceBackend(
                BackendOptions(
                    agent_name=f"{self.engine_id}#r{self._tp_rank}#{secrets.token_hex(8)}",
                    rails=rails,
                    stripe_width=self.cfg.stripe_width,
                ),
                copy_op=torch_copy_op(self._worker.tensors),
            )
        try:
            return Agent(config, backend=backend)
        except ImportError as exc:  # MissingDependency: nixl-rbln or NIXL itself
            log.error("RBLN NIXL (D2D): cannot start: %s", exc)
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
            kv_layout=str(self._kv_cache_config.kv_cache_layout or "NHD"),
        )

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        # vLLM's op copies between its own host buffers and the cache; kvxfer's host
        # bounce stages into the Agent's buffers with its own copies (by address on
        # the CPU platform, torch index copies on devices), so the op is not used.
        return

    def get_handshake_metadata(self) -> KvxferHandshakeMetadata | None:
        if self._worker is None:
            return None
        info = self._worker.handshake_info()
        return None if info is None else KvxferHandshakeMetadata(**info)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        if isinstance(meta, KvxferConnectorMetadata):
            self._worker.start_step(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # whole-request transfers between steps, never layer by layer

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # pull: the consumer reads; push: the Agent writes on hold()

    def wait_for_save(self) -> None:
        # After the forward: stage the prompts it completed (host bounce producer).
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, KvxferConnectorMetadata):
                self._worker.after_forward(meta.plan)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving, failed = self._worker.transfer_results()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Legacy form of :meth:`get_transfer_results` (drains the same results)."""
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

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvxferPromMetrics:
        return KvxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._linkmon is not None:
            self._linkmon.stop()
        if self._worker is not None:
            self._worker.close()

    # ==================================================================================
    # Scheduler side
    # ==================================================================================
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self._sched is None or not metadata:
            return
        ranks = sorted(
            (m for m in metadata.values() if isinstance(m, KvxferHandshakeMetadata)),
            key=lambda m: m.tp_rank,
        )
        if not ranks:
            return
        self._sched.set_endpoint(ranks[0].host, ranks[0].port, [m.incarnation for m in ranks])

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager
        parent = getattr(super(), "bind_kv_cache_manager", None)
        if callable(parent):
            parent(kv_cache_manager)

    def on_new_request(self, request: Any) -> None:
        if self._sched is not None:
            self._sched.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._sched is not None
        unhashed = blocks.get_unhashed_block_ids_all_groups() if num_external_tokens > 0 else []
        # Leading blocks that are local prefix-cache hits carry a hash; the load skips
        # as many remote blocks.
        first_group = blocks.blocks[0] if blocks.blocks else ()
        hits = sum(1 for b in first_group if b.block_hash is not None and not b.is_null)
        self._sched.update_state_after_alloc(
            request, unhashed, num_external_tokens, hits * self.block_size
        )

    def build_connector_meta(self, scheduler_output: Any) -> KvxferConnectorMetadata:
        assert self._sched is not None
        manager = self._kv_cache_manager
        plan = self._sched.build_step_plan(
            getattr(scheduler_output, "num_scheduled_tokens", None),
            manager.get_block_ids if manager is not None else None,
        )
        return KvxferConnectorMetadata(plan=plan)

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


class RblnNixlPullConnector(_RblnNixlBase):
    """Pull: the decode instance READs the prompt's KV from the prefill instance."""

    direction: ClassVar[Direction] = Direction.PULL


class RblnNixlPushConnector(_RblnNixlBase):
    """Push (experimental): the prefill instance WRITEs into blocks decode registered."""

    direction: ClassVar[Direction] = Direction.PUSH


class RblnNixlConnector(RblnNixlPullConnector):
    """The pull connector under the name existing deployments use."""
