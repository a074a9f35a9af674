"""The staging slots' and the hold check's contracts, by their exact words and at
their boundaries (kvxfer.core.staging, issue 55): what the mutation run of
``scripts/mutation.sh staging`` showed the properties of tests/test_staging.py left
open."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.core.staging import Slot, StagingSlots, extents, first_outside
from kvxfer.errors import ConfigError


def u64(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


@pytest.mark.parametrize("slots", [0, -1, True, 1.5, "2"])
def test_a_slot_count_that_is_not_a_positive_int_is_refused_by_its_words(slots: object) -> None:
    with pytest.raises(ConfigError) as err:
        StagingSlots(1024, slots)  # type: ignore[arg-type]
    assert (err.value.key, err.value.value, err.value.rule) == (
        "gather.slots",
        slots,
        "must be a positive int",
    )


@pytest.mark.parametrize(("nbytes", "slots"), [(3, 4), (0, 1), (True, 1), (8.0, 2)])
def test_staging_smaller_than_one_byte_a_slot_is_refused_by_its_words(
    nbytes: object, slots: int
) -> None:
    with pytest.raises(ConfigError) as err:
        StagingSlots(nbytes, slots)  # type: ignore[arg-type]
    assert (err.value.key, err.value.value, err.value.rule) == (
        "gather.staging_bytes",
        nbytes,
        f"must be at least {slots}",
    )


def test_the_smallest_staging_is_one_slot_of_one_byte_each() -> None:
    one = StagingSlots(1, 1)
    assert (one.slots, one.slot_bytes, one.free) == (1, 1, 1)
    four = StagingSlots(4, 4)
    assert (four.slots, four.slot_bytes) == (4, 1)
    assert [four.acquire() for _ in range(4)] == [Slot(i, i, 1, 0) for i in range(4)]
    assert four.acquire() is None


def test_a_release_of_a_free_slot_at_its_current_generation_frees_nothing() -> None:
    """Released once, a slot is free; a second release naming its new generation (a
    late GatherDone racing a newer round's bookkeeping) must not put it on the free
    list twice, where two requests would be lent the same bytes."""
    slots = StagingSlots(8, 2)
    a = slots.acquire()
    assert a is not None
    slots.release(a)
    assert slots.free == 2 and slots.generation(a.index) == 1
    slots.release(Slot(a.index, a.offset, a.nbytes, 1))  # free now: not lent
    assert slots.free == 2 and slots.generation(a.index) == 1
    lent = [slots.acquire(), slots.acquire()]
    assert None not in lent and len({s.index for s in lent if s}) == 2
    assert slots.acquire() is None


def test_extents_keep_one_byte_ranges_and_merge_ranges_that_touch() -> None:
    starts, ends = extents(u64(10, 4, 20), u64(1, 6, 1))
    # [4, 10) and [10, 11) touch: one extent; [20, 21) is a byte of its own.
    assert starts.tolist() == [4, 20] and ends.tolist() == [11, 21]
    # A piece across the touching point lies inside the merged extent.
    assert first_outside(u64(8), u64(3), starts, ends) is None
    # Empty ranges cover nothing.
    starts, ends = extents(u64(5, 7), u64(0, 2))
    assert starts.tolist() == [7] and ends.tolist() == [9]


def test_an_empty_piece_is_refused_even_inside_the_hold() -> None:
    starts, ends = u64(0), u64(100)
    assert first_outside(u64(10, 20), u64(4, 0), starts, ends) == 1
    assert first_outside(u64(10, 20), u64(4, 1), starts, ends) is None
