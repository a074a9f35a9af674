"""``kvxfer bench --gather``: the gather path (issue 55) against the direct path, and the
cost model's choice against the faster of the two, in one run.

Every request is measured three ways, each its own case with its own pair of agents
over the same caches: ``gather=off`` (no staging memory: the path every agent took
before issue 55, an ordinary matrix case), ``gather=force`` (staging on, every request
gathered into the producer's staging slot, read in a few descriptors and scattered on
the consumer) and ``gather=auto`` (staging on, the cost model of
:mod:`kvxfer.core.gather_cost` picks per request, as a deployed agent does). Raw NIXL
beside each posts the direct path's descriptors, so ``kvxfer_vs_nixl`` of a gathered
case is the gather path over raw NIXL's direct read of the same request.

:func:`relate` sets each gathered case against the direct one: ``vs_direct`` (GB/s over
GB/s), the path ``auto`` took on every rep, and ``auto_slower`` — whether the model's
pick was slower than the other path by more than :data:`NOISE` (the bar of the issue:
the model never picks the slower path). Pulls only (gathered pushes are not served), on
``ucx``, whole blocks.

The pure parts live here (the option, the cases, the agents' gather config, the
cross-case figures, the report lines); the processes are the matrix's own.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

import kvxfer.tools.bench.cases as bc
from kvxfer.core.gather_cost import GatherConfig, XferPath

__all__ = [
    "DEFAULTS",
    "KIND",
    "MODES",
    "NOISE",
    "STAGING_BYTES",
    "Pick",
    "agent_config",
    "build_cases",
    "check",
    "format_lines",
    "refusal",
    "relate",
]

#: The JSON ``kind`` of a gathered case (the matrix's bars and tables read ``transfer``).
KIND = "gather"
#: The three ways each request is measured (``off`` is an ordinary matrix case).
MODES = ("off", "force", "auto")
#: What ``--models --block-sizes --tokens --patterns`` default to with ``--gather``.
DEFAULTS = {
    "models": bc.QWEN,
    "block_sizes": "16,128",
    "tokens": "4000",
    "patterns": "contiguous,scattered",
}
#: Staging memory of each agent in a gathered case (both sides register one buffer).
STAGING_BYTES = 64 << 20
#: Two paths whose GB/s differ by less than this fraction are within noise of each
#: other on a shared machine: picking either is not picking the slower one.
NOISE = 0.10
#: Matrix selectors that a gathered case fixes: pull, ucx, whole blocks.
_FIXED = ("directions", "backends", "modes")


def refusal(args: argparse.Namespace) -> str:
    """Why ``--gather`` cannot run with the other options given ("" when it can)."""
    if args.tp:
        return "not with --tp (gathered pulls between TP sizes are not measured yet)"
    if args.block_ratios:
        return "not with --block-ratios"
    if args.device is not None:
        return "host memory only (staging on a device is not served yet)"
    given = bc.given_options(args, _FIXED)
    if given:
        return (
            f"not with {', '.join(given)}: a gathered case is a pull on ucx of whole "
            "blocks (gathered pushes are not served)"
        )
    return ""


def build_cases(
    *,
    models: Sequence[str],
    block_sizes: Sequence[int],
    tokens: Sequence[int],
    patterns: Sequence[str],
) -> list[bc.Case]:
    """Every request three ways (:data:`MODES`), the direct one first.

    Raises:
        ValueError: an unknown model or pattern, or a size or token count below 1.
    """
    direct, _ = bc.build_matrix(  # the matrix's checks of the selectors, and its cases
        models=models,
        block_sizes=block_sizes,
        tokens=tokens,
        patterns=patterns,
        directions=["pull"],
        backends=["ucx"],
        modes=["whole"],
    )
    return [msgspec.structs.replace(c, gather=g) for c in direct for g in MODES]


def agent_config(case: bc.Case) -> GatherConfig:
    """The gather config of a case's agents (both sides: the producer announces and
    lends its staging, the consumer reads into and scatters from its own)."""
    if case.gather == "off":
        return GatherConfig()
    force = XferPath.GATHER if case.gather == "force" else None
    return GatherConfig(staging_bytes=STAGING_BYTES, force=force)


# -- results ----------------------------------------------------------------------------
Result = dict[str, Any]


def _key(r: Result) -> tuple[Any, ...]:
    return (r["model"], r["block_size"], r["tokens"], r["pattern"])


def _paths(r: Result) -> list[str]:
    return sorted(set(r.get("paths") or []))


def relate(results: Sequence[Result]) -> None:
    """Set every gathered case against the direct case of the same request, in place:
    ``direct_label``, ``direct_gbps``, ``direct_descriptors``, ``vs_direct`` (GB/s over
    the direct case's); on ``auto`` also ``force_gbps``, ``faster`` (the path of the
    faster of ``off`` and ``force``) and ``auto_slower`` (True where the path auto took
    on every rep is slower than the other by more than :data:`NOISE`; None where auto
    took both paths or a sibling is missing)."""
    ok = [r for r in results if r.get("status") == "ok" and r.get("direction") == "pull"]
    direct = {_key(r): r for r in ok if r.get("kind") == "transfer" and r.get("gather") == "off"}
    forced = {_key(r): r for r in ok if r.get("kind") == KIND and r.get("gather") == "force"}
    for r in ok:
        if r.get("kind") != KIND:
            continue
        ref = direct.get(_key(r))
        if ref is None or ref["bytes_moved"] != r["bytes_moved"]:
            continue
        r["direct_label"] = ref["label"]
        r["direct_gbps"] = ref["kvxfer_gbps"]
        r["direct_descriptors"] = ref["descriptors_posted"]
        r["vs_direct"] = bc.ratio(r["kvxfer_gbps"], ref["kvxfer_gbps"])
        force = forced.get(_key(r))
        if r["gather"] != "auto" or force is None:
            continue
        g_gather, g_direct = force["kvxfer_gbps"], ref["kvxfer_gbps"]
        r["force_gbps"] = g_gather
        r["faster"] = "gather" if g_gather > g_direct else "direct"
        took = _paths(r)
        if len(took) != 1:
            r["auto_slower"] = None
            continue
        mine, other = (g_gather, g_direct) if took[0] == "gather" else (g_direct, g_gather)
        r["auto_slower"] = bool(mine < (1 - NOISE) * other)


class Pick(NamedTuple):
    """How the cost model's picks fared in one run (the report turns it into a bar)."""

    #: The lowest GB/s of the path taken over the faster path's, with its case.
    worst: tuple[float, str] | None
    #: Every auto case judged, none slower than the other path beyond :data:`NOISE`.
    holds: bool
    note: str


def check(results: Sequence[Result]) -> Pick | None:
    """The bar of ``--gather`` (None without gathered cases): the cost model never
    picks the path slower by more than :data:`NOISE`."""
    autos = [r for r in results if r.get("kind") == KIND and r.get("gather") == "auto"]
    if not autos:
        return None
    judged = [r for r in autos if r.get("auto_slower") is not None]
    worst: tuple[float, str] | None = None
    for r in judged:
        took = _paths(r)[0]
        mine = r["force_gbps"] if took == "gather" else r["direct_gbps"]
        value = bc.ratio(mine, max(r["force_gbps"], r["direct_gbps"]))
        if value is not None and (worst is None or value < worst[0]):
            worst = (value, r["label"])
    every = len(judged) == len(autos)
    holds = bool(judged) and every and not any(r["auto_slower"] for r in judged)
    return Pick(worst, holds, "" if every else "auto took both paths or lacks a sibling case")


def format_lines(results: Sequence[Result]) -> list[str]:
    """The report's section on gathered cases (none without them)."""
    rows = bc.measured(results, KIND)
    if not rows:
        return []
    lines = [
        "",
        "gather path against the direct pull of the same request (same run); GB/s, x = over"
        " direct; descs: posted by kvxfer (direct: the request's runs); path: what every"
        " rep took; slower?: auto's pick slower than the other path by more than"
        f" {NOISE:.0%}:",
        f"  {'case':<56} {'kvxfer':>7} {'direct':>7} {'x direct':>8} {'descs':>7} "
        f"{'direct':>7} {'path':>13} {'slower?':>7}",
    ]
    for r in rows:
        slower = r.get("auto_slower")
        mark = "-" if slower is None else ("YES" if slower else "no")
        lines.append(
            f"  {r['label']:<56} {bc.fmt(r['kvxfer_gbps']):>7} {bc.fmt(r.get('direct_gbps')):>7} "
            f"{bc.fmt(r.get('vs_direct')):>8} {r['descriptors_posted']:>7} "
            f"{r.get('direct_descriptors', '-'):>7} {'+'.join(_paths(r)) or '-':>13} "
            f"{mark if r['gather'] == 'auto' else '':>7}"
        )
    return lines
