"""The pure parts of ``kvxfer bench``: model shapes, the case matrix, block lists,
memory estimates, the bytes the descriptor algebra must move, and the ratio math.

Nothing here starts a process or touches NIXL, so all of it is unit-tested directly.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvxfer.testing.kvcache import QWEN3_0_6B, ModelShape

__all__ = [
    "BACKENDS",
    "DIRECTIONS",
    "MODES",
    "PATTERNS",
    "QWEN",
    "SHAPES",
    "THIN",
    "Case",
    "build_matrix",
    "case_blocks",
    "case_memory",
    "chunk_tokens_for",
    "expected_bytes",
    "gbps",
    "median",
    "median_ci",
    "mem_available",
    "num_blocks_for",
    "order_cases",
    "ratio",
    "request_blocks",
    "settled",
    "trim_to_budget",
]

QWEN = "qwen3-0.6b"
#: Same regions and descriptor count as Qwen3-0.6B, 1/64 of the bytes: planning cost
#: of very long prompts without holding their KV.
THIN = "qwen3-0.6b-thin"

#: Model shapes of the matrix: KV heads × head dim in bf16 per layer, K and V regions.
SHAPES: dict[str, ModelShape] = {
    "qwen3-0.6b": QWEN3_0_6B,  # 28 layers × 8 KV heads × 128
    "qwen2.5-32b": ModelShape(name="qwen2.5-32b", layers=64, kv_heads=8, head_dim=128),
    # gpt-oss-20b-like: every odd layer attends over a 128-token sliding window.
    "gpt-oss-20b": ModelShape(
        name="gpt-oss-20b", layers=24, kv_heads=8, head_dim=64, sliding_window=128
    ),
    THIN: ModelShape(name=THIN, layers=28, kv_heads=1, head_dim=16),
}
BACKENDS = ("ucx", "host_bounce", "nixl_rbln")
#: whole: every listed block whole; chunk: chunk_mode; window: swa_window_mode.
MODES = ("whole", "chunk", "window")
#: contiguous: runs with a hole every 64 blocks, phase-shifted between the two sides
#: (a paged allocator's free list); scattered: independent random permutations.
PATTERNS = ("contiguous", "scattered")
DIRECTIONS = ("pull", "push")
#: Backends that move device memory directly (chunk_mode / swa_window_mode need one).
DEVICE_TO_DEVICE = frozenset({"nixl_rbln"})

_HOLE_EVERY = 64


class Case(msgspec.Struct, frozen=True, kw_only=True):
    """One measured configuration."""

    model: str
    block_size: int
    tokens: int
    pattern: str
    direction: str
    backend: str
    mode: str = "whole"
    chunk_tokens: int = 0  # chunk mode's lower bound (0 elsewhere)
    #: A pull between block sizes (``--block-ratios``): the consumer's block size, where
    #: ``block_size`` is the producer's (0: the same; :mod:`.block_ratio`).
    consumer_block_size: int = 0
    #: The gather path (``--gather``, :mod:`.gather`): "off" (no staging: the direct
    #: path), "auto" (staging on, the cost model picks per request), "force" (staging
    #: on, every request gathered).
    gather: str = "off"

    @property
    def shape(self) -> ModelShape:
        return SHAPES[self.model]

    @property
    def is_ratio(self) -> bool:
        """Whether the two sides' blocks hold different token counts."""
        return self.consumer_block_size not in (0, self.block_size)

    def block_size_of(self, side: str) -> int:
        """Tokens per block on ``side`` ("local" consumer, "remote" producer)."""
        if side == "local":
            return self.consumer_block_size or self.block_size
        return self.block_size

    @property
    def unit(self) -> int:
        """Tokens of the smaller side's block: what a pull between sizes moves at a time."""
        return min(self.block_size_of("local"), self.block_size)

    @property
    def label(self) -> str:
        mode = "" if self.mode == "whole" else f" {self.mode}"
        ratio = f":{self.consumer_block_size}" if self.is_ratio else ""
        gather = "" if self.gather == "off" else f" gather={self.gather}"
        return (
            f"{self.model} bs{self.block_size}{ratio} {self.tokens}t {self.pattern} "
            f"{self.direction} {self.backend}{mode}{gather}"
        )

    @property
    def cache_key(self) -> tuple[str, int, int, int]:
        """Cases sharing this key share one KV cache per process."""
        return (self.model, self.block_size, self.block_size_of("local"), self.tokens)

    @property
    def agent_key(self) -> tuple[str, int, int, int, str, str, int, str]:
        """Cases sharing this key share one pair of kvxfer agents per direction."""
        return (
            self.model,
            self.block_size,
            self.block_size_of("local"),
            self.tokens,
            self.backend,
            self.mode,
            self.chunk_tokens,
            self.gather,
        )

    def fields(self) -> dict[str, Any]:
        """The case's identity as JSON fields."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        out["layers"] = self.shape.layers
        out["label"] = self.label
        if self.is_ratio:
            out["block_ratio"] = f"{self.block_size}:{self.consumer_block_size}"
        return out


def chunk_tokens_for(block_size: int) -> int:
    """The chunk bound the bench uses: a quarter block (a prefill step below one block)."""
    return max(1, block_size // 4)


def build_matrix(
    *,
    models: Sequence[str],
    block_sizes: Sequence[int],
    tokens: Sequence[int],
    patterns: Sequence[str],
    directions: Sequence[str],
    backends: Sequence[str],
    modes: Sequence[str],
) -> tuple[list[Case], list[tuple[Case, str]]]:
    """All cases, ordered so that caches and agents are reused, plus impossible ones.

    chunk/window cases exist only on device-to-device backends, window cases only on
    sliding-window models; a window that does not divide the block size is returned
    in the second list with the reason.
    """
    for name, values, allowed in (
        ("model", models, SHAPES),
        ("pattern", patterns, PATTERNS),
        ("direction", directions, DIRECTIONS),
        ("backend", backends, BACKENDS),
        ("mode", modes, MODES),
    ):
        bad = [v for v in values if v not in allowed]
        if bad:
            raise ValueError(f"unknown {name} {bad[0]!r}; choose from {', '.join(allowed)}")
    for v in (*block_sizes, *tokens):
        if v < 1:
            raise ValueError(f"block sizes and token counts must be positive, got {v}")
    cases: list[Case] = []
    impossible: list[tuple[Case, str]] = []
    for model in models:
        window = SHAPES[model].sliding_window
        for bs in block_sizes:
            for n in tokens:
                for backend in backends:
                    for mode in modes:
                        if mode != "whole" and backend not in DEVICE_TO_DEVICE:
                            continue
                        if mode == "window" and not window:
                            continue
                        ct = chunk_tokens_for(bs) if mode == "chunk" else 0
                        for pattern in patterns:
                            for direction in directions:
                                case = Case(
                                    model=model,
                                    block_size=bs,
                                    tokens=n,
                                    pattern=pattern,
                                    direction=direction,
                                    backend=backend,
                                    mode=mode,
                                    chunk_tokens=ct,
                                )
                                if mode == "window" and bs % window:
                                    impossible.append(
                                        (
                                            case,
                                            f"swa_window_mode needs block_size a multiple of "
                                            f"the {window}-token window",
                                        )
                                    )
                                else:
                                    cases.append(case)
    return cases, impossible


def order_cases(cases: Iterable[Case]) -> list[Case]:
    """Cases grouped by cache, then by agent pair (stable otherwise), so each cache and
    each agent pair is set up once."""
    first_cache: dict[tuple[str, int, int, int], int] = {}
    first_agents: dict[tuple[str, int, int, int, str, str, int, str], int] = {}
    items = list(cases)
    for i, c in enumerate(items):
        first_cache.setdefault(c.cache_key, i)
        first_agents.setdefault(c.agent_key, i)
    order = sorted(
        range(len(items)),
        key=lambda i: (first_cache[items[i].cache_key], first_agents[items[i].agent_key], i),
    )
    return [items[i] for i in order]


# -- block lists ------------------------------------------------------------------------
def request_blocks(case: Case, side: str = "remote") -> int:
    """Blocks the request's tokens fill on ``side`` (the last one possibly partly)."""
    return -(-case.tokens // case.block_size_of(side))


def num_blocks_for(case: Case, side: str = "remote") -> int:
    """Blocks per region on ``side``: the request, the allocator's holes and a little slack."""
    n = request_blocks(case, side)
    return n + n // (_HOLE_EVERY - 1) + 8


def case_blocks(case: Case, side: str) -> npt.NDArray[np.int64]:
    """The block ids the request occupies on ``side`` ("local" consumer, "remote" producer)."""
    n, total = request_blocks(case, side), num_blocks_for(case, side)
    remote = side == "remote"
    if case.pattern == "scattered":
        rng = np.random.default_rng(7 if remote else 11)
        picked: npt.NDArray[np.int64] = rng.permutation(total)[:n].astype(np.int64)
        return picked
    # A free list that hands out runs: one hole every 64 blocks, phase-shifted between
    # the sides, so runs contiguous on both sides average about half the hole spacing.
    start, phase = (1, 0) if remote else (3, 24)
    ids: npt.NDArray[np.int64] = np.arange(start, total, dtype=np.int64)
    ids = ids[(ids + phase) % _HOLE_EVERY != _HOLE_EVERY - 1]
    if len(ids) < n:  # pragma: no cover - num_blocks_for leaves room
        raise ValueError("num_blocks_for left no room for the request")
    return ids[:n]


# -- bytes the algebra must move ------------------------------------------------------------
def _chunk(range_tokens: int, bound: int) -> int:
    # Smallest s >= bound dividing range_tokens (restated here, independently of
    # kvxfer.core.descriptors, so the bench checks the algebra rather than trusting it).
    if bound >= range_tokens:
        return range_tokens
    return next(s for s in range(bound, range_tokens + 1) if range_tokens % s == 0)


def expected_bytes(case: Case) -> tuple[int, int]:
    """``(bytes the mode moves, bytes whole blocks would move)`` for the request.

    Between block sizes, whole blocks of the smaller size (the units a pull moves).
    """
    shape = case.shape
    tb, bs, n_tok = shape.token_bytes(), case.unit, case.tokens
    n = -(-n_tok // bs)
    regions = 2 * shape.layers
    whole = regions * n * bs * tb
    if case.mode == "whole":
        return whole, whole
    per_region: list[int] = []
    for layer in range(shape.layers):
        sliding = bool(shape.sliding_window) and layer % 2 == 1
        if case.mode == "window" and sliding:
            w = shape.sliding_window
            lo, hi = max(n_tok - w, 0) // w, (n_tok - 1) // w
            per_region.append((hi - lo + 1) * w * tb)
        elif case.mode == "chunk":
            c = _chunk(bs, case.chunk_tokens)
            in_last = n_tok - (n - 1) * bs
            per_region.append(((n - 1) * bs + -(-in_last // c) * c) * tb)
        else:
            per_region.append(n * bs * tb)
    return 2 * sum(per_region), whole


# -- memory --------------------------------------------------------------------------------
#: The consumer's memcpy scratch never exceeds this.
MEMCPY_SCRATCH = 256 << 20
#: Python, NIXL, UCX and the side channel of one bench process.
PROCESS_OVERHEAD = 512 << 20


def case_memory(case: Case) -> int:
    """Bytes both processes hold together for this case (caches, staging, scratch).

    Each process holds one cache of ``num_blocks`` blocks per region and its own
    runtime; host bounce adds a staging copy of the cache; the consumer adds the memcpy
    scratch and the verification's temporaries (about six times one region).
    """
    shape = case.shape
    total = 0
    for side in ("remote", "local"):  # the two block sizes of a pull between sizes
        region = num_blocks_for(case, side) * case.block_size_of(side) * shape.token_bytes()
        cache = 2 * shape.layers * region
        staging = cache if case.backend == "host_bounce" else 0
        total += cache + staging + PROCESS_OVERHEAD
    moved, _ = expected_bytes(case)
    region = num_blocks_for(case, "local") * case.block_size_of("local") * shape.token_bytes()
    return total + min(moved, MEMCPY_SCRATCH) + 6 * region


def mem_available() -> int:
    """MemAvailable in bytes (Linux); a conservative 8 GiB elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def trim_to_budget(cases: Iterable[Case], budget: int) -> tuple[list[Case], list[tuple[Case, str]]]:
    """Split cases into those that fit ``budget`` bytes and those skipped, with the reason."""
    keep: list[Case] = []
    skipped: list[tuple[Case, str]] = []
    for case in cases:
        need = case_memory(case)
        if need > budget:
            skipped.append(
                (case, f"needs {need / 2**30:.1f} GiB > memory budget {budget / 2**30:.1f} GiB")
            )
        else:
            keep.append(case)
    return keep, skipped


# -- ratio math ----------------------------------------------------------------------------
def median(samples: Sequence[float]) -> float | None:
    """Median of the samples, None when there are none."""
    return statistics.median(samples) if samples else None


def gbps(nbytes: int, seconds: float | None) -> float | None:
    """Decimal GB/s, None when the time is missing or zero."""
    if seconds is None or seconds <= 0:
        return None
    return nbytes / seconds / 1e9


def median_ci(samples: Sequence[float]) -> tuple[float, float] | None:
    """A distribution-free ~95% confidence interval of the median (order statistics)."""
    n = len(samples)
    if n < 5:
        return None
    xs = sorted(samples)
    half = 0.98 * n**0.5  # 1.96 sqrt(n) / 2
    lo, hi = max(0, int(n / 2 - half)), min(n - 1, int(n / 2 + half + 0.5))
    return xs[lo], xs[hi]


def settled(kvxfer_s: Sequence[float], nixl_s: Sequence[float], width: float = 0.08) -> bool:
    """Whether the per-rep ratio nixl/kvxfer is known to within ``width`` (95%)."""
    ci = median_ci([r / k for k, r in zip(kvxfer_s, nixl_s) if k > 0])
    return ci is not None and ci[1] - ci[0] <= width


def given_options(args: Any, keys: Sequence[str]) -> list[str]:
    """The ``--option`` spellings of ``keys`` (argparse destinations) given in ``args``:
    what a sub-bench that fixes those selectors refuses."""
    return [f"--{k.replace('_', '-')}" for k in keys if getattr(args, k)]


def fmt(v: float | None) -> str:
    """A figure of a report's table: two decimals, "-" where there is none."""
    return "-" if v is None else f"{v:.2f}"


def measured(results: Sequence[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The results of ``kind`` that measured (``status`` ok), in order."""
    return [r for r in results if r.get("kind") == kind and r.get("status") == "ok"]


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None when either is missing or ``b`` is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b
