"""Tests of the KV layout model (R-LAYOUT-1, R-LAYOUT-2)."""

from __future__ import annotations

import ctypes
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.core.descriptors import DescriptorTable, PlanOptions, build_plan
from kvxfer.core.layout import (
    Group,
    GroupKind,
    KVLayout,
    KVPart,
    MemKind,
    Region,
    SplitAxis,
    split_kv,
)
from kvxfer.errors import LayoutError
from kvxfer.testing import strategies as kst


def region(**overrides: Any) -> Region:
    fields: dict[str, Any] = {"base": 4096, "num_blocks": 8, "stride": 64, "block_len": 64}
    fields.update(overrides)
    return Region(**fields)


def two_layers(**overrides: Any) -> KVLayout:
    fields: dict[str, Any] = {
        "block_size": 16,
        "regions": (region(layer=0), region(layer=1, base=1 << 20)),
    }
    fields.update(overrides)
    return KVLayout(**fields)


# --- validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field", "rule"),
    [
        ({"stride": 32}, "stride", "must be >= block_len (64)"),
        ({"base": -1}, "base", "must be >= 0"),
        ({"num_blocks": 0}, "num_blocks", "must be >= 1"),
        ({"block_len": 0, "stride": 0}, "block_len", "must be >= 1"),
        ({"num_blocks": True}, "num_blocks", "must be an int"),
        ({"layer": 1.0}, "layer", "must be an int"),
        ({"base": (1 << 64) - 100}, "base", "below 2**64"),
        ({"mem": "vram"}, "mem", "MemKind"),
        ({"part": "k"}, "part", "KVPart"),
    ],
)
def test_region_rules_name_field_value_and_rule(
    overrides: dict[str, Any], field: str, rule: str
) -> None:
    with pytest.raises(LayoutError) as info:
        region(**overrides)
    message = str(info.value)
    assert f"Region.{field}=" in message
    assert rule in message


def test_group_window_iff_sliding() -> None:
    with pytest.raises(LayoutError, match=r"Group.window=0: must be > 0 iff kind is sliding"):
        Group(kind=GroupKind.SLIDING)
    with pytest.raises(LayoutError, match=r"Group\.window=8"):
        Group(kind=GroupKind.FULL, window=8)
    assert Group(kind=GroupKind.SLIDING, window=8).window == 8


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"block_size": 0}, r"KVLayout.block_size=0: must be >= 1"),
        ({"regions": ()}, r"KVLayout.regions=\(\): must not be empty"),
        (
            {"regions": (region(), region(layer=1, base=1 << 20, num_blocks=9))},
            r"regions\[1\].num_blocks=9: must equal regions\[0\] \(8\)",
        ),
        (
            {"split_axis": SplitAxis.TOKEN, "num_shards": 3},
            r"num_shards=3: TOKEN split needs block_size \(16\) divisible",
        ),
        (
            {"regions": (region(block_len=60, stride=64),)},
            r"regions\[0\].block_len=60: must be a multiple of 16 tokens",
        ),
        ({"regions": (region(shard=1),)}, r"regions\[0\].shard=1: must be < num_shards \(1\)"),
        ({"regions": (region(group=1),)}, r"regions\[0\].group=1: must be < len\(groups\)"),
        (
            {"regions": (region(), region(base=1 << 20))},
            r"regions\[1\].layer=0: duplicate \(layer, part, shard, head, lane\)",
        ),
        (
            {"groups": (Group(kind=GroupKind.FULL), Group(kind=GroupKind.SLIDING, window=4))},
            r"group 1 has no region",
        ),
        ({"dtype": ""}, r"KVLayout.dtype='': must not be empty"),
    ],
)
def test_layout_rules_name_field_value_and_rule(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        two_layers(**overrides)


def test_token_split_block_len_counts_tokens_per_shard() -> None:
    # 16 tokens over 4 TOKEN shards: 4 tokens per descriptor, so 12 bytes is fine.
    regions = tuple(region(block_len=12, stride=12, shard=s, base=s << 20) for s in range(4))
    layout = KVLayout(block_size=16, regions=regions, split_axis=SplitAxis.TOKEN, num_shards=4)
    assert layout.tokens_per_desc == 4
    assert layout.token_spans == 4


def test_derived_properties() -> None:
    groups = (Group(kind=GroupKind.FULL), Group(kind=GroupKind.SLIDING, window=8))
    layout = KVLayout(
        block_size=16,
        regions=(
            region(layer=0, part=KVPart.K, block_len=32, stride=32),
            region(layer=0, part=KVPart.V, block_len=32, stride=32, base=1 << 20),
            region(layer=1, group=1, base=2 << 20),
        ),
        groups=groups,
        num_shards=2,  # HEAD split: shards do not cut tokens
    )
    assert layout.num_blocks == 8
    assert layout.num_regions == 3
    assert layout.tokens_per_desc == 16
    assert layout.token_spans == 1
    assert layout.block_bytes(0) == 64
    assert layout.block_bytes(1) == 64
    assert layout.regions[2].end == (2 << 20) + 7 * 64 + 64


# --- comparison and serialization (R-LAYOUT-2) ---------------------------------------------


def test_first_difference_ignores_placement() -> None:
    a = two_layers()
    moved = tuple(
        msgspec.structs.replace(r, base=r.base + 999, stride=r.stride * 2, device_id=3)
        for r in a.regions
    )
    b = msgspec.structs.replace(
        a, regions=tuple(msgspec.structs.replace(r, num_blocks=20) for r in moved)
    )
    assert a.first_difference(b) is None


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"block_size": 32}, ("block_size", 16, 32)),
        ({"split_axis": SplitAxis.TOKEN}, ("split_axis", SplitAxis.HEAD, SplitAxis.TOKEN)),
        ({"dtype": "float16"}, ("dtype", "bfloat16", "float16")),
        ({"kv_layout": "HND"}, ("kv_layout", "NHD", "HND")),
        ({"regions": (region(layer=0),)}, ("num_layers", 2, 1)),
        (
            {"regions": (region(layer=0), region(layer=1, base=1 << 20, block_len=32))},
            ("regions[1] (layer 1 KV).block_len: bytes of 16 tokens of bfloat16, 4 vs 2", 64, 32),
        ),
        (
            {"regions": (region(layer=0), region(layer=2, base=1 << 20))},
            ("regions[1] (layer 1 KV).layer", 1, 2),
        ),
        (
            {"regions": (region(layer=0, mem=MemKind.VRAM), region(layer=1, base=1 << 20))},
            ("regions[0] (layer 0 KV).mem", MemKind.DRAM, MemKind.VRAM),
        ),
        (
            {"regions": (region(layer=0), region(layer=1, base=1 << 20, head=1))},
            ("regions[1] (layer 1 KV).head", 0, 1),
        ),
    ],
)
def test_first_difference_names_the_first_differing_field(
    change: dict[str, Any], expected: tuple[str, Any, Any]
) -> None:
    # A field names the region by its layer and part; a size names the per-token bytes.
    got = two_layers().first_difference(two_layers(**change))
    assert got is not None
    assert got[0].startswith(expected[0]) and got[1:] == expected[1:], got


@given(kst.layouts().flatmap(lambda layout: st.tuples(st.just(layout), kst.relocated(layout))))
def test_relocated_layouts_have_the_same_shape_and_survive_the_wire(
    pair: tuple[KVLayout, KVLayout],
) -> None:
    local, remote = pair
    assert local.first_difference(remote) is None
    for codec in (msgspec.json, msgspec.msgpack):
        decoded = codec.decode(codec.encode(remote), type=KVLayout)
        assert decoded == remote
    # The remote table rebuilt from the wire equals the one built from the original.
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(remote), type=KVLayout)
    a, b = DescriptorTable.build(remote), DescriptorTable.build(wire)
    np.testing.assert_array_equal(a.addr, b.addr)
    np.testing.assert_array_equal(a.length, b.length)


def test_one_region_per_head_is_unique_and_head_is_optional_on_the_wire() -> None:
    heads = KVLayout(
        block_size=16,
        regions=tuple(
            region(base=4096 + h * 64, stride=256, part=part, head=h)
            for h in range(2)
            for part in (KVPart.K, KVPart.V)
        ),
    )
    assert [r.head for r in heads.regions] == [0, 0, 1, 1]
    with pytest.raises(LayoutError, match=r"Region.head=-1: must be >= 0"):
        KVLayout(block_size=16, regions=(region(), region(head=-1, layer=1)))
    # A peer without the field (an older kvxfer) sends no "head": it decodes as 0.
    old = msgspec.json.encode(two_layers()).replace(b',"head":0', b"")
    assert b'"head":0' not in old
    assert msgspec.json.decode(old, type=KVLayout) == two_layers()


def test_decoding_an_invalid_layout_fails_validation() -> None:
    data = msgspec.json.encode(two_layers()).replace(b'"block_size":16', b'"block_size":0')
    with pytest.raises(msgspec.ValidationError, match="block_size"):
        msgspec.json.decode(data, type=KVLayout)


def test_summary_is_one_line_with_the_shape() -> None:
    groups = (Group(kind=GroupKind.FULL), Group(kind=GroupKind.SLIDING, window=8))
    layout = two_layers(
        regions=(region(layer=0), region(layer=1, group=1, base=1 << 20)), groups=groups
    )
    text = layout.summary()
    assert "\n" not in text
    for part in (
        "block_size=16",
        "split=head",
        "groups=[full,sliding(w=8)]",
        "regions=2",
        "layers=2",
        "num_blocks=8",
        "block_len=64",
        "dtype=bfloat16",
        "mem=dram",
    ):
        assert part in text


# --- from tensors (R-LAYOUT-1) ------------------------------------------------------------

import torch  # noqa: E402  (the torch extra is part of the test environment)


def _bytes_at(addr: int, length: int) -> bytes:
    return ctypes.string_at(addr, length)


def test_from_tensors_describes_memory_in_place() -> None:
    tensors = [torch.randn(6, 16, 2, 8).to(torch.bfloat16) for _ in range(3)]
    layout = KVLayout.from_tensors(tensors, block_size=16)
    assert layout.dtype == "bfloat16"
    assert layout.num_blocks == 6
    for i, (t, r) in enumerate(zip(tensors, layout.regions)):
        assert r.base == t.data_ptr()
        assert r.block_len == 16 * 2 * 8 * 2
        assert r.stride == r.block_len
        assert (r.layer, r.part, r.mem, r.device_id) == (i, KVPart.KV, MemKind.DRAM, 0)
    # No copy: writing the tensor changes the bytes at the described address.
    tensors[1][4].fill_(1.5)
    r = layout.regions[1]
    assert (
        _bytes_at(r.base + 4 * r.stride, r.block_len)
        == tensors[1][4].view(torch.int16).numpy().tobytes()
    )


@pytest.mark.parametrize("kv_dim", [0, 1])
def test_vllm_kv_caches_split_into_k_and_v_views(kv_dim: int) -> None:
    shape = (2, 5, 16, 2, 8) if kv_dim == 0 else (5, 2, 16, 2, 8)
    caches = [torch.arange(np.prod(shape), dtype=torch.float32).reshape(shape) for _ in range(2)]
    layout = KVLayout.from_kv_caches(caches, block_size=16, kv_dim=kv_dim)
    assert [(r.layer, r.part) for r in layout.regions] == [
        (0, KVPart.K),
        (0, KVPart.V),
        (1, KVPart.K),
        (1, KVPart.V),
    ]
    block_len = 16 * 2 * 8 * 4
    k, v = layout.regions[2], layout.regions[3]
    assert k.base == caches[1].data_ptr()
    assert k.block_len == v.block_len == block_len
    if kv_dim == 0:
        assert (k.stride, v.base - k.base) == (block_len, 5 * block_len)
    else:
        assert (k.stride, v.base - k.base) == (2 * block_len, block_len)
    # The table's chunk descriptors land on the right tokens (token-major blocks).
    table = DescriptorTable.build(layout, PlanOptions(chunk_mode=True, chunk_tokens=8))
    plan = build_plan(table, table, [1, 3], [1, 3], 16 + 5)
    v_view = split_kv(caches[1], kv_dim=kv_dim)[1]
    runs = plan.runs(table, table, merge=False)
    last = runs.local_addr[-1], runs.length[-1]  # region 3 (layer 1 V), block 3, chunk 0
    assert _bytes_at(int(last[0]), int(last[1])) == v_view[3, :8].numpy().tobytes()


def test_layer_groups_and_shards_repeat_for_k_and_v() -> None:
    caches = [torch.zeros(2, 4, 8, 4) for _ in range(2)]
    groups = (Group(kind=GroupKind.FULL), Group(kind=GroupKind.SLIDING, window=4))
    layout = KVLayout.from_kv_caches(
        caches, block_size=8, layers=[5, 6], layer_groups=[0, 1], groups=groups
    )
    assert [(r.layer, r.group) for r in layout.regions] == [(5, 0), (5, 0), (6, 1), (6, 1)]


def test_from_tensors_rejects_what_cannot_be_one_range_per_block() -> None:
    t = torch.zeros(4, 16, 8)
    with pytest.raises(LayoutError, match="one block must be contiguous"):
        KVLayout.from_tensors([t.transpose(1, 2)], block_size=16)
    with pytest.raises(LayoutError, match="mixed dtypes"):
        KVLayout.from_tensors([t, t.to(torch.float16)], block_size=16)
    with pytest.raises(LayoutError, match="needs one per tensor"):
        KVLayout.from_tensors([t], block_size=16, layers=[0, 1])
    with pytest.raises(LayoutError, match="dim 0 must have size 2"):
        split_kv(t)
    with pytest.raises(LayoutError, match="must not be empty"):
        KVLayout.from_tensors([], block_size=16)


def test_size_one_dims_need_no_particular_stride() -> None:
    # A (blocks, 1, tokens*heads) view of a contiguous tensor is one range per block.
    t = torch.zeros(4, 64)[:, None, :]
    layout = KVLayout.from_tensors([t], block_size=16)
    assert layout.regions[0].block_len == 64 * 4


# -- from_kv_caches checks block_size against the tensors (issue 21) ------------------


def _pools(kv_layout: str, kv_dim: int, blocks: int, tokens: int, heads: int, dim: int) -> Any:
    inner = (tokens, heads, dim) if kv_layout == "NHD" else (heads, tokens, dim)
    shape = (2, blocks, *inner) if kv_dim == 0 else (blocks, 2, *inner)
    return [torch.zeros(shape) for _ in range(2)]


@given(
    kv_layout=st.sampled_from(["NHD", "HND"]),
    kv_dim=st.sampled_from([0, 1]),
    blocks=st.integers(1, 4),
    tokens=st.sampled_from([1, 2, 4, 8, 16]),
    heads=st.integers(1, 4),
    dim=st.sampled_from([1, 2, 8]),
    claimed=st.sampled_from([1, 2, 4, 8, 16, 32]),
)
def test_from_kv_caches_checks_block_size_against_the_token_dim(
    kv_layout: str, kv_dim: int, blocks: int, tokens: int, heads: int, dim: int, claimed: int
) -> None:
    pools = _pools(kv_layout, kv_dim, blocks, tokens, heads, dim)
    if claimed != tokens:
        with pytest.raises(LayoutError) as info:
            KVLayout.from_kv_caches(pools, block_size=claimed, kv_dim=kv_dim, kv_layout=kv_layout)
        message = str(info.value)
        assert f"block_size={claimed}" in message and f"hold {tokens} tokens" in message
        assert kv_layout in message
        return
    layout = KVLayout.from_kv_caches(pools, block_size=claimed, kv_dim=kv_dim, kv_layout=kv_layout)
    assert (layout.num_kv_heads, layout.head_dim) == (heads, dim)
    assert f"kv_heads={heads} head_dim={dim}" in layout.summary()


def test_from_kv_caches_refuses_8_token_blocks_on_16_token_pools() -> None:
    # The case of issue 21: (2, num_blocks, 16, kv_heads, head_dim), block_size=8.
    pools = [torch.zeros(2, 32, 16, 2, 32) for _ in range(2)]
    with pytest.raises(LayoutError, match=r"block_size=8: kv_caches\[0\] has shape"):
        KVLayout.from_kv_caches(pools, block_size=8)
    assert KVLayout.from_kv_caches(pools, block_size=16).block_size == 16


def test_token_split_shards_hold_a_slice_of_the_block() -> None:
    # TOKEN split into 2 shards: each shard's tensor holds block_size / 2 tokens.
    pools = [torch.zeros(2, 4, 8, 2, 4) for _ in range(2)]
    layout = KVLayout.from_kv_caches(
        pools, block_size=16, shards=[0, 1], layers=[0, 0], split_axis=SplitAxis.TOKEN, num_shards=2
    )
    assert layout.tokens_per_desc == 8
    with pytest.raises(LayoutError, match="hold 8 tokens, not 16"):
        KVLayout.from_kv_caches(pools, block_size=16, shards=[0, 1], layers=[0, 0])


def test_shapes_that_do_not_say_where_tokens_are_are_not_guessed() -> None:
    # 3-d blocks or an unknown in-block order: only block_len's own rule applies.
    flat = [torch.zeros(2, 4, 8, 4) for _ in range(2)]
    assert KVLayout.from_kv_caches(flat, block_size=8).num_kv_heads == 0
    five = [torch.zeros(2, 4, 16, 2, 4) for _ in range(2)]
    layout = KVLayout.from_kv_caches(five, block_size=4, kv_layout="LBHNC")
    assert (layout.num_kv_heads, layout.head_dim) == (0, 0)
    # layers of different widths: no single heads/head_dim to name
    mixed = [torch.zeros(2, 4, 16, 2, 4), torch.zeros(2, 4, 16, 4, 4)]
    assert KVLayout.from_kv_caches(mixed, block_size=16).num_kv_heads == 0


class _LayoutV1(msgspec.Struct, frozen=True, kw_only=True):
    """KVLayout as protocol-1 peers built before num_kv_heads/head_dim existed."""

    block_size: int
    regions: tuple[Region, ...]
    split_axis: SplitAxis = SplitAxis.HEAD
    num_shards: int = 1
    groups: tuple[Group, ...] = (Group(kind=GroupKind.FULL),)
    dtype: str = "bfloat16"
    kv_layout: str = "NHD"


def test_heads_fields_keep_the_wire_compatible_both_ways() -> None:
    pools = [torch.zeros(2, 4, 16, 2, 8) for _ in range(2)]
    new = KVLayout.from_kv_caches(pools, block_size=16)
    old = msgspec.json.decode(msgspec.json.encode(new), type=_LayoutV1)  # old peer reads ours
    assert old.regions == new.regions and old.block_size == 16
    back = msgspec.json.decode(msgspec.json.encode(old), type=KVLayout)  # we read an old one
    assert (back.num_kv_heads, back.head_dim) == (0, 0)
    assert back.first_difference(new) is None
    with pytest.raises(msgspec.ValidationError, match="num_kv_heads"):
        msgspec.json.decode(
            msgspec.json.encode({**msgspec.to_builtins(new), "num_kv_heads": -1}), type=KVLayout
        )


def test_a_permuted_pool_is_refused_as_non_contiguous_not_as_a_wrong_block_size() -> None:
    # HND memory viewed as NHD (a permute): the logical dims are not the in-block order.
    hnd = torch.zeros(2, 4, 2, 16, 8).permute(0, 1, 3, 2, 4)
    with pytest.raises(LayoutError, match="one block must be contiguous"):
        KVLayout.from_kv_caches([hnd], block_size=16, kv_layout="HND")
