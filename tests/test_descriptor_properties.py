"""Properties of descriptor plans for every layout and request (R-DESC-7).

Each test states one invariant of R-DESC over the exported strategies
(:mod:`kvxfer.testing.strategies`). The oracle below is written from the spec, not from
the implementation: for each (region, listed block) it computes the one token interval
that must move, maps it to bytes through the layout (token-major blocks), and the plan's
bytes must equal that set exactly. Addresses reach ``2**64 - 1``, so the oracle computes
with Python integers (numpy object arrays), never int64.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given

from kvxfer.core import blocks as kblocks
from kvxfer.core.descriptors import (
    DescriptorTable,
    Plan,
    PlanOptions,
    Runs,
    build_plan,
    plan_pairing,
)
from kvxfer.core.layout import Group, GroupKind, KVLayout, Region, SplitAxis
from kvxfer.errors import PlanError
from kvxfer.testing import strategies as kst

Ints = npt.NDArray[np.object_]  # Python ints: exact at any width


def _ints(a: npt.NDArray[Any]) -> Ints:
    return np.array([int(x) for x in a], dtype=object)


def _chunk(tokens: int, bound: int) -> int:
    """R-DESC-3 written out plainly: smallest divisor of the range at or above bound."""
    return next((s for s in range(bound, tokens + 1) if tokens % s == 0), tokens)


def _union(start: Ints, length: Ints) -> tuple[Ints, Ints]:
    """Sorted, merged [start, end) intervals of a set of byte ranges."""
    if len(start) == 0:
        return start, start
    order = np.argsort(start, kind="stable")
    s, e = start[order], start[order] + length[order]
    # Inputs never overlap (checked separately), so a run breaks where a gap opens.
    breaks = np.flatnonzero(s[1:] != e[:-1]) + 1
    first = np.concatenate(([0], breaks))
    last = np.concatenate((breaks - 1, [len(s) - 1]))
    return s[first], e[last]


def _assert_disjoint(start: Ints, length: Ints) -> None:
    order = np.argsort(start, kind="stable")
    s, e = start[order], start[order] + length[order]
    assert (s[1:] >= e[:-1]).all(), "a byte is addressed twice"


def _locate(layout: KVLayout, addr: Ints, length: Ints) -> tuple[Ints, Ints, Ints]:
    """(region, block, offset) of each range; asserts each lies inside one block."""
    nb = layout.num_blocks
    starts = np.array(
        [r.base + b * r.stride for r in layout.regions for b in range(nb)], dtype=object
    )
    blen = np.array([r.block_len for r in layout.regions], dtype=object)
    order = np.argsort(starts, kind="stable")
    starts = starts[order]
    region = np.repeat(np.arange(len(layout.regions)), nb)[order]
    block = np.tile(np.arange(nb), len(layout.regions))[order]
    pos = np.searchsorted(starts, addr, side="right") - 1
    assert (pos >= 0).all(), "address below every registered block"
    offset = addr - starts[pos]
    assert (offset + length <= blen[region[pos]]).all(), "bytes outside a registered block"
    assert (addr + length <= kst.ADDRESS_LIMIT).all()
    return region[pos], block[pos], offset


def _expected(
    layout: KVLayout, options: PlanOptions, blocks: tuple[tuple[int, ...], ...], n: int
) -> tuple[Ints, Ints]:
    """The exact bytes a plan must move on one side: (start, length) per interval."""
    bs, tokens = layout.block_size, layout.tokens_per_desc
    chunk = _chunk(tokens, options.chunk_bound or tokens) if options.chunk_mode else tokens
    last = -(-n // bs) - 1
    starts: list[Ints] = []
    lengths: list[Ints] = []
    for r in layout.regions:
        listed = np.array(blocks[r.group], dtype=object)
        group = layout.groups[r.group]
        if group.is_state:
            # A state slot moves whole, whatever the tokens and modes (R-HYB-4).
            starts.append(_ints(r.base + listed * r.stride))
            lengths.append(np.array([r.block_len] * len(listed), dtype=object))
            continue
        j = last + 1 - len(listed) + np.arange(len(listed))  # request block index
        d0 = j * bs + (r.shard * tokens if layout.split_axis is SplitAxis.TOKEN else 0)
        d1 = d0 + tokens
        lo, hi = d0.copy(), d1.copy()  # whole descriptors (R-DESC-2)
        if options.swa_window_mode and group.kind is GroupKind.SLIDING:
            w = group.window  # granules of w tokens; the last w tokens' granules go
            lo = np.maximum(lo, max(n - w, 0) // w * w)
            hi = np.minimum(hi, ((n - 1) // w + 1) * w)
        if options.chunk_mode:
            # Last block: up to the end of the chunk holding the last token.
            tail_end = np.clip(d0 + ((n - 1 - d0) // chunk + 1) * chunk, d0, d1)
            hi = np.where(j == last, np.minimum(hi, tail_end), hi)
        bpt = r.block_len // tokens
        keep = hi > lo
        starts.append(_ints(r.base + listed[keep] * r.stride + (lo - d0)[keep] * bpt))
        lengths.append(_ints((hi - lo)[keep] * bpt))
    return np.concatenate(starts), np.concatenate(lengths)


def _tables(case: kst.PlanCase, options: PlanOptions) -> tuple[DescriptorTable, DescriptorTable]:
    # The remote table is rebuilt from the layout as it arrives in the handshake.
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(case.remote), type=KVLayout)
    return DescriptorTable.build(case.local, options), DescriptorTable.build(wire, options)


def _plan(
    case: kst.PlanCase, options: PlanOptions
) -> tuple[Plan, DescriptorTable, DescriptorTable]:
    local, remote = _tables(case, options)
    req = case.request
    mine, theirs = _as_given(req.local_blocks), _as_given(req.remote_blocks)
    plan = build_plan(local, remote, mine, theirs, req.num_tokens)
    return plan, local, remote


def _as_given(blocks: tuple[tuple[int, ...], ...]) -> Any:
    """One group as an engine passes it (an int64 array), several as per-group tuples."""
    return np.array(blocks[0], dtype=np.int64) if len(blocks) == 1 else blocks


def _gather(table: DescriptorTable, ids: npt.NDArray[np.int64]) -> tuple[Ints, Ints]:
    return _ints(table.addr[ids]), _ints(table.length[ids])


def _assert_covers_exactly(
    case: kst.PlanCase,
    options: PlanOptions,
    plan: Plan,
    local: DescriptorTable,
    remote: DescriptorTable,
) -> None:
    """R-DESC-7: each side moves exactly the bytes the modes select, each byte once."""
    req = case.request
    for table, layout, blocks, ids in (
        (local, case.local, req.local_blocks, plan.local_ids),
        (remote, case.remote, req.remote_blocks, plan.remote_ids),
    ):
        addr, length = _gather(table, ids)
        _assert_disjoint(addr, length)
        _locate(layout, addr, length)  # nothing outside the registered regions
        want = _union(*_expected(layout, options, blocks, req.num_tokens))
        got = _union(addr, length)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    assert plan.nbytes == sum(int(x) for x in local.length[plan.local_ids])


# --- exact cover, pairing, order ---------------------------------------------------------


@given(kst.plan_cases())
def test_plan_moves_exactly_the_requested_bytes(case: kst.PlanCase) -> None:
    plan, local, remote = _plan(case, case.options)
    _assert_covers_exactly(case, case.options, plan, local, remote)


@given(kst.plan_cases(kst.layouts(state=True)))
def test_state_slots_move_whole_beside_the_attention_bytes(case: kst.PlanCase) -> None:
    # Every listed slot of a state group, each byte once, from the slot at the same
    # list position on the other side; attention groups exactly as without state.
    plan, local, remote = _plan(case, case.options)
    _assert_covers_exactly(case, case.options, plan, local, remote)
    _assert_pairs_by_position(case, plan, local, remote)


@given(kst.plan_cases(kst.layouts(nesting=False)))
def test_windows_that_do_not_nest_with_a_descriptor_are_planned(case: kst.PlanCase) -> None:
    # R-DESC-4 asks only block_size % window == 0: a window straddling TOKEN shards
    # (block 6 over 3 shards, window 3) is cut in gcd units, never refused.
    options = msgspec.structs.replace(case.options, swa_window_mode=True)
    plan, local, remote = _plan(case, options)
    _assert_covers_exactly(case, options, plan, local, remote)


@given(kst.plan_cases())
def test_local_and_remote_pair_by_position_with_equal_lengths(case: kst.PlanCase) -> None:
    plan, local, remote = _plan(case, case.options)
    _assert_pairs_by_position(case, plan, local, remote)


def _assert_pairs_by_position(
    case: kst.PlanCase, plan: Plan, local: DescriptorTable, remote: DescriptorTable
) -> None:
    req = case.request
    assert len(plan.local_ids) == len(plan.remote_ids) == plan.num_descriptors
    la, ll = _gather(local, plan.local_ids)
    ra, rl = _gather(remote, plan.remote_ids)
    np.testing.assert_array_equal(ll, rl)
    l_region, l_block, l_off = _locate(case.local, la, ll)
    r_region, r_block, r_off = _locate(case.remote, ra, rl)
    np.testing.assert_array_equal(l_region, r_region)
    np.testing.assert_array_equal(l_off, r_off)
    # Block pairing by list position, within the region's group.
    groups = np.array([r.group for r in case.local.regions])[l_region]
    pos = np.full((len(case.local.groups), case.local.num_blocks), -1)
    remote_at = np.full((len(case.local.groups), case.local.num_blocks + 1), -1)
    for g, (lb, rb) in enumerate(zip(req.local_blocks, req.remote_blocks)):
        pos[g, list(lb)] = np.arange(len(lb))
        remote_at[g, : len(rb)] = rb
    listed_pos = pos[groups, l_block.astype(np.int64)]
    assert (listed_pos >= 0).all(), "a local block outside the request's list"
    np.testing.assert_array_equal(remote_at[groups, listed_pos], r_block.astype(np.int64))
    # local_blocks reports exactly the local blocks that receive bytes, per group.
    for g, reported in enumerate(plan.local_blocks):
        assert set(reported.tolist()) == set(l_block[groups == g].tolist())


def _abutting(layout: KVLayout) -> bool:
    """Whether two regions of one group lie side by side in every block (one region
    per head): plans then post each block's abutting regions together (test_merging)."""
    ends = {(r.group, r.device_id, r.stride, r.base + r.block_len) for r in layout.regions}
    return any((r.group, r.device_id, r.stride, r.base) in ends for r in layout.regions)


@given(kst.plan_cases())
def test_descriptors_come_in_the_fixed_order(case: kst.PlanCase) -> None:
    # Group by group, region by region, listed block by listed block, then by offset;
    # with abutting regions the same descriptors in posting order (kvxfer.core.merging).
    plan, local, _ = _plan(case, case.options)
    addr, length = _gather(local, plan.local_ids)
    region, block, offset = _locate(case.local, addr, length)
    listed = [{b: i for i, b in enumerate(blocks)} for blocks in case.request.local_blocks]
    keys = [
        (case.local.regions[r].group, int(r), listed[case.local.regions[r].group][int(b)], o)
        for r, b, o in zip(region, block, offset)
    ]
    if _abutting(case.local):
        keys.sort()
    assert all(a < b for a, b in itertools.pairwise(keys)), keys


@given(kst.plan_cases())
def test_a_descriptor_whose_bytes_all_go_is_sent_as_one(case: kst.PlanCase) -> None:
    # With coalescing off the plan is what the backend posts: a block (per region)
    # that moves whole must be one descriptor, not its K chunks or granules.
    plan, local, _ = _plan(case, case.options)
    addr, length = _gather(local, plan.local_ids)
    region, block, _ = _locate(case.local, addr, length)
    parts: dict[tuple[int, int], list[int]] = {}
    for r, b, n in zip(region, block, length):
        parts.setdefault((int(r), int(b)), []).append(int(n))
    for (r, b), lengths in parts.items():
        if len(lengths) > 1:
            assert sum(lengths) < case.local.regions[r].block_len, (r, b, lengths)


def _assert_dtypes(runs: Runs, n: int | None = None) -> None:
    for name in ("local_addr", "remote_addr", "length"):
        a = getattr(runs, name)
        assert a.dtype == np.uint64 and a.ndim == 1, (name, a.dtype)
    for name in ("local_device", "remote_device"):
        a = getattr(runs, name)
        assert a.dtype == np.int64 and a.ndim == 1, (name, a.dtype)
    sizes = {len(getattr(runs, f)) for f in ("local_addr", "remote_addr", "length")}
    assert sizes == {len(runs.local_device), len(runs.remote_device)} == {len(runs)}
    assert n is None or len(runs) == n
    assert type(runs.nbytes) is int


@given(kst.plan_cases())
def test_every_returned_array_has_its_documented_dtype(case: kst.PlanCase) -> None:
    plan, local, remote = _plan(case, case.options)
    for table in (local, remote):
        assert table.addr.dtype == table.length.dtype == np.uint64
        assert table.device.dtype == table.window_offset.dtype == np.int64
        assert len(table.addr) == len(table.length) == len(table.device) == len(table)
        assert not table.addr.flags.writeable and not table.length.flags.writeable
    assert plan.local_ids.dtype == plan.remote_ids.dtype == np.int64
    assert plan.local_ids.ndim == plan.remote_ids.ndim == 1
    assert len(plan.local_blocks) == len(case.local.groups)
    assert all(b.dtype == np.int64 and b.ndim == 1 for b in plan.local_blocks)
    assert type(plan.nbytes) is int and type(plan.num_tokens) is int
    _assert_dtypes(plan.runs(local, remote, merge=False), plan.num_descriptors)
    _assert_dtypes(plan.runs(local, remote, merge=True))
    _assert_dtypes(plan.runs(local, remote))


@given(kst.plan_cases())
def test_merged_runs_cover_exactly_the_descriptors_bytes(case: kst.PlanCase) -> None:
    plan, local, remote = _plan(case, case.options)
    flat = plan.runs(local, remote, merge=False)
    merged = plan.runs(local, remote, merge=True)
    assert len(flat) == plan.num_descriptors
    assert len(merged) <= len(flat)
    assert merged.nbytes == flat.nbytes == plan.nbytes
    m_local, m_remote, m_len = (
        _ints(merged.local_addr),
        _ints(merged.remote_addr),
        _ints(merged.length),
    )
    f_local, f_remote, f_len = _ints(flat.local_addr), _ints(flat.remote_addr), _ints(flat.length)
    _assert_disjoint(m_local, m_len)
    _assert_disjoint(m_remote, m_len)
    assert (m_local + m_len <= kst.ADDRESS_LIMIT).all() and (
        m_remote + m_len <= kst.ADDRESS_LIMIT
    ).all()
    # Runs are consecutive stretches of descriptors in plan order, back to back on both
    # sides: walk them; each run's length is the exact sum of its descriptors'.
    run, filled, owner = -1, 0, []
    for la, ra, n in zip(f_local, f_remote, f_len):
        if run >= 0 and filled < m_len[run]:
            assert la == m_local[run] + filled and ra == m_remote[run] + filled
        else:
            assert run < 0 or filled == m_len[run], "a run longer than its descriptors"
            run, filled = run + 1, 0
            assert la == m_local[run] and ra == m_remote[run]
        filled += n
        owner.append(run)
    assert run == len(merged) - 1 and (run < 0 or filled == m_len[run])
    dev = np.array(owner, dtype=np.int64)
    np.testing.assert_array_equal(flat.local_device, merged.local_device[dev])
    np.testing.assert_array_equal(flat.remote_device, merged.remote_device[dev])
    # Merging is maximal in plan order: no two neighbouring runs could be joined.
    joinable = (
        (m_local[1:] == m_local[:-1] + m_len[:-1])
        & (m_remote[1:] == m_remote[:-1] + m_len[:-1])
        & (merged.local_device[1:] == merged.local_device[:-1])
        & (merged.remote_device[1:] == merged.remote_device[:-1])
    )
    assert not joinable.any()


@given(kst.plan_cases())
def test_chunk_and_window_selections_are_subsets_of_whole_blocks(case: kst.PlanCase) -> None:
    plan, local, remote = _plan(case, case.options)
    whole, w_local, w_remote = _plan(case, PlanOptions())
    la, ll = _gather(local, plan.local_ids)
    ra, _ = _gather(remote, plan.remote_ids)
    wa, wl = _gather(w_local, whole.local_ids)
    wr, _ = _gather(w_remote, whole.remote_ids)
    assert plan.nbytes <= whole.nbytes
    if not len(la):
        return
    # Each selected descriptor lies inside a whole-block descriptor, same pairing.
    order = np.argsort(wa, kind="stable")
    host = order[np.searchsorted(wa[order], la, side="right") - 1]
    assert (la >= wa[host]).all()
    assert (la + ll <= wa[host] + wl[host]).all()
    np.testing.assert_array_equal(ra - wr[host], la - wa[host])


@given(kst.plan_cases())
def test_whole_section_addresses_follow_the_region_formula(case: kst.PlanCase) -> None:
    local, _ = _tables(case, case.options)
    layout = case.local
    nb = layout.num_blocks
    for i, r in enumerate(layout.regions):
        ids = i * nb + np.arange(nb)
        expect = [r.base + b * r.stride for b in range(nb)]
        assert [int(a) for a in local.addr[ids]] == expect
        assert (local.length[ids] == r.block_len).all()
        assert (local.device[ids] == r.device_id).all()


@given(kst.plan_cases())
def test_every_way_of_passing_the_blocks_gives_the_same_plan(case: kst.PlanCase) -> None:
    local, remote = _tables(case, case.options)
    req = case.request
    general = build_plan(local, remote, req.local_blocks, req.remote_blocks, req.num_tokens)
    arrays = build_plan(
        local,
        remote,
        [np.array(g, dtype=np.int64) for g in req.local_blocks],
        [np.array(g, dtype=np.uint32) for g in req.remote_blocks],
        req.num_tokens,
    )
    _assert_same_plan(arrays, general)
    lists = build_plan(
        local, remote, [list(g) for g in req.local_blocks], req.remote_blocks, req.num_tokens
    )
    _assert_same_plan(lists, general)
    # One block list for every group, as engines pass it: one list object shared by
    # all groups takes the single-broadcast shortcut.
    mine, theirs = req.local_blocks[0], req.remote_blocks[0]
    n = len(req.local_blocks)
    for form in (lambda b: np.array(b, dtype=np.int64), list):
        shared = build_plan(local, remote, [form(mine)] * n, [form(theirs)] * n, req.num_tokens)
        # The reference gets one distinct list per group (no shortcut).
        apart = build_plan(
            local,
            remote,
            [list(mine) for _ in range(n)],
            [list(theirs) for _ in range(n)],
            req.num_tokens,
        )
        _assert_same_plan(shared, apart)


@given(kst.plan_cases())
def test_a_pairing_checked_once_plans_as_build_plan_does(case: kst.PlanCase) -> None:
    """The Agent's path (ids checked once by kblocks.pair, then plan_pairing) gives the
    plan build_plan gives from the raw lists, shared groups included; a remote id past
    the peer's table is still refused, naming the remote side."""
    local, remote = _tables(case, case.options)
    req = case.request
    general = build_plan(local, remote, req.local_blocks, req.remote_blocks, req.num_tokens)
    n = len(req.local_blocks)
    mine = kblocks.block_groups(req.local_blocks, n, num_blocks=local.num_blocks)
    theirs = kblocks.from_wire(req.remote_blocks)
    _assert_same_plan(
        plan_pairing(local, remote, kblocks.Pairing(mine, theirs, req.num_tokens)), general
    )
    one_local = kblocks.block_array(req.local_blocks[0], side="local", group=0, num_blocks=None)
    one_remote = np.array(req.remote_blocks[0], dtype=np.int64)
    shared = plan_pairing(
        local, remote, kblocks.Pairing((one_local,) * n, (one_remote,) * n, req.num_tokens)
    )
    apart = build_plan(
        local, remote, [req.local_blocks[0]] * n, [req.remote_blocks[0]] * n, req.num_tokens
    )
    _assert_same_plan(shared, apart)
    listed = [g for g in theirs if len(g)]
    if listed:
        g = next(i for i, ids in enumerate(theirs) if len(ids))
        bad = list(theirs)
        bad[g] = np.concatenate([theirs[g][:-1], [remote.num_blocks]])
        with pytest.raises(PlanError, match="remote"):
            plan_pairing(local, remote, kblocks.Pairing(mine, tuple(bad), req.num_tokens))
    with pytest.raises(PlanError, match="group"):
        plan_pairing(local, remote, kblocks.Pairing(mine + mine[:1], theirs, req.num_tokens))


def _assert_same_plan(a: Plan, b: Plan) -> None:
    np.testing.assert_array_equal(a.local_ids, b.local_ids)
    np.testing.assert_array_equal(a.remote_ids, b.remote_ids)
    assert a.nbytes == b.nbytes and a.num_tokens == b.num_tokens
    assert len(a.local_blocks) == len(b.local_blocks)
    for x, y in zip(a.local_blocks, b.local_blocks):
        np.testing.assert_array_equal(x, y)


def _sweep_case(bs: int, shards: int, window: int, n: int) -> kst.PlanCase:
    """Two layers (full, sliding) of TOKEN-split regions with 3 bytes per token."""
    tokens = bs // shards
    regions = tuple(
        Region(
            base=10_000 * (layer * shards + s),
            num_blocks=4,
            stride=tokens * 3,
            block_len=tokens * 3,
            layer=layer,
            shard=s,
            group=layer,
        )
        for layer in range(2)
        for s in range(shards)
    )
    layout = KVLayout(
        block_size=bs,
        regions=regions,
        split_axis=SplitAxis.TOKEN,
        num_shards=shards,
        groups=(Group(kind=GroupKind.FULL), Group(kind=GroupKind.SLIDING, window=window)),
    )
    blocks = tuple(range(-(-n // bs)))
    req = kst.Request(num_tokens=n, local_blocks=(blocks, blocks), remote_blocks=(blocks, blocks))
    return kst.PlanCase(local=layout, remote=layout, options=PlanOptions(), request=req)


@pytest.mark.parametrize(
    ("bs", "shards", "window", "chunk_tokens"),
    [
        (12, 1, 4, 5),
        (12, 1, 6, 4),
        (24, 2, 4, 6),
        (24, 1, 8, 5),
        (48, 2, 12, 8),
        (16, 2, 16, 3),
        # windows that do not nest with the descriptor's range (R-DESC-4 allows them)
        (6, 3, 3, 1),
        (6, 3, 3, 2),
        (12, 2, 4, 3),
        (24, 3, 12, 2),
        (24, 4, 4, 3),
        (4, 2, 1, 1),  # a 1-token window: the window is the last token alone
    ],
)
def test_composed_modes_on_every_token_count(
    bs: int, shards: int, window: int, chunk_tokens: int
) -> None:
    # Chunks and granules that do not nest (e.g. 6 and 4 in 12 tokens) are rare in the
    # random layouts; sweep every request length through the oracle here.
    for options in (
        PlanOptions(chunk_mode=True, chunk_tokens=chunk_tokens, swa_window_mode=True),
        PlanOptions(swa_window_mode=True),
    ):
        for n in range(1, 3 * bs + 1):
            case = _sweep_case(bs, shards, window, n)
            plan, local, remote = _plan(case, options)
            _assert_covers_exactly(case, options, plan, local, remote)
