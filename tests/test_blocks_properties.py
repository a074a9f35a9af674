"""Properties of kvxfer.core.blocks beyond its example tests: both repeat checks, the side
and group every error names, flat lists and broadcast, the log summary's cut-over.

build_plan validates every request's ids through these functions (R-DESC-1, R-DESC-7).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.core.blocks import block_array, block_groups, describe
from kvxfer.errors import PlanError
from kvxfer.testing import strategies as kst

unique_ids = st.lists(st.integers(0, 300), unique=True, min_size=1, max_size=40)
# A table as small as the ids allow (the bitmap check), or far larger (the sort).
table_sizes = st.sampled_from((None, 301, 302, 2**20, 2**40))


@given(unique_ids, table_sizes, st.data())
def test_a_repeat_is_found_whatever_the_table_size(
    ids: list[int], num_blocks: int | None, data: st.DataObject
) -> None:
    assert block_array(ids, num_blocks=num_blocks).tolist() == ids
    assert block_array(np.array(ids), num_blocks=num_blocks).tolist() == ids
    first = data.draw(st.integers(0, len(ids) - 1))
    at = data.draw(st.integers(first + 1, len(ids)))
    bad = [*ids[:at], ids[first], *ids[at:]]
    for given_ids in (bad, np.array(bad, dtype=np.int64), np.array(bad, dtype=np.uint16)):
        with pytest.raises(
            PlanError,
            match=rf"\[{at}\]={ids[first]}: block id repeated \(first at position {first}\)",
        ):
            block_array(given_ids, num_blocks=num_blocks)


@given(
    st.sampled_from(("local", "remote", None)),
    st.integers(1, 3),
    st.data(),
)
def test_every_error_names_the_side_group_and_position(
    side: str | None, num_groups: int, data: st.DataObject
) -> None:
    groups = [list(range(data.draw(st.integers(1, 5)))) for _ in range(num_groups)]
    g = data.draw(st.integers(0, num_groups - 1))
    pos = data.draw(st.integers(0, len(groups[g]) - 1))
    groups[g][pos] = data.draw(kst.adversarial_ids(8))
    kwargs = {} if side is None else {"side": side}
    with pytest.raises(PlanError, match=rf"^{side or 'local'} block_ids \(group {g}\)\[{pos}\]="):
        block_groups(groups, num_groups, num_blocks=8, **kwargs)  # type: ignore[arg-type]


@given(st.lists(st.integers(0, 7), unique=True, max_size=8), st.integers(2, 4), st.data())
def test_a_flat_list_serves_every_group_only_when_broadcast(
    ids: list[int], num_groups: int, data: st.DataObject
) -> None:
    side = data.draw(st.sampled_from(("local", "remote")))
    for flat in (ids, np.array(ids, dtype=np.int64)):
        with pytest.raises(PlanError, match=rf"^{side} block_ids: one flat list given"):
            block_groups(flat, num_groups, side=side)
        shared = block_groups(flat, num_groups, side=side, broadcast=True, num_blocks=8)
        assert len(shared) == num_groups and all(a is shared[0] for a in shared)
        assert shared[0].tolist() == ids
    bad = [*ids, 8]
    with pytest.raises(PlanError, match=rf"^{side} block_ids \(group 0\)\[{len(ids)}\]=8"):
        block_groups(bad, num_groups, side=side, broadcast=True, num_blocks=8)


@given(st.lists(st.integers(0, 99), max_size=20))
def test_describe_lists_up_to_eight_ids_then_summarises(ids: list[int]) -> None:
    for given_ids in (ids, np.array(ids, dtype=np.int64)):
        text = describe(given_ids)
        if len(ids) <= 8:
            assert text == f"invalid blocks: {ids}"
        else:
            assert text == f"{len(ids)} invalid blocks: {ids[:4]} ... {ids[-2:]}"


@given(st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=6, unique=True), st.data())
def test_unsigned_arrays_are_exact_up_to_int64_and_refused_past_it(
    ids: list[int], data: st.DataObject
) -> None:
    top = np.array([2**63 - 1], dtype=np.uint64)  # the largest int64 is a valid id
    assert block_array(top).tolist() == [2**63 - 1]
    arr = np.array(ids, dtype=np.uint64)
    assert block_array(arr).tolist() == ids
    pos = data.draw(st.integers(0, len(ids) - 1))
    bad = data.draw(st.integers(2**63, 2**64 - 1))
    arr[pos] = bad
    num_blocks = data.draw(st.sampled_from((None, 10, 2**62)))
    bound = 2**63 if num_blocks is None else num_blocks
    with pytest.raises(PlanError) as info:
        block_array(arr, side="remote", group=2, num_blocks=num_blocks)
    assert str(info.value) == f"remote block_ids (group 2)[{pos}]={bad}: out of range [0, {bound})"


@given(
    st.integers(2, 3),  # one group: a flat list, where a stray value is a bad id
    st.sampled_from(("local", "remote")),
    st.sampled_from(("12", b"12", 7, None, 1.5, {1: 2}, np.zeros((2, 2), dtype=np.int64))),
    st.data(),
)
def test_a_group_that_is_not_a_list_of_ids_names_side_and_group(
    num_groups: int, side: str, row: object, data: st.DataObject
) -> None:
    # Not group 0: block_groups tells a flat list from a list of groups by its first item.
    g = data.draw(st.integers(1, num_groups - 1))
    rows: list[object] = [[0] for _ in range(num_groups)]
    rows[g] = row
    expect = (
        rf"^{side} block_ids \(group {g}\): need a 1-d list of ids, got shape \(2, 2\)$"
        if isinstance(row, np.ndarray)
        else rf"^{side} block_ids \(group {g}\)=.*: need a list of integer block ids$"
    )
    with pytest.raises(PlanError, match=expect):
        block_groups(rows, num_groups, side=side)  # type: ignore[arg-type]


@given(st.integers(1, 4), st.integers(1, 6), st.sampled_from(("local", "remote")))
def test_the_wrong_group_count_is_named_exactly(num_groups: int, given_n: int, side: str) -> None:
    if given_n in (0, num_groups):
        return  # [] is a flat (empty) list, not zero groups
    rows = [[i] for i in range(given_n)]
    with pytest.raises(PlanError) as info:
        block_groups(rows, num_groups, side=side)
    assert str(info.value) == (
        f"{side} block_ids: {given_n} group(s) given, the layout has {num_groups}; "
        "pass one list per KV group"
    )
