"""Fail-closed pulls (R-SAFE-1): the producer's guard table and the consumer's verdict.

A one-sided READ is invisible to the producer, so it cannot refuse one, and a wall
clock proves nothing (skew, tickets without ``lease_expiry``, tickets pulled twice).
Instead every hold gets one 64-bit word in a small table the producer's backend
registered (:meth:`~kvxfer.backend.Backend.register_guard`): a fresh random
generation while the blocks are held, overwritten with ``reason << 56 | generation``
*before* the request id reaches :meth:`~kvxfer.agent.Agent.freed` (one choke point,
:meth:`kvxfer._agent.leases.LeaseBook.free`). The consumer reads the word after its data
READ completed and compares it with the ticket's generation (seqlock style): the word
equals the generation from the hold until the producer frees, and never again after,
and the producer's engine writes the blocks only after ``freed()`` returned; so if
any byte the consumer read was the engine's, the word had changed before, and the
read issued after the data sees it. See docs/RELIABILITY.md.

:class:`GuardBook` is the producer's table (under the agent lock); :func:`verdict`
the consumer's comparison.
"""

from __future__ import annotations

import enum
import secrets
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["GEN_MASK", "FreeReason", "GuardBook", "not_held_yet", "verdict"]

#: The generation's bits; the top byte of a freed slot's word says why it was freed.
GEN_MASK = (1 << 56) - 1
#: Extra slots beyond one per block (holds of zero blocks, pending frees).
SPARE_SLOTS = 64


class FreeReason(enum.Enum):
    """Why a hold ended; the code goes in the top byte of its guard word."""

    DONE = 1  # its consumer pulled it (a later pull of the ticket reads "released")
    RELEASED = 2  # the engine or its consumer released it
    ABORTED = 3  # its consumer aborted
    EXPIRED = 4  # the lease ran out

    @property
    def text(self) -> str:
        """The word a failed pull's reason uses (``released``, ``aborted``, ...)."""
        return "released" if self is FreeReason.DONE else self.name.lower()


_BY_CODE = {r.value: r for r in FreeReason}


def verdict(word: int, generation: int) -> str | None:
    """None when ``word`` still holds ``generation``; else why the hold is gone
    (``released``, ``aborted``, ``expired``, or ``reused``: the slot serves another
    hold now)."""
    if word == generation:
        return None
    if word & GEN_MASK == generation & GEN_MASK:
        reason = _BY_CODE.get(word >> 56)
        return reason.text if reason is not None else "released"
    return "reused"


def not_held_yet(word: int, generation: int) -> bool:
    """Whether ``word`` may precede the hold of ``generation`` (a ticket minted before
    its hold): the slot was never armed (0), or its last hold, another one, was freed
    (a reason in the top byte). A live generation of another hold (top byte 0) says the
    slot is someone else's now, and a freed word of ``generation`` that this hold has
    ended: neither will ever turn into ``generation``."""
    if word & GEN_MASK == generation & GEN_MASK:
        return False
    return word == 0 or word >> 56 != 0


class GuardBook:
    """The producer's guard table: a slot and a generation per hold (internal;
    callers hold the agent lock).

    Args:
        table: The backend's registered table of 64-bit words (written here).
    """

    def __init__(self, table: npt.NDArray[np.uint64]) -> None:
        self._table = table
        # FIFO: a freed slot is taken again last, so its word keeps saying why for as
        # long as possible (a late pull then reads "aborted", not "reused").
        self._free = deque(range(len(table)))
        self._busy: set[int] = set()

    @staticmethod
    def slots_for(num_blocks: int) -> int:
        """Slots a layout of ``num_blocks`` needs: a live hold holds a block."""
        return num_blocks + SPARE_SLOTS

    def arm(self) -> tuple[int, int] | None:
        """A free slot with a fresh generation written in: ``(slot, generation)``, or
        None when every slot is taken (the hold is then unguarded and its pulls are
        refused by consumers that see the producer has a table)."""
        while self._free:
            slot = self._free.popleft()
            if slot not in self._busy:  # a slot armed_at() by its caller stays queued
                return self.arm_at(slot, secrets.randbits(56) or 1)
        return None

    def arm_at(self, slot: int, generation: int) -> tuple[int, int] | None:
        """Arm the slot a caller chose (the vLLM scheduler mints the ticket before the
        worker's hold): ``(slot, generation)``, or None when that slot is out of range
        or busy, in which case the word there is not ``generation`` and a pull of the
        ticket fails closed."""
        if not 0 <= slot < len(self._table) or slot in self._busy or not generation:
            return None
        generation &= GEN_MASK
        self._busy.add(slot)
        self._table[slot] = generation
        return slot, generation

    def retire(self, slot: int, generation: int, reason: FreeReason) -> None:
        """Overwrite the slot's word (before the blocks go back) and free the slot."""
        self._table[slot] = (reason.value << 56) | (generation & GEN_MASK)
        self._busy.discard(slot)
        self._free.append(slot)
