"""Transfer plans across tensor-parallel sizes (R-TP-1, R-TP-2).

A consumer rank whose heads live on several producer ranks moves one request with
one :class:`~kvxfer.core.descriptors.Plan` per producer rank. :class:`TPPlanner` is built
once per set of peers (like the descriptor tables it indexes): it matches regions with
:func:`~kvxfer.core.heads.map_regions`, restricts both sides to the matched regions of each
producer rank (sub-layouts of the same shape, paired by position) and precomputes, per
sub-table, the full-table id of every sub-table id. A request is then planned per rank
with the ordinary :func:`~kvxfer.core.descriptors.build_plan` on the sub-tables, its ids
mapped back by one gather, so they index the full tables the backend prepared.

The tables are those of the pairing's cut (:func:`kvxfer.core.heads.pairing_heads`): the
peer's as derived at its handshake, the posting side's whole table or its one-head
:class:`HeadSection`, prepared once after the whole-block table
(:func:`prepared_rows`) so that plans between equal TP sizes keep their ids.

The sections map cleanly: a sub-table lists the same regions' descriptors in the same
order within each section (whole blocks, chunks, window granules), only fewer regions,
so an id moves by its region's offset in that section. The map is checked once against
the tables' addresses when the planner is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

import msgspec
import numpy as np

from kvxfer.core.block_lists import ChainLists
from kvxfer.core.blocks import BlockIds, IntArray
from kvxfer.core.descriptors import DescriptorTable, Plan, Runs, build_plan
from kvxfer.core.heads import (
    HEAD_MAJOR_LAYOUTS,
    HeadLayout,
    RegionSource,
    check_head_layouts,
    heads_per_region,
    map_regions,
    needed_ranks,
    split_heads,
)
from kvxfer.errors import ConfigError, PlanError

__all__ = ["HeadSection", "RankPlan", "TPPlanner", "head_section", "prepared_rows"]


@dataclasses.dataclass(frozen=True, eq=False)
class HeadSection:
    """A posting side's regions cut one head each, prepared after its own table.

    Attributes:
        table: the table of the one-head layout (:func:`~kvxfer.core.heads.split_heads`).
        offset: where its ids start in the prepared list (the whole table's length).
    """

    table: DescriptorTable
    offset: int


def head_section(table: DescriptorTable, heads: HeadLayout, rank: int) -> HeadSection | None:
    """The one-head section a posting side prepares next to ``table``, or None when
    there is none to make: its regions hold one head already, or their blocks are not
    head-major (a head slice would be strided; pairs needing one are refused by name).

    Raises:
        LayoutError: the layout disagrees with its head layout.
        ConfigError: the table's options cannot cut one-head regions.
    """
    layout = table.layout
    if heads.latent or heads_per_region(layout, heads, rank) == 1:
        return None
    if layout.kv_layout not in HEAD_MAJOR_LAYOUTS:
        return None
    cut = DescriptorTable.build(split_heads(layout, heads, rank, 1), table.options)
    return HeadSection(table=cut, offset=len(table))


def prepared_rows(table: DescriptorTable, section: HeadSection | None) -> DescriptorTable:
    """What the backend prepares: ``table``'s descriptors, then the section's.

    Ids below ``len(table)`` keep their meaning (plans between equal TP sizes post
    them unchanged); a section id *i* is posted as ``section.offset + i``. Only the
    rows are meant for the backend: the returned table keeps ``table``'s layout and
    sections, so it is never planned against.
    """
    if section is None:
        return table
    if section.offset != len(table):
        raise PlanError("a head section starts right after its table (internal)")
    rows = {
        name: np.concatenate((getattr(table, name), getattr(section.table, name)))
        for name in ("addr", "length", "device")
    }
    for a in rows.values():
        a.setflags(write=False)
    return dataclasses.replace(table, **rows)


@dataclasses.dataclass(frozen=True, eq=False)
class RankPlan:
    """What one producer rank supplies for one request.

    Attributes:
        rank: the producer rank.
        plan: ``local_ids`` index the consumer's full table, ``remote_ids`` the producer
            rank's full table, paired by position (each shifted by its table's offset
            in the prepared list, :class:`HeadSection`); ``local_blocks`` are the consumer
            blocks this rank writes into (the blocks to report invalid if it fails).
    """

    rank: int
    plan: Plan
    _sub: Plan
    _tables: tuple[DescriptorTable, DescriptorTable]

    def runs(self, *, merge: bool | None = None) -> Runs:
        """Addresses of this rank's descriptors, merging runs contiguous on both sides.

        Pairs are taken in local address order first, so that one-head regions of
        adjacent heads (one descriptor each per block) merge back into one run where
        both sides hold those heads contiguously.
        """
        local, _ = self._tables
        order = np.argsort(local.addr[self._sub.local_ids], kind="stable")
        ordered = dataclasses.replace(
            self._sub, local_ids=self._sub.local_ids[order], remote_ids=self._sub.remote_ids[order]
        )
        return ordered.runs(*self._tables, merge=merge)


@dataclasses.dataclass(frozen=True, eq=False)
class _RankTables:
    rank: int
    local: DescriptorTable  # the consumer's matched regions
    remote: DescriptorTable  # the producer rank's regions, paired by position
    local_ids: IntArray  # full local id of each sub-local id
    remote_ids: IntArray  # full remote id of each sub-remote id


@dataclasses.dataclass(frozen=True, eq=False)
class TPPlanner:
    """Plans a consumer rank's requests across the producer ranks holding its heads.

    Build with :meth:`build`; plan each request with :meth:`plan`.

    Attributes:
        local: the consumer rank's full table.
        remotes: the producer ranks' full tables, by rank.
        sources: per consumer region planned, the producer rank and region it reads.
        ranks: the producer ranks planned (all this consumer rank reads from, unless
            ``only`` restricted them), ascending.
    """

    local: DescriptorTable
    remotes: Mapping[int, DescriptorTable]
    sources: tuple[RegionSource, ...]
    ranks: tuple[int, ...]
    _tables: tuple[_RankTables, ...]
    _offsets: tuple[int, int] = (0, 0)
    # Chain lists by rank and side, built on first use (kvxfer.core.block_lists).
    _chains: dict[tuple[int, bool], ChainLists | None] = dataclasses.field(default_factory=dict)

    @classmethod
    def build(
        cls,
        local: DescriptorTable,
        remotes: Mapping[int, DescriptorTable],
        *,
        local_heads: HeadLayout,
        remote_heads: HeadLayout,
        local_rank: int,
        salt: int = 0,
        only: Collection[int] | None = None,
        local_offset: int = 0,
        remote_offset: int = 0,
    ) -> TPPlanner:
        """Match regions and prepare the per-rank sub-tables.

        Args:
            local: the consumer rank's table.
            remotes: the tables of (at least) the needed producer ranks, built from their
                layouts with the local table's options.
            local_heads: the consumer's TP head layout.
            remote_heads: the producer's TP head layout.
            local_rank: the consumer's TP rank.
            salt: spreads replicated heads (see :func:`~kvxfer.core.heads.source_ranks`).
            only: plan only these producer ranks' parts (push: a producer rank plans
                its own writes into a consumer rank, holding only its own table).
            local_offset, remote_offset: where ``local``'s (the remote tables') ids
                start in the list the backend prepared: a :class:`HeadSection`'s
                offset when the table is one. Added to the plans' ids only:
                ``RankPlan.runs`` and the checks work on the tables themselves.

        Raises:
            LayoutMismatch: the layouts cannot exchange heads (named field).
            LayoutError: a layout disagrees with its head layout.
            ConfigError: a needed rank's table is missing, a head slice is needed, or
                the layout has state groups (planned by ``HybridTPPlanner``).
            PlanError: a remote table was built with other options.
        """
        if any(g.is_state for g in local.layout.groups):
            # A state slot is read in sub-ranges of producer slots, which no table's
            # descriptor covers: pulls plan those as address runs.
            raise ConfigError(
                "groups",
                [g.kind.value for g in local.layout.groups],
                "Mamba/GDN state groups across TP sizes move as address runs, planned "
                "by kvxfer.core.state_tp_plan.HybridTPPlanner, not by TPPlanner",
            )
        ranks = needed_ranks(local_heads, local_rank, remote_heads, salt=salt)
        if only is not None:
            if not set(only) <= set(ranks):
                raise ConfigError(
                    "only",
                    sorted(only),
                    f"consumer rank {local_rank} reads from producer ranks {list(ranks)} only",
                )
            ranks = tuple(p for p in ranks if p in set(only))
        missing = [p for p in ranks if p not in remotes]
        if missing:
            raise ConfigError(
                "remote tables", sorted(remotes), f"need producer ranks {missing} as well"
            )
        for p in ranks:
            if remotes[p].options != local.options:
                raise PlanError(
                    f"producer rank {p}'s table was built with other PlanOptions than the "
                    "local table; build it with the local options"
                )
            check_head_layouts(
                local.layout,
                remotes[p].layout,
                local_heads=local_heads,
                remote_heads=remote_heads,
                local_rank=local_rank,
                remote_rank=p,
            )
        sources = map_regions(
            local.layout,
            {p: remotes[p].layout for p in ranks},
            local_heads=local_heads,
            remote_heads=remote_heads,
            local_rank=local_rank,
            salt=salt,
            only=ranks,
        )
        tables = []
        for p in ranks:
            mine = np.array([s.local_region for s in sources if s.rank == p], dtype=np.int64)
            theirs = np.array([s.remote_region for s in sources if s.rank == p], dtype=np.int64)
            sub_local = _restrict(local, mine)
            sub_remote = _restrict(remotes[p], theirs)
            tables.append(
                _RankTables(
                    rank=p,
                    local=sub_local,
                    remote=sub_remote,
                    local_ids=_id_map(sub_local, local, mine),
                    remote_ids=_id_map(sub_remote, remotes[p], theirs),
                )
            )
        for name, offset in (("local_offset", local_offset), ("remote_offset", remote_offset)):
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                raise ConfigError(name, offset, "must be a non-negative int")
        return cls(
            local=local,
            remotes=dict(remotes),
            sources=sources,
            ranks=ranks,
            _tables=tuple(tables),
            _offsets=(local_offset, remote_offset),
        )

    def chain_lists(self, rank: int, *, write: bool = False) -> ChainLists | None:
        """Producer rank ``rank``'s :class:`~kvxfer.core.block_lists.ChainLists` over
        this planner's sub-tables (built on the first call), or None where they would
        not post as few units as the runs of every request. ``write``: the sides
        swapped, for that producer rank writing into this consumer rank (a push), its
        own sub-table local.

        Raises:
            ConfigError: ``rank`` is not planned here.
        """
        key = (rank, write)
        if key not in self._chains:
            tables = next((t for t in self._tables if t.rank == rank), None)
            if tables is None:
                raise ConfigError("rank", rank, f"not one of the planned ranks {list(self.ranks)}")
            mine, theirs = (tables.remote, tables.local) if write else (tables.local, tables.remote)
            self._chains[key] = ChainLists.build(mine, theirs)
        return self._chains[key]

    def plan(
        self, local_blocks: BlockIds, remote_blocks: BlockIds, num_tokens: int
    ) -> tuple[RankPlan, ...]:
        """One plan per producer rank for a request, in rank order.

        The producer ranks of one TP group share block ids, so ``remote_blocks`` serve
        every rank. Arguments and errors are those of
        :func:`~kvxfer.core.descriptors.build_plan`.
        """
        out = []
        lo, ro = self._offsets
        for t in self._tables:
            sub = build_plan(t.local, t.remote, local_blocks, remote_blocks, num_tokens)
            full = dataclasses.replace(
                sub,
                local_ids=t.local_ids[sub.local_ids] + lo if lo else t.local_ids[sub.local_ids],
                remote_ids=t.remote_ids[sub.remote_ids] + ro
                if ro
                else t.remote_ids[sub.remote_ids],
            )
            out.append(RankPlan(rank=t.rank, plan=full, _sub=sub, _tables=(t.local, t.remote)))
        return tuple(out)


def _restrict(table: DescriptorTable, regions: IntArray) -> DescriptorTable:
    """The table of ``table``'s layout restricted to ``regions`` (same options)."""
    layout = msgspec.structs.replace(
        table.layout, regions=tuple(table.layout.regions[int(i)] for i in regions)
    )
    return DescriptorTable.build(layout, table.options)


def _id_map(sub: DescriptorTable, full: DescriptorTable, regions: IntArray) -> IntArray:
    """The full-table id of every id of ``sub`` (``sub`` region j is full region
    ``regions[j]``), section by section; checked against the addresses."""
    nb = sub.num_blocks
    n = len(regions)
    out: IntArray
    block = np.arange(nb, dtype=np.int64)
    parts = [(regions[:, None] * nb + block[None, :]).ravel()]
    tokens = sub.layout.tokens_per_desc
    if sub.chunk_tokens < tokens:
        k = tokens // sub.chunk_tokens
        per_region = np.arange(nb * k, dtype=np.int64)
        parts.append(full.chunk_offset + (regions[:, None] * nb * k + per_region[None, :]).ravel())
    out = np.concatenate(parts).astype(np.int64)
    window = sub.window_offset
    if (window >= 0).any():
        # Window regions follow each other: a region's extent ends where the next
        # region's starts (the last one at the end of the table).
        starts = np.sort(window[window >= 0])
        ends = np.append(starts[1:], len(sub))
        extent = dict(zip(starts.tolist(), (ends - starts).tolist()))
        tail = np.empty(len(sub) - len(out), dtype=np.int64)
        for j in range(n):
            first = int(window[j])
            if first < 0:
                continue
            size = extent[first]
            tail[first - len(out) : first - len(out) + size] = int(
                full.window_offset[regions[j]]
            ) + np.arange(size, dtype=np.int64)
        out = np.concatenate((out, tail))
    if len(out) != len(sub) or not (
        np.array_equal(full.addr[out], sub.addr) and np.array_equal(full.length[out], sub.length)
    ):
        raise PlanError("sub-table ids do not map onto the full table (internal)")
    out.setflags(write=False)
    return out
