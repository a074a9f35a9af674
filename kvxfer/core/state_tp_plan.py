"""Pulls across TP sizes of hybrid models: KV heads and state slots, as address runs.

A hybrid model (attention layers beside Mamba2 / Gated DeltaNet layers) moves two
kinds of bytes per request: attention KV, split by KV heads
(:class:`~kvxfer.core.tp_plan.TPPlanner`), and state slots, split by their own units
(:func:`~kvxfer.core.state_plan.plan_slots`). :class:`HybridTPPlanner` plans both for
one consumer rank and hands each producer rank's part over as one list of address
runs (:class:`~kvxfer.core.descriptors.Runs`, posted with ``Backend.post_runs``): a
state unit's bytes are a sub-range of a slot, which no prepared descriptor of a
whole-slot table covers, and addresses need no table of their own per pairing.

The attention part is planned on the layouts without their state groups (groups
renumbered), whose regions are cut to the heads both sides share (head-major caches;
a token-major cache that would need a cut is refused by name, as any pull across TP
sizes is).

This consumer rank reads its state units from the producer ranks holding them, by
the rule of KV heads; where that names a producer rank holding none of its KV heads
(KV heads replicated over the producer's ranks while state units are not), the pull
is refused by name: the producer group's release counting follows the KV heads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import msgspec
import numpy as np

from kvxfer.core.blocks import Groups, IntArray
from kvxfer.core.descriptors import DescriptorTable, PlanOptions, Runs
from kvxfer.core.heads import TPRank, heads_per_region, needed_ranks, split_heads
from kvxfer.core.layout import KVLayout
from kvxfer.core.state_plan import (
    StatePiece,
    join_runs,
    plan_slots,
    slot_runs,
    state_source_ranks,
)
from kvxfer.core.tp_plan import TPPlanner
from kvxfer.errors import ConfigError

__all__ = ["HybridTPPlanner", "RunsPlan", "attention_part"]


def attention_part(layout: KVLayout) -> tuple[KVLayout | None, tuple[int, ...]]:
    """``layout`` without its state groups, and the kept groups' indices in it.

    The regions keep their order; ``Region.group`` is renumbered to the kept groups.
    None when every group is a state group.
    """
    kept = tuple(g for g, group in enumerate(layout.groups) if not group.is_state)
    if not kept:
        return None, ()
    index = {g: i for i, g in enumerate(kept)}
    regions = tuple(
        msgspec.structs.replace(r, group=index[r.group]) for r in layout.regions if r.group in index
    )
    groups = tuple(layout.groups[g] for g in kept)
    return msgspec.structs.replace(layout, regions=regions, groups=groups), kept


@dataclasses.dataclass(frozen=True, eq=False)
class RunsPlan:
    """What one producer rank supplies for one request, as address runs.

    Attributes:
        rank: the producer rank.
        runs: local and remote addresses paired by position, with lengths.
        local_blocks: per group of the full layout, the local blocks (state slots)
            this rank writes into: the blocks to report invalid if it fails.
    """

    rank: int
    runs: Runs
    local_blocks: tuple[IntArray, ...]

    @property
    def nbytes(self) -> int:
        """Bytes this rank's part moves."""
        return self.runs.nbytes


@dataclasses.dataclass(frozen=True, eq=False)
class HybridTPPlanner:
    """Plans a consumer rank's pulls of a hybrid model across TP sizes.

    Build with :meth:`build` (once per set of peers and replica choice); plan each
    request with :meth:`plan`.

    Attributes:
        local: the consumer rank's layout.
        remotes: the producer ranks' layouts, by rank.
        ranks: the producer ranks read, ascending.
        pieces: the state slot pieces (:func:`~kvxfer.core.state_plan.plan_slots`).
    """

    local: KVLayout
    remotes: Mapping[int, KVLayout]
    ranks: tuple[int, ...]
    pieces: tuple[StatePiece, ...]
    _attention: TPPlanner | None
    _kv_groups: tuple[int, ...]

    @classmethod
    def build(
        cls,
        local: KVLayout,
        remotes: Mapping[int, KVLayout],
        *,
        options: PlanOptions,
        local_tp: TPRank,
        remote_tp_size: int,
        salt: int = 0,
        only: int | None = None,
    ) -> HybridTPPlanner:
        """Match KV heads and state units of ``local`` with the producer ranks'.

        Args:
            local: the consumer rank's layout (as registered, addresses included).
            remotes: the layouts of (at least) the producer ranks read; with ``only``,
                that rank's alone.
            options: the plan options of the attention part.
            local_tp: the consumer's TP identity, with its :attr:`TPRank.state`.
            remote_tp_size: the producer's TP size.
            salt: spreads replicated heads and units (a request's CRC-32).
            only: plan producer rank ``only``'s part alone (a push: that producer rank
                writes it, and knows no other rank's layout); its ranks are then
                ``(only,)``, or none where this consumer rank reads nothing from it.

        Raises:
            ConfigError: no state split stated, a TP size it cannot serve, a needed
                rank missing, or state units on a producer rank that holds none of
                this rank's KV heads.
            LayoutMismatch, LayoutError: the layouts cannot exchange heads or state.
        """
        split = local_tp.state
        if split is None:
            raise ConfigError(
                "tp.state",
                None,
                "a pull of state groups across TP sizes needs how TP splits the state "
                "slots (TPRank.state)",
            )
        producer = local_tp.heads.for_tp_size(remote_tp_size)
        rank = local_tp.rank
        kv_local, kv_groups = attention_part(local)
        state_ranks = state_source_ranks(
            split, local_tp.heads.tp_size, rank, remote_tp_size, salt=salt
        )
        kv_ranks = needed_ranks(local_tp.heads, rank, producer, salt=salt) if kv_local else ()
        extra = sorted(set(state_ranks) - set(kv_ranks)) if kv_local else []
        if extra:
            raise ConfigError(
                "tp_size",
                remote_tp_size,
                f"consumer rank {rank} of tp_size={local_tp.heads.tp_size} reads state "
                f"units from producer ranks {extra}, which hold none of its KV heads "
                f"({producer.describe()}): pulls whose state and KV heads come from "
                "different producer ranks are not served; pair TP sizes the model's "
                "KV heads split without replication",
            )
        ranks = tuple(sorted(set(state_ranks) | set(kv_ranks)))
        if only is not None:
            ranks = tuple(p for p in ranks if p == only)
            kv_ranks = tuple(p for p in kv_ranks if p == only)
        missing = [p for p in ranks if p not in remotes]
        if missing:
            raise ConfigError("remote layouts", sorted(remotes), f"need producer ranks {missing}")
        sources = dict(remotes)
        if only is not None and only in remotes:
            # The producer ranks of one instance share one layout but for addresses:
            # the others stand in for the checks, and their pieces are dropped.
            sources = {p: remotes.get(p, remotes[only]) for p in state_ranks} | {
                only: remotes[only]
            }
        pieces = plan_slots(
            local,
            sources,
            split=split,
            local_tp=local_tp.heads.tp_size,
            local_rank=rank,
            remote_tp=remote_tp_size,
            salt=salt,
        )
        if only is not None:
            pieces = tuple(p for p in pieces if p.rank == only)
        attention = None
        if kv_local is not None and kv_ranks:
            kv_remotes = {p: attention_part(remotes[p])[0] for p in kv_ranks}
            per = math.gcd(
                heads_per_region(kv_local, local_tp.heads, rank),
                *(heads_per_region(lay, producer, p) for p, lay in kv_remotes.items() if lay),
            )
            cut_local = split_heads(kv_local, local_tp.heads, rank, per)
            tables = {}
            for p, lay in kv_remotes.items():
                assert lay is not None  # check_state_pair: the same groups on both sides
                tables[p] = DescriptorTable.build(split_heads(lay, producer, p, per), options)
            attention = TPPlanner.build(
                DescriptorTable.build(cut_local, options),
                tables,
                local_heads=local_tp.heads,
                remote_heads=producer,
                local_rank=rank,
                salt=salt,
                only=None if only is None else kv_ranks,
            )
        return cls(
            local=local,
            remotes=dict(remotes) if only is None else {only: remotes[only]},
            ranks=ranks,
            pieces=pieces,
            _attention=attention,
            _kv_groups=kv_groups,
        )

    def plan(self, local: Groups, remote: Groups, num_tokens: int) -> tuple[RunsPlan, ...]:
        """Each producer rank's part of a request, in rank order.

        ``local`` and ``remote`` are the request's paired block ids per group of the
        full layout (:func:`kvxfer.core.blocks.pair`): a state group's lists are its
        slots, paired by position.

        Raises:
            PlanError: as :func:`~kvxfer.core.descriptors.build_plan`, or slots out
                of range.
        """
        groups = len(self.local.groups)
        empty = np.zeros(0, dtype=np.int64)
        runs: dict[int, list[Runs]] = {p: [] for p in self.ranks}
        touched: dict[int, list[IntArray]] = {p: [empty] * groups for p in self.ranks}
        if self._attention is not None:
            kv = self._kv_groups
            for rp in self._attention.plan(
                [local[g] for g in kv], [remote[g] for g in kv], num_tokens
            ):
                runs[rp.rank].append(rp.runs(merge=True))
                for i, g in enumerate(kv):
                    touched[rp.rank][g] = rp.plan.local_blocks[i]
        for g, group in enumerate(self.local.groups):
            if not group.is_state:
                continue
            mine = tuple(p for p in self.pieces if self.local.regions[p.local_region].group == g)
            for p, part in slot_runs(mine, self.local, self.remotes, local[g], remote[g]).items():
                runs[p].append(part)
                touched[p][g] = local[g]
        return tuple(
            RunsPlan(rank=p, runs=join_runs(*runs[p]), local_blocks=tuple(touched[p]))
            for p in self.ranks
            if runs[p]
        )
