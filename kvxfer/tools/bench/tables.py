"""The Markdown tables of docs/PERFORMANCE.md, from a ``kvxfer bench --json`` run.

Run: ``kvxfer bench --tables run.jsonl [more.jsonl ...] > tables.md`` (or
``python -m kvxfer.tools.bench.tables run.jsonl ...``).

Every number comes from the JSON lines the bench wrote (one object per case); nothing
is measured here. Sections: the bar, kvxfer against raw NIXL and memcpy by
configuration and by transfer time, every ``ucx`` pull, Qwen3-0.6B at 4000 tokens on
every backend, contiguous block-size-16 runs, chunk and window modes, host bounce
against direct, planning cost.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["load", "main"]

Row = dict[str, Any]


def load(paths: Iterable[str]) -> list[Row]:
    """Every JSON object of the given files."""
    rows: list[Row] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _share(xs: Sequence[float], ok: Callable[[float], bool]) -> str:
    return f"{100 * sum(1 for x in xs if ok(x)) / len(xs):.0f}%" if xs else "–"


def _table(head: Sequence[str], body: Iterable[Sequence[object]], right_from: int = 1) -> str:
    align = ["---" if i < right_from else "---:" for i in range(len(head))]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def _f(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _ms(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x * 1e3:.{digits}f}"


def ok_transfers(rows: Sequence[Row]) -> list[Row]:
    """Measured transfer cases that verified."""
    return [r for r in rows if r.get("kind") == "transfer" and r.get("status") == "ok"]


def bars(rows: Sequence[Row]) -> str:
    """The bench's own verdict on each bar, and the counts."""
    tr = ok_transfers(rows)
    failed = [r for r in rows if r.get("kind") == "transfer" and r.get("status") == "failed"]
    skipped = [r for r in rows if r.get("kind") == "transfer" and r.get("status") == "skipped"]
    xs = [r["kvxfer_vs_nixl"] for r in tr]
    strict = [r["kvxfer_vs_nixl_strict"] for r in tr if r.get("kvxfer_vs_nixl_strict")]
    out = [
        f"{len(tr)} cases verified byte for byte, {len(failed)} failed, {len(skipped)} skipped.",
        "",
        _table(
            ["bar", "target", "worst", "holds", "worst case"],
            (
                (b["bar"], b["target"], _f(b["worst"], 3), b["holds"], b["worst_case"] or "–")
                for b in rows
                if b.get("kind") == "bar"
            ),
            right_from=2,
        ),
        "",
        f"kvxfer/NIXL over all cases: median {_f(_med(xs), 3)}, "
        f"{_share(xs, lambda x: x >= 0.95)} ≥ 0.95; strict reading: median "
        f"{_f(_med(strict), 3)}, {_share(strict, lambda x: x >= 0.95)} ≥ 0.95.",
    ]
    return "\n".join(out)


def by_configuration(rows: Sequence[Row]) -> str:
    """Median and worst per backend / mode / pattern / block size."""
    groups: dict[tuple[str, str, str, int], list[Row]] = {}
    for r in ok_transfers(rows):
        groups.setdefault((r["backend"], r["mode"], r["pattern"], r["block_size"]), []).append(r)
    body = []
    for (backend, mode, pattern, bs), v in sorted(groups.items()):
        xn = [r["kvxfer_vs_nixl"] for r in v]
        xs = [r["kvxfer_vs_nixl_strict"] for r in v if r.get("kvxfer_vs_nixl_strict")]
        xm = [r["kvxfer_vs_memcpy"] for r in v]
        nm = [r["nixl_vs_memcpy"] for r in v]
        body.append(
            (backend, mode, pattern, bs, len(v), _f(_med(xn)), _f(min(xn)), _f(_med(xs)),
             _f(_med(xm)), _f(min(xm)), _f(_med(nm)))
        )  # fmt: skip
    head = ["backend", "mode", "pattern", "bs", "cases", "kvxfer/NIXL median", "worst",
            "strict median", "kvxfer/memcpy median", "worst", "NIXL/memcpy median"]  # fmt: skip
    return _table(head, body, right_from=3)


def by_time(rows: Sequence[Row]) -> str:
    """kvxfer/NIXL by raw NIXL's median transfer time."""
    edges = [(0.0, 0.005, "< 5 ms"), (0.005, 0.01, "5–10 ms"), (0.01, 0.03, "10–30 ms"),
             (0.03, 0.1, "30–100 ms"), (0.1, 1e9, "≥ 100 ms")]  # fmt: skip
    body = []
    for lo, hi, name in edges:
        v = [r for r in ok_transfers(rows) if lo <= r["nixl_s"] < hi]
        if not v:
            continue
        for direction in ("pull", "push"):
            xs = [r["kvxfer_vs_nixl"] for r in v if r["direction"] == direction]
            # Direct backends with the raw transfer's own time (runs since nixl_post_s):
            # the transfer itself, and what is around it, against raw NIXL's.
            d = [r for r in v if r["direction"] == direction and r.get("nixl_post_s")
                 and r["backend"] != "host_bounce"]  # fmt: skip
            copy = _f(_med([r["post_s"] / r["nixl_post_s"] for r in d]), 3) if d else "–"
            around = [(r["kvxfer_s"] - r["post_s"]) - (r["nixl_s"] - r["nixl_post_s"]) for r in d]
            rest = f"{_med(around) * 1e6:+.0f}" if d else "–"
            if xs:
                body.append(
                    (name, direction, len(xs), _f(_med(xs), 3), _f(min(xs)),
                     _share(xs, lambda x: x >= 0.95), copy, rest)
                )  # fmt: skip
    head = ["raw NIXL time", "direction", "cases", "kvxfer/NIXL median", "worst", "≥ 0.95",
            "post / raw transfer (direct)", "rest µs, kvxfer − raw (direct)"]  # fmt: skip
    return _table(head, body, right_from=2)


def ucx_pulls(rows: Sequence[Row]) -> str:
    """Every ucx pull of whole blocks."""
    v = [r for r in ok_transfers(rows) if r["backend"] == "ucx" and r["direction"] == "pull"]
    body = [
        (r["label"], _f(r["kvxfer_gbps"]), _f(r["nixl_gbps"]), _f(r["memcpy_gbps"]),
         _f(r["kvxfer_vs_nixl"]), _f(r["kvxfer_vs_memcpy"]), f"{r['descriptors_posted']:,}",
         f"{r['runs']:,}" if r.get("runs") else "–", r["reps"])
        for r in v
    ]  # fmt: skip
    head = ["case (ucx, pull)", "kvxfer GB/s", "NIXL GB/s", "memcpy GB/s", "kvxfer/NIXL",
            "kvxfer/memcpy", "descriptors", "runs", "reps"]  # fmt: skip
    return _table(head, body)


def qwen_4000(rows: Sequence[Row]) -> str:
    """Qwen3-0.6B at 4000 tokens, whole blocks, every backend both ways."""
    v = [
        r
        for r in ok_transfers(rows)
        if r["model"] == "qwen3-0.6b" and r["tokens"] == 4000 and r["mode"] == "whole"
    ]
    v.sort(key=lambda r: (r["block_size"], r["backend"], r["pattern"], r["direction"]))
    body = [
        (r["label"], _f(r["kvxfer_gbps"]), _f(r["nixl_gbps"]), _f(r["kvxfer_vs_nixl"]),
         _f(r["kvxfer_vs_memcpy"]), _ms(r["handshake_s"]), _ms(r["first_transfer_s"], 0),
         _ms(r["kvxfer_s"], 0))
        for r in v
    ]  # fmt: skip
    head = ["case", "kvxfer GB/s", "NIXL GB/s", "kvxfer/NIXL", "kvxfer/memcpy",
            "handshake ms", "first transfer ms", "steady ms"]  # fmt: skip
    return _table(head, body)


def contiguous_bs16(rows: Sequence[Row]) -> str:
    """Contiguous runs at block size 16 on the direct backends (coalescing)."""
    v = [
        r
        for r in ok_transfers(rows)
        if r["block_size"] == 16
        and r["pattern"] == "contiguous"
        and r["backend"] != "host_bounce"
        and r["mode"] == "whole"
    ]
    v.sort(key=lambda r: r["kvxfer_vs_memcpy"])
    body = [
        (r["label"], _f(r["kvxfer_vs_memcpy"]), _f(r["nixl_vs_memcpy"]), _f(r["kvxfer_vs_nixl"]),
         f"{r['runs']:,}" if r.get("runs") else "–", f"{r['descriptors_posted']:,}")
        for r in v
    ]  # fmt: skip
    head = ["case", "kvxfer/memcpy", "NIXL/memcpy", "kvxfer/NIXL", "runs", "descriptors"]
    return _table(head, body)


def modes(rows: Sequence[Row]) -> str:
    """chunk_mode and swa_window_mode pulls of contiguous blocks: bytes and time saved."""
    v = [
        r
        for r in ok_transfers(rows)
        if r["mode"] != "whole" and r["pattern"] == "contiguous" and r["direction"] == "pull"
    ]
    v.sort(key=lambda r: (r["model"], r["block_size"], r["tokens"], r["mode"]))
    body = [
        (r["label"], f"{r['bytes_moved']:,}", f"{r['whole_block_bytes']:,}",
         _f(r["bytes_moved"] / r["whole_block_bytes"], 3),
         "yes" if r["bytes_moved"] == r["bytes_expected"] else "NO", _ms(r["kvxfer_s"]),
         _ms(r.get("whole_mode_s")),
         "–" if r.get("time_saved_s") is None else f"{r['time_saved_s'] * 1e3:+.1f}")
        for r in v
    ]  # fmt: skip
    head = ["case", "bytes moved", "whole-block bytes", "moved/whole", "= algebra",
            "kvxfer ms", "whole-mode ms", "time saved ms"]  # fmt: skip
    return _table(head, body)


def bounce(rows: Sequence[Row], copy_gbps: float) -> str:
    """host_bounce against direct ucx at 4000 tokens, with both floors.

    The bandwidth floor is the run's own (``bounce_bw_floor``: three copies of the bytes
    at the two-thread memcpy rate measured in the case's reps); runs from before the
    bench measured that rate use ``copy_gbps`` instead.
    """
    v = [
        r
        for r in ok_transfers(rows)
        if r["backend"] == "host_bounce" and r.get("bounce_vs_direct") and r["tokens"] == 4000
    ]
    body = []
    for r in v:
        # Three copies of the bytes (stage out, transfer, stage in) at the machine's
        # aggregate copy bandwidth: what perfect overlap could reach; never below the
        # direct transfer itself (slow when descriptor-bound, as scattered bs16).
        bw_floor = r.get("bounce_bw_floor") or max(
            1.0, 3 * r["bytes_moved"] / (copy_gbps * 1e9) / r["direct_s"]
        )
        body.append(
            (r["label"], _ms(r["kvxfer_s"]), _ms(r["direct_s"]), _f(r["bounce_vs_direct"]),
             _f(r.get("bounce_floor")), _f(r.get("memcpy_2t_gbps")), _f(bw_floor),
             _f(r["bounce_vs_direct"] / bw_floor), _f(r["kvxfer_vs_nixl"]))
        )  # fmt: skip
    head = ["case", "bounce ms", "direct ms", "bounce/direct", "sequential floor",
            "2-thread memcpy GB/s", "bandwidth floor", "bounce / bandwidth floor",
            "kvxfer/raw bounce"]  # fmt: skip
    xs = [r["bounce_vs_direct"] for r in ok_transfers(rows) if r.get("bounce_vs_direct")]
    floors = [r["bounce_bw_floor"] for r in ok_transfers(rows) if r.get("bounce_bw_floor")]
    tail = (
        f"\n\nAll host_bounce cases: bounce/direct median {_f(_med(xs))}, best {_f(min(xs))}, "
        f"{_share(xs, lambda x: x < 2)} under 2."
        if xs
        else ""
    )
    if floors:
        tail += (
            f" This machine's bandwidth floor: median {_f(_med(floors))}, "
            f"{_share(floors, lambda x: x >= 2)} of the cases at 2 or above."
        )
    return _table(head, body) + tail


def planning(rows: Sequence[Row]) -> str:
    """Planning cost per request beside the transfer."""
    v = [r for r in rows if r.get("kind") == "planning" and r.get("status") == "ok"]
    body = [
        (r["label"], f"{r['descriptors_posted']:,}", f"{r['runs']:,}", _ms(r["plan_ids_s"], 2),
         _ms(r["plan_runs_s"], 2), _ms(r["nixl_make_xfer_s"], 2), _ms(r["planning_s"], 2),
         _ms(r["kvxfer_s"]), _ms(r["prepped_total_s"]), _ms(r["premerged_total_s"]))
        for r in v
    ]  # fmt: skip
    head = ["case", "descriptors", "runs", "ids ms", "Plan.runs ms", "NIXL request ms",
            "plan+request ms", "kvxfer ms", "raw prepped ms", "raw pre-merged ms"]  # fmt: skip
    return _table(head, body)


def main(argv: Sequence[str] | None = None) -> int:
    """Print every section's table from the given ``--json`` files; 2 without any."""
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        print(__doc__)
        return 2
    try:
        rows = load(paths)
    except (OSError, ValueError) as exc:
        print(f"kvxfer bench --tables: cannot read the runs: {exc}", file=sys.stderr)
        return 2
    sections = [
        ("The bar", bars(rows)),
        ("kvxfer against raw NIXL and memcpy, by configuration", by_configuration(rows)),
        ("By transfer time", by_time(rows)),
        ("Every ucx pull", ucx_pulls(rows)),
        ("Qwen3-0.6B-shaped, 4000 tokens, every backend both ways", qwen_4000(rows)),
        ("Contiguous block runs at block size 16 (coalescing)", contiguous_bs16(rows)),
        ("chunk_mode and swa_window_mode (pulls of contiguous blocks)", modes(rows)),
        ("host_bounce against direct ucx (4000 tokens)", bounce(rows, 22.0)),
        ("Planning cost per request", planning(rows)),
    ]
    for title, body in sections:
        print(f"#### {title}\n\n{body}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
