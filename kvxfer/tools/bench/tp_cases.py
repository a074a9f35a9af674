"""The pure parts of ``kvxfer bench --tp``: transfers across tensor-parallel sizes.

A TP case is one request moving into one decode rank from a prefill group of another
TP size, pulled by the decode rank or pushed by the prefill ranks, with real processes
and real NIXL: prefill TP1 → decode TP2 (the decode rank gets its half of the heads
from one producer process, one descriptor per head per block) and prefill TP2 → decode
TP1 (the decode rank gets every head, half from each of two producer processes, in one
request). Both caches are head-major (HND) and
described as the vLLM adapter describes them by default: one region per (layer, K/V)
on a TP1 side, one per (layer, K/V, head) on a wider one; the pairing cuts them per
head (:func:`kvxfer.core.heads.pairing_heads`), as the agents do.

Here: the case, its selection, the bytes and descriptors the head algebra says the
pull needs (restated independently of :mod:`kvxfer.core.tp_plan`, so the bench checks the
planner rather than trusting it), what a token-major (NHD) cache would have cost in
descriptors, memory estimates, the result object and its table. Nothing here starts a
process or touches NIXL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

import kvxfer.tools.bench.cases as bc
from kvxfer.core.heads import HeadLayout, needed_ranks
from kvxfer.testing.kvcache import ModelShape

__all__ = [
    "DEFAULT_PAIRS",
    "PREFILL_ENGINE",
    "TPCase",
    "assemble",
    "build_tp_cases",
    "descriptor_counts",
    "expected_bytes",
    "format_tp_table",
    "parse_pairs",
    "tp_failed",
    "tp_memory",
]

#: ``--tp`` without a value: prefill TP1 → decode TP2 and prefill TP2 → decode TP1.
DEFAULT_PAIRS = "1:2,2:1"
#: The engine id every prefill rank's agent serves under (one per group).
PREFILL_ENGINE = "bench-tp-prefill"


class TPCase(msgspec.Struct, frozen=True, kw_only=True):
    """One measured transfer across TP sizes: decode rank ``decode_rank`` of a decode
    group of ``decode_tp`` ranks pulls one request from a prefill group of
    ``prefill_tp`` (``direction`` pull), or the prefill ranks holding its heads push it
    there (push)."""

    model: str
    block_size: int
    tokens: int
    pattern: str
    prefill_tp: int
    decode_tp: int
    decode_rank: int = 0
    backend: str = "ucx"
    direction: str = "pull"

    @property
    def shape(self) -> ModelShape:
        return bc.SHAPES[self.model]

    def per_head(self, producer: bool) -> bool:
        """Whether that side's cache is described per head (the vLLM adapter's
        default: where its TP size is over 1)."""
        return (self.prefill_tp if producer else self.decode_tp) > 1

    @property
    def base(self) -> bc.Case:
        """The same request as a plain bench case (its block lists and cache size)."""
        return bc.Case(
            model=self.model,
            block_size=self.block_size,
            tokens=self.tokens,
            pattern=self.pattern,
            direction="pull",
            backend=self.backend,
        )

    @property
    def prefill_heads(self) -> HeadLayout:
        return HeadLayout(num_kv_heads=self.shape.kv_heads, tp_size=self.prefill_tp)

    @property
    def decode_heads(self) -> HeadLayout:
        return HeadLayout(num_kv_heads=self.shape.kv_heads, tp_size=self.decode_tp)

    @property
    def producer_ranks(self) -> tuple[int, ...]:
        """The prefill ranks holding the decode rank's heads (one process each)."""
        return needed_ranks(self.decode_heads, self.decode_rank, self.prefill_heads)

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token."""
        return self.shape.head_dim * self.shape.dtype_bytes

    @property
    def label(self) -> str:
        return (
            f"{self.model} bs{self.block_size} {self.tokens}t {self.pattern} "
            f"TP{self.prefill_tp}->TP{self.decode_tp} r{self.decode_rank} {self.direction}"
        )

    def fields(self) -> dict[str, Any]:
        """The case's identity as JSON fields."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        out["layers"] = self.shape.layers
        out["kv_heads"] = self.shape.kv_heads
        out["producer_ranks"] = list(self.producer_ranks)
        out["label"] = self.label
        return out


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """``"1:2,2:1"`` → ``[(1, 2), (2, 1)]`` (prefill TP : decode TP)."""
    out: list[tuple[int, int]] = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        p, sep, d = item.partition(":")
        if not sep or not p.strip().isdigit() or not d.strip().isdigit():
            raise ValueError(f"--tp {item!r}: write PREFILL_TP:DECODE_TP, e.g. 1:2")
        pair = (int(p), int(d))
        if min(pair) < 1:
            raise ValueError(f"--tp {item!r}: TP sizes must be positive")
        if pair[0] == pair[1]:
            raise ValueError(f"--tp {item!r}: equal TP sizes are the plain matrix's cases")
        out.append(pair)
    return out


def build_tp_cases(
    *,
    pairs: Sequence[tuple[int, int]],
    models: Sequence[str],
    block_sizes: Sequence[int],
    tokens: Sequence[int],
    patterns: Sequence[str],
    directions: Sequence[str] = ("pull",),
) -> list[TPCase]:
    """Every selected TP case (decode rank 0), checking that the sizes split the heads.

    Raises:
        ValueError: an unknown model, pattern or direction, or TP sizes that cannot
            split a model's KV heads (named).
    """
    for name, values, allowed in (
        ("model", models, bc.SHAPES),
        ("pattern", patterns, bc.PATTERNS),
        ("direction", directions, bc.DIRECTIONS),
    ):
        bad = [v for v in values if v not in allowed]
        if bad:
            raise ValueError(f"unknown {name} {bad[0]!r}; choose from {', '.join(allowed)}")
    from kvxfer.errors import ConfigError

    out: list[TPCase] = []
    for model in models:
        for p, d in pairs:
            case = TPCase(
                model=model, block_size=1, tokens=1, pattern="contiguous", prefill_tp=p, decode_tp=d
            )
            try:
                case.prefill_heads, case.decode_heads  # noqa: B018 - validates the sizes
            except ConfigError as exc:
                raise ValueError(f"--tp {p}:{d} on {model}: {exc}") from None
            if case.prefill_heads.replicas > 1:
                raise ValueError(
                    f"--tp {p}:{d} on {model}: prefill TP {p} replicates its "
                    f"{case.shape.kv_heads} KV heads; the bench reads unreplicated prefill heads"
                )
            out += [
                msgspec.structs.replace(case, block_size=bs, tokens=n, pattern=pat, direction=d)
                for d in directions
                for bs in block_sizes
                for n in tokens
                for pat in patterns
            ]
    return out


# -- what the algebra says ------------------------------------------------------------------
def _consumer_heads(case: TPCase) -> int:
    return case.decode_heads.heads_per_rank


def expected_bytes(case: TPCase) -> int:
    """Bytes the pull moves: every head the decode rank holds, every whole block."""
    n = bc.request_blocks(case.base)
    per_head_block = case.block_size * case.head_bytes
    return n * 2 * case.shape.layers * _consumer_heads(case) * per_head_block


def descriptor_counts(case: TPCase) -> dict[str, int]:
    """Descriptor pairs of the request per way of describing the caches.

    ``hnd_per_head``: what kvxfer posts (one region per (layer, K/V, head): one
    descriptor per head per block); ``nhd_strided``: a token-major cache with one
    region per (layer, K/V) holding a rank's heads, where a head slice is one
    descriptor per token (kvxfer refuses it); ``equal_tp``: the same bytes between
    equal TP sizes, whole blocks of one region per (layer, K/V).
    """
    n = bc.request_blocks(case.base)
    regions = 2 * case.shape.layers
    heads = _consumer_heads(case)
    ranks = len(case.producer_ranks)
    slice_needed = case.prefill_heads.heads_per_rank != heads
    return {
        "hnd_per_head": n * regions * heads,
        "nhd_strided": n * regions * ranks * (case.block_size if slice_needed else 1),
        "equal_tp": n * regions,
    }


def tp_memory(case: TPCase) -> int:
    """Bytes all the case's processes hold together (caches, scratch, runtimes)."""
    shape = case.shape
    full = 2 * shape.layers * bc.num_blocks_for(case.base) * case.block_size * shape.token_bytes()
    producers = full  # the prefill ranks together hold every head once
    consumer = full // case.decode_tp
    procs = len(case.producer_ranks) + 1
    scratch = min(expected_bytes(case), bc.MEMCPY_SCRATCH)
    return producers + 2 * consumer + scratch + procs * bc.PROCESS_OVERHEAD


# -- results ----------------------------------------------------------------------------
def tp_failed(case: TPCase, reason: str, status: str = "failed") -> dict[str, Any]:
    """A result object for a TP case that did not produce numbers."""
    return {"kind": "tp", **case.fields(), "status": status, "reason": reason}


def _paired(num: Sequence[float], den: Sequence[float]) -> float | None:
    """Median over the back-to-back reps of ``t_num / t_den``: the speed of ``den``'s
    side over ``num``'s."""
    return bc.median([n / d for n, d in zip(num, den) if d > 0])


def assemble(
    case: TPCase,
    first: dict[str, Any],
    raw_first: dict[str, Any],
    runs_first: dict[str, Any],
    times: dict[str, list[float]],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The JSON object of one measured TP case (medians, paired ratios, checks).

    ``first``, ``raw_first``, ``runs_first``: the verified first transfers of kvxfer,
    raw NIXL on the planner's ids and raw NIXL on its merged runs (``bytes``,
    ``descriptors``, ``bad``); ``times``: seconds of the timed reps per ``kvxfer``,
    ``nixl``, ``nixl_runs`` and ``memcpy``, run back to back; ``extra``: per-case
    figures passed through (handshakes, runs).
    """
    kv, raw, runs, memcpy = (times[k] for k in ("kvxfer", "nixl", "nixl_runs", "memcpy"))
    moved, expected = int(first["bytes"]), expected_bytes(case)
    kv_s, raw_s, runs_s, mc_s = (bc.median(t) for t in (kv, raw, runs, memcpy))
    kv_g, raw_g, mc_g = bc.gbps(moved, kv_s), bc.gbps(moved, raw_s), bc.gbps(moved, mc_s)
    bad = {"kvxfer": first["bad"], "nixl": raw_first["bad"], "nixl_runs": runs_first["bad"]}
    verified = all(b == 0 for b in bad.values())
    same = (
        first["descriptors"] == raw_first["descriptors"]
        and raw_first["bytes"] == runs_first["bytes"] == moved
    )
    ok = verified and same and moved == expected
    reason = ""
    if not verified:
        reason = "bytes did not verify"
    elif not same:
        reason = "kvxfer and raw NIXL posted different descriptors"
    elif moved != expected:
        reason = f"moved {moved} bytes, the algebra says {expected}"
    counts = descriptor_counts(case)
    return {
        "kind": "tp",
        **case.fields(),
        "status": "ok" if ok else "failed",
        "reason": reason,
        "reps": len(kv),
        "bytes_moved": moved,
        "bytes_expected": expected,
        "descriptors_posted": first["descriptors"],
        "nixl_descriptors": raw_first["descriptors"],
        "descriptors_hnd_per_head": counts["hnd_per_head"],
        "descriptors_nhd_strided": counts["nhd_strided"],
        "descriptors_equal_tp": counts["equal_tp"],
        "verified": verified,
        "mismatches": bad,
        "kvxfer_s": kv_s,
        "nixl_s": raw_s,
        "nixl_runs_s": runs_s,
        "memcpy_s": mc_s,
        "kvxfer_gbps": kv_g,
        "nixl_gbps": raw_g,
        "nixl_runs_gbps": bc.gbps(moved, runs_s),
        "memcpy_gbps": mc_g,
        # t_other / t_kvxfer per back-to-back rep: above 1, kvxfer was faster
        "kvxfer_vs_nixl": _paired(raw, kv),
        "kvxfer_vs_nixl_runs": _paired(runs, kv),
        # Its ~95% confidence interval (order statistics; None under 5 reps).
        "kvxfer_vs_nixl_runs_ci": bc.median_ci([r / k for r, k in zip(runs, kv) if k > 0]),
        "kvxfer_vs_memcpy": _paired(memcpy, kv),
        "nixl_vs_memcpy": _paired(memcpy, raw),
        # The first request after the handshake: one per start of the case's
        # processes (add_first adds the later starts'), each over the steady median
        # of its own start, and the median of those ratios (issue 27: <= 1.2); raw
        # NIXL's the same way. kvxfer's first leads in this start.
        **_first_fields([(first["s"], kv_s)], [(raw_first["s"], raw_s)], [True]),
        **extra,
        "samples": {k: list(v) for k, v in times.items()},
    }


def add_first(
    result: dict[str, Any],
    first: dict[str, Any],
    raw_first: dict[str, Any],
    steady_s: float | None,
    raw_steady_s: float | None,
    *,
    kvxfer_led: bool = True,
) -> dict[str, Any]:
    """``result`` with one more first request of kvxfer and of raw NIXL (verified,
    from a fresh start of the case's processes) among its first samples, each with
    the steady median of the same start (``steady_s``, ``raw_steady_s``): a start's
    steady level is its own (one case's steady medians moved 14-21 ms between starts
    on the 2-core host), so a first is held against its own start's. ``kvxfer_led``:
    kvxfer's first ran before raw NIXL's in that start (see :func:`_first_fields`).
    A first whose bytes do not verify, or that moved other bytes, fails the case."""
    bad = {"kvxfer": first["bad"], "nixl": raw_first["bad"]}
    if any(b != 0 for b in bad.values()):
        rows = ", ".join(f"{k} {v}" for k, v in bad.items())
        why = f"a later first request's bytes did not verify (wrong rows: {rows})"
        return {**result, "status": "failed", "reason": why}
    if first["bytes"] != result["bytes_moved"]:
        why = f"a later first request moved {first['bytes']} bytes, not {result['bytes_moved']}"
        return {**result, "status": "failed", "reason": why}
    firsts = [*zip(result["first_samples_s"], result["first_steady_s"]), (first["s"], steady_s)]
    raws = [
        *zip(result["nixl_first_samples_s"], result["nixl_first_steady_s"]),
        (raw_first["s"], raw_steady_s),
    ]
    led = [*result.get("first_led", [True] * (len(firsts) - 1)), kvxfer_led]
    return {**result, **_first_fields(firsts, raws, led)}


def _ratios(pairs: Sequence[tuple[float, float | None]]) -> list[float]:
    return [first / steady for first, steady in pairs if steady]


def _median_where(
    pairs: Sequence[tuple[float, float | None]], flags: Sequence[bool], want: bool
) -> float | None:
    ratios = _ratios([p for p, f in zip(pairs, flags, strict=True) if f is want])
    return bc.median(ratios) if ratios else None


def _first_fields(
    firsts: Sequence[tuple[float, float | None]],
    raws: Sequence[tuple[float, float | None]],
    led: Sequence[bool],
) -> dict[str, Any]:
    """A case's first requests, each with its start's steady median (kvxfer's, raw
    NIXL's): the samples, their medians, and the median of first over steady.

    ``led``: per start, whether kvxfer's first ran before raw NIXL's. The transfer
    that runs first after a start's quiet set-up pays for the quiet (on the 2-core
    host, with 2 s idle before it, raw NIXL's first read 1.25-1.28x its steady median
    when it led and kvxfer's 1.00-1.01x after it; led by kvxfer the two swap), so
    starts alternate which leads, and the medians by position are kept apart."""
    ratios, raw_ratios = _ratios(firsts), _ratios(raws)
    return {
        "first_samples_s": [f for f, _ in firsts],
        "first_steady_s": [s for _, s in firsts],
        "first_transfer_s": bc.median([f for f, _ in firsts]),
        "first_vs_steady": bc.median(ratios) if ratios else None,
        "first_ratios": ratios,
        "first_led": list(led),
        "first_vs_steady_leading": _median_where(firsts, led, True),
        "first_vs_steady_following": _median_where(firsts, led, False),
        "nixl_first_samples_s": [f for f, _ in raws],
        "nixl_first_steady_s": [s for _, s in raws],
        "nixl_first_transfer_s": bc.median([f for f, _ in raws]),
        "nixl_first_vs_steady": bc.median(raw_ratios) if raw_ratios else None,
        "nixl_first_vs_steady_leading": _median_where(raws, led, False),
        "nixl_first_vs_steady_following": _median_where(raws, led, True),
    }


def _first_range(r: dict[str, Any]) -> tuple[float, float] | None:
    """The lowest and highest first transfer over its start's steady median."""
    ratios = r.get("first_ratios")
    if not ratios:
        return None
    return min(ratios), max(ratios)


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _interval(ci: Sequence[float] | None) -> str:
    return "-" if not ci else f"{ci[0]:.2f}-{ci[1]:.2f}"


def format_tp_table(results: Sequence[dict[str, Any]]) -> str:
    """One line per TP case: descriptors, bytes, GB/s of the three, the ratios."""
    head = (
        f"{'case':<50} {'ranks':>5} {'descs':>7} {'posted':>6} {'nixl u':>6} {'runs':>6} "
        f"{'NHD descs':>9} {'MB':>6} "
        f"{'kvxfer':>6} {'nixl':>6} {'n.runs':>6} {'memcpy':>6} {'x nixl':>6} {'x runs':>6} "
        f"{'runs 95%':>9} {'x mcpy':>6} {'1st/st':>6} {'1st range':>9}"
    )
    lines = [
        "transfers across TP sizes into one decode rank, pulled by it or pushed by the",
        "prefill ranks; GB/s (decimal), medians; x: kvxfer over raw NIXL posting the",
        "planner's ids on prepared lists (nixl: READs, or WRITEs from each prefill rank),",
        "its merged runs as per-request lists (n.runs), and memcpy, paired per rep;",
        "runs 95%: the x runs median's ~95% interval (more reps while it is wider than",
        "0.08, up to --max-reps);",
        "descs: planned pairs (one per head per block, HND); posted: transfer units",
        "kvxfer's backend posts; nixl u: units NIXL merges the prepared ids into; runs:",
        "the fewest that cover the bytes; NHD descs: a token-major cache's strided head",
        "slices (refused by kvxfer); 1st/st: the first transfer after the handshake over",
        "the steady median (with --firsts N, the median over N fresh starts of the case's",
        "processes of each start's first over that start's steady median; 1st range: the",
        "lowest and highest of them)",
        head,
    ]
    for r in results:
        if r.get("status") != "ok":
            lines.append(f"{r['label']:<50} {r.get('status', '?').upper()}: {r.get('reason', '')}")
            continue
        lines.append(
            f"{r['label']:<50} {len(r['producer_ranks']):>5} {r['descriptors_posted']:>7} "
            f"{_f(r.get('units_posted'), '{}'):>6} {_f(r.get('nixl_units'), '{}'):>6} "
            f"{_f(r.get('runs'), '{}'):>6} {r['descriptors_nhd_strided']:>9} "
            f"{r['bytes_moved'] / 1e6:>6.1f} {_f(r['kvxfer_gbps']):>6} {_f(r['nixl_gbps']):>6} "
            f"{_f(r['nixl_runs_gbps']):>6} {_f(r['memcpy_gbps']):>6} "
            f"{_f(r['kvxfer_vs_nixl']):>6} {_f(r['kvxfer_vs_nixl_runs']):>6} "
            f"{_interval(r.get('kvxfer_vs_nixl_runs_ci')):>9} "
            f"{_f(r['kvxfer_vs_memcpy']):>6} {_f(r.get('first_vs_steady')):>6} "
            f"{_interval(_first_range(r)):>9}"
        )
    return "\n".join(lines)
