"""Properties of state slots across TP sizes (issue 53; R-TP-3 for Mamba2 / GDN state).

The oracle is written from what the bytes mean: every byte of every rank's state
regions is labelled with the (layer, part, segment, global unit, byte-in-unit, slot)
it holds, decoded from the model's :class:`StateSplit` and the rank alone (segments
one after the other, each rank's units of a segment consecutive). The runs
:func:`slot_runs` gives per producer rank are executed on those byte arrays; every
byte of the consumer's requested slots must be written exactly once, with the
producer's label of the same (layer, part, segment, unit, byte) in the paired slot,
and no other byte may be written.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.core.heads import HeadLayout, source_ranks
from kvxfer.core.layout import ConvLayout, Group, GroupKind, KVLayout, KVPart
from kvxfer.core.state_plan import (
    check_state_layout,
    check_state_pair,
    plan_slots,
    slot_runs,
    state_source_ranks,
)
from kvxfer.core.state_split import StateSegment, StateSplit, unit_ranks, units_of
from kvxfer.errors import ConfigError, LayoutError, LayoutMismatch
from tests.state_layouts import STATE_PARTS, planned, state_cases, state_layout

I64 = npt.NDArray[np.int64]
_PARTS = STATE_PARTS


def _slot_labels(split: StateSplit, tp: int, rank: int, layer: int, part: KVPart) -> I64:
    """What one slot of rank ``rank``'s (layer, part) region holds, byte by byte."""
    out: list[int] = []
    for seg, s in enumerate(split.segments(part)):
        for u in units_of(s.units, tp, rank):
            for b in range(s.unit_bytes):
                out.append(((((layer * 2 + _PARTS.index(part)) * 8 + seg) * 64 + u) * 64 + b) * 8)
    return np.array(out, dtype=np.int64)


def _memory(layout: KVLayout, split: StateSplit, tp: int, rank: int) -> tuple[int, I64]:
    """A rank's memory from its lowest address: state bytes labelled (slot in the low
    bits), everything else -1."""
    lo = min(r.base for r in layout.regions)
    mem = np.full(max(r.end for r in layout.regions) - lo, -1, dtype=np.int64)
    for r in layout.regions:
        if r.group != 1:
            continue
        labels = _slot_labels(split, tp, rank, r.layer, r.part)
        for slot in range(r.num_blocks):
            at = r.base - lo + slot * r.stride
            mem[at : at + r.block_len] = labels + slot
    return lo, mem


@given(
    case=state_cases(),
    layers=st.integers(1, 2),
    nbs=st.tuples(st.integers(2, 4), st.integers(2, 4)),
    pads=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    salt=st.integers(0, 7),
    data=st.data(),
)
def test_every_consumer_state_byte_is_written_once_from_the_right_producer_byte(
    case: tuple[StateSplit, int, int, int],
    layers: int,
    nbs: tuple[int, int],
    pads: tuple[int, int],
    salt: int,
    data: st.DataObject,
) -> None:
    split, local_tp, remote_tp, rank = case
    pieces, local, remotes = planned(case, layers=layers, nbs=nbs, pads=pads, salt=salt, spacing=7)
    assert sorted({p.rank for p in pieces}) == list(
        state_source_ranks(split, local_tp, rank, remote_tp, salt=salt)
    )
    n = data.draw(st.integers(1, min(nbs)))
    lslots = np.array(data.draw(st.permutations(range(nbs[0])))[:n], dtype=np.int64)
    rslots = np.array(data.draw(st.permutations(range(nbs[1])))[:n], dtype=np.int64)
    runs = slot_runs(pieces, local, remotes, lslots, rslots)

    lo, _ = _memory(local, split, local_tp, rank)
    size = max(r.end for r in local.regions) - lo
    got = np.full(size, -1, dtype=np.int64)
    count = np.zeros(size, dtype=np.int64)
    for p, rr in runs.items():
        rlo, rmem = _memory(remotes[p], split, remote_tp, p)
        for la, ra, ln in zip(rr.local_addr.tolist(), rr.remote_addr.tolist(), rr.length.tolist()):
            src = rmem[ra - rlo : ra - rlo + ln]
            assert (src >= 0).all(), "read outside the producer's state slots"
            got[la - lo : la - lo + ln] = src
            count[la - lo : la - lo + ln] += 1
    want = np.full(size, -1, dtype=np.int64)
    for r in local.regions:
        if r.group != 1:
            continue
        labels = _slot_labels(split, local_tp, rank, r.layer, r.part)
        for ls, rs in zip(lslots.tolist(), rslots.tolist()):
            at = r.base - lo + ls * r.stride
            want[at : at + r.block_len] = labels + rs
    assert ((count == 1) == (want >= 0)).all(), "a byte written twice, never, or outside"
    assert (got[want >= 0] == want[want >= 0]).all(), "a byte from the wrong producer byte"


@given(case=state_cases(), salt=st.integers(0, 7))
def test_a_unit_comes_from_the_replica_kv_heads_would_pick(
    case: tuple[StateSplit, int, int, int], salt: int
) -> None:
    # One rule for heads and state units: a segment of as many units as a model has
    # KV heads is read from the ranks the head algebra names.
    split, local_tp, remote_tp, rank = case
    for s in (*split.conv, *split.ssm):
        heads = HeadLayout(num_kv_heads=s.units, tp_size=local_tp)
        theirs = heads.for_tp_size(remote_tp)
        assert [range(*(r.start, r.stop)) for r in (heads.heads_of(rank),)] == [
            units_of(s.units, local_tp, rank)
        ]
        for u in units_of(s.units, local_tp, rank):
            assert list(theirs.ranks_of(u)) == list(unit_ranks(s.units, remote_tp, u))
        single = StateSplit(conv=(s,), ssm=(s,))
        assert set(state_source_ranks(single, local_tp, rank, remote_tp, salt=salt)) == set(
            source_ranks(heads, rank, theirs, salt=salt).values()
        )


def test_equal_tp_sizes_read_each_region_whole_from_the_same_rank() -> None:
    split = StateSplit(
        conv=(
            StateSegment(name="x", units=8, unit_bytes=6),
            StateSegment(name="B", units=2, unit_bytes=3),
            StateSegment(name="C", units=2, unit_bytes=3),
        ),
        ssm=(StateSegment(name="heads", units=8, unit_bytes=4),),
    )
    for tp in (1, 2):
        local = state_layout(split, tp, 1, 2, 0, base=0)
        remotes = {p: state_layout(split, tp, 1, 2, 0, base=10_000) for p in range(tp)}
        for rank in range(tp):
            pieces = plan_slots(
                local, remotes, split=split, local_tp=tp, local_rank=rank, remote_tp=tp
            )
            assert [(p.rank, p.local_offset, p.remote_offset) for p in pieces] == [
                (rank, 0, 0),
                (rank, 0, 0),
            ]
            assert [p.length for p in pieces] == [
                local.regions[1].block_len,
                local.regions[2].block_len,
            ]


def test_tp1_to_tp2_reads_each_segment_slice_of_the_one_producer_slot() -> None:
    # Mamba2-shaped: x 4 heads of 2 bytes, B and C one group each (replicated at TP2).
    split = StateSplit(
        conv=(
            StateSegment(name="x", units=4, unit_bytes=2),
            StateSegment(name="B", units=1, unit_bytes=3),
            StateSegment(name="C", units=1, unit_bytes=3),
        ),
        ssm=(StateSegment(name="heads", units=4, unit_bytes=5),),
    )
    local = state_layout(split, 2, 1, 2, 0, base=0)
    remotes = {0: state_layout(split, 1, 1, 2, 0, base=10_000)}
    pieces = plan_slots(local, remotes, split=split, local_tp=2, local_rank=1, remote_tp=1)
    # conv: x units 2-3 (producer bytes 4..8), then B (8..11) and C (11..14) whole,
    # landing at 0..4, 4..7 and 7..10: contiguous on both sides, one piece; the SSM
    # state's heads 2-3 are producer bytes 10..20.
    assert [(p.local_offset, p.remote_offset, p.length) for p in pieces] == [
        (0, 4, 10),
        (0, 10, 10),
    ]
    # Rank 0 reads x units 0-1 and the replicated group: two pieces for its conv slot.
    pieces = plan_slots(local, remotes, split=split, local_tp=2, local_rank=0, remote_tp=1)
    assert [(p.local_offset, p.remote_offset, p.length) for p in pieces] == [
        (0, 0, 4),
        (4, 8, 6),
        (0, 0, 10),
    ]


def test_refusals_name_the_key_the_value_and_the_rule() -> None:
    split = StateSplit(
        conv=(StateSegment(name="x", units=6, unit_bytes=2),),
        ssm=(StateSegment(name="heads", units=6, unit_bytes=2),),
    )
    with pytest.raises(ConfigError, match=r"tp_size=4: must divide the 6 CONV 'x' units"):
        split.check(4)
    layout = state_layout(split, 2, 1, 2, 0, base=0)
    with pytest.raises(LayoutError, match=r"regions\[1\].block_len=6: layer 1 CONV state"):
        check_state_layout(layout, split, 1, side="local")
    sd = KVLayout(
        block_size=16,
        regions=layout.regions,
        groups=(Group(kind=GroupKind.FULL), Group(kind=GroupKind.STATE, conv_layout=ConvLayout.SD)),
    )
    with pytest.raises(
        ConfigError, match=r"groups\[1\].conv_layout='SD'.*VLLM_SSM_CONV_STATE_LAYOUT=DS"
    ):
        check_state_layout(sd, split, 2, side="local")
    with pytest.raises(ConfigError, match=r"StateSegment.units=0"):
        StateSegment(name="x", units=0, unit_bytes=1)


def test_the_handshake_check_names_what_keeps_two_state_layouts_apart() -> None:
    split = StateSplit(
        conv=(StateSegment(name="x", units=4, unit_bytes=2),),
        ssm=(StateSegment(name="heads", units=4, unit_bytes=3),),
    )
    one, two = state_layout(split, 1, 1, 2, 0, base=0), state_layout(split, 2, 1, 2, 0, base=9_000)
    check_state_pair(one, two, local_split=split, remote_split=split, local_tp=1, remote_tp=2)
    with pytest.raises(ConfigError, match=r"remote tp.state=None: state groups between TP sizes"):
        check_state_pair(one, two, local_split=split, remote_split=None, local_tp=1, remote_tp=2)
    other = StateSplit(conv=split.conv, ssm=(StateSegment(name="heads", units=4, unit_bytes=5),))
    with pytest.raises(LayoutMismatch, match=r"state.ssm\[0\]"):
        check_state_pair(one, two, local_split=split, remote_split=other, local_tp=1, remote_tp=2)
    # Equal TP sizes move slots whole: only the bytes per slot must agree.
    check_state_pair(one, one, local_split=None, remote_split=None, local_tp=1, remote_tp=1)
    with pytest.raises(LayoutMismatch, match=r"layer 1 CONV state bytes per slot"):
        check_state_pair(one, two, local_split=None, remote_split=None, local_tp=2, remote_tp=2)
