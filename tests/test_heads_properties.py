"""Properties of the head algebra and of plans across TP sizes (R-TP-1..3).

The oracle is written from what the bytes mean, not from the mapping: every byte of
every rank's cache is labelled with the (layer, K/V, head, token, byte-in-head, block)
it holds, decoded from the layout alone (token-major inside a region, heads
consecutive inside a token). The per-rank plans are executed on those byte arrays;
every consumer byte the equal-TP plan of the same request would write must be written
exactly once, with the producer's label for the same (layer, K/V, head, token, byte)
of the paired block, and no other byte may be written.
"""

from __future__ import annotations

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvxfer.core.descriptors import DescriptorTable, PlanOptions, build_plan
from kvxfer.core.heads import (
    HeadLayout,
    check_head_layouts,
    heads_per_region,
    map_regions,
    needed_ranks,
    pairing_heads,
    peer_ranks,
    place_heads,
    reader_ranks,
    region_heads,
    source_choices,
    source_ranks,
    split_heads,
)
from kvxfer.core.layout import KVLayout, KVPart, SplitAxis
from kvxfer.core.tp_plan import TPPlanner
from kvxfer.errors import ConfigError, LayoutError, LayoutMismatch
from kvxfer.testing import tp_strategies as tps
from kvxfer.testing.patterns import locate

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]


def _labels(layout: KVLayout, heads: range, region: int, tags: I64) -> U8:
    """What ``region`` holds in blocks labelled ``tags`` (one row per tag)."""
    r = layout.regions[region]
    tokens = layout.tokens_per_desc
    width = len(heads)
    per_head = r.block_len // (tokens * width)
    off = np.arange(r.block_len, dtype=np.uint64)
    if layout.kv_layout == "HND":  # head-major: each head's tokens together
        token = off // np.uint64(per_head) % np.uint64(tokens) + np.uint64(r.shard * tokens)
        head = off // np.uint64(tokens * per_head) + np.uint64(heads.start)
    else:  # token-major: each token's heads together
        token = off // np.uint64(width * per_head) + np.uint64(r.shard * tokens)
        head = off // np.uint64(per_head) % np.uint64(width) + np.uint64(heads.start)
    byte = off % np.uint64(per_head)
    part = list(KVPart).index(r.part)
    what = ((np.uint64(r.layer * 4 + part) * np.uint64(131) + head) * np.uint64(257) + token) * (
        np.uint64(8191)
    ) + byte
    mixed = (what[None, :] + tags.astype(np.uint64)[:, None] * np.uint64(104729)) * np.uint64(
        2654435761
    )
    out: U8 = ((mixed >> np.uint64(17)) & np.uint64(0xFF)).astype(np.uint8)
    return out


def _described(layout: KVLayout) -> list[range]:
    return [range(r.head, r.head + layout.num_kv_heads) for r in layout.regions]


def _execute(case: tps.TPCase) -> None:
    lb = [np.asarray(g, dtype=np.int64) for g in case.request.local_blocks]
    rb = [np.asarray(g, dtype=np.int64) for g in case.request.remote_blocks]
    n = case.request.num_tokens
    local = DescriptorTable.build(case.local, case.options)
    remotes = {p: DescriptorTable.build(lay, case.options) for p, lay in case.remotes.items()}
    planner = TPPlanner.build(
        local,
        remotes,
        local_heads=case.consumer,
        remote_heads=case.producer,
        local_rank=case.consumer_rank,
        salt=case.salt,
    )
    assert planner.ranks == needed_ranks(
        case.consumer, case.consumer_rank, case.producer, salt=case.salt
    )
    # Heads from the layouts as described (Region.head, heads per region), not the algebra.
    mine = _described(case.local)
    held = {p: _described(lay) for p, lay in case.remotes.items()}
    nb = case.local.num_blocks
    # Producer memory: every block labelled with its own block id.
    memory = {
        p: [_labels(lay, held[p][j], j, np.arange(lay.num_blocks)) for j in range(len(held[p]))]
        for p, lay in case.remotes.items()
    }
    got = [np.zeros((nb, r.block_len), dtype=np.uint8) for r in case.local.regions]
    count = [np.zeros((nb, r.block_len), dtype=np.int64) for r in case.local.regions]
    rank_plans = planner.plan(lb, rb, n)
    for rp in rank_plans:
        plan = rp.plan
        assert len(plan.local_ids) == len(plan.remote_ids)
        table = remotes[rp.rank]
        dr, db, do, dn = locate(local, plan.local_ids)
        sr, sb, so, sn = locate(table, plan.remote_ids)
        assert np.array_equal(dn, sn)
        for r, b, o, k, r2, b2, o2 in zip(dr, db, do, dn, sr, sb, so):
            got[r][b, o : o + k] = memory[rp.rank][r2][b2, o2 : o2 + k]
            count[r][b, o : o + k] += 1
        # The merged runs move the same bytes as the descriptors.
        assert rp.runs().nbytes == plan.nbytes
        # Push: producer rank p, holding only its own table, plans the same pairs.
        assert case.consumer_rank in reader_ranks(
            case.producer, rp.rank, case.consumer, salt=case.salt
        )
        (push,) = TPPlanner.build(
            local,
            {rp.rank: table},
            local_heads=case.consumer,
            remote_heads=case.producer,
            local_rank=case.consumer_rank,
            salt=case.salt,
            only=(rp.rank,),
        ).plan(lb, rb, n)
        assert np.array_equal(push.plan.local_ids, plan.local_ids)
        assert np.array_equal(push.plan.remote_ids, plan.remote_ids)
    # The bytes an equal-TP plan writes into this rank's cache (build_plan's selection).
    ref = build_plan(local, local, lb, lb, n)
    want = [np.zeros((nb, r.block_len), dtype=bool) for r in case.local.regions]
    for r, b, o, k in zip(*locate(local, ref.local_ids)):
        want[r][b, o : o + k] = True
    assert sum(rp.plan.nbytes for rp in rank_plans) == ref.nbytes
    for rp in rank_plans:
        for g, blocks in enumerate(ref.local_blocks):
            assert np.array_equal(rp.plan.local_blocks[g], blocks)
    pairs = [dict(zip(a.tolist(), b.tolist())) for a, b in zip(lb, rb)]
    for j, region in enumerate(case.local.regions):
        assert count[j].max(initial=0) <= 1, "a consumer byte is written twice"
        assert np.array_equal(count[j] == 1, want[j]), "written bytes differ from equal-TP"
        rows = np.flatnonzero(want[j].any(axis=1))
        if len(rows) == 0:
            continue
        tags = np.array([pairs[region.group][int(b)] for b in rows], dtype=np.int64)
        expected = _labels(case.local, mine[j], j, tags)
        mask = want[j][rows]
        assert np.array_equal(got[j][rows][mask], expected[mask]), "a byte from the wrong source"


@given(tps.tp_cases())
def test_every_consumer_byte_is_written_once_from_the_same_head_token_and_byte(
    case: tps.TPCase,
) -> None:
    _execute(case)


@st.composite
def _sectioned_cases(draw: st.DrawFn) -> tps.TPCase:
    """Cases whose tables have every section: whole blocks, chunks of the last block
    and the window granules of a sliding group (the drawn options have each only some
    of the time; the sub-table ids of the later sections map by their own offsets)."""
    block_size = draw(st.sampled_from((8, 16)))
    model = tps.TPModel(
        num_kv_heads=draw(st.sampled_from(tps.KV_HEADS)),
        layers=draw(st.integers(2, 3)),
        head_bytes=draw(st.integers(1, 3)),
        block_size=block_size,
        window=draw(st.sampled_from((1, 2, 4))),
    )
    case = draw(tps.tp_cases(st.just(model)))
    options = PlanOptions(
        chunk_mode=True,
        chunk_tokens=draw(st.integers(1, block_size // 2)),
        swa_window_mode=True,
        coalesce=draw(st.booleans()),
    )
    # A window granule that is a chunk already gets no section of its own.
    table = DescriptorTable.build(case.local, options)
    assume(table.chunk_tokens < case.local.tokens_per_desc and (table.window_offset >= 0).any())
    return msgspec.structs.replace(case, options=options)


@given(_sectioned_cases())
def test_plans_over_chunk_and_window_sections_write_every_byte_once_from_the_right_byte(
    case: tps.TPCase,
) -> None:
    _execute(case)


@given(tps.tp_cases(kv_layout="HND", uncut=True), st.booleans())
def test_pairs_cut_at_pairing_write_every_consumer_byte_once_from_the_right_byte(
    case: tps.TPCase, push: bool
) -> None:
    """Issue 26: either side described per (layer, part, shard) or per head, as its
    engine does by default. The pairing cuts the tables the way the agents do: the
    posting side (a pull's consumer, a push's producer) keeps its regions or takes
    their one-head pieces, the peer's are cut to match (heads.pairing_heads); then
    every property of the planner holds as for tables described per head."""
    c, p, rank = case.consumer, case.producer, case.consumer_rank
    consumer = heads_per_region(case.local, c, rank)
    producer = heads_per_region(case.remotes[0], p, 0)
    own, peer = (producer, consumer) if push else (consumer, producer)
    per = pairing_heads(own, peer)
    assert per in (own, 1) and peer % per == 0
    cut = msgspec.structs.replace(
        case,
        local=split_heads(case.local, c, rank, per),
        remotes={q: split_heads(lay, p, q, per) for q, lay in case.remotes.items()},
    )
    # Cutting moves no byte: the pieces tile their regions' blocks, in order.
    for before, after in [
        (case.local, cut.local),
        *zip(case.remotes.values(), cut.remotes.values()),
    ]:
        k = len(after.regions) // len(before.regions)
        assert len(after.regions) == k * len(before.regions)
        for i, r in enumerate(before.regions):
            pieces = after.regions[i * k : (i + 1) * k]
            assert [q.base - r.base for q in pieces] == [j * r.block_len // k for j in range(k)]
            assert {(q.stride, q.block_len * k, q.layer, q.part) for q in pieces} == {
                (r.stride, r.block_len, r.layer, r.part)
            }
    _execute(cut)


@given(st.sampled_from(tps.KV_HEADS), st.data())
def test_replicas_spread_over_producer_ranks_and_equal_tp_pairs_rank_with_rank(
    n: int, data: st.DataObject
) -> None:
    producer = data.draw(tps.head_layouts(n))
    consumer = data.draw(tps.head_layouts(n))
    for h in range(n):
        holders, takers = producer.ranks_of(h), consumer.ranks_of(h)
        chosen = {source_ranks(consumer, c, producer)[h] for c in takers}
        # Consumers sharing a head use as many of its replicas as there are.
        assert len(chosen) == min(len(holders), len(takers))
        assert chosen <= set(holders)
        # Over salts, one consumer rank reaches every replica.
        salted = {source_ranks(consumer, takers[0], producer, salt=s)[h] for s in range(8)}
        assert salted == set(holders)
    for p in range(producer.tp_size):
        readers = reader_ranks(producer, p, consumer)
        for c in range(consumer.tp_size):
            assert (p in needed_ranks(consumer, c, producer)) == (c in readers)
    same = HeadLayout(num_kv_heads=n, tp_size=producer.tp_size)
    for r in range(same.tp_size):
        assert needed_ranks(same, r, same) == (r,)


@given(st.sampled_from(tps.KV_HEADS), st.data(), st.integers(0, 2**32 - 1))
def test_source_choices_are_every_answer_a_salt_can_give_each_once(
    n: int, data: st.DataObject, salt: int
) -> None:
    producer = data.draw(tps.head_layouts(n))
    consumer = data.draw(tps.head_layouts(n))
    rank = data.draw(st.integers(0, consumer.tp_size - 1))
    choices = source_choices(consumer, rank, producer)
    maps = [tuple(sorted(sources.items())) for _, sources in choices]
    assert len(set(maps)) == len(maps)  # each once
    for s, sources in choices:  # each with a salt that gives it
        assert source_ranks(consumer, rank, producer, salt=s) == sources
    # Whatever a request's salt, its answer is one of them (agents prepare all).
    assert tuple(sorted(source_ranks(consumer, rank, producer, salt=salt).items())) in maps
    # Replicas chosen differently give different answers: as many as the replicas a
    # head of this rank has.
    assert len(maps) == min(producer.replicas, 8)
    assert len(source_choices(consumer, rank, producer, limit=1)) == 1


@given(st.sampled_from(tps.KV_HEADS), st.data())
def test_peer_ranks_are_every_rank_any_salt_makes_a_rank_transfer_with(
    n: int, data: st.DataObject
) -> None:
    mine = data.draw(tps.head_layouts(n))
    other = data.draw(tps.head_layouts(n))
    rank = data.draw(st.integers(0, mine.tp_size - 1))
    salts = range(8 * max(mine.replicas, other.replicas))
    read = {p for s in salts for p in needed_ranks(mine, rank, other, salt=s)}
    written = {c for s in salts for c in reader_ranks(mine, rank, other, salt=s)}
    if other.tp_size == mine.tp_size:
        read = written = {rank}  # equal sizes pair rank with rank, whatever the salt
    assert peer_ranks(mine, rank, other.tp_size, reads=True) == tuple(sorted(read))
    assert peer_ranks(mine, rank, other.tp_size, reads=False) == tuple(sorted(written))


@given(st.integers(1, 16), st.integers(1, 16))
def test_head_counts_a_tp_size_cannot_split_are_refused_by_name(n: int, tp: int) -> None:
    valid = (n % tp if n >= tp else tp % n) == 0
    if valid:
        layout = HeadLayout(num_kv_heads=n, tp_size=tp)
        held = [h for r in range(tp) for h in layout.heads_of(r)]
        # Every head on replicas ranks, every rank with heads_per_rank heads.
        assert sorted(set(held)) == list(range(n))
        assert len(held) == n * layout.replicas == tp * layout.heads_per_rank
        return
    with pytest.raises(ConfigError, match=rf"^tp_size={tp}: must divide num_kv_heads \({n}") as e:
        HeadLayout(num_kv_heads=n, tp_size=tp)
    assert (e.value.key, e.value.value) == ("tp_size", tp)


def _model(**kw: object) -> tps.TPModel:
    fields: dict[str, object] = {"num_kv_heads": 4, "layers": 2, "head_bytes": 4, "block_size": 4}
    fields.update(kw)
    return tps.TPModel(**fields)  # type: ignore[arg-type]


def test_latent_kv_is_one_head_every_rank_holds() -> None:
    with pytest.raises(ConfigError, match=r"^num_kv_heads=2: latent \(MLA\)"):
        HeadLayout(num_kv_heads=2, tp_size=2, latent=True)
    mla = HeadLayout(num_kv_heads=1, tp_size=4, latent=True)
    assert [mla.heads_of(r) for r in range(4)] == [range(1)] * 4
    with pytest.raises(LayoutMismatch, match=r"latent \(MLA KV\)"):
        source_ranks(mla, 0, HeadLayout(num_kv_heads=1, tp_size=2))


def test_layouts_that_cannot_exchange_heads_name_the_field() -> None:
    model = _model()
    p, c = HeadLayout(num_kv_heads=4, tp_size=1), HeadLayout(num_kv_heads=4, tp_size=2)
    remote = tps.rank_layout(model, p, 0, per_head=True, num_blocks=4)
    local = tps.rank_layout(model, c, 1, per_head=True, num_blocks=4, seed=3)
    check_head_layouts(local, remote, local_heads=c, remote_heads=p, local_rank=1)
    with pytest.raises(LayoutMismatch, match=r"num_kv_heads \(model, all ranks\)") as e:
        check_head_layouts(
            local,
            remote,
            local_heads=c,
            remote_heads=HeadLayout(num_kv_heads=8, tp_size=2),
            local_rank=1,
        )
    assert (e.value.local, e.value.remote) == (4, 8)
    wider = tps.rank_layout(_model(head_bytes=8), p, 0, per_head=True, num_blocks=4)
    with pytest.raises(LayoutMismatch, match=r"layer 0 K: bytes per head per block") as e:
        check_head_layouts(local, wider, local_heads=c, remote_heads=p, local_rank=1)
    assert (e.value.local, e.value.remote) == (16, 32)
    deeper = tps.rank_layout(_model(layers=3), p, 0, per_head=True, num_blocks=4)
    with pytest.raises(LayoutMismatch, match="num_layers"):
        check_head_layouts(local, deeper, local_heads=c, remote_heads=p, local_rank=1)


def test_region_heads_must_be_the_ranks_global_heads() -> None:
    c = HeadLayout(num_kv_heads=4, tp_size=2)
    rank1 = tps.rank_layout(_model(), c, 1, per_head=True, num_blocks=4)
    # Described with the tensor's own head indices (0, 1) instead of global (2, 3).
    local = tps.rank_layout(_model(), c, 0, per_head=True, num_blocks=4)
    with pytest.raises(LayoutError, match=r"regions\[\d+\]\.head=0: rank 1 of num_kv_heads=4"):
        region_heads(local, c, 1)
    placed = place_heads(local, c, 1)
    assert [r.head for r in placed.regions] == [r.head for r in rank1.regions]
    assert region_heads(placed, c, 1)[0] in (range(2, 3), range(3, 4))
    assert place_heads(rank1, c, 1) is rank1


def test_head_split_shards_are_refused() -> None:
    layout = tps.rank_layout(_model(), HeadLayout(num_kv_heads=4), 0, per_head=False, num_blocks=2)
    split = KVLayout(
        block_size=4,
        regions=tuple(
            r.__class__(**{**{f: getattr(r, f) for f in r.__struct_fields__}, "shard": s})
            for r in layout.regions[:1]
            for s in range(2)
        ),
        split_axis=SplitAxis.HEAD,
        num_shards=2,
    )
    with pytest.raises(LayoutError, match=r"num_shards=2: .*head-split shards"):
        region_heads(split, HeadLayout(num_kv_heads=4), 0)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_head_slices_are_refused_pointing_at_per_head_regions(kv_layout: str) -> None:
    p, c = HeadLayout(num_kv_heads=4, tp_size=1), HeadLayout(num_kv_heads=4, tp_size=2)
    model = _model()
    remote = tps.rank_layout(model, p, 0, per_head=False, num_blocks=4, kv_layout=kv_layout)
    local = tps.rank_layout(model, c, 1, per_head=True, num_blocks=4, seed=5)
    with pytest.raises(ConfigError) as e:
        map_regions(local, {0: remote}, local_heads=c, remote_heads=p, local_rank=1)
    assert (e.value.key, e.value.value) == ("kv_layout", kv_layout)
    assert "one region per (layer, K/V, head)" in e.value.rule
    cost = "strided: 4 descriptors per block" if kv_layout == "NHD" else "not a descriptor"
    assert cost in e.value.rule
    tables = {0: DescriptorTable.build(remote)}
    with pytest.raises(ConfigError, match="kv_layout"):
        TPPlanner.build(
            DescriptorTable.build(local), tables, local_heads=c, remote_heads=p, local_rank=1
        )


def test_a_missing_producer_rank_is_named() -> None:
    p, c = HeadLayout(num_kv_heads=4, tp_size=2), HeadLayout(num_kv_heads=4, tp_size=1)
    model = _model()
    local = DescriptorTable.build(tps.rank_layout(model, c, 0, per_head=True, num_blocks=4))
    only0 = {0: DescriptorTable.build(tps.rank_layout(model, p, 0, per_head=True, num_blocks=4))}
    with pytest.raises(ConfigError, match=r"^remote tables=\[0\]: need producer ranks \[1\]"):
        TPPlanner.build(local, only0, local_heads=c, remote_heads=p, local_rank=0)
