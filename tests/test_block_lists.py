"""Chain lists (kvxfer.core.block_lists, R-DESC-6, issue 27).

The oracle is the planner's own plan of the same request (its bytes are checked by
test_descriptor_properties, test_heads_properties and test_merging): a chain plan's
rows must move every byte of the plan's pairs once, from the same remote byte, and
nothing else; and the units they post (consecutive rows merged where both sides
continue, as NIXL merges prepared descriptors) must be the fewest runs of those bytes.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from kvxfer.core.block_lists import ChainLists, ChainPlan, pair_chains
from kvxfer.core.blocks import block_groups
from kvxfer.core.descriptors import DescriptorTable, Plan, PlanOptions, build_plan
from kvxfer.core.heads import HeadLayout, heads_per_region, pairing_heads, split_heads
from kvxfer.core.layout import Group, GroupKind, KVLayout, KVPart, MemKind, Region
from kvxfer.core.merging import address_order, joins, run_starts, transport_units
from kvxfer.core.tp_plan import TPPlanner
from kvxfer.errors import PlanError
from kvxfer.testing import strategies as kst
from kvxfer.testing import tp_strategies as tps


def _rows(cp: ChainPlan) -> tuple[list[int], list[int], list[int]]:
    lists = cp.lists
    la = lists.local[cp.local_ids, 0].tolist()
    ra = lists.remote[cp.remote_ids, 0].tolist()
    n = lists.local[cp.local_ids, 1].tolist()
    assert n == lists.remote[cp.remote_ids, 1].tolist(), "paired rows differ in length"
    return la, ra, n


def _check_rows_cover(
    cp: ChainPlan, plan: Plan, local: DescriptorTable, remote: DescriptorTable
) -> None:
    """Every pair of ``plan`` lies inside one row of ``cp`` at the same offset on both
    sides, rows never overlap locally, and they move no byte more than the plan."""
    la, ra, n = _rows(cp)
    assert sum(n) == plan.nbytes == cp.nbytes
    by_start = sorted(zip(la, ra, n))
    for (a, _, k), (b, _, _) in itertools.pairwise(by_start):
        assert a + k <= b, "two rows write one byte"
    starts = np.array([a for a, _, _ in by_start], dtype=object)
    pla = local.addr[plan.local_ids].tolist()
    pra = remote.addr[plan.remote_ids].tolist()
    pn = local.length[plan.local_ids].tolist()
    for a, b, k in zip(pla, pra, pn):
        pos = int(np.searchsorted(starts, a, side="right")) - 1
        assert pos >= 0, "a pair's bytes in no row"
        start, remote_start, size = by_start[pos]
        off = a - start
        assert off + k <= size, "a pair's bytes leave its row"
        assert remote_start + off == b, "a byte from the wrong remote byte"


def _units(cp: ChainPlan) -> int:
    """Units NIXL posts for the rows: consecutive rows merge where both sides continue
    and the rows are consecutive in the prepared lists."""
    lists = cp.lists
    joined = joins(
        lists.local[cp.local_ids, 0],
        lists.remote[cp.remote_ids, 0],
        lists.local[cp.local_ids, 1],
        lists.local[cp.local_ids, 2].astype(np.int64),
        lists.remote[cp.remote_ids, 2].astype(np.int64),
    )
    return transport_units(joined, cp.local_ids, cp.remote_ids)


def _fewest(plan: Plan, local: DescriptorTable, remote: DescriptorTable) -> int:
    order = address_order(local.addr[plan.local_ids])
    lid, rid = plan.local_ids[order], plan.remote_ids[order]
    devices = local.device[lid], remote.device[rid]
    return len(run_starts(local.addr[lid], remote.addr[rid], local.length[lid], *devices))


def _packed(layout: KVLayout, gaps: list[int]) -> KVLayout:
    """``layout`` with its regions' tensors placed one after the other, in region order,
    ``gaps[i] * 64`` bytes apart (0: back to back, where one tensor's last block ends
    at the next one's first; -1: one stride apart)."""
    regions = []
    at = 1 << 32
    for i, r in enumerate(layout.regions):
        regions.append(msgspec.structs.replace(r, base=at))
        gap = gaps[i % len(gaps)]
        at += r.num_blocks * r.stride + (r.stride if gap < 0 else gap * 64)
    return msgspec.structs.replace(layout, regions=tuple(regions))


_GAPS = st.lists(st.sampled_from((0, 0, -1, 1, 1000)), min_size=1, max_size=6)
#: Models with heads to merge (several per rank for some TP sizes).
_MODELS = st.builds(
    tps.TPModel,
    num_kv_heads=st.sampled_from((2, 4, 6, 8)),
    layers=st.integers(1, 3),
    parts=st.sampled_from(((KVPart.K, KVPart.V), (KVPart.KV,))),
    head_bytes=st.sampled_from((2, 4)),
    block_size=st.sampled_from((4, 8)),
    window=st.sampled_from((0, 0, 8)),
)


@st.composite
def _chain_cases(draw: st.DrawFn) -> tps.TPCase:
    """Both sides one region per (layer, part) holding the rank's heads, as engines
    describe them, placed where the strategy puts them or packed with gaps down to
    none; a consumer rank, the producer group and a request."""
    model = draw(_MODELS)
    n = model.num_kv_heads
    # TP sizes that leave each rank two heads or more: something to chain.
    sizes = st.sampled_from([t for t in tps.tp_sizes(n) if n // t >= 2])
    producer = HeadLayout(num_kv_heads=n, tp_size=draw(sizes))
    consumer = HeadLayout(num_kv_heads=n, tp_size=draw(sizes))
    rank = draw(st.integers(0, consumer.tp_size - 1))
    nb_local, nb_remote = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**16))
    packed = draw(st.booleans())
    local_gaps, remote_gaps = draw(_GAPS), draw(_GAPS)

    def place(layout: KVLayout, gaps: list[int]) -> KVLayout:
        return _packed(layout, gaps) if packed else layout

    def layout(heads: HeadLayout, r: int, nb: int, seed: int) -> KVLayout:
        return tps.rank_layout(
            model, heads, r, per_head=False, num_blocks=nb, seed=seed, kv_layout="HND"
        )

    local = place(layout(consumer, rank, nb_local, seed), local_gaps)
    remotes = {
        p: place(layout(producer, p, nb_remote, seed + 1 + p), remote_gaps)
        for p in range(producer.tp_size)
    }
    return tps.TPCase(
        model=model,
        producer=producer,
        consumer=consumer,
        consumer_rank=rank,
        local=local,
        remotes=remotes,
        options=PlanOptions(coalesce=draw(st.booleans())),
        request=draw(kst.requests(local, remotes[0])),
        salt=draw(st.sampled_from((0, 1, 2, 3))),
    )


@given(
    st.one_of(_chain_cases(), tps.tp_cases(_MODELS, kv_layout="HND", uncut=True)),
    st.sampled_from((True, True, False)),
)
def test_chain_rows_move_the_plans_bytes_in_the_fewest_units(
    case: tps.TPCase, one_head: bool
) -> None:
    """Tables cut as a pulling agent cuts them (heads.pairing_heads: the consumer's
    regions whole or in one-head pieces, the producer's to match), or both in one-head
    pieces (always a valid cut, and the one whose abutting heads chains merge again)."""
    c, p, rank = case.consumer, case.producer, case.consumer_rank
    per = (
        1
        if one_head
        else pairing_heads(
            heads_per_region(case.local, c, rank), heads_per_region(case.remotes[0], p, 0)
        )
    )
    local = DescriptorTable.build(split_heads(case.local, c, rank, per), case.options)
    remotes = {
        q: DescriptorTable.build(split_heads(lay, p, q, per), case.options)
        for q, lay in case.remotes.items()
    }
    planner = TPPlanner.build(
        local,
        remotes,
        local_heads=case.consumer,
        remote_heads=case.producer,
        local_rank=case.consumer_rank,
        salt=case.salt,
    )
    lb, rb, n = case.request.local_blocks, case.request.remote_blocks, case.request.num_tokens
    groups = len(local.layout.groups)
    mine = block_groups(lb, groups, broadcast=True)
    theirs = block_groups(rb, groups, side="remote", broadcast=True)
    for rp in planner.plan(lb, rb, n):
        lists = planner.chain_lists(rp.rank)
        if lists is None:
            continue
        cp = lists.plan(mine, theirs, n)
        remote = remotes[rp.rank]
        _check_rows_cover(cp, rp.plan, local, remote)
        assert cp.num_tokens == n
        for got, want in zip(cp.local_blocks, rp.plan.local_blocks, strict=True):
            assert np.array_equal(got, want)
        event("chain lists built")
        assert _units(cp) == _fewest(rp.plan, local, remote)
        assert cp.num_descriptors == rp.plan.num_descriptors
        assert cp.rows == len(cp.local_ids) <= cp.num_descriptors


def _per_head(
    base: int, nb: int, heads: int = 8, *, layers: int = 2, gap: int = 1 << 24
) -> KVLayout:
    """One region per head (HND), ``layers`` x (K, V) tensors ``gap`` bytes apart."""
    head_bytes = 16 * 32
    regions = tuple(
        Region(
            base=base + (2 * layer + i) * gap,
            num_blocks=nb,
            stride=heads * head_bytes,
            block_len=heads * head_bytes,
            layer=layer,
            part=part,
        )
        for layer in range(layers)
        for i, part in enumerate((KVPart.K, KVPart.V))
    )
    whole = KVLayout(block_size=16, regions=regions, num_kv_heads=heads, kv_layout="HND")
    return split_heads(whole, HeadLayout(num_kv_heads=heads, tp_size=1), 0, 1)


def test_a_blocks_heads_become_one_row_per_tensor_and_block() -> None:
    local = DescriptorTable.build(_per_head(1 << 30, 6))
    remote = DescriptorTable.build(_per_head(1 << 34, 9))
    lists = ChainLists.build(local, remote)
    assert lists is not None
    assert lists.chains == 4 and lists.pairs == (32,)
    assert lists.local.shape == (4 * 6, 3) and lists.remote.shape == (4 * 9, 3)
    assert lists.local_mem is MemKind.DRAM and lists.remote_mem is MemKind.DRAM
    assert not lists.local.flags.writeable and not lists.groups[0].flags.writeable
    cp = lists.plan((np.array([2, 3, 5]),), (np.array([4, 5, 0]),), 48)
    plan = build_plan(local, remote, [2, 3, 5], [4, 5, 0], 48)
    _check_rows_cover(cp, plan, local, remote)
    assert cp.rows == 12 and cp.num_descriptors == plan.num_descriptors == 96
    # Chain by chain, block by block: block 2 then 3 of a chain are one unit (both
    # sides continue); 3 -> 5 and 5 -> 0 are not.
    assert cp.local_ids.tolist()[:3] == [2, 3, 5]
    assert cp.remote_ids.tolist()[3:6] == [9 + 4, 9 + 5, 9 + 0]
    assert _units(cp) == 8 == _fewest(plan, local, remote)


def test_lists_are_declined_where_rows_could_post_more_units_than_runs() -> None:
    """Tensors back to back: a K tensor's last block ends where the V tensor's first
    block starts, on both sides. A request pairing those blocks merges them into one
    run, which chain-major rows never post: no lists."""
    nb = 4
    stride = 8 * 16 * 32
    local = DescriptorTable.build(_per_head(1 << 30, nb, gap=nb * stride))
    remote = DescriptorTable.build(_per_head(1 << 34, nb, gap=nb * stride))
    assert ChainLists.build(local, remote) is None
    plan = build_plan(local, remote, [0, 3], [0, 3], 32)
    # Each tensor's block 3 runs on into the next tensor's block 0: 5 runs, not 8.
    assert _fewest(plan, local, remote) == 5
    # The same tensors one block further apart on one side only: never merged.
    apart = DescriptorTable.build(_per_head(1 << 34, nb, gap=nb * stride + stride))
    assert ChainLists.build(local, apart) is not None


def test_lists_are_declined_without_a_merge_or_whole_blocks_or_one_stride() -> None:
    one = DescriptorTable.build(_per_head(1 << 30, 4, heads=1))
    assert ChainLists.build(one, DescriptorTable.build(_per_head(1 << 34, 4, heads=1))) is None
    per_head = _per_head(1 << 30, 4)
    options = PlanOptions(chunk_mode=True, chunk_tokens=8)
    nhd = msgspec.structs.replace(per_head, kv_layout="NHD")
    chunked = DescriptorTable.build(nhd, options)
    assert ChainLists.build(chunked, DescriptorTable.build(nhd, options)) is None
    regions = list(per_head.regions)
    regions[0] = msgspec.structs.replace(regions[0], stride=regions[0].stride * 2)
    odd = msgspec.structs.replace(per_head, regions=tuple(regions))
    assert ChainLists.build(DescriptorTable.build(odd), DescriptorTable.build(per_head)) is None
    other = DescriptorTable.build(per_head, PlanOptions(coalesce=False))
    assert ChainLists.build(other, DescriptorTable.build(per_head)) is None


def test_pair_chains_need_both_sides_to_abut() -> None:
    u = lambda *v: np.array(v, dtype=np.uint64)  # noqa: E731
    i = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    length = u(10, 10, 10, 10)
    stride = u(100, 100, 100, 100)
    # Locally 0 -> 1 -> 2 -> 3 abut; remotely 2 does not follow 1.
    local = u(0, 10, 20, 30)
    remote = u(500, 510, 700, 710)
    assert pair_chains(local, remote, length, stride, stride, i(0, 0, 0, 0), i(0, 0, 0, 0)) == [
        [0, 1],
        [2, 3],
    ]
    # Another device on either side breaks a chain; so does another stride.
    assert pair_chains(local, remote, length, stride, stride, i(0, 1, 0, 0), i(0, 0, 0, 0)) == [
        [0],
        [1],
        [2, 3],
    ]
    assert pair_chains(local, remote, length, stride, stride, i(0, 0, 0, 0), i(0, 0, 0, 1)) == [
        [0, 1],
        [2],
        [3],
    ]
    assert pair_chains(
        local, remote, length, stride, u(100, 100, 100, 200), i(0, 0, 0, 0), i(0, 0, 0, 0)
    ) == [
        [0, 1],
        [2],
        [3],
    ]
    assert pair_chains(
        local, remote, length, u(100, 100, 200, 200), stride, i(0, 0, 0, 0), i(0, 0, 0, 0)
    ) == [
        [0, 1],
        [2, 3],
    ]
    assert pair_chains(
        local, remote, length, u(100, 200, 200, 200), stride, i(0, 0, 0, 0), i(0, 0, 0, 0)
    ) == [
        [0],
        [1],
        [2, 3],
    ]
    # Chains are listed by their first region's local address, not its index.
    assert pair_chains(
        u(100, 110, 0, 10), remote, length, stride, stride, i(0, 0, 0, 0), i(0, 0, 0, 0)
    ) == [
        [2, 3],
        [0, 1],
    ]
    assert pair_chains(u(), u(), u(), u(), u(), i(), i()) == []


def test_a_plan_needs_the_lists_group_count_and_equal_lengths() -> None:
    local = DescriptorTable.build(_per_head(1 << 30, 6))
    lists = ChainLists.build(local, DescriptorTable.build(_per_head(1 << 34, 6)))
    assert lists is not None
    with pytest.raises(PlanError, match=r"2 local and 1 remote given, the chain lists have 1 KV"):
        lists.plan((np.array([1]), np.array([1])), (np.array([1]),), 16)
    with pytest.raises(PlanError, match="group 0: 2 local blocks but 1 remote blocks; they must"):
        lists.plan((np.array([1, 2]),), (np.array([1]),), 32)


def test_a_plans_remote_ids_are_checked_against_the_remote_blocks() -> None:
    local = DescriptorTable.build(_per_head(1 << 30, 6))
    lists = ChainLists.build(local, DescriptorTable.build(_per_head(1 << 34, 4)))
    assert lists is not None
    with pytest.raises(
        PlanError, match=r"remote block_ids \(group 0\)\[1\]=4: out of range \[0, 4\)"
    ):
        lists.plan((np.array([1, 2]),), (np.array([0, 4]),), 32)
    with pytest.raises(PlanError, match="repeat"):
        lists.plan((np.array([1, 2]),), (np.array([3, 3]),), 32)


def _region_list(layout: KVLayout, **changes: Any) -> KVLayout:
    """``layout`` with ``changes`` applied to its regions (a callable: per region)."""
    regions = []
    for i, r in enumerate(layout.regions):
        fields = {k: (v(i, r) if callable(v) else v) for k, v in changes.items()}
        regions.append(msgspec.structs.replace(r, **fields))
    return msgspec.structs.replace(layout, regions=tuple(regions))


def test_lists_need_one_memory_kind_one_stride_a_side_and_a_region_pair_to_merge() -> None:
    per_head = _per_head(1 << 30, 4)
    theirs = DescriptorTable.build(_per_head(1 << 34, 4))
    assert ChainLists.build(DescriptorTable.build(per_head), theirs) is not None
    # One region a side (a tensor holding all heads): nothing to merge.
    whole = KVLayout(
        block_size=16,
        regions=(Region(base=1 << 30, num_blocks=4, stride=4096, block_len=4096),),
        num_kv_heads=8,
        kv_layout="HND",
    )
    far = _region_list(whole, base=1 << 34)
    assert ChainLists.build(DescriptorTable.build(whole), DescriptorTable.build(far)) is None
    # Device memory for some regions (both sides, as equal shapes have).
    vram = _region_list(per_head, mem=lambda i, r: MemKind.VRAM if i >= 8 else MemKind.DRAM)
    far_vram = _region_list(vram, base=lambda i, r: r.base + (1 << 34))
    assert ChainLists.build(DescriptorTable.build(vram), DescriptorTable.build(far_vram)) is None
    # One tensor of one side at twice the stride (its heads still chain).
    wide = _region_list(per_head, stride=lambda i, r: r.stride * 2 if i < 8 else r.stride)
    assert ChainLists.build(DescriptorTable.build(wide), theirs) is None
    assert ChainLists.build(DescriptorTable.build(per_head), DescriptorTable.build(wide)) is None
    # Another stride for the last region of either side.
    last = len(per_head.regions) - 1
    odd = _region_list(per_head, stride=lambda i, r: r.stride * 2 if i == last else r.stride)
    assert ChainLists.build(DescriptorTable.build(odd), theirs) is None
    assert ChainLists.build(DescriptorTable.build(per_head), DescriptorTable.build(odd)) is None


def test_a_gap_other_than_whole_strides_never_lets_chains_continue() -> None:
    """Tensors a block list and 64 bytes apart: no block of one can end where a block
    of the next starts, so the lists are built (back to back they are not)."""
    nb, stride = 4, 8 * 16 * 32
    local = DescriptorTable.build(_per_head(1 << 30, nb, gap=nb * stride + 64))
    remote = DescriptorTable.build(_per_head(1 << 34, nb, gap=nb * stride + 64))
    lists = ChainLists.build(local, remote)
    assert lists is not None
    cp = lists.plan((np.array([3, 0]),), (np.array([3, 0]),), 32)
    _check_rows_cover(cp, build_plan(local, remote, [3, 0], [3, 0], 32), local, remote)


def test_rows_keep_every_address_bit_and_lists_stop_below_two_to_the_62() -> None:
    """Addresses above 2**53 (where a float would round) stay exact; a table reaching
    2**62 gets no lists (the continuation check subtracts addresses as int64)."""
    nb, stride = 4, 8 * 16 * 32
    high = (1 << 61) + 64 * 3
    local = DescriptorTable.build(_per_head(high, nb))
    remote = DescriptorTable.build(_per_head(high + (1 << 40), nb))
    lists = ChainLists.build(local, remote)
    assert lists is not None
    assert lists.local.dtype == lists.remote.dtype == np.uint64
    cp = lists.plan((np.array([1, 2]),), (np.array([2, 1]),), 32)
    _check_rows_cover(cp, build_plan(local, remote, [1, 2], [2, 1], 32), local, remote)
    assert int(lists.local[1, 0]) == high + stride
    # The highest region (the last tensor's last head) reaches 2**62 over its blocks'
    # strides: declined; 64 bytes lower: built.
    top = (1 << 62) - nb * stride - 3 * (1 << 24) - 7 * 16 * 32
    assert ChainLists.build(DescriptorTable.build(_per_head(top, nb)), remote) is None
    assert ChainLists.build(DescriptorTable.build(_per_head(top - 64, nb)), remote) is not None
    assert ChainLists.build(local, DescriptorTable.build(_per_head(top, nb))) is None


def test_a_bad_remote_id_is_named_with_its_group() -> None:
    per_head = _per_head(1 << 30, 4)
    groups = (Group(kind=GroupKind.FULL), Group(kind=GroupKind.FULL))
    regions = tuple(msgspec.structs.replace(r, group=int(r.layer == 1)) for r in per_head.regions)
    mine = msgspec.structs.replace(per_head, regions=regions, groups=groups)
    theirs = _region_list(mine, base=lambda i, r: r.base + (1 << 34))
    lists = ChainLists.build(DescriptorTable.build(mine), DescriptorTable.build(theirs))
    assert lists is not None and len(lists.groups) == 2
    one = np.array([1, 2])
    cp = lists.plan((one, one), (one, np.array([0, 3])), 32)
    assert cp.rows == 8 and cp.num_descriptors == 64
    assert cp.nbytes == sum(lists.block_bytes) * 2 == 64 * 16 * 32
    with pytest.raises(PlanError, match=r"remote block_ids \(group 1\)\[1\]=4"):
        lists.plan((one, one), (one, np.array([0, 4])), 32)


@pytest.mark.parametrize(
    ("local", "remote", "units"),
    [
        ([3, 2], [5, 4], 4),  # descending on both sides: one unit per tensor
        ([1, 3, 2], [1, 3, 2], 4),  # 1-2-3 merged once sorted, per tensor
        ([4, 1, 3, 0, 2], [4, 1, 3, 0, 2], 4),  # all five blocks, one unit per tensor
    ],
)
def test_rows_follow_the_local_block_order_so_every_merge_is_posted(
    local: list[int], remote: list[int], units: int
) -> None:
    """Blocks listed out of order still post the fewest units: each chain's rows go in
    ascending local order, and whole-block chains merge across blocks there."""
    mine = DescriptorTable.build(_per_head(1 << 30, 6))
    theirs = DescriptorTable.build(_per_head(1 << 34, 6))
    lists = ChainLists.build(mine, theirs)
    assert lists is not None
    tokens = 16 * len(local)
    cp = lists.plan((np.array(local),), (np.array(remote),), tokens)
    plan = build_plan(mine, theirs, local, remote, tokens)
    _check_rows_cover(cp, plan, mine, theirs)
    assert cp.local_ids[: len(local)].tolist() == sorted(local)
    assert _units(cp) == _fewest(plan, mine, theirs) == units
