"""The targets of ``kvxfer bench --tp`` (issue 27), checked on one run's TP cases.

Each bar carries the worst value of the run, the case it came from, whether it holds,
and a note with what puts it in context: how many of the ratio's intervals reach the
bar (a median just under it may be noise), and raw NIXL's own first transfer over its
steady one (what the transport itself pays once).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from kvxfer.tools.bench.report import bar, format_bars

__all__ = ["FIRST_BAR", "RUNS_BAR", "format_tp_bars", "tp_bars"]

Result = dict[str, Any]

#: kvxfer over raw NIXL posting the fewest runs of the same bytes.
RUNS_BAR = 0.95
#: The first transfer after the handshake over the steady median.
FIRST_BAR = 1.2


def tp_bars(results: Sequence[Result]) -> list[Result]:
    """Posted units against the fewest runs, kvxfer against raw NIXL's merged runs, and
    the first request against the steady ones, over the cases that ran."""
    ok = [r for r in results if r.get("kind") == "tp" and r.get("status") == "ok"]
    bars: list[Result] = []

    posted = [
        (r["units_posted"] / r["runs"], r["label"])
        for r in ok
        if r.get("units_posted") and r.get("runs")
    ]
    worst = max(posted) if posted else None
    bars.append(
        bar(
            "units posted over the fewest runs of the bytes",
            "== 1",
            worst,
            worst is not None and worst[0] == 1,
        )
    )

    ratios = [(r["kvxfer_vs_nixl_runs"], r["label"]) for r in ok if r.get("kvxfer_vs_nixl_runs")]
    worst = min(ratios) if ratios else None
    cis = [r["kvxfer_vs_nixl_runs_ci"] for r in ok if r.get("kvxfer_vs_nixl_runs_ci")]
    note = ""
    if cis:
        reach = sum(ci[1] >= RUNS_BAR for ci in cis)
        note = f"{reach} of {len(cis)} cases' 95% intervals reach {RUNS_BAR}"
    bars.append(
        bar(
            "kvxfer vs raw NIXL on the merged runs",
            f">= {RUNS_BAR}",
            worst,
            worst is not None and worst[0] >= RUNS_BAR,
            note,
        )
    )

    firsts = [(r["first_vs_steady"], r["label"]) for r in ok if r.get("first_vs_steady")]
    worst = max(firsts) if firsts else None
    raw = [r["nixl_first_vs_steady"] for r in ok if r.get("nixl_first_vs_steady")]
    counts = sorted({len(r.get("first_samples_s") or ()) for r in ok} - {0})
    note = (
        f"each case's median of {'/'.join(map(str, counts))} first request(s), every one "
        "from a fresh start of its processes, over that start's steady median; "
        if counts
        else ""
    )
    if raw:
        note += (
            f"raw NIXL's own first transfer over its steady median in the same cases: "
            f"median {statistics.median(raw):.2f}, worst {max(raw):.2f}"
        )
    note += _by_position(ok)
    bars.append(
        bar(
            "first request over the steady median",
            f"<= {FIRST_BAR}",
            worst,
            worst is not None and worst[0] <= FIRST_BAR,
            note,
        )
    )
    return bars


def _by_position(ok: Sequence[Result]) -> str:
    """The firsts' medians by which ran first after a start (starts alternate it):
    the leader pays for the quiet before it, whichever it is."""
    cols = {
        k: [r[k] for r in ok if r.get(k) is not None]
        for k in (
            "first_vs_steady_leading",
            "first_vs_steady_following",
            "nixl_first_vs_steady_leading",
            "nixl_first_vs_steady_following",
        )
    }
    if not all(cols.values()):
        return ""

    def span(xs: list[float]) -> str:
        return f"{min(xs):.2f}-{max(xs):.2f}"

    return (
        "; by which ran first after a start, the cases' medians: kvxfer's first "
        f"{span(cols['first_vs_steady_leading'])} leading, "
        f"{span(cols['first_vs_steady_following'])} after raw NIXL's; raw NIXL's "
        f"{span(cols['nixl_first_vs_steady_leading'])} leading, "
        f"{span(cols['nixl_first_vs_steady_following'])} after kvxfer's"
    )


def format_tp_bars(bars: Sequence[Result]) -> str:
    """The bars as the matrix bench prints them."""
    return "\n".join(format_bars(bars, width=50))
