"""In-process Agents of TP groups on the fake backend, for the tests across TP sizes
(``test_agent_tp.py`` pulls, ``test_agent_tp_push.py`` pushes): each rank holds a
:class:`~kvxfer.testing.tp_kvcache.TPHostCache` of its heads, registered with rank-local
head indices (the agent places them, ``heads.place_heads``)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from kvxfer.agent import Agent, AgentConfig
from kvxfer.backend import BackendOptions
from kvxfer.backends.host_bounce import CopyOp, HostBounceBackend
from kvxfer.core.compat import Fingerprint
from kvxfer.core.heads import HeadLayout, TPRank
from kvxfer.core.layout import KVLayout
from kvxfer.core.tp_plan import TPPlanner
from kvxfer.errors import KvxferError
from kvxfer.testing.fake_backend import FakeBackend
from kvxfer.testing.tp_kvcache import TPHostCache
from kvxfer.types import Direction, Role
from tests import ports

NUM_BLOCKS = 12
_names = itertools.count()


def free_base_port(span: int = 1, hosts: Sequence[str] = ("127.0.0.1",)) -> int:
    """A base port whose ``span`` ports all bind on every host in ``hosts`` right now,
    below the ephemeral range, in this pytest process's part of it (:mod:`tests.ports`):
    only another listener can take one first."""
    return ports.free_base_port(span, hosts)


class Rank:
    """One rank: its Agent, its fake backend (faults), its cache."""

    def __init__(self, agent: Agent, backend: FakeBackend, cache: TPHostCache) -> None:
        self.agent, self.backend, self.cache = agent, backend, cache

    @property
    def rank(self) -> int:
        tp = self.agent.config.tp
        assert tp is not None
        return tp.rank


def make_rank(
    engine_id: str,
    role: Role,
    heads: HeadLayout,
    rank: int,
    port: int,
    *,
    seed: int | None,
    direction: Direction,
    timeout_s: float,
    stream: bool = False,
    per_head: bool = True,
    bounce: bool = False,
    copy_op: Callable[[KVLayout], CopyOp] | None = None,
    host: str = "127.0.0.1",
) -> Rank:
    """A registered rank (its cache filled from ``seed``, or empty with None), described
    one region per head or (``per_head=False``) per layer and K/V; with ``bounce`` its
    blocks go through host staging buffers (the vLLM CPU build's backend) over the
    fake transport (``Rank.backend``, for faults), copied by ``copy_op(layout)`` when
    given (the engine's block copy, as vLLM passes one). It serves at ``host``."""
    cache = TPHostCache(heads, rank, num_blocks=NUM_BLOCKS, fill_seed=seed)
    layout = cache.layout(global_heads=False, per_head=per_head)
    options = BackendOptions(agent_name=f"{engine_id}-{rank}-{next(_names)}")
    backend = FakeBackend(options)
    bouncer = None
    if bounce or copy_op is not None:
        op = None if copy_op is None else copy_op(layout)
        bouncer = HostBounceBackend(options, transport=backend, copy_op=op)
    fingerprint = Fingerprint(
        model="m",
        dtype="bfloat16",
        kv_cache_dtype="bfloat16",
        attention_backend="t",
        direction=direction,
    )
    agent = Agent(
        AgentConfig(
            engine_id=engine_id,
            fingerprint=fingerprint,
            role=role,
            direction=direction,
            side_channel_host=host,
            side_channel_port=port,
            tp=TPRank(heads=heads, rank=rank),
            transfer_timeout_s=timeout_s,
            lease_s=30.0,
            push_stream=stream,
        ),
        backend=bouncer or backend,
    )
    agent.register(layout, keep=cache)
    return Rank(agent, backend, cache)


def producers(
    heads: HeadLayout,
    *,
    seed: int | None,
    direction: Direction,
    timeout_s: float,
    stream: bool = False,
    per_head: bool = True,
    bounce: bool = False,
    engine_id: str = "prefill",
    role: Role = Role.PRODUCER,
) -> list[Rank]:
    """Producer ranks serving at base + rank (retrying another base if one is taken);
    with ``role`` and ``engine_id``, any group of ranks serving so (a decode group's
    ranks: ``seed=None`` leaves their caches empty)."""
    for _ in range(20):
        base = free_base_port(heads.tp_size)
        ranks = [
            make_rank(
                engine_id,
                role,
                heads,
                r,
                base + r,
                seed=seed,
                direction=direction,
                timeout_s=timeout_s,
                stream=stream,
                per_head=per_head,
                bounce=bounce,
            )
            for r in range(heads.tp_size)
        ]
        try:
            for r in ranks:
                r.agent.serve()
            return ranks
        except KvxferError:
            for r in ranks:
                r.agent.close()
    raise RuntimeError("no free consecutive ports")


def consumers(
    heads: HeadLayout,
    *,
    direction: Direction,
    timeout_s: float,
    per_head: bool = True,
    bounce: bool = False,
    copy_op: Callable[[KVLayout], CopyOp] | None = None,
) -> list[Rank]:
    """Consumer ranks with empty caches (not serving until they need to)."""
    return [
        make_rank(
            "decode",
            Role.CONSUMER,
            heads,
            r,
            0,
            seed=None,
            direction=direction,
            timeout_s=timeout_s,
            per_head=per_head,
            bounce=bounce,
            copy_op=copy_op,
        )
        for r in range(heads.tp_size)
    ]


def count_planner_builds(monkeypatch: pytest.MonkeyPatch, delay_s: float = 0.0) -> list[int]:
    """Record the ``salt`` of every ``TPPlanner.build`` from now on (the list grows);
    ``delay_s``: each build takes that much longer (a window for a race to start in)."""
    builds: list[int] = []
    build = TPPlanner.build.__func__  # type: ignore[attr-defined]

    def counted(cls: type[TPPlanner], *args: Any, **kw: Any) -> TPPlanner:
        time.sleep(delay_s)
        builds.append(kw["salt"])
        return build(cls, *args, **kw)  # type: ignore[no-any-return]

    monkeypatch.setattr(TPPlanner, "build", classmethod(counted))
    return builds


@pytest.fixture
def closing() -> Iterator[list[Rank]]:
    """Ranks to close after the test."""
    ranks: list[Rank] = []
    yield ranks
    for r in ranks:
        r.agent.close()
