"""Hypothesis strategies for KV transfers across tensor-parallel sizes (R-TP-3).

Engines property-test their own head mapping with these, as with
:mod:`kvxfer.testing.strategies`::

    from hypothesis import given
    from kvxfer.testing import tp_strategies as tps

    @given(tps.tp_cases())
    def test_my_tp_mapping(case):
        ...

A :class:`TPCase` is a model (KV heads, possibly fewer than the TP sizes or one latent
head), a producer and a consumer TP group of sizes the head count allows, one consumer
rank, the layouts of that rank and of every producer rank (one region per (layer,
part, shard, head), or one per (layer, part, shard) holding all of a rank's heads
where both sides' regions hold the same heads), plan options and a request.
:func:`rank_layout` builds one rank's layout from a model and is usable on its own.

This module imports hypothesis; the rest of kvxfer never imports it.
"""

from __future__ import annotations

import msgspec
import numpy as np
from hypothesis import strategies as st

from kvxfer.core.descriptors import PlanOptions
from kvxfer.core.heads import HeadLayout
from kvxfer.core.layout import Group, GroupKind, KVLayout, KVPart, Region, SplitAxis
from kvxfer.testing.strategies import Request, plan_options, requests

__all__ = [
    "KV_HEADS",
    "TPCase",
    "TPModel",
    "head_layouts",
    "rank_layout",
    "tp_cases",
    "tp_models",
    "tp_sizes",
]

#: Head counts drawn: odd ones, fewer than the TP sizes, and a power of two.
KV_HEADS = (1, 2, 3, 4, 6, 8)
#: Regions of one rank are placed this far apart (addresses stay below 2**48).
_SLOT = 1 << 28


class TPModel(msgspec.Struct, frozen=True, kw_only=True):
    """The KV shape of a model, independent of TP.

    Attributes:
        num_kv_heads: KV heads of the model (1 when ``latent``).
        latent: latent KV (MLA-style), one head every rank holds.
        layers: model layers.
        parts: what each layer's regions hold: K and V, or packed KV.
        head_bytes: bytes of one head of one token in one region (head_dim x dtype).
        block_size: tokens per block.
        num_shards: TOKEN shards per block (1: none).
        window: > 0: odd layers form a sliding-window group of this window.
    """

    num_kv_heads: int
    latent: bool = False
    layers: int = 2
    parts: tuple[KVPart, ...] = (KVPart.K, KVPart.V)
    head_bytes: int = 4
    block_size: int = 8
    num_shards: int = 1
    window: int = 0


class TPCase(msgspec.Struct, frozen=True, kw_only=True):
    """One consumer rank pulling one request from a producer TP group.

    Attributes:
        model: the model both groups run.
        producer: the producer's head layout.
        consumer: the consumer's head layout.
        consumer_rank: the consumer rank planning.
        local: that rank's layout.
        remotes: every producer rank's layout, by rank.
        options: plan options valid for both sides.
        request: the request (producer ranks share block ids).
        salt: the replica-spreading salt.
    """

    model: TPModel
    producer: HeadLayout
    consumer: HeadLayout
    consumer_rank: int
    local: KVLayout
    remotes: dict[int, KVLayout]
    options: PlanOptions
    request: Request
    salt: int = 0


def tp_sizes(num_kv_heads: int, max_tp: int = 8) -> tuple[int, ...]:
    """TP sizes a head count allows up to ``max_tp``: its divisors and multiples."""
    return tuple(
        tp
        for tp in range(1, max_tp + 1)
        if (num_kv_heads % tp if num_kv_heads >= tp else tp % num_kv_heads) == 0
    )


@st.composite
def head_layouts(
    draw: st.DrawFn, num_kv_heads: int | None = None, latent: bool = False
) -> HeadLayout:
    """Valid head layouts (of ``num_kv_heads`` heads when given)."""
    n = 1 if latent else num_kv_heads or draw(st.sampled_from(KV_HEADS))
    return HeadLayout(num_kv_heads=n, tp_size=draw(st.sampled_from(tp_sizes(n))), latent=latent)


@st.composite
def tp_models(draw: st.DrawFn) -> TPModel:
    """Small models: 1-3 layers, K/V or packed, TOKEN shards, a sliding group."""
    latent = draw(st.sampled_from((False,) * 5 + (True,)))
    block_size = draw(st.sampled_from((2, 4, 6, 8, 16)))
    num_shards = draw(st.sampled_from([d for d in (1, 1, 2) if block_size % d == 0]))
    layers = draw(st.integers(1, 3))
    tokens = block_size // num_shards
    windows = [w for w in range(1, block_size + 1) if block_size % w == 0]
    windows = [w for w in windows if tokens % w == 0 or w % tokens == 0]
    window = draw(st.sampled_from(windows)) if layers > 1 and draw(st.booleans()) else 0
    return TPModel(
        num_kv_heads=1 if latent else draw(st.sampled_from(KV_HEADS)),
        latent=latent,
        layers=layers,
        parts=(KVPart.KV,)
        if latent
        else draw(st.sampled_from(((KVPart.K, KVPart.V), (KVPart.KV,)))),
        head_bytes=draw(st.integers(1, 4)),
        block_size=block_size,
        num_shards=num_shards,
        window=window,
    )


def rank_layout(
    model: TPModel,
    heads: HeadLayout,
    rank: int,
    *,
    per_head: bool,
    num_blocks: int,
    seed: int = 0,
    kv_layout: str = "NHD",
) -> KVLayout:
    """Rank ``rank``'s layout: regions per (layer, part, shard[, head]), global heads.

    ``per_head`` gives one region per head (``Region.head`` set), else one region per
    (layer, part, shard) holding all of the rank's heads in ``kv_layout`` order. The
    regions sit ``2**28`` bytes apart in an order drawn from ``seed``, with gaps between
    blocks for some seeds.
    """
    rng = np.random.default_rng(seed)
    held = heads.heads_of(rank)
    tokens = model.block_size // model.num_shards
    starts = list(held) if per_head else [held.start]
    width = 1 if per_head else len(held)
    specs = [
        (layer, part, shard, h)
        for layer in range(model.layers)
        for part in model.parts
        for shard in range(model.num_shards)
        for h in starts
    ]
    block_len = tokens * width * model.head_bytes
    pad = int(rng.choice((0, 0, 1, block_len)))
    slots = rng.permutation(len(specs))
    base = (int(seed) % 1024 + 1) << 38
    sliding = model.window > 0 and model.layers > 1
    regions = tuple(
        Region(
            base=base + int(slot) * _SLOT,
            num_blocks=num_blocks,
            stride=block_len + pad,
            block_len=block_len,
            layer=layer,
            part=part,
            shard=shard,
            group=layer % 2 if sliding else 0,
            head=h,
        )
        for (layer, part, shard, h), slot in zip(specs, slots)
    )
    groups: tuple[Group, ...] = (Group(kind=GroupKind.FULL),)
    if sliding:
        groups += (Group(kind=GroupKind.SLIDING, window=model.window),)
    return KVLayout(
        block_size=model.block_size,
        regions=regions,
        split_axis=SplitAxis.TOKEN if model.num_shards > 1 else SplitAxis.HEAD,
        num_shards=model.num_shards,
        groups=groups,
        dtype="uint8",
        kv_layout=kv_layout,
        num_kv_heads=width,
    )


@st.composite
def tp_cases(
    draw: st.DrawFn,
    model_strategy: st.SearchStrategy[TPModel] | None = None,
    *,
    kv_layout: str = "NHD",
    uncut: bool = False,
) -> TPCase:
    """A model, two TP groups it allows, a consumer rank, layouts that can be mapped
    (the side whose regions would hold more heads than the other's is per head),
    options and a request.

    ``uncut``: each side per head or per (layer, part, shard) independently, as
    engines describe them by default, for the pairing to cut
    (:func:`kvxfer.core.heads.pairing_heads`); give a head-major ``kv_layout`` then. The
    options are the defaults but for ``coalesce`` where the blocks are not
    token-major (chunks and window granules need token-major blocks)."""
    model = draw(model_strategy if model_strategy is not None else tp_models())
    producer = draw(head_layouts(model.num_kv_heads, model.latent))
    sizes = tp_sizes(producer.num_kv_heads)
    others = [tp for tp in sizes if tp != producer.tp_size]
    # Mostly unequal TP sizes: equal ones are the ordinary case, covered elsewhere.
    pool = others if others and draw(st.sampled_from((True, True, True, False))) else sizes
    consumer = HeadLayout(
        num_kv_heads=producer.num_kv_heads,
        tp_size=draw(st.sampled_from(pool)),
        latent=producer.latent,
    )
    rank = draw(st.integers(0, consumer.tp_size - 1))
    per_p, per_c = draw(st.booleans()), draw(st.booleans())
    width_p = 1 if per_p else producer.heads_per_rank
    width_c = 1 if per_c else consumer.heads_per_rank
    if width_p != width_c and not uncut:
        # Regions must hold the same heads on both sides: one head each, then.
        per_p = per_c = True
    nb_local, nb_remote = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**16))
    local = rank_layout(
        model, consumer, rank, per_head=per_c, num_blocks=nb_local, seed=seed, kv_layout=kv_layout
    )
    remotes = {
        p: rank_layout(
            model,
            producer,
            p,
            per_head=per_p,
            num_blocks=nb_remote,
            seed=seed + 1 + p,
            kv_layout=kv_layout,
        )
        for p in range(producer.tp_size)
    }
    token_major = kv_layout == "NHD"
    options = (
        draw(plan_options(local)) if token_major else PlanOptions(coalesce=draw(st.booleans()))
    )
    return TPCase(
        model=model,
        producer=producer,
        consumer=consumer,
        consumer_rank=rank,
        local=local,
        remotes=remotes,
        options=options,
        request=draw(requests(local, remotes[0])),
        salt=draw(st.sampled_from((0, 0, 1, 2, 3))),
    )
