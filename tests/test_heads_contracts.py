"""Exact contracts of the head algebra and of what a TP posting side prepares: which
field a refused pair names, with whose value on which side; what a ``TPRank`` accepts;
the one-head section and the rows prepared with it (R-TP-1, R-TP-2).

The properties in ``test_heads_properties.py`` show that accepted pairs move the right
bytes; these pin down the refusals and the prepared rows, written for the survivors of
``scripts/mutation.sh heads tp_plan``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest

from kvxfer.core.descriptors import DescriptorTable, PlanOptions
from kvxfer.core.heads import (
    HeadLayout,
    TPRank,
    check_head_layouts,
    pairing_heads,
    split_heads,
)
from kvxfer.core.layout import Group, GroupKind, KVLayout, MemKind, Region, SplitAxis
from kvxfer.core.tp_plan import HeadSection, TPPlanner, head_section, prepared_rows
from kvxfer.errors import ConfigError, LayoutError, LayoutMismatch, PlanError
from kvxfer.testing import tp_strategies as tps

P = HeadLayout(num_kv_heads=4, tp_size=1)  # the producer: TP1, every head
C = HeadLayout(num_kv_heads=4, tp_size=2)  # the consumer: TP2, rank 1 holds heads 2-3


def _model(**kw: Any) -> tps.TPModel:
    fields: dict[str, Any] = {"num_kv_heads": 4, "layers": 2, "head_bytes": 4, "block_size": 4}
    fields.update(kw)
    return tps.TPModel(**fields)


def _pair(**kw: Any) -> tuple[KVLayout, KVLayout]:
    """Consumer rank 1's layout and the producer's, one region per head, accepted."""
    model = _model(**kw)
    local = tps.rank_layout(model, C, 1, per_head=True, num_blocks=4, seed=3)
    remote = tps.rank_layout(model, P, 0, per_head=True, num_blocks=4)
    check_head_layouts(local, remote, local_heads=C, remote_heads=P, local_rank=1)
    return local, remote


def _with(layout: KVLayout, **fields: Any) -> KVLayout:
    return msgspec.structs.replace(layout, **fields)


def _regions(layout: KVLayout, which: Callable[[Region], bool], **fields: Any) -> KVLayout:
    return _with(
        layout,
        regions=tuple(
            msgspec.structs.replace(r, **fields) if which(r) else r for r in layout.regions
        ),
    )


def _head_dim(layout: KVLayout, dim: int) -> KVLayout:
    return _with(layout, head_dim=dim)


#: name -> (what changes on the producer's side, the field named, the consumer's
#: value, the producer's value). Each leaves everything checked before it equal.
CHANGES: dict[str, tuple[Callable[[KVLayout], KVLayout], str, Any, Any]] = {
    "block_size": (lambda r: _with(r, block_size=8), "block_size", 4, 8),
    "dtype": (lambda r: _with(r, dtype="float16"), "dtype", "uint8", "float16"),
    "num_shards": (
        lambda r: _with(r, num_shards=2, split_axis=SplitAxis.HEAD),
        "num_shards",
        1,
        2,
    ),
    "groups": (
        lambda r: _with(r, groups=(Group(kind=GroupKind.SLIDING, window=4),)),
        "groups",
        (Group(kind=GroupKind.FULL),),
        (Group(kind=GroupKind.SLIDING, window=4),),
    ),
    "head_dim": (lambda r: _head_dim(r, 2), "head_dim", 1, 2),
    "memory": (
        lambda r: _regions(r, lambda x: x.layer == 0 and x.part.name == "K", mem=MemKind.VRAM),
        "layer 0 K.mem",
        MemKind.DRAM,
        MemKind.VRAM,
    ),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_refused_pair_names_the_field_and_each_sides_value(name: str) -> None:
    change, field, mine, theirs = CHANGES[name]
    local, remote = _pair()
    if name == "head_dim":
        local = _head_dim(local, 1)
    changed = change(remote)
    with pytest.raises(LayoutMismatch) as e:
        check_head_layouts(local, changed, local_heads=C, remote_heads=P, local_rank=1)
    assert (e.value.field, e.value.local, e.value.remote) == (field, mine, theirs)
    # From the other side the same field, the values the other way round.
    with pytest.raises(LayoutMismatch) as e:
        check_head_layouts(changed, local, local_heads=P, remote_heads=C, remote_rank=1)
    assert (e.value.field, e.value.local, e.value.remote) == (field, theirs, mine)


def test_a_head_dim_one_side_does_not_state_is_not_compared() -> None:
    local, remote = _pair()
    check_head_layouts(
        _head_dim(local, 0), _head_dim(remote, 7), local_heads=C, remote_heads=P, local_rank=1
    )
    check_head_layouts(
        _head_dim(local, 7), _head_dim(remote, 0), local_heads=C, remote_heads=P, local_rank=1
    )


def test_regions_of_several_heads_must_agree_on_their_interior_order() -> None:
    model = _model()
    two = HeadLayout(num_kv_heads=4, tp_size=2)
    local = tps.rank_layout(model, two, 1, per_head=False, num_blocks=4, kv_layout="NHD")
    remote = tps.rank_layout(model, two, 0, per_head=False, num_blocks=4, kv_layout="HND")
    with pytest.raises(LayoutMismatch) as e:
        check_head_layouts(
            local, remote, local_heads=two, remote_heads=two, local_rank=1, remote_rank=0
        )
    assert (e.value.field, e.value.local, e.value.remote) == ("kv_layout", "NHD", "HND")
    # One head per region: the two orders are the same bytes.
    one_l = tps.rank_layout(model, C, 1, per_head=True, num_blocks=4, kv_layout="NHD")
    one_r = tps.rank_layout(model, P, 0, per_head=True, num_blocks=4, kv_layout="HND")
    check_head_layouts(one_l, one_r, local_heads=C, remote_heads=P, local_rank=1)


def test_a_region_one_side_lacks_is_named_with_present_and_absent() -> None:
    local, remote = _pair()

    def without_layer1_v(layout: KVLayout) -> KVLayout:
        return _with(
            layout, regions=tuple(r for r in layout.regions if (r.layer, r.part.name) != (1, "V"))
        )

    # The producer lacks layer 1's V regions, then the consumer does.
    for mine, theirs, values in (
        (local, without_layer1_v(remote), ("present", "absent")),
        (without_layer1_v(local), remote, ("absent", "present")),
    ):
        with pytest.raises(LayoutMismatch) as e:
            check_head_layouts(mine, theirs, local_heads=C, remote_heads=P, local_rank=1)
        assert (e.value.field, e.value.local, e.value.remote) == ("regions of layer 1 V", *values)


def test_which_side_disagrees_with_its_own_heads_is_said() -> None:
    local, remote = _pair()
    # Rank 1 described as rank 0: its regions hold heads 2-3, not 0-1.
    with pytest.raises(LayoutError, match=r"^local: ") as e:
        check_head_layouts(local, remote, local_heads=C, remote_heads=P, local_rank=0)
    assert not isinstance(e.value, LayoutMismatch)
    with pytest.raises(LayoutError, match=r"^remote: "):
        check_head_layouts(remote, local, local_heads=P, remote_heads=C, remote_rank=0)
    # The default ranks are 0 on both sides: a TP1 pair needs none given.
    one = tps.rank_layout(_model(), P, 0, per_head=True, num_blocks=4)
    check_head_layouts(one, one, local_heads=P, remote_heads=P)


@pytest.mark.parametrize("rank", [-1, 2, 5, True, 1.0, "1", None])
def test_a_tp_rank_outside_its_group_is_refused_by_name(rank: Any) -> None:
    with pytest.raises(ConfigError) as e:
        TPRank(heads=C, rank=rank)
    assert (e.value.key, e.value.value) == ("tp_rank", rank)
    assert e.value.rule == "must be an int in [0, tp_size=2)"


def test_a_tp_rank_takes_any_rank_of_its_group_and_needs_a_head_layout() -> None:
    assert [TPRank(heads=C, rank=r).rank for r in range(2)] == [0, 1]
    assert TPRank(heads=P).rank == 0
    with pytest.raises(ConfigError) as e:
        TPRank(heads={"num_kv_heads": 4}, rank=0)  # type: ignore[arg-type]
    assert (e.value.key, e.value.rule) == ("heads", "must be a HeadLayout")


def _table(per_head: bool, kv_layout: str = "HND", heads: HeadLayout = C) -> DescriptorTable:
    layout = tps.rank_layout(
        _model(), heads, 1 if heads.tp_size > 1 else 0, per_head=per_head, num_blocks=4,
        kv_layout=kv_layout,
    )  # fmt: skip
    return DescriptorTable.build(layout)


def test_the_head_section_is_the_one_head_cut_prepared_after_the_table() -> None:
    table = _table(per_head=False)
    section = head_section(table, C, 1)
    assert section is not None and section.offset == len(table)
    cut = DescriptorTable.build(split_heads(table.layout, C, 1, 1))
    for name in ("addr", "length", "device"):
        assert np.array_equal(getattr(section.table, name), getattr(cut, name))
    # Each one-head row is half a two-head row: the same bytes, cut in two.
    assert int(section.table.length.sum()) == int(table.length.sum())
    assert len(section.table) == 2 * len(table)


@pytest.mark.parametrize(
    ("why", "table", "heads"),
    [
        ("regions of one head already", lambda: _table(per_head=True), C),
        ("token-major blocks: a head is strided", lambda: _table(False, "NHD"), C),
        ("latent KV: one head", None, HeadLayout(num_kv_heads=1, tp_size=2, latent=True)),
    ],
)
def test_no_head_section_where_there_is_nothing_to_cut(
    why: str, table: Callable[[], DescriptorTable] | None, heads: HeadLayout
) -> None:
    if table is None:
        model = _model(num_kv_heads=1, latent=True)
        layout = tps.rank_layout(model, heads, 1, per_head=False, num_blocks=4)
        built = DescriptorTable.build(layout)
    else:
        built = table()
    assert head_section(built, heads, 1) is None, why


def test_prepared_rows_are_the_tables_then_the_sections() -> None:
    table = _table(per_head=False)
    assert prepared_rows(table, None) is table
    section = head_section(table, C, 1)
    assert section is not None
    rows = prepared_rows(table, section)
    n = len(table)
    for name in ("addr", "length", "device"):
        got = getattr(rows, name)
        assert np.array_equal(got[:n], getattr(table, name))
        assert np.array_equal(got[n:], getattr(section.table, name))
        assert not got.flags.writeable
    # The rows only: the layout and sections stay the table's own.
    assert rows.layout is table.layout and rows.num_blocks == table.num_blocks
    misplaced = HeadSection(table=section.table, offset=n + 1)
    with pytest.raises(PlanError, match=r"starts right after its table"):
        prepared_rows(table, misplaced)


def _planner_inputs() -> tuple[DescriptorTable, dict[int, DescriptorTable]]:
    """Consumer rank 1 of TP2 and the two ranks of a TP2 producer, one head a region."""
    model = _model()
    local = tps.rank_layout(model, C, 1, per_head=True, num_blocks=4, seed=3)
    remotes = {p: tps.rank_layout(model, C, p, per_head=True, num_blocks=4) for p in (0, 1)}
    return DescriptorTable.build(local), {p: DescriptorTable.build(r) for p, r in remotes.items()}


def test_a_tp_planner_refuses_ranks_tables_and_offsets_by_name() -> None:
    local, remotes = _planner_inputs()
    kw: dict[str, Any] = {"local_heads": C, "remote_heads": C, "local_rank": 1}
    assert TPPlanner.build(local, remotes, **kw).ranks == (1,)
    with pytest.raises(ConfigError) as e:
        TPPlanner.build(local, remotes, only=(1, 0), **kw)
    assert (e.value.key, e.value.value) == ("only", [0, 1])
    assert e.value.rule == "consumer rank 1 reads from producer ranks [1] only"
    with pytest.raises(ConfigError) as e:
        TPPlanner.build(local, {0: remotes[0]}, **kw)
    assert (e.value.key, e.value.value) == ("remote tables", [0])
    assert e.value.rule == "need producer ranks [1] as well"
    other = {1: DescriptorTable.build(remotes[1].layout, PlanOptions(coalesce=False))}
    with pytest.raises(PlanError, match=r"^producer rank 1's table was built with other Plan"):
        TPPlanner.build(local, other, **kw)
    for name in ("local_offset", "remote_offset"):
        for bad in (-1, True, 1.0, None):
            with pytest.raises(ConfigError) as e:
                TPPlanner.build(local, remotes, **{name: bad}, **kw)
            assert (e.value.key, e.value.value) == (name, bad)
            assert e.value.rule == "must be a non-negative int"
    planner = TPPlanner.build(local, remotes, **kw)
    assert planner.remotes == remotes and planner.local is local
    with pytest.raises(ConfigError) as e:
        planner.chain_lists(0)
    assert (e.value.key, e.value.value) == ("rank", 0)
    assert e.value.rule == "not one of the planned ranks [1]"


def test_offsets_move_the_planned_ids_only() -> None:
    local, remotes = _planner_inputs()
    kw: dict[str, Any] = {"local_heads": C, "remote_heads": C, "local_rank": 1}
    blocks = ([0, 2, 3],)
    (plain,) = TPPlanner.build(local, remotes, **kw).plan(blocks, blocks, 12)
    (moved,) = TPPlanner.build(local, remotes, local_offset=100, remote_offset=7, **kw).plan(
        blocks, blocks, 12
    )
    assert np.array_equal(moved.plan.local_ids, plain.plan.local_ids + 100)
    assert np.array_equal(moved.plan.remote_ids, plain.plan.remote_ids + 7)
    # The runs are gathered from the tables themselves: the same addresses either way.
    a, b = plain.runs(), moved.runs()
    assert np.array_equal(a.local_addr, b.local_addr) and np.array_equal(a.length, b.length)


@pytest.mark.parametrize(
    ("fields", "key", "value", "rule"),
    [
        ({"num_kv_heads": 0}, "num_kv_heads", 0, "must be a positive int"),
        ({"num_kv_heads": True}, "num_kv_heads", True, "must be a positive int"),
        ({"num_kv_heads": 4, "tp_size": 0}, "tp_size", 0, "must be a positive int"),
        ({"num_kv_heads": 4, "tp_size": 2.0}, "tp_size", 2.0, "must be a positive int"),
        ({"num_kv_heads": 1, "latent": 1}, "latent", 1, "must be a bool"),
        (
            {"num_kv_heads": 4, "tp_size": 3},
            "tp_size",
            3,
            "must divide num_kv_heads (4: each rank holds num_kv_heads / tp_size heads) or "
            "be a multiple of it (each head replicated on tp_size / num_kv_heads ranks)",
        ),
    ],
)
def test_a_head_layout_refuses_by_key_value_and_rule(
    fields: dict[str, Any], key: str, value: Any, rule: str
) -> None:
    with pytest.raises(ConfigError) as e:
        HeadLayout(**fields)
    assert (e.value.key, e.value.value, e.value.rule) == (key, value, rule)


def test_a_head_layout_takes_equal_heads_and_ranks_either_way() -> None:
    # tp_size == num_kv_heads: one head a rank, by either rule.
    assert HeadLayout(num_kv_heads=4, tp_size=4).heads_of(3) == range(3, 4)
    assert HeadLayout(num_kv_heads=2, tp_size=8).heads_of(7) == range(1, 2)


@pytest.mark.parametrize(
    ("own", "peer", "key"),
    [(0, 2, "own"), (2, 0, "peer"), (True, 2, "own"), (2, 1.0, "peer"), (-1, 2, "own")],
)
def test_pairing_heads_refuses_by_name(own: Any, peer: Any, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        pairing_heads(own, peer)
    value = own if key == "own" else peer
    assert (e.value.key, e.value.value, e.value.rule) == (key, value, "must be a positive int")
