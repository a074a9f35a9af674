"""The connectors' transfer statistics, as vLLM collects and exports them.

Worker side: :class:`~kvxfer.adapters.vllm.worker.WorkerSide` fills a plain dict per
interval; vLLM ships it to the API server as :class:`KvxferConnectorStats`, adds up
ranks and steps (numbers add, lists concatenate), logs ``reduce()`` as
"KV Transfer metrics: ..." and feeds :class:`KvxferPromMetrics`, whose Prometheus
series are all declared in :data:`SERIES`.
"""

from __future__ import annotations

import dataclasses
import enum
import statistics
from typing import Any, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = ["SERIES", "KvxferConnectorStats", "KvxferPromMetrics", "Series", "SeriesKind"]

#: Buckets of the per-request transfer time histogram (seconds).
_TIME_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5]


class SeriesKind(enum.Enum):
    """How a stats key becomes a Prometheus series."""

    COUNTER = "counter"  # incremented by the interval's number
    HISTOGRAM = "histogram"  # one observation per entry of the interval's list
    # A level (how many now), shipped as its change over the interval: changes add up
    # across ranks and steps as vLLM aggregates them, and the gauge moves by their sum.
    GAUGE = "gauge"


class Series(NamedTuple):
    """One Prometheus series: its name, kind, help, and the stats key it is fed from.

    Every series carries the label names vLLM passes in (model name, engine index).
    """

    name: str
    kind: SeriesKind
    help: str
    key: str


_C, _H, _G = SeriesKind.COUNTER, SeriesKind.HISTOGRAM, SeriesKind.GAUGE

#: kvxfer's Prometheus series, labelled like vLLM's own (model, engine).
SERIES: tuple[Series, ...] = (
    Series(
        "vllm:kvxfer_transfers", _C, "KV loads settled by kvxfer (done or failed).", "num_transfers"
    ),
    Series(
        "vllm:kvxfer_failed_transfers",
        _C,
        "KV loads kvxfer reported as failed to vLLM.",
        "num_failed",
    ),
    Series("vllm:kvxfer_bytes", _C, "KV bytes moved by completed kvxfer loads.", "bytes"),
    Series(
        "vllm:kvxfer_leases_released",
        _C,
        "Producer: held requests freed by their consumer.",
        "num_leases_released",
    ),
    Series(
        "vllm:kvxfer_leases_expired",
        _C,
        "Producer: held requests freed by lease expiry.",
        "num_leases_expired",
    ),
    Series(
        "vllm:kvxfer_leases_aborted",
        _C,
        "Producer: held requests freed because the consumer gave them up before "
        "transferring (request aborted, local prefix hit).",
        "num_leases_aborted",
    ),
    Series(
        "vllm:kvxfer_leases_renewed",
        _C,
        "Producer: holds whose lease a waiting consumer renewed (one per hold per renewal).",
        "num_leases_renewed",
    ),
    Series(
        "vllm:kvxfer_lease_renewals",
        _C,
        "Consumer, pull: producer holds this instance asked to keep while their request "
        "waited to be scheduled (one per hold per renewal).",
        "num_renewals_sent",
    ),
    Series(
        "vllm:kvxfer_lease_renewals_refused",
        _C,
        "Consumer, pull: renewals not granted (the hold was gone, or its producer did "
        "not answer); the load then fails closed if the lease ends first.",
        "num_renewals_refused",
    ),
    Series(
        "vllm:kvxfer_lease_renewals_lapsed",
        _C,
        "Consumer, pull: held requests this instance stopped renewing before their load "
        "(the lease ended unrenewed, or renew_limit_s passed); their loads fail closed.",
        "num_renewals_lapsed",
    ),
    Series(
        "vllm:kvxfer_push_writes",
        _C,
        "Push producer: KV WRITEs completed (push_stream: several per request).",
        "num_push_writes",
    ),
    # Failure accounting (issue 16), named after vLLM's NIXL connector's series.
    Series(
        "vllm:kvxfer_failed_notifications",
        _C,
        "Notifications ignored: undecodable, unauthenticated or without the capability.",
        "num_failed_notifications",
    ),
    Series(
        "vllm:kvxfer_expired_requests",
        _C,
        "Producer: held requests whose lease ran out before their consumer released them.",
        "num_leases_expired",
    ),
    Series(
        "vllm:kvxfer_capability_rejects",
        _C,
        "Release, notices, registrations refused for a missing or wrong capability.",
        "num_capability_rejects",
    ),
    Series(
        "vllm:kvxfer_guard_failures",
        _C,
        "Pulls failed closed: the producer no longer held the blocks when they were read.",
        "num_guard_failures",
    ),
    Series(
        "vllm:kvxfer_guard_reads",
        _C,
        "Pulls whose producer's guard word was read back after their data.",
        "num_guard_reads",
    ),
    Series(
        "vllm:kvxfer_unguarded_pulls",
        _C,
        "Pulls from a producer without a guard table (lease_expiry check only).",
        "num_unguarded_pulls",
    ),
    Series(
        "vllm:kvxfer_liveness_probes",
        _C,
        "Side-channel probes of transfers gone quiet.",
        "num_liveness_probes",
    ),
    Series(
        "vllm:kvxfer_quarantined",
        _G,
        "Failed transfers whose bytes may still land: their blocks are held back from "
        "vLLM until no byte can (R-SAFE-5). Returns to 0 once the transports settle.",
        "delta_quarantined",
    ),
    Series(
        "vllm:kvxfer_quarantines",
        _C,
        "Failed transfers that were quarantined until their bytes stopped (R-SAFE-5).",
        "num_quarantines",
    ),
    *(
        Series(
            f"vllm:kvxfer_failed_transfers_{stage}",
            _C,
            f"KV loads failed at the {stage} stage.",
            f"failed_stage_{stage}",
        )
        for stage in ("handshake", "registration", "post", "transfer", "notice", "lease")
    ),
    Series(
        "vllm:kvxfer_transfer_time_seconds",
        _H,
        "Per-request KV transfer time (handshake included).",
        "transfer_s",
    ),
)


@dataclasses.dataclass
class KvxferConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Per-interval transfer counters (see ``worker._Interval`` for the keys)."""

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
            if key.startswith(
                ("failed_", "num_leases_", "num_handshakes", "num_push_", "delta_")
            ) or key in (
                "num_failed_notifications",
                "num_capability_rejects",
                "num_guard_failures",
                "num_guard_reads",
                "num_unguarded_pulls",
                "num_liveness_probes",
                "num_quarantines",
            ):
                out[key] = int(d[key])
        return out

    def is_empty(self) -> bool:
        return not any(
            v for k, v in self.data.items() if k.startswith(("num_", "failed_", "delta_"))
        )


class KvxferPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The series of :data:`SERIES`, one child per engine, fed from interval stats."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        #: stats key -> (kind, engine index -> labelled child)
        self.series: dict[str, tuple[SeriesKind, dict[int, Any]]] = {}
        for s in SERIES:
            if s.kind is SeriesKind.HISTOGRAM:
                histogram: Any = self._histogram_cls
                metric = histogram(
                    name=s.name, documentation=s.help, buckets=_TIME_BUCKETS, labelnames=labelnames
                )
            elif s.kind is SeriesKind.GAUGE:
                gauge: Any = self._gauge_cls
                metric = gauge(
                    name=s.name,
                    documentation=s.help,
                    labelnames=labelnames,
                    multiprocess_mode="sum",
                )
            else:
                counter: Any = self._counter_cls
                metric = counter(name=s.name, documentation=s.help, labelnames=labelnames)
            children = {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}
            self.series[s.key] = (s.kind, children)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, (kind, children) in self.series.items():
            value = transfer_stats_data.get(key)
            if not value:
                continue
            if kind is SeriesKind.HISTOGRAM:
                for seconds in value:
                    children[engine_idx].observe(float(seconds))
            else:
                children[engine_idx].inc(value)
