"""The gather path's copies on host memory, by address (issue 55).

A producer gathers a round's pieces from its cache into its staging slot; a consumer
scatters the slot it READ into its own blocks. Both are plain copies over addresses
the agent registered with its backend: pieces that share a row width (a KV block's
bytes per head, whole blocks) go as rows in one numpy call, others one ``memmove``
each. So the whole path runs between two processes on host memory (the fake and
``ucx`` backends) with no engine library. A device cache takes a device copy instead
(the backend's business, not this module's).

The slot bounds are checked before any byte moves: a piece outside the slot would
write (or read) memory nobody lent to this round.
"""

from __future__ import annotations

import ctypes
from math import gcd
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.core.gather_plan import Copies
from kvxfer.errors import PlanError

__all__ = ["gather_into", "scatter_from"]

#: Rows narrower than this go piece by piece: a row-wise copy would index too many rows.
_MIN_ROW = 64
#: Rounds of fewer pieces go piece by piece: the row index costs more than it saves.
_FEW = 16
#: Rounds whose pieces average more bytes than this go piece by piece: a memmove call
#: costs less than the indexed copy's second pass through a temporary (measured with
#: ``kvxfer bench --gather`` on 2 cores: 512-byte pieces twice as fast by rows, 4 KiB
#: pieces twice as fast one by one).
_MAX_MEAN_PIECE = 2048

IntArray = npt.NDArray[np.intp]


def _check(copies: Copies, slot_nbytes: int) -> None:
    if len(copies) and int((copies.offset + copies.length).max()) > slot_nbytes:
        raise PlanError(f"a round's copies reach past its {slot_nbytes}-byte staging slot")


class _Span:
    """``rows`` rows of ``width`` bytes from address ``addr``, as numpy sees an array
    (nothing is read or written until a row is indexed: the span may cross memory
    between a cache's regions that no row ever touches)."""

    def __init__(self, addr: int, rows: int, width: int) -> None:
        self.__array_interface__: dict[str, Any] = {
            "data": (addr, False),
            "shape": (rows, width),
            "typestr": "|u1",
            "version": 3,
        }


def _row_index(start_bytes: npt.NDArray[np.uint64], counts: IntArray, width: int) -> IntArray:
    """The rows of every piece in order: piece ``i`` covers ``counts[i]`` rows from row
    ``start_bytes[i] // width``."""
    total = int(counts.sum())
    first = np.repeat((start_bytes // np.uint64(width)).astype(np.intp), counts)
    before = np.repeat(np.cumsum(counts) - counts, counts)
    out: IntArray = first + (np.arange(total, dtype=np.intp) - before)
    return out


def _by_rows(copies: Copies, slot_addr: int, to_slot: bool) -> bool:
    """Copy ``copies`` as rows of their common width (a few numpy calls, C loops over
    rows, instead of a Python call per piece); False where the pieces share no row
    width worth it (then nothing was copied).

    The width divides every length and slot offset. Engine addresses fall into one
    class per remainder modulo the width (a cache's regions are separate allocations,
    each its own remainder); inside a class every piece starts a whole number of rows
    from the class's lowest address, so each class is one indexed copy."""
    if len(copies) < _FEW or copies.nbytes > _MAX_MEAN_PIECE * len(copies):
        return False
    width = gcd(int(np.gcd.reduce(copies.length)), int(np.gcd.reduce(copies.offset)))
    if width < _MIN_ROW:
        return False
    residue = copies.addr % np.uint64(width)
    classes, which = np.unique(residue, return_inverse=True)
    if len(classes) * _FEW > len(copies):
        return False  # too few pieces per class: the index would not pay
    counts = (copies.length // np.uint64(width)).astype(np.intp)
    end = int((copies.offset + copies.length).max())
    slot = np.asarray(_Span(slot_addr, end // width, width))
    for k in range(len(classes)):
        pick = np.flatnonzero(which == k) if len(classes) > 1 else slice(None)
        base = int(copies.addr[pick].min())
        rows = _row_index(copies.addr[pick] - np.uint64(base), counts[pick], width)
        mine = _row_index(copies.offset[pick], counts[pick], width)
        engine = np.asarray(_Span(base, int(rows.max()) + 1, width))
        if to_slot:
            slot[mine] = engine[rows]
        else:
            engine[rows] = slot[mine]
    return True


def gather_into(copies: Copies, slot_addr: int, slot_nbytes: int) -> int:
    """Copy each piece from engine address ``copies.addr[i]`` to ``slot_addr +
    copies.offset[i]``; returns the bytes copied.

    Raises:
        PlanError: a piece reaches past the slot's ``slot_nbytes`` bytes.
    """
    _check(copies, slot_nbytes)
    if not _by_rows(copies, slot_addr, to_slot=True):
        for a, o, n in zip(copies.addr.tolist(), copies.offset.tolist(), copies.length.tolist()):
            ctypes.memmove(slot_addr + o, a, n)
    return copies.nbytes


def scatter_from(copies: Copies, slot_addr: int, slot_nbytes: int) -> int:
    """Copy each piece from ``slot_addr + copies.offset[i]`` to engine address
    ``copies.addr[i]``; returns the bytes copied.

    Raises:
        PlanError: a piece reaches past the slot's ``slot_nbytes`` bytes.
    """
    _check(copies, slot_nbytes)
    if not _by_rows(copies, slot_addr, to_slot=False):
        for a, o, n in zip(copies.addr.tolist(), copies.offset.tolist(), copies.length.tolist()):
            ctypes.memmove(a, slot_addr + o, n)
    return copies.nbytes
