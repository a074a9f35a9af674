"""Posting order and run merging (kvxfer.core.merging, R-DESC-6, issue 27).

Plans list each block's abutting regions together, so that the transfer units posted
(runs merged from consecutive pairs, as the transport merges them) are the fewest that
cover the plan's bytes. The oracle for the bytes is the region-major plan of the same
request (the order plans had before; its bytes are checked by
test_descriptor_properties and test_heads_properties): the ordered plan must pair the
same descriptors, and its merged runs must move every one of those bytes once, from
the same remote byte.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given

from kvxfer.core.descriptors import DescriptorTable, Plan, build_plan
from kvxfer.core.heads import split_heads
from kvxfer.core.layout import KVLayout
from kvxfer.core.merging import (
    RUNS_MIN_PAIRS,
    address_order,
    chain_order,
    joins,
    posted_units,
    region_chains,
    run_starts,
    transport_units,
)
from kvxfer.core.tp_plan import TPPlanner
from kvxfer.testing import strategies as kst
from kvxfer.testing import tp_strategies as tps


def _unordered(table: DescriptorTable) -> DescriptorTable:
    """The same table planning region by region (the order before posting order)."""
    return dataclasses.replace(table, _order=None, _chain=1, _abuts=False)


def _pairs(plan: Plan) -> list[tuple[int, int]]:
    return sorted(zip(plan.local_ids.tolist(), plan.remote_ids.tolist()))


def _check_runs_cover(plan: Plan, local: DescriptorTable, remote: DescriptorTable) -> int:
    """The runs merged from ``plan`` in posted order (consecutive pairs contiguous on
    both sides, as the backend cuts them) move each pair's bytes exactly once, at the
    same offset on both sides, and nothing else. Returns how many runs."""
    la_u, ra_u = local.addr[plan.local_ids], remote.addr[plan.remote_ids]
    n_u = local.length[plan.local_ids]
    devices = local.device[plan.local_ids], remote.device[plan.remote_ids]
    starts_at = run_starts(la_u, ra_u, n_u, *devices).tolist()
    ends_at = [*starts_at[1:], len(n_u)]
    la = [int(a) for a in la_u]
    ra = [int(a) for a in ra_u]
    n = [int(a) for a in n_u]
    runs = [(la[a], ra[a], sum(n[a:z])) for a, z in zip(starts_at, ends_at)]
    assert sum(k for _, _, k in runs) == plan.nbytes
    by_start = sorted(runs)
    # Runs are disjoint on the local side (each consumer byte written once).
    for (a, _, k), (b, _, _) in itertools.pairwise(by_start):
        assert a + k <= b, "two runs write one byte"
    starts = [a for a, _, _ in by_start]
    for a, b, k in zip(la, ra, n):
        pos = int(np.searchsorted(np.array(starts, dtype=object), a, side="right")) - 1
        assert pos >= 0
        start, remote_start, size = by_start[pos]
        off = a - start
        assert off + k <= size, "a pair's bytes leave its run"
        assert remote_start + off == b, "a byte from the wrong remote byte"
    return len(runs)


def _best(plan: Plan, local: DescriptorTable, remote: DescriptorTable) -> int:
    """Runs of the same pairs sorted by local address: no order merges more."""
    order = address_order(local.addr[plan.local_ids])
    lid, rid = plan.local_ids[order], plan.remote_ids[order]
    devices = local.device[lid], remote.device[rid]
    return len(run_starts(local.addr[lid], remote.addr[rid], local.length[lid], *devices))


@given(kst.plan_cases())
def test_ordered_plans_pair_the_same_descriptors_and_merge_at_least_as_far(
    case: kst.PlanCase,
) -> None:
    local = DescriptorTable.build(case.local, case.options)
    remote = DescriptorTable.build(case.remote, case.options)
    lb, rb, n = case.request.local_blocks, case.request.remote_blocks, case.request.num_tokens
    plan = build_plan(local, remote, lb, rb, n)
    plain = build_plan(_unordered(local), remote, lb, rb, n)
    assert _pairs(plan) == _pairs(plain)
    assert plan.nbytes == plain.nbytes
    for got, want in zip(plan.local_blocks, plain.local_blocks):
        assert np.array_equal(got, want)
    runs = _check_runs_cover(plan, local, remote)
    assert runs == len(plan.runs(local, remote, merge=True))
    assert runs <= len(plain.runs(local, remote, merge=True))
    assert runs >= _best(plan, local, remote)


@given(tps.tp_cases(kv_layout="HND"))
def test_tp_plans_post_a_blocks_heads_together_and_their_runs_move_the_same_bytes(
    case: tps.TPCase,
) -> None:
    local = DescriptorTable.build(case.local, case.options)
    remotes = {p: DescriptorTable.build(lay, case.options) for p, lay in case.remotes.items()}
    args: dict[str, Any] = {
        "local_heads": case.consumer,
        "remote_heads": case.producer,
        "local_rank": case.consumer_rank,
        "salt": case.salt,
    }
    planner = TPPlanner.build(local, remotes, **args)
    plain = TPPlanner.build(
        _unordered(local), {p: _unordered(t) for p, t in remotes.items()}, **args
    )
    lb, rb, n = case.request.local_blocks, case.request.remote_blocks, case.request.num_tokens
    for rp, ref in zip(planner.plan(lb, rb, n), plain.plan(lb, rb, n)):
        assert rp.rank == ref.rank
        assert _pairs(rp.plan) == _pairs(ref.plan)
        runs = _check_runs_cover(rp.plan, local, remotes[rp.rank])
        assert runs <= _check_runs_cover(ref.plan, local, remotes[rp.rank])
        if all(list(g) == sorted(g) for g in lb):
            assert runs == _best(rp.plan, local, remotes[rp.rank])


def test_one_head_regions_of_a_block_merge_into_one_run_per_block() -> None:
    """Issue 27's case: 8 heads one region each (HND) on both sides, 3 blocks: 24 pairs
    a block list apart in the table, 3 runs (6 when only the first half is read)."""
    from kvxfer.core.heads import HeadLayout
    from kvxfer.core.layout import KVPart, Region

    heads = HeadLayout(num_kv_heads=8, tp_size=1)
    head_bytes = 64 * 16
    whole = KVLayout(
        block_size=16,
        regions=(
            Region(
                base=1 << 20,
                num_blocks=8,
                stride=8 * head_bytes,
                block_len=8 * head_bytes,
                layer=0,
                part=KVPart.K,
            ),
        ),
        num_kv_heads=8,
        kv_layout="HND",
    )
    per_head = split_heads(whole, heads, 0, 1)
    local = DescriptorTable.build(per_head)
    remote = DescriptorTable.build(
        split_heads(dataclasses_replace_base(whole, 1 << 30), heads, 0, 1)
    )
    assert local._order is not None and local._chain == 8
    plan = build_plan(local, remote, [2, 3, 5], [4, 5, 6], 48)
    assert plan.num_descriptors == 24
    runs = plan.runs(local, remote, merge=True)
    assert len(runs) == 2  # blocks 2-3 (and 4-5) abut on both sides; 5 follows 6 no
    assert runs.length.tolist() == [2 * 8 * head_bytes, 8 * head_bytes]
    joined = joins(
        local.addr[plan.local_ids], remote.addr[plan.remote_ids], local.length[plan.local_ids]
    )
    # Prepared ids of one block's heads are num_blocks apart: NIXL would merge none.
    assert transport_units(joined, plan.local_ids, plan.remote_ids) == 24


def dataclasses_replace_base(layout: KVLayout, base: int) -> KVLayout:
    import msgspec

    regions = tuple(msgspec.structs.replace(r, base=base) for r in layout.regions)
    return msgspec.structs.replace(layout, regions=regions)


def test_region_chains_need_the_same_stride_and_device_and_an_exact_abutment() -> None:
    base = np.array([100, 0, 50, 1000, 1050, 2000], dtype=np.uint64)
    stride = np.array([500, 500, 500, 500, 400, 500], dtype=np.uint64)
    block_len = np.array([50, 50, 50, 50, 50, 50], dtype=np.uint64)
    device = np.array([0, 0, 0, 0, 0, 1], dtype=np.int64)
    chains = region_chains(base, stride, block_len, device)
    assert chains == [[1, 2, 0], [3], [4], [5]]
    assert chain_order(chains) is None  # unequal chains: plans sort by address
    rows, k = chain_order([[1, 0], [3, 2]]) or (None, 0)
    assert k == 2 and rows is not None and rows.tolist() == [1, 0, 3, 2]
    assert chain_order([[0], [1]]) is None  # nothing abuts
    assert region_chains(*(np.zeros(0, dtype=t) for t in (np.uint64,) * 3), np.zeros(0)) == []
    # A gap of one byte breaks the chain; so does another device.
    gap = base.copy()
    gap[2] = 51
    assert region_chains(gap, stride, block_len, device) == [[i] for i in range(6)]
    other = device.copy()
    other[2] = 1
    assert region_chains(base, stride, block_len, other)[:2] == [[0], [1]]
    # Side by side in one block but not in the next: another device or stride.
    two = np.array([0, 50], dtype=np.uint64), np.full(2, 50, dtype=np.uint64)
    same = np.full(2, 500, dtype=np.uint64)
    assert region_chains(two[0], same, two[1], np.array([0, 0])) == [[0, 1]]
    assert region_chains(two[0], same, two[1], np.array([0, 1])) == [[0], [1]]
    strides = np.array([400, 500], dtype=np.uint64)
    assert region_chains(two[0], strides, two[1], np.array([0, 0])) == [[0], [1]]


@pytest.mark.parametrize("n", [0, 1, 2, 7])
def test_run_starts_and_transport_units_count_merges_like_a_plain_loop(n: int) -> None:
    rng = np.random.default_rng(n)
    for _ in range(50):
        length = rng.choice([4, 8], size=n).astype(np.uint64)
        la = (8 + np.concatenate(([0], np.cumsum(length)))[:n]).astype(np.uint64)
        la += (rng.random(n) < 0.3).astype(np.uint64) * np.uint64(1)  # some gaps
        ra = la + np.uint64(4096) + (rng.random(n) < 0.2).astype(np.uint64) * np.uint64(2)
        lid = np.cumsum(rng.choice([1, 1, 2], size=n)).astype(np.int64)
        rid = lid + (rng.random(n) < 0.2)
        starts, units = [], 0
        for i in range(n):
            contiguous = i > 0 and la[i] == la[i - 1] + length[i - 1]
            contiguous = contiguous and ra[i] == ra[i - 1] + length[i - 1]
            if not contiguous:
                starts.append(i)
            if not (contiguous and lid[i] == lid[i - 1] + 1 and rid[i] == rid[i - 1] + 1):
                units += 1
        assert run_starts(la, ra, length).tolist() == starts
        assert transport_units(joins(la, ra, length), lid, rid) == units
        dev = np.zeros(n, dtype=np.int64)
        if n > 1:
            dev[-1] = 1
            got = run_starts(la, ra, length, dev, None).tolist()
            assert got == sorted(set(starts) | {n - 1})
            assert run_starts(la, ra, length, None, dev).tolist() == got


def test_an_end_that_wraps_past_two_to_the_64_joins_nothing() -> None:
    top = np.uint64(2**64 - 8)
    la = np.array([top, 0], dtype=np.uint64)
    ra = np.array([16, 24], dtype=np.uint64)
    assert run_starts(la, ra, np.array([8, 8], dtype=np.uint64)).tolist() == [0, 1]
    assert run_starts(ra, la, np.array([8, 8], dtype=np.uint64)).tolist() == [0, 1]


def test_address_order_is_a_stable_sort() -> None:
    addr = np.array([30, 10, 20, 10], dtype=np.uint64)
    assert address_order(addr).tolist() == [1, 3, 2, 0]


@pytest.mark.parametrize(
    ("pairs", "as_runs"), [(RUNS_MIN_PAIRS - 1, False), (RUNS_MIN_PAIRS, True)]
)
def test_small_posts_keep_prepared_ids_and_large_ones_whose_runs_merge_go_as_runs(
    pairs: int, as_runs: bool
) -> None:
    """One contiguous run whose prepared ids are two apart (a block's heads): NIXL would
    post every pair; per-request runs post one, from RUNS_MIN_PAIRS pairs on."""
    la = np.arange(pairs, dtype=np.uint64) * np.uint64(8)
    ids = np.arange(pairs, dtype=np.int64) * 2
    joined = joins(la, la + np.uint64(1 << 20), np.full(pairs, 8, dtype=np.uint64))
    assert posted_units(joined, ids, ids) == ((1, True) if as_runs else (pairs, False))
    # Ids one apart: NIXL merges them itself, and prepared ids stay.
    ones = np.arange(pairs, dtype=np.int64)
    assert posted_units(joined, ones, ones) == (1, False)
    # Runs of two that NIXL merges none of: half the units, so runs from RUNS_MIN_PAIRS on.
    halves = joins(
        np.repeat(np.arange(pairs // 2, dtype=np.uint64) * np.uint64(64), 2)
        + np.tile(np.array([0, 8], dtype=np.uint64), pairs // 2),
        np.repeat(np.arange(pairs // 2, dtype=np.uint64) * np.uint64(64), 2)
        + np.tile(np.array([0, 8], dtype=np.uint64), pairs // 2),
        np.full(pairs // 2 * 2, 8, dtype=np.uint64),
    )
    even = ids[: pairs // 2 * 2]
    assert posted_units(halves, even, even) == (
        (pairs // 2, True) if as_runs else (pairs // 2 * 2, False)
    )


def test_chunked_plans_over_one_region_per_head_post_a_blocks_heads_together() -> None:
    """The general planning path (chunk_mode here) orders by local address too."""
    from kvxfer.core.descriptors import PlanOptions
    from kvxfer.core.layout import KVPart, Region

    head_bytes = 16 * 64

    def layout(base: int) -> KVLayout:
        return KVLayout(
            block_size=16,
            regions=tuple(
                Region(
                    base=base + h * head_bytes,
                    num_blocks=8,
                    stride=8 * head_bytes,
                    block_len=head_bytes,
                    part=KVPart.K,
                    head=h,
                )
                for h in range(8)
            ),
            num_kv_heads=1,
        )

    opts = PlanOptions(chunk_mode=True, chunk_tokens=4)
    local = DescriptorTable.build(layout(1 << 20), opts)
    remote = DescriptorTable.build(layout(1 << 30), opts)
    plan = build_plan(local, remote, [2, 3, 4], [2, 3, 4], 2 * 16 + 5)
    # Blocks 2-3 whole and the first two chunks of block 4, per head: blocks 2-3 and
    # head 0's chunks of block 4 are one run on both sides, the other heads' one each
    # (region by region, 3 runs a head: its block 2, its block 3, its two chunks).
    assert _check_runs_cover(plan, local, remote) == _best(plan, local, remote) == 8
    assert _check_runs_cover(plan, _unordered(local), remote) == 8
    plain = build_plan(_unordered(local), remote, [2, 3, 4], [2, 3, 4], 2 * 16 + 5)
    assert _check_runs_cover(plain, local, remote) == 24


def test_the_chain_order_is_read_only_int64_and_an_empty_plan_has_no_run() -> None:
    """Exact contracts the properties above do not pin (mutation survivors): the chain
    order a table keeps is an int64 array nobody can write into, and an empty plan's
    run starts are an empty int64 array (ids index with it)."""
    got = chain_order([[0, 1], [2, 3]])
    assert got is not None
    rows, k = got
    assert k == 2 and rows.dtype == np.int64 and rows.tolist() == [0, 1, 2, 3]
    assert not rows.flags.writeable
    empty = np.zeros(0, dtype=np.uint64)
    starts = run_starts(empty, empty, empty)
    assert starts.dtype == np.int64 and starts.size == 0
