"""Metrics of ``kvxfer proxy``: Prometheus text for ``/metrics``, JSON for ``/stats``.

Self-contained (no prometheus_client): counters and histograms keyed by label values,
each histogram also keeping a bounded window of recent samples so ``/stats`` can show
exact recent percentiles. Stage definitions are in docs/PROXY.md and on
:class:`ProxyMetrics`.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import msgspec

from kvxfer.adapters.vllm.proxy.routing import Instance

__all__ = [
    "Counter",
    "Histogram",
    "InstanceStats",
    "ProxyMetrics",
    "ProxyStats",
    "StageStats",
    "Summary",
]

#: Latency buckets (seconds) shared by every histogram.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
_WINDOW = 2048  # recent samples kept per label set for /stats percentiles

Labels = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Counter:
    """A monotonically increasing count per label set."""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        self.name, self.help, self.labelnames = name, help_text, tuple(labelnames)
        self.values: dict[Labels, float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        """Add ``amount`` to the series with these label values."""
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, *labels: str) -> float:
        """The current value of one series (0 when never incremented)."""
        return self.values.get(labels, 0.0)

    def render(self) -> Iterable[str]:
        """Prometheus text lines."""
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        for labels, value in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.labelnames, labels)} {_num(value)}"


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    """Recent-window statistics of one latency series (seconds)."""

    count: int
    window: int
    mean_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    max_s: float


class StageStats(msgspec.Struct, frozen=True, kw_only=True):
    """One stage over all its series and per label value (instance or route)."""

    all: Summary | None
    by: dict[str, Summary]


def _summary(samples: Sequence[float], count: int) -> Summary | None:
    if not samples:
        return None
    ordered = sorted(samples)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(p * len(ordered)) - 1))]

    return Summary(
        count=count,
        window=len(ordered),
        mean_s=sum(ordered) / len(ordered),
        p50_s=q(0.50),
        p90_s=q(0.90),
        p99_s=q(0.99),
        max_s=ordered[-1],
    )


class Histogram:
    """Cumulative-bucket histogram per label set, plus a recent-sample window."""

    def __init__(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> None:
        self.name, self.help, self.labelnames = name, help_text, tuple(labelnames)
        self.buckets = tuple(sorted(buckets))
        self._counts: dict[Labels, list[int]] = {}
        self._sum: dict[Labels, float] = {}
        self._n: dict[Labels, int] = {}
        self._recent: dict[Labels, deque[float]] = {}
        self._all: deque[float] = deque(maxlen=_WINDOW)
        self._all_n = 0

    def observe(self, value: float, *labels: str) -> None:
        """Record one sample (seconds) for these label values."""
        value = max(0.0, float(value))
        counts = self._counts.get(labels)
        if counts is None:
            counts = self._counts[labels] = [0] * len(self.buckets)
            self._recent[labels] = deque(maxlen=_WINDOW)
        i = bisect.bisect_left(self.buckets, value)
        if i < len(counts):
            counts[i] += 1
        self._sum[labels] = self._sum.get(labels, 0.0) + value
        self._n[labels] = self._n.get(labels, 0) + 1
        self._recent[labels].append(value)
        self._all.append(value)
        self._all_n += 1

    def count(self, *labels: str) -> int:
        """Samples recorded for one label set (all label sets when none given)."""
        return self._all_n if not labels else self._n.get(labels, 0)

    def stats(self) -> StageStats:
        """Recent-window summaries, overall and per first label value."""
        by: dict[str, Summary] = {}
        for labels, recent in sorted(self._recent.items()):
            s = _summary(recent, self._n[labels])
            if s is not None:
                by["/".join(labels) or "all"] = s
        return StageStats(all=_summary(self._all, self._all_n), by=by)

    def render(self) -> Iterable[str]:
        """Prometheus text lines."""
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        for labels in sorted(self._counts):
            cumulative = 0
            for bound, c in zip(self.buckets, self._counts[labels]):
                cumulative += c
                le = _labels(self.labelnames, labels, f'le="{_num(bound)}"')
                yield f"{self.name}_bucket{le} {cumulative}"
            inf = _labels(self.labelnames, labels, 'le="+Inf"')
            yield f"{self.name}_bucket{inf} {self._n[labels]}"
            plain = _labels(self.labelnames, labels)
            yield f"{self.name}_sum{plain} {_num(self._sum[labels])}"
            yield f"{self.name}_count{plain} {self._n[labels]}"


class InstanceStats(msgspec.Struct, frozen=True, kw_only=True):
    """One instance in ``/stats``."""

    url: str
    role: str
    state: str
    active: int
    outstanding_tokens: int
    requests: int
    errors: int
    last_error: str
    kv_endpoint: dict[str, object] | None


class ProxyStats(msgspec.Struct, frozen=True, kw_only=True):
    """The body of ``GET /stats``."""

    mode: str
    uptime_s: float
    requests: int
    in_flight: int
    decisions: dict[str, int]
    responses: dict[str, int]
    affinity: dict[str, int]
    stages: dict[str, StageStats]
    instances: list[InstanceStats]


class ProxyMetrics:
    """Every metric the proxy exports.

    Stages (seconds; definitions also in docs/PROXY.md):

    - ``prefill``: the prefill request, sent to its whole response read.
    - ``kv_wait``: from the later of (decode request sent, prefill response received)
      to decode's first token. In pull mode that is decode sent → first token: queueing
      on decode, the KV pull and one decode step. In push mode decode was sent before
      prefill finished, so it starts at prefill's response: the final writes plus one
      decode step. Streaming requests only; decode-only requests have none.
    - ``decode``: decode's first token to its last byte (non-streaming: the whole
      decode request, as no first token is visible).
    - ``ttft``: the client's request arriving → the first token written back to it.
    - ``itl``: gap between consecutive token-bearing stream events from decode (an
      event may carry several tokens when vLLM coalesces output).
    - ``request``: the client's request arriving → its response finished.
    - ``routing``: time the proxy spends parsing and choosing instances.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.started = time.monotonic()
        self.in_flight = 0
        p = "kvxfer_proxy_"
        self.prefill = Histogram(p + "prefill_seconds", "Prefill request duration.", ["instance"])
        self.kv_wait = Histogram(
            p + "kv_wait_seconds",
            "Later of (decode request sent, prefill done) to decode's first token.",
            ["instance"],
        )
        self.decode = Histogram(
            p + "decode_seconds", "Decode first token to last byte.", ["instance"]
        )
        self.ttft = Histogram(
            p + "ttft_seconds", "Client request to first token forwarded.", ["route"]
        )
        self.itl = Histogram(
            p + "itl_seconds", "Gap between token-bearing decode stream events.", ["instance"]
        )
        self.request = Histogram(
            p + "request_seconds", "Client request to response finished.", ["route"]
        )
        self.routing = Histogram(p + "routing_seconds", "Proxy parse and routing time.")
        self.decisions = Counter(
            p + "decisions_total", "Decider verdicts (route and reason).", ["route", "reason"]
        )
        self.responses = Counter(p + "responses_total", "Responses by HTTP status.", ["code"])
        self.errors = Counter(
            p + "upstream_errors_total",
            "Failed upstream requests by instance and kind.",
            ["role", "instance", "kind"],
        )
        self.affinity = Counter(
            p + "prefix_affinity_total", "Prefix affinity outcome of prefill picks.", ["result"]
        )
        self.retries = Counter(
            p + "retries_total", "Requests re-sent after a connection failure.", ["role"]
        )
        self.missing_params = Counter(
            p + "missing_kv_transfer_params_total",
            "Prefill responses without kv_transfer_params (decode will recompute).",
            ["instance"],
        )
        self.push_sequential = Counter(
            p + "push_sequential_total",
            "Push requests sent prefill-first (prefill side channel not learned yet).",
            ["instance"],
        )
        self.health_transitions = Counter(
            p + "health_transitions_total",
            "Instances taken out of or put back into rotation.",
            ["role", "instance", "state"],
        )
        self._histograms = (
            self.prefill,
            self.kv_wait,
            self.decode,
            self.ttft,
            self.itl,
            self.request,
            self.routing,
        )
        self._counters = (
            self.decisions,
            self.responses,
            self.errors,
            self.affinity,
            self.retries,
            self.missing_params,
            self.push_sequential,
            self.health_transitions,
        )

    def render(self, instances: Sequence[Instance]) -> str:
        """The Prometheus text exposition (format 0.0.4)."""
        lines: list[str] = []
        gauges: tuple[tuple[str, str, Callable[[Instance], int]], ...] = (
            ("instance_healthy", "1 when the instance is in rotation.", lambda i: int(i.healthy)),
            ("instance_active_requests", "Requests in flight to the instance.", lambda i: i.active),
            (
                "instance_outstanding_tokens",
                "Estimated prompt tokens in flight to the instance.",
                lambda i: i.outstanding_tokens,
            ),
        )
        for suffix, help_text, value in gauges:
            name = "kvxfer_proxy_" + suffix
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
            for inst in instances:
                labels = _labels(("role", "instance"), (inst.kind.value, inst.url))
                lines.append(f"{name}{labels} {int(value(inst))}")
        for name, help_text, gvalue in (
            ("in_flight_requests", "Client requests being served.", self.in_flight),
            ("uptime_seconds", "Seconds since the proxy started.", self.uptime()),
        ):
            full = "kvxfer_proxy_" + name
            lines += [
                f"# HELP {full} {help_text}",
                f"# TYPE {full} gauge",
                f"{full} {_num(gvalue)}",
            ]
        for counter in self._counters:
            lines.extend(counter.render())
        for hist in self._histograms:
            lines.extend(hist.render())
        return "\n".join(lines) + "\n"

    def uptime(self) -> float:
        """Seconds since the proxy started."""
        return round(time.monotonic() - self.started, 3)

    def stats(self, instances: Sequence[Instance]) -> ProxyStats:
        """The ``/stats`` body."""
        decisions = {
            f"{route}/{reason}": int(v) for (route, reason), v in self.decisions.values.items()
        }
        return ProxyStats(
            mode=self.mode,
            uptime_s=self.uptime(),
            requests=self.request.count(),
            in_flight=self.in_flight,
            decisions=decisions,
            responses={code: int(v) for (code,), v in self.responses.values.items()},
            affinity={res: int(v) for (res,), v in self.affinity.values.items()},
            stages={
                "prefill": self.prefill.stats(),
                "kv_wait": self.kv_wait.stats(),
                "decode": self.decode.stats(),
                "ttft": self.ttft.stats(),
                "itl": self.itl.stats(),
                "request": self.request.stats(),
                "routing": self.routing.stats(),
            },
            instances=[
                InstanceStats(
                    url=i.url,
                    role=i.kind.value,
                    state=i.state.value,
                    active=i.active,
                    outstanding_tokens=i.outstanding_tokens,
                    requests=i.requests_total,
                    errors=i.errors_total,
                    last_error=i.last_error,
                    kv_endpoint=i.kv_endpoint,
                )
                for i in instances
            ],
        )

    def transition(self, inst: Instance) -> None:
        """Count a health transition of ``inst`` (call after its state changed)."""
        self.health_transitions.inc(inst.kind.value, inst.url, inst.state.value)
