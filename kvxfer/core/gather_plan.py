"""A request's address runs staged through bounded contiguous buffers (issue 55).

On a GPU every descriptor costs 5-9 µs to post through UCX's cuda_ipc whatever its
size, so 14,000 scattered 32 KiB blocks move at ~5 GB/s while the same bytes in a few
runs move at hundreds. The *gather path* moves such a request in **rounds**: each
side copies its part of a round between its scattered blocks and a contiguous staging
buffer of at most ``staging_bytes`` (the producer gathers, the consumer scatters; a
device copy on a GPU), and the transport moves the round as one run between the two
staging buffers.

:func:`staging_rounds` cuts a request's :class:`~kvxfer.core.descriptors.Runs` into
such rounds: the runs are laid end to end in request order in one virtual staging
stream, round *k* is the stream's bytes ``[k*S, (k+1)*S)`` (a run that crosses a
round's end is split there), and each side's copies are the runs' pieces merged where
that side's addresses continue (a side's blocks may be contiguous even where the
pair's are not). Every byte of the runs is copied once on each side and moved once,
each at the same staging offset on both sides, so the staged transfer lands exactly
the bytes of the direct one. Pure numpy; :mod:`kvxfer.core.gather_cost` decides
whether a request goes this way.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt

from kvxfer.core.descriptors import Runs
from kvxfer.errors import PlanError

__all__ = ["PIECE_BYTES", "Copies", "StagedRound", "StagingPlan", "staging_rounds"]

#: Bytes of one packed piece (:meth:`Copies.pack`): three uint64.
PIECE_BYTES = 24

IntArray = npt.NDArray[np.int64]
UIntArray = npt.NDArray[np.uint64]


@dataclasses.dataclass(frozen=True, eq=False)
class Copies:
    """One side's copies of one round: ``length[i]`` bytes between engine address
    ``addr[i]`` and byte ``offset[i]`` of that side's staging buffer (uint64 arrays,
    in staging order; pieces abutting on both ends are merged)."""

    addr: UIntArray
    offset: UIntArray
    length: UIntArray

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        """Bytes copied."""
        return int(self.length.sum())

    def pack(self) -> bytes:
        """The pieces as a gather round carries them on the wire: per piece three
        little-endian uint64 (``addr``, ``offset``, ``length``), 24 bytes."""
        return np.stack([self.addr, self.offset, self.length], axis=1).astype("<u8").tobytes()

    @classmethod
    def unpack(cls, data: bytes) -> Copies:
        """The pieces of :meth:`pack`.

        Raises:
            PlanError: ``data`` is not whole 24-byte pieces, or a piece is empty.
        """
        if len(data) % PIECE_BYTES:
            raise PlanError(
                f"gather pieces: {len(data)} bytes is not a whole number of "
                f"{PIECE_BYTES}-byte pieces"
            )
        cols = np.frombuffer(data, dtype="<u8").reshape(-1, 3).astype(np.uint64).T
        out = cls(addr=cols[0].copy(), offset=cols[1].copy(), length=cols[2].copy())
        if len(out) and int(out.length.min()) == 0:
            raise PlanError(f"gather piece {int(np.argmin(out.length))} is empty")
        return out


@dataclasses.dataclass(frozen=True, eq=False)
class StagedRound:
    """One round: the remote side's copies (the producer's gather in a pull), the
    local side's (the consumer's scatter), and ``nbytes``, the staging bytes the
    transport moves as one run from offset 0 on both sides."""

    local: Copies
    remote: Copies
    nbytes: int


@dataclasses.dataclass(frozen=True, eq=False)
class StagingPlan:
    """A request's rounds, in order; ``staging_bytes`` bounds each one."""

    rounds: tuple[StagedRound, ...]
    staging_bytes: int

    @property
    def nbytes(self) -> int:
        """Bytes moved over all rounds (those of the runs)."""
        return sum(r.nbytes for r in self.rounds)

    @property
    def local_pieces(self) -> int:
        """Copies the local side makes over all rounds."""
        return sum(len(r.local) for r in self.rounds)

    @property
    def remote_pieces(self) -> int:
        """Copies the remote side makes over all rounds."""
        return sum(len(r.remote) for r in self.rounds)


def _copies(addr: UIntArray, offset: UIntArray, length: UIntArray) -> Copies:
    """Pieces merged where both the address and the staging offset continue."""
    if len(length) > 1:
        ends = addr[:-1] + length[:-1]
        # A piece that ends at 2**64 wraps to 0 and joins nothing (as in merging.joins).
        joined = (addr[1:] == ends) & (ends != 0) & (offset[1:] == offset[:-1] + length[:-1])
        starts = np.flatnonzero(np.concatenate(([True], ~joined)))
        stops = np.append(starts[1:], len(length))
        # Sums over each merged group: the cumulative length at its bounds.
        total = np.concatenate(([0], np.cumsum(length, dtype=np.uint64)))
        addr, offset = addr[starts], offset[starts]
        length = (total[stops] - total[starts]).astype(np.uint64)
    for a in (addr, offset, length):
        a.setflags(write=False)
    return Copies(addr=addr, offset=offset, length=length)


def staging_rounds(runs: Runs, staging_bytes: int) -> StagingPlan:
    """Cut ``runs`` into rounds of at most ``staging_bytes`` staged bytes.

    Args:
        runs: a request's address runs (local and remote addresses paired by position).
        staging_bytes: the size of each side's staging buffer.

    Raises:
        PlanError: ``staging_bytes`` is not a positive int, or a run is empty.
    """
    if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int):
        raise PlanError(f"staging_bytes={staging_bytes!r}: must be a positive int")
    if staging_bytes < 1:
        raise PlanError(f"staging_bytes={staging_bytes!r}: must be a positive int")
    length = np.asarray(runs.length, dtype=np.uint64)
    if len(length) and not length.all():
        raise PlanError(f"address run {int(np.flatnonzero(length == 0)[0])} is empty")
    local = np.asarray(runs.local_addr, dtype=np.uint64)
    remote = np.asarray(runs.remote_addr, dtype=np.uint64)
    end = np.cumsum(length, dtype=np.uint64)
    total = int(end[-1]) if len(end) else 0
    start = end - length
    s = np.uint64(staging_bytes)
    # Cut points in the staging stream: every run's start and every round's end.
    bounds = np.arange(staging_bytes, total, staging_bytes, dtype=np.uint64)
    cuts = np.union1d(start, bounds)
    owner = np.searchsorted(end, cuts, side="right").astype(np.int64)
    piece_len = np.diff(np.append(cuts, np.uint64(total))).astype(np.uint64)
    into = cuts - start[owner]  # how far into its run a piece starts
    rnd = (cuts // s).astype(np.int64)
    offset = cuts - rnd.astype(np.uint64) * s
    l_addr, r_addr = local[owner] + into, remote[owner] + into
    edges = np.searchsorted(rnd, np.arange(-(-total // staging_bytes) + 1), side="left")
    rounds = []
    for k in range(len(edges) - 1):
        a, z = int(edges[k]), int(edges[k + 1])
        rounds.append(
            StagedRound(
                local=_copies(l_addr[a:z], offset[a:z], piece_len[a:z]),
                remote=_copies(r_addr[a:z], offset[a:z], piece_len[a:z]),
                nbytes=int(piece_len[a:z].sum()),
            )
        )
    return StagingPlan(rounds=tuple(rounds), staging_bytes=staging_bytes)
