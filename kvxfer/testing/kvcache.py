"""Model-shaped KV caches in host memory, with a byte pattern that proves where bytes came from.

Used by ``kvxfer demo``, ``kvxfer bench`` and the multi-process tests. A cache is one
numpy array per (layer, K|V) region of ``num_blocks`` blocks; block ``b`` of a producer's
region is filled with a pattern derived from ``(seed, layer, part, b)``, so a consumer
can check byte-for-byte that its block ``x`` received exactly producer block ``y``.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from kvxfer.core.layout import Group, GroupKind, KVLayout, KVPart, MemKind, Region, SplitAxis

__all__ = ["QWEN3_0_6B", "HostKVCache", "ModelShape", "model_layout"]


class ModelShape(msgspec.Struct, frozen=True, kw_only=True):
    """The KV-relevant shape of a model."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bf16
    sliding_window: int = 0  # > 0: odd layers use sliding-window attention

    def token_bytes(self) -> int:
        """Bytes one token occupies in one K (or V) region."""
        return self.kv_heads * self.head_dim * self.dtype_bytes


QWEN3_0_6B = ModelShape(name="qwen3-0.6b", layers=28, kv_heads=8, head_dim=128)


class HostKVCache:
    """A paged KV cache in host memory: ``layers × {K, V}`` regions of ``num_blocks`` blocks.

    Args:
        shape: The model's KV shape.
        block_size: Tokens per block.
        num_blocks: Blocks per region.
        fill_seed: Fill every block with the provenance pattern of this seed; None
            leaves zeros (a consumer's empty cache).
        shards: Split every block by TOKEN into this many shards, one region each (as
            an NPU's chiplets hold a block): one block then spans one descriptor per shard.
    """

    def __init__(
        self,
        shape: ModelShape,
        block_size: int,
        num_blocks: int,
        *,
        fill_seed: int | None = None,
        shards: int = 1,
    ) -> None:
        if block_size % shards:
            raise ValueError(f"shards={shards} must divide block_size={block_size}")
        self.shape = shape
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.shards = shards
        self.region_tokens = block_size // shards  # tokens of a block one region holds
        self.block_bytes = self.region_tokens * shape.token_bytes()  # per region
        self.parts = [
            (layer, part, shard)
            for layer in range(shape.layers)
            for part in (KVPart.K, KVPart.V)
            for shard in range(shards)
        ]
        # uint16 words: bf16-sized elements without needing a bf16 dtype.
        words = self.block_bytes // 2
        self.regions: list[npt.NDArray[np.uint16]] = [
            np.zeros((num_blocks, words), dtype=np.uint16) for _ in self.parts
        ]
        self.fill_seed = fill_seed
        if fill_seed is not None:
            for i in range(len(self.parts)):
                self.regions[i][:] = self.pattern(i, np.arange(num_blocks))

    @property
    def nbytes(self) -> int:
        """Total bytes of the cache."""
        return sum(r.nbytes for r in self.regions)

    def pattern(self, region: int, blocks: npt.NDArray[np.int64]) -> npt.NDArray[np.uint16]:
        """The producer's content of ``blocks`` of region ``region`` (one row per block)."""
        seed = self.fill_seed or 0
        words = self.block_bytes // 2
        col = np.arange(words, dtype=np.uint32)
        row = np.asarray(blocks, dtype=np.uint32) * np.uint32(40503) + np.uint32(
            region * 7919 + seed * 104729
        )
        return ((row[:, None] + col[None, :] * np.uint32(2654435761)) >> np.uint32(7)).astype(
            np.uint16
        )

    def layout(self) -> KVLayout:
        """The layout of this cache (addresses of the live arrays; no copies)."""
        return model_layout(
            self.shape,
            self.block_size,
            self.num_blocks,
            [int(arr.ctypes.data) for arr in self.regions],
            shards=self.shards,
        )

    def mismatches(
        self,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        producer_seed: int,
    ) -> int:
        """Count (region, block) pairs whose bytes differ from the producer's pattern."""
        local = np.asarray(local_blocks, dtype=np.int64)
        remote = np.asarray(remote_blocks, dtype=np.int64)
        saved, self.fill_seed = self.fill_seed, producer_seed
        try:
            bad = 0
            for i in range(len(self.regions)):
                expected = self.pattern(i, remote)
                got = self.regions[i][local]
                bad += int(np.count_nonzero((expected != got).any(axis=1)))
            return bad
        finally:
            self.fill_seed = saved


def model_layout(
    shape: ModelShape,
    block_size: int,
    num_blocks: int,
    bases: Sequence[int],
    *,
    shards: int = 1,
    mem: MemKind = MemKind.DRAM,
    device_id: int = 0,
) -> KVLayout:
    """The layout of a model-shaped cache whose ``layers × {K, V} × shards`` regions
    (in that order) start at ``bases``, each ``num_blocks`` contiguous blocks of
    ``block_size // shards`` tokens: :class:`HostKVCache`'s, or one in device memory."""
    parts = [
        (layer, part, shard)
        for layer in range(shape.layers)
        for part in (KVPart.K, KVPart.V)
        for shard in range(shards)
    ]
    if len(bases) != len(parts):
        raise ValueError(f"bases: {len(bases)} given, the shape has {len(parts)} regions")
    block_bytes = block_size // shards * shape.token_bytes()
    groups: tuple[Group, ...] = (Group(kind=GroupKind.FULL),)
    if shape.sliding_window:
        groups += (Group(kind=GroupKind.SLIDING, window=shape.sliding_window),)
    regions = tuple(
        Region(
            base=int(base),
            num_blocks=num_blocks,
            stride=block_bytes,
            block_len=block_bytes,
            mem=mem,
            device_id=device_id,
            layer=layer,
            part=part,
            shard=shard,
            group=1 if shape.sliding_window and layer % 2 else 0,
        )
        for base, (layer, part, shard) in zip(bases, parts)
    )
    return KVLayout(
        block_size=block_size,
        regions=regions,
        groups=groups,
        dtype="bfloat16",
        split_axis=SplitAxis.TOKEN if shards > 1 else SplitAxis.HEAD,
        num_shards=shards,
        # shards cut tokens, so every region holds all KV heads
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
    )
