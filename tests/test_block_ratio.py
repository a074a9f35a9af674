"""Pulls between different block sizes (issue 54, kvxfer.core.ratio): every token of the
request lands in the consumer's block at its position, from the producer's block at the
same position, and nothing past the last unit is written; what a ratio cannot serve is
refused with both sizes named."""

from __future__ import annotations

import itertools
import time

import msgspec
import numpy as np
import pytest

from kvxfer.agent import Agent, AgentConfig
from kvxfer.backend import Backend, BackendOptions, Capabilities, PeerHandle, XferOp
from kvxfer.backends.host_bounce import HostBounceBackend, torch_copy_op
from kvxfer.core.compat import Fingerprint, check_pair
from kvxfer.core.descriptors import Runs
from kvxfer.core.layout import Group, GroupKind, KVLayout, Region
from kvxfer.core.ratio import check_ratio, pair_units
from kvxfer.errors import LayoutMismatch, PlanError
from kvxfer.testing.fake_backend import FakeBackend
from kvxfer.testing.kvcache import HostKVCache, ModelShape
from kvxfer.transfer import Transfer, TransferState
from kvxfer.types import Direction, Role

SHAPE = ModelShape(name="sm", layers=2, kv_heads=2, head_dim=8)
FP = Fingerprint(
    model="m",
    dtype="bfloat16",
    kv_cache_dtype="bfloat16",
    attention_backend="t",
    direction=Direction.PULL,
)
_names = itertools.count()
PRODUCER_BLOCKS, CONSUMER_BLOCKS = 40, 64


def _agent(
    role: Role, bs: int, nb: int, seed: int | None, kind: str = "fake"
) -> tuple[Agent, HostKVCache]:
    options = BackendOptions(agent_name=f"ratio-{next(_names)}")
    backend: Backend = FakeBackend(options)
    if kind == "host_bounce":
        # Staging buffers moved by the fake fabric, copied to and from the cache.
        backend = HostBounceBackend(options, transport=backend)
    agent = Agent(
        AgentConfig(engine_id=f"e-{role.value}-{next(_names)}", fingerprint=FP, role=role),
        backend=backend,
    )
    cache = HostKVCache(SHAPE, bs, nb, fill_seed=seed)
    agent.register(cache.layout())
    agent.serve()
    return agent, cache


@pytest.mark.parametrize("kind", ["fake", "host_bounce"])
@pytest.mark.parametrize(("pbs", "cbs"), [(128, 16), (128, 64), (16, 128), (32, 64)])
@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 128, 129, 300])
def test_a_pull_between_block_sizes_moves_every_token_to_its_position(
    pbs: int, cbs: int, num_tokens: int, kind: str
) -> None:
    producer, pc = _agent(Role.PRODUCER, pbs, PRODUCER_BLOCKS, 1, kind)
    consumer, cc = _agent(Role.CONSUMER, cbs, CONSUMER_BLOCKS, None, kind)
    try:
        pn, cn = -(-num_tokens // pbs), -(-num_tokens // cbs)
        pb = list(range(3, 3 + pn))[::-1]  # scattered, descending
        cb = list(range(5, 5 + cn))
        ticket = producer.hold("q", pb, num_tokens)
        assert ticket.block_size == pbs
        pull = consumer.pull(ticket, cb)
        deadline = time.monotonic() + 20
        while not pull.done and time.monotonic() < deadline:
            time.sleep(0.005)
        assert pull.state.name == "DONE", (pull.state, pull.error)
        words = SHAPE.token_bytes() // 2
        unit = min(pbs, cbs)
        end = -(-num_tokens // unit) * unit  # tokens of the units moved
        for r in range(len(pc.regions)):
            pv = pc.regions[r].reshape(PRODUCER_BLOCKS, pbs, words)
            cv = cc.regions[r].reshape(CONSUMER_BLOCKS, cbs, words)
            tokens = np.arange(num_tokens)
            got = cv[np.array(cb)[tokens // cbs], tokens % cbs]
            want = pv[np.array(pb)[tokens // pbs], tokens % pbs]
            assert (got == want).all(), f"region {r}"
            assert not cv[cb[-1], end - (cn - 1) * cbs :].any(), "written past the last unit"
            untouched = np.setdiff1d(np.arange(CONSUMER_BLOCKS), cb)
            assert not cv[untouched].any(), "a block outside the request was written"
    finally:
        consumer.close()
        producer.close()


def test_a_prefix_hit_pulls_only_the_units_after_it() -> None:
    # Decode (16) holds the first 3 blocks: tokens 48.. come from the producer's
    # first 128-block's pieces 3.. and its second block.
    units = pair_units(
        (np.array([9, 4, 7, 2, 8, 11, 12, 13, 14, 15, 16], dtype=np.int64),),
        (np.array([5, 6], dtype=np.int64),),
        num_tokens=224,
        remote_num_tokens=224,
        local_block_size=16,
        remote_block_size=128,
    ).units[0]
    assert units.local_block.tolist() == [9, 4, 7, 2, 8, 11, 12, 13, 14, 15, 16]
    assert units.remote_block.tolist() == [5] * 5 + [6] * 6
    assert units.remote_piece.tolist() == [3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5]
    with pytest.raises(PlanError, match=r"holds tokens 128\.\.224 in blocks of 128"):
        pair_units(
            (np.arange(14, dtype=np.int64),),
            (np.array([6], dtype=np.int64),),  # a ticket cut to its last block
            num_tokens=224,
            remote_num_tokens=224,
            local_block_size=16,
            remote_block_size=128,
        )


def _layout(bs: int, *, groups: tuple[Group, ...] | None = None) -> KVLayout:
    return KVLayout(
        block_size=bs,
        regions=(Region(base=1 << 20, num_blocks=8, stride=bs * 64, block_len=bs * 64),),
        groups=groups or (Group(kind=GroupKind.FULL),),
    )


def test_what_a_ratio_cannot_serve_is_refused_naming_both_sizes() -> None:
    with pytest.raises(LayoutMismatch, match=r"whole multiple.*local=48 remote=32"):
        check_pair(_layout(48), _layout(32))
    # A push pair's handshake takes whole multiples as a pull's does (the writes:
    # tests/test_push_block_ratio.py); the rest is refused the same way.
    check_pair(_layout(128), _layout(16))
    check_pair(_layout(16), _layout(64))
    state = (Group(kind=GroupKind.STATE),)
    with pytest.raises(LayoutMismatch, match=r"recurrent-state group"):
        check_ratio(_layout(128, groups=state), _layout(16, groups=state))
    with pytest.raises(LayoutMismatch, match=r"equal TP sizes only, not TP 1 with TP 2"):
        check_ratio(_layout(128), _layout(16), local_tp_size=1, remote_tp_size=2)
    hnd = KVLayout(block_size=16, regions=_layout(16).regions, kv_layout="HND", num_kv_heads=0)
    with pytest.raises(LayoutMismatch, match=r"head count per region is not known"):
        check_ratio(_layout(128), hnd)
    # Whole multiples in either direction pass, compared at the smaller size.
    assert check_ratio(_layout(128), _layout(16)) == 16
    assert check_ratio(_layout(16), _layout(64)) == 16


class _NoRuns(FakeBackend):
    """A fabric whose backend says it posts no address runs."""

    @property
    def capabilities(self) -> Capabilities:
        return msgspec.structs.replace(super().capabilities, address_runs=False)


def _pull_state(producer: Agent, consumer: Agent, pb: list[int], cb: list[int], n: int) -> Transfer:
    pull = consumer.pull(producer.hold("q", pb, n), cb)
    deadline = time.monotonic() + 20
    while not pull.done and time.monotonic() < deadline:
        time.sleep(0.005)
    return pull


def test_a_backend_that_posts_no_address_runs_fails_the_pull_by_name() -> None:
    producer, _ = _agent(Role.PRODUCER, 128, PRODUCER_BLOCKS, 1)
    options = BackendOptions(agent_name=f"ratio-{next(_names)}")
    consumer = Agent(
        AgentConfig(engine_id=f"e-noruns-{next(_names)}", fingerprint=FP, role=Role.CONSUMER),
        backend=_NoRuns(options),
    )
    try:
        consumer.register(HostKVCache(SHAPE, 16, CONSUMER_BLOCKS).layout())
        consumer.serve()
        pull = _pull_state(producer, consumer, [3, 4], list(range(5, 18)), 200)
        assert pull.state is TransferState.FAILED
        assert "blocks of 16 tokens here and 128 at the peer need a backend that posts" in str(
            pull.error
        )
    finally:
        consumer.close()
        producer.close()


def test_host_bounce_through_the_engines_copy_op_moves_a_ratio_exactly() -> None:
    torch = pytest.importorskip("torch")  # installed by `make env`; the op is torch's
    caches, agents = [], []
    for role, bs, nb, seed in ((Role.PRODUCER, 16, 40, 3), (Role.CONSUMER, 64, 16, None)):
        cache = HostKVCache(SHAPE, bs, nb, fill_seed=seed)
        options = BackendOptions(agent_name=f"ratio-{next(_names)}")
        op = torch_copy_op([torch.from_numpy(r.reshape(nb, -1)) for r in cache.regions])
        agent = Agent(
            AgentConfig(engine_id=f"e-op-{next(_names)}", fingerprint=FP, role=role),
            backend=HostBounceBackend(options, transport=FakeBackend(options), copy_op=op),
        )
        agent.register(cache.layout())
        agent.serve()
        caches.append(cache)
        agents.append(agent)
    try:
        pb, cb = list(range(20, 7, -1)), [9, 2, 5, 11]  # 200 tokens: 13 blocks / 4
        pull = _pull_state(agents[0], agents[1], pb, cb, 200)
        assert pull.state is TransferState.DONE, pull.error
        words = SHAPE.token_bytes() // 2
        tokens = np.arange(200)
        for r in range(len(caches[0].regions)):
            pv = caches[0].regions[r].reshape(40, 16, words)
            cv = caches[1].regions[r].reshape(16, 64, words)
            got = cv[np.array(cb)[tokens // 64], tokens % 64]
            assert (got == pv[np.array(pb)[tokens // 16], tokens % 16]).all(), f"region {r}"
    finally:
        for a in agents[::-1]:
            a.close()


def test_host_bounce_refuses_address_runs_outside_its_staging() -> None:
    options = BackendOptions(agent_name=f"ratio-{next(_names)}")
    be = HostBounceBackend(options, transport=FakeBackend(options))
    try:
        exposed = be.register(HostKVCache(SHAPE, 16, 4).layout())
        top = exposed.regions[-1].base + 4 * exposed.regions[-1].block_len
        runs = Runs(
            local_addr=np.array([exposed.regions[0].base, top - 8], dtype=np.uint64),
            remote_addr=np.array([0, 64], dtype=np.uint64),
            length=np.array([64, 16], dtype=np.uint64),
            local_device=np.zeros(2, dtype=np.int64),
            remote_device=np.zeros(2, dtype=np.int64),
        )
        with pytest.raises(PlanError, match=r"address run 1 \(0x[0-9a-f]+, 16 bytes\) is not"):
            be.post_runs(XferOp.READ, PeerHandle(1), runs)
    finally:
        be.close()
