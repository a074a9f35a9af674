"""The gather cost model's contracts by exact values (kvxfer.core.gather_cost, issue
55): every refusal's whole words, each estimate against the formula of the module
docstring worked by hand, and the choice at its boundaries (``min_runs``, a forced
single run, an estimate exactly at ``margin`` times direct). What the mutation run of
``scripts/mutation.sh gather_cost`` showed the properties of tests/test_gather_cost.py
left open."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvxfer.core.descriptors import Runs
from kvxfer.core.gather_cost import (
    GatherConfig,
    XferPath,
    choose_path,
    direct_seconds,
    fit_costs,
    gather_estimate,
    gather_seconds,
)
from kvxfer.core.gather_plan import staging_rounds
from kvxfer.errors import ConfigError, PlanError

#: Costs chosen so that every term of an estimate is a distinct power of ten.
COSTS = dict(
    descriptor_s=1e-6,
    link_gbps=0.001,
    copy_gbps=0.01,
    copy_call_s=1e-3,
    copy_piece_s=1e-5,
    round_s=1e-2,
)


def _runs(n: int, length: int, gap: int = 8) -> Runs:
    """``n`` runs of ``length`` bytes, ``gap`` bytes apart on both sides."""
    at = np.arange(n, dtype=np.uint64) * np.uint64(length + gap)
    zero = np.zeros(n, dtype=np.int64)
    return Runs(
        at + np.uint64(1 << 20),
        at + np.uint64(1 << 30),
        np.full(n, length, dtype=np.uint64),
        zero,
        zero,
    )


@pytest.mark.parametrize(
    ("kw", "key", "rule"),
    [
        ({"staging_bytes": -1}, "gather.staging_bytes", "must be an int >= 0"),
        ({"min_runs": 1.0}, "gather.min_runs", "must be an int >= 0"),
        ({"round_s": "0"}, "gather.round_s", "must be a number"),
        ({"link_gbps": 0}, "gather.link_gbps", "must be finite and > 0"),
        ({"copy_gbps": -2.0}, "gather.copy_gbps", "must be finite and > 0"),
        ({"descriptor_s": -1.0}, "gather.descriptor_s", "must be finite and >= 0"),
        ({"copy_piece_s": math.inf}, "gather.copy_piece_s", "must be finite and >= 0"),
        ({"slots": 0}, "gather.slots", "must be an int >= 1"),
        ({"slots": True}, "gather.slots", "must be an int >= 1"),
        ({"slots": 2.0}, "gather.slots", "must be an int >= 1"),
        ({"staging_bytes": 3, "slots": 4}, "gather.staging_bytes", "must be >= slots (4)"),
        ({"margin": True}, "gather.margin", "must be a number in (0, 1]"),
        ({"margin": 1.0001}, "gather.margin", "must be a number in (0, 1]"),
        ({"margin": "0.5"}, "gather.margin", "must be a number in (0, 1]"),
    ],
)
def test_each_refusal_in_its_whole_words(kw: dict[str, object], key: str, rule: str) -> None:
    with pytest.raises(ConfigError) as info:
        GatherConfig(**kw)  # type: ignore[arg-type]
    value = kw[key.removeprefix("gather.")]
    assert (info.value.key, info.value.value, info.value.rule) == (key, value, rule)


def test_the_edges_of_the_rules_are_allowed() -> None:
    one = GatherConfig(staging_bytes=4, slots=4, margin=1.0, min_runs=0, descriptor_s=0.0)
    assert (one.slot_bytes, one.margin) == (1, 1.0)
    assert GatherConfig(slots=1).slots == 1
    assert GatherConfig(staging_bytes=1, slots=1).enabled


def test_the_estimates_are_the_formula_worked_by_hand() -> None:
    cfg = GatherConfig(staging_bytes=4000, **COSTS)  # type: ignore[arg-type]
    # Direct: 10 runs at 1 µs + 11,000 bytes at 1 MB/s.
    assert direct_seconds(cfg, 10, 11_000) == pytest.approx(10e-6 + 11e-3, rel=1e-12, abs=0)
    # Gathered, before planning: 3 rounds of up to 4000 bytes, 10 + 3 - 1 = 12 pieces
    # a side.
    want = (
        3 * (1e-6 + 1e-2)  # a descriptor and the control of each round
        + 11_000 / 1e6  # the bytes over the link
        + 2 * 3 * 1e-3  # one copy call a round and side
        + 2 * 12 * 1e-5  # the pieces of both sides
        + 2 * 11_000 / 1e7  # the bytes copied on both sides
    )
    assert gather_estimate(cfg, 10, 11_000) == pytest.approx(want, rel=1e-12, abs=0)
    # Planned: 10 runs of 1100 bytes cut at staged bytes 4000 and 8000, inside a run
    # each: 12 pieces a side, the same estimate.
    plan = staging_rounds(_runs(10, 1100), 4000)
    assert len(plan.rounds) == 3
    assert (plan.local_pieces, plan.remote_pieces) == (12, 12)
    assert gather_seconds(cfg, plan) == pytest.approx(want, rel=1e-12, abs=0)
    # Cuts that fall between runs copy fewer pieces than the estimate counts.
    fewer = staging_rounds(_runs(10, 1000), 4000)
    assert (fewer.local_pieces, len(fewer.rounds)) == (10, 3)
    assert gather_seconds(cfg, fewer) == pytest.approx(
        gather_estimate(cfg, 10, 10_000) - 2 * 2 * 1e-5, rel=1e-12, abs=0
    )


def test_the_choice_at_its_boundaries() -> None:
    # min_runs: a request of exactly min_runs runs may be gathered, one fewer may not.
    cheap = dict(COSTS, descriptor_s=1.0, round_s=0.0, copy_call_s=0.0, copy_piece_s=0.0)
    cfg = GatherConfig(staging_bytes=1 << 20, min_runs=4, **cheap)  # type: ignore[arg-type]
    assert choose_path(_runs(4, 64), cfg).path is XferPath.GATHER
    assert choose_path(_runs(3, 64), cfg).path is XferPath.DIRECT
    # min_runs 0 still needs one run; forced, one run of two rounds is not gathered,
    # two runs in one round are.
    zero = GatherConfig(staging_bytes=1 << 20, min_runs=0, **cheap)  # type: ignore[arg-type]
    assert choose_path(_runs(2, 64), zero).path is XferPath.GATHER
    forced = GatherConfig(staging_bytes=64, min_runs=100, force=XferPath.GATHER)
    assert choose_path(_runs(1, 128), forced).path is XferPath.DIRECT
    assert choose_path(_runs(2, 32), forced).path is XferPath.GATHER
    assert choose_path(_runs(1, 32), forced).path is XferPath.DIRECT  # no fewer rounds


def test_an_estimate_exactly_at_the_margin_is_gathered() -> None:
    runs = _runs(100, 1000)
    base = GatherConfig(staging_bytes=1 << 20, margin=1.0, min_runs=1, **COSTS)  # type: ignore[arg-type]
    direct = direct_seconds(base, len(runs), runs.nbytes)
    gather = gather_estimate(base, len(runs), runs.nbytes)
    # A per-descriptor cost that makes direct equal the gathered estimate (which holds
    # one descriptor a round: solve 100 d + b = 1 d + r, r the rest).
    rest = gather - 1 * base.descriptor_s
    link = runs.nbytes / 1e6
    d = (rest - link) / (100 - 1)
    cfg = GatherConfig(
        staging_bytes=1 << 20,
        margin=1.0,
        min_runs=1,
        **dict(COSTS, descriptor_s=d),  # type: ignore[arg-type]
    )
    got = choose_path(runs, cfg)
    assert got.estimate.gather == pytest.approx(got.estimate.direct, rel=1e-9)
    assert direct != gather
    # Nudged a hair above: direct.
    above = GatherConfig(
        staging_bytes=1 << 20,
        margin=1.0,
        min_runs=1,
        **dict(COSTS, descriptor_s=d * (1 - 1e-6)),  # type: ignore[arg-type]
    )
    assert choose_path(runs, above).path is XferPath.DIRECT
    below = GatherConfig(
        staging_bytes=1 << 20,
        margin=1.0,
        min_runs=1,
        **dict(COSTS, descriptor_s=d * (1 + 1e-6)),  # type: ignore[arg-type]
    )
    assert choose_path(runs, below).path is XferPath.GATHER


def test_fit_costs_refusals_in_their_whole_words() -> None:
    with pytest.raises(PlanError) as info:
        fit_costs([1, 2], [1, 2, 3], [1.0, 2.0])
    assert str(info.value) == (
        "fit_costs: descriptors, nbytes and seconds must be 1-d and of one length"
    )
    with pytest.raises(PlanError) as info:
        fit_costs([10, 20], [100, 200], [1.0, 2.0])
    assert str(info.value) == (
        "fit_costs: the transfers do not separate per-descriptor from per-byte cost "
        "(measure two block sizes or patterns)"
    )


def test_fit_costs_recovers_exact_figures_from_int_samples() -> None:
    # Integer inputs (descriptor counts, byte counts) fit as floats: 2 µs a descriptor,
    # 4 GB/s.
    d, b = [100, 1000, 10, 5000], [10**6, 10**5, 10**7, 4 * 10**6]
    t = [x * 2e-6 + y / 4e9 for x, y in zip(d, b)]
    per_desc, gbps = fit_costs(d, b, t)
    assert per_desc == pytest.approx(2e-6, rel=1e-9)
    assert gbps == pytest.approx(4.0, rel=1e-9)
