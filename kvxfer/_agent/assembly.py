"""How an Agent's parts are built: each one in order, with what it needs, none set later.

:func:`assemble` is the Agent's constructor body. It lives here so that
:mod:`kvxfer.agent` stays the public facade (its methods and their documentation) and
this module is the one place that says which part gets which other one. The parts
never reach each other any other way: no part holds the Agent, and none is given a
getter for another part.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvxfer._agent.gather_pull import GatherPuller
from kvxfer._agent.gather_serve import GatherDesk
from kvxfer._agent.guard import FreeReason
from kvxfer._agent.holds import HoldDesk
from kvxfer._agent.keepalive import KeepAlive
from kvxfer._agent.leases import Lease, LeaseBook
from kvxfer._agent.local import LocalEnd
from kvxfer._agent.peers import PeerCache
from kvxfer._agent.producer import Producer
from kvxfer._agent.pull import Puller
from kvxfer._agent.push_receive import PushReceiver
from kvxfer._agent.push_write import PushWriter
from kvxfer._agent.readers import ReaderCount
from kvxfer._agent.receptions import Receptions
from kvxfer._agent.registrar import Registrar
from kvxfer._agent.renewals import Renewer
from kvxfer._agent.runtime import Runtime
from kvxfer._agent.side_channel import Answers, SideChannel
from kvxfer._agent.tp_producers import ProducerGroup
from kvxfer._agent.tp_pull import TPPuller
from kvxfer._agent.workers import IoPool
from kvxfer.agent_config import AgentConfig, AgentStats
from kvxfer.backend import Backend
from kvxfer.core import wire
from kvxfer.errors import ConfigError
from kvxfer.io.control import SideChannelClient
from kvxfer.registry import get_backend
from kvxfer.types import Direction

__all__ = ["Parts", "assemble", "check_backend", "open_backend"]

#: Threads that run side-channel requests and handshakes off the engine's thread.
IO_THREADS = 8


def open_backend(config: AgentConfig, agent_name: str) -> Backend:
    """The backend ``config`` names (the registry's), opened for ``agent_name``."""
    return get_backend(config.backend)(config.backend_options(agent_name))


def check_backend(config: AgentConfig, backend: Backend) -> None:
    """Refuse a backend that cannot do what ``config`` asks.

    Raises:
        ConfigError: the config asks for what only a device-to-device backend does
            (``chunk_mode``, ``swa_window_mode``, ``push_stream``) of one that is not.
    """
    needs_d2d = config.plan.chunk_mode or config.plan.swa_window_mode or config.push_stream
    if needs_d2d and not backend.capabilities.device_to_device:
        raise ConfigError(
            "backend",
            config.backend,
            "chunk_mode, swa_window_mode and push_stream need a device-to-device backend",
        )


@dataclass(frozen=True)
class Parts:
    """An agent's parts, built by :func:`assemble` (internal).

    Attributes:
        local: Identity, registered memory and the block-id rules, shared by all.
        lock: The agent lock (leases, receptions, transfers in flight).
        peers: Handshaken peers.
        side: The side channel: its server and every message this agent sends.
        io: Worker threads for side-channel requests.
        receptions: A consumer's push receptions awaited.
        runtime: Posting, settling and the progress loop.
        push: A push producer's writes.
        producer: A producer's hold, stream, release and freed calls.
        answers: What the side channel does with the messages after a handshake.
        puller: A consumer's pulls.
        receiver: A consumer's push receptions.
        registrar: Registered memory.
        renewer: A consumer's lease renewals.
        keepalive: Renews a consumer's holds on a timer until their reads start.
    """

    local: LocalEnd
    lock: threading.RLock
    peers: PeerCache
    side: SideChannel
    io: IoPool
    receptions: Receptions
    runtime: Runtime
    push: PushWriter
    producer: Producer
    answers: Answers
    puller: Puller
    receiver: PushReceiver
    registrar: Registrar
    renewer: Renewer
    keepalive: KeepAlive


def assemble(local: LocalEnd, backend: Backend, stats: AgentStats) -> Parts:
    """Build the parts of the agent ``local`` describes, over ``backend``."""
    config = local.config
    lock = threading.RLock()
    prefix = backend.capabilities.log_prefix
    client = SideChannelClient(
        timeout_s=config.handshake_timeout_s,
        retries=config.handshake_retries,
        max_bytes=max(config.max_message_bytes, 1 << 16) * 4,
    )

    # A handshake (either side) speeds progress up while UCX wires the endpoint up;
    # the runtime that progresses is built below, after the cache it needs.
    def connected() -> None:
        runtime.wiring_up()

    peers = PeerCache(local, backend, client, stats, prefix, connected)
    side = SideChannel(local, backend, client)
    io = IoPool(IO_THREADS, "kvxfer-io")

    # A freed lease cancels its push writes first. The writer needs the lease book, so
    # the book calls it through this closure; nothing is freed before it exists.
    def on_free(lease: Lease, reason: FreeReason) -> None:
        push.on_free(lease, reason)
        gather.forget(lease.request_id)  # its staging slots come back with it

    leases = LeaseBook(stats, on_free=on_free)
    gather = GatherDesk(
        local, leases, stats, lock, bounces=backend.capabilities.stages_through_host
    )
    receptions = Receptions(local, lock)
    readers = ReaderCount()  # consumer ranks of a request read across TP sizes
    runtime = Runtime(
        local, backend, peers, leases, receptions, stats, lock, readers, ping=side.ping, io=io
    )
    push = PushWriter(local, backend, runtime, peers, leases, lock, io)
    if config.direction is Direction.PUSH:
        # A lease whose consumer registers after its hold() is written by a tick.
        runtime.add_tick_hook(push.resume)
    holds = HoldDesk(local, leases, readers, lock)
    # What peers may send once handshaken, each to the part that owns it.
    answers = Answers(
        handlers={
            wire.Release: holds.release,
            wire.Renew: holds.renew,
            wire.PushRegister: push.on_register,
            wire.GatherRound: gather.on_round,
            wire.GatherDone: gather.on_done,
        },
        hold_state=holds.state,
        welcomed=connected,
    )
    # Producers of another TP size: several ranks per request.
    group = ProducerGroup(local, runtime, io, side)
    tp = TPPuller(local, peers, runtime, io, group, lock)
    renewer = Renewer(side, group, io, stats, lock)
    return Parts(
        local=local,
        lock=lock,
        peers=peers,
        side=side,
        io=io,
        receptions=receptions,
        runtime=runtime,
        push=push,
        producer=Producer(local, backend, holds, push, leases, runtime, side, lock),
        answers=answers,
        puller=Puller(
            local,
            peers,
            runtime,
            side,
            io,
            tp,
            group,
            # Only where staging is configured: a pull with gathering off never
            # enters the gather path's module (tests/test_call_path.py).
            GatherPuller(local, backend, runtime, side, io, stats, lock)
            if local.config.gather.enabled
            else None,
        ),
        receiver=PushReceiver(local, runtime, receptions, side, io, group, backend.agent_name),
        registrar=Registrar(local, backend, leases, lock, prefix),
        renewer=renewer,
        keepalive=KeepAlive(renewer, io, config.lease_guard_s, config.renew_limit_s, stats, lock),
    )
