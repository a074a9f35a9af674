"""Building blocks of the fault suite (issue 16): two agents on the fake fabric with
real side channels, an engine that reuses freed blocks at once, and a stranger who
reaches the side channel.

Everything here drives the Agent's public API only (``hold``, ``pull``, ``abort``,
``release``, ``freed``, ``holding``, ``expect_push``, ``close``); faults are injected
through :class:`~kvxfer.testing.fake_backend.Faults` and through raw side-channel
frames, as a faulty or hostile peer would send them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import numpy as np
import zmq

from kvxfer.agent import Agent, AgentConfig, Ticket
from kvxfer.backend import Backend, BackendOptions
from kvxfer.core import wire
from kvxfer.core.compat import Fingerprint
from kvxfer.testing.fake_backend import FakeBackend, Faults
from kvxfer.testing.kvcache import HostKVCache, ModelShape
from kvxfer.transfer import Transfer, TransferState
from kvxfer.types import Direction, Role

SHAPE = ModelShape(name="faults", layers=2, kv_heads=1, head_dim=8)
BLOCK = 16
NUM_BLOCKS = 32
PRODUCER_SEED = 11
#: What the producer's engine writes into blocks it got back (another request's KV).
REUSED = np.uint16(0xBEEF)
#: Words a failure's reason may use for blocks the producer no longer held.
REASONS = ("released", "aborted", "reused", "expired")
_names = itertools.count()


def fingerprint(direction: Direction) -> Fingerprint:
    return Fingerprint(
        model="faults/model",
        dtype="bfloat16",
        kv_cache_dtype="bfloat16",
        attention_backend="test",
        direction=direction,
    )


class Side:
    """One agent on the fake fabric, its cache and its backend (faults settable)."""

    def __init__(
        self,
        role: Role,
        direction: Direction,
        *,
        seed: int | None = None,
        backend_extra: dict[str, str] | None = None,
        **config: Any,
    ) -> None:
        self.name = f"{role.value}-{next(_names)}"
        self.cache = HostKVCache(SHAPE, BLOCK, NUM_BLOCKS, fill_seed=seed)
        self.backend = FakeBackend(
            BackendOptions(agent_name=self.name, extra=dict(backend_extra or {}))
        )
        self.agent = Agent(
            AgentConfig(
                engine_id=self.name,
                fingerprint=fingerprint(direction),
                role=role,
                direction=direction,
                **config,
            ),
            backend=self.backend,
        )
        self.agent.register(self.cache.layout())
        self.host, self.port = self.agent.serve()

    def faults(self, **kw: Any) -> None:
        self.backend.faults = Faults(**kw)

    def close(self) -> None:
        self.backend.faults = Faults()  # a stalled post must not outlive the test
        self.agent.close()


class Engine:
    """A producer's engine that reuses every block it gets back at once: the moment a
    request id appears in ``freed()``, its blocks hold another request's bytes."""

    def __init__(self, side: Side) -> None:
        self.side = side
        self.blocks: dict[str, list[int]] = {}
        self.freed: list[str] = []

    def hold(self, request_id: str, blocks: Sequence[int], **kw: Any) -> Ticket:
        self.blocks[request_id] = list(blocks)
        return self.side.agent.hold(request_id, list(blocks), BLOCK * len(blocks), **kw)

    def step(self) -> list[str]:
        got = self.side.agent.freed()
        for rid in got:
            self.reuse(self.blocks.get(rid, []))
        self.freed += got
        return got

    def reuse(self, blocks: Sequence[int]) -> None:
        for region in self.side.cache.regions:
            region[list(blocks)] = REUSED

    def wait_freed(self, request_id: str, timeout: float) -> float:
        """Seconds until ``request_id`` was freed (and reused); raises after ``timeout``."""
        t0 = time.monotonic()
        while request_id not in self.freed:
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"{request_id} not freed within {timeout}s")
            self.step()
            time.sleep(0.002)
        return time.monotonic() - t0


def settle(transfer: Transfer, timeout: float, engine: Engine | None = None) -> float:
    """Poll until settled (stepping the producer's engine meanwhile); seconds taken."""
    t0 = time.monotonic()
    while transfer.poll() is TransferState.PENDING:
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{transfer!r} still pending after {timeout}s")
        if engine is not None:
            engine.step()
        time.sleep(0.002)
    return time.monotonic() - t0


def landed_intact(consumer: Side, local: Sequence[int], remote: Sequence[int]) -> bool:
    """Whether the consumer's ``local`` blocks hold the producer's bytes at hold time."""
    return consumer.cache.mismatches(list(local), list(remote), PRODUCER_SEED) == 0


def assert_fails_closed(transfer: Transfer, local: Sequence[int]) -> None:
    """FAILED, with exactly ``local`` invalid and a reason that says why."""
    assert transfer.state is TransferState.FAILED, (
        f"{transfer!r} reported success for blocks the producer no longer held"
    )
    assert transfer.invalid_blocks == tuple(sorted(local))
    text = str(transfer.error).lower()
    assert any(word in text for word in REASONS), transfer.error


def stub(producer: Side, request_id: str) -> Ticket:
    """What a push consumer knows before the prefill ran: where to register."""
    return Ticket(
        engine_id=producer.name,
        host=producer.host,
        port=producer.port,
        request_id=request_id,
        block_ids=((),),
        num_tokens=0,
    )


def push_registered(producer: Side, request_id: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while request_id not in producer.agent.holding():
        assert time.monotonic() < deadline, "the consumer never registered"
        time.sleep(0.001)


class Stranger:
    """Anyone who reaches a side-channel port: sends well-formed frames, unsigned."""

    def __init__(
        self, host: str, port: int, direction: Direction, *, compat_hash: str | None = None
    ) -> None:
        self.address = f"tcp://{host}:{port}"
        self.compat = fingerprint(direction).digest() if compat_hash is None else compat_hash
        self.ctx = zmq.Context()

    def request(self, message: wire.Message, timeout_ms: int = 3000) -> wire.Message:
        sock = self.ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        try:
            sock.connect(self.address)
            sock.send(wire.encode(message, self.compat))
            return wire.decode(sock.recv()).message
        finally:
            sock.close(0)

    def flood(self, messages: Sequence[wire.Message], window: int = 256) -> int:
        """Send every message, ``window`` in flight at a time; returns replies seen."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        replies = 0
        try:
            sock.connect(self.address)
            frames = [wire.encode(m, self.compat) for m in messages]
            sent = 0
            while replies < len(frames):
                while sent < len(frames) and sent - replies < window:
                    sock.send_multipart([b"", frames[sent]])
                    sent += 1
                sock.recv_multipart()
                replies += 1
            return replies
        except zmq.Again:
            return replies
        finally:
            sock.close(0)

    def close(self) -> None:
        self.ctx.term()


def until(predicate: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until ``predicate()`` held, or None after ``timeout``."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            return None
        time.sleep(0.002)
    return time.monotonic() - t0


def record_posts(backend: Backend) -> list[object]:
    """The handles of every transfer ``backend`` posts from now on (its ``post`` and
    ``post_lists`` wrapped on this instance): a test waits for a post by this, where
    the agent's counters move only once the transfer ends."""
    posted: list[object] = []

    def recorded(real: Callable[..., Any]) -> Callable[..., Any]:
        def post(*args: Any, **kw: Any) -> Any:
            posted.append(handle := real(*args, **kw))
            return handle

        return post

    for name in ("post", "post_lists"):
        setattr(backend, name, recorded(getattr(backend, name)))
    return posted


def replace(ticket: Ticket, **changes: Any) -> Ticket:
    return msgspec.structs.replace(ticket, **changes)


def pull_pair() -> Iterator[tuple[Side, Engine, Side]]:
    """A pull producer (its cache filled, 60 s leases), its engine and a consumer
    (10 s deadline), closed after use: the body of the ``pull`` fixtures."""
    producer = Side(Role.PRODUCER, Direction.PULL, seed=PRODUCER_SEED, lease_s=60.0)
    consumer = Side(Role.CONSUMER, Direction.PULL, transfer_timeout_s=10.0)
    yield producer, Engine(producer), consumer
    consumer.close()
    producer.close()
