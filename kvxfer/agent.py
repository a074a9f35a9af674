"""The Agent: kvxfer's embedding API, one per worker process.

An engine drives everything through an :class:`Agent`::

    agent = Agent(AgentConfig(engine_id="prefill-0", fingerprint=fp, direction=fp.direction))
    agent.register_tensors(kv_caches, block_size=16)  # kept alive until close()
    agent.serve()                     # side channel up: peers can handshake

    # producer (prefill), when a request's prompt is done:
    ticket = agent.hold("req-1", block_ids, num_tokens)   # lease; goes to the router
    ...
    for request_id in agent.freed(): engine.free_blocks(request_id)

    # consumer (decode), with the ticket the router forwarded (ceil(num_tokens /
    # block_size) - cached_blocks local blocks, checked at the call):
    transfer = agent.pull(ticket, local_block_ids, cached_blocks=0)
    ... transfer.poll() in the step loop, or transfer.wait() / await transfer

Push is the mirror image: the consumer calls :meth:`Agent.expect_push` with its
receiving blocks and a :meth:`Ticket.for_push <kvxfer.ticket.Ticket.for_push>`; the
producer's :meth:`Agent.hold` then writes into them (and :meth:`Agent.stream` writes
blocks early, during prefill, with ``push_stream``).

docs/DESIGN.md follows one pull and one push write from here to the posted descriptors.

The Agent is a facade: :func:`kvxfer._agent.assembly.assemble` builds its parts (pulls,
push receptions and writes, holds, registered memory, the runtime that posts and
settles, peers, the side channel), each with what it needs; the value types live in
:mod:`kvxfer.agent_config` and :mod:`kvxfer.ticket`.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from kvxfer._agent.assembly import assemble, check_backend, open_backend
from kvxfer._agent.local import LocalEnd
from kvxfer._agent.peers import Peer
from kvxfer.agent_config import AgentConfig, AgentStats, PushPost
from kvxfer.backend import Backend
from kvxfer.core.blocks import BlockIds
from kvxfer.core.descriptors import DescriptorTable
from kvxfer.core.heads import peer_ranks
from kvxfer.core.layout import KVLayout
from kvxfer.errors import ConfigError
from kvxfer.ticket import Ticket
from kvxfer.transfer import Transfer
from kvxfer.types import Direction, posts

__all__ = ["Agent", "AgentConfig", "AgentStats", "BlockIds", "PushPost", "Ticket"]

log = logging.getLogger("kvxfer.agent")


class Agent:
    """The embedding API (see the module docstring). Context manager; ``close`` is idempotent.

    Attributes:
        config: The configuration it was built with.
        backend: The transport.
        incarnation: This process life's random id (a restarted peer is told apart).
        agent_name: The backend's name of this agent (engine id and incarnation).
        compat_hash: The fingerprint's digest, checked in every handshake.
        stats_counters: The live counters (:meth:`stats` returns a copy).
    """

    def __init__(self, config: AgentConfig, *, backend: Backend | None = None) -> None:
        self.config = config
        # A fresh random incarnation per process life: a restarted peer on the same
        # address is told apart from its earlier self (R-HS-4).
        self.incarnation = secrets.randbits(63)
        self.agent_name = f"{config.engine_id}#{self.incarnation:016x}"
        self._local = LocalEnd(config, self.incarnation)
        self.compat_hash = self._local.compat_hash
        if backend is None:
            backend = open_backend(config, self.agent_name)
        check_backend(config, backend)
        self.backend = backend
        self.stats_counters = AgentStats()
        parts = assemble(self._local, backend, self.stats_counters)
        self._lock, self._runtime, self._io_pool = parts.lock, parts.runtime, parts.io
        self._side, self._answers, self._peers = parts.side, parts.answers, parts.peers
        self._producer, self._push = parts.producer, parts.push
        self._puller, self._receiver = parts.puller, parts.receiver
        self._receptions, self._registrar = parts.receptions, parts.registrar
        self._renewer, self._keepalive = parts.renewer, parts.keepalive

    # -- registered memory (kept in the parts' shared LocalEnd) -------------------------
    @property
    def layout(self) -> KVLayout | None:
        """The registered layout as the engine described it (None until registered)."""
        return self._local.layout

    @property
    def exposed_layout(self) -> KVLayout | None:
        """The registered layout as peers address it (the backend's view)."""
        return self._local.exposed_layout

    @property
    def table(self) -> DescriptorTable | None:
        """The descriptor table of :attr:`exposed_layout` (None until registered)."""
        return self._local.table

    # -- registration ---------------------------------------------------------------
    def register(self, layout: KVLayout, *, defer: bool = False, keep: object = None) -> None:
        """Register the KV cache memory described by ``layout`` (R-REG-1, R-REG-2).

        A layout records addresses, not tensors. The tensors a layout was built from
        (:meth:`KVLayout.from_kv_caches <kvxfer.core.layout.KVLayout.from_kv_caches>`,
        ``from_tensors``) pass to the agent, which references them until
        :meth:`close`, so that
        memory is not collected while peers may still read or write it; ``keep``
        names what to keep instead, for a layout described by addresses (without it
        the caller must keep that memory alive). Either way the memory must stay in
        place: a re-allocated pool is not seen by the agent.
        :meth:`register_tensors` builds the layout and keeps the tensors in one call.

        With ``defer=True`` only the layout is kept; call :meth:`complete_registration`
        once the engine's warm-up is over (device memory may move before that).

        Raises:
            RegistrationError: a layout is already registered (or deferred), or the
                transport refused the memory.
        """
        self._registrar.register(layout, defer=defer, keep=keep)

    def register_tensors(
        self,
        kv_caches: Sequence[Any],
        *,
        block_size: int,
        defer: bool = False,
        **layout_options: Any,
    ) -> KVLayout:
        """Register an engine's per-layer KV caches and keep them alive until :meth:`close`.

        ``kv_caches`` holds one tensor per layer, ``(2, num_blocks, block_size,
        kv_heads, head_dim)`` by default; ``layout_options`` are the other keywords of
        :meth:`KVLayout.from_kv_caches <kvxfer.core.layout.KVLayout.from_kv_caches>`
        (``kv_dim``, ``kv_layout``, ``layer_groups``, ``groups``, ...). The agent holds
        a reference to every tensor, so dropping the engine's own (``del pool``) does
        not free memory a peer may still move bytes into or out of.

        Returns:
            The registered layout.

        Raises:
            LayoutError: the tensors do not describe a valid layout (block_size
                disagreeing with their token dimension, mixed dtypes, ...).
            RegistrationError: as :meth:`register`.
        """
        caches = tuple(kv_caches)
        layout = KVLayout.from_kv_caches(caches, block_size=block_size, **layout_options)
        self.register(layout, defer=defer, keep=caches)
        return layout

    def complete_registration(self) -> None:
        """Finish a deferred registration (no-op when nothing is deferred)."""
        self._registrar.complete()

    @property
    def registered(self) -> bool:
        """True once memory is registered (not merely deferred)."""
        return self._local.table is not None

    # -- side channel ---------------------------------------------------------------
    def serve(self) -> tuple[str, int]:
        """Start answering handshakes; returns the advertised ``(host, port)``. The
        agent's threads start here too, so that no request waits for one's creation."""
        with self._lock:
            address = self._side.serve(self._answers)
            self._runtime.ensure_thread()
        self._io_pool.start()
        self._push.start_writer()
        return address

    @property
    def address(self) -> tuple[str, int]:
        """The advertised side-channel address (after :meth:`serve`)."""
        return self._side.address

    def connect(self, host: str, port: int, expected_engine_id: str | None = None) -> Peer:
        """Handshake with the peer at ``host:port`` (cached; concurrent callers share
        it), ahead of the first transfer with it. A consumer connecting to every rank
        of a producer group of another TP size also gets its pulls' planners built
        once the last rank it reads is connected; a push's producer connecting to a
        consumer rank of another TP size, the planners of its writes into it. An
        agent that posts to the peer (a pull's consumer, a push's producer) also uses
        the new connection once, so that the first request does not pay for its
        set-up (:meth:`Runtime.warm_up <kvxfer._agent.runtime.Runtime.warm_up>`: a
        read of the peer's guard word, or a push producer's write of its sink word,
        waited for within ``handshake_timeout_s``, and one notice the peer ignores)."""
        peer = self._peers.get(host, port, expected_engine_id, None)
        self._puller.connected(peer)
        self._push.connected(peer)
        self._runtime.warm_up(peer)
        return peer

    def connect_group(
        self, host: str, port: int, tp_size: int = 1, expected_engine_id: str | None = None
    ) -> list[Peer]:
        """:meth:`connect` to every rank of a peer instance of ``tp_size`` ranks (rank
        0 at ``host:port``, rank *p* at ``port + p``) that this rank will transfer
        with: the producer ranks holding its heads (a pull's consumer), or the
        consumer ranks holding its heads (a push's producer); between equal TP sizes
        rank *r* pairs rank *r*. Each replica a request may pick is included.

        Raises:
            ConfigError: ``tp_size`` is not a positive int that splits the model's
                heads, several ranks without this agent's TP identity
                (``AgentConfig.tp``), a port past 65535, or an agent that does not
                post (a pull's producer, a push's consumer).
            HandshakeError, CompatError, LayoutMismatch, PeerError: as :meth:`connect`.
        """
        config = self.config
        reads = config.direction is Direction.PULL
        if not posts(config.role, config.direction):
            raise ConfigError(
                "role",
                config.role.value,
                f"a {config.direction.value} {config.role.value} never posts; the other "
                "side connects to it",
            )
        if type(tp_size) is not int or tp_size < 1:
            raise ConfigError("tp_size", tp_size, "must be a positive int")
        mine = config.tp
        if mine is None:
            if tp_size != 1:
                raise ConfigError(
                    "tp_size",
                    tp_size,
                    "a peer group of several ranks needs this agent's TP identity "
                    "(AgentConfig.tp) to know which ranks hold its heads",
                )
            ranks: tuple[int, ...] = (0,)
        else:
            ranks = peer_ranks(mine.heads, mine.rank, tp_size, reads=reads)
        if port + ranks[-1] > 65535:
            raise ConfigError("port", port, f"rank {ranks[-1]} would serve at {port + ranks[-1]}")
        return [self.connect(host, port + p, expected_engine_id) for p in ranks]

    # -- producer -------------------------------------------------------------------
    def stage_out(self, block_ids: BlockIds) -> None:
        """Copy blocks out to the backend's staging buffers, where peers read them.

        Only backends that stage through host memory (host bounce,
        ``capabilities.stages_through_host``) do anything; elsewhere peers read engine
        memory directly and this is a no-op. An engine calls it right after the last
        forward that wrote the blocks, then passes ``staged=True`` to :meth:`hold` so
        that the hold does not copy them again.

        Raises:
            RegistrationError: no memory registered yet.
            PlanError: a block id that is not an integer, out of range or repeated.
        """
        self._producer.stage_out(block_ids)

    def hold(
        self,
        request_id: str,
        block_ids: BlockIds,
        num_tokens: int,
        *,
        lease_s: float | None = None,
        staged: bool = False,
        capability: str = "",
        guard: tuple[int, int] | None = None,
        pin: bool = True,
    ) -> Ticket:
        """Hold a finished prompt's blocks for its consumer and return the ticket.

        Pull: the blocks stay untouched until the consumer's completion notice, an
        abort, or the lease's expiry; then the request id appears in :meth:`freed`.
        Push: the blocks are written to the consumer as soon as it registered its
        receiving blocks (at once if it already did: by default on direct backends the
        write is posted here, on the caller's thread, once the consumer is connected;
        see :class:`PushPost`).

        ``block_ids`` are all the blocks of the prompt's ``num_tokens`` tokens, in
        order: exactly ``ceil(num_tokens / block_size)`` per group (a sliding-window
        group may name fewer: the last ones). The last block travels whole; its slots
        past ``num_tokens`` are not zeroed (see docs/EMBEDDING.md). Device writes to
        the blocks must be complete (the stream synchronised) before this call.

        ``staged``: the engine already copied exactly these blocks out with
        :meth:`stage_out` after their last forward (host bounce), so a pull's hold
        does not copy them again.

        ``capability`` and ``guard`` (slot, generation): the hold's token and guard
        word when the caller minted the ticket itself before this hold (the vLLM
        scheduler does); by default the agent mints them (docs/RELIABILITY.md). On a
        push producer a given ``capability`` pins the hold: only a consumer whose
        registration shows it (its ``Ticket.for_push(capability=...)``) receives the
        KV, so give it only when the router gave the consumer the same token;
        ``pin=False`` keeps the first registration's rule instead (a token the caller
        minted only so that every TP rank's hold shares it).

        Raises:
            RegistrationError: no memory registered yet.
            PlanError: a block id that is not an integer, out of range or repeated, or
                a block count that does not fit ``num_tokens`` (nothing is held).
        """
        return self._producer.hold(
            request_id,
            block_ids,
            num_tokens,
            lease_s=lease_s,
            staged=staged,
            capability=capability,
            guard=guard,
            pin=pin,
        )

    def stream(self, request_id: str, block_ids: BlockIds, num_tokens: int) -> None:
        """push_stream: write the blocks prefill has closed so far (R-XFER-3).

        Only whole blocks before ``num_tokens`` go now; :meth:`hold` writes the rest.

        Raises:
            ConfigError: ``push_stream`` is off.
        """
        self._producer.stream(request_id, block_ids, num_tokens)

    def release(self, request_id: str) -> bool:
        """Release a request's blocks at once (abort before or instead of the transfer)."""
        return self._producer.release(request_id)

    def freed(self) -> list[str]:
        """Request ids whose held blocks the engine may reuse now (drained on read)."""
        return self._producer.freed()

    def add_freed_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` each time a hold ends and its request id reaches :meth:`freed`
        (its consumer read or was written, released it, or the lease expired).

        ``fn`` runs on the thread that frees the hold (the side channel's, the progress
        thread, or the caller of :meth:`release`) while it holds the agent's lock, so it
        must be quick, must not block or raise, and must not call the agent: setting an
        event an engine's idle step waits on is the intended use (an engine with held
        blocks and nothing to compute need not poll :meth:`freed` in a loop).
        """
        self._producer.add_freed_callback(fn)

    def holding(self) -> list[str]:
        """Request ids currently held under a lease."""
        return self._producer.holding()

    # -- consumer -------------------------------------------------------------------
    def pull(
        self,
        ticket: Ticket,
        local_blocks: BlockIds,
        *,
        num_tokens: int | None = None,
        cached_blocks: int = 0,
    ) -> Transfer:
        """Read the ticket's blocks into ``local_blocks`` (R-XFER-1). Never raises for
        transport trouble: a failure is reported on the returned :class:`Transfer`.

        ``local_blocks`` receive the request's tokens from ``cached_blocks *
        block_size`` to ``num_tokens`` (default: the ticket's): exactly
        ``ceil(num_tokens / block_size) - cached_blocks`` blocks per group, in order.
        ``cached_blocks`` leading blocks are a local prefix-cache hit and are not read;
        the matching blocks of the ticket are skipped.

        A first contact handshakes on a worker thread; a known peer's read is posted
        here, so a transport that copies inside its post (UCX over CMA on one host)
        has moved the bytes when this returns.

        With :attr:`AgentConfig.tp` set and a ticket of another ``tp_size``, the
        request is read from every producer rank holding this rank's heads (rank *p*
        at ``ticket.port + p``), one sub-transfer per rank folded into the one
        returned transfer (:mod:`kvxfer._agent.tp_pull`).

        Raises:
            RegistrationError: no memory registered yet.
            PlanError: a local block id that is not an integer, out of range or
                repeated; a block count that does not fit ``num_tokens`` and
                ``cached_blocks``; or blocks the ticket does not hold (nothing is
                posted; the producer is told to release).
            ConfigError: a ticket ``tp_size`` that cannot split the model's heads.
        """
        # A kept hold's read starts: no more renewals, and the latest expiry counts.
        ticket = self._keepalive.take(ticket)
        return self._puller.pull(
            ticket, local_blocks, num_tokens=num_tokens, cached_blocks=cached_blocks
        )

    def renew(self, tickets: Sequence[Ticket]) -> list[float]:
        """Ask the producers of ``tickets`` to keep holding them: this consumer still
        means to read them (a request waiting in its engine's queue). Blocks on the
        side channel (a few seconds at most per producer); never raises for transport
        trouble.

        Each producer rank extends a hold it has for the ticket's capability to its
        ``lease_s`` from now. Returns, per ticket, the new expiry (wall clock; the
        earliest over its producer ranks across TP sizes), or 0.0 where it was not
        renewed (the hold is gone, or the producer did not answer). Pass the renewed
        expiry on to the pull (``msgspec.structs.replace(ticket, lease_expiry=...)``):
        a pull checks the ticket's expiry, less ``lease_guard_s``, before it reads.
        """
        return self._renewer.renew(tickets)

    def renew_later(self, tickets: Sequence[Ticket], done: Callable[[list[float]], None]) -> bool:
        """:meth:`renew` on one of the agent's io threads, then ``done(expiries)`` on
        it (quick; must not block). False, and nothing sent, once the agent closes."""
        return self._renewer.renew_later(tickets, done)

    def keep_alive(self, tickets: Sequence[Ticket]) -> int:
        """Keep the producers' holds of ``tickets`` alive until this agent reads them:
        for requests waiting in the consumer's queue, maybe longer than the lease.
        Never blocks; returns how many holds were added (one already kept, or a ticket
        whose ``lease_expiry`` is unset or past, is not).

        The agent renews each hold (:meth:`renew`) from its own timer and io threads,
        a third of its lease before the guard, so a long engine step cannot starve the
        renewals. It stops when :meth:`pull` of the same ticket (producer, address and
        request id) starts, which then checks the latest expiry the producer answered;
        at :meth:`abort` or :meth:`stop_keep_alive`; when the producer did not renew
        the hold before it ended (slow answers are retried until then); and after
        :attr:`AgentConfig.renew_limit_s`. Stopped ones are counted in ``stats()``'s
        ``renewals_lapsed``.
        """
        return self._keepalive.add(tickets)

    def stop_keep_alive(self, ticket: Ticket) -> bool:
        """Stop renewing ``ticket``'s hold (see :meth:`keep_alive`); whether it was
        kept. The hold then ends at its expiry, unless it is released first."""
        return self._keepalive.drop(ticket)

    def abort(self, ticket: Ticket, *, wait: bool = False) -> None:
        """Give up a request: this agent's own transfers of it fail at once (FAILED,
        every block invalid, never DONE later: R-SAFE-2), and the producer is told to
        release it (R-XFER-4).

        Non-blocking by default (the message goes from a worker thread); ``wait=True``
        returns only once the producer answered or the side channel gave up. Across TP
        sizes (a ticket naming producer rank 0 and its ``tp_size``) every producer rank
        this rank reads is told, always from worker threads.
        """
        self._keepalive.drop(ticket)
        self._puller.abort(ticket, wait=wait)

    def expect_push(
        self,
        ticket: Ticket,
        local_blocks: BlockIds,
        *,
        num_tokens: int | None = None,
        cached_blocks: int = 0,
    ) -> Transfer:
        """Register receiving blocks with the producer; the returned transfer settles
        once every expected write landed (R-XFER-2).

        ``ticket`` names the producer and the request; it needs no blocks
        (:meth:`Ticket.for_push <kvxfer.ticket.Ticket.for_push>` builds one before
        prefill ran). ``local_blocks`` follow the rule of :meth:`pull`. The producer
        notifies this agent through its side channel, so this starts serving (as
        :meth:`serve`) when the agent does not serve yet.

        Raises:
            RegistrationError: no memory registered yet.
            PlanError: a local block id that is not an integer, out of range or
                repeated, or a block count that does not fit ``num_tokens`` and
                ``cached_blocks`` (nothing is registered).
            ConfigError: the ticket's ``tp_size`` cannot split the model's heads, or a
                producer rank's port (``ticket.port + rank``) is past 65535.

        Across TP sizes (this agent's :attr:`AgentConfig.tp` and the ticket's
        ``tp_size`` differ) this rank registers with every producer rank holding one of
        its heads, and the transfer settles once each of them wrote (kvxfer._agent.tp_push_receive).
        Its consumer ranks must show one capability: give the ticket the router's
        token (``Ticket.for_push(capability=...)``), the same on every rank; without
        one this raises ConfigError naming ``ticket.capability``.
        """
        local = self._local.block_groups(local_blocks)
        tokens = ticket.num_tokens if num_tokens is None else num_tokens
        self._local.check_counts(local, tokens, cached_blocks)
        if not self._side.serving:
            self.serve()  # before the transfer exists: a failure to bind leaves nothing behind
        return self._receiver.expect(ticket, local, tokens)

    # -- progress -------------------------------------------------------------------
    def progress(self) -> None:
        """Drive notifications, completions, leases and deadlines once (non-blocking)."""
        self._runtime.tick()

    def stats(self) -> AgentStats:
        """A copy of the agent's counters."""
        with self._lock:
            return self.stats_counters.copy()

    def close(self) -> None:
        """Stop serving, fail what is in flight, release every handle; idempotent."""
        if not self._runtime.close():  # fails what is in flight, stops the progress thread
            return
        self._push.shutdown()
        self._side.close()  # cancels requests in flight (handshakes, probes) first
        self._io_pool.shutdown()
        self._peers.close()
        self.backend.close()
        self._registrar.drop()  # deregistered: the engine's tensors are its own again

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
