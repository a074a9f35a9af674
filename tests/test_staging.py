"""The gather path's staging pieces (issue 55): slots that never grow and whose
generation moves on every release (kvxfer.core.staging), the producer's hold check
(first_outside), the host gather/scatter copies by address (kvxfer.io.host_copy),
the Welcome field older peers skip, and GatherConfig's slots and force knobs."""

from __future__ import annotations

import ctypes

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.core import wire
from kvxfer.core.descriptors import DescriptorTable, Runs, build_plan
from kvxfer.core.gather_cost import GatherConfig, XferPath, choose_path
from kvxfer.core.gather_plan import Copies, staging_rounds
from kvxfer.core.layout import MemKind
from kvxfer.core.staging import StagingSlots, extents, first_outside
from kvxfer.errors import ConfigError, PlanError
from kvxfer.io.host_copy import gather_into, scatter_from
from kvxfer.testing.kvcache import HostKVCache, ModelShape


def u64(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


def mk_runs(local: np.ndarray, remote: np.ndarray, length: np.ndarray) -> Runs:
    zeros = np.zeros(len(length), dtype=np.int64)
    return Runs(
        local_addr=local,
        remote_addr=remote,
        length=length,
        local_device=zeros,
        remote_device=zeros,
    )


def test_slots_bounded_and_generations_move_on() -> None:
    pool = StagingSlots(100, 3)
    assert pool.slot_bytes == 33 and pool.slots == 3
    got = [pool.acquire() for _ in range(3)]
    assert [s.offset for s in got if s] == [0, 33, 66]
    assert pool.acquire() is None  # exhausted: the request goes direct
    first = got[0]
    assert first is not None
    pool.release(first)
    assert pool.generation(0) == 1 and pool.free == 1
    pool.release(first)  # repeated release: frees nothing
    assert pool.free == 1
    again = pool.acquire()
    assert again is not None and again.index == 0 and again.generation == 1
    pool.release(first)  # a stale release does not free the slot's new holder
    assert pool.free == 0


@pytest.mark.parametrize(("nbytes", "slots"), [(10, 0), (1, 2), (10, True)])
def test_slots_refuse_bad_sizes(nbytes: int, slots: int) -> None:
    with pytest.raises(ConfigError):
        StagingSlots(nbytes, slots)


def test_first_outside() -> None:
    starts, ends = u64(100, 300), u64(200, 400)
    assert first_outside(u64(100, 350), u64(100, 50), starts, ends) is None
    assert first_outside(u64(100, 150), u64(10, 51), starts, ends) == 1  # past the end
    assert first_outside(u64(50), u64(10), starts, ends) == 0  # before every block
    assert first_outside(u64(250), u64(10), starts, ends) == 0  # in the gap
    assert first_outside(u64(190), u64(20), starts, ends) == 0  # spans into the gap
    assert first_outside(u64(150), u64(0), starts, ends) == 0  # empty piece
    assert first_outside(u64(2**64 - 8), u64(16), u64(2**64 - 16), u64(2**64 - 1)) == 0
    assert first_outside(u64(), u64(), starts, ends) is None
    assert first_outside(u64(100), u64(1), u64(), u64()) == 0


@given(
    blocks=st.lists(st.integers(0, 31), min_size=1, max_size=32, unique=True),
    probe=st.tuples(st.integers(0, 32 * 16), st.integers(1, 40)),
)
def test_first_outside_matches_bytewise(blocks: list[int], probe: tuple[int, int]) -> None:
    bs = 16
    owned = np.zeros(32 * bs + 64, dtype=bool)
    for b in blocks:
        owned[b * bs : (b + 1) * bs] = True
    # The hold's extents, merged where blocks touch (as the producer builds them).
    edges = np.flatnonzero(np.diff(np.concatenate(([0], owned.astype(np.int8), [0]))))
    starts, ends = edges[0::2].astype(np.uint64), edges[1::2].astype(np.uint64)
    a, n = probe
    inside = bool(owned[a : a + n].all()) and a + n <= len(owned)
    assert (first_outside(u64(a), u64(n), starts, ends) is None) == inside


def test_host_gather_scatter_round_trip() -> None:
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    slot = np.zeros(64, dtype=np.uint8)
    s_base, d_base = src.ctypes.data, dst.ctypes.data
    runs = mk_runs(u64(d_base + 10, d_base + 200), u64(s_base + 0, s_base + 100), u64(30, 50))
    plan = staging_rounds(runs, 64)
    for rnd in plan.rounds:
        gather_into(rnd.remote, slot.ctypes.data, 64)
        scatter_from(rnd.local, slot.ctypes.data, 64)
    want = np.zeros(256, dtype=np.uint8)
    want[10:40], want[200:250] = src[0:30], src[100:150]
    assert np.array_equal(dst, want)


def test_host_copy_refuses_past_the_slot() -> None:
    buf = ctypes.create_string_buffer(32)
    addr = ctypes.addressof(buf)
    bad = Copies(addr=u64(addr), offset=u64(8), length=u64(16))
    with pytest.raises(PlanError, match="staging slot"):
        gather_into(bad, addr + 16, 16)
    with pytest.raises(PlanError, match="staging slot"):
        scatter_from(bad, addr + 16, 16)


def test_welcome_staging_field_is_append_only() -> None:
    info = wire.StagingInfo(base=4096, nbytes=1 << 20, slots=2, mem=MemKind.DRAM)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(info), type=wire.StagingInfo) == info
    # A peer of an earlier build omits the field: it decodes as None.
    fields = {f.name for f in msgspec.structs.fields(wire.Welcome)}
    assert "staging" in fields
    assert wire.Welcome.__struct_defaults__[-1] is None
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"base": 0, "nbytes": 0}, wire.StagingInfo)


def _scattered(n: int, size: int = 4096) -> Runs:
    addr = np.arange(n, dtype=np.uint64) * np.uint64(2 * size)
    return mk_runs(addr, addr + np.uint64(1 << 30), u64(*[size] * n))


def test_force_and_slots() -> None:
    runs = _scattered(8)
    off = GatherConfig(staging_bytes=1 << 20)
    assert choose_path(runs, off).path is XferPath.DIRECT  # under min_runs
    forced = GatherConfig(staging_bytes=1 << 20, slots=2, force=XferPath.GATHER)
    choice = choose_path(runs, forced)
    assert choice.path is XferPath.GATHER and choice.staging is not None
    assert choice.staging.staging_bytes == forced.slot_bytes == 1 << 19
    one_run = mk_runs(u64(0), u64(1 << 30), u64(1 << 16))
    assert choose_path(one_run, forced).path is XferPath.DIRECT  # never gathers one run
    cheap = GatherConfig(staging_bytes=1 << 20, min_runs=1, copy_gbps=1e6, descriptor_s=1e-3)
    assert choose_path(runs, cheap).path is XferPath.GATHER
    never = GatherConfig(
        staging_bytes=1 << 20, min_runs=1, copy_gbps=1e6, descriptor_s=1e-3, force=XferPath.DIRECT
    )
    assert choose_path(runs, never).path is XferPath.DIRECT
    with pytest.raises(ConfigError, match=r"gather\.slots"):
        GatherConfig(slots=0)
    with pytest.raises(ConfigError, match=r"gather\.staging_bytes"):
        GatherConfig(staging_bytes=1, slots=2)


@given(ranges=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 20)), max_size=20))
def test_extents_cover_exactly_the_ranges(ranges: list[tuple[int, int]]) -> None:
    addr = u64(*[a for a, _ in ranges])
    length = u64(*[n for _, n in ranges])
    starts, ends = extents(addr, length)
    want = np.zeros(256, dtype=bool)
    for a, n in ranges:
        want[a : a + n] = True
    got = np.zeros(256, dtype=bool)
    for a, e in zip(starts.tolist(), ends.tolist()):
        assert not got[a:e].any() and a < e
        got[a:e] = True
    assert np.array_equal(got, want)
    assert (np.diff(starts.astype(np.int64)) > 0).all()


SHAPE = ModelShape(name="gather", layers=2, kv_heads=1, head_dim=8)


def test_gathered_pull_on_host_lands_byte_exact_and_hold_is_enforced() -> None:
    """The pull's steps in one process: the producer checks each round's remote copies
    against its hold's extents and gathers into its slot, one move stands in for the
    consumer's READ of the slot, and the consumer scatters into its own blocks."""
    bs, n = 16, 64
    producer = HostKVCache(SHAPE, bs, n, fill_seed=3)
    consumer = HostKVCache(SHAPE, bs, n)
    p_table = DescriptorTable.build(producer.layout())
    c_table = DescriptorTable.build(consumer.layout())
    groups = len(producer.layout().groups)
    held = list(range(0, 40, 2))  # scattered on the producer
    local = list(range(5, 25))  # contiguous on the consumer
    tokens = bs * len(held)
    plan = build_plan(c_table, p_table, [local] * groups, [held] * groups, tokens)
    runs = plan.runs(c_table, p_table)
    choice = choose_path(runs, GatherConfig(staging_bytes=4096, slots=2, force=XferPath.GATHER))
    assert choice.path is XferPath.GATHER and choice.staging is not None
    hold_plan = build_plan(p_table, p_table, [held] * groups, [held] * groups, tokens)
    hold_runs = hold_plan.runs(p_table, p_table)
    starts, ends = extents(hold_runs.remote_addr, hold_runs.length)
    pool = StagingSlots(4096, 2)
    p_slot, c_slot = pool.acquire(), StagingSlots(4096, 2).acquire()
    assert p_slot is not None and c_slot is not None
    p_buf, c_buf = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
    p_addr, c_addr = p_buf.ctypes.data + p_slot.offset, c_buf.ctypes.data + c_slot.offset
    for rnd in choice.staging.rounds:
        assert first_outside(rnd.remote.addr, rnd.remote.length, starts, ends) is None
        gather_into(rnd.remote, p_addr, p_slot.nbytes)
        ctypes.memmove(c_addr, p_addr, rnd.nbytes)  # the consumer's one READ
        assert pool.generation(p_slot.index) == p_slot.generation  # slot not reused
        scatter_from(rnd.local, c_addr, c_slot.nbytes)
    assert consumer.mismatches(local, held, producer_seed=3) == 0
    assert len(choice.staging.rounds) < len(runs)
    # A ticket that names a block outside the hold: the producer's check refuses it.
    stray = build_plan(c_table, p_table, [[0]] * groups, [[41]] * groups, bs)
    stray_rounds = staging_rounds(stray.runs(c_table, p_table), 4096).rounds
    assert (
        first_outside(stray_rounds[0].remote.addr, stray_rounds[0].remote.length, starts, ends) == 0
    )


def test_bench_reports_the_gather_models_choice() -> None:
    from kvxfer.tools.bench.measure import gather_choice

    one_run = mk_runs(u64(0), u64(1 << 30), u64(1 << 16))
    assert gather_choice(one_run) == "direct"
    # The bench's bs16 scattered case: 14,000 runs of 32 KiB (docs/DESIGN.md's table).
    assert gather_choice(_scattered(14_000, 32768)) == "direct"  # CPU: copies cost more
    gpu = GatherConfig(staging_bytes=64 << 20, descriptor_s=7e-6, link_gbps=500, copy_gbps=1000)
    assert gather_choice(_scattered(14_000, 32768), gpu) == "gather"


def _reference(copies: Copies, src: np.ndarray, slot: np.ndarray, to_slot: bool) -> None:
    for a, o, n in zip(copies.addr.tolist(), copies.offset.tolist(), copies.length.tolist()):
        if to_slot:
            slot[o : o + n] = src[a : a + n]
        else:
            src[a : a + n] = slot[o : o + n]


@given(
    width=st.sampled_from([1, 2, 48, 64, 96, 512]),
    # From 1 piece (copied one by one) to over 16 (by rows where a width is shared).
    count=st.integers(1, 3) | st.integers(20, 40),
    gap=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_host_copies_by_rows_equal_piece_by_piece(
    width: int, count: int, gap: int, seed: int
) -> None:
    """Whatever path a round takes (rows of a shared width, or one memmove a piece),
    gathering and scattering move exactly the bytes a piece-by-piece copy moves, into
    the slot offsets given (abutting, or with gaps), and nothing else."""
    rng = np.random.default_rng(seed)
    # Pieces at multiples of ``width`` in a 64-row engine buffer, distinct starts.
    rows = rng.choice(61, count, replace=False).astype(np.uint64)
    starts = rows * np.uint64(width)
    lengths = rng.integers(1, 4, count).astype(np.uint64) * np.uint64(width)
    offsets = np.cumsum(lengths + np.uint64(gap * width)) - lengths - np.uint64(gap * width)
    engine = rng.integers(0, 256, 64 * width, dtype=np.uint8)
    engine = np.concatenate([engine, np.zeros(3 * width, dtype=np.uint8)])
    slot_nbytes = int((offsets + lengths).max()) + width
    base = engine.ctypes.data
    copies = Copies(starts + np.uint64(base), offsets.astype(np.uint64), lengths)
    slot, want = np.zeros(slot_nbytes, np.uint8), np.zeros(slot_nbytes, np.uint8)
    rel = Copies(starts, offsets.astype(np.uint64), lengths)
    assert gather_into(copies, slot.ctypes.data, slot_nbytes) == int(lengths.sum())
    _reference(rel, engine, want, to_slot=True)
    assert np.array_equal(slot, want)
    # Scatter a fresh slot back over a copy of the engine buffer.
    fresh = rng.integers(0, 256, slot_nbytes, dtype=np.uint8)
    before = engine.copy()
    scatter_from(Copies(copies.addr, copies.offset, copies.length), fresh.ctypes.data, slot_nbytes)
    _reference(rel, before, fresh, to_slot=False)
    assert np.array_equal(engine, before)


@given(
    st.lists(
        st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(1, 2**64 - 1)),
        max_size=50,
    )
)
def test_pieces_pack_and_unpack_exactly(pieces: list[tuple[int, int, int]]) -> None:
    cols = [np.array(c, dtype=np.uint64) for c in zip(*pieces)] or [u64()] * 3
    copies = Copies(addr=cols[0], offset=cols[1], length=cols[2])
    data = copies.pack()
    assert len(data) == 24 * len(pieces)
    back = Copies.unpack(data)
    for a, b in ((back.addr, cols[0]), (back.offset, cols[1]), (back.length, cols[2])):
        assert back.addr.dtype == np.uint64 and a.tolist() == b.tolist()
    with pytest.raises(PlanError, match="whole number of 24-byte pieces"):
        Copies.unpack(data + b"\0")
    if pieces:
        zero = Copies(addr=u64(1), offset=u64(2), length=u64(0)).pack()
        with pytest.raises(PlanError, match=f"gather piece {len(pieces)} is empty"):
            Copies.unpack(data + zero)
