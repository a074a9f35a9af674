"""The KV-cache layout model (R-LAYOUT).

A :class:`KVLayout` says what registered KV memory looks like: which contiguous
:class:`Region` holds which layer's K, V (or packed KV) for which shard and group, how
far apart its blocks are, and how many tokens a block holds. It is immutable, validated
on construction (every rule broken raises :class:`~kvxfer.errors.LayoutError` naming the
field, the value and the rule) and serializes with msgspec for the handshake.

Two instances of one model have layouts of the same *shape* (block size, split axis,
shards, groups, per-region block lengths) but different base addresses, strides and
block counts; :meth:`KVLayout.first_difference` compares only the shape.

Byte order inside a block is token-major: the token *t* (0-based among the
``tokens_per_desc`` tokens a region's block covers) occupies
``[t * block_len / T, (t + 1) * block_len / T)`` with ``T = tokens_per_desc``. Chunk and
window descriptors (:mod:`kvxfer.core.descriptors`) rely on this.
"""

from __future__ import annotations

import enum
import math
import weakref
from collections.abc import Sequence
from typing import Any

import msgspec

from kvxfer.errors import LayoutError

__all__ = [
    "BlockInterior",
    "ConvLayout",
    "Group",
    "GroupKind",
    "KVLayout",
    "KVPart",
    "MemKind",
    "Region",
    "SplitAxis",
    "split_kv",
    "tensors_of",
]

_ADDR_LIMIT = 1 << 64


class SplitAxis(enum.Enum):
    """How shards cut a block: by heads (all tokens each) or by token ranges."""

    HEAD = "head"
    TOKEN = "token"


class MemKind(enum.Enum):
    """Where a region lives: host memory or device memory."""

    DRAM = "dram"
    VRAM = "vram"


class KVPart(enum.Enum):
    """What a region holds of its layer: keys, values, or both packed together; for a
    state layer (:attr:`GroupKind.STATE`), its convolution state or its SSM (temporal)
    state."""

    K = "k"
    V = "v"
    KV = "kv"
    CONV = "conv"
    SSM = "ssm"


class GroupKind(enum.Enum):
    """The kind of a group of layers sharing one block table.

    FULL and SLIDING groups are attention KV: block *i* of a request holds its tokens
    ``[i * block_size, (i + 1) * block_size)``. A STATE group holds recurrent state
    (Mamba2 / Gated DeltaNet conv and SSM state): a request lists the *state slots* it
    moves, each a whole block of every region of the group, whatever its token count;
    such a block is never cut into token ranges and no prefix of it is cached.
    """

    FULL = "full"
    SLIDING = "sliding"
    STATE = "state"


class ConvLayout(enum.Enum):
    """How a state group's convolution state orders one slot (vLLM's
    ``VLLM_SSM_CONV_STATE_LAYOUT``): ``(state_len, dim)`` or ``(dim, state_len)``.

    kvxfer moves a slot whole, so either order works, but both sides must use the
    same one: the same bytes mean different state under the other order, with the
    same length. It is part of the group so that the handshake compares it.
    """

    SD = "SD"
    DS = "DS"


class BlockInterior(enum.Enum):
    """Where a token's bytes lie inside a region's block, beyond what ``kv_layout``
    says: what a plan between different block sizes must know to cut a block into
    token ranges (:mod:`kvxfer.core.ratio`).

    PLAIN: as ``kv_layout`` says: ``"NHD"`` token-major; ``"HND"`` head-major, each
    head's tokens in order (``num_kv_heads`` heads per region).
    K_ELEMENT_MAJOR: a packed K/V region whose block holds, per head, the keys
    element-major (``head_dim`` rows of ``block_size`` elements) and then the values
    token-major (``block_size`` rows of ``head_dim``): vLLM's CPU cache with its "vec"
    attention.
    OPAQUE: not stated for every region (a cache described partly per head and
    partly whole): blocks are moved whole only.
    """

    PLAIN = "plain"
    K_ELEMENT_MAJOR = "k_element_major"
    OPAQUE = "opaque"


def _bad(owner: str, field: str, value: Any, rule: str) -> LayoutError:
    return LayoutError(f"{owner}.{field}={value!r}: {rule}")


def _check_int(owner: str, field: str, value: Any, minimum: int) -> None:
    # msgspec type-checks on decode only; direct construction needs the check here
    # (and a bool is not an int for us).
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(owner, field, value, "must be an int")
    if value < minimum:
        raise _bad(owner, field, value, f"must be >= {minimum}")


class Group(msgspec.Struct, frozen=True, kw_only=True):
    """Layers that share one block table.

    Attributes:
        kind: full attention, sliding-window attention or recurrent state.
        window: the sliding window in tokens; > 0 iff ``kind`` is SLIDING.
        conv_layout: a STATE group's conv-state order, where the engine states it
            (None: not stated; never set on attention groups).
    """

    kind: GroupKind
    window: int = 0
    conv_layout: ConvLayout | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GroupKind):
            raise _bad("Group", "kind", self.kind, "must be a GroupKind")
        _check_int("Group", "window", self.window, 0)
        if (self.kind is GroupKind.SLIDING) != (self.window > 0):
            raise _bad("Group", "window", self.window, "must be > 0 iff kind is sliding")
        if self.conv_layout is not None and (
            not isinstance(self.conv_layout, ConvLayout) or self.kind is not GroupKind.STATE
        ):
            raise _bad(
                "Group",
                "conv_layout",
                self.conv_layout,
                "must be a ConvLayout, and only on a state group",
            )

    @property
    def is_state(self) -> bool:
        """True for a recurrent-state group (its blocks are state slots, not tokens)."""
        return self.kind is GroupKind.STATE


class Region(msgspec.Struct, frozen=True, kw_only=True):
    """One contiguous registered memory range holding ``num_blocks`` blocks.

    Block *b* occupies ``[base + b*stride, base + b*stride + block_len)``.

    Attributes:
        base: address of block 0.
        num_blocks: number of blocks in the region.
        stride: bytes from one block's start to the next (>= block_len).
        block_len: bytes of one block in this region.
        mem: host (DRAM) or device (VRAM) memory.
        device_id: the device (or NUMA/host index for DRAM) the region lives on.
        layer: the model layer whose KV this is.
        part: keys, values or packed KV.
        shard: which shard of the block (see :class:`SplitAxis`).
        group: index into :attr:`KVLayout.groups`.
        head: the global KV head index when a region holds one head's K or V (caches
            whose block interior is head-major are described one region per
            (layer, K/V, head), so that inside a region a block is token-major);
            0 when a region holds every head of its layer.
        lane: the head-dim element when a region holds one element of every token
            of one head (caches that store K transposed, element-major, are
            described one region per (layer, head, element) for token ranges);
            0 otherwise.
    """

    base: int
    num_blocks: int
    stride: int
    block_len: int
    mem: MemKind = MemKind.DRAM
    device_id: int = 0
    layer: int = 0
    part: KVPart = KVPart.KV
    shard: int = 0
    group: int = 0
    head: int = 0
    lane: int = 0

    def __post_init__(self) -> None:
        for name, minimum in (
            ("base", 0),
            ("num_blocks", 1),
            ("block_len", 1),
            ("stride", 1),
            ("device_id", 0),
            ("layer", 0),
            ("shard", 0),
            ("group", 0),
            ("head", 0),
            ("lane", 0),
        ):
            _check_int("Region", name, getattr(self, name), minimum)
        if self.stride < self.block_len:
            raise _bad("Region", "stride", self.stride, f"must be >= block_len ({self.block_len})")
        if not isinstance(self.mem, MemKind):
            raise _bad("Region", "mem", self.mem, "must be a MemKind")
        if not isinstance(self.part, KVPart):
            raise _bad("Region", "part", self.part, "must be a KVPart")
        if self.end > _ADDR_LIMIT:
            raise _bad("Region", "base", self.base, "region must end below 2**64")

    @property
    def end(self) -> int:
        """One past the last byte of the last block."""
        return self.base + (self.num_blocks - 1) * self.stride + self.block_len


def _group_summary(g: Group) -> str:
    if g.kind is GroupKind.SLIDING:
        return f"sliding(w={g.window})"
    if g.conv_layout is not None:
        return f"state(conv={g.conv_layout.value})"
    return "state" if g.kind is GroupKind.STATE else "full"


def _default_groups() -> tuple[Group, ...]:
    return (Group(kind=GroupKind.FULL),)


class KVLayout(msgspec.Struct, frozen=True, kw_only=True, weakref=True):
    """The shape and placement of a registered paged KV cache.

    Attributes:
        block_size: tokens per block (both instances must agree).
        regions: the registered regions, in descriptor-table order.
        split_axis: how shards cut a block.
        num_shards: shards per block (TOKEN split: each holds block_size/num_shards
            consecutive tokens, shard *s* the *s*-th slice).
        groups: block-table groups; ``Region.group`` indexes this.
        dtype: element type of the cache, e.g. ``"bfloat16"``.
        kv_layout: in-block order, e.g. ``"NHD"`` (token-major, needed for chunk and
            window descriptors) or ``"HND"``.
        num_kv_heads: KV heads one region holds (per shard); 0 when not known.
            Descriptive only (the bytes are in ``block_len``): it lets a mismatch be
            named in the engine's terms. :meth:`from_kv_caches` fills it in.
        head_dim: Elements per head; 0 when not known. Descriptive, as ``num_kv_heads``.
        interior: where a token's bytes lie inside a block beyond ``kv_layout``
            (:class:`BlockInterior`); compared by the handshake.
    """

    block_size: int
    regions: tuple[Region, ...]
    split_axis: SplitAxis = SplitAxis.HEAD
    num_shards: int = 1
    groups: tuple[Group, ...] = msgspec.field(default_factory=_default_groups)
    dtype: str = "bfloat16"
    kv_layout: str = "NHD"
    # Added after protocol 1 shipped: defaulted, so a peer that does not send them
    # decodes as "unknown" (0), and an older peer ignores them (msgspec skips
    # unknown fields).
    num_kv_heads: int = 0
    head_dim: int = 0
    interior: BlockInterior = BlockInterior.PLAIN

    def __post_init__(self) -> None:
        _check_int("KVLayout", "block_size", self.block_size, 1)
        if not isinstance(self.interior, BlockInterior):
            raise _bad("KVLayout", "interior", self.interior, "must be a BlockInterior")
        _check_int("KVLayout", "num_kv_heads", self.num_kv_heads, 0)
        _check_int("KVLayout", "head_dim", self.head_dim, 0)
        _check_int("KVLayout", "num_shards", self.num_shards, 1)
        if not isinstance(self.split_axis, SplitAxis):
            raise _bad("KVLayout", "split_axis", self.split_axis, "must be a SplitAxis")
        if not self.regions:
            raise _bad("KVLayout", "regions", self.regions, "must not be empty")
        if not self.groups:
            raise _bad("KVLayout", "groups", self.groups, "must not be empty")
        if not self.dtype:
            raise _bad("KVLayout", "dtype", self.dtype, "must not be empty")
        if not self.kv_layout:
            raise _bad("KVLayout", "kv_layout", self.kv_layout, "must not be empty")
        if self.split_axis is SplitAxis.TOKEN and self.block_size % self.num_shards:
            raise _bad(
                "KVLayout",
                "num_shards",
                self.num_shards,
                f"TOKEN split needs block_size ({self.block_size}) divisible by num_shards",
            )
        tokens = self.tokens_per_desc
        num_blocks = self.regions[0].num_blocks
        seen: set[tuple[int, KVPart, int, int, int]] = set()
        used_groups: set[int] = set()
        for i, r in enumerate(self.regions):
            owner = f"KVLayout.regions[{i}]"
            if r.num_blocks != num_blocks:
                raise _bad(
                    owner, "num_blocks", r.num_blocks, f"must equal regions[0] ({num_blocks})"
                )
            if r.group < len(self.groups) and self.groups[r.group].is_state:
                pass  # a state slot holds no tokens: any length
            elif r.block_len % tokens:
                raise _bad(
                    owner, "block_len", r.block_len, f"must be a multiple of {tokens} tokens"
                )
            if r.shard >= self.num_shards:
                raise _bad(owner, "shard", r.shard, f"must be < num_shards ({self.num_shards})")
            if r.group >= len(self.groups):
                raise _bad(owner, "group", r.group, f"must be < len(groups) ({len(self.groups)})")
            key = (r.layer, r.part, r.shard, r.head, r.lane)
            if key in seen:
                raise _bad(
                    owner, "layer", r.layer, f"duplicate (layer, part, shard, head, lane) {key}"
                )
            seen.add(key)
            used_groups.add(r.group)
        for g in range(len(self.groups)):
            if g not in used_groups:
                raise _bad("KVLayout", "groups", self.groups, f"group {g} has no region")

    @property
    def num_blocks(self) -> int:
        """Blocks per region (the same for every region)."""
        return self.regions[0].num_blocks

    @property
    def token_spans(self) -> int:
        """How many token slices one block is cut into (num_shards for TOKEN, else 1)."""
        return self.num_shards if self.split_axis is SplitAxis.TOKEN else 1

    @property
    def tokens_per_desc(self) -> int:
        """Tokens one whole-block descriptor covers (block_size / token_spans)."""
        return self.block_size // self.token_spans

    @property
    def num_regions(self) -> int:
        """Number of regions (whole-block descriptors per block)."""
        return len(self.regions)

    def block_bytes(self, group: int = 0) -> int:
        """Bytes of one block summed over the regions of ``group``."""
        return sum(r.block_len for r in self.regions if r.group == group)

    def first_difference(self, other: KVLayout) -> tuple[str, Any, Any] | None:
        """Name the first shape field where two layouts differ.

        Base addresses, strides, block counts and device ids legitimately differ
        between two instances and are never compared.

        Returns:
            ``(field, self_value, other_value)`` or ``None`` when the shapes agree.
        """
        for name in (
            "block_size",
            "dtype",
            "split_axis",
            "num_shards",
            "kv_layout",
            "interior",
            "groups",
        ):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return name, mine, theirs
        # The engine's terms first, where both sides know them (0 is "not known").
        for name in ("num_kv_heads", "head_dim"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine and theirs and mine != theirs:
                return f"{name} (per region)", mine, theirs
        if len(self.regions) != len(other.regions):
            layers = len({r.layer for r in self.regions}), len({r.layer for r in other.regions})
            if layers[0] != layers[1]:
                return "num_layers", layers[0], layers[1]
            return "num_regions", len(self.regions), len(other.regions)
        for i, (a, b) in enumerate(zip(self.regions, other.regions)):
            where = f"regions[{i}] (layer {a.layer} {a.part.name})"
            # Identity before size: a block_len difference is only meaningful between
            # regions that hold the same layer's same part.
            for name in ("layer", "part", "shard", "group", "head", "lane", "mem"):
                mine, theirs = getattr(a, name), getattr(b, name)
                if mine != theirs:
                    return f"{where}.{name}", mine, theirs
            if a.block_len != b.block_len:
                # block_size and dtype agree (checked above): what differs is the
                # size of one token, kv_heads x head_dim (x the dtype's bytes).
                tokens = self.tokens_per_desc
                return (
                    f"{where}.block_len: bytes of {tokens} tokens of {self.dtype}, "
                    f"{a.block_len // tokens} vs {b.block_len // tokens} bytes per token: "
                    "kv_heads x head_dim differ",
                    a.block_len,
                    b.block_len,
                )
        return None

    def summary(self) -> str:
        """One line describing the layout, for logs and ``kvxfer probe``."""
        groups = ",".join(_group_summary(g) for g in self.groups)
        layers = len({r.layer for r in self.regions})
        parts = "/".join(sorted({r.part.value for r in self.regions}))
        lens = sorted({r.block_len for r in self.regions})
        block_len = str(lens[0]) if len(lens) == 1 else f"{lens[0]}..{lens[-1]}"
        mems = "/".join(sorted({r.mem.value for r in self.regions}))
        return (
            f"block_size={self.block_size} split={self.split_axis.value} "
            f"shards={self.num_shards} groups=[{groups}] regions={self.num_regions} "
            f"(layers={layers} parts={parts}) num_blocks={self.num_blocks} "
            f"block_len={block_len} dtype={self.dtype} kv_layout={self.kv_layout} mem={mems}"
            + (f" kv_heads={self.num_kv_heads}" if self.num_kv_heads else "")
            + (f" head_dim={self.head_dim}" if self.head_dim else "")
            + (
                f" interior={self.interior.value}"
                if self.interior is not BlockInterior.PLAIN
                else ""
            )
        )

    @classmethod
    def from_tensors(
        cls,
        tensors: Sequence[Any],
        *,
        block_size: int,
        layers: Sequence[int] | None = None,
        parts: Sequence[KVPart] | None = None,
        shards: Sequence[int] | None = None,
        region_groups: Sequence[int] | None = None,
        groups: Sequence[Group] | None = None,
        split_axis: SplitAxis = SplitAxis.HEAD,
        num_shards: int = 1,
        kv_layout: str = "NHD",
        num_kv_heads: int = 0,
        head_dim: int = 0,
        heads: Sequence[int] | None = None,
        lanes: Sequence[int] | None = None,
    ) -> KVLayout:
        """Describe torch tensors in place (no copies) as one region each.

        Each tensor's dim 0 is the block index; the rest of a block must be contiguous.
        ``base`` is ``data_ptr()``, ``stride`` is ``stride(0) * element_size()`` and
        ``block_len`` the bytes of one block. Memory kind and device id come from
        ``tensor.device`` (``cpu`` is DRAM, anything else VRAM).

        Args:
            tensors: one tensor (or view) per region, e.g. from :func:`split_kv`.
            block_size: tokens per block.
            layers: layer of each tensor (default: its index).
            parts: K/V/KV of each tensor (default: KV, packed).
            shards: shard of each tensor (default: 0).
            region_groups: group index of each tensor (default: 0).
            groups: the groups (default: one full-attention group).
            split_axis: how shards cut a block.
            num_shards: shards per block.
            kv_layout: in-block order of the tensors.
            num_kv_heads: KV heads per region, for messages (0: not known).
            head_dim: elements per head, for messages (0: not known).
            heads: global KV head of each tensor (default: 0, every head).
            lanes: head-dim element of each tensor (default: 0).

        The tensors are described, not owned: they must stay alive and in place for as
        long as the layout is registered with an Agent (a freed or re-allocated tensor
        leaves the Agent moving bytes at a stale address).
        :meth:`Agent.register_tensors <kvxfer.agent.Agent.register_tensors>` (or
        ``Agent.register(layout, keep=tensors)``) keeps them alive until the Agent closes.

        Raises:
            LayoutError: mixed dtypes, non-contiguous blocks, or a layout rule broken.
        """
        n = len(tensors)
        if n == 0:
            raise _bad("KVLayout.from_tensors", "tensors", tensors, "must not be empty")
        per_region: dict[str, Sequence[Any] | None] = {
            "layers": layers,
            "parts": parts,
            "shards": shards,
            "region_groups": region_groups,
            "heads": heads,
            "lanes": lanes,
        }
        for name, values in per_region.items():
            if values is not None and len(values) != n:
                raise _bad(
                    "KVLayout.from_tensors", name, len(values), f"needs one per tensor ({n})"
                )
        group_list = tuple(groups) if groups is not None else _default_groups()
        # The layout's dtype is its attention KV's; recurrent state (a STATE group's
        # regions) keeps its own element type (vLLM may hold SSM state in float32 beside
        # bfloat16 KV): bytes are moved whole, so only attention tensors must agree.
        in_state = [
            region_groups is not None
            and 0 <= int(region_groups[i]) < len(group_list)
            and group_list[int(region_groups[i])].is_state
            for i in range(n)
        ]
        typed = [t for t, st in zip(tensors, in_state, strict=True) if not st] or list(tensors)
        dtypes = {str(t.dtype) for t in typed}
        if len(dtypes) != 1:
            raise _bad("KVLayout.from_tensors", "tensors", sorted(dtypes), "mixed dtypes")
        regions = []
        for i, t in enumerate(tensors):
            block_len = _block_len(t, i)  # first: it refuses a tensor without dim 0
            regions.append(
                Region(
                    base=int(t.data_ptr()),
                    num_blocks=int(t.shape[0]),
                    stride=int(t.stride(0)) * int(t.element_size()),
                    block_len=block_len,
                    mem=MemKind.DRAM if t.device.type == "cpu" else MemKind.VRAM,
                    device_id=int(t.device.index or 0),
                    layer=int(layers[i]) if layers is not None else i,
                    part=parts[i] if parts is not None else KVPart.KV,
                    shard=int(shards[i]) if shards is not None else 0,
                    group=int(region_groups[i]) if region_groups is not None else 0,
                    head=int(heads[i]) if heads is not None else 0,
                    lane=int(lanes[i]) if lanes is not None else 0,
                )
            )
        layout = cls(
            block_size=block_size,
            regions=tuple(regions),
            split_axis=split_axis,
            num_shards=num_shards,
            groups=group_list,
            dtype=dtypes.pop().removeprefix("torch."),
            kv_layout=kv_layout,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        _keep_sources(layout, tensors)
        return layout

    @classmethod
    def from_kv_caches(
        cls,
        kv_caches: Sequence[Any],
        *,
        block_size: int,
        kv_dim: int = 0,
        layers: Sequence[int] | None = None,
        shards: Sequence[int] | None = None,
        layer_groups: Sequence[int] | None = None,
        groups: Sequence[Group] | None = None,
        split_axis: SplitAxis = SplitAxis.HEAD,
        num_shards: int = 1,
        kv_layout: str = "NHD",
    ) -> KVLayout:
        """Describe vLLM-style per-layer caches holding K and V along ``kv_dim``.

        Each layer's tensor is ``(2, num_blocks, ...)`` (``kv_dim=0``) or
        ``(num_blocks, 2, ...)`` (``kv_dim=1``); it becomes a K and a V region (views
        from :func:`split_kv`, no copies), in that order. ``layers``, ``shards`` and
        ``layer_groups`` have one entry per tensor (default: index, 0, 0); the other
        arguments are those of :meth:`from_tensors`.

        Where the shape says where the tokens are, it is checked against
        ``block_size``: with ``kv_layout`` ``"NHD"`` a K (or V) view is
        ``(num_blocks, block_size, kv_heads, head_dim)``, with ``"HND"``
        ``(num_blocks, kv_heads, block_size, head_dim)`` (per shard: block_size /
        num_shards tokens with a TOKEN split). The heads and head_dim read there go
        into the layout, so a mismatch with a peer is named in those terms.

        Raises:
            LayoutError: ``block_size`` disagrees with the tensors' token dimension,
                or any rule of :meth:`from_tensors`.
        """
        views: list[Any] = []
        for cache in kv_caches:
            views.extend(split_kv(cache, kv_dim=kv_dim))
        spans = num_shards if split_axis is SplitAxis.TOKEN else 1
        heads, head_dim = _heads_and_dim(
            views, kv_caches, block_size=block_size, tokens=block_size // spans, kv_layout=kv_layout
        )

        def twice(values: Sequence[int] | None) -> list[int] | None:
            return None if values is None else [v for v in values for _ in range(2)]

        return cls.from_tensors(
            views,
            block_size=block_size,
            layers=twice(layers if layers is not None else range(len(kv_caches))),
            parts=[KVPart.K, KVPart.V] * len(kv_caches),
            shards=twice(shards),
            region_groups=twice(layer_groups),
            groups=groups,
            split_axis=split_axis,
            num_shards=num_shards,
            kv_layout=kv_layout,
            num_kv_heads=heads,
            head_dim=head_dim,
        )


# The tensors a layout was built from, while the layout object lives: a layout records
# addresses only, and registering one whose tensors were collected would hand NIXL
# freed memory. Keyed by id() and dropped by a finalizer when the layout is collected.
_SOURCES: dict[int, tuple[Any, ...]] = {}


def _keep_sources(layout: KVLayout, tensors: Sequence[Any]) -> None:
    key = id(layout)
    _SOURCES[key] = tuple(tensors)
    weakref.finalize(layout, _SOURCES.pop, key, None)


def tensors_of(layout: KVLayout) -> tuple[Any, ...] | None:
    """The tensors ``layout`` was built from (:meth:`KVLayout.from_tensors` and
    :meth:`KVLayout.from_kv_caches` keep them while the layout lives), or None for a
    layout described by addresses or whose tensors were taken."""
    return _SOURCES.get(id(layout))


def take_tensors(layout: KVLayout) -> tuple[Any, ...] | None:
    """Hand the tensors ``layout`` was built from to the caller, which keeps them from
    now on (:meth:`Agent.register <kvxfer.agent.Agent.register>` does, until it
    closes: then they are the engine's again, whoever still holds the layout)."""
    return _SOURCES.pop(id(layout), None)


#: Where the token and head dimensions sit in a 4-d K or V view, by in-block order.
_TOKEN_HEAD_DIMS = {"NHD": (1, 2), "HND": (2, 1)}


def _heads_and_dim(
    views: Sequence[Any], caches: Sequence[Any], *, block_size: int, tokens: int, kv_layout: str
) -> tuple[int, int]:
    """Check ``block_size`` against the views' token dimension; return (heads, head_dim).

    Only 4-d views in a known in-block order say where the tokens are; any other
    shape is accepted as it is (``(0, 0)``: heads and head_dim not known).
    """
    dims = _TOKEN_HEAD_DIMS.get(kv_layout)
    if dims is None or any(v.dim() != 4 for v in views):
        return 0, 0
    token_dim, head_dim_index = dims
    found: set[tuple[int, int]] = set()
    for i, v in enumerate(views):
        # A block that is not one byte range is refused for that first: its logical
        # dims then are not its in-block order, and kv_layout would misplace the tokens.
        _block_len(v, i)
        held = int(v.shape[token_dim])
        if held != tokens:
            order = "block_size, kv_heads" if kv_layout == "NHD" else "kv_heads, block_size"
            raise _bad(
                "KVLayout.from_kv_caches",
                "block_size",
                block_size,
                f"kv_caches[{i // 2}] has shape {tuple(int(d) for d in caches[i // 2].shape)}: "
                f"its {kv_layout} blocks (num_blocks, {order}, head_dim) hold {held} tokens, "
                f"not {tokens}",
            )
        found.add((int(v.shape[head_dim_index]), int(v.shape[3])))
    # Layers of different widths: nothing single to name.
    return found.pop() if len(found) == 1 else (0, 0)


def split_kv(cache: Any, *, kv_dim: int = 0) -> tuple[Any, Any]:
    """Split a tensor holding K and V along ``kv_dim`` into two views (no copies).

    With ``kv_dim=0`` a ``(2, num_blocks, ...)`` tensor gives ``cache[0], cache[1]``;
    with ``kv_dim=1`` a ``(num_blocks, 2, ...)`` tensor gives ``cache[:, 0], cache[:, 1]``,
    whose block stride is twice the block length.

    Raises:
        LayoutError: the dimension does not have size 2.
    """
    if kv_dim not in (0, 1):
        raise _bad("split_kv", "kv_dim", kv_dim, "must be 0 or 1")
    if cache.dim() < 2 or cache.shape[kv_dim] != 2:
        raise _bad("split_kv", "shape", tuple(cache.shape), f"dim {kv_dim} must have size 2")
    if kv_dim == 0:
        return cache[0], cache[1]
    return cache[:, 0], cache[:, 1]


def _block_len(t: Any, index: int) -> int:
    """Bytes of one block of ``t``; the block (dims 1..) must be contiguous."""
    owner = f"KVLayout.from_tensors.tensors[{index}]"
    if t.dim() < 1:
        raise _bad(owner, "shape", tuple(t.shape), "needs a block dimension")
    shape = [int(s) for s in t.shape[1:]]
    expected = 1
    # Walk the inner dims from the innermost outwards: each must step over exactly
    # the elements inside it, or one block is not a single byte range.
    for dim in range(t.dim() - 1, 0, -1):
        if shape[dim - 1] != 1 and int(t.stride(dim)) != expected:
            raise _bad(owner, "stride", tuple(t.stride()), "one block must be contiguous")
        expected *= shape[dim - 1]
    return math.prod(shape) * int(t.element_size())
