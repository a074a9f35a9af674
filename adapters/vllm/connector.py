"""kvxfer's KV connectors for vLLM 0.32 (``KVConnectorBase_V1``).

This module is the thin facade vLLM instantiates (one instance per role: SCHEDULER in
the engine core, WORKER in each worker process; with vLLM's uni-process executor both
live in the engine-core process, as two separate objects). Each hook maps onto one
call of the side it belongs to; the rest of the adapter:

* :mod:`~kvxfer.adapters.vllm.startup`: start-up checks (config, model support,
  rails) and the worker's Agent (:func:`~kvxfer.adapters.vllm.startup.agent_factory`);
* :mod:`~kvxfer.adapters.vllm.scheduler`: per-request state, the step plan;
* :mod:`~kvxfer.adapters.vllm.worker`: KV tensors -> layout -> Agent calls;
* :mod:`~kvxfer.adapters.vllm.params`: tickets <-> ``kv_transfer_params``;
* :mod:`~kvxfer.adapters.vllm.stats`: interval stats and Prometheus series;
* :mod:`~kvxfer.adapters.vllm.plugin`: the ``vllm.general_plugins`` entry point.

Connectors: :class:`RblnNixlPullConnector` (the consumer READs),
:class:`RblnNixlPushConnector` (experimental; the producer WRITEs) and
:class:`RblnNixlConnector` (the pull connector under its historical name).

Hybrid KV cache manager: the classes subclass vLLM's ``SupportsHMA``, so vLLM keeps
its hybrid KV cache manager on for them. Full-attention and sliding-window KV cache
groups move per group (one block list per group in the ticket, upstream's shape);
a sliding group moves only the blocks its window keeps; a Mamba2 / Gated DeltaNet
state group moves the request's running state slot (the prefill stops one token short
of the prompt so that decode computes the last token from the state before it). Groups
of other kinds are refused at start-up (:func:`~kvxfer.adapters.vllm.startup.kv_groups`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvxfer.adapters.vllm.cpu_cache import probe_interior
from kvxfer.adapters.vllm.plugin import attach_to_vllm_logging
from kvxfer.adapters.vllm.scheduler import SchedulerSide
from kvxfer.adapters.vllm.scheduler import StepPlan as StepPlan
from kvxfer.adapters.vllm.startup import (
    LEASE_KEY,
    TIMEOUT_KEY,
    agent_factory,
    check_model_support,
    check_parallelism,
    data_plane_rails,
    kv_groups,
    parse_vllm_config,
    positive_seconds,
    push_post,
    require_nixl_rbln,
    tp_identity,
)
from kvxfer.adapters.vllm.stats import KvxferConnectorStats, KvxferPromMetrics
from kvxfer.adapters.vllm.worker import WorkerSide
from kvxfer.errors import ConfigError
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


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


class _RblnNixlBase(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
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
        self.engine_id: str = str(vllm_config.kv_transfer_config.engine_id)
        self.block_size: int = int(vllm_config.cache_config.block_size)
        check_model_support(self.cfg, kv_cache_config, self.block_size)
        check_parallelism(vllm_config.parallel_config)
        self._groups = kv_groups(kv_cache_config)
        # Checked now (a bad chunk_tokens is refused at start-up on both sides).
        self._plan_options = self.cfg.plan_options(
            int(vllm_config.scheduler_config.max_num_batched_tokens)
        )
        self._lease_s = positive_seconds(self.cfg, LEASE_KEY, 30.0)
        positive_seconds(self.cfg, TIMEOUT_KEY, 30.0)  # refused at start-up on both sides
        push_post(self.cfg)
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
                windows=self._groups.windows,
                state=tuple(g.is_state for g in self._groups.groups),
                spec_slots=self._groups.spec_slots,
            )
        else:
            self._tp_rank = _tp_rank()
            if self.cfg.device_to_device:
                require_nixl_rbln()
            self._rails = tuple(data_plane_rails(self.cfg))
            # Checks the Agent's settings now; builds it once the KV cache exists.
            self._agent_factory = agent_factory(
                vllm_config,
                self.cfg,
                direction=self.direction,
                tp_rank=self._tp_rank,
                rails=self._rails,
                kv_cache_config=kv_cache_config,
            )
            self._start_link_monitor()

    # -- worker process: rails, link monitor ---------------------------------------------
    def _start_link_monitor(self) -> None:
        if not self._rails or self.cfg.link_down_exit_s <= 0:
            return
        from kvxfer.io.linkmon import LinkMonitor, sysfs_link_probe

        self._linkmon = LinkMonitor(sysfs_link_probe(self._rails), self.cfg.link_down_exit_s)
        self._linkmon.start()

    # ==================================================================================
    # Worker side
    # ==================================================================================
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        interior = None
        # The first attention layer's tensor (state layers come as lists of views).
        first = next((t for t in kv_caches.values() if not isinstance(t, list | tuple)), None)
        latent = bool(getattr(self._vllm_config.model_config, "use_mla", False))
        if first is not None and first.device.type == "cpu" and first.dim() == 4 and not latent:
            # Which order vLLM's CPU attention writes a block in (chunk_mode and
            # swa_window_mode cut its token ranges). An MLA cache holds one latent
            # vector per token, not K and V halves: nothing to probe.
            interior = probe_interior(
                num_kv_heads=int(first.shape[1]),
                block_size=int(first.shape[2]),
                head_size=int(first.shape[3]) // 2,
                dtype=first.dtype,
                kv_cache_dtype=str(self._vllm_config.cache_config.cache_dtype),
            )
        self._worker = WorkerSide.from_kv_caches(
            self.cfg,
            kv_caches,
            agent_factory=self._agent_factory,
            tp_rank=self._tp_rank,
            tp_size=self._tp_size,
            # Global index of this rank's first KV head (replicated heads included).
            first_head=tp_identity(self._vllm_config, self._tp_rank)
            .heads.heads_of(self._tp_rank)
            .start,
            defer_registration=self.cfg.device_to_device,
            block_size=self.block_size,
            num_blocks=int(self._kv_cache_config.num_blocks),
            kv_layout=str(self._kv_cache_config.kv_cache_layout or "NHD"),
            groups=self._groups.groups,
            layer_groups=self._groups.layer_groups,
            state_parts=self._groups.state_parts,
            plan_options=self._plan_options,
            interior=interior,
            # One region per head where this instance is tensor-parallel (as before);
            # pairs across TP sizes no longer need it on either side: they are cut at
            # the handshake (kvxfer.core.heads.pairing_heads).
            head_regions=self._tp_size > 1
            if self.cfg.head_regions is None
            else self.cfg.head_regions,
        )
        if self.cfg.head_regions and self._tp_size == 1:
            log.warning(
                "kvxfer: kv_connector_extra_config.head_regions=true is no longer needed "
                "for peers of other TP sizes (pairs are cut per head at the handshake); "
                "on a TP1 instance it only multiplies the descriptors of equal-TP pairs "
                "by the KV heads: drop it"
            )

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        # vLLM's op copies between its own host buffers and the cache; kvxfer's host
        # bounce stages into the Agent's buffers with its own copies (by address on
        # the CPU platform, torch index copies on devices), so the op is not used.
        return

    def get_handshake_metadata(self) -> KvxferHandshakeMetadata | None:
        if self._worker is None:
            return None
        return KvxferHandshakeMetadata(**self._worker.handshake_info())

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
        # as many remote blocks. A full-attention group counts them (a sliding one
        # holds null blocks where its window dropped hits).
        full = blocks.blocks[self._sched.full_group] if blocks.blocks else ()
        hits = sum(1 for b in full if b.block_hash is not None and not b.is_null)
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

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with one block list per KV cache group (SupportsHMA)."""
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

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
