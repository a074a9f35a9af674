"""Which descriptors a request moves: the selection behind
:func:`kvxfer.core.descriptors.build_plan`.

A group's descriptors are cut into *units* of tokens (:class:`GroupCut`): whole
descriptors, chunks (``chunk_mode``), or window units (``swa_window_mode`` on sliding
groups, ``gcd(window, T, chunk)`` tokens so that a unit lies inside one granule, one
descriptor and one chunk). :func:`pick` selects, for one group, which listed blocks go whole and
which units of the remaining blocks go, without looking at block ids; :func:`unit_ids`
maps that selection onto one side's table ids. Selecting once and mapping twice is
what makes the local and remote plans pair by position.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvxfer.core.layout import GroupKind, KVLayout
from kvxfer.errors import ConfigError

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

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
    state: bool = False  # a recurrent-state group: every listed slot goes whole


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
        if group.is_state:
            # State slots hold no tokens: neither chunks nor granules apply.
            regions = np.flatnonzero(group_of == g)
            cuts.append(GroupCut(regions, tokens, Section.WHOLE, 0, True))
            continue
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
            # A unit must lie inside one granule, one descriptor and (chunk_mode) one
            # chunk. Window and range need not nest: 6-token blocks over 3 TOKEN shards
            # (2 tokens a descriptor) with a 3-token window cut 1-token units.
            unit = math.gcd(window, tokens, chunk)
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
    """One group's selection, independent of which side's block ids it is applied to.

    Listed positions ``[0, skip)`` move nothing (before the window), ``[skip, skip +
    whole)`` go as whole descriptors and the remaining ``tail`` positions go as units
    (``K = tokens_per_desc / cut.unit`` per block and region).
    """

    cut: GroupCut
    skip: int
    whole: int
    tail: int
    mask: BoolArray | None  # (regions, whole + tail * K) entries kept; None = all
    full: BoolArray | None  # (regions, tail): the block's units all go, as one whole

    def touched(self, blocks: IntArray) -> IntArray:
        """The listed blocks that receive bytes under this selection."""
        return blocks[self.skip :] if self.skip else blocks


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
    A (region, block) whose units all go is sent as its one whole descriptor, so a
    plan never splits what a single descriptor moves (with or without coalescing).
    """
    if listed == 0:
        return Pick(cut, 0, 0, 0, None, None)
    bs, tokens = layout.block_size, layout.tokens_per_desc
    last = -(-num_tokens // bs) - 1  # request index of the last block
    first = last + 1 - listed  # request index of the first listed block
    if cut.state or (not cut.window and not chunk_mode):
        # R-DESC-2: the last block goes whole; a state slot always does.
        return Pick(cut, 0, listed, 0, None, None)
    if cut.window:
        w = cut.window
        g_lo, g_hi = max(num_tokens - w, 0) // w, (num_tokens - 1) // w
        # Blocks wholly before the window's first granule go nowhere.
        skip = min(max(g_lo * w // bs - first, 0), listed)
        whole = 0
    else:
        skip, whole = 0, listed - 1
    tail = listed - skip - whole
    k = tokens // cut.unit
    # Global token of each unit's first token: (regions, tail blocks, units).
    tail_index = first + skip + whole + np.arange(tail, dtype=np.int64)
    desc_start = tail_index[None, :] * bs + shard_start[cut.regions][:, None]
    offset = np.arange(k, dtype=np.int64) * cut.unit
    keep = np.ones((len(cut.regions), tail, k), dtype=np.bool_)
    if cut.window:
        granule = (desc_start[:, :, None] + offset[None, None, :]) // cut.window
        keep &= (granule >= g_lo) & (granule <= g_hi)
    if chunk_mode:
        # Of the last block only chunks holding a token go, each one whole.
        chunk_start = desc_start[:, :, None] + (offset // chunk * chunk)
        keep &= (tail_index != last)[None, :, None] | (chunk_start < num_tokens)
    all_units: BoolArray = np.all(keep, axis=2)
    if all_units.all():
        return Pick(cut, skip, whole + tail, 0, None, None)
    full: BoolArray | None = None
    if k > 1 and all_units.any():
        keep[:, :, 1:] &= ~all_units[:, :, None]  # unit 0 stands for the whole descriptor
        full = all_units
    mask = np.ones((len(cut.regions), whole + tail * k), dtype=np.bool_)
    mask[:, whole:] = keep.reshape(len(cut.regions), -1)
    return Pick(cut, skip, whole, tail, mask, full)


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
    lo = sel.skip + sel.whole
    if sel.whole:
        parts.append(rows[:, None] + blocks[None, sel.skip : lo])
    if sel.tail:
        tail_blocks = blocks[lo:]
        k = tokens_per_desc // cut.unit
        units = np.arange(k, dtype=np.int64)[None, None, :]
        if cut.section is Section.WHOLE:  # k == 1: the units are the descriptors
            first = rows[:, None] + tail_blocks[None, :]
        elif cut.section is Section.CHUNK:
            first = chunk_offset + (rows[:, None] + tail_blocks[None, :]) * k
        else:
            first = window_offset[cut.regions][:, None] + tail_blocks[None, :] * k
        t = first[:, :, None] + units
        if sel.full is not None:
            t[:, :, 0] = np.where(sel.full, rows[:, None] + tail_blocks[None, :], t[:, :, 0])
        parts.append(t.reshape(len(rows), -1))
    if not parts:
        return np.zeros(0, dtype=np.int64)
    ids = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    return ids[sel.mask] if sel.mask is not None else ids.ravel()
