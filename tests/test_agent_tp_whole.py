"""Pairs across tensor-parallel sizes with no per-head setting (issue 26): ranks that
describe their cache as engines do by default, one region per (layer, K/V) holding
all their heads, pull and push across TP sizes byte for byte, cut at pairing
(kvxfer.core.heads.pairing_heads): the consumer derives the producer's narrower table at
the handshake, and only a side that posts holding more heads per region than its
peer posts from its one-head section. Equal TP sizes keep their whole-block plans.

In-process Agents on the fake backend (tests/tp_ranks.py); every (layer, K/V, global
head, token) of every consumer rank is checked against the producer's pattern.
"""

from __future__ import annotations

import itertools
import random

import msgspec
import numpy as np
import numpy.typing as npt
import pytest

from kvxfer._agent.guard import GuardBook
from kvxfer.agent import Agent, Ticket
from kvxfer.backends.host_bounce import CopyDirection, CopyOp, host_block_view
from kvxfer.core import wire
from kvxfer.core.heads import HeadLayout
from kvxfer.core.layout import KVLayout
from kvxfer.transfer import Transfer, TransferState
from kvxfer.types import Direction
from tests.tp_ranks import NUM_BLOCKS, Rank, consumers, producers
from tests.tp_ranks import closing as closing  # the fixture, by name

SEED = 57
IntArray = npt.NDArray[np.int64]
ByteArray = npt.NDArray[np.uint8]
_slots = (i % GuardBook.slots_for(NUM_BLOCKS) for i in itertools.count())

#: (model KV heads, prefill TP, decode TP). llm-d's layout first: prefill TP1 feeding
#: decode TP2 and TP4; then the other direction, and heads fewer than ranks.
PAIRS = [(4, 1, 2), (4, 1, 4), (8, 1, 2), (4, 2, 1), (4, 4, 1), (4, 2, 4), (4, 4, 2), (2, 1, 4)]
#: (prefill, decode) described per (layer, K/V) (True) rather than per head (False).
STYLES = [(True, True), (True, False), (False, True)]
STYLE_IDS = ["both-whole", "prefill-whole", "decode-whole"]


def _hold(
    producers: list[Rank], rid: str, block_ids: list[int], tokens: int, cap: str | None = None
) -> Ticket:
    """Every producer rank holds ``rid`` under one capability and guard word; the
    router gets rank 0's ticket with every rank's incarnation."""
    cap = cap or wire.new_capability()
    guard = (next(_slots), random.randrange(1, 2**56))
    tickets = [p.agent.hold(rid, block_ids, tokens, capability=cap, guard=guard) for p in producers]
    return msgspec.structs.replace(tickets[0], incarnations=tuple(t.incarnation for t in tickets))


def _push_ticket(producers: list[Rank], rid: str, tokens: int, cap: str) -> Ticket:
    host, port = producers[0].agent.address
    return Ticket.for_push(
        "prefill", host, port, rid, tokens, capability=cap, tp_size=len(producers)
    )


def _section(agent: Agent) -> int:
    """How many one-head descriptors ``agent`` prepared next to its table."""
    heads = agent._local.heads
    return 0 if heads is None else len(heads.table)


@pytest.mark.parametrize(("p_whole", "d_whole"), STYLES, ids=STYLE_IDS)
@pytest.mark.parametrize(("kv_heads", "p_tp", "d_tp"), PAIRS)
def test_pull_across_tp_sizes_needs_no_per_head_description(
    closing: list[Rank], kv_heads: int, p_tp: int, d_tp: int, p_whole: bool, d_whole: bool
) -> None:
    p_heads = HeadLayout(num_kv_heads=kv_heads, tp_size=p_tp)
    d_heads = HeadLayout(num_kv_heads=kv_heads, tp_size=d_tp)
    prefill = producers(
        p_heads, seed=SEED, direction=Direction.PULL, timeout_s=3.0, per_head=not p_whole
    )
    decode = consumers(d_heads, direction=Direction.PULL, timeout_s=3.0, per_head=not d_whole)
    closing += prefill + decode
    remote, local, tokens = [3, 7, 1, 9], [10, 2, 5, 4], 3 * 4 + 2
    ticket = _hold(prefill, "req-w", remote, tokens)
    transfers = [c.agent.pull(ticket, local) for c in decode]
    for t in transfers:
        t.wait(5)
        assert t.state is TransferState.DONE, t.error
    for c in decode:
        assert c.cache.mismatches(local, remote, SEED) == []
        assert not any(buf[[0, 6, 11]].any() for buf in c.cache.buffers.values())
    # A pull's producer never posts: it prepares nothing beyond its table, whatever
    # TP sizes will read it.
    assert all(_section(p.agent) == 0 for p in prefill)


@pytest.mark.parametrize(("p_whole", "d_whole"), STYLES, ids=STYLE_IDS)
@pytest.mark.parametrize(("kv_heads", "p_tp", "d_tp"), PAIRS)
def test_push_across_tp_sizes_needs_no_per_head_description(
    closing: list[Rank], kv_heads: int, p_tp: int, d_tp: int, p_whole: bool, d_whole: bool
) -> None:
    p_heads = HeadLayout(num_kv_heads=kv_heads, tp_size=p_tp)
    d_heads = HeadLayout(num_kv_heads=kv_heads, tp_size=d_tp)
    prefill = producers(
        p_heads, seed=SEED, direction=Direction.PUSH, timeout_s=3.0, per_head=not p_whole
    )
    decode = consumers(d_heads, direction=Direction.PUSH, timeout_s=3.0, per_head=not d_whole)
    closing += prefill + decode
    remote, local, tokens = [3, 7, 1, 9], [10, 2, 5, 4], 3 * 4 + 2
    cap = wire.new_capability()
    ticket = _push_ticket(prefill, "req-wp", tokens, cap)
    transfers: list[Transfer] = [c.agent.expect_push(ticket, local) for c in decode]
    for p in prefill:
        p.agent.hold("req-wp", remote, tokens, capability=cap)
    for t in transfers:
        t.wait(5)
        assert t.state is TransferState.DONE, t.error
    for c in decode:
        assert c.cache.mismatches(local, remote, SEED) == []
        assert not any(buf[[0, 6, 11]].any() for buf in c.cache.buffers.values())
    # A push's consumer never posts: nothing prepared beyond its table.
    assert all(_section(c.agent) == 0 for c in decode)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("kv_heads", "p_tp", "d_tp"), PAIRS)
def test_through_host_staging_each_rank_copies_only_its_heads(
    closing: list[Rank], kv_heads: int, p_tp: int, d_tp: int, mode: str
) -> None:
    """The vLLM CPU build stages blocks through host buffers: a rank posting from its
    one-head section (a pull into decode TP1, a push out of prefill TP1) stages those
    pieces of its blocks only, so two producer ranks' heads landing in one block
    side by side never overwrite each other (pipelined slices, concurrent copies)."""
    direction = Direction.PULL if mode == "pull" else Direction.PUSH
    p_heads = HeadLayout(num_kv_heads=kv_heads, tp_size=p_tp)
    d_heads = HeadLayout(num_kv_heads=kv_heads, tp_size=d_tp)
    prefill = producers(
        p_heads, seed=SEED, direction=direction, timeout_s=3.0, per_head=False, bounce=True
    )
    decode = consumers(d_heads, direction=direction, timeout_s=3.0, per_head=False, bounce=True)
    closing += prefill + decode
    for rep, (remote, local) in enumerate(
        [([3, 7, 1, 9], [10, 2, 5, 4]), ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11])]
    ):
        rid, tokens = f"req-b{rep}", len(remote) * 4 - 1
        if direction is Direction.PULL:
            ticket = _hold(prefill, rid, remote, tokens)
            transfers = [c.agent.pull(ticket, local) for c in decode]
        else:
            cap = wire.new_capability()
            ticket = _push_ticket(prefill, rid, tokens, cap)
            transfers = [c.agent.expect_push(ticket, local) for c in decode]
            for p in prefill:
                p.agent.hold(rid, remote, tokens, capability=cap)
        for t in transfers:
            t.wait(5)
            assert t.state is TransferState.DONE, t.error
        for c in decode:
            assert c.cache.mismatches(local, remote, SEED) == [], rep


def _pull_descriptors(
    closing: list[Rank], kv_heads: int, p_tp: int, d_tp: int, *, whole: bool
) -> tuple[list[int], list[Rank], list[Rank]]:
    """Descriptors each decode rank posted for one 4-block pull."""
    p_heads = HeadLayout(num_kv_heads=kv_heads, tp_size=p_tp)
    d_heads = HeadLayout(num_kv_heads=kv_heads, tp_size=d_tp)
    prefill = producers(
        p_heads, seed=SEED, direction=Direction.PULL, timeout_s=3.0, per_head=not whole
    )
    decode = consumers(d_heads, direction=Direction.PULL, timeout_s=3.0, per_head=not whole)
    closing += prefill + decode
    ticket = _hold(prefill, "req-d", [3, 7, 1, 9], 16)
    transfers = [c.agent.pull(ticket, [10, 2, 5, 4]) for c in decode]
    for t in transfers:
        t.wait(5)
        assert t.state is TransferState.DONE, t.error
    return [int(t.stats.descriptors) for t in transfers], prefill, decode


def test_descriptors_per_request_follow_the_coarsest_shared_cut(closing: list[Rank]) -> None:
    """2 layers x K/V = 4 regions of whole heads per rank, 4 blocks: equal TP sizes
    post 16 descriptors per rank whatever the head count; prefill TP1 -> decode TP2
    of 8 heads pairs at 4 heads per region (the decode rank's whole region), the same
    16 (the decode ranks' one-head sections, there for producers of more ranks, stay
    unused); prefill TP2 -> decode TP1 reads each half of its regions' heads from
    another rank: from its one-head section, 8 x 16 per request."""
    same, *_ = _pull_descriptors(closing, 8, 1, 1, whole=True)
    assert same == [16]
    wider, *_ = _pull_descriptors(closing, 8, 1, 2, whole=True)
    assert wider == [16, 16]
    narrower, _, (d,) = _pull_descriptors(closing, 8, 2, 1, whole=True)
    # Decode TP1 (8 heads per region) reads 4 heads from each producer rank: it posts
    # from its one-head section, prepared at registration (4 regions x 8 heads x 12
    # blocks): 4 regions x 8 heads x 4 blocks per request, over both producer ranks.
    assert narrower == [4 * 8 * 4]
    assert _section(d.agent) == 4 * 8 * NUM_BLOCKS


def test_equal_tp_sizes_post_what_they_posted_before(closing: list[Rank]) -> None:
    """A decode rank that prepared a one-head section for other TP sizes still pulls
    a peer of its own TP size with whole-block ids below the section: the plan, its
    descriptors and bytes are those of a rank without one."""
    heads = HeadLayout(num_kv_heads=4, tp_size=1)
    (prefill,) = producers(
        heads, seed=SEED, direction=Direction.PULL, timeout_s=3.0, per_head=False
    )
    (decode,) = consumers(heads, direction=Direction.PULL, timeout_s=3.0, per_head=False)
    closing += [prefill, decode]
    assert _section(decode.agent) == 4 * 4 * NUM_BLOCKS
    table = decode.agent.table
    assert table is not None and len(table) == 4 * NUM_BLOCKS  # the whole-block table
    ticket = _hold([prefill], "req-s", [3, 4, 5, 6], 16)
    t = decode.agent.pull(ticket, [7, 8, 9, 10])
    t.wait(5)
    assert t.state is TransferState.DONE
    assert t.stats.descriptors == 4 * 4
    assert decode.cache.mismatches([7, 8, 9, 10], [3, 4, 5, 6], SEED) == []


def test_a_push_across_tp_sizes_copies_in_once_after_every_ranks_bytes_landed(
    closing: list[Rank],
) -> None:
    """Four producer ranks push one head each into one decode rank through host
    staging: one reception per rank, and a copy in moves the whole blocks (every
    rank's head). So the blocks are copied in once, by the reception that settles
    once all four are complete, never by one whose siblings' heads may still land;
    every head is then the producer's bytes."""
    regions = 4  # 2 layers x K/V, every head of the decode rank in each
    copies: list[int] = []

    def counting_copy(layout: KVLayout) -> CopyOp:
        views = [host_block_view(r) for r in layout.regions]

        def op(direction: CopyDirection, region: int, ids: IntArray, staging: ByteArray) -> None:
            if direction is CopyDirection.OUT:
                staging[ids] = views[region][ids]
            else:
                copies.append(region)
                views[region][ids] = staging[ids]

        return op

    prefill = producers(
        HeadLayout(num_kv_heads=4, tp_size=4),
        seed=SEED,
        direction=Direction.PUSH,
        timeout_s=10.0,
        per_head=False,
        bounce=True,
    )
    decode = consumers(
        HeadLayout(num_kv_heads=4, tp_size=1),
        direction=Direction.PUSH,
        timeout_s=10.0,
        per_head=False,
        copy_op=counting_copy,
    )
    closing += prefill + decode
    for rep, (remote, local) in enumerate([([3, 7, 1, 9], [10, 2, 5, 4]), ([0, 1], [6, 7])]):
        rid, tokens = f"req-once-{rep}", len(remote) * 4 - 1
        cap = wire.new_capability()
        ticket = _push_ticket(prefill, rid, tokens, cap)
        (transfer,) = [c.agent.expect_push(ticket, local) for c in decode]
        copies.clear()
        for p in prefill:
            p.agent.hold(rid, remote, tokens, capability=cap)
        transfer.wait(10)
        assert transfer.state is TransferState.DONE, transfer.error
        assert sorted(copies) == list(range(regions)), rep  # once, not once per rank
        assert decode[0].cache.mismatches(local, remote, SEED) == [], rep
