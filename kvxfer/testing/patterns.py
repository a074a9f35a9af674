"""Test KV caches whose every byte says where it came from.

A :class:`PatternCache` is host memory shaped like a sharded paged KV cache; its bytes
are a pattern of ``(seed, region, block, byte)``. After a transfer,
:func:`expected_after` computes what the receiver's memory must hold, byte for byte,
from the descriptor ids that moved (:func:`locate` maps ids back to region, block and
offset through the table's own layout), so any misplaced, missing or extra byte shows.
"""

from __future__ import annotations

import msgspec
import numpy as np
import numpy.typing as npt

from kvxfer.core.descriptors import DescriptorTable
from kvxfer.core.layout import Group, GroupKind, KVLayout, KVPart, MemKind, Region, SplitAxis

__all__ = ["CacheShape", "PatternCache", "expected_after", "locate"]

IntArray = npt.NDArray[np.int64]
ByteArray = npt.NDArray[np.uint8]


class CacheShape(msgspec.Struct, frozen=True, kw_only=True):
    """The test cache: ``layers × {K, V} × shards`` regions of ``num_blocks`` blocks.

    Even layers keep all their regions interleaved block by block in one buffer (as a
    ``(num_blocks, 2, ...)`` vLLM cache does), odd layers one buffer per region, so both
    strided and contiguous regions are exercised. With ``window`` > 0, odd layers form a
    sliding-window group.
    """

    layers: int = 2
    num_shards: int = 2
    split_axis: SplitAxis = SplitAxis.TOKEN
    block_size: int = 16
    token_bytes: int = 32
    num_blocks: int = 24
    window: int = 4
    mem: MemKind = MemKind.DRAM

    @property
    def block_len(self) -> int:
        """Bytes of one block of one region."""
        spans = self.num_shards if self.split_axis is SplitAxis.TOKEN else 1
        return self.block_size // spans * self.token_bytes


class PatternCache:
    """Host memory shaped like a sharded paged KV cache, filled with provenance patterns."""

    def __init__(self, shape: CacheShape) -> None:
        self.shape = shape
        per_layer = 2 * shape.num_shards
        bl, nb = shape.block_len, shape.num_blocks
        self._buffers: list[ByteArray] = []
        self.views: list[ByteArray] = []
        regions: list[Region] = []
        for layer in range(shape.layers):
            if layer % 2 == 0:
                buf = np.zeros((nb, per_layer, bl), dtype=np.uint8)
                self._buffers.append(buf)
                views = [buf[:, j, :] for j in range(per_layer)]
            else:
                views = [np.zeros((nb, bl), dtype=np.uint8) for _ in range(per_layer)]
                self._buffers.extend(views)
            for j, view in enumerate(views):
                part = KVPart.K if j < shape.num_shards else KVPart.V
                regions.append(
                    Region(
                        base=int(view.ctypes.data),
                        num_blocks=nb,
                        stride=int(view.strides[0]),
                        block_len=bl,
                        mem=shape.mem,
                        layer=layer,
                        part=part,
                        shard=j % shape.num_shards,
                        group=1 if shape.window and layer % 2 else 0,
                    )
                )
                self.views.append(view)
        groups: tuple[Group, ...] = (Group(kind=GroupKind.FULL),)
        if shape.window and shape.layers > 1:
            groups += (Group(kind=GroupKind.SLIDING, window=shape.window),)
        self.layout = KVLayout(
            block_size=shape.block_size,
            regions=tuple(regions),
            split_axis=shape.split_axis,
            num_shards=shape.num_shards,
            groups=groups,
            dtype="uint8",
        )

    def pattern(self, seed: int, region: int, blocks: npt.ArrayLike) -> ByteArray:
        """Content of ``blocks`` of ``region`` under ``seed`` (one row per block)."""
        b = np.asarray(blocks, dtype=np.uint32)
        col = np.arange(self.shape.block_len, dtype=np.uint32)
        row = b * np.uint32(40503) + np.uint32((region * 7919 + seed * 104729) & 0xFFFFFFFF)
        mixed = row[:, None] * np.uint32(2246822519) + col[None, :] * np.uint32(2654435761)
        return ((mixed >> np.uint32(13)) & np.uint32(0xFF)).astype(np.uint8)

    def fill(self, seed: int) -> None:
        """Fill every block of every region with its pattern under ``seed``."""
        blocks = np.arange(self.shape.num_blocks)
        for r, view in enumerate(self.views):
            view[:] = self.pattern(seed, r, blocks)

    def expected(self, seed: int) -> ByteArray:
        """What :meth:`snapshot` returns right after ``fill(seed)``."""
        blocks = np.arange(self.shape.num_blocks)
        return np.stack([self.pattern(seed, r, blocks) for r in range(len(self.views))])

    def snapshot(self) -> ByteArray:
        """A copy of every region, shaped ``(regions, num_blocks, block_len)``."""
        return np.stack([v.copy() for v in self.views])


def locate(table: DescriptorTable, ids: IntArray) -> tuple[IntArray, IntArray, IntArray, IntArray]:
    """Region, block, offset in the block and length of each descriptor id."""
    addr = table.addr[ids].astype(np.int64)
    length = table.length[ids].astype(np.int64)
    region = np.full(len(ids), -1, dtype=np.int64)
    block = np.zeros(len(ids), dtype=np.int64)
    offset = np.zeros(len(ids), dtype=np.int64)
    for r, reg in enumerate(table.layout.regions):
        rel = addr - reg.base
        blk = rel // reg.stride
        off = rel - blk * reg.stride
        hit = (region < 0) & (rel >= 0) & (blk < reg.num_blocks) & (off + length <= reg.block_len)
        region[hit], block[hit], offset[hit] = r, blk[hit], off[hit]
    if (region < 0).any():
        raise AssertionError("a descriptor lies outside every region of its table's layout")
    return region, block, offset, length


def expected_after(
    cache: PatternCache,
    dst_seed: int,
    src_seed: int,
    dst: tuple[DescriptorTable, IntArray],
    src: tuple[DescriptorTable, IntArray],
) -> ByteArray:
    """The receiver's memory after moving descriptor pairs ``src → dst``."""
    out = cache.expected(dst_seed)
    dr, db, doff, dlen = locate(*dst)
    sr, sb, soff, slen = locate(*src)
    if not np.array_equal(dlen, slen):
        raise AssertionError("paired descriptors differ in length")
    for r, b, o, n, r2, b2, o2 in zip(dr, db, doff, dlen, sr, sb, soff):
        src_row = cache.pattern(src_seed, int(r2), [int(b2)])[0]
        out[r, b, o : o + n] = src_row[o2 : o2 + n]
    return out
