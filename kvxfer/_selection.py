"""Which descriptors a request moves: the selection behind :func:`kvxfer.descriptors.build_plan`.

A group's descriptors are cut into *units* of tokens (:class:`GroupCut`): whole
descriptors, chunks (``chunk_mode``), or window units (``swa_window_mode`` on sliding
groups, ``gcd(min(window, T), chunk)`` tokens so that a unit lies inside one granule
and one chunk). :func:`pick` selects, for one group, which listed blocks go whole and
which units of the remaining blocks go, without looking at block ids; :func:`unit_ids`
maps that selection onto one side's table ids. Selecting once and mapping twice is
what makes the local and remote plans pair by position.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvxfer.errors import ConfigError, PlanError
from kvxfer.layout import GroupKind, KVLayout

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

#: One group's block ids, or one entry per group.
BlockIds = Sequence[int] | IntArray | Sequence[Sequence[int] | IntArray]

#: In-block orders where a token's bytes are contiguous (chunks and granules need it).
TOKEN_MAJOR_LAYOUTS = frozenset({"NHD"})


class Section(enum.IntEnum):
    """The descriptor-table section holding a group's units."""

    WHOLE = 0
    CHUNK = 1
    WINDOW = 2


class GroupCut(NamedTuple):
    """How one group's descriptors are cut for plans."""

    regions: IntArray  # region indices of the group, ascending
    unit: int  # tokens per unit for last-block / window selection
    section: Section  # the table section holding units of that size
    window: int  # sliding window in tokens when window selection applies, else 0


def group_cuts(layout: KVLayout, chunk: int, swa_window_mode: bool) -> tuple[GroupCut, ...]:
    """The cut of every group for chunks of ``chunk`` tokens.

    Raises:
        ConfigError: a window that swa_window_mode cannot cut, or sub-block units on a
            layout that is not token-major.
    """
    tokens = layout.tokens_per_desc
    group_of = np.array([r.group for r in layout.regions], dtype=np.int64)
    cuts = []
    for g, group in enumerate(layout.groups):
        unit, window = chunk, 0
        if swa_window_mode and group.kind is GroupKind.SLIDING:
            window = group.window
            if layout.block_size % window:
                raise ConfigError(
                    "swa_window_mode",
                    True,
                    f"group {g}: block_size {layout.block_size} is not a multiple of the "
                    f"sliding window {window}",
                )
            if tokens % window and window % tokens:
                raise ConfigError(
                    "swa_window_mode",
                    True,
                    f"group {g}: window {window} and the {tokens}-token range of one "
                    "descriptor do not divide one another",
                )
            # A unit must lie inside one granule and (chunk_mode) inside one chunk.
            unit = math.gcd(min(window, tokens), chunk)
        if unit == tokens:
            section = Section.WHOLE
        elif unit == chunk:
            section = Section.CHUNK
        else:
            section = Section.WINDOW
        if section is not Section.WHOLE and layout.kv_layout not in TOKEN_MAJOR_LAYOUTS:
            key = "chunk_mode" if unit == chunk else "swa_window_mode"
            raise ConfigError(key, True, f"needs a token-major kv_layout, not {layout.kv_layout!r}")
        cuts.append(GroupCut(np.flatnonzero(group_of == g), unit, section, window))
    return tuple(cuts)


class Pick(NamedTuple):
    """One group's selection, independent of which side's block ids it is applied to."""

    cut: GroupCut
    whole: int  # the first `whole` listed blocks go as whole descriptors
    tail: IntArray  # listed positions whose blocks go as units
    mask: BoolArray | None  # (regions, whole + len(tail) * K) kept entries; None = all

    def touched(self, blocks: IntArray) -> IntArray:
        """The listed blocks that receive bytes under this selection."""
        return blocks if self.whole or not len(self.tail) else blocks[self.tail[0] :]


def pick(
    cut: GroupCut,
    layout: KVLayout,
    shard_start: IntArray,
    chunk: int,
    listed: int,
    num_tokens: int,
    chunk_mode: bool,
) -> Pick:
    """Select one group's units for ``listed`` blocks ending a ``num_tokens`` request.

    ``shard_start[r]`` is the first token of region *r*'s descriptor within a block.
    """
    empty = np.zeros(0, dtype=np.int64)
    if listed == 0:
        return Pick(cut, 0, empty, None)
    bs, tokens = layout.block_size, layout.tokens_per_desc
    last = -(-num_tokens // bs) - 1  # request index of the last block
    first = last + 1 - listed  # request index of the first listed block
    if not cut.window and not chunk_mode:
        return Pick(cut, listed, empty, None)  # R-DESC-2: the last block goes whole
    if cut.window:
        w = cut.window
        g_lo, g_hi = max(num_tokens - w, 0) // w, (num_tokens - 1) // w
        # Blocks wholly before the window's first granule go nowhere.
        tail = np.arange(max(g_lo * w // bs - first, 0), listed, dtype=np.int64)
        whole = 0
    else:
        tail = np.array([listed - 1], dtype=np.int64)
        whole = listed - 1
    k = tokens // cut.unit
    # Global token of each unit's first token: (regions, tail blocks, units).
    desc_start = (first + tail)[None, :] * bs + shard_start[cut.regions][:, None]
    offset = np.arange(k, dtype=np.int64) * cut.unit
    keep = np.ones((len(cut.regions), len(tail), k), dtype=np.bool_)
    if cut.window:
        granule = (desc_start[:, :, None] + offset[None, None, :]) // cut.window
        keep &= (granule >= g_lo) & (granule <= g_hi)
    if chunk_mode:
        # Of the last block only chunks holding a token go, each one whole.
        chunk_start = desc_start[:, :, None] + (offset // chunk * chunk)
        keep &= ((first + tail) != last)[None, :, None] | (chunk_start < num_tokens)
    tail_keep = keep.reshape(len(cut.regions), -1)
    if tail_keep.all():
        return Pick(cut, whole, tail, None)
    mask = np.ones((len(cut.regions), whole + tail_keep.shape[1]), dtype=np.bool_)
    mask[:, whole:] = tail_keep
    return Pick(cut, whole, tail, mask)


def unit_ids(
    sel: Pick,
    blocks: IntArray,
    num_blocks: int,
    tokens_per_desc: int,
    chunk_offset: int,
    window_offset: IntArray,
) -> IntArray:
    """Map a selection onto one side's table ids (its block ids and section offsets)."""
    cut = sel.cut
    rows = cut.regions * num_blocks
    parts: list[IntArray] = []
    if sel.whole:
        parts.append(rows[:, None] + blocks[None, : sel.whole])
    if len(sel.tail):
        tail_blocks = blocks[sel.tail]
        k = tokens_per_desc // cut.unit
        units = np.arange(k, dtype=np.int64)[None, None, :]
        if cut.section is Section.WHOLE:
            t = rows[:, None] + tail_blocks[None, :]
        elif cut.section is Section.CHUNK:
            first = chunk_offset + (rows[:, None] + tail_blocks[None, :]) * k
            t = (first[:, :, None] + units).reshape(len(rows), -1)
        else:
            first = window_offset[cut.regions][:, None] + tail_blocks[None, :] * k
            t = (first[:, :, None] + units).reshape(len(rows), -1)
        parts.append(t)
    if not parts:
        return np.zeros(0, dtype=np.int64)
    ids = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    return ids[sel.mask] if sel.mask is not None else ids.ravel()


def as_groups(blocks: BlockIds, num_groups: int, side: str) -> list[IntArray]:
    """Normalize one array (single group) or one array per group to int64 copies."""
    items: list[Any]
    if isinstance(blocks, np.ndarray):
        items = [blocks] if blocks.ndim == 1 else list(blocks)
    else:
        seq = list(blocks)
        # Peek at one element only: checking every id in Python would cost a loop per
        # block, and numpy rejects mixed input below anyway.
        flat = not seq or isinstance(seq[0], (int, np.integer))
        if flat and seq and num_groups > 1:
            raise PlanError(
                f"{side} blocks: one flat list given, the layout has {num_groups} groups; "
                "pass one list per group"
            )
        items = [seq] if flat and num_groups == 1 else seq
    if len(items) != num_groups:
        raise PlanError(f"{side} blocks: {len(items)} group(s) given, the layout has {num_groups}")
    out = []
    for g, item in enumerate(items):
        try:
            arr = np.array(item, dtype=np.int64) if not isinstance(item, np.ndarray) else item
        except (TypeError, ValueError) as exc:
            raise PlanError(f"{side} blocks of group {g}: not a list of block ids") from exc
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise PlanError(f"{side} blocks of group {g}: need a 1-d integer array")
        out.append(arr.astype(np.int64, copy=True))
    return out


def check_range(blocks: IntArray, num_blocks: int, side: str, group: int) -> None:
    """Raise PlanError naming the first block id outside ``[0, num_blocks)``."""
    if blocks.size and (blocks.min() < 0 or blocks.max() >= num_blocks):
        pos = int(np.flatnonzero((blocks < 0) | (blocks >= num_blocks))[0])
        raise PlanError(
            f"{side} block id {int(blocks[pos])} (group {group}, position {pos}) "
            f"out of range [0, {num_blocks})"
        )
