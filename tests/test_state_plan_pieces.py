"""The shape of a state plan (``kvxfer.core.state_plan``), beyond which bytes land where.

tests/test_state_tp_properties.py shows every consumer state byte is written once from
the right producer byte; a byte label cannot tell replicas apart, nor a plan in one
piece per unit from a merged one. These properties pin the rest of the contract:
each unit is read from the replica the KV-head rule names; pieces tile each consumer
slot in order, name the producer's region of the same (layer, part) and are maximal;
address runs are in local address order, maximal, carry both sides' device ids, and
total the slots' bytes; refusals name the key, the value and the rule. Written against
the mutants the byte properties left alive.
"""

from __future__ import annotations

import itertools
import re

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.core.descriptors import Runs
from kvxfer.core.heads import HeadLayout, source_ranks
from kvxfer.core.layout import Group, GroupKind, KVLayout, KVPart
from kvxfer.core.state_plan import (
    StatePiece,
    check_state_pair,
    join_runs,
    plan_slots,
    slot_runs,
    state_regions,
    state_source_ranks,
)
from kvxfer.core.state_split import StateSegment, StateSplit, units_of
from kvxfer.errors import ConfigError, LayoutError, LayoutMismatch, PlanError
from tests.state_layouts import planned, state_cases, state_layout


def _plan(
    case: tuple[StateSplit, int, int, int], salt: int = 0
) -> tuple[tuple[StatePiece, ...], KVLayout, dict[int, KVLayout]]:
    return planned(case, layers=2, nbs=(3, 3), pads=(1, 2), salt=salt, spacing=1000)


@given(case=state_cases(), salt=st.integers(0, 9))
def test_each_unit_is_read_from_the_replica_the_kv_head_rule_names(
    case: tuple[StateSplit, int, int, int], salt: int
) -> None:
    split, local_tp, remote_tp, rank = case
    pieces, local, _ = _plan(case, salt)
    regions = state_regions(local)
    for part in (KVPart.CONV, KVPart.SSM):
        region = regions[(1, part)]
        offset = 0
        for s in split.segments(part):
            heads = HeadLayout(num_kv_heads=s.units, tp_size=local_tp)
            want = source_ranks(heads, rank, heads.for_tp_size(remote_tp), salt=salt)
            for u in units_of(s.units, local_tp, rank):
                (piece,) = [
                    p
                    for p in pieces
                    if p.local_region == region
                    and p.local_offset <= offset < p.local_offset + p.length
                ]
                assert piece.rank == want[u], (part, s.name, u)
                offset += s.unit_bytes
    assert state_source_ranks(split, local_tp, rank, remote_tp, salt=salt) == tuple(
        sorted({p.rank for p in pieces})
    )


@given(case=state_cases(), salt=st.integers(0, 9))
def test_pieces_tile_each_slot_in_order_from_the_same_layer_and_part_and_are_maximal(
    case: tuple[StateSplit, int, int, int], salt: int
) -> None:
    pieces, local, remotes = _plan(case, salt)
    order = sorted(state_regions(local).values())
    assert [p.local_region for p in pieces] == sorted(p.local_region for p in pieces)
    assert sorted({p.local_region for p in pieces}) == order
    for i in order:
        mine = [p for p in pieces if p.local_region == i]
        at = 0
        for p in mine:
            assert p.local_offset == at and p.length > 0  # no gap, no overlap, in order
            at += p.length
            theirs = remotes[p.rank].regions[p.remote_region]
            lr = local.regions[i]
            assert (theirs.layer, theirs.part) == (lr.layer, lr.part)
            assert p.remote_offset >= 0 and p.remote_offset + p.length <= theirs.block_len
        assert at == local.regions[i].block_len
        for a, b in itertools.pairwise(mine):
            continues = (
                a.rank == b.rank
                and a.remote_region == b.remote_region
                and a.remote_offset + a.length == b.remote_offset
            )
            assert not continues, f"pieces {a} and {b} should be one"


def _mergeable(runs: Runs, k: int) -> bool:
    return bool(
        runs.local_addr[k] + runs.length[k] == runs.local_addr[k + 1]
        and runs.remote_addr[k] + runs.length[k] == runs.remote_addr[k + 1]
        and runs.local_device[k] == runs.local_device[k + 1]
        and runs.remote_device[k] == runs.remote_device[k + 1]
    )


def _on_devices(layout: KVLayout, device: int) -> KVLayout:
    regions = tuple(msgspec.structs.replace(r, device_id=device) for r in layout.regions)
    return msgspec.structs.replace(layout, regions=regions)


@given(case=state_cases(), salt=st.integers(0, 9), data=st.data())
def test_runs_are_in_local_order_maximal_on_both_devices_and_total_the_slots(
    case: tuple[StateSplit, int, int, int], salt: int, data: st.DataObject
) -> None:
    pieces, local, remotes = _plan(case, salt)
    local = _on_devices(local, 3)
    remotes = {p: _on_devices(r, 10 + p) for p, r in remotes.items()}
    n = data.draw(st.integers(0, 3))
    lslots = np.array(data.draw(st.permutations(range(3)))[:n], dtype=np.int64)
    rslots = np.array(data.draw(st.permutations(range(3)))[:n], dtype=np.int64)
    runs = slot_runs(pieces, local, remotes, lslots, rslots)
    assert sorted(runs) == sorted({p.rank for p in pieces})
    total = 0
    for p, r in runs.items():
        assert (r.local_device == 3).all() and (r.remote_device == 10 + p).all()
        assert (np.diff(r.local_addr.astype(np.int64)) > 0).all()
        assert not any(_mergeable(r, k) for k in range(len(r) - 1))
        total += r.nbytes
    state = sum(local.regions[i].block_len for i in state_regions(local).values())
    assert total == n * state
    # Joined with another rank's list (or itself shifted), runs stay ordered and maximal.
    joined = join_runs(*runs.values())
    assert joined.nbytes == total
    assert not any(_mergeable(joined, k) for k in range(len(joined) - 1))


def test_join_runs_merges_runs_that_touch_across_lists_and_keeps_others_apart() -> None:
    def runs(*rows: tuple[int, int, int, int, int]) -> Runs:
        cols = list(zip(*rows, strict=True))
        return Runs(
            np.array(cols[0], dtype=np.uint64),
            np.array(cols[1], dtype=np.uint64),
            np.array(cols[2], dtype=np.uint64),
            np.array(cols[3], dtype=np.int64),
            np.array(cols[4], dtype=np.int64),
        )

    a = runs((100, 500, 10, 0, 1), (300, 900, 5, 0, 1))
    b = runs((110, 510, 6, 0, 1), (116, 700, 4, 0, 1), (305, 905, 5, 1, 1))
    got = join_runs(a, b)
    rows = list(
        zip(
            got.local_addr.tolist(),
            got.remote_addr.tolist(),
            got.length.tolist(),
            got.local_device.tolist(),
            got.remote_device.tolist(),
            strict=True,
        )
    )
    # 100+10 meets 110 on both sides: one run; 116 continues locally only; the run on
    # local device 1 never merges with device 0's, though its addresses continue.
    assert rows == [
        (100, 500, 16, 0, 1),
        (116, 700, 4, 0, 1),
        (300, 900, 5, 0, 1),
        (305, 905, 5, 1, 1),
    ]
    assert len(join_runs(Runs(*(c[:0] for c in _columns(a))))) == 0


def _columns(r: Runs) -> tuple[np.ndarray, ...]:
    return (r.local_addr, r.remote_addr, r.length, r.local_device, r.remote_device)


SPLIT = StateSplit(
    conv=(StateSegment(name="x", units=2, unit_bytes=2),),
    ssm=(StateSegment(name="heads", units=2, unit_bytes=3),),
)


def test_slot_runs_refuse_unpaired_or_outside_slots_naming_the_side() -> None:
    local = state_layout(SPLIT, 1, 1, 2, 0, base=0)
    remotes = {0: state_layout(SPLIT, 1, 1, 3, 0, base=10_000)}
    pieces = plan_slots(local, remotes, split=SPLIT, local_tp=1, local_rank=0, remote_tp=1)

    def refused(words: str, ls: list[int], rs: list[int]) -> None:
        with pytest.raises(PlanError, match=f"^{re.escape(words)}$"):
            slot_runs(pieces, local, remotes, np.array(ls), np.array(rs))

    refused("state slots: 2 local, 1 remote; they pair one to one", [0, 1], [0])
    refused("local state slots [2]: outside the 2 slots of layer 1 CONV", [2], [0])
    refused("local state slots [-1]: outside the 2 slots of layer 1 CONV", [-1], [0])
    refused("remote state slots [3]: outside the 3 slots of layer 1 CONV", [1], [3])
    refused("remote state slots [0, -1]: outside the 3 slots of layer 1 CONV", [0, 1], [0, -1])
    # The last slot of each side is inside.
    (runs,) = slot_runs(pieces, local, remotes, np.array([1]), np.array([2])).values()
    assert runs.nbytes == 4 + 6


def test_state_regions_refuse_other_parts_and_a_second_region_per_layer_part() -> None:
    good = state_layout(SPLIT, 1, 1, 2, 0, base=0)
    kv = msgspec.structs.replace(good.regions[1], part=KVPart.K)
    with pytest.raises(
        LayoutError,
        match=r"^KVLayout.regions\[1\].part=K: a state region across TP sizes holds a CONV "
        r"or an SSM state$",
    ):
        state_regions(msgspec.structs.replace(good, regions=(good.regions[0], kv, good.regions[2])))
    # A second SSM region of layer 1 (one head's share of it, elsewhere in memory).
    shard = msgspec.structs.replace(good.regions[2], head=1, base=90_000)
    twice = msgspec.structs.replace(good, regions=(*good.regions, shard))
    with pytest.raises(
        LayoutError,
        match=r"^KVLayout.regions\[3\]: layer 1 has two SSM state regions; across TP sizes "
        r"each state is one region per layer$",
    ):
        state_regions(twice)
    # Attention regions are not state regions, whatever their part.
    assert state_regions(good) == {(1, KVPart.CONV): 1, (1, KVPart.SSM): 2}
    plain = KVLayout(block_size=16, regions=good.regions[:1], groups=(Group(kind=GroupKind.FULL),))
    assert state_regions(plain) == {}


@pytest.mark.parametrize("salt", [-1, True, 1.0, "1"])
def test_a_bad_salt_is_named(salt: object) -> None:
    with pytest.raises(ConfigError, match=f"^salt={salt!r}: must be a non-negative int$"):
        state_source_ranks(SPLIT, 2, 0, 1, salt=salt)  # type: ignore[arg-type]


def test_a_missing_producer_rank_or_region_is_named() -> None:
    local = state_layout(SPLIT, 2, 1, 2, 0, base=0)
    one = state_layout(SPLIT, 1, 1, 2, 0, base=10_000)
    with pytest.raises(ConfigError, match=r"^remote layouts=\[1\]: need producer ranks \[0\]$"):
        plan_slots(local, {1: one}, split=SPLIT, local_tp=2, local_rank=0, remote_tp=1)
    # The producer has no state layer 1 SSM region (its SSM region is layer 2's).
    other = tuple(
        msgspec.structs.replace(r, layer=2) if r.part is KVPart.SSM else r for r in one.regions
    )
    with pytest.raises(
        LayoutMismatch,
        match=r"^KV layout mismatch at layer 1 SSM state \(producer rank 0\): "
        r"local='present' remote='absent'$",
    ):
        plan_slots(
            local,
            {0: msgspec.structs.replace(one, regions=other)},
            split=SPLIT,
            local_tp=2,
            local_rank=0,
            remote_tp=1,
        )


def test_a_replicated_unit_spreads_consumer_ranks_over_its_replicas() -> None:
    # One conv unit and one SSM unit, held by both producer ranks of TP2: consumer ranks
    # 0 and 1 of TP4 (both holding unit 0) read replicas 0 and 1; the salt turns them.
    split = StateSplit(
        conv=(StateSegment(name="B", units=1, unit_bytes=4),),
        ssm=(StateSegment(name="heads", units=1, unit_bytes=2),),
    )
    for salt, want in ((0, [0, 1, 0, 1]), (1, [1, 0, 1, 0]), (2, [0, 1, 0, 1])):
        got = [state_source_ranks(split, 4, r, 2, salt=salt) for r in range(4)]
        assert got == [(w,) for w in want], salt


def test_runs_on_other_remote_devices_never_merge_and_columns_keep_their_dtypes() -> None:
    a = Runs(
        np.array([100], dtype=np.uint64),
        np.array([500], dtype=np.uint64),
        np.array([10], dtype=np.uint64),
        np.array([0], dtype=np.int64),
        np.array([1], dtype=np.int64),
    )
    b = Runs(
        np.array([110], dtype=np.uint64),
        np.array([510], dtype=np.uint64),
        np.array([6], dtype=np.uint64),
        np.array([0], dtype=np.int64),
        np.array([2], dtype=np.int64),
    )
    got = join_runs(a, b)
    assert got.length.tolist() == [10, 6] and got.remote_device.tolist() == [1, 2]
    # slot_runs hands the transport unsigned addresses and lengths, signed devices.
    local = state_layout(SPLIT, 1, 1, 2, 0, base=0)
    remotes = {0: state_layout(SPLIT, 1, 1, 2, 0, base=10_000)}
    pieces = plan_slots(local, remotes, split=SPLIT, local_tp=1, local_rank=0, remote_tp=1)
    (runs,) = slot_runs(pieces, local, remotes, np.array([1]), np.array([0])).values()
    assert [c.dtype for c in _columns(runs)] == [np.uint64] * 3 + [np.int64] * 2


def test_slots_of_a_narrow_integer_type_address_the_right_bytes() -> None:
    # Slot ids as the engine may hand them (int8 / uint8 arrays): the addresses are
    # computed in 64 bits, so a slot times a stride of thousands does not wrap.
    split = StateSplit(
        conv=(StateSegment(name="x", units=2, unit_bytes=1000),),
        ssm=(StateSegment(name="heads", units=2, unit_bytes=3000),),
    )
    local = state_layout(split, 1, 1, 200, 0, base=0)
    remotes = {0: state_layout(split, 1, 1, 200, 0, base=10_000_000)}
    pieces = plan_slots(local, remotes, split=split, local_tp=1, local_rank=0, remote_tp=1)
    wide = slot_runs(pieces, local, remotes, np.array([100], np.int64), np.array([110], np.int64))
    for dtype in (np.int8, np.uint8, np.int16):
        narrow = slot_runs(pieces, local, remotes, np.array([100], dtype), np.array([110], dtype))
        for w, n in zip(_columns(wide[0]), _columns(narrow[0]), strict=True):
            assert n.tolist() == w.tolist(), dtype


def test_plan_slots_names_the_side_whose_region_does_not_hold_its_share() -> None:
    tp1 = state_layout(SPLIT, 1, 1, 2, 0, base=0)
    tp2 = state_layout(SPLIT, 2, 1, 2, 0, base=10_000)
    share = "KVLayout.regions[1].block_len=2: layer 1 CONV state of a rank of tp_size=1"
    with pytest.raises(LayoutError, match=f"^local {re.escape(share)}"):
        plan_slots(tp2, {0: tp1}, split=SPLIT, local_tp=1, local_rank=0, remote_tp=1)
    with pytest.raises(LayoutError, match=f"^producer rank 0 {re.escape(share)}"):
        plan_slots(tp1, {0: tp2}, split=SPLIT, local_tp=1, local_rank=0, remote_tp=1)
    # The refusal lists every segment of the part.
    three = StateSplit(
        conv=(
            StateSegment(name="x", units=2, unit_bytes=2),
            StateSegment(name="B", units=1, unit_bytes=1),
            StateSegment(name="C", units=1, unit_bytes=1),
        ),
        ssm=SPLIT.ssm,
    )
    with pytest.raises(LayoutError, match=re.escape("bytes per slot (x+B+C as the state split")):
        plan_slots(tp1, {0: tp1}, split=three, local_tp=1, local_rank=0, remote_tp=1)


def test_the_salt_defaults_to_zero() -> None:
    # Replicated units (one unit, two producer ranks holding it): salt 0 and 1 differ.
    split = StateSplit(
        conv=(StateSegment(name="B", units=1, unit_bytes=4),),
        ssm=(StateSegment(name="heads", units=1, unit_bytes=2),),
    )
    assert state_source_ranks(split, 2, 1, 2) == state_source_ranks(split, 2, 1, 2, salt=0)
    assert state_source_ranks(split, 2, 1, 2, salt=1) != state_source_ranks(split, 2, 1, 2)
    local = state_layout(split, 2, 1, 2, 0, base=0)
    remotes = {p: state_layout(split, 2, 1, 2, 0, base=10_000 * (p + 1)) for p in range(2)}
    default = plan_slots(local, remotes, split=split, local_tp=2, local_rank=1, remote_tp=2)
    zero = plan_slots(local, remotes, split=split, local_tp=2, local_rank=1, remote_tp=2, salt=0)
    assert default == zero and {p.rank for p in default} == {1}


def test_state_on_one_side_only_is_a_mismatch_not_a_pass() -> None:
    with_state = state_layout(SPLIT, 1, 1, 2, 0, base=0)
    plain = KVLayout(
        block_size=16, regions=with_state.regions[:1], groups=(Group(kind=GroupKind.FULL),)
    )
    for local, remote, mine in ((with_state, plain, True), (plain, with_state, False)):
        with pytest.raises(
            LayoutMismatch,
            match=f"^KV layout mismatch at layer 1 CONV state region: local={mine} "
            f"remote={not mine}$",
        ):
            check_state_pair(
                local, remote, local_split=SPLIT, remote_split=SPLIT, local_tp=1, remote_tp=1
            )
