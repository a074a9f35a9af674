"""Results of ``kvxfer bench``: cross-case figures, the bar, the table and the plot."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import kvxfer.tools.bench.block_ratio as block_ratio
import kvxfer.tools.bench.gather as gather

__all__ = ["bar", "check_bars", "format_bars", "format_summary", "format_table", "plot", "relate"]

Result = dict[str, Any]

#: Targets of issue 6 / R-CLI-3 (ratios from one run).
NIXL_BAR = 0.95
MEMCPY_BAR_BS16 = 0.6
BOUNCE_BAR = 2.0
#: Issue 27: push at pull's speed.
PUSH_BAR = 0.95


def _key(r: Result, **override: Any) -> tuple[Any, ...]:
    f = {**r, **override}
    return (
        f["model"],
        f["block_size"],
        f["tokens"],
        f["pattern"],
        f["direction"],
        f["backend"],
        f["mode"],
    )


def _ok(r: Result) -> bool:
    return r.get("status") == "ok" and r.get("kind") == "transfer"


def relate(results: Sequence[Result]) -> None:
    """Add figures that need a sibling case of the same run, in place.

    ``time_saved_s`` / ``whole_mode_s`` for chunk and window modes (against the same
    case moving whole blocks); ``direct_s`` / ``bounce_vs_direct`` for host bounce
    (against the same case on ucx), with two floors: ``bounce_floor`` (the two extra
    copies one after the other at single-thread memcpy speed) and ``bounce_bw_floor``
    (perfect overlap at the two-thread copy rate of the case's reps), and
    ``bounce_vs_floor`` (the ratio over the latter); ``push_vs_pull`` (GB/s) and
    ``nixl_write_vs_read`` (raw NIXL's WRITE over its READ) for a push against the same
    case pulled; a pull between block sizes against the equal-size pull of the same
    bytes (:func:`.block_ratio.relate`).
    """
    index = {_key(r): r for r in results if _ok(r)}
    for r in results:
        if not _ok(r):
            continue
        if r["direction"] == "push":
            pull = index.get(_key(r, direction="pull"))
            if pull is not None and r["kvxfer_s"] and r["nixl_s"]:
                # Same bytes, same descriptors, the other way round: push over pull in
                # GB/s, beside raw NIXL's own WRITE over its READ (the transport's).
                r["pull_s"] = pull["kvxfer_s"]
                r["push_vs_pull"] = pull["kvxfer_s"] / r["kvxfer_s"]
                r["nixl_write_vs_read"] = pull["nixl_s"] / r["nixl_s"]
        if r["mode"] != "whole":
            whole = index.get(_key(r, mode="whole"))
            if whole is not None:
                r["whole_mode_s"] = whole["kvxfer_s"]
                r["time_saved_s"] = whole["kvxfer_s"] - r["kvxfer_s"]
        if r["backend"] == "host_bounce":
            direct = index.get(_key(r, backend="ucx"))
            if direct is not None and direct["kvxfer_s"]:
                r["direct_s"] = direct["kvxfer_s"]
                r["bounce_cost_s"] = r["kvxfer_s"] - direct["kvxfer_s"]
                r["bounce_vs_direct"] = r["kvxfer_s"] / direct["kvxfer_s"]
                # Two extra copies of the bytes at best memcpy speed each, on a box whose
                # memory bandwidth one copy already saturates: the best bounce can do.
                if direct.get("kvxfer_vs_memcpy"):
                    r["bounce_floor"] = 1 + 2 * direct["kvxfer_vs_memcpy"]
                # Perfect overlap instead: every byte still crosses the memory bus three
                # times (stage out, transfer, stage in), at best at the rate two copies
                # side by side reach (measured in this case's reps); never below the
                # direct transfer itself.
                if r.get("memcpy_2t_gbps"):
                    three = 3 * r["bytes_moved"] / (r["memcpy_2t_gbps"] * 1e9)
                    r["bounce_bw_floor"] = max(1.0, three / direct["kvxfer_s"])
                    r["bounce_vs_floor"] = r["bounce_vs_direct"] / r["bounce_bw_floor"]
    block_ratio.relate(results)  # pulls between block sizes against their equal-size pull
    gather.relate(results)  # gathered pulls against the direct pull of the same request


def _worst(rows: list[tuple[float, str]], lowest: bool = True) -> tuple[float, str] | None:
    if not rows:
        return None
    return min(rows) if lowest else max(rows)


def bar(
    name: str, target: str, worst: tuple[float, str] | None, holds: bool | None, note: str = ""
) -> Result:
    """One bar's JSON object: the worst value of the run and its case, whether the
    target holds (None when no case measured it), and a note that puts it in context."""
    return {
        "kind": "bar",
        "bar": name,
        "target": target,
        "worst": None if worst is None else round(worst[0], 4),
        "worst_case": None if worst is None else worst[1],
        "holds": holds if worst is not None else None,
        "note": note,
    }


def format_bars(bars: Sequence[Result], width: int = 56) -> list[str]:
    """The ``bar:`` section of a report, one line per bar (and its note)."""
    lines = ["bar:"]
    for b in bars:
        verdict = {True: "holds", False: "MISSED", None: "n/a"}[b["holds"]]
        lines.append(
            f"  {b['bar']:<{width}} {b['target']:>11}  worst {_f(b['worst'], '{:.3f}'):>7}"
            f"  {verdict}  {b['worst_case'] or ''}"
        )
        if b.get("note"):
            lines.append(f"    ({b['note']})")
    return lines


def check_bars(results: Sequence[Result], cma: Result | None = None) -> list[Result]:
    """The issue's targets, each with the worst value of this run and whether it holds.

    ``cma``: the run header's measurement of the kernel's copy between two processes
    (:mod:`kvxfer.tools.cma`), quoted beside the push bar.
    """
    ok = [r for r in results if _ok(r)]
    # Pulls between block sizes post the very runs raw NIXL posts: the same two bars.
    runs = ok + [r for r in results if r.get("kind") == block_ratio.KIND and r["status"] == "ok"]
    checks: list[Result] = []

    def add(
        name: str,
        target: str,
        worst: tuple[float, str] | None,
        holds: bool | None,
        note: str = "",
    ) -> None:
        checks.append(bar(name, target, worst, holds, note))

    nixl = _worst([(r["kvxfer_vs_nixl"], r["label"]) for r in runs if r["kvxfer_vs_nixl"]])
    add(
        "kvxfer vs raw NIXL, same descriptors",
        f">= {NIXL_BAR}",
        nixl,
        nixl is not None and nixl[0] >= NIXL_BAR,
    )
    bs16 = _worst(
        [
            (r["kvxfer_vs_memcpy"], r["label"])
            for r in ok
            if r["block_size"] == 16
            and r["pattern"] == "contiguous"
            and r["backend"] != "host_bounce"
            and r["mode"] == "whole"
            and r["kvxfer_vs_memcpy"]
        ]
    )
    add(
        "contiguous bs16 vs memcpy (coalescing)",
        f">= {MEMCPY_BAR_BS16}",
        bs16,
        bs16 is not None and bs16[0] >= MEMCPY_BAR_BS16,
    )
    modes = [r for r in ok if r["mode"] != "whole"]
    exact = all(r["bytes_moved"] == r["bytes_expected"] <= r["whole_block_bytes"] for r in modes)
    saved = _worst(
        [(r["bytes_moved"] / r["whole_block_bytes"], r["label"]) for r in modes], lowest=False
    )
    add(
        "chunk/window bytes exactly as the algebra (moved/whole)",
        "== algebra",
        saved,
        exact if modes else None,
    )
    bounce = _worst(
        [(r["bounce_vs_direct"], r["label"]) for r in ok if "bounce_vs_direct" in r], lowest=False
    )
    add(
        "host_bounce time vs direct ucx",
        f"< {BOUNCE_BAR}",
        bounce,
        bounce is not None and bounce[0] < BOUNCE_BAR,
        _floor_note([r for r in ok if "bounce_bw_floor" in r]),
    )
    pushes = [r for r in ok if "push_vs_pull" in r]
    push = _worst([(r["push_vs_pull"], r["label"]) for r in pushes])
    add(
        "push vs pull, same case (GB/s)",
        f">= {PUSH_BAR}",
        push,
        push is not None and push[0] >= PUSH_BAR,
        _transport_note(pushes, cma),
    )
    again = _worst(
        [(float(r["handshakes_in_timed_reps"] or 0), r["label"]) for r in runs], lowest=False
    )
    add("handshakes after the first transfer", "== 0", again, again is not None and again[0] == 0)
    picked = gather.check(results)
    if picked is not None:
        add(
            "gather model's pick vs the faster path (GB/s)",
            f">= {1 - gather.NOISE:.2f}",
            picked.worst,
            picked.holds,
            picked.note,
        )
    return checks


def _floor_note(rows: Sequence[Result]) -> str:
    """Where this machine puts host bounce's floor, and how close the bounce came."""
    if not rows:
        return ""
    floors = [r["bounce_bw_floor"] for r in rows]
    over = [r["bounce_vs_floor"] for r in rows]
    above = sum(f >= BOUNCE_BAR for f in floors)
    return (
        f"this machine's floor (3 copies at the two-thread memcpy rate): median "
        f"{statistics.median(floors):.2f}x direct, >= {BOUNCE_BAR}x in {above} of "
        f"{len(rows)} cases; bounce / floor median {statistics.median(over):.2f}"
    )


def _transport_note(rows: Sequence[Result], cma: Result | None) -> str:
    """What the transport itself reaches writing against reading, on this run."""
    if not rows:
        return ""
    wr = [r["nixl_write_vs_read"] for r in rows]
    note = (
        f"raw NIXL's WRITE over its READ in the same cases: median "
        f"{statistics.median(wr):.2f}, worst {min(wr):.2f}"
    )
    if cma:
        from kvxfer.tools.cma import describe

        note += (
            "; this kernel's process_vm_writev over readv (UCX's copy between two processes"
            f" on one host; the bench's caches on {cma.get('numpy_pages', '?')} pages):"
            f" {describe(cma)}"
        )
    return note


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _first_over_steady(r: Result) -> float | None:
    """The first transfer after the handshake over the median timed one (goal: <= 1.2)."""
    steady = r.get("kvxfer_s")
    return r["first_transfer_s"] / steady if steady else None


def format_table(results: Sequence[Result], bars: Sequence[Result]) -> str:
    """A human-readable report: one line per case, planning cost, then the bar."""
    head = (
        f"{'case':<58} {'kvxfer':>7} {'nixl':>7} {'memcpy':>7} {'x nixl':>6} "
        f"{'x mcpy':>6} {'descs':>7} {'runs':>6} {'moved/whole':>11} {'first ms':>8} {'1st/st':>6}"
    )
    lines = [
        "GB/s (decimal), medians of the timed reps; x = ratio of GB/s; 1st/st: the first"
        " transfer after the handshake over the median timed one",
        head,
    ]
    for r in results:
        if r.get("kind") == "bar":
            continue
        if r.get("status") != "ok":
            lines.append(f"{r['label']:<58} {r.get('status', '?').upper()}: {r.get('reason', '')}")
            continue
        frac = r["bytes_moved"] / r["whole_block_bytes"] if r["whole_block_bytes"] else 0
        lines.append(
            f"{r['label']:<58} {_f(r['kvxfer_gbps']):>7} {_f(r['nixl_gbps']):>7} "
            f"{_f(r['memcpy_gbps']):>7} {_f(r['kvxfer_vs_nixl']):>6} "
            f"{_f(r['kvxfer_vs_memcpy']):>6} {r['descriptors_posted']:>7} {_f(r['runs'], '{}'):>6} "
            f"{frac:>11.3f} {_f(r['first_transfer_s'] * 1e3, '{:.1f}'):>8} "
            f"{_f(_first_over_steady(r)):>6}"
        )
    plans = [r for r in results if r.get("kind") == "planning" and r.get("status") == "ok"]
    if plans:
        lines += [
            "",
            "planning cost per request (engine block list -> posted transfer), ms; then",
            "block list -> DONE: kvxfer; raw NIXL with prepared lists + the plan's indices",
            "(NIXL merges contiguous pairs); raw NIXL with kvxfer's merged runs as",
            "per-request lists (initialize_xfer):",
            f"{'case':<58} {'ids':>6} {'runs':>6} {'nixl prep':>9} {'plan+prep':>9} "
            f"{'kvxfer':>8} {'prepped':>8} {'premerged':>9}",
        ]
        for r in plans:
            lines.append(
                f"{r['label']:<58} {r['plan_ids_s'] * 1e3:>6.2f} {r['plan_runs_s'] * 1e3:>6.2f} "
                f"{r['nixl_make_xfer_s'] * 1e3:>9.2f} {r['planning_s'] * 1e3:>9.2f} "
                f"{r['kvxfer_s'] * 1e3:>8.1f} {r['prepped_total_s'] * 1e3:>8.1f} "
                f"{r['premerged_total_s'] * 1e3:>9.1f}"
            )
    bounce = [r for r in results if "bounce_vs_direct" in r]
    if bounce:
        lines += ["", "host_bounce over direct ucx (same case):"]
        lines += [
            f"  {r['label']:<58} {r['bounce_vs_direct']:.2f}x "
            f"(+{r['bounce_cost_s'] * 1e3:.1f} ms; floors: copies in sequence "
            f"{_f(r.get('bounce_floor'))}x, overlapped {_f(r.get('bounce_bw_floor'))}x)"
            for r in bounce
        ]
    pushes = [r for r in results if "push_vs_pull" in r]
    if pushes:
        lines += [
            "",
            "push against pull (same case; GB/s over GB/s): kvxfer, then raw NIXL's WRITE over"
            " its READ",
        ]
        lines += [
            f"  {r['label']:<58} {r['push_vs_pull']:.2f}  raw NIXL {r['nixl_write_vs_read']:.2f}"
            for r in pushes
        ]
    lines += block_ratio.format_lines(results)
    lines += gather.format_lines(results)
    saved = [r for r in results if "time_saved_s" in r]
    if saved:
        lines += ["", "chunk/window modes against whole blocks (same case):"]
        lines += [
            f"  {r['label']:<58} bytes {r['bytes_moved']:,}/{r['whole_block_bytes']:,}, "
            f"time saved {r['time_saved_s'] * 1e3:+.1f} ms"
            for r in saved
        ]
    summary = format_summary(results)
    if summary:
        lines += ["", summary]
    lines += ["", *format_bars(bars)]
    return "\n".join(lines)


def format_summary(results: Sequence[Result]) -> str:
    """Ratios aggregated per backend, mode, allocation pattern and block size."""
    groups: dict[tuple[str, str, str, int], list[Result]] = {}
    for r in results:
        if _ok(r):
            key = (r["backend"], r["mode"], r["pattern"], r["block_size"])
            groups.setdefault(key, []).append(r)
    if not groups:
        return ""

    def med(rows: list[Result], k: str) -> float | None:
        vals = sorted(v for r in rows if (v := r.get(k)) is not None)
        return vals[len(vals) // 2] if vals else None

    lines = [
        "summary over models, prompt lengths and directions (median / worst of the cases):",
        f"{'backend':<12} {'mode':<7} {'pattern':<11} {'bs':>5} {'cases':>5} "
        f"{'x nixl med':>10} {'worst':>6} {'x mcpy med':>10} {'worst':>6} {'nixl x mcpy':>11}",
    ]
    for (backend, mode, pattern, bs), rows in sorted(groups.items()):
        xn = [r["kvxfer_vs_nixl"] for r in rows if r.get("kvxfer_vs_nixl") is not None]
        xm = [r["kvxfer_vs_memcpy"] for r in rows if r.get("kvxfer_vs_memcpy") is not None]
        lines.append(
            f"{backend:<12} {mode:<7} {pattern:<11} {bs:>5} {len(rows):>5} "
            f"{_f(med(rows, 'kvxfer_vs_nixl')):>10} {_f(min(xn) if xn else None):>6} "
            f"{_f(med(rows, 'kvxfer_vs_memcpy')):>10} {_f(min(xm) if xm else None):>6} "
            f"{_f(med(rows, 'nixl_vs_memcpy')):>11}"
        )
    return "\n".join(lines)


def plot(results: Sequence[Result], path: str) -> str | None:
    """GB/s against block size, one panel per direction; returns an error or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            "--plot needs matplotlib: pip install 'kvxfer[bench]' (or matplotlib); no plot written"
        )
    ok = [r for r in results if _ok(r)]
    directions = sorted({r["direction"] for r in ok}) or ["pull"]
    fig, axes = plt.subplots(1, len(directions), figsize=(8 * len(directions), 5.5), squeeze=False)
    colors = plt.get_cmap("tab10")
    for ax, d in zip(axes[0], directions):
        # One line per backend/mode/pattern: the median over models and prompt lengths
        # at each block size; kvxfer solid, raw NIXL dashed in the same colour.
        cells: dict[tuple[str, int], dict[str, list[float]]] = {}
        memcpy: dict[int, list[float]] = {}
        for r in ok:
            if r["direction"] != d:
                continue
            tag = f"{r['backend']}/{r['mode']} {r['pattern']}"
            cell = cells.setdefault((tag, r["block_size"]), {"kvxfer": [], "nixl": []})
            cell["kvxfer"].append(r["kvxfer_gbps"])
            cell["nixl"].append(r["nixl_gbps"])
            memcpy.setdefault(r["block_size"], []).append(r["memcpy_gbps"])
        tags = sorted({t for t, _ in cells})
        for n, tag in enumerate(tags):
            sizes = sorted(b for t, b in cells if t == tag)
            for who, style in (("kvxfer", "-o"), ("nixl", "--x")):
                ys = [statistics.median(cells[(tag, b)][who]) for b in sizes]
                label = f"{tag} ({'kvxfer' if who == 'kvxfer' else 'raw NIXL'})"
                ax.plot(sizes, ys, style, color=colors(n % 10), label=label)
        sizes = sorted(memcpy)
        ys = [statistics.median(memcpy[b]) for b in sizes]
        ax.plot(sizes, ys, ":", color="gray", label="memcpy of the same bytes")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("GB/s (median over models and prompt lengths)")
        ax.set_title(f"kvxfer bench: {d}")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
