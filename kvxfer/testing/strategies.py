"""Hypothesis strategies for KV layouts, block lists and requests (R-DESC-8).

Engines that embed kvxfer property-test their own block mapping with these (see
``docs/TESTING.md``)::

    from hypothesis import given
    from kvxfer.testing import strategies as kst

    @given(kst.plan_cases())
    def test_my_slicing(case: kst.PlanCase) -> None:
        ...

What they cover:

* :func:`layouts`: HEAD and TOKEN split over up to 4 shards, full and sliding groups
  (windows that nest with a descriptor's token range and windows that do not), K/V or
  packed parts, per-layer block lengths, regions apart in random order or interleaved
  block by block, gaps between blocks, and addresses anywhere in ``[0, 2**64)``: from
  0, ending exactly at ``2**64``, or spread over the whole space.
* :func:`relocated`: the same shape at other addresses, block counts and devices (the
  peer's layout), or at the very same addresses.
* :func:`requests`: multi-group requests listing all of their blocks or a suffix (the
  leading blocks came from the prefix cache), as a run or scattered.
* :func:`bad_requests`, :func:`adversarial_ids`, :func:`mismatched`: every class of bad
  input build_plan must refuse, tagged with the :class:`Flaw` it carries.

Layouts stay small (a few regions of at most a few dozen blocks) so each example costs
about a millisecond. The names in ``__all__`` are stable API: new keyword arguments may
be added with defaults that keep today's behaviour.

This module imports hypothesis; the rest of kvxfer never imports it.
"""

from __future__ import annotations

import dataclasses
import enum
from fractions import Fraction
from typing import Any

import msgspec
import numpy as np
from hypothesis import reject
from hypothesis import strategies as st

from kvxfer.core.descriptors import PlanOptions
from kvxfer.core.layout import Group, GroupKind, KVLayout, KVPart, MemKind, Region, SplitAxis
from kvxfer.errors import LayoutError

__all__ = [
    "ADDRESS_LIMIT",
    "BadRequest",
    "Flaw",
    "Placement",
    "PlanCase",
    "Request",
    "adversarial_ids",
    "bad_requests",
    "block_lists",
    "layouts",
    "mismatched",
    "plan_cases",
    "plan_options",
    "relocated",
    "requests",
]

#: One past the highest byte address a region may use.
ADDRESS_LIMIT = 1 << 64
BLOCK_SIZES = (4, 6, 8, 12, 16, 24, 32, 48, 64)
TINY_BLOCK_SIZES = (1, 2, 3)
_BOOL = st.booleans()
_MOSTLY = st.sampled_from((True, True, True, False))
_RARELY = st.sampled_from((False,) * 15 + (True,))


class Placement(enum.Enum):
    """Where :func:`layouts` puts the regions in the 64-bit address space."""

    LOW = "low"  # the lowest region starts at address 0
    ANY = "any"  # anywhere below 2**64
    HIGH = "high"  # the highest region ends exactly at 2**64
    SPREAD = "spread"  # regions apart: the first at 0, the last ending at 2**64


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


class Flaw(enum.Enum):
    """The one thing wrong with a :class:`BadRequest`; build_plan raises PlanError."""

    WRONG_TYPE = "wrong_type"  # an id (or a group's list) that is not an integer (list)
    REPEATED = "repeated"  # an id twice in one group's list
    OUT_OF_RANGE = "out_of_range"  # negative, >= num_blocks, or past int64
    GROUP_COUNT = "group_count"  # more or fewer lists than the layout has groups
    LENGTH_MISMATCH = "length_mismatch"  # local and remote lists of different lengths
    TOO_MANY_BLOCKS = "too_many_blocks"  # more blocks than num_tokens fill
    BAD_NUM_TOKENS = "bad_num_tokens"  # negative, or not an int


@dataclasses.dataclass(frozen=True)
class BadRequest:
    """A request with exactly one :class:`Flaw`, on ``side`` (``local``/``remote``/
    ``both``). The fields hold what a caller might pass: lists, arrays, stray objects."""

    num_tokens: Any
    local_blocks: Any
    remote_blocks: Any
    flaw: Flaw
    side: str


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nests(tokens_per_desc: int, window: int) -> bool:
    return tokens_per_desc % window == 0 or window % tokens_per_desc == 0


def _rng(draw: st.DrawFn) -> np.random.Generator:
    # Placement, device ids and scattered block orders come from one drawn seed:
    # hundreds of fine-grained draws would cost milliseconds per example, and these
    # details shrink well enough as "seed 0".
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1)))


def _placement(
    rng: np.random.Generator, block_lens: tuple[int, ...], num_blocks: int, where: Placement
) -> list[tuple[int, int]]:
    """(base, stride) per region: apart in random order, or interleaved per block."""
    n = len(block_lens)
    out = [(0, 0)] * n
    order = [int(r) for r in rng.permutation(n)]
    if n > 1 and where is not Placement.SPREAD and rng.integers(2):
        # One tensor of (num_blocks, regions, ...): a region's block sits right after
        # another region's block; the stride spans all regions (plus a pad).
        stride = sum(block_lens) + int(rng.choice((0, 0, 1, 16)))
        offset = 0
        for r in order:
            out[r] = (offset, stride)
            offset += block_lens[r]
    else:
        cursor = 0
        for r in order:
            gap = int(rng.choice((0, 0, 1, 16)))
            stride = block_lens[r] + int(rng.choice((0, 0, 1, block_lens[r])))
            out[r] = (cursor + gap, stride)
            cursor += gap + num_blocks * stride
    ends = [
        base + (num_blocks - 1) * stride + block_lens[r] for r, (base, stride) in enumerate(out)
    ]
    room = ADDRESS_LIMIT - max(ends)
    if where is Placement.SPREAD and n > 1:
        # Stretch the gaps so the first region sits at 0 and the last ends at 2**64.
        step, last = room // (n - 1), order[-1]
        out = [(base + order.index(r) * step, stride) for r, (base, stride) in enumerate(out)]
        out[last] = (out[last][0] + ADDRESS_LIMIT - (ends[last] + (n - 1) * step), out[last][1])
        return out
    if where is Placement.LOW:
        shift = 0
    elif where is Placement.HIGH or where is Placement.SPREAD:
        shift = room
    else:
        shift = int(rng.integers(0, room, dtype=np.uint64, endpoint=True))
    return [(base + shift, stride) for base, stride in out]


#: (block_size, TOKEN shards) with a window dividing the block but not nesting with
#: a shard's token range, e.g. (6, 3): 2 tokens a shard, window 3.
_STRADDLING = tuple(
    (bs, d)
    for bs in BLOCK_SIZES
    for d in _divisors(bs)
    if d <= 4 and any(not _nests(bs // d, w) for w in _divisors(bs))
)

_PLACEMENTS = st.sampled_from(
    (Placement.LOW, Placement.LOW, Placement.ANY, Placement.HIGH, Placement.SPREAD)
)


@st.composite
def layouts(
    draw: st.DrawFn,
    *,
    max_layers: int = 3,
    max_blocks: int = 12,
    split_axes: tuple[SplitAxis, ...] = (SplitAxis.HEAD, SplitAxis.TOKEN),
    sliding: bool = True,
    nesting: bool | None = None,
    placement: Placement | None = None,
    state: bool = False,
) -> KVLayout:
    """Valid layouts; every sliding window divides the block size (R-DESC-4).

    Args:
        draw: supplied by hypothesis.
        max_layers: layers (each with K and V, or packed KV, per shard).
        max_blocks: the most blocks per region.
        split_axes: the split axes to draw from.
        sliding: whether a sliding-window group may appear.
        nesting: ``True``: windows that divide or are multiples of a descriptor's token
            range; ``False``: TOKEN-split layouts with a sliding group whose window does
            neither (it straddles shards); ``None``: both.
        placement: where the regions sit; ``None`` draws one.
        state: add a recurrent-state group (Mamba2 / GDN): its layers hold a conv
            and an SSM region each, of any slot length (a multiple of nothing).
    """
    if nesting is False:
        # Only TOKEN shards make a window that divides the block straddle descriptors.
        block_size, num_shards = draw(st.sampled_from(_STRADDLING))
        split = SplitAxis.TOKEN
    else:
        # Tiny blocks cannot be chunked or cut into granules: draw them rarely.
        tiny = draw(_RARELY)
        block_size = draw(st.sampled_from(TINY_BLOCK_SIZES if tiny else BLOCK_SIZES))
        split = draw(st.sampled_from(split_axes))
        if split is SplitAxis.TOKEN:
            num_shards = draw(st.sampled_from([d for d in _divisors(block_size) if d <= 4]))
        else:
            num_shards = draw(st.integers(1, 3))
    tokens = block_size // num_shards if split is SplitAxis.TOKEN else block_size
    if nesting is False:
        num_layers = draw(st.integers(2, max(max_layers, 2)))  # a full and a sliding layer
    else:
        num_layers = draw(st.integers(1, max_layers))
    groups = [Group(kind=GroupKind.FULL)]
    if nesting is False or (sliding and num_layers > 1 and draw(_MOSTLY)):
        windows = _divisors(block_size)
        if nesting is not None:
            chosen = [w for w in windows if _nests(tokens, w) == nesting]
            windows = chosen or windows
        # Windows below a descriptor's range are the ones granules cut: favour them.
        small = [w for w in windows if w < tokens]
        pool = small if len(small) > 0 and draw(_MOSTLY) else windows
        groups.append(Group(kind=GroupKind.SLIDING, window=draw(st.sampled_from(pool))))
        if num_layers > 2 and draw(_BOOL):
            # A second sliding group (another window): its units follow the first's.
            groups.append(Group(kind=GroupKind.SLIDING, window=draw(st.sampled_from(windows))))
        if draw(st.booleans()):
            groups.reverse()  # sliding groups need not come after the full one
    if state:
        # At a random place among the groups; at least one layer of each group.
        groups.insert(draw(st.integers(0, len(groups))), Group(kind=GroupKind.STATE))
        num_layers = max(num_layers, len(groups))
    parts = draw(st.sampled_from([(KVPart.KV,), (KVPart.K, KVPart.V)]))
    num_blocks = draw(st.integers(1, max_blocks))
    mem = draw(st.sampled_from(MemKind))
    where = placement if placement is not None else draw(_PLACEMENTS)
    # (layer, part, shard, group, block_len) per region, in table order.
    specs: list[tuple[int, KVPart, int, int, int]] = []
    for layer in range(num_layers):
        token_bytes = draw(st.integers(1, 4))
        if groups[layer % len(groups)].is_state:
            # State slots are not split into shards or tokens: one region per part.
            for part in (KVPart.CONV, KVPart.SSM):
                specs.append(
                    (layer, part, 0, layer % len(groups), draw(st.integers(1, 3 * tokens)))
                )
            continue
        for part in parts:
            for shard in range(num_shards):
                specs.append((layer, part, shard, layer % len(groups), tokens * token_bytes))
    rng = _rng(draw)
    places = _placement(rng, tuple(s[4] for s in specs), num_blocks, where)
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
    """A layout of the same shape at other addresses, strides, block count, devices.

    Sometimes the very same addresses (two instances mapping their caches alike).
    """
    if draw(_RARELY):
        return layout
    num_blocks = draw(st.integers(1, max_blocks))
    rng = _rng(draw)
    where = draw(_PLACEMENTS)
    places = _placement(rng, tuple(r.block_len for r in layout.regions), num_blocks, where)
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
def requests(
    draw: st.DrawFn, local: KVLayout, remote: KVLayout, *, prefix_hits: bool = True
) -> Request:
    """A request that fits both caches, one block list per group.

    Each group lists all of the request's blocks or, with ``prefix_hits``, a suffix of
    them (the leading blocks were found in the prefix cache; groups may hit different
    lengths, as hybrid models' groups do).
    """
    bs = local.block_size
    capacity = min(local.num_blocks, remote.num_blocks)
    num_tokens = 0 if draw(_RARELY) else draw(st.integers(1, capacity * bs))
    needed = -(-num_tokens // bs)
    mine, theirs = [], []
    for group in local.groups:
        if group.is_state:
            # State slots, whatever the token count: mostly the one running slot.
            count = draw(st.sampled_from((1, 1, 1, 2))) if capacity > 1 else 1
            mine.append(draw(block_lists(local.num_blocks, count)))
            theirs.append(draw(block_lists(remote.num_blocks, count)))
            continue
        full = not prefix_hits or draw(st.booleans())
        count = needed if full else draw(st.integers(min(needed, 1), needed))
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


# --- bad input -----------------------------------------------------------------------


def _wrong_types(b: int) -> st.SearchStrategy[Any]:
    """Values that are not block ids, though some look like the integer ``b``."""
    return st.sampled_from(
        (
            True,
            False,
            np.bool_(True),
            float(b),
            b + 0.5,
            np.float64(b),
            np.float32(b),
            complex(b),
            Fraction(b, 1),
            str(b),
            b"\x01",
            None,
            (b,),
        )
    )


def adversarial_ids(num_blocks: int) -> st.SearchStrategy[Any]:
    """Single values that must never be taken as an id into a ``num_blocks`` table.

    Wrong types (bools, floats, strings, ...) and integers out of range (negative,
    ``num_blocks`` and past it, around ``2**63`` and ``2**64``, ``2**70``).
    """
    return _wrong_types(0) | _out_of_range(num_blocks)


def _out_of_range(num_blocks: int) -> st.SearchStrategy[int]:
    edges = (-1, -(2**63), -(2**70), num_blocks, num_blocks + 1, 2**63 - 1, 2**63, 2**64, 2**70)
    return st.sampled_from(edges) | st.integers(min_value=num_blocks) | st.integers(max_value=-1)


def _replace(seq: tuple[Any, ...], pos: int, value: Any) -> list[Any]:
    out = list(seq)
    out[pos] = value
    return out


@st.composite
def bad_requests(
    draw: st.DrawFn,
    local: KVLayout,
    remote: KVLayout,
    *,
    flaws: tuple[Flaw, ...] = tuple(Flaw),
) -> BadRequest:
    """A request for ``local``/``remote`` with exactly one :class:`Flaw` of ``flaws``.

    Rejects the example (``hypothesis.reject``) when no flaw of ``flaws`` fits the
    drawn request (a repeat needs a group listing two blocks).
    """
    req = draw(requests(local, remote))
    mine = [list(g) for g in req.local_blocks]
    theirs = [list(g) for g in req.remote_blocks]
    n: Any = req.num_tokens
    bs = local.block_size
    listed = [g for g, ids in enumerate(mine) if ids]
    possible = [Flaw.GROUP_COUNT, Flaw.BAD_NUM_TOKENS, Flaw.OUT_OF_RANGE]
    if listed:
        possible += [Flaw.WRONG_TYPE, Flaw.LENGTH_MISMATCH]
    if any(len(ids) > 1 for ids in mine):
        possible.append(Flaw.REPEATED)
    if any(len(ids) < min(local.num_blocks, remote.num_blocks) for ids in mine):
        possible.append(Flaw.TOO_MANY_BLOCKS)
    usable = [f for f in possible if f in flaws]
    if not usable:
        reject()
    flaw = draw(st.sampled_from(usable))
    side = draw(st.sampled_from(("local", "remote")))
    ids, nb = (mine, local.num_blocks) if side == "local" else (theirs, remote.num_blocks)
    if flaw is Flaw.WRONG_TYPE:
        g = draw(st.sampled_from(listed))
        pos = draw(st.integers(0, len(ids[g]) - 1))
        if draw(_RARELY):  # the whole list: a float or bool array, a string
            ids[g] = draw(
                st.sampled_from(
                    (
                        np.array(ids[g], dtype=np.float64),
                        np.array(ids[g], dtype=np.bool_),
                        "".join(str(i % 10) for i in ids[g]),
                    )
                )
            )
        else:
            ids[g] = _replace(tuple(ids[g]), pos, draw(_wrong_types(ids[g][pos])))
    elif flaw is Flaw.REPEATED:
        g = draw(st.sampled_from([g for g, x in enumerate(ids) if len(x) > 1]))
        i, j = draw(st.lists(st.integers(0, len(ids[g]) - 1), min_size=2, max_size=2, unique=True))
        ids[g][j] = ids[g][i]
    elif flaw is Flaw.OUT_OF_RANGE:
        g = draw(st.integers(0, len(ids) - 1))
        bad = draw(_out_of_range(nb))
        other, other_nb = (
            (theirs, remote.num_blocks) if side == "local" else (mine, local.num_blocks)
        )
        if not ids[g] or (draw(_RARELY) and len(other[g]) < other_nb):
            # Both sides grow by one so only the range is wrong; the token count grows
            # to hold the extra block.
            ids[g].append(bad)
            other[g].append(next(b for b in range(len(other[g]) + 1) if b not in other[g]))
            n = max(n, max(len(x) for x in mine) * bs)
        else:
            ids[g][draw(st.integers(0, len(ids[g]) - 1))] = bad
    elif flaw is Flaw.GROUP_COUNT:
        side = "both"
        if len(mine) > 1 and draw(_BOOL):
            mine, theirs = mine[:-1], theirs[:-1]
        else:
            mine, theirs = [*mine, []], [*theirs, []]
    elif flaw is Flaw.LENGTH_MISMATCH:
        g = draw(st.sampled_from(listed))
        ids[g] = ids[g][:-1]
    elif flaw is Flaw.TOO_MANY_BLOCKS:
        side = "both"
        room = min(local.num_blocks, remote.num_blocks)
        g = draw(st.sampled_from([g for g, x in enumerate(mine) if len(x) < room]))
        mine[g].append(next(b for b in range(local.num_blocks) if b not in mine[g]))
        theirs[g].append(next(b for b in range(remote.num_blocks) if b not in theirs[g]))
        n = min(n, (len(mine[g]) - 1) * bs)
    else:
        side = "both"
        n = draw(st.sampled_from((-1, -(2**70), 1.0, 2.5, True, False, "8", None)))
    return BadRequest(
        num_tokens=n,
        local_blocks=[tuple(x) if isinstance(x, list) else x for x in mine],
        remote_blocks=[tuple(x) if isinstance(x, list) else x for x in theirs],
        flaw=flaw,
        side=side,
    )


@st.composite
def mismatched(draw: st.DrawFn, layout: KVLayout) -> KVLayout:
    """A valid layout whose shape differs from ``layout``'s (``first_difference`` is
    not None): another dtype, in-block order, region block length, layer, memory kind,
    window, region count, or another layout altogether."""
    r0 = layout.regions[0]
    tokens = layout.tokens_per_desc
    candidates: list[KVLayout] = []
    replace = msgspec.structs.replace

    def region0(**kw: Any) -> KVLayout:
        return replace(layout, regions=(replace(r0, **kw), *layout.regions[1:]))

    change = draw(st.sampled_from(("dtype", "kv", "len", "layer", "mem", "window", "drop", "any")))
    try:
        if change == "dtype":
            candidates.append(
                replace(layout, dtype="float16" if layout.dtype != "float16" else "fp8")
            )
        elif change == "kv":
            candidates.append(replace(layout, kv_layout="HND"))
        elif change == "len":
            candidates.append(region0(block_len=r0.block_len + tokens, stride=r0.stride + tokens))
        elif change == "layer":
            candidates.append(region0(layer=max(r.layer for r in layout.regions) + 1))
        elif change == "mem":
            mem = MemKind.VRAM if r0.mem is MemKind.DRAM else MemKind.DRAM
            candidates.append(region0(mem=mem))
        elif change == "window":
            groups = tuple(
                Group(kind=GroupKind.SLIDING, window=layout.block_size * 2)
                if g.kind is GroupKind.FULL
                else Group(kind=GroupKind.FULL)
                for g in layout.groups
            )
            candidates.append(replace(layout, groups=groups))
        elif change == "drop" and len(layout.regions) > 1:
            candidates.append(replace(layout, regions=layout.regions[:-1]))
    except LayoutError:
        pass  # that change breaks a layout rule here: take another layout instead
    if not candidates:
        other = draw(layouts().filter(lambda b: layout.first_difference(b) is not None))
        candidates.append(other)
    return candidates[0]
