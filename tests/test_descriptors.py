"""Example tests for descriptor tables and plans (R-DESC-1..6), from the spec's examples."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvxfer.core.descriptors import DescriptorTable, PlanOptions, build_plan, chunk_size
from kvxfer.core.layout import Group, GroupKind, KVLayout, Region, SplitAxis
from kvxfer.errors import ConfigError, LayoutMismatch, PlanError

TB = 4  # bytes per token in every region of these examples


def make_layout(
    block_size: int = 16,
    *,
    num_regions: int = 2,
    num_blocks: int = 8,
    split: SplitAxis = SplitAxis.HEAD,
    num_shards: int = 1,
    groups: tuple[Group, ...] = (Group(kind=GroupKind.FULL),),
    base: int = 0x10000,
    gap: int = 0x10000,
    packed: bool = False,
    kv_layout: str = "NHD",
) -> KVLayout:
    """Regions ``layer = i // shards``, ``shard = i % shards``, group ``layer % groups``.

    ``packed``: regions back to back with no gap (region i+1 starts where i ends).
    """
    spans = num_shards if split is SplitAxis.TOKEN else 1
    block_len = block_size // spans * TB
    extent = num_blocks * block_len
    regions = tuple(
        Region(
            base=base + i * (extent if packed else extent + gap),
            num_blocks=num_blocks,
            stride=block_len,
            block_len=block_len,
            layer=i // num_shards,
            shard=i % num_shards,
            group=(i // num_shards) % len(groups),
        )
        for i in range(num_regions)
    )
    return KVLayout(
        block_size=block_size,
        regions=regions,
        split_axis=split,
        num_shards=num_shards,
        groups=groups,
        kv_layout=kv_layout,
    )


def moved(table: DescriptorTable, ids: np.ndarray) -> list[tuple[int, int]]:
    """(addr, length) of each id, as plain ints."""
    return [(int(a), int(n)) for a, n in zip(table.addr[ids], table.length[ids])]


# --- chunk size (R-DESC-3) ------------------------------------------------------------


@pytest.mark.parametrize(
    ("range_tokens", "bound", "expected"),
    [
        (16, 5, 8),
        (16, 6, 8),
        (16, 16, 16),
        (16, 20, 16),
        (16, 1, 1),
        (16, 3, 4),
        (12, 5, 6),
        (12, 7, 12),
        (64, 17, 32),
        (4096, 2048, 2048),
        (4096, 2049, 4096),
        (1, 1, 1),
        (97, 2, 97),
    ],
)
def test_chunk_size_is_smallest_divisor_at_or_above_the_bound(
    range_tokens: int, bound: int, expected: int
) -> None:
    assert chunk_size(range_tokens, bound) == expected


def test_chunk_size_rejects_non_positive_inputs() -> None:
    with pytest.raises(ConfigError, match="chunk_tokens"):
        chunk_size(16, 0)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        chunk_size(16, True)
    with pytest.raises(PlanError, match="range_tokens"):
        chunk_size(0, 4)


# --- options ---------------------------------------------------------------------------


def test_chunk_tokens_below_one_prefill_step_is_rejected() -> None:
    with pytest.raises(ConfigError) as info:
        PlanOptions(chunk_mode=True, chunk_tokens=256, prefill_step_tokens=512)
    assert info.value.key == "chunk_tokens"
    assert info.value.value == 256
    assert "512" in info.value.rule


def test_chunk_bound_defaults_to_one_prefill_step() -> None:
    assert PlanOptions(chunk_mode=True, prefill_step_tokens=512).chunk_bound == 512
    assert PlanOptions(chunk_tokens=1024, prefill_step_tokens=512).chunk_bound == 1024
    with pytest.raises(ConfigError, match="chunk_mode needs"):
        PlanOptions(chunk_mode=True)


@pytest.mark.parametrize(
    "kwargs",
    [{"chunk_tokens": 0}, {"chunk_tokens": True}, {"prefill_step_tokens": -1}, {"coalesce": 1}],
)
def test_plan_options_type_and_range_checks(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as info:
        PlanOptions(**kwargs)  # type: ignore[arg-type]
    assert info.value.key == next(iter(kwargs))


def test_plan_options_round_trip_msgspec() -> None:
    opts = PlanOptions(chunk_mode=True, chunk_tokens=64, swa_window_mode=True, coalesce=False)
    assert msgspec.json.decode(msgspec.json.encode(opts), type=PlanOptions) == opts


# --- whole blocks (R-DESC-1, R-DESC-2) --------------------------------------------------


def test_whole_block_ids_are_region_times_num_blocks_plus_block() -> None:
    layout = make_layout(num_regions=3, num_blocks=8)
    table = DescriptorTable.build(layout)
    assert len(table) == 24
    r = layout.regions[2]
    assert moved(table, np.array([2 * 8 + 5])) == [(r.base + 5 * r.stride, 16 * TB)]
    assert not table.addr.flags.writeable


def test_plan_pairs_by_position_region_major_and_sends_the_partial_last_block_whole() -> None:
    local = DescriptorTable.build(make_layout(num_blocks=8))
    remote = DescriptorTable.build(make_layout(num_blocks=10, base=0x900000))
    plan = build_plan(local, remote, [3, 1], [5, 6], num_tokens=20)
    assert plan.local_ids.tolist() == [3, 1, 8 + 3, 8 + 1]
    assert plan.remote_ids.tolist() == [5, 6, 10 + 5, 10 + 6]
    assert plan.num_descriptors == 4
    assert plan.nbytes == 4 * 16 * TB  # 20 tokens, but block 2 of 2 goes whole
    assert [b.tolist() for b in plan.local_blocks] == [[3, 1]]
    assert plan.local_ids.dtype == np.int64


def test_block_ids_accept_lists_arrays_and_per_group_lists() -> None:
    table = DescriptorTable.build(make_layout())
    a = build_plan(table, table, [4, 2], [1, 0], 32)
    b = build_plan(table, table, np.array([4, 2]), np.array([1, 0], dtype=np.int32), 32)
    c = build_plan(table, table, [[4, 2]], [np.array([1, 0])], 32)
    for p in (b, c):
        assert p.local_ids.tolist() == a.local_ids.tolist()
        assert p.remote_ids.tolist() == a.remote_ids.tolist()


def test_empty_request_gives_an_empty_plan() -> None:
    table = DescriptorTable.build(make_layout())
    plan = build_plan(table, table, [], [], 0)
    assert plan.num_descriptors == 0
    assert plan.nbytes == 0
    assert len(plan.runs(table, table)) == 0


def test_a_suffix_of_blocks_ends_the_request() -> None:
    # 40 tokens fill 3 blocks; the first two are cached locally, only block 3 moves.
    table = DescriptorTable.build(make_layout(), PlanOptions(chunk_mode=True, chunk_tokens=4))
    plan = build_plan(table, table, [6], [2], num_tokens=40)
    chunk_len = 4 * TB
    # Tokens 32..39 are chunks 0 and 1 of the last block: both, and nothing else.
    assert [n for _, n in moved(table, plan.local_ids)] == [chunk_len] * 4
    assert plan.nbytes == 2 * 8 * TB


# --- errors ------------------------------------------------------------------------------


def test_mismatched_lengths_are_rejected() -> None:
    table = DescriptorTable.build(make_layout())
    with pytest.raises(PlanError, match="3 local blocks but 2 remote blocks"):
        build_plan(table, table, [0, 1, 2], [0, 1], 48)


@pytest.mark.parametrize("bad", [8, -1, 100])
def test_out_of_range_block_ids_name_the_id_and_range(bad: int) -> None:
    local = DescriptorTable.build(make_layout(num_blocks=8))
    with pytest.raises(PlanError, match=rf"local block_ids \(group 0\)\[1\]={bad}.*\[0, 8\)"):
        build_plan(local, local, [0, bad], [0, 1], 32)
    with pytest.raises(PlanError, match=rf"remote block_ids \(group 0\)\[1\]={bad}.*\[0, 8\)"):
        build_plan(local, local, [0, 1], [0, bad], 32)


def test_more_blocks_than_the_tokens_fill_is_rejected() -> None:
    table = DescriptorTable.build(make_layout())
    with pytest.raises(PlanError, match="3 blocks given but 17 tokens fill only 2"):
        build_plan(table, table, [0, 1, 2], [0, 1, 2], 17)


@pytest.mark.parametrize("n", [-1, 1.5, True])
def test_bad_token_counts_are_rejected(n: object) -> None:
    table = DescriptorTable.build(make_layout())
    with pytest.raises(PlanError, match="num_tokens"):
        build_plan(table, table, [0], [0], n)  # type: ignore[arg-type]


def test_non_integer_or_ragged_block_ids_are_rejected() -> None:
    table = DescriptorTable.build(make_layout())
    with pytest.raises(PlanError, match="integer"):
        build_plan(table, table, np.array([0.0, 1.0]), [0, 1], 32)
    two = DescriptorTable.build(
        make_layout(groups=(Group(kind=GroupKind.FULL), Group(kind=GroupKind.FULL)))
    )
    with pytest.raises(PlanError, match="one flat list given, the layout has 2 KV groups"):
        build_plan(two, two, [0, 1], [0, 1], 32)
    with pytest.raises(PlanError, match="3 group"):
        build_plan(two, two, [[0], [1], [2]], [[0], [1], [2]], 32)


def test_tables_of_different_shapes_do_not_pair() -> None:
    a = DescriptorTable.build(make_layout(block_size=16))
    b = DescriptorTable.build(make_layout(block_size=32))
    with pytest.raises(LayoutMismatch) as info:
        build_plan(a, b, [0], [0], 16)
    assert info.value.field == "block_size"
    c = DescriptorTable.build(make_layout(), PlanOptions(chunk_mode=True, chunk_tokens=4))
    d = DescriptorTable.build(make_layout())
    with pytest.raises(PlanError, match="PlanOptions"):
        build_plan(c, d, [0], [0], 16)


# --- chunk mode (R-DESC-3) ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "last_block_chunks"),
    [(17, [0]), (24, [0]), (25, [0, 1]), (32, [0, 1])],
)
def test_chunk_mode_sends_only_chunks_holding_tokens_of_the_last_block(
    num_tokens: int, last_block_chunks: list[int]
) -> None:
    layout = make_layout(block_size=16, num_blocks=8)
    table = DescriptorTable.build(layout, PlanOptions(chunk_mode=True, chunk_tokens=5))
    assert table.chunk_tokens == 8  # range 16, bound 5 -> 8
    assert table.chunk_offset == 16
    plan = build_plan(table, table, [2, 5], [2, 5], num_tokens)
    expected = []
    for r in range(2):
        expected.append(r * 8 + 2)  # block 2 is not the last: whole
        if len(last_block_chunks) == 2:  # every chunk goes: one whole descriptor
            expected.append(r * 8 + 5)
        else:
            expected += [16 + (r * 8 + 5) * 2 + k for k in last_block_chunks]
    assert plan.local_ids.tolist() == expected
    chunk_addr = layout.regions[1].base + 5 * 16 * TB + 8 * TB  # region 1, block 5, chunk 1
    if last_block_chunks == [0]:
        assert (chunk_addr - 8 * TB, 8 * TB) in moved(table, plan.local_ids)
    else:
        assert (chunk_addr - 8 * TB, 16 * TB) in moved(table, plan.local_ids)
    assert plan.nbytes == 2 * (16 + 8 * len(last_block_chunks)) * TB


def test_a_bound_above_the_range_means_no_chunks() -> None:
    table = DescriptorTable.build(make_layout(), PlanOptions(chunk_mode=True, chunk_tokens=20))
    assert table.chunk_tokens == 16
    assert len(table) == 16  # no chunk section
    plan = build_plan(table, table, [0, 1], [0, 1], 17)
    assert plan.nbytes == 4 * 16 * TB


def test_chunk_tokens_unset_means_one_prefill_step() -> None:
    opts = PlanOptions(chunk_mode=True, prefill_step_tokens=4)
    table = DescriptorTable.build(make_layout(), opts)
    assert table.chunk_tokens == 4
    plan = build_plan(table, table, [0], [0], 5)
    assert plan.nbytes == 2 * 8 * TB  # chunks 0 and 1 (token 4 opens chunk 1)


@pytest.mark.parametrize(
    ("last_tokens", "expected"),
    [
        # (tokens in the last block, [(shard, chunk), ...] sent of the last block)
        (3, [(0, 0)]),
        (5, [(0, 0), (0, 1)]),
        (8, [(0, 0), (0, 1)]),
        (12, [(0, 0), (0, 1), (1, 0)]),
        (16, [(0, 0), (0, 1), (1, 0), (1, 1)]),
    ],
)
def test_token_split_sends_only_shards_and_chunks_holding_tokens(
    last_tokens: int, expected: list[tuple[int, int]]
) -> None:
    # block 16, 2 TOKEN shards -> 8 tokens per descriptor; bound 4 -> chunks of 4.
    layout = make_layout(16, num_regions=2, split=SplitAxis.TOKEN, num_shards=2)
    table = DescriptorTable.build(layout, PlanOptions(chunk_mode=True, chunk_tokens=4))
    plan = build_plan(table, table, [1, 3], [1, 3], 16 + last_tokens)
    nb = layout.num_blocks
    want = [0 * nb + 1]  # shard 0, block 1 whole
    for shard in range(2):
        if shard:
            want += [1 * nb + 1]  # shard 1, block 1 whole
        chunks = [k for s, k in expected if s == shard]
        if chunks == [0, 1]:  # both chunks: the shard's one whole descriptor
            want += [shard * nb + 3]
        else:
            want += [16 + (shard * nb + 3) * 2 + k for k in chunks]
    assert plan.local_ids.tolist() == want


def test_token_split_without_chunk_mode_sends_every_shard_of_the_last_block() -> None:
    layout = make_layout(16, num_regions=2, split=SplitAxis.TOKEN, num_shards=2)
    table = DescriptorTable.build(layout)
    plan = build_plan(table, table, [0], [0], 3)
    assert plan.local_ids.tolist() == [0, 8]
    # With chunk_mode and no chunking, the empty shard still stays home.
    whole = DescriptorTable.build(layout, PlanOptions(chunk_mode=True, chunk_tokens=8))
    assert build_plan(whole, whole, [0], [0], 3).local_ids.tolist() == [0]


# --- window mode (R-DESC-4) --------------------------------------------------------------

SWA = (Group(kind=GroupKind.FULL), Group(kind=GroupKind.SLIDING, window=16))


def swa_tables(
    window: int = 16, chunk_tokens: int | None = None
) -> tuple[KVLayout, DescriptorTable]:
    groups = (Group(kind=GroupKind.FULL), Group(kind=GroupKind.SLIDING, window=window))
    layout = make_layout(64, num_regions=2, num_blocks=4, groups=groups)
    opts = PlanOptions(
        swa_window_mode=True, chunk_mode=chunk_tokens is not None, chunk_tokens=chunk_tokens
    )
    return layout, DescriptorTable.build(layout, opts)


@pytest.mark.parametrize(
    ("num_tokens", "granules"),
    [
        (168, [(2, 1), (2, 2)]),  # window [152,168): two granules of block 2
        (96, [(1, 1)]),  # window [80,96): one granule
        (72, [(0, 3), (1, 0)]),  # window [56,72) straddles blocks 0 and 1
        (10, [(0, 0)]),  # the window reaches back before token 0
        (64, [(0, 3)]),
    ],
)
def test_window_mode_sends_only_the_granules_the_window_covers(
    num_tokens: int, granules: list[tuple[int, int]]
) -> None:
    # block 64, window 16: granules of 16 tokens; region 0 full, region 1 sliding.
    layout, table = swa_tables()
    blocks = list(range(-(-num_tokens // 64)))
    plan = build_plan(table, table, [blocks, blocks], [blocks, blocks], num_tokens)
    sliding = layout.regions[1]
    full_ids = [b for b in blocks]  # full attention: every block whole
    assert plan.local_ids[: len(blocks)].tolist() == full_ids
    got = moved(table, plan.local_ids[len(blocks) :])
    assert got == [(sliding.base + b * 64 * TB + g * 16 * TB, 16 * TB) for b, g in granules]
    touched = sorted({b for b, _ in granules})
    assert plan.local_blocks[1].tolist() == touched
    assert plan.local_blocks[0].tolist() == blocks


def test_window_as_large_as_the_block_sends_whole_blocks_inside_the_window() -> None:
    _, table = swa_tables(window=64)
    assert len(table) == 8  # no granule section: a granule is a block
    plan = build_plan(table, table, [[0, 1, 2], [0, 1, 2]], [[0, 1, 2], [0, 1, 2]], 160)
    # window [96,160): blocks 1 and 2 of the sliding region; block 0 goes nowhere.
    assert plan.local_ids.tolist() == [0, 1, 2, 4 + 1, 4 + 2]


def test_window_mode_off_sends_sliding_blocks_whole() -> None:
    layout = make_layout(64, num_regions=2, num_blocks=4, groups=SWA)
    table = DescriptorTable.build(layout)
    plan = build_plan(table, table, [[0, 1], [0, 1]], [[0, 1], [0, 1]], 100)
    assert plan.local_ids.tolist() == [0, 1, 4, 5]


def test_chunk_and_window_modes_compose() -> None:
    # window 32, chunks 16: n=104 -> window [72,104) = granules [64,96),[96,128) of
    # block 1; chunk mode drops the chunk [112,128) past the last token's chunk.
    layout, table = swa_tables(window=32, chunk_tokens=16)
    plan = build_plan(table, table, [[0, 1], [0, 1]], [[0, 1], [0, 1]], 104)
    region = layout.regions[1]
    start = region.base + 64 * TB
    sliding = moved(table, plan.local_ids[-3:])
    assert sliding == [(start + k * 16 * TB, 16 * TB) for k in range(3)]
    # full attention: block 0 whole and chunks 0..2 of block 1; then the sliding 3.
    assert plan.num_descriptors == 4 + 3


def test_window_must_divide_the_block_size() -> None:
    groups = (Group(kind=GroupKind.FULL), Group(kind=GroupKind.SLIDING, window=24))
    layout = make_layout(64, num_regions=2, groups=groups)
    with pytest.raises(ConfigError) as info:
        DescriptorTable.build(layout, PlanOptions(swa_window_mode=True))
    assert info.value.key == "swa_window_mode"
    assert "block_size 64 is not a multiple of the sliding window 24" in str(info.value)
    DescriptorTable.build(layout)  # fine while the mode is off


def test_windows_that_straddle_token_shards_are_cut_in_gcd_units() -> None:
    # block 6 over 3 TOKEN shards = 2 tokens a descriptor; window 3 straddles shards.
    # Units of gcd(3, 2) = 1 token. n=8: window granules 1 and 2 = tokens [3, 9).
    groups = (Group(kind=GroupKind.FULL), Group(kind=GroupKind.SLIDING, window=3))
    layout = make_layout(6, num_regions=6, split=SplitAxis.TOKEN, num_shards=3, groups=groups)
    table = DescriptorTable.build(layout, PlanOptions(swa_window_mode=True))
    plan = build_plan(table, table, [[0, 1], [0, 1]], [[0, 1], [0, 1]], 8)
    r3, r4, r5 = layout.regions[3:]
    assert moved(table, plan.local_ids[6:]) == [  # after the full layer's 3 shards x 2 blocks
        (r3.base + 2 * TB, 2 * TB),  # shard 0 of block 1 (tokens 6, 7): whole
        (r4.base + 1 * TB, TB),  # shard 1 of block 0: token 3 only
        (r4.base + 2 * TB, TB),  # shard 1 of block 1: token 8 only
        (r5.base, 2 * TB),  # shard 2 of block 0 (tokens 4, 5): whole
    ]


def test_sub_block_descriptors_need_a_token_major_layout() -> None:
    layout = make_layout(kv_layout="HND")
    with pytest.raises(ConfigError) as info:
        DescriptorTable.build(layout, PlanOptions(chunk_mode=True, chunk_tokens=4))
    assert info.value.key == "chunk_mode"
    assert len(DescriptorTable.build(layout)) == 16


# --- coalescing (R-DESC-6) ----------------------------------------------------------------


def test_contiguous_blocks_coalesce_into_one_run_per_region() -> None:
    local = DescriptorTable.build(make_layout())
    remote = DescriptorTable.build(make_layout(num_blocks=12, base=0x800000))
    plan = build_plan(local, remote, [2, 3, 4, 5], [7, 8, 9, 10], 64)
    runs = plan.runs(local, remote)
    assert len(runs) == 2
    assert runs.length.tolist() == [4 * 16 * TB] * 2
    assert runs.local_addr.tolist() == [int(local.addr[2]), int(local.addr[8 + 2])]
    assert runs.remote_addr.tolist() == [int(remote.addr[7]), int(remote.addr[12 + 7])]
    assert runs.nbytes == plan.nbytes


def test_runs_merge_only_where_both_sides_are_contiguous() -> None:
    table = DescriptorTable.build(make_layout())
    # local 0,1,2 contiguous; remote 4,5 contiguous then 1: two runs per region.
    plan = build_plan(table, table, [0, 1, 2], [4, 5, 1], 48)
    runs = plan.runs(table, table)
    assert runs.length.tolist() == [2 * 64, 64] * 2
    scattered = build_plan(table, table, [5, 0, 3], [1, 2, 3], 48)
    assert len(scattered.runs(table, table)) == 6


def test_regions_packed_back_to_back_merge_across_regions() -> None:
    table = DescriptorTable.build(make_layout(packed=True, num_blocks=4))
    plan = build_plan(table, table, [0, 1, 2, 3], [0, 1, 2, 3], 64)
    runs = plan.runs(table, table)
    assert len(runs) == 1
    assert runs.nbytes == 2 * 4 * 16 * TB


def test_runs_follow_the_coalesce_option_unless_told() -> None:
    table = DescriptorTable.build(make_layout(), PlanOptions(coalesce=False))
    plan = build_plan(table, table, [0, 1], [0, 1], 32)
    assert len(plan.runs(table, table)) == 4
    assert len(plan.runs(table, table, merge=True)) == 2


@pytest.mark.parametrize("mixed", ["local", "remote", "both"])
def test_runs_do_not_merge_across_devices(mixed: str) -> None:
    # Contiguous on both sides, but region 1 sits on another device on the mixed side(s).
    single = make_layout(packed=True, num_blocks=2)
    moved_regions = (
        single.regions[0],
        msgspec.structs.replace(single.regions[1], device_id=1),
    )
    two = msgspec.structs.replace(single, regions=moved_regions)
    local = DescriptorTable.build(two if mixed in ("local", "both") else single)
    remote = DescriptorTable.build(two if mixed in ("remote", "both") else single)
    plan = build_plan(local, remote, [0, 1], [0, 1], 32)
    runs = plan.runs(local, remote)
    assert runs.length.tolist() == [2 * 64, 2 * 64]
    assert (runs.local_device.tolist() == [0, 1]) == (mixed != "remote")
    assert (runs.remote_device.tolist() == [0, 1]) == (mixed != "local")


def test_runs_refuse_tables_of_another_shape() -> None:
    table = DescriptorTable.build(make_layout())
    plan = build_plan(table, table, [0], [0], 16)
    other = DescriptorTable.build(make_layout(num_regions=3))
    with pytest.raises(PlanError) as info:
        plan.runs(other, other)
    assert str(info.value) == "runs(): tables differ in shape from those the plan was built on"


def test_two_contiguous_descriptors_merge_into_one_run() -> None:
    table = DescriptorTable.build(make_layout(num_regions=1))
    plan = build_plan(table, table, [2, 3], [2, 3], 32)
    assert plan.num_descriptors == 2
    runs = plan.runs(table, table, merge=True)
    assert (len(runs), int(runs.length[0])) == (1, 2 * 16 * TB)


@pytest.mark.parametrize("wraps", ["local", "remote", "both"])
def test_runs_never_merge_across_the_top_of_the_address_space(wraps: str) -> None:
    # Region 0's only block ends exactly at 2**64, region 1's starts at 0: their ends
    # meet modulo 2**64 but the bytes are not contiguous, on either side.
    n = 16 * TB

    def layout(wrap: bool) -> KVLayout:
        bases = (2**64 - n, 0) if wrap else (1 << 40, (1 << 40) + n)
        return KVLayout(
            block_size=16,
            regions=tuple(
                Region(base=b, num_blocks=1, stride=n, block_len=n, layer=i)
                for i, b in enumerate(bases)
            ),
        )

    local = DescriptorTable.build(layout(wraps in ("local", "both")))
    remote = DescriptorTable.build(layout(wraps in ("remote", "both")))
    plan = build_plan(local, remote, [0], [0], 16)
    runs = plan.runs(local, remote, merge=True)
    assert len(runs) == 2
    assert runs.length.tolist() == [n, n]
