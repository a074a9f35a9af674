"""kvxfer.core.blocks: the one normaliser of block id lists (R-DESC-1, R-DESC-7)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.core import blocks
from kvxfer.core.blocks import block_array, block_groups, describe, to_wire
from kvxfer.errors import PlanError


@given(st.lists(st.integers(0, 10_000), unique=True, max_size=64))
def test_valid_ids_round_trip_as_read_only_int64(ids: list[int]) -> None:
    arr = block_array(ids, num_blocks=10_001)
    assert arr.dtype == np.int64 and arr.ndim == 1
    assert arr.tolist() == ids
    assert not arr.flags.writeable
    # numpy input of any integer dtype gives the same result
    for dtype in (np.int32, np.int64, np.uint32, np.uint64):
        assert block_array(np.array(ids, dtype=dtype)).tolist() == ids


@given(
    st.lists(st.integers(0, 1000), unique=True, min_size=1, max_size=20),
    st.data(),
)
def test_a_repeated_id_is_refused_naming_its_position(ids: list[int], data: st.DataObject) -> None:
    dup_of = data.draw(st.integers(0, len(ids) - 1))
    at = data.draw(st.integers(dup_of + 1, len(ids)))
    bad = [*ids[:at], ids[dup_of], *ids[at:]]
    with pytest.raises(PlanError, match=rf"\[{at}\]={ids[dup_of]}: block id repeated"):
        block_array(bad)
    with pytest.raises(PlanError, match="repeated"):
        block_array(np.array(bad))


@given(
    st.lists(st.integers(0, 100), unique=True, max_size=10),
    st.data(),
    st.one_of(
        st.booleans(),
        st.floats(allow_nan=True),
        st.text(max_size=3),
        st.none(),
        st.just(np.float32(1.0)),
        st.just(np.bool_(True)),
    ),
)
def test_a_non_integer_id_is_refused_not_converted(
    ids: list[int], data: st.DataObject, bad: object
) -> None:
    pos = data.draw(st.integers(0, len(ids)))
    seq = [*ids[:pos], bad, *ids[pos:]]
    with pytest.raises(
        PlanError, match=rf"\[{pos}\].*must be an integer, not {type(bad).__name__}"
    ):
        block_array(seq)


@pytest.mark.parametrize("arr", [np.array([1.0, 2.0]), np.array([True, False]), np.array(["1"])])
def test_non_integer_arrays_are_refused(arr: np.ndarray) -> None:
    with pytest.raises(PlanError, match="must be integers"):
        block_array(arr)


@given(st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63), st.integers(50, 2**62)))
def test_out_of_range_ids_of_any_size_are_plan_errors(bad: int) -> None:
    with pytest.raises(PlanError, match=rf"\[1\]={bad}: out of range"):
        block_array([3, bad], num_blocks=50)


def test_unsigned_ids_past_int64_are_out_of_range() -> None:
    with pytest.raises(PlanError, match="out of range"):
        block_array(np.array([1, 2**63 + 5], dtype=np.uint64))


def test_groups_flat_list_rules() -> None:
    one = block_groups([1, 2], 1)
    assert to_wire(one) == ((1, 2),)
    with pytest.raises(PlanError, match="one flat list given, the layout has 2 KV groups"):
        block_groups([1, 2], 2)
    shared = block_groups([1, 2], 2, broadcast=True)
    assert to_wire(shared) == ((1, 2), (1, 2))
    per = block_groups([[1, 2], [5]], 2)
    assert to_wire(per) == ((1, 2), (5,))
    assert to_wire(block_groups(np.array([[1, 2], [3, 4]]), 2)) == ((1, 2), (3, 4))
    with pytest.raises(PlanError, match="3 group\\(s\\) given, the layout has 2"):
        block_groups([[1], [2], [3]], 2)
    assert to_wire(block_groups([], 1)) == ((),)
    assert to_wire(block_groups([[], []], 2)) == ((), ())


def test_groups_name_the_group_of_a_bad_id() -> None:
    with pytest.raises(
        PlanError, match=r"remote block_ids \(group 1\)\[0\]=9: out of range \[0, 4\)"
    ):
        block_groups([[1], [9]], 2, side="remote", num_blocks=4)
    with pytest.raises(PlanError, match="need a list"):
        block_groups("12", 1)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="need a list"):
        block_groups(7, 1)  # type: ignore[arg-type]


def test_describe_is_log_sized() -> None:
    assert describe([1, 2]) == "invalid blocks: [1, 2]"
    assert describe(np.arange(20)) == "20 invalid blocks: [0, 1, 2, 3] ... [18, 19]"


# -- check_counts: block counts against num_tokens ----------------------------------------


def _g(*counts: int) -> blocks.Groups:
    return tuple(np.arange(n, dtype=np.int64) for n in counts)


@pytest.mark.parametrize(
    ("num_tokens", "cached", "count"),
    [(0, 0, 0), (1, 0, 1), (16, 0, 1), (17, 0, 2), (100, 0, 7), (100, 2, 5), (100, 7, 0)],
)
def test_check_counts_accepts_exactly_the_blocks_the_tokens_fill(
    num_tokens: int, cached: int, count: int
) -> None:
    got = blocks.check_counts(
        _g(count, count), num_tokens=num_tokens, block_size=16, cached_blocks=cached
    )
    assert got == count


@pytest.mark.parametrize(
    ("groups", "num_tokens", "cached", "match"),
    [
        (_g(3), 100, 0, r"group 0\): 3 block\(s\) given; num_tokens=100 fills 7 .* exactly 7"),
        (_g(4), 48, 0, r"4 block\(s\) given; num_tokens=48 fills 3"),
        (_g(3, 2), 48, 0, r"group 1\): 2 block\(s\)"),
        (_g(3), 48, 1, r"cached_blocks=1, so exactly 2"),
        (_g(0), 48, 4, r"cached_blocks=4: more than the 3 block"),
        (_g(1), -1, 0, r"num_tokens=-1: must be a non-negative int"),
        (_g(1), 16, -1, r"cached_blocks=-1: must be a non-negative int"),
        (_g(1), True, 0, r"num_tokens=True"),
        (_g(1), 16.0, 0, r"num_tokens=16\.0"),
    ],
)
def test_check_counts_refuses_with_the_counts_named(
    groups: blocks.Groups, num_tokens: int, cached: int, match: str
) -> None:
    with pytest.raises(PlanError, match=match):
        blocks.check_counts(groups, num_tokens=num_tokens, block_size=16, cached_blocks=cached)


def test_check_counts_takes_numpy_integers() -> None:
    assert blocks.check_counts(_g(2), num_tokens=np.int64(17), block_size=16) == 2  # type: ignore[arg-type]


def test_check_counts_lets_a_sliding_group_name_fewer_never_more() -> None:
    sliding = [False, True]
    assert blocks.check_counts(_g(7, 2), num_tokens=100, block_size=16, sliding=sliding) == 7
    with pytest.raises(PlanError, match=r"group 1\): 8 block\(s\).*at most 7"):
        blocks.check_counts(_g(7, 8), num_tokens=100, block_size=16, sliding=sliding)


def test_pair_remote_pairs_by_token_position_cut_or_not() -> None:
    local = (np.array([20, 21, 22]),)
    full = (np.array([1, 2, 3, 4, 5]),)  # a hold's list: blocks 0..4 of 70 tokens
    cut = (np.array([3, 4, 5]),)  # the same ticket cut to the suffix
    for remote in (full, cut):
        got = blocks.pair_remote(local, remote, num_tokens=70, remote_num_tokens=70, block_size=16)
        assert got[0].tolist() == [3, 4, 5]
    shared = np.array([1, 2, 3, 4, 5])
    got = blocks.pair_remote(
        (local[0], local[0]), (shared, shared), num_tokens=70, remote_num_tokens=70, block_size=16
    )
    assert got[0] is got[1]  # identical groups stay one array
    with pytest.raises(PlanError, match=r"holds blocks 2\.\.4 of its 70 tokens"):
        blocks.pair_remote(
            (np.array([9, 8, 7, 6]),), cut, num_tokens=70, remote_num_tokens=70, block_size=16
        )
    with pytest.raises(PlanError, match="more than the ticket's 70 tokens"):
        blocks.pair_remote(local, full, num_tokens=80, remote_num_tokens=70, block_size=16)
    with pytest.raises(PlanError, match="1 KV group"):
        blocks.pair_remote(
            (local[0], local[0]), full, num_tokens=70, remote_num_tokens=70, block_size=16
        )


_RULES = blocks.BlockRules(num_groups=2, num_blocks=10, block_size=4, sliding=(False, True))


def test_pair_checks_once_and_pairs_a_prefix_cached_suffix_with_the_ticket() -> None:
    # 10 tokens fill 3 blocks; one leading block is cached, so two are listed. The
    # ticket holds all three (its last two pair with ours), for both groups.
    got = blocks.pair(
        [7, 8],
        ((1, 2, 3), (4, 5, 6)),
        _RULES,
        num_tokens=10,
        remote_num_tokens=10,
        cached_blocks=1,
        request_id="r",
    )
    assert isinstance(got, blocks.Pairing)
    assert [g.tolist() for g in got.local] == [[7, 8], [7, 8]]
    assert [g.tolist() for g in got.remote] == [[2, 3], [5, 6]]
    assert got.num_tokens == 10
    assert all(not g.flags.writeable for g in got.local)


@pytest.mark.parametrize(
    ("local", "tokens", "remote_tokens", "cached", "match"),
    [
        ([7, 10], 10, 10, 1, r"local .*=10: out of range"),  # past num_blocks
        ([7, 7], 10, 10, 1, "repeat"),  # twice in one group
        ([True, 8], 10, 10, 1, "integer"),  # not an integer
        ([7], 10, 10, 1, "exactly 2 must be listed"),  # too few for the full group
        ([7, 8], 14, 10, 2, "more than the ticket"),  # more tokens than the ticket holds
    ],
)
def test_pair_refuses_what_any_of_its_checks_refuses(
    local: list[object], tokens: int, remote_tokens: int, cached: int, match: str
) -> None:
    with pytest.raises(PlanError, match=match):
        blocks.pair(
            local,  # type: ignore[arg-type]
            ((1, 2, 3), (4, 5, 6)),
            _RULES,
            num_tokens=tokens,
            remote_num_tokens=remote_tokens,
            cached_blocks=cached,
            request_id="r",
        )
