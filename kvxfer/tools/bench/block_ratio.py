"""``kvxfer bench --block-ratios``: pulls between a producer and a consumer of different
block sizes (issue 54), beside raw NIXL and memcpy of the same bytes.

A case ``P:C`` holds the producer's cache in blocks of ``P`` tokens and the consumer's
in blocks of ``C``, one a whole multiple of the other (llm-d's prefill 128 with decode
16 or 64, or the reverse). kvxfer's pull posts the address runs that
:mod:`kvxfer.core.ratio` plans unit by unit (a unit: a block of the smaller size); raw
NIXL posts the very same runs, planned inside its own timed region, as per-request
lists (``initialize_xfer``, as kvxfer's ``Backend.post_runs`` does). Every ratio case
comes with the pull of equal block sizes at the unit size, measured in the same run:
it moves exactly the same bytes, so ``vs_equal`` (GB/s over GB/s) is what the ratio
itself costs. Pulls only (a push between sizes is refused by kvxfer), on ``ucx``,
whole blocks.

The pure parts live here (the option, the cases, the plan of a case, the cross-case
figures, the report lines); the processes are the matrix's own (:mod:`.runner`,
:mod:`.worker`), which ask :attr:`.cases.Case.is_ratio` where a ratio differs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

import kvxfer.tools.bench.cases as bc
from kvxfer.core.descriptors import Runs
from kvxfer.core.layout import KVLayout
from kvxfer.core.ratio import pair_units, unit_runs

__all__ = [
    "DEFAULTS",
    "KIND",
    "build_cases",
    "format_lines",
    "parse_ratios",
    "pull_runs",
    "refusal",
    "relate",
    "split_at_regions",
]

#: The JSON ``kind`` of a ratio case (the matrix's bars and tables read ``transfer``).
KIND = "ratio"
#: What ``--models --tokens --patterns`` default to with ``--block-ratios``.
DEFAULTS = {"models": bc.QWEN, "tokens": "4000", "patterns": "contiguous"}
#: Matrix selectors that a ratio case fixes: pull, ucx, whole blocks, sizes from the pairs.
_FIXED = ("block_sizes", "directions", "backends", "modes")

U64 = npt.NDArray[np.uint64]


def parse_ratios(text: str) -> list[tuple[int, int]]:
    """``"128:16,16:128"`` as ``[(producer, consumer), ...]``.

    Raises:
        ValueError: a pair that is not ``P:C`` with positive ints, equal sizes (the
            equal-size pull is measured beside every ratio anyway), or sizes neither of
            which divides the other (kvxfer refuses those at the handshake).
    """
    pairs: list[tuple[int, int]] = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        try:
            p, c = (int(v) for v in item.split(":"))
        except ValueError:
            raise ValueError(f"--block-ratios {item!r}: not P:C (e.g. 128:16)") from None
        if p < 1 or c < 1:
            raise ValueError(f"--block-ratios {item}: block sizes must be positive")
        if p == c:
            raise ValueError(
                f"--block-ratios {item}: equal sizes; the equal-size pull is measured "
                "beside every ratio"
            )
        if max(p, c) % min(p, c):
            raise ValueError(
                f"--block-ratios {item}: neither size divides the other (kvxfer serves "
                "whole multiples only)"
            )
        if (p, c) not in pairs:
            pairs.append((p, c))
    if not pairs:
        raise ValueError("--block-ratios: no P:C pair given")
    return pairs


def refusal(args: argparse.Namespace) -> str:
    """Why ``--block-ratios`` cannot run with the other options given ("" when it can)."""
    if args.tp:
        return "not with --tp (different block sizes are served between equal TP sizes)"
    if args.device is not None:
        return "host memory only (not with --device)"
    given = bc.given_options(args, _FIXED)
    if given:
        return (
            f"not with {', '.join(given)}: a ratio case is a pull on ucx of whole blocks, "
            "its sizes the P:C pairs"
        )
    return ""


def build_cases(
    *,
    ratios: Sequence[tuple[int, int]],
    models: Sequence[str],
    tokens: Sequence[int],
    patterns: Sequence[str],
) -> list[bc.Case]:
    """Every ratio case, each followed by its equal-size pull at the unit size (once).

    Raises:
        ValueError: an unknown model or pattern, or a token count below 1.
    """
    bc.build_matrix(  # the matrix's checks of the selectors
        models=models,
        block_sizes=[1],
        tokens=tokens,
        patterns=patterns,
        directions=["pull"],
        backends=["ucx"],
        modes=["whole"],
    )
    cases: list[bc.Case] = []
    for model in models:
        for n in tokens:
            for pattern in patterns:
                for p, c in ratios:
                    equal = bc.Case(
                        model=model,
                        block_size=min(p, c),
                        tokens=n,
                        pattern=pattern,
                        direction="pull",
                        backend="ucx",
                    )
                    ratio = msgspec.structs.replace(equal, block_size=p, consumer_block_size=c)
                    cases += [case for case in (ratio, equal) if case not in cases]
    return cases


# -- in a bench process -----------------------------------------------------------------
def pull_runs(
    case: bc.Case,
    local: KVLayout,
    remote: KVLayout,
    local_blocks: npt.NDArray[np.int64],
    remote_blocks: npt.NDArray[np.int64],
) -> Runs:
    """The address runs a pull of ``case`` moves: its block lists (one for every KV
    cache group, as the bench's caches share one block table) paired unit by unit and
    turned into runs, as kvxfer's consumer plans each request."""
    pairing = pair_units(
        (local_blocks,) * len(local.groups),
        (remote_blocks,) * len(remote.groups),
        num_tokens=case.tokens,
        remote_num_tokens=case.tokens,
        local_block_size=local.block_size,
        remote_block_size=remote.block_size,
    )
    return unit_runs(local, remote, pairing)


def split_at_regions(runs: Runs, local: KVLayout, remote: KVLayout) -> tuple[U64, U64, U64]:
    """``(local_addr, remote_addr, length)`` of the runs cut where a region of either
    side ends: runs merge across regions that lie back to back (one pool), and the
    exact check (:func:`.data.verify_regions`) reads each descriptor inside one region
    of each side."""
    la, ra, ln = runs.local_addr, runs.remote_addr, runs.length
    lend = np.unique(np.array([r.end for r in local.regions], dtype=np.uint64))
    rend = np.unique(np.array([r.end for r in remote.regions], dtype=np.uint64))

    def crossings(start: U64, ends: U64) -> npt.NDArray[np.int64]:
        lo = np.searchsorted(ends, start, side="right")
        hi = np.searchsorted(ends, start + ln, side="left")
        return (hi - lo).astype(np.int64)

    cross = (crossings(la, lend) + crossings(ra, rend)) > 0
    if not cross.any():
        return la, ra, ln
    out_l, out_r, out_n = [la[~cross]], [ra[~cross]], [ln[~cross]]
    for a, b, n in zip(la[cross].tolist(), ra[cross].tolist(), ln[cross].tolist()):
        cuts = {int(e) - a for e in lend if a < e < a + n}
        cuts |= {int(e) - b for e in rend if b < e < b + n}
        edges = [0, *sorted(cuts), n]
        out_l.append(np.array([a + x for x in edges[:-1]], dtype=np.uint64))
        out_r.append(np.array([b + x for x in edges[:-1]], dtype=np.uint64))
        out_n.append(np.diff(np.array(edges, dtype=np.uint64)))
    return np.concatenate(out_l), np.concatenate(out_r), np.concatenate(out_n)


# -- results ----------------------------------------------------------------------------
Result = dict[str, Any]


def _equal_key(r: Result, block_size: int) -> tuple[Any, ...]:
    return (r["model"], block_size, r["tokens"], r["pattern"], r["backend"])


def relate(results: Sequence[Result]) -> None:
    """Set every measured ratio case against the equal-size pull of the same run that
    moves the same bytes (both sides at the unit size), in place: ``equal_label``,
    ``equal_gbps`` and ``equal_nixl_gbps``, ``equal_descriptors`` and ``equal_runs``,
    ``vs_equal`` (kvxfer's GB/s over the equal pull's) and ``nixl_vs_equal`` (raw
    NIXL's, over its own on the equal pull)."""
    equal = {
        _equal_key(r, r["block_size"]): r
        for r in results
        if r.get("kind") == "transfer"
        and r.get("status") == "ok"
        and r["direction"] == "pull"
        and r["mode"] == "whole"
    }
    for r in results:
        if r.get("kind") != KIND or r.get("status") != "ok":
            continue
        unit = min(r["block_size"], r["consumer_block_size"])
        ref = equal.get(_equal_key(r, unit))
        if ref is None or ref["bytes_moved"] != r["bytes_moved"]:
            continue
        r["equal_label"] = ref["label"]
        r["equal_gbps"] = ref["kvxfer_gbps"]
        r["equal_nixl_gbps"] = ref["nixl_gbps"]
        r["equal_descriptors"] = ref["descriptors_posted"]
        r["equal_runs"] = ref["runs"]
        r["vs_equal"] = bc.ratio(r["kvxfer_gbps"], ref["kvxfer_gbps"])
        r["nixl_vs_equal"] = bc.ratio(r["nixl_gbps"], ref["nixl_gbps"])


def format_lines(results: Sequence[Result]) -> list[str]:
    """The report's section on ratio cases (none without them)."""
    rows = bc.measured(results, KIND)
    if not rows:
        return []
    lines = [
        "",
        "block-size ratios (producer:consumer) against the equal-size pull of the same bytes"
        " (both sides at the smaller size, same run); GB/s, x = ratio over equal; descs:"
        " the runs posted (the equal pull: per-block descriptors, which NIXL merges into runs):",
        f"  {'case':<44} {'kvxfer':>7} {'equal':>7} {'x equal':>7} {'nixl':>7} {'equal':>7} "
        f"{'x equal':>7} {'descs':>7} {'equal descs/runs':>16}",
    ]
    for r in rows:
        lines.append(
            f"  {r['label']:<44} {bc.fmt(r['kvxfer_gbps']):>7} {bc.fmt(r.get('equal_gbps')):>7} "
            f"{bc.fmt(r.get('vs_equal')):>7} {bc.fmt(r['nixl_gbps']):>7} "
            f"{bc.fmt(r.get('equal_nixl_gbps')):>7} {bc.fmt(r.get('nixl_vs_equal')):>7} "
            f"{r['descriptors_posted']:>7} "
            f"{'{}/{}'.format(r.get('equal_descriptors', '-'), r.get('equal_runs', '-')):>16}"
        )
    return lines
