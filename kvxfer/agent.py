"""The Agent: kvxfer's embedding API, one per worker process.

An engine drives everything through an :class:`Agent`::

    agent = Agent(AgentConfig(engine_id="prefill-0", fingerprint=fp))
    agent.register(layout)            # once (or defer=True, then complete_registration())
    agent.serve()                     # side channel up: peers can handshake

    # producer (prefill), when a request's prompt is done:
    ticket = agent.hold("req-1", block_ids, num_tokens)   # lease; goes to the router
    ...
    for request_id in agent.freed(): engine.free_blocks(request_id)

    # consumer (decode), with the ticket the router forwarded:
    transfer = agent.pull(ticket, local_block_ids)
    ... transfer.poll() in the step loop, or transfer.wait() / await transfer

Push is the mirror image: the consumer calls :meth:`Agent.expect_push` with its
receiving blocks; the producer's :meth:`Agent.hold` then writes into them (and
:meth:`Agent.stream` writes blocks early, during prefill, with ``push_stream``).

The data path of a pull: block ids → :func:`kvxfer.descriptors.build_plan` (ids into
prepared descriptor tables) → :meth:`Backend.post` → completion seen by :meth:`poll`
→ engine. Registration and the handshake happen once per process and once per peer.

The class is assembled from three layers: :mod:`kvxfer._agent_runtime` (posting,
settling, the progress loop), :mod:`kvxfer._agent_push` (the push writer) and this
module's public API; the value types live in :mod:`kvxfer._agent_types`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np

from kvxfer import wire
from kvxfer._agent_push import NOTICE_REUSE_S, InlineWrite, PushProducer
from kvxfer._agent_runtime import IDLE_NAP_S
from kvxfer._agent_types import (
    AgentConfig,
    AgentStats,
    BlockIds,
    Lease,
    PushPost,
    Ticket,
    as_groups,
)
from kvxfer._peers import Peer, PeerCache
from kvxfer._serial import SerialWorker
from kvxfer.backend import Backend, BackendOptions, XferOp
from kvxfer.control import SideChannelClient, SideChannelServer
from kvxfer.descriptors import DescriptorTable, build_plan
from kvxfer.errors import (
    ConfigError,
    KvxferError,
    PeerError,
    RegistrationError,
    TransferError,
)
from kvxfer.handshake import Initiator, Responder
from kvxfer.layout import KVLayout
from kvxfer.registry import get_backend
from kvxfer.transfer import FailureKind, Transfer, TransferState
from kvxfer.types import Direction

__all__ = ["Agent", "AgentConfig", "AgentStats", "BlockIds", "PushPost", "Ticket"]

log = logging.getLogger("kvxfer.agent")


class Agent(PushProducer):
    """The embedding API (see the module docstring). Context manager; ``close`` is idempotent."""

    def __init__(self, config: AgentConfig, *, backend: Backend | None = None) -> None:
        self.config = config
        # A fresh random incarnation per process life: a restarted peer on the same
        # address is told apart from its earlier self (R-HS-4).
        self.incarnation = secrets.randbits(63)
        self.agent_name = f"{config.engine_id}#{self.incarnation:016x}"
        self.compat_hash = config.fingerprint.digest()
        self._auth_key = config.auth_secret.encode() if config.auth_secret else None
        self._lock = threading.RLock()
        if backend is None:
            cls = get_backend(config.backend)
            backend = cls(
                BackendOptions(
                    agent_name=self.agent_name,
                    rails=config.rails,
                    stripe_width=config.stripe_width,
                    extra=dict(config.backend_extra),
                )
            )
        self.backend = backend
        caps = backend.capabilities
        needs_d2d = config.plan.chunk_mode or config.plan.swa_window_mode or config.push_stream
        if needs_d2d and not caps.device_to_device:
            raise ConfigError(
                "backend",
                config.backend,
                "chunk_mode, swa_window_mode and push_stream need a device-to-device backend",
            )
        self._log_prefix = "RBLN NIXL (D2D): " if caps.device_to_device else "kvxfer: "
        self._stages = caps.stages_through_host  # stage_out / stage_in do something
        self.layout: KVLayout | None = None  # as the engine described it
        self.exposed_layout: KVLayout | None = None  # as peers address it
        self.table: DescriptorTable | None = None
        self._deferred: KVLayout | None = None
        self._server: SideChannelServer | None = None
        self._client = SideChannelClient(
            timeout_s=config.handshake_timeout_s,
            retries=config.handshake_retries,
            max_bytes=max(config.max_message_bytes, 1 << 16) * 4,
        )
        self._peers = PeerCache(self)
        self._leases: dict[str, Lease] = {}
        self._freed: list[str] = []
        self._transfers: dict[int, Transfer] = {}
        self._expected_push: dict[str, Transfer] = {}
        # Final PUSHED notices announced in the producers' registration replies, already
        # checked, by their exact bytes (see _learn_final_notice).
        self._final_notices: dict[bytes, tuple[wire.Notice, float]] = {}
        self.stats_counters = AgentStats()
        self._closed = False
        self._wake = threading.Event()
        self._idle_nap = True  # the progress thread sleeps its long idle interval
        self._nap_s = IDLE_NAP_S
        self._thread: threading.Thread | None = None
        self._pusher = SerialWorker("kvxfer-push")
        self._last_tick = 0.0  # monotonic time of the latest tick, by any thread
        self._io_pool: ThreadPoolExecutor | None = None
        # Settlements (DONE / ABORT notices, Release messages) that arrived before the
        # engine's hold() of that request: kept briefly so the hold frees at once.
        self._early: dict[str, float] = {}

    # -- registration ---------------------------------------------------------------
    def register(self, layout: KVLayout, *, defer: bool = False) -> None:
        """Register the KV cache memory described by ``layout`` (R-REG-1, R-REG-2).

        With ``defer=True`` only the layout is kept; call :meth:`complete_registration`
        once the engine's warm-up is over (device memory may move before that).
        """
        with self._lock:
            if self.layout is not None or self._deferred is not None:
                raise RegistrationError("this agent already has a registered layout")
            if defer:
                self._deferred = layout
                log.info("%sdeferring registration until the engine is warmed up", self._log_prefix)
                return
            self._register_now(layout)

    def complete_registration(self) -> None:
        """Finish a deferred registration (no-op when nothing is deferred)."""
        with self._lock:
            if self._deferred is not None:
                layout, self._deferred = self._deferred, None
                self._register_now(layout)

    def _register_now(self, layout: KVLayout) -> None:
        exposed = self.backend.register(layout)
        table = DescriptorTable.build(exposed, self.config.plan)
        self.backend.prepare_local(table)
        self.layout, self.exposed_layout, self.table = layout, exposed, table
        shards = len({(r.device_id, r.shard) for r in exposed.regions})
        log.info(
            "%sregistered %d regions / %d shards, %d descriptors, %d blocks of %d tokens",
            self._log_prefix,
            len(exposed.regions),
            shards,
            len(table.addr),
            exposed.num_blocks,
            exposed.block_size,
        )

    @property
    def registered(self) -> bool:
        """True once memory is registered (not merely deferred)."""
        return self.table is not None

    # -- side channel ---------------------------------------------------------------
    def serve(self) -> tuple[str, int]:
        """Start answering handshakes; returns the advertised ``(host, port)``."""
        with self._lock:
            if self._server is None:
                responder = self._make_responder()
                self._server = SideChannelServer(
                    self.config.side_channel_host,
                    self.config.side_channel_port,
                    responder.respond,
                    max_bytes=self.config.max_message_bytes,
                    oversize_reply=responder.too_large,
                )
            self._ensure_thread()
            return self.config.side_channel_host, self._server.port

    @property
    def address(self) -> tuple[str, int]:
        """The advertised side-channel address (after :meth:`serve`)."""
        if self._server is None:
            raise PeerError("the agent is not serving; call serve() first")
        return self.config.side_channel_host, self._server.port

    def _make_responder(self) -> Responder:
        return Responder(
            engine_id=self.config.engine_id,
            incarnation=self.incarnation,
            compat_hash=self.compat_hash,
            enforce_compat=self.config.enforce_handshake_compat,
            local_info=self._local_info,
            on_message=self._on_control_message,
            auth_secret=self.config.auth_secret,
            max_bytes=self.config.max_message_bytes,
        )

    def _local_info(self) -> wire.Welcome | None:
        """What this agent tells a peer in the handshake (None until registered)."""
        if self.exposed_layout is None:
            return None
        return wire.Welcome(
            engine_id=self.config.engine_id,
            incarnation=self.incarnation,
            layout=self.exposed_layout,
            agent_name=self.backend.agent_name,
            agent_metadata=self.backend.metadata(),
            rails=self.config.rails,
            options=self.config.plan,
            lease_s=self.config.lease_s,
            role=self.config.role,
            direction=self.config.direction,
        )

    def _hello(self, expected_engine_id: str | None) -> wire.Hello:
        if self.exposed_layout is None:
            raise RegistrationError("register memory before connecting to peers")
        return wire.Hello(
            engine_id=self.config.engine_id,
            expected_engine_id=expected_engine_id,
            incarnation=self.incarnation,
            role=self.config.role,
            direction=self.config.direction,
            layout=self.exposed_layout,
            rails=self.config.rails,
        )

    def connect(self, host: str, port: int, expected_engine_id: str | None = None) -> Peer:
        """Handshake with the peer at ``host:port`` (cached; concurrent callers share it)."""
        return self._peers.get(host, port, expected_engine_id, None)

    # -- producer -------------------------------------------------------------------
    def hold(
        self,
        request_id: str,
        block_ids: BlockIds,
        num_tokens: int,
        *,
        lease_s: float | None = None,
        staged: bool = False,
    ) -> Ticket:
        """Hold a finished prompt's blocks for its consumer and return the ticket.

        Pull: the blocks stay untouched until the consumer's completion notice, an
        abort, or the lease's expiry; then the request id appears in :meth:`freed`.
        Push: the blocks are written to the consumer as soon as it registered its
        receiving blocks (at once if it already did: by default on direct backends the
        write is posted here, on the caller's thread, once the consumer is connected;
        see :class:`PushPost`).

        ``staged``: the engine already copied exactly these blocks out with
        ``backend.stage_out`` after their last forward (host bounce), so a pull's hold
        does not copy them again.
        """
        _, layout = self._require_registered()
        groups = as_groups(block_ids, len(layout.groups))
        expiry = time.time() + (self.config.lease_s if lease_s is None else lease_s)
        host, port = self.address if self._server is not None else ("", 0)
        if self._stages and self.config.direction is Direction.PULL and not staged:
            # host bounce: the consumer reads the staging buffers, so fill them first
            # (a push stages each slice as it writes it: Backend.post_engine).
            self.backend.stage_out([np.asarray(g, dtype=np.int64) for g in groups])
        with self._lock:
            if self._early.pop(request_id, None) is not None:
                # The consumer finished (or gave up) before the engine got here.
                self.stats_counters.leases_released += 1
                self._freed.append(request_id)
                return self._ticket(request_id, groups, num_tokens, expiry, host, port)
            lease = self._leases.get(request_id)
            if lease is None:
                lease = Lease(
                    request_id=request_id, blocks=groups, num_tokens=num_tokens, expiry=expiry
                )
                self._leases[request_id] = lease
            else:
                lease.blocks, lease.num_tokens, lease.expiry = groups, num_tokens, expiry
            lease.ready = True
            inline: list[InlineWrite] = []
            if self.config.direction is Direction.PUSH and lease.target is not None:
                self._start_push(lease, inline)
        self._post_inline(inline)  # outside the lock: a post may copy every byte
        if self.config.direction is Direction.PULL:
            # The lease wants the progress thread's faster pace (see _run); a push has
            # nothing to poll until its writer posted, which wakes the thread if needed.
            self._nudge()
        return self._ticket(request_id, groups, num_tokens, expiry, host, port)

    def _ticket(
        self,
        request_id: str,
        groups: tuple[tuple[int, ...], ...],
        num_tokens: int,
        expiry: float,
        host: str,
        port: int,
    ) -> Ticket:
        return Ticket(
            engine_id=self.config.engine_id,
            host=host,
            port=port,
            request_id=request_id,
            block_ids=groups,
            num_tokens=num_tokens,
            incarnation=self.incarnation,
            lease_expiry=expiry,
        )

    def stream(self, request_id: str, block_ids: BlockIds, num_tokens: int) -> None:
        """push_stream: write the blocks prefill has closed so far (R-XFER-3).

        Only whole blocks before ``num_tokens`` go now; :meth:`hold` writes the rest.
        """
        if not self.config.push_stream:
            raise ConfigError("push_stream", False, "stream() needs push_stream enabled")
        _, layout = self._require_registered()
        groups = as_groups(block_ids, len(layout.groups))
        inline: list[InlineWrite] = []
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                lease = Lease(
                    request_id=request_id,
                    blocks=groups,
                    num_tokens=num_tokens,
                    expiry=time.time() + self.config.lease_s,
                )
                self._leases[request_id] = lease
            closed = num_tokens // layout.block_size
            if lease.target is None or closed <= lease.pushed_blocks:
                lease.blocks, lease.num_tokens = groups, num_tokens
                return
            lease.blocks, lease.num_tokens = groups, num_tokens
            self._write(lease, lease.pushed_blocks, closed, final=False, inline=inline)
            lease.pushed_blocks = closed
        self._post_inline(inline)

    def release(self, request_id: str) -> bool:
        """Release a request's blocks at once (abort before or instead of the transfer)."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
            if lease is None:
                return False
            self.stats_counters.leases_aborted += 1
            self._freed.append(request_id)
            return True

    def freed(self) -> list[str]:
        """Request ids whose held blocks the engine may reuse now (drained on read)."""
        self._tick()
        with self._lock:
            out, self._freed = self._freed, []
            return out

    def holding(self) -> list[str]:
        """Request ids currently held under a lease."""
        with self._lock:
            return list(self._leases)

    # -- consumer -------------------------------------------------------------------
    def pull(
        self, ticket: Ticket, local_blocks: BlockIds, *, num_tokens: int | None = None
    ) -> Transfer:
        """Read the ticket's blocks into ``local_blocks`` (R-XFER-1). Never raises for
        transport trouble: a failure is reported on the returned :class:`Transfer`.

        A first contact handshakes on a worker thread; a known peer's read is posted
        here, so a transport that copies inside its post (UCX over CMA on one host)
        has moved the bytes when this returns."""
        _, layout = self._require_registered()
        groups = as_groups(local_blocks, len(layout.groups))
        tokens = ticket.num_tokens if num_tokens is None else num_tokens
        transfer = self._new_transfer(ticket.request_id, groups)
        if ticket.lease_expiry:
            transfer.meta["lease_expiry"] = ticket.lease_expiry
            if self._lease_over(ticket.lease_expiry):
                self._fail(
                    transfer, FailureKind.LEASE_EXPIRED, self._expired_error(ticket.request_id)
                )
                return transfer
        peer = self._peers.cached(
            ticket.host, ticket.port, ticket.engine_id, ticket.incarnation or None
        )
        if peer is not None:
            self._start_pull(transfer, peer, ticket, groups, tokens)
        else:
            # A first contact handshakes on a worker thread: the engine's step loop never
            # waits for a peer (which can take the whole handshake timeout if it is gone).
            self._io().submit(self._connect_and_pull, transfer, ticket, groups, tokens)
        return transfer

    def _connect_and_pull(
        self, transfer: Transfer, ticket: Ticket, groups: tuple[tuple[int, ...], ...], tokens: int
    ) -> None:
        try:
            peer = self._peers.get(
                ticket.host, ticket.port, ticket.engine_id, ticket.incarnation or None
            )
        except KvxferError as exc:
            self._fail(transfer, FailureKind.HANDSHAKE, exc)
            return
        self._start_pull(transfer, peer, ticket, groups, tokens)

    def _start_pull(
        self,
        transfer: Transfer,
        peer: Peer,
        ticket: Ticket,
        groups: tuple[tuple[int, ...], ...],
        tokens: int,
    ) -> None:
        notice = self._encode(
            wire.Notice(
                kind=wire.NoticeKind.DONE,
                request_id=ticket.request_id,
                engine_id=self.config.engine_id,
                incarnation=self.incarnation,
            )
        )
        if transfer.done:  # the agent closed meanwhile
            return
        self._post(transfer, XferOp.READ, peer, groups, ticket.block_ids, tokens, notice)
        if transfer.state is TransferState.FAILED:
            # Nothing was read: let the producer free its blocks now, not at lease expiry.
            self.abort(ticket)

    def _io(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._io_pool is None:
                self._io_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvxfer-io")
            return self._io_pool

    def abort(self, ticket: Ticket, *, wait: bool = False) -> None:
        """Tell the producer to release a request we will not pull (R-XFER-4).

        Non-blocking by default (the message goes from a worker thread); ``wait=True``
        returns only once the producer answered or the side channel gave up.
        """
        if not wait:
            if not self._closed:
                self._io().submit(self._send_release, ticket)
            return
        self._send_release(ticket)

    def _send_release(self, ticket: Ticket) -> None:
        msg = wire.Release(request_id=ticket.request_id, reason="consumer aborted")
        try:
            self._request(ticket.host, ticket.port, msg)
        except KvxferError as exc:
            log.warning(
                "could not tell %s to release %s: %s", ticket.engine_id, ticket.request_id, exc
            )

    def expect_push(
        self, ticket: Ticket, local_blocks: BlockIds, *, num_tokens: int | None = None
    ) -> Transfer:
        """Register receiving blocks with the producer; the returned transfer settles
        once every expected write landed (R-XFER-2)."""
        table, layout = self._require_registered()
        groups = as_groups(local_blocks, len(layout.groups))
        transfer = self._new_transfer(ticket.request_id, groups)
        tokens = ticket.num_tokens if num_tokens is None else num_tokens
        # The bytes the producer will write are the bytes our own plan of these blocks
        # covers (both sides share the layout shape); computed here for the stats.
        try:
            own = [np.asarray(g, dtype=np.int64) for g in groups]
            plan = build_plan(table, table, own, own, tokens)
            transfer.stats.bytes, transfer.stats.descriptors = plan.nbytes, plan.num_descriptors
        except KvxferError as exc:
            self._fail(transfer, FailureKind.POST, exc)
            return transfer
        with self._lock:
            self._expected_push[ticket.request_id] = transfer
        host, port = self.address
        msg = wire.PushRegister(
            request_id=ticket.request_id,
            engine_id=self.config.engine_id,
            incarnation=self.incarnation,
            block_ids=groups,
            num_tokens=tokens,
            agent_name=self.backend.agent_name,
            host=host,
            port=port,
        )
        # The registration is a side-channel round trip (a timeout when the producer is
        # gone): it goes from a worker thread, and a failure lands on the transfer.
        self._io().submit(self._send_push_register, ticket, msg, transfer)
        # Awaiting notices now: out of its idle nap, the progress thread polls them at
        # the in-flight pace (or, if a thread waits on this transfer, leaves that to it).
        self._nudge()
        return transfer

    def _send_push_register(
        self, ticket: Ticket, msg: wire.PushRegister, transfer: Transfer
    ) -> None:
        try:
            reply = self._request(ticket.host, ticket.port, msg)
        except KvxferError as exc:
            with self._lock:
                self._expected_push.pop(ticket.request_id, None)
            self._fail(transfer, FailureKind.HANDSHAKE, exc)
            return
        if isinstance(reply, wire.Ack) and reply.notice:
            self._learn_final_notice(transfer, reply.notice)

    def _learn_final_notice(self, transfer: Transfer, data: bytes) -> None:
        """Remember the final PUSHED notice a producer announced for ``transfer``.

        It is checked here as if it had arrived (decoded, its MAC verified), and must be
        the one notice that settles the transfer alone: final, for this request, naming
        every expected block. When it arrives, :meth:`_handle_notifications` knows it by
        its bytes. A notice that does not qualify is ignored: the real one is then
        decoded and checked on arrival, as any other.
        """
        try:
            notice = wire.decode_notice(
                data, max_bytes=self.config.max_message_bytes, auth_key=self._auth_key
            )
        except KvxferError as exc:
            log.debug("producer's announced notice for %s not used: %s", transfer.request_id, exc)
            return
        if not (
            notice.kind is wire.NoticeKind.PUSHED
            and notice.final
            and notice.request_id == transfer.request_id
            and notice.block_ids == transfer.local_blocks
        ):
            return
        with self._lock:
            # Arrived (or failed) meanwhile: nothing left to recognise.
            if transfer.done or self._expected_push.get(transfer.request_id) is not transfer:
                return
            # A producer sends the announced bytes only this long after encoding them
            # (later it signs a fresh notice), so later they are not recognised either.
            self._final_notices[data] = (notice, time.monotonic() + NOTICE_REUSE_S)
            transfer.meta["notice_bytes"] = data

    def _request(self, host: str, port: int, msg: wire.Message) -> wire.Message:
        """Send a control message; return the (authenticated) reply or raise the rejection."""
        initiator = Initiator(
            hello=self._hello(None),
            compat_hash=self.compat_hash,
            enforce_compat=self.config.enforce_handshake_compat,
            auth_secret=self.config.auth_secret,
            address=f"{host}:{port}",
            max_bytes=self.config.max_message_bytes * 4,
        )
        return initiator.reply(self._client.request(host, port, initiator.request(msg)))

    # -- progress -------------------------------------------------------------------
    def progress(self) -> None:
        """Drive notifications, completions, leases and deadlines once (non-blocking)."""
        self._tick()

    def stats(self) -> AgentStats:
        """A copy of the agent's counters."""
        with self._lock:
            return msgspec.structs.replace(
                self.stats_counters, failures=dict(self.stats_counters.failures)
            )

    def close(self) -> None:
        """Stop serving, fail what is in flight, release every handle; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for t in list(self._transfers.values()):
                self._fail(t, FailureKind.ABORTED, TransferError("agent closed"))
        self._wake.set()
        self._pusher.shutdown()
        if self._io_pool is not None:
            self._io_pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._server is not None:
            self._server.close()
        self._peers.close()
        self.backend.close()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- side-channel messages ------------------------------------------------------------
    def _on_control_message(self, msg: Any) -> Any:
        """Side-channel messages other than the handshake (runs on the server thread)."""
        if isinstance(msg, wire.Release):
            released = self.release(msg.request_id)
            if not released:
                with self._lock:
                    self._early[msg.request_id] = time.monotonic()
            log.info("peer asked to release %s (%s): %s", msg.request_id, msg.reason, released)
            return wire.Ack(request_id=msg.request_id)
        if isinstance(msg, wire.PushRegister):
            return self._on_push_register(msg)
        return None
