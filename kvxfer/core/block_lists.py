"""Chain lists: prepared descriptor lists whose rows are already merged (issue 27).

A plan pairs one descriptor per (region, block); where regions abut block by block on
*both* sides (a block's heads, held side by side by the consumer and by the producer
rank it reads them from), those pairs always merge into one run, whatever the request.
Cutting each request's runs again (:meth:`kvxfer.core.descriptors.Plan.runs`, or a
backend's per-request run lists) costs a dozen numpy calls per producer rank, right
after a copy flushed the caches: a third of a millisecond of a 1,000-token pull.

:class:`ChainLists` does that merge once, for two tables paired region by region (a
:class:`~kvxfer.core.tp_plan.TPPlanner`'s per-rank sub-tables): the regions are cut
into *pair chains* (:func:`pair_chains`), and each side gets one row per (chain,
block), ``row = chain * num_blocks + block``. A backend prepares both lists once; a
request then posts ``chains × blocks`` rows found by one broadcast
(:meth:`ChainLists.plan`), and the transport merges consecutive rows contiguous on
both sides itself (a chain that fills its blocks, on consecutive blocks).

Lists are built only when their rows post as few units as the request's merged runs
would, for every request (see :meth:`ChainLists.build`): every group moves whole
blocks, the chains merge something, each side keeps one stride, and no two chains can
ever continue one another across blocks. Pure numpy; nothing here touches a transport.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvxfer.core._selection import IntArray
from kvxfer.core.blocks import Groups, block_array
from kvxfer.core.descriptors import DescriptorTable
from kvxfer.core.layout import MemKind
from kvxfer.errors import PlanError

__all__ = ["ChainLists", "ChainPlan", "pair_chains"]

UIntArray = npt.NDArray[np.uint64]


def pair_chains(
    local_base: UIntArray,
    remote_base: UIntArray,
    block_len: UIntArray,
    local_stride: UIntArray,
    remote_stride: UIntArray,
    local_device: IntArray,
    remote_device: IntArray,
) -> list[list[int]]:
    """Maximal chains of paired regions whose blocks abut on both sides.

    Region *j* follows region *i* when, on each side, ``base[j] == base[i] +
    block_len[i]`` with the same stride and device: then block *b* of *j* starts where
    block *b* of *i* ends, locally and remotely, for every block. Regions pair by
    position (``block_len`` is both sides', as paired tables share their shapes).
    Chains are in local address order, listed by their first region's local address.
    """
    n = len(local_base)
    if n == 0:
        return []
    order = np.lexsort((local_base, local_stride, local_device)).tolist()
    chains: list[list[int]] = []
    current = [order[0]]
    for i in order[1:]:
        prev = current[-1]
        end = block_len[prev]
        if (
            local_device[i] == local_device[prev]
            and local_stride[i] == local_stride[prev]
            and local_base[i] == local_base[prev] + end
            and remote_device[i] == remote_device[prev]
            and remote_stride[i] == remote_stride[prev]
            and remote_base[i] == remote_base[prev] + end
        ):
            current.append(i)
        else:
            chains.append(current)
            current = [i]
    chains.append(current)
    chains.sort(key=lambda c: int(local_base[c[0]]))
    return chains


#: Addresses at or above this make :meth:`ChainLists.build` decline (its continuation
#: check subtracts them as int64).
_ADDR_LIMIT = 1 << 62


def _may_continue(
    first: UIntArray, end: UIntArray, stride: int, device: IntArray, num_blocks: int
) -> npt.NDArray[np.bool_]:
    """``[a, b]``: whether some block of chain *a* ends where some block of chain *b*
    starts on this side. Block *x* of *a* ends at ``end[a] + x * stride``, block *y*
    of *b* starts at ``first[b] + y * stride``: they meet when the gap is a whole
    number *d* of strides with both blocks in range (``|d| < num_blocks``), on one
    device."""
    gap = end.astype(np.int64)[:, None] - first.astype(np.int64)[None, :]
    out: npt.NDArray[np.bool_] = gap % stride == 0
    out &= np.abs(gap) < num_blocks * stride
    out &= device[:, None] == device[None, :]
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class ChainPlan:
    """A request's rows of a :class:`ChainLists`, paired by position.

    Attributes:
        lists: the lists the rows index.
        local_ids: rows of ``lists.local``.
        remote_ids: rows of ``lists.remote``; ``remote_ids[i]`` pairs with
            ``local_ids[i]``.
        nbytes: bytes moved.
        num_tokens: the request's token count.
        local_blocks: per group, the local blocks that receive bytes.
        num_descriptors: the descriptor pairs the rows cover (those of the
            :class:`~kvxfer.core.descriptors.Plan` of the same request).
    """

    lists: ChainLists
    local_ids: IntArray
    remote_ids: IntArray
    nbytes: int
    num_tokens: int
    local_blocks: Groups
    num_descriptors: int

    @property
    def rows(self) -> int:
        """Rows posted (the transport merges consecutive ones that continue)."""
        return len(self.local_ids)


@dataclasses.dataclass(frozen=True, eq=False)
class ChainLists:
    """Both sides' descriptor lists of one table pairing, a row per (chain, block).

    Build with :meth:`build`; plan each request with :meth:`plan`.

    Attributes:
        local: ``(chains * local_blocks, 3)`` uint64 rows ``(addr, length, device)``.
        remote: the same over the remote table's blocks.
        local_mem, remote_mem: the memory kind of each side's rows.
        local_blocks, remote_blocks: blocks per chain on each side.
        groups: per KV group, its chains' indices (one per chain of the group, in
            local address order).
        block_bytes: per group, the bytes of one block over all its chains.
        pairs: per group, the plan pairs (regions) one block of it moves.
    """

    local: UIntArray
    remote: UIntArray
    local_mem: MemKind
    remote_mem: MemKind
    local_blocks: int
    remote_blocks: int
    groups: tuple[IntArray, ...]
    block_bytes: tuple[int, ...]
    pairs: tuple[int, ...]

    @property
    def chains(self) -> int:
        """Chains over every group."""
        return sum(len(g) for g in self.groups)

    @classmethod
    def build(cls, local: DescriptorTable, remote: DescriptorTable) -> ChainLists | None:
        """The chain lists of ``local`` and ``remote`` paired region by region, or
        None where a request's rows could post more units than its merged runs.

        None unless: the tables share their shape and options; every group moves
        whole blocks (no chunk or window section); each side's regions share one
        memory kind and one stride; some chain holds two regions or more (else the
        prepared per-region lists serve as well); and no chain's block can end where
        another chain's block starts on both sides, which a request's runs would
        merge and the rows, listed chain by chain, would not.
        """
        # Whole blocks only (no chunk or window section): the remote table, of the same
        # shape and options, has none either.
        if local._key != remote._key or local._whole is None:
            return None
        lreg, rreg = local.layout.regions, remote.layout.regions
        # Equal keys: both sides' regions hold the same memory kinds, region by region.
        mems = {r.mem for r in lreg}
        lstride = np.array([r.stride for r in lreg], dtype=np.uint64)
        rstride = np.array([r.stride for r in rreg], dtype=np.uint64)
        if len(mems) != 1:
            return None
        if (lstride != lstride[0]).any() or (rstride != rstride[0]).any():
            return None
        lbase = np.array([r.base for r in lreg], dtype=np.uint64)
        rbase = np.array([r.base for r in rreg], dtype=np.uint64)
        length = np.array([r.block_len for r in lreg], dtype=np.uint64)
        top = max(int(lbase.max()) + int(lstride[0]) * local.num_blocks,
                  int(rbase.max()) + int(rstride[0]) * remote.num_blocks)  # fmt: skip
        if top >= _ADDR_LIMIT:
            return None
        ldev = np.array([r.device_id for r in lreg], dtype=np.int64)
        rdev = np.array([r.device_id for r in rreg], dtype=np.int64)
        chains: list[list[int]] = []
        groups: list[IntArray] = []
        block_bytes: list[int] = []
        pairs: list[int] = []
        for cut in local._cuts:
            rows = cut.regions
            found = pair_chains(
                lbase[rows], rbase[rows], length[rows], lstride[rows], rstride[rows],
                ldev[rows], rdev[rows],
            )  # fmt: skip
            first = len(chains)
            chains.extend([int(rows[i]) for i in c] for c in found)
            groups.append(np.arange(first, len(chains), dtype=np.int64))
            block_bytes.append(int(length[rows].sum()))
            pairs.append(len(rows))
        if len(chains) == len(lreg):
            return None  # nothing merges: the per-region lists post the same units
        head = np.array([c[0] for c in chains], dtype=np.int64)
        size = np.array([int(length[c].sum()) for c in chains], dtype=np.uint64)
        # A chain's end continuing another chain's start (blocks apart) on both sides
        # is a merge the runs of some request make and chain-major rows never post.
        local_next = _may_continue(
            lbase[head], lbase[head] + size, int(lstride[0]), ldev[head], local.num_blocks
        )
        remote_next = _may_continue(
            rbase[head], rbase[head] + size, int(rstride[0]), rdev[head], remote.num_blocks
        )
        across = local_next & remote_next
        np.fill_diagonal(across, False)  # a chain on its next block: consecutive rows
        if across.any():
            return None
        return cls(
            local=_rows(lbase[head], size, int(lstride[0]), ldev[head], local.num_blocks),
            remote=_rows(rbase[head], size, int(rstride[0]), rdev[head], remote.num_blocks),
            local_mem=lreg[0].mem,
            remote_mem=rreg[0].mem,
            local_blocks=local.num_blocks,
            remote_blocks=remote.num_blocks,
            groups=tuple(_readonly(g) for g in groups),
            block_bytes=tuple(block_bytes),
            pairs=tuple(pairs),
        )

    def plan(self, local_blocks: Groups, remote_blocks: Groups, num_tokens: int) -> ChainPlan:
        """The rows of a request's block ids paired by :func:`kvxfer.core.blocks.pair`
        (one array per group, the local ones checked there), chain by chain, the blocks
        of each in ascending local order. The remote ids (a ticket's) are checked here
        against the remote blocks.

        Raises:
            PlanError: another group count than the lists', group lengths that differ,
                or a remote id that repeats or lies outside ``[0, remote_blocks)``.
        """
        if len(local_blocks) != len(self.groups) or len(remote_blocks) != len(self.groups):
            raise PlanError(
                f"block lists: {len(local_blocks)} local and {len(remote_blocks)} remote "
                f"given, the chain lists have {len(self.groups)} KV group(s); pass one list "
                "per group on each side"
            )
        local_ids: list[IntArray] = []
        remote_ids: list[IntArray] = []
        nbytes = pairs = 0
        checked = None  # groups sharing one array are checked once
        for chains, block_bytes, per_block, lb, rb in zip(
            self.groups, self.block_bytes, self.pairs, local_blocks, remote_blocks, strict=True
        ):
            if len(lb) != len(rb):
                raise PlanError(
                    f"group {len(local_ids)}: {len(lb)} local blocks but {len(rb)} remote "
                    "blocks; they must match"
                )
            if rb is not checked:
                checked = rb
                block_array(rb, side="remote", group=len(local_ids), num_blocks=self.remote_blocks)
            if len(lb) > 1 and (lb[1:] < lb[:-1]).any():
                # Ascending local blocks: each chain's rows then lie in local address
                # order, so the transport merges every pair of rows the runs would.
                order = np.argsort(lb)
                lb, rb = lb[order], rb[order]
            local_ids.append((chains[:, None] * self.local_blocks + lb[None, :]).ravel())
            remote_ids.append((chains[:, None] * self.remote_blocks + rb[None, :]).ravel())
            nbytes += block_bytes * len(lb)
            pairs += per_block * len(lb)
        one = len(self.groups) == 1
        return ChainPlan(
            lists=self,
            local_ids=local_ids[0] if one else np.concatenate(local_ids),
            remote_ids=remote_ids[0] if one else np.concatenate(remote_ids),
            nbytes=nbytes,
            num_tokens=num_tokens,
            local_blocks=local_blocks,
            num_descriptors=pairs,
        )


def _rows(base: UIntArray, size: UIntArray, stride: int, device: IntArray, nb: int) -> UIntArray:
    """``(chains * nb, 3)`` rows: chain *c*'s block *b* at ``c * nb + b``."""
    starts = base[:, None] + np.arange(nb, dtype=np.uint64)[None, :] * np.uint64(stride)
    out = np.empty((len(base) * nb, 3), dtype=np.uint64)
    out[:, 0] = starts.ravel()
    out[:, 1] = np.repeat(size, nb)
    out[:, 2] = np.repeat(device.astype(np.uint64), nb)
    return _readonly(out)


_A = TypeVar("_A", bound=npt.NDArray[Any])


def _readonly(a: _A) -> _A:
    a.setflags(write=False)
    return a
