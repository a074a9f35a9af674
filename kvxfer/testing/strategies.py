"""Hypothesis strategies for KV layouts, block lists and requests (R-DESC-8).

Engines that embed kvxfer can property-test their own slicing with these::

    from hypothesis import given
    from kvxfer.testing import strategies as kst

    @given(kst.plan_cases())
    def test_my_slicing(case):
        ...

Layouts are small (a few regions of at most a few dozen blocks) so each example
stays cheap, but cover every axis: HEAD and TOKEN split, several shards, full and
sliding groups, K/V or packed parts, per-layer block lengths, regions placed apart
in random order or interleaved block by block (one tensor holding every region),
gaps between blocks. Addresses stay below 2**48 so int64 arithmetic is exact.

This module imports hypothesis; the rest of kvxfer never imports it.
"""

from __future__ import annotations

import msgspec
import numpy as np
from hypothesis import strategies as st

from kvxfer.descriptors import PlanOptions
from kvxfer.layout import Group, GroupKind, KVLayout, KVPart, MemKind, Region, SplitAxis

__all__ = [
    "PlanCase",
    "Request",
    "block_lists",
    "layouts",
    "plan_cases",
    "plan_options",
    "relocated",
    "requests",
]

BLOCK_SIZES = (4, 6, 8, 12, 16, 24, 32, 48, 64)
TINY_BLOCK_SIZES = (1, 2, 3)
_BOOL = st.booleans()
_MOSTLY = st.sampled_from((True, True, True, False))
_RARELY = st.sampled_from((False,) * 15 + (True,))


class Request(msgspec.Struct, frozen=True, kw_only=True):
    """One request: its token count and, per group, the paired block ids.

    The block lists are the request's last blocks (a suffix when leading blocks are
    cached), so ``len(list) <= ceil(num_tokens / block_size)``.
    """

    num_tokens: int
    local_blocks: tuple[tuple[int, ...], ...]
    remote_blocks: tuple[tuple[int, ...], ...]


class PlanCase(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one plan needs: both layouts, the options and a request."""

    local: KVLayout
    remote: KVLayout
    options: PlanOptions
    request: Request


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _window_ok(block_size: int, tokens_per_desc: int, window: int) -> bool:
    """Whether swa_window_mode can cut a group of this window (see descriptors)."""
    return block_size % window == 0 and (
        tokens_per_desc % window == 0 or window % tokens_per_desc == 0
    )


def _placement(
    rng: np.random.Generator, block_lens: tuple[int, ...], num_blocks: int
) -> list[tuple[int, int]]:
    """(base, stride) per region: apart in random order, or interleaved per block."""
    n = len(block_lens)
    start = int(rng.integers(0, 1 << 40))
    out = [(0, 0)] * n
    order = [int(r) for r in rng.permutation(n)]
    if n > 1 and rng.integers(2):
        # One tensor of (num_blocks, regions, ...): a region's block sits right after
        # another region's block; the stride spans all regions (plus a pad).
        stride = sum(block_lens) + int(rng.choice((0, 0, 1, 16)))
        offset = start
        for r in order:
            out[r] = (offset, stride)
            offset += block_lens[r]
        return out
    cursor = start
    for r in order:
        gap = int(rng.choice((0, 0, 1, 16)))
        stride = block_lens[r] + int(rng.choice((0, 0, 1, block_lens[r])))
        out[r] = (cursor + gap, stride)
        cursor += gap + num_blocks * stride
    return out


def _rng(draw: st.DrawFn) -> np.random.Generator:
    # Placement, device ids and scattered block orders come from one drawn seed:
    # hundreds of fine-grained draws would cost milliseconds per example, and these
    # details shrink well enough as "seed 0".
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1)))


@st.composite
def layouts(
    draw: st.DrawFn,
    *,
    max_layers: int = 3,
    max_blocks: int = 12,
    split_axes: tuple[SplitAxis, ...] = (SplitAxis.HEAD, SplitAxis.TOKEN),
    sliding: bool = True,
) -> KVLayout:
    """Valid layouts; sliding windows are always cuttable by swa_window_mode."""
    # Tiny blocks cannot be chunked or cut into granules: draw them rarely.
    tiny = draw(_RARELY)
    block_size = draw(st.sampled_from(TINY_BLOCK_SIZES if tiny else BLOCK_SIZES))
    split = draw(st.sampled_from(split_axes))
    if split is SplitAxis.TOKEN:
        num_shards = draw(st.sampled_from([d for d in _divisors(block_size) if d <= 4]))
    else:
        num_shards = draw(st.integers(1, 3))
    tokens = block_size // num_shards if split is SplitAxis.TOKEN else block_size
    num_layers = draw(st.integers(1, max_layers))
    groups = [Group(kind=GroupKind.FULL)]
    if sliding and num_layers > 1 and draw(_MOSTLY):
        windows = [w for w in _divisors(block_size) if _window_ok(block_size, tokens, w)]
        # Windows below a descriptor's range are the ones granules cut: favour them.
        small = [w for w in windows if w < tokens]
        pool = small if len(small) > 0 and draw(_MOSTLY) else windows
        groups.append(Group(kind=GroupKind.SLIDING, window=draw(st.sampled_from(pool))))
        if draw(st.booleans()):
            groups.reverse()  # the sliding group need not come second
    parts = draw(st.sampled_from([(KVPart.KV,), (KVPart.K, KVPart.V)]))
    num_blocks = draw(st.integers(1, max_blocks))
    mem = draw(st.sampled_from(MemKind))
    # (layer, part, shard, group, block_len) per region, in table order.
    specs: list[tuple[int, KVPart, int, int, int]] = []
    for layer in range(num_layers):
        token_bytes = draw(st.integers(1, 4))
        for part in parts:
            for shard in range(num_shards):
                specs.append((layer, part, shard, layer % len(groups), tokens * token_bytes))
    rng = _rng(draw)
    places = _placement(rng, tuple(s[4] for s in specs), num_blocks)
    regions = tuple(
        Region(
            base=base,
            num_blocks=num_blocks,
            stride=stride,
            block_len=block_len,
            mem=mem,
            device_id=int(rng.integers(2)),
            layer=layer,
            part=part,
            shard=shard,
            group=group,
        )
        for (layer, part, shard, group, block_len), (base, stride) in zip(specs, places)
    )
    return KVLayout(
        block_size=block_size,
        regions=regions,
        split_axis=split,
        num_shards=num_shards,
        groups=tuple(groups),
    )


@st.composite
def relocated(draw: st.DrawFn, layout: KVLayout, *, max_blocks: int = 12) -> KVLayout:
    """A layout of the same shape at other addresses, strides, block count, devices."""
    num_blocks = draw(st.integers(1, max_blocks))
    rng = _rng(draw)
    places = _placement(rng, tuple(r.block_len for r in layout.regions), num_blocks)
    regions = tuple(
        msgspec.structs.replace(
            r, base=base, stride=stride, num_blocks=num_blocks, device_id=int(rng.integers(2))
        )
        for r, (base, stride) in zip(layout.regions, places)
    )
    return msgspec.structs.replace(layout, regions=regions)


@st.composite
def block_lists(draw: st.DrawFn, num_blocks: int, count: int) -> tuple[int, ...]:
    """``count`` distinct block ids in ``[0, num_blocks)``: a run, or scattered."""
    if count == 0:
        return ()
    if draw(st.booleans()):
        start = draw(st.integers(0, num_blocks - count))
        return tuple(range(start, start + count))
    return tuple(int(b) for b in _rng(draw).permutation(num_blocks)[:count])


@st.composite
def requests(draw: st.DrawFn, local: KVLayout, remote: KVLayout) -> Request:
    """A request that fits both caches: all of its blocks, or a suffix (cache hit)."""
    bs = local.block_size
    capacity = min(local.num_blocks, remote.num_blocks)
    num_tokens = 0 if draw(_RARELY) else draw(st.integers(1, capacity * bs))
    needed = -(-num_tokens // bs)
    mine, theirs = [], []
    for _ in local.groups:
        count = needed if draw(st.booleans()) else draw(st.integers(min(needed, 1), needed))
        mine.append(draw(block_lists(local.num_blocks, count)))
        theirs.append(draw(block_lists(remote.num_blocks, count)))
    return Request(num_tokens=num_tokens, local_blocks=tuple(mine), remote_blocks=tuple(theirs))


@st.composite
def plan_options(draw: st.DrawFn, layout: KVLayout) -> PlanOptions:
    """Options valid for ``layout``: chunk bounds around its descriptor range."""
    tokens = layout.tokens_per_desc

    def bound(cap: int) -> int:
        # Mostly at most half the range (real chunks), sometimes up to past it.
        return draw(st.integers(1, max(1, min(cap, tokens // 2) if draw(_MOSTLY) else cap)))

    chunk_mode = draw(_BOOL)
    chunk_tokens = bound(tokens + 4) if draw(_BOOL) else None
    step = bound(chunk_tokens or tokens + 4) if draw(_BOOL) else None
    if chunk_mode and chunk_tokens is None and step is None:
        step = bound(tokens + 4)
    return PlanOptions(
        chunk_mode=chunk_mode,
        chunk_tokens=chunk_tokens,
        prefill_step_tokens=step,
        swa_window_mode=draw(_BOOL),
        coalesce=draw(_BOOL),
    )


@st.composite
def plan_cases(
    draw: st.DrawFn, layout_strategy: st.SearchStrategy[KVLayout] | None = None
) -> PlanCase:
    """A local layout, a relocated remote one, options and a request fitting both."""
    local = draw(layout_strategy if layout_strategy is not None else layouts())
    remote = draw(relocated(local))
    return PlanCase(
        local=local,
        remote=remote,
        options=draw(plan_options(local)),
        request=draw(requests(local, remote)),
    )
