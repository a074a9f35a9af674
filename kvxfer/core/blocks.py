"""Block id lists: the one place kvxfer turns an engine's block ids into arrays.

Every caller that accepts block ids from outside (the Agent's ``hold``, ``pull``,
``expect_push`` and ``stream``, :func:`kvxfer.core.descriptors.build_plan`, the vLLM adapter
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
from typing import Any, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt

from kvxfer.errors import PlanError

__all__ = [
    "BlockIds",
    "BlockRules",
    "Groups",
    "IntArray",
    "Pairing",
    "block_array",
    "block_groups",
    "check_counts",
    "describe",
    "from_wire",
    "pair",
    "pair_remote",
    "to_wire",
]

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
        # (list and tuple first: the ABC checks cost a microsecond on every request)
        if (
            type(ids) is not list
            and type(ids) is not tuple
            and (isinstance(ids, str | bytes) or not isinstance(ids, Sequence | range))
        ):
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
        # One pass for both bounds: a negative id read as unsigned lies past 2**63 > hi.
        if int(arr.view(np.uint64).max()) > hi:
            pos = int(np.flatnonzero((arr < 0) | (arr > hi))[0])
            raise PlanError(
                f"{_where(side, group)}[{pos}]={int(arr[pos])}: out of range [0, {hi + 1})"
            )
        # A set of Python ints finds a repeat holding the GIL; a numpy sort releases it,
        # and behind a busy thread (the agent's progress thread) waits up to the switch
        # interval to get it back. The sort words the error only.
        values = ids if type(ids) is list or type(ids) is tuple else arr.tolist()
        if arr.size > 1 and len(set(values)) != arr.size:
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


def _is_id_list(item: Any) -> bool:
    kind = type(item)
    if kind is list or kind is tuple or kind is np.ndarray:
        return True
    if kind is int:
        return False
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
        seq = ids if type(ids) is list else list(ids)
        flat = not seq or not _is_id_list(seq[0])
        rows = [seq] if flat else seq
    if flat and num_groups > 1:
        # Its ids first: a list whose first item is no id list may be a malformed
        # per-group list (``["0", [1]]``); the bad id is the better error.
        one = block_array(rows[0], side=side, group=0, num_blocks=num_blocks)
        if not broadcast:
            raise PlanError(
                f"{side} block_ids: one flat list given, the layout has {num_groups} KV "
                "groups; pass one list per group"
            )
        return (one,) * num_groups
    if len(rows) != num_groups:
        raise PlanError(
            f"{side} block_ids: {len(rows)} group(s) given, the layout has {num_groups}; "
            "pass one list per KV group"
        )
    return _shared(
        tuple(
            block_array(row, side=side, group=g, num_blocks=num_blocks)
            for g, row in enumerate(rows)
        )
    )


def check_counts(
    groups: Groups,
    *,
    num_tokens: int,
    block_size: int,
    cached_blocks: int = 0,
    sliding: Sequence[bool] = (),
    side: str = "local",
    state: Sequence[bool] = (),
) -> int:
    """Check each group's block count against the tokens it must hold; return the count.

    The blocks of a request are positional: block ``i`` holds tokens ``[i * block_size,
    (i + 1) * block_size)``. A request of ``num_tokens`` tokens fills
    ``ceil(num_tokens / block_size)`` blocks; the leading ``cached_blocks`` of them are
    a prefix the caller already has (a prefix-cache hit), so the list names the rest,
    in order. A sliding-window group (``sliding[g]``) may name fewer (the blocks that
    fell out of its window are not kept), never more. A state group (``state[g]``)
    names state slots, not token positions: at least one, whatever the token count
    and the cached prefix.

    Args:
        groups: Normalised block ids (:func:`block_groups`).
        num_tokens: The request's token count (>= 0).
        block_size: Tokens per block.
        cached_blocks: Leading blocks not listed (>= 0).
        sliding: Per group, True when it is a sliding-window group (default: none).
        side: For error messages (``"local"``, ``"remote"``).
        state: Per group, True when it is a recurrent-state group (default: none).

    Raises:
        PlanError: naming ``num_tokens``, ``cached_blocks`` or the group whose count
            breaks the rule, with the counts.
    """
    for key, value in (("num_tokens", num_tokens), ("cached_blocks", cached_blocks)):
        # numpy integers are integers; a bool or a float is a mistake, never converted
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise PlanError(f"{key}={value!r}: must be a non-negative int")
    num_tokens, cached_blocks = int(num_tokens), int(cached_blocks)
    filled = -(-num_tokens // block_size)
    expected = filled - cached_blocks
    if expected < 0:
        raise PlanError(
            f"cached_blocks={cached_blocks}: more than the {filled} block(s) that "
            f"num_tokens={num_tokens} fills (block_size {block_size})"
        )
    for g, ids in enumerate(groups):
        if g < len(state) and state[g]:
            if len(ids) == 0 and expected > 0:
                raise PlanError(
                    f"{_where(side, g)}: no block given; a state group lists the state "
                    f"slot(s) of the request (at least one) for its {num_tokens} tokens"
                )
            continue
        window = g < len(sliding) and sliding[g]
        if len(ids) == expected or (window and len(ids) < expected):
            continue
        rule = "at most" if window else "exactly"
        raise PlanError(
            f"{_where(side, g)}: {len(ids)} block(s) given; num_tokens={num_tokens} "
            f"fills {filled} block(s) of {block_size} tokens and cached_blocks="
            f"{cached_blocks}, so {rule} {expected} must be listed (the blocks of "
            f"tokens {cached_blocks * block_size}..{num_tokens})"
        )
    return expected


def pair_remote(
    local: Groups,
    remote: Groups,
    *,
    num_tokens: int,
    remote_num_tokens: int,
    block_size: int,
    request_id: str = "",
    state: Sequence[bool] = (),
) -> Groups:
    """The remote blocks that pair with ``local``, by token position.

    Each list holds the *last* blocks of its token count: ``local`` those of
    ``num_tokens`` (:func:`check_counts` checked it), ``remote`` (a ticket's) those of
    ``remote_num_tokens`` (all of them when it comes from a hold; a router may cut it
    to a suffix). The remote blocks at the positions ``local`` covers are returned, so
    a prefix-cache suffix reads the matching remote blocks whether or not the ticket
    was cut.

    Args:
        local: Normalised local block ids.
        remote: The ticket's block ids (:func:`from_wire`).
        num_tokens: The tokens ``local`` ends at.
        remote_num_tokens: The tokens ``remote`` ends at (0: unknown, taken as
            ``num_tokens``).
        block_size: Tokens per block.
        request_id: For error messages.
        state: Per group, True for a recurrent-state group: its slots pair by
            position, local *i* with remote *i*, and both sides list as many.

    Raises:
        PlanError: another group count, more tokens than the remote side holds,
            positions it does not cover (naming both ranges), or state groups that
            list different slot counts.
    """
    if len(remote) != len(local):
        raise PlanError(
            f"remote block_ids of {request_id!r}: {len(remote)} KV group(s), the local "
            f"block_ids {len(local)}"
        )
    if remote_num_tokens and num_tokens > remote_num_tokens:
        raise PlanError(
            f"num_tokens={num_tokens}: more than the ticket's {remote_num_tokens} tokens "
            f"(request {request_id!r})"
        )
    held = -(-(remote_num_tokens or num_tokens) // block_size)
    wanted = -(-num_tokens // block_size)
    bounds: list[tuple[int, int]] = []
    for g, (mine, theirs) in enumerate(zip(local, remote, strict=True)):
        if g < len(state) and state[g]:
            if len(mine) != len(theirs):
                raise PlanError(
                    f"{_where('remote', g)}: the ticket of {request_id!r} holds "
                    f"{len(theirs)} state slot(s), the local state group lists {len(mine)}: "
                    "state slots pair one to one"
                )
            bounds.append((0, len(theirs)))
            continue
        start = (wanted - len(mine)) - (held - len(theirs))
        stop = start + len(mine)
        if start < 0 or stop > len(theirs):
            raise PlanError(
                f"{_where('remote', g)}: the ticket of {request_id!r} holds blocks "
                f"{held - len(theirs)}..{held - 1} of its {remote_num_tokens} tokens, the "
                f"{len(mine)} local block(s) need blocks {wanted - len(mine)}..{wanted - 1}"
            )
        bounds.append((start, stop))
    if all(r is remote[0] for r in remote) and len(set(bounds)) == 1:
        # Identical groups stay one shared array (see from_wire).
        start, stop = bounds[0]
        one = remote[0] if (start, stop) == (0, len(remote[0])) else remote[0][start:stop]
        return (one,) * len(remote)
    return tuple(
        r if (start, stop) == (0, len(r)) else r[start:stop]
        for r, (start, stop) in zip(remote, bounds, strict=True)
    )


def _shared(groups: Groups) -> Groups:
    """Identical groups as one shared array: :func:`kvxfer.core.descriptors.build_plan` turns
    a shared array into the ids of every group with a single broadcast."""
    if len(groups) > 1:
        first = groups[0]
        if all(g is first or np.array_equal(g, first) for g in groups[1:]):
            return (first,) * len(groups)
    return groups


def to_wire(groups: Groups) -> tuple[tuple[int, ...], ...]:
    """Block groups as plain int tuples, the form tickets and wire messages carry."""
    # tolist() converts in C: a generator over numpy scalars costs ~1 µs per block.
    return tuple(tuple(g.tolist()) for g in groups)


def from_wire(groups: tuple[tuple[int, ...], ...]) -> Groups:
    """Block groups from their wire form (a ticket's, a registration's) as arrays.

    The wire schema already made every id an int; ranges are the peer's table's,
    which :func:`kvxfer.core.descriptors.build_plan` checks. Identical groups share one
    array (see :func:`block_groups`).
    """
    if len(groups) > 1:
        first = groups[0]
        if all(g == first for g in groups[1:]):
            one = np.array(first, dtype=np.int64)
            return (one,) * len(groups)
    return tuple(np.array(g, dtype=np.int64) for g in groups)


class BlockRules(NamedTuple):
    """What a registered layout says of the block ids a request may list."""

    num_groups: int
    num_blocks: int
    block_size: int
    #: Per group, whether it is a sliding-window group (it may list fewer blocks).
    sliding: tuple[bool, ...]
    #: Per group, whether it is a recurrent-state group (it lists state slots).
    state: tuple[bool, ...] = ()


class Pairing(NamedTuple):
    """A request's block ids checked once, by :func:`pair`.

    The planner takes it as it is (:func:`kvxfer.core.descriptors.plan_pairing`) and
    checks only what ``pair`` cannot know: the remote ids against the peer's table.
    """

    #: The local blocks per group: integers in range, no repeats, the counts the
    #: request's tokens call for.
    local: Groups
    #: The ticket's blocks that hold the same token positions, per group.
    remote: Groups
    #: The tokens the local blocks end at.
    num_tokens: int


def pair(
    local_ids: BlockIds,
    ticket_ids: tuple[tuple[int, ...], ...],
    rules: BlockRules,
    *,
    num_tokens: int,
    remote_num_tokens: int,
    cached_blocks: int = 0,
    request_id: str = "",
) -> Pairing:
    """Check a pull's local block ids and pair them with its ticket's, once.

    :func:`block_groups` (a flat list serves every group), :func:`check_counts` and
    :func:`pair_remote` in one call: what an Agent does before it plans a pull.

    Raises:
        PlanError: an id or a count breaks a rule (the error names which).
    """
    local = block_groups(local_ids, rules.num_groups, num_blocks=rules.num_blocks, broadcast=True)
    check_counts(
        local,
        num_tokens=num_tokens,
        block_size=rules.block_size,
        cached_blocks=cached_blocks,
        sliding=rules.sliding,
        state=rules.state,
    )
    remote = pair_remote(
        local,
        from_wire(ticket_ids),
        num_tokens=num_tokens,
        remote_num_tokens=remote_num_tokens,
        block_size=rules.block_size,
        request_id=request_id,
        state=rules.state,
    )
    return Pairing(local, remote, num_tokens)


def describe(blocks: Sequence[int] | IntArray) -> str:
    """A log-sized summary of a block list."""
    ids = list(blocks.tolist() if isinstance(blocks, np.ndarray) else blocks)
    if len(ids) <= 8:
        return f"invalid blocks: {ids}"
    return f"{len(ids)} invalid blocks: {ids[:4]} ... {ids[-2:]}"
