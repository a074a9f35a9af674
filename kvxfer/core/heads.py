"""The algebra of KV heads across tensor-parallel ranks (R-TP-1, R-TP-2, R-TP-4).

A tensor-parallel (TP) group of ``tp_size`` ranks splits a model's ``num_kv_heads``
KV heads between its ranks (:class:`HeadLayout`):

* ``num_kv_heads >= tp_size``: rank *r* holds the ``num_kv_heads / tp_size``
  consecutive heads starting at ``r * num_kv_heads / tp_size``;
* ``num_kv_heads < tp_size``: every head is replicated on ``tp_size / num_kv_heads``
  consecutive ranks, rank *r* holding head ``r // replicas`` (vLLM's rule);
* latent KV (MLA-style, ``latent=True``): one "head" that every rank holds.

A rank's :class:`~kvxfer.core.layout.KVLayout` says which global heads each region holds:
a region covers heads ``[Region.head, Region.head + heads_per_region)`` where
``heads_per_region`` is the rank's heads divided by its regions per (layer, part,
shard) — one region per (layer, K/V, head) gives 1, one region per layer gives all
of the rank's heads (:func:`region_heads`).

A consumer rank reads each of its heads from exactly one producer rank
(:func:`source_ranks`): a head the producer holds once comes from that rank; a
replicated head comes from replica ``(i + salt) mod replicas``, *i* being the
consumer rank's index among the consumer ranks holding that head. Equal TP sizes
thus pair rank *r* with rank *r*, and the consumer ranks that share a head spread
over the producer ranks that hold it; ``salt`` (e.g. per request) spreads a single
consumer's reads. A head is never split by layer between producer ranks: each
consumer rank talks to as few producer ranks as possible, and one failed producer
rank invalidates whole heads.

Planning (:class:`kvxfer.core.tp_plan.TPPlanner`) matches every consumer region with the
producer region holding the *same* heads of the same (layer, part, shard), restricts both layouts to
the matched regions per producer rank, builds ordinary plans
(:func:`~kvxfer.core.descriptors.build_plan`) on those sub-layouts and maps the ids back to
the full tables (whole-block, chunk and window sections), so the ids index the tables
the backend prepared.

**Head slices are cut at pairing, never asked of the operator.** A head-major (HND)
block holds each head's bytes contiguously, so a region of *k* heads is also *k*
regions of one head (:func:`split_heads`: same memory, no new registration). Which cut
a pair needs follows from the two layouts (:func:`pairing_heads`): each side is
planned at the coarsest number of heads per region both sides share, so prefill TP1
and decode TP2 of a model of 8 KV heads pair at 4 heads per region (the decode
rank's whole region: as many descriptors as between equal TP sizes), and only the
side that must be cut is. The consumer derives the producer's cut table from its
layout at the handshake (kvxfer._agent.peers); the side that posts (a pull's consumer, a
push's producer) cannot prepare its own table per peer, so it prepares its regions
one head each once, next to its whole-block table (kvxfer._agent.local).

**Strided head slices are refused.** When the two sides' regions hold different head sets
(a consumer region of one head, a producer region of four), the consumer would read a
slice of a producer block. In a token-major (NHD) block a head slice is strided: one
descriptor per token per slice (``block_size`` descriptors per block per region
instead of one, i.e. 16x–64x the descriptors and as many small RDMA reads). That, and
a head-major slice the pairing did not cut (a table built without
:func:`pairing_heads`), are refused with a :class:`~kvxfer.errors.ConfigError` asking
for one region per (layer, K/V, head) (``Region.head``), which is exact, costs one
descriptor per head per block, and whose consecutive heads merge again in
:meth:`kvxfer.core.tp_plan.RankPlan.runs` when both sides hold them contiguously (vLLM's own NIXL
connector likewise asks for an HND cache across TP sizes).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from typing import Any

import msgspec

from kvxfer.core.layout import KVLayout, KVPart, SplitAxis
from kvxfer.core.state_split import StateSplit
from kvxfer.errors import ConfigError, LayoutError, LayoutMismatch

__all__ = [
    "HEAD_MAJOR_LAYOUTS",
    "HeadLayout",
    "RegionSource",
    "TPRank",
    "check_head_layouts",
    "heads_per_region",
    "map_regions",
    "needed_ranks",
    "pairing_heads",
    "peer_ranks",
    "place_heads",
    "reader_ranks",
    "region_heads",
    "source_choices",
    "source_ranks",
    "split_heads",
]

#: (layer, part, shard): what a region holds of a block, heads aside.
_Key = tuple[int, KVPart, int]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class HeadLayout(msgspec.Struct, frozen=True, kw_only=True):
    """How a TP group splits the model's KV heads between its ranks.

    Attributes:
        num_kv_heads: KV heads of the model (all ranks together); 1 for latent KV.
        tp_size: ranks of the tensor-parallel group.
        latent: latent KV (MLA-style): one head every rank holds.
    """

    num_kv_heads: int
    tp_size: int = 1
    latent: bool = False

    def __post_init__(self) -> None:
        for key in ("num_kv_heads", "tp_size"):
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                raise ConfigError(key, value, "must be a positive int")
        if not isinstance(self.latent, bool):
            raise ConfigError("latent", self.latent, "must be a bool")
        n, tp = self.num_kv_heads, self.tp_size
        if self.latent and n != 1:
            raise ConfigError(
                "num_kv_heads", n, "latent (MLA) KV is one head shared by every rank: must be 1"
            )
        if (n % tp if n >= tp else tp % n) != 0:
            raise ConfigError(
                "tp_size",
                tp,
                f"must divide num_kv_heads ({n}: each rank holds num_kv_heads / tp_size "
                "heads) or be a multiple of it (each head replicated on tp_size / "
                "num_kv_heads ranks)",
            )

    @property
    def heads_per_rank(self) -> int:
        """KV heads one rank holds."""
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def replicas(self) -> int:
        """Ranks holding each head (1 unless heads are fewer than ranks)."""
        return max(1, self.tp_size // self.num_kv_heads)

    def heads_of(self, rank: int) -> range:
        """The global heads rank ``rank`` holds.

        Raises:
            ConfigError: ``rank`` is not in ``[0, tp_size)``.
        """
        self._check("tp_rank", rank, self.tp_size)
        if self.replicas > 1:
            head = rank // self.replicas
            return range(head, head + 1)
        per = self.heads_per_rank
        return range(rank * per, (rank + 1) * per)

    def ranks_of(self, head: int) -> range:
        """The ranks holding global head ``head``.

        Raises:
            ConfigError: ``head`` is not in ``[0, num_kv_heads)``.
        """
        self._check("head", head, self.num_kv_heads)
        if self.replicas > 1:
            return range(head * self.replicas, (head + 1) * self.replicas)
        rank = head // self.heads_per_rank
        return range(rank, rank + 1)

    def describe(self) -> str:
        """The layout in engine terms, for messages."""
        kind = "latent KV" if self.latent else f"num_kv_heads={self.num_kv_heads}"
        if self.replicas > 1:
            return f"{kind} tp_size={self.tp_size} (each head on {self.replicas} ranks)"
        return f"{kind} tp_size={self.tp_size} ({self.heads_per_rank} heads per rank)"

    def for_tp_size(self, tp_size: int) -> HeadLayout:
        """The same model's heads split over ``tp_size`` ranks (a peer's, from its
        ticket's ``tp_size``).

        Raises:
            ConfigError: ``tp_size`` cannot split this many heads (named rule).
        """
        return HeadLayout(num_kv_heads=self.num_kv_heads, tp_size=tp_size, latent=self.latent)

    @staticmethod
    def _check(key: str, value: Any, bound: int) -> None:
        if not _is_int(value) or not 0 <= value < bound:
            raise ConfigError(key, value, f"must be an int in [0, {bound})")


class TPRank(msgspec.Struct, frozen=True, kw_only=True):
    """One rank of a TP group, as the handshake carries it.

    Attributes:
        heads: the group's head layout.
        rank: this rank, in ``[0, heads.tp_size)``.
        state: how TP splits the model's recurrent-state slots (Mamba2 / GDN layers),
            where it has any and the engine says (None: not stated; state groups
            then pair between equal TP sizes only).
    """

    heads: HeadLayout
    rank: int = 0
    # Added with state pulls across TP sizes (issue 53): defaulted, so an older peer's
    # TPRank decodes as "not stated".
    state: StateSplit | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.heads, HeadLayout):
            raise ConfigError("heads", self.heads, "must be a HeadLayout")
        if self.state is not None:
            if not isinstance(self.state, StateSplit):
                raise ConfigError("state", self.state, "must be a StateSplit")
            self.state.check(self.heads.tp_size)
        if not _is_int(self.rank) or not 0 <= self.rank < self.heads.tp_size:
            raise ConfigError(
                "tp_rank", self.rank, f"must be an int in [0, tp_size={self.heads.tp_size})"
            )


def _check_pair(local: HeadLayout, remote: HeadLayout) -> None:
    """Raise LayoutMismatch when two TP groups do not run the same heads."""
    if local.latent != remote.latent:
        raise LayoutMismatch("latent (MLA KV)", local.latent, remote.latent)
    if local.num_kv_heads != remote.num_kv_heads:
        raise LayoutMismatch(
            "num_kv_heads (model, all ranks)", local.num_kv_heads, remote.num_kv_heads
        )


def source_ranks(
    consumer: HeadLayout, consumer_rank: int, producer: HeadLayout, *, salt: int = 0
) -> dict[int, int]:
    """For each head of ``consumer_rank``, the one producer rank it is read from.

    The rule (module doc): replica ``(i + salt) mod replicas`` of the head, *i* the
    consumer rank's index among the consumer ranks holding it.

    Raises:
        LayoutMismatch: the groups run different heads (count or latent).
        ConfigError: a bad rank or salt.
    """
    _check_pair(consumer, producer)
    if not _is_int(salt) or salt < 0:
        raise ConfigError("salt", salt, "must be a non-negative int")
    consumer.heads_of(consumer_rank)  # a bad rank is named before the cache sees it
    # Only salt mod replicas picks a replica: a request's salt (a CRC) maps to one of
    # a few cached answers, so a pull pays no per-head scan (issue 27).
    return dict(_sources(consumer, int(consumer_rank), producer, int(salt) % producer.replicas))


@functools.lru_cache(maxsize=256)
def _sources(
    consumer: HeadLayout, consumer_rank: int, producer: HeadLayout, salt: int
) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for head in consumer.heads_of(consumer_rank):
        holders = producer.ranks_of(head)
        i = consumer_rank - consumer.ranks_of(head).start
        out.append((head, holders[(i + salt) % len(holders)]))
    return tuple(out)


def source_choices(
    consumer: HeadLayout, consumer_rank: int, producer: HeadLayout, *, limit: int = 8
) -> list[tuple[int, dict[int, int]]]:
    """Each distinct :func:`source_ranks` answer for ``consumer_rank``, with a salt that
    gives it: one unless the producer replicates heads, at most ``limit``. What an
    agent prepares ahead of a rank's first request (a request's salt picks one).

    Raises:
        LayoutMismatch, ConfigError: as :func:`source_ranks`.
    """
    choices: dict[tuple[tuple[int, int], ...], tuple[int, dict[int, int]]] = {}
    for salt in range(min(producer.replicas, limit)):
        sources = source_ranks(consumer, consumer_rank, producer, salt=salt)
        choices.setdefault(tuple(sorted(sources.items())), (salt, sources))
    return list(choices.values())


def peer_ranks(heads: HeadLayout, rank: int, peer_tp_size: int, *, reads: bool) -> tuple[int, ...]:
    """The ranks of a peer group of ``peer_tp_size`` ranks (same model) that ``rank``
    of ``heads`` ever transfers with, whatever a request's salt picks, ascending: the
    producer ranks it reads from (``reads``: a pull's consumer rank) or the consumer
    ranks it writes into (a push's producer rank). Equal TP sizes pair rank with rank.

    Raises:
        ConfigError: ``peer_tp_size`` cannot split the heads, or a bad rank.
    """
    heads.heads_of(rank)  # a bad rank is named first
    peer = heads.for_tp_size(peer_tp_size)
    if peer.tp_size == heads.tp_size:
        return (rank,)
    if reads:  # every replica choice, however many (an agent prepares at most 8)
        choices = source_choices(heads, rank, peer, limit=peer.replicas)
        got = {p for _, sources in choices for p in sources.values()}
    else:
        got = {
            c for salt in range(heads.replicas) for c in reader_ranks(heads, rank, peer, salt=salt)
        }
    return tuple(sorted(got))


def needed_ranks(
    consumer: HeadLayout, consumer_rank: int, producer: HeadLayout, *, salt: int = 0
) -> tuple[int, ...]:
    """The producer ranks ``consumer_rank`` reads from (handshakes with), ascending."""
    return tuple(sorted(set(source_ranks(consumer, consumer_rank, producer, salt=salt).values())))


def reader_ranks(
    producer: HeadLayout, producer_rank: int, consumer: HeadLayout, *, salt: int = 0
) -> tuple[int, ...]:
    """The consumer ranks that read from ``producer_rank`` (push: the ranks it writes
    into), ascending: the inverse of :func:`needed_ranks`."""
    producer.heads_of(producer_rank)  # a bad rank is named before the scan
    _check_pair(consumer, producer)
    if not _is_int(salt) or salt < 0:
        raise ConfigError("salt", salt, "must be a non-negative int")
    return _readers(producer, int(producer_rank), consumer, int(salt) % producer.replicas)


@functools.lru_cache(maxsize=256)
def _readers(
    producer: HeadLayout, producer_rank: int, consumer: HeadLayout, salt: int
) -> tuple[int, ...]:
    return tuple(
        c
        for c in range(consumer.tp_size)
        if producer_rank in needed_ranks(consumer, c, producer, salt=salt)
    )


def _keys(layout: KVLayout) -> dict[_Key, list[int]]:
    """Region indices per (layer, part, shard), in table order: attention regions
    only (a state group's regions are split by their own units,
    :mod:`kvxfer.core.state_split`, and hold no KV heads)."""
    out: dict[_Key, list[int]] = {}
    for i, r in enumerate(layout.regions):
        if layout.groups[r.group].is_state:
            continue
        out.setdefault((r.layer, r.part, r.shard), []).append(i)
    return out


def _per_region(
    layout: KVLayout, heads: HeadLayout, rank: int
) -> tuple[dict[_Key, list[int]], int]:
    """Regions per key and heads per region, checked against ``heads`` at ``rank``."""
    where = f"rank {rank} of {heads.describe()}"
    if layout.split_axis is SplitAxis.HEAD and layout.num_shards > 1:
        raise LayoutError(
            f"KVLayout.num_shards={layout.num_shards}: {where}: head-split shards do not "
            "say which global heads they hold; describe one region per head (Region.head)"
        )
    keys = _keys(layout)
    counts = {len(v) for v in keys.values()}
    per_rank = heads.heads_per_rank
    count = counts.pop() if len(counts) == 1 else 0
    if count == 0 or per_rank % count:
        raise LayoutError(
            f"KVLayout.regions: {where}: holds {per_rank} heads, but its (layer, part, "
            f"shard) have {sorted(len(v) for v in keys.values())} regions each: each must "
            f"hold the same number of heads, dividing {per_rank}"
        )
    per = per_rank // count
    if layout.num_kv_heads and layout.num_kv_heads != per:
        raise LayoutError(
            f"KVLayout.num_kv_heads={layout.num_kv_heads}: {where} holds {per_rank} heads "
            f"in {count} region(s) per (layer, part, shard): {per} per region"
        )
    for i, r in enumerate(layout.regions):
        if layout.groups[r.group].is_state:
            continue
        if r.block_len % (per * layout.tokens_per_desc):
            raise LayoutError(
                f"KVLayout.regions[{i}].block_len={r.block_len}: not {per} head(s) x "
                f"{layout.tokens_per_desc} tokens of whole bytes"
            )
    return keys, per


def region_heads(layout: KVLayout, heads: HeadLayout, rank: int) -> tuple[range, ...]:
    """The global heads each region of rank ``rank``'s layout holds, in table order.

    Every (layer, part, shard) must have the same number of regions, their heads
    (``Region.head``, global) consecutive runs covering exactly the rank's heads. A
    state group's region holds no KV heads: ``range(0)``.

    Raises:
        LayoutError: naming the region and field that break the rule.
    """
    keys, per = _per_region(layout, heads, rank)
    mine = heads.heads_of(rank)
    out: list[range] = [range(0)] * len(layout.regions)
    for (layer, part, shard), idx in keys.items():
        starts = sorted(layout.regions[i].head for i in idx)
        expected = list(range(mine.start, mine.stop, per))
        if starts != expected:
            bad = next(i for i in idx if layout.regions[i].head not in expected)
            raise LayoutError(
                f"KVLayout.regions[{bad}].head={layout.regions[bad].head}: rank {rank} of "
                f"{heads.describe()} holds heads [{mine.start}, {mine.stop}); the regions of "
                f"layer {layer} {part.name} shard {shard} must start at global heads "
                f"{expected} (place_heads() turns rank-local head indices global)"
            )
        for i in idx:
            h = layout.regions[i].head
            out[i] = range(h, h + per)
    return tuple(out)


def place_heads(layout: KVLayout, heads: HeadLayout, rank: int) -> KVLayout:
    """``layout`` with rank-local ``Region.head`` indices made global.

    An engine describing its own cache knows head *h* of its tensor, not which global
    head that is: ``Region.head`` in ``[0, heads_per_rank)`` is shifted to the rank's
    first head. A layout already global is returned as it is.

    Raises:
        LayoutError: the heads are neither the rank's local nor its global ones.
    """
    _, per = _per_region(layout, heads, rank)
    first = heads.heads_of(rank).start
    kv = [not layout.groups[r.group].is_state for r in layout.regions]
    local = all(
        r.head < heads.heads_per_rank and r.head % per == 0
        for r, is_kv in zip(layout.regions, kv, strict=True)
        if is_kv
    )
    if first == 0 or not local:
        region_heads(layout, heads, rank)  # global already, or raise naming the region
        return layout
    regions = tuple(
        msgspec.structs.replace(r, head=r.head + first) if is_kv else r
        for r, is_kv in zip(layout.regions, kv, strict=True)
    )
    placed = msgspec.structs.replace(layout, regions=regions)
    region_heads(placed, heads, rank)
    return placed


#: In-block orders whose blocks hold each head's bytes contiguously (a head slice of a
#: block is one range): vLLM's HND device caches and its CPU cache.
HEAD_MAJOR_LAYOUTS = frozenset({"HND"})


def heads_per_region(layout: KVLayout, heads: HeadLayout, rank: int) -> int:
    """How many global heads each region of rank ``rank``'s layout holds.

    Raises:
        LayoutError: the layout disagrees with its head layout (see :func:`region_heads`).
    """
    region_heads(layout, heads, rank)
    return _per_region(layout, heads, rank)[1]


def split_heads(layout: KVLayout, heads: HeadLayout, rank: int, per: int) -> KVLayout:
    """``layout`` with every region cut into regions of ``per`` heads each.

    Pure address arithmetic over the same memory (nothing new to register): in a
    head-major block head *h* of a region whose heads start at *h0* occupies bytes
    ``[(h - h0) * b, (h - h0 + 1) * b)`` of each block, ``b`` the region's bytes per
    head per block, and the stride between blocks stays the region's. The pieces of
    one region follow each other in table order, with their first global head as
    ``Region.head``. A layout already at ``per`` heads per region is returned as it is.

    Raises:
        ConfigError: ``per`` does not divide the regions' heads, or the blocks are not
            head-major (a head slice of a token-major block is strided: one descriptor
            per token).
        LayoutError: the layout disagrees with its head layout.
    """
    have = heads_per_region(layout, heads, rank)
    if not _is_int(per) or per < 1 or have % per:
        raise ConfigError("per", per, f"must divide the {have} head(s) each region holds")
    if per == have:
        return layout
    if layout.kv_layout not in HEAD_MAJOR_LAYOUTS:
        raise ConfigError(
            "kv_layout",
            layout.kv_layout,
            f"regions of {have} heads cut into {per}-head pieces need head-major blocks "
            f"({sorted(HEAD_MAJOR_LAYOUTS)}): a head slice of a token-major block is "
            f"strided, {layout.tokens_per_desc} descriptors per block per region",
        )
    pieces = have // per
    regions = []
    for r in layout.regions:
        if layout.groups[r.group].is_state:  # no KV heads: kept whole
            regions.append(r)
            continue
        size = r.block_len // pieces
        for j in range(pieces):
            regions.append(
                msgspec.structs.replace(
                    r, base=r.base + j * size, block_len=size, head=r.head + j * per
                )
            )
    return msgspec.structs.replace(
        layout,
        regions=tuple(regions),
        num_kv_heads=per if layout.num_kv_heads else 0,
    )


def pairing_heads(own: int, peer: int) -> int:
    """The heads per region a transfer between two ranks is planned at, given the heads
    per region of the posting side (``own``: its prepared table) and of its peer.

    The peer's table is derived at the handshake, so it can be cut to anything
    (:func:`split_heads`); the posting side has its whole regions and, where they hold
    several heads of a head-major cache, their one-head pieces. So: its whole regions
    when their heads divide the peer's (every such region then lies inside one peer
    region: heads are aligned runs), else one head.
    """
    for name, value in (("own", own), ("peer", peer)):
        if not _is_int(value) or value < 1:
            raise ConfigError(name, value, "must be a positive int")
    return own if peer % own == 0 else 1


def check_head_layouts(
    local: KVLayout,
    remote: KVLayout,
    *,
    local_heads: HeadLayout,
    remote_heads: HeadLayout,
    local_rank: int = 0,
    remote_rank: int = 0,
) -> None:
    """Raise unless two ranks of two TP groups can exchange heads.

    The compatibility check across TP sizes: instead of requiring the same regions on
    both sides (:func:`~kvxfer.core.compat.check_layout`), it requires the same model heads,
    the same block shape and, per (layer, part, shard), the same bytes per head.
    Addresses, strides, block counts, TP sizes and how many heads a region holds may
    differ.

    Raises:
        LayoutMismatch: naming the first differing field in engine terms and both values.
        LayoutError: a layout disagrees with its own head layout (see :func:`region_heads`).
    """
    if local.block_size != remote.block_size:
        raise LayoutMismatch("block_size", local.block_size, remote.block_size)
    _check_pair(local_heads, remote_heads)
    for name in ("dtype", "split_axis", "num_shards", "groups"):
        mine, theirs = getattr(local, name), getattr(remote, name)
        if mine != theirs:
            raise LayoutMismatch(name, mine, theirs)
    if local.head_dim and remote.head_dim and local.head_dim != remote.head_dim:
        raise LayoutMismatch("head_dim", local.head_dim, remote.head_dim)
    try:
        mine_keys, mine_per = _per_region(local, local_heads, local_rank)
        region_heads(local, local_heads, local_rank)
    except LayoutError as exc:
        raise LayoutError(f"local: {exc}") from None
    try:
        theirs_keys, theirs_per = _per_region(remote, remote_heads, remote_rank)
        region_heads(remote, remote_heads, remote_rank)
    except LayoutError as exc:
        raise LayoutError(f"remote: {exc}") from None
    if mine_per == theirs_per > 1 and local.kv_layout != remote.kv_layout:
        # Regions of several heads pair whole: their interiors must agree. (With one
        # head per region NHD and HND are the same bytes; regions of different widths
        # are refused by map_regions, naming the head slice.)
        raise LayoutMismatch("kv_layout", local.kv_layout, remote.kv_layout)
    layers = len({k[0] for k in mine_keys}), len({k[0] for k in theirs_keys})
    if layers[0] != layers[1]:
        raise LayoutMismatch("num_layers", layers[0], layers[1])
    for key, idx in mine_keys.items():
        layer, part, shard = key
        where = f"layer {layer} {part.name}" + (f" shard {shard}" if shard else "")
        other = theirs_keys.get(key)
        if other is None:
            raise LayoutMismatch(f"regions of {where}", "present", "absent")
        a, b = local.regions[idx[0]], remote.regions[other[0]]
        for name in ("group", "mem"):
            if getattr(a, name) != getattr(b, name):
                raise LayoutMismatch(f"{where}.{name}", getattr(a, name), getattr(b, name))
        per_a, per_b = a.block_len // mine_per, b.block_len // theirs_per
        if per_a != per_b:
            raise LayoutMismatch(
                f"{where}: bytes per head per block (block_size x head_dim x dtype bytes)",
                per_a,
                per_b,
            )
    if len(theirs_keys) != len(mine_keys):
        extra = next(k for k in theirs_keys if k not in mine_keys)
        raise LayoutMismatch(f"regions of layer {extra[0]} {extra[1].name}", "absent", "present")


class RegionSource(msgspec.Struct, frozen=True, kw_only=True):
    """Where one consumer region's bytes come from.

    Attributes:
        local_region: the consumer region (index into the local layout).
        rank: the producer rank.
        remote_region: the producer region holding the same heads (index into that
            rank's layout).
    """

    local_region: int
    rank: int
    remote_region: int


def map_regions(
    local: KVLayout,
    remotes: Mapping[int, KVLayout],
    *,
    local_heads: HeadLayout,
    remote_heads: HeadLayout,
    local_rank: int,
    salt: int = 0,
    only: Collection[int] | None = None,
) -> tuple[RegionSource, ...]:
    """The producer rank and region supplying each consumer region, in table order.

    ``remotes`` maps producer ranks to their layouts; it must hold at least
    :func:`needed_ranks` (those in ``only`` when given: then only the consumer regions
    those ranks supply are mapped). Run :func:`check_head_layouts` on each pair first.

    Raises:
        ConfigError: a needed producer rank is missing, or a consumer region and its
            producer region hold different head sets (a head slice; module doc).
        LayoutError: a layout disagrees with its head layout.
    """
    ranks = source_ranks(local_heads, local_rank, remote_heads, salt=salt)
    wanted = set(ranks.values()) if only is None else set(only)
    missing = sorted(wanted - set(remotes))
    if missing:
        raise ConfigError(
            "remote layouts", sorted(remotes), f"need producer ranks {missing} as well"
        )
    mine = region_heads(local, local_heads, local_rank)
    index: dict[tuple[int, int, KVPart, int, int], tuple[int, range]] = {}
    for p in sorted(wanted):
        held = region_heads(remotes[p], remote_heads, p)
        for j, (r, hs) in enumerate(zip(remotes[p].regions, held)):
            for h in hs:
                index[(p, r.layer, r.part, r.shard, h)] = (j, hs)
    out: list[RegionSource] = []
    for i, (r, hs) in enumerate(zip(local.regions, mine)):
        if not hs:  # a state region: no heads (kvxfer.core.state_plan maps it)
            continue
        p = ranks[hs.start]
        if p not in wanted:
            continue
        found = index.get((p, r.layer, r.part, r.shard, hs.start))
        if found is None:
            where = f"regions of layer {r.layer} {r.part.name} shard {r.shard}"
            raise LayoutMismatch(f"{where} (producer rank {p})", "present", "absent")
        j, theirs = found
        if any(ranks[h] != p for h in hs) or theirs != hs:
            raise _slice_error(i, r.layer, r.part, hs, p, theirs, local, remotes[p])
        out.append(RegionSource(local_region=i, rank=p, remote_region=j))
    return tuple(out)


def _slice_error(
    i: int,
    layer: int,
    part: KVPart,
    mine: range,
    rank: int,
    theirs: range,
    local: KVLayout,
    remote: KVLayout,
) -> ConfigError:
    wide = local if len(mine) > len(theirs) else remote
    if wide.kv_layout not in HEAD_MAJOR_LAYOUTS:
        cost = (
            f"a head slice of a token-major ({wide.kv_layout}) block is strided: "
            f"{wide.tokens_per_desc} descriptors per block per region instead of one, "
            "so the pairing cannot cut it; use a head-major (HND) cache or"
        )
    else:
        cost = (
            f"a head slice of a {wide.kv_layout} block is not a descriptor of these tables: "
            "cut them first (split_heads to pairing_heads, as kvxfer's agents do when "
            "they pair), or"
        )
    return ConfigError(
        "kv_layout",
        wide.kv_layout,
        f"consumer regions[{i}] (layer {layer} {part.name}) holds heads "
        f"[{mine.start}, {mine.stop}) but producer rank {rank} holds them in regions of heads "
        f"[{theirs.start}, {theirs.stop}) (or across ranks): {cost} describe both caches "
        "one region per (layer, K/V, head) with Region.head (vLLM's own connector asks for "
        "an HND cache across TP sizes)",
    )
