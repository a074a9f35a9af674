"""Tests of the KV layout model (R-LAYOUT-1, R-LAYOUT-2)."""

from __future__ import annotations

import ctypes
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.descriptors import DescriptorTable, PlanOptions, build_plan
from kvxfer.errors import LayoutError
from kvxfer.layout import (
    Group,
    GroupKind,
    KVLayout,
    KVPart,
    MemKind,
    Region,
    SplitAxis,
    split_kv,
)
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
        ({"regions": (region(layer=0),)}, ("num_regions", 2, 1)),
        (
            {"regions": (region(layer=0), region(layer=1, base=1 << 20, block_len=32))},
            ("regions[1].block_len", 64, 32),
        ),
        (
            {"regions": (region(layer=0), region(layer=2, base=1 << 20))},
            ("regions[1].layer", 1, 2),
        ),
        (
            {"regions": (region(layer=0, mem=MemKind.VRAM), region(layer=1, base=1 << 20))},
            ("regions[0].mem", MemKind.DRAM, MemKind.VRAM),
        ),
        (
            {"regions": (region(layer=0), region(layer=1, base=1 << 20, head=1))},
            ("regions[1].head", 0, 1),
        ),
    ],
)
def test_first_difference_names_the_first_differing_field(
    change: dict[str, Any], expected: tuple[str, Any, Any]
) -> None:
    assert two_layers().first_difference(two_layers(**change)) == expected


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
