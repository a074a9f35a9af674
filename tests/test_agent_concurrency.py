"""A long post never stalls the engine's other calls.

With UCX over CMA (and the host bounce's staging copies) a backend's ``post`` moves the
bytes before it returns: tens to hundreds of milliseconds for a long prompt. The engine
keeps calling ``hold()``, ``freed()``, ``stats()`` and ``progress()`` from its step
loop meanwhile; none of them may wait for that post. Here a backend's post blocks
until the test opens a gate (a fake backend's, and a real UCX backend's inside its own
lock, as its copy holds it), and the engine's calls must answer while it is shut.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt
import pytest

from kvxfer._agent import progress as _progress
from kvxfer._agent.progress import RECEPTION_TICK_S, WAITED_TICK_S
from kvxfer.agent import Agent, AgentConfig, PushPost, Ticket
from kvxfer.agent_config import (
    DEFAULT_PROGRESS_INTERVAL_S,
    MAX_PROGRESS_INTERVAL_S,
    MAX_WARM_UP_DESCRIPTORS,
)
from kvxfer.backend import BackendOptions, PeerHandle, XferHandle, XferOp, XferStatus
from kvxfer.core.compat import Fingerprint
from kvxfer.errors import ConfigError, TransferTimeout
from kvxfer.testing.fake_backend import FakeBackend, Faults
from kvxfer.testing.kvcache import HostKVCache, ModelShape
from kvxfer.transfer import Transfer, TransferState
from kvxfer.types import Direction, Role
from tests.agent_proc import AgentProc, ProcSpec
from tests.faultkit import (
    BLOCK,
    PRODUCER_SEED,
    Engine,
    Side,
    landed_intact,
    push_registered,
    replace,
    settle,
    stub,
    until,
)

SHAPE = ModelShape(name="sm", layers=2, kv_heads=1, head_dim=8)
SEED = 21
_names = itertools.count()
# Each engine call must answer well within this while a post is blocked (they take
# microseconds; the margin is for a loaded CI machine).
PROMPT_S = 0.5


class GatedBackend(FakeBackend):
    """A fake backend whose post waits for ``gate`` first, like a post that copies."""

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options)
        self.gate = threading.Event()
        self.gate.set()
        self.posting = threading.Event()
        self.posters: list[str] = []  # the thread of each post, in order

    def post(
        self,
        op: XferOp,
        peer: PeerHandle,
        local_ids: npt.NDArray[np.int64],
        remote_ids: npt.NDArray[np.int64],
        notification: bytes = b"",
    ) -> XferHandle:
        self.posters.append(threading.current_thread().name)
        self.posting.set()
        if not self.gate.wait(30):
            raise AssertionError("the test never opened the gate")
        return super().post(op, peer, local_ids, remote_ids, notification)


def _fp(direction: Direction) -> Fingerprint:
    return Fingerprint(
        model="m",
        dtype="bfloat16",
        kv_cache_dtype="bfloat16",
        attention_backend="t",
        direction=direction,
    )


def _agent(
    role: Role,
    direction: Direction,
    cache: HostKVCache,
    push_post: PushPost = PushPost.AUTO,
    stages: bool = False,
    **config: Any,
) -> tuple[Agent, GatedBackend]:
    name = f"{role.value}-{next(_names)}"
    backend = GatedBackend(BackendOptions(agent_name=name))
    if stages:  # poses as a staging backend (host bounce): only its capabilities change
        backend._caps = msgspec.structs.replace(backend._caps, stages_through_host=True)
    agent = Agent(
        AgentConfig(
            engine_id=name,
            fingerprint=_fp(direction),
            role=role,
            direction=direction,
            push_post=push_post,
            **config,
        ),
        backend=backend,
    )
    agent.register(cache.layout())
    agent.serve()
    return agent, backend


class _PushAgents(NamedTuple):
    prod: Agent
    prod_be: GatedBackend
    prod_cache: HostKVCache  # kept: the agent registered this memory
    cons: Agent
    cons_be: GatedBackend
    cons_cache: HostKVCache


def _push_agents(
    num_blocks: int,
    push_post: PushPost = PushPost.AUTO,
    stages: bool = False,
    **consumer_config: Any,
) -> _PushAgents:
    """A push producer (its cache filled with the SEED pattern) and consumer."""
    prod_cache = HostKVCache(SHAPE, 16, num_blocks, fill_seed=SEED)
    cons_cache = HostKVCache(SHAPE, 16, num_blocks)
    prod, prod_be = _agent(Role.PRODUCER, Direction.PUSH, prod_cache, push_post, stages)
    cons, cons_be = _agent(Role.CONSUMER, Direction.PUSH, cons_cache, **consumer_config)
    return _PushAgents(prod, prod_be, prod_cache, cons, cons_be, cons_cache)


@pytest.fixture(params=[Direction.PULL, Direction.PUSH], ids=["pull", "push"])
def pair(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[Direction, Agent, GatedBackend, Agent, GatedBackend, HostKVCache]]:
    direction: Direction = request.param
    prod_cache = HostKVCache(SHAPE, 16, 16, fill_seed=SEED)
    cons_cache = HostKVCache(SHAPE, 16, 16)
    prod, prod_be = _agent(Role.PRODUCER, direction, prod_cache)
    cons, cons_be = _agent(Role.CONSUMER, direction, cons_cache)
    yield direction, prod, prod_be, cons, cons_be, cons_cache
    for be in (prod_be, cons_be):
        be.gate.set()
    cons.close()
    prod.close()


def _prompt(call: Callable[[], object]) -> None:
    t0 = time.monotonic()
    call()
    assert time.monotonic() - t0 < PROMPT_S, f"{call} waited for the blocked post"


def _stub(prod: Agent, request_id: str) -> Ticket:
    """What a push consumer knows before the prefill ran: where to register."""
    host, port = prod.address
    return Ticket(
        engine_id=prod.config.engine_id,
        host=host,
        port=port,
        request_id=request_id,
        block_ids=((),),
        num_tokens=0,
    )


def _start(
    direction: Direction, prod: Agent, cons: Agent, rid: str, src: list[int], dst: list[int]
) -> Transfer:
    tokens = 16 * len(src)
    if direction is Direction.PULL:
        return cons.pull(prod.hold(rid, src, tokens), dst)
    transfer = cons.expect_push(_stub(prod, rid), dst, num_tokens=tokens)
    deadline = time.monotonic() + 10
    while rid not in prod.holding():  # the registration arrives from a worker thread
        assert time.monotonic() < deadline, "the consumer never registered"
        time.sleep(0.001)
    prod.hold(rid, src, tokens)  # posts the write (or hands it to the writer thread)
    return transfer


def test_engine_calls_answer_while_a_post_is_blocked(
    pair: tuple[Direction, Agent, GatedBackend, Agent, GatedBackend, HostKVCache],
) -> None:
    direction, prod, prod_be, cons, cons_be, cons_cache = pair
    # a first transfer, ungated, so the handshake is behind us
    _start(direction, prod, cons, "warm", [0], [0]).wait(10)

    # The next post blocks: the initiator's (the consumer's for a pull, issued from an
    # engine thread of its own here; the producer's writer thread for a push).
    gated, engine = (cons_be, cons) if direction is Direction.PULL else (prod_be, prod)
    gated.gate.clear()
    gated.posting.clear()
    src, dst = [7, 8, 9], [3, 4, 5]
    started: list[Transfer] = []
    poster = threading.Thread(
        target=lambda: started.append(_start(direction, prod, cons, "big", src, dst)),
        daemon=True,
    )
    poster.start()
    assert gated.posting.wait(10), "the post never started"

    for call in (engine.freed, engine.stats, engine.progress, engine.holding):
        _prompt(call)
    _prompt(lambda: prod.hold("other", [11], 16))  # another request's hold
    if direction is Direction.PUSH:
        assert "big" in prod.holding()  # still held: its write has not landed

    gated.gate.set()
    poster.join(10)
    (transfer,) = started
    transfer.wait(10)
    assert transfer.state is TransferState.DONE
    assert cons_cache.mismatches(dst, src, SEED) == 0


class RacingBackend(FakeBackend):
    """A fake backend whose next status() call first lets another thread settle the
    transfer (a waiter and the progress thread both polling), then answers for the
    handle that thread released meanwhile: FAILED, as NIXL backends answer."""

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options)
        self.race: Callable[[], None] | None = None

    def status(self, handle: XferHandle) -> XferStatus:
        race, self.race = self.race, None
        if race is not None:
            other = threading.Thread(target=race, daemon=True)
            other.start()
            other.join(2)
        return super().status(handle)


def test_a_completion_seen_by_two_threads_is_no_failure() -> None:
    """The loser of the race must not read the released handle's FAILED as a transport
    error: that marked the peer suspect and made the next transfer handshake again."""
    fp = _fp(Direction.PULL)
    prod_cache = HostKVCache(SHAPE, 16, 16, fill_seed=SEED)
    cons_cache = HostKVCache(SHAPE, 16, 16)
    prod, _ = _agent(Role.PRODUCER, Direction.PULL, prod_cache)
    backend = RacingBackend(BackendOptions(agent_name=f"race-{next(_names)}"))
    cons = Agent(
        AgentConfig(engine_id="d-race", fingerprint=fp, role=Role.CONSUMER), backend=backend
    )
    cons.register(cons_cache.layout())
    try:
        cons.pull(prod.hold("warm", [0], 16), [0]).wait(10)
        handshakes = cons.stats().handshakes
        # not done at the post's own status check: settled by a later poll, in the race
        backend.faults = Faults(complete_after_polls=1)
        for i in range(3):
            rid = f"race-{i}"
            transfer = cons.pull(prod.hold(rid, [5 + i], 16), [9 + i])
            backend.race = cons.progress  # another thread settles it inside our poll
            transfer.wait(10)
            assert transfer.state is TransferState.DONE
        stats = cons.stats()
        assert stats.failures == {} and stats.transfers_failed == 0
        assert stats.handshakes == handshakes, "a settled transfer marked its peer suspect"
        assert cons_cache.mismatches([9, 10, 11], [5, 6, 7], SEED) == 0
    finally:
        cons.close()
        prod.close()


class _GatedEndpoint:
    """Wraps a real backend's NIXL endpoint: ``post`` waits for ``gate`` first, inside
    the backend's lock, as a UCX-over-CMA post does while it copies every byte."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.posting = threading.Event()
        self.posters: list[str] = []  # the thread of each post, in order

    def post(self, *args: Any) -> Any:
        self.posting.set()
        if not self.gate.wait(30):
            raise AssertionError("the test never opened the gate")
        return self._inner.post(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_real_ucx_write_in_flight_does_not_stall_the_producer() -> None:
    """The real UCX backend: while the push writer's post holds the backend (copying),
    the engine's freed() and progress() still answer; they used to wait for the whole
    copy because polling a notification took the backend's lock. (Writes posted by the
    writer thread: with PushPost.ENGINE the engine's own hold() would be the post.)"""
    shape = ModelShape(name="test", layers=2, kv_heads=2, head_dim=32)
    cache = HostKVCache(shape, 16, 64, fill_seed=SEED)
    prod = Agent(
        AgentConfig(
            engine_id="ucx-gated-p",
            fingerprint=Fingerprint(
                model="test/model",
                dtype="bfloat16",
                kv_cache_dtype="bfloat16",
                attention_backend="test",
                direction=Direction.PUSH,
            ),
            role=Role.PRODUCER,
            direction=Direction.PUSH,
            backend="ucx",
            push_post=PushPost.WRITER,
        )
    )
    cons = AgentProc(ProcSpec(engine_id="ucx-gated-d", role="kv_consumer", direction="push"))
    gated = _GatedEndpoint(prod.backend._agent)  # type: ignore[attr-defined]
    prod.backend._agent = gated  # type: ignore[attr-defined]
    try:
        prod.register(cache.layout())
        prod.serve()

        def push(rid: str, src: list[int], dst: list[int]) -> None:
            stub = msgspec.to_builtins(_stub(prod, rid))
            cons.call("expect_push", stub, dst, 16 * len(src))
            deadline = time.monotonic() + 10
            while rid not in prod.holding():
                assert time.monotonic() < deadline, "the consumer never registered"
                time.sleep(0.001)
            prod.hold(rid, src, 16 * len(src))

        push("warm", [0], [0])  # the handshake, ungated
        assert cons.call("wait", "warm", 10)["ok"]

        gated.gate.clear()
        gated.posting.clear()
        src, dst = [7, 8, 9], [3, 4, 5]
        push("big", src, dst)
        assert gated.posting.wait(10), "the write never started"
        for call in (prod.freed, prod.progress, prod.stats, prod.holding):
            _prompt(call)
        assert "big" in prod.holding()  # its write has not landed

        gated.gate.set()
        assert cons.call("wait", "big", 10)["ok"]
        assert cons.call("check", dst, src, SEED) == 0
        deadline = time.monotonic() + 10
        freed: list[str] = []
        while "big" not in freed:
            assert time.monotonic() < deadline, "the producer never freed the pushed blocks"
            freed += prod.freed()
            time.sleep(0.005)
    finally:
        gated.gate.set()
        assert cons.close() == 0
        prod.close()


def _progress_thread_ticks(agent: Agent) -> list[float]:
    """Record when the agent's progress thread runs a round (other threads' rounds,
    a waiter's or the engine's, are not recorded)."""
    ticks: list[float] = []
    runtime = agent._runtime
    real_tick = runtime.tick

    def counted() -> None:
        if threading.current_thread().name == "kvxfer-progress":
            ticks.append(time.monotonic())
        real_tick()

    runtime.tick = counted  # type: ignore[method-assign]
    return ticks


def test_no_fast_polling_while_the_only_transfer_is_inside_its_post(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A transfer inside its post has nothing to poll yet, and a push producer's leases
    wait only for its own writes: the progress thread keeps its idle pace meanwhile
    instead of ticking every progress interval (with UCX over CMA, that CPU came out of
    the copy the post was doing)."""
    monkeypatch.setattr(_progress, "WIREUP_S", 0.0)  # the handshake's fast pace: below
    agents = _push_agents(16)
    prod, prod_be, cons, cons_cache = agents.prod, agents.prod_be, agents.cons, agents.cons_cache
    ticks = _progress_thread_ticks(prod)
    try:
        _start(Direction.PUSH, prod, cons, "warm", [0], [0]).wait(10)
        prod_be.gate.clear()
        prod_be.posting.clear()
        started: list[Transfer] = []
        # The engine's hold() posts the write itself (PushPost.AUTO on a direct backend),
        # so it is the call that blocks in the post here: issue it from its own thread.
        poster = threading.Thread(
            target=lambda: started.append(
                _start(Direction.PUSH, prod, cons, "big", [7, 8], [3, 4])
            ),
            daemon=True,
        )
        poster.start()
        assert prod_be.posting.wait(10), "the write never started"
        time.sleep(0.05)  # the progress thread sees the write inside its post
        ticks.clear()
        window = 0.3
        time.sleep(window)
        # idle pace: one round per 50 ms. The lease pace (LEASE_TICK_S, 1 ms, which a
        # pull producer's leases need) would be ~300 rounds, and the 0.2 ms progress
        # interval up to five times as many.
        assert len(ticks) < 3 * window / 0.05, f"{len(ticks)} ticks in {window}s"
        prod_be.gate.set()
        poster.join(10)
        started[0].wait(10)
        assert cons_cache.mismatches([3, 4], [7, 8], SEED) == 0
    finally:
        prod_be.gate.set()
        cons.close()
        prod.close()


@pytest.mark.parametrize("side", ["producer", "consumer"])
def test_a_handshake_speeds_both_sides_progress_up_for_a_while(
    monkeypatch: pytest.MonkeyPatch, side: str
) -> None:
    """After a handshake both sides' progress threads tick at the lease pace for
    WIREUP_S, though nothing is in flight: UCX wires the new endpoint up only as both
    workers progress, and at the 50 ms idle nap that took 130-210 ms, which the first
    transfer paid (issue 27). Then they go back to the idle nap."""
    monkeypatch.setattr(_progress, "WIREUP_S", 0.6)
    prod_cache = HostKVCache(SHAPE, 16, 16, fill_seed=SEED)
    prod, _ = _agent(Role.PRODUCER, Direction.PULL, prod_cache)
    cons, _ = _agent(Role.CONSUMER, Direction.PULL, HostKVCache(SHAPE, 16, 16))
    try:
        watched = prod if side == "producer" else cons
        time.sleep(0.1)  # both threads settle into their idle nap
        ticks = _progress_thread_ticks(watched)
        cons.connect(*prod.address, prod.config.engine_id)
        time.sleep(0.3)
        fast = len(ticks)
        # The idle nap would be at most ~7 rounds in 0.3 s; the lease pace (1 ms) is
        # ~300, and a loaded host still gives its thread far more than 30.
        assert fast > 30, f"{fast} rounds in the 0.3 s after a handshake"
        time.sleep(0.6)  # past WIREUP_S
        ticks.clear()
        time.sleep(0.3)
        assert len(ticks) < 3 * 0.3 / 0.05, f"{len(ticks)} rounds once wired up"
    finally:
        cons.close()
        prod.close()


@pytest.mark.parametrize("direction", [Direction.PULL, Direction.PUSH], ids=["pull", "push"])
def test_connect_uses_the_connection_once_when_this_side_posts(direction: Direction) -> None:
    """``Agent.connect`` from the side that posts (a pull's consumer reads, a push's
    producer writes) uses the new connection once before any request: a transfer of the
    operation its requests post (a puller reads the peer's guard word, a push producer
    writes the peer's sink word; the agent's first as ``warm_up_descriptors``
    descriptors) and one WARM notice, which the peer ignores. Once per peer; a transfer
    after it is DONE, and the sink write landed."""
    prod_cache = HostKVCache(SHAPE, 16, 16, fill_seed=SEED)
    cons_cache = HostKVCache(SHAPE, 16, 16)
    prod, prod_be = _agent(Role.PRODUCER, direction, prod_cache)
    cons, cons_be = _agent(Role.CONSUMER, direction, cons_cache)
    pull = direction is Direction.PULL
    poster, passive = (cons, prod) if pull else (prod, cons)
    poster_be, passive_be = (cons_be, prod_be) if pull else (prod_be, cons_be)
    used: list[tuple[str, object]] = []
    for be in (poster_be, passive_be):
        real_read, real_write, real_notify = be.post_guard_read, be.post_sink_write, be.notify

        def read(
            peer: Any, slot: int, notification: bytes = b"", *, copies: int = 1, _r: Any = real_read
        ) -> Any:
            used.append(("read", slot, copies))
            return _r(peer, slot, notification, copies=copies)

        def write(peer: Any, *, copies: int = 1, _w: Any = real_write) -> Any:
            used.append(("write", copies))
            return _w(peer, copies=copies)

        def notify(peer: Any, payload: bytes, _n: Any = real_notify) -> None:
            used.append(("notice", b"warm" in payload))
            _n(peer, payload)

        be.post_guard_read = read  # type: ignore[method-assign]
        be.post_sink_write = write  # type: ignore[method-assign]
        be.notify = notify  # type: ignore[method-assign]
    marker = 0x5EED_0F_5111C
    poster_sink, passive_sink = (be.guard_table().sink for be in (poster_be, passive_be))
    assert poster_sink is not None and passive_sink is not None
    ctypes.c_uint64.from_address(poster_sink).value = marker
    try:
        for _ in range(2):
            poster.connect(*passive.address, passive.config.engine_id)
        # The agent's first warm-up, as warm_up_descriptors descriptors.
        n = poster.config.warm_up_descriptors
        first = ("read", 0, n) if pull else ("write", n)
        assert used == [first, ("notice", True)]
        landed = ctypes.c_uint64.from_address(passive_sink).value
        assert landed == (0 if pull else marker)
        _start(direction, prod, cons, "after-warm", [3], [5]).wait(10)
        assert cons_cache.mismatches([5], [3], SEED) == 0
        assert passive.stats().notices_failed == 0  # the WARM notice was not taken for bad
    finally:
        cons.close()
        prod.close()


def test_a_push_producer_warms_up_with_a_read_where_the_peer_announces_no_sink() -> None:
    """A consumer that predates the sink word (its Welcome's guard table has none) is
    warmed up as before: the push producer reads its guard word, writes nothing, and
    the push after it is DONE."""
    prod_cache = HostKVCache(SHAPE, 16, 16, fill_seed=SEED)
    cons_cache = HostKVCache(SHAPE, 16, 16)
    prod, prod_be = _agent(Role.PRODUCER, Direction.PUSH, prod_cache)
    cons, cons_be = _agent(Role.CONSUMER, Direction.PUSH, cons_cache)
    table = cons_be.guard_table()
    assert table is not None and table.sink is not None
    old_table = msgspec.structs.replace(table, sink=None)
    cons_be.guard_table = lambda: old_table  # type: ignore[method-assign]
    used: list[str] = []
    real_read, real_write = prod_be.post_guard_read, prod_be.post_sink_write

    def read(peer: Any, slot: int, notification: bytes = b"", *, copies: int = 1) -> Any:
        used.append("read")
        return real_read(peer, slot, notification, copies=copies)

    def write(peer: Any, *, copies: int = 1) -> Any:
        used.append("write")
        return real_write(peer, copies=copies)

    prod_be.post_guard_read = read  # type: ignore[method-assign]
    prod_be.post_sink_write = write  # type: ignore[method-assign]
    try:
        prod.connect(*cons.address, cons.config.engine_id)
        assert used == ["read"]
        _start(Direction.PUSH, prod, cons, "no-sink", [3], [5]).wait(10)
        assert cons_cache.mismatches([5], [3], SEED) == 0
    finally:
        cons.close()
        prod.close()


def test_polling_many_transfers_runs_one_round_of_progress() -> None:
    """An engine polls each transfer in flight once a step; a round of progress (every
    notice, status and deadline) serves all of them, so polling 40 transfers in one
    step must not run 40 rounds. (A round is skipped when another ran within half the
    progress interval: a 1 s interval makes that window far longer than 40 polls take
    on a loaded host, so the count checks the sharing, not the host's speed.)"""
    agents = _push_agents(64, progress_interval_s=1.0)
    prod, cons, cons_be, cons_cache = agents.prod, agents.cons, agents.cons_be, agents.cons_cache
    rounds: list[str] = []
    real_drain = cons_be.drain_notifications

    def counted() -> list[tuple[str, bytes]]:  # every round drains notices first
        rounds.append(threading.current_thread().name)
        return real_drain()

    try:
        transfers = [cons.expect_push(_stub(prod, f"r{i}"), [i], num_tokens=16) for i in range(40)]
        deadline = time.monotonic() + 10
        while len(prod.holding()) < 40:  # registrations arrive from worker threads
            assert time.monotonic() < deadline, "the consumer never registered"
            time.sleep(0.005)
        cons_be.drain_notifications = counted  # type: ignore[method-assign]
        cons.progress()  # a round just ran: the polls below may share it
        rounds.clear()
        assert all(t.poll() is TransferState.PENDING for t in transfers)
        assert rounds.count("MainThread") <= 1, rounds
        # the transfers still progress (here by the progress thread's rounds)
        prod.hold("r7", [20], 16)
        transfers[7].wait(10)
        assert cons_cache.mismatches([7], [20], SEED) == 0
    finally:
        cons.close()
        prod.close()


@pytest.mark.parametrize("how", ["wait", "await"])
def test_a_transfer_with_a_waiter_is_not_polled_twice(how: str) -> None:
    """A thread in wait() (or a coroutine awaiting the transfer) polls it every 0.2 ms;
    the progress thread then keeps a backstop pace instead of polling the same
    transfer as often (two pollers doubled the consumer's wakeups, CPU a small host's
    copy needed). Once the waiter gives up, the progress thread still polls the
    reception, at its own relaxed pace (a waiting consumer must not spin)."""
    agents = _push_agents(16)
    cons = agents.cons
    ticks = _progress_thread_ticks(cons)
    try:
        # registered with the producer, which never holds it: awaiting notices
        transfer = cons.expect_push(_stub(agents.prod, "never"), [1, 2], num_tokens=32)
        outcome: list[BaseException] = []

        async def awaited() -> None:
            await asyncio.wait_for(transfer, 0.5)

        def wait() -> None:
            try:
                if how == "wait":
                    transfer.wait(0.5)
                else:
                    asyncio.run(awaited())
            except (TransferTimeout, TimeoutError) as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        time.sleep(0.1)
        ticks.clear()
        window = 0.3
        time.sleep(window)
        waited = len(ticks)
        waiter.join(10)
        assert not waiter.is_alive() and len(outcome) == 1, "the wait did not time out"
        # 5 ms backstop: ~60 rounds; the 0.2 ms progress interval: several hundred
        assert waited < 2 * window / WAITED_TICK_S, f"{waited} rounds in {window}s"
        assert transfer.poll() is TransferState.PENDING
        ticks.clear()
        time.sleep(0.2)
        # nobody waits any more: a push reception alone is still polled, at the
        # reception pace (5 ms: ~40 rounds; the 0.2 ms in-flight interval would give
        # ~1000, which took a waiting decode 0.4 of a core)
        assert len(ticks) > 0.2 / RECEPTION_TICK_S / 4, f"{len(ticks)} rounds in 0.2s"
        assert len(ticks) < 2 * 0.2 / RECEPTION_TICK_S, f"{len(ticks)} rounds in 0.2s"
    finally:
        cons.close()
        agents.prod.close()


def test_expect_push_wakes_an_idle_progress_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A push reception awaits notices from the moment it is registered: the progress
    thread leaves its idle nap for it at once, so an engine that polls only now and
    then (or not at all) still sees the push settle promptly."""
    monkeypatch.setattr(_progress, "IDLE_NAP_S", 30.0)  # idle: asleep for 30 s
    agents = _push_agents(16)
    prod, cons = agents.prod, agents.cons
    ticks = _progress_thread_ticks(cons)
    try:
        _start(Direction.PUSH, prod, cons, "warm", [0], [0]).wait(10)
        time.sleep(0.2)  # nothing in flight: the progress thread is in its idle nap
        ticks.clear()
        transfer = cons.expect_push(_stub(prod, "late"), [3, 4], num_tokens=32)
        deadline = time.monotonic() + 10
        while "late" not in prod.holding():
            assert time.monotonic() < deadline, "the consumer never registered"
            time.sleep(0.001)
        prod.hold("late", [7, 8], 32)
        # nobody polls or waits on this side: only the progress thread can settle it
        deadline = time.monotonic() + 10
        while not transfer.done:
            assert time.monotonic() < deadline, "the push was never seen to land"
            time.sleep(0.01)
        assert ticks, "settled without a round of the progress thread?"
        assert transfer.state is TransferState.DONE
        assert agents.cons_cache.mismatches([3, 4], [7, 8], SEED) == 0
    finally:
        cons.close()
        prod.close()


@pytest.mark.parametrize(
    ("push_post", "stages", "inline"),
    [
        (PushPost.AUTO, False, True),
        (PushPost.AUTO, True, False),  # a staging backend: its post copies on the CPU
        (PushPost.ENGINE, True, True),
        (PushPost.WRITER, False, False),
    ],
)
def test_who_posts_a_push_write(push_post: PushPost, stages: bool, inline: bool) -> None:
    """hold() posts a push's write on the engine's own thread (no thread hand-off, no
    waiting for the GIL behind a busy engine) once the consumer is connected; the first
    write (a handshake) always goes to the writer thread."""
    agents = _push_agents(16, push_post, stages)
    prod, prod_be, cons, cons_cache = agents.prod, agents.prod_be, agents.cons, agents.cons_cache
    me = threading.current_thread().name
    try:
        for rid, src, dst in (("first", [0], [0]), ("second", [1, 2], [5, 6])):
            # The consumer may see the first write's bytes before the writer's call
            # returned; the engine posts only behind an idle writer, so wait for it.
            assert until(lambda: prod._push.writer_idle, 10) is not None, "writer stayed busy"
            transfer = _start(Direction.PUSH, prod, cons, rid, src, dst)
            if inline and rid == "second":  # posted (and here landed) inside hold()
                assert prod_be.posters[-1] == me
            transfer.wait(10)
            assert transfer.state is TransferState.DONE
        assert cons_cache.mismatches([5, 6], [1, 2], SEED) == 0
        assert prod_be.posters[0] == "kvxfer-push"  # the first contact handshakes there
        assert prod_be.posters[1] == (me if inline else "kvxfer-push")
    finally:
        cons.close()
        prod.close()


def test_a_write_queued_on_the_writer_is_never_overtaken_by_the_engine() -> None:
    """While the writer thread has a write queued or in its post, the engine's next
    write goes behind it (a request's writes stay in order; no two posts race)."""
    agents = _push_agents(16, PushPost.ENGINE)
    prod, prod_be, cons, cons_cache = agents.prod, agents.prod_be, agents.cons, agents.cons_cache
    me = threading.current_thread().name
    try:
        prod_be.gate.clear()
        prod_be.posting.clear()
        first = _start(Direction.PUSH, prod, cons, "first", [0], [0])  # handshake: writer
        assert prod_be.posting.wait(10), "the first write never started"
        second = _start(Direction.PUSH, prod, cons, "second", [1], [1])  # writer busy
        assert prod_be.posters == ["kvxfer-push"]  # hold() returned without posting
        prod_be.gate.set()
        first.wait(10)
        second.wait(10)
        assert prod_be.posters == ["kvxfer-push", "kvxfer-push"]
        assert cons_cache.mismatches([0, 1], [0, 1], SEED) == 0
        # The consumer may see the bytes before the writer's call returned: wait for it.
        assert until(lambda: prod._push.writer_idle, 10) is not None, "the writer stayed busy"
        third = _start(Direction.PUSH, prod, cons, "third", [2], [2])  # writer idle again
        third.wait(10)
        assert prod_be.posters[-1] == me
    finally:
        prod_be.gate.set()
        cons.close()
        prod.close()


@pytest.mark.parametrize("value", [0, -1, MAX_WARM_UP_DESCRIPTORS + 1, True, 1.5, "4096"])
def test_warm_up_descriptors_out_of_range_is_refused_naming_key_value_rule(value: int) -> None:
    with pytest.raises(ConfigError) as err:
        AgentConfig(engine_id="e", fingerprint=_fp(Direction.PULL), warm_up_descriptors=value)
    assert str(err.value) == (
        f"warm_up_descriptors={value!r}: must be an integer from 1 to {MAX_WARM_UP_DESCRIPTORS}"
    )
    for ok in (1, MAX_WARM_UP_DESCRIPTORS):
        config = AgentConfig(engine_id="e", fingerprint=_fp(Direction.PULL), warm_up_descriptors=ok)
        assert config.warm_up_descriptors == ok


@pytest.mark.parametrize("value", [0, 0.0, -0.001, 1.5, True, "0.0002", None])
def test_progress_interval_out_of_range_is_refused_naming_key_value_rule(value: Any) -> None:
    with pytest.raises(ConfigError) as err:
        AgentConfig(engine_id="e", fingerprint=_fp(Direction.PULL), progress_interval_s=value)
    assert str(err.value) == (
        f"progress_interval_s={value!r}: must be a number of seconds more than 0 and at "
        f"most {MAX_PROGRESS_INTERVAL_S:g}"
    )
    for ok in (1e-6, 2e-5, MAX_PROGRESS_INTERVAL_S, 1):
        config = AgentConfig(engine_id="e", fingerprint=_fp(Direction.PULL), progress_interval_s=ok)
        assert config.progress_interval_s == ok
    assert AgentConfig(engine_id="e", fingerprint=_fp(Direction.PULL)).progress_interval_s == (
        DEFAULT_PROGRESS_INTERVAL_S
    )


def test_push_post_must_be_a_push_post() -> None:
    with pytest.raises(ConfigError, match="push_post") as err:
        AgentConfig(engine_id="e", fingerprint=_fp(Direction.PUSH), push_post="engine")  # type: ignore[arg-type]
    assert "'engine'" in str(err.value) and "PushPost" in str(err.value)


@pytest.mark.parametrize("case", ["pull", "pull before its hold", "push"])
def test_no_thread_starts_on_a_requests_path_once_the_agents_serve(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """A thread's start holds the interpreter lock while the thread is created, and
    creation can wait on the process's memory map behind other work (issue 25: a
    producer ran no Python for seconds inside ``Thread.start``). Once both agents
    serve, a first pull or push (first contact included) starts no thread, nor does
    a pull whose guard word is read again while its hold has not come (the vLLM
    scheduler hands the ticket out a step before the worker holds)."""
    direction = Direction.PUSH if case == "push" else Direction.PULL

    producer = Side(Role.PRODUCER, direction, seed=PRODUCER_SEED, lease_s=60.0)
    consumer = Side(Role.CONSUMER, direction, transfer_timeout_s=10.0)
    engine = Engine(producer)
    started: list[str] = []
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    try:
        if case == "pull":
            t = consumer.agent.pull(engine.hold("first", [1, 2]), [5, 6])
        elif case == "pull before its hold":
            cap, guard = "cd" * 16, (3, 0xC0FFEE)
            minted = replace(
                stub(producer, "first"),
                block_ids=((1, 2),),
                num_tokens=2 * BLOCK,
                capability=cap,
                guard_slot=guard[0],
                generation=guard[1],
            )
            t = consumer.agent.pull(minted, [5, 6])
            time.sleep(0.3)  # its guard word is read again meanwhile
            assert t.state is TransferState.PENDING, t.error
            engine.hold("first", [1, 2], capability=cap, guard=guard)
        else:
            t = consumer.agent.expect_push(stub(producer, "first"), [5, 6], num_tokens=2 * BLOCK)
            push_registered(producer, "first")
            engine.hold("first", [1, 2])
        settle(t, 10.0, engine)
        assert t.state is TransferState.DONE, t.error
        assert landed_intact(consumer, [5, 6], [1, 2])
        assert started == [], f"threads started on the request's path: {started}"
        if case == "pull before its hold":
            assert consumer.agent.stats().guard_rereads == 1
    finally:
        monkeypatch.undo()
        consumer.close()
        producer.close()
