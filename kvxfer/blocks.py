"""Block id lists: the one place kvxfer turns an engine's block ids into arrays.

Every caller that accepts block ids from outside (the Agent's ``hold``, ``pull``,
``expect_push`` and ``stream``, :func:`kvxfer.descriptors.build_plan`, the vLLM adapter
reading ``kv_transfer_params``) goes through :func:`block_groups`, so one set of rules
holds everywhere (R-DESC-1, R-DESC-7):

- an id is an integer: ``bool``, ``float``, ``str`` and anything else are refused,
  never converted (``True`` is not block 1, ``2.7`` is not block 2);
- an id fits the block table: negative ids and ids of any size past ``num_blocks``
  (``2**70`` included) are refused by value and position;
- no id appears twice in one group's list (a byte would be written twice);
- the result is one read-only int64 array per KV group.

Errors are :class:`~kvxfer.errors.PlanError` naming the side, the group, the position,
the offending value and the rule. Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from kvxfer.errors import PlanError

__all__ = ["BlockIds", "Groups", "IntArray", "block_array", "block_groups", "describe", "to_wire"]

IntArray: TypeAlias = npt.NDArray[np.int64]
#: What callers may pass: one list (or 1-d array) of ids, or one list per KV group.
BlockIds: TypeAlias = (
    "Sequence[int] | Sequence[Sequence[int] | npt.NDArray[Any]] | npt.NDArray[Any]"
)
#: Normalised block ids: one read-only int64 array per KV group.
Groups: TypeAlias = tuple[IntArray, ...]

_INT64_MAX = np.iinfo(np.int64).max


def _where(side: str, group: int) -> str:
    return f"{side} block_ids (group {group})"


def _reject_types(seq: Sequence[Any], side: str, group: int) -> None:
    # One pass of type() in C (map) instead of an isinstance loop: ~5 ns per id.
    kinds = set(map(type, seq))
    if kinds <= {int} or all(k is not bool and issubclass(k, np.integer) for k in kinds):
        return
    for pos, item in enumerate(seq):
        kind = type(item)
        if kind is bool or not issubclass(kind, int | np.integer):
            raise PlanError(
                f"{_where(side, group)}[{pos}]={item!r}: a block id must be an integer, "
                f"not {kind.__name__}"
            )


def block_array(
    ids: Sequence[int] | npt.NDArray[Any],
    *,
    side: str = "local",
    group: int = 0,
    num_blocks: int | None = None,
) -> IntArray:
    """Validate one group's block ids and return them as a read-only int64 copy.

    Args:
        ids: The ids, a sequence of ints or a 1-d integer array.
        side: ``"local"`` or ``"remote"``, for the error message.
        group: The KV group these ids belong to, for the error message.
        num_blocks: When given, every id must lie in ``[0, num_blocks)``.

    Raises:
        PlanError: an id that is not an integer, negative, too large or repeated.
    """
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1:
            raise PlanError(f"{_where(side, group)}: need a 1-d list of ids, got shape {ids.shape}")
        if ids.size and ids.dtype.kind not in "iu":
            raise PlanError(f"{_where(side, group)}: dtype {ids.dtype}: block ids must be integers")
        if ids.dtype.kind == "u" and ids.size and int(ids.max()) > _INT64_MAX:
            pos = int(np.flatnonzero(ids > _INT64_MAX)[0])
            raise PlanError(
                f"{_where(side, group)}[{pos}]={int(ids[pos])}: out of range "
                f"[0, {num_blocks if num_blocks is not None else 2**63})"
            )
        arr = np.array(ids, dtype=np.int64)
    else:
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | range):
            raise PlanError(f"{_where(side, group)}={ids!r}: need a list of integer block ids")
        _reject_types(ids, side, group)
        try:
            arr = np.array(ids, dtype=np.int64)
        except OverflowError:
            pos, bad = next(
                (i, b) for i, b in enumerate(ids) if not -(2**63) <= int(b) <= _INT64_MAX
            )
            raise PlanError(
                f"{_where(side, group)}[{pos}]={int(bad)}: out of range "
                f"[0, {num_blocks if num_blocks is not None else 2**63})"
            ) from None
    if arr.size:
        hi = _INT64_MAX if num_blocks is None else num_blocks - 1
        # One reduction checks both ends: seen as uint64, a negative id is above hi.
        if int(arr.view(np.uint64).max()) > hi:
            pos = int(np.flatnonzero((arr < 0) | (arr > hi))[0])
            raise PlanError(
                f"{_where(side, group)}[{pos}]={int(arr[pos])}: out of range [0, {hi + 1})"
            )
        if arr.size > 1 and _has_repeats(arr, num_blocks):
            order = np.argsort(arr, kind="stable")
            same = arr[order[1:]] == arr[order[:-1]]
            # Name the repeat that comes latest in the caller's list order of the pair.
            first = int(np.flatnonzero(same)[0])
            pos = int(order[first + 1])
            raise PlanError(
                f"{_where(side, group)}[{pos}]={int(arr[pos])}: block id repeated "
                f"(first at position {int(order[first])}); each block may appear once"
            )
    arr.flags.writeable = False
    return arr


def _has_repeats(arr: IntArray, num_blocks: int | None) -> bool:
    """Whether an in-range id list repeats an id (block_array is on the request path).

    A bitmap over the block table costs O(num_blocks) but no sort; past a few times
    the list's size a sort is cheaper.
    """
    if num_blocks is not None and num_blocks <= 32 * arr.size + 4096:
        seen = np.zeros(num_blocks, dtype=np.bool_)
        seen[arr] = True
        return int(np.count_nonzero(seen)) != arr.size
    ordered = np.sort(arr)
    return bool((ordered[1:] == ordered[:-1]).any())


def _is_id_list(item: Any) -> bool:
    return isinstance(item, np.ndarray) or (
        isinstance(item, Sequence | range) and not isinstance(item, str | bytes)
    )


def block_groups(
    ids: BlockIds,
    num_groups: int,
    *,
    side: str = "local",
    num_blocks: int | None = None,
    broadcast: bool = False,
) -> Groups:
    """Normalise block ids to one validated int64 array per KV group.

    Args:
        ids: One list (or 1-d array) of ids, or one list per group (a 2-d array
            counts as one row per group).
        num_groups: The layout's KV group count.
        side: ``"local"`` or ``"remote"``, for error messages.
        num_blocks: When given, ids must lie in ``[0, num_blocks)``.
        broadcast: A flat list serves every group (engines whose groups share one block
            table). Without it a flat list is accepted only for a single-group layout.

    Raises:
        PlanError: wrong group count or a bad id (see :func:`block_array`).
    """
    if isinstance(ids, np.ndarray):
        rows: list[Any] = [ids] if ids.ndim == 1 else list(ids)
        flat = ids.ndim == 1
    else:
        if not _is_id_list(ids):
            raise PlanError(f"{side} block_ids={ids!r}: need a list of integer block ids")
        seq = list(ids)
        flat = not seq or not _is_id_list(seq[0])
        rows = [seq] if flat else seq
    if flat and num_groups > 1:
        if not broadcast:
            raise PlanError(
                f"{side} block_ids: one flat list given, the layout has {num_groups} KV "
                "groups; pass one list per group"
            )
        one = block_array(rows[0], side=side, group=0, num_blocks=num_blocks)
        return (one,) * num_groups
    if len(rows) != num_groups:
        raise PlanError(
            f"{side} block_ids: {len(rows)} group(s) given, the layout has {num_groups}; "
            "pass one list per KV group"
        )
    return tuple(
        block_array(row, side=side, group=g, num_blocks=num_blocks) for g, row in enumerate(rows)
    )


def to_wire(groups: Groups) -> tuple[tuple[int, ...], ...]:
    """Block groups as plain int tuples, the form tickets and wire messages carry."""
    # tolist() converts in C: a generator over numpy scalars costs ~1 µs per block.
    return tuple(tuple(g.tolist()) for g in groups)


def describe(blocks: Sequence[int] | IntArray) -> str:
    """A log-sized summary of a block list."""
    ids = list(blocks.tolist() if isinstance(blocks, np.ndarray) else blocks)
    if len(ids) <= 8:
        return f"invalid blocks: {ids}"
    return f"{len(ids)} invalid blocks: {ids[:4]} ... {ids[-2:]}"
