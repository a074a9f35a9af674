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
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvxfer import wire
from kvxfer._peers import Peer, PeerCache
from kvxfer._serial import SerialWorker
from kvxfer.backend import Backend, BackendOptions, XferOp, XferStatus
from kvxfer.compat import Fingerprint
from kvxfer.config import Direction, Role
from kvxfer.control import SideChannelClient, SideChannelServer
from kvxfer.descriptors import DescriptorTable, PlanOptions, build_plan
from kvxfer.errors import (
    BackendError,
    ConfigError,
    KvxferError,
    PeerError,
    RegistrationError,
    TransferError,
    TransferTimeout,
)
from kvxfer.handshake import Initiator, Responder
from kvxfer.layout import KVLayout
from kvxfer.registry import get_backend
from kvxfer.transfer import FailureKind, Transfer, TransferState

__all__ = ["Agent", "AgentConfig", "AgentStats", "Ticket"]

log = logging.getLogger("kvxfer.agent")

# How long a settlement that arrived before its hold() is remembered.
_EARLY_KEEP_S = 120.0
# Progress interval while leases are held and nothing is in flight (see _run).
_LEASE_TICK_S = 0.001
#: A signed notice encoded ahead is used only this long after (the receiver refuses
#: notices whose timestamp is far from its clock).
_NOTICE_REUSE_S = 60.0

BlockIds = Sequence[int] | npt.NDArray[np.integer[Any]] | Sequence[Sequence[int]]


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything an :class:`Agent` needs; build it directly or from a vLLM config.

    Attributes:
        engine_id: This instance's id; consumers check it against the one they expect.
        fingerprint: Model/dtype/backend identity folded into the compatibility hash.
        role: Producer, consumer or both.
        direction: Pull (consumer reads) or push (producer writes).
        backend: Backend name from the ``kvxfer.backends`` registry.
        side_channel_host: Address peers reach this instance at (must be routable).
        side_channel_port: Side-channel TCP port; 0 picks a free one.
        plan: Descriptor options (chunk_mode, swa_window_mode, coalescing).
        push_stream: Push blocks as prefill closes them (push + device-to-device only).
        enforce_handshake_compat: False skips the hash check (never the layout check).
        lease_s: How long a producer holds a request's blocks for its consumer.
        handshake_timeout_s: One side-channel try's receive timeout.
        handshake_retries: Further tries after a timeout (with backoff).
        transfer_timeout_s: A transfer not complete by then fails.
        max_message_bytes: Largest side-channel frame accepted.
        auth_secret: Shared secret authenticating the side channel (None: off, warned).
        rails: RDMA devices the data plane may use; stripe_width: see R-RAIL-3.
        backend_extra: Backend-specific options (``BackendOptions.extra``), e.g.
            ``{"rbln_adapter": "emulated"}`` or ``{"transport": "ucx"}``.
        lease_guard_s: A consumer refuses (or invalidates) a pull this close to the
            producer's lease expiry: clock skew between hosts must stay below it.
        progress_interval_s: Sleep of the progress thread while transfers are in flight.
    """

    engine_id: str
    fingerprint: Fingerprint
    role: Role = Role.BOTH
    direction: Direction = Direction.PULL
    backend: str = "ucx"
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    plan: PlanOptions = msgspec.field(default_factory=PlanOptions)
    push_stream: bool = False
    enforce_handshake_compat: bool = True
    lease_s: float = 30.0
    handshake_timeout_s: float = 5.0
    handshake_retries: int = 2
    transfer_timeout_s: float = 30.0
    max_message_bytes: int = 1 << 20
    auth_secret: str | None = None
    rails: tuple[str, ...] = ()
    stripe_width: int | None = None
    progress_interval_s: float = 0.0002
    lease_guard_s: float = 0.5
    backend_extra: dict[str, str] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ConfigError("engine_id", self.engine_id, "must be a non-empty string")
        for key in ("lease_s", "handshake_timeout_s", "transfer_timeout_s"):
            value = getattr(self, key)
            if not value > 0:
                raise ConfigError(key, value, "must be a positive number of seconds")
        if not 0 <= self.side_channel_port <= 65535:
            raise ConfigError("side_channel_port", self.side_channel_port, "must be 0..65535")
        if self.push_stream and self.direction is not Direction.PUSH:
            raise ConfigError("push_stream", True, "only valid with the push direction")


class Ticket(msgspec.Struct, frozen=True, kw_only=True):
    """What a producer hands the router for the consumer: where and what to fetch.

    Maps one-to-one onto upstream vLLM's ``kv_transfer_params`` keys (so existing
    routers forward it untouched) plus kvxfer's own ``remote_incarnation``,
    ``remote_num_tokens`` and ``lease_expiry``.
    """

    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    incarnation: int = 0
    lease_expiry: float = 0.0
    tp_size: int = 1

    def to_kv_transfer_params(self) -> dict[str, Any]:
        """The upstream ``kv_transfer_params`` dict (decode side of a pull)."""
        blocks: Any = (
            list(self.block_ids[0])
            if len(self.block_ids) == 1
            else [list(g) for g in self.block_ids]
        )
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": self.request_id,
            "remote_block_ids": blocks,
            "tp_size": self.tp_size,
            "remote_incarnation": self.incarnation,
            "remote_num_tokens": self.num_tokens,
            "lease_expiry": self.lease_expiry,
        }

    @classmethod
    def from_kv_transfer_params(cls, params: dict[str, Any], num_tokens: int = 0) -> Ticket:
        """Read a ticket back from ``kv_transfer_params``; missing keys raise ConfigError."""
        for key in ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids"):
            if key not in params or params[key] is None:
                raise ConfigError(
                    f"kv_transfer_params.{key}", None, "is required for a remote prefill"
                )
        raw = params["remote_block_ids"]
        groups = (
            tuple(tuple(int(b) for b in g) for g in raw)
            if raw and isinstance(raw[0], (list, tuple))
            else (tuple(int(b) for b in raw),)
        )
        return cls(
            engine_id=str(params["remote_engine_id"]),
            host=str(params["remote_host"]),
            port=int(params["remote_port"]),
            request_id=str(params.get("remote_request_id") or ""),
            block_ids=groups,
            num_tokens=int(params.get("remote_num_tokens") or num_tokens),
            incarnation=int(params.get("remote_incarnation") or 0),
            lease_expiry=float(params.get("lease_expiry") or 0.0),
            tp_size=int(params.get("tp_size") or 1),
        )


class AgentStats(msgspec.Struct, kw_only=True):
    """Counters an engine exports as metrics (monotonic since start)."""

    transfers_done: int = 0
    transfers_failed: int = 0
    bytes_moved: int = 0
    descriptors_posted: int = 0
    transfer_s_total: float = 0.0
    post_s_total: float = 0.0
    handshakes: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    leases_aborted: int = 0
    failures: dict[str, int] = msgspec.field(default_factory=dict)


class _Lease(msgspec.Struct, kw_only=True):
    """A producer's hold on a request's blocks (R-XFER-4)."""

    request_id: str
    blocks: tuple[tuple[int, ...], ...]
    num_tokens: int
    expiry: float
    # push: where to write, once the consumer registered its blocks
    target: wire.PushRegister | None = None
    ready: bool = False  # prefill finished (hold() called), for push
    pushed_blocks: int = 0  # push_stream: leading blocks already written
    parts_posted: int = 0
    final_posted: bool = False
    writes: list[Transfer] = msgspec.field(default_factory=list)
    final_notice: tuple[float, bytes] | None = None  # push: encoded at registration


def _as_groups(blocks: BlockIds, num_groups: int) -> tuple[tuple[int, ...], ...]:
    """Normalise block ids to one tuple per KV group (one flat list serves every group)."""
    arr = blocks if isinstance(blocks, np.ndarray) else None
    if arr is None:
        seq: list[Any] = list(blocks)
        if seq and isinstance(seq[0], list | tuple | np.ndarray):
            groups = tuple(tuple(int(b) for b in g) for g in seq)
            if len(groups) != num_groups:
                raise ConfigError(
                    "block_ids", len(groups), f"needs one block list per KV group ({num_groups})"
                )
            return groups
        arr = np.asarray(seq, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ConfigError("block_ids", str(arr.dtype), "must be integer block ids")
    # tolist() converts in C: a generator over numpy scalars costs ~1 µs per block.
    if arr.ndim == 2:
        return tuple(tuple(row) for row in arr.tolist())
    one = tuple(arr.tolist())
    return (one,) * num_groups


def _id_arrays(groups: tuple[tuple[int, ...], ...]) -> npt.NDArray[np.int64] | list[Any]:
    """Block ids as build_plan takes them fastest: one int64 array for one group."""
    if len(groups) == 1:
        return np.array(groups[0], dtype=np.int64)
    first = groups[0]
    if all(g == first for g in groups):
        # One list for every group (as engines pass it): one array, shared, which
        # build_plan turns into ids for all groups with a single broadcast.
        return [np.array(first, dtype=np.int64)] * len(groups)
    return [np.array(g, dtype=np.int64) for g in groups]


def _describe_blocks(blocks: tuple[int, ...]) -> str:
    """A log-sized summary of a block list."""
    if len(blocks) <= 8:
        return f"invalid blocks: {list(blocks)}"
    return f"{len(blocks)} invalid blocks: {list(blocks[:4])} ... {list(blocks[-2:])}"


class Agent:
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
        self._leases: dict[str, _Lease] = {}
        self._freed: list[str] = []
        self._transfers: dict[int, Transfer] = {}
        self._expected_push: dict[str, Transfer] = {}
        self.stats_counters = AgentStats()
        self._closed = False
        self._wake = threading.Event()
        self._idle_nap = True  # the progress thread sleeps its long idle interval
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
        receiving blocks (at once if it already did).

        ``staged``: the engine already copied exactly these blocks out with
        ``backend.stage_out`` after their last forward (host bounce), so a pull's hold
        does not copy them again.
        """
        _, layout = self._require_registered()
        groups = _as_groups(block_ids, len(layout.groups))
        expiry = time.time() + (self.config.lease_s if lease_s is None else lease_s)
        host, port = self.address if self._server is not None else ("", 0)
        if self.config.direction is Direction.PULL and not staged:
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
                lease = _Lease(
                    request_id=request_id, blocks=groups, num_tokens=num_tokens, expiry=expiry
                )
                self._leases[request_id] = lease
            else:
                lease.blocks, lease.num_tokens, lease.expiry = groups, num_tokens, expiry
            lease.ready = True
            if self.config.direction is Direction.PUSH and lease.target is not None:
                self._start_push(lease)
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
        groups = _as_groups(block_ids, len(layout.groups))
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                lease = _Lease(
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
            self._write(lease, lease.pushed_blocks, closed, final=False)
            lease.pushed_blocks = closed

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
        transport trouble: a failure is reported on the returned :class:`Transfer`."""
        _, layout = self._require_registered()
        groups = _as_groups(local_blocks, len(layout.groups))
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

    def _lease_over(self, expiry: float) -> bool:
        # One-sided reads cannot be refused by the producer, so the consumer enforces the
        # lease itself, with a guard for clock skew between the two hosts.
        return time.time() > expiry - self.config.lease_guard_s

    @staticmethod
    def _expired_error(request_id: str) -> TransferError:
        return TransferError(
            f"the producer's lease on {request_id} ran out before its blocks were read; "
            "they may have been reused (raise lease_s, or pull sooner)"
        )

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
        groups = _as_groups(local_blocks, len(layout.groups))
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
        return transfer

    def _send_push_register(
        self, ticket: Ticket, msg: wire.PushRegister, transfer: Transfer
    ) -> None:
        try:
            self._request(ticket.host, ticket.port, msg)
        except KvxferError as exc:
            with self._lock:
                self._expected_push.pop(ticket.request_id, None)
            self._fail(transfer, FailureKind.HANDSHAKE, exc)

    def _encode(self, msg: wire.Message) -> bytes:
        return wire.encode(msg, self.compat_hash, auth_key=self._auth_key)

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

    # -- internals --------------------------------------------------------------------
    def _require_registered(self) -> tuple[DescriptorTable, KVLayout]:
        if self.table is None or self.exposed_layout is None:
            state = "deferred" if self._deferred is not None else "missing"
            raise RegistrationError(f"KV memory registration is {state}; register() first")
        return self.table, self.exposed_layout

    def _new_transfer(self, request_id: str, groups: tuple[tuple[int, ...], ...]) -> Transfer:
        t = Transfer(
            request_id,
            groups,
            progress=self._tick,
            deadline=time.monotonic() + self.config.transfer_timeout_s,
        )
        with self._lock:
            self._transfers[id(t)] = t
        self._ensure_thread()
        return t

    def _post(
        self,
        transfer: Transfer,
        op: XferOp,
        peer: Peer,
        local: tuple[tuple[int, ...], ...],
        remote: tuple[tuple[int, ...], ...],
        num_tokens: int,
        notification: bytes | Callable[[int], bytes],
    ) -> None:
        """Plan and post one transfer. Called without the agent lock: with UCX over CMA
        (and the host bounce's staging copies) a post moves bytes before it returns, and
        the lock held that long would stall the engine's hold(), pull() and freed()."""
        table, _ = self._require_registered()
        t0 = time.perf_counter()
        try:
            plan = build_plan(table, peer.table, _id_arrays(local), _id_arrays(remote), num_tokens)
        except KvxferError as exc:
            self._fail(transfer, FailureKind.POST, exc)
            return
        t1 = time.perf_counter()
        transfer.stats.plan_s = t1 - t0
        transfer.stats.bytes = plan.nbytes
        transfer.stats.descriptors = plan.num_descriptors
        notif = notification(plan.nbytes) if callable(notification) else notification
        try:
            handle = self.backend.post_engine(
                op, peer.handle, plan.local_ids, plan.remote_ids, notif
            )
        except KvxferError as exc:
            self._peers.mark_suspect(peer)
            kind = FailureKind.PEER_GONE if isinstance(exc, PeerError) else FailureKind.POST
            self._fail(transfer, kind, exc)
            return
        transfer.stats.post_s = time.perf_counter() - t1
        with self._lock:
            if transfer.done:  # failed meanwhile (agent closed, deadline passed)
                self.backend.release(handle)
                return
            transfer.meta["peer"] = peer
            transfer.meta["handle"] = handle
        if self.backend.status(handle) is XferStatus.DONE:
            # Moved inside post (UCX over CMA copies synchronously): settle now rather
            # than hand the completion to the progress thread (a GIL hand-off per pull).
            self._landed(transfer)
            return
        self._nudge()

    def _fail(self, transfer: Transfer, kind: FailureKind, error: BaseException) -> None:
        transfer.stats.failure = kind
        err = error if isinstance(error, KvxferError) else BackendError(str(error))
        if kind is FailureKind.TIMEOUT and not isinstance(err, TransferTimeout):
            err = TransferTimeout(str(err))
        if transfer._settle(TransferState.FAILED, err):
            with self._lock:
                self._transfers.pop(id(transfer), None)
                self.stats_counters.transfers_failed += 1
                self.stats_counters.failures[kind.value] = (
                    self.stats_counters.failures.get(kind.value, 0) + 1
                )
            handle = transfer.meta.pop("handle", None)
            if handle is not None:
                self.backend.release(handle)
            with self._lock:
                self._settle_lease_write(transfer, ok=False)
            log.warning(
                "transfer %s failed (%s): %s; %s",
                transfer.request_id,
                kind.value,
                err,
                _describe_blocks(transfer.invalid_blocks),
            )

    def _landed(self, t: Transfer) -> None:
        """The backend reports every byte of ``t`` moved: settle it."""
        expiry = t.meta.get("lease_expiry")
        if expiry is not None and self._lease_over(expiry):
            # Landed after the producer was free to reuse the blocks:
            # the bytes may be another request's, so they are not valid.
            self._fail(t, FailureKind.LEASE_EXPIRED, self._expired_error(t.request_id))
        else:
            self._succeed(t)

    def _succeed(self, transfer: Transfer) -> None:
        if transfer.meta.get("stage_in"):
            self.backend.stage_in([np.asarray(g, dtype=np.int64) for g in transfer.local_blocks])
        if transfer._settle(TransferState.DONE):
            with self._lock:
                self._transfers.pop(id(transfer), None)
                c = self.stats_counters
                c.transfers_done += 1
                c.bytes_moved += transfer.stats.bytes
                c.descriptors_posted += transfer.stats.descriptors
                c.transfer_s_total += transfer.stats.transfer_s
                c.post_s_total += transfer.stats.post_s
            handle = transfer.meta.pop("handle", None)
            if handle is not None:
                self.backend.release(handle)
            with self._lock:
                self._settle_lease_write(transfer, ok=True)

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._run, name="kvxfer-progress", daemon=True
                )
                self._thread.start()

    def _nudge(self) -> None:
        """Wake the progress thread only from its long idle sleep: waking it costs a GIL
        hand-off (a few hundred µs on a busy host) on every hold and pull, and from the
        short sleeps it comes back within a millisecond anyway."""
        if self._idle_nap:
            self._wake.set()

    def _run(self) -> None:
        # Sleeps between ticks: short while anything is in flight, long when idle, so
        # an idle agent costs nothing (NIXL's own progress thread would spin a core).
        interval, woken = 0.0, True
        while not self._closed:
            # Skip a round that was not asked for when another thread (a waiter in
            # Transfer.wait, the engine's freed()) ticked within it: it would add only
            # lock and GIL traffic, which on a small host delays that very thread.
            if woken or time.monotonic() - self._last_tick >= interval:
                try:
                    self._tick()
                except Exception:  # never let the progress thread die silently
                    log.exception("kvxfer progress thread")
            self._idle_nap = True  # before reading the state: see _nudge
            if self._transfers:
                interval = self.config.progress_interval_s
            elif self._leases:
                # Held blocks may be being read: NIXL completes a consumer's READ only
                # after this side's worker progressed, so the 50 ms idle sleep used to
                # add up to 50 ms to a pull. A tick costs a few µs.
                interval = _LEASE_TICK_S
            else:
                interval = 0.05
            self._idle_nap = interval == 0.05
            woken = self._wake.wait(interval)
            self._wake.clear()

    def _tick(self) -> None:
        """One round of progress, from any thread. The agent lock covers bookkeeping
        only: backend calls (which wait for the backend's own lock while another thread
        posts) and staging copies run outside it, so a long post never stalls the
        engine's calls."""
        if self._closed:
            return
        self._last_tick = time.monotonic()
        notes = self.backend.drain_notifications()
        with self._lock:
            complete = self._handle_notifications(notes) if notes else []
            polled = [(t, t.meta.get("handle")) for t in self._transfers.values()]
        for t in complete:
            self._succeed(t)
        now = time.monotonic()
        for t, handle in polled:
            if t.done:
                continue
            if handle is not None:
                state = self.backend.status(handle)
                if state is XferStatus.DONE:
                    self._landed(t)
                    continue
                if state is XferStatus.FAILED:
                    peer = t.meta.get("peer")
                    if peer is not None:
                        self._peers.mark_suspect(peer)
                    self._fail(
                        t, FailureKind.TRANSPORT, TransferError("the transport reported an error")
                    )
                    continue
            if now > t.deadline:
                self._fail(
                    t,
                    FailureKind.TIMEOUT,
                    TransferTimeout(
                        f"transfer {t.request_id} not complete after "
                        f"{self.config.transfer_timeout_s:g}s"
                    ),
                )
        if self._early or self._leases:
            self._tick_leases(now)

    def _tick_leases(self, now: float) -> None:
        now_wall = time.time()
        with self._lock:
            if self._early:
                horizon = now - _EARLY_KEEP_S
                for rid in [r for r, t in self._early.items() if t < horizon]:
                    del self._early[rid]
            for rid, lease in list(self._leases.items()):
                writing = any(w.state is TransferState.PENDING for w in lease.writes)
                if lease.expiry < now_wall and not writing:
                    del self._leases[rid]
                    self.stats_counters.leases_expired += 1
                    self._freed.append(rid)
                    log.warning("lease of request %s expired; blocks released", rid)
                elif lease.target is not None and lease.ready and not lease.final_posted:
                    self._start_push(lease)

    # notifications & control messages --------------------------------------------------
    def _handle_notifications(self, notes: list[tuple[str, bytes]]) -> list[Transfer]:
        """Act on drained notices (under the lock); returns the push receptions that are
        now complete, for the caller to settle outside the lock (stage-in copies)."""
        complete: list[Transfer] = []
        for sender, payload in notes:
            try:
                # With a shared secret a notice must be signed by it: a DONE frees held
                # blocks and a PUSHED settles a transfer, so neither may be forged.
                notice = wire.decode_notice(
                    payload, max_bytes=self.config.max_message_bytes, auth_key=self._auth_key
                )
            except KvxferError as exc:
                log.warning("ignored a notification from %s: %s", sender, exc)
                continue
            if notice.kind in (wire.NoticeKind.DONE, wire.NoticeKind.ABORT, wire.NoticeKind.FAILED):
                lease = self._leases.pop(notice.request_id, None)
                if lease is not None:
                    self.stats_counters.leases_released += 1
                    self._freed.append(notice.request_id)
                elif (
                    notice.kind is not wire.NoticeKind.FAILED
                    and self.config.role is not Role.CONSUMER
                ):
                    self._early[notice.request_id] = time.monotonic()
                expected = self._expected_push.pop(notice.request_id, None)
                if expected is not None and notice.kind is wire.NoticeKind.FAILED:
                    self._fail(
                        expected,
                        FailureKind.PEER_GONE,
                        TransferError(f"producer {notice.engine_id} reported a failed write"),
                    )
            elif notice.kind is wire.NoticeKind.PUSHED:
                t = self._on_pushed(notice)
                if t is not None:
                    complete.append(t)
        return complete

    def _on_pushed(self, notice: wire.Notice) -> Transfer | None:
        """Record one PUSHED notice; returns the transfer once every write landed."""
        t = self._expected_push.get(notice.request_id)
        if t is None:
            log.warning("write notice for unknown request %s", notice.request_id)
            return None
        # Settle only when the final notice arrived and the writes announced so far
        # cover every expected block of every group: no gaps (R-XFER-2).
        covered: list[set[int]] = t.meta.setdefault("covered", [set() for _ in t.local_blocks])
        for group, blocks in zip(covered, notice.block_ids):
            group.update(blocks)
        if notice.final:
            t.meta["final"] = True
        complete = all(set(want) <= got for want, got in zip(t.local_blocks, covered))
        if t.meta.get("final") and complete:
            # every write of the request has landed: no gaps (R-XFER-2)
            self._expected_push.pop(notice.request_id, None)
            t.meta["stage_in"] = True
            return t
        return None

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
            if self.config.direction is not Direction.PUSH:
                return wire.Reject(
                    code=wire.RejectCode.UNKNOWN_REQUEST, reason="this instance does not push"
                )
            with self._lock:
                lease = self._leases.get(msg.request_id)
                if lease is None:
                    lease = _Lease(
                        request_id=msg.request_id,
                        blocks=(),
                        num_tokens=msg.num_tokens,
                        expiry=time.time() + self.config.lease_s,
                    )
                    self._leases[msg.request_id] = lease
                lease.target = msg
            final = wire.Notice(
                kind=wire.NoticeKind.PUSHED,
                request_id=msg.request_id,
                engine_id=self.config.engine_id,
                incarnation=self.incarnation,
                block_ids=msg.block_ids,
            )
            encoded = (time.monotonic(), self._encode(final))
            with self._lock:
                if lease.target is msg:
                    lease.final_notice = encoded
            self._wake.set()
            return wire.Ack()
        return None

    # push (producer side) ---------------------------------------------------------------
    def _start_push(self, lease: _Lease) -> None:
        """Write what is left of a ready lease to the consumer that registered for it."""
        if lease.target is None or not lease.ready or lease.final_posted:
            return
        total = max((len(g) for g in lease.blocks), default=0)
        self._write(lease, lease.pushed_blocks, total, final=True)

    def _write(self, lease: _Lease, start: int, stop: int, *, final: bool) -> None:
        """Queue one WRITE of blocks ``[start, stop)`` of a lease (R-XFER-2/3).

        Called under the agent lock; the handshake with the consumer (which can take a
        timeout when it is gone) runs on the push worker, never under the lock. One
        worker keeps a request's writes in order. Each write's notice names the blocks
        it covers, and the last one says it is final, so the consumer settles only
        when no block is missing.
        """
        target = lease.target
        assert target is not None and self.exposed_layout is not None
        block_size = self.exposed_layout.block_size
        lease.parts_posted += 1
        if final:
            lease.final_posted = True
        # A consumer whose leading blocks are local prefix-cache hits registers only the
        # request's last blocks: skip as many of ours (per group) and write the suffix.
        offsets = [max(0, len(g) - len(t)) for g, t in zip(lease.blocks, target.block_ids)]
        local = tuple(g[max(start, o) : stop] for g, o in zip(lease.blocks, offsets))
        remote = tuple(t[max(start, o) - o : stop - o] for t, o in zip(target.block_ids, offsets))
        first = max(start, offsets[0]) if offsets else start
        transfer = self._new_transfer(lease.request_id, local)
        lease.writes.append(transfer)
        transfer.meta["lease"] = lease.request_id
        # Tokens inside the written slice: whole blocks, except the request's tail.
        tokens = lease.num_tokens - first * block_size if final else (stop - first) * block_size
        early, lease.final_notice = (lease.final_notice if final else None), None
        self._pusher.submit(
            self._post_write, transfer, target, local, remote, max(tokens, 0), final, early
        )

    def _post_write(
        self,
        transfer: Transfer,
        target: wire.PushRegister,
        local: tuple[tuple[int, ...], ...],
        remote: tuple[tuple[int, ...], ...],
        tokens: int,
        final: bool,
        early: tuple[float, bytes] | None = None,
    ) -> None:
        try:
            peer = self._peers.get(target.host, target.port, target.engine_id, target.incarnation)
        except KvxferError as exc:
            self._fail(transfer, FailureKind.HANDSHAKE, exc)
            return
        transfer.meta["push_peer"] = peer
        notice = self._pushed_notice(target, remote, final, early)
        if transfer.done:  # failed meanwhile (agent closing, lease gone)
            return
        if not any(local):
            # Everything was streamed already: only the final notice is left to send.
            try:
                self.backend.notify(peer.handle, notice)
            except KvxferError as exc:
                self._fail(transfer, FailureKind.PEER_GONE, exc)
                return
            self._succeed(transfer)
            return
        self._post(transfer, XferOp.WRITE, peer, local, remote, tokens, notice)

    def _pushed_notice(
        self,
        target: wire.PushRegister,
        remote: tuple[tuple[int, ...], ...],
        final: bool,
        early: tuple[float, bytes] | None,
    ) -> bytes:
        """The PUSHED notice of one write. The common one, a single final write of every
        block the consumer registered, was encoded when the registration arrived (off
        the write's path); signed ones only while their timestamp is fresh."""
        if (
            early is not None
            and final
            and remote == target.block_ids
            and (self._auth_key is None or time.monotonic() - early[0] < _NOTICE_REUSE_S)
        ):
            return early[1]
        return self._encode(
            wire.Notice(
                kind=wire.NoticeKind.PUSHED,
                request_id=target.request_id,
                engine_id=self.config.engine_id,
                incarnation=self.incarnation,
                block_ids=remote,
                final=final,
            )
        )

    def _settle_lease_write(self, transfer: Transfer, ok: bool) -> None:
        """A push write finished: free the lease when every write is done, or on failure."""
        rid = transfer.meta.get("lease")
        if rid is None:
            return
        lease = self._leases.get(rid)
        if lease is None:
            return
        if not ok:
            peer = transfer.meta.get("push_peer")
            if peer is not None and lease.target is not None:
                failed = wire.Notice(
                    kind=wire.NoticeKind.FAILED,
                    request_id=lease.target.request_id,
                    engine_id=self.config.engine_id,
                    incarnation=self.incarnation,
                )
                try:
                    self.backend.notify(peer.handle, self._encode(failed))
                except KvxferError as exc:
                    log.debug("could not tell the consumer about the failed push: %s", exc)
            del self._leases[rid]
            self._freed.append(rid)
            return
        if lease.final_posted and all(w.state is TransferState.DONE for w in lease.writes):
            del self._leases[rid]
            self.stats_counters.leases_released += 1
            self._freed.append(rid)
