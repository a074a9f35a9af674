"""The exact contracts of :mod:`kvxfer.core.state_split` (issue 53).

Which units each rank holds, checked exhaustively against the rule written out here
independently, over every (units, tp) pair up to 16; and every refusal by its key,
value and words. These are what the 2026-12-07 mutmut run of ``state_split`` left
alive (docs/TESTING.md): its properties (tests/test_state_tp_properties.py) draw few
replicated pairs and never read a refusal's text.
"""

from __future__ import annotations

import re

import pytest

from kvxfer.core.layout import ConvLayout, Group, GroupKind, KVPart
from kvxfer.core.state_split import (
    StateSegment,
    StateSplit,
    check_conv_order,
    unit_ranks,
    units_of,
)
from kvxfer.errors import ConfigError

SPLIT_RULE = (
    "must divide the {units} {what} (each rank holds units / tp_size) or be a "
    "multiple of them (each replicated on tp_size / units ranks)"
)


def _valid(units: int, tp: int) -> bool:
    return units % tp == 0 if units >= tp else tp % units == 0


def _held(units: int, tp: int, rank: int) -> list[int]:
    """The rule, restated: a share of consecutive units, or one replicated unit."""
    if units >= tp:
        share = units // tp
        return [rank * share + i for i in range(share)]
    return [rank * units // tp]


PAIRS = [(u, t) for u in range(1, 17) for t in range(1, 17)]


@pytest.mark.parametrize(("units", "tp"), PAIRS)
def test_units_of_and_unit_ranks_follow_the_rule_and_each_other(units: int, tp: int) -> None:
    if not _valid(units, tp):
        message = re.escape(f"tp_size={tp!r}: " + SPLIT_RULE.format(units=units, what="units"))
        with pytest.raises(ConfigError, match=f"^{message}$"):
            units_of(units, tp, 0)
        with pytest.raises(ConfigError, match=f"^{message}$"):
            unit_ranks(units, tp, 0)
        return
    for rank in range(tp):
        held = units_of(units, tp, rank)
        assert isinstance(held, range) and held.step == 1
        assert list(held) == _held(units, tp, rank)
    for unit in range(units):
        ranks = unit_ranks(units, tp, unit)
        assert isinstance(ranks, range) and ranks.step == 1
        assert list(ranks) == [r for r in range(tp) if unit in units_of(units, tp, r)]
    segment = StateSegment(name="x", units=units, unit_bytes=3)
    assert segment.held_bytes(tp) == 3 * len(_held(units, tp, 0))


@pytest.mark.parametrize("rank", [-1, 4, 5, True, 1.0, "1", None])
def test_a_rank_outside_the_group_is_refused_by_name(rank: object) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"tp_rank={rank!r}: must be an int in [0, 4)")):
        units_of(8, 4, rank)  # type: ignore[arg-type]


@pytest.mark.parametrize("unit", [-1, 8, 9, True, 2.0, None])
def test_a_unit_outside_the_segment_is_refused_by_name(unit: object) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"unit={unit!r}: must be an int in [0, 8)")):
        unit_ranks(8, 4, unit)  # type: ignore[arg-type]


def test_the_last_rank_and_unit_are_accepted() -> None:
    assert list(units_of(8, 4, 3)) == [6, 7]
    assert list(unit_ranks(8, 4, 7)) == [3]
    assert list(units_of(2, 8, 7)) == [1]
    assert list(unit_ranks(2, 8, 1)) == [4, 5, 6, 7]


@pytest.mark.parametrize("key", ["units", "unit_bytes"])
@pytest.mark.parametrize("value", [0, -1, True, 2.0, None])
def test_a_segment_with_a_bad_count_is_refused_by_key(key: str, value: object) -> None:
    fields: dict[str, object] = {"name": "x", "units": 2, "unit_bytes": 4, key: value}
    with pytest.raises(
        ConfigError, match=re.escape(f"StateSegment.{key}={value!r}: must be a positive int")
    ):
        StateSegment(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", 3, None])
def test_a_segment_needs_a_name(name: object) -> None:
    with pytest.raises(
        ConfigError, match=re.escape(f"StateSegment.name={name!r}: must be a non-empty str")
    ):
        StateSegment(name=name, units=1, unit_bytes=1)  # type: ignore[arg-type]


def test_a_one_unit_one_byte_segment_is_valid() -> None:
    s = StateSegment(name="h", units=1, unit_bytes=1)
    assert (s.units, s.unit_bytes, s.held_bytes(4)) == (1, 1, 1)


X = StateSegment(name="x", units=8, unit_bytes=16)
B = StateSegment(name="B", units=2, unit_bytes=4)
HEADS = StateSegment(name="heads", units=8, unit_bytes=64)


@pytest.mark.parametrize("key", ["conv", "ssm"])
@pytest.mark.parametrize("bad", [(), (X, "x"), ("x",)])
def test_a_split_without_segments_is_refused_by_key(key: str, bad: tuple[object, ...]) -> None:
    fields: dict[str, object] = {"conv": (X, B), "ssm": (HEADS,), key: bad}
    with pytest.raises(
        ConfigError,
        match=re.escape(f"StateSplit.{key}={bad!r}: must be a non-empty tuple of StateSegment"),
    ):
        StateSplit(**fields)  # type: ignore[arg-type]


def test_segments_sizes_and_the_tp_check() -> None:
    split = StateSplit(conv=(X, B), ssm=(HEADS,))
    assert split.segments(KVPart.CONV) == (X, B)
    assert split.segments(KVPart.SSM) == (HEADS,)
    with pytest.raises(ConfigError, match=re.escape("part=<KVPart.K: ")) as info:
        split.segments(KVPart.K)
    assert info.value.rule == "a state region holds CONV or SSM state"
    # TP2: 4 x-heads of 16 bytes and 1 group of 4; 4 heads of 64.
    assert split.region_bytes(KVPart.CONV, 2) == 4 * 16 + 4
    assert split.region_bytes(KVPart.SSM, 2) == 4 * 64
    # TP4 replicates no group (2 groups, 4 ranks: each on 2 ranks).
    assert split.region_bytes(KVPart.CONV, 4) == 2 * 16 + 4
    for tp in (1, 2, 4, 8):
        split.check(tp)
    for tp in (0, -2, True, 2.0):
        with pytest.raises(ConfigError, match=re.escape(f"tp_size={tp!r}: must be a positive int")):
            split.check(tp)  # type: ignore[arg-type]
    # 3 ranks split neither 8 heads nor 2 groups: the first segment is named.
    with pytest.raises(ConfigError) as bad:
        split.check(3)
    assert str(bad.value) == "tp_size=3: " + SPLIT_RULE.format(
        units=8, what="CONV 'x' units (heads/groups)"
    )
    # 16 ranks: x (8) and B (2) replicate, and so do the SSM heads.
    split.check(16)
    odd = StateSplit(conv=(X,), ssm=(StateSegment(name="heads", units=6, unit_bytes=1),))
    with pytest.raises(ConfigError) as bad:
        odd.check(4)
    assert str(bad.value) == "tp_size=4: " + SPLIT_RULE.format(
        units=6, what="SSM 'heads' units (heads/groups)"
    )


def test_first_difference_names_the_field_and_both_values() -> None:
    split = StateSplit(conv=(X, B), ssm=(HEADS,))
    assert split.first_difference(StateSplit(conv=(X, B), ssm=(HEADS,))) is None
    assert split.first_difference(StateSplit(conv=(X,), ssm=(HEADS,))) == (
        "state.conv (segments)",
        2,
        1,
    )
    other_b = StateSegment(name="B", units=2, unit_bytes=8)
    assert split.first_difference(StateSplit(conv=(X, other_b), ssm=(HEADS,))) == (
        "state.conv[1]",
        B,
        other_b,
    )
    other_h = StateSegment(name="heads", units=4, unit_bytes=64)
    assert split.first_difference(StateSplit(conv=(X, B), ssm=(other_h,))) == (
        "state.ssm[0]",
        HEADS,
        other_h,
    )
    assert split.first_difference(StateSplit(conv=(X, B), ssm=(HEADS, HEADS))) == (
        "state.ssm (segments)",
        1,
        2,
    )


DS_RULE = (
    "state pulls across TP sizes cut conv state by channel and need it "
    "dim-major (DS): start both instances with VLLM_SSM_CONV_STATE_LAYOUT=DS"
)


def test_check_conv_order_names_the_first_state_group_not_dim_major() -> None:
    full = Group(kind=GroupKind.FULL)
    ds = Group(kind=GroupKind.STATE, conv_layout=ConvLayout.DS)
    check_conv_order(())
    check_conv_order((full, ds, full))
    for bad, value in (
        (Group(kind=GroupKind.STATE, conv_layout=ConvLayout.SD), "SD"),
        (Group(kind=GroupKind.STATE), None),
    ):
        with pytest.raises(ConfigError) as info:
            check_conv_order((full, ds, bad, Group(kind=GroupKind.STATE)))
        assert str(info.value) == f"groups[2].conv_layout={value!r}: {DS_RULE}"
