"""Pulls of a hybrid model's state slots across TP sizes between in-process Agents on
the fake backend (issue 53): attention KV split by heads beside a Mamba2-shaped state
layer (conv ``[x | B | C]`` in DS order, SSM state by heads), every 4-byte word of
both checked against what it means; refusals named."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pytest

from kvxfer.agent import Agent, AgentConfig, Ticket
from kvxfer.backend import BackendOptions
from kvxfer.core import wire
from kvxfer.core.compat import Fingerprint
from kvxfer.core.heads import HeadLayout, TPRank
from kvxfer.core.layout import ConvLayout, Group, GroupKind, KVLayout, KVPart, Region
from kvxfer.core.state_split import StateSegment, StateSplit, units_of
from kvxfer.errors import KvxferError, TransferError
from kvxfer.testing.fake_backend import FakeBackend
from kvxfer.transfer import TransferState
from kvxfer.types import Direction, Role
from tests import ports

NB, BS, HEAD_WORDS = 8, 4, 2
_names = itertools.count()
I32 = npt.NDArray[np.int32]


def _split(x_heads: int, groups: int) -> StateSplit:
    return StateSplit(
        conv=(
            StateSegment(name="x", units=x_heads, unit_bytes=8),
            StateSegment(name="B", units=groups, unit_bytes=12),
            StateSegment(name="C", units=groups, unit_bytes=12),
        ),
        ssm=(StateSegment(name="heads", units=x_heads, unit_bytes=16),),
    )


def _kv_word(part: Any, head: Any, token: Any, word: Any, block: Any) -> Any:
    """The label of a KV word (scalars or arrays): what it means, and its block."""
    return ((((part * 16 + head) * BS + token) * HEAD_WORDS + word) * NB + block) * 2 + 1


def _state_words(split: StateSplit, tp: int, rank: int, part: KVPart) -> I32:
    """What one slot of a rank's ``part`` state holds, word by word (slot 0)."""
    out = []
    for seg, s in enumerate(split.segments(part)):
        for u in units_of(s.units, tp, rank):
            for w in range(s.unit_bytes // 4):
                out.append(((((part is KVPart.SSM) * 4 + seg) * 16 + u) * 8 + w) * NB * 2)
    return np.array(out, dtype=np.int32)


class _Cache:
    """One rank's memory: K and V of layer 0 (head-major, all its heads in one region)
    and layer 1's conv and SSM state, labelled (or zero)."""

    def __init__(self, heads: HeadLayout, split: StateSplit, rank: int, fill: bool) -> None:
        tp = heads.tp_size
        self.held = heads.heads_of(rank)
        n = len(self.held)
        self.kv = {p: np.zeros((NB, n, BS, HEAD_WORDS), dtype=np.int32) for p in (0, 1)}
        self.state = {
            part: np.zeros((NB, split.region_bytes(part, tp) // 4), dtype=np.int32)
            for part in (KVPart.CONV, KVPart.SSM)
        }
        self.want_state = {part: _state_words(split, tp, rank, part) for part in self.state}
        if fill:
            for p, buf in self.kv.items():
                b, i, t, w = np.indices(buf.shape)
                buf[...] = _kv_word(p, i + self.held.start, t, w, b)
            for part, slots in self.state.items():
                slots[...] = self.want_state[part][None, :] + 2 * np.arange(NB)[:, None] + 1

    def layout(self, rank_heads: range) -> KVLayout:
        regions = [
            Region(
                base=int(buf.ctypes.data),
                num_blocks=NB,
                stride=buf.strides[0],
                block_len=buf[0].nbytes,
                layer=0,
                part=KVPart.K if p == 0 else KVPart.V,
                head=rank_heads.start,
            )
            for p, buf in self.kv.items()
        ]
        regions += [
            Region(
                base=int(buf.ctypes.data),
                num_blocks=NB,
                stride=buf.strides[0],
                block_len=buf[0].nbytes,
                layer=1,
                part=part,
                group=1,
            )
            for part, buf in self.state.items()
        ]
        return KVLayout(
            block_size=BS,
            regions=tuple(regions),
            kv_layout="HND",
            groups=(
                Group(kind=GroupKind.FULL),
                Group(kind=GroupKind.STATE, conv_layout=ConvLayout.DS),
            ),
        )


def _rank(
    role: Role,
    heads: HeadLayout,
    split: StateSplit,
    rank: int,
    port: int,
    direction: Direction = Direction.PULL,
) -> tuple[Agent, _Cache]:
    cache = _Cache(heads, split, rank, fill=role is Role.PRODUCER)
    fingerprint = Fingerprint(
        model="m",
        dtype="int32",
        kv_cache_dtype="int32",
        attention_backend="t",
        direction=direction,
    )
    agent = Agent(
        AgentConfig(
            engine_id="prefill" if role is Role.PRODUCER else "decode",
            fingerprint=fingerprint,
            role=role,
            direction=direction,
            side_channel_host="127.0.0.1",
            side_channel_port=port,
            tp=TPRank(heads=heads, rank=rank, state=split),
            transfer_timeout_s=3.0,
            lease_s=30.0,
        ),
        backend=FakeBackend(BackendOptions(agent_name=f"st-{rank}-{next(_names)}")),
    )
    agent.register(cache.layout(heads.heads_of(rank)), keep=cache)
    return agent, cache


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    made: list[Agent] = []
    yield made
    for a in made:
        a.close()


def _group(
    role: Role,
    heads: HeadLayout,
    split: StateSplit,
    agents: list[Agent],
    direction: Direction = Direction.PULL,
) -> list[tuple[Agent, _Cache]]:
    for _ in range(20):
        base = ports.free_base_port(heads.tp_size) if role is Role.PRODUCER else 0
        ranks = [
            _rank(role, heads, split, r, base + r if base else 0, direction)
            for r in range(heads.tp_size)
        ]
        agents += [a for a, _ in ranks]
        try:
            if role is Role.PRODUCER:
                for a, _ in ranks:
                    a.serve()
            return ranks
        except KvxferError:
            continue
    raise RuntimeError("no free consecutive ports")


def _hold(producers: list[tuple[Agent, _Cache]], rid: str, ids: list[list[int]]) -> Ticket:
    cap, guard = wire.new_capability(), (random.randrange(0, 8), random.randrange(1, 2**56))
    tickets = [a.hold(rid, ids, 2 * BS, capability=cap, guard=guard) for a, _ in producers]
    return msgspec.structs.replace(tickets[0], incarnations=tuple(t.incarnation for t in tickets))


@pytest.mark.parametrize(
    ("kv_heads", "x_heads", "groups", "p_tp", "d_tp"),
    [
        (4, 8, 2, 1, 2),  # prefill TP1 -> decode TP2
        (4, 8, 2, 2, 1),  # and the reverse
        (4, 8, 1, 1, 4),  # a single group, replicated on every decode rank
        (4, 8, 1, 4, 1),  # ... read once, from the replica the rule names
        (4, 4, 2, 4, 2),
        # Fewer SSM heads than KV heads: the state comes from ranks 0 and 2 only, the
        # KV heads from all four.
        (4, 2, 1, 4, 1),
    ],
)
@pytest.mark.parametrize("direction", [Direction.PULL, Direction.PUSH], ids=["pull", "push"])
def test_state_slots_and_kv_heads_move_exactly_across_tp_sizes(
    agents: list[Agent],
    kv_heads: int,
    x_heads: int,
    groups: int,
    p_tp: int,
    d_tp: int,
    direction: Direction,
) -> None:
    split = _split(x_heads, groups)
    p_heads = HeadLayout(num_kv_heads=kv_heads, tp_size=p_tp)
    d_heads = p_heads.for_tp_size(d_tp)
    producers = _group(Role.PRODUCER, p_heads, split, agents, direction)
    consumers = _group(Role.CONSUMER, d_heads, split, agents, direction)
    remote, local = [[3, 6], [5]], [[1, 7], [2]]
    if direction is Direction.PULL:
        ticket = _hold(producers, "req-s", remote)
        transfers = [a.pull(ticket, local) for a, _ in consumers]
    else:
        # Decode's ranks register first, then each prefill rank writes what every
        # consumer rank takes from it: its KV heads and state units there.
        cap = wire.new_capability()
        host, port = producers[0][0].address
        ticket = Ticket.for_push(
            "prefill", host, port, "req-s", 2 * BS, capability=cap, tp_size=p_tp
        )
        transfers = [a.expect_push(ticket, local) for a, _ in consumers]
        for a, _ in producers:
            a.hold("req-s", remote, 2 * BS, capability=cap)
    for t in transfers:
        t.wait(5)
        assert t.state is TransferState.DONE, t.error
    for _, cache in consumers:
        for p, buf in cache.kv.items():
            for lb, rb in zip(local[0], remote[0], strict=True):
                i, t, w = np.indices(buf[lb].shape)
                want = _kv_word(p, i + cache.held.start, t, w, rb)
                assert (buf[lb] == want).all()
            assert not buf[[0, 2, 3, 4, 5, 6]].any()  # no other block written
        for part, slots in cache.state.items():
            assert (slots[2] == cache.want_state[part] + 2 * 5 + 1).all(), part
            assert not np.delete(slots, 2, axis=0).any()
    # Every producer rank hands the request back once each consumer rank it serves
    # read (pull) or was written (push).
    deadline = time.monotonic() + 5
    held = {i for i in range(len(producers))}
    while held and time.monotonic() < deadline:
        held -= {i for i in held if "req-s" in producers[i][0].freed()}
        time.sleep(0.01)
    assert not held, f"producer ranks {sorted(held)} still hold the request"


def test_state_units_on_a_rank_holding_none_of_the_kv_heads_are_refused_by_name(
    agents: list[Agent],
) -> None:
    # One KV head replicated on both prefill ranks: the decode rank reads it from one,
    # but its 4 SSM heads live on both.
    split = _split(4, 2)
    p_heads = HeadLayout(num_kv_heads=1, tp_size=2)
    producers = _group(Role.PRODUCER, p_heads, split, agents)
    ((consumer, cache),) = _group(Role.CONSUMER, p_heads.for_tp_size(1), split, agents)
    t = consumer.pull(_hold(producers, "req-r", [[3, 6], [5]]), [[1, 7], [2]])
    with pytest.raises(TransferError, match=r"tp_size=2: .*hold none of its KV heads"):
        t.wait(5)
    assert t.state is TransferState.FAILED
    assert not cache.state[KVPart.SSM].any()


def test_a_push_whose_state_and_kv_heads_come_from_different_ranks_fails_by_name(
    agents: list[Agent],
) -> None:
    """The push of the refused pairing above: the producer rank refuses to plan the
    write and the consumer rank's reception fails in time, nothing written."""
    split = _split(4, 2)
    p_heads = HeadLayout(num_kv_heads=1, tp_size=2)
    producers = _group(Role.PRODUCER, p_heads, split, agents, Direction.PUSH)
    ((consumer, cache),) = _group(
        Role.CONSUMER, p_heads.for_tp_size(1), split, agents, Direction.PUSH
    )
    cap = wire.new_capability()
    host, port = producers[0][0].address
    ticket = Ticket.for_push("prefill", host, port, "req-r", 2 * BS, capability=cap, tp_size=2)
    t = consumer.expect_push(ticket, [[1, 7], [2]])
    for a, _ in producers:
        a.hold("req-r", [[3, 6], [5]], 2 * BS, capability=cap)
    with pytest.raises(TransferError, match=r"hold none of its KV heads"):
        t.wait(10)
    assert t.state is TransferState.FAILED
    assert not cache.state[KVPart.SSM].any()


# -- the planner itself (no agents) ------------------------------------------------------
def _layouts(heads: HeadLayout, split: StateSplit) -> tuple[list[_Cache], dict[int, KVLayout]]:
    caches = [_Cache(heads, split, r, fill=False) for r in range(heads.tp_size)]
    return caches, {r: c.layout(heads.heads_of(r)) for r, c in enumerate(caches)}


def test_the_planner_refuses_by_its_whole_words() -> None:
    from kvxfer.core.descriptors import PlanOptions
    from kvxfer.core.state_tp_plan import HybridTPPlanner
    from kvxfer.errors import ConfigError

    split = _split(8, 2)
    p_heads = HeadLayout(num_kv_heads=4, tp_size=2)
    d_heads = p_heads.for_tp_size(1)
    _pc, producers = _layouts(p_heads, split)
    _dc, consumers = _layouts(d_heads, split)
    layout = consumers[0]
    with pytest.raises(ConfigError) as info:
        HybridTPPlanner.build(
            layout,
            producers,
            options=PlanOptions(),
            local_tp=TPRank(heads=d_heads, rank=0),
            remote_tp_size=2,
        )
    assert (info.value.key, info.value.value, info.value.rule) == (
        "tp.state",
        None,
        "a pull of state groups across TP sizes needs how TP splits the state slots (TPRank.state)",
    )
    with pytest.raises(ConfigError) as info:
        HybridTPPlanner.build(
            layout,
            {0: producers[0]},
            options=PlanOptions(),
            local_tp=TPRank(heads=d_heads, rank=0, state=split),
            remote_tp_size=2,
        )
    assert (info.value.key, info.value.value, info.value.rule) == (
        "remote layouts",
        [0],
        "need producer ranks [1]",
    )
    one = HeadLayout(num_kv_heads=1, tp_size=2)
    _c, two = _layouts(one, _split(4, 2))
    _c1, single = _layouts(one.for_tp_size(1), _split(4, 2))
    with pytest.raises(ConfigError) as info:
        HybridTPPlanner.build(
            single[0],
            two,
            options=PlanOptions(),
            local_tp=TPRank(heads=one.for_tp_size(1), rank=0, state=_split(4, 2)),
            remote_tp_size=2,
        )
    assert (info.value.key, info.value.value) == ("tp_size", 2)
    assert info.value.rule == (
        "consumer rank 0 of tp_size=1 reads state units from producer ranks [1], which "
        f"hold none of its KV heads ({one.describe()}): pulls whose state and KV heads "
        "come from different producer ranks are not served; pair TP sizes the model's "
        "KV heads split without replication"
    )


@pytest.mark.parametrize(
    ("kv_heads", "x_heads", "groups", "p_tp", "d_tp"),
    [(4, 8, 1, 4, 1), (4, 2, 1, 4, 1), (4, 8, 2, 1, 2), (4, 4, 2, 4, 2)],
)
def test_one_ranks_part_planned_alone_is_that_ranks_part_of_the_whole_plan(
    kv_heads: int, x_heads: int, groups: int, p_tp: int, d_tp: int
) -> None:
    """What a producer rank plans for a push (``only``) is exactly its part of the
    consumer rank's plan of the whole request, for every salt; the default salt is 0."""
    from kvxfer.core.descriptors import PlanOptions
    from kvxfer.core.state_tp_plan import HybridTPPlanner

    split = _split(x_heads, groups)
    p_heads = HeadLayout(num_kv_heads=kv_heads, tp_size=p_tp)
    d_heads = p_heads.for_tp_size(d_tp)
    _pc, producers = _layouts(p_heads, split)
    _dc, consumers = _layouts(d_heads, split)
    i64 = np.int64
    local = (np.array([1, 7], dtype=i64), np.array([2], dtype=i64))
    remote = (np.array([3, 6], dtype=i64), np.array([5], dtype=i64))
    for rank in range(d_tp):
        tp = TPRank(heads=d_heads, rank=rank, state=split)
        for salt in (0, 1, 2, 3):
            kw: dict[str, Any] = {"salt": salt} if salt else {}
            whole = HybridTPPlanner.build(
                consumers[rank],
                producers,
                options=PlanOptions(),
                local_tp=tp,
                remote_tp_size=p_tp,
                **kw,
            )
            parts = {rp.rank: rp for rp in whole.plan(local, remote, 2 * BS)}
            assert set(parts) == set(whole.ranks)
            for p in range(p_tp):
                alone = HybridTPPlanner.build(
                    consumers[rank],
                    {p: producers[p]},
                    options=PlanOptions(),
                    local_tp=tp,
                    remote_tp_size=p_tp,
                    only=p,
                    **kw,
                )
                got = alone.plan(local, remote, 2 * BS)
                assert alone.ranks == ((p,) if p in parts else ())
                if p not in parts:
                    assert got == ()
                    continue
                (mine,) = got
                want = parts[p]
                for field in ("local_addr", "remote_addr", "length"):
                    assert getattr(mine.runs, field).tolist() == getattr(want.runs, field).tolist()
                assert [b.tolist() for b in mine.local_blocks] == [
                    b.tolist() for b in want.local_blocks
                ]
                # Merged: no two runs continue each other on both sides.
                r = mine.runs
                order = np.argsort(r.local_addr)
                la, ra, ln = r.local_addr[order], r.remote_addr[order], r.length[order]
                assert not ((la[:-1] + ln[:-1] == la[1:]) & (ra[:-1] + ln[:-1] == ra[1:])).any()


@pytest.mark.parametrize(
    ("x_heads", "groups", "p_tp", "d_tp", "builds"),
    [
        # Nothing replicated on prefill: its one rank builds one planner per decode
        # rank (2) for all three requests.
        (8, 2, 1, 2, 2),
        # One group on every prefill rank: each of the 4 ranks plans each request.
        (8, 1, 4, 1, 4 * 3),
    ],
)
def test_a_push_builds_its_planner_once_per_decode_rank_unless_replicas_choose(
    agents: list[Agent],
    monkeypatch: pytest.MonkeyPatch,
    x_heads: int,
    groups: int,
    p_tp: int,
    d_tp: int,
    builds: int,
) -> None:
    """The salt (a request's CRC-32) picks among replicas only: where no head or unit
    is held twice on the prefill side, every request of a pair reuses one planner;
    where one is, each request plans with its own salt, so that every prefill rank
    makes the same choice of writer for it."""
    from kvxfer.core.state_tp_plan import HybridTPPlanner

    built: list[int] = []
    real = HybridTPPlanner.build.__func__  # type: ignore[attr-defined]

    def counting(cls: Any, *args: Any, **kw: Any) -> Any:
        built.append(kw.get("only", -1))
        return real(cls, *args, **kw)

    monkeypatch.setattr(HybridTPPlanner, "build", classmethod(counting))
    split = _split(x_heads, groups)
    p_heads = HeadLayout(num_kv_heads=4, tp_size=p_tp)
    producers = _group(Role.PRODUCER, p_heads, split, agents, Direction.PUSH)
    consumers = _group(Role.CONSUMER, p_heads.for_tp_size(d_tp), split, agents, Direction.PUSH)
    host, port = producers[0][0].address
    for i in range(3):
        rid, cap = f"req-{i}", wire.new_capability()
        ticket = Ticket.for_push("prefill", host, port, rid, 2 * BS, capability=cap, tp_size=p_tp)
        transfers = [a.expect_push(ticket, [[1, 7], [2]]) for a, _ in consumers]
        for a, _ in producers:
            a.hold(rid, [[3, 6], [5]], 2 * BS, capability=cap)
        for t in transfers:
            t.wait(5)
            assert t.state is TransferState.DONE, t.error
        for _, cache in consumers:
            for part, slots in cache.state.items():
                assert (slots[2] == cache.want_state[part] + 2 * 5 + 1).all(), part
    assert len(built) == builds, built
