"""The NIXL backends post per-request lists of address runs where prepared ids would
not merge (issue 27): real NIXL UCX, two agents in this process.

A cache described one region per head holds a block's heads side by side, but their
prepared descriptors lie a block list apart, and NIXL merges only neighbours in its
prepared lists. Such a post goes as runs (one per block here); a post whose runs NIXL
merges itself (one region, consecutive blocks) keeps the prepared ids. Either way the
bytes land where the descriptors say, and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest

from kvxfer.backend import BackendOptions, PeerHandle, XferOp, XferStatus
from kvxfer.backends.ucx import UcxBackend
from kvxfer.core.block_lists import ChainLists
from kvxfer.core.descriptors import DescriptorTable, build_plan
from kvxfer.core.heads import HeadLayout, split_heads
from kvxfer.core.layout import KVLayout, KVPart, Region
from kvxfer.errors import PeerError

HEADS = 4
HEAD_BYTES = 256
BLOCKS = 80


def _layout(buf: npt.NDArray[np.uint8], per_head: bool) -> KVLayout:
    block = HEADS * HEAD_BYTES
    whole = KVLayout(
        block_size=16,
        regions=(
            Region(
                base=int(buf.ctypes.data),
                num_blocks=BLOCKS,
                stride=block,
                block_len=block,
                layer=0,
                part=KVPart.K,
            ),
        ),
        num_kv_heads=HEADS,
        kv_layout="HND",
    )
    if not per_head:
        return whole
    return split_heads(whole, HeadLayout(num_kv_heads=HEADS), 0, 1)


@pytest.fixture
def pair() -> Iterator[tuple[UcxBackend, UcxBackend]]:
    reader = UcxBackend(BackendOptions(agent_name="runs-reader"))
    holder = UcxBackend(BackendOptions(agent_name="runs-holder", progress_thread=True))
    try:
        yield reader, holder
    finally:
        reader.close()
        holder.close()


Buffers = tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]


def _registered(
    pair: tuple[UcxBackend, UcxBackend], per_head: bool, seed: int
) -> tuple[Buffers, DescriptorTable, DescriptorTable]:
    """The holder's random source and the reader's zeroed cache, registered and
    prepared on both backends, with their tables."""
    reader, holder = pair
    size = BLOCKS * HEADS * HEAD_BYTES
    src = np.random.default_rng(seed).integers(0, 255, size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    mine, theirs = _layout(dst, per_head), _layout(src, per_head)
    reader.register(mine)
    holder.register(theirs)
    table, peer_table = DescriptorTable.build(mine), DescriptorTable.build(theirs)
    reader.prepare_local(table)
    holder.prepare_local(peer_table)
    return (src, dst), table, peer_table


def _pull(
    pair: tuple[UcxBackend, UcxBackend], per_head: bool, local: list[int], remote: list[int]
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], int]:
    reader, holder = pair
    (src, dst), table, peer_table = _registered(pair, per_head, 5)
    peer = reader.add_peer(holder.metadata(), peer_table)
    plan = build_plan(table, peer_table, local, remote, 16 * len(local))
    handle = reader.post(XferOp.READ, peer, plan.local_ids, plan.remote_ids)
    for _ in range(100_000):
        if reader.status(handle) is not XferStatus.PENDING:
            break
    assert reader.status(handle) is XferStatus.DONE
    reader.release(handle)
    return src, dst, reader.runs_posted


def _expected(
    src: npt.NDArray[np.uint8], local: list[int], remote: list[int]
) -> npt.NDArray[np.uint8]:
    block = HEADS * HEAD_BYTES
    want = np.zeros_like(src)
    for lb, rb in zip(local, remote):
        want[lb * block : (lb + 1) * block] = src[rb * block : (rb + 1) * block]
    return want


# 64 pairs (below that prepared ids always go): 16 blocks x 4 heads; 2 runs of 8 blocks.
LOCAL = list(range(16))
REMOTE = [*range(8, 16), *range(0, 8)]


def test_one_region_per_head_posts_runs_and_moves_exactly_the_planned_bytes(
    pair: tuple[UcxBackend, UcxBackend],
) -> None:
    src, dst, runs_posted = _pull(pair, True, LOCAL, REMOTE)
    assert runs_posted == 1
    assert np.array_equal(dst, _expected(src, LOCAL, REMOTE))


def test_runs_nixl_merges_itself_keep_the_prepared_ids(
    pair: tuple[UcxBackend, UcxBackend],
) -> None:
    local, remote = list(range(70)), list(range(5, 75))  # 70 pairs, one run
    src, dst, runs_posted = _pull(pair, False, local, remote)
    assert runs_posted == 0
    assert np.array_equal(dst, _expected(src, local, remote))


def test_chain_lists_post_rows_and_move_exactly_the_planned_bytes(
    pair: tuple[UcxBackend, UcxBackend],
) -> None:
    """Chain lists (kvxfer.core.block_lists) prepared once with the peer: a request posts
    one row per block (the four heads chained), and the bytes land where its plan says.
    A peer removed and added again (a new connection to the same agent) loses its lists;
    the next post prepares them again. A removed peer is refused by name."""
    reader, holder = pair
    (src, dst), table, peer_table = _registered(pair, True, 9)
    lists = ChainLists.build(table, peer_table)
    assert lists is not None and lists.chains == 1
    local, remote = [3, 4, 9], [70, 71, 2]
    cp = lists.plan((np.array(local),), (np.array(remote),), 16 * len(local))
    assert cp.rows == 3 and cp.num_descriptors == 12

    def read(peer: PeerHandle) -> None:
        dst[:] = 0
        handle = reader.post_lists(XferOp.READ, peer, lists, cp.local_ids, cp.remote_ids)
        for _ in range(100_000):
            if reader.status(handle) is not XferStatus.PENDING:
                break
        assert reader.status(handle) is XferStatus.DONE
        reader.release(handle)
        assert np.array_equal(dst, _expected(src, local, remote))

    peer = reader.add_peer(holder.metadata(), peer_table)
    assert reader.prepare_lists(peer, lists) and reader.prepare_lists(peer, lists)
    read(peer)
    reader.remove_peer(peer)
    with pytest.raises(PeerError):
        reader.prepare_lists(peer, lists)
    with pytest.raises(PeerError):
        reader.post_lists(XferOp.READ, peer, lists, cp.local_ids, cp.remote_ids)
    read(reader.add_peer(holder.metadata(), peer_table))
    assert reader.lists_posted == 2 and reader.runs_posted == 0
