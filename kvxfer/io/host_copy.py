"""The gather path's copies on host memory, by address (issue 55).

A producer gathers a round's pieces from its cache into its staging slot; a consumer
scatters the slot it READ into its own blocks. Both are plain ``memmove`` calls over
addresses the agent registered with its backend, so the whole path runs between two
processes on host memory (the fake and ``ucx`` backends) with no engine library. A
device cache takes a device copy instead (the backend's business, not this module's).

The slot bounds are checked before any byte moves: a piece outside the slot would
write (or read) memory nobody lent to this round.
"""

from __future__ import annotations

import ctypes

from kvxfer.core.gather_plan import Copies
from kvxfer.errors import PlanError

__all__ = ["gather_into", "scatter_from"]


def _check(copies: Copies, slot_nbytes: int) -> None:
    if len(copies) and int((copies.offset + copies.length).max()) > slot_nbytes:
        raise PlanError(f"a round's copies reach past its {slot_nbytes}-byte staging slot")


def gather_into(copies: Copies, slot_addr: int, slot_nbytes: int) -> int:
    """Copy each piece from engine address ``copies.addr[i]`` to ``slot_addr +
    copies.offset[i]``; returns the bytes copied.

    Raises:
        PlanError: a piece reaches past the slot's ``slot_nbytes`` bytes.
    """
    _check(copies, slot_nbytes)
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
    for a, o, n in zip(copies.addr.tolist(), copies.offset.tolist(), copies.length.tolist()):
        ctypes.memmove(a, slot_addr + o, n)
    return copies.nbytes
