"""State slots across tensor-parallel sizes: which producer bytes fill which consumer bytes.

Between equal TP sizes a state slot moves whole. Between TP sizes a consumer rank's
slot of a state layer holds, segment by segment (:class:`~kvxfer.core.state_split.StateSplit`),
units that live on one or several producer ranks. :func:`plan_slots` says, once per
set of peers, for every state region of the consumer: which producer rank supplies
each run of its units, at which byte offset inside that rank's slot, and where it
lands inside the consumer's slot (:class:`StatePiece`; consecutive units read from one
rank and contiguous on both sides merge into one piece). A request then turns its
paired slots into address runs per producer rank (:func:`slot_runs`), posted as
any other list of runs.

Which producer rank supplies a unit held by several (a group replicated because it
is fewer than the producer's ranks) follows the rule of KV heads
(:func:`kvxfer.core.heads.source_ranks`): replica ``(i + salt) mod replicas``, *i* the
consumer rank's index among the consumer ranks holding that unit.

Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import numpy as np

from kvxfer.core.blocks import IntArray
from kvxfer.core.descriptors import Runs
from kvxfer.core.layout import KVLayout, KVPart
from kvxfer.core.merging import run_starts
from kvxfer.core.state_split import StateSplit, check_conv_order, unit_ranks, units_of
from kvxfer.errors import ConfigError, LayoutError, LayoutMismatch, PlanError

__all__ = [
    "StatePiece",
    "check_state_layout",
    "check_state_pair",
    "join_runs",
    "plan_slots",
    "slot_runs",
    "state_regions",
    "state_source_ranks",
]

_Key = tuple[int, KVPart]


class StatePiece(msgspec.Struct, frozen=True, kw_only=True):
    """One byte range of a consumer's state slot and where it is read from.

    Attributes:
        local_region: the consumer's state region (index into its layout).
        rank: the producer rank read.
        remote_region: that rank's region of the same (layer, part).
        local_offset: where the range starts inside a consumer slot.
        remote_offset: where it starts inside the producer rank's slot.
        length: bytes.
    """

    local_region: int
    rank: int
    remote_region: int
    local_offset: int
    remote_offset: int
    length: int


def state_regions(layout: KVLayout) -> dict[_Key, int]:
    """The state regions of ``layout`` by (layer, part).

    Raises:
        LayoutError: a state region that is neither CONV nor SSM, or two for one
            (layer, part) (a state slot split into shards is not described here).
    """
    out: dict[_Key, int] = {}
    for i, r in enumerate(layout.regions):
        if not layout.groups[r.group].is_state:
            continue
        if r.part not in (KVPart.CONV, KVPart.SSM):
            raise LayoutError(
                f"KVLayout.regions[{i}].part={r.part.name}: a state region across TP sizes "
                "holds a CONV or an SSM state"
            )
        key = (r.layer, r.part)
        if key in out:
            raise LayoutError(
                f"KVLayout.regions[{i}]: layer {r.layer} has two {r.part.name} state "
                "regions; across TP sizes each state is one region per layer"
            )
        out[key] = i
    return out


def check_state_layout(layout: KVLayout, split: StateSplit, tp_size: int, *, side: str) -> None:
    """Raise unless every state region of a rank of ``tp_size`` holds the bytes
    ``split`` gives it, and its conv state is dim-major.

    Raises:
        ConfigError: ``tp_size`` cannot split a segment, or the conv state is not DS.
        LayoutError: a state region's ``block_len`` is not its share (naming it).
    """
    split.check(tp_size)
    check_conv_order(layout.groups)
    for (layer, part), i in state_regions(layout).items():
        want = split.region_bytes(part, tp_size)
        got = layout.regions[i].block_len
        if got != want:
            names = "+".join(s.name for s in split.segments(part))
            raise LayoutError(
                f"{side} KVLayout.regions[{i}].block_len={got}: layer {layer} {part.name} "
                f"state of a rank of tp_size={tp_size} holds {want} bytes per slot "
                f"({names} as the state split says)"
            )


def _source(
    units: int, unit: int, local_tp: int, local_rank: int, remote_tp: int, salt: int
) -> int:
    holders = unit_ranks(units, remote_tp, unit)
    i = local_rank - unit_ranks(units, local_tp, unit).start
    return holders[(i + salt) % len(holders)]


def state_source_ranks(
    split: StateSplit, local_tp: int, local_rank: int, remote_tp: int, *, salt: int = 0
) -> tuple[int, ...]:
    """The producer ranks (of ``remote_tp``) that consumer rank ``local_rank`` of
    ``local_tp`` reads state units from, ascending.

    Raises:
        ConfigError: a TP size cannot split a segment, or a bad rank or salt.
    """
    if isinstance(salt, bool) or not isinstance(salt, int) or salt < 0:
        raise ConfigError("salt", salt, "must be a non-negative int")
    got: set[int] = set()
    for s in (*split.conv, *split.ssm):
        for u in units_of(s.units, local_tp, local_rank):
            got.add(_source(s.units, u, local_tp, local_rank, remote_tp, salt))
    return tuple(sorted(got))


def plan_slots(
    local: KVLayout,
    remotes: Mapping[int, KVLayout],
    *,
    split: StateSplit,
    local_tp: int,
    local_rank: int,
    remote_tp: int,
    salt: int = 0,
) -> tuple[StatePiece, ...]:
    """Where every byte of consumer rank ``local_rank``'s state slots is read from.

    ``remotes`` maps producer ranks to their layouts and must hold at least
    :func:`state_source_ranks`. Pieces come in local region order, then local offset.

    Raises:
        ConfigError: a TP size cannot split a segment, a conv state not DS, or a
            needed producer rank missing.
        LayoutError: a state region does not hold its share.
        LayoutMismatch: a producer rank lacks a consumer's state region.
    """
    check_state_layout(local, split, local_tp, side="local")
    ranks = state_source_ranks(split, local_tp, local_rank, remote_tp, salt=salt)
    missing = [p for p in ranks if p not in remotes]
    if missing:
        raise ConfigError("remote layouts", sorted(remotes), f"need producer ranks {missing}")
    theirs: dict[int, dict[_Key, int]] = {}
    for p in ranks:
        check_state_layout(remotes[p], split, remote_tp, side=f"producer rank {p}")
        theirs[p] = state_regions(remotes[p])
    out: list[StatePiece] = []
    for key, i in sorted(state_regions(local).items(), key=lambda kv: kv[1]):
        local_start = remote_base = 0
        pieces: list[StatePiece] = []
        for s in split.segments(key[1]):
            mine = units_of(s.units, local_tp, local_rank)
            for u in mine:
                p = _source(s.units, u, local_tp, local_rank, remote_tp, salt)
                j = theirs[p].get(key)
                if j is None:
                    where = f"layer {key[0]} {key[1].name} state (producer rank {p})"
                    raise LayoutMismatch(where, "present", "absent")
                held = units_of(s.units, remote_tp, p)
                piece = StatePiece(
                    local_region=i,
                    rank=p,
                    remote_region=j,
                    local_offset=local_start + (u - mine.start) * s.unit_bytes,
                    remote_offset=remote_base + (u - held.start) * s.unit_bytes,
                    length=s.unit_bytes,
                )
                pieces.append(_merged(pieces, piece))
            local_start += len(mine) * s.unit_bytes
            remote_base += s.held_bytes(remote_tp)
        out.extend(pieces)
    return tuple(out)


def _merged(pieces: list[StatePiece], piece: StatePiece) -> StatePiece:
    """``piece``, grown by the last of ``pieces`` (popped) when it continues it on
    both sides from the same producer region."""
    if pieces:
        last = pieces[-1]
        if (
            last.rank == piece.rank
            and last.remote_region == piece.remote_region
            and last.local_offset + last.length == piece.local_offset
            and last.remote_offset + last.length == piece.remote_offset
        ):
            pieces.pop()
            return msgspec.structs.replace(last, length=last.length + piece.length)
    return piece


def slot_runs(
    pieces: tuple[StatePiece, ...],
    local: KVLayout,
    remotes: Mapping[int, KVLayout],
    local_slots: IntArray,
    remote_slots: IntArray,
) -> dict[int, Runs]:
    """Address runs per producer rank for one request's state slots, paired by
    position (``local_slots[k]`` is filled from ``remote_slots[k]`` of every rank:
    the ranks of one TP group share block ids).

    Raises:
        PlanError: the slot lists differ in length, or a slot is outside a region.
    """
    if len(local_slots) != len(remote_slots):
        raise PlanError(
            f"state slots: {len(local_slots)} local, {len(remote_slots)} remote; they pair "
            "one to one"
        )
    lslots = np.asarray(local_slots, dtype=np.int64)
    rslots = np.asarray(remote_slots, dtype=np.int64)
    by_rank: dict[int, list[StatePiece]] = {}
    for piece in pieces:
        by_rank.setdefault(piece.rank, []).append(piece)
    out: dict[int, Runs] = {}
    for p, mine in sorted(by_rank.items()):
        parts: list[tuple[np.ndarray, ...]] = []
        for piece in mine:
            lr = local.regions[piece.local_region]
            rr = remotes[p].regions[piece.remote_region]
            for side, r, slots in (("local", lr, lslots), ("remote", rr, rslots)):
                if len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= r.num_blocks):
                    raise PlanError(
                        f"{side} state slots {slots.tolist()}: outside the {r.num_blocks} "
                        f"slots of layer {r.layer} {r.part.name}"
                    )
            n = len(lslots)
            parts.append(
                (
                    (lr.base + piece.local_offset + lslots * lr.stride).astype(np.uint64),
                    (rr.base + piece.remote_offset + rslots * rr.stride).astype(np.uint64),
                    np.full(n, piece.length, dtype=np.uint64),
                    np.full(n, lr.device_id, dtype=np.int64),
                    np.full(n, rr.device_id, dtype=np.int64),
                )
            )
        out[p] = _runs([np.concatenate(c) for c in zip(*parts, strict=True)])
    return out


def _runs(columns: list[np.ndarray]) -> Runs:
    """Runs from (local, remote, length, local device, remote device) columns,
    merged where contiguous on both sides (in local address order)."""
    l_addr, r_addr, length, l_dev, r_dev = columns
    order = np.lexsort((l_addr, l_dev))
    l_addr, r_addr, length = l_addr[order], r_addr[order], length[order]
    l_dev, r_dev = l_dev[order], r_dev[order]
    if not len(length):
        return Runs(l_addr, r_addr, length, l_dev, r_dev)
    starts = run_starts(l_addr, r_addr, length, l_dev, r_dev)
    total = np.concatenate((np.zeros(1, dtype=np.uint64), np.cumsum(length, dtype=np.uint64)))
    ends = np.append(starts[1:], len(length))
    return Runs(
        l_addr[starts], r_addr[starts], total[ends] - total[starts], l_dev[starts], r_dev[starts]
    )


def join_runs(*runs: Runs) -> Runs:
    """Several lists of runs as one (a producer rank's attention runs and its state
    runs posted together), merged again where they touch."""
    columns = [
        np.concatenate([getattr(r, name) for r in runs])
        for name in ("local_addr", "remote_addr", "length", "local_device", "remote_device")
    ]
    return _runs(columns)


def check_state_pair(
    local: KVLayout,
    remote: KVLayout,
    *,
    local_split: StateSplit | None,
    remote_split: StateSplit | None,
    local_tp: int,
    remote_tp: int,
) -> None:
    """Raise unless two ranks can exchange their state slots: the handshake's check
    of the state groups, beside the attention heads'. Equal TP sizes move slots whole
    (same bytes per slot); other TP sizes need both sides' :class:`StateSplit` (the
    same) and regions holding their shares.

    Raises:
        ConfigError: a split not stated, a TP size it cannot serve, or a conv state
            not dim-major.
        LayoutMismatch: other state regions or splits (naming the field).
        LayoutError: a state region that does not hold its share.
    """
    mine, theirs = state_regions(local), state_regions(remote)
    if not mine and not theirs:
        return
    for key in (*mine, *theirs):
        if key not in mine or key not in theirs:
            where = f"layer {key[0]} {key[1].name} state region"
            raise LayoutMismatch(where, key in mine, key in theirs)
    if local_tp == remote_tp:
        for key, i in mine.items():
            a, b = local.regions[i].block_len, remote.regions[theirs[key]].block_len
            if a != b:
                raise LayoutMismatch(f"layer {key[0]} {key[1].name} state bytes per slot", a, b)
        return
    for side, split in (("local", local_split), ("remote", remote_split)):
        if split is None:
            raise ConfigError(
                f"{side} tp.state",
                None,
                f"state groups between TP sizes {local_tp} and {remote_tp} need both "
                "instances to state how TP splits their state slots (TPRank.state)",
            )
    assert local_split is not None and remote_split is not None
    difference = local_split.first_difference(remote_split)
    if difference is not None:
        raise LayoutMismatch(*difference)
    check_state_layout(local, local_split, local_tp, side="local")
    check_state_layout(remote, remote_split, remote_tp, side="remote")
