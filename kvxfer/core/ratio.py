"""Different block sizes on the two sides of a transfer (issue 54, R-COMPAT-3).

Operators size prefill and decode apart: llm-d runs prefill with 128-token blocks and
decode with 16. A block of one side then holds the tokens of ``k`` blocks of the other
(or of a ``1/k`` part of one). kvxfer moves such pairs exactly and in place, with no
copy after the transfer, because a block's bytes for a token range can always be
named as address ranges:

* the request is cut into *units* of ``g = min(local, remote)`` block-size tokens: a
  unit is a whole block of the smaller side and one of the ``k`` *pieces* of a block
  of the larger side (piece *p* holds the block's tokens ``[p*g, (p+1)*g)``);
* :func:`pair_units` pairs the units of the two sides' block lists by token position
  (both lists end at their request's last token, a prefix-cache hit shortens the
  local one), never past the request's last token: the uncovered tail of a larger
  block's last piece is never written nor read;
* :func:`unit_runs` turns each unit into the address ranges it occupies in every
  region of its group (one range in a token-major region, one per head in a
  head-major one, one per key element and one for the values in vLLM's CPU cache) and
  merges ranges contiguous on both sides.

:func:`check_ratio` is the handshake's rule: one size divides the other, the layouts
agree in shape once both are described at ``g`` tokens per block, and nothing the
ratio cannot serve (recurrent-state groups, token-split shards, an in-block order
that is not known, TP sizes that differ) is present; each refusal names both sizes.
Pure numpy; nothing here touches a transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt

from kvxfer.core.blocks import BlockIds, BlockRules, Groups, block_groups, check_counts, from_wire
from kvxfer.core.descriptors import Runs
from kvxfer.core.layout import BlockInterior, KVLayout, KVPart, Region, SplitAxis
from kvxfer.core.merging import run_starts
from kvxfer.errors import LayoutMismatch, PlanError

__all__ = [
    "UnitPairing",
    "Units",
    "at_unit",
    "check_ratio",
    "covered_blocks",
    "pair_ratio",
    "pair_units",
    "ratio_pieces",
    "slices_per_unit",
    "unit_runs",
    "units_between",
]

IntArray = npt.NDArray[np.int64]
UIntArray = npt.NDArray[np.uint64]

_RULE = (
    "one block size must be a whole multiple of the other (prefill 128 with decode 16 "
    "or 64, or the reverse)"
)


def ratio_pieces(local_block_size: int, remote_block_size: int) -> tuple[int, int, int]:
    """``(g, k_local, k_remote)``: the unit in tokens and how many units one block of
    each side holds (1 on the smaller side).

    Raises:
        LayoutMismatch: neither size divides the other (naming both).
    """
    small, big = sorted((local_block_size, remote_block_size))
    if small < 1 or big % small:
        raise LayoutMismatch(f"block_size ({_RULE})", local_block_size, remote_block_size)
    return small, local_block_size // small, remote_block_size // small


def at_unit(layout: KVLayout, unit: int) -> KVLayout:
    """``layout`` described as if its blocks held ``unit`` tokens (each region's
    ``block_len`` scaled; addresses and strides as they are): the shape two layouts of
    different block sizes are compared in. Not a layout to address memory with."""
    if unit == layout.block_size:
        return layout
    regions = tuple(
        msgspec.structs.replace(r, block_len=r.block_len * unit // layout.block_size)
        for r in layout.regions
    )
    return msgspec.structs.replace(layout, block_size=unit, regions=regions)


def check_ratio(
    local: KVLayout, remote: KVLayout, *, local_tp_size: int = 1, remote_tp_size: int = 1
) -> int:
    """Raise unless two layouts of different block sizes can exchange KV; return the
    unit ``g`` in tokens.

    Raises:
        LayoutMismatch: naming both block sizes and what stops the pair: sizes neither
            of which divides the other, a recurrent-state group, token-split shards, an
            in-block order not known per token, TP sizes that differ, or (after
            describing both at ``g`` tokens) the first field where the shapes differ.
    """
    g, _, _ = ratio_pieces(local.block_size, remote.block_size)
    sizes = (local.block_size, remote.block_size)

    def refuse(why: str) -> LayoutMismatch:
        return LayoutMismatch(f"block_size ({why})", *sizes)

    if local_tp_size != remote_tp_size:
        raise refuse(
            f"different block sizes are served between equal TP sizes only, not TP "
            f"{local_tp_size} with TP {remote_tp_size}"
        )
    for side, layout in (("local", local), ("remote", remote)):
        if any(gr.is_state for gr in layout.groups):
            raise refuse(
                f"the {side} layout has a recurrent-state group: vLLM sizes a hybrid "
                "model's blocks to its state pages, so give both instances one block size"
            )
        if layout.split_axis is SplitAxis.TOKEN and layout.num_shards > 1:
            raise refuse(f"the {side} layout splits blocks into {layout.num_shards} token shards")
        if _geometry_error(layout) is not None:
            raise refuse(f"the {side} layout: {_geometry_error(layout)}")
    difference = at_unit(local, g).first_difference(at_unit(remote, g))
    if difference is not None:
        field, mine, theirs = difference
        raise LayoutMismatch(f"{field} (described at {g} tokens per block)", mine, theirs)
    return g


def _geometry_error(layout: KVLayout) -> str | None:
    """Why a token range of this layout's blocks cannot be named (None: it can)."""
    if layout.interior is BlockInterior.PLAIN:
        if layout.kv_layout == "NHD":
            return None
        if layout.kv_layout != "HND":
            return f"kv_layout {layout.kv_layout!r} is not one whose token order is known"
        if layout.num_kv_heads < 1:
            return "a head-major block whose head count per region is not known"
        if layout.num_kv_heads > 1 and any(r.part is KVPart.KV for r in layout.regions):
            return "head-major regions pack K and V per head in an order not stated"
        return None
    if layout.interior is BlockInterior.OPAQUE:
        return "its in-block token order is not stated for every region"
    heads, dim = layout.num_kv_heads, layout.head_dim
    if heads < 1 or dim < 1:
        return f"interior {layout.interior.value} needs num_kv_heads and head_dim"
    for r in layout.regions:
        if r.part is not KVPart.KV or r.block_len % (heads * 2 * layout.block_size * dim):
            return (
                f"interior {layout.interior.value}: region of layer {r.layer} "
                f"{r.part.name} is not {heads} packed K/V heads of {dim} elements"
            )
    return None


class Units(NamedTuple):
    """One group's units, paired by position: block and piece on each side."""

    local_block: IntArray
    local_piece: IntArray
    remote_block: IntArray
    remote_piece: IntArray


class UnitPairing(NamedTuple):
    """A request's block ids of two block sizes, checked and paired unit by unit
    (:func:`pair_units`); what a pull between different block sizes posts from."""

    #: The local blocks per group (as the request listed them).
    local: Groups
    #: The ticket's blocks per group.
    remote: Groups
    #: The tokens the local blocks end at.
    num_tokens: int
    local_block_size: int
    remote_block_size: int
    #: Tokens of one unit (the smaller block size).
    unit: int
    #: Per group, its units.
    units: tuple[Units, ...]


def units_between(
    local: Sequence[int] | IntArray,
    remote: Sequence[int] | IntArray,
    u0: int,
    u1: int,
    local_side: tuple[int, int],
    remote_side: tuple[int, int],
) -> Units:
    """The units ``u0 .. u1`` (by token position, none when ``u1 <= u0``) of two block
    lists; each side is ``(k, first)``: units per block and the position of its list's
    first block."""
    (kl, first_local), (kr, first_remote) = local_side, remote_side
    u = np.arange(u0, max(u0, u1), dtype=np.int64)
    return Units(
        local_block=np.asarray(local, dtype=np.int64)[u // kl - first_local],
        local_piece=u % kl,
        remote_block=np.asarray(remote, dtype=np.int64)[u // kr - first_remote],
        remote_piece=u % kr,
    )


def pair_units(
    local: Groups,
    remote: Groups,
    *,
    num_tokens: int,
    remote_num_tokens: int,
    local_block_size: int,
    remote_block_size: int,
    request_id: str = "",
) -> UnitPairing:
    """Pair two block lists of different block sizes unit by unit.

    Each list holds the *last* blocks of its token count (``local``: of
    ``num_tokens``, checked by :func:`kvxfer.core.blocks.check_counts`; ``remote``: of
    ``remote_num_tokens``, all of them from a hold). The units are those of the local
    blocks' token positions up to the request's last token; each is read from the
    remote unit at the same position.

    Raises:
        PlanError: another group count, more tokens than the remote side holds, or
            local positions the remote list does not cover (naming both ranges).
        LayoutMismatch: sizes neither of which divides the other.
    """
    g, kl, kr = ratio_pieces(local_block_size, remote_block_size)
    if len(remote) != len(local):
        raise PlanError(
            f"remote block_ids of {request_id!r}: {len(remote)} KV group(s), the local "
            f"block_ids {len(local)}"
        )
    remote_tokens = remote_num_tokens or num_tokens
    if num_tokens > remote_tokens:
        raise PlanError(
            f"num_tokens={num_tokens}: more than the ticket's {remote_tokens} tokens "
            f"(request {request_id!r})"
        )
    last_unit = -(-num_tokens // g)
    wanted = -(-num_tokens // local_block_size)
    held = -(-remote_tokens // remote_block_size)
    remote_end = min(held * kr, -(-remote_tokens // g))
    per_group = []
    for gi, (mine, theirs) in enumerate(zip(local, remote, strict=True)):
        first_local = wanted - len(mine)
        first_remote = held - len(theirs)
        u0, u1 = first_local * kl, min(wanted * kl, last_unit)
        if len(mine) and (u0 < first_remote * kr or u1 > remote_end):
            raise PlanError(
                f"remote group {gi}: the ticket of {request_id!r} holds tokens "
                f"{first_remote * remote_block_size}..{remote_tokens} in blocks of "
                f"{remote_block_size}; the {len(mine)} local block(s) of {local_block_size} "
                f"need tokens {u0 * g}..{num_tokens}"
            )
        per_group.append(units_between(mine, theirs, u0, u1, (kl, first_local), (kr, first_remote)))
    return UnitPairing(
        local=local,
        remote=remote,
        num_tokens=num_tokens,
        local_block_size=local_block_size,
        remote_block_size=remote_block_size,
        unit=g,
        units=tuple(per_group),
    )


def _slices(layout: KVLayout, region: Region, unit: int) -> tuple[UIntArray, UIntArray, UIntArray]:
    """Where a unit lies in one block of ``region``: ``(first, step, length)``: the
    unit's slice *s* of piece *p* starts at ``first[s] + p * step[s]`` bytes into the
    block and is ``length[s]`` bytes long."""
    bs = layout.block_size
    if layout.interior is BlockInterior.K_ELEMENT_MAJOR:
        heads, dim = layout.num_kv_heads, layout.head_dim
        elem = region.block_len // (heads * 2 * bs * dim)
        per_head = 2 * bs * dim * elem
        # Per head: head_dim key rows of block_size elements, then the values' rows.
        k_first = np.arange(heads, dtype=np.uint64)[:, None] * np.uint64(per_head) + np.arange(
            dim, dtype=np.uint64
        )[None, :] * np.uint64(bs * elem)
        v_first = np.arange(heads, dtype=np.uint64)[:, None] * np.uint64(per_head) + np.uint64(
            bs * dim * elem
        )
        first = np.concatenate((k_first, v_first), axis=1).ravel()
        step = np.tile(np.array([unit * elem] * dim + [unit * dim * elem], dtype=np.uint64), heads)
        return first, step, step.copy()
    heads = layout.num_kv_heads if layout.kv_layout == "HND" else 1
    per_head = region.block_len // heads
    per_unit = per_head // bs * unit
    first = np.arange(heads, dtype=np.uint64) * np.uint64(per_head)
    step = np.full(heads, per_unit, dtype=np.uint64)
    return first, step, step.copy()


def unit_runs(local: KVLayout, remote: KVLayout, pairing: UnitPairing) -> Runs:
    """The address runs of a unit pairing: every unit in every region of its group,
    local and remote paired by position, merged where both sides continue
    contiguously (in local address order, which loses no merge).

    Raises:
        PlanError: the layouts are not those the pairing was made for (block sizes),
            or their regions do not pair (:func:`check_ratio` was not passed).
    """
    if (local.block_size, remote.block_size) != (
        pairing.local_block_size,
        pairing.remote_block_size,
    ):
        raise PlanError(
            f"unit pairing of blocks of {pairing.local_block_size} (local) and "
            f"{pairing.remote_block_size} (remote) planned on layouts of "
            f"{local.block_size} and {remote.block_size}"
        )
    if len(local.regions) != len(remote.regions):
        raise PlanError(
            f"{len(local.regions)} local and {len(remote.regions)} remote regions do not pair"
        )
    unit = pairing.unit
    la: list[UIntArray] = []
    ra: list[UIntArray] = []
    ln: list[UIntArray] = []
    ld: list[IntArray] = []
    rd: list[IntArray] = []
    for lr, rr in zip(local.regions, remote.regions, strict=True):
        units = pairing.units[lr.group]
        if not len(units.local_block):
            continue
        lf, ls, llen = _slices(local, lr, unit)
        rf, rs, rlen = _slices(remote, rr, unit)
        if len(lf) != len(rf) or (llen != rlen).any():
            raise PlanError(
                f"region of layer {lr.layer} {lr.part.name}: {len(lf)} local and {len(rf)} "
                "remote slices per unit do not pair"
            )
        lstart = np.uint64(lr.base) + units.local_block.astype(np.uint64) * np.uint64(lr.stride)
        rstart = np.uint64(rr.base) + units.remote_block.astype(np.uint64) * np.uint64(rr.stride)
        lp, rp = units.local_piece.astype(np.uint64), units.remote_piece.astype(np.uint64)
        la.append((lstart[:, None] + lf[None, :] + lp[:, None] * ls[None, :]).ravel())
        ra.append((rstart[:, None] + rf[None, :] + rp[:, None] * rs[None, :]).ravel())
        n = len(lstart) * len(lf)
        ln.append(np.tile(llen, len(lstart)))
        ld.append(np.full(n, lr.device_id, dtype=np.int64))
        rd.append(np.full(n, rr.device_id, dtype=np.int64))
    if not la:
        empty_u, empty_i = np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)
        return Runs(empty_u, empty_u.copy(), empty_u.copy(), empty_i, empty_i.copy())
    l_addr, r_addr, length = np.concatenate(la), np.concatenate(ra), np.concatenate(ln)
    l_dev, r_dev = np.concatenate(ld), np.concatenate(rd)
    order = np.lexsort((l_addr, l_dev))
    l_addr, r_addr, length = l_addr[order], r_addr[order], length[order]
    l_dev, r_dev = l_dev[order], r_dev[order]
    starts = run_starts(l_addr, r_addr, length, l_dev, r_dev)
    total = np.concatenate((np.zeros(1, dtype=np.uint64), np.cumsum(length, dtype=np.uint64)))
    ends = np.append(starts[1:], len(length))
    return Runs(
        l_addr[starts],
        r_addr[starts],
        total[ends] - total[starts],
        l_dev[starts],
        r_dev[starts],
    )


def covered_blocks(pairing: UnitPairing) -> tuple[IntArray, ...]:
    """Per group, the local blocks that receive bytes, in request order."""
    out = []
    for units in pairing.units:
        blocks = units.local_block
        keep = np.ones(len(blocks), dtype=np.bool_)
        keep[1:] = blocks[1:] != blocks[:-1]
        out.append(blocks[keep])
    return tuple(out)


def slices_per_unit(layout: KVLayout) -> Sequence[int]:
    """Per region, the address ranges one unit occupies (for a plan's descriptor count)."""
    return [len(_slices(layout, r, layout.block_size)[0]) for r in layout.regions]


def pair_ratio(
    local_ids: BlockIds,
    ticket_ids: tuple[tuple[int, ...], ...],
    rules: BlockRules,
    *,
    num_tokens: int,
    remote_num_tokens: int,
    remote_block_size: int,
    cached_blocks: int = 0,
    request_id: str = "",
) -> UnitPairing:
    """:func:`kvxfer.core.blocks.pair` for a ticket of another block size: the local
    ids checked (:func:`~kvxfer.core.blocks.block_groups`,
    :func:`~kvxfer.core.blocks.check_counts`) and paired unit by unit.

    Raises:
        PlanError: an id or a count breaks a rule, or a recurrent-state group (whose
            slots a block-size ratio does not serve).
        LayoutMismatch: sizes neither of which divides the other.
    """
    if any(rules.state):
        raise PlanError(
            f"request {request_id!r}: blocks of {rules.block_size} tokens here and "
            f"{remote_block_size} at the producer, with a recurrent-state group: give "
            "both instances one block size"
        )
    local = block_groups(local_ids, rules.num_groups, num_blocks=rules.num_blocks, broadcast=True)
    check_counts(
        local,
        num_tokens=num_tokens,
        block_size=rules.block_size,
        cached_blocks=cached_blocks,
        sliding=rules.sliding,
    )
    return pair_units(
        local,
        from_wire(ticket_ids),
        num_tokens=num_tokens,
        remote_num_tokens=remote_num_tokens,
        local_block_size=rules.block_size,
        remote_block_size=remote_block_size,
        request_id=request_id,
    )
