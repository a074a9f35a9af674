"""Bytes for ``kvxfer bench``: a provenance fill, an exact check, and memcpy.

The producer fills word *w* of its region *r* with ``(w + r·2^40) · C mod 2^64`` (``C``
odd, so distinct words get distinct values). One broadcast add per region writes it at
memory speed. The consumer checks landed bytes against the plan's descriptors: every
descriptor's bytes must be the producer's bytes at the paired address, and every other
byte of the touched blocks must still be zero. Runs region by region, touched rows
only, fully vectorized.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from kvxfer.core.layout import KVLayout

__all__ = [
    "REGION_SHIFT",
    "WORD_FACTOR",
    "MemcpyBench",
    "fill_regions",
    "verify_regions",
    "zero_rows",
]

U64 = npt.NDArray[np.uint64]
#: The fill's odd factor ``C`` and where the region id sits in a word's id.
WORD_FACTOR = 0x9E3779B97F4A7C15
REGION_SHIFT = 40
_C = np.uint64(WORD_FACTOR)


def _words(arr: npt.NDArray[np.uint16]) -> U64:
    return arr.view(np.uint64)


def fill_regions(regions: Sequence[npt.NDArray[np.uint16]]) -> None:
    """Write the provenance pattern into each ``(num_blocks, words)`` region in place."""
    for r, arr in enumerate(regions):
        words = _words(arr)
        nb, per_block = words.shape
        template = np.arange(per_block, dtype=np.uint64) * _C
        offsets = (
            np.arange(nb, dtype=np.uint64) * np.uint64(per_block) + np.uint64(r << REGION_SHIFT)
        ) * _C
        np.add(offsets[:, None], template[None, :], out=words)


def zero_rows(regions: Sequence[npt.NDArray[np.uint16]], rows: npt.NDArray[np.int64]) -> None:
    """Zero the given blocks of every region (before a verified transfer)."""
    for arr in regions:
        arr[rows] = 0


def verify_regions(
    regions: Sequence[npt.NDArray[np.uint16]],
    local_addr: U64,
    remote_addr: U64,
    length: U64,
    remote: KVLayout,
    rows: Sequence[npt.NDArray[np.int64]],
    bases: Sequence[int] | None = None,
) -> int:
    """Count wrong 8-byte words in the touched blocks; 0 means byte-exact.

    Args:
        regions: the consumer's regions (one ``(num_blocks, words)`` array each), or
            host copies of them (then ``bases`` gives where the regions are).
        local_addr, remote_addr, length: the moved descriptors (unmerged), bytes.
        remote: the producer's cache layout (bases of the filled regions).
        rows: per region, the block ids the request touches there.
        bases: each region's address, when ``regions`` are copies (a device cache).
    """
    rbase = np.array([r.base for r in remote.regions], dtype=np.uint64)
    order_r = np.argsort(rbase)
    rsorted = rbase[order_r]
    # The producer's word id of each descriptor's first byte.
    rreg = order_r[np.searchsorted(rsorted, remote_addr, side="right") - 1]
    g0 = (remote_addr - rbase[rreg]) // np.uint64(8) + (
        rreg.astype(np.uint64) << np.uint64(REGION_SHIFT)
    )
    where = bases if bases is not None else [int(a.ctypes.data) for a in regions]
    starts = np.array(where, dtype=np.uint64)
    order = np.argsort(local_addr)
    la, g0, ln = local_addr[order], g0[order], length[order] // np.uint64(8)
    bad = 0
    for i, arr in enumerate(regions):
        words = _words(arr)
        per_block = words.shape[1]
        lo = np.searchsorted(la, starts[i], side="left")
        hi = np.searchsorted(la, starts[i] + np.uint64(words.nbytes), side="left")
        touched = np.unique(rows[i])
        if not len(touched):
            bad += 0 if hi == lo else int(ln[lo:hi].sum())
            continue
        sub = words[touched].ravel()  # a copy of the touched blocks
        p = (la[lo:hi] - starts[i]) // np.uint64(8)
        row, col = p // np.uint64(per_block), p % np.uint64(per_block)
        pos = np.searchsorted(touched, row.astype(np.int64)).astype(np.int64)
        if len(pos) and (
            pos.max() >= len(touched) or (touched[np.minimum(pos, len(touched) - 1)] != row).any()
        ):
            return int(ln.sum())  # a descriptor outside the touched blocks: plan mismatch
        start = pos * per_block + col.astype(np.int64)
        n = ln[lo:hi].astype(np.int64)
        # Piecewise description of the expected words: inside descriptor k, the word at
        # position q holds producer word g0[k] + (q - start[k]); elsewhere zero.
        delta = np.zeros(len(sub) + 1, dtype=np.uint64)
        step = g0[lo:hi] - start.astype(np.uint64)
        np.add.at(delta, start, step)
        np.subtract.at(delta, start + n, step)
        covered = np.zeros(len(sub) + 1, dtype=np.int32)
        np.add.at(covered, start, 1)
        np.subtract.at(covered, start + n, 1)
        d = np.cumsum(delta[:-1], dtype=np.uint64)
        cov = np.cumsum(covered[:-1], dtype=np.int32) > 0
        expected = (np.arange(len(sub), dtype=np.uint64) + d) * _C
        expected[~cov] = 0
        bad += int(np.count_nonzero(expected != sub))
    return bad


class MemcpyBench:
    """A memcpy of ``nbytes`` from the consumer's (pre-touched) cache into scratch.

    ``run(nbytes, threads=2)`` splits the same bytes over two threads (each into its own
    half of the scratch buffer): what the machine's memory bus gives to copies running
    side by side, the bound on overlapped copies such as host bounce's.
    """

    def __init__(self, regions: Sequence[npt.NDArray[np.uint16]], scratch_bytes: int) -> None:
        self._src = [r.reshape(-1).view(np.uint8) for r in regions]
        self._scratch = np.ones(max(scratch_bytes, 1), dtype=np.uint8)  # touched
        self._pool: ThreadPoolExecutor | None = None

    def _stream(self, nbytes: int) -> list[npt.NDArray[np.uint8]]:
        """Source pieces totalling ``nbytes``: the regions in order, again if needed."""
        pieces: list[npt.NDArray[np.uint8]] = []
        left = nbytes
        while left > 0 and self._src:
            for src in self._src:
                n = min(left, len(src))
                pieces.append(src[:n])
                left -= n
                if left <= 0:
                    break
        return pieces

    @staticmethod
    def _copy(pieces: Sequence[npt.NDArray[np.uint8]], scratch: npt.NDArray[np.uint8]) -> None:
        cap, at = len(scratch), 0
        for piece in pieces:
            done = 0
            while done < len(piece):
                # Walk the scratch buffer too: re-using its head would copy into cache.
                n = min(len(piece) - done, cap - at)
                np.copyto(scratch[at : at + n], piece[done : done + n])
                done += n
                at = 0 if at + n >= cap else at + n

    def run(self, nbytes: int, threads: int = 1) -> float:
        """Seconds to copy ``nbytes`` in the largest pieces the buffers allow, on
        ``threads`` threads (the caller's and ``threads - 1`` helpers) side by side."""
        parts = _split(self._stream(nbytes), max(threads, 1))
        cap = len(self._scratch) // len(parts)
        dests = [self._scratch[k * cap : (k + 1) * cap] for k in range(len(parts))]
        if len(parts) > 1 and self._pool is None:
            self._pool = ThreadPoolExecutor(len(parts) - 1, thread_name_prefix="bench-memcpy")
        t0 = time.perf_counter()
        futures = [
            self._pool.submit(self._copy, part, dest)
            for part, dest in zip(parts[1:], dests[1:])
            if self._pool is not None
        ]
        self._copy(parts[0], dests[0])
        for f in futures:
            f.result()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop the helper threads."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _split(pieces: Sequence[npt.NDArray[np.uint8]], n: int) -> list[list[npt.NDArray[np.uint8]]]:
    """Cut a stream of pieces into ``n`` parts of (nearly) equal bytes."""
    total = sum(len(p) for p in pieces)
    parts: list[list[npt.NDArray[np.uint8]]] = [[] for _ in range(n)]
    k, room = 0, total // n + (total % n > 0)
    for piece in pieces:
        while len(piece):
            take = min(len(piece), room) if k < n - 1 else len(piece)
            parts[k].append(piece[:take])
            piece, room = piece[take:], room - take
            if room == 0 and k < n - 1:
                k, room = k + 1, total // n + (total % n > k + 1)
    return parts
