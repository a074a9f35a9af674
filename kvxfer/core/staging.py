"""The gather path's staging memory: bounded slots and the hold check (issue 55).

An agent whose :class:`~kvxfer.core.gather_cost.GatherConfig` has ``staging_bytes > 0``
registers one staging buffer beside its cache, cut into a fixed number of equal
slots. :class:`StagingSlots` hands them out: a request that finds no free slot goes
direct, so staging memory never grows. Every release bumps the slot's generation, so a
consumer that reads a slot's generation back after its READ knows no later request
reused the slot in between (the same seqlock idea as the guard words, R-SAFE-1).

:func:`first_outside` is the producer's check before it gathers a round for a
ticket: every piece must lie wholly inside blocks of that request's hold (a ticket
reads only its own blocks, R-SAFE-3). Pure; no I/O.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt

from kvxfer.errors import ConfigError

__all__ = ["Slot", "StagingSlots", "extents", "first_outside"]

UIntArray = npt.NDArray[np.uint64]


@dataclasses.dataclass(frozen=True)
class Slot:
    """One staging slot lent to one request: bytes ``[offset, offset + nbytes)`` of
    the staging buffer, at ``generation`` (bumped each time the slot is given back)."""

    index: int
    offset: int
    nbytes: int
    generation: int


class StagingSlots:
    """A fixed set of equal staging slots over ``nbytes`` of staging memory.

    Not thread-safe: the owner (the agent's runtime) calls it from one thread.
    """

    def __init__(self, nbytes: int, slots: int) -> None:
        """Cut ``nbytes`` into ``slots`` equal slots (the remainder is unused).

        Raises:
            ConfigError: ``slots`` is not a positive int or leaves a slot empty.
        """
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ConfigError("gather.slots", slots, "must be a positive int")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < slots:
            raise ConfigError("gather.staging_bytes", nbytes, f"must be at least {slots}")
        self.slot_bytes = nbytes // slots
        self._generation = [0] * slots
        self._free = list(range(slots - 1, -1, -1))  # pop() lends slot 0 first
        self._lent: set[int] = set()

    @property
    def slots(self) -> int:
        """How many slots there are."""
        return len(self._generation)

    @property
    def free(self) -> int:
        """How many slots are free now."""
        return len(self._free)

    def acquire(self) -> Slot | None:
        """A free slot, or None when every slot is lent (the request goes direct)."""
        if not self._free:
            return None
        i = self._free.pop()
        self._lent.add(i)
        return Slot(i, i * self.slot_bytes, self.slot_bytes, self._generation[i])

    def generation(self, index: int) -> int:
        """Slot ``index``'s current generation."""
        return self._generation[index]

    def release(self, slot: Slot) -> None:
        """Give ``slot`` back; its generation moves on. Releasing a slot that is not
        lent at that generation is a no-op (a late or repeated release frees nothing
        a later request holds)."""
        i = slot.index
        if i not in self._lent or self._generation[i] != slot.generation:
            return
        self._lent.discard(i)
        self._generation[i] += 1
        self._free.append(i)


def extents(addr: UIntArray, length: UIntArray) -> tuple[UIntArray, UIntArray]:
    """Byte ranges ``[addr[i], addr[i] + length[i])`` sorted and merged where they
    touch or overlap: the ``(starts, ends)`` :func:`first_outside` takes. The producer
    builds a hold's from the runs of a plan of the hold's blocks against its own table.
    """
    addr = np.asarray(addr, dtype=np.uint64)
    length = np.asarray(length, dtype=np.uint64)
    keep = length > 0
    order = np.argsort(addr[keep], kind="stable")
    a, e = addr[keep][order], (addr[keep] + length[keep])[order]
    if not len(a):
        return a, e
    reach = np.maximum.accumulate(e)
    # A new extent starts where a range begins past everything before it ends.
    new = np.concatenate(([True], a[1:] > reach[:-1]))
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(a)) - 1
    return a[first], reach[last]


def first_outside(
    addr: UIntArray, length: UIntArray, starts: UIntArray, ends: UIntArray
) -> int | None:
    """The index of the first piece ``[addr[i], addr[i] + length[i])`` not wholly
    inside one allowed range ``[starts[j], ends[j])``, or None when all are inside.

    ``starts`` must be sorted and the ranges disjoint (a hold's block extents, merged
    where they touch). A piece that spans two touching ranges that were not merged is
    refused: the caller merges first. An empty piece is refused (no round sends one).
    """
    addr = np.asarray(addr, dtype=np.uint64)
    length = np.asarray(length, dtype=np.uint64)
    if not len(addr):
        return None
    if not len(starts):
        return 0
    j = np.searchsorted(np.asarray(starts, dtype=np.uint64), addr, side="right") - 1
    jj = np.clip(j, 0, None)
    end = addr + length
    ok = (
        (j >= 0)
        & (length > 0)
        & (end > addr)  # no wrap past 2**64
        & (end <= np.asarray(ends, dtype=np.uint64)[jj])
    )
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if len(bad) else None
