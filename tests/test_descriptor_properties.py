"""Properties of descriptor plans for every layout and request (R-DESC-7).

The oracle below is written from the spec, not from the implementation: for each
(region, listed block) it computes the one token interval that must move, maps it to
bytes through the layout (token-major blocks), and the plan's bytes must equal that
set exactly. Intervals are compared as normalized unions, so the checks stay
vectorized and each example takes about a millisecond.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given

from kvxfer.descriptors import DescriptorTable, Plan, PlanOptions, build_plan
from kvxfer.layout import Group, GroupKind, KVLayout, Region, SplitAxis
from kvxfer.testing import strategies as kst

I64 = npt.NDArray[np.int64]


def _chunk(tokens: int, bound: int) -> int:
    """R-DESC-3 written out plainly: smallest divisor of the range at or above bound."""
    return next((s for s in range(bound, tokens + 1) if tokens % s == 0), tokens)


def _union(start: I64, length: I64) -> tuple[I64, I64]:
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


def _assert_disjoint(start: I64, length: I64) -> None:
    order = np.argsort(start, kind="stable")
    s, e = start[order], start[order] + length[order]
    assert (s[1:] >= e[:-1]).all(), "a byte is addressed twice"


def _locate(layout: KVLayout, addr: I64, length: I64) -> tuple[I64, I64, I64]:
    """(region, block, offset) of each range; asserts each lies inside one block."""
    nb = layout.num_blocks
    base = np.array([r.base for r in layout.regions], dtype=np.int64)
    stride = np.array([r.stride for r in layout.regions], dtype=np.int64)
    blen = np.array([r.block_len for r in layout.regions], dtype=np.int64)
    starts = (base[:, None] + np.arange(nb)[None, :] * stride[:, None]).ravel()
    order = np.argsort(starts, kind="stable")
    starts = starts[order]
    region = np.repeat(np.arange(len(base)), nb)[order]
    block = np.tile(np.arange(nb), len(base))[order]
    pos = np.searchsorted(starts, addr, side="right") - 1
    assert (pos >= 0).all(), "address below every registered block"
    offset = addr - starts[pos]
    assert (offset + length <= blen[region[pos]]).all(), "bytes outside a registered block"
    return region[pos], block[pos], offset


def _expected(
    layout: KVLayout, options: PlanOptions, blocks: tuple[tuple[int, ...], ...], n: int
) -> tuple[I64, I64]:
    """The exact bytes a plan must move on one side: (start, length) per interval."""
    bs, tokens = layout.block_size, layout.tokens_per_desc
    chunk = _chunk(tokens, options.chunk_bound or tokens) if options.chunk_mode else tokens
    last = -(-n // bs) - 1
    starts: list[I64] = []
    lengths: list[I64] = []
    for r in layout.regions:
        listed = np.asarray(blocks[r.group], dtype=np.int64)
        j = last + 1 - len(listed) + np.arange(len(listed))  # request block index
        d0 = j * bs + (r.shard * tokens if layout.split_axis is SplitAxis.TOKEN else 0)
        d1 = d0 + tokens
        lo, hi = d0.copy(), d1.copy()  # whole descriptors (R-DESC-2)
        group = layout.groups[r.group]
        if options.swa_window_mode and group.kind is GroupKind.SLIDING:
            w = group.window
            lo = np.maximum(lo, max(n - w, 0) // w * w)
            hi = np.minimum(hi, ((n - 1) // w + 1) * w)
        if options.chunk_mode:
            # Last block: up to the end of the chunk holding the last token.
            tail_end = np.clip(d0 + ((n - 1 - d0) // chunk + 1) * chunk, d0, d1)
            hi = np.where(j == last, np.minimum(hi, tail_end), hi)
        bpt = r.block_len // tokens
        keep = hi > lo
        starts.append(r.base + listed[keep] * r.stride + (lo - d0)[keep] * bpt)
        lengths.append((hi - lo)[keep] * bpt)
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
    """One group as an engine passes it (an int64 array: build_plan's fast path when
    blocks go whole), several as per-group tuples (the general path)."""
    return np.array(blocks[0], dtype=np.int64) if len(blocks) == 1 else blocks


@given(kst.plan_cases())
def test_fast_path_plans_equal_the_general_path(case: kst.PlanCase) -> None:
    local, remote = _tables(case, case.options)
    req = case.request
    general = build_plan(local, remote, req.local_blocks, req.remote_blocks, req.num_tokens)
    fast = build_plan(
        local,
        remote,
        [np.array(g, dtype=np.int64) for g in req.local_blocks]
        if len(req.local_blocks) > 1
        else np.array(req.local_blocks[0], dtype=np.int64),
        _as_given(req.remote_blocks)
        if len(req.remote_blocks) == 1
        else [np.array(g, dtype=np.int64) for g in req.remote_blocks],
        req.num_tokens,
    )
    _assert_same_plan(fast, general)
    # One block list for every group, as engines pass it: one array object shared by
    # all groups takes the single-broadcast shortcut.
    mine, theirs = req.local_blocks[0], req.remote_blocks[0]
    n = len(req.local_blocks)
    shared = build_plan(
        local,
        remote,
        [np.array(mine, dtype=np.int64)] * n if n > 1 else np.array(mine, dtype=np.int64),
        [np.array(theirs, dtype=np.int64)] * n if n > 1 else np.array(theirs, dtype=np.int64),
        req.num_tokens,
    )
    _assert_same_plan(shared, build_plan(local, remote, [mine] * n, [theirs] * n, req.num_tokens))


def _assert_same_plan(a: Plan, b: Plan) -> None:
    np.testing.assert_array_equal(a.local_ids, b.local_ids)
    np.testing.assert_array_equal(a.remote_ids, b.remote_ids)
    assert a.nbytes == b.nbytes and a.num_tokens == b.num_tokens
    assert len(a.local_blocks) == len(b.local_blocks)
    for x, y in zip(a.local_blocks, b.local_blocks):
        np.testing.assert_array_equal(x, y)


def _gather(table: DescriptorTable, ids: I64) -> tuple[I64, I64]:
    return table.addr[ids].astype(np.int64), table.length[ids].astype(np.int64)


@given(kst.plan_cases())
def test_plan_moves_exactly_the_requested_bytes(case: kst.PlanCase) -> None:
    plan, local, remote = _plan(case, case.options)
    req = case.request
    for table, layout, blocks in (
        (local, case.local, req.local_blocks),
        (remote, case.remote, req.remote_blocks),
    ):
        ids = plan.local_ids if table is local else plan.remote_ids
        addr, length = _gather(table, ids)
        _assert_disjoint(addr, length)
        _locate(layout, addr, length)  # nothing outside the registered regions
        want = _union(*_expected(layout, case.options, blocks, req.num_tokens))
        got = _union(addr, length)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    assert plan.nbytes == int(local.length[plan.local_ids].sum())


@given(kst.plan_cases())
def test_local_and_remote_pair_byte_for_byte(case: kst.PlanCase) -> None:
    plan, local, remote = _plan(case, case.options)
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
    listed_pos = pos[groups, l_block]
    assert (listed_pos >= 0).all(), "a local block outside the request's list"
    np.testing.assert_array_equal(remote_at[groups, listed_pos], r_block)
    # local_blocks reports exactly the local blocks that receive bytes, per group.
    for g, reported in enumerate(plan.local_blocks):
        assert set(reported.tolist()) == set(l_block[groups == g].tolist())


@given(kst.plan_cases())
def test_coalesced_runs_move_the_same_bytes(case: kst.PlanCase) -> None:
    plan, local, remote = _plan(case, case.options)
    flat = plan.runs(local, remote, merge=False)
    merged = plan.runs(local, remote, merge=True)
    assert len(flat) == plan.num_descriptors
    assert len(merged) <= len(flat)
    assert merged.nbytes == flat.nbytes == plan.nbytes
    m_local = merged.local_addr.astype(np.int64)
    m_remote = merged.remote_addr.astype(np.int64)
    m_len = merged.length.astype(np.int64)
    _assert_disjoint(m_local, m_len)
    _assert_disjoint(m_remote, m_len)
    # Every descriptor sits in one run at the same offset on both sides.
    order = np.argsort(m_local)
    f_local = flat.local_addr.astype(np.int64)
    f_len = flat.length.astype(np.int64)
    run = order[np.searchsorted(m_local[order], f_local, side="right") - 1]
    assert (f_local + f_len <= m_local[run] + m_len[run]).all()
    np.testing.assert_array_equal(
        flat.remote_addr.astype(np.int64) - m_remote[run], f_local - m_local[run]
    )
    np.testing.assert_array_equal(flat.local_device, merged.local_device[run])
    np.testing.assert_array_equal(flat.remote_device, merged.remote_device[run])
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
    # Each selected descriptor lies inside a whole-block descriptor, same pairing.
    order = np.argsort(wa)
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
        expect = r.base + np.arange(nb, dtype=np.int64) * r.stride
        np.testing.assert_array_equal(local.addr[ids].astype(np.int64), expect)
        assert (local.length[ids] == r.block_len).all()
        assert (local.device[ids] == r.device_id).all()


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
    [(12, 1, 4, 5), (12, 1, 6, 4), (24, 2, 4, 6), (24, 1, 8, 5), (48, 2, 12, 8), (16, 2, 16, 3)],
)
def test_composed_modes_on_every_token_count(
    bs: int, shards: int, window: int, chunk_tokens: int
) -> None:
    # Chunks and granules that do not nest (e.g. 6 and 4 in 12 tokens) are rare in the
    # random layouts; sweep every request length through the oracle here.
    options = PlanOptions(chunk_mode=True, chunk_tokens=chunk_tokens, swa_window_mode=True)
    for n in range(1, 3 * bs + 1):
        case = _sweep_case(bs, shards, window, n)
        plan, local, _ = _plan(case, options)
        addr, length = _gather(local, plan.local_ids)
        _assert_disjoint(addr, length)
        want = _union(*_expected(case.local, options, case.request.local_blocks, n))
        got = _union(addr, length)
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"n={n}")
        np.testing.assert_array_equal(got[1], want[1], err_msg=f"n={n}")
