"""vLLM's KV cache tensors as a :class:`~kvxfer.core.layout.KVLayout` (no copies).

:func:`describe_kv_caches` turns the per-layer tensors vLLM hands
``register_kv_caches`` into regions: one per layer for whole blocks, or token-major
regions (per head, and per head-dim element where K is stored element-major) for the
KV cache groups whose blocks chunk_mode or swa_window_mode cut into token ranges
(:func:`token_major_groups`). No torch or vLLM imports: tensors are duck-typed; the
CPU cache's in-block order is probed by :mod:`~kvxfer.adapters.vllm.cpu_cache`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import msgspec

from kvxfer.core.descriptors import PlanOptions, chunk_size
from kvxfer.core.layout import (
    BlockInterior,
    Group,
    GroupKind,
    KVLayout,
    KVPart,
    SplitAxis,
    split_kv,
)
from kvxfer.errors import ConfigError

__all__ = [
    "CPU_VEC_INTERIOR",
    "Interior",
    "describe_kv_caches",
    "token_major_groups",
]


class Interior(enum.Enum):
    """How one head's K (or V) rows sit inside a block of vLLM's CPU cache."""

    #: ``[token][element]``: a token range is one contiguous range.
    TOKEN_MAJOR = "token-major"
    #: ``[element][token]`` (K of vLLM's CPU "vec" attention): a token range is one
    #: range per head-dim element.
    ELEMENT_MAJOR = "element-major"


#: (K, V) interior of vLLM 0.32's CPU cache with its "vec"/"vec16" attention, probed
#: with vLLM's own cache-write op (:mod:`kvxfer.adapters.vllm.cpu_cache`).
CPU_VEC_INTERIOR = (Interior.ELEMENT_MAJOR, Interior.TOKEN_MAJOR)


def describe_kv_caches(
    kv_caches: Mapping[str, Any],
    *,
    block_size: int,
    num_blocks: int,
    kv_layout: str,
    groups: Sequence[Group] | None = None,
    layer_groups: Mapping[str, int] | None = None,
    token_major_groups: Collection[int] = (),
    interior: tuple[Interior, Interior] | None = CPU_VEC_INTERIOR,
    tp_rank: int = 0,
    head_regions: bool = False,
    first_head: int | None = None,
    state_parts: Mapping[int, Sequence[int]] | None = None,
) -> KVLayout:
    """The :class:`KVLayout` of vLLM's per-layer KV tensors, without copying.

    Layer *i* is the *i*-th entry of ``kv_caches`` (vLLM's layer order); its region
    belongs to the KV cache group ``layer_groups[name]`` (default 0). A tensor shared
    by several layers of one group (KV sharing) is described once; vLLM's hybrid KV
    cache manager also lets layers of *different* groups share one tensor (a block id
    belongs to one group at a time), and each of them gets its own region over the
    same bytes. Three shapes are understood: block-first ``(num_blocks, ...)``,
    ``(2, num_blocks, ...)`` and ``(num_blocks, 2, ...)`` (a K and a V region).

    vLLM 0.32 on CPU gives ``(num_blocks, num_kv_heads, block_size, 2 * head_size)``,
    head-major: per head, the K part then the V part of ``block_size * head_size``
    elements each, whose order ``interior`` gives (probed at start-up: K is
    element-major, V token-major with the "vec" attention). Layers of the groups in
    ``token_major_groups`` (blocks that chunk_mode or swa_window_mode cut into token
    ranges) are described so that inside every region a block is token-major: one
    region per (head, V) and per (head, K) (``Region.head``, the *global* KV head:
    ``first_head + h``; by default ``tp_rank * num_kv_heads + h`` on a tensor-parallel
    rank holding ``num_kv_heads``, which is wrong where heads are fewer than ranks:
    there rank *r* holds head ``r // (tp_size / total heads)``, so pass ``first_head``),
    or, for an element-major K, one per (head, K, element) (``Region.lane``). Other
    layers are one region each and move whole blocks (``kv_layout`` ``"HND"`` unless a
    group is split), or with ``head_regions`` one region per head (its K and V parts of
    each block; pairs across TP sizes no longer need it: a head-major region is cut
    per head at the handshake, :func:`kvxfer.core.heads.split_heads`).

    A layer of a recurrent-state group (Mamba2, Gated DeltaNet) comes as vLLM 0.32
    hands it over, a raw ``(num_blocks, 1, 1, bytes)`` page view whose slot packs the
    layer's states one after the other; ``state_parts[g]`` gives their sizes in
    bytes (conv state, then SSM state: ``MambaSpec.shapes`` and ``dtypes``), and each
    becomes its own region (:attr:`KVPart.CONV`, :attr:`KVPart.SSM`). A list of
    per-state views (an engine that unpacked them) is taken as it is.

    Raises:
        ConfigError: a group must be cut but the cache's interior is unknown; a state
            layer whose slot is not its states' sizes.
    """
    groups = tuple(groups) if groups is not None else (Group(kind=GroupKind.FULL),)
    group_of = dict(layer_groups or {})
    split = set(token_major_groups)
    regions = _Regions()
    seen: set[tuple[int, int]] = set()
    head_major = False
    subs: set[int] = set()  # kernel blocks per block, by layer
    for layer, (name, t) in enumerate(kv_caches.items()):
        g = int(group_of.get(name, 0))
        if isinstance(t, list | tuple):
            _add_state(regions, name, t, layer, g, groups)
            continue
        parts = (state_parts or {}).get(g)
        if parts and 0 <= g < len(groups) and groups[g].is_state:
            _add_state(regions, name, _unpack_state(name, t, parts), layer, g, groups)
            continue
        if (int(t.data_ptr()), g) in seen:
            continue
        seen.add((int(t.data_ptr()), g))
        if int(t.shape[0]) == num_blocks:
            subs.add(1)
            cpu_shape = t.dim() == 4 and int(t.shape[2]) == block_size
            head_major = head_major or cpu_shape
            if cpu_shape and g in split:
                if interior is None:
                    raise ConfigError(
                        "chunk_mode/swa_window_mode",
                        True,
                        f"cut the blocks of KV cache group {g}, but the in-block order of "
                        "this engine's CPU cache is unknown (its attention is not one "
                        "whose cache writes kvxfer probed): leave both modes off",
                    )
                first = tp_rank * int(t.shape[1]) if first_head is None else first_head
                _split_heads(regions, t, layer, g, block_size, interior, first)
                continue
            if cpu_shape and head_regions:
                heads = int(t.shape[1])
                first = tp_rank * heads if first_head is None else first_head
                for h in range(heads):
                    regions.add(t[:, h], layer, KVPart.KV, g, head=first + h)
                continue
            regions.add(t, layer, KVPart.KV, g)
            continue
        sub, kv_dim = _kernel_split(name, t, num_blocks)
        if sub > 1 and g in split:
            raise ConfigError(
                "chunk_mode/swa_window_mode",
                True,
                f"cut the blocks of KV cache group {g}, but the attention kernel splits "
                f"each {block_size}-token block into {sub} blocks of "
                f"{block_size // sub}: leave both modes off",
            )
        subs.add(sub)
        if kv_dim is None:
            _add_kernel_blocks(regions, t, sub, layer, KVPart.KV, g)
            continue
        k, v = split_kv(t, kv_dim=kv_dim)
        _add_kernel_blocks(regions, k, sub, layer, KVPart.K, g)
        _add_kernel_blocks(regions, v, sub, layer, KVPart.V, g)
    if len(subs) > 1:
        raise ConfigError(
            "kv_caches",
            sorted(subs),
            f"attention kernels that split the {block_size}-token blocks differently "
            "in one engine (kernel blocks per block, by layer)",
        )
    kernel_split = max(subs, default=1)
    if head_major:
        # Whole regions of a head-major cache are not token-major; split ones are.
        kv_layout = "NHD" if split else "HND"
    layout = KVLayout.from_tensors(
        regions.views,
        block_size=block_size,
        layers=regions.layers,
        parts=regions.parts,
        shards=regions.shards,
        # The kernel's blocks as token shards of the block the scheduler names.
        split_axis=SplitAxis.TOKEN if kernel_split > 1 else SplitAxis.HEAD,
        num_shards=kernel_split,
        region_groups=regions.groups,
        groups=groups,
        kv_layout=kv_layout,
        heads=regions.heads,
        lanes=regions.lanes,
    )
    if head_major:
        return _cpu_interior(layout, kv_caches, bool(split), interior, head_regions)
    return layout


def _cpu_interior(
    layout: KVLayout,
    kv_caches: Mapping[str, Any],
    split: bool,
    interior: tuple[Interior, Interior] | None,
    head_regions: bool = False,
) -> KVLayout:
    """State where a token's bytes lie in the blocks of vLLM's CPU cache, so that a
    pull between different block sizes can cut them (:mod:`kvxfer.core.ratio`): whole
    regions of the probed "vec" order hold, per head, K element-major then V
    token-major. A cache described partly per head, or of another order, is opaque."""
    shapes = {
        (int(t.shape[1]), int(t.shape[3]) // 2)
        for t in kv_caches.values()
        if not isinstance(t, list | tuple) and t.dim() == 4
    }
    whole = all(r.part is KVPart.KV for r in layout.regions)
    if split or not whole or len(shapes) != 1 or interior != CPU_VEC_INTERIOR:
        return msgspec.structs.replace(layout, interior=BlockInterior.OPAQUE)
    heads, dim = shapes.pop()
    if head_regions:  # one region per head
        heads = 1
    return msgspec.structs.replace(
        layout, interior=BlockInterior.K_ELEMENT_MAJOR, num_kv_heads=heads, head_dim=dim
    )


#: What the tensors of a recurrent-state layer hold, in vLLM's order (``MambaSpec.shapes``:
#: the convolution state, then the SSM / temporal state).
_STATE_PARTS = (KVPart.CONV, KVPart.SSM)


def _unpack_state(name: str, page: Any, parts: Sequence[int]) -> list[Any]:
    """Per-state byte views of a state layer's ``(num_blocks, 1, 1, bytes)`` pages."""
    flat = page.reshape(int(page.shape[0]), -1) if page.dim() != 2 else page
    width = int(flat.shape[1]) * int(flat.element_size())
    if sum(parts) != width or flat.element_size() != 1:
        raise ConfigError(
            f"kv_caches[{name!r}]",
            f"{tuple(int(d) for d in page.shape)} {page.dtype}",
            f"a state layer's slot must be its states' {list(parts)} bytes, packed, as "
            "byte pages (vLLM's MambaSpec page view)",
        )
    views, offset = [], 0
    for n in parts:
        views.append(flat[:, offset : offset + n])
        offset += n
    return views


def _add_state(
    regions: _Regions,
    name: str,
    tensors: Sequence[Any],
    layer: int,
    group: int,
    groups: Sequence[Group],
) -> None:
    """A Mamba2 / Gated DeltaNet layer's state tensors as one region each.

    ``tensors``: one view per state over the KV pages, ``(num_blocks, ...)`` each:
    block *b* of every view is state slot *b* (a slot is one page, shared with the
    attention layers of other groups as any page is). A slot is moved whole, so no
    in-slot order matters at equal TP sizes.
    """
    if not (0 <= group < len(groups)) or not groups[group].is_state:
        raise ConfigError(
            f"kv_caches[{name!r}]",
            f"{len(tensors)} state tensor(s)",
            "a layer with a list of state tensors must belong to a Mamba/GDN "
            f"(MambaSpec) KV cache group, and its group {group} is not one",
        )
    if len(tensors) != len(_STATE_PARTS):
        raise ConfigError(
            f"kv_caches[{name!r}]",
            f"{len(tensors)} state tensor(s)",
            "kvxfer moves state layers of exactly a conv state and an SSM state "
            "(Mamba2, Gated DeltaNet)",
        )
    for part, view in zip(_STATE_PARTS, tensors, strict=True):
        regions.add(view, layer, part, group)


class _Regions:
    """Per-region columns for :meth:`KVLayout.from_tensors`."""

    def __init__(self) -> None:
        self.views: list[Any] = []
        self.layers: list[int] = []
        self.parts: list[KVPart] = []
        self.groups: list[int] = []
        self.heads: list[int] = []
        self.lanes: list[int] = []
        self.shards: list[int] = []

    def add(
        self,
        view: Any,
        layer: int,
        part: KVPart,
        group: int,
        head: int = 0,
        lane: int = 0,
        shard: int = 0,
    ) -> None:
        self.views.append(view)
        self.layers.append(layer)
        self.parts.append(part)
        self.groups.append(group)
        self.heads.append(head)
        self.lanes.append(lane)
        self.shards.append(shard)


def _kernel_split(name: str, t: Any, num_blocks: int) -> tuple[int, int | None]:
    """``(sub, kv_dim)`` of a KV tensor that is not block-first at ``num_blocks``: the
    kernel blocks per scheduler block and the dimension K and V are split on (None:
    block-first, described packed).

    vLLM gives an attention kernel that supports only smaller blocks than the KV
    cache manager's a tensor of ``num_blocks * sub`` kernel blocks of
    ``block_size / sub`` tokens, scheduler block *b* being kernel blocks
    ``b*sub .. b*sub+sub-1`` (``prepare_kernel_block_sizes``).

    Raises:
        ConfigError: no block dimension is a whole multiple of ``num_blocks``.
    """
    shape = tuple(int(d) for d in t.shape)
    if len(shape) > 1 and shape[0] == 2 and shape[1] % num_blocks == 0:
        return shape[1] // num_blocks, 0
    if shape and shape[0] % num_blocks == 0:  # packed, as a block-first tensor is
        return shape[0] // num_blocks, None
    raise ConfigError(
        f"kv_caches[{name!r}].shape",
        shape,
        f"no block dimension is a whole multiple of the KV cache's {num_blocks} blocks",
    )


def _add_kernel_blocks(
    regions: _Regions, t: Any, sub: int, layer: int, part: KVPart, group: int
) -> None:
    """``t``'s blocks as regions: one when a block is one kernel block, else one per
    kernel block *j* of every scheduler block (token shard *j*: ``t[j::sub]``)."""
    for j in range(sub):
        regions.add(t[j::sub] if sub > 1 else t, layer, part, group, shard=j)


def _split_heads(
    regions: _Regions,
    t: Any,
    layer: int,
    group: int,
    block_size: int,
    interior: tuple[Interior, Interior],
    first: int,
) -> None:
    """One CPU cache tensor as token-major regions (see :func:`describe_kv_caches`);
    ``first``: this rank's first global KV head."""
    nb, num_heads, _, two_hs = (int(d) for d in t.shape)
    hs = two_hs // 2
    for h in range(num_heads):
        for index, part in ((0, KVPart.K), (1, KVPart.V)):
            if interior[index] is Interior.TOKEN_MAJOR:
                # [block][head][K | V][token][element]
                view = t.view(nb, num_heads, 2, block_size, hs)[:, h, index]
                regions.add(view, layer, part, group, head=first + h)
                continue
            # [block][head][K | V][element][token]: one region per element
            rows = t.view(nb, num_heads, 2, hs, block_size)[:, h, index]
            for e in range(hs):
                regions.add(rows[:, e], layer, part, group, head=first + h, lane=e)


def token_major_groups(
    groups: Sequence[Group], block_size: int, options: PlanOptions
) -> frozenset[int]:
    """The groups whose blocks ``options`` cut into token ranges (R-DESC-3/4): every
    group with chunks smaller than a block, sliding groups with swa_window_mode and a
    window granule smaller than a block."""
    bound = options.chunk_bound
    chunk = chunk_size(block_size, bound) if options.chunk_mode and bound else block_size
    out = set()
    for g, group in enumerate(groups):
        unit = chunk
        if options.swa_window_mode and group.kind is GroupKind.SLIDING:
            unit = math.gcd(min(group.window, block_size), chunk)
        if unit < block_size:
            out.add(g)
    return frozenset(out)
