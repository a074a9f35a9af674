"""Descriptor tables and transfer plans (R-DESC).

A :class:`DescriptorTable` lists every descriptor ``(addr, length, device)`` of a
registered cache in a fixed order, so a descriptor is named by its row number (id):

* section *whole*: one descriptor per (region, block), ``id = region * num_blocks +
  block``;
* section *chunk* (``chunk_mode`` with chunks smaller than a descriptor): each whole
  descriptor cut into ``K = tokens_per_desc / chunk`` chunks, ``id = chunk_offset +
  (region * num_blocks + block) * K + k``;
* section *window* (``swa_window_mode``, sliding groups whose window granule is smaller
  than a descriptor and is not already a chunk): per region of such a group, blocks cut
  into ``K`` units, ``id = window_offset[region] + block * K + k``.

Both instances build the *remote* table from the remote layout received in the
handshake (with the local options), so tables never travel on the wire.
:func:`build_plan` turns a request's local and remote block ids into two id arrays
that pair by position; :meth:`Plan.runs` gathers addresses and merges runs that are
contiguous on both sides. Which units a request moves (whole blocks, last-block
chunks, window granules) is decided in :mod:`kvxfer.core._selection`. Everything per
descriptor is numpy; Python loops run per group or per section only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvxfer.core._selection import (
    TOKEN_MAJOR_LAYOUTS,
    GroupCut,
    IntArray,
    Pick,
    Section,
    group_cuts,
    pick,
    unit_ids,
)
from kvxfer.core.blocks import BlockIds, Groups, Pairing, block_array, block_groups
from kvxfer.core.layout import KVLayout
from kvxfer.core.merging import address_order, chain_order, region_chains, run_starts
from kvxfer.errors import ConfigError, LayoutMismatch, PlanError

__all__ = [
    "TOKEN_MAJOR_LAYOUTS",
    "BlockIds",
    "DescriptorTable",
    "Plan",
    "PlanOptions",
    "Runs",
    "build_plan",
    "chunk_size",
    "plan_pairing",
]

UIntArray = npt.NDArray[np.uint64]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class PlanOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How requests are cut into descriptors.

    Attributes:
        chunk_mode: send only the chunks of the request's last block that hold tokens.
        chunk_tokens: lower bound of the chunk size in tokens; ``None`` means one
            prefill step. Below one prefill step is rejected.
        prefill_step_tokens: tokens of one prefill step (``max_num_batched_tokens``).
        swa_window_mode: send only the window granules of sliding-window groups.
        coalesce: merge runs contiguous on both sides (the default of :meth:`Plan.runs`).
    """

    chunk_mode: bool = False
    chunk_tokens: int | None = None
    prefill_step_tokens: int | None = None
    swa_window_mode: bool = False
    coalesce: bool = True

    def __post_init__(self) -> None:
        for name in ("chunk_mode", "swa_window_mode", "coalesce"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "must be a bool")
        for name in ("chunk_tokens", "prefill_step_tokens"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ConfigError(name, value, "must be a positive int or unset")
        step = self.prefill_step_tokens
        if self.chunk_tokens is not None and step is not None and self.chunk_tokens < step:
            raise ConfigError(
                "chunk_tokens",
                self.chunk_tokens,
                f"below one prefill step ({step} tokens): a step must close at most one chunk",
            )
        if self.chunk_mode and self.chunk_bound is None:
            raise ConfigError(
                "chunk_tokens", None, "chunk_mode needs chunk_tokens or prefill_step_tokens"
            )

    @property
    def chunk_bound(self) -> int | None:
        """The chunk size lower bound: ``chunk_tokens``, else one prefill step."""
        return self.chunk_tokens if self.chunk_tokens is not None else self.prefill_step_tokens


def chunk_size(range_tokens: int, chunk_tokens: int) -> int:
    """The smallest ``s >= chunk_tokens`` dividing ``range_tokens``.

    ``range_tokens`` is the token range one descriptor covers; a bound at or above it
    gives the whole range (no chunking). Example: range 16 → bound 5 gives 8, 16 gives
    16, 20 gives 16.

    Raises:
        ConfigError: ``chunk_tokens`` is not a positive int.
        PlanError: ``range_tokens`` is not a positive int.
    """
    if not _is_int(range_tokens) or range_tokens < 1:
        raise PlanError(f"range_tokens={range_tokens!r}: must be a positive int")
    if not _is_int(chunk_tokens) or chunk_tokens < 1:
        raise ConfigError("chunk_tokens", chunk_tokens, "must be a positive int")
    if chunk_tokens >= range_tokens:
        return range_tokens
    best = range_tokens
    for d in range(1, math.isqrt(range_tokens) + 1):
        if range_tokens % d == 0:
            for s in (d, range_tokens // d):
                if chunk_tokens <= s < best:
                    best = s
    return best


def _readonly(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    a.setflags(write=False)
    return a


@dataclasses.dataclass(frozen=True, eq=False)
class DescriptorTable:
    """Every descriptor of one registered cache, in a fixed order (see module doc).

    Build with :meth:`build`. ``addr`` and ``length`` are uint64, ``device`` int64;
    the arrays are read-only.
    """

    layout: KVLayout
    options: PlanOptions
    addr: UIntArray
    length: UIntArray
    device: IntArray
    chunk_tokens: int  # chunk size (tokens_per_desc when chunks are off)
    chunk_offset: int  # first id of the chunk section (len(table) when absent)
    window_offset: IntArray  # first id of each region in the window section, or -1
    _cuts: tuple[GroupCut, ...]
    _shard_start: IntArray  # first token of each region's descriptor within a block
    single_device: int | None  # the device of every descriptor, if they share one
    _key: bytes  # the shape and options two tables must share to be paired
    num_blocks: int  # blocks per region of ``layout`` (read on every plan)
    # Fast path of build_plan when every group moves every listed block whole (no
    # chunks, no window selection): per group, the first descriptor id of each region, and the bytes
    # of one block over all of the group's regions. None when some group cuts blocks.
    _whole: tuple[tuple[IntArray, int], ...] | None = None
    # The same over every group at once (the groups' rows in group order), for the
    # common request that lists the same blocks for every group.
    _whole_all: tuple[IntArray, int] | None = None
    # Posting order (kvxfer.core.merging): where regions of a group abut block by block (one
    # region per head), plans list each block's abutting regions one after the other so
    # the transport merges them. Per group, its regions' positions chain by chain, when
    # every chain has the same length ``_chain``; ``_abuts`` whenever any two abut
    # (plans the chain order cannot lay out are sorted by local address instead).
    _order: tuple[IntArray, ...] | None = None
    _chain: int = 1
    _abuts: bool = False

    @classmethod
    def build(cls, layout: KVLayout, options: PlanOptions | None = None) -> DescriptorTable:
        """Lay out all descriptors of ``layout`` for ``options``.

        Raises:
            ConfigError: the options cannot cut this layout (window not dividing the
                block size, a non-token-major ``kv_layout`` with chunks or granules).
        """
        options = options if options is not None else PlanOptions()
        tokens = layout.tokens_per_desc
        bound = options.chunk_bound
        chunk = chunk_size(tokens, bound) if options.chunk_mode and bound is not None else tokens
        cuts = group_cuts(layout, chunk, options.swa_window_mode)
        nb = layout.num_blocks
        regions = layout.regions
        base = np.array([r.base for r in regions], dtype=np.uint64)
        stride = np.array([r.stride for r in regions], dtype=np.uint64)
        block_len = np.array([r.block_len for r in regions], dtype=np.uint64)
        dev = np.array([r.device_id for r in regions], dtype=np.int64)
        # (regions, blocks) start addresses; every section offsets from these.
        starts = base[:, None] + np.arange(nb, dtype=np.uint64)[None, :] * stride[:, None]
        addrs = [starts.ravel()]
        lengths = [np.repeat(block_len, nb)]
        devices = [np.repeat(dev, nb)]
        size = len(regions) * nb

        # Rows of recurrent-state regions: their slots hold no tokens, so the chunk
        # section (cut over every region, ids by formula) lists their whole slot at
        # each chunk index; plans never select them (state groups go whole).
        state_rows = np.array([layout.groups[r.group].is_state for r in regions], dtype=np.bool_)

        def cut(rows: IntArray, unit: int) -> None:
            k = tokens // unit
            unit_bytes = np.where(
                state_rows[rows],
                block_len[rows],
                block_len[rows] // np.uint64(tokens) * np.uint64(unit),
            ).astype(np.uint64)
            steps = (
                np.arange(k, dtype=np.uint64)[None, None, :]
                * np.where(state_rows[rows], np.uint64(0), unit_bytes).astype(np.uint64)[
                    :, None, None
                ]
            )
            addrs.append((starts[rows][:, :, None] + steps).ravel())
            lengths.append(np.repeat(unit_bytes, nb * k))
            devices.append(np.repeat(dev[rows], nb * k))

        chunk_offset = size
        if chunk < tokens:
            cut(np.arange(len(regions), dtype=np.int64), chunk)
            size += len(regions) * nb * (tokens // chunk)
        window_offset = np.full(len(regions), -1, dtype=np.int64)
        for c in cuts:
            if c.section is Section.WINDOW:
                per_region = nb * (tokens // c.unit)
                window_offset[c.regions] = size + np.arange(len(c.regions)) * per_region
                cut(c.regions, c.unit)
                size += len(c.regions) * per_region
        shard = np.array([r.shard for r in regions], dtype=np.int64)
        spans = layout.token_spans
        # Every shape field KVLayout.first_difference compares, and the options, as one
        # byte string: build_plan compares it on each request (a memcmp, not a walk
        # over hundreds of region fields).
        key = msgspec.msgpack.encode(
            (
                layout.block_size,
                layout.split_axis,
                layout.num_shards,
                layout.dtype,
                layout.kv_layout,
                layout.groups,
                [(r.block_len, r.layer, r.part, r.shard, r.group, r.mem) for r in regions],
                options,
            )
        )
        whole = (
            tuple((_readonly(c.regions * nb), int(block_len[c.regions].sum())) for c in cuts)
            if not options.chunk_mode
            and all(c.section is Section.WHOLE and not c.window for c in cuts)
            else None
        )
        chains = [
            region_chains(base[c.regions], stride[c.regions], block_len[c.regions], dev[c.regions])
            for c in cuts
        ]
        abuts = any(len(chain) > 1 for group in chains for chain in group)
        orders = [chain_order(group) for group in chains]
        lengths_k = {o[1] for o in orders if o is not None}
        ordered = abuts and all(o is not None for o in orders) and len(lengths_k) == 1
        return cls(
            layout=layout,
            options=options,
            addr=_readonly(np.concatenate(addrs)),
            length=_readonly(np.concatenate(lengths)),
            device=_readonly(np.concatenate(devices)),
            chunk_tokens=chunk,
            chunk_offset=chunk_offset,
            window_offset=_readonly(window_offset),
            _cuts=cuts,
            _shard_start=_readonly(shard * tokens if spans > 1 else np.zeros_like(shard)),
            single_device=int(dev[0]) if (dev == dev[0]).all() else None,
            _key=key,
            num_blocks=nb,
            _whole=whole,
            _whole_all=(
                (_readonly(np.concatenate([rows for rows, _ in whole])), sum(b for _, b in whole))
                if whole is not None
                else None
            ),
            _order=tuple(o[0] for o in orders if o is not None) if ordered else None,
            _chain=lengths_k.pop() if ordered else 1,
            _abuts=abuts,
        )

    def __len__(self) -> int:
        return len(self.addr)

    def _unit_ids(self, sel: Pick, blocks: IntArray) -> IntArray:
        return unit_ids(
            sel,
            blocks,
            self.num_blocks,
            self.layout.tokens_per_desc,
            self.chunk_offset,
            self.window_offset,
        )


@dataclasses.dataclass(frozen=True, eq=False)
class Runs:
    """Transfer units: plan descriptors with both-side-contiguous runs merged."""

    local_addr: UIntArray
    remote_addr: UIntArray
    length: UIntArray
    local_device: IntArray
    remote_device: IntArray

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        """Total bytes moved."""
        return int(self.length.sum())


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """The descriptors one request moves, paired by position.

    Attributes:
        local_ids: ids into the local table.
        remote_ids: ids into the remote table; ``remote_ids[i]`` pairs with
            ``local_ids[i]`` and has the same length.
        nbytes: bytes moved.
        num_tokens: the request's token count.
        local_blocks: per group, the local block ids that receive bytes (for
            invalid-block reporting), in request order.
    """

    local_ids: IntArray
    remote_ids: IntArray
    nbytes: int
    num_tokens: int
    local_blocks: tuple[IntArray, ...]
    _key: bytes

    @property
    def num_descriptors(self) -> int:
        """Number of (local, remote) descriptor pairs."""
        return len(self.local_ids)

    def runs(
        self,
        local_table: DescriptorTable,
        remote_table: DescriptorTable,
        *,
        merge: bool | None = None,
    ) -> Runs:
        """Addresses of this plan, merging runs contiguous on both sides (R-DESC-6).

        Args:
            local_table: the table ``local_ids`` index.
            remote_table: the table ``remote_ids`` index.
            merge: merge contiguous runs; ``None`` follows ``options.coalesce``.

        Raises:
            PlanError: the tables are not the ones (in shape) the plan was built for.
        """
        if local_table._key != self._key or remote_table._key != self._key:
            raise PlanError("runs(): tables differ in shape from those the plan was built on")
        if merge is None:
            merge = local_table.options.coalesce
        la = local_table.addr[self.local_ids]
        ra = remote_table.addr[self.remote_ids]
        length = local_table.length[self.local_ids]
        if not merge or len(la) < 2:
            ld, rd = _devices(local_table, self.local_ids), _devices(remote_table, self.remote_ids)
            return Runs(la, ra, length, ld, rd)
        # Most caches sit on one device per side; only mixed ones pay for device gathers.
        mixed_l = None if local_table.single_device is not None else local_table.device
        mixed_r = None if remote_table.single_device is not None else remote_table.device
        starts = run_starts(
            la,
            ra,
            length,
            None if mixed_l is None else mixed_l[self.local_ids],
            None if mixed_r is None else mixed_r[self.remote_ids],
        )
        if len(starts) == len(la):  # scattered blocks: nothing to merge
            ld, rd = _devices(local_table, self.local_ids), _devices(remote_table, self.remote_ids)
            return Runs(la, ra, length, ld, rd)
        # Run lengths as differences of a running sum (cheaper than ufunc.reduceat).
        # uint64 throughout: concatenating with a Python 0 would promote to float64.
        total = np.concatenate((np.zeros(1, dtype=np.uint64), np.cumsum(length, dtype=np.uint64)))
        ends = np.append(starts[1:], len(length))
        return Runs(
            la[starts],
            ra[starts],
            total[ends] - total[starts],
            _devices(local_table, self.local_ids[starts]),
            _devices(remote_table, self.remote_ids[starts]),
        )


def _devices(table: DescriptorTable, ids: IntArray) -> IntArray:
    if table.single_device is not None:
        return np.full(len(ids), table.single_device, dtype=np.int64)
    return table.device[ids]


def build_plan(
    local: DescriptorTable,
    remote: DescriptorTable,
    local_blocks: BlockIds,
    remote_blocks: BlockIds,
    num_tokens: int,
) -> Plan:
    """Pair the descriptors that move a request's KV from ``remote`` to ``local``.

    The listed blocks are the request's *last* blocks, in order (all of them, or a
    suffix when leading blocks are already cached); ``num_tokens`` is the request's
    token count, which places the last token in the last listed block. Descriptors are
    ordered group by group, region by region, block by block.

    Args:
        local: the local table.
        remote: the remote table, built from the peer's layout with the same options.
        local_blocks: one int array (single-group layouts) or one per group.
        remote_blocks: the same shape as ``local_blocks``.
        num_tokens: tokens of the request.

    Raises:
        LayoutMismatch: the tables' layouts differ in shape.
        PlanError: group counts or lengths differ, more blocks than the tokens fill,
            or a block id that is not an integer, repeats in its group's list, or lies
            outside ``[0, num_blocks)`` (:func:`kvxfer.core.blocks.block_groups`).
    """
    _check_tables(local, remote)
    if not _is_int(num_tokens) or num_tokens < 0:
        raise PlanError(f"num_tokens={num_tokens!r}: must be a non-negative int")
    num_groups = len(local._cuts)
    mine, shared = _groups(local_blocks, num_groups, "local", local.num_blocks)
    theirs, shared_remote = _groups(remote_blocks, num_groups, "remote", remote.num_blocks)
    return _plan(local, remote, mine, theirs, shared and shared_remote, num_tokens)


def plan_pairing(local: DescriptorTable, remote: DescriptorTable, pairing: Pairing) -> Plan:
    """:func:`build_plan` for block ids checked already (:func:`kvxfer.core.blocks.pair`).

    The local ids are taken as they are; the remote ids, which came from a ticket, are
    checked here against ``remote`` (the one table that knows their range).

    Raises:
        LayoutMismatch: the tables' layouts differ in shape.
        PlanError: another group count than the tables', or a remote id outside the
            peer's table.
    """
    _check_tables(local, remote)
    mine = pairing.local
    num_groups = len(local._cuts)
    if len(mine) != num_groups:
        raise PlanError(
            f"local block_ids: {len(mine)} group(s) given, the layout has {num_groups}; "
            "pass one list per KV group"
        )
    theirs, shared_remote = _groups(pairing.remote, num_groups, "remote", remote.num_blocks)
    shared = num_groups == 1 or all(g is mine[0] for g in mine)
    return _plan(local, remote, mine, theirs, shared and shared_remote, pairing.num_tokens)


def _check_tables(local: DescriptorTable, remote: DescriptorTable) -> None:
    if local._key != remote._key:
        diff = local.layout.first_difference(remote.layout)
        if diff is not None:
            raise LayoutMismatch(*diff)
        raise PlanError("local and remote tables were built with different PlanOptions")


def _plan(
    local: DescriptorTable,
    remote: DescriptorTable,
    mine: Groups,
    theirs: Groups,
    shared: bool,
    num_tokens: int,
) -> Plan:
    """The plan of checked block ids (both entry points above)."""
    num_groups = len(local._cuts)
    needed = -(-num_tokens // local.layout.block_size)
    for g, (lb, rb) in enumerate(zip(mine, theirs)):
        if len(lb) != len(rb):
            raise PlanError(
                f"group {g}: {len(lb)} local blocks but {len(rb)} remote blocks; they must match"
            )
        if len(lb) > needed and not local._cuts[g].state:  # state slots hold no tokens
            raise PlanError(
                f"group {g}: {len(lb)} blocks given but {num_tokens} tokens fill only {needed}"
            )
    if local._whole is not None:
        return _whole_plan(local, remote, mine, theirs, shared, num_tokens)
    chunk_mode = local.options.chunk_mode
    local_ids: list[IntArray] = []
    remote_ids: list[IntArray] = []
    touched: list[IntArray] = []
    for g, (lb, rb) in enumerate(zip(mine, theirs)):
        sel = pick(
            local._cuts[g],
            local.layout,
            local._shard_start,
            local.chunk_tokens,
            len(lb),
            num_tokens,
            chunk_mode,
        )
        local_ids.append(local._unit_ids(sel, lb))
        remote_ids.append(remote._unit_ids(sel, rb))
        touched.append(sel.touched(lb))
    lids = local_ids[0] if num_groups == 1 else np.concatenate(local_ids)
    rids = remote_ids[0] if num_groups == 1 else np.concatenate(remote_ids)
    if local._abuts:
        order = address_order(local.addr[lids])
        lids, rids = lids[order], rids[order]
    return Plan(
        local_ids=lids,
        remote_ids=rids,
        nbytes=int(local.length[lids].sum()),
        num_tokens=num_tokens,
        local_blocks=tuple(touched),
        _key=local._key,
    )


def _groups(blocks: BlockIds, num_groups: int, side: str, num_blocks: int) -> tuple[Groups, bool]:
    """Validated block ids per group (:mod:`kvxfer.core.blocks`), and whether every group
    was given the very same list object (engines whose groups share a block table)."""
    if (
        num_groups > 1
        and type(blocks) in (list, tuple)
        and len(blocks) == num_groups
        and isinstance(blocks[0], np.ndarray | list | tuple | range)
        and all(b is blocks[0] for b in blocks)  # type: ignore[union-attr]
    ):
        one = block_array(blocks[0], side=side, group=0, num_blocks=num_blocks)  # type: ignore[index]
        return (one,) * num_groups, True
    return block_groups(blocks, num_groups, side=side, num_blocks=num_blocks), num_groups == 1


def _whole_plan(
    local: DescriptorTable,
    remote: DescriptorTable,
    mine: Groups,
    theirs: Groups,
    shared: bool,
    num_tokens: int,
) -> Plan:
    """build_plan when every group moves every listed block whole: a handful of numpy
    calls. It runs on every request, right after a large copy has flushed the caches,
    where each call costs microseconds."""
    whole, remote_whole = local._whole, remote._whole
    assert whole is not None and remote_whole is not None  # equal keys: both or neither
    groups = 0
    order = local._order
    if order is not None:
        return _chained_plan(local, remote, order, mine, theirs, num_tokens)
    if shared and len(whole) > 1 and local._whole_all and remote._whole_all:
        # Every group lists the same blocks (one list for the whole model, as engines
        # pass it): one broadcast over all groups' rows gives the same ids, in order.
        groups = len(whole)
        mine, theirs = mine[:1], theirs[:1]
        whole, remote_whole = (local._whole_all,), (remote._whole_all,)
    local_ids, remote_ids = [], []
    nbytes = 0
    for (rows, block_bytes), (remote_rows, _), lb, rb in zip(whole, remote_whole, mine, theirs):
        local_ids.append((rows[:, None] + lb[None, :]).ravel())
        remote_ids.append((remote_rows[:, None] + rb[None, :]).ravel())
        nbytes += block_bytes * len(lb)
    one = len(whole) == 1
    lids = local_ids[0] if one else np.concatenate(local_ids)
    rids = remote_ids[0] if one else np.concatenate(remote_ids)
    if local._abuts:  # abutting regions in chains of unequal lengths
        by_addr = address_order(local.addr[lids])
        lids, rids = lids[by_addr], rids[by_addr]
    return Plan(
        local_ids=lids,
        remote_ids=rids,
        nbytes=nbytes,
        num_tokens=num_tokens,
        # The validated arrays are read-only copies: the engine may reuse its own.
        local_blocks=mine * groups if groups else mine,
        _key=local._key,
    )


def _chained_plan(
    local: DescriptorTable,
    remote: DescriptorTable,
    order: tuple[IntArray, ...],
    mine: Groups,
    theirs: Groups,
    num_tokens: int,
) -> Plan:
    """_whole_plan for a table whose regions abut in chains of ``local._chain``: the
    ids laid out (chain, block, region of the chain), so that each block's abutting
    regions are posted one after the other (:mod:`kvxfer.core.merging`). The remote rows
    follow the local order: regions pair by position."""
    whole, remote_whole = local._whole, remote._whole
    assert whole is not None and remote_whole is not None  # equal keys: both or neither
    k = local._chain
    local_ids, remote_ids = [], []
    nbytes = 0
    for (rows, block_bytes), (remote_rows, _), rows_order, lb, rb in zip(
        whole, remote_whole, order, mine, theirs
    ):
        lr = rows[rows_order].reshape(-1, k)
        rr = remote_rows[rows_order].reshape(-1, k)
        local_ids.append((lr[:, None, :] + lb[None, :, None]).ravel())
        remote_ids.append((rr[:, None, :] + rb[None, :, None]).ravel())
        nbytes += block_bytes * len(lb)
    one = len(whole) == 1
    return Plan(
        local_ids=local_ids[0] if one else np.concatenate(local_ids),
        remote_ids=remote_ids[0] if one else np.concatenate(remote_ids),
        nbytes=nbytes,
        num_tokens=num_tokens,
        local_blocks=mine,
        _key=local._key,
    )
