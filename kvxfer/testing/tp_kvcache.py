"""One tensor-parallel rank's paged KV cache in host memory, head-major (HND).

A :class:`TPHostCache` holds, per (layer, K/V), one buffer of ``num_blocks`` blocks,
each block ``heads_per_rank`` heads of ``block_size`` tokens (vLLM's CPU cache
interior); it is described one region per (layer, K/V, head) with ``Region.head`` the
global head, or one region per (layer, K/V) of all the rank's heads (an engine's
default description, which pairings across TP sizes cut per head). A producer fills every
(layer, part, global head, block, token) with a pattern of those values and its seed,
so replicas of a head on several ranks hold the same bytes (as an engine's do) and a
consumer checks byte for byte, per (layer, K/V, head, token), that its block *x*
received producer block *y*.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvxfer.core.heads import HeadLayout
from kvxfer.core.layout import Group, GroupKind, KVLayout, KVPart, MemKind, Region, SplitAxis

__all__ = ["Mismatch", "TPHostCache"]

#: (layer, part, global head, local block, token) of a wrong token.
Mismatch = tuple[int, KVPart, int, int, int]


class TPHostCache:
    """Rank ``rank``'s cache of a model split by ``heads``.

    Args:
        heads: The TP group's head layout.
        rank: This rank.
        layers: Model layers (each with K and V).
        head_bytes: Bytes of one head of one token.
        block_size: Tokens per block.
        num_blocks: Blocks of the cache.
        fill_seed: Fill with the provenance pattern of this seed; None: zeros.
    """

    def __init__(
        self,
        heads: HeadLayout,
        rank: int,
        *,
        layers: int = 2,
        head_bytes: int = 8,
        block_size: int = 4,
        num_blocks: int = 16,
        fill_seed: int | None = None,
    ) -> None:
        self.heads, self.rank = heads, rank
        self.held = heads.heads_of(rank)
        self.layers, self.head_bytes = layers, head_bytes
        self.block_size, self.num_blocks = block_size, num_blocks
        n = len(self.held)
        # (layer, part) -> (num_blocks, heads, block_size, head_bytes): head-major blocks
        self.buffers: dict[tuple[int, KVPart], npt.NDArray[np.uint8]] = {
            (layer, part): np.zeros((num_blocks, n, block_size, head_bytes), dtype=np.uint8)
            for layer in range(layers)
            for part in (KVPart.K, KVPart.V)
        }
        if fill_seed is not None:
            every = np.arange(num_blocks)
            for (layer, part), buf in self.buffers.items():
                for i, h in enumerate(self.held):
                    buf[:, i] = self.pattern(fill_seed, layer, part, h, every)

    def pattern(
        self, seed: int, layer: int, part: KVPart, head: int, blocks: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.uint8]:
        """A producer's bytes of ``blocks`` of (layer, part, global head):
        ``(len(blocks), block_size, head_bytes)``."""
        b = np.asarray(blocks, dtype=np.uint32)[:, None, None]
        t = np.arange(self.block_size, dtype=np.uint32)[None, :, None]
        d = np.arange(self.head_bytes, dtype=np.uint32)[None, None, :]
        key = np.uint32(
            (seed * 131 + layer * 31 + (part is KVPart.V) * 7 + head) * 2654435761 % 2**32
        )
        mixed = (b * np.uint32(40503) + t * np.uint32(97) + d * np.uint32(13) + key) * np.uint32(
            2246822519
        )
        out: npt.NDArray[np.uint8] = (mixed >> np.uint32(24)).astype(np.uint8)
        return out

    def layout(self, *, global_heads: bool = True, per_head: bool = True) -> KVLayout:
        """The layout: one region per (layer, K/V, head), ``Region.head`` global (or the
        tensor's own head index with ``global_heads=False``, for the Agent to place);
        with ``per_head=False`` one region per (layer, K/V) holding all the rank's
        heads (an engine's default description, which pairs across TP sizes are cut
        from)."""
        per_head_bytes = self.block_size * self.head_bytes
        n = len(self.held)
        if not per_head:
            return self._layout(
                [
                    Region(
                        base=int(buf.ctypes.data),
                        num_blocks=self.num_blocks,
                        stride=buf.strides[0],
                        block_len=n * per_head_bytes,
                        mem=MemKind.DRAM,
                        device_id=0,
                        layer=layer,
                        part=part,
                        head=self.held.start if global_heads else 0,
                    )
                    for (layer, part), buf in self.buffers.items()
                ],
                heads=n,
            )
        regions = []
        for (layer, part), buf in self.buffers.items():
            for i, h in enumerate(self.held):
                regions.append(
                    Region(
                        base=int(buf.ctypes.data) + i * per_head_bytes,
                        num_blocks=self.num_blocks,
                        stride=buf.strides[0],
                        block_len=per_head_bytes,
                        mem=MemKind.DRAM,
                        device_id=0,
                        layer=layer,
                        part=part,
                        head=h if global_heads else i,
                    )
                )
        return self._layout(regions, heads=1)

    def _layout(self, regions: Sequence[Region], *, heads: int) -> KVLayout:
        return KVLayout(
            block_size=self.block_size,
            regions=tuple(regions),
            groups=(Group(kind=GroupKind.FULL),),
            dtype="uint8",
            split_axis=SplitAxis.HEAD,
            num_shards=1,
            num_kv_heads=heads,
            kv_layout="HND",
        )

    def zero(self) -> None:
        """Clear every byte (a consumer's empty cache)."""
        for buf in self.buffers.values():
            buf[:] = 0

    def mismatches(
        self, local_blocks: Sequence[int], remote_blocks: Sequence[int], seed: int
    ) -> list[Mismatch]:
        """Every (layer, part, head, local block, token) whose bytes are not the
        producer's (``seed``) for the paired remote block."""
        local = np.asarray(local_blocks, dtype=np.int64)
        remote = np.asarray(remote_blocks, dtype=np.int64)
        out: list[Mismatch] = []
        for (layer, part), buf in self.buffers.items():
            for i, h in enumerate(self.held):
                expected = self.pattern(seed, layer, part, h, remote)
                bad = np.argwhere((buf[local, i] != expected).any(axis=2))
                out += [(layer, part, h, int(local[j]), int(tok)) for j, tok in bad]
        return out
