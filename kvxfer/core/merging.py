"""Fewest transfer units for a plan's bytes: posting order and run merging (R-DESC-6).

A plan pairs descriptors by position; the transport (NIXL's ``make_prepped_xfer``)
merges each pair with the one posted right after it when both sides continue
contiguously. So what a plan costs in transfer units depends on its order:

* **across blocks** the request's block order already puts contiguous runs of blocks
  next to each other (one region, consecutive ids);
* **across regions** it does not: a cache described one region per head (the vLLM
  adapter's default on TP ranks, and every one-head section a pull across TP sizes is
  planned on) holds a block's heads side by side, but the plan lists region after
  region, so the heads of one block lie a whole block list apart and never merge. A
  4000-token, 16-token-block pull of 8 such heads then posts 56,000 descriptors where
  14,000 runs cover the bytes.

:func:`region_chains` finds, once per table, the regions whose blocks abut (region
*j*'s block *b* starts where region *i*'s block *b* ends, for every *b*: same stride
and device); :func:`chain_order` turns them into a row order that lists each chain's
regions block by block, so a plan built in that order posts a block's abutting heads
one after the other. :func:`address_order` is the general fallback (a stable sort on
the local address), and :func:`run_starts` is the merge itself, shared by
:meth:`kvxfer.core.descriptors.Plan.runs` and the tests that restate what the transport does.

Posting in local-address order loses no merge: two pairs can merge only when the
second's local bytes start where the first's end, and nothing else starts there.
Everything here is pure numpy over address arrays.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = [
    "RUNS_MIN_PAIRS",
    "RUNS_SHARE",
    "address_order",
    "chain_order",
    "joins",
    "posted_units",
    "region_chains",
    "run_starts",
    "transport_units",
]

IntArray = npt.NDArray[np.int64]
UIntArray = npt.NDArray[np.uint64]

#: Posts of fewer pairs go as prepared ids whatever they would merge into.
RUNS_MIN_PAIRS = 64
#: Per-request lists of address runs are built when they post at most this share of
#: the units prepared ids would (building them costs ~0.1 µs a run; each unit the
#: transport posts, ~3-10 µs).
RUNS_SHARE = 0.5


def region_chains(
    base: UIntArray, stride: UIntArray, block_len: UIntArray, device: IntArray
) -> list[list[int]]:
    """Maximal chains of regions whose blocks abut, each in address order.

    Region *j* follows region *i* in a chain when ``base[j] == base[i] +
    block_len[i]`` on the same device with the same stride: then block *b* of *j*
    starts where block *b* of *i* ends, for every block. Regions that abut nothing
    form chains of one. Chains are listed by their first region's index.

    Args:
        base, stride, block_len: per region, uint64.
        device: per region, int64.
    """
    n = len(base)
    if n == 0:
        return []
    order = np.lexsort((base, stride, device))
    chains: list[list[int]] = []
    current = [int(order[0])]
    for i in order[1:].tolist():
        prev = current[-1]
        if (
            device[i] == device[prev]
            and stride[i] == stride[prev]
            and base[i] == base[prev] + block_len[prev]
        ):
            current.append(i)
        else:
            chains.append(current)
            current = [i]
    chains.append(current)
    chains.sort(key=lambda c: c[0])
    return chains


def chain_order(chains: list[list[int]]) -> tuple[IntArray, int] | None:
    """Rows (positions into the regions the chains index) listed chain by chain, and
    the chains' common length, or None when no two regions abut or the chains differ
    in length (plans then fall back to :func:`address_order`).

    A plan over ``rows`` laid out as ``(chains, blocks, length)`` instead of
    ``(regions, blocks)`` posts each block's abutting regions consecutively.
    """
    if not chains:
        return None
    k = len(chains[0])
    if k < 2 or any(len(c) != k for c in chains):
        return None
    rows = np.array([i for c in chains for i in c], dtype=np.int64)
    rows.setflags(write=False)
    return rows, k


def address_order(local_addr: UIntArray) -> IntArray:
    """The permutation that lists pairs by local address (stable: equal addresses,
    which a valid plan never has, keep their order)."""
    return np.argsort(local_addr, kind="stable").astype(np.int64, copy=False)


def joins(
    local_addr: UIntArray,
    remote_addr: UIntArray,
    length: UIntArray,
    local_device: IntArray | None = None,
    remote_device: IntArray | None = None,
) -> npt.NDArray[np.bool_]:
    """Per pair after the first: whether it continues the pair before it on both sides
    (and on the same devices, when devices are given)."""
    # A run never wraps past 2**64: an end that overflows to 0 joins nothing (a real
    # successor starts above its predecessor, never at address 0).
    out: npt.NDArray[np.bool_] = (local_addr[1:] == local_addr[:-1] + length[:-1]) & (
        remote_addr[1:] == remote_addr[:-1] + length[:-1]
    )
    out &= (local_addr[1:] != 0) & (remote_addr[1:] != 0)
    if local_device is not None:
        out &= local_device[1:] == local_device[:-1]
    if remote_device is not None:
        out &= remote_device[1:] == remote_device[:-1]
    return out


def run_starts(
    local_addr: UIntArray,
    remote_addr: UIntArray,
    length: UIntArray,
    local_device: IntArray | None = None,
    remote_device: IntArray | None = None,
) -> IntArray:
    """Where each merged run starts: pair *i* joins pair *i-1* when both sides continue
    contiguously (and on the same devices, when devices are given).

    Returns:
        ascending positions, the first always 0 (empty for an empty plan).
    """
    if len(length) == 0:
        return np.zeros(0, dtype=np.int64)
    joined = joins(local_addr, remote_addr, length, local_device, remote_device)
    return np.flatnonzero(np.concatenate(([True], ~joined))).astype(np.int64, copy=False)


def transport_units(
    joined: npt.NDArray[np.bool_], local_ids: IntArray, remote_ids: IntArray
) -> int:
    """Transfer units a transport posts when it merges, like NIXL's
    ``make_prepped_xfer``, only pairs that also follow each other in its prepared
    lists (ids one apart on both sides); ``joined`` is :func:`joins` of the pairs.

    A head's block and the next head's block abut in memory but lie a whole block list
    apart in a prepared table (``region * num_blocks + block``): such runs merge only
    when posted as per-request lists of address runs.
    """
    n = len(local_ids)
    if n == 0:
        return 0
    consecutive = (local_ids[1:] == local_ids[:-1] + 1) & (remote_ids[1:] == remote_ids[:-1] + 1)
    return n - int(np.count_nonzero(joined & consecutive))


def posted_units(
    joined: npt.NDArray[np.bool_], local_ids: IntArray, remote_ids: IntArray
) -> tuple[int, bool]:
    """How a NIXL backend posts a plan (pairs in posted order, ``joined`` their
    :func:`joins`): the transfer units, and whether as per-request run lists (True)
    or as prepared ids (False), whichever posts far fewer units."""
    n = len(local_ids)
    prepared = transport_units(joined, local_ids, remote_ids)
    if n < RUNS_MIN_PAIRS:
        return prepared, False
    runs = n - int(np.count_nonzero(joined))
    if runs > RUNS_SHARE * prepared:
        return prepared, False
    return runs, True
